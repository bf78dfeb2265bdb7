/*
 * norm.cu - CUDA launchers of layer_norm and rms_norm over the last dim,
 * forward and backward (core/reduce_cuda.h): one row per block forward (from
 * registers when the row fits, kernels/rows.cuh); the backward streams rows
 * through shared-memory stages by cp.async and sums the weight and bias
 * gradients through per-block partial rows in a fixed order (no atomics).
 */
#include "common.cuh"
#include "reduce_cuda.h"
#include "rows.cuh"

#include <math.h>

template <moe_dtype DT, int NV, bool RMS>
__global__ void __launch_bounds__(MOE_REG_FWD_THREADS)
    moe_norm_fwd_reg_kernel(const void *__restrict__ x, const void *__restrict__ w,
                            const void *__restrict__ b, void *__restrict__ y,
                            float *__restrict__ mean, float *__restrict__ rstd, int64_t nvec,
                            float eps) {
  using T = moe_st_t<DT>;
  constexpr int VW = MoeRow<DT>::VW;
  __shared__ float sh[32];
  int64_t row = blockIdx.x, n = nvec * VW, off = row * n;
  MoeRegRow<NV> r;
  moe_reg_load<NV>(r, (const T *)x + off, nvec);
  float s1 = 0.f;
#pragma unroll
  for (int q = 0; q < NV; q++)
#pragma unroll
    for (int e = 0; e < VW; e++) { /* padding is zero: adds nothing */
      float v = moe_reg_at<DT, NV>(r, q, e);
      s1 += RMS ? v * v : v;
    }
  float tot = moe_block_sum(s1, sh);
  float m = 0.f, rs;
  if (RMS) {
    rs = rsqrtf(tot / (float)n + eps);
  } else {
    m = tot / (float)n;
    float s2 = 0.f;
#pragma unroll
    for (int q = 0; q < NV; q++)
      if (moe_reg_valid(q, nvec))
#pragma unroll
        for (int e = 0; e < VW; e++) {
          float c = moe_reg_at<DT, NV>(r, q, e) - m;
          s2 += c * c;
        }
    rs = rsqrtf(moe_block_sum(s2, sh) / (float)n + eps);
  }
  MoeRegRow<NV> rw, rb;
  if (w) moe_reg_load<NV>(rw, w, nvec);
  if (b) moe_reg_load<NV>(rb, b, nvec);
  moe_reg_store<DT, NV>((T *)y + off, nvec, [&](int q, int e) {
    float v = (moe_reg_at<DT, NV>(r, q, e) - m) * rs;
    if (w) v *= moe_reg_at<DT, NV>(rw, q, e);
    if (b) v += moe_reg_at<DT, NV>(rb, q, e);
    return v;
  });
  if (threadIdx.x == 0) {
    if (mean) mean[row] = m;
    rstd[row] = rs;
  }
}

/* 16-byte asynchronous copy global -> shared (Ampere and later), its
 * group commit and wait for all but N groups. */
__device__ __forceinline__ void moe_cp16(void *sdst, const void *gsrc) {
  unsigned d = (unsigned)__cvta_generic_to_shared(sdst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(gsrc) : "memory");
}
__device__ __forceinline__ void moe_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void moe_cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

#define MOE_NB_STAGES 4 /* rows of x and g in flight per block (norm backward) */

/* Issues the thread's vectors of rows `row` of x and g into stage buffers
 * sx / sg (nothing past `rows`); always commits a group. */
template <int NV>
__device__ __forceinline__ void moe_nb_issue(uint4 *sx, uint4 *sg, const void *x, const void *g,
                                             int64_t row, int64_t rows, int64_t nvec) {
  if (row < rows) {
#pragma unroll
    for (int q = 0; q < NV; q++) {
      int64_t k = threadIdx.x + (int64_t)q * blockDim.x;
      if (k < nvec) {
        moe_cp16(sx + k, (const uint4 *)x + row * nvec + k);
        moe_cp16(sg + k, (const uint4 *)g + row * nvec + k);
      }
    }
  }
  moe_cp_commit();
}

