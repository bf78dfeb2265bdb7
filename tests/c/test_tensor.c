/*
 * test_tensor.c - context, dtypes, devices, storages and memory statistics,
 * tensor lifecycle, from_f64/to_f64/to_i64 round trips for every dtype,
 * bf16/f16 rounding and the defined float -> integer conversions.
 */
#include <string.h>

#include "harness.h"
#include "internal.h"

static moe_tensor *from(moe_ctx *ctx, moe_dtype dt, int ndim, const int64_t *shape,
                        const double *v) {
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, v, ndim, shape, dt, MOE_CPU, &t));
  return t;
}

static void test_ctx(moe_ctx *ctx) {
  uint64_t seed, call;
  moe_rng_get_state(ctx, &seed, &call);
  EXPECT(seed == 0x5eed && call == 0);
  EXPECT(ctx->cuda == NULL && ctx->cuda_count == -1);
  EXPECT(moe_error(ctx, MOE_ERR_SHAPE, "bad %d", 7) == MOE_ERR_SHAPE);
  EXPECT(moe_ctx_status(ctx) == MOE_ERR_SHAPE);
  EXPECT_STR(moe_ctx_error(ctx), "bad 7");
  moe_ctx_clear(ctx);
  EXPECT(moe_ctx_status(ctx) == MOE_OK);
  EXPECT_STR(moe_ctx_error(ctx), "");
  EXPECT_STR(moe_status_name(MOE_OK), "ok");
  EXPECT_STR(moe_status_name(MOE_ERR_DTYPE), "dtype error");
  EXPECT_STR(moe_status_name(MOE_STATUS_COUNT), "unknown status");
  for (int s = 0; s < MOE_STATUS_COUNT; s++) EXPECT(moe_status_name((moe_status)s)[0] != 0);
  /* a long message is cut, not overflowed */
  char big[3000];
  memset(big, 'x', sizeof(big) - 1);
  big[sizeof(big) - 1] = 0;
  moe_error(ctx, MOE_ERR_IO, "%s", big);
  EXPECT(strlen(moe_ctx_error(ctx)) == sizeof(ctx->err) - 1);
  moe_rng_set_state(ctx, 7, 9);
  moe_rng_get_state(ctx, &seed, &call);
  EXPECT(seed == 7 && call == 9);
  moe_rng_seed(ctx, 11);
  moe_rng_get_state(ctx, &seed, &call);
  EXPECT(seed == 11 && call == 0);
  moe_ctx *other = NULL;
  EXPECT(moe_ctx_init(&other) == MOE_OK && other != NULL);
  moe_ctx_free(other);
  moe_ctx_free(NULL);
  EXPECT(moe_ctx_init(NULL) == MOE_ERR_INVALID_ARG);
}

static void test_dtypes(moe_ctx *ctx) {
  static const char *names[] = {"f32", "f64", "bf16", "f16", "i8", "u8", "i32", "i64", "bool"};
  static const size_t sizes[] = {4, 8, 2, 2, 1, 1, 4, 8, 1};
  for (int i = 0; i < MOE_DTYPE_COUNT; i++) {
    moe_dtype dt;
    EXPECT_STR(moe_dtype_name((moe_dtype)i), names[i]);
    EXPECT(moe_dtype_size((moe_dtype)i) == sizes[i]);
    EXPECT(moe_dtype_parse(names[i], &dt) && dt == (moe_dtype)i);
    EXPECT(moe_dtype_is_float((moe_dtype)i) == (i <= MOE_F16));
  }
  moe_dtype dt;
  EXPECT(moe_dtype_parse("float32", &dt) && dt == MOE_F32);
  EXPECT(moe_dtype_parse("float", &dt) && dt == MOE_F32);
  EXPECT(moe_dtype_parse("bfloat16", &dt) && dt == MOE_BF16);
  EXPECT(moe_dtype_parse("int64", &dt) && dt == MOE_I64);
  EXPECT(moe_dtype_parse("long", &dt) && dt == MOE_I64);
  EXPECT(moe_dtype_parse("half", &dt) && dt == MOE_F16);
  EXPECT(!moe_dtype_parse("f8", &dt));
  EXPECT(!moe_dtype_parse("", &dt));
  EXPECT(!moe_dtype_parse(NULL, &dt));
  EXPECT_STR(moe_dtype_name((moe_dtype)42), "dtype?");
  EXPECT(moe_dtype_size((moe_dtype)42) == 0);
}

