/*
 * reduce.cu - CUDA launchers of the reductions (core/reduce_cuda.h): dim
 * reductions with combinable states, their elementwise backward, the max /
 * min backward and cumsum. The row kernels of the family (softmax,
 * log_softmax: softmax.cu; layer_norm, rms_norm: norm.cu; cross_entropy:
 * loss.cu) share kernels/rows.cuh.
 *
 * Determinism: no atomics. A dim reduction combines per-thread states in a
 * fixed tree; a long reduction split into segments writes one state per
 * segment and a second kernel combines them in segment order. Column sums
 * of the norm backward (weight and bias gradients) go through per-block
 * partial rows (accumulated in registers over each block's rows) summed by
 * a second kernel in a fixed order, so the result depends only on the
 * launch geometry, fixed per GPU model and shape (SM count, occupancy).
 *
 * Index math is int64 where a product can pass 2^31.
 */
#include "common.cuh"
#include "reduce_cuda.h"
#include "rows.cuh"

#include <math.h>

/* ------------------------------------------------------------ helpers */

template <moe_dtype DT> __device__ __forceinline__ float moe_ldf(const void *p, int64_t i) {
  return moe_load_as<float, DT>(((const moe_st_t<DT> *)p)[i]);
}

/* -------------------------------------------------- reduction states */

template <typename A> struct MoeRedSt {
  A a, b;     /* see moe_red_kind */
  int64_t n;  /* elements seen */
  int64_t i;  /* MAX/MIN index */
};

template <typename A> __device__ __forceinline__ bool moe_isnan(A x) {
  if constexpr (std::is_same_v<A, int64_t>) return false;
  else return x != x;
}

template <int K, typename A> __device__ __forceinline__ void moe_st_init(MoeRedSt<A> &s) {
  s.a = 0;
  s.b = 0;
  s.n = 0;
  s.i = 0;
  if constexpr (K == MOE_RED_LSE) s.a = -(A)INFINITY;
}

template <int K, typename A>
__device__ __forceinline__ void moe_st_push(MoeRedSt<A> &s, A x, int64_t j, A p) {
  if constexpr (K == MOE_RED_SUM || K == MOE_RED_MEAN) {
    if constexpr (std::is_same_v<A, int64_t>) s.a = (int64_t)((uint64_t)s.a + (uint64_t)x);
    else s.a += x;
  } else if constexpr (K == MOE_RED_NORM1) {
    s.a += fabs(x);
  } else if constexpr (K == MOE_RED_NORM2) {
    s.a += x * x;
  } else if constexpr (K == MOE_RED_NORMP) {
    s.a += pow(fabs(x), p);
  } else if constexpr (K == MOE_RED_NORMINF) {
    A ax = fabs(x);
    if (!moe_isnan(s.a) && (moe_isnan(ax) || ax > s.a)) s.a = ax;
  } else if constexpr (K == MOE_RED_MAX) {
    if (s.n == 0 || (!moe_isnan(s.a) && (moe_isnan(x) || x > s.a))) s.a = x, s.i = j;
  } else if constexpr (K == MOE_RED_MIN) {
    if (s.n == 0 || (!moe_isnan(s.a) && (moe_isnan(x) || x < s.a))) s.a = x, s.i = j;
  } else if constexpr (K == MOE_RED_LSE) {
    if (x > s.a) {
      s.b = s.b * exp(s.a - x) + (A)1;
      s.a = x;
    } else if (x == s.a) {
      s.b += (A)1;
    } else {
      s.b += exp(x - s.a);
    }
  } else if constexpr (K == MOE_RED_VAR) {
    A d = x - s.a;
    s.a += d / (A)(s.n + 1);
    s.b += d * (x - s.a);
  }
  s.n++;
}

/* l = l (+) r; for MAX/MIN ties go to the smaller index, so the result
 * does not depend on which thread saw which element. */
