/*
 * test_autograd.c - the engine of core/autograd.c and the backward of the
 * ops it owns (views, copies, add/sub/mul/div/neg and their scalar forms):
 * hand-computed gradients, finite-difference checks in f64 on contiguous and
 * non-contiguous inputs, accumulation, retain_graph, detach, grad mode,
 * saved-tensor hooks, error paths, and the release of the graph and saved
 * tensors as soon as backward ends.
 */
#include "gradcheck.h"
#include "harness.h"

#define SHAPE(...) (int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (int64_t[]){__VA_ARGS__}

/* A leaf of the given shape holding values (row-major), requiring grad. */
static moe_tensor *leaf(moe_ctx *ctx, moe_dtype dt, const double *v, int ndim,
                        const int64_t *shape) {
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, v, ndim, shape, dt, MOE_CPU, &t));
  EXPECT_OK(moe_set_requires_grad(ctx, t, true));
  return t;
}

/* A leaf with numel deterministic f64 values in [-1.5, 1.5] away from 0. */
static moe_tensor *leaf_f64(moe_ctx *ctx, int ndim, const int64_t *shape, double phase) {
  int64_t n = 1;
  for (int d = 0; d < ndim; d++) n *= shape[d];
  double *v = malloc(sizeof(double) * (size_t)(n ? n : 1));
  for (int64_t i = 0; i < n; i++) {
    double x = sin(1.3 * (double)i + phase);
    v[i] = x >= 0 ? 0.5 + x : -0.5 + x;
  }
  moe_tensor *t = leaf(ctx, MOE_F64, v, ndim, shape);
  free(v);
  return t;
}

/* A non-contiguous leaf: the transpose of a (shape[1], shape[0]) tensor,
 * detached and set to require grad. */
static moe_tensor *leaf_transposed(moe_ctx *ctx, int64_t rows, int64_t cols, double phase) {
  moe_tensor *base = leaf_f64(ctx, SHAPE(cols, rows), phase), *tr = NULL, *d = NULL;
  moe_grad_set(ctx, false);
  EXPECT_OK(moe_transpose(ctx, base, 0, 1, &tr));
  moe_grad_set(ctx, true);
  EXPECT_OK(moe_detach(ctx, tr, &d));
  EXPECT_OK(moe_set_requires_grad(ctx, d, true));
  EXPECT(!moe_tensor_is_contiguous(d));
  moe_tensor_release(tr);
  moe_tensor_release(base);
  return d;
}

/* ------------------------------------------------------------ fields */

static void test_leaf_fields(moe_ctx *ctx) {
  moe_tensor *x = NULL, *i = NULL, *g = NULL, *y = NULL;
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(2, 3), 1.0, MOE_F32, MOE_CPU, &x));
  EXPECT(!moe_requires_grad(x) && moe_tensor_is_leaf(x) && !moe_tensor_grad(x));
  EXPECT_OK(moe_set_requires_grad(ctx, x, true));
  EXPECT(moe_requires_grad(x) && moe_tensor_is_leaf(x) && !moe_tensor_grad_fn(x));
  EXPECT_OK(moe_set_requires_grad(ctx, x, false));
  EXPECT(!moe_requires_grad(x));
  EXPECT_OK(moe_set_requires_grad(ctx, x, true));

  EXPECT_OK(moe_tensor_full(ctx, SHAPE(2), 1.0, MOE_I64, MOE_CPU, &i));
  EXPECT_ERR_MSG(moe_set_requires_grad(ctx, i, true), MOE_ERR_DTYPE,
                 "only floating-point tensors can require grad, not i64");

  /* set_grad checks shape, dtype, device */
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(3, 2), 1.0, MOE_F32, MOE_CPU, &g));
  EXPECT_ERR_MSG(moe_tensor_set_grad(ctx, x, g), MOE_ERR_SHAPE,
                 "gradient of shape [3, 2] for a tensor of shape [2, 3]");
  moe_tensor_release(g);
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(2, 3), 1.0, MOE_F64, MOE_CPU, &g));
  EXPECT_ERR_MSG(moe_tensor_set_grad(ctx, x, g), MOE_ERR_DTYPE, "set_grad: the gradient is f64 but the tensor is f32");
  moe_tensor_release(g);
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(2, 3), 4.0, MOE_F32, MOE_CPU, &g));
  EXPECT_OK(moe_tensor_set_grad(ctx, x, g));
  EXPECT(moe_tensor_grad(x) == g);
  moe_tensor_release(g);
  EXPECT_OK(moe_tensor_set_grad(ctx, x, NULL));
  EXPECT(!moe_tensor_grad(x));

  /* a result is not a leaf; its requires_grad cannot change */
  EXPECT_OK(moe_binary_scalar(ctx, MOE_OP_MUL, x, 2.0, false, &y));
  EXPECT(!moe_tensor_is_leaf(y) && moe_requires_grad(y));
  EXPECT_STR(moe_node_name(moe_tensor_grad_fn(y)), "mul");
  EXPECT_ERR_MSG(moe_set_requires_grad(ctx, y, false), MOE_ERR_INVALID_ARG,
                 "only leaf tensors can change requires_grad (this one is the output of mul");
  moe_tensor_release(y);
  moe_tensor_release(i);
  moe_tensor_release(x);
}

