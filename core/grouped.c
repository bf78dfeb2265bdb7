/*
 * grouped.c - the grouped GEMM family (API and contract in moe_grouped.h):
 * moe_grouped_mm (differentiable in x and w), moe_grouped_mm_wgrad, and the
 * context's choice of the CUDA backend.
 *
 * Both ops reduce to a list of per-group products described as moe_gemm
 * (matmul_cuda.h, batch 1), one per non-empty group, built from the host
 * offsets without copying the operands when their layout is BLAS-compatible
 * (x rows of unit stride, w's groups row-major or transposed): the CPU runs
 * cblas_sgemm/dgemm per product (bf16 converted to f32 first and rounded
 * back, as matmul.c does), CUDA runs the list with the backend chosen by
 * moe_grouped_set_backend: "loop" (one cuBLASLt GEMM per group through
 * matmul's moe_cuda_gemm, its algorithm cache included) or "cublas_grouped"
 * (one cublasGemmGroupedBatchedEx_64 call, kernels/grouped.cu) or
 * "streams" (cublasGemmEx per group over 4 side streams); "auto"
 * picks loop or streams per call (gg_auto_backend below, with the
 * measurements behind the rule). Output rows outside the groups
 * and weight gradients of empty groups are zero-filled; nothing else is.
 *
 * The device-offset functions (moe_grouped_mm_dev, _wgrad_dev) hand bf16
 * products on an sm_90a GPU to the block-sparse family's wgmma kernel
 * (moe_cuda_wg_grouped_mm, kernels/blocksparse.cu), which reads the offsets
 * where they are; otherwise they copy the offsets to the host once and run
 * the functions above (the backward reuses that copy).
 *
 * Backward of grouped_mm (node MOE_OP_GROUPED_MM, saves x and w, keeps its
 * own copy of the offsets in node->user):
 *   dx = grouped_mm(dout, w, offs, !trans_w)
 *   dw = grouped_mm_wgrad(x, dout, offs, trans_w)
 */
#include <cblas.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "blocksparse_cuda.h" /* the sm_90a kernel of the device-offset functions */
#include "grouped_cuda.h"
#include "internal.h"
#include "moe_grouped.h"

/* ------------------------------------------------------------ backends */

typedef enum gg_backend {
  GG_AUTO = 0,
  GG_LOOP,
  GG_CUBLAS_GROUPED,
  GG_STREAMS,
  GG_WGMMA,
  GG_NBACKENDS
} gg_backend;

static const char *const gg_backend_names[GG_NBACKENDS] = {"auto", "loop", "cublas_grouped",
                                                            "streams", "wgmma"};

moe_status moe_grouped_set_backend(moe_ctx *ctx, const char *name) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!name)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "grouped_set_backend: name is NULL (valid: %s)",
                     moe_grouped_backends());
  for (int i = 0; i < GG_NBACKENDS; i++)
    if (strcmp(name, gg_backend_names[i]) == 0) {
      ctx->knobs.grouped_backend = i; /* the knob grouped_backend (knobs.h) */
      return MOE_OK;
    }
  return moe_error(ctx, MOE_ERR_INVALID_ARG,
                   "grouped_set_backend: unknown backend \"%s\" (valid: %s)", name,
                   moe_grouped_backends());
}

const char *moe_grouped_backend(const moe_ctx *ctx) {
  int b = ctx ? ctx->knobs.grouped_backend : GG_AUTO;
  return gg_backend_names[b >= 0 && b < GG_NBACKENDS ? b : GG_AUTO];
}

const char *moe_grouped_backends(void) { return "auto,loop,cublas_grouped,streams,wgmma"; }

/* ---------------------------------------------------------- validation */

static bool gg_dtype_ok(moe_dtype dt) { return dt == MOE_F32 || dt == MOE_F64 || dt == MOE_BF16; }

static moe_status gg_check_tensor(moe_ctx *ctx, const char *fn, const moe_tensor *t,
                                  const char *what, int ndim, const char *layout) {
  if (!t) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: %s is NULL", fn, what);
  if (!gg_dtype_ok(t->dtype))
    return moe_error(ctx, MOE_ERR_DTYPE, "%s: %s has dtype %s; %s takes f32, f64 or bf16", fn, what,
                     moe_dtype_name(t->dtype), fn);
  if (t->dtype == MOE_F64 && t->storage->device.type == MOE_DEVICE_CUDA)
    return moe_error(ctx, MOE_ERR_DTYPE, "%s: %s is f64 on CUDA; f64 is CPU only (use f32 or bf16)",
                     fn, what);
  if (t->ndim != ndim)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: %s must be %d-D %s, got shape %s", fn, what, ndim,
                     layout, MOE_SHAPE(t));
  return MOE_OK;
}

/* b on a's device with a's dtype. */
static moe_status gg_check_pair(moe_ctx *ctx, const char *fn, const moe_tensor *a, const char *an,
                                const moe_tensor *b, const char *bn) {
  MOE_CHECK(moe_check_same_device(ctx, fn, an, a->storage->device, bn, b->storage->device));
  MOE_CHECK(moe_check_same_dtype(ctx, fn, an, a->dtype, bn, b->dtype));
  return moe_device_check(ctx, a->storage->device);
}

