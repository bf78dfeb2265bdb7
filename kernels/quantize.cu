/*
 * quantize.cu - CUDA kernels of the quantize family (core/quantize_cuda.h):
 * absmax-per-group quantization to 8 or 4 bits and its inverse.
 *
 * Input rows may be strided (row r starts at x + r * ld, its elements
 * contiguous): the gate/up halves of a (n, 2f) pre-activation are read in
 * place, with no contiguous copy.
 *
 * Fast path (cols, G and ld multiples of 8, 16-byte aligned rows): a chunk is
 * 8 consecutive elements (one 16-byte load for bf16/f16, two for f32).
 * TPG threads per (row, group): 4, 16 or 32 lanes of a warp with NV = 1,
 * 2, 4 or 8 chunks each when the group has at most 256 chunks, else the 256
 * threads of a block with NV = 2, 4 or 8 chunks each (groups up to 16384
 * elements). The group is read ONCE into registers (kept raw: 4 registers
 * a chunk for bf16 / f16), all its loads issued before any use,
 * its absmax reduced (shuffles, then shared memory across warps), and the
 * codes written from the registers: 8 codes = one 8-byte store (8 bits) or
 * one 4-byte store (4 bits). Dequantize: one thread per chunk, one scale
 * load, one 8- or 4-byte load and 16-byte stores.
 * Other shapes take the scalar kernels (two reads of the group, one thread
 * per element pair). The element math is the CPU reference's
 * (quantize_cuda.h, no FMA), so results are bit-identical on both paths.
 * Index math is int64; deterministic (no atomics).
 */
#include <cuda_runtime.h>

#include "common.cuh"
#include "quantize.cuh"

static moe_status qz_stream(moe_ctx *ctx, int device, cudaStream_t *s) {
  void *p = nullptr;
  MOE_CHECK(moe_cuda_stream(ctx, device, &p));
  *s = (cudaStream_t)p;
  return MOE_OK;
}

/* Max over the TPG threads of one group (all of them call it). */
template <int TPG> __device__ __forceinline__ float qz_group_max(float m, float *shared) {
  for (int o = 16; o > 0; o >>= 1) {
    float other = __shfl_xor_sync(0xffffffffu, m, o);
    m = moe_qz_absmax(m, other); /* other >= 0 or NaN: keeps NaN */
  }
  if constexpr (TPG > 32) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) shared[warp] = m;
    __syncthreads();
    m = 0.0f;
    for (int w = 0; w < TPG / 32; w++) m = moe_qz_absmax(m, shared[w]);
    __syncthreads();
  }
  return m;
}

