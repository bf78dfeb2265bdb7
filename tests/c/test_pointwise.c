/*
 * test_pointwise.c - the pointwise family on the CPU (moe_pointwise.h):
 * values of every op against naive double-precision references (f32, f64,
 * bf16; contiguous and non-contiguous), broadcasting and dtype rules,
 * comparisons, where, maximum/minimum (ties split equally), clamp (absent
 * bounds, NaN, integers), swiglu, dropout masks against Philox drawn here,
 * finite-difference gradient checks in f64 of every differentiable op on
 * contiguous and non-contiguous leaves, and the error paths.
 */
#include "gradcheck.h"
#include "harness.h"
#include "philox.h"

#define SHAPE(...) (int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (int64_t[]){__VA_ARGS__}

static moe_tensor *vals(moe_ctx *ctx, moe_dtype dt, int ndim, const int64_t *shape,
                        const double *v) {
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, v, ndim, shape, dt, MOE_CPU, &t));
  return t;
}

/* A random f64 leaf in [lo, hi) that requires grad. */
static moe_tensor *leaf(moe_ctx *ctx, int ndim, const int64_t *shape, double lo, double hi) {
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, ndim, shape, MOE_F64, MOE_CPU, &t));
  EXPECT_OK(moe_uniform_(ctx, t, lo, hi));
  EXPECT_OK(moe_set_requires_grad(ctx, t, true));
  return t;
}

/* A non-contiguous f64 leaf of a 2-d shape: the transpose of a narrowed
 * random tensor (made without grad history, then set to require grad). */
static moe_tensor *leaf_view(moe_ctx *ctx, int64_t rows, int64_t cols, double lo, double hi) {
  moe_tensor *base = NULL, *t = NULL, *v = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, SHAPE(cols + 2, rows), MOE_F64, MOE_CPU, &base));
  EXPECT_OK(moe_uniform_(ctx, base, lo, hi));
  EXPECT_OK(moe_narrow(ctx, base, 0, 1, cols, &t));
  EXPECT_OK(moe_transpose(ctx, t, 0, 1, &v));
  EXPECT(v && !moe_tensor_is_contiguous(v));
  EXPECT_OK(moe_set_requires_grad(ctx, v, true));
  moe_tensor_release(t);
  moe_tensor_release(base);
  return v;
}

/* Every element of t within rtol * max(1, |want|) of want (NaN matches NaN). */
static bool close_to(moe_ctx *ctx, const moe_tensor *t, const double *want, int64_t n,
                     double rtol, const char *what) {
  if (!t || moe_tensor_numel(t) != n) {
    fprintf(stderr, "%s: wrong element count\n", what);
    return false;
  }
  double *got = malloc(sizeof(double) * (size_t)(n ? n : 1));
  bool ok = moe_tensor_to_f64(ctx, t, got) == MOE_OK;
  for (int64_t i = 0; ok && i < n; i++) {
    bool same = (isnan(got[i]) && isnan(want[i])) || got[i] == want[i] ||
                fabs(got[i] - want[i]) <= rtol * fmax(1.0, fabs(want[i]));
    if (!same) {
      fprintf(stderr, "%s: element %lld is %.9g, wanted %.9g (rtol %g)\n", what, (long long)i,
              got[i], want[i], rtol);
      ok = false;
    }
  }
  free(got);
  return ok;
}

/* ------------------------------------------------------ unary references */

typedef moe_status (*unary_fn)(moe_ctx *, moe_tensor *, moe_tensor **);

