/*
 * test_matmul.c - matmul, bmm and linear on the CPU: values against hand
 * computed products and a naive triple loop in double (every 1-D case of
 * matmul, broadcast batch dims, transposed / narrowed / strided / expanded
 * operands that take the no-copy and the copy paths, bf16/f16 through f32,
 * empty sizes), the autograd node, finite-difference gradient checks in f64
 * on contiguous and non-contiguous inputs, and every error path.
 */
#include "gradcheck.h"
#include "harness.h"

#define SHAPE(...) (sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (int64_t[]){__VA_ARGS__}

/* ------------------------------------------------------------ helpers */

static moe_tensor *vals(moe_ctx *ctx, moe_dtype dt, int ndim, const int64_t *shape,
                        const double *v) {
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, v, ndim, shape, dt, MOE_CPU, &t));
  return t;
}

static moe_tensor *rnd(moe_ctx *ctx, moe_dtype dt, int ndim, const int64_t *shape) {
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, ndim, shape, dt, MOE_CPU, &t));
  EXPECT_OK(moe_uniform_(ctx, t, -1, 1));
  return t;
}

static moe_tensor *leaf(moe_ctx *ctx, int ndim, const int64_t *shape) {
  moe_tensor *t = rnd(ctx, MOE_F64, ndim, shape);
  EXPECT_OK(moe_set_requires_grad(ctx, t, true));
  return t;
}

/* A non-contiguous f64 leaf of shape (at least 2-D): a random tensor with
 * the last two dims swapped and two extra rows, narrowed, then transposed. */
static moe_tensor *leaf_t(moe_ctx *ctx, int ndim, const int64_t *shape) {
  int64_t s[MOE_MAX_DIMS];
  for (int d = 0; d < ndim; d++) s[d] = shape[d];
  s[ndim - 2] = shape[ndim - 1] + 2;
  s[ndim - 1] = shape[ndim - 2];
  moe_tensor *base = rnd(ctx, MOE_F64, ndim, s), *n = NULL, *v = NULL;
  EXPECT_OK(moe_narrow(ctx, base, ndim - 2, 1, shape[ndim - 1], &n));
  EXPECT_OK(moe_transpose(ctx, n, -1, -2, &v));
  EXPECT(v && !moe_tensor_is_contiguous(v));
  EXPECT_OK(moe_set_requires_grad(ctx, v, true));
  moe_tensor_release(n);
  moe_tensor_release(base);
  return v;
}

/* A 1-D non-contiguous f64 leaf of n elements (every second one). */
static moe_tensor *leaf_strided1(moe_ctx *ctx, int64_t n) {
  moe_tensor *base = rnd(ctx, MOE_F64, SHAPE(2 * n)), *v = NULL;
  EXPECT_OK(moe_slice(ctx, base, 0, 0, 2 * n, 2, &v));
  EXPECT_OK(moe_set_requires_grad(ctx, v, true));
  moe_tensor_release(base);
  return v;
}

static double *host(moe_ctx *ctx, const moe_tensor *t) {
  int64_t n = moe_tensor_numel(t);
  double *v = (double *)malloc(sizeof(double) * (size_t)(n ? n : 1));
  EXPECT_OK(moe_tensor_to_f64(ctx, t, v));
  return v;
}

static bool same_shape(const moe_tensor *t, int ndim, const int64_t *shape) {
  if (!t || t->ndim != ndim) return false;
  for (int d = 0; d < ndim; d++)
    if (t->shape[d] != shape[d]) return false;
  return true;
}

/* The naive product of a (.., M, K) and b (.., K, N) (both at least 2-D,
 * batch dims broadcast) in double, in row-major order of the result; the
 * result's shape goes to rshape/rndim. */
static double *naive_mm(moe_ctx *ctx, const moe_tensor *a, const moe_tensor *b, int *rndim,
                        int64_t *rshape) {
  int na = a->ndim - 2, nb = b->ndim - 2, nbat = na > nb ? na : nb;
  int64_t M = a->shape[na], K = a->shape[na + 1], N = b->shape[nb + 1], batch = 1;
  for (int i = 0; i < nbat; i++) {
    int da = i - (nbat - na), db = i - (nbat - nb);
    int64_t x = da >= 0 ? a->shape[da] : 1, y = db >= 0 ? b->shape[db] : 1;
    rshape[i] = x == 1 ? y : x;
    batch *= rshape[i];
  }
  rshape[nbat] = M;
  rshape[nbat + 1] = N;
  *rndim = nbat + 2;
  double *va = host(ctx, a), *vb = host(ctx, b);
  double *r = (double *)calloc((size_t)(batch * M * N + 1), sizeof(double));
  for (int64_t bi = 0; bi < batch; bi++) {
    int64_t rem = bi, ia = 0, ib = 0, sa = 1, sb = 1;
    for (int i = nbat - 1; i >= 0; i--) {
      int64_t idx = rem % rshape[i];
      rem /= rshape[i];
      int da = i - (nbat - na), db = i - (nbat - nb);
      if (da >= 0) {
        ia += (a->shape[da] == 1 ? 0 : idx) * sa;
        sa *= a->shape[da];
      }
      if (db >= 0) {
        ib += (b->shape[db] == 1 ? 0 : idx) * sb;
        sb *= b->shape[db];
      }
    }
    for (int64_t i = 0; i < M; i++)
      for (int64_t j = 0; j < N; j++) {
        double s = 0;
        for (int64_t k = 0; k < K; k++)
          s += va[(ia * M + i) * K + k] * vb[(ib * K + k) * N + j];
        r[(bi * M + i) * N + j] = s;
      }
  }
  free(va);
  free(vb);
  return r;
}

