/*
 * matmul.c - matrix products: moe_matmul, moe_bmm, moe_linear and their
 * backward rules (the matmul family; API in moe_matmul.h, the GEMM
 * description in matmul_cuda.h, the CUDA launcher in kernels/matmul.cu).
 *
 * Every op reduces to mm_compute: out (batch..., M, N) = a (batch..., M, K)
 * @ b (batch..., K, N) [+ bias (N)], batch dims broadcast, out a new
 * contiguous tensor. mm_compute describes each operand as a BLAS matrix
 * without copying when one of its two matrix strides is 1 (a transposed
 * view becomes a transposed GEMM; anything else is copied to a contiguous
 * temporary), folds the batch dims of a into its rows when b has none (a
 * linear layer over (B, T, C) is one GEMM), merges the remaining batch dims
 * and runs strided-batched GEMMs: cblas_sgemm/dgemm per product on the CPU,
 * cuBLASLt on CUDA. CPU bf16/f16 are converted to f32, multiplied with one
 * sgemm and rounded back.
 *
 * Forward math runs with grad mode off (internal views and copies record no
 * nodes); then the op records one node whose inputs are the caller's
 * tensors and which saves them. Backward rules (g: gradient of out):
 *   matmul, bmm: da = g @ b^T, db = a^T @ g, summed over the batch dims
 *                that were broadcast (db is one GEMM over the flattened batch
 *                when b has no batch dims, as in x @ W);
 *   linear:      dx = g @ W, dW = g_flat^T @ x_flat (one GEMM over the
 *                flattened leading dims), dbias = the column sums of g_flat
 *                (on CUDA a column-sum kernel, on the CPU ones(1, R) @ g_flat).
 * Backward GEMMs run in the inputs' dtype (16-bit types accumulate in f32).
 */
#include <cblas.h>
#include <limits.h>
#include <string.h>

#include "internal.h"
#include "matmul_cuda.h"

/* ------------------------------------------------------------ settings */

static bool mm_tf32 = false; /* process-wide, see moe_matmul_set_tf32 */

bool moe_matmul_set_tf32(bool allow) {
  bool prev = mm_tf32;
  mm_tf32 = allow;
  return prev;
}

bool moe_matmul_tf32(void) { return mm_tf32; }

/* ---------------------------------------------------------- validation */

static bool mm_dtype_ok(moe_dtype dt) {
  return dt == MOE_F32 || dt == MOE_F64 || dt == MOE_BF16 || dt == MOE_F16;
}

/* t present, of a float dtype the products take. */
static moe_status mm_check_one(moe_ctx *ctx, const char *fn, const moe_tensor *t,
                               const char *what) {
  if (!t) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: %s is NULL", fn, what);
  if (!mm_dtype_ok(t->dtype))
    return moe_error(ctx, MOE_ERR_DTYPE,
                     "%s: %s has dtype %s; matrix products take f32, f64, bf16 or f16", fn,
                     what, moe_dtype_name(t->dtype));
  return MOE_OK;
}

/* b on a's device with a's dtype. */
static moe_status mm_check_pair(moe_ctx *ctx, const char *fn, const moe_tensor *a,
                                const char *an, const moe_tensor *b, const char *bn) {
  MOE_CHECK(moe_check_same_device(ctx, fn, an, a->storage->device, bn, b->storage->device));
  return moe_check_same_dtype(ctx, fn, an, a->dtype, bn, b->dtype);
}

/* The broadcast of the batch dims a[0, na) and b[0, nb) into shape (max(na,
 * nb) dims); an error names both full shapes. */
static moe_status mm_batch_shape(moe_ctx *ctx, const char *fn, const moe_tensor *a, int na,
                                 const moe_tensor *b, int nb, int64_t *shape) {
  int n = na > nb ? na : nb;
  for (int i = 0; i < n; i++) {
    int da = i - (n - na), db = i - (n - nb);
    int64_t x = da >= 0 ? a->shape[da] : 1, y = db >= 0 ? b->shape[db] : 1;
    if (x != y && x != 1 && y != 1)
      return moe_error(ctx, MOE_ERR_SHAPE,
                       "%s: the batch dims of shapes %s and %s cannot be broadcast (%lld vs %lld "
                       "in batch dim %d)",
                       fn, MOE_SHAPE(a), MOE_SHAPE(b), (long long)x, (long long)y, i);
    shape[i] = x == 1 ? y : x;
  }
  return MOE_OK;
}

