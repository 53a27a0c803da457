"""Tuned vs rules-only builds of the default workloads, cross-compiled here, run on the GPU machine.

    python benchmarks/cache_ab.py build --art DIR [--cache tuning_logs] [--workloads mlp,...] [--shapes 1,4,16]   #
    here (nvcc)
    python3 benchmarks/cache_ab.py run --art DIR --out OUT                                   # GPU machine

`build` compiles each workload twice for cuda as `relaxtune compile W --target cuda` does (default
config, the buckets the cache was tuned at): with the committed cache (`W.so`) and rules only at
the same buckets (`W-rules.so`, as `--no-cache`); it records which kernels use records (`schedules` in each manifest)
and, per shape
n of `SHAPES`, random inputs and the float32 torch reference output (`W-n<N>.npz`). `run` loads
every artifact with the TVM runtime only (TVM_USE_RUNTIME_LIB=1: no compiler library, and a
CUDA C compile callback that fails: the `.so` files must carry compiled device code), checks each
output against the reference, and times tuned vs rules side by side, interleaved (`bench.interleaved`),
at each n: the cache's tuning points 1, 16, 128, 1024 and values inside their buckets.
Writes `cache_ab.json` and `cache_ab.md` to --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger("cache_ab")

WORKLOADS = ("llama-block", "gpt2-block", "mlp")
SHAPES = (1, 4, 16, 64, 128, 512, 1024)  # tuning points of the committed cache: 1, 16, 128, 1024
ROUNDS = 7
TOLERANCE = 1e-3  # relative max error, float32 (what `relaxtune run` accepts)


def build(art: Path, cache: Path, names: list[str], shapes: tuple[int, ...] = SHAPES, cuda_graphs: bool = True) -> None:
    import numpy as np

    from relaxtune import api, targets, workloads
    from relaxtune.config import CompileConfig, JobConfig

    target = targets.resolve("cuda")
    art.mkdir(parents=True, exist_ok=True)
    for name in names:
        workload = workloads.load(name, {}, None)
        tuned = api.tuned_buckets(workload, target, JobConfig(cache_dir=cache))  # as `relaxtune compile` picks them
        for suffix, use_cache in (("", True), ("-rules", False)):
            job = JobConfig(cache_dir=cache, compile=CompileConfig(use_cache=use_cache, cuda_graphs=cuda_graphs))
            job = job.with_(buckets=tuned) if tuned is not None else job
            result = api.compile(workload, target, job, art / f"{name}{suffix}.so")
            logger.info("%s%s: %.0f s; kernel calls: %s", name, suffix, result.seconds, dict(result.schedules))
        for n in shapes:
            inputs = workload.random_inputs({"n": n, "b": 1})
            expected = workload.reference(inputs, workload.params)
            np.savez(art / f"{name}-n{n}.npz", expected=expected, **inputs)


def run(art: Path, out: Path, names: list[str]) -> None:
    import numpy as np
    import tvm
    import tvm_ffi

    from relaxtune.measure.bench import interleaved
    from relaxtune.runtime.artifact import Artifact

    def no_jit(*_args):  # a fatbin artifact never calls it; CUDA C source would
        raise SystemExit("CUDA C source compiled at load: the artifact carries no device code")

    tvm_ffi.register_global_func("tvm_callback_cuda_compile", no_jit, override=True)
    report = {"runtime_only": bool(getattr(tvm.base, "_RUNTIME_ONLY", False)), "workloads": {}}
    rows = [
        "| workload | n | tuned ms | rules ms | tuned/rules | error tuned | error rules |",
        "|---|---|---|---|---|---|---|",
    ]
    ok = True
    for name in names:
        arts = {"tuned": Artifact.load(art / f"{name}.so"), "rules": Artifact.load(art / f"{name}-rules.so")}
        entry = {"schedules": arts["tuned"].manifest["schedules"], "shapes": {}}
        for n in sorted(int(p.name[len(name) + 2 : -4]) for p in art.glob(f"{name}-n*.npz")):  # the shapes build wrote
            data = dict(np.load(art / f"{name}-n{n}.npz"))
            expected = data.pop("expected")
            errors = {}
            for kind, a in arts.items():
                got = a(data).astype("float64")
                errors[kind] = float(np.max(np.abs(got - expected)) / max(1.0, float(np.max(np.abs(expected)))))
            calls = {kind: a.caller(data) for kind, a in arts.items()}
            ms = interleaved(calls, ROUNDS)
            ok = ok and all(e <= TOLERANCE for e in errors.values())
            entry["shapes"][n] = {
                "tuned_ms": ms["tuned"],
                "rules_ms": ms["rules"],
                "ratio": ms["tuned"] / ms["rules"],
                "errors": errors,
            }
            rows.append(
                f"| {name} | {n} | {ms['tuned']:.4f} | {ms['rules']:.4f} | {ms['tuned'] / ms['rules']:.2f} | "
                f"{errors['tuned']:.1e} | {errors['rules']:.1e} |"
            )
            logger.info(rows[-1])
        report["workloads"][name] = entry
    report["all_within_tolerance"] = ok
    out.mkdir(parents=True, exist_ok=True)
    (out / "cache_ab.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "cache_ab.md").write_text(
        f"runtime only: {report['runtime_only']}; every output within {TOLERANCE:g} of torch: {ok}\n\n"
        + "\n".join(rows)
        + "\n"
    )
    if not ok:
        raise SystemExit("an output differs from the torch reference")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("build", "run"))
    parser.add_argument("--art", type=Path, required=True, help="folder of the artifacts and their inputs")
    parser.add_argument(
        "--cache", type=Path, default=Path("tuning_logs"), help="build: the tuning cache (default tuning_logs/)"
    )
    parser.add_argument("--out", type=Path, default=Path("."), help="run: where cache_ab.json / .md go")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument(
        "--shapes",
        default=",".join(map(str, SHAPES)),
        help="build: the values of n to check and time (run: those built)",
    )
    parser.add_argument("--no-cuda-graphs", action="store_true", help="build: without CUDA graphs in the small buckets")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)
    names = [n for n in args.workloads.split(",") if n]
    if args.step == "build":
        try:
            shapes = tuple(int(v) for v in args.shapes.split(",") if v.strip())
        except ValueError:
            raise SystemExit(
                f"--shapes {args.shapes!r}: expected comma-separated positive integers (e.g. 1,4,16)"
            ) from None
        build(args.art, args.cache, names, shapes, cuda_graphs=not args.no_cuda_graphs)
    else:
        if os.environ.get("TVM_USE_RUNTIME_LIB") != "1":
            logger.warning("TVM_USE_RUNTIME_LIB=1 is not set: the compiler library may be loaded")
        run(args.art, args.out, names)


if __name__ == "__main__":
    main()