/* matmul(a, b) (a, b at least 2-D) equals the naive product within tol. */
static void check_matmul(moe_ctx *ctx, moe_tensor *a, moe_tensor *b, double tol, int line) {
  moe_tensor *r = NULL;
  harness_checks++;
  if (moe_matmul(ctx, a, b, &r) != MOE_OK) {
    harness_failures++;
    fprintf(stderr, "line %d: matmul failed: %s\n", line, moe_ctx_error(ctx));
    return;
  }
  int nd;
  int64_t shape[MOE_MAX_DIMS];
  double *want = naive_mm(ctx, a, b, &nd, shape);
  EXPECT(same_shape(r, nd, shape));
  EXPECT(moe_tensor_is_contiguous(r));
  EXPECT(r->dtype == a->dtype);
  harness_checks++;
  if (!harness_values(r, want, moe_tensor_numel(r), tol, __FILE__, line)) harness_failures++;
  free(want);
  moe_tensor_release(r);
}

/* ------------------------------------------------------------- values */

static void test_matmul_2d_values(moe_ctx *ctx) {
  /* [[1, 2, 3], [4, 5, 6]] @ [[7, 8], [9, 10], [11, 12]] = [[58, 64], [139, 154]] */
  const moe_dtype dts[] = {MOE_F32, MOE_F64, MOE_BF16, MOE_F16};
  for (int i = 0; i < 4; i++) {
    moe_tensor *a = vals(ctx, dts[i], SHAPE(2, 3), (double[]){1, 2, 3, 4, 5, 6});
    moe_tensor *b = vals(ctx, dts[i], SHAPE(3, 2), (double[]){7, 8, 9, 10, 11, 12});
    moe_tensor *r = NULL;
    EXPECT_OK(moe_matmul(ctx, a, b, &r));
    EXPECT(same_shape(r, SHAPE(2, 2)) && r->dtype == dts[i]);
    EXPECT_VALUES(r, 0, 58, 64, 139, 154); /* exact in every dtype (integers < 256) */
    moe_tensor_release(r);
    moe_tensor_release(a);
    moe_tensor_release(b);
  }
}

static void test_matmul_1d_cases(moe_ctx *ctx) {
  moe_tensor *v = vals(ctx, MOE_F64, SHAPE(3), (double[]){1, 2, 3});
  moe_tensor *w = vals(ctx, MOE_F64, SHAPE(3), (double[]){4, 5, 6});
  moe_tensor *m = vals(ctx, MOE_F64, SHAPE(2, 3), (double[]){1, 0, -1, 2, 1, 0});
  moe_tensor *mt = vals(ctx, MOE_F64, SHAPE(3, 2), (double[]){1, 2, 0, 1, -1, 0});
  moe_tensor *bm = vals(ctx, MOE_F64, SHAPE(2, 2, 3), (double[]){1, 0, -1, 2, 1, 0, 0, 1, 1, 3, 0, 1});
  moe_tensor *r = NULL;
  EXPECT_OK(moe_matmul(ctx, v, w, &r)); /* dot: 4 + 10 + 18 */
  EXPECT(r && r->ndim == 0);
  EXPECT_VALUES(r, 0, 32);
  moe_tensor_release(r);
  EXPECT_OK(moe_matmul(ctx, m, v, &r)); /* (2, 3) @ (3) */
  EXPECT(same_shape(r, SHAPE(2)));
  EXPECT_VALUES(r, 0, -2, 4);
  moe_tensor_release(r);
  EXPECT_OK(moe_matmul(ctx, v, mt, &r)); /* (3) @ (3, 2) */
  EXPECT(same_shape(r, SHAPE(2)));
  EXPECT_VALUES(r, 0, -2, 4);
  moe_tensor_release(r);
  EXPECT_OK(moe_matmul(ctx, bm, v, &r)); /* (2, 2, 3) @ (3) -> (2, 2) */
  EXPECT(same_shape(r, SHAPE(2, 2)));
  EXPECT_VALUES(r, 0, -2, 4, 5, 6);
  moe_tensor_release(r);
  moe_tensor *bmt = NULL;
  EXPECT_OK(moe_transpose(ctx, bm, 1, 2, &bmt)); /* (2, 3, 2) */
  EXPECT_OK(moe_matmul(ctx, v, bmt, &r));        /* (3) @ (2, 3, 2) -> (2, 2) */
  EXPECT(same_shape(r, SHAPE(2, 2)));
  EXPECT_VALUES(r, 0, -2, 4, 5, 6);
  moe_tensor_release(r);
  moe_tensor_release(bmt);
  moe_tensor_release(v);
  moe_tensor_release(w);
  moe_tensor_release(m);
  moe_tensor_release(mt);
  moe_tensor_release(bm);
}

