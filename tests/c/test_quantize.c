/*
 * test_quantize.c - the quantize family on the CPU (moe_quantize.h): codes
 * and scales against a naive reference written here, round-trip error
 * bounds (8 bits: |x - x'| <= group absmax / 254; 4 bits: <= group absmax /
 * 14), the 4-bit nibble layout on a hand-worked example, ragged last groups
 * and odd rows, zero / NaN / empty / 0-dim inputs, strided inputs,
 * stochastic rounding (unbiased on average, reproducible from the RNG
 * state), the saved-tensor hooks (gradients of a small MLP and of an
 * attention-like block against the unquantized run, the bytes kept for
 * backward shrink, pass-through of f64 / small / kept tensors) and errors.
 */
#include "harness.h"
#include "moe_quantize.h"

/* ------------------------------------------------------------- helpers */

static moe_tensor *rand_tensor(moe_ctx *ctx, int ndim, const int64_t *shape, moe_dtype dt,
                               double lo, double hi) {
  moe_tensor *t = NULL;
  if (moe_tensor_empty(ctx, ndim, shape, dt, MOE_CPU, &t) != MOE_OK) return NULL;
  if (moe_uniform_(ctx, t, lo, hi) != MOE_OK) {
    moe_tensor_release(t);
    return NULL;
  }
  return t;
}

static double *values_of(moe_ctx *ctx, const moe_tensor *t) {
  int64_t n = moe_tensor_numel(t);
  double *v = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
  if (v && moe_tensor_to_f64(ctx, t, v) != MOE_OK) {
    free(v);
    return NULL;
  }
  return v;
}

/* Naive reference of one (row, group): the codes and scale as the header
 * defines them, computed in float with plain operators. */
static float naive_group(const float *x, int64_t n, int qmax, int *codes) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; i++) {
    float a = fabsf(x[i]);
    if (a > m || a != a) m = a;
  }
  float s = m / (float)qmax;
  float inv = 1.0f / s; /* once per group (moe_quantize.h) */
  for (int64_t i = 0; i < n; i++) {
    if (!(s > 0.0f) || isinf(s)) {
      codes[i] = 0;
      continue;
    }
    float v = rintf(isinf(inv) ? x[i] / s : x[i] * inv);
    if (v > (float)qmax) v = (float)qmax;
    if (v < -(float)qmax) v = -(float)qmax;
    codes[i] = (int)v;
  }
  return s;
}

/* Checks q (from x (rows, cols) as f32 values) against the naive reference:
 * exact codes, exact scales, and the round-trip error bound. */
static void check_against_naive(moe_ctx *ctx, const moe_tensor *x, const moe_qtensor *q,
                                int64_t G) {
  int64_t cols = x->ndim ? x->shape[x->ndim - 1] : 1, rows = moe_tensor_numel(x) / (cols ? cols : 1);
  int bits = q->bits, qmax = bits == 8 ? 127 : 7;
  int64_t Ge = G > 0 ? G : cols, ng = (cols + Ge - 1) / Ge;
  int64_t rb = bits == 8 ? cols : (cols + 1) / 2;
  double *xv = values_of(ctx, x);
  double *sv = values_of(ctx, q->scales);
  moe_tensor *vals = NULL, *deq = NULL;
  EXPECT_OK(moe_to(ctx, q->values, MOE_I64, MOE_CPU, &vals));
  EXPECT_OK(moe_dequantize(ctx, q, &deq));
  double *vv = vals ? values_of(ctx, vals) : NULL;
  double *dv = deq ? values_of(ctx, deq) : NULL;
  float *xf = malloc(sizeof(float) * (size_t)(Ge > 0 ? Ge : 1));
  int *codes = malloc(sizeof(int) * (size_t)(Ge > 0 ? Ge : 1));
  int bad_code = 0, bad_scale = 0, bad_bound = 0;
  /* the dtype's own rounding of x': 2^-8 relative for bf16, 2^-11 for f16 */
  double rel = x->dtype == MOE_BF16 ? 1.0 / 256 : x->dtype == MOE_F16 ? 1.0 / 2048 : 1e-7;
  for (int64_t r = 0; xv && sv && vv && dv && r < rows; r++)
    for (int64_t k = 0; k < ng; k++) {
      int64_t c0 = k * Ge, c1 = c0 + Ge < cols ? c0 + Ge : cols;
      for (int64_t c = c0; c < c1; c++) xf[c - c0] = (float)xv[r * cols + c];
      float s = naive_group(xf, c1 - c0, qmax, codes);
      if ((float)sv[r * ng + k] != s) bad_scale++;
      for (int64_t c = c0; c < c1; c++) {
        int code;
        if (bits == 8) {
          code = (int)vv[r * rb + c];
        } else {
          int byte = (int)vv[r * rb + c / 2];
          code = ((byte >> ((c & 1) * 4)) & 15) - 8;
        }
        if (code != codes[c - c0]) bad_code++;
        double err = fabs(xv[r * cols + c] - dv[r * cols + c]);
        if (!(err <= (double)s / 2 * (1 + 1e-6) + rel * fabs(dv[r * cols + c]))) bad_bound++;
      }
    }
  EXPECT(xv && sv && vv && dv);
  EXPECT(bad_code == 0);
  EXPECT(bad_scale == 0);
  EXPECT(bad_bound == 0);
  if (bad_code || bad_scale || bad_bound)
    fprintf(stderr, "  bits %d G %lld shape (%lld, %lld) %s: %d codes, %d scales, %d bounds wrong\n",
            bits, (long long)G, (long long)rows, (long long)cols, moe_dtype_name(x->dtype),
            bad_code, bad_scale, bad_bound);
  free(xv), free(sv), free(vv), free(dv), free(xf), free(codes);
  moe_tensor_release(vals);
  moe_tensor_release(deq);
}