static void test_promote(moe_ctx *ctx) {
  /* the full table, rows and columns in enum order:
   * f32 f64 bf16 f16 i8 u8 i32 i64 bool */
  static const moe_dtype want[9][9] = {
      {MOE_F32, MOE_F64, MOE_F32, MOE_F32, MOE_F32, MOE_F32, MOE_F32, MOE_F32, MOE_F32},
      {MOE_F64, MOE_F64, MOE_F64, MOE_F64, MOE_F64, MOE_F64, MOE_F64, MOE_F64, MOE_F64},
      {MOE_F32, MOE_F64, MOE_BF16, MOE_F32, MOE_BF16, MOE_BF16, MOE_BF16, MOE_BF16, MOE_BF16},
      {MOE_F32, MOE_F64, MOE_F32, MOE_F16, MOE_F16, MOE_F16, MOE_F16, MOE_F16, MOE_F16},
      {MOE_F32, MOE_F64, MOE_BF16, MOE_F16, MOE_I8, MOE_I32, MOE_I32, MOE_I64, MOE_I8},
      {MOE_F32, MOE_F64, MOE_BF16, MOE_F16, MOE_I32, MOE_U8, MOE_I32, MOE_I64, MOE_U8},
      {MOE_F32, MOE_F64, MOE_BF16, MOE_F16, MOE_I32, MOE_I32, MOE_I32, MOE_I64, MOE_I32},
      {MOE_F32, MOE_F64, MOE_BF16, MOE_F16, MOE_I64, MOE_I64, MOE_I64, MOE_I64, MOE_I64},
      {MOE_F32, MOE_F64, MOE_BF16, MOE_F16, MOE_I8, MOE_U8, MOE_I32, MOE_I64, MOE_BOOL},
  };
  for (int a = 0; a < 9; a++)
    for (int b = 0; b < 9; b++) {
      moe_dtype got = moe_dtype_promote((moe_dtype)a, (moe_dtype)b);
      if (got != want[a][b])
        fprintf(stderr, "promote(%s, %s) = %s, wanted %s\n", moe_dtype_name((moe_dtype)a),
                moe_dtype_name((moe_dtype)b), moe_dtype_name(got), moe_dtype_name(want[a][b]));
      EXPECT(got == want[a][b]);
    }
}

