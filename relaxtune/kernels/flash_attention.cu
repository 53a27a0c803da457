// relaxtune flash attention (FlashAttention-2 style forward), compiled by nvcc into a fatbin that
// kernels/flash_attention.py embeds in the artifact's host object. sm_80+ (mma.sync, cp.async: mma_sm80.cu's
// wrappers, prepended).
//
// One CTA: BM = 64 or 128 query rows of one (batch, query head), 4 warps of 16 or 32 rows each. Key and
// value tiles of BN = 64 rows are staged in shared memory by cp.async, double-buffered (the next
// K tile loads while S = Q K^T is computed, the next V tile while O += P V is); S and O live in
// fp32 registers (mma.sync m16n8k16, fp16 or bf16 inputs), the softmax is online (running max and
// sum per row, exp2 with the scale folded in). Causal (top-left: key j <= query i): key tiles past
// the block's last row are never loaded, a warp skips tiles entirely above its rows, and only
// tiles crossing the diagonal (or the end of the keys) are masked. GQA: query head h reads
// key/value head h / group. Rows are 128 or 64 elements wide, 16-byte chunks XOR-swizzled by
// row so ldmatrix reads are conflict-free. Layouts: o (b, n, heads, D); q, k, v are head ranges of
// (b, rows, H, D) tensors (e.g. the merged q/k/v projection), and q may be rotated (RoPE) on load, k too
// (rope_k: each key tile in shared memory once it has landed; what a grid of one query block per head wants, where
// no tile is rotated twice).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace {

struct Params {
  const void *q, *k, *v;        // (b, rows, heads of the tensor, D): read from head q_head0 + h, k/v_head0 + h / group
  const void *cos, *sin;        // null, or (>= n, D) rotary tables: q is rotated (rotate-half) as it is loaded
  void* o;                      // (b, n, heads, D)
  long long q_batch, k_batch, v_batch, o_batch;  // elements between batches
  int q_row, k_row, v_row, o_row;                // elements between consecutive rows (heads of the tensor * D)
  int q_head0, k_head0, v_head0;
  int n, m, group, causal;      // query rows, key rows, query heads per kv head, top-left causal mask
  float scale_log2;             // softmax scale * log2(e)
  int rope_k;  // 1: k is rotated too, with the same tables (>= m rows), tile by tile (this kernel only)
  // ragged (this kernel only): sequence b = blockIdx.z has rows q_indptr[b] .. q_indptr[b + 1] of q and o (batch
  // strides 0) and kv_indptr[b] .. of k and v; null: every sequence has n and m rows
  const int *q_indptr, *kv_indptr;
  float* lse;  // null, or (rows of o, heads) float32: the rows' base-2 log-sum-exp of the scaled scores
};

constexpr int BN = 64;

// ROWS rows of D elements from `src` (row stride `stride` elements) into the tile at `dst`
template <typename T, int D, int ROWS, int THREADS>
__device__ __forceinline__ void load_tile(uint32_t dst, const T* src, int stride, int valid_rows, int tid) {
  constexpr int CHUNKS = D / 8;
#pragma unroll
  for (int i = tid; i < ROWS * CHUNKS; i += THREADS) {
    int row = i / CHUNKS, c = i % CHUNKS;
    bool ok = row < valid_rows;
    cp_async16(dst + swz<D>(row, c), src + static_cast<long long>(ok ? row : 0) * stride + c * 8, ok);
  }
}

// RoPE in shared memory on the tile at `tile` (ROWS rows, the first at sequence position `pos0`; rows from
// `valid_rows` on are left), and with the same table rows on the tile at `tile2` (its first `valid2` rows; none
// when 0): x * cos + concat(-x2, x1) * sin, in fp32, one rounding
template <typename T, int D, int ROWS, int THREADS>
__device__ __forceinline__ void rotate_tile(uint32_t tile, int pos0, int valid_rows, const Params& p, int tid,
                                            uint32_t tile2 = 0, int valid2 = 0) {
  const T* cos = static_cast<const T*>(p.cos);
  const T* sin = static_cast<const T*>(p.sin);
#pragma unroll 8  // the table loads of 8 steps in flight at once
  for (int i = tid; i < ROWS * D / 4; i += THREADS) {  // two neighbouring columns j, j + 1 of each half
    int row = i / (D / 4), j = (i % (D / 4)) * 2;
    if (row >= max(valid_rows, valid2)) continue;
    const long long t = static_cast<long long>(pos0 + row) * D + j;
    float2 c1 = unpack<T>(*reinterpret_cast<const uint32_t*>(cos + t)),
           c2 = unpack<T>(*reinterpret_cast<const uint32_t*>(cos + t + D / 2));
    float2 s1 = unpack<T>(*reinterpret_cast<const uint32_t*>(sin + t)),
           s2 = unpack<T>(*reinterpret_cast<const uint32_t*>(sin + t + D / 2));
#pragma unroll
    for (int which = 0; which < 2; ++which) {
      if (row >= (which ? valid2 : valid_rows)) continue;
      const uint32_t base = which ? tile2 : tile;
      uint32_t a1 = base + swz<D>(row, j / 8) + (j % 8) * 2, a2 = base + swz<D>(row, (j + D / 2) / 8) + (j % 8) * 2;
      uint32_t r1, r2;
      asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(r1) : "r"(a1));
      asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(r2) : "r"(a2));
      float2 x1 = unpack<T>(r1), x2 = unpack<T>(r2);
      r1 = pack<T>(x1.x * c1.x - x2.x * s1.x, x1.y * c1.y - x2.y * s1.y);
      r2 = pack<T>(x2.x * c2.x + x1.x * s2.x, x2.y * c2.y + x1.y * s2.y);
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a1), "r"(r1));
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a2), "r"(r2));
    }
  }
}

