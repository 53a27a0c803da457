"""Per-kernel times of one workload, stock fusion vs relaxtune fusion, built as fusion_ab builds them.

    python benchmarks/kernel_profile.py gpt2-block --cache-dir DIR --shape n=1,128 [--json PATH]

With ``--cache-dir`` each fusion is built with ``DIR/stock`` / ``DIR/relaxtune`` (the caches
`fusion_ab.py --trials N --cache-dir DIR` tuned, and their bucket verdicts); without it, rules only.
One `main` call per shape runs under a VM instrument that re-runs every kernel call on its own
arguments (after one warm-up call of it) for about ``--budget-ms`` and keeps the mean. The two
fusions are profiled alternately, ``--rounds`` times, and each kernel's median over rounds is
printed, largest first, with the sum of kernel times and the whole call's median next to it (the
difference is the VM's own cost: its instructions, allocations and kernel-call overhead).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import tvm
from tvm import relax

from relaxtune import api, targets
from relaxtune.cli.common import parse_shapes
from relaxtune.config import CompileConfig, JobConfig
from relaxtune.runtime.artifact import prepare_params
from relaxtune.workloads import load, parse_config

FUSIONS = ("stock", "relaxtune")


def kernel_times(vm, args, budget_s: float) -> dict[str, float]:
    """us per call of each kernel of one `main` call (a kernel called k times: k entries, #i suffixed)."""
    times: dict[str, float] = {}
    state = {"on": True}

    def instrument(func, symbol, before, _ret, *call_args):
        if before or not state["on"] or symbol.startswith(("vm.", "main")):
            return 0
        func(*call_args)
        t0 = time.perf_counter()
        func(*call_args)
        reps = max(3, min(2000, int(budget_s / max(time.perf_counter() - t0, 1e-7))))
        t0 = time.perf_counter()
        for _ in range(reps):
            func(*call_args)
        key, i = symbol, 1
        while key in times:
            i += 1
            key = f"{symbol}#{i}"
        times[key] = (time.perf_counter() - t0) / reps * 1e6
        return 0

    vm.set_instrument(instrument)
    try:
        vm["main"](*args)
    finally:
        state["on"] = False  # stays installed, inert (the VM takes no None)
    return times


def call_ms(vm, args, repeats: int = 50) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        vm["main"](*args)
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload")
    parser.add_argument("--config", default="")
    parser.add_argument("--shape", action="append", default=["n=1,128"])
    parser.add_argument(
        "--cache-dir", type=Path, help="DIR/stock and DIR/relaxtune, as fusion_ab.py --trials tuned them"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--budget-ms", type=float, default=20.0, help="time spent re-running each kernel call per round"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    workload = load(args.workload, parse_config(args.config))
    target = targets.resolve("cpu")
    vms = {}
    for fusion in FUSIONS:
        if args.cache_dir:
            job = JobConfig(cache_dir=args.cache_dir / fusion, compile=CompileConfig(fusion=fusion))
        else:
            job = JobConfig(compile=CompileConfig(use_cache=False, fusion=fusion))
        executable = api.build(workload, target, job)[0]
        # two VMs: the instrument, once set, stays (a Python callback per kernel call), so whole calls get their own
        vm, plain = (relax.VirtualMachine(executable, tvm.cpu()) for _ in range(2))
        vms[fusion] = (vm, plain, prepare_params(vm, [tvm.runtime.tensor(v) for v in workload.params.values()]))
    report = []
    for n in parse_shapes(args.shape[-1:], many=True)["n"]:
        inputs = workload.random_inputs({"b": 1, "n": n})
        per: dict[str, dict[str, list[float]]] = {f: defaultdict(list) for f in FUSIONS}
        whole: dict[str, list[float]] = {f: [] for f in FUSIONS}
        for _ in range(args.rounds):
            for fusion, (vm, plain, params) in vms.items():
                call = [tvm.runtime.tensor(inputs[t.name]) for t in workload.inputs] + list(params)
                for name, us in kernel_times(vm, call, args.budget_ms / 1e3).items():
                    per[fusion][name].append(us)
                whole[fusion].append(call_ms(plain, call))
        for fusion in FUSIONS:
            kernels = {k: statistics.median(v) for k, v in per[fusion].items()}
            total, call = sum(kernels.values()), statistics.median(whole[fusion])
            print(
                f"\n== {workload.name} n={n} {fusion}: {len(kernels)} kernel calls, {total:.1f} us in kernels, whole "
                f"call {call * 1e3:.1f} us"
            )
            for k, us in sorted(kernels.items(), key=lambda kv: -kv[1]):
                print(f"  {us:9.1f}  {k}")
            report.append(
                {"n": n, "fusion": fusion, "kernels_us": kernels, "kernel_sum_us": total, "call_us": call * 1e3}
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
