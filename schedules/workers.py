"""Worker processes that build and measure candidates, started without importing torch.

`import tvm` imports torch whenever torch is installed: tvm_ffi imports it first, as a workaround
for a symbol clash seen with Windows, Python 3.12 and torch 2.9. Here that makes a fresh process's
`import tvm` 2.8-3.0 s instead of 0.82-0.90 s (3 runs each; a build worker's whole start-up with
its warm-up build and MetaSchedule's runner module: 0.96 s). A tuning job starts three worker
processes (one build worker per core and the runner's), and its first batch waits for them: on
this 2-core machine they were the largest fixed cost of a job (`worker_start_s` 1.6-3.1 s).

Neither kind of worker uses torch: a build worker lowers and compiles TIR (`build_worker.py`),
the runner's loads the built library and times it on arrays TVM allocates. So their processes run
TVM's own worker loop (`tvm.exec.popen_worker`) after marking torch absent
(`sys.modules["torch"] = None`, which makes `import torch` raise the ImportError tvm_ffi expects
when torch is not installed). `Pool` is TVM's `PopenPoolExecutor` with such workers;
`LocalRunner` is MetaSchedule's local runner (its evaluator settings and error messages) on a `Pool`,
reporting the fastest of a candidate's timing windows (`repeat`; `TuneConfig.measure_windows`): on a shared
machine other work only ever slows a window, and the mean of the windows, which MetaSchedule keeps, ranked
candidates by how much they were disturbed. A batch's windows are taken in turns (`measure_interleaved`: every
candidate's first window, then every candidate's second, ...), so load that comes and goes during the batch
falls on all its candidates alike. One after another, as MetaSchedule measures, each candidate saw the load
of its own second or so: the same point of the same kernel, measured in 4 main jobs on the shared 2-core box,
differed from its other measurements by a median of 40% (log), more than the 10-25% that separates a batch's
candidates, and a cost model's ranking of a batch could not beat chance by more than that allowed
(docs/results.md). On Windows the workers start as TVM starts them.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.runner.local_runner import LocalRunnerFuture, _worker_func
from tvm.s_tir.meta_schedule.utils import get_global_func_with_default_on_worker
from tvm.support.popen_pool import PopenPoolExecutor, PopenWorker

logger = logging.getLogger(__name__)

# run as `python -c PRELUDE <read fd> <write fd>`: the worker loop reads its pipes from argv[1:3]
PRELUDE = "import sys; sys.modules['torch'] = None; from tvm.exec.popen_worker import main; main()"


class Worker(PopenWorker):
    """TVM's PopenWorker, its process started by `PRELUDE` (POSIX: the same pipes as TVM's)."""

    def _start(self):
        if self._proc is not None:
            return
        if sys.platform == "win32":
            super()._start()
            return
        main_read, worker_write = os.pipe()
        worker_read, main_write = os.pipe()
        cmd = [sys.executable, "-c", PRELUDE, str(worker_read), str(worker_write)]
        self._proc = subprocess.Popen(
            cmd, pass_fds=(worker_read, worker_write), stdout=self._stdout, stderr=self._stderr
        )
        os.close(worker_read)
        os.close(worker_write)
        self._reader = os.fdopen(main_read, "rb")
        self._writer = os.fdopen(main_write, "wb")


class Pool(PopenPoolExecutor):
    """TVM's PopenPoolExecutor whose per-thread worker is a `Worker`."""

    def submit_timed(self, timeout: float, fn, *args):
        """`submit` with its own timeout (a batch's: one candidate's times the batch size)."""
        return self._threadpool.submit(self._worker_run, fn, args, {}, timeout)

    def _worker_run(self, fn, args, kwargs, timeout: float | None = None):
        import threading

        with self._lock:
            tid = threading.get_ident()
            if tid not in self._worker_map:
                self._worker_map[tid] = Worker(
                    self._initializer, self._initargs, self._maximum_process_uses, self._stdout, self._stderr
                )
            proc = self._worker_map[tid]
        proc.send(fn, args, kwargs, self._timeout if timeout is None else timeout)
        return proc.recv()


