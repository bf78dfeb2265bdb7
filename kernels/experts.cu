/*
 * experts.cu - CUDA kernels of the experts family (entry points in
 * core/experts_cuda.h, called by core/experts.c): the GLU activation
 * a = act(h1) * h3, its fused backward pass (gate scaling, per-row gate
 * gradient, activation derivative) over a dense or block-sparse hidden, and
 * the index gather that moves gates between assignment and row order.
 *
 * Math in f32 (bf16 storage, f32 accumulation). The per-row gate gradient is
 * one thread block per row reduced in a fixed tree order: deterministic, no
 * atomics. Index math is int64.
 */
#include <cuda_bf16.h>

#include "common.cuh"
#include "experts_cuda.h"

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

/* act(v) and act'(v); act as moe_glu_activation (0 silu, 1 gelu, 2 gelu_tanh). */
__device__ __forceinline__ void ex_act(int act, float v, float *f, float *df) {
  if (act == 0) {
    float s = 1.0f / (1.0f + expf(-v));
    *f = v * s;
    *df = s * (1.0f + v * (1.0f - s));
  } else if (act == 1) {
    float c = 0.5f * (1.0f + erff(v * 0.70710678118654752440f));
    *f = v * c;
    *df = c + v * expf(-0.5f * v * v) * 0.39894228040143267794f;
  } else {
    const float k0 = 0.79788456080286535588f, k1 = 0.044715f;
    float t = tanhf(k0 * (v + k1 * v * v * v));
    *f = 0.5f * v * (1.0f + t);
    *df = 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * k0 * (1.0f + 3.0f * k1 * v * v);
  }
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
template <typename T, int V>
__global__ void ex_glu_bwd_kernel(int act, int64_t R, int64_t f, int64_t bs, T *dA0, const T *h1,
                                  const T *h3, const T *a, const float *g_rows, T *dh3, T *ga,
                                  float *dgate_rows) {
  __shared__ float warp_sums[EX_THREADS / 32];
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    float g = g_rows ? g_rows[r] : 1.0f, dot = 0.0f;
    int64_t base, F = bs > 0 ? f / bs : 0;
    if (bs == 0) base = r * f;
    else base = (r / bs) * F * bs * bs + (r % bs) * bs;
    for (int64_t c = (int64_t)threadIdx.x * V; c < f; c += (int64_t)blockDim.x * V) {
      int64_t i = bs == 0 ? base + c : base + (c / bs) * bs * bs + c % bs;
      ExVec<T, V> v1 = *(const ExVec<T, V> *)(h1 + i), v3 = *(const ExVec<T, V> *)(h3 + i),
                  d0 = *(const ExVec<T, V> *)(dA0 + i), va, o1, o3, og;
      if (a) va = *(const ExVec<T, V> *)(a + i);
#pragma unroll
      for (int j = 0; j < V; j++) {
        float x1 = ex_load(v1.v, j), x3 = ex_load(v3.v, j), dd = ex_load(d0.v, j);
        float fa, dfa;
        ex_act(act, x1, &fa, &dfa);
        float av = a ? ex_load(va.v, j) : fa * x3;
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
    if (dgate_rows) {
      for (int o = 16; o > 0; o >>= 1) dot += __shfl_down_sync(0xffffffffu, dot, o);
      if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = dot;
      __syncthreads();
      if (threadIdx.x == 0) {
        float s = 0.0f;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) s += warp_sums[w];
        dgate_rows[r] = s;
      }
      __syncthreads();
    }
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
  MOE_KCHECK(ctx, "glu_experts forward kernel");
  return MOE_OK;
}

template <typename T>
static void ex_bwd_launch(cudaStream_t s, int act, int64_t R, int64_t f, int64_t bs, void *dA0,
                          const void *h1, const void *h3, const void *a, const float *g_rows,
                          void *dh3, void *ga, float *dgate_rows) {
  constexpr int V = 16 / sizeof(T);
  bool vec = f % V == 0 && (bs == 0 || bs % V == 0) && moe_aligned(dA0, 16) &&
             moe_aligned(h1, 16) && moe_aligned(h3, 16) && moe_aligned(dh3, 16) &&
             (!a || moe_aligned(a, 16)) && (!ga || moe_aligned(ga, 16));
  int64_t chunks = vec ? f / V : f;
  int threads = (int)((chunks + 31) / 32 * 32);
  if (threads > EX_THREADS) threads = EX_THREADS;
  unsigned grid = (unsigned)(R < (1 << 30) ? R : (1 << 30));
  if (vec)
    ex_glu_bwd_kernel<T, V><<<grid, threads, 0, s>>>(act, R, f, bs, (T *)dA0, (const T *)h1,
                                                     (const T *)h3, (const T *)a, g_rows,
                                                     (T *)dh3, (T *)ga, dgate_rows);
  else
    ex_glu_bwd_kernel<T, 1><<<grid, threads, 0, s>>>(act, R, f, bs, (T *)dA0, (const T *)h1,
                                                     (const T *)h3, (const T *)a, g_rows,
                                                     (T *)dh3, (T *)ga, dgate_rows);
}

extern "C" moe_status moe_cuda_experts_glu_bwd(moe_ctx *ctx, int device, moe_dtype dt, int act,
                                               int64_t R, int64_t f, int64_t bs, void *dA0,
                                               const void *h1, const void *h3, const void *a,
                                               const float *g_rows, void *dh3, void *ga,
                                               float *dgate_rows) {
  cudaStream_t s;
  MOE_CHECK(ex_stream(ctx, device, &s));
  if (R <= 0 || f <= 0) return MOE_OK;
  if (dt == MOE_F32) ex_bwd_launch<float>(s, act, R, f, bs, dA0, h1, h3, a, g_rows, dh3, ga, dgate_rows);
  else if (dt == MOE_BF16)
    ex_bwd_launch<__nv_bfloat16>(s, act, R, f, bs, dA0, h1, h3, a, g_rows, dh3, ga, dgate_rows);
  else
    return moe_error(ctx, MOE_ERR_DTYPE, "glu_experts: CUDA takes f32 or bf16, got %s",
                     moe_dtype_name(dt));
  MOE_KCHECK(ctx, "glu_experts backward kernel");
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
  MOE_KCHECK(ctx, "glu_experts gate gather kernel");
  return MOE_OK;
}