static void test_devices(moe_ctx *ctx) {
  char buf[32];
  EXPECT_STR(moe_device_str(MOE_CPU, buf, sizeof(buf)), "cpu");
  EXPECT_STR(moe_device_str((moe_device){MOE_DEVICE_CUDA, 3}, buf, sizeof(buf)), "cuda:3");
  EXPECT(moe_device_equal(MOE_CPU, MOE_CPU));
  EXPECT(!moe_device_equal(MOE_CPU, (moe_device){MOE_DEVICE_CUDA, 0}));
  EXPECT(!moe_device_equal((moe_device){MOE_DEVICE_CUDA, 0}, (moe_device){MOE_DEVICE_CUDA, 1}));
  moe_device d = {MOE_DEVICE_CUDA, 5};
  EXPECT_OK(moe_device_parse(ctx, "cpu", &d));
  EXPECT(d.type == MOE_DEVICE_CPU);
  EXPECT_OK(moe_device_check(ctx, MOE_CPU));
  int n = moe_cuda_device_count(ctx);
  if (n == 0) {
    /* built without CUDA, or no GPU: every CUDA name fails with a clear message */
    moe_status want = moe_cuda_built() ? MOE_ERR_DEVICE : MOE_ERR_NOT_SUPPORTED;
    const char *part = moe_cuda_built() ? "no CUDA GPU is visible" : "built without CUDA";
    EXPECT_ERR_MSG(moe_device_parse(ctx, "cuda", &d), want, part);
    EXPECT_ERR_MSG(moe_device_parse(ctx, "gpu", &d), want, part);
    EXPECT_ERR_MSG(moe_device_parse(ctx, "cuda:1", &d), want, "cuda:1 requested");
    EXPECT(d.type == MOE_DEVICE_CPU); /* not written on failure */
  } else {
    EXPECT_OK(moe_device_parse(ctx, "cuda", &d));
    EXPECT(d.type == MOE_DEVICE_CUDA && d.index == 0);
    char name[16];
    snprintf(name, sizeof(name), "cuda:%d", n);
    EXPECT_ERR_MSG(moe_device_parse(ctx, name, &d), MOE_ERR_DEVICE, "CUDA device");
  }
  EXPECT_ERR_MSG(moe_device_parse(ctx, "tpu", &d), MOE_ERR_INVALID_ARG, "\"cuda:N\"");
  EXPECT_ERR(moe_device_parse(ctx, "cuda:", &d), MOE_ERR_INVALID_ARG);
  EXPECT_ERR(moe_device_parse(ctx, "cuda:x", &d), MOE_ERR_INVALID_ARG);
  EXPECT_ERR(moe_device_parse(ctx, "cuda:-1", &d), MOE_ERR_INVALID_ARG);
  EXPECT_ERR(moe_device_parse(ctx, "cuda:123456789", &d), MOE_ERR_INVALID_ARG);
  EXPECT_ERR(moe_device_parse(ctx, "CPU", &d), MOE_ERR_INVALID_ARG);
  EXPECT_ERR(moe_device_parse(ctx, NULL, &d), MOE_ERR_INVALID_ARG);
  EXPECT_ERR_MSG(moe_device_check(ctx, (moe_device){MOE_DEVICE_CUDA, -2}), MOE_ERR_INVALID_ARG,
                 "cuda:-2");
  EXPECT_ERR(moe_device_check(ctx, (moe_device){(moe_device_type)7, 0}), MOE_ERR_INVALID_ARG);
}

static void test_memory_stats(moe_ctx *ctx) {
  moe_memory_stats s0, s1, s2;
  EXPECT_OK(moe_memory_reset_peak(ctx, MOE_CPU));
  EXPECT_OK(moe_memory_stats_get(ctx, MOE_CPU, &s0));
  moe_tensor *a = NULL, *b = NULL, *e = NULL, *v = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, 2, (int64_t[]){10, 10}, MOE_F32, MOE_CPU, &a)); /* 400 B */
  EXPECT_OK(moe_tensor_empty(ctx, 1, (int64_t[]){3}, MOE_F64, MOE_CPU, &b));      /* 24 B */
  EXPECT_OK(moe_tensor_empty(ctx, 2, (int64_t[]){0, 3}, MOE_F32, MOE_CPU, &e));   /* 0 B */
  EXPECT(moe_tensor_data(e) == NULL && e->storage->nbytes == 0);
  EXPECT(((uintptr_t)moe_tensor_data(a) & 63) == 0); /* 64-byte aligned */
  EXPECT(a->storage->block == 448);
  EXPECT_OK(moe_memory_stats_get(ctx, MOE_CPU, &s1));
  EXPECT(s1.allocated - s0.allocated == 424);
  EXPECT(s1.reserved == s1.allocated);
  EXPECT(s1.alloc_count - s0.alloc_count == 3);
  EXPECT(s1.live_storages - s0.live_storages == 3);
  EXPECT(s1.system_allocs - s0.system_allocs == 2); /* the empty one mallocs nothing */
  EXPECT(s1.peak_allocated >= s1.allocated);
  EXPECT_OK(moe_view(ctx, a, 1, (int64_t[]){100}, &v)); /* views allocate no storage */
  EXPECT_OK(moe_memory_stats_get(ctx, MOE_CPU, &s2));
  EXPECT(s2.alloc_count == s1.alloc_count);
  moe_tensor_release(a); /* the view keeps the storage alive */
  EXPECT_OK(moe_memory_stats_get(ctx, MOE_CPU, &s2));
  EXPECT(s2.live_storages == s1.live_storages);
  moe_tensor_release(v);
  moe_tensor_release(b);
  moe_tensor_release(e);
  EXPECT_OK(moe_memory_stats_get(ctx, MOE_CPU, &s2));
  EXPECT(s2.allocated == s0.allocated);
  EXPECT(s2.live_storages == s0.live_storages);
  EXPECT(s2.free_count - s0.free_count == 3);
  EXPECT(s2.system_frees - s0.system_frees == 2);
  EXPECT(s2.peak_allocated == s0.allocated + 424);
  EXPECT_OK(moe_memory_reset_peak(ctx, MOE_CPU));
  EXPECT_OK(moe_memory_stats_get(ctx, MOE_CPU, &s2));
  EXPECT(s2.peak_allocated == s2.allocated);
  EXPECT_OK(moe_memory_empty_cache(ctx, MOE_CPU));
  if (moe_cuda_device_count(ctx) == 0)
    EXPECT_ERR(moe_memory_stats_get(ctx, (moe_device){MOE_DEVICE_CUDA, 0}, &s2),
               moe_cuda_built() ? MOE_ERR_DEVICE : MOE_ERR_NOT_SUPPORTED);
  moe_tensor_release(NULL);
}

