/*
 * test_random.c - Philox known answers, pinned values of every fill for
 * seed 42 (any change to the stream fails here: the values come from an
 * independent Python transcription of philox.h), determinism, the call
 * counter, row-major order on strided views, and moments of 100k samples.
 */
#include "harness.h"
#include "philox.h"

#define SHAPE(...) (sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (int64_t[]){__VA_ARGS__}

static moe_tensor *empty(moe_ctx *ctx, moe_dtype dt, int ndim, const int64_t *shape) {
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, ndim, shape, dt, MOE_CPU, &t));
  return t;
}

static void test_philox_kat(moe_ctx *ctx) {
  /* Random123's known-answer vectors for Philox-4x32-10 */
  moe_philox4 r = moe_philox(0, 0, 0);
  EXPECT(r.v[0] == 0x6627e8d5u && r.v[1] == 0xe169c58du && r.v[2] == 0xbc57ac4cu &&
         r.v[3] == 0x9b00dbd8u);
  r = moe_philox(UINT64_MAX, UINT64_MAX, UINT64_MAX);
  EXPECT(r.v[0] == 0x408f276du && r.v[1] == 0x41c83b0eu && r.v[2] == 0xa20bc7c6u &&
         r.v[3] == 0x6d5451fdu);
  r = moe_philox(42, 0, 0);
  EXPECT(r.v[0] == 0x9ceaf053u && r.v[1] == 0x77f5493bu && r.v[2] == 0x12bf50adu &&
         r.v[3] == 0x5742b3d7u);
}

static void test_pinned(moe_ctx *ctx) {
  moe_rng_seed(ctx, 42);
  moe_tensor *t = empty(ctx, MOE_F32, SHAPE(2, 3));
  EXPECT_OK(moe_uniform_(ctx, t, 0, 1)); /* call 0 */
  EXPECT_VALUES(t, 0, 0.6129598617553711, 0.4685865044593811, 0.07323169708251953,
                0.3408614993095398, 0.9877186417579651, 0.32706332206726074);
  moe_rng_set_state(ctx, 42, 0);
  EXPECT_OK(moe_uniform_(ctx, t, -1, 2)); /* low + u * (high - low) in double, then f32 */
  EXPECT_VALUES(t, 0, 0.8388795852661133, 0.4057595133781433, -0.7803049087524414,
                0.022584497928619385, 1.96315598487854, -0.018810033798217773);
  moe_tensor_release(t);
  moe_tensor *d = empty(ctx, MOE_F64, SHAPE(4));
  EXPECT_OK(moe_uniform_(ctx, d, 0, 1)); /* call 1, 53 bits */
  EXPECT_VALUES(d, 0, 0.1262498542224193, 0.7116127377916281, 0.9914873587267705,
                0.2256887573994779);
  EXPECT_OK(moe_normal_(ctx, d, 0, 1)); /* call 2: libm may differ in the last bits */
  EXPECT_VALUES(d, 1e-12, -1.3457069609987942, -0.1720506281821863, -0.46948265260814076,
                -1.2275585993759939);
  moe_tensor_release(d);
  moe_tensor *i = empty(ctx, MOE_I64, SHAPE(8));
  EXPECT_OK(moe_randint_(ctx, i, -5, 5)); /* call 3 */
  EXPECT_VALUES(i, 0, -3, -4, -5, 1, 4, -5, 0, -4);
  moe_tensor_release(i);
  uint64_t seed, call;
  moe_rng_get_state(ctx, &seed, &call);
  EXPECT(seed == 42 && call == 4);
}

