#include <dlfcn.h>
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <algorithm>
#include <climits>
#include <map>
#include <mutex>
#include <type_traits>
#include <string>
#include <vector>

namespace {
using Handle = void*;
using CreateFn = int (*)(Handle*);
using SetStreamFn = int (*)(Handle, void*);
using GemmExFn = int (*)(Handle, int, int, int, int, int, const void*, const void*, int, int, const void*, int, int,
                         const void*, void*, int, int, int, int);
using GemmBatchedFn = int (*)(Handle, int, int, int, int, int, const void*, const void*, int, int, long long,
                              const void*, int, int, long long, const void*, void*, int, int, long long, int, int, int);
constexpr int kOpN = 0, kOpT = 1, kR16F = 2, kR16BF = 14, kCompute32F = 68, kGemmDefault = -1;

struct Cublas {
  Handle handle = nullptr;
  SetStreamFn set_stream = nullptr;
  GemmExFn gemm = nullptr;
  GemmBatchedFn gemm_batched = nullptr;
};

Cublas* Load(DLDevice dev) {
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
    lib.gemm_batched = reinterpret_cast<GemmBatchedFn>(dlsym(so, "cublasGemmStridedBatchedEx"));
    if (!create || !lib.set_stream || !lib.gemm || !lib.gemm_batched || create(&lib.handle) != 0) {
      error = "libcublas loaded but cublasCreate/cublasGemmEx/cublasGemmStridedBatchedEx failed";
      lib.handle = nullptr;
    }
  });
  TVM_FFI_ICHECK(lib.handle != nullptr) << "relaxtune cuBLAS kernels: " << error;
  lib.set_stream(lib.handle, TVMFFIEnvGetStream(dev.device_type, dev.device_id));
  return &lib;
}

int CublasType(const tvm::ffi::TensorView& t) {
  DLDataType d = t.dtype();
  TVM_FFI_ICHECK(d.bits == 16 && d.lanes == 1 && (d.code == kDLFloat || d.code == kDLBfloat)) << "fp16 or bf16 only";
  return d.code == kDLBfloat ? kR16BF : kR16F;
}

char* Data(const tvm::ffi::TensorView& t) { return static_cast<char*>(t.data_ptr()) + t.byte_offset(); }

// the weight's K and N: w is (K, N), or (N, K) when `nk` (read with a transpose flag)
void WeightShape(const tvm::ffi::TensorView& w, bool nk, int64_t* k, int64_t* n) {
  TVM_FFI_ICHECK_EQ(w.ndim(), 2) << "weight must be " << (nk ? "(N, K)" : "(K, N)");
  *k = w.size(nk ? 1 : 0), *n = w.size(nk ? 0 : 1);
}
void GemmLayout(tvm::ffi::TensorView x, tvm::ffi::TensorView w, tvm::ffi::TensorView y, bool nk) {
  int64_t k, n, m = 1;
  WeightShape(w, nk, &k, &n);
  TVM_FFI_ICHECK_EQ(x.size(x.ndim() - 1), k) << "x's last dimension must be K";
  for (int i = 0; i + 1 < x.ndim(); ++i) m *= x.size(i);
  TVM_FFI_ICHECK_EQ(y.size(y.ndim() - 1), n);
  int type = CublasType(x);
  Cublas* lib = Load(x.device());
  float alpha = 1.0f, beta = 0.0f;
  // row-major Y (m x n) = X (m x k) W (k x n)  <=>  column-major Y^T = W^T X^T; W (n x k) row-major is
  // column-major W^T with ld = k, read transposed (the "TN" GEMM of PyTorch's Linear)
  int status = lib->gemm(lib->handle, nk ? kOpT : kOpN, kOpN, static_cast<int>(n), static_cast<int>(m),
                         static_cast<int>(k), &alpha, Data(w), type, static_cast<int>(nk ? k : n), Data(x), type,
                         static_cast<int>(k), &beta, Data(y), type, static_cast<int>(n), kCompute32F, kGemmDefault);
  TVM_FFI_ICHECK_EQ(status, 0) << "cublasGemmEx failed for m=" << m << " n=" << n << " k=" << k;
}

