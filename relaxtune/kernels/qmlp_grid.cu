// The state the blocks of one launch of the fused 4-bit decode MLP kernel (qmlp_stream.cu) share in global memory:
// the grid barriers between its steps. Appended after qstream_ring.cu and before qmlp_steps.cu in the gemv fatbin
// (kernels/gemv.py).

__device__ unsigned int relaxtune_q4mlp_barrier[2];  // arrivals, generation (zero at module load)
__device__ unsigned long long relaxtune_q4mlp_arrivals;  // kCountBarrier: every arrival ever (zero at module load)
enum { kGenerationBarrier = 0, kCountBarrier = 1, kTaggedWords = 2, kClaimedTiles = 3 };
// kTaggedWords: h, act and q | k | v as 32-bit words (the value's fp16 bits, this launch's tag above them), H, F and
// nqkv of them (the kernels' largest: H <= 4096 * 3, F <= 4096 * 4, nqkv <= 3 H), and the blocks done in this launch
// and the launches so far
constexpr int kQ4MlpTaggedWords = 4 * 4096 * 3 + 4096 * 4;
__device__ unsigned int relaxtune_q4mlp_tagged[kQ4MlpTaggedWords];
__device__ unsigned int relaxtune_q4mlp_launches[2];
// kClaimedTiles: tagged words, and the tiles of each step (q/k/v, o_proj, gate / up, down) claimed from a count of
// its own by the blocks' producers (qmlp_claim.cu); the launch's last block zeroes them (q4mlp_tagged_done)
constexpr int kQ4MlpSteps = 4;
__device__ unsigned int relaxtune_q4mlp_claims[kQ4MlpSteps];

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// every consumer thread of every block: what each wrote before is visible to all after. kGenerationBarrier: the last
// block to arrive resets the count and bumps the generation the others wait on (any grid size). kCountBarrier: one
// release-add to a count of every arrival ever, then acquire-loads until it reaches the next multiple of the grid: one
// round trip fewer on the critical path, but right only while every launch on the device has the same grid (the host
// takes it where the grid is the SM count) and runs to its end.
__device__ __forceinline__ void q4mlp_grid_barrier(int consumers, int kind) {
  asm volatile("bar.sync 1, %0;" ::"r"(consumers) : "memory");
  if (threadIdx.x == 0 && kind == kCountBarrier) {
    unsigned long long old, now;
    asm volatile("atom.add.release.gpu.global.u64 %0, [%1], 1;"
                 : "=l"(old)
                 : "l"(&relaxtune_q4mlp_arrivals)
                 : "memory");
    const unsigned long long target = (old / gridDim.x + 1) * gridDim.x;
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

// kTaggedWords, the grid barrier's alternative: a step's outputs are words tagged with the launch (launch L writes
// (L + 1) mod 2^16 above each value; the words of the module's load are zeros, no launch's), and each block polls the
// words it needs until all carry this launch's tag. The words of one launch are its own, since every launch rewrites
// every word it reads; no fence and no shared count stand between a writer and its readers, only the words' own round
// trip. Right while one launch at a time runs (as the count barrier), each to its end (q4mlp_tagged_done).
__device__ __forceinline__ unsigned int q4mlp_tag() {
  unsigned int launches;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(launches) : "l"(&relaxtune_q4mlp_launches[1]) : "memory");
  return ((launches + 1) & 0xFFFFu) << 16;
}

__device__ __forceinline__ void q4mlp_put_tagged(int at, __half v, unsigned int tag) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(relaxtune_q4mlp_tagged + at),
               "r"(static_cast<unsigned int>(__half_as_ushort(v)) | tag)
               : "memory");
}

// one uint4 of tagged words (4 values): the two words of fp16 pairs it packs to, and whether all carry `tag`
__device__ __forceinline__ bool q4mlp_tagged_quad(const uint4* at, unsigned int tag, unsigned int& lo,
                                                  unsigned int& hi) {
  uint4 v;
  asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(at)
               : "memory");
  lo = __byte_perm(v.x, v.y, 0x5410), hi = __byte_perm(v.z, v.w, 0x5410);
  const unsigned int all = v.x & v.y & v.z & v.w, any = v.x | v.y | v.z | v.w;
  return (all >> 16) == (tag >> 16) && (any >> 16) == (tag >> 16);
}

// every consumer thread of the block (`consumers`): the K values of the tagged words from word `first` into `stage`
// (K fp16 in shared memory), then the consumers' barrier. The block reads each word once: a thread's uint4s of words
// are loaded in one round, then each still without this launch's tag is polled alone, with a pause between polls
// (every thread polling all its words at once loads L2 with the blocks' polls while the weights stream through it;
// each word in turn in a tight loop, by relaxed loads or ld.global.cg, measured slower still: docs/results.md,
// 3916d36). QMAX: the most uint4s of words a thread polls (K / 4 / consumers, rounded up; <= 32)
template <int QMAX>
__device__ __forceinline__ void q4mlp_stage_tagged(int first, int k, unsigned int tag, int consumers, uint2* stage) {
  static_assert(QMAX <= 32, "a bit of `pending` a uint4 of words");
  const uint4* words = reinterpret_cast<const uint4*>(relaxtune_q4mlp_tagged + first);
  unsigned int pending = 0;
#pragma unroll
  for (int j = 0; j < QMAX; ++j) {
    const int at = threadIdx.x + j * consumers;
    unsigned int lo, hi;
    if (at >= k / 4) break;
    if (q4mlp_tagged_quad(words + at, tag, lo, hi)) {
      stage[at] = make_uint2(lo, hi);
    } else {
      pending |= 1u << j;
    }
  }
#pragma unroll
  for (int j = 0; j < QMAX; ++j) {
    if (!(pending >> j & 1u)) continue;
    const int at = threadIdx.x + j * consumers;
    unsigned int lo, hi;
    while (!q4mlp_tagged_quad(words + at, tag, lo, hi)) __nanosleep(64);
    stage[at] = make_uint2(lo, hi);
  }
  asm volatile("bar.sync 1, %0;" ::"r"(consumers) : "memory");
}

// kTaggedWords, kClaimedTiles: the block's end (every claim of its producer made); the last block of the launch zeroes
// the claims and counts the launch (the next one's tag)
__device__ __forceinline__ void q4mlp_tagged_done() {
  if (threadIdx.x != 0) return;
  if (atomicAdd(&relaxtune_q4mlp_launches[0], 1u) == gridDim.x - 1) {
    for (int step = 0; step < kQ4MlpSteps; ++step) atomicExch(&relaxtune_q4mlp_claims[step], 0u);
    atomicExch(&relaxtune_q4mlp_launches[0], 0u);
    atomicAdd(&relaxtune_q4mlp_launches[1], 1u);
  }
}
#endif
