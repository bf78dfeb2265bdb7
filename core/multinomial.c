/*
 * multinomial.c - sampling category indices from rows of weights
 * (moe_index.h), with or without replacement, from the context's Philox
 * stream (one call per op). The CPU reference here and the CUDA one behind
 * moe_cuda_multinomial (index_cuda.h, kernels/index.cu) draw the same
 * indices: the draw order is written in moe_index.h.
 */
#include <math.h>
#include <stdlib.h>

#include "index_cuda.h"
#include "index_util.h"
#include "internal.h"
#include "philox.h"

/* -------------------------------------------------------- multinomial */

#define MN_CHUNKS 256

/* prefix[0..256] of the chunk sums of w (C weights, zeroed where taken). */
static void mn_prefix(const double *part, double *prefix) {
  prefix[0] = 0;
  for (int t = 0; t < MN_CHUNKS; t++) prefix[t + 1] = prefix[t] + part[t];
}

/* The draw for target: the first category whose running sum exceeds it;
 * when rounding leaves none, the last category of positive weight. */
static int64_t mn_pick(const double *w, int64_t C, int64_t cs, const double *prefix,
                          double target) {
  for (int t = 0; t < MN_CHUNKS; t++) {
    if (!(prefix[t + 1] > target)) continue;
    double acc = prefix[t];
    int64_t lo = (int64_t)t * cs, hi = lo + cs < C ? lo + cs : C;
    for (int64_t j = lo; j < hi; j++) {
      acc += w[j];
      if (acc > target) return j;
    }
    break;
  }
  for (int64_t j = C - 1; j >= 0; j--)
    if (w[j] > 0) return j;
  return 0;
}

static double mn_chunk_sum(const double *w, int64_t C, int64_t cs, int t) {
  double acc = 0;
  int64_t lo = (int64_t)t * cs, hi = lo + cs < C ? lo + cs : C;
  for (int64_t j = lo; j < hi; j++) acc += w[j];
  return acc;
}

moe_status moe_multinomial(moe_ctx *ctx, moe_tensor *probs, int64_t num_samples,
                           bool replacement, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  const char *fn = "multinomial";
  MOE_CHECK(ix_null(ctx, fn, "probs", probs));
  MOE_CHECK(ix_null(ctx, fn, "out", out));
  if (probs->dtype != MOE_F32 && probs->dtype != MOE_F64 && probs->dtype != MOE_BF16 &&
      probs->dtype != MOE_F16)
    return moe_error(ctx, MOE_ERR_DTYPE, "%s: probs must be f32, f64, bf16 or f16, got %s", fn,
                     moe_dtype_name(probs->dtype));
  if ((probs->ndim != 1 && probs->ndim != 2) || probs->shape[probs->ndim - 1] == 0)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: probs must be (N, C) or (C) with C >= 1, got %s", fn,
                     MOE_SHAPE(probs));
  int64_t C = probs->shape[probs->ndim - 1], N = probs->ndim == 2 ? probs->shape[0] : 1;
  if (num_samples < 0 || (!replacement && num_samples > C))
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "%s: num_samples = %lld must be in [0, %lld]%s", fn, (long long)num_samples,
                     (long long)(replacement ? INT64_MAX : C),
                     replacement ? "" : " without replacement (C categories)");
  MOE_CHECK(moe_device_check(ctx, probs->storage->device));
  int64_t oshape[2] = {N, num_samples};
  moe_tensor *r;
  MOE_CHECK(moe_tensor_empty(ctx, probs->ndim, probs->ndim == 2 ? oshape : oshape + 1, MOE_I64,
                             probs->storage->device, &r));
  uint64_t seed = ctx->rng_seed, call = ctx->rng_call;
  moe_status st = MOE_OK;
  if (N * num_samples > 0 && ix_cuda(probs)) {
    moe_kview vp = moe_kview_of(probs);
    if (vp.ndim == 1) { /* as (1, C) */
      vp.ndim = 2;
      vp.shape[1] = vp.shape[0], vp.stride[1] = vp.stride[0];
      vp.shape[0] = 1, vp.stride[0] = 0;
    }
    st = moe_cuda_multinomial(ctx, probs->storage->device.index, (int64_t *)moe_tensor_data(r), &vp,
                              num_samples, replacement, seed, call);
  } else if (N * num_samples > 0) {
    double *w = (double *)malloc(sizeof(double) * (size_t)C);
    if (!w) st = moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: no memory for a row of %lld", fn, (long long)C);
    int64_t cs = (C + MN_CHUNKS - 1) / MN_CHUNKS;
    int64_t *po = (int64_t *)moe_tensor_data(r);
    const char *pp = (const char *)moe_tensor_data(probs);
    size_t es = moe_dtype_size(probs->dtype);
    int64_t rs = probs->ndim == 2 ? probs->stride[0] : 0, cst = probs->stride[probs->ndim - 1];
    double part[MN_CHUNKS], prefix[MN_CHUNKS + 1];
    for (int64_t row = 0; row < N && st == MOE_OK; row++) {
      int64_t nonzero = 0;
      for (int64_t j = 0; j < C; j++) {
        w[j] = moe_load_f64(pp + (row * rs + j * cst) * (int64_t)es, probs->dtype);
        if (!(w[j] >= 0) || isinf(w[j])) {
          st = moe_error(ctx, MOE_ERR_INVALID_ARG,
                         "%s: probs[%lld, %lld] = %g: weights must be finite and >= 0", fn,
                         (long long)row, (long long)j, w[j]);
          break;
        }
        nonzero += w[j] > 0;
      }
      if (st != MOE_OK) break;
      if (nonzero == 0 || (!replacement && nonzero < num_samples)) {
        st = moe_error(ctx, MOE_ERR_INVALID_ARG,
                       "%s: row %lld has %lld non-zero weights, fewer than %s", fn, (long long)row,
                       (long long)nonzero, nonzero == 0 ? "one" : "num_samples without replacement");
        break;
      }
      for (int t = 0; t < MN_CHUNKS; t++) part[t] = mn_chunk_sum(w, C, cs, t);
      mn_prefix(part, prefix);
      for (int64_t s = 0; s < num_samples; s++) {
        double u = moe_philox_uniform53(seed, call, (uint64_t)(row * num_samples + s));
        int64_t j = mn_pick(w, C, cs, prefix, u * prefix[MN_CHUNKS]);
        po[row * num_samples + s] = j;
        if (!replacement) { /* j leaves the urn: its chunk is summed again */
          w[j] = 0;
          int t = (int)(j / cs);
          part[t] = mn_chunk_sum(w, C, cs, t);
          mn_prefix(part, prefix);
        }
      }
    }
    free(w);
  }
  if (st != MOE_OK) {
    moe_tensor_release(r);
    return st;
  }
  ctx->rng_call++;
  *out = r;
  return MOE_OK;
}