/*
 * Norm backward, rows blockIdx.x, + gridDim.x, ...: rows of x and g stream
 * into MOE_NB_STAGES shared-memory stages by cp.async, MOE_NB_STAGES - 1
 * rows ahead of the one being worked on. Each thread copies and later reads
 * only its own vectors, so the stages need no barrier. Per row: the two
 * block sums (of g*w and g*w*xhat) in one reduction, then dx; the thread's
 * columns of dw (sum of g*xhat) and db (sum of g) accumulate in registers
 * over the block's rows in row order and go to the block's partial row
 * pw[blockIdx.x] / pb[blockIdx.x] at the end (summed by moe_colsum_kernel).
 * Dynamic shared memory: MOE_NB_STAGES * 2 * nvec * 16 bytes.
 */
template <moe_dtype DT, int NV, bool RMS>
__global__ void __launch_bounds__(MOE_REG_BWD_THREADS)
    moe_norm_bwd_reg_kernel(const void *__restrict__ x, const void *__restrict__ w,
                            const void *__restrict__ g, const float *__restrict__ mean,
                            const float *__restrict__ rstd, void *__restrict__ gx,
                            float *__restrict__ pw, float *__restrict__ pb, int64_t rows,
                            int64_t nvec) {
  using T = moe_st_t<DT>;
  constexpr int VW = MoeRow<DT>::VW;
  extern __shared__ uint4 moe_nb_buf[];
  __shared__ float sh[64];
  int64_t n = nvec * VW, step = gridDim.x;
  float inv_n = 1.f / (float)n;
  int64_t row = blockIdx.x;
#pragma unroll
  for (int st = 0; st < MOE_NB_STAGES - 1; st++) {
    uint4 *sx = moe_nb_buf + (int64_t)st * 2 * nvec;
    moe_nb_issue<NV>(sx, sx + nvec, x, g, row + st * step, rows, nvec);
  }
  MoeRegRow<NV> rw;
  if (w) moe_reg_load<NV>(rw, w, nvec);
  float aw[NV][VW], ab[NV][VW];
#pragma unroll
  for (int q = 0; q < NV; q++)
#pragma unroll
    for (int e = 0; e < VW; e++) aw[q][e] = 0.f, ab[q][e] = 0.f;
  float m = 0.f, rs = 0.f;
  if (row < rows) m = RMS ? 0.f : mean[row], rs = rstd[row];
  for (int it = 0; row < rows; row += step, it++) {
    {
      int st = (it + MOE_NB_STAGES - 1) % MOE_NB_STAGES; /* consumed at it - 1, by this thread */
      uint4 *sx = moe_nb_buf + (int64_t)st * 2 * nvec;
      moe_nb_issue<NV>(sx, sx + nvec, x, g, row + (MOE_NB_STAGES - 1) * step, rows, nvec);
    }
    int64_t next = row + step;
    float m_next = 0.f, rs_next = 0.f;
    if (next < rows) m_next = RMS ? 0.f : mean[next], rs_next = rstd[next];
    moe_cp_wait<MOE_NB_STAGES - 1>();
    const uint4 *sx = moe_nb_buf + (int64_t)(it % MOE_NB_STAGES) * 2 * nvec, *sg = sx + nvec;
    MoeRegRow<NV> cx, cg;
#pragma unroll
    for (int q = 0; q < NV; q++) {
      int64_t k = threadIdx.x + (int64_t)q * blockDim.x;
      cx.v[q] = k < nvec ? sx[k] : make_uint4(0u, 0u, 0u, 0u);
      cg.v[q] = k < nvec ? sg[k] : make_uint4(0u, 0u, 0u, 0u);
    }
    float sa = 0.f, sb = 0.f;
#pragma unroll
    for (int q = 0; q < NV; q++)
#pragma unroll
      for (int e = 0; e < VW; e++) { /* padding: g is zero, adds nothing */
        float gv = moe_reg_at<DT, NV>(cg, q, e);
        float h = (moe_reg_at<DT, NV>(cx, q, e) - m) * rs;
        float gh = w ? gv * moe_reg_at<DT, NV>(rw, q, e) : gv;
        sa += gh;
        sb += gh * h;
        aw[q][e] += gv * h;
        ab[q][e] += gv;
      }
    if (gx) {
      moe_block_sum2(sa, sb, sh);
      float ta = RMS ? 0.f : sa * inv_n, tb = sb * inv_n;
      moe_reg_store<DT, NV>((T *)gx + row * n, nvec, [&](int q, int e) {
        float gv = moe_reg_at<DT, NV>(cg, q, e);
        float h = (moe_reg_at<DT, NV>(cx, q, e) - m) * rs;
        float gh = w ? gv * moe_reg_at<DT, NV>(rw, q, e) : gv;
        return rs * (gh - ta - h * tb);
      });
    }
    m = m_next;
    rs = rs_next;
  }
  moe_cp_wait<0>();
#pragma unroll
  for (int q = 0; q < NV; q++) {
    int64_t k = threadIdx.x + (int64_t)q * blockDim.x;
    if (k >= nvec) continue;
    float *dw = pw ? pw + (int64_t)blockIdx.x * n + k * VW : NULL;
    float *db = pb ? pb + (int64_t)blockIdx.x * n + k * VW : NULL;
#pragma unroll
    for (int e = 0; e < VW; e += 4) {
      if (dw) *(float4 *)(dw + e) = make_float4(aw[q][e], aw[q][e + 1], aw[q][e + 2], aw[q][e + 3]);
      if (db) *(float4 *)(db + e) = make_float4(ab[q][e], ab[q][e + 1], ab[q][e + 2], ab[q][e + 3]);
    }
  }
}

