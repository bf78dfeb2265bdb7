/*
 * experts_cuda.h - CUDA entry points of the experts family (kernels/experts.cu),
 * called by core/experts.c (core/nocuda.c stubs them without CUDA). Private to
 * core/.
 *
 * The fused elementwise work of the GLU expert MLP: its activation, its
 * backward (gate scaling, gate gradient, activation derivative in one pass
 * over the hidden), parallel_linear's gate pass, and the index gathers that
 * move gates between assignment order (T * k) and buffer-row order (R). Launches go on the context's
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
 *   dgate_rows[r] = sum_c dA0 * a            (a = act(h1) * h3, recomputed and
 *                                             rounded to dt as the forward stored it)
 *   da = g * dA0 (g = g_rows[r], 1 when g_rows is NULL)
 *   dh1 = da * h3 * act'(h1), written over dA0
 *   dh3 = da * act(h1)
 *   ga = g * a                               (when ga != NULL)
 * Hidden tensors of dtype dt; g_rows and dgate_rows (R) f32 (nullable).
 */
moe_status moe_cuda_experts_glu_bwd(moe_ctx *ctx, int device, moe_dtype dt, int act, int64_t R,
                                    int64_t f, int64_t bs, void *dA0, const void *h1,
                                    const void *h3, const float *g_rows, void *dh3, void *ga,
                                    float *dgate_rows);

/* The GLU's pre-activations h1 and h3 kept quantized for backward
 * (core/moe_quantize.h's format): the hidden's elements in memory order
 * seen as (rows, cols), groups of G along cols (G the effective group,
 * moe_qz_group), codes v (rows, row_bytes) i8 (8 bits) or u8 (4 bits),
 * scales s (rows, ngroups) f32. */
typedef struct moe_ex_qhidden {
  int bits;
  int64_t cols, G;
  const void *v1, *v3;
  const float *s1, *s3;
} moe_ex_qhidden;

/* a = act(h1) * h3 (rows * qh->cols elements, contiguous) and h1, h3
 * quantized into qh's codes and scales (written through the const
 * pointers: the caller owns them) in one pass; stochastic rounding draws
 * (seed, call1) for h1 and (seed, call3) for h3, as two moe_quantize calls
 * would. The results are the bits of moe_cuda_experts_glu_fwd followed by
 * two moe_cuda_quantize calls. *done = false (and nothing launched) when
 * the fast path does not apply (dtype not f32 / bf16, cols or G not a
 * multiple of 8, misaligned buffers, groups wider than 32768). */
moe_status moe_cuda_experts_glu_fwd_quant(moe_ctx *ctx, int device, moe_dtype dt, int act,
                                          int64_t rows, const moe_ex_qhidden *qh, bool stochastic,
                                          uint64_t seed, uint64_t call1, uint64_t call3,
                                          const void *h1, const void *h3, void *a, bool *done);

/* moe_cuda_experts_glu_bwd with h1 and h3 read from qh (dequantized in
 * registers and rounded to dt, the values moe_dequantize would give) and
 * no saved a (recomputed). */
moe_status moe_cuda_experts_glu_bwd_quant(moe_ctx *ctx, int device, moe_dtype dt, int act,
                                          int64_t R, int64_t f, int64_t bs, void *dA0,
                                          const moe_ex_qhidden *qh, const float *g_rows,
                                          void *dh3, void *ga, float *dgate_rows);

/*
 * Backward of out_rows = g_rows * (xs W) at the gate, given dX0 = dout_rows
 * W^T (ungated), per row r of xs (R rows, K cols, layout bs):
 *   dgate_rows[r] = sum_c dX0 * xs            (when dgate_rows != NULL)
 *   dX0 = g * dX0, in place                   (g = g_rows[r], 1 when NULL;
 *                                              dX0 may be NULL: no dot, no dX0)
 *   gxs = g * xs                              (when gxs != NULL)
 *   ys = g * ys, in place                     (when ys != NULL: dense (R, N))
 * xs is the tensor xs, or with src (bs 0 only) row src[r] / k of x (T, K)
 * (zeros where src[r] < 0). Tensors of dtype dt; g_rows, dgate_rows f32.
 */
moe_status moe_cuda_experts_gate_rows(moe_ctx *ctx, int device, moe_dtype dt, int64_t R, int64_t K,
                                      int64_t bs, void *dX0, const void *xs, const int64_t *src,
                                      int64_t k, const float *g_rows, void *gxs, void *ys, int64_t N,
                                      float *dgate_rows);

/* out[i] = idx[i] >= 0 ? in[idx[i]] : 0 for i < n; in of dtype in_dt, out of
 * out_dt (f32, f64, bf16), idx i64, all contiguous. */
moe_status moe_cuda_experts_take(moe_ctx *ctx, int device, int64_t n, const int64_t *idx,
                                 const void *in, moe_dtype in_dt, void *out, moe_dtype out_dt);

#ifdef __cplusplus
}
#endif
#endif /* MOE_EXPERTS_CUDA_H */
