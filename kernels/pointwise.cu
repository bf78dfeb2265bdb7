/*
 * pointwise.cu - CUDA launchers of the pointwise family (core/pointwise_cuda.h):
 * unary math and activations with their gradients, pow/maximum/minimum and
 * their gradients, comparisons, where, fused swiglu forward and backward,
 * dropout.
 *
 * Two kernel shapes serve every op:
 *   - pw_contig_kernel: every operand contiguous and of one float dtype;
 *     16-byte vector loads and stores (8 bf16/f16, 4 f32, 2 f64 per access)
 *     when all pointers are 16-byte aligned, a scalar tail otherwise. The
 *     unary forward ops are instantiated per op (the switch in the shared
 *     formula folds away); other ops pass the op at run time.
 *   - pw_dyn_kernel: anything else (strided or broadcast views, mixed dtypes,
 *     integer and bool operands), with per-element offsets from the merged
 *     geometry of common.cuh and runtime-dtype loads and stores.
 * Dropout has its own contiguous kernel: 8 elements (16-byte vectors, two
 * Philox blocks) per thread step. Math is the formulas of pointwise_cuda.h
 * in float (f32, bf16, f16), double (f64) or int64; index math is int64.
 */
#include "common.cuh"
#include "pointwise_cuda.h"

/* ---------------------------------------------------------- device math */

template <typename C>
__device__ __forceinline__ C pw_unary(int op, C x, C p0, C p1, int64_t i0, int64_t i1) {
  if constexpr (std::is_same_v<C, float>) return moe_pw_unary_f32(op, x, p0, p1);
  else if constexpr (std::is_same_v<C, double>) return moe_pw_unary_f64(op, x, p0, p1);
  else return moe_pw_unary_i64(op, x, i0, i1);
}

template <typename C>
__device__ __forceinline__ C pw_unary_grad(int op, C g, C x, C p0, C p1) {
  if constexpr (std::is_same_v<C, float>) return moe_pw_unary_grad_f32(op, g, x, p0, p1);
  else return moe_pw_unary_grad_f64(op, g, x, p0, p1);
}

template <typename C> __device__ __forceinline__ C pw_binary(int op, C a, C b) {
  if constexpr (std::is_same_v<C, float>) return moe_pw_binary_f32(op, a, b);
  else if constexpr (std::is_same_v<C, double>) return moe_pw_binary_f64(op, a, b);
  else return moe_pw_binary_i64(op, a, b);
}

template <typename C>
__device__ __forceinline__ void pw_binary_grad(int op, C g, C a, C b, C *ga, C *gb) {
  if constexpr (std::is_same_v<C, float>) moe_pw_binary_grad_f32(op, g, a, b, ga, gb);
  else moe_pw_binary_grad_f64(op, g, a, b, ga, gb);
}

template <typename C> __device__ __forceinline__ C pw_swiglu(C gate, C up) {
  if constexpr (std::is_same_v<C, float>) return moe_pw_swiglu_f32(gate, up);
  else return moe_pw_swiglu_f64(gate, up);
}

template <typename C>
__device__ __forceinline__ void pw_swiglu_grad(C g, C gate, C up, C *dgate, C *dup) {
  if constexpr (std::is_same_v<C, float>) moe_pw_swiglu_grad_f32(g, gate, up, dgate, dup);
  else moe_pw_swiglu_grad_f64(g, gate, up, dgate, dup);
}

/* A host scalar as the compute type (NaN and out-of-range values give 0 for
 * int64, whose ops take their bounds separately). */
template <typename C> static inline C pw_param(double v) {
  if constexpr (std::is_same_v<C, int64_t>) {
    return v == v && v > -9.2e18 && v < 9.2e18 ? (int64_t)v : 0;
  } else {
    return (C)v;
  }
}

/* ------------------------------------------------------------- functors */
/* f(x, y, i): inputs x (NIN), outputs y (NOUT), i the row-major index. */

/* The unary forward with the op fixed at compile time (contiguous path). */
template <typename C, int OP> struct PwUnaryFixed {
  C p0, p1;
  int64_t i0, i1;
  __device__ __forceinline__ void operator()(const C (&x)[1], C (&y)[1], int64_t) const {
    y[0] = pw_unary<C>(OP, x[0], p0, p1, i0, i1);
  }
};