static void test_empty_full(moe_ctx *ctx) {
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, 3, (int64_t[]){2, 3, 4}, MOE_F32, MOE_CPU, &t));
  EXPECT(t->ndim == 3 && t->stride[0] == 12 && t->stride[1] == 4 && t->stride[2] == 1);
  EXPECT(t->offset == 0 && t->refcount == 1 && t->autograd == NULL);
  EXPECT(moe_tensor_numel(t) == 24 && moe_tensor_is_contiguous(t));
  EXPECT(moe_tensor_device(t).type == MOE_DEVICE_CPU);
  moe_kview kv = moe_kview_of(t);
  EXPECT(kv.data == moe_tensor_data(t) && kv.ndim == 3 && kv.shape[1] == 3 && kv.stride[0] == 12);
  moe_tensor_retain(t);
  EXPECT(t->refcount == 2);
  moe_tensor_release(t);
  moe_tensor_release(t);

  EXPECT_OK(moe_tensor_empty(ctx, 0, NULL, MOE_I64, MOE_CPU, &t)); /* a scalar */
  EXPECT(t->ndim == 0 && moe_tensor_numel(t) == 1 && moe_tensor_is_contiguous(t));
  moe_tensor_release(t);

  EXPECT_OK(moe_tensor_full(ctx, 2, (int64_t[]){2, 2}, 2.5, MOE_F64, MOE_CPU, &t));
  EXPECT_VALUES(t, 0, 2.5, 2.5, 2.5, 2.5);
  moe_tensor_release(t);
  EXPECT_OK(moe_tensor_full(ctx, 1, (int64_t[]){3}, -3.9, MOE_I32, MOE_CPU, &t));
  EXPECT_VALUES(t, 0, -3, -3, -3);
  moe_tensor_release(t);
  EXPECT_OK(moe_tensor_full(ctx, 1, (int64_t[]){2}, 0.5, MOE_BOOL, MOE_CPU, &t));
  EXPECT_VALUES(t, 0, 1, 1);
  moe_tensor_release(t);

  /* empty tensors of any shape */
  EXPECT_OK(moe_tensor_full(ctx, 2, (int64_t[]){0, 3}, 1, MOE_F32, MOE_CPU, &t));
  EXPECT(moe_tensor_numel(t) == 0 && moe_tensor_is_contiguous(t));
  EXPECT(t->stride[0] == 3 && t->stride[1] == 1);
  double none[1] = {42};
  EXPECT_OK(moe_tensor_to_f64(ctx, t, none));
  EXPECT_OK(moe_tensor_to_f64(ctx, t, NULL));
  EXPECT(none[0] == 42);
  moe_tensor_release(t);
  EXPECT_OK(moe_tensor_from_f64(ctx, NULL, 2, (int64_t[]){3, 0}, MOE_I8, MOE_CPU, &t));
  EXPECT(moe_tensor_numel(t) == 0);
  moe_tensor_release(t);
}

