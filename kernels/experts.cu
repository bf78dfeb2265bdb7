/*
 * experts.cu - CUDA kernels of the experts family (entry points in
 * core/experts_cuda.h, called by core/experts.c): the GLU activation
 * a = act(h1) * h3, its fused backward pass (gate scaling, per-row gate
 * gradient, activation derivative) over a dense or block-sparse hidden,
 * parallel_linear's gate pass (the same for a linear's rows), and the index
 * gather that moves gates between assignment and row order.
 *
 * With quantize on, the forward pass quantizes h1 and h3 in the pass that
 * computes a (the quantize fast path's group-in-registers scheme, helpers in
 * quantize.cuh), and the backward pass reads them dequantized straight from
 * the codes (no bf16 copy of either).
 *
 * Math in f32 (bf16 storage, f32 accumulation). The per-row gate gradient is
 * one thread block per row reduced in a fixed tree order: deterministic, no
 * atomics. Index math is int64.
 */
#include <cuda_bf16.h>

#include "common.cuh"
#include "experts_cuda.h"
#include "glu_act.cuh"
#include "quantize.cuh"

#define EX_THREADS 256 /* a multiple of 32 */

static moe_status ex_stream(moe_ctx *ctx, int device, cudaStream_t *s) {
  void *p = nullptr;
  MOE_CHECK(moe_cuda_stream(ctx, device, &p));
  *s = (cudaStream_t)p;
  return MOE_OK;
}

template <typename T> __device__ __forceinline__ float ex_load(const T *p, int64_t i);
template <> __device__ __forceinline__ float ex_load<float>(const float *p, int64_t i) { return p[i]; }
template <> __device__ __forceinline__ float ex_load<__nv_bfloat16>(const __nv_bfloat16 *p, int64_t i) {
  return __bfloat162float(p[i]);
}
template <typename T> __device__ __forceinline__ void ex_store(T *p, int64_t i, float v);
template <> __device__ __forceinline__ void ex_store<float>(float *p, int64_t i, float v) { p[i] = v; }
template <> __device__ __forceinline__ void ex_store<__nv_bfloat16>(__nv_bfloat16 *p, int64_t i, float v) {
  p[i] = __float2bfloat16_rn(v);
}

/* V consecutive elements moved as one aligned access (V = 1: scalar). */
template <typename T, int V> struct alignas(sizeof(T) * V) ExVec {
  T v[V];
};

template <typename T, int V>
__global__ void ex_glu_fwd_kernel(int act, int64_t n, const T *h1, const T *h3, T *a) {
  for (int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * V; i < n;
       i += (int64_t)gridDim.x * blockDim.x * V) {
    ExVec<T, V> x1 = *(const ExVec<T, V> *)(h1 + i), x3 = *(const ExVec<T, V> *)(h3 + i), y;
#pragma unroll
    for (int j = 0; j < V; j++) {
      float f, df;
      ex_act(act, ex_load(x1.v, j), &f, &df);
      ex_store(y.v, j, f * ex_load(x3.v, j));
    }
    *(ExVec<T, V> *)(a + i) = y;
  }
}

/* One block per row (blockDim a multiple of 32, at most EX_THREADS); each
 * thread moves V consecutive columns at a time (V divides f and bs, so they
 * are contiguous in either layout). The gate gradient reduces in a fixed
 * order: warp shuffles, then warp 0's lane 0 over the warps in order. */
/* The quantized pre-activations of the backward pass (BITS 8 or 4): the
 * hidden seen as (rows, cols) in memory order, groups of G along cols
 * (core/moe_quantize.h's layout). */
struct ExQ {
  const void *v1, *v3;
  const float *s1, *s3;
  int64_t cols, G, ngroups, row_bytes;
};

/* x rounded to T and back (the value the unfused path would have stored). */
template <typename T> __device__ __forceinline__ float ex_round(float x) {
  T t;
  ex_store(&t, 0, x);
  return ex_load(&t, 0);
}

/* V consecutive elements from memory index i of a quantized hidden (V
 * divides cols and G, so they share a row and a scale), dequantized. */
