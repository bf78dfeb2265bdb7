/*
 * grouped_cuda.h - the CUDA entry point of the grouped family (private to
 * core/grouped.c and kernels/grouped.cu).
 *
 * A grouped GEMM is handed over as a list of `count` independent products,
 * each a moe_gemm of matmul_cuda.h with batch 1 (row-major terms: c (m, n)
 * packed with ldc = n, a (m, k) and b (k, n) BLAS-compatible, possibly
 * stored transposed); core/grouped.c builds the list from the host offsets
 * and skips empty products. All products share one dtype.
 */
#ifndef MOE_GROUPED_CUDA_H
#define MOE_GROUPED_CUDA_H

#include "internal.h"
#include "matmul_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Runs the count products g[0..count) on `device` on the context's stream
 * with ONE cublasGemmGroupedBatchedEx_64 call (each product its own cuBLAS
 * group of size 1). f32 (full precision, or TF32 when g[0].tf32) and bf16
 * (f32 accumulation); count >= 1, every m, n, k >= 1, no bias. The device
 * pointer arrays are uploaded from a pageable host buffer with
 * cudaMemcpyAsync (the call returns once the buffer is staged, so the
 * buffer is freed on return) into a block of the caching allocator released
 * after the launch (later users of the block queue behind the GEMM on the
 * same stream). */
moe_status moe_cuda_gemm_grouped(moe_ctx *ctx, int device, const moe_gemm *g, int64_t count);

/* The same list with one cublasGemmEx_64 per product, largest first,
 * dealt round-robin over 4 side streams forked from the context's stream
 * (an event) and joined back (the context's stream waits on one event per
 * side stream). */
moe_status moe_cuda_gemm_streams(moe_ctx *ctx, int device, const moe_gemm *g, int64_t count);
#ifdef __cplusplus
}
#endif
#endif /* MOE_GROUPED_CUDA_H */
