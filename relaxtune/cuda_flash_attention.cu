// relaxtune flash attention (FlashAttention-2 style forward), compiled by nvcc into a fatbin that
// relaxtune/cuda_flash_attention.py embeds in the artifact's host object. sm_80+ (mma.sync, cp.async).
//
// One CTA: BM = 16 * WARPS query rows of one (batch, query head); each warp owns 16 rows. Key and
// value tiles of BN = 64 rows are staged in shared memory by cp.async, double-buffered (the next
// K tile loads while S = Q K^T is computed, the next V tile while O += P V is); S and O live in
// fp32 registers (mma.sync m16n8k16, fp16 or bf16 inputs), the softmax is online (running max and
// sum per row, exp2 with the scale folded in). Causal (top-left: key j <= query i): key tiles past
// the block's last row are never loaded, a warp skips tiles entirely above its rows, and only
// tiles crossing the diagonal (or the end of the keys) are masked. GQA: query head h reads
// key/value head h / group. Rows are 128 or 64 elements wide, 16-byte chunks XOR-swizzled by
// row so ldmatrix reads are conflict-free. Layouts: q, o (b, n, hq, D); k, v (b, m, hkv, D), compact.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace {

struct Params {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  long long q_batch, k_batch;  // elements between batches
  int q_row, k_row;            // elements between consecutive rows (heads * D)
  int n, m, group, causal;     // query rows, key rows, query heads per kv head, top-left causal mask
  float scale_log2;            // softmax scale * log2(e)
};

constexpr int BN = 64;

