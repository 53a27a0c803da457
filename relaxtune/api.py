"""The Python API the CLI calls: tune a workload into the cache, compile it into an artifact.

Each entry point sizes TVM's CPU thread pool first (threads.configure); importing relaxtune does
not. The compiler's own functions (`build`, `bucket_plan`, `extract_tasks`) are re-exported here
for programs that build without exporting.
"""

from __future__ import annotations

import logging
from pathlib import Path

from . import threads
from .compiler.build import CompileResult, bucket_plan, build, export, extract_tasks, open_cache, tuned_buckets
from .config import JobConfig
from .measure import bench as measure_bench
from .measure.bucket_check import check_buckets
from .schedules import cache
from .schedules.tune import tune as run_tuning
from .targets import ResolvedTarget
from .workloads import Workload

__all__ = ["CompileResult", "bench", "bucket_plan", "build", "compile", "extract_tasks", "tune", "tuned_buckets"]

logger = logging.getLogger(__name__)


def tune(workload: Workload, target: ResolvedTarget, job: JobConfig, progress: bool = True):
    """Tune every contraction kernel of every bucket; records go to the target's cache folder."""
    threads.configure()
    tasks = extract_tasks(workload, target, job)
    database, folder = open_cache(target, job, writable=True)
    logger.info("target %s; cache %s; %d tasks", target.json, folder, len(tasks))
    result = run_tuning(tasks, target.target, database, job.tune, folder, progress=progress, workload=workload.name)
    if job.tune.check_buckets and not job.tune.rpc_tracker and workload.entries != ("main",):
        logger.info(
            "bucket check skipped: %s's buckets (%s) run against a KV cache, which the check cannot drive",
            workload.name,
            ", ".join(workload.entries),
        )
    elif job.tune.check_buckets and not job.tune.rpc_tracker:
        # no new trial: the records are as they were, but their buckets may never have been checked
        # with the compiler that builds them now (a verdict names the bucket's kernels and records)
        result.buckets = check_buckets(workload, target, job, only_unchecked=not result.trials_run)
    cache.write_manifest(
        folder,
        target,
        workload.name,
        {
            "config": workload.config,
            "trials_budget": job.tune.trials,
            "tasks": [t.name for t in tasks],
            "buckets": {
                dim: [[b.lo, b.hi, b.tune_at] for b in plan] for dim, plan in bucket_plan(workload, job).items()
            },
        },  # as the artifact manifest has them
    )
    return result


def compile(workload: Workload, target: ResolvedTarget, job: JobConfig, output: Path) -> CompileResult:
    """Compile with the cache applied and export `output` (.so) with its params and manifest."""
    threads.configure()
    return export(workload, target, job, output)


def bench(
    workload: Workload,
    target: ResolvedTarget,
    job: JobConfig,
    shapes: dict[str, list[int]],
    systems=measure_bench.SYSTEMS,
) -> list[measure_bench.Row]:
    """Median latency of each system at each shape, in one process: relaxtune vs stock TVM vs torch."""
    threads.configure()
    return measure_bench.bench(workload, target, job, shapes, systems)
