/*
 * moe_optim.h - the optimiser family: fused, in-place parameter updates
 * (AdamW with decoupled weight decay and bias correction, SGD with momentum)
 * on one parameter tensor per call, on the CPU and on CUDA (one kernel launch
 * per tensor, kernels/optim.cu). The Lua optimisers (lua/moe/optim/) loop
 * over a model's parameters and call these; they own the state tensors.
 *
 * Precision: the update is computed in f32 (f64 for f64 parameters). A bf16
 * or f16 parameter needs an fp32 master copy: the update runs on the master
 * and the parameter is rewritten from it (round to nearest even) in the same
 * pass. The CPU loop and the CUDA kernel do the same IEEE operations in the
 * same order (no fused multiply-add), so both devices give the same bits;
 * there are no reductions, so every step is deterministic.
 *
 * Multi-tensor forms (moe_adamw_step_multi, moe_grad_norm_multi,
 * moe_scale_multi) take a list of tensors on one device and cover it in a
 * handful of launches on CUDA: each tensor is cut into chunks of
 * MOE_OPTIM_CHUNK elements, one block per chunk, the table of tensors passed
 * in the kernel arguments (up to 48 tensors per launch). The AdamW update of
 * every element is the same IEEE sequence as moe_adamw_step's, so both forms
 * give the same bits. Their optional device scalars (grad_scale, skip) are
 * read by the kernels, so gradient clipping needs no host read.
 *
 * Arguments: param contiguous; grad of param's shape, any float dtype and
 * any strides (made contiguous first when needed); state tensors (exp_avg,
 * exp_avg_sq, momentum buffer, master) contiguous with param's element
 * count, f32 (f64 for f64 params), all on param's device. Nothing is
 * touched when validation fails. Not differentiable (they update leaves).
 */
#ifndef MOE_OPTIM_H
#define MOE_OPTIM_H

#include "moe.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct moe_adamw_opts {
  double lr;           /* >= 0 */
  double beta1, beta2; /* in [0, 1) */
  double eps;          /* >= 0 */
  double weight_decay; /* >= 0, decoupled: w -= lr * weight_decay * w */
  int64_t step;        /* the step being taken, 1-based (bias correction) */
} moe_adamw_opts;

/* lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0, step 1 */
moe_adamw_opts moe_adamw_opts_default(void);

/*
 * One AdamW step (PyTorch's torch.optim.AdamW, maximize=False, amsgrad=False):
 *   w = master ? master : param
 *   w *= 1 - lr * weight_decay
 *   m = beta1 * m + (1 - beta1) * g
 *   v = beta2 * v + (1 - beta2) * g * g
 *   w -= (lr / (1 - beta1^step)) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
 *   param = w (rounded to param's dtype); master = w when given.
 * master may be NULL for f32/f64 params; required for bf16/f16 params.
 */
moe_status moe_adamw_step(moe_ctx *ctx, moe_tensor *param, const moe_tensor *grad,
                          moe_tensor *exp_avg, moe_tensor *exp_avg_sq, moe_tensor *master,
                          const moe_adamw_opts *o);

/* One parameter of a multi-tensor AdamW step: moe_adamw_step's tensors and
 * the weight decay of its group (replaces opts->weight_decay). */
typedef struct moe_adamw_entry {
  moe_tensor *param;
  const moe_tensor *grad;
  moe_tensor *exp_avg, *exp_avg_sq;
  moe_tensor *master;  /* NULL allowed for f32/f64 params, as moe_adamw_step */
  double weight_decay; /* >= 0 */
} moe_adamw_entry;

/* Elements per chunk of the multi-tensor kernels (one CUDA block each); the
 * CPU norm follows the same chunks so both devices sum in the same order. */
#define MOE_OPTIM_CHUNK 65536

/*
 * moe_adamw_step on every entry in one call (opts->weight_decay ignored: each
 * entry carries its own). Entries may mix dtypes as moe_adamw_step allows
 * (f32, f64, bf16, f16 params; f32 state, f64 for f64 params); every tensor
 * must be on one device. Optional device scalars, f32 tensors of one element
 * on that device, read on the device (no host synchronisation):
 *   grad_scale: each gradient element is multiplied by it as it is read
 *               (g = g * scale, in the state's precision) before the update;
 *   skip:       when its value is not 0 (NaN counts as not 0), the call
 *               writes nothing (a step with a non-finite gradient).
 * With grad_scale NULL the result is bit-identical to one moe_adamw_step per
 * entry. Validation covers every entry before anything is written; errors
 * name the entry ("adamw_step_multi: entry 3: ..."). n == 0 is a no-op.
 */
moe_status moe_adamw_step_multi(moe_ctx *ctx, const moe_adamw_entry *entries, int64_t n,
                                const moe_adamw_opts *o, const moe_tensor *grad_scale,
                                const moe_tensor *skip);

/*
 * The global L2 norm of n gradients (any float dtypes, one device) and the
 * clipping coefficient, computed on that device with no host read:
 *   norm      = sqrt(sum over every element x of x * x)  (f32, x rounded to f32)
 *   coef      = min(1, max_norm / (norm + 1e-6))          (f32; 1 when norm is 0)
 *   found_inf = norm is finite ? 0 : 1
 * Outputs are f32 tensors of one element on the gradients' device (for n ==
 * 0: the device of norm; norm 0, coef 1); coef and found_inf may be NULL.
 * max_norm > 0 (inf: coef is 1). Deterministic: a fixed two-pass sum without
 * atomics, each chunk of MOE_OPTIM_CHUNK elements summed by 512 lanes (lane
 * j takes elements j, j + 512, ...) then a pairwise tree; the chunk sums in
 * list order, again by 512 lanes and a tree; CPU and CUDA give the same bits.
 */
moe_status moe_grad_norm_multi(moe_ctx *ctx, const moe_tensor *const *grads, int64_t n,
                               double max_norm, moe_tensor *norm, moe_tensor *coef,
                               moe_tensor *found_inf);

/*
 * In place, t = t * scale[0] for every tensor (contiguous, f32, f64, bf16 or
 * f16, one device); scale is an f32 tensor of one element on that device
 * (read there). The product is taken in f32 (f64 for f64 tensors) and
 * rounded to the tensor's dtype.
 */
moe_status moe_scale_multi(moe_ctx *ctx, moe_tensor *const *tensors, int64_t n,
                           const moe_tensor *scale);

typedef struct moe_sgd_opts {
  double lr;           /* >= 0 */
  double momentum;     /* >= 0; 0: no buffer */
  double weight_decay; /* >= 0, L2 (added to the gradient, as torch.optim.SGD) */
} moe_sgd_opts;

/*
 * One SGD step (torch.optim.SGD, dampening 0, no Nesterov):
 *   d = g + weight_decay * w
 *   buf = momentum * buf + d  (buf starts at zero, so the first step is d)
 *   w -= lr * (momentum > 0 ? buf : d)
 * buf may be NULL only when momentum is 0; master as for AdamW.
 */
moe_status moe_sgd_step(moe_ctx *ctx, moe_tensor *param, const moe_tensor *grad,
                        moe_tensor *momentum_buf, moe_tensor *master, const moe_sgd_opts *o);

#ifdef __cplusplus
}
#endif
#endif /* MOE_OPTIM_H */
