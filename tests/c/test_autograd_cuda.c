/*
 * test_autograd_cuda.c - autograd on CUDA tensors against the same graph on
 * the CPU: arithmetic with broadcasting, chains of views and copies across
 * devices, forward values and every leaf's gradient, at awkward sizes (1,
 * odd, large, non-contiguous) in f32 and bf16; and the device memory of a
 * graph returning to the caching allocator when backward ends. Exits 77
 * without a GPU.
 */
#include "harness.h"

#define SHAPE(...) (int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (int64_t[]){__VA_ARGS__}

static const moe_device CUDA0 = {MOE_DEVICE_CUDA, 0};

/* Largest |a - b| / (atol + rtol |b|) over the elements; > 1 fails. */
static double excess(moe_ctx *ctx, const moe_tensor *a, const moe_tensor *b, double atol,
                     double rtol) {
  int64_t n = moe_tensor_numel(b);
  if (moe_tensor_numel(a) != n) return INFINITY;
  double *va = malloc(sizeof(double) * (size_t)(n ? n : 1)),
         *vb = malloc(sizeof(double) * (size_t)(n ? n : 1)), worst = 0;
  if (moe_tensor_to_f64(ctx, a, va) != MOE_OK || moe_tensor_to_f64(ctx, b, vb) != MOE_OK)
    worst = INFINITY;
  for (int64_t i = 0; i < n && isfinite(worst); i++) {
    double e = fabs(va[i] - vb[i]) / (atol + rtol * fabs(vb[i]));
    if (!(e <= worst)) worst = e; /* NaN counts as a failure */
  }
  free(va);
  free(vb);
  return worst;
}

#define EXPECT_CLOSE(a, b, atol, rtol)                                                   \
  do {                                                                                   \
    double x_ = excess(ctx, (a), (b), (atol), (rtol));                                   \
    harness_checks++;                                                                    \
    if (!(x_ <= 1)) {                                                                    \
      harness_failures++;                                                                \
      fprintf(stderr, "%s:%d: FAILED: %s vs %s: error %.3g x the tolerance\n", __FILE__, \
              __LINE__, #a, #b, x_);                                                     \
    }                                                                                    \
  } while (0)

/* A CPU leaf of dt with values uniform in [lo, hi), and its copy on cuda
 * (a separate leaf with the same values). */
static void leaf_pair(moe_ctx *ctx, int ndim, const int64_t *shape, moe_dtype dt, double lo,
                      double hi, moe_tensor **cpu, moe_tensor **gpu) {
  EXPECT_OK(moe_tensor_empty(ctx, ndim, shape, dt, MOE_CPU, cpu));
  EXPECT_OK(moe_uniform_(ctx, *cpu, lo, hi));
  EXPECT_OK(moe_to(ctx, *cpu, dt, CUDA0, gpu));
  EXPECT_OK(moe_set_requires_grad(ctx, *cpu, true));
  EXPECT_OK(moe_set_requires_grad(ctx, *gpu, true));
}

/* y = (a * b - a / b + b) * 0.5 - (-a) + 2 / b, b broadcast over a's rows. */
static moe_status arith(moe_ctx *ctx, moe_tensor *a, moe_tensor *b, moe_tensor **out) {
  moe_tensor *t[8] = {NULL};
  moe_status st = moe_binary(ctx, MOE_OP_MUL, a, b, &t[0]);
  if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_DIV, a, b, &t[1]);
  if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_SUB, t[0], t[1], &t[2]);
  if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_ADD, t[2], b, &t[3]);
  if (st == MOE_OK) st = moe_binary_scalar(ctx, MOE_OP_MUL, t[3], 0.5, false, &t[4]);
  if (st == MOE_OK) st = moe_unary(ctx, MOE_OP_NEG, a, &t[5]);
  if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_SUB, t[4], t[5], &t[6]);
  if (st == MOE_OK) st = moe_binary_scalar(ctx, MOE_OP_DIV, b, 2.0, true, &t[7]);
  if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_ADD, t[6], t[7], out);
  for (int k = 0; k < 8; k++) moe_tensor_release(t[k]);
  return st;
}

