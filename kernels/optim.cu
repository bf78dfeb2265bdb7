/*
 * optim.cu - CUDA kernels of the optimiser family (entry points in
 * core/optim_cuda.h, called by core/optim.c): the fused AdamW and SGD
 * updates, one launch per parameter tensor, a grid-stride loop of one
 * element per thread; and the multi-tensor AdamW, gradient norm and scale,
 * which cover a list of tensors in a few launches.
 *
 * Multi-tensor launches (as apex/PyTorch multi_tensor_apply): the table of
 * up to OP_LIST_MAX tensors (pointers, sizes, dtypes, per-tensor decay) is
 * passed in the kernel arguments (about 3.3 KB, under the 4 KB limit), each
 * tensor is cut into chunks (MOE_OPTIM_CHUNK elements for the norm and the
 * scale, OP_TILE for AdamW) and block b takes chunks b, b + grid, ... of the
 * launch, finding the tensor of a chunk by a binary search of the table's
 * cumulative chunk counts. A list longer than
 * OP_LIST_MAX tensors takes one more launch per OP_LIST_MAX. The dtypes are
 * resolved once per chunk (templates), not per element.
 *
 * The norm is two passes without atomics: each chunk's sum of squares by 512
 * threads (thread j takes elements j, j + 512, ... then a shared-memory tree)
 * into a scratch array in list order, then one block of 512 sums that array
 * the same way and writes the norm, the clip coefficient and the non-finite
 * flag. core/optim.c's CPU loop follows the same order, so the bits agree.
 *
 * Bits: every operation is an explicit round-to-nearest intrinsic
 * (__fmul_rn, __fadd_rn, __fsqrt_rn, __fdiv_rn and their double twins) in
 * the order of core/optim.c's CPU loop, so no multiply-add is contracted and
 * both devices produce the same values. bf16/f16 parameters are written from
 * the f32 master with core/half.h's round-to-nearest-even, as on the CPU.
 */
#include "common.cuh"
#include "optim_cuda.h"

namespace {

template <typename S> struct OpMath;
template <> struct OpMath<float> {
  static __device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
  static __device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
  static __device__ __forceinline__ float sub(float a, float b) { return __fsub_rn(a, b); }
  static __device__ __forceinline__ float div(float a, float b) { return __fdiv_rn(a, b); }
  static __device__ __forceinline__ float sqrt(float a) { return __fsqrt_rn(a); }
};
template <> struct OpMath<double> {
  static __device__ __forceinline__ double mul(double a, double b) { return __dmul_rn(a, b); }
  static __device__ __forceinline__ double add(double a, double b) { return __dadd_rn(a, b); }
  static __device__ __forceinline__ double sub(double a, double b) { return __dsub_rn(a, b); }
  static __device__ __forceinline__ double div(double a, double b) { return __ddiv_rn(a, b); }
  static __device__ __forceinline__ double sqrt(double a) { return __dsqrt_rn(a); }
};

/* Element i of a float array of dtype dt, converted to S as the CPU does. */
template <typename S> __device__ __forceinline__ S op_load(const void *p, moe_dtype dt, int64_t i) {
  float f;
  switch (dt) {
  case MOE_F64:
    if (std::is_same<S, double>::value) return (S)((const double *)p)[i];
    return (S)__double2float_rn(((const double *)p)[i]);
  case MOE_F32: f = ((const float *)p)[i]; break;
  case MOE_BF16: f = moe_bf16_to_f32(((const moe_bf16 *)p)[i]); break;
  default: f = moe_f16_to_f32(((const moe_f16 *)p)[i]); break;
  }
  return (S)f;
}

template <typename S> __device__ __forceinline__ void op_store(void *p, moe_dtype dt, int64_t i, S w) {
  switch (dt) {
  case MOE_F64: ((double *)p)[i] = (double)w; break;
  case MOE_F32: ((float *)p)[i] = (float)w; break;
  case MOE_BF16: ((moe_bf16 *)p)[i] = moe_f32_to_bf16((float)w); break;
  default: ((moe_f16 *)p)[i] = moe_f32_to_f16((float)w); break;
  }
}

template <typename S> struct OpScalars {
  S decay, beta1, one_m_b1, beta2, one_m_b2, step_size, sqrt_bc2, eps;
};

template <typename S> static OpScalars<S> op_scalars(const moe_optim_scalars *s) {
  OpScalars<S> r;
  r.decay = (S)s->decay;
  r.beta1 = (S)s->beta1;
  r.one_m_b1 = (S)s->one_m_b1;
  r.beta2 = (S)s->beta2;
  r.one_m_b2 = (S)s->one_m_b2;
  r.step_size = (S)s->step_size;
  r.sqrt_bc2 = (S)s->sqrt_bc2;
  r.eps = (S)s->eps;
  return r;
}

template <typename S>
__global__ void op_adamw_kernel(int64_t n, void *param, moe_dtype pdt, const void *grad,
                                moe_dtype gdt, S *m, S *v, S *master, OpScalars<S> s) {
  using M = OpMath<S>;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    S g = op_load<S>(grad, gdt, i);
    S w = master ? master[i] : op_load<S>(param, pdt, i);
    w = M::mul(w, s.decay);
    S mi = M::add(M::mul(s.beta1, m[i]), M::mul(s.one_m_b1, g));
    S vi = M::add(M::mul(s.beta2, v[i]), M::mul(s.one_m_b2, M::mul(g, g)));
    S den = M::add(M::div(M::sqrt(vi), s.sqrt_bc2), s.eps);
    w = M::sub(w, M::mul(s.step_size, M::div(mi, den)));
    m[i] = mi;
    v[i] = vi;
    if (master) master[i] = w;
    op_store<S>(param, pdt, i, w);
  }
}