/* ---------------------------------------------------------- BLAS layout */

/* Describes a (rows, cols) matrix with element strides (rs, cs) for BLAS:
 * row-major (unit column stride, ld = rs; *trans false) or the transpose of
 * a row-major (cols, rows) matrix (unit row stride, ld = cs; *trans true).
 * The stride of a size-1 dim does not matter. False when neither fits. */
static bool mm_layout(int64_t rows, int64_t cols, int64_t rs, int64_t cs, bool *trans,
                      int64_t *ld) {
  int64_t rmin = rows > 1 ? rows : 1, cmin = cols > 1 ? cols : 1;
  if (cs == 1 || cols == 1) {
    int64_t l = rows == 1 ? cmin : rs;
    if (l >= cmin) {
      *trans = false;
      *ld = l;
      return true;
    }
  }
  if (rs == 1 || rows == 1) {
    int64_t l = cols == 1 ? rmin : cs;
    if (l >= rmin) {
      *trans = true;
      *ld = l;
      return true;
    }
  }
  return false;
}

/* Whether the batch dims and the row dim of a (..., M, K) walk memory as one
 * dim of rows: then *rows is their product and *rs its stride. */
static bool mm_fold_rows(const moe_tensor *a, int64_t *rows, int64_t *rs) {
  int na = a->ndim - 2;
  int64_t n = 1, stride = 0, extent = 0;
  bool any = false;
  for (int d = na; d >= 0; d--) {
    if (a->shape[d] == 1) continue;
    if (!any) {
      stride = a->stride[d];
      any = true;
    } else if (a->stride[d] != extent) {
      return false;
    }
    extent = a->stride[d] * a->shape[d];
    n *= a->shape[d];
  }
  *rows = n;
  *rs = stride;
  return true;
}

/* ------------------------------------------------------------ execution */

static moe_status mm_cpu_gemm(moe_ctx *ctx, const char *fn, const moe_gemm *g) {
  if (g->m > INT_MAX || g->n > INT_MAX || g->k > INT_MAX || g->lda > INT_MAX ||
      g->ldb > INT_MAX)
    return moe_error(ctx, MOE_ERR_NOT_SUPPORTED,
                     "%s: a product of (%lld x %lld) @ (%lld x %lld) exceeds the 32-bit sizes "
                     "of the CPU BLAS",
                     fn, (long long)g->m, (long long)g->k, (long long)g->k, (long long)g->n);
  size_t es = moe_dtype_size(g->dtype);
  int m = (int)g->m, n = (int)g->n, k = (int)g->k, lda = (int)g->lda, ldb = (int)g->ldb;
  enum CBLAS_TRANSPOSE ta = g->a_t ? CblasTrans : CblasNoTrans;
  enum CBLAS_TRANSPOSE tb = g->b_t ? CblasTrans : CblasNoTrans;
  for (int64_t i = 0; i < g->batch; i++) {
    const char *pa = (const char *)g->a + (size_t)(i * g->a_bs) * es;
    const char *pb = (const char *)g->b + (size_t)(i * g->b_bs) * es;
    char *pc = (char *)g->c + (size_t)(i * g->c_bs) * es;
    if (g->bias)
      for (int64_t r = 0; r < g->m; r++) memcpy(pc + (size_t)(r * g->n) * es, g->bias, (size_t)n * es);
    if (g->dtype == MOE_F32)
      cblas_sgemm(CblasRowMajor, ta, tb, m, n, k, 1.0f, (const float *)pa, lda,
                  (const float *)pb, ldb, g->bias ? 1.0f : 0.0f, (float *)pc, n);
    else
      cblas_dgemm(CblasRowMajor, ta, tb, m, n, k, 1.0, (const double *)pa, lda,
                  (const double *)pb, ldb, g->bias ? 1.0 : 0.0, (double *)pc, n);
  }
  return MOE_OK;
}

static moe_status mm_exec(moe_ctx *ctx, const char *fn, moe_device d, const moe_gemm *g) {
  if (d.type == MOE_DEVICE_CUDA) {
    return moe_cuda_gemm(ctx, d.index, g);
  }
  return mm_cpu_gemm(ctx, fn, g);
}

/* r (batch..., M, N) = a @ b (+ bias) for f32/f64 on the CPU and every dtype
 * on CUDA; r is contiguous, M, N, K >= 1. */
