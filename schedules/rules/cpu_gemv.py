"""CPU GEMV rule: decode-time matmuls whose weight is contiguous along the reduction axis.

Matches the matmul pattern of ``cpu_matmul`` (one ``C += A * B`` reduction plus injective
prologue / epilogue blocks) when B is read along K, i.e. ``x(b, 1, K) @ W(N, K)^T`` as produced by
``FuseTransposeMatmul`` / ``nn.Linear`` weights, with few static rows (<= 4, e.g. ``n = 1`` and
``b`` static) and a static K. ``dl.cpu.GEMV`` also targets this case but measured 183 us on
x(1, 256) @ W(704, 256)^T (1 thread), and the matmul rule's packing path 125 us: both copy or stride
through W; this rule reads W once, contiguously: 8.5 us.

How it schedules: normalize to ``C[S, I, J] += A[S, I, K] * B[S, J, K]``, split K by the SIMD width
and ``rfactor`` it, so each of the ``rows x 8`` outputs of a tile keeps one vector of partial dot
products (a < 1024-byte "global" buffer, i.e. registers); loops
``[S * I/rows * J/8] (parallel) > K/VL > rows (unroll) > 8 (unroll) > VL (vector)``, then one
horizontal sum per output and the epilogue, per tile. ``cpu_matmul`` reuses ``schedule_dot`` as the
single-row branch of symbolic-row matmuls.
"""

from __future__ import annotations

import logging

from tvm import DataType, s_tir, tirx
from tvm.target import Target

from . import _utils as U
from . import fast_math
from .cpu_matmul import detect, epilogue_at, normalize

logger = logging.getLogger(__name__)

MAX_ROWS = 4
_COLS = 8


def dot_eligible(block) -> bool:
    """A matmul block reading both operands along their (static) reduction axis."""
    found = detect(block)
    if found is None:
        return False
    kinds, ai, bi = found
    k_iters = [iv for iv, kind in zip(block.iter_vars, kinds) if kind == "K"]
    last_k = k_iters[-1].var
    contiguous = all(block.reads[i].region[-1].min.same_as(last_k) for i in (ai, bi))
    return contiguous and all(U.static(iv.dom.extent) is not None for iv in k_iters)


def row_extent(block):
    """Product of the row (I) extents of a matmul block, static int or PrimExpr."""
    kinds, _, _ = detect(block)
    rows = 1
    for iv, kind in zip(block.iter_vars, kinds):
        if kind == "I":
            rows = rows * iv.dom.extent
    return U.static(rows) if U.static(rows) is not None else rows


def schedule_dot(sch: s_tir.Schedule, main, target: Target, rows: int) -> None:
    """Vectorized dot products over K; ``rows`` rows per tile (the row extent must divide by it)."""
    normalize(sch, main, b_order=("S", "J", "K"))
    stmt = sch.get(main)
    ext_j, ext_k = (U.static(iv.dom.extent) for iv in stmt.iter_vars[2:4])
    dtype = stmt.writes[0].source.dtype
    vec = U.largest_pow2_divisor(ext_k, U.lanes(target, dtype))
    cols = U.largest_pow2_divisor(ext_j, _COLS) if ext_j is not None else 1
    while rows * cols * vec * DataType(dtype).bits // 8 >= 1024 and cols > 1:
        cols //= 2  # keep the partial sums on the stack (see cpu_matmul)
    s_loop, i_loop, j_loop, k_loop = sch.get_loops(main)
    i_o, i_i = sch.split(i_loop, [None, rows])
    j_o, j_i = sch.split(j_loop, [None, cols])
    k_o, k_v = sch.split(k_loop, [None, vec])
    sch.reorder(s_loop, i_o, j_o, k_o, i_i, j_i, k_v)
    tile = sch.fuse(s_loop, i_o, j_o)
    sch.parallel(tile)
    for prod in sch.get_producers(main):  # reindex copies and prologues read in place
        U.inline_producers(sch, prod)
        sch.compute_inline(prod)
    partial = sch.rfactor(k_v, factor_axis=3)
    sch.set_scope(partial, 0, "global")
    loops = sch.get_loops(partial)
    sch.vectorize(loops[-1])
    sch.unroll(loops[-2])
    sch.unroll(loops[-3])
    sch.decompose_reduction(partial, loops[-4])
    tile = loops[0]  # rfactor left the horizontal sum in a copy of the nest: bring it back
    sch.reverse_compute_at(main, tile, preserve_unit_loops=True)
    epilogue_at(sch, main, tile, vec)


class Gemv(fast_math.FastMathRule):
    """Few-row matmul with a K-contiguous weight (see module docstring)."""

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        sch = self.schedule_of(func, target)
        if sch is None:
            return None
        blocks = U.root_children(sch) or []
        reductions = [b for b in blocks if any(iv.iter_type == tirx.IterVar.CommReduce for iv in sch.get(b).iter_vars)]
        if len(reductions) != 1 or not dot_eligible(sch.get(reductions[0])):
            return None
        if any(iv.iter_type not in (tirx.IterVar.DataPar, tirx.IterVar.CommReduce)
               for b in blocks for iv in sch.get(b).iter_vars):
            return None
        rows = row_extent(sch.get(reductions[0]))
        if not isinstance(rows, int) or rows > MAX_ROWS:
            return None
        try:
            schedule_dot(sch, reductions[0], target, rows)
        except Exception as err:  # pylint: disable=broad-except  # a primitive refused: not ours
            logger.debug("cpu Gemv rule gave up: %s", err)
            return None
        return sch
