/*
 * matmul.cu - the CUDA GEMM of the matmul family: moe_cuda_gemm (declared in
 * core/matmul_cuda.h), on cuBLASLt with cublasGemmStridedBatchedEx as the
 * fallback when Lt's heuristic offers no algorithm; and moe_cuda_colsum,
 * the column sums that are linear's bias gradient.
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
 * holds only host memory), and a table of the algorithm chosen per problem
 * (see the algorithm cache below). The workspace (32 MiB, what PyTorch gives cuBLAS
 * on Hopper) comes from the context's caching allocator for each call and is
 * released right after the launch: every later user of that block is queued
 * after the GEMM on the same stream. Nothing outlives the context on the GPU.
 */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "common.cuh"
#include "matmul_cuda.h"

#define MOE_GEMM_WORKSPACE ((size_t)32 << 20)

static cublasLtHandle_t moe_lt_handle = NULL;

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

/* ---------------------------------------------------------- algorithm cache
 *
 * The algorithm cuBLASLt's heuristic picks for a problem (or none) is kept per
 * problem key, so a GEMM repeated every step (a layer's forward and backward)
 * asks the heuristic once. For large problems (MOE_GEMM_TUNE_FLOPS and up)
 * with the bias epilogue the first call instead times the heuristic's top MOE_GEMM_TUNE_ALGOS
 * candidates on the real operands (moe_gemm_tune) and keeps the fastest:
 * the heuristic's first choice is not always the fastest, notably with the
 * bias epilogue (measured on an H100: 2.89 ms for linear's forward with its
 * bias at 16384 x 14336 x 4096 with the first choice, 2.68 ms tuned). Tuning
 * synchronizes the stream once per key; the environment variable
 * MOE_GEMM_TUNE=0 turns it off (the heuristic's first choice, deterministic
 * across processes), MOE_GEMM_TUNE=all extends it to large plain GEMMs;
 * the setting is part of the key (moe_knob_set can change it mid-run).
 * The table is process-wide (host memory only) and, like the Lt handle,
 * meant for one host thread issuing GEMMs at a time. */
#define MOE_GEMM_CACHE 128
#define MOE_GEMM_TUNE_ALGOS 8
#define MOE_GEMM_TUNE_REPS 2
#define MOE_GEMM_TUNE_ROUNDS 2
#define MOE_GEMM_TUNE_MARGIN 0.02
#define MOE_GEMM_TUNE_FLOPS 2e10

struct MoeGemmKey {
  int32_t device, dtype, compute, opa, opb, epilogue, tune;
  int64_t m, n, k, lda, ldb, batch, a_bs, b_bs, c_bs;
  uint32_t al_a, al_b, al_c, al_bias;
};

struct MoeGemmEntry {
  bool used, found;
  MoeGemmKey key;
  cublasLtMatmulAlgo_t algo;
};

static MoeGemmEntry moe_gemm_cache[MOE_GEMM_CACHE];
static int moe_gemm_cache_next = 0; /* round-robin victim once full */

static MoeGemmEntry *moe_gemm_cache_find(const MoeGemmKey &key) {
  for (int i = 0; i < MOE_GEMM_CACHE; i++)
    if (moe_gemm_cache[i].used && memcmp(&moe_gemm_cache[i].key, &key, sizeof(key)) == 0)
      return &moe_gemm_cache[i];
  return nullptr;
}

static void moe_gemm_cache_put(const MoeGemmKey &key, bool found,
                               const cublasLtMatmulAlgo_t *algo) {
  MoeGemmEntry *e = &moe_gemm_cache[moe_gemm_cache_next];
  moe_gemm_cache_next = (moe_gemm_cache_next + 1) % MOE_GEMM_CACHE;
  e->used = true;
  e->found = found;
  e->key = key;
  if (found) e->algo = *algo;
}

/* The knob gemm_tune, MOE_GEMM_TUNE: 0 none, 1 (unset or anything else)
 * the large GEMMs with the bias epilogue, "all" every large GEMM (an
 * experiment: see below). */
static int moe_gemm_tune_level(const moe_ctx *ctx) { return ctx->knobs.gemm_tune; }

/* CUDA events, destroyed on scope exit. */
struct MoeEvents {
  cudaEvent_t a = nullptr, b = nullptr;
  ~MoeEvents() {
    if (a) cudaEventDestroy(a);
    if (b) cudaEventDestroy(b);
  }
};

