"""The search's per-task state: MetaSchedule `TuneContext`s of the kernels a job measures, and their seeds.

Each kernel short of its share gets a context in its design space (`space.py`) with the evolutionary search
wrapped by `SeededSearch` (`seeded_search.py`), its own logger and random state; a kernel whose design space
cannot be generated is left out here, before the search (it keeps its rules). Its seeds (the rule's own schedule,
then candidates transferred from similar tasks, `transfer.py`) are made when its first batch is searched. Used
by the tuning driver (`tune.py`).
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

from ..config import TuneConfig
from . import shares, space, task_logs, transfer
from .rules import decisions
from .seeded_search import Budget, SeedBox, SeededSearch
from .tasks import Task

logger = logging.getLogger(__name__)


def make_contexts(
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


def set_seeds(tasks, contexts, boxes, cached, target, config, database, events, seconds: list) -> None:
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
        events.write("seeds", tasks=[seeds_event(task, seeds)])
        if len(seeds) > (config.space != "generic"):
            logger.info("%s: %d seed candidate(s) measured first", task.name, len(seeds))
        seconds[0] += time.perf_counter() - mark
        return seeds

    for task, context, box in zip(tasks, contexts, boxes):
        box.make = functools.partial(make, task, context)


def seeds_event(task: Task, seeds: list) -> dict:
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