def measure_interleaved(
    paths: list[str], device_types: list[str], args_info: list, windows: int, window_ms: float
) -> list[tuple[float | None, str | None]]:
    """Run in the runner's worker: each candidate's library loaded and its arguments allocated once (as
    MetaSchedule's runner does), then `windows` rounds of one timing window of at least `window_ms` per candidate,
    in turns; per candidate (the fastest window's seconds per run, None) or (None, the error that stopped it)."""
    import tvm
    from tvm.s_tir.meta_schedule.runner.local_runner import default_alloc_argument

    timers: list = []
    out: list[list] = []
    for path, device_type, info in zip(paths, device_types, args_info):
        try:
            mod = tvm.runtime.load_module(path)
            device = tvm.runtime.device(device_type, 0)
            args = default_alloc_argument(device, info, 1)[0]
            first = mod.time_evaluator(mod.entry_name, device, number=1, repeat=1, min_repeat_ms=window_ms)
            secs = float(first(*args).results[0])
            number = max(1, math.ceil(window_ms * 1e-3 / max(secs, 1e-9)))  # runs per window, as the first had
            timers.append((mod.time_evaluator(mod.entry_name, device, number=number, repeat=1), args))
            out.append([secs, None])
        except Exception as err:  # noqa: BLE001 (a candidate that does not load or run is a failed run)
            timers.append(None)
            out.append([None, str(err)])
    for _ in range(windows - 1):
        for i, timer in enumerate(timers):
            if timer is None:
                continue
            try:
                out[i][0] = min(out[i][0], float(timer[0](*timer[1]).results[0]))
            except Exception as err:  # noqa: BLE001
                timers[i], out[i] = None, [None, str(err)]
    return [(secs, error) for secs, error in out]


@derived_object
class LocalRunner(ms.runner.PyRunner):
    """MetaSchedule's LocalRunner (one worker) on a `Pool`, a batch's timing windows taken in turns (`interleave`,
    module docstring; False: one candidate after another, as MetaSchedule measures); made by
    `builder.make_runner`. Like MetaSchedule's, its constructor waits for the worker to start (run it in the
    background: `builder.DeferredRunner`)."""

    def __init__(self, timeout_sec: float, evaluator_config, interleave: bool = True):
        super().__init__()
        self.timeout_sec = timeout_sec
        self.interleave = interleave
        self.evaluator_config = ms.runner.EvaluatorConfig._normalized(evaluator_config)
        self.pool = Pool(
            max_workers=1,
            timeout=timeout_sec,
            stderr=subprocess.DEVNULL if logging.root.level > logging.DEBUG else subprocess.STDOUT,
        )
        self.pool.submit(
            get_global_func_with_default_on_worker, None, None
        ).result()  # MetaSchedule's sanity check: started, its modules imported

    def shutdown(self) -> None:
        """End the worker process and wait for it (so its CPU time is its parent's children's)."""
        self.pool.shutdown(wait=True)

    def run(self, runner_inputs):
        if self.interleave and len(runner_inputs) > 1:
            try:
                return self._run_interleaved(runner_inputs)
            except Exception as err:  # noqa: BLE001 (a batch that timed out or crashed the worker: one at a time)
                logger.debug("interleaved measurement failed (%s): measuring the batch one candidate at a time", err)
        return self._run_each(runner_inputs)

    def _run_interleaved(self, runner_inputs) -> list:
        """The batch measured in turns (`measure_interleaved`), in one call of at most the batch's timeout."""
        future = self.pool.submit_timed(
            self.timeout_sec * len(runner_inputs),
            measure_interleaved,
            [str(r.artifact_path) for r in runner_inputs],
            [str(r.device_type) for r in runner_inputs],
            [tuple(a.as_json() for a in r.args_info) for r in runner_inputs],
            self.evaluator_config.repeat,
            self.evaluator_config.min_repeat_ms,
        )
        return [
            LocalRunnerFuture(res=[secs], error_message=None)
            if error is None
            else LocalRunnerFuture(res=None, error_message="LocalRunner: An exception occurred\n" + error)
            for secs, error in future.result()
        ]

    def _run_each(self, runner_inputs) -> list:
        """One candidate after another, each in its own call (MetaSchedule's measurement function)."""
        results = []
        for runner_input in runner_inputs:
            future = self.pool.submit(
                _worker_func,
                None,
                None,
                None,
                self.evaluator_config,
                1,
                str(runner_input.artifact_path),
                str(runner_input.device_type),
                tuple(a.as_json() for a in runner_input.args_info),
            )
            try:
                results.append(LocalRunnerFuture(res=[min(future.result())], error_message=None))
            except TimeoutError:
                results.append(
                    LocalRunnerFuture(
                        res=None, error_message=f"LocalRunner: Timeout, killed after {self.timeout_sec} seconds\n"
                    )
                )
            except Exception as err:  # noqa: BLE001 (MetaSchedule's runner reports any failure as a failed run)
                results.append(
                    LocalRunnerFuture(res=None, error_message="LocalRunner: An exception occurred\n" + str(err))
                )
        return results