/* --------------------------------------------------------------- tests */

static void test_roundtrip(moe_ctx *ctx) {
  moe_rng_seed(ctx, 11);
  const moe_dtype dts[] = {MOE_F32, MOE_BF16, MOE_F16, MOE_F64};
  const int64_t shapes[][2] = {{37, 300}, {5, 301}, {1, 1}, {3, 7}, {64, 128}};
  const int64_t groups8[] = {0, 64, 7};
  const int64_t groups4[] = {0, 128, 64, 2};
  for (size_t di = 0; di < 4; di++)
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
      moe_tensor *x = rand_tensor(ctx, 2, shapes[si], dts[di], -3.0, 2.0);
      EXPECT(x != NULL);
      if (!x) continue;
      for (int b = 0; b < 2; b++) {
        int bits = b ? 4 : 8;
        const int64_t *gs = bits == 8 ? groups8 : groups4;
        int ng = bits == 8 ? 3 : 4;
        for (int gi = 0; gi < ng; gi++) {
          moe_quant_opts o = {bits, gs[gi], false};
          moe_qtensor q;
          EXPECT_OK(moe_quantize(ctx, x, &o, &q));
          if (!q.values) continue;
          EXPECT(q.dtype == x->dtype && q.ndim == 2 && q.shape[1] == shapes[si][1]);
          check_against_naive(ctx, x, &q, gs[gi]);
          moe_qtensor_clear(&q);
        }
      }
      moe_tensor_release(x);
    }
}

/* A 3-d input keeps its shape; the bound holds per row of the last dim. */
static void test_shapes(moe_ctx *ctx) {
  moe_rng_seed(ctx, 12);
  moe_tensor *x = rand_tensor(ctx, 3, (const int64_t[]){2, 3, 50}, MOE_F32, -1.0, 1.0);
  moe_quant_opts o = moe_quant_opts_default(4);
  moe_qtensor q;
  EXPECT_OK(moe_quantize(ctx, x, &o, &q));
  EXPECT(q.values && q.values->ndim == 2 && q.values->shape[0] == 6 && q.values->shape[1] == 25);
  EXPECT(q.scales && q.scales->shape[0] == 6 && q.scales->shape[1] == 1);
  EXPECT(moe_qtensor_nbytes(&q) == 6 * 25 + 6 * 4);
  moe_tensor *y = NULL;
  EXPECT_OK(moe_dequantize(ctx, &q, &y));
  EXPECT(y && y->ndim == 3 && y->shape[0] == 2 && y->shape[1] == 3 && y->shape[2] == 50);
  moe_qtensor_clear(&q);
  moe_tensor_release(y);
  /* strided input: the same as its contiguous copy */
  moe_tensor *xt = NULL, *xc = NULL;
  EXPECT_OK(moe_transpose(ctx, x, 0, 2, &xt));
  EXPECT_OK(moe_clone(ctx, xt, &xc));
  moe_qtensor qa, qb;
  o = moe_quant_opts_default(8);
  EXPECT_OK(moe_quantize(ctx, xt, &o, &qa));
  EXPECT_OK(moe_quantize(ctx, xc, &o, &qb));
  moe_tensor *ya = NULL, *yb = NULL;
  EXPECT_OK(moe_dequantize(ctx, &qa, &ya));
  EXPECT_OK(moe_dequantize(ctx, &qb, &yb));
  EXPECT(ya && yb && ya->ndim == 3 && ya->shape[0] == 50 && ya->shape[2] == 2);
  double *va = ya ? values_of(ctx, ya) : NULL, *vb = yb ? values_of(ctx, yb) : NULL;
  EXPECT(va && vb && memcmp(va, vb, sizeof(double) * 300) == 0);
  free(va), free(vb);
  moe_qtensor_clear(&qa), moe_qtensor_clear(&qb);
  moe_tensor_release(ya), moe_tensor_release(yb);
  moe_tensor_release(xt), moe_tensor_release(xc), moe_tensor_release(x);
}

