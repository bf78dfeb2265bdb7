/*
 * test_reduce_cuda.c - the reduction and normalisation family on CUDA
 * against the CPU reference, forward and backward, on random inputs at
 * awkward sizes (1, odd, large, long rows past the shared-memory cache,
 * column reductions, non-contiguous views) in f32 and bf16. Exits 77
 * (skipped) without a GPU.
 *
 * Both sides get the same input values (rounded to the dtype first) and
 * the same output cotangent; the CPU computes in double.
 * Tolerances, |gpu - cpu| <= tol * (1 + |cpu|):
 *   f32  1e-4: the GPU accumulates in float in a different order, and uses
 *        __expf / __logf (2 ulp); sums of up to 1e6 terms of O(1) values
 *        stay well inside 1e-4 relative to the result plus one.
 *   bf16 1.6e-2: outputs are rounded to bf16 (8 bits, 2^-8 relative); a
 *        float result and a double result one rounding apart can land on
 *        neighbouring bf16 values: two ulps of 2^-7 leave room.
 * Indices (max, min, argmax) must match exactly: ties get the first index
 * on both devices.
 */
#include "harness.h"

#define SHAPE(...) (int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (int64_t[]){__VA_ARGS__}

static const moe_device GPU = {MOE_DEVICE_CUDA, 0};

static double tol_of(moe_dtype dt) { return dt == MOE_BF16 ? 1.6e-2 : 1e-4; }

/* max |a - b| / (1 + |b|) over the elements; 1e30 on a shape or NaN mismatch. */
static double rel_diff(moe_ctx *ctx, const moe_tensor *a, const moe_tensor *b) {
  int64_t n = moe_tensor_numel(a);
  if (!a || !b || n != moe_tensor_numel(b) || a->ndim != b->ndim) return 1e30;
  double *x = malloc(sizeof(double) * (size_t)(n ? n : 1)), *y = malloc(sizeof(double) * (size_t)(n ? n : 1));
  double worst = 0;
  if (moe_tensor_to_f64(ctx, a, x) != MOE_OK || moe_tensor_to_f64(ctx, b, y) != MOE_OK) worst = 1e30;
  for (int64_t i = 0; i < n && worst < 1e30; i++) {
    if (isnan(x[i]) || isnan(y[i])) {
      if (isnan(x[i]) != isnan(y[i])) worst = 1e30;
      continue;
    }
    if (isinf(x[i]) || isinf(y[i])) {
      if (x[i] != y[i]) worst = 1e30;
      continue;
    }
    double d = fabs(x[i] - y[i]) / (1 + fabs(y[i]));
    if (d > worst) worst = d;
  }
  free(x);
  free(y);
  return worst;
}

/* A random f32 CPU tensor in [lo, hi). */
static moe_tensor *rnd(moe_ctx *ctx, int ndim, const int64_t *shape, double lo, double hi) {
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, ndim, shape, MOE_F32, MOE_CPU, &t));
  EXPECT_OK(moe_uniform_(ctx, t, lo, hi));
  return t;
}

/* src's values as dtype dt on device d; noncontig: a transposed view (dims
 * 0 and last) of a contiguous tensor, so the same shape with other strides.
 * grad: a leaf that requires grad. */
static moe_tensor *place(moe_ctx *ctx, moe_tensor *src, moe_dtype dt, moe_device d, bool noncontig,
                         bool grad) {
  moe_tensor *a = NULL, *b = NULL, *c = NULL;
  if (noncontig && src->ndim >= 2) {
    EXPECT_OK(moe_transpose(ctx, src, 0, src->ndim - 1, &a));
    EXPECT_OK(moe_contiguous(ctx, a, &b));
    EXPECT_OK(moe_to(ctx, b, dt, d, &c));
    moe_tensor_release(a);
    moe_tensor_release(b);
    a = c;
    EXPECT_OK(moe_transpose(ctx, a, 0, src->ndim - 1, &c));
    moe_tensor_release(a);
  } else {
    EXPECT_OK(moe_clone(ctx, src, &a));
    EXPECT_OK(moe_to(ctx, a, dt, d, &c));
    moe_tensor_release(a);
  }
  if (grad && c) EXPECT_OK(moe_set_requires_grad(ctx, c, true));
  return c;
}

typedef moe_status (*op_fn)(moe_ctx *ctx, moe_tensor **in, const void *ud, moe_tensor **out);

