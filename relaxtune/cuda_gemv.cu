// relaxtune's decode GEMV: y[r, :] = x[r, :] @ W (+ res[r, :]) for a few rows r, W (K, N) row-major,
// fp16 or bf16 in and out, fp32 accumulation (host side and the measurements: cuda_gemv.py).
//
// A block owns 64 output columns (kCols) of one K range: 8 column threads each load 16 bytes (8
// columns) of a weight row, so a warp reads 4 whole 128-byte row segments per load, and each of
// the block's 32 K lanes takes U consecutive rows (x: one U-element vector load per row of x),
// then the block moves on by 32 U rows. Each thread issues the next chunk's U weight loads
// (unrolled) before it multiplies the current chunk with up to M rows of x (M = 1, 2, 4, 8: the
// rows share one pass over the weights). The K lanes reduce through warp shuffles and shared memory.
// With N = 4096 there are only 64 column tiles for 132 SMs, so the K range is split over the
// blocks of a thread-block cluster (1, splits, 1) (compute capability 9.0): each block reduces
// its partial sums into its own shared memory, and after a cluster barrier every block sums one
// slice of the tile's outputs over the cluster's shared memory (DSMEM) and writes it, with the
// residual added in fp32. No global workspace, no atomics, nothing zeroed: a CUDA graph
// captures the launch as it is. splits = 1 is a plain launch (any sm_80+ GPU).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
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
};

constexpr int kTX = 8, kTY = 32, kThreads = kTX * kTY, kCols = kTX * 8, kWarps = kThreads / 32;

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

template <typename T, int M, int U>
__device__ __forceinline__ void gemv_body(const GemvParams& p) {
  __shared__ float part[kWarps][M * kCols];  // per warp: the sums of its 4 K lanes
  __shared__ float total[M * kCols];         // the block's sums (read by the whole cluster)
  const int tx = threadIdx.x % kTX, ty = threadIdx.x / kTX, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int col = blockIdx.x * kCols + tx * 8;
  // the host makes K and k_per_split multiples of 8: a chunk of U rows is wholly inside [k0, k1) or outside
  const int k0 = blockIdx.y * p.k_per_split, k1 = min(p.k, k0 + p.k_per_split);
  const bool col_ok = col < p.n;
  const T* x = static_cast<const T*>(p.x);
  const char* w = static_cast<const char*>(p.w) + static_cast<size_t>(col) * sizeof(T);
  const size_t row_bytes = static_cast<size_t>(p.n) * sizeof(T);
  float acc[M][8];
#pragma unroll
  for (int r = 0; r < M; ++r)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[r][j] = 0.0f;
  constexpr int kStep = kTY * U;  // each K lane takes U consecutive rows, then the block moves on
  int kc = k0 + ty * U;
  uint4 cur[U];
  load_weights<U>(cur, w, row_bytes, kc, col_ok && kc < k1);
  for (; kc < k1; kc += kStep) {
    uint4 next[U];  // the next chunk's loads are in flight while this one is multiplied
    load_weights<U>(next, w, row_bytes, kc + kStep, col_ok && kc + kStep < k1);
    float xv[M][U];  // rows beyond p.rows (a partial group) multiply by zero
#pragma unroll
    for (int r = 0; r < M; ++r) {
      if (r < p.rows) {
        load_x<T, U>(x + static_cast<size_t>(r) * p.k + kc, xv[r]);
      } else {
#pragma unroll
        for (int u = 0; u < U; ++u) xv[r][u] = 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const uint32_t bits[4] = {cur[u].x, cur[u].y, cur[u].z, cur[u].w};
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
  int begin = 0, end = M * kCols, splits = gridDim.y;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cg::cluster_group cluster = cg::this_cluster();
  if (splits > 1) {  // this block writes slice `rank` of the tile, summed over the cluster's blocks
    cluster.sync();
    const int rank = static_cast<int>(cluster.block_rank()), slice = (M * kCols + splits - 1) / splits;
    begin = rank * slice, end = min(M * kCols, begin + slice);
  }
#else
  splits = 1;
#endif
  if (splits == 1) __syncthreads();
  const T* res = static_cast<const T*>(p.res);
  T* y = static_cast<T*>(p.y);
  for (int i = begin + threadIdx.x; i < end; i += kThreads) {
    const int r = i / kCols, c = blockIdx.x * kCols + i % kCols;
    if (r >= p.rows || c >= p.n) continue;
    float s = 0.0f;
    if (splits == 1) {
      s = total[i];
    } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      for (int q = 0; q < splits; ++q) s += *cluster.map_shared_rank(&total[i], q);
#endif
    }
    const size_t at = static_cast<size_t>(r) * p.n + c;
    if (res != nullptr) s += to_float(res[at]);
    y[at] = from_float<T>(s);
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (splits > 1) cluster.sync();  // no block leaves while another still reads its shared memory
#endif
}

// U: weight loads in flight per thread (16 bytes each), fewer with more rows; B: blocks per SM the
// registers must allow (M = 8 would take 143 registers, one block per SM)
#define RELAXTUNE_GEMV(NAME, T, M, U, B) \
  extern "C" __global__ void __launch_bounds__(kThreads, B) NAME(GemvParams p) { gemv_body<T, M, U>(p); }

RELAXTUNE_GEMV(relaxtune_gemv_f16_m1, __half, 1, 8, 2)
RELAXTUNE_GEMV(relaxtune_gemv_f16_m2, __half, 2, 8, 2)
RELAXTUNE_GEMV(relaxtune_gemv_f16_m4, __half, 4, 4, 2)
RELAXTUNE_GEMV(relaxtune_gemv_f16_m8, __half, 8, 2, 2)
RELAXTUNE_GEMV(relaxtune_gemv_bf16_m1, __nv_bfloat16, 1, 8, 2)
RELAXTUNE_GEMV(relaxtune_gemv_bf16_m2, __nv_bfloat16, 2, 8, 2)
RELAXTUNE_GEMV(relaxtune_gemv_bf16_m4, __nv_bfloat16, 4, 4, 2)
RELAXTUNE_GEMV(relaxtune_gemv_bf16_m8, __nv_bfloat16, 8, 2, 2)
