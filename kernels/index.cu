/*
 * index.cu - CUDA kernels of the index family (entry points in
 * core/index_cuda.h, called by core/index.c): gather, the sort-based
 * scatter / scatter_add, index_add, one_hot, bincount, row sort (CUB), warp
 * topk, rope and multinomial.
 *
 * No floating-point atomics: accumulation sorts the targets with CUB's stable
 * radix sort. scatter_add gives each distinct target one thread, which adds
 * its sources in the order of the index tensor (the CPU's order); index_add
 * sums windows of the sorted index in parallel and joins them in window
 * order (the order of moe_index.h, which the CPU follows). Sums run in
 * f32 for f32/bf16/f16 (f64 for f64, i64 for integers) with the _rn
 * intrinsics, so nothing is fused. Index math is int64 (rope: 32-bit where
 * the sizes allow); out-of-range indices
 * read 0 and drop writes, and the first one is reported in the device's
 * error word (kerr.h), an error at the next synchronisation (moe_index.h). Nothing here synchronises with the
 * host; scratch memory comes from the context's caching allocator and goes
 * back to it after the launches are queued (one stream: safe).
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>

#include "common.cuh"
#include "index_cuda.h"
#include "philox.h"

/* ------------------------------------------------------------- helpers */

static inline size_t ix_align(size_t n) { return (n + 255) & ~(size_t)255; }

/* Bits needed to hold keys in [0, maxkey]. */
static inline int ix_key_bits(uint64_t maxkey) {
  int b = 1;
  while (b < 64 && (maxkey >> b) != 0) b++;
  return b;
}

__device__ __forceinline__ int64_t ix_load_index(const void *p, bool i32, int64_t off) {
  return i32 ? (int64_t)((const int32_t *)p)[off] : ((const int64_t *)p)[off];
}

template <typename C> __device__ __forceinline__ C ix_add(C a, C b) {
  if constexpr (std::is_same_v<C, float>) return __fadd_rn(a, b);
  else if constexpr (std::is_same_v<C, double>) return __dadd_rn(a, b);
  else return (int64_t)((uint64_t)a + (uint64_t)b);
}

/* Calls f(type tag) with an unsigned type of the element size. */
template <typename F> static moe_status ix_size_dispatch(size_t es, F &&f) {
  switch (es) {
    case 1: return f(uint8_t{});
    case 2: return f(uint16_t{});
    case 4: return f(uint32_t{});
    case 8: return f(uint64_t{});
    default: return MOE_ERR_INTERNAL;
  }
}

/* N-d geometry passed by value: a shape and up to three stride sets. */
struct IxGeom {
  int ndim, dim;
  int64_t dimsize; /* valid index range [0, dimsize) */
  moe_kerr *kerr;  /* where an index outside it is reported (NULL: nowhere) */
  int kerr_tag;
  int64_t shape[MOE_MAX_DIMS];
  int64_t s0[MOE_MAX_DIMS], s1[MOE_MAX_DIMS], s2[MOE_MAX_DIMS];
};

/* ---------------------------------------------------------------- gather */

/* out[p] = x[p with dim <- index[p]]; s0: index strides, s1: x strides. */
template <typename T>
__global__ void __launch_bounds__(MOE_THREADS)
    ix_gather_kernel(int64_t n, T *out, const T *x, const void *index, bool i32, IxGeom g) {
  int64_t nthreads = (int64_t)gridDim.x * blockDim.x;
  for (int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; p < n; p += nthreads) {
    int64_t r = p, io = 0, xo = 0;
    for (int d = g.ndim - 1; d >= 0; d--) {
      int64_t c = r % g.shape[d];
      r /= g.shape[d];
      io += c * g.s0[d];
      if (d != g.dim) xo += c * g.s1[d];
    }
    int64_t v = ix_load_index(index, i32, io);
    const bool ok = v >= 0 && v < g.dimsize;
    if (!ok) moe_kerr_report(g.kerr, g.kerr_tag, v, g.dimsize);
    out[p] = ok ? x[xo + v * g.s1[g.dim]] : (T)0;
  }
}

extern "C" moe_status moe_cuda_gather(moe_ctx *ctx, int device, const char *fn, const moe_kview *out,
                                      const moe_kview *x, int dim, const moe_kview *index) {
  int64_t n = 1;
  for (int d = 0; d < index->ndim; d++) n *= index->shape[d];
  if (n == 0) return MOE_OK;
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  IxGeom g;
  memset(&g, 0, sizeof g);
  g.ndim = index->ndim;
  g.dim = dim;
  g.dimsize = x->shape[dim];
  g.kerr = (moe_kerr *)moe_cuda_kerr(ctx, device, fn, &g.kerr_tag);
  for (int d = 0; d < g.ndim; d++) {
    g.shape[d] = index->shape[d];
    g.s0[d] = index->stride[d];
    g.s1[d] = x->stride[d];
  }
  bool i32 = index->dtype == MOE_I32;
  moe_status st = ix_size_dispatch(moe_dtype_size(x->dtype), [&](auto tag) -> moe_status {
    using T = decltype(tag);
    ix_gather_kernel<T><<<moe_blocks(n), MOE_THREADS, 0, (cudaStream_t)stream>>>(
        n, (T *)out->data, (const T *)x->data, index->data, i32, g);
    return MOE_OK;
  });
  MOE_CHECK(st);
  MOE_CUDA_CHECK_LAUNCH(ctx, "gather kernel");
  return MOE_OK;
}

/* --------------------------------------------------------------- scatter */

/* keys[p] = target offset in out (contiguous; s2 its strides) or oob;
 * vals[p] = p. s0: index strides. */
__global__ void __launch_bounds__(MOE_THREADS)
    ix_scatter_keys_kernel(int64_t n, uint64_t *keys, int64_t *vals, const void *index, bool i32,
                           IxGeom g, uint64_t oob) {
  int64_t nthreads = (int64_t)gridDim.x * blockDim.x;
  for (int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; p < n; p += nthreads) {
    int64_t r = p, io = 0, to = 0;
    for (int d = g.ndim - 1; d >= 0; d--) {
      int64_t c = r % g.shape[d];
      r /= g.shape[d];
      io += c * g.s0[d];
      if (d != g.dim) to += c * g.s2[d];
    }
    int64_t v = ix_load_index(index, i32, io);
    const bool ok = v >= 0 && v < g.dimsize;
    if (!ok) moe_kerr_report(g.kerr, g.kerr_tag, v, g.dimsize);
    keys[p] = ok ? (uint64_t)(to + v * g.s2[g.dim]) : oob;
    vals[p] = p;
  }
}

