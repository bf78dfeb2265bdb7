/*
 * matmul.cu - the CUDA GEMM of the matmul family: moe_cuda_gemm (declared in
 * core/matmul_cuda.h), on cuBLASLt with cublasGemmStridedBatchedEx as the
 * fallback when Lt's heuristic offers no algorithm.
 *
 * Row-major to column-major: cuBLAS sees our packed row-major c (m, n) as
 * the column-major c^T (n, m), so it computes c^T = op(b) op(a) with b as
 * its first operand. A row-major operand (unit column stride) is, read
 * column-major, already the transpose it needs (op N); a transposed one
 * (unit row stride) needs op T. The bias (n) is one value per row of c^T,
 * which is what CUBLASLT_EPILOGUE_BIAS adds (bias batch stride 0: shared).
 *
 * Precision: bf16/f16 in and out with f32 accumulation and f32 scale
 * (CUBLAS_COMPUTE_32F); f32 in full f32 precision (CUBLAS_COMPUTE_32F)
 * unless the GEMM asks for TF32 (CUBLAS_COMPUTE_32F_FAST_TF32); f64 in f64.
 *
 * State: one cuBLASLt handle for the process, created on first use and
 * never destroyed (a cuBLASLt handle belongs to no device or context and
 * holds only host memory). The workspace (32 MiB, what PyTorch gives cuBLAS
 * on Hopper) comes from the context's caching allocator for each call and is
 * released right after the launch: every later user of that block is queued
 * after the GEMM on the same stream. Nothing outlives the context on the GPU.
 */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <limits.h>

#include "common.cuh"
#include "matmul_cuda.h"

#define MOE_GEMM_WORKSPACE ((size_t)32 << 20)

static cublasLtHandle_t moe_lt_handle = NULL;

#define MOE_BLAS_CHECK(ctx, call)                                                            \
  do {                                                                                       \
    cublasStatus_t moe_b_ = (call);                                                          \
    if (moe_b_ != CUBLAS_STATUS_SUCCESS)                                                     \
      return moe_error((ctx), MOE_ERR_CUDA, "%s failed at %s:%d: %s", #call,                 \
                       moe_kfile(__FILE__), __LINE__, cublasGetStatusString(moe_b_));        \
  } while (0)

/* Lt descriptors, destroyed whatever path leaves the launcher. */
struct MoeLtDescs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~MoeLtDescs() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

/* A block of the caching allocator, released on scope exit. */
struct MoeScratch {
  moe_ctx *ctx;
  int device;
  void *ptr = nullptr;
  size_t block = 0;
  MoeScratch(moe_ctx *c, int d) : ctx(c), device(d) {}
  ~MoeScratch() {
    if (ptr) moe_cuda_release(ctx, device, ptr, block);
  }
};

struct MoeGemmTypes {
  cudaDataType_t data, scale;
  cublasComputeType_t compute;
};

static bool moe_gemm_types(const moe_gemm *g, MoeGemmTypes *t) {
  switch (g->dtype) {
    case MOE_F32:
      *t = {CUDA_R_32F, CUDA_R_32F, g->tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F};
      return true;
    case MOE_F64: *t = {CUDA_R_64F, CUDA_R_64F, CUBLAS_COMPUTE_64F}; return true;
    case MOE_BF16: *t = {CUDA_R_16BF, CUDA_R_32F, CUBLAS_COMPUTE_32F}; return true;
    case MOE_F16: *t = {CUDA_R_16F, CUDA_R_32F, CUBLAS_COMPUTE_32F}; return true;
    default: return false;
  }
}

/* Largest power of two (<= 256) dividing the address and the byte strides
 * every product's pointer is built from. */
static uint32_t moe_gemm_align(const void *p, int64_t ld, int64_t bs, int64_t batch, size_t es) {
  uint64_t v = (uint64_t)(uintptr_t)p | (uint64_t)ld * es;
  if (batch > 1) v |= (uint64_t)bs * es;
  uint32_t a = 256;
  while (a > 1 && v % a) a >>= 1;
  return a;
}

/* c[i] = bias for every row of every product (the fallback's epilogue). */
template <typename T>
__global__ void __launch_bounds__(MOE_THREADS)
    moe_bias_rows_kernel(T *c, const T *bias, int64_t total, int64_t n) {
  int64_t nthreads = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += nthreads)
    c[i] = bias[i % n];
}