/* Rows read in place (narrow views of the last dim, as the gate/up halves
 * of a (n, 2f) pre-activation; a 3-D view whose leading dims collapse; a
 * view with a size-1 dim) give the same codes and scales as their
 * contiguous copies, for 8 and 4 bits and stochastic rounding (whose
 * counters are logical indices, not storage offsets). */
static void test_strided_rows(moe_ctx *ctx) {
  moe_rng_seed(ctx, 13);
  moe_tensor *h = rand_tensor(ctx, 3, (const int64_t[]){3, 5, 40}, MOE_BF16, -3.0, 3.0);
  moe_tensor *views[3] = {NULL, NULL, NULL}, *tmp = NULL;
  EXPECT_OK(moe_narrow(ctx, h, 2, 20, 20, &views[0])); /* (3, 5, 20), ld 40 */
  EXPECT_OK(moe_narrow(ctx, h, 2, 3, 17, &views[1]));  /* odd start and width */
  EXPECT_OK(moe_narrow(ctx, h, 1, 2, 1, &tmp));        /* (3, 1, 40) */
  if (tmp) EXPECT_OK(moe_narrow(ctx, tmp, 2, 0, 24, &views[2]));
  moe_tensor_release(tmp);
  int bad = 0;
  for (int v = 0; v < 3; v++)
    for (int b = 0; views[v] && b < 2; b++)
      for (int stoch = 0; stoch < 2; stoch++) {
        moe_tensor *c = NULL;
        EXPECT_OK(moe_clone(ctx, views[v], &c));
        moe_quant_opts o = {b ? 4 : 8, b ? 8 : 0, stoch != 0};
        moe_qtensor qa, qb;
        uint64_t seed, call;
        moe_rng_get_state(ctx, &seed, &call);
        EXPECT_OK(moe_quantize(ctx, views[v], &o, &qa));
        moe_rng_set_state(ctx, seed, call);
        EXPECT_OK(moe_quantize(ctx, c, &o, &qb));
        bool same = qa.values && qb.values &&
                    memcmp(moe_tensor_data(qa.values), moe_tensor_data(qb.values),
                           (size_t)moe_qtensor_nbytes(&qa) - 4 * (size_t)moe_tensor_numel(qa.scales)) == 0 &&
                    memcmp(moe_tensor_data(qa.scales), moe_tensor_data(qb.scales),
                           4 * (size_t)moe_tensor_numel(qa.scales)) == 0;
        if (!same) bad++;
        moe_qtensor_clear(&qa), moe_qtensor_clear(&qb);
        moe_tensor_release(c);
      }
  EXPECT(bad == 0);
  for (int v = 0; v < 3; v++) moe_tensor_release(views[v]);
  moe_tensor_release(h);
}

/* The layout on a worked example: 4 bits, one group, absmax 7 -> scale 1;
 * codes 1, -1, 0 (0.5 rounds to even), 7, -2 (-2.4); nibbles q + 8 low
 * first: 9 | 7 << 4 = 121, 8 | 15 << 4 = 248, 6 (odd row: high nibble 0). */
static void test_layout(moe_ctx *ctx) {
  moe_tensor *x = NULL, *v = NULL, *y = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, (const double[]){1, -1, 0.5, 7, -2.4}, 2,
                                (const int64_t[]){1, 5}, MOE_F32, MOE_CPU, &x));
  moe_quant_opts o = moe_quant_opts_default(4);
  moe_qtensor q;
  EXPECT_OK(moe_quantize(ctx, x, &o, &q));
  EXPECT_OK(moe_to(ctx, q.values, MOE_I64, MOE_CPU, &v));
  EXPECT_VALUES(v, 0, 121, 248, 6);
  EXPECT_VALUES(q.scales, 0, 1);
  EXPECT_OK(moe_dequantize(ctx, &q, &y));
  EXPECT_VALUES(y, 0, 1, -1, 0, 7, -2);
  moe_qtensor_clear(&q);
  moe_tensor_release(v), moe_tensor_release(y);
  /* 8 bits: absmax 7 -> scale 7/127; 0.5 / (7/127) = 9.07 -> 9 */
  o = moe_quant_opts_default(8);
  EXPECT_OK(moe_quantize(ctx, x, &o, &q));
  EXPECT_OK(moe_to(ctx, q.values, MOE_I64, MOE_CPU, &v));
  EXPECT_VALUES(v, 0, 18, -18, 9, 127, -44);
  moe_qtensor_clear(&q);
  moe_tensor_release(v), moe_tensor_release(x);
}

