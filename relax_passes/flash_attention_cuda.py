"""RewriteAttentionToFlash: attention calls become one fused flash-attention kernel (CUDA only).

`R.nn.attention(q, k, v)` with q (b, n, heads, d), k and v (b, m, kv_heads, d), fp16 or bf16,
d = 64 or 128, no bias and no window, no mask or the top-left causal mask, becomes
`R.call_dps_packed("relaxtune_flash_attention", (q, k, v, causal, scale, block_m), out)`: the
kernel of relaxtune/cuda_flash_attention.py (FlashAttention-2 style, online softmax: the n x n
scores never reach memory), linked into the artifact. Grouped-query attention is read in place:
a k and a v that are `R.repeat(x, r, axis=2)` of kv heads (the model's repeat_kv) are passed as
`x`, and the kernel maps query head h to kv head h / r, so the repeat kernels go away.

What it does not match is left to DecomposeAttention (matmul / masked softmax / matmul, then
RewriteBatchedGemmToCublas in the larger buckets). Only bucket functions whose lower bound of
`dim` is at least `min_rows` are rewritten (functions without a bucket always are); the arch
must be sm_80 or newer (mma.sync bf16, cp.async).

Run after BucketDispatch (reads `relaxtune.bucket`) and before DecomposeAttention, which would
otherwise have split the attention calls.
"""

from __future__ import annotations

import logging
import math

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..cuda_flash_attention import FUNCTION, HEAD_DIMS, supports
from .bucket_dispatch import BUCKET_ATTR
from .fusion_utils import is_op

logger = logging.getLogger(__name__)

DTYPES = ("float16", "bfloat16")


def _static(value) -> int | None:
    return int(value) if isinstance(value, tvm.tirx.IntImm) else None


def _kv_heads(expr: relax.Expr, var2val) -> tuple[relax.Expr, int]:
    """(the tensor before a `repeat(x, r, axis=2)`, r), or (expr, 1)."""
    value = var2val.get(expr) if isinstance(expr, relax.Var) else None
    if is_op(value, "relax.repeat") and value.attrs.axis is not None and int(value.attrs.axis) in (2, -2):
        source = value.args[0]
        if isinstance(source.ty, relax.TensorType) and source.ty.ndim == 4:
            return source, int(value.attrs.repeats)
    return expr, 1


def flash_args(call: relax.Call, var2val, block_m: int = 0) -> list | None:
    """The arguments of the flash call that replaces the attention `call`, or None (not supported)."""
    if not is_op(call, "relax.nn.attention") or len(call.args) != 3:
        return None
    attrs = call.attrs
    if attrs.window_size is not None or attrs.causal_mask not in (None, "TopLeft"):
        return None
    q, k, v = call.args
    if not all(isinstance(x.ty, relax.TensorType) and x.ty.ndim == 4 and x.ty.shape is not None for x in (q, k, v, call)):
        return None
    dtype = q.ty.dtype
    if dtype not in DTYPES or any(x.ty.dtype != dtype for x in (k, v, call)):
        return None
    (k, k_rep), (v, v_rep) = _kv_heads(k, var2val), _kv_heads(v, var2val)
    if k_rep != v_rep:
        k, v = call.args[1], call.args[2]  # only one of them repeated: pass both repeated
    qs, ks, vs = (x.ty.shape.values for x in (q, k, v))
    d, heads, kv_heads = _static(qs[3]), _static(qs[2]), _static(ks[2])
    if d not in HEAD_DIMS or _static(ks[3]) != d or _static(vs[3]) != d or heads is None or not kv_heads or heads % kv_heads:
        return None
    analyzer = tvm.sym.Analyzer()
    same = [(qs[0], ks[0]), (qs[0], vs[0]), (ks[1], vs[1]), (ks[2], vs[2])]
    if not all(analyzer.can_prove_equal(a, b) for a, b in same):
        return None
    scale = float(attrs.scale.value) if attrs.scale is not None else 1.0 / math.sqrt(d)
    causal = 1 if attrs.causal_mask == "TopLeft" else 0
    return [
        q, k, v, relax.prim_value(tvm.tirx.IntImm("int64", causal)),
        relax.prim_value(tvm.tirx.FloatImm("float64", scale)), relax.prim_value(tvm.tirx.IntImm("int64", block_m)),
    ]


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod, block_m: int):
        super().__init__(mod)
        self.block_m, self.var2val, self.count = block_m, {}, 0

    def rewrite(self, func: relax.Function) -> relax.Function | None:
        self.var2val, self.count = relax.analysis.get_var2val(func), 0
        new = self.visit_expr(func)
        return relax.analysis.remove_all_unused(new) if self.count else None  # the absorbed repeats

    def visit_call_(self, call):
        args = flash_args(call, self.var2val, self.block_m)  # matched on the original call: var2val knows its vars
        call = self.visit_expr_post_order(call)
        if args is None:
            return call
        self.count += 1
        return relax.call_dps_packed(FUNCTION, [self.visit_expr(a) for a in args], call.ty)


@tvm.transform.module_pass(opt_level=0, name="RewriteAttentionToFlash")
class RewriteAttentionToFlash:
    """Attention calls of functions whose bucket of `dim` starts at >= `min_rows` call the flash kernel."""

    def __init__(self, arch: str, dim: str = "n", min_rows: int = 1, block_m: int = 0):
        self.arch, self.dim, self.min_rows, self.block_m = arch, dim, min_rows, block_m

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if not supports(self.arch):
            return mod
        rewriter = _Rewriter(mod, self.block_m)
        changed = False
        for gvar, func in mod.functions_items():
            if not isinstance(func, relax.Function):
                continue
            bucket = func.attrs[BUCKET_ATTR] if func.attrs is not None and BUCKET_ATTR in func.attrs else None
            if bucket is not None and self.dim in bucket and int(bucket[self.dim][0]) < self.min_rows:
                continue
            new = rewriter.rewrite(func)
            if new is not None:
                rewriter.builder_.update_func(gvar, new)
                changed = True
                logger.info("%s: %d attention call(s) -> flash attention", gvar.name_hint, rewriter.count)
        return rewriter.builder_.get() if changed else mod
