/*
 * test_reduce.c - reductions and normalisation on the CPU: values against
 * hand-computed results and naive references, keepdim and negative dims,
 * integer sums, empty reductions, error paths, and finite-difference
 * gradient checks (f64) of every differentiable op on contiguous and
 * non-contiguous (transposed, narrowed) inputs.
 */
#include "harness.h"
#include "gradcheck.h"

#define SHAPE(...) (sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (int64_t[]){__VA_ARGS__}
#define DIMS(...) (int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (int64_t[]){__VA_ARGS__}

static moe_tensor *vals(moe_ctx *ctx, moe_dtype dt, int ndim, const int64_t *shape,
                        const double *v) {
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, v, ndim, shape, dt, MOE_CPU, &t));
  return t;
}

/* A random f64 leaf of shape that requires grad. */
static moe_tensor *leaf(moe_ctx *ctx, int ndim, const int64_t *shape, double lo, double hi) {
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, ndim, shape, MOE_F64, MOE_CPU, &t));
  EXPECT_OK(moe_uniform_(ctx, t, lo, hi));
  EXPECT_OK(moe_set_requires_grad(ctx, t, true));
  return t;
}

/* A non-contiguous f64 leaf: dims 0 and last of a random tensor of the
 * transposed shape swapped, then narrowed by one at each end of dim 0
 * (the base is released; the view keeps the storage). */
static moe_tensor *leaf_view(moe_ctx *ctx, int ndim, const int64_t *shape, double lo, double hi) {
  int64_t s[MOE_MAX_DIMS];
  for (int d = 0; d < ndim; d++) s[d] = shape[d];
  s[ndim - 1] = shape[0];
  s[0] = shape[ndim - 1] + 2;
  moe_tensor *base = NULL, *t = NULL, *v = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, ndim, s, MOE_F64, MOE_CPU, &base));
  EXPECT_OK(moe_uniform_(ctx, base, lo, hi));
  EXPECT_OK(moe_narrow(ctx, base, 0, 1, shape[ndim - 1], &t));
  EXPECT_OK(moe_transpose(ctx, t, 0, ndim - 1, &v));
  EXPECT(v && !moe_tensor_is_contiguous(v));
  EXPECT_OK(moe_set_requires_grad(ctx, v, true));
  moe_tensor_release(t);
  moe_tensor_release(base);
  return v;
}

static bool same_shape(const moe_tensor *t, int ndim, const int64_t *shape) {
  if (!t || t->ndim != ndim) return false;
  for (int d = 0; d < ndim; d++)
    if (t->shape[d] != shape[d]) return false;
  return true;
}

/* ------------------------------------------------------------------ sum */

static void test_sum_values(moe_ctx *ctx) {
  moe_tensor *a = vals(ctx, MOE_F32, SHAPE(2, 3), (double[]){1, 2, 3, 4, 5, 6});
  moe_tensor *r = NULL;
  EXPECT_OK(moe_sum(ctx, a, 0, NULL, false, &r));
  EXPECT(r && r->ndim == 0 && r->dtype == MOE_F32);
  EXPECT_VALUES(r, 0, 21);
  moe_tensor_release(r);
  EXPECT_OK(moe_sum(ctx, a, DIMS(0), false, &r));
  EXPECT(same_shape(r, SHAPE(3)));
  EXPECT_VALUES(r, 0, 5, 7, 9);
  moe_tensor_release(r);
  EXPECT_OK(moe_sum(ctx, a, DIMS(-1), true, &r));
  EXPECT(same_shape(r, SHAPE(2, 1)));
  EXPECT_VALUES(r, 0, 6, 15);
  moe_tensor_release(r);
  EXPECT_OK(moe_sum(ctx, a, DIMS(1, 0), true, &r));
  EXPECT(same_shape(r, SHAPE(1, 1)));
  EXPECT_VALUES(r, 0, 21);
  moe_tensor_release(r);
  /* a transposed view: (3, 2) summed over dim 1 */
  moe_tensor *at = NULL;
  EXPECT_OK(moe_transpose(ctx, a, 0, 1, &at));
  EXPECT_OK(moe_sum(ctx, at, DIMS(1), false, &r));
  EXPECT_VALUES(r, 0, 5, 7, 9);
  moe_tensor_release(r);
  moe_tensor_release(at);
  moe_tensor_release(a);
  /* 3-d over the outer and inner dims, against a naive loop */
  double v[2 * 3 * 4];
  for (int i = 0; i < 24; i++) v[i] = (double)(i * 7 % 11) - 3.5;
  moe_tensor *b = vals(ctx, MOE_F64, SHAPE(2, 3, 4), v);
  EXPECT_OK(moe_sum(ctx, b, DIMS(0, 2), false, &r));
  double want[3] = {0, 0, 0};
  for (int i = 0; i < 2; i++)
    for (int j = 0; j < 3; j++)
      for (int k = 0; k < 4; k++) want[j] += v[(i * 3 + j) * 4 + k];
  EXPECT_VALUES(r, 1e-12, want[0], want[1], want[2]);
  moe_tensor_release(r);
  moe_tensor_release(b);
}