/* ------------------------------------------------- hand-computed values */

static void test_arith_values(moe_ctx *ctx) {
  /* y = x*x + 3x - x/2, dy/dx = 2x + 2.5 */
  moe_tensor *x = leaf(ctx, MOE_F32, (double[]){1, -2, 0.5, 4}, SHAPE(2, 2));
  moe_tensor *a = NULL, *b = NULL, *c = NULL, *d = NULL, *y = NULL;
  EXPECT_OK(moe_binary(ctx, MOE_OP_MUL, x, x, &a));
  EXPECT_OK(moe_binary_scalar(ctx, MOE_OP_MUL, x, 3.0, false, &b));
  EXPECT_OK(moe_binary_scalar(ctx, MOE_OP_DIV, x, 2.0, false, &c));
  EXPECT_OK(moe_binary(ctx, MOE_OP_ADD, a, b, &d));
  EXPECT_OK(moe_binary(ctx, MOE_OP_SUB, d, c, &y));
  EXPECT_ERR(moe_backward(ctx, y, NULL, false), MOE_ERR_SHAPE); /* 4 elements: no implied grad */
  moe_tensor *ones = NULL;
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(2, 2), 1.0, MOE_F32, MOE_CPU, &ones));
  EXPECT_OK(moe_backward(ctx, y, ones, false));
  EXPECT(moe_tensor_grad(x) && moe_tensor_grad(x)->dtype == MOE_F32);
  EXPECT_VALUES(moe_tensor_grad(x), 1e-6, 4.5, -1.5, 3.5, 10.5);
  moe_tensor_release(ones);
  moe_tensor_release(y);
  moe_tensor_release(d);
  moe_tensor_release(c);
  moe_tensor_release(b);
  moe_tensor_release(a);

  /* scalar forms with the scalar first: 1 - x, 2 / x, -x; d/dx = -1 - 2/x^2 - 1 */
  EXPECT_OK(moe_tensor_set_grad(ctx, x, NULL));
  EXPECT_OK(moe_binary_scalar(ctx, MOE_OP_SUB, x, 1.0, true, &a));
  EXPECT_OK(moe_binary_scalar(ctx, MOE_OP_DIV, x, 2.0, true, &b));
  EXPECT_OK(moe_unary(ctx, MOE_OP_NEG, x, &c));
  EXPECT_OK(moe_binary(ctx, MOE_OP_ADD, a, b, &d));
  EXPECT_OK(moe_binary(ctx, MOE_OP_ADD, d, c, &y));
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(2, 2), 1.0, MOE_F32, MOE_CPU, &ones));
  EXPECT_OK(moe_backward(ctx, y, ones, false));
  EXPECT_VALUES(moe_tensor_grad(x), 1e-6, -2 - 2.0 / 1, -2 - 2.0 / 4, -2 - 2.0 / 0.25,
                -2 - 2.0 / 16);
  moe_tensor *names[] = {a, b, c, d, y, ones};
  EXPECT_STR(moe_node_name(moe_tensor_grad_fn(a)), "sub");
  EXPECT_STR(moe_node_name(moe_tensor_grad_fn(b)), "div");
  EXPECT_STR(moe_node_name(moe_tensor_grad_fn(c)), "neg");
  for (int k = 0; k < 6; k++) moe_tensor_release(names[k]);
  moe_tensor_release(x);
}

/* Broadcasting: a (2, 3) * b (3) + c (2, 1); gradients summed to shape and
 * kept in each input's dtype (b is bf16, the product f32). */
static void test_broadcast_values(moe_ctx *ctx) {
  moe_tensor *a = leaf(ctx, MOE_F32, (double[]){1, 2, 3, 4, 5, 6}, SHAPE(2, 3));
  moe_tensor *b = leaf(ctx, MOE_BF16, (double[]){0.5, -1, 2}, SHAPE(3));
  moe_tensor *c = leaf(ctx, MOE_F32, (double[]){10, 20}, SHAPE(2, 1));
  moe_tensor *p = NULL, *y = NULL, *g = NULL;
  EXPECT_OK(moe_binary(ctx, MOE_OP_MUL, a, b, &p));
  EXPECT(p && p->dtype == MOE_F32);
  EXPECT_OK(moe_binary(ctx, MOE_OP_ADD, p, c, &y));
  EXPECT_OK(moe_tensor_from_f64(ctx, (double[]){1, 1, 1, 2, 2, 2}, SHAPE(2, 3), MOE_F32, MOE_CPU, &g));
  EXPECT_OK(moe_backward(ctx, y, g, false));
  EXPECT_VALUES(moe_tensor_grad(a), 0, 0.5, -1, 2, 1, -2, 4);
  EXPECT(moe_tensor_grad(b)->dtype == MOE_BF16);
  EXPECT_VALUES(moe_tensor_grad(b), 0, 1 + 8, 2 + 10, 3 + 12);
  EXPECT_VALUES(moe_tensor_grad(c), 0, 3, 6);
  moe_tensor_release(g);
  moe_tensor_release(y);
  moe_tensor_release(p);
  moe_tensor_release(c);
  moe_tensor_release(b);
  moe_tensor_release(a);
}

/* ------------------------------------------------------- gradchecks */