template <typename T, int V, int BITS>
__device__ __forceinline__ void ex_qload(const void *vals, const float *sc, const ExQ &q, int64_t i,
                                         float out[V]) {
  int64_t qr = i / q.cols, qc = i - qr * q.cols;
  float s = sc[qr * q.ngroups + qc / q.G];
  if constexpr (BITS == 8) {
    ExVec<int8_t, V> c = *(const ExVec<int8_t, V> *)((const int8_t *)vals + qr * q.row_bytes + qc);
#pragma unroll
    for (int j = 0; j < V; j++) out[j] = ex_round<T>(moe_qz_value((int)c.v[j], s));
  } else if constexpr (V == 1) {
    uint8_t b = ((const uint8_t *)vals)[qr * q.row_bytes + qc / 2];
    out[0] = ex_round<T>(moe_qz_value((int)((b >> ((qc & 1) * 4)) & 15) - 8, s));
  } else {
    ExVec<uint8_t, V / 2> c =
        *(const ExVec<uint8_t, V / 2> *)((const uint8_t *)vals + qr * q.row_bytes + qc / 2);
#pragma unroll
    for (int j = 0; j < V; j++)
      out[j] = ex_round<T>(moe_qz_value((int)((c.v[j / 2] >> ((j & 1) * 4)) & 15) - 8, s));
  }
}

/* The block's per-thread partial sums of one row, reduced in a fixed order
 * (warp shuffles, then thread 0 over the warps in order) into *out. Every
 * thread of the block calls it. */
__device__ __forceinline__ void ex_row_sum(float dot, float *warp_sums, float *out) {
  for (int o = 16; o > 0; o >>= 1) dot += __shfl_down_sync(0xffffffffu, dot, o);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = dot;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.0f;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) s += warp_sums[w];
    *out = s;
  }
  __syncthreads();
}

/* BITS 0: h1 and h3 are T tensors; 8 or 4: they are read from q. */
template <typename T, int V, int BITS>
__global__ void ex_glu_bwd_kernel(int act, int64_t R, int64_t f, int64_t bs, T *dA0, const T *h1,
                                  const T *h3, ExQ q, const float *g_rows, T *dh3, T *ga,
                                  float *dgate_rows) {
  __shared__ float warp_sums[EX_THREADS / 32];
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    float g = g_rows ? g_rows[r] : 1.0f, dot = 0.0f;
    int64_t base, F = bs > 0 ? f / bs : 0;
    if (bs == 0) base = r * f;
    else base = (r / bs) * F * bs * bs + (r % bs) * bs;
    for (int64_t c = (int64_t)threadIdx.x * V; c < f; c += (int64_t)blockDim.x * V) {
      int64_t i = bs == 0 ? base + c : base + (c / bs) * bs * bs + c % bs;
      float f1[V], f3[V];
      if constexpr (BITS == 0) {
        ExVec<T, V> v1 = *(const ExVec<T, V> *)(h1 + i), v3 = *(const ExVec<T, V> *)(h3 + i);
#pragma unroll
        for (int j = 0; j < V; j++) {
          f1[j] = ex_load(v1.v, j);
          f3[j] = ex_load(v3.v, j);
        }
      } else {
        ex_qload<T, V, BITS>(q.v1, q.s1, q, i, f1);
        ex_qload<T, V, BITS>(q.v3, q.s3, q, i, f3);
      }
      ExVec<T, V> d0 = *(const ExVec<T, V> *)(dA0 + i), o1, o3, og;
#pragma unroll
      for (int j = 0; j < V; j++) {
        float x1 = f1[j], x3 = f3[j], dd = ex_load(d0.v, j);
        float fa, dfa;
        ex_act(act, x1, &fa, &dfa);
        /* recomputed: rounded as the forward stored it, so the same bits */
        float av = ex_round<T>(fa * x3);
        dot += dd * av;
        float da = g * dd;
        ex_store(o1.v, j, da * x3 * dfa);
        ex_store(o3.v, j, da * fa);
        ex_store(og.v, j, g * av);
      }
      *(ExVec<T, V> *)(dA0 + i) = o1;
      *(ExVec<T, V> *)(dh3 + i) = o3;
      if (ga) *(ExVec<T, V> *)(ga + i) = og;
    }
    if (dgate_rows) ex_row_sum(dot, warp_sums, dgate_rows + r);
  }
}

