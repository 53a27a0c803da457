"""A MetaSchedule measure callback that drives a tqdm bar: trials, ETA, best GFLOP/s per task."""

from __future__ import annotations

import logging

from tqdm import tqdm
from tvm.s_tir import meta_schedule as ms
from tvm.ir.utils import derived_object

logger = logging.getLogger(__name__)


@derived_object
class ProgressBar(ms.measure_callback.PyMeasureCallback):
    """Counts measured candidates against the job's budget and keeps the best time per task."""

    def __init__(self, total: int, names: list[str], flops: list[float], disable: bool = False):
        super().__init__()
        self.names = names
        self.flops = flops
        self.best_us = [float("inf")] * len(names)
        self.trials = [0] * len(names)
        self.failed = 0
        self.bar = tqdm(total=total, unit="trial", desc="tuning", disable=disable, dynamic_ncols=True)

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results) -> None:
        for build, run in zip(builder_results, runner_results):
            self.trials[task_id] += 1
            if build.error_msg or run.error_msg or not run.run_secs:
                self.failed += 1
                continue
            secs = sum(float(s) for s in run.run_secs) / len(run.run_secs)
            self.best_us[task_id] = min(self.best_us[task_id], secs * 1e6)
        best = self.best_us[task_id]
        gflops = self.flops[task_id] / best / 1e3 if best < float("inf") else 0.0
        self.bar.set_postfix_str(f"{self.names[task_id]}: {best:.0f} us, {gflops:.1f} GFLOP/s, failed {self.failed}")
        self.bar.update(len(measure_candidates))

    def close(self) -> None:
        self.bar.close()
