/*
 * optim.c - the optimiser family (moe_optim.h): validation, the scalars
 * shared with the CUDA kernels, and the CPU loops of the fused AdamW and SGD
 * updates. The CUDA launches are in kernels/optim.cu (optim_cuda.h).
 *
 * The CPU loop computes in float for f32 state (double for f64) with one
 * operation per C statement and no contraction, in the order the kernel
 * uses, so CPU and CUDA results carry the same bits.
 */
#include <math.h>
#include <string.h>

#include "internal.h"
#include "moe_optim.h"
#include "optim_cuda.h"

moe_adamw_opts moe_adamw_opts_default(void) {
  moe_adamw_opts o = {1e-3, 0.9, 0.999, 1e-8, 0.0, 1};
  return o;
}

/* ------------------------------------------------------------ validation */

static bool op_float(moe_dtype dt) {
  return dt == MOE_F32 || dt == MOE_F64 || dt == MOE_BF16 || dt == MOE_F16;
}

static moe_dtype op_state_dtype(moe_dtype pdt) { return pdt == MOE_F64 ? MOE_F64 : MOE_F32; }

/* A state tensor: contiguous, param's element count, state dtype, param's device. */
static moe_status op_check_state(moe_ctx *ctx, const char *fn, const char *what,
                                 const moe_tensor *t, const moe_tensor *param) {
  moe_dtype want = op_state_dtype(param->dtype);
  MOE_CHECK(moe_check_same_device(ctx, fn, what, t->storage->device, "param",
                                  param->storage->device));
  if (t->dtype != want)
    return moe_error(ctx, MOE_ERR_DTYPE, "%s: %s must be %s for a %s param, got %s", fn, what,
                     moe_dtype_name(want), moe_dtype_name(param->dtype), moe_dtype_name(t->dtype));
  if (moe_tensor_numel(t) != moe_tensor_numel(param))
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: %s has shape %s (%lld elements), param has %lld", fn,
                     what, MOE_SHAPE(t),
                     (long long)moe_tensor_numel(t), (long long)moe_tensor_numel(param));
  if (!moe_tensor_is_contiguous(t))
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: %s must be contiguous", fn, what);
  if (t->storage == param->storage && moe_tensor_numel(t) > 0)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: %s shares param's storage", fn, what);
  return MOE_OK;
}

/* param and grad; *gc gets a contiguous grad (one new reference). */
static moe_status op_check_param(moe_ctx *ctx, const char *fn, moe_tensor *param,
                                 const moe_tensor *grad, moe_tensor *master, moe_tensor **gc) {
  *gc = NULL;
  if (!param || !grad) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: param and grad are required", fn);
  if (!op_float(param->dtype))
    return moe_error(ctx, MOE_ERR_DTYPE, "%s: param must be f32, f64, bf16 or f16, got %s", fn,
                     moe_dtype_name(param->dtype));
  if (!op_float(grad->dtype))
    return moe_error(ctx, MOE_ERR_DTYPE, "%s: grad must be f32, f64, bf16 or f16, got %s", fn,
                     moe_dtype_name(grad->dtype));
  if (param->ndim != grad->ndim ||
      memcmp(param->shape, grad->shape, sizeof(int64_t) * (size_t)param->ndim) != 0)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: grad has shape %s but param has shape %s", fn,
                     MOE_SHAPE(grad),
                     MOE_SHAPE(param));
  MOE_CHECK(moe_check_same_device(ctx, fn, "grad", grad->storage->device, "param",
                                  param->storage->device));
  if (!moe_tensor_is_contiguous(param))
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: param must be contiguous", fn);
  if (!master && (param->dtype == MOE_BF16 || param->dtype == MOE_F16))
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "%s: a %s param needs an f32 master copy (master_weights)", fn,
                     moe_dtype_name(param->dtype));
  if (master) MOE_CHECK(op_check_state(ctx, fn, "master", master, param));
  return moe_contiguous(ctx, (moe_tensor *)grad, gc);
}

/* ------------------------------------------------------------ CPU loops */

static float op_loadf(const void *p, moe_dtype dt, int64_t i) {
  switch (dt) {
  case MOE_F32: return ((const float *)p)[i];
  case MOE_F64: return (float)((const double *)p)[i];
  case MOE_BF16: return moe_bf16_to_f32(((const moe_bf16 *)p)[i]);
  default: return moe_f16_to_f32(((const moe_f16 *)p)[i]);
  }
}

static double op_loadd(const void *p, moe_dtype dt, int64_t i) {
  switch (dt) {
  case MOE_F64: return ((const double *)p)[i];
  default: return (double)op_loadf(p, dt, i);
  }
}

static void op_storef(void *p, moe_dtype dt, int64_t i, float v) {
  switch (dt) {
  case MOE_F32: ((float *)p)[i] = v; break;
  case MOE_BF16: ((moe_bf16 *)p)[i] = moe_f32_to_bf16(v); break;
  default: ((moe_f16 *)p)[i] = moe_f32_to_f16(v); break;
  }
}

