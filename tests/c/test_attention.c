/*
 * test_attention.c - scaled-dot-product attention on the CPU: a hand-computed
 * case, the reference against a naive softmax(Q K^T scale + mask) V built
 * here from the definition (f64, f32, bf16, contiguous and strided inputs),
 * the lse output, the default scale, finite-difference gradient checks in
 * f64 (causal and not, contiguous leaves and transposed views), gradients in
 * f32/bf16 against f64, partial requires_grad, empty sizes and error paths.
 */
#include "gradcheck.h"
#include "harness.h"

/* The naive reference in double: out (BH, T, D) and lse (BH, T) from q, k, v
 * given as row-major (BH, T, D) values. */
static void naive_attention(const double *q, const double *k, const double *v, double *out,
                            double *lse, int64_t BH, int64_t T, int64_t D, bool causal,
                            double scale) {
  double *s = (double *)malloc(sizeof(double) * (size_t)(T * T));
  for (int64_t bh = 0; bh < BH; bh++) {
    const double *qb = q + bh * T * D, *kb = k + bh * T * D, *vb = v + bh * T * D;
    for (int64_t i = 0; i < T; i++) {
      double m = -INFINITY;
      for (int64_t j = 0; j < T; j++) {
        double x = 0;
        for (int64_t d = 0; d < D; d++) x += qb[i * D + d] * kb[j * D + d];
        s[i * T + j] = causal && j > i ? -INFINITY : x * scale;
        if (s[i * T + j] > m) m = s[i * T + j];
      }
      double l = 0;
      for (int64_t j = 0; j < T; j++) l += exp(s[i * T + j] - m);
      if (lse) lse[bh * T + i] = m + log(l);
      for (int64_t d = 0; d < D; d++) {
        double o = 0;
        for (int64_t j = 0; j < T; j++) o += exp(s[i * T + j] - m) / l * vb[j * D + d];
        out[(bh * T + i) * D + d] = o;
      }
    }
  }
  free(s);
}

static moe_tensor *randn4(moe_ctx *ctx, int64_t B, int64_t H, int64_t T, int64_t D, moe_dtype dt) {
  moe_tensor *t = NULL;
  int64_t shape[4] = {B, H, T, D};
  if (moe_tensor_empty(ctx, 4, shape, dt, MOE_CPU, &t) != MOE_OK) return NULL;
  moe_normal_(ctx, t, 0.0, 1.0);
  return t;
}

static double *values(moe_ctx *ctx, const moe_tensor *t) {
  int64_t n = moe_tensor_numel(t);
  double *v = (double *)malloc(sizeof(double) * (size_t)(n ? n : 1));
  if (moe_tensor_to_f64(ctx, t, v) != MOE_OK) {
    free(v);
    return NULL;
  }
  return v;
}

static double max_abs_diff(const double *a, const double *b, int64_t n) {
  double m = 0;
  for (int64_t i = 0; i < n; i++) {
    double d = fabs(a[i] - b[i]);
    if (!(d <= m)) m = d; /* NaN propagates */
  }
  return m;
}

/* T = 2, D = 1, scale 1: q = [0, 1], k = [0, ln 3], v = [4, 8].
 * causal: row 0 sees key 0 only -> 4; row 1: softmax(0, ln 3) = (1/4, 3/4)
 * -> 1 + 6 = 7. Not causal: row 0 scores (0, 0) -> 6. */
static void test_hand_computed(moe_ctx *ctx) {
  int64_t shape[4] = {1, 1, 2, 1};
  moe_tensor *q = NULL, *k = NULL, *v = NULL, *o = NULL, *lse = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, (double[]){0, 1}, 4, shape, MOE_F64, MOE_CPU, &q));
  EXPECT_OK(moe_tensor_from_f64(ctx, (double[]){0, log(3.0)}, 4, shape, MOE_F64, MOE_CPU, &k));
  EXPECT_OK(moe_tensor_from_f64(ctx, (double[]){4, 8}, 4, shape, MOE_F64, MOE_CPU, &v));
  EXPECT_OK(moe_attention(ctx, q, k, v, true, 1.0, &o));
  EXPECT_VALUES(o, 1e-12, 4, 7);
  moe_tensor_release(o);
  EXPECT_OK(moe_attention_forward(ctx, q, k, v, true, 1.0, &o, &lse));
  EXPECT_VALUES(lse, 1e-12, 0, log(4.0)); /* log(e^0) and log(1 + 3) */
  EXPECT(lse->dtype == MOE_F64 && lse->ndim == 3);
  moe_tensor_release(o);
  moe_tensor_release(lse);
  EXPECT_OK(moe_attention(ctx, q, k, v, false, 1.0, &o));
  EXPECT_VALUES(o, 1e-12, 6, 7);
  moe_tensor_release(o);
  moe_tensor_release(q), moe_tensor_release(k), moe_tensor_release(v);
}

