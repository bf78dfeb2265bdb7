/*
 * test_grouped.c - the grouped GEMM family on the CPU (moe_grouped.h):
 * forward and weight gradient against a naive per-group triple loop in f64
 * (both transposes), awkward groupings (empty groups, every row in one
 * group, rows outside the groups, G = 1 and 256, odd K and N, R = 0, K = 0),
 * f32 and bf16 against the f64 loop, finite-difference gradients in f64
 * (contiguous, a strided x, a column-sliced x, a transposed w), the offsets
 * taken from a routing plan, the backend setting, and error paths.
 */
#include "gradcheck.h"
#include "harness.h"
#include "moe_grouped.h"
#include "moe_routing.h"

/* ------------------------------------------------------ naive reference */

/* out (R, N): rows of group g = x[rows] @ w[g] (w (G, K, N)) or
 * x[rows] @ w[g]^T (w (G, N, K)); zero rows outside the groups. */
static void naive_mm(const double *x, const double *w, const int64_t *offs, int64_t G, int64_t R,
                     int64_t K, int64_t N, bool trans_w, double *out) {
  for (int64_t i = 0; i < R * N; i++) out[i] = 0;
  for (int64_t g = 0; g < G; g++)
    for (int64_t r = offs[g]; r < offs[g + 1]; r++)
      for (int64_t n = 0; n < N; n++) {
        double s = 0;
        for (int64_t k = 0; k < K; k++)
          s += x[r * K + k] * (trans_w ? w[(g * N + n) * K + k] : w[(g * K + k) * N + n]);
        out[r * N + n] = s;
      }
}

/* out (G, K, N) = a_g^T b_g, or (G, N, K) = b_g^T a_g. */
static void naive_wgrad(const double *a, const double *b, const int64_t *offs, int64_t G,
                        int64_t K, int64_t N, bool trans_out, double *out) {
  for (int64_t g = 0; g < G; g++)
    for (int64_t i = 0; i < K; i++)
      for (int64_t j = 0; j < N; j++) {
        double s = 0;
        for (int64_t r = offs[g]; r < offs[g + 1]; r++) s += a[r * K + i] * b[r * N + j];
        if (trans_out) out[(g * N + j) * K + i] = s;
        else out[(g * K + i) * N + j] = s;
      }
}

/* ------------------------------------------------------------- helpers */

static moe_tensor *rand_tensor(moe_ctx *ctx, int ndim, const int64_t *shape, moe_dtype dt) {
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, ndim, shape, dt, MOE_CPU, &t));
  if (t) EXPECT_OK(moe_uniform_(ctx, t, -1, 1));
  return t;
}

static double *values_of(moe_ctx *ctx, const moe_tensor *t) {
  int64_t n = moe_tensor_numel(t);
  double *v = (double *)malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
  EXPECT_OK(moe_tensor_to_f64(ctx, t, v));
  return v;
}

/* max |got - want| over n values */
static double max_diff(const double *got, const double *want, int64_t n) {
  double m = 0;
  for (int64_t i = 0; i < n; i++) {
    double d = fabs(got[i] - want[i]);
    if (!(d <= m)) m = d; /* NaN propagates */
  }
  return m;
}

/* Random offsets: G groups over rows [lo, hi), some empty when G is large. */
static void random_offs(int64_t *offs, int64_t G, int64_t lo, int64_t hi, uint64_t seed) {
  uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
  offs[0] = lo;
  offs[G] = hi;
  for (int64_t g = 1; g < G; g++) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    offs[g] = lo + (int64_t)((s >> 33) % (uint64_t)(hi - lo + 1));
  }
  for (int64_t i = 1; i < G; i++) /* insertion sort of the inner offsets */
    for (int64_t j = i; j > 1 && offs[j] < offs[j - 1]; j--) {
      int64_t t = offs[j];
      offs[j] = offs[j - 1], offs[j - 1] = t;
    }
}

/* One forward + wgrad check of a configuration in dtype dt against the f64
 * loop; tol per dtype from the caller. */