/* 0 <= offs[0] <= ... <= offs[G] <= R. */
static moe_status gg_check_offs(moe_ctx *ctx, const char *fn, const int64_t *offs, int64_t groups,
                                int64_t R) {
  if (groups < 1)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: groups must be >= 1, got %lld", fn,
                     (long long)groups);
  if (!offs) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: offsets are NULL", fn);
  if (offs[0] < 0)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: offsets[0] = %lld is negative", fn,
                     (long long)offs[0]);
  for (int64_t g = 0; g < groups; g++)
    if (offs[g + 1] < offs[g])
      return moe_error(ctx, MOE_ERR_INVALID_ARG,
                       "%s: offsets out of order: offsets[%lld] = %lld < offsets[%lld] = %lld", fn,
                       (long long)(g + 1), (long long)offs[g + 1], (long long)g,
                       (long long)offs[g]);
  if (offs[groups] > R)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "%s: offsets[%lld] = %lld is past the %lld rows of the input", fn,
                     (long long)groups, (long long)offs[groups], (long long)R);
  return MOE_OK;
}

/* a (R, K) and b (R, N) of one dtype and device, the same rows. */
/* x (R, K) times w per group: w's group count against the groups the
 * offsets give (gname says whose: "wanted", "the offsets"; not checked for
 * groups < 1, which the offsets' check reports), and the depths. */
static moe_status gg_check_mm(moe_ctx *ctx, const char *fn, const moe_tensor *x, const moe_tensor *w,
                              int64_t groups, const char *gname, bool trans_w) {
  const char *sx = MOE_SHAPE(x), *sw = MOE_SHAPE(w);
  if (groups >= 1 && w->shape[0] != groups)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: w of shape %s has %lld groups, %s %lld (x %s)", fn, sw,
                     (long long)w->shape[0], gname, (long long)groups, sx);
  int64_t wk = trans_w ? w->shape[2] : w->shape[1];
  if (x->shape[1] != wk)
    return moe_error(ctx, MOE_ERR_SHAPE,
                     "%s: x %s and w %s cannot be multiplied (K %lld != %lld, trans_w %s)", fn, sx,
                     sw, (long long)x->shape[1], (long long)wk, trans_w ? "true" : "false");
  return MOE_OK;
}

static moe_status gg_check_wgrad_operands(moe_ctx *ctx, const char *fn, const moe_tensor *a,
                                          const moe_tensor *b) {
  MOE_CHECK(gg_check_tensor(ctx, fn, a, "a", 2, "(R, K)"));
  MOE_CHECK(gg_check_tensor(ctx, fn, b, "b", 2, "(R, N)"));
  MOE_CHECK(gg_check_pair(ctx, fn, a, "a", b, "b"));
  if (a->shape[0] != b->shape[0])
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: a %s and b %s have different rows (%lld != %lld)", fn,
                     MOE_SHAPE(a), MOE_SHAPE(b), (long long)a->shape[0], (long long)b->shape[0]);
  return MOE_OK;
}

/* ------------------------------------------------------------- layouts */

/* x (R, K) usable in place: unit stride along K and a row stride >= K. */
static bool gg_rows_ok(const moe_tensor *x, int64_t *ld) {
  int64_t R = x->shape[0], K = x->shape[1];
  if (K > 1 && x->stride[1] != 1) return false;
  if (R > 1 && x->stride[0] < (K > 1 ? K : 1)) return false;
  *ld = R > 1 ? x->stride[0] : (K > 1 ? K : 1);
  return true;
}

/* w (G, A, B) usable in place: each group row-major with unit inner stride
 * and a row stride >= B; the group stride is free. */
static bool gg_groups_ok(const moe_tensor *w, int64_t *ld) {
  int64_t A = w->shape[1], B = w->shape[2];
  if (B > 1 && w->stride[2] != 1) return false;
  if (A > 1 && w->stride[1] < (B > 1 ? B : 1)) return false;
  *ld = A > 1 ? w->stride[1] : (B > 1 ? B : 1);
  return true;
}

/* t itself (retained) when ok, else a contiguous copy. */
static moe_status gg_usable(moe_ctx *ctx, moe_tensor *t, bool ok, moe_tensor **out) {
  if (ok) {
    moe_tensor_retain(t);
    *out = t;
    return MOE_OK;
  }
  return moe_contiguous(ctx, t, out);
}

/* ------------------------------------------------------------ execution */

static moe_status gg_cpu_gemm(moe_ctx *ctx, const char *fn, const moe_gemm *g) {
  if (g->m > INT_MAX || g->n > INT_MAX || g->k > INT_MAX || g->lda > INT_MAX || g->ldb > INT_MAX)
    return moe_error(ctx, MOE_ERR_NOT_SUPPORTED,
                     "%s: a group's product (%lld x %lld) @ (%lld x %lld) exceeds the 32-bit "
                     "sizes of the CPU BLAS",
                     fn, (long long)g->m, (long long)g->k, (long long)g->k, (long long)g->n);
  int m = (int)g->m, n = (int)g->n, k = (int)g->k, lda = (int)g->lda, ldb = (int)g->ldb;
  enum CBLAS_TRANSPOSE ta = g->a_t ? CblasTrans : CblasNoTrans;
  enum CBLAS_TRANSPOSE tb = g->b_t ? CblasTrans : CblasNoTrans;
  if (g->dtype == MOE_F32)
    cblas_sgemm(CblasRowMajor, ta, tb, m, n, k, 1.0f, (const float *)g->a, lda,
                (const float *)g->b, ldb, 0.0f, (float *)g->c, n);
  else
    cblas_dgemm(CblasRowMajor, ta, tb, m, n, k, 1.0, (const double *)g->a, lda,
                (const double *)g->b, ldb, 0.0, (double *)g->c, n);
  return MOE_OK;
}

