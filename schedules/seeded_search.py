"""SeededSearch: MetaSchedule's evolutionary search with given candidates measured first, none twice.

- **Seeds first.** A task's first batches hold its seeds ahead of the search's own picks: the rule's
  own schedule (the rules' design space, `space.rule_candidate`), so the first measured candidate of
  every task is the rule and the search can only improve on it, then the candidates transferred from
  similar tasks' best records (`transfer.py`), made when the task's first batch is searched, so that
  they include what the job measured for the tasks before it (a bucket's kernel takes the decisions
  the same kernel of the bucket tuned before it found). The evolutionary search, guided by the cost
  model, fills the rest of the batch. Measured like any batch, they are committed to the cache, where
  the search's next batches start their population from them.
- **No candidate measured twice.** TVM's evolutionary search starts each batch's population from the
  database's best records but does not count them as measured (a TODO in its source), so a trained
  cost model ranks them first again and the best records are measured again, batch after batch. Here
  a candidate whose scheduled module the cache (this task's records) or this job already measured is
  dropped, and the search is asked for more, up to `REFILLS` times.

Where seeds take part of a batch, the search's picks are cut to the rest keeping their mix: MetaSchedule
returns the cost model's best picks first, then its random ones (`eps_greedy`, `explore`), and both are
kept in proportion. Trials are counted as the inner search counts them: each batch returned is one batch
of its budget.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import tvm_ffi
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

logger = logging.getLogger(__name__)

REFILLS = 3  # extra calls of the inner search per batch to replace already-measured candidates
MAX_KNOWN = 256  # cached records per task whose modules are remembered as measured


def module_key(mod) -> int:
    return int(tvm_ffi.structural_hash(mod))


def measured_keys(database, mod, postprocs) -> set[int]:
    """Module keys of the task's cached records (up to `MAX_KNOWN`), each replayed and postprocessed
    as the search replays them."""
    import tvm

    keys = set()
    if not database.has_workload(mod):
        return keys
    for record in database.get_top_k(database.commit_workload(mod), MAX_KNOWN):
        sch = tvm.s_tir.Schedule(mod)
        try:
            record.trace.apply_to_schedule(sch, remove_postproc=True)
            sch.enter_postproc()
            if all(p.apply(sch) for p in postprocs):
                keys.add(module_key(sch.mod))
        except (RuntimeError, ValueError, IndexError):  # a record that no longer replays
            continue
    return keys


@dataclass
class Budget:
    """The job's trials left, shared by every task's search: a batch never takes more (MetaSchedule checks
    the global budget only before a batch, so a short batch, one whose already-measured picks were
    dropped, let the last one overshoot it)."""

    left: int = 1 << 62


@dataclass
class SeedBox:
    """A task's seeds (the search and its clones share the box) and the `time.time()` each of its batches was
    handed to the builder (MetaSchedule reports a batch's results only when it next picks the task, or at the
    end). `make`, when set, makes the seeds when the task's first batch is searched: by then the cache holds
    the batches the job measured for the tasks before it, which transfer to this one."""

    seeds: list = field(default_factory=list)
    sent: list[float] = field(default_factory=list)
    make: Callable[[], list] | None = None
    budget: Budget = field(default_factory=Budget)


@derived_object
class SeededSearch(ms.search_strategy.PySearchStrategy):
    """`inner` (an EvolutionarySearch) with the box's seeds measured first and no module measured twice."""

    def __init__(self, inner, box: SeedBox, explore: float = 0.0):
        super().__init__()
        self.inner = inner
        self.box = box
        self.explore = explore
        self.pending: list = []
        self.known: set[int] = set()
        self.batch = 0
        self.left = 0
        self.postprocs: list = []

    def _initialize_with_tune_context(self, context) -> None:
        self.inner._initialize_with_tune_context(context)
        self.mod = context.mod
        self.postprocs = list(context.space_generator.postprocs)

    def pre_tuning(self, max_trials, num_trials_per_iter, design_spaces, database=None, cost_model=None) -> None:
        self.inner.pre_tuning(max_trials, num_trials_per_iter, design_spaces, database, cost_model)
        self.batch, self.left = num_trials_per_iter, max_trials
        self.pending = list(self.box.seeds)
        self.known = measured_keys(database, self.mod, self.postprocs) if database is not None else set()

    def post_tuning(self) -> None:
        self.inner.post_tuning()

    def _take(self, candidates, out: list, room: int) -> int:
        """Append the candidates not measured yet to `out` until it holds `room`; returns how many of
        `candidates` were looked at."""
        used = 0
        for candidate in candidates:
            if len(out) >= room:
                break
            used += 1
            key = module_key(candidate.sch.mod)
            if key not in self.known:
                self.known.add(key)
                out.append(candidate)
        return used

    def generate_measure_candidates(self):
        if self.box.budget.left <= 0:
            return None
        if self.box.make is not None:
            self.box.seeds, self.box.make = list(self.box.make()), None
            self.pending = list(self.box.seeds)
        room = min(self.batch, self.left, self.box.budget.left)
        out: list = []
        self.pending = self.pending[self._take(self.pending, out, room) :]
        dropped = 0
        for _ in range(1 + REFILLS):
            if len(out) >= room:
                break
            picks = self.inner.generate_measure_candidates()
            if not picks:
                break
            picks = self._mix(list(picks), room - len(out))
            before = len(out)
            dropped += self._take(picks, out, room) - (len(out) - before)
        if dropped:
            logger.debug("%d candidate(s) already measured were dropped", dropped)
        if out:
            self.box.sent.append(time.time())
            self.box.budget.left -= len(out)
        return out or None

    def _mix(self, picks: list, room: int) -> list:
        """`picks` (the model's best first, its random ones last) ordered so the first `room` keep the mix (at
        least one random pick where the search made any and there is room for two)."""
        if len(picks) <= room:
            return picks
        randoms = min(round(len(picks) * self.explore), len(picks))
        keep = min(randoms, max(1, round(room * randoms / len(picks)))) if randoms and room > 1 else 0
        front = picks[: len(picks) - randoms]
        back = picks[len(picks) - randoms :]
        return front[: room - keep] + back[:keep] + front[room - keep :] + back[keep:]

    def notify_runner_results(self, measure_candidates, results) -> None:
        self.left -= len(results)
        self.inner.notify_runner_results(measure_candidates, results)

    def clone(self) -> SeededSearch:
        return SeededSearch(self.inner.clone(), self.box, self.explore)
