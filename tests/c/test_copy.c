/*
 * test_copy.c - copy_ (broadcasting, dtype conversion, non-contiguous and
 * overlapping views), to, clone, fill_, arange and linspace.
 */
#include "harness.h"

#define SHAPE(...) (sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (int64_t[]){__VA_ARGS__}

static moe_tensor *vals(moe_ctx *ctx, moe_dtype dt, int ndim, const int64_t *shape,
                        const double *v) {
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, v, ndim, shape, dt, MOE_CPU, &t));
  return t;
}

static moe_tensor *zeros(moe_ctx *ctx, moe_dtype dt, int ndim, const int64_t *shape) {
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_full(ctx, ndim, shape, 0, dt, MOE_CPU, &t));
  return t;
}

static void test_copy_broadcast(moe_ctx *ctx) {
  moe_tensor *dst = zeros(ctx, MOE_F32, SHAPE(2, 3));
  moe_tensor *row = vals(ctx, MOE_F64, SHAPE(3), (double[]){1.5, 2.5, 3.5});
  EXPECT_OK(moe_copy_(ctx, dst, row));
  EXPECT_VALUES(dst, 0, 1.5, 2.5, 3.5, 1.5, 2.5, 3.5);
  moe_tensor *col = vals(ctx, MOE_I32, SHAPE(2, 1), (double[]){7, -8});
  EXPECT_OK(moe_copy_(ctx, dst, col));
  EXPECT_VALUES(dst, 0, 7, 7, 7, -8, -8, -8);
  moe_tensor *one = vals(ctx, MOE_BOOL, 0, NULL, (double[]){1});
  EXPECT_OK(moe_copy_(ctx, dst, one));
  EXPECT_VALUES(dst, 0, 1, 1, 1, 1, 1, 1);
  EXPECT_ERR_MSG(moe_copy_(ctx, row, dst), MOE_ERR_SHAPE,
                 "copy_: source shape [2, 3] cannot be broadcast to destination shape [3]");
  moe_tensor *four = zeros(ctx, MOE_F32, SHAPE(4));
  EXPECT_ERR(moe_copy_(ctx, dst, four), MOE_ERR_SHAPE);
  moe_tensor_release(four);
  moe_tensor_release(one);
  moe_tensor_release(col);
  moe_tensor_release(row);
  moe_tensor_release(dst);
}

static void test_copy_into_views(moe_ctx *ctx) {
  /* write the transpose of a [3, 2] i64 source into columns 1..3 of a
   * [2, 5] bf16 destination: both non-contiguous, dtype converted */
  moe_tensor *dst = zeros(ctx, MOE_BF16, SHAPE(2, 5)), *win = NULL, *srct = NULL;
  moe_tensor *src = vals(ctx, MOE_I64, SHAPE(3, 2), (double[]){1, 2, 3, 4, 5, 6});
  EXPECT_OK(moe_narrow(ctx, dst, 1, 1, 3, &win));
  EXPECT_OK(moe_transpose(ctx, src, 0, 1, &srct));
  EXPECT_OK(moe_copy_(ctx, win, srct));
  EXPECT_VALUES(dst, 0, 0, 1, 3, 5, 0, 0, 2, 4, 6, 0);
  moe_tensor_release(win);
  /* every other element of a strided slice, from a float that rounds */
  moe_tensor *sl = NULL, *v = vals(ctx, MOE_F64, SHAPE(1), (double[]){257.0});
  EXPECT_OK(moe_slice(ctx, dst, 1, 0, 5, 2, &sl)); /* cols 0, 2, 4 */
  EXPECT_OK(moe_copy_(ctx, sl, v));
  EXPECT_VALUES(dst, 0, 256, 1, 256, 5, 256, 256, 2, 256, 6, 256); /* bf16(257) = 256 */
  moe_tensor_release(v);
  moe_tensor_release(sl);
  moe_tensor_release(srct);
  moe_tensor_release(src);
  moe_tensor_release(dst);

  /* i64 -> i64 keeps big values; f32 -> i8 truncates and saturates */
  moe_tensor *a = NULL, *b = zeros(ctx, MOE_I64, SHAPE(2));
  EXPECT_OK(moe_tensor_empty(ctx, SHAPE(2), MOE_I64, MOE_CPU, &a));
  ((int64_t *)moe_tensor_data(a))[0] = INT64_MAX - 1;
  ((int64_t *)moe_tensor_data(a))[1] = -5;
  EXPECT_OK(moe_copy_(ctx, b, a));
  int64_t got[2];
  EXPECT_OK(moe_tensor_to_i64(ctx, b, got));
  EXPECT(got[0] == INT64_MAX - 1 && got[1] == -5);
  moe_tensor *f = vals(ctx, MOE_F32, SHAPE(4), (double[]){-1.7, 1.7, 1000, -1000});
  moe_tensor *i8 = zeros(ctx, MOE_I8, SHAPE(4));
  EXPECT_OK(moe_copy_(ctx, i8, f));
  EXPECT_VALUES(i8, 0, -1, 1, 127, -128);
  moe_tensor_release(i8);
  moe_tensor_release(f);
  moe_tensor_release(a);
  moe_tensor_release(b);
}