template <typename C> struct PwUnaryF {
  int op;
  C p0, p1;
  int64_t i0, i1;
  PwUnaryF(int o, double a, double b, int64_t c, int64_t d)
      : op(o), p0(pw_param<C>(a)), p1(pw_param<C>(b)), i0(c), i1(d) {}
  __device__ __forceinline__ void operator()(const C (&x)[1], C (&y)[1], int64_t) const {
    y[0] = pw_unary<C>(op, x[0], p0, p1, i0, i1);
  }
};

template <typename C> struct PwUnaryGradF {
  int op;
  C p0, p1;
  PwUnaryGradF(int o, double a, double b) : op(o), p0(pw_param<C>(a)), p1(pw_param<C>(b)) {}
  __device__ __forceinline__ void operator()(const C (&x)[2], C (&y)[1], int64_t) const {
    y[0] = pw_unary_grad<C>(op, x[0], x[1], p0, p1);
  }
};

template <typename C> struct PwBinaryF {
  int op;
  explicit PwBinaryF(int o) : op(o) {}
  __device__ __forceinline__ void operator()(const C (&x)[2], C (&y)[1], int64_t) const {
    y[0] = pw_binary<C>(op, x[0], x[1]);
  }
};

/* which: with one output, 0 stores the gradient of a, 1 that of b. */
template <typename C> struct PwBinaryGradF {
  int op, which;
  PwBinaryGradF(int o, int w) : op(o), which(w) {}
  template <int NOUT>
  __device__ __forceinline__ void operator()(const C (&x)[3], C (&y)[NOUT], int64_t) const {
    C ga, gb;
    pw_binary_grad<C>(op, x[0], x[1], x[2], &ga, &gb);
    if constexpr (NOUT == 2) {
      y[0] = ga;
      y[1] = gb;
    } else {
      y[0] = which ? gb : ga;
    }
  }
};

template <typename C> __device__ __forceinline__ bool pw_cmp(int op, C a, C b) {
  switch (op) {
    case MOE_OP_EQ: return a == b;
    case MOE_OP_NE: return a != b;
    case MOE_OP_LT: return a < b;
    case MOE_OP_LE: return a <= b;
    case MOE_OP_GT: return a > b;
    default: return a >= b;
  }
}

template <typename C> struct PwCompareF {
  int op;
  C s;
  PwCompareF(int o, double sv) : op(o), s(pw_param<C>(sv)) {}
  __device__ __forceinline__ void operator()(const C (&x)[2], C (&y)[1], int64_t) const {
    y[0] = pw_cmp<C>(op, x[0], x[1]) ? (C)1 : (C)0;
  }
  __device__ __forceinline__ void operator()(const C (&x)[1], C (&y)[1], int64_t) const {
    y[0] = pw_cmp<C>(op, x[0], s) ? (C)1 : (C)0;
  }
};

template <typename C> struct PwWhereF {
  __device__ __forceinline__ void operator()(const C (&x)[3], C (&y)[1], int64_t) const {
    y[0] = x[0] != (C)0 ? x[1] : x[2];
  }
};

template <typename C> struct PwSwigluF {
  __device__ __forceinline__ void operator()(const C (&x)[2], C (&y)[1], int64_t) const {
    y[0] = pw_swiglu<C>(x[0], x[1]);
  }
};

template <typename C> struct PwSwigluGradF {
  int which;
  explicit PwSwigluGradF(int w) : which(w) {}
  template <int NOUT>
  __device__ __forceinline__ void operator()(const C (&x)[3], C (&y)[NOUT], int64_t) const {
    C dg, du;
    pw_swiglu_grad<C>(x[0], x[1], x[2], &dg, &du);
    if constexpr (NOUT == 2) {
      y[0] = dg;
      y[1] = du;
    } else {
      y[0] = which ? du : dg;
    }
  }
};

template <typename C> struct PwDropoutF {
  uint64_t seed, call;
  uint32_t thr;
  C scale;
  PwDropoutF(uint64_t s, uint64_t c, uint32_t t, double sc) : seed(s), call(c), thr(t), scale(pw_param<C>(sc)) {}
  __device__ __forceinline__ void operator()(const C (&x)[1], C (&y)[1], int64_t i) const {
    y[0] = moe_pw_dropout_keep(seed, call, (uint64_t)i, thr) ? x[0] * scale : (C)0;
  }
};

