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
horizontal sum per output and the epilogue, per tile (``tiling.schedule_dot``; ``cpu_matmul`` uses it
as the single-row branch of symbolic-row matmuls).
"""

from __future__ import annotations

import logging

from tvm import s_tir, tirx
from tvm.target import Target

from . import _utils as U
from . import fast_math
from .analysis import dot_eligible, row_extent
from .tiling import schedule_dot

logger = logging.getLogger(__name__)

MAX_ROWS = 4


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
        if any(
            iv.iter_type not in (tirx.IterVar.DataPar, tirx.IterVar.CommReduce)
            for b in blocks
            for iv in sch.get(b).iter_vars
        ):
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
