"""Helpers shared by relaxtune's Relax passes (not a pass): running a mutator over every function,
the upper bounds of a (bucket) function's symbolic variables,
which expressions are weights, how often each variable is used, and how to re-emit a weight
expression at another place.

A *load-time* expression depends only on weights (parameters of `main` after its `num_input`
inputs, or constants), so `LiftTransformParams` moves it into `main_transform_params` (or
`FoldConstant` folds it): a concatenation or layout change of such an expression runs once, at
load, never per call. Passes that pack weights must check this and run before LiftTransformParams.
"""

from __future__ import annotations

from collections import Counter

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx
from tvm.relax.expr_functor import PyExprMutator, PyExprVisitor, mutator, visitor

from ..ir_attrs import BUCKET_ATTR, GPU_Q4_ATTR

# PrimFunc attribute listing the original operators of a kernel a relaxtune pass wrote whole
# (`relaxtune report fusion` reads it; FuseOps kernels are read from their fused functions)
FUSED_OPS_ATTR = "relaxtune.fused_ops"


def with_functions(mod: tvm.IRModule, updates: dict) -> tvm.IRModule:
    """`mod` with the functions of `updates` ({global var: function}) replaced; a copy, so that the pass's input
    stays as it was (`mod` itself when there is nothing to replace)."""
    if not updates:
        return mod
    mod = mod.clone()
    for gvar, func in updates.items():
        mod[gvar] = func
    return mod


def rewrite_functions(mod: tvm.IRModule, mutator) -> tvm.IRModule:
    """Run `mutator` (a PyExprMutator built on `mod`) over every Relax function of `mod`; returns the
    module its builder holds then (PrimFuncs it added included)."""
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gv, mutator.visit_expr(func))
    return mutator.builder_.get()


def weight_params(func: relax.Function) -> set:
    """The parameters of `func` that are weights (after `num_input`); empty without the attribute."""
    num_input = func.attrs.get("num_input") if func.attrs is not None else None
    if num_input is None:
        return set()
    return set(func.params[int(num_input) :])


def is_load_time(expr: relax.Expr, weights: set, var2val) -> bool:
    """True when `expr` is computed from weights and constants only (through any ops)."""
    if isinstance(expr, tvm.ir.expr.Constant):
        return True
    if isinstance(expr, relax.Var):
        if expr in weights:
            return True
        value = var2val.get(expr)
        return value is not None and is_load_time(value, weights, var2val)
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
        return all(is_load_time(arg, weights, var2val) for arg in expr.args)
    if isinstance(expr, relax.Tuple):
        return all(is_load_time(field, weights, var2val) for field in expr.fields)
    return False


def inline_load_time(expr: relax.Expr, weights: set, var2val) -> relax.Expr:
    """`expr` with every bound variable replaced by its value, down to weights and constants, so it
    can be emitted earlier in the block than the bindings it came from."""
    if isinstance(expr, relax.Var) and expr not in weights and expr in var2val:
        return inline_load_time(var2val[expr], weights, var2val)
    if isinstance(expr, relax.Call):
        args = [inline_load_time(arg, weights, var2val) for arg in expr.args]
        return relax.Call(expr.op, args, expr.attrs, expr.ty_args)
    if isinstance(expr, relax.Tuple):
        return relax.Tuple([inline_load_time(f, weights, var2val) for f in expr.fields])
    return expr


@visitor
class _UseCounter(PyExprVisitor):
    def __init__(self):
        super().__init__()
        self.uses: Counter = Counter()

    def visit_var_(self, var):
        self.uses[var] += 1

    def visit_dataflow_var_(self, var):
        self.uses[var] += 1


def use_counts(func: relax.Function) -> Counter:
    """How many times each variable is read in `func` (its definition does not count)."""
    counter = _UseCounter()
    counter.visit_expr(func)
    return counter.uses


# Element-wise / injective operators FuseOps fuses an injective producer (a slice) into; a slice
# read by anything else (attention, matmul, a reshape, the function's output) is a kernel of its own
SLICE_ABSORBING_OPS = frozenset(
    f"relax.{name}"
    for name in (
        "add",
        "subtract",
        "multiply",
        "divide",
        "negative",
        "permute_dims",
        "repeat",
        "split",
        "concat",
        "astype",
        "sigmoid",
        "tanh",
        "exp",
        "sqrt",
        "rsqrt",
        "power",
        "maximum",
        "minimum",
        "clip",
        "where",
        "nn.silu",
        "nn.gelu",
        "nn.gelu_tanh",
        "nn.relu",
        "strided_slice",
        "tile",
        "broadcast_to",
        "expand_dims",
    )
)