static void test_matmul_broadcast(moe_ctx *ctx) {
  moe_tensor *a = rnd(ctx, MOE_F64, SHAPE(2, 1, 3, 4)), *b = rnd(ctx, MOE_F64, SHAPE(5, 4, 2));
  check_matmul(ctx, a, b, 1e-12, __LINE__); /* both broadcast: (2, 5, 3, 2) */
  moe_tensor *c = rnd(ctx, MOE_F64, SHAPE(3, 4)), *d = rnd(ctx, MOE_F64, SHAPE(2, 3, 4, 5));
  check_matmul(ctx, c, d, 1e-12, __LINE__); /* a matrix against b's batch */
  moe_tensor *e = rnd(ctx, MOE_F64, SHAPE(5, 6));
  check_matmul(ctx, d, e, 1e-12, __LINE__); /* b without batch: folded into one GEMM */
  moe_tensor *f = rnd(ctx, MOE_F64, SHAPE(1, 3, 4)), *h = rnd(ctx, MOE_F64, SHAPE(2, 4, 5));
  check_matmul(ctx, f, h, 1e-12, __LINE__); /* size-1 batch dim */
  moe_tensor *k = rnd(ctx, MOE_F64, SHAPE(1, 1, 5, 6));
  check_matmul(ctx, d, k, 1e-12, __LINE__); /* b's batch dims all 1: folded too */
  moe_tensor *ff = rnd(ctx, MOE_F32, SHAPE(3, 1, 7, 9)), *hf = rnd(ctx, MOE_F32, SHAPE(4, 9, 5));
  check_matmul(ctx, ff, hf, 1e-5, __LINE__); /* f32: 9-term sums of values in [-1, 1] */
  moe_tensor *ts[] = {a, b, c, d, e, f, h, k, ff, hf};
  for (int i = 0; i < 10; i++) moe_tensor_release(ts[i]);
}

/* Operands that BLAS takes in place (transposed, narrowed, expanded batch)
 * and ones that need a copy (stride 2 in both matrix dims). */
static void test_matmul_strided(moe_ctx *ctx) {
  const moe_dtype dts[] = {MOE_F64, MOE_F32, MOE_BF16};
  const double tols[] = {1e-12, 1e-5, 0}; /* bf16: see below */
  for (int t = 0; t < 3; t++) {
    moe_dtype dt = dts[t];
    /* bf16 results are rounded to 8 bits: |r| <= 8 here, so 8 * 2^-8 */
    double tol = dt == MOE_BF16 ? 8.0 / 256 : tols[t];
    moe_tensor *base = rnd(ctx, dt, SHAPE(8, 6)), *base2 = rnd(ctx, dt, SHAPE(6, 8));
    moe_tensor *at = NULL, *bt = NULL, *an = NULL, *as = NULL, *tmp = NULL, *bs = NULL;
    EXPECT_OK(moe_transpose(ctx, base, 0, 1, &at));       /* (6, 8), unit row stride */
    EXPECT_OK(moe_transpose(ctx, base2, 0, 1, &bt));      /* (8, 6) */
    check_matmul(ctx, at, base, tol, __LINE__);            /* T @ N */
    check_matmul(ctx, base, at, tol, __LINE__);            /* N @ T */
    check_matmul(ctx, at, bt, tol, __LINE__);              /* T @ T */
    EXPECT_OK(moe_narrow(ctx, base, 1, 1, 4, &an));        /* (8, 4), ld 6 */
    EXPECT_OK(moe_narrow(ctx, base2, 0, 2, 4, &tmp));      /* (4, 8), ld 8 */
    check_matmul(ctx, an, tmp, tol, __LINE__);
    moe_tensor_release(tmp);
    EXPECT_OK(moe_slice(ctx, base, 0, 0, 8, 2, &tmp));     /* (4, 6) rows stride 12 */
    EXPECT_OK(moe_slice(ctx, tmp, 1, 0, 6, 2, &as));       /* (4, 3), strides (12, 2): copied */
    moe_tensor_release(tmp);
    EXPECT_OK(moe_slice(ctx, base2, 1, 1, 8, 2, &bs));     /* (6, 4), strides (8, 2) */
    EXPECT_OK(moe_narrow(ctx, bs, 0, 0, 3, &tmp));         /* (3, 4): copied */
    check_matmul(ctx, as, tmp, tol, __LINE__);
    moe_tensor_release(tmp);
    /* a transposed batched a against an expanded b (batch stride 0) */
    moe_tensor *e = NULL, *bb = rnd(ctx, dt, SHAPE(3, 8, 5));
    EXPECT_OK(moe_expand(ctx, base, SHAPE(3, 8, 6), &tmp));
    EXPECT_OK(moe_transpose(ctx, bb, 1, 2, &e)); /* (3, 5, 8) */
    check_matmul(ctx, e, tmp, tol, __LINE__);
    moe_tensor_release(tmp);
    moe_tensor_release(e);
    moe_tensor_release(bb);
    /* batch dims that do not fold into rows: (T, B, K) -> (B, T, K) */
    moe_tensor *x = rnd(ctx, dt, SHAPE(4, 3, 6)), *xt = NULL;
    EXPECT_OK(moe_transpose(ctx, x, 0, 1, &xt));
    check_matmul(ctx, xt, base2, tol, __LINE__);
    moe_tensor_release(xt);
    /* batch dims that fold into transposed rows: (K, B, M) -> (B, M, K) */
    EXPECT_OK(moe_permute(ctx, x, 3, (int64_t[]){1, 2, 0}, &xt)); /* (3, 6, 4) */
    moe_tensor *w = rnd(ctx, dt, SHAPE(4, 5));
    check_matmul(ctx, xt, w, tol, __LINE__);
    moe_tensor_release(xt);
    moe_tensor_release(x);
    moe_tensor_release(w);
    /* sizes 1 */
    moe_tensor *r1 = rnd(ctx, dt, SHAPE(1, 1)), *r2 = rnd(ctx, dt, SHAPE(1, 7)), *r3 = rnd(ctx, dt, SHAPE(7, 1));
    check_matmul(ctx, r1, r1, tol, __LINE__);
    check_matmul(ctx, r2, r3, tol, __LINE__);
    check_matmul(ctx, r3, r2, tol, __LINE__);
    moe_tensor_release(r1);
    moe_tensor_release(r2);
    moe_tensor_release(r3);
    moe_tensor_release(base);
    moe_tensor_release(base2);
    moe_tensor_release(at);
    moe_tensor_release(bt);
    moe_tensor_release(an);
    moe_tensor_release(as);
    moe_tensor_release(bs);
  }
}

