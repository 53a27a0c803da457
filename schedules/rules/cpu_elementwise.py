"""CPU element-wise / injective rule: add, multiply, activations, cast, transpose, reshape, slice, rotary.

Matches a PrimFunc whose blocks are all spatial (no reduction), static or symbolic extents.

How it schedules: inline every block that can be inlined (so a fused chain becomes one loop nest
per output), then for each remaining block fuse the outer loops into one parallel loop (all static
ones, but a symbolic loop only when outermost or with >= 256 elements of work per iteration: see
``_utils.parallel_depth``; the others stay nested, serial) and vectorize the innermost: a static innermost loop is
split by the largest power of two <= SIMD
width that divides it; a symbolic innermost loop is split by the SIMD width and its outer part gets
``pragma_loop_partition_hint``, so lowering peels a predicate-free vector body plus a scalar tail.
A block of static extents with fewer than ``_utils.PARALLEL_MIN_WORK`` iterations is not parallelized.
"""

from __future__ import annotations

import logging

from tvm import s_tir, tirx
from tvm.target import Target

from . import _utils as U
from . import fast_math

logger = logging.getLogger(__name__)


def parallel_vectorize(sch: s_tir.Schedule, blk, vec: int) -> None:
    """Parallelize all loops but the innermost (unless the nest is too small) and vectorize the innermost one."""
    loops = sch.get_loops(blk)
    if not loops:
        return
    serial = U.too_small_to_parallelize(sch, loops)  # a decode step's activation: no thread-pool launch
    inner = loops[-1]
    ext = U.static(U.extent(sch, inner))
    lane_work = 256  # a symbolic innermost loop: assume it is long
    if ext is not None:
        width = lane_work = U.largest_pow2_divisor(ext, vec)
        if width >= 2 and ext > width:
            outer_part, inner = sch.split(inner, [None, width])
            loops = loops[:-1] + [outer_part]
        else:
            loops = loops[:-1]
        if width >= 2:
            sch.vectorize(inner)
    else:
        loops = loops[:-1]
        outer_part, lane = sch.split(inner, [None, vec])
        sch.vectorize(lane)
        sch.annotate(outer_part, "pragma_loop_partition_hint", 1)
        if not loops:  # a 1-D symbolic loop: run its vector chunks in parallel instead
            sch.unannotate(outer_part, "pragma_loop_partition_hint")
            sch.parallel(outer_part)
            return
    if loops and not serial:
        loops = loops[: U.parallel_depth(sch, loops, lane_work)]
        sch.parallel(sch.fuse(*loops) if len(loops) > 1 else loops[0])


class Elementwise(fast_math.FastMathRule):
    """Inline, then parallel outer loops and vectorized inner loop (see module docstring)."""

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        sch = self.schedule_of(func, target)
        if sch is None:
            return None
        blocks = U.root_children(sch)
        if not blocks:
            return None
        for blk in blocks:
            stmt = sch.get(blk)
            if not stmt.iter_vars or any(iv.iter_type != tirx.IterVar.DataPar for iv in stmt.iter_vars):
                return None
        try:
            remaining = U.inline_all_spatial(sch, blocks)
            for blk in remaining:
                parallel_vectorize(sch, blk, U.lanes(target, sch.get(blk).writes[0].source.dtype))
        except Exception as err:  # pylint: disable=broad-except
            logger.debug("cpu Elementwise rule gave up: %s", err)
            return None
        return sch
