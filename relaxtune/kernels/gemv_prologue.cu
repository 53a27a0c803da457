// The x prologues of relaxtune's (N, K) decode GEMV (gemv_nk.cu) and the helpers they share with the 4-bit kernels
// (qgemv_stream.cu, qmlp_stream.cu): fp16 / bf16 packing, rounding as the separate kernels round, SwiGLU, RMSNorm
// and the attention of one short sequence. Appended after gemv.cu in one fatbin (kernels/gemv.py).

// ---- x prologues of the (N, K) kernel: the block computes the product's input x once, into shared memory
// (rows x K elements of T), from what the separate kernel before it read, rounded where that kernel rounds:
// kRmsX: x = rms_norm(x, g, eps) over K as TVM's legalized rms_norm computes it, in fp32
//   ((x * rsqrt(sum(x^2) / K + eps)) * g, one rounding to T);
// kSwiGluX: x (rows, 2K) is the merged gate/up product, gate | up: x = silu(gate) * up with every step rounded to
//   T as the fused element-wise kernel's T arithmetic does (sigmoid as 1 / (1 + exp(-gate)), then the two products).
// The weight loads of the first chunk are issued before (64 KB per SM in flight), so the prologue overlaps them.
// (The norm applied by each warp as it reads x instead, g on the way and the squares summed by the warps in turns,
// measured no faster on an H200: q/k/v 26.7 us against 26.5, docs/results.md.)
// ---- and its SwiGLU epilogue (GLU): the weight is the merged gate | up (2N, K); warp f owns features f and f + N
// (rows gate_f and up_f) and writes silu(gate_f) * up_f, both sums rounded to T first, then kSwiGluX's steps: the
// product the down projection reads, so that one needs no prologue.
enum { kPlainX = 0, kRmsX = 1, kSwiGluX = 2, kAttnX = 3 };
constexpr int kNkMaxWarps = 16;

template <typename T>
__device__ __forceinline__ void unpack8(const uint4& v, float (&out)[8]) {
  const uint32_t bits[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = to_float2(bits[j], T());
    out[2 * j] = f.x, out[2 * j + 1] = f.y;
  }
}

__device__ __forceinline__ uint32_t pack2(float lo, float hi, __half) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t pack2(float lo, float hi, __nv_bfloat16) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&in)[8]) {
  return make_uint4(pack2(in[0], in[1], T()), pack2(in[2], in[3], T()), pack2(in[4], in[5], T()),
                    pack2(in[6], in[7], T()));
}

template <typename T>
__device__ __forceinline__ float round_to(float v) { return to_float(from_float<T>(v)); }

template <typename T>
__device__ __forceinline__ float silu_times(float gate, float up) {
  const float sigmoid = round_to<T>(__frcp_rn(round_to<T>(1.0f + round_to<T>(__expf(-gate)))));  // 1 / x, IEEE
  return round_to<T>(round_to<T>(gate * sigmoid) * up);
}