static void test_sum_dtypes(moe_ctx *ctx) {
  moe_tensor *a = vals(ctx, MOE_I32, SHAPE(2, 2), (double[]){2000000000, 2000000000, 1, -5});
  moe_tensor *r = NULL;
  EXPECT_OK(moe_sum(ctx, a, DIMS(0), false, &r));
  EXPECT(r && r->dtype == MOE_I64);
  EXPECT_VALUES(r, 0, 2000000001, 1999999995);
  moe_tensor_release(r);
  moe_tensor_release(a);
  moe_tensor *b = vals(ctx, MOE_BOOL, SHAPE(4), (double[]){1, 0, 1, 1});
  EXPECT_OK(moe_sum(ctx, b, 0, NULL, false, &r));
  EXPECT(r && r->dtype == MOE_I64);
  EXPECT_VALUES(r, 0, 3);
  moe_tensor_release(r);
  moe_tensor_release(b);
  moe_tensor *h = vals(ctx, MOE_BF16, SHAPE(3), (double[]){1, 2, 0.5});
  EXPECT_OK(moe_sum(ctx, h, 0, NULL, false, &r));
  EXPECT(r && r->dtype == MOE_BF16);
  EXPECT_VALUES(r, 0, 3.5);
  moe_tensor_release(r);
  moe_tensor_release(h);
  /* empty: sum 0 */
  moe_tensor *e = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, SHAPE(2, 0), MOE_F32, MOE_CPU, &e));
  EXPECT_OK(moe_sum(ctx, e, DIMS(1), false, &r));
  EXPECT_VALUES(r, 0, 0, 0);
  moe_tensor_release(r);
  moe_tensor_release(e);
}

/* A broadcast view (stride 0), as autograd's sum_to_shape hands gradients. */
static void test_sum_expanded(moe_ctx *ctx) {
  moe_tensor *row = vals(ctx, MOE_F32, SHAPE(1, 3), (double[]){1, -2, 0.5});
  moe_tensor *e = NULL, *r = NULL;
  EXPECT_OK(moe_expand(ctx, row, SHAPE(4, 3), &e));
  EXPECT_OK(moe_sum(ctx, e, DIMS(0), true, &r));
  EXPECT(same_shape(r, SHAPE(1, 3)));
  EXPECT_VALUES(r, 0, 4, -8, 2);
  moe_tensor_release(r);
  EXPECT_OK(moe_softmax(ctx, e, 0, &r)); /* equal rows: a quarter each */
  EXPECT_VALUES(r, 1e-7, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25);
  moe_tensor_release(r);
  moe_tensor_release(e);
  moe_tensor_release(row);
  /* bf16 in, bf16 out, computed in double and rounded once */
  moe_tensor *h = vals(ctx, MOE_BF16, SHAPE(2, 2), (double[]){0, 0, 1, 1});
  EXPECT_OK(moe_log_softmax(ctx, h, 1, &r));
  EXPECT(r && r->dtype == MOE_BF16);
  EXPECT_VALUES(r, 2e-3, -log(2), -log(2), -log(2), -log(2));
  moe_tensor_release(r);
  moe_tensor_release(h);
}

static void test_sum_errors(moe_ctx *ctx) {
  moe_tensor *a = vals(ctx, MOE_F32, SHAPE(2, 3), (double[]){1, 2, 3, 4, 5, 6});
  moe_tensor *r = NULL;
  EXPECT_ERR_MSG(moe_sum(ctx, a, DIMS(2), false, &r), MOE_ERR_INVALID_ARG,
                 "sum: dim 2 is out of range for a tensor of 2 dims");
  EXPECT_ERR_MSG(moe_sum(ctx, a, DIMS(0, -2), false, &r), MOE_ERR_INVALID_ARG,
                 "sum: dim 0 appears twice");
  EXPECT_ERR_MSG(moe_sum(ctx, NULL, 0, NULL, false, &r), MOE_ERR_INVALID_ARG, "sum: input is NULL");
  EXPECT_ERR(moe_sum(ctx, a, 0, NULL, false, NULL), MOE_ERR_INVALID_ARG);
  EXPECT(r == NULL);
  moe_tensor_release(a);
}

typedef struct red_args {
  int ndims;
  int64_t dims[4];
  bool keepdim;
  double arg;
} red_args;

static moe_status f_sum(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  red_args *a = ud;
  return moe_sum(ctx, in[0], a->ndims, a->dims, a->keepdim, out);
}

static void test_sum_grad(moe_ctx *ctx) {
  moe_tensor *x = leaf(ctx, SHAPE(3, 4, 5), -1, 1);
  red_args a1 = {1, {1}, false, 0}, a2 = {2, {0, -1}, true, 0}, a3 = {0, {0}, false, 0};
  EXPECT(gradcheck(ctx, f_sum, 1, &x, &a1, 1e-6, 1e-6));
  EXPECT(gradcheck(ctx, f_sum, 1, &x, &a2, 1e-6, 1e-6));
  EXPECT(gradcheck(ctx, f_sum, 1, &x, &a3, 1e-6, 1e-6));
  moe_tensor_release(x);
  x = leaf_view(ctx, SHAPE(3, 4, 5), -1, 1);
  EXPECT(gradcheck(ctx, f_sum, 1, &x, &a1, 1e-6, 1e-6));
  EXPECT(gradcheck(ctx, f_sum, 1, &x, &a2, 1e-6, 1e-6));
  moe_tensor_release(x);
}