/* The reference against the naive one for a dtype; tol per dtype. */
static void check_against_naive(moe_ctx *ctx, moe_dtype dt, double tol, int64_t B, int64_t H,
                                int64_t T, int64_t D, bool causal, double scale) {
  moe_tensor *q = randn4(ctx, B, H, T, D, dt), *k = randn4(ctx, B, H, T, D, dt),
             *v = randn4(ctx, B, H, T, D, dt), *o = NULL, *lse = NULL;
  EXPECT(q && k && v);
  EXPECT_OK(moe_attention_forward(ctx, q, k, v, causal, scale, &o, &lse));
  if (o && lse) {
    int64_t n = B * H * T * D;
    double *qv = values(ctx, q), *kv = values(ctx, k), *vv = values(ctx, v), *ov = values(ctx, o),
           *lv = values(ctx, lse);
    double *want = (double *)malloc(sizeof(double) * (size_t)n),
           *wl = (double *)malloc(sizeof(double) * (size_t)(B * H * T));
    double s = scale == 0 || isnan(scale) ? 1 / sqrt((double)D) : scale;
    naive_attention(qv, kv, vv, want, wl, B * H, T, D, causal, s);
    EXPECT(o->dtype == dt && moe_tensor_is_contiguous(o));
    double e = max_abs_diff(ov, want, n), el = max_abs_diff(lv, wl, B * H * T);
    if (!(e <= tol && el <= tol))
      fprintf(stderr, "  %s T=%lld D=%lld causal=%d: out err %g, lse err %g (tol %g)\n",
              moe_dtype_name(dt), (long long)T, (long long)D, causal, e, el, tol);
    EXPECT(e <= tol);
    EXPECT(el <= tol);
    free(qv), free(kv), free(vv), free(ov), free(lv), free(want), free(wl);
  }
  moe_tensor_release(o), moe_tensor_release(lse);
  moe_tensor_release(q), moe_tensor_release(k), moe_tensor_release(v);
}

static void test_reference_values(moe_ctx *ctx) {
  moe_rng_seed(ctx, 1);
  /* f64: the same math in another order, rounding only: 1e-12.
   * f32: inputs exact in double, output rounded to f32 (values |o| < 4): 1e-6.
   * bf16: output rounded to bf16 (8 bits of mantissa, |o| < 4): 2e-2. */
  check_against_naive(ctx, MOE_F64, 1e-12, 2, 3, 7, 5, true, 0);
  check_against_naive(ctx, MOE_F64, 1e-12, 1, 2, 9, 4, false, 0.3);
  check_against_naive(ctx, MOE_F64, 1e-12, 1, 1, 1, 3, true, NAN);
  check_against_naive(ctx, MOE_F32, 1e-6, 2, 2, 17, 8, true, 0);
  check_against_naive(ctx, MOE_F32, 1e-6, 1, 3, 33, 16, false, 0);
  check_against_naive(ctx, MOE_BF16, 2e-2, 2, 2, 13, 8, true, 0);
  check_against_naive(ctx, MOE_BF16, 2e-2, 1, 1, 20, 64, true, -0.5);
}

