// What relaxtune's two Hopper flash attention kernels (flash_attention_sm90.cu, flash_attention_sm90_ws.cu; sm_90a)
// share, appended after flash_attention.cu (its Params, pack / unpack and mma_sm80.cu's cp.async) in one translation
// unit: the wgmma wrappers (Wgmma<T, N>::ss / rs for m64nNk16, fp32 accumulators), the warpgroup fences, commit and
// wait, the shared-memory matrix descriptor and its 128-byte swizzle, the tile loaders (plain and with q rotated), and
// the steps on a warpgroup's accumulators both kernels take (online_softmax, pack_p, inverse_row_sums). Without
// sm_90a features (RELAXTUNE_WGMMA unset) the wrappers compile to nothing, for the kernels' trapping stubs.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define RELAXTUNE_WGMMA 1
#endif

namespace {

#define RT_D32                                                                                                      \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31}"
#define RT_D64                                                                       \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "          \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define RT_OUT8(b)                                                                                            \
  "+f"(d[b]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3]), "+f"(d[b + 4]), "+f"(d[b + 5]), "+f"(d[b + 6]), \
      "+f"(d[b + 7])
#define RT_OUT32 RT_OUT8(0), RT_OUT8(8), RT_OUT8(16), RT_OUT8(24)
#define RT_OUT64 RT_OUT32, RT_OUT8(32), RT_OUT8(40), RT_OUT8(48), RT_OUT8(56)

// d (64 x N fp32 accumulators of the warpgroup, the mma.sync C layout per 8 columns) += a * b:
// ss: a (64 x 16) and b (16 x N, K-major) in shared memory; rs: a in registers (the mma.sync A
// layout), b (16 x N) read transposed (N-major). scale_d 0: d = a * b.
template <typename T, int N>
struct Wgmma;
#ifdef RELAXTUNE_WGMMA
#define RT_WGMMA(TYPE, DT, N, DREGS, OUTS, SS_OPS, RS_OPS)                                                     \
  template <>                                                                                                  \
  struct Wgmma<TYPE, N> {                                                                                      \
    static __device__ __forceinline__ void ss(float* d, uint64_t a, uint64_t b, int scale_d) {                 \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SS_OPS ";\n}\n" : OUTS : "l"(a), "l"(b), "r"(scale_d)); \
    }                                                                                                          \
    static __device__ __forceinline__ void rs(float* d, const uint32_t* a, uint64_t b, int scale_d) {          \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " RS_OPS ";\n}\n"                                         \
                   : OUTS                                                                                      \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));                        \
    }                                                                                                          \
  };
#define RT_WGMMA_TYPE(TYPE, DT)                                                                                      \
  RT_WGMMA(TYPE, DT, 64, RT_D32, RT_OUT32,                                                                           \
           "%34, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32." DT "." DT " " RT_D32 ", %32, %33, p, 1, 1, 0, 0",  \
           "%37, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32." DT "." DT " " RT_D32                               \
           ", {%32, %33, %34, %35}, %36, p, 1, 1, 1")                                                                \
  RT_WGMMA(TYPE, DT, 128, RT_D64, RT_OUT64,                                                                          \
           "%66, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32." DT "." DT " " RT_D64 ", %64, %65, p, 1, 1, 0, 0", \
           "%69, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32." DT "." DT " " RT_D64                              \
           ", {%64, %65, %66, %67}, %68, p, 1, 1, 1")

RT_WGMMA_TYPE(__half, "f16")
RT_WGMMA_TYPE(__nv_bfloat16, "bf16")
#endif

