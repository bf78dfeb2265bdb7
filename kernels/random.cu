/*
 * random.cu - moe_cuda_random: uniform, normal and integer fills from
 * Philox-4x32-10 (core/philox.h, the same code the CPU runs).
 *
 * Element i in row-major logical order is a function of (seed, call, i) only:
 *   uniform: u = moe_philox_uniform53 for f64, moe_philox_uniform24 for the
 *            other dtypes; value = low + u * (high - low) in double;
 *   normal:  mean + std * moe_philox_normal;
 *   integer: low + bits64 % (high - low), stored as moe_store_i64 would.
 * Double arithmetic uses __dmul_rn / __dadd_rn so nothing is fused: uniform
 * and integer results are bit-identical to the CPU (-ffp-contract=off);
 * normal differs only by the last bits of CUDA's log/sin/cos against libm.
 * One thread per element; each computes its own Philox block (pure, so the
 * launch shape does not matter). low/high of integer fills come as doubles:
 * exact for |values| up to 2^53.
 */
#include "common.cuh"
#include "philox.h"

struct MoeUniformGen {
  uint64_t seed, call;
  double low, range;
  bool bits53;
  __device__ __forceinline__ double operator()(int64_t i) const {
    double u = bits53 ? moe_philox_uniform53(seed, call, (uint64_t)i)
                      : moe_philox_uniform24(seed, call, (uint64_t)i);
    return MOE_DADD(low, MOE_DMUL(u, range));
  }
};

struct MoeNormalGen {
  uint64_t seed, call;
  double mean, std;
  __device__ __forceinline__ double operator()(int64_t i) const {
    return MOE_DADD(mean, MOE_DMUL(std, moe_philox_normal(seed, call, (uint64_t)i)));
  }
};

struct MoeIntGen {
  uint64_t seed, call;
  int64_t low;
  uint64_t range; /* high - low, >= 1 */
  __device__ __forceinline__ int64_t operator()(int64_t i) const {
    uint64_t r = moe_philox_bits64(seed, call, (uint64_t)i) % range;
    return (int64_t)((uint64_t)low + r);
  }
};

/* An integer bound given as a double: NaN 0, saturating at the int64 range. */
static int64_t moe_random_i64(double v) {
  if (v != v) return 0;
  if (v >= 9223372036854775807.0) return INT64_MAX;
  if (v <= -9223372036854775808.0) return INT64_MIN;
  return (int64_t)v;
}

template <typename G>
static moe_status moe_random_launch(moe_ctx *ctx, const moe_kview *dst, int64_t n,
                                    const MoeGeom<1> &g, G gen, cudaStream_t s) {
  return moe_dtype_dispatch(dst->dtype, [&](auto tag) -> moe_status {
    moe_gen_kernel<decltype(tag)::value><<<moe_blocks(n), MOE_THREADS, 0, s>>>(n, dst->data, g,
                                                                               gen);
    return MOE_OK;
  });
}

extern "C" moe_status moe_cuda_random(moe_ctx *ctx, int device, const moe_kview *dst,
                                      moe_random_kind kind, uint64_t seed, uint64_t call,
                                      double a, double b) {
  const moe_kview *v[1] = {dst};
  int64_t n = 0;
  MOE_CHECK(moe_kviews_check(ctx, "cuda random", 1, v, &n));
  if (kind != MOE_RANDOM_UNIFORM && kind != MOE_RANDOM_NORMAL && kind != MOE_RANDOM_INT)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "cuda random: unknown kind %d", (int)kind);
  int64_t ilow = 0, ihigh = 0;
  if (kind == MOE_RANDOM_INT) { /* moe_randint_ checked the bounds; saturate for safety */
    ilow = moe_random_i64(a);
    ihigh = moe_random_i64(b);
    if (ihigh <= ilow)
      return moe_error(ctx, MOE_ERR_INVALID_ARG,
                       "cuda random: integer range [%lld, %lld) is empty", (long long)ilow,
                       (long long)ihigh);
  }
  if (n == 0) return MOE_OK;
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  cudaStream_t s = (cudaStream_t)stream;
  MoeGeom<1> g;
  moe_geom_init<1>(&g, v);
  if (kind == MOE_RANDOM_UNIFORM) {
    MoeUniformGen gen{seed, call, a, b - a, dst->dtype == MOE_F64};
    MOE_CHECK(moe_random_launch(ctx, dst, n, g, gen, s));
  } else if (kind == MOE_RANDOM_NORMAL) {
    MoeNormalGen gen{seed, call, a, b};
    MOE_CHECK(moe_random_launch(ctx, dst, n, g, gen, s));
  } else {
    MoeIntGen gen{seed, call, ilow, (uint64_t)ihigh - (uint64_t)ilow};
    MOE_CHECK(moe_random_launch(ctx, dst, n, g, gen, s));
  }
  MOE_CUDA_CHECK_LAUNCH(ctx, "cuda random kernel");
  return MOE_OK;
}
