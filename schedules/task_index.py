"""The cache's task index (`tasks.jsonl`): what each tuned workload is, and its rule-based time.

MetaSchedule's database stores a static kernel and its records, not which kernel of which model
and bucket it was. The index adds that, one JSON line per task, append-only (a later line for the
same key adds to or updates the earlier one):

    {"key": ..., "kernel": "fused_matmul_add", "workload": "llama-block",
     "bucket": {"n": [65, 128, 128]}, "flops": 1.6e7, "rule_us": 42.0}

`rule_us` is the measured time of the rule-based schedule of the same static kernel: a record
is applied only where it beats it. On a CPU it is measured here, one kernel after another, before
the job's build workers start (`measure_rules`). On a GPU the rule schedules go through the job's
builder and runner like candidates (`measure_rules_batch`): built on every core at once, device
code included, and timed by the runner with the evaluator settings the records are measured with.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from .database import append_lines, read_lines

logger = logging.getLogger(__name__)

INDEX = "tasks.jsonl"


def load(folder: Path) -> dict[str, dict]:
    entries: dict[str, dict] = {}
    path = Path(folder) / INDEX
    for number, entry, _ in read_lines(path):
        try:
            entries.setdefault(entry["key"], {}).update(entry)
        except (KeyError, TypeError, ValueError):  # None (not JSON) or not an entry
            logger.warning("%s:%d: damaged task-index line skipped", path, number)
    return entries


def append(folder: Path, entries: list[dict]) -> None:
    append_lines(folder, INDEX, entries)


def rule_scheduled(mod, target):
    """The static kernel module scheduled by the rules (a copy: dlight schedules in place)."""
    import tvm

    from .rules import rule_schedules

    copy = tvm.ir.load_json(tvm.ir.save_json(mod))
    with target:
        return rule_schedules(target)(copy)


def measure_rules_batch(mods: list, target, builder, runner) -> list[float | None]:
    """Microseconds of each module's rule-based schedule, built by `builder` (all at once) and
    timed by `runner`; None where the build or the run failed (logged)."""
    from tvm.s_tir import meta_schedule as ms

    from .builder import build_and_run

    scheduled = [rule_scheduled(m, target) for m in mods]
    builds, runs = build_and_run(
        [(s, ms.arg_info.ArgInfo.from_prim_func(s["main"])) for s in scheduled], target, builder, runner
    )
    times: list[float | None] = [None] * len(mods)
    for i, (b, result) in enumerate(zip(builds, runs)):
        if b.error_msg:
            logger.warning(
                "rule schedule %d of %d does not build: %s",
                i + 1,
                len(mods),
                b.error_msg.strip().splitlines()[-1][:200],
            )
        elif result.error_msg or not result.run_secs:
            logger.warning(
                "rule schedule %d of %d does not run: %s",
                i + 1,
                len(mods),
                (result.error_msg or "no time").strip().splitlines()[-1][:200],
            )
        else:
            times[i] = sum(float(x) for x in result.run_secs) / len(result.run_secs) * 1e6
    return times


def measure_rules(mod, target, windows: int = 10, window_ms: int = 5) -> float:
    """Microseconds of the rule-based schedule of a static kernel module (`main`): the fastest of `windows`
    timing windows of at least `window_ms` (as the local runner times candidates, `workers.LocalRunner`)."""
    import tvm

    scheduled = rule_scheduled(mod, target)
    lib = tvm.compile(scheduled, target=target)
    dev = tvm.cuda(0) if target.kind.name == "cuda" else tvm.cpu(0)
    rng = np.random.default_rng(0)
    args = []
    for param in scheduled["main"].params:
        shape = [int(d) for d in param.shape]
        dtype = str(param.dtype)
        args.append(tvm.runtime.tensor(rng.standard_normal(shape).astype(dtype), dev))
    timer = lib.mod.time_evaluator("main", dev, number=1, repeat=windows, min_repeat_ms=window_ms)
    return float(min(timer(*args).results) * 1e6)