template <typename S>
__global__ void op_sgd_kernel(int64_t n, void *param, moe_dtype pdt, const void *grad,
                              moe_dtype gdt, S *buf, S *master, OpScalars<S> s) {
  using M = OpMath<S>;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    S g = op_load<S>(grad, gdt, i);
    S w = master ? master[i] : op_load<S>(param, pdt, i);
    S d = M::add(g, M::mul(s.decay, w));
    if (buf) {
      d = M::add(M::mul(s.beta1, buf[i]), d);
      buf[i] = d;
    }
    w = M::sub(w, M::mul(s.step_size, d));
    if (master) master[i] = w;
    op_store<S>(param, pdt, i, w);
  }
}

/* ------------------------------------------------------------ multi-tensor */

#define OP_LIST_MAX 48
#define OP_BLOCK 512 /* threads per block of the multi-tensor kernels (the norm's lanes) */

/* One launch's tensors, in the kernel arguments. */
struct OpList {
  int n;
  int64_t csize;                   /* elements per chunk: MOE_OPTIM_CHUNK, or OP_TILE (AdamW) */
  int64_t chunk0;                  /* the first chunk's index in the whole list (norm) */
  int64_t chunk_end[OP_LIST_MAX];  /* chunks of tensors 0..k, cumulative */
  int64_t numel[OP_LIST_MAX];
  void *param[OP_LIST_MAX];
  const void *grad[OP_LIST_MAX];
  void *m[OP_LIST_MAX], *v[OP_LIST_MAX], *master[OP_LIST_MAX];
  double decay[OP_LIST_MAX];
  unsigned char pdt[OP_LIST_MAX], gdt[OP_LIST_MAX];
  unsigned char vec[OP_LIST_MAX];  /* every array aligned for 4-element vectors (OP_TILE) */
};
static_assert(sizeof(OpList) + sizeof(OpScalars<double>) + 2 * sizeof(void *) <= 4000,
              "the multi-tensor table must fit in the 4 KB of kernel arguments");

/* The tensor of local chunk c and the chunk's element range [lo, hi). */
__device__ __forceinline__ int op_find(const OpList &L, int64_t c, int64_t *lo, int64_t *hi) {
  int a = 0, b = L.n - 1;
  while (a < b) {
    int mid = (a + b) / 2;
    if (c < L.chunk_end[mid]) b = mid;
    else a = mid + 1;
  }
  int64_t first = a ? L.chunk_end[a - 1] : 0;
  *lo = (c - first) * L.csize;
  int64_t end = *lo + L.csize;
  *hi = end < L.numel[a] ? end : L.numel[a];
  return a;
}