static moe_status mm_run(moe_ctx *ctx, const char *fn, moe_tensor *a, moe_tensor *b,
                         moe_tensor *bias, moe_tensor *r) {
  moe_tensor *ac = NULL, *bc = NULL, *biasc = NULL;
  moe_status st = MOE_OK;
  moe_device dev = r->storage->device;
  int na = a->ndim - 2, nb = b->ndim - 2, nbat = r->ndim - 2;
  size_t es = moe_dtype_size(r->dtype);
  moe_gemm g;
  memset(&g, 0, sizeof(g));
  g.dtype = r->dtype;
  g.m = r->shape[nbat];
  g.n = r->shape[nbat + 1];
  g.k = a->shape[na + 1];
  g.tf32 = mm_tf32;
  g.batch = 1;
  g.c = moe_tensor_data(r);

  if (!mm_layout(g.k, g.n, b->stride[nb], b->stride[nb + 1], &g.b_t, &g.ldb)) {
    MOE_CHECK_GOTO(moe_contiguous(ctx, b, &bc), st, done);
    b = bc;
    MOE_ASSERT(mm_layout(g.k, g.n, b->stride[nb], b->stride[nb + 1], &g.b_t, &g.ldb));
  }
  if (bias) {
    MOE_CHECK_GOTO(moe_contiguous(ctx, bias, &biasc), st, done);
    g.bias = moe_tensor_data(biasc);
  }

  /* b without batch: fold a's batch dims into its rows, one GEMM */
  int64_t bnum = 1;
  for (int d = 0; d < nb; d++) bnum *= b->shape[d];
  bool a_ok = mm_layout(g.m, g.k, a->stride[na], a->stride[na + 1], &g.a_t, &g.lda);
  if (bnum == 1) {
    int64_t rows = 0, rs = 0;
    if (!a_ok || !mm_fold_rows(a, &rows, &rs) ||
        !mm_layout(rows, g.k, rs, a->stride[na + 1], &g.a_t, &g.lda)) {
      /* neither foldable nor a per-product matrix: a contiguous copy is both */
      if (!a_ok) {
        MOE_CHECK_GOTO(moe_contiguous(ctx, a, &ac), st, done);
        a = ac;
        MOE_ASSERT(mm_fold_rows(a, &rows, &rs));
        MOE_ASSERT(mm_layout(rows, g.k, rs, a->stride[na + 1], &g.a_t, &g.lda));
      } else {
        rows = 0; /* batched below, a used in place */
        MOE_ASSERT(mm_layout(g.m, g.k, a->stride[na], a->stride[na + 1], &g.a_t, &g.lda));
      }
    }
    if (rows > 0) {
      g.m = rows;
      g.a = moe_tensor_data(a);
      g.b = moe_tensor_data(b);
      st = mm_exec(ctx, fn, dev, &g);
      goto done;
    }
  } else if (!a_ok) {
    MOE_CHECK_GOTO(moe_contiguous(ctx, a, &ac), st, done);
    a = ac;
    MOE_ASSERT(mm_layout(g.m, g.k, a->stride[na], a->stride[na + 1], &g.a_t, &g.lda));
  }

  /* batched: merge the batch dims (a and b broadcast with stride 0), the
   * innermost merged dim is a strided batch, the others are looped */
  int64_t sh[MOE_MAX_DIMS], sa[MOE_MAX_DIMS], sb[MOE_MAX_DIMS], sc[MOE_MAX_DIMS];
  int nd = 0;
  for (int i = 0; i < nbat; i++) {
    int64_t size = r->shape[i];
    if (size == 1) continue;
    int da = i - (nbat - na), db = i - (nbat - nb);
    int64_t xa = da >= 0 && a->shape[da] == size ? a->stride[da] : 0;
    int64_t xb = db >= 0 && b->shape[db] == size ? b->stride[db] : 0;
    int64_t xc = r->stride[i];
    if (nd > 0 && sa[nd - 1] == xa * size && sb[nd - 1] == xb * size && sc[nd - 1] == xc * size) {
      sh[nd - 1] *= size;
      sa[nd - 1] = xa, sb[nd - 1] = xb, sc[nd - 1] = xc;
    } else {
      sh[nd] = size, sa[nd] = xa, sb[nd] = xb, sc[nd] = xc;
      nd++;
    }
  }
  int64_t outer = 1;
  if (nd > 0) {
    g.batch = sh[nd - 1];
    g.a_bs = sa[nd - 1], g.b_bs = sb[nd - 1], g.c_bs = sc[nd - 1];
    for (int d = 0; d < nd - 1; d++) outer *= sh[d];
  }
  for (int64_t o = 0; o < outer && st == MOE_OK; o++) {
    int64_t oa = 0, ob = 0, oc = 0, rem = o;
    for (int d = nd - 2; d >= 0; d--) {
      int64_t i = rem % sh[d];
      rem /= sh[d];
      oa += i * sa[d], ob += i * sb[d], oc += i * sc[d];
    }
    g.a = (const char *)moe_tensor_data(a) + (size_t)oa * es;
    g.b = (const char *)moe_tensor_data(b) + (size_t)ob * es;
    g.c = (char *)moe_tensor_data(r) + (size_t)oc * es;
    st = mm_exec(ctx, fn, dev, &g);
  }
done:
  moe_tensor_release(ac);
  moe_tensor_release(bc);
  moe_tensor_release(biasc);
  return st;
}