static void check_case(moe_ctx *ctx, int64_t R, int64_t K, int64_t N, int64_t G,
                       const int64_t *offs, moe_dtype dt, double tol) {
  for (int tw = 0; tw < 2; tw++) {
    moe_tensor *x = rand_tensor(ctx, 2, (int64_t[]){R, K}, dt);
    moe_tensor *w = rand_tensor(ctx, 3, tw ? (int64_t[]){G, N, K} : (int64_t[]){G, K, N}, dt);
    moe_tensor *dy = rand_tensor(ctx, 2, (int64_t[]){R, N}, dt);
    moe_tensor *y = NULL, *dw = NULL;
    EXPECT_OK(moe_grouped_mm(ctx, x, w, offs, G, tw, &y));
    EXPECT_OK(moe_grouped_mm_wgrad(ctx, x, dy, offs, G, tw, &dw));
    if (y && dw) {
      EXPECT(y->ndim == 2 && y->shape[0] == R && y->shape[1] == N && y->dtype == dt);
      EXPECT(dw->ndim == 3 && dw->shape[0] == G && dw->shape[1] == (tw ? N : K) &&
             dw->shape[2] == (tw ? K : N));
      double *xv = values_of(ctx, x), *wv = values_of(ctx, w), *dyv = values_of(ctx, dy);
      double *yv = values_of(ctx, y), *dwv = values_of(ctx, dw);
      double *ref = (double *)malloc(sizeof(double) * (size_t)(R * N + G * K * N + 1));
      naive_mm(xv, wv, offs, G, R, K, N, tw, ref);
      double e1 = max_diff(yv, ref, R * N);
      naive_wgrad(xv, dyv, offs, G, K, N, tw, ref);
      double e2 = max_diff(dwv, ref, G * K * N);
      EXPECT(e1 <= tol);
      EXPECT(e2 <= tol * 4); /* the wgrad sums over up to R rows, not K */
      if (e1 > tol || e2 > tol * 4)
        fprintf(stderr, "  R=%lld K=%lld N=%lld G=%lld %s trans=%d: fwd %g wgrad %g\n",
                (long long)R, (long long)K, (long long)N, (long long)G, moe_dtype_name(dt), tw, e1,
                e2);
      free(xv), free(wv), free(dyv), free(yv), free(dwv), free(ref);
    }
    moe_tensor_release(x), moe_tensor_release(w), moe_tensor_release(dy);
    moe_tensor_release(y), moe_tensor_release(dw);
  }
}

/* --------------------------------------------------------------- tests */

static void test_by_hand(moe_ctx *ctx) {
  /* x (4, 2), groups {row 0}, {}, {rows 1, 2}; row 3 outside */
  double xv[] = {1, 2, 3, 4, 5, 6, 7, 8};
  double wv[] = {1, 0, 0, 1, 9, 9, 9, 9, 1, 2, 0, -1}; /* (3, 2, 2) */
  int64_t offs[] = {0, 1, 1, 3};
  moe_tensor *x = NULL, *w = NULL, *y = NULL, *dw = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, xv, 2, (int64_t[]){4, 2}, MOE_F64, MOE_CPU, &x));
  EXPECT_OK(moe_tensor_from_f64(ctx, wv, 3, (int64_t[]){3, 2, 2}, MOE_F64, MOE_CPU, &w));
  EXPECT_OK(moe_grouped_mm(ctx, x, w, offs, 3, false, &y));
  EXPECT_VALUES(y, 0, 1, 2, 3, 2, 5, 4, 0, 0);
  moe_tensor_release(y);
  y = NULL;
  EXPECT_OK(moe_grouped_mm(ctx, x, w, offs, 3, true, &y)); /* x @ w[g]^T */
  EXPECT_VALUES(y, 0, 1, 2, 11, -4, 17, -6, 0, 0);
  /* wgrad of a = b = x: group 0 is [1 2]^T [1 2], group 1 zero, group 2
   * rows {3 4}, {5 6} */
  EXPECT_OK(moe_grouped_mm_wgrad(ctx, x, x, offs, 3, false, &dw));
  EXPECT_VALUES(dw, 0, 1, 2, 2, 4, 0, 0, 0, 0, 34, 42, 42, 52);
  moe_tensor_release(x), moe_tensor_release(w), moe_tensor_release(y), moe_tensor_release(dw);
}

