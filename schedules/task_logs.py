"""Per-task log files for MetaSchedule's tune contexts, made without touching the process's logging.

MetaSchedule's own helper (`ms.logging.get_loggers_from_work_dir`) runs `logging.config.dictConfig`
over a config built from the names of the handlers already attached to `tvm.s_tir.meta_schedule`;
a handler without a name (pytest's capture handler, or any application's own) becomes `None` in
that config and the helper raises. It also re-configures the global MetaSchedule logger. These
loggers are relaxtune's own: one file handler each, named, `propagate=False`, and nothing else in
the process is read or changed.

Contract: `task_loggers(log_dir, names)` returns one logger per name, writing (appending) to
`<log_dir>/logs/task_<i>_<name>.log`; `close(loggers)` closes their files at the end of a job.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

_FORMAT = logging.Formatter("%(asctime)s [%(levelname)s] %(message)s", "%Y-%m-%d %H:%M:%S")


def task_loggers(log_dir: Path, names: list[str]) -> list[logging.Logger]:
    """One DEBUG logger per task, each with its own named file handler under `<log_dir>/logs`."""
    folder = Path(log_dir) / "logs"
    folder.mkdir(parents=True, exist_ok=True)
    width = len(str(max(len(names) - 1, 0)))
    scope = hashlib.sha1(str(folder.resolve()).encode()).hexdigest()[:8]  # two caches in one process
    loggers = []
    for i, name in enumerate(names):
        stem = f"task_{i:0{width}d}_{name[:100]}"
        task_logger = logging.getLogger(f"{__name__}.{scope}.{stem}")
        close([task_logger])  # the same task in an earlier job of this process
        handler = logging.FileHandler(folder / f"{stem}.log", mode="a", delay=True)
        handler.set_name(f"{task_logger.name}.file")
        handler.setFormatter(_FORMAT)
        handler.setLevel(logging.DEBUG)
        task_logger.addHandler(handler)
        task_logger.setLevel(logging.DEBUG)
        task_logger.propagate = False
        loggers.append(task_logger)
    return loggers


def close(loggers: list[logging.Logger]) -> None:
    """Detach and close the file handlers `task_loggers` attached."""
    for task_logger in loggers:
        for handler in list(task_logger.handlers):
            task_logger.removeHandler(handler)
            handler.close()
