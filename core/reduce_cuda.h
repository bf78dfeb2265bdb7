/*
 * reduce_cuda.h - CUDA entry points of the reductions, norms and losses
 * (private to core/reduce.c, core/norm.c, core/loss.c through core/rows.h,
 * and to their kernels: kernels/reduce.cu, softmax.cu, norm.cu, loss.cu over
 * kernels/rows.cuh).
 *
 * The core validates, allocates outputs (contiguous) and describes inputs;
 * the launchers in kernels/ only compute. All launches go on the
 * context's stream; errors come back through moe_error. Float math is in
 * float for f32/bf16/f16 and double for f64; integer sums, max and min in
 * int64.
 */
#ifndef MOE_REDUCE_CUDA_H
#define MOE_REDUCE_CUDA_H

#include "internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What a dim reduction computes (one state per output, combinable, so the
 * GPU can split a long reduction into segments and combine them in order). */
typedef enum moe_red_kind {
  MOE_RED_SUM = 0, /* sum */
  MOE_RED_MEAN,    /* sum / count */
  MOE_RED_MAX,     /* value and index (first of equal values; NaN wins) */
  MOE_RED_MIN,
  MOE_RED_NORM1,   /* sum |x| */
  MOE_RED_NORM2,   /* sqrt(sum x^2) */
  MOE_RED_NORMP,   /* (sum |x|^p)^(1/p) */
  MOE_RED_NORMINF, /* max |x| */
  MOE_RED_LSE,     /* log(sum exp(x)), online max-shifted */
  MOE_RED_VAR,     /* Welford: M2 / (count - correction) */
  MOE_RED_KIND_COUNT
} moe_red_kind;

/*
 * An input seen as (outer, inner): the kept dims (outer, row-major, the
 * output's order) and the reduced dims (inner, row-major) with the input's
 * element strides. Size-1 dims are dropped and neighbouring dims merged
 * where strides allow, so the row-major index over inner is the flat index
 * over the reduced dims (what argmax over several dims reports).
 */
typedef struct moe_red_geom {
  const void *data;                 /* input element 0 */
  moe_dtype dtype;
  int ondim;                        /* kept dims, outermost first */
  int64_t oshape[MOE_MAX_DIMS];     /* (ondim) */
  int64_t ostride[MOE_MAX_DIMS];    /* (ondim) input strides */
  int indim;                        /* reduced dims, outermost first */
  int64_t ishape[MOE_MAX_DIMS];     /* (indim) */
  int64_t istride[MOE_MAX_DIMS];    /* (indim) input strides */
  int64_t outer, inner;             /* products of oshape and ishape */
} moe_red_geom;

/* out (outer) contiguous, dtype odt = g's dtype, or i64 for integer sums;
 * idx (outer) contiguous i64 or NULL (MAX/MIN only). arg: p for NORMP,
 * correction for VAR. inner >= 1. */
moe_status moe_cuda_reduce(moe_ctx *ctx, int device, moe_red_kind kind, const moe_red_geom *g,
                           double arg, void *out, moe_dtype odt, int64_t *idx);

/* Backward of a dim reduction (not MAX/MIN), elementwise over the input's
 * shape: gin = F(x, g, y, aux) where g and y are the output gradient and
 * the forward output broadcast to the input's shape (stride 0 on reduced
 * dims); gin and x are views of that shape; views F does not use may have
 * no data. aux: the mean for VAR (broadcast). scale: 1/count for MEAN,
 * 2/(count - correction) for VAR, 1 otherwise; arg: p for NORMP. */
moe_status moe_cuda_reduce_backward(moe_ctx *ctx, int device, moe_red_kind kind,
                                    const moe_kview *gin, const moe_kview *x, const moe_kview *g,
                                    const moe_kview *y, const moe_kview *aux, double scale,
                                    double arg);

