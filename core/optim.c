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
#include <stdio.h>
#include <stdlib.h>
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

/* gscale: NULL, or the factor each gradient element is multiplied by as it
 * is read (moe_adamw_step_multi's grad_scale). */
static void op_adamw_cpu_f32(int64_t n, void *param, moe_dtype pdt, const void *grad,
                             moe_dtype gdt, float *m, float *v, float *master,
                             const moe_optim_scalars *s, const float *gscale) {
  const float decay = (float)s->decay, b1 = (float)s->beta1, omb1 = (float)s->one_m_b1;
  const float b2 = (float)s->beta2, omb2 = (float)s->one_m_b2;
  const float step = (float)s->step_size, sbc2 = (float)s->sqrt_bc2, eps = (float)s->eps;
  for (int64_t i = 0; i < n; i++) {
    float g = op_loadf(grad, gdt, i);
    if (gscale) g = g * *gscale;
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
                             double *m, double *v, double *master, const moe_optim_scalars *s,
                             const float *gscale) {
  for (int64_t i = 0; i < n; i++) {
    double g = op_loadd(grad, gdt, i);
    if (gscale) g = g * (double)*gscale;
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

static moe_status op_check_adamw_opts(moe_ctx *ctx, const char *fn, const moe_adamw_opts *o,
                                      double weight_decay) {
  if (!o) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: options are required", fn);
  if (!(o->lr >= 0) || !(o->beta1 >= 0 && o->beta1 < 1) || !(o->beta2 >= 0 && o->beta2 < 1) ||
      !(o->eps >= 0) || !(weight_decay >= 0) || o->step < 1)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "%s: need lr >= 0, betas in [0, 1), eps >= 0, weight_decay >= 0, step >= 1 "
                     "(got lr=%g, betas=(%g, %g), eps=%g, weight_decay=%g, step=%lld)",
                     fn, o->lr, o->beta1, o->beta2, o->eps, weight_decay, (long long)o->step);
  return MOE_OK;
}

/* The scalars of one AdamW update, rounded to the state's precision. */
static moe_optim_scalars op_adamw_scalars(const moe_adamw_opts *o, double weight_decay, bool f64) {
  moe_optim_scalars s;
  s.decay = 1.0 - o->lr * weight_decay;
  s.beta1 = o->beta1;
  s.one_m_b1 = 1.0 - o->beta1;
  s.beta2 = o->beta2;
  s.one_m_b2 = 1.0 - o->beta2;
  s.step_size = o->lr / (1.0 - pow(o->beta1, (double)o->step));
  s.sqrt_bc2 = sqrt(1.0 - pow(o->beta2, (double)o->step));
  s.eps = o->eps;
  op_round(&s, f64);
  return s;
}

moe_status moe_adamw_step(moe_ctx *ctx, moe_tensor *param, const moe_tensor *grad,
                          moe_tensor *exp_avg, moe_tensor *exp_avg_sq, moe_tensor *master,
                          const moe_adamw_opts *o) {
  const char *fn = "adamw_step";
  MOE_CHECK(op_check_adamw_opts(ctx, fn, o, o ? o->weight_decay : 0));
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
  moe_optim_scalars s = op_adamw_scalars(o, o->weight_decay, f64);
  int64_t n = moe_tensor_numel(param);
  if (param->storage->device.type == MOE_DEVICE_CUDA) {
    st = moe_cuda_adamw_step(ctx, param->storage->device.index, n, moe_tensor_data(param),
                             param->dtype, moe_tensor_data(g), g->dtype, moe_tensor_data(exp_avg),
                             moe_tensor_data(exp_avg_sq), op_ptr(master), &s);
  } else if (f64) {
    op_adamw_cpu_f64(n, (double *)moe_tensor_data(param), moe_tensor_data(g), g->dtype,
                     (double *)moe_tensor_data(exp_avg), (double *)moe_tensor_data(exp_avg_sq),
                     (double *)op_ptr(master), &s, NULL);
  } else {
    op_adamw_cpu_f32(n, moe_tensor_data(param), param->dtype, moe_tensor_data(g), g->dtype,
                     (float *)moe_tensor_data(exp_avg), (float *)moe_tensor_data(exp_avg_sq),
                     (float *)op_ptr(master), &s, NULL);
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

/* ------------------------------------------------------------ multi-tensor */

/* Lanes of the deterministic norm: the CUDA block size of both passes. */
#define OP_NORM_LANES 512

/* An optional device scalar (grad_scale, skip, outputs): f32, one element, on d. */
static moe_status op_check_scalar(moe_ctx *ctx, const char *fn, const char *what,
                                  const moe_tensor *t, moe_device d) {
  if (t->dtype != MOE_F32)
    return moe_error(ctx, MOE_ERR_DTYPE, "%s: %s must be f32, got %s", fn, what,
                     moe_dtype_name(t->dtype));
  if (moe_tensor_numel(t) != 1)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: %s must have one element, got shape %s", fn, what,
                     MOE_SHAPE(t));
  return moe_check_same_device(ctx, fn, what, t->storage->device, "the tensors", d);
}

static void op_release_all(moe_tensor **ts, int64_t n) {
  if (!ts) return;
  for (int64_t i = 0; i < n; i++) moe_tensor_release(ts[i]);
  free(ts);
}

static moe_status op_alloc_lists(moe_ctx *ctx, const char *fn, int64_t n, moe_tensor ***gcs,
                                 moe_optim_item **items) {
  *gcs = calloc((size_t)n, sizeof **gcs);
  *items = calloc((size_t)n, sizeof **items);
  if (*gcs && *items) return MOE_OK;
  free(*gcs);
  free(*items);
  *gcs = NULL;
  *items = NULL;
  return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: no host memory for %lld tensors", fn,
                   (long long)n);
}

moe_status moe_adamw_step_multi(moe_ctx *ctx, const moe_adamw_entry *entries, int64_t n,
                                const moe_adamw_opts *o, const moe_tensor *grad_scale,
                                const moe_tensor *skip) {
  const char *fn = "adamw_step_multi";
  if (n < 0 || (n > 0 && !entries))
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: need n >= 0 entries (got %lld%s)", fn,
                     (long long)n, entries ? "" : ", entries NULL");
  MOE_CHECK(op_check_adamw_opts(ctx, fn, o, 0));
  if (n == 0) return MOE_OK;
  moe_tensor **gcs = NULL;
  moe_optim_item *items = NULL;
  MOE_CHECK(op_alloc_lists(ctx, fn, n, &gcs, &items));
  moe_status st = MOE_OK;
  moe_device dev = MOE_CPU;
  char efn[64];
  for (int64_t k = 0; k < n && st == MOE_OK; k++) {
    const moe_adamw_entry *e = &entries[k];
    snprintf(efn, sizeof efn, "%s: entry %lld", fn, (long long)k);
    if (!e->param || !e->grad || !e->exp_avg || !e->exp_avg_sq) {
      st = moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: param, grad, exp_avg and exp_avg_sq are required",
                     efn);
      break;
    }
    if (!(e->weight_decay >= 0)) {
      st = moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: weight_decay must be >= 0, got %g", efn,
                     e->weight_decay);
      break;
    }
    if (k == 0) dev = e->param->storage->device;
    st = moe_check_same_device(ctx, efn, "param", e->param->storage->device, "entry 0's param", dev);
    if (st == MOE_OK) st = op_check_param(ctx, efn, e->param, e->grad, e->master, &gcs[k]);
    if (st == MOE_OK) st = op_check_state(ctx, efn, "exp_avg", e->exp_avg, e->param);
    if (st == MOE_OK) st = op_check_state(ctx, efn, "exp_avg_sq", e->exp_avg_sq, e->param);
    if (st != MOE_OK) break;
    moe_optim_item *it = &items[k];
    it->n = moe_tensor_numel(e->param);
    it->param = moe_tensor_data(e->param);
    it->grad = moe_tensor_data(gcs[k]);
    it->m = moe_tensor_data(e->exp_avg);
    it->v = moe_tensor_data(e->exp_avg_sq);
    it->master = op_ptr(e->master);
    it->pdt = e->param->dtype;
    it->gdt = gcs[k]->dtype;
    it->decay = 1.0 - o->lr * e->weight_decay;
  }
  if (st == MOE_OK && grad_scale) st = op_check_scalar(ctx, fn, "grad_scale", grad_scale, dev);
  if (st == MOE_OK && skip) st = op_check_scalar(ctx, fn, "skip", skip, dev);
  if (st != MOE_OK) goto done;
  if (dev.type == MOE_DEVICE_CUDA) {
    /* unrounded scalars: the kernels round each to their state's precision,
     * which gives op_round's values */
    moe_optim_scalars s = op_adamw_scalars(o, 0, true);
    st = moe_cuda_adamw_multi(ctx, dev.index, items, n, &s,
                              grad_scale ? (const float *)moe_tensor_data(grad_scale) : NULL,
                              skip ? (const float *)moe_tensor_data(skip) : NULL);
    goto done;
  }
  if (skip && *(const float *)moe_tensor_data(skip) != 0.0f) goto done;
  const float *gscale = grad_scale ? (const float *)moe_tensor_data(grad_scale) : NULL;
  for (int64_t k = 0; k < n; k++) {
    const moe_adamw_entry *e = &entries[k];
    moe_optim_item *it = &items[k];
    bool f64 = it->pdt == MOE_F64;
    moe_optim_scalars s = op_adamw_scalars(o, e->weight_decay, f64);
    if (f64)
      op_adamw_cpu_f64(it->n, (double *)it->param, it->grad, it->gdt, (double *)it->m,
                       (double *)it->v, (double *)it->master, &s, gscale);
    else
      op_adamw_cpu_f32(it->n, it->param, it->pdt, it->grad, it->gdt, (float *)it->m,
                       (float *)it->v, (float *)it->master, &s, gscale);
  }
