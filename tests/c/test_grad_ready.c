/*
 * test_grad_ready.c - the leaf hook of moe_backward (moe_autograd_set_grad_ready):
 * each leaf reported once, after its last gradient of the backward was summed
 * into .grad (tied weights: one leaf on two edges, or on both inputs of one
 * node); leaves whose gradient was skipped reported too, with no .grad; a
 * root that is itself a leaf; leaves outside the graph not reported; a
 * failing hook stops backward with its status and leaks nothing; without a
 * hook gradients are bit-identical to a run with one.
 */
#include "harness.h"

#define SHAPE(...) (int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (int64_t[]){__VA_ARGS__}

static moe_tensor *leaf(moe_ctx *ctx, const double *v, int ndim, const int64_t *shape) {
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, v, ndim, shape, MOE_F64, MOE_CPU, &t));
  EXPECT_OK(moe_set_requires_grad(ctx, t, true));
  return t;
}

/* What the hook saw: the leaves in order and the sum of each one's .grad at
 * the time (NaN when it had none). */
#define MAX_REPORTS 16
typedef struct reports {
  int n;
  moe_tensor *leaf[MAX_REPORTS];
  double grad_sum[MAX_REPORTS];
  int fail_at; /* 1-based report that fails, 0: none */
} reports;

static double sum_of(moe_ctx *ctx, const moe_tensor *t) {
  int64_t n = moe_tensor_numel(t);
  double *v = malloc(sizeof(double) * (size_t)n), s = 0;
  if (moe_tensor_to_f64(ctx, t, v) != MOE_OK) s = NAN;
  else
    for (int64_t i = 0; i < n; i++) s += v[i];
  free(v);
  return s;
}

static moe_status record_ready(moe_ctx *ctx, moe_tensor *leaf_t, void *ud) {
  reports *r = (reports *)ud;
  if (r->n >= MAX_REPORTS) return moe_error(ctx, MOE_ERR_INVALID_ARG, "too many reports");
  EXPECT(!moe_grad_enabled(ctx)); /* hooks run inside backward, grad mode off */
  moe_tensor *g = moe_tensor_grad(leaf_t);
  r->leaf[r->n] = leaf_t;
  r->grad_sum[r->n] = g ? sum_of(ctx, g) : NAN;
  r->n++;
  if (r->fail_at == r->n) return moe_error(ctx, MOE_ERR_INVALID_ARG, "hook refused leaf %d", r->n);
  return MOE_OK;
}

static int count_of(const reports *r, const moe_tensor *t) {
  int c = 0;
  for (int i = 0; i < r->n; i++) c += r->leaf[i] == t;
  return c;
}

static int index_of(const reports *r, const moe_tensor *t) {
  for (int i = 0; i < r->n; i++)
    if (r->leaf[i] == t) return i;
  return -1;
}

/* loss = sum((a * w + b) * w): w is tied (two edges from two nodes). */
static moe_status tied_graph(moe_ctx *ctx, moe_tensor *a, moe_tensor *b, moe_tensor *w,
                             moe_tensor **loss) {
  moe_tensor *h1 = NULL, *h2 = NULL, *h3 = NULL;
  moe_status st = moe_binary(ctx, MOE_OP_MUL, a, w, &h1);
  if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_ADD, h1, b, &h2);
  if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_MUL, h2, w, &h3);
  if (st == MOE_OK) st = moe_sum(ctx, h3, 0, NULL, false, loss);
  moe_tensor_release(h3);
  moe_tensor_release(h2);
  moe_tensor_release(h1);
  return st;
}

static void test_tied_order(moe_ctx *ctx) {
  moe_tensor *a = leaf(ctx, (double[]){1, 2, 3}, SHAPE(3));
  moe_tensor *b = leaf(ctx, (double[]){-1, 0.5, 2}, SHAPE(3));
  moe_tensor *w = leaf(ctx, (double[]){0.5, -2, 4}, SHAPE(3));
  moe_tensor *unused = leaf(ctx, (double[]){7}, SHAPE(1));
  moe_tensor *loss = NULL;
  reports r = {0};
  moe_autograd_set_grad_ready(ctx, record_ready, &r);
  EXPECT_OK(tied_graph(ctx, a, b, w, &loss));
  EXPECT_OK(moe_backward(ctx, loss, NULL, false));
  /* backward runs mul(h2, w), add(h1, b), mul(a, w): b, then a and w (input order) */
  EXPECT(r.n == 3);
  EXPECT(count_of(&r, a) == 1 && count_of(&r, b) == 1 && count_of(&r, w) == 1);
  EXPECT(index_of(&r, b) == 0 && index_of(&r, a) == 1 && index_of(&r, w) == 2);
  EXPECT(count_of(&r, unused) == 0);
  /* each report came after the last gradient: .grad then equals .grad now */
  EXPECT(r.grad_sum[index_of(&r, a)] == sum_of(ctx, moe_tensor_grad(a)));
  EXPECT(r.grad_sum[index_of(&r, b)] == sum_of(ctx, moe_tensor_grad(b)));
  EXPECT(r.grad_sum[index_of(&r, w)] == sum_of(ctx, moe_tensor_grad(w)));
  /* dw = h2 + w * a with h2 = a * w + b = (-0.5, -3.5, 14), a * w = (0.5, -4, 12) */
  EXPECT(r.grad_sum[index_of(&r, w)] == (-0.5 + 0.5) + (-3.5 - 4) + (14 + 12));
  EXPECT(!moe_tensor_grad(unused));
  moe_autograd_set_grad_ready(ctx, NULL, NULL);
  moe_tensor_release(loss);
  moe_tensor_release(unused);
  moe_tensor_release(w);
  moe_tensor_release(b);
  moe_tensor_release(a);
}

