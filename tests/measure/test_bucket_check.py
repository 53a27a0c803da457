"""The check after tuning: each bucket's block timed with and without its records; compile follows."""

from __future__ import annotations

import json

import numpy as np
import pytest

from relaxtune import api
from relaxtune.config import BucketConfig, JobConfig, TuneConfig
from relaxtune.measure.bucket_check import _points, mismatch
from relaxtune.runtime.artifact import prepare_params
from relaxtune.schedules import cache, verdicts

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def checked(tmp_path_factory, tiny_mlp, target):
    """A tuned cache whose records all get applied (their rule times forgotten), then checked."""
    from relaxtune.measure.bucket_check import check_buckets
    from relaxtune.schedules import task_index

    job = JobConfig(
        cache_dir=tmp_path_factory.mktemp("cache"),
        # MetaSchedule's own space, no side-by-side confirmation: records that are not the rules' own schedules,
        # all applied, whatever a loaded machine makes of 16 trials (the rules' space often keeps its first point)
        tune=TuneConfig(trials=16, trials_per_iter=8, space="generic", confirm_rounds=0),
        buckets=BucketConfig({"n": (1, 16, 64)}),
    )
    result = api.tune(tiny_mlp, target, job, progress=False)
    folder = cache.folder_for(job.cache_dir, target)
    task_index.append(folder, [{"key": key, "rule_us": None} for key in task_index.load(folder)])
    return job, result, check_buckets(tiny_mlp, target, job)


def test_points_are_the_tuning_point_and_the_middle():
    assert _points({"n": [17, 64, 64], "b": [1, 4, 1]}) == [{"n": 64, "b": 1}, {"n": 33, "b": 2}]
    assert _points({"n": [1, 1, 1]}) == [{"n": 1}]


def test_mismatch_is_relative_and_refuses_nan_and_shape_changes():
    want = [np.array([[1.0, -4.0], [2.0, 0.5]], dtype="float32")]
    assert mismatch([want[0].copy()], want) == 0.0
    assert mismatch([want[0] + np.float32(0.002)], want) == pytest.approx(0.0005, rel=1e-3)  # 0.002 / max |want| = 4
    assert mismatch([np.where(want[0] > 1, np.nan, want[0])], want) == float("inf")
    assert mismatch([want[0][:1]], want) == float("inf")
    with pytest.raises(ValueError):  # a different number of outputs
        mismatch([want[0], want[0]], want)


def test_every_bucket_with_applied_records_gets_a_measured_verdict(checked, target):
    job, result, entries = checked
    assert result.trials_run == 16
    assert entries and {e["bucket"] for e in entries} >= {b["bucket"] for b in result.buckets}
    folder = cache.folder_for(job.cache_dir, target)
    stored = verdicts.load(folder)
    for entry in entries:
        assert entry["verdict"] in verdicts.VERDICTS and entry["records_ms"] > 0 and entry["rules_ms"] > 0
        assert entry["verdict"] == ("records" if entry["records_ms"] < (1 - 0.03) * entry["rules_ms"] else "rules")
        assert 0 <= entry["error"] <= 1  # the records' outputs matched the rules' (in units of TOLERANCE)

        assert stored[entry["signature"]]["bucket"] == entry["bucket"]


def _run(executable, workload, ns):
    import tvm
    from tvm import relax

    vm = relax.VirtualMachine(executable, tvm.cpu())
    params = prepare_params(vm, [tvm.runtime.tensor(v) for v in workload.params.values()])
    for b, n in ns:
        inputs = workload.random_inputs({"b": b, "n": n})
        out = vm["main"](tvm.runtime.tensor(inputs["x"]), *params).numpy()
        np.testing.assert_allclose(out, workload.reference(inputs, workload.params), rtol=1e-4, atol=1e-5)


def test_compile_follows_the_verdicts(checked, tiny_mlp, target, tmp_path):
    job, _, _ = checked
    every = verdicts.Verdicts()
    _, report, folder = api.build(tiny_mlp, target, job, verdicts=every)
    tuned = sum(v for k, v in report.items() if k.startswith("tuned"))
    assert every.seen and tuned >= 1, report
    # the check said rules everywhere: no record is applied, results still right
    lose = verdicts.Verdicts({sig: {"signature": sig, "verdict": "rules"} for sig, _ in every.seen.values()})
    executable, report, _ = api.build(tiny_mlp, target, job, verdicts=lose)
    assert not any(k.startswith("tuned") for k in report) and report["bucket faster with rules: rules"] == tuned, report
    _run(executable, tiny_mlp, [(1, 1), (2, 5), (1, 17), (2, 64)])
    # records everywhere: the same calls as with no verdicts
    win = verdicts.Verdicts({sig: {"signature": sig, "verdict": "records"} for sig, _ in every.seen.values()})
    _, report, _ = api.build(tiny_mlp, target, job, verdicts=win)
    assert sum(v for k, v in report.items() if k.startswith("tuned")) == tuned


def test_cli_tune_prints_and_writes_the_verdicts(checked, tiny_mlp, target, tmp_path, capsys):
    from relaxtune.__main__ import main

    out = tmp_path / "tune.json"
    code = main(
        [
            "tune",
            "mlp",
            "--config",
            "hidden=32,ffn=64,max_seq=64,max_batch=2",
            "--buckets",
            "n=1,16,64",
            "--trials",
            "8",
            "--cache",
            str(tmp_path / "c"),
            "--no-progress",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    data = json.loads(out.read_text())
    assert all(b["verdict"] in verdicts.VERDICTS for b in data["buckets"])  # none where every record lost to its rules
    printed = capsys.readouterr().out
    assert printed.count("(side by side;") == len(data["buckets"])


def test_records_with_other_outputs_than_the_rules_lose(checked, tiny_mlp, target, monkeypatch):
    """The only correctness check a cuda schedule gets: outputs off by more than the dtype allows -> rules."""
    from relaxtune.measure import bucket_check

    job, _, _ = checked
    monkeypatch.setattr(bucket_check, "mismatch", lambda got, want: float("inf"))
    entries = bucket_check.check_buckets(tiny_mlp, target, job)
    assert entries and all(e["verdict"] == "rules" and e["error"] == "inf" for e in entries), entries


def test_a_job_without_new_trials_checks_only_buckets_without_a_verdict(checked, tiny_mlp, target, tmp_path):
    """Verdicts name the bucket's kernels: a cache checked with another compiler gets checked, even
    when no trial runs."""
    import dataclasses
    import shutil

    from relaxtune.measure.bucket_check import check_buckets

    job, _, _ = checked
    folder = cache.folder_for(job.cache_dir, target)
    lines = (folder / verdicts.FILE).read_text()
    assert (
        check_buckets(tiny_mlp, target, job, only_unchecked=True) == []
    )  # every bucket has its verdict: one build, no timing
    assert (folder / verdicts.FILE).read_text() == lines
    shutil.copytree(job.cache_dir, tmp_path / "c")
    (cache.folder_for(tmp_path / "c", target) / verdicts.FILE).unlink()  # as if checked under other kernel names
    again = api.tune(tiny_mlp, target, dataclasses.replace(job, cache_dir=tmp_path / "c"), progress=False)
    assert again.trials_run == 0 and again.buckets  # no trial, yet checked: the records' buckets had no verdict
    assert set(verdicts.load(cache.folder_for(tmp_path / "c", target))) == {e["signature"] for e in again.buckets}