static void test_copy_overlap(moe_ctx *ctx) {
  /* copying a tensor onto its own transpose must read before writing */
  moe_tensor *m = vals(ctx, MOE_F32, SHAPE(2, 2), (double[]){1, 2, 3, 4}), *mt = NULL;
  EXPECT_OK(moe_transpose(ctx, m, 0, 1, &mt));
  EXPECT_OK(moe_copy_(ctx, m, mt));
  EXPECT_VALUES(m, 0, 1, 3, 2, 4);
  moe_tensor_release(mt);
  moe_tensor_release(m);
  /* shifting by one within one buffer */
  moe_tensor *r = vals(ctx, MOE_I32, SHAPE(5), (double[]){1, 2, 3, 4, 5}), *lo = NULL, *hi = NULL;
  EXPECT_OK(moe_narrow(ctx, r, 0, 0, 4, &lo));
  EXPECT_OK(moe_narrow(ctx, r, 0, 1, 4, &hi));
  EXPECT_OK(moe_copy_(ctx, hi, lo));
  EXPECT_VALUES(r, 0, 1, 1, 2, 3, 4);
  moe_tensor_release(lo);
  moe_tensor_release(hi);
  /* an expanded destination overlaps itself: refused, nothing written */
  moe_tensor *one = vals(ctx, MOE_I32, SHAPE(1), (double[]){9}), *ex = NULL;
  EXPECT_OK(moe_expand(ctx, one, SHAPE(5), &ex));
  EXPECT_ERR_MSG(moe_copy_(ctx, ex, r), MOE_ERR_INVALID_ARG,
                 "copy_: cannot write into a tensor whose elements overlap (dim 0 has size 5 and "
                 "stride 0");
  EXPECT_ERR_MSG(moe_fill_(ctx, ex, 1), MOE_ERR_INVALID_ARG, "fill_: cannot write");
  EXPECT_VALUES(one, 0, 9);
  moe_tensor_release(ex);
  moe_tensor_release(one);
  moe_tensor_release(r);
}