/* Gradient of max / min: gin (outer * nd * post) contiguous, already zero;
 * gin[(o / post * nd + idx[o]) * post + o % post] = g[o] for o < outer (g
 * contiguous, gin's dtype). */
moe_status moe_cuda_red_scatter(moe_ctx *ctx, int device, void *gin, const void *g,
                                const int64_t *idx, moe_dtype dt, int64_t outer, int64_t nd,
                                int64_t post);

/* The row kernels below take contiguous rows (rows, n): the core moves the
 * dim to the end and copies when needed. */

/* y = softmax(x) or log_softmax(x) over the last dim of contiguous (rows, n). */
moe_status moe_cuda_softmax(moe_ctx *ctx, int device, bool log, const void *x, void *y,
                            moe_dtype dt, int64_t rows, int64_t n);
/* gx = y * (g - sum(g*y))  or  g - exp(y) * sum(g); all contiguous (rows, n). */
moe_status moe_cuda_softmax_backward(moe_ctx *ctx, int device, bool log, const void *y,
                                     const void *g, void *gx, moe_dtype dt, int64_t rows,
                                     int64_t n);
/* Inclusive (reverse: suffix) sums along the last dim of contiguous (rows, n). */
moe_status moe_cuda_cumsum(moe_ctx *ctx, int device, bool reverse, const void *x, void *y,
                           moe_dtype dt, int64_t rows, int64_t n);

/* layer_norm (rms: rms_norm) over the last dim of contiguous x (rows, n):
 * y (rows, n); w, b (n) or NULL; mean (rows) f32 (NULL for rms), rstd
 * (rows) f32. */
moe_status moe_cuda_norm_forward(moe_ctx *ctx, int device, bool rms, const void *x,
                                 const void *w, const void *b, void *y, float *mean, float *rstd,
                                 moe_dtype dt, int64_t rows, int64_t n, double eps);
/* gx (rows, n) or NULL; gw, gb (n) or NULL (written, not accumulated). */
moe_status moe_cuda_norm_backward(moe_ctx *ctx, int device, bool rms, const void *x,
                                  const void *w, const void *g, const float *mean,
                                  const float *rstd, void *gx, void *gw, void *gb, moe_dtype dt,
                                  int64_t rows, int64_t n);

/* Fused cross entropy over contiguous logits (rows, n), target (rows) i64.
 * loss (rows) f32: per-row loss, 0 for ignored rows, NaN for a target out of
 * range (also reported at the next synchronisation, kerr.h); lse (rows) f32
 * saved for backward. */
moe_status moe_cuda_cross_entropy(moe_ctx *ctx, int device, const void *logits,
                                  const int64_t *target, float *loss, float *lse, moe_dtype dt,
                                  int64_t rows, int64_t n, int64_t ignore_index, double smoothing);
/* Reduces per-row losses to out (a one-element tensor of dtype odt):
 * mean over non-ignored rows (count written to *count, f32 scalar on the
 * device) or sum. */
moe_status moe_cuda_cross_entropy_reduce(moe_ctx *ctx, int device, const float *loss,
                                         const int64_t *target, int64_t rows,
                                         int64_t ignore_index, bool mean, void *out,
                                         moe_dtype odt, float *count);
/* gx (rows, n) = gscale_r * (softmax - (1-s) onehot - s/n), 0 on ignored rows,
 * where gscale_r = g[0] / count[0] (mean), g[0] (sum) or g[r] (none: g has
 * rows elements); g of dtype gdt. */
moe_status moe_cuda_cross_entropy_backward(moe_ctx *ctx, int device, const void *logits,
                                           const int64_t *target, const float *lse,
                                           const void *g, moe_dtype gdt, bool per_row,
                                           const float *count, void *gx, moe_dtype dt,
                                           int64_t rows, int64_t n, int64_t ignore_index,
                                           double smoothing);

#ifdef __cplusplus
}
#endif
#endif /* MOE_REDUCE_CUDA_H */
