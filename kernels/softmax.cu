/*
 * softmax.cu - CUDA launchers of softmax and log_softmax over the last dim
 * of contiguous rows, forward and backward (core/reduce_cuda.h): one row per
 * block, from registers when the row fits (kernels/rows.cuh), else through
 * shared memory or global memory.
 */
#include "common.cuh"
#include "reduce_cuda.h"
#include "rows.cuh"

#include <math.h>

template <moe_dtype DT, int NV, bool LOG>
__global__ void __launch_bounds__(MOE_REG_FWD_THREADS)
    moe_softmax_reg_kernel(const void *__restrict__ x, void *__restrict__ y, int64_t nvec) {
  using T = moe_st_t<DT>;
  constexpr int VW = MoeRow<DT>::VW;
  __shared__ float sh[32];
  int64_t off = (int64_t)blockIdx.x * nvec * VW;
  MoeRegRow<NV> r;
  moe_reg_load<NV>(r, (const T *)x + off, nvec);
  float m = -INFINITY;
#pragma unroll
  for (int q = 0; q < NV; q++)
    if (moe_reg_valid(q, nvec))
#pragma unroll
      for (int e = 0; e < VW; e++) m = fmaxf(m, moe_reg_at<DT, NV>(r, q, e));
  m = moe_block_max(m, sh);
  float s = 0.f;
#pragma unroll
  for (int q = 0; q < NV; q++)
    if (moe_reg_valid(q, nvec))
#pragma unroll
      for (int e = 0; e < VW; e++) s += __expf(moe_reg_at<DT, NV>(r, q, e) - m);
  s = moe_block_sum(s, sh);
  float ls = __logf(s), inv = 1.f / s;
  moe_reg_store<DT, NV>((T *)y + off, nvec, [&](int q, int e) {
    float v = moe_reg_at<DT, NV>(r, q, e) - m;
    return LOG ? v - ls : __expf(v) * inv;
  });
}

/* softmax / log_softmax of one row per block; cache: row in shared memory. */
template <moe_dtype DT, bool LOG>
__global__ void moe_softmax_kernel(const void *__restrict__ x, void *__restrict__ y, int64_t n,
                                   bool vec, bool cache) {
  using T = moe_st_t<DT>;
  extern __shared__ float moe_row_buf[];
  __shared__ float sh[64];
  const T *xr = (const T *)x + (int64_t)blockIdx.x * n;
  T *yr = (T *)y + (int64_t)blockIdx.x * n;
  float m = -INFINITY, s = 0.f;
  moe_row_read<DT>(xr, n, vec, [&](int64_t j, float v) {
    if (cache) moe_row_buf[j] = v;
    moe_ms_push(m, s, v);
  });
  moe_block_ms(m, s, sh);
  float ls = __logf(s), inv = 1.f / s;
  if (cache) __syncthreads();
  moe_row_write<DT>(yr, n, vec, [&](int64_t j) {
    float v = (cache ? moe_row_buf[j] : moe_load_as<float, DT>(xr[j])) - m;
    return LOG ? v - ls : __expf(v) * inv;
  });
}

/* gx = y * (g - sum(g y))  or  g - exp(y) sum(g). */
template <moe_dtype DT, bool LOG>
__global__ void moe_softmax_bwd_kernel(const void *__restrict__ y, const void *__restrict__ g,
                                       void *__restrict__ gx, int64_t n, bool vec) {
  using T = moe_st_t<DT>;
  __shared__ float sh[32];
  int64_t off = (int64_t)blockIdx.x * n;
  const T *yr = (const T *)y + off, *gr = (const T *)g + off;
  float acc = 0.f;
  if (LOG) {
    moe_row_read<DT>(gr, n, vec, [&](int64_t, float v) { acc += v; });
  } else {
    /* same partition for y and g: read both vector by vector */
    moe_row_read<DT>(gr, n, vec, [&](int64_t j, float v) { acc += v * moe_load_as<float, DT>(yr[j]); });
  }
  float tot = moe_block_sum(acc, sh);
  moe_row_write<DT>((T *)gx + off, n, vec, [&](int64_t j) {
    float yv = moe_load_as<float, DT>(yr[j]), gv = moe_load_as<float, DT>(gr[j]);
    return LOG ? gv - __expf(yv) * tot : yv * (gv - tot);
  });
}

