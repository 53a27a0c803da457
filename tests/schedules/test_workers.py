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