/* ----------------------------------------------------- other reductions */

static void test_mean_var_norm_lse(moe_ctx *ctx) {
  moe_tensor *a = vals(ctx, MOE_F64, SHAPE(2, 3), (double[]){1, 2, 6, -4, 0, 1});
  moe_tensor *r = NULL;
  EXPECT_OK(moe_mean(ctx, a, DIMS(1), false, &r));
  EXPECT_VALUES(r, 1e-12, 3, -1);
  moe_tensor_release(r);
  EXPECT_OK(moe_mean(ctx, a, 0, NULL, true, &r));
  EXPECT(same_shape(r, SHAPE(1, 1)));
  EXPECT_VALUES(r, 1e-12, 1);
  moe_tensor_release(r);
  /* var of {1,2,6}: mean 3, M2 = 4+1+9 = 14; of {-4,0,1}: mean -1, M2 = 9+1+4 = 14 */
  EXPECT_OK(moe_var(ctx, a, DIMS(-1), 1, false, &r));
  EXPECT_VALUES(r, 1e-12, 7, 7);
  moe_tensor_release(r);
  EXPECT_OK(moe_var(ctx, a, DIMS(1), 0, true, &r));
  EXPECT(same_shape(r, SHAPE(2, 1)));
  EXPECT_VALUES(r, 1e-12, 14.0 / 3, 14.0 / 3);
  moe_tensor_release(r);
  /* columns: {1,-4} mean -1.5 var(c=1) = 12.5 */
  EXPECT_OK(moe_var(ctx, a, DIMS(0), 1, false, &r));
  EXPECT_VALUES(r, 1e-12, 12.5, 2, 12.5);
  moe_tensor_release(r);
  EXPECT_OK(moe_norm(ctx, a, 2, DIMS(1), false, &r));
  EXPECT_VALUES(r, 1e-12, sqrt(41), sqrt(17));
  moe_tensor_release(r);
  EXPECT_OK(moe_norm(ctx, a, 1, 0, NULL, false, &r));
  EXPECT_VALUES(r, 1e-12, 14);
  moe_tensor_release(r);
  EXPECT_OK(moe_norm(ctx, a, 3, DIMS(1), false, &r));
  EXPECT_VALUES(r, 1e-12, pow(1 + 8 + 216, 1.0 / 3), pow(64 + 0 + 1, 1.0 / 3));
  moe_tensor_release(r);
  EXPECT_OK(moe_norm(ctx, a, INFINITY, DIMS(1), false, &r));
  EXPECT_VALUES(r, 0, 6, 4);
  moe_tensor_release(r);
  EXPECT_OK(moe_logsumexp(ctx, a, DIMS(1), false, &r));
  EXPECT_VALUES(r, 1e-12, log(exp(1) + exp(2) + exp(6)), log(exp(-4) + exp(0) + exp(1)));
  moe_tensor_release(r);
  moe_tensor_release(a);
  /* logsumexp stays finite for large values; of -inf rows is -inf */
  moe_tensor *b = vals(ctx, MOE_F32, SHAPE(2, 2), (double[]){1000, 1000, -INFINITY, -INFINITY});
  EXPECT_OK(moe_logsumexp(ctx, b, DIMS(1), false, &r));
  EXPECT_VALUES(r, 1e-3, 1000 + log(2), -INFINITY);
  moe_tensor_release(r);
  moe_tensor_release(b);
  /* errors */
  moe_tensor *i = vals(ctx, MOE_I64, SHAPE(2), (double[]){1, 2});
  EXPECT_ERR_MSG(moe_mean(ctx, i, 0, NULL, false, &r), MOE_ERR_DTYPE, "mean: expected a float tensor");
  EXPECT_ERR_MSG(moe_norm(ctx, i, 0, 0, NULL, false, &r), MOE_ERR_INVALID_ARG, "norm: p must be > 0");
  EXPECT_ERR_MSG(moe_var(ctx, i, 0, NULL, -1, false, &r), MOE_ERR_INVALID_ARG, "var: correction");
  r = NULL;
  EXPECT_ERR_MSG(moe_logsumexp(ctx, i, 0, NULL, false, &r), MOE_ERR_DTYPE,
                 "logsumexp: expected a float tensor (f32, f64, bf16, f16), got i64");
  moe_tensor *f2 = vals(ctx, MOE_F32, SHAPE(2, 3), (double[]){1, 2, 3, 4, 5, 6});
  EXPECT_ERR_MSG(moe_logsumexp(ctx, f2, DIMS(5), false, &r), MOE_ERR_INVALID_ARG,
                 "logsumexp: dim 5 is out of range for a tensor of 2 dims (expected -2 to 1)");
  EXPECT_ERR_MSG(moe_log_softmax(ctx, i, 0, &r), MOE_ERR_DTYPE, "log_softmax: expected a float tensor");
  EXPECT_ERR_MSG(moe_log_softmax(ctx, f2, 2, &r), MOE_ERR_INVALID_ARG, "log_softmax: dim 2 is out of range");
  EXPECT_ERR_MSG(moe_cumsum(ctx, f2, -3, &r), MOE_ERR_INVALID_ARG, "cumsum: dim -3 is out of range");
  EXPECT_ERR_MSG(moe_argmax(ctx, f2, 2, false, false, &r), MOE_ERR_INVALID_ARG, "argmax: dim 2 is out of range");
  moe_tensor *mv = NULL, *mi = NULL;
  EXPECT_ERR_MSG(moe_min(ctx, f2, 3, false, &mv, &mi), MOE_ERR_INVALID_ARG, "min: dim 3 is out of range");
  EXPECT(r == NULL && mv == NULL && mi == NULL);
  moe_tensor_release(f2);
  moe_tensor_release(i);
}

