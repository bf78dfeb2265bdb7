/*
 * optim_cuda.h - CUDA entry points of the optimiser family (kernels/optim.cu),
 * called by core/optim.c for parameters on a GPU; declared in every build
 * (core/nocuda.c has the stubs of a build without CUDA). Private to core/.
 *
 * Pointers are device pointers to n contiguous elements; core/optim.c has
 * validated dtypes, shapes and devices and precomputed the scalars (in the
 * state's precision) so that the kernel and the CPU loop do the same IEEE
 * operations. One launch on the context's stream; no host synchronisation.
 */
#ifndef MOE_OPTIM_CUDA_H
#define MOE_OPTIM_CUDA_H

#include "internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Scalars of one update, each rounded once to the state's precision. */
typedef struct moe_optim_scalars {
  double decay;     /* AdamW: 1 - lr * wd; SGD: wd */
  double beta1;     /* AdamW: beta1; SGD: momentum */
  double one_m_b1;  /* 1 - beta1 */
  double beta2;
  double one_m_b2;  /* 1 - beta2 */
  double step_size; /* AdamW: lr / (1 - beta1^step); SGD: lr */
  double sqrt_bc2;  /* sqrt(1 - beta2^step) */
  double eps;
} moe_optim_scalars;

/* param: dtype pdt (f32, f64, bf16, f16); grad: gdt (same set); m, v,
 * master (NULL allowed unless pdt is bf16/f16): f64 when pdt is f64, else f32. */
moe_status moe_cuda_adamw_step(moe_ctx *ctx, int device, int64_t n, void *param, moe_dtype pdt,
                               const void *grad, moe_dtype gdt, void *m, void *v, void *master,
                               const moe_optim_scalars *s);
/* One tensor of a multi-tensor launch (n contiguous elements). AdamW uses
 * every field; the norm reads grad/gdt; the scale rewrites param/pdt. */
typedef struct moe_optim_item {
  int64_t n;
  void *param;
  const void *grad;
  void *m, *v, *master; /* master NULL allowed */
  moe_dtype pdt, gdt;
  double decay; /* AdamW: 1 - lr * weight_decay, rounded to the state's precision */
} moe_optim_item;

/* Multi-tensor AdamW: s->decay is unused (each item has its own). grad_scale
 * and skip: device pointers to one f32 each, or NULL (moe_optim.h). */
moe_status moe_cuda_adamw_multi(moe_ctx *ctx, int device, const moe_optim_item *items, int64_t n,
                                const moe_optim_scalars *s, const float *grad_scale,
                                const float *skip);
/* Global norm of the items' grads into *norm (device f32); coef and
 * found_inf may be NULL. max_norm already rounded to f32. */
moe_status moe_cuda_grad_norm_multi(moe_ctx *ctx, int device, const moe_optim_item *items,
                                    int64_t n, float max_norm, float *norm, float *coef,
                                    float *found_inf);
/* items' param *= *scale in place. */
moe_status moe_cuda_scale_multi(moe_ctx *ctx, int device, const moe_optim_item *items, int64_t n,
                                const float *scale);

/* buf NULL when momentum is 0. */
moe_status moe_cuda_sgd_step(moe_ctx *ctx, int device, int64_t n, void *param, moe_dtype pdt,
                             const void *grad, moe_dtype gdt, void *buf, void *master,
                             const moe_optim_scalars *s);

#ifdef __cplusplus
}
#endif
#endif /* MOE_OPTIM_CUDA_H */
