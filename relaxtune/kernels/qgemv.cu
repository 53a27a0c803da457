// relaxtune's 4-bit decode GEMV: y[r, :] = x[r, :] @ W^T (+ res[r, :]) for one or two rows r, fp16 x, y and
// res, W (N, K) as 4-bit groups in the GPU layout (quant_formats.pack_q4_gpu: per output row, uint32 words of 8
// weights, weight 8j + 2i in bits 4i.., 8j + 2i + 1 in bits 16 + 4i..) with fp16 scales (N, K / group), the
// value of a weight (q - 8) * scale; fp32 accumulation. Appended to gemv.cu in one fatbin (kernels/gemv.py): it
// uses that file's load_stream and wait_for_previous_kernel. Host side: qgemv_host.cc.
//
// A warp owns R = 2 consecutive output features; lane l reads the 16-byte vectors (32 weights) l, l + 32, ...
// of each row, C = 2 of them per row per chunk, and the next chunk's R x C weight vectors and their scales are
// in flight while the current chunk is multiplied. A vector is dequantized in registers without a conversion
// instruction: (word & 0x000F000F) | 0x64006400 is the half2 (1024 + q0, 1024 + q1), minus 1032 the exact
// (q0 - 8, q1 - 8); the nibbles 4 bits up give 1024 + 16 q, scaled by 1/16 minus 72 in one HFMA2, exact too.
// The 32 products with x are summed in fp16 pairs (two chains of 8 per half, HFMA2), then in fp32, times the
// group's scale (fp32 FMA). A warp shuffle reduces each feature: no shared memory, no atomics.
//
// The grid is two 256-thread blocks per SM (the host launches exactly that many) and a warp's features are
// spread so that every SM gets the same number of feature pairs +-1 (block b taken to run on SM b % SMs, its warps
// that SM's slots b / SMs * 8 + w; feature pair p goes to SM p % SMs, slot p / SMs % 16), whatever N. (A grid of
// one block per 16 features would, for N = 11008, be 688 blocks: 2.6 waves of 264, the last one 60% full.)
// As gemv.cu's kernels, it issues the first weight loads and then waits for the previous kernel
// (griddepcontrol.wait) before it reads x or the residual or writes y.
#include <cuda_fp16.h>
#include <stdint.h>

struct Q4GemvParams {  // must match qgemv_host.cc
  const void* x;      // (rows, k) fp16
  const void* w;      // (n, k / 8) uint32, the GPU layout
  const void* scale;  // (n, k >> (5 + group_shift)) fp16
  const void* res;    // (rows, n) fp16 residual, or null
  void* y;            // (rows, n) fp16
  int rows;           // rows of x in this launch (<= M)
  int k, n;
  int group_shift;    // group = 32 << group_shift weights per scale
  int sms;            // the SM count the grid was sized for (2 blocks per SM)
};

constexpr int kQ4Features = 2, kQ4Vectors = 2, kQ4Warps = 8;  // R, C, warps per block

