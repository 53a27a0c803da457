#include <tvm/ffi/container/shape.h>

#include <algorithm>
#include <climits>
#include <cmath>

extern "C" const char relaxtune_flash_fatbin[];  // the nvcc fatbin, linked in by .incbin below

namespace {
struct Params {  // must match flash_attention.cu
  const void *q, *k, *v, *cos, *sin;
  void* o;
  long long q_batch, k_batch, v_batch, o_batch;
  int q_row, k_row, v_row, o_row;
  int q_head0, k_head0, v_head0;
  int n, m, group, causal;
  float scale_log2;
  int rope_k;
  const int *q_indptr, *kv_indptr;  // ragged (the mma.sync kernel only): null here but in RaggedPrefill
  float* lse;
};

constexpr int kBlockN = 64;
// the default configuration, measured on an H200 (benchmarks/flash_check.py, 7B shapes): 64 query rows per block
// were as fast as 128 or faster at n = 128, 512 and 2048 (11.2 / 25.6 / 224 us against 16.2 / 31.8 / 223 us),
// and one K/V buffer each (48 KB of shared memory: more blocks per SM) beat two for the 7B block's call at
// n = 2048 (q, v in place, q rotated: 217 us against 239 us; 128 rows: 249 / 247 us)
constexpr int kBlockM = 64;
constexpr int kStages = 1;  // K/V buffers per block (flash_attention.cu); relaxtune_flash_attention_config picks any
// on compute capability 9.0, from kSm90MinRows query rows on: the warp-specialized wgmma kernel with ping-pong
// (flash_attention_sm90_ws.cu, 128 query rows, 64 key rows per tile), measured on an H200 for the 7B block's
// call at n = 2048 (q, v in place, q rotated): 89.1 us, without ping-pong 89.7, the two-warpgroup kernel
// (flash_attention_sm90.cu) 107-108 with 64 or 128 key rows, the mma.sync kernel 215
constexpr int kSm90MinRows = 256;
constexpr int kSm90BlockN = 64;
constexpr int kSm90 = 90;  // block_m value that asks for that kernel


// whether `device` is compute capability 9.0 (the fatbin's sm_90a code runs there), cached per device
bool IsSm90(Driver* d, int device) {
  return Attribute(d, device, kComputeMajor) == 9 && Attribute(d, device, kComputeMinor) == 0;
}

// the float type of q, checked: fp16 or bf16, and k, v and o of the same (`what` names the caller in the errors)
DLDataType HalfType(const char* what, const tvm::ffi::TensorView& q, const tvm::ffi::TensorView& k,
                    const tvm::ffi::TensorView& v, const tvm::ffi::TensorView& o) {
  DLDataType dt = q.dtype();
  TVM_FFI_ICHECK(dt.bits == 16 && dt.lanes == 1 && (dt.code == kDLFloat || dt.code == kDLBfloat))
      << what << ": fp16 or bf16 only";
  for (const auto* t : {&k, &v, &o}) {
    TVM_FFI_ICHECK(t->dtype().code == dt.code && t->dtype().bits == 16) << what << ": mixed dtypes";
  }
  return dt;
}

// the mma.sync kernel of `block_m` query rows and `stages` K/V buffers (128 threads), over a grid (query blocks, heads,
// batch) on TVM's current stream
void LaunchMmaSync(Driver* d, DLDevice dev, const char* type, int64_t dim, int64_t block_m, int64_t stages,
                   unsigned blocks, int64_t heads, int64_t batch, void** args) {
  int smem = static_cast<int>((block_m + 2 * stages * kBlockN) * dim * 2);
  std::string name = std::string("relaxtune_flash_") + type + "_d" + std::to_string(dim) + "_m" +
                     std::to_string(block_m) + (stages == 1 ? "_s1" : "");
  Ptr fn = Kernel(d, relaxtune_flash_fatbin, dev.device_id, name, smem);
  Check(d, d->launch(fn, blocks, static_cast<unsigned>(heads), static_cast<unsigned>(batch), 128, 1, 1, smem,
                     TVMFFIEnvGetStream(dev.device_type, dev.device_id), args, nullptr), "cuLaunchKernel");
}

// o (b, n, heads, d) = attention of heads q_head0.. of q, kv heads k_head0.. of k and v_head0.. of v
// (each (b, rows, heads of the tensor, d), compact); cos/sin: (>= n, d) tables to rotate q with, or null
void Launch(const tvm::ffi::TensorView& q, const tvm::ffi::TensorView& k, const tvm::ffi::TensorView& v,
            const tvm::ffi::TensorView* cos, const tvm::ffi::TensorView* sin, int64_t q_head0, int64_t k_head0,
            int64_t v_head0, int64_t kv_heads, int64_t causal, double scale, int64_t block_m,
            const tvm::ffi::TensorView& o, int64_t stages = kStages, bool rope_k = false) {
  for (const auto* t : {&q, &k, &v, &o}) {
    TVM_FFI_ICHECK_EQ(t->ndim(), 4) << "flash attention: q, k, v and out must be (batch, rows, heads, head_dim)";
    TVM_FFI_ICHECK(t->IsContiguous()) << "flash attention: operands must be compact";
  }
  DLDataType dt = HalfType("flash attention", q, k, v, o);
  int64_t b = o.size(0), n = o.size(1), heads = o.size(2), dim = o.size(3), m = k.size(1);
  TVM_FFI_ICHECK(dim == 64 || dim == 128) << "flash attention: head_dim " << dim << " (64 or 128 only)";
  TVM_FFI_ICHECK(q.size(0) == b && k.size(0) == b && v.size(0) == b && q.size(1) == n && v.size(1) == m)
      << "flash attention: batch or row counts of q, k, v and out differ";
  TVM_FFI_ICHECK(q.size(3) == dim && k.size(3) == dim && v.size(3) == dim) << "flash attention: head_dim differs";
  TVM_FFI_ICHECK(kv_heads > 0 && heads % kv_heads == 0)
      << "flash attention: " << heads << " query heads for " << kv_heads << " kv heads";
  TVM_FFI_ICHECK(q_head0 >= 0 && q_head0 + heads <= q.size(2) && k_head0 >= 0 && k_head0 + kv_heads <= k.size(2) &&
                 v_head0 >= 0 && v_head0 + kv_heads <= v.size(2))
      << "flash attention: head range outside q, k or v";
  if (cos != nullptr) {
    for (const auto* t : {cos, sin}) {
      TVM_FFI_ICHECK(t->ndim() == 2 && t->size(0) >= n && t->size(1) == dim && t->IsContiguous() &&
                     t->dtype().code == dt.code && t->dtype().bits == 16)
          << "flash attention: cos/sin must be compact (>= n, head_dim) tables of q's dtype";
      TVM_FFI_ICHECK(!rope_k || t->size(0) >= m) << "flash attention: rotating k needs tables of >= m rows";
    }
  }
  TVM_FFI_ICHECK(n * q.size(2) * dim <= INT_MAX && m * std::max(k.size(2), v.size(2)) * dim <= INT_MAX &&
                 heads <= 65535 && b <= 65535)
      << "flash attention: too large";
  if (b == 0 || n == 0) return;
  TVM_FFI_ICHECK(m > 0) << "flash attention: no keys";
  Driver* d = LoadDriver();
  DLDevice dev = o.device();
  // block_m 0: the warp-specialized wgmma kernel on compute capability 9.0 from kSm90MinRows query rows, else 64 rows
  // of the mma.sync one. The config entry point: stages 0 = the two-warpgroup wgmma kernel, 3 = the warp-specialized
  // one, 4 = that with ping-pong, block_m then their key rows per tile (64 or 128; 64 for 3 and 4)
  bool hopper = block_m == kSm90 || (block_m == 0 && !rope_k && n >= kSm90MinRows && IsSm90(d, dev.device_id));
  bool ws = stages == 3 || stages == 4 || hopper, pingpong = stages == 4 || hopper;
  bool sm90 = stages == 0 || ws;
  TVM_FFI_ICHECK(!rope_k || !sm90)
      << "flash attention: k rotated on load needs the mma.sync kernel (block_m 0, 64 or 128, n < " << kSm90MinRows
      << ")";
  TVM_FFI_ICHECK(!sm90 || IsSm90(d, dev.device_id)) << "flash attention: the wgmma kernels need compute capability 9.0";
  int64_t block_n = hopper ? kSm90BlockN : block_m;
  TVM_FFI_ICHECK(!ws || block_n == 64) << "flash attention: the warp-specialized kernel has 64 key rows per tile, not "
                                       << block_n;
  if (sm90) block_m = 128, stages = 2;
  if (block_m == 0) block_m = kBlockM;
  TVM_FFI_ICHECK(block_m == 64 || block_m == 128)
      << "flash attention: block_m " << block_m << " (0, 64, 128 or " << kSm90 << ")";
  TVM_FFI_ICHECK(stages == 1 || stages == 2) << "flash attention: stages " << stages << " (0, 1, 2, 3 or 4)";
  TVM_FFI_ICHECK(!sm90 || block_n == 64 || block_n == 128)
      << "flash attention: wgmma key rows " << block_n << " (64 or 128)";
  auto row = [dim](const tvm::ffi::TensorView& t) { return static_cast<int>(t.size(2) * dim); };
  Params p{Data(q), Data(k), Data(v), cos ? Data(*cos) : nullptr, sin ? Data(*sin) : nullptr, Data(o),
           n * row(q), m * row(k), m * row(v), n * row(o), row(q), row(k), row(v), row(o),
           static_cast<int>(q_head0), static_cast<int>(k_head0), static_cast<int>(v_head0),
           static_cast<int>(n), static_cast<int>(m), static_cast<int>(heads / kv_heads), causal ? 1 : 0,
           static_cast<float>(scale * 1.4426950408889634), rope_k ? 1 : 0};
  const char* type = dt.code == kDLBfloat ? "bf16" : "f16";
  void* args[] = {&p};
  unsigned blocks = static_cast<unsigned>((n + block_m - 1) / block_m);
  void* stream = TVMFFIEnvGetStream(dev.device_type, dev.device_id);
  if (ws) {  // 384 threads: two consumer warpgroups, one producer warpgroup; Q, three K/V stages, six mbarriers
    int smem = static_cast<int>((block_m + 6 * block_n) * dim * 2 + 1024 + 64);
    std::string name = std::string("relaxtune_flash_ws_") + type + "_d" + std::to_string(dim) + "_n" +
                       std::to_string(block_n) + (pingpong ? "_pp" : "");
    Ptr fn = Kernel(d, relaxtune_flash_fatbin, dev.device_id, name, smem);
    Check(d,
          d->launch(fn, static_cast<unsigned>(heads), blocks, static_cast<unsigned>(b), 384, 1, 1, smem, stream, args,
                    nullptr),
          "cuLaunchKernel");
    return;
  }
  if (sm90) {  // 256 threads; grid (heads, query blocks, batch): every head's longest causal blocks start first
    // Q, two K and two V buffers, 1024-byte alignment
    int smem = static_cast<int>((block_m + 4 * block_n) * dim * 2 + 1024);
    std::string name =
        std::string("relaxtune_flash_sm90_") + type + "_d" + std::to_string(dim) + "_n" + std::to_string(block_n);
    Ptr fn = Kernel(d, relaxtune_flash_fatbin, dev.device_id, name, smem);
    Check(d,
          d->launch(fn, static_cast<unsigned>(heads), blocks, static_cast<unsigned>(b), 256, 1, 1, smem, stream, args,
                    nullptr),
          "cuLaunchKernel");
    return;
  }
  LaunchMmaSync(d, dev, type, dim, block_m, stages, blocks, heads, b, args);
}

int64_t At(const tvm::ffi::Shape& s, int i) {
  TVM_FFI_ICHECK_EQ(s.size(), 4) << "flash attention: heads must be (q_head0, k_head0, v_head0, kv_heads)";
  return s[i];
}

void Plain(tvm::ffi::TensorView q, tvm::ffi::TensorView k, tvm::ffi::TensorView v, int64_t causal, double scale,
           int64_t block_m, tvm::ffi::TensorView o) {
  Launch(q, k, v, nullptr, nullptr, 0, 0, 0, k.size(2), causal, scale, block_m, o);
}

void InPlace(tvm::ffi::TensorView q, tvm::ffi::TensorView k, tvm::ffi::TensorView v, tvm::ffi::Shape heads,
             int64_t causal, double scale, int64_t block_m, tvm::ffi::TensorView o) {
  Launch(q, k, v, nullptr, nullptr, At(heads, 0), At(heads, 1), At(heads, 2), At(heads, 3), causal, scale, block_m, o);
}

void Rope(tvm::ffi::TensorView q, tvm::ffi::TensorView k, tvm::ffi::TensorView v, tvm::ffi::TensorView cos,
          tvm::ffi::TensorView sin, tvm::ffi::Shape heads, int64_t causal, double scale, int64_t block_m,
          tvm::ffi::TensorView o) {
  Launch(q, k, v, &cos, &sin, At(heads, 0), At(heads, 1), At(heads, 2), At(heads, 3), causal, scale, block_m, o);
}

// k rotated too, tile by tile as each lands (the mma.sync kernel): for a grid of one query block per head, where
// no key tile is rotated twice (RewriteAttentionToFlash emits it where the bucket's n fits one block)
void RopeQk(tvm::ffi::TensorView q, tvm::ffi::TensorView k, tvm::ffi::TensorView v, tvm::ffi::TensorView cos,
            tvm::ffi::TensorView sin, tvm::ffi::Shape heads, int64_t causal, double scale, int64_t block_m,
            tvm::ffi::TensorView o) {
  Launch(q, k, v, &cos, &sin, At(heads, 0), At(heads, 1), At(heads, 2), At(heads, 3), causal, scale, block_m, o,
         kStages, true);
}

// the rope entry point with the kernel chosen (benchmarks/flash_check.py times each): block_m 64 / 128 and
// stages 1 / 2 for the mma.sync kernel; stages 0 for the wgmma one, 3 for its warp-specialized form, 4 for
// that with ping-pong: block_m then the key rows per tile (64 / 128; 64 for 3 and 4)
void RopeConfig(tvm::ffi::TensorView q, tvm::ffi::TensorView k, tvm::ffi::TensorView v, tvm::ffi::TensorView cos,
                tvm::ffi::TensorView sin, tvm::ffi::Shape heads, int64_t causal, double scale, int64_t block_m,
                int64_t stages, tvm::ffi::TensorView o) {
  Launch(q, k, v, &cos, &sin, At(heads, 0), At(heads, 1), At(heads, 2), At(heads, 3), causal, scale, block_m, o,
         stages);
}
// a paged KV cache's ragged prefill attention, with TVM's TIR kernel's arguments (the runtime's TIRRaggedPrefillFunc
// calls it so): the queries of sequence s, rows q_indptr[s] .. q_indptr[s + 1] of q (total, heads, d), over keys and
// values kv_indptr[s] .. of k, v (total_kv, kv_heads, d), into o (total, heads, d) and lse (total, heads) float32, the
// base-2 log-sum-exp of the scaled scores (what the runtime's merge of attention states reads). causal: top-left,
// the runtime's call (each prompt chunk over its own keys: q_indptr == kv_indptr). q and k come rotated (rotary_mode 0;
// positions and the RoPE settings unused). The mma.sync kernel, 64 query rows a block, one K/V buffer; the grid covers
// the longest sequence with ceil(total / 64) blocks a head and sequence, the blocks past a sequence's rows exit.
void RaggedPrefill(tvm::ffi::TensorView q, tvm::ffi::TensorView q_indptr, tvm::ffi::TensorView k,
                   tvm::ffi::TensorView v, tvm::ffi::TensorView kv_indptr, tvm::ffi::TensorView q_rope_position,
                   tvm::ffi::TensorView k_rope_pos_offset, tvm::ffi::TensorView o, tvm::ffi::TensorView lse,
                   int64_t causal, int64_t rotary_mode, double rope_scale, double rope_theta, double sm_scale) {
  (void)q_rope_position, (void)k_rope_pos_offset, (void)rope_scale, (void)rope_theta;
  TVM_FFI_ICHECK(rotary_mode == 0) << "ragged prefill: RoPE inside attention (rotary_mode " << rotary_mode
                                   << ") is not supported";
  for (const auto* t : {&q, &k, &v, &o}) {
    TVM_FFI_ICHECK(t->ndim() == 3 && t->IsContiguous())
        << "ragged prefill: q, k, v and o must be compact (rows, heads, head_dim)";
  }
  DLDataType dt = HalfType("ragged prefill", q, k, v, o);
  const int64_t total = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k.size(1),
                batch = q_indptr.size(0) - 1;
  TVM_FFI_ICHECK(dim == 64 || dim == 128) << "ragged prefill: head_dim " << dim << " (64 or 128 only)";
  TVM_FFI_ICHECK(o.size(0) == total && o.size(1) == heads && o.size(2) == dim && v.size(0) == k.size(0) &&
                 v.size(1) == kv_heads && k.size(2) == dim && v.size(2) == dim)
      << "ragged prefill: the shapes of q, k, v and o differ";
  TVM_FFI_ICHECK(kv_heads > 0 && heads % kv_heads == 0)
      << "ragged prefill: " << heads << " query heads for " << kv_heads << " kv heads";
  for (const auto* t : {&q_indptr, &kv_indptr}) {
    TVM_FFI_ICHECK(t->ndim() == 1 && t->size(0) == batch + 1 && t->dtype().code == kDLInt && t->dtype().bits == 32 &&
                   t->IsContiguous())
        << "ragged prefill: q_indptr and kv_indptr must be int32 of batch + 1";
  }
  TVM_FFI_ICHECK(lse.ndim() == 2 && lse.size(0) == total && lse.size(1) == heads && lse.dtype().code == kDLFloat &&
                 lse.dtype().bits == 32 && lse.IsContiguous())
      << "ragged prefill: lse must be compact float32 (rows, heads)";
  TVM_FFI_ICHECK(total * heads * dim <= INT_MAX && k.size(0) * kv_heads * dim <= INT_MAX && heads <= 65535 &&
                 batch <= 65535)
      << "ragged prefill: too large";
  if (batch <= 0 || total == 0) return;
  Driver* d = LoadDriver();
  DLDevice dev = o.device();
  const int q_row = static_cast<int>(heads * dim), kv_row = static_cast<int>(kv_heads * dim);
  Params p{Data(q), Data(k), Data(v), nullptr, nullptr, Data(o), 0, 0, 0, 0, q_row, kv_row, kv_row, q_row, 0, 0, 0,
           static_cast<int>(total), static_cast<int>(k.size(0)), static_cast<int>(heads / kv_heads), causal ? 1 : 0,
           static_cast<float>(sm_scale * 1.4426950408889634), 0,
           reinterpret_cast<const int*>(Data(q_indptr)), reinterpret_cast<const int*>(Data(kv_indptr)),
           reinterpret_cast<float*>(Data(lse))};
  void* args[] = {&p};
  LaunchMmaSync(d, dev, dt.code == kDLBfloat ? "bf16" : "f16", dim, kBlockM, 1,
                static_cast<unsigned>((total + kBlockM - 1) / kBlockM), heads, batch, args);
}
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_flash_attention_ragged, RaggedPrefill);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_flash_attention, Plain);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_flash_attention_in_place, InPlace);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_flash_attention_rope, Rope);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_flash_attention_rope_qk, RopeQk);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(relaxtune_flash_attention_config, RopeConfig);
