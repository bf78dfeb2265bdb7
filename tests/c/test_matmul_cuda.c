/*
 * test_matmul_cuda.c - matmul, bmm and linear on CUDA (cuBLASLt) against a
 * naive product in double of the same (already rounded) inputs, forward
 * and backward, in f32, bf16, f16 and f64, at awkward sizes (1, odd, a few
 * hundred), with transposed, narrowed (pointer misaligned by one element),
 * strided (copied), expanded and non-foldable batched operands, the bias
 * epilogue, and empty sizes. Exits 77 (skipped) without a GPU.
 *
 * Tolerances, per element, with S = sum_k |a_ik b_kj| (what rounding errors
 * of the sum scale with) and r the exact result:
 *   f64  1e-12 S                 double accumulation;
 *   f32  1e-5 S                  full f32 (TF32, 10-bit inputs, would err by
 *                                about 5e-4 S and fail: the check also
 *                                proves TF32 is off by default);
 *   bf16 2^-8 |r| + 1e-5 S       f32 accumulation, then one rounding of the
 *                                output to 8 bits (half an ulp is 2^-9 |r|);
 *   f16  2^-10 |r| + 1e-5 S      the same with an 11-bit output.
 * Gradients are compared with the CPU in f64 on the same values, relative to
 * the largest gradient element: f64 1e-12, f32 1e-5, f16 4e-3, bf16 2e-2
 * (16-bit gradients are rounded after each GEMM and after the sum over
 * broadcast batch dims).
 */
#include "harness.h"

#define SHAPE(...) (sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (int64_t[]){__VA_ARGS__}
#define CUDA0 ((moe_device){MOE_DEVICE_CUDA, 0})

static const moe_dtype DTS[] = {MOE_F32, MOE_BF16, MOE_F16, MOE_F64};
#define NDTS 4

static double out_rel(moe_dtype dt) {
  return dt == MOE_BF16 ? 1.0 / 256 : dt == MOE_F16 ? 1.0 / 1024 : 0;
}
static double sum_rel(moe_dtype dt) { return dt == MOE_F64 ? 1e-12 : 1e-5; }
static double grad_rel(moe_dtype dt) {
  return dt == MOE_F64 ? 1e-12 : dt == MOE_F32 ? 1e-5 : dt == MOE_F16 ? 4e-3 : 2e-2;
}

static moe_tensor *rnd_dev(moe_ctx *ctx, moe_dtype dt, moe_device d, int ndim, const int64_t *shape) {
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, ndim, shape, dt, d, &t));
  EXPECT_OK(moe_uniform_(ctx, t, -1, 1));
  return t;
}

static double *host(moe_ctx *ctx, const moe_tensor *t) {
  int64_t n = moe_tensor_numel(t);
  double *v = (double *)malloc(sizeof(double) * (size_t)(n ? n : 1));
  EXPECT_OK(moe_tensor_to_f64(ctx, t, v));
  return v;
}

/* r (.., M, N) from a (.., M, K) @ b (.., K, N) (+ bias): compares every
 * element with the naive product in double (batch dims broadcast). */
