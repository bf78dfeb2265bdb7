/*
 * routing.cu - CUDA kernels of the routing family (entry points in
 * core/routing_cuda.h, called by core/routing.c): the plan's stable sort by
 * expert (CUB radix sort), offsets by binary search over the sorted keys,
 * the buffer layout, the block-sparse topology, and the row gather / combine
 * / gate-gradient kernels of permute and combine.
 *
 * Determinism: no atomics anywhere. Counts and offsets come from binary
 * searches over sorted keys; combine gives each token one thread block that
 * sums its k rows in slot order with round-to-nearest intrinsics (the CPU's
 * bits); the gate gradient reduces each dot product in one warp in a fixed
 * order. Nothing here synchronises with the host; scratch comes from the
 * context's caching allocator and goes back once the launches are queued
 * (one stream: safe). Index math is int64.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cub/device/device_radix_sort.cuh>

#include "common.cuh"
#include "routing_cuda.h"

/* ------------------------------------------------------------- helpers */

#define RT_THREADS 256

static inline size_t rt_align(size_t n) { return (n + 255) & ~(size_t)255; }

static inline unsigned rt_grid(int64_t n, int threads) {
  int64_t g = (n + threads - 1) / threads;
  if (g < 1) g = 1;
  return (unsigned)(g > (1 << 30) ? (1 << 30) : g);
}

static inline int rt_key_bits(uint64_t maxkey) {
  int b = 1;
  while (b < 32 && (maxkey >> b) != 0) b++;
  return b;
}

static moe_status rt_stream(moe_ctx *ctx, int device, cudaStream_t *s) {
  void *p = nullptr;
  MOE_CHECK(moe_cuda_stream(ctx, device, &p));
  *s = (cudaStream_t)p;
  return MOE_OK;
}

#define RT_LOOP(i, n) \
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (int64_t)gridDim.x * blockDim.x)

/* Score key as core/routing.c: larger score -> larger key; -0 == +0; NaN 0. */
__device__ __forceinline__ uint64_t rt_score_key(double v) {
  if (v != v) return 0;
  if (v == 0) v = 0.0;
  uint64_t u = (uint64_t)__double_as_longlong(v);
  return (u >> 63) ? ~u : (u | 0x8000000000000000ull);
}

/* First position in sorted[0, n) holding a key >= v. */
__device__ __forceinline__ int64_t rt_lower_bound(const int32_t *sorted, int64_t n, int64_t v) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    int64_t mid = (lo + hi) >> 1;
    if ((int64_t)sorted[mid] < v) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

/* ------------------------------------------------------------- stage 1 */

__global__ void rt_keys_kernel(const void *ids, bool i32, int64_t s0, int64_t s1, int64_t k,
                               int64_t N, int64_t E, uint32_t *keys, int64_t *iota) {
  RT_LOOP(a, N) {
    int64_t t = a / k, j = a % k, off = t * s0 + j * s1;
    int64_t v = i32 ? (int64_t)((const int32_t *)ids)[off] : ((const int64_t *)ids)[off];
    keys[a] = (uint32_t)(v >= 0 && v < E ? v : E);
    iota[a] = a;
  }
}

__global__ void rt_score_keys_kernel(const void *scores, moe_dtype dt, int64_t s0, int64_t s1,
                                     int64_t k, int64_t N, uint64_t *sk) {
  RT_LOOP(a, N) {
    int64_t t = a / k, j = a % k;
    sk[a] = rt_score_key(moe_dyn_load<double>(scores, dt, t * s0 + j * s1));
  }
}

__global__ void rt_gather_keys_kernel(const uint32_t *keys, const int64_t *idx, int64_t N,
                                      uint32_t *out) {
  RT_LOOP(i, N) out[i] = keys[idx[i]];
}

__global__ void rt_offsets_kernel(const int32_t *sorted, int64_t N, int64_t E, int64_t *offsets,
                                  int64_t *counts) {
  RT_LOOP(e, E + 1) {
    int64_t lo = rt_lower_bound(sorted, N, e);
    offsets[e] = lo;
    if (e < E) counts[e] = rt_lower_bound(sorted, N, e + 1) - lo;
  }
}