static double ref_relu(double x) { return x > 0 ? x : 0; }
static double ref_gelu(double x) { return 0.5 * x * (1 + erf(x / sqrt(2.0))); }
static double ref_gelu_tanh(double x) {
  return 0.5 * x * (1 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}
static double ref_silu(double x) { return x / (1 + exp(-x)); }
static double ref_sigmoid(double x) { return 1 / (1 + exp(-x)); }
static double ref_rsqrt(double x) { return 1 / sqrt(x); }

typedef struct unary_case {
  const char *name;
  unary_fn fn;
  double (*ref)(double);
  bool positive; /* domain x > 0 */
} unary_case;

static const unary_case unary_cases[] = {
    {"exp", moe_exp, exp, false},          {"log", moe_log, log, true},
    {"sqrt", moe_sqrt, sqrt, true},        {"rsqrt", moe_rsqrt, ref_rsqrt, true},
    {"abs", moe_abs, fabs, false},         {"relu", moe_relu, ref_relu, false},
    {"gelu", moe_gelu, ref_gelu, false},   {"gelu_tanh", moe_gelu_tanh, ref_gelu_tanh, false},
    {"silu", moe_silu, ref_silu, false},   {"sigmoid", moe_sigmoid, ref_sigmoid, false},
    {"tanh", moe_tanh, tanh, false},
};
#define N_UNARY (int)(sizeof(unary_cases) / sizeof(unary_cases[0]))

static void test_unary_values(moe_ctx *ctx) {
  double xs[12];
  for (int i = 0; i < 12; i++) xs[i] = -3.1 + 0.55 * i; /* -3.1 .. 2.95, never 0 */
  /* f32: float math of libm-accurate calls, a few ulp; f64: double libm,
   * formulas differ from the references by rounding only; bf16: output
   * rounding to 8 bits of mantissa (2^-8 relative). */
  const moe_dtype dts[3] = {MOE_F32, MOE_F64, MOE_BF16};
  const double rtol[3] = {2e-6, 1e-13, 8e-3};
  for (int c = 0; c < N_UNARY; c++) {
    const unary_case *uc = &unary_cases[c];
    double in[12];
    for (int i = 0; i < 12; i++) in[i] = uc->positive ? fabs(xs[i]) : xs[i];
    for (int k = 0; k < 3; k++) {
      moe_tensor *x = vals(ctx, dts[k], SHAPE(3, 4), in), *y = NULL;
      double xr[12], want[12];
      EXPECT_OK(moe_tensor_to_f64(ctx, x, xr)); /* the input as stored (bf16 rounds) */
      for (int i = 0; i < 12; i++) want[i] = uc->ref(xr[i]);
      EXPECT_OK(uc->fn(ctx, x, &y));
      EXPECT(y && y->dtype == dts[k] && y->ndim == 2 && y->shape[0] == 3 && y->shape[1] == 4);
      if (!close_to(ctx, y, want, 12, rtol[k], uc->name)) {
        harness_failures++;
        fprintf(stderr, "  (%s in %s)\n", uc->name, moe_dtype_name(dts[k]));
      }
      /* a transposed (non-contiguous) view gives the transposed values */
      moe_tensor *xt = NULL, *yt = NULL;
      EXPECT_OK(moe_transpose(ctx, x, 0, 1, &xt));
      EXPECT_OK(uc->fn(ctx, xt, &yt));
      double wt[12];
      for (int i = 0; i < 4; i++)
        for (int j = 0; j < 3; j++) wt[i * 3 + j] = want[j * 4 + i];
      EXPECT(close_to(ctx, yt, wt, 12, rtol[k], uc->name));
      moe_tensor_release(yt);
      moe_tensor_release(xt);
      moe_tensor_release(y);
      moe_tensor_release(x);
    }
  }
}

static void test_unary_special(moe_ctx *ctx) {
  moe_tensor *x = vals(ctx, MOE_F32, SHAPE(5), (double[]){0, -0.0, INFINITY, -INFINITY, NAN});
  moe_tensor *y = NULL;
  EXPECT_OK(moe_relu(ctx, x, &y));
  EXPECT_VALUES(y, 0, 0, 0, INFINITY, 0, NAN);
  moe_tensor_release(y);
  EXPECT_OK(moe_sigmoid(ctx, x, &y));
  EXPECT_VALUES(y, 0, 0.5, 0.5, 1, 0, NAN);
  moe_tensor_release(y);
  EXPECT_OK(moe_log(ctx, x, &y));
  EXPECT_VALUES(y, 0, -INFINITY, -INFINITY, INFINITY, NAN, NAN);
  moe_tensor_release(y);
  moe_tensor_release(x);
  /* abs of integers in int64, stored back (i8 -128 wraps as in PyTorch) */
  moe_tensor *i = vals(ctx, MOE_I8, SHAPE(4), (double[]){-3, 0, 5, -128});
  EXPECT_OK(moe_abs(ctx, i, &y));
  EXPECT(y->dtype == MOE_I8);
  EXPECT_VALUES(y, 0, 3, 0, 5, -128);
  moe_tensor_release(y);
  moe_tensor_release(i);
  /* empty and 0-dim tensors */
  moe_tensor *e = NULL, *s = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, SHAPE(0, 3), MOE_F32, MOE_CPU, &e));
  EXPECT_OK(moe_gelu(ctx, e, &y));
  EXPECT(y && moe_tensor_numel(y) == 0 && y->shape[1] == 3);
  moe_tensor_release(y);
  EXPECT_OK(moe_tensor_full(ctx, 0, NULL, 2.0, MOE_F64, MOE_CPU, &s));
  EXPECT_OK(moe_exp(ctx, s, &y));
  EXPECT(y && y->ndim == 0);
  EXPECT_VALUES(y, 1e-15, exp(2.0));
  moe_tensor_release(y);
  moe_tensor_release(s);
  moe_tensor_release(e);
}

/* -------------------------------------------------------------- powers */

static void test_pow_values(moe_ctx *ctx) {
  moe_tensor *a = vals(ctx, MOE_F32, SHAPE(2, 2), (double[]){1, 2, 3, 4});
  moe_tensor *b = vals(ctx, MOE_F32, SHAPE(2), (double[]){2, 0.5});
  moe_tensor *y = NULL;
  EXPECT_OK(moe_pow_scalar(ctx, a, 2, &y));
  EXPECT_VALUES(y, 1e-6, 1, 4, 9, 16);
  moe_tensor_release(y);
  EXPECT_OK(moe_rpow_scalar(ctx, 2, a, &y));
  EXPECT_VALUES(y, 1e-6, 2, 4, 8, 16);
  moe_tensor_release(y);
  EXPECT_OK(moe_pow(ctx, a, b, &y)); /* b broadcasts along dim 0 */
  EXPECT_VALUES(y, 1e-6, 1, sqrt(2.0), 9, 2);
  moe_tensor_release(y);
  /* f32 ^ f64 promotes to f64 */
  moe_tensor *c = vals(ctx, MOE_F64, SHAPE(1), (double[]){3});
  EXPECT_OK(moe_pow(ctx, a, c, &y));
  EXPECT(y->dtype == MOE_F64);
  EXPECT_VALUES(y, 1e-12, 1, 8, 27, 64);
  moe_tensor_release(y);
  moe_tensor_release(c);
  moe_tensor_release(b);
  moe_tensor_release(a);
}

