// relaxtune's 4-bit decode MLP in one kernel (compute capability 9.0+, int8 activations): for one row,
//   h = x @ Wo^T + res,  n = rms_norm(h, g, eps),  a = silu(n @ Wgate^T) * (n @ Wup^T),  y = a @ Wd^T + h,
// the o_proj through the down projection of a decoder layer's decode step, which qgemv_stream.cu's kernels run as
// five launches (three GEMVs, the norm, the SwiGLU). Appended after qgemv_stream.cu in one fatbin (kernels/gemv.py):
// it uses its ring helpers, quantize_piece, dot_piece_i8 and warp_transposed_sum. Host side: qmlp_host.cc.
//
// One block per SM, launched cooperatively (all blocks resident). Block b owns the same share of rows in each of the
// four weights: rows b * H / G .. of Wo and Wd, features b * F / G .. of gate and up (the merged (2F, H) weight's
// rows f and F + f). Its producer warp streams those rows, segment after segment (Wo, gate, up, Wd), through one ring
// of shared-memory slots (cp.async.bulk, as qgemv_stream.cu) without ever waiting for activations: while the
// consumer warps wait at a grid barrier, the next segment's weights are already in flight. The consumers compute
// each segment as qgemv_stream.cu's int8 kernels do (x quantized per 16 values, dp4a; RS rows per slot), then:
//   - after Wo: h for their rows (+ res, one rounding) to global memory; grid barrier;
//   - every block reads the whole h back (L2), computes the norm (fp32, one rounding, as TVM's legalized
//     rms_norm) and quantizes it; gate and up; a = silu_times(gate, up) rounded as the separate kernels round;
//     grid barrier;
//   - every block reads the whole a and quantizes it; Wd; y = sum + h.
// The grid barrier is the consumers' only (the producer never stops), on state in this module's global memory
// (q4mlp_grid_barrier). h and a are outputs (the caller's memory): written once by their owner block, read by all
// after the barrier. Each step's time in the kernel: benchmarks/q4mlp_trace.py (the `trace` stamps).
// With F in two parts (f1 > 0: the count barrier; qmlp_host.cc picks f1), the second barrier waits for nobody: the
// ring streams gate and up of part 0, then of part 1, then Wd's columns of part 0, then of part 1 (one bulk copy per
// row); the consumers arrive (a release-add, no wait) once a's part 0 is written and again after part 1, while lane 1
// of the producer warp waits for each arrival count and bulk-copies that part of a into shared memory. So every
// block computes part 1's gate and up while part 0's arrivals meet, and part 0's down while part 1's do; down's two
// sums of each row are added in a fixed order.
// Where x_bytes > 0, x is no input: every block first computes it, the attention of the step's one row (q, k, v and
// the rotary tables in `attn`, gemv.cu's attention_rows), into shared memory before the ring.

struct Q4MlpParams {  // must match qmlp_host.cc
  const void* x;          // (A) fp16: the o_proj input
  const void* res;        // (H) fp16: the residual
  const void *wo, *so;    // (H, A / 8) uint32, (H, A / group) fp16
  const void* g;          // (H) fp16: the norm's weight
  const void *wgu, *sgu;  // (2F, H / 8), (2F, H / group)
  const void *wd, *sd;    // (H, F / 8), (H, F / group)
  void* h;                // (H) fp16: x @ Wo^T + res
  void* act;              // (F) fp16: silu(gate) * up
  void* y;                // (H) fp16
  int a, hidden, f;
  int shift_o, shift_gu, shift_d;  // group = 32 << shift weights per scale
  float eps;
  int stages, stage_bytes;
  unsigned long long* trace;  // null, or per block kQ4MlpTraceEvents globaltimer stamps (benchmarks/q4mlp_trace.py)
  int barrier;                // kGenerationBarrier / kCountBarrier (q4mlp_grid_barrier)
  int x_bytes;                // > 0: x is the attention of one row (attn), computed into that much shared memory
  int f1;                     // > 0 (kCountBarrier only): gate/up and down in two parts of F, [0, f1) and [f1, F)
  AttnParams attn;            // gemv.cu's: q, k, v, the tables, the heads (x null)
};

constexpr int kQ4MlpTraceEvents = 16;
constexpr int kQ4MlpExtraBytes = 128;  // after the ring's mbarriers: the act parts' mbarriers, the launch's count base