__global__ void rt_inverse_kernel(const int64_t *perm, int64_t N, int64_t *inv) {
  RT_LOOP(p, N) inv[perm[p]] = p;
}

extern "C" moe_status moe_cuda_routing_sort(moe_ctx *ctx, int device, const moe_kview *ids,
                                            const moe_kview *scores, int64_t E,
                                            int32_t *sorted_keys, int64_t *perm, int64_t *inv,
                                            int64_t *offsets, int64_t *counts) {
  cudaStream_t s;
  MOE_CHECK(rt_stream(ctx, device, &s));
  int64_t T = ids->shape[0], k = ids->shape[1], N = T * k;
  int bits = rt_key_bits((uint64_t)E);
  if (N == 0) {
    MOE_CUDA_CHECK(ctx, cudaMemsetAsync(offsets, 0, sizeof(int64_t) * (size_t)(E + 1), s));
    MOE_CUDA_CHECK(ctx, cudaMemsetAsync(counts, 0, sizeof(int64_t) * (size_t)E, s));
    return MOE_OK;
  }
  int n = (int)N; /* < 2^31: checked by core/routing.c */
  size_t kb = rt_align(sizeof(uint32_t) * (size_t)N), vb = rt_align(sizeof(int64_t) * (size_t)N);
  size_t skb = scores ? rt_align(sizeof(uint64_t) * (size_t)N) : 0;
  /* CUB's temporary storage: the larger of the sorts' needs */
  size_t cub_bytes = 0, b2 = 0;
  uint32_t *kin = nullptr, *kout = (uint32_t *)sorted_keys;
  int64_t *vin = nullptr, *vmid = nullptr;
  uint64_t *sk = nullptr, *skout = nullptr;
  MOE_CUDA_CHECK(ctx, cub::DeviceRadixSort::SortPairs(nullptr, cub_bytes, kin, kout, vin, perm, n, 0, bits, s));
  if (scores)
    MOE_CUDA_CHECK(ctx, cub::DeviceRadixSort::SortPairsDescending(nullptr, b2, sk, skout, vin, vmid, n, 0, 64, s));
  if (b2 > cub_bytes) cub_bytes = b2;
  cub_bytes = rt_align(cub_bytes);
  MoeScratch tmp(ctx, device);
  const size_t tmp_bytes = cub_bytes + kb * 2 + vb * 2 + skb * 2;
  MOE_CHECK(tmp.alloc(tmp_bytes > 0 ? tmp_bytes : 1));
  char *base = (char *)tmp.ptr;
  void *cub_tmp = base;
  kin = (uint32_t *)(base + cub_bytes);
  uint32_t *kmid = (uint32_t *)(base + cub_bytes + kb);
  vin = (int64_t *)(base + cub_bytes + 2 * kb);
  vmid = (int64_t *)(base + cub_bytes + 2 * kb + vb);
  if (scores) {
    sk = (uint64_t *)(base + cub_bytes + 2 * kb + 2 * vb);
    skout = (uint64_t *)(base + cub_bytes + 2 * kb + 2 * vb + skb);
  }
  unsigned g = rt_grid(N, RT_THREADS);
  rt_keys_kernel<<<g, RT_THREADS, 0, s>>>(ids->data, ids->dtype == MOE_I32, ids->stride[0],
                                         ids->stride[1], k, N, E, kin, vin);
  MOE_CUDA_CHECK_LAUNCH(ctx, "routing_plan keys kernel");
  if (!scores) {
    MOE_CUDA_CHECK(ctx, cub::DeviceRadixSort::SortPairs(cub_tmp, cub_bytes, kin, kout, vin, perm, n, 0, bits, s));
  } else {
    /* score descending (stable: ties keep a ascending), then expert (stable) */
    rt_score_keys_kernel<<<g, RT_THREADS, 0, s>>>(scores->data, scores->dtype, scores->stride[0],
                                                 scores->stride[1], k, N, sk);
    MOE_CUDA_CHECK_LAUNCH(ctx, "routing_plan score keys kernel");
    size_t b = cub_bytes;
    MOE_CUDA_CHECK(ctx, cub::DeviceRadixSort::SortPairsDescending(cub_tmp, b, sk, skout, vin, vmid, n, 0, 64, s));
    rt_gather_keys_kernel<<<g, RT_THREADS, 0, s>>>(kin, vmid, N, kmid);
    MOE_CUDA_CHECK_LAUNCH(ctx, "routing_plan gather keys kernel");
    b = cub_bytes;
    MOE_CUDA_CHECK(ctx, cub::DeviceRadixSort::SortPairs(cub_tmp, b, kmid, kout, vmid, perm, n, 0, bits, s));
  }
  rt_offsets_kernel<<<rt_grid(E + 1, RT_THREADS), RT_THREADS, 0, s>>>(sorted_keys, N, E, offsets, counts);
  MOE_CUDA_CHECK_LAUNCH(ctx, "routing_plan offsets kernel");
  rt_inverse_kernel<<<g, RT_THREADS, 0, s>>>(perm, N, inv);
  MOE_CUDA_CHECK_LAUNCH(ctx, "routing_plan inverse kernel");
  return MOE_OK;
}