/* bf16 and f16 (through f32 on the CPU) against the naive product of the
 * rounded inputs: the result is rounded once, so the error is half an ulp
 * of the output (|r| <= K = 9 here: bf16 9 * 2^-9, f16 9 * 2^-12). */
static void test_matmul_half(moe_ctx *ctx) {
  moe_tensor *a = rnd(ctx, MOE_BF16, SHAPE(2, 5, 9)), *b = rnd(ctx, MOE_BF16, SHAPE(9, 3));
  check_matmul(ctx, a, b, 9.0 / 512, __LINE__);
  moe_tensor *c = rnd(ctx, MOE_F16, SHAPE(2, 5, 9)), *d = rnd(ctx, MOE_F16, SHAPE(2, 9, 3));
  check_matmul(ctx, c, d, 9.0 / 4096, __LINE__);
  moe_tensor_release(a);
  moe_tensor_release(b);
  moe_tensor_release(c);
  moe_tensor_release(d);
}

static void test_matmul_empty(moe_ctx *ctx) {
  moe_tensor *a = NULL, *b = NULL, *c = NULL, *r = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, SHAPE(2, 0), MOE_F32, MOE_CPU, &a));
  EXPECT_OK(moe_tensor_empty(ctx, SHAPE(0, 3), MOE_F32, MOE_CPU, &b));
  EXPECT_OK(moe_matmul(ctx, a, b, &r)); /* K = 0: an empty sum, zeros */
  EXPECT(same_shape(r, SHAPE(2, 3)));
  EXPECT_VALUES(r, 0, 0, 0, 0, 0, 0, 0);
  moe_tensor_release(r);
  c = rnd(ctx, MOE_F32, SHAPE(3, 4));
  EXPECT_OK(moe_matmul(ctx, b, c, &r));
  EXPECT(same_shape(r, SHAPE(0, 4))); /* M = 0 */
  moe_tensor_release(r);
  moe_tensor *e = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, SHAPE(0, 3, 3), MOE_F32, MOE_CPU, &e));
  EXPECT_OK(moe_matmul(ctx, e, c, &r)); /* batch 0 */
  EXPECT(same_shape(r, SHAPE(0, 3, 4)));
  moe_tensor_release(r);
  moe_tensor_release(e);
  moe_tensor_release(a);
  moe_tensor_release(b);
  moe_tensor_release(c);
}

static void test_bmm_values(moe_ctx *ctx) {
  moe_tensor *a = vals(ctx, MOE_F32, SHAPE(2, 1, 2), (double[]){1, 2, 3, 4});
  moe_tensor *b = vals(ctx, MOE_F32, SHAPE(2, 2, 1), (double[]){5, 6, 7, 8});
  moe_tensor *r = NULL;
  EXPECT_OK(moe_bmm(ctx, a, b, &r)); /* [1*5 + 2*6], [3*7 + 4*8] */
  EXPECT(same_shape(r, SHAPE(2, 1, 1)));
  EXPECT_VALUES(r, 0, 17, 53);
  moe_tensor_release(r);
  moe_tensor *x = rnd(ctx, MOE_F64, SHAPE(3, 7, 5)), *y = rnd(ctx, MOE_F64, SHAPE(3, 4, 7));
  moe_tensor *xt = NULL, *yt = NULL;
  EXPECT_OK(moe_transpose(ctx, x, 1, 2, &xt)); /* (3, 5, 7) */
  EXPECT_OK(moe_transpose(ctx, y, 1, 2, &yt)); /* (3, 7, 4) */
  EXPECT_OK(moe_bmm(ctx, xt, yt, &r));
  int nd;
  int64_t shape[MOE_MAX_DIMS];
  double *want = naive_mm(ctx, xt, yt, &nd, shape);
  EXPECT(same_shape(r, SHAPE(3, 5, 4)));
  harness_checks++;
  if (!harness_values(r, want, 60, 1e-12, __FILE__, __LINE__)) harness_failures++;
  free(want);
  moe_tensor_release(r);
  moe_tensor *ts[] = {a, b, x, y, xt, yt};
  for (int i = 0; i < 6; i++) moe_tensor_release(ts[i]);
}