static moe_status f_arith(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  (void)ud;
  /* (a * b - a / b + b) * 0.5 - (-a) + 2 / b, b broadcast from (3) to (2, 3) */
  moe_tensor *t1 = NULL, *t2 = NULL, *t3 = NULL, *t4 = NULL, *t5 = NULL, *t6 = NULL, *t7 = NULL,
             *t8 = NULL;
  moe_status st = moe_binary(ctx, MOE_OP_MUL, in[0], in[1], &t1);
  if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_DIV, in[0], in[1], &t2);
  if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_SUB, t1, t2, &t3);
  if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_ADD, t3, in[1], &t4);
  if (st == MOE_OK) st = moe_binary_scalar(ctx, MOE_OP_MUL, t4, 0.5, false, &t5);
  if (st == MOE_OK) st = moe_unary(ctx, MOE_OP_NEG, in[0], &t6);
  if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_SUB, t5, t6, &t7);
  if (st == MOE_OK) st = moe_binary_scalar(ctx, MOE_OP_DIV, in[1], 2.0, true, &t8);
  if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_ADD, t7, t8, out);
  moe_tensor *all[] = {t1, t2, t3, t4, t5, t6, t7, t8};
  for (int k = 0; k < 8; k++) moe_tensor_release(all[k]);
  return st;
}

static void test_gradcheck_arith(moe_ctx *ctx) {
  moe_tensor *in[2];
  in[0] = leaf_f64(ctx, SHAPE(2, 3), 0.1);
  in[1] = leaf_f64(ctx, SHAPE(3), 0.7);
  EXPECT(gradcheck(ctx, f_arith, 2, in, NULL, 1e-6, 1e-6));
  moe_tensor_release(in[0]);
  moe_tensor_release(in[1]);

  /* non-contiguous leaves: a transposed (2, 3) and a stride-2 (3) */
  moe_tensor *base = leaf_f64(ctx, SHAPE(6), 0.9), *s = NULL;
  in[0] = leaf_transposed(ctx, 2, 3, 0.2);
  moe_grad_set(ctx, false);
  EXPECT_OK(moe_slice(ctx, base, 0, 0, 6, 2, &s));
  moe_grad_set(ctx, true);
  EXPECT_OK(moe_detach(ctx, s, &in[1]));
  EXPECT_OK(moe_set_requires_grad(ctx, in[1], true));
  EXPECT(!moe_tensor_is_contiguous(in[1]));
  EXPECT(gradcheck(ctx, f_arith, 2, in, NULL, 1e-6, 1e-6));
  moe_tensor_release(in[0]);
  moe_tensor_release(in[1]);
  moe_tensor_release(s);
  moe_tensor_release(base);
}

/* Every scalar form, both orders: ((((a + 1.5) - 0.25) * -1.75) / 1.3) then
 * (2 - .), (3 * .), (0.7 / .) and (. - 0.1), summed with the input so each
 * path carries its own gradient. */
static moe_status f_scalars(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  (void)ud;
  const moe_op ops[8] = {MOE_OP_ADD, MOE_OP_SUB, MOE_OP_MUL, MOE_OP_DIV,
                         MOE_OP_SUB, MOE_OP_MUL, MOE_OP_DIV, MOE_OP_SUB};
  const double sv[8] = {1.5, 0.25, -1.75, 1.3, 2.0, 3.0, 0.7, 0.1};
  const bool rev[8] = {false, false, false, false, true, true, true, false};
  moe_tensor *t[9] = {NULL};
  moe_status st = MOE_OK;
  const moe_tensor *x = in[0];
  for (int k = 0; k < 8 && st == MOE_OK; k++) {
    st = moe_binary_scalar(ctx, ops[k], x, sv[k], rev[k], &t[k]);
    x = t[k];
  }
  if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_ADD, t[7], in[0], out);
  for (int k = 0; k < 9; k++) moe_tensor_release(t[k]);
  return st;
}

/* A round trip through a narrower dtype: f64 -> ud's dtype -> f64, times x. */
static moe_status f_cast(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  moe_tensor *n = NULL, *w = NULL;
  moe_status st = moe_to(ctx, in[0], *(const moe_dtype *)ud, MOE_CPU, &n);
  if (st == MOE_OK) st = moe_to(ctx, n, MOE_F64, MOE_CPU, &w);
  if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_MUL, w, in[0], out);
  moe_tensor_release(n);
  moe_tensor_release(w);
  return st;
}

static void test_gradcheck_scalars_casts(moe_ctx *ctx) {
  moe_tensor *c = leaf_f64(ctx, SHAPE(2, 5), 0.3), *t = leaf_transposed(ctx, 3, 4, 0.6);
  moe_tensor *ins[2] = {c, t};
  for (int i = 0; i < 2; i++) {
    EXPECT(gradcheck(ctx, f_scalars, 1, &ins[i], NULL, 1e-6, 1e-6));
    /* the cast rounds (f32 to 2^-24, bf16 to 2^-9 relative, on values of
     * magnitude 0.5 to 1.5): steps wide against that, tolerance to match */
    moe_dtype f32 = MOE_F32, bf16 = MOE_BF16;
    EXPECT(gradcheck(ctx, f_cast, 1, &ins[i], &f32, 1e-2, 1e-4));
    EXPECT(gradcheck(ctx, f_cast, 1, &ins[i], &bf16, 0.5, 3e-2));
  }
  moe_tensor_release(c);
  moe_tensor_release(t);
}

