/*
 * moe_reduce.h - reductions, softmax, cumsum, layer_norm, rms_norm,
 * cross_entropy (core/reduce.c, core/norm.c, core/loss.c and their
 * kernels in kernels/); moe_sum itself is declared in moe.h. Included by moe.h. Conventions of moe.h hold: ctx
 * first, outputs last, 0-based dims (negative from the end), a new
 * reference per returned tensor, differentiable ops record autograd nodes
 * (moe_autograd.h).
 *
 * Dtypes: floats (f32, f64, bf16, f16) everywhere; f32/bf16/f16 accumulate
 * in f32 on the GPU and f64 on the CPU, f64 in f64. sum, max, min, argmax and
 * argmin also take integers and bool. Reductions over dims take a list of
 * distinct dims (ndims == 0: all dims); keepdim keeps them with size 1.
 */
#ifndef MOE_REDUCE_H
#define MOE_REDUCE_H

#ifdef __cplusplus
extern "C" {
#endif

/* Mean over dims (floats only). Differentiable. */
moe_status moe_mean(moe_ctx *ctx, moe_tensor *t, int ndims, const int64_t *dims, bool keepdim,
                    moe_tensor **out);

/* Max / min over one dim: values (t's dtype) and indices (i64, the first
 * position of the extreme value; NaN counts as the extreme). indices may be
 * NULL when not wanted. The gradient goes to the index position.
 * An empty dim is an error. */
moe_status moe_max(moe_ctx *ctx, moe_tensor *t, int64_t dim, bool keepdim, moe_tensor **values,
                   moe_tensor **indices);
moe_status moe_min(moe_ctx *ctx, moe_tensor *t, int64_t dim, bool keepdim, moe_tensor **values,
                   moe_tensor **indices);
/* Max / min over all elements: a scalar. The gradient goes to the first
 * position of the extreme value (PyTorch splits it between ties). */
moe_status moe_max_all(moe_ctx *ctx, moe_tensor *t, moe_tensor **out);
moe_status moe_min_all(moe_ctx *ctx, moe_tensor *t, moe_tensor **out);

/* Index (i64) of the max / min along dim; all: over the flattened tensor
 * (dim and keepdim ignored, a scalar). Not differentiable. */
moe_status moe_argmax(moe_ctx *ctx, moe_tensor *t, int64_t dim, bool all, bool keepdim,
                      moe_tensor **out);
moe_status moe_argmin(moe_ctx *ctx, moe_tensor *t, int64_t dim, bool all, bool keepdim,
                      moe_tensor **out);

/* p-norm over dims: (sum |x|^p)^(1/p) for p > 0, max |x| for p = inf
 * (HUGE_VAL). Differentiable (gradient 0 where the norm is 0; for inf the
 * gradient goes to every element whose |x| equals the norm). */
moe_status moe_norm(moe_ctx *ctx, moe_tensor *t, double p, int ndims, const int64_t *dims,
                    bool keepdim, moe_tensor **out);

/* log(sum(exp(x))) over dims, computed max-shifted. Differentiable. */
moe_status moe_logsumexp(moe_ctx *ctx, moe_tensor *t, int ndims, const int64_t *dims,
                         bool keepdim, moe_tensor **out);

/* Variance over dims: sum((x - mean)^2) / (N - correction), PyTorch's
 * `correction` (1: unbiased, 0: population). N - correction <= 0 gives
 * inf or NaN as PyTorch does. Differentiable. */
moe_status moe_var(moe_ctx *ctx, moe_tensor *t, int ndims, const int64_t *dims,
                   double correction, bool keepdim, moe_tensor **out);

/* softmax / log_softmax over one dim. Differentiable. Fused row kernels on
 * the GPU (a dim other than the last, or a non-contiguous input, is copied
 * to contiguous rows first). */
moe_status moe_softmax(moe_ctx *ctx, moe_tensor *t, int64_t dim, moe_tensor **out);
moe_status moe_log_softmax(moe_ctx *ctx, moe_tensor *t, int64_t dim, moe_tensor **out);

/* Inclusive cumulative sum along dim (floats keep their dtype; integers and
 * bool give i64). Differentiable (the gradient is the reversed cumsum). */
moe_status moe_cumsum(moe_ctx *ctx, moe_tensor *t, int64_t dim, moe_tensor **out);

/* Layer norm over the last dim: (x - mean) * rstd * weight + bias, with
 * rstd = 1 / sqrt(var + eps) (population variance). weight and bias are
 * optional (NULL), of shape (n) with x's dtype and device. Saves mean and
 * rstd in f32 (f64 for f64). Gradients for x, weight, bias. */
moe_status moe_layer_norm(moe_ctx *ctx, moe_tensor *x, moe_tensor *weight, moe_tensor *bias,
                          double eps, moe_tensor **out);
/* RMS norm over the last dim: x * rstd * weight with rstd =
 * 1 / sqrt(mean(x^2) + eps); weight optional. Saves rstd. */
moe_status moe_rms_norm(moe_ctx *ctx, moe_tensor *x, moe_tensor *weight, double eps,
                        moe_tensor **out);

typedef enum moe_reduction {
  MOE_REDUCTION_MEAN = 0, /* over rows whose target is not ignore_index */
  MOE_REDUCTION_SUM,
  MOE_REDUCTION_NONE      /* one loss per row, 0 on ignored rows */
} moe_reduction;

/* Parses "mean", "sum", "none"; false for anything else. */
bool moe_reduction_parse(const char *name, moe_reduction *out);

/* Cross entropy of logits (N, C) against target (N) of class indices (i64):
 * loss_r = lse_r - (1 - s) x[r, t_r] - s * mean_c x[r, c], with s the label
 * smoothing in [0, 1]. Rows whose target is ignore_index count for nothing
 * (mean: divided by the count of the other rows; all ignored: NaN, as
 * PyTorch). A target outside [0, C) other than ignore_index is an error on
 * the CPU; on the GPU the kernel does not stop: that row's loss is NaN and
 * the next synchronisation of the device (or copy to the host, item())
 * fails naming "cross_entropy (target)", the value and C (moe_index.h). Output: a scalar (mean, sum) or (N) (none),
 * logits' dtype. Differentiable in logits; the fused backward writes
 * (softmax - (1 - s) onehot - s / C) * grad directly. */
moe_status moe_cross_entropy(moe_ctx *ctx, moe_tensor *logits, moe_tensor *target,
                             int64_t ignore_index, double label_smoothing,
                             moe_reduction reduction, moe_tensor **out);

#ifdef __cplusplus
}
#endif
#endif /* MOE_REDUCE_H */
