"""Tuning works whatever logging the host process set up (pytest's plugin, an application's own)."""

from __future__ import annotations

import logging

import pytest

from relaxtune import api
from relaxtune.config import BucketConfig, JobConfig, TuneConfig
from relaxtune.schedules import task_logs

pytestmark = pytest.mark.integration


@pytest.fixture
def unnamed_handlers():
    """An unnamed handler on every `tvm` logger MetaSchedule's own logging config reads."""
    handler = logging.StreamHandler()
    assert handler.get_name() is None
    names = ["tvm", "tvm.s_tir", "tvm.s_tir.meta_schedule"]
    for name in names:
        logging.getLogger(name).addHandler(handler)
    yield handler
    for name in names:
        logging.getLogger(name).removeHandler(handler)


def test_tuning_with_unnamed_handlers_on_the_tvm_loggers(unnamed_handlers, tmp_path, tiny_mlp, target):
    job = JobConfig(
        cache_dir=tmp_path, tune=TuneConfig(trials=8, trials_per_iter=8), buckets=BucketConfig({"n": (64,)})
    )
    result = api.tune(tiny_mlp, target, job, progress=False)
    assert result.trials_run == 8
    logs = sorted((tmp_path / target_folder(tmp_path)).glob("logs/task_*.log"))
    assert logs and any(p.stat().st_size > 0 for p in logs)
    # nothing of the process's own logging was reconfigured
    assert unnamed_handlers in logging.getLogger("tvm.s_tir.meta_schedule").handlers


def target_folder(cache):
    (folder,) = [p.name for p in cache.iterdir() if p.is_dir()]
    return folder


def test_task_loggers_write_their_own_files_and_close(tmp_path):
    loggers = task_logs.task_loggers(tmp_path, ["a", "b"])
    assert [len(lg.handlers) for lg in loggers] == [1, 1] and not any(lg.propagate for lg in loggers)
    loggers[1].info("hello")
    again = task_logs.task_loggers(tmp_path, ["a", "b"])  # the same job twice in one process: one handler each
    assert [len(lg.handlers) for lg in again] == [1, 1]
    task_logs.close(again)
    assert (tmp_path / "logs" / "task_1_b.log").read_text().endswith("hello\n")
    assert not any(lg.handlers for lg in again)
