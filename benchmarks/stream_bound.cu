// The skeleton of relaxtune's fused 4-bit decode kernels for benchmarks/stream_bound.py: the same weight bytes,
// streamed the same way (one block per SM, launched cooperatively; a producer warp's cp.async.bulk copies into a ring
// of shared-memory slots, qstream_ring.cu's helpers), the same grid barrier between the steps (qmlp_grid.cu's) and the
// same outputs written before it and read back after it, but no arithmetic: the consumers only read each slot once.
// Its time per call is the least a kernel of this design can take for those bytes and dependencies. Where readback[0]
// > 0 the consumers first wait for the previous kernel (a programmatic dependent launch) and read the kernel's input,
// as the product reads x or q / k / v. Appended after relaxtune's gemv kernel sources (kernels/gemv.py's
// KERNEL_SOURCE), which it uses unchanged.

constexpr int kBoundMaxSegments = 8, kBoundMaxSteps = 4, kBoundEvents = 2 + 2 * kBoundMaxSteps;
constexpr int kBoundConsumers = 2 * kQ4PieceThreads;  // two row groups, as relaxtune_q4mlp_h1f4

struct BoundSegment {  // must match stream_bound.py's Segment
  const char *w, *s;   // rows x row_bytes, rows x scale_bytes
  int rows, row_bytes, scale_bytes, rows_per_slot;
  int step;  // 0 ..: a step > 0 starts after a grid barrier (where `barriers`), then reads back the outputs before it
  int out;  // this segment's outputs' offset in `out` (2 bytes a row)
};

struct BoundParams {  // must match stream_bound.py's Params
  BoundSegment seg[kBoundMaxSegments];
  int segments, stages, stage_bytes, ahead, barriers, barrier_kind;
  char* out;  // every step's outputs, 2 bytes a row of its segments
  int readback[kBoundMaxSteps];  // bytes of `out` every block reads after the barrier that starts the step (0: first)
  int readfrom[kBoundMaxSteps];  // their offset
  unsigned long long* trace;  // null, or kBoundEvents globaltimer stamps a block
  unsigned int* sink;  // one word a block: what the consumers read, so that no read is dropped
  // reduce > 0: the last step's products are partial sums over each block's own K (split-K, as down over the block's
  // own features of silu(gate) * up would be): every block adds `reduce` floats into `red`, the last to count itself
  // in `arrived` reads them back, writes them as fp16 to out and zeroes `red` and `arrived` for the next launch
  float* red;
  unsigned int* arrived;
  int reduce;
  int prefetch;  // > 0: where the producer stops at a barrier, it first asks L2 for the step's next `prefetch` slots
  // dynamic: the blocks claim a step's tiles (one slot of each of its segments, rows alike) from tiles[step] instead
  // of streaming a fixed share, so that a block whose memory is fast takes more. With dynamic or kTaggedBarrier,
  // tiles[kBoundMaxSteps] counts the blocks done; the last one zeroes every count for the next launch and bumps the
  // launch's tag, tiles[kBoundMaxSteps + 1] (kTaggedBarrier: each output a 32-bit word, its value and the tag of the
  // launch that wrote it; a block after a step's outputs polls them until every word has this launch's tag: no
  // barrier, no fence)
  int dynamic;
  unsigned long long* tiles;
};
static_assert(sizeof(BoundSegment) == 40 && sizeof(BoundParams) == 440, "stream_bound.py's Segment and Params");

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// `bytes` (a multiple of 16) from global `src` into L2, nothing waiting on them
__device__ __forceinline__ void prefetch_l2(const char* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}