__device__ __forceinline__ void wg_fence() {
#ifdef RELAXTUNE_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wg_commit() {
#ifdef RELAXTUNE_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void wg_wait() {
#ifdef RELAXTUNE_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// keeps the compiler from moving uses of wgmma results above the wait (the asm outputs look ready at issue)
template <int COUNT>
__device__ __forceinline__ void reg_fence(float* r) {
#pragma unroll
  for (int i = 0; i < COUNT; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// cp.async / st.shared writes (generic proxy) visible to wgmma's reads (async proxy)
__device__ __forceinline__ void fence_async_smem() {
#ifdef RELAXTUNE_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// shared-memory matrix descriptor, 128-byte swizzle: start address, leading / stride byte offsets
__device__ __forceinline__ uint64_t gmma_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32) | (1ull << 62);
}

// byte offset of 16-byte chunk `c` of row `row` in a tile of ROWS rows stored as 64-column blocks
// of ROWS x 128 bytes, chunks XOR-swizzled by row (the wgmma 128-byte swizzle; tiles 1024-aligned)
template <int ROWS>
__device__ __forceinline__ uint32_t swz128(int row, int c) {
  return static_cast<uint32_t>((c >> 3) * ROWS * 128 + row * 128 + (((c & 7) ^ (row & 7)) << 4));
}

template <typename T, int D, int ROWS, int THREADS>
__device__ __forceinline__ void load_tile128(uint32_t dst, const T* src, int stride, int valid_rows, int tid) {
  constexpr int CHUNKS = D / 8;
  static_assert(ROWS * CHUNKS % THREADS == 0, "tile chunks must divide among the threads");
#pragma unroll
  for (int it = 0; it < ROWS * CHUNKS / THREADS; ++it) {
    int i = tid + it * THREADS, row = i / CHUNKS, c = i % CHUNKS;
    bool ok = row < valid_rows;
    cp_async16(dst + swz128<ROWS>(row, c), src + static_cast<long long>(ok ? row : 0) * stride + c * 8, ok);
  }
}

// q rotated (rotate-half RoPE, fp32 math) on its way into the Q tile: every load of a thread's
// chunk pairs (16-byte q, cos and sin chunks of both halves) is issued before the first use,
// then the rotated chunks are stored swizzled; rows past `valid_rows` are zeros
template <typename T, int D, int ROWS, int THREADS>
__device__ __forceinline__ void load_q_rotated(uint32_t dst, const T* src, int stride, int valid_rows, const T* cos,
                                               const T* sin, int tid) {
  constexpr int PAIRS = D / 16, ITEMS = ROWS * PAIRS / THREADS;  // chunk c pairs with chunk c + D / 16
  static_assert(ROWS * PAIRS % THREADS == 0, "chunk pairs must divide among the threads");
  uint4 x1[ITEMS], x2[ITEMS], c1[ITEMS], c2[ITEMS], s1[ITEMS], s2[ITEMS];
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    int i = tid + it * THREADS, row = i / PAIRS, c = i % PAIRS;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    bool ok = row < valid_rows;
    const T* x = src + static_cast<long long>(row) * stride + c * 8;
    const long long t = static_cast<long long>(row) * D + c * 8;
    x1[it] = ok ? *reinterpret_cast<const uint4*>(x) : zero,
    x2[it] = ok ? *reinterpret_cast<const uint4*>(x + D / 2) : zero;
    c1[it] = ok ? *reinterpret_cast<const uint4*>(cos + t) : zero,
    c2[it] = ok ? *reinterpret_cast<const uint4*>(cos + t + D / 2) : zero;
    s1[it] = ok ? *reinterpret_cast<const uint4*>(sin + t) : zero,
    s2[it] = ok ? *reinterpret_cast<const uint4*>(sin + t + D / 2) : zero;
  }
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    int i = tid + it * THREADS, row = i / PAIRS, c = i % PAIRS;
    const uint32_t* a = &x1[it].x;
    const uint32_t* b = &x2[it].x;
    const uint32_t *ca = &c1[it].x, *cb = &c2[it].x, *sa = &s1[it].x, *sb = &s2[it].x;
    uint32_t r1[4], r2[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {  // two columns per 32-bit word
      float2 u = unpack<T>(a[w]), v = unpack<T>(b[w]), cu = unpack<T>(ca[w]), cv = unpack<T>(cb[w]),
             su = unpack<T>(sa[w]), sv = unpack<T>(sb[w]);
      r1[w] = pack<T>(u.x * cu.x - v.x * su.x, u.y * cu.y - v.y * su.y);
      r2[w] = pack<T>(v.x * cv.x + u.x * sv.x, v.y * cv.y + u.y * sv.y);
    }
    asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"r"(dst + swz128<ROWS>(row, c)), "r"(r1[0]), "r"(r1[1]),
                 "r"(r1[2]), "r"(r1[3]));
    asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"r"(dst + swz128<ROWS>(row, c + PAIRS)), "r"(r2[0]),
                 "r"(r2[1]), "r"(r2[2]), "r"(r2[3]));
  }
}

