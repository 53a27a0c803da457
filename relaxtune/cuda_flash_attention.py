"""Fused flash attention for CUDA artifacts: an nvcc-compiled kernel launched through the driver API.

`relaxtune_flash_attention(q, k, v, causal, scale, block_m, out)`: softmax(scale * q k^T + mask) v
for q, out (b, n, heads, d) and k, v (b, m, kv_heads, d), compact, fp16 or bf16, d = 64 or 128;
`causal` 1 masks key j > query i (top-left, Relax's "TopLeft"); query head h reads kv head
h / (heads / kv_heads) (grouped-query attention without repeating k and v); `block_m` picks the
query rows per thread block (64 or 128; 0: the default, `DEFAULT_BLOCK_M`). Emitted by
`RewriteAttentionToFlash` (relax_passes/flash_attention_cuda.py).

The kernel (cuda_flash_attention.cu, FlashAttention-2 style: mma.sync tensor cores, cp.async
double buffering, online softmax) is compiled here by nvcc into a fatbin for the target's arch;
`object_file(arch)` embeds that fatbin in a host object (`.incbin`) whose exported TVM FFI
function loads it with `cuModuleLoadData` on first use (per device) and launches it with
`cuLaunchKernel` on TVM's current stream: no sync and no allocation per call, so CUDA graphs can
capture it. libcuda is opened with `dlopen`, so the GPU host needs the driver and the TVM runtime
only (no nvcc, NVRTC or cudart). `artifact.export` links the object into CUDA artifacts.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
from pathlib import Path

logger = logging.getLogger(__name__)

FUNCTION = "relaxtune_flash_attention"
HEAD_DIMS = (64, 128)
MIN_ARCH = 80  # mma.sync with bf16, cp.async
DEFAULT_BLOCK_M = 64
KERNEL_SOURCE = (Path(__file__).with_name("cuda_flash_attention.cu")).read_text()

HOST_SOURCE = r"""
#include <dlfcn.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <climits>
#include <cmath>
#include <mutex>
#include <string>
#include <unordered_map>

extern "C" const char relaxtune_flash_fatbin[];  // the nvcc fatbin, linked in by .incbin below

namespace {
using CUresult = int;
using CUdevice = int;
using Ptr = void*;
struct Driver {
  CUresult (*init)(unsigned) = nullptr;
  CUresult (*ctx_get_current)(Ptr*) = nullptr;
  CUresult (*ctx_set_current)(Ptr) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*primary_retain)(Ptr*, CUdevice) = nullptr;
  CUresult (*module_load_data)(Ptr*, const void*) = nullptr;
  CUresult (*module_get_function)(Ptr*, Ptr, const char*) = nullptr;
  CUresult (*func_set_attribute)(Ptr, int, int) = nullptr;
  CUresult (*launch)(Ptr, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, Ptr, void**, void**) = nullptr;
  CUresult (*error_string)(CUresult, const char**) = nullptr;
};

struct Params {  // must match cuda_flash_attention.cu
  const void* q;
  const void* k;
  const void* v;
  void* o;
  long long q_batch, k_batch;
  int q_row, k_row;
  int n, m, group, causal;
  float scale_log2;
};

constexpr int kMaxDynamicSharedBytes = 8;  // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
constexpr int kBlockN = 64;

Driver* LoadDriver() {
  static Driver d;
  static std::once_flag once;
  static std::string error;
  std::call_once(once, [] {
    void* so = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (so == nullptr) { error = "cannot dlopen libcuda.so.1 (no NVIDIA driver?)"; return; }
    auto sym = [so](auto& fn, const char* name) { fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(so, name)); return fn != nullptr; };
    bool ok = sym(d.init, "cuInit") && sym(d.ctx_get_current, "cuCtxGetCurrent") && sym(d.ctx_set_current, "cuCtxSetCurrent") &&
              sym(d.device_get, "cuDeviceGet") && sym(d.primary_retain, "cuDevicePrimaryCtxRetain") &&
              sym(d.module_load_data, "cuModuleLoadData") && sym(d.module_get_function, "cuModuleGetFunction") &&
              sym(d.func_set_attribute, "cuFuncSetAttribute") && sym(d.launch, "cuLaunchKernel") && sym(d.error_string, "cuGetErrorString");
    if (!ok || d.init(0) != 0) { error = "libcuda.so.1 lacks a driver entry point, or cuInit failed"; d.launch = nullptr; }
  });
  TVM_FFI_ICHECK(d.launch != nullptr) << "relaxtune flash attention: " << error;
  return &d;
}

