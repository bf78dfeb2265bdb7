/*
 * grouped.cu - two CUDA backends of the grouped GEMM family (declared in
 * core/grouped_cuda.h): moe_cuda_gemm_grouped ("cublas_grouped") runs a
 * list of independent products with one cublasGemmGroupedBatchedEx_64
 * call; moe_cuda_gemm_streams ("streams") runs them with cublasGemmEx_64,
 * largest first, dealt round-robin over 4 side streams (the environment
 * variable MOE_GROUPED_STREAMS=1..8 for experiments) forked from the
 * context's stream with an event and joined back (the context's stream
 * waits for every side stream, so all later work, and the caching
 * allocator's reuse of any block, is ordered after the products). The
 * "loop" backend needs no code here: core/grouped.c calls matmul's
 * moe_cuda_gemm once per group.
 *
 * The side streams, their cuBLAS handles and events are created per device
 * on first use and kept for the process (like matmul's cuBLASLt handle):
 * meant for one host thread issuing GEMMs at a time.
 *
 * Row-major to column-major as in matmul.cu: our packed row-major c (m, n)
 * is cuBLAS's column-major c^T (n, m) = op(b) op(a), b first. Each product
 * is its own cuBLAS group of size 1, so the problem sizes, leading
 * dimensions, operations, alpha and beta are host arrays of `count` entries;
 * the A, B and C pointer arrays are device arrays, uploaded from one
 * pageable host buffer with one cudaMemcpyAsync on the context's stream
 * (for pageable memory the call returns once the bytes are staged, so the
 * host buffer may be freed at once) into a block of the caching allocator,
 * released right after the GEMM is queued (its next user queues behind the
 * GEMM on the same stream).
 *
 * Precision: bf16 in and out with f32 accumulation (CUBLAS_COMPUTE_32F);
 * f32 in f32 or, when asked, TF32.
 */
#include <cublas_v2.h>
#include <stdlib.h>

#include "common.cuh"
#include "grouped_cuda.h"

/* Host arrays of one call, freed on scope exit. */
struct MoeGgHost {
  void *block = nullptr;
  ~MoeGgHost() { free(block); }
};

/* cuBLAS data and compute types of the list's dtype (f32, optionally TF32; bf16). */
static moe_status moe_gg_types(moe_ctx *ctx, const moe_gemm *g, cudaDataType_t *data,
                               cublasComputeType_t *compute) {
  switch (g->dtype) {
    case MOE_F32:
      *data = CUDA_R_32F;
      *compute = g->tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
      return MOE_OK;
    case MOE_BF16:
      *data = CUDA_R_16BF;
      *compute = CUBLAS_COMPUTE_32F;
      return MOE_OK;
    default:
      return moe_error(ctx, MOE_ERR_DTYPE, "cuda grouped gemm: dtype %s is not supported",
                       moe_dtype_name(g->dtype));
  }
}

