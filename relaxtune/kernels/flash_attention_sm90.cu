// relaxtune flash attention for Hopper (sm_90a): wgmma tensor-core instructions. Appended to
// flash_attention.cu (one translation unit: Params and the load / pack helpers, with mma_sm80.cu's, are shared).
//
// One CTA: 128 query rows of one (batch, query head), two warpgroups of 64 rows each sharing the
// K and V tiles (BN key rows, staged by cp.async into 128-byte-swizzled shared memory: the
// canonical wgmma layout, rows split into 64-column blocks). S = Q K^T is one chain of
// wgmma.m64nBNk16 with both operands in shared memory; P goes from the S accumulators straight
// into the A registers of O += P V (wgmma with V read transposed from shared memory). The loop
// overlaps P_{j-1} V_{j-1} on the tensor cores with the softmax of S_j; K_{j+1} and V_j load
// (cp.async, two buffers each) while tile j is computed. Causal: tiles past the block's last row
// are never loaded and only diagonal / tail tiles are masked; both warpgroups run every tile (a
// warpgroup-dependent branch around wgmma makes ptxas serialize them). The grid runs heads fastest and query blocks
// from the last (the longest causal rows) to the first.
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

template <typename T, int D, int BN>
__device__ __forceinline__ void flash_forward_sm90(const Params& p) {
#ifdef RELAXTUNE_WGMMA
  constexpr int BM = 128, THREADS = 256, Q_BYTES = BM * D * 2, KV_BYTES = BN * D * 2, NT = BN / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t s_q = (static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + 1023u) & ~1023u;
  const uint32_t s_k = s_q + Q_BYTES, s_v = s_k + 2 * KV_BYTES;  // two K buffers, two V buffers

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
  const int h = blockIdx.x, m0 = (gridDim.y - 1 - blockIdx.y) * BM, b = blockIdx.z;
  const T* q = static_cast<const T*>(p.q) + b * p.q_batch + static_cast<long long>(m0) * p.q_row + (p.q_head0 + h) * D;
  const T* k = static_cast<const T*>(p.k) + b * p.k_batch + (p.k_head0 + h / p.group) * D;
  const T* v = static_cast<const T*>(p.v) + b * p.v_batch + (p.v_head0 + h / p.group) * D;

  const int kv_end = p.causal ? min(p.m, m0 + BM) : p.m;
  const int tiles = (kv_end + BN - 1) / BN;
  const int wg_row0 = m0 + wg * 64;                               // the warpgroup's first query row
  const int row_a = wg_row0 + (warp & 3) * 16 + (lane >> 2);      // the thread's rows: row_a, row_a + 8

  // group: Q (unless rotated), K_0; group: K_1, V_0 (K_j+1 and V_j then load while tile j is computed)
  if (p.cos == nullptr) load_tile128<T, D, BM, THREADS>(s_q, q, p.q_row, p.n - m0, tid);
  load_tile128<T, D, BN, THREADS>(s_k, k, p.k_row, p.m, tid);
  cp_commit();
  if (tiles > 1)
    load_tile128<T, D, BN, THREADS>(s_k + KV_BYTES, k + static_cast<long long>(BN) * p.k_row, p.k_row, p.m - BN, tid);
  load_tile128<T, D, BN, THREADS>(s_v, v, p.v_row, p.m, tid);
  cp_commit();
  if (p.cos != nullptr)  // while K_0 loads: q through registers, rotated (RoPE) on the way
    load_q_rotated<T, D, BM, THREADS>(s_q, q, p.q_row, p.n - m0,
                                      static_cast<const T*>(p.cos) + static_cast<long long>(m0) * D,
                                      static_cast<const T*>(p.sin) + static_cast<long long>(m0) * D, tid);
  cp_wait1();
  fence_async_smem();
  __syncthreads();

  float o[D / 8][4], s[NT][4];
#pragma unroll
  for (int t = 0; t < D / 8; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f}, alpha[2];
  uint32_t pa[BN / 16][4];  // P of the previous tile: the A operand of O += P V

  // S = Q K_j^T for K in buffer `kbuf`
  auto issue_s = [&](uint32_t kbuf) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint64_t da = gmma_desc(s_q + (kk >> 2) * BM * 128 + wg * 64 * 128 + (kk & 3) * 32, 16, 1024);
      uint64_t db = gmma_desc(kbuf + (kk >> 2) * BN * 128 + (kk & 3) * 32, 16, 1024);
      Wgmma<T, BN>::ss(&s[0][0], da, db, kk > 0);
    }
  };
  // O += P V for V in buffer `vbuf` (V read transposed: 64-column blocks BN * 128 bytes apart)
  auto issue_pv = [&](uint32_t vbuf) {
#pragma unroll
    for (int kb = 0; kb < BN / 16; ++kb)
      Wgmma<T, D>::rs(&o[0][0], pa[kb], gmma_desc(vbuf + kb * 16 * 128, BN * 128, 1024), 1);
  };
  // mask S_j, fold it into the running max / sum (alpha: the factor for O), S_j becomes exp(S_j - max)
  auto softmax = [&](int j) {
    const int key0 = j * BN;
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
  };
  auto to_pa = [&]() {
#pragma unroll
    for (int kb = 0; kb < BN / 16; ++kb) {
      pa[kb][0] = pack<T>(s[2 * kb][0], s[2 * kb][1]), pa[kb][1] = pack<T>(s[2 * kb][2], s[2 * kb][3]);
      pa[kb][2] = pack<T>(s[2 * kb + 1][0], s[2 * kb + 1][1]), pa[kb][3] = pack<T>(s[2 * kb + 1][2], s[2 * kb + 1][3]);
    }
  };

  // every warpgroup runs every tile of the block (a tile above its rows is all masked: P = 0, alpha = 1),
  // so no wgmma sits on a path that depends on the warpgroup (ptxas would serialize them all)
  wg_fence();  // S_0 (O is still 0: no rescale)
  issue_s(s_k);
  wg_commit();
  wg_wait<0>();
  reg_fence<NT * 4>(&s[0][0]);
  softmax(0);
  to_pa();
  __syncthreads();  // both warpgroups are done with K_0
  if (tiles > 2)
    load_tile128<T, D, BN, THREADS>(s_k, k + static_cast<long long>(2 * BN) * p.k_row, p.k_row, p.m - 2 * BN, tid);
  if (tiles > 1)
    load_tile128<T, D, BN, THREADS>(s_v + KV_BYTES, v + static_cast<long long>(BN) * p.v_row, p.v_row, p.m - BN, tid);
  cp_commit();

  for (int j = 1; j < tiles; ++j) {
    cp_wait1();  // K_j and V_{j-1} landed
    fence_async_smem();
    __syncthreads();
    wg_fence();
    issue_s(s_k + (j & 1) * KV_BYTES);
    wg_commit();
    issue_pv(s_v + ((j - 1) & 1) * KV_BYTES);  // on the tensor cores during the softmax of S_j
    wg_commit();
    wg_wait<1>();
    reg_fence<NT * 4>(&s[0][0]);
    softmax(j);
    wg_wait<0>();
    reg_fence<D / 2>(&o[0][0]);
#pragma unroll
    for (int t = 0; t < D / 8; ++t) o[t][0] *= alpha[0], o[t][1] *= alpha[0], o[t][2] *= alpha[1], o[t][3] *= alpha[1];
    to_pa();
    __syncthreads();  // both warpgroups are done with K_j and V_{j-1}: load K_{j+2} and V_{j+1} there
    if (j + 2 < tiles)
      load_tile128<T, D, BN, THREADS>(s_k + (j & 1) * KV_BYTES, k + static_cast<long long>((j + 2) * BN) * p.k_row,
                                      p.k_row, p.m - (j + 2) * BN, tid);
    if (j + 1 < tiles)
      load_tile128<T, D, BN, THREADS>(s_v + ((j + 1) & 1) * KV_BYTES,
                                      v + static_cast<long long>((j + 1) * BN) * p.v_row, p.v_row, p.m - (j + 1) * BN,
                                      tid);
    cp_commit();
  }
  cp_wait0();  // V of the last tile
  fence_async_smem();
  __syncthreads();
  wg_fence();  // P V of the last tile
  issue_pv(s_v + ((tiles - 1) & 1) * KV_BYTES);
  wg_commit();
  wg_wait<0>();
  reg_fence<D / 2>(&o[0][0]);

  // epilogue: divide by the row sums, stage the rows in the Q tile (no wgmma reads it any more), store 16-byte chunks
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = row_sum[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    inv[r] = sum > 0.f ? 1.f / sum : 0.f;
  }
  const int row_t = wg * 64 + (warp & 3) * 16 + (lane >> 2);  // the thread's first row in the tile
