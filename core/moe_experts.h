/*
 * moe_experts.h - expert computation over a routing plan:
 * parallel_linear, one differentiable op (one node) over the grouped GEMM
 * (moe_grouped.h) or the block-sparse products (moe_blocksparse.h), from
 * which Lua composes expert MLPs; and the fused GLU expert MLP in C that a
 * Lua-composed GLU must match. core/experts.c (+ kernels where fused work
 * needs them). Included by moe.h.
 */
#ifndef MOE_EXPERTS_H
#define MOE_EXPERTS_H

#ifdef __cplusplus
extern "C" {
#endif

struct moe_routing_plan;

typedef enum moe_experts_impl {
  MOE_EXPERTS_GROUPED = 0, /* grouped GEMM over the plan's row segments */
  MOE_EXPERTS_SPARSE = 1   /* block-sparse products over the plan's topology */
} moe_experts_impl;

typedef struct moe_parallel_linear_opts {
  moe_experts_impl impl;
  bool trans_w;        /* w (E_loc, N, K) instead of (E_loc, K, N) */
  bool gather;         /* x is tokens (T, K): its rows are gathered into the
                          plan's order (moe_routing_permute) */
  bool scatter;        /* the output is combined back to tokens (T, N)
                          (moe_routing_combine) with gates */
  moe_tensor *gates;   /* (T, k) for scatter, NULL: all ones (borrowed) */
  bool memory_optimized; /* with gather, where the kernels gather (bf16 on
                            sm_90a): the backward's weight gradient reads
                            x's rows in place rather than permuting the
                            tokens again (as MOE_BSMM_GATHER=wgrad does for
                            every call); the same bits, less memory, slower */
} moe_parallel_linear_opts;

/* impl grouped, no gather, no scatter, w not transposed. */
moe_parallel_linear_opts moe_parallel_linear_opts_default(void);

/*
 * y = x W_e per expert e, rows grouped by the plan.
 *   grouped: x (R, K) (or (T, K) with gather) -> (R, N) (or (T, N) with
 *            scatter).
 *   sparse:  the plan must be padded with ffn_hidden. A 2-D x (R, K) (or
 *            (T, K) with gather) gives the block-sparse (nnz, b, b) hidden
 *            (SDD; scatter is an error); a 3-D x (nnz, b, b) is a sparse
 *            hidden and gives (R, N) or (T, N) with scatter (DSD; gather is an
 *            error). N, K from w as above.
 * Differentiable in x, w and gates: one autograd node that saves x, w and
 * gates, neither the permuted tokens nor the product's rows (its backward
 * permutes again and forms the gate gradient from dout's rows times W^T).
 * With scatter on a top-1 plan the product writes the rows in token order
 * (bf16 on sm_90a: moe_bsmm_scatters); with MOE_BSMM_GATHER=1 the sm_90a
 * kernels read token rows in place (=wgrad: the weight gradient's product
 * only). Where the grouped products cannot read the offsets on the device
 * it uses the plan's host row offsets (moe_routing_plan_counts_to_host: at
 * most one sync per plan).
 */
moe_status moe_parallel_linear(moe_ctx *ctx, moe_tensor *x, moe_tensor *w,
                               struct moe_routing_plan *plan,
                               const moe_parallel_linear_opts *opts, moe_tensor **out);

typedef enum moe_glu_activation {
  MOE_GLU_SILU = 0,   /* SwiGLU: silu(x W1) * (x W3) */
  MOE_GLU_GELU = 1,   /* GeGLU, exact gelu */
  MOE_GLU_GELU_TANH = 2
} moe_glu_activation;

/*
 * The fused GLU expert MLP: out (T, d) = sum over a token's kept
 * assignments of gates[t, j] * (act(x_t W1_e) * (x_t W3_e)) W2_e.
 * x (T, d), w1 and w3 (E_loc, d, f), w2 (E_loc, f, d), gates (T, k) or NULL.
 * impl as above (sparse needs a padded plan with ffn_hidden = f).
 * The backward recomputes act(h1) * h3 from the saved pre-activations (the
 * same bits as the forward's) whatever memory_optimized says (MegaBlocks'
 * option to recompute the activation). Here memory_optimized trades time
 * for memory another way: where the kernels gather (bf16 on sm_90a) the
 * backward's weight gradients dW1 and dW3 read x's rows in place instead of
 * a permuted copy of the tokens (as MOE_BSMM_GATHER=wgrad does for every
 * layer), so the backward's peak holds no (R, d) copy; the same bits.
 * Differentiable in x, w1, w3, w2 and gates; one autograd node.
 */
moe_status moe_glu_experts(moe_ctx *ctx, moe_tensor *x, moe_tensor *w1, moe_tensor *w3,
                           moe_tensor *w2, struct moe_routing_plan *plan, moe_tensor *gates,
                           moe_experts_impl impl, moe_glu_activation act,
                           bool memory_optimized, moe_tensor **out);

/* Options of moe_glu_experts_ex. */
typedef struct moe_glu_experts_opts {
  moe_experts_impl impl;
  moe_glu_activation act;
  bool memory_optimized;
  /* Quantized saved pre-activations (MegaBlocks'
   * quantize_rematerialize_num_bits): with quant_bits 8 or 4, backward keeps
   * h1 and h3 quantized as moe_quantize would (moe_quantize.h: group
   * quant_group_size, 0 a row of the hidden's last dim; stochastic rounding
   * when quant_stochastic) and recomputes act(h1) * h3 from them, so nothing
   * of the hidden's size is kept in bf16 (memory_optimized is implied). On
   * CUDA the quantization is fused into the activation's pass and backward
   * reads the codes directly. Hiddens of fewer than quant_min_numel elements
   * are kept unquantized. The node's tensors are saved past any saved-tensor
   * hooks pushed by the caller: the op's own quantization is the one that
   * applies to it. 0: off. */
  int quant_bits;
  int64_t quant_group_size;
  bool quant_stochastic;
  int64_t quant_min_numel;
} moe_glu_experts_opts;

/* impl grouped, silu, not memory-optimized, quantization off (min_numel
 * 1024 for when it is set). */
moe_glu_experts_opts moe_glu_experts_opts_default(void);

/* moe_glu_experts with options (opts NULL: the defaults). */
moe_status moe_glu_experts_ex(moe_ctx *ctx, moe_tensor *x, moe_tensor *w1, moe_tensor *w3,
                              moe_tensor *w2, struct moe_routing_plan *plan, moe_tensor *gates,
                              const moe_glu_experts_opts *opts, moe_tensor **out);

#ifdef __cplusplus
}
#endif
#endif /* MOE_EXPERTS_H */