template <int K, typename A> __device__ __forceinline__ void moe_st_combine(MoeRedSt<A> &l,
                                                                           const MoeRedSt<A> &r) {
  if (r.n == 0) return;
  if (l.n == 0) {
    l = r;
    return;
  }
  if constexpr (K == MOE_RED_SUM || K == MOE_RED_MEAN) {
    if constexpr (std::is_same_v<A, int64_t>) l.a = (int64_t)((uint64_t)l.a + (uint64_t)r.a);
    else l.a += r.a;
  } else if constexpr (K == MOE_RED_NORM1 || K == MOE_RED_NORM2 || K == MOE_RED_NORMP) {
    l.a += r.a;
  } else if constexpr (K == MOE_RED_NORMINF) {
    if (!moe_isnan(l.a) && (moe_isnan(r.a) || r.a > l.a)) l.a = r.a;
  } else if constexpr (K == MOE_RED_MAX || K == MOE_RED_MIN) {
    bool ln = moe_isnan(l.a), rn = moe_isnan(r.a);
    bool take;
    if (ln || rn) take = rn && (!ln || r.i < l.i);
    else if (r.a == l.a) take = r.i < l.i;
    else take = K == MOE_RED_MAX ? r.a > l.a : r.a < l.a;
    if (take) l.a = r.a, l.i = r.i;
  } else if constexpr (K == MOE_RED_LSE) {
    if (r.a > l.a) {
      l.b = l.b * exp(l.a - r.a) + r.b;
      l.a = r.a;
    } else if (r.a == l.a) {
      l.b += r.b;
    } else {
      l.b += r.b * exp(r.a - l.a);
    }
  } else if constexpr (K == MOE_RED_VAR) {
    A nl = (A)l.n, nr = (A)r.n, nn = nl + nr;
    A d = r.a - l.a;
    l.a += d * nr / nn;
    l.b += r.b + d * d * nl * nr / nn;
  }
  l.n += r.n;
}

template <int K, typename A>
__device__ __forceinline__ A moe_st_final(const MoeRedSt<A> &s, int64_t inner, double arg) {
  if constexpr (K == MOE_RED_MEAN) return s.a / (A)inner;
  else if constexpr (K == MOE_RED_NORM2) return sqrt(s.a);
  else if constexpr (K == MOE_RED_NORMP) return pow(s.a, (A)(1.0 / arg));
  else if constexpr (K == MOE_RED_LSE) return s.a + log(s.b);
  else if constexpr (K == MOE_RED_VAR) {
    A den = (A)s.n - (A)arg;
    return s.b / (den > 0 ? den : (A)0);
  } else return s.a;
}

/* Geometry by value: dims innermost first. */
struct MoeRedGeomK {
  int ondim, indim;
  int64_t oshape[MOE_MAX_DIMS], ostride[MOE_MAX_DIMS];
  int64_t ishape[MOE_MAX_DIMS], istride[MOE_MAX_DIMS];
  int64_t outer, inner;
};

__device__ __forceinline__ int64_t moe_red_off(int nd, const int64_t *shape,
                                               const int64_t *stride, int64_t i) {
  if (nd == 1) return i * stride[0];
  int64_t off = 0;
#pragma unroll
  for (int d = 0; d < MOE_MAX_DIMS; d++) {
    if (d >= nd) break;
    if (d == nd - 1) {
      off += i * stride[d];
      break;
    }
    int64_t q = i / shape[d];
    off += (i - q * shape[d]) * stride[d];
    i = q;
  }
  return off;
}


/*
 * Block (bx, by): thread (tx, ty) reduces output blockIdx.x * bx + tx over
 * elements seg_start + ty, + by, ... of segment blockIdx.y; the by states
 * are combined in a fixed tree. One segment: finalise and write; several:
 * write the state to part[o * nseg + seg].
 */
