/*
 * moe_index.h - indexing, sorting, topk (core/index.c), joining and
 * splitting (core/join.c), rotary embedding (core/rope.c), multinomial
 * (core/multinomial.c); CUDA kernels in kernels/index.cu.
 * Included by moe.h. Conventions of moe.h hold: ctx first, outputs last,
 * 0-based dims, a new reference per returned tensor, differentiable ops
 * record autograd nodes (moe_autograd.h).
 *
 * Index tensors hold 0-based indices as i64 (i32 is accepted too); results
 * that are indices (topk, sort, argsort, multinomial) are i64. All inputs of
 * one call live on one device.
 *
 * Out-of-range indices: on the CPU every op checks them and fails with
 * MOE_ERR_INVALID_ARG naming the value, its position and the valid range.
 * On CUDA the launch cannot check them (that would cost a host
 * synchronisation); the kernels stay inside memory (a read through a bad
 * index (gather, index_select, embedding) gives 0, a write through one
 * (scatter, scatter_add, index_add, embedding's backward) is dropped, and
 * one_hot gives an all-zero row) and record the first bad index, and the next
 * synchronisation of that device (moe_cuda_synchronize, a copy to the host
 * such as item()) fails with MOE_ERR_INVALID_ARG naming the op, the value
 * and the range, e.g. "embedding: index 12 is out of range [0, 10) on
 * cuda:0 (found by the kernel, reported at this synchronisation ...)". The
 * context goes on afterwards.
 *
 * Determinism: nothing here uses floating-point atomics, and every float
 * sum has one order, fixed by the index alone, that the CPU and CUDA both
 * follow, so the two give the same bits. scatter_add and the backward of
 * gather, sort and topk add each target's sources serially in row-major
 * order of the index (on CUDA a stable radix sort of the targets gives one
 * thread each target). index_add, and with it the backward of index_select
 * and embedding, adds in the windowed order written at moe_index_add below
 * (parallel on CUDA over windows of the sorted index). Integer sums
 * (scatter_add of i32/i64, bincount) use integer atomics on CUDA, whose
 * result does not depend on the order; scatter with repeated targets keeps
 * the last one in row-major order, on both devices.
 *
 * dtypes: data movement (gather, scatter, index_select, embedding, cat,
 * stack, split) takes every dtype; accumulation (scatter_add, index_add) takes
 * every dtype but bool and adds floats in f32 (f64 for f64) and integers in
 * i64; rope and multinomial take f32, f64, bf16 and f16 (f64 on CUDA too),
 * with f32 math for the 16-bit dtypes.
 */
#ifndef MOE_INDEX_H
#define MOE_INDEX_H

