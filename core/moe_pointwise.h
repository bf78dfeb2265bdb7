/*
 * moe_pointwise.h - pointwise math, comparisons, activations and dropout (core/pointwise.c, kernels/pointwise.cu).
 * Included by moe.h. Conventions of moe.h hold: ctx first, outputs last,
 * 0-based dims, a new reference per returned tensor, differentiable ops
 * record autograd nodes (moe_autograd.h).
 */
#ifndef MOE_POINTWISE_H
#define MOE_POINTWISE_H

#ifdef __cplusplus
extern "C" {
#endif

#ifdef __cplusplus
}
#endif
#endif /* MOE_POINTWISE_H */