/* Conversions as op_load / op_store above (the CPU's op_loadf / op_storef). */
__device__ __forceinline__ void op_cvt(float &o, float x) { o = x; }
__device__ __forceinline__ void op_cvt(float &o, double x) { o = __double2float_rn(x); }
__device__ __forceinline__ void op_cvt(float &o, moe_bf16 x) { o = moe_bf16_to_f32(x); }
__device__ __forceinline__ void op_cvt(float &o, moe_f16 x) { o = moe_f16_to_f32(x); }
__device__ __forceinline__ void op_cvt(double &o, double x) { o = x; }
template <typename G> __device__ __forceinline__ void op_cvt(double &o, G x) {
  float f;
  op_cvt(f, x);
  o = (double)f;
}
__device__ __forceinline__ void op_put(float &o, float w) { o = w; }
__device__ __forceinline__ void op_put(moe_bf16 &o, float w) { o = moe_f32_to_bf16(w); }
__device__ __forceinline__ void op_put(moe_f16 &o, float w) { o = moe_f32_to_f16(w); }
__device__ __forceinline__ void op_put(double &o, double w) { o = w; }

template <typename S, typename G> __device__ __forceinline__ S op_ld(const G *p, int64_t i) {
  S r;
  op_cvt(r, p[i]);
  return r;
}

/* AdamW on elements [lo, hi) of one tensor: op_adamw_kernel's sequence per
 * element, plus the optional gradient scale. OP_ILP elements per thread and
 * pass, all loaded before any is computed or stored (the compiler cannot
 * reorder loads past the stores of possibly aliasing pointers itself), as
 * apex's multi_tensor_apply does; the element order does not change any
 * element's bits. */
#define OP_ILP 4
template <typename S, typename P, typename G>
__device__ __forceinline__ void op_adamw_range(int64_t lo, int64_t hi, P *param, const G *grad,
                                               S *m, S *v, S *master, S decay,
                                               const OpScalars<S> &s, bool scaled, S sc) {
  using M = OpMath<S>;
  const int64_t stride = blockDim.x;
  for (int64_t base = lo + threadIdx.x; base < hi; base += stride * OP_ILP) {
    S g[OP_ILP], w[OP_ILP], mi[OP_ILP], vi[OP_ILP];
#pragma unroll
    for (int j = 0; j < OP_ILP; j++) {
      int64_t i = base + j * stride;
      if (i < hi) {
        g[j] = op_ld<S>(grad, i);
        w[j] = master ? master[i] : op_ld<S>(param, i);
        mi[j] = m[i];
        vi[j] = v[i];
      }
    }
#pragma unroll
    for (int j = 0; j < OP_ILP; j++) {
      S gj = scaled ? M::mul(g[j], sc) : g[j];
      S wj = M::mul(w[j], decay);
      mi[j] = M::add(M::mul(s.beta1, mi[j]), M::mul(s.one_m_b1, gj));
      vi[j] = M::add(M::mul(s.beta2, vi[j]), M::mul(s.one_m_b2, M::mul(gj, gj)));
      S den = M::add(M::div(M::sqrt(vi[j]), s.sqrt_bc2), s.eps);
      w[j] = M::sub(wj, M::mul(s.step_size, M::div(mi[j], den)));
    }
#pragma unroll
    for (int j = 0; j < OP_ILP; j++) {
      int64_t i = base + j * stride;
      if (i < hi) {
        m[i] = mi[j];
        v[i] = vi[j];
        if (master) master[i] = w[j];
        op_put(param[i], w[j]);
      }
    }
  }
}

template <typename S, typename P>
__device__ __forceinline__ void op_adamw_g(const OpList &L, int k, int64_t lo, int64_t hi,
                                           const OpScalars<S> &s, bool scaled, S sc) {
  P *p = (P *)L.param[k];
  S *m = (S *)L.m[k], *v = (S *)L.v[k], *w = (S *)L.master[k];
  S decay = (S)L.decay[k];
  switch ((moe_dtype)L.gdt[k]) {
  case MOE_F32: op_adamw_range<S>(lo, hi, p, (const float *)L.grad[k], m, v, w, decay, s, scaled, sc); break;
  case MOE_F64: op_adamw_range<S>(lo, hi, p, (const double *)L.grad[k], m, v, w, decay, s, scaled, sc); break;
  case MOE_BF16: op_adamw_range<S>(lo, hi, p, (const moe_bf16 *)L.grad[k], m, v, w, decay, s, scaled, sc); break;
  default: op_adamw_range<S>(lo, hi, p, (const moe_f16 *)L.grad[k], m, v, w, decay, s, scaled, sc); break;
  }
}

