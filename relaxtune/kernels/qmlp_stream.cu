// relaxtune's 4-bit decode MLP in one kernel (compute capability 9.0+, int8 activations): for one row,
//   h = x @ Wo^T + res,  n = rms_norm(h, g, eps),  a = silu(n @ Wgate^T) * (n @ Wup^T),  y = a @ Wd^T + h,
// the o_proj through the down projection of a decoder layer's decode step, which qgemv_stream.cu's kernels run as
// five launches (three GEMVs, the norm, the SwiGLU). Appended after qgemv_stream.cu in one fatbin (kernels/gemv.py):
// it uses qstream_ring.cu's ring helpers, quantize_piece, dot_piece_i8 and warp_transposed_sum, qmlp_grid.cu's grid
// barriers and chunk counter, and qmlp_steps.cu's producer and consumer steps. Host: qmlp_host.cc.
//
// One block per SM, launched cooperatively (all blocks resident). Block b owns the same share of rows in each of the
// four weights: rows b * H / G .. of Wo and Wd, features b * F / G .. of gate and up (the merged (2F, H) weight's
// rows f and F + f). Its producer warp streams those rows, segment after segment (Wo, gate, up, Wd), through one ring
// of shared-memory slots (cp.async.bulk, as qgemv_stream.cu) without ever waiting for activations: while the
// consumer warps wait at a grid barrier, the first `ahead` slots of the next step (gate / up, or Wd) are already in
// flight; the rest wait for the consumers to pass it (copies queued beyond that only slow the barrier's round trips
// and the read back; `passed` in shared memory counts the barriers passed). The consumers compute
// each segment as qgemv_stream.cu's int8 kernels do (x quantized per 16 values, dp4a; RS rows per slot), then:
//   - after Wo: h for their rows (+ res, one rounding) to global memory; grid barrier;
//   - every block reads the whole h back (L2), computes the norm (fp32, one rounding, as TVM's legalized
//     rms_norm) and quantizes it; gate and up; a = silu_times(gate, up) rounded as the separate kernels round;
//     grid barrier;
//   - every block reads the whole a and quantizes it; Wd; y = sum + h.
// The grid barrier is the consumers' (the producer only reads their count of it), on state in this module's global
// memory (qmlp_grid.cu). h and a are outputs (the caller's memory): written once by their owner block, read by all
// after the barrier, two values at a time (the shares of rows and features are even). With `chunked`, gate / up is
// no fixed share: each block's producer takes chunks of RH features from a counter while they last (qmlp_steps.cu).
// Each step's time in the kernel: benchmarks/q4mlp_trace.py (the `trace` stamps).
// Where x_bytes > 0, x is no input: every block first computes it, the attention of the step's one row (q, k, v and
// the rotary tables in `attn`, gemv_prologue.cu's attention_rows), into shared memory before the ring.

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
  int barrier;                // kGenerationBarrier / kCountBarrier (qmlp_grid.cu)
  int x_bytes;                // > 0: x is the attention of one row (attn), computed into that much shared memory
  int ahead;                  // slots of a step the producer copies before the consumers pass its grid barrier
  int chunked;                // gate / up in chunks grabbed while they last (q4mlp_produce_chunks), not a fixed share
  AttnParams attn;            // gemv_prologue.cu's: q, k, v, the tables, the heads (x null)
};

constexpr int kQ4MlpTraceEvents = 16;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// event `e` of this block's trace (thread 0 of the consumers, or the producer), where one is asked for
__device__ __forceinline__ void q4mlp_stamp(const Q4MlpParams& p, int e) {
  if (p.trace == nullptr) return;
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  p.trace[blockIdx.x * kQ4MlpTraceEvents + e] = now;
}
#endif