static void test_linear_values(moe_ctx *ctx) {
  /* x [[1, 2, 3], [4, 5, 6]], W [[1, 0, -1], [2, 1, 0]], b [10, 20]:
   * x W^T = [[-2, 4], [-2, 13]], + b = [[8, 24], [8, 33]] */
  const moe_dtype dts[] = {MOE_F32, MOE_F64, MOE_BF16};
  for (int i = 0; i < 3; i++) {
    moe_tensor *x = vals(ctx, dts[i], SHAPE(2, 3), (double[]){1, 2, 3, 4, 5, 6});
    moe_tensor *w = vals(ctx, dts[i], SHAPE(2, 3), (double[]){1, 0, -1, 2, 1, 0});
    moe_tensor *b = vals(ctx, dts[i], SHAPE(2), (double[]){10, 20});
    moe_tensor *r = NULL, *x1 = NULL;
    EXPECT_OK(moe_linear(ctx, x, w, b, &r));
    EXPECT(same_shape(r, SHAPE(2, 2)) && r->dtype == dts[i]);
    EXPECT_VALUES(r, 0, 8, 24, 8, 33);
    moe_tensor_release(r);
    EXPECT_OK(moe_linear(ctx, x, w, NULL, &r));
    EXPECT_VALUES(r, 0, -2, 4, -2, 13);
    moe_tensor_release(r);
    EXPECT_OK(moe_select(ctx, x, 0, 1, &x1)); /* x (3) -> (2) */
    EXPECT_OK(moe_linear(ctx, x1, w, b, &r));
    EXPECT(same_shape(r, SHAPE(2)));
    EXPECT_VALUES(r, 0, 8, 33);
    moe_tensor_release(r);
    moe_tensor_release(x1);
    moe_tensor_release(x);
    moe_tensor_release(w);
    moe_tensor_release(b);
  }
  /* 3-D and non-contiguous x against matmul(x, W^T) + b */
  moe_tensor *x = rnd(ctx, MOE_F64, SHAPE(5, 2, 6)), *xt = NULL, *w = rnd(ctx, MOE_F64, SHAPE(4, 6));
  moe_tensor *b = rnd(ctx, MOE_F64, SHAPE(4)), *wt = NULL, *r = NULL;
  EXPECT_OK(moe_transpose(ctx, x, 0, 1, &xt)); /* (2, 5, 6) */
  EXPECT_OK(moe_transpose(ctx, w, 0, 1, &wt));
  EXPECT_OK(moe_linear(ctx, xt, w, b, &r));
  EXPECT(same_shape(r, SHAPE(2, 5, 4)));
  int nd;
  int64_t shape[MOE_MAX_DIMS];
  double *want = naive_mm(ctx, xt, wt, &nd, shape), *bv = host(ctx, b);
  for (int i = 0; i < 40; i++) want[i] += bv[i % 4];
  harness_checks++;
  if (!harness_values(r, want, 40, 1e-12, __FILE__, __LINE__)) harness_failures++;
  free(want);
  free(bv);
  moe_tensor_release(r);
  /* in features 0: the bias alone */
  moe_tensor *x0 = NULL, *w0 = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, SHAPE(3, 0), MOE_F64, MOE_CPU, &x0));
  EXPECT_OK(moe_tensor_empty(ctx, SHAPE(4, 0), MOE_F64, MOE_CPU, &w0));
  EXPECT_OK(moe_linear(ctx, x0, w0, b, &r));
  EXPECT(same_shape(r, SHAPE(3, 4)));
  bv = host(ctx, b);
  EXPECT_VALUES(r, 0, bv[0], bv[1], bv[2], bv[3], bv[0], bv[1], bv[2], bv[3], bv[0], bv[1], bv[2], bv[3]);
  free(bv);
  moe_tensor_release(r);
  moe_tensor *ts[] = {x, xt, w, b, wt, x0, w0};
  for (int i = 0; i < 7; i++) moe_tensor_release(ts[i]);
}

/* --------------------------------------------------------------- autograd */

static void test_autograd_node(moe_ctx *ctx) {
  moe_tensor *a = leaf(ctx, SHAPE(2, 3)), *b = rnd(ctx, MOE_F64, SHAPE(3, 2)), *r = NULL;
  EXPECT_OK(moe_matmul(ctx, a, b, &r));
  EXPECT(moe_requires_grad(r) && moe_tensor_grad_fn(r));
  EXPECT_STR(moe_node_name(moe_tensor_grad_fn(r)), "matmul");
  moe_tensor_release(r);
  bool prev = moe_grad_set(ctx, false);
  EXPECT_OK(moe_matmul(ctx, a, b, &r));
  EXPECT(!moe_requires_grad(r) && !moe_tensor_grad_fn(r));
  moe_tensor_release(r);
  moe_grad_set(ctx, prev);
  moe_tensor *c = rnd(ctx, MOE_F64, SHAPE(2, 3));
  EXPECT_OK(moe_linear(ctx, c, a, NULL, &r)); /* W requires grad */
  EXPECT_STR(moe_node_name(moe_tensor_grad_fn(r)), "linear");
  moe_tensor_release(r);
  EXPECT_OK(moe_linear(ctx, c, c, NULL, &r)); /* nothing requires grad */
  EXPECT(!moe_tensor_grad_fn(r));
  moe_tensor_release(r);
  moe_tensor *a3 = NULL, *b3 = NULL;
  EXPECT_OK(moe_unsqueeze(ctx, a, 0, &a3));
  EXPECT_OK(moe_unsqueeze(ctx, b, 0, &b3));
  EXPECT_OK(moe_bmm(ctx, a3, b3, &r));
  EXPECT_STR(moe_node_name(moe_tensor_grad_fn(r)), "bmm");
  moe_tensor_release(r);
  moe_tensor *ts[] = {a, b, c, a3, b3};
  for (int i = 0; i < 5; i++) moe_tensor_release(ts[i]);
}