extern "C" moe_status moe_cuda_gemm_grouped(moe_ctx *ctx, int device, const moe_gemm *g,
                                            int64_t count) {
  if (count < 1) return moe_error(ctx, MOE_ERR_INTERNAL, "cuda grouped gemm: no products");
  cudaDataType_t data = CUDA_R_32F;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  MOE_CHECK(moe_gg_types(ctx, &g[0], &data, &compute));
  size_t n = (size_t)count;
  /* host block: ops (2n), sizes and lds (6n int64), alpha/beta (2n float),
   * group sizes (n int64), then the 3n pointers to upload */
  size_t bytes = 2 * n * sizeof(cublasOperation_t) + 7 * n * sizeof(int64_t) +
                 2 * n * sizeof(float) + 3 * n * sizeof(void *) + 64;
  MoeGgHost host;
  host.block = malloc(bytes);
  if (!host.block)
    return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "cuda grouped gemm: cannot allocate %zu bytes",
                     bytes);
  char *p = (char *)host.block;
  void **ptrs = (void **)p; /* (3n): A (b operands), B (a operands), C */
  p += 3 * n * sizeof(void *);
  int64_t *mm = (int64_t *)p, *nn = mm + n, *kk = nn + n, *lda = kk + n, *ldb = lda + n,
          *ldc = ldb + n, *gsize = ldc + n;
  p = (char *)(gsize + n);
  cublasOperation_t *opa = (cublasOperation_t *)p, *opb = opa + n;
  p = (char *)(opb + n);
  p += (size_t)(-(uintptr_t)p & 7u); /* align the floats */
  float *alpha = (float *)p, *beta = alpha + n;
  for (size_t i = 0; i < n; i++) {
    const moe_gemm *q = &g[i];
    if (q->m < 1 || q->n < 1 || q->k < 1 || q->batch != 1 || q->bias || q->dtype != g[0].dtype)
      return moe_error(ctx, MOE_ERR_INTERNAL,
                       "cuda grouped gemm: product %zu (%lld, %lld, %lld) x %lld is not a plain "
                       "non-empty product of the list's dtype",
                       i, (long long)q->m, (long long)q->n, (long long)q->k, (long long)q->batch);
    ptrs[i] = (void *)q->b;
    ptrs[n + i] = (void *)q->a;
    ptrs[2 * n + i] = q->c;
    opa[i] = q->b_t ? CUBLAS_OP_T : CUBLAS_OP_N;
    opb[i] = q->a_t ? CUBLAS_OP_T : CUBLAS_OP_N;
    mm[i] = q->n, nn[i] = q->m, kk[i] = q->k;
    lda[i] = q->ldb, ldb[i] = q->lda, ldc[i] = q->n;
    gsize[i] = 1;
    alpha[i] = 1.0f, beta[i] = 0.0f;
  }
  if (count > INT32_MAX)
    return moe_error(ctx, MOE_ERR_NOT_SUPPORTED, "cuda grouped gemm: %lld groups exceed 2^31",
                     (long long)count);
  void *stream = NULL, *handle = NULL;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  MOE_CHECK(moe_cuda_cublas(ctx, device, &handle));
  MoeScratch dev(ctx, device);
  MOE_CHECK(dev.alloc(3 * n * sizeof(void *)));
  MOE_CUDA_CHECK(ctx, cudaMemcpyAsync(dev.ptr, ptrs, 3 * n * sizeof(void *), cudaMemcpyHostToDevice,
                                 (cudaStream_t)stream));
  void **dptrs = (void **)dev.ptr;
  cublasHandle_t h = (cublasHandle_t)handle;
  cublasPointerMode_t mode;
  MOE_CUBLAS_CHECK(ctx, cublasGetPointerMode(h, &mode));
  if (mode != CUBLAS_POINTER_MODE_HOST)
    MOE_CUBLAS_CHECK(ctx, cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST));
  cublasStatus_t bs = cublasGemmGroupedBatchedEx_64(
      h, opa, opb, mm, nn, kk, alpha, (const void *const *)dptrs, data, lda,
      (const void *const *)(dptrs + n), data, ldb, beta, dptrs + 2 * n, data, ldc, count, gsize,
      compute);
  if (mode != CUBLAS_POINTER_MODE_HOST) cublasSetPointerMode(h, mode);
  if (bs != CUBLAS_STATUS_SUCCESS)
    return moe_error(ctx, MOE_ERR_CUDA,
                     "cublasGemmGroupedBatchedEx_64 failed for %lld groups (%s): %s",
                     (long long)count, moe_dtype_name(g[0].dtype), cublasGetStatusString(bs));
  MOE_CUDA_CHECK_LAUNCH(ctx, "cublasGemmGroupedBatchedEx_64");
  return MOE_OK;
}

/* ------------------------------------------------------------ streams */

#define MOE_GG_STREAMS 8 /* at most; MOE_GROUPED_STREAMS (default 4) are created and used */

/* Side streams one call uses: the knob grouped_streams (MOE_GROUPED_STREAMS,
 * for experiments), 4 by default. */
static int moe_gg_streams_wanted(const moe_ctx *ctx) {
  const int x = ctx->knobs.grouped_streams;
  return x >= 1 && x <= MOE_GG_STREAMS ? x : 4;
}

struct MoeGgSide {
  bool ready; /* fork created */
  int n;      /* side streams created (with their join events and handles) */
  cudaStream_t stream[MOE_GG_STREAMS];
  cublasHandle_t handle[MOE_GG_STREAMS];
  cudaEvent_t fork, join[MOE_GG_STREAMS];
};

static MoeGgSide moe_gg_side[MOE_MAX_CUDA_DEVICES];

/* The first `want` side streams of `device` (current), created on first
 * use (only those used; a later call that wants more creates the rest). */
