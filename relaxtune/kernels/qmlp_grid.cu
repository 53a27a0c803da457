// The state the blocks of one launch of the fused 4-bit decode MLP kernel (qmlp_stream.cu) share in global memory:
// the grid barriers between its steps. Appended after qstream_ring.cu and before qmlp_steps.cu in the gemv fatbin
// (kernels/gemv.py).

__device__ unsigned int relaxtune_q4mlp_barrier[2];  // arrivals, generation (zero at module load)
__device__ unsigned long long relaxtune_q4mlp_arrivals;  // kCountBarrier: every arrival ever (zero at module load)
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
#endif