/* Zero rows give zero scales and zeros; a NaN makes its group NaN; empty and
 * 0-dim tensors work. */
static void test_special(moe_ctx *ctx) {
  moe_tensor *x = NULL, *y = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, (const double[]){0, 0, 0, 1, NAN, 2}, 2,
                                (const int64_t[]){2, 3}, MOE_F32, MOE_CPU, &x));
  for (int b = 0; b < 2; b++) {
    moe_quant_opts o = moe_quant_opts_default(b ? 4 : 8);
    moe_qtensor q;
    EXPECT_OK(moe_quantize(ctx, x, &o, &q));
    EXPECT_OK(moe_dequantize(ctx, &q, &y));
    EXPECT_VALUES(y, 0, 0, 0, 0, NAN, NAN, NAN);
    moe_qtensor_clear(&q);
    moe_tensor_release(y);
  }
  moe_tensor_release(x);
  const int64_t empty[] = {0, 5}, none[] = {4, 0};
  for (int i = 0; i < 2; i++) {
    EXPECT_OK(moe_tensor_empty(ctx, 2, i ? none : empty, MOE_BF16, MOE_CPU, &x));
    moe_quant_opts o = moe_quant_opts_default(4);
    moe_qtensor q;
    EXPECT_OK(moe_quantize(ctx, x, &o, &q));
    EXPECT_OK(moe_dequantize(ctx, &q, &y));
    EXPECT(y && moe_tensor_numel(y) == 0 && y->dtype == MOE_BF16 && y->shape[0] == x->shape[0]);
    moe_qtensor_clear(&q);
    moe_tensor_release(y), moe_tensor_release(x);
  }
  /* subnormal scales (f32 values ~1e-40): 1 / scale overflows, so these
   * groups divide instead of multiplying by the reciprocal; codes exact */
  {
    double tiny[16];
    for (int i = 0; i < 16; i++) tiny[i] = (i - 7.5) * 1e-40 * (i % 3 ? 1 : -1);
    EXPECT_OK(moe_tensor_from_f64(ctx, tiny, 2, (const int64_t[]){2, 8}, MOE_F32, MOE_CPU, &x));
    for (int b = 0; b < 2; b++) {
      moe_quant_opts o = moe_quant_opts_default(b ? 4 : 8);
      moe_qtensor q;
      EXPECT_OK(moe_quantize(ctx, x, &o, &q));
      if (q.values) check_against_naive(ctx, x, &q, o.group_size);
      moe_qtensor_clear(&q);
    }
    moe_tensor_release(x);
  }
  EXPECT_OK(moe_tensor_full(ctx, 0, NULL, -2.5, MOE_F32, MOE_CPU, &x));
  moe_quant_opts o = moe_quant_opts_default(8);
  moe_qtensor q;
  EXPECT_OK(moe_quantize(ctx, x, &o, &q));
  EXPECT_OK(moe_dequantize(ctx, &q, &y));
  EXPECT(y && y->ndim == 0);
  EXPECT_VALUES(y, 1e-6, -2.5);
  moe_qtensor_clear(&q);
  moe_tensor_release(y), moe_tensor_release(x);
}

/* Stochastic rounding: each value lands on one of its two neighbouring
 * codes, the mean over many draws is the value (unbiased), and the same RNG
 * state gives the same codes. */