/* ------------------------------------------------------------- stage 2 */

/* One thread: the exclusive scan of the segments (E is small; O(E)). */
__global__ void rt_segments_kernel(const int64_t *counts, int64_t E, int64_t capacity, int64_t bs,
                                   int64_t *gpo) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  int64_t acc = 0;
  gpo[0] = 0;
  for (int64_t e = 0; e < E; e++) {
    int64_t c = counts[e];
    acc += capacity > 0 ? capacity : (bs > 0 ? (c + bs - 1) / bs * bs : c);
    gpo[e + 1] = acc;
  }
}

__global__ void rt_row_offsets_kernel(const int64_t *gpo, const int64_t *counts, int64_t E,
                                      int64_t e0, int64_t e1, int64_t capacity, int64_t *row_offsets,
                                      int64_t *kept) {
  RT_LOOP(e, E + 1) {
    int64_t v = gpo[e], lo = gpo[e0], hi = gpo[e1];
    row_offsets[e] = (v < lo ? lo : v > hi ? hi : v) - lo;
    if (e < E) {
      int64_t c = counts[e];
      kept[e] = e < e0 || e >= e1 ? 0 : capacity > 0 && c > capacity ? capacity : c;
    }
  }
}

__global__ void rt_fill_kernel(int64_t *p, int64_t n, int64_t v) { RT_LOOP(i, n) p[i] = v; }

__global__ void rt_dest_kernel(const int32_t *keys, const int64_t *perm, const int64_t *offsets,
                               const int64_t *gpo, int64_t N, int64_t E, int64_t e0, int64_t e1,
                               int64_t capacity, int64_t R, int64_t *dest, int64_t *src) {
  RT_LOOP(p, N) {
    int64_t a = perm[p], e = keys[p], row = -1;
    if (e >= e0 && e < e1 && e < E) {
      int64_t rank = p - offsets[e];
      if (!(capacity > 0 && rank >= capacity)) {
        row = gpo[e] - gpo[e0] + rank;
        if (row >= R) row = -1;
      }
    }
    dest[a] = row;
    if (row >= 0) src[row] = a;
  }
}

