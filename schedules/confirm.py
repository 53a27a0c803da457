"""Each kernel's best record timed against its rule side by side before the build may apply it.

The search keeps the fastest candidate it measured, each candidate once (`TuneConfig.measure_windows`
windows, the fastest kept). On a loaded machine that minimum over many noisy candidates is biased: one
mlp kernel's best, timed at 3.07 ms in the search, ran 1.32x its rule side by side, and the same
decisions with other unroll widths had read 7.9 and 11.7 ms in the same job. So after the search every
task whose best record is not the rule's own point is compiled both ways, as the build applies them
(the rule's schedule; the record's: the rule with its decisions, or its trace replayed), and timed in
turns on the CPU (`ROUNDS` rounds of back-to-back windows of at least `WINDOW_MS`, the order
alternating), and the median of the per-round ratios record / rule goes to the task index
(``confirmed``: the record's measured time, which names it, and the ratio). `ApplyTunedSchedules`
leaves a kernel to its rule where that ratio is above 1 - `MARGIN`. CPU targets measured here only: a GPU or
RPC job's records are checked by the bucket check alone.
"""

from __future__ import annotations

import logging
import statistics
from pathlib import Path

import numpy as np

from . import replay, space, task_index
from .rules import decisions, fast_math
from .tasks import normalize

logger = logging.getLogger(__name__)

WINDOW_MS = 5
# a record must be this much faster than its rule side by side to ship, as the bucket check asks of a bucket: an mlp
# kernel confirmed at 0.985 during its job ran 1.14x its rule when timed again under other load
MARGIN = 0.03


def ships_rule(confirmed: dict, record_time_us: float) -> bool:
    """Whether a task index's ``confirmed`` entry sends the record of that measured time back to its rule."""
    return confirmed.get("record_us") == record_time_us and confirmed.get("ratio", 0.0) > 1 - MARGIN


def record_us(record) -> float:
    """The record's measured time (us), as the build compares it: the mean of its run seconds."""
    return sum(float(s) for s in record.run_secs) / len(record.run_secs) * 1e6


RULE_LOOKUP = 256  # records of a kernel searched for the rule's own point


def rule_point_us(database, static, target) -> float | None:
    """The time the job's runner measured for the rule's own point of the rules' space of `static` (its first
    candidate, `seeded_search.py`): the record whose rule and decisions are the rule's defaults; None where
    there is none (a generic task, an older cache)."""
    import tvm

    mod = normalize(static)
    rule = space.tunable_rule(mod, target) if target is not None else None
    if rule is None or not database.has_workload(mod):
        return None
    probe = decisions.Probe()
    if not rule.sketch(tvm.s_tir.Schedule(mod), target, probe):
        return None
    own = (type(rule).__name__, {c.name: c.default for c in probe.choices})
    for record in database.get_top_k(database.commit_workload(mod), RULE_LOOKUP):
        if decisions.read(record.trace) == own:
            return record_us(record)
    return None


def tuned_kernel(record, static, target):
    """The record's schedule of the static kernel `static`, as `ApplyTunedSchedules` makes it."""
    found = decisions.read(record.trace)
    if found is not None:
        return space.schedule_from_decisions(static, target, *found)
    return fast_math.rewrite(replay.apply_trace(static, replay.generalize(record.trace)))


def paired_ratio(rule_lib, tuned_lib, args, rounds: int) -> float:
    """The median over `rounds` of the tuned kernel's window / the rule's, timed back to back, the order alternating."""
    import tvm

    timers = [
        lib.mod.time_evaluator("main", tvm.cpu(0), number=1, repeat=1, min_repeat_ms=WINDOW_MS)
        for lib in (rule_lib, tuned_lib)
    ]
    for timer in timers:
        timer(*args)  # warm-up
    ratios = []
    for r in range(rounds):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        us = {i: timers[i](*args).mean for i in order}
        ratios.append(us[1] / us[0])
    return statistics.median(ratios)


def confirm(tasks, database, target, folder: Path, rounds: int) -> dict[str, float]:
    """Time each task's best record against its rule (module docstring); returns and indexes task -> ratio."""
    import tvm

    index = task_index.load(folder)
    done, entries = {}, []
    rng = np.random.default_rng(0)
    for task in tasks:
        if not database.has_workload(task.mod):
            continue
        top = database.get_top_k(database.commit_workload(task.mod), 1)
        if not top:
            continue
        record, static = top[0], task.mod["main"]
        mine = record_us(record)
        if index.get(task.key, {}).get("confirmed", {}).get("record_us") == mine:
            continue  # this record was confirmed by an earlier job
        rule_us = rule_point_us(database, static, target)
        if rule_us == mine and decisions.read(record.trace) is not None:
            continue  # the best record is the rule's own point
        try:
            tuned = tuned_kernel(record, static, target)
            rule_lib = tvm.compile(task_index.rule_scheduled(task.mod, target), target=target)
            tuned_lib = tvm.compile(tvm.IRModule({"main": tuned.with_attr("global_symbol", "main")}), target=target)
        except Exception as err:  # pylint: disable=broad-except  # the build finds the same failure and keeps the rule
            logger.warning("%s: its best record does not build here (%s): not confirmed", task.name, err)
            continue
        args = [
            tvm.runtime.tensor(rng.standard_normal([int(d) for d in p.shape]).astype(str(p.dtype)), tvm.cpu(0))
            for p in static.params
        ]
        done[task.name] = paired_ratio(rule_lib, tuned_lib, args, rounds)
        entries.append({"key": task.key, "confirmed": {"record_us": mine, "ratio": round(done[task.name], 4)}})
        logger.info("%s: best record / rule side by side %.3f", task.name, done[task.name])
    task_index.append(folder, entries)
    return done