/* The CUDA backend of one call: "auto" resolved from the number of groups
 * and the mean rows per group (rows = offs[G] - offs[0], the dimension that
 * varies: M of the forward and input-gradient products, the inner K of the
 * weight gradient).
 *
 * Rule, from bench/results/grouped.md (H100 80GB HBM3, cuBLAS 13.1,
 * 2026-11-22, bf16, the six GEMMs of the GLU expert MLP at T = 16384, chain
 * ms; torch._grouped_mm beside):
 *                 groups  rows/grp  loop    streams  cublas_grouped  torch
 *   mixtral       8       4096      51.5    51.4     104.9           58.4
 *   olmoe         64      2048      8.47    8.70     14.14           8.34
 *   qwen3         128     1024      12.52   9.59     11.75           6.64
 * cublasGemmGroupedBatchedEx never wins (it ran at 47-56% of the dense
 * rate), so auto never picks it. One cuBLASLt GEMM per group (loop) runs
 * each group at about the dense rate when groups are few or >= 2048 rows;
 * below that a single group no longer fills the 132 SMs and 4 side streams
 * win (qwen3: 9.59 vs 12.52 ms; 8 streams: 13.5 ms, worse). */
#define GG_AUTO_LOOP_MAX_GROUPS 16 /* this many groups or fewer: loop */
#define GG_AUTO_LOOP_MIN_ROWS 2048 /* mean rows per group at least this: loop */
static gg_backend gg_auto_backend(const moe_ctx *ctx, int64_t groups, int64_t rows) {
  const gg_backend set = (gg_backend)ctx->knobs.grouped_backend;
  if (set != GG_AUTO && set != GG_WGMMA) return set; /* wgmma: the device-offset functions' kernel */
  if (groups <= GG_AUTO_LOOP_MAX_GROUPS || rows / groups >= GG_AUTO_LOOP_MIN_ROWS) return GG_LOOP;
  return GG_STREAMS;
}

/* Runs the count products of list; groups and rows (offs[G] - offs[0])
 * for the choice of the CUDA backend. */
static moe_status gg_exec(moe_ctx *ctx, const char *fn, moe_device dev, const moe_gemm *list,
                          int64_t count, int64_t groups, int64_t rows) {
  if (count == 0) return MOE_OK;
  if (dev.type == MOE_DEVICE_CUDA) {
    gg_backend b = gg_auto_backend(ctx, groups, rows);
    if (b == GG_CUBLAS_GROUPED) return moe_cuda_gemm_grouped(ctx, dev.index, list, count);
    if (b == GG_STREAMS) return moe_cuda_gemm_streams(ctx, dev.index, list, count);
    for (int64_t i = 0; i < count; i++) MOE_CHECK(moe_cuda_gemm(ctx, dev.index, &list[i]));
    return MOE_OK;
  }
  for (int64_t i = 0; i < count; i++) MOE_CHECK(gg_cpu_gemm(ctx, fn, &list[i]));
  return MOE_OK;
}

/* Zero-fills rows [start, start + len) of dim 0 of t. */
static moe_status gg_zero_rows(moe_ctx *ctx, moe_tensor *t, int64_t start, int64_t len) {
  if (len <= 0) return MOE_OK;
  moe_tensor *v = NULL;
  MOE_CHECK(moe_narrow(ctx, t, 0, start, len, &v));
  moe_status st = moe_fill_(ctx, v, 0);
  moe_tensor_release(v);
  return st;
}

static moe_gemm *gg_list_new(moe_ctx *ctx, const char *fn, int64_t groups) {
  moe_gemm *list = (moe_gemm *)calloc((size_t)groups, sizeof(moe_gemm));
  if (!list)
    moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: cannot allocate %lld group descriptions", fn,
              (long long)groups);
  return list;
}

/* out (R, N) = per group x @ w[g] (or w[g]^T); validated, grad mode off,
 * f32/f64 on the CPU or any dtype on CUDA. */
static moe_status gg_mm_run(moe_ctx *ctx, const char *fn, moe_tensor *x, moe_tensor *w,
                            const int64_t *offs, int64_t groups, bool trans_w, moe_tensor *r) {
  int64_t R = x->shape[0], K = x->shape[1], N = r->shape[1];
  moe_tensor *xc = NULL, *wc = NULL;
  moe_gemm *list = NULL;
  moe_status st = MOE_OK;
  int64_t ldx = 0, ldw = 0;
  MOE_CHECK_GOTO(gg_usable(ctx, x, gg_rows_ok(x, &ldx), &xc), st, done);
  MOE_CHECK_GOTO(gg_usable(ctx, w, gg_groups_ok(w, &ldw), &wc), st, done);
  if (xc != x) MOE_ASSERT(gg_rows_ok(xc, &ldx));
  if (wc != w) MOE_ASSERT(gg_groups_ok(wc, &ldw));
  MOE_CHECK_GOTO(gg_zero_rows(ctx, r, 0, offs[0]), st, done);
  MOE_CHECK_GOTO(gg_zero_rows(ctx, r, offs[groups], R - offs[groups]), st, done);
  if (K == 0) { /* empty sums */
    st = gg_zero_rows(ctx, r, offs[0], offs[groups] - offs[0]);
    goto done;
  }
  if (!(list = gg_list_new(ctx, fn, groups))) {
    st = MOE_ERR_OUT_OF_MEMORY;
    goto done;
  }
  size_t es = moe_dtype_size(x->dtype);
  int64_t count = 0;
  for (int64_t g = 0; g < groups; g++) {
    int64_t m = offs[g + 1] - offs[g];
    if (m == 0) continue;
    moe_gemm *p = &list[count++];
    p->dtype = x->dtype;
    p->batch = 1;
    p->m = m, p->n = N, p->k = K;
    p->a = (const char *)moe_tensor_data(xc) + (size_t)(offs[g] * ldx) * es;
    p->lda = ldx;
    p->b = (const char *)moe_tensor_data(wc) + (size_t)(g * wc->stride[0]) * es;
    p->b_t = trans_w; /* w[g] (N, K) row-major is the transpose of a (K, N) */
    p->ldb = ldw;
    p->c = (char *)moe_tensor_data(r) + (size_t)(offs[g] * N) * es;
    p->tf32 = moe_matmul_tf32();
  }
  st = gg_exec(ctx, fn, r->storage->device, list, count, groups, offs[groups] - offs[0]);
done:
  free(list);
  moe_tensor_release(xc);
  moe_tensor_release(wc);
  return st;
}