static moe_status moe_gg_side_get(moe_ctx *ctx, int device, int want, MoeGgSide **out) {
  if (device < 0 || device >= MOE_MAX_CUDA_DEVICES)
    return moe_error(ctx, MOE_ERR_DEVICE, "cuda grouped gemm: device %d out of range", device);
  MoeGgSide *s = &moe_gg_side[device];
  if (!s->ready) {
    MOE_CUDA_CHECK(ctx, cudaEventCreateWithFlags(&s->fork, cudaEventDisableTiming));
    s->ready = true;
  }
  for (; s->n < want; s->n++) {
    const int i = s->n;
    MOE_CUDA_CHECK(ctx, cudaStreamCreateWithFlags(&s->stream[i], cudaStreamNonBlocking));
    MOE_CUDA_CHECK(ctx, cudaEventCreateWithFlags(&s->join[i], cudaEventDisableTiming));
    MOE_CUBLAS_CHECK(ctx, cublasCreate(&s->handle[i]));
    MOE_CUBLAS_CHECK(ctx, cublasSetStream(s->handle[i], s->stream[i]));
  }
  *out = s;
  return MOE_OK;
}

struct MoeGgOrder {
  double work; /* m n k */
  int64_t index;
};

static int moe_gg_order_cmp(const void *a, const void *b) {
  const MoeGgOrder *x = (const MoeGgOrder *)a, *y = (const MoeGgOrder *)b;
  if (x->work != y->work) return x->work > y->work ? -1 : 1;
  return x->index < y->index ? -1 : x->index > y->index ? 1 : 0;
}

static size_t moe_gg_order_bytes(int64_t count) { return (size_t)count * sizeof(MoeGgOrder); }

extern "C" moe_status moe_cuda_gemm_streams(moe_ctx *ctx, int device, const moe_gemm *g,
                                            int64_t count) {
  if (count < 1) return moe_error(ctx, MOE_ERR_INTERNAL, "cuda grouped gemm: no products");
  cudaDataType_t data = CUDA_R_32F;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  MOE_CHECK(moe_gg_types(ctx, &g[0], &data, &compute));
  void *main = NULL;
  MOE_CHECK(moe_cuda_stream(ctx, device, &main));
  MoeGgSide *s = NULL;
  const int want = moe_gg_streams_wanted(ctx);
  MOE_CHECK(moe_gg_side_get(ctx, device, want, &s));
  int used = count < want ? (int)count : want;
  MOE_CUDA_CHECK(ctx, cudaEventRecord(s->fork, (cudaStream_t)main));
  for (int i = 0; i < used; i++) MOE_CUDA_CHECK(ctx, cudaStreamWaitEvent(s->stream[i], s->fork, 0));
  /* largest products first, dealt round-robin: the streams finish close together */
  MoeGgHost order;
  order.block = malloc(moe_gg_order_bytes(count));
  if (!order.block)
    return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "cuda grouped gemm: cannot allocate an order");
  MoeGgOrder *ord = (MoeGgOrder *)order.block;
  for (int64_t i = 0; i < count; i++) ord[i] = {(double)g[i].m * g[i].n * g[i].k, i};
  qsort(ord, (size_t)count, sizeof(MoeGgOrder), moe_gg_order_cmp);
  const float one = 1.0f, zero = 0.0f;
  moe_status st = MOE_OK;
  for (int64_t j = 0; j < count && st == MOE_OK; j++) {
    int64_t i = ord[j].index;
    const moe_gemm *q = &g[i];
    if (q->m < 1 || q->n < 1 || q->k < 1 || q->batch != 1 || q->bias || q->dtype != g[0].dtype) {
      st = moe_error(ctx, MOE_ERR_INTERNAL, "cuda grouped gemm: product %lld is not plain",
                     (long long)i);
      break;
    }
    cublasStatus_t bs = cublasGemmEx_64(
        s->handle[j % used], q->b_t ? CUBLAS_OP_T : CUBLAS_OP_N, q->a_t ? CUBLAS_OP_T : CUBLAS_OP_N,
        q->n, q->m, q->k, &one, q->b, data, q->ldb, q->a, data, q->lda, &zero, q->c, data, q->n,
        compute, CUBLAS_GEMM_DEFAULT);
    if (bs != CUBLAS_STATUS_SUCCESS)
      st = moe_error(ctx, MOE_ERR_CUDA, "cublasGemmEx_64 failed for product %lld: %s",
                     (long long)i, cublasGetStatusString(bs));
  }
  /* join whatever was queued, also after a failure: the context's stream
   * must not run ahead of work still reading or writing its blocks */
  for (int i = 0; i < used; i++) {
    cudaEventRecord(s->join[i], s->stream[i]);
    cudaStreamWaitEvent((cudaStream_t)main, s->join[i], 0);
  }
  if (st != MOE_OK) return st;
  MOE_CUDA_CHECK_LAUNCH(ctx, "cublasGemmEx_64 on side streams");
  return MOE_OK;
}
