"""CPU matmul rule: dense / linear / batched matmul with symbolic rows, fused prologue and epilogue.

Matches a PrimFunc with exactly one reduction block of the form ``C[S, I, J] += A[S, I, K] * B[S, K, J]``
(any axis order and layout; ``S`` = batch axes shared by A, B and C, ``I`` = rows, ``J`` = columns,
``K`` = reduction; several axes of one kind are fused, e.g. ``b`` and ``n`` of ``x(b, n, K)`` become
one row axis) plus any number of injective prologue / epilogue blocks (bias, gelu, silu, residual ...).
Typical kernels: ``x(b, n, K) @ W(K, N)``, ``q @ k^T`` and ``p @ v`` of attention.

How it schedules:
1. Normalize with ``reindex`` + ``transform_layout`` into ``C[S, I, J] += A[S, I, K] * B[S, K, J]``.
2. ``pad_einsum`` the rows I (and J when it is symbolic) up to the register tile, so no predicate is
   left inside the inner loops: a symbolic loop is only split at the outer, parallel level.
   Measured (b=1, K=256, N=704, 1 thread, through the Relax VM, n=1/32/64/128 in us): padded
   3x64 tile 11/114/228/443; no row tiling 8/208/413/826; split rows with the predicate inside
   15/296/598/1193; the same plus ``pragma_loop_partition_hint`` 16/252/525/1006.
3. Register tile ``MR x NR`` (3 rows x 4 vectors with AVX-512, 4 x 3 with AVX2) accumulated in a
   "global"-scope buffer of < 1024 bytes, which TVM 0.27 keeps on the stack (so in registers); a
   "local" or larger tile becomes a workspace allocation and runs 2.3x slower. Loops:
   ``[S*J/NR * I/MR] (parallel) > K > MR (unroll) > NR/VL (unroll) > VL (vector)``.
   The padded A panel (MR x K) is copied per tile; B is read in place when it is contiguous along J
   and packed per column panel (K x NR, then rows serial inside) otherwise or when J is padded.
4. Epilogue blocks are inlined into the write-back, which is computed per tile and vectorized;
   float32 exp / erf / tanh in them (gelu, silu) become vectorizable approximations (``fast_math``).
5. With a symbolic row count the function gets two bodies, ``if rows == 1`` (decode) and else:
   the single-row body uses a 1-row tile (x(1, 256) @ W(256, 704): 8.5 us instead of 12 us with
   the 3-row tile). For a K-contiguous weight the first body is ``cpu_gemv``'s dot products (11 us
   instead of 128 us at one row), for up to ``DOT_ROWS`` rows: one task per tile of weight rows, which
   walks the rows with it in cache, where the general body would pack (transpose) the whole weight on
   every call (a classifier's 960 x 1280 weight at batch 8, ``docs/results.md``).

Its hand-made choices (rows and vectors per tile, packing B, reduction unrolling: ``tiling.tiled_matmul``)
are decisions (`decisions.py`): ``sketch`` schedules a static kernel with a decider's choices (a point of
the design space `schedules/space.py` searches), ``apply(..., decide=Given(values))`` a kernel at any
shapes with a record's choices; with the defaults both are this rule.
"""

from __future__ import annotations

import logging

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule
from tvm.target import Target

from . import _utils as U
from . import fast_math
from .analysis import I, detect, dot_eligible, main_contraction
from .decisions import Defaults
from .tiling import schedule_dot, tiled_matmul, two_versions

logger = logging.getLogger(__name__)

DOT_ROWS = 16  # the most rows a K-contiguous weight's matmul computes as dot products (module docstring, 5.)


class Matmul(CPUScheduleRule):
    """Register-tiled, padded, parallel matmul for llvm targets (see module docstring)."""

    def __init__(
        self, rows: int | None = None, units: int | None = None, fast_math: bool = True, single_row: bool = True
    ):
        self.rows = rows
        self.units = units
        self.single_row = single_row
        self.fast_math = fast_math  # pylint: disable=redefined-outer-name

    def apply(
        self, func: tirx.PrimFunc, target: Target, _tunable: bool, decide: Defaults | None = None
    ) -> s_tir.Schedule | None:
        """The rule's schedule of `func`, with `decide`'s choices (default: the rule's own) for its
        general body; None where the rule does not apply."""
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        func = fast_math.rewrite(func) if self.fast_math else func
        sch = s_tir.Schedule(func)
        main = main_contraction(sch)
        if main is None:
            return None
        rows = 1
        for iv, kind in zip(sch.get(main).iter_vars, detect(sch.get(main))[0]):
            rows = rows * iv.dom.extent if kind == I else rows
        try:
            tiled_matmul(sch, main, target, self.rows, self.units, decide=decide)
            if self.single_row and U.static(rows) is None:
                small, few = self._few_rows(func, target, rows)
                return s_tir.Schedule(two_versions(rows == 1 if few == 1 else rows <= few, small, sch.mod["main"]))
        except Exception as err:  # pylint: disable=broad-except  # a primitive refused: not ours
            logger.debug("cpu Matmul rule gave up on %s: %s", func.attrs.get("global_symbol", "?"), err)
            return None
        return sch

    def sketch(self, sch: s_tir.Schedule, target: Target, decide: Defaults) -> bool:
        """Schedule the static kernel held by `sch` in place with `decide`'s choices (no fast-math rewrite: the
        build applies it); False where this rule does not apply (nothing is changed then)."""
        main = main_contraction(sch)
        if main is None or not self.is_target_available(target):
            return False
        decide.begin(sch, type(self).__name__)
        tiled_matmul(sch, main, target, self.rows, self.units, decide=decide)
        return True

    def _few_rows(self, func: tirx.PrimFunc, target: Target, rows) -> tuple[tirx.PrimFunc, int]:
        """The version for few rows and the most rows it takes: dot products over a K-contiguous weight, row by
        row (up to `DOT_ROWS`), else a 1-row tile (n == 1, decode). Not the dot products where ``rows`` is a
        multiple of more than `DOT_ROWS` (``b * 32``): ``rows <= DOT_ROWS`` would make the branch's rows 0."""
        sch = s_tir.Schedule(func)
        main = main_contraction(sch)
        least = tvm.sym.Analyzer()  # the rows with every symbolic extent 1
        for var in tirx.analysis.undefined_vars(rows):
            least.bind(var, tirx.IntImm(str(var.ty), 1))
        if dot_eligible(sch.get(main)) and (U.static(least.simplify(rows)) or DOT_ROWS + 1) <= DOT_ROWS:
            schedule_dot(sch, main, target, rows=1, rows_inner=True)
            return sch.mod["main"], DOT_ROWS
        tiled_matmul(sch, main, target, rows=1, units=self.units)
        return sch.mod["main"], 1
