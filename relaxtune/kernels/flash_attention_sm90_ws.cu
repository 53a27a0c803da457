// relaxtune flash attention for Hopper, warp-specialized: appended after flash_attention_sm90.cu (one translation
// unit; flash_sm90_common.cu's wgmma wrappers, descriptors, tile loaders and softmax steps are shared).
//
// One CTA: 128 query rows of one (batch, query head) in two consumer warpgroups of 64 rows and one
// producer warpgroup (setmaxnreg moves its registers to the consumers). The producer streams K_j
// and V_j (cp.async) through NS = 3 stages, each guarded by a "full" mbarrier (the producer's copies landed) and an
// "empty" one (both warpgroups are done with the stage); so the warpgroups never wait for each other: each loads and
// rotates its own 64 query rows, runs the same loop as flash_attention_sm90.cu (S_j = Q K_j^T on the tensor cores,
// the softmax of S_j overlapping P_{j-1} V_{j-1}) and stores its own rows. With PINGPONG the two warpgroups take turns
// issuing their wgmma (named barriers, as FlashAttention-3 does), so one's softmax runs while the other's matrix
// products do.

namespace {

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}

__device__ __forceinline__ void named_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

__device__ __forceinline__ void named_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

template <typename T, int D, int BN, bool PINGPONG>
__device__ __forceinline__ void flash_forward_sm90_ws(const Params& p) {
#ifdef RELAXTUNE_WGMMA
  constexpr int NS = 3, QW_BYTES = 64 * D * 2, KV_BYTES = BN * D * 2, NT = BN / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t s_q = (static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + 1023u) & ~1023u;
  const uint32_t s_k = s_q + 2 * QW_BYTES, s_v = s_k + NS * KV_BYTES, s_bar = s_v + NS * KV_BYTES;
  auto full = [&](int s) { return s_bar + s * 8; };
  auto empty = [&](int s) { return s_bar + (NS + s) * 8; };

  const int tid = threadIdx.x, lane = tid & 31;
  // warp-uniform to the compiler: the role branch is not divergent
  const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
  const int h = blockIdx.x, m0 = (gridDim.y - 1 - blockIdx.y) * 128, b = blockIdx.z;
  const T* q = static_cast<const T*>(p.q) + b * p.q_batch + static_cast<long long>(m0) * p.q_row + (p.q_head0 + h) * D;
  const T* k = static_cast<const T*>(p.k) + b * p.k_batch + (p.k_head0 + h / p.group) * D;
  const T* v = static_cast<const T*>(p.v) + b * p.v_batch + (p.v_head0 + h / p.group) * D;
  const int kv_end = p.causal ? min(p.m, m0 + 128) : p.m;
  const int tiles = (kv_end + BN - 1) / BN;

  if (tid == 0) {
    for (int s = 0; s < NS; ++s) mbar_init(full(s), 128), mbar_init(empty(s), 256);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (warp >= 8) {  // the producer warpgroup: tile j into stage j % NS once both consumers released tile j - NS
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n" ::: "memory");
    for (int j = 0; j < tiles; ++j) {
      const int s = j % NS;
      if (j >= NS) mbar_wait(empty(s), (j / NS - 1) & 1);
      load_tile128<T, D, BN, 128>(s_k + s * KV_BYTES, k + static_cast<long long>(j * BN) * p.k_row, p.k_row,
                                  p.m - j * BN, tid & 127);
      load_tile128<T, D, BN, 128>(s_v + s * KV_BYTES, v + static_cast<long long>(j * BN) * p.v_row, p.v_row,
                                  p.m - j * BN, tid & 127);
      cp_commit();
      if (j >= 1) {  // tile j - 1 landed: visible to wgmma, then announced
        cp_wait1();
        fence_async_smem();
        mbar_arrive(full((j - 1) % NS));
      }
    }
    cp_wait0();
    fence_async_smem();
    mbar_arrive(full((tiles - 1) % NS));
  } else {  // the two consumer warpgroups
  asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n" ::: "memory");
  const int wg = warp >> 2, wtid = tid & 127;
  const uint32_t s_qw = s_q + wg * QW_BYTES;                 // this warpgroup's 64 query rows
  const int wg_row0 = m0 + wg * 64;
  const int row_a = wg_row0 + (warp & 3) * 16 + (lane >> 2);  // the thread's rows: row_a, row_a + 8
  const T* qw = q + static_cast<long long>(wg * 64) * p.q_row;
  if (p.cos == nullptr) {
    load_tile128<T, D, 64, 128>(s_qw, qw, p.q_row, p.n - wg_row0, wtid);
    cp_commit();
    cp_wait0();
  } else {
    load_q_rotated<T, D, 64, 128>(s_qw, qw, p.q_row, p.n - wg_row0,
                                  static_cast<const T*>(p.cos) + static_cast<long long>(wg_row0) * D,
                                  static_cast<const T*>(p.sin) + static_cast<long long>(wg_row0) * D, wtid);
  }
  fence_async_smem();
  named_sync(1 + wg, 128);
  if (PINGPONG && wg == 1) named_arrive(3, 256);  // warpgroup 0 issues first

  float o[D / 8][4], s[NT][4];
#pragma unroll
  for (int t = 0; t < D / 8; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f}, alpha[2];
  uint32_t pa[BN / 16][4];

  auto issue_s = [&](uint32_t kbuf) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint64_t da = gmma_desc(s_qw + (kk >> 2) * 64 * 128 + (kk & 3) * 32, 16, 1024);
      uint64_t db = gmma_desc(kbuf + (kk >> 2) * BN * 128 + (kk & 3) * 32, 16, 1024);
      Wgmma<T, BN>::ss(&s[0][0], da, db, kk > 0);
    }
  };
  auto issue_pv = [&](uint32_t vbuf) {
#pragma unroll
    for (int kb = 0; kb < BN / 16; ++kb)
      Wgmma<T, D>::rs(&o[0][0], pa[kb], gmma_desc(vbuf + kb * 16 * 128, BN * 128, 1024), 1);
  };
  auto softmax = [&](int j) { online_softmax<BN, NT>(s, row_max, row_sum, alpha, p, j * BN, wg_row0, row_a, lane); };
  auto to_pa = [&]() { pack_p<T, BN, NT>(s, pa); };
  // turns of issuing wgmma: tiles + 1 per warpgroup (S_0, then S_j with P_{j-1} V_{j-1}, then the last P V)
  auto turn_begin = [&]() {
    if (PINGPONG) named_sync(3 + wg, 256);
  };
  auto turn_end = [&](bool last) {
    if (PINGPONG && !(last && wg == 1)) named_arrive(4 - wg, 256);
  };

  mbar_wait(full(0), 0);
  turn_begin();
  wg_fence();
  issue_s(s_k);
  wg_commit();
  turn_end(false);
  wg_wait<0>();
  reg_fence<NT * 4>(&s[0][0]);
  softmax(0);
  to_pa();
  for (int j = 1; j < tiles; ++j) {
    const int st = j % NS, prev = (j - 1) % NS;
    mbar_wait(full(st), (j / NS) & 1);
    turn_begin();
    wg_fence();
    issue_s(s_k + st * KV_BYTES);
    wg_commit();
    issue_pv(s_v + prev * KV_BYTES);
    wg_commit();
    turn_end(false);
    wg_wait<1>();
    reg_fence<NT * 4>(&s[0][0]);
    softmax(j);
    wg_wait<0>();
    reg_fence<D / 2>(&o[0][0]);
#pragma unroll
    for (int t = 0; t < D / 8; ++t) o[t][0] *= alpha[0], o[t][1] *= alpha[0], o[t][2] *= alpha[1], o[t][3] *= alpha[1];
    to_pa();
    mbar_arrive(empty(prev));  // done with K_{j-1} and V_{j-1}
  }
  turn_begin();
  wg_fence();
  issue_pv(s_v + ((tiles - 1) % NS) * KV_BYTES);
  wg_commit();
  turn_end(true);
  wg_wait<0>();
  reg_fence<D / 2>(&o[0][0]);

  // epilogue: the warpgroup's rows, staged in its own Q rows (its last S read them long ago), 16-byte stores
  float inv[2];
  inverse_row_sums(row_sum, inv);
  const int row_t = (warp & 3) * 16 + (lane >> 2);
#pragma unroll
  for (int t = 0; t < D / 8; ++t) {
    uint32_t lo = pack<T>(o[t][0] * inv[0], o[t][1] * inv[0]), hi = pack<T>(o[t][2] * inv[1], o[t][3] * inv[1]);
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(s_qw + swz128<64>(row_t, t) + (lane & 3) * 4), "r"(lo));
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(s_qw + swz128<64>(row_t + 8, t) + (lane & 3) * 4), "r"(hi));
  }
  named_sync(1 + wg, 128);
  T* out = static_cast<T*>(p.o) + b * p.o_batch + static_cast<long long>(wg_row0) * p.o_row + h * D;
  constexpr int CHUNKS = D / 8;
