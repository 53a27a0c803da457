// relaxtune's 4-bit decode GEMV streamed through shared memory (compute capability 9.0+): the product of qgemv.cu,
// y[r, :] = x[r, :] @ W^T (+ res[r, :]) for one or two rows r, W (N, K) in the GPU layout with fp16 scales per
// group, fp32 accumulation. Appended after gemv.cu, qgemv.cu and qstream_ring.cu in one fatbin (kernels/gemv.py): it
// uses their wait_for_previous_kernel, half2_bits, dequantize_word and the ring. Host side: qgemv_host.cc, which
// takes these kernels where K / group is a multiple of 8 (16-byte scale rows), K <= 256 * 16 * PMAX and the ring
// fits, else qgemv.cu's.
//
// One block per SM owns a contiguous range of output features (rows of W, N / grid +-1 of them), so its weights
// and their scales are two contiguous byte ranges. A producer warp copies them, RS = GR * RPG rows at a time, into a
// ring of `stages` shared-memory slots with bulk asynchronous copies (cp.async.bulk: one per slot for the weights,
// one for the scales; an mbarrier counts the bytes), a slot again as soon as every consumer warp has released it:
// up to ~220 KB per SM in flight, the first slots issued before the consumers' griddepcontrol.wait. (qgemv.cu keeps
// 4 vectors per lane in flight, 32 KB per SM: at 36-55% of the copy rate it was bound by that, not by arithmetic.)
// The 8 * GR consumer warps are K-stationary: thread t of a row group (256 threads) owns the 16-weight pieces
// (8 bytes of a row) t, t + 256, ... (at most PMAX), so its pieces of x (16 halfs per row of x) stay in registers for
// the whole kernel and shared memory carries the weights only; row group g takes rows g * RPG .. g * RPG + RPG - 1
// of every slot. Per row and piece: one 8-byte shared load, qgemv.cu's dequantization (lop3 + HFMA2, no
// conversion), 8 HFMA2 per row of x (the 8 products of each half summed in fp16, as qgemv.cu), then fp32 times the
// group's scale. After a slot (released first), a warp's RPG * M sums are reduced over its lanes by a transposing
// butterfly (RPG * M - 1 shuffles and adds for the first halvings, then one per remaining lane bit) and kept in
// shared memory per (row, warp); at the end the 8 warps' sums of each row are added in a fixed order, with the
// residual, and written. No global workspace, no atomics: a CUDA graph captures the launch as it is.
//
// With int8 activations (I8; the i8 families, as llama.cpp's Q8_1 dot products): each thread quantizes its pieces of
// x once, before the loop, to int8 with one float scale per piece of 16 (absmax / 127, round to nearest even), the
// bytes permuted to the nibbles' order in a word, and keeps -8 x their sum. A row's piece is then 4 lop3 masks
// (low nibbles, and high nibbles 16 x as large) and 4 dp4a (u8 x s8, int32 sums starting at -8 sum(x)), one IMAD
// that joins the two sums, one conversion and one FMA with the weight's and x's scales: about 15 instructions per 16
// weights against about 35 for the fp16 products, which bound the fp16 kernel below the copy rate. The integer sums
// are exact; x's rounding to int8 is the only other error.
//
// x prologue (P, gemv_prologue.cu's kinds, with int8 activations): kRmsX, x = rms_norm(x, g, eps) over K: each row
// group's 256 threads hold the whole row of x, so their sums of squares meet in shared memory behind a named barrier of
// the group, and each thread scales its own pieces (fp32, one rounding to fp16, as TVM's legalized rms_norm). The
// RMSNorm before a decode projection is then no kernel.
#include <cuda_fp16.h>
#include <stdint.h>