__device__ unsigned int relaxtune_q4mlp_barrier[2];  // arrivals, generation (zero at module load)
__device__ unsigned long long relaxtune_q4mlp_arrivals;  // kCountBarrier: every arrival ever (zero at module load)
enum { kGenerationBarrier = 0, kCountBarrier = 1 };

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// event `e` of this block's trace (thread 0 of the consumers, or the producer), where one is asked for
__device__ __forceinline__ void q4mlp_stamp(const Q4MlpParams& p, int e) {
  if (p.trace == nullptr) return;
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  p.trace[blockIdx.x * kQ4MlpTraceEvents + e] = now;
}

// every consumer thread of every block: what each wrote before is visible to all after. kGenerationBarrier: the last
// block to arrive resets the count and bumps the generation the others wait on (any grid size). kCountBarrier: one
// release-add to a count of every arrival ever, then acquire-loads until it reaches the next multiple of the grid: one
// round trip fewer on the critical path, but right only while every launch on the device has the same grid (the host
// takes it where the grid is the SM count) and runs to its end.
// (kCountBarrier: where `target` is not null, thread 0 also puts the count this barrier waits for there)
__device__ __forceinline__ void q4mlp_grid_barrier(int consumers, int kind, unsigned long long* target_out = nullptr) {
  asm volatile("bar.sync 1, %0;" ::"r"(consumers) : "memory");
  if (threadIdx.x == 0 && kind == kCountBarrier) {
    unsigned long long old, now;
    asm volatile("atom.add.release.gpu.global.u64 %0, [%1], 1;"
                 : "=l"(old)
                 : "l"(&relaxtune_q4mlp_arrivals)
                 : "memory");
    const unsigned long long target = (old / gridDim.x + 1) * gridDim.x;
    if (target_out != nullptr) *target_out = target;
    do {
      asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(now) : "l"(&relaxtune_q4mlp_arrivals) : "memory");
    } while (now < target);
  } else if (threadIdx.x == 0) {
    volatile unsigned int* gen = &relaxtune_q4mlp_barrier[1];
    const unsigned int seen = *gen;
    __threadfence();
    if (atomicAdd(&relaxtune_q4mlp_barrier[0], 1u) == gridDim.x - 1) {
      atomicExch(&relaxtune_q4mlp_barrier[0], 0u);
      __threadfence();
      atomicAdd(&relaxtune_q4mlp_barrier[1], 1u);
    } else {
      while (*gen == seen) __nanosleep(32);
    }
    __threadfence();
  }
  asm volatile("bar.sync 1, %0;" ::"r"(consumers) : "memory");
}

// kCountBarrier's two halves for the split MLP: every consumer thread arrives (what each wrote before is visible to
// whoever sees the count reach the arrival's multiple of the grid) without waiting ...
__device__ __forceinline__ void q4mlp_count_arrive(int consumers) {
  asm volatile("bar.sync 1, %0;" ::"r"(consumers) : "memory");
  if (threadIdx.x == 0) {
    asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(&relaxtune_q4mlp_arrivals) : "memory");
  }
}

// ... and one thread waits for the count to reach `target`, then may read what the arrivals published, also through
// the async proxy (cp.async.bulk)
__device__ __forceinline__ void q4mlp_count_wait(unsigned long long target) {
  unsigned long long now;
  while (true) {
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(now) : "l"(&relaxtune_q4mlp_arrivals) : "memory");
    if (now >= target) break;
    __nanosleep(64);  // one poller per block, alongside the weights' copies
  }
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

struct Q4MlpSegment {  // one weight's rows of this block, as the producer and the consumers walk them
  const char *w, *s;
  int row_bytes, scale_bytes, rows, shift;
  int w_stride, s_stride;  // bytes from one row to the next in global memory: row_bytes / scale_bytes, or the whole
                           // row's where the segment is the columns [c0, c0 + k) of a weight with more
};

// rows first .. first + rows - 1 of the (N, K_all) weight `w` (K_all = k unless given), columns c0 .. c0 + k - 1
__device__ __forceinline__ Q4MlpSegment q4mlp_segment(const void* w, const void* s, int k, int shift, int first,
                                                       int rows, int k_all = 0, int c0 = 0) {
  k_all = k_all > 0 ? k_all : k;
  const int w_stride = k_all / 2, s_stride = 2 * (k_all >> (5 + shift));
  return {static_cast<const char*>(w) + static_cast<size_t>(first) * w_stride + c0 / 2,
          static_cast<const char*>(s) + static_cast<size_t>(first) * s_stride + 2 * (c0 >> (5 + shift)),
          k / 2,
          2 * (k >> (5 + shift)),
          rows,
          shift,
          w_stride,
          s_stride};
}

