"""The variants `benchmarks/gpu_job.py` builds and times: tiny runtime-only checks and the fp16
llama-block at Llama-7B sizes, each a (fusion, CUDA graphs, cuda libraries) of relaxtune's pipeline."""

from __future__ import annotations

from relaxtune.config import CudaLibraries, FlashAttention

LLAMA7B = {
    "hidden": "4096",
    "heads": "32",
    "kv_heads": "32",
    "ffn": "11008",
    "max_seq": "2048",
    "max_batch": "1",
    "dtype": "float16",
}
LLAMA7B_BF16 = {**LLAMA7B, "dtype": "bfloat16"}
TINY_LLAMA = {
    "hidden": "256",
    "heads": "4",
    "kv_heads": "2",
    "ffn": "512",
    "max_seq": "128",
    "max_batch": "1",
    "dtype": "float16",
}
TINY = {
    "mlp-f32": ("mlp", {"hidden": "64", "ffn": "128", "max_seq": "64", "max_batch": "2"}),
    "llama-f16": ("llama-block", TINY_LLAMA),
    "llama-f16-sf-cublas": ("llama-block", TINY_LLAMA),
    "llama-f16-flash": ("llama-block", TINY_LLAMA),  # head_dim 64, GQA 4/2: the flash kernel inside the VM
}
TINY_VARIANTS = {
    "llama-f16-sf-cublas": ("stock", CudaLibraries()),
    "llama-f16-flash": ("relaxtune", CudaLibraries()),
}  # (fusion, libraries); others: relaxtune fusion, no cuBLAS
BIG_BUCKETS = {"n": (1, 16, 128, 2048)}
# relaxtune variants of the 7B block: (CompileConfig.fusion, CUDA graphs, CompileConfig.cublas)
# relaxtune fusion at these sizes: the build process died in FuseSwiGLU/MergeProjections (2026-11-30)
VARIANTS = {
    "llama7b-sf": ("stock", False, CudaLibraries(enabled=False)),
    "llama7b-sf-graph": ("stock", True, CudaLibraries(enabled=False)),
    "llama7b-sf-cublas": ("stock", False, CudaLibraries(min_rows=2, batched=False)),  # n=1 keeps the TIR GEMVs
    "llama7b-sf-cublas-graph": ("stock", True, CudaLibraries(min_rows=2, batched=False)),
    "llama7b-sf-cublas-wide-graph": (
        "stock",
        True,
        CudaLibraries(min_rows=2, decode_wide=8192, batched=False),
    ),  # n=1: cuBLAS for the MLP GEMVs only
    # every weight GEMM on cuBLAS, attention's batched GEMMs too in buckets from n >= 64 (here 129..2048): the default
    "llama7b-sf-cublas-all-graph": ("stock", True, CudaLibraries()),
    "llama7b-sf-cublas-all": ("stock", False, CudaLibraries()),  # the same without CUDA graphs: per-kernel times
    "llama7b-sf-cublas-nobmm-graph": (
        "stock",
        True,
        CudaLibraries(batched=False),
    ),  # attention in TIR (the default before)
    "llama7b-sf-cublas-nobmm": ("stock", False, CudaLibraries(batched=False)),
    "llama7b-sf-cublas-bmm17-graph": (
        "stock",
        True,
        CudaLibraries(batched_min_rows=17),
    ),  # attention on cuBLAS from n = 17
    # the default before RowSoftmax (dlight's GeneralReduction for the softmax kernels): see PREVIOUS_RULES
    "llama7b-sf-cublas-all-prev": ("stock", False, CudaLibraries()),
    "llama7b-sf-cublas-all-graph-prev": ("stock", True, CudaLibraries()),
    # relaxtune fusion on GPU = MergeProjections (q/k/v one GEMM, gate/up one GEMM), the CLI's default for cuda
    "llama7b-rf-cublas-all": ("relaxtune", False, CudaLibraries()),
    "llama7b-rf-cublas-all-graph": ("relaxtune", True, CudaLibraries()),
    # attention as one fused flash kernel (relax_passes/flash_attention_cuda.py), options in FLASH
    "llama7b-rf-cublas-flash-graph": ("relaxtune", True, CudaLibraries()),
    "llama7b-rf-cublas-flash": ("relaxtune", False, CudaLibraries()),
    "llama7b-rf-cublas-flash-copies-graph": (
        "relaxtune",
        True,
        CudaLibraries(),
    ),  # flash on compact q/k/v (slice and rope kernels kept)
    "llama7b-rf-cublas-flash-mma-graph": (
        "relaxtune",
        True,
        CudaLibraries(),
    ),  # the mma.sync flash kernel in every bucket (the default before the wgmma one)
    "llama7b-rf-cublas-flash-sepadd-graph": (
        "relaxtune",
        True,
        CudaLibraries(residual=False),
    ),  # residual adds as kernels of their own (the default before)
    # the decode buckets' GEMVs on cuBLAS, their residual adds as kernels (the default before relax_passes/gemv_cuda.py)
    "llama7b-rf-cublas-flash-nogemv-graph": ("relaxtune", True, CudaLibraries(gemv=False)),
    "llama7b-rf-cublas-flash-nogemv": ("relaxtune", False, CudaLibraries(gemv=False)),
    # the GEMV kernel for the 4096-output GEMVs only (o_proj, down); up to 12288 (qkv too: the default's choice
    # since RewriteGemvToCuda's max_cols = 16384); every one (gate/up too: the default before)
    "llama7b-rf-cublas-flash-gemv4k-graph": ("relaxtune", True, CudaLibraries(gemv_max_cols=4096)),
    "llama7b-rf-cublas-flash-gemv12k-graph": ("relaxtune", True, CudaLibraries(gemv_max_cols=12288)),
    "llama7b-rf-cublas-flash-gemvall-graph": ("relaxtune", True, CudaLibraries(gemv_max_cols=None)),
    # weights as LiftTransformParams leaves them, (K, N), read by the (K, N) GEMV kernel and cuBLAS (the default before
    # keep_weights_nk.py)
    "llama7b-rf-cublas-flash-kn-graph": ("relaxtune", True, CudaLibraries(weights_nk=False)),
    "llama7b-rf-cublas-flash-kn": ("relaxtune", False, CudaLibraries(weights_nk=False)),
    # the decode GEMVs without their x prologues: the RMSNorms and the SwiGLU as kernels of their own (the default
    # before relax_passes/fuse_gemv_prologue_cuda.py); `run` times it against the default at n = 1 (PROLOGUE_AB)
    "llama7b-rf-cublas-flash-noprologue-graph": ("relaxtune", True, CudaLibraries(gemv_prologue=False)),
    "llama7b-rf-cublas-flash-noprologue": ("relaxtune", False, CudaLibraries(gemv_prologue=False)),
    # the default with the SwiGLU as down's prologue rather than gate/up's epilogue (the default before gemv_glu), and
    # with k rotated by its own kernel in the decode buckets (before FlashAttention.rope_k): gpu_ab_builds.py
    "llama7b-rf-cublas-flash-noglu-graph": ("relaxtune", True, CudaLibraries(gemv_glu=False)),
    # the default with the n = 1 attention as its own flash kernel rather than o_proj's prologue (FuseAttentionGemvCuda)
    "llama7b-rf-cublas-flash-noattn-graph": ("relaxtune", True, CudaLibraries(gemv_attention=False)),
    "llama7b-rf-cublas-flash-noropek-graph": ("relaxtune", True, CudaLibraries()),
    # the flash default before RowElementwise (dlight's Fallback for the element-wise kernels): see PREVIOUS_EW
    "llama7b-rf-cublas-flash-graph-prev": ("relaxtune", True, CudaLibraries()),
    "llama7b-rf-cublas-flash-prev": ("relaxtune", False, CudaLibraries()),
    # the flash default before issue 8's RMSNorm / RoPE / table work (scalar loads in the norms'
    # reductions, k's RoPE on dlight's Fallback, the rotary tables computed per call): see PREVIOUS_H8C
    "llama7b-rf-cublas-flash-graph-h8cprev": ("relaxtune", True, CudaLibraries()),
    "llama7b-rf-cublas-flash-h8cprev": ("relaxtune", False, CudaLibraries()),
}
# CompileConfig.flash_attention per artifact (others: off, the attention of the variants above)
FLASH = {
    "llama-f16-flash": FlashAttention(),
    "llama7b-rf-cublas-flash-graph": FlashAttention(),
    "llama7b-rf-cublas-flash": FlashAttention(),
    "llama7b-rf-cublas-flash-graph-prev": FlashAttention(),
    "llama7b-rf-cublas-flash-prev": FlashAttention(),
    "llama7b-rf-cublas-flash-copies-graph": FlashAttention(in_place=False),
    "llama7b-rf-cublas-flash-mma-graph": FlashAttention(block_m=64),
    "llama7b-rf-cublas-flash-sepadd-graph": FlashAttention(),
    "llama7b-rf-cublas-flash-nogemv-graph": FlashAttention(),
    "llama7b-rf-cublas-flash-nogemv": FlashAttention(),
    "llama7b-rf-cublas-flash-gemv4k-graph": FlashAttention(),
    "llama7b-rf-cublas-flash-gemv12k-graph": FlashAttention(),
    "llama7b-rf-cublas-flash-gemvall-graph": FlashAttention(),
    "llama7b-rf-cublas-flash-graph-h8cprev": FlashAttention(lift_tables=False),
    "llama7b-rf-cublas-flash-h8cprev": FlashAttention(lift_tables=False),
    "llama7b-rf-cublas-flash-kn-graph": FlashAttention(),
    "llama7b-rf-cublas-flash-kn": FlashAttention(),
    "llama7b-rf-cublas-flash-noprologue-graph": FlashAttention(),
    "llama7b-rf-cublas-flash-noprologue": FlashAttention(),
    "llama7b-rf-cublas-flash-noglu-graph": FlashAttention(),
    "llama7b-rf-cublas-flash-noropek-graph": FlashAttention(rope_k=False),
    "llama7b-rf-cublas-flash-noattn-graph": FlashAttention(),
}
# built with the GPU rules as they were before schedules/rules/gpu_row_softmax.py (for comparison)
PREVIOUS_RULES = ("llama7b-sf-cublas-all-prev", "llama7b-sf-cublas-all-graph-prev")
# built without schedules/rules/gpu_elementwise.py (dlight's Fallback for element-wise kernels)
PREVIOUS_EW = ("llama7b-rf-cublas-flash-graph-prev", "llama7b-rf-cublas-flash-prev")
# built with RowSoftmax(vector_bytes=0) and RowElementwise(halves=False), tables not lifted (FLASH)
PREVIOUS_H8C = ("llama7b-rf-cublas-flash-graph-h8cprev", "llama7b-rf-cublas-flash-h8cprev")
# `run` profiles these per kernel when built (else the fastest variant without graphs at n=128)
KERNEL_VARIANTS = (
    "llama7b-sf-cublas-all-prev",
    "llama7b-sf-cublas-all",
    "llama7b-rf-cublas-all",
    "llama7b-sf-cublas-nobmm",
    "llama7b-rf-cublas-flash-prev",
    "llama7b-rf-cublas-flash-h8cprev",
    "llama7b-rf-cublas-flash-nogemv",
    "llama7b-rf-cublas-flash-kn",
    "llama7b-rf-cublas-flash-noprologue",
    "llama7b-rf-cublas-flash",
)
# what the lead's device run needs: `build --only` with this list (tiny check artifacts included)
DEVICE_SET = (
    *TINY,
    *PREVIOUS_RULES,
    "llama7b-sf-cublas-all",
    "llama7b-sf-cublas-all-graph",
    "llama7b-rf-cublas-all",
    "llama7b-rf-cublas-all-graph",
    "llama7b-rf-cublas-flash",
    "llama7b-rf-cublas-flash-graph",
    "llama7b-rf-cublas-flash-copies-graph",
)
SYSTEMS = (*VARIANTS, "llama7b-stock")
# the bfloat16 block (LLAMA7B_BF16): the default cuda build, with and without CUDA graphs, timed against torch in
# bfloat16
BF16_VARIANTS = {
    "llama7b-bf16-rf-cublas-flash-graph": ("relaxtune", True, CudaLibraries()),
    "llama7b-bf16-rf-cublas-flash": ("relaxtune", False, CudaLibraries()),
    "llama7b-bf16-rf-cublas-flash-noprologue-graph": ("relaxtune", True, CudaLibraries(gemv_prologue=False)),
    "llama7b-bf16-rf-cublas-flash-noattn-graph": ("relaxtune", True, CudaLibraries(gemv_attention=False)),
}
FLASH.update(dict.fromkeys(BF16_VARIANTS, FlashAttention()))
BF16_SYSTEMS = tuple(BF16_VARIANTS)
# n = 1 A/B per dtype: the default graph build (the GEMVs compute their RMSNorm / SwiGLU) and the same without that
PROLOGUE_AB = {
    "float16": ("llama7b-rf-cublas-flash-graph", "llama7b-rf-cublas-flash-noprologue-graph"),
    "bfloat16": ("llama7b-bf16-rf-cublas-flash-graph", "llama7b-bf16-rf-cublas-flash-noprologue-graph"),
}
# the same block with its projections 4-bit (`--quantize q4f16`, groups of Q4_GROUP, fp16 scales): the GEMV kernel over
# the GPU layout at n = 1 (relax_passes/quant_gemv_cuda.py), dequantize + cuBLAS beyond; timed against the floor for its
# bytes (gpu_job_quant.py)
Q4_GROUP = 32
Q4_VARIANTS = {
    "llama7b-q4-rf-cublas-flash-graph": ("relaxtune", True, CudaLibraries()),  # int8 activations in the GEMV (default)
    "llama7b-q4-rf-cublas-flash": ("relaxtune", False, CudaLibraries()),  # per-kernel times
    "llama7b-q4-f16act-rf-cublas-flash-graph": ("relaxtune", True, CudaLibraries()),  # float16 activations
    # o_proj .. down as five kernels, not relaxtune_q4mlp_i8 (FuseQuantMlpCuda)
    "llama7b-q4-nomlp-rf-cublas-flash-graph": ("relaxtune", True, CudaLibraries(q4_mlp=False)),
    "llama7b-q4-nomlp-rf-cublas-flash": ("relaxtune", False, CudaLibraries(q4_mlp=False)),
    # the one-kernel layer without the q/k/v projection in it (its own GEMV before: FuseQuantBlockCuda off)
    "llama7b-q4-noblock-rf-cublas-flash-graph": ("relaxtune", True, CudaLibraries(q4_block=False)),
    # the MLP kernel without the n = 1 attention in it (the flash kernel before it: FuseQuantMlpCuda(attention=False))
    "llama7b-q4-noattn-rf-cublas-flash-graph": ("relaxtune", True, CudaLibraries(gemv_attention=False)),
    # int8 activations, the q/k/v's RMSNorm its own kernel (FuseQuantGemvPrologueCuda off)
    "llama7b-q4-noprologue-rf-cublas-flash-graph": ("relaxtune", True, CudaLibraries(gemv_prologue=False)),
}
FLOAT16_ACTIVATIONS = ("llama7b-q4-f16act-rf-cublas-flash-graph",)  # built with CompileConfig(int8_activations=False)
FLASH.update(dict.fromkeys(Q4_VARIANTS, FlashAttention()))
Q4_SYSTEMS = tuple(Q4_VARIANTS)
