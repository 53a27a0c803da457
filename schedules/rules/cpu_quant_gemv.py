"""CPU rule for a GEMV over a quantized weight: ``x(b, rows, K) @ W(N, K)^T`` with W dequantized in the
kernel (`relaxtune/kernels/quant_tir.py`), few static rows (a decode step, <= 4).

How it schedules: like ``cpu_gemv`` (vector partial dot products per output, ``rfactor`` over the SIMD
lanes, a horizontal sum per output), with the reduction axis split at the packing of the integers:
``[K / unit] > rows (unroll) > cols (unroll) > unit / VL (unroll) > VL (vector)``, where a unit is one
load of packed integers (32 weights of a 4-bit format: 16 bytes, low nibbles then high nibbles, so both
halves are unpacked from one load with constant shifts) or one vector (8-bit, F16). The dequantization is
inlined into the partial sums: the weight's bytes are read once. Its float16 scales (and Q4_1's mins) are
converted to float32 per tile as vectors before the dot products (the kernel's ``DEQUANTIZE_SCALE_ATTR``
stages: a tile's whole rows at once, or 8 groups at a time for long rows), which the dot products then
broadcast, instead of a scalar load, conversion and broadcast per group and column. The generic split
(``cpu_gemv``: K by VL, the nibble shift a variable) is slower on these kernels. Figures: docs/results.md
("Quantized weights (CPU)"; `benchmarks/bench_quant_gemv.py`).

Its choices are decisions of its design space (`decisions.py`; ``sketch`` asks `decide` for each, the
default the rule's value): ``cols``, outputs per tile (2, 4, 8, 16; 8), and ``units``, packed units per loop
iteration (1, 2, 4; 32 weights: one 4-bit chunk, or two vectors of 8-bit weights, a Q8_0 group). Both are
structural (the tile's partial sums and the scales converted per step are sized by them, and a value that
does not divide the kernel's extent falls back to a smaller one), so each combination is one sketch of the
rules' space (`schedules/space.py`) and `MutateDecision` moves between them.
"""

from __future__ import annotations

import logging

from tvm import s_tir, tirx
from tvm.target import Target

from ...ir_attrs import DEQUANTIZE_SCALE_ATTR
from . import _utils as U
from . import fast_math
from .analysis import dot_eligible, normalize, row_extent
from .decisions import Defaults
from .quant_analysis import quant_contraction
from .tiling import STACK_LIMIT, epilogue_at

logger = logging.getLogger(__name__)

MAX_ROWS = 4
UNIT_WEIGHTS = 32  # weights of K per loop iteration by default: a 4-bit chunk, two vectors of 8-bit (one group)


class QuantGemv(fast_math.FastMathRule):
    """Few-row matmul over a dequantized weight (see the module docstring)."""

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool, decide=None) -> s_tir.Schedule | None:
        """The rule's schedule of `func` with `decide`'s choices (default: the rule's own); None where it does
        not apply."""
        sch = self.schedule_of(func, target)
        if sch is None:
            return None
        try:
            return sch if self.sketch(sch, target, decide or Defaults()) else None
        except Exception as err:  # pylint: disable=broad-except  # a primitive refused: not ours
            logger.debug("cpu QuantGemv rule gave up: %s", err)
            return None

    def sketch(self, sch: s_tir.Schedule, target: Target, decide) -> bool:
        """Schedule the kernel held by `sch` in place; False where this rule does not apply (nothing changed)."""
        found = quant_contraction(sch)
        if found is None or not dot_eligible(sch.get(found.main)):
            return False
        rows = row_extent(sch.get(found.main))
        if not isinstance(rows, int) or rows > MAX_ROWS:
            return False
        main = found.main
        normalize(sch, main, b_order=("S", "J", "K"))
        ext_j, ext_k = (U.static(iv.dom.extent) for iv in sch.get(main).iter_vars[2:4])
        vec = U.lanes(target, "float32")
        unit = max(found.chunk, vec)
        if ext_k is None or ext_k % unit or unit % vec:
            return False
        decide.begin(sch, type(self).__name__)
        decide.note(sch, "rows", rows)
        decide.note(sch, "cols", ext_j)
        decide.note(sch, "reduction", ext_k)
        cols = decide.choose(sch, "cols", (2, 4, 8, 16), 8, structural=True)
        units = decide.choose(sch, "units", (1, 2, 4), max(1, UNIT_WEIGHTS // unit), structural=True)
        cols = U.largest_pow2_divisor(ext_j, cols) if ext_j is not None else 1
        while rows * cols * vec * 4 >= STACK_LIMIT and cols > 1:
            cols //= 2  # the partial sums stay on the stack (registers)
        units = units if ext_k % (unit * units) == 0 else 1
        s_loop, i_loop, j_loop, k_loop = sch.get_loops(main)
        i_o, i_i = sch.split(i_loop, [None, rows])
        j_o, j_i = sch.split(j_loop, [None, cols])
        k_o, k_m, k_v = sch.split(k_loop, [None, unit * units // vec, vec])
        sch.reorder(s_loop, i_o, j_o, k_o, i_i, j_i, k_m, k_v)
        sch.parallel(sch.fuse(s_loop, i_o, j_o))
        scales = [b for b in U.root_children(sch) if DEQUANTIZE_SCALE_ATTR in sch.get(b).annotations]
        for prod in sch.get_producers(main):  # reindex copies, the dequantization, prologues: read in place
            _inline_producers_but(sch, prod, scales)
            sch.compute_inline(prod)
        partial = sch.rfactor(k_v, factor_axis=3)
        sch.set_scope(partial, 0, "global")
        loops = sch.get_loops(partial)
        sch.vectorize(loops[-1])
        for loop in loops[-4:-1]:
            sch.unroll(loop)
        sch.decompose_reduction(partial, loops[-5])
        tile = loops[0]
        sch.reverse_compute_at(main, tile, preserve_unit_loops=True)
        epilogue_at(sch, main, tile, vec)
        _convert_scales_per_tile(sch, scales, sch.get_loops(partial), ext_k // unit // units, vec)
        return True


SCALE_GROUPS = 8  # groups whose scales one tile converts at a time (8 columns x 8 x 2 float32: the stack)


def _inline_producers_but(sch: s_tir.Schedule, block, keep: list) -> None:
    """compute_inline every producer of `block` (recursively) except the blocks in `keep`."""
    names = {sch.get(b).name_hint for b in keep}
    changed = True
    while changed:
        changed = False
        for prod in sch.get_producers(block):
            if sch.get(prod).name_hint in names:
                continue
            try:
                sch.compute_inline(prod)
                changed = True
            except Exception:  # pylint: disable=broad-except  # not inlinable: keep it
                continue


def _convert_scales_per_tile(sch: s_tir.Schedule, scales: list, loops: list, units: int, vec: int) -> None:
    """Each tile's float16 scales / mins converted to float32 as vectors, `SCALE_GROUPS` groups at a time,
    before the dot products read them (instead of a scalar load, conversion and broadcast per group and
    column inside them)."""
    tile, k_o = loops[0], loops[1]
    at = tile
    if units > SCALE_GROUPS and units % SCALE_GROUPS == 0:
        k_oo, _ = sch.split(k_o, [None, SCALE_GROUPS])
        at = k_oo
    for blk in scales:
        sch.compute_at(blk, at, preserve_unit_loops=True)
        cols, groups = sch.get_loops(blk)[-2:]
        # a tile's whole rows are one contiguous run of the scale array: vectorized across its columns
        U.vectorize_inner(sch, sch.fuse(cols, groups) if at.same_as(tile) else groups, vec)