template <moe_dtype DT, moe_dtype OD, int K, typename A>
__global__ void moe_red_kernel(const void *__restrict__ x, MoeRedGeomK g, int64_t seglen,
                               double arg, void *out, int64_t *idx, MoeRedSt<A> *part) {
  extern __shared__ unsigned char moe_red_smem[];
  MoeRedSt<A> *sm = (MoeRedSt<A> *)moe_red_smem;
  int tx = threadIdx.x, ty = threadIdx.y, bx = blockDim.x, by = blockDim.y;
  int64_t o = (int64_t)blockIdx.x * bx + tx;
  int64_t seg = blockIdx.y, nseg = gridDim.y;
  MoeRedSt<A> s;
  moe_st_init<K, A>(s);
  A p = (A)arg;
  if (o < g.outer) {
    int64_t base = moe_red_off(g.ondim, g.oshape, g.ostride, o);
    int64_t j0 = seg * seglen, j1 = j0 + seglen < g.inner ? j0 + seglen : g.inner;
    const moe_st_t<DT> *px = (const moe_st_t<DT> *)x;
    if (g.indim == 1) {
      int64_t is = g.istride[0];
      for (int64_t j = j0 + ty; j < j1; j += by)
        moe_st_push<K, A>(s, moe_load_as<A, DT>(px[base + j * is]), j, p);
    } else {
      for (int64_t j = j0 + ty; j < j1; j += by)
        moe_st_push<K, A>(s, moe_load_as<A, DT>(px[base + moe_red_off(g.indim, g.ishape, g.istride, j)]),
                          j, p);
    }
  }
  if (by > 1) {
    sm[ty * bx + tx] = s;
    __syncthreads();
    for (int h = by / 2; h > 0; h >>= 1) {
      if (ty < h) {
        MoeRedSt<A> l = sm[ty * bx + tx];
        moe_st_combine<K, A>(l, sm[(ty + h) * bx + tx]);
        sm[ty * bx + tx] = l;
      }
      __syncthreads();
    }
    s = sm[tx];
  }
  if (ty != 0 || o >= g.outer) return;
  if (nseg == 1) {
    ((moe_st_t<OD> *)out)[o] = moe_store_from<OD, A>(moe_st_final<K, A>(s, g.inner, arg));
    if (idx) idx[o] = s.i;
  } else {
    part[o * nseg + seg] = s;
  }
}

template <moe_dtype OD, int K, typename A>
__global__ void moe_red_finish_kernel(const MoeRedSt<A> *__restrict__ part, int64_t outer,
                                      int64_t nseg, int64_t inner, double arg, void *out,
                                      int64_t *idx) {
  int64_t o = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (o >= outer) return;
  MoeRedSt<A> s = part[o * nseg];
  for (int64_t k = 1; k < nseg; k++) moe_st_combine<K, A>(s, part[o * nseg + k]);
  ((moe_st_t<OD> *)out)[o] = moe_store_from<OD, A>(moe_st_final<K, A>(s, inner, arg));
  if (idx) idx[o] = s.i;
}

template <moe_dtype DT, moe_dtype OD, int K, typename A>
static moe_status moe_red_launch(moe_ctx *ctx, int device, cudaStream_t stream,
                                 const moe_red_geom *g, double arg, void *out, int64_t *idx) {
  MoeRedGeomK k;
  memset(&k, 0, sizeof(k));
  k.ondim = g->ondim;
  k.indim = g->indim;
  for (int d = 0; d < g->ondim; d++) {
    k.oshape[d] = g->oshape[g->ondim - 1 - d];
    k.ostride[d] = g->ostride[g->ondim - 1 - d];
  }
  for (int d = 0; d < g->indim; d++) {
    k.ishape[d] = g->ishape[g->indim - 1 - d];
    k.istride[d] = g->istride[g->indim - 1 - d];
  }
  if (k.ondim == 0) k.ondim = 1, k.oshape[0] = 1, k.ostride[0] = 0;
  if (k.indim == 0) k.indim = 1, k.ishape[0] = 1, k.istride[0] = 0;
  k.outer = g->outer;
  k.inner = g->inner;
  /* Rows (the innermost reduced stride is 1, or few outputs): threads of a
   * block share one output. Columns: a warp takes 32 neighbouring outputs. */
  bool rows = k.istride[0] == 1 || k.outer < 32 || k.ostride[0] != 1;
  unsigned bx, by;
  if (rows) {
    by = moe_pow2_ceil(k.inner);
    if (by > 256) by = 256;
    if (by < 32) by = 32;
    bx = 256 / by;
  } else {
    bx = 32;
    by = 8;
  }
  int64_t gx = (k.outer + bx - 1) / bx;
  int64_t nseg = 1;
  int64_t want = 4LL * moe_red_sm_count(device);
  if (gx < want && k.inner > (int64_t)by * 64) {
    nseg = (want + gx - 1) / gx;
    int64_t most = (k.inner + (int64_t)by * 64 - 1) / ((int64_t)by * 64);
    if (nseg > most) nseg = most;
    if (nseg > 1024) nseg = 1024;
  }
  int64_t seglen = (k.inner + nseg - 1) / nseg;
  nseg = (k.inner + seglen - 1) / seglen;
  if (gx > 0x7fffffffLL)
    return moe_error(ctx, MOE_ERR_NOT_SUPPORTED, "cuda reduce: %lld outputs is too many",
                     (long long)k.outer);
  MoeRedSt<A> *part = NULL;
  MoeScratch pblock(ctx, device);
  if (nseg > 1) {
    MOE_CHECK(pblock.alloc(sizeof(MoeRedSt<A>) * (size_t)(k.outer * nseg)));
    part = (MoeRedSt<A> *)pblock.ptr;
  }
  dim3 block(bx, by), grid((unsigned)gx, (unsigned)nseg);
  size_t smem = by > 1 ? sizeof(MoeRedSt<A>) * bx * by : 0;
  moe_red_kernel<DT, OD, K, A><<<grid, block, smem, stream>>>(g->data, k, seglen, arg, out, idx,
                                                              part);
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess && nseg > 1) {
    moe_red_finish_kernel<OD, K, A><<<moe_blocks(k.outer), MOE_THREADS, 0, stream>>>(
        part, k.outer, nseg, k.inner, arg, out, idx);
    e = cudaGetLastError();
  }
  pblock.release();
  if (e != cudaSuccess)
    return moe_error(ctx, MOE_ERR_CUDA, "cuda reduce kernel failed: %s (%s)", cudaGetErrorString(e),
                     cudaGetErrorName(e));
  return MOE_OK;
}

