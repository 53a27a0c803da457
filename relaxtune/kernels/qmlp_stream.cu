// relaxtune's 4-bit decode MLP in one kernel (compute capability 9.0+, int8 activations): for one row,
//   h = x @ Wo^T + res,  n = rms_norm(h, g, eps),  a = silu(n @ Wgate^T) * (n @ Wup^T),  y = a @ Wd^T + h,
// the o_proj through the down projection of a decoder layer's decode step, which qgemv_stream.cu's kernels run as
// five launches (three GEMVs, the norm, the SwiGLU). Appended after qgemv_stream.cu in one fatbin (kernels/gemv.py):
// it uses qstream_ring.cu's ring helpers, quantize_piece, dot_piece_i8 and warp_transposed_sum, qmlp_grid.cu's grid
// barriers and qmlp_steps.cu's steps (qmlp_claim.cu's where the tiles are claimed). Host: qmlp_host.cc.
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
// memory (qmlp_grid.cu's q4mlp_grid_barrier). h and a are outputs (the caller's memory): written once by their owner
// block, read by all after the barrier. With kTaggedWords there is no barrier: h and a are also written as words
// tagged with the launch (qmlp_grid.cu), which every block polls once into shared memory until all carry this
// launch's tag. kClaimedTiles is kTaggedWords with each step's rows taken as tiles claimed by the blocks' producers
// rather than a fixed share (qmlp_claim.cu). Each step's time in the kernel: benchmarks/q4mlp_trace.py (the `trace`
// stamps).
// Where x_bytes > 0, x is no input: every block first computes it, the attention of the step's one row (q, k, v and
// the rotary tables in `attn`, gemv_prologue.cu's attention_rows), into shared memory before the ring.
// Where nqkv > 0, q, k and v are no input either (the whole decoder layer, relaxtune_q4block_i8): a first step,
// before o_proj, computes qkv = rms_norm(x, gin, eps_in) @ Wqkv^T (the row's merged q | k | v, which `attn` points
// into) as the o_proj step computes h: the block's share of the rows (segment 0 of the ring, Wqkv's rows streamed
// ahead of Wo's), written out, then the grid barrier before every block reads them for the attention (with tagged
// words: written as tagged words too, polled into shared memory, and the attention reads them there).

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
  int barrier;                // kGenerationBarrier / kCountBarrier (q4mlp_grid_barrier) / kTaggedWords
  int x_bytes;                // > 0: x is the attention of one row (attn), computed into that much shared memory
  int ahead;                  // slots of a step the producer copies before the consumers pass its grid barrier
  AttnParams attn;            // gemv_prologue.cu's: q, k, v (each qkv where nqkv > 0), the tables, the heads (x null)
  const void *wqkv, *sqkv;    // nqkv > 0: (nqkv, H / 8), (nqkv, H / group): the merged q | k | v projection
  const void* gin;            // (H) fp16: its norm's weight (x, then, is that norm's input, H values)
  void* qkv;                  // (nqkv) fp16: rms_norm(x, gin, eps_in) @ Wqkv^T, where attn's q, k and v point
  int nqkv, shift_qkv;
  float eps_in;
  int tag_bytes;  // with tagged words: shared memory for h and act as read back (2 H and 2 F bytes, each to 128)
};

constexpr int kQ4MlpTraceEvents = 20;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// event `e` of this block's trace of `events` stamps a block (the globaltimer, ns) in p.trace, where one is asked for
template <int events, typename Params>
__device__ __forceinline__ void globaltimer_stamp(const Params& p, int e) {
  if (p.trace == nullptr) return;
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  p.trace[blockIdx.x * events + e] = now;
}

// event `e` of this block's trace (thread 0 of the consumers, or the producer)
__device__ __forceinline__ void q4mlp_stamp(const Q4MlpParams& p, int e) { globaltimer_stamp<kQ4MlpTraceEvents>(p, e); }
#endif

