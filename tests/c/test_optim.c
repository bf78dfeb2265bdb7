/*
 * test_optim.c - the fused optimiser updates (core/moe_optim.h) on the CPU:
 * AdamW and SGD against naive double-precision references written out here
 * for several steps (f32, f64, bf16 parameters with f32 master weights,
 * non-contiguous gradients), and the error paths.
 */
#include "harness.h"
#include "moe_optim.h"

#define N 37

static moe_tensor *vec(moe_ctx *ctx, const double *v, int64_t n, moe_dtype dt) {
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, v, 1, &n, dt, MOE_CPU, &t));
  return t;
}

static void fill_values(double *p, double *g, int step) {
  for (int i = 0; i < N; i++) {
    p[i] = sin(0.7 * i + 0.3) * 2.0;
    g[i] = cos(1.3 * i + step) * (0.5 + 0.1 * step) + (i % 5 == 0 ? 1e-4 : 0);
  }
}

/* The textbook AdamW (PyTorch's formula) in double. */
static void ref_adamw(double *w, double *m, double *v, const double *g, int64_t n,
                      const moe_adamw_opts *o) {
  double bc1 = 1 - pow(o->beta1, (double)o->step), bc2 = 1 - pow(o->beta2, (double)o->step);
  for (int64_t i = 0; i < n; i++) {
    w[i] *= 1 - o->lr * o->weight_decay;
    m[i] = o->beta1 * m[i] + (1 - o->beta1) * g[i];
    v[i] = o->beta2 * v[i] + (1 - o->beta2) * g[i] * g[i];
    w[i] -= o->lr / bc1 * m[i] / (sqrt(v[i]) / sqrt(bc2) + o->eps);
  }
}

static double max_rel(const moe_tensor *t, const double *want, int64_t n) {
  double got[N], worst = 0;
  if (moe_tensor_to_f64(harness_ctx, t, got) != MOE_OK) return INFINITY;
  for (int64_t i = 0; i < n; i++) {
    double e = fabs(got[i] - want[i]) / (fabs(want[i]) + 1e-3);
    if (!(e <= worst)) worst = e;
  }
  return worst;
}

static void run_adamw(moe_ctx *ctx, moe_dtype pdt, bool master, double tol) {
  double p[N], g[N], w[N], m[N] = {0}, v[N] = {0};
  fill_values(p, g, 0);
  memcpy(w, p, sizeof w);
  moe_dtype sdt = pdt == MOE_F64 ? MOE_F64 : MOE_F32;
  moe_tensor *tp = vec(ctx, p, N, pdt), *tm = NULL, *tv = NULL, *tw = NULL;
  int64_t n = N;
  EXPECT_OK(moe_tensor_full(ctx, 1, &n, 0, sdt, MOE_CPU, &tm));
  EXPECT_OK(moe_tensor_full(ctx, 1, &n, 0, sdt, MOE_CPU, &tv));
  if (master) {
    /* the reference starts from the bf16-rounded values, as the master does */
    moe_tensor *tmp = NULL; /* moe_to may hand back tp itself: clone */
    EXPECT_OK(moe_to(ctx, tp, sdt, MOE_CPU, &tmp));
    EXPECT_OK(moe_clone(ctx, tmp, &tw));
    moe_tensor_release(tmp);
    EXPECT_OK(moe_tensor_to_f64(ctx, tw, w));
  }
  for (int step = 1; step <= 5; step++) {
    fill_values(p, g, step);
    moe_tensor *tg = vec(ctx, g, N, pdt == MOE_F64 ? MOE_F64 : MOE_F32);
    moe_adamw_opts o = {1e-2, 0.9, 0.95, 1e-8, 0.1, step};
    EXPECT_OK(moe_adamw_step(ctx, tp, tg, tm, tv, tw, &o));
    ref_adamw(w, m, v, g, N, &o);
    moe_tensor_release(tg);
  }
  EXPECT(max_rel(tm, m, N) <= tol);
  EXPECT(max_rel(tv, v, N) <= tol);
  if (tw) EXPECT(max_rel(tw, w, N) <= tol);
  /* the parameter is the master (or the reference) rounded to its dtype */
  EXPECT(max_rel(tp, w, N) <= (pdt == MOE_BF16 ? 4e-3 : tol));
  if (tw) {
    moe_tensor *r = NULL;
    EXPECT_OK(moe_to(ctx, tw, pdt, MOE_CPU, &r));
    double a[N], b[N];
    EXPECT_OK(moe_tensor_to_f64(ctx, r, a));
    EXPECT_OK(moe_tensor_to_f64(ctx, tp, b));
    EXPECT(memcmp(a, b, sizeof a) == 0);
    moe_tensor_release(r);
  }
  moe_tensor_release(tp);
  moe_tensor_release(tm);
  moe_tensor_release(tv);
  moe_tensor_release(tw);
}