static moe_status mm_compute(moe_ctx *ctx, const char *fn, moe_tensor *a, moe_tensor *b,
                             moe_tensor *bias, moe_tensor **out);

/* CPU bf16/f16: in f32 (one sgemm), rounded into r. */
static moe_status mm_cpu_half(moe_ctx *ctx, const char *fn, moe_tensor *a, moe_tensor *b,
                              moe_tensor *bias, moe_tensor *r) {
  moe_tensor *a32 = NULL, *b32 = NULL, *bias32 = NULL, *r32 = NULL;
  moe_status st;
  MOE_CHECK_GOTO(moe_to(ctx, a, MOE_F32, MOE_CPU, &a32), st, done);
  MOE_CHECK_GOTO(moe_to(ctx, b, MOE_F32, MOE_CPU, &b32), st, done);
  if (bias) MOE_CHECK_GOTO(moe_to(ctx, bias, MOE_F32, MOE_CPU, &bias32), st, done);
  MOE_CHECK_GOTO(mm_compute(ctx, fn, a32, b32, bias32, &r32), st, done);
  st = moe_copy_(ctx, r, r32);
done:
  moe_tensor_release(a32);
  moe_tensor_release(b32);
  moe_tensor_release(bias32);
  moe_tensor_release(r32);
  return st;
}

/* out (batch..., M, N) = a (.., M, K) @ b (.., K, N) (+ bias (N)): a and b
 * at least 2-D, validated by the caller (same dtype and device, matching K,
 * broadcastable batch dims). A new contiguous tensor. */
static moe_status mm_compute(moe_ctx *ctx, const char *fn, moe_tensor *a, moe_tensor *b,
                             moe_tensor *bias, moe_tensor **out) {
  int na = a->ndim - 2, nb = b->ndim - 2, nbat = na > nb ? na : nb;
  int64_t shape[MOE_MAX_DIMS];
  MOE_CHECK(mm_batch_shape(ctx, fn, a, na, b, nb, shape));
  int64_t k = a->shape[na + 1];
  shape[nbat] = a->shape[na];
  shape[nbat + 1] = b->shape[nb + 1];
  moe_device dev = a->storage->device;
  moe_tensor *r = NULL;
  MOE_CHECK(moe_tensor_empty(ctx, nbat + 2, shape, a->dtype, dev, &r));
  moe_status st = MOE_OK;
  if (moe_tensor_numel(r) == 0)
    st = MOE_OK;
  else if (k == 0) /* an empty sum: zeros, or the bias */
    st = bias ? moe_copy_(ctx, r, bias) : moe_fill_(ctx, r, 0);
  else if (dev.type == MOE_DEVICE_CPU && (r->dtype == MOE_BF16 || r->dtype == MOE_F16))
    st = mm_cpu_half(ctx, fn, a, b, bias, r);
  else
    st = mm_run(ctx, fn, a, b, bias, r);
  if (st != MOE_OK) {
    moe_tensor_release(r);
    return st;
  }
  *out = r;
  return MOE_OK;
}

/* ------------------------------------------------------------- helpers */

/* A 1-D operand as a matrix: (K) -> (1, K) with dim 0, (K, 1) with dim 1;
 * others retained as they are. */
static moe_status mm_as_matrix(moe_ctx *ctx, moe_tensor *t, int64_t dim, moe_tensor **out) {
  if (t->ndim == 1) return moe_unsqueeze(ctx, t, dim, out);
  moe_tensor_retain(t);
  *out = t;
  return MOE_OK;
}

