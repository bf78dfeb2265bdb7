/*
 * moe_quantize.h - quantization of tensors to 8 or 4 bits with per-group
 * absmax scales, and the saved-tensor hooks that keep activations saved for
 * backward in that packed form (implemented in core/quantize.c,
 * CUDA kernels in kernels/quantize.cu; docs/QUANTIZE.md).
 *
 * Layout. x of any shape is seen as (rows, cols) with cols = its last dim
 * (a 0-dim tensor is (1, 1)). The last dim is cut into groups of G elements
 * (G = group_size; 0 means the whole row: one scale per row); the last group
 * of a row may be shorter (ragged: cols need not be a multiple of G).
 *   scale[r, g] = absmax(x[r, group g]) / qmax      (f32; qmax = 127 or 7)
 *   q = clamp(round(x * inv), -qmax, qmax)           (0 where scale is 0)
 *   x' = q * scale                                   (rounded to x's dtype)
 * with inv = 1 / scale computed once per group (x / scale itself for a
 * subnormal scale, whose reciprocal overflows): x * inv is within 1.5 ulp
 * of x / scale, so codes differ from a per-element division only next to a
 * rounding tie, and each element costs a multiplication, not a division.
 * round is to nearest even, or stochastic: floor(x * inv + u) with u
 * uniform in [0, 1) from Philox (seed and call drawn from the context's RNG,
 * one call per quantize, counter = the element's row-major index), which
 * is unbiased: E[x'] = x. The arithmetic is f32 without fused multiply-add
 * on both devices, so CUDA and CPU give the same bits for the same input
 * (and the same RNG state). Error bound (deterministic): |x - x'| <=
 * scale / 2 = group absmax / 254 (8 bits) or / 14 (4 bits), plus the
 * rounding of x' to x's dtype. A NaN in a group makes its scale NaN and the
 * whole group dequantizes to NaN (an infinity likewise): non-finite values
 * propagate instead of being silently clamped.
 *
 * Storage: 8 bits: values (rows, cols) i8. 4 bits: values (rows, (cols + 1)
 * / 2) u8, element c of a row in byte c / 2, low nibble for even c, as the
 * nibble q + 8 (1..15; an odd row's unused high nibble is 0); G must be even
 * so that no byte straddles two groups. scales (rows, ngroups) f32 with
 * ngroups = ceil(cols / G). Devices: CPU and CUDA; dtypes f32, bf16, f16
 * (f64 also on the CPU, for checks).
 */
#ifndef MOE_QUANTIZE_H
#define MOE_QUANTIZE_H

#include "moe.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct moe_quant_opts {
  int bits;           /* 8 or 4 */
  int64_t group_size; /* elements per scale along the last dim; 0 = whole row */
  bool stochastic;    /* stochastic rounding (unbiased) instead of nearest */
} moe_quant_opts;

/* bits 8: one scale per row; bits 4: groups of 128; deterministic. */
moe_quant_opts moe_quant_opts_default(int bits);

/* A quantized tensor: what x was, and the two tensors that encode it. */
typedef struct moe_qtensor {
  int bits;
  int64_t group_size;           /* as given (0 = whole row) */
  moe_dtype dtype;              /* x's dtype, restored by dequantize */
  int ndim;
  int64_t shape[MOE_MAX_DIMS];  /* (ndim) x's shape */
  moe_tensor *values;           /* (rows, cols) i8 or (rows, (cols + 1) / 2) u8; owned */
  moe_tensor *scales;           /* (rows, ngroups) f32; owned */
} moe_qtensor;

/* Quantizes x (any strides) into *out (which the caller clears with
 * moe_qtensor_clear). On failure *out holds nothing. */
moe_status moe_quantize(moe_ctx *ctx, moe_tensor *x, const moe_quant_opts *opts,
                        moe_qtensor *out);
/* A new contiguous tensor of q's dtype, shape and device. Checks that
 * q's fields agree with each other (a hand-built q gets a clear error). */
moe_status moe_dequantize(moe_ctx *ctx, const moe_qtensor *q, moe_tensor **out);
/* Releases q's tensors; q becomes empty. */
void moe_qtensor_clear(moe_qtensor *q);
/* Bytes of q's storages (values and scales). */
int64_t moe_qtensor_nbytes(const moe_qtensor *q);

/* Options of the saved-tensor hooks. */
typedef struct moe_quant_hooks_opts {
  moe_quant_opts quant;
  int64_t min_numel;        /* smaller float tensors are kept as they are */
  int n_keep;               /* tensors (e.g. parameters) that are never */
  moe_tensor *const *keep;  /* quantized: saved tensors sharing their storage */
} moe_quant_hooks_opts;

/* quant = moe_quant_opts_default(bits), min_numel 1024, nothing kept. */
moe_quant_hooks_opts moe_quant_hooks_opts_default(int bits);

/* Pushes saved-tensor hooks (moe_autograd.h) that store every saved tensor
 * of dtype f32, bf16 or f16 with at least min_numel elements, whose storage
 * is not one of keep's, quantized as opts->quant says; other tensors (f64,
 * integers, small ones, kept ones) are saved unchanged. Backward unpacks
 * them with moe_dequantize. Pop with moe_saved_hooks_pop. The keep storages
 * are retained while nodes packed by these hooks live. */
moe_status moe_quantize_hooks_push(moe_ctx *ctx, const moe_quant_hooks_opts *opts);

#ifdef __cplusplus
}
#endif
#endif /* MOE_QUANTIZE_H */