template <moe_dtype DT, int BITS, int TPG>
__global__ void qz_quantize_kernel(const moe_st_t<DT> *__restrict__ x, int64_t ld, int64_t rows, int64_t cols,
                                   int64_t G, int64_t ngroups, int64_t row_bytes, bool stochastic,
                                   uint64_t seed, uint64_t call, void *__restrict__ values,
                                   float *__restrict__ scales) {
  __shared__ float shared[QZ_THREADS / 32];
  constexpr int qmax = BITS == 8 ? 127 : 7;
  const int per_block = QZ_THREADS / TPG;
  int64_t gid = (int64_t)blockIdx.x * per_block + threadIdx.x / TPG;
  int t = threadIdx.x % TPG;
  bool active = gid < rows * ngroups;
  /* a group is a whole warp (TPG 32) or the whole block (the grid has one
   * block per group then), so inactive threads leave together */
  if (!active) return;
  int64_t r = gid / ngroups, k = gid % ngroups;
  int64_t c0 = k * G, c1 = c0 + G < cols ? c0 + G : cols;
  int64_t n = c1 - c0, npairs = (n + 1) / 2;
  const moe_st_t<DT> *xr = x + r * ld;
  float m = 0.0f;
  for (int64_t j = t; j < npairs; j += TPG) {
    int64_t c = c0 + 2 * j;
    m = moe_qz_absmax(m, qz_ld<DT>(xr, c));
    if (c + 1 < c1) m = moe_qz_absmax(m, qz_ld<DT>(xr, c + 1));
  }
  m = qz_group_max<TPG>(m, shared);
  float s = moe_qz_scale(m, qmax), inv = moe_qz_inv(s);
  if (t == 0) scales[r * ngroups + k] = s;
  for (int64_t j = t; j < npairs; j += TPG) {
    int64_t c = c0 + 2 * j;
    int64_t i = r * cols + c;
    float u0 = stochastic ? moe_qz_uniform(seed, call, (uint64_t)i) : 0.0f;
    int q0 = moe_qz_code(qz_ld<DT>(xr, c), s, inv, qmax, stochastic, u0);
    bool two = c + 1 < c1;
    int q1 = 0;
    if (two) {
      float u1 = stochastic ? moe_qz_uniform(seed, call, (uint64_t)i + 1) : 0.0f;
      q1 = moe_qz_code(qz_ld<DT>(xr, c + 1), s, inv, qmax, stochastic, u1);
    }
    if constexpr (BITS == 8) {
      int8_t *vr = (int8_t *)values + r * row_bytes;
      vr[c] = (int8_t)q0;
      if (two) vr[c + 1] = (int8_t)q1;
    } else {
      uint8_t *vr = (uint8_t *)values + r * row_bytes;
      vr[c / 2] = (uint8_t)((q0 + 8) | (two ? (q1 + 8) << 4 : 0));
    }
  }
}

template <moe_dtype DT, int BITS>
__global__ void qz_dequantize_kernel(const void *__restrict__ values,
                                     const float *__restrict__ scales, int64_t rows, int64_t cols,
                                     int64_t G, int64_t ngroups, int64_t row_bytes,
                                     moe_st_t<DT> *__restrict__ out) {
  int64_t ppr = (cols + 1) / 2, n = rows * ppr;
  for (int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; p < n;
       p += (int64_t)gridDim.x * blockDim.x) {
    int64_t r = p / ppr, c = 2 * (p % ppr);
    bool two = c + 1 < cols;
    int q0, q1 = 0;
    if constexpr (BITS == 8) {
      const int8_t *vr = (const int8_t *)values + r * row_bytes;
      q0 = vr[c];
      if (two) q1 = vr[c + 1];
    } else {
      uint8_t b = ((const uint8_t *)values)[r * row_bytes + c / 2];
      q0 = (int)(b & 15) - 8;
      q1 = (int)(b >> 4) - 8;
    }
    const float *sr = scales + r * ngroups;
    moe_st_t<DT> *o = out + r * cols;
    o[c] = qz_st<DT>(moe_qz_value(q0, sr[c / G]));
    if (two) o[c + 1] = qz_st<DT>(moe_qz_value(q1, sr[(c + 1) / G]));
  }
}


/* ------------------------------------------------------------ fast path */