/* out (G, K, N) = a_g^T b_g, or (G, N, K) = b_g^T a_g; validated, grad
 * mode off, f32/f64 on the CPU or any dtype on CUDA. */
static moe_status gg_wgrad_run(moe_ctx *ctx, const char *fn, moe_tensor *a, moe_tensor *b,
                               const int64_t *offs, int64_t groups, bool trans_out,
                               moe_tensor *r) {
  int64_t K = a->shape[1], N = b->shape[1];
  moe_tensor *ac = NULL, *bc = NULL;
  moe_gemm *list = NULL;
  moe_status st = MOE_OK;
  int64_t lda = 0, ldb = 0;
  if (K == 0 || N == 0) return MOE_OK; /* nothing to write */
  MOE_CHECK_GOTO(gg_usable(ctx, a, gg_rows_ok(a, &lda), &ac), st, done);
  MOE_CHECK_GOTO(gg_usable(ctx, b, gg_rows_ok(b, &ldb), &bc), st, done);
  if (ac != a) MOE_ASSERT(gg_rows_ok(ac, &lda));
  if (bc != b) MOE_ASSERT(gg_rows_ok(bc, &ldb));
  if (!(list = gg_list_new(ctx, fn, groups))) {
    st = MOE_ERR_OUT_OF_MEMORY;
    goto done;
  }
  size_t es = moe_dtype_size(a->dtype);
  int64_t count = 0;
  for (int64_t g = 0; g < groups; g++) {
    int64_t m = offs[g + 1] - offs[g];
    if (m == 0) { /* a run of empty groups: one fill */
      int64_t e = g + 1;
      while (e < groups && offs[e + 1] == offs[e]) e++;
      MOE_CHECK_GOTO(gg_zero_rows(ctx, r, g, e - g), st, done);
      g = e - 1;
      continue;
    }
    const char *pa = (const char *)moe_tensor_data(ac) + (size_t)(offs[g] * lda) * es;
    const char *pb = (const char *)moe_tensor_data(bc) + (size_t)(offs[g] * ldb) * es;
    moe_gemm *p = &list[count++];
    p->dtype = a->dtype;
    p->batch = 1;
    p->k = m;
    p->c = (char *)moe_tensor_data(r) + (size_t)(g * K * N) * es;
    p->tf32 = moe_matmul_tf32();
    /* the first operand is the transpose of the rows of one input */
    p->a_t = true;
    p->b_t = false;
    if (!trans_out) { /* (K, N) = a_g^T b_g */
      p->m = K, p->n = N;
      p->a = pa, p->lda = lda;
      p->b = pb, p->ldb = ldb;
    } else { /* (N, K) = b_g^T a_g */
      p->m = N, p->n = K;
      p->a = pb, p->lda = ldb;
      p->b = pa, p->ldb = lda;
    }
  }
  st = gg_exec(ctx, fn, r->storage->device, list, count, groups, offs[groups] - offs[0]);
done:
  free(list);
  moe_tensor_release(ac);
  moe_tensor_release(bc);
  return st;
}

/* out (R, N) of x's dtype and device (validated inputs; grad mode off). */
static moe_status gg_mm_compute(moe_ctx *ctx, const char *fn, moe_tensor *x, moe_tensor *w,
                                const int64_t *offs, int64_t groups, bool trans_w,
                                moe_tensor **out) {
  int64_t R = x->shape[0], N = trans_w ? w->shape[1] : w->shape[2];
  moe_device dev = x->storage->device;
  moe_tensor *r = NULL, *x32 = NULL, *w32 = NULL, *r32 = NULL;
  moe_status st = MOE_OK;
  if (dev.type == MOE_DEVICE_CPU && x->dtype == MOE_BF16) { /* in f32, rounded back */
    MOE_CHECK_GOTO(moe_to(ctx, x, MOE_F32, dev, &x32), st, done);
    MOE_CHECK_GOTO(moe_to(ctx, w, MOE_F32, dev, &w32), st, done);
    MOE_CHECK_GOTO(gg_mm_compute(ctx, fn, x32, w32, offs, groups, trans_w, &r32), st, done);
    st = moe_to(ctx, r32, MOE_BF16, dev, out);
    goto done;
  }
  MOE_CHECK_GOTO(moe_tensor_empty(ctx, 2, (int64_t[]){R, N}, x->dtype, dev, &r), st, done);
  if (R > 0 && N > 0) MOE_CHECK_GOTO(gg_mm_run(ctx, fn, x, w, offs, groups, trans_w, r), st, done);
  *out = r;
  r = NULL;
done:
  moe_tensor_release(r);
  moe_tensor_release(x32);
  moe_tensor_release(w32);
  moe_tensor_release(r32);
  return st;
}

