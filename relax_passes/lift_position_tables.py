"""LiftPositionTables: a table computed from positions alone (the rotary cos/sin tables) is computed
once, up to the sequence bound, and sliced to ``n`` per call.

A ``call_tir`` with no inputs whose outputs are all ``(n, ...)`` for a symbolic ``n`` with a
``tir_var_upper_bound`` ``U`` is called for ``(U, ...)`` instead, and each output sliced to its first
``n`` rows (``strided_slice`` on axis 0 from 0). Depending on nothing and static now, the
``(U, ...)`` call is folded by FoldConstant (after LegalizeOps): computed once, at compile time,
never per call (LiftTransformParams leaves a call with no inputs in ``main``). FuseAttentionPrologue
(right after this pass) reads the first rows straight from the full tables, so the slice is no
kernel either. Tables over ``MAX_ELEMENTS`` elements are left as they are.

Fires only when row ``i`` of every output provably does not depend on ``n``: the PrimFunc's every
block stores one element, with no predicate, and ``n`` appears in no stored value and no index
(only in loop extents and buffer shapes). Matches operators and PrimFunc structure, never names.
Run before FuseAttentionPrologue and before LegalizeOps / FoldConstant.
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from .fusion_utils import is_op, rewrite_functions

logger = logging.getLogger(__name__)

MAX_ELEMENTS = 1 << 24  # per table at the bound (64 MiB of float32): larger ones stay computed per call


def _mentions(expr, var: tirx.Var) -> bool:
    return any(v.same_as(var) for v in tirx.analysis.undefined_vars(expr, []))


def rows_independent_of(func: tirx.PrimFunc, var: tirx.Var) -> bool:
    """`func` is loops over blocks that each store one element with no predicate, and `var` is in
    no stored value or index (anything else: False)."""
    from tvm import s_tir

    def check(stmt, in_block: bool) -> bool:
        if isinstance(stmt, tirx.stmt.SeqStmt):
            return all(check(s, in_block) for s in stmt.seq)
        if isinstance(stmt, tirx.stmt.For):
            return check(stmt.body, in_block)
        if isinstance(stmt, s_tir.SBlockRealize):
            plain = isinstance(stmt.predicate, tirx.IntImm) and int(stmt.predicate) == 1
            return plain and stmt.block.init is None and check(stmt.block.body, True)
        if isinstance(stmt, tirx.stmt.BufferStore):
            return in_block and not (_mentions(stmt.value, var) or any(_mentions(i, var) for i in stmt.indices))
        return False

    body = func.body
    if isinstance(body, s_tir.SBlockRealize) and not body.block.iter_vars:  # the root block
        body = body.block.body
    return check(body, False)


def _table_var(call: relax.Call) -> tirx.Var | None:
    """The symbolic row count shared by every output of `call`, when the rest of each shape is static."""
    fields = call.ty.fields if isinstance(call.ty, relax.TupleType) else [call.ty]
    rows = None
    for ty in fields:
        if not isinstance(ty, relax.TensorType) or ty.shape is None or ty.ndim < 1:
            return None
        first, *rest = ty.shape.values
        if not isinstance(first, tirx.Var) or rows not in (None, first) or not all(isinstance(x, tirx.IntImm) for x in rest):
            return None
        rows = first
    return rows


def _elements(ty: relax.TensorType) -> int:
    count = 1
    for x in ty.shape.values:
        count *= int(x)
    return count


@mutator
class _Lifter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.bounds: dict = {}  # name of a symbolic var -> its upper bound, per function
        self.lifted = 0

    def visit_function_(self, func):
        bounds = (func.attrs or {}).get("tir_var_upper_bound", None) if func.attrs is not None else None
        self.bounds = {str(k): int(v) for k, v in bounds.items()} if bounds else {}
        return super().visit_function_(func)

    def visit_call_(self, call):
        call = self.visit_expr_post_order(call)
        if not is_op(call, "relax.call_tir") or len(call.args) != 2 or not isinstance(call.args[1], relax.Tuple) or call.args[1].fields:
            return call
        rows = _table_var(call)
        kernel = self.builder_.get()[call.args[0]]
        if rows is None or rows.name not in self.bounds or not isinstance(kernel, tirx.PrimFunc):
            return call
        own = {p.shape[0] for p in kernel.params if p.shape is not None and len(p.shape) >= 1}
        if len(own) != 1 or len(kernel.params) != len(call.ty.fields if isinstance(call.ty, relax.TupleType) else [call.ty]):
            return call
        if not isinstance(next(iter(own)), tirx.Var) or not rows_independent_of(kernel, next(iter(own))):
            return call
        bound = tirx.const(self.bounds[rows.name], "int64")
        multi = isinstance(call.ty, relax.TupleType)
        fields = call.ty.fields if multi else [call.ty]
        full_ty = [relax.TensorType([bound, *ty.shape.values[1:]], ty.dtype) for ty in fields]
        if any(_elements(ty) > MAX_ELEMENTS for ty in full_ty):
            return call
        full = self.builder_.emit(relax.call_tir(call.args[0], [], full_ty if multi else full_ty[0]))
        parts = [self.builder_.emit(relax.TupleGetItem(full, i)) for i in range(len(fields))] if multi else [full]
        sliced = [relax.op.strided_slice(p, [0], [0], [rows], assume_inbound=True) for p in parts]
        self.lifted += 1
        return relax.Tuple([self.builder_.emit(s) for s in sliced]) if multi else sliced[0]


@tvm.transform.module_pass(opt_level=0, name="LiftPositionTables")
class LiftPositionTables:
    """Position-only tables computed once up to the bound, sliced per call (module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        lifter = _Lifter(mod)
        rewritten = rewrite_functions(mod, lifter)
        if not lifter.lifted:
            return mod
        logger.info("LiftPositionTables: %d table call(s) now computed up to the bound", lifter.lifted)
        return rewritten