/* -------------------------------------------------------------- kernels */

template <int N> struct PwOut {
  void *p[N];
};

template <int N> struct PwDynOut {
  void *p[N];
  moe_dtype dt[N];
};

/* Every operand contiguous and of dtype DT. */
template <moe_dtype DT, int NIN, int NOUT, typename F>
__global__ void __launch_bounds__(MOE_THREADS)
    pw_contig_kernel(int64_t n, PwOut<NOUT> out, MoePtrs<NIN> in, F f, bool vec) {
  using T = moe_st_t<DT>;
  using C = moe_compute_t<DT>;
  constexpr int V = 16 / (int)sizeof(T);
  int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  int64_t nthreads = (int64_t)gridDim.x * blockDim.x;
  int64_t start = 0;
  if (vec) {
    int64_t nv = n / V;
    for (int64_t j = tid; j < nv; j += nthreads) {
      MoeVec<T, V> a[NIN], o[NOUT];
#pragma unroll
      for (int k = 0; k < NIN; k++) a[k] = ((const MoeVec<T, V> *)in.p[k])[j];
#pragma unroll
      for (int e = 0; e < V; e++) {
        C x[NIN], y[NOUT];
#pragma unroll
        for (int k = 0; k < NIN; k++) x[k] = moe_load_as<C, DT>(a[k].v[e]);
        f(x, y, j * V + e);
#pragma unroll
        for (int m = 0; m < NOUT; m++) o[m].v[e] = moe_store_from<DT, C>(y[m]);
      }
#pragma unroll
      for (int m = 0; m < NOUT; m++) ((MoeVec<T, V> *)out.p[m])[j] = o[m];
    }
    start = nv * V;
  }
  for (int64_t i = start + tid; i < n; i += nthreads) {
    C x[NIN], y[NOUT];
#pragma unroll
    for (int k = 0; k < NIN; k++) x[k] = moe_load_as<C, DT>(((const T *)in.p[k])[i]);
    f(x, y, i);
#pragma unroll
    for (int m = 0; m < NOUT; m++) ((T *)out.p[m])[i] = moe_store_from<DT, C>(y[m]);
  }
}

/* Any layout and dtypes (g: the outputs first, then the inputs). */
template <typename C, int NIN, int NOUT, typename F>
__global__ void __launch_bounds__(MOE_THREADS)
    pw_dyn_kernel(int64_t n, PwDynOut<NOUT> out, MoeDynIn<NIN> in, MoeGeom<NIN + NOUT> g, F f) {
  int64_t nthreads = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += nthreads) {
    int64_t off[NIN + NOUT];
    moe_geom_offsets<NIN + NOUT>(g, i, off);
    C x[NIN], y[NOUT];
#pragma unroll
    for (int k = 0; k < NIN; k++) x[k] = moe_dyn_load<C>(in.p[k], in.dt[k], off[NOUT + k]);
    f(x, y, i);
#pragma unroll
    for (int m = 0; m < NOUT; m++) moe_dyn_store<C>(out.p[m], out.dt[m], off[m], y[m]);
  }
}

/*
 * Dropout over a contiguous tensor. Element i's mask bit is lane i % 4 of
 * Philox block i / 4 (moe_pw_dropout_keep). With vec (both pointers 16-byte
 * aligned) a thread takes 8 consecutive elements per grid-stride step: it
 * issues their 16-byte loads (one vector of bf16/f16, two of f32, four of
 * f64), computes the two Philox blocks covering them once each while the
 * loads are in flight, and stores whole vectors. The remaining elements
 * (all of them without vec, fewer than 8 with it) go one Philox block of 4
 * scalar elements per thread. No Philox block is computed twice. Launch
 * bounds: at most 32 registers (8 blocks of 256 threads per SM, full
 * occupancy) for 2- and 4-byte dtypes, 48 for f64 (5 blocks), none spilling.
 */