/* Two blocks of OP_BLOCK per SM at least (registers capped at 64 per thread):
 * 1024 threads with OP_ILP loads in flight each keep the memory busy. */
template <typename S>
__global__ void __launch_bounds__(OP_BLOCK, 2)
op_adamw_multi_kernel(OpList L, OpScalars<S> s, const float *gscale, const float *skip) {
  if (skip && *skip != 0.0f) return; /* NaN != 0 as well */
  bool scaled = gscale != nullptr;
  S sc = scaled ? (S)*gscale : (S)1;
  int64_t total = L.chunk_end[L.n - 1];
  for (int64_t c = blockIdx.x; c < total; c += gridDim.x) {
    int64_t lo, hi;
    int k = op_find(L, c, &lo, &hi);
    if (std::is_same<S, double>::value) {
      op_adamw_g<S, double>(L, k, lo, hi, s, scaled, sc);
    } else {
      switch ((moe_dtype)L.pdt[k]) {
      case MOE_F32: op_adamw_g<S, float>(L, k, lo, hi, s, scaled, sc); break;
      case MOE_BF16: op_adamw_g<S, moe_bf16>(L, k, lo, hi, s, scaled, sc); break;
      default: op_adamw_g<S, moe_f16>(L, k, lo, hi, s, scaled, sc); break;
      }
    }
  }
}

/* ------------------------------------------------- AdamW over small tiles */

/* The multi-tensor AdamW of the f32 compute path cuts its tensors into tiles
 * of OP_TILE elements, one block of OP_TILE_THREADS threads per tile, each
 * thread 4 consecutive elements: with every array aligned (OpList.vec) one
 * 16-byte (f32) or 8-byte (bf16, f16) access per array and thread, else
 * element by element. The blocks in flight then cover one short stretch of
 * each array, which measured faster on an H100 than a grid striding over
 * 64K-element chunks (the norm keeps its MOE_OPTIM_CHUNK chunks: its bits
 * depend on them; AdamW's do not, each element being computed alone). */
#define OP_TILE_THREADS 256
#define OP_TILE (4 * OP_TILE_THREADS)

template <typename T> struct OpVec4;
template <> struct OpVec4<float> {
  union U { float4 v; float e[4]; };
};
template <> struct OpVec4<moe_bf16> {
  union U { uint2 v; moe_bf16 e[4]; };
};
template <> struct OpVec4<moe_f16> {
  union U { uint2 v; moe_f16 e[4]; };
};

template <typename T> __device__ __forceinline__ void op_ld4(const T *p, int64_t i, float o[4]) {
  typename OpVec4<T>::U u;
  u.v = *(const decltype(u.v) *)(p + i);
#pragma unroll
  for (int j = 0; j < 4; j++) op_cvt(o[j], u.e[j]);
}

template <typename T> __device__ __forceinline__ void op_st4(T *p, int64_t i, const float w[4]) {
  typename OpVec4<T>::U u;
#pragma unroll
  for (int j = 0; j < 4; j++) op_put(u.e[j], w[j]);
  *(decltype(u.v) *)(p + i) = u.v;
}

/* Elements [i, i + c) of tensor k, c <= 4: op_adamw_range's sequence per
 * element. */
