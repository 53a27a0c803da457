// relaxtune's decode GEMV over a weight in the (N, K) layout, with its x prologues (gemv_prologue.cu) and SwiGLU
// epilogue. Appended after gemv.cu and gemv_prologue.cu in one fatbin (kernels/gemv.py); host code: gemv_host.cc.

// ---- the (N, K) layout: y[r, :] = x[r, :] @ W^T (+ res[r, :]), W (N, K) row-major (PyTorch Linear's)
// A warp owns R consecutive output features (rows of W), a block of 16 (or 8) warps 16 R of them. Lane l
// reads the 16-byte vectors l, l + 32, l + 64, ... of each of its rows: a warp reads 512
// contiguous bytes per load, C such loads per row per chunk, and the next chunk's R x C loads are
// in flight while the current chunk is multiplied. The K reduction is a warp shuffle: no shared
// memory, no cluster, one wave of 128 blocks for 4096 outputs. fp16 sums the 8 products of a
// 16-byte vector in fp16 (one HMUL2, three HFMA2) and adds that to an fp32 accumulator: the
// fp32-FMA form measured 10.1 us for o_proj on an H200 against 9.7 (notes s16/gemv); bf16, whose
// 8-bit mantissa would lose too much there, multiplies in fp32.
__device__ __forceinline__ float dot8(const uint4& a, const uint4& b, __half) {
  const uint32_t av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
  __half2 h = __hmul2(*reinterpret_cast<const __half2*>(&av[0]), *reinterpret_cast<const __half2*>(&bv[0]));
#pragma unroll
  for (int j = 1; j < 4; ++j)
    h = __hfma2(*reinterpret_cast<const __half2*>(&av[j]), *reinterpret_cast<const __half2*>(&bv[j]), h);
  const float2 f = __half22float2(h);
  return f.x + f.y;
}

__device__ __forceinline__ float dot8(const uint4& a, const uint4& b, __nv_bfloat16) {
  const uint32_t av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 fa = to_float2(av[j], __nv_bfloat16()), fb = to_float2(bv[j], __nv_bfloat16());
    s = fmaf(fa.x, fb.x, fmaf(fa.y, fb.y, s));
  }
  return s;
}

template <typename T, int M>
__device__ __forceinline__ void prepare_attention_x(const GemvParams& p, const AttnParams& a, uint4* xs) {
  attention_rows<T, M>(p.rows, p.k, a, xs, blockDim.x);
  __syncthreads();
}

// P: x as it is (kPlainX, read through L1 by every warp), or a prologue's x in shared memory (rows x K x 2
// bytes of dynamic shared memory, given at launch); GLU: the SwiGLU epilogue (R = 2)
template <typename T, int M, int R, int C, int P = kPlainX, bool GLU = false>
__device__ __forceinline__ void gemv_nk_body(const GemvParams& p, const AttnParams* attn = nullptr) {
  static_assert(!GLU || R == 2, "the SwiGLU epilogue pairs a gate row with its up row");
  extern __shared__ uint4 nk_x[];  // the prologue's x (P != kPlainX)
  const int lane = threadIdx.x % 32, warp_id = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  // the warp's rows of w: row0 + r (its R features), or with GLU row0 + r * N (gate_f, up_f for feature f = row0)
  const int row0 = GLU ? warp_id : warp_id * R, row_step = GLU ? p.n : 1;
  const int vectors = p.k / 8, chunks = (vectors + 32 * C - 1) / (32 * C);  // the host makes K a multiple of 8
  const uint4* w = static_cast<const uint4*>(p.w);
  const uint4* x = P == kPlainX ? static_cast<const uint4*>(p.x) : nk_x;
  auto feature_ok = [&](int r) { return (GLU ? row0 : row0 + r) < p.n; };
  auto load = [&](uint4 (&buf)[R][C], int chunk) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int u = 0; u < C; ++u) {
        const int v = (chunk * C + u) * 32 + lane;
        const size_t row = static_cast<size_t>(row0) + static_cast<size_t>(r) * row_step;
        buf[r][u] = feature_ok(r) && v < vectors ? load_stream(w + row * vectors + v) : make_uint4(0, 0, 0, 0);
      }
  };
  float acc[M][R];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;
  uint4 cur[R][C];
  load(cur, 0);
  wait_for_previous_kernel();  // x, the residual and y only after the previous kernel
  if constexpr (P == kAttnX) prepare_attention_x<T, M>(p, *attn, nk_x);  // x is rows x K in shared memory
  else if constexpr (P != kPlainX) prepare_x<T, M, P>(p, nk_x);
  for (int chunk = 0; chunk < chunks; ++chunk) {
    uint4 next[R][C];
    load(next, chunk + 1);  // zeros past the last chunk
#pragma unroll
    for (int u = 0; u < C; ++u) {
      // past K both the weights and x are zeros: no branch around the products (a `continue` here
      // kept the x loads from issuing together: o_proj 11.9 us against 9.6 on an H200, notes s17)
      const int v = (chunk * C + u) * 32 + lane;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const size_t at = static_cast<size_t>(m) * vectors + v;
        const uint4 xv = v < vectors && m < p.rows ? (P == kPlainX ? __ldg(x + at) : x[at]) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] += dot8(xv, cur[r][u], T());
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int u = 0; u < C; ++u) cur[r][u] = next[r][u];
  }
  const T* res = static_cast<const T*>(p.res);
  T* y = static_cast<T*>(p.y);