static void test_max_min_arg(moe_ctx *ctx) {
  moe_tensor *a = vals(ctx, MOE_F32, SHAPE(2, 4), (double[]){3, 7, 7, -1, 0, -2, 5, -2});
  moe_tensor *v = NULL, *ix = NULL;
  EXPECT_OK(moe_max(ctx, a, 1, false, &v, &ix));
  EXPECT(same_shape(v, SHAPE(2)) && ix && ix->dtype == MOE_I64);
  EXPECT_VALUES(v, 0, 7, 5);
  EXPECT_VALUES(ix, 0, 1, 2); /* first of equal values */
  moe_tensor_release(v);
  moe_tensor_release(ix);
  EXPECT_OK(moe_min(ctx, a, -1, true, &v, &ix));
  EXPECT(same_shape(v, SHAPE(2, 1)));
  EXPECT_VALUES(v, 0, -1, -2);
  EXPECT_VALUES(ix, 0, 3, 1);
  moe_tensor_release(v);
  moe_tensor_release(ix);
  EXPECT_OK(moe_max(ctx, a, 0, false, &v, NULL));
  EXPECT_VALUES(v, 0, 3, 7, 7, -1);
  moe_tensor_release(v);
  EXPECT_OK(moe_max_all(ctx, a, &v));
  EXPECT(v && v->ndim == 0);
  EXPECT_VALUES(v, 0, 7);
  moe_tensor_release(v);
  EXPECT_OK(moe_min_all(ctx, a, &v));
  EXPECT_VALUES(v, 0, -2);
  moe_tensor_release(v);
  EXPECT_OK(moe_argmax(ctx, a, 0, true, false, &ix));
  EXPECT(ix && ix->ndim == 0 && ix->dtype == MOE_I64);
  EXPECT_VALUES(ix, 0, 1);
  moe_tensor_release(ix);
  EXPECT_OK(moe_argmin(ctx, a, 0, true, false, &ix));
  EXPECT_VALUES(ix, 0, 5);
  moe_tensor_release(ix);
  EXPECT_OK(moe_argmax(ctx, a, 0, false, true, &ix));
  EXPECT(same_shape(ix, SHAPE(1, 4)));
  EXPECT_VALUES(ix, 0, 0, 0, 0, 0);
  moe_tensor_release(ix);
  /* NaN is the max */
  moe_tensor *n = vals(ctx, MOE_F64, SHAPE(3), (double[]){1, NAN, 2});
  EXPECT_OK(moe_max(ctx, n, 0, false, &v, &ix));
  EXPECT(v && isnan(*(double *)moe_tensor_data(v)));
  EXPECT_VALUES(ix, 0, 1);
  moe_tensor_release(v);
  moe_tensor_release(ix);
  moe_tensor_release(n);
  /* integers */
  moe_tensor *i = vals(ctx, MOE_I32, SHAPE(2, 2), (double[]){5, -9, 4, 12});
  EXPECT_OK(moe_max(ctx, i, 0, false, &v, &ix));
  EXPECT(v && v->dtype == MOE_I32);
  EXPECT_VALUES(v, 0, 5, 12);
  EXPECT_VALUES(ix, 0, 0, 1);
  moe_tensor_release(v);
  moe_tensor_release(ix);
  moe_tensor_release(i);
  /* errors */
  EXPECT_ERR_MSG(moe_max(ctx, a, 2, false, &v, &ix), MOE_ERR_INVALID_ARG,
                 "max: dim 2 is out of range for a tensor of 2 dims");
  moe_tensor *e = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, SHAPE(2, 0), MOE_F32, MOE_CPU, &e));
  EXPECT_ERR_MSG(moe_max(ctx, e, 1, false, &v, &ix), MOE_ERR_SHAPE, "max: cannot reduce over an empty dim");
  EXPECT_ERR_MSG(moe_argmin(ctx, e, 1, false, false, &ix), MOE_ERR_SHAPE, "argmin: cannot reduce");
  moe_tensor_release(e);
  moe_tensor_release(a);
}

