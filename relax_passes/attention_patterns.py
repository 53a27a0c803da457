"""The patterns FuseAttention matches (not a pass): what an expression is proven to be, read through the
BlockBuilder's bindings (`fusion_utils.bound_call`); nothing is emitted.

For `R.nn.attention`: `repeated_heads`, the tensor before `R.repeat(x, g, axis=2)` and g. For the decomposed
attention of imported models (fuse_attention.py's module docstring): `scalar` (a scalar constant, or an
`R.full` of one), `scaled` (x · c through multiplies by scalar constants), `no_broadcast` (through
`broadcast_to`s that keep the shape), `has_axes` (a permute_dims' axes), `mask_terms` (a boolean mask as
the conjunction of "causal" and one (b, m) key-mask tensor, its positions `arange`s put on axes by
`expand_dims`), `all_masked_guard` (torch's guard for rows whose scores are all -inf) and `heads_of`
(repeat_kv: reshape(broadcast_to(expand_dims(x, 2)))). Where a pattern is not proven: None or False, or
the expression itself with a factor of 1.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx

from .fusion_utils import bound_call, static_int


def repeated_heads(bb: relax.BlockBuilder, expr: relax.Expr) -> tuple[relax.Expr, int]:
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


def _same_shape(a: relax.Expr, b: relax.Expr) -> bool:
    sa, sb = a.ty.shape, b.ty.shape
    if sa is None or sb is None or not isinstance(sa, relax.ShapeExpr) or not isinstance(sb, relax.ShapeExpr):
        return False
    analyzer = tvm.sym.Analyzer()
    return len(sa.values) == len(sb.values) and all(
        analyzer.can_prove_equal(x, y) for x, y in zip(sa.values, sb.values)
    )


def no_broadcast(bb, expr):
    """`expr` through `broadcast_to`s that keep the shape (what torch.export writes around matmuls)."""
    while (call := bound_call(bb, expr, "relax.broadcast_to")) is not None and _same_shape(call.args[0], expr):
        expr = call.args[0]
    return expr


def scalar(bb, expr) -> float | None:
    """The value of a scalar constant (a constant or `R.full` of one), else None."""
    while isinstance(expr, relax.Var) and bb.lookup_binding(expr) is not None:
        expr = bb.lookup_binding(expr)
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == "relax.full":
        if isinstance(expr.args[0], relax.ShapeExpr) and len(expr.args[0].values) == 0:
            expr = expr.args[1]
    if isinstance(expr, tvm.ir.expr.GenericConst) and expr.ty.ndim == 0:
        return float(expr.value.numpy())
    return None


def scaled(bb, expr) -> tuple[relax.Expr, float]:
    """(x, c) for `expr` = x · c with scalar constants c (1.0 when there are none)."""
    scale = 1.0
    while (call := bound_call(bb, expr, "relax.multiply")) is not None:
        value = scalar(bb, call.args[1])
        if value is None:
            break
        scale, expr = scale * value, call.args[0]
    return expr, scale


def has_axes(call, expected) -> bool:
    """`call`'s axes (a permute_dims) are exactly `expected`."""
    return call.attrs.axes is not None and [int(a) for a in call.attrs.axes] == expected


def _position(bb, expr, rank: int = 4) -> tuple[int, tirx.PrimExpr] | None:
    """(axis, extent) when `expr` holds the index along one axis of a `rank`-d tensor: `arange(0, N)`
    (plus a constant 0) put on that axis by `expand_dims`."""
    inserted = []
    while (call := bound_call(bb, expr, "relax.expand_dims", "relax.add")) is not None:
        if call.op.name == "relax.add":
            if scalar(bb, call.args[1]) != 0.0:
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


def mask_terms(bb, expr, n, m) -> list | None:
    """The conjunction a boolean (.., n, m) mask is proven to be: a list of "causal" and the (b, m)
    key-mask tensor, or None when it is anything else."""
    if str(expr.ty.dtype) == "bool" and scalar(bb, expr) == 1.0:  # True
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
        return mask_terms(bb, call.args[0], n, m)
    if name in ("relax.bitwise_and", "relax.logical_and"):
        left, right = (mask_terms(bb, a, n, m) for a in call.args)
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


def all_masked_guard(bb, cond, scores) -> bool:
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
    return call.args[0].same_as(scores) and scalar(bb, call.args[1]) == float("-inf")


def heads_of(bb, expr) -> tuple[relax.Expr, int]:
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