/* Lt: returns MOE_OK with *done false when no algorithm fits (fallback). */
static moe_status moe_gemm_lt(moe_ctx *ctx, int device, cudaStream_t stream, const moe_gemm *g,
                              const MoeGemmTypes &ty, bool *done) {
  *done = false;
  if (!moe_lt_handle) MOE_BLAS_CHECK(ctx, cublasLtCreate(&moe_lt_handle));
  size_t es = moe_dtype_size(g->dtype);
  MoeLtDescs d;
  cublasOperation_t opa = g->b_t ? CUBLAS_OP_T : CUBLAS_OP_N; /* Lt's A is our b */
  cublasOperation_t opb = g->a_t ? CUBLAS_OP_T : CUBLAS_OP_N; /* Lt's B is our a */
  MOE_BLAS_CHECK(ctx, cublasLtMatmulDescCreate(&d.op, ty.compute, ty.scale));
  MOE_BLAS_CHECK(ctx, cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &opa,
                                                     sizeof(opa)));
  MOE_BLAS_CHECK(ctx, cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &opb,
                                                     sizeof(opb)));
  if (g->bias) {
    cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    MOE_BLAS_CHECK(ctx, cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi,
                                                       sizeof(epi)));
    MOE_BLAS_CHECK(ctx, cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                       &g->bias, sizeof(g->bias)));
    cudaDataType_t bt = ty.data;
    MOE_BLAS_CHECK(ctx, cublasLtMatmulDescSetAttribute(
                            d.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)));
  }
  /* stored shapes (column-major rows, cols) of Lt's A = b and B = a */
  uint64_t ar = g->b_t ? g->k : g->n, ac = g->b_t ? g->n : g->k;
  uint64_t br = g->a_t ? g->m : g->k, bc = g->a_t ? g->k : g->m;
  MOE_BLAS_CHECK(ctx, cublasLtMatrixLayoutCreate(&d.la, ty.data, ar, ac, g->ldb));
  MOE_BLAS_CHECK(ctx, cublasLtMatrixLayoutCreate(&d.lb, ty.data, br, bc, g->lda));
  MOE_BLAS_CHECK(ctx, cublasLtMatrixLayoutCreate(&d.lc, ty.data, g->n, g->m, g->n));
  if (g->batch > 1) {
    int32_t count = (int32_t)g->batch;
    const cublasLtMatrixLayout_t ls[3] = {d.la, d.lb, d.lc};
    const int64_t strides[3] = {g->b_bs, g->a_bs, g->c_bs};
    for (int i = 0; i < 3; i++) {
      MOE_BLAS_CHECK(ctx, cublasLtMatrixLayoutSetAttribute(
                              ls[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
      MOE_BLAS_CHECK(ctx, cublasLtMatrixLayoutSetAttribute(
                              ls[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &strides[i],
                              sizeof(strides[i])));
    }
  }
  MoeScratch ws(ctx, device);
  MOE_CHECK(moe_cuda_alloc(ctx, device, MOE_GEMM_WORKSPACE, &ws.ptr, &ws.block));
  size_t ws_size = MOE_GEMM_WORKSPACE;
  uint32_t al_a = moe_gemm_align(g->b, g->ldb, g->b_bs, g->batch, es);
  uint32_t al_b = moe_gemm_align(g->a, g->lda, g->a_bs, g->batch, es);
  uint32_t al_c = moe_gemm_align(g->c, g->n, g->c_bs, g->batch, es);
  MOE_BLAS_CHECK(ctx, cublasLtMatmulPreferenceCreate(&d.pref));
  MOE_BLAS_CHECK(ctx, cublasLtMatmulPreferenceSetAttribute(
                          d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_size,
                          sizeof(ws_size)));
  MOE_BLAS_CHECK(ctx, cublasLtMatmulPreferenceSetAttribute(
                          d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a)));
  MOE_BLAS_CHECK(ctx, cublasLtMatmulPreferenceSetAttribute(
                          d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b)));
  MOE_BLAS_CHECK(ctx, cublasLtMatmulPreferenceSetAttribute(
                          d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c)));
  MOE_BLAS_CHECK(ctx, cublasLtMatmulPreferenceSetAttribute(
                          d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof(al_c)));
  cublasLtMatmulHeuristicResult_t heur;
  int found = 0;
  cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(moe_lt_handle, d.op, d.la, d.lb, d.lc, d.lc,
                                                     d.pref, 1, &heur, &found);
  if (hs != CUBLAS_STATUS_SUCCESS || found == 0) return MOE_OK; /* fallback */
  float one_f = 1.0f, zero_f = 0.0f;
  double one_d = 1.0, zero_d = 0.0;
  const void *alpha = g->dtype == MOE_F64 ? (const void *)&one_d : (const void *)&one_f;
  const void *beta = g->dtype == MOE_F64 ? (const void *)&zero_d : (const void *)&zero_f;
  MOE_BLAS_CHECK(ctx, cublasLtMatmul(moe_lt_handle, d.op, alpha, g->b, d.la, g->a, d.lb, beta,
                                     g->c, d.lc, g->c, d.lc, &heur.algo, ws.ptr, ws_size, stream));
  MOE_KCHECK(ctx, "cublasLtMatmul");
  *done = true;
  return MOE_OK;
}

