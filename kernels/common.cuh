/*
 * common.cuh - what the elementwise CUDA kernels share (private to the .cu files of kernels/):
 * dtype storage types and conversions that match the CPU reference in
 * core/dtype.c bit for bit, the launch geometry (merged dims, per-operand
 * strides) passed to kernels by value, the generic contiguous / strided /
 * runtime-dtype kernels, the host-side checks and launch helpers, and the
 * scratch type of the launchers (MoeScratch).
 *
 * Conversions (as core/dtype.c): float -> integer truncates toward zero and
 * saturates, NaN gives 0; -> bool is v != 0; integer -> narrower integer
 * wraps; double -> bf16/f16 goes through float. Loads into the compute type:
 * float (f32/bf16/f16 outs) is (float)(double)x, double is (double)x, int64 is
 * the saturating conversion. Stores from float/double go through double,
 * from int64 through int64 (moe_store_f64 / moe_store_i64).
 *
 * Index math is int64 everywhere; geometry dims are stored innermost first so
 * the unrolled offset loop indexes kernel parameters with constants.
 */
#ifndef MOE_KERNELS_COMMON_CUH
#define MOE_KERNELS_COMMON_CUH

#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>
#include <type_traits>

#include "cuda_check.h"
#include "internal.h"
#include "kerr.h"

/* A kernel that finds bad input (value outside [0, limit)) records the
 * first such find for the host (kerr.h; e from moe_cuda_kerr, may be NULL). */
__device__ __forceinline__ void moe_kerr_report(moe_kerr *e, int tag, int64_t value, int64_t limit) {
  if (e && atomicCAS(&e->set, 0u, 1u) == 0u) {
    e->tag = tag;
    e->value = value;
    e->limit = limit;
    __threadfence_system();
  }
}

/* ------------------------------------------------------- host errors, scratch */

/* Status checks of CUDA and cuBLAS calls: MOE_CUDA_CHECK(ctx, call),
 * MOE_CUDA_CHECK_LAUNCH(ctx, what) after launches, MOE_CUBLAS_CHECK(ctx,
 * call) (core/cuda_check.h, shared with core/cuda_runtime.c). */

/*
 * Temporary device memory of one launcher call: a block of the context's
 * caching allocator, borrowed by alloc and given back by release or when
 * the scratch goes out of scope, whichever path leaves the launcher. The
 * block may be handed out again at once: every later user queues behind the
 * launcher's work on the same stream. alloc(0) holds no block (ptr NULL) but
 * still counts as a live allocation until released.
 *
 *   MoeScratch tmp(ctx, device);
 *   MOE_CHECK(tmp.alloc(bytes));
 *   kernel<<<..., stream>>>((float *)tmp.ptr, ...);
 */
struct MoeScratch {
  moe_ctx *ctx;
  int device;
  void *ptr = nullptr;
  size_t block = 0;  /* the allocator's size of the block */
  bool held = false; /* alloc succeeded and release has not run */
  MoeScratch(moe_ctx *c, int d) : ctx(c), device(d) {}
  MoeScratch(const MoeScratch &) = delete;
  MoeScratch &operator=(const MoeScratch &) = delete;
  ~MoeScratch() { release(); }
  /* nbytes of device memory in ptr; releases what was held before. */
  moe_status alloc(size_t nbytes) {
    release();
    moe_status st = moe_cuda_alloc(ctx, device, nbytes, &ptr, &block);
    held = st == MOE_OK;
    return st;
  }
  void release() {
    if (held) moe_cuda_release(ctx, device, ptr, block);
    held = false;
    ptr = nullptr;
    block = 0;
  }
};

/* ------------------------------------------------------------ dtype types */

template <moe_dtype DT> struct MoeSt;
template <> struct MoeSt<MOE_F32> { using T = float; };
template <> struct MoeSt<MOE_F64> { using T = double; };
template <> struct MoeSt<MOE_BF16> { using T = uint16_t; };
template <> struct MoeSt<MOE_F16> { using T = uint16_t; };
template <> struct MoeSt<MOE_I8> { using T = int8_t; };
template <> struct MoeSt<MOE_U8> { using T = uint8_t; };
template <> struct MoeSt<MOE_I32> { using T = int32_t; };
template <> struct MoeSt<MOE_I64> { using T = int64_t; };
template <> struct MoeSt<MOE_BOOL> { using T = uint8_t; };
template <moe_dtype DT> using moe_st_t = typename MoeSt<DT>::T;

