/*
 * reduce.cu - CUDA launchers of the reductions and normalisation family
 * (core/reduce_cuda.h): dim reductions with combinable states, their
 * elementwise backward, fused row kernels (softmax, log_softmax, layer_norm,
 * rms_norm, cross_entropy) forward and backward, and cumsum.
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

#include <math.h>

/* ------------------------------------------------------------ helpers */

static int moe_red_sm_count(int device) {
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

template <moe_dtype DT> __device__ __forceinline__ float moe_ldf(const void *p, int64_t i) {
  return moe_load_as<float, DT>(((const moe_st_t<DT> *)p)[i]);
}

static inline unsigned moe_pow2_ceil(int64_t v) {
  unsigned p = 1;
  while ((int64_t)p < v && p < (1u << 30)) p <<= 1;
  return p;
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
static int moe_reg_plan(int64_t nvec, int most_nv, unsigned want, unsigned most_th, unsigned *th) {
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

static moe_status moe_rows_check(moe_ctx *ctx, const char *fn, int64_t rows) {
  if (rows > 0x7fffffffLL)
    return moe_error(ctx, MOE_ERR_NOT_SUPPORTED, "%s: %lld rows is more than one launch takes", fn,
                     (long long)rows);
  return MOE_OK;
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
