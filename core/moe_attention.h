/*
 * moe_attention.h - causal scaled-dot-product attention (core/attention.c CPU reference, kernels/attention.cu fused kernels).
 * Included by moe.h. Conventions of moe.h hold: ctx first, outputs last,
 * 0-based dims, a new reference per returned tensor, differentiable ops
 * record autograd nodes (moe_autograd.h).
 */
#ifndef MOE_ATTENTION_H
#define MOE_ATTENTION_H

#ifdef __cplusplus
extern "C" {
#endif

#ifdef __cplusplus
}
#endif
#endif /* MOE_ATTENTION_H */