/* full (gradient over the broadcast batch shape) summed to like's shape and
 * reshaped to the input's shape (ndim, shape). */
static moe_status mm_reduce_to(moe_ctx *ctx, moe_tensor *full, const moe_tensor *like, int ndim,
                               const int64_t *shape, moe_tensor **out) {
  moe_tensor *red = NULL;
  MOE_CHECK(moe_sum_to_shape(ctx, full, like->ndim, like->shape, &red));
  moe_status st = moe_reshape(ctx, red, ndim, shape, out);
  moe_tensor_release(red);
  return st;
}

/* --------------------------------------------------------------- matmul */

/* The shape of matmul(a, b) with 1-D operands' dims removed (validated). */
static moe_status matmul_compute(moe_ctx *ctx, moe_tensor *a, moe_tensor *b, moe_tensor **out) {
  moe_tensor *a2 = NULL, *b2 = NULL, *r = NULL;
  moe_status st;
  MOE_CHECK_GOTO(mm_as_matrix(ctx, a, 0, &a2), st, done);
  MOE_CHECK_GOTO(mm_as_matrix(ctx, b, 1, &b2), st, done);
  MOE_CHECK_GOTO(mm_compute(ctx, "matmul", a2, b2, NULL, &r), st, done);
  if (a->ndim == 1 || b->ndim == 1) {
    int64_t shape[MOE_MAX_DIMS];
    int n = 0;
    for (int d = 0; d < r->ndim; d++) {
      if (a->ndim == 1 && d == r->ndim - 2) continue;
      if (b->ndim == 1 && d == r->ndim - 1) continue;
      shape[n++] = r->shape[d];
    }
    st = moe_view(ctx, r, n, shape, out);
    moe_tensor_release(r);
  } else {
    *out = r;
  }
done:
  moe_tensor_release(a2);
  moe_tensor_release(b2);
  return st;
}

/* The backward of matmul and bmm: saved a (slot 0) and b (slot 1). */
static moe_status matmul_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                  moe_tensor **gin) {
  if (!gout[0]) return moe_node_zero_grads(ctx, n, gin);
  moe_tensor *a = NULL, *b = NULL, *a2 = NULL, *b2 = NULL, *g2 = NULL, *t = NULL, *full = NULL;
  moe_tensor *af = NULL, *gf = NULL;
  moe_status st;
  const char *fn = moe_node_name(n);
  MOE_CHECK_GOTO(moe_node_saved(ctx, n, 0, &a), st, fail);
  MOE_CHECK_GOTO(moe_node_saved(ctx, n, 1, &b), st, fail);
  MOE_CHECK_GOTO(mm_as_matrix(ctx, a, 0, &a2), st, fail);
  MOE_CHECK_GOTO(mm_as_matrix(ctx, b, 1, &b2), st, fail);
  /* g with the dims of 1-D operands put back: (batch..., M, N) */
  int na = a2->ndim - 2, nb = b2->ndim - 2, nbat = na > nb ? na : nb;
  int64_t shape[MOE_MAX_DIMS];
  MOE_CHECK_GOTO(mm_batch_shape(ctx, fn, a2, na, b2, nb, shape), st, fail);
  int64_t M = a2->shape[na], K = a2->shape[na + 1], N = b2->shape[nb + 1];
  shape[nbat] = M;
  shape[nbat + 1] = N;
  MOE_CHECK_GOTO(moe_reshape(ctx, gout[0], nbat + 2, shape, &g2), st, fail);

  if (moe_node_needs_grad(n, 0)) { /* da = g @ b^T */
    MOE_CHECK_GOTO(moe_transpose(ctx, b2, -1, -2, &t), st, fail);
    MOE_CHECK_GOTO(mm_compute(ctx, fn, g2, t, NULL, &full), st, fail);
    MOE_CHECK_GOTO(mm_reduce_to(ctx, full, a2, a->ndim, a->shape, &gin[0]), st, fail);
    moe_tensor_release(t);
    moe_tensor_release(full);
    t = full = NULL;
  }
  if (moe_node_needs_grad(n, 1)) { /* db = a^T @ g */
    int64_t bnum = 1, abat = 1, gbat = 1;
    for (int d = 0; d < nb; d++) bnum *= b2->shape[d];
    for (int d = 0; d < na; d++) abat *= a2->shape[d];
    for (int d = 0; d < nbat; d++) gbat *= shape[d];
    if (bnum == 1 && abat == gbat) {
      /* b shared by every product: one GEMM over the flattened batch */
      int64_t R = abat * M;
      MOE_CHECK_GOTO(moe_reshape(ctx, a2, 2, (int64_t[]){R, K}, &af), st, fail);
      MOE_CHECK_GOTO(moe_reshape(ctx, g2, 2, (int64_t[]){R, N}, &gf), st, fail);
      MOE_CHECK_GOTO(moe_transpose(ctx, af, 0, 1, &t), st, fail);
      MOE_CHECK_GOTO(mm_compute(ctx, fn, t, gf, NULL, &full), st, fail);
      MOE_CHECK_GOTO(moe_reshape(ctx, full, b->ndim, b->shape, &gin[1]), st, fail);
    } else {
      MOE_CHECK_GOTO(moe_transpose(ctx, a2, -1, -2, &t), st, fail);
      MOE_CHECK_GOTO(mm_compute(ctx, fn, t, g2, NULL, &full), st, fail);
      MOE_CHECK_GOTO(mm_reduce_to(ctx, full, b2, b->ndim, b->shape, &gin[1]), st, fail);
    }
  }
  st = MOE_OK;
  goto done;
fail:
  for (int i = 0; i < 2; i++) {
    moe_tensor_release(gin[i]);
    gin[i] = NULL;
  }
done:
  moe_tensor_release(a);
  moe_tensor_release(b);
  moe_tensor_release(a2);
  moe_tensor_release(b2);
  moe_tensor_release(g2);
  moe_tensor_release(t);
  moe_tensor_release(full);
  moe_tensor_release(af);
  moe_tensor_release(gf);
  return st;
}