/*
 * Runs f on both devices with inputs src[k] (f32 CPU values; float inputs
 * are rounded to dt and require grad when `grad`; others, like targets, go
 * as they are), compares the outputs, then (grad) backpropagates one random
 * cotangent on both and compares every input gradient.
 */
static void compare(moe_ctx *ctx, const char *what, op_fn f, const void *ud, int nin,
                    moe_tensor **src, moe_dtype dt, bool noncontig, bool grad) {
  moe_tensor *ci[4] = {0}, *gi[4] = {0}, *co = NULL, *go = NULL, *r = NULL, *rc = NULL, *rg = NULL;
  double tol = tol_of(dt);
  for (int k = 0; k < nin; k++) {
    bool flt = moe_dtype_is_float(src[k]->dtype);
    ci[k] = place(ctx, src[k], flt ? dt : src[k]->dtype, MOE_CPU, noncontig && k == 0, grad && flt);
    gi[k] = place(ctx, src[k], flt ? dt : src[k]->dtype, GPU, noncontig && k == 0, grad && flt);
  }
  EXPECT_OK(f(ctx, ci, ud, &co));
  EXPECT_OK(f(ctx, gi, ud, &go));
  if (co && go) {
    double d = rel_diff(ctx, go, co);
    if (!(d <= tol))
      fprintf(stderr, "  %s %s%s forward: max rel diff %g (tol %g)\n", what, moe_dtype_name(dt),
              noncontig ? " (non-contiguous)" : "", d, tol);
    EXPECT(d <= tol);
  }
  if (grad && co && go && moe_dtype_is_float(co->dtype)) {
    r = rnd(ctx, co->ndim, co->shape, -1, 1);
    EXPECT_OK(moe_to(ctx, r, co->dtype, MOE_CPU, &rc));
    EXPECT_OK(moe_to(ctx, r, co->dtype, GPU, &rg));
    EXPECT_OK(moe_backward(ctx, co, rc, false));
    EXPECT_OK(moe_backward(ctx, go, rg, false));
    for (int k = 0; k < nin; k++) {
      if (!moe_dtype_is_float(src[k]->dtype)) continue;
      moe_tensor *a = moe_tensor_grad(gi[k]), *b = moe_tensor_grad(ci[k]);
      EXPECT(a && b);
      if (!a || !b) continue;
      double d = rel_diff(ctx, a, b);
      if (!(d <= tol))
        fprintf(stderr, "  %s %s%s backward input %d: max rel diff %g (tol %g)\n", what,
                moe_dtype_name(dt), noncontig ? " (non-contiguous)" : "", k, d, tol);
      EXPECT(d <= tol);
    }
  }
  for (int k = 0; k < nin; k++) {
    moe_tensor_release(ci[k]);
    moe_tensor_release(gi[k]);
  }
  moe_tensor_release(co);
  moe_tensor_release(go);
  moe_tensor_release(r);
  moe_tensor_release(rc);
  moe_tensor_release(rg);
}

/* ------------------------------------------------------------------ ops */

typedef struct red_case {
  int kind; /* 0 sum, 1 mean, 2 norm, 3 logsumexp, 4 var */
  int ndims;
  int64_t dims[3];
  bool keepdim;
  double arg;
} red_case;

static moe_status f_red(moe_ctx *ctx, moe_tensor **in, const void *ud, moe_tensor **out) {
  const red_case *c = ud;
  switch (c->kind) {
    case 0: return moe_sum(ctx, in[0], c->ndims, c->dims, c->keepdim, out);
    case 1: return moe_mean(ctx, in[0], c->ndims, c->dims, c->keepdim, out);
    case 2: return moe_norm(ctx, in[0], c->arg, c->ndims, c->dims, c->keepdim, out);
    case 3: return moe_logsumexp(ctx, in[0], c->ndims, c->dims, c->keepdim, out);
    default: return moe_var(ctx, in[0], c->ndims, c->dims, c->arg, c->keepdim, out);
  }
}