template <moe_dtype DT, int K>
static moe_status moe_red_float(moe_ctx *ctx, int device, cudaStream_t s, const moe_red_geom *g,
                                double arg, void *out, int64_t *idx) {
  using A = std::conditional_t<DT == MOE_F64, double, float>;
  return moe_red_launch<DT, DT, K, A>(ctx, device, s, g, arg, out, idx);
}

template <moe_dtype DT>
static moe_status moe_red_float_kind(moe_ctx *ctx, int device, cudaStream_t s, moe_red_kind kind,
                                     const moe_red_geom *g, double arg, void *out, int64_t *idx) {
  switch (kind) {
    case MOE_RED_SUM: return moe_red_float<DT, MOE_RED_SUM>(ctx, device, s, g, arg, out, idx);
    case MOE_RED_MEAN: return moe_red_float<DT, MOE_RED_MEAN>(ctx, device, s, g, arg, out, idx);
    case MOE_RED_MAX: return moe_red_float<DT, MOE_RED_MAX>(ctx, device, s, g, arg, out, idx);
    case MOE_RED_MIN: return moe_red_float<DT, MOE_RED_MIN>(ctx, device, s, g, arg, out, idx);
    case MOE_RED_NORM1: return moe_red_float<DT, MOE_RED_NORM1>(ctx, device, s, g, arg, out, idx);
    case MOE_RED_NORM2: return moe_red_float<DT, MOE_RED_NORM2>(ctx, device, s, g, arg, out, idx);
    case MOE_RED_NORMP: return moe_red_float<DT, MOE_RED_NORMP>(ctx, device, s, g, arg, out, idx);
    case MOE_RED_NORMINF: return moe_red_float<DT, MOE_RED_NORMINF>(ctx, device, s, g, arg, out, idx);
    case MOE_RED_LSE: return moe_red_float<DT, MOE_RED_LSE>(ctx, device, s, g, arg, out, idx);
    case MOE_RED_VAR: return moe_red_float<DT, MOE_RED_VAR>(ctx, device, s, g, arg, out, idx);
    default: return moe_error(ctx, MOE_ERR_INTERNAL, "cuda reduce: unknown kind %d", (int)kind);
  }
}

template <moe_dtype DT>
static moe_status moe_red_int_kind(moe_ctx *ctx, int device, cudaStream_t s, moe_red_kind kind,
                                   const moe_red_geom *g, void *out, int64_t *idx) {
  switch (kind) {
    case MOE_RED_SUM: return moe_red_launch<DT, MOE_I64, MOE_RED_SUM, int64_t>(ctx, device, s, g, 0, out, idx);
    case MOE_RED_MAX: return moe_red_launch<DT, DT, MOE_RED_MAX, int64_t>(ctx, device, s, g, 0, out, idx);
    case MOE_RED_MIN: return moe_red_launch<DT, DT, MOE_RED_MIN, int64_t>(ctx, device, s, g, 0, out, idx);
    default:
      return moe_error(ctx, MOE_ERR_DTYPE, "cuda reduce: %s is not supported for integers",
                       moe_dtype_name(DT));
  }
}