/* 0 and NaN mean 1/sqrt(D); other values are used as given. */
static void test_default_scale(moe_ctx *ctx) {
  moe_rng_seed(ctx, 2);
  moe_tensor *q = randn4(ctx, 1, 2, 5, 9, MOE_F64), *k = randn4(ctx, 1, 2, 5, 9, MOE_F64),
             *v = randn4(ctx, 1, 2, 5, 9, MOE_F64), *a = NULL, *b = NULL, *c = NULL, *d = NULL;
  EXPECT_OK(moe_attention(ctx, q, k, v, true, 0, &a));
  EXPECT_OK(moe_attention(ctx, q, k, v, true, NAN, &b));
  EXPECT_OK(moe_attention(ctx, q, k, v, true, 1.0 / 3.0, &c));
  EXPECT_OK(moe_attention(ctx, q, k, v, true, 1.0, &d));
  double *va = values(ctx, a), *vb = values(ctx, b), *vc = values(ctx, c), *vd = values(ctx, d);
  EXPECT(max_abs_diff(va, vb, 90) == 0);
  EXPECT(max_abs_diff(va, vc, 90) <= 1e-15);
  EXPECT(max_abs_diff(va, vd, 90) > 1e-3); /* another scale gives another result */
  free(va), free(vb), free(vc), free(vd);
  moe_tensor_release(a), moe_tensor_release(b), moe_tensor_release(c), moe_tensor_release(d);
  moe_tensor_release(q), moe_tensor_release(k), moe_tensor_release(v);
}

/* q, k, v as (B, H, T, D) views of (B, T, H, D) buffers, and k narrowed
 * from a wider head dim: same result as contiguous copies. */
static void test_strided_inputs(moe_ctx *ctx) {
  moe_rng_seed(ctx, 3);
  int64_t B = 2, H = 3, T = 6, D = 4;
  moe_tensor *qb = randn4(ctx, B, T, H, D, MOE_F32), *kb = randn4(ctx, B, H, T, 2 * D, MOE_F32),
             *vb = randn4(ctx, B, T, H, D, MOE_F32);
  moe_tensor *q = NULL, *k = NULL, *v = NULL, *qc = NULL, *kc = NULL, *vc = NULL, *o1 = NULL,
             *o2 = NULL;
  EXPECT_OK(moe_transpose(ctx, qb, 1, 2, &q));
  EXPECT_OK(moe_narrow(ctx, kb, 3, 2, D, &k));
  EXPECT_OK(moe_transpose(ctx, vb, 1, 2, &v));
  EXPECT(!moe_tensor_is_contiguous(q) && !moe_tensor_is_contiguous(k));
  EXPECT_OK(moe_contiguous(ctx, q, &qc));
  EXPECT_OK(moe_contiguous(ctx, k, &kc));
  EXPECT_OK(moe_contiguous(ctx, v, &vc));
  EXPECT_OK(moe_attention(ctx, q, k, v, true, 0, &o1));
  EXPECT_OK(moe_attention(ctx, qc, kc, vc, true, 0, &o2));
  double *a = values(ctx, o1), *b = values(ctx, o2);
  EXPECT(a && b && max_abs_diff(a, b, B * H * T * D) == 0);
  free(a), free(b);
  moe_tensor *t[] = {qb, kb, vb, q, k, v, qc, kc, vc, o1, o2};
  for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++) moe_tensor_release(t[i]);
}

typedef struct attn_ud {
  bool causal;
  double scale;
} attn_ud;

static moe_status attn_fn(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  attn_ud *u = (attn_ud *)ud;
  return moe_attention(ctx, in[0], in[1], in[2], u->causal, u->scale, out);
}

static moe_tensor *leaf(moe_ctx *ctx, int64_t B, int64_t H, int64_t T, int64_t D) {
  moe_tensor *t = randn4(ctx, B, H, T, D, MOE_F64);
  if (t) moe_set_requires_grad(ctx, t, true);
  return t;
}

static void test_gradcheck_contiguous(moe_ctx *ctx) {
  moe_rng_seed(ctx, 4);
  moe_tensor *in[3] = {leaf(ctx, 1, 2, 4, 3), leaf(ctx, 1, 2, 4, 3), leaf(ctx, 1, 2, 4, 3)};
  attn_ud causal = {true, 0}, full = {false, 0.7};
  EXPECT(gradcheck(ctx, attn_fn, 3, in, &causal, 1e-6, 1e-6));
  EXPECT(gradcheck(ctx, attn_fn, 3, in, &full, 1e-6, 1e-6));
  for (int i = 0; i < 3; i++) moe_tensor_release(in[i]);
  /* T = 1 and a batch of 2 */
  moe_tensor *in1[3] = {leaf(ctx, 2, 1, 1, 2), leaf(ctx, 2, 1, 1, 2), leaf(ctx, 2, 1, 1, 2)};
  EXPECT(gradcheck(ctx, attn_fn, 3, in1, &causal, 1e-6, 1e-6));
  for (int i = 0; i < 3; i++) moe_tensor_release(in1[i]);
}