extern "C" moe_status moe_cuda_routing_layout(moe_ctx *ctx, int device, int64_t N, int64_t E,
                                              int64_t e0, int64_t e1, int64_t capacity,
                                              int64_t block_size, int64_t R,
                                              const int32_t *sorted_keys, const int64_t *perm,
                                              const int64_t *offsets, const int64_t *counts,
                                              int64_t *kept, int64_t *row_offsets, int64_t *dest,
                                              int64_t *src) {
  cudaStream_t s;
  MOE_CHECK(rt_stream(ctx, device, &s));
  MoeScratch tmp(ctx, device);
  MOE_CHECK(tmp.alloc(sizeof(int64_t) * (size_t)(E + 1))); /* never 0 bytes */
  int64_t *gpo = (int64_t *)tmp.ptr;
  rt_segments_kernel<<<1, 1, 0, s>>>(counts, E, capacity, block_size, gpo);
  MOE_CUDA_CHECK_LAUNCH(ctx, "routing_plan segments kernel");
  rt_row_offsets_kernel<<<rt_grid(E + 1, RT_THREADS), RT_THREADS, 0, s>>>(gpo, counts, E, e0, e1,
                                                                          capacity, row_offsets, kept);
  MOE_CUDA_CHECK_LAUNCH(ctx, "routing_plan row offsets kernel");
  if (R > 0) {
    rt_fill_kernel<<<rt_grid(R, RT_THREADS), RT_THREADS, 0, s>>>(src, R, -1);
    MOE_CUDA_CHECK_LAUNCH(ctx, "routing_plan fill kernel");
  }
  if (N > 0) {
    rt_dest_kernel<<<rt_grid(N, RT_THREADS), RT_THREADS, 0, s>>>(sorted_keys, perm, offsets, gpo, N,
                                                                 E, e0, e1, capacity, R, dest, src);
    MOE_CUDA_CHECK_LAUNCH(ctx, "routing_plan dest kernel");
  }
  return MOE_OK;
}

/* ------------------------------------------------------------- stage 3 */

__global__ void rt_topo_offsets_kernel(const int64_t *row_offsets, int64_t e0, int64_t EL,
                                       int64_t bs, int64_t F, int64_t Rb, int64_t *off,
                                       int64_t *off_t) {
  RT_LOOP(i, (Rb + 1 > EL * F + 1 ? Rb + 1 : EL * F + 1)) {
    if (i <= Rb) off[i] = i * F;
    if (i <= EL * F) {
      if (i == EL * F) {
        off_t[i] = Rb * F;
      } else {
        int64_t el = i / F, c = i % F;
        int64_t rs = row_offsets[e0 + el] / bs;
        int64_t nb = (row_offsets[e0 + el + 1] - row_offsets[e0 + el]) / bs;
        off_t[i] = F * rs + c * nb;
      }
    }
  }
}

__global__ void rt_topo_blocks_kernel(const int64_t *row_offsets, int64_t e0, int64_t EL,
                                      int64_t bs, int64_t F, int64_t nnz, int64_t *ri, int64_t *ci,
                                      int64_t *ci_t, int64_t *bo_t) {
  RT_LOOP(i, nnz) {
    int64_t rb = i / F, c = i % F;
    /* the last local expert whose segment starts at or before rb */
    int64_t lo = 0, hi = EL - 1;
    while (lo < hi) {
      int64_t mid = (lo + hi + 1) >> 1;
      if (row_offsets[e0 + mid] / bs <= rb) lo = mid;
      else hi = mid - 1;
    }
    int64_t rs = row_offsets[e0 + lo] / bs, nb = (row_offsets[e0 + lo + 1] - row_offsets[e0 + lo]) / bs;
    int64_t it = F * rs + c * nb + (rb - rs);
    ri[i] = rb;
    ci[i] = lo * F + c;
    ci_t[it] = rb;
    bo_t[it] = i;
  }
}

extern "C" moe_status moe_cuda_routing_topology(moe_ctx *ctx, int device, const int64_t *row_offsets,
                                                int64_t e0, int64_t e1, int64_t block_size,
                                                int64_t F, int64_t Rb, int64_t *row_indices,
                                                int64_t *column_indices, int64_t *offsets,
                                                int64_t *column_indices_t, int64_t *offsets_t,
                                                int64_t *block_offsets_t) {
  cudaStream_t s;
  MOE_CHECK(rt_stream(ctx, device, &s));
  int64_t EL = e1 - e0, n = Rb + 1 > EL * F + 1 ? Rb + 1 : EL * F + 1;
  rt_topo_offsets_kernel<<<rt_grid(n, RT_THREADS), RT_THREADS, 0, s>>>(row_offsets, e0, EL, block_size,
                                                                       F, Rb, offsets, offsets_t);
  MOE_CUDA_CHECK_LAUNCH(ctx, "routing_plan topology offsets kernel");
  if (Rb * F > 0) {
    rt_topo_blocks_kernel<<<rt_grid(Rb * F, RT_THREADS), RT_THREADS, 0, s>>>(
        row_offsets, e0, EL, block_size, F, Rb * F, row_indices, column_indices, column_indices_t,
        block_offsets_t);
    MOE_CUDA_CHECK_LAUNCH(ctx, "routing_plan topology blocks kernel");
  }
  return MOE_OK;
}