static void check_product(moe_ctx *ctx, const moe_tensor *a, const moe_tensor *b,
                          const moe_tensor *bias, const moe_tensor *r, moe_dtype dt, int line) {
  int na = a->ndim - 2, nb = b->ndim - 2, nbat = na > nb ? na : nb;
  int64_t M = a->shape[na], K = a->shape[na + 1], N = b->shape[nb + 1], batch = 1;
  int64_t bs[MOE_MAX_DIMS];
  for (int i = 0; i < nbat; i++) {
    int da = i - (nbat - na), db = i - (nbat - nb);
    int64_t x = da >= 0 ? a->shape[da] : 1, y = db >= 0 ? b->shape[db] : 1;
    bs[i] = x == 1 ? y : x;
    batch *= bs[i];
  }
  harness_checks++;
  if (moe_tensor_numel(r) != batch * M * N || r->ndim != nbat + 2) {
    harness_failures++;
    fprintf(stderr, "%s:%d: FAILED: result has %lld elements, wanted %lld\n", __FILE__, line,
            (long long)moe_tensor_numel(r), (long long)(batch * M * N));
    return;
  }
  double *va = host(ctx, a), *vb = host(ctx, b), *vr = host(ctx, r);
  double *vbias = bias ? host(ctx, bias) : NULL;
  int bad = 0;
  for (int64_t bi = 0; bi < batch && bad < 3; bi++) {
    int64_t rem = bi, ia = 0, ib = 0, sa = 1, sb = 1;
    for (int i = nbat - 1; i >= 0; i--) {
      int64_t idx = rem % bs[i];
      rem /= bs[i];
      int da = i - (nbat - na), db = i - (nbat - nb);
      if (da >= 0) ia += (a->shape[da] == 1 ? 0 : idx) * sa, sa *= a->shape[da];
      if (db >= 0) ib += (b->shape[db] == 1 ? 0 : idx) * sb, sb *= b->shape[db];
    }
    for (int64_t i = 0; i < M; i++)
      for (int64_t j = 0; j < N; j++) {
        double s = vbias ? vbias[j] : 0, S = fabs(s);
        for (int64_t k = 0; k < K; k++) {
          double p = va[(ia * M + i) * K + k] * vb[(ib * K + k) * N + j];
          s += p;
          S += fabs(p);
        }
        double got = vr[(bi * M + i) * N + j];
        double tol = out_rel(dt) * fabs(s) + sum_rel(dt) * S + 1e-30;
        if (!(fabs(got - s) <= tol) && bad++ < 3)
          fprintf(stderr, "%s:%d: FAILED: %s element (%lld, %lld, %lld) is %.9g, wanted %.9g (tol %g)\n",
                  __FILE__, line, moe_dtype_name(dt), (long long)bi, (long long)i, (long long)j,
                  got, s, tol);
      }
  }
  if (bad) harness_failures++;
  free(va);
  free(vb);
  free(vr);
  free(vbias);
}

/* matmul on CUDA of a, b (CUDA tensors, at least 2-D) checked element-wise. */
static void check_mm(moe_ctx *ctx, moe_tensor *a, moe_tensor *b, int line) {
  moe_tensor *r = NULL;
  EXPECT_OK(moe_matmul(ctx, a, b, &r));
  if (!r) return;
  EXPECT(moe_tensor_device(r).type == MOE_DEVICE_CUDA && r->dtype == a->dtype);
  check_product(ctx, a, b, NULL, r, a->dtype, line);
  moe_tensor_release(r);
}

static void test_forward_shapes(moe_ctx *ctx) {
  for (int t = 0; t < NDTS; t++) {
    moe_dtype dt = DTS[t];
    const int64_t sizes[][3] = {{1, 1, 1}, {1, 300, 1}, {7, 13, 5}, {257, 513, 129}, {64, 64, 64}, {1, 65, 33}};
    for (int s = 0; s < 6; s++) {
      moe_tensor *a = rnd_dev(ctx, dt, CUDA0, SHAPE(sizes[s][0], sizes[s][1]));
      moe_tensor *b = rnd_dev(ctx, dt, CUDA0, SHAPE(sizes[s][1], sizes[s][2]));
      check_mm(ctx, a, b, __LINE__);
      moe_tensor_release(a);
      moe_tensor_release(b);
    }
    /* batched, broadcast, folded */
    moe_tensor *a = rnd_dev(ctx, dt, CUDA0, SHAPE(3, 33, 65)), *b = rnd_dev(ctx, dt, CUDA0, SHAPE(3, 65, 17));
    check_mm(ctx, a, b, __LINE__);
    moe_tensor *c = rnd_dev(ctx, dt, CUDA0, SHAPE(2, 1, 5, 7)), *d = rnd_dev(ctx, dt, CUDA0, SHAPE(3, 7, 4));
    check_mm(ctx, c, d, __LINE__);
    moe_tensor *w = rnd_dev(ctx, dt, CUDA0, SHAPE(65, 31));
    check_mm(ctx, a, w, __LINE__); /* folded into one (99 x 65) GEMM */
    moe_tensor *ts[] = {a, b, c, d, w};
    for (int i = 0; i < 5; i++) moe_tensor_release(ts[i]);
  }
}

