// The steps the fused 4-bit decode MLP kernel (qmlp_stream.cu) is made of: the producer warp's copies of a weight's
// rows into the ring, either a share of rows fixed by the block's index (q4mlp_produce) or chunks of gate / up
// features grabbed from a counter in global memory while they last (q4mlp_produce_chunks: the blocks that stream
// faster take more, so that no block finishes gate / up long after the others); the consumers' dot products of a
// slot's rows with the int8 activations (q4mlp_slot), and their walk over a fixed share (q4mlp_consume) or over the
// chunks the producer grabbed (q4mlp_consume_chunks, an epilogue per chunk). Appended after qmlp_grid.cu and
// before qmlp_stream.cu in the gemv fatbin (kernels/gemv.py).

struct Q4MlpSegment {  // one weight's rows of this block, as the producer and the consumers walk them
  const char *w, *s;
  int row_bytes, scale_bytes, rows, shift;
};

__device__ __forceinline__ Q4MlpSegment q4mlp_segment(const void* w, const void* s, int k, int shift, int first,
                                                       int rows) {
  const int row_bytes = k / 2, scale_bytes = 2 * (k >> (5 + shift));
  return {static_cast<const char*>(w) + static_cast<size_t>(first) * row_bytes,
          static_cast<const char*>(s) + static_cast<size_t>(first) * scale_bytes, row_bytes, scale_bytes, rows, shift};
}

struct Q4MlpRing {  // the ring in shared memory and what the producer and the consumers share about it
  unsigned char* slots;
  uint64_t *full, *empty;
  int stages, stage_bytes, ahead;
  volatile int* passed;  // the steps whose activations the consumers hold (0, 1, 2)
  volatile int* chunk;   // per slot: the chunk of gate / up features it holds, -1 past the last
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
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
      pv[j][e] = at >= k / 8 ? make_uint4(0, 0, 0, 0)
                 : shared      ? vec[at]
                 : kCoherent   ? __ldcg(vec + at)
                               : __ldg(vec + at);
    }
}

// the producer: slot `s` of the ring (its s-th copy), once the consumers released it and, but for the first `ahead`
// slots of a step, once they hold the step's activations
__device__ __forceinline__ unsigned char* q4mlp_claim(const Q4MlpRing& r, int s, int n, int step) {
  const int slot = s % r.stages;
  if (s >= r.stages) barrier_wait(&r.empty[slot], (s / r.stages - 1) & 1);
  if (n >= r.ahead)
    while (*r.passed < step) __nanosleep(64);
  return r.slots + static_cast<size_t>(slot) * r.stage_bytes;
}

// the producer: a segment's rows, rs a slot, from its s-th copy on (n: slots of its step already copied); the next s
__device__ __forceinline__ int q4mlp_produce(const Q4MlpRing& r, const Q4MlpSegment& sg, int rs, int s, int n,
                                             int step) {
  for (int row = 0; row < sg.rows; row += rs, ++s, ++n) {
    unsigned char* dst = q4mlp_claim(r, s, n, step);
    uint64_t* bar = &r.full[s % r.stages];
    const int here = min(rs, sg.rows - row);
    barrier_expect_bytes(bar, here * (sg.row_bytes + sg.scale_bytes));
    bulk_copy(dst, sg.w + static_cast<size_t>(row) * sg.row_bytes, here * sg.row_bytes, bar);
    bulk_copy(dst + rs * sg.row_bytes, sg.s + static_cast<size_t>(row) * sg.scale_bytes, here * sg.scale_bytes, bar);
  }
  return s;
}

// the producer: chunks of rpg gate / up features (the merged weight's rows c rpg .. and F + c rpg ..: two row groups)
// grabbed from `counter` until none is left; then one slot that says so (chunk -1, no bytes). Each grab is issued a
// slot ahead of its use. The next s
__device__ __forceinline__ int q4mlp_produce_chunks(const Q4MlpRing& r, const Q4MlpSegment& gate, int f, int rpg,
                                                    unsigned int* counter, int s) {
  const int chunks = (f + rpg - 1) / rpg;
  const size_t up_rows = static_cast<size_t>(f) * gate.row_bytes, up_scales = static_cast<size_t>(f) * gate.scale_bytes;
  int next = static_cast<int>(atomicAdd(counter, 1u));
  for (int n = 0;; ++s, ++n) {
    unsigned char* dst = q4mlp_claim(r, s, n, 1);
    uint64_t* bar = &r.full[s % r.stages];
    const int c = next < chunks ? next : -1;
    r.chunk[s % r.stages] = c;
    if (c < 0) {
      barrier_arrive(bar);
      return s + 1;
    }
    next = static_cast<int>(atomicAdd(counter, 1u));
    const int here = min(rpg, f - c * rpg);
    const size_t w = static_cast<size_t>(c) * rpg * gate.row_bytes,
                 sc = static_cast<size_t>(c) * rpg * gate.scale_bytes;
    unsigned char* scales = dst + 2 * rpg * gate.row_bytes;
    barrier_expect_bytes(bar, 2 * here * (gate.row_bytes + gate.scale_bytes));
    bulk_copy(dst, gate.w + w, here * gate.row_bytes, bar);
    bulk_copy(dst + rpg * gate.row_bytes, gate.w + up_rows + w, here * gate.row_bytes, bar);
    bulk_copy(scales, gate.s + sc, here * gate.scale_bytes, bar);
    bulk_copy(scales + rpg * gate.scale_bytes, gate.s + up_scales + sc, here * gate.scale_bytes, bar);
  }
}

