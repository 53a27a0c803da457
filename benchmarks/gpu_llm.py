"""A SmolLM2-sized language model on the GPU: relaxtune's cuda build (paged KV cache) against transformers.

    bash benchmarks/gpu_llm.sh OUT                       # on the GPU machine: TVM from .device, then this script
    python benchmarks/gpu_llm.py --out OUT               # the same, TVM and relaxtune already importable
    python benchmarks/gpu_llm.py --out OUT --device cpu --model tiny --modes eager   # every step on a CPU

The GPU machine cannot receive the 93 MB GGUF, so the model is made there: (1) a checkpoint folder with
random weights of the model's sizes, seeded (config.json + model.safetensors, float16 on cuda, float32 on
the CPU), which `relaxtune compile hf:DIR` builds and transformers loads: the same weights for both;
(2) relaxtune's artifact built there, with CUDA graphs and without (`--graphs`); (3) greedy tokens and
teacher-forced next-token logits of relaxtune against transformers in the same float type and in float32;
(4) interleaved rounds: prefill tokens/s at `--prefill` prompt lengths and decode tokens/s after
`--decode` context lengths (`--steps` tokens fed one at a time, no sampling), each system sampled once per
figure per round, medians; each decode step against its bandwidth floor (the weights' bytes over the
measured device copy bandwidth); (5) gpu_llm.json and gpu_llm.md in --out, written after every stage.
transformers runs eager, under torch.compile (default) and under torch.compile mode="reduce-overhead" with a
static cache (`--modes`); a mode this transformers cannot run is skipped with one line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
from gpu_llm_report import markdown
from gpu_llm_systems import MODES, Relaxtune, Transformers, agreement, first_difference

from relaxtune.models import random_checkpoint

MODELS = {"smollm2": random_checkpoint.SMOLLM2, "tiny": random_checkpoint.TINY}
FIRST_ID = 100
RESULTS: dict = {"stages": {}, "errors": {}}


def log(*args) -> None:
    print(*args, flush=True)


def save(out: Path) -> None:
    (out / "gpu_llm.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    (out / "gpu_llm.md").write_text(markdown(RESULTS))


def stage(name: str, out: Path, fn, *args):
    """Run one stage; its failure is recorded (the later stages go on where they can) and the results saved."""
    start = time.perf_counter()
    log(f"\n=== {name}")
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 (one broken stage must not cost the device call)
        RESULTS["errors"][name] = traceback.format_exc()[-3000:]
        log(RESULTS["errors"][name])
        return None
    finally:
        RESULTS["stages"][name] = round(time.perf_counter() - start, 1)
        save(out)


def build(folder: Path, art: Path, device: str, graphs: bool, tops: tuple[int, ...]) -> Path:
    """relaxtune's artifact of the checkpoint (rules only, buckets at `tops`), as `relaxtune compile` makes it."""
    from relaxtune import api, targets
    from relaxtune.config import BucketConfig, CompileConfig, JobConfig
    from relaxtune.workloads import load

    target = targets.resolve(cuda_target() if device == "cuda" else "cpu")
    workload = load(f"hf:{folder}", {"max_prefill": str(tops[-1])}, target=target)
    job = JobConfig(
        cache_dir=art / "no-cache",
        compile=CompileConfig(use_cache=False, cuda_graphs=graphs),
        buckets=BucketConfig(edges={"n": tops}),
    )
    name = f"model-{'graphs' if graphs else 'nographs'}.so"
    start = time.perf_counter()
    result = api.compile(workload, target, job, art / name)
    RESULTS.setdefault("build_s", {})[name] = round(time.perf_counter() - start, 1)
    log(f"built {result.path} in {time.perf_counter() - start:.0f} s")
    return result.path


def cuda_target() -> str:
    import torch

    return "cuda:sm_{}{}".format(*torch.cuda.get_device_capability())


def copy_bandwidth(device: str) -> float:
    """Bytes read + written per second by a copy (1 GiB on the GPU, 256 MB on the CPU), best of 5, GB/s."""
    if device == "cuda":
        import torch

        src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)

        def copy():
            dst.copy_(src)
            torch.cuda.synchronize()
    else:
        src = np.ones(64 * 2**20, np.float32)
        dst = np.empty_like(src)

        def copy():
            np.copyto(dst, src)

    copy()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        copy()
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best / 1e9