template <moe_dtype DT>
__global__ void __launch_bounds__(MOE_THREADS, DT == MOE_F64 ? 5 : 8)
    pw_dropout_contig_kernel(int64_t n, void *out, const void *x, uint64_t seed, uint64_t call,
                             uint32_t thr, float scale32, double scale64, bool vec) {
  using T = moe_st_t<DT>;
  using C = moe_compute_t<DT>;
  constexpr int V = 16 / (int)sizeof(T); /* elements per 16-byte vector */
  constexpr int E = 8;                   /* elements per vector step: 2 Philox blocks */
  constexpr int NV = E / V;              /* vectors per step */
  static_assert(E % V == 0, "a step is whole vectors");
  using Vec = MoeVec<T, V>;
  C scale;
  if constexpr (std::is_same_v<C, double>) scale = scale64;
  else scale = scale32;
  int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  int64_t nthreads = (int64_t)gridDim.x * blockDim.x;
  int64_t ng = vec ? n / E : 0;
  for (int64_t j = tid; j < ng; j += nthreads) {
    Vec a[NV], o[NV];
#pragma unroll
    for (int k = 0; k < NV; k++) a[k] = ((const Vec *)x)[j * NV + k];
    moe_philox4 r[2];
    r[0] = moe_philox(seed, 2 * (uint64_t)j, call);
    r[1] = moe_philox(seed, 2 * (uint64_t)j + 1, call);
#pragma unroll
    for (int k = 0; k < NV; k++) {
#pragma unroll
      for (int e = 0; e < V; e++) {
        const int l = k * V + e; /* element 8j + l: block 2j + l / 4, lane l % 4 */
        bool keep = (r[l >> 2].v[l & 3] >> 8) >= thr;
        o[k].v[e] = moe_store_from<DT, C>(keep ? moe_load_as<C, DT>(a[k].v[e]) * scale : (C)0);
      }
    }
#pragma unroll
    for (int k = 0; k < NV; k++) ((Vec *)out)[j * NV + k] = o[k];
  }
  int64_t nb = (n + 3) / 4;
  for (int64_t b = ng * (E / 4) + tid; b < nb; b += nthreads) {
    moe_philox4 r = moe_philox(seed, (uint64_t)b, call);
    for (int e = 0; e < 4 && 4 * b + e < n; e++) {
      int64_t i = 4 * b + e;
      C v = moe_load_as<C, DT>(((const T *)x)[i]);
      ((T *)out)[i] = moe_store_from<DT, C>((r.v[e] >> 8) >= thr ? v * scale : (C)0);
    }
  }
}

/* ------------------------------------------------------------ launchers */

/* Which compute type a dtype's math uses: 0 float, 1 double, 2 int64. */
static int pw_cclass(moe_dtype dt) {
  return dt == MOE_F64 ? 1 : moe_dtype_is_float(dt) ? 0 : 2;
}

/* Calls f(tag) for the float dtype dt (F32, F64, BF16, F16). */
template <typename F> static moe_status pw_float_dispatch(moe_dtype dt, F &&f) {
  switch (dt) {
    case MOE_F32: return f(MoeDtTag<MOE_F32>{});
    case MOE_F64: return f(MoeDtTag<MOE_F64>{});
    case MOE_BF16: return f(MoeDtTag<MOE_BF16>{});
    case MOE_F16: return f(MoeDtTag<MOE_F16>{});
    default: return MOE_ERR_INTERNAL;
  }
}

/* Whether the contiguous typed kernel applies: one float dtype whose compute
 * class is cdt's, every view dense in row-major order. */
template <int N>
static bool pw_typed_ok(const moe_kview *const *v, const MoeGeom<N> &g, moe_dtype cdt) {
  for (int k = 0; k < N; k++)
    if (v[k]->dtype != v[0]->dtype) return false;
  return moe_dtype_is_float(v[0]->dtype) && pw_cclass(v[0]->dtype) == pw_cclass(cdt) &&
         moe_geom_contiguous(g);
}

template <moe_dtype DT, int NIN, int NOUT, typename F>
static void pw_launch_contig(cudaStream_t s, int64_t n, const moe_kview *const *v, F f) {
  using T = moe_st_t<DT>;
  constexpr int V = 16 / (int)sizeof(T);
  PwOut<NOUT> out;
  MoePtrs<NIN> in;
  bool vec = n >= V;
  for (int m = 0; m < NOUT; m++) {
    out.p[m] = v[m]->data;
    vec = vec && moe_aligned(v[m]->data, 16);
  }
  for (int k = 0; k < NIN; k++) {
    in.p[k] = v[NOUT + k]->data;
    vec = vec && moe_aligned(v[NOUT + k]->data, 16);
  }
  pw_contig_kernel<DT, NIN, NOUT><<<moe_blocks(vec ? n / V : n), MOE_THREADS, 0, s>>>(n, out, in, f, vec);
}

