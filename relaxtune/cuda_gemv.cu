// relaxtune's decode GEMV: y[r, :] = x[r, :] @ W (+ res[r, :]) for a few rows r, W (K, N) row-major,
// fp16 or bf16 in and out, fp32 accumulation (host side and the measurements: cuda_gemv.py).
//
// A block owns 64 output columns (kCols) of one K range: 8 column threads each load 16 bytes (8
// columns) of a weight row, so a warp reads 32 / 8 whole 128-byte row segments per load, and each
// of the block's TY K lanes takes U consecutive rows (x: one U-element vector load per row of x),
// then the block moves on by TY U rows. Two loops (B):
// - B = 0 (256 threads, 2 blocks per SM): each thread issues the next chunk's U weight loads
//   before it multiplies the current chunk (grids larger than the SM count: qkv's 192 tiles);
// - B > 0 (512 threads, 1 block per SM, for grids that fit the SMs in one wave: o_proj and down,
//   64 tiles x 2 K splits): each thread issues B chunks (B U 16-byte loads, 128 KB per SM in flight)
//   before it multiplies them; measured 6% faster than B = 0 for down on an H200 (notes s15/gemv).
// Up to M rows of x share one pass over the weights (M = 1, 2, 4, 8). The K lanes reduce through
// warp shuffles and shared memory.
// With N = 4096 there are only 64 column tiles for 132 SMs, so the K range is split over the
// blocks of a thread-block cluster (1, splits, 1) (compute capability 9.0): each block reduces
// its partial sums into its own shared memory, and after a cluster barrier every block sums one
// slice of the tile's outputs over the cluster's shared memory (DSMEM) and writes it, with the
// residual added in fp32. No global workspace, no atomics, nothing zeroed: a CUDA graph
// captures the launch as it is. splits = 1 is a plain launch (any sm_80+ GPU).
// Launched as a programmatic dependent (the host's RELAXTUNE_GEMV_PDL), a block issues its first
// weight loads and only then waits for the previous kernel (griddepcontrol.wait) before it reads
// x or writes y; otherwise the wait returns at once.
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

constexpr int kTX = 8, kCols = kTX * 8;

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

template <typename T, int M, int TY, int U, int B>
__device__ __forceinline__ void gemv_body(const GemvParams& p) {
  constexpr int kThreads = kTX * TY, kWarps = kThreads / 32;
  __shared__ float part[kWarps][M * kCols];  // per warp: the sums of its 4 K lanes
  __shared__ float total[M * kCols];         // the block's sums (read by the whole cluster)
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
  if constexpr (B == 0) {
    int kc = k0 + ty * U;
    uint4 cur[U];
    load_weights<U>(cur, w, row_bytes, kc, col_ok && kc < k1);
    wait_for_previous_kernel();
    for (; kc < k1; kc += kStep) {
      uint4 next[U];  // the next chunk's loads are in flight while this one is multiplied
      load_weights<U>(next, w, row_bytes, kc + kStep, col_ok && kc + kStep < k1);
      multiply_chunk<T, M, U>(p, kc, cur, acc);
#pragma unroll
      for (int u = 0; u < U; ++u) cur[u] = next[u];
    }
  } else {
    uint4 wv[B][U];  // B chunks' loads issued before the first is used
    auto load_batch = [&](int kb) {
#pragma unroll
      for (int b = 0; b < B; ++b) load_weights<U>(wv[b], w, row_bytes, kb + b * kStep, col_ok && kb + b * kStep < k1);
    };
    int kb = k0 + ty * U;
    load_batch(kb);
    wait_for_previous_kernel();
    for (; kb < k1; kb += B * kStep) {
#pragma unroll
      for (int b = 0; b < B; ++b)
        if (kb + b * kStep < k1) multiply_chunk<T, M, U>(p, kb + b * kStep, wv[b], acc);
      load_batch(kb + B * kStep);
    }
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

// TY K lanes (256 or 512 threads); U rows per chunk (fewer with more rows); B chunks per batch (0:
// the double-buffered loop); MINB blocks per SM the registers must allow
#define RELAXTUNE_GEMV(NAME, T, M, TY, U, B, MINB) \
  extern "C" __global__ void __launch_bounds__(kTX * TY, MINB) NAME(GemvParams p) { gemv_body<T, M, TY, U, B>(p); }

RELAXTUNE_GEMV(relaxtune_gemv_f16_m1, __half, 1, 32, 8, 0, 2)
RELAXTUNE_GEMV(relaxtune_gemv_f16_m2, __half, 2, 32, 8, 0, 2)
RELAXTUNE_GEMV(relaxtune_gemv_f16_m4, __half, 4, 32, 4, 0, 2)
RELAXTUNE_GEMV(relaxtune_gemv_f16_m8, __half, 8, 32, 2, 0, 2)
RELAXTUNE_GEMV(relaxtune_gemv_bf16_m1, __nv_bfloat16, 1, 32, 8, 0, 2)
RELAXTUNE_GEMV(relaxtune_gemv_bf16_m2, __nv_bfloat16, 2, 32, 8, 0, 2)
RELAXTUNE_GEMV(relaxtune_gemv_bf16_m4, __nv_bfloat16, 4, 32, 4, 0, 2)
RELAXTUNE_GEMV(relaxtune_gemv_bf16_m8, __nv_bfloat16, 8, 32, 2, 0, 2)
// one block per SM (grids up to the SM count), 16 loads in flight per thread
RELAXTUNE_GEMV(relaxtune_gemv_f16_m1_wide, __half, 1, 64, 8, 2, 1)
RELAXTUNE_GEMV(relaxtune_gemv_f16_m2_wide, __half, 2, 64, 8, 2, 1)
RELAXTUNE_GEMV(relaxtune_gemv_bf16_m1_wide, __nv_bfloat16, 1, 64, 8, 2, 1)
RELAXTUNE_GEMV(relaxtune_gemv_bf16_m2_wide, __nv_bfloat16, 2, 64, 8, 2, 1)
