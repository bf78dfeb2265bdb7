/*
 * test_format.c - exact text of moe_tensor_format for small tensors of each
 * kind (floats fixed and scientific, integers, bools, NaN/inf, scalars,
 * empty, strided views), the summarised form, row and suffix wrapping and
 * the print options.
 */
#include "harness.h"

#define SHAPE(...) (sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (int64_t[]){__VA_ARGS__}

static moe_tensor *vals(moe_ctx *ctx, moe_dtype dt, int ndim, const int64_t *shape,
                        const double *v) {
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, v, ndim, shape, dt, MOE_CPU, &t));
  return t;
}

static moe_tensor *iota(moe_ctx *ctx, moe_dtype dt, int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int d = 0; d < ndim; d++) n *= shape[d];
  moe_tensor *r = NULL, *t = NULL;
  EXPECT_OK(moe_arange(ctx, 0, (double)n, 1, dt, MOE_CPU, &r));
  EXPECT_OK(moe_view(ctx, r, ndim, shape, &t));
  moe_tensor_release(r);
  return t;
}

/* Formats t (then releases it) and compares with want. */
#define EXPECT_FORMAT(t, opt, want)                             \
  do {                                                          \
    char *str_ = NULL;                                          \
    moe_tensor *t_ = (t);                                       \
    EXPECT_OK(moe_tensor_format(harness_ctx, t_, (opt), &str_)); \
    EXPECT_STR(str_, want);                                     \
    free(str_);                                                 \
    moe_tensor_release(t_);                                     \
  } while (0)

static void test_small(moe_ctx *ctx) {
  EXPECT_FORMAT(vals(ctx, MOE_F32, SHAPE(2, 3), (double[]){0.1234, -1.5, 2, 3, 4, 5}), NULL,
                "tensor([[ 0.1234, -1.5000,  2.0000],\n"
                "        [ 3.0000,  4.0000,  5.0000]], shape=[2, 3], dtype=f32, device=cpu)");
  EXPECT_FORMAT(vals(ctx, MOE_F32, 0, NULL, (double[]){3.5}), NULL,
                "tensor(3.5000, shape=[], dtype=f32, device=cpu)");
  EXPECT_FORMAT(vals(ctx, MOE_I64, 0, NULL, (double[]){-42}), NULL,
                "tensor(-42, shape=[], dtype=i64, device=cpu)");
  moe_tensor *e = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, SHAPE(0, 3), MOE_F32, MOE_CPU, &e));
  EXPECT_FORMAT(e, NULL, "tensor([], shape=[0, 3], dtype=f32, device=cpu)");
  EXPECT_FORMAT(vals(ctx, MOE_BOOL, SHAPE(3), (double[]){1, 0, 1}), NULL,
                "tensor([ true, false,  true], shape=[3], dtype=bool, device=cpu)");
  EXPECT_FORMAT(vals(ctx, MOE_I8, SHAPE(3), (double[]){1, -20, 300}), NULL,
                "tensor([  1, -20, 127], shape=[3], dtype=i8, device=cpu)");
  EXPECT_FORMAT(vals(ctx, MOE_F16, SHAPE(4), (double[]){NAN, INFINITY, -INFINITY, 1.5}), NULL,
                "tensor([   nan,    inf,   -inf, 1.5000], shape=[4], dtype=f16, device=cpu)");
  EXPECT_FORMAT(vals(ctx, MOE_F64, SHAPE(3), (double[]){0, -0.0, 0}), NULL,
                "tensor([ 0.0000, -0.0000,  0.0000], shape=[3], dtype=f64, device=cpu)");
  EXPECT_FORMAT(vals(ctx, MOE_BF16, SHAPE(2), (double[]){NAN, NAN}), NULL,
                "tensor([nan, nan], shape=[2], dtype=bf16, device=cpu)");
  EXPECT_FORMAT(iota(ctx, MOE_I32, SHAPE(2, 3, 4)), NULL,
                "tensor([[[ 0,  1,  2,  3],\n"
                "         [ 4,  5,  6,  7],\n"
                "         [ 8,  9, 10, 11]],\n"
                "\n"
                "        [[12, 13, 14, 15],\n"
                "         [16, 17, 18, 19],\n"
                "         [20, 21, 22, 23]]], shape=[2, 3, 4], dtype=i32, device=cpu)");
  EXPECT_FORMAT(iota(ctx, MOE_U8, SHAPE(1, 1, 1)), NULL,
                "tensor([[[0]]], shape=[1, 1, 1], dtype=u8, device=cpu)");
}

