/*
 * blocksparse_cuda.h - CUDA entry points of the block-sparse family
 * (kernels/blocksparse.cu), called by core/blocksparse.c (core/nocuda.c
 * stubs them without CUDA). Private to core/.
 *
 * All pointers are device pointers to contiguous, 16-byte aligned arrays of
 * one dtype dt (MOE_F32 or MOE_BF16; core/blocksparse.c validated shapes,
 * dtypes and devices, b = 128, and K % 8 == 0 for bf16). Index arrays are the
 * plan's i64 topology (moe_routing.h). Launches go on the context's stream;
 * nothing synchronises with the host. Every output element is written by one
 * thread summing in a fixed order (no atomics): results are deterministic.
 *
 * Shapes (b = 128, F column blocks per expert, N = F * b, EL local experts,
 * Rb = R / b row blocks, nnz = Rb * F blocks):
 *   sdd:    x (R, K), w (EL, K, N) or (EL, N, K) when trans_w -> s (nnz, b, b)
 *   dsd:    s (nnz, b, b), w (EL, N, K) or (EL, K, N) when trans_w -> out (R, K)
 *   dsd_t:  s (nnz, b, b), y (R, K) -> out (EL, N, K)
 *   dds:    x (R, K), s (nnz, b, b) -> out (EL, K, N)
 */
#ifndef MOE_BLOCKSPARSE_CUDA_H
#define MOE_BLOCKSPARSE_CUDA_H

#include "internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The topology a kernel reads (device arrays of the plan, i64). */
typedef struct moe_bs_topo {
  int64_t b, F, EL, Rb, nnz;
  const int64_t *row_indices;      /* (nnz) */
  const int64_t *column_indices;   /* (nnz) */
  const int64_t *offsets_t;        /* (EL * F + 1) */
  const int64_t *column_indices_t; /* (nnz) */
  const int64_t *block_offsets_t;  /* (nnz) */
  /* The gather of the dense R-row operand (x of sdd and dds, y of dsd_t), or
   * NULL: that operand is then (T, K) in token order, and row r of the
   * product reads its row gather_src[r] / gather_k (the plan's src: the
   * row's assignment t * k + j), zeros where gather_src[r] < 0 (padding).
   * Only the sm_90a bf16 kernel gathers (moe_cuda_bsmm_wgmma). */
  const int64_t *gather_src;       /* (R) or NULL */
  int64_t gather_k;
  /* The scatter of a DSD output (and GG's, moe_wg_scatter; the sm_90a bf16
   * kernel only), or NULL: row
   * r of the product goes to row scatter_dst[r] of out (none where < 0) as
   * bf16(0 + s * v), v the row's bf16 value and s = scatter_scale[row]
   * (1 where scatter_scale is NULL): what moe_routing_combine makes of a
   * token's one assignment. */
  const int64_t *scatter_dst; /* (R) or NULL */
  const float *scatter_scale; /* (rows of out) or NULL */
} moe_bs_topo;

moe_status moe_cuda_bsmm_sdd(moe_ctx *ctx, int device, moe_dtype dt, const moe_bs_topo *tp,
                             const void *x, const void *w, int64_t K, bool trans_w, void *out);
moe_status moe_cuda_bsmm_dsd(moe_ctx *ctx, int device, moe_dtype dt, const moe_bs_topo *tp,
                             const void *s, const void *w, int64_t K, bool trans_w, void *out);
moe_status moe_cuda_bsmm_dsd_t(moe_ctx *ctx, int device, moe_dtype dt, const moe_bs_topo *tp,
                               const void *s, const void *y, int64_t K, void *out);
moe_status moe_cuda_bsmm_dds(moe_ctx *ctx, int device, moe_dtype dt, const moe_bs_topo *tp,
                             const void *x, const void *s, int64_t K, void *out);
/* out = s @ w + s2 @ w2 (both DSD over tp, as moe_cuda_bsmm_dsd with the
 * same trans_w), summed in f32 by one kernel and rounded once: the sm_90a
 * kernel only (moe_cuda_bsmm_wgmma tells). */
moe_status moe_cuda_bsmm_dsd2(moe_ctx *ctx, int device, moe_dtype dt, const moe_bs_topo *tp,
                              const void *s, const void *w, const void *s2, const void *w2,
                              int64_t K, bool trans_w, void *out);
/* h1 = x @ w1, h3 = x @ w3 (SDD, w untransposed) and a = act(h1) * h3 from
 * their bf16 values, in one launch of the sm_90a kernel (bf16 only). */
moe_status moe_cuda_bsmm_sdd_glu(moe_ctx *ctx, int device, moe_dtype dt, const moe_bs_topo *tp,
                                 const void *x, const void *w1, const void *w3, int64_t K, int act,
                                 void *h1, void *h3, void *a);
/* The grouped GEMM on the same sm_90a kernel, bf16, group offsets read on
 * the device (offs: G + 1 int64 in device memory; no host copy), for
 * core/grouped.c's device-offset functions. x (R, K), w (G, K, N) or with
 * trans_w (G, N, K) -> out (R, N), rows outside every group zero;
 * a (R, K), b (R, N) -> out (G, K, N) = per group a^T b (zero for an empty
 * group). Offsets out of order or past R are clamped, never followed
 * outside the tensors. MOE_ERR_NOT_SUPPORTED where the kernel cannot run
 * (moe_cuda_wg_grouped false, K or N not a multiple of 8, unaligned
 * tensors, 4094 groups or more). */
