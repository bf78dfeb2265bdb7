/*
 * moe_blocksparse.h - block-sparse matrix products over a routing plan's
 * topology (MegaBlocks' SDD, DSD, DDS and the transposed
 * forms its backward needs): core/blocksparse.c (CPU reference, autograd),
 * kernels/blocksparse.cu (CUDA). Included by moe.h.
 *
 * The sparse matrix S. A padded plan with ffn_hidden (moe_routing.h: block
 * size b = plan->block_size, F = plan->ffn_blocks, N = F * b = ffn_hidden,
 * E_loc = e1 - e0) describes S (R x E_loc * N) as nnz b x b blocks: block i
 * sits at row block rb = bs_row_indices[i] and column block
 * cb = bs_column_indices[i] = (e - e0) * F + c, e the expert owning rb,
 * c = 0..F-1. Its VALUES are a contiguous tensor (nnz, b, b), block i
 * row-major (MegaBlocks' stk.Matrix.data layout). The transpose metadata
 * (bs_offsets_t, bs_column_indices_t, bs_block_offsets_t) lists the blocks
 * of each column block.
 *
 * The dense expert operand. w holds one matrix per local expert, a 3-D
 * tensor (E_loc, K, N) or (E_loc, N, K): the stacked (K x E_loc * N) matrix
 * whose column block cb = (e - e0) * F + c is w[e - e0][:, c*b : (c+1)*b]
 * (rows c*b : (c+1)*b of w[e - e0] in the (E_loc, N, K) form).
 *
 * x / y: dense (R, K), R = plan->rows (the permuted, padded buffer of
 * moe_routing_permute). Supported: b = 128 on CUDA (other b: a clear error),
 * any b >= 1 on the CPU; K any size >= 1 (CUDA may require K % 8 == 0 for
 * bf16: then a clear error naming K); dtypes as moe_grouped.h (f32, f64 on
 * the CPU, bf16 with f32 accumulation). No atomics: every output element is
 * summed by one thread in a fixed order, so results are deterministic.
 */
#ifndef MOE_BLOCKSPARSE_H
#define MOE_BLOCKSPARSE_H