def consumers(func: relax.Function) -> dict:
    """var → the bound values that read it (None for the function's return)."""
    users: dict = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            for var in relax.analysis.free_vars(binding.value):
                users.setdefault(var, []).append(binding.value)
    for var in relax.analysis.free_vars(func.body.body):
        users.setdefault(var, []).append(None)
    return users


def absorbs_slice(var: relax.Var, users: dict) -> bool:
    """True when every reader of `var` is an operator a slice of it would fuse into."""
    readers = users.get(var, [])
    return bool(readers) and all(
        isinstance(r, relax.Call) and isinstance(r.op, tvm.ir.Op) and r.op.name in SLICE_ABSORBING_OPS for r in readers
    )


def bound_call(bb: relax.BlockBuilder, expr: relax.Expr, *ops: str) -> relax.Call | None:
    """The call `expr` is bound to (through variables, in the builder's bindings) when its
    operator is one of `ops`, else None."""
    while isinstance(expr, relax.Var) and bb.lookup_binding(expr) is not None:
        expr = bb.lookup_binding(expr)
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name in ops:
        return expr
    return None


def extern_call(value, names) -> tuple[str, list] | None:
    """(name, operands) of `R.call_dps_packed(name, (operands...), ...)` for a name among `names`, else None."""
    if not (isinstance(value, relax.Call) and value.op == tvm.ir.Op.get("relax.call_dps_packed")):
        return None
    func, args = value.args[0], value.args[1]
    if not (isinstance(func, relax.ExternFunc) and str(func.global_symbol) in names and isinstance(args, relax.Tuple)):
        return None
    return str(func.global_symbol), list(args.fields)


def is_op(expr: relax.Expr, name: str) -> bool:
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == name


def is_transpose(expr: relax.Expr) -> bool:
    """`R.permute_dims(w)` of a 2-D `w` that swaps its two axes (axes None or [1, 0])."""
    if (
        not is_op(expr, "relax.permute_dims")
        or not isinstance(expr.args[0].ty, relax.TensorType)
        or expr.args[0].ty.ndim != 2
    ):
        return False
    axes = expr.attrs.axes
    return axes is None or [int(a) for a in axes] == [1, 0]


def plain_matmul(expr: relax.Expr) -> bool:
    """`R.matmul(x, w)` with a 2-D weight and no out_dtype change (what a projection is)."""
    if not is_op(expr, "relax.matmul"):
        return False
    x, w = expr.args
    if not isinstance(x.ty, relax.TensorType) or not isinstance(w.ty, relax.TensorType) or w.ty.ndim != 2:
        return False
    out_dtype = expr.attrs.out_dtype
    return (
        (out_dtype is None or str(out_dtype) in ("", "void", str(x.ty.dtype)))
        and x.ty.dtype == w.ty.dtype
        and x.ty.ndim >= 1
    )


def upper_bounds(func: relax.Function) -> dict[str, int]:
    """The function's ``tir_var_upper_bound`` (a bucket function's bounds after BucketDispatch) by variable name."""
    limits = (func.attrs or {}).get("tir_var_upper_bound", None) or {}
    return {str(k): int(getattr(v, "value", v)) for k, v in limits.items()}


def upper_bound(dim, bounds: dict[str, int]) -> int | None:
    """The largest value of the shape dimension `dim`: a constant, or a variable named in `bounds`; else None."""
    if isinstance(dim, tirx.IntImm):
        return int(dim.value)
    if isinstance(dim, tirx.Var) and dim.name in bounds:
        return bounds[dim.name]
    return None


def bucket_functions(mod: tvm.IRModule, dim: str):
    """(global var, function, bucket) for every Relax function of `mod` that bucket dispatch made with `dim` in its
    bucket (``bucket[dim]`` is its (low, high) range)."""
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, relax.Function) and func.attrs is not None and BUCKET_ATTR in func.attrs:
            bucket = func.attrs[BUCKET_ATTR]
            if dim in bucket:
                yield gvar, func, bucket


TRANSFORM_SUFFIX = "_transform_params"  # LiftTransformParams' name for the function that computes `f`'s weights


