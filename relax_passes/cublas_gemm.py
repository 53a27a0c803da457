"""RewriteGemmToCublas: weight GEMMs of the larger shape buckets become cuBLAS calls (CUDA only).

`R.matmul(x, w)` with `x (..., K)` and a 2-D weight `w (K, N)` that is a parameter of the bucket
function (the transposed weights LiftTransformParams produced), fp16 or bf16 in and out, becomes
`R.call_dps_packed("relaxtune_cublas_gemm", (x, w), out)` — the external kernel of
`relaxtune/kernels/cublas.py`, linked into the artifact; `R.matmul(x, permute_dims(w))` with an
(N, K) weight parameter (keep_weights_nk.py) becomes "relaxtune_cublas_gemm_nk" on `w` itself. In bucket functions
whose lower bound of
the rows dimension is at least `min_rows`, every such GEMM; in smaller (decode) buckets only those
whose weight has a side >= `decode_wide` (None: none). The default is every bucket (`min_rows=1`):
inside the graph-captured Llama-7B block every GEMM on cuBLAS measured fastest on an H200
(`benchmarks/gpu_job.py`; docs/results.md "GPU GEMMs and cuBLAS").

Run after BucketDispatch (reads `relaxtune.bucket`) and RewriteGemvToCuda (gemv_cuda.py: the
decode buckets' GEMVs on relaxtune's own kernel, where it measured faster), and before
LegalizeOps; element-wise
consumers of the GEMM (SwiGLU) then stay separate kernels, except a residual add, which
RewriteResidualAddToCublas (cublas_gemm_add.py) folds into the GEMM. Attention's batched
activation GEMMs are RewriteBatchedGemmToCublas's (cublas_batched_gemm.py). The pipeline adds
them for cuda targets from `CompileConfig.cublas` (config.CudaLibraries).
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .fusion_utils import bucket_functions, is_transpose, with_functions

logger = logging.getLogger(__name__)

FUNCTION = "relaxtune_cublas_gemm"
NK_FUNCTION = "relaxtune_cublas_gemm_nk"  # the weight kept (N, K): keep_weights_nk.py
DTYPES = ("float16", "bfloat16")


def _untransposed(w, params, lookup) -> relax.Var | None:
    """The (N, K) parameter `w` is bound to the transpose of (`lookup`: the mutator's lookup_binding), else None."""
    value = lookup(w) if lookup is not None and isinstance(w, relax.Var) else None
    if not is_transpose(value):
        return None
    source = value.args[0]
    return source if isinstance(source, relax.Var) and source in params else None


def weight_gemm(
    call: relax.Call, params, min_x_ndim: int = 2, lookup=None
) -> tuple[relax.Expr, relax.Var, bool] | None:
    """`(x, w, nk)` when `call` is `R.matmul(x, w)` with `w` a 2-D weight among `params` (the bucket
    function's parameters; nk False), or `R.matmul(x, permute_dims(w))` with `w` an (N, K) one
    (nk True; `lookup` resolves the transpose's variable: keep_weights_nk.py keeps weights so), `x`
    of at least `min_x_ndim` dimensions, fp16 or bf16 in and out; else None. The weight GEMMs that
    relaxtune's CUDA library rewrites may take (also gemv_cuda.py)."""
    if call.op != tvm.ir.Op.get("relax.matmul") or len(call.args) != 2:
        return None
    x, w = call.args
    nk = _untransposed(w, params, lookup)
    if nk is not None:
        w = nk
    elif not (isinstance(w, relax.Var) and w in params):
        return None
    xt, wt = x.ty, w.ty
    if not (
        isinstance(xt, relax.TensorType)
        and isinstance(wt, relax.TensorType)
        and wt.ndim == 2
        and xt.ndim >= min_x_ndim
        and wt.shape is not None
    ):
        return None
    out_dtype = str(call.attrs.out_dtype) if call.attrs.out_dtype else ""
    if xt.dtype not in DTYPES or wt.dtype != xt.dtype or out_dtype not in ("", "void", xt.dtype):
        return None
    return x, w, nk is not None


def kn_shape(w: relax.Var, nk: bool) -> tuple:
    """The weight's (K, N) dimensions, whichever way it is stored."""
    k, n = w.ty.shape.values
    return (n, k) if nk else (k, n)


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod, params, min_width: int = 0):
        super().__init__(mod)
        self.params, self.min_width = params, min_width
        self.count = 0

    def visit_call_(self, call):
        call = super().visit_call_(call)
        matched = weight_gemm(call, self.params, lookup=self.lookup_binding)
        if matched is None:
            return call
        x, w, nk = matched
        xt, wt = x.ty, w.ty
        if max(int(d) for d in wt.shape.values) < self.min_width:  # a narrow decode GEMV keeps its TIR kernel
            return call
        out = relax.TensorType(list(xt.shape.values[:-1]) + [kn_shape(w, nk)[1]], xt.dtype)
        self.count += 1
        return relax.call_dps_packed(NK_FUNCTION if nk else FUNCTION, [x, w], out)


@tvm.transform.module_pass(opt_level=0, name="RewriteGemmToCublas")
class RewriteGemmToCublas:
    """Weight GEMMs of bucket functions whose `dim` starts at >= `min_rows` call cuBLAS (see above)."""

    def __init__(self, dim: str = "n", min_rows: int = 1, decode_wide: int | None = None):
        self.dim, self.min_rows, self.decode_wide = dim, min_rows, decode_wide

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gvar, func, bucket in bucket_functions(mod, self.dim):
            small = int(bucket[self.dim][0]) < self.min_rows
            if small and self.decode_wide is None:
                continue
            rewriter = _Rewriter(mod, set(func.params), min_width=self.decode_wide if small else 0)
            new = rewriter.visit_expr(func)
            if rewriter.count:
                updates[gvar] = relax.analysis.remove_all_unused(new)  # the (N, K) weights' transposes it read through
                logger.info("%s: %d GEMM(s) -> cuBLAS", gvar.name_hint, rewriter.count)
        return with_functions(mod, updates)
