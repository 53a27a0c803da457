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

Imported models (``torch.export`` of ``transformers``) write the tables as Relax operators:
``cos(concat((f, f), -1)) * s`` with ``f = float(positions) * inv_freq``, positions
``arange(0, n)``, viewed as ``(1, 1, n, d)``. The same is done for these (``_RowLocal``): an
expression computed only from constants and ``arange(0, n, 1)`` (``n`` bounded), through
element-wise operators, broadcasting binary ones, ``expand_dims``, ``permute_dims``, ``concat`` and
``matmul`` (over a static axis), every value with ``n`` on exactly one axis and every other axis
static, has row ``i`` (along ``n``) independent of ``n``. Each float such expression read by
something else, with a transcendental operator (cos, sin, exp, ...) in it, is computed at the bound
(a copy of its operators with ``arange(0, U)``) and sliced to ``n`` along that axis. Positions read
from an input (``position_ids``) or tables using a weight (the ONNX export keeps ``inv_freq`` as an
initializer) are not lifted: they are not constant. Integer positions alone are not either (the
causal mask's, which FuseAttention reads as ``arange``).
Run before FuseAttentionPrologue and before LegalizeOps / FoldConstant.
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from .fusion_utils import is_op, rewrite_functions, upper_bounds

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
        if (
            not isinstance(first, tirx.Var)
            or rows not in (None, first)
            or not all(isinstance(x, tirx.IntImm) for x in rest)
        ):
            return None
        rows = first
    return rows


def _elements(ty: relax.TensorType) -> int:
    count = 1
    for x in ty.shape.values:
        count *= int(x)
    return count


# operators under which an expression of positions stays row-local (module docstring)
_UNARY = {f"relax.{op}" for op in ("astype", "cos", "sin", "negative", "exp", "sqrt", "rsqrt", "tanh", "sigmoid")}
_BINARY = {f"relax.{op}" for op in ("add", "subtract", "multiply", "divide", "power", "maximum", "minimum")}
_LAYOUT = {"relax.expand_dims", "relax.permute_dims", "relax.concat"}
_FREE = "constant"  # a row-local analysis value: computed from constants only, no n
# operators that make a table worth computing once (positions alone, or scaled by constants, cost
# nothing to recompute: lifting them would only turn a cheap kernel into a constant)
_TRANSCENDENTAL = {f"relax.{op}" for op in ("cos", "sin", "exp", "sqrt", "rsqrt", "tanh", "sigmoid", "power", "divide")}


class _RowLocal:
    """The bindings of one function that are row-local in a bounded symbolic var (module docstring):
    `axis[var]` is (n, the axis of n in var's shape), or `_FREE` for constant expressions."""

    def __init__(self, func: relax.Function, bounds: dict):
        self.bounds, self.axis, self.values, self.costly = bounds, {}, {}, set()
        for block in func.body.blocks:
            for binding in block.bindings:
                if isinstance(binding, relax.VarBinding):
                    found = self._analyse(binding.value)
                    if found is not None:
                        self.axis[binding.var], self.values[binding.var] = found, binding.value
                        if binding.value.op.name in _TRANSCENDENTAL or any(
                            v in self.costly for v in relax.analysis.free_vars(binding.value)
                        ):
                            self.costly.add(binding.var)
        self.roots = self._roots(func)

    def _arg(self, expr):
        """`_FREE`, (n, axis), a list of those (a tuple's fields), or None (not row-local)."""
        if isinstance(expr, tvm.ir.expr.Constant):
            return _FREE
        if isinstance(expr, relax.Tuple):
            fields = [self._arg(f) for f in expr.fields]
            return None if any(f is None or isinstance(f, list) for f in fields) else fields
        return self.axis.get(expr) if isinstance(expr, relax.Var) else None

    @staticmethod
    def _n_axis(ty, n) -> int | None:
        """The axis of `ty`'s shape holding n, when it is its only symbolic one (else None)."""
        if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
            return None
        axes = [i for i, x in enumerate(ty.shape.values) if not isinstance(x, tirx.IntImm)]
        return axes[0] if len(axes) == 1 and ty.shape.values[axes[0]].same_as(n) else None

    def _analyse(self, value):
        """`_FREE`, (n, axis) or None for a bound value (module docstring)."""
        if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
            return None
        name = value.op.name
        if name == "relax.arange":
            start, end, step = value.args  # prim values are PrimExprs
            if not (
                isinstance(start, tirx.IntImm) and int(start) == 0 and isinstance(step, tirx.IntImm) and int(step) == 1
            ):
                return None
            return (end, 0) if isinstance(end, tirx.Var) and end.name in self.bounds else None
        if name not in _UNARY | _BINARY | _LAYOUT and name != "relax.matmul":
            return None
        args = []
        for arg in (self._arg(a) for a in value.args):
            if arg is None:
                return None
            args += arg if isinstance(arg, list) else [arg]
        local = [a for a in args if a != _FREE]
        if not local:
            return _FREE
        n = local[0][0]
        if any(not other.same_as(n) for other, _ in local):  # positions along two different vars
            return None
        if name == "relax.matmul":  # the contracted axis static: output position i reads input position i
            contracted = [value.args[0].ty.shape.values[-1], value.args[1].ty.shape.values[-2]]
            if any(not isinstance(x, tirx.IntImm) for x in contracted):
                return None
        axis = self._n_axis(value.ty, n)
        if axis is None or (name == "relax.concat" and int(value.attrs.axis) % value.ty.ndim == axis):
            return None
        return n, axis

    def _roots(self, func) -> dict:
        """Float row-local vars (with n) read by something that is not row-local, with a transcendental
        operator in their computation: var → (n, axis)."""
        outside = set(relax.analysis.free_vars(func.body.body))
        for block in func.body.blocks:
            for binding in block.bindings:
                if binding.var not in self.axis:
                    outside.update(relax.analysis.free_vars(binding.value))
        return {
            var: found
            for var, found in self.axis.items()
            if var in outside
            and found != _FREE
            and var in self.costly
            and str(var.ty.dtype).startswith(("float", "bfloat"))
        }


@mutator
class _Lifter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.bounds: dict = {}  # name of a symbolic var -> its upper bound, per function
        self.lifted = 0
        self.expressions = 0  # of them, Relax expressions (imported models), not call_tir

    def visit_function_(self, func):
        self.bounds = upper_bounds(func)
        self.rows = _RowLocal(func, self.bounds)
        self.root_values = {self.rows.values[var]: (var, found) for var, found in self.rows.roots.items()}
        self.at_bound = {}  # row-local var -> its value computed at the bound (emitted once)
        return super().visit_function_(func)

    def _full(self, expr) -> relax.Expr:
        """`expr` (row-local or constant) with n replaced by its bound (module docstring)."""
        if isinstance(expr, relax.Tuple):
            return relax.Tuple([self._full(f) for f in expr.fields])
        if not isinstance(expr, relax.Var) or self.rows.axis.get(expr) == _FREE:
            return self.visit_expr(expr)
        if expr not in self.at_bound:
            value = self.rows.values[expr]
            if is_op(value, "relax.arange"):
                bound = relax.prim_value(tirx.const(self.bounds[value.args[1].name], "int64"))
                args = [value.args[0], bound, *value.args[2:]]
            else:
                args = [self._full(a) for a in value.args]
            self.at_bound[expr] = self.builder_.emit(relax.Call(value.op, args, value.attrs, value.ty_args))
        return self.at_bound[expr]

    def _lift_expression(self, call) -> relax.Expr | None:
        """The slice of `call`'s value computed at the bound, when `call` is a root of `_RowLocal`."""
        root = self.root_values.get(call)
        if root is None:
            return None
        var, (n, axis) = root
        shape = [
            tirx.const(self.bounds[n.name], "int64") if i == axis else x for i, x in enumerate(var.ty.shape.values)
        ]
        if _elements(relax.TensorType(shape, var.ty.dtype)) > MAX_ELEMENTS:
            return None
        self.lifted += 1
        self.expressions += 1
        return relax.op.strided_slice(self._full(var), [axis], [0], [n], assume_inbound=True)

    def visit_call_(self, call):
        lifted = self._lift_expression(call)
        if lifted is not None:
            return lifted
        call = self.visit_expr_post_order(call)
        if (
            not is_op(call, "relax.call_tir")
            or len(call.args) != 2
            or not isinstance(call.args[1], relax.Tuple)
            or call.args[1].fields
        ):
            return call
        rows = _table_var(call)
        kernel = self.builder_.get()[call.args[0]]
        if rows is None or rows.name not in self.bounds or not isinstance(kernel, tirx.PrimFunc):
            return call
        own = {p.shape[0] for p in kernel.params if p.shape is not None and len(p.shape) >= 1}
        if len(own) != 1 or len(kernel.params) != len(
            call.ty.fields if isinstance(call.ty, relax.TupleType) else [call.ty]
        ):
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
        logger.info("LiftPositionTables: %d table(s) now computed up to the bound", lifter.lifted)
        return relax.transform.DeadCodeElimination()(rewritten) if lifter.expressions else rewritten
