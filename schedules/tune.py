"""The tuning driver: MetaSchedule's task scheduler over our tasks, cache, builder and cost model.

The trial budget (`TuneConfig.trials`) is the job's, counting what the cache already holds for its
kernels, whichever job measured it. It is split into per-kernel shares (`shares.py`: whole
batches, the most valuable kernels first, by expected run-time share). The job measures only the
kernels short of their share, for the sum of their shortfalls (never more than the budget minus
the cached trials of all its kernels), with MetaSchedule's gradient task scheduler spending them
where the gains are:
- the same job run twice measures nothing the second time; an interrupted job measures exactly
  the rest; a larger budget later measures more, for the kernels whose share grew;
- a second workload whose kernels an earlier job (of any workload) already tuned to their share
  measures nothing for them, and a kernel an earlier job stopped early (no gain; `stopped_at` in
  the task index) is not tuned again;
- a kernel whose main computation another job measured on a kernel with other fused element-wise
  blocks has those trials credited toward its share, less the one batch it owes to measure that
  kernel's best traces carried to it (`shares.py`, `transfer.py`);
- a job with nothing to measure starts nothing: no build workers, no cost model load or save, no
  events file, and the rule-based time only of kernels that have none yet.
The evolutionary search starts from the cached records of each task, in the task's design space
(`TuneConfig.space`, `space.py`): by default the rules' space, where every kernel a CPU rule
schedules is searched around that rule, whose own schedule is the task's first measured candidate
(`seeded_search.py`), so a tuned kernel starts at the rule's speed.

Where a job's time goes, and what this driver does about it (`TuneResult.profile` has the seconds
per part; `relaxtune report tuning` draws them): build workers that live for the whole job and
start while the job loads its cost model and seeds, with the runner's worker started alongside
them in the background (`builder.py`; all after the rule-based times are measured, which their
start-up would disturb); a smaller evolutionary population and fewer
generations per batch, since a trained cost model scores every member of every generation; the
XGBoost model loaded from and saved to the cache folder (`cost_model.py`); a new task's first
batch seeded from similar tasks' best records (`transfer.py`), the search's picks filling it, and
no candidate measured twice (`seeded_search.py`); a task stopped after
`early_stop_batches` batches without gain, its trials left to the others (`progress.py`).
Trials are counted as the cache holds them: every record, failed builds and runs included.

This file is the driver itself; the job's view of its tasks (trial counts, the task index, their order) is in
`job_tasks.py`, the per-task search contexts and their seeds in `contexts.py`, the time profile in
`job_profile.py`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..config import TuneConfig
from . import confirm, cost_model, intrin, job_profile, shares, task_index, task_logs, transfer
from .builder import DeferredRunner, make_builder, make_runner
from .contexts import make_contexts, set_seeds
from .database import CacheDatabase
from .job_tasks import best_us, finite, index_tasks, retired, select, trial_counts
from .progress import EventLog, ProgressBar
from .scheduler import InformedGradient
from .tasks import Task

logger = logging.getLogger(__name__)


@dataclass
class TaskResult:
    name: str
    trials: int
    best_us: float
    flops: float
    rule_us: float
    weight: float = 0.0  # expected calls per model call

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
    profile: dict = field(default_factory=dict)  # seconds per part of the job (`job_profile.py`)
    ranking: dict = field(default_factory=dict)  # the cost model's held-out ranking quality
    shares: dict = field(default_factory=dict)  # kernel name -> its share of the budget (`shares.py`)
    buckets: list = field(default_factory=list)  # per-bucket verdicts of the check after the search (bucket_check.py)


def tune(
    tasks: list[Task],
    target,
    database: CacheDatabase,
    config: TuneConfig,
    log_dir: Path,
    progress: bool = True,
    workload: str = "",
) -> TuneResult:
    """Measure what the job owes its kernels (`shares.plan`): nothing at all, and nothing started
    (build workers, cost model, events), when the cache already holds every kernel's share."""
    intrin.register_for(target.kind.name)
    from tvm.s_tir import meta_schedule as ms

    start = time.perf_counter()
    cached = trial_counts(database, tasks)
    result = TuneResult(trials_run=0, trials_cached=sum(cached.values()), wall_s=0.0)
    all_tasks = tasks
    index = task_index.load(log_dir) if tasks else {}
    ranked = select(tasks)

    def planned(borrowed: dict[str, int]) -> shares.Plan:
        return shares.plan(
            [t.weight * t.flops for t in ranked],
            [cached[t.key] for t in ranked],
            config.trials,
            config.trials_per_iter,
            sum(cached.values()),
            [retired(t, index, cached) for t in ranked],
            [borrowed.get(t.key, 0) for t in ranked],
        )

    job = planned({})
    if config.transfer and job.budget > 0:  # credit from other jobs' kernels: scanned only where something is owed
        job = planned(transfer.same_core_trials(database, ranked))
    result.shares = {t.name: s for t, s in zip(ranked, job.shares) if s}
    short = [ranked[i] for i in job.short]
    needs = {ranked[i].key: job.needs[i] for i in job.short}
    credit = {t.key: c for t, c in zip(ranked, job.credit) if c}
    remaining = job.budget
    tuning = remaining > 0 and bool(short)
    if tuning:
        log_dir.mkdir(parents=True, exist_ok=True)
    tasks, contexts, task_loggers, boxes = (
        make_contexts(short, needs, target, config, log_dir) if tuning else ([], [], [], [])
    )
    remaining = min(remaining, sum(needs[t.key] for t in tasks))
    tuning = tuning and remaining > 0  # not when every short kernel was skipped (no design space)
    if not tuning:
        task_logs.close(task_loggers)
    # the rule-based time of every kernel that has or gets records (a record must beat it to be
    # used). On a CPU it is measured before the build workers start: their start-up on the same
    # cores made the rules read up to 3-4x slow (llama-block's SwiGLU kernel: 3672 us against
    # 959 us). On a GPU the job's builder and runner measure them, all built at once
    # (`task_index.measure_rules_batch`): one at a time took ~1 s a kernel there (NVRTC).
    on_gpu = target.kind.name == "cuda" and not config.rpc_tracker
    builder = runner = None
    if tuning and on_gpu:
        builder, runner = _start_workers(config)
    chosen, mark = {t.key for t in tasks}, time.perf_counter()
    index = index_tasks(
        [t for t in all_tasks if cached[t.key] or t.key in chosen], target, log_dir, workload, builder, runner, config
    )
    rules_s = time.perf_counter() - mark
    if tuning and builder is None:
        builder, runner = _start_workers(config)
    if tuning:
        holding = sum(1 for s in job.shares if s) - len(short)
        logger.info(
            "%d trials for the %d kernels short of their share of the %d-trial budget; %d hold theirs already or were "
            "stopped early%s",
            remaining,
            len(tasks),
            config.trials,
            holding,
            f"; {sum(credit.values())} trials of the same main computations credited" if credit else "",
        )
        events = EventLog(log_dir)
        mark = time.perf_counter()
        inner, warm = (
            cost_model.load(log_dir, target if config.cost_prior else None)
            if config.persist_cost_model
            else (cost_model.new_model(), False)
        )
        load_s = time.perf_counter() - mark
        model = cost_model.RankedModel(inner)
        bar = ProgressBar(
            remaining,
            [t.name for t in tasks],
            [t.flops for t in tasks],
            disable=not progress,
            events=events,
            cost_model=model,
            patience=config.early_stop_batches,
            deadline=start + config.time_limit_s if config.time_limit_s else 0.0,
            sent=[box.sent for box in boxes],
        )
        events.write(
            "start",
            workload=workload,
            budget=remaining,
            warm_model=warm,
            model_samples=inner.data_size,
            tasks=[
                {
                    "name": t.name,
                    "key": t.key,
                    "weight": t.weight,
                    "flops": t.flops,
                    "cached": cached[t.key],
                    "share": result.shares.get(t.name, 0),
                    "need": needs[t.key],
                    "credit": credit.get(t.key, 0),
                    "cached_best_us": finite(best_us(database, t)) if cached[t.key] else None,
                    "rule_us": index.get(t.key, {}).get("rule_us"),
                }
                for t in tasks
            ],
        )
        setup_s = time.perf_counter() - start
        seeding, phases = [0.0], {}
        try:
            set_seeds(tasks, contexts, boxes, cached, target, config, database, events, seeding)
            if boxes:
                boxes[0].budget.left = remaining
            if remaining > 0 and not _past(bar.deadline):
                profiler = ms.Profiler() if ms.Profiler.current() is None else contextlib.nullcontext()
                with profiler:
                    _tune_tasks(contexts, tasks, log_dir, remaining, config, builder, runner, database, model, bar)
                phases = job_profile.phases(profiler)
        finally:
            bar.close()
            task_logs.close(task_loggers)
            builder.shutdown()
            if isinstance(runner, DeferredRunner):
                runner.shutdown()
            if config.persist_cost_model:
                cost_model.save(inner, log_dir)
            result.profile = {
                **job_profile.profile(time.perf_counter() - start, setup_s, seeding[0], builder, model),
                **phases,
                "setup_rule_timing_s": round(rules_s, 2),
                "setup_cost_model_load_s": round(load_s, 2),
            }  # parts of setup_s
            result.ranking = cost_model.summarize(model.held_out)
            events.write("end", profile=result.profile, ranking=result.ranking, stopped=bar.stopped)
            logger.info(
                "where the time went: %s; cost model ranking on held-out batches: %s", result.profile, result.ranking
            )
        stopped, counts = {t.name: t for t in tasks}, trial_counts(database, tasks)
        task_index.append(log_dir, [{"key": stopped[n].key, "stopped_at": counts[stopped[n].key]} for n in bar.stopped])
        result.trials_run = sum(bar.trials)
        result.failed = bar.failed
        if config.confirm_rounds and target.kind.name == "llvm" and not config.rpc_tracker:
            mark = time.perf_counter()
            confirm.confirm(tasks, database, target, log_dir, config.confirm_rounds)
            result.profile["confirm_s"] = round(time.perf_counter() - mark, 2)
    else:
        logger.info(
            "0 trials to run: the cache holds %d trials for these %d kernels (budget %d), each kernel's share of it "
            "included",
            result.trials_cached,
            len(all_tasks),
            config.trials,
        )
    result.wall_s = time.perf_counter() - start
    counts = trial_counts(database, all_tasks)
    result.tasks = [
        TaskResult(
            t.name,
            counts[t.key],
            best_us(database, t),
            t.flops,
            index.get(t.key, {}).get("rule_us", float("nan")),
            t.weight,
        )
        for t in all_tasks
    ]
    return result


def _past(deadline: float) -> bool:
    """Whether the job's time limit (a `time.perf_counter()` value; 0: none) has passed."""
    return bool(deadline) and time.perf_counter() >= deadline


def _start_workers(config: TuneConfig):
    """(builder, runner), their workers starting in the background."""
    builder = make_builder(config)
    builder.start()
    # the local runner's worker starts in the background too (`DeferredRunner`); a remote one
    # is checked now, so that a tracker without servers is reported before any search
    runner = make_runner(config) if config.rpc_tracker else DeferredRunner(lambda: make_runner(config))
    if isinstance(runner, DeferredRunner):
        runner.start()
    return builder, runner


def _tune_tasks(contexts, tasks, log_dir, remaining, config, builder, runner, database, model, bar) -> None:
    """One gradient task scheduler over the kernels short of their share, for the sum of what they
    are owed: it spends the trials where the gains are, every measured batch reported before the next
    task is searched (`scheduler.py`), and a kernel stopped early (`progress.py`) leaves its trials to
    the others."""
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
        task_scheduler=InformedGradient(bar, seed=config.seed),
    )