template <typename C, int NIN, int NOUT, typename F>
static void pw_launch_dyn(cudaStream_t s, int64_t n, const moe_kview *const *v,
                          const MoeGeom<NIN + NOUT> &g, F f) {
  PwDynOut<NOUT> out;
  MoeDynIn<NIN> in;
  for (int m = 0; m < NOUT; m++) {
    out.p[m] = v[m]->data;
    out.dt[m] = v[m]->dtype;
  }
  for (int k = 0; k < NIN; k++) {
    in.p[k] = v[NOUT + k]->data;
    in.dt[k] = v[NOUT + k]->dtype;
  }
  pw_dyn_kernel<C, NIN, NOUT><<<moe_blocks(n), MOE_THREADS, 0, s>>>(n, out, in, g, f);
}

/*
 * Runs Fn<C>{args...} over v = NOUT outputs then NIN inputs of one shape;
 * C is the compute type of cdt (integer compute only when INTS).
 */
template <int NIN, int NOUT, bool INTS, template <typename> class Fn, typename... Args>
static moe_status pw_launch(moe_ctx *ctx, int device, const char *fn, const moe_kview *const *v,
                            moe_dtype cdt, Args... args) {
  int64_t n = 0;
  MOE_CHECK(moe_kviews_check(ctx, fn, NIN + NOUT, v, &n));
  if (n == 0) return MOE_OK;
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  cudaStream_t s = (cudaStream_t)stream;
  MoeGeom<NIN + NOUT> g;
  moe_geom_init<NIN + NOUT>(&g, v);
  moe_status st;
  if (pw_typed_ok<NIN + NOUT>(v, g, cdt)) {
    st = pw_float_dispatch(v[0]->dtype, [&](auto tag) -> moe_status {
      constexpr moe_dtype DT = decltype(tag)::value;
      pw_launch_contig<DT, NIN, NOUT>(s, n, v, Fn<moe_compute_t<DT>>(args...));
      return MOE_OK;
    });
  } else if (pw_cclass(cdt) == 1) {
    pw_launch_dyn<double, NIN, NOUT>(s, n, v, g, Fn<double>(args...));
    st = MOE_OK;
  } else if (pw_cclass(cdt) == 0) {
    pw_launch_dyn<float, NIN, NOUT>(s, n, v, g, Fn<float>(args...));
    st = MOE_OK;
  } else if constexpr (INTS) {
    pw_launch_dyn<int64_t, NIN, NOUT>(s, n, v, g, Fn<int64_t>(args...));
    st = MOE_OK;
  } else {
    st = moe_error(ctx, MOE_ERR_INTERNAL, "%s: integer compute for a float-only op", fn);
  }
  MOE_CHECK(st);
  MOE_CUDA_CHECK_LAUNCH(ctx, fn);
  return MOE_OK;
}

/* Calls g(std::integral_constant<int, op>) for a unary kop. */
template <typename G> static moe_status pw_kop_dispatch(int op, G &&g) {
  switch (op) {
    case MOE_PW_EXP: return g(std::integral_constant<int, MOE_PW_EXP>{});
    case MOE_PW_LOG: return g(std::integral_constant<int, MOE_PW_LOG>{});
    case MOE_PW_SQRT: return g(std::integral_constant<int, MOE_PW_SQRT>{});
    case MOE_PW_RSQRT: return g(std::integral_constant<int, MOE_PW_RSQRT>{});
    case MOE_PW_ABS: return g(std::integral_constant<int, MOE_PW_ABS>{});
    case MOE_PW_RELU: return g(std::integral_constant<int, MOE_PW_RELU>{});
    case MOE_PW_GELU: return g(std::integral_constant<int, MOE_PW_GELU>{});
    case MOE_PW_GELU_TANH: return g(std::integral_constant<int, MOE_PW_GELU_TANH>{});
    case MOE_PW_SILU: return g(std::integral_constant<int, MOE_PW_SILU>{});
    case MOE_PW_SIGMOID: return g(std::integral_constant<int, MOE_PW_SIGMOID>{});
    case MOE_PW_TANH: return g(std::integral_constant<int, MOE_PW_TANH>{});
    case MOE_PW_POW_SCALAR: return g(std::integral_constant<int, MOE_PW_POW_SCALAR>{});
    case MOE_PW_RPOW_SCALAR: return g(std::integral_constant<int, MOE_PW_RPOW_SCALAR>{});
    case MOE_PW_CLAMP: return g(std::integral_constant<int, MOE_PW_CLAMP>{});
    default: return MOE_ERR_INTERNAL;
  }
}

