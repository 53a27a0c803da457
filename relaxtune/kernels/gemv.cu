// relaxtune's decode GEMVs: y[r, :] = x[r, :] @ W (+ res[r, :]) for a few rows r, W (K, N) row-major, or W^T for
// W (N, K) (the "nk" kernels at the end), fp16 or bf16 in and out, fp32 accumulation (host side and the measurements: cuda_gemv.py).
//
// A block owns 64 output columns (kCols) of one K range: 8 column threads each load 16 bytes (8
// columns) of a weight row, so a warp reads 4 whole 128-byte row segments per load, and each of
// the block's TY K lanes takes U consecutive rows (x: one U-element vector load per row of x),
// then the block moves on by TY U rows. Each thread issues the next chunk's U weight loads
// (unrolled) before it multiplies the current chunk with up to M rows of x (M = 1, 2, 4, 8: the
// rows share one pass over the weights). The K lanes reduce through warp shuffles and shared memory.
// Two block sizes: 256 threads (TY = 32, 2 blocks per SM) for grids larger than the SM count
// (qkv's 192 tiles), 512 (TY = 64, one block per SM, twice the loads in flight per SM) for grids
// that fit the SMs in one wave (o_proj and down: 64 tiles x 2 K splits; H200: 7% faster for
// o_proj and down than 256 threads, notes s15/gemv).
// With N = 4096 there are only 64 column tiles for 132 SMs, so the K range is split over the
// blocks of a thread-block cluster (1, splits, 1) (compute capability 9.0): every block but the
// leader writes its partial sums into the leader's shared memory (DSMEM), and after one cluster
// barrier the leader adds them, adds the residual in fp32 and writes the tile (the first phase of
// the barrier, "every block has started", is arrived at when the kernel starts). No global
// workspace, no atomics, nothing zeroed: a CUDA graph captures the launch as it is. splits = 1 is
// a plain launch (any sm_80+ GPU).
// Launched as a programmatic dependent (cuda_gemv.py does on 9.0+), a block issues its first
// weight loads and only then waits for the previous kernel (griddepcontrol.wait) before it reads
// x or the residual or writes y; launched plainly, the wait returns at once.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#include <math.h>
#include <stdint.h>

namespace cg = cooperative_groups;

struct GemvParams {  // must match cuda_gemv.py's host code
  const void* x;
  const void* w;
  const void* res;  // (rows, n) residual, or null
  void* y;
  int rows;         // rows of x in this launch (<= M)
  int k, n;
  int k_per_split;  // weight rows per block of a cluster (the last may have fewer)
  const void* g;    // the (N, K) kernel's RMSNorm prologue: the norm's weight (K), else null
  float eps;        // and its epsilon
};

constexpr int kTX = 8, kCols = kTX * 8, kMaxSplits = 8;  // kMaxSplits: cuda_gemv.py's

__device__ __forceinline__ void wait_for_previous_kernel() {  // programmatic dependent launch; a no-op otherwise
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ uint4 load_stream(const void* p) {  // read once: no L1 allocation
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ float2 to_float2(uint32_t bits, __half) { return __half22float2(*reinterpret_cast<__half2*>(&bits)); }
__device__ __forceinline__ float2 to_float2(uint32_t bits, __nv_bfloat16) { return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&bits)); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// U weight rows (16 bytes each) from row k on, or zeros where the chunk is outside the block's range
template <int U>
__device__ __forceinline__ void load_weights(uint4 (&wv)[U], const char* w, size_t row_bytes, int k, bool ok) {
#pragma unroll
  for (int u = 0; u < U; ++u) wv[u] = ok ? load_stream(w + static_cast<size_t>(k + u) * row_bytes) : make_uint4(0, 0, 0, 0);
}

// U consecutive elements of x from p (2U-byte aligned) as floats: one vector load
template <typename T, int U>
__device__ __forceinline__ void load_x(const T* p, float (&out)[U]) {
  uint32_t words[U / 2];
  if constexpr (U == 8) {
    uint4 v = *reinterpret_cast<const uint4*>(p);
    words[0] = v.x, words[1] = v.y, words[2] = v.z, words[3] = v.w;
  } else if constexpr (U == 4) {
    uint2 v = *reinterpret_cast<const uint2*>(p);
    words[0] = v.x, words[1] = v.y;
  } else {
    static_assert(U == 2, "U is 2, 4 or 8");
    words[0] = *reinterpret_cast<const uint32_t*>(p);
  }
#pragma unroll
  for (int j = 0; j < U / 2; ++j) {
    float2 f = to_float2(words[j], T());
    out[2 * j] = f.x, out[2 * j + 1] = f.y;
  }
}

// U rows of x (rows beyond p.rows, in a partial group, are zeros) from row k on
template <typename T, int M, int U>
__device__ __forceinline__ void load_x_rows(const GemvParams& p, int k, float (&xv)[M][U]) {
  const T* x = static_cast<const T*>(p.x);
#pragma unroll
  for (int r = 0; r < M; ++r) {
    if (r < p.rows) {
      load_x<T, U>(x + static_cast<size_t>(r) * p.k + k, xv[r]);
    } else {
#pragma unroll
      for (int u = 0; u < U; ++u) xv[r][u] = 0.0f;
    }
  }
}

// acc += x rows (U of them from row k) times the U weight vectors of one chunk
template <typename T, int M, int U>
__device__ __forceinline__ void multiply_chunk(const GemvParams& p, int k, const uint4 (&wv)[U], float (&acc)[M][8]) {
  float xv[M][U];
  load_x_rows<T, M, U>(p, k, xv);
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const uint32_t bits[4] = {wv[u].x, wv[u].y, wv[u].z, wv[u].w};
    float wf[8];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float2 f = to_float2(bits[j], T());
      wf[2 * j] = f.x, wf[2 * j + 1] = f.y;
    }
#pragma unroll
    for (int r = 0; r < M; ++r)
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[r][j] = fmaf(xv[r][u], wf[j], acc[r][j]);
  }
}