// cuBLASLt (dlopen'ed like cuBLAS) and the driver's stream-ordered allocator for its workspace
struct LtAlgo { uint64_t data[8]; };                                       // cublasLtMatmulAlgo_t
struct LtHeuristic {
  LtAlgo algo;
  size_t workspace;
  int state;
  float waves;
  int reserved[4];
};  // cublasLtMatmulHeuristicResult_t
constexpr int kR32F = 0, kPrefMaxWorkspace = 1, kDescTransA = 3;  // CUBLASLT_MATMUL_DESC_TRANSA
constexpr size_t kLtWorkspace = size_t(32) << 20;
struct Lt {
  Handle handle = nullptr;
  int (*desc_create)(Handle*, int, int) = nullptr;
  int (*desc_set)(Handle, int, const void*, size_t) = nullptr;
  int (*layout_create)(Handle*, int, uint64_t, uint64_t, int64_t) = nullptr;
  int (*pref_create)(Handle*) = nullptr;
  int (*pref_set)(Handle, int, const void*, size_t) = nullptr;
  int (*pref_destroy)(Handle) = nullptr;
  int (*heuristic)(Handle, Handle, Handle, Handle, Handle, Handle, Handle, int, LtHeuristic*, int*) = nullptr;
  int (*matmul)(Handle, Handle, const void*, const void*, Handle, const void*, Handle, const void*, const void*, Handle,
                void*, Handle, const LtAlgo*, void*, size_t, void*) = nullptr;
  int (*alloc_async)(uint64_t*, size_t, void*) = nullptr;  // cuMemAllocAsync
  int (*free_async)(uint64_t, void*) = nullptr;            // cuMemFreeAsync
};

Lt* LoadLt() {
  static Lt lib;
  static std::once_flag once;
  static std::string error;
  std::call_once(once, [] {
    void* so = nullptr;
    for (const char* name : {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"}) {
      if ((so = dlopen(name, RTLD_NOW | RTLD_GLOBAL)) != nullptr) break;
    }
    void* cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (so == nullptr || cuda == nullptr) { error = "cannot dlopen libcublasLt.so.13/.12 or libcuda.so.1"; return; }
    auto sym = [](void* from, auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(from, name));
      return fn != nullptr;
    };
    int (*create)(Handle*) = nullptr;
    bool ok = sym(so, create, "cublasLtCreate") && sym(so, lib.desc_create, "cublasLtMatmulDescCreate") &&
              sym(so, lib.desc_set, "cublasLtMatmulDescSetAttribute") &&
              sym(so, lib.layout_create, "cublasLtMatrixLayoutCreate") &&
              sym(so, lib.pref_create, "cublasLtMatmulPreferenceCreate") &&
              sym(so, lib.pref_set, "cublasLtMatmulPreferenceSetAttribute") &&
              sym(so, lib.pref_destroy, "cublasLtMatmulPreferenceDestroy") &&
              sym(so, lib.heuristic, "cublasLtMatmulAlgoGetHeuristic") && sym(so, lib.matmul, "cublasLtMatmul") &&
              sym(cuda, lib.alloc_async, "cuMemAllocAsync") && sym(cuda, lib.free_async, "cuMemFreeAsync");
    if (!ok || create(&lib.handle) != 0) {
      error = "libcublasLt/libcuda lack an entry point, or cublasLtCreate failed";
      lib.handle = nullptr;
    }
  });
  TVM_FFI_ICHECK(lib.handle != nullptr) << "relaxtune cuBLASLt GEMM: " << error;
  return &lib;
}

// the descriptors and the heuristic's algorithm for column-major D (n x m) = W (n x k) X (k x m) + C, per shape and
// type
struct LtPlan {
  Handle desc = nullptr, w = nullptr, x = nullptr, y = nullptr;
  LtHeuristic best{};
};

const LtPlan& Plan(Lt* lt, int64_t m, int64_t n, int64_t k, int type, bool nk) {
  static std::mutex mu;
  static std::map<std::vector<int64_t>, LtPlan> plans;
  std::lock_guard<std::mutex> lock(mu);
  LtPlan& plan = plans[{m, n, k, type, nk}];
  if (plan.desc != nullptr) return plan;
  const int trans_w = nk ? kOpT : kOpN;  // W (n x k) row-major: column-major (k x n), ld = k, transposed
  bool ok = lt->desc_create(&plan.desc, kCompute32F, kR32F) == 0 &&
            lt->desc_set(plan.desc, kDescTransA, &trans_w, sizeof(trans_w)) == 0 &&
            (nk ? lt->layout_create(&plan.w, type, k, n, k) : lt->layout_create(&plan.w, type, n, k, n)) == 0 &&
            lt->layout_create(&plan.x, type, k, m, k) == 0 && lt->layout_create(&plan.y, type, n, m, n) == 0;
  Handle pref = nullptr;
  int found = 0;
  ok = ok && lt->pref_create(&pref) == 0 &&
       lt->pref_set(pref, kPrefMaxWorkspace, &kLtWorkspace, sizeof(kLtWorkspace)) == 0 &&
       lt->heuristic(lt->handle, plan.desc, plan.w, plan.x, plan.y, plan.y, pref, 1, &plan.best, &found) == 0 &&
       found > 0;
  if (pref != nullptr) lt->pref_destroy(pref);
  if (!ok) plan.desc = nullptr;
  TVM_FFI_ICHECK(ok) << "cuBLASLt has no algorithm for the GEMM m=" << m << " n=" << n << " k=" << k;
  return plan;
}

