"""`relaxtune report tuning`: two tiny real tuning jobs (the second warm-starts the saved cost
model), then the report's JSON keys, markdown and PNGs; bad input is one line."""

from __future__ import annotations

import json

import pytest

from relaxtune.__main__ import main

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cache(tmp_path_factory, tiny_mlp, target):
    from relaxtune import api
    from relaxtune.config import BucketConfig, JobConfig, TuneConfig
    from relaxtune.schedules import cache as cache_folder
    from relaxtune.schedules import cost_model

    small = dict(  # no prior: the first job starts cold, the second from the first's model
        trials_per_iter=4,
        population=16,
        search_generations=1,
        build_workers=1,
        runs_per_measure=1,
        min_repeat_ms=1,
        cost_prior=False,
    )
    job = JobConfig(
        cache_dir=tmp_path_factory.mktemp("cache"),
        tune=TuneConfig(trials=4, **small),
        buckets=BucketConfig(single={"n": 16}),
    )
    first = api.tune(tiny_mlp, target, job, progress=False)
    folder = cache_folder.folder_for(job.cache_dir, target)
    saved = (folder / cost_model.MODEL_FILE).read_bytes()
    second = api.tune(tiny_mlp, target, job.with_(tune=TuneConfig(trials=8, **small)), progress=False)
    return job.cache_dir, folder, first, second, saved


def test_jobs_save_and_warm_start_the_cost_model(cache):
    from relaxtune.schedules import cost_model

    _, folder, first, second, saved = cache
    assert first.trials_run == 4 and second.trials_run == 4
    starts = [json.loads(f.read_text().splitlines()[0]) for f in sorted((folder / "events").glob("*.jsonl"))]
    assert [s["warm_model"] for s in starts] == [False, True]
    assert starts[1]["model_samples"] == 4  # what the first job measured
    model, warm = cost_model.load(folder)
    assert warm and model.data_size == 8 and (folder / cost_model.MODEL_FILE).read_bytes() != saved
    assert set(first.profile) >= {"wall_s", "build_s", "cost_model_update_s", "search_and_measure_s"}
    assert sum(
        v
        for k, v in first.profile.items()
        if k
        in {"setup_s", "transfer_s", "build_s", "cost_model_predict_s", "cost_model_update_s", "search_and_measure_s"}
    ) == pytest.approx(first.profile["wall_s"], abs=0.1)


def test_report_json_markdown_and_plots(cache, tmp_path, capsys):
    cache_dir, _, first, second, _ = cache
    out = tmp_path / "report"
    code = main(
        [
            "report",
            "tuning",
            "--cache",
            str(cache_dir),
            "--target",
            "cpu",
            "--out",
            str(out),
            "--json",
            str(out / "t.json"),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads((out / "t.json").read_text())
    assert set(report) >= {"tasks", "trials_per_s", "failed_builds", "failed_runs", "failures", "ranking", "jobs"}
    assert report["tasks"] and all(set(t) >= {"name", "trials", "best_us", "wall_s"} for t in report["tasks"])
    assert sum(t["trials"] for t in report["tasks"]) == 8 and len(report["jobs"]) == 2
    assert report["trials_per_s"] > 0 and isinstance(report["failed_builds"], int)
    tuned = {t.name: t.best_us for t in second.tasks if t.trials}
    rules = {t.name: t.rule_us for t in second.tasks if t.trials}
    for task in report["tasks"]:
        assert task["best_us"] == pytest.approx(tuned[task["name"]], rel=1e-6)  # the cache's best is the events' best
        assert task["rules_us"] == pytest.approx(rules[task["name"]], rel=1e-6)  # tuned vs rules, per kernel
    assert "| rules us | tuned / rules |" in (out / "tuning.md").read_text()
    assert report["ranking"]["batches"] >= 1  # the second job's batch was scored by the saved model
    assert (out / "tuning.md").read_text().strip() in printed
    for png in ("tuning-latency.png", "tuning-throughput.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_without_events_is_one_line(tmp_path, capsys):
    code = main(["report", "tuning", "--cache", str(tmp_path), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and str(tmp_path) in err[0]
    code = main(["report", "tuning", "--cache", str(tmp_path / "missing"), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "missing" in err[0]