static moe_status mm_check_args(moe_ctx *ctx, const char *fn, moe_tensor *a, moe_tensor *b,
                                moe_tensor **out) {
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: out is NULL", fn);
  MOE_CHECK(mm_check_one(ctx, fn, a, "the first operand"));
  MOE_CHECK(mm_check_one(ctx, fn, b, "the second operand"));
  MOE_CHECK(mm_check_pair(ctx, fn, a, "the first operand", b, "the second operand"));
  return moe_device_check(ctx, a->storage->device);
}

moe_status moe_matmul(moe_ctx *ctx, moe_tensor *a, moe_tensor *b, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(mm_check_args(ctx, "matmul", a, b, out));
  if (a->ndim == 0 || b->ndim == 0)
    return moe_error(ctx, MOE_ERR_SHAPE,
                     "matmul: both operands need at least 1 dim, got shapes %s and %s",
                     MOE_SHAPE(a), MOE_SHAPE(b));
  int64_t ka = a->shape[a->ndim - 1], kb = b->shape[b->ndim == 1 ? 0 : b->ndim - 2];
  if (ka != kb)
    return moe_error(ctx, MOE_ERR_SHAPE, "matmul: shapes %s and %s cannot be multiplied (%lld != %lld)",
                     MOE_SHAPE(a), MOE_SHAPE(b), (long long)ka, (long long)kb);
  int64_t bshape[MOE_MAX_DIMS];
  MOE_CHECK(mm_batch_shape(ctx, "matmul", a, a->ndim - 2, b, b->ndim - 2, bshape));
  bool prev = moe_grad_set(ctx, false);
  moe_tensor *r = NULL;
  moe_status st = matmul_compute(ctx, a, b, &r);
  moe_grad_set(ctx, prev);
  MOE_CHECK(st);
  MOE_CHECK(moe_record(ctx, &(moe_record_spec){
      .op = MOE_OP_MATMUL, .backward = matmul_backward, .n_in = 2, .in = {a, b},
      .n_save = 2, .save = {a, b}}, 1, &r));
  *out = r;
  return MOE_OK;
}

/* ------------------------------------------------------------------ bmm */

