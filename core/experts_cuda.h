/*
 * experts_cuda.h - CUDA entry points of the experts family (kernels/experts.cu),
 * called by core/experts.c inside #ifdef MOE_WITH_CUDA. Private to core/.
 *
 * The fused elementwise work of the GLU expert MLP: its activation, its
 * backward (gate scaling, gate gradient, activation derivative in one pass
 * over the hidden) and the index gathers that move gates between assignment
 * order (T * k) and buffer-row order (R). Launches go on the context's
 * stream; nothing synchronises with the host; no atomics (the per-row gate
 * gradient is a fixed-order block reduction). Index math is int64.
 *
 * Hidden layouts (bs): 0 is a dense (R, f) row-major matrix; bs > 0 is the
 * block-sparse values (nnz, bs, bs) of a padded plan with F = f / bs column
 * blocks per row block, row r's column c at
 * ((r / bs) * F + c / bs) * bs * bs + (r % bs) * bs + c % bs.
 */
#ifndef MOE_EXPERTS_CUDA_H
#define MOE_EXPERTS_CUDA_H

#include "internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* a[i] = act(h1[i]) * h3[i], n elements of dtype dt (f32 / bf16; f32 math).
 * act: the moe_glu_activation value. */
moe_status moe_cuda_experts_glu_fwd(moe_ctx *ctx, int device, moe_dtype dt, int act, int64_t n,
                                    const void *h1, const void *h3, void *a);

/*
 * Backward of out_rows = g_rows * ((act(h1) * h3) W2), given
 * dA0 = dout_rows W2^T (ungated), per row r of the hidden (R rows, f cols,
 * layout bs):
 *   dgate_rows[r] = sum_c dA0 * a            (a = act(h1) * h3; the saved a
 *                                             when a != NULL)
 *   da = g * dA0 (g = g_rows[r], 1 when g_rows is NULL)
 *   dh1 = da * h3 * act'(h1), written over dA0
 *   dh3 = da * act(h1)
 *   ga = g * a                               (when ga != NULL)
 * Hidden tensors of dtype dt; g_rows and dgate_rows (R) f32 (nullable).
 */
moe_status moe_cuda_experts_glu_bwd(moe_ctx *ctx, int device, moe_dtype dt, int act, int64_t R,
                                    int64_t f, int64_t bs, void *dA0, const void *h1,
                                    const void *h3, const void *a, const float *g_rows, void *dh3,
                                    void *ga, float *dgate_rows);

/* out[i] = idx[i] >= 0 ? in[idx[i]] : 0 for i < n; in of dtype in_dt, out of
 * out_dt (f32, f64, bf16), idx i64, all contiguous. */
moe_status moe_cuda_experts_take(moe_ctx *ctx, int device, int64_t n, const int64_t *idx,
                                 const void *in, moe_dtype in_dt, void *out, moe_dtype out_dt);

#ifdef __cplusplus
}
#endif
#endif /* MOE_EXPERTS_CUDA_H */