static void test_to_clone(moe_ctx *ctx) {
  moe_tensor *a = vals(ctx, MOE_F32, SHAPE(2, 2), (double[]){1.25, -2.75, 3.5, 1e9}), *b = NULL,
             *c = NULL, *t = NULL;
  EXPECT_OK(moe_to(ctx, a, MOE_F32, MOE_CPU, &b));
  EXPECT(b == a && a->refcount == 2);
  moe_tensor_release(b);
  EXPECT_OK(moe_to(ctx, a, MOE_I32, MOE_CPU, &b));
  EXPECT(b != a && b->dtype == MOE_I32);
  EXPECT_VALUES(b, 0, 1, -2, 3, 1000000000);
  moe_tensor_release(b);
  EXPECT_OK(moe_to(ctx, a, MOE_F16, MOE_CPU, &b));
  EXPECT_VALUES(b, 0, 1.25, -2.75, 3.5, INFINITY);
  moe_tensor_release(b);
  EXPECT_OK(moe_transpose(ctx, a, 0, 1, &t));
  EXPECT_OK(moe_clone(ctx, t, &c));
  EXPECT(c->storage != a->storage && moe_tensor_is_contiguous(c) && c->dtype == MOE_F32);
  EXPECT_VALUES(c, 0, 1.25, 3.5, -2.75, 1e9);
  moe_tensor_release(c);
  moe_tensor_release(t);
  if (moe_cuda_device_count(ctx) == 0)
    EXPECT_ERR(moe_to(ctx, a, MOE_F32, ((moe_device){MOE_DEVICE_CUDA, 0}), &b),
               moe_cuda_built() ? MOE_ERR_DEVICE : MOE_ERR_NOT_SUPPORTED);
  EXPECT_ERR_MSG(moe_to(ctx, a, (moe_dtype)99, MOE_CPU, &b), MOE_ERR_DTYPE, "unknown dtype 99");
  moe_tensor_release(a);
}

static void test_fill(moe_ctx *ctx) {
  moe_tensor *t = zeros(ctx, MOE_F32, SHAPE(3, 4)), *col = NULL, *sl = NULL;
  EXPECT_OK(moe_select(ctx, t, 1, 2, &col));
  EXPECT_OK(moe_fill_(ctx, col, -1.5));
  EXPECT_OK(moe_slice(ctx, t, 0, 0, 3, 2, &sl));
  EXPECT_OK(moe_fill_(ctx, sl, 2));
  EXPECT_VALUES(t, 0, 2, 2, 2, 2, 0, 0, -1.5, 0, 2, 2, 2, 2);
  moe_tensor_release(sl);
  moe_tensor_release(col);
  moe_tensor_release(t);
  const moe_dtype dts[] = {MOE_F64, MOE_BF16, MOE_F16, MOE_I8, MOE_U8, MOE_I32, MOE_I64, MOE_BOOL};
  const double want[] = {3.7, 3.703125, 3.69921875, 3, 3, 3, 3, 1};
  for (int i = 0; i < 8; i++) {
    t = zeros(ctx, dts[i], SHAPE(2, 3));
    EXPECT_OK(moe_fill_(ctx, t, 3.7));
    EXPECT_VALUES(t, 0, want[i], want[i], want[i], want[i], want[i], want[i]);
    moe_tensor_release(t);
  }
  /* a big one (the parallel path) */
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(1000, 300), 0.5, MOE_F32, MOE_CPU, &t));
  float *p = moe_tensor_data(t);
  int bad = 0;
  for (int64_t i = 0; i < 300000; i++) bad += p[i] != 0.5f;
  EXPECT(bad == 0);
  moe_tensor_release(t);
  EXPECT_OK(moe_tensor_empty(ctx, SHAPE(0, 4), MOE_F32, MOE_CPU, &t));
  EXPECT_OK(moe_fill_(ctx, t, 1));
  moe_tensor_release(t);
}

