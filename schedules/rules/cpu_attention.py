"""CPU rule for the fused attention kernel (`relax_passes/attention_kernel.py`).

Recognises the kernel by its ``relaxtune.kernel`` attribute, set by the compute definition (never
by a model's names), and schedules it by its block names. Runs before the generic rules, which
would leave its score and P·V loops serial.

Not a MetaSchedule task (`tasks.is_contraction` counts two contractions): the stock design space
fails on it (multi-level tiling rejects the online softmax's write-after-read on the running max
and the per-row loop that holds several blocks), and a custom MetaSchedule rule made TVM 0.27
rewrite the task's own module in place, after which the search failed replaying traces. So the
kernel always gets this schedule.

How it schedules: the (batch, head, query tile) loops are fused into one parallel loop, so each
thread keeps one query tile's scratch (scores, probabilities, transposed key tile, running
state) in its own cache; the score loop is vectorized along the key tile (keys transposed to
``(d, key)`` by ``k_tile``), the probabilities along the key tile (float32 ``exp`` replaced by the
vectorizable approximation of ``fast_math``), and the P·V, init and output loops along
``head_dim``. Reductions are decomposed so their inits sit outside the vector loops. With RoPE on
load (``kernel.ROPE_ATTR``) the ``k_rope`` block runs first, parallel over (batch, key) and
vectorized over half a head.
"""

from __future__ import annotations

import logging

from tvm import s_tir, tirx
from tvm.target import Target

from ...relax_passes import attention_kernel as kernel
from . import _utils as U
from . import fast_math

logger = logging.getLogger(__name__)

# block -> (loop to vectorize, loop to decompose the reduction at), as indices into its loops
# below the fused parallel loop; None: leave it
_PLAN = {
    "q_tile": (-1, None),
    "row_init": (None, None),
    "acc_zero": (-1, None),
    "k_tile": (None, None),
    "v_tile": (-1, None),
    "score": (-1, -2),
    "tile_max": (None, -1),
    "rescale": (None, None),
    "prob": (-1, None),
    "tile_sum": (None, -1),
    "acc": (-1, -2),
    "output": (-1, None),
    "v_sum": (-1, -2),  # key_mask="uniform" only: the values summed over all keys
}


def is_attention(func: tirx.PrimFunc) -> bool:
    return bool(func.attrs) and func.attrs.get(kernel.ATTR, None) == kernel.KIND


def schedule(sch: s_tir.Schedule, target: Target) -> None:
    """Schedule the kernel held by `sch` in place (see the module docstring)."""
    blocks = {name: sch.get_sblock(name) for name in kernel.BLOCKS}
    if sch.mod["main"].attrs.get(kernel.KEY_MASK_ATTR, None) == "uniform":
        blocks.update({name: sch.get_sblock(name) for name in kernel.BLOCKS_UNIFORM})
    if sch.mod["main"].attrs.get(kernel.ROPE_ATTR, False):  # keys rotated once: parallel over (batch, key), vectorized on d/2
        rope_loops = sch.get_loops(sch.get_sblock(kernel.BLOCKS_ROPE[0]))  # batch, key, head, half, i
        sch.parallel(sch.fuse(*rope_loops[:2]))
        U.vectorize_inner(sch, rope_loops[-1], U.lanes(target, "float32"), max_vec=4 * U.lanes(target, "float32"))
    outer = sch.get_loops(blocks.pop("query_tile"))  # batch, head, query tile
    sch.parallel(sch.fuse(*outer))
    vec = U.lanes(target, "float32")
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
            logger.warning("the attention rule does not apply to %s: %s", func.attrs.get("global_symbol", "kernel"), err)
            return None
        return sch