/* --------------------------------------------------------------- clamp */

static void test_clamp_values(moe_ctx *ctx) {
  moe_tensor *x = vals(ctx, MOE_F32, SHAPE(6), (double[]){-2, -0.5, 0, 0.5, 2, NAN});
  moe_tensor *y = NULL;
  EXPECT_OK(moe_clamp(ctx, x, -1, 1, &y));
  EXPECT_VALUES(y, 0, -1, -0.5, 0, 0.5, 1, NAN);
  moe_tensor_release(y);
  EXPECT_OK(moe_clamp(ctx, x, 0, NAN, &y)); /* min only */
  EXPECT_VALUES(y, 0, 0, 0, 0, 0.5, 2, NAN);
  moe_tensor_release(y);
  EXPECT_OK(moe_clamp(ctx, x, NAN, 0, &y)); /* max only */
  EXPECT_VALUES(y, 0, -2, -0.5, 0, 0, 0, NAN);
  moe_tensor_release(y);
  EXPECT_OK(moe_clamp(ctx, x, 1, -1, &y)); /* min > max: everything is max */
  EXPECT_VALUES(y, 0, -1, -1, -1, -1, -1, NAN);
  moe_tensor_release(y);
  moe_tensor_release(x);
  /* integers: integral bounds keep the dtype; a fractional one gives f32 */
  moe_tensor *i = vals(ctx, MOE_I64, SHAPE(4), (double[]){-5, 0, 3, 9});
  EXPECT_OK(moe_clamp(ctx, i, -1, 4, &y));
  EXPECT(y->dtype == MOE_I64);
  EXPECT_VALUES(y, 0, -1, 0, 3, 4);
  moe_tensor_release(y);
  EXPECT_OK(moe_clamp(ctx, i, NAN, 2.5, &y));
  EXPECT(y->dtype == MOE_F32);
  EXPECT_VALUES(y, 0, -5, 0, 2.5, 2.5);
  moe_tensor_release(y);
  moe_tensor_release(i);
}

/* --------------------------------------------------------- comparisons */

static void test_compare_values(moe_ctx *ctx) {
  moe_tensor *a = vals(ctx, MOE_F32, SHAPE(2, 3), (double[]){1, 2, 3, 4, 5, NAN});
  moe_tensor *b = vals(ctx, MOE_I64, SHAPE(3), (double[]){2, 2, 2});
  moe_tensor *y = NULL;
  const moe_op ops[6] = {MOE_OP_EQ, MOE_OP_NE, MOE_OP_LT, MOE_OP_LE, MOE_OP_GT, MOE_OP_GE};
  const double want[6][6] = {{0, 1, 0, 0, 0, 0}, {1, 0, 1, 1, 1, 1}, {1, 0, 0, 0, 0, 0},
                             {1, 1, 0, 0, 0, 0}, {0, 0, 1, 1, 1, 0}, {0, 1, 1, 1, 1, 0}};
  for (int k = 0; k < 6; k++) {
    EXPECT_OK(moe_compare(ctx, ops[k], a, b, &y)); /* f32 vs broadcast i64 */
    EXPECT(y && y->dtype == MOE_BOOL && y->ndim == 2 && y->shape[1] == 3);
    EXPECT(close_to(ctx, y, want[k], 6, 0, moe_op_name(ops[k])));
    moe_tensor_release(y);
    EXPECT_OK(moe_compare_scalar(ctx, ops[k], a, 2, &y));
    EXPECT(close_to(ctx, y, want[k], 6, 0, moe_op_name(ops[k])));
    moe_tensor_release(y);
  }
  /* integers compare in int64, exactly beyond 2^53 */
  moe_tensor *i = NULL, *j = NULL;
  int64_t big = (INT64_C(1) << 60) + 1;
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(1), 0, MOE_I64, MOE_CPU, &i));
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(1), 0, MOE_I64, MOE_CPU, &j));
  ((int64_t *)moe_tensor_data(i))[0] = big;
  ((int64_t *)moe_tensor_data(j))[0] = big - 1;
  EXPECT_OK(moe_compare(ctx, MOE_OP_GT, i, j, &y));
  EXPECT_VALUES(y, 0, 1);
  moe_tensor_release(y);
  /* an integer tensor against a fractional scalar compares in double */
  moe_tensor *k = vals(ctx, MOE_I32, SHAPE(3), (double[]){1, 2, 3});
  EXPECT_OK(moe_compare_scalar(ctx, MOE_OP_LT, k, 2.5, &y));
  EXPECT_VALUES(y, 0, 1, 1, 0);
  moe_tensor_release(y);
  moe_tensor_release(k);
  moe_tensor_release(j);
  moe_tensor_release(i);
  moe_tensor_release(b);
  moe_tensor_release(a);
}

/* --------------------------------------------------------------- where */