#ifdef __cplusplus
extern "C" {
#endif

/* ----------------------------------------------------- gather / scatter */

/* out[i][j][k] = x[index[i][j][k]][j][k] (dim 0; likewise for other dims).
 * index has x's number of dims and index.shape[d] <= x.shape[d] for d != dim;
 * out has index's shape and x's dtype. Differentiable in x. */
moe_status moe_gather(moe_ctx *ctx, moe_tensor *x, int64_t dim, moe_tensor *index,
                      moe_tensor **out);
/* Out of place: out = copy of x, then out[index[i][j][k]][j][k] = src[i][j][k]
 * (dim 0). index, x and src have one number of dims; index.shape[d] <=
 * src.shape[d] for all d and <= x.shape[d] for d != dim; src has x's dtype.
 * With repeated targets the last in row-major order of index wins.
 * Differentiable in x and src (src's gradient is gout gathered at index, as
 * PyTorch does, so a repeated target passes its gradient to every writer). */
moe_status moe_scatter(moe_ctx *ctx, moe_tensor *x, int64_t dim, moe_tensor *index,
                       moe_tensor *src, moe_tensor **out);
/* As moe_scatter, adding: out[index[i][j][k]][j][k] += src[i][j][k]. */
moe_status moe_scatter_add(moe_ctx *ctx, moe_tensor *x, int64_t dim, moe_tensor *index,
                           moe_tensor *src, moe_tensor **out);

/* --------------------------------------------- index_select / index_add */

/* index is 1-D (n); out has x's shape with dim of size n:
 * out.select(dim, i) = x.select(dim, index[i]). Differentiable in x. */
moe_status moe_index_select(moe_ctx *ctx, moe_tensor *x, int64_t dim, moe_tensor *index,
                            moe_tensor **out);
/* index is 1-D (n); src has x's shape with dim of size n; out = copy of x,
 * then out.select(dim, index[i]) += src.select(dim, i). Differentiable in x
 * and src.
 *
 * Summation order (the same on the CPU and CUDA, bit for bit; also the
 * backward of index_select and embedding). Sort the positions i by
 * (index[i], i): each key k gets a segment of consecutive sorted entries,
 * its occurrences in increasing i. Cut the sorted entries into windows of
 * P = MOE_INDEX_ADD_WINDOW (entries [wP, wP + P)). Per element of a row,
 * in the compute type (f32 for f32/bf16/f16, f64 for f64, i64 for
 * integers):
 *   head = x[k] + s_1 + s_2 + ...   (left to right) over the segment's
 *          entries in its first window;
 *   C_v  = s_a + s_b + ...          (left to right, starting from the first
 *          entry, not from 0) over its entries in each later window v;
 *   out[k] = (((head + C_w1) + C_w2) + ...) in window order, rounded once
 *          to x's dtype.
 * A key whose occurrences all fall in one window is the plain serial sum
 * x[k] + s_1 + s_2 + ... in order of i. On CUDA the windows are summed in
 * parallel (one thread per window, row element and outer index), then one
 * thread per row element of each segment that spans windows adds the
 * window partials in order; a frequent key no longer costs one thread a
 * walk over all of its occurrences. */
moe_status moe_index_add(moe_ctx *ctx, moe_tensor *x, int64_t dim, moe_tensor *index,
                         moe_tensor *src, moe_tensor **out);
/* P of index_add's summation order: 32 entries of the sorted index per
 * window. It bounds the serial adds of a window to 32 and of a segment's
 * second pass to n / 32; with the 16384 tokens of a training step and rows
 * of 512, 512 windows x 512 elements are 262144 threads, about one full
 * H100 (132 SMs x 2048), and the f32 partials take 2 x 4 / 32 bytes per
 * summed element of src. */
#define MOE_INDEX_ADD_WINDOW 32
/* weight (V, D), ids of any shape S (i64 or i32): out (S..., D) with
 * out[s] = weight[ids[s]]. Differentiable in weight; the backward sums rows
 * deterministically (a stable sort of ids on CUDA, no atomics). */
moe_status moe_embedding(moe_ctx *ctx, moe_tensor *weight, moe_tensor *ids, moe_tensor **out);
/* ids of any shape S (integers): out (S..., num_classes) i64 with a 1 at
 * ids[s]. num_classes -1 means max(ids) + 1 (on CUDA this reads ids back to
 * the host: a synchronisation). */
moe_status moe_one_hot(moe_ctx *ctx, moe_tensor *ids, int64_t num_classes, moe_tensor **out);

/* ids of any shape and strides (i64 or i32), E >= 0 -> out (E) i64 on ids'
 * device: out[e] = how many elements of ids equal e (the MoE router's expert
 * counts). Not differentiable. CPU: an id outside [0, E) is an error naming
 * the value, its position and the range. CUDA: no check at the launch (that
 * would be a synchronisation): an id outside [0, E) is counted in no bin and
 * reported at the next synchronisation, as every index op here (above). One
 * launch after a memset: each block counts into a histogram in shared memory
 * (E <= MOE_BINCOUNT_SMEM_MAX; larger E counts straight into global memory),
 * lanes of a warp holding the same id add once, then the blocks add their
 * bins to out with integer atomics (deterministic: integer sums do not depend
 * on the order). Nothing synchronises with the host. */
moe_status moe_bincount(moe_ctx *ctx, moe_tensor *ids, int64_t E, moe_tensor **out);
#define MOE_BINCOUNT_SMEM_MAX 8192

/* ------------------------------------------------------ sort and topk */
/*
 * Order: values ascending (descending / largest: the reverse); equal values
 * keep their order of position (stable), so ties come lowest index first in
 * both directions; NaN is larger than every number. On CUDA the sort is CUB's
 * segmented radix sort (stable), which orders -0.0 before +0.0 where the CPU
 * treats them as equal. Every dtype but bool; on CUDA at most 2^31 - 1
 * elements per call.
 */

/* values: x sorted along dim (x's dtype); indices (i64): where each value
 * was. Differentiable in x (through values). */
moe_status moe_sort(moe_ctx *ctx, moe_tensor *x, int64_t dim, bool descending,
                    moe_tensor **values, moe_tensor **indices);
moe_status moe_argsort(moe_ctx *ctx, moe_tensor *x, int64_t dim, bool descending,
                       moe_tensor **indices);
/* The k largest (smallest unless largest) values along dim, in order, and
 * their indices (i64); 0 <= k <= x.shape[dim]. Differentiable in x through
 * values. On CUDA, k <= 32 along a contiguous last dim uses one warp per row
 * (the MoE router: k <= 8 of E <= 256); other cases sort. */
moe_status moe_topk(moe_ctx *ctx, moe_tensor *x, int64_t k, int64_t dim, bool largest,
                    moe_tensor **values, moe_tensor **indices);

/* ------------------------------------------------------------- joining */

/* Concatenates n >= 1 tensors of one dtype and device along dim; their
 * shapes agree except in dim. Differentiable in every input. */
moe_status moe_cat(moe_ctx *ctx, int n, moe_tensor *const *xs, int64_t dim, moe_tensor **out);
/* Stacks n >= 1 tensors of one shape, dtype and device along a new dim
 * (0 <= dim <= ndim; negative counts from ndim + 1). Differentiable. */
moe_status moe_stack(moe_ctx *ctx, int n, moe_tensor *const *xs, int64_t dim, moe_tensor **out);
/* Views of x along dim (narrow, so gradients flow through narrow's node):
 *   moe_split: pieces of split_size (the last may be smaller);
 *   moe_split_sizes: n pieces of the given sizes, which sum to x.shape[dim];
 *   moe_chunk: chunks pieces of ceil(size / chunks) (fewer when the size
 *   does not need them all, as PyTorch).
 * outs has room for max_out tensors; *n_out gets the count. A dim of size 0
 * gives one empty piece. On failure no output is left. */
moe_status moe_split(moe_ctx *ctx, moe_tensor *x, int64_t split_size, int64_t dim, int max_out,
                     moe_tensor **outs, int *n_out);
moe_status moe_split_sizes(moe_ctx *ctx, moe_tensor *x, int n, const int64_t *sizes,
                           int64_t dim, moe_tensor **outs);
moe_status moe_chunk(moe_ctx *ctx, moe_tensor *x, int64_t chunks, int64_t dim, int max_out,
                     moe_tensor **outs, int *n_out);
/* How many pieces moe_split / moe_chunk give (for sizing outs). */
moe_status moe_split_count(moe_ctx *ctx, const moe_tensor *x, int64_t split_size, int64_t dim,
                           int *count);
moe_status moe_chunk_count(moe_ctx *ctx, const moe_tensor *x, int64_t chunks, int64_t dim,
                           int *count);

/* ------------------------------------------------- rotary embedding */
/*
 * Rotary position embedding with the rotate-half convention of GPT-NeoX and
 * Llama: with h = D / 2, x1 = x[..., :h], x2 = x[..., h:],
 *   out[..., j]     = x1[j] * cos[t, j]     - x2[j] * sin[t, j]
 *   out[..., j + h] = x2[j] * cos[t, j + h] + x1[j] * sin[t, j + h]
 * x is (B, T, H, D) (MOE_ROPE_BTHD) or (B, H, T, D) (MOE_ROPE_BHTD), D even,
 * any strides. cos and sin are (T, D / 2) (as moe_rope_cache makes: entry j
 * serves both j and j + h) or (T, D) (Hugging Face's duplicated halves); for
 * generation past position p, pass the narrowed rows [p, p + T) of a longer
 * cache. Differentiable in x; the backward applies the transposed rotation
 * (the inverse rotation for tables of angles). cos and sin are constants: an
 * error if they require grad. Computed in f32 (f64 for f64); x, cos and sin
 * share one dtype.
 */
typedef enum moe_rope_layout { MOE_ROPE_BTHD = 0, MOE_ROPE_BHTD = 1 } moe_rope_layout;

moe_status moe_rope(moe_ctx *ctx, moe_tensor *x, moe_tensor *cos, moe_tensor *sin,
                    moe_rope_layout layout, moe_tensor **out);
/* cos, sin (T, D / 2) of angle t * base^(-2j / D), computed in double and
 * stored as dt (a float dtype) on device d. D even and > 0, T >= 0, base > 0. */
moe_status moe_rope_cache(moe_ctx *ctx, int64_t T, int64_t D, double base, moe_dtype dt,
                          moe_device d, moe_tensor **cos, moe_tensor **sin);

/* -------------------------------------------------------- multinomial */
/*
 * probs (N, C) or (C) of non-negative weights (need not sum to 1); out
 * (N, num_samples) or (num_samples) i64 category indices. With replacement
 * each draw is independent; without, a category is drawn at most once
 * (num_samples <= the count of non-zero weights of each row).
 *
 * Draw s of row r uses u = moe_philox_uniform53(seed, call, r * num_samples
 * + s) with the context's generator (one call per multinomial, as the random
 * fills). A row is cut into 256 chunks of ceil(C / 256) weights, summed in
 * double in a fixed order; the draw picks the first category whose running
 * sum exceeds u * total. CPU and CUDA follow the same order, so one seed gives
 * the same samples on both. Without replacement, drawn categories get weight
 * 0 and the sums are redone. On CUDA, rows with a negative, NaN or infinite
 * weight or a zero total are not checked (a synchronisation): their samples
 * are unspecified indices in [0, C); on the CPU they are an error.
 */
moe_status moe_multinomial(moe_ctx *ctx, moe_tensor *probs, int64_t num_samples,
                           bool replacement, moe_tensor **out);

#ifdef __cplusplus
}
#endif
#endif /* MOE_INDEX_H */