// STAGES 2: K and V tiles double-buffered (the next K loads during S, the next V during P V);
// STAGES 1: one buffer each (V_j loads during S_j, K_{j+1} during P V_j): less shared memory per block
template <typename T, int D, int WARPS, int MT, int STAGES>
__device__ __forceinline__ void flash_forward(const Params& p) {
  constexpr int WM = 16 * MT, BM = WM * WARPS, THREADS = 32 * WARPS;
  constexpr int TILE_BYTES = BN * D * 2;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t s_q = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t s_k = s_q + BM * D * 2, s_v = s_k + STAGES * TILE_BYTES;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int m0 = (gridDim.x - 1 - blockIdx.x) * BM;  // the longest (causal) blocks start first
  const int h = blockIdx.y, b = blockIdx.z;
  const bool ragged = p.q_indptr != nullptr;
  const int q_first = ragged ? p.q_indptr[b] : 0, kv_first = ragged ? p.kv_indptr[b] : 0;
  const int n = ragged ? p.q_indptr[b + 1] - q_first : p.n, m = ragged ? p.kv_indptr[b + 1] - kv_first : p.m;
  if (m0 >= n) return;  // past the sequence's rows (a ragged grid covers the longest)
  const T* q =
      static_cast<const T*>(p.q) + b * p.q_batch + static_cast<long long>(q_first + m0) * p.q_row + (p.q_head0 + h) * D;
  const T* k = static_cast<const T*>(p.k) + b * p.k_batch + static_cast<long long>(kv_first) * p.k_row +
               (p.k_head0 + h / p.group) * D;
  const T* v = static_cast<const T*>(p.v) + b * p.v_batch + static_cast<long long>(kv_first) * p.v_row +
               (p.v_head0 + h / p.group) * D;

  const int kv_end = p.causal ? min(m, m0 + BM) : m;
  const int tiles = (kv_end + BN - 1) / BN;
  const int warp_row0 = m0 + warp * WM;            // this warp's first query row
  const int row_a = warp_row0 + (lane >> 2);       // the thread's rows: row_a + 16 mt and row_a + 16 mt + 8

  load_tile<T, D, BM, THREADS>(s_q, q, p.q_row, n - m0, tid);
  load_tile<T, D, BN, THREADS>(s_k, k, p.k_row, m, tid);
  cp_commit();
  if (STAGES == 2) {
    load_tile<T, D, BN, THREADS>(s_v, v, p.v_row, m, tid);
    cp_commit();
  }
  // one query block with k rotated too: K_0's rows are at q's positions, so one pass rotates both with one table read
  const bool k0_with_q = BM == BN && p.rope_k && m0 == 0;
  if (p.cos != nullptr) {  // RoPE on q (and K_0) in shared memory
    if (STAGES == 2) cp_wait1(); else cp_wait0();
    __syncthreads();
    rotate_tile<T, D, BM, THREADS>(s_q, m0, n - m0, p, tid, s_k, k0_with_q ? min(m, BN) : 0);
  }

  float o[MT][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int t = 0; t < D / 8; ++t) o[mt][t][0] = o[mt][t][1] = o[mt][t][2] = o[mt][t][3] = 0.f;
  float row_max[MT][2], row_sum[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) row_max[mt][0] = row_max[mt][1] = -INFINITY, row_sum[mt][0] = row_sum[mt][1] = 0.f;

  for (int j = 0; j < tiles; ++j) {
    const int key0 = j * BN, stage = STAGES == 2 ? j & 1 : 0;
    const bool active = !p.causal || key0 <= warp_row0 + WM - 1;  // a tile entirely above the warp's rows adds nothing
    if (STAGES == 2) {
      cp_wait1();
      __syncthreads();  // K_j (and Q) landed; every warp is done with K_{j-1}
      if (j + 1 < tiles)
        load_tile<T, D, BN, THREADS>(s_k + (stage ^ 1) * TILE_BYTES, k + static_cast<long long>(key0 + BN) * p.k_row,
                                     p.k_row, m - key0 - BN, tid);
      cp_commit();
    } else {
      cp_wait0();
      __syncthreads();  // K_j (and Q) landed; every warp is done with V_{j-1}
      load_tile<T, D, BN, THREADS>(s_v, v + static_cast<long long>(key0) * p.v_row, p.v_row, m - key0, tid);
      cp_commit();
    }
    if (p.rope_k && !(k0_with_q && j == 0)) {  // K_j rotated where it landed, before any warp reads it
      rotate_tile<T, D, BN, THREADS>(s_k + stage * TILE_BYTES, key0, m - key0, p, tid);
      __syncthreads();
    }

    float s[MT][BN / 8][4];
    if (active) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int t = 0; t < BN / 8; ++t) s[mt][t][0] = s[mt][t][1] = s[mt][t][2] = s[mt][t][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          ldsm_x4(a[mt], s_q + swz<D>(warp * WM + mt * 16 + (lane & 15), kk * 2 + (lane >> 4)));
#pragma unroll
        for (int nn = 0; nn < BN / 16; ++nn) {
          uint32_t bk[4];  // each K fragment feeds MT row tiles
          ldsm_x4(bk, s_k + stage * TILE_BYTES +
                          swz<D>(nn * 16 + (lane >> 4) * 8 + (lane & 7), kk * 2 + ((lane >> 3) & 1)));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma<T>(s[mt][2 * nn], a[mt], bk[0], bk[1]);
            mma<T>(s[mt][2 * nn + 1], a[mt], bk[2], bk[3]);
          }
        }
      }
      const bool masked = key0 + BN > m || (p.causal && key0 + BN - 1 > warp_row0);
      if (masked) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int t = 0; t < BN / 8; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              int col = key0 + t * 8 + (lane & 3) * 2 + (e & 1), row = row_a + mt * 16 + (e >> 1) * 8;
              if (col >= m || (p.causal && col > row)) s[mt][t][e] = -INFINITY;
            }
      }
      // online softmax: rows r = 0 (elements 0, 1) and r = 1 (elements 2, 3); a row is spread over a quad
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = row_max[mt][r];
#pragma unroll
          for (int t = 0; t < BN / 8; ++t) mx = fmaxf(mx, fmaxf(s[mt][t][2 * r], s[mt][t][2 * r + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float base = mx == -INFINITY ? 0.f : mx * p.scale_log2;
          const float alpha = exp2f(row_max[mt][r] * p.scale_log2 - base);  // 0 while the row had no keys
          row_max[mt][r] = mx;
          float sum = 0.f;
#pragma unroll
          for (int t = 0; t < BN / 8; ++t) {
            s[mt][t][2 * r] = exp2f(fmaf(s[mt][t][2 * r], p.scale_log2, -base));
            s[mt][t][2 * r + 1] = exp2f(fmaf(s[mt][t][2 * r + 1], p.scale_log2, -base));
            sum += s[mt][t][2 * r] + s[mt][t][2 * r + 1];
          }
          row_sum[mt][r] = row_sum[mt][r] * alpha + sum;
#pragma unroll
          for (int t = 0; t < D / 8; ++t) o[mt][t][2 * r] *= alpha, o[mt][t][2 * r + 1] *= alpha;
        }
    }

    if (STAGES == 2) {
      cp_wait1();
      __syncthreads();  // V_j landed; every warp is done with V_{j-1}
      if (j + 1 < tiles)
        load_tile<T, D, BN, THREADS>(s_v + (stage ^ 1) * TILE_BYTES, v + static_cast<long long>(key0 + BN) * p.v_row,
                                     p.v_row, m - key0 - BN, tid);
      cp_commit();
    } else {
      cp_wait0();
      __syncthreads();  // V_j landed; every warp is done with K_j
      if (j + 1 < tiles) {
        load_tile<T, D, BN, THREADS>(s_k, k + static_cast<long long>(key0 + BN) * p.k_row, p.k_row, m - key0 - BN, tid);
        cp_commit();
      }
    }

    if (active) {
#pragma unroll
      for (int kb = 0; kb < BN / 16; ++kb) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          a[mt][0] = pack<T>(s[mt][2 * kb][0], s[mt][2 * kb][1]),
          a[mt][1] = pack<T>(s[mt][2 * kb][2], s[mt][2 * kb][3]);
          a[mt][2] = pack<T>(s[mt][2 * kb + 1][0], s[mt][2 * kb + 1][1]),
          a[mt][3] = pack<T>(s[mt][2 * kb + 1][2], s[mt][2 * kb + 1][3]);
        }
#pragma unroll
        for (int dn = 0; dn < D / 16; ++dn) {
          uint32_t bv[4];  // each V fragment feeds MT row tiles
          ldsm_x4_trans(bv, s_v + stage * TILE_BYTES +
                                swz<D>(kb * 16 + ((lane >> 3) & 1) * 8 + (lane & 7), dn * 2 + (lane >> 4)));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma<T>(o[mt][2 * dn], a[mt], bv[0], bv[1]);
            mma<T>(o[mt][2 * dn + 1], a[mt], bv[2], bv[3]);
          }
        }
      }
    }
  }

  // epilogue: divide by the row sums, stage the warp's 16 rows in its own rows of the Q tile, store 16-byte chunks
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = row_sum[mt][r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      inv[r] = sum > 0.f ? 1.f / sum : 0.f;
      const int row = m0 + warp * WM + mt * 16 + (lane >> 2) + 8 * r;  // row_max is the quad's already
      if (p.lse != nullptr && (lane & 3) == 0 && row < n)
        p.lse[static_cast<long long>(q_first + row) * gridDim.y + h] =
            sum > 0.f ? fmaf(row_max[mt][r], p.scale_log2, log2f(sum)) : -INFINITY;
    }