/* Leaves that are non-contiguous: transposed views of (B, T, H, D) buffers
 * and a narrowed head dim, made leaves by requires_grad on the view. */
static void test_gradcheck_strided(moe_ctx *ctx) {
  moe_rng_seed(ctx, 5);
  moe_tensor *qb = randn4(ctx, 1, 3, 2, 3, MOE_F64), *kb = randn4(ctx, 1, 2, 3, 5, MOE_F64),
             *vb = randn4(ctx, 1, 3, 2, 3, MOE_F64);
  moe_tensor *in[3] = {NULL};
  EXPECT_OK(moe_transpose(ctx, qb, 1, 2, &in[0]));
  EXPECT_OK(moe_narrow(ctx, kb, 3, 1, 3, &in[1]));
  EXPECT_OK(moe_transpose(ctx, vb, 1, 2, &in[2]));
  for (int i = 0; i < 3; i++) {
    EXPECT(!moe_tensor_is_contiguous(in[i]));
    EXPECT_OK(moe_set_requires_grad(ctx, in[i], true));
  }
  attn_ud causal = {true, 0}, full = {false, -0.4};
  EXPECT(gradcheck(ctx, attn_fn, 3, in, &causal, 1e-6, 1e-6));
  EXPECT(gradcheck(ctx, attn_fn, 3, in, &full, 1e-6, 1e-6));
  for (int i = 0; i < 3; i++) moe_tensor_release(in[i]);
  moe_tensor_release(qb), moe_tensor_release(kb), moe_tensor_release(vb);
}

/* Gradients through autograd in f32 and bf16 against f64 of the same
 * values; only the inputs that require grad get one. */
static void test_grad_dtypes(moe_ctx *ctx) {
  moe_rng_seed(ctx, 6);
  const moe_dtype dts[2] = {MOE_F32, MOE_BF16};
  /* f32: double math, gradients rounded once: 1e-5. bf16: inputs rounded to
   * bf16 for both sides, dout too; gradients (|g| < 8) rounded to bf16: 5e-2. */
  const double tols[2] = {1e-5, 5e-2};
  for (int di = 0; di < 2; di++) {
    moe_tensor *x[3], *x64[3], *o = NULL, *o64 = NULL, *r = NULL, *r64 = NULL;
    for (int i = 0; i < 3; i++) {
      x[i] = randn4(ctx, 2, 2, 11, 8, dts[di]);
      EXPECT_OK(moe_to(ctx, x[i], MOE_F64, MOE_CPU, &x64[i]));
    }
    EXPECT_OK(moe_set_requires_grad(ctx, x[0], true));
    EXPECT_OK(moe_set_requires_grad(ctx, x[2], true));
    EXPECT_OK(moe_set_requires_grad(ctx, x64[0], true));
    EXPECT_OK(moe_set_requires_grad(ctx, x64[2], true));
    EXPECT_OK(moe_attention(ctx, x[0], x[1], x[2], true, 0, &o));
    EXPECT_OK(moe_attention(ctx, x64[0], x64[1], x64[2], true, 0, &o64));
    r = randn4(ctx, 2, 2, 11, 8, dts[di]);
    EXPECT_OK(moe_to(ctx, r, MOE_F64, MOE_CPU, &r64));
    EXPECT(moe_tensor_grad_fn(o) != NULL);
    EXPECT_OK(moe_backward(ctx, o, r, false));
    EXPECT_OK(moe_backward(ctx, o64, r64, false));
    EXPECT(moe_tensor_grad(x[1]) == NULL);
    for (int i = 0; i < 3; i += 2) {
      moe_tensor *g = moe_tensor_grad(x[i]), *g64 = moe_tensor_grad(x64[i]);
      EXPECT(g && g64 && g->dtype == dts[di]);
      if (g && g64) {
        double *a = values(ctx, g), *b = values(ctx, g64);
        double e = max_abs_diff(a, b, 2 * 2 * 11 * 8);
        if (!(e <= tols[di]))
          fprintf(stderr, "  %s grad %d: err %g\n", moe_dtype_name(dts[di]), i, e);
        EXPECT(e <= tols[di]);
        free(a), free(b);
      }
    }
    for (int i = 0; i < 3; i++) moe_tensor_release(x[i]), moe_tensor_release(x64[i]);
    moe_tensor_release(o), moe_tensor_release(o64), moe_tensor_release(r),
        moe_tensor_release(r64);
  }
}