#pragma unroll
  for (int t = 0; t < D / 8; ++t) {
    uint32_t lo = pack<T>(o[t][0] * inv[0], o[t][1] * inv[0]), hi = pack<T>(o[t][2] * inv[1], o[t][3] * inv[1]);
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(s_q + swz128<BM>(row_t, t) + (lane & 3) * 4), "r"(lo));
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(s_q + swz128<BM>(row_t + 8, t) + (lane & 3) * 4), "r"(hi));
  }
  __syncthreads();
  T* out = static_cast<T*>(p.o) + b * p.o_batch + static_cast<long long>(m0) * p.o_row + h * D;
  constexpr int CHUNKS = D / 8;
#pragma unroll
  for (int it = 0; it < BM * CHUNKS / THREADS; ++it) {
    int i = tid + it * THREADS, row = i / CHUNKS, c = i % CHUNKS;
    if (m0 + row < p.n) {
      uint4 value;
      asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(value.x), "=r"(value.y), "=r"(value.z), "=r"(value.w)
                   : "r"(s_q + swz128<BM>(row, c)));
      *reinterpret_cast<uint4*>(out + static_cast<long long>(row) * p.o_row + c * 8) = value;
    }
  }
#else
  __trap();  // built without sm_90a features: the host never launches it there
#endif
}

}  // namespace

// relaxtune_flash_sm90_<f16|bf16>_d<D>_n<BN>: 256 threads (two warpgroups), 128 query rows per block
#define RELAXTUNE_FLASH_SM90(NAME, T, D, BN) \
  extern "C" __global__ void __launch_bounds__(256, 1) NAME(Params p) { flash_forward_sm90<T, D, BN>(p); }
#define RELAXTUNE_FLASH_SM90_ALL(DT, T)                               \
  RELAXTUNE_FLASH_SM90(relaxtune_flash_sm90_##DT##_d128_n64, T, 128, 64) \
  RELAXTUNE_FLASH_SM90(relaxtune_flash_sm90_##DT##_d128_n128, T, 128, 128) \
  RELAXTUNE_FLASH_SM90(relaxtune_flash_sm90_##DT##_d64_n64, T, 64, 64)   \
  RELAXTUNE_FLASH_SM90(relaxtune_flash_sm90_##DT##_d64_n128, T, 64, 128)

RELAXTUNE_FLASH_SM90_ALL(f16, __half)
RELAXTUNE_FLASH_SM90_ALL(bf16, __nv_bfloat16)