static void test_determinism(moe_ctx *ctx) {
  moe_tensor *a = empty(ctx, MOE_F32, SHAPE(1000)), *b = empty(ctx, MOE_F32, SHAPE(1000));
  double va[1000], vb[1000];
  moe_rng_seed(ctx, 7);
  EXPECT_OK(moe_normal_(ctx, a, 1, 2));
  moe_rng_seed(ctx, 7);
  EXPECT_OK(moe_normal_(ctx, b, 1, 2));
  EXPECT_OK(moe_tensor_to_f64(ctx, a, va));
  EXPECT_OK(moe_tensor_to_f64(ctx, b, vb));
  int same = 0;
  for (int k = 0; k < 1000; k++) same += va[k] == vb[k];
  EXPECT(same == 1000);
  EXPECT_OK(moe_normal_(ctx, b, 1, 2)); /* the next call differs */
  EXPECT_OK(moe_tensor_to_f64(ctx, b, vb));
  same = 0;
  for (int k = 0; k < 1000; k++) same += va[k] == vb[k];
  EXPECT(same == 0);
  moe_rng_seed(ctx, 8); /* another seed differs */
  EXPECT_OK(moe_normal_(ctx, b, 1, 2));
  EXPECT_OK(moe_tensor_to_f64(ctx, b, vb));
  same = 0;
  for (int k = 0; k < 1000; k++) same += va[k] == vb[k];
  EXPECT(same == 0);
  /* empty fills advance the counter too; failed ones do not */
  moe_tensor *e = empty(ctx, MOE_F32, SHAPE(0, 4));
  uint64_t c0, c1, seed;
  moe_rng_get_state(ctx, &seed, &c0);
  EXPECT_OK(moe_uniform_(ctx, e, 0, 1));
  EXPECT_ERR(moe_uniform_(ctx, e, 1, 0), MOE_ERR_INVALID_ARG);
  moe_rng_get_state(ctx, &seed, &c1);
  EXPECT(c1 == c0 + 1);
  moe_tensor_release(e);
  moe_tensor_release(a);
  moe_tensor_release(b);
}

static void test_order(moe_ctx *ctx) {
  /* a strided view gets its values in its own row-major order */
  moe_tensor *c = empty(ctx, MOE_F32, SHAPE(3, 4)), *base = empty(ctx, MOE_F32, SHAPE(4, 3));
  moe_tensor *v = NULL;
  EXPECT_OK(moe_transpose(ctx, base, 0, 1, &v)); /* [3, 4], strides [1, 3] */
  moe_rng_set_state(ctx, 5, 11);
  EXPECT_OK(moe_uniform_(ctx, c, 0, 1));
  moe_rng_set_state(ctx, 5, 11);
  EXPECT_OK(moe_uniform_(ctx, v, 0, 1));
  double a[12], b[12];
  EXPECT_OK(moe_tensor_to_f64(ctx, c, a));
  EXPECT_OK(moe_tensor_to_f64(ctx, v, b));
  int same = 0;
  for (int k = 0; k < 12; k++) same += a[k] == b[k];
  EXPECT(same == 12);
  /* and a large one (the parallel path) matches element by element */
  moe_tensor *big = empty(ctx, MOE_F64, SHAPE(300, 500));
  moe_rng_set_state(ctx, 99, 3);
  EXPECT_OK(moe_uniform_(ctx, big, 0, 1));
  const double *p = moe_tensor_data(big);
  int bad = 0;
  for (uint64_t k = 0; k < 150000; k += 101) bad += p[k] != moe_philox_uniform53(99, 3, k);
  EXPECT(bad == 0);
  moe_tensor_release(big);
  moe_tensor_release(v);
  moe_tensor_release(base);
  moe_tensor_release(c);
}

static void moments(const moe_tensor *t, double *mean, double *sd) {
  int64_t n = moe_tensor_numel(t);
  double *v = malloc((size_t)n * sizeof(double)), s = 0, s2 = 0;
  EXPECT_OK(moe_tensor_to_f64(harness_ctx, t, v));
  for (int64_t i = 0; i < n; i++) s += v[i];
  *mean = s / (double)n;
  for (int64_t i = 0; i < n; i++) s2 += (v[i] - *mean) * (v[i] - *mean);
  *sd = sqrt(s2 / (double)(n - 1));
  free(v);
}