/* The low-level backward against autograd's, and on empty sizes. */
static void test_backward_direct(moe_ctx *ctx) {
  moe_rng_seed(ctx, 7);
  moe_tensor *q = randn4(ctx, 1, 2, 5, 4, MOE_F64), *k = randn4(ctx, 1, 2, 5, 4, MOE_F64),
             *v = randn4(ctx, 1, 2, 5, 4, MOE_F64), *r = randn4(ctx, 1, 2, 5, 4, MOE_F64);
  moe_tensor *o = NULL, *lse = NULL, *dq = NULL, *dk = NULL, *dv = NULL, *o2 = NULL;
  EXPECT_OK(moe_attention_forward(ctx, q, k, v, true, 0, &o, &lse));
  EXPECT_OK(moe_attention_backward(ctx, q, k, v, o, lse, r, true, 0, &dq, &dk, &dv));
  EXPECT_OK(moe_set_requires_grad(ctx, q, true));
  EXPECT_OK(moe_set_requires_grad(ctx, k, true));
  EXPECT_OK(moe_set_requires_grad(ctx, v, true));
  EXPECT_OK(moe_attention(ctx, q, k, v, true, 0, &o2));
  EXPECT_OK(moe_backward(ctx, o2, r, false));
  moe_tensor *mine[3] = {dq, dk, dv}, *ag[3] = {moe_tensor_grad(q), moe_tensor_grad(k),
                                                 moe_tensor_grad(v)};
  for (int i = 0; i < 3; i++) {
    double *a = values(ctx, mine[i]), *b = ag[i] ? values(ctx, ag[i]) : NULL;
    EXPECT(a && b && max_abs_diff(a, b, 40) == 0);
    free(a), free(b);
  }
  /* the last key gets gradient only from the last query (causal) */
  double *gk = values(ctx, dk);
  EXPECT(gk && fabs(gk[4 * 4]) > 0);
  free(gk);
  moe_tensor *t[] = {q, k, v, r, o, lse, dq, dk, dv, o2};
  for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++) moe_tensor_release(t[i]);

  /* T = 0 and B = 0: empty results of the right shapes */
  const int64_t shapes[2][4] = {{1, 2, 0, 4}, {0, 2, 3, 4}};
  for (int s = 0; s < 2; s++) {
    moe_tensor *e[4];
    for (int i = 0; i < 4; i++) e[i] = randn4(ctx, shapes[s][0], shapes[s][1], shapes[s][2], shapes[s][3], MOE_F32);
    o = lse = dq = dk = dv = NULL;
    EXPECT_OK(moe_attention_forward(ctx, e[0], e[1], e[2], true, 0, &o, &lse));
    EXPECT(o && moe_tensor_numel(o) == 0 && o->ndim == 4 && lse && lse->ndim == 3);
    EXPECT_OK(moe_attention_backward(ctx, e[0], e[1], e[2], o, lse, e[3], true, 0, &dq, &dk, &dv));
    EXPECT(dq && moe_tensor_numel(dq) == 0 && dq->shape[2] == shapes[s][2]);
    moe_tensor_release(o), moe_tensor_release(lse), moe_tensor_release(dq), moe_tensor_release(dk),
        moe_tensor_release(dv);
    for (int i = 0; i < 4; i++) moe_tensor_release(e[i]);
  }
}