static void test_scientific(moe_ctx *ctx) {
  /* a ratio over 1000, a tiny value, a huge value: scientific */
  EXPECT_FORMAT(vals(ctx, MOE_F32, SHAPE(4), (double[]){1e-5, 1, 1e3, -2}), NULL,
                "tensor([ 1.0000e-05,  1.0000e+00,  1.0000e+03, -2.0000e+00], shape=[4],\n"
                "       dtype=f32, device=cpu)");
  EXPECT_FORMAT(vals(ctx, MOE_F64, SHAPE(2), (double[]){2e8, 3e8}), NULL,
                "tensor([2.0000e+08, 3.0000e+08], shape=[2], dtype=f64, device=cpu)");
  EXPECT_FORMAT(vals(ctx, MOE_F64, SHAPE(2), (double[]){5e-5, 0}), NULL,
                "tensor([5.0000e-05, 0.0000e+00], shape=[2], dtype=f64, device=cpu)");
  /* ratio exactly 1000 stays fixed; inf and nan do not count */
  EXPECT_FORMAT(vals(ctx, MOE_F64, SHAPE(3), (double[]){1, 1000, INFINITY}), NULL,
                "tensor([   1.0000, 1000.0000,       inf], shape=[3], dtype=f64, device=cpu)");
}

static void test_options(moe_ctx *ctx) {
  moe_print_options o = moe_print_options_default();
  EXPECT(o.precision == 4 && o.threshold == 1000 && o.edgeitems == 3 && o.linewidth == 80);
  o.precision = 2;
  EXPECT_FORMAT(vals(ctx, MOE_F32, SHAPE(2), (double[]){3.14159, -2.71828}), &o,
                "tensor([ 3.14, -2.72], shape=[2], dtype=f32, device=cpu)");
  o.precision = 0;
  EXPECT_FORMAT(vals(ctx, MOE_F32, SHAPE(2), (double[]){3.7, -2.2}), &o,
                "tensor([ 4, -2], shape=[2], dtype=f32, device=cpu)");
  o = moe_print_options_default();
  o.linewidth = 30; /* rows wrap, and so do the suffixes */
  EXPECT_FORMAT(iota(ctx, MOE_I64, SHAPE(12)), &o,
                "tensor([ 0,  1,  2,  3,  4,\n"
                "         5,  6,  7,  8,  9,\n"
                "        10, 11], shape=[12],\n"
                "       dtype=i64, device=cpu)");
  o.linewidth = 1; /* one element per line at least */
  EXPECT_FORMAT(iota(ctx, MOE_I64, SHAPE(2)), &o,
                "tensor([0,\n"
                "        1],\n"
                "       shape=[2],\n"
                "       dtype=i64,\n"
                "       device=cpu)");
  o = moe_print_options_default();
  o.precision = -1;
  moe_tensor *t = iota(ctx, MOE_F32, SHAPE(2));
  char *s = NULL;
  EXPECT_ERR_MSG(moe_tensor_format(ctx, t, &o, &s), MOE_ERR_INVALID_ARG, "format: bad print options");
  EXPECT(s == NULL);
  o = moe_print_options_default();
  o.linewidth = 0;
  EXPECT_ERR(moe_tensor_format(ctx, t, &o, &s), MOE_ERR_INVALID_ARG);
  EXPECT_ERR(moe_tensor_format(ctx, NULL, NULL, &s), MOE_ERR_INVALID_ARG);
  EXPECT_ERR(moe_tensor_format(ctx, t, NULL, NULL), MOE_ERR_INVALID_ARG);
  moe_tensor_release(t);
}