static moe_status pw_kop_check(moe_ctx *ctx, const char *fn, int op, bool unary) {
  bool ok = unary ? (op >= 0 && op < MOE_PW_UNARY_COUNT)
                  : (op >= MOE_PW_UNARY_COUNT && op < MOE_PW_KOP_COUNT);
  if (!ok) return moe_error(ctx, MOE_ERR_INTERNAL, "%s: kernel op %d is not a %s op", fn, op,
                            unary ? "unary" : "binary");
  return MOE_OK;
}

extern "C" moe_status moe_cuda_pw_unary(moe_ctx *ctx, int device, moe_pw_kop op,
                                        const moe_kview *out, const moe_kview *x, double p0,
                                        double p1, int64_t i0, int64_t i1) {
  const char *fn = "cuda pointwise unary";
  MOE_CHECK(pw_kop_check(ctx, fn, op, true));
  const moe_kview *v[2] = {out, x};
  int64_t n = 0;
  MOE_CHECK(moe_kviews_check(ctx, fn, 2, v, &n));
  if (n == 0) return MOE_OK;
  MoeGeom<2> g;
  moe_geom_init<2>(&g, v);
  if (!pw_typed_ok<2>(v, g, out->dtype))
    return pw_launch<1, 1, true, PwUnaryF>(ctx, device, fn, v, out->dtype, (int)op, p0, p1, i0, i1);
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  cudaStream_t s = (cudaStream_t)stream;
  MOE_CHECK(pw_float_dispatch(out->dtype, [&](auto tag) -> moe_status {
    constexpr moe_dtype DT = decltype(tag)::value;
    using C = moe_compute_t<DT>;
    return pw_kop_dispatch(op, [&](auto opc) -> moe_status {
      constexpr int OP = decltype(opc)::value;
      pw_launch_contig<DT, 1, 1>(s, n, v, PwUnaryFixed<C, OP>{(C)p0, (C)p1, i0, i1});
      return MOE_OK;
    });
  }));
  MOE_CUDA_CHECK_LAUNCH(ctx, fn);
  return MOE_OK;
}

extern "C" moe_status moe_cuda_pw_unary_grad(moe_ctx *ctx, int device, moe_pw_kop op,
                                             const moe_kview *gin, const moe_kview *g,
                                             const moe_kview *x, double p0, double p1) {
  const char *fn = "cuda pointwise unary grad";
  MOE_CHECK(pw_kop_check(ctx, fn, op, true));
  const moe_kview *v[3] = {gin, g, x};
  return pw_launch<2, 1, false, PwUnaryGradF>(ctx, device, fn, v, gin->dtype, (int)op, p0, p1);
}

extern "C" moe_status moe_cuda_pw_binary(moe_ctx *ctx, int device, moe_pw_kop op,
                                         const moe_kview *out, const moe_kview *a,
                                         const moe_kview *b) {
  const char *fn = "cuda pointwise binary";
  MOE_CHECK(pw_kop_check(ctx, fn, op, false));
  const moe_kview *v[3] = {out, a, b};
  return pw_launch<2, 1, true, PwBinaryF>(ctx, device, fn, v, out->dtype, (int)op);
}

extern "C" moe_status moe_cuda_pw_binary_grad(moe_ctx *ctx, int device, moe_pw_kop op,
                                              const moe_kview *ga, const moe_kview *gb,
                                              const moe_kview *g, const moe_kview *a,
                                              const moe_kview *b) {
  const char *fn = "cuda pointwise binary grad";
  MOE_CHECK(pw_kop_check(ctx, fn, op, false));
  if (ga && gb) {
    const moe_kview *v[5] = {ga, gb, g, a, b};
    return pw_launch<3, 2, false, PwBinaryGradF>(ctx, device, fn, v, g->dtype, (int)op, 0);
  }
  if (!ga && !gb) return MOE_OK;
  const moe_kview *v[4] = {ga ? ga : gb, g, a, b};
  return pw_launch<3, 1, false, PwBinaryGradF>(ctx, device, fn, v, g->dtype, (int)op, ga ? 0 : 1);
}

