/*
 * index_cuda.h - CUDA entry points of the index family (kernels/index.cu),
 * called by core/index.c, rope.c and multinomial.c when a tensor is on a
 * GPU; declared in every build (core/nocuda.c has the stubs of a build
 * without CUDA). Private to core/.
 *
 * Views live on `device`; launches go on the context's stream and never
 * synchronise with the host. Shapes, dtypes and ranges are validated by
 * the callers; these functions only check what a launch needs. Index views
 * hold i64 or i32. Out-of-range indices are not checked here (see
 * moe_index.h): reads through them give 0 and writes are dropped.
 */
#ifndef MOE_INDEX_CUDA_H
#define MOE_INDEX_CUDA_H

#include "internal.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum moe_scatter_mode { MOE_SCATTER_REPLACE = 0, MOE_SCATTER_ADD = 1 } moe_scatter_mode;

/* The index launchers take the op's name (fn, a static string): an index
 * out of range is reported under it at the next synchronisation (kerr.h).
 *
 * out (contiguous, index's shape, x's dtype) = x gathered along dim:
 * out[p] = x[p with coordinate dim replaced by index[p]]. */
moe_status moe_cuda_gather(moe_ctx *ctx, int device, const char *fn, const moe_kview *out,
                           const moe_kview *x, int dim, const moe_kview *index);

/* out (contiguous, already holding the base values): for every element p of
 * index (src has index's shape here, src's strides), the target t = p with
 * coordinate dim replaced by index[p] gets src[p] (REPLACE: the last p in
 * row-major order wins) or += src[p] (ADD, in row-major order of p). A
 * stable radix sort of the targets gives each target one owning thread. */
moe_status moe_cuda_scatter(moe_ctx *ctx, int device, const char *fn, moe_scatter_mode mode,
                            const moe_kview *out, int dim, const moe_kview *index,
                            const moe_kview *src);

/* out (contiguous (outer, X, inner), already holding x) and src (contiguous
 * (outer, n, inner)), index contiguous (n): out[o, index[i], e] += src[o, i, e]
 * in the windowed order of moe_index_add (moe_index.h), by sorting the n
 * indices (deterministic, no atomics; the CPU follows the same order). */
moe_status moe_cuda_index_add(moe_ctx *ctx, int device, const char *fn, void *out, const void *src, moe_dtype dt,
                              const void *index, moe_dtype index_dt, int64_t outer, int64_t X,
                              int64_t n, int64_t inner);

/* out (m, num_classes) i64 contiguous; ids contiguous (m) i64 or i32. */
moe_status moe_cuda_one_hot(moe_ctx *ctx, int device, const char *fn, int64_t *out, const void *ids,
                            moe_dtype ids_dt, int64_t m, int64_t num_classes);

/* out (E) i64 contiguous = the counts of ids (contiguous (n), i64 or i32);
 * ids outside [0, E) are counted nowhere and reported under fn (kerr.h).
 * Zeroes out itself (a memset on the stream) before counting. */
moe_status moe_cuda_bincount(moe_ctx *ctx, int device, const char *fn, int64_t *out,
                             const void *ids, moe_dtype ids_dt, int64_t n, int64_t E);

/* x, values (rows, cols) contiguous of dtype dt, indices (rows, cols) i64:
 * each row sorted stably (CUB segmented radix sort). rows * cols < 2^31. */
moe_status moe_cuda_sort_rows(moe_ctx *ctx, int device, void *values, int64_t *indices,
                              const void *x, moe_dtype dt, int64_t rows, int64_t cols,
                              bool descending);

/* x (rows, cols) contiguous; values (rows, k) of dt and indices (rows, k)
 * i64: the k best of each row in order, ties lowest index first, one warp
 * per row. 1 <= k <= 32. */
moe_status moe_cuda_topk_rows(moe_ctx *ctx, int device, void *values, int64_t *indices,
                              const void *x, moe_dtype dt, int64_t rows, int64_t cols, int64_t k,
                              bool largest);
#define MOE_CUDA_TOPK_MAX_K 32

/* out (contiguous) = rope(x) (inverse: the transposed rotation); x and out
 * 4-D with the sequence at dim tdim (1 or 2); cos, sin (T, D) or (T, D / 2). */
moe_status moe_cuda_rope(moe_ctx *ctx, int device, const moe_kview *out, const moe_kview *x,
                         const moe_kview *cos, const moe_kview *sin, int tdim, bool inverse);

/* out (rows, num_samples) i64 contiguous; probs a 2-D view (rows, C). The
 * draw order of moe_index.h, one block per row. */
moe_status moe_cuda_multinomial(moe_ctx *ctx, int device, int64_t *out, const moe_kview *probs,
                                int64_t num_samples, bool replacement, uint64_t seed,
                                uint64_t call);

#ifdef __cplusplus
}
#endif
#endif /* MOE_INDEX_CUDA_H */