static moe_status f_mean(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  red_args *a = ud;
  return moe_mean(ctx, in[0], a->ndims, a->dims, a->keepdim, out);
}
static moe_status f_norm(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  red_args *a = ud;
  return moe_norm(ctx, in[0], a->arg, a->ndims, a->dims, a->keepdim, out);
}
static moe_status f_lse(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  red_args *a = ud;
  return moe_logsumexp(ctx, in[0], a->ndims, a->dims, a->keepdim, out);
}
static moe_status f_var(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  red_args *a = ud;
  return moe_var(ctx, in[0], a->ndims, a->dims, a->arg, a->keepdim, out);
}
static moe_status f_max(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  red_args *a = ud;
  if (a->ndims == 0) return moe_max_all(ctx, in[0], out);
  return moe_max(ctx, in[0], a->dims[0], a->keepdim, out, NULL);
}
static moe_status f_min(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  red_args *a = ud;
  if (a->ndims == 0) return moe_min_all(ctx, in[0], out);
  return moe_min(ctx, in[0], a->dims[0], a->keepdim, out, NULL);
}

/* Each reduction on a contiguous and a non-contiguous leaf. */
static void check_reduction_grads(moe_ctx *ctx, gradcheck_fn f, red_args *args, int nargs,
                                  double lo, double hi, const char *what) {
  moe_tensor *x = leaf(ctx, SHAPE(3, 4, 5), lo, hi);
  moe_tensor *xv = leaf_view(ctx, SHAPE(3, 4, 5), lo, hi);
  for (int k = 0; k < nargs; k++) {
    bool ok1 = gradcheck(ctx, f, 1, &x, &args[k], 1e-6, 1e-6);
    bool ok2 = gradcheck(ctx, f, 1, &xv, &args[k], 1e-6, 1e-6);
    if (!ok1 || !ok2) fprintf(stderr, "  (%s, case %d: contiguous %d, view %d)\n", what, k, ok1, ok2);
    EXPECT(ok1);
    EXPECT(ok2);
  }
  moe_tensor_release(x);
  moe_tensor_release(xv);
}

static void test_reduction_grads(moe_ctx *ctx) {
  red_args a[4] = {{1, {1}, false, 0}, {2, {0, -1}, true, 0}, {0, {0}, false, 0}, {1, {2}, true, 0}};
  check_reduction_grads(ctx, f_mean, a, 4, -1, 1, "mean");
  check_reduction_grads(ctx, f_lse, a, 4, -2, 2, "logsumexp");
  red_args v[3] = {{1, {1}, false, 1}, {2, {0, 2}, true, 0}, {0, {0}, false, 1}};
  check_reduction_grads(ctx, f_var, v, 3, -1, 1, "var");
  red_args n2[2] = {{1, {1}, false, 2}, {0, {0}, true, 2}};
  check_reduction_grads(ctx, f_norm, n2, 2, 0.2, 1.5, "norm 2");
  red_args n3[2] = {{1, {2}, false, 3}, {2, {0, 1}, false, 1.5}};
  check_reduction_grads(ctx, f_norm, n3, 2, 0.2, 1.5, "norm p");
  red_args n1[2] = {{1, {2}, false, 1}, {1, {0}, false, INFINITY}};
  check_reduction_grads(ctx, f_norm, n1, 2, 0.2, 1.5, "norm 1 / inf");
  /* distinct random values: the max is unique, the gradient well defined */
  red_args m[3] = {{1, {1}, false, 0}, {1, {-1}, true, 0}, {0, {0}, false, 0}};
  check_reduction_grads(ctx, f_max, m, 3, -1, 1, "max");
  check_reduction_grads(ctx, f_min, m, 3, -1, 1, "min");
}

/* --------------------------------------------- softmax, cumsum, norms */

static void test_softmax_cumsum_values(moe_ctx *ctx) {
  moe_tensor *a = vals(ctx, MOE_F64, SHAPE(2, 3), (double[]){1, 2, 3, 0, 0, 1000});
  moe_tensor *r = NULL;
  double z = exp(1) + exp(2) + exp(3);
  EXPECT_OK(moe_softmax(ctx, a, 1, &r));
  EXPECT_VALUES(r, 1e-12, exp(1) / z, exp(2) / z, exp(3) / z, 0, 0, 1);
  moe_tensor_release(r);
  EXPECT_OK(moe_log_softmax(ctx, a, -1, &r));
  EXPECT_VALUES(r, 1e-12, 1 - log(z), 2 - log(z), 3 - log(z), -1000, -1000, 0);
  moe_tensor_release(r);
  EXPECT_OK(moe_softmax(ctx, a, 0, &r));
  double e1 = 1 / (1 + exp(-1)), e2 = 1 / (1 + exp(-2));
  EXPECT_VALUES(r, 1e-12, e1, e2, 0, 1 - e1, 1 - e2, 1);
  moe_tensor_release(r);
  EXPECT_OK(moe_cumsum(ctx, a, 1, &r));
  EXPECT_VALUES(r, 1e-12, 1, 3, 6, 0, 0, 1000);
  moe_tensor_release(r);
  EXPECT_OK(moe_cumsum(ctx, a, 0, &r));
  EXPECT_VALUES(r, 1e-12, 1, 2, 3, 1, 2, 1003);
  moe_tensor_release(r);
  moe_tensor_release(a);
  moe_tensor *i = vals(ctx, MOE_I32, SHAPE(4), (double[]){3, 0, 2, 1});
  EXPECT_OK(moe_cumsum(ctx, i, 0, &r));
  EXPECT(r && r->dtype == MOE_I64);
  EXPECT_VALUES(r, 0, 3, 3, 5, 6);
  moe_tensor_release(r);
  EXPECT_ERR_MSG(moe_softmax(ctx, i, 0, &r), MOE_ERR_DTYPE, "softmax: expected a float tensor");
  EXPECT_ERR_MSG(moe_softmax(ctx, i, 1, &r), MOE_ERR_DTYPE, "softmax");
  moe_tensor_release(i);
}

