/*
 * optim_multi_cases.h - the cases of the multi-tensor optimiser ops
 * (moe_adamw_step_multi, moe_grad_norm_multi, moe_scale_multi), run on one
 * device by tests/c/test_optim_multi.c (CPU) and test_optim_multi_cuda.c
 * (GPU). Tolerance 0 for the updates: the multi-tensor op must give the bits
 * of one moe_adamw_step per entry; the norm is compared with a double
 * reference at 1e-5 (f32 sums of up to 66K terms) and with itself for bits.
 */
#ifndef OPTIM_MULTI_CASES_H
#define OPTIM_MULTI_CASES_H

#include "harness.h"
#include "moe_optim.h"

typedef struct om_spec {
  int64_t n;
  moe_dtype pdt, gdt;
  bool master;
  double wd;
} om_spec;

/* Mixed sizes (empty, one, across a chunk), dtypes and decay groups, then
 * 52 small tensors so that a CUDA launch list overflows (48 per launch). */
#define OM_FIXED 8
#define OM_COUNT (OM_FIXED + 52)
static om_spec om_specs(int k) {
  static const om_spec fixed[OM_FIXED] = {
      {37, MOE_F32, MOE_F32, false, 0.1},
      {1, MOE_F32, MOE_BF16, false, 0.0},
      {0, MOE_F32, MOE_F32, false, 0.1},
      {MOE_OPTIM_CHUNK + 17, MOE_BF16, MOE_BF16, true, 0.1},
      {200, MOE_F64, MOE_F64, false, 0.1},
      {513, MOE_F16, MOE_F32, true, 0.0},
      {1000, MOE_F32, MOE_F64, true, 0.1},
      {300, MOE_F64, MOE_BF16, false, 0.0},
  };
  if (k < OM_FIXED) return fixed[k];
  static const moe_dtype pd[] = {MOE_F32, MOE_BF16, MOE_F64};
  moe_dtype p = pd[k % 3];
  om_spec s = {3 + k, p, k % 2 ? MOE_BF16 : MOE_F32, p == MOE_BF16, (k % 4) ? 0.05 : 0.0};
  if (p == MOE_F64) s.gdt = MOE_F64;
  return s;
}

static moe_dtype om_sdt(moe_dtype p) { return p == MOE_F64 ? MOE_F64 : MOE_F32; }

/* n values f(i, seed) of dtype dt on d; `poison` puts an inf at element 0. */
static moe_tensor *om_make(moe_ctx *ctx, int64_t n, moe_dtype dt, moe_device d, int seed,
                           double scale) {
  double *v = malloc(sizeof(double) * (size_t)(n + 1));
  for (int64_t i = 0; i < n; i++) v[i] = scale * sin(0.37 * (double)i + 1.3 * seed) * (1 + (i % 7) * 0.1);
  moe_tensor *c = NULL, *t = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, v, 1, &n, dt, MOE_CPU, &c));
  EXPECT_OK(moe_to(ctx, c, dt, d, &t));
  if (t == c) { /* moe_to may hand back c: keep a private copy */
    moe_tensor_release(t);
    EXPECT_OK(moe_clone(ctx, c, &t));
  }
  moe_tensor_release(c);
  free(v);
  return t;
}

static moe_tensor *om_copy(moe_ctx *ctx, moe_tensor *t) {
  moe_tensor *c = NULL;
  if (t) EXPECT_OK(moe_clone(ctx, t, &c));
  return c;
}

/* Element-wise identical bits (f64 holds every f32/bf16/f16 value exactly). */
static int om_same(moe_ctx *ctx, const moe_tensor *a, const moe_tensor *b) {
  if (!a || !b) return a == b;
  int64_t n = moe_tensor_numel(a);
  if (n != moe_tensor_numel(b)) return 0;
  double *x = malloc(sizeof(double) * (size_t)(n + 1)), *y = malloc(sizeof(double) * (size_t)(n + 1));
  int ok = moe_tensor_to_f64(ctx, a, x) == MOE_OK && moe_tensor_to_f64(ctx, b, y) == MOE_OK;
  for (int64_t i = 0; ok && i < n; i++)
    if (memcmp(&x[i], &y[i], sizeof(double)) != 0) {
      fprintf(stderr, "element %lld: %.17g vs %.17g\n", (long long)i, x[i], y[i]);
      ok = 0;
    }
  free(x);
  free(y);
  return ok;
}

