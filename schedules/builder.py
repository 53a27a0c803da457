"""MetaSchedule builder and runner sized for this project: persistent build workers, no 35 s import.

Stock `LocalBuilder` starts fresh worker processes for every batch and runs `import
tvm.s_tir.tensor_intrin` inside the timed build of each, so on a small machine every candidate
times out. Here the build function skips that import (scheduled candidates are already tensorized
when they reach the builder; `build_worker.py`), and the workers are started once per job, warmed
up (TVM imported, one kernel built) outside the timeout, and reused for every batch, in processes
that do not import torch (`workers.py`: 0.96 s to start instead of ~3); they are recycled after
`RECYCLE_AFTER` builds each, which bounds the memory leak that made stock restart them per batch.
Each batch's wall time is kept in `stats` for the tuning profile.

The local runner (`make_runner`) is MetaSchedule's `LocalRunner` on the same kind of worker
(`workers.LocalRunner`); its constructor starts its worker process and waits for a sanity check
in it: 2.15 s of a 2.5 s job set-up (mlp, 40 trials).
`DeferredRunner` builds it in a background thread instead, started with the build workers, and
the first `run` waits for it: the runner's worker starts while the build workers do and while the
first batch is searched and built, which needs no runner.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.builder import BuilderResult

from ..config import TuneConfig
from .build_worker import build_and_export, build_without_intrin_import, warm_up  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

RECYCLE_AFTER = 256  # builds per worker process before it is replaced


@derived_object
class PersistentBuilder(ms.builder.PyBuilder):
    """A LocalBuilder whose worker processes live for the whole job."""

    def __init__(self, max_workers: int, timeout_sec: float):
        super().__init__()
        self.max_workers = max_workers
        self.timeout_sec = timeout_sec
        self.stats = {"batches": 0, "candidates": 0, "failed": 0, "seconds": 0.0, "batch_seconds": []}
        self._pool = None

    def _executor(self):
        from .workers import Pool

        if self._pool is None:
            self._pool = Pool(
                max_workers=self.max_workers,
                timeout=self.timeout_sec,
                initializer=warm_up,
                maximum_process_uses=RECYCLE_AFTER,
            )
        return self._pool

    def start(self) -> None:
        """Start and warm up every worker now, in the background, so their start-up overlaps the
        job's set-up (task contexts, transfer) instead of delaying the first batch."""
        pool = self._executor()
        for _ in range(self.max_workers):  # each blocks its thread briefly: one per worker thread
            pool.submit(time.sleep, 0.2)

    def build(self, build_inputs):
        from tvm.support.popen_pool import StatusKind

        start = time.perf_counter()
        results = []
        jobs = [(b.mod, b.target) for b in build_inputs]
        for outcome in self._executor().map_with_error_catching(build_and_export, jobs):
            if outcome.status == StatusKind.COMPLETE:
                results.append(BuilderResult(outcome.value, None))
            elif outcome.status == StatusKind.TIMEOUT:
                results.append(BuilderResult(None, f"LocalBuilder: Timeout, killed after {self.timeout_sec} seconds"))
            else:
                results.append(BuilderResult(None, "LocalBuilder: An exception occurred\n" + str(outcome.value)))
        self.stats["batches"] += 1
        self.stats["candidates"] += len(results)
        self.stats["failed"] += sum(1 for r in results if r.error_msg)
        self.stats["seconds"] += time.perf_counter() - start
        self.stats["batch_seconds"].append(round(time.perf_counter() - start, 3))
        return results

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


@derived_object
class DeferredRunner(ms.runner.PyRunner):
    """A runner made by `factory()` in a background thread from `start()` on; `run` waits for it
    (and raises what the factory raised)."""

    def __init__(self, factory):
        super().__init__()
        self._factory = factory
        self._runner = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._make, name="relaxtune-runner-start", daemon=True)
            self._thread.start()

    def _make(self) -> None:
        try:
            self._runner = self._factory()
        except BaseException as err:  # noqa: BLE001 (re-raised in the tuning thread by `get`)
            self._error = err

    def get(self):
        """The runner, once made (starts it here if `start` was not called)."""
        self.start()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._runner

    def run(self, runner_inputs):
        return self.get().run(runner_inputs)

    def shutdown(self) -> None:
        """End the runner's worker once made (waits for the making)."""
        if self._thread is not None:
            self._thread.join()
            if self._runner is not None and hasattr(self._runner, "shutdown"):
                self._runner.shutdown()


def make_builder(config: TuneConfig) -> PersistentBuilder:
    """Call `shutdown()` on it when the job ends (the workers are started on the first batch)."""
    workers = config.build_workers or os.cpu_count() or 1
    return PersistentBuilder(max_workers=workers, timeout_sec=config.build_timeout_s)


def make_runner(config: TuneConfig):
    """Measures here (LocalRunner), or on the tracker's servers when `config.rpc_tracker` is set."""
    if config.rpc_tracker:
        from .rpc import make_rpc_runner

        evaluator = ms.runner.EvaluatorConfig(
            number=config.runs_per_measure, repeat=1, min_repeat_ms=config.min_repeat_ms
        )
        return make_rpc_runner(config, evaluator)
    from .workers import LocalRunner

    evaluator = ms.runner.EvaluatorConfig(number=1, repeat=config.measure_windows, min_repeat_ms=config.window_ms)
    return LocalRunner(timeout_sec=config.run_timeout_s, evaluator_config=evaluator)


def build_and_run(items: list, target, builder, runner) -> tuple[list, list]:
    """Build `items` ((module, args info) pairs) in one batch and run the ones that built; returns
    (builder results, runner results), a failed build's runner result carrying the build's error.
    The built artifacts are removed once run."""
    device = "cuda" if "gpu" in target.keys else "cpu"  # a device name: tvm.device("llvm") is an error
    builds = builder.build([ms.builder.BuilderInput(mod, target) for mod, _ in items])
    inputs, where = [], []
    for i, ((_, args_info), b) in enumerate(zip(items, builds)):
        if b.error_msg is None:
            inputs.append(ms.runner.RunnerInput(b.artifact_path, device, args_info))
            where.append(i)
    runs = [ms.runner.RunnerResult(None, b.error_msg) for b in builds]
    for i, future in zip(where, runner.run(inputs) if inputs else []):
        runs[i] = future.result()
    for b in builds:
        if b.artifact_path:
            shutil.rmtree(Path(b.artifact_path).parent, ignore_errors=True)
    return builds, runs