// the producer's copies of one slot: rows r .. r + here - 1 of `sg`, weights at dst, scales at dst + scales_at; one
// copy each where the rows are contiguous, else one per row
__device__ __forceinline__ void q4mlp_copy_rows(const Q4MlpSegment& sg, int r, int here, unsigned char* dst,
                                                int scales_at, uint64_t* full) {
  barrier_expect_bytes(full, here * (sg.row_bytes + sg.scale_bytes));
  if (sg.w_stride == sg.row_bytes) {
    bulk_copy(dst, sg.w + static_cast<size_t>(r) * sg.row_bytes, here * sg.row_bytes, full);
    bulk_copy(dst + scales_at, sg.s + static_cast<size_t>(r) * sg.scale_bytes, here * sg.scale_bytes, full);
    return;
  }
  for (int i = 0; i < here; ++i) {
    bulk_copy(dst + i * sg.row_bytes, sg.w + static_cast<size_t>(r + i) * sg.w_stride, sg.row_bytes, full);
    bulk_copy(dst + scales_at + i * sg.scale_bytes, sg.s + static_cast<size_t>(r + i) * sg.s_stride, sg.scale_bytes,
              full);
  }
}

// this thread's PMAX pieces of `v` (K fp16; zeros past K), all loads issued together; through L2 (kCoherent) where `v`
// is written in this kernel
template <int PMAX, bool kCoherent>
__device__ __forceinline__ void q4mlp_load(const void* v, int k, int t, uint4 (&pv)[PMAX][2], bool shared = false) {
  const uint4* vec = static_cast<const uint4*>(v);
#pragma unroll
  for (int j = 0; j < PMAX; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int at = 2 * (t + j * kQ4PieceThreads) + e;
      pv[j][e] = at >= k / 8 ? make_uint4(0, 0, 0, 0) : shared ? vec[at] : kCoherent ? __ldcg(vec + at) : __ldg(vec + at);
    }
}

// the same pieces as int8 (quantize_piece)
template <int PMAX, bool kCoherent>
__device__ __forceinline__ void q4mlp_quantize(const void* v, int k, int t, uint32_t (&xq)[PMAX][4],
                                               int (&corr)[PMAX], float (&scale)[PMAX], bool shared = false) {
  uint4 pv[PMAX][2];
  q4mlp_load<PMAX, kCoherent>(v, k, t, pv, shared);
#pragma unroll
  for (int j = 0; j < PMAX; ++j) quantize_piece(pv[j], xq[j], corr[j], scale[j]);
}

// the consumers' side of one segment: RPG rows per row group and slot; row sums into part[row * 8 + warp]
template <int GR, int RPG, int PMAX>
__device__ __forceinline__ void q4mlp_consume(const Q4MlpSegment& sg, int& s, int stages, int stage_bytes,
                                              unsigned char* ring, uint64_t* full, uint64_t* empty, int k,
                                              const uint32_t (&xq)[PMAX][4], const int (&corr)[PMAX],
                                              const float (&scale)[PMAX], float* part) {
  constexpr int RS = GR * RPG;
  const int g = threadIdx.x / kQ4PieceThreads, t = threadIdx.x % kQ4PieceThreads, lane = t % 32, warp = t / 32;
  const int pieces = k / 16, groups = sg.scale_bytes / 2;
  for (int base0 = 0; base0 < sg.rows; base0 += RS, ++s) {
    const int slot = s % stages, base = base0 + g * RPG;
    barrier_wait(&full[slot], (s / stages) & 1);
    const unsigned char* slot_base = ring + static_cast<size_t>(slot) * stage_bytes;
    const unsigned char* wslot = slot_base + g * RPG * sg.row_bytes;
    const __half* sslot = reinterpret_cast<const __half*>(slot_base + RS * sg.row_bytes) + g * RPG * groups;
    float acc[RPG];
#pragma unroll
    for (int i = 0; i < RPG; ++i) acc[i] = 0.0f;
#pragma unroll
    for (int i = 0; i < RPG; ++i) {
      if (base + i >= sg.rows) break;  // the same for the whole warp
#pragma unroll
      for (int j = 0; j < PMAX; ++j) {
        const int piece = t + j * kQ4PieceThreads;
        if (piece >= pieces) break;
        const uint2 q = *reinterpret_cast<const uint2*>(wslot + i * sg.row_bytes + 8 * piece);
        const float sc = __half2float(sslot[i * groups + (piece >> (1 + sg.shift))]);
        acc[i] = fmaf(static_cast<float>(dot_piece_i8(q, xq[j], corr[j])), sc * scale[j], acc[i]);
      }
    }
    __syncwarp();
    if (lane == 0) barrier_arrive(&empty[slot]);
    const float sum = warp_transposed_sum<RPG>(acc, lane);
    const int row = base + lane / (32 / RPG);
    if (lane % (32 / RPG) == 0 && row < sg.rows) part[row * 8 + warp] = sum;
  }
}
#endif

