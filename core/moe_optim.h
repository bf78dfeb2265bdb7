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
