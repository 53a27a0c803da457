// What relaxtune's streamed 4-bit kernels (qgemv_stream.cu, qmlp_stream.cu; compute capability 9.0+) share: the
// shared-memory ring a producer warp fills with bulk asynchronous copies (cp.async.bulk, an mbarrier per slot counting
// its bytes, another its consumer warps' releases; Q4RingSlot walks the slots and their phases), the int8 pieces of x
// (quantize_piece: 16 values, one float scale, the bytes in the nibbles' order, -8 x their sum) and their dot product
// with a row's 16 4-bit weights (dot_piece_i8: lop3 masks and dp4a), and the transposing butterfly that reduces a
// warp's row sums (warp_transposed_sum). Appended after qgemv.cu in the gemv fatbin (kernels/gemv.py); the host's
// copies of its sizes: qgemv_host.cc.
#include <cuda_fp16.h>
#include <stdint.h>

constexpr int kQ4PieceThreads = 256;      // threads of a row group: 8 warps
constexpr int kQ4StreamMaxStages = 64;    // mbarriers: full and empty per slot in the first kQ4BarrierBytes
constexpr int kQ4BarrierBytes = 1024;

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// d = c + a . b over 4 bytes, a's unsigned and b's signed
__device__ __forceinline__ int dot4_u8s8(uint32_t a, uint32_t b, int c) {
  int d;
  asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// 16 halfs of x (h[0]: 0-7, h[1]: 8-15) as int8 q = rint(x * 127 / absmax) in the order dot4_u8s8 meets the nibbles
// of two words of the GPU layout (word & 0x0F0F0F0F holds weights 0, 4, 1, 5 of its 8; word & 0xF0F0F0F0 2, 6, 3, 7,
// as 16 x): q[0] = x 0 4 1 5, q[1] = x 2 6 3 7, q[2] = x 8 12 9 13, q[3] = x 10 14 11 15; corr = -8 sum(q), and
// scale16 = absmax / (127 * 16), the factor of the joined sums (16 x the low nibbles' + the high nibbles').
// rint without a conversion (F2I runs at a quarter of the FP32 rate): x * 127 / absmax (rounded to fp32 as before)
// plus 1.5 * 2^23 rounds to the nearest integer, ties to even, into the low mantissa bits, whose low byte is the int8
// in two's complement; byte permutes gather the bytes, a dp4a with ones sums them
__device__ __forceinline__ void quantize_piece(const uint4 (&h)[2], uint32_t (&q)[4], int& corr, float& scale16) {
  const uint32_t words[8] = {h[0].x, h[0].y, h[0].z, h[0].w, h[1].x, h[1].y, h[1].z, h[1].w};
  __half2 top = __habs2(half2_bits(words[0]));
#pragma unroll
  for (int e = 1; e < 8; ++e) top = __hmax2(top, __habs2(half2_bits(words[e])));
  const float amax = fmaxf(__low2float(top), __high2float(top));
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  uint32_t v[16];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float2 f = __half22float2(half2_bits(words[e]));
    v[2 * e] = __float_as_uint(__fadd_rn(__fmul_rn(f.x, inv), kRound));
    v[2 * e + 1] = __float_as_uint(__fadd_rn(__fmul_rn(f.y, inv), kRound));
  }
  auto bytes = [&](int a, int b, int c, int d) {  // the low bytes of v[a], v[b], v[c], v[d], in that order
    return __byte_perm(__byte_perm(v[a], v[b], 0x0040), __byte_perm(v[c], v[d], 0x0040), 0x5410);
  };
  q[0] = bytes(0, 4, 1, 5), q[1] = bytes(2, 6, 3, 7), q[2] = bytes(8, 12, 9, 13), q[3] = bytes(10, 14, 11, 15);
  int sum = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) asm("dp4a.s32.s32 %0, %1, %2, %0;" : "+r"(sum) : "r"(q[i]), "r"(0x01010101));
  corr = -8 * sum, scale16 = amax / 2032.0f;
}

// 16 x the dot product of a piece's 16 weights (two words of the GPU layout, as unsigned nibbles) with its int8 x
// (quantize_piece's q and corr): 4 masks and 4 dp4a, the low nibbles' sum from corr, the high nibbles' as 16 x
__device__ __forceinline__ int dot_piece_i8(const uint2& q, const uint32_t (&xq)[4], int corr) {
  const int lo = dot4_u8s8(q.y & 0x0F0F0F0Fu, xq[2], dot4_u8s8(q.x & 0x0F0F0F0Fu, xq[0], corr));
  const int hi = dot4_u8s8(q.y & 0xF0F0F0F0u, xq[3], dot4_u8s8(q.x & 0xF0F0F0F0u, xq[1], 0));
  return 16 * lo + hi;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void barrier_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void barrier_expect_bytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void barrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(bar)) : "memory");
}

__device__ __forceinline__ void barrier_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}" ::"r"(shared_address(bar)),
      "r"(parity)
      : "memory");
}

// the consumers' next ring slot and its full barrier's parity: s % stages and (s / stages) & 1 for the s-th slot,
// advanced slot by slot (no division per slot)
struct Q4RingSlot {
  int slot = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void next(int stages) { slot = slot + 1 == stages ? 0 : slot + 1, phase ^= slot == 0; }
};

// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global `src` to shared `dst`, counted on `bar`
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(shared_address(dst)), "l"(src), "r"(bytes), "r"(shared_address(bar))
               : "memory");
}

// one step of warp_transposed_sum: N of the NV values left per lane; keep half, add the partner's same half
template <int N, int NV>
__device__ __forceinline__ void halve_over_lanes(float (&v)[NV], int lane) {
  if constexpr (N > 1) {
    constexpr int offset = 16 * N / NV;
    const bool upper = (lane & offset) != 0;
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const float give = upper ? v[i] : v[i + N / 2], keep = upper ? v[i + N / 2] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, give, offset);
    }
    halve_over_lanes<N / 2, NV>(v, lane);
  }
}

// the sums over the warp of NV values per lane (NV a power of two <= 32): lane l gets value l / (32 / NV)'s
template <int NV>
__device__ __forceinline__ float warp_transposed_sum(float (&v)[NV], int lane) {
  halve_over_lanes<NV, NV>(v, lane);
  float s = v[0];
#pragma unroll
  for (int offset = 16 / NV; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
  return s;
}
#endif