/* f32 state: a few f32 roundings per step (1e-5 relative); f64: 1e-12. */
static void test_adamw_f32(moe_ctx *ctx) { run_adamw(ctx, MOE_F32, false, 1e-5); }
static void test_adamw_f64(moe_ctx *ctx) { run_adamw(ctx, MOE_F64, false, 1e-12); }
static void test_adamw_bf16_master(moe_ctx *ctx) { run_adamw(ctx, MOE_BF16, true, 1e-5); }
static void test_adamw_f32_master(moe_ctx *ctx) { run_adamw(ctx, MOE_F32, true, 1e-5); }

/* A transposed (non-contiguous) gradient gives the contiguous result. */
static void test_adamw_noncontiguous_grad(moe_ctx *ctx) {
  double pv[6] = {1, 2, 3, 4, 5, 6}, gv[6] = {0.1, -0.2, 0.3, -0.4, 0.5, -0.6};
  int64_t s23[2] = {2, 3}, s32[2] = {3, 2};
  moe_tensor *p1 = NULL, *p2 = NULL, *g = NULL, *gt = NULL, *gtt = NULL, *gc = NULL;
  moe_tensor *m1 = NULL, *v1 = NULL, *m2 = NULL, *v2 = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, pv, 2, s23, MOE_F32, MOE_CPU, &p1));
  EXPECT_OK(moe_tensor_from_f64(ctx, pv, 2, s23, MOE_F32, MOE_CPU, &p2));
  EXPECT_OK(moe_tensor_from_f64(ctx, gv, 2, s32, MOE_F32, MOE_CPU, &g));
  EXPECT_OK(moe_transpose(ctx, g, 0, 1, &gt)); /* (2, 3) strided */
  EXPECT(!moe_tensor_is_contiguous(gt));
  EXPECT_OK(moe_contiguous(ctx, gt, &gc));
  EXPECT_OK(moe_tensor_full(ctx, 2, s23, 0, MOE_F32, MOE_CPU, &m1));
  EXPECT_OK(moe_tensor_full(ctx, 2, s23, 0, MOE_F32, MOE_CPU, &v1));
  EXPECT_OK(moe_tensor_full(ctx, 2, s23, 0, MOE_F32, MOE_CPU, &m2));
  EXPECT_OK(moe_tensor_full(ctx, 2, s23, 0, MOE_F32, MOE_CPU, &v2));
  moe_adamw_opts o = {0.1, 0.9, 0.999, 1e-8, 0.0, 1};
  EXPECT_OK(moe_adamw_step(ctx, p1, gt, m1, v1, NULL, &o));
  EXPECT_OK(moe_adamw_step(ctx, p2, gc, m2, v2, NULL, &o));
  double a[6], b[6];
  EXPECT_OK(moe_tensor_to_f64(ctx, p1, a));
  EXPECT_OK(moe_tensor_to_f64(ctx, p2, b));
  EXPECT(memcmp(a, b, sizeof a) == 0);
  /* first step, no decay: w - lr * sign(g) (up to eps) */
  EXPECT_NEAR(a[0], 1 - 0.1, 1e-6);
  EXPECT_NEAR(a[1], 2 - 0.1, 1e-6); /* g^T[0][1] = g[1][0] = 0.3 > 0 */
  moe_tensor *list[] = {p1, p2, g, gt, gtt, gc, m1, v1, m2, v2};
  for (size_t i = 0; i < sizeof list / sizeof list[0]; i++) moe_tensor_release(list[i]);
}

static void test_sgd_momentum(moe_ctx *ctx) {
  double p[N], g[N], w[N], buf[N] = {0};
  fill_values(p, g, 0);
  memcpy(w, p, sizeof w);
  moe_tensor *tp = vec(ctx, p, N, MOE_F64), *tb = NULL, *tp2 = vec(ctx, p, N, MOE_F32);
  int64_t n = N;
  EXPECT_OK(moe_tensor_full(ctx, 1, &n, 0, MOE_F64, MOE_CPU, &tb));
  moe_sgd_opts o = {0.1, 0.9, 0.01};
  moe_sgd_opts plain = {0.1, 0.0, 0.0};
  for (int step = 1; step <= 4; step++) {
    fill_values(p, g, step);
    moe_tensor *tg = vec(ctx, g, N, MOE_F64);
    EXPECT_OK(moe_sgd_step(ctx, tp, tg, tb, NULL, &o));
    EXPECT_OK(moe_sgd_step(ctx, tp2, tg, NULL, NULL, &plain));
    for (int i = 0; i < N; i++) {
      buf[i] = 0.9 * buf[i] + g[i] + 0.01 * w[i];
      w[i] -= 0.1 * buf[i];
    }
    moe_tensor_release(tg);
  }
  EXPECT(max_rel(tp, w, N) <= 1e-12);
  EXPECT(max_rel(tb, buf, N) <= 1e-12);
  /* plain SGD: p0 - lr * sum of the gradients */
  double want[N], g0[N];
  fill_values(want, g0, 0);
  for (int step = 1; step <= 4; step++) {
    fill_values(p, g, step);
    for (int i = 0; i < N; i++) want[i] -= 0.1 * g[i];
  }
  EXPECT(max_rel(tp2, want, N) <= 1e-5);
  moe_tensor_release(tp);
  moe_tensor_release(tp2);
  moe_tensor_release(tb);
}

