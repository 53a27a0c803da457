"""A MetaSchedule measure callback: the progress bar, the job's events file, per-task early stop.

Runs after MetaSchedule's default callbacks (records committed, cost model updated) for every
measured batch:
- drives a tqdm bar: trials, ETA, best GFLOP/s per task;
- appends one JSON line per batch to the job's events file (`EventLog`): the time, the task,
  each candidate's time or error, its decisions in the rules' space (`rules/decisions.py`; null
  for a generic candidate), when the batch was sent to the builder (`sent`: MetaSchedule reports a
  batch when it next picks the task, so `t` can be much later) and the cost model's held-out scores
  of the batch, which `relaxtune
  report tuning` turns into curves and per-kernel rule / tuned times; the cache itself is never
  rewritten;
- stops a task whose best time has not improved by `min_gain` for `patience` batches in a row
  (`TaskScheduler.terminate_task`): the gradient scheduler then gives its trials to the others;
- past the job's `deadline` (`TuneConfig.time_limit_s`), stops every task it safely can: the one
  just measured and those with nothing in flight (a task in flight stops at its own callback), so
  the search ends within about one batch of the limit and the job goes on to its bucket check.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from tqdm import tqdm
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from .rules import decisions

logger = logging.getLogger(__name__)

EVENTS = "events"  # folder of per-job event files in the cache's target folder


class EventLog:
    """One job's `<folder>/events/<utc time>-<pid>.jsonl`, appended and flushed line by line."""

    def __init__(self, folder: Path):
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        self.path = Path(folder) / EVENTS / f"{stamp}-{os.getpid()}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, kind: str, **fields) -> None:
        line = json.dumps({"ev": kind, "t": time.time(), **fields}, separators=(",", ":"))
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()


def short_error(message: str) -> str:
    """The first informative line of a MetaSchedule build or run error (the reason, no trace)."""
    lines = [ln.strip() for ln in str(message).splitlines() if ln.strip()]
    for line in lines:
        if "Error" in line or "Timeout" in line or "error" in line:
            return line[:200]
    return lines[0][:200] if lines else "unknown"