template <typename P, typename G>
__device__ __forceinline__ void op_adamw4(P *param, const G *grad, float *m, float *v, float *master,
                                          int64_t i, int c, bool vec, float decay,
                                          const OpScalars<float> &s, bool scaled, float sc) {
  using M = OpMath<float>;
  float g[4], w[4], mi[4], vi[4];
  constexpr bool gvec = sizeof(G) <= 4; /* no vectors of f64 gradients */
  vec = vec && gvec && c == 4;
  if constexpr (gvec) {
    if (vec) op_ld4(grad, i, g);
  }
  if (vec) {
    if (master) op_ld4(master, i, w);
    else op_ld4(param, i, w);
    op_ld4(m, i, mi);
    op_ld4(v, i, vi);
  } else {
#pragma unroll
    for (int j = 0; j < 4; j++) {
      if (j < c) {
        g[j] = op_ld<float>(grad, i + j);
        w[j] = master ? master[i + j] : op_ld<float>(param, i + j);
        mi[j] = m[i + j];
        vi[j] = v[i + j];
      }
    }
  }
#pragma unroll
  for (int j = 0; j < 4; j++) {
    float gj = scaled ? M::mul(g[j], sc) : g[j];
    float wj = M::mul(w[j], decay);
    mi[j] = M::add(M::mul(s.beta1, mi[j]), M::mul(s.one_m_b1, gj));
    vi[j] = M::add(M::mul(s.beta2, vi[j]), M::mul(s.one_m_b2, M::mul(gj, gj)));
    float den = M::add(M::div(M::sqrt(vi[j]), s.sqrt_bc2), s.eps);
    w[j] = M::sub(wj, M::mul(s.step_size, M::div(mi[j], den)));
  }
  if (vec) {
    op_st4(m, i, mi);
    op_st4(v, i, vi);
    if (master) op_st4(master, i, w);
    op_st4(param, i, w);
  } else {
#pragma unroll
    for (int j = 0; j < 4; j++) {
      if (j < c) {
        m[i + j] = mi[j];
        v[i + j] = vi[j];
        if (master) master[i + j] = w[j];
        op_put(param[i + j], w[j]);
      }
    }
  }
}

template <typename P>
__device__ __forceinline__ void op_adamw_tile_p(const OpList &L, int k, int64_t i, int c,
                                                const OpScalars<float> &s, bool scaled, float sc) {
  P *p = (P *)L.param[k];
  float *m = (float *)L.m[k], *v = (float *)L.v[k], *w = (float *)L.master[k];
  float decay = (float)L.decay[k];
  bool vec = L.vec[k] != 0;
  switch ((moe_dtype)L.gdt[k]) {
  case MOE_F32: op_adamw4(p, (const float *)L.grad[k], m, v, w, i, c, vec, decay, s, scaled, sc); break;
  case MOE_F64: op_adamw4(p, (const double *)L.grad[k], m, v, w, i, c, false, decay, s, scaled, sc); break;
  case MOE_BF16: op_adamw4(p, (const moe_bf16 *)L.grad[k], m, v, w, i, c, vec, decay, s, scaled, sc); break;
  default: op_adamw4(p, (const moe_f16 *)L.grad[k], m, v, w, i, c, vec, decay, s, scaled, sc); break;
  }
}

/* One tile per block (L.csize == OP_TILE); f32 state, parameters f32, bf16
 * or f16. */
__global__ void __launch_bounds__(OP_TILE_THREADS)
op_adamw_tile_kernel(OpList L, OpScalars<float> s, const float *gscale, const float *skip) {
  if (skip && *skip != 0.0f) return; /* NaN != 0 as well */
  bool scaled = gscale != nullptr;
  float sc = scaled ? *gscale : 1.0f;
  int64_t total = L.chunk_end[L.n - 1];
  for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
    int64_t lo, hi;
    int k = op_find(L, t, &lo, &hi);
    int64_t i = lo + 4 * (int64_t)threadIdx.x;
    if (i >= hi) continue;
    int c = hi - i < 4 ? (int)(hi - i) : 4;
    switch ((moe_dtype)L.pdt[k]) {
    case MOE_F32: op_adamw_tile_p<float>(L, k, i, c, s, scaled, sc); break;
    case MOE_BF16: op_adamw_tile_p<moe_bf16>(L, k, i, c, s, scaled, sc); break;
    default: op_adamw_tile_p<moe_f16>(L, k, i, c, s, scaled, sc); break;
    }
  }
}