/* The gate's backward pass of a linear's rows (moe_cuda_experts_gate_rows):
 * one block per row as ex_glu_bwd_kernel, the same fixed-order reduction;
 * with src, xs's row is x's row src[r] / k (zeros for a padding row). */
template <typename T, int V>
__global__ void ex_gate_rows_kernel(int64_t R, int64_t K, int64_t bs, T *dX0, const T *xs,
                                    const int64_t *src, int64_t k, const float *g_rows, T *gxs,
                                    T *ys, int64_t N, float *dgate_rows) {
  __shared__ float warp_sums[EX_THREADS / 32];
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    float g = g_rows ? g_rows[r] : 1.0f, dot = 0.0f;
    int64_t base, F = bs > 0 ? K / bs : 0, xrow = -1;
    if (bs == 0) base = r * K;
    else base = (r / bs) * F * bs * bs + (r % bs) * bs;
    if (src) xrow = src[r] >= 0 ? src[r] / k : -1;
    for (int64_t c = (int64_t)threadIdx.x * V; c < K; c += (int64_t)blockDim.x * V) {
      int64_t i = bs == 0 ? base + c : base + (c / bs) * bs * bs + c % bs;
      ExVec<T, V> xv, d0, od, og;
      if (!src) xv = *(const ExVec<T, V> *)(xs + i);
      else if (xrow >= 0) xv = *(const ExVec<T, V> *)(xs + xrow * K + c);
      if (dX0) d0 = *(const ExVec<T, V> *)(dX0 + i);
#pragma unroll
      for (int j = 0; j < V; j++) {
        float xj = src && xrow < 0 ? 0.0f : ex_load(xv.v, j), dd = dX0 ? ex_load(d0.v, j) : 0.0f;
        dot += dd * xj;
        ex_store(od.v, j, g * dd);
        ex_store(og.v, j, g * xj);
      }
      if (dX0) *(ExVec<T, V> *)(dX0 + i) = od;
      if (gxs) *(ExVec<T, V> *)(gxs + i) = og;
    }
    for (int64_t c = (int64_t)threadIdx.x * V; ys && c < N; c += (int64_t)blockDim.x * V) {
      ExVec<T, V> y = *(const ExVec<T, V> *)(ys + r * N + c);
#pragma unroll
      for (int j = 0; j < V; j++) ex_store(y.v, j, g * ex_load(y.v, j));
      *(ExVec<T, V> *)(ys + r * N + c) = y;
    }
    if (dgate_rows) ex_row_sum(dot, warp_sums, dgate_rows + r);
  }
}

template <typename TI, typename TO>
__global__ void ex_take_kernel(int64_t n, const int64_t *idx, const TI *in, TO *out) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    int64_t j = idx[i];
    double v = j >= 0 ? (double)in[j] : 0.0;
    out[i] = (TO)v;
  }
}

/* bf16 specialisations go through float */
template <typename TO>
__global__ void ex_take_bf16_in_kernel(int64_t n, const int64_t *idx, const __nv_bfloat16 *in,
                                       TO *out) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    int64_t j = idx[i];
    out[i] = (TO)(j >= 0 ? __bfloat162float(in[j]) : 0.0f);
  }
}

template <typename TI>
__global__ void ex_take_bf16_out_kernel(int64_t n, const int64_t *idx, const TI *in,
                                        __nv_bfloat16 *out) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    int64_t j = idx[i];
    out[i] = __float2bfloat16_rn(j >= 0 ? (float)in[j] : 0.0f);
  }
}

__global__ void ex_take_bf16_kernel(int64_t n, const int64_t *idx, const __nv_bfloat16 *in,
                                    __nv_bfloat16 *out) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    int64_t j = idx[i];
    out[i] = j >= 0 ? in[j] : __float2bfloat16_rn(0.0f);
  }
}

