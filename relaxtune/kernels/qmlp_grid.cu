// What the blocks of one launch of the fused 4-bit decode MLP kernel (qmlp_stream.cu) share in global memory: the
// grid barriers between its steps (q4mlp_grid_barrier), and the counter from which they take gate / up's chunks
// (qmlp_steps.cu's q4mlp_produce_chunks). Appended after qstream_ring.cu and before qmlp_steps.cu in the gemv fatbin
// (kernels/gemv.py).
//
// The chunk counter of launch e is relaxtune_q4mlp_chunks[e & 1], e the launch's epoch (relaxtune_q4mlp_epoch, read
// once the previous kernel is done). Once every block has passed the second grid barrier (each has read the epoch and
// taken its last chunk), block 0 zeroes launch e + 1's counter and bumps the epoch; the module's memory starts at
// zero. Like the barriers, it needs every block of the grid resident at once (the cooperative launch).

__device__ unsigned int relaxtune_q4mlp_barrier[2];      // arrivals, generation (zero at module load)
__device__ unsigned long long relaxtune_q4mlp_arrivals;  // kCountBarrier: every arrival ever (zero at module load)
__device__ unsigned int relaxtune_q4mlp_epoch;
__device__ unsigned int relaxtune_q4mlp_chunks[2];  // gate / up chunks taken: launch e's is [e & 1]
enum { kGenerationBarrier = 0, kCountBarrier = 1 };

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

__device__ __forceinline__ unsigned int q4mlp_epoch() {  // this launch's (after the previous kernel is done)
  unsigned int e;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(e) : "l"(&relaxtune_q4mlp_epoch) : "memory");
  return e;
}

__device__ __forceinline__ void q4mlp_next_epoch(unsigned int e) {  // launch e + 1's chunk counter, then the epoch
  asm volatile("st.relaxed.gpu.global.u32 [%0], 0;" ::"l"(&relaxtune_q4mlp_chunks[(e + 1) & 1]) : "memory");
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(&relaxtune_q4mlp_epoch), "r"(e + 1) : "memory");
}

#endif
