"""PagedKVKernels: relaxtune's CPU kernels in place of the ones TVM's paged KV cache is created with.

`TIRPagedKVCache` (``relax.frontend.nn.llm.kv_cache``) on an llvm target passes TVM's CPU kernels to
``vm.builtin.paged_attention_kv_cache_create``: serial scalar loops, the prefill ones scanning the
whole page pool with a test per slot. This pass finds each such create call (by the builtin's name
and its argument layout for llvm, never by a kernel's name), reads the cache's sizes from its
arguments (query / key-value heads, head_dim, dtype, RoPE base), and replaces, under the same global
names, the kernels the runtime calls for a model whose keys are rotated before they are stored
(RopeMode NONE or NORMAL): the ragged and paged prefill attention, the decode attention, the merge of
two partial results (`kernels/paged_attention_tir.py`), the split-and-rotate of q/k/v and the append of k/v
into the pages (`kernels/paged_copy_tir.py`). The sliding-window, tree and page-copy kernels stay TVM's.
A cache created with RopeMode INLINE (keys rotated inside attention) is left as it is.

Runs before legalization and scheduling (first in the CPU pipeline: `pipeline.fusion_passes`); the
rules `schedules/rules/cpu_paged_attention.py` and `cpu_paged_copy.py` schedule the new kernels.
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprVisitor, visitor

from ..kernels.paged_attention_tir import PAGE_SIZE, decode_kernel, merge_kernel, prefill_kernel
from ..kernels.paged_copy_tir import append_kernel, rope_kernel

logger = logging.getLogger(__name__)

CREATE = "vm.builtin.paged_attention_kv_cache_create"
LLVM_ARGS = 28  # the create call's arguments for an llvm target (TIRPagedKVCache.__init__)
# argument positions in that call
_QO_HEADS, _KV_HEADS, _QK_DIM, _V_DIM, _ROPE_MODE, _ROPE_THETA, _DTYPE_PROBE, _APPEND = 2, 3, 4, 5, 8, 10, 12, 13
_RAGGED, _PREFILL, _DECODE, _MERGE, _SPLIT_ROTARY = 15, 16, 17, 23, 24
_ROTATED_BEFORE_STORING = (0, 1)  # RopeMode NONE, NORMAL


def _value(expr):
    """A Python number from a constant prim value argument (IntImm / FloatImm), else None."""
    return expr.value if isinstance(expr, (tirx.IntImm, tirx.FloatImm)) else None


@visitor
class _CreateCalls(PyExprVisitor):
    def __init__(self):
        super().__init__()
        self.calls = []

    def visit_call_(self, call):
        if (
            call.op.same_as(tvm.ir.Op.get("relax.call_pure_packed"))
            and isinstance(call.args[0], relax.ExternFunc)
            and call.args[0].global_symbol == CREATE
        ):
            self.calls.append(list(call.args[1:]))
        for arg in call.args:
            self.visit_expr(arg)


def _global(expr, field: int | None):
    target = (
        expr.fields[field] if field is not None and isinstance(expr, relax.Tuple) and len(expr.fields) > field else expr
    )
    return target if isinstance(target, tvm.ir.GlobalVar) else None


def kernels_for(args: list) -> dict | None:
    """{GlobalVar: relaxtune's kernel} for one create call's arguments, or None when the call is not one
    this pass handles (another target's layout, RoPE inside attention, unknown sizes)."""
    if len(args) != LLVM_ARGS:
        return None
    h_q, h_kv, d, dv, mode, theta = (
        _value(args[i]) for i in (_QO_HEADS, _KV_HEADS, _QK_DIM, _V_DIM, _ROPE_MODE, _ROPE_THETA)
    )
    probe = args[_DTYPE_PROBE].ty
    if (
        None in (h_q, h_kv, d, mode, theta)
        or d != dv
        or mode not in _ROTATED_BEFORE_STORING
        or not isinstance(probe, relax.TensorType)
    ):
        return None
    dtype = probe.dtype
    wanted = {
        (_RAGGED, 1): prefill_kernel(h_kv, h_q, d, dtype, paged=False),
        (_PREFILL, 1): prefill_kernel(h_kv, h_q, d, dtype, paged=True),
        (_DECODE, 1): decode_kernel(h_kv, h_q, d, dtype),
        (_MERGE, 0): merge_kernel(h_q, d, dtype),
        (_SPLIT_ROTARY, None): rope_kernel(h_q, h_kv, d, dtype, float(theta)),
        (_APPEND, None): append_kernel(h_kv, d, dtype, PAGE_SIZE),
    }
    out = {}
    for (position, field), kernel in wanted.items():
        gv = _global(args[position], field)
        if gv is None:
            return None
        out[gv] = kernel
    return out


@tvm.transform.module_pass(opt_level=0, name="PagedKVKernels")
class PagedKVKernels:
    """Replace the CPU kernels of each paged KV cache the module creates (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        found = _CreateCalls()
        for _, func in mod.functions_items():
            if isinstance(func, relax.Function):
                found.visit_expr(func)
        if not found.calls:
            return mod
        out = mod.clone()
        for args in found.calls:
            kernels = kernels_for(args)
            if kernels is None:
                logger.info(
                    "a paged KV cache keeps TVM's kernels (not llvm's argument layout, or RoPE inside attention)"
                )
                continue
            for gv, kernel in kernels.items():
                out[gv] = kernel
            logger.info(
                "paged KV cache: %d kernels replaced by relaxtune's (%s)",
                len(kernels),
                ", ".join(gv.name_hint for gv in kernels),
            )
        return out