template <typename T>
static void ex_fwd_launch(cudaStream_t s, int act, int64_t n, const void *h1, const void *h3,
                          void *a) {
  constexpr int V = 16 / sizeof(T);
  const T *p1 = (const T *)h1, *p3 = (const T *)h3;
  T *pa = (T *)a;
  if (n % V == 0 && moe_aligned(h1, 16) && moe_aligned(h3, 16) && moe_aligned(a, 16))
    ex_glu_fwd_kernel<T, V><<<moe_blocks(n / V), EX_THREADS, 0, s>>>(act, n, p1, p3, pa);
  else
    ex_glu_fwd_kernel<T, 1><<<moe_blocks(n), EX_THREADS, 0, s>>>(act, n, p1, p3, pa);
}

extern "C" moe_status moe_cuda_experts_glu_fwd(moe_ctx *ctx, int device, moe_dtype dt, int act,
                                               int64_t n, const void *h1, const void *h3, void *a) {
  cudaStream_t s;
  MOE_CHECK(ex_stream(ctx, device, &s));
  if (n <= 0) return MOE_OK;
  if (dt == MOE_F32) ex_fwd_launch<float>(s, act, n, h1, h3, a);
  else if (dt == MOE_BF16) ex_fwd_launch<__nv_bfloat16>(s, act, n, h1, h3, a);
  else
    return moe_error(ctx, MOE_ERR_DTYPE, "glu_experts: CUDA takes f32 or bf16, got %s",
                     moe_dtype_name(dt));
  MOE_CUDA_CHECK_LAUNCH(ctx, "glu_experts forward kernel");
  return MOE_OK;
}

template <typename T, int BITS>
static void ex_bwd_launch(cudaStream_t s, int act, int64_t R, int64_t f, int64_t bs, void *dA0,
                          const void *h1, const void *h3, const ExQ &q, const float *g_rows,
                          void *dh3, void *ga, float *dgate_rows) {
  constexpr int V = 16 / sizeof(T);
  bool vec = f % V == 0 && (bs == 0 || bs % V == 0) && moe_aligned(dA0, 16) &&
             moe_aligned(dh3, 16) && (!ga || moe_aligned(ga, 16));
  if (BITS == 0) vec = vec && moe_aligned(h1, 16) && moe_aligned(h3, 16);
  else /* a chunk within one row and one group; its codes aligned */
    vec = vec && q.cols % V == 0 && q.G % V == 0 && moe_aligned(q.v1, 8) && moe_aligned(q.v3, 8) &&
          (BITS == 8 || q.row_bytes * 2 == q.cols);
  int64_t chunks = vec ? f / V : f;
  int threads = (int)((chunks + 31) / 32 * 32);
  if (threads > EX_THREADS) threads = EX_THREADS;
  unsigned grid = (unsigned)(R < (1 << 30) ? R : (1 << 30));
  if (vec)
    ex_glu_bwd_kernel<T, V, BITS><<<grid, threads, 0, s>>>(act, R, f, bs, (T *)dA0, (const T *)h1,
                                                           (const T *)h3, q, g_rows, (T *)dh3,
                                                           (T *)ga, dgate_rows);
  else
    ex_glu_bwd_kernel<T, 1, BITS><<<grid, threads, 0, s>>>(act, R, f, bs, (T *)dA0, (const T *)h1,
                                                           (const T *)h3, q, g_rows, (T *)dh3,
                                                           (T *)ga, dgate_rows);
}

template <typename T>
static void ex_bwd_bits(cudaStream_t s, int bits, int act, int64_t R, int64_t f, int64_t bs,
                        void *dA0, const void *h1, const void *h3, const ExQ &q,
                        const float *g_rows, void *dh3, void *ga, float *dgate_rows) {
  if (bits == 8) ex_bwd_launch<T, 8>(s, act, R, f, bs, dA0, h1, h3, q, g_rows, dh3, ga, dgate_rows);
  else if (bits == 4) ex_bwd_launch<T, 4>(s, act, R, f, bs, dA0, h1, h3, q, g_rows, dh3, ga, dgate_rows);
  else ex_bwd_launch<T, 0>(s, act, R, f, bs, dA0, h1, h3, q, g_rows, dh3, ga, dgate_rows);
}