extern "C" moe_status moe_cuda_softmax(moe_ctx *ctx, int device, bool log, const void *x, void *y,
                                       moe_dtype dt, int64_t rows, int64_t n) {
  if (rows == 0 || n == 0) return MOE_OK;
  MOE_CHECK(moe_rows_check(ctx, "cuda softmax", rows));
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  cudaStream_t s = (cudaStream_t)stream;
  return moe_row_dispatch(ctx, dt, "cuda softmax", [&](auto tag) -> moe_status {
    constexpr moe_dtype DT = decltype(tag)::value;
    bool vec = moe_row_vec<DT>(x, n) && moe_row_vec<DT>(y, n);
    unsigned th;
    int64_t nvec = n / MoeRow<DT>::VW;
    int nv = vec ? moe_reg_plan(nvec, 4, 128, MOE_REG_FWD_THREADS, &th) : 0;
    if (nv > 0)
      return moe_reg_nv(nv, [&](auto nvt) -> moe_status {
        constexpr int NV = decltype(nvt)::value;
        if (log) moe_softmax_reg_kernel<DT, NV, true><<<(unsigned)rows, th, 0, s>>>(x, y, nvec);
        else moe_softmax_reg_kernel<DT, NV, false><<<(unsigned)rows, th, 0, s>>>(x, y, nvec);
        MOE_CUDA_CHECK_LAUNCH(ctx, "cuda softmax kernel");
        return MOE_OK;
      });
    size_t bytes = (size_t)n * sizeof(float);
    bool cache = bytes <= MOE_ROW_CACHE_MAX;
    size_t smem = cache ? bytes : 0;
    th = moe_row_threads<DT>(n, vec);
    if (log) {
      if (smem > 48 * 1024)
        MOE_CUDA_CHECK(ctx, cudaFuncSetAttribute(moe_softmax_kernel<DT, true>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, MOE_ROW_CACHE_MAX));
      moe_softmax_kernel<DT, true><<<(unsigned)rows, th, smem, s>>>(x, y, n, vec, cache);
    } else {
      if (smem > 48 * 1024)
        MOE_CUDA_CHECK(ctx, cudaFuncSetAttribute(moe_softmax_kernel<DT, false>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, MOE_ROW_CACHE_MAX));
      moe_softmax_kernel<DT, false><<<(unsigned)rows, th, smem, s>>>(x, y, n, vec, cache);
    }
    MOE_CUDA_CHECK_LAUNCH(ctx, "cuda softmax kernel");
    return MOE_OK;
  });
}

extern "C" moe_status moe_cuda_softmax_backward(moe_ctx *ctx, int device, bool log, const void *y,
                                                const void *g, void *gx, moe_dtype dt, int64_t rows,
                                                int64_t n) {
  if (rows == 0 || n == 0) return MOE_OK;
  MOE_CHECK(moe_rows_check(ctx, "cuda softmax backward", rows));
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  cudaStream_t s = (cudaStream_t)stream;
  return moe_row_dispatch(ctx, dt, "cuda softmax backward", [&](auto tag) -> moe_status {
    constexpr moe_dtype DT = decltype(tag)::value;
    bool vec = moe_row_vec<DT>(y, n) && moe_row_vec<DT>(g, n) && moe_row_vec<DT>(gx, n);
    unsigned th = moe_row_threads<DT>(n, vec);
    if (log) moe_softmax_bwd_kernel<DT, true><<<(unsigned)rows, th, 0, s>>>(y, g, gx, n, vec);
    else moe_softmax_bwd_kernel<DT, false><<<(unsigned)rows, th, 0, s>>>(y, g, gx, n, vec);
    MOE_CUDA_CHECK_LAUNCH(ctx, "cuda softmax backward kernel");
    return MOE_OK;
  });
}
