"""FuseAttention: `R.nn.attention` → one online-softmax TIR kernel (`kernels/attention_tir.py`).

Each call is replaced by a `call_tir` of the fused kernel: scaled Q·Kᵀ, causal mask, softmax and
·V in one pass over the keys, so no `n x m` score tensor goes through memory. Grouped-query
attention written as `R.repeat(k, g, axis=2)` / `R.repeat(v, g, axis=2)` feeding the attention
(what `repeat_kv` and the built-in llama block produce) reads the un-repeated keys and values: the
repeats become dead and DeadCodeElimination drops them.

Matches the operator and its attributes only: no bias argument, no sliding window, a causal mask
of None, `TopLeft` or `BottomRight`, 4-d float q, k, v of one dtype with static head counts and a
static head_dim shared by k and v. Anything else is left to DecomposeAttention or legalisation.
The kernel is marked opaque (`op_pattern` 8), so FuseOps leaves it alone and the attention rule
(`schedules/rules/cpu_attention.py`) schedules it whole (it is not a tuning task).

Imported models (``torch.export`` of ``transformers``) arrive decomposed: ``matmul(q·c, (kᵀ)·c)``
(or ``matmul(q, kᵀ)·c``), plus an additive mask ``where(mask, 0, fill)``, softmax over the keys,
for ``fill = -inf`` torch's guard that zeroes rows whose scores are all ``-inf`` (or the ONNX export's
``where(isnan(p), 0, p)``: for finite scores a softmax row is NaN exactly then), then ``matmul`` with
``v``; CanonicalizeOnnxAttention brings the rest of the ONNX export's chain to this form. That chain is fused too
(``_fuse_decomposed``) when the boolean mask is proven to be
exactly ``causal ∧ key-padding``: the conjunction of ``key position <= query position`` (both
``arange`` from 0, broadcast by ``expand_dims``) and ``attention_mask[batch, key position]`` read
by ``index_tensor`` (an ``R.full`` of True may join it). The kernel then reads the ``(b, m)`` key
mask itself (``key_mask``), never the ``n x n`` mask tensor. Rows with no visible key give what
the source gives: zeros with the guard and ``fill = -inf``; the mean of all values with
``fill`` = the float32 minimum (every score of such a row rounds to it, so the softmax is
uniform). A mask that is not provably that conjunction, another fill, ``-inf`` without the guard
(NaN rows) or a softmax over another axis: not fused. Heads repeated as ``reshape(broadcast_to(
expand_dims(x, 2)))`` (``repeat_kv``) are read un-repeated. The kernel takes ``(b, n, heads, d)``,
so q, k, v are transposed to it (a transpose in the source is dropped instead) and the output back;
the model's own transposes of that output are composed with it (``_compose_output_transposes``),
so a chain back to ``(b, n, heads, d)`` (torch.export writes three) leaves no copy kernel.
What each piece of either form is proven to be (the repeats, scales, masks, guards) is read by
attention_patterns.py; this module builds the kernel calls and rewrites the functions.

Run before LegalizeOps and before DecomposeAttention (the fallback for the calls left here). On a
GPU target (in scope) the pass does nothing yet: the kernel has a CPU schedule only, and dlight's
GPU fallback would give it one thread per query tile.
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..kernels.attention_masks import CAUSAL_MASKS
from ..kernels.attention_spec import ATTR, KIND
from ..kernels.attention_tir import attention_kernel
from .attention_patterns import (
    all_masked_guard,
    has_axes,
    heads_of,
    mask_terms,
    no_broadcast,
    repeated_heads,
    scalar,
    scaled,
)
from .fusion_utils import bound_call, rewrite_functions, static_int

logger = logging.getLogger(__name__)

OPAQUE = 8  # tvm::relax::OpPatternKind::kOpaque


def _kernel(bb: relax.BlockBuilder, kernel: tirx.PrimFunc) -> relax.GlobalVar:
    return bb.add_func(kernel.with_attr("op_pattern", OPAQUE), "fused_attention")


def _fuse(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr | None:
    """The fused call replacing `call`, or None where the kernel does not implement it."""
    attrs = call.attrs
    if len(call.args) != 3 or attrs.window_size is not None or attrs.causal_mask not in CAUSAL_MASKS:
        return None
    query, key, value = call.args
    types = [a.ty for a in (query, key, value)]
    if any(not isinstance(t, relax.TensorType) or t.ndim != 4 or t.shape is None for t in types):
        return None
    dtype = str(types[0].dtype)
    if any(str(t.dtype) != dtype for t in types) or not dtype.startswith(("float", "bfloat")):
        return None
    heads, head_dim = (static_int(x) for x in types[0].shape.values[2:])
    value_dim = static_int(types[2].shape.values[3])
    if heads is None or head_dim is None or value_dim != head_dim:
        return None
    key_src, key_group = repeated_heads(bb, key)
    value_src, value_group = repeated_heads(bb, value)
    if key_group != value_group or key_group < 1:  # one side repeated, the other not: keep the repeats
        key_src, value_src, key_group = key, value, 1
    kv_heads = static_int(key_src.ty.shape.values[2])
    if kv_heads is None or kv_heads != static_int(value_src.ty.shape.values[2]) or kv_heads * key_group != heads:
        return None
    if static_int(key_src.ty.shape.values[3]) != head_dim:
        return None
    scale = None if attrs.scale is None else float(attrs.scale.value)
    gv = _kernel(bb, attention_kernel(heads, kv_heads, head_dim, dtype, attrs.causal_mask, scale))
    return relax.call_tir(gv, [query, key_src, value_src], relax.TensorType(types[0].shape, dtype))


# ---- the decomposed form of imported models (see the module docstring) ----

_F32_LOWEST = -3.4028234663852886e38


def _to_bnhd(bb, expr):
    """`expr` (b, h, n, d) as (b, n, h, d): the source of a permute_dims [0, 2, 1, 3], else a new one."""
    call = bound_call(bb, expr, "relax.permute_dims")
    if call is not None and has_axes(call, [0, 2, 1, 3]):
        return call.args[0]
    return bb.emit(relax.op.permute_dims(expr, [0, 2, 1, 3]))


def _fuse_decomposed(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr | None:
    """The fused replacement of `call` = matmul(softmax(scores + mask), v) (module docstring), else None."""
    probs, value = (no_broadcast(bb, a) for a in call.args)
    guard = bound_call(bb, probs, "relax.where")
    cond = None
    if guard is not None:  # where(all -inf, zeros, softmax)
        zeros = bound_call(bb, guard.args[1], "relax.full_like", "relax.zeros_like")
        if zeros is None and scalar(bb, guard.args[1]) != 0.0:  # ONNX: a scalar 0
            return None
        if zeros is not None and zeros.op.name == "relax.full_like" and scalar(bb, zeros.args[1]) != 0.0:
            return None
        cond, probs = guard.args[0], guard.args[2]
    softmax = bound_call(bb, probs, "relax.nn.softmax")
    if softmax is None or int(softmax.attrs.axis) % 4 != 3 or softmax.args[0].ty.ndim != 4:
        return None
    masked = softmax.args[0]
    nan_guard = (
        cond is not None and (isnan := bound_call(bb, cond, "relax.isnan")) is not None and isnan.args[0].same_as(probs)
    )
    if cond is not None and not (nan_guard or all_masked_guard(bb, cond, masked)):
        return None
    add = bound_call(bb, masked, "relax.add")
    if add is None:
        return None
    for scores, bias in (add.args, reversed(add.args)):
        where = bound_call(bb, bias, "relax.where")
        if where is not None and where.args[0].ty.ndim == 4 and scalar(bb, where.args[1]) == 0.0:
            break
    else:
        return None
    fill = scalar(bb, where.args[2])
    key_mask = {float("-inf"): "zero" if cond is not None else None, _F32_LOWEST: "uniform"}.get(fill)
    scores, post_scale = scaled(bb, scores)
    matmul = bound_call(bb, scores, "relax.matmul")
    if key_mask is None or matmul is None:
        return None
    query, q_scale = scaled(bb, no_broadcast(bb, matmul.args[0]))
    key_t, k_scale = scaled(bb, no_broadcast(bb, matmul.args[1]))
    transpose = bound_call(bb, key_t, "relax.permute_dims")
    if transpose is None or not has_axes(transpose, [0, 1, 3, 2]):
        return None
    key, k_scale2 = scaled(bb, transpose.args[0])
    types = [x.ty for x in (query, key, value)]
    if any(
        not isinstance(t, relax.TensorType) or t.ndim != 4 or t.shape is None or str(t.dtype) != "float32"
        for t in types
    ):
        return None
    b, heads, n, head_dim = query.ty.shape.values
    m = key.ty.shape.values[2]
    terms = mask_terms(bb, where.args[0], n, m)
    masks = [t for t in terms or [] if not isinstance(t, str)]
    if terms is None or len(masks) == len(terms) or len(masks) > 1:  # causal, at most one key mask
        return None
    analyzer = tvm.sym.Analyzer()
    if not all(analyzer.can_prove_equal(x.ty.shape.values[0], b) for x in [key, value, *masks]):
        return None
    heads, head_dim = static_int(heads), static_int(head_dim)
    (key, group), (value, v_group) = heads_of(bb, key), heads_of(bb, value)
    kv_heads = static_int(key.ty.shape.values[1])
    if heads is None or head_dim is None or group != v_group or kv_heads is None:
        return None
    (_, v_heads, _, v_dim), k_dim = value.ty.shape.values, key.ty.shape.values[3]
    if kv_heads * group != heads or [static_int(x) for x in (v_heads, v_dim, k_dim)] != [kv_heads, head_dim, head_dim]:
        return None
    scale = post_scale * q_scale * k_scale * k_scale2
    if masks:
        mask_dtype = str(masks[0].ty.dtype)
        kernel = attention_kernel(
            heads, kv_heads, head_dim, "float32", "TopLeft", scale, key_mask=key_mask, mask_dtype=mask_dtype
        )
    else:  # causal only: every row sees key 0
        kernel = attention_kernel(heads, kv_heads, head_dim, "float32", "TopLeft", scale)
    args = [_to_bnhd(bb, x) for x in (query, key, value)] + masks
    out = bb.emit(relax.call_tir(_kernel(bb, kernel), args, relax.TensorType((b, n, heads, head_dim), "float32")))
    return relax.op.permute_dims(out, [0, 2, 1, 3])


@mutator
class _AttentionFuser(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.fused = 0
        self.left = 0

    def visit_call_(self, call):
        call = self.visit_expr_post_order(call)
        name = call.op.name if isinstance(call.op, tvm.ir.Op) else None
        if name in ("relax.nn.attention", "relax.matmul"):
            fused = (
                _fuse(self.builder_, call) if name == "relax.nn.attention" else _fuse_decomposed(self.builder_, call)
            )
            if fused is None and name == "relax.matmul":
                return call
            if fused is None:
                self.left += 1
                return call
            self.fused += 1
            return fused
        if name == "relax.permute_dims":
            return _compose_output_transposes(self.builder_, call)
        return call


def _compose_output_transposes(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """`call` = permute_dims(permute_dims(out, p1), p2) of a fused kernel's output as one transpose of
    `out`, or `out` itself where they cancel (imported models transpose the (b, h, n, d) result back
    to (b, n, h, d), the kernel's own layout, sometimes in several steps)."""
    inner = bound_call(bb, call.args[0], "relax.permute_dims")
    if inner is None or inner.attrs.axes is None or call.attrs.axes is None:
        return call
    kernel = bound_call(bb, inner.args[0], "relax.call_tir")
    func = None if kernel is None else bb.get()[kernel.args[0]]
    if not isinstance(func, tirx.PrimFunc) or not func.attrs or func.attrs.get(ATTR, None) != KIND:
        return call
    first, second = [int(a) for a in inner.attrs.axes], [int(a) for a in call.attrs.axes]
    axes = [first[a] for a in second]
    return inner.args[0] if axes == sorted(axes) else relax.op.permute_dims(inner.args[0], axes)


@tvm.transform.module_pass(opt_level=0, name="FuseAttention")
class FuseAttention:
    """Replace every supported `R.nn.attention` with one fused online-softmax kernel."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = tvm.target.Target.current(allow_none=True)
        if target is not None and "gpu" in target.keys:  # no GPU schedule for the kernel yet
            logger.info("FuseAttention: GPU target %s, attention left to DecomposeAttention", target.kind.name)
            return mod
        fuser = _AttentionFuser(mod)
        rewritten = rewrite_functions(mod, fuser)
        if fuser.fused or fuser.left:
            logger.info("FuseAttention: %d attention call(s) fused, %d left as they were", fuser.fused, fuser.left)
        return relax.transform.DeadCodeElimination()(rewritten) if fuser.fused else mod
