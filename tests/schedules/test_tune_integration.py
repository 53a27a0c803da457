"""Integration tier, tiny budget, always runs: tune → cache → compile → correct at every n."""

from __future__ import annotations

import numpy as np
import pytest

from relaxtune import api
from relaxtune.config import BucketConfig, JobConfig, TuneConfig
from relaxtune.runtime.artifact import prepare_params

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, tiny_mlp, target):
    job = JobConfig(
        cache_dir=tmp_path_factory.mktemp("cache"),
        tune=TuneConfig(trials=16, trials_per_iter=8),
        buckets=BucketConfig({"n": (1, 16, 64)}),  # three buckets keep the tier fast
    )
    first = api.tune(tiny_mlp, target, job, progress=False)
    return job, first


def test_tuning_commits_every_trial(tuned):
    job, first = tuned
    assert first.trials_run == 16 and first.trials_cached == 0
    assert sum(t.trials for t in first.tasks) == 16
    assert any(t.best_us < float("inf") for t in first.tasks)


def test_same_job_again_runs_zero_trials(tuned, tiny_mlp, target):
    job, _ = tuned
    again = api.tune(tiny_mlp, target, job, progress=False)
    assert again.trials_run == 0 and again.trials_cached == 16


def test_larger_budget_continues_from_the_cache(tuned, tiny_mlp, target):
    job, _ = tuned
    more = api.tune(tiny_mlp, target, job.with_(tune=TuneConfig(trials=24, trials_per_iter=8)), progress=False)
    assert more.trials_cached == 16 and more.trials_run == 8


def test_compiled_with_cache_matches_reference_at_every_n(tuned, tiny_mlp, target):
    import tvm
    from tvm import relax

    job, _ = tuned
    executable, report, _ = api.build(tiny_mlp, target, job)
    # every call site with a record used it, or kept its rules because they measured faster (the
    # kernel alone, or the bucket's block in the check after tuning)
    consulted = sum(
        v
        for k, v in report.items()
        if k.startswith("tuned")
        or k
        in (
            "rules faster than record",
            "the rule is the best record",
            "rule faster side by side",
            "bucket faster with rules: rules",
        )
    )
    assert consulted >= 1, report
    vm = relax.VirtualMachine(executable, tvm.cpu())
    params = prepare_params(vm, [tvm.runtime.tensor(v) for v in tiny_mlp.params.values()])
    for b, n in [(1, 1), (2, 1), (1, 2), (1, 17), (2, 33), (1, 64)]:
        inputs = tiny_mlp.random_inputs({"b": b, "n": n})
        out = vm["main"](tvm.runtime.tensor(inputs["x"]), *params).numpy()
        np.testing.assert_allclose(out, tiny_mlp.reference(inputs, tiny_mlp.params), rtol=1e-4, atol=1e-5)


def test_another_workload_reuses_shared_kernels(tuned, tiny_mlp, target):
    from relaxtune.schedules import cache
    from relaxtune.schedules.database import CacheDatabase
    from relaxtune.workloads import load

    job, _ = tuned
    llama = load(
        "llama-block", {"hidden": "64", "heads": "4", "kv_heads": "2", "ffn": "128", "max_seq": "64", "max_batch": "2"}
    )
    mlp_keys = {t.key for t in api.extract_tasks(tiny_mlp, target, job)}
    shared = [t for t in api.extract_tasks(llama, target, job) if t.key in mlp_keys]
    assert shared, "the SwiGLU kernels of llama-block are the mlp's kernels"
    db = CacheDatabase(cache.folder_for(job.cache_dir, target))
    reused = [t for t in shared if db.records_for(t.mod)]
    assert reused, "records tuned for mlp are found for llama-block"
    from relaxtune.schedules.tune import trial_counts

    cached = sum(trial_counts(db, api.extract_tasks(llama, target, job)).values())  # failed trials count too
    again = api.tune(llama, target, job.with_(tune=TuneConfig(trials=cached, trials_per_iter=8)), progress=False)
    assert again.trials_run == 0 and again.trials_cached == cached