// GR row groups of 8 consumer warps; RH / RF: rows per row group and slot for the K = A, H segments / the K = F
// one; PH / PF: pieces per thread
template <int GR, int RH, int PH, int RF, int PF>
__device__ __forceinline__ void q4mlp_body(const Q4MlpParams& p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(GR == 2 && RH % 2 == 0, "gate / up chunks: gate's rows in one row group, up's in the other, pairs");
  constexpr int kConsumers = GR * kQ4PieceThreads, kWarps = kQ4PieceThreads / 32;
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + kQ4StreamMaxStages;
  uint4* xs = reinterpret_cast<uint4*>(smem + kQ4BarrierBytes);  // x_bytes: the attention's x, where asked
  unsigned char* ring = smem + kQ4BarrierBytes + p.x_bytes;
  float* part = reinterpret_cast<float*>(ring + static_cast<size_t>(p.stages) * p.stage_bytes);
  const int b = blockIdx.x, blocks = gridDim.x;
  auto share = [&](int n, int i) {  // an even share: h and act are written two values at a time
    return 2 * static_cast<int>(static_cast<long long>(i) * (n / 2) / blocks);
  };
  const int r0 = share(p.hidden, b), rows = share(p.hidden, b + 1) - r0;
  const int f0 = share(p.f, b), frows = share(p.f, b + 1) - f0;
  const Q4MlpSegment seg[4] = {
      q4mlp_segment(p.wo, p.so, p.a, p.shift_o, r0, rows),
      q4mlp_segment(p.wgu, p.sgu, p.hidden, p.shift_gu, f0, frows),
      q4mlp_segment(p.wgu, p.sgu, p.hidden, p.shift_gu, p.f + f0, frows),
      q4mlp_segment(p.wd, p.sd, p.f, p.shift_d, r0, rows),
  };
  const Q4MlpSegment gate = q4mlp_segment(p.wgu, p.sgu, p.hidden, p.shift_gu, 0, p.f);  // chunks: all of gate's rows
  // the steps passed (0, 1, 2) in full[] past the ring's slots, each slot's chunk in empty[] past them (stages <= 32)
  const Q4MlpRing r{ring, full, empty, p.stages, p.stage_bytes, p.ahead,
                    reinterpret_cast<volatile int*>(full + kQ4StreamMaxStages - 1),
                    reinterpret_cast<volatile int*>(empty + kQ4StreamMaxStages / 2)};
  if (threadIdx.x == 0) {
    for (int s = 0; s < p.stages; ++s) barrier_init(&full[s], 1), barrier_init(&empty[s], GR * kWarps);
    *r.passed = 0;
    asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x >= kConsumers) {  // the producer warp: all four segments' weights, never waiting for activations
    if (threadIdx.x == kConsumers) {  // (but for `ahead` slots of each step after the first before its barrier)
      q4mlp_stamp(p, 10);
      int s = q4mlp_produce(r, seg[0], GR * RH, 0, 0, 0);
      q4mlp_stamp(p, 11);  // each segment's last copy issued
      if (p.chunked) {
        wait_for_previous_kernel();  // the epoch, which picks the chunk counter, once the previous kernel is done
        s = q4mlp_produce_chunks(r, gate, p.f, RH, &relaxtune_q4mlp_chunks[q4mlp_epoch() & 1], s);
        q4mlp_stamp(p, 12);
      } else {
        s = q4mlp_produce(r, seg[1], GR * RH, s, 0, 1);
        q4mlp_stamp(p, 12);
        s = q4mlp_produce(r, seg[2], GR * RH, s, (frows + GR * RH - 1) / (GR * RH), 1);
      }
      q4mlp_stamp(p, 13);
      q4mlp_produce(r, seg[3], GR * RF, s, 0, 2);
      q4mlp_stamp(p, 14);
    }
    return;
  }
  const int t = threadIdx.x % kQ4PieceThreads, g = threadIdx.x / kQ4PieceThreads, lane = t % 32, warp = t / 32;
  __half* h = static_cast<__half*>(p.h);
  __half* act = static_cast<__half*>(p.act);
  __half* y = static_cast<__half*>(p.y);
  Q4RingSlot s;
  const bool stamps = threadIdx.x == 0;
  if (stamps) q4mlp_stamp(p, 0);
  wait_for_previous_kernel();  // x, res and the epoch only after the previous kernel
  const unsigned int epoch = q4mlp_epoch();
  {  // h = x @ Wo^T + res for this block's rows
    if (p.x_bytes > 0) {  // x = the attention of the one row (gemv_prologue.cu), into shared memory
      attention_rows<__half, 1>(1, p.a, p.attn, xs, kConsumers);
      asm volatile("bar.sync 1, %0;" ::"r"(kConsumers) : "memory");
    }
    uint4 xv[PH][2];
    if (p.x_bytes > 0) {
      q4mlp_load<PH, false>(xs, p.a, t, xv, true);
    } else {
      q4mlp_load<PH, false>(p.x, p.a, t, xv);
    }
    uint32_t xq[PH][4];
    int corr[PH];
    float scale[PH];
#pragma unroll
    for (int j = 0; j < PH; ++j) quantize_piece(xv[j], xq[j], corr[j], scale[j]);
    if (stamps) q4mlp_stamp(p, 1);
    q4mlp_consume<GR, RH, PH>(r, s, seg[0], p.a, xq, corr, scale, part);
    if (stamps) q4mlp_stamp(p, 2);
    asm volatile("bar.sync 1, %0;" ::"r"(kConsumers) : "memory");
    const __half* res = static_cast<const __half*>(p.res);
    for (int i = 2 * threadIdx.x; i < rows; i += 2 * kConsumers) {  // two rows a thread (rows is even)
      float sum[2] = {__half2float(res[r0 + i]), __half2float(res[r0 + i + 1])};
#pragma unroll
      for (int q = 0; q < kWarps; ++q) sum[0] += part[i * kWarps + q], sum[1] += part[(i + 1) * kWarps + q];
      *reinterpret_cast<__half2*>(h + r0 + i) = __floats2half2_rn(sum[0], sum[1]);
    }
  }
  uint4 gv[PH][2];  // the norm's weight for this thread's pieces, read before the barrier
  q4mlp_load<PH, false>(p.g, p.hidden, t, gv);
  q4mlp_grid_barrier(kConsumers, p.barrier);
  uint4 xv[PH][2];  // all of h
  q4mlp_load<PH, true>(h, p.hidden, t, xv);
  if (threadIdx.x == 0) *r.passed = 1;
  if (stamps) q4mlp_stamp(p, 3);
  {  // n = rms_norm(h) * g; gate and up of this block's features; act = silu(gate) * up
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
    // after the gate / up sums: the fixed share's, or the chunks' two buffers
    float* scratch = part + static_cast<size_t>(max(2 * frows, 4 * RH)) * kWarps + g * kWarps;
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
    // act for features f, f + 1 from their gate and up sums (`stride` floats apart) over the 8 warps
    auto act_pair = [&](int f, const float* sums, int stride) {
      float a[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float gsum = 0.0f, usum = 0.0f;
#pragma unroll
        for (int q = 0; q < kWarps; ++q) gsum += sums[i * kWarps + q], usum += sums[stride + i * kWarps + q];
        a[i] = silu_times<__half>(round_to<__half>(gsum), round_to<__half>(usum));
      }
      *reinterpret_cast<__half2*>(act + f) = __floats2half2_rn(a[0], a[1]);
    };
    if (p.chunked) {
      q4mlp_consume_chunks<RH, PH>(r, s, gate, p.hidden, xq, corr, scale, part, [&](int c, const float* sums) {
        const int i = 2 * threadIdx.x;
        if (i < RH && c * RH + i < p.f) act_pair(c * RH + i, sums + i * kWarps, RH * kWarps);
      });
    } else {
      q4mlp_consume<GR, RH, PH>(r, s, seg[1], p.hidden, xq, corr, scale, part);
      q4mlp_consume<GR, RH, PH>(r, s, seg[2], p.hidden, xq, corr, scale, part + static_cast<size_t>(frows) * kWarps);
      asm volatile("bar.sync 1, %0;" ::"r"(kConsumers) : "memory");
      for (int i = 2 * threadIdx.x; i < frows; i += 2 * kConsumers) {  // two features a thread (frows is even)
        act_pair(f0 + i, part + i * kWarps, frows * kWarps);
      }
    }
    if (stamps) q4mlp_stamp(p, 5);
  }
  {  // y = act @ Wd^T + h for this block's rows
    q4mlp_grid_barrier(kConsumers, p.barrier);
    // every block has read the epoch and taken its last chunk: the next launch's counter and epoch
    if (b == 0 && threadIdx.x == 0) q4mlp_next_epoch(epoch);
    uint4 av[PF][2];  // all of act
    q4mlp_load<PF, true>(act, p.f, t, av);
    if (threadIdx.x == 0) *r.passed = 2;
    if (stamps) q4mlp_stamp(p, 6);
    uint32_t xq[PF][4];
    int corr[PF];
    float scale[PF];
#pragma unroll
    for (int j = 0; j < PF; ++j) quantize_piece(av[j], xq[j], corr[j], scale[j]);
    if (stamps) q4mlp_stamp(p, 7);
    q4mlp_consume<GR, RF, PF>(r, s, seg[3], p.f, xq, corr, scale, part);
    if (stamps) q4mlp_stamp(p, 8);
    asm volatile("bar.sync 1, %0;" ::"r"(kConsumers) : "memory");
    for (int i = threadIdx.x; i < rows; i += kConsumers) {
      float sum = __half2float(__ldcg(h + r0 + i));
#pragma unroll
      for (int q = 0; q < kWarps; ++q) sum += part[i * kWarps + q];
      y[r0 + i] = __float2half_rn(sum);
    }
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