static void test_forward_strided(moe_ctx *ctx) {
  for (int t = 0; t < NDTS; t++) {
    moe_dtype dt = DTS[t];
    moe_tensor *base = rnd_dev(ctx, dt, CUDA0, SHAPE(67, 45)), *base2 = rnd_dev(ctx, dt, CUDA0, SHAPE(45, 67));
    moe_tensor *at = NULL, *bt = NULL, *an = NULL, *bn = NULL, *tmp = NULL, *as = NULL, *bs = NULL;
    EXPECT_OK(moe_transpose(ctx, base, 0, 1, &at));  /* (45, 67) unit row stride */
    EXPECT_OK(moe_transpose(ctx, base2, 0, 1, &bt)); /* (67, 45) */
    check_mm(ctx, at, base, __LINE__);
    check_mm(ctx, base, at, __LINE__);
    check_mm(ctx, at, bt, __LINE__);
    /* narrowed by one element: pointers misaligned for 16-byte loads */
    EXPECT_OK(moe_narrow(ctx, base, 1, 1, 43, &an));  /* (67, 43) ld 45 */
    EXPECT_OK(moe_narrow(ctx, base2, 0, 1, 43, &bn)); /* (43, 67) */
    check_mm(ctx, an, bn, __LINE__);
    /* stride 2 in both dims: copied first */
    EXPECT_OK(moe_slice(ctx, base, 0, 0, 67, 2, &tmp)); /* (34, 45) */
    EXPECT_OK(moe_slice(ctx, tmp, 1, 0, 45, 2, &as));   /* (34, 23) */
    moe_tensor_release(tmp);
    EXPECT_OK(moe_slice(ctx, base2, 1, 0, 67, 3, &tmp)); /* (45, 23) */
    EXPECT_OK(moe_slice(ctx, tmp, 0, 0, 45, 2, &bs));    /* (23, 23), strides (134, 3) */
    moe_tensor_release(tmp);
    check_mm(ctx, as, bs, __LINE__);
    /* expanded b (batch stride 0) against a transposed batched a */
    moe_tensor *bb = rnd_dev(ctx, dt, CUDA0, SHAPE(3, 67, 9)), *e = NULL;
    EXPECT_OK(moe_expand(ctx, base, SHAPE(3, 67, 45), &tmp));
    EXPECT_OK(moe_transpose(ctx, bb, 1, 2, &e)); /* (3, 9, 67) */
    check_mm(ctx, e, tmp, __LINE__);
    moe_tensor_release(tmp);
    moe_tensor_release(e);
    moe_tensor_release(bb);
    /* batch dims that do not fold: (T, B, K) -> (B, T, K) @ (K, N) */
    moe_tensor *x = rnd_dev(ctx, dt, CUDA0, SHAPE(5, 3, 45));
    EXPECT_OK(moe_transpose(ctx, x, 0, 1, &tmp));
    check_mm(ctx, tmp, base2, __LINE__);
    moe_tensor_release(tmp);
    moe_tensor_release(x);
    moe_tensor *ts[] = {base, base2, at, bt, an, bn, as, bs};
    for (int i = 0; i < 8; i++) moe_tensor_release(ts[i]);
  }
}