static void test_round_trip(moe_ctx *ctx) {
  /* values every dtype holds exactly (bool gets 0/1) */
  const double v[6] = {0, 1, -2, 3, 100, -7};
  for (int i = 0; i < MOE_DTYPE_COUNT; i++) {
    moe_dtype dt = (moe_dtype)i;
    moe_tensor *t = from(ctx, dt, 2, (int64_t[]){2, 3}, v);
    if (!t) continue;
    double got[6];
    int64_t goti[6];
    EXPECT_OK(moe_tensor_to_f64(ctx, t, got));
    EXPECT_OK(moe_tensor_to_i64(ctx, t, goti));
    for (int k = 0; k < 6; k++) {
      double want = v[k];
      if (dt == MOE_BOOL) want = v[k] != 0;
      if (dt == MOE_U8 && v[k] < 0) want = 0; /* saturates */
      if (got[k] != want || goti[k] != (int64_t)want)
        fprintf(stderr, "round trip %s: element %d is %g / %lld, wanted %g\n", moe_dtype_name(dt),
                k, got[k], (long long)goti[k], want);
      EXPECT(got[k] == want && goti[k] == (int64_t)want);
    }
    moe_tensor_release(t);
  }
  /* int64 keeps all 64 bits through to_i64 */
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, 1, (int64_t[]){2}, MOE_I64, MOE_CPU, &t));
  int64_t *p = moe_tensor_data(t);
  p[0] = INT64_MAX;
  p[1] = INT64_MIN + 1;
  int64_t got[2];
  EXPECT_OK(moe_tensor_to_i64(ctx, t, got));
  EXPECT(got[0] == INT64_MAX && got[1] == INT64_MIN + 1);
  moe_tensor_release(t);
}

static void test_half_rounding(moe_ctx *ctx) {
  /* bf16 has 8 bits of mantissa: 1 + 2^-8 is a tie, rounds to even (1);
   * 1 + 3 * 2^-8 ties up to 1 + 2^-6; f16 has 11 bits */
  const double v[8] = {1.0 + 1.0 / 256, 1.0 + 3.0 / 256, 3.14159265, 1e-3,
                       65504, 70000, -1e-8, 0.1};
  moe_tensor *b = from(ctx, MOE_BF16, 1, (int64_t[]){8}, v);
  moe_tensor *h = from(ctx, MOE_F16, 1, (int64_t[]){8}, v);
  EXPECT_VALUES(b, 0, 1.0, 1.015625, 3.140625, 0.00099945068359375, 65536, 70144,
                -1.0011717677116394e-08, 0.10009765625);
  EXPECT_VALUES(h, 0, 1.00390625, 1.01171875, 3.140625, 0.0010004043579101562, 65504, INFINITY,
                -0.0, 0.0999755859375);
  moe_tensor_release(b);
  moe_tensor_release(h);
  /* NaN and infinities survive both */
  const double s[3] = {NAN, INFINITY, -INFINITY};
  b = from(ctx, MOE_BF16, 1, (int64_t[]){3}, s);
  h = from(ctx, MOE_F16, 1, (int64_t[]){3}, s);
  EXPECT_VALUES(b, 0, NAN, INFINITY, -INFINITY);
  EXPECT_VALUES(h, 0, NAN, INFINITY, -INFINITY);
  moe_tensor_release(b);
  moe_tensor_release(h);
  /* f16 subnormals: 2^-24 is the smallest */
  const double sub[3] = {5.960464477539063e-08, 2.9e-08, 1e-5};
  h = from(ctx, MOE_F16, 1, (int64_t[]){3}, sub);
  EXPECT_VALUES(h, 0, 5.960464477539063e-08, 0, 1.0013580322265625e-05);
  moe_tensor_release(h);
}

