"""The tuning driver: MetaSchedule's task scheduler over our tasks, cache, builder and cost model.

The trial budget is global and counts what the cache already holds: a job asked for N trials
over tasks that already have M records runs N - M more (zero when repeated, the rest after an
interrupt). The evolutionary search starts from the cached records of each task.

Where a job's time goes, and what this driver does about it (`TuneResult.profile` has the seconds
per part; `relaxtune report tuning` draws them): build workers that live for the whole job and
start while the job sets up (`builder.py`); a smaller evolutionary population and fewer
generations per batch, since a trained cost model scores every member of every generation; the
XGBoost model loaded from and saved to the cache folder (`cost_model.py`); a new task's first
batch transferred from similar tasks' best records (`transfer.py`); a task stopped after
`early_stop_batches` batches without gain, its trials left to the others (`progress.py`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..config import TuneConfig
from . import cost_model, intrin, task_index, transfer
from .builder import make_builder, make_runner
from .database import CacheDatabase
from .progress import EventLog, ProgressBar
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
    profile: dict = field(default_factory=dict)  # seconds per part of the job (`_profile`)
    ranking: dict = field(default_factory=dict)  # the cost model's held-out ranking quality
    buckets: list = field(default_factory=list)  # per-bucket verdicts of the check after the search (bucket_check.py)


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


def select(tasks: list[Task], index: dict[str, dict] | None = None, cached: dict[str, int] | None = None) -> list[Task]:
    """The tasks worth tuning, most valuable first: largest expected share of run time (expected
    calls x FLOPs). The budget takes as many as get one measured batch each (`_contexts`);
    MetaSchedule's gradient scheduler then moves the rest to where it pays; the others borrow
    records or keep their rules. A task an earlier job stopped early (no gain; `stopped_at` in
    the index) is not tuned again."""
    index, cached = index or {}, cached or {}
    live = [t for t in tasks if cached.get(t.key, 0) < index.get(t.key, {}).get("stopped_at", 1 << 62)]
    return sorted(live, key=lambda t: (-t.weight * t.flops, t.name))


def _contexts(ranked: list[Task], limit: int, target, config: TuneConfig, log_dir: Path) -> tuple[list[Task], list]:
    """(tasks, TuneContexts) for the first `limit` tasks whose design space MetaSchedule can
    generate: one it cannot (a schedule rule that fails on a kernel) would abort the whole search,
    so it is skipped with one warning, keeps its rule-based schedule, and the next task is taken."""
    from tvm.s_tir import meta_schedule as ms

    # per-task log files (traces, build errors) under <log_dir>/logs, as stock MetaSchedule writes them
    candidates = ranked[: 2 * limit + 4]  # room for a few tasks skipped below
    loggers = ms.logging.get_loggers_from_work_dir(str(log_dir), [t.name.replace("@", "_") for t in candidates])
    kept, contexts = [], []
    for i, t in enumerate(candidates):
        if len(kept) == limit:
            break
        context = ms.TuneContext(
            mod=t.mod,
            target=target,
            space_generator="post-order-apply",
            search_strategy=ms.search_strategy.EvolutionarySearch(population_size=config.population, genetic_num_iters=config.search_generations),
            task_name=t.name,
            logger=loggers[i],
            rand_state=config.seed + i + 1,
            num_threads=config.build_workers or "physical",
        ).clone()
        try:
            context.space_generator.generate_design_space(context.mod)
        except Exception as err:  # TVM raises ValueError/InternalError from inside a schedule rule
            logger.warning("%s: MetaSchedule cannot generate its design space (%s): keeps its rules", t.name, str(err).strip().splitlines()[-1][:160])
            continue
        kept.append(t)
        contexts.append(context)
    return kept, contexts


def _seed_from_similar(tasks, contexts, cached, budget, config, builder, runner, database, model, bar) -> int:
    """Measure transferred candidates for each task without records; returns trials spent."""
    spent = 0
    for i, (task, context) in enumerate(zip(tasks, contexts)):
        room = min(config.trials_per_iter, budget - spent)
        if cached[task.key] or room <= 0:
            continue
        space = context.space_generator.generate_design_space(context.mod)
        candidates = transfer.seed_candidates(task.mod, database, context.space_generator.postprocs, room, space, config.seed + i)
        if not candidates:
            continue
        builds, runs = transfer.measure(candidates, context, builder, runner, database)
        model.update(context, candidates, runs)
        bar.record(None, i, len(candidates), builds, runs)
        spent += len(candidates)
        logger.info("%s: first batch of %d seeded from similar tasks' records, best %.1f us", task.name, len(candidates), bar.best_us[i])
    return spent


def tune(tasks: list[Task], target, database: CacheDatabase, config: TuneConfig, log_dir: Path, progress: bool = True, workload: str = "") -> TuneResult:
    """Run up to `config.trials` trials in all (cached ones included) over the most valuable tasks."""
    intrin.register_for(target.kind.name)
    from tvm.s_tir import meta_schedule as ms

    start = time.perf_counter()
    cached = {t.key: len(database.records_for(t.mod)) for t in tasks}
    remaining = config.trials - sum(cached.values())
    result = TuneResult(trials_run=0, trials_cached=sum(cached.values()), wall_s=0.0)
    all_tasks = tasks
    index = task_index.load(log_dir) if tasks else {}
    ranked = select(tasks, index, cached) if tasks else []
    limit = max(1, config.trials // config.trials_per_iter)
    tuning = remaining > 0 and bool(ranked)
    if tuning:
        log_dir.mkdir(parents=True, exist_ok=True)
        builder, runner = make_builder(config), make_runner(config)
        builder.start()
    try:
        if tuning:
            tasks, contexts = _contexts(ranked, limit, target, config, log_dir)
        else:
            tasks = ranked[:limit]
        # the rule-based time of every kernel that has or gets records: a record must beat it to be used
        chosen = {t.key for t in tasks}
        index = index_tasks([t for t in all_tasks if cached[t.key] or t.key in chosen], target, log_dir, workload)
    except BaseException:
        if tuning:
            builder.shutdown()
        raise
    if tuning:
        events = EventLog(log_dir)
        inner, warm = cost_model.load(log_dir) if config.persist_cost_model else (cost_model.new_model(), False)
        model = cost_model.RankedModel(inner)
        bar = ProgressBar(remaining, [t.name for t in tasks], [t.flops for t in tasks], disable=not progress, events=events, cost_model=model, patience=config.early_stop_batches)
        events.write(
            "start",
            workload=workload,
            budget=remaining,
            warm_model=warm,
            model_samples=inner.data_size,
            tasks=[{"name": t.name, "key": t.key, "weight": t.weight, "flops": t.flops, "cached": cached[t.key], "rule_us": index.get(t.key, {}).get("rule_us")} for t in tasks],
        )
        setup_s = time.perf_counter() - start
        transfer_s, phases = 0.0, {}
        try:
            if config.transfer:
                mark = (time.perf_counter(), builder.stats["seconds"], model.seconds["update"])
                remaining -= _seed_from_similar(tasks, contexts, cached, remaining, config, builder, runner, database, model, bar)
                # adapting traces and measuring them; their builds and the model update count there
                transfer_s = time.perf_counter() - mark[0] - (builder.stats["seconds"] - mark[1]) - (model.seconds["update"] - mark[2])
            if remaining > 0 and contexts:
                profiler = ms.Profiler() if ms.Profiler.current() is None else contextlib.nullcontext()
                with profiler:
                    _tune_tasks(contexts, tasks, log_dir, remaining, config, builder, runner, database, model, bar)
                phases = _phases(profiler)
        finally:
            bar.close()
            builder.shutdown()
            if config.persist_cost_model:
                cost_model.save(inner, log_dir)
            result.profile = {**_profile(time.perf_counter() - start, setup_s, transfer_s, builder, model), **phases}
            result.ranking = cost_model.summarize(model.held_out)
            events.write("end", profile=result.profile, ranking=result.ranking, stopped=bar.stopped)
            logger.info("where the time went: %s; cost model ranking on held-out batches: %s", result.profile, result.ranking)
        stopped = {t.name: t for t in tasks}
        task_index.append(log_dir, [{"key": stopped[n].key, "stopped_at": len(database.records_for(stopped[n].mod))} for n in bar.stopped])
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


def _tune_tasks(contexts, tasks, log_dir, remaining, config, builder, runner, database, model, bar) -> None:
    from tvm.s_tir import meta_schedule as ms

    ms.tune_tasks(
        tasks=contexts,
        # MetaSchedule reads weights as whole numbers: expected calls per 1000 model calls
        task_weights=[float(max(1, round(1000 * t.weight))) for t in tasks],
        work_dir=str(log_dir),
        max_trials_global=remaining,
        num_trials_per_iter=config.trials_per_iter,
        builder=builder,
        runner=runner,
        database=database,
        cost_model=model,
        measure_callbacks=[*ms.MeasureCallback.create("default"), bar],
        task_scheduler="gradient",
    )


def _phases(profiler) -> dict:
    """MetaSchedule's own timers, where this job opened the profiler: the evolutionary search
    (sampling, mutation, postprocessing and the cost model's scoring of the population, inside
    `search_and_measure_s` and `cost_model_predict_s`) and the wait for the runner."""
    if not hasattr(profiler, "get"):
        return {}
    timers = {str(k): float(v) for k, v in profiler.get().items()}
    search = sum(v for k, v in timers.items() if k.startswith("EvoSearch/") and k.count("/") == 1)
    return {"ms_evolutionary_search_s": round(search, 2), "ms_wait_for_runner_s": round(timers.get("JoinRunnerFutures", 0.0), 2)}


def _profile(wall_s: float, setup_s: float, transfer_s: float, builder, model) -> dict:
    """Seconds per part of the job (they add up to `wall_s`). `transfer_s`: adapting similar tasks'
    traces and measuring them; `search_and_measure_s` is the rest: candidate generation (sampling,
    mutation, postprocessing) and waiting for the runner (which overlaps the search). Not a part:
    `worker_start_s`, the first build batch's excess over the median batch (workers start then)."""
    batches = builder.stats["batch_seconds"]
    median = sorted(batches[1:])[len(batches[1:]) // 2] if len(batches) > 1 else 0.0
    parts = {
        "setup_s": setup_s,
        "transfer_s": transfer_s,
        "build_s": builder.stats["seconds"],
        "cost_model_predict_s": model.seconds["predict"],
        "cost_model_update_s": model.seconds["update"],
    }
    rest = wall_s - sum(parts.values())
    out = {"wall_s": wall_s, **parts, "search_and_measure_s": max(0.0, rest), "worker_start_s": max(0.0, batches[0] - median) if batches else 0.0}
    return {k: round(v, 2) for k, v in out.items()}