static void test_reductions(moe_ctx *ctx) {
  static const char *names[] = {"sum", "mean", "norm", "logsumexp", "var"};
  struct { int ndim; int64_t shape[3]; } shapes[] = {
      {1, {1}}, {1, {7}}, {3, {3, 5, 7}}, {2, {4099, 33}}, {2, {33, 4099}}, {1, {1000003}}};
  for (int s = 0; s < 6; s++) {
    moe_tensor *x = rnd(ctx, shapes[s].ndim, shapes[s].shape, -1, 1);
    int nd = shapes[s].ndim;
    red_case cases[] = {
        {0, 0, {0}, false, 0},       {0, 1, {0}, false, 0},  {0, 1, {-1}, true, 0},
        {1, 1, {nd - 1}, false, 0},  {1, 0, {0}, true, 0},   {2, 1, {0}, false, 2},
        {2, 0, {0}, false, 1},       {2, 1, {-1}, false, 3}, {2, 1, {-1}, false, INFINITY},
        {3, 1, {-1}, false, 0},      {3, 1, {0}, true, 0},   {4, 1, {-1}, false, 1},
        {4, 0, {0}, false, 0},       {4, 1, {0}, true, 0},   {2, 1, {0}, true, 2},
        {2, 1, {-1}, true, 1},       {0, 2, {0, 2}, false, 0}};
    int nc = nd == 3 ? 17 : 16; /* the last case reduces two of three dims */
    for (int c = 0; c < nc; c++) {
      char what[64];
      snprintf(what, sizeof(what), "%s case %d shape %d", names[cases[c].kind], c, s);
      bool big = shapes[s].shape[0] * (nd > 1 ? shapes[s].shape[1] : 1) > 100000;
      for (int dt = 0; dt < 2; dt++) {
        moe_dtype t = dt ? MOE_BF16 : MOE_F32;
        compare(ctx, what, f_red, &cases[c], 1, &x, t, false, true);
        if (nd >= 2 && !big) compare(ctx, what, f_red, &cases[c], 1, &x, t, true, true);
      }
    }
    moe_tensor_release(x);
  }
}

static void test_int_sum(moe_ctx *ctx) {
  moe_tensor *x = NULL, *xg = NULL, *a = NULL, *b = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, SHAPE(517, 9), MOE_I32, MOE_CPU, &x));
  EXPECT_OK(moe_randint_(ctx, x, -1000000, 1000000));
  EXPECT_OK(moe_to(ctx, x, MOE_I32, GPU, &xg));
  for (int d = 0; d < 2; d++) {
    int64_t dim = d;
    EXPECT_OK(moe_sum(ctx, x, 1, &dim, false, &a));
    EXPECT_OK(moe_sum(ctx, xg, 1, &dim, false, &b));
    EXPECT(b && b->dtype == MOE_I64 && rel_diff(ctx, b, a) == 0); /* integers: exact */
    moe_tensor_release(a);
    moe_tensor_release(b);
    EXPECT_OK(moe_cumsum(ctx, x, dim, &a));
    EXPECT_OK(moe_cumsum(ctx, xg, dim, &b));
    EXPECT(b && b->dtype == MOE_I64 && rel_diff(ctx, b, a) == 0);
    moe_tensor_release(a);
    moe_tensor_release(b);
    EXPECT_OK(moe_max(ctx, x, dim, false, &a, NULL));
    EXPECT_OK(moe_max(ctx, xg, dim, false, &b, NULL));
    EXPECT(b && b->dtype == MOE_I32 && rel_diff(ctx, b, a) == 0);
    moe_tensor_release(a);
    moe_tensor_release(b);
  }
  moe_tensor_release(x);
  moe_tensor_release(xg);
}

typedef struct mm_case {
  bool min, all;
  int64_t dim;
  bool keepdim;
} mm_case;

static moe_status f_minmax(moe_ctx *ctx, moe_tensor **in, const void *ud, moe_tensor **out) {
  const mm_case *c = ud;
  if (c->all) return c->min ? moe_min_all(ctx, in[0], out) : moe_max_all(ctx, in[0], out);
  return c->min ? moe_min(ctx, in[0], c->dim, c->keepdim, out, NULL)
                : moe_max(ctx, in[0], c->dim, c->keepdim, out, NULL);
}

