"""Layouts for PlanMemory: where the slots of one arena go, from their lifetimes and sizes alone (no IR).

A slot is live over bindings [start, end]; slots live at one binding must not share bytes. A layout orders
such pairs: `below[s]` is the set of slots below slot s. `place_greedy` (best or first fit, at one shape)
and `place_exact` (scipy's MILP, time-limited; None without a solution) make layouts from integer sizes;
`lower_bound` is the largest total size live at one binding, and `choose` keeps up to `_LAYOUTS` layouts
whose smallest arena at each sample shape is closest to it. `slot_offsets` turns a layout into symbolic
offsets, valid for every value of every dimension within the analyzer's bounds (a slot's offset is the
max over the slots below it of offset + size); `select_layout` picks, at run time, the layout with the
smallest arena. Sizes are rounded up to ALIGN bytes (`align`), so every offset is a multiple of it.
"""

from __future__ import annotations

import functools
import graphlib

from tvm import tirx
from tvm.sym import Analyzer

from .verify_memory_plan import ALIGN

_LAYOUTS, _GAIN = 3, 0.01  # at most 3 layouts per function; each must cut (worst + mean) arena / lower bound by 1%
_EXACT_SECONDS = 2.0  # time limit of one MILP solve
_I64 = "int64"


def lower_bound(lives: list[tuple[int, int]], sizes: list[int]) -> int:
    """The largest total size of tensors live at one binding."""
    points = {p for s, e in lives for p in (s, e)}
    return max((sum(z for (s, e), z in zip(lives, sizes) if s <= p <= e) for p in points), default=0)


def _overlap(a, b) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]


def place_greedy(order: list[int], lives, size: list[int], best_fit: bool) -> dict[int, set[int]]:
    """Greedy placement at one shape (the smallest or the lowest gap that fits): the slots below each slot."""
    below: dict[int, set[int]] = {s: set() for s in order}
    offset: dict[int, int] = {}
    for s in order:
        conflicts = sorted((offset[p], offset[p] + size[p], p) for p in offset if _overlap(lives[s], lives[p]))
        top, gap = 0, None
        for lo, hi, _ in conflicts:
            if lo - top >= size[s] and (gap is None or (best_fit and lo - top < gap[1])):
                gap = (top, lo - top)
            top = max(top, hi)
        offset[s] = gap[0] if gap is not None else top
        for lo, hi, p in conflicts:  # below the gap, or at or above its end
            (below[s].add(p) if hi <= offset[s] else below[p].add(s))
    return below