template <typename T>
__device__ __forceinline__ void mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma<__half>(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma<__nv_bfloat16>(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <typename T>
__device__ __forceinline__ uint32_t pack(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <>
__device__ __forceinline__ uint32_t pack<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ void ldsm_x4(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  int size = valid ? 16 : 0;  // 0: zero-fill (rows past the end)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(size));
}

__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }

__device__ __forceinline__ void cp_wait1() { asm volatile("cp.async.wait_group 1;\n" ::); }

// byte offset of 16-byte chunk `c` of row `row` in a tile of D-element rows
template <int D>
__device__ __forceinline__ uint32_t swz(int row, int c) {
  return static_cast<uint32_t>((row * (D / 8) + (c ^ (row & 7))) * 16);
}

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

template <typename T, int D, int WARPS>
__device__ __forceinline__ void flash_forward(const Params& p) {
  constexpr int BM = 16 * WARPS, THREADS = 32 * WARPS;
  constexpr int TILE_BYTES = BN * D * 2;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t s_q = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t s_k = s_q + BM * D * 2, s_v = s_k + 2 * TILE_BYTES;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int m0 = (gridDim.x - 1 - blockIdx.x) * BM;  // the longest (causal) blocks start first
  const int h = blockIdx.y, b = blockIdx.z;
  const T* q = static_cast<const T*>(p.q) + b * p.q_batch + static_cast<long long>(m0) * p.q_row + h * D;
  const T* k = static_cast<const T*>(p.k) + b * p.k_batch + (h / p.group) * D;
  const T* v = static_cast<const T*>(p.v) + b * p.k_batch + (h / p.group) * D;

  const int kv_end = p.causal ? min(p.m, m0 + BM) : p.m;
  const int tiles = (kv_end + BN - 1) / BN;
  const int warp_row0 = m0 + warp * 16;            // this warp's first query row
  const int row_a = warp_row0 + (lane >> 2);       // the thread's two rows: row_a and row_a + 8

  load_tile<T, D, BM, THREADS>(s_q, q, p.q_row, p.n - m0, tid);
  load_tile<T, D, BN, THREADS>(s_k, k, p.k_row, p.m, tid);
  cp_commit();
  load_tile<T, D, BN, THREADS>(s_v, v, p.k_row, p.m, tid);
  cp_commit();

  float o[D / 8][4];
#pragma unroll
  for (int t = 0; t < D / 8; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};

  for (int j = 0; j < tiles; ++j) {
    const int key0 = j * BN, stage = j & 1;
    const bool active = !p.causal || key0 <= warp_row0 + 15;  // a tile entirely above the warp's rows adds nothing
    cp_wait1();
    __syncthreads();  // K_j (and Q) landed; every warp is done with K_{j-1}
    if (j + 1 < tiles)
      load_tile<T, D, BN, THREADS>(s_k + (stage ^ 1) * TILE_BYTES, k + static_cast<long long>(key0 + BN) * p.k_row, p.k_row, p.m - key0 - BN, tid);
    cp_commit();

    float s[BN / 8][4];
    if (active) {
#pragma unroll
      for (int t = 0; t < BN / 8; ++t) s[t][0] = s[t][1] = s[t][2] = s[t][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[4];
        ldsm_x4(a, s_q + swz<D>(warp * 16 + (lane & 15), kk * 2 + (lane >> 4)));
#pragma unroll
        for (int nn = 0; nn < BN / 16; ++nn) {
          uint32_t bk[4];
          ldsm_x4(bk, s_k + stage * TILE_BYTES + swz<D>(nn * 16 + (lane >> 4) * 8 + (lane & 7), kk * 2 + ((lane >> 3) & 1)));
          mma<T>(s[2 * nn], a, bk[0], bk[1]);
          mma<T>(s[2 * nn + 1], a, bk[2], bk[3]);
        }
      }
      const bool masked = key0 + BN > p.m || (p.causal && key0 + BN - 1 > warp_row0);
      if (masked) {
#pragma unroll
        for (int t = 0; t < BN / 8; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            int col = key0 + t * 8 + (lane & 3) * 2 + (e & 1), row = row_a + (e >> 1) * 8;
            if (col >= p.m || (p.causal && col > row)) s[t][e] = -INFINITY;
          }
      }
      // online softmax: rows r = 0 (elements 0, 1) and r = 1 (elements 2, 3); a row is spread over a quad
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = row_max[r];
#pragma unroll
        for (int t = 0; t < BN / 8; ++t) mx = fmaxf(mx, fmaxf(s[t][2 * r], s[t][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float base = mx == -INFINITY ? 0.f : mx * p.scale_log2;
        const float alpha = exp2f(row_max[r] * p.scale_log2 - base);  // 0 while the row had no keys
        row_max[r] = mx;
        float sum = 0.f;
#pragma unroll
        for (int t = 0; t < BN / 8; ++t) {
          s[t][2 * r] = exp2f(fmaf(s[t][2 * r], p.scale_log2, -base));
          s[t][2 * r + 1] = exp2f(fmaf(s[t][2 * r + 1], p.scale_log2, -base));
          sum += s[t][2 * r] + s[t][2 * r + 1];
        }
        row_sum[r] = row_sum[r] * alpha + sum;
#pragma unroll
        for (int t = 0; t < D / 8; ++t) o[t][2 * r] *= alpha, o[t][2 * r + 1] *= alpha;
      }
    }

    cp_wait1();
    __syncthreads();  // V_j landed; every warp is done with V_{j-1}
    if (j + 1 < tiles)
      load_tile<T, D, BN, THREADS>(s_v + (stage ^ 1) * TILE_BYTES, v + static_cast<long long>(key0 + BN) * p.k_row, p.k_row, p.m - key0 - BN, tid);
    cp_commit();

    if (active) {
#pragma unroll
      for (int kb = 0; kb < BN / 16; ++kb) {
        uint32_t a[4] = {pack<T>(s[2 * kb][0], s[2 * kb][1]), pack<T>(s[2 * kb][2], s[2 * kb][3]),
                         pack<T>(s[2 * kb + 1][0], s[2 * kb + 1][1]), pack<T>(s[2 * kb + 1][2], s[2 * kb + 1][3])};
#pragma unroll
        for (int dn = 0; dn < D / 16; ++dn) {
          uint32_t bv[4];
          ldsm_x4_trans(bv, s_v + stage * TILE_BYTES + swz<D>(kb * 16 + ((lane >> 3) & 1) * 8 + (lane & 7), dn * 2 + (lane >> 4)));
          mma<T>(o[2 * dn], a, bv[0], bv[1]);
          mma<T>(o[2 * dn + 1], a, bv[2], bv[3]);
        }
      }
    }
  }

  // epilogue: divide by the row sums, stage the warp's 16 rows in its own rows of the Q tile, store 16-byte chunks
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = row_sum[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    inv[r] = sum > 0.f ? 1.f / sum : 0.f;
  }
#pragma unroll
  for (int t = 0; t < D / 8; ++t) {
    int row = warp * 16 + (lane >> 2), col = t * 8 + (lane & 3) * 2;
    uint32_t lo = pack<T>(o[t][0] * inv[0], o[t][1] * inv[0]), hi = pack<T>(o[t][2] * inv[1], o[t][3] * inv[1]);
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(s_q + swz<D>(row, col / 8) + (col % 8) * 2), "r"(lo));
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(s_q + swz<D>(row + 8, col / 8) + (col % 8) * 2), "r"(hi));
  }
  __syncwarp();
  T* out = static_cast<T*>(p.o) + b * p.q_batch + static_cast<long long>(m0) * p.q_row + h * D;
  constexpr int CHUNKS = D / 8;
#pragma unroll
  for (int i = lane; i < 16 * CHUNKS; i += 32) {
    int row = warp * 16 + i / CHUNKS, c = i % CHUNKS;
    if (m0 + row < p.n) {
      uint4 value;
      asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(value.x), "=r"(value.y), "=r"(value.z), "=r"(value.w) : "r"(s_q + swz<D>(row, c)));
      *reinterpret_cast<uint4*>(out + static_cast<long long>(row) * p.q_row + c * 8) = value;
    }
  }
}

}  // namespace

// one entry point per (dtype, head dim, warps): relaxtune_flash_<f16|bf16>_d<D>_w<WARPS>
#define RELAXTUNE_FLASH(NAME, T, D, WARPS) \
  extern "C" __global__ void __launch_bounds__(32 * WARPS) NAME(Params p) { flash_forward<T, D, WARPS>(p); }

RELAXTUNE_FLASH(relaxtune_flash_f16_d128_w4, __half, 128, 4)
RELAXTUNE_FLASH(relaxtune_flash_f16_d128_w8, __half, 128, 8)
RELAXTUNE_FLASH(relaxtune_flash_f16_d64_w4, __half, 64, 4)
RELAXTUNE_FLASH(relaxtune_flash_f16_d64_w8, __half, 64, 8)
RELAXTUNE_FLASH(relaxtune_flash_bf16_d128_w4, __nv_bfloat16, 128, 4)
RELAXTUNE_FLASH(relaxtune_flash_bf16_d128_w8, __nv_bfloat16, 128, 8)
RELAXTUNE_FLASH(relaxtune_flash_bf16_d64_w4, __nv_bfloat16, 64, 4)
RELAXTUNE_FLASH(relaxtune_flash_bf16_d64_w8, __nv_bfloat16, 64, 8)
