/*
 * moe_matmul.h - matmul, bmm, linear (core/matmul.c on OpenBLAS, kernels/matmul.cu on cuBLAS/cuBLASLt).
 * Included by moe.h. Conventions of moe.h hold: ctx first, outputs last,
 * 0-based dims, a new reference per returned tensor, differentiable ops
 * record autograd nodes (moe_autograd.h).
 */
#ifndef MOE_MATMUL_H
#define MOE_MATMUL_H

#ifdef __cplusplus
extern "C" {
#endif

#ifdef __cplusplus
}
#endif
#endif /* MOE_MATMUL_H */