done:
  op_release_all(gcs, n);
  free(items);
  return st;
}

/* The sum of squares of one chunk (x[lo, hi) of n), in the CUDA block's
 * order: lane j adds x[lo + j], x[lo + j + 512], ... then a pairwise tree. */
static float op_chunk_sumsq(const void *x, moe_dtype dt, int64_t lo, int64_t hi) {
  float lane[OP_NORM_LANES];
  for (int j = 0; j < OP_NORM_LANES; j++) lane[j] = 0.0f;
  for (int64_t i = lo; i < hi; i++) {
    float v = op_loadf(x, dt, i);
    float sq = v * v;
    int j = (int)((i - lo) % OP_NORM_LANES);
    lane[j] = lane[j] + sq;
  }
  for (int s = OP_NORM_LANES / 2; s > 0; s >>= 1)
    for (int j = 0; j < s; j++) lane[j] = lane[j] + lane[j + s];
  return lane[0];
}

/* The sum of the chunk sums, as the CUDA finishing block does. */
static float op_sum_partials(const float *p, int64_t n) {
  float lane[OP_NORM_LANES];
  for (int j = 0; j < OP_NORM_LANES; j++) lane[j] = 0.0f;
  for (int64_t i = 0; i < n; i++) {
    int j = (int)(i % OP_NORM_LANES);
    lane[j] = lane[j] + p[i];
  }
  for (int s = OP_NORM_LANES / 2; s > 0; s >>= 1)
    for (int j = 0; j < s; j++) lane[j] = lane[j] + lane[j + s];
  return lane[0];
}