void GemmAddLayout(tvm::ffi::TensorView x, tvm::ffi::TensorView w, tvm::ffi::TensorView r, tvm::ffi::TensorView y,
                   bool nk) {
  int64_t k, n, m = 1;
  WeightShape(w, nk, &k, &n);
  TVM_FFI_ICHECK_EQ(x.size(x.ndim() - 1), k) << "x's last dimension must be K";
  for (int i = 0; i + 1 < x.ndim(); ++i) m *= x.size(i);
  TVM_FFI_ICHECK(y.size(y.ndim() - 1) == n && y.numel() == m * n && r.numel() == m * n && r.IsContiguous() &&
                 y.IsContiguous())
      << "gemm_add: r and y must be compact (..., N) tensors of x's rows";
  int type = CublasType(x);
  TVM_FFI_ICHECK(CublasType(w) == type && CublasType(r) == type && CublasType(y) == type) << "gemm_add: mixed dtypes";
  Lt* lt = LoadLt();
  const LtPlan& plan = Plan(lt, m, n, k, type, nk);
  void* stream = TVMFFIEnvGetStream(y.device().device_type, y.device().device_id);
  uint64_t workspace = 0;
  if (plan.best.workspace > 0)
    TVM_FFI_ICHECK_EQ(lt->alloc_async(&workspace, plan.best.workspace, stream), 0) << "cuMemAllocAsync failed";
  float alpha = 1.0f, beta = 1.0f;
  int status =
      lt->matmul(lt->handle, plan.desc, &alpha, Data(w), plan.w, Data(x), plan.x, &beta, Data(r), plan.y, Data(y),
                 plan.y, &plan.best.algo, reinterpret_cast<void*>(workspace), plan.best.workspace, stream);
  if (workspace != 0) lt->free_async(workspace, stream);
  TVM_FFI_ICHECK_EQ(status, 0) << "cublasLtMatmul failed for m=" << m << " n=" << n << " k=" << k;
}

// permute_dims(t, axes) of a compact tensor t, as a strided view (extents and element strides)
struct View {
  std::vector<int64_t> shape, strides;
};

View Permuted(const tvm::ffi::TensorView& t, const tvm::ffi::Shape& axes) {
  int r = t.ndim();
  TVM_FFI_ICHECK(t.IsContiguous()) << "batched gemm: operands must be compact";
  TVM_FFI_ICHECK_EQ(static_cast<int>(axes.size()), r) << "batched gemm: axes do not match the tensor's rank";
  std::vector<int64_t> compact(r, 1);
  for (int i = r - 2; i >= 0; --i) compact[i] = compact[i + 1] * t.size(i + 1);
  View v;
  for (int i = 0; i < r; ++i) {
    int64_t a = axes[i];
    TVM_FFI_ICHECK(a >= 0 && a < r) << "batched gemm: bad axis " << a;
    v.shape.push_back(t.size(a));
    v.strides.push_back(compact[a]);
  }
  return v;
}

// The row-major matrix X (rows x cols, element strides sr, sc) as cuBLAS sees it: column-major
// X^T read directly (op N, ld = sr) when its rows are contiguous, or column-major X transposed
// (op T, ld = sc) when its columns are. False when neither stride is 1.
bool AsTransposed(int64_t rows, int64_t cols, int64_t sr, int64_t sc, int* op, int64_t* ld) {
  if (sc == 1 || cols == 1) {
    *op = kOpN;
    *ld = rows == 1 ? std::max<int64_t>(cols, 1) : sr;
    return *ld >= std::max<int64_t>(cols, 1);
  }
  if (sr == 1 || rows == 1) {
    *op = kOpT;
    *ld = cols == 1 ? std::max<int64_t>(rows, 1) : sc;
    return *ld >= std::max<int64_t>(rows, 1);
  }
  return false;
}