def output_binding(func: relax.Function):
    """The binding of a transform function's returned tuple, or None when it returns another form."""
    result = func.body.body
    for block in func.body.blocks:
        for binding in block.bindings:
            if binding.var.same_as(result) and isinstance(binding.value, relax.Tuple):
                return binding
    return None


def lifted_functions(mod: tvm.IRModule):
    """(global var, function, its transform function's global var, num_input) for every Relax function whose
    weights LiftTransformParams moved into a transform function."""
    names = {gv.name_hint: gv for gv in mod.get_global_vars()}
    for gv, func in list(mod.functions_items()):
        transform = names.get(gv.name_hint + TRANSFORM_SUFFIX)
        if isinstance(func, relax.Function) and transform is not None and func.attrs is not None:
            if "num_input" in func.attrs:
                yield gv, func, transform, int(func.attrs["num_input"])


@mutator
class _OutputTuple(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, output: relax.Var, rewrite):
        super().__init__(mod)
        self.output, self.rewrite = output, rewrite

    def visit_var_binding_(self, binding):
        if not binding.var.same_as(self.output):
            return super().visit_var_binding_(binding)
        bb = self.builder_
        fields = self.rewrite(bb, [self.visit_expr(f) for f in binding.value.fields])
        new = bb.emit_output(relax.Tuple(fields)) if bb.current_block_is_dataflow() else bb.emit(relax.Tuple(fields))
        self.set_var_remap(binding.var, new)


def rewrite_output_tuple(mod: tvm.IRModule, gv: tvm.ir.GlobalVar, func: relax.Function, rewrite) -> tvm.IRModule:
    """`mod` with `func` (a transform function, put in at `gv`) returning `rewrite(bb, fields)` in place of the
    fields of its output tuple (`output_binding`): `rewrite` may emit with `bb` and must return the new fields."""
    mutator_ = _OutputTuple(mod, output_binding(func).var, rewrite)
    new = mutator_.visit_expr(func)
    mod = mutator_.builder_.get()
    mod[gv] = new
    return mod


def is_gpu_q4_kernel(kernel) -> bool:
    """Whether `kernel` is a PrimFunc with a block annotated ``GPU_Q4_ATTR`` (a projection over 4-bit weights in the
    GPU layout: kernels/quant_gpu_tir.linear)."""
    if not isinstance(kernel, tirx.PrimFunc):
        return False
    found = []
    tvm_ffi.structural_walk(kernel.body, (s_tir.SBlock, lambda b: found.append(GPU_Q4_ATTR in b.annotations)))
    return any(found)


def static_int(value) -> int | None:
    """A dimension's (or any PrimExpr's) value when it is a constant integer, else None."""
    return int(value) if isinstance(value, tirx.IntImm) else None


def has_call(func: relax.Function, matches) -> bool:
    """Whether any expression of `func` satisfies `matches` (a pass's cheap test before it rewrites the function)."""
    found = []
    relax.analysis.post_order_visit(func, lambda e: found.append(bool(matches(e))))
    return any(found)


GPU_Q4_SCALE_ROW_GROUPS = 8  # the streamed 4-bit kernels copy 16-byte rows of fp16 scales: groups per row a multiple


def streamed_q4_weight(packed, scale, max_k: int) -> tuple[int, int] | None:
    """(N, K) of a 4-bit weight in the GPU layout ((N, K / 8) words, (N, K / group) scales) whose scale rows the
    streamed kernels copy whole, K <= max_k; else None."""
    shapes = [static_shape(packed), static_shape(scale)]
    if any(s is None or len(s) != 2 for s in shapes) or shapes[0][0] != shapes[1][0]:
        return None
    (n, words), (_, groups) = shapes
    k = 8 * words
    return (n, k) if groups % GPU_Q4_SCALE_ROW_GROUPS == 0 and k <= max_k else None


def static_shape(expr) -> list[int] | None:
    """The static shape of a tensor-typed `expr` (every dimension a constant), else None."""
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    dims = [static_int(d) for d in ty.shape.values]
    return None if None in dims else dims


def static_ints(expr) -> list[int] | None:
    """The values of a tuple of static integers (a strided_slice's axes, begin, end, strides), else None."""
    if not isinstance(expr, relax.Tuple):
        return None
    values = [getattr(f, "value", f) for f in expr.fields]
    return [int(v) for v in values] if all(isinstance(v, (int, tirx.IntImm)) for v in values) else None
