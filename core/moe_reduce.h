/*
 * moe_reduce.h - reductions, softmax, cumsum, layer_norm, rms_norm, cross_entropy (core/reduce.c, kernels/reduce.cu); moe_sum itself is declared in moe.h.
 * Included by moe.h. Conventions of moe.h hold: ctx first, outputs last,
 * 0-based dims, a new reference per returned tensor, differentiable ops
 * record autograd nodes (moe_autograd.h).
 */
#ifndef MOE_REDUCE_H
#define MOE_REDUCE_H

#ifdef __cplusplus
extern "C" {
#endif

#ifdef __cplusplus
}
#endif
#endif /* MOE_REDUCE_H */