void BatchedGemm(tvm::ffi::TensorView a, tvm::ffi::TensorView b, tvm::ffi::Shape a_axes, tvm::ffi::Shape b_axes,
                 tvm::ffi::Shape c_axes, double alpha, tvm::ffi::TensorView c) {
  View A = Permuted(a, a_axes), B = Permuted(b, b_axes), C = Permuted(c, c_axes);
  int r = static_cast<int>(A.shape.size());
  TVM_FFI_ICHECK(r >= 2 && static_cast<int>(B.shape.size()) == r && static_cast<int>(C.shape.size()) == r)
      << "batched gemm: operands must have the same rank";
  int64_t m = A.shape[r - 2], k = A.shape[r - 1], n = B.shape[r - 1];
  TVM_FFI_ICHECK(B.shape[r - 2] == k && C.shape[r - 2] == m && C.shape[r - 1] == n)
      << "batched gemm: shapes do not match";
  int type = CublasType(a);
  TVM_FFI_ICHECK(CublasType(b) == type && CublasType(c) == type) << "batched gemm: mixed dtypes";
  // row-major C = A B  <=>  column-major C^T = B^T A^T: cuBLAS's first operand is B, its second A
  int op_b, op_a, op_c;
  int64_t ld_b, ld_a, ld_c;
  TVM_FFI_ICHECK(AsTransposed(k, n, B.strides[r - 2], B.strides[r - 1], &op_b, &ld_b))
      << "batched gemm: b has no unit stride";
  TVM_FFI_ICHECK(AsTransposed(m, k, A.strides[r - 2], A.strides[r - 1], &op_a, &ld_a))
      << "batched gemm: a has no unit stride";
  TVM_FFI_ICHECK(AsTransposed(m, n, C.strides[r - 2], C.strides[r - 1], &op_c, &ld_c) && op_c == kOpN)
      << "batched gemm: c's rows must be contiguous";
  // batch dimensions: drop extent 1, merge neighbours whose strides nest in all three operands
  std::vector<int64_t> extent, sa, sb, sc;
  for (int i = 0; i + 2 < r; ++i) {
    TVM_FFI_ICHECK(A.shape[i] == C.shape[i] && B.shape[i] == C.shape[i]) << "batched gemm: batch dimensions differ";
    if (C.shape[i] == 1) continue;
    if (!extent.empty() && sa.back() == A.strides[i] * A.shape[i] && sb.back() == B.strides[i] * B.shape[i] &&
        sc.back() == C.strides[i] * C.shape[i]) {
      extent.back() *= C.shape[i];
      sa.back() = A.strides[i], sb.back() = B.strides[i], sc.back() = C.strides[i];
      continue;
    }
    extent.push_back(C.shape[i]), sa.push_back(A.strides[i]), sb.push_back(B.strides[i]), sc.push_back(C.strides[i]);
  }
  if (extent.empty()) extent.push_back(1), sa.push_back(0), sb.push_back(0), sc.push_back(0);
  for (int64_t v : {m, n, k, ld_a, ld_b, ld_c, extent.back()})
    TVM_FFI_ICHECK_LE(v, INT_MAX) << "batched gemm: too large for cuBLAS";
  Cublas* lib = Load(c.device());
  float alpha32 = static_cast<float>(alpha), beta = 0.0f;
  int64_t outer = 1, bytes = 2;
  for (size_t i = 0; i + 1 < extent.size(); ++i) outer *= extent[i];
  for (int64_t o = 0; o < outer; ++o) {  // batch dimensions that did not merge: one call each
    int64_t off_a = 0, off_b = 0, off_c = 0;
    for (int64_t i = static_cast<int64_t>(extent.size()) - 2, rest = o; i >= 0; --i) {
      int64_t idx = rest % extent[i];
      rest /= extent[i];
      off_a += idx * sa[i], off_b += idx * sb[i], off_c += idx * sc[i];
    }
    int status = lib->gemm_batched(lib->handle, op_b, op_a, static_cast<int>(n), static_cast<int>(m),
                                   static_cast<int>(k), &alpha32, Data(b) + off_b * bytes, type, static_cast<int>(ld_b),
                                   sb.back(), Data(a) + off_a * bytes, type, static_cast<int>(ld_a), sa.back(), &beta,
                                   Data(c) + off_c * bytes, type, static_cast<int>(ld_c), sc.back(),
                                   static_cast<int>(extent.back()), kCompute32F, kGemmDefault);
    TVM_FFI_ICHECK_EQ(status, 0) << "cublasGemmStridedBatchedEx failed for m=" << m << " n=" << n << " k=" << k
                                 << " batch=" << extent.back();
  }
}
}  // namespace

void Gemm(tvm::ffi::TensorView x, tvm::ffi::TensorView w, tvm::ffi::TensorView y) { GemmLayout(x, w, y, false); }
void GemmNk(tvm::ffi::TensorView x, tvm::ffi::TensorView w, tvm::ffi::TensorView y) { GemmLayout(x, w, y, true); }
void GemmAdd(tvm::ffi::TensorView x, tvm::ffi::TensorView w, tvm::ffi::TensorView r, tvm::ffi::TensorView y) {
  GemmAddLayout(x, w, r, y, false);
}
void GemmAddNk(tvm::ffi::TensorView x, tvm::ffi::TensorView w, tvm::ffi::TensorView r, tvm::ffi::TensorView y) {
  GemmAddLayout(x, w, r, y, true);
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_cublas_gemm, Gemm);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_cublas_gemm_nk, GemmNk);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_cublas_gemm_add, GemmAdd);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_cublas_gemm_add_nk, GemmAddNk);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_cublas_batched_gemm, BatchedGemm);
