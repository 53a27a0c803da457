// relaxtune flash attention for Hopper (sm_90a): wgmma tensor-core instructions. Appended to flash_attention.cu and
// flash_sm90_common.cu (one translation unit: Params, the wgmma wrappers, tile loaders and softmax steps are shared).
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

namespace {

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
  auto softmax = [&](int j) { online_softmax<BN, NT>(s, row_max, row_sum, alpha, p, j * BN, wg_row0, row_a, lane); };
  auto to_pa = [&]() { pack_p<T, BN, NT>(s, pa); };

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
  inverse_row_sums(row_sum, inv);
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