static moe_status ex_bwd_any(moe_ctx *ctx, int device, moe_dtype dt, int bits, int act, int64_t R,
                             int64_t f, int64_t bs, void *dA0, const void *h1, const void *h3,
                             const ExQ &q, const float *g_rows, void *dh3, void *ga,
                             float *dgate_rows) {
  cudaStream_t s;
  MOE_CHECK(ex_stream(ctx, device, &s));
  if (R <= 0 || f <= 0) return MOE_OK;
  if (dt == MOE_F32) ex_bwd_bits<float>(s, bits, act, R, f, bs, dA0, h1, h3, q, g_rows, dh3, ga, dgate_rows);
  else if (dt == MOE_BF16)
    ex_bwd_bits<__nv_bfloat16>(s, bits, act, R, f, bs, dA0, h1, h3, q, g_rows, dh3, ga, dgate_rows);
  else
    return moe_error(ctx, MOE_ERR_DTYPE, "glu_experts: CUDA takes f32 or bf16, got %s",
                     moe_dtype_name(dt));
  MOE_CUDA_CHECK_LAUNCH(ctx, "glu_experts backward kernel");
  return MOE_OK;
}

extern "C" moe_status moe_cuda_experts_glu_bwd(moe_ctx *ctx, int device, moe_dtype dt, int act,
                                               int64_t R, int64_t f, int64_t bs, void *dA0,
                                               const void *h1, const void *h3,
                                               const float *g_rows, void *dh3, void *ga,
                                               float *dgate_rows) {
  ExQ q = {};
  return ex_bwd_any(ctx, device, dt, 0, act, R, f, bs, dA0, h1, h3, q, g_rows, dh3, ga, dgate_rows);
}

extern "C" moe_status moe_cuda_experts_glu_bwd_quant(moe_ctx *ctx, int device, moe_dtype dt, int act,
                                                     int64_t R, int64_t f, int64_t bs, void *dA0,
                                                     const moe_ex_qhidden *qh, const float *g_rows,
                                                     void *dh3, void *ga, float *dgate_rows) {
  if (qh->bits != 8 && qh->bits != 4)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "glu_experts: quantized hidden of %d bits", qh->bits);
  ExQ q = {qh->v1, qh->v3, qh->s1, qh->s3, qh->cols, qh->G, (qh->cols + qh->G - 1) / qh->G,
           qh->bits == 8 ? qh->cols : (qh->cols + 1) / 2};
  return ex_bwd_any(ctx, device, dt, qh->bits, act, R, f, bs, dA0, nullptr, nullptr, q, g_rows,
                    dh3, ga, dgate_rows);
}

/* ------------------------------------------- forward with quantization */

/* a = act(h1) * h3 and both pre-activations quantized in one pass: the
 * quantize fast path of kernels/quantize.cu (one group per TPG threads, read
 * once into registers) over h1 and h3 together, a written from the same
 * registers. rows x cols in memory order, groups of G along cols. */