// x for rows [0, p.rows) into xs (rows x K / 8 vectors), then a block barrier
template <typename T, int M, int P>
__device__ __forceinline__ void prepare_x(const GemvParams& p, uint4* xs) {
  const int vectors = p.k / 8, threads = blockDim.x;
  const uint4* x = static_cast<const uint4*>(p.x);
  if constexpr (P == kSwiGluX) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      if (m >= p.rows) break;
      for (int v = threadIdx.x; v < vectors; v += threads) {
        float gate[8], up[8];
        unpack8<T>(__ldg(x + static_cast<size_t>(2 * m) * vectors + v), gate);
        unpack8<T>(__ldg(x + static_cast<size_t>(2 * m + 1) * vectors + v), up);
#pragma unroll
        for (int j = 0; j < 8; ++j) gate[j] = silu_times<T>(gate[j], up[j]);
        xs[m * vectors + v] = pack8<T>(gate);
      }
    }
  } else {
    static_assert(P == kRmsX, "a prologue");
    __shared__ float partial[M][kNkMaxWarps];  // per warp: its share of each row's sum of squares
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float squares[M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
      squares[m] = 0.0f;
      if (m >= p.rows) continue;
      for (int v = threadIdx.x; v < vectors; v += threads) {
        const uint4 raw = __ldg(x + static_cast<size_t>(m) * vectors + v);
        float f[8];
        unpack8<T>(raw, f);
#pragma unroll
        for (int j = 0; j < 8; ++j) squares[m] = fmaf(f[j], f[j], squares[m]);
        xs[m * vectors + v] = raw;  // read back below by this thread only
      }
#pragma unroll
      for (int o = 16; o > 0; o /= 2) squares[m] += __shfl_xor_sync(0xffffffffu, squares[m], o);
      if (lane == 0) partial[m][warp] = squares[m];
    }
    __syncthreads();
    const uint4* g = static_cast<const uint4*>(p.g);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      if (m >= p.rows) break;
      float sum = 0.0f;
      for (int q = 0; q < threads / 32; ++q) sum += partial[m][q];
      const float scale = rsqrtf(sum / static_cast<float>(p.k) + p.eps);
      for (int v = threadIdx.x; v < vectors; v += threads) {
        float f[8], gf[8];
        unpack8<T>(xs[m * vectors + v], f);
        unpack8<T>(__ldg(g + v), gf);
#pragma unroll
        for (int j = 0; j < 8; ++j) f[j] = scale * f[j] * gf[j];
        xs[m * vectors + v] = pack8<T>(f);
      }
    }
  }
  __syncthreads();
}

// ---- the attention prologue (kAttnX): x (rows x K, K = heads x D) is attention over one short sequence (batch 1):
// its `rows` query rows against the same rows as keys, as the flash kernel computes it: q (and k where a.rope == 2)
// rotated (rotate-half, the table row of the row's position) in fp32 and rounded to T, scores in fp32 times the
// scale, the top-left causal mask where a.causal, the softmax in fp32 with each p rounded to T for the product with
// v, divided by the fp32 sum, one rounding to T. D / 8 lanes per head (16 for D = 128: a block of 512 threads takes
// 32 heads at once), each one 16-byte vector of q, k, v and the tables; a rotation partner is D / 16 lanes away.
struct AttnParams {  // must match gemv_host.cc
  const void *q, *k, *v, *cos, *sin;  // q, k, v (1, rows, heads of the tensor, D); cos / sin (>= rows, D) or null
  int q_row, k_row, v_row;            // elements between consecutive rows
  int q_head0, k_head0, v_head0;
  int heads, group, causal, rope;     // query heads, query heads per kv head, mask, 0 / 1 (q) / 2 (q and k) rotated
  float scale;
};

// how attention_rows reads q, k and v: read-only, through L2 (where the same kernel wrote them), or by generic loads
// (where the kernel put them in shared memory)
enum AttnLoad { kAttnReadOnly = 0, kAttnCoherent = 1, kAttnGeneric = 2 };

// one lane's 16-byte vector `at` of src, zeros where !ok, loaded without a branch (a valid address either way), as
// kLoad (an AttnLoad) says
template <int kLoad>
__device__ __forceinline__ uint4 load_vector(const uint4* src, size_t at, bool ok) {
  const uint4* from = src + (ok ? at : 0);
  const uint4 v = kLoad == kAttnCoherent ? __ldcg(from) : kLoad == kAttnGeneric ? *from : __ldg(from);
  return ok ? v : make_uint4(0, 0, 0, 0);
}

// one lane's 8 elements of a head (raw), rotated by its table vectors c, s if asked (rotate-half: the partner value
// `partner_lanes` lanes away, negated in the first half)
template <typename T>
__device__ __forceinline__ void rotate_part(const uint4& raw, bool rotate, const uint4& cos, const uint4& sin,
                                            int partner_lanes, bool first_half, float (&out)[8]) {
  unpack8<T>(raw, out);
  if (!rotate) return;  // uniform over the warp
  float c[8], s[8];
  unpack8<T>(cos, c);
  unpack8<T>(sin, s);
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float partner = __shfl_xor_sync(0xffffffffu, out[e], partner_lanes);
    out[e] = round_to<T>(out[e] * c[e] + (first_half ? -partner : partner) * s[e]);
  }
}