/* Views of the inputs inside the function: the gradient flows back through
 * them to the leaves. */
static moe_status f_views(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  (void)ud;
  /* in[0] (4, 6), in[1] (3, 1, 2) */
  moe_tensor *t[16] = {NULL};
  moe_status st = moe_transpose(ctx, in[0], 0, 1, &t[0]);                /* (6, 4) */
  if (st == MOE_OK) st = moe_narrow(ctx, t[0], 0, 1, 4, &t[1]);          /* (4, 4) */
  if (st == MOE_OK) st = moe_slice(ctx, t[1], 1, -4, 4, 2, &t[2]);        /* (4, 2) */
  if (st == MOE_OK) st = moe_reshape(ctx, t[2], 2, (int64_t[]){2, 4}, &t[3]); /* copy path */
  if (st == MOE_OK) st = moe_view(ctx, t[3], 3, (int64_t[]){2, 2, 2}, &t[4]);
  if (st == MOE_OK) st = moe_permute(ctx, t[4], 3, (int64_t[]){2, 0, 1}, &t[5]); /* (2, 2, 2) */
  if (st == MOE_OK) st = moe_expand(ctx, in[1], 3, (int64_t[]){3, 2, 2}, &t[6]);
  if (st == MOE_OK) st = moe_select(ctx, t[6], 0, -1, &t[7]);            /* (2, 2) */
  if (st == MOE_OK) st = moe_unsqueeze(ctx, t[7], 0, &t[8]);             /* (1, 2, 2) */
  if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_MUL, t[5], t[8], &t[9]); /* (2, 2, 2) */
  if (st == MOE_OK) st = moe_narrow(ctx, t[9], 0, 1, 1, &t[10]);         /* (1, 2, 2) */
  if (st == MOE_OK) st = moe_squeeze(ctx, t[10], 0, false, &t[11]);      /* (2, 2) */
  if (st == MOE_OK) st = moe_contiguous(ctx, t[0], &t[12]);              /* clone (6, 4) */
  if (st == MOE_OK) st = moe_select(ctx, t[12], 1, 2, &t[13]);           /* (6) */
  if (st == MOE_OK) st = moe_view(ctx, t[13], 2, (int64_t[]){-1, 2}, &t[14]); /* (3, 2) */
  if (st == MOE_OK) st = moe_narrow(ctx, t[14], 0, 0, 2, &t[15]);        /* (2, 2) */
  if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_ADD, t[11], t[15], out);
  for (int k = 0; k < 16; k++) moe_tensor_release(t[k]);
  return st;
}

static void test_gradcheck_views(moe_ctx *ctx) {
  moe_tensor *in[2];
  in[0] = leaf_f64(ctx, SHAPE(4, 6), 0.3);
  in[1] = leaf_f64(ctx, SHAPE(3, 1, 2), 1.1);
  EXPECT(gradcheck(ctx, f_views, 2, in, NULL, 1e-6, 1e-6));
  moe_tensor_release(in[0]);
  moe_tensor_release(in[1]);
  /* the same on a non-contiguous in[0] */
  in[0] = leaf_transposed(ctx, 4, 6, 0.4);
  in[1] = leaf_f64(ctx, SHAPE(3, 1, 2), 1.2);
  EXPECT(gradcheck(ctx, f_views, 2, in, NULL, 1e-6, 1e-6));
  moe_tensor_release(in[0]);
  moe_tensor_release(in[1]);
}

/* A tensor used by several consumers (a diamond) and by itself. */
static moe_status f_diamond(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  (void)ud;
  moe_tensor *y = NULL, *yy = NULL, *z = NULL, *w = NULL;
  moe_status st = moe_binary_scalar(ctx, MOE_OP_MUL, in[0], 2.0, false, &y);
  if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_MUL, y, y, &yy);
  if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_ADD, yy, y, &z);
  if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_DIV, z, in[0], &w);
  if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_SUB, w, y, out);
  moe_tensor_release(y);
  moe_tensor_release(yy);
  moe_tensor_release(z);
  moe_tensor_release(w);
  return st;
}

static void test_gradcheck_diamond(moe_ctx *ctx) {
  moe_tensor *in[1] = {leaf_f64(ctx, SHAPE(5), 0.5)};
  EXPECT(gradcheck(ctx, f_diamond, 1, in, NULL, 1e-6, 1e-6));
  moe_tensor_release(in[0]);
}

/* to() between dtypes: the gradient returns in the input's dtype. */
static void test_copy_backward(moe_ctx *ctx) {
  moe_tensor *x = leaf(ctx, MOE_F32, (double[]){1, 2, 3}, SHAPE(3)), *y = NULL, *z = NULL,
             *g = NULL, *c = NULL;
  EXPECT_OK(moe_to(ctx, x, MOE_F64, MOE_CPU, &y));
  EXPECT_STR(moe_node_name(moe_tensor_grad_fn(y)), "copy");
  EXPECT_OK(moe_binary(ctx, MOE_OP_MUL, y, y, &z));
  EXPECT_OK(moe_tensor_from_f64(ctx, (double[]){1, 1, 1}, SHAPE(3), MOE_F64, MOE_CPU, &g));
  EXPECT_OK(moe_backward(ctx, z, g, false));
  EXPECT(moe_tensor_grad(x)->dtype == MOE_F32);
  EXPECT_VALUES(moe_tensor_grad(x), 0, 2, 4, 6);
  /* to() with nothing to change returns x itself: no node */
  moe_tensor *same = NULL;
  EXPECT_OK(moe_to(ctx, x, MOE_F32, MOE_CPU, &same));
  EXPECT(same == x);
  moe_tensor_release(same);
  /* clone records a copy */
  EXPECT_OK(moe_clone(ctx, x, &c));
  EXPECT(moe_requires_grad(c) && !moe_tensor_is_leaf(c));
  moe_tensor_release(c);
  moe_tensor_release(g);
  moe_tensor_release(z);
  moe_tensor_release(y);
  moe_tensor_release(x);
}

