"""CanonicalizeOnnxAttention: the ONNX exporter's attention idioms → the forms FuseAttention matches.

``torch.onnx.export`` of a Hugging Face model, imported with TVM's ONNX frontend, writes three
pieces of the decomposed attention differently from ``torch.export`` (what FuseAttention's
``_fuse_decomposed`` reads). Each is rewritten here into an equal expression of the torch form:

- the key-padding read ``attention_mask[batch, key]`` as ``gather_nd(mask, idx)`` with
  ``idx = concat((i_0[..., None], i_1[..., None]), -1)``, wrapped by the importer for negative
  indices (``where(idx < 0, idx + shape, idx)``) → ``index_tensor(mask, (i_0, i_1))``. Only when
  every ``i_k`` is proven non-negative (positions from ``arange`` with a start >= 0 and a step > 0,
  through ``expand_dims`` / ``broadcast_to``), so the wrap never fires; a ``broadcast_to`` around
  each ``i_k`` is dropped when the sources broadcast to the same shape (``index_tensor`` broadcasts
  its indices itself).
- kᵀ of a ``(b, h, m, d)`` key as ``reshape(permute_dims(reshape(k, (b·h, m, d)), [0, 2, 1]),
  (b, h, d, m))`` (Llama) → ``permute_dims(k, [0, 1, 3, 2])``, when the shapes prove it.
- kᵀ taken straight from the ``(b, m, h, d)`` projection, ``permute_dims(k, [0, 2, 3, 1])`` as the
  right operand of a matmul (GPT-2) → ``permute_dims(permute_dims(k, [0, 2, 1, 3]), [0, 1, 3, 2])``
  (heads first, then the key transpose), which FuseAttention reads back to ``k`` itself.

The ONNX softmax guard ``where(isnan(p), 0, p)`` is FuseAttention's to judge (it knows the fill).
Matches operators, attributes and shapes only. The rewrites change no value, so where FuseAttention
then does not fire the module computes the same (FuseOps puts the two transposes in one kernel).

Run after the ONNX import (``relaxtune.workloads.onnx_import`` binds rank-0 initializers, the
scale and mask fill among them, as constants) and right before FuseAttention.
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from .fusion_utils import bound_call, rewrite_functions

logger = logging.getLogger(__name__)


def _dims(expr: relax.Expr) -> list | None:
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    return list(ty.shape.values)


def _equal(xs, ys) -> bool:
    analyzer = tvm.sym.Analyzer()
    return (
        xs is not None
        and ys is not None
        and len(xs) == len(ys)
        and all(analyzer.can_prove_equal(x, y) for x, y in zip(xs, ys))
    )


def _int(value) -> int | None:
    return int(value) if isinstance(value, tirx.IntImm) else None


def _nonnegative(bb, expr) -> bool:
    """`expr` holds positions >= 0: `arange(start >= 0, _, step > 0)` through expand_dims / broadcast_to."""
    while (call := bound_call(bb, expr, "relax.expand_dims", "relax.broadcast_to")) is not None:
        expr = call.args[0]
    arange = bound_call(bb, expr, "relax.arange")
    if arange is None:
        return False
    start, _, step = (_int(a) for a in arange.args)
    return start is not None and step is not None and start >= 0 and step > 0


def _unwrapped(bb, idx):
    """`idx` without the importer's negative-index wrap `where(idx < 0, idx + shape, idx)`."""
    where = bound_call(bb, idx, "relax.where")
    less = None if where is None else bound_call(bb, where.args[0], "relax.less")
    if less is None or not less.args[0].same_as(where.args[2]):
        return idx
    zero = less.args[1]
    if not (isinstance(zero, tvm.ir.expr.GenericConst) and zero.ty.ndim == 0 and int(zero.value.numpy()) == 0):
        return idx
    return where.args[2]


def _unbroadcast(bb, indices: list, shape: list) -> list:
    """The sources of `broadcast_to(i_k, shape)` when they broadcast to `shape` themselves, else `indices`."""
    calls = [bound_call(bb, i, "relax.broadcast_to") for i in indices]
    if any(c is None for c in calls):
        return indices
    sources = [c.args[0] for c in calls]
    dims = [_dims(s) for s in sources]
    if any(d is None or len(d) != len(shape) for d in dims):
        return indices
    analyzer = tvm.sym.Analyzer()
    for axis, extent in enumerate(shape):
        column = [d[axis] for d in dims]
        if not all(analyzer.can_prove_equal(x, 1) or analyzer.can_prove_equal(x, extent) for x in column):
            return indices
        if not any(analyzer.can_prove_equal(x, extent) for x in column) and not analyzer.can_prove_equal(extent, 1):
            return indices
    return sources


