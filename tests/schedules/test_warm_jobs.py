"""Integration tier, tiny budgets, always runs: a second job over kernels an earlier job tuned.

The tasks are the tiny mlp's kernels at one bucket; the "workloads" are subsets of them, so the
shared kernels are the same static kernels (the same cache keys), as two workloads share them.
"""

from __future__ import annotations

import pytest

from relaxtune.config import BucketConfig, CompileConfig, JobConfig, TuneConfig
from relaxtune.schedules import cache, tune as tune_module
from relaxtune.schedules.database import CacheDatabase

pytestmark = pytest.mark.integration

# transfer off: what the tests count is the share rule, not the seeded first batch
SMALL = dict(trials_per_iter=4, population=16, search_generations=1, build_workers=1, runs_per_measure=1, min_repeat_ms=1, transfer=False)


@pytest.fixture(scope="module")
def kernels(tiny_mlp, target):
    from relaxtune import api

    tasks = api.extract_tasks(tiny_mlp, target, JobConfig(buckets=BucketConfig(single={"n": 16}), compile=CompileConfig(fusion="stock")))
    assert len(tasks) >= 3, [t.name for t in tasks]
    return tasks[:3]


def _job(tasks, folder, target, trials):
    database = CacheDatabase(folder, writable=True)
    result = tune_module.tune(tasks, target.target, database, TuneConfig(trials=trials, **SMALL), folder, progress=False, workload="test")
    return result, {t.name: t.trials for t in result.tasks}


def test_second_workload_measures_only_what_the_first_did_not(kernels, target, tmp_path, monkeypatch):
    a, b, c = kernels
    folder = cache.folder_for(tmp_path, target)
    first, counts = _job([a, b], folder, target, trials=8)  # one batch each
    assert first.trials_run == 8 and counts == {a.name: 4, b.name: 4}
    assert first.shares == {a.name: 4, b.name: 4}

    # a workload sharing a and b, plus c: a and b hold their share (4 of 12), only c is measured
    second, counts = _job([c, b, a], folder, target, trials=12)
    assert second.trials_cached == 8 and second.trials_run == 4
    assert counts == {a.name: 4, b.name: 4, c.name: 4}

    # every kernel holds its share: nothing measured, nothing started
    def no_workers(*args, **kwargs):
        raise AssertionError("build workers started for a job with nothing to measure")

    monkeypatch.setattr(tune_module, "make_builder", no_workers)
    monkeypatch.setattr(tune_module.cost_model, "load", no_workers)
    events = set((folder / "events").glob("*.jsonl"))
    third, counts = _job([a, c], folder, target, trials=8)
    assert third.trials_run == 0 and third.trials_cached == 8 and third.profile == {}
    assert set((folder / "events").glob("*.jsonl")) == events  # no events file for a job that measured nothing
    assert all(t.rule_us == t.rule_us for t in third.tasks)  # rule times come from the index, measured once


def test_larger_budget_tops_up_only_the_kernels_short_of_their_share(kernels, target, tmp_path):
    a, b, c = kernels
    folder = cache.folder_for(tmp_path, target)
    _job([a, b, c], folder, target, trials=12)
    again, _ = _job([a, b, c], folder, target, trials=12)
    assert again.trials_run == 0
    more, counts = _job([a, b, c], folder, target, trials=16)  # one batch more: the most valuable kernel's
    ranked = tune_module.select([a, b, c])
    assert more.trials_run == 4 and counts[ranked[0].name] == 8
    assert sorted(counts.values()) == [4, 4, 8]