static void test_errors(moe_ctx *ctx) {
  int64_t n3 = 3, n4 = 4;
  moe_tensor *p = NULL, *g4 = NULL, *g = NULL, *m = NULL, *v = NULL, *m64 = NULL, *pi = NULL,
             *pb = NULL, *gi = NULL;
  EXPECT_OK(moe_tensor_full(ctx, 1, &n3, 1, MOE_F32, MOE_CPU, &p));
  EXPECT_OK(moe_tensor_full(ctx, 1, &n3, 1, MOE_F32, MOE_CPU, &g));
  EXPECT_OK(moe_tensor_full(ctx, 1, &n4, 1, MOE_F32, MOE_CPU, &g4));
  EXPECT_OK(moe_tensor_full(ctx, 1, &n3, 0, MOE_F32, MOE_CPU, &m));
  EXPECT_OK(moe_tensor_full(ctx, 1, &n3, 0, MOE_F32, MOE_CPU, &v));
  EXPECT_OK(moe_tensor_full(ctx, 1, &n3, 0, MOE_F64, MOE_CPU, &m64));
  EXPECT_OK(moe_tensor_full(ctx, 1, &n3, 0, MOE_I64, MOE_CPU, &pi));
  EXPECT_OK(moe_tensor_full(ctx, 1, &n3, 0, MOE_BF16, MOE_CPU, &pb));
  EXPECT_OK(moe_tensor_full(ctx, 1, &n3, 0, MOE_I32, MOE_CPU, &gi));
  moe_adamw_opts o = moe_adamw_opts_default();
  EXPECT_ERR_MSG(moe_adamw_step(ctx, p, g4, m, v, NULL, &o), MOE_ERR_SHAPE,
                 "grad has shape [4] but param has shape [3]");
  EXPECT_ERR_MSG(moe_adamw_step(ctx, pi, g, m, v, NULL, &o), MOE_ERR_DTYPE, "param must be");
  EXPECT_ERR_MSG(moe_adamw_step(ctx, p, gi, m, v, NULL, &o), MOE_ERR_DTYPE, "grad must be");
  EXPECT_ERR_MSG(moe_adamw_step(ctx, p, g, m64, v, NULL, &o), MOE_ERR_DTYPE,
                 "exp_avg must be f32 for a f32 param, got f64");
  EXPECT_ERR_MSG(moe_adamw_step(ctx, pb, g, m, v, NULL, &o), MOE_ERR_INVALID_ARG, "master copy");
  EXPECT_ERR_MSG(moe_adamw_step(ctx, p, g, p, v, NULL, &o), MOE_ERR_INVALID_ARG,
                 "shares param's storage");
  EXPECT_ERR_MSG(moe_adamw_step(ctx, p, g, m, g4, NULL, &o), MOE_ERR_SHAPE, "exp_avg_sq has shape");
  moe_adamw_opts bad = o;
  bad.beta1 = 1.0;
  EXPECT_ERR_MSG(moe_adamw_step(ctx, p, g, m, v, NULL, &bad), MOE_ERR_INVALID_ARG, "betas");
  bad = o;
  bad.step = 0;
  EXPECT_ERR_MSG(moe_adamw_step(ctx, p, g, m, v, NULL, &bad), MOE_ERR_INVALID_ARG, "step >= 1");
  EXPECT_ERR(moe_adamw_step(ctx, p, g, m, v, NULL, NULL), MOE_ERR_INVALID_ARG);
  moe_sgd_opts so = {0.1, 0.9, 0};
  EXPECT_ERR_MSG(moe_sgd_step(ctx, p, g, NULL, NULL, &so), MOE_ERR_INVALID_ARG, "momentum buffer");
  so.lr = -1;
  EXPECT_ERR_MSG(moe_sgd_step(ctx, p, g, m, NULL, &so), MOE_ERR_INVALID_ARG, "lr");
  /* nothing was touched by the failed calls */
  EXPECT_VALUES(p, 0, 1, 1, 1);
  EXPECT_VALUES(m, 0, 0, 0, 0);
  moe_tensor *list[] = {p, g4, g, m, v, m64, pi, pb, gi};
  for (size_t i = 0; i < sizeof list / sizeof list[0]; i++) moe_tensor_release(list[i]);
}

int main(void) {
  RUN(test_adamw_f32);
  RUN(test_adamw_f64);
  RUN(test_adamw_bf16_master);
  RUN(test_adamw_f32_master);
  RUN(test_adamw_noncontiguous_grad);
  RUN(test_sgd_momentum);
  RUN(test_errors);
  return harness_end();
}