static void test_minmax(moe_ctx *ctx) {
  struct { int ndim; int64_t shape[3]; } shapes[] = {{1, {1}}, {2, {37, 5}}, {3, {3, 129, 7}}, {1, {300001}}};
  for (int s = 0; s < 4; s++) {
    moe_tensor *x = rnd(ctx, shapes[s].ndim, shapes[s].shape, -1, 1);
    mm_case cases[] = {{false, true, 0, false}, {true, true, 0, false}, {false, false, 0, false},
                       {true, false, -1, true}, {false, false, shapes[s].ndim > 2 ? 1 : 0, false}};
    for (int c = 0; c < 5; c++)
      for (int dt = 0; dt < 2; dt++) {
        moe_dtype t = dt ? MOE_BF16 : MOE_F32;
        compare(ctx, "max/min", f_minmax, &cases[c], 1, &x, t, false, true);
        if (shapes[s].ndim >= 2) compare(ctx, "max/min", f_minmax, &cases[c], 1, &x, t, true, true);
      }
    /* indices exactly */
    for (int dt = 0; dt < 2; dt++) {
      moe_tensor *xc = place(ctx, x, dt ? MOE_BF16 : MOE_F32, MOE_CPU, false, false);
      moe_tensor *xg = place(ctx, x, dt ? MOE_BF16 : MOE_F32, GPU, false, false);
      moe_tensor *a = NULL, *b = NULL, *va = NULL, *vb = NULL;
      for (int64_t d = 0; d < shapes[s].ndim; d++) {
        EXPECT_OK(moe_min(ctx, xc, d, false, &va, &a));
        EXPECT_OK(moe_min(ctx, xg, d, false, &vb, &b));
        EXPECT(rel_diff(ctx, b, a) == 0);
        moe_tensor_release(a);
        moe_tensor_release(b);
        moe_tensor_release(va);
        moe_tensor_release(vb);
      }
      EXPECT_OK(moe_argmax(ctx, xc, 0, true, false, &a));
      EXPECT_OK(moe_argmax(ctx, xg, 0, true, false, &b));
      EXPECT(rel_diff(ctx, b, a) == 0);
      moe_tensor_release(a);
      moe_tensor_release(b);
      /* argmax along each dim, with and without keepdim, and on the
       * transposed view where there are two dims or more */
      for (int tr = 0; tr < (shapes[s].ndim >= 2 ? 2 : 1); tr++) {
        moe_tensor *yc = place(ctx, x, dt ? MOE_BF16 : MOE_F32, MOE_CPU, tr, false);
        moe_tensor *yg = place(ctx, x, dt ? MOE_BF16 : MOE_F32, GPU, tr, false);
        for (int64_t d = 0; d < shapes[s].ndim; d++)
          for (int kd = 0; kd < 2; kd++) {
            a = b = NULL;
            EXPECT_OK(moe_argmax(ctx, yc, d, false, kd, &a));
            EXPECT_OK(moe_argmax(ctx, yg, d, false, kd, &b));
            EXPECT(a && b && a->ndim == b->ndim && rel_diff(ctx, b, a) == 0);
            if (kd) EXPECT(b && b->ndim == shapes[s].ndim && b->shape[d] == 1);
            moe_tensor_release(a);
            moe_tensor_release(b);
          }
        moe_tensor_release(yc);
        moe_tensor_release(yg);
      }
      moe_tensor_release(xc);
      moe_tensor_release(xg);
    }
    moe_tensor_release(x);
  }
}

typedef struct row_case {
  int kind; /* 0 softmax, 1 log_softmax, 2 cumsum */
  int64_t dim;
} row_case;

static moe_status f_row(moe_ctx *ctx, moe_tensor **in, const void *ud, moe_tensor **out) {
  const row_case *c = ud;
  if (c->kind == 0) return moe_softmax(ctx, in[0], c->dim, out);
  if (c->kind == 1) return moe_log_softmax(ctx, in[0], c->dim, out);
  return moe_cumsum(ctx, in[0], c->dim, out);
}

static void test_rows(moe_ctx *ctx) {
  int64_t shapes[][2] = {{1, 1}, {7, 13}, {64, 4096}, {3, 5000}, {5, 30011}, {257, 8}, {2, 1031}};
  for (int s = 0; s < 7; s++) {
    moe_tensor *x = rnd(ctx, 2, shapes[s], -4, 4);
    for (int k = 0; k < 3; k++) {
      for (int64_t d = -1; d <= 0; d++) {
        row_case c = {k, d};
        char what[64];
        snprintf(what, sizeof(what), "%s dim %lld shape [%lld, %lld]", k == 0 ? "softmax" : k == 1 ? "log_softmax" : "cumsum",
                 (long long)d, (long long)shapes[s][0], (long long)shapes[s][1]);
        for (int dt = 0; dt < 2; dt++) {
          moe_dtype t = dt ? MOE_BF16 : MOE_F32;
          /* cumsum over long rows: float accumulation drifts by about sqrt(n) ulps of
           * the partial sums, past the tolerance where a partial sum crosses zero; rows
           * of up to 1031 (two scan tiles, so the carry) are compared */
          if (k == 2 && (d == -1 ? shapes[s][1] : shapes[s][0]) > 1100) continue;
          compare(ctx, what, f_row, &c, 1, &x, t, false, true);
          compare(ctx, what, f_row, &c, 1, &x, t, true, true);
        }
      }
    }
    moe_tensor_release(x);
  }
}