// the consumers after a step whose outputs every block reads (v, K of them; with tagged words, kTaggedWords and
// kClaimedTiles, the words from word `first`): the grid barrier, then this thread's pieces of v through L2, or the
// block's poll of the tagged words into `staged` (shared memory) and its pieces from there; `passed` = step tells the
// producer, stamp `event` once the step may start. QMAX: q4mlp_stage_tagged's
template <int PMAX, int QMAX>
__device__ __forceinline__ void q4mlp_meet(const Q4MlpParams& p, int consumers, unsigned int tag, volatile int* passed,
                                           int step, int event, int first, const void* v, __half* staged, int k, int t,
                                           uint4 (&pv)[PMAX][2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const bool tagged = p.barrier >= kTaggedWords;
  if (tagged) {
    q4mlp_stage_tagged<QMAX>(first, k, tag, consumers, reinterpret_cast<uint2*>(staged));
  } else {
    q4mlp_grid_barrier(consumers, p.barrier);
  }
  if (threadIdx.x == 0) {
    *passed = step;
    q4mlp_stamp(p, event);
  }
  if (tagged) {
    q4mlp_load<PMAX, false>(staged, k, t, pv, true);
  } else {
    q4mlp_load<PMAX, true>(v, k, t, pv);
  }
#endif
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// the consumers' side of a step of SEGS segments (seg[0], and seg[1] alike: gate, up): the tiles claimed
// (kClaimedTiles, q4mlp_consume_claimed), else this block's share of their rows (the first, row0, of the weight), then
// out(row, sums, i, second) for each row of the weight they computed, as q4mlp_consume_claimed's; stamp `event` once
// the step's last slot is read
template <int GR, int RPG, int PMAX, int SEGS, typename Out>
__device__ __forceinline__ void q4mlp_step(const Q4MlpParams& p, const Q4MlpSegment* seg, int row0, Q4RingSlot& s,
                                           unsigned char* ring, uint64_t* full, uint64_t* empty, int k,
                                           const uint32_t (&xq)[PMAX][4], const int (&corr)[PMAX],
                                           const float (&scale)[PMAX], float* part, int event, Out out) {
  constexpr int kConsumers = GR * kQ4PieceThreads;
  if (p.barrier == kClaimedTiles) {
    q4mlp_consume_claimed<GR, RPG, PMAX, SEGS>(seg, s, p.stages, p.stage_bytes, ring, full, empty, k, xq, corr, scale,
                                               part, out);
    if (threadIdx.x == 0) q4mlp_stamp(p, event);
    return;
  }
  const int second = seg[0].rows * (kQ4PieceThreads / 32);
#pragma unroll
  for (int j = 0; j < SEGS; ++j)
    q4mlp_consume<GR, RPG, PMAX>(seg[j], s, p.stages, p.stage_bytes, ring, full, empty, k, xq, corr, scale,
                                 part + j * second);
  if (threadIdx.x == 0) q4mlp_stamp(p, event);
  asm volatile("bar.sync 1, %0;" ::"r"(kConsumers) : "memory");
  for (int r = threadIdx.x; r < seg[0].rows; r += kConsumers) out(row0 + r, part, r, second);
}
#endif

// GR row groups of 8 consumer warps; RH / RF: rows per row group and slot for the K = A, H segments / the K = F
// one; PH / PF: pieces per thread
template <int GR, int RH, int PH, int RF, int PF>
__device__ __forceinline__ void q4mlp_body(const Q4MlpParams& p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kConsumers = GR * kQ4PieceThreads, kWarps = kQ4PieceThreads / 32;
  constexpr int kQuads = (4096 * (PH > PF ? PH : PF) / 4 + kConsumers - 1) / kConsumers;  // tagged uint4s a thread
  constexpr int kQkvQuads = (3 * 4096 * PH / 4 + kConsumers - 1) / kConsumers;  // those of q | k | v (<= 3 H)
  constexpr int kTileSums = 4 * GR * (RH > RF ? RH : RF) * kWarps;  // kClaimedTiles: two tiles' of two segments
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + kQ4StreamMaxStages;
  uint4* xs = reinterpret_cast<uint4*>(smem + kQ4BarrierBytes);  // x_bytes: the attention's x, where asked
  // tag_bytes, with tagged words: h, then act (or before it q | k | v), as the block read them back (each rounded up
  // to 128 bytes)
  __half* staged_h = reinterpret_cast<__half*>(smem + kQ4BarrierBytes + p.x_bytes);
  __half* staged_a = staged_h + (p.hidden + 63) / 64 * 64;
  unsigned char* ring = smem + kQ4BarrierBytes + p.x_bytes + p.tag_bytes;
  float* part = reinterpret_cast<float*>(ring + static_cast<size_t>(p.stages) * p.stage_bytes);
  const int blocks = gridDim.x;
  const bool claimed = p.barrier == kClaimedTiles, tagged = p.barrier >= kTaggedWords;
  // this block's share of the rows, or with claimed tiles the whole weight (a tile's rows counted from its first)
  auto share = [&](int n, int i) { return static_cast<int>(static_cast<long long>(i) * n / blocks); };
  const int b = blockIdx.x, from = claimed ? 0 : b, to = claimed ? blocks : b + 1;
  const int r0 = share(p.hidden, from), rows = share(p.hidden, to) - r0;
  const int f0 = share(p.f, from), frows = share(p.f, to) - f0;
  const int q0 = share(p.nqkv, from), qrows = share(p.nqkv, to) - q0;  // none without the q/k/v step
  const int first = p.nqkv > 0 ? 1 : 0;  // the grid barriers before o_proj's step
  const Q4MlpSegment seg[5] = {
      q4mlp_segment(p.wqkv, p.sqkv, p.hidden, p.shift_qkv, q0, qrows),
      q4mlp_segment(p.wo, p.so, p.a, p.shift_o, r0, rows),
      q4mlp_segment(p.wgu, p.sgu, p.hidden, p.shift_gu, f0, frows),
      q4mlp_segment(p.wgu, p.sgu, p.hidden, p.shift_gu, p.f + f0, frows),
      q4mlp_segment(p.wd, p.sd, p.f, p.shift_d, r0, rows),
  };
  // each segment's step, its rows a slot and the producer's stamp once its last copy is issued
  const int step[5] = {0, first, first + 1, first + 1, first + 2}, event[5] = {18, 11, 12, 13, 14};
  const int rs[5] = {GR * RH, GR * RH, GR * RH, GR * RH, GR * RF};
  // the grid barriers the consumers passed (0 .. 3), in full[] past the ring's slots (the host keeps them < 64)
  volatile int* passed = reinterpret_cast<volatile int*>(full + kQ4StreamMaxStages - 1);
  if (threadIdx.x == 0) {
    for (int s = 0; s < p.stages; ++s) barrier_init(&full[s], 1), barrier_init(&empty[s], GR * kWarps);
    *passed = 0;
    asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x >= kConsumers) {  // the producer warp: all five segments' weights, never waiting for activations
    if (threadIdx.x == kConsumers) {  // (but for `ahead` slots of each step after the first before its barrier)
      q4mlp_stamp(p, 10);
      if (claimed) {
        q4mlp_produce_claimed(seg, GR * RH, GR * RF, p.nqkv > 0, ring, full, empty, p.stages, p.stage_bytes, p.ahead,
                              passed, [&](int k) {  // the step's segments' last copies issued
                                if (k == 2) q4mlp_stamp(p, 12);
                                q4mlp_stamp(p, k == 0 ? 18 : k == 1 ? 11 : k == 2 ? 13 : 14);
                              });
        return;
      }
      int s = 0;
      for (int i = 0; i < 5; ++i) {
        for (int r = 0, n = i == 3 ? (seg[2].rows + rs[i] - 1) / rs[i] : 0; r < seg[i].rows; r += rs[i], ++s, ++n) {
          const int slot = s % p.stages, here = min(rs[i], seg[i].rows - r);
          if (s >= p.stages) barrier_wait(&empty[slot], (s / p.stages - 1) & 1);
          if (n >= p.ahead)
            while (*passed < step[i]) __nanosleep(64);
          unsigned char* dst = ring + static_cast<size_t>(slot) * p.stage_bytes;
          barrier_expect_bytes(&full[slot], here * (seg[i].row_bytes + seg[i].scale_bytes));
          bulk_copy(dst, seg[i].w + static_cast<size_t>(r) * seg[i].row_bytes, here * seg[i].row_bytes, &full[slot]);
          bulk_copy(dst + rs[i] * seg[i].row_bytes, seg[i].s + static_cast<size_t>(r) * seg[i].scale_bytes,
                    here * seg[i].scale_bytes, &full[slot]);
        }
        q4mlp_stamp(p, event[i]);  // the segment's last copy issued
      }
    }
    return;
  }
  const int t = threadIdx.x % kQ4PieceThreads, g = threadIdx.x / kQ4PieceThreads;
  __half* h = static_cast<__half*>(p.h);
  __half* act = static_cast<__half*>(p.act);
  __half* y = static_cast<__half*>(p.y);
  Q4RingSlot s;
  const bool stamps = threadIdx.x == 0;
  unsigned int tag = 0;  // with tagged words: this launch's (qmlp_grid.cu), once the previous launch is seen whole
  // the norms' per-warp sums of squares, after the partial sums of gate and up (or of q | k | v, or the tiles')
  float* scratch = part + (claimed ? kTileSums : max(2 * frows, qrows) * kWarps) + g * kWarps;
  if (stamps) q4mlp_stamp(p, 0);
  wait_for_previous_kernel();  // x and res only after the previous kernel
  if (tagged) tag = q4mlp_tag();
  if (p.nqkv > 0) {  // qkv = rms_norm(x, gin) @ Wqkv^T for this block's rows, then every block's for the attention
    uint4 xv[PH][2], gv[PH][2];
    q4mlp_load<PH, false>(p.x, p.hidden, t, xv);
    q4mlp_load<PH, false>(p.gin, p.hidden, t, gv);
    uint32_t xq[PH][4];
    int corr[PH];
    float scale[PH];
    q4mlp_rms_quantize<PH>(xv, gv, p.hidden, p.eps_in, scratch, xq, corr, scale);
    __half* qkv = static_cast<__half*>(p.qkv);
    q4mlp_step<GR, RH, PH, 1>(p, seg, q0, s, ring, full, empty, p.hidden, xq, corr, scale, part, 16,
                              [&](int row, const float* sums, int i, int) {
                                const __half v = __float2half_rn(q4mlp_row_sum(sums, i, 0.0f));
                                qkv[row] = v;
                                if (tagged) q4mlp_put_tagged(p.hidden + p.f + row, v, tag);
                              });
    if (tagged) {  // every block's q | k | v, polled into shared memory (where act will be) for the attention
      q4mlp_stage_tagged<kQkvQuads>(p.hidden + p.f, p.nqkv, tag, kConsumers, reinterpret_cast<uint2*>(staged_a));
    } else {
      q4mlp_grid_barrier(kConsumers, p.barrier);
    }
    if (threadIdx.x == 0) {
      *passed = 1;
      q4mlp_stamp(p, 15);
    }
  }
  {  // h = x @ Wo^T + res for this block's rows
    uint32_t xq[PH][4];
    int corr[PH];
    float scale[PH];
    if (p.x_bytes > 0) {  // x = the attention of the one row (gemv_prologue.cu), into shared memory
      if (p.nqkv > 0 && tagged) {  // q, k and v (all three qkv, the host's) where the meeting put them
        AttnParams a = p.attn;
        a.q = a.k = a.v = staged_a;
        attention_rows<__half, 1, kAttnGeneric>(1, p.a, a, xs, kConsumers);
      } else {  // q, k and v through L2 (the q/k/v step's outputs, or the inputs)
        attention_rows<__half, 1, kAttnCoherent>(1, p.a, p.attn, xs, kConsumers);
      }
      asm volatile("bar.sync 1, %0;" ::"r"(kConsumers) : "memory");
      if (stamps) q4mlp_stamp(p, 17);
    }
    q4mlp_quantize<PH, false>(p.x_bytes > 0 ? xs : p.x, p.a, t, xq, corr, scale, p.x_bytes > 0);
    if (stamps) q4mlp_stamp(p, 1);
    const __half* res = static_cast<const __half*>(p.res);
    q4mlp_step<GR, RH, PH, 1>(p, seg + 1, r0, s, ring, full, empty, p.a, xq, corr, scale, part, 2,
                              [&](int row, const float* sums, int i, int) {
                                const __half v = __float2half_rn(q4mlp_row_sum(sums, i, __half2float(res[row])));
                                h[row] = v;
                                if (tagged) q4mlp_put_tagged(row, v, tag);
                              });
  }
  uint4 gv[PH][2];  // the norm's weight for this thread's pieces, read before the barrier
  q4mlp_load<PH, false>(p.g, p.hidden, t, gv);
  uint4 xv[PH][2];  // h: after the grid barrier, or its tagged words as soon as every block has written its rows
  q4mlp_meet<PH, kQuads>(p, kConsumers, tag, passed, first + 1, 3, 0, h, staged_h, p.hidden, t, xv);
  {  // n = rms_norm(h) * g; gate and up of this block's features; act = silu(gate) * up
    uint32_t xq[PH][4];
    int corr[PH];
    float scale[PH];
    q4mlp_rms_quantize<PH>(xv, gv, p.hidden, p.eps, scratch, xq, corr, scale);
    if (stamps) q4mlp_stamp(p, 4);
    q4mlp_step<GR, RH, PH, 2>(p, seg + 2, f0, s, ring, full, empty, p.hidden, xq, corr, scale, part, 5,
                              [&](int row, const float* sums, int i, int second) {
                                const float gate = q4mlp_row_sum(sums, i, 0.0f);
                                const float up = q4mlp_row_sum(sums + second, i, 0.0f);
                                const __half v =
                                    __float2half_rn(silu_times<__half>(round_to<__half>(gate), round_to<__half>(up)));
                                act[row] = v;
                                if (tagged) q4mlp_put_tagged(p.hidden + row, v, tag);
                              });
  }
  uint4 av[PF][2];  // act, as h
  q4mlp_meet<PF, kQuads>(p, kConsumers, tag, passed, first + 2, 6, p.hidden, act, staged_a, p.f, t, av);
  {  // y = act @ Wd^T + h for this block's rows (h: its own, or with tagged words as the block read it back)
    uint32_t xq[PF][4];
    int corr[PF];
    float scale[PF];
#pragma unroll
    for (int j = 0; j < PF; ++j) quantize_piece(av[j], xq[j], corr[j], scale[j]);
    if (stamps) q4mlp_stamp(p, 7);
    q4mlp_step<GR, RF, PF, 1>(p, seg + 4, r0, s, ring, full, empty, p.f, xq, corr, scale, part, 8,
                              [&](int row, const float* sums, int i, int) {
                                const __half hv = tagged ? staged_h[row] : __ldcg(h + row);
                                y[row] = __float2half_rn(q4mlp_row_sum(sums, i, __half2float(hv)));
                              });
  }
  if (tagged) q4mlp_tagged_done();
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
