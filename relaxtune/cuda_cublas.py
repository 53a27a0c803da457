"""cuBLAS GEMM as an external kernel linked into CUDA artifacts: `relaxtune_cublas_gemm(x, w, y)`.

`y[..., N] = x[..., K] @ w[K, N]` (row-major, fp16 or bf16, fp32 accumulation) by `cublasGemmEx`
on TVM's current CUDA stream (so it is captured in CUDA graphs). cuBLAS is opened with `dlopen`
on the first call, not linked: the TVM wheel has no cuBLAS integration and the compiling host
needs no cuBLAS; the GPU host needs `libcublas.so` on the loader path (or already loaded, e.g.
by torch). `RewriteGemmToCublas` (relax_passes/cublas_gemm.py) emits the calls; `object_file()`
compiles this source with the host C++ compiler and `artifact.export` links it into the `.so`,
where the VM finds it as a library function.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
from pathlib import Path

logger = logging.getLogger(__name__)

FUNCTION = "relaxtune_cublas_gemm"

SOURCE = r"""
#include <dlfcn.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <mutex>
#include <string>

namespace {
using Handle = void*;
using CreateFn = int (*)(Handle*);
using SetStreamFn = int (*)(Handle, void*);
using SetWorkspaceFn = int (*)(Handle, void*, size_t);
using GemmExFn = int (*)(Handle, int, int, int, int, int, const void*, const void*, int, int, const void*, int, int,
                         const void*, void*, int, int, int, int);
constexpr int kOpN = 0, kR16F = 2, kR16BF = 14, kCompute32F = 68, kGemmDefault = -1;

struct Cublas {
  Handle handle = nullptr;
  SetStreamFn set_stream = nullptr;
  GemmExFn gemm = nullptr;
};

Cublas* Load() {
  static Cublas lib;
  static std::once_flag once;
  static std::string error;
  std::call_once(once, [] {
    void* so = nullptr;
    for (const char* name : {"libcublas.so.13", "libcublas.so.12", "libcublas.so"}) {
      if ((so = dlopen(name, RTLD_NOW | RTLD_GLOBAL)) != nullptr) break;
    }
    if (so == nullptr) { error = "cannot dlopen libcublas.so.13/.12 (put it on LD_LIBRARY_PATH)"; return; }
    auto create = reinterpret_cast<CreateFn>(dlsym(so, "cublasCreate_v2"));
    lib.set_stream = reinterpret_cast<SetStreamFn>(dlsym(so, "cublasSetStream_v2"));
    lib.gemm = reinterpret_cast<GemmExFn>(dlsym(so, "cublasGemmEx"));
    if (!create || !lib.set_stream || !lib.gemm || create(&lib.handle) != 0) {
      error = "libcublas loaded but cublasCreate/cublasGemmEx failed";
      lib.handle = nullptr;
    }
  });
  TVM_FFI_ICHECK(lib.handle != nullptr) << "relaxtune_cublas_gemm: " << error;
  return &lib;
}

void Gemm(tvm::ffi::TensorView x, tvm::ffi::TensorView w, tvm::ffi::TensorView y) {
  TVM_FFI_ICHECK_EQ(w.ndim(), 2) << "weight must be (K, N)";
  int64_t k = w.size(0), n = w.size(1), m = 1;
  TVM_FFI_ICHECK_EQ(x.size(x.ndim() - 1), k) << "x's last dimension must be K";
  for (int i = 0; i + 1 < x.ndim(); ++i) m *= x.size(i);
  TVM_FFI_ICHECK_EQ(y.size(y.ndim() - 1), n);
  DLDataType t = x.dtype();
  TVM_FFI_ICHECK(t.bits == 16 && (t.code == kDLFloat || t.code == kDLBfloat)) << "fp16 or bf16 only";
  int type = t.code == kDLBfloat ? kR16BF : kR16F;
  Cublas* lib = Load();
  DLDevice dev = x.device();
  lib->set_stream(lib->handle, TVMFFIEnvGetStream(dev.device_type, dev.device_id));
  float alpha = 1.0f, beta = 0.0f;
  // row-major Y (m x n) = X (m x k) W (k x n)  <=>  column-major Y^T = W^T X^T
  int status = lib->gemm(lib->handle, kOpN, kOpN, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha,
                         w.data_ptr(), type, static_cast<int>(n), x.data_ptr(), type, static_cast<int>(k), &beta,
                         y.data_ptr(), type, static_cast<int>(n), kCompute32F, kGemmDefault);
  TVM_FFI_ICHECK_EQ(status, 0) << "cublasGemmEx failed for m=" << m << " n=" << n << " k=" << k;
}
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_cublas_gemm, Gemm);
"""


def object_file(cache_dir: Path | None = None) -> Path:
    """The compiled object (cached by the hash of the source and the tvm-ffi headers' location)."""
    import tvm_ffi.libinfo

    include = tvm_ffi.libinfo.find_include_path()
    digest = hashlib.sha1((SOURCE + include).encode()).hexdigest()[:12]
    folder = Path(cache_dir or os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "relaxtune"
    obj = folder / f"cublas_gemm_{digest}.o"
    if obj.exists():
        return obj
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / f"cublas_gemm_{digest}.cc"
    src.write_text(SOURCE)
    includes = {include, tvm_ffi.libinfo.find_dlpack_include_path()}
    cmd = [os.environ.get("CXX", "g++"), "-std=c++17", "-O2", "-fPIC", *(f"-I{p}" for p in includes), "-c", str(src), "-o", str(obj) + ".tmp"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"compiling the cuBLAS kernel failed ({' '.join(cmd)}):\n{done.stderr[-3000:]}")
    os.replace(str(obj) + ".tmp", obj)
    logger.info("compiled %s", obj)
    return obj
