// The host side of the 4-bit decode GEMV (qgemv.cu, qgemv_stream.cu), appended to gemv_host.cc in one object
// (kernels/gemv.py): it launches through that file's Start (a programmatic dependent launch on compute capability
// 9.0+) and the shared driver code of extern_host.h, on TVM's current stream, with no allocation.
// The kernel: the first family of kQ4DefaultFamily, or of RELAXTUNE_Q4GEMV (read per launch, for measurements:
// benchmarks/qgemv_sweep.py), that applies, a comma-separated list of reg|s2r4|s2r8|s2r2|s3r2|s1r8; qgemv.cu's
// register kernel ("reg") where none does. A streamed family (qgemv_stream.cu) does not apply on compute capability
// < 9.0, where K / group is not a multiple of 8, the scales are not 16-byte aligned, K is above its pieces, or a ring
// of 2 slots does not fit. RELAXTUNE_Q4GEMV_STAGES=N caps its ring (default kQ4DefaultStages; 0: no cap).
// relaxtune_q4gemv_i8 / _i8_add: the same with int8 activations where a streamed kernel applies (the i8 families,
// default kQ4DefaultInt8Family), the fp16 register kernel elsewhere; RELAXTUNE_Q4GEMV overrides both defaults.
#include <vector>

namespace {
constexpr const char* kQ4DefaultFamily = "s2r4";  // the kernel families the artifacts use: one line to change
constexpr const char* kQ4DefaultInt8Family = "i8s2r8,i8s2r4";  // with int8 activations: the first that applies
// the ring's default cap: 2 slots measured 2-6% faster than the deepest ring on the 7B shapes (H200, 1 and 2 rows;
// docs/results.md "GPU 4-bit weights (q4f16)")
constexpr int kQ4DefaultStages = 2;

struct Q4StreamArgs {  // must match qgemv_stream.cu's Q4StreamParams
  const void *x, *w, *scale, *res;
  void* y;
  int rows, k, n, group_shift, stages;
  const void* g;
  float eps;
};
struct Q4StreamKernel {
  const char* family;
  int groups, rows_per_group, pieces;  // GR, RPG, PMAX of qgemv_stream.cu
};
// qgemv_stream.cu's instantiations relaxtune_q4gemv_s<GR>r<RPG>p<PMAX>_m1 / _m2, fewest pieces first
constexpr Q4StreamKernel kQ4StreamKernels[] = {{"s2r4", 2, 4, 1}, {"s2r4", 2, 4, 3}, {"s2r8", 2, 8, 1},
                                               {"s2r2", 2, 2, 3}, {"s3r2", 3, 2, 1}, {"s1r8", 1, 8, 1},
                                               {"s1r8", 1, 8, 3}, {"i8s2r4", 2, 4, 1}, {"i8s2r4", 2, 4, 3},
                                               {"i8s2r8", 2, 8, 1}, {"i8s1r8", 1, 8, 1}, {"i8s1r8", 1, 8, 3}};
constexpr int kQ4PieceThreads = 256, kQ4PieceWeights = 16, kQ4BarrierBytes = 1024, kQ4MaxStages = 64;
constexpr int kQ4ScratchBytes = 256;  // qgemv_stream.cu's
// x prologues (qgemv_stream.cu's P, gemv_prologue.cu's kinds): kernels with one exist for int8 activations in the
// default int8 families only (relaxtune_q4gemv_i8s2r8p1_rms_m1, ...)
enum { kQ4PlainX = 0, kQ4RmsX = 1 };
constexpr int kMaxSharedOptIn = 97;  // CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN

std::string Q4Family(bool int8) {
  const char* value = std::getenv("RELAXTUNE_Q4GEMV");
  if (value != nullptr && value[0] != '\0') return std::string(value);
  return std::string(int8 ? kQ4DefaultInt8Family : kQ4DefaultFamily);
}

int Q4ForcedStages() {
  const char* value = std::getenv("RELAXTUNE_Q4GEMV_STAGES");  // 0: as deep as shared memory allows
  return value != nullptr && value[0] != '\0' ? std::atoi(value) : kQ4DefaultStages;
}

struct Q4StreamPlan {
  std::string name;  // without the _m1 / _m2 suffix
  int blocks = 0, threads = 0, stages = 0, shared_bytes = 0;
};

// the streamed kernel of `family` for this product, or false where it does not apply (then: qgemv.cu's)
bool PlanQ4Stream(const std::string& family, int64_t k, int64_t n, int shift, const void* scale, int major, int sms,
                  int shared_limit, int tile_rows, Q4StreamPlan* plan) {
  const int64_t groups = k >> (5 + shift), pieces = (k / kQ4PieceWeights + kQ4PieceThreads - 1) / kQ4PieceThreads;
  if (major < 9 || groups % 8 != 0 || reinterpret_cast<uintptr_t>(scale) % 16 != 0) return false;
  const Q4StreamKernel* kernel = nullptr;
  for (const auto& candidate : kQ4StreamKernels) {
    if (family == candidate.family && candidate.pieces >= pieces) {
      kernel = &candidate;
      break;
    }
  }
  if (kernel == nullptr) return false;
  const int64_t blocks = std::min<int64_t>(sms, n), rows = (n + blocks - 1) / blocks;
  const int64_t slot_rows = kernel->groups * kernel->rows_per_group;
  const int64_t slot_bytes = slot_rows * (k / 2 + 2 * groups), partial_bytes = rows * tile_rows * 8 * 4;
  int64_t stages = std::min<int64_t>({kQ4MaxStages, (rows + slot_rows - 1) / slot_rows,
                                      (shared_limit - kQ4BarrierBytes - partial_bytes - kQ4ScratchBytes) / slot_bytes});
  if (Q4ForcedStages() > 0) stages = std::min<int64_t>(stages, Q4ForcedStages());
  if (stages < std::min<int64_t>(2, (rows + slot_rows - 1) / slot_rows)) return false;
  plan->name = std::string("relaxtune_q4gemv_") + family + "p" + std::to_string(kernel->pieces);
  plan->blocks = static_cast<int>(blocks), plan->threads = kQ4PieceThreads * kernel->groups + 32;
  plan->stages = static_cast<int>(stages);
  plan->shared_bytes = static_cast<int>(kQ4BarrierBytes + stages * slot_bytes + partial_bytes + kQ4ScratchBytes);
  return true;
}

struct Q4Params {  // must match qgemv.cu
  const void *x, *w, *scale, *res;
  void* y;
  int rows, k, n, group_shift, sms;
};
constexpr int kQ4MaxRows = 2, kQ4Threads = 256, kQ4BlocksPerSm = 2;

bool IsHalf(const DLDataType& t) { return t.code == kDLFloat && t.bits == 16 && t.lanes == 1; }

struct Q4Weight {
  int64_t n, k;
  int shift;  // group = 32 << shift weights per scale
};

// the (N, K / 8) uint32 weight `w` in the GPU layout and its (N, K / group) fp16 scales (messages prefixed `what`)
Q4Weight CheckQ4Weight(const char* what, const tvm::ffi::TensorView& w, const tvm::ffi::TensorView& scale) {
  const DLDataType wt = w.dtype();
  TVM_FFI_ICHECK(w.ndim() == 2 && wt.code == kDLUInt && wt.bits == 32 && wt.lanes == 1)
      << what << ": the weight must be (N, K / 8) uint32 (the GPU layout)";
  const int64_t n = w.size(0), k = w.size(1) * 8;
  TVM_FFI_ICHECK(scale.ndim() == 2 && scale.size(0) == n && IsHalf(scale.dtype()) && scale.size(1) > 0)
      << what << ": the scales must be (N, K / group) float16";
  const int64_t group = k / scale.size(1);
  int shift = 0;
  while ((32 << shift) < group) ++shift;
  TVM_FFI_ICHECK(group * scale.size(1) == k && (32 << shift) == group)
      << what << ": K = " << k << " with " << scale.size(1) << " scales per row: the group must be 32 x a power of two";
  TVM_FFI_ICHECK(w.IsContiguous() && scale.IsContiguous()) << what << ": operands must be compact";
  return {n, k, shift};
}

// y = x @ W^T (+ r) for W (N, K) in the GPU layout `w` (N, K / 8) uint32 with `scale` (N, K / group) fp16; with
// `chosen`, nothing is launched: the first launch's kernel name is put there (for tests and measurements)
void LaunchQ4(const tvm::ffi::TensorView& x, const tvm::ffi::TensorView& w, const tvm::ffi::TensorView& scale,
              const tvm::ffi::TensorView* r, const tvm::ffi::TensorView& y, bool int8,
              std::string* chosen = nullptr, int prologue = kQ4PlainX, const tvm::ffi::TensorView* g = nullptr,
              double eps = 0.0) {
  const Q4Weight q = CheckQ4Weight("q4gemv", w, scale);
  const int64_t n = q.n, k = q.k;
  const int shift = q.shift;
  TVM_FFI_ICHECK(x.ndim() >= 1 && x.size(x.ndim() - 1) == k && IsHalf(x.dtype()))
      << "q4gemv: x must be (..., K = " << k << ") float16";
  const int64_t m = x.numel() / k;
  if (prologue == kQ4RmsX) {
    TVM_FFI_ICHECK(g != nullptr && g->ndim() == 1 && g->size(0) == k && IsHalf(g->dtype()) && g->IsContiguous() &&
                   reinterpret_cast<uintptr_t>(Data(*g)) % 16 == 0)
        << "q4gemv: the norm's weight must be (K = " << k << ") float16, 16-byte aligned";
  }
  TVM_FFI_ICHECK(IsHalf(y.dtype()) && y.size(y.ndim() - 1) == n && y.numel() == m * n)
      << "q4gemv: y must be (..., N) float16 with x's rows";
  TVM_FFI_ICHECK(k <= INT32_MAX / 2 && n <= INT32_MAX / 2) << "q4gemv: too large";
  for (const auto* t : {&x, &y, r}) {  // the weight and its scales: CheckQ4Weight
    if (t != nullptr) TVM_FFI_ICHECK(t->IsContiguous()) << "q4gemv: operands must be compact";
  }
  if (r != nullptr)
    TVM_FFI_ICHECK(IsHalf(r->dtype()) && r->numel() == m * n) << "q4gemv: the residual must be shaped like y";
  TVM_FFI_ICHECK(reinterpret_cast<uintptr_t>(Data(w)) % 16 == 0 && reinterpret_cast<uintptr_t>(Data(x)) % 16 == 0)
      << "q4gemv: the weight and x must be 16-byte aligned";
  if (m == 0 || n == 0) return;
  Driver* d = LoadDriver();
  DLDevice dev = y.device();
  const int sms = Attribute(d, dev.device_id, kMultiprocessors), major = Attribute(d, dev.device_id, kComputeMajor);
  const bool pdl = major >= 9 && ProgrammaticLaunch();
  void* stream = TVMFFIEnvGetStream(dev.device_type, dev.device_id);
  std::vector<std::string> families;  // in order of preference, up to the first "reg"
  // a prologue exists in the default int8 families only
  for (std::string rest = prologue != kQ4PlainX ? kQ4DefaultInt8Family : Q4Family(int8); !rest.empty();) {
    const size_t comma = rest.find(',');
    families.push_back(rest.substr(0, comma));
    rest = comma == std::string::npos ? std::string() : rest.substr(comma + 1);
  }
  for (int64_t r0 = 0; r0 < m; r0 += kQ4MaxRows) {  // up to 2 rows share one pass over the weights
    const int rows = static_cast<int>(std::min<int64_t>(kQ4MaxRows, m - r0));
    Q4StreamPlan plan;
    bool streamed = false;
    for (const std::string& family : families) {
      if (family == "reg") break;
      streamed = PlanQ4Stream(family, k, n, shift, Data(scale), major, sms,
                              Attribute(d, dev.device_id, kMaxSharedOptIn), rows, &plan);
      if (streamed) break;
    }
    TVM_FFI_ICHECK(streamed || prologue == kQ4PlainX)
        << "q4gemv: no streamed kernel takes this product's prologue (K = " << k << ", compute capability " << major
        << "): it needs compute capability 9.0+, K / group a multiple of 8 and K <= 12288";
    if (streamed) {
      const char* suffix = prologue == kQ4RmsX ? "_rms" : "";
      const std::string name = plan.name + suffix + "_m" + std::to_string(rows);
      if (chosen != nullptr) {
        *chosen = name;
        return;
      }
      Ptr fn = Kernel(d, relaxtune_gemv_fatbin, dev.device_id, name, Attribute(d, dev.device_id, kMaxSharedOptIn));
      Q4StreamArgs p{Data(x) + r0 * k * 2, Data(w), Data(scale), r != nullptr ? Data(*r) + r0 * n * 2 : nullptr,
                     Data(y) + r0 * n * 2, rows, static_cast<int>(k), static_cast<int>(n), shift, plan.stages,
                     g != nullptr ? Data(*g) : nullptr, static_cast<float>(eps)};
      void* args[] = {&p};
      Start(d, fn, static_cast<unsigned>(plan.blocks), 1, static_cast<unsigned>(plan.threads), pdl, stream, args,
            static_cast<unsigned>(plan.shared_bytes));
      continue;
    }
    const std::string name = std::string("relaxtune_q4gemv_f16_m") + std::to_string(rows);
    if (chosen != nullptr) {
      *chosen = name;
      return;
    }
    Ptr fn = Kernel(d, relaxtune_gemv_fatbin, dev.device_id, name);
    Q4Params p{Data(x) + r0 * k * 2, Data(w), Data(scale), r != nullptr ? Data(*r) + r0 * n * 2 : nullptr,
               Data(y) + r0 * n * 2, rows, static_cast<int>(k), static_cast<int>(n), shift, sms};
    void* args[] = {&p};
    Start(d, fn, static_cast<unsigned>(kQ4BlocksPerSm * sms), 1, kQ4Threads, pdl, stream, args);
  }
}

void Q4Gemv(tvm::ffi::TensorView x, tvm::ffi::TensorView w, tvm::ffi::TensorView s, tvm::ffi::TensorView y) {
  LaunchQ4(x, w, s, nullptr, y, false);
}
void Q4GemvAdd(tvm::ffi::TensorView x, tvm::ffi::TensorView w, tvm::ffi::TensorView s, tvm::ffi::TensorView r,
               tvm::ffi::TensorView y) {
  LaunchQ4(x, w, s, &r, y, false);
}
void Q4GemvI8(tvm::ffi::TensorView x, tvm::ffi::TensorView w, tvm::ffi::TensorView s, tvm::ffi::TensorView y) {
  LaunchQ4(x, w, s, nullptr, y, true);
}
void Q4GemvI8Add(tvm::ffi::TensorView x, tvm::ffi::TensorView w, tvm::ffi::TensorView s, tvm::ffi::TensorView r,
                 tvm::ffi::TensorView y) {
  LaunchQ4(x, w, s, &r, y, true);
}
// with int8 activations and the RMSNorm as x's prologue: y = rms_norm(x, g, eps) @ W^T
void Q4GemvI8Rms(tvm::ffi::TensorView x, tvm::ffi::TensorView g, tvm::ffi::TensorView w, tvm::ffi::TensorView s,
                 double eps, tvm::ffi::TensorView y) {
  LaunchQ4(x, w, s, nullptr, y, true, nullptr, kQ4RmsX, &g, eps);
}
// the kernel relaxtune_q4gemv(x, w, s, y) (int8: relaxtune_q4gemv_i8) would launch first, under the current settings
std::string ChosenQ4(tvm::ffi::TensorView x, tvm::ffi::TensorView w, tvm::ffi::TensorView s, tvm::ffi::TensorView y,
                     bool int8) {
  std::string chosen;
  LaunchQ4(x, w, s, nullptr, y, int8, &chosen);
  return chosen;
}
std::string Q4GemvKernel(tvm::ffi::TensorView x, tvm::ffi::TensorView w, tvm::ffi::TensorView s,
                         tvm::ffi::TensorView y) {
  return ChosenQ4(x, w, s, y, false);
}
std::string Q4GemvI8Kernel(tvm::ffi::TensorView x, tvm::ffi::TensorView w, tvm::ffi::TensorView s,
                           tvm::ffi::TensorView y) {
  return ChosenQ4(x, w, s, y, true);
}
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_q4gemv, Q4Gemv);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_q4gemv_add, Q4GemvAdd);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_q4gemv_i8, Q4GemvI8);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_q4gemv_i8_add, Q4GemvI8Add);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_q4gemv_i8_rms, Q4GemvI8Rms);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_q4gemv_kernel, Q4GemvKernel);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_q4gemv_i8_kernel, Q4GemvI8Kernel);