static void test_conversions(moe_ctx *ctx) {
  /* float -> integer: toward zero, saturating, NaN -> 0; bool: v != 0 */
  const double v[7] = {2.9, -2.9, 1e10, -1e10, NAN, 300, -0.5};
  moe_tensor *t;
  t = from(ctx, MOE_I32, 1, (int64_t[]){7}, v);
  EXPECT_VALUES(t, 0, 2, -2, 2147483647, -2147483648.0, 0, 300, 0);
  moe_tensor_release(t);
  t = from(ctx, MOE_I8, 1, (int64_t[]){7}, v);
  EXPECT_VALUES(t, 0, 2, -2, 127, -128, 0, 127, 0);
  moe_tensor_release(t);
  t = from(ctx, MOE_U8, 1, (int64_t[]){7}, v);
  EXPECT_VALUES(t, 0, 2, 0, 255, 0, 0, 255, 0);
  moe_tensor_release(t);
  t = from(ctx, MOE_BOOL, 1, (int64_t[]){7}, v);
  EXPECT_VALUES(t, 0, 1, 1, 1, 1, 1, 1, 1);
  moe_tensor_release(t);
  const double big[2] = {1e30, -1e30};
  t = from(ctx, MOE_I64, 1, (int64_t[]){2}, big);
  int64_t gi[2];
  EXPECT_OK(moe_tensor_to_i64(ctx, t, gi));
  EXPECT(gi[0] == INT64_MAX && gi[1] == INT64_MIN);
  moe_tensor_release(t);
  /* the element accessors directly: integer -> narrower integer wraps */
  unsigned char buf[8];
  moe_store_i64(buf, MOE_I8, 300);
  EXPECT(moe_load_i64(buf, MOE_I8) == 44);
  moe_store_i64(buf, MOE_U8, -1);
  EXPECT(moe_load_i64(buf, MOE_U8) == 255);
  moe_store_i64(buf, MOE_BOOL, -5);
  EXPECT(moe_load_i64(buf, MOE_BOOL) == 1 && buf[0] == 1);
  moe_store_i64(buf, MOE_BF16, 257);
  EXPECT(moe_load_f64(buf, MOE_BF16) == 256);
  moe_store_f64(buf, MOE_F32, 0.1);
  EXPECT(moe_load_f64(buf, MOE_F32) == (double)0.1f);
  EXPECT(moe_load_i64(buf, MOE_F32) == 0);
  moe_store_f64(buf, MOE_F64, -7.75);
  EXPECT(moe_load_i64(buf, MOE_F64) == -7);
  moe_store_f64(buf, MOE_F16, NAN);
  EXPECT(moe_load_i64(buf, MOE_F16) == 0);
}

static void test_helpers(moe_ctx *ctx) {
  char buf[64];
  EXPECT_STR(moe_shape_str(0, NULL, buf, sizeof(buf)), "[]");
  EXPECT_STR(moe_shape_str(3, (int64_t[]){2, 0, 7}, buf, sizeof(buf)), "[2, 0, 7]");
  char small[5];
  moe_shape_str(3, (int64_t[]){200, 300, 400}, small, sizeof(small));
  EXPECT(strlen(small) == 4);
  int d = -1;
  EXPECT_OK(moe_dim_normalize(ctx, -1, 3, false, &d));
  EXPECT(d == 2);
  EXPECT_OK(moe_dim_normalize(ctx, -1, 3, true, &d));
  EXPECT(d == 3);
  EXPECT_OK(moe_dim_normalize(ctx, 0, 0, true, &d));
  EXPECT(d == 0);
  EXPECT_ERR_MSG(moe_dim_normalize(ctx, 3, 3, false, &d), MOE_ERR_INVALID_ARG,
                 "dim 3 is out of range for a tensor of 3 dims (expected -3 to 2)");
  EXPECT_ERR(moe_dim_normalize(ctx, -5, 3, true, &d), MOE_ERR_INVALID_ARG);
  EXPECT_ERR(moe_dim_normalize(ctx, 0, 0, false, &d), MOE_ERR_INVALID_ARG);
  EXPECT(d == 0);
  EXPECT(moe_tensor_numel(NULL) == 0 && !moe_tensor_is_contiguous(NULL));
  EXPECT(moe_tensor_data(NULL) == NULL);
}

int main(void) {
  RUN(test_ctx);
  RUN(test_dtypes);
  RUN(test_promote);
  RUN(test_devices);
  RUN(test_memory_stats);
  RUN(test_empty_full);
  RUN(test_round_trip);
  RUN(test_half_rounding);
  RUN(test_conversions);
  RUN(test_helpers);
  return harness_end();
}
