"""Fused flash attention for CUDA artifacts: an nvcc-compiled kernel launched through the driver API.

`relaxtune_flash_attention(q, k, v, causal, scale, block_m, out)`: softmax(scale * q k^T + mask) v
for q, out (b, n, heads, d) and k, v (b, m, kv_heads, d), compact, fp16 or bf16, d = 64 or 128;
`causal` 1 masks key j > query i (top-left, Relax's "TopLeft"); query head h reads kv head
h / (heads / kv_heads) (grouped-query attention without repeating k and v); `block_m` picks the
kernel: 64 or 128 query rows per block of the mma.sync kernel (single-buffered K/V), 90 the
warp-specialized wgmma kernel (compute capability 9.0 only), 0 the measured default (that kernel on
9.0 from 256 query rows on, else 64 rows of the mma.sync one).
`relaxtune_flash_attention_in_place(q, k, v, heads, causal, scale, block_m, out)` reads q, k, v
as head ranges of larger (b, rows, H, d) tensors (the merged q/k/v projection): `heads` =
(q_head0, k_head0, v_head0, kv_heads); `relaxtune_flash_attention_rope(q, k, v, cos, sin, heads,
...)` also rotates q (rotate-half RoPE with (>= n, d) tables) as it loads it, and
`relaxtune_flash_attention_rope_qk(...)` (the same arguments) k too, each key tile in shared memory once it has
landed (the mma.sync kernel; tables of >= m rows): for grids of one query block per head, where no key tile is
rotated twice. Emitted by `RewriteAttentionToFlash` (relax_passes/flash_attention_cuda.py).

The kernels (flash_attention.cu, FlashAttention-2 style: mma.sync tensor cores, cp.async
double buffering, online softmax; flash_attention_sm90.cu, the same with Hopper's wgmma, two
warpgroups per block; flash_attention_sm90_ws.cu, that with a producer warpgroup feeding
mbarrier-guarded stages and the two consumer warpgroups taking turns on the tensor cores) are
compiled here by nvcc into a fatbin for the target's arch;
`object_file(arch)` embeds that fatbin in a host object (`.incbin`) whose exported TVM FFI
function loads it with `cuModuleLoadData` on first use (per device) and launches it with
`cuLaunchKernel` on TVM's current stream: no sync and no allocation per call, so CUDA graphs can
capture it. libcuda is opened with `dlopen`, so the GPU host needs the driver and the TVM runtime
only (no nvcc, NVRTC or cudart). `artifact.export` links the object into CUDA artifacts.
"""

from __future__ import annotations

import logging
from pathlib import Path

from .device_code import arch_number, embedded_fatbin_object, extern_host_source, find_nvcc, run_nvcc

logger = logging.getLogger(__name__)

FUNCTION = "relaxtune_flash_attention"
IN_PLACE_FUNCTION = "relaxtune_flash_attention_in_place"
ROPE_FUNCTION = "relaxtune_flash_attention_rope"
ROPE_QK_FUNCTION = "relaxtune_flash_attention_rope_qk"  # k rotated on load too
RAGGED_FUNCTION = "relaxtune_flash_attention_ragged"  # a paged KV cache's ragged prefill (TVM's kernel's arguments)
BLOCK_ROWS = 64  # query rows per block of the kernel that block_m 0 picks below SM90_MIN_ROWS rows (the host's kBlockM)
SM90_MIN_ROWS = 256  # from these query rows on block_m 0 picks the wgmma kernel on 9.0 (the host's kSm90MinRows)
HEAD_DIMS = (64, 128)
MIN_ARCH = 80  # mma.sync with bf16, cp.async
# the shared mma.sync / ldmatrix / cp.async wrappers (mma_sm80.cu), the mma.sync kernels (sm_80+) and, appended in the
# same translation unit, the wgmma kernels (sm_90a)
KERNEL_SOURCE = "".join(
    Path(__file__).with_name(name).read_text()
    for name in (
        "mma_sm80.cu",
        "flash_attention.cu",
        "flash_sm90_common.cu",
        "flash_attention_sm90.cu",
        "flash_attention_sm90_ws.cu",
    )
)

HOST_SOURCE = extern_host_source(
    "relaxtune flash attention",
    Path(__file__).with_name("flash_attention_host.cc").read_text(),
)

NVCC_FLAGS = ("-O3", "--use_fast_math", "-std=c++17")


def supports(arch: str) -> bool:
    """Whether the kernel runs on `arch` (e.g. "sm_90")."""
    try:
        return arch_number(arch) >= MIN_ARCH
    except ValueError:
        return False


def compile_fatbin(arch: str, workdir: Path) -> Path:
    """nvcc the kernel into a fatbin with SASS for `arch` and its PTX (for newer GPUs)."""
    number = arch_number(arch)
    workdir.mkdir(parents=True, exist_ok=True)
    src, out = workdir / "flash_attention.cu", workdir / "flash_attention.fatbin"
    src.write_text(KERNEL_SOURCE)
    # sm_90: SASS for sm_90a (the wgmma kernels; it runs on compute capability 9.0 only) and sm_90 PTX
    # (newer GPUs JIT it; the wgmma kernels trap there and the host never picks them)
    sass = f"{number}a" if number == 90 else str(number)
    gencode = [f"-gencode=arch=compute_{sass},code=sm_{sass}", f"-gencode=arch=compute_{number},code=compute_{number}"]
    run_nvcc([find_nvcc(), "--fatbin", *gencode, *NVCC_FLAGS, "-o", str(out), str(src)], "the flash attention kernel")
    return out


def object_file(arch: str, cache_dir: Path | None = None) -> Path:
    """The host object with the fatbin for `arch` embedded (cached by sources, arch and headers)."""
    if not supports(arch):
        raise ValueError(f"the flash attention kernel needs sm_{MIN_ARCH} or newer, not {arch}")
    return embedded_fatbin_object(
        "flash",
        "flash_attention",
        arch,
        KERNEL_SOURCE,
        HOST_SOURCE,
        compile_fatbin,
        cache_dir,
        "the flash attention host object",
    )