// the product's barrier (kinds 0, 1), or its count barrier with no ordering at all (kRelaxedBarrier: the outputs are
// not made visible; only what the meeting itself takes), or polled relaxed with one acquire fence once the count is
// met (kPolledBarrier: the same ordering as the product's, one fence instead of one a poll)
constexpr int kRelaxedBarrier = 2, kPolledBarrier = 3, kTaggedBarrier = 4;
__device__ __forceinline__ void bound_grid_barrier(int kind) {
  if (kind != kRelaxedBarrier && kind != kPolledBarrier) return q4mlp_grid_barrier(kBoundConsumers, kind);
  asm volatile("bar.sync 1, %0;" ::"r"(kBoundConsumers) : "memory");
  if (threadIdx.x == 0) {
    unsigned long long old, now;
    unsigned long long* count = &relaxtune_q4mlp_arrivals;
    if (kind == kRelaxedBarrier) {
      asm volatile("atom.add.relaxed.gpu.global.u64 %0, [%1], 1;" : "=l"(old) : "l"(count) : "memory");
    } else {
      asm volatile("atom.add.release.gpu.global.u64 %0, [%1], 1;" : "=l"(old) : "l"(count) : "memory");
    }
    const unsigned long long target = (old / gridDim.x + 1) * gridDim.x;
    do {
      asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(now) : "l"(count) : "memory");
    } while (now < target);
    if (kind == kPolledBarrier) asm volatile("fence.acq_rel.gpu;" ::: "memory");
  }
  asm volatile("bar.sync 1, %0;" ::"r"(kBoundConsumers) : "memory");
}

__device__ __forceinline__ void bound_stamp(const BoundParams& p, int e) { globaltimer_stamp<kBoundEvents>(p, e); }

// `here` rows of segment sg from its row `row` into ring slot `slot`, counted on the slot's full barrier
__device__ __forceinline__ void bound_copy_rows(const BoundParams& p, const BoundSegment& sg, unsigned char* ring,
                                                uint64_t* full, int slot, int row, int here) {
  unsigned char* dst = ring + static_cast<size_t>(slot) * p.stage_bytes;
  barrier_expect_bytes(&full[slot], here * (sg.row_bytes + sg.scale_bytes));
  bulk_copy(dst, sg.w + static_cast<size_t>(row) * sg.row_bytes, here * sg.row_bytes, &full[slot]);
  bulk_copy(dst + sg.rows_per_slot * sg.row_bytes, sg.s + static_cast<size_t>(row) * sg.scale_bytes,
            here * sg.scale_bytes, &full[slot]);
}

// readback[step] bytes of `out` from readfrom[step], through L2, into `seen`
__device__ __forceinline__ void bound_read_back(const BoundParams& p, int step, unsigned int& seen) {
  const uint4* back = reinterpret_cast<const uint4*>(p.out + p.readfrom[step]);
  for (int v = threadIdx.x; v < p.readback[step] / 16; v += kBoundConsumers) seen ^= __ldcg(back + v).x;
}

// kTaggedBarrier: this launch's tag, above each output's 16 bits
__device__ __forceinline__ unsigned int bound_tag(const BoundParams& p) {
  return p.barrier_kind == kTaggedBarrier ? static_cast<unsigned int>(__ldcg(p.tiles + kBoundMaxSteps + 1)) << 16 : 0;
}

// output `row` of the segment whose outputs start at `out`: 2 bytes, or with kTaggedBarrier a word under `tag`
__device__ __forceinline__ void bound_put_output(const BoundParams& p, int out, int row, unsigned int value,
                                                 unsigned int tag) {
  if (p.barrier_kind == kTaggedBarrier) {
    __stcg(reinterpret_cast<unsigned int*>(p.out + out) + row, (value & 0xFFFFu) | tag);
  } else {
    reinterpret_cast<unsigned short*>(p.out + out)[row] = static_cast<unsigned short>(value);
  }
}

// kTaggedBarrier: the step's read back, readback[step] / 2 words, each polled until it has this launch's tag
__device__ __forceinline__ void bound_read_tagged(const BoundParams& p, int step, unsigned int tag,
                                                  unsigned int& seen) {
  const uint4* back = reinterpret_cast<const uint4*>(p.out + p.readfrom[step]);
  for (int v = threadIdx.x; v < p.readback[step] / 8; v += kBoundConsumers) {
    uint4 w;
    do w = __ldcg(back + v);
    while (((w.x & w.y & w.z & w.w) >> 16 != tag >> 16) || ((w.x | w.y | w.z | w.w) >> 16 != tag >> 16));
    seen ^= w.x;
  }
  asm volatile("bar.sync 1, %0;" ::"r"(kBoundConsumers) : "memory");
}