static void test_forward_1d_empty(moe_ctx *ctx) {
  moe_tensor *v = rnd_dev(ctx, MOE_F32, CUDA0, SHAPE(37)), *m = rnd_dev(ctx, MOE_F32, CUDA0, SHAPE(5, 37));
  moe_tensor *r = NULL, *v2 = NULL, *mt = NULL;
  EXPECT_OK(moe_matmul(ctx, v, v, &r));
  EXPECT(r && r->ndim == 0);
  double *hv = host(ctx, v), got = 0, want = 0, S = 0;
  for (int i = 0; i < 37; i++) want += hv[i] * hv[i], S += hv[i] * hv[i];
  EXPECT_OK(moe_tensor_to_f64(ctx, r, &got));
  EXPECT_NEAR(got, want, 1e-5 * S);
  moe_tensor_release(r);
  EXPECT_OK(moe_matmul(ctx, m, v, &r));
  EXPECT(r && r->ndim == 1 && r->shape[0] == 5);
  EXPECT_OK(moe_unsqueeze(ctx, v, 1, &v2));
  moe_tensor *r2 = NULL; /* (5) as (5, 1), the shape check_product expects */
  if (r) EXPECT_OK(moe_unsqueeze(ctx, r, 1, &r2));
  if (r2) check_product(ctx, m, v2, NULL, r2, MOE_F32, __LINE__);
  moe_tensor_release(r2);
  moe_tensor_release(r);
  EXPECT_OK(moe_transpose(ctx, m, 0, 1, &mt));
  EXPECT_OK(moe_matmul(ctx, v, mt, &r)); /* (37) @ (37, 5) */
  EXPECT(r && r->ndim == 1 && r->shape[0] == 5);
  moe_tensor_release(r);
  /* K = 0: zeros; with a bias: the bias */
  moe_tensor *a0 = NULL, *w0 = NULL, *bias = rnd_dev(ctx, MOE_BF16, CUDA0, SHAPE(4));
  EXPECT_OK(moe_tensor_empty(ctx, SHAPE(3, 0), MOE_BF16, CUDA0, &a0));
  EXPECT_OK(moe_tensor_empty(ctx, SHAPE(4, 0), MOE_BF16, CUDA0, &w0));
  EXPECT_OK(moe_linear(ctx, a0, w0, bias, &r));
  double *hb = host(ctx, bias);
  EXPECT_VALUES(r, 0, hb[0], hb[1], hb[2], hb[3], hb[0], hb[1], hb[2], hb[3], hb[0], hb[1], hb[2], hb[3]);
  moe_tensor_release(r);
  moe_tensor *e0 = NULL, *e1 = rnd_dev(ctx, MOE_BF16, CUDA0, SHAPE(3, 4));
  EXPECT_OK(moe_tensor_empty(ctx, SHAPE(0, 3), MOE_BF16, CUDA0, &e0));
  EXPECT_OK(moe_matmul(ctx, e0, e1, &r)); /* M = 0 */
  EXPECT(r && r->ndim == 2 && r->shape[0] == 0 && r->shape[1] == 4);
  moe_tensor_release(r);
  moe_tensor_release(e0);
  moe_tensor_release(e1);
  moe_tensor *ts[] = {v, m, v2, mt, a0, w0, bias};
  for (int i = 0; i < 7; i++) moe_tensor_release(ts[i]);
  free(hv);
  free(hb);
}

/* linear with the bias epilogue, folded x and a non-foldable x (a batched
 * GEMM with a shared bias) */
static void test_linear(moe_ctx *ctx) {
  for (int t = 0; t < NDTS; t++) {
    moe_dtype dt = DTS[t];
    moe_tensor *x = rnd_dev(ctx, dt, CUDA0, SHAPE(3, 37, 96)), *w = rnd_dev(ctx, dt, CUDA0, SHAPE(50, 96));
    moe_tensor *bias = rnd_dev(ctx, dt, CUDA0, SHAPE(50)), *wt = NULL, *r = NULL, *xt = NULL;
    EXPECT_OK(moe_transpose(ctx, w, 0, 1, &wt));
    EXPECT_OK(moe_linear(ctx, x, w, bias, &r));
    if (r) check_product(ctx, x, wt, bias, r, dt, __LINE__);
    moe_tensor_release(r);
    EXPECT_OK(moe_linear(ctx, x, w, NULL, &r));
    if (r) check_product(ctx, x, wt, NULL, r, dt, __LINE__);
    moe_tensor_release(r);
    EXPECT_OK(moe_transpose(ctx, x, 0, 1, &xt)); /* (37, 3, 96): rows do not fold */
    EXPECT_OK(moe_linear(ctx, xt, w, bias, &r));
    if (r) check_product(ctx, xt, wt, bias, r, dt, __LINE__);
    moe_tensor_release(r);
    moe_tensor *ts[] = {x, w, bias, wt, xt};
    for (int i = 0; i < 5; i++) moe_tensor_release(ts[i]);
  }
}

/* ---------------------------------------------------------------- backward */

typedef enum { OP_MATMUL, OP_BMM, OP_LINEAR } op_kind;

static moe_status run_op(moe_ctx *ctx, op_kind op, moe_tensor **in, int n, moe_tensor **out) {
  if (op == OP_MATMUL) return moe_matmul(ctx, in[0], in[1], out);
  if (op == OP_BMM) return moe_bmm(ctx, in[0], in[1], out);
  return moe_linear(ctx, in[0], in[1], n > 2 ? in[2] : NULL, out);
}