moe_status moe_bmm(moe_ctx *ctx, moe_tensor *a, moe_tensor *b, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(mm_check_args(ctx, "bmm", a, b, out));
  const char *sa = MOE_SHAPE(a), *sb = MOE_SHAPE(b);
  if (a->ndim != 3 || b->ndim != 3)
    return moe_error(ctx, MOE_ERR_SHAPE,
                     "bmm: both operands must be 3-D (B, M, K) and (B, K, N), got shapes %s and %s",
                     sa, sb);
  if (a->shape[0] != b->shape[0])
    return moe_error(ctx, MOE_ERR_SHAPE,
                     "bmm: shapes %s and %s have different batch sizes (%lld != %lld)", sa, sb,
                     (long long)a->shape[0], (long long)b->shape[0]);
  if (a->shape[2] != b->shape[1])
    return moe_error(ctx, MOE_ERR_SHAPE, "bmm: shapes %s and %s cannot be multiplied (%lld != %lld)",
                     sa, sb, (long long)a->shape[2], (long long)b->shape[1]);
  bool prev = moe_grad_set(ctx, false);
  moe_tensor *r = NULL;
  moe_status st = mm_compute(ctx, "bmm", a, b, NULL, &r);
  moe_grad_set(ctx, prev);
  MOE_CHECK(st);
  MOE_CHECK(moe_record(ctx, &(moe_record_spec){
      .op = MOE_OP_BMM, .backward = matmul_backward, .n_in = 2, .in = {a, b},
      .n_save = 2, .save = {a, b}}, 1, &r));
  *out = r;
  return MOE_OK;
}

/* --------------------------------------------------------------- linear */

/* dbias (N) = the sums over rows of gf (R, N): on CUDA one column-sum
 * kernel pass over gf (read once, at memory speed), on the CPU the GEMM
 * ones(1, R) @ gf. */
static moe_status linear_bias_grad(moe_ctx *ctx, moe_tensor *gf, moe_tensor **out) {
  int64_t R = gf->shape[0], N = gf->shape[1];
  moe_device dev = gf->storage->device;
  moe_tensor *ones = NULL, *r = NULL, *gc = NULL;
  moe_status st = MOE_OK;
  if (dev.type == MOE_DEVICE_CUDA && R > 0 && N > 0) {
    /* the kernel reads rows of unit column stride at least N apart (an
     * expanded gradient, row stride 0, is not): others take a contiguous copy */
    if ((N > 1 && gf->stride[1] != 1) || (R > 1 && gf->stride[0] < N)) {
      MOE_CHECK(moe_contiguous(ctx, gf, &gc));
      gf = gc;
    }
    int64_t ld = R > 1 ? gf->stride[0] : N;
    MOE_CHECK_GOTO(moe_tensor_empty(ctx, 1, &N, gf->dtype, dev, &r), st, done);
    st = moe_cuda_colsum(ctx, dev.index, gf->dtype, moe_tensor_data(gf), R, N, ld,
                         moe_tensor_data(r));
    if (st != MOE_OK) goto done;
    *out = r;
    r = NULL;
    goto done;
  }
  MOE_CHECK_GOTO(moe_tensor_full(ctx, 2, (int64_t[]){1, R}, 1.0, gf->dtype, dev, &ones), st,
                 done);
  MOE_CHECK_GOTO(mm_compute(ctx, "linear", ones, gf, NULL, &r), st, done);
  st = moe_reshape(ctx, r, 1, &N, out);
done:
  moe_tensor_release(ones);
  moe_tensor_release(r);
  moe_tensor_release(gc);
  return st;
}

/* saved x (slot 0), W (slot 1); inputs x, W, bias (when given). */
static moe_status linear_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                  moe_tensor **gin) {
  if (!gout[0]) return moe_node_zero_grads(ctx, n, gin);
  moe_tensor *x = NULL, *w = NULL, *g2 = NULL, *gf = NULL, *xf = NULL, *t = NULL, *r = NULL;
  moe_status st;
  MOE_CHECK_GOTO(moe_node_saved(ctx, n, 0, &x), st, fail);
  MOE_CHECK_GOTO(moe_node_saved(ctx, n, 1, &w), st, fail);
  int64_t out_f = w->shape[0], in_f = w->shape[1], R = 1;
  for (int d = 0; d < x->ndim - 1; d++) R *= x->shape[d];
  MOE_CHECK_GOTO(moe_reshape(ctx, gout[0], 2, (int64_t[]){R, out_f}, &gf), st, fail);
  if (moe_node_needs_grad(n, 0)) { /* dx = g @ W */
    MOE_CHECK_GOTO(mm_as_matrix(ctx, gout[0], 0, &g2), st, fail);
    MOE_CHECK_GOTO(mm_compute(ctx, "linear", g2, w, NULL, &r), st, fail);
    MOE_CHECK_GOTO(moe_reshape(ctx, r, x->ndim, x->shape, &gin[0]), st, fail);
    moe_tensor_release(r);
    r = NULL;
  }
  if (moe_node_needs_grad(n, 1)) { /* dW = g_flat^T @ x_flat */
    MOE_CHECK_GOTO(moe_reshape(ctx, x, 2, (int64_t[]){R, in_f}, &xf), st, fail);
    MOE_CHECK_GOTO(moe_transpose(ctx, gf, 0, 1, &t), st, fail);
    MOE_CHECK_GOTO(mm_compute(ctx, "linear", t, xf, NULL, &gin[1]), st, fail);
  }
  if (n->n_inputs > 2 && moe_node_needs_grad(n, 2)) /* dbias: the column sums of g_flat */
    MOE_CHECK_GOTO(linear_bias_grad(ctx, gf, &gin[2]), st, fail);
  st = MOE_OK;
  goto done;
fail:
  for (int i = 0; i < n->n_inputs; i++) {
    moe_tensor_release(gin[i]);
    gin[i] = NULL;
  }
done:
  moe_tensor_release(x);
  moe_tensor_release(w);
  moe_tensor_release(g2);
  moe_tensor_release(gf);
  moe_tensor_release(xf);
  moe_tensor_release(t);
  moe_tensor_release(r);
  return st;
}

