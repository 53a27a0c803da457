"""FuseAttentionGemvCuda: in a bucket of one or two rows, the attention before o_proj is that GEMV's prologue, not a
kernel of its own (CUDA only).

``y = relaxtune_gemv_nk(r, w)`` (or ``relaxtune_gemv_nk_add(r, w, res)``), where ``r = R.reshape(o, (..., K))`` and
``o = relaxtune_flash_attention_rope_qk(q, k, v, cos, sin, heads, causal, scale, block_m)`` (or the ``_rope`` form,
k already rotated) are each read by nothing else, becomes
``y = relaxtune_gemv_nk_attn(q, k, v, cos, sin, heads, causal, scale, rope, w)`` (``_attn_add(..., w, res)``), rope 2
(q and k rotated) or 1 (q only): each block of the (N, K) GEMV computes the attention of the sequence's rows, D / 8
lanes per head, into its shared memory while its first weight loads are in flight, then the product (kernels/gemv.py,
gemv_prologue.cu's kAttnX). Where: o is (1, rows, heads, D) with rows static and at most kernels.gemv.ATTN_MAX_ROWS,
q, k and v have those rows (self-attention of one short sequence: the prefill of a block or model at n = 1 or 2), D is
64 or 128 and K = heads x D, all of one dtype (float16 / bfloat16).

Why: at n = 1 the flash kernel is a launch of its own between q/k/v's GEMV and o_proj's in the block's CUDA graph,
plainly launched, with almost no work; o_proj's programmatic launch then overlaps q/k/v's end instead
(docs/results.md, GPU Llama-7B block).

Runs after RewriteAttentionToFlash and RewriteGemvToCuda (it reads both passes' calls), with or after
FuseGemvPrologueCuda, before LegalizeOps; the pipeline adds it for cuda sm_80+ from config.CudaLibraries
(`gemv`, `gemv_attention`).
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..kernels.flash_attention import ROPE_FUNCTION, ROPE_QK_FUNCTION
from ..kernels.gemv import (
    ATTN_HEAD_DIMS,
    ATTN_MAX_ROWS,
    NK_ADD_FUNCTION,
    NK_ATTN_ADD_FUNCTION,
    NK_ATTN_FUNCTION,
    NK_FUNCTION,
)
from .fusion_utils import extern_call, has_call, is_op, static_shape, use_counts, with_functions

logger = logging.getLogger(__name__)

DTYPES = ("float16", "bfloat16")
FUSED = {NK_FUNCTION: NK_ATTN_FUNCTION, NK_ADD_FUNCTION: NK_ATTN_ADD_FUNCTION}
ROPE = {ROPE_QK_FUNCTION: 2, ROPE_FUNCTION: 1}  # the flash forms taken, and what each rotates


def _shape(expr) -> list[int] | None:
    """`expr`'s static shape when it is a tensor of a dtype the kernel takes, else None."""
    return static_shape(expr) if isinstance(expr.ty, relax.TensorType) and expr.ty.dtype in DTYPES else None


def attention_operands(var2val: dict, uses, x, features: int, max_rows: int = ATTN_MAX_ROWS) -> tuple | None:
    """(q, k, v, cos, sin, heads, causal, scale, rope; the variables computing x) when `x` is a single-use
    ``R.reshape(o, (..., features))`` of a single-use flash call ``o`` (the _rope_qk or _rope form) of one sequence
    (batch 1) of at most `max_rows` rows attending to itself, D 64 or 128, features = heads x D; else None."""
    reshape = var2val.get(x) if isinstance(x, relax.Var) and uses[x] == 1 else None
    if not is_op(reshape, "relax.reshape"):
        return None
    o = reshape.args[0]
    flash = extern_call(var2val.get(o), ROPE) if isinstance(o, relax.Var) and uses[o] == 1 else None
    if flash is None:
        return None
    q, k, v, cos, sin, heads, causal, scale, _block_m = flash[1]
    out = _shape(o)
    if out is None or len(out) != 4 or out[0] != 1 or not 1 <= out[1] <= max_rows:
        return None
    _batch, rows, query_heads, dim = out
    if dim not in ATTN_HEAD_DIMS or features != query_heads * dim or x.ty.dtype != o.ty.dtype:
        return None
    if any((_shape(t) or [0, 0])[:2] != [1, rows] for t in (q, k, v)):
        return None
    rope = relax.prim_value(tirx.IntImm("int64", ROPE[flash[0]]))
    return [q, k, v, cos, sin, heads, causal, scale, rope], [x, o]


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, func: relax.Function):
        super().__init__(mod)
        self.var2val, self.uses = relax.analysis.get_var2val(func), use_counts(func)
        self.count = 0

    def visit_call_(self, call):
        found = extern_call(call, FUSED)
        new = self._fused(call, *found) if found else None
        return new if new is not None else super().visit_call_(call)

    def _fused(self, call, name: str, operands: list) -> relax.Call | None:
        w = _shape(operands[1])
        if w is None or len(w) != 2 or operands[1].ty.dtype != call.ty.dtype:
            return None
        found = attention_operands(self.var2val, self.uses, operands[0], w[1])
        if found is None:
            return None
        self.count += 1
        args = [*found[0], *operands[1:]]
        return relax.call_dps_packed(FUSED[name], [self.visit_expr(a) for a in args], call.ty)


@tvm.transform.module_pass(opt_level=0, name="FuseAttentionGemvCuda")
class FuseAttentionGemvCuda:
    """A one- or two-row bucket's flash attention computed by the (N, K) GEMV that reads it (see above)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gvar, func in mod.functions_items():
            if not isinstance(func, relax.Function) or not has_call(func, lambda e: extern_call(e, ROPE)):
                continue
            rewriter = _Rewriter(mod, func)
            new = rewriter.visit_expr(func)
            if rewriter.count:
                updates[gvar] = relax.analysis.remove_all_unused(new)  # the flash call and its reshape
                logger.info("%s: %d attention(s) as the (N, K) GEMV's prologue", gvar.name_hint, rewriter.count)
        return with_functions(mod, updates)
