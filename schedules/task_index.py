"""The cache's task index (`tasks.jsonl`): what each tuned workload is, and its rule-based time.

MetaSchedule's database stores a static kernel and its records, not which kernel of which model
and bucket it was. The index adds that, one JSON line per task, append-only (a later line for the
same key adds to or updates the earlier one):

    {"key": ..., "kernel": "fused_matmul_add", "workload": "llama-block",
     "bucket": {"n": [65, 128, 128]}, "flops": 1.6e7, "rule_us": 42.0}

`rule_us` is the measured time of the rule-based schedule of the same static kernel: a record
is applied only where it beats it.
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


def measure_rules(mod, target, runs: int = 3) -> float:
    """Median microseconds of the rule-based schedule of a static kernel module (`main`)."""
    import tvm

    from ..relax_passes.pipeline import rule_schedules

    copy = tvm.ir.load_json(tvm.ir.save_json(mod))  # dlight schedules the module it is given in place
    with target:
        scheduled = rule_schedules(target)(copy)
    lib = tvm.compile(scheduled, target=target)
    dev = tvm.cuda(0) if target.kind.name == "cuda" else tvm.cpu(0)
    rng = np.random.default_rng(0)
    args = []
    for param in scheduled["main"].params:
        shape = [int(d) for d in param.shape]
        dtype = str(param.dtype)
        args.append(tvm.runtime.tensor(rng.standard_normal(shape).astype(dtype), dev))
    timer = lib.mod.time_evaluator("main", dev, number=runs, repeat=1, min_repeat_ms=20)
    return float(timer(*args).median * 1e6)
