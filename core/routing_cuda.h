/*
 * routing_cuda.h - CUDA entry points of the routing family (kernels/routing.cu),
 * called by core/routing.c (core/nocuda.c stubs them without CUDA). Private to
 * core/.
 *
 * Launches go on the context's stream; none synchronises with the host.
 * Arrays are device pointers, contiguous, i64 unless said otherwise; core/
 * routing.c validated shapes and dtypes. Scratch comes from the context's
 * caching allocator and returns to it once the launches are queued.
 */
#ifndef MOE_ROUTING_CUDA_H
#define MOE_ROUTING_CUDA_H

#include "internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Stage 1: ids (T, k) view (i64 or i32); scores (T, k) float view or NULL.
 * Key of assignment a: its expert, or E when out of range. Writes
 * sorted_keys (N) i32: keys in sorted order; perm (N): sorted position ->
 * assignment (stable by key; with scores: key asc, score desc, a asc);
 * inv (N): its inverse; offsets (E + 1): first sorted position of each key
 * (offsets[E] = number of valid ids); counts (E). N < 2^31. */
moe_status moe_cuda_routing_sort(moe_ctx *ctx, int device, const moe_kview *ids,
                                 const moe_kview *scores, int64_t E, int32_t *sorted_keys,
                                 int64_t *perm, int64_t *inv, int64_t *offsets, int64_t *counts);

/* Stage 2: the buffer layout. capacity 0: uncapped; block_size 0: unpadded.
 * Segment of e: capacity when capped, else counts[e] rounded up to
 * block_size; gpo = exclusive scan of the segments, row_offsets[e] =
 * clamp(gpo[e], gpo[e0], gpo[e1]) - gpo[e0]; kept[e] = min(counts[e],
 * capacity) inside [e0, e1), else 0; dest (N), src (R, -1 for padding). */
moe_status moe_cuda_routing_layout(moe_ctx *ctx, int device, int64_t N, int64_t E, int64_t e0,
                                   int64_t e1, int64_t capacity, int64_t block_size, int64_t R,
                                   const int32_t *sorted_keys, const int64_t *perm,
                                   const int64_t *offsets, const int64_t *counts, int64_t *kept,
                                   int64_t *row_offsets, int64_t *dest, int64_t *src);

/* Stage 3: the block-sparse topology of moe_routing.h from row_offsets
 * (E + 1, every segment a multiple of block_size) for experts [e0, e1), F
 * column blocks per expert, Rb = R / block_size row blocks. */
moe_status moe_cuda_routing_topology(moe_ctx *ctx, int device, const int64_t *row_offsets,
                                     int64_t e0, int64_t e1, int64_t block_size, int64_t F,
                                     int64_t Rb, int64_t *row_indices, int64_t *column_indices,
                                     int64_t *offsets, int64_t *column_indices_t,
                                     int64_t *offsets_t, int64_t *block_offsets_t);

/* out (n_ranks) = offsets[(r + 1) * E / n_ranks] - offsets[r * E / n_ranks]. */
moe_status moe_cuda_routing_rank_counts(moe_ctx *ctx, int device, const int64_t *offsets,
                                        int64_t E, int64_t n_ranks, int64_t *out);

/* out (R, d) contiguous of x's dtype: out[r] = scale * x[src[r] / k], scale =
 * gates[src[r]] (gates a (T, k) view) or 1 without gates; zero when
 * src[r] < 0. x a (T, d) view. Every float dtype. One block per row; with
 * dest (the inverse of src: dest[a] = r, or < 0 for a dropped slot), no
 * gates, k > 1 and rows of whole 16-byte units, one block per token reads
 * its row once and writes its k copies (k times less reading), and the
 * padding rows are zeroed apart (unless padded is false: the caller knows
 * that every row has a source). */
moe_status moe_cuda_routing_gather(moe_ctx *ctx, int device, const moe_kview *out,
                                   const moe_kview *x, const int64_t *src, const int64_t *dest,
                                   const moe_kview *gates, int64_t k, bool padded);

/* out (T, d) contiguous of y's dtype: out[t] = sum_j gates[t, j] *
 * y[dest[t * k + j]] over dest >= 0, in slot order, f32 (f64 for f64)
 * with round-to-nearest products and sums (the CPU's bits). y an (R, d)
 * view, gates (T, k) view or NULL (ones). One block per token. */
moe_status moe_cuda_routing_combine(moe_ctx *ctx, int device, const moe_kview *out,
                                    const moe_kview *y, const int64_t *dest,
                                    const moe_kview *gates, int64_t k);

/* dgates (T, k) contiguous of its dtype: dot(dout[t], y[dest[t * k + j]])
 * or 0 when dropped; dout (T, d) and y (R, d) views. One warp per
 * assignment, a fixed reduction order (deterministic). */
moe_status moe_cuda_routing_gate_grad(moe_ctx *ctx, int device, const moe_kview *dgates,
                                      const moe_kview *dout, const moe_kview *y,
                                      const int64_t *dest, int64_t k);

#ifdef __cplusplus
}
#endif
#endif /* MOE_ROUTING_CUDA_H */
