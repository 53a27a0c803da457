"""cuBLAS GEMMs as external kernels linked into CUDA artifacts (fp16/bf16, fp32 accumulation).

- `relaxtune_cublas_gemm(x, w, y)`: `y[..., N] = x[..., K] @ w[K, N]` (row-major) by `cublasGemmEx`;
  emitted by `RewriteGemmToCublas` (relax_passes/cublas_gemm.py) for weight GEMMs.
- `relaxtune_cublas_gemm_nk(x, w, y)` / `relaxtune_cublas_gemm_add_nk(x, w, r, y)`: the same for a
  weight kept as (N, K) (relax_passes/keep_weights_nk.py), `y = x @ w^T (+ r)`: cuBLAS reads w with
  a transpose flag (PyTorch Linear's "TN" GEMM), no copy.
- `relaxtune_cublas_gemm_add(x, w, r, y)`: `y = x @ w + r` (r shaped like y) by `cublasLtMatmul` with
  C = r, beta = 1 and D = y: the residual add is the GEMM's epilogue (no add kernel, r read once
  there); the algorithm is cuBLASLt's heuristic first pick, cached per shape, with up to 32 MiB of
  workspace taken from the stream-ordered pool (`cuMemAllocAsync` / `cuMemFreeAsync` around the
  call, so CUDA graphs capture it). Emitted by `RewriteResidualAddToCublas`
  (relax_passes/cublas_gemm_add.py).
- `relaxtune_cublas_batched_gemm(a, b, a_axes, b_axes, c_axes, alpha, c)`: the batched
  `permute_dims(c, c_axes) = alpha * permute_dims(a, a_axes) @ permute_dims(b, b_axes)` by
  `cublasGemmStridedBatchedEx`, where the three tensors are compact and each permutation is a
  view: a matrix whose rows are contiguous is read with a transpose flag, row and batch strides
  come from the permutation, so attention's `q`, `k^T`, `v` and its output need no transpose
  kernel. Batch dimensions that do not merge into one stride are looped over (one call each).
  Emitted by `RewriteBatchedGemmToCublas` (relax_passes/cublas_batched_gemm.py) for attention.

Both run on TVM's current CUDA stream (so they are captured in CUDA graphs). cuBLAS is opened with
`dlopen` on the first call, not linked: the TVM wheel has no cuBLAS integration and the compiling
host needs no cuBLAS; the GPU host needs `libcublas.so` on the loader path (or already loaded,
e.g. by torch). `object_file()` compiles this source with the host C++ compiler and
`artifact.export` links it into the `.so`, where the VM finds the functions as library functions.
"""

from __future__ import annotations

import logging
from pathlib import Path

from . import kernel_cache

logger = logging.getLogger(__name__)

FUNCTION = "relaxtune_cublas_gemm"
GEMM_ADD_FUNCTION = "relaxtune_cublas_gemm_add"
NK_FUNCTION = "relaxtune_cublas_gemm_nk"  # the weight as (N, K): y = x @ w^T
GEMM_ADD_NK_FUNCTION = "relaxtune_cublas_gemm_add_nk"
BATCHED_FUNCTION = "relaxtune_cublas_batched_gemm"

SOURCE = Path(__file__).with_name("cublas_host.cc").read_text()  # the host code: cuBLAS / cuBLASLt by dlopen


def object_file(cache_dir: Path | None = None) -> Path:
    """The compiled object (kernel_cache: keyed by the source, the host compiler and the tvm-ffi headers)."""
    digest = kernel_cache.entry_digest(SOURCE, kernel_cache.toolchain(kernel_cache.host_compiler()))
    folder = kernel_cache.cache_root(cache_dir)
    obj = folder / f"cublas_gemm_{digest}.o"
    return kernel_cache.build_once(
        obj,
        lambda: kernel_cache.compile_host_object(SOURCE, folder / f"cublas_gemm_{digest}.cc", obj, "the cuBLAS kernel"),
    )