/* ---------------------------------------------------- engine behaviour */

static void test_accumulate_and_retain(moe_ctx *ctx) {
  moe_tensor *x = leaf(ctx, MOE_F64, (double[]){1, 2}, SHAPE(2)), *y = NULL, *g = NULL;
  EXPECT_OK(moe_binary(ctx, MOE_OP_MUL, x, x, &y)); /* dy/dx = 2x */
  EXPECT_OK(moe_tensor_from_f64(ctx, (double[]){1, 1}, SHAPE(2), MOE_F64, MOE_CPU, &g));
  EXPECT_OK(moe_backward(ctx, y, g, true));
  EXPECT_VALUES(moe_tensor_grad(x), 0, 2, 4);
  EXPECT_OK(moe_backward(ctx, y, g, false)); /* the graph was retained: accumulates */
  EXPECT_VALUES(moe_tensor_grad(x), 0, 4, 8);
  /* now freed: a third backward is a clear error */
  EXPECT_ERR_MSG(moe_backward(ctx, y, g, false), MOE_ERR_INVALID_ARG, "retain_graph");
  EXPECT_VALUES(moe_tensor_grad(x), 0, 4, 8);
  moe_tensor_release(y);

  /* a new graph accumulates into the same .grad */
  EXPECT_OK(moe_binary_scalar(ctx, MOE_OP_MUL, x, 3.0, false, &y));
  EXPECT_OK(moe_backward(ctx, y, g, false));
  EXPECT_VALUES(moe_tensor_grad(x), 0, 7, 11);
  /* the stored gradient is not the user's tensor g, nor aliases it */
  EXPECT(moe_tensor_grad(x) != g && moe_tensor_grad(x)->storage != g->storage);
  moe_tensor_release(y);

  /* a leaf as its own root: grad flows into itself */
  EXPECT_OK(moe_tensor_set_grad(ctx, x, NULL));
  EXPECT_OK(moe_backward(ctx, x, g, false));
  EXPECT_VALUES(moe_tensor_grad(x), 0, 1, 1);
  EXPECT(moe_tensor_grad(x)->storage != g->storage);
  moe_tensor_release(g);

  /* one element: the gradient is implied */
  moe_tensor *s = leaf(ctx, MOE_F32, (double[]){3}, SHAPE(1)), *t = NULL;
  EXPECT_OK(moe_binary(ctx, MOE_OP_MUL, s, s, &t));
  EXPECT_OK(moe_backward(ctx, t, NULL, false));
  EXPECT_VALUES(moe_tensor_grad(s), 0, 6);
  moe_tensor_release(t);
  moe_tensor_release(s);
  moe_tensor_release(x);
}

static void test_detach_and_no_grad(moe_ctx *ctx) {
  moe_tensor *x = leaf(ctx, MOE_F32, (double[]){1, 2}, SHAPE(2)), *y = NULL, *d = NULL, *z = NULL;
  EXPECT_OK(moe_binary_scalar(ctx, MOE_OP_MUL, x, 2.0, false, &y));
  EXPECT_OK(moe_detach(ctx, y, &d));
  EXPECT(!moe_requires_grad(d) && moe_tensor_is_leaf(d) && d->storage == y->storage);
  EXPECT_OK(moe_binary(ctx, MOE_OP_MUL, d, d, &z));
  EXPECT(!moe_requires_grad(z) && !moe_tensor_grad_fn(z));
  EXPECT_ERR_MSG(moe_backward(ctx, z, NULL, false), MOE_ERR_INVALID_ARG,
                 "backward: tensor does not require grad and has no grad_fn");
  moe_tensor_release(z);
  moe_tensor_release(d);
  moe_tensor_release(y);

  EXPECT(moe_grad_enabled(ctx));
  bool prev = moe_grad_set(ctx, false);
  EXPECT(prev && !moe_grad_enabled(ctx));
  EXPECT_OK(moe_binary_scalar(ctx, MOE_OP_MUL, x, 2.0, false, &y));
  EXPECT(!moe_requires_grad(y) && !moe_tensor_grad_fn(y));
  EXPECT_OK(moe_transpose(ctx, x, 0, 0, &z));
  EXPECT(!moe_tensor_grad_fn(z));
  EXPECT_OK(moe_fill_(ctx, x, 5.0)); /* in-place on a leaf is fine under no_grad */
  moe_grad_set(ctx, prev);
  EXPECT(moe_grad_enabled(ctx));
  EXPECT_VALUES(x, 0, 5, 5);
  moe_tensor_release(z);
  moe_tensor_release(y);
  moe_tensor_release(x);
}