static void test_stochastic(moe_ctx *ctx) {
  /* 4 bits, absmax 7 -> scale 1: x' in {floor(x), ceil(x)} */
  const double xs[] = {7, 2.3, -4.6, 0.25, -0.5, 5.9};
  moe_tensor *x = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, xs, 2, (const int64_t[]){1, 6}, MOE_F32, MOE_CPU, &x));
  moe_quant_opts o = {4, 0, true};
  moe_rng_seed(ctx, 5);
  const int n = 4000;
  double sum[6] = {0};
  int off_grid = 0;
  for (int it = 0; it < n && x; it++) {
    moe_qtensor q;
    moe_tensor *y = NULL;
    EXPECT_OK(moe_quantize(ctx, x, &o, &q));
    EXPECT_OK(moe_dequantize(ctx, &q, &y));
    double v[6];
    if (y && moe_tensor_to_f64(ctx, y, v) == MOE_OK)
      for (int i = 0; i < 6; i++) {
        sum[i] += v[i];
        if (v[i] != floor(xs[i]) && v[i] != ceil(xs[i])) off_grid++;
      }
    moe_qtensor_clear(&q);
    moe_tensor_release(y);
  }
  EXPECT(off_grid == 0);
  /* a Bernoulli mean over 4000 draws: std <= 0.5 / sqrt(4000) = 0.008; 0.04 is 5 sigma */
  for (int i = 0; i < 6; i++) EXPECT_NEAR(sum[i] / n, xs[i], 0.04);
  /* reproducible: the same RNG state gives the same codes; the next call differs */
  moe_tensor *big = rand_tensor(ctx, 2, (const int64_t[]){8, 256}, MOE_F32, -1, 1);
  uint64_t seed, call;
  moe_rng_get_state(ctx, &seed, &call);
  moe_qtensor a, b, c;
  EXPECT_OK(moe_quantize(ctx, big, &o, &a));
  EXPECT_OK(moe_quantize(ctx, big, &o, &c));
  moe_rng_set_state(ctx, seed, call);
  EXPECT_OK(moe_quantize(ctx, big, &o, &b));
  EXPECT(a.values && b.values && c.values &&
         memcmp(moe_tensor_data(a.values), moe_tensor_data(b.values), 8 * 128) == 0);
  EXPECT(a.values && c.values &&
         memcmp(moe_tensor_data(a.values), moe_tensor_data(c.values), 8 * 128) != 0);
  /* deterministic rounding does not advance the RNG */
  moe_quant_opts od = moe_quant_opts_default(8);
  moe_qtensor d;
  moe_rng_get_state(ctx, &seed, &call);
  EXPECT_OK(moe_quantize(ctx, big, &od, &d));
  uint64_t seed2, call2;
  moe_rng_get_state(ctx, &seed2, &call2);
  EXPECT(call2 == call);
  moe_qtensor_clear(&a), moe_qtensor_clear(&b), moe_qtensor_clear(&c), moe_qtensor_clear(&d);
  moe_tensor_release(big), moe_tensor_release(x);
}

static void test_errors(moe_ctx *ctx) {
  moe_tensor *x = rand_tensor(ctx, 2, (const int64_t[]){4, 8}, MOE_F32, -1, 1), *y = NULL;
  moe_tensor *xi = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, 1, (const int64_t[]){4}, MOE_I64, MOE_CPU, &xi));
  moe_qtensor q;
  moe_quant_opts o = {3, 0, false};
  EXPECT_ERR_MSG(moe_quantize(ctx, x, &o, &q), MOE_ERR_INVALID_ARG, "quantize: bits must be 8 or 4, got 3");
  EXPECT(q.values == NULL);
  o = (moe_quant_opts){4, 3, false};
  EXPECT_ERR_MSG(moe_quantize(ctx, x, &o, &q), MOE_ERR_INVALID_ARG, "group_size must be even for 4 bits");
  o = (moe_quant_opts){8, -1, false};
  EXPECT_ERR_MSG(moe_quantize(ctx, x, &o, &q), MOE_ERR_INVALID_ARG, "group_size must be >= 0");
  o = moe_quant_opts_default(8);
  EXPECT_ERR_MSG(moe_quantize(ctx, xi, &o, &q), MOE_ERR_DTYPE, "quantize: dtype i64 is not supported");
  EXPECT_ERR(moe_quantize(ctx, NULL, &o, &q), MOE_ERR_INVALID_ARG);
  EXPECT_ERR(moe_quantize(ctx, x, NULL, &q), MOE_ERR_INVALID_ARG);
  /* dequantize checks a hand-built q */
  EXPECT_OK(moe_quantize(ctx, x, &o, &q));
  moe_qtensor bad = q;
  bad.shape[1] = 9;
  EXPECT_ERR_MSG(moe_dequantize(ctx, &bad, &y), MOE_ERR_SHAPE,
                 "dequantize: values must be a contiguous i8 tensor of shape [4, 9]");
  bad = q;
  bad.bits = 4;
  EXPECT_ERR_MSG(moe_dequantize(ctx, &bad, &y), MOE_ERR_SHAPE, "values must be a contiguous u8");
  bad = q;
  bad.group_size = 2;
  EXPECT_ERR_MSG(moe_dequantize(ctx, &bad, &y), MOE_ERR_SHAPE, "scales must be a contiguous f32 tensor of shape [4, 4]");
  bad = q;
  bad.dtype = MOE_I32;
  EXPECT_ERR(moe_dequantize(ctx, &bad, &y), MOE_ERR_DTYPE);
  bad = q;
  bad.scales = NULL;
  EXPECT_ERR(moe_dequantize(ctx, &bad, &y), MOE_ERR_INVALID_ARG);
  EXPECT(y == NULL);
  moe_qtensor_clear(&q);
  moe_quant_hooks_opts ho = moe_quant_hooks_opts_default(5);
  EXPECT_ERR_MSG(moe_quantize_hooks_push(ctx, &ho), MOE_ERR_INVALID_ARG, "quantize_hooks_push: bits must be 8 or 4, got 5");
  ho = moe_quant_hooks_opts_default(8);
  ho.n_keep = 1;
  EXPECT_ERR(moe_quantize_hooks_push(ctx, &ho), MOE_ERR_INVALID_ARG);
  ho.n_keep = 0;
  ho.min_numel = -1;
  EXPECT_ERR(moe_quantize_hooks_push(ctx, &ho), MOE_ERR_INVALID_ARG);
  EXPECT_ERR(moe_saved_hooks_pop(ctx), MOE_ERR_INVALID_ARG); /* nothing was pushed */
  moe_tensor_release(x), moe_tensor_release(xi);
}

