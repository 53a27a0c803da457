"""Stock fusion vs relaxtune fusion, rule-based schedules only (no cache), interleaved A/B.

    python scripts/fusion_ab.py llama-block --shape n=1,128,512 [--rounds 15] [--config ...]

Both executables are built in this process; per shape, each round times a few calls of A, then of
B, so load on the machine hits both alike. Prints medians over rounds and the ratio B/A.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import tvm
from tvm import relax

from relaxtune import api, targets
from relaxtune.artifact import prepare_params
from relaxtune.cli.common import parse_shapes
from relaxtune.config import CompileConfig, JobConfig
from relaxtune.workloads import load, parse_config


def runner(workload, target, fusion: str):
    job = JobConfig(compile=CompileConfig(use_cache=False, fusion=fusion))
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
    args = parser.parse_args()
    workload = load(args.workload, parse_config(args.config))
    target = targets.resolve("cpu")
    systems = {fusion: runner(workload, target, fusion) for fusion in ("stock", "relaxtune")}
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
        print(f"| {n} | {med['stock']:.3f} | {med['relaxtune']:.3f} | {med['relaxtune'] / med['stock']:.2f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