extern "C" moe_status moe_cuda_reduce(moe_ctx *ctx, int device, moe_red_kind kind,
                                      const moe_red_geom *g, double arg, void *out, moe_dtype odt,
                                      int64_t *idx) {
  if (g->outer == 0) return MOE_OK;
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  cudaStream_t s = (cudaStream_t)stream;
  switch (g->dtype) {
    case MOE_F32: return moe_red_float_kind<MOE_F32>(ctx, device, s, kind, g, arg, out, idx);
    case MOE_BF16: return moe_red_float_kind<MOE_BF16>(ctx, device, s, kind, g, arg, out, idx);
    case MOE_F16: return moe_red_float_kind<MOE_F16>(ctx, device, s, kind, g, arg, out, idx);
    case MOE_I8: return moe_red_int_kind<MOE_I8>(ctx, device, s, kind, g, out, idx);
    case MOE_U8: return moe_red_int_kind<MOE_U8>(ctx, device, s, kind, g, out, idx);
    case MOE_I32: return moe_red_int_kind<MOE_I32>(ctx, device, s, kind, g, out, idx);
    case MOE_I64: return moe_red_int_kind<MOE_I64>(ctx, device, s, kind, g, out, idx);
    case MOE_BOOL: return moe_red_int_kind<MOE_BOOL>(ctx, device, s, kind, g, out, idx);
    default: break;
  }
  return moe_error(ctx, MOE_ERR_DTYPE, "cuda reduce: dtype %s is not supported on CUDA",
                   moe_dtype_name(g->dtype));
}

/* ------------------------------------------------ reduction backward */

struct MoeDyn5 {
  void *p[5];
  moe_dtype dt[5];
};

template <int K>
__global__ void moe_red_bwd_kernel(int64_t n, MoeDyn5 v, MoeGeom<5> g, float scale, float p) {
  int64_t nthreads = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += nthreads) {
    int64_t off[5];
    moe_geom_offsets<5>(g, i, off);
    float gv = moe_dyn_load<float>(v.p[2], v.dt[2], off[2]);
    float r;
    if constexpr (K == MOE_RED_SUM || K == MOE_RED_MEAN) {
      r = gv * scale;
    } else {
      float x = moe_dyn_load<float>(v.p[1], v.dt[1], off[1]);
      if constexpr (K == MOE_RED_VAR) {
        float m = moe_dyn_load<float>(v.p[4], v.dt[4], off[4]);
        r = gv * scale * (x - m);
      } else {
        float y = moe_dyn_load<float>(v.p[3], v.dt[3], off[3]);
        if constexpr (K == MOE_RED_NORM1) r = x > 0 ? gv : x < 0 ? -gv : 0.f;
        else if constexpr (K == MOE_RED_NORM2) r = y == 0 ? 0.f : gv * x / y;
        else if constexpr (K == MOE_RED_NORMP)
          r = y == 0 ? 0.f : gv * (x > 0 ? 1.f : x < 0 ? -1.f : 0.f) * powf(fabsf(x) / y, p - 1.f);
        else if constexpr (K == MOE_RED_NORMINF)
          r = fabsf(x) == y && y != 0 ? (x > 0 ? gv : -gv) : 0.f;
        else r = gv * expf(x - y); /* LSE */
      }
    }
    moe_dyn_store<float>(v.p[0], v.dt[0], off[0], r);
  }
}