/* ------------------------------------------------------- saved-tensor hooks */

typedef struct mlp {
  moe_tensor *x, *w1, *w2, *gy; /* x (T, d), w1 (d, f), w2 (f, d), gy (T, d) */
} mlp;

static void mlp_free(mlp *m) {
  moe_tensor_release(m->x), moe_tensor_release(m->w1), moe_tensor_release(m->w2);
  moe_tensor_release(m->gy);
}

static moe_tensor *param(moe_ctx *ctx, int64_t a, int64_t b, moe_dtype dt, double s) {
  moe_tensor *t = rand_tensor(ctx, 2, (const int64_t[]){a, b}, dt, -s, s);
  if (t) moe_set_requires_grad(ctx, t, true);
  return t;
}

static void mlp_init(moe_ctx *ctx, mlp *m, int64_t T, int64_t d, int64_t f, moe_dtype dt) {
  moe_rng_seed(ctx, 99);
  m->x = param(ctx, T, d, dt, 1.0);
  m->w1 = param(ctx, d, f, dt, 1.0 / sqrt((double)d));
  m->w2 = param(ctx, f, d, dt, 1.0 / sqrt((double)f));
  m->gy = rand_tensor(ctx, 2, (const int64_t[]){T, d}, dt, -1, 1);
}

/* y = gelu(x @ w1) @ w2, backward with gy; grads left in the leaves. When
 * saved_bytes is given: host bytes still allocated after the forward once
 * every intermediate but y is released (what autograd keeps for backward),
 * with x's own storage counted only when something saved it. */
static void mlp_step(moe_ctx *ctx, mlp *m, int64_t *saved_bytes) {
  moe_tensor *h = NULL, *a = NULL, *y = NULL;
  moe_memory_stats s0, s1;
  moe_memory_stats_get(ctx, MOE_CPU, &s0);
  /* x goes through a copy that the step owns, so that releasing it frees its
   * storage unless autograd saved it */
  moe_tensor *xin = NULL;
  EXPECT_OK(moe_binary_scalar(ctx, MOE_OP_MUL, m->x, 1.0, false, &xin));
  EXPECT_OK(moe_matmul(ctx, xin, m->w1, &h));
  EXPECT_OK(moe_gelu(ctx, h, &a));
  EXPECT_OK(moe_matmul(ctx, a, m->w2, &y));
  moe_tensor_release(xin), moe_tensor_release(h), moe_tensor_release(a);
  moe_memory_stats_get(ctx, MOE_CPU, &s1);
  if (saved_bytes && y)
    *saved_bytes = s1.allocated - s0.allocated -
                   moe_tensor_numel(y) * (int64_t)moe_dtype_size(y->dtype);
  if (y) EXPECT_OK(moe_backward(ctx, y, m->gy, false));
  moe_tensor_release(y);
}

/* ||a - b|| / ||b|| of two same-shaped tensors. */
static double rel_err(moe_ctx *ctx, const moe_tensor *a, const moe_tensor *b) {
  if (!a || !b) return INFINITY;
  double *va = values_of(ctx, a), *vb = values_of(ctx, b);
  double num = 0, den = 0;
  for (int64_t i = 0; va && vb && i < moe_tensor_numel(a); i++) {
    num += (va[i] - vb[i]) * (va[i] - vb[i]);
    den += vb[i] * vb[i];
  }
  free(va), free(vb);
  return sqrt(num / (den > 0 ? den : 1));
}