/* The same arithmetic on both devices, a (rows, cols) possibly transposed,
 * b (cols) in [0.5, 1.5) so division is tame. */
static void check_arith(moe_ctx *ctx, moe_dtype dt, int64_t rows, int64_t cols, bool transposed) {
  moe_tensor *ac, *ag, *bc, *bg, *a1c = NULL, *a1g = NULL;
  if (transposed) {
    leaf_pair(ctx, SHAPE(cols, rows), dt, -1, 1, &ac, &ag);
    EXPECT_OK(moe_transpose(ctx, ac, 0, 1, &a1c)); /* non-contiguous, through a view node */
    EXPECT_OK(moe_transpose(ctx, ag, 0, 1, &a1g));
  } else {
    leaf_pair(ctx, SHAPE(rows, cols), dt, -1, 1, &ac, &ag);
    moe_tensor_retain(ac);
    moe_tensor_retain(ag);
    a1c = ac;
    a1g = ag;
  }
  leaf_pair(ctx, SHAPE(cols), dt, 0.5, 1.5, &bc, &bg);
  moe_tensor *yc = NULL, *yg = NULL, *gc = NULL, *gg = NULL;
  EXPECT_OK(arith(ctx, a1c, bc, &yc));
  EXPECT_OK(arith(ctx, a1g, bg, &yg));
  EXPECT_OK(moe_tensor_empty(ctx, SHAPE(rows, cols), dt, MOE_CPU, &gc));
  EXPECT_OK(moe_uniform_(ctx, gc, -1, 1));
  EXPECT_OK(moe_to(ctx, gc, dt, CUDA0, &gg));
  EXPECT_OK(moe_backward(ctx, yc, gc, false));
  EXPECT_OK(moe_backward(ctx, yg, gg, false));
  /* f32: the same IEEE operations on both devices (CUDA division is
   * correctly rounded by default), except the order of the sums that reduce
   * b's gradient over `rows` terms of size <= ~6: rows * 2^-24 * 6 absolute.
   * bf16: every intermediate is rounded to 8 bits on both devices the same
   * way; the sums accumulate in f32 in a different order, which can flip a
   * final rounding: one bf16 ulp (2^-8 relative) plus the f32 term. */
  double rtol = dt == MOE_BF16 ? 1.0 / 128 : 1e-6;
  double atol_a = dt == MOE_BF16 ? 1.0 / 64 : 1e-6;
  double atol_b = atol_a + (double)rows * 6.0 * 0x1p-24 * (dt == MOE_BF16 ? 256 : 1);
  EXPECT_CLOSE(yg, yc, atol_a, rtol);
  EXPECT(moe_tensor_grad(ag) && moe_tensor_device(moe_tensor_grad(ag)).type == MOE_DEVICE_CUDA);
  EXPECT(moe_tensor_grad(ag)->dtype == dt && moe_tensor_grad(bg)->dtype == dt);
  EXPECT_CLOSE(moe_tensor_grad(ag), moe_tensor_grad(ac), atol_a, rtol);
  EXPECT_CLOSE(moe_tensor_grad(bg), moe_tensor_grad(bc), atol_b, rtol);
  moe_tensor *all[] = {ac, ag, bc, bg, a1c, a1g, yc, yg, gc, gg};
  for (int k = 0; k < 10; k++) moe_tensor_release(all[k]);
}

static void test_arith(moe_ctx *ctx) {
  const moe_dtype dts[] = {MOE_F32, MOE_BF16};
  for (int d = 0; d < 2; d++) {
    check_arith(ctx, dts[d], 1, 1, false);
    check_arith(ctx, dts[d], 7, 13, false);
    check_arith(ctx, dts[d], 7, 13, true);
    check_arith(ctx, dts[d], 513, 1031, false);
    check_arith(ctx, dts[d], 1031, 257, true);
  }
}

