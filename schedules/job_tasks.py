"""What a tuning job knows of its tasks before it searches: the trials the cache holds per task, the task
index with each kernel's rule-based time, the order of the tasks, and those an earlier job retired.

Used by the tuning driver (`tune.py`) to plan the job (`shares.py` splits the budget in `select`'s order) and to
report each task's best time after it.
"""

from __future__ import annotations

from pathlib import Path

from ..config import TuneConfig
from . import task_index
from .database import CacheDatabase
from .tasks import Task


def trial_counts(database: CacheDatabase, tasks: list[Task]) -> dict[str, int]:
    """Trials the cache holds per task key: every record, failed builds and runs included (they
    were measured, and the budget counts measured trials: a job that saw failures, run again,
    measures nothing)."""
    from .tasks import workload_key

    by_key: dict[str, int] = {}
    for workload, count in database.records_per_workload():
        key = workload_key(workload.mod)
        by_key[key] = by_key.get(key, 0) + count
    return {t.key: by_key.get(t.key, 0) for t in tasks}


def best_us(database: CacheDatabase, task: Task) -> float:
    records = database.records_for(task.mod)
    times = [sum(float(s) for s in r.run_secs) / len(r.run_secs) for r in records if r.run_secs]
    return min(times) * 1e6 if times else float("inf")


def finite(us: float) -> float | None:
    return us if us < float("inf") else None


def index_tasks(
    tasks: list[Task], target, folder: Path, workload: str, builder=None, runner=None, config: TuneConfig = TuneConfig()
) -> dict[str, dict]:
    """The task index of the cache, with every task of this job in it (rule time measured once):
    one after another here, or with `builder` and `runner` all at once (GPU targets)."""
    index = task_index.load(folder)
    todo = [t for t in tasks if "rule_us" not in index.get(t.key, {})]
    if builder is not None and todo:
        times = task_index.measure_rules_batch([t.mod for t in todo], target, builder, runner)
    else:
        times = [task_index.measure_rules(t.mod, target, config.measure_windows, config.window_ms) for t in todo]
    new = []
    for t, us in zip(todo, times):
        entry = {
            "key": t.key,
            "kernel": t.name.split("@")[0],
            "workload": workload,
            "bucket": t.bucket,
            "flops": t.flops,
        }
        if us is not None:  # a rule schedule that failed is measured again by the next job
            entry["rule_us"] = us
        new.append(entry)
        index.setdefault(t.key, {}).update(entry)
    task_index.append(folder, new)
    return index


def select(tasks: list[Task], index: dict[str, dict] | None = None, cached: dict[str, int] | None = None) -> list[Task]:
    """The tasks, most valuable first: largest expected share of run time (expected calls x
    FLOPs). The budget's shares go to as many as get one measured batch each (`shares.split`);
    the others borrow records or keep their rules."""
    return sorted(tasks, key=lambda t: (-t.weight * t.flops, t.name))


def retired(task: Task, index: dict[str, dict], cached: dict[str, int]) -> bool:
    """Whether an earlier job stopped the task early (no gain; `stopped_at` in the index) and the
    cache holds no record measured since: it is not tuned again."""
    return cached.get(task.key, 0) >= index.get(task.key, {}).get("stopped_at", 1 << 62)
