"""Stock fusion vs relaxtune fusion, interleaved A/B: rule-based schedules, or after tuning each.

    python benchmarks/fusion_ab.py llama-block --shape n=1,128,512 [--rounds 15] [--config ...]
    python benchmarks/fusion_ab.py llama-block --trials 64 --cache-dir build/fusion_ab   # tuned A/B

With ``--trials N`` each fusion is first tuned with the same budget of N trials into its own
cache (``CACHE_DIR/stock``, ``CACHE_DIR/relaxtune``, default buckets), then built with it.

Both executables are built in this process; per shape, each round times a few calls of A, then of
B, so load on the machine hits both alike. Prints medians over rounds and the ratio B/A.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from relaxtune.schedules import intrin

intrin.register_for("llvm")  # before anything imports MetaSchedule

import numpy as np  # noqa: E402
import tvm  # noqa: E402
from tvm import relax  # noqa: E402

from relaxtune import api, targets  # noqa: E402
from relaxtune.cli.common import parse_shapes  # noqa: E402
from relaxtune.config import CompileConfig, JobConfig, TuneConfig  # noqa: E402
from relaxtune.runtime.artifact import prepare_params  # noqa: E402
from relaxtune.workloads import load, parse_config  # noqa: E402


def runner(workload, target, fusion: str, trials: int = 0, cache_dir: Path | None = None):
    job = JobConfig(compile=CompileConfig(use_cache=False, fusion=fusion))
    if trials:
        job = JobConfig(
            cache_dir=cache_dir / fusion, tune=TuneConfig(trials=trials), compile=CompileConfig(fusion=fusion)
        )
        job.cache_dir.mkdir(parents=True, exist_ok=True)
        result = api.tune(workload, target, job, progress=False)
        print(
            f"{fusion}: {result.trials_run} trials run ({result.trials_cached} cached) over {len(result.tasks)} tasks "
            f"in {result.wall_s:.0f} s",
            flush=True,
        )
    vm = relax.VirtualMachine(api.build(workload, target, job)[0], tvm.cpu())
    params = prepare_params(vm, [tvm.runtime.tensor(v) for v in workload.params.values()])

    def make(inputs):
        args = [tvm.runtime.tensor(inputs[t.name]) for t in workload.inputs] + list(params)
        return lambda: vm["main"](*args)

    return make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload")
    parser.add_argument("--config", default="")
    parser.add_argument("--shape", action="append", default=["n=1,128,512"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=3, help="calls per system per round (the median of them is kept)")
    parser.add_argument("--trials", type=int, default=0, help="tune each fusion with this budget first (0: rules only)")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path("build/fusion_ab"),
        help="with --trials: CACHE_DIR/stock and CACHE_DIR/relaxtune",
    )
    args = parser.parse_args()
    workload = load(args.workload, parse_config(args.config))
    target = targets.resolve("cpu")
    systems = {
        fusion: runner(workload, target, fusion, args.trials, args.cache_dir) for fusion in ("stock", "relaxtune")
    }
    shapes = parse_shapes(args.shape[-1:], many=True)
    print(f"| {workload.name} n | stock ms | relaxtune ms | relaxtune / stock | max abs diff |")
    print("|---|---|---|---|---|")
    for n in shapes["n"]:
        inputs = workload.random_inputs({"b": 1, "n": n})
        calls = {name: make(inputs) for name, make in systems.items()}
        outs = {name: call().numpy() for name, call in calls.items()}
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                samples = []
                for _ in range(args.calls):
                    start = time.perf_counter()
                    call()
                    samples.append((time.perf_counter() - start) * 1e3)
                times[name].append(statistics.median(samples))
        med = {name: statistics.median(t) for name, t in times.items()}
        diff = float(np.abs(outs["stock"] - outs["relaxtune"]).max())
        print(
            f"| {n} | {med['stock']:.3f} | {med['relaxtune']:.3f} | {med['relaxtune'] / med['stock']:.2f} | {diff:.1e} "
            "|",
            flush=True,
        )


if __name__ == "__main__":
    main()
