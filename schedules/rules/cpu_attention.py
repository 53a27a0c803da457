"""CPU rule for the fused attention kernel (`kernels/attention_tir.py`; its block names: `attention_spec.py`).

Recognises the kernel by its ``relaxtune.kernel`` attribute, set by the compute definition (never
by a model's names), and schedules it by its block names. Runs before the generic rules, which
would leave its score and P·V loops serial.

Not a MetaSchedule task (`tasks.is_contraction` counts two contractions): the stock design space
fails on it (multi-level tiling rejects the online softmax's write-after-read on the running max
and the per-row loop that holds several blocks), and a custom MetaSchedule rule made TVM 0.27
rewrite the task's own module in place, after which the search failed replaying traces. So the
kernel always gets this schedule.

How it schedules: ``k_transpose`` runs first, a parallel loop over (batch, kv head, key tile), each
key's row read along ``head_dim`` (vectorized). Measured against one thread vectorized along the key
tile (masked gathers, the other core idle: a third of the kernel at n = 128), interleaved,
gpt2/llama-block shapes: 0.41-0.69x at n = 1, 0.68-0.70x at n = 128, 0.87x at n = 512 (the second
parallel launch costs less than the gathers even at n = 1). The (batch, head, query tile) loops are
fused into one parallel loop, so each thread keeps one query tile's scratch in its own cache (both loops stay serial
when the call site bounds n x m to ``SERIAL_WORK``: see ``SmallAttentionTiles``). Inside a key tile, each row
group's blocks (``_ROW_BLOCKED``) are register-blocked: the reduction loop moved outside the
unrolled row loop, so each vector of the key tile (score, vectorized along the key tile) or of the
value tile (P·V, along ``head_dim``) feeds every row of the group, whose sums stay in registers;
the max and sum reductions run one independent chain per row. The probabilities are vectorized
along the key tile (float32 ``exp`` replaced by the vectorizable approximation of ``fast_math``),
the init, store and output loops along ``head_dim``. Reductions are decomposed so their inits sit
outside the vector loops.
"""

from __future__ import annotations

import logging

from tvm import s_tir, tirx
from tvm.target import Target

from ...kernels import attention_spec as kernel
from . import _utils as U
from . import fast_math

logger = logging.getLogger(__name__)

# block -> (loop to vectorize, loop to decompose the reduction at), as indices into its loops
# below the fused parallel loop; None: leave it
_PLAN = {
    "q_tile": (-1, None),
    "row_init": (None, None),
    "acc_zero": (-1, None),
    "prob": (-1, None),
    "acc_store": (-1, None),
    "output": (-1, None),
    "v_sum": (-1, -2),  # key_mask="uniform" only: the values summed over all keys
}
# row group blocks whose loops are (row, reduction, vector) or (row, reduction): the reduction loop
# moved outside the row loop and the rows unrolled, so each key / value vector (or score column)
# feeds every row of the group, and the rows' sums stay in registers
_ROW_BLOCKED = ("score", "tile_max", "tile_sum", "acc")
# a kernel whose call site bounds n x m to this (kernel.BOUNDS_ATTR, SmallAttentionTiles) runs on one thread: its two
# parallel launches cost more than its work (gpt2-block's kernel, n = m <= 8: 1.25-2.75 us serial vs 2.6-3.5 us
# with both launches; n = 16: 7.2 us serial vs 4.9 us parallel)
SERIAL_WORK = 64


def _row_blocked(sch: s_tir.Schedule, block, vec: int) -> None:
    loops = sch.get_loops(block)
    if len(sch.get(block).iter_vars) == 3:  # row, reduction, vector
        row, red, lane = loops[-3:]
        sch.reorder(red, row, lane)
        U.vectorize_inner(sch, lane, vec, max_vec=4 * vec)
    else:  # row, reduction: independent chains, one per row
        row, red = loops[-2:]
        sch.reorder(red, row)
    sch.unroll(row)
    sch.decompose_reduction(block, red)  # after vectorize: before it, vectorize fails its dataflow check


def is_attention(func: tirx.PrimFunc) -> bool:
    return bool(func.attrs) and func.attrs.get(kernel.ATTR, None) == kernel.KIND


def schedule(sch: s_tir.Schedule, target: Target) -> None:
    """Schedule the kernel held by `sch` in place (see the module docstring)."""
    blocks = {name: sch.get_sblock(name) for name in kernel.BLOCKS}
    if sch.mod["main"].attrs.get(kernel.KEY_MASK_ATTR, None) == "uniform":
        blocks.update({name: sch.get_sblock(name) for name in kernel.BLOCKS_UNIFORM})
    vec = U.lanes(target, "float32")
    # keys transposed (rotated) once per call, a parallel loop of its own over (batch, kv head, key tile), each key's
    # row read along head_dim (vectorized; stores strided by the key tile)
    bounds = sch.mod["main"].attrs.get(kernel.BOUNDS_ATTR, None)
    serial = bounds is not None and min(int(b) for b in bounds) > 0 and int(bounds[0]) * int(bounds[1]) <= SERIAL_WORK
    parallel = (lambda loop: None) if serial else sch.parallel
    transpose_loops = sch.get_loops(blocks.pop("k_transpose"))  # batch, kv head, key tile, key, [side, i | d]
    parallel(sch.fuse(*transpose_loops[:3]))
    U.vectorize_inner(sch, transpose_loops[-1], vec, max_vec=4 * vec)
    for opaque in ("row_group", "pv_part"):  # blocks that only hold a row group's arrays: nothing to schedule
        blocks.pop(opaque)
    outer = sch.get_loops(blocks.pop("query_tile"))  # batch, head, query tile
    parallel(sch.fuse(*outer))
    for name in _ROW_BLOCKED:
        _row_blocked(sch, blocks[name], vec)
    for name, (vector, reduction) in _PLAN.items():
        if name not in blocks:
            continue
        block = blocks[name]
        loops = sch.get_loops(block)
        if vector is not None:
            U.vectorize_inner(sch, loops[vector], vec, max_vec=4 * vec)
        if reduction is not None:  # after vectorize: before it, vectorize fails its dataflow check
            sch.decompose_reduction(block, loops[reduction])


class Attention(fast_math.FastMathRule):
    """The fused attention kernel: parallel over batch x heads x query tiles, vectorized inside."""

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not is_attention(func):
            return None
        sch = self.schedule_of(func, target)
        if sch is None:
            return None
        try:
            schedule(sch, target)
        except Exception as err:  # pylint: disable=broad-except  # a changed kernel: leave it to the fallback
            logger.warning(
                "the attention rule does not apply to %s: %s", func.attrs.get("global_symbol", "kernel"), err
            )
            return None
        return sch
