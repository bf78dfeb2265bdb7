/*
 * moe_index.h - indexing, sorting, topk, joining, rotary embedding, multinomial (core/index.c, kernels/index.cu).
 * Included by moe.h. Conventions of moe.h hold: ctx first, outputs last,
 * 0-based dims, a new reference per returned tensor, differentiable ops
 * record autograd nodes (moe_autograd.h).
 */
#ifndef MOE_INDEX_H
#define MOE_INDEX_H

#ifdef __cplusplus
extern "C" {
#endif

#ifdef __cplusplus
}
#endif
#endif /* MOE_INDEX_H */