static moe_status gg_wgrad_compute(moe_ctx *ctx, const char *fn, moe_tensor *a, moe_tensor *b,
                                   const int64_t *offs, int64_t groups, bool trans_out,
                                   moe_tensor **out) {
  int64_t K = a->shape[1], N = b->shape[1];
  moe_device dev = a->storage->device;
  moe_tensor *r = NULL, *a32 = NULL, *b32 = NULL, *r32 = NULL;
  moe_status st = MOE_OK;
  if (dev.type == MOE_DEVICE_CPU && a->dtype == MOE_BF16) {
    MOE_CHECK_GOTO(moe_to(ctx, a, MOE_F32, dev, &a32), st, done);
    MOE_CHECK_GOTO(moe_to(ctx, b, MOE_F32, dev, &b32), st, done);
    MOE_CHECK_GOTO(gg_wgrad_compute(ctx, fn, a32, b32, offs, groups, trans_out, &r32), st, done);
    st = moe_to(ctx, r32, MOE_BF16, dev, out);
    goto done;
  }
  int64_t shape[3] = {groups, trans_out ? N : K, trans_out ? K : N};
  MOE_CHECK_GOTO(moe_tensor_empty(ctx, 3, shape, a->dtype, dev, &r), st, done);
  MOE_CHECK_GOTO(gg_wgrad_run(ctx, fn, a, b, offs, groups, trans_out, r), st, done);
  *out = r;
  r = NULL;
done:
  moe_tensor_release(r);
  moe_tensor_release(a32);
  moe_tensor_release(b32);
  moe_tensor_release(r32);
  return st;
}

/* ---------------------------------------------- offsets on the device */

/* The sm_90a kernel runs these sizes (moe_grouped_offsets_on_device). */
static bool gg_dev_sizes(int64_t G, int64_t K, int64_t N) {
  return G >= 1 && G < 4094 && K >= 8 && N >= 8 && K % 8 == 0 && N % 8 == 0 && K <= INT32_MAX &&
         N <= INT32_MAX;
}

bool moe_grouped_offsets_on_device(moe_ctx *ctx, moe_device dev, moe_dtype dt, int64_t groups,
                                   int64_t K, int64_t N) {
  if (!ctx || dev.type != MOE_DEVICE_CUDA || dt != MOE_BF16) return false;
  gg_backend b = (gg_backend)ctx->knobs.grouped_backend;
  return (b == GG_AUTO || b == GG_WGMMA) && gg_dev_sizes(groups, K, N) &&
         moe_cuda_wg_grouped(ctx, dev.index);
}

/* offs: (G + 1) i64 on dev. */
static moe_status gg_check_offs_tensor(moe_ctx *ctx, const char *fn, const moe_tensor *offs,
                                       moe_device dev, int64_t *groups) {
  if (!offs) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: offsets are NULL", fn);
  if (offs->ndim != 1 || offs->dtype != MOE_I64 || offs->shape[0] < 2)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: offsets must be a 1-D i64 tensor of G + 1 >= 2 "
                     "entries, got %s %s", fn, moe_dtype_name(offs->dtype), MOE_SHAPE(offs));
  moe_device od = moe_tensor_device(offs);
  if (od.type != dev.type || od.index != dev.index)
    return moe_error(ctx, MOE_ERR_DEVICE, "%s: offsets are on another device than the operands", fn);
  *groups = offs->shape[0] - 1;
  return MOE_OK;
}

/* The offsets on the host (a synchronisation on CUDA), checked. */
static moe_status gg_offs_host(moe_ctx *ctx, const char *fn, moe_tensor *offs, int64_t R,
                               int64_t **out) {
  int64_t G = offs->shape[0] - 1;
  moe_tensor *h = NULL;
  MOE_CHECK(moe_to(ctx, offs, MOE_I64, MOE_CPU, &h));
  moe_tensor *hc = NULL;
  moe_status st = moe_contiguous(ctx, h, &hc);
  moe_tensor_release(h);
  MOE_CHECK(st);
  int64_t *copy = (int64_t *)malloc(sizeof(int64_t) * (size_t)(G + 1));
  if (!copy) {
    moe_tensor_release(hc);
    return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: cannot copy %lld offsets", fn, (long long)(G + 1));
  }
  memcpy(copy, moe_tensor_data(hc), sizeof(int64_t) * (size_t)(G + 1));
  moe_tensor_release(hc);
  st = gg_check_offs(ctx, fn, copy, G, R);
  if (st != MOE_OK) {
    free(copy);
    return st;
  }
  *out = copy;
  return MOE_OK;
}

/* The kernel's operands and offsets, contiguous (the tensors themselves
 * when they already are). */
static moe_status gg_dev_operands(moe_ctx *ctx, moe_tensor *a, moe_tensor *b, moe_tensor *offs,
                                  moe_tensor **ac, moe_tensor **bc, moe_tensor **oc) {
  MOE_CHECK(moe_contiguous(ctx, a, ac));
  MOE_CHECK(moe_contiguous(ctx, b, bc));
  return moe_contiguous(ctx, offs, oc);
}