static void test_where_values(moe_ctx *ctx) {
  moe_tensor *c = vals(ctx, MOE_BOOL, SHAPE(2, 1), (double[]){1, 0});
  moe_tensor *a = vals(ctx, MOE_F32, SHAPE(3), (double[]){1, 2, 3});
  moe_tensor *b = vals(ctx, MOE_F64, SHAPE(2, 3), (double[]){-1, -2, -3, -4, -5, -6});
  moe_tensor *y = NULL;
  EXPECT_OK(moe_where(ctx, c, a, b, &y));
  EXPECT(y && y->dtype == MOE_F64 && y->ndim == 2 && y->shape[0] == 2 && y->shape[1] == 3);
  EXPECT_VALUES(y, 0, 1, 2, 3, -4, -5, -6);
  moe_tensor_release(y);
  /* integers */
  moe_tensor *ia = vals(ctx, MOE_I64, SHAPE(2), (double[]){7, 8});
  moe_tensor *ib = vals(ctx, MOE_I64, SHAPE(2), (double[]){-7, -8});
  moe_tensor *ic = vals(ctx, MOE_BOOL, SHAPE(2), (double[]){0, 1});
  EXPECT_OK(moe_where(ctx, ic, ia, ib, &y));
  EXPECT(y->dtype == MOE_I64);
  EXPECT_VALUES(y, 0, -7, 8);
  moe_tensor_release(y);
  moe_tensor_release(ic);
  moe_tensor_release(ib);
  moe_tensor_release(ia);
  moe_tensor_release(b);
  moe_tensor_release(a);
  moe_tensor_release(c);
}

/* ------------------------------------------------------ maximum/minimum */

static void test_maxmin_values(moe_ctx *ctx) {
  moe_tensor *a = vals(ctx, MOE_F32, SHAPE(2, 2), (double[]){1, 5, NAN, -1});
  moe_tensor *b = vals(ctx, MOE_F32, SHAPE(2), (double[]){3, 2});
  moe_tensor *y = NULL;
  EXPECT_OK(moe_maximum(ctx, a, b, &y));
  EXPECT_VALUES(y, 0, 3, 5, NAN, 2);
  moe_tensor_release(y);
  EXPECT_OK(moe_minimum(ctx, a, b, &y));
  EXPECT_VALUES(y, 0, 1, 2, NAN, -1);
  moe_tensor_release(y);
  moe_tensor *i = vals(ctx, MOE_I32, SHAPE(3), (double[]){-4, 0, 9});
  moe_tensor *j = vals(ctx, MOE_I32, SHAPE(3), (double[]){1, -2, 9});
  EXPECT_OK(moe_maximum(ctx, i, j, &y));
  EXPECT(y->dtype == MOE_I32);
  EXPECT_VALUES(y, 0, 1, 0, 9);
  moe_tensor_release(y);
  moe_tensor_release(j);
  moe_tensor_release(i);
  moe_tensor_release(b);
  moe_tensor_release(a);
}

/* Ties split the gradient equally; otherwise it goes to the selected input. */
static void test_maxmin_ties(moe_ctx *ctx) {
  for (int k = 0; k < 2; k++) {
    moe_tensor *a = vals(ctx, MOE_F64, SHAPE(3), (double[]){1, 2, 3});
    moe_tensor *b = vals(ctx, MOE_F64, SHAPE(3), (double[]){1, 0, 5});
    EXPECT_OK(moe_set_requires_grad(ctx, a, true));
    EXPECT_OK(moe_set_requires_grad(ctx, b, true));
    moe_tensor *y = NULL, *g = vals(ctx, MOE_F64, SHAPE(3), (double[]){2, 2, 2});
    EXPECT_OK(k == 0 ? moe_maximum(ctx, a, b, &y) : moe_minimum(ctx, a, b, &y));
    EXPECT_OK(moe_backward(ctx, y, g, false));
    if (k == 0) {
      EXPECT_VALUES(moe_tensor_grad(a), 0, 1, 2, 0);
      EXPECT_VALUES(moe_tensor_grad(b), 0, 1, 0, 2);
    } else {
      EXPECT_VALUES(moe_tensor_grad(a), 0, 1, 0, 2);
      EXPECT_VALUES(moe_tensor_grad(b), 0, 1, 2, 0);
    }
    moe_tensor_release(g);
    moe_tensor_release(y);
    moe_tensor_release(b);
    moe_tensor_release(a);
  }
}

/* -------------------------------------------------------------- swiglu */

static void test_swiglu_values(moe_ctx *ctx) {
  double gv[6] = {-2, -0.5, 0, 0.5, 1, 3}, uv[6] = {1, 2, -1, 0.5, -3, 0.25};
  double want[6];
  for (int i = 0; i < 6; i++) want[i] = ref_silu(gv[i]) * uv[i];
  moe_tensor *g = vals(ctx, MOE_F32, SHAPE(2, 3), gv), *u = vals(ctx, MOE_F32, SHAPE(2, 3), uv);
  moe_tensor *y = NULL;
  EXPECT_OK(moe_swiglu(ctx, g, u, &y));
  EXPECT(close_to(ctx, y, want, 6, 2e-6, "swiglu"));
  moe_tensor_release(y);
  /* equals silu(gate) * up composed of separate ops */
  moe_tensor *s = NULL, *m = NULL;
  EXPECT_OK(moe_silu(ctx, g, &s));
  EXPECT_OK(moe_binary(ctx, MOE_OP_MUL, s, u, &m));
  EXPECT(close_to(ctx, m, want, 6, 2e-6, "silu * up"));
  moe_tensor_release(m);
  moe_tensor_release(s);
  moe_tensor_release(u);
  moe_tensor_release(g);
}