static void test_random(moe_ctx *ctx) {
  int64_t offs[300];
  /* f64: the same sums in another order; 1e-12 for O(10)-long sums of O(1) */
  random_offs(offs, 5, 0, 37, 1);
  check_case(ctx, 37, 13, 11, 5, offs, MOE_F64, 1e-12);
  random_offs(offs, 7, 3, 50, 2); /* rows outside at both ends */
  check_case(ctx, 55, 9, 17, 7, offs, MOE_F64, 1e-12);
  /* f32: sums of <= 50 products of [-1, 1) values: 1e-4 covers f32 rounding */
  random_offs(offs, 4, 0, 41, 3);
  check_case(ctx, 41, 19, 7, 4, offs, MOE_F32, 1e-4);
}

static void test_awkward(moe_ctx *ctx) {
  int64_t offs[300];
  /* every row in one group of several */
  int64_t one[] = {0, 0, 20, 20, 20};
  check_case(ctx, 20, 5, 3, 4, one, MOE_F64, 1e-12);
  /* G = 1, all rows; G = 1 with rows outside */
  int64_t g1[] = {0, 16};
  check_case(ctx, 16, 3, 5, 1, g1, MOE_F64, 1e-12);
  int64_t g1b[] = {5, 9};
  check_case(ctx, 16, 3, 5, 1, g1b, MOE_F64, 1e-12);
  /* G = 256 over 100 rows: most groups empty */
  random_offs(offs, 256, 0, 100, 4);
  check_case(ctx, 100, 3, 2, 256, offs, MOE_F64, 1e-12);
  /* odd K and N, K = 1, N = 1 */
  random_offs(offs, 3, 0, 31, 5);
  check_case(ctx, 31, 1, 1, 3, offs, MOE_F64, 1e-12);
  check_case(ctx, 31, 127, 1, 3, offs, MOE_F64, 1e-11);
  check_case(ctx, 31, 1, 129, 3, offs, MOE_F64, 1e-12);
  /* no rows in any group, and R = 0 */
  int64_t none[] = {0, 0, 0};
  check_case(ctx, 8, 3, 4, 2, none, MOE_F64, 0);
  check_case(ctx, 0, 3, 4, 2, none, MOE_F64, 0);
  /* K = 0: empty sums, zero outputs */
  int64_t k0[] = {0, 2, 6};
  check_case(ctx, 6, 0, 4, 2, k0, MOE_F64, 0);
}

static void test_bf16(moe_ctx *ctx) {
  int64_t offs[10];
  random_offs(offs, 6, 0, 70, 6);
  /* bf16 output rounding: 8 bits of mantissa, relative 2^-8 of a sum whose
   * magnitude stays below ~sqrt(K) * 1 ~ 6 for K = 33: 0.05 absolute;
   * the inputs are bf16 on both sides, the products are exact in f32 */
  check_case(ctx, 70, 33, 21, 6, offs, MOE_BF16, 0.05);
}

/* ----------------------------------------------------------- gradients */

typedef struct gg_ud {
  const int64_t *offs;
  int64_t G;
  bool trans_w;
  int x_view; /* 0 as is, 1 a transposed copy made into a view */
} gg_ud;

static moe_status gg_fn(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  gg_ud *u = (gg_ud *)ud;
  return moe_grouped_mm(ctx, in[0], in[1], u->offs, u->G, u->trans_w, out);
}

static moe_tensor *leaf(moe_ctx *ctx, moe_tensor *t) {
  moe_set_requires_grad(ctx, t, true);
  return t;
}