/* The thread at the first position of each run of equal keys owns that
 * target: REPLACE takes the run's last source, ADD sums the run in order.
 * s1: src strides over index's shape. */
template <moe_dtype DT>
__global__ void __launch_bounds__(MOE_THREADS)
    ix_scatter_seg_kernel(int64_t n, const uint64_t *keys, const int64_t *vals, void *out_,
                          const void *src_, IxGeom g, uint64_t oob, bool add) {
  using T = moe_st_t<DT>;
  using C = moe_compute_t<DT>;
  T *out = (T *)out_;
  const T *src = (const T *)src_;
  int64_t nthreads = (int64_t)gridDim.x * blockDim.x;
  for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += nthreads) {
    uint64_t k = keys[j];
    if (k >= oob || (j > 0 && keys[j - 1] == k)) continue;
    C acc = add ? moe_load_as<C, DT>(out[k]) : (C)0;
    int64_t jj = j;
    for (; jj < n && keys[jj] == k; jj++) {
      if (!add && !(jj + 1 == n || keys[jj + 1] != k)) continue; /* REPLACE: the last one */
      int64_t r = vals[jj], so = 0;
      for (int d = g.ndim - 1; d >= 0; d--) {
        int64_t c = r % g.shape[d];
        r /= g.shape[d];
        so += c * g.s1[d];
      }
      if (add) acc = ix_add<C>(acc, moe_load_as<C, DT>(src[so]));
      else out[k] = src[so];
    }
    if (add) out[k] = moe_store_from<DT, C>(acc);
  }
}

/* ADD of 32- and 64-bit integers: atomics, one thread per source element.
 * Integer addition is associative (two's complement wraps the same in any
 * order), so the result is as deterministic as the sorted path, without its
 * serial walk of each run: a histogram whose ids mostly fall in one bin (an
 * untrained router's expert counts) was one thread summing them all. */
template <typename T>
__global__ void __launch_bounds__(MOE_THREADS)
    ix_scatter_add_int_kernel(int64_t n, T *out, const T *src, const void *index, bool i32,
                              IxGeom g) {
  int64_t nthreads = (int64_t)gridDim.x * blockDim.x;
  for (int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; p < n; p += nthreads) {
    int64_t r = p, io = 0, so = 0, to = 0;
    for (int d = g.ndim - 1; d >= 0; d--) {
      int64_t c = r % g.shape[d];
      r /= g.shape[d];
      io += c * g.s0[d];
      so += c * g.s1[d];
      if (d != g.dim) to += c * g.s2[d];
    }
    int64_t v = ix_load_index(index, i32, io);
    if (v < 0 || v >= g.dimsize) {
      moe_kerr_report(g.kerr, g.kerr_tag, v, g.dimsize);
      continue;
    }
    T *dst = out + to + v * g.s2[g.dim];
    if constexpr (sizeof(T) == 8)
      atomicAdd((unsigned long long *)dst, (unsigned long long)src[so]);
    else
      atomicAdd((int *)dst, (int)src[so]);
  }
}

/* Sorts n (key, value) pairs by the low `bits` bits of the keys (stable). */
static moe_status ix_sort_pairs(moe_ctx *ctx, int device, cudaStream_t s, const uint64_t *kin,
                                uint64_t *kout, const int64_t *vin, int64_t *vout, int64_t n,
                                int bits) {
  size_t bytes = 0;
  MOE_CUDA_CHECK(ctx, cub::DeviceRadixSort::SortPairs(nullptr, bytes, kin, kout, vin, vout, n, 0, bits, s));
  MoeScratch tmp(ctx, device);
  MOE_CHECK(tmp.alloc(bytes > 0 ? bytes : 1));
  MOE_CUDA_CHECK(ctx, cub::DeviceRadixSort::SortPairs(tmp.ptr, bytes, kin, kout, vin, vout, n, 0, bits, s));
  return MOE_OK;
}

extern "C" moe_status moe_cuda_scatter(moe_ctx *ctx, int device, const char *fn,
                                       moe_scatter_mode mode, const moe_kview *out, int dim,
                                       const moe_kview *index, const moe_kview *src) {
  int64_t n = 1, on = 1;
  for (int d = 0; d < index->ndim; d++) n *= index->shape[d];
  for (int d = 0; d < out->ndim; d++) on *= out->shape[d];
  if (n == 0 || on == 0) return MOE_OK;
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  cudaStream_t s = (cudaStream_t)stream;
  IxGeom g;
  memset(&g, 0, sizeof g);
  g.ndim = index->ndim;
  g.dim = dim;
  g.dimsize = out->shape[dim];
  g.kerr = (moe_kerr *)moe_cuda_kerr(ctx, device, fn, &g.kerr_tag);
  for (int d = 0; d < g.ndim; d++) {
    g.shape[d] = index->shape[d];
    g.s0[d] = index->stride[d];
    g.s1[d] = src->stride[d];
    g.s2[d] = out->stride[d];
  }
  bool add = mode == MOE_SCATTER_ADD;
  if (add && (out->dtype == MOE_I64 || out->dtype == MOE_I32)) {
    bool i32 = index->dtype == MOE_I32;
    if (out->dtype == MOE_I64)
      ix_scatter_add_int_kernel<int64_t><<<moe_blocks(n), MOE_THREADS, 0, s>>>(
          n, (int64_t *)out->data, (const int64_t *)src->data, index->data, i32, g);
    else
      ix_scatter_add_int_kernel<int32_t><<<moe_blocks(n), MOE_THREADS, 0, s>>>(
          n, (int32_t *)out->data, (const int32_t *)src->data, index->data, i32, g);
    MOE_CUDA_CHECK_LAUNCH(ctx, "scatter_add integer kernel");
    return MOE_OK;
  }
  uint64_t oob = (uint64_t)on;
  size_t kb = ix_align((size_t)n * 8);
  MoeScratch buf(ctx, device);
  MOE_CHECK(buf.alloc(4 * kb));
  char *b = (char *)buf.ptr;
  uint64_t *kin = (uint64_t *)b, *kout = (uint64_t *)(b + kb);
  int64_t *vin = (int64_t *)(b + 2 * kb), *vout = (int64_t *)(b + 3 * kb);
  ix_scatter_keys_kernel<<<moe_blocks(n), MOE_THREADS, 0, s>>>(n, kin, vin, index->data,
                                                               index->dtype == MOE_I32, g, oob);
  MOE_CUDA_CHECK_LAUNCH(ctx, "scatter keys kernel");
  MOE_CHECK(ix_sort_pairs(ctx, device, s, kin, kout, vin, vout, n, ix_key_bits(oob)));
  moe_status st = moe_dtype_dispatch(out->dtype, [&](auto tag) -> moe_status {
    ix_scatter_seg_kernel<decltype(tag)::value><<<moe_blocks(n), MOE_THREADS, 0, s>>>(
        n, kout, vout, out->data, src->data, g, oob, add);
    return MOE_OK;
  });
  MOE_CHECK(st);
  MOE_CUDA_CHECK_LAUNCH(ctx, "scatter segment kernel");
  return MOE_OK;
}