// GR row groups of 8 consumer warps; RH / RF: rows per row group and slot for the K = A, H segments / the K = F
// ones; PH / PF: pieces per thread
template <int GR, int RH, int PH, int RF, int PF>
__device__ __forceinline__ void q4mlp_body(const Q4MlpParams& p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kConsumers = GR * kQ4PieceThreads, kWarps = kQ4PieceThreads / 32;
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + kQ4StreamMaxStages;
  uint64_t* act_ready = reinterpret_cast<uint64_t*>(smem + kQ4BarrierBytes);  // split: each part of act in act_s
  uint64_t* base_ready = act_ready + 2;                                          // split: *base set
  unsigned long long* base = reinterpret_cast<unsigned long long*>(act_ready + 3);  // the count barrier 1 reached
  uint4* xs = reinterpret_cast<uint4*>(smem + kQ4BarrierBytes + kQ4MlpExtraBytes);  // the attention's x, where asked
  unsigned char* ring = smem + kQ4BarrierBytes + kQ4MlpExtraBytes + p.x_bytes;
  unsigned char* act_s = ring + static_cast<size_t>(p.stages) * p.stage_bytes;  // split: act, F fp16
  const bool split = p.f1 > 0;
  float* part = reinterpret_cast<float*>(act_s + (split ? 2 * p.f : 0));
  const int b = blockIdx.x, blocks = gridDim.x;
  auto share = [&](int n, int i) { return static_cast<int>(static_cast<long long>(i) * n / blocks); };
  const int r0 = share(p.hidden, b), rows = share(p.hidden, b + 1) - r0;
  // F in one part, or two: [0, f1) and [f1, F); this block's features of each
  const int fk[2] = {split ? p.f1 : p.f, split ? p.f - p.f1 : 0}, fbase[2] = {0, p.f1};
  int fs[2], fn[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) fs[i] = fbase[i] + share(fk[i], b), fn[i] = share(fk[i], b + 1) - share(fk[i], b);
  const int fmax = max(fn[0], fn[1]);
  // the ring's order: Wo; gate and up of part 0, of part 1; Wd's columns of part 0, of part 1 (rows 0: no part 1)
  const Q4MlpSegment seg[7] = {
      q4mlp_segment(p.wo, p.so, p.a, p.shift_o, r0, rows),
      q4mlp_segment(p.wgu, p.sgu, p.hidden, p.shift_gu, fs[0], fn[0]),
      q4mlp_segment(p.wgu, p.sgu, p.hidden, p.shift_gu, p.f + fs[0], fn[0]),
      q4mlp_segment(p.wgu, p.sgu, p.hidden, p.shift_gu, fs[1], fn[1]),
      q4mlp_segment(p.wgu, p.sgu, p.hidden, p.shift_gu, p.f + fs[1], fn[1]),
      q4mlp_segment(p.wd, p.sd, fk[0], p.shift_d, r0, rows, p.f, 0),
      q4mlp_segment(p.wd, p.sd, fk[1], p.shift_d, r0, split ? rows : 0, p.f, p.f1),
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < p.stages; ++s) barrier_init(&full[s], 1), barrier_init(&empty[s], GR * kWarps);
    barrier_init(&act_ready[0], 1), barrier_init(&act_ready[1], 1), barrier_init(base_ready, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x >= kConsumers) {  // the producer warp
    if (threadIdx.x == kConsumers) {  // lane 0: every segment's weights, never waiting for activations
      q4mlp_stamp(p, 10);
      int s = 0;
#pragma unroll
      for (int i = 0; i < 7; ++i) {
        const int rs = GR * (i >= 5 ? RF : RH);
        for (int r = 0; r < seg[i].rows; r += rs, ++s) {
          const int slot = s % p.stages, here = min(rs, seg[i].rows - r);
          if (s >= p.stages) barrier_wait(&empty[slot], (s / p.stages - 1) & 1);
          q4mlp_copy_rows(seg[i], r, here, ring + static_cast<size_t>(slot) * p.stage_bytes, rs * seg[i].row_bytes,
                          &full[slot]);
        }
        if (i == 0 || i == 2 || i == 4 || i == 5) q4mlp_stamp(p, 11 + i / 2 + (i == 5));  // the last copy issued
      }
    } else if (threadIdx.x == kConsumers + 1 && split) {  // lane 1: each part of act once every block wrote it
      barrier_wait(base_ready, 0);
      const unsigned long long first = *base;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        q4mlp_count_wait(first + static_cast<unsigned long long>(i + 1) * blocks);
        barrier_expect_bytes(&act_ready[i], 2 * fk[i]);
        bulk_copy(act_s + 2 * fbase[i], static_cast<const __half*>(p.act) + fbase[i], 2 * fk[i], &act_ready[i]);
      }
    }
    return;
  }
  const int t = threadIdx.x % kQ4PieceThreads, g = threadIdx.x / kQ4PieceThreads, lane = t % 32, warp = t / 32;
  __half* h = static_cast<__half*>(p.h);
  __half* act = static_cast<__half*>(p.act);
  __half* y = static_cast<__half*>(p.y);
  int s = 0;
  const bool stamps = threadIdx.x == 0;
  if (stamps) q4mlp_stamp(p, 0);
  {  // h = x @ Wo^T + res for this block's rows
    uint32_t xq[PH][4];
    int corr[PH];
    float scale[PH];
    wait_for_previous_kernel();  // x and res only after the previous kernel
    if (p.x_bytes > 0) {  // x = the attention of the one row (gemv.cu), into shared memory
      attention_rows<__half, 1>(1, p.a, p.attn, xs, kConsumers);
      asm volatile("bar.sync 1, %0;" ::"r"(kConsumers) : "memory");
    }
    q4mlp_quantize<PH, false>(p.x_bytes > 0 ? xs : p.x, p.a, t, xq, corr, scale, p.x_bytes > 0);
    if (stamps) q4mlp_stamp(p, 1);
    q4mlp_consume<GR, RH, PH>(seg[0], s, p.stages, p.stage_bytes, ring, full, empty, p.a, xq, corr, scale, part);
    if (stamps) q4mlp_stamp(p, 2);
    asm volatile("bar.sync 1, %0;" ::"r"(kConsumers) : "memory");
    const __half* res = static_cast<const __half*>(p.res);
    for (int r = threadIdx.x; r < rows; r += kConsumers) {
      float sum = __half2float(res[r0 + r]);
#pragma unroll
      for (int q = 0; q < kWarps; ++q) sum += part[r * kWarps + q];
      h[r0 + r] = __float2half_rn(sum);
    }
  }
  uint4 gv[PH][2];  // the norm's weight for this thread's pieces, read before the barrier
  q4mlp_load<PH, false>(p.g, p.hidden, t, gv);
  q4mlp_grid_barrier(kConsumers, p.barrier, split ? base : nullptr);
  if (split && threadIdx.x == 0) barrier_arrive(base_ready);  // lane 1 counts the act parts' arrivals from *base
  if (stamps) q4mlp_stamp(p, 3);
  {  // n = rms_norm(h) * g; gate and up of this block's features; act = silu(gate) * up
    uint4 xv[PH][2];
    q4mlp_load<PH, true>(h, p.hidden, t, xv);
    float sq = 0.0f;
#pragma unroll
    for (int j = 0; j < PH; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float f[8];
        unpack8<__half>(xv[j][e], f);
#pragma unroll
        for (int i = 0; i < 8; ++i) sq = fmaf(f[i], f[i], sq);
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) sq += __shfl_xor_sync(0xffffffffu, sq, o);
    float* scratch = part + 2 * static_cast<size_t>(fmax) * kWarps + g * kWarps;  // after gate's and up's sums
    if (lane == 0) scratch[warp] = sq;
    asm volatile("bar.sync %0, %1;" ::"r"(2 + g), "r"(kQ4PieceThreads) : "memory");  // this row group's warps
    float total = 0.0f;
#pragma unroll
    for (int q = 0; q < kWarps; ++q) total += scratch[q];
    const float inv = rsqrtf(total / static_cast<float>(p.hidden) + p.eps);
    uint32_t xq[PH][4];
    int corr[PH];
    float scale[PH];
#pragma unroll
    for (int j = 0; j < PH; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float f[8], gf[8];
        unpack8<__half>(xv[j][e], f);
        unpack8<__half>(gv[j][e], gf);
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = inv * f[i] * gf[i];
        xv[j][e] = pack8<__half>(f);
      }
      quantize_piece(xv[j], xq[j], corr[j], scale[j]);
    }
    if (stamps) q4mlp_stamp(p, 4);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (i == 1 && !split) break;
      q4mlp_consume<GR, RH, PH>(seg[1 + 2 * i], s, p.stages, p.stage_bytes, ring, full, empty, p.hidden, xq, corr,
                                scale, part);
      q4mlp_consume<GR, RH, PH>(seg[2 + 2 * i], s, p.stages, p.stage_bytes, ring, full, empty, p.hidden, xq, corr,
                                scale, part + static_cast<size_t>(fmax) * kWarps);
      asm volatile("bar.sync 1, %0;" ::"r"(kConsumers) : "memory");
      for (int r = threadIdx.x; r < fn[i]; r += kConsumers) {
        float gate = 0.0f, up = 0.0f;
#pragma unroll
        for (int q = 0; q < kWarps; ++q) gate += part[r * kWarps + q], up += part[(fmax + r) * kWarps + q];
        act[fs[i] + r] = __float2half_rn(silu_times<__half>(round_to<__half>(gate), round_to<__half>(up)));
      }
      if (split) q4mlp_count_arrive(kConsumers);  // part i of act written: lane 1 fetches it once all blocks did
    }
    if (stamps) q4mlp_stamp(p, 5);
  }
  float* dpart[2] = {part, part + static_cast<size_t>(rows) * kWarps};  // down's sums of each part of F
  if (!split) {
    q4mlp_grid_barrier(kConsumers, p.barrier);
    if (stamps) q4mlp_stamp(p, 6);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {  // y = act @ Wd^T + h for this block's rows, over each part of F
    if (i == 1 && !split) break;
    if (split) barrier_wait(&act_ready[i], 0);
    if (stamps) q4mlp_stamp(p, i == 0 ? 6 : 15);
    uint32_t xq[PF][4];
    int corr[PF];
    float scale[PF];
    if (split) {
      q4mlp_quantize<PF, false>(act_s + 2 * fbase[i], fk[i], t, xq, corr, scale, true);
    } else {
      q4mlp_quantize<PF, true>(act, p.f, t, xq, corr, scale);
    }
    if (stamps && i == 0) q4mlp_stamp(p, 7);
    q4mlp_consume<GR, RF, PF>(seg[5 + i], s, p.stages, p.stage_bytes, ring, full, empty, fk[i], xq, corr, scale,
                              dpart[i]);
  }
  if (stamps) q4mlp_stamp(p, 8);
  asm volatile("bar.sync 1, %0;" ::"r"(kConsumers) : "memory");
  for (int r = threadIdx.x; r < rows; r += kConsumers) {
    float sum = __half2float(__ldcg(h + r0 + r));
#pragma unroll
    for (int q = 0; q < kWarps; ++q) sum += dpart[0][r * kWarps + q];
    if (split) {
#pragma unroll
      for (int q = 0; q < kWarps; ++q) sum += dpart[1][r * kWarps + q];
    }
    y[r0 + r] = __float2half_rn(sum);
  }
  if (stamps) q4mlp_stamp(p, 9);
#endif
}

#define RELAXTUNE_Q4MLP(NAME, GR, RH, PH, RF, PF)                                                        \
  extern "C" __global__ void __launch_bounds__(GR * kQ4PieceThreads + 32, 1) NAME(Q4MlpParams p) { \
    q4mlp_body<GR, RH, PH, RF, PF>(p);                                                               \
  }

// name: relaxtune_q4mlp_h<PH>f<PF>: A, H <= 4096 * PH and F <= 4096 * PF (qmlp_host.cc's kQ4MlpKernels)
RELAXTUNE_Q4MLP(relaxtune_q4mlp_h1f4, 2, 8, 1, 4, 4)
RELAXTUNE_Q4MLP(relaxtune_q4mlp_h3f4, 2, 4, 3, 4, 4)
// measured and dropped (benchmarks/q4mlp_trace.py, docs/results.md): 2 rows per group and slot for Wd (a 6-slot ring),
// 4 for Wo / gate / up too (9 slots), three row groups: each 0.8-2.4 us slower than h1f4 on the 7B sizes
