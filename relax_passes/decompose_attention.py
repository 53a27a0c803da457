"""DecomposeAttention: `R.nn.attention` → batched matmul, causal mask, softmax, batched matmul.

TVM legalises `R.nn.attention` into one PrimFunc that holds two batched matmuls, the mask and a
softmax. No schedule rule or search handles that kernel well (measured: 0.7 GFLOP/s, 40% of a
llama block at n=128), and MetaSchedule's builds of it fail in TVM 0.27. Split, each part is an
ordinary kernel: the matmuls are tuned like any contraction, the masked softmax gets the
reduction rule. (A fused attention kernel with online softmax replaces this in the fusion work.)

Run before LegalizeOps. Only calls without bias or window, with no mask or a top-left causal
mask (the one `is_causal=True` means when queries and keys have the same length), are rewritten.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .fusion_utils import rewrite_functions


def _causal_bias(bb: relax.BlockBuilder, n, m, dtype: str) -> relax.Expr:
    """-inf above the diagonal, 0 on and below: its own kernel, marked opaque so FuseOps keeps it
    out of the score matmul (fused in, it made the matmul rule fall back: 0.7 s at n=1024)."""
    from tvm import te

    def bias():
        return te.compute(
            (n, m),
            lambda i, j: tvm.tirx.if_then_else(j > i, tvm.tirx.const(float("-inf"), dtype), tvm.tirx.const(0.0, dtype)),
            name="causal_bias",
        )

    out = bb.emit_te(bias, primfunc_name_hint="causal_bias")
    kernel = bb.lookup_binding(out).args[0]
    bb.update_func(kernel, bb.get()[kernel].with_attr("op_pattern", 8))  # kOpaque
    return out


def _decompose(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr | None:
    query, key, value = call.args[:3]
    attrs = call.attrs
    if len(call.args) > 3 or attrs.window_size is not None or attrs.causal_mask not in (None, "TopLeft"):
        return None
    if any(not isinstance(a.ty, relax.TensorType) or a.ty.ndim != 4 for a in (query, key, value)):
        return None
    head_dim = query.ty.shape.values[3]
    if attrs.scale is not None:
        scale = float(attrs.scale.value)
    elif isinstance(head_dim, tvm.tirx.IntImm):
        scale = 1.0 / math.sqrt(int(head_dim))
    else:
        return None
    dtype = str(query.ty.dtype)
    q = bb.emit(relax.op.permute_dims(query, [0, 2, 1, 3]))  # b h n d
    k = bb.emit(relax.op.permute_dims(key, [0, 2, 3, 1]))  # b h d m
    v = bb.emit(relax.op.permute_dims(value, [0, 2, 1, 3]))  # b h m d
    scores = bb.emit(relax.op.multiply(relax.op.matmul(q, k), relax.const(scale, dtype)))
    if attrs.causal_mask == "TopLeft":
        n, m = scores.ty.shape.values[2], scores.ty.shape.values[3]
        scores = bb.emit(relax.op.add(scores, _causal_bias(bb, n, m, dtype)))  # a plain bias-add epilogue
    probs = bb.emit(relax.op.nn.softmax(scores, axis=-1))
    out = bb.emit(relax.op.matmul(probs, v))  # b h n d
    return relax.op.permute_dims(out, [0, 2, 1, 3])


@mutator
class _Decomposer(PyExprMutator):
    def __init__(self, mod):
        super().__init__(mod)
        self.count = 0

    def visit_call_(self, call):
        call = self.visit_expr_post_order(call)
        if isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.nn.attention":
            rewritten = _decompose(self.builder_, call)
            if rewritten is not None:
                self.count += 1
                return rewritten
        return call


@tvm.transform.module_pass(opt_level=0, name="DecomposeAttention")
class DecomposeAttention:
    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, _Decomposer(mod))