template <moe_dtype DT, int BITS, int TPG, int NV>
__global__ void __launch_bounds__(QZ_THREADS)
qz_quantize_vec_kernel(const moe_st_t<DT> *__restrict__ x, int64_t ld, int64_t rows, int64_t cols,
                       int64_t G, int64_t ngroups, bool stochastic, uint64_t seed, uint64_t call,
                       void *__restrict__ values, float *__restrict__ scales) {
  __shared__ float shared[QZ_THREADS / 32];
  constexpr int qmax = BITS == 8 ? 127 : 7;
  constexpr int per_block = QZ_THREADS / TPG;
  int64_t gid = (int64_t)blockIdx.x * per_block + threadIdx.x / TPG;
  int t = threadIdx.x % TPG;
  /* no early return before the reduction: every lane takes part */
  bool active = gid < rows * ngroups;
  int64_t r = active ? gid / ngroups : 0, k = active ? gid % ngroups : 0;
  int64_t c0 = k * G, n = c0 + G < cols ? G : cols - c0, nch = n / 8;
  const moe_st_t<DT> *xr = x + r * ld + c0;
  qz_chunk v[NV];
  float m = 0.0f;
#pragma unroll
  for (int j = 0; j < NV; j++) {
    int64_t ch = t + (int64_t)j * TPG;
    if (active && ch < nch) qz_load8<DT>(xr + ch * 8, v[j]);
  }
#pragma unroll
  for (int j = 0; j < NV; j++) {
    int64_t ch = t + (int64_t)j * TPG;
    if (active && ch < nch) {
#pragma unroll
      for (int e = 0; e < 8; e++) m = moe_qz_absmax(m, qz_elem<DT>(v[j], e));
    }
  }
  m = qz_group_max_vec<TPG>(m, shared);
  if (!active) return;
  float s = moe_qz_scale(m, qmax), inv = moe_qz_inv(s);
  if (t == 0) scales[r * ngroups + k] = s;
#pragma unroll
  for (int j = 0; j < NV; j++) {
    int64_t ch = t + (int64_t)j * TPG;
    if (ch < nch) {
      qz_put8<DT, BITS>(v[j], s, inv, stochastic, seed, call, r, cols, c0 + ch * 8, values);
    }
  }
}

template <moe_dtype DT, int BITS>
__global__ void __launch_bounds__(QZ_THREADS)
qz_dequantize_vec_kernel(const void *__restrict__ values, const float *__restrict__ scales,
                         int64_t rows, int64_t cols, int64_t G, int64_t ngroups,
                         moe_st_t<DT> *__restrict__ out) {
  int64_t cpr = cols / 8, n = rows * cpr;
  for (int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; p < n;
       p += (int64_t)gridDim.x * blockDim.x) {
    int64_t r = p / cpr, c = 8 * (p % cpr);
    float s = __ldg(scales + r * ngroups + c / G);
    float v[8];
    if constexpr (BITS == 8) {
      uint2 u = __ldg((const uint2 *)((const int8_t *)values + r * cols + c));
#pragma unroll
      for (int e = 0; e < 4; e++) {
        v[e] = moe_qz_value((int)(int8_t)(u.x >> (8 * e)), s);
        v[e + 4] = moe_qz_value((int)(int8_t)(u.y >> (8 * e)), s);
      }
    } else {
      uint32_t w = __ldg((const uint32_t *)((const uint8_t *)values + r * (cols / 2) + c / 2));
#pragma unroll
      for (int e = 0; e < 8; e++) v[e] = moe_qz_value((int)((w >> (4 * e)) & 15) - 8, s);
    }
    qz_store8<DT>(out + r * cols + c, v);
  }
}

/* Whether the fast path applies: 8-element chunks never straddle a group or
 * a row, and every chunk start is 16-byte aligned. */
static bool qz_vec_ok(const void *x, int64_t ld, int64_t cols, int64_t G) {
  return cols % 8 == 0 && G % 8 == 0 && ld % 8 == 0 && ((uintptr_t)x & 15) == 0;
}

template <moe_dtype DT, int BITS, int TPG, int NV>
static void qz_launch_vec(cudaStream_t s, const void *x, int64_t ld, int64_t rows, int64_t cols,
                          int64_t G, int64_t ngroups, bool stochastic, uint64_t seed,
                          uint64_t call, void *values, float *scales) {
  constexpr int per_block = QZ_THREADS / TPG;
  int64_t blocks = (rows * ngroups + per_block - 1) / per_block;
  qz_quantize_vec_kernel<DT, BITS, TPG, NV><<<(unsigned)blocks, QZ_THREADS, 0, s>>>(
      (const moe_st_t<DT> *)x, ld, rows, cols, G, ngroups, stochastic, seed, call, values, scales);
}