template <typename T, int M, int TY, int U>
__device__ __forceinline__ void gemv_body(const GemvParams& p) {
  constexpr int kThreads = kTX * TY, kWarps = kThreads / 32;
  __shared__ float part[kWarps][M * kCols];           // per warp: the sums of its 4 K lanes
  __shared__ float total[M * kCols];                  // the block's sums
  __shared__ float gathered[kMaxSplits][M * kCols];   // the cluster leader's: the other blocks' sums
  const int splits = gridDim.y;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // phase 1 of the cluster barrier: arrive now, wait before writing to the leader's shared memory
  if (splits > 1) asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
  const int tx = threadIdx.x % kTX, ty = threadIdx.x / kTX, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int col = blockIdx.x * kCols + tx * 8;
  // the host makes K and k_per_split multiples of 8: a chunk of U rows is wholly inside [k0, k1) or outside
  const int k0 = blockIdx.y * p.k_per_split, k1 = min(p.k, k0 + p.k_per_split);
  const bool col_ok = col < p.n;
  const char* w = static_cast<const char*>(p.w) + static_cast<size_t>(col) * sizeof(T);
  const size_t row_bytes = static_cast<size_t>(p.n) * sizeof(T);
  float acc[M][8];
#pragma unroll
  for (int r = 0; r < M; ++r)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[r][j] = 0.0f;
  constexpr int kStep = TY * U;  // each K lane takes U consecutive rows, then the block moves on
  int kc = k0 + ty * U;
  uint4 cur[U];
  load_weights<U>(cur, w, row_bytes, kc, col_ok && kc < k1);
  wait_for_previous_kernel();  // x, the residual and y only after the previous kernel
  for (; kc < k1; kc += kStep) {
    uint4 next[U];  // the next chunk's loads are in flight while this one is multiplied
    load_weights<U>(next, w, row_bytes, kc + kStep, col_ok && kc + kStep < k1);
    multiply_chunk<T, M, U>(p, kc, cur, acc);
#pragma unroll
    for (int u = 0; u < U; ++u) cur[u] = next[u];
  }
  // the 4 K lanes of a warp (lanes tx, tx + 8, tx + 16, tx + 24), then the warps
#pragma unroll
  for (int r = 0; r < M; ++r)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float v = acc[r][j];
      v += __shfl_xor_sync(0xffffffffu, v, 8);
      v += __shfl_xor_sync(0xffffffffu, v, 16);
      if (lane < kTX) part[warp][r * kCols + tx * 8 + j] = v;
    }
  __syncthreads();
  for (int i = threadIdx.x; i < M * kCols; i += kThreads) {
    float s = 0.0f;
#pragma unroll
    for (int q = 0; q < kWarps; ++q) s += part[q][i];
    total[i] = s;
  }
  __syncthreads();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (splits > 1) {  // every block but the leader (rank 0) puts its sums into the leader's shared memory
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");  // every block of the cluster has started
    cg::cluster_group cluster = cg::this_cluster();
    const int rank = static_cast<int>(cluster.block_rank());
    if (rank > 0) {
      float* leader = cluster.map_shared_rank(&gathered[0][0], 0);
      for (int i = threadIdx.x; i < M * kCols; i += kThreads) leader[rank * M * kCols + i] = total[i];
    }
    cluster.sync();  // phase 2: the sums are in; nobody reads another block's shared memory after it
    if (rank > 0) return;
  }