/* Runs op forward and backward on CUDA (dtype dt; inputs made from random
 * values, input 0 transposed when t0) and on the CPU in f64 with the same
 * values and the same output gradient; compares the gradients. */
static void check_backward(moe_ctx *ctx, op_kind op, moe_dtype dt, int n, const int *ndims,
                           const int64_t (*shapes)[MOE_MAX_DIMS], bool t0, int line) {
  moe_tensor *gin[3] = {NULL}, *cin[3] = {NULL}, *base[3] = {NULL};
  for (int i = 0; i < n; i++) {
    int64_t s[MOE_MAX_DIMS];
    memcpy(s, shapes[i], sizeof(s));
    bool tr = i == 0 && t0 && ndims[i] >= 2;
    if (tr) { /* made transposed: a non-contiguous leaf */
      s[ndims[i] - 1] = shapes[i][ndims[i] - 2];
      s[ndims[i] - 2] = shapes[i][ndims[i] - 1];
    }
    base[i] = rnd_dev(ctx, dt, CUDA0, ndims[i], s);
    if (tr)
      EXPECT_OK(moe_transpose(ctx, base[i], -1, -2, &gin[i]));
    else {
      gin[i] = base[i];
      moe_tensor_retain(gin[i]);
    }
    EXPECT_OK(moe_to(ctx, gin[i], MOE_F64, MOE_CPU, &cin[i]));
    EXPECT_OK(moe_set_requires_grad(ctx, gin[i], true));
    EXPECT_OK(moe_set_requires_grad(ctx, cin[i], true));
  }
  moe_tensor *gr = NULL, *cr = NULL, *gg = NULL, *cg = NULL;
  EXPECT_OK(run_op(ctx, op, gin, n, &gr));
  EXPECT_OK(run_op(ctx, op, cin, n, &cr));
  if (gr && cr) {
    gg = rnd_dev(ctx, dt, CUDA0, gr->ndim, gr->shape);
    EXPECT_OK(moe_to(ctx, gg, MOE_F64, MOE_CPU, &cg));
    EXPECT_OK(moe_backward(ctx, gr, gg, false));
    EXPECT_OK(moe_backward(ctx, cr, cg, false));
    for (int i = 0; i < n; i++) {
      moe_tensor *a = moe_tensor_grad(gin[i]), *b = moe_tensor_grad(cin[i]);
      harness_checks++;
      if (!a || !b || moe_tensor_numel(a) != moe_tensor_numel(b) ||
          moe_tensor_device(a).type != MOE_DEVICE_CUDA || a->dtype != dt) {
        harness_failures++;
        fprintf(stderr, "%s:%d: FAILED: gradient %d missing or of the wrong kind\n", __FILE__, line, i);
        continue;
      }
      int64_t m = moe_tensor_numel(b);
      double *va = host(ctx, a), *vb = host(ctx, b), mx = 0, worst = 0;
      for (int64_t j = 0; j < m; j++) mx = fmax(mx, fabs(vb[j]));
      for (int64_t j = 0; j < m; j++) worst = fmax(worst, fabs(va[j] - vb[j]));
      if (!(worst <= grad_rel(dt) * mx + 1e-30)) {
        harness_failures++;
        fprintf(stderr, "%s:%d: FAILED: %s gradient %d differs by %g (max |grad| %g, tol %g)\n",
                __FILE__, line, moe_dtype_name(dt), i, worst, mx, grad_rel(dt) * mx);
      }
      free(va);
      free(vb);
    }
  }
  moe_tensor_release(gr);
  moe_tensor_release(cr);
  moe_tensor_release(gg);
  moe_tensor_release(cg);
  for (int i = 0; i < n; i++) {
    moe_tensor_release(gin[i]);
    moe_tensor_release(cin[i]);
    moe_tensor_release(base[i]);
  }
}

