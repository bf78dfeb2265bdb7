/*
 * optim.cu - CUDA kernels of the optimiser family (entry points in
 * core/optim_cuda.h, called by core/optim.c): the fused AdamW and SGD
 * updates, one launch per parameter tensor, a grid-stride loop of one
 * element per thread.
 *
 * Bits: every operation is an explicit round-to-nearest intrinsic
 * (__fmul_rn, __fadd_rn, __fsqrt_rn, __fdiv_rn and their double twins) in
 * the order of core/optim.c's CPU loop, so no multiply-add is contracted and
 * both devices produce the same values. bf16/f16 parameters are written from
 * the f32 master with core/half.h's round-to-nearest-even, as on the CPU.
 */
#include "common.cuh"
#include "optim_cuda.h"

namespace {

template <typename S> struct OpMath;
template <> struct OpMath<float> {
  static __device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
  static __device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
  static __device__ __forceinline__ float sub(float a, float b) { return __fsub_rn(a, b); }
  static __device__ __forceinline__ float div(float a, float b) { return __fdiv_rn(a, b); }
  static __device__ __forceinline__ float sqrt(float a) { return __fsqrt_rn(a); }
};
template <> struct OpMath<double> {
  static __device__ __forceinline__ double mul(double a, double b) { return __dmul_rn(a, b); }
  static __device__ __forceinline__ double add(double a, double b) { return __dadd_rn(a, b); }
  static __device__ __forceinline__ double sub(double a, double b) { return __dsub_rn(a, b); }
  static __device__ __forceinline__ double div(double a, double b) { return __ddiv_rn(a, b); }
  static __device__ __forceinline__ double sqrt(double a) { return __dsqrt_rn(a); }
};

/* Element i of a float array of dtype dt, converted to S as the CPU does. */
template <typename S> __device__ __forceinline__ S op_load(const void *p, moe_dtype dt, int64_t i) {
  float f;
  switch (dt) {
  case MOE_F64:
    if (std::is_same<S, double>::value) return (S)((const double *)p)[i];
    return (S)__double2float_rn(((const double *)p)[i]);
  case MOE_F32: f = ((const float *)p)[i]; break;
  case MOE_BF16: f = moe_bf16_to_f32(((const moe_bf16 *)p)[i]); break;
  default: f = moe_f16_to_f32(((const moe_f16 *)p)[i]); break;
  }
  return (S)f;
}

template <typename S> __device__ __forceinline__ void op_store(void *p, moe_dtype dt, int64_t i, S w) {
  switch (dt) {
  case MOE_F64: ((double *)p)[i] = (double)w; break;
  case MOE_F32: ((float *)p)[i] = (float)w; break;
  case MOE_BF16: ((moe_bf16 *)p)[i] = moe_f32_to_bf16((float)w); break;
  default: ((moe_f16 *)p)[i] = moe_f32_to_f16((float)w); break;
  }
}

template <typename S> struct OpScalars {
  S decay, beta1, one_m_b1, beta2, one_m_b2, step_size, sqrt_bc2, eps;
};

template <typename S> static OpScalars<S> op_scalars(const moe_optim_scalars *s) {
  OpScalars<S> r;
  r.decay = (S)s->decay;
  r.beta1 = (S)s->beta1;
  r.one_m_b1 = (S)s->one_m_b1;
  r.beta2 = (S)s->beta2;
  r.one_m_b2 = (S)s->one_m_b2;
  r.step_size = (S)s->step_size;
  r.sqrt_bc2 = (S)s->sqrt_bc2;
  r.eps = (S)s->eps;
  return r;
}

template <typename S>
__global__ void op_adamw_kernel(int64_t n, void *param, moe_dtype pdt, const void *grad,
                                moe_dtype gdt, S *m, S *v, S *master, OpScalars<S> s) {
  using M = OpMath<S>;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    S g = op_load<S>(grad, gdt, i);
    S w = master ? master[i] : op_load<S>(param, pdt, i);
    w = M::mul(w, s.decay);
    S mi = M::add(M::mul(s.beta1, m[i]), M::mul(s.one_m_b1, g));
    S vi = M::add(M::mul(s.beta2, v[i]), M::mul(s.one_m_b2, M::mul(g, g)));
    S den = M::add(M::div(M::sqrt(vi), s.sqrt_bc2), s.eps);
    w = M::sub(w, M::mul(s.step_size, M::div(mi, den)));
    m[i] = mi;
    v[i] = vi;
    if (master) master[i] = w;
    op_store<S>(param, pdt, i, w);
  }
}

template <typename S>
__global__ void op_sgd_kernel(int64_t n, void *param, moe_dtype pdt, const void *grad,
                              moe_dtype gdt, S *buf, S *master, OpScalars<S> s) {
  using M = OpMath<S>;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    S g = op_load<S>(grad, gdt, i);
    S w = master ? master[i] : op_load<S>(param, pdt, i);
    S d = M::add(g, M::mul(s.decay, w));
    if (buf) {
      d = M::add(M::mul(s.beta1, buf[i]), d);
      buf[i] = d;
    }
    w = M::sub(w, M::mul(s.step_size, d));
    if (master) master[i] = w;
    op_store<S>(param, pdt, i, w);
  }
}

moe_status op_stream(moe_ctx *ctx, int device, cudaStream_t *s) {
  void *p = nullptr;
  MOE_CHECK(moe_cuda_stream(ctx, device, &p));
  *s = (cudaStream_t)p;
  return MOE_OK;
}

} // namespace

extern "C" moe_status moe_cuda_adamw_step(moe_ctx *ctx, int device, int64_t n, void *param,
                                          moe_dtype pdt, const void *grad, moe_dtype gdt, void *m,
                                          void *v, void *master, const moe_optim_scalars *s) {
  if (n == 0) return MOE_OK;
  cudaStream_t stream;
  MOE_CHECK(op_stream(ctx, device, &stream));
  if (pdt == MOE_F64)
    op_adamw_kernel<double><<<moe_blocks(n), MOE_THREADS, 0, stream>>>(
        n, param, pdt, grad, gdt, (double *)m, (double *)v, (double *)master, op_scalars<double>(s));
  else
    op_adamw_kernel<float><<<moe_blocks(n), MOE_THREADS, 0, stream>>>(
        n, param, pdt, grad, gdt, (float *)m, (float *)v, (float *)master, op_scalars<float>(s));
  MOE_CUDA_CHECK_LAUNCH(ctx, "adamw_step kernel");
  return MOE_OK;
}

extern "C" moe_status moe_cuda_sgd_step(moe_ctx *ctx, int device, int64_t n, void *param,
                                        moe_dtype pdt, const void *grad, moe_dtype gdt, void *buf,
                                        void *master, const moe_optim_scalars *s) {
  if (n == 0) return MOE_OK;
  cudaStream_t stream;
  MOE_CHECK(op_stream(ctx, device, &stream));
  if (pdt == MOE_F64)
    op_sgd_kernel<double><<<moe_blocks(n), MOE_THREADS, 0, stream>>>(
        n, param, pdt, grad, gdt, (double *)buf, (double *)master, op_scalars<double>(s));
  else
    op_sgd_kernel<float><<<moe_blocks(n), MOE_THREADS, 0, stream>>>(
        n, param, pdt, grad, gdt, (float *)buf, (float *)master, op_scalars<float>(s));
  MOE_CUDA_CHECK_LAUNCH(ctx, "sgd_step kernel");
  return MOE_OK;
}
