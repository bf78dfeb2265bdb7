/*
 * matmul_cuda.h - the GEMM description core/matmul.c hands to its CPU BLAS
 * loop and to the CUDA launcher in kernels/matmul.cu (private to the matmul
 * family).
 *
 * One call runs `batch` products c[i] = a[i] @ b[i] (+ bias) in row-major
 * terms, where every matrix is BLAS-compatible: a (m, k) is either row-major
 * with leading dimension lda (a_t false: unit column stride) or the
 * transpose of a row-major (k, m) matrix (a_t true: unit row stride, lda its
 * column stride); the same for b (k, n). c (m, n) is always row-major and
 * packed (ldc = n). Products are batch strides apart (0: one matrix shared
 * by all products). m, n, k >= 1; the core handles empty products itself.
 */
#ifndef MOE_MATMUL_CUDA_H
#define MOE_MATMUL_CUDA_H

#include "internal.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct moe_gemm {
  moe_dtype dtype;             /* of a, b, c and bias */
  int64_t batch;               /* products, >= 1 */
  int64_t m, n, k;             /* per product: c (m, n) = a (m, k) @ b (k, n) */
  const void *a;               /* (batch, m, k) element 0 of product 0 */
  bool a_t;                    /* a stored transposed (unit row stride) */
  int64_t lda, a_bs;           /* leading dimension, batch stride (elements) */
  const void *b;               /* (batch, k, n) */
  bool b_t;
  int64_t ldb, b_bs;
  void *c;                     /* (batch, m, n) packed rows, ldc = n */
  int64_t c_bs;
  const void *bias;            /* (n) packed, added to every row; NULL for none */
  bool tf32;                   /* f32 may use TF32 tensor cores */
} moe_gemm;

/* Runs g on `device` on the context's stream (cuBLASLt; cublasGemmStridedBatchedEx
 * when Lt offers no algorithm). f32, f64, bf16, f16; 16-bit types accumulate
 * in f32. */
moe_status moe_cuda_gemm(moe_ctx *ctx, int device, const moe_gemm *g);

/* dst (cols) = the sums over rows of src (rows, cols), element (r, c) at
 * src[r * ld + c] (ld >= cols), summed in f32 (f64 for f64) in a fixed order
 * (deterministic): linear's bias gradient. f32, f64, bf16, f16; rows, cols
 * >= 1; dst packed, of src's dtype. */
moe_status moe_cuda_colsum(moe_ctx *ctx, int device, moe_dtype dtype, const void *src,
                           int64_t rows, int64_t cols, int64_t ld, void *dst);
#ifdef __cplusplus
}
#endif
#endif /* MOE_MATMUL_CUDA_H */