/* ------------------------------------------------------------- index_add */

__global__ void __launch_bounds__(MOE_THREADS)
    ix_index_keys_kernel(int64_t n, uint64_t *keys, int64_t *vals, const void *index, bool i32,
                         int64_t X, moe_kerr *kerr, int kerr_tag) {
  int64_t nthreads = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += nthreads) {
    int64_t v = ix_load_index(index, i32, i);
    const bool ok = v >= 0 && v < X;
    if (!ok) moe_kerr_report(kerr, kerr_tag, v, X);
    keys[i] = ok ? (uint64_t)v : (uint64_t)X;
    vals[i] = i;
  }
}

/* index_add in the order of moe_index.h (moe_index_add), P =
 * MOE_INDEX_ADD_WINDOW. The sorted entries (keys ascending, positions
 * ascending per key: CUB's radix sort is stable; out-of-range keys, X, come
 * last) are cut into windows [wP, wP + P).
 *
 * Pass 1, thread (o, w, e): walks window w's entries; each run of one key
 * k is summed left to right in C. A run that starts k's segment (its head)
 * starts from out[o, k, e]; a run that continues the segment from window
 * w - 1 (only a window's first run can) starts from its first entry. A head
 * that ends inside the window writes out[o, k, e]; a head that goes on
 * into window w + 1 leaves its sum in H[o, w, e], a continuation leaves
 * its sum in Cw[o, w, e] (a window holds at most one of each). Consecutive
 * threads take consecutive e (coalesced rows). */
template <moe_dtype DT>
__global__ void __launch_bounds__(MOE_THREADS)
    ix_index_add_kernel(int64_t total, const uint64_t *keys, const int64_t *vals, void *out_,
                        const void *src_, moe_compute_t<DT> *H, moe_compute_t<DT> *Cw, int64_t X,
                        int64_t n, int64_t inner, int64_t nwin) {
  using T = moe_st_t<DT>;
  using C = moe_compute_t<DT>;
  constexpr int64_t P = MOE_INDEX_ADD_WINDOW;
  T *out = (T *)out_;
  const T *src = (const T *)src_;
  int64_t nthreads = (int64_t)gridDim.x * blockDim.x;
  for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < total; t += nthreads) {
    int64_t e = t % inner, rest = t / inner, w = rest % nwin, o = rest / nwin;
    int64_t j = w * P, end = j + P < n ? j + P : n;
    const T *ps = src + o * n * inner + e;
    while (j < end) {
      uint64_t k = keys[j];
      if (k >= (uint64_t)X) break; /* out of range: the rest of the sort is too */
      T *po = out + (o * X + (int64_t)k) * inner + e;
      const bool head = j == 0 || keys[j - 1] != k;
      int64_t r = j + 1; /* the run is [j, r): found first, so the adds below */
      while (r < end && keys[r] == k) r++; /* have a known count and their loads overlap */
      C acc = head ? moe_load_as<C, DT>(*po) : moe_load_as<C, DT>(ps[vals[j] * inner]);
#pragma unroll 4
      for (int64_t jj = head ? j : j + 1; jj < r; jj++)
        acc = ix_add<C>(acc, moe_load_as<C, DT>(ps[vals[jj] * inner]));
      if (!head) Cw[t] = acc;
      else if (r == end && r < n && keys[r] == k) H[t] = acc;
      else *po = moe_store_from<DT, C>(acc);
      j = r;
    }
  }
}

/* Pass 2, thread (o, w, e): when window w holds the head of a segment that
 * goes on into window w + 1 (its last entry and the next have one key k,
 * and k's segment starts in w), out[o, k, e] = H[w] + Cw[w + 1] + Cw[w + 2]
 * ... in window order, while the segment goes on. Pass 1's thread (o, w, e)
 * is index t here too. */
template <moe_dtype DT>
__global__ void __launch_bounds__(MOE_THREADS)
    ix_index_add_join_kernel(int64_t total, const uint64_t *keys, void *out_,
                             const moe_compute_t<DT> *H, const moe_compute_t<DT> *Cw, int64_t X,
                             int64_t n, int64_t inner, int64_t nwin) {
  using T = moe_st_t<DT>;
  using C = moe_compute_t<DT>;
  constexpr int64_t P = MOE_INDEX_ADD_WINDOW;
  T *out = (T *)out_;
  int64_t nthreads = (int64_t)gridDim.x * blockDim.x;
  for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < total; t += nthreads) {
    int64_t e = t % inner, rest = t / inner, w = rest % nwin, o = rest / nwin;
    int64_t next = (w + 1) * P; /* the first entry of window w + 1 */
    if (next >= n) continue;
    uint64_t k = keys[next - 1];
    if (k >= (uint64_t)X || keys[next] != k || (w > 0 && keys[w * P - 1] == k)) continue;
    /* the segment's last window: the largest v with keys[vP] == k (keys
     * ascend, and window w + 1 starts with k), by bisection, so the adds
     * below have a known count and their loads overlap */
    int64_t lo = w + 1, hi = nwin; /* keys[lo P] == k; hi: past the end */
    while (hi - lo > 1) {
      int64_t mid = lo + (hi - lo) / 2;
      if (keys[mid * P] == k) lo = mid;
      else hi = mid;
    }
    C acc = H[t];
    const C *pc = Cw + t - w * inner;
#pragma unroll 8
    for (int64_t v = w + 1; v <= lo; v++) acc = ix_add<C>(acc, pc[v * inner]);
    out[(o * X + (int64_t)k) * inner + e] = moe_store_from<DT, C>(acc);
  }
}

