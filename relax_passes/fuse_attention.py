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
from .fusion_utils import bound_call, rewrite_functions, static_int

logger = logging.getLogger(__name__)

OPAQUE = 8  # tvm::relax::OpPatternKind::kOpaque


def _repeated_heads(bb: relax.BlockBuilder, expr: relax.Expr) -> tuple[relax.Expr, int]:
    """(tensor before `R.repeat(..., axis=2)`, repeats) when `expr` is bound to such a repeat, else (expr, 1)."""
    if not isinstance(expr, relax.Var):
        return expr, 1
    bound = bb.lookup_binding(expr)
    if not (isinstance(bound, relax.Call) and isinstance(bound.op, tvm.ir.Op) and bound.op.name == "relax.repeat"):
        return expr, 1
    source = bound.args[0]
    if not isinstance(source.ty, relax.TensorType) or source.ty.ndim != 4:
        return expr, 1
    axis = bound.attrs.axis
    if axis is None or int(axis) % 4 != 2:
        return expr, 1
    return source, int(bound.attrs.repeats)


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
    key_src, key_group = _repeated_heads(bb, key)
    value_src, value_group = _repeated_heads(bb, value)
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


def _same_shape(a: relax.Expr, b: relax.Expr) -> bool:
    sa, sb = a.ty.shape, b.ty.shape
    if sa is None or sb is None or not isinstance(sa, relax.ShapeExpr) or not isinstance(sb, relax.ShapeExpr):
        return False
    analyzer = tvm.sym.Analyzer()
    return len(sa.values) == len(sb.values) and all(
        analyzer.can_prove_equal(x, y) for x, y in zip(sa.values, sb.values)
    )


def _no_broadcast(bb, expr):
    """`expr` through `broadcast_to`s that keep the shape (what torch.export writes around matmuls)."""
    while (call := bound_call(bb, expr, "relax.broadcast_to")) is not None and _same_shape(call.args[0], expr):
        expr = call.args[0]
    return expr


def _scalar(bb, expr) -> float | None:
    """The value of a scalar constant (a constant or `R.full` of one), else None."""
    while isinstance(expr, relax.Var) and bb.lookup_binding(expr) is not None:
        expr = bb.lookup_binding(expr)
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == "relax.full":
        if isinstance(expr.args[0], relax.ShapeExpr) and len(expr.args[0].values) == 0:
            expr = expr.args[1]
    if isinstance(expr, tvm.ir.expr.GenericConst) and expr.ty.ndim == 0:
        return float(expr.value.numpy())
    return None


def _scaled(bb, expr) -> tuple[relax.Expr, float]:
    """(x, c) for `expr` = x · c with scalar constants c (1.0 when there are none)."""
    scale = 1.0
    while (call := bound_call(bb, expr, "relax.multiply")) is not None:
        value = _scalar(bb, call.args[1])
        if value is None:
            break
        scale, expr = scale * value, call.args[0]
    return expr, scale


def _axes(call, expected) -> bool:
    return call.attrs.axes is not None and [int(a) for a in call.attrs.axes] == expected


def _position(bb, expr, rank: int = 4) -> tuple[int, tirx.PrimExpr] | None:
    """(axis, extent) when `expr` holds the index along one axis of a `rank`-d tensor: `arange(0, N)`
    (plus a constant 0) put on that axis by `expand_dims`."""
    inserted = []
    while (call := bound_call(bb, expr, "relax.expand_dims", "relax.add")) is not None:
        if call.op.name == "relax.add":
            if _scalar(bb, call.args[1]) != 0.0:
                return None
        else:
            inserted.append([int(a) for a in call.attrs.axis])
        expr = call.args[0]
    arange = bound_call(bb, expr, "relax.arange")
    if arange is None:
        return None
    start, end, step = arange.args
    if not (isinstance(start, tirx.IntImm) and int(start) == 0 and isinstance(step, tirx.IntImm) and int(step) == 1):
        return None
    axis, ndim = 0, 1
    for axes in reversed(inserted):  # innermost first
        ndim += len(axes)
        for a in sorted(a % ndim for a in axes):
            axis += a <= axis
    return (axis + rank - ndim, end) if ndim <= rank else None