static void test_arange(moe_ctx *ctx) {
  moe_tensor *t = NULL;
  EXPECT_OK(moe_arange(ctx, 0, 5, 1, MOE_I64, MOE_CPU, &t));
  EXPECT(t && t->ndim == 1 && t->shape[0] == 5);
  EXPECT_VALUES(t, 0, 0, 1, 2, 3, 4);
  moe_tensor_release(t);
  EXPECT_OK(moe_arange(ctx, 1, 2, 0.3, MOE_F64, MOE_CPU, &t)); /* ceil(1 / 0.3) = 4 */
  EXPECT_VALUES(t, 0, 1, 1.3, 1.6, 1.9);
  moe_tensor_release(t);
  EXPECT_OK(moe_arange(ctx, 5, 0, -2, MOE_F32, MOE_CPU, &t));
  EXPECT_VALUES(t, 0, 5, 3, 1);
  moe_tensor_release(t);
  EXPECT_OK(moe_arange(ctx, 3, 3, 1, MOE_F32, MOE_CPU, &t));
  EXPECT(t && t->shape[0] == 0);
  moe_tensor_release(t);
  EXPECT_OK(moe_arange(ctx, -1, 1, 0.5, MOE_I32, MOE_CPU, &t)); /* -1 -0.5 0 0.5 truncated */
  EXPECT_VALUES(t, 0, -1, 0, 0, 0);
  moe_tensor_release(t);
  EXPECT_ERR_MSG(moe_arange(ctx, 0, 1, 0, MOE_F32, MOE_CPU, &t), MOE_ERR_INVALID_ARG,
                 "step must be nonzero");
  EXPECT_ERR_MSG(moe_arange(ctx, 0, 10, -1, MOE_F32, MOE_CPU, &t), MOE_ERR_INVALID_ARG,
                 "goes away from end");
  EXPECT_ERR(moe_arange(ctx, 0, INFINITY, 1, MOE_F32, MOE_CPU, &t), MOE_ERR_INVALID_ARG);
  EXPECT_ERR(moe_arange(ctx, 0, 1e300, 1e-300, MOE_F32, MOE_CPU, &t), MOE_ERR_INVALID_ARG);
  EXPECT_ERR(moe_arange(ctx, 0, 3, 1, MOE_BOOL, MOE_CPU, &t), MOE_ERR_DTYPE);
}

static void test_linspace(moe_ctx *ctx) {
  moe_tensor *t = NULL;
  EXPECT_OK(moe_linspace(ctx, 0, 1, 5, MOE_F32, MOE_CPU, &t));
  EXPECT_VALUES(t, 0, 0, 0.25, 0.5, 0.75, 1);
  moe_tensor_release(t);
  EXPECT_OK(moe_linspace(ctx, 0.1, 0.3, 3, MOE_F64, MOE_CPU, &t));
  double v[3];
  EXPECT_OK(moe_tensor_to_f64(ctx, t, v));
  EXPECT(v[0] == 0.1 && v[2] == 0.3); /* the end is exact */
  EXPECT_NEAR(v[1], 0.2, 1e-15);
  moe_tensor_release(t);
  EXPECT_OK(moe_linspace(ctx, 2, 7, 1, MOE_F32, MOE_CPU, &t));
  EXPECT_VALUES(t, 0, 2);
  moe_tensor_release(t);
  EXPECT_OK(moe_linspace(ctx, 2, 7, 0, MOE_F32, MOE_CPU, &t));
  EXPECT(t && t->shape[0] == 0);
  moe_tensor_release(t);
  EXPECT_OK(moe_linspace(ctx, 10, 0, 4, MOE_I64, MOE_CPU, &t)); /* 10 6.67 3.33 0 */
  EXPECT_VALUES(t, 0, 10, 6, 3, 0);
  moe_tensor_release(t);
  EXPECT_ERR_MSG(moe_linspace(ctx, 0, 1, -1, MOE_F32, MOE_CPU, &t), MOE_ERR_INVALID_ARG,
                 "steps -1 is negative");
  EXPECT_ERR(moe_linspace(ctx, NAN, 1, 3, MOE_F32, MOE_CPU, &t), MOE_ERR_INVALID_ARG);
}

int main(void) {
  RUN(test_copy_broadcast);
  RUN(test_copy_into_views);
  RUN(test_copy_overlap);
  RUN(test_to_clone);
  RUN(test_fill);
  RUN(test_arange);
  RUN(test_linspace);
  return harness_end();
}