template <moe_dtype DT> constexpr bool moe_is_float_v =
    DT == MOE_F32 || DT == MOE_F64 || DT == MOE_BF16 || DT == MOE_F16;

/* The type an elementwise op computes in for an output dtype. */
template <moe_dtype DT> using moe_compute_t =
    std::conditional_t<DT == MOE_F64, double,
                       std::conditional_t<moe_is_float_v<DT>, float, int64_t>>;

template <moe_dtype DT> using MoeDtTag = std::integral_constant<moe_dtype, DT>;

/* Calls f(MoeDtTag<DT>{}) for the runtime dtype dt; dt must be valid. */
template <typename F> static inline moe_status moe_dtype_dispatch(moe_dtype dt, F &&f) {
  switch (dt) {
    case MOE_F32: return f(MoeDtTag<MOE_F32>{});
    case MOE_F64: return f(MoeDtTag<MOE_F64>{});
    case MOE_BF16: return f(MoeDtTag<MOE_BF16>{});
    case MOE_F16: return f(MoeDtTag<MOE_F16>{});
    case MOE_I8: return f(MoeDtTag<MOE_I8>{});
    case MOE_U8: return f(MoeDtTag<MOE_U8>{});
    case MOE_I32: return f(MoeDtTag<MOE_I32>{});
    case MOE_I64: return f(MoeDtTag<MOE_I64>{});
    case MOE_BOOL: return f(MoeDtTag<MOE_BOOL>{});
    default: break;
  }
  return MOE_ERR_INTERNAL;
}

/* ------------------------------------------------------ value conversions */

__device__ __forceinline__ int64_t moe_d_f64_to_i64_sat(double v, int64_t lo, int64_t hi) {
  if (v != v) return 0;
  if (v <= (double)lo) return lo;
  if (v >= -(double)lo) return hi;
  return (int64_t)v;
}

template <moe_dtype DT> __device__ __forceinline__ double moe_raw_to_f64(moe_st_t<DT> x) {
  if constexpr (DT == MOE_BF16) return moe_bf16_to_f32(moe_bf16{x});
  else if constexpr (DT == MOE_F16) return moe_f16_to_f32(moe_f16{x});
  else if constexpr (DT == MOE_BOOL) return x ? 1.0 : 0.0;
  else return (double)x;
}

template <moe_dtype DT> __device__ __forceinline__ int64_t moe_raw_to_i64(moe_st_t<DT> x) {
  if constexpr (moe_is_float_v<DT>) return moe_d_f64_to_i64_sat(moe_raw_to_f64<DT>(x), INT64_MIN, INT64_MAX);
  else if constexpr (DT == MOE_BOOL) return x ? 1 : 0;
  else return (int64_t)x;
}

template <moe_dtype DT> __device__ __forceinline__ moe_st_t<DT> moe_f64_to_raw(double v) {
  if constexpr (DT == MOE_F32) return (float)v;
  else if constexpr (DT == MOE_F64) return v;
  else if constexpr (DT == MOE_BF16) return moe_f32_to_bf16((float)v).bits;
  else if constexpr (DT == MOE_F16) return moe_f32_to_f16((float)v).bits;
  else if constexpr (DT == MOE_I8) return (int8_t)moe_d_f64_to_i64_sat(v, INT8_MIN, INT8_MAX);
  else if constexpr (DT == MOE_U8) return (uint8_t)(v != v || v <= 0 ? 0 : v >= 255.0 ? 255 : (uint8_t)v);
  else if constexpr (DT == MOE_I32) return (int32_t)moe_d_f64_to_i64_sat(v, INT32_MIN, INT32_MAX);
  else if constexpr (DT == MOE_I64) return moe_d_f64_to_i64_sat(v, INT64_MIN, INT64_MAX);
  else return (uint8_t)(v != 0);
}