static void test_backward(moe_ctx *ctx) {
  for (int t = 0; t < NDTS; t++) {
    moe_dtype dt = DTS[t];
    for (int tr = 0; tr < 2; tr++) {
      check_backward(ctx, OP_MATMUL, dt, 2, (int[]){2, 2},
                     (const int64_t[][MOE_MAX_DIMS]){{33, 65}, {65, 17}}, tr, __LINE__);
      check_backward(ctx, OP_MATMUL, dt, 2, (int[]){3, 2},
                     (const int64_t[][MOE_MAX_DIMS]){{3, 19, 40}, {40, 7}}, tr, __LINE__);
      /* broadcast batch dims: the gradients are summed with moe_sum, which
       * takes no f64 on CUDA (the reduce family's choice), so not for f64 */
      if (dt != MOE_F64)
        check_backward(ctx, OP_MATMUL, dt, 2, (int[]){4, 3},
                       (const int64_t[][MOE_MAX_DIMS]){{2, 1, 9, 11}, {3, 11, 5}}, tr, __LINE__);
      check_backward(ctx, OP_MATMUL, dt, 2, (int[]){1, 2},
                     (const int64_t[][MOE_MAX_DIMS]){{31}, {31, 6}}, tr, __LINE__);
      check_backward(ctx, OP_BMM, dt, 2, (int[]){3, 3},
                     (const int64_t[][MOE_MAX_DIMS]){{4, 1, 23}, {4, 23, 9}}, tr, __LINE__);
      check_backward(ctx, OP_LINEAR, dt, 3, (int[]){3, 2, 1},
                     (const int64_t[][MOE_MAX_DIMS]){{2, 37, 48}, {29, 48}, {29}}, tr, __LINE__);
      check_backward(ctx, OP_LINEAR, dt, 2, (int[]){2, 2},
                     (const int64_t[][MOE_MAX_DIMS]){{1, 48}, {1, 48}}, tr, __LINE__);
    }
  }
}

/* worst |a - ref| <= rel * max |ref|, a on CUDA, ref on the CPU (same shape). */
static void expect_close_rows(moe_ctx *ctx, const moe_tensor *a, const moe_tensor *ref, double rel,
                              const char *what, int line) {
  int64_t n = moe_tensor_numel(ref);
  harness_checks++;
  if (!a || moe_tensor_numel(a) != n) {
    harness_failures++;
    fprintf(stderr, "%s:%d: FAILED: %s missing or of the wrong size\n", __FILE__, line, what);
    return;
  }
  double *va = host(ctx, a), *vr = host(ctx, ref), mx = 0, worst = 0;
  for (int64_t j = 0; j < n; j++) mx = fmax(mx, fabs(vr[j]));
  for (int64_t j = 0; j < n; j++) worst = fmax(worst, fabs(va[j] - vr[j]));
  if (!(worst <= rel * mx) || !(mx > 0)) {
    harness_failures++;
    fprintf(stderr, "%s:%d: FAILED: %s differs by %g (max |ref| %g, tol %g)\n", __FILE__, line,
            what, worst, mx, rel * mx);
  }
  free(va);
  free(vr);
}

/* A bf16 linear layer large enough for the first call of each of its three
 * GEMMs to time cuBLASLt's candidates (forward with the bias epilogue, dX,
 * dW), run twice (the second from the algorithm cache); the bias gradient
 * takes the vectorized column-sum kernel (2560 columns). Checked against the CPU in f64 on a few rows (x, dx),
 * a few rows of dW (a few columns of g) and the whole bias gradient.
 * Tolerance 2^-7 of the largest reference element: one bf16 rounding of the
 * output (2^-9 |r|) plus f32 accumulation error (about 1e-5 S) is far less. */
