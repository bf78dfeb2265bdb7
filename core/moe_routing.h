/*
 * moe_routing.h - the routing plan of a Mixture-of-Experts layer and the two
 * differentiable ops built on it, permute and combine (core/routing.c, CUDA
 * in kernels/routing.cu). C users include it beside moe.h. docs/ROUTING.md
 * draws the layout.
 *
 * Terms. T tokens each pick k experts out of E: ids (T, k). Assignment
 * a = t * k + j is token t's j-th choice; N = T * k. The plan sorts the
 * assignments stably by expert and lays them out in a "permuted buffer" of
 * R rows, one contiguous segment of rows per expert:
 *
 *   rows [row_offsets[e], row_offsets[e + 1]) belong to expert e; the first
 *   kept[e] of them hold tokens (in sorted order), the rest are padding.
 *
 * Variants (moe_routing_opts):
 *   dropless     block_size 0, capacity_factor 0: R = N, no padding,
 *                row_offsets = offsets.
 *   padded       block_size b > 0: each segment rounded up to a multiple of
 *                b (MegaBlocks); with ffn_hidden > 0 the plan also holds the
 *                block-sparse topology below.
 *   capacity     capacity_factor c > 0: capacity C = ceil(c * T * k / E)
 *                (rounded up to a multiple of block_size when padded; at
 *                least 1); each
 *                segment has C rows, R = E * C; assignments past C are
 *                dropped, by position (earlier tokens win: rank in the
 *                stable sort) or by score (higher gate wins, ties: earlier
 *                assignment; the segment is then ordered by descending
 *                score). A dropped assignment has dest = -1: combine gives it
 *                zero weight and its gradients are zero.
 *   local        expert_begin/expert_end = [e0, e1): only experts e0..e1-1
 *                get rows (expert parallelism); assignments to other experts
 *                have dest = -1, so combine gives this rank's partial sum.
 *
 * Host synchronisation. The plan is built on the ids' device without waiting
 * for it, EXCEPT that the per-expert counts are copied to the host once when
 * (a) opts.counts_to_host is set, (b) moe_routing_plan_counts_to_host is
 * called, or (c) R depends on the data (padded without capacity, or dropless
 * with a local range). That copy is the one synchronisation an MoE layer is
 * allowed (grouped GEMM needs the group sizes on the host); plan->host_syncs
 * counts it (at most 1 per plan: later requests reuse the copy). permute and
 * combine never synchronise. On the CPU the same copy is made and counted,
 * so tests assert one count on both devices.
 *
 * Out-of-range ids (< 0 or >= E): an error on the CPU (MOE_ERR_INVALID_ARG
 * naming the value and position). On CUDA they are not checked at build
 * time (a check costs a synchronisation): such an assignment is dropped
 * (dest = -1, counted in no expert), and the error is raised by the one
 * counts copy when it happens (the copy carries the number of valid ids).
 *
 * Block-sparse topology (padded with ffn_hidden = F * b, b = block_size):
 * the (R x (e1 - e0) * F * b) block matrix whose blocks are b x b; row block
 * rb (rows [rb * b, (rb + 1) * b)) belongs to the expert e whose segment
 * holds it, and has exactly F non-zero blocks, at column blocks
 * (e - e0) * F + c, c = 0..F-1. nnz = (R / b) * F. Blocked CSR as MegaBlocks'
 * stk.Matrix:
 *   bs_row_indices[i], bs_column_indices[i]  row / column block of block i,
 *                                             blocks in row-major order
 *   bs_offsets (R / b + 1)                    first block of each row block
 * and the transpose metadata of its backward pass (column-major order):
 *   bs_offsets_t ((e1 - e0) * F + 1)         first block of each column
 *   bs_column_indices_t[i_t]                  row block of the i_t-th block
 *                                             in column-major order
 *   bs_block_offsets_t[i_t]                   its index i in row-major order
 *
 * Every index tensor of the plan is i64, contiguous, on the ids' device.
 */
#ifndef MOE_ROUTING_H
#define MOE_ROUTING_H

#include "moe.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum moe_routing_drop {
  MOE_ROUTING_DROP_POSITION = 0, /* earlier tokens win */
  MOE_ROUTING_DROP_SCORE = 1     /* higher scores win (opts.scores) */
} moe_routing_drop;

typedef struct moe_routing_opts {
  int64_t block_size;           /* 0: unpadded; > 0: pad segments to it (MegaBlocks: 128) */
  int64_t ffn_hidden;           /* > 0 with block_size: build the block-sparse topology;
                                   a multiple of block_size */
  double capacity_factor;       /* 0: dropless; > 0: capacity-limited */
  moe_routing_drop drop_policy;
  moe_tensor *scores;           /* (T, k) float, for MOE_ROUTING_DROP_SCORE (borrowed) */
  int64_t expert_begin;         /* local experts [expert_begin, expert_end); */
  int64_t expert_end;           /* both 0: all experts */
  bool counts_to_host;          /* copy the counts to the host now (the one sync) */
  const int64_t *known_counts;  /* (E) or NULL: the counts, already on the host (borrowed) */
} moe_routing_opts;