/* Gradients by hand: a [[1, 2, 3], [4, 5, 6]], b [[7, 8], [9, 10], [11, 12]],
 * L = sum(a @ b): da[i][k] = sum_j b[k][j], db[k][j] = sum_i a[i][k]; and
 * linear's bias gradient is the column sums of the incoming gradient. */
static void test_backward_values(moe_ctx *ctx) {
  moe_tensor *a = vals(ctx, MOE_F32, SHAPE(2, 3), (double[]){1, 2, 3, 4, 5, 6});
  moe_tensor *b = vals(ctx, MOE_F32, SHAPE(3, 2), (double[]){7, 8, 9, 10, 11, 12});
  EXPECT_OK(moe_set_requires_grad(ctx, a, true));
  EXPECT_OK(moe_set_requires_grad(ctx, b, true));
  moe_tensor *r = NULL, *g = NULL;
  EXPECT_OK(moe_matmul(ctx, a, b, &r));
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(2, 2), 1, MOE_F32, MOE_CPU, &g));
  EXPECT_OK(moe_backward(ctx, r, g, false));
  EXPECT_VALUES(moe_tensor_grad(a), 0, 15, 19, 23, 15, 19, 23);
  EXPECT_VALUES(moe_tensor_grad(b), 0, 5, 5, 7, 7, 9, 9);
  moe_tensor_release(r);
  moe_tensor_release(g);
  /* linear: x (2, 3), W = b^T (2, 3), bias (2); gradient [[1, 2], [3, 4]] */
  moe_tensor *w = vals(ctx, MOE_F32, SHAPE(2, 3), (double[]){7, 9, 11, 8, 10, 12});
  moe_tensor *bias = vals(ctx, MOE_F32, SHAPE(2), (double[]){0.5, -0.5});
  moe_tensor *x = vals(ctx, MOE_F32, SHAPE(2, 3), (double[]){1, 2, 3, 4, 5, 6});
  EXPECT_OK(moe_set_requires_grad(ctx, w, true));
  EXPECT_OK(moe_set_requires_grad(ctx, bias, true));
  EXPECT_OK(moe_set_requires_grad(ctx, x, true));
  EXPECT_OK(moe_linear(ctx, x, w, bias, &r));
  EXPECT_VALUES(r, 0, 58.5, 63.5, 139.5, 153.5);
  g = vals(ctx, MOE_F32, SHAPE(2, 2), (double[]){1, 2, 3, 4});
  EXPECT_OK(moe_backward(ctx, r, g, false));
  /* dx = g @ W: [[1*7+2*8, 1*9+2*10, 1*11+2*12], [3*7+4*8, 3*9+4*10, 3*11+4*12]] */
  EXPECT_VALUES(moe_tensor_grad(x), 0, 23, 29, 35, 53, 67, 81);
  /* dW = g^T @ x: [[1*1+3*4, 1*2+3*5, 1*3+3*6], [2*1+4*4, 2*2+4*5, 2*3+4*6]] */
  EXPECT_VALUES(moe_tensor_grad(w), 0, 13, 17, 21, 18, 24, 30);
  EXPECT_VALUES(moe_tensor_grad(bias), 0, 4, 6);
  moe_tensor_release(r);
  moe_tensor_release(g);
  moe_tensor *ts[] = {a, b, w, bias, x};
  for (int i = 0; i < 5; i++) moe_tensor_release(ts[i]);
}

static moe_status f_matmul(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  return moe_matmul(ctx, in[0], in[1], out);
}
static moe_status f_bmm(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  return moe_bmm(ctx, in[0], in[1], out);
}
static moe_status f_linear(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  return moe_linear(ctx, in[0], in[1], ud ? NULL : in[2], out);
}
/* linear with a fixed weight (ud) that does not require grad: only x, bias */
static moe_status f_linear_fixed_w(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  return moe_linear(ctx, in[0], (moe_tensor *)ud, in[1], out);
}

/* gradcheck of matmul on a fresh pair of leaves, then released */
static void gc_matmul(moe_ctx *ctx, moe_tensor *a, moe_tensor *b, int line) {
  moe_tensor *in[2] = {a, b};
  harness_checks++;
  if (!gradcheck(ctx, f_matmul, 2, in, NULL, 1e-6, 1e-6)) {
    harness_failures++;
    fprintf(stderr, "%s:%d: FAILED: gradcheck matmul\n", __FILE__, line);
  }
  moe_tensor_release(a);
  moe_tensor_release(b);
}

