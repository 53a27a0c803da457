"""relaxtune's decode GEMV for CUDA artifacts: an nvcc-compiled kernel launched through the driver API.

- `relaxtune_gemv(x, w, y)`: `y[..., N] = x[..., K] @ w[K, N]` for the few rows of a decode step
  (w row-major, as LiftTransformParams left it), fp16 or bf16, fp32 accumulation;
- `relaxtune_gemv_add(x, w, r, y)`: the same plus `r` (shaped like y), added in fp32 before the
  one rounding: the residual add as the GEMV's epilogue;
- `relaxtune_gemv_config(x, w, splits, y)`: `relaxtune_gemv` with the split of K chosen by the
  caller (benchmarks/gemv_check.py times each; 0 = the default below);
- `relaxtune_gemv_nk(x, w, y)` and `relaxtune_gemv_nk_add(x, w, r, y)`: the same products for a
  weight kept as (N, K) (`y = x @ w^T`, PyTorch Linear's layout; relax_passes/keep_weights_nk.py):
  a warp reads whole weight rows and reduces with shuffles, 16 warps x 2 features per block, the
  8 products of each 16-byte fp16 vector summed in fp16 (HFMA2), then in fp32; 512-thread blocks
  for grids of one wave, 256-thread ones (two per SM) beyond. Up to 4 rows of x per launch (from 4
  rows cuBLAS measured faster). Its times against the copy bandwidth and cuBLAS: docs/results.md
  (GPU decode GEMVs; `benchmarks/gemv_check.py`).
Emitted by `RewriteGemvToCuda` (relax_passes/gemv_cuda.py) in the small (decode) buckets.
- `relaxtune_gemv_nk_rms(x, g, w, eps, y)`: `y = rms_norm(x, g, eps) @ w^T` (the norm over K, g (K,), eps a
  float64 PrimValue), and `relaxtune_gemv_nk_swiglu(gu, w, y)` / `relaxtune_gemv_nk_swiglu_add(gu, w, r, y)`:
  `y = (silu(gu[..., :K]) * gu[..., K:]) @ w^T (+ r)` for the merged gate/up product gu (..., 2K): the (N, K)
  kernel with an x prologue. Each block first computes its x (up to 2 rows per launch) into shared memory,
  rounded where the separate kernels round (the norm in fp32 with one rounding, as TVM's legalized rms_norm;
  the SwiGLU step by step in the dtype, as its element-wise kernel), while its first weight loads are in
  flight; then the product as above.
  `relaxtune_gemv_nk_glu(x, w, y)` / `relaxtune_gemv_nk_rms_glu(x, g, w, eps, y)`: for the merged gate | up weight w
  (2N, K), `y (..., N) = silu(x' @ gate^T) * (x' @ up^T)` (x' = x or its norm): a warp owns gate row f and up row
  f + N, rounds both sums to the dtype and applies the SwiGLU's steps, so the down projection reads its x as it is.
  Emitted by `FuseGemvPrologueCuda` (relax_passes/fuse_gemv_prologue_cuda.py).
- `relaxtune_gemv_nk_attn(q, k, v, cos, sin, heads, causal, scale, rope, w, y)` / `relaxtune_gemv_nk_attn_add(...,
  w, r, y)`: `y = attention(q, k, v) @ w^T (+ r)` for one sequence of up to 2 rows (batch 1) attending to itself,
  heads (q_head0, k_head0, v_head0, kv_heads) as the flash kernel takes them, q (rope 1) or q and k (rope 2) rotated
  by the (>= rows, D) tables: each block computes the attention (D / 8 lanes per head) into shared memory as its x,
  as the flash kernel rounds. Emitted by `FuseAttentionGemvCuda` (relax_passes/fuse_attention_gemv_cuda.py).
- `relaxtune_q4gemv(x, w, scale, y)` and `relaxtune_q4gemv_add(x, w, scale, r, y)`: the same product for a 4-bit
  weight in the GPU layout (`quant_formats.pack_q4_gpu`, (N, K / 8) uint32, fp16 scales (N, K / group)), dequantized
  in registers; on compute capability 9.0+ streamed through a shared-memory ring by bulk asynchronous copies
  (qgemv_stream.cu), else, or where its conditions fail, register-pipelined (qgemv.cu); the host code
  (qgemv_host.cc) picks, RELAXTUNE_Q4GEMV / RELAXTUNE_Q4GEMV_STAGES override it for measurements
  (benchmarks/qgemv_sweep.py), and `relaxtune_q4gemv_kernel(x, w, scale, y)` names the kernel it would launch.
  `relaxtune_q4gemv_i8` / `_i8_add` / `_i8_kernel`: the same with int8 activations (x quantized per 16 values in
  the kernel, dp4a products; the `i8` families of qgemv_stream.cu) where a streamed kernel applies.
  `relaxtune_q4gemv_i8_rms(x, g, w, scale, eps, y)`: the same with the RMSNorm before it computed by each thread for
  its own pieces of x (compute capability 9.0+, K / group a multiple of 8, K <= Q4_PROLOGUE_MAX_K; emitted by
  `FuseQuantGemvPrologueCuda`).
  Compiled with this file's kernels into one fatbin and one host object; emitted by `RewriteQuantGemvToCuda`
  (relax_passes/quant_gemv_cuda.py).
- `relaxtune_q4mlp_i8(x, res, wo, so, g, wgu, sgu, wd, sd, eps, h, act, y)`: a decode step's o_proj through its
  down projection for one row of 4-bit weights, `h = x @ wo^T + res`, `act = silu(n @ gate^T) * (n @ up^T)` for
  `n = rms_norm(h, g, eps)` and the merged gate | up weight (2F, H), `y = act @ wd^T + h`, in one cooperative launch
  (qmlp_stream.cu: the weights of all four streamed through one ring, grid barriers between the steps; sm_90+, int8
  activations); `relaxtune_q4mlp_i8_kernel` names its kernel or says why none applies. Emitted by
  `FuseQuantMlpCuda` (relax_passes/fuse_quant_mlp_cuda.py). `relaxtune_q4mlp_attn_i8(q, k, v, cos, sin, heads, causal,
  scale, rope, res, wo, ..., y)`: the same where x is the attention of the one row, which every block computes first
  (gemv_prologue.cu's attention_rows) into shared memory before its ring. `relaxtune_q4block_i8(x, gin, wqkv, sqkv,
  eps_in, cos, sin, heads, causal, scale, rope, res, wo, ..., eps, qkv, h, act, y)`: the whole decoder layer, q, k and
  v too (`qkv = rms_norm(x, gin, eps_in) @ wqkv^T`, a first step with its own grid barrier, which the attention reads
  as q, k and v); emitted by `FuseQuantBlockCuda` (relax_passes/fuse_quant_block_cuda.py).

The (K, N) kernel (gemv.cu) gives each block 64 output columns: 8 threads x 16-byte vectors per
weight row, 32 or 64 K lanes per block each taking 8 consecutive rows (x: one vector load per row),
the next 8 rows' loads in flight while the current ones are multiplied, up to 8 rows of x sharing
one pass over the weights (more rows: one launch per 8). At N = 4096 outputs, 64 column tiles are
too few for an H200's 132 SMs (cuBLAS stays far below the copy bandwidth there). Here, on compute
capability 9.0+, the K range of a tile is split over the blocks of a thread-block cluster, whose
partial sums go to the leader block's shared memory (DSMEM; no workspace, nothing zeroed, no
atomics): the default split is the smallest power of two up to 8 that gives a block to 7/8 of the
SMs while every block keeps >= 256 weight rows. A grid that then fits the SMs in one wave (tiles x
splits <= SMs: o_proj and down, 64 x 2) takes the 512-thread kernel (one block per SM, twice the
loads in flight per SM), 1 and 2 rows; others the 256-thread one (two blocks per SM).
On 9.0+ the launch is a programmatic dependent one (cuLaunchKernelEx attribute): the kernel's
blocks may start as the previous kernel's blocks exit and issue their first weight loads, then
wait (griddepcontrol.wait) before they read x or the residual or write y. So the weight must not
be written by the kernel launched just before (RewriteGemvToCuda passes function parameters only).
RELAXTUNE_GEMV_SPLITS=1|2|4|8 replaces the default split, RELAXTUNE_GEMV_WIDE=0 keeps the
256-thread kernel, RELAXTUNE_GEMV_PDL=0 launches plainly (read at each launch; for measurements).
Launched with `cuLaunchKernelEx` (cluster dimension, programmatic serialization) on TVM's current
stream, no allocation and no sync, so CUDA graphs capture it; libcuda is opened with `dlopen`.
`object_file(arch)` embeds the fatbin in a host object (`.incbin`) that `artifact.export` links
into CUDA artifacts, as for the flash attention kernel (kernels/flash_attention.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

from .device_code import arch_number, embedded_fatbin_object, extern_host_source, find_nvcc, run_nvcc

logger = logging.getLogger(__name__)

FUNCTION = "relaxtune_gemv"
ADD_FUNCTION = "relaxtune_gemv_add"
NK_FUNCTION = "relaxtune_gemv_nk"  # the weight as (N, K)
NK_ADD_FUNCTION = "relaxtune_gemv_nk_add"
NK_RMS_FUNCTION = "relaxtune_gemv_nk_rms"  # rms_norm(x) @ w^T
NK_SWIGLU_FUNCTION = "relaxtune_gemv_nk_swiglu"  # (silu(gate) * up) @ w^T from the merged gate | up product
NK_SWIGLU_ADD_FUNCTION = "relaxtune_gemv_nk_swiglu_add"
NK_GLU_FUNCTION = "relaxtune_gemv_nk_glu"  # silu(x @ gate^T) * (x @ up^T) for the merged gate | up weight (2N, K)
NK_RMS_GLU_FUNCTION = "relaxtune_gemv_nk_rms_glu"  # the same of rms_norm(x)
NK_ATTN_FUNCTION = "relaxtune_gemv_nk_attn"  # attention(q, k, v) @ w^T for a sequence of up to 2 rows
NK_ATTN_ADD_FUNCTION = "relaxtune_gemv_nk_attn_add"
ATTN_MAX_ROWS = 2  # gemv_prologue.cu's kAttnX: the prologue kernels' rows
ATTN_HEAD_DIMS = (64, 128)
PROLOGUE_MAX_K = 16384  # the prologue kernels keep 2 rows of K elements in shared memory (64 KB at this K)
CONFIG_FUNCTION = "relaxtune_gemv_config"
Q4_FUNCTION = "relaxtune_q4gemv"  # the weight as 4-bit groups in the GPU layout (qgemv.cu)
Q4_ADD_FUNCTION = "relaxtune_q4gemv_add"
Q4_KERNEL_FUNCTION = "relaxtune_q4gemv_kernel"  # (x, w, scale, y) -> the kernel relaxtune_q4gemv would launch
Q4_I8_FUNCTION = "relaxtune_q4gemv_i8"  # the same with int8 activations where a streamed kernel applies
Q4_I8_ADD_FUNCTION = "relaxtune_q4gemv_i8_add"
Q4_I8_KERNEL_FUNCTION = "relaxtune_q4gemv_i8_kernel"
Q4_MLP_FUNCTION = "relaxtune_q4mlp_i8"  # o_proj + residual, RMSNorm, gate/up, SwiGLU, down + residual: one kernel
Q4_MLP_ATTN_FUNCTION = "relaxtune_q4mlp_attn_i8"  # the same with x the attention of the one row (q, k, v, ...)
Q4_BLOCK_FUNCTION = "relaxtune_q4block_i8"  # the same with q, k, v = rms_norm(x) @ Wqkv^T computed first
Q4_MLP_KERNEL_FUNCTION = "relaxtune_q4mlp_i8_kernel"  # (the same operands) -> its kernel, or "none: why"
Q4_MLP_MAX_K = (12288, 16384)  # qmlp_stream.cu's widest A, H and F
Q4_MLP_MIN_ARCH = 90  # bulk copies into a shared-memory ring, as qgemv_stream.cu
Q4_MLP_KERNELS = ("relaxtune_q4mlp_h1f4", "relaxtune_q4mlp_h3f4")  # qmlp_stream.cu's, as qmlp_host.cc lists them
Q4_I8_RMS_FUNCTION = "relaxtune_q4gemv_i8_rms"  # (x, g, w, scale, eps, y): rms_norm(x) @ W^T, int8 activations
Q4_PROLOGUE_MAX_K = 256 * 16 * 3  # the prologue kernels' K: 3 pieces of 16 per thread of a row group
Q4_PROLOGUE_MIN_ARCH = 90  # the prologue kernels are streamed ones (qgemv_stream.cu)
# qgemv_stream.cu's kernels, as qgemv_host.cc's kQ4StreamKernels lists them: family s<GR>r<RPG> (GR row groups of 8
# warps, RPG rows per group per ring slot), p<PMAX> (K up to 256 * 16 * PMAX), _m<rows of x>
Q4_STREAM_KERNELS = tuple(
    f"relaxtune_q4gemv_{kind}_m{m}"
    for kind in ("s2r4p1", "s2r4p3", "s2r8p1", "s2r2p3", "s3r2p1", "s1r8p1", "s1r8p3")
    + ("i8s2r4p1", "i8s2r4p3", "i8s2r8p1", "i8s1r8p1", "i8s1r8p3")
    + tuple(f"{kind}_rms" for kind in ("i8s2r8p1", "i8s2r4p1", "i8s2r4p3"))  # the RMSNorm as x's prologue
    for m in (1, 2)
)
MIN_ARCH = 80
VECTOR = 8  # columns per 16-byte load: N must be a multiple of it
_HERE = Path(__file__).parent
# one fatbin and one host object: the 4-bit kernels (qgemv.cu, qgemv_stream.cu) use gemv.cu's load and wait
# helpers (the streamed one also qgemv.cu's dequantization), their host code (qgemv_host.cc) gemv_host.cc's launch
KERNEL_SOURCE = "\n".join(
    (_HERE / name).read_text()
    for name in (
        "gemv.cu",
        "gemv_prologue.cu",
        "gemv_nk.cu",
        "qgemv.cu",
        "qstream_ring.cu",
        "qgemv_stream.cu",
        "qmlp_grid.cu",
        "qmlp_steps.cu",
        "qmlp_claim.cu",
        "qmlp_stream.cu",
    )
)

HOST_SOURCE = extern_host_source(
    "relaxtune gemv",
    "\n".join(
        (_HERE / name).read_text() for name in ("gemv_host.cc", "qgemv_host.cc", "qmlp_host.cc", "qblock_host.cc")
    ),
)

NVCC_FLAGS = ("-O3", "-std=c++17")


def supports(arch: str, minimum: int = MIN_ARCH) -> bool:
    """Whether the kernel runs on `arch` (e.g. "sm_90"); the cluster split needs compute capability 9.0+ at run time.
    `minimum`: a kernel's own lowest arch number (Q4_MLP_MIN_ARCH)."""
    try:
        return arch_number(arch) >= minimum
    except ValueError:
        return False


def nvcc_command(arch: str, src: Path, out: Path, kind: str = "--fatbin", extra: tuple = ()) -> list[str]:
    """nvcc for `arch`: SASS for it and its PTX (newer GPUs JIT that)."""
    number = arch_number(arch)
    return [
        find_nvcc(),
        kind,
        f"-gencode=arch=compute_{number},code=[sm_{number},compute_{number}]",
        *NVCC_FLAGS,
        *extra,
        "-o",
        str(out),
        str(src),
    ]


def compile_fatbin(arch: str, workdir: Path) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    src, out = workdir / "gemv.cu", workdir / "gemv.fatbin"
    src.write_text(KERNEL_SOURCE)
    run_nvcc(nvcc_command(arch, src, out), "the gemv kernel")
    return out


def object_file(arch: str, cache_dir: Path | None = None) -> Path:
    """The host object with the fatbin for `arch` embedded (cached by sources, arch and headers)."""
    if not supports(arch):
        raise ValueError(f"the gemv kernel needs sm_{MIN_ARCH} or newer, not {arch}")
    return embedded_fatbin_object(
        "gemv", "gemv", arch, KERNEL_SOURCE, HOST_SOURCE, compile_fatbin, cache_dir, "the gemv host object"
    )