extern "C" moe_status moe_cuda_index_add(moe_ctx *ctx, int device, const char *fn, void *out, const void *src,
                                         moe_dtype dt, const void *index, moe_dtype index_dt,
                                         int64_t outer, int64_t X, int64_t n, int64_t inner) {
  if (n == 0 || outer == 0 || inner == 0 || X == 0) return MOE_OK;
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  cudaStream_t s = (cudaStream_t)stream;
  size_t kb = ix_align((size_t)n * 8);
  MoeScratch buf(ctx, device);
  MOE_CHECK(buf.alloc(4 * kb));
  char *b = (char *)buf.ptr;
  uint64_t *kin = (uint64_t *)b, *kout = (uint64_t *)(b + kb);
  int64_t *vin = (int64_t *)(b + 2 * kb), *vout = (int64_t *)(b + 3 * kb);
  int tag = 0;
  moe_kerr *kerr = (moe_kerr *)moe_cuda_kerr(ctx, device, fn, &tag);
  ix_index_keys_kernel<<<moe_blocks(n), MOE_THREADS, 0, s>>>(n, kin, vin, index,
                                                             index_dt == MOE_I32, X, kerr, tag);
  MOE_CUDA_CHECK_LAUNCH(ctx, "index_add keys kernel");
  MOE_CHECK(ix_sort_pairs(ctx, device, s, kin, kout, vin, vout, n, ix_key_bits((uint64_t)X)));
  const int64_t nwin = (n + MOE_INDEX_ADD_WINDOW - 1) / MOE_INDEX_ADD_WINDOW;
  const int64_t total = outer * nwin * inner;
  MoeScratch part(ctx, device); /* H then Cw, each (outer, nwin, inner) */
  moe_status st = moe_dtype_dispatch(dt, [&](auto tag) -> moe_status {
    constexpr moe_dtype DT = decltype(tag)::value;
    using C = moe_compute_t<DT>;
    C *H = nullptr, *Cw = nullptr;
    if (nwin > 1) { /* one window: no segment spans two, no partials */
      MOE_CHECK(part.alloc(2 * (size_t)total * sizeof(C)));
      H = (C *)part.ptr;
      Cw = H + total;
    }
    ix_index_add_kernel<DT><<<moe_blocks(total), MOE_THREADS, 0, s>>>(total, kout, vout, out, src, H,
                                                                      Cw, X, n, inner, nwin);
    MOE_CUDA_CHECK_LAUNCH(ctx, "index_add kernel");
    if (nwin > 1) {
      ix_index_add_join_kernel<DT><<<moe_blocks(total), MOE_THREADS, 0, s>>>(total, kout, out, H, Cw,
                                                                             X, n, inner, nwin);
      MOE_CUDA_CHECK_LAUNCH(ctx, "index_add join kernel");
    }
    return MOE_OK;
  });
  return st;
}

/* --------------------------------------------------------------- one_hot */

__global__ void __launch_bounds__(MOE_THREADS)
    ix_one_hot_kernel(int64_t m, int64_t *out, const void *ids, bool i32, int64_t C, moe_kerr *kerr,
                      int kerr_tag) {
  int64_t nthreads = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < m; i += nthreads) {
    int64_t v = ix_load_index(ids, i32, i);
    if (v >= 0 && v < C) out[i * C + v] = 1;
    else moe_kerr_report(kerr, kerr_tag, v, C);
  }
}

extern "C" moe_status moe_cuda_one_hot(moe_ctx *ctx, int device, const char *fn, int64_t *out,
                                       const void *ids, moe_dtype ids_dt, int64_t m,
                                       int64_t num_classes) {
  if (m == 0 || num_classes == 0) return MOE_OK;
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  int tag = 0;
  moe_kerr *kerr = (moe_kerr *)moe_cuda_kerr(ctx, device, fn, &tag);
  ix_one_hot_kernel<<<moe_blocks(m), MOE_THREADS, 0, (cudaStream_t)stream>>>(
      m, out, ids, ids_dt == MOE_I32, num_classes, kerr, tag);
  MOE_CUDA_CHECK_LAUNCH(ctx, "one_hot kernel");
  return MOE_OK;
}

/* -------------------------------------------------------------- bincount */

/* Counts ids (contiguous (n)) into out (E). smem: each block counts into a
 * histogram of E 32-bit bins in shared memory (the launch keeps a block's
 * share of ids under 2^31), then adds its non-zero bins to out; else every
 * count goes straight to out. The warps walk the ids together (base is one
 * value per warp), so the lanes holding one id find each other
 * (__match_any_sync) and the lowest adds their number: one atomic per
 * distinct id per warp, which keeps a skewed histogram (an untrained router
 * sending most tokens to one expert) from queueing on one bin. Integer
 * atomics: the same counts in any order. ids outside [0, E) go nowhere and
 * are reported (kerr). */
__global__ void __launch_bounds__(MOE_THREADS)
    ix_bincount_kernel(int64_t n, const void *ids, bool i32, int64_t E, bool smem,
                       unsigned long long *out, moe_kerr *kerr, int kerr_tag) {
  extern __shared__ unsigned int ix_hist[];
  if (smem) {
    for (int64_t e = threadIdx.x; e < E; e += blockDim.x) ix_hist[e] = 0u;
    __syncthreads();
  }
  const int lane = threadIdx.x & 31;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t base = (int64_t)blockIdx.x * blockDim.x + (threadIdx.x & ~31); base < n;
       base += stride) {
    const int64_t i = base + lane;
    long long key = -1;
    if (i < n) {
      const int64_t v = ix_load_index(ids, i32, i);
      if (v >= 0 && v < E) key = (long long)v;
      else moe_kerr_report(kerr, kerr_tag, v, E);
    }
    const unsigned peers = __match_any_sync(0xffffffffu, key);
    if (key >= 0 && lane == __ffs(peers) - 1) {
      const unsigned c = (unsigned)__popc(peers);
      if (smem) atomicAdd(&ix_hist[key], c);
      else atomicAdd(&out[key], (unsigned long long)c);
    }
  }
  if (smem) {
    __syncthreads();
    for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
      const unsigned c = ix_hist[e];
      if (c) atomicAdd(&out[e], (unsigned long long)c);
    }
  }
}

