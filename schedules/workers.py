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
`LocalRunner` is MetaSchedule's local runner (its measurement function, evaluator settings and
error messages) on a `Pool`, reporting the fastest of a candidate's timing windows (`repeat`;
`TuneConfig.measure_windows`): on a shared machine other work only ever slows a window, and the mean of
the windows, which MetaSchedule keeps, ranked candidates by how much they were disturbed. On Windows
the workers start as TVM starts them.
"""

from __future__ import annotations

import logging
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

    def _worker_run(self, fn, args, kwargs):
        import threading

        with self._lock:
            tid = threading.get_ident()
            if tid not in self._worker_map:
                self._worker_map[tid] = Worker(
                    self._initializer, self._initargs, self._maximum_process_uses, self._stdout, self._stderr
                )
            proc = self._worker_map[tid]
        proc.send(fn, args, kwargs, self._timeout)
        return proc.recv()


@derived_object
class LocalRunner(ms.runner.PyRunner):
    """MetaSchedule's LocalRunner (one worker, candidates measured one at a time, in order) on a
    `Pool`; made by `builder.make_runner`. Like MetaSchedule's, its constructor waits for the
    worker to start (run it in the background: `builder.DeferredRunner`)."""

    def __init__(self, timeout_sec: float, evaluator_config):
        super().__init__()
        self.timeout_sec = timeout_sec
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
