"""The GPU tuning job's parts that run anywhere: the search time limit, rule times through the
builder and runner, CUDA candidates compiled in the build workers, compile at the tuned buckets."""

from __future__ import annotations

import shutil
import time
from types import SimpleNamespace

import pytest

from relaxtune.config import BucketConfig, JobConfig, TuneConfig
from relaxtune.errors import UserError


class _Scheduler:
    """What the callback reads of MetaSchedule's task scheduler: its tasks and terminate_task."""

    def __init__(self, in_flight: list[bool]):
        self.tasks_ = [SimpleNamespace(is_terminated=False, runner_futures=[1] if f else None) for f in in_flight]

    def terminate_task(self, i: int) -> None:
        assert not self.tasks_[i].is_terminated, "terminated twice (MetaSchedule aborts)"
        self.tasks_[i].is_terminated = True


def _bar(deadline: float, total: int = 100):
    from relaxtune.schedules.progress import ProgressBar

    return ProgressBar(total, ["a", "b", "c"], [1e6] * 3, disable=True, deadline=deadline)


def _result(us: float):
    return SimpleNamespace(error_msg=None, run_secs=[us * 1e-6])


def test_past_the_time_limit_every_idle_task_stops():
    scheduler = _Scheduler([True, True, False])  # task 0 just measured, 1 still in flight, 2 idle
    bar = _bar(deadline=time.perf_counter() - 1)
    bar.record(scheduler, 0, 1, [_result(5)], [_result(5)])
    assert [t.is_terminated for t in scheduler.tasks_] == [True, False, True]
    assert bar.timed_out and bar.stopped == []  # not an early stop: the tasks are not retired
    bar.record(scheduler, 1, 1, [_result(5)], [_result(5)])  # the in-flight one stops at its own callback
    assert all(t.is_terminated for t in scheduler.tasks_)


def test_before_the_limit_or_with_the_budget_sent_nothing_stops():
    scheduler = _Scheduler([True, False, False])
    _bar(deadline=time.perf_counter() + 3600).record(scheduler, 0, 1, [_result(5)], [_result(5)])
    _bar(deadline=0.0).record(scheduler, 0, 1, [_result(5)], [_result(5)])  # no limit
    _bar(deadline=time.perf_counter() - 1, total=1).record(scheduler, 0, 1, [_result(5)], [_result(5)])  # final drain
    assert not any(t.is_terminated for t in scheduler.tasks_)


def test_a_negative_time_limit_is_refused():
    with pytest.raises(UserError, match="time-limit -1"):
        TuneConfig(time_limit_s=-1)


def test_rule_times_through_the_builder_and_runner(tiny_mlp, target):
    from relaxtune import api
    from relaxtune.schedules import task_index
    from relaxtune.schedules.builder import make_builder, make_runner

    tasks = api.extract_tasks(tiny_mlp, target, JobConfig(buckets=BucketConfig({"n": (1, 64)})))
    config = TuneConfig(build_workers=1)
    builder, runner = make_builder(config), make_runner(config)
    try:
        times = task_index.measure_rules_batch([t.mod for t in tasks[:2]], target.target, builder, runner)
    finally:
        builder.shutdown()
        runner.shutdown()
    assert len(times) == 2 and all(t is not None and 0 < t < 1e6 for t in times)


@pytest.mark.skipif(
    shutil.which("nvcc") is None and not __import__("os").path.exists("/usr/local/cuda/bin/nvcc"), reason="needs nvcc"
)
def test_cuda_candidates_carry_compiled_device_code():
    import tvm
    from tvm import te
    from tvm.s_tir import dlight as dl

    from relaxtune import targets
    from relaxtune.schedules.build_worker import build_and_export

    target = targets.resolve("cuda").target
    a = te.placeholder((1024,), "float32", name="a")
    mod = tvm.IRModule({"main": te.create_prim_func([a, te.compute((1024,), lambda i: a[i] * 2.0, name="b")])})
    with target:
        mod = dl.ApplyDefaultSchedule(dl.gpu.Fallback())(mod)
    data = open(build_and_export((mod, target)), "rb").read()
    assert b"fatbin" in data and b"__global__" not in data  # nvcc's binary, no CUDA C for the runner to compile


def test_compile_uses_the_buckets_the_cache_was_tuned_at(tmp_path, tiny_mlp, target):
    from relaxtune import api
    from relaxtune.schedules import cache

    job = JobConfig(cache_dir=tmp_path)
    folder = cache.folder_for(tmp_path, target)
    folder.mkdir(parents=True)
    assert api.tuned_buckets(tiny_mlp, target, job) is None  # nothing tuned: the default plan
    cache.write_manifest(
        folder,
        target,
        tiny_mlp.name,
        {"config": tiny_mlp.config, "buckets": {"n": [[1, 1, 1], [2, 16, 16], [17, 64, 64]], "b": [[1, 2, 1]]}},
    )
    assert api.tuned_buckets(tiny_mlp, target, job).edges == {"n": (1, 16, 64)}
    cache.write_manifest(folder, target, tiny_mlp.name, {"config": {**tiny_mlp.config, "hidden": 128}})
    assert api.tuned_buckets(tiny_mlp, target, job) is None  # tuned for another config


def test_a_job_past_its_time_limit_ends_after_one_batch(tmp_path, tiny_mlp, target, monkeypatch):
    """In the job's task scheduler (`schedules/scheduler.py`, which reports each batch before the next pick):
    the callback after the first measured batch ends the search well short of the budget, with nothing retired."""
    from relaxtune import api
    from relaxtune.schedules import task_index
    from relaxtune.schedules import tune as tune_module

    monkeypatch.setattr(tune_module, "_past", lambda deadline: False)  # let the search start despite the limit
    job = JobConfig(
        cache_dir=tmp_path,
        tune=TuneConfig(trials=64, time_limit_s=1e-3, check_buckets=False, transfer=False),
        buckets=BucketConfig({"n": (1, 64)}),
    )
    result = api.tune(tiny_mlp, target, job, progress=False)
    shares = len(result.shares)
    assert shares > 1 and result.trials_run == 8 < 64, (result.trials_run, result.shares)
    index = task_index.load(next(p for p in tmp_path.iterdir() if p.is_dir()))
    assert not any("stopped_at" in entry for entry in index.values())