typedef struct norm_case {
  bool rms, w, b;
} norm_case;

static moe_status f_norm_layer(moe_ctx *ctx, moe_tensor **in, const void *ud, moe_tensor **out) {
  const norm_case *c = ud;
  if (c->rms) return moe_rms_norm(ctx, in[0], c->w ? in[1] : NULL, 1e-5, out);
  return moe_layer_norm(ctx, in[0], c->w ? in[1] : NULL, c->b ? in[2] : NULL, 1e-5, out);
}

static void test_norms(moe_ctx *ctx) {
  /* (3000, 4096) and (40000, 8): blocks of the backward take many rows, so
   * its stage buffers wrap around and the weight / bias partial rows sum
   * many rows each */
  int64_t shapes[][2] = {{1, 1},    {7, 13},     {64, 4096}, {3, 5000},
                         {2, 30011}, {1029, 64}, {3000, 4096}, {40000, 8}};
  for (int s = 0; s < 8; s++) {
    moe_tensor *in[3];
    in[0] = rnd(ctx, 2, shapes[s], -3, 3);
    in[1] = rnd(ctx, 1, &shapes[s][1], 0.5, 1.5);
    in[2] = rnd(ctx, 1, &shapes[s][1], -1, 1);
    norm_case cases[] = {{false, false, false}, {false, true, true}, {false, true, false},
                         {true, false, false}, {true, true, false}};
    for (int c = 0; c < 5; c++) {
      char what[64];
      snprintf(what, sizeof(what), "%s w%d b%d shape [%lld, %lld]", cases[c].rms ? "rms_norm" : "layer_norm",
               cases[c].w, cases[c].b, (long long)shapes[s][0], (long long)shapes[s][1]);
      int nin = cases[c].b ? 3 : cases[c].w ? 2 : 1;
      for (int dt = 0; dt < 2; dt++) {
        moe_dtype t = dt ? MOE_BF16 : MOE_F32;
        compare(ctx, what, f_norm_layer, &cases[c], nin, in, t, false, true);
        compare(ctx, what, f_norm_layer, &cases[c], nin, in, t, true, true);
      }
    }
    for (int k = 0; k < 3; k++) moe_tensor_release(in[k]);
  }
}

typedef struct ce_case {
  double smoothing;
  moe_reduction red;
} ce_case;

static moe_status f_ce(moe_ctx *ctx, moe_tensor **in, const void *ud, moe_tensor **out) {
  const ce_case *c = ud;
  return moe_cross_entropy(ctx, in[0], in[1], -100, c->smoothing, c->red, out);
}

static void test_cross_entropy(moe_ctx *ctx) {
  int64_t shapes[][2] = {{1, 1}, {7, 13}, {64, 4096}, {257, 1000}, {3, 30011}};
  for (int s = 0; s < 5; s++) {
    moe_tensor *in[2];
    in[0] = rnd(ctx, 2, shapes[s], -5, 5);
    int64_t rows = shapes[s][0], C = shapes[s][1];
    double *tv = malloc(sizeof(double) * (size_t)rows);
    for (int64_t r = 0; r < rows; r++) tv[r] = (r % 5 == 3) ? -100 : (double)((r * 7919) % C);
    EXPECT_OK(moe_tensor_from_f64(ctx, tv, 1, &rows, MOE_I64, MOE_CPU, &in[1]));
    free(tv);
    ce_case cases[] = {{0, MOE_REDUCTION_MEAN}, {0.1, MOE_REDUCTION_MEAN}, {0, MOE_REDUCTION_SUM},
                       {0.2, MOE_REDUCTION_NONE}};
    for (int c = 0; c < 4; c++)
      for (int dt = 0; dt < 2; dt++) {
        moe_dtype t = dt ? MOE_BF16 : MOE_F32;
        compare(ctx, "cross_entropy", f_ce, &cases[c], 2, in, t, false, true);
        compare(ctx, "cross_entropy", f_ce, &cases[c], 2, in, t, true, true);
      }
    moe_tensor_release(in[0]);
    moe_tensor_release(in[1]);
  }
  /* a target out of range on the GPU: that row's loss is NaN and the next
   * synchronisation reports it (documented) */
  moe_tensor *x = NULL, *t = NULL, *l = NULL;
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(2, 3), 0.0, MOE_F32, GPU, &x));
  EXPECT_OK(moe_tensor_from_f64(ctx, (double[]){1, 9}, SHAPE(2), MOE_I64, GPU, &t));
  EXPECT_OK(moe_cross_entropy(ctx, x, t, -100, 0, MOE_REDUCTION_NONE, &l));
  EXPECT_ERR_MSG(moe_cuda_synchronize(ctx, GPU), MOE_ERR_INVALID_ARG,
                 "cross_entropy (target): index 9 is out of range [0, 3)");
  double v[2] = {0, 0};
  if (l) EXPECT_OK(moe_tensor_to_f64(ctx, l, v));
  EXPECT_NEAR(v[0], log(3.0), 1e-5);
  EXPECT(isnan(v[1]));
  moe_tensor_release(l);
  moe_tensor_release(t);
  moe_tensor_release(x);
}

