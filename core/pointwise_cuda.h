/*
 * pointwise_cuda.h - what core/pointwise.c and kernels/pointwise.cu share
 * (private to the pointwise family):
 *   - the kernel op codes (moe_pw_kop) of the unary and binary math,
 *   - the per-element formulas, forward and backward, written once as
 *     inline functions compiled both by the C compiler (CPU reference) and by
 *     nvcc (device code), in float (f32/bf16/f16), double (f64) and int64
 *     (abs, clamp, maximum, minimum of integer tensors),
 *   - the CUDA entry points implemented in kernels/pointwise.cu (declared in
 *     every build; core/nocuda.c has the stubs of a build without CUDA).
 *
 * Both sides use the same formulas and the same libm-style calls (expf,
 * erff, tanhf, powf, ...); the CPU is built with -ffp-contract=off and nvcc
 * may fuse multiply-adds, so float results agree to a few ulp, not bit for
 * bit. Dropout masks are bit-identical (integer compare of Philox bits).
 *
 * Views handed to the entry points all have the output's shape (inputs are
 * broadcast with stride-0 dims); `out`/`gin` outputs are dense tensors the
 * core just allocated.
 */
#ifndef MOE_POINTWISE_CUDA_H
#define MOE_POINTWISE_CUDA_H

#include <math.h>
#include <stdint.h>

#include "internal.h"
#include "philox.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Kernel op codes. p0/p1 are the op's scalars. */
typedef enum moe_pw_kop {
  /* unary: y = f(x) */
  MOE_PW_EXP = 0,
  MOE_PW_LOG,
  MOE_PW_SQRT,
  MOE_PW_RSQRT,
  MOE_PW_ABS,
  MOE_PW_RELU,
  MOE_PW_GELU,      /* exact: 0.5 x (1 + erf(x / sqrt 2)) */
  MOE_PW_GELU_TANH, /* 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) */
  MOE_PW_SILU,      /* x sigmoid(x) */
  MOE_PW_SIGMOID,
  MOE_PW_TANH,
  MOE_PW_POW_SCALAR,  /* x ^ p0 */
  MOE_PW_RPOW_SCALAR, /* p0 ^ x */
  MOE_PW_CLAMP,       /* min(max(x, p0), p1); a NaN bound is absent */
  MOE_PW_UNARY_COUNT,
  /* binary: y = f(a, b) */
  MOE_PW_POW = MOE_PW_UNARY_COUNT,
  MOE_PW_MAXIMUM, /* NaN propagates */
  MOE_PW_MINIMUM,
  MOE_PW_KOP_COUNT
} moe_pw_kop;

#if defined(__CUDACC__)
#define MOE_PW_HD static __host__ __device__ __forceinline__
#else
#define MOE_PW_HD static inline
#endif

#define MOE_PW_SQRT1_2 0.70710678118654752440    /* 1 / sqrt(2) */
#define MOE_PW_INV_SQRT_2PI 0.39894228040143267794 /* 1 / sqrt(2 pi) */
#define MOE_PW_SQRT_2_PI 0.79788456080286535588  /* sqrt(2 / pi) */
#define MOE_PW_GELU_C 0.044715

/* ------------------------------------------------------------ float math */

MOE_PW_HD float moe_pw_sigmoid_f32(float x) { return 1.0f / (1.0f + expf(-x)); }

MOE_PW_HD float moe_pw_unary_f32(int op, float x, float p0, float p1) {
  switch (op) {
    case MOE_PW_EXP: return expf(x);
    case MOE_PW_LOG: return logf(x);
    case MOE_PW_SQRT: return sqrtf(x);
    case MOE_PW_RSQRT: return 1.0f / sqrtf(x);
    case MOE_PW_ABS: return fabsf(x);
    case MOE_PW_RELU: return x < 0.0f ? 0.0f : x; /* NaN stays NaN */
    case MOE_PW_GELU: return 0.5f * x * (1.0f + erff(x * (float)MOE_PW_SQRT1_2));
    case MOE_PW_GELU_TANH: {
      float u = (float)MOE_PW_SQRT_2_PI * (x + (float)MOE_PW_GELU_C * x * x * x);
      return 0.5f * x * (1.0f + tanhf(u));
    }
    case MOE_PW_SILU: return x / (1.0f + expf(-x));
    case MOE_PW_SIGMOID: return moe_pw_sigmoid_f32(x);
    case MOE_PW_TANH: return tanhf(x);
    case MOE_PW_POW_SCALAR: return powf(x, p0);
    case MOE_PW_RPOW_SCALAR: return powf(p0, x);
    default: { /* MOE_PW_CLAMP: comparisons with a NaN bound are false */
      float y = x < p0 ? p0 : x;
      return y > p1 ? p1 : y;
    }
  }
}