/* Index of the fastest of the n candidates on these operands: each runs
 * once to warm up, then MOE_GEMM_TUNE_ROUNDS rounds time every candidate
 * over MOE_GEMM_TUNE_REPS runs (rounds interleave the candidates, so a
 * change of clock between them weighs on all alike), keeping each one's
 * fastest round. The heuristic's first choice (0) stays unless another is
 * faster by more than MOE_GEMM_TUNE_MARGIN: timing noise does not move it.
 * 0 when timing fails. c is written by every run; the launch after tuning
 * writes it again. */
static int moe_gemm_tune(const cublasLtMatmulDesc_t op, const cublasLtMatrixLayout_t la,
                         const cublasLtMatrixLayout_t lb, const cublasLtMatrixLayout_t lc,
                         const moe_gemm *g, const void *alpha, const void *beta,
                         const cublasLtMatmulHeuristicResult_t *heur, int n, void *ws,
                         size_t ws_size, cudaStream_t stream) {
  MoeEvents ev;
  if (cudaEventCreate(&ev.a) != cudaSuccess || cudaEventCreate(&ev.b) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  bool ok[MOE_GEMM_TUNE_ALGOS];
  float best_ms[MOE_GEMM_TUNE_ALGOS];
  for (int i = 0; i < n; i++) { /* warm-up; an algorithm that fails to launch is skipped */
    ok[i] = cublasLtMatmul(moe_lt_handle, op, alpha, g->b, la, g->a, lb, beta, g->c, lc, g->c, lc,
                           &heur[i].algo, ws, ws_size, stream) == CUBLAS_STATUS_SUCCESS;
    best_ms[i] = -1.0f;
  }
  if (!ok[0]) return 0;
  for (int round = 0; round < MOE_GEMM_TUNE_ROUNDS; round++) {
    for (int i = 0; i < n; i++) {
      if (!ok[i]) continue;
      cudaEventRecord(ev.a, stream);
      for (int r = 0; r < MOE_GEMM_TUNE_REPS; r++)
        cublasLtMatmul(moe_lt_handle, op, alpha, g->b, la, g->a, lb, beta, g->c, lc, g->c, lc,
                       &heur[i].algo, ws, ws_size, stream);
      cudaEventRecord(ev.b, stream);
      float ms = 0.0f;
      if (cudaEventSynchronize(ev.b) != cudaSuccess ||
          cudaEventElapsedTime(&ms, ev.a, ev.b) != cudaSuccess) {
        cudaGetLastError();
        return 0;
      }
      if (best_ms[i] < 0.0f || ms < best_ms[i]) best_ms[i] = ms;
    }
  }
  int best = 0;
  for (int i = 1; i < n; i++)
    if (ok[i] && best_ms[i] < best_ms[best]) best = i;
  return best_ms[best] < (float)(1.0 - MOE_GEMM_TUNE_MARGIN) * best_ms[0] ? best : 0;
}

/* Lt: returns MOE_OK with *done false when no algorithm fits (fallback). */
static moe_status moe_gemm_lt(moe_ctx *ctx, int device, cudaStream_t stream, const moe_gemm *g,
                              const MoeGemmTypes &ty, bool *done) {
  *done = false;
  if (!moe_lt_handle) MOE_CUBLAS_CHECK(ctx, cublasLtCreate(&moe_lt_handle));
  size_t es = moe_dtype_size(g->dtype);
  MoeLtDescs d;
  cublasOperation_t opa = g->b_t ? CUBLAS_OP_T : CUBLAS_OP_N; /* Lt's A is our b */
  cublasOperation_t opb = g->a_t ? CUBLAS_OP_T : CUBLAS_OP_N; /* Lt's B is our a */
  cublasLtEpilogue_t epi = g->bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  const void *epi_ptr = g->bias;
  MOE_CUBLAS_CHECK(ctx, cublasLtMatmulDescCreate(&d.op, ty.compute, ty.scale));
  MOE_CUBLAS_CHECK(ctx, cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &opa,
                                                     sizeof(opa)));
  MOE_CUBLAS_CHECK(ctx, cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &opb,
                                                     sizeof(opb)));
  if (epi_ptr) {
    MOE_CUBLAS_CHECK(ctx, cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi,
                                                       sizeof(epi)));
    MOE_CUBLAS_CHECK(ctx, cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                       &epi_ptr, sizeof(epi_ptr)));
    cudaDataType_t bt = ty.data;
    MOE_CUBLAS_CHECK(ctx, cublasLtMatmulDescSetAttribute(
                            d.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)));
  }
  /* stored shapes (column-major rows, cols) of Lt's A = b and B = a */
  uint64_t ar = g->b_t ? g->k : g->n, ac = g->b_t ? g->n : g->k;
  uint64_t br = g->a_t ? g->m : g->k, bc = g->a_t ? g->k : g->m;
  MOE_CUBLAS_CHECK(ctx, cublasLtMatrixLayoutCreate(&d.la, ty.data, ar, ac, g->ldb));
  MOE_CUBLAS_CHECK(ctx, cublasLtMatrixLayoutCreate(&d.lb, ty.data, br, bc, g->lda));
  MOE_CUBLAS_CHECK(ctx, cublasLtMatrixLayoutCreate(&d.lc, ty.data, g->n, g->m, g->n));
  if (g->batch > 1) {
    int32_t count = (int32_t)g->batch;
    const cublasLtMatrixLayout_t ls[3] = {d.la, d.lb, d.lc};
    const int64_t strides[3] = {g->b_bs, g->a_bs, g->c_bs};
    for (int i = 0; i < 3; i++) {
      MOE_CUBLAS_CHECK(ctx, cublasLtMatrixLayoutSetAttribute(
                              ls[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
      MOE_CUBLAS_CHECK(ctx, cublasLtMatrixLayoutSetAttribute(
                              ls[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &strides[i],
                              sizeof(strides[i])));
    }
  }
  size_t ws_size = MOE_GEMM_WORKSPACE;
  MoeGemmKey key;
  memset(&key, 0, sizeof(key)); /* padding too: keys compare with memcmp */
  key.device = device;
  key.dtype = (int32_t)g->dtype;
  key.compute = (int32_t)ty.compute;
  key.opa = (int32_t)opa;
  key.opb = (int32_t)opb;
  key.epilogue = (int32_t)epi;
  key.tune = (int32_t)moe_gemm_tune_level(ctx); /* a pick made under another setting is not reused */
  key.m = g->m, key.n = g->n, key.k = g->k, key.lda = g->lda, key.ldb = g->ldb;
  key.batch = g->batch;
  if (g->batch > 1) key.a_bs = g->a_bs, key.b_bs = g->b_bs, key.c_bs = g->c_bs;
  key.al_a = moe_gemm_align(g->b, g->ldb, g->b_bs, g->batch, es);
  key.al_b = moe_gemm_align(g->a, g->lda, g->a_bs, g->batch, es);
  key.al_c = moe_gemm_align(g->c, g->n, g->c_bs, g->batch, es);
  key.al_bias = epi_ptr ? moe_gemm_align(epi_ptr, 0, 0, 1, es) : 0;

  float one_f = 1.0f, zero_f = 0.0f;
  double one_d = 1.0, zero_d = 0.0;
  const void *alpha = g->dtype == MOE_F64 ? (const void *)&one_d : (const void *)&one_f;
  const void *beta = g->dtype == MOE_F64 ? (const void *)&zero_d : (const void *)&zero_f;
  MoeScratch ws(ctx, device);
  MoeGemmEntry *hit = moe_gemm_cache_find(key);
  if (hit && !hit->found) return MOE_OK; /* Lt has none: known */
  MOE_CHECK(ws.alloc(MOE_GEMM_WORKSPACE));
  cublasLtMatmulAlgo_t algo;
  if (hit) {
    algo = hit->algo;
  } else {
    MOE_CUBLAS_CHECK(ctx, cublasLtMatmulPreferenceCreate(&d.pref));
    MOE_CUBLAS_CHECK(ctx, cublasLtMatmulPreferenceSetAttribute(
                            d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_size,
                            sizeof(ws_size)));
    MOE_CUBLAS_CHECK(ctx, cublasLtMatmulPreferenceSetAttribute(
                            d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &key.al_a,
                            sizeof(key.al_a)));
    MOE_CUBLAS_CHECK(ctx, cublasLtMatmulPreferenceSetAttribute(
                            d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &key.al_b,
                            sizeof(key.al_b)));
    MOE_CUBLAS_CHECK(ctx, cublasLtMatmulPreferenceSetAttribute(
                            d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &key.al_c,
                            sizeof(key.al_c)));
    MOE_CUBLAS_CHECK(ctx, cublasLtMatmulPreferenceSetAttribute(
                            d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &key.al_c,
                            sizeof(key.al_c)));
    double flops = 2.0 * (double)g->m * (double)g->n * (double)g->k * (double)g->batch;
    /* By default only GEMMs with the bias epilogue are tuned: for plain
     * GEMMs the heuristic's first choice was as fast or faster in most
     * measurements (MOE_GEMM_TUNE=all tunes them too, to measure that). */
    int level = moe_gemm_tune_level(ctx);
    int want = flops >= MOE_GEMM_TUNE_FLOPS && (level == 2 || (level == 1 && g->bias))
                   ? MOE_GEMM_TUNE_ALGOS
                   : 1;
    cublasLtMatmulHeuristicResult_t heur[MOE_GEMM_TUNE_ALGOS];
    int nfound = 0;
    cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(moe_lt_handle, d.op, d.la, d.lb, d.lc,
                                                       d.lc, d.pref, want, heur, &nfound);
    if (hs != CUBLAS_STATUS_SUCCESS || nfound == 0) {
      moe_gemm_cache_put(key, false, nullptr);
      return MOE_OK; /* fallback */
    }
    int pick = nfound > 1 ? moe_gemm_tune(d.op, d.la, d.lb, d.lc, g, alpha, beta, heur, nfound,
                                          ws.ptr, ws_size, stream)
                          : 0;
    algo = heur[pick].algo;
    moe_gemm_cache_put(key, true, &algo);
  }
  MOE_CUBLAS_CHECK(ctx, cublasLtMatmul(moe_lt_handle, d.op, alpha, g->b, d.la, g->a, d.lb, beta,
                                     g->c, d.lc, g->c, d.lc, &algo, ws.ptr, ws_size, stream));
  MOE_CUDA_CHECK_LAUNCH(ctx, "cublasLtMatmul");
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
    MOE_CUDA_CHECK_LAUNCH(ctx, "cuda gemm bias kernel");
  }
  float one_f = 1.0f, beta_f = g->bias ? 1.0f : 0.0f;
  double one_d = 1.0, beta_d = g->bias ? 1.0 : 0.0;
  const void *alpha = g->dtype == MOE_F64 ? (const void *)&one_d : (const void *)&one_f;
  const void *beta = g->dtype == MOE_F64 ? (const void *)&beta_d : (const void *)&beta_f;
  cublasOperation_t opa = g->b_t ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t opb = g->a_t ? CUBLAS_OP_T : CUBLAS_OP_N;
  MOE_CUBLAS_CHECK(ctx, cublasGemmStridedBatchedEx(
                          (cublasHandle_t)h, opa, opb, (int)g->n, (int)g->m, (int)g->k, alpha,
                          g->b, ty.data, (int)g->ldb, g->b_bs, g->a, ty.data, (int)g->lda,
                          g->a_bs, beta, g->c, ty.data, (int)g->n, g->c_bs, (int)g->batch,
                          ty.compute, CUBLAS_GEMM_DEFAULT));
  MOE_CUDA_CHECK_LAUNCH(ctx, "cublasGemmStridedBatchedEx");
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

/* ------------------------------------------------------------ column sums
 *
 * moe_cuda_colsum: linear's bias gradient, the sums over rows of g (R, N).
 * Pass 1 splits the rows into `splits` chunks; each thread sums V adjacent
 * columns over one chunk (one 16-byte load per row when the columns and
 * rows are aligned for it) into an f32 (f64) partial. Pass 2 adds the
 * partials of each column in chunk order. No atomics: the result depends
 * only on the shape. */
#define MOE_COLSUM_THREADS 128
#define MOE_COLSUM_BLOCKS 1024 /* pass 1 aims at this many blocks */
#define MOE_COLSUM_MAX_SPLITS 256

template <moe_dtype DT, typename A, int V>
__global__ void __launch_bounds__(MOE_COLSUM_THREADS)
    moe_colsum_part_kernel(const moe_st_t<DT> *src, int64_t rows, int64_t cols, int64_t ld,
                           int64_t chunk, A *part) {
  using T = moe_st_t<DT>;
  int64_t c0 = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * V;
  if (c0 >= cols) return;
  int64_t r0 = (int64_t)blockIdx.y * chunk, r1 = r0 + chunk < rows ? r0 + chunk : rows;
  A acc[V];
#pragma unroll
  for (int v = 0; v < V; v++) acc[v] = 0;
  const T *p = src + r0 * ld + c0;
#pragma unroll 4
  for (int64_t r = r0; r < r1; r++, p += ld) {
    if constexpr (V > 1) {
      MoeVec<T, V> x = *reinterpret_cast<const MoeVec<T, V> *>(p);
#pragma unroll
      for (int v = 0; v < V; v++) acc[v] += moe_load_as<A, DT>(x.v[v]);
    } else {
      acc[0] += moe_load_as<A, DT>(*p);
    }
  }
  A *o = part + (int64_t)blockIdx.y * cols + c0;
#pragma unroll
  for (int v = 0; v < V; v++) o[v] = acc[v];
}

template <moe_dtype DT, typename A>
__global__ void __launch_bounds__(MOE_THREADS)
    moe_colsum_final_kernel(const A *part, int64_t splits, int64_t cols, moe_st_t<DT> *dst) {
  int64_t nthreads = (int64_t)gridDim.x * blockDim.x;
  for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += nthreads) {
    A s = 0;
    for (int64_t i = 0; i < splits; i++) s += part[i * cols + c];
    dst[c] = moe_store_from<DT>(s);
  }
}

template <moe_dtype DT>
static moe_status moe_colsum_run(moe_ctx *ctx, int device, cudaStream_t stream, const void *src,
                                 int64_t rows, int64_t cols, int64_t ld, void *dst) {
  using T = moe_st_t<DT>;
  using A = std::conditional_t<DT == MOE_F64, double, float>;
  constexpr int VW = (int)(16 / sizeof(T)); /* columns per 16-byte load */
  bool vec = cols % VW == 0 && moe_aligned(src, 16) && ((uint64_t)ld * sizeof(T)) % 16 == 0;
  int64_t tcols = vec ? cols / VW : cols;
  int64_t bx = (tcols + MOE_COLSUM_THREADS - 1) / MOE_COLSUM_THREADS;
  int64_t splits = (MOE_COLSUM_BLOCKS + bx - 1) / bx;
  if (splits > MOE_COLSUM_MAX_SPLITS) splits = MOE_COLSUM_MAX_SPLITS;
  if (splits > rows) splits = rows;
  int64_t chunk = (rows + splits - 1) / splits;
  splits = (rows + chunk - 1) / chunk;
  if (bx > INT_MAX)
    return moe_error(ctx, MOE_ERR_NOT_SUPPORTED, "cuda colsum: %lld columns are too many",
                     (long long)cols);
  MoeScratch part(ctx, device);
  MOE_CHECK(part.alloc((size_t)(splits * cols) * sizeof(A)));
  dim3 grid((unsigned)bx, (unsigned)splits);
  if (vec)
    moe_colsum_part_kernel<DT, A, VW><<<grid, MOE_COLSUM_THREADS, 0, stream>>>(
        (const T *)src, rows, cols, ld, chunk, (A *)part.ptr);
  else
    moe_colsum_part_kernel<DT, A, 1><<<grid, MOE_COLSUM_THREADS, 0, stream>>>(
        (const T *)src, rows, cols, ld, chunk, (A *)part.ptr);
  MOE_CUDA_CHECK_LAUNCH(ctx, "cuda colsum");
  moe_colsum_final_kernel<DT, A><<<moe_blocks(cols), MOE_THREADS, 0, stream>>>(
      (const A *)part.ptr, splits, cols, (T *)dst);
  MOE_CUDA_CHECK_LAUNCH(ctx, "cuda colsum");
  return MOE_OK;
}

extern "C" moe_status moe_cuda_colsum(moe_ctx *ctx, int device, moe_dtype dtype, const void *src,
                                      int64_t rows, int64_t cols, int64_t ld, void *dst) {
  if (rows < 1 || cols < 1 || ld < cols)
    return moe_error(ctx, MOE_ERR_INTERNAL, "cuda colsum: bad geometry (%lld, %lld) ld %lld",
                     (long long)rows, (long long)cols, (long long)ld);
  void *stream = NULL;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  cudaStream_t s = (cudaStream_t)stream;
  switch (dtype) {
    case MOE_F32: return moe_colsum_run<MOE_F32>(ctx, device, s, src, rows, cols, ld, dst);
    case MOE_F64: return moe_colsum_run<MOE_F64>(ctx, device, s, src, rows, cols, ld, dst);
    case MOE_BF16: return moe_colsum_run<MOE_BF16>(ctx, device, s, src, rows, cols, ld, dst);
    case MOE_F16: return moe_colsum_run<MOE_F16>(ctx, device, s, src, rows, cols, ld, dst);
    default:
      return moe_error(ctx, MOE_ERR_DTYPE, "cuda colsum: dtype %s is not supported",
                       moe_dtype_name(dtype));
  }
}
