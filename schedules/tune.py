"""The tuning driver: MetaSchedule's task scheduler over our tasks, cache, builder and cost model.

The trial budget is global and counts what the cache already holds: a job asked for N trials
over tasks that already have M records runs N - M more (zero when repeated, the rest after an
interrupt). The evolutionary search starts from the cached records of each task.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..config import TuneConfig
from . import intrin, task_index
from .builder import make_builder, make_runner
from .database import CacheDatabase
from .progress import ProgressBar
from .tasks import Task

logger = logging.getLogger(__name__)


@dataclass
class TaskResult:
    name: str
    trials: int
    best_us: float
    flops: float
    rule_us: float

    @property
    def gflops(self) -> float:
        return self.flops / self.best_us / 1e3 if self.best_us < float("inf") else 0.0


@dataclass
class TuneResult:
    trials_run: int
    trials_cached: int
    wall_s: float
    failed: int = 0
    tasks: list[TaskResult] = field(default_factory=list)


def _best_us(database: CacheDatabase, task: Task) -> float:
    records = database.records_for(task.mod)
    times = [sum(float(s) for s in r.run_secs) / len(r.run_secs) for r in records if r.run_secs]
    return min(times) * 1e6 if times else float("inf")


def index_tasks(tasks: list[Task], target, folder: Path, workload: str) -> dict[str, dict]:
    """The task index of the cache, with every task of this job in it (rule time measured once)."""
    index = task_index.load(folder)
    new = []
    for t in tasks:
        if "rule_us" not in index.get(t.key, {}):
            entry = {"key": t.key, "kernel": t.name.split("@")[0], "workload": workload, "bucket": t.bucket, "flops": t.flops}
            entry["rule_us"] = task_index.measure_rules(t.mod, target)
            new.append(entry)
            index.setdefault(t.key, {}).update(entry)
    task_index.append(folder, new)
    return index


def select(tasks: list[Task], config: TuneConfig) -> list[Task]:
    """The tasks this budget tunes: largest expected share of run time first (expected calls x
    FLOPs), as many as get one measured batch each (MetaSchedule's gradient scheduler then moves
    the rest of the budget to where it pays); the others borrow records or keep their rules."""
    ranked = sorted(tasks, key=lambda t: (-t.weight * t.flops, t.name))
    return ranked[: max(1, config.trials // config.trials_per_iter)]


def tune(tasks: list[Task], target, database: CacheDatabase, config: TuneConfig, log_dir: Path, progress: bool = True, workload: str = "") -> TuneResult:
    """Run up to `config.trials` trials in all (cached ones included) over the most valuable tasks."""
    intrin.register_for(target.kind.name)
    from tvm.s_tir import meta_schedule as ms

    start = time.perf_counter()
    cached = {t.key: len(database.records_for(t.mod)) for t in tasks}
    remaining = config.trials - sum(cached.values())
    result = TuneResult(trials_run=0, trials_cached=sum(cached.values()), wall_s=0.0)
    all_tasks, tasks = tasks, select(tasks, config) if tasks else []
    # the rule-based time of every kernel that has or gets records: a record must beat it to be used
    chosen = {t.key for t in tasks}
    index = index_tasks([t for t in all_tasks if cached[t.key] or t.key in chosen], target, log_dir, workload)
    if remaining > 0 and tasks:
        log_dir.mkdir(parents=True, exist_ok=True)
        # per-task log files (traces, build errors) under <log_dir>/logs, as stock MetaSchedule writes them
        loggers = ms.logging.get_loggers_from_work_dir(str(log_dir), [t.name.replace("@", "_") for t in tasks])
        contexts = [
            ms.TuneContext(
                mod=t.mod,
                target=target,
                space_generator="post-order-apply",
                search_strategy="evolutionary",
                task_name=t.name,
                logger=loggers[i],
                rand_state=config.seed + i + 1,
                num_threads=config.build_workers or "physical",
            ).clone()
            for i, t in enumerate(tasks)
        ]
        bar = ProgressBar(remaining, [t.name for t in tasks], [t.flops for t in tasks], disable=not progress)
        try:
            ms.tune_tasks(
                tasks=contexts,
                # MetaSchedule reads weights as whole numbers: expected calls per 1000 model calls
                task_weights=[float(max(1, round(1000 * t.weight))) for t in tasks],
                work_dir=str(log_dir),
                max_trials_global=remaining,
                num_trials_per_iter=config.trials_per_iter,
                builder=make_builder(config),
                runner=make_runner(config),
                database=database,
                cost_model=ms.cost_model.XGBModel(num_warmup_samples=0),
                measure_callbacks=[*ms.MeasureCallback.create("default"), bar],
                task_scheduler="gradient",
            )
        finally:
            bar.close()
        result.trials_run = sum(bar.trials)
        result.failed = bar.failed
    else:
        logger.info("cache holds %d trials for these %d tasks (budget %d): 0 trials to run", result.trials_cached, len(all_tasks), config.trials)
    result.wall_s = time.perf_counter() - start
    result.tasks = [
        TaskResult(t.name, len(database.records_for(t.mod)), _best_us(database, t), t.flops, index.get(t.key, {}).get("rule_us", float("nan")))
        for t in all_tasks
    ]
    return result
