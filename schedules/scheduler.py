"""InformedGradient: MetaSchedule's gradient task scheduler, reporting each batch before the next search.

TVM's gradient scheduler first gives every task one batch, round robin, and reports none of them
(cost model update, database, callbacks) until all are sent: each task's results are joined when it
is next picked. So in that first round the search of every task ranks its candidates with a cost
model that has seen nothing of the job, and a job whose budget is one batch per kernel (the main
job: 128 trials, 16 kernels) is never guided by it. Here the runner measures a batch as it is sent
(`workers.LocalRunner` runs the batch before returning), so every batch already measured is
reported (`touch_task`) before the next task is picked (an RPC runner measures in the background: a task
whose batch is still running is joined before it is picked again): each task's first batch is chosen by a
model trained on the batches of the tasks before it (and on the cache's earlier jobs, `cost_model.py`).

After the first round the choice is TVM's: the task with the largest weighted gradient of its best
latency (``alpha`` = 0.2 on the latency drop over the last ``window`` batches, the rest on
best / batches), ties broken at random.
"""

from __future__ import annotations

import random

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

FAILED = 1e9  # a best latency (us) at or above this is no valid measurement


@derived_object
class InformedGradient(ms.task_scheduler.PyTaskScheduler):
    """The gradient scheduler with every measured batch reported before the next pick (module docstring).

    `progress` is the job's `ProgressBar` (a measure callback): its ``best_us`` and ``trials`` per task
    are the latency history the gradient is computed from."""

    def __init__(self, progress, alpha: float = 0.2, window: int = 3, seed: int = 0):
        super().__init__()
        self.progress = progress
        self.alpha = alpha
        self.window = window
        self.rng = random.Random(seed)
        self.history: dict[int, list[float]] = {}  # task -> its best latency after each reported batch
        self.seen: dict[int, int] = {}  # task -> trials reported when its history was last extended

    def _report(self, count: int) -> None:
        outer = self._outer()
        for i in range(count):
            outer.touch_task(i)  # joins a batch whose runs are done (all of them: the runner is synchronous)
            trials = self.progress.trials[i]
            if trials != self.seen.get(i, 0):
                self.seen[i] = trials
                self.history.setdefault(i, []).append(self.progress.best_us[i])

    def next_task_id(self) -> int:
        outer = self._outer()
        count = len(outer.tasks_)
        self._report(count)
        alive = [i for i in range(count) if not outer.tasks_[i].is_terminated]
        if not alive:
            return -1
        fresh = [i for i in alive if i not in self.history]
        if fresh:  # each task's first batch in turn; one still running on an asynchronous runner (RPC) goes last
            chosen = ([i for i in fresh if outer.tasks_[i].runner_futures is None] or fresh)[0]
        else:
            grads = [self._gradient(i, float(outer.tasks_[i].task_weight)) for i in alive]
            chosen = self.rng.choice(alive) if max(grads) == min(grads) else alive[grads.index(max(grads))]
        if outer.tasks_[chosen].runner_futures is not None:  # not reported yet: its runs are still going
            outer.join_running_task(chosen)
        return chosen

    def _gradient(self, task: int, weight: float) -> float:
        history = self.history[task]
        best, n, w = history[-1], len(history), self.window
        if best >= FAILED or best == float("inf"):
            return -FAILED
        g1 = (history[-1 - w] - best) / w if n >= 1 + w and history[-1 - w] < FAILED else 0.0
        g2 = best / n
        return (self.alpha * g1 + (1 - self.alpha) * g2) * weight
