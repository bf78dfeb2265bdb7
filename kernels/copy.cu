/*
 * copy.cu - CUDA launchers that write whole views: moe_cuda_copy (dtype
 * conversion, any strides, stride-0 broadcast sources), moe_cuda_fill and
 * moe_cuda_arange.
 *
 * Copy converts as the CPU reference does (core/copy.c, core/dtype.c): from a
 * float source through double (moe_load_f64 / moe_store_f64), from an integer
 * or bool source through int64 (moe_load_i64 / moe_store_i64, exact for i64).
 * Same-dtype contiguous copies are one cudaMemcpyAsync; same-dtype copies
 * whose innermost (merged) dim is dense in both views move whole rows in the
 * widest word (16, 8, 4, 2 or 1 bytes) that the row length, both pointers
 * and every row stride allow (moe_copy_rows_kernel); other same-dtype
 * strided copies move raw bits element by element; contiguous conversions
 * have a typed kernel per dtype pair (vectorised when aligned); strided
 * conversions take the runtime-dtype kernel. Fill converts its value once on the host with
 * moe_store_f64 itself and writes those bits. Arange computes
 * start + i * step with __dmul_rn / __dadd_rn (no FMA), like the CPU.
 * The views must not overlap each other (the core checks dst).
 */
#include "common.cuh"

template <typename C> struct MoeIdentityFn {
  __device__ __forceinline__ C operator()(const C (&x)[1]) const { return x[0]; }
};

/* Raw bits of one element size, any strides (same-dtype copy and fill). */
template <typename T>
__global__ void __launch_bounds__(MOE_THREADS)
    moe_copy_bits_kernel(int64_t n, T *dst, const T *src, MoeGeom<2> g) {
  int64_t nthreads = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += nthreads) {
    int64_t off[2];
    moe_geom_offsets<2>(g, i, off);
    dst[off[0]] = src[off[1]];
  }
}

template <typename T>
__global__ void __launch_bounds__(MOE_THREADS)
    moe_fill_bits_kernel(int64_t n, T *dst, T value, MoeGeom<1> g) {
  int64_t nthreads = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += nthreads) {
    int64_t off[1];
    moe_geom_offsets<1>(g, i, off);
    dst[off[0]] = value;
  }
}

template <typename T>
static void moe_copy_bits_launch(int64_t n, const moe_kview *dst, const moe_kview *src,
                                 const MoeGeom<2> &g, cudaStream_t s) {
  moe_copy_bits_kernel<T><<<moe_blocks(n), MOE_THREADS, 0, s>>>(n, (T *)dst->data,
                                                                (const T *)src->data, g);
}

/* ------------------------------------------------------------ row copies */

/*
 * A same-dtype copy whose innermost merged dim has stride 1 in both views:
 * `rows` rows of `row_words` words of type W (16, 8, 4, 2 or 1 bytes). The
 * outer dims (innermost first, at least one) give each row's offset in
 * words; the last takes what is left of the row index, so it needs no size.
 */
struct MoeRowGeom {
  int nouter;
  int64_t shape[MOE_MAX_DIMS - 1];
  int64_t dst[MOE_MAX_DIMS - 1], src[MOE_MAX_DIMS - 1]; /* strides in words */
};

/* threadIdx.y and blockIdx.y walk rows, threadIdx.x and blockIdx.x the words
 * of a row: a thread finds its row's offsets once and then copies. I is
 * uint32_t when rows and row_words are below 2^31 (the loop steps stay
 * below 2^24, so nothing wraps), int64_t otherwise. */
template <typename W, typename I>
__global__ void __launch_bounds__(MOE_THREADS)
    moe_copy_rows_kernel(I rows, I row_words, W *__restrict__ dst, const W *__restrict__ src,
                         MoeRowGeom g) {
  for (I r = (I)blockIdx.y * blockDim.y + threadIdx.y; r < rows; r += (I)gridDim.y * blockDim.y) {
    int64_t od = 0, os = 0;
    I q = r;
#pragma unroll
    for (int j = 0; j < MOE_MAX_DIMS - 1; j++) {
      if (j == g.nouter - 1) {
        od += (int64_t)q * g.dst[j];
        os += (int64_t)q * g.src[j];
        break;
      }
      I n = (I)g.shape[j], t = q / n, c = q - t * n;
      q = t;
      od += (int64_t)c * g.dst[j];
      os += (int64_t)c * g.src[j];
    }
    W *d = dst + od;
    const W *s = src + os;
    for (I w = (I)blockIdx.x * blockDim.x + threadIdx.x; w < row_words;
         w += (I)gridDim.x * blockDim.x)
      d[w] = s[w];
  }
}

/* A block of MOE_THREADS threads: x over the words of a row (a power of two,
 * at most MOE_THREADS), y over rows; grid-stride loops cover what the grid
 * caps leave. */