extern "C" moe_status moe_cuda_bincount(moe_ctx *ctx, int device, const char *fn, int64_t *out,
                                        const void *ids, moe_dtype ids_dt, int64_t n, int64_t E) {
  if (E == 0) return MOE_OK;
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  cudaStream_t s = (cudaStream_t)stream;
  MOE_CUDA_CHECK(ctx, cudaMemsetAsync(out, 0, (size_t)E * sizeof(int64_t), s));
  if (n == 0) return MOE_OK;
  int tag = 0;
  moe_kerr *kerr = (moe_kerr *)moe_cuda_kerr(ctx, device, fn, &tag);
  const bool smem = E <= MOE_BINCOUNT_SMEM_MAX;
  /* 8 ids per thread, at most 256 blocks (each adds up to E bins to out),
   * and enough blocks that none counts 2^31 ids into its 32-bit bins */
  int64_t blocks = (n + MOE_THREADS * 8 - 1) / (MOE_THREADS * 8);
  if (blocks > 256) blocks = 256;
  const int64_t min_blocks = (n + ((int64_t)1 << 31) - 1) >> 31;
  if (blocks < min_blocks) blocks = min_blocks;
  if (blocks > INT32_MAX)
    return moe_error(ctx, MOE_ERR_NOT_SUPPORTED, "%s: %lld ids are too many for one launch", fn,
                     (long long)n);
  const size_t shm = smem ? (size_t)E * sizeof(unsigned int) : 0;
  ix_bincount_kernel<<<(unsigned)blocks, MOE_THREADS, shm, s>>>(
      n, ids, ids_dt == MOE_I32, E, smem, (unsigned long long *)out, kerr, tag);
  MOE_CUDA_CHECK_LAUNCH(ctx, "bincount kernel");
  return MOE_OK;
}

/* ------------------------------------------------------------------ sort */

template <moe_dtype DT> struct IxCubKey { using T = moe_st_t<DT>; };
template <> struct IxCubKey<MOE_BF16> { using T = __nv_bfloat16; };
template <> struct IxCubKey<MOE_F16> { using T = __half; };
template <> struct IxCubKey<MOE_BOOL> { using T = uint8_t; };

__global__ void __launch_bounds__(MOE_THREADS)
    ix_sort_init_kernel(int64_t n, int64_t cols, int64_t *vals, int *offsets, int64_t rows) {
  int64_t nthreads = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += nthreads) {
    vals[i] = i % cols;
    if (i % cols == 0) offsets[i / cols] = (int)i;
    if (i == 0) offsets[rows] = (int)n;
  }
}

extern "C" moe_status moe_cuda_sort_rows(moe_ctx *ctx, int device, void *values, int64_t *indices,
                                         const void *x, moe_dtype dt, int64_t rows, int64_t cols,
                                         bool descending) {
  int64_t n = rows * cols;
  if (n == 0) return MOE_OK;
  if (n >= INT32_MAX)
    return moe_error(ctx, MOE_ERR_NOT_SUPPORTED, "cuda sort: %lld elements (fewer than 2^31 please)",
                     (long long)n);
  if (dt == MOE_BOOL)
    return moe_error(ctx, MOE_ERR_DTYPE, "cuda sort: bool is not sorted");
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  cudaStream_t s = (cudaStream_t)stream;
  size_t vb = ix_align((size_t)n * 8), ob = ix_align((size_t)(rows + 1) * sizeof(int));
  MoeScratch buf(ctx, device);
  MOE_CHECK(buf.alloc(vb + ob));
  int64_t *vin = (int64_t *)buf.ptr;
  int *offsets = (int *)((char *)buf.ptr + vb);
  ix_sort_init_kernel<<<moe_blocks(n), MOE_THREADS, 0, s>>>(n, cols, vin, offsets, rows);
  MOE_CUDA_CHECK_LAUNCH(ctx, "sort init kernel");
  return moe_dtype_dispatch(dt, [&](auto tag) -> moe_status {
    using K = typename IxCubKey<decltype(tag)::value>::T;
    const K *kin = (const K *)x;
    K *kout = (K *)values;
    size_t bytes = 0;
    int ni = (int)n, nr = (int)rows;
    if (rows == 1) {
      if (descending)
        MOE_CUDA_CHECK(ctx, cub::DeviceRadixSort::SortPairsDescending(nullptr, bytes, kin, kout, vin, indices, ni, 0, (int)(sizeof(K) * 8), s));
      else
        MOE_CUDA_CHECK(ctx, cub::DeviceRadixSort::SortPairs(nullptr, bytes, kin, kout, vin, indices, ni, 0, (int)(sizeof(K) * 8), s));
    } else if (descending) {
      MOE_CUDA_CHECK(ctx, cub::DeviceSegmentedRadixSort::SortPairsDescending(nullptr, bytes, kin, kout, vin, indices, ni, nr, offsets, offsets + 1, 0, (int)(sizeof(K) * 8), s));
    } else {
      MOE_CUDA_CHECK(ctx, cub::DeviceSegmentedRadixSort::SortPairs(nullptr, bytes, kin, kout, vin, indices, ni, nr, offsets, offsets + 1, 0, (int)(sizeof(K) * 8), s));
    }
    MoeScratch tmp(ctx, device);
    MOE_CHECK(tmp.alloc(bytes > 0 ? bytes : 1));
    if (rows == 1) {
      if (descending)
        MOE_CUDA_CHECK(ctx, cub::DeviceRadixSort::SortPairsDescending(tmp.ptr, bytes, kin, kout, vin, indices, ni, 0, (int)(sizeof(K) * 8), s));
      else
        MOE_CUDA_CHECK(ctx, cub::DeviceRadixSort::SortPairs(tmp.ptr, bytes, kin, kout, vin, indices, ni, 0, (int)(sizeof(K) * 8), s));
    } else if (descending) {
      MOE_CUDA_CHECK(ctx, cub::DeviceSegmentedRadixSort::SortPairsDescending(tmp.ptr, bytes, kin, kout, vin, indices, ni, nr, offsets, offsets + 1, 0, (int)(sizeof(K) * 8), s));
    } else {
      MOE_CUDA_CHECK(ctx, cub::DeviceSegmentedRadixSort::SortPairs(tmp.ptr, bytes, kin, kout, vin, indices, ni, nr, offsets, offsets + 1, 0, (int)(sizeof(K) * 8), s));
    }
    MOE_CUDA_CHECK_LAUNCH(ctx, "cub sort");
    return MOE_OK;
  });
}

/* ------------------------------------------------------------------ topk */

template <typename C> __device__ __forceinline__ bool ix_isnan(C v) {
  if constexpr (std::is_same_v<C, int64_t>) return false;
  else return v != v;
}

/* (a, ia) comes before (b, ib): larger first (smaller when !largest), NaN
 * above every number, ties lowest index first. */
template <typename C>
__device__ __forceinline__ bool ix_before(C a, int64_t ia, C b, int64_t ib, bool largest) {
  bool na = ix_isnan(a), nb = ix_isnan(b);
  bool gt, lt;
  if (na || nb) {
    gt = na && !nb;
    lt = nb && !na;
  } else {
    gt = a > b;
    lt = a < b;
  }
  bool better = largest ? gt : lt, worse = largest ? lt : gt;
  return better || (!worse && ia < ib);
}

