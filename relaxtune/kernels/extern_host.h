// The host side every relaxtune CUDA extern shares (flash attention, GEMV): cuda_device_code.py puts
// this text in front of each extern's own host code, after `#define RELAXTUNE_EXTERN "<its name>"`.
// The CUDA driver is opened with dlopen (no link-time dependency: the artifact loads on hosts without
// a GPU), driver errors become TVM exceptions naming the extern, the extern's fatbin is loaded once
// per device in the device's current (else primary) context, and each kernel is looked up once.
// Everything is in an anonymous namespace: two externs linked into one artifact keep their own.
#include <dlfcn.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>

namespace {
using CUresult = int;
using Ptr = void*;
struct LaunchAttribute {
  int id;
  char pad[4];
  union {
    char raw[64];
    struct {
      unsigned x, y, z;
    } cluster;
  } value;
};  // CUlaunchAttribute
struct LaunchConfig {  // CUlaunchConfig
  unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes;
  Ptr stream;
  LaunchAttribute* attrs;
  unsigned num_attrs;
};
// CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
constexpr int kClusterDimension = 4, kProgrammaticSerialization = 6;
constexpr int kMaxDynamicSharedBytes = 8;  // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
constexpr int kComputeMajor = 75, kComputeMinor = 76, kMultiprocessors = 16;  // CU_DEVICE_ATTRIBUTE_*

struct Driver {
  CUresult (*init)(unsigned) = nullptr;
  CUresult (*ctx_get_current)(Ptr*) = nullptr;
  CUresult (*ctx_set_current)(Ptr) = nullptr;
  CUresult (*device_get)(int*, int) = nullptr;
  CUresult (*primary_retain)(Ptr*, int) = nullptr;
  CUresult (*module_load_data)(Ptr*, const void*) = nullptr;
  CUresult (*module_get_function)(Ptr*, Ptr, const char*) = nullptr;
  CUresult (*func_set_attribute)(Ptr, int, int) = nullptr;
  CUresult (*launch)(Ptr, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, Ptr, void**,
                     void**) = nullptr;
  CUresult (*launch_ex)(const LaunchConfig*, Ptr, void**, void**) = nullptr;  // CUDA 12+ drivers; null on older ones
  CUresult (*error_string)(CUresult, const char**) = nullptr;
  CUresult (*device_attribute)(int*, int, int) = nullptr;
};

Driver* LoadDriver() {
  static Driver d;
  static std::once_flag once;
  static std::string error;
  std::call_once(once, [] {
    void* so = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (so == nullptr) { error = "cannot dlopen libcuda.so.1 (no NVIDIA driver?)"; return; }
    auto sym = [so](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(so, name));
      return fn != nullptr;
    };
    bool ok = sym(d.init, "cuInit") && sym(d.ctx_get_current, "cuCtxGetCurrent") &&
              sym(d.ctx_set_current, "cuCtxSetCurrent") && sym(d.device_get, "cuDeviceGet") &&
              sym(d.primary_retain, "cuDevicePrimaryCtxRetain") && sym(d.module_load_data, "cuModuleLoadData") &&
              sym(d.module_get_function, "cuModuleGetFunction") && sym(d.func_set_attribute, "cuFuncSetAttribute") &&
              sym(d.launch, "cuLaunchKernel") && sym(d.error_string, "cuGetErrorString") &&
              sym(d.device_attribute, "cuDeviceGetAttribute");
    sym(d.launch_ex, "cuLaunchKernelEx");
    if (!ok || d.init(0) != 0) {
      error = "libcuda.so.1 lacks a driver entry point, or cuInit failed";
      d.launch = nullptr;
    }
  });
  TVM_FFI_ICHECK(d.launch != nullptr) << RELAXTUNE_EXTERN ": " << error;
  return &d;
}

void Check(Driver* d, CUresult status, const char* what) {
  if (status == 0) return;
  const char* text = nullptr;
  d->error_string(status, &text);
  TVM_FFI_THROW(RuntimeError) << RELAXTUNE_EXTERN ": " << what << " failed: " << (text ? text : "?") << " (" << status
                              << ")";
}

// the kernel `name` of `fatbin` on `device`; the module is loaded once per device, in its current (else
// primary) context; `shared_bytes` > 0 raises the kernel's dynamic shared-memory limit, once
Ptr Kernel(Driver* d, const char* fatbin, int device, const std::string& name, int shared_bytes = 0) {
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
      int dev;
      Check(d, d->device_get(&dev, device), "cuDeviceGet");
      Check(d, d->primary_retain(&ctx, dev), "cuDevicePrimaryCtxRetain");
      Check(d, d->ctx_set_current(ctx), "cuCtxSetCurrent");
    }
    Check(d, d->module_load_data(&module, fatbin), "cuModuleLoadData (is the GPU older than the artifact's arch?)");
  }
  Ptr fn = nullptr;
  Check(d, d->module_get_function(&fn, module, name.c_str()), "cuModuleGetFunction");
  if (shared_bytes > 0)
    Check(d, d->func_set_attribute(fn, kMaxDynamicSharedBytes, shared_bytes),
          "cuFuncSetAttribute(max dynamic shared memory)");
  return kernels[key] = fn;
}

// a CU_DEVICE_ATTRIBUTE_* of `device`, read once
int Attribute(Driver* d, int device, int attribute) {
  static std::mutex mu;
  static std::unordered_map<long long, int> known;
  std::lock_guard<std::mutex> lock(mu);
  long long key = static_cast<long long>(device) << 32 | static_cast<unsigned>(attribute);
  auto found = known.find(key);
  if (found != known.end()) return found->second;
  int dev, value = 0;
  Check(d, d->device_get(&dev, device), "cuDeviceGet");
  Check(d, d->device_attribute(&value, attribute, dev), "cuDeviceGetAttribute");
  return known[key] = value;
}

char* Data(const tvm::ffi::TensorView& t) { return static_cast<char*>(t.data_ptr()) + t.byte_offset(); }
}  // namespace