static void op_adamw_cpu_f32(int64_t n, void *param, moe_dtype pdt, const void *grad,
                             moe_dtype gdt, float *m, float *v, float *master,
                             const moe_optim_scalars *s) {
  const float decay = (float)s->decay, b1 = (float)s->beta1, omb1 = (float)s->one_m_b1;
  const float b2 = (float)s->beta2, omb2 = (float)s->one_m_b2;
  const float step = (float)s->step_size, sbc2 = (float)s->sqrt_bc2, eps = (float)s->eps;
  for (int64_t i = 0; i < n; i++) {
    float g = op_loadf(grad, gdt, i);
    float w = master ? master[i] : op_loadf(param, pdt, i);
    w = w * decay;
    float mi = b1 * m[i];
    float gm = omb1 * g;
    mi = mi + gm;
    float vi = b2 * v[i];
    float gg = g * g;
    float gv = omb2 * gg;
    vi = vi + gv;
    float den = sqrtf(vi);
    den = den / sbc2;
    den = den + eps;
    float upd = mi / den;
    upd = step * upd;
    w = w - upd;
    m[i] = mi;
    v[i] = vi;
    if (master) master[i] = w;
    op_storef(param, pdt, i, w);
  }
}

static void op_adamw_cpu_f64(int64_t n, double *param, const void *grad, moe_dtype gdt,
                             double *m, double *v, double *master, const moe_optim_scalars *s) {
  for (int64_t i = 0; i < n; i++) {
    double g = op_loadd(grad, gdt, i);
    double w = master ? master[i] : param[i];
    w = w * s->decay;
    double mi = s->beta1 * m[i];
    double gm = s->one_m_b1 * g;
    mi = mi + gm;
    double vi = s->beta2 * v[i];
    double gg = g * g;
    double gv = s->one_m_b2 * gg;
    vi = vi + gv;
    double den = sqrt(vi);
    den = den / s->sqrt_bc2;
    den = den + s->eps;
    double upd = mi / den;
    upd = s->step_size * upd;
    w = w - upd;
    m[i] = mi;
    v[i] = vi;
    if (master) master[i] = w;
    param[i] = w;
  }
}

static void op_sgd_cpu_f32(int64_t n, void *param, moe_dtype pdt, const void *grad, moe_dtype gdt,
                           float *buf, float *master, const moe_optim_scalars *s) {
  const float wd = (float)s->decay, mom = (float)s->beta1, lr = (float)s->step_size;
  for (int64_t i = 0; i < n; i++) {
    float g = op_loadf(grad, gdt, i);
    float w = master ? master[i] : op_loadf(param, pdt, i);
    float dw = wd * w;
    float d = g + dw;
    if (buf) {
      float b = mom * buf[i];
      b = b + d;
      buf[i] = b;
      d = b;
    }
    float upd = lr * d;
    w = w - upd;
    if (master) master[i] = w;
    op_storef(param, pdt, i, w);
  }
}

static void op_sgd_cpu_f64(int64_t n, double *param, const void *grad, moe_dtype gdt, double *buf,
                           double *master, const moe_optim_scalars *s) {
  for (int64_t i = 0; i < n; i++) {
    double g = op_loadd(grad, gdt, i);
    double w = master ? master[i] : param[i];
    double dw = s->decay * w;
    double d = g + dw;
    if (buf) {
      double b = s->beta1 * buf[i];
      b = b + d;
      buf[i] = b;
      d = b;
    }
    double upd = s->step_size * d;
    w = w - upd;
    if (master) master[i] = w;
    param[i] = w;
  }
}

/* Rounds every scalar once to the state's precision (f32 or f64). */
static void op_round(moe_optim_scalars *s, bool f64) {
  if (f64) return;
  double *f[] = {&s->decay, &s->beta1, &s->one_m_b1, &s->beta2,
                 &s->one_m_b2, &s->step_size, &s->sqrt_bc2, &s->eps};
  for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) *f[i] = (double)(float)*f[i];
}

static void *op_ptr(moe_tensor *t) { return t ? moe_tensor_data(t) : NULL; }

/* ------------------------------------------------------------ AdamW */

