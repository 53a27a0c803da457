"""Tune several workloads for cuda in one process and one time limit (the GPU machine's tuning job).

    bash scripts/tune_gpu.sh CACHE_DIR            # sets up the package and runs this with its defaults
    python3 scripts/tune_gpu.py --cache DIR [--workloads llama-block,gpt2-block,mlp] [--minutes 6]
        [--buckets n=1,16,128,1024] [--trials 256] [--trials-per-iter 16] [--json OUT.json]

One process for every workload: TVM, its CUDA tensor intrinsics (~9 s here, a fresh import per
workload before) and the workload-independent set-up are paid once. The time left is split evenly
over the workloads still to tune, less what the last bucket check took (an estimate before the
first); each workload's search stops at its share (`TuneConfig.time_limit_s`, records kept), then
its bucket check runs. A workload's kernels already tuned by an earlier one (mlp's after
llama-block's) are not tuned again (`schedules/tune.py`), so its share goes to the next.

The defaults are "the default workloads": the three built-ins at their default configs (fp32,
hidden 256, max_seq 1024, batch 1-4), which `relaxtune compile W --target cuda` builds without
further flags, tuned at the shape buckets n = 1, 16, 128, 1024 (four of the default plan's eleven
power-of-two tops; `relaxtune compile` borrows a neighbouring tuning point's record for the
others, `schedules/apply.py`). Logs each phase with its seconds; --json writes them and per
workload the trials, failures, profile and bucket verdicts.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

logger = logging.getLogger("tune_gpu")

DEFAULT_WORKLOADS = ("llama-block", "gpt2-block", "mlp")  # mlp last: llama-block tunes its kernels
DEFAULT_BUCKETS = "n=1,16,128,1024"
CHECK_ESTIMATE_S = 30.0  # a bucket check's seconds before one is measured (two builds, NVRTC, timing)
# a batch's seconds before one is measured: 16 fp32 candidates of llama-block built in 9.4 s a batch
# on the H200 machine's 16 cores (nvcc; heavily unrolled candidates: 0.5 MB of CUDA C), ~12 s with
# the search and the runs (2026-11-30)
BATCH_ESTIMATE_S = 12.0
BUILD_TIMEOUT_S = 20.0  # a candidate whose compile takes longer fails rather than hold up its batch


def _share(deadline: float, left: int, check_s: float) -> float:
    """Seconds of search for the next of `left` workloads: an even split of the time left, less
    one bucket check; at least 1 s (a search stopped at once still measures its first round)."""
    return max(1.0, (deadline - time.perf_counter()) / left - check_s)


def _budget(trials: int, limit_s: float, batch_s: float, per_batch: int) -> int:
    """The trial budget that fits `limit_s` at `batch_s` a batch, at most `trials`, at least one
    batch. It is the budget that bounds a job's first round: MetaSchedule measures every task once
    before any result reaches the callback that enforces the time limit."""
    return max(per_batch, min(trials, int(limit_s / batch_s) * per_batch))


def tune_all(
    names: list[str],
    cache: Path,
    minutes: float,
    buckets: str,
    trials: int,
    dtype: str | None,
    target_spec: str = "cuda",
    config: str = "",
    compile_flags: dict | None = None,
    per_batch: int = 16,
) -> dict:
    """Tune `names` one after another into `cache`; returns the per-phase report."""
    start = time.perf_counter()
    deadline = start + minutes * 60
    report: dict = {"workloads": {}, "buckets": buckets, "trials": trials, "minutes": minutes}
    mark = time.perf_counter()
    from relaxtune import api, targets, workloads
    from relaxtune.config import TuneConfig
    from relaxtune.schedules import intrin

    target = targets.resolve(target_spec)
    report["import_s"] = round(time.perf_counter() - mark, 2)
    mark = time.perf_counter()
    intrin.register_for(target.target.kind.name)  # once for every workload
    report["intrinsics_s"] = round(time.perf_counter() - mark, 2)
    logger.info("imports %.1f s, %s tensor intrinsics %.1f s", report["import_s"], target.kind, report["intrinsics_s"])
    check_s, batch_s = CHECK_ESTIMATE_S, BATCH_ESTIMATE_S
    for i, name in enumerate(names):
        limit = _share(
            deadline - check_s * (len(names) - 1), len(names) - i, check_s
        )  # the checks again (`_recheck`) at the end
        budget = _budget(trials, limit, batch_s, per_batch)
        workload = workloads.load(name, workloads.parse_config(config), dtype)
        tune = TuneConfig(trials=budget, trials_per_iter=per_batch, time_limit_s=limit, build_timeout_s=BUILD_TIMEOUT_S)
        job = _job(cache, buckets, compile_flags).with_(tune=tune)
        mark = time.perf_counter()
        logger.info(
            "%s: search limit %.0f s (%.0f s left in all), budget %d trials (%.1f s a batch of %d)",
            name,
            limit,
            deadline - mark,
            budget,
            batch_s,
            per_batch,
        )
        try:
            result = api.tune(workload, target, job, progress=False)
        except Exception as err:  # noqa: BLE001 (one workload's failure must not cost the others their time)
            logger.exception("%s: tuning failed; its committed records are kept", name)
            report["workloads"][name] = {
                "error": f"{type(err).__name__}: {err}"[:500],
                "wall_s": round(time.perf_counter() - mark, 2),
            }
            continue
        wall = time.perf_counter() - mark
        if result.buckets:
            check_s = max(0.0, wall - result.wall_s)
        if result.trials_run >= per_batch:  # seconds a batch, set-up (rule timing, cost model load) excluded
            batch_s = (result.profile["wall_s"] - result.profile["setup_s"]) / (result.trials_run / per_batch)
        entry = {
            "wall_s": round(wall, 2),
            "search_limit_s": round(limit, 1),
            "budget": budget,
            "tune_s": round(result.wall_s, 2),
            "extract_and_check_s": round(wall - result.wall_s, 2),  # task extraction, bucket check, manifest
            "trials_run": result.trials_run,
            "trials_cached": result.trials_cached,
            "failed": result.failed,
            "tasks": len(result.tasks),
            "with_records": sum(1 for t in result.tasks if t.trials),
            "profile": result.profile,
            "buckets": result.buckets,
            "kernels": [
                {
                    "name": t.name,
                    "trials": t.trials,
                    "best_us": round(t.best_us, 2) if t.best_us < float("inf") else None,
                    "rule_us": round(t.rule_us, 2) if t.rule_us == t.rule_us else None,
                }
                for t in result.tasks
            ],
        }
        report["workloads"][name] = entry
        logger.info(
            "%s: %d trials (%d failed) in %.0f s, %d were cached; %d of %d kernels have records; extraction + bucket "
            "check %.0f s: %s",
            name,
            result.trials_run,
            result.failed,
            wall,
            result.trials_cached,
            entry["with_records"],
            entry["tasks"],
            entry["extract_and_check_s"],
            _verdicts(result.buckets),
        )
        logger.info("%s: where the time went: %s", name, result.profile)
    _recheck(report, names, cache, buckets, config, dtype, target, compile_flags, deadline)
    report["wall_s"] = round(time.perf_counter() - start, 2)
    return report


def _recheck(
    report: dict,
    names: list[str],
    cache: Path,
    buckets: str,
    config: str,
    dtype: str | None,
    target,
    compile_flags: dict | None,
    deadline: float,
) -> None:
    """Check the buckets of every workload but the last again, while time is left: a later
    workload's records of a shared kernel (mlp's matmuls are llama-block's) change the record set
    of the earlier one's buckets, and a verdict holds only for the records it timed
    (`schedules/verdicts.py`), so `relaxtune compile` would apply the new records unchecked. A
    workload whose record sets all still have a verdict costs one build and is not timed again."""
    from relaxtune import workloads
    from relaxtune.measure.bucket_check import check_buckets

    for name in names[:-1]:
        entry = report["workloads"].get(name, {})
        if (
            not entry.get("buckets")
            or time.perf_counter() + entry.get("extract_and_check_s", CHECK_ESTIMATE_S) > deadline
        ):
            continue
        mark = time.perf_counter()
        workload = workloads.load(name, workloads.parse_config(config), dtype)
        entry["recheck"] = check_buckets(workload, target, _job(cache, buckets, compile_flags), only_unchecked=True)
        logger.info(
            "%s: buckets checked again with every workload's records in %.0f s: %s",
            name,
            time.perf_counter() - mark,
            _verdicts(entry["recheck"]),
        )


def _job(cache: Path, buckets: str, compile_flags: dict | None):
    """The job every workload is tuned, and its buckets checked, with: the cache, the bucket tops, the build flags."""
    from relaxtune.config import BucketConfig, CompileConfig, JobConfig

    return JobConfig(
        cache_dir=cache,
        buckets=BucketConfig.parse([buckets] if buckets else None),
        compile=CompileConfig(**(compile_flags or {})),
    )


def _verdicts(entries: list[dict]) -> str:
    return (
        ", ".join(f"{b['bucket']} {b['verdict']} ({b['records_ms']:.3f} vs {b['rules_ms']:.3f} ms)" for b in entries)
        or "none"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache", type=Path, required=True, help="tuning cache folder (the target's folder is made in it)"
    )
    parser.add_argument(
        "--workloads",
        default=",".join(DEFAULT_WORKLOADS),
        help=f"comma-separated built-ins (default {','.join(DEFAULT_WORKLOADS)})",
    )
    parser.add_argument(
        "--minutes", type=float, default=5.0, help="time for the whole job, bucket checks included (default 5)"
    )
    parser.add_argument(
        "--buckets",
        default=DEFAULT_BUCKETS,
        help=f"bucket tops, DIM=T1,T2,... ('' for the default plan; default {DEFAULT_BUCKETS})",
    )
    parser.add_argument(
        "--trials",
        type=int,
        default=256,
        help="most trials per workload, cached ones included (default 256; less where the time share is short)",
    )
    parser.add_argument(
        "--trials-per-iter",
        type=int,
        default=16,
        help="candidates a batch: one per build core (default 16, the GPU machine's cores)",
    )
    parser.add_argument("--dtype", default=None, help="workload dtype (default: each built-in's, float32)")
    parser.add_argument("--target", default="cuda", help="cuda (default), cuda:sm_80, ...")
    parser.add_argument(
        "--config", default="", help="overrides for every workload, e.g. hidden=4096,heads=32 (default: none)"
    )
    parser.add_argument(
        "--fusion", default="relaxtune", help="relaxtune (default) or stock: compile with the same to apply the records"
    )
    parser.add_argument(
        "--no-cublas", action="store_true", help="fp16/bf16 weight GEMMs as TIR kernels (compile with --no-cublas too)"
    )
    parser.add_argument(
        "--no-flash-attention",
        action="store_true",
        help="attention as TIR kernels (compile with --no-flash-attention too)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the per-phase report here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    for noisy in ("tvm", "tvm.s_tir.meta_schedule", "relaxtune.task", "relaxtune.relax_passes"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    flags = {"fusion": args.fusion, "cublas": not args.no_cublas, "flash_attention": not args.no_flash_attention}
    report = tune_all(
        names,
        args.cache,
        args.minutes,
        args.buckets,
        args.trials,
        args.dtype,
        args.target,
        args.config,
        flags,
        args.trials_per_iter,
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    logger.info("done in %.0f s", report["wall_s"])


if __name__ == "__main__":
    main()