template <moe_dtype DT, int BITS, int TPG, int NV, int BT>
__global__ void __launch_bounds__(BT)
ex_glu_fwd_quant_kernel(int act, const moe_st_t<DT> *__restrict__ h1,
                        const moe_st_t<DT> *__restrict__ h3, moe_st_t<DT> *__restrict__ a,
                        int64_t rows, int64_t cols, int64_t G, int64_t ngroups, bool stochastic,
                        uint64_t seed, uint64_t call1, uint64_t call3, void *__restrict__ v1,
                        float *__restrict__ s1, void *__restrict__ v3, float *__restrict__ s3) {
  __shared__ float shared[2][32];
  constexpr int qmax = BITS == 8 ? 127 : 7;
  constexpr int per_block = BT / TPG;
  int64_t gid = (int64_t)blockIdx.x * per_block + threadIdx.x / TPG;
  int t = threadIdx.x % TPG;
  bool active = gid < rows * ngroups; /* every lane takes part in the reduction */
  int64_t r = active ? gid / ngroups : 0, k = active ? gid % ngroups : 0;
  int64_t c0 = k * G, n = c0 + G < cols ? G : cols - c0, nch = n / 8;
  int64_t off = r * cols + c0;
  qz_chunk x1[NV], x3[NV];
#pragma unroll
  for (int j = 0; j < NV; j++) {
    int64_t ch = t + (int64_t)j * TPG;
    if (active && ch < nch) {
      qz_load8<DT>(h1 + off + ch * 8, x1[j]);
      qz_load8<DT>(h3 + off + ch * 8, x3[j]);
    }
  }
  float m1 = 0.0f, m3 = 0.0f;
#pragma unroll
  for (int j = 0; j < NV; j++) {
    int64_t ch = t + (int64_t)j * TPG;
    if (active && ch < nch) {
#pragma unroll
      for (int e = 0; e < 8; e++) {
        m1 = moe_qz_absmax(m1, qz_elem<DT>(x1[j], e));
        m3 = moe_qz_absmax(m3, qz_elem<DT>(x3[j], e));
      }
    }
  }
  qz_group_max2_vec<TPG>(m1, m3, shared);
  if (!active) return;
  float sc1 = moe_qz_scale(m1, qmax), sc3 = moe_qz_scale(m3, qmax);
  float inv1 = moe_qz_inv(sc1), inv3 = moe_qz_inv(sc3);
  if (t == 0) {
    s1[r * ngroups + k] = sc1;
    s3[r * ngroups + k] = sc3;
  }
#pragma unroll
  for (int j = 0; j < NV; j++) {
    int64_t ch = t + (int64_t)j * TPG;
    if (ch < nch) {
      int64_t c = c0 + ch * 8;
      qz_put8<DT, BITS>(x1[j], sc1, inv1, stochastic, seed, call1, r, cols, c, v1);
      qz_put8<DT, BITS>(x3[j], sc3, inv3, stochastic, seed, call3, r, cols, c, v3);
      float av[8];
#pragma unroll
      for (int e = 0; e < 8; e++) {
        float fa, dfa;
        ex_act(act, qz_elem<DT>(x1[j], e), &fa, &dfa);
        av[e] = fa * qz_elem<DT>(x3[j], e);
      }
      qz_store8<DT>(a + r * cols + c, av);
    }
  }
}

template <moe_dtype DT, int BITS, int TPG, int NV>
static void ex_fwdq_launch(cudaStream_t s, int act, const moe_ex_qhidden *qh, int64_t rows,
                           bool stochastic, uint64_t seed, uint64_t call1, uint64_t call3,
                           const void *h1, const void *h3, void *a) {
  /* blocks of 256 threads for warp-sized groups, one group a block beyond */
  constexpr int BT = TPG <= 32 ? QZ_THREADS : TPG;
  constexpr int per_block = BT / TPG;
  int64_t ngroups = (qh->cols + qh->G - 1) / qh->G;
  int64_t blocks = (rows * ngroups + per_block - 1) / per_block;
  ex_glu_fwd_quant_kernel<DT, BITS, TPG, NV, BT><<<(unsigned)blocks, BT, 0, s>>>(
      act, (const moe_st_t<DT> *)h1, (const moe_st_t<DT> *)h3, (moe_st_t<DT> *)a, rows, qh->cols,
      qh->G, ngroups, stochastic, seed, call1, call3, (void *)qh->v1, (float *)qh->s1,
      (void *)qh->v3, (float *)qh->s3);
}

