// relaxtune's decode GEMVs: y[r, :] = x[r, :] @ W (+ res[r, :]) for a few rows r, W (K, N) row-major, or W^T for
// W (N, K) (the "nk" kernels of gemv_nk.cu), fp16 or bf16 in and out, fp32 accumulation (host side:
// gemv_host.cc; the functions and their conditions: kernels/gemv.py).
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
// Launched as a programmatic dependent (gemv_host.cc does on 9.0+), a block issues its first
// weight loads and only then waits for the previous kernel (griddepcontrol.wait) before it reads
// x or the residual or writes y; launched plainly, the wait returns at once.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#include <math.h>
#include <stdint.h>

namespace cg = cooperative_groups;

struct GemvParams {  // must match gemv_host.cc
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

constexpr int kTX = 8, kCols = kTX * 8, kMaxSplits = 8;  // kMaxSplits: gemv_host.cc.s

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

__device__ __forceinline__ float2 to_float2(uint32_t bits, __half) {
  return __half22float2(*reinterpret_cast<__half2*>(&bits));
}
__device__ __forceinline__ float2 to_float2(uint32_t bits, __nv_bfloat16) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&bits));
}
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// U weight rows (16 bytes each) from row k on, or zeros where the chunk is outside the block's range
template <int U>
__device__ __forceinline__ void load_weights(uint4 (&wv)[U], const char* w, size_t row_bytes, int k, bool ok) {
#pragma unroll
  for (int u = 0; u < U; ++u)
    wv[u] = ok ? load_stream(w + static_cast<size_t>(k + u) * row_bytes) : make_uint4(0, 0, 0, 0);
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