/* A backward returning a gradient of the wrong shape: the engine names the op. */
static moe_status test_dummy_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                               moe_tensor **gin) {
  (void)gout;
  if (!moe_node_needs_grad(n, 0)) return MOE_OK;
  return moe_tensor_full(ctx, 1, (int64_t[]){7}, 1.0, n->in_dtype[0], n->in_device[0], &gin[0]);
}

static void test_errors(moe_ctx *ctx) {
  moe_tensor *x = leaf(ctx, MOE_F32, (double[]){1, 2, 3, 4}, SHAPE(2, 2)), *y = NULL, *g = NULL,
             *v = NULL, *p = NULL;
  EXPECT_ERR_MSG(moe_backward(ctx, NULL, NULL, false), MOE_ERR_INVALID_ARG, "tensor is NULL");
  EXPECT_OK(moe_binary_scalar(ctx, MOE_OP_MUL, x, 2.0, false, &y));
  EXPECT_ERR_MSG(moe_backward(ctx, y, NULL, false), MOE_ERR_SHAPE,
                 "implied only for a tensor of one element; this one has shape [2, 2]");
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(4), 1.0, MOE_F32, MOE_CPU, &g));
  EXPECT_ERR_MSG(moe_backward(ctx, y, g, false), MOE_ERR_SHAPE,
                 "gradient of shape [4] for a tensor of shape [2, 2]");
  moe_tensor_release(g);
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(2, 2), 1.0, MOE_F64, MOE_CPU, &g));
  EXPECT_ERR_MSG(moe_backward(ctx, y, g, false), MOE_ERR_DTYPE, "backward: the gradient is f64 but the tensor is f32");
  moe_tensor_release(g);

  /* in-place writes autograd cannot see */
  EXPECT_ERR_MSG(moe_fill_(ctx, x, 0), MOE_ERR_INVALID_ARG,
                 "fill_: a leaf tensor that requires grad is being used in an in-place operation");
  EXPECT_ERR_MSG(moe_uniform_(ctx, x, 0, 1), MOE_ERR_INVALID_ARG, "uniform_: a leaf tensor");
  EXPECT_ERR_MSG(moe_normal_(ctx, x, 0, 1), MOE_ERR_INVALID_ARG, "normal_: a leaf tensor");
  EXPECT_ERR_MSG(moe_copy_(ctx, x, y), MOE_ERR_INVALID_ARG, "copy_: a leaf tensor");
  EXPECT_OK(moe_narrow(ctx, x, 0, 0, 1, &v));
  EXPECT_ERR_MSG(moe_fill_(ctx, v, 0), MOE_ERR_INVALID_ARG,
                 "fill_: in-place write into a tensor recorded in an autograd graph (output of "
                 "narrow)");
  EXPECT_VALUES(x, 0, 1, 2, 3, 4);

  /* node API misuse */
  moe_node *n = NULL;
  EXPECT_ERR_MSG(moe_node_new(ctx, MOE_OP_CUSTOM, NULL, 1, &x, &n), MOE_ERR_INVALID_ARG,
                 "backward function is NULL");
  EXPECT_ERR_MSG(moe_saved_hooks_pop(ctx), MOE_ERR_INVALID_ARG, "no saved-tensor hooks");
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(2), 1.0, MOE_I64, MOE_CPU, &p));
  moe_tensor *in1[] = {x};
  EXPECT_OK(moe_node_new(ctx, MOE_OP_CUSTOM, test_dummy_backward, 1, in1, &n));
  EXPECT_ERR_MSG(moe_node_set_output(ctx, n, 0, p), MOE_ERR_DTYPE,
                 "output 0 of dtype i64 cannot carry a gradient");
  EXPECT_ERR_MSG(moe_node_set_output(ctx, n, MOE_NODE_MAX_OUTPUTS, y), MOE_ERR_INVALID_ARG,
                 "output 4");
  EXPECT_ERR_MSG(moe_node_saved(ctx, n, 0, &g), MOE_ERR_INVALID_ARG, "slot 0 of 0 saved");
  moe_node_release(n);
  moe_tensor_release(p);
  moe_tensor_release(v);
  moe_tensor_release(y);
  moe_tensor_release(x);
}

static void test_bad_backward(moe_ctx *ctx) {
  moe_tensor *x = leaf(ctx, MOE_F32, (double[]){1, 2}, SHAPE(2)), *y = NULL;
  moe_node *n = NULL;
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(2), 0.0, MOE_F32, MOE_CPU, &y));
  EXPECT_OK(moe_node_new(ctx, MOE_OP_CUSTOM, test_dummy_backward, 1, &x, &n));
  n->name = "dummy";
  EXPECT_OK(moe_node_set_output(ctx, n, 0, y));
  moe_node_release(n);
  EXPECT_STR(moe_node_name(moe_tensor_grad_fn(y)), "dummy");
  moe_tensor *g = NULL;
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(2), 1.0, MOE_F32, MOE_CPU, &g));
  EXPECT_ERR_MSG(moe_backward(ctx, y, g, false), MOE_ERR_SHAPE,
                 "backward of dummy: the gradient of input 0 has shape [7], expected [2]");
  EXPECT(!moe_tensor_grad(x));
  EXPECT(moe_grad_enabled(ctx)); /* restored after the failure */
  moe_tensor_release(g);
  moe_tensor_release(y);
  moe_tensor_release(x);
}

