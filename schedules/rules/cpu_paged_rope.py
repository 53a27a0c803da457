"""CPU rule for relaxtune's split-and-rotate kernel of the paged KV cache (`relax_passes/paged_rope_kernel.py`).

Recognised by its ``relaxtune.kernel`` attribute. Positions are one parallel loop; the rotations and
the copy of v are vectorized along each half of head_dim (the angles' cosines and sines are scalar
libm calls, d/2 of each per position).
"""

from __future__ import annotations

import logging

from tvm import s_tir, tirx
from tvm.target import Target

from ...relax_passes import paged_rope_kernel as kernel
from ...relax_passes.paged_attention_kernel import ATTR
from . import _utils as U
from . import fast_math

logger = logging.getLogger(__name__)


class PagedRope(fast_math.FastMathRule):
    """The paged KV cache's split-and-rotate kernel (see the module docstring)."""

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not func.attrs or str(func.attrs.get(ATTR, "")) != kernel.ROPE:
            return None
        sch = self.schedule_of(func, target)
        if sch is None:
            return None
        vec = U.lanes(target, "float32")
        try:
            sch.parallel(sch.get_loops(sch.get_sblock("position"))[-1])
            for name in ("rotate_q", "rotate_k", "copy_v"):
                U.vectorize_inner(sch, sch.get_loops(sch.get_sblock(name))[-1], vec, max_vec=4 * vec)
        except Exception as err:  # noqa: BLE001 (a changed kernel: say so, leave it to the fallback)
            logger.warning(
                "the paged rope rule does not apply to %s: %s", func.attrs.get("global_symbol", "kernel"), err
            )
            return None
        return sch
