/*
 * test_optim_cuda.c - the CUDA AdamW and SGD kernels against the CPU loop
 * (core/optim.c) at awkward sizes, several steps each. Needs a GPU (exit 77
 * without). Tolerance 0 everywhere: both devices do the same IEEE
 * operations in the same order with no fused multiply-add, so parameters,
 * master copies and state must agree bit for bit.
 */
#include "harness.h"
#include "moe_optim.h"

static const moe_device GPU = {MOE_DEVICE_CUDA, 0};

static moe_tensor *rnd(moe_ctx *ctx, int64_t n, moe_dtype dt, moe_device d, double std) {
  moe_tensor *t = NULL, *g = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, 1, &n, MOE_F32, MOE_CPU, &t));
  EXPECT_OK(moe_normal_(ctx, t, 0.0, std));
  EXPECT_OK(moe_to(ctx, t, dt, d, &g));
  moe_tensor_release(t);
  return g;
}

static moe_tensor *to(moe_ctx *ctx, moe_tensor *t, moe_device d) {
  moe_tensor *o = NULL;
  EXPECT_OK(moe_to(ctx, t, t->dtype, d, &o));
  /* moe_to may return t itself: always work on a private copy */
  moe_tensor *c = NULL;
  EXPECT_OK(moe_clone(ctx, o, &c));
  moe_tensor_release(o);
  return c;
}

/* Element-wise identical (bits, through f64 which holds f32/bf16 exactly). */
static int same(moe_ctx *ctx, moe_tensor *a, moe_tensor *b) {
  int64_t n = moe_tensor_numel(a);
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

/* Runs `steps` AdamW (sgd = false) or SGD steps on both devices. */
static void check_case(moe_ctx *ctx, int64_t n, moe_dtype pdt, moe_dtype gdt, bool sgd) {
  moe_dtype sdt = pdt == MOE_F64 ? MOE_F64 : MOE_F32;
  bool need_master = pdt == MOE_BF16 || pdt == MOE_F16;
  moe_tensor *p = rnd(ctx, n, pdt, MOE_CPU, 1.0), *m = NULL, *v = NULL, *w = NULL;
  EXPECT_OK(moe_tensor_full(ctx, 1, &n, 0.0, sdt, MOE_CPU, &m));
  EXPECT_OK(moe_tensor_full(ctx, 1, &n, 0.0, sdt, MOE_CPU, &v));
  if (need_master) EXPECT_OK(moe_to(ctx, p, sdt, MOE_CPU, &w));
  moe_tensor *pg = to(ctx, p, GPU), *mg = to(ctx, m, GPU), *vg = to(ctx, v, GPU);
  moe_tensor *wg = w ? to(ctx, w, GPU) : NULL;
  for (int step = 1; step <= 3; step++) {
    moe_tensor *g = rnd(ctx, n, gdt, MOE_CPU, 0.1 * step), *gg = to(ctx, g, GPU);
    if (sgd) {
      moe_sgd_opts o = {0.05, 0.9, 0.01};
      EXPECT_OK(moe_sgd_step(ctx, p, g, m, w, &o));
      EXPECT_OK(moe_sgd_step(ctx, pg, gg, mg, wg, &o));
    } else {
      moe_adamw_opts o = {3e-3, 0.9, 0.95, 1e-8, 0.1, step};
      EXPECT_OK(moe_adamw_step(ctx, p, g, m, v, w, &o));
      EXPECT_OK(moe_adamw_step(ctx, pg, gg, mg, vg, wg, &o));
    }
    moe_tensor_release(g);
    moe_tensor_release(gg);
  }
  EXPECT_OK(moe_cuda_synchronize(ctx, GPU));
  EXPECT(same(ctx, p, pg));
  EXPECT(same(ctx, m, mg));
  if (!sgd) EXPECT(same(ctx, v, vg));
  if (w) EXPECT(same(ctx, w, wg));
  moe_tensor *list[] = {p, m, v, w, pg, mg, vg, wg};
  for (size_t i = 0; i < sizeof list / sizeof list[0]; i++) moe_tensor_release(list[i]);
}

static void test_adamw_cuda_matches_cpu(moe_ctx *ctx) {
  const int64_t sizes[] = {1, 255, 257, 1000003};
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    check_case(ctx, sizes[i], MOE_F32, MOE_F32, false);
    check_case(ctx, sizes[i], MOE_BF16, MOE_BF16, false);
    check_case(ctx, sizes[i], MOE_BF16, MOE_F32, false);
    check_case(ctx, sizes[i], MOE_F64, MOE_F64, false);
  }
  check_case(ctx, 0, MOE_F32, MOE_F32, false);
}

static void test_sgd_cuda_matches_cpu(moe_ctx *ctx) {
  const int64_t sizes[] = {1, 4097, 1000003};
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    check_case(ctx, sizes[i], MOE_F32, MOE_F32, true);
    check_case(ctx, sizes[i], MOE_BF16, MOE_BF16, true);
    check_case(ctx, sizes[i], MOE_F64, MOE_F64, true);
  }
}

static void test_cuda_errors(moe_ctx *ctx) {
  int64_t n = 8;
  moe_tensor *p = rnd(ctx, n, MOE_F32, GPU, 1.0), *g = rnd(ctx, n, MOE_F32, MOE_CPU, 1.0);
  moe_tensor *m = rnd(ctx, n, MOE_F32, GPU, 1.0), *v = rnd(ctx, n, MOE_F32, GPU, 1.0);
  moe_adamw_opts o = moe_adamw_opts_default();
  EXPECT_ERR_MSG(moe_adamw_step(ctx, p, g, m, v, NULL, &o), MOE_ERR_DEVICE, "grad is on cpu");
  moe_tensor *list[] = {p, g, m, v};
  for (size_t i = 0; i < 4; i++) moe_tensor_release(list[i]);
}

int main(void) {
  moe_ctx *ctx = harness_start();
  SKIP_IF_NO_GPU(ctx);
  moe_rng_seed(ctx, 7);
  RUN(test_adamw_cuda_matches_cpu);
  RUN(test_sgd_cuda_matches_cpu);
  RUN(test_cuda_errors);
  return harness_end();
}