def test_each_kernels_first_candidate_is_its_rule_and_the_best_never_loses_to_it(tuned, tiny_mlp, target):
    """The rules' space (the default): every task's first measured candidate is the rule's own schedule (its default
    decisions; the events file keeps the measured order), so the best record of a kernel is never slower than the
    rule measured beside it."""
    import json

    from relaxtune.schedules import cache, confirm, space
    from relaxtune.schedules.database import CacheDatabase
    from relaxtune.schedules.rules import decisions

    job, _ = tuned
    folder = cache.folder_for(job.cache_dir, target)
    db = CacheDatabase(folder)
    first_batch = {}
    for path in sorted((folder / "events").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event["ev"] == "batch":
                first_batch.setdefault(event["task"], event)
    tasks = {t.name: t for t in api.extract_tasks(tiny_mlp, target, job)}
    assert first_batch
    for name, batch in first_batch.items():
        rule = decisions.read(space.rule_candidate(tasks[name].mod, target.target, space.postprocs()).sch.trace)
        assert batch["decisions"][0] == rule[1], name  # measured first
        records = db.records_for(tasks[name].mod)
        assert all(decisions.read(r.trace) is not None for r in records)  # every candidate a point of the space
        rule_us = [min(float(s) for s in r.run_secs) for r in records if decisions.read(r.trace) == rule]
        assert min(float(s) for s in records[0].run_secs) <= rule_us[0]
        own = [r for r in records if decisions.read(r.trace) == rule][0]  # what the build weighs a record against
        want = sum(float(s) for s in own.run_secs) / len(own.run_secs) * 1e6
        assert confirm.rule_point_us(db, tasks[name].mod["main"], target.target) == pytest.approx(want)


def test_generic_space_is_still_searched(tmp_path, tiny_mlp, target):
    """--space generic: MetaSchedule's own space, no rule schedule measured first."""
    from relaxtune.schedules import cache
    from relaxtune.schedules.database import CacheDatabase
    from relaxtune.schedules.rules import decisions

    job = JobConfig(
        cache_dir=tmp_path,
        tune=TuneConfig(trials=8, trials_per_iter=8, space="generic", check_buckets=False),
        buckets=BucketConfig({"n": (1, 64)}),
    )
    result = api.tune(tiny_mlp, target, job, progress=False)
    assert result.trials_run == 8
    db = CacheDatabase(cache.folder_for(job.cache_dir, target))
    records = db.get_all_tuning_records()
    assert len(records) == 8 and all(decisions.read(r.trace) is None for r in records)


def test_each_best_record_is_timed_against_its_rule_and_kept_only_where_faster(tuned, tiny_mlp, target, tmp_path):
    """After the search every kernel whose best record is not the rule's own point has the side-by-side ratio of
    that record to its rule in the task index (schedules/confirm.py); a ratio of 1 or more sends the kernel back
    to its rule in the build."""
    import shutil
    from collections import Counter

    from relaxtune.schedules import cache, confirm, task_index
    from relaxtune.schedules.database import CacheDatabase

    job, _ = tuned
    folder = cache.folder_for(job.cache_dir, target)
    index, db = task_index.load(folder), CacheDatabase(folder)
    tasks = api.extract_tasks(tiny_mlp, target, job)
    confirmed = []
    for task in tasks:
        records = db.records_for(task.mod)
        if not records:
            continue
        entry = index.get(task.key, {}).get("confirmed")
        mine = confirm.record_us(records[0])
        if entry is None:  # only the rule's own point goes unconfirmed
            assert confirm.rule_point_us(db, task.mod["main"], target.target) == pytest.approx(mine), task.name
        else:
            assert entry["record_us"] == mine and entry["ratio"] > 0, task.name
            confirmed.append(task)
    if not confirmed:
        pytest.skip("every best record of this tiny job was its rule's own point")
    copy = tmp_path / "cache"
    shutil.copytree(job.cache_dir, copy)
    folder_copy = cache.folder_for(copy, target)
    (folder_copy / "buckets.jsonl").unlink(missing_ok=True)  # no bucket verdicts: every record would apply
    lines = [
        {"key": t.key, "confirmed": {"record_us": confirm.record_us(db.records_for(t.mod)[0]), "ratio": 1.5}}
        for t in confirmed
    ]
    task_index.append(folder_copy, lines)
    _, report, _ = api.build(tiny_mlp, target, job.with_(cache_dir=copy))
    assert Counter(report)["rule faster side by side"] >= 1, report


def test_a_record_ships_only_3_percent_faster_than_its_rule_side_by_side():
    from relaxtune.schedules import confirm

    assert confirm.ships_rule({"record_us": 5.0, "ratio": 0.985}, 5.0)  # within the margin: the rule
    assert not confirm.ships_rule({"record_us": 5.0, "ratio": 0.9}, 5.0)
    assert not confirm.ships_rule({"record_us": 4.0, "ratio": 2.0}, 5.0)  # another record was confirmed: not this one
    assert not confirm.ships_rule({}, 5.0)