#pragma unroll
    for (int t = 0; t < D / 8; ++t) {
      int row = warp * WM + mt * 16 + (lane >> 2), col = t * 8 + (lane & 3) * 2;
      uint32_t lo = pack<T>(o[mt][t][0] * inv[0], o[mt][t][1] * inv[0]),
               hi = pack<T>(o[mt][t][2] * inv[1], o[mt][t][3] * inv[1]);
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(s_q + swz<D>(row, col / 8) + (col % 8) * 2), "r"(lo));
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(s_q + swz<D>(row + 8, col / 8) + (col % 8) * 2), "r"(hi));
    }
  }
  __syncwarp();
  T* out = static_cast<T*>(p.o) + b * p.o_batch + static_cast<long long>(q_first + m0) * p.o_row + h * D;
  constexpr int CHUNKS = D / 8;
#pragma unroll
  for (int i = lane; i < WM * CHUNKS; i += 32) {
    int row = warp * WM + i / CHUNKS, c = i % CHUNKS;
    if (m0 + row < n) {
      uint4 value;
      asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(value.x), "=r"(value.y), "=r"(value.z), "=r"(value.w) : "r"(s_q + swz<D>(row, c)));
      *reinterpret_cast<uint4*>(out + static_cast<long long>(row) * p.o_row + c * 8) = value;
    }
  }
}

}  // namespace