static bool gg_aligned(moe_tensor *const *t, int n) {
  for (int i = 0; i < n; i++)
    if ((uintptr_t)moe_tensor_data(t[i]) & 15) return false;
  return true;
}

/* A product's offsets: a tensor on the operands' device (offs, else NULL)
 * and, once made (or given), their host copy. */
typedef struct gg_offs {
  moe_tensor *offs;
  int64_t *host;
  int64_t groups;
} gg_offs;

static void gg_offs_free(void *p) {
  gg_offs *o = (gg_offs *)p;
  if (!o) return;
  moe_tensor_release(o->offs);
  free(o->host);
  free(o);
}

/* out (R, N) = grouped_mm over o: the kernel reads o->offs on the device
 * where it runs; otherwise the host copy, made on first need. */
static moe_status gg_mm_any(moe_ctx *ctx, const char *fn, moe_tensor *x, moe_tensor *w, gg_offs *o,
                            bool trans_w, moe_tensor **out) {
  moe_tensor *offs = o->offs;
  int64_t **host = &o->host;
  int64_t G = o->groups, R = x->shape[0], K = x->shape[1];
  int64_t N = trans_w ? w->shape[1] : w->shape[2];
  moe_device dev = x->storage->device;
  if (!*host && moe_grouped_offsets_on_device(ctx, dev, x->dtype, G, K, N)) {
    moe_tensor *xc = NULL, *wc = NULL, *oc = NULL, *r = NULL;
    moe_status st = gg_dev_operands(ctx, x, w, offs, &xc, &wc, &oc);
    if (st == MOE_OK) st = moe_tensor_empty(ctx, 2, (int64_t[]){R, N}, x->dtype, dev, &r);
    moe_tensor *t[4] = {xc, wc, oc, r};
    if (st == MOE_OK && gg_aligned(t, 4)) {
      st = moe_cuda_wg_grouped_mm(ctx, dev.index, moe_tensor_data(xc), moe_tensor_data(wc),
                                  (const int64_t *)moe_tensor_data(oc), G, R, K, N, trans_w,
                                  moe_tensor_data(r));
      if (st == MOE_OK) *out = r, r = NULL;
    } else if (st == MOE_OK) {
      st = MOE_ERR_NOT_SUPPORTED; /* unaligned views: the host path below */
    }
    moe_tensor_release(xc), moe_tensor_release(wc), moe_tensor_release(oc), moe_tensor_release(r);
    if (st != MOE_ERR_NOT_SUPPORTED) return st;
  }
  if (!*host) MOE_CHECK(gg_offs_host(ctx, fn, offs, R, host));
  return gg_mm_compute(ctx, fn, x, w, *host, G, trans_w, out);
}

static moe_status gg_wgrad_any(moe_ctx *ctx, const char *fn, moe_tensor *a, moe_tensor *b,
                               gg_offs *o, bool trans_out, moe_tensor **out) {
  moe_tensor *offs = o->offs;
  int64_t **host = &o->host;
  int64_t G = o->groups, R = a->shape[0], K = a->shape[1], N = b->shape[1];
  moe_device dev = a->storage->device;
  if (!*host && R > 0 && moe_grouped_offsets_on_device(ctx, dev, a->dtype, G, K, N)) {
    moe_tensor *ac = NULL, *bc = NULL, *oc = NULL, *r = NULL;
    moe_status st = gg_dev_operands(ctx, a, b, offs, &ac, &bc, &oc);
    /* (G, N, K) = b^T a: the same kernel with the operands swapped */
    int64_t shape[3] = {G, trans_out ? N : K, trans_out ? K : N};
    if (st == MOE_OK) st = moe_tensor_empty(ctx, 3, shape, a->dtype, dev, &r);
    moe_tensor *t[4] = {ac, bc, oc, r};
    if (st == MOE_OK && gg_aligned(t, 4)) {
      const void *p = moe_tensor_data(ac), *q = moe_tensor_data(bc);
      st = moe_cuda_wg_grouped_wgrad(ctx, dev.index, trans_out ? q : p, trans_out ? p : q,
                                     (const int64_t *)moe_tensor_data(oc), G, R,
                                     trans_out ? N : K, trans_out ? K : N, moe_tensor_data(r));
      if (st == MOE_OK) *out = r, r = NULL;
    } else if (st == MOE_OK) {
      st = MOE_ERR_NOT_SUPPORTED;
    }
    moe_tensor_release(ac), moe_tensor_release(bc), moe_tensor_release(oc), moe_tensor_release(r);
    if (st != MOE_ERR_NOT_SUPPORTED) return st;
  }
  if (!*host) MOE_CHECK(gg_offs_host(ctx, fn, offs, R, host));
  return gg_wgrad_compute(ctx, fn, a, b, *host, G, trans_out, out);
}

/* ------------------------------------------------------------ autograd */

/* inputs x (0), w (1); saved x (slot 0), w (slot 1); iargs: trans_w;
 * user: the gg_offs (a host copy of the G + 1 offsets, or the device
 * tensor). */