/* sh[0] = sum of sh[0..OP_BLOCK) by the pairwise tree of core/optim.c. */
__device__ __forceinline__ void op_tree(float *sh) {
  for (int st = OP_BLOCK / 2; st > 0; st >>= 1) {
    if ((int)threadIdx.x < st) sh[threadIdx.x] = __fadd_rn(sh[threadIdx.x], sh[threadIdx.x + st]);
    __syncthreads();
  }
}

template <typename G>
__device__ __forceinline__ float op_sumsq_range(const G *x, int64_t lo, int64_t hi) {
  float acc = 0.0f;
  for (int64_t i = lo + threadIdx.x; i < hi; i += OP_BLOCK) {
    float f = op_ld<float>(x, i);
    acc = __fadd_rn(acc, __fmul_rn(f, f));
  }
  return acc;
}

/* Pass 1: part[chunk0 + c] = the sum of squares of chunk c. blockDim OP_BLOCK. */
__global__ void __launch_bounds__(OP_BLOCK) op_norm_chunks_kernel(OpList L, float *part) {
  __shared__ float sh[OP_BLOCK];
  int64_t total = L.chunk_end[L.n - 1];
  for (int64_t c = blockIdx.x; c < total; c += gridDim.x) {
    int64_t lo, hi;
    int k = op_find(L, c, &lo, &hi);
    float acc;
    switch ((moe_dtype)L.gdt[k]) {
    case MOE_F32: acc = op_sumsq_range((const float *)L.grad[k], lo, hi); break;
    case MOE_F64: acc = op_sumsq_range((const double *)L.grad[k], lo, hi); break;
    case MOE_BF16: acc = op_sumsq_range((const moe_bf16 *)L.grad[k], lo, hi); break;
    default: acc = op_sumsq_range((const moe_f16 *)L.grad[k], lo, hi); break;
    }
    sh[threadIdx.x] = acc;
    __syncthreads();
    op_tree(sh);
    if (threadIdx.x == 0) part[L.chunk0 + c] = sh[0];
    __syncthreads(); /* sh[0] read before the next chunk overwrites it */
  }
}

/* Pass 2, one block of OP_BLOCK: the norm, the coefficient, the flag. */
__global__ void __launch_bounds__(OP_BLOCK)
op_norm_finish_kernel(const float *part, int64_t np, float max_norm, float *norm, float *coef,
                      float *found_inf) {
  __shared__ float sh[OP_BLOCK];
  float acc = 0.0f;
  for (int64_t i = threadIdx.x; i < np; i += OP_BLOCK) acc = __fadd_rn(acc, part[i]);
  sh[threadIdx.x] = acc;
  __syncthreads();
  op_tree(sh);
  if (threadIdx.x == 0) {
    float total = __fsqrt_rn(sh[0]);
    float q = __fdiv_rn(max_norm, __fadd_rn(total, 1e-6f));
    *norm = total;
    if (coef) *coef = q < 1.0f ? q : 1.0f;
    if (found_inf) *found_inf = isfinite(total) ? 0.0f : 1.0f;
  }
}

template <typename P> __device__ __forceinline__ void op_scale_range(P *p, int64_t lo, int64_t hi, float sc) {
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    float f = op_ld<float>(p, i);
    op_put(p[i], __fmul_rn(f, sc));
  }
}

__global__ void __launch_bounds__(OP_BLOCK) op_scale_multi_kernel(OpList L, const float *scale) {
  float sc = *scale;
  int64_t total = L.chunk_end[L.n - 1];
  for (int64_t c = blockIdx.x; c < total; c += gridDim.x) {
    int64_t lo, hi;
    int k = op_find(L, c, &lo, &hi);
    switch ((moe_dtype)L.pdt[k]) {
    case MOE_F64: {
      double *p = (double *)L.param[k], sd = (double)sc;
      for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) p[i] = __dmul_rn(p[i], sd);
      break;
    }
    case MOE_F32: op_scale_range((float *)L.param[k], lo, hi, sc); break;
    case MOE_BF16: op_scale_range((moe_bf16 *)L.param[k], lo, hi, sc); break;
    default: op_scale_range((moe_f16 *)L.param[k], lo, hi, sc); break;
    }
  }
}

/* Whether every array of item it is aligned for OP_TILE's 4-element vectors
 * (f32 state and master: 16 bytes; the parameter and gradient: 4 elements of
 * their dtype). Tiles start at multiples of 4 elements, so the bases decide. */