/* x * x: one leaf on both inputs of one node, reported once with 2x. */
static void test_same_node_twice(moe_ctx *ctx) {
  moe_tensor *x = leaf(ctx, (double[]){1, -2}, SHAPE(2)), *y = NULL, *loss = NULL;
  reports r = {0};
  moe_autograd_set_grad_ready(ctx, record_ready, &r);
  EXPECT_OK(moe_binary(ctx, MOE_OP_MUL, x, x, &y));
  EXPECT_OK(moe_sum(ctx, y, 0, NULL, false, &loss));
  EXPECT_OK(moe_backward(ctx, loss, NULL, false));
  EXPECT(r.n == 1 && r.leaf[0] == x && r.grad_sum[0] == 2 * 1 + 2 * -2);
  moe_autograd_set_grad_ready(ctx, NULL, NULL);
  moe_tensor_release(loss);
  moe_tensor_release(y);
  moe_tensor_release(x);
}

/* A custom op whose backward sends nothing to its input. */
static moe_status block_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                 moe_tensor **gin) {
  (void)ctx, (void)n, (void)gout, (void)gin;
  return MOE_OK;
}

static void test_skipped(moe_ctx *ctx) {
  moe_tensor *c = leaf(ctx, (double[]){1, 2}, SHAPE(2)), *d = leaf(ctx, (double[]){3, 4}, SHAPE(2));
  moe_tensor *p = NULL, *q = NULL, *s = NULL, *loss = NULL;
  EXPECT_OK(moe_binary_scalar(ctx, MOE_OP_MUL, c, 2.0, false, &p)); /* skipped: nothing flows */
  moe_node *n = NULL;
  EXPECT_OK(moe_node_new(ctx, MOE_OP_CUSTOM, block_backward, 1, &p, &n));
  bool prev = moe_grad_set(ctx, false);
  EXPECT_OK(moe_clone(ctx, p, &q));
  moe_grad_set(ctx, prev);
  EXPECT_OK(moe_node_set_output(ctx, n, 0, q));
  moe_node_release(n);
  EXPECT_OK(moe_binary(ctx, MOE_OP_ADD, q, d, &s));
  EXPECT_OK(moe_sum(ctx, s, 0, NULL, false, &loss));
  reports r = {0};
  moe_autograd_set_grad_ready(ctx, record_ready, &r);
  EXPECT_OK(moe_backward(ctx, loss, NULL, false));
  EXPECT(r.n == 2 && count_of(&r, c) == 1 && count_of(&r, d) == 1);
  EXPECT(index_of(&r, d) == 0 && r.grad_sum[index_of(&r, d)] == 2);
  EXPECT(isnan(r.grad_sum[index_of(&r, c)]) && !moe_tensor_grad(c)); /* reported with no .grad */
  moe_autograd_set_grad_ready(ctx, NULL, NULL);
  moe_tensor_release(loss);
  moe_tensor_release(s);
  moe_tensor_release(q);
  moe_tensor_release(p);
  moe_tensor_release(d);
  moe_tensor_release(c);
}

static void test_root_leaf(moe_ctx *ctx) {
  moe_tensor *x = leaf(ctx, (double[]){5}, SHAPE(1));
  reports r = {0};
  moe_autograd_set_grad_ready(ctx, record_ready, &r);
  EXPECT_OK(moe_backward(ctx, x, NULL, false));
  EXPECT(r.n == 1 && r.leaf[0] == x && r.grad_sum[0] == 1);
  r.fail_at = 2; /* the next report fails: the status comes back */
  EXPECT_ERR_MSG(moe_backward(ctx, x, NULL, false), MOE_ERR_INVALID_ARG, "hook refused leaf 2");
  EXPECT(moe_grad_enabled(ctx));
  moe_autograd_set_grad_ready(ctx, NULL, NULL);
  moe_tensor_release(x);
}