/* d/dx of the unary op, times g. */
MOE_PW_HD float moe_pw_unary_grad_f32(int op, float g, float x, float p0, float p1) {
  switch (op) {
    case MOE_PW_EXP: return g * expf(x);
    case MOE_PW_LOG: return g / x;
    case MOE_PW_SQRT: return g * 0.5f / sqrtf(x);
    case MOE_PW_RSQRT: {
      float r = 1.0f / sqrtf(x);
      return -0.5f * g * r * r * r;
    }
    case MOE_PW_ABS: return x > 0.0f ? g : x < 0.0f ? -g : 0.0f;
    case MOE_PW_RELU: return x > 0.0f ? g : 0.0f;
    case MOE_PW_GELU: {
      float cdf = 0.5f * (1.0f + erff(x * (float)MOE_PW_SQRT1_2));
      float pdf = (float)MOE_PW_INV_SQRT_2PI * expf(-0.5f * x * x);
      return g * (cdf + x * pdf);
    }
    case MOE_PW_GELU_TANH: {
      float k = (float)MOE_PW_SQRT_2_PI, c = (float)MOE_PW_GELU_C;
      float t = tanhf(k * (x + c * x * x * x));
      return g * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * k * (1.0f + 3.0f * c * x * x));
    }
    case MOE_PW_SILU: {
      float s = moe_pw_sigmoid_f32(x);
      return g * s * (1.0f + x * (1.0f - s));
    }
    case MOE_PW_SIGMOID: {
      float s = moe_pw_sigmoid_f32(x);
      return g * s * (1.0f - s);
    }
    case MOE_PW_TANH: {
      float t = tanhf(x);
      return g * (1.0f - t * t);
    }
    case MOE_PW_POW_SCALAR: return p0 == 0.0f ? 0.0f : g * p0 * powf(x, p0 - 1.0f);
    case MOE_PW_RPOW_SCALAR:
      return p0 == 0.0f && x >= 0.0f ? 0.0f : g * powf(p0, x) * logf(p0);
    default: /* MOE_PW_CLAMP: through where min <= x <= max (a NaN bound is absent) */
      return (p0 != p0 || x >= p0) && (p1 != p1 || x <= p1) ? g : 0.0f;
  }
}

MOE_PW_HD float moe_pw_binary_f32(int op, float a, float b) {
  switch (op) {
    case MOE_PW_POW: return powf(a, b);
    case MOE_PW_MAXIMUM: return a != a || b != b ? a + b : a > b ? a : b;
    default: return a != a || b != b ? a + b : a < b ? a : b; /* MOE_PW_MINIMUM */
  }
}

/* Gradients of the binary op times g: *ga wrt a, *gb wrt b. maximum and
 * minimum split g equally between a and b where they tie (as PyTorch). */
MOE_PW_HD void moe_pw_binary_grad_f32(int op, float g, float a, float b, float *ga, float *gb) {
  switch (op) {
    case MOE_PW_POW:
      *ga = b == 0.0f ? 0.0f : g * b * powf(a, b - 1.0f);
      *gb = a == 0.0f && b >= 0.0f ? 0.0f : g * powf(a, b) * logf(a);
      return;
    case MOE_PW_MAXIMUM:
      *ga = a < b ? 0.0f : a == b ? 0.5f * g : g;
      *gb = a > b ? 0.0f : a == b ? 0.5f * g : g;
      return;
    default: /* MOE_PW_MINIMUM */
      *ga = a > b ? 0.0f : a == b ? 0.5f * g : g;
      *gb = a < b ? 0.0f : a == b ? 0.5f * g : g;
      return;
  }
}

/* swiglu(gate, up) = silu(gate) * up and its gradients. */
MOE_PW_HD float moe_pw_swiglu_f32(float gate, float up) {
  return gate / (1.0f + expf(-gate)) * up;
}

MOE_PW_HD void moe_pw_swiglu_grad_f32(float g, float gate, float up, float *dgate, float *dup) {
  float s = moe_pw_sigmoid_f32(gate);
  *dgate = g * up * s * (1.0f + gate * (1.0f - s));
  *dup = g * gate * s;
}

/* ----------------------------------------------------------- double math */

MOE_PW_HD double moe_pw_sigmoid_f64(double x) { return 1.0 / (1.0 + exp(-x)); }

