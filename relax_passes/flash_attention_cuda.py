"""RewriteAttentionToFlash: attention calls become one fused flash-attention kernel (CUDA only).

`R.nn.attention(q, k, v)` with q (b, n, heads, d), k and v (b, m, kv_heads, d), fp16 or bf16,
d = 64 or 128, no bias and no window, no mask or the top-left causal mask, becomes
`R.call_dps_packed("relaxtune_flash_attention", (q, k, v, causal, scale, block_m), out)`: the
kernel of relaxtune/cuda_flash_attention.py (FlashAttention-2 style, online softmax: the n x n
scores never reach memory), linked into the artifact. Grouped-query attention is read in place:
a k and a v that are `R.repeat(x, r, axis=2)` of kv heads (the model's repeat_kv) are passed as
`x`, and the kernel maps query head h to kv head h / r, so the repeat kernels go away.

Operands are read where the projection put them (attention_operand_trace.py, as CPU's in-place
attention does): a q, k or v that is a single-use head slice of a (b, n, H, d) tensor (the merged
q/k/v projection) is read from that tensor at a head offset
(`relaxtune_flash_attention_in_place`), and a q that is a rotate-half RoPE of such a slice (or of
any tensor) with (1, n, 1, d) cos/sin tables is rotated as the kernel loads it
(`relaxtune_flash_attention_rope`), so the slice copies and q's rotation kernel go away. k's
rotation stays a kernel where there are several query blocks (each would rotate every key tile again); in a
bucket whose upper bound of `dim` fits one query block (the decode buckets), a k that is the same rotation of a
head slice is rotated as the kernel loads it too (`relaxtune_flash_attention_rope_qk`), and its kernel goes away.

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

from ..kernels.flash_attention import (
    BLOCK_ROWS,
    FUNCTION,
    HEAD_DIMS,
    IN_PLACE_FUNCTION,
    ROPE_FUNCTION,
    ROPE_QK_FUNCTION,
    SM90_MIN_ROWS,
    supports,
)
from .attention_operand_trace import Source, Tracer
from .bucket_dispatch import BUCKET_ATTR
from .fusion_utils import is_op, static_int, use_counts

logger = logging.getLogger(__name__)

DTYPES = ("float16", "bfloat16")


def _kv_heads(expr: relax.Expr, lookup) -> tuple[relax.Expr, int]:
    """(the tensor before a `repeat(x, r, axis=2)`, r), or (expr, 1)."""
    value = lookup(expr) if isinstance(expr, relax.Var) else None
    if is_op(value, "relax.repeat") and value.attrs.axis is not None and int(value.attrs.axis) in (2, -2):
        source = value.args[0]
        if isinstance(source.ty, relax.TensorType) and source.ty.ndim == 4:
            return source, int(value.attrs.repeats)
    return expr, 1


def flash_args(call: relax.Call, lookup, block_m: int = 0) -> list | None:
    """The arguments of the flash call that replaces the attention `call`, or None (not supported);
    `lookup(var)`: the value bound to a variable, or None."""
    if not is_op(call, "relax.nn.attention") or len(call.args) != 3:
        return None
    attrs = call.attrs
    if attrs.window_size is not None or attrs.causal_mask not in (None, "TopLeft"):
        return None
    q, k, v = call.args
    if not all(
        isinstance(x.ty, relax.TensorType) and x.ty.ndim == 4 and x.ty.shape is not None for x in (q, k, v, call)
    ):
        return None
    dtype = q.ty.dtype
    if dtype not in DTYPES or any(x.ty.dtype != dtype for x in (k, v, call)):
        return None
    (k, k_rep), (v, v_rep) = _kv_heads(k, lookup), _kv_heads(v, lookup)
    if k_rep != v_rep:
        k, v = call.args[1], call.args[2]  # only one of them repeated: pass both repeated
    qs, ks, vs = (x.ty.shape.values for x in (q, k, v))
    d, heads, kv_heads = static_int(qs[3]), static_int(qs[2]), static_int(ks[2])
    if (
        d not in HEAD_DIMS
        or static_int(ks[3]) != d
        or static_int(vs[3]) != d
        or heads is None
        or not kv_heads
        or heads % kv_heads
    ):
        return None
    analyzer = tvm.sym.Analyzer()
    same = [(qs[0], ks[0]), (qs[0], vs[0]), (ks[1], vs[1]), (ks[2], vs[2])]
    if not all(analyzer.can_prove_equal(a, b) for a, b in same):
        return None
    scale = float(attrs.scale.value) if attrs.scale is not None else 1.0 / math.sqrt(d)
    causal = 1 if attrs.causal_mask == "TopLeft" else 0
    return [
        q,
        k,
        v,
        relax.prim_value(tvm.tirx.IntImm("int64", causal)),
        relax.prim_value(tvm.tirx.FloatImm("float64", scale)),
        relax.prim_value(tvm.tirx.IntImm("int64", block_m)),
    ]


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod, block_m: int, in_place: bool):
        super().__init__(mod)
        self.block_m, self.in_place = block_m, in_place
        self.uses, self.views, self.count, self.read_in_place, self.rotated = {}, {}, 0, 0, 0
        self.one_block, self.rotated_k = False, 0

    def rewrite(self, func: relax.Function, one_block: bool = False) -> relax.Function | None:
        """`func` with its attention calls on the flash kernel, or None; `one_block`: its query rows fit one block."""
        self.uses, self.views, self.count, self.read_in_place, self.rotated = use_counts(func), {}, 0, 0, 0
        self.one_block, self.rotated_k = one_block, 0
        new = self.visit_expr(func)
        return relax.analysis.remove_all_unused(new) if self.count else None  # the absorbed repeats, slices, rotation

    def _lookup(self, var: relax.Var):
        return self.builder_.lookup_binding(var)

    def visit_call_(self, call):
        call = self.visit_expr_post_order(call)
        args = flash_args(call, self._lookup, self.block_m)
        if args is None:
            return call
        self.count += 1
        in_place = self._in_place(*args[:3]) if self.in_place else None
        if in_place is None:
            return relax.call_dps_packed(FUNCTION, args, call.ty)
        function, operands = in_place
        return relax.call_dps_packed(function, [*operands, *args[3:]], call.ty)

    def _in_place(self, q, k, v) -> tuple[str, list] | None:
        """(function, operands) reading q, k, v in place and rotating q on load where they allow it."""
        tracer = Tracer(self.builder_, self.uses, self.views)
        rope = tracer.rope(q)
        if rope is not None:
            x, tables, reads = rope
            qs = tracer.heads(x, uses=reads) or Source(x)  # x is read by x * cos and by the rotation
        else:
            qs, tables = tracer.heads(q) or Source(q), None
        ks, vs = tracer.heads(k) or Source(k), tracer.heads(v) or Source(v)
        if tables is None and all(s.tensor.same_as(x) for s, x in zip((qs, ks, vs), (q, k, v))):
            return None
        heads = relax.ShapeExpr([qs.offset, ks.offset, vs.offset, static_int(k.ty.shape.values[2])])
        self.read_in_place += 1
        if tables is None:
            return IN_PLACE_FUNCTION, [qs.tensor, ks.tensor, vs.tensor, heads]
        self.rotated += 1
        k_rope = tracer.rope(k) if self.one_block else None
        if k_rope is not None and all(a.same_as(b) for a, b in zip(k_rope[1], tables)):
            kx, _tables, reads = k_rope
            ks = tracer.heads(kx, uses=reads) or Source(kx)
            heads = relax.ShapeExpr([qs.offset, ks.offset, vs.offset, static_int(k.ty.shape.values[2])])
            self.rotated_k += 1
            return ROPE_QK_FUNCTION, [qs.tensor, ks.tensor, vs.tensor, *(tracer.rows(t) for t in tables), heads]
        return ROPE_FUNCTION, [qs.tensor, ks.tensor, vs.tensor, *(tracer.rows(t) for t in tables), heads]


@tvm.transform.module_pass(opt_level=0, name="RewriteAttentionToFlash")
class RewriteAttentionToFlash:
    """Attention calls of functions whose bucket of `dim` starts at >= `min_rows` call the flash kernel."""

    def __init__(
        self, arch: str, dim: str = "n", min_rows: int = 1, block_m: int = 0, in_place: bool = True, rope_k: bool = True
    ):
        self.arch, self.dim, self.min_rows, self.block_m, self.in_place = arch, dim, min_rows, block_m, in_place
        self.rope_k = rope_k

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if not supports(self.arch):
            return mod
        rewriter = _Rewriter(mod, self.block_m, self.in_place)
        changed = False
        for gvar, func in mod.functions_items():
            if not isinstance(func, relax.Function):
                continue
            bucket = func.attrs[BUCKET_ATTR] if func.attrs is not None and BUCKET_ATTR in func.attrs else None
            if bucket is not None and self.dim in bucket and int(bucket[self.dim][0]) < self.min_rows:
                continue
            one_block = self.rope_k and bucket is not None and self.dim in bucket and self._one_block(bucket)
            new = rewriter.rewrite(func, one_block=one_block)
            if new is not None:
                rewriter.builder_.update_func(gvar, new)
                changed = True
                logger.info(
                    "%s: %d attention call(s) -> flash attention (%d reading q/k/v in place, %d rotating q on load, "
                    "%d k too)",
                    gvar.name_hint,
                    rewriter.count,
                    rewriter.read_in_place,
                    rewriter.rotated,
                    rewriter.rotated_k,
                )
        return rewriter.builder_.get() if changed else mod

    def _one_block(self, bucket) -> bool:
        """Whether the bucket's largest `dim` fits one query block of the kernel that `block_m` picks (mma.sync)."""
        rows = self.block_m if self.block_m in (64, 128) else BLOCK_ROWS if self.block_m == 0 else 0
        return int(bucket[self.dim][1]) <= min(rows, SM90_MIN_ROWS - 1)