static void test_linear_large(moe_ctx *ctx) {
  const int64_t R = 4096, IN = 1024, OUT = 2560, ROWS = 8;
  moe_tensor *x = rnd_dev(ctx, MOE_BF16, CUDA0, SHAPE(R, IN));
  moe_tensor *w = rnd_dev(ctx, MOE_BF16, CUDA0, SHAPE(OUT, IN));
  moe_tensor *b = rnd_dev(ctx, MOE_BF16, CUDA0, SHAPE(OUT));
  moe_tensor *g = rnd_dev(ctx, MOE_BF16, CUDA0, SHAPE(R, OUT));
  moe_tensor *cx = NULL, *cw = NULL, *cb = NULL, *cg = NULL;
  EXPECT_OK(moe_to(ctx, x, MOE_F64, MOE_CPU, &cx));
  EXPECT_OK(moe_to(ctx, w, MOE_F64, MOE_CPU, &cw));
  EXPECT_OK(moe_to(ctx, b, MOE_F64, MOE_CPU, &cb));
  EXPECT_OK(moe_to(ctx, g, MOE_F64, MOE_CPU, &cg));
  EXPECT_OK(moe_set_requires_grad(ctx, x, true));
  EXPECT_OK(moe_set_requires_grad(ctx, w, true));
  EXPECT_OK(moe_set_requires_grad(ctx, b, true));
  /* references: y[0:ROWS], dx[0:ROWS] = g[0:ROWS] @ w, dw[0:ROWS] = g[:, 0:ROWS]^T @ x,
   * db = ones(1, R) @ g */
  moe_tensor *cx8 = NULL, *cg8 = NULL, *cgc = NULL, *cgct = NULL, *ones = NULL;
  moe_tensor *ry = NULL, *rdx = NULL, *rdw = NULL, *rdb = NULL;
  EXPECT_OK(moe_narrow(ctx, cx, 0, 0, ROWS, &cx8));
  EXPECT_OK(moe_narrow(ctx, cg, 0, 0, ROWS, &cg8));
  EXPECT_OK(moe_narrow(ctx, cg, 1, 0, ROWS, &cgc));
  EXPECT_OK(moe_transpose(ctx, cgc, 0, 1, &cgct));
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(1, R), 1, MOE_F64, MOE_CPU, &ones));
  EXPECT_OK(moe_linear(ctx, cx8, cw, cb, &ry));
  EXPECT_OK(moe_matmul(ctx, cg8, cw, &rdx));
  EXPECT_OK(moe_matmul(ctx, cgct, cx, &rdw));
  EXPECT_OK(moe_matmul(ctx, ones, cg, &rdb));
  for (int pass = 0; pass < 2; pass++) {
    moe_tensor *y = NULL, *y8 = NULL, *dx8 = NULL, *dw8 = NULL;
    EXPECT_OK(moe_linear(ctx, x, w, b, &y));
    if (!y) break;
    EXPECT_OK(moe_backward(ctx, y, g, false));
    EXPECT_OK(moe_narrow(ctx, y, 0, 0, ROWS, &y8));
    EXPECT_OK(moe_narrow(ctx, moe_tensor_grad(x), 0, 0, ROWS, &dx8));
    EXPECT_OK(moe_narrow(ctx, moe_tensor_grad(w), 0, 0, ROWS, &dw8));
    expect_close_rows(ctx, y8, ry, 1.0 / 128, "y rows", __LINE__);
    expect_close_rows(ctx, dx8, rdx, 1.0 / 128, "dx rows", __LINE__);
    expect_close_rows(ctx, dw8, rdw, 1.0 / 128, "dW rows", __LINE__);
    expect_close_rows(ctx, moe_tensor_grad(b), rdb, 1.0 / 128, "dbias", __LINE__);
    moe_tensor *ts[] = {y, y8, dx8, dw8};
    for (size_t i = 0; i < sizeof(ts) / sizeof(ts[0]); i++) moe_tensor_release(ts[i]);
    EXPECT_OK(moe_tensor_set_grad(ctx, x, NULL)); /* the next pass accumulates afresh */
    EXPECT_OK(moe_tensor_set_grad(ctx, w, NULL));
    EXPECT_OK(moe_tensor_set_grad(ctx, b, NULL));
  }
  moe_tensor *ts[] = {x, w, b, g, cx, cw, cb, cg, cx8, cg8, cgc, cgct, ones, ry, rdx, rdw, rdb};
  for (size_t i = 0; i < sizeof(ts) / sizeof(ts[0]); i++) moe_tensor_release(ts[i]);
}

/* An output gradient expanded from one row (row stride 0): the bias
 * gradient (column sums) reads a contiguous copy; db = R * row exactly in f32
 * for these small integers (R = 37 times a value in {-2..2}). */