MOE_PW_HD double moe_pw_unary_f64(int op, double x, double p0, double p1) {
  switch (op) {
    case MOE_PW_EXP: return exp(x);
    case MOE_PW_LOG: return log(x);
    case MOE_PW_SQRT: return sqrt(x);
    case MOE_PW_RSQRT: return 1.0 / sqrt(x);
    case MOE_PW_ABS: return fabs(x);
    case MOE_PW_RELU: return x < 0.0 ? 0.0 : x;
    case MOE_PW_GELU: return 0.5 * x * (1.0 + erf(x * MOE_PW_SQRT1_2));
    case MOE_PW_GELU_TANH: {
      double u = MOE_PW_SQRT_2_PI * (x + MOE_PW_GELU_C * x * x * x);
      return 0.5 * x * (1.0 + tanh(u));
    }
    case MOE_PW_SILU: return x / (1.0 + exp(-x));
    case MOE_PW_SIGMOID: return moe_pw_sigmoid_f64(x);
    case MOE_PW_TANH: return tanh(x);
    case MOE_PW_POW_SCALAR: return pow(x, p0);
    case MOE_PW_RPOW_SCALAR: return pow(p0, x);
    default: {
      double y = x < p0 ? p0 : x;
      return y > p1 ? p1 : y;
    }
  }
}

MOE_PW_HD double moe_pw_unary_grad_f64(int op, double g, double x, double p0, double p1) {
  switch (op) {
    case MOE_PW_EXP: return g * exp(x);
    case MOE_PW_LOG: return g / x;
    case MOE_PW_SQRT: return g * 0.5 / sqrt(x);
    case MOE_PW_RSQRT: {
      double r = 1.0 / sqrt(x);
      return -0.5 * g * r * r * r;
    }
    case MOE_PW_ABS: return x > 0.0 ? g : x < 0.0 ? -g : 0.0;
    case MOE_PW_RELU: return x > 0.0 ? g : 0.0;
    case MOE_PW_GELU: {
      double cdf = 0.5 * (1.0 + erf(x * MOE_PW_SQRT1_2));
      double pdf = MOE_PW_INV_SQRT_2PI * exp(-0.5 * x * x);
      return g * (cdf + x * pdf);
    }
    case MOE_PW_GELU_TANH: {
      double k = MOE_PW_SQRT_2_PI, c = MOE_PW_GELU_C;
      double t = tanh(k * (x + c * x * x * x));
      return g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * c * x * x));
    }
    case MOE_PW_SILU: {
      double s = moe_pw_sigmoid_f64(x);
      return g * s * (1.0 + x * (1.0 - s));
    }
    case MOE_PW_SIGMOID: {
      double s = moe_pw_sigmoid_f64(x);
      return g * s * (1.0 - s);
    }
    case MOE_PW_TANH: {
      double t = tanh(x);
      return g * (1.0 - t * t);
    }
    case MOE_PW_POW_SCALAR: return p0 == 0.0 ? 0.0 : g * p0 * pow(x, p0 - 1.0);
    case MOE_PW_RPOW_SCALAR: return p0 == 0.0 && x >= 0.0 ? 0.0 : g * pow(p0, x) * log(p0);
    default: return (p0 != p0 || x >= p0) && (p1 != p1 || x <= p1) ? g : 0.0;
  }
}

MOE_PW_HD double moe_pw_binary_f64(int op, double a, double b) {
  switch (op) {
    case MOE_PW_POW: return pow(a, b);
    case MOE_PW_MAXIMUM: return a != a || b != b ? a + b : a > b ? a : b;
    default: return a != a || b != b ? a + b : a < b ? a : b;
  }
}

MOE_PW_HD void moe_pw_binary_grad_f64(int op, double g, double a, double b, double *ga,
                                      double *gb) {
  switch (op) {
    case MOE_PW_POW:
      *ga = b == 0.0 ? 0.0 : g * b * pow(a, b - 1.0);
      *gb = a == 0.0 && b >= 0.0 ? 0.0 : g * pow(a, b) * log(a);
      return;
    case MOE_PW_MAXIMUM:
      *ga = a < b ? 0.0 : a == b ? 0.5 * g : g;
      *gb = a > b ? 0.0 : a == b ? 0.5 * g : g;
      return;
    default:
      *ga = a > b ? 0.0 : a == b ? 0.5 * g : g;
      *gb = a < b ? 0.0 : a == b ? 0.5 * g : g;
      return;
  }
}

MOE_PW_HD double moe_pw_swiglu_f64(double gate, double up) { return gate / (1.0 + exp(-gate)) * up; }

MOE_PW_HD void moe_pw_swiglu_grad_f64(double g, double gate, double up, double *dgate,
                                      double *dup) {
  double s = moe_pw_sigmoid_f64(gate);
  *dgate = g * up * s * (1.0 + gate * (1.0 - s));
  *dup = g * gate * s;
}