void Check(Driver* d, CUresult status, const char* what) {
  if (status == 0) return;
  const char* text = nullptr;
  d->error_string(status, &text);
  TVM_FFI_THROW(RuntimeError) << "relaxtune flash attention: " << what << " failed: " << (text ? text : "?") << " (" << status << ")";
}

// the kernel for (dtype, d, warps) on `device`: the module is loaded once per device, in its
// current (else primary) context, and each kernel's shared-memory limit raised once
Ptr Kernel(Driver* d, int device, const std::string& name, int smem) {
  static std::mutex mu;
  static std::unordered_map<int, Ptr> modules;
  static std::unordered_map<std::string, Ptr> kernels;
  std::lock_guard<std::mutex> lock(mu);
  std::string key = std::to_string(device) + "/" + name;
  auto found = kernels.find(key);
  if (found != kernels.end()) return found->second;
  Ptr& module = modules[device];
  if (module == nullptr) {
    Ptr ctx = nullptr;
    Check(d, d->ctx_get_current(&ctx), "cuCtxGetCurrent");
    if (ctx == nullptr) {
      CUdevice dev;
      Check(d, d->device_get(&dev, device), "cuDeviceGet");
      Check(d, d->primary_retain(&ctx, dev), "cuDevicePrimaryCtxRetain");
      Check(d, d->ctx_set_current(ctx), "cuCtxSetCurrent");
    }
    Check(d, d->module_load_data(&module, relaxtune_flash_fatbin), "cuModuleLoadData (is the GPU older than the artifact's arch?)");
  }
  Ptr fn = nullptr;
  Check(d, d->module_get_function(&fn, module, name.c_str()), "cuModuleGetFunction");
  Check(d, d->func_set_attribute(fn, kMaxDynamicSharedBytes, smem), "cuFuncSetAttribute(max dynamic shared memory)");
  kernels[key] = fn;
  return fn;
}