/* ------------------------------------------------------------- dropout */

static void test_dropout(moe_ctx *ctx) {
  const int64_t n = 1000;
  const double p = 0.3;
  moe_tensor *x = NULL, *y = NULL, *y2 = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, SHAPE(40, 25), MOE_F64, MOE_CPU, &x));
  EXPECT_OK(moe_uniform_(ctx, x, 1, 2)); /* never 0, so a kept element is nonzero */
  moe_rng_seed(ctx, 1234);
  uint64_t seed, call;
  moe_rng_get_state(ctx, &seed, &call);
  EXPECT_OK(moe_dropout(ctx, x, p, true, &y));
  uint64_t seed2, call2;
  moe_rng_get_state(ctx, &seed2, &call2);
  EXPECT(seed2 == seed && call2 == call + 1);
  double *xv = malloc(sizeof(double) * n), *yv = malloc(sizeof(double) * n);
  EXPECT_OK(moe_tensor_to_f64(ctx, x, xv));
  EXPECT_OK(moe_tensor_to_f64(ctx, y, yv));
  int64_t kept = 0, bad = 0;
  for (int64_t i = 0; i < n; i++) {
    bool keep = moe_philox_uniform24(seed, call, (uint64_t)i) >= p;
    double want = keep ? xv[i] / (1 - p) : 0;
    kept += keep;
    if (fabs(yv[i] - want) > 1e-12) bad++;
  }
  EXPECT(bad == 0);
  EXPECT(kept > 620 && kept < 780); /* 700 expected; 5+ sigma either side */
  /* reproducible from the same state; a new call draws another mask */
  moe_rng_set_state(ctx, seed, call);
  EXPECT_OK(moe_dropout(ctx, x, p, true, &y2));
  EXPECT(close_to(ctx, y2, yv, n, 0, "dropout again"));
  moe_tensor_release(y2);
  EXPECT_OK(moe_dropout(ctx, x, p, true, &y2));
  double *y2v = malloc(sizeof(double) * n);
  EXPECT_OK(moe_tensor_to_f64(ctx, y2, y2v));
  int64_t differ = 0;
  for (int64_t i = 0; i < n; i++) differ += (yv[i] == 0) != (y2v[i] == 0);
  EXPECT(differ > 100);
  moe_tensor_release(y2);
  /* a transposed view: mask by the row-major index of the view */
  moe_tensor *xt = NULL;
  EXPECT_OK(moe_transpose(ctx, x, 0, 1, &xt));
  moe_rng_get_state(ctx, &seed, &call);
  EXPECT_OK(moe_dropout(ctx, xt, p, true, &y2));
  EXPECT_OK(moe_tensor_to_f64(ctx, y2, y2v));
  bad = 0;
  for (int64_t r = 0; r < 25; r++)
    for (int64_t c = 0; c < 40; c++) {
      int64_t i = r * 40 + c;
      bool keep = moe_philox_uniform24(seed, call, (uint64_t)i) >= p;
      if (fabs(y2v[i] - (keep ? xv[c * 25 + r] / (1 - p) : 0)) > 1e-12) bad++;
    }
  EXPECT(bad == 0);
  moe_tensor_release(y2);
  moe_tensor_release(xt);
  /* bf16 draws the same mask as f64 for the same state */
  moe_tensor *xb = NULL;
  EXPECT_OK(moe_to(ctx, x, MOE_BF16, MOE_CPU, &xb));
  moe_rng_set_state(ctx, 1234, 0);
  moe_tensor *ya = NULL, *yb = NULL;
  EXPECT_OK(moe_dropout(ctx, x, p, true, &ya));
  moe_rng_set_state(ctx, 1234, 0);
  EXPECT_OK(moe_dropout(ctx, xb, p, true, &yb));
  EXPECT_OK(moe_tensor_to_f64(ctx, ya, yv));
  EXPECT_OK(moe_tensor_to_f64(ctx, yb, y2v));
  differ = 0;
  for (int64_t i = 0; i < n; i++) differ += (yv[i] == 0) != (y2v[i] == 0);
  EXPECT(differ == 0);
  moe_tensor_release(yb);
  moe_tensor_release(ya);
  moe_tensor_release(xb);
  /* eval mode and p == 0 return x itself and draw nothing; p == 1 zeroes */
  moe_rng_get_state(ctx, &seed, &call);
  EXPECT_OK(moe_dropout(ctx, x, p, false, &y2));
  EXPECT(y2 == x);
  moe_tensor_release(y2);
  EXPECT_OK(moe_dropout(ctx, x, 0, true, &y2));
  EXPECT(y2 == x);
  moe_tensor_release(y2);
  moe_rng_get_state(ctx, &seed2, &call2);
  EXPECT(call2 == call);
  EXPECT_OK(moe_dropout(ctx, x, 1, true, &y2));
  EXPECT_OK(moe_tensor_to_f64(ctx, y2, y2v));
  bad = 0;
  for (int64_t i = 0; i < n; i++) bad += y2v[i] != 0;
  EXPECT(bad == 0);
  moe_tensor_release(y2);
  free(y2v);
  free(yv);
  free(xv);
  moe_tensor_release(y);
  moe_tensor_release(x);
}