/* transpose, narrow, slice, expand, select, reshape (copy), to(f32) */
static moe_status views(moe_ctx *ctx, moe_tensor *x, moe_tensor *v, moe_tensor **out) {
  moe_tensor *t[10] = {NULL};
  moe_status st = moe_transpose(ctx, x, 0, 1, &t[0]);                     /* (c, r) */
  if (st == MOE_OK) st = moe_narrow(ctx, t[0], 0, 1, t[0]->shape[0] - 1, &t[1]);
  if (st == MOE_OK) st = moe_slice(ctx, t[1], 1, 0, t[1]->shape[1], 2, &t[2]);
  if (st == MOE_OK) st = moe_reshape(ctx, t[2], 1, (int64_t[]){-1}, &t[3]); /* copy */
  if (st == MOE_OK)
    st = moe_expand(ctx, v, 2, (int64_t[]){t[2]->shape[0], t[2]->shape[1]}, &t[4]);
  if (st == MOE_OK) st = moe_reshape(ctx, t[4], 1, (int64_t[]){-1}, &t[5]);
  if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_MUL, t[3], t[5], &t[6]);
  if (st == MOE_OK) st = moe_select(ctx, t[2], 1, 0, &t[7]);
  if (st == MOE_OK) st = moe_to(ctx, t[6], MOE_F32, moe_tensor_device(t[6]), &t[8]);
  if (st == MOE_OK) st = moe_narrow(ctx, t[8], 0, 0, t[7]->shape[0], &t[9]);
  if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_ADD, t[9], t[7], out);
  for (int k = 0; k < 10; k++) moe_tensor_release(t[k]);
  return st;
}

static void check_views(moe_ctx *ctx, moe_dtype dt, int64_t r, int64_t c) {
  moe_tensor *xc, *xg, *vc, *vg, *yc = NULL, *yg = NULL, *gc = NULL, *gg = NULL;
  leaf_pair(ctx, SHAPE(r, c), dt, -1, 1, &xc, &xg);
  int64_t cols = (r + 1) / 2;
  leaf_pair(ctx, SHAPE(1, cols), dt, -1, 1, &vc, &vg);
  EXPECT_OK(views(ctx, xc, vc, &yc));
  EXPECT_OK(views(ctx, xg, vg, &yg));
  EXPECT_OK(moe_tensor_full(ctx, yc->ndim, yc->shape, 1.0, yc->dtype, MOE_CPU, &gc));
  EXPECT_OK(moe_uniform_(ctx, gc, -1, 1));
  EXPECT_OK(moe_to(ctx, gc, gc->dtype, CUDA0, &gg));
  EXPECT_OK(moe_backward(ctx, yc, gc, false));
  EXPECT_OK(moe_backward(ctx, yg, gg, false));
  /* products of two values and sums over the expanded rows (c - 1 terms):
   * f32 exact but for the sum order; bf16 one ulp of 2^-8 */
  double rtol = dt == MOE_BF16 ? 1.0 / 128 : 1e-6;
  double atol = (dt == MOE_BF16 ? 1.0 / 64 : 1e-6) + (double)c * 0x1p-24 * (dt == MOE_BF16 ? 256 : 1);
  EXPECT_CLOSE(yg, yc, atol, rtol);
  EXPECT_CLOSE(moe_tensor_grad(xg), moe_tensor_grad(xc), atol, rtol);
  EXPECT_CLOSE(moe_tensor_grad(vg), moe_tensor_grad(vc), atol, rtol);
  moe_tensor *all[] = {xc, xg, vc, vg, yc, yg, gc, gg};
  for (int k = 0; k < 8; k++) moe_tensor_release(all[k]);
}

static void test_views(moe_ctx *ctx) {
  check_views(ctx, MOE_F32, 2, 2);
  check_views(ctx, MOE_F32, 9, 17);
  check_views(ctx, MOE_F32, 1001, 515);
  check_views(ctx, MOE_BF16, 9, 17);
  check_views(ctx, MOE_BF16, 1001, 515);
}