@derived_object
class ProgressBar(ms.measure_callback.PyMeasureCallback):
    """Counts measured candidates against the job's budget and keeps the best time per task."""

    def __init__(
        self,
        total: int,
        names: list[str],
        flops: list[float],
        disable: bool = False,
        events: EventLog | None = None,
        cost_model=None,
        patience: int = 0,
        min_gain: float = 0.01,
        deadline: float = 0.0,
        sent: list[list[float]] | None = None,
    ):
        super().__init__()
        self.sent = sent  # per task, the time.time() each of its batches was sent to the builder (SeedBox)
        self.batches = [0] * len(names)
        self.names = names
        self.flops = flops
        self.best_us = [float("inf")] * len(names)
        self.trials = [0] * len(names)
        self.failed = 0
        self.failed_builds = 0
        self.events = events
        self.cost_model = cost_model
        self.patience = patience
        self.min_gain = min_gain
        self.stale = [0] * len(names)
        self.stopped: list[str] = []
        self.deadline = deadline  # time.perf_counter() value after which the search stops (0: none)
        self.timed_out = False
        self._held_out_seen = 0
        self.total = total
        self.bar = tqdm(total=total, unit="trial", desc="tuning", disable=disable, dynamic_ncols=True)

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results) -> None:
        chosen = [decisions.read(c.sch.trace) for c in measure_candidates]
        self.record(
            task_scheduler,
            task_id,
            len(measure_candidates),
            builder_results,
            runner_results,
            [found[1] if found else None for found in chosen],
        )

    def record(
        self, task_scheduler, task_id: int, count: int, builder_results, runner_results, chosen: list | None = None
    ) -> None:
        """What `apply` does, callable from Python with any result objects (tests); `task_scheduler` None: no
        early stop; `chosen`: each candidate's decisions in the rules' space (`rules/decisions.read`), None for a
        generic one."""
        before = self.best_us[task_id]
        times, errors = [], []
        for build, run in zip(builder_results, runner_results):
            self.trials[task_id] += 1
            if build.error_msg or run.error_msg or not run.run_secs:
                self.failed += 1
                self.failed_builds += bool(build.error_msg)
                kind = "build" if build.error_msg else "run"
                errors.append([kind, short_error(build.error_msg or run.error_msg or "no run time")])
                times.append(None)
                continue
            secs = sum(float(s) for s in run.run_secs) / len(run.run_secs)
            times.append(secs * 1e6)
            self.best_us[task_id] = min(self.best_us[task_id], secs * 1e6)
        best = self.best_us[task_id]
        if self.events is not None:
            scores = None
            held_out = getattr(self.cost_model, "held_out", None)
            if held_out is not None and len(held_out) > self._held_out_seen:
                scores = held_out[-1]["scores"]
                self._held_out_seen = len(held_out)
            self.events.write(
                "batch",
                task=self.names[task_id],
                us=times,
                errors=errors,
                best_us=best if best < float("inf") else None,
                scores=scores,
                decisions=chosen,
                sent=self._sent(task_id),
            )
        self.batches[task_id] += 1
        self._early_stop(task_scheduler, task_id, before)
        self._stop_at_deadline(task_scheduler, task_id)
        gflops = self.flops[task_id] / best / 1e3 if best < float("inf") else 0.0
        self.bar.set_postfix_str(f"{self.names[task_id]}: {best:.0f} us, {gflops:.1f} GFLOP/s, failed {self.failed}")
        self.bar.update(count)

    def _sent(self, task_id: int) -> float | None:
        """When this batch of the task was sent to the builder (None where not known)."""
        sent = self.sent[task_id] if self.sent is not None and task_id < len(self.sent) else []
        return sent[self.batches[task_id]] if self.batches[task_id] < len(sent) else None

    def _early_stop(self, task_scheduler, task_id: int, before: float) -> None:
        best = self.best_us[task_id]
        gained = best < float("inf") and (before == float("inf") or best < before * (1 - self.min_gain))
        self.stale[task_id] = 0 if gained else self.stale[task_id] + 1
        if self.patience and self.stale[task_id] >= self.patience and task_scheduler is not None:
            if task_scheduler.tasks_[task_id].is_terminated:  # the scheduler ended it (budget spent, or its space done)
                return
            if self._budget_sent(task_scheduler, task_id):
                # no trials left to give away; and in its final drain the scheduler ends this task itself after the
                # callback
                return
            name = self.names[task_id]
            logger.info(
                "%s: no gain over %d batches, best %.1f us: stopped; its trials go to the other tasks",
                name,
                self.patience,
                best,
            )
            self.stopped.append(name)
            if self.events is not None:
                self.events.write("stop", task=name, best_us=best if best < float("inf") else None)
            task_scheduler.terminate_task(task_id)

    def _stop_at_deadline(self, task_scheduler, task_id: int) -> None:
        if not self.deadline or task_scheduler is None or time.perf_counter() < self.deadline:
            return
        if self._budget_sent(task_scheduler, task_id):
            return  # the scheduler's final drain ends every task itself
        if not self.timed_out:
            logger.info("time limit reached after %d trials: the search stops", sum(self.trials))
            if self.events is not None:
                self.events.write("time_limit", trials=sum(self.trials))
        self.timed_out = True
        for i, task in enumerate(task_scheduler.tasks_):
            in_flight = i != task_id and getattr(task, "runner_futures", None) is not None
            if not task.is_terminated and not in_flight:
                task_scheduler.terminate_task(i)

    def _budget_sent(self, task_scheduler, task_id: int) -> bool:
        """Whether every trial of the budget is measured or in flight. Then MetaSchedule sends no more
        candidates, and once it stops picking tasks it joins each running task and ends it without
        checking whether a callback already did (TerminateTask: `Check failed: (!task->is_terminated)`,
        which crashed a 128-trial job of llama-block): an early stop there gains nothing and must not happen."""
        in_flight = sum(
            len(t.runner_futures)
            for i, t in enumerate(task_scheduler.tasks_)
            if i != task_id and getattr(t, "runner_futures", None) is not None
        )
        return sum(self.trials) + in_flight >= self.total

    def close(self) -> None:
        self.bar.close()