// the consumers at the start of step > 0: the barrier and the read back of the step before's outputs, or the
// tagged words polled (stamps 2 step and 2 step + 1 around it); `passed` tells the producer
__device__ __forceinline__ void bound_meet(const BoundParams& p, int step, unsigned int tag, volatile int* passed,
                                           unsigned int& seen) {
  const bool stamps = threadIdx.x == 0, tagged = p.barrier_kind == kTaggedBarrier;
  if (stamps) bound_stamp(p, 2 * step);
  if (p.barriers) {
    if (tagged) bound_read_tagged(p, step, tag, seen);
    else bound_grid_barrier(p.barrier_kind);
    if (threadIdx.x == 0) *passed = step;
  }
  if (stamps) bound_stamp(p, 2 * step + 1);
  if (!(p.barriers && tagged)) bound_read_back(p, step, seen);
}

// the block's end where the launch keeps counts (dynamic, kTaggedBarrier): the last block zeroes the claims and
// bumps the tag
__device__ __forceinline__ void bound_launch_done(const BoundParams& p) {
  if (threadIdx.x == 0 && atomicAdd(p.tiles + kBoundMaxSteps, 1ull) == gridDim.x - 1) {  // every claim is made
    for (int step = 0; step <= kBoundMaxSteps; ++step) atomicExch(p.tiles + step, 0ull);
    atomicAdd(p.tiles + kBoundMaxSteps + 1, 1ull);
  }
}
#endif

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// p.dynamic: the producer claims a step's tiles until none is left, then ends the step with a slot of tile -1; the
// consumers write each tile's outputs as they read it
__device__ void bound_dynamic(const BoundParams& p, uint64_t* full, uint64_t* empty, volatile int* passed,
                              unsigned char* ring, int* slot_tile) {
  const int last_step = p.seg[p.segments - 1].step;
  auto first_of = [&](int step) {
    int j = 0;
    while (p.seg[j].step != step) ++j;
    return j;
  };
  if (threadIdx.x >= kBoundConsumers) {
    if (threadIdx.x != kBoundConsumers) return;
    int s = 0;
    for (int step = 0; step <= last_step; ++step) {
      const int j0 = first_of(step);
      int j1 = j0;
      while (j1 < p.segments && p.seg[j1].step == step) ++j1;
      const BoundSegment& lead = p.seg[j0];
      const unsigned long long tiles = (lead.rows + lead.rows_per_slot - 1) / lead.rows_per_slot;
      for (int n = 0;;) {
        int slot = s % p.stages;
        if (s >= p.stages) barrier_wait(&empty[slot], (s / p.stages - 1) & 1);
        const unsigned long long t = atomicAdd(p.tiles + step, 1ull);
        if (t >= tiles) {
          slot_tile[slot] = -1;
          barrier_arrive(&full[slot]);
          ++s;
          break;
        }
        const int r = static_cast<int>(t) * lead.rows_per_slot, here = min(lead.rows_per_slot, lead.rows - r);
        for (int j = j0; j < j1; ++j, ++s, ++n) {
          const BoundSegment& sg = p.seg[j];
          slot = s % p.stages;
          if (j > j0 && s >= p.stages) barrier_wait(&empty[slot], (s / p.stages - 1) & 1);
          if (p.barriers && n >= p.ahead && *passed < step) while (*passed < step) __nanosleep(64);
          slot_tile[slot] = j << 16 | r;
          bound_copy_rows(p, sg, ring, full, slot, r, here);
        }
      }
    }
    return;
  }
  const bool stamps = threadIdx.x == 0;
  if (stamps) bound_stamp(p, 0);
  unsigned int seen = 0;
  const unsigned int tag = bound_tag(p);
  if (p.readback[0] > 0) {
    wait_for_previous_kernel();
    bound_read_back(p, 0, seen);
  }
  Q4RingSlot ring_slot;
  for (int step = 0; step <= last_step; ++step) {
    if (step > 0) {
      bound_meet(p, step, tag, passed, seen);
    }
    for (;;) {
      const int slot = ring_slot.slot;
      barrier_wait(&full[slot], ring_slot.phase);
      ring_slot.next(p.stages);
      const int tile = slot_tile[slot];
      if (tile >= 0) {
        const BoundSegment& sg = p.seg[tile >> 16];
        const int r = tile & 0xFFFF, here = min(sg.rows_per_slot, sg.rows - r);
        const int slot_bytes = sg.rows_per_slot * (sg.row_bytes + sg.scale_bytes);
        const uint4* data = reinterpret_cast<const uint4*>(ring + static_cast<size_t>(slot) * p.stage_bytes);
        for (int v = threadIdx.x; v < slot_bytes / 16; v += kBoundConsumers) seen += data[v].y;
        if (threadIdx.x < here) bound_put_output(p, sg.out, r + threadIdx.x, seen, tag);
      }
      __syncwarp();
      if (threadIdx.x % 32 == 0) barrier_arrive(&empty[slot]);
      if (tile < 0) break;
    }
  }
  if (stamps) bound_stamp(p, 2 * kBoundMaxSteps);
  seen = __reduce_add_sync(0xffffffffu, seen);
  if (threadIdx.x % 32 == 0) atomicAdd(p.sink + blockIdx.x, seen);
  bound_launch_done(p);
  if (stamps) bound_stamp(p, 2 * kBoundMaxSteps + 1);
}
#endif