moe_status moe_grad_norm_multi(moe_ctx *ctx, const moe_tensor *const *grads, int64_t n,
                               double max_norm, moe_tensor *norm, moe_tensor *coef,
                               moe_tensor *found_inf) {
  const char *fn = "grad_norm_multi";
  if (n < 0 || (n > 0 && !grads))
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: need n >= 0 gradients (got %lld%s)", fn,
                     (long long)n, grads ? "" : ", grads NULL");
  if (!(max_norm > 0))
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: max_norm must be > 0 (inf: no clipping), got %g",
                     fn, max_norm);
  if (!norm) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: norm (the output) is required", fn);
  moe_device dev = n > 0 && grads[0] ? grads[0]->storage->device : norm->storage->device;
  moe_tensor **gcs = NULL;
  moe_optim_item *items = NULL;
  if (n > 0) MOE_CHECK(op_alloc_lists(ctx, fn, n, &gcs, &items));
  moe_status st = MOE_OK;
  char efn[64];
  for (int64_t k = 0; k < n && st == MOE_OK; k++) {
    const moe_tensor *g = grads[k];
    snprintf(efn, sizeof efn, "%s: grad %lld", fn, (long long)k);
    if (!g) {
      st = moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: is NULL", efn);
      break;
    }
    if (!op_float(g->dtype)) {
      st = moe_error(ctx, MOE_ERR_DTYPE, "%s: must be f32, f64, bf16 or f16, got %s", efn,
                     moe_dtype_name(g->dtype));
      break;
    }
    st = moe_check_same_device(ctx, efn, "the gradient", g->storage->device, "grad 0", dev);
    if (st == MOE_OK) st = moe_contiguous(ctx, (moe_tensor *)g, &gcs[k]);
    if (st != MOE_OK) break;
    items[k].n = moe_tensor_numel(gcs[k]);
    items[k].grad = moe_tensor_data(gcs[k]);
    items[k].gdt = gcs[k]->dtype;
  }
  if (st == MOE_OK) st = op_check_scalar(ctx, fn, "norm", norm, dev);
  if (st == MOE_OK && coef) st = op_check_scalar(ctx, fn, "coef", coef, dev);
  if (st == MOE_OK && found_inf) st = op_check_scalar(ctx, fn, "found_inf", found_inf, dev);
  if (st != MOE_OK) goto done;
  float mx = (float)max_norm;
  if (dev.type == MOE_DEVICE_CUDA) {
    st = moe_cuda_grad_norm_multi(ctx, dev.index, items, n, mx, (float *)moe_tensor_data(norm),
                                  coef ? (float *)moe_tensor_data(coef) : NULL,
                                  found_inf ? (float *)moe_tensor_data(found_inf) : NULL);
    goto done;
  }
  int64_t nchunks = 0;
  for (int64_t k = 0; k < n; k++) nchunks += (items[k].n + MOE_OPTIM_CHUNK - 1) / MOE_OPTIM_CHUNK;
  float *part = malloc(sizeof(float) * (size_t)(nchunks > 0 ? nchunks : 1));
  if (!part) {
    st = moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: no host memory for %lld chunk sums", fn,
                   (long long)nchunks);
    goto done;
  }
  int64_t c = 0;
  for (int64_t k = 0; k < n; k++)
    for (int64_t lo = 0; lo < items[k].n; lo += MOE_OPTIM_CHUNK) {
      int64_t hi = lo + MOE_OPTIM_CHUNK < items[k].n ? lo + MOE_OPTIM_CHUNK : items[k].n;
      part[c++] = op_chunk_sumsq(items[k].grad, items[k].gdt, lo, hi);
    }
  float total = sqrtf(op_sum_partials(part, nchunks));
  free(part);
  float den = total + 1e-6f;
  float q = mx / den;
  *(float *)moe_tensor_data(norm) = total;
  if (coef) *(float *)moe_tensor_data(coef) = q < 1.0f ? q : 1.0f;
  if (found_inf) *(float *)moe_tensor_data(found_inf) = isfinite(total) ? 0.0f : 1.0f;