// one entry point per (dtype, head dim, query rows per block, stages): relaxtune_flash_<f16|bf16>_d<D>_m<BM>[_s1];
// 4 warps, each 16 * MT rows (MT = 2: every K and V fragment read from shared memory feeds two tiles)
#define RELAXTUNE_FLASH(NAME, T, D, MT, STAGES) \
  extern "C" __global__ void __launch_bounds__(128) NAME(Params p) { flash_forward<T, D, 4, MT, STAGES>(p); }
#define RELAXTUNE_FLASH_ALL(DT, T)                                      \
  RELAXTUNE_FLASH(relaxtune_flash_##DT##_d128_m64, T, 128, 1, 2)        \
  RELAXTUNE_FLASH(relaxtune_flash_##DT##_d128_m128, T, 128, 2, 2)       \
  RELAXTUNE_FLASH(relaxtune_flash_##DT##_d64_m64, T, 64, 1, 2)          \
  RELAXTUNE_FLASH(relaxtune_flash_##DT##_d64_m128, T, 64, 2, 2)         \
  RELAXTUNE_FLASH(relaxtune_flash_##DT##_d128_m64_s1, T, 128, 1, 1)     \
  RELAXTUNE_FLASH(relaxtune_flash_##DT##_d128_m128_s1, T, 128, 2, 1)    \
  RELAXTUNE_FLASH(relaxtune_flash_##DT##_d64_m64_s1, T, 64, 1, 1)       \
  RELAXTUNE_FLASH(relaxtune_flash_##DT##_d64_m128_s1, T, 64, 2, 1)

RELAXTUNE_FLASH_ALL(f16, __half)
RELAXTUNE_FLASH_ALL(bf16, __nv_bfloat16)