/* Two copies of every parameter and its state: a for moe_adamw_step, b for
 * the multi-tensor op. */
typedef struct om_set {
  moe_tensor *p[2][OM_COUNT], *m[2][OM_COUNT], *v[2][OM_COUNT], *w[2][OM_COUNT];
} om_set;

static void om_set_init(moe_ctx *ctx, om_set *s, moe_device d) {
  memset(s, 0, sizeof *s);
  for (int k = 0; k < OM_COUNT; k++) {
    om_spec sp = om_specs(k);
    int64_t n = sp.n;
    moe_dtype sdt = om_sdt(sp.pdt);
    s->p[0][k] = om_make(ctx, n, sp.pdt, d, k, 1.0);
    EXPECT_OK(moe_tensor_full(ctx, 1, &n, 0, sdt, d, &s->m[0][k]));
    EXPECT_OK(moe_tensor_full(ctx, 1, &n, 0, sdt, d, &s->v[0][k]));
    if (sp.master) { /* moe_to may hand back the f32 param itself: copy */
      moe_tensor *t = NULL;
      EXPECT_OK(moe_to(ctx, s->p[0][k], sdt, d, &t));
      s->w[0][k] = om_copy(ctx, t);
      moe_tensor_release(t);
    }
    s->p[1][k] = om_copy(ctx, s->p[0][k]);
    s->m[1][k] = om_copy(ctx, s->m[0][k]);
    s->v[1][k] = om_copy(ctx, s->v[0][k]);
    s->w[1][k] = om_copy(ctx, s->w[0][k]);
  }
}

static void om_set_free(om_set *s) {
  for (int c = 0; c < 2; c++)
    for (int k = 0; k < OM_COUNT; k++) {
      moe_tensor_release(s->p[c][k]);
      moe_tensor_release(s->m[c][k]);
      moe_tensor_release(s->v[c][k]);
      moe_tensor_release(s->w[c][k]);
    }
}

/* Copy c of s and the step's gradients as entries. */
static void om_entries(om_set *s, int c, moe_tensor **g, moe_adamw_entry *e) {
  for (int k = 0; k < OM_COUNT; k++) {
    e[k].param = s->p[c][k];
    e[k].grad = g[k];
    e[k].exp_avg = s->m[c][k];
    e[k].exp_avg_sq = s->v[c][k];
    e[k].master = s->w[c][k];
    e[k].weight_decay = om_specs(k).wd;
  }
}

static int om_set_same(moe_ctx *ctx, om_set *s) {
  int ok = 1;
  for (int k = 0; k < OM_COUNT; k++) {
    int same = om_same(ctx, s->p[0][k], s->p[1][k]) && om_same(ctx, s->m[0][k], s->m[1][k]) &&
               om_same(ctx, s->v[0][k], s->v[1][k]) && om_same(ctx, s->w[0][k], s->w[1][k]);
    if (!same) fprintf(stderr, "entry %d differs\n", k);
    ok = ok && same;
  }
  return ok;
}

/* g * scale in the state's precision, as a new tensor of that dtype: the
 * gradient the multi-tensor op reads when grad_scale is given. */
static moe_tensor *om_prescale(moe_ctx *ctx, moe_tensor *g, moe_dtype pdt, float scale,
                               moe_device d) {
  int64_t n = moe_tensor_numel(g);
  double *x = malloc(sizeof(double) * (size_t)(n + 1));
  EXPECT_OK(moe_tensor_to_f64(ctx, g, x));
  for (int64_t i = 0; i < n; i++) {
    if (pdt == MOE_F64) x[i] = x[i] * (double)scale;
    else x[i] = (double)((float)x[i] * scale);
  }
  moe_tensor *c = NULL, *t = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, x, 1, &n, om_sdt(pdt), MOE_CPU, &c));
  EXPECT_OK(moe_to(ctx, c, om_sdt(pdt), d, &t));
  moe_tensor_release(c);
  free(x);
  return t;
}