done:
  op_release_all(gcs, n);
  free(items);
  return st;
}

moe_status moe_scale_multi(moe_ctx *ctx, moe_tensor *const *tensors, int64_t n,
                           const moe_tensor *scale) {
  const char *fn = "scale_multi";
  if (n < 0 || (n > 0 && !tensors))
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: need n >= 0 tensors (got %lld%s)", fn,
                     (long long)n, tensors ? "" : ", tensors NULL");
  if (!scale) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: scale is required", fn);
  if (n == 0) return MOE_OK;
  moe_optim_item *items = calloc((size_t)n, sizeof *items);
  if (!items)
    return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: no host memory for %lld tensors", fn,
                     (long long)n);
  moe_status st = MOE_OK;
  moe_device dev = tensors[0] ? tensors[0]->storage->device : MOE_CPU;
  char efn[64];
  for (int64_t k = 0; k < n && st == MOE_OK; k++) {
    moe_tensor *t = tensors[k];
    snprintf(efn, sizeof efn, "%s: tensor %lld", fn, (long long)k);
    if (!t) {
      st = moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: is NULL", efn);
    } else if (!op_float(t->dtype)) {
      st = moe_error(ctx, MOE_ERR_DTYPE, "%s: must be f32, f64, bf16 or f16, got %s", efn,
                     moe_dtype_name(t->dtype));
    } else if (!moe_tensor_is_contiguous(t)) {
      st = moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: must be contiguous", efn);
    } else {
      st = moe_check_same_device(ctx, efn, "the tensor", t->storage->device, "tensor 0", dev);
      items[k].n = moe_tensor_numel(t);
      items[k].param = moe_tensor_data(t);
      items[k].pdt = t->dtype;
    }
  }
  if (st == MOE_OK) st = op_check_scalar(ctx, fn, "scale", scale, dev);
  if (st == MOE_OK && dev.type == MOE_DEVICE_CUDA) {
    st = moe_cuda_scale_multi(ctx, dev.index, items, n,
                              (const float *)moe_tensor_data(scale));
  } else if (st == MOE_OK) {
    float sf = *(const float *)moe_tensor_data(scale);
    for (int64_t k = 0; k < n; k++) {
      moe_optim_item *it = &items[k];
      if (it->pdt == MOE_F64) {
        double *p = it->param, sd = (double)sf;
        for (int64_t i = 0; i < it->n; i++) p[i] = p[i] * sd;
      } else {
        for (int64_t i = 0; i < it->n; i++) {
          float v = op_loadf(it->param, it->pdt, i);
          v = v * sf;
          op_storef(it->param, it->pdt, i, v);
        }
      }
    }
  }
  free(items);
  return st;
}