template <typename C> __device__ __forceinline__ C ix_shfl(C v, int off) {
  if constexpr (std::is_same_v<C, int64_t>)
    return (int64_t)__shfl_xor_sync(0xffffffffu, (long long)v, off);
  else
    return __shfl_xor_sync(0xffffffffu, v, off);
}

/* One warp per row, k rounds: each lane takes the best element strictly
 * after the previous pick in the order, then the warp reduces. */
template <moe_dtype DT>
__global__ void __launch_bounds__(MOE_THREADS)
    ix_topk_kernel(int64_t rows, int64_t cols, int k, bool largest, const void *x_, void *vals_,
                   int64_t *idx) {
  using T = moe_st_t<DT>;
  using C = moe_compute_t<DT>;
  int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  int lane = threadIdx.x & 31;
  if (warp >= rows) return;
  const T *row = (const T *)x_ + warp * cols;
  T *vals = (T *)vals_;
  C pv = (C)0;
  int64_t pi = -1;
  for (int r = 0; r < k; r++) {
    C bv = (C)0;
    int64_t bi = -1;
    for (int64_t j = lane; j < cols; j += 32) {
      C v = moe_load_as<C, DT>(row[j]);
      if (pi >= 0 && !ix_before<C>(pv, pi, v, j, largest)) continue;
      if (bi < 0 || ix_before<C>(v, j, bv, bi, largest)) {
        bv = v;
        bi = j;
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      C ov = ix_shfl<C>(bv, off);
      int64_t oi = (int64_t)__shfl_xor_sync(0xffffffffu, (long long)bi, off);
      if (oi >= 0 && (bi < 0 || ix_before<C>(ov, oi, bv, bi, largest))) {
        bv = ov;
        bi = oi;
      }
    }
    if (lane == 0) {
      vals[warp * k + r] = row[bi];
      idx[warp * k + r] = bi;
    }
    pv = bv;
    pi = bi;
  }
}

extern "C" moe_status moe_cuda_topk_rows(moe_ctx *ctx, int device, void *values, int64_t *indices,
                                         const void *x, moe_dtype dt, int64_t rows, int64_t cols,
                                         int64_t k, bool largest) {
  if (rows == 0 || k == 0) return MOE_OK;
  if (k < 1 || k > MOE_CUDA_TOPK_MAX_K || k > cols)
    return moe_error(ctx, MOE_ERR_INTERNAL, "cuda topk: k = %lld outside [1, %d] or above %lld",
                     (long long)k, MOE_CUDA_TOPK_MAX_K, (long long)cols);
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  int64_t warps_per_block = MOE_THREADS / 32;
  int64_t blocks = (rows + warps_per_block - 1) / warps_per_block;
  if (blocks > INT32_MAX) return moe_error(ctx, MOE_ERR_NOT_SUPPORTED, "cuda topk: too many rows");
  moe_status st = moe_dtype_dispatch(dt, [&](auto tag) -> moe_status {
    ix_topk_kernel<decltype(tag)::value><<<(unsigned)blocks, MOE_THREADS, 0, (cudaStream_t)stream>>>(
        rows, cols, (int)k, largest, x, values, indices);
    return MOE_OK;
  });
  MOE_CHECK(st);
  MOE_CUDA_CHECK_LAUNCH(ctx, "topk kernel");
  return MOE_OK;
}

/* ------------------------------------------------------------------ rope */

struct IxRope {
  int64_t shape[4]; /* x's shape with D replaced by h = D / 2 */
  int64_t xs[4], os[4];
  int64_t cs0, cs1, ss0, ss1;
  int64_t h;
  int tdim;
  bool full, inverse;
};

/*
 * Rotates the pairs (j, j + h) of x's rows; a row is one (c0, c1, c2). The
 * block's y threads (and the grid's y) walk rows, its x threads V
 * consecutive pairs each: a thread splits its row index once (I: uint32_t
 * when rows and h are below 2^31, int64_t otherwise) and finds the row's x,
 * out, cos and sin bases once. V > 1 only when the last dims of x, out, cos
 * and sin are dense and every pointer and row stride is a multiple of V
 * elements (ix_rope_vec): then each of x[j..], x[j+h..], the cos and sin
 * runs and the two outputs is one V-element (up to 16-byte) access. The
 * arithmetic per pair is the CPU's: the same products and sums, each
 * rounded once (_rn intrinsics, no FMA).
 */
template <moe_dtype DT, int V, typename I>
__global__ void __launch_bounds__(MOE_THREADS)
    ix_rope_kernel(I rows, I groups, void *out_, const void *x_, const void *c_, const void *s_,
                   IxRope g) {
  using T = moe_st_t<DT>;
  using C = moe_compute_t<DT>;
  using Vec = MoeVec<T, V>;
  T *out = (T *)out_;
  const T *x = (const T *)x_, *cs = (const T *)c_, *sn = (const T *)s_;
  const I n1 = (I)g.shape[1], n2 = (I)g.shape[2], h = (I)g.h;
  for (I r = (I)blockIdx.y * blockDim.y + threadIdx.y; r < rows; r += (I)gridDim.y * blockDim.y) {
    I q = r / n2, c2 = r - q * n2;
    I c0 = q / n1, c1 = q - c0 * n1;
    I t = g.tdim == 1 ? c1 : c2;
    const T *xr = x + ((int64_t)c0 * g.xs[0] + (int64_t)c1 * g.xs[1] + (int64_t)c2 * g.xs[2]);
    T *orow = out + ((int64_t)c0 * g.os[0] + (int64_t)c1 * g.os[1] + (int64_t)c2 * g.os[2]);
    const T *cr = cs + (int64_t)t * g.cs0, *sr = sn + (int64_t)t * g.ss0;
    for (I k = (I)blockIdx.x * blockDim.x + threadIdx.x; k < groups;
         k += (I)gridDim.x * blockDim.x) {
      I j = k * V, jb = g.full ? j + h : j;
      Vec va, vb, vc1, vc2, vs1, vs2, vo1, vo2;
      if constexpr (V > 1) { /* dense last dims, aligned: one access each */
        va = *(const Vec *)(xr + j);
        vb = *(const Vec *)(xr + j + h);
        vc1 = *(const Vec *)(cr + j);
        vc2 = *(const Vec *)(cr + jb);
        vs1 = *(const Vec *)(sr + j);
        vs2 = *(const Vec *)(sr + jb);
      } else {
        va.v[0] = xr[(int64_t)j * g.xs[3]];
        vb.v[0] = xr[(int64_t)(j + h) * g.xs[3]];
        vc1.v[0] = cr[(int64_t)j * g.cs1];
        vc2.v[0] = cr[(int64_t)jb * g.cs1];
        vs1.v[0] = sr[(int64_t)j * g.ss1];
        vs2.v[0] = sr[(int64_t)jb * g.ss1];
      }
#pragma unroll
      for (int e = 0; e < V; e++) {
        C a = moe_load_as<C, DT>(va.v[e]), b = moe_load_as<C, DT>(vb.v[e]);
        C c1v = moe_load_as<C, DT>(vc1.v[e]), c2v = moe_load_as<C, DT>(vc2.v[e]);
        C s1v = moe_load_as<C, DT>(vs1.v[e]), s2v = moe_load_as<C, DT>(vs2.v[e]);
        C o1, o2;
        if constexpr (std::is_same_v<C, double>) {
          o1 = g.inverse ? __dadd_rn(__dmul_rn(a, c1v), __dmul_rn(b, s2v)) : __dsub_rn(__dmul_rn(a, c1v), __dmul_rn(b, s1v));
          o2 = g.inverse ? __dsub_rn(__dmul_rn(b, c2v), __dmul_rn(a, s1v)) : __dadd_rn(__dmul_rn(b, c2v), __dmul_rn(a, s2v));
        } else {
          o1 = g.inverse ? __fadd_rn(__fmul_rn(a, c1v), __fmul_rn(b, s2v)) : __fsub_rn(__fmul_rn(a, c1v), __fmul_rn(b, s1v));
          o2 = g.inverse ? __fsub_rn(__fmul_rn(b, c2v), __fmul_rn(a, s1v)) : __fadd_rn(__fmul_rn(b, c2v), __fmul_rn(a, s2v));
        }
        vo1.v[e] = moe_store_from<DT, C>(o1);
        vo2.v[e] = moe_store_from<DT, C>(o2);
      }
      if constexpr (V > 1) {
        *(Vec *)(orow + j) = vo1;
        *(Vec *)(orow + j + h) = vo2;
      } else {
        orow[(int64_t)j * g.os[3]] = vo1.v[0];
        orow[(int64_t)(j + h) * g.os[3]] = vo2.v[0];
      }
    }
  }
}

/* Whether V-element accesses fit view v (rows given by its first nrow dims,
 * then a last dim that must be dense): the pointer and the stride of every
 * dim of more than one element are multiples of V elements. */
static bool ix_rope_vec_view(const moe_kview *v, int nrow, int64_t V) {
  size_t es = moe_dtype_size(v->dtype);
  if (!moe_aligned(v->data, (size_t)V * es) || v->stride[nrow] != 1) return false;
  for (int d = 0; d < nrow; d++)
    if (v->shape[d] > 1 && v->stride[d] % V != 0) return false;
  return true;
}

/* The widest V (pairs per thread) that h, the element size (16 bytes at most
 * per access) and all four views allow. */
static int ix_rope_vec(const moe_kview *out, const moe_kview *x, const moe_kview *cos,
                       const moe_kview *sin, int64_t h) {
  size_t es = moe_dtype_size(x->dtype);
  for (int V = 8; V > 1; V /= 2)
    if ((size_t)V * es <= 16 && h % V == 0 && ix_rope_vec_view(x, 3, V) &&
        ix_rope_vec_view(out, 3, V) && ix_rope_vec_view(cos, 1, V) &&
        ix_rope_vec_view(sin, 1, V))
      return V;
  return 1;
}

template <moe_dtype DT, int V, typename I>
static void ix_rope_launch(int64_t rows, const moe_kview *out, const moe_kview *x,
                           const moe_kview *cos, const moe_kview *sin, const IxRope &g,
                           cudaStream_t s) {
  int64_t groups = g.h / V;
  int64_t tx = 1;
  while (tx < groups && tx < MOE_THREADS) tx *= 2;
  int64_t ty = MOE_THREADS / tx;
  int64_t gx = (groups + tx - 1) / tx, gy = (rows + ty - 1) / ty;
  if (gx > 65535) gx = 65535;
  if (gy > 65535) gy = 65535;
  dim3 grid((unsigned)gx, (unsigned)gy), block((unsigned)tx, (unsigned)ty);
  ix_rope_kernel<DT, V, I><<<grid, block, 0, s>>>((I)rows, (I)groups, out->data, x->data,
                                                  cos->data, sin->data, g);
}

/* 32-bit indices when every row and every j + h fit (then the steps of the
 * grid-stride loops, below 2^24, cannot wrap either); the vector width
 * from ix_rope_vec, instantiated only where V elements fit 16 bytes. */
template <moe_dtype DT>
static void ix_rope_dispatch(int64_t rows, const moe_kview *out, const moe_kview *x,
                             const moe_kview *cos, const moe_kview *sin, const IxRope &g,
                             cudaStream_t s) {
  constexpr size_t es = sizeof(moe_st_t<DT>);
  if (rows > INT32_MAX || g.h > INT32_MAX / 2) {
    ix_rope_launch<DT, 1, int64_t>(rows, out, x, cos, sin, g, s);
    return;
  }
  int V = ix_rope_vec(out, x, cos, sin, g.h);
  if constexpr (8 * es <= 16)
    if (V == 8) return ix_rope_launch<DT, 8, uint32_t>(rows, out, x, cos, sin, g, s);
  if constexpr (4 * es <= 16)
    if (V == 4) return ix_rope_launch<DT, 4, uint32_t>(rows, out, x, cos, sin, g, s);
  if constexpr (2 * es <= 16)
    if (V == 2) return ix_rope_launch<DT, 2, uint32_t>(rows, out, x, cos, sin, g, s);
  ix_rope_launch<DT, 1, uint32_t>(rows, out, x, cos, sin, g, s);
}

extern "C" moe_status moe_cuda_rope(moe_ctx *ctx, int device, const moe_kview *out,
                                    const moe_kview *x, const moe_kview *cos, const moe_kview *sin,
                                    int tdim, bool inverse) {
  IxRope g;
  memset(&g, 0, sizeof g);
  for (int d = 0; d < 4; d++) {
    g.shape[d] = x->shape[d];
    g.xs[d] = x->stride[d];
    g.os[d] = out->stride[d];
  }
  g.h = x->shape[3] / 2;
  g.shape[3] = g.h;
  g.cs0 = cos->stride[0], g.cs1 = cos->stride[1];
  g.ss0 = sin->stride[0], g.ss1 = sin->stride[1];
  g.tdim = tdim;
  g.full = cos->shape[1] == x->shape[3];
  g.inverse = inverse;
  int64_t rows = g.shape[0] * g.shape[1] * g.shape[2];
  if (rows == 0 || g.h == 0) return MOE_OK;
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  cudaStream_t s = (cudaStream_t)stream;
  moe_status st = moe_dtype_dispatch(x->dtype, [&](auto tag) -> moe_status {
    constexpr moe_dtype DT = decltype(tag)::value;
    if constexpr (moe_is_float_v<DT>) {
      ix_rope_dispatch<DT>(rows, out, x, cos, sin, g, s);
      return MOE_OK;
    } else {
      return moe_error(ctx, MOE_ERR_DTYPE, "cuda rope: %s is not a float dtype", moe_dtype_name(DT));
    }
  });
  MOE_CHECK(st);
  MOE_CUDA_CHECK_LAUNCH(ctx, "rope kernel");
  return MOE_OK;
}

/* ----------------------------------------------------------- multinomial */

#define IX_MN_CHUNKS 256 /* = MOE_THREADS: one chunk per thread */

/* Weight j of the row, 0 once drawn (taken: the row's outputs so far). */
template <moe_dtype DT>
__device__ __forceinline__ double ix_mn_w(const moe_st_t<DT> *p, int64_t cst, int64_t j,
                                          const int64_t *taken, int64_t ntaken) {
  for (int64_t q = 0; q < ntaken; q++)
    if (taken[q] == j) return 0.0;
  return moe_load_as<double, DT>(p[j * cst]);
}

template <moe_dtype DT>
__device__ double ix_mn_chunk(const moe_st_t<DT> *p, int64_t cst, int64_t C, int64_t cs, int t,
                              const int64_t *taken, int64_t ntaken) {
  double acc = 0;
  int64_t lo = (int64_t)t * cs, hi = lo + cs < C ? lo + cs : C;
  for (int64_t j = lo; j < hi; j++) acc = __dadd_rn(acc, ix_mn_w<DT>(p, cst, j, taken, ntaken));
  return acc;
}

template <moe_dtype DT>
__device__ int64_t ix_mn_pick(const moe_st_t<DT> *p, int64_t cst, int64_t C, int64_t cs,
                              const double *prefix, double target, const int64_t *taken,
                              int64_t ntaken) {
  for (int t = 0; t < IX_MN_CHUNKS; t++) {
    if (!(prefix[t + 1] > target)) continue;
    double acc = prefix[t];
    int64_t lo = (int64_t)t * cs, hi = lo + cs < C ? lo + cs : C;
    for (int64_t j = lo; j < hi; j++) {
      acc = __dadd_rn(acc, ix_mn_w<DT>(p, cst, j, taken, ntaken));
      if (acc > target) return j;
    }
    break;
  }
  for (int64_t j = C - 1; j >= 0; j--)
    if (ix_mn_w<DT>(p, cst, j, taken, ntaken) > 0) return j;
  return 0;
}

template <moe_dtype DT>
__global__ void __launch_bounds__(IX_MN_CHUNKS)
    ix_multinomial_kernel(int64_t rows, const void *probs, int64_t rs, int64_t cst, int64_t C,
                          int64_t ns, bool replacement, uint64_t seed, uint64_t call,
                          int64_t *out) {
  using T = moe_st_t<DT>;
  __shared__ double part[IX_MN_CHUNKS], prefix[IX_MN_CHUNKS + 1];
  int64_t cs = (C + IX_MN_CHUNKS - 1) / IX_MN_CHUNKS;
  int t = threadIdx.x;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T *p = (const T *)probs + row * rs;
    int64_t *o = out + row * ns;
    part[t] = ix_mn_chunk<DT>(p, cst, C, cs, t, o, 0);
    __syncthreads();
    if (t == 0) {
      prefix[0] = 0;
      for (int q = 0; q < IX_MN_CHUNKS; q++) prefix[q + 1] = __dadd_rn(prefix[q], part[q]);
    }
    __syncthreads();
    if (replacement) {
      for (int64_t s = t; s < ns; s += IX_MN_CHUNKS) {
        double u = moe_philox_uniform53(seed, call, (uint64_t)(row * ns + s));
        o[s] = ix_mn_pick<DT>(p, cst, C, cs, prefix, __dmul_rn(u, prefix[IX_MN_CHUNKS]), o, 0);
      }
    } else if (t == 0) { /* sequential: each draw changes the urn */
      for (int64_t s = 0; s < ns; s++) {
        double u = moe_philox_uniform53(seed, call, (uint64_t)(row * ns + s));
        int64_t j = ix_mn_pick<DT>(p, cst, C, cs, prefix, __dmul_rn(u, prefix[IX_MN_CHUNKS]), o, s);
        o[s] = j;
        int q = (int)(j / cs);
        part[q] = ix_mn_chunk<DT>(p, cst, C, cs, q, o, s + 1);
        for (int r = 0; r < IX_MN_CHUNKS; r++) prefix[r + 1] = __dadd_rn(prefix[r], part[r]);
      }
    }
    __syncthreads();
  }
}