static void test_gradcheck(moe_ctx *ctx) {
  int64_t offs[] = {1, 4, 4, 9}; /* row 0 and rows 9..10 outside, an empty group */
  int64_t R = 11, K = 4, N = 3, G = 3;
  for (int tw = 0; tw < 2; tw++) {
    gg_ud u = {offs, G, tw != 0, 0};
    /* contiguous */
    moe_tensor *x = leaf(ctx, rand_tensor(ctx, 2, (int64_t[]){R, K}, MOE_F64));
    moe_tensor *w = leaf(ctx, rand_tensor(ctx, 3, tw ? (int64_t[]){G, N, K} : (int64_t[]){G, K, N},
                                          MOE_F64));
    EXPECT(gradcheck(ctx, gg_fn, 2, (moe_tensor *[]){x, w}, &u, 1e-6, 1e-6));
    moe_tensor_release(x);

    /* x a transposed view (stride (1, R)): copied inside the op */
    moe_tensor *base = rand_tensor(ctx, 2, (int64_t[]){K, R}, MOE_F64), *xt = NULL;
    EXPECT_OK(moe_transpose(ctx, base, 0, 1, &xt));
    moe_tensor_release(base);
    leaf(ctx, xt);
    EXPECT(!moe_tensor_is_contiguous(xt));
    EXPECT(gradcheck(ctx, gg_fn, 2, (moe_tensor *[]){xt, w}, &u, 1e-6, 1e-6));
    moe_tensor_release(xt);

    /* x a column slice (row stride K + 3): used in place */
    base = rand_tensor(ctx, 2, (int64_t[]){R, K + 3}, MOE_F64);
    moe_tensor *xs = NULL;
    EXPECT_OK(moe_narrow(ctx, base, 1, 2, K, &xs));
    moe_tensor_release(base);
    leaf(ctx, xs);
    EXPECT(gradcheck(ctx, gg_fn, 2, (moe_tensor *[]){xs, w}, &u, 1e-6, 1e-6));
    moe_tensor_release(w);

    /* w a transposed view of the other layout: (G, A, B) with unit stride on A */
    int64_t A = tw ? N : K, B = tw ? K : N;
    moe_tensor *wb = rand_tensor(ctx, 3, (int64_t[]){G, B, A}, MOE_F64), *wt = NULL;
    EXPECT_OK(moe_transpose(ctx, wb, 1, 2, &wt));
    moe_tensor_release(wb);
    leaf(ctx, wt);
    EXPECT(gradcheck(ctx, gg_fn, 2, (moe_tensor *[]){xs, wt}, &u, 1e-6, 1e-6));
    moe_tensor_release(xs);
    moe_tensor_release(wt);
  }
}

/* The gradients are the two documented calls, exactly. */
static void test_backward_rule(moe_ctx *ctx) {
  int64_t offs[] = {0, 3, 3, 7, 8};
  int64_t R = 9, K = 5, N = 6, G = 4;
  moe_tensor *x = leaf(ctx, rand_tensor(ctx, 2, (int64_t[]){R, K}, MOE_F32));
  moe_tensor *w = leaf(ctx, rand_tensor(ctx, 3, (int64_t[]){G, K, N}, MOE_F32));
  moe_tensor *dy = rand_tensor(ctx, 2, (int64_t[]){R, N}, MOE_F32);
  moe_tensor *y = NULL, *dx = NULL, *dw = NULL;
  EXPECT_OK(moe_grouped_mm(ctx, x, w, offs, G, false, &y));
  EXPECT(y && moe_tensor_grad_fn(y) != NULL);
  if (y) EXPECT_OK(moe_backward(ctx, y, dy, false));
  EXPECT_OK(moe_grouped_mm(ctx, dy, w, offs, G, true, &dx));
  EXPECT_OK(moe_grouped_mm_wgrad(ctx, x, dy, offs, G, false, &dw));
  if (dx && dw && moe_tensor_grad(x) && moe_tensor_grad(w)) {
    double *a = values_of(ctx, moe_tensor_grad(x)), *b = values_of(ctx, dx);
    EXPECT(max_diff(a, b, R * K) == 0);
    free(a), free(b);
    a = values_of(ctx, moe_tensor_grad(w)), b = values_of(ctx, dw);
    EXPECT(max_diff(a, b, G * K * N) == 0);
    free(a), free(b);
  } else {
    EXPECT(!"gradients missing");
  }
  /* no graph when grad mode is off */
  moe_tensor *y2 = NULL;
  bool prev = moe_grad_set(ctx, false);
  EXPECT_OK(moe_grouped_mm(ctx, x, w, offs, G, false, &y2));
  moe_grad_set(ctx, prev);
  EXPECT(y2 && moe_tensor_grad_fn(y2) == NULL);
  moe_tensor_release(x), moe_tensor_release(w), moe_tensor_release(dy), moe_tensor_release(y);
  moe_tensor_release(dx), moe_tensor_release(dw), moe_tensor_release(y2);
}