/* The launch for one group width; false when none fits. */
template <moe_dtype DT, int BITS>
static bool ex_fwdq_try(cudaStream_t s, int act, const moe_ex_qhidden *qh, int64_t rows,
                        bool stochastic, uint64_t seed, uint64_t call1, uint64_t call3,
                        const void *h1, const void *h3, void *a) {
  int64_t chunks = (qh->G < qh->cols ? qh->G : qh->cols) / 8;
#define EX_FQ(TPG, NV) \
  ex_fwdq_launch<DT, BITS, TPG, NV>(s, act, qh, rows, stochastic, seed, call1, call3, h1, h3, a)
  if (chunks <= 4) EX_FQ(4, 1);
  else if (chunks <= 16) EX_FQ(16, 1);
  else if (chunks <= 32) EX_FQ(32, 1);
  else if (chunks <= 64) EX_FQ(32, 2);
  else if (chunks <= 128) EX_FQ(32, 4);
  else if (chunks <= 256) EX_FQ(32, 8);
  /* wide groups (a row of 8 bits): a block of up to 1024 threads with at
   * most 2 chunks of each input a thread, so that registers stay low and
   * several blocks share an SM (256 threads with 8 chunks of two inputs
   * each made the mixtral forward 7.6 ms slower than quantization off) */
  else if (chunks <= 512) EX_FQ(512, 1);
  else if (chunks <= 1024) EX_FQ(1024, 1);
  else if (chunks <= 2048) EX_FQ(1024, 2);
  else if (chunks <= 4096) EX_FQ(1024, 4);
  else return false;
#undef EX_FQ
  return true;
}

extern "C" moe_status moe_cuda_experts_glu_fwd_quant(moe_ctx *ctx, int device, moe_dtype dt,
                                                     int act, int64_t rows,
                                                     const moe_ex_qhidden *qh, bool stochastic,
                                                     uint64_t seed, uint64_t call1,
                                                     uint64_t call3, const void *h1,
                                                     const void *h3, void *a, bool *done) {
  *done = false;
  int64_t cols = qh->cols, G = qh->G;
  bool ok = (dt == MOE_F32 || dt == MOE_BF16) && (qh->bits == 8 || qh->bits == 4) && cols % 8 == 0 &&
            G % 8 == 0 && moe_aligned(h1, 16) && moe_aligned(h3, 16) && moe_aligned(a, 16) &&
            moe_aligned(qh->v1, 8) && moe_aligned(qh->v3, 8) &&
            (rows * ((cols + G - 1) / G) + 3) / 4 <= (int64_t)INT32_MAX;
  if (!ok) return MOE_OK;
  cudaStream_t s;
  MOE_CHECK(ex_stream(ctx, device, &s));
  if (rows * cols == 0) {
    *done = true;
    return MOE_OK;
  }
  bool b8 = qh->bits == 8;
  if (dt == MOE_F32)
    *done = b8 ? ex_fwdq_try<MOE_F32, 8>(s, act, qh, rows, stochastic, seed, call1, call3, h1, h3, a)
               : ex_fwdq_try<MOE_F32, 4>(s, act, qh, rows, stochastic, seed, call1, call3, h1, h3, a);
  else
    *done = b8 ? ex_fwdq_try<MOE_BF16, 8>(s, act, qh, rows, stochastic, seed, call1, call3, h1, h3, a)
               : ex_fwdq_try<MOE_BF16, 4>(s, act, qh, rows, stochastic, seed, call1, call3, h1, h3, a);
  if (*done) MOE_CUDA_CHECK_LAUNCH(ctx, "glu_experts quantizing forward kernel");
  return MOE_OK;
}

template <typename TI>
static void ex_take_launch(unsigned grid, cudaStream_t s, int64_t n, const int64_t *idx,
                           const TI *in, void *out, moe_dtype out_dt) {
  if (out_dt == MOE_F32) ex_take_kernel<TI, float><<<grid, EX_THREADS, 0, s>>>(n, idx, in, (float *)out);
  else if (out_dt == MOE_F64)
    ex_take_kernel<TI, double><<<grid, EX_THREADS, 0, s>>>(n, idx, in, (double *)out);
  else
    ex_take_bf16_out_kernel<TI><<<grid, EX_THREADS, 0, s>>>(n, idx, in, (__nv_bfloat16 *)out);
}