__global__ void rt_rank_counts_kernel(const int64_t *offsets, int64_t per, int64_t n_ranks,
                                      int64_t *out) {
  RT_LOOP(r, n_ranks) out[r] = offsets[(r + 1) * per] - offsets[r * per];
}

extern "C" moe_status moe_cuda_routing_rank_counts(moe_ctx *ctx, int device, const int64_t *offsets,
                                                   int64_t E, int64_t n_ranks, int64_t *out) {
  cudaStream_t s;
  MOE_CHECK(rt_stream(ctx, device, &s));
  rt_rank_counts_kernel<<<rt_grid(n_ranks, RT_THREADS), RT_THREADS, 0, s>>>(offsets, E / n_ranks,
                                                                            n_ranks, out);
  MOE_CUDA_CHECK_LAUNCH(ctx, "routing_rank_counts kernel");
  return MOE_OK;
}

/* ---------------------------------------------------- permute / combine */

template <typename C> __device__ __forceinline__ C rt_mul(C a, C b) {
  if constexpr (std::is_same_v<C, double>) return __dmul_rn(a, b);
  else return __fmul_rn(a, b);
}
template <typename C> __device__ __forceinline__ C rt_add(C a, C b) {
  if constexpr (std::is_same_v<C, double>) return __dadd_rn(a, b);
  else return __fadd_rn(a, b);
}

/* One block per buffer row (grid-stride over rows), threads over columns. */
template <moe_dtype DT>
__global__ void __launch_bounds__(RT_THREADS)
rt_gather_kernel(moe_st_t<DT> *out, const moe_st_t<DT> *x, int64_t xs0, int64_t xs1,
                 const int64_t *src, const void *gates, moe_dtype gdt, int64_t gs0, int64_t gs1,
                 int64_t k, int64_t R, int64_t d) {
  using C = moe_compute_t<DT>;
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    int64_t a = src[r];
    moe_st_t<DT> *o = out + r * d;
    if (a < 0) {
      for (int64_t c = threadIdx.x; c < d; c += blockDim.x) o[c] = moe_store_from<DT, C>((C)0);
      continue;
    }
    const moe_st_t<DT> *xr = x + (a / k) * xs0;
    if (!gates) {
      for (int64_t c = threadIdx.x; c < d; c += blockDim.x) o[c] = xr[c * xs1];
    } else {
      C g = moe_dyn_load<C>(gates, gdt, (a / k) * gs0 + (a % k) * gs1);
      for (int64_t c = threadIdx.x; c < d; c += blockDim.x)
        o[c] = moe_store_from<DT, C>(rt_mul<C>(g, moe_load_as<C, DT>(xr[c * xs1])));
    }
  }
}

/* The ungated gather of rows whose bytes split into 16-byte units (the
 * common case: contiguous rows, d * element size a multiple of 16). */
__global__ void __launch_bounds__(RT_THREADS)
rt_gather_vec_kernel(uint4 *out, const uint4 *x, int64_t xs0_units, const int64_t *src,
                     int64_t k, int64_t R, int64_t units) {
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    int64_t a = src[r];
    uint4 *o = out + r * units;
    if (a < 0) {
      for (int64_t c = threadIdx.x; c < units; c += blockDim.x) o[c] = make_uint4(0, 0, 0, 0);
      continue;
    }
    const uint4 *xr = x + (a / k) * xs0_units;
    for (int64_t c = threadIdx.x; c < units; c += blockDim.x) o[c] = xr[c];
  }
}

/* The ungated gather as a scatter: one block per token t reads its row once
 * (16-byte units) and writes it to rows dest[t k + j] >= 0, so x is read
 * once rather than k times; rows that no slot fills (src < 0, the padding)
 * are zeroed by rt_zero_unsourced_kernel. */