/* ------------------------------------------------------------ gradients */

static moe_status gf_unary(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  return ((const unary_case *)ud)->fn(ctx, in[0], out);
}

static void test_grad_unary(moe_ctx *ctx) {
  for (int c = 0; c < N_UNARY; c++) {
    const unary_case *uc = &unary_cases[c];
    double lo = uc->positive ? 0.3 : -2.5, hi = 2.5;
    moe_tensor *x = leaf(ctx, SHAPE(3, 4), lo, hi);
    moe_tensor *v = leaf_view(ctx, 4, 3, lo, hi);
    bool ok1 = gradcheck(ctx, gf_unary, 1, &x, (void *)uc, 1e-6, 1e-6);
    bool ok2 = gradcheck(ctx, gf_unary, 1, &v, (void *)uc, 1e-6, 1e-6);
    EXPECT(ok1 && ok2);
    if (!ok1 || !ok2) fprintf(stderr, "  (gradcheck of %s)\n", uc->name);
    moe_tensor_release(v);
    moe_tensor_release(x);
  }
}

static moe_status gf_pow_scalar(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  return moe_pow_scalar(ctx, in[0], 2.5, out);
}
static moe_status gf_rpow_scalar(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  return moe_rpow_scalar(ctx, 1.7, in[0], out);
}
static moe_status gf_pow(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  return moe_pow(ctx, in[0], in[1], out);
}
static moe_status gf_clamp(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  const double *b = ud;
  return moe_clamp(ctx, in[0], b[0], b[1], out);
}
static moe_status gf_maximum(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  return moe_maximum(ctx, in[0], in[1], out);
}
static moe_status gf_minimum(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  return moe_minimum(ctx, in[0], in[1], out);
}
static moe_status gf_where(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  return moe_where(ctx, (moe_tensor *)ud, in[0], in[1], out);
}
static moe_status gf_swiglu(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  return moe_swiglu(ctx, in[0], in[1], out);
}
/* Dropout with the generator reset first, so every evaluation draws the
 * mask of the first (the one backward regenerates). */
static moe_status gf_dropout(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  moe_rng_set_state(ctx, 77, 5);
  return moe_dropout(ctx, in[0], 0.4, true, out);
}

static void test_grad_pow(moe_ctx *ctx) {
  moe_tensor *x = leaf(ctx, SHAPE(3, 4), 0.3, 2), *v = leaf_view(ctx, 3, 4, 0.3, 2);
  EXPECT(gradcheck(ctx, gf_pow_scalar, 1, &x, NULL, 1e-6, 1e-6));
  EXPECT(gradcheck(ctx, gf_pow_scalar, 1, &v, NULL, 1e-6, 1e-6));
  EXPECT(gradcheck(ctx, gf_rpow_scalar, 1, &x, NULL, 1e-6, 1e-6));
  EXPECT(gradcheck(ctx, gf_rpow_scalar, 1, &v, NULL, 1e-6, 1e-6));
  /* tensor ^ tensor: same shape (one a view), and b broadcast over rows */
  moe_tensor *in[2] = {v, x};
  EXPECT(gradcheck(ctx, gf_pow, 2, in, NULL, 1e-6, 1e-6));
  moe_tensor *b = leaf(ctx, SHAPE(4), -1, 2);
  in[1] = b;
  EXPECT(gradcheck(ctx, gf_pow, 2, in, NULL, 1e-6, 1e-6));
  moe_tensor_release(b);
  moe_tensor_release(v);
  moe_tensor_release(x);
}

static void test_grad_clamp(moe_ctx *ctx) {
  moe_tensor *x = leaf(ctx, SHAPE(3, 5), -2, 2), *v = leaf_view(ctx, 5, 3, -2, 2);
  double both[2] = {-0.5, 0.7}, lo[2] = {-0.5, NAN}, hi[2] = {NAN, 0.7};
  EXPECT(gradcheck(ctx, gf_clamp, 1, &x, both, 1e-6, 1e-6));
  EXPECT(gradcheck(ctx, gf_clamp, 1, &v, both, 1e-6, 1e-6));
  EXPECT(gradcheck(ctx, gf_clamp, 1, &x, lo, 1e-6, 1e-6));
  EXPECT(gradcheck(ctx, gf_clamp, 1, &v, hi, 1e-6, 1e-6));
  moe_tensor_release(v);
  moe_tensor_release(x);
}

static void test_grad_maxmin(moe_ctx *ctx) {
  moe_tensor *a = leaf(ctx, SHAPE(4, 3), -1, 1), *v = leaf_view(ctx, 4, 3, -1, 1);
  moe_tensor *b = leaf(ctx, SHAPE(3), -1, 1), *c = leaf(ctx, SHAPE(4, 1), -1, 1);
  moe_tensor *in[2] = {a, v};
  EXPECT(gradcheck(ctx, gf_maximum, 2, in, NULL, 1e-6, 1e-6));
  EXPECT(gradcheck(ctx, gf_minimum, 2, in, NULL, 1e-6, 1e-6));
  in[0] = v, in[1] = b; /* broadcast over rows */
  EXPECT(gradcheck(ctx, gf_maximum, 2, in, NULL, 1e-6, 1e-6));
  in[0] = c, in[1] = b; /* both broadcast: (4, 1) with (3) */
  EXPECT(gradcheck(ctx, gf_minimum, 2, in, NULL, 1e-6, 1e-6));
  moe_tensor_release(c);
  moe_tensor_release(b);
  moe_tensor_release(v);
  moe_tensor_release(a);
}