/* -------------------------------------------------- layer_norm, rms_norm */

template <moe_dtype DT, bool RMS>
__global__ void moe_norm_fwd_kernel(const void *__restrict__ x, const void *__restrict__ w,
                                    const void *__restrict__ b, void *__restrict__ y,
                                    float *__restrict__ mean, float *__restrict__ rstd, int64_t n,
                                    float eps, bool vec, bool cache) {
  using T = moe_st_t<DT>;
  extern __shared__ float moe_row_buf[];
  __shared__ float sh[32];
  int64_t row = blockIdx.x;
  const T *xr = (const T *)x + row * n;
  float s1 = 0.f;
  moe_row_read<DT>(xr, n, vec, [&](int64_t j, float v) {
    if (cache) moe_row_buf[j] = v;
    s1 += RMS ? v * v : v;
  });
  float tot = moe_block_sum(s1, sh);
  float m = 0.f, r;
  if (RMS) {
    r = rsqrtf(tot / (float)n + eps);
  } else {
    m = tot / (float)n;
    float s2 = 0.f;
    if (cache) { /* block_sum synchronised: the whole row is in shared memory */
      for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
        float c = moe_row_buf[j] - m;
        s2 += c * c;
      }
    } else {
      moe_row_read<DT>(xr, n, vec, [&](int64_t, float v) { s2 += (v - m) * (v - m); });
    }
    r = rsqrtf(moe_block_sum(s2, sh) / (float)n + eps);
  }
  const T *wp = (const T *)w, *bp = (const T *)b;
  moe_row_write<DT>((T *)y + row * n, n, vec, [&](int64_t j) {
    float v = ((cache ? moe_row_buf[j] : moe_load_as<float, DT>(xr[j])) - m) * r;
    if (wp) v *= moe_load_as<float, DT>(wp[j]);
    if (bp) v += moe_load_as<float, DT>(bp[j]);
    return v;
  });
  if (threadIdx.x == 0) {
    if (mean) mean[row] = m;
    rstd[row] = r;
  }
}