#pragma unroll
  for (int m = 0; m < M; ++m) {
    if constexpr (GLU) {
      float s[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        s[r] = acc[m][r];
#pragma unroll
        for (int o = 16; o > 0; o /= 2) s[r] += __shfl_xor_sync(0xffffffffu, s[r], o);
      }
      if (lane == 0 && m < p.rows && row0 < p.n)
        y[static_cast<size_t>(m) * p.n + row0] = from_float<T>(silu_times<T>(round_to<T>(s[0]), round_to<T>(s[1])));
    } else {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float s = acc[m][r];
#pragma unroll
        for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0 && m < p.rows && row0 + r < p.n) {
          const size_t at = static_cast<size_t>(m) * p.n + row0 + r;
          y[at] = from_float<T>(res != nullptr ? s + to_float(res[at]) : s);
        }
      }
    }
  }
}

// R = 2 features per warp, C = 4 vectors per row per chunk; 512 threads (16 warps, one block per SM)
// for grids that fit the SMs in one wave (o_proj, down: 128 blocks), 256 (8 warps, two blocks per
// SM) for larger ones (H200: qkv 25.4 us against 26.0, notes s17); gemv_host.cc picks
#define RELAXTUNE_GEMV_NK(NAME, T, M, THREADS, MINB) \
  extern "C" __global__ void __launch_bounds__(THREADS, MINB) NAME(GemvParams p) { gemv_nk_body<T, M, 2, 4>(p); }

RELAXTUNE_GEMV_NK(relaxtune_gemv_nk_f16_m1, __half, 1, 512, 1)
RELAXTUNE_GEMV_NK(relaxtune_gemv_nk_f16_m2, __half, 2, 512, 1)
RELAXTUNE_GEMV_NK(relaxtune_gemv_nk_f16_m4, __half, 4, 512, 1)
RELAXTUNE_GEMV_NK(relaxtune_gemv_nk_bf16_m1, __nv_bfloat16, 1, 512, 1)
RELAXTUNE_GEMV_NK(relaxtune_gemv_nk_bf16_m2, __nv_bfloat16, 2, 512, 1)
RELAXTUNE_GEMV_NK(relaxtune_gemv_nk_bf16_m4, __nv_bfloat16, 4, 512, 1)
RELAXTUNE_GEMV_NK(relaxtune_gemv_nk_f16_m1_narrow, __half, 1, 256, 2)
RELAXTUNE_GEMV_NK(relaxtune_gemv_nk_f16_m2_narrow, __half, 2, 256, 2)
RELAXTUNE_GEMV_NK(relaxtune_gemv_nk_f16_m4_narrow, __half, 4, 256, 2)
RELAXTUNE_GEMV_NK(relaxtune_gemv_nk_bf16_m1_narrow, __nv_bfloat16, 1, 256, 2)
RELAXTUNE_GEMV_NK(relaxtune_gemv_nk_bf16_m2_narrow, __nv_bfloat16, 2, 256, 2)
RELAXTUNE_GEMV_NK(relaxtune_gemv_nk_bf16_m4_narrow, __nv_bfloat16, 4, 256, 2)