/* cublasGemmStridedBatchedEx; the bias is written into c first (beta 1). */
static moe_status moe_gemm_fallback(moe_ctx *ctx, int device, cudaStream_t stream,
                                    const moe_gemm *g, const MoeGemmTypes &ty) {
  if (g->m > INT_MAX || g->n > INT_MAX || g->k > INT_MAX || g->lda > INT_MAX ||
      g->ldb > INT_MAX || g->batch > INT_MAX)
    return moe_error(ctx, MOE_ERR_NOT_SUPPORTED,
                     "cuda gemm: (%lld x %lld) @ (%lld x %lld) x %lld has no cuBLASLt algorithm "
                     "and exceeds cublasGemmStridedBatchedEx's 32-bit sizes",
                     (long long)g->m, (long long)g->k, (long long)g->k, (long long)g->n,
                     (long long)g->batch);
  void *h = NULL;
  MOE_CHECK(moe_cuda_cublas(ctx, device, &h));
  size_t es = moe_dtype_size(g->dtype);
  if (g->bias) {
    int64_t total = g->batch * g->m * g->n;
    /* c is packed (c_bs == m * n, or 0 only when batch == 1) */
    switch (es) {
      case 2:
        moe_bias_rows_kernel<uint16_t><<<moe_blocks(total), MOE_THREADS, 0, stream>>>(
            (uint16_t *)g->c, (const uint16_t *)g->bias, total, g->n);
        break;
      case 4:
        moe_bias_rows_kernel<float><<<moe_blocks(total), MOE_THREADS, 0, stream>>>(
            (float *)g->c, (const float *)g->bias, total, g->n);
        break;
      default:
        moe_bias_rows_kernel<double><<<moe_blocks(total), MOE_THREADS, 0, stream>>>(
            (double *)g->c, (const double *)g->bias, total, g->n);
        break;
    }
    MOE_KCHECK(ctx, "cuda gemm bias kernel");
  }
  float one_f = 1.0f, beta_f = g->bias ? 1.0f : 0.0f;
  double one_d = 1.0, beta_d = g->bias ? 1.0 : 0.0;
  const void *alpha = g->dtype == MOE_F64 ? (const void *)&one_d : (const void *)&one_f;
  const void *beta = g->dtype == MOE_F64 ? (const void *)&beta_d : (const void *)&beta_f;
  cublasOperation_t opa = g->b_t ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t opb = g->a_t ? CUBLAS_OP_T : CUBLAS_OP_N;
  MOE_BLAS_CHECK(ctx, cublasGemmStridedBatchedEx(
                          (cublasHandle_t)h, opa, opb, (int)g->n, (int)g->m, (int)g->k, alpha,
                          g->b, ty.data, (int)g->ldb, g->b_bs, g->a, ty.data, (int)g->lda,
                          g->a_bs, beta, g->c, ty.data, (int)g->n, g->c_bs, (int)g->batch,
                          ty.compute, CUBLAS_GEMM_DEFAULT));
  MOE_KCHECK(ctx, "cublasGemmStridedBatchedEx");
  return MOE_OK;
}

extern "C" moe_status moe_cuda_gemm(moe_ctx *ctx, int device, const moe_gemm *g) {
  MoeGemmTypes ty;
  if (!moe_gemm_types(g, &ty))
    return moe_error(ctx, MOE_ERR_DTYPE, "cuda gemm: dtype %s is not supported",
                     moe_dtype_name(g->dtype));
  if (g->m < 1 || g->n < 1 || g->k < 1 || g->batch < 1)
    return moe_error(ctx, MOE_ERR_INTERNAL, "cuda gemm: empty product (%lld, %lld, %lld) x %lld",
                     (long long)g->m, (long long)g->n, (long long)g->k, (long long)g->batch);
  void *stream = NULL;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  bool done = false;
  if (g->batch <= INT32_MAX) MOE_CHECK(moe_gemm_lt(ctx, device, (cudaStream_t)stream, g, ty, &done));
  if (done) return MOE_OK;
  return moe_gemm_fallback(ctx, device, (cudaStream_t)stream, g, ty);
}