/* Gradients cross devices and dtypes back to their leaves. */
static void test_copy_across(moe_ctx *ctx) {
  moe_tensor *x = NULL, *xg = NULL, *y = NULL, *g = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, (double[]){1, -2, 3}, SHAPE(3), MOE_F32, MOE_CPU, &x));
  EXPECT_OK(moe_set_requires_grad(ctx, x, true));
  EXPECT_OK(moe_to(ctx, x, MOE_BF16, CUDA0, &xg));
  EXPECT_OK(moe_binary(ctx, MOE_OP_MUL, xg, xg, &y));
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(3), 1.0, MOE_BF16, CUDA0, &g));
  EXPECT_OK(moe_backward(ctx, y, g, false));
  EXPECT(moe_tensor_grad(x) && moe_tensor_grad(x)->dtype == MOE_F32 &&
         moe_tensor_device(moe_tensor_grad(x)).type == MOE_DEVICE_CPU);
  EXPECT_VALUES(moe_tensor_grad(x), 0, 2, -4, 6); /* exact in bf16 */
  moe_tensor_release(g);
  moe_tensor_release(y);
  moe_tensor_release(xg);
  /* and from cuda to the CPU */
  moe_tensor *w = NULL, *wc = NULL;
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(3), 2.0, MOE_BF16, CUDA0, &w));
  EXPECT_OK(moe_set_requires_grad(ctx, w, true));
  EXPECT_OK(moe_to(ctx, w, MOE_F32, MOE_CPU, &wc));
  EXPECT_OK(moe_binary(ctx, MOE_OP_MUL, wc, x, &y));
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(3), 1.0, MOE_F32, MOE_CPU, &g));
  EXPECT_OK(moe_backward(ctx, y, g, false));
  EXPECT(moe_tensor_grad(w) && moe_tensor_grad(w)->dtype == MOE_BF16 &&
         moe_tensor_device(moe_tensor_grad(w)).type == MOE_DEVICE_CUDA);
  EXPECT_VALUES(moe_tensor_grad(w), 0, 1, -2, 3);
  moe_tensor *all[] = {x, w, wc, y, g};
  for (int k = 0; k < 5; k++) moe_tensor_release(all[k]);
}

/* Device memory of the graph goes back when backward ends. */
static void test_device_memory(moe_ctx *ctx) {
  moe_memory_stats m0, m1;
  moe_tensor *x = NULL, *a = NULL, *b = NULL, *g = NULL;
  int64_t n = 1 << 20;
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(n), 0.5, MOE_F32, CUDA0, &x));
  EXPECT_OK(moe_set_requires_grad(ctx, x, true));
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(n), 1.0, MOE_F32, CUDA0, &g));
  EXPECT_OK(moe_memory_stats_get(ctx, CUDA0, &m0));
  EXPECT_OK(moe_binary(ctx, MOE_OP_MUL, x, x, &a));
  EXPECT_OK(moe_binary(ctx, MOE_OP_MUL, a, a, &b)); /* saves a */
  moe_tensor_release(a);
  EXPECT_OK(moe_backward(ctx, b, g, false));
  moe_tensor_release(b);
  EXPECT_OK(moe_memory_stats_get(ctx, CUDA0, &m1));
  /* left: x.grad only (a, b, intermediate gradients all returned) */
  EXPECT(m1.allocated - m0.allocated == n * 4);
  moe_tensor *e = NULL;
  EXPECT_OK(moe_narrow(ctx, moe_tensor_grad(x), 0, n - 1, 1, &e));
  EXPECT_VALUES(e, 0, 0.5); /* 4 x^3 at x = 0.5, exact */
  moe_tensor_release(e);
  moe_tensor_release(g);
  moe_tensor_release(x);
}

int main(void) {
  moe_ctx *ctx = harness_start();
  SKIP_IF_NO_GPU(ctx);
  RUN(test_arith);
  RUN(test_views);
  RUN(test_copy_across);
  RUN(test_device_memory);
  return harness_end();
}
