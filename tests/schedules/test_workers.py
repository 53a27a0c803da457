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