typedef struct dim_arg {
  int64_t dim;
} dim_arg;

static moe_status f_softmax(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  return moe_softmax(ctx, in[0], ((dim_arg *)ud)->dim, out);
}
static moe_status f_log_softmax(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  return moe_log_softmax(ctx, in[0], ((dim_arg *)ud)->dim, out);
}
static moe_status f_cumsum(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  return moe_cumsum(ctx, in[0], ((dim_arg *)ud)->dim, out);
}

static void test_softmax_cumsum_grads(moe_ctx *ctx) {
  gradcheck_fn fs[3] = {f_softmax, f_log_softmax, f_cumsum};
  const char *names[3] = {"softmax", "log_softmax", "cumsum"};
  moe_tensor *x = leaf(ctx, SHAPE(3, 4, 5), -2, 2);
  moe_tensor *xv = leaf_view(ctx, SHAPE(3, 4, 5), -2, 2);
  for (int k = 0; k < 3; k++) {
    for (int64_t d = -1; d <= 1; d++) {
      dim_arg a = {d};
      bool ok1 = gradcheck(ctx, fs[k], 1, &x, &a, 1e-6, 1e-6);
      bool ok2 = gradcheck(ctx, fs[k], 1, &xv, &a, 1e-6, 1e-6);
      if (!ok1 || !ok2) fprintf(stderr, "  (%s dim %lld: %d %d)\n", names[k], (long long)d, ok1, ok2);
      EXPECT(ok1 && ok2);
    }
  }
  moe_tensor_release(x);
  moe_tensor_release(xv);
}

static void test_norms_values(moe_ctx *ctx) {
  moe_tensor *x = vals(ctx, MOE_F64, SHAPE(2, 4), (double[]){1, 2, 3, 4, -1, 1, -1, 1});
  moe_tensor *w = vals(ctx, MOE_F64, SHAPE(4), (double[]){1, 2, 0.5, -1});
  moe_tensor *b = vals(ctx, MOE_F64, SHAPE(4), (double[]){0, 0.5, 1, -2});
  moe_tensor *r = NULL;
  /* row 0: mean 2.5, var 1.25; row 1: mean 0, var 1 */
  double s0 = 1 / sqrt(1.25 + 1e-5), s1 = 1 / sqrt(1 + 1e-5);
  EXPECT_OK(moe_layer_norm(ctx, x, NULL, NULL, 1e-5, &r));
  EXPECT_VALUES(r, 1e-12, -1.5 * s0, -0.5 * s0, 0.5 * s0, 1.5 * s0, -s1, s1, -s1, s1);
  moe_tensor_release(r);
  EXPECT_OK(moe_layer_norm(ctx, x, w, b, 1e-5, &r));
  EXPECT_VALUES(r, 1e-12, -1.5 * s0, -0.5 * s0 * 2 + 0.5, 0.5 * s0 * 0.5 + 1, -1.5 * s0 - 2,
                -s1, 2 * s1 + 0.5, -0.5 * s1 + 1, -s1 - 2);
  moe_tensor_release(r);
  /* rms: row 0 mean square 7.5, row 1 mean square 1 */
  double q0 = 1 / sqrt(7.5 + 1e-6), q1 = 1 / sqrt(1 + 1e-6);
  EXPECT_OK(moe_rms_norm(ctx, x, w, 1e-6, &r));
  EXPECT_VALUES(r, 1e-12, q0, 4 * q0, 1.5 * q0, -4 * q0, -q1, 2 * q1, -0.5 * q1, -q1);
  moe_tensor_release(r);
  /* errors */
  r = NULL;
  moe_tensor *w3 = vals(ctx, MOE_F64, SHAPE(3), (double[]){1, 2, 3});
  moe_tensor *wf = vals(ctx, MOE_F32, SHAPE(4), (double[]){1, 2, 3, 4});
  EXPECT_ERR_MSG(moe_layer_norm(ctx, x, w3, NULL, 1e-5, &r), MOE_ERR_SHAPE,
                 "layer_norm: weight of shape [3] does not match the last dim of input [2, 4]");
  EXPECT_ERR_MSG(moe_layer_norm(ctx, x, w, w3, 1e-5, &r), MOE_ERR_SHAPE, "layer_norm: bias of shape [3]");
  EXPECT_ERR_MSG(moe_rms_norm(ctx, x, wf, 1e-5, &r), MOE_ERR_DTYPE, "rms_norm: weight is f32 but input is f64");
  EXPECT_ERR_MSG(moe_rms_norm(ctx, x, NULL, -1, &r), MOE_ERR_INVALID_ARG, "rms_norm: eps");
  EXPECT(r == NULL);
  moe_tensor_release(w3);
  moe_tensor_release(wf);
  moe_tensor_release(w);
  moe_tensor_release(b);
  moe_tensor_release(x);
}

