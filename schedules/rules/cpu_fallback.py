"""CPU fallback rule: schedules any PrimFunc the specific rules declined (it never returns None
for a PrimFunc with a root block).

Typical kernels: reductions over a non-trailing axis, cumulative ops, gathers / takes, argmax,
mixed spatial + reduction functions whose blocks do not share row axes.

How it schedules: inline the spatial blocks that can be inlined; then for every remaining block at
the root, fuse the maximal prefix of loops that only drive spatial block iterators into one
parallel loop (safe: distinct iterations write distinct elements), and, for an injective block,
vectorize its innermost loop when its extent is static (split by a power of two <= SIMD width).
Reduction loops are left serial, and so is a block nest of static extents below
``_utils.PARALLEL_MIN_WORK`` iterations. A function it cannot improve is still returned (unchanged loops)
so that it is marked scheduled.
"""

from __future__ import annotations

import logging

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis.common_analysis import get_sblockrealize
from tvm.target import Target
from tvm.tirx.analysis import undefined_vars

from . import _utils as U
from . import fast_math

logger = logging.getLogger(__name__)


def _spatial_prefix(sch: s_tir.Schedule, blk) -> list:
    """Outermost loops whose variables feed only data-parallel block iterators."""
    stmt = sch.get(blk)
    values = get_sblockrealize(sch, blk).iter_values
    reduce_vars = set()
    for iv, val in zip(stmt.iter_vars, values):
        if iv.iter_type != tirx.IterVar.DataPar:
            reduce_vars |= set(undefined_vars(val))
    prefix = []
    for loop in sch.get_loops(blk):
        node = sch.get(loop)
        if node.loop_var in reduce_vars or node.kind != tirx.ForKind.SERIAL or node.annotations:
            break
        prefix.append(loop)
    return prefix


class Fallback(fast_math.FastMathRule):
    """Parallel outer spatial loops, vectorized static inner loop (see module docstring)."""

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        sch = self.schedule_of(func, target)
        if sch is None:
            return None
        blocks = U.root_children(sch)
        if blocks is None:
            return None
        spatial = [b for b in blocks if all(iv.iter_type == tirx.IterVar.DataPar for iv in sch.get(b).iter_vars)]
        U.inline_all_spatial(sch, spatial)
        for blk in sch.get_child_blocks(sch.get_sblock("root")):
            try:
                self._schedule_block(sch, blk, target)
            except Exception as err:  # pylint: disable=broad-except  # leave this block serial
                logger.debug("cpu Fallback left block %s serial: %s", sch.get(blk).name_hint, err)
        return sch

    @staticmethod
    def _schedule_block(sch: s_tir.Schedule, blk, target: Target) -> None:
        stmt = sch.get(blk)
        if not stmt.iter_vars:
            return
        loops = sch.get_loops(blk)
        serial = U.too_small_to_parallelize(sch, loops)  # a decode step's small block: no thread-pool launch
        n_prefix = len(_spatial_prefix(sch, blk))
        injective = all(iv.iter_type == tirx.IterVar.DataPar for iv in stmt.iter_vars)
        ext = U.static(U.extent(sch, loops[-1])) if loops else None
        if injective and ext is not None:
            width = U.largest_pow2_divisor(ext, U.lanes(target, stmt.writes[0].source.dtype))
            if width >= 2:
                if ext > width:
                    outer_part, inner = sch.split(loops[-1], [None, width])
                    loops = loops[:-1] + [outer_part]
                else:
                    inner = loops[-1]
                    loops = loops[:-1]
                    n_prefix = min(n_prefix, len(loops))
                sch.vectorize(inner)
        prefix = loops[: min(n_prefix, U.parallel_depth(sch, loops, 1))] if n_prefix and not serial else []
        if prefix:
            sch.parallel(sch.fuse(*prefix) if len(prefix) > 1 else prefix[0])