static void test_errors(moe_ctx *ctx) {
  moe_tensor *q = randn4(ctx, 1, 2, 3, 4, MOE_F32), *k = randn4(ctx, 1, 2, 3, 4, MOE_F32),
             *v = randn4(ctx, 1, 2, 3, 4, MOE_F32), *o = NULL, *lse = NULL;
  moe_tensor *k5 = randn4(ctx, 1, 2, 4, 4, MOE_F32), *v64 = randn4(ctx, 1, 2, 3, 4, MOE_F64),
             *q16 = randn4(ctx, 1, 2, 3, 4, MOE_F16), *d0 = randn4(ctx, 1, 2, 3, 0, MOE_F32);
  moe_tensor *i32 = NULL, *q3 = NULL;
  int64_t s3[3] = {2, 3, 4};
  EXPECT_OK(moe_tensor_full(ctx, 4, q->shape, 1, MOE_I32, MOE_CPU, &i32));
  EXPECT_OK(moe_tensor_full(ctx, 3, s3, 1, MOE_F32, MOE_CPU, &q3));
  EXPECT_ERR_MSG(moe_attention(ctx, q3, q3, q3, true, 0, &o), MOE_ERR_SHAPE, "4-D (B, H, T, D)");
  EXPECT_ERR_MSG(moe_attention(ctx, q, k5, v, true, 0, &o), MOE_ERR_SHAPE,
                 "k has shape [1, 2, 4, 4], wanted q's shape [1, 2, 3, 4]");
  EXPECT_ERR_MSG(moe_attention(ctx, q, k, v64, true, 0, &o), MOE_ERR_DTYPE, "v is f64 but q is f32");
  EXPECT_ERR_MSG(moe_attention(ctx, q16, q16, q16, true, 0, &o), MOE_ERR_DTYPE,
                 "dtype f16 is not supported on the CPU");
  EXPECT_ERR_MSG(moe_attention(ctx, i32, i32, i32, true, 0, &o), MOE_ERR_DTYPE, "i32");
  EXPECT_ERR_MSG(moe_attention(ctx, d0, d0, d0, true, 0, &o), MOE_ERR_SHAPE, "head dim");
  EXPECT_ERR_MSG(moe_attention(ctx, q, k, v, true, INFINITY, &o), MOE_ERR_INVALID_ARG,
                 "scale must be finite");
  EXPECT_ERR_MSG(moe_attention(ctx, NULL, k, v, true, 0, &o), MOE_ERR_INVALID_ARG, "q is NULL");
  EXPECT_ERR_MSG(moe_attention(ctx, q, k, NULL, true, 0, &o), MOE_ERR_INVALID_ARG, "v is NULL");
  EXPECT_ERR(moe_attention(ctx, q, k, v, true, 0, NULL), MOE_ERR_INVALID_ARG);
  EXPECT(o == NULL);
  EXPECT_OK(moe_attention_forward(ctx, q, k, v, true, 0, &o, &lse));
  moe_tensor *dq = NULL, *dk = NULL, *dv = NULL;
  EXPECT_ERR_MSG(moe_attention_backward(ctx, q, k, v, o, q, q, true, 0, &dq, &dk, &dv),
                 MOE_ERR_SHAPE, "lse must be f32 [1, 2, 3]");
  EXPECT_ERR_MSG(moe_attention_backward(ctx, q, k, v, o, lse, k5, true, 0, &dq, &dk, &dv),
                 MOE_ERR_SHAPE, "dout has shape");
  EXPECT_ERR_MSG(moe_attention_backward(ctx, q, k, v, o, lse, v64, true, 0, &dq, &dk, &dv),
                 MOE_ERR_DTYPE, "dout is f64");
  EXPECT_ERR(moe_attention_backward(ctx, q, k, v, o, NULL, q, true, 0, &dq, &dk, &dv),
             MOE_ERR_INVALID_ARG);
  EXPECT(dq == NULL && dk == NULL && dv == NULL);
  moe_tensor *t[] = {q, k, v, o, lse, k5, v64, q16, d0, i32, q3};
  for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++) moe_tensor_release(t[i]);
}

int main(void) {
  RUN(test_hand_computed);
  RUN(test_reference_values);
  RUN(test_default_scale);
  RUN(test_strided_inputs);
  RUN(test_gradcheck_contiguous);
  RUN(test_gradcheck_strided);
  RUN(test_grad_dtypes);
  RUN(test_backward_direct);
  RUN(test_errors);
  return harness_end();
}
