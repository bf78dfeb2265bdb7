/*
 * loss.cu - CUDA launchers of cross_entropy (core/reduce_cuda.h): the loss
 * and log-sum-exp per row (one row per block, from registers when the row
 * fits, kernels/rows.cuh; label smoothing, ignored targets, bad targets
 * reported through kerr.h), their reduction to a mean or sum, and the
 * backward.
 */
#include "common.cuh"
#include "reduce_cuda.h"
#include "rows.cuh"

#include <math.h>

/* cross_entropy forward of one row per block from registers: max, sum of
 * exps, sum of logits (label smoothing); the target's logit from memory. */
template <moe_dtype DT, int NV>
__global__ void __launch_bounds__(MOE_REG_FWD_THREADS)
    moe_ce_fwd_reg_kernel(const void *__restrict__ logits, const int64_t *__restrict__ target,
                          float *__restrict__ loss, float *__restrict__ lse, int64_t nvec,
                          int64_t ignore, float smooth, moe_kerr *kerr, int kerr_tag) {
  using T = moe_st_t<DT>;
  constexpr int VW = MoeRow<DT>::VW;
  __shared__ float sh[32];
  int64_t row = blockIdx.x, n = nvec * VW;
  const T *xr = (const T *)logits + row * n;
  MoeRegRow<NV> r;
  moe_reg_load<NV>(r, xr, nvec);
  float m = -INFINITY, sx = 0.f;
#pragma unroll
  for (int q = 0; q < NV; q++)
    if (moe_reg_valid(q, nvec))
#pragma unroll
      for (int e = 0; e < VW; e++) {
        float v = moe_reg_at<DT, NV>(r, q, e);
        m = fmaxf(m, v);
        sx += v;
      }
  m = moe_block_max(m, sh);
  float s = 0.f;
#pragma unroll
  for (int q = 0; q < NV; q++)
    if (moe_reg_valid(q, nvec))
#pragma unroll
      for (int e = 0; e < VW; e++) s += __expf(moe_reg_at<DT, NV>(r, q, e) - m);
  s = moe_block_sum(s, sh);
  float tsx = smooth != 0.f ? moe_block_sum(sx, sh) : 0.f;
  if (threadIdx.x == 0) {
    float l = m + __logf(s);
    int64_t t = target[row];
    float out = 0.f;
    if (t != ignore) {
      if (t < 0 || t >= n) { /* out of range: NaN, and an error at the next sync */
        out = NAN;
        moe_kerr_report(kerr, kerr_tag, t, n);
      } else out = l - (1.f - smooth) * moe_load_as<float, DT>(xr[t]) - smooth * tsx / (float)n;
    }
    loss[row] = out;
    lse[row] = l;
  }
}

/* ------------------------------------------------------- cross_entropy */

/* One row per block, one pass: online (max, sum exp), sum of logits (for
 * label smoothing) and the target's logit. */
template <moe_dtype DT>
__global__ void moe_ce_fwd_kernel(const void *__restrict__ logits, const int64_t *__restrict__ target,
                                  float *__restrict__ loss, float *__restrict__ lse, int64_t n,
                                  int64_t ignore, float smooth, bool vec, moe_kerr *kerr,
                                  int kerr_tag) {
  using T = moe_st_t<DT>;
  __shared__ float sh[64];
  int64_t row = blockIdx.x;
  const T *xr = (const T *)logits + row * n;
  float m = -INFINITY, s = 0.f, sx = 0.f;
  moe_row_read<DT>(xr, n, vec, [&](int64_t, float v) {
    moe_ms_push(m, s, v);
    sx += v;
  });
  moe_block_ms(m, s, sh);
  float tsx = smooth != 0.f ? moe_block_sum(sx, sh) : 0.f;
  if (threadIdx.x == 0) {
    float l = m + __logf(s);
    int64_t t = target[row];
    float out = 0.f;
    if (t != ignore) {
      if (t < 0 || t >= n) { /* out of range: NaN, and an error at the next sync */
        out = NAN;
        moe_kerr_report(kerr, kerr_tag, t, n);
      } else out = l - (1.f - smooth) * moe_load_as<float, DT>(xr[t]) - smooth * tsx / (float)n;
    }
    loss[row] = out;
    lse[row] = l;
  }
}

extern "C" moe_status moe_cuda_cross_entropy(moe_ctx *ctx, int device, const void *logits,
                                             const int64_t *target, float *loss, float *lse,
                                             moe_dtype dt, int64_t rows, int64_t n,
                                             int64_t ignore_index, double smoothing) {
  if (rows == 0) return MOE_OK;
  MOE_CHECK(moe_rows_check(ctx, "cuda cross_entropy", rows));
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  cudaStream_t s = (cudaStream_t)stream;
  int ktag = 0;
  moe_kerr *kerr = (moe_kerr *)moe_cuda_kerr(ctx, device, "cross_entropy (target)", &ktag);
  return moe_row_dispatch(ctx, dt, "cuda cross_entropy", [&](auto tag) -> moe_status {
    constexpr moe_dtype DT = decltype(tag)::value;
    bool vec = moe_row_vec<DT>(logits, n);
    unsigned th;
    int64_t nvec = n / MoeRow<DT>::VW;
    int nv = vec ? moe_reg_plan(nvec, 4, 128, MOE_REG_FWD_THREADS, &th) : 0;
    if (nv > 0)
      return moe_reg_nv(nv, [&](auto nvt) -> moe_status {
        constexpr int NV = decltype(nvt)::value;
        moe_ce_fwd_reg_kernel<DT, NV><<<(unsigned)rows, th, 0, s>>>(
            logits, target, loss, lse, nvec, ignore_index, (float)smoothing, kerr, ktag);
        MOE_CUDA_CHECK_LAUNCH(ctx, "cuda cross_entropy kernel");
        return MOE_OK;
      });
    th = moe_row_threads<DT>(n, vec);
    moe_ce_fwd_kernel<DT><<<(unsigned)rows, th, 0, s>>>(logits, target, loss, lse, n, ignore_index,
                                                        (float)smoothing, vec, kerr, ktag);
    MOE_CUDA_CHECK_LAUNCH(ctx, "cuda cross_entropy kernel");
    return MOE_OK;
  });
}