extern "C" moe_status moe_cuda_reduce_backward(moe_ctx *ctx, int device, moe_red_kind kind,
                                               const moe_kview *gin, const moe_kview *x,
                                               const moe_kview *g, const moe_kview *y,
                                               const moe_kview *aux, double scale,
                                               double arg) {
  int64_t n = 1;
  for (int d = 0; d < gin->ndim; d++) n *= gin->shape[d];
  if (n == 0) return MOE_OK;
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  /* views without data (unused by this kind) take gin's layout */
  moe_kview vv[5] = {*gin, *x, *g, *y, *aux};
  for (int k = 1; k < 5; k++)
    if (!vv[k].data) {
      vv[k] = *gin;
      vv[k].data = gin->data;
    }
  const moe_kview *pv[5] = {&vv[0], &vv[1], &vv[2], &vv[3], &vv[4]};
  MoeGeom<5> geo;
  moe_geom_init<5>(&geo, pv);
  MoeDyn5 d;
  for (int k = 0; k < 5; k++) d.p[k] = vv[k].data, d.dt[k] = vv[k].dtype;
  cudaStream_t s = (cudaStream_t)stream;
  unsigned nb = moe_blocks(n);
  float sc = (float)scale, p = (float)arg;
  switch (kind) {
    case MOE_RED_SUM: moe_red_bwd_kernel<MOE_RED_SUM><<<nb, MOE_THREADS, 0, s>>>(n, d, geo, sc, p); break;
    case MOE_RED_MEAN: moe_red_bwd_kernel<MOE_RED_MEAN><<<nb, MOE_THREADS, 0, s>>>(n, d, geo, sc, p); break;
    case MOE_RED_NORM1: moe_red_bwd_kernel<MOE_RED_NORM1><<<nb, MOE_THREADS, 0, s>>>(n, d, geo, sc, p); break;
    case MOE_RED_NORM2: moe_red_bwd_kernel<MOE_RED_NORM2><<<nb, MOE_THREADS, 0, s>>>(n, d, geo, sc, p); break;
    case MOE_RED_NORMP: moe_red_bwd_kernel<MOE_RED_NORMP><<<nb, MOE_THREADS, 0, s>>>(n, d, geo, sc, p); break;
    case MOE_RED_NORMINF: moe_red_bwd_kernel<MOE_RED_NORMINF><<<nb, MOE_THREADS, 0, s>>>(n, d, geo, sc, p); break;
    case MOE_RED_LSE: moe_red_bwd_kernel<MOE_RED_LSE><<<nb, MOE_THREADS, 0, s>>>(n, d, geo, sc, p); break;
    case MOE_RED_VAR: moe_red_bwd_kernel<MOE_RED_VAR><<<nb, MOE_THREADS, 0, s>>>(n, d, geo, sc, p); break;
    default:
      return moe_error(ctx, MOE_ERR_INTERNAL, "cuda reduce backward: kind %d has no elementwise rule",
                       (int)kind);
  }
  MOE_CUDA_CHECK_LAUNCH(ctx, "cuda reduce backward kernel");
  return MOE_OK;
}

/* ------------------------------------------------- max / min backward */

template <typename T>
__global__ void moe_red_scatter_kernel(T *gin, const T *g, const int64_t *idx, int64_t outer,
                                       int64_t nd, int64_t post) {
  int64_t nthreads = (int64_t)gridDim.x * blockDim.x;
  for (int64_t o = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; o < outer; o += nthreads) {
    int64_t k = idx[o];
    if (k < 0 || k >= nd) continue; /* not produced by max/min; never write out of bounds */
    gin[(o / post * nd + k) * post + o % post] = g[o];
  }
}

extern "C" moe_status moe_cuda_red_scatter(moe_ctx *ctx, int device, void *gin, const void *g,
                                           const int64_t *idx, moe_dtype dt, int64_t outer,
                                           int64_t nd, int64_t post) {
  if (outer == 0) return MOE_OK;
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  cudaStream_t s = (cudaStream_t)stream;
  switch (moe_dtype_size(dt)) {
    case 2: moe_red_scatter_kernel<uint16_t><<<moe_blocks(outer), MOE_THREADS, 0, s>>>((uint16_t *)gin, (const uint16_t *)g, idx, outer, nd, post); break;
    case 4: moe_red_scatter_kernel<uint32_t><<<moe_blocks(outer), MOE_THREADS, 0, s>>>((uint32_t *)gin, (const uint32_t *)g, idx, outer, nd, post); break;
    case 8: moe_red_scatter_kernel<uint64_t><<<moe_blocks(outer), MOE_THREADS, 0, s>>>((uint64_t *)gin, (const uint64_t *)g, idx, outer, nd, post); break;
    default: return moe_error(ctx, MOE_ERR_DTYPE, "cuda max/min backward: dtype %s", moe_dtype_name(dt));
  }
  MOE_CUDA_CHECK_LAUNCH(ctx, "cuda max/min backward kernel");
  return MOE_OK;
}

