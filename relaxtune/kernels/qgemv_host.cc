// The host side of the 4-bit decode GEMV (qgemv.cu), appended to gemv_host.cc in one object (kernels/gemv.py):
// it launches through that file's Start (a programmatic dependent launch on compute capability 9.0+) and the
// shared driver code of extern_host.h, on TVM's current stream, with no allocation.
namespace {
struct Q4Params {  // must match qgemv.cu
  const void *x, *w, *scale, *res;
  void* y;
  int rows, k, n, group_shift, sms;
};
constexpr int kQ4MaxRows = 2, kQ4Threads = 256, kQ4BlocksPerSm = 2;

bool IsHalf(const DLDataType& t) { return t.code == kDLFloat && t.bits == 16 && t.lanes == 1; }

// y = x @ W^T (+ r) for W (N, K) in the GPU layout `w` (N, K / 8) uint32 with `scale` (N, K / group) fp16
void LaunchQ4(const tvm::ffi::TensorView& x, const tvm::ffi::TensorView& w, const tvm::ffi::TensorView& scale,
              const tvm::ffi::TensorView* r, const tvm::ffi::TensorView& y) {
  const DLDataType wt = w.dtype();
  TVM_FFI_ICHECK(w.ndim() == 2 && wt.code == kDLUInt && wt.bits == 32 && wt.lanes == 1)
      << "q4gemv: the weight must be (N, K / 8) uint32 (the GPU layout)";
  const int64_t n = w.size(0), k = w.size(1) * 8;
  TVM_FFI_ICHECK(scale.ndim() == 2 && scale.size(0) == n && IsHalf(scale.dtype()) && scale.size(1) > 0)
      << "q4gemv: the scales must be (N, K / group) float16";
  const int64_t group = k / scale.size(1);
  int shift = 0;
  while ((32 << shift) < group) ++shift;
  TVM_FFI_ICHECK(group * scale.size(1) == k && (32 << shift) == group)
      << "q4gemv: K = " << k << " with " << scale.size(1) << " scales per row: the group must be 32 x a power of two";
  TVM_FFI_ICHECK(x.ndim() >= 1 && x.size(x.ndim() - 1) == k && IsHalf(x.dtype())) << "q4gemv: x must be (..., K = " << k << ") float16";
  const int64_t m = x.numel() / k;
  TVM_FFI_ICHECK(IsHalf(y.dtype()) && y.size(y.ndim() - 1) == n && y.numel() == m * n) << "q4gemv: y must be (..., N) float16 with x's rows";
  TVM_FFI_ICHECK(k <= INT32_MAX / 2 && n <= INT32_MAX / 2) << "q4gemv: too large";
  for (const auto* t : {&x, &w, &scale, &y, r}) {
    if (t != nullptr) TVM_FFI_ICHECK(t->IsContiguous()) << "q4gemv: operands must be compact";
  }
  if (r != nullptr) TVM_FFI_ICHECK(IsHalf(r->dtype()) && r->numel() == m * n) << "q4gemv: the residual must be shaped like y";
  TVM_FFI_ICHECK(reinterpret_cast<uintptr_t>(Data(w)) % 16 == 0 && reinterpret_cast<uintptr_t>(Data(x)) % 16 == 0)
      << "q4gemv: the weight and x must be 16-byte aligned";
  if (m == 0 || n == 0) return;
  Driver* d = LoadDriver();
  DLDevice dev = y.device();
  const int sms = Attribute(d, dev.device_id, kMultiprocessors);
  const bool pdl = Attribute(d, dev.device_id, kComputeMajor) >= 9 && ProgrammaticLaunch();
  void* stream = TVMFFIEnvGetStream(dev.device_type, dev.device_id);
  for (int64_t r0 = 0; r0 < m; r0 += kQ4MaxRows) {  // up to 2 rows share one pass over the weights
    const int rows = static_cast<int>(std::min<int64_t>(kQ4MaxRows, m - r0));
    Ptr fn = Kernel(d, relaxtune_gemv_fatbin, dev.device_id, std::string("relaxtune_q4gemv_f16_m") + std::to_string(rows));
    Q4Params p{Data(x) + r0 * k * 2, Data(w), Data(scale), r != nullptr ? Data(*r) + r0 * n * 2 : nullptr,
               Data(y) + r0 * n * 2, rows, static_cast<int>(k), static_cast<int>(n), shift, sms};
    void* args[] = {&p};
    Start(d, fn, static_cast<unsigned>(kQ4BlocksPerSm * sms), 1, kQ4Threads, pdl, stream, args);
  }
}

void Q4Gemv(tvm::ffi::TensorView x, tvm::ffi::TensorView w, tvm::ffi::TensorView s, tvm::ffi::TensorView y) { LaunchQ4(x, w, s, nullptr, y); }
void Q4GemvAdd(tvm::ffi::TensorView x, tvm::ffi::TensorView w, tvm::ffi::TensorView s, tvm::ffi::TensorView r, tvm::ffi::TensorView y) {
  LaunchQ4(x, w, s, &r, y);
}
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_q4gemv, Q4Gemv);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_q4gemv_add, Q4GemvAdd);
