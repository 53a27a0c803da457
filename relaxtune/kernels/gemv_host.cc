#include <tvm/ffi/container/shape.h>

#include <algorithm>
#include <cstdlib>

extern "C" const char relaxtune_gemv_fatbin[];  // the nvcc fatbin, linked in by .incbin below

namespace {
struct Params {  // must match gemv.cu
  const void *x, *w, *res;
  void* y;
  int rows, k, n, k_per_split;
  const void* g;  // the nk RMSNorm prologue's weight, else null
  float eps;
};
struct AttnParams {  // must match gemv_prologue.cu
  const void *q, *k, *v, *cos, *sin;
  int q_row, k_row, v_row, q_head0, k_head0, v_head0, heads, group, causal, rope;
  float scale;
};
constexpr int kCols = 64, kMaxRows = 8, kMaxSplits = 8, kMinRowsPerSplit = 256;
// the nk kernel's features per 512-thread block (16 warps x 2), rows per launch
constexpr int kNkFeatures = 32, kNkMaxRows = 4;
// the nk kernel's x prologues (gemv_prologue.cu's kRmsX, kSwiGluX: their x in dynamic shared memory) and its SwiGLU
// epilogue (GLU): up to 2 rows per launch
enum class Prologue { kNone, kRms, kSwiGlu, kAttention };
constexpr int kNkPrologueMaxRows = 2, kSharedOptin = 97;  // CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
constexpr int kNkStaticShared = 1024;  // more than the prologue kernels' static shared memory (the norm's partial sums)

// RELAXTUNE_GEMV_SPLITS=1|2|4|8 replaces the default split of K (benchmarks/gpu_job.py measures each in the block);
// read per launch
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
int64_t CheckOperands(const char* what, const tvm::ffi::TensorView& x, const tvm::ffi::TensorView& w,
                      const tvm::ffi::TensorView* r, const tvm::ffi::TensorView& y, int64_t k, int64_t n) {
  int64_t m = 1;
  for (int i = 0; i + 1 < x.ndim(); ++i) m *= x.size(i);
  TVM_FFI_ICHECK(x.ndim() >= 1 && x.size(x.ndim() - 1) == k) << what << ": x's last dimension must be K = " << k;
  TVM_FFI_ICHECK(y.size(y.ndim() - 1) == n && y.numel() == m * n) << what << ": y must be (..., N) with x's rows";
  TVM_FFI_ICHECK(k <= INT32_MAX / 2 && n <= INT32_MAX / 2) << what << ": too large";
  DLDataType dt = x.dtype();
  TVM_FFI_ICHECK(dt.bits == 16 && dt.lanes == 1 && (dt.code == kDLFloat || dt.code == kDLBfloat))
      << what << ": fp16 or bf16 only";
  for (const auto* t : {&x, &w, &y, r}) {
    if (t == nullptr) continue;
    TVM_FFI_ICHECK(t->dtype().code == dt.code && t->dtype().bits == 16 && t->dtype().lanes == 1)
        << what << ": mixed dtypes";
    TVM_FFI_ICHECK(t->IsContiguous()) << what << ": operands must be compact";
  }
  TVM_FFI_ICHECK(reinterpret_cast<uintptr_t>(Data(w)) % 16 == 0 && reinterpret_cast<uintptr_t>(Data(x)) % 16 == 0)
      << what << ": the weight and x must be 16-byte aligned";
  if (r != nullptr) TVM_FFI_ICHECK_EQ(r->numel(), m * n) << what << ": the residual must be shaped like y";
  return m;
}

// one launch on `stream` with `shared_bytes` of dynamic shared memory: a plain one, or cuLaunchKernelEx with a
// (1, splits, 1) cluster and/or as a programmatic dependent of the previous kernel (compute capability 9.0+)
void Start(Driver* d, Ptr fn, unsigned blocks, unsigned splits, unsigned threads, bool pdl, void* stream, void** args,
           unsigned shared_bytes = 0) {
  if (splits == 1 && !pdl) {
    Check(d, d->launch(fn, blocks, 1, 1, threads, 1, 1, shared_bytes, stream, args, nullptr), "cuLaunchKernel");
    return;
  }
  LaunchAttribute attrs[2]{};
  unsigned count = 0;
  if (splits > 1) {
    attrs[count].id = kClusterDimension;
    attrs[count].value.cluster.x = 1, attrs[count].value.cluster.y = splits, attrs[count].value.cluster.z = 1;
    ++count;
  }
  if (pdl) {  // the union's first int: allowed = 1
    attrs[count].id = kProgrammaticSerialization, attrs[count].value.cluster.x = 1;
    ++count;
  }
  TVM_FFI_ICHECK(d->launch_ex != nullptr)
      << "gemv: a cluster or programmatic launch needs cuLaunchKernelEx (a CUDA 12+ driver)";
  LaunchConfig config{blocks, splits, 1, threads, 1, 1, shared_bytes, stream, attrs, count};
  Check(d, d->launch_ex(&config, fn, args, nullptr), "cuLaunchKernelEx (cluster / programmatic)");
}

// y = x @ w (+ r); splits: blocks per cluster that share a column tile's K range (0: the default)
void Launch(const tvm::ffi::TensorView& x, const tvm::ffi::TensorView& w, const tvm::ffi::TensorView* r,
            const tvm::ffi::TensorView& y, int64_t splits) {
  TVM_FFI_ICHECK_EQ(w.ndim(), 2) << "gemv: the weight must be (K, N)";
  int64_t k = w.size(0), n = w.size(1);
  TVM_FFI_ICHECK(n % 8 == 0 && k % 8 == 0)
      << "gemv: N = " << n << " and K = " << k << " must be multiples of 8 (16-byte vectors)";
  int64_t m = CheckOperands("gemv", x, w, r, y, k, n);
  DLDataType dt = x.dtype();
  TVM_FFI_ICHECK(splits >= 0 && splits <= kMaxSplits)
      << "gemv: splits " << splits << " (0 = default, 1.." << kMaxSplits << ")";
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
  // a multiple of 8: chunks never straddle blocks
  int k_per_split = static_cast<int>((k + 8 * splits - 1) / (8 * splits) * 8);
  const char* type = dt.code == kDLBfloat ? "bf16" : "f16";
  // a grid that fits the SMs in one wave takes the 512-thread kernel (one block per SM, 16 loads in flight per thread)
  bool wide = major >= 9 && tiles * splits <= static_cast<unsigned>(sms) && WideAllowed();
  bool pdl = major >= 9 && ProgrammaticLaunch();
  void* stream = TVMFFIEnvGetStream(dev.device_type, dev.device_id);
  for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {  // up to 8 rows share one pass over the weights
    int rows = static_cast<int>(std::min<int64_t>(kMaxRows, m - r0));
    int tile = rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : 8;
    bool wide_here = wide && tile <= 2;
    Ptr fn = Kernel(d, relaxtune_gemv_fatbin, dev.device_id,
                    std::string("relaxtune_gemv_") + type + "_m" + std::to_string(tile) + (wide_here ? "_wide" : ""));
    Params p{Data(x) + r0 * k * 2, Data(w), r != nullptr ? Data(*r) + r0 * n * 2 : nullptr, Data(y) + r0 * n * 2,
             rows, static_cast<int>(k), static_cast<int>(n), k_per_split};
    void* args[] = {&p};
    Start(d, fn, tiles, static_cast<unsigned>(splits), wide_here ? 512 : 256, pdl, stream, args);
  }
}

// y = x' @ w^T (+ r) for w (N, K): warps of the "nk" kernel own 2 features each, up to 4 rows of x per launch (2 with a
// prologue or the epilogue). x' is x (kNone), rms_norm(x, g, eps) over K (kRms: g (K,)), or silu(gate) * up for
// x = gate | up (kSwiGlu: x (..., 2K)), computed by each block into its shared memory. glu: w is gate | up (2N, K) and
// y (..., N) = silu(x' @ gate^T) * (x' @ up^T), no residual
void LaunchNk(const tvm::ffi::TensorView& x, const tvm::ffi::TensorView& w, const tvm::ffi::TensorView* r,
              const tvm::ffi::TensorView& y, Prologue prologue = Prologue::kNone,
              const tvm::ffi::TensorView* g = nullptr, double eps = 0.0, bool glu = false,
              const AttnParams* attn = nullptr) {
  const char* what = glu ? (prologue == Prologue::kRms ? "gemv_nk_rms_glu" : "gemv_nk_glu")
                     : prologue == Prologue::kRms  ? "gemv_nk_rms"
                     : prologue == Prologue::kSwiGlu ? "gemv_nk_swiglu"
                     : prologue == Prologue::kAttention ? "gemv_nk_attn"
                                                     : "gemv_nk";
  TVM_FFI_ICHECK_EQ(w.ndim(), 2) << what << ": the weight must be (N, K)";
  TVM_FFI_ICHECK(!glu || (w.size(0) % 2 == 0 && r == nullptr && prologue != Prologue::kSwiGlu))
      << what << ": the weight must be gate | up (2N, K)";
  int64_t n = glu ? w.size(0) / 2 : w.size(0), k = w.size(1);
  TVM_FFI_ICHECK(k % 8 == 0) << what << ": K = " << k << " must be a multiple of 8 (16-byte vectors)";
  const int64_t x_k = prologue == Prologue::kSwiGlu ? 2 * k : k;  // gate | up: K each
  // the attention prologue's x is its own (attn: LaunchNkAttention checked q, k, v), y's rows
  const bool own_x = prologue == Prologue::kAttention;
  int64_t m = own_x ? CheckOperands(what, y, w, r, y, n, n) : CheckOperands(what, x, w, r, y, x_k, n);
  DLDataType dt = x.dtype();
  if (g != nullptr) {
    TVM_FFI_ICHECK(g->ndim() == 1 && g->size(0) == k) << what << ": the norm's weight must be (K,) with K = " << k;
    TVM_FFI_ICHECK(g->dtype().code == dt.code && g->dtype().bits == 16 && g->IsContiguous())
        << what << ": the norm's weight must be compact, of x's dtype";
    TVM_FFI_ICHECK(reinterpret_cast<uintptr_t>(Data(*g)) % 16 == 0)
        << what << ": the norm's weight must be 16-byte aligned";
  }
  if (m == 0 || n == 0) return;
  Driver* d = LoadDriver();
  DLDevice dev = y.device();
  const bool pdl = Attribute(d, dev.device_id, kComputeMajor) >= 9 && ProgrammaticLaunch();
  // a grid of 512-thread blocks that fits the SMs in one wave keeps them; larger ones take 256-thread blocks, two per
  // SM
  const int64_t rows_of_w = glu ? 2 * n : n, per_block = glu ? 1 : 2;  // features per warp (each 2 rows of w)
  const bool narrow =
      (rows_of_w + kNkFeatures - 1) / kNkFeatures > Attribute(d, dev.device_id, kMultiprocessors) || !WideAllowed();
  const unsigned threads = narrow ? 256 : 512;
  const unsigned blocks = static_cast<unsigned>((n + threads / 32 * per_block - 1) / (threads / 32 * per_block));
  const char* type = dt.code == kDLBfloat ? "bf16" : "f16";
  std::string kind = prologue == Prologue::kRms         ? "rms_"
                     : prologue == Prologue::kSwiGlu    ? "swiglu_"
                     : prologue == Prologue::kAttention ? "attn_"
                                                        : "";
  if (glu) kind += "glu_";
  const int max_rows = prologue == Prologue::kNone && !glu ? kNkMaxRows : kNkPrologueMaxRows;
  // the prologue's x: rows x K elements of shared memory; the kernels may take up to the device's opt-in limit
  const int shared_limit =
      prologue == Prologue::kNone ? 0 : Attribute(d, dev.device_id, kSharedOptin) - kNkStaticShared;
  void* stream = TVMFFIEnvGetStream(dev.device_type, dev.device_id);
  for (int64_t r0 = 0; r0 < m; r0 += max_rows) {
    int rows = static_cast<int>(std::min<int64_t>(max_rows, m - r0));
    int tile = rows <= 1 ? 1 : rows <= 2 ? 2 : 4;
    const int64_t shared = prologue == Prologue::kNone ? 0 : tile * k * 2;
    TVM_FFI_ICHECK(shared <= shared_limit)
        << what << ": K = " << k << " needs " << shared << " bytes of shared memory, the GPU allows " << shared_limit;
    Ptr fn = Kernel(
        d, relaxtune_gemv_fatbin, dev.device_id,
        std::string("relaxtune_gemv_nk_") + kind + type + "_m" + std::to_string(tile) + (narrow ? "_narrow" : ""),
        shared_limit);
    Params p{own_x ? nullptr : Data(x) + r0 * x_k * 2,
             Data(w),
             r != nullptr ? Data(*r) + r0 * n * 2 : nullptr,
             Data(y) + r0 * n * 2,
             rows,
             static_cast<int>(k),
             static_cast<int>(n),
             static_cast<int>(k),
             g != nullptr ? Data(*g) : nullptr,
             static_cast<float>(eps)};
    void* args[] = {&p, const_cast<AttnParams*>(attn)};
    Start(d, fn, blocks, 1, threads, pdl, stream, args, static_cast<unsigned>(shared));
  }
}

// the attention of one sequence of up to `max_rows` rows (batch 1) over itself as gemv_prologue.cu's attention_rows
// takes it: heads q_head0.. of q and kv heads k_head0.. / v_head0.. of k and v (each (1, rows, heads of the tensor, D),
// compact, of `dtype`), q (rope 1) or q and k (rope 2) rotated by the cos / sin tables (>= rows, D); its output has
// `features` = query heads x D per row. Puts the rows in `rows`.
AttnParams CheckAttention(const char* what, const tvm::ffi::TensorView& q, const tvm::ffi::TensorView& k,
                          const tvm::ffi::TensorView& v, const tvm::ffi::TensorView& cos,
                          const tvm::ffi::TensorView& sin, const tvm::ffi::Shape& heads, int64_t causal, double scale,
                          int64_t rope, int64_t features, int64_t max_rows, DLDataType dtype, int64_t* rows_out) {
  TVM_FFI_ICHECK_EQ(heads.size(), 4) << what << ": heads must be (q_head0, k_head0, v_head0, kv_heads)";
  for (const auto* t : {&q, &k, &v}) {
    TVM_FFI_ICHECK(t->ndim() == 4 && t->size(0) == 1 && t->IsContiguous())
        << what << ": q, k and v must be compact (1, rows, heads, D)";
    TVM_FFI_ICHECK(t->dtype().code == dtype.code && t->dtype().bits == 16) << what << ": mixed dtypes";
    TVM_FFI_ICHECK(reinterpret_cast<uintptr_t>(Data(*t)) % 16 == 0) << what << ": q, k and v must be 16-byte aligned";
  }
  const int64_t rows = q.size(1), dim = q.size(3), kv_heads = heads[3];
  TVM_FFI_ICHECK(rows <= max_rows && k.size(1) == rows && v.size(1) == rows)
      << what << ": q, k and v must have the same rows, at most " << max_rows << ", not " << rows;
  TVM_FFI_ICHECK((dim == 64 || dim == 128) && k.size(3) == dim && v.size(3) == dim)
      << what << ": head_dim " << dim << " (64 or 128 only)";
  const int64_t query_heads = features / dim;
  TVM_FFI_ICHECK(features % dim == 0 && kv_heads > 0 && query_heads % kv_heads == 0) << what << ": K = " << features
      << " is not a whole number of query heads for " << kv_heads << " kv heads of " << dim;
  TVM_FFI_ICHECK(heads[0] >= 0 && heads[0] + query_heads <= q.size(2) && heads[1] >= 0 &&
                 heads[1] + kv_heads <= k.size(2) && heads[2] >= 0 && heads[2] + kv_heads <= v.size(2))
      << what << ": head range outside q, k or v";
  TVM_FFI_ICHECK(rope >= 0 && rope <= 2) << what << ": rope " << rope << " (0, 1, 2)";
  for (const auto* t : {&cos, &sin}) {
    TVM_FFI_ICHECK(rope == 0 || (t->ndim() == 2 && t->size(0) >= rows && t->size(1) == dim && t->IsContiguous() &&
                                 t->dtype().code == dtype.code && t->dtype().bits == 16 &&
                                 reinterpret_cast<uintptr_t>(Data(*t)) % 16 == 0))
        << what << ": cos/sin must be compact, aligned (>= rows, head_dim) tables of q's dtype";
  }
  auto row = [dim](const tvm::ffi::TensorView& t) { return static_cast<int>(t.size(2) * dim); };
  *rows_out = rows;
  return AttnParams{Data(q),
                    Data(k),
                    Data(v),
                    Data(cos),
                    Data(sin),
                    row(q),
                    row(k),
                    row(v),
                    static_cast<int>(heads[0]),
                    static_cast<int>(heads[1]),
                    static_cast<int>(heads[2]),
                    static_cast<int>(query_heads),
                    static_cast<int>(query_heads / kv_heads),
                    causal ? 1 : 0,
                    static_cast<int>(rope),
                    static_cast<float>(scale)};
}

// y = attention(q, k, v) @ w^T (+ r) for up to 2 rows (CheckAttention), computed by each block (gemv_prologue.cu's
// kAttnX) as x
void LaunchNkAttention(const tvm::ffi::TensorView& q, const tvm::ffi::TensorView& k, const tvm::ffi::TensorView& v,
                       const tvm::ffi::TensorView& cos, const tvm::ffi::TensorView& sin, const tvm::ffi::Shape& heads,
                       int64_t causal, double scale, int64_t rope, const tvm::ffi::TensorView& w,
                       const tvm::ffi::TensorView* r, const tvm::ffi::TensorView& y) {
  TVM_FFI_ICHECK_EQ(w.ndim(), 2) << "gemv_nk_attn: the weight must be (N, K)";
  int64_t rows = 0;
  const AttnParams a = CheckAttention("gemv_nk_attn", q, k, v, cos, sin, heads, causal, scale, rope, w.size(1),
                                      kNkPrologueMaxRows, y.dtype(), &rows);
  TVM_FFI_ICHECK_EQ(y.numel(), rows * w.size(0)) << "gemv_nk_attn: y must be (..., N) with q's rows";
  LaunchNk(q, w, r, y, Prologue::kAttention, nullptr, 0.0, false, &a);
}

void Gemv(tvm::ffi::TensorView x, tvm::ffi::TensorView w, tvm::ffi::TensorView y) { Launch(x, w, nullptr, y, 0); }
void GemvNk(tvm::ffi::TensorView x, tvm::ffi::TensorView w, tvm::ffi::TensorView y) { LaunchNk(x, w, nullptr, y); }
void GemvNkAdd(tvm::ffi::TensorView x, tvm::ffi::TensorView w, tvm::ffi::TensorView r, tvm::ffi::TensorView y) {
  LaunchNk(x, w, &r, y);
}
void GemvNkRms(tvm::ffi::TensorView x, tvm::ffi::TensorView g, tvm::ffi::TensorView w, double eps,
               tvm::ffi::TensorView y) {
  LaunchNk(x, w, nullptr, y, Prologue::kRms, &g, eps);
}
void GemvNkGlu(tvm::ffi::TensorView x, tvm::ffi::TensorView w, tvm::ffi::TensorView y) {
  LaunchNk(x, w, nullptr, y, Prologue::kNone, nullptr, 0.0, true);
}
void GemvNkRmsGlu(tvm::ffi::TensorView x, tvm::ffi::TensorView g, tvm::ffi::TensorView w, double eps,
                  tvm::ffi::TensorView y) {
  LaunchNk(x, w, nullptr, y, Prologue::kRms, &g, eps, true);
}
void GemvNkSwiGlu(tvm::ffi::TensorView gu, tvm::ffi::TensorView w, tvm::ffi::TensorView y) {
  LaunchNk(gu, w, nullptr, y, Prologue::kSwiGlu);
}
void GemvNkSwiGluAdd(tvm::ffi::TensorView gu, tvm::ffi::TensorView w, tvm::ffi::TensorView r, tvm::ffi::TensorView y) {
  LaunchNk(gu, w, &r, y, Prologue::kSwiGlu);
}
void GemvNkAttn(tvm::ffi::TensorView q, tvm::ffi::TensorView k, tvm::ffi::TensorView v, tvm::ffi::TensorView cos,
                tvm::ffi::TensorView sin, tvm::ffi::Shape heads, int64_t causal, double scale, int64_t rope,
                tvm::ffi::TensorView w, tvm::ffi::TensorView y) {
  LaunchNkAttention(q, k, v, cos, sin, heads, causal, scale, rope, w, nullptr, y);
}
void GemvNkAttnAdd(tvm::ffi::TensorView q, tvm::ffi::TensorView k, tvm::ffi::TensorView v, tvm::ffi::TensorView cos,
                   tvm::ffi::TensorView sin, tvm::ffi::Shape heads, int64_t causal, double scale, int64_t rope,
                   tvm::ffi::TensorView w, tvm::ffi::TensorView r, tvm::ffi::TensorView y) {
  LaunchNkAttention(q, k, v, cos, sin, heads, causal, scale, rope, w, &r, y);
}
void GemvAdd(tvm::ffi::TensorView x, tvm::ffi::TensorView w, tvm::ffi::TensorView r, tvm::ffi::TensorView y) {
  Launch(x, w, &r, y, 0);
}
void GemvConfig(tvm::ffi::TensorView x, tvm::ffi::TensorView w, int64_t splits, tvm::ffi::TensorView y) {
  Launch(x, w, nullptr, y, splits);
}
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_gemv, Gemv);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_gemv_add, GemvAdd);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_gemv_config, GemvConfig);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_gemv_nk, GemvNk);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_gemv_nk_add, GemvNkAdd);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_gemv_nk_rms, GemvNkRms);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_gemv_nk_glu, GemvNkGlu);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_gemv_nk_rms_glu, GemvNkRmsGlu);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_gemv_nk_swiglu, GemvNkSwiGlu);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_gemv_nk_swiglu_add, GemvNkSwiGluAdd);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_gemv_nk_attn, GemvNkAttn);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_gemv_nk_attn_add, GemvNkAttnAdd);