static void grads_clear(moe_ctx *ctx, mlp *m) {
  moe_tensor_set_grad(ctx, m->x, NULL);
  moe_tensor_set_grad(ctx, m->w1, NULL);
  moe_tensor_set_grad(ctx, m->w2, NULL);
}

/* Gradient error bounds and saved bytes of the MLP under the hooks. Bounds:
 * 8 bits rounds each activation by <= absmax / 254 (~0.4% of the row's
 * largest value, ~1% relative on a uniform row): gradients within 2%;
 * 4 bits by <= absmax / 14: the rounding error is about uniform in
 * +-scale / 2 (rms absmax / (7 sqrt 12) = 4% of the group's absmax) while
 * the rms of a gelu output (half near zero) is ~25% of its absmax: ~16%
 * relative error, bounded at 25%. Memory: bf16 activations,
 * 8 bits keep about half (codes + one f32 scale per row), 4 bits at least
 * 3.5x less (two codes a byte + one f32 scale per 128). */
static void test_hooks_mlp(moe_ctx *ctx) {
  const moe_dtype dts[] = {MOE_F32, MOE_BF16};
  for (int di = 0; di < 2; di++) {
    mlp m;
    mlp_init(ctx, &m, 64, 96, 256, dts[di]);
    moe_tensor *ref[3] = {NULL, NULL, NULL};
    int64_t off_bytes = 0;
    mlp_step(ctx, &m, &off_bytes);
    ref[0] = moe_tensor_grad(m.x), ref[1] = moe_tensor_grad(m.w1), ref[2] = moe_tensor_grad(m.w2);
    for (int i = 0; i < 3; i++) moe_tensor_retain(ref[i]);
    for (int b = 0; b < 2; b++) {
      int bits = b ? 4 : 8;
      grads_clear(ctx, &m);
      moe_quant_hooks_opts ho = moe_quant_hooks_opts_default(bits);
      ho.n_keep = 2;
      ho.keep = (moe_tensor *const[]){m.w1, m.w2};
      int64_t q_bytes = 0;
      EXPECT_OK(moe_quantize_hooks_push(ctx, &ho));
      mlp_step(ctx, &m, &q_bytes);
      EXPECT_OK(moe_saved_hooks_pop(ctx));
      double bound = bits == 8 ? 0.02 : 0.25;
      double e0 = rel_err(ctx, moe_tensor_grad(m.x), ref[0]);
      double e1 = rel_err(ctx, moe_tensor_grad(m.w1), ref[1]);
      double e2 = rel_err(ctx, moe_tensor_grad(m.w2), ref[2]);
      printf("  mlp %s %d bits: grad rel err x %.4f w1 %.4f w2 %.4f; saved %lld -> %lld bytes "
             "(%.2fx)\n",
             moe_dtype_name(dts[di]), bits, e0, e1, e2, (long long)off_bytes, (long long)q_bytes,
             q_bytes ? (double)off_bytes / (double)q_bytes : 0.0);
      EXPECT(e0 < bound && e1 < bound && e2 < bound);
      EXPECT(e0 > 0 || e1 > 0 || e2 > 0); /* something was quantized */
      if (dts[di] == MOE_BF16) {
        if (bits == 8) EXPECT(q_bytes * 2 <= off_bytes * 1.05 && q_bytes * 2 >= off_bytes * 0.95);
        else EXPECT(q_bytes * 3.5 <= off_bytes);
      } else {
        EXPECT(q_bytes * (bits == 8 ? 3.5 : 6.5) <= off_bytes);
      }
    }
    for (int i = 0; i < 3; i++) moe_tensor_release(ref[i]);
    grads_clear(ctx, &m);
    mlp_free(&m);
  }
}

/* Without keep the weights are quantized too (larger gradient error); f64,
 * integer and small tensors pass through bit for bit. */