static void test_summarised(moe_ctx *ctx) {
  EXPECT_FORMAT(iota(ctx, MOE_I64, SHAPE(10000)), NULL,
                "tensor([   0,    1,    2,  ..., 9997, 9998, 9999], shape=[10000], dtype=i64,\n"
                "       device=cpu)");
  moe_print_options o = moe_print_options_default();
  o.threshold = 5;
  o.edgeitems = 1;
  EXPECT_FORMAT(iota(ctx, MOE_I32, SHAPE(3, 3, 4)), &o,
                "tensor([[[ 0,  ...,  3],\n"
                "         ...,\n"
                "         [ 8,  ..., 11]],\n"
                "\n"
                "        ...,\n"
                "\n"
                "        [[24,  ..., 27],\n"
                "         ...,\n"
                "         [32,  ..., 35]]], shape=[3, 3, 4], dtype=i32, device=cpu)");
  /* the width comes from the printed elements only: 1000 and more are cut */
  o = moe_print_options_default();
  o.threshold = 4;
  o.edgeitems = 2;
  EXPECT_FORMAT(iota(ctx, MOE_F32, SHAPE(2000)), &o,
                "tensor([0.0000e+00, 1.0000e+00,  ..., 1.9980e+03, 1.9990e+03], shape=[2000],\n"
                "       dtype=f32, device=cpu)");
  moe_tensor *r = NULL, *sl = NULL;
  EXPECT_OK(moe_arange(ctx, 0, 1000, 1, MOE_F32, MOE_CPU, &r));
  EXPECT_OK(moe_narrow(ctx, r, 0, 10, 990, &sl));
  EXPECT_FORMAT(sl, &o,
                "tensor([ 10.0000,  11.0000,  ..., 998.0000, 999.0000], shape=[990], dtype=f32,\n"
                "       device=cpu)");
  moe_tensor_release(r);
  o.edgeitems = 0;
  EXPECT_FORMAT(iota(ctx, MOE_I64, SHAPE(3, 5)), &o,
                "tensor([...], shape=[3, 5], dtype=i64, device=cpu)");
  /* exactly at the threshold: everything prints */
  o = moe_print_options_default();
  o.threshold = 6;
  EXPECT_FORMAT(iota(ctx, MOE_I64, SHAPE(6)), &o,
                "tensor([0, 1, 2, 3, 4, 5], shape=[6], dtype=i64, device=cpu)");
}

static void test_strided(moe_ctx *ctx) {
  moe_tensor *a = iota(ctx, MOE_F32, SHAPE(2, 3)), *t = NULL, *e = NULL, *one = NULL;
  EXPECT_OK(moe_transpose(ctx, a, 0, 1, &t));
  EXPECT_FORMAT(t, NULL,
                "tensor([[0.0000, 3.0000],\n"
                "        [1.0000, 4.0000],\n"
                "        [2.0000, 5.0000]], shape=[3, 2], dtype=f32, device=cpu)");
  EXPECT_OK(moe_select(ctx, a, 1, 2, &t));
  EXPECT_FORMAT(t, NULL, "tensor([2.0000, 5.0000], shape=[2], dtype=f32, device=cpu)");
  one = vals(ctx, MOE_BOOL, SHAPE(1), (double[]){1});
  EXPECT_OK(moe_expand(ctx, one, SHAPE(2, 2), &e));
  EXPECT_FORMAT(e, NULL,
                "tensor([[true, true],\n"
                "        [true, true]], shape=[2, 2], dtype=bool, device=cpu)");
  moe_tensor_release(one);
  moe_tensor_release(a);
}

int main(void) {
  RUN(test_small);
  RUN(test_scientific);
  RUN(test_options);
  RUN(test_summarised);
  RUN(test_strided);
  return harness_end();
}