static void moe_rows_grid(int64_t rows, int64_t row_words, dim3 *grid, dim3 *block) {
  int64_t tx = 1;
  while (tx < row_words && tx < MOE_THREADS) tx *= 2;
  int64_t ty = MOE_THREADS / tx;
  int64_t gx = (row_words + tx - 1) / tx, gy = (rows + ty - 1) / ty;
  if (gx > 65535) gx = 65535;
  if (gy > 65535) gy = 65535;
  *block = dim3((unsigned)tx, (unsigned)ty, 1);
  *grid = dim3((unsigned)gx, (unsigned)gy, 1);
}

template <typename W>
static void moe_copy_rows_typed(int64_t rows, int64_t row_words, void *dst, const void *src,
                                const MoeRowGeom &rg, cudaStream_t s) {
  dim3 grid, block;
  moe_rows_grid(rows, row_words, &grid, &block);
  if (rows <= INT32_MAX && row_words <= INT32_MAX)
    moe_copy_rows_kernel<W, uint32_t><<<grid, block, 0, s>>>(
        (uint32_t)rows, (uint32_t)row_words, (W *)dst, (const W *)src, rg);
  else
    moe_copy_rows_kernel<W, int64_t><<<grid, block, 0, s>>>(rows, row_words, (W *)dst,
                                                            (const W *)src, rg);
}

/* g (merged, ndim >= 2) has stride 1 innermost in both views. The word is
 * the widest power of two up to 16 bytes dividing the row's bytes, both
 * pointers and every outer stride in bytes (stride 0 of a broadcast source
 * divides anything). */
static void moe_copy_rows(int64_t n, const moe_kview *dst, const moe_kview *src,
                          const MoeGeom<2> &g, size_t es, cudaStream_t s) {
  uint64_t bits = (uint64_t)(uintptr_t)dst->data | (uint64_t)(uintptr_t)src->data |
                  (uint64_t)g.shape[0] * es;
  for (int j = 1; j < g.ndim; j++)
    for (int k = 0; k < 2; k++) {
      int64_t st = g.stride[k][j];
      bits |= (uint64_t)(st < 0 ? -st : st) * es;
    }
  size_t wb = 16;
  while (wb > 1 && (bits & (wb - 1)) != 0) wb /= 2;
  MoeRowGeom rg;
  memset(&rg, 0, sizeof rg);
  rg.nouter = g.ndim - 1;
  for (int j = 1; j < g.ndim; j++) {
    rg.shape[j - 1] = g.shape[j];
    rg.dst[j - 1] = g.stride[0][j] * (int64_t)es / (int64_t)wb;
    rg.src[j - 1] = g.stride[1][j] * (int64_t)es / (int64_t)wb;
  }
  int64_t rows = n / g.shape[0], row_words = g.shape[0] * (int64_t)es / (int64_t)wb;
  switch (wb) {
    case 16: moe_copy_rows_typed<uint4>(rows, row_words, dst->data, src->data, rg, s); break;
    case 8: moe_copy_rows_typed<uint2>(rows, row_words, dst->data, src->data, rg, s); break;
    case 4: moe_copy_rows_typed<uint32_t>(rows, row_words, dst->data, src->data, rg, s); break;
    case 2: moe_copy_rows_typed<uint16_t>(rows, row_words, dst->data, src->data, rg, s); break;
    default: moe_copy_rows_typed<uint8_t>(rows, row_words, dst->data, src->data, rg, s); break;
  }
}

template <moe_dtype OUT, moe_dtype IN>
static void moe_copy_convert_contig(int64_t n, const moe_kview *dst, const moe_kview *src,
                                    cudaStream_t s) {
  using C = std::conditional_t<moe_is_float_v<IN>, double, int64_t>;
  MoePtrs<1> in;
  in.p[0] = src->data;
  bool vec = n >= MOE_VEC && moe_aligned(dst->data, MOE_VEC * sizeof(moe_st_t<OUT>)) &&
             moe_aligned(src->data, MOE_VEC * sizeof(moe_st_t<IN>));
  moe_ew_contig_kernel<OUT, IN, C, 1><<<moe_blocks(vec ? n / MOE_VEC : n), MOE_THREADS, 0, s>>>(
      n, dst->data, in, MoeIdentityFn<C>{}, vec);
}