static void test_gradcheck_matmul(moe_ctx *ctx) {
  gc_matmul(ctx, leaf(ctx, SHAPE(3, 4)), leaf(ctx, SHAPE(4, 2)), __LINE__);
  gc_matmul(ctx, leaf(ctx, SHAPE(4)), leaf(ctx, SHAPE(4)), __LINE__);
  gc_matmul(ctx, leaf(ctx, SHAPE(3, 4)), leaf(ctx, SHAPE(4)), __LINE__);
  gc_matmul(ctx, leaf(ctx, SHAPE(4)), leaf(ctx, SHAPE(4, 2)), __LINE__);
  gc_matmul(ctx, leaf(ctx, SHAPE(2, 3, 4)), leaf(ctx, SHAPE(4)), __LINE__);
  gc_matmul(ctx, leaf(ctx, SHAPE(4)), leaf(ctx, SHAPE(2, 4, 3)), __LINE__);
  gc_matmul(ctx, leaf(ctx, SHAPE(2, 3, 4)), leaf(ctx, SHAPE(4, 5)), __LINE__);     /* folded db */
  gc_matmul(ctx, leaf(ctx, SHAPE(2, 1, 3, 4)), leaf(ctx, SHAPE(3, 4, 2)), __LINE__); /* both broadcast */
  gc_matmul(ctx, leaf(ctx, SHAPE(3, 4)), leaf(ctx, SHAPE(2, 4, 5)), __LINE__);     /* a broadcast */
  gc_matmul(ctx, leaf(ctx, SHAPE(2, 3, 4)), leaf(ctx, SHAPE(1, 4, 5)), __LINE__);  /* size-1 batch b */
  /* non-contiguous leaves */
  gc_matmul(ctx, leaf_t(ctx, SHAPE(3, 4)), leaf_t(ctx, SHAPE(4, 2)), __LINE__);
  gc_matmul(ctx, leaf_t(ctx, SHAPE(2, 3, 4)), leaf_t(ctx, SHAPE(4, 5)), __LINE__);
  gc_matmul(ctx, leaf_t(ctx, SHAPE(2, 3, 4)), leaf(ctx, SHAPE(2, 4, 5)), __LINE__);
  gc_matmul(ctx, leaf_strided1(ctx, 4), leaf_t(ctx, SHAPE(2, 4, 3)), __LINE__);
  gc_matmul(ctx, leaf_t(ctx, SHAPE(3, 4)), leaf_strided1(ctx, 4), __LINE__);
}

static void test_gradcheck_bmm(moe_ctx *ctx) {
  moe_tensor *in[2] = {leaf(ctx, SHAPE(2, 3, 4)), leaf(ctx, SHAPE(2, 4, 5))};
  EXPECT(gradcheck(ctx, f_bmm, 2, in, NULL, 1e-6, 1e-6));
  moe_tensor_release(in[0]);
  moe_tensor_release(in[1]);
  in[0] = leaf_t(ctx, SHAPE(3, 1, 4));
  in[1] = leaf_t(ctx, SHAPE(3, 4, 2));
  EXPECT(gradcheck(ctx, f_bmm, 2, in, NULL, 1e-6, 1e-6));
  moe_tensor_release(in[0]);
  moe_tensor_release(in[1]);
}

static void test_gradcheck_linear(moe_ctx *ctx) {
  moe_tensor *in[3] = {leaf(ctx, SHAPE(2, 3, 4)), leaf(ctx, SHAPE(5, 4)), leaf(ctx, SHAPE(5))};
  EXPECT(gradcheck(ctx, f_linear, 3, in, NULL, 1e-6, 1e-6));
  EXPECT(gradcheck(ctx, f_linear, 2, in, (void *)1, 1e-6, 1e-6)); /* no bias */
  for (int i = 0; i < 3; i++) moe_tensor_release(in[i]);
  /* non-contiguous x, W and bias; x 1-D */
  in[0] = leaf_t(ctx, SHAPE(3, 2, 4));
  in[1] = leaf_t(ctx, SHAPE(5, 4));
  in[2] = leaf_strided1(ctx, 5);
  EXPECT(gradcheck(ctx, f_linear, 3, in, NULL, 1e-6, 1e-6));
  moe_tensor_release(in[0]);
  in[0] = leaf_strided1(ctx, 4);
  EXPECT(gradcheck(ctx, f_linear, 3, in, NULL, 1e-6, 1e-6));
  /* a weight that does not require grad: only x and bias get gradients */
  moe_tensor *w = rnd(ctx, MOE_F64, SHAPE(5, 4));
  moe_tensor *in2[2] = {in[0], in[2]};
  EXPECT(gradcheck(ctx, f_linear_fixed_w, 2, in2, w, 1e-6, 1e-6));
  moe_tensor_release(w);
  for (int i = 0; i < 3; i++) moe_tensor_release(in[i]);
}

/* --------------------------------------------------------------- settings */

static void test_tf32_flag(moe_ctx *ctx) {
  EXPECT(!moe_matmul_tf32()); /* off by default */
  EXPECT(!moe_matmul_set_tf32(true));
  EXPECT(moe_matmul_tf32());
  EXPECT(moe_matmul_set_tf32(false));
  EXPECT(!moe_matmul_tf32());
}

/* ----------------------------------------------------------------- errors */