struct Q4StreamParams {  // must match qgemv_host.cc
  const void* x;      // (rows, k) fp16
  const void* w;      // (n, k / 8) uint32, the GPU layout
  const void* scale;  // (n, k >> (5 + group_shift)) fp16
  const void* res;    // (rows, n) fp16 residual, or null
  void* y;            // (rows, n) fp16
  int rows;           // rows of x in this launch (<= M)
  int k, n;
  int group_shift;    // group = 32 << group_shift weights per scale
  int stages;         // ring slots (<= kQ4StreamMaxStages)
  const void* g;      // kRmsX: the norm's weight (K) fp16, else null
  float eps;          // kRmsX: its epsilon
};

constexpr int kQ4ScratchBytes = 256;  // after the partial sums: the norm's per-warp sums of squares

template <int M, int GR, int RPG, int PMAX, bool I8, int P>
__device__ __forceinline__ void q4stream_body(const Q4StreamParams& p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int RS = GR * RPG, kConsumers = kQ4PieceThreads * GR, NV = RPG * M, kWarpsPerGroup = kQ4PieceThreads / 32;
  static_assert(GR * M * 8 * sizeof(float) <= kQ4ScratchBytes, "the norm's per-warp sums fit the host's scratch");
  static_assert((NV & (NV - 1)) == 0 && NV <= 32, "RPG * M is a power of two <= 32");
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + kQ4StreamMaxStages;
  const int row0 = static_cast<int>(static_cast<long long>(blockIdx.x) * p.n / gridDim.x);
  const int rows = static_cast<int>(static_cast<long long>(blockIdx.x + 1) * p.n / gridDim.x) - row0;
  const int row_bytes = p.k / 2, groups = p.k >> (5 + p.group_shift), scale_row_bytes = 2 * groups;
  const int weight_bytes = RS * row_bytes, stage_bytes = weight_bytes + RS * scale_row_bytes;
  const int slots = (rows + RS - 1) / RS;
  unsigned char* ring = smem + kQ4BarrierBytes;
  float* part = reinterpret_cast<float*>(ring + static_cast<size_t>(p.stages) * stage_bytes);  // [rows][M][8 warps]
  if (threadIdx.x == 0) {
    for (int s = 0; s < p.stages; ++s) barrier_init(&full[s], 1), barrier_init(&empty[s], GR * kWarpsPerGroup);
    asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x >= kConsumers) {  // the producer warp: reads weights only, never waits for the previous kernel
    if (threadIdx.x == kConsumers) {
      const char* w = static_cast<const char*>(p.w) + static_cast<size_t>(row0) * row_bytes;
      const char* scale = static_cast<const char*>(p.scale) + static_cast<size_t>(row0) * scale_row_bytes;
      for (int s = 0; s < slots; ++s) {
        const int slot = s % p.stages, here = min(RS, rows - s * RS);
        if (s >= p.stages) barrier_wait(&empty[slot], (s / p.stages - 1) & 1);  // every consumer warp is done with it
        unsigned char* dst = ring + static_cast<size_t>(slot) * stage_bytes;
        barrier_expect_bytes(&full[slot], here * (row_bytes + scale_row_bytes));
        bulk_copy(dst, w + static_cast<size_t>(s) * weight_bytes, here * row_bytes, &full[slot]);
        bulk_copy(dst + weight_bytes, scale + static_cast<size_t>(s) * RS * scale_row_bytes, here * scale_row_bytes,
                  &full[slot]);
      }
    }
    return;
  }
  const int g = threadIdx.x / kQ4PieceThreads, t = threadIdx.x % kQ4PieceThreads, lane = t % 32, warp = t / 32;
  const int pieces = p.k / 16;
  const uint4* x = static_cast<const uint4*>(p.x);
  const __half* res = static_cast<const __half*>(p.res);
  __half* y = static_cast<__half*>(p.y);
  wait_for_previous_kernel();  // x, the residual and y only after the previous kernel
  uint4 gv[P == kRmsX ? PMAX : 1][2];  // kRmsX: the norm's weight for this thread's pieces, loaded with x
  if constexpr (P == kRmsX) {
#pragma unroll
    for (int j = 0; j < PMAX; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int piece = t + j * kQ4PieceThreads;
        gv[j][h] = piece < pieces ? __ldg(static_cast<const uint4*>(p.g) + 2 * piece + h) : make_uint4(0, 0, 0, 0);
      }
  }
  uint4 xv[M][PMAX][2];        // this thread's pieces of x: 16 halfs each
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int j = 0; j < PMAX; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int piece = t + j * kQ4PieceThreads;
        xv[m][j][h] = m < p.rows && piece < pieces ? __ldg(x + static_cast<size_t>(m) * (p.k / 8) + 2 * piece + h)
                                                   : make_uint4(0, 0, 0, 0);
      }
  if constexpr (P == kRmsX) {  // the row group's sum of squares, then each thread's pieces scaled by g
    float* scratch = reinterpret_cast<float*>(part + static_cast<size_t>(rows) * M * kWarpsPerGroup) + g * M * 8;
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float sq = 0.0f;
#pragma unroll
      for (int j = 0; j < PMAX; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float f[8];
          unpack8<__half>(xv[m][j][h], f);
#pragma unroll
          for (int e = 0; e < 8; ++e) sq = fmaf(f[e], f[e], sq);
        }
#pragma unroll
      for (int o = 16; o > 0; o /= 2) sq += __shfl_xor_sync(0xffffffffu, sq, o);
      if (lane == 0) scratch[m * 8 + warp] = sq;
    }
    asm volatile("bar.sync %0, %1;" ::"r"(2 + g), "r"(kQ4PieceThreads) : "memory");  // this row group's warps
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float sum = 0.0f;
#pragma unroll
      for (int q = 0; q < kWarpsPerGroup; ++q) sum += scratch[m * 8 + q];
      const float scale = rsqrtf(sum / static_cast<float>(p.k) + p.eps);