static void test_linear_expanded_grad(moe_ctx *ctx) {
  const int64_t R = 37, IN = 24, OUT = 40;
  moe_tensor *x = rnd_dev(ctx, MOE_F32, CUDA0, SHAPE(R, IN));
  moe_tensor *w = rnd_dev(ctx, MOE_F32, CUDA0, SHAPE(OUT, IN));
  moe_tensor *b = rnd_dev(ctx, MOE_F32, CUDA0, SHAPE(OUT));
  moe_tensor *row = NULL, *dy = NULL, *y = NULL;
  double hrow[40];
  for (int j = 0; j < OUT; j++) hrow[j] = (double)(j % 5 - 2);
  EXPECT_OK(moe_tensor_from_f64(ctx, hrow, SHAPE(1, OUT), MOE_F32, CUDA0, &row));
  EXPECT_OK(moe_expand(ctx, row, 2, (int64_t[]){R, OUT}, &dy));
  EXPECT_OK(moe_set_requires_grad(ctx, b, true));
  EXPECT_OK(moe_linear(ctx, x, w, b, &y));
  if (y && dy) {
    EXPECT_OK(moe_backward(ctx, y, dy, false));
    moe_tensor *db = moe_tensor_grad(b);
    EXPECT(db != NULL);
    if (db) {
      double *v = host(ctx, db);
      for (int j = 0; j < OUT; j++) EXPECT(v[j] == (double)R * hrow[j]);
      free(v);
    }
  }
  moe_tensor *ts[] = {x, w, b, row, dy, y};
  for (size_t i = 0; i < sizeof(ts) / sizeof(ts[0]); i++) moe_tensor_release(ts[i]);
}

/* Device memory comes back: products and their backward hold nothing. */
static void test_memory_flat(moe_ctx *ctx) {
  moe_memory_stats before, after;
  EXPECT_OK(moe_memory_stats_get(ctx, CUDA0, &before));
  for (int i = 0; i < 3; i++) {
    int64_t s[][MOE_MAX_DIMS] = {{4, 64, 128}, {96, 128}, {96}};
    check_backward(ctx, OP_LINEAR, MOE_BF16, 3, (int[]){3, 2, 1},
                   (const int64_t(*)[MOE_MAX_DIMS])s, false, __LINE__);
  }
  EXPECT_OK(moe_memory_stats_get(ctx, CUDA0, &after));
  EXPECT(after.allocated == before.allocated);
  EXPECT(after.live_storages == before.live_storages);
}

static void test_errors(moe_ctx *ctx) {
  moe_tensor *a = rnd_dev(ctx, MOE_F32, CUDA0, SHAPE(2, 3)), *b = rnd_dev(ctx, MOE_F32, MOE_CPU, SHAPE(3, 2));
  moe_tensor *r = NULL, *ai = NULL;
  EXPECT_ERR_MSG(moe_matmul(ctx, a, b, &r), MOE_ERR_DEVICE,
                 "matmul: the first operand is on cuda:0 but the second operand is on cpu");
  EXPECT_ERR_MSG(moe_linear(ctx, a, b, NULL, &r), MOE_ERR_DEVICE, "linear: the input is on cuda:0");
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(3, 2), 1, MOE_I32, CUDA0, &ai));
  EXPECT_ERR_MSG(moe_matmul(ctx, a, ai, &r), MOE_ERR_DTYPE, "dtype i32");
  moe_tensor *ba = rnd_dev(ctx, MOE_F32, CUDA0, SHAPE(2, 3, 4)), *bb = rnd_dev(ctx, MOE_F32, MOE_CPU, SHAPE(2, 4, 5));
  EXPECT_ERR_MSG(moe_bmm(ctx, ba, bb, &r), MOE_ERR_DEVICE,
                 "bmm: the first operand is on cuda:0 but the second operand is on cpu");
  EXPECT(r == NULL);
  moe_tensor_release(a);
  moe_tensor_release(b);
  moe_tensor_release(ai);
  moe_tensor_release(ba);
  moe_tensor_release(bb);
}

int main(void) {
  moe_ctx *ctx = harness_start();
  SKIP_IF_NO_GPU(ctx);
  moe_rng_seed(ctx, 99);
  RUN(test_forward_shapes);
  RUN(test_forward_strided);
  RUN(test_forward_1d_empty);
  RUN(test_linear);
  RUN(test_backward);
  RUN(test_linear_large);
  RUN(test_linear_expanded_grad);
  RUN(test_memory_flat);
  RUN(test_errors);
  return harness_end();
}