__device__ __forceinline__ unsigned short load_scale(const void* p) {  // read once: no L1 allocation
  unsigned short v;
  asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ __half2 half2_bits(uint32_t bits) { return *reinterpret_cast<__half2*>(&bits); }

// the 8 weights of one word as 4 half2 pairs (q - 8), in x's order: pair i is weights 2i, 2i + 1 of the word
__device__ __forceinline__ void dequantize_word(uint32_t word, __half2* w) {
  const __half2 minus_1032 = half2_bits(0xE408E408u), sixteenth = half2_bits(0x2C002C00u);
  const __half2 minus_72 = half2_bits(0xD480D480u);
  const uint32_t hi = word >> 8;
  w[0] = __hadd2(half2_bits((word & 0x000F000Fu) | 0x64006400u), minus_1032);
  w[1] = __hfma2(half2_bits((word & 0x00F000F0u) | 0x64006400u), sixteenth, minus_72);
  w[2] = __hadd2(half2_bits((hi & 0x000F000Fu) | 0x64006400u), minus_1032);
  w[3] = __hfma2(half2_bits((hi & 0x00F000F0u) | 0x64006400u), sixteenth, minus_72);
}

// the 32 weights of one 16-byte vector as 16 half2 pairs (q - 8): pair i of word j is weights 8j + 2i, 8j + 2i + 1
__device__ __forceinline__ void dequantize_vector(const uint4& v, __half2 (&w)[16]) {
  dequantize_word(v.x, w), dequantize_word(v.y, w + 4), dequantize_word(v.z, w + 8), dequantize_word(v.w, w + 12);
}

// sum over the vector's 32 weights of x * (q - 8): fp16 pairs in two chains (words 0-1, 2-3), then fp32
__device__ __forceinline__ float dot_vector(const __half2 (&w)[16], const uint4 (&x)[4]) {
  __half2 acc[2];
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const uint4 a = x[2 * c], b = x[2 * c + 1];
    const uint32_t xs[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    acc[c] = __hmul2(half2_bits(xs[0]), w[8 * c]);
#pragma unroll
    for (int i = 1; i < 8; ++i) acc[c] = __hfma2(half2_bits(xs[i]), w[8 * c + i], acc[c]);
  }
  const float2 s0 = __half22float2(acc[0]), s1 = __half22float2(acc[1]);
  return (s0.x + s0.y) + (s1.x + s1.y);
}

template <int M>
__device__ __forceinline__ void q4gemv_body(const Q4GemvParams& p) {
  constexpr int R = kQ4Features, C = kQ4Vectors;
  const int lane = threadIdx.x % 32;
  // this warp's slot: SM b % sms, slot (b / sms) * 8 + w of that SM's 16; feature pairs p go to slot p / sms of SM p %
  // sms
  const int b = blockIdx.x, sm = b % p.sms, slot = (b / p.sms) * kQ4Warps + threadIdx.x / 32;
  const int first = slot * p.sms + sm, stride = 2 * kQ4Warps * p.sms;
  const int pairs = (p.n + R - 1) / R, vectors = p.k / 32, chunks = (vectors + 32 * C - 1) / (32 * C);
  const int mine = first < pairs ? (pairs - first + stride - 1) / stride : 0, items = mine * chunks;
  const uint4* w = static_cast<const uint4*>(p.w);
  const char* scale = static_cast<const char*>(p.scale);
  const int scales_per_row = vectors >> p.group_shift;
  auto load = [&](uint4 (&buf)[R][C], unsigned short (&sc)[R][C], int t) {
    const int row0 = (first + t / chunks * stride) * R, chunk = t % chunks;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int u = 0; u < C; ++u) {
        const int v = (chunk * C + u) * 32 + lane, row = row0 + r;
        const bool ok = t < items && row < p.n && v < vectors;
        buf[r][u] = ok ? load_stream(w + static_cast<size_t>(row) * vectors + v) : make_uint4(0, 0, 0, 0);
        sc[r][u] = ok ? load_scale(scale + 2 * (static_cast<size_t>(row) * scales_per_row + (v >> p.group_shift))) : 0;
      }
  };
  float acc[M][R];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;
  uint4 cur[R][C];
  unsigned short cur_scale[R][C];
  load(cur, cur_scale, 0);
  wait_for_previous_kernel();  // x, the residual and y only after the previous kernel
  const uint4* x = static_cast<const uint4*>(p.x);
  const __half* res = static_cast<const __half*>(p.res);
  __half* y = static_cast<__half*>(p.y);
  for (int t = 0; t < items; ++t) {
    uint4 next[R][C];
    unsigned short next_scale[R][C];
    load(next, next_scale, t + 1);  // zeros past the last item
    const int chunk = t % chunks;
#pragma unroll
    for (int u = 0; u < C; ++u) {
      // past K the weights and x are zeros: (0 - 8) * 0, no branch around the products
      const int v = (chunk * C + u) * 32 + lane;
      uint4 xv[M][4];
#pragma unroll
      for (int m = 0; m < M; ++m)
#pragma unroll
        for (int j = 0; j < 4; ++j)
          xv[m][j] = v < vectors && m < p.rows ? __ldg(x + static_cast<size_t>(m) * (p.k / 8) + 4 * v + j)
                                               : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        __half2 wv[16];
        dequantize_vector(cur[r][u], wv);
        const float s = __half2float(__ushort_as_half(cur_scale[r][u]));
#pragma unroll
        for (int m = 0; m < M; ++m) acc[m][r] = fmaf(dot_vector(wv, xv[m]), s, acc[m][r]);
      }
    }
    if (chunk == chunks - 1) {  // the pair's rows are done: reduce over the warp, write, start the next pair
      const int row0 = (first + t / chunks * stride) * R;
#pragma unroll
      for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float s = acc[m][r];
#pragma unroll
          for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
          acc[m][r] = 0.0f;
          if (lane == 0 && m < p.rows && row0 + r < p.n) {
            const size_t at = static_cast<size_t>(m) * p.n + row0 + r;
            y[at] = __float2half_rn(res != nullptr ? s + __half2float(res[at]) : s);
          }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int u = 0; u < C; ++u) cur[r][u] = next[r][u], cur_scale[r][u] = next_scale[r][u];
  }
}

#define RELAXTUNE_Q4GEMV(NAME, M) \
  extern "C" __global__ void __launch_bounds__(32 * kQ4Warps, 2) NAME(Q4GemvParams p) { q4gemv_body<M>(p); }

RELAXTUNE_Q4GEMV(relaxtune_q4gemv_f16_m1, 1)
RELAXTUNE_Q4GEMV(relaxtune_q4gemv_f16_m2, 2)