static moe_status linear_compute(moe_ctx *ctx, moe_tensor *x, moe_tensor *w, moe_tensor *bias,
                                 moe_tensor **out) {
  moe_tensor *x2 = NULL, *wt = NULL, *r = NULL;
  moe_status st;
  MOE_CHECK_GOTO(mm_as_matrix(ctx, x, 0, &x2), st, done);
  MOE_CHECK_GOTO(moe_transpose(ctx, w, 0, 1, &wt), st, done);
  MOE_CHECK_GOTO(mm_compute(ctx, "linear", x2, wt, bias, &r), st, done);
  if (x->ndim == 1) {
    st = moe_view(ctx, r, 1, &w->shape[0], out);
    moe_tensor_release(r);
  } else {
    *out = r;
  }
done:
  moe_tensor_release(x2);
  moe_tensor_release(wt);
  return st;
}

moe_status moe_linear(moe_ctx *ctx, moe_tensor *x, moe_tensor *w, moe_tensor *bias,
                      moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  const char *fn = "linear";
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "linear: out is NULL");
  MOE_CHECK(mm_check_one(ctx, fn, x, "the input"));
  MOE_CHECK(mm_check_one(ctx, fn, w, "the weight"));
  MOE_CHECK(mm_check_pair(ctx, fn, x, "the input", w, "the weight"));
  if (bias) {
    MOE_CHECK(mm_check_one(ctx, fn, bias, "the bias"));
    MOE_CHECK(mm_check_pair(ctx, fn, x, "the input", bias, "the bias"));
  }
  MOE_CHECK(moe_device_check(ctx, x->storage->device));
  const char *sx = MOE_SHAPE(x), *sw = MOE_SHAPE(w);
  if (w->ndim != 2)
    return moe_error(ctx, MOE_ERR_SHAPE, "linear: the weight must be 2-D (out, in), got shape %s",
                     sw);
  if (x->ndim == 0)
    return moe_error(ctx, MOE_ERR_SHAPE, "linear: the input must have at least 1 dim, got shape %s",
                     sx);
  if (x->shape[x->ndim - 1] != w->shape[1])
    return moe_error(ctx, MOE_ERR_SHAPE,
                     "linear: input %s and weight %s cannot be multiplied (in features %lld != %lld)",
                     sx, sw, (long long)x->shape[x->ndim - 1], (long long)w->shape[1]);
  if (bias && (bias->ndim != 1 || bias->shape[0] != w->shape[0]))
    return moe_error(ctx, MOE_ERR_SHAPE,
                     "linear: bias of shape %s does not fit weight %s (wanted [%lld])",
                     MOE_SHAPE(bias), sw,
                     (long long)w->shape[0]);
  bool prev = moe_grad_set(ctx, false);
  moe_tensor *r = NULL;
  moe_status st = linear_compute(ctx, x, w, bias, &r);
  moe_grad_set(ctx, prev);
  MOE_CHECK(st);
  MOE_CHECK(moe_record(ctx, &(moe_record_spec){
      .op = MOE_OP_LINEAR, .backward = linear_backward, .n_in = bias ? 3 : 2,
      .in = {x, w, bias}, .n_save = 2, .save = {x, w}}, 1, &r));
  *out = r;
  return MOE_OK;
}
