"""RewriteQuantGemvToCuda: each bucket's projections over 4-bit weights in the GPU layout call their CUDA kernels.

A projection here is `R.call_tir(k, (x, packed, scale))` of a kernel whose dequantization block is annotated
``ir_attrs.GPU_Q4_ATTR`` (`kernels/quant_gpu_tir.linear`, PackQuantWeightsCuda's rewrite): packed (N, K / 8)
uint32 and scale (N, K / group) float16 parameters of the bucket function, x (..., K) float16, the output float16.

- In bucket functions whose rows dimension ends at <= `max_rows` (decode): `R.call_dps_packed("relaxtune_q4gemv",
  (x, packed, scale), out)`, relaxtune's 4-bit GEMV (kernels/qgemv.cu: the weights dequantized in registers, read
  once); a product used by nothing but an add of a same-typed tensor r (the residual) becomes
  `"relaxtune_q4gemv_add"(x, packed, scale, r)`: the add in the kernel's epilogue (the matcher is
  RewriteResidualAddToCublas's). With `int8`, `relaxtune_q4gemv_i8` / `_i8_add`: x rounded to int8 per 16 values
  inside the kernel and multiplied by dp4a where the streamed kernel runs (compute capability 9.0+). The weight
  parts are parameters, so no kernel launched just before writes them (the kernel starts loading them before the
  previous kernel ends).
- In the other buckets: `w = R.call_tir(dequantize, (packed, scale))`, W (N, K) float16
  (`quant_gpu_tir.dequantize_kernel`, scheduled), then `R.call_dps_packed("relaxtune_cublas_gemm_nk", (x, w),
  out)`: cuBLAS on the dequantized weight, as for a float16 weight kept (N, K) (RewriteResidualAddToCublas then
  folds a residual add into it in its buckets). Prefill reads the weight twice and writes it once in float16: the
  decode step is what the 4-bit layout is for.

Run after BucketDispatch (reads `relaxtune.bucket`) and before RewriteResidualAddToCublas; the pipeline adds it with
PackQuantWeightsCuda (pack_quant_weights_cuda.py) for cuda sm_80+ with the cuda libraries on.
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..config import CudaLibraries
from ..kernels import quant_gpu_tir
from ..kernels.gemv import Q4_ADD_FUNCTION, Q4_FUNCTION, Q4_I8_ADD_FUNCTION, Q4_I8_FUNCTION
from .cublas_gemm import NK_FUNCTION as CUBLAS_NK_FUNCTION
from .cublas_gemm_add import _Matches
from .cublas_gemm_add import _Rewriter as _AddRewriter
from .fusion_utils import bucket_functions, is_gpu_q4_kernel, with_functions

logger = logging.getLogger(__name__)

MAX_ROWS = CudaLibraries.gemv_max_rows  # the decode buckets: where relaxtune's GEMV kernels run


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod, params: set, decode: bool, function: str):
        super().__init__(mod)
        self.mod, self.params, self.decode, self.function, self.count = mod, params, decode, function, 0
        self.kernels: dict = {}  # (rows, words, groups) -> the dequantize kernel's GlobalVar

    def dequantize(self, packed: relax.Var, scale: relax.Var) -> relax.Expr:
        (rows, words), (_r, groups) = (tuple(int(d) for d in v.ty.shape.values) for v in (packed, scale))
        key = (rows, words, groups)
        if key not in self.kernels:
            kernel = quant_gpu_tir.dequantize_kernel(*key)
            self.kernels[key] = self.builder_.add_func(kernel, f"dequantize_q4_gpu_{rows}x{words * 8}")
        out = relax.TensorType([rows, words * 8], "float16")
        return self.builder_.emit(relax.call_tir(self.kernels[key], [packed, scale], out))

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not (call.op == tvm.ir.Op.get("relax.call_tir") and len(call.args) == 2):
            return call
        gv, args = call.args
        if gv not in self.mod.get_global_vars() or not is_gpu_q4_kernel(self.mod[gv]) or len(args.fields) != 3:
            return call
        x, packed, scale = args.fields
        if packed not in self.params or scale not in self.params or x.ty.dtype != "float16":
            return call
        self.count += 1
        if self.decode:
            return relax.call_dps_packed(self.function, [x, packed, scale], call.ty)
        return relax.call_dps_packed(CUBLAS_NK_FUNCTION, [x, self.dequantize(packed, scale)], call.ty)


@tvm.transform.module_pass(opt_level=0, name="RewriteQuantGemvToCuda")
class RewriteQuantGemvToCuda:
    """4-bit projections: the GEMV kernel in buckets whose `dim` ends at <= `max_rows`, dequantize + cuBLAS in
    the others (see above); `residual`: the decode buckets' residual adds in the GEMV's epilogue; `int8`: the
    GEMV with int8 activations."""

    def __init__(self, dim: str = "n", max_rows: int = MAX_ROWS, residual: bool = True, int8: bool = False):
        self.dim, self.max_rows, self.residual = dim, max_rows, residual
        self.function, self.add_function = (
            (Q4_I8_FUNCTION, Q4_I8_ADD_FUNCTION) if int8 else (Q4_FUNCTION, Q4_ADD_FUNCTION)
        )

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gvar, func, bucket in bucket_functions(mod, self.dim):
            decode = int(bucket[self.dim][1]) <= self.max_rows
            rewriter = _Rewriter(mod, set(func.params), decode, self.function)
            new = rewriter.visit_expr(func)
            if not rewriter.count:
                continue
            fused = 0
            if decode and self.residual:
                matches = _Matches({self.function: self.add_function})
                matches.visit_expr(new)
                found = matches.matches()
                if found:
                    new, fused = _AddRewriter(mod, found).visit_expr(new), len(found)
            mod = rewriter.builder_.get()  # with the dequantize kernels it added
            updates[gvar] = new
            logger.info(
                "%s: %d 4-bit projection(s) -> %s (%d with the residual add)",
                gvar.name_hint,
                rewriter.count,
                self.function if decode else "dequantize + cuBLAS",
                fused,
            )
        return with_functions(mod, updates)
