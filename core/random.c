/*
 * random.c - the random fills of moe.h: uniform_, normal_ and randint_. Each
 * validates (copy_check.h), then runs the CPU loop here or moe_cuda_random
 * (internal.h, kernels/random.cu), which compute the same values.
 *
 * Element i in row-major logical order gets the value of (seed, call, i)
 * from Philox (philox.h); the context's call counter advances by one after
 * every successful fill, empty tensors included.
 */
#include <math.h>

#include "copy_check.h"
#include "cpu_loop.h"
#include "internal.h"
#include "philox.h"

static void cpu_random(const moe_kview *dst, moe_random_kind kind, uint64_t seed, uint64_t call,
                       double a, double b, int64_t ilow, uint64_t irange) {
  int64_t es = (int64_t)moe_dtype_size(dst->dtype);
  bool f64 = dst->dtype == MOE_F64;
  moe_loop l;
  moe_loop_init(&l, 1, (const moe_kview *[]){dst});
#pragma omp parallel for if (l.numel >= MOE_LOOP_PAR_MIN / 4) schedule(static)
  for (int64_t k = 0; k < l.tasks; k++) {
    int64_t off = 0, first = 0;
    int64_t n = moe_loop_task(&l, k, &off, &first);
    char *d = (char *)dst->data + off * es;
    int64_t sd = l.inner_stride[0] * es;
    for (int64_t j = 0; j < n; j++, d += sd) {
      uint64_t i = (uint64_t)(first + j);
      if (kind == MOE_RANDOM_UNIFORM) {
        double u = f64 ? moe_philox_uniform53(seed, call, i) : moe_philox_uniform24(seed, call, i);
        moe_store_f64(d, dst->dtype, a + u * (b - a));
      } else if (kind == MOE_RANDOM_NORMAL) {
        moe_store_f64(d, dst->dtype, a + b * moe_philox_normal(seed, call, i));
      } else {
        uint64_t r = moe_philox_bits64(seed, call, i) % irange;
        moe_store_i64(d, dst->dtype, (int64_t)((uint64_t)ilow + r));
      }
    }
  }
}

static moe_status random_fill(moe_ctx *ctx, moe_tensor *t, moe_random_kind kind,
                              double a, double b, int64_t ilow, uint64_t irange) {
  moe_device d = t->storage->device;
  uint64_t seed = ctx->rng_seed, call = ctx->rng_call;
  if (moe_tensor_numel(t) > 0) {
    moe_kview v = moe_kview_of(t);
    if (d.type == MOE_DEVICE_CUDA)
      MOE_CHECK(moe_cuda_random(ctx, d.index, &v, kind, seed, call, a, b));
    else
      cpu_random(&v, kind, seed, call, a, b, ilow, irange);
  }
  ctx->rng_call++;
  return MOE_OK;
}

static moe_status random_args(moe_ctx *ctx, const char *fn, moe_tensor *t, bool floats_only) {
  if (!t) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: tensor is NULL", fn);
  MOE_CHECK(moe_check_writable(ctx, fn, t));
  MOE_CHECK(moe_check_inplace(ctx, fn, t));
  MOE_CHECK(moe_device_check(ctx, t->storage->device));
  if (floats_only && !moe_dtype_is_float(t->dtype))
    return moe_error(ctx, MOE_ERR_DTYPE, "%s: needs a float tensor, got %s (use randint_ for integers)",
                     fn, moe_dtype_name(t->dtype));
  return MOE_OK;
}

moe_status moe_uniform_(moe_ctx *ctx, moe_tensor *t, double low, double high) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(random_args(ctx, "uniform_", t, true));
  if (!isfinite(low) || !isfinite(high) || low > high)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "uniform_: needs finite low <= high, got low %g and high %g", low, high);
  return random_fill(ctx, t, MOE_RANDOM_UNIFORM, low, high, 0, 1);
}

moe_status moe_normal_(moe_ctx *ctx, moe_tensor *t, double mean, double std) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(random_args(ctx, "normal_", t, true));
  if (!isfinite(mean) || !isfinite(std) || std < 0)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "normal_: needs a finite mean and std >= 0, got mean %g and std %g", mean, std);
  return random_fill(ctx, t, MOE_RANDOM_NORMAL, mean, std, 0, 1);
}

/* Inclusive range of integers a dtype holds exactly. */
static void dtype_int_range(moe_dtype dt, int64_t *lo, int64_t *hi) {
  switch (dt) {
    case MOE_BOOL: *lo = 0, *hi = 1; return;
    case MOE_I8: *lo = INT8_MIN, *hi = INT8_MAX; return;
    case MOE_U8: *lo = 0, *hi = UINT8_MAX; return;
    case MOE_I32: *lo = INT32_MIN, *hi = INT32_MAX; return;
    case MOE_BF16: *lo = -(1 << 8), *hi = 1 << 8; return;
    case MOE_F16: *lo = -(1 << 11), *hi = 1 << 11; return;
    case MOE_F32: *lo = -(1 << 24), *hi = 1 << 24; return;
    case MOE_F64: *lo = -(INT64_C(1) << 53), *hi = INT64_C(1) << 53; return;
    default: *lo = INT64_MIN, *hi = INT64_MAX; return;
  }
}

moe_status moe_randint_(moe_ctx *ctx, moe_tensor *t, int64_t low, int64_t high) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(random_args(ctx, "randint_", t, false));
  if (high <= low)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "randint_: high %lld must be greater than low %lld",
                     (long long)high, (long long)low);
  int64_t lo, hi;
  dtype_int_range(t->dtype, &lo, &hi);
  if (low < lo || high - 1 > hi)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "randint_: [%lld, %lld) does not fit dtype %s (which holds %lld to %lld exactly)",
                     (long long)low, (long long)high, moe_dtype_name(t->dtype), (long long)lo,
                     (long long)hi);
  return random_fill(ctx, t, MOE_RANDOM_INT, (double)low, (double)high, low,
                     (uint64_t)high - (uint64_t)low);
}
