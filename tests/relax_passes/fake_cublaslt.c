/* A host-memory stand-in for the cuBLASLt entry points (and the two libcuda allocator calls) that
   relaxtune's cublas addon dlopens for relaxtune_cublas_gemm_add: column-major
   D = alpha * op(A) B + beta * C with op(A) (m x k), B (k x n), C and D (m x n) described by matrix
   layouts (rows, cols, ld), op(A) = A^T when the descriptor's TRANSA attribute is CUBLAS_OP_T, fp16/bf16 storage, fp32 accumulation; the heuristic asks for 4 KiB
   of workspace, which the matmul checks it got. Built twice: as libcublasLt.so.13 and libcuda.so.1. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
typedef struct { int type; uint64_t rows, cols; int64_t ld; } Layout;
typedef struct { uint64_t data[8]; } Algo;
typedef struct { int transa; } Desc;
typedef struct { Algo algo; size_t workspace; int state; float waves; int reserved[4]; } Heuristic;
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
int cublasLtCreate(void** h) { *h = (void*)1; return 0; }
int cublasLtMatmulDescCreate(void** d, int compute, int scale) { *d = calloc(1, sizeof(Desc)); return compute == 68 && scale == 0 ? 0 : 7; }
int cublasLtMatmulDescSetAttribute(void* d, int attr, const void* buf, size_t size) {
  if (attr != 3 || size != sizeof(int) || (*(const int*)buf != 0 && *(const int*)buf != 1)) return 7;  /* TRANSA: N or T */
  ((Desc*)d)->transa = *(const int*)buf; return 0;
}
int cublasLtMatrixLayoutCreate(void** l, int type, uint64_t rows, uint64_t cols, int64_t ld) {
  if (ld < (int64_t)(rows > 1 ? rows : 1)) return 7;
  Layout* p = malloc(sizeof(Layout)); p->type = type, p->rows = rows, p->cols = cols, p->ld = ld; *l = p; return 0;
}
int cublasLtMatmulPreferenceCreate(void** p) { *p = (void*)1; return 0; }
int cublasLtMatmulPreferenceSetAttribute(void* p, int attr, const void* buf, size_t size) { (void)p; (void)buf; return attr == 1 && size == 8 ? 0 : 7; }
int cublasLtMatmulPreferenceDestroy(void* p) { (void)p; return 0; }
static int shapes_ok(const Desc* desc, const Layout* a, const Layout* b, const Layout* c, const Layout* d) {
  uint64_t a_rows = desc->transa ? a->cols : a->rows, a_cols = desc->transa ? a->rows : a->cols;
  return a_cols == b->rows && c->rows == a_rows && c->cols == b->cols && d->rows == c->rows && d->cols == c->cols &&
         a->type == b->type && c->type == a->type && d->type == a->type;
}
int cublasLtMatmulAlgoGetHeuristic(void* h, void* desc, void* a, void* b, void* c, void* d, void* pref, int want, Heuristic* out, int* found) {
  (void)h; (void)pref;
  if (want < 1 || !shapes_ok(desc, a, b, c, d)) return 7;
  memset(out, 0, sizeof(Heuristic)); out->workspace = 4096; *found = 1; return 0;
}
int cublasLtMatmul(void* h, void* desc, const void* alpha, const void* A, void* al, const void* B, void* bl, const void* beta,
                   const void* C, void* cl, void* D, void* dl, const Algo* algo, void* ws, size_t ws_size, void* stream) {
  (void)h; (void)algo; (void)stream;
  const Layout *a = al, *b = bl, *c = cl, *d = dl;
  const int ta = ((const Desc*)desc)->transa;
  if (!shapes_ok(desc, a, b, c, d) || (ws_size > 0 && ws == NULL)) return 7;
  float al_ = *(const float*)alpha, be = *(const float*)beta;
  for (uint64_t i = 0; i < c->rows; ++i)
    for (uint64_t j = 0; j < b->cols; ++j) {
      float acc = 0.0f;
      for (uint64_t l = 0; l < b->rows; ++l) acc += load(A, a->type, ta ? l + i * a->ld : i + l * a->ld) * load(B, b->type, l + j * b->ld);
      store(D, d->type, i + j * d->ld, al_ * acc + be * load(C, c->type, i + j * c->ld));
    }
  return 0;
}
int cuMemAllocAsync(uint64_t* p, size_t size, void* stream) { (void)stream; *p = (uint64_t)(uintptr_t)malloc(size); return *p ? 0 : 2; }
int cuMemFreeAsync(uint64_t p, void* stream) { (void)stream; free((void*)(uintptr_t)p); return 0; }
