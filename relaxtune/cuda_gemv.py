"""relaxtune's decode GEMV for CUDA artifacts: an nvcc-compiled kernel launched through the driver API.

- `relaxtune_gemv(x, w, y)`: `y[..., N] = x[..., K] @ w[K, N]` for the few rows of a decode step
  (w row-major, as LiftTransformParams left it), fp16 or bf16, fp32 accumulation;
- `relaxtune_gemv_add(x, w, r, y)`: the same plus `r` (shaped like y), added in fp32 before the
  one rounding: the residual add as the GEMV's epilogue;
- `relaxtune_gemv_config(x, w, splits, y)`: `relaxtune_gemv` with the split of K chosen by the
  caller (scripts/gemv_check.py times each; 0 = the default below);
- `relaxtune_gemv_nk(x, w, y)` and `relaxtune_gemv_nk_add(x, w, r, y)`: the same products for a
  weight kept as (N, K) (`y = x @ w^T`, PyTorch Linear's layout; relax_passes/keep_weights_nk.py):
  a warp reads whole weight rows and reduces with shuffles, 16 warps x 2 features per block, the
  8 products of each 16-byte fp16 vector summed in fp16 (HFMA2), then in fp32; 512-thread blocks
  for grids of one wave, 256-thread ones (two per SM) beyond. H200, fp16, 1 row, weights from
  memory (scripts/gemv_check.py in gpu_job.py run, 2026-12-01), eager / in a graph, % of the 4268
  GB/s copy: o_proj 4096 x 4096 9.77 / 9.65 us (80.5% / 81.5%; the (K, N) kernel below 10.53 /
  10.33), down 22.17 / 22.06 (95%; 23.18 / 22.95), gate/up 42.9 / 42.7 (99%; cuBLAS 47.4 / 46.7),
  qkv 25.3 / 25.1 (93%; 25.3 / 25.2). Up to 4 rows of x per launch (from 4 rows cuBLAS is faster).
Emitted by `RewriteGemvToCuda` (relax_passes/gemv_cuda.py) in the small (decode) buckets.

The (K, N) kernel (cuda_gemv.cu) gives each block 64 output columns: 8 threads x 16-byte vectors per
weight row, 32 or 64 K lanes per block each taking 8 consecutive rows (x: one vector load per row),
the next 8 rows' loads in flight while the current ones are multiplied, up to 8 rows of x sharing
one pass over the weights (more rows: one launch per 8). cuBLAS reaches 48% of the copy bandwidth
at N = 4096 outputs on an H200: 64 column tiles are too few for 132 SMs. Here, on compute
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
H200, fp16, 1 row, weights from memory (scripts/gemv_check.py, eager launches; notes s15/gemv):
qkv 25.3 us, o_proj 10.4, down 23.2 (93% / 75% / 91% of the 4269 GB/s copy bandwidth); graph-
captured block at n = 1: 0.1274 ms (0.1396 with every GEMV on cuBLAS; with the 256-thread kernel
only 0.1267, with a plain launch 0.1274, splits 1 / 4 forced 0.1269 / 0.1324).
RELAXTUNE_GEMV_SPLITS=1|2|4|8 replaces the default split, RELAXTUNE_GEMV_WIDE=0 keeps the
256-thread kernel, RELAXTUNE_GEMV_PDL=0 launches plainly (read at each launch; for measurements).
Launched with `cuLaunchKernelEx` (cluster dimension, programmatic serialization) on TVM's current
stream, no allocation and no sync, so CUDA graphs capture it; libcuda is opened with `dlopen`.
`object_file(arch)` embeds the fatbin in a host object (`.incbin`) that `artifact.export` links
into CUDA artifacts, as for the flash attention kernel (cuda_flash_attention.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

from .cuda_device_code import arch_number, embedded_fatbin_object, extern_host_source, find_nvcc, run_nvcc

logger = logging.getLogger(__name__)

FUNCTION = "relaxtune_gemv"
ADD_FUNCTION = "relaxtune_gemv_add"
NK_FUNCTION = "relaxtune_gemv_nk"  # the weight as (N, K)
NK_ADD_FUNCTION = "relaxtune_gemv_nk_add"
CONFIG_FUNCTION = "relaxtune_gemv_config"
MIN_ARCH = 80
VECTOR = 8  # columns per 16-byte load: N must be a multiple of it
KERNEL_SOURCE = Path(__file__).with_name("cuda_gemv.cu").read_text()

HOST_SOURCE = extern_host_source("relaxtune gemv", r"""
#include <algorithm>
#include <cstdlib>