#ifdef __cplusplus
extern "C" {
#endif

struct moe_routing_plan;

/*
 * SDD: sparse = dense @ dense, only the plan's blocks.
 *   trans_w false: w (E_loc, K, N): S_i = x[rb] @ w[e][:, c block]
 *   trans_w true:  w (E_loc, N, K): S_i = x[rb] @ w[e][c block, :]^T
 * x (R, K) -> out (nnz, b, b). Differentiable in x and w:
 *   dx = moe_bsmm_dsd(dS, w, plan, !trans_w);
 *   dw = moe_bsmm_dds(x, dS) (trans_w false) or moe_bsmm_dsd_t(dS, x)
 *   (trans_w true).
 */
moe_status moe_bsmm_sdd(moe_ctx *ctx, moe_tensor *x, moe_tensor *w,
                        struct moe_routing_plan *plan, bool trans_w, moe_tensor **out);

/*
 * DSD: dense = sparse @ dense. s (nnz, b, b) ->
 *   trans_w false: w (E_loc, N, K): out[rb] = sum over blocks i of row block rb
 *                  of S_i @ w[e][c block, :]
 *   trans_w true:  w (E_loc, K, N): out[rb] = sum_i S_i @ w[e][:, c block]^T
 * out (R, K). Differentiable in s and w:
 *   ds = moe_bsmm_sdd(dout, w, plan, !trans_w);
 *   dw = moe_bsmm_dsd_t(s, dout) (trans_w false) or moe_bsmm_dds(dout, s)
 *   (trans_w true).
 */
moe_status moe_bsmm_dsd(moe_ctx *ctx, moe_tensor *s, moe_tensor *w,
                        struct moe_routing_plan *plan, bool trans_w, moe_tensor **out);

/*
 * out = moe_bsmm_dsd(s, w) + moe_bsmm_dsd(s2, w2) over the same plan and
 * trans_w (the input gradient of a GLU's two up-projections). On CUDA in
 * bf16 with the sm_90a kernel one kernel walks both pairs into one f32 sum
 * per element, rounded once (no second (R, K) product and no add pass);
 * elsewhere two products and an add. Not differentiable: with grad mode on,
 * an operand that requires grad is an error.
 */
moe_status moe_bsmm_dsd_sum(moe_ctx *ctx, moe_tensor *s, moe_tensor *w, moe_tensor *s2,
                            moe_tensor *w2, struct moe_routing_plan *plan, bool trans_w,
                            moe_tensor **out);

/*
 * out (T, K) = moe_routing_combine(moe_bsmm_dsd(s, w) [+ moe_bsmm_dsd(s2,
 * w2)], plan, gates), bit for bit: the GLU experts' output (gates (T, k) or
 * NULL: ones) and input gradient (the pair, no gates). s2 and w2 are both
 * NULL or both given. Where moe_bsmm_scatters (top-1 plans: every token's
 * row is its output row) the sm_90a kernel's epilogue writes each product
 * row where the combine would put it, scaled by its gate, so neither the
 * (R, K) product nor the combine pass is made; elsewhere the products and
 * the combine. Not differentiable: with grad mode on, an operand that
 * requires grad is an error.
 */
moe_status moe_bsmm_dsd_combine(moe_ctx *ctx, moe_tensor *s, moe_tensor *w, moe_tensor *s2,
                                moe_tensor *w2, struct moe_routing_plan *plan, bool trans_w,
                                moe_tensor *gates, moe_tensor **out);
/* Whether moe_bsmm_dsd_combine and the grouped experts scatter inside the
 * kernel for dtype dt: CUDA, bf16 on the sm_90a kernel, k = 1, every expert
 * local, no capacity, and MOE_BSMM_SCATTER (the knob bsmm_scatter, on by
 * default). */
bool moe_bsmm_scatters(moe_ctx *ctx, const struct moe_routing_plan *plan, moe_dtype dt);

/*
 * DSD with S transposed (a weight gradient; not differentiable):
 * s (nnz, b, b), y (R, K) -> out (E_loc, N, K), out[e][c block, :] = sum over
 * the blocks i of column block cb of S_i^T @ y[rb]; blocks of a column in the
 * transpose metadata's order. Columns without blocks give zeros.
 */
moe_status moe_bsmm_dsd_t(moe_ctx *ctx, moe_tensor *s, moe_tensor *y,
                          struct moe_routing_plan *plan, moe_tensor **out);

/*
 * DDS: dense = dense^T @ sparse (a weight gradient; not differentiable):
 * x (R, K), s (nnz, b, b) -> out (E_loc, K, N), out[e][:, c block] = sum over
 * the blocks i of column block cb of x[rb]^T @ S_i. Zeros where no blocks.
 */
moe_status moe_bsmm_dds(moe_ctx *ctx, moe_tensor *x, moe_tensor *s,
                        struct moe_routing_plan *plan, moe_tensor **out);

/*
 * SDD, DDS and DSD^T with the dense R-row operand gathered from tokens: x
 * (or y) is (T, K) in token order, and row r of the product reads row
 * src[r] / k of it (the plan's src; zeros for padding rows), as
 * moe_routing_permute followed by the product above, without the permuted
 * (R, K) copy. On CUDA the wgmma kernel gathers the rows itself (bf16 on
 * compute capability 9.x: the producer warpgroup copies them with cp.async
 * where a permuted operand comes by TMA); elsewhere the rows are permuted
 * into a copy first. The same bits either way. Not differentiable
 * (for fused callers: moe_glu_experts): with grad mode on, an operand that
 * requires grad is an error.
 */
/* Whether the gather variants gather inside the kernel for operands of
 * dtype dt on the plan's device (else they permute into a copy first).
 * moe_glu_experts uses them when MOE_BSMM_GATHER=1 (the knob bsmm_gather). */
bool moe_bsmm_gathers(moe_ctx *ctx, const struct moe_routing_plan *plan, moe_dtype dt);
moe_status moe_bsmm_sdd_gather(moe_ctx *ctx, moe_tensor *x, moe_tensor *w,
                               struct moe_routing_plan *plan, bool trans_w, moe_tensor **out);
moe_status moe_bsmm_dds_gather(moe_ctx *ctx, moe_tensor *x, moe_tensor *s,
                               struct moe_routing_plan *plan, moe_tensor **out);
moe_status moe_bsmm_dsd_t_gather(moe_ctx *ctx, moe_tensor *s, moe_tensor *y,
                                 struct moe_routing_plan *plan, moe_tensor **out);

/*
 * The GLU experts' first products in one kernel: h1 = x W1 and h3 = x W3
 * (two SDDs over the plan, x (R, K), w1 and w3 (E_loc, K, N), untransposed)
 * and a = act(h1) * h3 (act: 0 silu, 1 gelu, 2 gelu_tanh, as
 * moe_glu_activation), each (nnz, b, b). One tile of the sm_90a kernel
 * computes a block of h1 beside the same block of h3, and its epilogue
 * stores both and a, made from their bf16 values: the bits of two
 * moe_bsmm_sdd and the separate activation pass, without that pass's reads.
 * Only where moe_bsmm_glu_fuses (bf16 on compute capability 9.x with the
 * wgmma kernel, and the knob MOE_BSMM_GLU=1: off by default, slower on an
 * H100 today, docs/EXPERTS.md); elsewhere an
 * error: callers compose the three. Not differentiable (for
 * moe_glu_experts): an operand that requires grad under grad mode is an
 * error.
 */
bool moe_bsmm_glu_fuses(moe_ctx *ctx, const struct moe_routing_plan *plan, moe_dtype dt);
moe_status moe_bsmm_sdd_glu(moe_ctx *ctx, moe_tensor *x, moe_tensor *w1, moe_tensor *w3,
                            struct moe_routing_plan *plan, int act, moe_tensor **h1,
                            moe_tensor **h3, moe_tensor **a);

/*
 * The dense (R, E_loc * N) matrix of s with zeros outside the blocks, and
 * back (values outside the topology ignored). For tests and debugging; both
 * devices; not differentiable.
 */
moe_status moe_bsmm_to_dense(moe_ctx *ctx, moe_tensor *s, struct moe_routing_plan *plan,
                             moe_tensor **out);
moe_status moe_bsmm_from_dense(moe_ctx *ctx, moe_tensor *dense, struct moe_routing_plan *plan,
                               moe_tensor **out);

#ifdef __cplusplus
}
#endif
#endif /* MOE_BLOCKSPARSE_H */