// the prologue / epilogue kernels (rows <= 2 per launch: a prologue's x is 2 x K x 2 bytes of shared memory): RMSNorm
// before the product (q/k/v), SwiGLU of the merged gate/up product before it (down, when gate/up is no GEMV of
// this kind), the SwiGLU epilogue with (gate/up) or without the norm
#define RELAXTUNE_GEMV_NK_X(NAME, P, GLU)                                                                        \
  extern "C" __global__ void __launch_bounds__(512, 1) relaxtune_gemv_nk_##NAME##_f16_m1(GemvParams p) {         \
    gemv_nk_body<__half, 1, 2, 4, P, GLU>(p);                                                                    \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(512, 1) relaxtune_gemv_nk_##NAME##_f16_m2(GemvParams p) {         \
    gemv_nk_body<__half, 2, 2, 4, P, GLU>(p);                                                                    \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(512, 1) relaxtune_gemv_nk_##NAME##_bf16_m1(GemvParams p) {        \
    gemv_nk_body<__nv_bfloat16, 1, 2, 4, P, GLU>(p);                                                             \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(512, 1) relaxtune_gemv_nk_##NAME##_bf16_m2(GemvParams p) {        \
    gemv_nk_body<__nv_bfloat16, 2, 2, 4, P, GLU>(p);                                                             \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(256, 2) relaxtune_gemv_nk_##NAME##_f16_m1_narrow(GemvParams p) {  \
    gemv_nk_body<__half, 1, 2, 4, P, GLU>(p);                                                                    \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(256, 2) relaxtune_gemv_nk_##NAME##_f16_m2_narrow(GemvParams p) {  \
    gemv_nk_body<__half, 2, 2, 4, P, GLU>(p);                                                                    \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(256, 2) relaxtune_gemv_nk_##NAME##_bf16_m1_narrow(GemvParams p) { \
    gemv_nk_body<__nv_bfloat16, 1, 2, 4, P, GLU>(p);                                                             \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(256, 2) relaxtune_gemv_nk_##NAME##_bf16_m2_narrow(GemvParams p) { \
    gemv_nk_body<__nv_bfloat16, 2, 2, 4, P, GLU>(p);                                                             \
  }

RELAXTUNE_GEMV_NK_X(rms, kRmsX, false)
RELAXTUNE_GEMV_NK_X(swiglu, kSwiGluX, false)
RELAXTUNE_GEMV_NK_X(glu, kPlainX, true)
RELAXTUNE_GEMV_NK_X(rms_glu, kRmsX, true)

// the attention prologue (o_proj of a one- or two-row bucket: the attention before it is no kernel of its own)
#define RELAXTUNE_GEMV_NK_ATTN(NAME, T, M, THREADS, MINB)                                        \
  extern "C" __global__ void __launch_bounds__(THREADS, MINB) NAME(GemvParams p, AttnParams a) { \
    gemv_nk_body<T, M, 2, 4, kAttnX>(p, &a);                                                     \
  }

RELAXTUNE_GEMV_NK_ATTN(relaxtune_gemv_nk_attn_f16_m1, __half, 1, 512, 1)
RELAXTUNE_GEMV_NK_ATTN(relaxtune_gemv_nk_attn_f16_m2, __half, 2, 512, 1)
RELAXTUNE_GEMV_NK_ATTN(relaxtune_gemv_nk_attn_bf16_m1, __nv_bfloat16, 1, 512, 1)
RELAXTUNE_GEMV_NK_ATTN(relaxtune_gemv_nk_attn_bf16_m2, __nv_bfloat16, 2, 512, 1)
RELAXTUNE_GEMV_NK_ATTN(relaxtune_gemv_nk_attn_f16_m1_narrow, __half, 1, 256, 2)
RELAXTUNE_GEMV_NK_ATTN(relaxtune_gemv_nk_attn_f16_m2_narrow, __half, 2, 256, 2)
RELAXTUNE_GEMV_NK_ATTN(relaxtune_gemv_nk_attn_bf16_m1_narrow, __nv_bfloat16, 1, 256, 2)
RELAXTUNE_GEMV_NK_ATTN(relaxtune_gemv_nk_attn_bf16_m2_narrow, __nv_bfloat16, 2, 256, 2)
