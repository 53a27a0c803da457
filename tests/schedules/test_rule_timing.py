"""Rule-based times (the bar a record must beat) are measured before the build workers start."""

from __future__ import annotations

import pytest

from relaxtune import api
from relaxtune.config import BucketConfig, JobConfig, TuneConfig

pytestmark = pytest.mark.integration


def test_rules_are_timed_on_a_quiet_machine(tmp_path, tiny_mlp, target, monkeypatch):
    from relaxtune.schedules import task_index
    from relaxtune.schedules import tune as tune_module

    state = {"started": False, "timed_while_started": 0, "timed": 0}
    real_make_builder, real_measure = tune_module.make_builder, task_index.measure_rules

    def make_builder(config):
        builder = real_make_builder(config)
        start = builder.start

        def started():
            state["started"] = True
            start()

        builder.start = started
        return builder

    def measure_rules(mod, target, windows: int = 10, window_ms: int = 5):
        state["timed"] += 1
        state["timed_while_started"] += state["started"]
        return real_measure(mod, target, windows, window_ms)

    monkeypatch.setattr(tune_module, "make_builder", make_builder)
    monkeypatch.setattr(task_index, "measure_rules", measure_rules)
    job = JobConfig(
        cache_dir=tmp_path, tune=TuneConfig(trials=8, check_buckets=False), buckets=BucketConfig({"n": (1, 64)})
    )
    result = api.tune(tiny_mlp, target, job, progress=False)
    assert result.trials_run == 8 and state["started"]
    assert state["timed"] >= 1 and state["timed_while_started"] == 0