template <moe_dtype DT> __device__ __forceinline__ moe_st_t<DT> moe_i64_to_raw(int64_t v) {
  if constexpr (DT == MOE_F32) return (float)v;
  else if constexpr (DT == MOE_F64) return (double)v;
  else if constexpr (DT == MOE_BF16) return moe_f32_to_bf16((float)v).bits;
  else if constexpr (DT == MOE_F16) return moe_f32_to_f16((float)v).bits;
  else if constexpr (DT == MOE_BOOL) return (uint8_t)(v != 0);
  else return (moe_st_t<DT>)v; /* wraps */
}

/* Load into compute type C (float, double or int64_t). */
template <typename C, moe_dtype DT> __device__ __forceinline__ C moe_load_as(moe_st_t<DT> x) {
  if constexpr (std::is_same_v<C, int64_t>) return moe_raw_to_i64<DT>(x);
  else if constexpr (std::is_same_v<C, double>) return moe_raw_to_f64<DT>(x);
  else if constexpr (DT == MOE_F32) return x; /* (float)(double)x == x */
  else if constexpr (DT == MOE_BF16) return moe_bf16_to_f32(moe_bf16{x});
  else if constexpr (DT == MOE_F16) return moe_f16_to_f32(moe_f16{x});
  else return (float)moe_raw_to_f64<DT>(x);
}

/* Store from compute type C: through double for float/double, int64 for int64. */
template <moe_dtype DT, typename C> __device__ __forceinline__ moe_st_t<DT> moe_store_from(C v) {
  if constexpr (std::is_same_v<C, int64_t>) return moe_i64_to_raw<DT>(v);
  else if constexpr (std::is_same_v<C, float> && DT == MOE_F32) return v;
  else if constexpr (std::is_same_v<C, float> && DT == MOE_BF16) return moe_f32_to_bf16(v).bits;
  else if constexpr (std::is_same_v<C, float> && DT == MOE_F16) return moe_f32_to_f16(v).bits;
  else return moe_f64_to_raw<DT>((double)v);
}

/* Runtime-dtype element access, for the mixed-dtype paths. */
template <typename C> __device__ __forceinline__ C moe_dyn_load(const void *base, moe_dtype dt,
                                                                int64_t i) {
  switch (dt) {
    case MOE_F32: return moe_load_as<C, MOE_F32>(((const float *)base)[i]);
    case MOE_F64: return moe_load_as<C, MOE_F64>(((const double *)base)[i]);
    case MOE_BF16: return moe_load_as<C, MOE_BF16>(((const uint16_t *)base)[i]);
    case MOE_F16: return moe_load_as<C, MOE_F16>(((const uint16_t *)base)[i]);
    case MOE_I8: return moe_load_as<C, MOE_I8>(((const int8_t *)base)[i]);
    case MOE_U8: return moe_load_as<C, MOE_U8>(((const uint8_t *)base)[i]);
    case MOE_I32: return moe_load_as<C, MOE_I32>(((const int32_t *)base)[i]);
    case MOE_I64: return moe_load_as<C, MOE_I64>(((const int64_t *)base)[i]);
    default: return moe_load_as<C, MOE_BOOL>(((const uint8_t *)base)[i]);
  }
}

template <typename C> __device__ __forceinline__ void moe_dyn_store(void *base, moe_dtype dt,
                                                                    int64_t i, C v) {
  switch (dt) {
    case MOE_F32: ((float *)base)[i] = moe_store_from<MOE_F32, C>(v); break;
    case MOE_F64: ((double *)base)[i] = moe_store_from<MOE_F64, C>(v); break;
    case MOE_BF16: ((uint16_t *)base)[i] = moe_store_from<MOE_BF16, C>(v); break;
    case MOE_F16: ((uint16_t *)base)[i] = moe_store_from<MOE_F16, C>(v); break;
    case MOE_I8: ((int8_t *)base)[i] = moe_store_from<MOE_I8, C>(v); break;
    case MOE_U8: ((uint8_t *)base)[i] = moe_store_from<MOE_U8, C>(v); break;
    case MOE_I32: ((int32_t *)base)[i] = moe_store_from<MOE_I32, C>(v); break;
    case MOE_I64: ((int64_t *)base)[i] = moe_store_from<MOE_I64, C>(v); break;
    default: ((uint8_t *)base)[i] = moe_store_from<MOE_BOOL, C>(v); break;
  }
}

/* --------------------------------------------------------------- geometry */