extern "C" moe_status moe_cuda_copy(moe_ctx *ctx, int device, const moe_kview *dst,
                                    const moe_kview *src) {
  const moe_kview *v[2] = {dst, src};
  int64_t n = 0;
  MOE_CHECK(moe_kviews_check(ctx, "cuda copy", 2, v, &n));
  if (n == 0) return MOE_OK;
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  cudaStream_t s = (cudaStream_t)stream;
  MoeGeom<2> g;
  moe_geom_init<2>(&g, v);
  bool contig = moe_geom_contiguous(g);
  size_t es = moe_dtype_size(dst->dtype);
  if (dst->dtype == src->dtype) {
    if (contig) {
      MOE_CUDA_CHECK(ctx, cudaMemcpyAsync(dst->data, src->data, (size_t)n * es,
                                     cudaMemcpyDeviceToDevice, s));
      return MOE_OK;
    }
    if (g.ndim >= 2 && g.stride[0][0] == 1 && g.stride[1][0] == 1) {
      moe_copy_rows(n, dst, src, g, es, s);
      MOE_CUDA_CHECK_LAUNCH(ctx, "cuda copy kernel");
      return MOE_OK;
    }
    switch (es) {
      case 1: moe_copy_bits_launch<uint8_t>(n, dst, src, g, s); break;
      case 2: moe_copy_bits_launch<uint16_t>(n, dst, src, g, s); break;
      case 4: moe_copy_bits_launch<uint32_t>(n, dst, src, g, s); break;
      default: moe_copy_bits_launch<uint64_t>(n, dst, src, g, s); break;
    }
  } else if (contig) {
    MOE_CHECK(moe_dtype_dispatch(dst->dtype, [&](auto otag) -> moe_status {
      return moe_dtype_dispatch(src->dtype, [&](auto itag) -> moe_status {
        moe_copy_convert_contig<decltype(otag)::value, decltype(itag)::value>(n, dst, src, s);
        return MOE_OK;
      });
    }));
  } else {
    MoeDynIn<1> in;
    in.p[0] = src->data;
    in.dt[0] = src->dtype;
    if (moe_dtype_is_float(src->dtype))
      moe_ew_dynamic_kernel<double, 1><<<moe_blocks(n), MOE_THREADS, 0, s>>>(
          n, dst->data, dst->dtype, in, g, MoeIdentityFn<double>{});
    else
      moe_ew_dynamic_kernel<int64_t, 1><<<moe_blocks(n), MOE_THREADS, 0, s>>>(
          n, dst->data, dst->dtype, in, g, MoeIdentityFn<int64_t>{});
  }
  MOE_CUDA_CHECK_LAUNCH(ctx, "cuda copy kernel");
  return MOE_OK;
}

template <typename T>
static void moe_fill_bits_launch(int64_t n, const moe_kview *dst, const unsigned char *bits,
                                 const MoeGeom<1> &g, cudaStream_t s) {
  T value;
  memcpy(&value, bits, sizeof(T));
  moe_fill_bits_kernel<T><<<moe_blocks(n), MOE_THREADS, 0, s>>>(n, (T *)dst->data, value, g);
}

extern "C" moe_status moe_cuda_fill(moe_ctx *ctx, int device, const moe_kview *dst,
                                    double value) {
  const moe_kview *v[1] = {dst};
  int64_t n = 0;
  MOE_CHECK(moe_kviews_check(ctx, "cuda fill", 1, v, &n));
  if (n == 0) return MOE_OK;
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  cudaStream_t s = (cudaStream_t)stream;
  unsigned char bits[8] = {0};
  moe_store_f64(bits, dst->dtype, value); /* exactly the CPU's conversion */
  size_t es = moe_dtype_size(dst->dtype);
  MoeGeom<1> g;
  moe_geom_init<1>(&g, v);
  bool same_bytes = true; /* every byte equal: a memset does it */
  for (size_t k = 1; k < es; k++) same_bytes = same_bytes && bits[k] == bits[0];
  if (moe_geom_contiguous(g) && same_bytes) {
    MOE_CUDA_CHECK(ctx, cudaMemsetAsync(dst->data, bits[0], (size_t)n * es, s));
    return MOE_OK;
  }
  switch (es) {
    case 1: moe_fill_bits_launch<uint8_t>(n, dst, bits, g, s); break;
    case 2: moe_fill_bits_launch<uint16_t>(n, dst, bits, g, s); break;
    case 4: moe_fill_bits_launch<uint32_t>(n, dst, bits, g, s); break;
    default: moe_fill_bits_launch<uint64_t>(n, dst, bits, g, s); break;
  }
  MOE_CUDA_CHECK_LAUNCH(ctx, "cuda fill kernel");
  return MOE_OK;
}

struct MoeArangeGen {
  double start, step;
  __device__ __forceinline__ double operator()(int64_t i) const {
    return __dadd_rn(start, __dmul_rn((double)i, step));
  }
};

extern "C" moe_status moe_cuda_arange(moe_ctx *ctx, int device, const moe_kview *dst,
                                      double start, double step) {
  const moe_kview *v[1] = {dst};
  int64_t n = 0;
  MOE_CHECK(moe_kviews_check(ctx, "cuda arange", 1, v, &n));
  if (n == 0) return MOE_OK;
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  cudaStream_t s = (cudaStream_t)stream;
  MoeGeom<1> g;
  moe_geom_init<1>(&g, v);
  MoeArangeGen gen{start, step};
  MOE_CHECK(moe_dtype_dispatch(dst->dtype, [&](auto tag) -> moe_status {
    moe_gen_kernel<decltype(tag)::value><<<moe_blocks(n), MOE_THREADS, 0, s>>>(n, dst->data, g,
                                                                               gen);
    return MOE_OK;
  }));
  MOE_CUDA_CHECK_LAUNCH(ctx, "cuda arange kernel");
  return MOE_OK;
}
