/*
 * quantize_cuda.h - the element math of the quantize family, shared verbatim
 * by the CPU reference (core/quantize.c) and the CUDA kernels
 * (kernels/quantize.cu) so both give the same bits, and the CUDA entry
 * points, called by core/quantize.c for tensors on a GPU and declared in
 * every build (core/nocuda.c has the stubs of a build without CUDA).
 * Private to core/ and kernels/.
 *
 * The f32 operations are written through MOE_QZ_DIV / MOE_QZ_ADD /
 * MOE_QZ_MUL, which are __fdiv_rn / __fadd_rn / __fmul_rn on the GPU (no
 * fused multiply-add, IEEE division) and plain operators on the CPU (built
 * with -ffp-contract=off). Layout and rounding rules: core/moe_quantize.h.
 */
#ifndef MOE_QUANTIZE_CUDA_H
#define MOE_QUANTIZE_CUDA_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>

#include "internal.h"
#include "philox.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__CUDA_ARCH__)
#define MOE_QZ_DIV(a, b) __fdiv_rn((a), (b))
#define MOE_QZ_ADD(a, b) __fadd_rn((a), (b))
#define MOE_QZ_MUL(a, b) __fmul_rn((a), (b))
#else
#define MOE_QZ_DIV(a, b) ((a) / (b))
#define MOE_QZ_ADD(a, b) ((a) + (b))
#define MOE_QZ_MUL(a, b) ((a) * (b))
#endif

/* Running absmax that keeps a NaN once seen. */
MOE_HD float moe_qz_absmax(float m, float x) {
  float a = fabsf(x);
  return (a > m || a != a) ? a : m;
}

/* The effective group of a row of cols elements: group_size, 0 meaning the
 * whole row, made even for 4 bits (no byte straddles two groups). */
MOE_HD int64_t moe_qz_group(int64_t cols, int bits, int64_t group_size) {
  int64_t G = group_size > 0 ? group_size : (cols > 0 ? cols : 1);
  if (bits == 4 && G % 2) G++;
  return G;
}

/* The scale of a group from its absmax (0, NaN or inf propagate). */
MOE_HD float moe_qz_scale(float absmax, int qmax) { return MOE_QZ_DIV(absmax, (float)qmax); }

/* The reciprocal of a group's scale, computed once per group so that each
 * element costs a multiplication instead of an IEEE division: 0 when the
 * scale is 0 or not finite (codes 0), and 0 too when 1 / scale overflows (a
 * subnormal scale: moe_qz_code then divides). */
MOE_HD float moe_qz_inv(float scale) {
  if (!(scale > 0.0f) || scale == INFINITY) return 0.0f;
  float inv = MOE_QZ_DIV(1.0f, scale);
  return inv == INFINITY ? 0.0f : inv;
}

/* The integer code of x in [-qmax, qmax]: round(x * inv) with inv =
 * moe_qz_inv(scale) (x / scale where inv is 0 for a subnormal scale); u in
 * [0, 1) for stochastic rounding. 0 when the scale is 0 or not finite
 * (dequantize then gives 0, or NaN through the scale). x * inv is within
 * 1.5 ulp of x / scale: the codes differ from a division's only where
 * x / scale is within that of a rounding tie. */
MOE_HD int moe_qz_code(float x, float scale, float inv, int qmax, bool stochastic, float u) {
  if (!(scale > 0.0f) || scale == INFINITY) return 0;
  float v = inv > 0.0f ? MOE_QZ_MUL(x, inv) : MOE_QZ_DIV(x, scale);
  v = stochastic ? floorf(MOE_QZ_ADD(v, u)) : rintf(v);
  float q = (float)qmax;
  v = v < -q ? -q : (v > q ? q : v);
  return (int)v;
}

/* u for element i (row-major) of a stochastic quantize. */
MOE_HD float moe_qz_uniform(uint64_t seed, uint64_t call, uint64_t i) {
  return (float)moe_philox_uniform24(seed, call, i);
}

MOE_HD float moe_qz_value(int q, float scale) { return MOE_QZ_MUL((float)q, scale); }

/* x (rows, cols) of dtype dt (f32, bf16, f16), row r at x + r * ld (ld >=
 * cols, elements of a row contiguous) -> values (i8
 * (rows, cols) for bits 8; u8 (rows, (cols + 1) / 2) for bits 4) and scales
 * (rows, ceil(cols / G)) f32. G > 0 (even for bits 4). Device pointers. */
moe_status moe_cuda_quantize(moe_ctx *ctx, int device, moe_dtype dt, const void *x, int64_t ld,
                             int64_t rows, int64_t cols, int bits, int64_t G, bool stochastic, uint64_t seed,
                             uint64_t call, void *values, float *scales);

/* The inverse: out (rows, cols) contiguous of dtype dt. */
moe_status moe_cuda_dequantize(moe_ctx *ctx, int device, moe_dtype dt, const void *values,
                               const float *scales, int64_t rows, int64_t cols, int bits,
                               int64_t G, void *out);

#ifdef __cplusplus
}
#endif
#endif /* MOE_QUANTIZE_CUDA_H */
