"""KeepWeightsNK: the weights only weight GEMMs read stay as (N, K), PyTorch Linear's layout, instead
of the (K, N) transposes LiftTransformParams computes at load (CUDA with cuBLAS only).

After LiftTransformParams a function `f` takes each lifted weight as a parameter that
`f_transform_params` computes; nn.Linear's `x @ permute_dims(w)` left a (K, N) transpose there.
For each such parameter `p` (2-D, static, fp16 or bf16) that `f` reads only as the weight of
`R.matmul(x, p)` (x of p's dtype, no out_dtype change), the transform returns p^T instead: the
weight itself when p was `permute_dims(w)`, the weights concatenated along axis 0 when p was
their transposes concatenated along axis 1 (MergeProjections), else a transpose (at load). In `f`
each `R.matmul(x, p)` becomes `R.matmul(x, permute_dims(p'))` on the (N, K) parameter p'. The
library rewrites read that form (cublas_gemm.weight_gemm): relaxtune_gemv_nk (gemv_cuda.py) and
relaxtune_cublas_gemm_nk / _add_nk (cublas_gemm.py, cublas_gemm_add.py; cuBLAS's transpose flag
costs nothing); a product they leave becomes one NT matmul kernel (FuseTransposeMatmul), never a
transpose per call. Matched by operators and types, never by names.

Why: with a weight's rows contiguous, a decode GEMV's warp reads whole rows and reduces by warp
shuffles; on the H200 the decode step gained more than cuBLAS's transposed-operand GEMMs cost at
small M (docs/results.md "GPU decode GEMVs").

Run after LiftTransformParams and before BucketDispatch; the pipeline adds it for cuda targets
with the library GEMMs on (config.CudaLibraries.weights_nk, default True), and FuseTransposeMatmul
after the library rewrites; for llvm targets, float32 weights only, for a workload that asks for it
(Workload.weights_nk: a language model, whose decode GEMVs then read weight rows contiguously).
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .cublas_gemm import DTYPES  # what the library calls reading (N, K) weights take
from .fusion_utils import consumers, is_op, is_transpose, lifted_functions, output_binding, plain_matmul, with_functions

logger = logging.getLogger(__name__)


def _static_2d(var: relax.Var) -> bool:
    t = var.ty
    return (
        isinstance(t, relax.TensorType)
        and t.ndim == 2
        and t.shape is not None
        and all(isinstance(d, tvm.tirx.IntImm) for d in t.shape.values)
    )


def gemm_only_weights(func: relax.Function, dtypes: tuple[str, ...] = DTYPES) -> list[int]:
    """Positions (among `func`'s parameters) of the weights of `dtypes` `func` reads only as `R.matmul(x, w)`'s w."""
    num_input = int(func.attrs["num_input"])
    users = consumers(func)
    picked = []
    for i, p in enumerate(func.params[num_input:], num_input):
        readers = users.get(p, [])
        if not readers or not _static_2d(p) or p.ty.dtype not in dtypes:
            continue
        if all(plain_matmul(r) and r.args[1].same_as(p) and not r.args[0].same_as(p) for r in readers):
            picked.append(i)
    return picked


@mutator
class _Outputs(PyExprMutator):
    """The transform function with its outputs at `picked` transposed (see the module docstring)."""

    def __init__(self, mod, output: relax.Var, picked: set[int], var2val: dict):
        super().__init__(mod)
        self.output, self.picked, self.var2val = output, picked, var2val

    def transposed(self, expr: relax.Expr) -> relax.Expr:
        value = self.var2val.get(expr) if isinstance(expr, relax.Var) else None
        if is_transpose(value):
            return self.visit_expr(value.args[0])
        if is_op(value, "relax.concat") and isinstance(value.args[0], relax.Tuple) and int(value.attrs.axis) in (1, -1):
            parts = value.args[0].fields
            if all(isinstance(part.ty, relax.TensorType) and part.ty.ndim == 2 for part in parts):
                return self.builder_.emit(relax.op.concat([self.transposed(part) for part in parts], axis=0))
        return self.builder_.emit(relax.op.permute_dims(self.visit_expr(expr)))

    def visit_var_binding_(self, binding):
        if not binding.var.same_as(self.output):
            return super().visit_var_binding_(binding)
        fields = [
            self.transposed(f) if i in self.picked else self.visit_expr(f) for i, f in enumerate(binding.value.fields)
        ]
        bb = self.builder_
        new = bb.emit_output(relax.Tuple(fields)) if bb.current_block_is_dataflow() else bb.emit(relax.Tuple(fields))
        self.set_var_remap(binding.var, new)


@mutator
class _Readers(PyExprMutator):
    """`f` with each `R.matmul(x, p)` of a swapped parameter p reading permute_dims(p')."""

    def __init__(self, mod, swapped: dict):
        super().__init__(mod)
        self.swapped = swapped

    def visit_call_(self, call):
        if is_op(call, "relax.matmul") and call.args[1] in self.swapped:
            weight = self.builder_.emit(relax.op.permute_dims(self.swapped[call.args[1]]))
            return relax.Call(call.op, [self.visit_expr(call.args[0]), weight], call.attrs)
        return super().visit_call_(call)


@tvm.transform.module_pass(opt_level=0, name="KeepWeightsNK")
class KeepWeightsNK:
    """Weights read only by weight GEMMs are computed at load as (N, K) and read transposed (see above).
    `dtypes`: the weight dtypes it keeps (default: those the cuBLAS calls take)."""

    def __init__(self, dtypes: tuple[str, ...] = DTYPES):
        self.dtypes = tuple(dtypes)

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gv, func, transform, num_input in lifted_functions(mod):
            tfunc = mod[transform]
            binding = output_binding(tfunc)
            if binding is None or len(binding.value.fields) != len(func.params) - num_input:
                continue
            picked = gemm_only_weights(func, self.dtypes)
            if not picked:
                continue
            swapped = {}
            for i in picked:
                p = func.params[i]
                k, n = p.ty.shape.values
                swapped[p] = relax.Var(p.name, relax.TensorType([n, k], p.ty.dtype))
            params = [swapped.get(p, p) for p in func.params]
            updates[gv] = _Readers(mod, swapped).visit_expr(
                relax.Function(params, func.body, func.ret_ty, func.is_pure, func.attrs, func.span)
            )
            outputs = _Outputs(mod, binding.var, {i - num_input for i in picked}, relax.analysis.get_var2val(tfunc))
            updates[transform] = relax.analysis.remove_all_unused(outputs.visit_expr(tfunc))
            shown = [func.params[i].name for i in picked[:4]] + (["..."] if len(picked) > 4 else [])
            logger.info("%s: %d weight(s) kept as (N, K): %s", gv.name_hint, len(picked), ", ".join(shown))
        return with_functions(mod, updates)