/* ------------------------------------------------------------ cumsum */

#define MOE_SCAN_ITEMS 4

/* Inclusive scan of one row per block in tiles of blockDim * ITEMS
 * consecutive elements: per-thread sums, a block scan of them, a carry. */
template <moe_dtype DT, typename A, bool REV>
__global__ void moe_cumsum_kernel(const void *__restrict__ x, void *__restrict__ y, int64_t n) {
  using T = moe_st_t<DT>;
  __shared__ A sh[32];
  __shared__ A carry_sh;
  const T *xr = (const T *)x + (int64_t)blockIdx.x * n;
  T *yr = (T *)y + (int64_t)blockIdx.x * n;
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  A carry = 0;
  int64_t tile = (int64_t)blockDim.x * MOE_SCAN_ITEMS;
  for (int64_t t0 = 0; t0 < n; t0 += tile) {
    A v[MOE_SCAN_ITEMS];
    A run = 0;
#pragma unroll
    for (int q = 0; q < MOE_SCAN_ITEMS; q++) {
      int64_t k = t0 + (int64_t)threadIdx.x * MOE_SCAN_ITEMS + q;
      int64_t j = REV ? n - 1 - k : k;
      A e = k < n ? moe_load_as<A, DT>(xr[j]) : (A)0;
      run += e;
      v[q] = run;
    }
    /* inclusive warp scan of the thread totals */
    A incl = run;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      A u = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += u;
    }
    if (lane == 31) sh[w] = incl;
    __syncthreads();
    if (w == 0) {
      A s = lane < nw ? sh[lane] : (A)0;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        A u = __shfl_up_sync(0xffffffffu, s, o);
        if (lane >= o) s += u;
      }
      if (lane < nw) sh[lane] = s; /* inclusive over warps */
    }
    __syncthreads();
    A before = carry + (w > 0 ? sh[w - 1] : (A)0) + (incl - run);
#pragma unroll
    for (int q = 0; q < MOE_SCAN_ITEMS; q++) {
      int64_t k = t0 + (int64_t)threadIdx.x * MOE_SCAN_ITEMS + q;
      int64_t j = REV ? n - 1 - k : k;
      if (k < n) yr[j] = moe_store_from<DT, A>(before + v[q]);
    }
    if (threadIdx.x == blockDim.x - 1) carry_sh = before + run;
    __syncthreads();
    carry = carry_sh;
    __syncthreads();
  }
}

extern "C" moe_status moe_cuda_cumsum(moe_ctx *ctx, int device, bool reverse, const void *x,
                                      void *y, moe_dtype dt, int64_t rows, int64_t n) {
  if (rows == 0 || n == 0) return MOE_OK;
  MOE_CHECK(moe_rows_check(ctx, "cuda cumsum", rows));
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  cudaStream_t s = (cudaStream_t)stream;
  unsigned th = moe_pow2_ceil((n + MOE_SCAN_ITEMS - 1) / MOE_SCAN_ITEMS);
  if (th < 32) th = 32;
  if (th > 256) th = 256;
  unsigned g = (unsigned)rows;
#define MOE_CUMSUM_CASE(DTV, A)                                                          \
  case DTV:                                                                              \
    if (reverse) moe_cumsum_kernel<DTV, A, true><<<g, th, 0, s>>>(x, y, n);              \
    else moe_cumsum_kernel<DTV, A, false><<<g, th, 0, s>>>(x, y, n);                     \
    break;
  switch (dt) {
    MOE_CUMSUM_CASE(MOE_F32, float)
    MOE_CUMSUM_CASE(MOE_BF16, float)
    MOE_CUMSUM_CASE(MOE_F16, float)
    MOE_CUMSUM_CASE(MOE_I64, int64_t)
    default:
      return moe_error(ctx, MOE_ERR_DTYPE, "cuda cumsum: dtype %s is not supported on CUDA",
                       moe_dtype_name(dt));
  }
#undef MOE_CUMSUM_CASE
  MOE_CUDA_CHECK_LAUNCH(ctx, "cuda cumsum kernel");
  return MOE_OK;
}
