/*
 * rows.cuh - the row machinery the row-wise CUDA kernels share (private to
 * kernels/softmax.cu, norm.cu, loss.cu, and reduce.cu for its helpers): a
 * row per block, read by 16-byte vectors when aligned (MoeRow), warp and
 * block sums and maxima, the online (max, sum of exps) merge, the
 * register-resident fast path (MoeRegRow: a row held in registers), the
 * launch plans (threads, vectors per thread) and the dtype dispatch of the
 * launchers (f32, bf16, f16). Determinism: every sum here is a fixed tree.
 */
#ifndef MOE_KERNELS_ROWS_CUH
#define MOE_KERNELS_ROWS_CUH

#include "common.cuh"

/* ------------------------------------------------------------ helpers */

static inline int moe_red_sm_count(int device) {
  static int cached[MOE_MAX_CUDA_DEVICES];
  if (device < 0 || device >= MOE_MAX_CUDA_DEVICES) return 132;
  if (cached[device] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n <= 0) {
      (void)cudaGetLastError();
      n = 132;
    }
    cached[device] = n;
  }
  return cached[device];
}

static inline unsigned moe_pow2_ceil(int64_t v) {
  unsigned p = 1;
  while ((int64_t)p < v && p < (1u << 30)) p <<= 1;
  return p;
}

/* ------------------------------------------------------ row kernels */
/*
 * One block per row of a contiguous (rows, n) tensor. Rows are read with
 * 16-byte vector loads when n is a multiple of the vector width and the
 * base is aligned (then every row is); otherwise element by element. Rows
 * short enough are cached in shared memory as float, so each is read from
 * global memory once.
 */

#define MOE_ROW_THREADS 256
#define MOE_ROW_CACHE_MAX (96 * 1024) /* bytes of dynamic shared memory per block at most */

template <moe_dtype DT> struct MoeRow {
  using T = moe_st_t<DT>;
  static constexpr int VW = 16 / (int)sizeof(T);
};

/* f(j, v) for every element j of row xr (thread-strided). */
template <moe_dtype DT, typename F>
__device__ __forceinline__ void moe_row_read(const moe_st_t<DT> *__restrict__ xr, int64_t n,
                                             bool vec, F &&f) {
  using T = moe_st_t<DT>;
  constexpr int VW = MoeRow<DT>::VW;
  if (vec) {
    int64_t nv = n / VW;
    for (int64_t k = threadIdx.x; k < nv; k += blockDim.x) {
      uint4 u = __ldg((const uint4 *)xr + k);
      const T *e = (const T *)&u;
#pragma unroll
      for (int q = 0; q < VW; q++) f(k * VW + q, moe_load_as<float, DT>(e[q]));
    }
  } else {
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) f(j, moe_load_as<float, DT>(xr[j]));
  }
}

/* yr[j] = f(j) for every element (thread-strided, same partition as read). */
template <moe_dtype DT, typename F>
__device__ __forceinline__ void moe_row_write(moe_st_t<DT> *__restrict__ yr, int64_t n, bool vec,
                                              F &&f) {
  using T = moe_st_t<DT>;
  constexpr int VW = MoeRow<DT>::VW;
  if (vec) {
    int64_t nv = n / VW;
    for (int64_t k = threadIdx.x; k < nv; k += blockDim.x) {
      uint4 u;
      T *e = (T *)&u;
#pragma unroll
      for (int q = 0; q < VW; q++) e[q] = moe_store_from<DT, float>(f(k * VW + q));
      ((uint4 *)yr)[k] = u;
    }
  } else {
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) yr[j] = moe_store_from<DT, float>(f(j));
  }
}

__device__ __forceinline__ float moe_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float moe_warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

/* Sum over the block (every thread gets it); sh: 32 floats of shared memory. */
__device__ __forceinline__ float moe_block_sum(float v, float *sh) {
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = moe_warp_sum(v);
  __syncthreads(); /* sh may still be read from a previous call */
  if (lane == 0) sh[w] = v;
  __syncthreads();
  v = lane < nw ? sh[lane] : 0.f;
  return moe_warp_sum(v);
}

/* Online (max, sum exp) pairs combined over the block. */
__device__ __forceinline__ void moe_ms_merge(float &m, float &s, float m2, float s2) {
  if (m2 > m) {
    s = s * __expf(m - m2) + s2;
    m = m2;
  } else if (m2 == m) {
    s += s2;
  } else {
    s += s2 * __expf(m2 - m);
  }
}

__device__ __forceinline__ void moe_block_ms(float &m, float &s, float *sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    moe_ms_merge(m, s, m2, s2);
  }
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  __syncthreads();
  if (lane == 0) sh[w] = m, sh[32 + w] = s;
  __syncthreads();
  m = lane < nw ? sh[lane] : -INFINITY;
  s = lane < nw ? sh[32 + lane] : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    moe_ms_merge(m, s, m2, s2);
  }
}

__device__ __forceinline__ void moe_ms_push(float &m, float &s, float v) {
  if (v > m) {
    s = s * __expf(m - v) + 1.f;
    m = v;
  } else if (v == m) {
    s += 1.f;
  } else {
    s += __expf(v - m);
  }
}

template <moe_dtype DT> static inline bool moe_row_vec(const void *p, int64_t n) {
  return n % MoeRow<DT>::VW == 0 && moe_aligned(p, 16);
}

template <moe_dtype DT> static inline unsigned moe_row_threads(int64_t n, bool vec) {
  int64_t work = vec ? n / MoeRow<DT>::VW : n;
  unsigned t = moe_pow2_ceil(work);
  if (t < 32) t = 32;
  if (t > MOE_ROW_THREADS) t = MOE_ROW_THREADS;
  return t;
}