/* Offsets from a routing plan's host row offsets (the local experts). */
static void test_plan_offsets(moe_ctx *ctx) {
  int64_t T = 13, k = 2, E = 5, d = 4, f = 3;
  moe_tensor *ids = NULL, *x = NULL, *xs = NULL, *y = NULL;
  moe_routing_plan *p = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, 2, (int64_t[]){T, k}, MOE_I64, MOE_CPU, &ids));
  EXPECT_OK(moe_randint_(ctx, ids, 0, E));
  moe_routing_opts o = moe_routing_opts_default();
  o.expert_begin = 1, o.expert_end = 4;
  EXPECT_OK(moe_routing_plan_new(ctx, ids, E, &o, &p));
  x = rand_tensor(ctx, 2, (int64_t[]){T, d}, MOE_F64);
  moe_tensor *w = rand_tensor(ctx, 3, (int64_t[]){3, d, f}, MOE_F64);
  if (p) {
    EXPECT_OK(moe_routing_plan_counts_to_host(ctx, p));
    EXPECT_OK(moe_routing_permute(ctx, x, p, &xs));
    const int64_t *offs = p->row_offsets_host + p->e0;
    EXPECT_OK(moe_grouped_mm(ctx, xs, w, offs, p->e1 - p->e0, false, &y));
    if (y) {
      double *xv = values_of(ctx, xs), *wv = values_of(ctx, w), *yv = values_of(ctx, y);
      double *ref = (double *)malloc(sizeof(double) * (size_t)(p->rows * f + 1));
      naive_mm(xv, wv, offs, 3, p->rows, d, f, false, ref);
      EXPECT(max_diff(yv, ref, p->rows * f) <= 1e-12);
      free(xv), free(wv), free(yv), free(ref);
    }
  }
  moe_routing_plan_release(p);
  moe_tensor_release(ids), moe_tensor_release(x), moe_tensor_release(xs);
  moe_tensor_release(w), moe_tensor_release(y);
}

static void test_backend(moe_ctx *ctx) {
  EXPECT_STR(moe_grouped_backend(ctx), "auto");
  EXPECT_STR(moe_grouped_backends(), "auto,loop,cublas_grouped,streams,wgmma");
  EXPECT_OK(moe_grouped_set_backend(ctx, "loop"));
  EXPECT_STR(moe_grouped_backend(ctx), "loop");
  EXPECT_OK(moe_grouped_set_backend(ctx, "cublas_grouped"));
  EXPECT_STR(moe_grouped_backend(ctx), "cublas_grouped");
  EXPECT_ERR_MSG(moe_grouped_set_backend(ctx, "fast"), MOE_ERR_INVALID_ARG,
                 "unknown backend \"fast\" (valid: auto,loop,cublas_grouped,streams,wgmma)");
  EXPECT_STR(moe_grouped_backend(ctx), "cublas_grouped");
  EXPECT_ERR(moe_grouped_set_backend(ctx, NULL), MOE_ERR_INVALID_ARG);
  /* the CPU ignores the backend */
  int64_t offs[] = {0, 2, 5};
  check_case(ctx, 5, 3, 2, 2, offs, MOE_F64, 1e-12);
  EXPECT_OK(moe_grouped_set_backend(ctx, "auto"));
}

