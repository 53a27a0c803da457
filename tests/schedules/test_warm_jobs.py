"""Integration tier, tiny budgets, always runs: a second job over kernels an earlier job tuned.

The tasks are the tiny mlp's kernels at one bucket; the "workloads" are subsets of them, so the
shared kernels are the same static kernels (the same cache keys), as two workloads share them.
"""

from __future__ import annotations

import pytest

from relaxtune.config import BucketConfig, CompileConfig, JobConfig, TuneConfig
from relaxtune.schedules import cache
from relaxtune.schedules import tune as tune_module
from relaxtune.schedules.database import CacheDatabase

pytestmark = pytest.mark.integration

# transfer off: what the tests count is the share rule, not the seeded first batch
SMALL = dict(
    trials_per_iter=4,
    population=16,
    search_generations=1,
    build_workers=1,
    runs_per_measure=1,
    min_repeat_ms=1,
    transfer=False,
)


@pytest.fixture(scope="module")
def kernels(tiny_mlp, target):
    from relaxtune import api

    tasks = api.extract_tasks(
        tiny_mlp, target, JobConfig(buckets=BucketConfig(single={"n": 16}), compile=CompileConfig(fusion="stock"))
    )
    assert len(tasks) >= 3, [t.name for t in tasks]
    return tasks[:3]


def _job(tasks, folder, target, trials):
    database = CacheDatabase(folder, writable=True)
    result = tune_module.tune(
        tasks, target.target, database, TuneConfig(trials=trials, **SMALL), folder, progress=False, workload="test"
    )
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


def _matmul_task(add: bool):
    """A 16x64x32 matmul kernel, with or without a fused residual add, as a task."""
    import tvm
    import tvm_ffi
    from tvm import te

    from relaxtune.schedules.tasks import Task

    a, b = te.placeholder((16, 64), name="a"), te.placeholder((64, 32), name="b")
    k = te.reduce_axis((0, 64), name="k")
    out = te.compute((16, 32), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="matmul")
    args = [a, b]
    if add:
        r = te.placeholder((16, 32), name="r")
        out, args = te.compute((16, 32), lambda i, j: out[i, j] + r[i, j], name="T_add"), [a, b, r]
    mod = tvm.IRModule(
        {"main": te.create_prim_func([*args, out]).with_attr("global_symbol", "main").with_attr("tirx.noalias", True)}
    )
    name = "fused_matmul_add@n16" if add else "matmul@n16"
    return Task(
        name=name, mod=mod, key=str(tvm_ffi.structural_hash(mod)), flops=2.0 * 16 * 64 * 32, bucket={}, weight=1.0
    )


def test_another_jobs_trials_of_the_same_main_computation_are_credited(target, tmp_path):
    """A plain matmul after a job that tuned the same matmul with a residual add fused: it owes one
    batch (its carried traces), not its whole share, and that batch holds the fused kernel's tiling."""
    fused, plain = _matmul_task(add=True), _matmul_task(add=False)
    folder = cache.folder_for(tmp_path, target)
    database = CacheDatabase(folder, writable=True)
    config = TuneConfig(trials=8, **{**SMALL, "transfer": True})
    first = tune_module.tune([fused], target.target, database, config, folder, progress=False, workload="first")
    assert first.trials_run == 8
    second = tune_module.tune([plain], target.target, database, config, folder, progress=False, workload="second")
    assert second.trials_run == 4 and second.shares == {plain.name: 8}  # 4 of fused's 8 credited
    tiles = lambda trace: [list(trace.decisions[i]) for i in trace.insts if i.kind.name == "SamplePerfectTile"]  # noqa: E731
    fused_tiles = [tiles(r.trace) for r in database.records_for(fused.mod)]
    assert any(tiles(r.trace) in fused_tiles for r in database.records_for(plain.mod))
    again = tune_module.tune([plain], target.target, database, config, folder, progress=False, workload="second")
    assert again.trials_run == 0
