"""CPU rule for relaxtune's paged-KV-cache attention kernels (`kernels/paged_prefill_tir.py`, `paged_decode_tir.py`).

Recognises a kernel by its ``relaxtune.kernel`` attribute (never by name) and schedules it by its
block names; runs before the generic rules. Not a MetaSchedule task (data-dependent loops: page
tables, per-sequence lengths), so it always gets this schedule.

Prefill (``paged_prefill``): the key transpose and the query tiles are each one parallel loop over
their tasks; the transpose copies a key row's head_dim (vectorized); per row and key tile the 16
scores are one vector accumulated over head_dim (each step a broadcast query element times a
transposed key row: the reduction loop moved outside the key loop), the mask, the probabilities
(float32 ``exp`` vectorizable through `fast_math`) and the P·V update vectorized (the latter along
head_dim, one vector FMA per key and part of head_dim), the max and sum over the tile unrolled.
Decode (``paged_decode``): the (sequence, head) tasks are one parallel loop; each score is a dot
product along head_dim, one vector of partial sums per key (the 16 keys' chains interleaved), summed,
then the same updates.
The merge kernel is written scheduled (`kernels/paged_attention_tir.py` says why).
"""

from __future__ import annotations

import logging

from tvm import s_tir, tirx
from tvm.target import Target

from ...kernels import paged_attention_tir as kernel
from . import _utils as U
from . import fast_math

logger = logging.getLogger(__name__)

KINDS = (kernel.PREFILL, kernel.DECODE)
_VECTOR_ALONG_LAST = ("q_load", "acc_zero", "mask", "prob", "acc_store", "output")
_ROW_REDUCTIONS = ("row_max", "row_sum")
ACCUMULATORS = 16  # vector accumulators of a P·V step (rows x parts of head_dim)


def kind_of(func: tirx.PrimFunc) -> str | None:
    value = func.attrs.get(kernel.ATTR, None) if func.attrs else None
    return str(value) if value is not None and str(value) in KINDS else None


def _blocks(sch: s_tir.Schedule, names) -> dict:
    out = {}
    for name in names:
        try:
            out[name] = sch.get_sblock(name)
        except Exception:  # noqa: BLE001 (a block the kernel's form does not have)
            logger.debug("no block %s", name)
    return out


def _vectorize_last(sch: s_tir.Schedule, block, vec: int) -> None:
    U.vectorize_inner(sch, sch.get_loops(block)[-1], vec, max_vec=4 * vec)


def _row_reduction(sch: s_tir.Schedule, block) -> None:
    """(row, key) reductions: keys outside, rows unrolled inside, so each row's chain runs beside the others."""
    r, j = sch.get_loops(block)[-2:]
    sch.reorder(j, r)
    sch.unroll(r)
    sch.unroll(j)


def schedule_prefill(sch: s_tir.Schedule, target: Target) -> None:
    vec = U.lanes(target, "float32")
    b = _blocks(sch, ("kv_gather", "query_tile", "score", "acc", *_VECTOR_ALONG_LAST, *_ROW_REDUCTIONS))
    gather = sch.get_loops(b["kv_gather"])  # batch, task, key, head_dim
    sch.parallel(gather[-3])
    U.vectorize_inner(sch, gather[-1], vec, max_vec=4 * vec)
    sch.parallel(sch.get_loops(b["query_tile"])[-1])
    r, j, dd = sch.get_loops(b["score"])[-3:]
    sch.reorder(dd, r, j)  # per head_dim step, one vector of each row's tile scores: a chain per row
    U.vectorize_inner(sch, j, vec, max_vec=4 * vec)
    sch.unroll(r)
    init = sch.decompose_reduction(b["score"], dd)
    U.vectorize_inner(sch, sch.get_loops(init)[-1], vec, max_vec=4 * vec)
    _schedule_acc(sch, b["acc"], vec)
    for name in _VECTOR_ALONG_LAST:
        if name in b:
            _vectorize_last(sch, b[name], vec)
    for name in _ROW_REDUCTIONS:
        _row_reduction(sch, b[name])


def _schedule_acc(sch: s_tir.Schedule, block, vec: int) -> None:
    """P·V: per key, its value row (vectorized along head_dim) times each row's probability."""
    loops = sch.get_loops(block)
    if len(sch.get(block).iter_vars) == 3:  # rows, head_dim, keys
        r, dd, j = loops[-3:]
        rows, width = int(sch.get(r).extent), int(sch.get(dd).extent)
        # head_dim in parts so that rows x part stays within 16 vector accumulators (AVX-512 has 32 registers)
        part = min(width, max(vec, ACCUMULATORS // rows * vec))
        if part < width and width % part == 0:
            outer, dd = sch.split(dd, [None, part])
            sch.reorder(outer, j, r, dd)
        else:
            sch.reorder(j, r, dd)
        sch.unroll(r)
    else:  # head_dim, keys
        dd, j = loops[-2:]
        sch.reorder(j, dd)
    U.vectorize_inner(sch, dd, vec, max_vec=4 * vec)
    sch.unroll(j)
    init = sch.decompose_reduction(block, j)  # after vectorize (before it, vectorize fails its dataflow check)
    U.vectorize_inner(sch, sch.get_loops(init)[-1], vec, max_vec=4 * vec)


def schedule_decode(sch: s_tir.Schedule, target: Target) -> None:
    vec = U.lanes(target, "float32")
    b = _blocks(sch, ("head", "score", "acc", *_VECTOR_ALONG_LAST, *_ROW_REDUCTIONS))
    sch.parallel(sch.get_loops(b["head"])[-1])
    partial = sch.get_sblock("score_partial")
    j, do, lane = sch.get_loops(partial)[-3:]
    sch.reorder(do, j, lane)  # one vector of partial sums per key, the keys' chains side by side
    sch.vectorize(lane)
    sch.unroll(j)
    init = sch.decompose_reduction(partial, do)
    sch.vectorize(sch.get_loops(init)[-1])
    for loop in sch.get_loops(b["score"])[-2:]:
        sch.unroll(loop)
    _schedule_acc(sch, b["acc"], vec)
    for name in _VECTOR_ALONG_LAST:
        if name in b:
            _vectorize_last(sch, b[name], vec)
    for name in _ROW_REDUCTIONS:
        if name in b:
            sch.unroll(sch.get_loops(b[name])[-1])


class PagedAttention(fast_math.FastMathRule):
    """The paged KV cache's attention kernels (see the module docstring)."""

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc):
            return None
        kind = kind_of(func)
        if kind is None:
            return None
        sch = self.schedule_of(func, target)
        if sch is None:
            return None
        try:
            {kernel.PREFILL: schedule_prefill, kernel.DECODE: schedule_decode}[kind](sch, target)
        except Exception as err:  # noqa: BLE001 (a changed kernel: say so, leave it to the fallback)
            logger.warning(
                "the paged attention rule does not apply to %s: %s", func.attrs.get("global_symbol", kind), err
            )
            return None
        return sch