extern "C" moe_status moe_cuda_norm_forward(moe_ctx *ctx, int device, bool rms, const void *x,
                                            const void *w, const void *b, void *y, float *mean,
                                            float *rstd, moe_dtype dt, int64_t rows, int64_t n,
                                            double eps) {
  if (rows == 0 || n == 0) return MOE_OK;
  MOE_CHECK(moe_rows_check(ctx, "cuda norm", rows));
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  cudaStream_t s = (cudaStream_t)stream;
  return moe_row_dispatch(ctx, dt, rms ? "cuda rms_norm" : "cuda layer_norm", [&](auto tag) -> moe_status {
    constexpr moe_dtype DT = decltype(tag)::value;
    bool vec = moe_row_vec<DT>(x, n) && moe_row_vec<DT>(y, n);
    unsigned th;
    int64_t nvec = n / MoeRow<DT>::VW;
    int nv = vec && (!w || moe_aligned(w, 16)) && (!b || moe_aligned(b, 16))
                 ? moe_reg_plan(nvec, 4, 128, MOE_REG_FWD_THREADS, &th)
                 : 0;
    if (nv > 0)
      return moe_reg_nv(nv, [&](auto nvt) -> moe_status {
        constexpr int NV = decltype(nvt)::value;
        float e = (float)eps;
        if (rms) moe_norm_fwd_reg_kernel<DT, NV, true><<<(unsigned)rows, th, 0, s>>>(x, w, b, y, mean, rstd, nvec, e);
        else moe_norm_fwd_reg_kernel<DT, NV, false><<<(unsigned)rows, th, 0, s>>>(x, w, b, y, mean, rstd, nvec, e);
        MOE_CUDA_CHECK_LAUNCH(ctx, rms ? "cuda rms_norm kernel" : "cuda layer_norm kernel");
        return MOE_OK;
      });
    size_t bytes = (size_t)n * sizeof(float);
    bool cache = bytes <= MOE_ROW_CACHE_MAX;
    size_t smem = cache ? bytes : 0;
    th = moe_row_threads<DT>(n, vec);
    if (rms) {
      if (smem > 48 * 1024)
        MOE_CUDA_CHECK(ctx, cudaFuncSetAttribute(moe_norm_fwd_kernel<DT, true>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, MOE_ROW_CACHE_MAX));
      moe_norm_fwd_kernel<DT, true><<<(unsigned)rows, th, smem, s>>>(x, w, b, y, mean, rstd, n,
                                                                      (float)eps, vec, cache);
    } else {
      if (smem > 48 * 1024)
        MOE_CUDA_CHECK(ctx, cudaFuncSetAttribute(moe_norm_fwd_kernel<DT, false>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, MOE_ROW_CACHE_MAX));
      moe_norm_fwd_kernel<DT, false><<<(unsigned)rows, th, smem, s>>>(x, w, b, y, mean, rstd, n,
                                                                       (float)eps, vec, cache);
    }
    MOE_CUDA_CHECK_LAUNCH(ctx, rms ? "cuda rms_norm kernel" : "cuda layer_norm kernel");
    return MOE_OK;
  });
}

/*
 * Backward: block k takes rows k, k + grid, ...; per row two block sums
 * (mean of g*w and of g*w*xhat) then dx; the weight / bias gradient of its
 * rows goes to its own partial row part[k] (columns owned by threads, so no
 * races); a second kernel sums the partial rows in block order.
 */
