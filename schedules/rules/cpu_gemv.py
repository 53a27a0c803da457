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
as the single-row branch of symbolic-row matmuls). Its hand-made choices (outputs per tile, reduction
lanes per partial-sum vector) are decisions (`decisions.py`, ``sketch``; see ``cpu_matmul``).
"""

from __future__ import annotations

import logging

from tvm import s_tir, tirx
from tvm.target import Target

from . import _utils as U
from . import fast_math
from .analysis import dot_eligible, row_extent
from .decisions import Defaults
from .tiling import schedule_dot

logger = logging.getLogger(__name__)

MAX_ROWS = 4


class Gemv(fast_math.FastMathRule):
    """Few-row matmul with a K-contiguous weight (see module docstring)."""

    def apply(
        self, func: tirx.PrimFunc, target: Target, _tunable: bool, decide: Defaults | None = None
    ) -> s_tir.Schedule | None:
        """The rule's schedule of `func` with `decide`'s choices (default: the rule's own); None where it does not
        apply."""
        sch = self.schedule_of(func, target)
        if sch is None:
            return None
        try:
            return sch if self.sketch(sch, target, decide or Defaults()) else None
        except Exception as err:  # pylint: disable=broad-except  # a primitive refused: not ours
            logger.debug("cpu Gemv rule gave up: %s", err)
            return None

    def sketch(self, sch: s_tir.Schedule, target: Target, decide: Defaults) -> bool:
        """Schedule the kernel held by `sch` in place with `decide`'s choices; False where this rule does not
        apply (nothing is changed then)."""
        blocks = U.root_children(sch) or []
        reductions = [b for b in blocks if any(iv.iter_type == tirx.IterVar.CommReduce for iv in sch.get(b).iter_vars)]
        if len(reductions) != 1 or not dot_eligible(sch.get(reductions[0])):
            return False
        if any(
            iv.iter_type not in (tirx.IterVar.DataPar, tirx.IterVar.CommReduce)
            for b in blocks
            for iv in sch.get(b).iter_vars
        ):
            return False
        rows = row_extent(sch.get(reductions[0]))
        if not isinstance(rows, int) or rows > MAX_ROWS:
            return False
        decide.begin(sch, type(self).__name__)
        schedule_dot(sch, reductions[0], target, rows, decide)
        return True