static void test_errors(moe_ctx *ctx) {
  moe_tensor *x = rand_tensor(ctx, 2, (int64_t[]){6, 4}, MOE_F32);
  moe_tensor *w = rand_tensor(ctx, 3, (int64_t[]){2, 4, 3}, MOE_F32);
  moe_tensor *w64 = rand_tensor(ctx, 3, (int64_t[]){2, 4, 3}, MOE_F64);
  moe_tensor *wi = NULL, *x1 = NULL, *out = NULL;
  EXPECT_OK(moe_tensor_full(ctx, 3, (int64_t[]){2, 4, 3}, 1, MOE_I64, MOE_CPU, &wi));
  EXPECT_OK(moe_tensor_full(ctx, 1, (int64_t[]){6}, 1, MOE_F32, MOE_CPU, &x1));
  int64_t ok[] = {0, 3, 6}, bad_order[] = {0, 4, 3}, past[] = {0, 3, 7}, neg[] = {-1, 3, 6};
  EXPECT_ERR_MSG(moe_grouped_mm(ctx, x, w, ok, 3, false, &out), MOE_ERR_SHAPE,
                 "w of shape [2, 4, 3] has 2 groups, wanted 3");
  EXPECT_ERR_MSG(moe_grouped_mm(ctx, x, w, ok, 2, true, &out), MOE_ERR_SHAPE,
                 "x [6, 4] and w [2, 4, 3] cannot be multiplied");
  EXPECT_ERR_MSG(moe_grouped_mm(ctx, x, w, ok, 0, false, &out), MOE_ERR_INVALID_ARG,
                 "groups must be >= 1");
  EXPECT_ERR_MSG(moe_grouped_mm(ctx, x, w, bad_order, 2, false, &out), MOE_ERR_INVALID_ARG,
                 "offsets out of order");
  EXPECT_ERR_MSG(moe_grouped_mm(ctx, x, w, past, 2, false, &out), MOE_ERR_INVALID_ARG,
                 "past the 6 rows");
  EXPECT_ERR_MSG(moe_grouped_mm(ctx, x, w, neg, 2, false, &out), MOE_ERR_INVALID_ARG,
                 "negative");
  EXPECT_ERR_MSG(moe_grouped_mm(ctx, x, w, NULL, 2, false, &out), MOE_ERR_INVALID_ARG,
                 "offsets are NULL");
  EXPECT_ERR_MSG(moe_grouped_mm(ctx, x, w64, ok, 2, false, &out), MOE_ERR_DTYPE,
                 "x is f32 but w is f64");
  EXPECT_ERR_MSG(moe_grouped_mm(ctx, x, wi, ok, 2, false, &out), MOE_ERR_DTYPE,
                 "w has dtype i64");
  EXPECT_ERR_MSG(moe_grouped_mm(ctx, x1, w, ok, 2, false, &out), MOE_ERR_SHAPE,
                 "x must be 2-D (R, K), got shape [6]");
  EXPECT_ERR_MSG(moe_grouped_mm(ctx, x, x, ok, 2, false, &out), MOE_ERR_SHAPE,
                 "w must be 3-D (G, K, N)");
  EXPECT_ERR_MSG(moe_grouped_mm(ctx, NULL, w, ok, 2, false, &out), MOE_ERR_INVALID_ARG,
                 "x is NULL");
  EXPECT_ERR(moe_grouped_mm(ctx, x, w, ok, 2, false, NULL), MOE_ERR_INVALID_ARG);
  EXPECT(moe_grouped_mm(NULL, x, w, ok, 2, false, &out) == MOE_ERR_INVALID_ARG);
  EXPECT(out == NULL);
  /* wgrad */
  moe_tensor *b = rand_tensor(ctx, 2, (int64_t[]){5, 3}, MOE_F32);
  EXPECT_ERR_MSG(moe_grouped_mm_wgrad(ctx, x, b, ok, 2, false, &out), MOE_ERR_SHAPE,
                 "a [6, 4] and b [5, 3] have different rows");
  EXPECT_ERR_MSG(moe_grouped_mm_wgrad(ctx, x, x1, ok, 2, false, &out), MOE_ERR_SHAPE,
                 "b must be 2-D");
  EXPECT_ERR_MSG(moe_grouped_mm_wgrad(ctx, x, x, past, 2, false, &out), MOE_ERR_INVALID_ARG,
                 "grouped_mm_wgrad: offsets[2] = 7 is past the 6 rows");
  EXPECT_ERR_MSG(moe_grouped_mm_wgrad(ctx, x, x, ok, -1, false, &out), MOE_ERR_INVALID_ARG,
                 "groups must be >= 1");
  moe_tensor *x64 = rand_tensor(ctx, 2, (int64_t[]){6, 4}, MOE_F64);
  EXPECT_ERR_MSG(moe_grouped_mm_wgrad(ctx, x, x64, ok, 2, false, &out), MOE_ERR_DTYPE,
                 "a is f32 but b is f64");
  EXPECT(out == NULL);
  moe_tensor_release(x), moe_tensor_release(w), moe_tensor_release(w64);
  moe_tensor_release(wi), moe_tensor_release(x1), moe_tensor_release(b);
  moe_tensor_release(x64);
}