def environment(device: str) -> dict:
    import platform

    info = {"python": platform.python_version(), "device": device}
    for name in ("torch", "transformers", "tvm"):
        try:
            info[name] = __import__(name).__version__
        except Exception as err:  # noqa: BLE001
            info[name] = f"missing ({type(err).__name__})"
    if device == "cuda":
        import torch

        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def prompt(length: int, vocab: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(FIRST_ID, vocab - 1, length).tolist()


def check_tokens(systems: dict, reference, vocab: int, length: int = 32, steps: int = 32) -> None:
    """Greedy continuations against transformers eager; teacher-forced next-token logits of every system,
    with random tokens fed after the prompt (a random model's greedy continuation soon repeats a few tokens),
    against transformers in float32 and, for relaxtune, against transformers in its own float type."""
    ids = prompt(length, vocab, 1)
    base = systems["transformers eager"].greedy(ids, steps)
    out = {"prompt_tokens": length, "new_tokens": steps, "distinct_new_tokens": len(set(base))}
    for name, system in systems.items():
        if name.startswith("relaxtune"):
            tokens = system.greedy(ids, steps)
            out[name] = {"greedy_same_prefix": first_difference(tokens, base)}
    sequence = ids + prompt(steps, vocab, 2)
    want = reference.logits(sequence, length) if reference is not None else None
    same_type = systems["transformers eager"].logits(sequence, length)
    for name, system in systems.items():
        if not name.startswith("relaxtune") and name != "transformers eager":
            continue
        if name == "transformers eager" and want is None:
            continue  # it is the reference
        got = same_type if name == "transformers eager" else system.logits(sequence, length)
        row = out.setdefault(name, {})
        if want is not None:
            row["vs_float32"] = agreement(got, want)
        if name != "transformers eager":
            row["vs_transformers_same_dtype"] = agreement(got, same_type)
    RESULTS["agreement"] = out
    log(json.dumps(out, indent=1))


def measure(systems: dict, args, vocab: int) -> None:
    """Each figure of each system once per round, systems in turns; the first call of each is a warm-up."""
    figures = [("prefill", n) for n in args.prefill] + [("decode", c) for c in args.decode]
    samples = {name: {"prefill": {}, "decode": {}} for name in systems}
    tokens = prompt(args.steps, vocab, 7)
    failed: dict = {}  # (system, op, size) -> its error, said once
    for round_ in range(args.rounds + 1):  # round 0: warm-up (torch.compile compiles there)
        for op, size in figures:
            ids = prompt(size, vocab, size)
            for name, system in systems.items():
                if (name, op, size) in failed:
                    continue
                try:
                    seconds = system.prefill(ids) if op == "prefill" else system.decode(ids, tokens)
                except Exception as err:  # noqa: BLE001 (a mode that fails at one size loses that figure only)
                    failed[(name, op, size)] = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"
                    log(f"{name} {op} {size}: skipped, {failed[(name, op, size)]}")
                    continue
                if round_:
                    rate = size / seconds if op == "prefill" else args.steps / seconds
                    samples[name][op].setdefault(str(size), []).append(rate)
        log(f"round {round_} of {args.rounds} done" + (" (warm-up)" if not round_ else ""))
    RESULTS["samples"], RESULTS["skipped"] = samples, {" ".join(map(str, k)): v for k, v in failed.items()}
    RESULTS["medians"] = {
        name: {op: {k: round(statistics.median(v), 2) for k, v in figs.items()} for op, figs in per.items()}
        for name, per in samples.items()
    }


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where gpu_llm.json and gpu_llm.md go")
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu_llm"), help="checkpoint and artifacts")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--model", choices=tuple(MODELS), default="smollm2")
    parser.add_argument("--modes", default=",".join(MODES), help=f"transformers modes: {', '.join(MODES)}")
    parser.add_argument("--graphs", default="on,off", help="relaxtune builds: with CUDA graphs (on), without (off)")
    parser.add_argument("--prefill", default="128,512", help="prompt lengths")
    parser.add_argument("--decode", default="128,1024", help="context lengths before the timed decode steps")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per sample")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    args.prefill = [int(v) for v in args.prefill.split(",")]
    args.decode = [int(v) for v in args.decode.split(",")]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.graphs = [g.strip() == "on" for g in args.graphs.split(",") if g.strip()]
    bad = [m for m in args.modes if m not in MODES]
    if bad or "eager" not in args.modes:
        parser.error(f"--modes {','.join(args.modes)}: give eager and any of {', '.join(MODES[1:])}")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    config, dtype = MODELS[args.model], "float16" if args.device == "cuda" else "float32"
    capacity = max(args.prefill + [c + args.steps for c in args.decode]) + 64
    tops = tuple(sorted({1, 16, *args.prefill, *args.decode}))
    RESULTS.update(model=args.model, config=config, dtype=dtype, environment=environment(args.device))
    folder = args.work / f"{args.model}-{dtype}"
    RESULTS["weight_bytes"] = stage("checkpoint", args.out, random_checkpoint.write, folder, config, dtype)
    RESULTS["copy_GBps"] = round(copy_bandwidth(args.device), 1)
    systems = {}
    for graphs in args.graphs if args.device == "cuda" else args.graphs[:1]:  # graphs are cuda's
        name = "relaxtune" + ("" if args.device == "cpu" else " graphs" if graphs else " no graphs")
        built = stage(f"build {name}", args.out, build, folder, args.work, args.device, graphs, tops)
        if built is not None:
            systems[name] = stage(f"load {name}", args.out, Relaxtune, built, args.device, capacity)
    for mode in args.modes:
        name = "transformers eager" if mode == "eager" else f"torch.compile {mode}"
        systems[name] = stage(f"load {name}", args.out, Transformers, folder, args.device, dtype, mode, capacity)
    systems = {k: v for k, v in systems.items() if v is not None}
    if "transformers eager" not in systems:
        log("transformers eager did not load: nothing to compare with")
        return 1
    reference = None
    if dtype != "float32":
        reference = stage("load float32 reference", args.out, Transformers, folder, args.device, "float32", "eager", 0)
    stage("tokens", args.out, check_tokens, systems, reference, config["vocab_size"])
    del reference
    stage("timings", args.out, measure, systems, args, config["vocab_size"])
    log(markdown(RESULTS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
