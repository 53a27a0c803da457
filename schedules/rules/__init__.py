"""Rule-based schedules (dlight style) for kernels that have no tuning record.

``rule_schedules(target)`` is the pass that applies the target's rule set (the pipeline's and
tuning's one choice of rules); ``cpu_rules()`` lists the CPU rules, most specific first; ``apply_cpu_rules(mod,
target)`` runs them on
every PrimFunc of a fused module (after ``LegalizeOps -> AnnotateTIROpPattern -> FuseOps -> FuseTIR``)
that is not already marked ``tirx.is_scheduled``. Every rule handles symbolic dimensions.
"""

from __future__ import annotations

import logging

import tvm
from tvm.s_tir import dlight as dl

from .cpu_attention import Attention
from .cpu_conv2d import Conv2d
from .cpu_elementwise import Elementwise
from .cpu_fallback import Fallback
from .cpu_gemv import Gemv
from .cpu_matmul import Matmul
from .cpu_norm_gemv import NormGemv
from .cpu_paged_attention import PagedAttention
from .cpu_paged_copy import PagedCopy
from .cpu_reduction import Reduction
from .cpu_window import Window

logger = logging.getLogger(__name__)

__all__ = [
    "Attention",
    "Conv2d",
    "Elementwise",
    "Fallback",
    "Gemv",
    "Matmul",
    "NormGemv",
    "PagedAttention",
    "PagedCopy",
    "Reduction",
    "Window",
    "apply_cpu_rules",
    "cpu_rules",
    "rule_schedules",
]


def rule_schedules(target, rules: list | None = None) -> tvm.transform.Pass:
    """Rule-based schedules for every kernel not yet scheduled (never a naive loop nest): `rules`, by
    default ``gpu_rules()`` on a GPU target (its kernels' bounds annotated first), else ``cpu_rules()``."""
    if "gpu" in target.keys:
        from .gpu_rules import gpu_schedule_pass

        return gpu_schedule_pass(rules)
    return dl.ApplyDefaultSchedule(*(rules if rules is not None else cpu_rules()))


def cpu_rules(fast_math: bool = True) -> list:
    """The CPU rules in the order they are tried: fused attention, the paged KV cache's kernels,
    normalization + GEMV, GEMV, convolution and window reductions (NHWC: depthwise, pooling, image
    means), matmul, row reductions, element-wise, fallback.

    ``fast_math`` replaces float32 exp / erf / tanh / sigmoid by vectorizable approximations
    (error < 4e-7, see ``fast_math``); TVM otherwise calls scalar libm for each element.
    """
    return [
        Attention(fast_math=fast_math),
        PagedAttention(fast_math=fast_math),
        PagedCopy(fast_math=fast_math),
        NormGemv(fast_math=fast_math),
        Gemv(fast_math=fast_math),
        Conv2d(fast_math=fast_math),
        Window(fast_math=fast_math),
        Matmul(fast_math=fast_math),
        Reduction(fast_math=fast_math),
        Elementwise(fast_math=fast_math),
        Fallback(fast_math=fast_math),
    ]


def apply_cpu_rules(mod: tvm.IRModule, target, fast_math: bool = True) -> tvm.IRModule:
    """Schedule every unscheduled PrimFunc of ``mod`` for the llvm ``target`` (dict, str or Target).

    Functions already marked ``tirx.is_scheduled`` (e.g. from a tuning database) are left untouched;
    ``mod`` itself is not modified.
    """
    if not isinstance(target, tvm.target.Target):
        target = tvm.target.Target(target)
    with target:  # ApplyDefaultSchedule edits the module it is given: work on a copy
        out = dl.ApplyDefaultSchedule(*cpu_rules(fast_math))(mod.clone())
    left = [
        gv.name_hint
        for gv, f in out.functions_items()
        if isinstance(f, tvm.tirx.PrimFunc) and not f.attrs.get("tirx.is_scheduled", False)
    ]
    if left:
        logger.info("no CPU rule scheduled: %s", ", ".join(sorted(left)))
    return out