static void test_grad_where(moe_ctx *ctx) {
  moe_tensor *cond = vals(ctx, MOE_BOOL, SHAPE(4, 3), (double[]){1, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 1});
  moe_tensor *a = leaf_view(ctx, 4, 3, -1, 1), *b = leaf(ctx, SHAPE(3), -1, 1);
  moe_tensor *in[2] = {a, b};
  EXPECT(gradcheck(ctx, gf_where, 2, in, cond, 1e-6, 1e-6));
  moe_tensor *c2 = leaf(ctx, SHAPE(4, 3), -1, 1);
  in[0] = b, in[1] = c2;
  EXPECT(gradcheck(ctx, gf_where, 2, in, cond, 1e-6, 1e-6));
  moe_tensor_release(c2);
  moe_tensor_release(b);
  moe_tensor_release(a);
  moe_tensor_release(cond);
}

static void test_grad_swiglu(moe_ctx *ctx) {
  moe_tensor *g = leaf(ctx, SHAPE(3, 4), -3, 3), *u = leaf(ctx, SHAPE(3, 4), -2, 2);
  moe_tensor *gv = leaf_view(ctx, 3, 4, -3, 3), *uv = leaf_view(ctx, 3, 4, -2, 2);
  moe_tensor *in[2] = {g, u};
  EXPECT(gradcheck(ctx, gf_swiglu, 2, in, NULL, 1e-6, 1e-6));
  in[0] = gv, in[1] = uv;
  EXPECT(gradcheck(ctx, gf_swiglu, 2, in, NULL, 1e-6, 1e-6));
  in[0] = g, in[1] = uv;
  EXPECT(gradcheck(ctx, gf_swiglu, 2, in, NULL, 1e-6, 1e-6));
  moe_tensor_release(uv);
  moe_tensor_release(gv);
  moe_tensor_release(u);
  moe_tensor_release(g);
}

static void test_grad_dropout(moe_ctx *ctx) {
  moe_tensor *x = leaf(ctx, SHAPE(5, 7), -1, 1), *v = leaf_view(ctx, 7, 5, -1, 1);
  EXPECT(gradcheck(ctx, gf_dropout, 1, &x, NULL, 1e-6, 1e-6));
  EXPECT(gradcheck(ctx, gf_dropout, 1, &v, NULL, 1e-6, 1e-6));
  moe_tensor_release(v);
  moe_tensor_release(x);
}

/* Only one input requires grad; no grad mode; integer ops record nothing. */
static void test_grad_bookkeeping(moe_ctx *ctx) {
  moe_tensor *a = leaf(ctx, SHAPE(2, 3), 0.5, 1.5), *b = NULL, *y = NULL, *g = NULL;
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(2, 3), 2.0, MOE_F64, MOE_CPU, &b));
  EXPECT_OK(moe_pow(ctx, b, a, &y)); /* only the exponent requires grad */
  EXPECT(moe_requires_grad(y));
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(2, 3), 1.0, MOE_F64, MOE_CPU, &g));
  EXPECT_OK(moe_backward(ctx, y, g, false));
  EXPECT(moe_tensor_grad(a) != NULL && moe_tensor_grad(b) == NULL);
  moe_tensor_release(y);
  bool prev = moe_grad_set(ctx, false);
  EXPECT_OK(moe_gelu(ctx, a, &y));
  EXPECT(!moe_requires_grad(y) && moe_tensor_grad_fn(y) == NULL);
  moe_tensor_release(y);
  moe_grad_set(ctx, prev);
  EXPECT_OK(moe_compare_scalar(ctx, MOE_OP_GT, a, 1.0, &y));
  EXPECT(!moe_requires_grad(y));
  moe_tensor_release(y);
  /* swiglu backward into gate only */
  moe_tensor *u = NULL;
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(2, 3), 3.0, MOE_F64, MOE_CPU, &u));
  EXPECT_OK(moe_tensor_set_grad(ctx, a, NULL));
  EXPECT_OK(moe_swiglu(ctx, a, u, &y));
  EXPECT_OK(moe_backward(ctx, y, g, false));
  EXPECT(moe_tensor_grad(a) != NULL && moe_tensor_grad(u) == NULL);
  moe_tensor_release(y);
  moe_tensor_release(u);
  moe_tensor_release(g);
  moe_tensor_release(b);
  moe_tensor_release(a);
}

/* --------------------------------------------------------------- errors */

