"""RewriteBatchedGemmToCublas: attention's batched GEMMs of the larger shape buckets call cuBLAS (CUDA only).

`R.matmul(a, b)` of two activations with the same batch dimensions (rank >= 3, fp16 or bf16 in
and out) becomes `R.call_dps_packed("relaxtune_cublas_batched_gemm", (a', b', a_axes, b_axes,
c_axes, alpha), out)`: `cublasGemmStridedBatchedEx` (relaxtune/cuda_cublas.py). Views are
absorbed instead of computed:

- an operand bound to `permute_dims(src, axes)` is passed as `src` with its `axes`, when the
  permutation keeps `src`'s contiguous (last) axis among the matrix axes: a transpose flag and a
  leading dimension then read it in place (attention's `q`, `kᵀ` and `v` from the (b, n, h, d)
  projections, so no transpose kernel runs);
- a result whose only reader is `permute_dims(y, axes)` is written in that layout (`c_axes`,
  the inverse permutation; attention's output goes straight to (b, n, h, d));
- a result whose only reader is `multiply(y, scalar constant)` folds the scalar into cuBLAS's
  alpha (attention's 1/sqrt(d): the scores are stored scaled, as before);
- scores read only by `softmax(add(scores, bias), axis=-1)` (the causal mask) get one kernel,
  `softmax_bias`, that adds the bias inside the softmax: in TIR the add was the score matmul's
  epilogue, and FuseOps never fuses an element-wise producer into the softmax reduction, so it
  would be a kernel of its own reading and writing the n x n scores once more. The add, max,
  exp and sum are fp32; the GPU rule RowSoftmax (schedules/rules/gpu_row_softmax.py) schedules
  it, one thread block per row, with the add inlined.

Grouped-query attention reaches this pass with k and v already repeated to every query head
(`R.repeat` in the model), so the batches match and the repeat stays a kernel of its own.
Operands whose batch dimensions differ (broadcasting) are left to TIR.

Only bucket functions whose lower bound of `dim` is at least `min_rows` are rewritten: the n x n
score matmuls of dlight's rules are the slow part of long sequences (about 1.9 of 3.4 ms of the
Llama-7B block at n = 2048 on an H200), while for short ones the three small kernels are cheap.

Run after BucketDispatch (reads `relaxtune.bucket`) and DecomposeAttention (whose matmuls it
rewrites), before LegalizeOps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import tvm
from tvm import relax, te
from tvm.relax.expr_functor import PyExprMutator, mutator

from .fusion_utils import bucket_functions, is_op, use_counts

logger = logging.getLogger(__name__)

FUNCTION = "relaxtune_cublas_batched_gemm"
DTYPES = ("float16", "bfloat16")


@dataclass
class _Call:
    """One matmul to rewrite: operands (before their permute_dims), the layouts, alpha, and the
    binding whose variable the call defines (the matmul's own, or the reader it absorbed)."""

    a: relax.Expr
    a_axes: list[int]
    b: relax.Expr
    b_axes: list[int]
    c_axes: list[int]
    alpha: float
    out: relax.Var


def _inverse(axes: list[int]) -> list[int]:
    inverse = [0] * len(axes)
    for i, a in enumerate(axes):
        inverse[a] = i
    return inverse


def _operand(var: relax.Expr, var2val) -> tuple[relax.Expr, list[int]]:
    """`var` as (storage, axes): through a permute_dims that keeps the contiguous axis a matrix axis."""
    rank = var.ty.ndim
    value = var2val.get(var) if isinstance(var, relax.Var) else None
    if is_op(value, "relax.permute_dims") and value.attrs.axes is not None:
        axes = [int(a) for a in value.attrs.axes]
        if rank - 1 in axes[-2:] and isinstance(value.args[0].ty, relax.TensorType):
            return value.args[0], axes
    return var, list(range(rank))


def _scalar(expr: relax.Expr) -> float | None:
    value = getattr(expr, "value", None) if isinstance(expr, tvm.ir.expr.Constant) else None
    if isinstance(value, tvm.runtime.Tensor) and value.numpy().ndim == 0:
        return float(value.numpy())
    return None


def _plan(func: relax.Function) -> tuple[dict, set, dict]:
    """{matmul var: _Call} for every matmul to rewrite, the reader bindings they absorb, and
    {softmax var: (scores var, bias)} for the biased softmaxes to emit as one kernel."""
    var2val = relax.analysis.get_var2val(func)
    uses = use_counts(func)
    readers = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            for var in relax.analysis.free_vars(binding.value):
                readers[var] = binding
    plan, absorbed, softmaxes = {}, set(), {}
    analyzer = tvm.sym.Analyzer()
    for var, value in var2val.items():
        if not is_op(value, "relax.matmul") or len(value.args) != 2:
            continue
        a, b = value.args
        types = (a.ty, b.ty, var.ty)
        if not all(isinstance(t, relax.TensorType) and t.shape is not None and t.ndim >= 3 for t in types):
            continue
        rank = a.ty.ndim
        out_dtype = str(value.attrs.out_dtype) if value.attrs.out_dtype else ""
        if (
            b.ty.ndim != rank
            or a.ty.dtype not in DTYPES
            or b.ty.dtype != a.ty.dtype
            or out_dtype not in ("", "void", a.ty.dtype)
        ):
            continue
        if not all(analyzer.can_prove_equal(x, y) for x, y in zip(a.ty.shape.values[:-2], b.ty.shape.values[:-2])):
            continue  # broadcasting batch dimensions: left to TIR
        call = _Call(*_operand(a, var2val), *_operand(b, var2val), list(range(rank)), 1.0, var)
        reader = readers.get(var) if uses[var] == 1 else None
        if reader is not None and isinstance(reader.var, relax.Var):
            read = reader.value
            if is_op(read, "relax.permute_dims") and read.attrs.axes is not None:
                c_axes = _inverse([int(x) for x in read.attrs.axes])
                if c_axes[-1] == rank - 1:  # cuBLAS writes rows with unit stride
                    call.c_axes, call.out = c_axes, reader.var
            elif is_op(read, "relax.multiply"):
                alpha = _scalar(read.args[1] if read.args[0].same_as(var) else read.args[0])
                if alpha is not None and read.ty.dtype == var.ty.dtype:
                    call.alpha, call.out = alpha, reader.var
        if call.out is not var:
            absorbed.add(call.out)
        plan[var] = call
        softmax = _biased_softmax(call.out, uses, readers)
        if softmax is not None:
            absorbed.add(softmax[0])  # the add
            softmaxes[softmax[1]] = (call.out, softmax[2])
    return plan, absorbed, softmaxes


def _biased_softmax(scores: relax.Var, uses, readers):
    """(add var, softmax var, bias) when `scores` is read only by softmax(add(scores, bias), -1)."""
    add = readers.get(scores) if uses[scores] == 1 else None
    if (
        add is None
        or not isinstance(add.var, relax.DataflowVar)
        or not is_op(add.value, "relax.add")
        or uses[add.var] != 1
    ):
        return None
    bias = add.value.args[1] if add.value.args[0].same_as(scores) else add.value.args[0]
    softmax = readers.get(add.var)
    if (
        softmax is None
        or not is_op(softmax.value, "relax.nn.softmax")
        or int(softmax.value.attrs.axis) not in (-1, scores.ty.ndim - 1)
    ):
        return None
    if (
        not isinstance(bias.ty, relax.TensorType)
        or bias.ty.dtype != scores.ty.dtype
        or add.var.ty.ndim != scores.ty.ndim
    ):
        return None
    return add.var, softmax.var, bias


def _softmax_bias(scores, bias):
    """softmax(scores + bias, -1) with the add, max, exp and sum in fp32, the result in scores' dtype
    (the row softmax GPU rule, schedules/rules/gpu_row_softmax.py, inlines the add and casts)."""
    offset = len(scores.shape) - len(bias.shape)

    def bias_at(i):  # numpy broadcasting: bias aligned right, its size-1 axes read at 0
        return bias(
            *(0 if isinstance(d, tvm.tirx.IntImm) and int(d) == 1 else i[offset + a] for a, d in enumerate(bias.shape))
        )

    x = te.compute(scores.shape, lambda *i: scores(*i).astype("float32") + bias_at(i).astype("float32"), name="T_add")
    *lead, m = x.shape
    k = te.reduce_axis((0, m), "k")
    maxelem = te.compute(lead, lambda *i: te.max(x(*i, k), axis=k), name="T_softmax_maxelem")
    k = te.reduce_axis((0, m), "k")
    expsum = te.compute(lead, lambda *i: te.sum(te.exp(x(*i, k) - maxelem(*i)), axis=k), name="T_softmax_expsum")
    return te.compute(
        x.shape,
        lambda *i: (te.exp(x(*i) - maxelem(*i[:-1])) / expsum(*i[:-1])).astype(scores.dtype),
        name="T_softmax_norm",
        attrs={"axis": len(lead)},
    )


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod):
        super().__init__(mod)
        self.plan, self.absorbed, self.softmaxes = {}, set(), {}

    def rewrite(self, func: relax.Function) -> relax.Function | None:
        """`func` with its planned rewrites (None: nothing to rewrite); kernels go to `builder_`."""
        self.plan, self.absorbed, self.softmaxes = _plan(func)
        if not self.plan:
            return None
        # the permute_dims whose views the calls absorbed are left unread: drop them
        return relax.analysis.remove_all_unused(self.visit_expr(func))

    def visit_var_binding_(self, binding):
        if binding.var in self.absorbed:
            return  # defined where its matmul was, or inside softmax_bias
        bb = self.builder_
        if binding.var in self.softmaxes:
            scores, bias = self.softmaxes[binding.var]
            value = bb.call_te(
                _softmax_bias, self.visit_expr(scores), self.visit_expr(bias), primfunc_name_hint="softmax_bias"
            )
            self.set_var_remap(binding.var, self._emit(value, binding.var))
            return
        call = self.plan.get(binding.var)
        if call is None:
            return super().visit_var_binding_(binding)
        args = [
            self.visit_expr(call.a),
            self.visit_expr(call.b),
            relax.ShapeExpr(call.a_axes),
            relax.ShapeExpr(call.b_axes),
            relax.ShapeExpr(call.c_axes),
            relax.prim_value(tvm.tirx.FloatImm("float64", call.alpha)),
        ]
        self.set_var_remap(call.out, self._emit(relax.call_dps_packed(FUNCTION, args, call.out.ty), call.out))

    def _emit(self, value: relax.Expr, like: relax.Var) -> relax.Var:
        """Bind `value` to a new variable of `like`'s kind (a dataflow block's output stays one)."""
        bb = self.builder_
        if bb.current_block_is_dataflow() and not isinstance(like, relax.DataflowVar):
            return bb.emit_output(value, like.name)
        return bb.emit(value, like.name)


@tvm.transform.module_pass(opt_level=0, name="RewriteBatchedGemmToCublas")
class RewriteBatchedGemmToCublas:
    """Batched activation GEMMs of bucket functions whose `dim` starts at >= `min_rows` call cuBLAS."""

    def __init__(self, dim: str = "n", min_rows: int = 64):
        self.dim, self.min_rows = dim, min_rows

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        rewriter = _Rewriter(mod)  # one builder: the softmax_bias kernels of all buckets get distinct names
        changed = False
        for gvar, func, bucket in bucket_functions(mod, self.dim):
            if int(bucket[self.dim][0]) < self.min_rows:
                continue
            new = rewriter.rewrite(func)
            if new is not None:
                rewriter.builder_.update_func(gvar, new)
                changed = True
                logger.info(
                    "%s: %d batched GEMM(s) -> cuBLAS, %d softmax(es) with the bias inside",
                    gvar.name_hint,
                    len(rewriter.plan),
                    len(rewriter.softmaxes),
                )
        return rewriter.builder_.get() if changed else mod