/* max |a - b| over two tensors of one size (-1: sizes differ). */
static double max_diff_t(moe_ctx *ctx, const moe_tensor *a, const moe_tensor *b) {
  int64_t n = moe_tensor_numel(a);
  if (moe_tensor_numel(b) != n) return -1;
  double *av = values_of(ctx, a), *bv = values_of(ctx, b);
  double d = max_diff(av, bv, n);
  free(av), free(bv);
  return d;
}

static moe_tensor *offs_tensor(moe_ctx *ctx, const int64_t *offs, int64_t n, moe_dtype dt) {
  double v[16];
  for (int64_t i = 0; i < n; i++) v[i] = (double)offs[i];
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, v, 1, (int64_t[]){n}, dt, MOE_CPU, &t));
  return t;
}

/* The device-offset functions on the CPU: the host functions' results and
 * gradients bit for bit, and errors naming the offsets tensor's fault (on
 * the CPU its values are checked, as the host offsets are). */
static void test_device_offsets_cpu(moe_ctx *ctx) {
  int64_t offs[] = {1, 4, 4, 9, 11};
  moe_tensor *o = offs_tensor(ctx, offs, 5, MOE_I64);
  for (int tw = 0; tw < 2; tw++) {
    moe_tensor *x = rand_tensor(ctx, 2, (int64_t[]){12, 5}, MOE_F64);
    moe_tensor *w = rand_tensor(ctx, 3, tw ? (int64_t[]){4, 3, 5} : (int64_t[]){4, 5, 3}, MOE_F64);
    moe_tensor *dy = rand_tensor(ctx, 2, (int64_t[]){12, 3}, MOE_F64);
    moe_tensor *y = NULL, *yd = NULL, *dw = NULL, *dwd = NULL;
    EXPECT_OK(moe_set_requires_grad(ctx, x, true));
    EXPECT_OK(moe_grouped_mm(ctx, x, w, offs, 4, tw, &y));
    EXPECT_OK(moe_grouped_mm_dev(ctx, x, w, o, tw, &yd));
    EXPECT(y && yd && max_diff_t(ctx, y, yd) == 0.0);
    EXPECT_OK(moe_grouped_mm_wgrad(ctx, x, dy, offs, 4, tw, &dw));
    EXPECT_OK(moe_grouped_mm_wgrad_dev(ctx, x, dy, o, tw, &dwd));
    EXPECT(dw && dwd && max_diff_t(ctx, dw, dwd) == 0.0);
    /* the backward: dx through the device-offset node */
    if (yd) {
      EXPECT_OK(moe_backward(ctx, yd, dy, false));
      moe_tensor *gx = moe_tensor_grad(x), *dx = NULL;
      EXPECT_OK(moe_grouped_mm(ctx, dy, w, offs, 4, !tw, &dx));
      EXPECT(gx && dx && max_diff_t(ctx, gx, dx) == 0.0);
      moe_tensor_release(dx);
    }
    moe_tensor_release(x), moe_tensor_release(w), moe_tensor_release(dy), moe_tensor_release(y);
    moe_tensor_release(yd), moe_tensor_release(dw), moe_tensor_release(dwd);
  }
  moe_tensor *x = rand_tensor(ctx, 2, (int64_t[]){12, 5}, MOE_F32);
  moe_tensor *w = rand_tensor(ctx, 3, (int64_t[]){4, 5, 3}, MOE_F32), *out = NULL;
  int64_t past[] = {0, 3, 5, 9, 13};
  moe_tensor *op = offs_tensor(ctx, past, 5, MOE_I64), *o32 = offs_tensor(ctx, offs, 5, MOE_I32);
  moe_tensor *o3 = offs_tensor(ctx, offs, 3, MOE_I64);
  EXPECT_ERR_MSG(moe_grouped_mm_dev(ctx, x, w, op, false, &out), MOE_ERR_INVALID_ARG,
                 "grouped_mm_dev: offsets[4] = 13 is past the 12 rows");
  EXPECT_ERR_MSG(moe_grouped_mm_dev(ctx, x, w, o32, false, &out), MOE_ERR_SHAPE,
                 "offsets must be a 1-D i64 tensor of G + 1 >= 2 entries, got i32 [5]");
  EXPECT_ERR_MSG(moe_grouped_mm_dev(ctx, x, w, o3, false, &out), MOE_ERR_SHAPE,
                 "w of shape [4, 5, 3] has 4 groups, the offsets 2");
  EXPECT_ERR_MSG(moe_grouped_mm_dev(ctx, x, w, NULL, false, &out), MOE_ERR_INVALID_ARG,
                 "grouped_mm_dev: offsets are NULL");
  EXPECT_ERR_MSG(moe_grouped_mm_wgrad_dev(ctx, x, x, op, false, &out), MOE_ERR_INVALID_ARG,
                 "grouped_mm_wgrad_dev: offsets[4] = 13 is past the 12 rows");
  EXPECT(out == NULL);
  EXPECT(!moe_grouped_offsets_on_device(ctx, MOE_CPU, MOE_BF16, 4, 64, 64));
  { /* the summed pair: two products and an add on the CPU; its errors */
    moe_tensor *w2 = rand_tensor(ctx, 3, (int64_t[]){4, 5, 3}, MOE_F32), *s = NULL, *y1 = NULL,
               *y2 = NULL, *wbad = rand_tensor(ctx, 3, (int64_t[]){4, 5, 2}, MOE_F32);
    EXPECT_OK(moe_grouped_mm_sum_dev(ctx, x, w, x, w2, o, false, &s));
    EXPECT_OK(moe_grouped_mm(ctx, x, w, offs, 4, false, &y1));
    EXPECT_OK(moe_grouped_mm(ctx, x, w2, offs, 4, false, &y2));
    if (s && y1 && y2) {
      double *sv = values_of(ctx, s), *a1 = values_of(ctx, y1), *a2 = values_of(ctx, y2), e = 0;
      for (int64_t i = 0; i < 36; i++) e = fmax(e, fabs(sv[i] - (a1[i] + a2[i])));
      EXPECT(e <= 1e-5);
      free(sv), free(a1), free(a2);
    }
    EXPECT_ERR_MSG(moe_grouped_mm_sum_dev(ctx, x, w, x, wbad, o, false, &out), MOE_ERR_SHAPE,
                   "grouped_mm_sum_dev: x2 [12, 5] and w2 [4, 5, 2] must have the shapes of x [12, 5] and w [4, 5, 3]");
    EXPECT_OK(moe_set_requires_grad(ctx, w2, true));
    EXPECT_ERR_MSG(moe_grouped_mm_sum_dev(ctx, x, w, x, w2, o, false, &out), MOE_ERR_INVALID_ARG,
                   "grouped_mm_sum_dev: not differentiable, and w2 requires grad");
    EXPECT(out == NULL);
    moe_tensor_release(w2), moe_tensor_release(s), moe_tensor_release(y1), moe_tensor_release(y2);
    moe_tensor_release(wbad);
  }
  moe_tensor_release(x), moe_tensor_release(w), moe_tensor_release(op), moe_tensor_release(o32);
  moe_tensor_release(o3), moe_tensor_release(o);
}

int main(void) {
  RUN(test_by_hand);
  RUN(test_random);
  RUN(test_awkward);
  RUN(test_bf16);
  RUN(test_gradcheck);
  RUN(test_backward_rule);
  RUN(test_plan_offsets);
  RUN(test_backend);
  RUN(test_errors);
  RUN(test_device_offsets_cpu);
  return harness_end();
}