def _mask_terms(bb, expr, n, m) -> list | None:
    """The conjunction a boolean (.., n, m) mask is proven to be: a list of "causal" and the (b, m)
    key-mask tensor, or None when it is anything else."""
    if str(expr.ty.dtype) == "bool" and _scalar(bb, expr) == 1.0:  # True
        return []
    call = bound_call(
        bb,
        expr,
        "relax.broadcast_to",
        "relax.bitwise_and",
        "relax.logical_and",
        "relax.less_equal",
        "relax.index_tensor",
    )
    if call is None:
        return None
    name = call.op.name
    if name == "relax.broadcast_to":
        return _mask_terms(bb, call.args[0], n, m)
    if name in ("relax.bitwise_and", "relax.logical_and"):
        left, right = (_mask_terms(bb, a, n, m) for a in call.args)
        return None if left is None or right is None else left + right
    analyzer = tvm.sym.Analyzer()
    if name == "relax.less_equal":  # key position <= query position
        key, query = (_position(bb, a) for a in call.args)
        if key is None or query is None or key[0] != 3 or query[0] != 2:
            return None
        return ["causal"] if analyzer.can_prove_equal(key[1], m) and analyzer.can_prove_equal(query[1], n) else None
    data, indices = call.args  # index_tensor(mask (b, m), (batch position, key position))
    if not isinstance(indices, relax.Tuple) or len(indices.fields) != 2 or data.ty.ndim != 2:
        return None
    batch, key = (_position(bb, a) for a in indices.fields)
    if batch is None or key is None or batch[0] != 0 or key[0] != 3 or not analyzer.can_prove_equal(key[1], m):
        return None
    if not (
        analyzer.can_prove_equal(batch[1], data.ty.shape.values[0])
        and analyzer.can_prove_equal(data.ty.shape.values[1], m)
    ):
        return None
    if str(data.ty.dtype) != "bool":
        return None
    cast = bound_call(bb, data, "relax.astype")  # a bool view of an integer mask: read the integers
    if cast is not None and str(cast.args[0].ty.dtype).startswith(("int", "uint")):
        data = cast.args[0]
    return [data]


def _all_masked_guard(bb, cond, scores) -> bool:
    """`cond` is torch's guard "every score of the row is -inf": not(bool(max(int8(not(scores == -inf)), -1)))."""
    chain = [
        ("relax.logical_not", None),
        ("relax.astype", "bool"),
        ("relax.max", None),
        ("relax.astype", "int8"),
        ("relax.logical_not", None),
        ("relax.equal", None),
    ]
    expr, call = cond, None
    for op, dtype in chain:
        call = bound_call(bb, expr, op)
        if call is None or (dtype is not None and str(call.attrs.dtype) != dtype):
            return False
        if op == "relax.max" and not (
            call.attrs.keepdims and call.attrs.axis is not None and [int(a) % 4 for a in call.attrs.axis] == [3]
        ):
            return False
        expr = call.args[0]
    return call.args[0].same_as(scores) and _scalar(bb, call.args[1]) == float("-inf")


def _heads_of(bb, expr) -> tuple[relax.Expr, int]:
    """(x, g) for `expr` = repeat_kv(x, g):
    reshape(broadcast_to(expand_dims(x, 2), (b, h, g, m, d)), (b, h·g, m, d))."""
    reshape = bound_call(bb, expr, "relax.reshape")
    bcast = None if reshape is None else bound_call(bb, reshape.args[0], "relax.broadcast_to")
    expand = None if bcast is None else bound_call(bb, bcast.args[0], "relax.expand_dims")
    if expand is None or [int(a) for a in expand.attrs.axis] != [2] or expand.args[0].ty.ndim != 4:
        return expr, 1
    source, group = expand.args[0], static_int(bcast.ty.shape.values[2])
    analyzer = tvm.sym.Analyzer()
    wide, out, src = bcast.ty.shape.values, expr.ty.shape.values, source.ty.shape.values
    same = [(src[i], wide[j]) for i, j in ((0, 0), (1, 1), (2, 3), (3, 4))] + [
        (out[i], wide[j]) for i, j in ((0, 0), (2, 3), (3, 4))
    ]
    if group is None or not all(analyzer.can_prove_equal(x, y) for x, y in same):  # only axis 2 is broadcast
        return expr, 1
    return source, group