void FlashAttention(tvm::ffi::TensorView q, tvm::ffi::TensorView k, tvm::ffi::TensorView v, int64_t causal, double scale,
                    int64_t block_m, tvm::ffi::TensorView o) {
  for (const auto* t : {&q, &k, &v, &o}) {
    TVM_FFI_ICHECK_EQ(t->ndim(), 4) << "flash attention: q, k, v and out must be (batch, rows, heads, head_dim)";
    TVM_FFI_ICHECK(t->IsContiguous()) << "flash attention: operands must be compact";
  }
  DLDataType dt = q.dtype();
  TVM_FFI_ICHECK(dt.bits == 16 && dt.lanes == 1 && (dt.code == kDLFloat || dt.code == kDLBfloat)) << "flash attention: fp16 or bf16 only";
  for (const auto* t : {&k, &v, &o}) {
    TVM_FFI_ICHECK(t->dtype().code == dt.code && t->dtype().bits == 16) << "flash attention: mixed dtypes";
  }
  int64_t b = q.size(0), n = q.size(1), hq = q.size(2), dim = q.size(3), m = k.size(1), hkv = k.size(2);
  TVM_FFI_ICHECK(dim == 64 || dim == 128) << "flash attention: head_dim " << dim << " (64 or 128 only)";
  TVM_FFI_ICHECK(k.size(0) == b && v.size(0) == b && v.size(1) == m && v.size(2) == hkv && k.size(3) == dim && v.size(3) == dim)
      << "flash attention: k and v must be (batch, keys, kv_heads, head_dim) like each other";
  TVM_FFI_ICHECK(hkv > 0 && hq % hkv == 0) << "flash attention: " << hq << " query heads for " << hkv << " kv heads";
  for (int i = 0; i < 4; ++i) TVM_FFI_ICHECK_EQ(o.size(i), q.size(i)) << "flash attention: out must have q's shape";
  TVM_FFI_ICHECK(n * hq * dim <= INT_MAX && m * hkv * dim <= INT_MAX && hq <= 65535 && b <= 65535) << "flash attention: too large";
  if (block_m == 0) block_m = DEFAULT_BLOCK_M;
  TVM_FFI_ICHECK(block_m == 64 || block_m == 128) << "flash attention: block_m " << block_m << " (64 or 128)";
  if (b == 0 || n == 0) return;
  TVM_FFI_ICHECK(m > 0) << "flash attention: no keys";
  auto data = [](const tvm::ffi::TensorView& t) { return static_cast<char*>(t.data_ptr()) + t.byte_offset(); };
  Params p{data(q), data(k), data(v), data(o), n * hq * dim, m * hkv * dim, static_cast<int>(hq * dim),
           static_cast<int>(hkv * dim), static_cast<int>(n), static_cast<int>(m), static_cast<int>(hq / hkv),
           causal ? 1 : 0, static_cast<float>(scale * 1.4426950408889634)};
  int warps = static_cast<int>(block_m / 16);
  int smem = static_cast<int>((block_m + 4 * kBlockN) * dim * 2);
  std::string name = std::string("relaxtune_flash_") + (dt.code == kDLBfloat ? "bf16" : "f16") + "_d" + std::to_string(dim) + "_w" + std::to_string(warps);
  Driver* d = LoadDriver();
  DLDevice dev = q.device();
  Ptr fn = Kernel(d, dev.device_id, name, smem);
  void* args[] = {&p};
  unsigned grid_x = static_cast<unsigned>((n + block_m - 1) / block_m);
  Check(d, d->launch(fn, grid_x, static_cast<unsigned>(hq), static_cast<unsigned>(b), 32 * warps, 1, 1, smem,
                     TVMFFIEnvGetStream(dev.device_type, dev.device_id), args, nullptr), "cuLaunchKernel");
}
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_flash_attention, FlashAttention);
"""

NVCC_FLAGS = ("-O3", "--use_fast_math", "-std=c++17")


def _arch_number(arch: str) -> int:
    return int(arch.removeprefix("sm_").rstrip("a"))


def supports(arch: str) -> bool:
    """Whether the kernel runs on `arch` (e.g. "sm_90")."""
    try:
        return _arch_number(arch) >= MIN_ARCH
    except ValueError:
        return False


def compile_fatbin(arch: str, workdir: Path) -> Path:
    """nvcc the kernel into a fatbin with SASS for `arch` and its PTX (for newer GPUs)."""
    from .cuda_device_code import find_nvcc

    number = _arch_number(arch)
    workdir.mkdir(parents=True, exist_ok=True)
    src, out = workdir / "flash_attention.cu", workdir / "flash_attention.fatbin"
    src.write_text(KERNEL_SOURCE)
    cmd = [find_nvcc(), "--fatbin", f"-gencode=arch=compute_{number},code=[sm_{number},compute_{number}]", *NVCC_FLAGS, "-o", str(out), str(src)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"nvcc failed on the flash attention kernel ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
    return out


def object_file(arch: str, cache_dir: Path | None = None) -> Path:
    """The host object with the fatbin for `arch` embedded (cached by sources, arch and headers)."""
    import tvm_ffi.libinfo

    include = tvm_ffi.libinfo.find_include_path()
    digest = hashlib.sha1((KERNEL_SOURCE + HOST_SOURCE + arch + include + str(DEFAULT_BLOCK_M)).encode()).hexdigest()[:12]
    folder = Path(cache_dir or os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "relaxtune" / f"flash_{arch}_{digest}"
    obj = folder / "flash_attention.o"
    if obj.exists():
        return obj
    if not supports(arch):
        raise ValueError(f"the flash attention kernel needs sm_{MIN_ARCH} or newer, not {arch}")
    fatbin = compile_fatbin(arch, folder)
    src = folder / "flash_attention_host.cc"
    embed = (
        f'asm(".section .rodata\\n.balign 16\\n.globl relaxtune_flash_fatbin\\n.hidden relaxtune_flash_fatbin\\n'
        f'relaxtune_flash_fatbin:\\n.incbin \\"{fatbin}\\"\\n.byte 0\\n.previous\\n");\n'
    )
    src.write_text(HOST_SOURCE.replace("DEFAULT_BLOCK_M", str(DEFAULT_BLOCK_M)) + embed)
    includes = {include, tvm_ffi.libinfo.find_dlpack_include_path()}
    cmd = [os.environ.get("CXX", "g++"), "-std=c++17", "-O2", "-fPIC", *(f"-I{p}" for p in includes), "-c", str(src), "-o", str(obj) + ".tmp"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"compiling the flash attention host object failed ({' '.join(cmd)}):\n{done.stderr[-3000:]}")
    os.replace(str(obj) + ".tmp", obj)
    logger.info("compiled %s (fatbin %d bytes)", obj, fatbin.stat().st_size)
    return obj
