/*
 * test_dist_reducer.c - the gradient reducer (moe_dist.h, core/dist_reducer.c)
 * in a world of one rank, where all_reduce(avg) is the identity: buckets by
 * reverse parameter order per (dtype, device) group and their count;
 * gradients after finish bit-identical to a plain backward, each .grad a
 * view of its bucket's buffer; a parameter backward never reached keeps
 * .grad NULL, one with a gradient from an earlier backward (gradient
 * accumulation) keeps it; errors (arming twice, two reducers, finish
 * unarmed, a second backward while armed, bad parameter lists) and a
 * reducer freed while armed. The multi-rank test is tests/dist/dp_*.lua.
 */
#include "harness.h"

#define SHAPE(...) (int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (int64_t[]){__VA_ARGS__}

static moe_comm *world(moe_ctx *ctx) {
  moe_comm *w = NULL;
  EXPECT_OK(moe_dist_init(ctx, &w));
  EXPECT(w && moe_comm_size(w) == 1);
  return w;
}

/* A leaf of numel deterministic values. */
static moe_tensor *param(moe_ctx *ctx, moe_dtype dt, int ndim, const int64_t *shape, double phase) {
  int64_t n = 1;
  for (int d = 0; d < ndim; d++) n *= shape[d];
  double *v = malloc(sizeof(double) * (size_t)n);
  for (int64_t i = 0; i < n; i++) v[i] = sin(0.7 * (double)i + phase);
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, v, ndim, shape, dt, MOE_CPU, &t));
  EXPECT_OK(moe_set_requires_grad(ctx, t, true));
  free(v);
  return t;
}

/* The model: five parameters, p[0] (f32, 4x3) tied: used first and last;
 * p[4] (f64, 3) is its own group; p[3] (f32, 6) is never used.
 *   h = p0 * 2; h = h + p1 (4x3); s = sum(h * p2 (3)); u = sum(p0 * p0);
 *   loss = s + u + sum(p4) (cast to f32) */
enum { NP = 5 };
static moe_status model_loss(moe_ctx *ctx, moe_tensor **p, bool use_p3, moe_tensor **loss) {
  moe_tensor *h = NULL, *h2 = NULL, *h3 = NULL, *s = NULL, *q = NULL, *u = NULL, *su = NULL,
             *t4 = NULL, *c4 = NULL, *tot = NULL, *s3 = NULL;
  moe_status st = moe_binary_scalar(ctx, MOE_OP_MUL, p[0], 2.0, false, &h);
  if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_ADD, h, p[1], &h2);
  if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_MUL, h2, p[2], &h3);
  if (st == MOE_OK) st = moe_sum(ctx, h3, 0, NULL, false, &s);
  if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_MUL, p[0], p[0], &q);
  if (st == MOE_OK) st = moe_sum(ctx, q, 0, NULL, false, &u);
  if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_ADD, s, u, &su);
  if (st == MOE_OK) st = moe_sum(ctx, p[4], 0, NULL, false, &t4);
  if (st == MOE_OK) st = moe_to(ctx, t4, MOE_F32, MOE_CPU, &c4);
  if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_ADD, su, c4, &tot);
  if (st == MOE_OK && use_p3) {
    moe_tensor *a = NULL;
    st = moe_sum(ctx, p[3], 0, NULL, false, &s3);
    if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_ADD, tot, s3, &a);
    moe_tensor_release(tot);
    tot = a;
  }
  if (st == MOE_OK) *loss = tot;
  else moe_tensor_release(tot);
  moe_tensor *tmp[] = {h, h2, h3, s, q, u, su, t4, c4, s3};
  for (size_t i = 0; i < sizeof tmp / sizeof tmp[0]; i++) moe_tensor_release(tmp[i]);
  return st;
}

static void make_params(moe_ctx *ctx, moe_tensor **p) {
  p[0] = param(ctx, MOE_F32, SHAPE(4, 3), 0.1);
  p[1] = param(ctx, MOE_F32, SHAPE(4, 3), 0.2);
  p[2] = param(ctx, MOE_F32, SHAPE(3), 0.3);
  p[3] = param(ctx, MOE_F32, SHAPE(6), 0.4);
  p[4] = param(ctx, MOE_F64, SHAPE(3), 0.5);
}

static void free_params(moe_tensor **p) {
  for (int i = 0; i < NP; i++) moe_tensor_release(p[i]);
}