/* ------------------------------------------- integer math (int64, wraps) */

/* ABS and CLAMP of integer tensors (lo/hi: the bounds, INT64_MIN/INT64_MAX
 * when absent). */
MOE_PW_HD int64_t moe_pw_unary_i64(int op, int64_t x, int64_t lo, int64_t hi) {
  if (op == MOE_PW_ABS) return x < 0 ? (int64_t)(0 - (uint64_t)x) : x;
  int64_t y = x < lo ? lo : x;
  return y > hi ? hi : y;
}

MOE_PW_HD int64_t moe_pw_binary_i64(int op, int64_t a, int64_t b) {
  return op == MOE_PW_MAXIMUM ? (a > b ? a : b) : (a < b ? a : b);
}

/* --------------------------------------------------------------- dropout */

/* Element i is kept iff its uniform moe_philox_uniform24(seed, call, i)
 * (k / 2^24 for the 24-bit k) is >= p, i.e. iff k >= ceil(p * 2^24): an
 * integer threshold, so CPU and GPU masks agree bit for bit. */
MOE_PW_HD uint32_t moe_pw_dropout_threshold(double p) {
  double t = ceil(p * 16777216.0);
  return t <= 0.0 ? 0u : t >= 16777216.0 ? 16777216u : (uint32_t)t;
}

MOE_PW_HD int moe_pw_dropout_keep(uint64_t seed, uint64_t call, uint64_t i, uint32_t thr) {
  moe_philox4 r = moe_philox(seed, i >> 2, call);
  return (r.v[i & 3] >> 8) >= thr;
}

/* ------------------------------------------------------ CUDA entry points */
/* In kernels/pointwise.cu; views as described at the top; launches on the
 * context's stream; errors through moe_error. Outputs may be of another
 * dtype than the inputs (promotions decided by the core). */

/* out = op(x) for a unary kop; p0, p1 as in moe_pw_kop; i0, i1: the
 * bounds of CLAMP when out is an integer tensor (computed in int64). */
moe_status moe_cuda_pw_unary(moe_ctx *ctx, int device, moe_pw_kop op, const moe_kview *out,
                             const moe_kview *x, double p0, double p1, int64_t i0, int64_t i1);
/* gin = g * op'(x). */
moe_status moe_cuda_pw_unary_grad(moe_ctx *ctx, int device, moe_pw_kop op, const moe_kview *gin,
                                  const moe_kview *g, const moe_kview *x, double p0, double p1);
/* out = op(a, b) for POW, MAXIMUM, MINIMUM. */
moe_status moe_cuda_pw_binary(moe_ctx *ctx, int device, moe_pw_kop op, const moe_kview *out,
                              const moe_kview *a, const moe_kview *b);
/* ga, gb (either may be NULL) = the gradients times g, in out's shape. */
moe_status moe_cuda_pw_binary_grad(moe_ctx *ctx, int device, moe_pw_kop op, const moe_kview *ga,
                                   const moe_kview *gb, const moe_kview *g, const moe_kview *a,
                                   const moe_kview *b);
/* out (bool) = a op b for MOE_OP_EQ..GE, compared in double when cdt is a
 * float dtype and in int64 otherwise. b NULL: compare with the scalar s. */
moe_status moe_cuda_pw_compare(moe_ctx *ctx, int device, moe_op op, moe_dtype cdt,
                               const moe_kview *out, const moe_kview *a, const moe_kview *b,
                               double s);
/* out = cond ? a : b (cond bool). */
moe_status moe_cuda_pw_where(moe_ctx *ctx, int device, const moe_kview *out,
                             const moe_kview *cond, const moe_kview *a, const moe_kview *b);
moe_status moe_cuda_pw_swiglu(moe_ctx *ctx, int device, const moe_kview *out,
                              const moe_kview *gate, const moe_kview *up);
/* dgate, dup (either may be NULL) from g. */
moe_status moe_cuda_pw_swiglu_grad(moe_ctx *ctx, int device, const moe_kview *dgate,
                                   const moe_kview *dup, const moe_kview *g,
                                   const moe_kview *gate, const moe_kview *up);
/* out[i] = keep(i) ? x[i] * scale : 0 with keep from moe_pw_dropout_keep
 * (i the row-major index); forward and backward alike. */
moe_status moe_cuda_pw_dropout(moe_ctx *ctx, int device, const moe_kview *out,
                               const moe_kview *x, uint64_t seed, uint64_t call, uint32_t thr,
                               double scale);

#ifdef __cplusplus
}
#endif
#endif /* MOE_POINTWISE_CUDA_H */