template <moe_dtype DT, bool RMS>
__global__ void moe_norm_bwd_kernel(const void *__restrict__ x, const void *__restrict__ w,
                                    const void *__restrict__ g, const float *__restrict__ mean,
                                    const float *__restrict__ rstd, void *__restrict__ gx,
                                    float *__restrict__ pw, float *__restrict__ pb, int64_t rows,
                                    int64_t n) {
  using T = moe_st_t<DT>;
  __shared__ float sh[32];
  const T *wp = (const T *)w;
  float *pwr = pw ? pw + (int64_t)blockIdx.x * n : NULL, *pbr = pb ? pb + (int64_t)blockIdx.x * n : NULL;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    if (pwr) pwr[j] = 0.f;
    if (pbr) pbr[j] = 0.f;
  }
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T *xr = (const T *)x + row * n, *gr = (const T *)g + row * n;
    float m = RMS ? 0.f : mean[row], r = rstd[row];
    float sa = 0.f, sb = 0.f;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      float xv = moe_load_as<float, DT>(xr[j]), gv = moe_load_as<float, DT>(gr[j]);
      float h = (xv - m) * r;
      float gh = wp ? gv * moe_load_as<float, DT>(wp[j]) : gv;
      sa += gh;
      sb += gh * h;
      if (pwr) pwr[j] += gv * h;
      if (pbr) pbr[j] += gv;
    }
    if (gx) {
      float ta = RMS ? 0.f : moe_block_sum(sa, sh) / (float)n;
      float tb = moe_block_sum(sb, sh) / (float)n;
      T *gxr = (T *)gx + row * n;
      for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
        float xv = moe_load_as<float, DT>(xr[j]), gv = moe_load_as<float, DT>(gr[j]);
        float h = (xv - m) * r;
        float gh = wp ? gv * moe_load_as<float, DT>(wp[j]) : gv;
        gxr[j] = moe_store_from<DT, float>(r * (gh - ta - h * tb));
      }
    }
  }
}

/* out[j] = sum over k of part[k * n + j]: block (32, 8) takes 32 columns;
 * thread row ty sums partial rows ty, ty + 8, ... in order, then a fixed
 * tree over ty (deterministic). */
#define MOE_COLSUM_Y 8
template <moe_dtype DT>
__global__ void moe_colsum_kernel(const float *__restrict__ part, int64_t nblk, int64_t n,
                                  void *__restrict__ out) {
  __shared__ float sh[MOE_COLSUM_Y][33];
  int tx = threadIdx.x, ty = threadIdx.y;
  int64_t j = (int64_t)blockIdx.x * 32 + tx;
  float s = 0.f;
  if (j < n) {
    int64_t k = ty;
    for (; k + 3 * MOE_COLSUM_Y < nblk; k += 4 * MOE_COLSUM_Y) {
      float a = part[k * n + j], b = part[(k + MOE_COLSUM_Y) * n + j];
      float c = part[(k + 2 * MOE_COLSUM_Y) * n + j], d = part[(k + 3 * MOE_COLSUM_Y) * n + j];
      s += a;
      s += b;
      s += c;
      s += d;
    }
    for (; k < nblk; k += MOE_COLSUM_Y) s += part[k * n + j];
  }
  sh[ty][tx] = s;
  __syncthreads();
  for (int h = MOE_COLSUM_Y / 2; h > 0; h >>= 1) {
    if (ty < h) sh[ty][tx] += sh[ty + h][tx];
    __syncthreads();
  }
  if (ty == 0 && j < n) ((moe_st_t<DT> *)out)[j] = moe_store_from<DT, float>(sh[0][tx]);
}