// the consumers: this row group's `valid` (<= RPG) rows of a full slot (GR row groups of RPG rows, then their
// scales) against the int8 activations; the slot released; lane l's value is row l / (32 / RPG)'s sum over its pieces
template <int GR, int RPG, int PMAX>
__device__ __forceinline__ float q4mlp_slot(const Q4MlpRing& r, int slot, const Q4MlpSegment& sg, int k, int valid,
                                            const uint32_t (&xq)[PMAX][4], const int (&corr)[PMAX],
                                            const float (&scale)[PMAX]) {
  const int g = threadIdx.x / kQ4PieceThreads, t = threadIdx.x % kQ4PieceThreads, lane = t % 32;
  const int pieces = k / 16, groups = sg.scale_bytes / 2;
  const unsigned char* slot_base = r.slots + static_cast<size_t>(slot) * r.stage_bytes;
  const unsigned char* wslot = slot_base + g * RPG * sg.row_bytes;
  const __half* sslot = reinterpret_cast<const __half*>(slot_base + GR * RPG * sg.row_bytes) + g * RPG * groups;
  float acc[RPG];
#pragma unroll
  for (int i = 0; i < RPG; ++i) acc[i] = 0.0f;
#pragma unroll
  for (int i = 0; i < RPG; ++i) {
    if (i >= valid) break;  // the same for the whole warp
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
  if (lane == 0) barrier_arrive(&r.empty[slot]);
  return warp_transposed_sum<RPG>(acc, lane);
}

// the consumers' side of a fixed share: RPG rows per row group and slot; row sums into part[row * 8 + warp]
template <int GR, int RPG, int PMAX>
__device__ __forceinline__ void q4mlp_consume(const Q4MlpRing& r, Q4RingSlot& s, const Q4MlpSegment& sg, int k,
                                              const uint32_t (&xq)[PMAX][4], const int (&corr)[PMAX],
                                              const float (&scale)[PMAX], float* part) {
  const int g = threadIdx.x / kQ4PieceThreads, lane = threadIdx.x % 32, warp = threadIdx.x % kQ4PieceThreads / 32;
  for (int base = g * RPG; base - g * RPG < sg.rows; base += GR * RPG) {
    const int slot = s.slot;
    barrier_wait(&r.full[slot], s.phase);
    s.next(r.stages);
    const float sum = q4mlp_slot<GR, RPG, PMAX>(r, slot, sg, k, sg.rows - base, xq, corr, scale);
    const int row = base + lane / (32 / RPG);
    if (lane % (32 / RPG) == 0 && row < sg.rows) part[row * 8 + warp] = sum;
  }
}

// the consumers' side of the chunks the producer grabbed (GR = 2: gate's rows, then up's): per chunk, the sums of
// its rows in part (two buffers of 2 RPG rows x 8 warps, in turns), all consumers synchronised, then
// epilogue(c, sums): sums[i * 8 + w] gate's feature c RPG + i, sums[(RPG + i) * 8 + w] up's
template <int RPG, int PMAX, typename Epilogue>
__device__ __forceinline__ void q4mlp_consume_chunks(const Q4MlpRing& r, Q4RingSlot& s, const Q4MlpSegment& gate,
                                                     int k, const uint32_t (&xq)[PMAX][4], const int (&corr)[PMAX],
                                                     const float (&scale)[PMAX], float* part, Epilogue epilogue) {
  const int g = threadIdx.x / kQ4PieceThreads, lane = threadIdx.x % 32, warp = threadIdx.x % kQ4PieceThreads / 32;
  for (int n = 0;; ++n) {
    const int slot = s.slot;
    barrier_wait(&r.full[slot], s.phase);
    s.next(r.stages);
    const int c = r.chunk[slot];
    if (c < 0) {
      __syncwarp();
      if (lane == 0) barrier_arrive(&r.empty[slot]);
      return;
    }
    const int valid = min(RPG, gate.rows - c * RPG);
    const float sum = q4mlp_slot<2, RPG, PMAX>(r, slot, gate, k, valid, xq, corr, scale);
    float* sums = part + (n & 1) * 2 * RPG * 8;
    if (lane % (32 / RPG) == 0 && lane / (32 / RPG) < valid) sums[(g * RPG + lane / (32 / RPG)) * 8 + warp] = sum;
    asm volatile("bar.sync 1, %0;" ::"r"(2 * kQ4PieceThreads) : "memory");
    epilogue(c, sums);
  }
}
#endif