#endif
  const T* res = static_cast<const T*>(p.res);
  T* y = static_cast<T*>(p.y);
  for (int i = threadIdx.x; i < M * kCols; i += kThreads) {
    const int r = i / kCols, c = blockIdx.x * kCols + i % kCols;
    if (r >= p.rows || c >= p.n) continue;
    float s = total[i];
    for (int q = 1; q < splits; ++q) s += gathered[q][i];
    const size_t at = static_cast<size_t>(r) * p.n + c;
    if (res != nullptr) s += to_float(res[at]);
    y[at] = from_float<T>(s);
  }
}

// TY K lanes (256 or 512 threads), U rows per chunk (fewer with more rows: registers), MINB blocks per SM
#define RELAXTUNE_GEMV(NAME, T, M, TY, U, MINB) \
  extern "C" __global__ void __launch_bounds__(kTX * TY, MINB) NAME(GemvParams p) { gemv_body<T, M, TY, U>(p); }

RELAXTUNE_GEMV(relaxtune_gemv_f16_m1, __half, 1, 32, 8, 2)
RELAXTUNE_GEMV(relaxtune_gemv_f16_m2, __half, 2, 32, 8, 2)
RELAXTUNE_GEMV(relaxtune_gemv_f16_m4, __half, 4, 32, 4, 2)
RELAXTUNE_GEMV(relaxtune_gemv_f16_m8, __half, 8, 32, 2, 2)
RELAXTUNE_GEMV(relaxtune_gemv_bf16_m1, __nv_bfloat16, 1, 32, 8, 2)
RELAXTUNE_GEMV(relaxtune_gemv_bf16_m2, __nv_bfloat16, 2, 32, 8, 2)
RELAXTUNE_GEMV(relaxtune_gemv_bf16_m4, __nv_bfloat16, 4, 32, 4, 2)
RELAXTUNE_GEMV(relaxtune_gemv_bf16_m8, __nv_bfloat16, 8, 32, 2, 2)
// grids up to the SM count: one block of 512 threads per SM, twice the loads in flight per SM
RELAXTUNE_GEMV(relaxtune_gemv_f16_m1_wide, __half, 1, 64, 8, 1)
RELAXTUNE_GEMV(relaxtune_gemv_f16_m2_wide, __half, 2, 64, 8, 1)
RELAXTUNE_GEMV(relaxtune_gemv_bf16_m1_wide, __nv_bfloat16, 1, 64, 8, 1)
RELAXTUNE_GEMV(relaxtune_gemv_bf16_m2_wide, __nv_bfloat16, 2, 64, 8, 1)

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
  for (int j = 1; j < 4; ++j) h = __hfma2(*reinterpret_cast<const __half2*>(&av[j]), *reinterpret_cast<const __half2*>(&bv[j]), h);
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
  return make_uint4(pack2(in[0], in[1], T()), pack2(in[2], in[3], T()), pack2(in[4], in[5], T()), pack2(in[6], in[7], T()));
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

// one lane's 8 elements of a head (vector `at` of src, zeros where !ok), rotated by the table row at `table` if asked
template <typename T>
__device__ __forceinline__ void load_part(const uint4* src, size_t at, bool ok, bool rotate, const uint4* cos,
                                          const uint4* sin, size_t table, int partner_lanes, bool first_half,
                                          float (&out)[8]) {
  unpack8<T>(ok ? __ldg(src + at) : make_uint4(0, 0, 0, 0), out);
  if (!rotate) return;  // uniform over the warp
  float c[8], s[8];
  unpack8<T>(ok ? __ldg(cos + table) : make_uint4(0, 0, 0, 0), c);
  unpack8<T>(ok ? __ldg(sin + table) : make_uint4(0, 0, 0, 0), s);
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float partner = __shfl_xor_sync(0xffffffffu, out[e], partner_lanes);
    out[e] = round_to<T>(out[e] * c[e] + (first_half ? -partner : partner) * s[e]);
  }
}