extern "C" moe_status moe_cuda_experts_take(moe_ctx *ctx, int device, int64_t n, const int64_t *idx,
                                            const void *in, moe_dtype in_dt, void *out,
                                            moe_dtype out_dt) {
  cudaStream_t s;
  MOE_CHECK(ex_stream(ctx, device, &s));
  if (n <= 0) return MOE_OK;
  bool ok_in = in_dt == MOE_F32 || in_dt == MOE_F64 || in_dt == MOE_BF16;
  bool ok_out = out_dt == MOE_F32 || out_dt == MOE_F64 || out_dt == MOE_BF16;
  if (!ok_in || !ok_out)
    return moe_error(ctx, MOE_ERR_DTYPE, "glu_experts: gate gather takes f32, f64 or bf16, got %s -> %s",
                     moe_dtype_name(in_dt), moe_dtype_name(out_dt));
  unsigned grid = moe_blocks(n);
  if (in_dt == MOE_BF16) {
    const __nv_bfloat16 *pi = (const __nv_bfloat16 *)in;
    if (out_dt == MOE_BF16)
      ex_take_bf16_kernel<<<grid, EX_THREADS, 0, s>>>(n, idx, pi, (__nv_bfloat16 *)out);
    else if (out_dt == MOE_F32)
      ex_take_bf16_in_kernel<float><<<grid, EX_THREADS, 0, s>>>(n, idx, pi, (float *)out);
    else
      ex_take_bf16_in_kernel<double><<<grid, EX_THREADS, 0, s>>>(n, idx, pi, (double *)out);
  } else if (in_dt == MOE_F32) {
    ex_take_launch<float>(grid, s, n, idx, (const float *)in, out, out_dt);
  } else {
    ex_take_launch<double>(grid, s, n, idx, (const double *)in, out, out_dt);
  }
  MOE_CUDA_CHECK_LAUNCH(ctx, "glu_experts gate gather kernel");
  return MOE_OK;
}

template <typename T>
static void ex_gate_rows_launch(cudaStream_t s, int64_t R, int64_t K, int64_t bs, void *dX0,
                                const void *xs, const int64_t *src, int64_t k, const float *g_rows,
                                void *gxs, void *ys, int64_t N, float *dgate_rows) {
  constexpr int V = 16 / sizeof(T);
  bool vec = K % V == 0 && (bs == 0 || bs % V == 0) && (!dX0 || moe_aligned(dX0, 16)) && moe_aligned(xs, 16) &&
             (!gxs || moe_aligned(gxs, 16)) && (!ys || (N % V == 0 && moe_aligned(ys, 16)));
  int64_t chunks = vec ? K / V : K;
  int threads = (int)((chunks + 31) / 32 * 32);
  if (threads > EX_THREADS) threads = EX_THREADS;
  if (threads < 32) threads = 32;
  unsigned grid = (unsigned)(R < (1 << 30) ? R : (1 << 30));
  if (vec)
    ex_gate_rows_kernel<T, V><<<grid, threads, 0, s>>>(R, K, bs, (T *)dX0, (const T *)xs, src, k,
                                                       g_rows, (T *)gxs, (T *)ys, N, dgate_rows);
  else
    ex_gate_rows_kernel<T, 1><<<grid, threads, 0, s>>>(R, K, bs, (T *)dX0, (const T *)xs, src, k,
                                                       g_rows, (T *)gxs, (T *)ys, N, dgate_rows);
}

extern "C" moe_status moe_cuda_experts_gate_rows(moe_ctx *ctx, int device, moe_dtype dt, int64_t R,
                                                 int64_t K, int64_t bs, void *dX0, const void *xs,
                                                 const int64_t *src, int64_t k, const float *g_rows,
                                                 void *gxs, void *ys, int64_t N, float *dgate_rows) {
  cudaStream_t s;
  MOE_CHECK(ex_stream(ctx, device, &s));
  if (src && bs != 0)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "parallel_linear: gathered rows need a dense layout");
  if (R <= 0) return MOE_OK;
  if (dt == MOE_F32) ex_gate_rows_launch<float>(s, R, K, bs, dX0, xs, src, k, g_rows, gxs, ys, N, dgate_rows);
  else if (dt == MOE_BF16)
    ex_gate_rows_launch<__nv_bfloat16>(s, R, K, bs, dX0, xs, src, k, g_rows, gxs, ys, N, dgate_rows);
  else
    return moe_error(ctx, MOE_ERR_DTYPE, "parallel_linear: CUDA takes f32 or bf16, got %s",
                     moe_dtype_name(dt));
  MOE_CUDA_CHECK_LAUNCH(ctx, "parallel_linear gate backward kernel");
  return MOE_OK;
}