__global__ void __launch_bounds__(RT_THREADS)
rt_scatter_rows_vec_kernel(uint4 *out, const uint4 *x, int64_t xs0_units, const int64_t *dest,
                           int64_t k, int64_t T, int64_t units) {
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    const uint4 *xr = x + t * xs0_units;
    for (int64_t c = threadIdx.x; c < units; c += blockDim.x) {
      uint4 v = xr[c];
      for (int64_t j = 0; j < k; j++) {
        int64_t r = dest[t * k + j];
        if (r >= 0) out[r * units + c] = v;
      }
    }
  }
}

/* A warp per row: rows whose src < 0 become zeros. */
__global__ void __launch_bounds__(RT_THREADS)
rt_zero_unsourced_kernel(uint4 *out, const int64_t *src, int64_t R, int64_t units) {
  const int64_t warps = (int64_t)gridDim.x * (RT_THREADS / 32);
  const int lane = threadIdx.x & 31;
  for (int64_t r = (int64_t)blockIdx.x * (RT_THREADS / 32) + threadIdx.x / 32; r < R; r += warps) {
    if (src[r] >= 0) continue;
    uint4 *o = out + r * units;
    for (int64_t c = lane; c < units; c += 32) o[c] = make_uint4(0, 0, 0, 0);
  }
}

/* One block per token, threads over columns, slots summed in order. */
template <moe_dtype DT>
__global__ void __launch_bounds__(RT_THREADS)
rt_combine_kernel(moe_st_t<DT> *out, const moe_st_t<DT> *y, int64_t ys0, int64_t ys1,
                  const int64_t *dest, const void *gates, moe_dtype gdt, int64_t gs0, int64_t gs1,
                  int64_t k, int64_t T, int64_t d) {
  using C = moe_compute_t<DT>;
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
      C acc = (C)0;
      for (int64_t j = 0; j < k; j++) {
        int64_t row = dest[t * k + j];
        if (row < 0) continue;
        C g = gates ? moe_dyn_load<C>(gates, gdt, t * gs0 + j * gs1) : (C)1;
        acc = rt_add<C>(acc, rt_mul<C>(g, moe_load_as<C, DT>(y[row * ys0 + c * ys1])));
      }
      out[t * d + c] = moe_store_from<DT, C>(acc);
    }
  }
}

/* The combine over 16-byte units of V = 16 / sizeof(element) columns: the
 * same operations per element in the same order (the same bits). */
template <moe_dtype DT>
__global__ void __launch_bounds__(RT_THREADS)
rt_combine_vec_kernel(uint4 *out, const uint4 *y, int64_t ys0_units, const int64_t *dest,
                      const void *gates, moe_dtype gdt, int64_t gs0, int64_t gs1, int64_t k,
                      int64_t T, int64_t units) {
  using C = moe_compute_t<DT>;
  using S = moe_st_t<DT>;
  constexpr int V = 16 / sizeof(S);
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    for (int64_t u = threadIdx.x; u < units; u += blockDim.x) {
      C acc[V];
#pragma unroll
      for (int i = 0; i < V; i++) acc[i] = (C)0;
      for (int64_t j = 0; j < k; j++) {
        int64_t row = dest[t * k + j];
        if (row < 0) continue;
        C g = gates ? moe_dyn_load<C>(gates, gdt, t * gs0 + j * gs1) : (C)1;
        uint4 v = y[row * ys0_units + u];
        const S *e = reinterpret_cast<const S *>(&v);
#pragma unroll
        for (int i = 0; i < V; i++) acc[i] = rt_add<C>(acc[i], rt_mul<C>(g, moe_load_as<C, DT>(e[i])));
      }
      uint4 w;
      S *o = reinterpret_cast<S *>(&w);
#pragma unroll
      for (int i = 0; i < V; i++) o[i] = moe_store_from<DT, C>(acc[i]);
      out[t * units + u] = w;
    }
  }
}

/* One warp per assignment: lane l sums columns l, l + 32, ...; then a
 * butterfly over the lanes (a fixed order). */