static moe_status f_layer_norm(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  int k = *(int *)ud; /* 0: x only, 1: x, w, 2: x, w, b */
  return moe_layer_norm(ctx, in[0], k >= 1 ? in[1] : NULL, k >= 2 ? in[2] : NULL, 1e-5, out);
}
static moe_status f_rms_norm(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  int k = *(int *)ud;
  return moe_rms_norm(ctx, in[0], k >= 1 ? in[1] : NULL, 1e-5, out);
}

/* A stride-2 1-D leaf of n elements drawn from U(lo, hi). */
static moe_tensor *leaf_strided(moe_ctx *ctx, int64_t n, double lo, double hi) {
  moe_tensor *base = NULL, *v = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, 1, (int64_t[]){2 * n}, MOE_F64, MOE_CPU, &base));
  EXPECT_OK(moe_uniform_(ctx, base, lo, hi));
  EXPECT_OK(moe_slice(ctx, base, 0, 0, 2 * n, 2, &v));
  EXPECT(v && !moe_tensor_is_contiguous(v));
  EXPECT_OK(moe_set_requires_grad(ctx, v, true));
  moe_tensor_release(base);
  return v;
}

static void test_norms_grads(moe_ctx *ctx) {
  moe_tensor *in[3];
  in[1] = leaf(ctx, SHAPE(6), 0.5, 1.5);
  in[2] = leaf(ctx, SHAPE(6), -1, 1);
  for (int view = 0; view < 2; view++) {
    in[0] = view ? leaf_view(ctx, SHAPE(2, 3, 6), -2, 2) : leaf(ctx, SHAPE(2, 3, 6), -2, 2);
    for (int k = 0; k <= 2; k++) {
      bool ok1 = gradcheck(ctx, f_layer_norm, 1 + k, in, &k, 1e-6, 1e-6);
      bool ok2 = k == 2 || gradcheck(ctx, f_rms_norm, 1 + k, in, &k, 1e-6, 1e-6);
      if (!ok1 || !ok2) fprintf(stderr, "  (norms view %d k %d: %d %d)\n", view, k, ok1, ok2);
      EXPECT(ok1 && ok2);
    }
    moe_tensor_release(in[0]);
  }
  moe_tensor_release(in[1]);
  moe_tensor_release(in[2]);
  /* strided weight and bias, with a transposed input */
  in[0] = leaf_view(ctx, SHAPE(2, 3, 6), -2, 2);
  in[1] = leaf_strided(ctx, 6, 0.5, 1.5);
  in[2] = leaf_strided(ctx, 6, -1, 1);
  for (int k = 1; k <= 2; k++) {
    EXPECT(gradcheck(ctx, f_layer_norm, 1 + k, in, &k, 1e-6, 1e-6));
    if (k == 1) EXPECT(gradcheck(ctx, f_rms_norm, 2, in, &k, 1e-6, 1e-6));
  }
  for (int j = 0; j < 3; j++) moe_tensor_release(in[j]);
}

/* ------------------------------------------------------------ cross_entropy */