extern "C" __global__ void __launch_bounds__(kBoundConsumers + 32, 1) relaxtune_stream_bound(BoundParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char bound_smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(bound_smem);
  uint64_t* empty = full + kQ4StreamMaxStages;
  volatile int* passed = reinterpret_cast<volatile int*>(full + kQ4StreamMaxStages - 1);
  unsigned char* ring = bound_smem + kQ4BarrierBytes;
  const int b = blockIdx.x, blocks = gridDim.x;
  auto share = [&](int n, int i) { return static_cast<int>(static_cast<long long>(i) * n / blocks); };
  if (threadIdx.x == 0) {
    for (int s = 0; s < p.stages; ++s) barrier_init(&full[s], 1), barrier_init(&empty[s], kBoundConsumers / 32);
    *passed = 0;
    asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();
  int* slot_tile = reinterpret_cast<int*>(full + p.stages);  // dynamic: each slot's (segment << 16 | row), -1 ends
  if (p.dynamic) {
    bound_dynamic(p, full, empty, passed, ring, slot_tile);
    return;
  }
  if (threadIdx.x >= kBoundConsumers) {  // the producer warp, as qmlp_stream.cu's
    if (threadIdx.x == kBoundConsumers) {
      int s = 0;
      for (int i = 0, n = 0; i < p.segments; ++i) {
        const BoundSegment& sg = p.seg[i];
        if (i > 0 && sg.step != p.seg[i - 1].step) n = 0;  // slots of this step so far
        const int r0 = share(sg.rows, b), rows = share(sg.rows, b + 1) - r0;
        for (int r = 0; r < rows; r += sg.rows_per_slot, ++s, ++n) {
          const int slot = s % p.stages, here = min(sg.rows_per_slot, rows - r);
          if (s >= p.stages) barrier_wait(&empty[slot], (s / p.stages - 1) & 1);
          if (p.barriers && n >= p.ahead && *passed < sg.step) {
            if (n == p.ahead && p.prefetch > 0) {  // the memory keeps streaming into L2 while the barrier is met
              const int last = min(rows, r + p.prefetch * sg.rows_per_slot);
              prefetch_l2(sg.w + static_cast<size_t>(r0 + r) * sg.row_bytes, (last - r) * sg.row_bytes);
              prefetch_l2(sg.s + static_cast<size_t>(r0 + r) * sg.scale_bytes, (last - r) * sg.scale_bytes);
            }
            while (*passed < sg.step) __nanosleep(64);
          }
          bound_copy_rows(p, sg, ring, full, slot, r0 + r, here);
        }
      }
    }
    return;
  }
  const bool stamps = threadIdx.x == 0, tagged = p.barrier_kind == kTaggedBarrier;
  if (stamps) bound_stamp(p, 0);
  unsigned int seen = 0;
  const unsigned int tag = bound_tag(p);
  auto write_outputs = [&](int step) {  // this block's rows of the step's outputs
    for (int j = 0; j < p.segments; ++j) {
      if (p.seg[j].step != step) continue;
      const int r0 = share(p.seg[j].rows, b), rows = share(p.seg[j].rows, b + 1) - r0;
      for (int r = threadIdx.x; r < rows; r += kBoundConsumers)
        bound_put_output(p, p.seg[j].out, r0 + r, seen + r, tag);
    }
  };
  if (p.readback[0] > 0) {
    wait_for_previous_kernel();
    bound_read_back(p, 0, seen);
  }
  Q4RingSlot ring_slot;
  for (int i = 0; i < p.segments; ++i) {
    const BoundSegment& sg = p.seg[i];
    if (i > 0 && sg.step != p.seg[i - 1].step) {  // the step before is done: its outputs, the barrier, the read back
      const int step = sg.step;
      write_outputs(step - 1);
      bound_meet(p, step, tag, passed, seen);
    }
    const int r0 = share(sg.rows, b), rows = share(sg.rows, b + 1) - r0;
    const int slot_bytes = sg.rows_per_slot * (sg.row_bytes + sg.scale_bytes);
    for (int r = 0; r < rows; r += sg.rows_per_slot) {
      const int slot = ring_slot.slot;
      barrier_wait(&full[slot], ring_slot.phase);
      ring_slot.next(p.stages);
      const uint4* data = reinterpret_cast<const uint4*>(ring + static_cast<size_t>(slot) * p.stage_bytes);
      for (int v = threadIdx.x; v < slot_bytes / 16; v += kBoundConsumers) seen += data[v].y;
      __syncwarp();
      if (threadIdx.x % 32 == 0) barrier_arrive(&empty[slot]);
    }
  }
  if (stamps) bound_stamp(p, 2 * kBoundMaxSteps);
  asm volatile("bar.sync 1, %0;" ::"r"(kBoundConsumers) : "memory");  // the last step's outputs: every slot read
  write_outputs(p.seg[p.segments - 1].step);
  seen = __reduce_add_sync(0xffffffffu, seen);
  if (threadIdx.x % 32 == 0) atomicAdd(p.sink + b, seen);
  if (tagged) bound_launch_done(p);
  if (p.reduce > 0) {  // split-K: this block's partial sums into red; the last block to arrive finishes y
    const float part = static_cast<float>(seen & 0xFF);
    for (int v = threadIdx.x; v < p.reduce / 4; v += kBoundConsumers)
      atomicAdd(reinterpret_cast<float4*>(p.red) + v, make_float4(part, part, part, part));
    __threadfence();
    asm volatile("bar.sync 1, %0;" ::"r"(kBoundConsumers) : "memory");
    volatile int* last = passed;  // the count of barriers passed is no longer read
    if (threadIdx.x == 0) *last = atomicAdd(p.arrived, 1u) == gridDim.x - 1 ? -1 : 0;
    asm volatile("bar.sync 1, %0;" ::"r"(kBoundConsumers) : "memory");
    if (*last == -1) {
      __threadfence();
      unsigned short* y = reinterpret_cast<unsigned short*>(p.out + p.seg[p.segments - 1].out);
      for (int v = threadIdx.x; v < p.reduce; v += kBoundConsumers) {
        y[v] = __half_as_ushort(__float2half_rn(__ldcg(p.red + v)));
        p.red[v] = 0.0f;
      }
      if (threadIdx.x == 0) *p.arrived = 0;
    }
  }
  if (stamps) bound_stamp(p, 2 * kBoundMaxSteps + 1);
#endif
}