static void test_errors(moe_ctx *ctx) {
  moe_tensor *a = rnd(ctx, MOE_F32, SHAPE(4, 7)), *b = rnd(ctx, MOE_F32, SHAPE(5, 3));
  moe_tensor *r = NULL;
  EXPECT_ERR_MSG(moe_matmul(ctx, a, b, &r), MOE_ERR_SHAPE,
                 "matmul: shapes [4, 7] and [5, 3] cannot be multiplied (7 != 5)");
  EXPECT(r == NULL);
  moe_tensor *s = NULL, *v5 = rnd(ctx, MOE_F32, SHAPE(5));
  EXPECT_OK(moe_tensor_full(ctx, 0, NULL, 1, MOE_F32, MOE_CPU, &s));
  EXPECT_ERR_MSG(moe_matmul(ctx, s, a, &r), MOE_ERR_SHAPE, "at least 1 dim");
  EXPECT_ERR_MSG(moe_matmul(ctx, a, v5, &r), MOE_ERR_SHAPE, "(7 != 5)");
  moe_tensor *x = rnd(ctx, MOE_F32, SHAPE(2, 4, 7)), *y = rnd(ctx, MOE_F32, SHAPE(3, 7, 2));
  EXPECT_ERR_MSG(moe_matmul(ctx, x, y, &r), MOE_ERR_SHAPE, "cannot be broadcast (2 vs 3");
  /* dtypes */
  moe_tensor *a64 = rnd(ctx, MOE_F64, SHAPE(7, 3)), *ai = NULL;
  EXPECT_ERR_MSG(moe_matmul(ctx, a, a64, &r), MOE_ERR_DTYPE, "matmul: the first operand is f32 but the second operand is f64");
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(7, 3), 1, MOE_I64, MOE_CPU, &ai));
  EXPECT_ERR_MSG(moe_matmul(ctx, a, ai, &r), MOE_ERR_DTYPE, "dtype i64");
  EXPECT_ERR_MSG(moe_bmm(ctx, ai, ai, &r), MOE_ERR_DTYPE, "bmm: the first operand has dtype i64");
  EXPECT_ERR(moe_matmul(ctx, NULL, a, &r), MOE_ERR_INVALID_ARG);
  EXPECT_ERR(moe_matmul(ctx, a, b, NULL), MOE_ERR_INVALID_ARG);
  /* bmm */
  EXPECT_ERR_MSG(moe_bmm(ctx, a, b, &r), MOE_ERR_SHAPE, "must be 3-D");
  moe_tensor *z = rnd(ctx, MOE_F32, SHAPE(3, 4, 7));
  EXPECT_ERR_MSG(moe_bmm(ctx, x, z, &r), MOE_ERR_SHAPE, "different batch sizes (2 != 3)");
  EXPECT_ERR_MSG(moe_bmm(ctx, z, z, &r), MOE_ERR_SHAPE, "bmm: shapes [3, 4, 7] and [3, 4, 7] cannot be multiplied (7 != 4)");
  /* linear */
  moe_tensor *w = rnd(ctx, MOE_F32, SHAPE(5, 3)), *bias = rnd(ctx, MOE_F32, SHAPE(4));
  EXPECT_ERR_MSG(moe_linear(ctx, a, w, NULL, &r), MOE_ERR_SHAPE,
                 "linear: input [4, 7] and weight [5, 3] cannot be multiplied (in features 7 != 3)");
  EXPECT_ERR_MSG(moe_linear(ctx, a, v5, NULL, &r), MOE_ERR_SHAPE, "weight must be 2-D");
  moe_tensor *x3 = rnd(ctx, MOE_F32, SHAPE(2, 3));
  EXPECT_ERR_MSG(moe_linear(ctx, x3, w, bias, &r), MOE_ERR_SHAPE, "bias of shape [4] does not fit weight [5, 3]");
  moe_tensor *b64 = rnd(ctx, MOE_F64, SHAPE(5));
  EXPECT_ERR_MSG(moe_linear(ctx, x3, w, b64, &r), MOE_ERR_DTYPE,
                 "linear: the input is f32 but the bias is f64");
  moe_tensor_release(b64);
  EXPECT_ERR_MSG(moe_linear(ctx, s, w, NULL, &r), MOE_ERR_SHAPE, "at least 1 dim");
  EXPECT_ERR(moe_linear(ctx, NULL, w, NULL, &r), MOE_ERR_INVALID_ARG);
  EXPECT(r == NULL);
  moe_tensor *ts[] = {a, b, s, v5, x, y, a64, ai, z, w, bias, x3};
  for (int i = 0; i < 12; i++) moe_tensor_release(ts[i]);
}

int main(void) {
  moe_ctx *ctx = harness_start();
  moe_rng_seed(ctx, 1234);
  RUN(test_matmul_2d_values);
  RUN(test_matmul_1d_cases);
  RUN(test_matmul_broadcast);
  RUN(test_matmul_strided);
  RUN(test_matmul_half);
  RUN(test_matmul_empty);
  RUN(test_bmm_values);
  RUN(test_linear_values);
  RUN(test_autograd_node);
  RUN(test_backward_values);
  RUN(test_gradcheck_matmul);
  RUN(test_gradcheck_bmm);
  RUN(test_gradcheck_linear);
  RUN(test_tf32_flag);
  RUN(test_errors);
  return harness_end();
}
