"""RewriteGemvToCuda: the weight GEMVs of the decode buckets call relaxtune's GEMV kernel (CUDA only).

In bucket functions whose rows dimension ends at <= `max_rows` (the decode buckets), `R.matmul(x, w)`
with at most `max_cols` outputs
with `x (..., K)` and a 2-D weight `w (K, N)` that is a parameter of the bucket function (the
transposed weights LiftTransformParams produced), static K and N, both multiples of 8, fp16 or
bf16 in and out, becomes `R.call_dps_packed("relaxtune_gemv", (x, w), out)`: the kernel of
kernels/gemv.py (16-byte weight loads in 64-column tiles, K split over a thread-block
cluster, up to 8 rows per pass over the weights). A product used by nothing but an add of a
same-typed tensor `r` (the residual: `x + o_proj(a)`, `h + down(m)`) becomes
`R.call_dps_packed("relaxtune_gemv_add", (x, w, r), out)` (`residual`): r is added in the
kernel's epilogue, the add kernel and its read of the product are gone. Matched by operators and
types, never by names (the add matcher is RewriteResidualAddToCublas's).

Why: cuBLAS reads the 4096-output weights of a decode step far below the copy bandwidth (with weights
in the (K, N) layout, 4096 outputs give it too little parallelism). The limits are where the H200
measured this kernel faster (`benchmarks/gemv_check.py`, docs/results.md "GPU decode GEMVs"): GEMVs up
to `max_cols` outputs (cuBLAS keeps wider ones), buckets up to `max_rows` = 2 rows (from 4 rows cuBLAS
wins every shape: the kernel's FMAs and x loads per weight byte grow with the rows).

A weight kept as (N, K) (keep_weights_nk.py), read as `R.matmul(x, permute_dims(w))`, takes the
(N, K) kernel, "relaxtune_gemv_nk" / "relaxtune_gemv_nk_add", at up to `max_cols_nk` outputs (any
N; K a multiple of 8): warps read whole weight rows (kernels/gemv.py).

Run after BucketDispatch (reads `relaxtune.bucket`) and before RewriteGemmToCublas, which then
takes the weight GEMMs left (larger buckets, shapes this kernel does not take). The pipeline adds
it for cuda sm_80+ from `CompileConfig.cublas` (config.CudaLibraries: gemv, gemv_max_*).
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..config import CudaLibraries
from ..kernels.gemv import ADD_FUNCTION, FUNCTION, NK_ADD_FUNCTION, NK_FUNCTION, VECTOR
from .cublas_gemm import kn_shape, weight_gemm
from .cublas_gemm_add import _Matches
from .cublas_gemm_add import _Rewriter as _AddRewriter
from .fusion_utils import bucket_functions, static_int, with_functions

EPILOGUES = {FUNCTION: ADD_FUNCTION, NK_FUNCTION: NK_ADD_FUNCTION}  # each GEMV and the call that takes its residual add

logger = logging.getLogger(__name__)

# buckets up to 2 rows, GEMVs up to 16384 outputs ((N, K): any): where the H200 measured the kernel
# faster (docs/results.md); the defaults of config.CudaLibraries
MAX_ROWS = CudaLibraries.gemv_max_rows
MAX_COLS = CudaLibraries.gemv_max_cols
MAX_COLS_NK = CudaLibraries.gemv_max_cols_nk


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod, params, max_cols: int | None, max_cols_nk: int | None):
        super().__init__(mod)
        self.params, self.max_cols, self.max_cols_nk, self.count = params, max_cols, max_cols_nk, 0

    def visit_call_(self, call):
        call = super().visit_call_(call)
        matched = weight_gemm(call, self.params, min_x_ndim=1, lookup=self.lookup_binding)
        if matched is None:
            return call
        x, w, nk = matched
        xt = x.ty
        k, n = (static_int(d) for d in kn_shape(w, nk))
        if k is None or n is None or k % VECTOR or (not nk and n % VECTOR):
            return call
        limit = self.max_cols_nk if nk else self.max_cols
        if limit is not None and n > limit:
            return call
        self.count += 1
        return relax.call_dps_packed(
            NK_FUNCTION if nk else FUNCTION, [x, w], relax.TensorType(list(xt.shape.values[:-1]) + [n], xt.dtype)
        )


@tvm.transform.module_pass(opt_level=0, name="RewriteGemvToCuda")
class RewriteGemvToCuda:
    """Weight GEMVs (N <= `max_cols` outputs) of bucket functions whose `dim` ends at <= `max_rows`
    call relaxtune's GEMV kernel (see above)."""

    def __init__(
        self,
        dim: str = "n",
        max_rows: int = MAX_ROWS,
        residual: bool = True,
        max_cols: int | None = MAX_COLS,
        max_cols_nk: int | None = MAX_COLS_NK,
    ):
        self.dim, self.max_rows, self.residual, self.max_cols, self.max_cols_nk = (
            dim,
            max_rows,
            residual,
            max_cols,
            max_cols_nk,
        )

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gvar, func, bucket in bucket_functions(mod, self.dim):
            if int(bucket[self.dim][1]) > self.max_rows:
                continue
            rewriter = _Rewriter(mod, set(func.params), self.max_cols, self.max_cols_nk)
            new = relax.analysis.remove_all_unused(
                rewriter.visit_expr(func)
            )  # the (N, K) weights' transposes it read through
            if not rewriter.count:
                continue
            fused = 0
            if self.residual:
                matches = _Matches(EPILOGUES)
                matches.visit_expr(new)
                found = matches.matches()
                if found:
                    new, fused = _AddRewriter(mod, found).visit_expr(new), len(found)
            updates[gvar] = new
            logger.info(
                "%s: %d GEMV(s) -> relaxtune_gemv (%d with the residual add)", gvar.name_hint, rewriter.count, fused
            )
        return with_functions(mod, updates)