/* N views of one shape with size-1 dims dropped and dims contiguous in every
 * view merged (as core/cpu_loop.h does). Dim 0 here is the innermost. */
template <int N> struct MoeGeom {
  int ndim; /* >= 1 */
  int64_t shape[MOE_MAX_DIMS];
  int64_t stride[N][MOE_MAX_DIMS];
};

/* Returns numel; v[k] all have v[0]'s shape (checked by moe_kviews_check). */
template <int N> static inline int64_t moe_geom_init(MoeGeom<N> *g, const moe_kview *const *v) {
  int64_t shape[MOE_MAX_DIMS], stride[N][MOE_MAX_DIMS];
  int nd = 0;
  int64_t numel = 1;
  for (int d = 0; d < v[0]->ndim; d++) {
    int64_t n = v[0]->shape[d];
    numel *= n;
    if (n == 1) continue;
    bool merge = nd > 0;
    for (int k = 0; k < N && merge; k++) merge = stride[k][nd - 1] == v[k]->stride[d] * n;
    if (merge) {
      shape[nd - 1] *= n;
      for (int k = 0; k < N; k++) stride[k][nd - 1] = v[k]->stride[d];
    } else {
      shape[nd] = n;
      for (int k = 0; k < N; k++) stride[k][nd] = v[k]->stride[d];
      nd++;
    }
  }
  memset(g, 0, sizeof(*g));
  if (nd == 0) { /* a scalar, or every size 1: one element at offset 0 */
    g->ndim = 1;
    g->shape[0] = 1;
    for (int k = 0; k < N; k++) g->stride[k][0] = 1;
    return numel;
  }
  g->ndim = nd;
  for (int j = 0; j < nd; j++) {
    g->shape[j] = shape[nd - 1 - j];
    for (int k = 0; k < N; k++) g->stride[k][j] = stride[k][nd - 1 - j];
  }
  return numel;
}

/* Every view walks its memory densely in row-major order. */
template <int N> static inline bool moe_geom_contiguous(const MoeGeom<N> &g) {
  if (g.ndim != 1) return false;
  for (int k = 0; k < N; k++)
    if (g.stride[k][0] != 1) return false;
  return true;
}

/* Element offsets of row-major index i in each view. */
template <int N>
__device__ __forceinline__ void moe_geom_offsets(const MoeGeom<N> &g, int64_t i, int64_t *off) {
#pragma unroll
  for (int k = 0; k < N; k++) off[k] = 0;
#pragma unroll
  for (int j = 0; j < MOE_MAX_DIMS; j++) {
    if (j == g.ndim - 1) { /* the outermost dim takes what is left */
#pragma unroll
      for (int k = 0; k < N; k++) off[k] += i * g.stride[k][j];
      break;
    }
    int64_t q = i / g.shape[j], r = i - q * g.shape[j];
    i = q;
#pragma unroll
    for (int k = 0; k < N; k++) off[k] += r * g.stride[k][j];
  }
}

/* ----------------------------------------------------------- host checks */

/* dtype valid, ndim in range, every view of v[0]'s shape, data present when
 * there are elements. Returns numel in *numel. */
static inline moe_status moe_kviews_check(moe_ctx *ctx, const char *fn, int n,
                                          const moe_kview *const *v, int64_t *numel) {
  int64_t count = 1;
  for (int k = 0; k < n; k++) {
    const moe_kview *x = v[k];
    if (!x) return moe_error(ctx, MOE_ERR_INTERNAL, "%s: view %d is NULL", fn, k);
    if ((int)x->dtype < 0 || x->dtype >= MOE_DTYPE_COUNT)
      return moe_error(ctx, MOE_ERR_DTYPE, "%s: view %d has unknown dtype %d", fn, k,
                       (int)x->dtype);
    if (x->ndim < 0 || x->ndim > MOE_MAX_DIMS || x->ndim != v[0]->ndim)
      return moe_error(ctx, MOE_ERR_SHAPE, "%s: view %d has %d dims, view 0 has %d", fn, k,
                       x->ndim, v[0]->ndim);
    for (int d = 0; d < x->ndim; d++) {
      if (x->shape[d] != v[0]->shape[d] || x->shape[d] < 0) {
        char a[128], b[128];
        return moe_error(ctx, MOE_ERR_SHAPE, "%s: view %d has shape %s, view 0 has %s", fn, k,
                         moe_shape_str(x->ndim, x->shape, a, sizeof(a)),
                         moe_shape_str(v[0]->ndim, v[0]->shape, b, sizeof(b)));
      }
    }
  }
  for (int d = 0; d < v[0]->ndim; d++) count *= v[0]->shape[d];
  for (int k = 0; k < n && count > 0; k++)
    if (!v[k]->data) return moe_error(ctx, MOE_ERR_INTERNAL, "%s: view %d has no data", fn, k);
  *numel = count;
  return MOE_OK;
}

