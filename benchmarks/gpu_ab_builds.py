"""Two (or more) builds of one 7B-block variant on the GPU, e.g. this checkout's against main's: the CUDA-graph
artifact of each timed at n = 1 in turns (and at the other n), each checked against torch, with the bandwidth
floor; then, per build, each kernel of its artifact without graphs at n = 1 (torch-free VM instrument).

Build each in its own checkout first (`gpu_job.py build --art DIR --only VARIANT,VARIANT-without-graph`), then,
with any one of them installed (the artifacts need only the TVM runtime):

    python3 benchmarks/gpu_ab_builds.py --build main=/tmp/base --build gpu=/tmp/mine --out $OUT/ab

`--build LABEL=DIR:VARIANT` times that build's VARIANT instead of --variant (e.g. one built without a feature), and
profiles no kernels of it. `--env LABEL:VAR=VALUE` sets an environment variable while that build's calls run and its
kernels are profiled (e.g. `--build pf=DIR --env pf:RELAXTUNE_GEMV_L2_PREFETCH=6144`: one artifact, two launch
configurations). `--q4`: the q4f16 block (its floor is that of its 4-bit bytes), e.g. `--variant
llama7b-q4-rf-cublas-flash-graph --plain llama7b-q4-rf-cublas-flash --build i8=DIR --build
f16act=DIR:llama7b-q4-f16act-rf-cublas-flash-graph`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
from pathlib import Path

import gpu_job_common as common
from gpu_job_common import OUT_DIR, RESULTS, copy_bandwidth, environment, log, rel_err, save, section, time_ms
from gpu_job_llama import Llama7B, floor_ms, kernel_times
from gpu_job_variants import LLAMA7B, LLAMA7B_BF16, Q4_GROUP

from relaxtune.config import QuantizeConfig


def _load(model: Llama7B, art: Path, name: str):
    model.art = art
    return model.vm(name)


def _where(build: str, variant: str) -> tuple[Path, str]:
    """(artifact folder, variant) of a --build value DIR or DIR:VARIANT."""
    folder, _, name = build.partition(":")
    return Path(folder), name or variant


ENV: dict[str, dict[str, str]] = {}  # label -> environment variables set while its builds' calls run


@contextlib.contextmanager
def _env(label: str):
    """The label's --env variables set: around every call of its build, not only the first, which captures the
    graphs: the kernels' host code reads them per launch, and a bucket with no graph (n = 1: every kernel reads x)
    launches its kernels at every call."""
    saved = {k: os.environ.get(k) for k in ENV.get(label, {})}
    os.environ.update(ENV.get(label, {}))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@section("builds at every n, CUDA graphs, in turns")
def latency_ab(model: Llama7B, builds: dict, variant: str, rounds: int) -> None:
    calls = {}
    for label, build in builds.items():
        vm, params, dev = _load(model, *_where(build, variant))
        for n in common.SEQS:
            x = model.tvm_args(n, dev)
            with _env(label):
                err = rel_err(vm["main"](x, *params).numpy(), model.ref[n].float().cpu().numpy())
            calls[(label, n)] = (vm["main"], params, dev, x, err)
    samples = {key: [] for key in calls}
    for n in common.SEQS:
        for _ in range(rounds):
            for label in builds:
                main, params, dev, x, _err = calls[(label, n)]
                with _env(label):
                    samples[(label, n)].append(time_ms(lambda: main(x, *params), dev.sync, min_seconds=0.1, batches=3))
    device = {}  # the GPU's own time per call, the host queueing ahead of it (common.device_ms)
    for (label, n), (main, params, _dev, x, _err) in calls.items():
        with _env(label):
            device[(label, n)] = common.device_ms(lambda: main(x, *params))
    floor = floor_ms(model)
    table: dict = {"floor_n1_ms": round(floor, 4) if floor else None, "variant": variant}
    for (label, n), (_m, _p, _d, _x, err) in calls.items():
        ms = statistics.median(samples[(label, n)])
        row = {"ms": round(ms, 4), "rounds": [round(v, 4) for v in samples[(label, n)]], "rel_err_vs_torch": err}
        dev_ms = device[(label, n)]
        row.update({f"device_{k}": round(v, 4) if isinstance(v, float) else v for k, v in dev_ms.items()})
        if n == 1 and floor:
            row["over_floor"] = round(ms / floor, 3)
            row["device_over_floor"] = round(dev_ms["gpu_ms"] / floor, 3)
        table[f"{label} n={n}"] = row
        log(
            f"{label} n={n}: {ms * 1e3:.1f} us, {row.get('over_floor', '')} x floor, rel err vs torch {err:.2e}; "
            f"the GPU alone {dev_ms['gpu_ms'] * 1e3:.1f} us ({row.get('device_over_floor', '')} x floor), "
            f"the host {dev_ms['host_ms'] * 1e3:.1f} us per call{'' if dev_ms['ahead'] else ' (not ahead)'}"
        )
    RESULTS["ab_latency"] = table


@section("builds per kernel, n = 1, no graphs")
def kernels_ab(model: Llama7B, builds: dict, variant: str) -> None:
    table = RESULTS.setdefault("ab_kernels", {})
    for label, build in builds.items():
        if ":" in build or not (Path(build) / f"{variant}.so").exists():
            continue
        vm, params, dev = _load(model, Path(build), variant)
        x = model.tvm_args(1, dev)
        with _env(label):
            vm["main"](x, *params)
            rows = kernel_times(vm, [x, *params], dev.sync, budget_s=0.05)
        table[label] = rows
        log(f"{label}: {sum(r['us'] for r in rows):.1f} us in {len(rows)} kernels")
        for r in rows:
            log(f"   {r['us']:8.2f} us  {r['kernel']}  {[s for _dt, s in r['shapes']]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="append", required=True, help="LABEL=ART_DIR, twice or more")
    parser.add_argument("--env", action="append", default=[], help="LABEL:VAR=VALUE for that build's launches")
    parser.add_argument("--variant", default="llama7b-rf-cublas-flash-graph", help="the artifact timed with graphs")
    parser.add_argument("--plain", default="llama7b-rf-cublas-flash", help="the artifact profiled per kernel")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--q4", action="store_true", help="the q4f16 block (gpu_job_variants.Q4_VARIANTS' weights)")
    parser.add_argument("--seqs", default="1,128,2048")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    builds = dict(b.split("=", 1) for b in args.build)
    for spec in args.env:
        label, _, assignment = spec.partition(":")
        var, _, value = assignment.partition("=")
        if label not in builds or not var:
            parser.error(f"--env {spec!r}: expected LABEL:VAR=VALUE with LABEL one of {sorted(builds)}")
        ENV.setdefault(label, {})[var] = value
    common.SEQS = tuple(int(n) for n in args.seqs.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    OUT_DIR.append(args.out)
    environment()
    copy_bandwidth()
    quantize = QuantizeConfig("q4f16", Q4_GROUP) if args.q4 else None
    config = LLAMA7B if args.dtype == "float16" else LLAMA7B_BF16
    model = section("llama-7B setup")(Llama7B)(None, None, config, quantize)
    if model is None:
        return
    latency_ab(model, builds, args.variant, args.rounds)
    if any((Path(b) / f"{args.plain}.so").exists() for b in builds.values() if ":" not in b):
        kernels_ab(model, builds, args.plain)
    save()


if __name__ == "__main__":
    main()