/* Launches the fast quantize kernel when one fits; false otherwise. */
template <moe_dtype DT, int BITS>
static bool qz_try_vec(cudaStream_t s, const void *x, int64_t ld, int64_t rows, int64_t cols,
                       int64_t G, bool stochastic, uint64_t seed, uint64_t call, void *values,
                       float *scales) {
  if (!qz_vec_ok(x, ld, cols, G)) return false;
  int64_t ngroups = (cols + G - 1) / G;
  int64_t chunks = (G < cols ? G : cols) / 8;
#define QZ_VEC(TPG, NV) \
  qz_launch_vec<DT, BITS, TPG, NV>(s, x, ld, rows, cols, G, ngroups, stochastic, seed, call, values, scales)
  /* a warp per group up to 256 chunks (no block barrier, no idle threads
   * for widths such as 768), a block beyond */
  if (chunks <= 4) QZ_VEC(4, 1);
  else if (chunks <= 16) QZ_VEC(16, 1);
  else if (chunks <= 32) QZ_VEC(32, 1);
  else if (chunks <= 64) QZ_VEC(32, 2);
  else if (chunks <= 128) QZ_VEC(32, 4);
  else if (chunks <= 256) QZ_VEC(32, 8);
  else if (chunks <= 2 * QZ_THREADS) QZ_VEC(QZ_THREADS, 2);
  else if (chunks <= 4 * QZ_THREADS) QZ_VEC(QZ_THREADS, 4);
  else if (chunks <= 8 * QZ_THREADS) QZ_VEC(QZ_THREADS, 8);
  else return false;
#undef QZ_VEC
  return true;
}

template <moe_dtype DT, int BITS>
static moe_status qz_launch_quantize(moe_ctx *ctx, cudaStream_t s, const void *x, int64_t ld,
                                     int64_t rows, int64_t cols, int64_t G, bool stochastic,
                                     uint64_t seed, uint64_t call, void *values, float *scales) {
  if (qz_try_vec<DT, BITS>(s, x, ld, rows, cols, G, stochastic, seed, call, values, scales)) {
    MOE_CUDA_CHECK_LAUNCH(ctx, "quantize kernel");
    return MOE_OK;
  }
  int64_t ngroups = (cols + G - 1) / G, row_bytes = BITS == 8 ? cols : (cols + 1) / 2;
  int64_t groups = rows * ngroups;
  const moe_st_t<DT> *xp = (const moe_st_t<DT> *)x;
  if (G <= 1024) {
    int64_t blocks = (groups + QZ_THREADS / 32 - 1) / (QZ_THREADS / 32);
    qz_quantize_kernel<DT, BITS, 32><<<(unsigned)blocks, QZ_THREADS, 0, s>>>(
        xp, ld, rows, cols, G, ngroups, row_bytes, stochastic, seed, call, values, scales);
  } else {
    qz_quantize_kernel<DT, BITS, QZ_THREADS><<<(unsigned)groups, QZ_THREADS, 0, s>>>(
        xp, ld, rows, cols, G, ngroups, row_bytes, stochastic, seed, call, values, scales);
  }
  MOE_CUDA_CHECK_LAUNCH(ctx, "quantize kernel");
  return MOE_OK;
}

template <moe_dtype DT, int BITS>
static moe_status qz_launch_dequantize(moe_ctx *ctx, cudaStream_t s, const void *values,
                                       const float *scales, int64_t rows, int64_t cols, int64_t G,
                                       void *out) {
  int64_t ngroups = (cols + G - 1) / G, row_bytes = BITS == 8 ? cols : (cols + 1) / 2;
  if (qz_vec_ok(out, cols, cols, G) && ((uintptr_t)values & 7) == 0) {
    int64_t nv = rows * (cols / 8), vblocks = (nv + QZ_THREADS - 1) / QZ_THREADS;
    if (vblocks > 65535LL * 32) vblocks = 65535LL * 32; /* grid-stride beyond */
    qz_dequantize_vec_kernel<DT, BITS><<<(unsigned)vblocks, QZ_THREADS, 0, s>>>(
        values, scales, rows, cols, G, ngroups, (moe_st_t<DT> *)out);
    MOE_CUDA_CHECK_LAUNCH(ctx, "dequantize kernel");
    return MOE_OK;
  }
  int64_t n = rows * ((cols + 1) / 2);
  int64_t blocks = (n + QZ_THREADS - 1) / QZ_THREADS;
  if (blocks > 65535LL * 32) blocks = 65535LL * 32; /* grid-stride beyond */
  qz_dequantize_kernel<DT, BITS><<<(unsigned)blocks, QZ_THREADS, 0, s>>>(
      values, scales, rows, cols, G, ngroups, row_bytes, (moe_st_t<DT> *)out);
  MOE_CUDA_CHECK_LAUNCH(ctx, "dequantize kernel");
  return MOE_OK;
}