/* ---------------------------------------------------------------- launches */

#define MOE_THREADS 256
#define MOE_VEC 4 /* elements per vector access in the contiguous kernels */

static inline unsigned moe_blocks(int64_t work) {
  int64_t b = (work + MOE_THREADS - 1) / MOE_THREADS;
  if (b < 1) b = 1;
  if (b > (1 << 20)) b = 1 << 20; /* grid-stride loops cover the rest */
  return (unsigned)b;
}

static inline bool moe_aligned(const void *p, size_t bytes) {
  return ((uintptr_t)p % bytes) == 0;
}

template <typename T, int V> struct alignas(sizeof(T) * V) MoeVec {
  T v[V];
};

template <int N> struct MoePtrs {
  const void *p[N];
};

/* Runtime-dtype inputs of the mixed-dtype kernel. */
template <int N> struct MoeDynIn {
  const void *p[N];
  moe_dtype dt[N];
};

/*
 * out[i] = f(x[0][i], ..., x[NIN-1][i]) over contiguous views: inputs of
 * dtype IN loaded as C, f(const C (&)[NIN]) -> C, stored as OUT. With vec,
 * every pointer is aligned to MOE_VEC elements and the body moves whole
 * vectors; the tail (numel % MOE_VEC) runs element by element.
 */
template <moe_dtype OUT, moe_dtype IN, typename C, int NIN, typename F>
__global__ void __launch_bounds__(MOE_THREADS)
    moe_ew_contig_kernel(int64_t n, void *out, MoePtrs<NIN> in, F f, bool vec) {
  using TO = moe_st_t<OUT>;
  using TI = moe_st_t<IN>;
  int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  int64_t nthreads = (int64_t)gridDim.x * blockDim.x;
  int64_t start = 0;
  if (vec) {
    int64_t nv = n / MOE_VEC;
    for (int64_t j = tid; j < nv; j += nthreads) {
      MoeVec<TI, MOE_VEC> a[NIN];
#pragma unroll
      for (int k = 0; k < NIN; k++) a[k] = ((const MoeVec<TI, MOE_VEC> *)in.p[k])[j];
      MoeVec<TO, MOE_VEC> o;
#pragma unroll
      for (int e = 0; e < MOE_VEC; e++) {
        C x[NIN];
#pragma unroll
        for (int k = 0; k < NIN; k++) x[k] = moe_load_as<C, IN>(a[k].v[e]);
        o.v[e] = moe_store_from<OUT, C>(f(x));
      }
      ((MoeVec<TO, MOE_VEC> *)out)[j] = o;
    }
    start = nv * MOE_VEC;
  }
  for (int64_t i = start + tid; i < n; i += nthreads) {
    C x[NIN];
#pragma unroll
    for (int k = 0; k < NIN; k++) x[k] = moe_load_as<C, IN>(((const TI *)in.p[k])[i]);
    ((TO *)out)[i] = moe_store_from<OUT, C>(f(x));
  }
}

/* The same over strided views (g: the output first, then the inputs). */
template <moe_dtype OUT, moe_dtype IN, typename C, int NIN, typename F>
__global__ void __launch_bounds__(MOE_THREADS)
    moe_ew_strided_kernel(int64_t n, void *out, MoePtrs<NIN> in, MoeGeom<NIN + 1> g, F f) {
  using TO = moe_st_t<OUT>;
  using TI = moe_st_t<IN>;
  int64_t nthreads = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += nthreads) {
    int64_t off[NIN + 1];
    moe_geom_offsets<NIN + 1>(g, i, off);
    C x[NIN];
#pragma unroll
    for (int k = 0; k < NIN; k++) x[k] = moe_load_as<C, IN>(((const TI *)in.p[k])[off[k + 1]]);
    ((TO *)out)[off[0]] = moe_store_from<OUT, C>(f(x));
  }
}

