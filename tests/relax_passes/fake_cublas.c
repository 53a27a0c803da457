/* A host-memory stand-in for the four cuBLAS entry points relaxtune's addon dlopens: same
   column-major semantics and leading-dimension checks, fp16/bf16 storage, fp32 accumulation. */
#include <stdint.h>
#include <string.h>
static float load(const void* p, int type, long long i) {
  if (type == 2) return (float)((const _Float16*)p)[i];
  uint32_t bits = (uint32_t)((const uint16_t*)p)[i] << 16;
  float f; memcpy(&f, &bits, 4); return f;
}
static void store(void* p, int type, long long i, float v) {
  if (type == 2) { ((_Float16*)p)[i] = (_Float16)v; return; }
  uint32_t bits; memcpy(&bits, &v, 4); bits += 0x7fff + ((bits >> 16) & 1);
  ((uint16_t*)p)[i] = (uint16_t)(bits >> 16);
}
int cublasCreate_v2(void** h) { *h = (void*)1; return 0; }
int cublasSetStream_v2(void* h, void* s) { (void)h; (void)s; return 0; }
int cublasGemmStridedBatchedEx(void* h, int ta, int tb, int m, int n, int k, const void* alpha, const void* A, int at,
                               int lda, long long sa, const void* B, int bt, int ldb, long long sb, const void* beta,
                               void* C, int ct, int ldc, long long sc, int batch, int compute, int algo) {
  (void)h; (void)compute; (void)algo;
  if (m < 0 || n < 0 || k < 0 || batch < 0) return 7;
  if (lda < (ta == 0 ? (m > 1 ? m : 1) : (k > 1 ? k : 1))) return 7;
  if (ldb < (tb == 0 ? (k > 1 ? k : 1) : (n > 1 ? n : 1))) return 7;
  if (ldc < (m > 1 ? m : 1)) return 7;
  if (at != bt || at != ct) return 7;
  float al = *(const float*)alpha, be = *(const float*)beta;
  for (int p = 0; p < batch; ++p)
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) {
        float acc = 0.0f;
        for (int l = 0; l < k; ++l) {
          float a = load(A, at, p * sa + (ta == 0 ? i + (long long)l * lda : l + (long long)i * lda));
          float b = load(B, bt, p * sb + (tb == 0 ? l + (long long)j * ldb : j + (long long)l * ldb));
          acc += a * b;
        }
        long long ci = p * sc + i + (long long)j * ldc;
        store(C, ct, ci, al * acc + (be != 0.0f ? be * load(C, ct, ci) : 0.0f));
      }
  return 0;
}
int cublasGemmEx(void* h, int ta, int tb, int m, int n, int k, const void* alpha, const void* A, int at, int lda,
                 const void* B, int bt, int ldb, const void* beta, void* C, int ct, int ldc, int compute, int algo) {
  return cublasGemmStridedBatchedEx(h, ta, tb, m, n, k, alpha, A, at, lda, 0, B, bt, ldb, 0, beta, C, ct, ldc, 0, 1,
                                    compute, algo);
}