static void grads_of(moe_ctx *ctx, moe_tensor **p, double out[NP][12], bool has[NP]) {
  for (int i = 0; i < NP; i++) {
    moe_tensor *g = moe_tensor_grad(p[i]);
    has[i] = g != NULL;
    memset(out[i], 0, sizeof out[i]);
    if (g) EXPECT_OK(moe_tensor_to_f64(ctx, g, out[i]));
  }
}

static void test_buckets(moe_ctx *ctx) {
  moe_comm *w = world(ctx);
  moe_tensor *p[NP];
  make_params(ctx, p);
  moe_reducer *r = NULL;
  /* f32 bytes: p0 48, p1 48, p2 12, p3 24; f64: p4 24 */
  EXPECT_OK(moe_reducer_new(ctx, w, NP, p, 0, &r));
  EXPECT(moe_reducer_buckets(r) == NP); /* 0: one parameter per bucket */
  moe_reducer_free(ctx, r);
  EXPECT_OK(moe_reducer_new(ctx, w, NP, p, 1 << 20, &r));
  EXPECT(moe_reducer_buckets(r) == 2); /* one per (dtype, device) group */
  moe_reducer_free(ctx, r);
  /* reverse order, 40 bytes: [p4] f64, [p3 24 + p2 12], [p1 48], [p0 48] */
  EXPECT_OK(moe_reducer_new(ctx, w, NP, p, 40, &r));
  EXPECT(moe_reducer_buckets(r) == 4);
  moe_reducer_free(ctx, r);
  EXPECT_OK(moe_reducer_new(ctx, w, 0, NULL, 40, &r));
  EXPECT(moe_reducer_buckets(r) == 0);
  EXPECT_OK(moe_reducer_arm(ctx, r));
  EXPECT_OK(moe_reducer_finish(ctx, r));
  moe_reducer_free(ctx, r);
  moe_reducer_free(ctx, NULL);
  free_params(p);
}

/* Plain backward vs arm / backward / finish: the same gradients, bit for bit. */
static void test_identity(moe_ctx *ctx) {
  moe_comm *w = world(ctx);
  double ref[NP][12], got[NP][12];
  bool has_ref[NP], has_got[NP];
  for (int pass = 0; pass < 2; pass++) {
    moe_tensor *p[NP], *loss = NULL;
    make_params(ctx, p);
    moe_reducer *r = NULL;
    if (pass == 1) {
      EXPECT_OK(moe_reducer_new(ctx, w, NP, p, 40, &r));
      EXPECT_OK(moe_reducer_arm(ctx, r));
    }
    EXPECT_OK(model_loss(ctx, p, false, &loss));
    EXPECT_OK(moe_backward(ctx, loss, NULL, false));
    moe_tensor *g1_before = moe_tensor_grad(p[1]);
    if (pass == 1) {
      EXPECT_OK(moe_reducer_finish(ctx, r));
      /* p1 and p0 are alone in theirs: p1's gradient (nobody else holds it)
       * is averaged in place, the same tensor; p2's grad is a view of a
       * buffer */
      EXPECT(moe_tensor_grad(p[1]) == g1_before);
      moe_tensor *g2 = moe_tensor_grad(p[2]);
      EXPECT(g2 && g2->storage->nbytes == (24 + 12) && g2->offset == 6);
      EXPECT(moe_tensor_grad(p[3]) == NULL); /* never reached, on no rank */
      moe_reducer_free(ctx, r);
    }
    grads_of(ctx, p, pass ? got : ref, pass ? has_got : has_ref);
    moe_tensor_release(loss);
    free_params(p);
  }
  EXPECT(memcmp(has_ref, has_got, sizeof has_ref) == 0);
  EXPECT(memcmp(ref, got, sizeof ref) == 0);
}

/* Gradient accumulation: the first backward unarmed (uses p3), the second
 * armed (does not): p3's accumulated gradient is reduced too; a second
 * round works the same; zero_grad between rounds. */