/* ------------------------------------------------------ memory release */

static int64_t cpu_bytes(moe_ctx *ctx) {
  moe_memory_stats m;
  moe_memory_stats_get(ctx, MOE_CPU, &m);
  return m.allocated;
}

static void test_release_after_backward(moe_ctx *ctx) {
  moe_tensor *x = leaf_f64(ctx, SHAPE(256), 0.1), *h = NULL, *y = NULL, *z = NULL;
  int64_t base = cpu_bytes(ctx), live = harness_live_storages();
  EXPECT_OK(moe_binary(ctx, MOE_OP_MUL, x, x, &h));     /* saves x twice (aliases) */
  EXPECT_OK(moe_binary(ctx, MOE_OP_MUL, h, h, &y));     /* saves h */
  EXPECT_OK(moe_binary_scalar(ctx, MOE_OP_DIV, y, 2.0, true, &z)); /* saves y */
  moe_tensor_release(h); /* the user drops intermediates; saved ones stay alive */
  moe_tensor_release(y);
  EXPECT(harness_live_storages() == live + 3); /* h, y (saved), z */
  moe_tensor *g = NULL;
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(256), 1.0, MOE_F64, MOE_CPU, &g));
  EXPECT_OK(moe_backward(ctx, z, g, false));
  moe_tensor_release(g);
  /* at once: only z and x.grad remain beside x */
  EXPECT(harness_live_storages() == live + 2);
  EXPECT(cpu_bytes(ctx) == base + 2 * 256 * 8);
  moe_tensor_release(z);
  EXPECT(harness_live_storages() == live + 1);
  moe_tensor_release(x);
}

/* The result of a graph freed before backward: its producers stay alive in
 * the graph of the loss. */
static void test_result_freed_before_backward(moe_ctx *ctx) {
  moe_tensor *x = leaf(ctx, MOE_F64, (double[]){1, 2, 3}, SHAPE(3)), *a = NULL, *b = NULL,
             *c = NULL;
  EXPECT_OK(moe_binary_scalar(ctx, MOE_OP_MUL, x, 3.0, false, &a));
  EXPECT_OK(moe_binary(ctx, MOE_OP_MUL, a, x, &b));  /* 3x^2 */
  moe_tensor_release(a);
  EXPECT_OK(moe_narrow(ctx, b, 0, 1, 2, &c));
  moe_tensor_release(b);
  moe_tensor *g = NULL;
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(2), 1.0, MOE_F64, MOE_CPU, &g));
  EXPECT_OK(moe_backward(ctx, c, g, false));
  EXPECT_VALUES(moe_tensor_grad(x), 1e-12, 0, 12, 18);
  moe_tensor_release(g);
  moe_tensor_release(c);
  /* and a graph nobody runs is freed with its last tensor */
  EXPECT_OK(moe_binary(ctx, MOE_OP_MUL, x, x, &a));
  EXPECT_OK(moe_binary(ctx, MOE_OP_MUL, a, a, &b));
  moe_tensor_release(a);
  moe_tensor_release(b);
  moe_tensor_release(x);
}

/* A chain of 200000 ops: backward and release use no recursion. */
static void test_long_chain(moe_ctx *ctx) {
  moe_tensor *x = leaf(ctx, MOE_F64, (double[]){1}, SHAPE(1)), *y = NULL;
  moe_tensor_retain(x);
  y = x;
  moe_status st = MOE_OK;
  for (int i = 0; i < 200000 && st == MOE_OK; i++) {
    moe_tensor *z = NULL;
    st = moe_binary_scalar(ctx, MOE_OP_ADD, y, 1.0, false, &z);
    if (st != MOE_OK) break;
    moe_tensor_release(y);
    y = z;
  }
  EXPECT_OK(st);
  EXPECT_VALUES(y, 0, 200001);
  EXPECT_OK(moe_backward(ctx, y, NULL, true));
  EXPECT_VALUES(moe_tensor_grad(x), 0, 1);
  moe_tensor_release(y); /* frees 200000 retained nodes */
  moe_tensor_release(x);
}

/* ------------------------------------------------------ saved hooks */

typedef struct hook_counts {
  int pack, unpack, free_packed, free_ud;
  bool wrong_shape; /* unpack returns a tensor of another shape */
} hook_counts;

static moe_status hk_pack(moe_ctx *ctx, void *ud, moe_tensor *t, void **packed) {
  hook_counts *c = ud;
  c->pack++;
  moe_tensor *k = NULL;
  moe_status st = moe_clone(ctx, t, &k); /* keep a copy, as a quantizer would */
  *packed = k;
  return st;
}

static moe_status hk_unpack(moe_ctx *ctx, void *ud, void *packed, moe_tensor **out) {
  hook_counts *c = ud;
  c->unpack++;
  moe_tensor *k = packed;
  if (c->wrong_shape) return moe_reshape(ctx, k, 1, (int64_t[]){-1}, out);
  moe_tensor_retain(k);
  *out = k;
  return MOE_OK;
}

static void hk_free_packed(void *ud, void *packed) {
  ((hook_counts *)ud)->free_packed++;
  moe_tensor_release(packed);
}

