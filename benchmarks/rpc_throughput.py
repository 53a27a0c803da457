"""Trials per minute of one tuning job measured on one versus two local RPC servers, in one run.

Starts a TVM RPC tracker and three servers on 127.0.0.1 (two under key `pair`, one under key
`solo`), runs the same job (same workload, budget and seed) into a fresh temporary cache once per
key, prints both rates, the ratio and where each job's time went (MetaSchedule's profiler), and
stops every process it started. Usage:

    python benchmarks/rpc_throughput.py [--workload mlp] [--config ...] [--trials 32] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

from relaxtune.schedules import intrin

intrin.register_for("llvm")  # before MetaSchedule is imported

from relaxtune import api, targets  # noqa: E402
from relaxtune.config import JobConfig, TuneConfig  # noqa: E402
from relaxtune.schedules.rpc import LocalCluster  # noqa: E402
from relaxtune.workloads import load, parse_config  # noqa: E402

KEYS = {"pair": 2, "solo": 1}  # the two-server job first: a warm-up advantage would go to the one-server job
# MetaSchedule profiler scopes: the synchronous build, the wait for measurements (the runner works
# while the next task is searched and built), cost-model updates, and search.
PHASES = ("SendToBuilder", "JoinRunnerFutures", "MeasureCallback/UpdateCostModel", "EvoSearch/")


def one_job(workload, target, address: str, key: str, args) -> dict:
    from tvm.s_tir import meta_schedule as ms

    with tempfile.TemporaryDirectory(prefix=f"rpc-{key}-") as cache:
        tune = TuneConfig(trials=args.trials, trials_per_iter=args.trials_per_iter, rpc_tracker=address, device_key=key)
        with ms.Profiler() as profiler:
            result = api.tune(workload, target, JobConfig(cache_dir=Path(cache), tune=tune), progress=False)
        phases = {str(name): float(secs) for name, secs in profiler.get().items() if str(name).startswith(PHASES)}
    return {
        "servers": KEYS[key],
        "trials_run": result.trials_run,
        "failed": result.failed,
        "wall_s": result.wall_s,  # the whole job: task preparation and the tuning loop
        "trials_per_min": 60.0 * result.trials_run / result.wall_s if result.wall_s else 0.0,
        "build_s": phases.get("SendToBuilder", 0.0),
        "wait_for_measure_s": phases.get("JoinRunnerFutures", 0.0),
        "cost_model_s": phases.get("MeasureCallback/UpdateCostModel", 0.0),
        # top-level search scopes (EvoSearch/Evolve/Misc/... is nested in EvoSearch/Evolve/Misc)
        "search_s": sum(v for k, v in phases.items() if k.startswith("EvoSearch/") and k.count("/") <= 2),
        "phases_s": phases,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="mlp")
    parser.add_argument("--config", default="hidden=64,ffn=128,max_seq=64,max_batch=2")
    parser.add_argument("--trials", type=int, default=32)
    parser.add_argument("--trials-per-iter", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    for noisy in ("tvm", "tvm.s_tir.meta_schedule"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    workload = load(args.workload, parse_config(args.config))
    target = targets.resolve("cpu")
    with LocalCluster(KEYS) as cluster:
        print(f"tracker {cluster.address}; servers: {KEYS}; target {target.json}", flush=True)
        by_key = {key: one_job(workload, target, cluster.address, key, args) for key in KEYS}
    runs = [by_key["solo"], by_key["pair"]]

    def ratio(field: str) -> float:
        return runs[1][field] / runs[0][field] if runs[0][field] else float("nan")

    print(f"\n{args.workload} ({args.config}), {args.trials} trials, {args.trials_per_iter} per batch\n")
    print(
        "| servers | trials | failed | job s | trials/min | search s | build s | cost model s | wait for measurements "
        "s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(
            f"| {r['servers']} | {r['trials_run']} | {r['failed']} | {r['wall_s']:.1f} | {r['trials_per_min']:.1f} "
            f"| {r['search_s']:.1f} | {r['build_s']:.1f} | {r['cost_model_s']:.1f} | {r['wait_for_measure_s']:.1f} |"
        )
    print(f"\nratio two/one servers (trials per minute): {ratio('trials_per_min'):.2f}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"runs": runs, "ratio": ratio("trials_per_min"), "args": vars(args) | {"json": str(args.json)}}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