/* Any dtypes, chosen at run time per element access (mixed-dtype ops). */
template <typename C, int NIN, typename F>
__global__ void __launch_bounds__(MOE_THREADS)
    moe_ew_dynamic_kernel(int64_t n, void *out, moe_dtype odt, MoeDynIn<NIN> in,
                          MoeGeom<NIN + 1> g, F f) {
  int64_t nthreads = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += nthreads) {
    int64_t off[NIN + 1];
    moe_geom_offsets<NIN + 1>(g, i, off);
    C x[NIN];
#pragma unroll
    for (int k = 0; k < NIN; k++) x[k] = moe_dyn_load<C>(in.p[k], in.dt[k], off[k + 1]);
    moe_dyn_store<C>(out, odt, off[0], f(x));
  }
}

/* out[i] = g(i) for row-major index i: G returns double (stored as
 * moe_store_f64 would) or int64_t (as moe_store_i64). */
template <moe_dtype OUT, typename G>
__global__ void __launch_bounds__(MOE_THREADS)
    moe_gen_kernel(int64_t n, void *out, MoeGeom<1> g, G gen) {
  using TO = moe_st_t<OUT>;
  int64_t nthreads = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += nthreads) {
    int64_t off[1];
    moe_geom_offsets<1>(g, i, off);
    ((TO *)out)[off[0]] = moe_store_from<OUT>(gen(i));
  }
}

/*
 * Launches f over views out (v[0]) and NIN inputs (v[1..]) of one shape:
 * contiguous and same-dtype views take the typed kernels (vectorised when
 * aligned), anything else the runtime-dtype kernel. C is the compute type
 * of out's dtype; the inputs are converted to it.
 */
template <int NIN, template <typename> class Fn, typename... Args>
static moe_status moe_ew_launch(moe_ctx *ctx, int device, const char *fn,
                                const moe_kview *const *v, Args... args) {
  int64_t n = 0;
  MOE_CHECK(moe_kviews_check(ctx, fn, NIN + 1, v, &n));
  if (n == 0) return MOE_OK;
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  cudaStream_t s = (cudaStream_t)stream;
  MoeGeom<NIN + 1> g;
  moe_geom_init<NIN + 1>(&g, v);
  bool same = true;
  for (int k = 1; k <= NIN; k++) same = same && v[k]->dtype == v[0]->dtype;
  moe_status st = moe_dtype_dispatch(v[0]->dtype, [&](auto tag) -> moe_status {
    constexpr moe_dtype OUT = decltype(tag)::value;
    using C = moe_compute_t<OUT>;
    Fn<C> f{args...};
    if (same) {
      MoePtrs<NIN> in;
      for (int k = 0; k < NIN; k++) in.p[k] = v[k + 1]->data;
      if (moe_geom_contiguous(g)) {
        bool vec = n >= MOE_VEC;
        for (int k = 0; k <= NIN; k++)
          vec = vec && moe_aligned(v[k]->data, MOE_VEC * sizeof(moe_st_t<OUT>));
        moe_ew_contig_kernel<OUT, OUT, C, NIN><<<moe_blocks(vec ? n / MOE_VEC : n), MOE_THREADS, 0, s>>>(
            n, v[0]->data, in, f, vec);
      } else {
        moe_ew_strided_kernel<OUT, OUT, C, NIN><<<moe_blocks(n), MOE_THREADS, 0, s>>>(
            n, v[0]->data, in, g, f);
      }
    } else {
      MoeDynIn<NIN> in;
      for (int k = 0; k < NIN; k++) {
        in.p[k] = v[k + 1]->data;
        in.dt[k] = v[k + 1]->dtype;
      }
      moe_ew_dynamic_kernel<C, NIN><<<moe_blocks(n), MOE_THREADS, 0, s>>>(n, v[0]->data, OUT,
                                                                          in, g, f);
    }
    return MOE_OK;
  });
  MOE_CHECK(st);
  MOE_CUDA_CHECK_LAUNCH(ctx, fn);
  return MOE_OK;
}

#endif /* MOE_KERNELS_COMMON_CUH */