static void test_gpu_errors(moe_ctx *ctx) {
  moe_tensor *x = NULL, *r = NULL, *w = NULL;
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(2, 3), 1.0, MOE_F64, GPU, &x));
  EXPECT_ERR_MSG(moe_softmax(ctx, x, 1, &r), MOE_ERR_DTYPE, "softmax: f64 is not supported on CUDA");
  moe_tensor_release(x);
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(2, 3), 1.0, MOE_F32, GPU, &x));
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(3), 1.0, MOE_F32, MOE_CPU, &w));
  EXPECT_ERR_MSG(moe_layer_norm(ctx, x, w, NULL, 1e-5, &r), MOE_ERR_DEVICE, "layer_norm: weight is on cpu but input is on cuda:0");
  moe_tensor *wg = NULL, *t = NULL;
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(3), 1.0, MOE_F32, GPU, &wg));
  EXPECT_ERR_MSG(moe_layer_norm(ctx, x, wg, w, 1e-5, &r), MOE_ERR_DEVICE, "layer_norm: bias is on cpu but input is on cuda:0");
  EXPECT_ERR_MSG(moe_rms_norm(ctx, x, w, 1e-5, &r), MOE_ERR_DEVICE, "rms_norm: weight is on cpu but input is on cuda:0");
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(2), 0, MOE_I64, MOE_CPU, &t));
  EXPECT_ERR_MSG(moe_cross_entropy(ctx, x, t, -100, 0.0, MOE_REDUCTION_MEAN, &r), MOE_ERR_DEVICE,
                 "cross_entropy: logits is on cuda:0 but target is on cpu");
  EXPECT(r == NULL);
  moe_tensor_release(w);
  moe_tensor_release(wg);
  moe_tensor_release(t);
  moe_tensor_release(x);
}

/* GPU memory comes back after each op's graph is released. */
static void test_gpu_memory_flat(moe_ctx *ctx) {
  moe_memory_stats before, after;
  moe_tensor *src = rnd(ctx, SHAPE(33, 517), -1, 1);
  EXPECT_OK(moe_memory_stats_get(ctx, GPU, &before));
  for (int i = 0; i < 3; i++) {
    moe_tensor *x = place(ctx, src, MOE_BF16, GPU, false, true), *y = NULL, *z = NULL, *l = NULL;
    EXPECT_OK(moe_layer_norm(ctx, x, NULL, NULL, 1e-5, &y));
    EXPECT_OK(moe_softmax(ctx, y, 0, &z));
    EXPECT_OK(moe_sum(ctx, z, 0, NULL, false, &l));
    EXPECT_OK(moe_backward(ctx, l, NULL, false));
    moe_tensor_release(l);
    moe_tensor_release(z);
    moe_tensor_release(y);
    moe_tensor_release(x);
  }
  EXPECT_OK(moe_memory_stats_get(ctx, GPU, &after));
  EXPECT(after.allocated == before.allocated);
  EXPECT(after.live_storages == before.live_storages);
  moe_tensor_release(src);
}

int main(void) {
  moe_ctx *ctx = harness_start();
  SKIP_IF_NO_GPU(ctx);
  moe_rng_seed(ctx, 1234);
  RUN(test_reductions);
  RUN(test_int_sum);
  RUN(test_minmax);
  RUN(test_rows);
  RUN(test_norms);
  RUN(test_cross_entropy);
  RUN(test_gpu_errors);
  RUN(test_gpu_memory_flat);
  return harness_end();
}