static void test_hooks_passthrough(moe_ctx *ctx) {
  mlp m;
  mlp_init(ctx, &m, 16, 24, 40, MOE_F64);
  mlp_step(ctx, &m, NULL);
  moe_tensor *ref = moe_tensor_grad(m.w1);
  moe_tensor_retain(ref);
  grads_clear(ctx, &m);
  moe_quant_hooks_opts ho = moe_quant_hooks_opts_default(4);
  ho.min_numel = 0;
  EXPECT_OK(moe_quantize_hooks_push(ctx, &ho));
  mlp_step(ctx, &m, NULL);
  EXPECT_OK(moe_saved_hooks_pop(ctx));
  EXPECT(rel_err(ctx, moe_tensor_grad(m.w1), ref) == 0.0); /* f64: not quantized */
  moe_tensor_release(ref);
  grads_clear(ctx, &m);
  mlp_free(&m);
  /* small f32 tensors (below min_numel) pass through; with min_numel 0 they do not */
  mlp_init(ctx, &m, 4, 6, 8, MOE_F32);
  mlp_step(ctx, &m, NULL);
  ref = moe_tensor_grad(m.w1);
  moe_tensor_retain(ref);
  for (int i = 0; i < 2; i++) {
    grads_clear(ctx, &m);
    ho = moe_quant_hooks_opts_default(4);
    ho.min_numel = i ? 0 : 1024;
    EXPECT_OK(moe_quantize_hooks_push(ctx, &ho));
    mlp_step(ctx, &m, NULL);
    EXPECT_OK(moe_saved_hooks_pop(ctx));
    double e = rel_err(ctx, moe_tensor_grad(m.w1), ref);
    EXPECT(i ? (e > 0 && e < 0.3) : e == 0.0);
  }
  moe_tensor_release(ref);
  grads_clear(ctx, &m);
  mlp_free(&m);
}

/* An attention-like block: p = softmax(q k^T / sqrt(d)), o = p v; saved
 * softmax outputs and operands quantized to 8 bits give gradients within 3%
 * (p's entries are in [0, 1]: row absmax / 254 <= 0.4% each). */
static void test_hooks_attention(moe_ctx *ctx) {
  moe_rng_seed(ctx, 7);
  const int64_t S = 48, d = 32;
  moe_tensor *q = param(ctx, S, d, MOE_F32, 1), *k = param(ctx, S, d, MOE_F32, 1);
  moe_tensor *v = param(ctx, S, d, MOE_F32, 1);
  moe_tensor *go = rand_tensor(ctx, 2, (const int64_t[]){S, d}, MOE_F32, -1, 1);
  moe_tensor *ref[3] = {NULL, NULL, NULL};
  for (int pass = 0; pass < 2; pass++) {
    if (pass) EXPECT_OK(moe_quantize_hooks_push(ctx, &(moe_quant_hooks_opts){{8, 0, false}, 0, 0, NULL}));
    moe_tensor *kt = NULL, *sc = NULL, *sc2 = NULL, *p = NULL, *o = NULL;
    EXPECT_OK(moe_transpose(ctx, k, 0, 1, &kt));
    EXPECT_OK(moe_matmul(ctx, q, kt, &sc));
    EXPECT_OK(moe_binary_scalar(ctx, MOE_OP_MUL, sc, 1.0 / sqrt((double)d), false, &sc2));
    EXPECT_OK(moe_softmax(ctx, sc2, -1, &p));
    EXPECT_OK(moe_matmul(ctx, p, v, &o));
    if (pass) EXPECT_OK(moe_saved_hooks_pop(ctx));
    if (o) EXPECT_OK(moe_backward(ctx, o, go, false));
    moe_tensor_release(kt), moe_tensor_release(sc), moe_tensor_release(sc2);
    moe_tensor_release(p), moe_tensor_release(o);
    moe_tensor *leaves[3] = {q, k, v};
    if (!pass) {
      for (int i = 0; i < 3; i++) {
        ref[i] = moe_tensor_grad(leaves[i]);
        moe_tensor_retain(ref[i]);
        moe_tensor_set_grad(ctx, leaves[i], NULL);
      }
    } else {
      for (int i = 0; i < 3; i++) {
        double e = rel_err(ctx, moe_tensor_grad(leaves[i]), ref[i]);
        printf("  attention 8 bits: grad %d rel err %.4f\n", i, e);
        EXPECT(e > 0 && e < 0.03);
        moe_tensor_set_grad(ctx, leaves[i], NULL);
      }
    }
  }
  for (int i = 0; i < 3; i++) moe_tensor_release(ref[i]);
  moe_tensor_release(q), moe_tensor_release(k), moe_tensor_release(v), moe_tensor_release(go);
}

int main(void) {
  RUN(test_roundtrip);
  RUN(test_shapes);
  RUN(test_strided_rows);
  RUN(test_layout);
  RUN(test_special);
  RUN(test_stochastic);
  RUN(test_errors);
  RUN(test_hooks_mlp);
  RUN(test_hooks_passthrough);
  RUN(test_hooks_attention);
  return harness_end();
}