/* One block: sum of the per-row losses (in row order per thread, then a
 * fixed tree) and the count of non-ignored rows. */
template <moe_dtype OD>
__global__ void moe_ce_reduce_kernel(const float *__restrict__ loss, const int64_t *__restrict__ target,
                                     int64_t rows, int64_t ignore, bool mean, void *out,
                                     float *count) {
  __shared__ float sh[32];
  float s = 0.f, c = 0.f;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    s += loss[r];
    c += target[r] != ignore ? 1.f : 0.f;
  }
  s = moe_block_sum(s, sh);
  c = moe_block_sum(c, sh);
  if (threadIdx.x == 0) {
    *count = c;
    ((moe_st_t<OD> *)out)[0] = moe_store_from<OD, float>(mean ? s / c : s);
  }
}

extern "C" moe_status moe_cuda_cross_entropy_reduce(moe_ctx *ctx, int device, const float *loss,
                                                    const int64_t *target, int64_t rows,
                                                    int64_t ignore_index, bool mean, void *out,
                                                    moe_dtype odt, float *count) {
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  cudaStream_t s = (cudaStream_t)stream;
  return moe_row_dispatch(ctx, odt, "cuda cross_entropy", [&](auto tag) -> moe_status {
    constexpr moe_dtype OD = decltype(tag)::value;
    moe_ce_reduce_kernel<OD><<<1, 1024, 0, s>>>(loss, target, rows, ignore_index, mean, out, count);
    MOE_CUDA_CHECK_LAUNCH(ctx, "cuda cross_entropy reduce kernel");
    return MOE_OK;
  });
}

template <moe_dtype DT>
__global__ void moe_ce_bwd_kernel(const void *__restrict__ logits, const int64_t *__restrict__ target,
                                  const float *__restrict__ lse, const void *g, moe_dtype gdt,
                                  bool per_row, const float *count, void *__restrict__ gx,
                                  int64_t n, int64_t ignore, float smooth, bool vec) {
  using T = moe_st_t<DT>;
  int64_t row = blockIdx.x;
  int64_t t = target[row];
  float gs = moe_dyn_load<float>(g, gdt, per_row ? row : 0);
  if (count) gs /= *count;
  if (t == ignore) gs = 0.f;
  float l = lse[row], off = smooth / (float)n, hit = 1.f - smooth;
  const T *xr = (const T *)logits + row * n;
  T *gr = (T *)gx + row * n;
  if (vec) {
    constexpr int VW = MoeRow<DT>::VW;
    int64_t nv = n / VW;
    for (int64_t k = threadIdx.x; k < nv; k += blockDim.x) {
      uint4 u = __ldg((const uint4 *)xr + k), o;
      const T *e = (const T *)&u;
      T *eo = (T *)&o;
#pragma unroll
      for (int q = 0; q < VW; q++) {
        int64_t j = k * VW + q;
        float p = __expf(moe_load_as<float, DT>(e[q]) - l);
        eo[q] = moe_store_from<DT, float>(gs * (p - (j == t ? hit : 0.f) - off));
      }
      ((uint4 *)gr)[k] = o;
    }
  } else {
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      float p = __expf(moe_load_as<float, DT>(xr[j]) - l);
      gr[j] = moe_store_from<DT, float>(gs * (p - (j == t ? hit : 0.f) - off));
    }
  }
}

extern "C" moe_status moe_cuda_cross_entropy_backward(moe_ctx *ctx, int device, const void *logits,
                                                      const int64_t *target, const float *lse,
                                                      const void *g, moe_dtype gdt, bool per_row,
                                                      const float *count, void *gx, moe_dtype dt,
                                                      int64_t rows, int64_t n, int64_t ignore_index,
                                                      double smoothing) {
  if (rows == 0 || n == 0) return MOE_OK;
  MOE_CHECK(moe_rows_check(ctx, "cuda cross_entropy backward", rows));
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  cudaStream_t s = (cudaStream_t)stream;
  return moe_row_dispatch(ctx, dt, "cuda cross_entropy backward", [&](auto tag) -> moe_status {
    constexpr moe_dtype DT = decltype(tag)::value;
    bool vec = moe_row_vec<DT>(logits, n) && moe_row_vec<DT>(gx, n);
    unsigned th = moe_row_threads<DT>(n, vec);
    moe_ce_bwd_kernel<DT><<<(unsigned)rows, th, 0, s>>>(logits, target, lse, g, gdt, per_row, count,
                                                        gx, n, ignore_index, (float)smoothing, vec);
    MOE_CUDA_CHECK_LAUNCH(ctx, "cuda cross_entropy backward kernel");
    return MOE_OK;
  });
}
