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
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..config import TuneConfig
from . import confirm, cost_model, intrin, shares, space, task_index, task_logs, transfer
from .builder import DeferredRunner, make_builder, make_runner
from .database import CacheDatabase
from .progress import EventLog, ProgressBar
from .rules import decisions
from .scheduler import InformedGradient
from .seeded_search import Budget, SeedBox, SeededSearch
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
    profile: dict = field(default_factory=dict)  # seconds per part of the job (`_profile`)
    ranking: dict = field(default_factory=dict)  # the cost model's held-out ranking quality
    shares: dict = field(default_factory=dict)  # kernel name -> its share of the budget (`shares.py`)
    buckets: list = field(default_factory=list)  # per-bucket verdicts of the check after the search (bucket_check.py)


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


def _best_us(database: CacheDatabase, task: Task) -> float:
    records = database.records_for(task.mod)
    times = [sum(float(s) for s in r.run_secs) / len(r.run_secs) for r in records if r.run_secs]
    return min(times) * 1e6 if times else float("inf")


def _finite(us: float) -> float | None:
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


def _contexts(
    short: list[Task], needs: dict[str, int], target, config: TuneConfig, log_dir: Path
) -> tuple[list[Task], list, list, list]:
    """(tasks, TuneContexts, their loggers: `task_logs.close` them, their seed boxes: `SeededSearch`) of the
    kernels short of their share whose design space (`config.space`, `space.py`) can be generated:
    one that cannot (a schedule rule that fails on a kernel) would abort the whole search, so it is
    skipped with one warning, keeps its rule-based schedule, and what it was owed goes to the others
    (`needs` is updated)."""
    from tvm.s_tir import meta_schedule as ms

    # per-task log files (traces, build errors) under <log_dir>/logs, as stock MetaSchedule writes them
    loggers = task_logs.task_loggers(log_dir, [t.name.replace("@", "_") for t in short])
    kept, contexts, kept_loggers, boxes, freed = [], [], [], [], 0
    budget = Budget()  # the job's trials left, shared: set when the job knows them
    for i, t in enumerate(short):
        box = SeedBox(budget=budget)
        search = ms.search_strategy.EvolutionarySearch(
            population_size=config.population, genetic_num_iters=config.search_generations, eps_greedy=config.explore
        )
        context = ms.TuneContext(
            mod=t.mod,
            target=target,
            space_generator=space.generator(config.space, t.mod, target),
            search_strategy=SeededSearch(search, box, config.explore),
            task_name=t.name,
            logger=loggers[i],
            rand_state=config.seed + i + 1,
            num_threads=config.build_workers or "physical",
        ).clone()
        try:
            context.space_generator.generate_design_space(context.mod)
        except Exception as err:  # TVM raises ValueError/InternalError from inside a schedule rule
            task_logs.close([loggers[i]])
            logger.warning(
                "%s: MetaSchedule cannot generate its design space (%s): keeps its rules",
                t.name,
                str(err).strip().splitlines()[-1][:160],
            )
            freed += needs.pop(t.key)
            continue
        kept.append(t)
        contexts.append(context)
        kept_loggers.append(loggers[i])
        boxes.append(box)
    for t, extra in zip(kept, shares.give_back(freed, [t.weight * t.flops for t in kept], config.trials_per_iter)):
        needs[t.key] += extra
    return kept, contexts, kept_loggers, boxes