static moe_status gg_mm_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                 moe_tensor **gin) {
  moe_tensor *x = NULL, *w = NULL;
  moe_status st = MOE_OK;
  gg_offs *o = (gg_offs *)n->user;
  bool trans_w = n->iargs[0] != 0;
  if (!gout[0]) return moe_node_zero_grads(ctx, n, gin); /* nothing flowed in */
  MOE_CHECK_GOTO(moe_node_saved(ctx, n, 0, &x), st, fail);
  MOE_CHECK_GOTO(moe_node_saved(ctx, n, 1, &w), st, fail);
  if (moe_node_needs_grad(n, 0))
    MOE_CHECK_GOTO(gg_mm_any(ctx, "grouped_mm", gout[0], w, o, !trans_w, &gin[0]), st, fail);
  if (moe_node_needs_grad(n, 1))
    MOE_CHECK_GOTO(gg_wgrad_any(ctx, "grouped_mm", x, gout[0], o, trans_w, &gin[1]), st, fail);
  goto done;
fail:
  for (int i = 0; i < 2; i++) {
    moe_tensor_release(gin[i]);
    gin[i] = NULL;
  }
done:
  moe_tensor_release(x);
  moe_tensor_release(w);
  return st;
}

/* ------------------------------------------------------------------ API */

moe_status moe_grouped_mm(moe_ctx *ctx, moe_tensor *x, moe_tensor *w, const int64_t *offs,
                          int64_t groups, bool trans_w, moe_tensor **out) {
  const char *fn = "grouped_mm";
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: out is NULL", fn);
  MOE_CHECK(gg_check_tensor(ctx, fn, x, "x", 2, "(R, K)"));
  MOE_CHECK(gg_check_tensor(ctx, fn, w, "w", 3, trans_w ? "(G, N, K)" : "(G, K, N)"));
  MOE_CHECK(gg_check_pair(ctx, fn, x, "x", w, "w"));
  MOE_CHECK(gg_check_mm(ctx, fn, x, w, groups, "wanted", trans_w));
  MOE_CHECK(gg_check_offs(ctx, fn, offs, groups, x->shape[0]));

  bool prev = moe_grad_set(ctx, false);
  moe_tensor *r = NULL;
  moe_status st = gg_mm_compute(ctx, fn, x, w, offs, groups, trans_w, &r);
  moe_grad_set(ctx, prev);
  MOE_CHECK(st);
  gg_offs *o = NULL; /* the node's copy of the offsets */
  if (moe_grad_wanted(ctx, 2, (const moe_tensor *const[]){x, w})) {
    o = (gg_offs *)calloc(1, sizeof *o);
    if (o) o->host = (int64_t *)malloc(sizeof(int64_t) * (size_t)(groups + 1));
    if (!o || !o->host) {
      gg_offs_free(o);
      moe_tensor_release(r);
      return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: cannot copy %lld offsets", fn,
                       (long long)(groups + 1));
    }
    memcpy(o->host, offs, sizeof(int64_t) * (size_t)(groups + 1));
    o->groups = groups;
  }
  MOE_CHECK(moe_record(ctx, &(moe_record_spec){
      .op = MOE_OP_GROUPED_MM, .backward = gg_mm_backward, .n_in = 2, .in = {x, w},
      .n_save = 2, .save = {x, w}, .iargs = {trans_w}, .user = o, .user_free = gg_offs_free},
      1, &r));
  *out = r;
  return MOE_OK;
}

moe_status moe_grouped_mm_wgrad(moe_ctx *ctx, moe_tensor *a, moe_tensor *b, const int64_t *offs,
                                int64_t groups, bool trans_out, moe_tensor **out) {
  const char *fn = "grouped_mm_wgrad";
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: out is NULL", fn);
  MOE_CHECK(gg_check_wgrad_operands(ctx, fn, a, b));
  MOE_CHECK(gg_check_offs(ctx, fn, offs, groups, a->shape[0]));
  bool prev = moe_grad_set(ctx, false);
  moe_status st = gg_wgrad_compute(ctx, fn, a, b, offs, groups, trans_out, out);
  moe_grad_set(ctx, prev);
  return st;
}

moe_status moe_grouped_mm_dev(moe_ctx *ctx, moe_tensor *x, moe_tensor *w, moe_tensor *offs,
                              bool trans_w, moe_tensor **out) {
  const char *fn = "grouped_mm_dev";
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: out is NULL", fn);
  MOE_CHECK(gg_check_tensor(ctx, fn, x, "x", 2, "(R, K)"));
  MOE_CHECK(gg_check_tensor(ctx, fn, w, "w", 3, trans_w ? "(G, N, K)" : "(G, K, N)"));
  MOE_CHECK(gg_check_pair(ctx, fn, x, "x", w, "w"));
  int64_t groups = 0;
  MOE_CHECK(gg_check_offs_tensor(ctx, fn, offs, x->storage->device, &groups));
  MOE_CHECK(gg_check_mm(ctx, fn, x, w, groups, "the offsets", trans_w));
  gg_offs *o = (gg_offs *)calloc(1, sizeof *o);
  if (!o) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
  moe_tensor_retain(offs);
  o->offs = offs, o->groups = groups;
  bool prev = moe_grad_set(ctx, false);
  moe_tensor *r = NULL;
  moe_status st = gg_mm_any(ctx, fn, x, w, o, trans_w, &r);
  moe_grad_set(ctx, prev);
  if (st != MOE_OK) {
    gg_offs_free(o);
    return st;
  }
  bool want = moe_grad_wanted(ctx, 2, (const moe_tensor *const[]){x, w});
  if (!want) gg_offs_free(o), o = NULL;
  MOE_CHECK(moe_record(ctx, &(moe_record_spec){
      .op = MOE_OP_GROUPED_MM, .backward = gg_mm_backward, .n_in = 2, .in = {x, w},
      .n_save = 2, .save = {x, w}, .iargs = {trans_w}, .user = o, .user_free = gg_offs_free},
      1, &r));
  *out = r;
  return MOE_OK;
}