static void test_accumulate(moe_ctx *ctx) {
  moe_comm *w = world(ctx);
  double ref[NP][12], got[NP][12];
  bool has_ref[NP], has_got[NP];
  for (int pass = 0; pass < 2; pass++) {
    moe_tensor *p[NP];
    make_params(ctx, p);
    moe_reducer *r = NULL;
    if (pass == 1) EXPECT_OK(moe_reducer_new(ctx, w, NP, p, 30, &r));
    for (int round = 0; round < 2; round++) {
      for (int i = 0; i < NP; i++) EXPECT_OK(moe_tensor_set_grad(ctx, p[i], NULL));
      for (int micro = 0; micro < 2; micro++) {
        moe_tensor *loss = NULL;
        if (r && micro == 1) EXPECT_OK(moe_reducer_arm(ctx, r));
        EXPECT_OK(model_loss(ctx, p, micro == 0, &loss));
        EXPECT_OK(moe_backward(ctx, loss, NULL, false));
        moe_tensor_release(loss);
      }
      if (r) EXPECT_OK(moe_reducer_finish(ctx, r));
    }
    EXPECT(moe_tensor_grad(p[3]) != NULL);
    grads_of(ctx, p, pass ? got : ref, pass ? has_got : has_ref);
    moe_reducer_free(ctx, r);
    free_params(p);
  }
  EXPECT(memcmp(has_ref, has_got, sizeof has_ref) == 0);
  EXPECT(memcmp(ref, got, sizeof ref) == 0);
}

static void test_errors(moe_ctx *ctx) {
  moe_comm *w = world(ctx);
  moe_tensor *p[NP], *loss = NULL, *nl = NULL, *plain = NULL;
  make_params(ctx, p);
  moe_reducer *r = NULL, *r2 = NULL;
  EXPECT_ERR_MSG(moe_reducer_new(ctx, NULL, NP, p, 40, &r), MOE_ERR_INVALID_ARG, "communicator");
  moe_tensor *dup[] = {p[0], p[1], p[0]};
  EXPECT_ERR_MSG(moe_reducer_new(ctx, w, 3, dup, 40, &r), MOE_ERR_INVALID_ARG,
                 "parameters 0 and 2 are the same tensor");
  EXPECT(r == NULL);
  EXPECT_OK(moe_binary_scalar(ctx, MOE_OP_MUL, p[0], 2.0, false, &nl));
  moe_tensor *bad[] = {p[1], nl};
  EXPECT_ERR_MSG(moe_reducer_new(ctx, w, 2, bad, 40, &r), MOE_ERR_INVALID_ARG,
                 "parameter 1 (shape [4, 3]) is not a leaf that requires grad");
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(2), 1.0, MOE_F32, MOE_CPU, &plain));
  bad[1] = plain;
  EXPECT_ERR_MSG(moe_reducer_new(ctx, w, 2, bad, 40, &r), MOE_ERR_INVALID_ARG, "not a leaf");

  EXPECT_OK(moe_reducer_new(ctx, w, NP, p, 40, &r));
  EXPECT_OK(moe_reducer_new(ctx, w, NP, p, 40, &r2));
  EXPECT_ERR_MSG(moe_reducer_finish(ctx, r), MOE_ERR_INVALID_ARG, "not armed");
  EXPECT_OK(moe_reducer_arm(ctx, r));
  EXPECT_ERR_MSG(moe_reducer_arm(ctx, r), MOE_ERR_INVALID_ARG, "already armed");
  EXPECT_ERR_MSG(moe_reducer_arm(ctx, r2), MOE_ERR_INVALID_ARG, "another reducer");
  /* two backwards in one round */
  EXPECT_OK(model_loss(ctx, p, false, &loss));
  EXPECT_OK(moe_backward(ctx, loss, NULL, false));
  moe_tensor_release(loss);
  EXPECT_OK(model_loss(ctx, p, false, &loss));
  EXPECT_ERR_MSG(moe_backward(ctx, loss, NULL, false), MOE_ERR_INVALID_ARG,
                 "from a second backward while armed");
  moe_tensor_release(loss);
  EXPECT_OK(moe_reducer_finish(ctx, r)); /* the round still completes */
  EXPECT_OK(moe_reducer_arm(ctx, r2));   /* the hook is free again */
  EXPECT_OK(moe_reducer_finish(ctx, r2));
  /* freed while armed, with buckets in flight: the hook goes with it */
  EXPECT_OK(moe_reducer_arm(ctx, r));
  EXPECT_OK(model_loss(ctx, p, false, &loss));
  EXPECT_OK(moe_backward(ctx, loss, NULL, false));
  moe_tensor_release(loss);
  moe_reducer_free(ctx, r);
  EXPECT_OK(moe_reducer_arm(ctx, r2));
  moe_reducer_free(ctx, r2);
  moe_tensor_release(plain);
  moe_tensor_release(nl);
  free_params(p);
}

int main(void) {
  RUN(test_buckets);
  RUN(test_identity);
  RUN(test_accumulate);
  RUN(test_errors);
  moe_dist_finalize();
  return harness_end();
}