static void test_hook_failure(moe_ctx *ctx) {
  moe_tensor *a = leaf(ctx, (double[]){1, 2, 3}, SHAPE(3));
  moe_tensor *b = leaf(ctx, (double[]){-1, 0.5, 2}, SHAPE(3));
  moe_tensor *w = leaf(ctx, (double[]){0.5, -2, 4}, SHAPE(3));
  moe_tensor *loss = NULL;
  reports r = {0};
  r.fail_at = 1; /* b's report fails: a and w get no further gradient */
  moe_autograd_set_grad_ready(ctx, record_ready, &r);
  EXPECT_OK(tied_graph(ctx, a, b, w, &loss));
  EXPECT_ERR_MSG(moe_backward(ctx, loss, NULL, false), MOE_ERR_INVALID_ARG, "hook refused leaf 1");
  EXPECT(r.n == 1 && r.leaf[0] == b);
  EXPECT(!moe_tensor_grad(a));
  EXPECT(moe_grad_enabled(ctx));
  moe_autograd_set_grad_ready(ctx, NULL, NULL);
  moe_tensor_release(loss); /* the graph goes with it: RUN checks no storage is left */
  moe_tensor_release(w);
  moe_tensor_release(b);
  moe_tensor_release(a);
}

/* Gradients with and without a hook are the same, bit for bit; a cleared
 * hook is not called. */
static void test_no_hook_unchanged(moe_ctx *ctx) {
  double ga[2][3], gw[2][3];
  reports r = {0};
  for (int pass = 0; pass < 2; pass++) {
    moe_tensor *a = leaf(ctx, (double[]){1.1, 2.3, -3.7}, SHAPE(3));
    moe_tensor *b = leaf(ctx, (double[]){-1, 0.5, 2}, SHAPE(3));
    moe_tensor *w = leaf(ctx, (double[]){0.3, -2.9, 4.1}, SHAPE(3));
    moe_tensor *loss = NULL;
    if (pass == 1) moe_autograd_set_grad_ready(ctx, record_ready, &r);
    EXPECT_OK(tied_graph(ctx, a, b, w, &loss));
    EXPECT_OK(moe_backward(ctx, loss, NULL, false));
    moe_autograd_set_grad_ready(ctx, NULL, &r); /* NULL clears it */
    EXPECT_OK(moe_tensor_to_f64(ctx, moe_tensor_grad(a), ga[pass]));
    EXPECT_OK(moe_tensor_to_f64(ctx, moe_tensor_grad(w), gw[pass]));
    moe_tensor_release(loss);
    moe_tensor_release(w);
    moe_tensor_release(b);
    moe_tensor_release(a);
  }
  EXPECT(r.n == 3);
  EXPECT(memcmp(ga[0], ga[1], sizeof ga[0]) == 0 && memcmp(gw[0], gw[1], sizeof gw[0]) == 0);
  /* a hook cleared: the next backward reports nothing */
  moe_tensor *x = leaf(ctx, (double[]){5}, SHAPE(1));
  EXPECT_OK(moe_backward(ctx, x, NULL, false));
  EXPECT(r.n == 3);
  moe_tensor_release(x);
}

/* Many leaves (the leaf table grows past its first size), each reported once. */
enum { MANY = 200 };
typedef struct many_state {
  int n;
  bool seen[MANY];
  moe_tensor **xs;
} many_state;

static moe_status many_ready(moe_ctx *ctx, moe_tensor *t, void *ud) {
  many_state *c = (many_state *)ud;
  for (int i = 0; i < MANY; i++)
    if (c->xs[i] == t) {
      if (c->seen[i]) return moe_error(ctx, MOE_ERR_INVALID_ARG, "leaf %d reported twice", i);
      c->seen[i] = true;
    }
  c->n++;
  return MOE_OK;
}

static void test_many_leaves(moe_ctx *ctx) {
  moe_tensor *xs[MANY], *acc = NULL, *loss = NULL;
  for (int i = 0; i < MANY; i++) xs[i] = leaf(ctx, (double[]){(double)i}, SHAPE(1));
  EXPECT_OK(moe_binary(ctx, MOE_OP_MUL, xs[0], xs[0], &acc));
  for (int i = 1; i < MANY; i++) {
    moe_tensor *t = NULL;
    EXPECT_OK(moe_binary(ctx, MOE_OP_ADD, acc, xs[i], &t));
    moe_tensor_release(acc);
    acc = t;
  }
  EXPECT_OK(moe_sum(ctx, acc, 0, NULL, false, &loss));
  many_state c = {0, {false}, xs};
  moe_autograd_set_grad_ready(ctx, many_ready, &c);
  EXPECT_OK(moe_backward(ctx, loss, NULL, false));
  moe_autograd_set_grad_ready(ctx, NULL, NULL);
  int seen = 0;
  for (int i = 0; i < MANY; i++) seen += c.seen[i];
  EXPECT(c.n == MANY && seen == MANY);
  moe_tensor_release(loss);
  moe_tensor_release(acc);
  for (int i = 0; i < MANY; i++) moe_tensor_release(xs[i]);
}

int main(void) {
  RUN(test_tied_order);
  RUN(test_same_node_twice);
  RUN(test_skipped);
  RUN(test_root_leaf);
  RUN(test_hook_failure);
  RUN(test_no_hook_unchanged);
  RUN(test_many_leaves);
  return harness_end();
}
