"""Each kernel's share of a job's trial budget, and what the job still owes it.

A job's budget (`TuneConfig.trials`) is split over its live kernels (`job_tasks.select`: most valuable
first, value = expected calls x FLOPs), in whole batches, since the search measures a batch at a
time:

- as many kernels as get one batch each are taken, most valuable first (`trials // trials_per_iter`
  of them; the others keep their rules or borrow records);
- each taken kernel gets one batch, the other batches go by value (largest remainder, ties to the
  more valuable kernel), and the trials left over from whole batches go to the most valuable one,
  so the shares add up to the budget exactly.

A kernel owes nothing once the cache holds its share, whichever job (of this workload or another
sharing the kernel) measured those trials. The job tunes only the kernels short of their share,
for the sum of their shortfalls and never more than the budget minus every cached trial of the
job's kernels (`plan`); within that, the gradient task scheduler spends trials where the gains are. So the same job run
twice measures nothing the second time, an interrupted
job measures exactly the rest, a larger budget later measures more, and a second workload whose
kernels an earlier job already tuned to their share measures nothing for them. A kernel an earlier
job stopped early (no gain) keeps its share and is owed nothing more.

Trials of the same main computation count too. A kernel whose main computation (its blocks with
a reduction, at the same shapes: `transfer.core`) another job measured on a kernel with other
fused element-wise blocks (mlp's down projection, a plain matmul, after llama-block's, which fuses
the residual add) gets those trials credited toward its share (`borrowed`): that search explored
this kernel's tiling, and its best traces are carried here (`transfer.py`). A kernel without a
record of its own still owes one batch of its share (its first batch: the carried traces,
measured on it; without a record of its own it would keep its rule-based schedule); the credit
covers at most the rest. So mlp after llama-block at 40 trials owes its SwiGLU kernel 8 (share
24, 16 measured by llama-block) and its down projection 8 (share 16, one batch; llama-block
measured 8 on its fused twin), 16 trials where 24 were owed before; run again, it owes nothing.
Credited trials count against the budget as cached ones do.
"""

from __future__ import annotations

from dataclasses import dataclass


def split(values: list[float], total: int, per_batch: int) -> list[int]:
    """`total` trials over kernels ranked most valuable first, as described in the module docstring."""
    if per_batch < 1:
        raise ValueError(f"per_batch {per_batch} must be at least 1")
    shares = [0] * len(values)
    if not values or total <= 0:
        return shares
    batches = total // per_batch
    taken = min(len(values), batches)
    if taken == 0:  # less than one batch: all of it to the most valuable kernel
        shares[0] = total
        return shares
    weights = [max(float(v), 0.0) for v in values[:taken]]
    scale = sum(weights) or float(taken)
    weights = weights if sum(weights) else [1.0] * taken
    extra = batches - taken
    exact = [extra * w / scale for w in weights]
    counts = [1 + int(e) for e in exact]
    by_remainder = sorted(range(taken), key=lambda i: (-(exact[i] - int(exact[i])), i))
    for i in by_remainder[: batches - sum(counts)]:
        counts[i] += 1
    for i, count in enumerate(counts):
        shares[i] = count * per_batch
    shares[0] += total - batches * per_batch
    return shares


@dataclass(frozen=True)
class Plan:
    """One job's trials: `shares`, `needs` (new trials owed) and `credit` (another kernel's trials
    of the same main computation counted toward the share) per kernel, in ranked order."""

    shares: list[int]
    needs: list[int]
    budget: int  # new trials this job may measure: min(budget - all cached - credit, sum of needs)
    credit: list[int] | None = None

    @property
    def short(self) -> list[int]:
        """Positions of the kernels short of their share."""
        return [i for i, n in enumerate(self.needs) if n > 0]


def plan(
    values: list[float],
    cached: list[int],
    trials: int,
    per_batch: int,
    cached_total: int,
    retired: list[bool] | None = None,
    borrowed: list[int] | None = None,
) -> Plan:
    """The job's plan for its kernels (`values`, `cached`, `retired`, `borrowed`: ranked, most
    valuable first). A retired kernel (stopped early by an earlier job) keeps its share and is owed
    nothing, so the others' shares do not grow when one retires. `cached_total` counts the cached
    trials of every kernel of the job (those past the budget's batches too). `borrowed`: trials of
    the kernel's main computation measured on other jobs' kernels (module docstring)."""
    shares = split(values, trials, per_batch)
    retired = retired or [False] * len(values)
    borrowed = borrowed or [0] * len(values)
    needs, credit = [], []
    for share, have, gone, lent in zip(shares, cached, retired, borrowed):
        floor = min(share, per_batch) if have == 0 and lent > 0 else 0  # its carried batch
        given = 0 if gone else min(lent, max(0, share - have - floor))
        credit.append(given)
        needs.append(0 if gone else max(0, share - have - given))
    return Plan(shares, needs, max(0, min(trials - cached_total - sum(credit), sum(needs))), credit)


def give_back(freed: int, values: list[float], per_batch: int) -> list[int]:
    """`freed` trials (owed to a kernel whose design space cannot be generated) over the other
    kernels about to be tuned (`values`, ranked): one batch each, most valuable first, then by
    value; the same rule as `split`."""
    return split(values, freed, per_batch) if values else []