// the attention of `rows` (<= M) rows into xs (rows x K), by threads [0, threads) of the block (whole warps); no
// barrier; q, k and v loaded as kLoad (an AttnLoad) says
template <typename T, int M, int kLoad = kAttnReadOnly>
__device__ __forceinline__ void attention_rows(int rows, int k_features, const AttnParams& a, uint4* xs, int threads) {
  const int d = k_features / a.heads, lanes = d / 8, sub = threadIdx.x % lanes, per_warp = 32 / lanes;
  const int groups = threads / lanes;
  const uint4 *q = static_cast<const uint4*>(a.q), *k = static_cast<const uint4*>(a.k);
  const uint4 *v = static_cast<const uint4*>(a.v), *cos = static_cast<const uint4*>(a.cos);
  const uint4* sin = static_cast<const uint4*>(a.sin);
  const bool first_half = sub < lanes / 2;
  // the warp's first head, then a block's worth of heads on: every lane of a warp runs the same trips (shuffles)
  for (int base = threadIdx.x / 32 * per_warp; base < a.heads; base += groups) {
    const int h = base + (threadIdx.x % 32) / lanes, kv = h / a.group;
    const bool ok = h < a.heads;
    float keys[M][8], values[M][8], query[M][8];
#pragma unroll
    for (int j = 0; j < M; ++j) {  // a row's loads first (one round trip to L2, not one per vector), then its rotations
      if (j >= rows) break;
      auto at = [&](int row, int head0, int head) {  // the lane's vector of `head` in row j
        return (static_cast<size_t>(j) * row + (head0 + head) * d) / 8 + sub;
      };
      const uint4 kr = load_vector<kLoad>(k, at(a.k_row, a.k_head0, kv), ok);
      const uint4 vr = load_vector<kLoad>(v, at(a.v_row, a.v_head0, kv), ok);
      const uint4 qr = load_vector<kLoad>(q, at(a.q_row, a.q_head0, h), ok);
      uint4 c = make_uint4(0, 0, 0, 0), sn = c;  // the row's table vectors, where a.rope > 0
      if (a.rope >= 1) {
        c = load_vector<kAttnReadOnly>(cos, static_cast<size_t>(j) * lanes + sub, ok);
        sn = load_vector<kAttnReadOnly>(sin, static_cast<size_t>(j) * lanes + sub, ok);
      }
      rotate_part<T>(kr, a.rope == 2, c, sn, lanes / 2, first_half, keys[j]);
      rotate_part<T>(vr, false, c, sn, lanes / 2, first_half, values[j]);
      rotate_part<T>(qr, a.rope >= 1, c, sn, lanes / 2, first_half, query[j]);
    }
#pragma unroll
    for (int r = 0; r < M; ++r) {
      if (r >= rows) break;
      float score[M], top = -INFINITY;
#pragma unroll
      for (int j = 0; j < M; ++j) {
        float s = 0.0f;
        if (j < rows) {
#pragma unroll
          for (int e = 0; e < 8; ++e) s = fmaf(query[r][e], keys[j][e], s);
        }
        for (int o = lanes / 2; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);  // the head's lanes
        score[j] = j < rows && !(a.causal && j > r) ? s * a.scale : -INFINITY;
        top = fmaxf(top, score[j]);
      }
      float out[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f}, sum = 0.0f;
#pragma unroll
      for (int j = 0; j < M; ++j) {
        if (score[j] == -INFINITY) continue;
        const float weight = __expf(score[j] - top);
        sum += weight;
#pragma unroll
        for (int e = 0; e < 8; ++e) out[e] = fmaf(round_to<T>(weight), values[j][e], out[e]);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) out[e] /= sum;
      if (ok) xs[static_cast<size_t>(r) * (k_features / 8) + h * lanes + sub] = pack8<T>(out);
    }
  }
}