static void test_cross_entropy_values(moe_ctx *ctx) {
  moe_tensor *x = vals(ctx, MOE_F64, SHAPE(3, 3), (double[]){1, 2, 3, 0, 0, 0, -1, 5, 2});
  moe_tensor *t = vals(ctx, MOE_I64, SHAPE(3), (double[]){2, 0, -100});
  moe_tensor *r = NULL;
  double l0 = log(exp(1) + exp(2) + exp(3)), l1 = log(3);
  EXPECT_OK(moe_cross_entropy(ctx, x, t, -100, 0, MOE_REDUCTION_NONE, &r));
  EXPECT(same_shape(r, SHAPE(3)));
  EXPECT_VALUES(r, 1e-12, l0 - 3, l1, 0);
  moe_tensor_release(r);
  EXPECT_OK(moe_cross_entropy(ctx, x, t, -100, 0, MOE_REDUCTION_MEAN, &r));
  EXPECT(r && r->ndim == 0);
  EXPECT_VALUES(r, 1e-12, (l0 - 3 + l1) / 2);
  moe_tensor_release(r);
  EXPECT_OK(moe_cross_entropy(ctx, x, t, -100, 0, MOE_REDUCTION_SUM, &r));
  EXPECT_VALUES(r, 1e-12, l0 - 3 + l1);
  moe_tensor_release(r);
  /* label smoothing 0.3: (1-s)(lse - x_t) + s (lse - mean x) */
  EXPECT_OK(moe_cross_entropy(ctx, x, t, -100, 0.3, MOE_REDUCTION_NONE, &r));
  EXPECT_VALUES(r, 1e-12, 0.7 * (l0 - 3) + 0.3 * (l0 - 2), l1, 0);
  moe_tensor_release(r);
  /* all ignored: mean is NaN, sum 0 */
  moe_tensor *ti = vals(ctx, MOE_I64, SHAPE(3), (double[]){7, 7, 7});
  EXPECT_OK(moe_cross_entropy(ctx, x, ti, 7, 0, MOE_REDUCTION_MEAN, &r));
  EXPECT(r && isnan(*(double *)moe_tensor_data(r)));
  moe_tensor_release(r);
  r = NULL;
  /* errors */
  moe_tensor *bad = vals(ctx, MOE_I64, SHAPE(3), (double[]){2, 3, 0});
  EXPECT_ERR_MSG(moe_cross_entropy(ctx, x, bad, -100, 0, MOE_REDUCTION_MEAN, &r), MOE_ERR_INVALID_ARG,
                 "cross_entropy: target 3 at row 1 is out of range for 3 classes");
  moe_tensor *tf = vals(ctx, MOE_F32, SHAPE(3), (double[]){0, 1, 2});
  EXPECT_ERR_MSG(moe_cross_entropy(ctx, x, tf, -100, 0, MOE_REDUCTION_MEAN, &r), MOE_ERR_DTYPE,
                 "cross_entropy: target must be i64");
  moe_tensor *t2 = vals(ctx, MOE_I64, SHAPE(2), (double[]){0, 1});
  EXPECT_ERR_MSG(moe_cross_entropy(ctx, x, t2, -100, 0, MOE_REDUCTION_MEAN, &r), MOE_ERR_SHAPE,
                 "cross_entropy: target of shape [2] does not match logits [3, 3]");
  EXPECT_ERR_MSG(moe_cross_entropy(ctx, x, t, -100, 1.5, MOE_REDUCTION_MEAN, &r), MOE_ERR_INVALID_ARG,
                 "label_smoothing must be in [0, 1]");
  EXPECT_ERR_MSG(moe_cross_entropy(ctx, t, t, -100, 0, MOE_REDUCTION_MEAN, &r), MOE_ERR_DTYPE,
                 "cross_entropy: expected a float tensor");
  EXPECT(r == NULL);
  moe_reduction red;
  EXPECT(moe_reduction_parse("sum", &red) && red == MOE_REDUCTION_SUM);
  EXPECT(!moe_reduction_parse("avg", &red));
  moe_tensor_release(t2);
  moe_tensor_release(tf);
  moe_tensor_release(bad);
  moe_tensor_release(ti);
  moe_tensor_release(t);
  moe_tensor_release(x);
}

typedef struct ce_arg {
  moe_tensor *target;
  double smoothing;
  moe_reduction red;
} ce_arg;

static moe_status f_ce(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  ce_arg *a = ud;
  return moe_cross_entropy(ctx, in[0], a->target, 1, a->smoothing, a->red, out);
}

static void test_cross_entropy_grads(moe_ctx *ctx) {
  /* target 1 is ignore_index in f_ce: row 2 contributes nothing */
  moe_tensor *t = vals(ctx, MOE_I64, SHAPE(5), (double[]){0, 3, 1, 6, 2});
  moe_tensor *x = leaf(ctx, SHAPE(5, 7), -2, 2), *xv = leaf_view(ctx, SHAPE(5, 7), -2, 2);
  for (int red = 0; red < 3; red++) {
    for (int sm = 0; sm < 2; sm++) {
      ce_arg a = {t, sm ? 0.2 : 0.0, (moe_reduction)red};
      bool ok1 = gradcheck(ctx, f_ce, 1, &x, &a, 1e-6, 1e-6);
      bool ok2 = gradcheck(ctx, f_ce, 1, &xv, &a, 1e-6, 1e-6);
      if (!ok1 || !ok2) fprintf(stderr, "  (cross_entropy red %d smoothing %d: %d %d)\n", red, sm, ok1, ok2);
      EXPECT(ok1 && ok2);
    }
  }
  moe_tensor_release(x);
  moe_tensor_release(xv);
  moe_tensor_release(t);
}

/* Inference under grad mode leaves no graph behind and leaks nothing. */
static void test_no_grad_outputs(moe_ctx *ctx) {
  moe_tensor *x = leaf(ctx, SHAPE(4, 6), -1, 1), *r = NULL;
  bool prev = moe_grad_set(ctx, false);
  EXPECT_OK(moe_softmax(ctx, x, 1, &r));
  EXPECT(r && moe_tensor_grad_fn(r) == NULL);
  moe_tensor_release(r);
  moe_grad_set(ctx, prev);
  EXPECT_OK(moe_layer_norm(ctx, x, NULL, NULL, 1e-5, &r));
  EXPECT(r && moe_tensor_grad_fn(r) != NULL);
  moe_tensor_release(r); /* the graph goes with it, without backward */
  moe_tensor_release(x);
}

int main(void) {
  RUN(test_sum_values);
  RUN(test_sum_dtypes);
  RUN(test_sum_expanded);
  RUN(test_sum_errors);
  RUN(test_sum_grad);
  RUN(test_mean_var_norm_lse);
  RUN(test_max_min_arg);
  RUN(test_reduction_grads);
  RUN(test_softmax_cumsum_values);
  RUN(test_softmax_cumsum_grads);
  RUN(test_norms_values);
  RUN(test_norms_grads);
  RUN(test_cross_entropy_values);
  RUN(test_cross_entropy_grads);
  RUN(test_no_grad_outputs);
  return harness_end();
}