#pragma unroll
  for (int it = 0; it < 64 * CHUNKS / 128; ++it) {
    int i = wtid + it * 128, row = i / CHUNKS, c = i % CHUNKS;
    if (wg_row0 + row < p.n) {
      uint4 value;
      asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(value.x), "=r"(value.y), "=r"(value.z), "=r"(value.w)
                   : "r"(s_qw + swz128<64>(row, c)));
      *reinterpret_cast<uint4*>(out + static_cast<long long>(row) * p.o_row + c * 8) = value;
    }
  }
  }
#else
  __trap();
#endif
}

}  // namespace

// relaxtune_flash_ws_<f16|bf16>_d<D>_n<BN>[_pp]: 384 threads (two consumer warpgroups with 224 registers each, one
// producer warpgroup with 56: setmaxnreg)
#define RELAXTUNE_FLASH_WS(NAME, T, D, BN, PP) \
  extern "C" __global__ void __launch_bounds__(384, 1) NAME(Params p) { flash_forward_sm90_ws<T, D, BN, PP>(p); }
#define RELAXTUNE_FLASH_WS_ALL(DT, T)                                    \
  RELAXTUNE_FLASH_WS(relaxtune_flash_ws_##DT##_d128_n64, T, 128, 64, false)  \
  RELAXTUNE_FLASH_WS(relaxtune_flash_ws_##DT##_d128_n64_pp, T, 128, 64, true) \
  RELAXTUNE_FLASH_WS(relaxtune_flash_ws_##DT##_d64_n64, T, 64, 64, false)    \
  RELAXTUNE_FLASH_WS(relaxtune_flash_ws_##DT##_d64_n64_pp, T, 64, 64, true)

RELAXTUNE_FLASH_WS_ALL(f16, __half)
RELAXTUNE_FLASH_WS_ALL(bf16, __nv_bfloat16)