def _to_bnhd(bb, expr):
    """`expr` (b, h, n, d) as (b, n, h, d): the source of a permute_dims [0, 2, 1, 3], else a new one."""
    call = bound_call(bb, expr, "relax.permute_dims")
    if call is not None and _axes(call, [0, 2, 1, 3]):
        return call.args[0]
    return bb.emit(relax.op.permute_dims(expr, [0, 2, 1, 3]))


def _fuse_decomposed(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr | None:
    """The fused replacement of `call` = matmul(softmax(scores + mask), v) (module docstring), else None."""
    probs, value = (_no_broadcast(bb, a) for a in call.args)
    guard = bound_call(bb, probs, "relax.where")
    cond = None
    if guard is not None:  # where(all -inf, zeros, softmax)
        zeros = bound_call(bb, guard.args[1], "relax.full_like", "relax.zeros_like")
        if zeros is None and _scalar(bb, guard.args[1]) != 0.0:  # ONNX: a scalar 0
            return None
        if zeros is not None and zeros.op.name == "relax.full_like" and _scalar(bb, zeros.args[1]) != 0.0:
            return None
        cond, probs = guard.args[0], guard.args[2]
    softmax = bound_call(bb, probs, "relax.nn.softmax")
    if softmax is None or int(softmax.attrs.axis) % 4 != 3 or softmax.args[0].ty.ndim != 4:
        return None
    masked = softmax.args[0]
    nan_guard = (
        cond is not None and (isnan := bound_call(bb, cond, "relax.isnan")) is not None and isnan.args[0].same_as(probs)
    )
    if cond is not None and not (nan_guard or _all_masked_guard(bb, cond, masked)):
        return None
    add = bound_call(bb, masked, "relax.add")
    if add is None:
        return None
    for scores, bias in (add.args, reversed(add.args)):
        where = bound_call(bb, bias, "relax.where")
        if where is not None and where.args[0].ty.ndim == 4 and _scalar(bb, where.args[1]) == 0.0:
            break
    else:
        return None
    fill = _scalar(bb, where.args[2])
    key_mask = {float("-inf"): "zero" if cond is not None else None, _F32_LOWEST: "uniform"}.get(fill)
    scores, post_scale = _scaled(bb, scores)
    matmul = bound_call(bb, scores, "relax.matmul")
    if key_mask is None or matmul is None:
        return None
    query, q_scale = _scaled(bb, _no_broadcast(bb, matmul.args[0]))
    key_t, k_scale = _scaled(bb, _no_broadcast(bb, matmul.args[1]))
    transpose = bound_call(bb, key_t, "relax.permute_dims")
    if transpose is None or not _axes(transpose, [0, 1, 3, 2]):
        return None
    key, k_scale2 = _scaled(bb, transpose.args[0])
    types = [x.ty for x in (query, key, value)]
    if any(
        not isinstance(t, relax.TensorType) or t.ndim != 4 or t.shape is None or str(t.dtype) != "float32"
        for t in types
    ):
        return None
    b, heads, n, head_dim = query.ty.shape.values
    m = key.ty.shape.values[2]
    terms = _mask_terms(bb, where.args[0], n, m)
    masks = [t for t in terms or [] if not isinstance(t, str)]
    if terms is None or len(masks) == len(terms) or len(masks) > 1:  # causal, at most one key mask
        return None
    analyzer = tvm.sym.Analyzer()
    if not all(analyzer.can_prove_equal(x.ty.shape.values[0], b) for x in [key, value, *masks]):
        return None
    heads, head_dim = static_int(heads), static_int(head_dim)
    (key, group), (value, v_group) = _heads_of(bb, key), _heads_of(bb, value)
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