moe_status moe_cuda_wg_grouped_mm(moe_ctx *ctx, int device, const void *x, const void *w,
                                  const int64_t *offs, int64_t G, int64_t R, int64_t K, int64_t N,
                                  bool trans_w, void *out);
moe_status moe_cuda_wg_grouped_wgrad(moe_ctx *ctx, int device, const void *a, const void *b,
                                     const int64_t *offs, int64_t G, int64_t R, int64_t K,
                                     int64_t N, void *out);
/* out = x @ w + x2 @ w2 per group (the same sizes), summed in one kernel's
 * accumulators. */
moe_status moe_cuda_wg_grouped_mm2(moe_ctx *ctx, int device, const void *x, const void *w,
                                   const void *x2, const void *w2, const int64_t *offs, int64_t G,
                                   int64_t R, int64_t K, int64_t N, bool trans_w, void *out);
/* The grouped products with the R-row operand gathered from a token-order
 * tensor, so no permuted copy is made: row r of that operand is row
 * src[r] / k of a (T, width) tensor, zeros where src[r] < 0 (src: R int64
 * on the device, a routing plan's src). mm_gather: x is (T, K) (and x2, w2
 * must be NULL with a gather; gt NULL: moe_cuda_wg_grouped_mm2);
 * wgrad_gather: b_rows false gathers a ((T, K)), true b ((T, N)). */
typedef struct moe_wg_gather {
  const int64_t *src;
  int64_t k;
  bool b_rows;
} moe_wg_gather;
/* And mm_gather's output rows scattered (dst NULL: none): row r of the
 * product to row dst[r] of out, scaled as moe_bs_topo's scatter. */
typedef struct moe_wg_scatter {
  const int64_t *dst;
  const float *scale;
} moe_wg_scatter;
moe_status moe_cuda_wg_grouped_mm_gather(moe_ctx *ctx, int device, const void *x, const void *w,
                                         const void *x2, const void *w2, const int64_t *offs,
                                         const moe_wg_gather *gt, const moe_wg_scatter *sc, int64_t G,
                                         int64_t R, int64_t K, int64_t N, bool trans_w, void *out);
moe_status moe_cuda_wg_grouped_wgrad_gather(moe_ctx *ctx, int device, const void *a, const void *b,
                                            const int64_t *offs, const moe_wg_gather *gt, int64_t G,
                                            int64_t R, int64_t K, int64_t N, void *out);
/* The GLU experts' products with their elementwise pass in the kernel's
 * epilogue (moe_cuda_wg_grouped_mm's kernel and conditions, bf16; act a
 * moe_glu_activation). glu: h1 = x @ w1, h3 = x @ w3 (w (G, K, N)) and
 * a = act(h1) * h3 from their rounded values, each (R, N): the bits of
 * two products and moe_cuda_experts_glu_fwd. glu_bwd: dA0 = dy @ w2^T (w2
 * (G, N, K), dy (R, K)) and over it moe_cuda_experts_glu_bwd's pass (h1,
 * h3 (R, N); g_rows R floats or NULL: ones): dh1 (in place of dA0), dh3 and
 * ga (NULL: not made) with its bits; dgate_rows (R floats, NULL: not made)
 * summed per row over 256-column tiles, then over the tiles in order.
 * dh3 may be h3 and ga h1. */
moe_status moe_cuda_wg_grouped_glu(moe_ctx *ctx, int device, const void *x, const void *w1,
                                   const void *w3, const int64_t *offs, int64_t G, int64_t R,
                                   int64_t K, int64_t N, int act, void *h1, void *h3, void *a);
moe_status moe_cuda_wg_grouped_glu_bwd(moe_ctx *ctx, int device, const void *dy, const void *w2,
                                       const int64_t *offs, int64_t G, int64_t R, int64_t K,
                                       int64_t N, int act, const void *h1, const void *h3,
                                       const float *g_rows, void *dh1, void *dh3, void *ga,
                                       float *dgate_rows);
bool moe_cuda_wg_grouped(moe_ctx *ctx, int device);
/* Whether the sm_90a wgmma kernel runs for dtype dt on device (bf16,
 * MOE_BSMM_TILE=wg, compute capability 9.x): the products can then gather
 * (topo.gather_src) and moe_cuda_bsmm_dsd2 runs. */
bool moe_cuda_bsmm_wgmma(moe_ctx *ctx, int device, moe_dtype dt);
/* dense (R, EL * N) <-> s (nnz, b, b); to_dense writes zeros outside blocks. */
moe_status moe_cuda_bsmm_to_dense(moe_ctx *ctx, int device, moe_dtype dt, const moe_bs_topo *tp,
                                  const void *s, void *dense);
moe_status moe_cuda_bsmm_from_dense(moe_ctx *ctx, int device, moe_dtype dt,
                                    const moe_bs_topo *tp, const void *dense, void *s);

#ifdef __cplusplus
}
#endif
#endif /* MOE_BLOCKSPARSE_CUDA_H */