#pragma unroll
      for (int j = 0; j < PMAX; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float f[8], gf[8];
          unpack8<__half>(xv[m][j][h], f);
          unpack8<__half>(gv[j][h], gf);
#pragma unroll
          for (int e = 0; e < 8; ++e) f[e] = scale * f[e] * gf[e];
          xv[m][j][h] = pack8<__half>(f);
        }
    }
  }
  uint32_t xq[M][PMAX][4];  // I8: the pieces as int8, -8 x their sums, their scales / 16 (else unused)
  int xcorr[M][PMAX];
  float xscale[M][PMAX];
  if constexpr (I8) {
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int j = 0; j < PMAX; ++j) quantize_piece(xv[m][j], xq[m][j], xcorr[m][j], xscale[m][j]);
  }
  const int first_out = threadIdx.x, first_row = first_out / M, first_m = first_out % M;  // its first output, below
  const float first_res = res != nullptr && first_row < rows && first_m < p.rows
                              ? __half2float(res[static_cast<size_t>(first_m) * p.n + row0 + first_row]) : 0.0f;
  Q4RingSlot at;
  for (int s = 0; s < slots; ++s, at.next(p.stages)) {
    const int slot = at.slot, base = s * RS + g * RPG;  // the block row of this group's first row in the slot
    barrier_wait(&full[slot], at.phase);
    const unsigned char* slot_base = ring + static_cast<size_t>(slot) * stage_bytes;
    const unsigned char* wslot = slot_base + g * RPG * row_bytes;  // this group's rows: weights, then scales
    const __half* sslot = reinterpret_cast<const __half*>(slot_base + weight_bytes) + g * RPG * groups;
    float acc[NV];
#pragma unroll
    for (int i = 0; i < NV; ++i) acc[i] = 0.0f;
#pragma unroll
    for (int i = 0; i < RPG; ++i) {
      if (base + i >= rows) break;  // the same for the whole warp
#pragma unroll
      for (int j = 0; j < PMAX; ++j) {
        const int piece = t + j * kQ4PieceThreads;
        if (piece >= pieces) break;
        const uint2 q = *reinterpret_cast<const uint2*>(wslot + i * row_bytes + 8 * piece);
        const float sc = __half2float(sslot[i * groups + (piece >> (1 + p.group_shift))]);
        if constexpr (I8) {
#pragma unroll
          for (int m = 0; m < M; ++m)
            acc[i * M + m] =
                fmaf(static_cast<float>(dot_piece_i8(q, xq[m][j], xcorr[m][j])), sc * xscale[m][j], acc[i * M + m]);
          continue;
        }
        __half2 wv[8];
        dequantize_word(q.x, wv), dequantize_word(q.y, wv + 4);
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const uint32_t xs[8] = {xv[m][j][0].x, xv[m][j][0].y, xv[m][j][0].z, xv[m][j][0].w,
                                  xv[m][j][1].x, xv[m][j][1].y, xv[m][j][1].z, xv[m][j][1].w};
          __half2 d = __hmul2(half2_bits(xs[0]), wv[0]);
#pragma unroll
          for (int e = 1; e < 8; ++e) d = __hfma2(half2_bits(xs[e]), wv[e], d);
          const float2 f = __half22float2(d);
          acc[i * M + m] = fmaf(f.x + f.y, sc, acc[i * M + m]);
        }
      }
    }
    __syncwarp();
    if (lane == 0) barrier_arrive(&empty[slot]);  // the slot's shared memory is read: the producer may refill it
    const float sum = warp_transposed_sum<NV>(acc, lane);
    const int which = lane / (32 / NV), row = base + which / M;
    if (lane % (32 / NV) == 0 && row < rows) part[(row * M + which % M) * kWarpsPerGroup + warp] = sum;
  }
  asm volatile("bar.sync 1, %0;" ::"r"(kConsumers) : "memory");  // the consumer warps only: the producer has left
  for (int out = first_out; out < rows * M; out += kConsumers) {
    const int row = out / M, m = out % M;
    if (m >= p.rows) continue;
    float s = 0.0f;
#pragma unroll
    for (int q = 0; q < kWarpsPerGroup; ++q) s += part[out * kWarpsPerGroup + q];
    const size_t at = static_cast<size_t>(m) * p.n + row0 + row;
    if (res != nullptr) s += out == first_out ? first_res : __half2float(res[at]);
    y[at] = __float2half_rn(s);
  }