template <typename C>
__global__ void __launch_bounds__(RT_THREADS)
rt_gate_grad_kernel(void *dg, moe_dtype gdt, const void *dout, moe_dtype ddt, int64_t ds0,
                    int64_t ds1, const void *y, moe_dtype ydt, int64_t ys0, int64_t ys1,
                    const int64_t *dest, int64_t k, int64_t N, int64_t d) {
  int lane = threadIdx.x & 31;
  int64_t warps = (int64_t)gridDim.x * (blockDim.x / 32);
  for (int64_t a = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; a < N; a += warps) {
    int64_t row = dest[a], t = a / k;
    C acc = (C)0;
    if (row >= 0)
      for (int64_t c = lane; c < d; c += 32)
        acc = rt_add<C>(acc, rt_mul<C>(moe_dyn_load<C>(dout, ddt, t * ds0 + c * ds1),
                                       moe_dyn_load<C>(y, ydt, row * ys0 + c * ys1)));
    for (int m = 16; m > 0; m >>= 1) acc = rt_add<C>(acc, __shfl_xor_sync(0xffffffffu, acc, m));
    if (lane == 0) moe_dyn_store<C>(dg, gdt, a, acc);
  }
}

template <typename F> static moe_status rt_float_dispatch(moe_ctx *ctx, const char *fn, moe_dtype dt, F &&f) {
  switch (dt) {
    case MOE_F32: return f(MoeDtTag<MOE_F32>{});
    case MOE_F64: return f(MoeDtTag<MOE_F64>{});
    case MOE_BF16: return f(MoeDtTag<MOE_BF16>{});
    case MOE_F16: return f(MoeDtTag<MOE_F16>{});
    default:
      return moe_error(ctx, MOE_ERR_DTYPE, "%s: dtype %s is not a float dtype", fn, moe_dtype_name(dt));
  }
}

extern "C" moe_status moe_cuda_routing_gather(moe_ctx *ctx, int device, const moe_kview *out,
                                              const moe_kview *x, const int64_t *src,
                                              const int64_t *dest, const moe_kview *gates,
                                              int64_t k, bool padded) {
  cudaStream_t s;
  MOE_CHECK(rt_stream(ctx, device, &s));
  int64_t R = out->shape[0], d = out->shape[1];
  if (R * d == 0) return MOE_OK;
  unsigned grid = (unsigned)(R < (1 << 30) ? R : (1 << 30));
  size_t es = moe_dtype_size(x->dtype);
  if (!gates && x->stride[1] == 1 && ((size_t)d * es) % 16 == 0 && ((size_t)x->stride[0] * es) % 16 == 0 &&
      (uintptr_t)x->data % 16 == 0 && (uintptr_t)out->data % 16 == 0) {
    int64_t T = x->shape[0], units = (int64_t)((size_t)d * es / 16),
            xs0 = (int64_t)((size_t)x->stride[0] * es / 16);
    if (dest && k > 1 && T > 0) {
      if (padded) {
        unsigned zg = rt_grid(R, RT_THREADS / 32);
        rt_zero_unsourced_kernel<<<zg, RT_THREADS, 0, s>>>((uint4 *)out->data, src, R, units);
        MOE_CUDA_CHECK_LAUNCH(ctx, "routing gather kernel (padding)");
      }
      unsigned tg = (unsigned)(T < (1 << 30) ? T : (1 << 30));
      rt_scatter_rows_vec_kernel<<<tg, RT_THREADS, 0, s>>>((uint4 *)out->data, (const uint4 *)x->data,
                                                           xs0, dest, k, T, units);
      MOE_CUDA_CHECK_LAUNCH(ctx, "routing gather kernel (scatter)");
      return MOE_OK;
    }
    rt_gather_vec_kernel<<<grid, RT_THREADS, 0, s>>>((uint4 *)out->data, (const uint4 *)x->data,
                                                     xs0, src, k, R, units);
    MOE_CUDA_CHECK_LAUNCH(ctx, "routing gather kernel");
    return MOE_OK;
  }
  return rt_float_dispatch(ctx, "routing_permute", x->dtype, [&](auto tag) -> moe_status {
    constexpr moe_dtype DT = decltype(tag)::value;
    using S = moe_st_t<DT>;
    rt_gather_kernel<DT><<<grid, RT_THREADS, 0, s>>>(
        (S *)out->data, (const S *)x->data, x->stride[0], x->stride[1], src,
        gates ? gates->data : nullptr, gates ? gates->dtype : MOE_F32,
        gates ? gates->stride[0] : 0, gates ? gates->stride[1] : 0, k, R, d);
    MOE_CUDA_CHECK_LAUNCH(ctx, "routing gather kernel");
    return MOE_OK;
  });
}