// The steps the two wgmma kernels (flash_forward_sm90, flash_forward_ws) share, on a warpgroup's accumulators: S (NT
// n8 tiles of 64 rows x BN keys) and O, the thread's rows row_a and row_a + 8 (e >> 1), columns 2 (lane % 4) + (e & 1).
// online_softmax: mask S_j where its keys end or (causal) pass the row, fold it into the running max and sum (alpha:
// O's factor, 0 while a row had no keys) and make S_j exp(S_j - max); wg_row0 is the warpgroup's first row.
template <int BN, int NT>
__device__ __forceinline__ void online_softmax(float (&s)[NT][4], float (&row_max)[2], float (&row_sum)[2],
                                               float (&alpha)[2], const Params& p, int key0, int wg_row0, int row_a,
                                               int lane) {
  if (key0 + BN > p.m || (p.causal && key0 + BN - 1 > wg_row0)) {
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int col = key0 + t * 8 + (lane & 3) * 2 + (e & 1), row = row_a + (e >> 1) * 8;
        if (col >= p.m || (p.causal && col > row)) s[t][e] = -INFINITY;
      }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = row_max[r];
#pragma unroll
    for (int t = 0; t < NT; ++t) mx = fmaxf(mx, fmaxf(s[t][2 * r], s[t][2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float base = mx == -INFINITY ? 0.f : mx * p.scale_log2;
    alpha[r] = exp2f(row_max[r] * p.scale_log2 - base);  // 0 while the row had no keys
    row_max[r] = mx;
    float sum = 0.f;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      s[t][2 * r] = exp2f(fmaf(s[t][2 * r], p.scale_log2, -base));
      s[t][2 * r + 1] = exp2f(fmaf(s[t][2 * r + 1], p.scale_log2, -base));
      sum += s[t][2 * r] + s[t][2 * r + 1];
    }
    row_sum[r] = row_sum[r] * alpha[r] + sum;
  }
}

// P (S after online_softmax) as the A operand of O += P V: BN / 16 k16 tiles of packed pairs
template <typename T, int BN, int NT>
__device__ __forceinline__ void pack_p(const float (&s)[NT][4], uint32_t (&pa)[BN / 16][4]) {
#pragma unroll
  for (int kb = 0; kb < BN / 16; ++kb) {
    pa[kb][0] = pack<T>(s[2 * kb][0], s[2 * kb][1]), pa[kb][1] = pack<T>(s[2 * kb][2], s[2 * kb][3]);
    pa[kb][2] = pack<T>(s[2 * kb + 1][0], s[2 * kb + 1][1]), pa[kb][3] = pack<T>(s[2 * kb + 1][2], s[2 * kb + 1][3]);
  }
}

// the thread's two rows' 1 / sum over the 4 threads that share them (0 for a row without keys)
__device__ __forceinline__ void inverse_row_sums(const float (&row_sum)[2], float (&inv)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = row_sum[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    inv[r] = sum > 0.f ? 1.f / sum : 0.f;
  }
}

}  // namespace
