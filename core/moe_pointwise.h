/*
 * moe_pointwise.h - pointwise math, comparisons, activations and dropout (core/pointwise.c, kernels/pointwise.cu).
 * Included by moe.h. Conventions of moe.h hold: ctx first, outputs last,
 * 0-based dims, a new reference per returned tensor, differentiable ops
 * record autograd nodes (moe_autograd.h).
 *
 * Dtypes. Math (pow, exp, log, sqrt, rsqrt, the activations, swiglu,
 * dropout) takes float tensors (f32, f64, bf16, f16) and keeps their dtype;
 * f32/bf16/f16 compute in float, f64 in double. abs, clamp, maximum, minimum
 * also take integer tensors (computed in int64); comparisons and where take
 * every dtype. Anything else is MOE_ERR_DTYPE naming the op and the dtype.
 * Binary ops broadcast (NumPy rules) and promote with moe_dtype_promote; all
 * tensors of one call must be on one device.
 *
 * Gradients (all saved tensors are the inputs, never the outputs, so no
 * node holds its own output):
 *   - maximum/minimum: to the selected input; where a == b the gradient is
 *     split equally (half to each), as PyTorch does.
 *   - clamp: passes where min <= x <= max (bounds inclusive), else 0.
 *   - pow: d/da = b a^(b-1) (0 where b == 0); d/db = a^b log(a) (0 where
 *     a == 0 and b >= 0), as PyTorch.
 *   - abs: sign(x) (0 at 0); relu: 1 where x > 0.
 *   - where: to a where cond, to b elsewhere; cond gets none.
 *   - comparisons are not differentiable (their results never require grad).
 *   - dropout: the mask is not saved; backward regenerates it from the
 *     (seed, call) the forward used, kept in the node.
 */
#ifndef MOE_POINTWISE_H
#define MOE_POINTWISE_H

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------- powers */

/* a ^ b, broadcasting; differentiable in a and b. */
moe_status moe_pow(moe_ctx *ctx, moe_tensor *a, moe_tensor *b, moe_tensor **out);
/* a ^ s (tensor to a scalar power). */
moe_status moe_pow_scalar(moe_ctx *ctx, moe_tensor *a, double s, moe_tensor **out);
/* s ^ a (a scalar to a tensor power). */
moe_status moe_rpow_scalar(moe_ctx *ctx, double s, moe_tensor *a, moe_tensor **out);

/* ------------------------------------------------------- unary math */

moe_status moe_exp(moe_ctx *ctx, moe_tensor *x, moe_tensor **out);
moe_status moe_log(moe_ctx *ctx, moe_tensor *x, moe_tensor **out);
moe_status moe_sqrt(moe_ctx *ctx, moe_tensor *x, moe_tensor **out);
moe_status moe_rsqrt(moe_ctx *ctx, moe_tensor *x, moe_tensor **out); /* 1 / sqrt(x) */
moe_status moe_abs(moe_ctx *ctx, moe_tensor *x, moe_tensor **out);
/* min(max(x, min), max); pass NAN for an absent bound (at least one must be
 * given). An integer tensor keeps its dtype for integral bounds and gives f32
 * for a non-integral one (as moe_binary_scalar). If min > max every element
 * becomes max (as PyTorch). NaN elements stay NaN. */
moe_status moe_clamp(moe_ctx *ctx, moe_tensor *x, double min, double max, moe_tensor **out);

/* ------------------------------------------------------- activations */

moe_status moe_relu(moe_ctx *ctx, moe_tensor *x, moe_tensor **out);
moe_status moe_gelu(moe_ctx *ctx, moe_tensor *x, moe_tensor **out);      /* exact, erf */
moe_status moe_gelu_tanh(moe_ctx *ctx, moe_tensor *x, moe_tensor **out); /* tanh approx. */
moe_status moe_silu(moe_ctx *ctx, moe_tensor *x, moe_tensor **out);
moe_status moe_sigmoid(moe_ctx *ctx, moe_tensor *x, moe_tensor **out);
moe_status moe_tanh(moe_ctx *ctx, moe_tensor *x, moe_tensor **out);
/* silu(gate) * up as one fused op (the GLU expert activation). gate and up
 * must have the same shape, dtype and device; differentiable in both. */
moe_status moe_swiglu(moe_ctx *ctx, moe_tensor *gate, moe_tensor *up, moe_tensor **out);

/* --------------------------------------------- binary and selection */

/* Elementwise maximum / minimum, broadcasting (NaN propagates). */
moe_status moe_maximum(moe_ctx *ctx, moe_tensor *a, moe_tensor *b, moe_tensor **out);
moe_status moe_minimum(moe_ctx *ctx, moe_tensor *a, moe_tensor *b, moe_tensor **out);
/* cond ? a : b; cond must be bool; the three broadcast together; the result
 * has the promoted dtype of a and b. */
moe_status moe_where(moe_ctx *ctx, moe_tensor *cond, moe_tensor *a, moe_tensor *b,
                     moe_tensor **out);

/* --------------------------------------------------------- comparisons */

/* op is one of MOE_OP_EQ, NE, LT, LE, GT, GE. The result is a bool tensor
 * of the broadcast shape. Operands are compared in double when either is a
 * float (or the scalar is not an integer), in int64 otherwise. */
moe_status moe_compare(moe_ctx *ctx, moe_op op, moe_tensor *a, moe_tensor *b, moe_tensor **out);
moe_status moe_compare_scalar(moe_ctx *ctx, moe_op op, moe_tensor *a, double s,
                              moe_tensor **out);

/* ------------------------------------------------------------- dropout */

/* In training with p > 0: element i (row-major) is kept iff
 * moe_philox_uniform24(seed, call, i) >= p, with (seed, call) the context's
 * generator state; kept elements are scaled by 1 / (1 - p) (p == 1 zeroes
 * everything); ctx->rng_call advances by one. CPU and GPU draw the same
 * mask. Otherwise (not training, or p == 0) returns x itself, retained, and
 * draws nothing. p must be in [0, 1]. */
moe_status moe_dropout(moe_ctx *ctx, moe_tensor *x, double p, bool training, moe_tensor **out);

#ifdef __cplusplus
}
#endif
#endif /* MOE_POINTWISE_H */