#endif
}

// GR row groups of 8 warps (+ the producer warp), RPG rows per group per slot, up to PMAX pieces of K per thread
#define RELAXTUNE_Q4STREAM_X(NAME, M, GR, RPG, PMAX, I8, P)                                                \
  extern "C" __global__ void __launch_bounds__(kQ4PieceThreads * GR + 32, 1) NAME(Q4StreamParams p) { \
    q4stream_body<M, GR, RPG, PMAX, I8, P>(p);                                                             \
  }
#define RELAXTUNE_Q4STREAM(NAME, M, GR, RPG, PMAX, I8) RELAXTUNE_Q4STREAM_X(NAME, M, GR, RPG, PMAX, I8, kPlainX)

// name: relaxtune_q4gemv_[i8]s<GR>r<RPG>p<PMAX>_m<M> (i8: int8 activations); qgemv_host.cc's kQ4StreamKernels
// lists them. Three row groups (800 threads: <= 80 registers) only with one piece: with three, two rows of x spill
RELAXTUNE_Q4STREAM(relaxtune_q4gemv_s2r4p1_m1, 1, 2, 4, 1, false)
RELAXTUNE_Q4STREAM(relaxtune_q4gemv_s2r4p1_m2, 2, 2, 4, 1, false)
RELAXTUNE_Q4STREAM(relaxtune_q4gemv_s2r4p3_m1, 1, 2, 4, 3, false)
RELAXTUNE_Q4STREAM(relaxtune_q4gemv_s2r4p3_m2, 2, 2, 4, 3, false)
RELAXTUNE_Q4STREAM(relaxtune_q4gemv_s2r8p1_m1, 1, 2, 8, 1, false)
RELAXTUNE_Q4STREAM(relaxtune_q4gemv_s2r8p1_m2, 2, 2, 8, 1, false)
RELAXTUNE_Q4STREAM(relaxtune_q4gemv_s2r2p3_m1, 1, 2, 2, 3, false)
RELAXTUNE_Q4STREAM(relaxtune_q4gemv_s2r2p3_m2, 2, 2, 2, 3, false)
RELAXTUNE_Q4STREAM(relaxtune_q4gemv_s3r2p1_m1, 1, 3, 2, 1, false)
RELAXTUNE_Q4STREAM(relaxtune_q4gemv_s3r2p1_m2, 2, 3, 2, 1, false)
RELAXTUNE_Q4STREAM(relaxtune_q4gemv_s1r8p1_m1, 1, 1, 8, 1, false)
RELAXTUNE_Q4STREAM(relaxtune_q4gemv_s1r8p1_m2, 2, 1, 8, 1, false)
RELAXTUNE_Q4STREAM(relaxtune_q4gemv_s1r8p3_m1, 1, 1, 8, 3, false)
RELAXTUNE_Q4STREAM(relaxtune_q4gemv_s1r8p3_m2, 2, 1, 8, 3, false)
RELAXTUNE_Q4STREAM(relaxtune_q4gemv_i8s2r4p1_m1, 1, 2, 4, 1, true)
RELAXTUNE_Q4STREAM(relaxtune_q4gemv_i8s2r4p1_m2, 2, 2, 4, 1, true)
RELAXTUNE_Q4STREAM(relaxtune_q4gemv_i8s2r4p3_m1, 1, 2, 4, 3, true)
RELAXTUNE_Q4STREAM(relaxtune_q4gemv_i8s2r4p3_m2, 2, 2, 4, 3, true)
RELAXTUNE_Q4STREAM(relaxtune_q4gemv_i8s2r8p1_m1, 1, 2, 8, 1, true)
RELAXTUNE_Q4STREAM(relaxtune_q4gemv_i8s2r8p1_m2, 2, 2, 8, 1, true)
RELAXTUNE_Q4STREAM(relaxtune_q4gemv_i8s1r8p1_m1, 1, 1, 8, 1, true)
RELAXTUNE_Q4STREAM(relaxtune_q4gemv_i8s1r8p1_m2, 2, 1, 8, 1, true)
RELAXTUNE_Q4STREAM(relaxtune_q4gemv_i8s1r8p3_m1, 1, 1, 8, 3, true)
RELAXTUNE_Q4STREAM(relaxtune_q4gemv_i8s1r8p3_m2, 2, 1, 8, 3, true)
// with the RMSNorm as x's prologue (int8 activations only): _rms
RELAXTUNE_Q4STREAM_X(relaxtune_q4gemv_i8s2r8p1_rms_m1, 1, 2, 8, 1, true, kRmsX)
RELAXTUNE_Q4STREAM_X(relaxtune_q4gemv_i8s2r8p1_rms_m2, 2, 2, 8, 1, true, kRmsX)
RELAXTUNE_Q4STREAM_X(relaxtune_q4gemv_i8s2r4p1_rms_m1, 1, 2, 4, 1, true, kRmsX)
RELAXTUNE_Q4STREAM_X(relaxtune_q4gemv_i8s2r4p1_rms_m2, 2, 2, 4, 1, true, kRmsX)
RELAXTUNE_Q4STREAM_X(relaxtune_q4gemv_i8s2r4p3_rms_m1, 1, 2, 4, 3, true, kRmsX)
RELAXTUNE_Q4STREAM_X(relaxtune_q4gemv_i8s2r4p3_rms_m2, 2, 2, 4, 3, true, kRmsX)