extern "C" moe_status moe_cuda_pw_compare(moe_ctx *ctx, int device, moe_op op, moe_dtype cdt,
                                          const moe_kview *out, const moe_kview *a,
                                          const moe_kview *b, double s) {
  const char *fn = "cuda compare";
  if (op < MOE_OP_EQ || op > MOE_OP_GE)
    return moe_error(ctx, MOE_ERR_INTERNAL, "%s: op %s is not a comparison", fn, moe_op_name(op));
  moe_dtype c = cdt == MOE_F64 ? MOE_F64 : MOE_I64; /* double or int64 */
  if (b) {
    const moe_kview *v[3] = {out, a, b};
    return pw_launch<2, 1, true, PwCompareF>(ctx, device, fn, v, c, (int)op, s);
  }
  const moe_kview *v[2] = {out, a};
  return pw_launch<1, 1, true, PwCompareF>(ctx, device, fn, v, c, (int)op, s);
}

extern "C" moe_status moe_cuda_pw_where(moe_ctx *ctx, int device, const moe_kview *out,
                                        const moe_kview *cond, const moe_kview *a,
                                        const moe_kview *b) {
  const moe_kview *v[4] = {out, cond, a, b};
  return pw_launch<3, 1, true, PwWhereF>(ctx, device, "cuda where", v, out->dtype);
}

extern "C" moe_status moe_cuda_pw_swiglu(moe_ctx *ctx, int device, const moe_kview *out,
                                         const moe_kview *gate, const moe_kview *up) {
  const moe_kview *v[3] = {out, gate, up};
  return pw_launch<2, 1, false, PwSwigluF>(ctx, device, "cuda swiglu", v, out->dtype);
}

extern "C" moe_status moe_cuda_pw_swiglu_grad(moe_ctx *ctx, int device, const moe_kview *dgate,
                                              const moe_kview *dup, const moe_kview *g,
                                              const moe_kview *gate, const moe_kview *up) {
  const char *fn = "cuda swiglu grad";
  if (dgate && dup) {
    const moe_kview *v[5] = {dgate, dup, g, gate, up};
    return pw_launch<3, 2, false, PwSwigluGradF>(ctx, device, fn, v, g->dtype, 0);
  }
  if (!dgate && !dup) return MOE_OK;
  const moe_kview *v[4] = {dgate ? dgate : dup, g, gate, up};
  return pw_launch<3, 1, false, PwSwigluGradF>(ctx, device, fn, v, g->dtype, dgate ? 0 : 1);
}

extern "C" moe_status moe_cuda_pw_dropout(moe_ctx *ctx, int device, const moe_kview *out,
                                          const moe_kview *x, uint64_t seed, uint64_t call,
                                          uint32_t thr, double scale) {
  const char *fn = "cuda dropout";
  const moe_kview *v[2] = {out, x};
  int64_t n = 0;
  MOE_CHECK(moe_kviews_check(ctx, fn, 2, v, &n));
  if (n == 0) return MOE_OK;
  MoeGeom<2> g;
  moe_geom_init<2>(&g, v);
  if (!pw_typed_ok<2>(v, g, out->dtype))
    return pw_launch<1, 1, false, PwDropoutF>(ctx, device, fn, v, out->dtype, seed, call, thr, scale);
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  cudaStream_t s = (cudaStream_t)stream;
  MOE_CHECK(pw_float_dispatch(out->dtype, [&](auto tag) -> moe_status {
    constexpr moe_dtype DT = decltype(tag)::value;
    /* 8 elements per thread step when vectorised, 4 (one Philox block) otherwise */
    bool vec = n >= 8 && moe_aligned(out->data, 16) && moe_aligned(x->data, 16);
    pw_dropout_contig_kernel<DT><<<moe_blocks(vec ? n / 8 : (n + 3) / 4), MOE_THREADS, 0, s>>>(
        n, out->data, x->data, seed, call, thr, (float)scale, scale, vec);
    return MOE_OK;
  }));
  MOE_CUDA_CHECK_LAUNCH(ctx, fn);
  return MOE_OK;
}