moe_status moe_grouped_mm_wgrad_dev(moe_ctx *ctx, moe_tensor *a, moe_tensor *b, moe_tensor *offs,
                                    bool trans_out, moe_tensor **out) {
  const char *fn = "grouped_mm_wgrad_dev";
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: out is NULL", fn);
  MOE_CHECK(gg_check_wgrad_operands(ctx, fn, a, b));
  int64_t groups = 0;
  MOE_CHECK(gg_check_offs_tensor(ctx, fn, offs, a->storage->device, &groups));
  gg_offs o = {offs, NULL, groups};
  bool prev = moe_grad_set(ctx, false);
  moe_status st = gg_wgrad_any(ctx, fn, a, b, &o, trans_out, out);
  moe_grad_set(ctx, prev);
  free(o.host);
  return st;
}

moe_status moe_grouped_mm_sum_dev(moe_ctx *ctx, moe_tensor *x, moe_tensor *w, moe_tensor *x2,
                                  moe_tensor *w2, moe_tensor *offs, bool trans_w, moe_tensor **out) {
  const char *fn = "grouped_mm_sum_dev";
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: out is NULL", fn);
  moe_tensor *in[4] = {x, w, x2, w2};
  const char *names[4] = {"x", "w", "x2", "w2"};
  for (int i = 0; i < 4; i++) {
    MOE_CHECK(gg_check_tensor(ctx, fn, in[i], names[i], i % 2 ? 3 : 2,
                              i % 2 ? (trans_w ? "(G, N, K)" : "(G, K, N)") : "(R, K)"));
    MOE_CHECK(gg_check_pair(ctx, fn, x, "x", in[i], names[i]));
    if (moe_grad_enabled(ctx) && moe_requires_grad(in[i]))
      return moe_error(ctx, MOE_ERR_INVALID_ARG,
                       "%s: not differentiable, and %s requires grad: run it with grad mode off, "
                       "or add two moe_grouped_mm_dev", fn, names[i]);
  }
  for (int d = 0; d < 3; d++)
    if (w2->shape[d] != w->shape[d] || (d < 2 && x2->shape[d] != x->shape[d]))
      return moe_error(ctx, MOE_ERR_SHAPE, "%s: x2 %s and w2 %s must have the shapes of x %s and w %s",
                       fn, MOE_SHAPE(x2), MOE_SHAPE(w2), MOE_SHAPE(x), MOE_SHAPE(w));
  int64_t groups = 0;
  MOE_CHECK(gg_check_offs_tensor(ctx, fn, offs, x->storage->device, &groups));
  MOE_CHECK(gg_check_mm(ctx, fn, x, w, groups, "the offsets", trans_w));
  int64_t R = x->shape[0], K = x->shape[1], N = trans_w ? w->shape[1] : w->shape[2];
  moe_device dev = x->storage->device;
  bool prev = moe_grad_set(ctx, false);
  moe_status st = MOE_ERR_NOT_SUPPORTED;
  moe_tensor *c[5] = {0}, *r = NULL, *t1 = NULL, *t2 = NULL;
  gg_offs o = {offs, NULL, groups};
  if (moe_grouped_offsets_on_device(ctx, dev, x->dtype, groups, K, N)) {
    /* one kernel: the second pair's chunks follow the first's into the same accumulators */
    st = MOE_OK;
    for (int i = 0; i < 4 && st == MOE_OK; i++) st = moe_contiguous(ctx, in[i], &c[i]);
    if (st == MOE_OK) st = moe_contiguous(ctx, offs, &c[4]);
    if (st == MOE_OK) st = moe_tensor_empty(ctx, 2, (int64_t[]){R, N}, x->dtype, dev, &r);
    moe_tensor *t[6] = {c[0], c[1], c[2], c[3], c[4], r};
    if (st == MOE_OK && gg_aligned(t, 6))
      st = moe_cuda_wg_grouped_mm2(ctx, dev.index, moe_tensor_data(c[0]), moe_tensor_data(c[1]),
                                   moe_tensor_data(c[2]), moe_tensor_data(c[3]),
                                   (const int64_t *)moe_tensor_data(c[4]), groups, R, K, N, trans_w,
                                   moe_tensor_data(r));
    else if (st == MOE_OK)
      st = MOE_ERR_NOT_SUPPORTED;
  }
  if (st == MOE_ERR_NOT_SUPPORTED) { /* two products and a sum */
    moe_tensor_release(r);
    r = NULL;
    st = gg_mm_any(ctx, fn, x, w, &o, trans_w, &t1);
    if (st == MOE_OK) st = gg_mm_any(ctx, fn, x2, w2, &o, trans_w, &t2);
    if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_ADD, t1, t2, &r);
  }
  moe_grad_set(ctx, prev);
  if (st == MOE_OK) *out = r, r = NULL;
  for (int i = 0; i < 5; i++) moe_tensor_release(c[i]);
  moe_tensor_release(r), moe_tensor_release(t1), moe_tensor_release(t2);
  free(o.host);
  return st;
}