static moe_tensor *om_scalar(moe_ctx *ctx, double v, moe_device d) {
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_full(ctx, 0, NULL, v, MOE_F32, d, &t));
  return t;
}

/* 10 steps: the multi-tensor op against one moe_adamw_step per entry, with
 * the gradient scale on the odd steps and skipped steps (skip 1, NaN). */
static void om_case_adamw(moe_ctx *ctx, moe_device d) {
  om_set s;
  om_set_init(ctx, &s, d);
  moe_adamw_entry e[OM_COUNT];
  moe_tensor *one = om_scalar(ctx, 1, d), *nan = om_scalar(ctx, NAN, d), *zero = om_scalar(ctx, 0, d);
  for (int step = 1; step <= 10; step++) {
    moe_tensor *g[OM_COUNT];
    for (int k = 0; k < OM_COUNT; k++) {
      om_spec sp = om_specs(k);
      g[k] = om_make(ctx, sp.n, sp.gdt, d, 100 * step + k, 0.1 * step);
    }
    bool scaled = step % 2 == 1;
    float sc = 0.375f + 0.01f * (float)step;
    moe_tensor *gs = scaled ? om_scalar(ctx, sc, d) : NULL;
    moe_adamw_opts o = {1e-2, 0.9, 0.95, 1e-8, 0.0, step};
    for (int k = 0; k < OM_COUNT; k++) {
      om_spec sp = om_specs(k);
      o.weight_decay = sp.wd;
      moe_tensor *gk = scaled ? om_prescale(ctx, g[k], sp.pdt, sc, d) : g[k];
      EXPECT_OK(moe_adamw_step(ctx, s.p[0][k], gk, s.m[0][k], s.v[0][k], s.w[0][k], &o));
      if (scaled) moe_tensor_release(gk);
    }
    om_entries(&s, 1, g, e);
    o.weight_decay = 123; /* ignored by the multi-tensor op */
    EXPECT_OK(moe_adamw_step_multi(ctx, e, OM_COUNT, &o, gs, step == 4 ? zero : NULL));
    /* skipped: nothing changes */
    EXPECT_OK(moe_adamw_step_multi(ctx, e, OM_COUNT, &o, gs, one));
    EXPECT_OK(moe_adamw_step_multi(ctx, e, OM_COUNT, &o, NULL, nan));
    moe_tensor_release(gs);
    for (int k = 0; k < OM_COUNT; k++) moe_tensor_release(g[k]);
  }
  EXPECT(om_set_same(ctx, &s));
  /* and the parameters moved */
  moe_tensor *init0 = om_make(ctx, 37, MOE_F32, d, 0, 1.0); /* entry 0 before the steps */
  double a0[37], b0[37];
  EXPECT_OK(moe_tensor_to_f64(ctx, init0, a0));
  EXPECT_OK(moe_tensor_to_f64(ctx, s.p[1][0], b0));
  EXPECT(fabs(a0[5] - b0[5]) > 1e-3);
  moe_tensor_release(init0);
  moe_tensor_release(one);
  moe_tensor_release(nan);
  moe_tensor_release(zero);
  om_set_free(&s);
}

/* The norm against a double reference; same bits on a second call; coef and
 * found_inf; an empty list. */