static unsigned char op_vec_ok(const moe_optim_item &it) {
  auto al = [](const void *p, size_t a) { return p == nullptr || ((uintptr_t)p % a) == 0; };
  size_t pe = moe_dtype_size(it.pdt), ge = moe_dtype_size(it.gdt);
  if (it.pdt == MOE_F64 || it.gdt == MOE_F64) return 0;
  return al(it.param, 4 * pe) && al(it.grad, 4 * ge) && al(it.m, 16) && al(it.v, 16) &&
         al(it.master, 16);
}

/* Packs the items accepted by `take` into launches of up to OP_LIST_MAX
 * tensors; launch(L) runs one. Empty tensors are left out. */
template <typename Take, typename Launch>
moe_status op_for_lists(const moe_optim_item *items, int64_t n, Take take, Launch launch,
                        int64_t csize = MOE_OPTIM_CHUNK) {
  OpList L;
  memset(&L, 0, sizeof L);
  L.csize = csize;
  int64_t chunks = 0; /* chunks of the whole list before this launch */
  for (int64_t k = 0; k < n; k++) {
    const moe_optim_item &it = items[k];
    if (!take(it) || it.n == 0) continue;
    int j = L.n++;
    int64_t c = (it.n + csize - 1) / csize;
    L.chunk_end[j] = (j ? L.chunk_end[j - 1] : 0) + c;
    L.numel[j] = it.n;
    L.param[j] = it.param;
    L.grad[j] = it.grad;
    L.m[j] = it.m;
    L.v[j] = it.v;
    L.master[j] = it.master;
    L.decay[j] = it.decay;
    L.pdt[j] = (unsigned char)it.pdt;
    L.gdt[j] = (unsigned char)it.gdt;
    L.vec[j] = op_vec_ok(it);
    if (L.n == OP_LIST_MAX) {
      MOE_CHECK(launch(L));
      chunks += L.chunk_end[L.n - 1];
      memset(&L, 0, sizeof L);
      L.csize = csize;
      L.chunk0 = chunks;
    }
  }
  if (L.n > 0) MOE_CHECK(launch(L));
  return MOE_OK;
}

static unsigned op_grid(const OpList &L) {
  int64_t c = L.chunk_end[L.n - 1];
  return (unsigned)(c < (1 << 20) ? c : (1 << 20));
}

/* One block per tile, up to the grid's limit (the kernel strides past it). */
static unsigned op_tile_grid(const OpList &L) {
  int64_t c = L.chunk_end[L.n - 1];
  return (unsigned)(c < INT32_MAX ? c : INT32_MAX);
}

moe_status op_stream(moe_ctx *ctx, int device, cudaStream_t *s) {
  void *p = nullptr;
  MOE_CHECK(moe_cuda_stream(ctx, device, &p));
  *s = (cudaStream_t)p;
  return MOE_OK;
}

} // namespace

extern "C" moe_status moe_cuda_adamw_step(moe_ctx *ctx, int device, int64_t n, void *param,
                                          moe_dtype pdt, const void *grad, moe_dtype gdt, void *m,
                                          void *v, void *master, const moe_optim_scalars *s) {
  if (n == 0) return MOE_OK;
  cudaStream_t stream;
  MOE_CHECK(op_stream(ctx, device, &stream));
  if (pdt == MOE_F64)
    op_adamw_kernel<double><<<moe_blocks(n), MOE_THREADS, 0, stream>>>(
        n, param, pdt, grad, gdt, (double *)m, (double *)v, (double *)master, op_scalars<double>(s));
  else
    op_adamw_kernel<float><<<moe_blocks(n), MOE_THREADS, 0, stream>>>(
        n, param, pdt, grad, gdt, (float *)m, (float *)v, (float *)master, op_scalars<float>(s));
  MOE_CUDA_CHECK_LAUNCH(ctx, "adamw_step kernel");
  return MOE_OK;
}

