// The fused 4-bit decode MLP kernel's claimed tiles (qmlp_stream.cu, kClaimedTiles): instead of a fixed share of each
// weight's rows, a block streams the tiles its producer claims from the step's count (qmlp_grid.cu's
// relaxtune_q4mlp_claims), so that a block whose memory is fast takes more and the blocks end a step together (the
// skeleton's `-dyn` forms, benchmarks/stream_bound.cu). A tile is one ring slot of each of the step's segments, rows
// alike (gate's rows and up's: act's rows are the tile's); the consumers write its outputs as soon as they have it.
// The outputs the next step reads are tagged words (every block reads all of them, written by any block). Appended
// after qmlp_steps.cu and before qmlp_stream.cu in the gemv fatbin (kernels/gemv.py).

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// the ring slot's tile (its first row; -1: the step's end) where the producer writes it for the consumers: in the
// full barriers' place past the ring's (the host keeps the ring at most kQ4StreamMaxStages / 2 slots)
__device__ __forceinline__ int* q4mlp_slot_tiles(uint64_t* full) {
  return reinterpret_cast<int*>(full + kQ4StreamMaxStages / 2);
}

// the producer warp's lane 0, the steps of `seg` (the whole weights: q / k / v where `qkv`, o_proj, gate and up, down;
// rs_h, rs_f: the rows of a slot of the K = A, H ones and of down): each step's tiles, the block's own then those
// claimed one after another from the step's count until the count passes them, each tile's slots copied (a slot's
// tile in q4mlp_slot_tiles), then a slot with tile -1 (no bytes) ends the step; the first `ahead` slots of a step are
// claimed before the consumers pass its meeting (`passed`), the rest after; done(k) once step k's last claim fails
// (k: 0 q / k / v .. 3 down)
template <typename Done>
__device__ __forceinline__ void q4mlp_produce_claimed(const Q4MlpSegment (&seg)[5], int rs_h, int rs_f, bool qkv,
                                                      unsigned char* ring, uint64_t* full, uint64_t* empty, int stages,
                                                      int stage_bytes, int ahead, volatile int* passed, Done done) {
  int* slot_tile = q4mlp_slot_tiles(full);
  int s = 0, n = 0;  // slots so far, and of this step
  // the tile's rows r .. r + here of segment `sg` (rows_per_slot a slot) into the next slot, waited for unless `ready`
  auto copy = [&](const Q4MlpSegment& sg, int rows_per_slot, int r, int here, bool ready) {
    const int slot = s % stages;
    if (!ready && s >= stages) barrier_wait(&empty[slot], (s / stages - 1) & 1);
    slot_tile[slot] = r;
    unsigned char* dst = ring + static_cast<size_t>(slot) * stage_bytes;
    barrier_expect_bytes(&full[slot], here * (sg.row_bytes + sg.scale_bytes));
    bulk_copy(dst, sg.w + static_cast<size_t>(r) * sg.row_bytes, here * sg.row_bytes, &full[slot]);
    bulk_copy(dst + rows_per_slot * sg.row_bytes, sg.s + static_cast<size_t>(r) * sg.scale_bytes, here * sg.scale_bytes,
              &full[slot]);
    ++s, ++n;
  };
  bool claiming = false;  // past the first claim
#pragma unroll 1
  for (int k = qkv ? 0 : 1; k < 4; ++k) {  // one copy of the loop (a segment picked by value: no local memory)
    const Q4MlpSegment sg = k == 0 ? seg[0] : k == 1 ? seg[1] : k == 2 ? seg[2] : seg[4], up = seg[3];
    const int rs = k < 3 ? rs_h : rs_f, step = qkv ? k : k - 1;
    const unsigned int tiles = (sg.rows + rs - 1) / rs;
    for (n = 0;;) {
      const int slot = s % stages;
      if (s >= stages) barrier_wait(&empty[slot], (s / stages - 1) & 1);
      if (n >= ahead)
        while (*passed < step) __nanosleep(64);
      // the step's first tile is the block's own (its number), the rest are claimed past the grid's; the first claim
      // waits for the previous kernel, whose last block may be the previous launch's zeroing the counts
      unsigned int tile = n == 0 ? blockIdx.x : gridDim.x;
      if (n > 0 && tile < tiles) {
        if (!claiming) wait_for_previous_kernel(), claiming = true;
        tile += atomicAdd(&relaxtune_q4mlp_claims[step], 1u);
      }
      if (tile >= tiles) {
        slot_tile[slot] = -1;
        barrier_arrive(&full[slot]);
        ++s;
        break;
      }
      const int r = static_cast<int>(tile) * rs, here = min(rs, sg.rows - r);
      copy(sg, rs, r, here, true);
      if (k == 2) copy(up, rs, r, here, false);  // up's rows, as gate's
    }
    done(k);
  }
}

// the consumers' side of one step of claimed tiles (SEGS segments of the whole weights, RPG rows per row group and
// slot), until the slot that ends the step: per tile the segments' partial sums (q4mlp_consume over the tile's rows)
// into one of two halves of `part` in turn (the next tile's are written while this one's are read), the consumers'
// barrier, then out(row, sums, i, second) for each of the tile's rows (the weight's row; segment 0's partial sums of
// it are row i of `sums`, segment 1's row i of sums + second: q4mlp_row_sum's)
template <int GR, int RPG, int PMAX, int SEGS, typename Out>
__device__ __forceinline__ void q4mlp_consume_claimed(const Q4MlpSegment* seg, Q4RingSlot& s, int stages,
                                                      int stage_bytes, unsigned char* ring, uint64_t* full,
                                                      uint64_t* empty, int k, const uint32_t (&xq)[PMAX][4],
                                                      const int (&corr)[PMAX], const float (&scale)[PMAX], float* part,
                                                      Out out) {
  constexpr int RS = GR * RPG, kConsumers = GR * kQ4PieceThreads, kSums = RS * (kQ4PieceThreads / 32);
  const int* slot_tile = q4mlp_slot_tiles(full);
  for (int n = 0;; ++n) {
    barrier_wait(&full[s.slot], s.phase);
    const int r = slot_tile[s.slot];
    if (r < 0) {  // the step's end: the slot is given back as a consumed one is
      __syncwarp();
      if (threadIdx.x % 32 == 0) barrier_arrive(&empty[s.slot]);
      s.next(stages);
      return;
    }
    float* sums = part + (n % 2) * SEGS * kSums;
    const int here = min(RS, seg[0].rows - r);
#pragma unroll
    for (int j = 0; j < SEGS; ++j) {
      Q4MlpSegment tile = seg[j];
      tile.rows = here;  // the consumers read the slot, not the weight: only its rows count
      q4mlp_consume<GR, RPG, PMAX>(tile, s, stages, stage_bytes, ring, full, empty, k, xq, corr, scale,
                                   sums + j * kSums);
    }
    asm volatile("bar.sync 1, %0;" ::"r"(kConsumers) : "memory");
    for (int i = threadIdx.x; i < here; i += kConsumers) out(r + i, sums, i, kSums);
  }
}
#endif
