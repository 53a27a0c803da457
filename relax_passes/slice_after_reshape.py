"""SliceAfterReshape: a reshape of the first ``n`` rows of a static table becomes the first ``n`` rows
of the reshaped table, so that the slice fuses into the table's consumer (issue 8, CUDA path).

LiftPositionTables computes the rotary cos/sin tables once, at the bound ``U`` (a constant after
FoldConstant), and slices them to ``n`` per call: ``reshape(strided_slice(T, [0], [0], [n]), (1, n,
1, d))``. The reshape of a symbolic-shape tensor legalizes to a kernel that AnnotateTIROpPattern
marks opaque (its index is taken ``% n``), so FuseOps cannot fuse the slice through it into k's
rotation kernel: the slice stays a kernel of its own (one per table), and RewriteDataflowReshape
later makes the reshape a view.

Rewritten here as ``strided_slice(reshape(T, (1, U, 1, d)), [1], [0], [n])``: the reshape of the
static table folds to a constant (FoldConstant), and the slice, an injective ``T[0, s, 0, j]``
read, fuses into its consumer, which then reads the whole table in place.

With LiftPositionTables and this pass the per-call table kernel is gone and no slice kernel takes
its place; k's rotation reads the (1, U, 1, d) tables in place (the H200's figures: docs/results.md).

Fires when the reshape only inserts unit dimensions into the slice's shape, the slice is on one
axis from 0 with stride 1, and the table's shape is static. Matches operators, never names; a
slice reached through a tuple (``(slice_a, slice_b)[i]``, as LiftPositionTables writes for a
call with two outputs) counts. Run after RewriteAttentionToFlash (whose q rotation reads the
whole table through the ``reshape(strided_slice(...))`` form, attention_operand_trace.Tracer.rows)
and before LegalizeOps / FoldConstant.
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from .fusion_utils import is_op, static_ints

logger = logging.getLogger(__name__)


def _static(ty) -> bool:
    return (
        isinstance(ty, relax.TensorType)
        and isinstance(ty.shape, relax.ShapeExpr)
        and all(isinstance(x, tirx.IntImm) for x in ty.shape.values)
    )


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.count = 0

    def _binding(self, expr):
        return self.builder_.lookup_binding(expr) if isinstance(expr, relax.Var) else None

    def _slice(self, expr):
        """The strided_slice `expr` is bound to, directly or as a field of a tuple, else None."""
        value = self._binding(expr)
        if isinstance(value, relax.TupleGetItem):
            fields = self._binding(value.tuple_value) if isinstance(value.tuple_value, relax.Var) else value.tuple_value
            value = self._binding(fields.fields[int(value.index)]) if isinstance(fields, relax.Tuple) else None
        return value if is_op(value, "relax.strided_slice") else None

    def visit_call_(self, call):
        call = self.visit_expr_post_order(call)
        if (
            not is_op(call, "relax.reshape")
            or not isinstance(call.ty, relax.TensorType)
            or not isinstance(call.ty.shape, relax.ShapeExpr)
        ):
            return call
        sliced = self._slice(call.args[0])
        if sliced is None:
            return call
        table = sliced.args[0]
        axes, begin = static_ints(sliced.args[1]), static_ints(sliced.args[2])
        strides = static_ints(sliced.args[4]) if len(sliced.args) > 4 else []
        if (
            axes is None
            or len(axes) != 1
            or begin != [0]
            or strides is None
            or any(s != 1 for s in strides)
            or not _static(table.ty)
        ):
            return call
        src = (
            list(sliced.ty.shape.values)
            if isinstance(sliced.ty, relax.TensorType) and isinstance(sliced.ty.shape, relax.ShapeExpr)
            else None
        )
        if src is None:
            return call
        axis = axes[0] % len(src)
        dst = list(call.ty.shape.values)
        # the reshape only inserts unit dims: dst without them (in order) is src; where src's axis lands in dst
        kept = [i for i, x in enumerate(dst) if not (isinstance(x, tirx.IntImm) and int(x) == 1)]
        src_kept = [i for i, x in enumerate(src) if not (isinstance(x, tirx.IntImm) and int(x) == 1)]
        analyzer = tvm.sym.Analyzer()
        if (
            len(kept) != len(src_kept)
            or axis not in src_kept
            or not all(analyzer.can_prove_equal(dst[a], src[b]) for a, b in zip(kept, src_kept))
        ):
            return call
        if any(isinstance(src[i], tirx.IntImm) and int(src[i]) == 1 for i in range(len(src))):
            return call  # unit dims in the slice: the mapping of axes would be ambiguous
        position = kept[src_kept.index(axis)]
        full = [table.ty.shape.values[axis] if i == position else x for i, x in enumerate(dst)]
        whole = self.builder_.emit(relax.op.reshape(table, full))
        self.count += 1
        return relax.op.strided_slice(whole, [position], [0], [dst[position]], assume_inbound=True)


@tvm.transform.module_pass(opt_level=0, name="SliceAfterReshape")
class SliceAfterReshape:
    """reshape(first n rows of a static table) -> first n rows of the reshaped table (module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        rewriter = _Rewriter(mod)
        changed = False
        for gvar, func in mod.functions_items():
            if not isinstance(func, relax.Function):
                continue
            before = rewriter.count
            new = rewriter.visit_expr(func)
            if rewriter.count > before:
                rewriter.builder_.update_func(gvar, relax.analysis.remove_all_unused(new))
                changed = True
                logger.info("%s: %d table slice(s) moved after their reshape", gvar.name_hint, rewriter.count - before)
        return rewriter.builder_.get() if changed else mod