extern "C" moe_status moe_cuda_quantize(moe_ctx *ctx, int device, moe_dtype dt, const void *x,
                                        int64_t ld, int64_t rows, int64_t cols, int bits, int64_t G,
                                        bool stochastic, uint64_t seed, uint64_t call,
                                        void *values, float *scales) {
  if (rows * cols == 0) return MOE_OK;
  if ((rows * ((cols + G - 1) / G) + 7) / 8 > (int64_t)INT32_MAX)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "quantize: too many groups for one launch");
  cudaStream_t s;
  MOE_CHECK(qz_stream(ctx, device, &s));
  bool b8 = bits == 8;
  switch (dt) {
  case MOE_F32:
    return b8 ? qz_launch_quantize<MOE_F32, 8>(ctx, s, x, ld, rows, cols, G, stochastic, seed, call, values, scales)
              : qz_launch_quantize<MOE_F32, 4>(ctx, s, x, ld, rows, cols, G, stochastic, seed, call, values, scales);
  case MOE_BF16:
    return b8 ? qz_launch_quantize<MOE_BF16, 8>(ctx, s, x, ld, rows, cols, G, stochastic, seed, call, values, scales)
              : qz_launch_quantize<MOE_BF16, 4>(ctx, s, x, ld, rows, cols, G, stochastic, seed, call, values, scales);
  case MOE_F16:
    return b8 ? qz_launch_quantize<MOE_F16, 8>(ctx, s, x, ld, rows, cols, G, stochastic, seed, call, values, scales)
              : qz_launch_quantize<MOE_F16, 4>(ctx, s, x, ld, rows, cols, G, stochastic, seed, call, values, scales);
  default:
    return moe_error(ctx, MOE_ERR_DTYPE, "quantize: dtype %s is not supported on CUDA",
                     moe_dtype_name(dt));
  }
}

extern "C" moe_status moe_cuda_dequantize(moe_ctx *ctx, int device, moe_dtype dt,
                                          const void *values, const float *scales, int64_t rows,
                                          int64_t cols, int bits, int64_t G, void *out) {
  if (rows * cols == 0) return MOE_OK;
  cudaStream_t s;
  MOE_CHECK(qz_stream(ctx, device, &s));
  bool b8 = bits == 8;
  switch (dt) {
  case MOE_F32:
    return b8 ? qz_launch_dequantize<MOE_F32, 8>(ctx, s, values, scales, rows, cols, G, out)
              : qz_launch_dequantize<MOE_F32, 4>(ctx, s, values, scales, rows, cols, G, out);
  case MOE_BF16:
    return b8 ? qz_launch_dequantize<MOE_BF16, 8>(ctx, s, values, scales, rows, cols, G, out)
              : qz_launch_dequantize<MOE_BF16, 4>(ctx, s, values, scales, rows, cols, G, out);
  case MOE_F16:
    return b8 ? qz_launch_dequantize<MOE_F16, 8>(ctx, s, values, scales, rows, cols, G, out)
              : qz_launch_dequantize<MOE_F16, 4>(ctx, s, values, scales, rows, cols, G, out);
  default:
    return moe_error(ctx, MOE_ERR_DTYPE, "dequantize: dtype %s is not supported on CUDA",
                     moe_dtype_name(dt));
  }
}