static void om_case_norm(moe_ctx *ctx, moe_device d) {
  moe_tensor *g[OM_COUNT];
  double ref = 0;
  for (int k = 0; k < OM_COUNT; k++) {
    om_spec sp = om_specs(k);
    g[k] = om_make(ctx, sp.n, sp.gdt, d, k, 0.5);
    double *x = malloc(sizeof(double) * (size_t)(sp.n + 1));
    EXPECT_OK(moe_tensor_to_f64(ctx, g[k], x));
    for (int64_t i = 0; i < sp.n; i++) ref += (double)(float)x[i] * (double)(float)x[i];
    free(x);
  }
  ref = sqrt(ref);
  moe_tensor *norm = om_scalar(ctx, 0, d), *coef = om_scalar(ctx, 0, d), *fi = om_scalar(ctx, 7, d);
  moe_tensor *norm2 = om_scalar(ctx, 0, d);
  EXPECT_OK(moe_grad_norm_multi(ctx, (const moe_tensor *const *)g, OM_COUNT, 1.0, norm, coef, fi));
  EXPECT_OK(moe_grad_norm_multi(ctx, (const moe_tensor *const *)g, OM_COUNT, 1.0, norm2, NULL, NULL));
  double got = 0, c = 0, f = 0;
  EXPECT_OK(moe_tensor_to_f64(ctx, norm, &got));
  EXPECT_OK(moe_tensor_to_f64(ctx, coef, &c));
  EXPECT_OK(moe_tensor_to_f64(ctx, fi, &f));
  EXPECT(fabs(got - ref) <= 1e-5 * ref);
  EXPECT(om_same(ctx, norm, norm2));
  float want_c = 1.0f / ((float)got + 1e-6f);
  EXPECT(c == (double)want_c);
  EXPECT(f == 0);
  /* max_norm above the norm (or inf): coef 1 */
  EXPECT_OK(moe_grad_norm_multi(ctx, (const moe_tensor *const *)g, OM_COUNT, 1e9, norm, coef, fi));
  EXPECT_VALUES(coef, 0, 1);
  EXPECT_OK(moe_grad_norm_multi(ctx, (const moe_tensor *const *)g, OM_COUNT, INFINITY, norm, coef, fi));
  EXPECT_VALUES(coef, 0, 1);
  /* a non-finite gradient: found_inf 1 */
  moe_tensor *bad = om_make(ctx, 5, MOE_F32, d, 1, 1.0), *list[2] = {g[0], bad};
  moe_tensor *binf = NULL;
  int64_t one = 1;
  EXPECT_OK(moe_tensor_full(ctx, 1, &one, INFINITY, MOE_F32, d, &binf));
  list[1] = binf;
  EXPECT_OK(moe_grad_norm_multi(ctx, (const moe_tensor *const *)list, 2, 1.0, norm, coef, fi));
  EXPECT_VALUES(fi, 0, 1);
  EXPECT_VALUES(norm, 0, INFINITY);
  /* empty list: norm 0, coef 1, found_inf 0 */
  EXPECT_OK(moe_grad_norm_multi(ctx, NULL, 0, 1.0, norm, coef, fi));
  EXPECT_VALUES(norm, 0, 0);
  EXPECT_VALUES(coef, 0, 1);
  EXPECT_VALUES(fi, 0, 0);
  moe_tensor_release(bad);
  moe_tensor_release(binf);
  moe_tensor_release(norm);
  moe_tensor_release(norm2);
  moe_tensor_release(coef);
  moe_tensor_release(fi);
  for (int k = 0; k < OM_COUNT; k++) moe_tensor_release(g[k]);
}

/* moe_scale_multi against the product in f32 (f64), rounded to the dtype. */
static void om_case_scale(moe_ctx *ctx, moe_device d) {
  moe_tensor *t[OM_COUNT], *want[OM_COUNT];
  float sc = 0.3f;
  moe_tensor *s = om_scalar(ctx, sc, d);
  for (int k = 0; k < OM_COUNT; k++) {
    om_spec sp = om_specs(k);
    t[k] = om_make(ctx, sp.n, sp.pdt, d, k, 2.0);
    moe_tensor *w = om_prescale(ctx, t[k], sp.pdt, sc, d);
    EXPECT_OK(moe_to(ctx, w, sp.pdt, d, &want[k]));
    moe_tensor_release(w);
  }
  EXPECT_OK(moe_scale_multi(ctx, t, OM_COUNT, s));
  for (int k = 0; k < OM_COUNT; k++) {
    EXPECT(om_same(ctx, t[k], want[k]));
    moe_tensor_release(t[k]);
    moe_tensor_release(want[k]);
  }
  moe_tensor_release(s);
}

#endif /* OPTIM_MULTI_CASES_H */
