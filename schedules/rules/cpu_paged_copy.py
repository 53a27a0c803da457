"""CPU rule for relaxtune's copy kernels of the paged KV cache (`kernels/paged_copy_tir.py`): the
split-and-rotate of q/k/v and the append of k/v into the pages.

Recognised by their ``relaxtune.kernel`` attribute. Tokens are one parallel loop; the rotations, the copy
of v and the appended rows are vectorized along head_dim (halves of it for the rotations; the angles'
cosines and sines are scalar libm calls, d/2 of each per position).
"""

from __future__ import annotations

import logging

from tvm import s_tir, tirx
from tvm.target import Target

from ...kernels import paged_copy_tir as kernel
from ...kernels.paged_attention_tir import ATTR
from . import _utils as U
from . import fast_math

logger = logging.getLogger(__name__)

# per kernel: the block whose outermost loop runs over the tokens, and the blocks vectorized along head_dim
_BLOCKS = {kernel.ROPE: ("position", ("rotate_q", "rotate_k", "copy_v")), kernel.APPEND: ("append", ("append",))}


class PagedCopy(fast_math.FastMathRule):
    """The paged KV cache's split-and-rotate and append kernels (see the module docstring)."""

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        kind = str(func.attrs.get(ATTR, "")) if isinstance(func, tirx.PrimFunc) and func.attrs else ""
        if kind not in _BLOCKS:
            return None
        sch = self.schedule_of(func, target)
        if sch is None:
            return None
        tokens, vectorized = _BLOCKS[kind]
        vec = U.lanes(target, "float32")
        try:
            sch.parallel(sch.get_loops(sch.get_sblock(tokens))[0])
            for name in vectorized:
                U.vectorize_inner(sch, sch.get_loops(sch.get_sblock(name))[-1], vec, max_vec=4 * vec)
        except Exception as err:  # noqa: BLE001 (a changed kernel: say so, leave it to the fallback)
            logger.warning("the paged copy rule does not apply to %s: %s", func.attrs.get("global_symbol", kind), err)
            return None
        return sch