moe_status moe_adamw_step(moe_ctx *ctx, moe_tensor *param, const moe_tensor *grad,
                          moe_tensor *exp_avg, moe_tensor *exp_avg_sq, moe_tensor *master,
                          const moe_adamw_opts *o) {
  const char *fn = "adamw_step";
  if (!o) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: options are required", fn);
  if (!(o->lr >= 0) || !(o->beta1 >= 0 && o->beta1 < 1) || !(o->beta2 >= 0 && o->beta2 < 1) ||
      !(o->eps >= 0) || !(o->weight_decay >= 0) || o->step < 1)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "%s: need lr >= 0, betas in [0, 1), eps >= 0, weight_decay >= 0, step >= 1 "
                     "(got lr=%g, betas=(%g, %g), eps=%g, weight_decay=%g, step=%lld)",
                     fn, o->lr, o->beta1, o->beta2, o->eps, o->weight_decay, (long long)o->step);
  if (!exp_avg || !exp_avg_sq)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: exp_avg and exp_avg_sq are required", fn);
  moe_tensor *g = NULL;
  MOE_CHECK(op_check_param(ctx, fn, param, grad, master, &g));
  moe_status st = op_check_state(ctx, fn, "exp_avg", exp_avg, param);
  if (st == MOE_OK) st = op_check_state(ctx, fn, "exp_avg_sq", exp_avg_sq, param);
  if (st != MOE_OK) {
    moe_tensor_release(g);
    return st;
  }
  bool f64 = param->dtype == MOE_F64;
  moe_optim_scalars s;
  s.decay = 1.0 - o->lr * o->weight_decay;
  s.beta1 = o->beta1;
  s.one_m_b1 = 1.0 - o->beta1;
  s.beta2 = o->beta2;
  s.one_m_b2 = 1.0 - o->beta2;
  s.step_size = o->lr / (1.0 - pow(o->beta1, (double)o->step));
  s.sqrt_bc2 = sqrt(1.0 - pow(o->beta2, (double)o->step));
  s.eps = o->eps;
  op_round(&s, f64);
  int64_t n = moe_tensor_numel(param);
  if (param->storage->device.type == MOE_DEVICE_CUDA) {
    st = moe_cuda_adamw_step(ctx, param->storage->device.index, n, moe_tensor_data(param),
                             param->dtype, moe_tensor_data(g), g->dtype, moe_tensor_data(exp_avg),
                             moe_tensor_data(exp_avg_sq), op_ptr(master), &s);
  } else if (f64) {
    op_adamw_cpu_f64(n, (double *)moe_tensor_data(param), moe_tensor_data(g), g->dtype,
                     (double *)moe_tensor_data(exp_avg), (double *)moe_tensor_data(exp_avg_sq),
                     (double *)op_ptr(master), &s);
  } else {
    op_adamw_cpu_f32(n, moe_tensor_data(param), param->dtype, moe_tensor_data(g), g->dtype,
                     (float *)moe_tensor_data(exp_avg), (float *)moe_tensor_data(exp_avg_sq),
                     (float *)op_ptr(master), &s);
  }
  moe_tensor_release(g);
  return st;
}

/* ------------------------------------------------------------ SGD */

moe_status moe_sgd_step(moe_ctx *ctx, moe_tensor *param, const moe_tensor *grad,
                        moe_tensor *momentum_buf, moe_tensor *master, const moe_sgd_opts *o) {
  const char *fn = "sgd_step";
  if (!o) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: options are required", fn);
  if (!(o->lr >= 0) || !(o->momentum >= 0) || !(o->weight_decay >= 0))
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "%s: need lr, momentum and weight_decay >= 0 (got %g, %g, %g)", fn, o->lr,
                     o->momentum, o->weight_decay);
  if (o->momentum > 0 && !momentum_buf)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: momentum %g needs a momentum buffer", fn,
                     o->momentum);
  moe_tensor *g = NULL;
  MOE_CHECK(op_check_param(ctx, fn, param, grad, master, &g));
  moe_status st = MOE_OK;
  if (o->momentum > 0) st = op_check_state(ctx, fn, "momentum_buf", momentum_buf, param);
  if (st != MOE_OK) {
    moe_tensor_release(g);
    return st;
  }
  moe_tensor *buf = o->momentum > 0 ? momentum_buf : NULL;
  bool f64 = param->dtype == MOE_F64;
  moe_optim_scalars s = {0};
  s.decay = o->weight_decay;
  s.beta1 = o->momentum;
  s.step_size = o->lr;
  op_round(&s, f64);
  int64_t n = moe_tensor_numel(param);
  if (param->storage->device.type == MOE_DEVICE_CUDA) {
    st = moe_cuda_sgd_step(ctx, param->storage->device.index, n, moe_tensor_data(param),
                           param->dtype, moe_tensor_data(g), g->dtype, op_ptr(buf), op_ptr(master),
                           &s);
  } else if (f64) {
    op_sgd_cpu_f64(n, (double *)moe_tensor_data(param), moe_tensor_data(g), g->dtype,
                   (double *)op_ptr(buf), (double *)op_ptr(master), &s);
  } else {
    op_sgd_cpu_f32(n, moe_tensor_data(param), param->dtype, moe_tensor_data(g), g->dtype,
                   (float *)op_ptr(buf), (float *)op_ptr(master), &s);
  }
  moe_tensor_release(g);
  return st;
}
