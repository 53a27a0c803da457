// The steps the fused 4-bit decode MLP kernel (qmlp_stream.cu) is made of: a block's share of a weight's rows
// (Q4MlpSegment), the activations each thread holds, as fp16 pieces or int8 (q4mlp_load, q4mlp_quantize), and the
// consumers' walk over a segment's slots of the ring (q4mlp_consume). Appended after qmlp_grid.cu and before
// qmlp_stream.cu in the gemv fatbin (kernels/gemv.py).

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
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

// the same pieces as int8 (quantize_piece)
template <int PMAX, bool kCoherent>
__device__ __forceinline__ void q4mlp_quantize(const void* v, int k, int t, uint32_t (&xq)[PMAX][4],
                                               int (&corr)[PMAX], float (&scale)[PMAX], bool shared = false) {
  uint4 pv[PMAX][2];
  q4mlp_load<PMAX, kCoherent>(v, k, t, pv, shared);
#pragma unroll
  for (int j = 0; j < PMAX; ++j) quantize_piece(pv[j], xq[j], corr[j], scale[j]);
}

// this thread's PMAX pieces of a row of K values (the row group's 256 threads hold all of it) normalised as TVM's
// legalized rms_norm computes it: v * rsqrt(sum(v^2) / K + eps) * g in fp32, one rounding to fp16 (as qgemv_stream.cu's
// kRmsX), then as int8 (quantize_piece); `scratch`: the row group's 8 floats, apart from the partial sums the step
// after writes
template <int PMAX>
__device__ __forceinline__ void q4mlp_rms_quantize(uint4 (&v)[PMAX][2], const uint4 (&g)[PMAX][2], int k, float eps,
                                                   float* scratch, uint32_t (&xq)[PMAX][4], int (&corr)[PMAX],
                                                   float (&scale)[PMAX]) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x % kQ4PieceThreads / 32, group = threadIdx.x / kQ4PieceThreads;
  float sq = 0.0f;
#pragma unroll
  for (int j = 0; j < PMAX; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float f[8];
      unpack8<__half>(v[j][e], f);
#pragma unroll
      for (int i = 0; i < 8; ++i) sq = fmaf(f[i], f[i], sq);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) sq += __shfl_xor_sync(0xffffffffu, sq, o);
  if (lane == 0) scratch[warp] = sq;
  asm volatile("bar.sync %0, %1;" ::"r"(2 + group), "r"(kQ4PieceThreads) : "memory");  // this row group's warps
  float total = 0.0f;
#pragma unroll
  for (int q = 0; q < kQ4PieceThreads / 32; ++q) total += scratch[q];
  const float inv = rsqrtf(total / static_cast<float>(k) + eps);
#pragma unroll
  for (int j = 0; j < PMAX; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float f[8], gf[8];
      unpack8<__half>(v[j][e], f);
      unpack8<__half>(g[j][e], gf);
#pragma unroll
      for (int i = 0; i < 8; ++i) f[i] = inv * f[i] * gf[i];
      v[j][e] = pack8<__half>(f);
    }
    quantize_piece(v[j], xq[j], corr[j], scale[j]);
  }
}

// row `r`'s sum: `init` plus its 8 warps' partial sums in part (q4mlp_consume's), in warp order
__device__ __forceinline__ float q4mlp_row_sum(const float* part, int r, float init) {
#pragma unroll
  for (int q = 0; q < kQ4PieceThreads / 32; ++q) init += part[r * (kQ4PieceThreads / 32) + q];
  return init;
}

// the consumers' side of one segment: RPG rows per row group and slot; row sums into part[row * 8 + warp]
template <int GR, int RPG, int PMAX>
__device__ __forceinline__ void q4mlp_consume(const Q4MlpSegment& sg, Q4RingSlot& s, int stages, int stage_bytes,
                                              unsigned char* ring, uint64_t* full, uint64_t* empty, int k,
                                              const uint32_t (&xq)[PMAX][4], const int (&corr)[PMAX],
                                              const float (&scale)[PMAX], float* part) {
  constexpr int RS = GR * RPG;
  const int g = threadIdx.x / kQ4PieceThreads, t = threadIdx.x % kQ4PieceThreads, lane = t % 32, warp = t / 32;
  const int pieces = k / 16, groups = sg.scale_bytes / 2;
  for (int base0 = 0; base0 < sg.rows; base0 += RS) {
    const int slot = s.slot, base = base0 + g * RPG;
    barrier_wait(&full[slot], s.phase);
    s.next(stages);
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