extern "C" moe_status moe_cuda_multinomial(moe_ctx *ctx, int device, int64_t *out,
                                           const moe_kview *probs, int64_t num_samples,
                                           bool replacement, uint64_t seed, uint64_t call) {
  int64_t rows = probs->shape[0], C = probs->shape[1];
  if (rows == 0 || num_samples == 0) return MOE_OK;
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  unsigned grid = (unsigned)(rows < 65535 * 16 ? rows : 65535 * 16);
  moe_status st = moe_dtype_dispatch(probs->dtype, [&](auto tag) -> moe_status {
    constexpr moe_dtype DT = decltype(tag)::value;
    if constexpr (moe_is_float_v<DT>) {
      ix_multinomial_kernel<DT><<<grid, IX_MN_CHUNKS, 0, (cudaStream_t)stream>>>(
          rows, probs->data, probs->stride[0], probs->stride[1], C, num_samples, replacement,
          seed, call, out);
      return MOE_OK;
    } else {
      return moe_error(ctx, MOE_ERR_DTYPE, "cuda multinomial: %s is not a float dtype",
                       moe_dtype_name(DT));
    }
  });
  MOE_CHECK(st);
  MOE_CUDA_CHECK_LAUNCH(ctx, "multinomial kernel");
  return MOE_OK;
}