extern "C" moe_status moe_cuda_sgd_step(moe_ctx *ctx, int device, int64_t n, void *param,
                                        moe_dtype pdt, const void *grad, moe_dtype gdt, void *buf,
                                        void *master, const moe_optim_scalars *s) {
  if (n == 0) return MOE_OK;
  cudaStream_t stream;
  MOE_CHECK(op_stream(ctx, device, &stream));
  if (pdt == MOE_F64)
    op_sgd_kernel<double><<<moe_blocks(n), MOE_THREADS, 0, stream>>>(
        n, param, pdt, grad, gdt, (double *)buf, (double *)master, op_scalars<double>(s));
  else
    op_sgd_kernel<float><<<moe_blocks(n), MOE_THREADS, 0, stream>>>(
        n, param, pdt, grad, gdt, (float *)buf, (float *)master, op_scalars<float>(s));
  MOE_CUDA_CHECK_LAUNCH(ctx, "sgd_step kernel");
  return MOE_OK;
}

extern "C" moe_status moe_cuda_adamw_multi(moe_ctx *ctx, int device, const moe_optim_item *items,
                                           int64_t n, const moe_optim_scalars *s,
                                           const float *grad_scale, const float *skip) {
  cudaStream_t stream;
  MOE_CHECK(op_stream(ctx, device, &stream));
  OpScalars<float> sf = op_scalars<float>(s);
  OpScalars<double> sd = op_scalars<double>(s);
  MOE_CHECK(op_for_lists(
      items, n, [](const moe_optim_item &it) { return it.pdt != MOE_F64; },
      [&](const OpList &L) {
        op_adamw_tile_kernel<<<op_tile_grid(L), OP_TILE_THREADS, 0, stream>>>(L, sf, grad_scale, skip);
        MOE_CUDA_CHECK_LAUNCH(ctx, "adamw_step_multi kernel");
        return MOE_OK;
      },
      OP_TILE));
  MOE_CHECK(op_for_lists(
      items, n, [](const moe_optim_item &it) { return it.pdt == MOE_F64; },
      [&](const OpList &L) {
        op_adamw_multi_kernel<double><<<op_grid(L), OP_BLOCK, 0, stream>>>(L, sd, grad_scale, skip);
        MOE_CUDA_CHECK_LAUNCH(ctx, "adamw_step_multi kernel");
        return MOE_OK;
      }));
  return MOE_OK;
}

extern "C" moe_status moe_cuda_grad_norm_multi(moe_ctx *ctx, int device,
                                               const moe_optim_item *items, int64_t n,
                                               float max_norm, float *norm, float *coef,
                                               float *found_inf) {
  cudaStream_t stream;
  MOE_CHECK(op_stream(ctx, device, &stream));
  int64_t np = 0;
  for (int64_t k = 0; k < n; k++) np += (items[k].n + MOE_OPTIM_CHUNK - 1) / MOE_OPTIM_CHUNK;
  MoeScratch part(ctx, device);
  MOE_CHECK(part.alloc(sizeof(float) * (size_t)(np > 0 ? np : 1)));
  float *pp = (float *)part.ptr;
  MOE_CHECK(op_for_lists(
      items, n, [](const moe_optim_item &) { return true; },
      [&](const OpList &L) {
        op_norm_chunks_kernel<<<op_grid(L), OP_BLOCK, 0, stream>>>(L, pp);
        MOE_CUDA_CHECK_LAUNCH(ctx, "grad_norm_multi kernel");
        return MOE_OK;
      }));
  op_norm_finish_kernel<<<1, OP_BLOCK, 0, stream>>>(pp, np, max_norm, norm, coef, found_inf);
  MOE_CUDA_CHECK_LAUNCH(ctx, "grad_norm_multi finishing kernel");
  return MOE_OK;
}

extern "C" moe_status moe_cuda_scale_multi(moe_ctx *ctx, int device, const moe_optim_item *items,
                                           int64_t n, const float *scale) {
  cudaStream_t stream;
  MOE_CHECK(op_stream(ctx, device, &stream));
  return op_for_lists(
      items, n, [](const moe_optim_item &) { return true; },
      [&](const OpList &L) {
        op_scale_multi_kernel<<<op_grid(L), OP_BLOCK, 0, stream>>>(L, scale);
        MOE_CUDA_CHECK_LAUNCH(ctx, "scale_multi kernel");
        return MOE_OK;
      });
}