/* -------------------------------------------- register-resident rows */
/*
 * Fast path of the row kernels for contiguous rows of n = nvec * VW
 * elements with 16-byte aligned bases: thread t of a block holds vectors
 * t, t + TH, ..., t + (NV - 1) * TH of its row raw in registers (those past
 * nvec are zero and skipped), so every row is read from global memory once,
 * all of a thread's loads in flight before any arithmetic, and each pass
 * after the first runs on registers. Forward kernels take one row per
 * block; the norm backward takes rows blockIdx.x, + gridDim.x, ... and
 * streams them through shared-memory stages by cp.async, several rows
 * ahead of the one it works on.
 */

#define MOE_REG_FWD_THREADS 512 /* at most, per block, forward */
#define MOE_REG_BWD_THREADS 512 /* at most, per block, norm backward */

template <int NV> struct MoeRegRow {
  uint4 v[NV];
};

template <int NV>
__device__ __forceinline__ void moe_reg_load(MoeRegRow<NV> &r, const void *__restrict__ row,
                                             int64_t nvec) {
#pragma unroll
  for (int q = 0; q < NV; q++) {
    int64_t k = threadIdx.x + (int64_t)q * blockDim.x;
    r.v[q] = k < nvec ? __ldg((const uint4 *)row + k) : make_uint4(0u, 0u, 0u, 0u);
  }
}

/* Element e of vector q as float. */
template <moe_dtype DT, int NV>
__device__ __forceinline__ float moe_reg_at(const MoeRegRow<NV> &r, int q, int e) {
  return moe_load_as<float, DT>(((const moe_st_t<DT> *)&r.v[q])[e]);
}

__device__ __forceinline__ bool moe_reg_valid(int q, int64_t nvec) {
  return threadIdx.x + (int64_t)q * blockDim.x < nvec;
}

/* Writes f(q, e) to the thread's vectors of row yr. */
template <moe_dtype DT, int NV, typename F>
__device__ __forceinline__ void moe_reg_store(void *__restrict__ yr, int64_t nvec, F &&f) {
  using T = moe_st_t<DT>;
  constexpr int VW = MoeRow<DT>::VW;
#pragma unroll
  for (int q = 0; q < NV; q++) {
    int64_t k = threadIdx.x + (int64_t)q * blockDim.x;
    if (k < nvec) {
      uint4 u;
      T *e = (T *)&u;
#pragma unroll
      for (int i = 0; i < VW; i++) e[i] = moe_store_from<DT, float>(f(q, i));
      ((uint4 *)yr)[k] = u;
    }
  }
}

/* Max over the block (every thread gets it); sh: 32 floats. NaN-ignoring
 * like fmaxf: a NaN still reaches the result through the sum of exps. */
__device__ __forceinline__ float moe_block_max(float v, float *sh) {
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = moe_warp_max(v);
  __syncthreads();
  if (lane == 0) sh[w] = v;
  __syncthreads();
  v = lane < nw ? sh[lane] : -INFINITY;
  return moe_warp_max(v);
}

/* Two sums over the block at once; sh: 64 floats. */
__device__ __forceinline__ void moe_block_sum2(float &a, float &b, float *sh) {
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  a = moe_warp_sum(a);
  b = moe_warp_sum(b);
  __syncthreads();
  if (lane == 0) sh[w] = a, sh[32 + w] = b;
  __syncthreads();
  a = moe_warp_sum(lane < nw ? sh[lane] : 0.f);
  b = moe_warp_sum(lane < nw ? sh[32 + lane] : 0.f);
}

/* Vectors per thread (1, 2, 4 ... most_nv) and threads (a multiple of 32,
 * at most most_th) for a row of nvec vectors: the fewest vectors per thread
 * that keep the block within `want` threads, else most_nv. 0: no fit. */
static inline int moe_reg_plan(int64_t nvec, int most_nv, unsigned want, unsigned most_th, unsigned *th) {
  for (int nv = 1; nv <= most_nv; nv <<= 1) {
    int64_t t = (nvec + nv - 1) / nv;
    if (t <= (int64_t)want || (nv == most_nv && t <= (int64_t)most_th)) {
      *th = (unsigned)((t + 31) / 32 * 32);
      return nv;
    }
  }
  return 0;
}

/* Calls f(std::integral_constant<int, NV>{}) for nv in {1, 2, 4}. */
template <typename F> static moe_status moe_reg_nv(int nv, F &&f) {
  switch (nv) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    default: return f(std::integral_constant<int, 4>{});
  }
}

/* ------------------------------------------------------ launch helpers */

template <typename F> static moe_status moe_row_dispatch(moe_ctx *ctx, moe_dtype dt, const char *fn, F &&f) {
  switch (dt) {
    case MOE_F32: return f(MoeDtTag<MOE_F32>{});
    case MOE_BF16: return f(MoeDtTag<MOE_BF16>{});
    case MOE_F16: return f(MoeDtTag<MOE_F16>{});
    default:
      return moe_error(ctx, MOE_ERR_DTYPE, "%s: dtype %s is not supported on CUDA (f32, bf16, f16)",
                       fn, moe_dtype_name(dt));
  }
}

static inline moe_status moe_rows_check(moe_ctx *ctx, const char *fn, int64_t rows) {
  if (rows > 0x7fffffffLL)
    return moe_error(ctx, MOE_ERR_NOT_SUPPORTED, "%s: %lld rows is more than one launch takes", fn,
                     (long long)rows);
  return MOE_OK;
}

#endif /* MOE_KERNELS_ROWS_CUH */