// the attention of `rows` (<= M) rows into xs (rows x K), by threads [0, threads) of the block (whole warps); no barrier
template <typename T, int M>
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
    for (int j = 0; j < M; ++j) {
      if (j >= rows) break;
      const size_t table = static_cast<size_t>(j) * lanes + sub;
      load_part<T>(k, (static_cast<size_t>(j) * a.k_row + (a.k_head0 + kv) * d) / 8 + sub, ok, a.rope == 2, cos, sin,
                   table, lanes / 2, first_half, keys[j]);
      load_part<T>(v, (static_cast<size_t>(j) * a.v_row + (a.v_head0 + kv) * d) / 8 + sub, ok, false, cos, sin, table,
                   lanes / 2, first_half, values[j]);
      load_part<T>(q, (static_cast<size_t>(j) * a.q_row + (a.q_head0 + h) * d) / 8 + sub, ok, a.rope >= 1, cos, sin,
                   table, lanes / 2, first_half, query[j]);
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
// SM) for larger ones (H200: qkv 25.4 us against 26.0, notes s17); cuda_gemv.py picks
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
#define RELAXTUNE_GEMV_NK_X(NAME, P, GLU)                                                                                  \
  extern "C" __global__ void __launch_bounds__(512, 1) relaxtune_gemv_nk_##NAME##_f16_m1(GemvParams p) { gemv_nk_body<__half, 1, 2, 4, P, GLU>(p); } \
  extern "C" __global__ void __launch_bounds__(512, 1) relaxtune_gemv_nk_##NAME##_f16_m2(GemvParams p) { gemv_nk_body<__half, 2, 2, 4, P, GLU>(p); } \
  extern "C" __global__ void __launch_bounds__(512, 1) relaxtune_gemv_nk_##NAME##_bf16_m1(GemvParams p) { gemv_nk_body<__nv_bfloat16, 1, 2, 4, P, GLU>(p); } \
  extern "C" __global__ void __launch_bounds__(512, 1) relaxtune_gemv_nk_##NAME##_bf16_m2(GemvParams p) { gemv_nk_body<__nv_bfloat16, 2, 2, 4, P, GLU>(p); } \
  extern "C" __global__ void __launch_bounds__(256, 2) relaxtune_gemv_nk_##NAME##_f16_m1_narrow(GemvParams p) { gemv_nk_body<__half, 1, 2, 4, P, GLU>(p); } \
  extern "C" __global__ void __launch_bounds__(256, 2) relaxtune_gemv_nk_##NAME##_f16_m2_narrow(GemvParams p) { gemv_nk_body<__half, 2, 2, 4, P, GLU>(p); } \
  extern "C" __global__ void __launch_bounds__(256, 2) relaxtune_gemv_nk_##NAME##_bf16_m1_narrow(GemvParams p) { gemv_nk_body<__nv_bfloat16, 1, 2, 4, P, GLU>(p); } \
  extern "C" __global__ void __launch_bounds__(256, 2) relaxtune_gemv_nk_##NAME##_bf16_m2_narrow(GemvParams p) { gemv_nk_body<__nv_bfloat16, 2, 2, 4, P, GLU>(p); }

RELAXTUNE_GEMV_NK_X(rms, kRmsX, false)
RELAXTUNE_GEMV_NK_X(swiglu, kSwiGluX, false)
RELAXTUNE_GEMV_NK_X(glu, kPlainX, true)
RELAXTUNE_GEMV_NK_X(rms_glu, kRmsX, true)

// the attention prologue (o_proj of a one- or two-row bucket: the attention before it is no kernel of its own)
#define RELAXTUNE_GEMV_NK_ATTN(NAME, T, M, THREADS, MINB) \
  extern "C" __global__ void __launch_bounds__(THREADS, MINB) NAME(GemvParams p, AttnParams a) { gemv_nk_body<T, M, 2, 4, kAttnX>(p, &a); }

RELAXTUNE_GEMV_NK_ATTN(relaxtune_gemv_nk_attn_f16_m1, __half, 1, 512, 1)
RELAXTUNE_GEMV_NK_ATTN(relaxtune_gemv_nk_attn_f16_m2, __half, 2, 512, 1)
RELAXTUNE_GEMV_NK_ATTN(relaxtune_gemv_nk_attn_bf16_m1, __nv_bfloat16, 1, 512, 1)
RELAXTUNE_GEMV_NK_ATTN(relaxtune_gemv_nk_attn_bf16_m2, __nv_bfloat16, 2, 512, 1)
RELAXTUNE_GEMV_NK_ATTN(relaxtune_gemv_nk_attn_f16_m1_narrow, __half, 1, 256, 2)
RELAXTUNE_GEMV_NK_ATTN(relaxtune_gemv_nk_attn_f16_m2_narrow, __half, 2, 256, 2)
RELAXTUNE_GEMV_NK_ATTN(relaxtune_gemv_nk_attn_bf16_m1_narrow, __nv_bfloat16, 1, 256, 2)
RELAXTUNE_GEMV_NK_ATTN(relaxtune_gemv_nk_attn_bf16_m2_narrow, __nv_bfloat16, 2, 256, 2)