static void test_moments(moe_ctx *ctx) {
  /* 100k samples: the standard error of the mean is about 0.003 */
  moe_rng_seed(ctx, 1234);
  moe_tensor *t = empty(ctx, MOE_F32, SHAPE(100000));
  double mean, sd;
  EXPECT_OK(moe_uniform_(ctx, t, 0, 1));
  moments(t, &mean, &sd);
  EXPECT_NEAR(mean, 0.5, 0.01);
  EXPECT_NEAR(sd, sqrt(1.0 / 12), 0.01);
  EXPECT_OK(moe_normal_(ctx, t, 3, 2));
  moments(t, &mean, &sd);
  EXPECT_NEAR(mean, 3, 0.02);
  EXPECT_NEAR(sd, 2, 0.02);
  moe_tensor_release(t);
  moe_tensor *h = empty(ctx, MOE_BF16, SHAPE(100000));
  EXPECT_OK(moe_normal_(ctx, h, 0, 1));
  moments(h, &mean, &sd);
  EXPECT_NEAR(mean, 0, 0.02);
  EXPECT_NEAR(sd, 1, 0.02);
  EXPECT_OK(moe_uniform_(ctx, h, -2, -1));
  double *v = malloc(100000 * sizeof(double));
  EXPECT_OK(moe_tensor_to_f64(ctx, h, v));
  int out = 0;
  for (int k = 0; k < 100000; k++) out += v[k] < -2 || v[k] > -1;
  EXPECT(out == 0);
  free(v);
  moe_tensor_release(h);
  /* randint: every value of [-3, 4) appears, nothing outside */
  moe_tensor *i = empty(ctx, MOE_I8, SHAPE(10000));
  EXPECT_OK(moe_randint_(ctx, i, -3, 4));
  int64_t counts[7] = {0};
  const int8_t *p = moe_tensor_data(i);
  out = 0;
  for (int k = 0; k < 10000; k++) {
    if (p[k] < -3 || p[k] >= 4)
      out++;
    else
      counts[p[k] + 3]++;
  }
  EXPECT(out == 0);
  for (int k = 0; k < 7; k++) EXPECT(counts[k] > 1200 && counts[k] < 1660); /* 1428 expected */
  moe_tensor_release(i);
  moe_tensor *f = empty(ctx, MOE_F32, SHAPE(1000)), *b = empty(ctx, MOE_BOOL, SHAPE(1000));
  EXPECT_OK(moe_randint_(ctx, f, 10, 12)); /* on floats too */
  moments(f, &mean, &sd);
  EXPECT_NEAR(mean, 10.5, 0.1);
  EXPECT_OK(moe_randint_(ctx, b, 0, 2));
  moments(b, &mean, &sd);
  EXPECT_NEAR(mean, 0.5, 0.1);
  moe_tensor_release(f);
  moe_tensor_release(b);
  /* the full int64 range does not overflow */
  moe_tensor *l = empty(ctx, MOE_I64, SHAPE(4));
  EXPECT_OK(moe_randint_(ctx, l, INT64_MIN, INT64_MAX));
  moe_tensor_release(l);
}

static void test_random_errors(moe_ctx *ctx) {
  moe_tensor *i = empty(ctx, MOE_I32, SHAPE(4)), *u = empty(ctx, MOE_U8, SHAPE(4));
  moe_tensor *f = empty(ctx, MOE_F32, SHAPE(1)), *ex = NULL;
  uint64_t seed, c0, c1;
  moe_rng_get_state(ctx, &seed, &c0);
  EXPECT_ERR_MSG(moe_uniform_(ctx, i, 0, 1), MOE_ERR_DTYPE,
                 "uniform_: needs a float tensor, got i32");
  EXPECT_ERR_MSG(moe_normal_(ctx, i, 0, 1), MOE_ERR_DTYPE, "normal_: needs a float tensor");
  EXPECT_ERR_MSG(moe_normal_(ctx, f, 0, -1), MOE_ERR_INVALID_ARG, "std >= 0");
  EXPECT_ERR(moe_normal_(ctx, f, NAN, 1), MOE_ERR_INVALID_ARG);
  EXPECT_ERR_MSG(moe_uniform_(ctx, f, 2, 1), MOE_ERR_INVALID_ARG, "low 2 and high 1");
  EXPECT_ERR(moe_uniform_(ctx, f, 0, INFINITY), MOE_ERR_INVALID_ARG);
  EXPECT_ERR_MSG(moe_randint_(ctx, i, 5, 5), MOE_ERR_INVALID_ARG,
                 "randint_: high 5 must be greater than low 5");
  EXPECT_ERR_MSG(moe_randint_(ctx, u, 0, 300), MOE_ERR_INVALID_ARG,
                 "randint_: [0, 300) does not fit dtype u8");
  EXPECT_ERR(moe_randint_(ctx, u, -1, 3), MOE_ERR_INVALID_ARG);
  EXPECT_OK(moe_expand(ctx, f, SHAPE(3), &ex));
  EXPECT_ERR_MSG(moe_uniform_(ctx, ex, 0, 1), MOE_ERR_INVALID_ARG, "uniform_: cannot write");
  EXPECT_ERR(moe_uniform_(ctx, NULL, 0, 1), MOE_ERR_INVALID_ARG);
  moe_rng_get_state(ctx, &seed, &c1);
  EXPECT(c1 == c0);
  moe_tensor_release(ex);
  moe_tensor_release(f);
  moe_tensor_release(u);
  moe_tensor_release(i);
}

int main(void) {
  RUN(test_philox_kat);
  RUN(test_pinned);
  RUN(test_determinism);
  RUN(test_order);
  RUN(test_moments);
  RUN(test_random_errors);
  return harness_end();
}
