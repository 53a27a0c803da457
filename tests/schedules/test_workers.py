"""Build and runner workers start without torch (`schedules/workers.py`), and still work."""

from __future__ import annotations

import sys

import pytest


def _torch_state():
    import tvm  # noqa: F401 (what a worker imports first)

    return "torch" in sys.modules and sys.modules["torch"] is not None


def test_pool_workers_run_tvm_without_importing_torch():
    from relaxtune.schedules.workers import Pool

    pool = Pool(max_workers=1, timeout=60)
    try:
        assert pool.submit(_torch_state).result() is False
    finally:
        pool.shutdown()


def test_a_failing_call_is_reported_and_the_worker_replaced():
    from relaxtune.schedules.workers import Pool

    pool = Pool(max_workers=1, timeout=60)
    try:
        with pytest.raises(ZeroDivisionError):
            pool.submit(divmod, 1, 0).result()
        assert pool.submit(divmod, 7, 2).result() == (3, 1)
    finally:
        pool.shutdown()


def test_deferred_runner_is_made_in_the_background_and_reports_its_failure():
    import threading

    from relaxtune.schedules.builder import DeferredRunner

    release, made = threading.Event(), []

    class Fake:
        def run(self, inputs):
            return [x * 2 for x in inputs]

    def slow():
        release.wait(10)
        made.append(threading.current_thread().name)
        return Fake()

    runner = DeferredRunner(slow)
    runner.start()  # returns at once: the factory waits in its own thread
    assert made == []
    release.set()
    assert runner.get().run([1, 2]) == [2, 4] and made == ["relaxtune-runner-start"]

    def broken():
        raise ValueError("no tracker at 127.0.0.1:1")

    with pytest.raises(ValueError, match="no tracker"):
        DeferredRunner(broken).get()


def _library(tmp_path, n: int, target) -> str:
    import tvm
    from tvm import te

    a, b = te.placeholder((n, n), name="a"), te.placeholder((n, n), name="b")
    k = te.reduce_axis((0, n), name="k")
    c = te.compute((n, n), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="c")
    func = te.create_prim_func([a, b, c]).with_attr("global_symbol", "main")
    path = str(tmp_path / f"mm{n}.so")
    tvm.compile(tvm.IRModule({"main": func}), target=target).export_library(path)
    return path, func


def test_a_batch_is_timed_in_turns_and_a_broken_candidate_fails_alone(tmp_path, target):
    """The local runner times a batch's windows in turns (`measure_interleaved`): each candidate gets its own
    fastest window (a 128^3 matmul slower than an 8^3 one, naive loops both), and a candidate whose library does
    not load is a failed run while the others are measured."""
    from tvm.s_tir import meta_schedule as ms

    from relaxtune.schedules.workers import LocalRunner

    small, small_func = _library(tmp_path, 8, target.target)
    large, large_func = _library(tmp_path, 128, target.target)
    inputs = [
        ms.runner.RunnerInput(path, "cpu", ms.arg_info.ArgInfo.from_prim_func(func))
        for path, func in ((small, small_func), (str(tmp_path / "missing.so"), small_func), (large, large_func))
    ]
    runner = LocalRunner(60, ms.runner.EvaluatorConfig(number=1, repeat=3, min_repeat_ms=1))
    try:
        results = [f.result() for f in runner._run_interleaved(inputs)]  # what `run` does with a batch: no fallback
        again = [f.result() for f in runner.run(inputs[:1])]  # one candidate: measured on its own
    finally:
        runner.shutdown()
    assert results[0].error_msg is None and results[2].error_msg is None
    assert len(results[0].run_secs) == 1 and 0 < float(results[0].run_secs[0]) < float(results[2].run_secs[0])
    assert results[1].run_secs is None and "LocalRunner: An exception occurred" in results[1].error_msg
    assert again[0].error_msg is None and float(again[0].run_secs[0]) > 0