extern "C" const char relaxtune_gemv_fatbin[];  // the nvcc fatbin, linked in by .incbin below

namespace {
struct Params {  // must match cuda_gemv.cu
  const void *x, *w, *res;
  void* y;
  int rows, k, n, k_per_split;
};
constexpr int kCols = 64, kMaxRows = 8, kMaxSplits = 8, kMinRowsPerSplit = 256;
constexpr int kNkFeatures = 32, kNkMaxRows = 4;  // the nk kernel's features per 512-thread block (16 warps x 2), rows per launch

// RELAXTUNE_GEMV_SPLITS=1|2|4|8 replaces the default split of K (scripts/gpu_job.py measures each in the block); read per launch
int64_t ForcedSplits() {
  const char* value = std::getenv("RELAXTUNE_GEMV_SPLITS");
  int64_t splits = value != nullptr ? std::atoll(value) : 0;
  return splits == 1 || splits == 2 || splits == 4 || splits == 8 ? splits : 0;
}

// on compute capability 9.0+ the kernel is launched as a programmatic dependent of the previous one
// (its first weight loads overlap that kernel's end); RELAXTUNE_GEMV_PDL=0: a plain launch (for measurements)
bool ProgrammaticLaunch() {
  const char* value = std::getenv("RELAXTUNE_GEMV_PDL");
  return value == nullptr || value[0] != '0';
}
// RELAXTUNE_GEMV_WIDE=0: never the 512-thread kernels (for measurements)
bool WideAllowed() {
  const char* value = std::getenv("RELAXTUNE_GEMV_WIDE");
  return value == nullptr || value[0] != '0';
}

// the checks both layouts share (messages prefixed with `what`): x (..., K), y (..., N) with x's rows, r
// shaped like y, all compact fp16 or bf16 of one type, x and w 16-byte aligned; returns x's rows
int64_t CheckOperands(const char* what, const tvm::ffi::TensorView& x, const tvm::ffi::TensorView& w, const tvm::ffi::TensorView* r,
                      const tvm::ffi::TensorView& y, int64_t k, int64_t n) {
  int64_t m = 1;
  for (int i = 0; i + 1 < x.ndim(); ++i) m *= x.size(i);
  TVM_FFI_ICHECK(x.ndim() >= 1 && x.size(x.ndim() - 1) == k) << what << ": x's last dimension must be K = " << k;
  TVM_FFI_ICHECK(y.size(y.ndim() - 1) == n && y.numel() == m * n) << what << ": y must be (..., N) with x's rows";
  TVM_FFI_ICHECK(k <= INT32_MAX / 2 && n <= INT32_MAX / 2) << what << ": too large";
  DLDataType dt = x.dtype();
  TVM_FFI_ICHECK(dt.bits == 16 && dt.lanes == 1 && (dt.code == kDLFloat || dt.code == kDLBfloat)) << what << ": fp16 or bf16 only";
  for (const auto* t : {&x, &w, &y, r}) {
    if (t == nullptr) continue;
    TVM_FFI_ICHECK(t->dtype().code == dt.code && t->dtype().bits == 16 && t->dtype().lanes == 1) << what << ": mixed dtypes";
    TVM_FFI_ICHECK(t->IsContiguous()) << what << ": operands must be compact";
  }
  TVM_FFI_ICHECK(reinterpret_cast<uintptr_t>(Data(w)) % 16 == 0 && reinterpret_cast<uintptr_t>(Data(x)) % 16 == 0)
      << what << ": the weight and x must be 16-byte aligned";
  if (r != nullptr) TVM_FFI_ICHECK_EQ(r->numel(), m * n) << what << ": the residual must be shaped like y";
  return m;
}

// one launch on `stream`: a plain one, or cuLaunchKernelEx with a (1, splits, 1) cluster and/or as a
// programmatic dependent of the previous kernel (compute capability 9.0+)
void Start(Driver* d, Ptr fn, unsigned blocks, unsigned splits, unsigned threads, bool pdl, void* stream, void** args) {
  if (splits == 1 && !pdl) {
    Check(d, d->launch(fn, blocks, 1, 1, threads, 1, 1, 0, stream, args, nullptr), "cuLaunchKernel");
    return;
  }
  LaunchAttribute attrs[2]{};
  unsigned count = 0;
  if (splits > 1) {
    attrs[count].id = kClusterDimension;
    attrs[count].value.cluster.x = 1, attrs[count].value.cluster.y = splits, attrs[count].value.cluster.z = 1;
    ++count;
  }
  if (pdl) attrs[count].id = kProgrammaticSerialization, attrs[count].value.cluster.x = 1, ++count;  // the union's first int: allowed = 1
  TVM_FFI_ICHECK(d->launch_ex != nullptr) << "gemv: a cluster or programmatic launch needs cuLaunchKernelEx (a CUDA 12+ driver)";
  LaunchConfig config{blocks, splits, 1, threads, 1, 1, 0, stream, attrs, count};
  Check(d, d->launch_ex(&config, fn, args, nullptr), "cuLaunchKernelEx (cluster / programmatic)");
}

// y = x @ w (+ r); splits: blocks per cluster that share a column tile's K range (0: the default)
void Launch(const tvm::ffi::TensorView& x, const tvm::ffi::TensorView& w, const tvm::ffi::TensorView* r, const tvm::ffi::TensorView& y,
            int64_t splits) {
  TVM_FFI_ICHECK_EQ(w.ndim(), 2) << "gemv: the weight must be (K, N)";
  int64_t k = w.size(0), n = w.size(1);
  TVM_FFI_ICHECK(n % 8 == 0 && k % 8 == 0) << "gemv: N = " << n << " and K = " << k << " must be multiples of 8 (16-byte vectors)";
  int64_t m = CheckOperands("gemv", x, w, r, y, k, n);
  DLDataType dt = x.dtype();
  TVM_FFI_ICHECK(splits >= 0 && splits <= kMaxSplits) << "gemv: splits " << splits << " (0 = default, 1.." << kMaxSplits << ")";
  if (m == 0 || n == 0) return;
  Driver* d = LoadDriver();
  DLDevice dev = y.device();
  const int major = Attribute(d, dev.device_id, kComputeMajor), sms = Attribute(d, dev.device_id, kMultiprocessors);
  unsigned tiles = static_cast<unsigned>((n + kCols - 1) / kCols);
  if (splits == 0) splits = ForcedSplits();
  if (splits == 0) {  // clusters (compute capability 9.0+) until 7/8 of the SMs have a block
    splits = 1;
    while (major >= 9 && splits < kMaxSplits && 8 * tiles * splits < static_cast<unsigned>(7 * sms) &&
           k / (2 * splits) >= kMinRowsPerSplit)
      splits *= 2;
  }
  TVM_FFI_ICHECK(splits == 1 || major >= 9) << "gemv: splitting K over a cluster needs compute capability 9.0+";
  int k_per_split = static_cast<int>((k + 8 * splits - 1) / (8 * splits) * 8);  // a multiple of 8: chunks never straddle blocks
  const char* type = dt.code == kDLBfloat ? "bf16" : "f16";
  // a grid that fits the SMs in one wave takes the 512-thread kernel (one block per SM, 16 loads in flight per thread)
  bool wide = major >= 9 && tiles * splits <= static_cast<unsigned>(sms) && WideAllowed();
  bool pdl = major >= 9 && ProgrammaticLaunch();
  void* stream = TVMFFIEnvGetStream(dev.device_type, dev.device_id);
  for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {  // up to 8 rows share one pass over the weights
    int rows = static_cast<int>(std::min<int64_t>(kMaxRows, m - r0));
    int tile = rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : 8;
    bool wide_here = wide && tile <= 2;
    Ptr fn = Kernel(d, relaxtune_gemv_fatbin, dev.device_id, std::string("relaxtune_gemv_") + type + "_m" + std::to_string(tile) + (wide_here ? "_wide" : ""));
    Params p{Data(x) + r0 * k * 2, Data(w), r != nullptr ? Data(*r) + r0 * n * 2 : nullptr, Data(y) + r0 * n * 2,
             rows, static_cast<int>(k), static_cast<int>(n), k_per_split};
    void* args[] = {&p};
    Start(d, fn, tiles, static_cast<unsigned>(splits), wide_here ? 512 : 256, pdl, stream, args);
  }
}

// y = x @ w^T (+ r) for w (N, K): warps of the "nk" kernel own 2 features each, up to 4 rows of x per launch
void LaunchNk(const tvm::ffi::TensorView& x, const tvm::ffi::TensorView& w, const tvm::ffi::TensorView* r, const tvm::ffi::TensorView& y) {
  TVM_FFI_ICHECK_EQ(w.ndim(), 2) << "gemv_nk: the weight must be (N, K)";
  int64_t n = w.size(0), k = w.size(1);
  TVM_FFI_ICHECK(k % 8 == 0) << "gemv_nk: K = " << k << " must be a multiple of 8 (16-byte vectors)";
  int64_t m = CheckOperands("gemv_nk", x, w, r, y, k, n);
  DLDataType dt = x.dtype();
  if (m == 0 || n == 0) return;
  Driver* d = LoadDriver();
  DLDevice dev = y.device();
  const bool pdl = Attribute(d, dev.device_id, kComputeMajor) >= 9 && ProgrammaticLaunch();
  // a grid of 512-thread blocks that fits the SMs in one wave keeps them; larger ones take 256-thread blocks, two per SM
  const bool narrow = (n + kNkFeatures - 1) / kNkFeatures > Attribute(d, dev.device_id, kMultiprocessors) || !WideAllowed();
  const unsigned threads = narrow ? 256 : 512, blocks = static_cast<unsigned>((n + threads / 16 - 1) / (threads / 16));
  const char* type = dt.code == kDLBfloat ? "bf16" : "f16";
  void* stream = TVMFFIEnvGetStream(dev.device_type, dev.device_id);
  for (int64_t r0 = 0; r0 < m; r0 += kNkMaxRows) {
    int rows = static_cast<int>(std::min<int64_t>(kNkMaxRows, m - r0));
    int tile = rows <= 1 ? 1 : rows <= 2 ? 2 : 4;
    Ptr fn = Kernel(d, relaxtune_gemv_fatbin, dev.device_id, std::string("relaxtune_gemv_nk_") + type + "_m" + std::to_string(tile) + (narrow ? "_narrow" : ""));
    Params p{Data(x) + r0 * k * 2, Data(w), r != nullptr ? Data(*r) + r0 * n * 2 : nullptr, Data(y) + r0 * n * 2,
             rows, static_cast<int>(k), static_cast<int>(n), static_cast<int>(k)};
    void* args[] = {&p};
    Start(d, fn, blocks, 1, threads, pdl, stream, args);
  }
}

void Gemv(tvm::ffi::TensorView x, tvm::ffi::TensorView w, tvm::ffi::TensorView y) { Launch(x, w, nullptr, y, 0); }
void GemvNk(tvm::ffi::TensorView x, tvm::ffi::TensorView w, tvm::ffi::TensorView y) { LaunchNk(x, w, nullptr, y); }
void GemvNkAdd(tvm::ffi::TensorView x, tvm::ffi::TensorView w, tvm::ffi::TensorView r, tvm::ffi::TensorView y) { LaunchNk(x, w, &r, y); }
void GemvAdd(tvm::ffi::TensorView x, tvm::ffi::TensorView w, tvm::ffi::TensorView r, tvm::ffi::TensorView y) { Launch(x, w, &r, y, 0); }
void GemvConfig(tvm::ffi::TensorView x, tvm::ffi::TensorView w, int64_t splits, tvm::ffi::TensorView y) { Launch(x, w, nullptr, y, splits); }
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_gemv, Gemv);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_gemv_add, GemvAdd);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_gemv_config, GemvConfig);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_gemv_nk, GemvNk);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_gemv_nk_add, GemvNkAdd);
""")

NVCC_FLAGS = ("-O3", "-std=c++17")


def supports(arch: str) -> bool:
    """Whether the kernel runs on `arch` (e.g. "sm_90"); the cluster split needs compute capability 9.0+ at run time."""
    try:
        return arch_number(arch) >= MIN_ARCH
    except ValueError:
        return False


def nvcc_command(arch: str, src: Path, out: Path, kind: str = "--fatbin", extra: tuple = ()) -> list[str]:
    """nvcc for `arch`: SASS for it and its PTX (newer GPUs JIT that)."""
    number = arch_number(arch)
    return [find_nvcc(), kind, f"-gencode=arch=compute_{number},code=[sm_{number},compute_{number}]", *NVCC_FLAGS, *extra, "-o", str(out), str(src)]


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
    return embedded_fatbin_object("gemv", "gemv", arch, KERNEL_SOURCE, HOST_SOURCE, compile_fatbin, cache_dir, "the gemv host object")
