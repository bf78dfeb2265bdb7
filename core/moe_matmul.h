/*
 * moe_matmul.h - matmul, bmm, linear (core/matmul.c on OpenBLAS, kernels/matmul.cu on cuBLAS/cuBLASLt).
 * Included by moe.h. Conventions of moe.h hold: ctx first, outputs last,
 * 0-based dims, a new reference per returned tensor, differentiable ops
 * record autograd nodes (moe_autograd.h).
 *
 * dtypes: f32, f64, bf16, f16 on both devices; both operands (and the bias)
 * must have the same dtype and device, other dtypes give MOE_ERR_DTYPE.
 * CPU: f32/f64 through cblas_sgemm/dgemm, bf16/f16 converted to f32, one
 * sgemm, rounded back. CUDA: cuBLASLt, 16-bit inputs with f32 accumulation
 * and 16-bit output; f32 in full f32 precision unless moe_matmul_set_tf32.
 * The output is always a new contiguous tensor. Strided inputs are used in
 * place when each matrix has a unit stride in one of its two dims (a
 * transposed view becomes a transposed GEMM); any other layout is copied to
 * a contiguous temporary first.
 */
#ifndef MOE_MATMUL_H
#define MOE_MATMUL_H

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Matrix product with PyTorch's torch.matmul semantics:
 *   (K) @ (K)              -> ()            dot product
 *   (M, K) @ (K)           -> (M)
 *   (K) @ (K, N)           -> (N)
 *   (M, K) @ (K, N)        -> (M, N)
 *   (..., M, K) @ (..., K, N) -> (..., M, N): batch dims broadcast (NumPy);
 *   a 1-D operand takes part as a matrix (1, K) or (K, 1) whose added dim is
 *   removed from the result.
 * Errors: MOE_ERR_SHAPE ("matmul: shapes [4, 7] and [5, 3] cannot be
 * multiplied (7 != 5)"), 0-d operands, batch dims that do not broadcast;
 * MOE_ERR_DTYPE, MOE_ERR_DEVICE. Differentiable in both operands.
 */
moe_status moe_matmul(moe_ctx *ctx, moe_tensor *a, moe_tensor *b, moe_tensor **out);

/* Batched product without broadcasting: a (B, M, K) @ b (B, K, N) -> (B, M, N).
 * Differentiable in both operands. */
moe_status moe_bmm(moe_ctx *ctx, moe_tensor *a, moe_tensor *b, moe_tensor **out);

/*
 * y = x W^T + bias, with x (..., in) (any number of leading dims, also none:
 * x (in) gives y (out)), W (out, in), bias (out) or NULL. On CUDA the bias is
 * added in the GEMM's epilogue. Differentiable in x, W and bias; the weight
 * gradient is one GEMM over the flattened leading dims of x.
 */
moe_status moe_linear(moe_ctx *ctx, moe_tensor *x, moe_tensor *w, moe_tensor *bias,
                      moe_tensor **out);

/* Whether f32 GEMMs on CUDA may use TF32 tensor cores (10-bit mantissa
 * inputs, f32 accumulation): off by default. Process-wide, like
 * torch.backends.cuda.matmul.allow_tf32. Returns the previous setting. */
bool moe_matmul_set_tf32(bool allow);
bool moe_matmul_tf32(void);

#ifdef __cplusplus
}
#endif
#endif /* MOE_MATMUL_H */