def place_exact(lives, size: list[int]) -> dict[int, set[int]] | None:
    """The order with the smallest arena at these sizes, from a MILP solved by scipy (HiGHS); None if not in time."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    k, units = len(size), [z // ALIGN for z in size]
    pairs = [(i, j) for i in range(k) for j in range(i + 1, k) if _overlap(lives[i], lives[j])]
    big, rows = float(sum(units)), [([(i, 1), (k, -1)], -units[i]) for i in range(k)]  # offset_i + size_i <= arena
    for p, (i, j) in enumerate(pairs):  # column k+1+p is 1 when i is below j
        rows += [
            ([(i, 1), (j, -1), (k + 1 + p, big)], big - units[i]),
            ([(j, 1), (i, -1), (k + 1 + p, -big)], -units[j]),
        ]
    r, c, v = zip(*[(n, col, val) for n, (terms, _) in enumerate(rows) for col, val in terms])
    matrix, cost = (
        coo_array((v, (r, c)), shape=(len(rows), k + 1 + len(pairs))),
        (np.arange(k + 1 + len(pairs)) == k).astype(float),
    )
    found = milp(
        cost,
        constraints=LinearConstraint(matrix, -np.inf, [b for _, b in rows]),
        integrality=[0] * (k + 1) + [1] * len(pairs),
        bounds=Bounds(0, [big] * (k + 1) + [1] * len(pairs)), options={"time_limit": _EXACT_SECONDS},
    )  # fmt: skip
    if found.x is None:
        return None
    below: dict[int, set[int]] = {s: set() for s in range(k)}
    for p, (i, j) in enumerate(pairs):
        (below[j].add(i) if found.x[k + 1 + p] > 0.5 else below[i].add(j))
    return below


def topological_order(below) -> list[int] | None:
    """The slots, each after every slot below it; None on a cycle."""
    try:
        return list(graphlib.TopologicalSorter(below).static_order())
    except graphlib.CycleError:
        return None


def longest(order: list[int], below, size: list[int]) -> int:
    """The arena of a layout at integer sizes: the largest end, each slot on top of those below it."""
    end: dict[int, int] = {}
    for s in order:
        end[s] = max((end[p] for p in below[s]), default=0) + size[s]
    return max(end.values())


def choose(layouts: list) -> tuple[list, list[float]]:
    """Up to _LAYOUTS layouts whose smallest arena at each sample shape is closest to the lower bound there."""
    chosen, current = [], None
    score = lambda ratios: max(ratios) + sum(ratios) / len(ratios)  # noqa: E731
    while len(chosen) < _LAYOUTS:
        merged = [[min(a, b) for a, b in zip(current, c[2])] if current else c[2] for c in layouts]
        k = min(range(len(layouts)), key=lambda i: score(merged[i]))
        if current is not None and score(merged[k]) > score(current) - _GAIN:
            break
        chosen.append(layouts[k])
        current = merged[k]
    return chosen, current


def align(nbytes: tirx.PrimExpr, analyzer: Analyzer) -> tirx.PrimExpr:
    step = tirx.const(ALIGN, _I64)
    aligned = analyzer.can_prove_equal(tirx.floormod(nbytes, step), tirx.const(0, _I64))
    return analyzer.simplify(nbytes if aligned else tirx.floordiv(nbytes + step - tirx.const(1, _I64), step) * step)


def _max(exprs: list[tirx.PrimExpr], analyzer: Analyzer) -> tirx.PrimExpr:
    """max(exprs), without the terms provably never the largest within the bounds."""
    kept: list[tirx.PrimExpr] = []
    for e in exprs:
        if not any(analyzer.can_prove(e <= k) for k in kept):
            kept = [k for k in kept if not analyzer.can_prove(k <= e)] + [e]
    result = kept[0] if kept else tirx.const(0, _I64)
    return analyzer.simplify(functools.reduce(tirx.max, kept[1:], result))


def slot_offsets(topo: list[int], below, sizes, analyzer: Analyzer):
    """Offsets over the transitive reduction of the 'below' order, and the arena size."""
    reach: dict[int, set[int]] = {s: set() for s in topo}  # slots above s, directly or not
    for s in reversed(topo):
        for t in (t for t in topo if s in below[t]):
            reach[s] |= {t} | reach[t]
    offsets: dict[int, tirx.PrimExpr] = {}
    for s in topo:
        direct = [p for p in below[s] if not any(q in reach[p] for q in below[s])]
        offsets[s] = _max([offsets[p] + sizes[p] for p in direct], analyzer)
    return [offsets[s] for s in range(len(topo))], _max([offsets[s] + sizes[s] for s in topo if not reach[s]], analyzer)


def select_layout(built: list, analyzer: Analyzer):
    """One layout, or the one whose arena is smallest at run time: the same choice for every offset."""
    arenas = [arena for _, arena in built]
    conds = [tirx.all(*[arenas[k] <= arenas[j] for j in range(k + 1, len(arenas))]) for k in range(len(arenas) - 1)]

    def pick(values):  # values[k] for the first k whose condition holds, else the last
        out = values[-1]
        for cond, value in zip(reversed(conds), reversed(values[:-1])):
            out = tirx.Select(cond, value, out)
        return analyzer.simplify(out)

    return [pick([offsets[s] for offsets, _ in built]) for s in range(len(built[0][0]))], pick(arenas)