extern "C" moe_status moe_cuda_norm_backward(moe_ctx *ctx, int device, bool rms, const void *x,
                                             const void *w, const void *g, const float *mean,
                                             const float *rstd, void *gx, void *gw, void *gb,
                                             moe_dtype dt, int64_t rows, int64_t n) {
  if (n == 0) return MOE_OK;
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  cudaStream_t s = (cudaStream_t)stream;
  int sms = moe_red_sm_count(device);
  MoeScratch partial(ctx, device); /* the blocks' partial rows of dw and db */
  int np = (gw ? 1 : 0) + (gb ? 1 : 0);
  moe_status st = moe_row_dispatch(ctx, dt, rms ? "cuda rms_norm backward" : "cuda layer_norm backward",
                                   [&](auto tag) -> moe_status {
    constexpr moe_dtype DT = decltype(tag)::value;
    /* register path: rows of at most 2 vectors per thread of 512 */
    bool vec = moe_row_vec<DT>(x, n) && moe_row_vec<DT>(g, n) && (!gx || moe_row_vec<DT>(gx, n)) &&
               (!w || moe_aligned(w, 16));
    unsigned th = 0;
    int64_t nvec = n / MoeRow<DT>::VW;
    int nv = vec ? moe_reg_plan(nvec, 2, MOE_REG_BWD_THREADS, MOE_REG_BWD_THREADS, &th) : 0;
    const void *kfn = NULL;
    if (nv == 1) kfn = rms ? (const void *)moe_norm_bwd_reg_kernel<DT, 1, true> : (const void *)moe_norm_bwd_reg_kernel<DT, 1, false>;
    else if (nv == 2) kfn = rms ? (const void *)moe_norm_bwd_reg_kernel<DT, 2, true> : (const void *)moe_norm_bwd_reg_kernel<DT, 2, false>;
    else th = moe_row_threads<DT>(n, false);
    /* blocks: as many as are resident at once (register path) or two per SM,
     * at most a quarter of the rows (so blocks of many rows amortise their
     * partial row); without column sums, a block per row */
    int64_t nblk = 2LL * sms;
    size_t smem = (size_t)MOE_NB_STAGES * 2 * (size_t)nvec * 16;
    if (kfn) {
      int per = 0;
      if (smem > 48 * 1024)
        MOE_CUDA_CHECK(ctx, cudaFuncSetAttribute(kfn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
      MOE_CUDA_CHECK(ctx, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, kfn, (int)th, smem));
      nblk = (int64_t)(per > 0 ? per : 1) * sms;
      int64_t q = (rows + 3) / 4;
      if (np > 0 && nblk > q) nblk = q;
    }
    if (np == 0) nblk = rows;
    if (nblk > rows) nblk = rows;
    if (nblk > 0x7fffffffLL) nblk = 0x7fffffffLL;
    float *pw = NULL, *pb = NULL;
    if (np > 0 && nblk > 0) {
      MOE_CHECK(partial.alloc(sizeof(float) * (size_t)(nblk * n * np)));
      pw = gw ? (float *)partial.ptr : NULL;
      pb = gb ? (float *)partial.ptr + (gw ? nblk * n : 0) : NULL;
    }
    if (nblk > 0) {
      unsigned gb_ = (unsigned)nblk;
      if (nv == 1) {
        if (rms) moe_norm_bwd_reg_kernel<DT, 1, true><<<gb_, th, smem, s>>>(x, w, g, mean, rstd, gx, pw, pb, rows, nvec);
        else moe_norm_bwd_reg_kernel<DT, 1, false><<<gb_, th, smem, s>>>(x, w, g, mean, rstd, gx, pw, pb, rows, nvec);
      } else if (nv == 2) {
        if (rms) moe_norm_bwd_reg_kernel<DT, 2, true><<<gb_, th, smem, s>>>(x, w, g, mean, rstd, gx, pw, pb, rows, nvec);
        else moe_norm_bwd_reg_kernel<DT, 2, false><<<gb_, th, smem, s>>>(x, w, g, mean, rstd, gx, pw, pb, rows, nvec);
      } else if (rms) {
        moe_norm_bwd_kernel<DT, true><<<gb_, th, 0, s>>>(x, w, g, mean, rstd, gx, pw, pb, rows, n);
      } else {
        moe_norm_bwd_kernel<DT, false><<<gb_, th, 0, s>>>(x, w, g, mean, rstd, gx, pw, pb, rows, n);
      }
    }
    dim3 cblk(32, MOE_COLSUM_Y);
    unsigned cb = (unsigned)((n + 31) / 32);
    if (gw) {
      if (nblk > 0) moe_colsum_kernel<DT><<<cb, cblk, 0, s>>>(pw, nblk, n, gw);
      else MOE_CUDA_CHECK(ctx, cudaMemsetAsync(gw, 0, (size_t)n * sizeof(moe_st_t<DT>), s));
    }
    if (gb) {
      if (nblk > 0) moe_colsum_kernel<DT><<<cb, cblk, 0, s>>>(pb, nblk, n, gb);
      else MOE_CUDA_CHECK(ctx, cudaMemsetAsync(gb, 0, (size_t)n * sizeof(moe_st_t<DT>), s));
    }
    MOE_CUDA_CHECK_LAUNCH(ctx, "cuda norm backward kernel");
    return MOE_OK;
  });
  partial.release();
  return st;
}