static void hk_free_ud(void *ud) { ((hook_counts *)ud)->free_ud++; }

static void test_saved_hooks(moe_ctx *ctx) {
  hook_counts c = {0, 0, 0, 0, false};
  moe_saved_hooks h = {0, hk_pack, hk_unpack, hk_free_packed, hk_free_ud, &c};
  moe_tensor *x = leaf(ctx, MOE_F64, (double[]){1, 2, 3, 4}, SHAPE(2, 2)), *y = NULL, *z = NULL,
             *g = NULL;
  EXPECT_OK(moe_saved_hooks_push(ctx, &h));
  EXPECT_OK(moe_binary(ctx, MOE_OP_MUL, x, x, &y));                 /* saves 2 */
  EXPECT_OK(moe_binary_scalar(ctx, MOE_OP_ADD, y, 1.0, false, &z)); /* saves 0 */
  EXPECT_OK(moe_saved_hooks_pop(ctx));
  EXPECT(c.pack == 2 && c.unpack == 0 && c.free_ud == 0); /* the node still holds the hooks */
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(2, 2), 1.0, MOE_F64, MOE_CPU, &g));
  EXPECT_OK(moe_backward(ctx, z, g, false));
  EXPECT_VALUES(moe_tensor_grad(x), 0, 2, 4, 6, 8);
  EXPECT(c.unpack == 2 && c.free_packed == 2 && c.free_ud == 1);
  moe_tensor_release(z);
  moe_tensor_release(y);

  /* nested: the inner hooks pack; popping in order; an unpack of the wrong
   * shape is caught and named */
  hook_counts c2 = {0, 0, 0, 0, true};
  moe_saved_hooks h2 = {0, hk_pack, hk_unpack, hk_free_packed, hk_free_ud, &c2};
  c = (hook_counts){0, 0, 0, 0, false};
  EXPECT_OK(moe_saved_hooks_push(ctx, &h));
  EXPECT_OK(moe_saved_hooks_push(ctx, &h2));
  EXPECT_OK(moe_binary(ctx, MOE_OP_MUL, x, x, &y));
  EXPECT_OK(moe_saved_hooks_pop(ctx));
  EXPECT_OK(moe_saved_hooks_pop(ctx));
  EXPECT(c.pack == 0 && c2.pack == 2 && c.free_ud == 1);
  EXPECT_ERR_MSG(moe_backward(ctx, y, g, false), MOE_ERR_SHAPE,
                 "mul: the unpack hook gave shape [4] for saved slot 0, which had shape [2, 2]");
  EXPECT(c2.free_ud == 0);
  moe_tensor_release(y); /* frees the node, its packed values and the hooks */
  EXPECT(c2.free_packed == 2 && c2.free_ud == 1);
  moe_tensor_release(g);
  moe_tensor_release(x);
}

/* ------------------------------------------------------ sum_to_shape */

static void test_sum_to_shape(moe_ctx *ctx) {
  moe_tensor *g = NULL, *r = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, (double[]){1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12},
                                SHAPE(2, 2, 3), MOE_F32, MOE_CPU, &g));
  EXPECT_OK(moe_sum_to_shape(ctx, g, SHAPE(2, 1), &r)); /* over dims 0 and 2 */
  EXPECT(r->ndim == 2 && r->shape[0] == 2 && r->shape[1] == 1);
  EXPECT_VALUES(r, 0, 1 + 2 + 3 + 7 + 8 + 9, 4 + 5 + 6 + 10 + 11 + 12);
  moe_tensor_release(r);
  EXPECT_OK(moe_sum_to_shape(ctx, g, SHAPE(3), &r));
  EXPECT_VALUES(r, 0, 22, 26, 30);
  moe_tensor_release(r);
  EXPECT_OK(moe_sum_to_shape(ctx, g, SHAPE(2, 2, 3), &r));
  EXPECT(r == g);
  moe_tensor_release(r);
  EXPECT_OK(moe_sum_to_shape(ctx, g, 0, NULL, &r));
  EXPECT(r->ndim == 0);
  EXPECT_VALUES(r, 0, 78);
  moe_tensor_release(r);
  EXPECT_ERR_MSG(moe_sum_to_shape(ctx, g, SHAPE(3, 3), &r), MOE_ERR_SHAPE,
                 "a gradient of shape [2, 2, 3] is not a broadcast of shape [3, 3]");
  EXPECT_ERR_MSG(moe_sum_to_shape(ctx, g, SHAPE(1, 2, 2, 3), &r), MOE_ERR_SHAPE,
                 "is not a broadcast of shape [1, 2, 2, 3]");
  moe_tensor_release(g);
}

int main(void) {
  RUN(test_leaf_fields);
  RUN(test_arith_values);
  RUN(test_broadcast_values);
  RUN(test_gradcheck_arith);
  RUN(test_gradcheck_scalars_casts);
  RUN(test_gradcheck_views);
  RUN(test_gradcheck_diamond);
  RUN(test_copy_backward);
  RUN(test_accumulate_and_retain);
  RUN(test_detach_and_no_grad);
  RUN(test_errors);
  RUN(test_bad_backward);
  RUN(test_release_after_backward);
  RUN(test_result_freed_before_backward);
  RUN(test_long_chain);
  RUN(test_saved_hooks);
  RUN(test_sum_to_shape);
  return harness_end();
}