def _index_tensor(bb, call: relax.Call) -> relax.Expr | None:
    """`gather_nd(data, concat((i_k[..., None]), -1))` → `index_tensor(data, (i_k))` (module docstring)."""
    if int(call.attrs.batch_dims) != 0:
        return None
    data, idx = call.args
    idx = _unwrapped(bb, idx)
    concat = bound_call(bb, idx, "relax.concat")
    out, idx_dims = _dims(call), _dims(idx)
    if concat is None or out is None or idx_dims is None or data.ty.ndim != _int(idx_dims[-1]):
        return None
    if concat.attrs.axis is None or int(concat.attrs.axis) % len(idx_dims) != len(idx_dims) - 1:
        return None
    fields = concat.args[0]
    while isinstance(fields, relax.Var) and bb.lookup_binding(fields) is not None:
        fields = bb.lookup_binding(fields)
    if not isinstance(fields, relax.Tuple) or len(fields.fields) != data.ty.ndim:
        return None
    indices = []
    for field in fields.fields:
        expand = bound_call(bb, field, "relax.expand_dims")
        if expand is None or [int(a) % len(idx_dims) for a in expand.attrs.axis] != [len(idx_dims) - 1]:
            return None
        if not str(expand.args[0].ty.dtype).startswith("int") or not _nonnegative(bb, expand.args[0]):
            return None
        indices.append(expand.args[0])
    indices = _unbroadcast(bb, indices, idx_dims[:-1])
    rewritten = bb.normalize(relax.op.index_tensor(data, relax.Tuple(indices)))
    return rewritten if _equal(_dims(rewritten), out) and rewritten.ty.dtype == call.ty.dtype else None


def _key_transpose(bb, call: relax.Call) -> relax.Expr | None:
    """`reshape(permute_dims(reshape(k, (b·h, m, d)), [0, 2, 1]), (b, h, d, m))` → `permute_dims(k, [0, 1, 3, 2])`."""
    swap = bound_call(bb, call.args[0], "relax.permute_dims")
    if swap is None or swap.attrs.axes is None or [int(a) for a in swap.attrs.axes] != [0, 2, 1]:
        return None
    merge = bound_call(bb, swap.args[0], "relax.reshape")
    if merge is None:
        return None
    key = merge.args[0]
    dims, merged, out = _dims(key), _dims(merge), _dims(call)
    if dims is None or len(dims) != 4 or merged is None or out is None:
        return None
    b, h, m, d = dims
    if not (_equal(merged, [b * h, m, d]) and _equal(out, [b, h, d, m])):
        return None
    return relax.op.permute_dims(key, [0, 1, 3, 2])


def _split_key_transpose(bb, call: relax.Call) -> relax.Expr | None:
    """matmul(a, permute_dims(k, [0, 2, 3, 1])) with a 4-d k → the same with the transpose in two steps."""
    permute = bound_call(bb, call.args[1], "relax.permute_dims")
    if permute is None or permute.attrs.axes is None or [int(a) for a in permute.attrs.axes] != [0, 2, 3, 1]:
        return None
    if permute.args[0].ty.ndim != 4 or call.args[0].ty.ndim != 4:
        return None
    heads_first = bb.emit(relax.op.permute_dims(permute.args[0], [0, 2, 1, 3]))
    key_t = bb.emit(relax.op.permute_dims(heads_first, [0, 1, 3, 2]))
    return relax.Call(call.op, [call.args[0], key_t], call.attrs)


# operator → (rewrite, what the log calls it)
_REWRITES = {
    "relax.gather_nd": (_index_tensor, "mask gather(s)"),
    "relax.reshape": (_key_transpose, "reshaped key transpose(s)"),
    "relax.matmul": (_split_key_transpose, "one-step key transpose(s)"),
}


@mutator
class _OnnxAttentionCanonicalizer(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.rewritten: dict[str, int] = {}

    def visit_call_(self, call):
        call = self.visit_expr_post_order(call)
        name = call.op.name if isinstance(call.op, tvm.ir.Op) else None
        rewrite, label = _REWRITES.get(name, (None, None))
        new = None if rewrite is None else rewrite(self.builder_, call)
        if new is None:
            return call
        self.rewritten[label] = self.rewritten.get(label, 0) + 1
        return new


@tvm.transform.module_pass(opt_level=0, name="CanonicalizeOnnxAttention")
class CanonicalizeOnnxAttention:
    """Rewrite the ONNX exporter's mask gather and key transposes into the torch.export forms."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        canonicalizer = _OnnxAttentionCanonicalizer(mod)
        rewritten = rewrite_functions(mod, canonicalizer)
        if not canonicalizer.rewritten:
            return mod
        logger.info(
            "CanonicalizeOnnxAttention rewrote %s",
            ", ".join(f"{n} {what}" for what, n in sorted(canonicalizer.rewritten.items())),
        )
        return relax.transform.DeadCodeElimination()(rewritten)