extern "C" moe_status moe_cuda_routing_combine(moe_ctx *ctx, int device, const moe_kview *out,
                                               const moe_kview *y, const int64_t *dest,
                                               const moe_kview *gates, int64_t k) {
  cudaStream_t s;
  MOE_CHECK(rt_stream(ctx, device, &s));
  int64_t T = out->shape[0], d = out->shape[1];
  if (T * d == 0) return MOE_OK;
  unsigned grid = (unsigned)(T < (1 << 30) ? T : (1 << 30));
  size_t es = moe_dtype_size(y->dtype);
  bool vec = y->stride[1] == 1 && ((size_t)d * es) % 16 == 0 && ((size_t)y->stride[0] * es) % 16 == 0 &&
             (uintptr_t)y->data % 16 == 0 && (uintptr_t)out->data % 16 == 0;
  return rt_float_dispatch(ctx, "routing_combine", y->dtype, [&](auto tag) -> moe_status {
    constexpr moe_dtype DT = decltype(tag)::value;
    using S = moe_st_t<DT>;
    if (vec) {
      rt_combine_vec_kernel<DT><<<grid, RT_THREADS, 0, s>>>(
          (uint4 *)out->data, (const uint4 *)y->data, (int64_t)((size_t)y->stride[0] * es / 16), dest,
          gates ? gates->data : nullptr, gates ? gates->dtype : MOE_F32,
          gates ? gates->stride[0] : 0, gates ? gates->stride[1] : 0, k, T,
          (int64_t)((size_t)d * es / 16));
      MOE_CUDA_CHECK_LAUNCH(ctx, "routing combine kernel");
      return MOE_OK;
    }
    rt_combine_kernel<DT><<<grid, RT_THREADS, 0, s>>>(
        (S *)out->data, (const S *)y->data, y->stride[0], y->stride[1], dest,
        gates ? gates->data : nullptr, gates ? gates->dtype : MOE_F32,
        gates ? gates->stride[0] : 0, gates ? gates->stride[1] : 0, k, T, d);
    MOE_CUDA_CHECK_LAUNCH(ctx, "routing combine kernel");
    return MOE_OK;
  });
}

extern "C" moe_status moe_cuda_routing_gate_grad(moe_ctx *ctx, int device, const moe_kview *dgates,
                                                 const moe_kview *dout, const moe_kview *y,
                                                 const int64_t *dest, int64_t k) {
  cudaStream_t s;
  MOE_CHECK(rt_stream(ctx, device, &s));
  int64_t N = dgates->shape[0] * dgates->shape[1], d = y->shape[1];
  if (N == 0) return MOE_OK;
  unsigned grid = rt_grid(N, RT_THREADS / 32);
  if (y->dtype == MOE_F64)
    rt_gate_grad_kernel<double><<<grid, RT_THREADS, 0, s>>>(
        dgates->data, dgates->dtype, dout->data, dout->dtype, dout->stride[0], dout->stride[1],
        y->data, y->dtype, y->stride[0], y->stride[1], dest, k, N, d);
  else
    rt_gate_grad_kernel<float><<<grid, RT_THREADS, 0, s>>>(
        dgates->data, dgates->dtype, dout->data, dout->dtype, dout->stride[0], dout->stride[1],
        y->data, y->dtype, y->stride[0], y->stride[1], dest, k, N, d);
  MOE_CUDA_CHECK_LAUNCH(ctx, "routing gate gradient kernel");
  return MOE_OK;
}