def _seed(tasks, contexts, boxes, cached, target, config, database, events, seconds: list) -> None:
    """Each task's seeds (`SeededSearch`), made when its first batch is searched and measured first: the rule's
    own schedule where the task's space is the rules' (its first candidate; dropped there if the cache holds it),
    then, for a task the cache held no record of when the job started, up to half a batch transferred from
    similar tasks' best records of the same space (`transfer.py`), this job's included. The seconds spent making
    them are added to `seconds[0]`."""

    def make(task, context):
        mark = time.perf_counter()
        postprocs = list(context.space_generator.postprocs)
        seeds = []
        if config.space != "generic":
            rule = space.rule_candidate(task.mod, target, postprocs)
            seeds += [rule] if rule is not None else []
        if config.transfer and not cached[task.key]:
            seeds += transfer.seed_candidates(
                task.mod, database, postprocs, max(1, config.trials_per_iter // 2), target, config.space
            )
        events.write("seeds", tasks=[_seeds_event(task, seeds)])
        if len(seeds) > (config.space != "generic"):
            logger.info("%s: %d seed candidate(s) measured first", task.name, len(seeds))
        seconds[0] += time.perf_counter() - mark
        return seeds

    for task, context, box in zip(tasks, contexts, boxes):
        box.make = functools.partial(make, task, context)


def _seeds_event(task: Task, seeds: list) -> dict:
    """A task's seeds for the events file: the rule's own decisions (its first seed, where its space is the
    rules'; `relaxtune report tuning` compares the tuned kernel's with them) and how many were transferred."""
    chosen = [decisions.read(c.sch.trace) for c in seeds]
    rule = chosen[0] if chosen and chosen[0] is not None else None
    return {
        "name": task.name,
        "rule": rule[0] if rule else None,
        "rule_decisions": rule[1] if rule else None,
        "transferred": len(seeds) - (rule is not None),
    }


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
        _contexts(short, needs, target, config, log_dir) if tuning else ([], [], [], [])
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
                    "cached_best_us": _finite(_best_us(database, t)) if cached[t.key] else None,
                    "rule_us": index.get(t.key, {}).get("rule_us"),
                }
                for t in tasks
            ],
        )
        setup_s = time.perf_counter() - start
        seeding, phases = [0.0], {}
        try:
            _seed(tasks, contexts, boxes, cached, target, config, database, events, seeding)
            if boxes:
                boxes[0].budget.left = remaining
            if remaining > 0 and not _past(bar.deadline):
                profiler = ms.Profiler() if ms.Profiler.current() is None else contextlib.nullcontext()
                with profiler:
                    _tune_tasks(contexts, tasks, log_dir, remaining, config, builder, runner, database, model, bar)
                phases = _phases(profiler)
        finally:
            bar.close()
            task_logs.close(task_loggers)
            builder.shutdown()
            if isinstance(runner, DeferredRunner):
                runner.shutdown()
            if config.persist_cost_model:
                cost_model.save(inner, log_dir)
            result.profile = {
                **_profile(time.perf_counter() - start, setup_s, seeding[0], builder, model),
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
            _best_us(database, t),
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


def _phases(profiler) -> dict:
    """MetaSchedule's own timers, where this job opened the profiler: the evolutionary search
    (sampling, mutation, postprocessing and the cost model's scoring of the population, inside
    `search_and_measure_s` and `cost_model_predict_s`) and the wait for the runner."""
    if not hasattr(profiler, "get"):
        return {}
    timers = {str(k): float(v) for k, v in profiler.get().items()}
    search = sum(v for k, v in timers.items() if k.startswith("EvoSearch/") and k.count("/") == 1)
    return {
        "ms_evolutionary_search_s": round(search, 2),
        "ms_wait_for_runner_s": round(timers.get("JoinRunnerFutures", 0.0), 2),
    }


def _profile(wall_s: float, setup_s: float, transfer_s: float, builder, model) -> dict:
    """Seconds per part of the job (they add up to `wall_s`). `transfer_s`: making the seeds (the rules'
    schedules, similar tasks' traces adapted; measured with the search's batches); `search_and_measure_s` is the
    rest: candidate generation (sampling,
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
    out = {
        "wall_s": wall_s,
        **parts,
        "search_and_measure_s": max(0.0, rest),
        "worker_start_s": max(0.0, batches[0] - median) if batches else 0.0,
    }
    return {k: round(v, 2) for k, v in out.items()}