static void test_errors(moe_ctx *ctx) {
  moe_tensor *f = NULL, *i = NULL, *bl = NULL, *g = NULL, *y = NULL;
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(2, 3), 1, MOE_F32, MOE_CPU, &f));
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(2, 3), 1, MOE_I64, MOE_CPU, &i));
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(2, 3), 1, MOE_BOOL, MOE_CPU, &bl));
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(4), 1, MOE_F32, MOE_CPU, &g));
  EXPECT_ERR_MSG(moe_exp(ctx, i, &y), MOE_ERR_DTYPE, "exp: x has dtype i64");
  EXPECT_ERR_MSG(moe_gelu(ctx, bl, &y), MOE_ERR_DTYPE, "gelu");
  EXPECT_ERR_MSG(moe_abs(ctx, bl, &y), MOE_ERR_DTYPE, "abs: x has dtype bool");
  /* every float-only activation names itself and the dtype */
  EXPECT_ERR_MSG(moe_log(ctx, i, &y), MOE_ERR_DTYPE, "log: x has dtype i64; log takes float tensors");
  EXPECT_ERR_MSG(moe_sqrt(ctx, i, &y), MOE_ERR_DTYPE, "sqrt: x has dtype i64");
  EXPECT_ERR_MSG(moe_rsqrt(ctx, bl, &y), MOE_ERR_DTYPE, "rsqrt: x has dtype bool");
  EXPECT_ERR_MSG(moe_relu(ctx, i, &y), MOE_ERR_DTYPE, "relu: x has dtype i64");
  EXPECT_ERR_MSG(moe_gelu_tanh(ctx, i, &y), MOE_ERR_DTYPE, "gelu_tanh: x has dtype i64");
  EXPECT_ERR_MSG(moe_silu(ctx, i, &y), MOE_ERR_DTYPE, "silu: x has dtype i64");
  EXPECT_ERR_MSG(moe_sigmoid(ctx, bl, &y), MOE_ERR_DTYPE, "sigmoid: x has dtype bool");
  EXPECT_ERR_MSG(moe_tanh(ctx, i, &y), MOE_ERR_DTYPE, "tanh: x has dtype i64");
  EXPECT_ERR_MSG(moe_pow(ctx, f, i, &y), MOE_ERR_DTYPE, "pow: b has dtype i64");
  EXPECT_ERR_MSG(moe_pow(ctx, f, g, &y), MOE_ERR_SHAPE, "pow: shapes [2, 3], [4] cannot be broadcast");
  EXPECT_ERR_MSG(moe_maximum(ctx, f, g, &y), MOE_ERR_SHAPE, "maximum");
  EXPECT_ERR_MSG(moe_compare(ctx, MOE_OP_LT, f, g, &y), MOE_ERR_SHAPE, "lt");
  EXPECT_ERR_MSG(moe_compare(ctx, MOE_OP_ADD, f, f, &y), MOE_ERR_INVALID_ARG, "not a comparison");
  EXPECT_ERR_MSG(moe_compare_scalar(ctx, MOE_OP_MUL, f, 1, &y), MOE_ERR_INVALID_ARG, "not a comparison");
  EXPECT_ERR_MSG(moe_clamp(ctx, f, NAN, NAN, &y), MOE_ERR_INVALID_ARG, "clamp: at least one");
  EXPECT_ERR_MSG(moe_where(ctx, f, f, f, &y), MOE_ERR_DTYPE, "where: cond must be a bool tensor, got f32");
  EXPECT_ERR_MSG(moe_where(ctx, bl, f, g, &y), MOE_ERR_SHAPE, "where: shapes [2, 3], [2, 3], [4]");
  EXPECT_ERR_MSG(moe_swiglu(ctx, f, g, &y), MOE_ERR_SHAPE, "swiglu: gate [2, 3] and up [4]");
  EXPECT_ERR_MSG(moe_swiglu(ctx, f, i, &y), MOE_ERR_DTYPE, "swiglu: gate is f32 but up is i64");
  EXPECT_ERR_MSG(moe_swiglu(ctx, i, i, &y), MOE_ERR_DTYPE, "swiglu: gate has dtype i64");
  EXPECT_ERR_MSG(moe_dropout(ctx, f, 1.5, true, &y), MOE_ERR_INVALID_ARG, "dropout: p must be in [0, 1]");
  EXPECT_ERR_MSG(moe_dropout(ctx, f, NAN, true, &y), MOE_ERR_INVALID_ARG, "dropout: p");
  EXPECT_ERR_MSG(moe_dropout(ctx, i, 0.5, true, &y), MOE_ERR_DTYPE, "dropout");
  EXPECT_ERR_MSG(moe_exp(ctx, NULL, &y), MOE_ERR_INVALID_ARG, "exp: x is NULL");
  EXPECT_ERR_MSG(moe_exp(ctx, f, NULL), MOE_ERR_INVALID_ARG, "exp: out is NULL");
  EXPECT_ERR_MSG(moe_where(ctx, bl, NULL, f, &y), MOE_ERR_INVALID_ARG, "where: a is NULL");
  EXPECT(y == NULL); /* no output written on failure */
  moe_tensor_release(g);
  moe_tensor_release(bl);
  moe_tensor_release(i);
  moe_tensor_release(f);
}

int main(void) {
  RUN(test_unary_values);
  RUN(test_unary_special);
  RUN(test_pow_values);
  RUN(test_clamp_values);
  RUN(test_compare_values);
  RUN(test_where_values);
  RUN(test_maxmin_values);
  RUN(test_maxmin_ties);
  RUN(test_swiglu_values);
  RUN(test_dropout);
  RUN(test_grad_unary);
  RUN(test_grad_pow);
  RUN(test_grad_clamp);
  RUN(test_grad_maxmin);
  RUN(test_grad_where);
  RUN(test_grad_swiglu);
  RUN(test_grad_dropout);
  RUN(test_grad_bookkeeping);
  RUN(test_errors);
  return harness_end();
}