/* Dropless, unpadded, all experts, no host copy. */
moe_routing_opts moe_routing_opts_default(void);

typedef struct moe_routing_plan {
  int64_t refcount;
  moe_device device;
  int64_t T, k, E, N;           /* N = T * k assignments */
  int64_t e0, e1;               /* local experts [e0, e1) */
  int64_t block_size;           /* 0 when unpadded */
  int64_t capacity;             /* rows per expert when capacity-limited, else 0 */
  moe_routing_drop drop_policy;
  int64_t rows;                 /* R, rows of the permuted buffer */
  moe_tensor *counts;           /* (E) assignments routed to each expert */
  moe_tensor *kept;             /* (E) rows holding tokens: counts capped at capacity,
                                   0 outside [e0, e1) */
  moe_tensor *offsets;          /* (E + 1) exclusive scan of counts (sorted order) */
  moe_tensor *row_offsets;      /* (E + 1) segment starts in the buffer; experts
                                   outside [e0, e1) have empty segments */
  moe_tensor *sort_perm;        /* (N) sorted position -> assignment t * k + j */
  moe_tensor *sort_inv;         /* (N) assignment -> sorted position */
  moe_tensor *dest;             /* (N) assignment -> buffer row, -1 when dropped */
  moe_tensor *src;              /* (R) buffer row -> assignment, -1 for padding */
  /* block-sparse topology; NULL unless block_size and ffn_hidden are set */
  int64_t ffn_blocks;           /* F = ffn_hidden / block_size */
  int64_t nnz;                  /* (R / block_size) * F */
  moe_tensor *bs_row_indices;      /* (nnz) */
  moe_tensor *bs_column_indices;   /* (nnz) */
  moe_tensor *bs_offsets;          /* (R / block_size + 1) */
  moe_tensor *bs_column_indices_t; /* (nnz) */
  moe_tensor *bs_offsets_t;        /* ((e1 - e0) * F + 1) */
  moe_tensor *bs_block_offsets_t;  /* (nnz) */
  /* host side, after the counts copy */
  int64_t *counts_host;         /* (E) or NULL */
  int64_t *row_offsets_host;    /* (E + 1) or NULL */
  int64_t host_syncs;           /* device -> host copies this plan made (0 or 1) */
} moe_routing_plan;

/* ids (T, k) i64 or i32 on any device, E >= 1 experts. opts NULL: defaults.
 * Errors: ids not 2-D, bad dtype, E < 1, bad option values (block_size < 0,
 * ffn_hidden not a multiple of block_size, capacity_factor < 0, a bad expert
 * range, scores missing or not (T, k) float on ids' device). */
moe_status moe_routing_plan_new(moe_ctx *ctx, const moe_tensor *ids, int64_t E,
                                const moe_routing_opts *opts, moe_routing_plan **out);
void moe_routing_plan_retain(moe_routing_plan *p);
void moe_routing_plan_release(moe_routing_plan *p); /* NULL is a no-op */
/* Copies counts (and the host row offsets) to the host unless already there:
 * the layer's one host synchronisation (plan->host_syncs becomes 1). On CUDA
 * it also reports ids that were out of range. */
moe_status moe_routing_plan_counts_to_host(moe_ctx *ctx, moe_routing_plan *p);
/* Per-rank counts for expert parallelism: the E experts split into n_ranks
 * contiguous ranges of E / n_ranks (E divisible by n_ranks); out (n_ranks) i64
 * on the plan's device: assignments routed to each rank (before capacity),
 * i.e. the send counts of the all-to-all. No synchronisation. */
moe_status moe_routing_rank_counts(moe_ctx *ctx, const moe_routing_plan *p, int64_t n_ranks,
                                   moe_tensor **out);

/* x (T, d) float, any strides, on the plan's device -> out (R, d) contiguous,
 * x's dtype: out[r] = x[src[r] / k], zero rows for padding. Differentiable in
 * x; the backward sums the k copies of each token in slot order (a combine
 * without gates: deterministic, no atomics). */
moe_status moe_routing_permute(moe_ctx *ctx, moe_tensor *x, moe_routing_plan *p,
                               moe_tensor **out);
/* y (R, d) float, gates (T, k) float or NULL (all ones), on the plan's
 * device -> out (T, d) of y's dtype:
 *   out[t] = sum over j = 0..k-1 with dest[t*k+j] >= 0 of
 *            gates[t, j] * y[dest[t*k+j]]
 * summed in slot order in f32 (f64 for f64), one row per thread block on
 * CUDA: deterministic, no atomics, the same bits as the CPU. Differentiable
 * in y (dy[r] = gates[a] * dout[a / k], a = src[r]; 0 for padding) and in
 * gates (dgates[a] = dot(dout[a / k], y[dest[a]]), 0 when dropped). */
moe_status moe_routing_combine(moe_ctx *ctx, moe_tensor *y, moe_routing_plan *p,
                               moe_tensor *gates, moe_tensor **out);

#ifdef __cplusplus
}
#endif
#endif /* MOE_ROUTING_H */
