/*
 * elementwise.cu - CUDA launchers of the arithmetic ops (MOE_OP_ADD, SUB,
 * MUL, DIV, NEG): moe_cuda_binary, moe_cuda_binary_scalar, moe_cuda_unary.
 *
 * Views arrive broadcast to the output's shape (stride-0 dims) with dtypes
 * already promoted by the core; inputs of another dtype than the output are
 * converted to its compute type (float for f32/bf16/f16, double for f64,
 * int64 for integers and bool), as the CPU reference does. The arithmetic
 * uses the round-to-nearest intrinsics (__fadd_rn, __dmul_rn, ...) so nvcc
 * cannot fuse a multiply and an add: results are bit-identical to the CPU
 * built with -ffp-contract=off. Integer arithmetic wraps (two's complement);
 * integer division (not produced by the core, which divides integers in
 * f32) truncates and gives 0 for a zero divisor.
 */
#include "common.cuh"

template <typename C> __device__ __forceinline__ C moe_arith(moe_op op, C a, C b) {
  if constexpr (std::is_same_v<C, float>) {
    switch (op) {
      case MOE_OP_ADD: return __fadd_rn(a, b);
      case MOE_OP_SUB: return __fsub_rn(a, b);
      case MOE_OP_MUL: return __fmul_rn(a, b);
      default: return __fdiv_rn(a, b);
    }
  } else if constexpr (std::is_same_v<C, double>) {
    switch (op) {
      case MOE_OP_ADD: return __dadd_rn(a, b);
      case MOE_OP_SUB: return __dsub_rn(a, b);
      case MOE_OP_MUL: return __dmul_rn(a, b);
      default: return __ddiv_rn(a, b);
    }
  } else {
    uint64_t ua = (uint64_t)a, ub = (uint64_t)b;
    switch (op) {
      case MOE_OP_ADD: return (int64_t)(ua + ub);
      case MOE_OP_SUB: return (int64_t)(ua - ub);
      case MOE_OP_MUL: return (int64_t)(ua * ub);
      default:
        if (b == 0) return 0;
        if (b == -1) return (int64_t)(0 - ua); /* INT64_MIN / -1 wraps */
        return a / b;
    }
  }
}

template <typename C> struct MoeBinaryFn {
  moe_op op;
  explicit MoeBinaryFn(moe_op o) : op(o) {}
  __device__ __forceinline__ C operator()(const C (&x)[2]) const { return moe_arith<C>(op, x[0], x[1]); }
};

/* The scalar in the compute type, as the CPU reference converts it. */
template <typename C> static inline C moe_scalar_as(double s) {
  if constexpr (std::is_same_v<C, int64_t>) {
    if (s != s) return 0;
    if (s <= -9223372036854775808.0) return INT64_MIN;
    if (s >= 9223372036854775808.0) return INT64_MAX;
    return (int64_t)s;
  } else {
    return (C)s;
  }
}

template <typename C> struct MoeScalarFn {
  moe_op op;
  C s;
  bool reverse;
  MoeScalarFn(moe_op o, double sv, bool rev) : op(o), s(moe_scalar_as<C>(sv)), reverse(rev) {}
  __device__ __forceinline__ C operator()(const C (&x)[1]) const {
    return reverse ? moe_arith<C>(op, s, x[0]) : moe_arith<C>(op, x[0], s);
  }
};

template <typename C> struct MoeNegFn {
  __device__ __forceinline__ C operator()(const C (&x)[1]) const {
    if constexpr (std::is_same_v<C, int64_t>) return (int64_t)(0 - (uint64_t)x[0]);
    else return -x[0];
  }
};

static moe_status moe_op_check(moe_ctx *ctx, const char *fn, moe_op op, bool binary) {
  bool ok = binary ? (op == MOE_OP_ADD || op == MOE_OP_SUB || op == MOE_OP_MUL || op == MOE_OP_DIV)
                   : op == MOE_OP_NEG;
  if (!ok)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: op %d (%s) is not a %s op", fn, (int)op,
                     moe_op_name(op), binary ? "binary" : "unary");
  return MOE_OK;
}

extern "C" moe_status moe_cuda_binary(moe_ctx *ctx, int device, moe_op op, const moe_kview *out,
                                      const moe_kview *a, const moe_kview *b) {
  MOE_CHECK(moe_op_check(ctx, "cuda binary", op, true));
  const moe_kview *v[3] = {out, a, b};
  return moe_ew_launch<2, MoeBinaryFn>(ctx, device, "cuda binary kernel", v, op);
}

extern "C" moe_status moe_cuda_binary_scalar(moe_ctx *ctx, int device, moe_op op,
                                             const moe_kview *out, const moe_kview *a, double s,
                                             bool reverse) {
  MOE_CHECK(moe_op_check(ctx, "cuda binary_scalar", op, true));
  const moe_kview *v[2] = {out, a};
  return moe_ew_launch<1, MoeScalarFn>(ctx, device, "cuda binary_scalar kernel", v, op, s,
                                       reverse);
}

extern "C" moe_status moe_cuda_unary(moe_ctx *ctx, int device, moe_op op, const moe_kview *out,
                                     const moe_kview *a) {
  MOE_CHECK(moe_op_check(ctx, "cuda unary", op, false));
  const moe_kview *v[2] = {out, a};
  return moe_ew_launch<1, MoeNegFn>(ctx, device, "cuda unary kernel", v);
}
