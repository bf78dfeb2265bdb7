/*
 * pointwise.c - pointwise math, comparisons, activations, swiglu and dropout
 * (moe_pointwise.h): validation, dtype rules, output allocation, dispatch to
 * the CUDA entry points of pointwise_cuda.h or to the CPU reference here,
 * and the autograd nodes with their backward functions.
 *
 * The CPU reference walks up to five views of one shape (two outputs and
 * three inputs for the fused backward passes) with core/cpu_loop.h. Each element
 * is loaded into the compute type (float for f32/bf16/f16, double for f64,
 * int64 for integers), handed to the formulas of pointwise_cuda.h, which the
 * CUDA kernels share, and stored to the output dtype. All-f32 and all-f64
 * operands skip the per-element dtype conversion.
 *
 * Backward functions save inputs only (never the op's own output, which would
 * make a node hold itself) and recompute what they need. Gradients of
 * broadcast inputs are reduced with moe_sum_to_shape, then cast to the
 * input's dtype when promotion changed it.
 */
#include <math.h>
#include <string.h>

#include "cpu_loop.h"
#include "internal.h"
#include "pointwise_cuda.h"

#define PW_MAX_OPS MOE_LOOP_MAX_OPS /* views one CPU loop walks together */

/* What one CPU pass computes. */
typedef enum pw_kind {
  PW_UNARY,       /* y0 = op(x0; p0, p1) */
  PW_UNARY_GRAD,  /* y0 = x0 * op'(x1) */
  PW_BINARY,      /* y0 = op(x0, x1) */
  PW_BINARY_GRAD, /* (y0, y1) = grads of op(x1, x2) times x0 */
  PW_COMPARE,     /* y0 = x0 cmp x1 */
  PW_WHERE,       /* y0 = x0 ? x1 : x2 */
  PW_SWIGLU,      /* y0 = silu(x0) * x1 */
  PW_SWIGLU_GRAD, /* (y0, y1) = grads of swiglu(x1, x2) times x0 */
  PW_DROPOUT      /* y0 = keep(i) ? x0 * scale : 0 */
} pw_kind;

typedef enum pw_compute { PW_C_F32, PW_C_F64, PW_C_I64 } pw_compute;

typedef struct pw_job {
  pw_kind kind;
  int op;             /* moe_pw_kop, or moe_op for PW_COMPARE */
  pw_compute compute; /* the type elements are loaded into */
  int nout, nin;
  int ymap[2];        /* output k stores y[ymap[k]] */
  double p0, p1;      /* float parameters */
  int64_t i0, i1;     /* integer parameters (clamp bounds) */
  uint64_t seed, call;
  uint32_t thr;
  double scale;
} pw_job;

static pw_compute pw_compute_of(moe_dtype dt) {
  return dt == MOE_F64 ? PW_C_F64 : moe_dtype_is_float(dt) ? PW_C_F32 : PW_C_I64;
}

static bool pw_cmp_f64(int op, double a, double b) {
  switch (op) {
    case MOE_OP_EQ: return a == b;
    case MOE_OP_NE: return a != b;
    case MOE_OP_LT: return a < b;
    case MOE_OP_LE: return a <= b;
    case MOE_OP_GT: return a > b;
    default: return a >= b;
  }
}

static bool pw_cmp_i64(int op, int64_t a, int64_t b) {
  switch (op) {
    case MOE_OP_EQ: return a == b;
    case MOE_OP_NE: return a != b;
    case MOE_OP_LT: return a < b;
    case MOE_OP_LE: return a <= b;
    case MOE_OP_GT: return a > b;
    default: return a >= b;
  }
}

static void pw_elem_f32(const pw_job *jb, const float *x, float *y, int64_t i) {
  switch (jb->kind) {
    case PW_UNARY: y[0] = moe_pw_unary_f32(jb->op, x[0], (float)jb->p0, (float)jb->p1); return;
    case PW_UNARY_GRAD:
      y[0] = moe_pw_unary_grad_f32(jb->op, x[0], x[1], (float)jb->p0, (float)jb->p1);
      return;
    case PW_BINARY: y[0] = moe_pw_binary_f32(jb->op, x[0], x[1]); return;
    case PW_BINARY_GRAD: moe_pw_binary_grad_f32(jb->op, x[0], x[1], x[2], &y[0], &y[1]); return;
    case PW_COMPARE: y[0] = pw_cmp_f64(jb->op, x[0], x[1]) ? 1.0f : 0.0f; return;
    case PW_WHERE: y[0] = x[0] != 0.0f ? x[1] : x[2]; return;
    case PW_SWIGLU: y[0] = moe_pw_swiglu_f32(x[0], x[1]); return;
    case PW_SWIGLU_GRAD: moe_pw_swiglu_grad_f32(x[0], x[1], x[2], &y[0], &y[1]); return;
    case PW_DROPOUT:
      y[0] = moe_pw_dropout_keep(jb->seed, jb->call, (uint64_t)i, jb->thr) ? x[0] * (float)jb->scale
                                                                           : 0.0f;
      return;
  }
}

static void pw_elem_f64(const pw_job *jb, const double *x, double *y, int64_t i) {
  switch (jb->kind) {
    case PW_UNARY: y[0] = moe_pw_unary_f64(jb->op, x[0], jb->p0, jb->p1); return;
    case PW_UNARY_GRAD: y[0] = moe_pw_unary_grad_f64(jb->op, x[0], x[1], jb->p0, jb->p1); return;
    case PW_BINARY: y[0] = moe_pw_binary_f64(jb->op, x[0], x[1]); return;
    case PW_BINARY_GRAD: moe_pw_binary_grad_f64(jb->op, x[0], x[1], x[2], &y[0], &y[1]); return;
    case PW_COMPARE: y[0] = pw_cmp_f64(jb->op, x[0], x[1]) ? 1.0 : 0.0; return;
    case PW_WHERE: y[0] = x[0] != 0.0 ? x[1] : x[2]; return;
    case PW_SWIGLU: y[0] = moe_pw_swiglu_f64(x[0], x[1]); return;
    case PW_SWIGLU_GRAD: moe_pw_swiglu_grad_f64(x[0], x[1], x[2], &y[0], &y[1]); return;
    case PW_DROPOUT:
      y[0] = moe_pw_dropout_keep(jb->seed, jb->call, (uint64_t)i, jb->thr) ? x[0] * jb->scale : 0.0;
      return;
  }
}

/* Integer compute: ABS, CLAMP, MAXIMUM, MINIMUM, comparisons and where. */
static void pw_elem_i64(const pw_job *jb, const int64_t *x, int64_t *y) {
  switch (jb->kind) {
    case PW_UNARY: y[0] = moe_pw_unary_i64(jb->op, x[0], jb->i0, jb->i1); return;
    case PW_BINARY: y[0] = moe_pw_binary_i64(jb->op, x[0], x[1]); return;
    case PW_COMPARE: y[0] = pw_cmp_i64(jb->op, x[0], x[1]); return;
    case PW_WHERE: y[0] = x[0] != 0 ? x[1] : x[2]; return;
    default: MOE_ASSERT(!"integer compute of a float-only pointwise op"); return;
  }
}

/* Runs jb over v = outputs (nout) then inputs (nin), all of v[0]'s shape. */
static void pw_cpu_run(const pw_job *jb, const moe_kview *const *v) {
  int nops = jb->nout + jb->nin;
  moe_loop l;
  moe_loop_init(&l, nops, v);
  int64_t esz[PW_MAX_OPS];
  bool all_f32 = jb->compute == PW_C_F32, all_f64 = jb->compute == PW_C_F64;
  for (int k = 0; k < nops; k++) {
    esz[k] = (int64_t)moe_dtype_size(v[k]->dtype);
    all_f32 = all_f32 && v[k]->dtype == MOE_F32;
    all_f64 = all_f64 && v[k]->dtype == MOE_F64;
  }
#pragma omp parallel for if (l.numel >= MOE_LOOP_PAR_MIN) schedule(static)
  for (int64_t t = 0; t < l.tasks; t++) {
    int64_t off[PW_MAX_OPS], first;
    int64_t n = moe_loop_task(&l, t, off, &first);
    char *p[PW_MAX_OPS];
    int64_t step[PW_MAX_OPS];
    for (int k = 0; k < nops; k++) {
      p[k] = (char *)v[k]->data + off[k] * esz[k];
      step[k] = l.stride[k][l.ndim - 1] * esz[k];
    }
    for (int64_t j = 0; j < n; j++) {
      int64_t i = first + j;
      if (all_f32) {
        float x[3] = {0, 0, 0}, y[2] = {0, 0};
        for (int k = 0; k < jb->nin; k++) x[k] = *(const float *)p[jb->nout + k];
        pw_elem_f32(jb, x, y, i);
        for (int k = 0; k < jb->nout; k++) *(float *)p[k] = y[jb->ymap[k]];
      } else if (all_f64) {
        double x[3] = {0, 0, 0}, y[2] = {0, 0};
        for (int k = 0; k < jb->nin; k++) x[k] = *(const double *)p[jb->nout + k];
        pw_elem_f64(jb, x, y, i);
        for (int k = 0; k < jb->nout; k++) *(double *)p[k] = y[jb->ymap[k]];
      } else if (jb->compute == PW_C_F32) {
        float x[3] = {0, 0, 0}, y[2] = {0, 0};
        for (int k = 0; k < jb->nin; k++)
          x[k] = (float)moe_load_f64(p[jb->nout + k], v[jb->nout + k]->dtype);
        pw_elem_f32(jb, x, y, i);
        for (int k = 0; k < jb->nout; k++) moe_store_f64(p[k], v[k]->dtype, y[jb->ymap[k]]);
      } else if (jb->compute == PW_C_F64) {
        double x[3] = {0, 0, 0}, y[2] = {0, 0};
        for (int k = 0; k < jb->nin; k++) x[k] = moe_load_f64(p[jb->nout + k], v[jb->nout + k]->dtype);
        pw_elem_f64(jb, x, y, i);
        for (int k = 0; k < jb->nout; k++) moe_store_f64(p[k], v[k]->dtype, y[jb->ymap[k]]);
      } else {
        int64_t x[3] = {0, 0, 0}, y[2] = {0, 0};
        for (int k = 0; k < jb->nin; k++) x[k] = moe_load_i64(p[jb->nout + k], v[jb->nout + k]->dtype);
        pw_elem_i64(jb, x, y);
        for (int k = 0; k < jb->nout; k++) moe_store_i64(p[k], v[k]->dtype, y[jb->ymap[k]]);
      }
      for (int k = 0; k < nops; k++) p[k] += step[k];
    }
  }
}

static pw_job pw_job_make(pw_kind kind, int op, pw_compute compute, int nout, int nin) {
  pw_job jb;
  memset(&jb, 0, sizeof(jb));
  jb.kind = kind;
  jb.op = op;
  jb.compute = compute;
  jb.nout = nout;
  jb.nin = nin;
  jb.ymap[0] = 0;
  jb.ymap[1] = 1;
  return jb;
}

/* ---------------------------------------------------------- validation */

/* n tensors (named for messages) present, one device, which exists. */
static moe_status pw_args(moe_ctx *ctx, const char *fn, int n, moe_tensor *const *t,
                          const char *const *names, moe_tensor **out) {
  for (int k = 0; k < n; k++)
    if (!t[k]) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: %s is NULL", fn, names[k]);
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: out is NULL", fn);
  for (int k = 1; k < n; k++)
    MOE_CHECK(moe_check_same_device(ctx, fn, names[0], t[0]->storage->device, names[k],
                                    t[k]->storage->device));
  return moe_device_check(ctx, t[0]->storage->device);
}

static moe_status pw_float_only(moe_ctx *ctx, const char *fn, const char *name, moe_dtype dt) {
  if (moe_dtype_is_float(dt)) return MOE_OK;
  return moe_error(ctx, MOE_ERR_DTYPE,
                   "%s: %s has dtype %s; %s takes float tensors (f32, f64, bf16, f16)", fn, name,
                   moe_dtype_name(dt), fn);
}

/* The broadcast shape of n tensors; the error lists every shape. */
static moe_status pw_broadcast(moe_ctx *ctx, const char *fn, int n, moe_tensor *const *t,
                               int *ndim, int64_t *shape) {
  int nd = 0;
  for (int k = 0; k < n; k++) nd = t[k]->ndim > nd ? t[k]->ndim : nd;
  for (int i = 0; i < nd; i++) {
    int64_t s = 1;
    for (int k = 0; k < n; k++) {
      int d = i - (nd - t[k]->ndim);
      int64_t x = d >= 0 ? t[k]->shape[d] : 1;
      if (x == 1 || x == s) continue;
      if (s != 1) {
        char buf[3][MOE_SHAPE_STR];
        for (int j = 0; j < 3; j++) buf[j][0] = 0;
        for (int j = 0; j < n && j < 3; j++) moe_shape_str(t[j]->ndim, t[j]->shape, buf[j], MOE_SHAPE_STR);
        return moe_error(ctx, MOE_ERR_SHAPE, "%s: shapes %s%s%s%s%s cannot be broadcast together", fn,
                         buf[0], n > 1 ? ", " : "", buf[1], n > 2 ? ", " : "", buf[2]);
      }
      s = x;
    }
    shape[i] = s;
  }
  *ndim = nd;
  return MOE_OK;
}

/* ------------------------------------------------------------ autograd */

/* g (the output's shape) reduced to input i's shape and cast to its dtype;
 * consumes the caller's reference to g. */
static moe_status pw_grad_finish(moe_ctx *ctx, moe_node *n, int i, moe_tensor *g,
                                 moe_tensor **out) {
  moe_tensor *s = NULL, *c = NULL;
  moe_status st = moe_sum_to_shape(ctx, g, n->in_ndim[i], n->in_shape[i], &s);
  moe_tensor_release(g);
  if (st != MOE_OK) return st;
  if (s->dtype == n->in_dtype[i]) {
    *out = s;
    return MOE_OK;
  }
  st = moe_to(ctx, s, n->in_dtype[i], n->in_device[i], &c);
  moe_tensor_release(s);
  if (st != MOE_OK) return st;
  *out = c;
  return MOE_OK;
}

/* Releases the saved tensors fetched into s[0..n). */
static void pw_release_all(int n, moe_tensor **s) {
  for (int k = 0; k < n; k++) moe_tensor_release(s[k]);
}

/* --------------------------------------------------------------- unary */

typedef struct pw_unary_spec {
  moe_op op;      /* for errors and the node */
  moe_pw_kop kop;
  bool ints;      /* also takes integer tensors (abs, clamp) */
} pw_unary_spec;

/* out = kop(x; p0, p1) of dtype dt on x's device (x of any dtype the job's
 * compute type loads). */
static moe_status pw_unary_run(moe_ctx *ctx, moe_pw_kop kop, moe_tensor *x,
                               moe_dtype dt, double p0, double p1, int64_t i0, int64_t i1,
                               moe_tensor **out) {
  moe_device d = x->storage->device;
  moe_tensor *r;
  MOE_CHECK(moe_tensor_empty(ctx, x->ndim, x->shape, dt, d, &r));
  moe_status st = MOE_OK;
  if (moe_tensor_numel(r) > 0) {
    moe_kview vo = moe_kview_of(r), vx = moe_kview_of(x);
    pw_compute c = pw_compute_of(dt);
    if (d.type == MOE_DEVICE_CUDA) {
      st = moe_cuda_pw_unary(ctx, d.index, kop, &vo, &vx, p0, p1, i0, i1);
    } else {
      pw_job jb = pw_job_make(PW_UNARY, kop, c, 1, 1);
      jb.p0 = p0, jb.p1 = p1, jb.i0 = i0, jb.i1 = i1;
      pw_cpu_run(&jb, (const moe_kview *[]){&vo, &vx});
    }
  }
  if (st != MOE_OK) {
    moe_tensor_release(r);
    return st;
  }
  *out = r;
  return MOE_OK;
}

/* gin = g * kop'(x) in x's dtype and shape. */
static moe_status pw_unary_grad_run(moe_ctx *ctx, moe_pw_kop kop, moe_tensor *g,
                                    moe_tensor *x, double p0, double p1, moe_tensor **out) {
  moe_device d = x->storage->device;
  moe_tensor *r;
  MOE_CHECK(moe_tensor_empty(ctx, x->ndim, x->shape, x->dtype, d, &r));
  moe_status st = MOE_OK;
  if (moe_tensor_numel(r) > 0) {
    moe_kview vo = moe_kview_of(r), vg = moe_kview_of(g), vx = moe_kview_of(x);
    if (d.type == MOE_DEVICE_CUDA) {
      st = moe_cuda_pw_unary_grad(ctx, d.index, kop, &vo, &vg, &vx, p0, p1);
    } else {
      pw_job jb = pw_job_make(PW_UNARY_GRAD, kop, pw_compute_of(x->dtype), 1, 2);
      jb.p0 = p0, jb.p1 = p1;
      pw_cpu_run(&jb, (const moe_kview *[]){&vo, &vg, &vx});
    }
  }
  if (st != MOE_OK) {
    moe_tensor_release(r);
    return st;
  }
  *out = r;
  return MOE_OK;
}

/* saved: x; iargs: kop; dargs: p0, p1. */
static moe_status pw_unary_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                    moe_tensor **gin) {
  if (!moe_node_needs_grad(n, 0)) return MOE_OK;
  if (!gout[0]) return moe_node_zeros_input(ctx, n, 0, &gin[0]);
  moe_tensor *x;
  MOE_CHECK(moe_node_saved(ctx, n, 0, &x));
  moe_status st = pw_unary_grad_run(ctx, (moe_pw_kop)n->iargs[0], gout[0], x,
                                    n->dargs[0], n->dargs[1], &gin[0]);
  moe_tensor_release(x);
  return st;
}

/* A float unary op (or abs/clamp of any non-bool dtype), with its node. */
static moe_status pw_unary(moe_ctx *ctx, pw_unary_spec sp, moe_tensor *x, double p0, double p1,
                           moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  const char *fn = moe_op_name(sp.op);
  MOE_CHECK(pw_args(ctx, fn, 1, (moe_tensor *[]){x}, (const char *[]){"x"}, out));
  moe_dtype dt = x->dtype;
  int64_t i0 = INT64_MIN, i1 = INT64_MAX;
  if (sp.ints && !moe_dtype_is_float(dt)) {
    if (dt == MOE_BOOL)
      return moe_error(ctx, MOE_ERR_DTYPE, "%s: x has dtype bool, which %s does not take", fn, fn);
    /* clamp of an integer tensor: integral bounds keep the dtype, a
     * non-integral one gives f32 (as moe_binary_scalar) */
    bool lo = !isnan(p0), hi = !isnan(p1);
    if ((lo && p0 != trunc(p0)) || (hi && p1 != trunc(p1)) || (lo && !isfinite(p0)) ||
        (hi && !isfinite(p1))) {
      dt = MOE_F32;
    } else {
      if (lo) i0 = p0 <= -9223372036854775808.0 ? INT64_MIN : p0 >= 9223372036854775807.0 ? INT64_MAX : (int64_t)p0;
      if (hi) i1 = p1 <= -9223372036854775808.0 ? INT64_MIN : p1 >= 9223372036854775807.0 ? INT64_MAX : (int64_t)p1;
    }
  } else {
    MOE_CHECK(pw_float_only(ctx, fn, "x", dt));
  }
  moe_tensor *r;
  MOE_CHECK(pw_unary_run(ctx, sp.kop, x, dt, p0, p1, i0, i1, &r));
  if (moe_dtype_is_float(x->dtype))
    MOE_CHECK(moe_record(ctx, &(moe_record_spec){.op = sp.op, .backward = pw_unary_backward,
                                                 .n_in = 1, .in = {x}, .n_save = 1, .save = {x},
                                                 .iargs = {sp.kop}, .dargs = {p0, p1}},
                         1, &r));
  *out = r;
  return MOE_OK;
}

moe_status moe_exp(moe_ctx *ctx, moe_tensor *x, moe_tensor **out) {
  return pw_unary(ctx, (pw_unary_spec){MOE_OP_EXP, MOE_PW_EXP, false}, x, 0, 0, out);
}
moe_status moe_log(moe_ctx *ctx, moe_tensor *x, moe_tensor **out) {
  return pw_unary(ctx, (pw_unary_spec){MOE_OP_LOG, MOE_PW_LOG, false}, x, 0, 0, out);
}
moe_status moe_sqrt(moe_ctx *ctx, moe_tensor *x, moe_tensor **out) {
  return pw_unary(ctx, (pw_unary_spec){MOE_OP_SQRT, MOE_PW_SQRT, false}, x, 0, 0, out);
}
moe_status moe_rsqrt(moe_ctx *ctx, moe_tensor *x, moe_tensor **out) {
  return pw_unary(ctx, (pw_unary_spec){MOE_OP_RSQRT, MOE_PW_RSQRT, false}, x, 0, 0, out);
}
moe_status moe_abs(moe_ctx *ctx, moe_tensor *x, moe_tensor **out) {
  return pw_unary(ctx, (pw_unary_spec){MOE_OP_ABS, MOE_PW_ABS, true}, x, 0, 0, out);
}
moe_status moe_relu(moe_ctx *ctx, moe_tensor *x, moe_tensor **out) {
  return pw_unary(ctx, (pw_unary_spec){MOE_OP_RELU, MOE_PW_RELU, false}, x, 0, 0, out);
}
moe_status moe_gelu(moe_ctx *ctx, moe_tensor *x, moe_tensor **out) {
  return pw_unary(ctx, (pw_unary_spec){MOE_OP_GELU, MOE_PW_GELU, false}, x, 0, 0, out);
}
moe_status moe_gelu_tanh(moe_ctx *ctx, moe_tensor *x, moe_tensor **out) {
  return pw_unary(ctx, (pw_unary_spec){MOE_OP_GELU_TANH, MOE_PW_GELU_TANH, false}, x, 0, 0, out);
}
moe_status moe_silu(moe_ctx *ctx, moe_tensor *x, moe_tensor **out) {
  return pw_unary(ctx, (pw_unary_spec){MOE_OP_SILU, MOE_PW_SILU, false}, x, 0, 0, out);
}
moe_status moe_sigmoid(moe_ctx *ctx, moe_tensor *x, moe_tensor **out) {
  return pw_unary(ctx, (pw_unary_spec){MOE_OP_SIGMOID, MOE_PW_SIGMOID, false}, x, 0, 0, out);
}
moe_status moe_tanh(moe_ctx *ctx, moe_tensor *x, moe_tensor **out) {
  return pw_unary(ctx, (pw_unary_spec){MOE_OP_TANH, MOE_PW_TANH, false}, x, 0, 0, out);
}

moe_status moe_pow_scalar(moe_ctx *ctx, moe_tensor *a, double s, moe_tensor **out) {
  return pw_unary(ctx, (pw_unary_spec){MOE_OP_POW, MOE_PW_POW_SCALAR, false}, a, s, 0, out);
}

moe_status moe_rpow_scalar(moe_ctx *ctx, double s, moe_tensor *a, moe_tensor **out) {
  return pw_unary(ctx, (pw_unary_spec){MOE_OP_POW, MOE_PW_RPOW_SCALAR, false}, a, s, 0, out);
}

moe_status moe_clamp(moe_ctx *ctx, moe_tensor *x, double min, double max, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (isnan(min) && isnan(max))
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "clamp: at least one of min and max must be given (both are absent)");
  return pw_unary(ctx, (pw_unary_spec){MOE_OP_CLAMP, MOE_PW_CLAMP, true}, x, min, max, out);
}

/* -------------------------------------------------------------- binary */

/* saved: a, b; iargs: kop. */
static moe_status pw_binary_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                     moe_tensor **gin) {
  bool need[2] = {moe_node_needs_grad(n, 0), moe_node_needs_grad(n, 1)};
  if (!gout[0]) return moe_node_zero_grads(ctx, n, gin);
  moe_tensor *s[2] = {NULL, NULL}, *full[2] = {NULL, NULL};
  moe_status st = moe_node_saved(ctx, n, 0, &s[0]);
  if (st == MOE_OK) st = moe_node_saved(ctx, n, 1, &s[1]);
  moe_tensor *g = gout[0];
  moe_device d = g->storage->device;
  for (int k = 0; k < 2 && st == MOE_OK; k++)
    if (need[k]) st = moe_tensor_empty(ctx, g->ndim, g->shape, g->dtype, d, &full[k]);
  if (st == MOE_OK && moe_tensor_numel(g) > 0) {
    moe_kview vg = moe_kview_of(g);
    moe_kview va = moe_kview_broadcast(s[0], g->ndim, g->shape);
    moe_kview vb = moe_kview_broadcast(s[1], g->ndim, g->shape);
    moe_kview vo[2];
    for (int k = 0; k < 2; k++)
      if (full[k]) vo[k] = moe_kview_of(full[k]);
    if (d.type == MOE_DEVICE_CUDA) {
      st = moe_cuda_pw_binary_grad(ctx, d.index, (moe_pw_kop)n->iargs[0], full[0] ? &vo[0] : NULL,
                                   full[1] ? &vo[1] : NULL, &vg, &va, &vb);
    } else {
      int nout = 0;
      pw_job jb = pw_job_make(PW_BINARY_GRAD, (int)n->iargs[0], pw_compute_of(g->dtype), 0, 3);
      const moe_kview *v[5];
      for (int k = 0; k < 2; k++)
        if (full[k]) jb.ymap[nout] = k, v[nout++] = &vo[k];
      jb.nout = nout;
      v[nout] = &vg, v[nout + 1] = &va, v[nout + 2] = &vb;
      pw_cpu_run(&jb, v);
    }
  }
  pw_release_all(2, s);
  for (int k = 0; k < 2; k++) {
    if (!full[k]) continue;
    if (st == MOE_OK) st = pw_grad_finish(ctx, n, k, full[k], &gin[k]);
    else moe_tensor_release(full[k]);
  }
  return st;
}

static moe_status pw_binary(moe_ctx *ctx, moe_op op, moe_pw_kop kop, moe_tensor *a,
                            moe_tensor *b, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  const char *fn = moe_op_name(op);
  moe_tensor *const in[2] = {a, b};
  MOE_CHECK(pw_args(ctx, fn, 2, in, (const char *[]){"a", "b"}, out));
  int ndim = 0;
  int64_t shape[MOE_MAX_DIMS];
  MOE_CHECK(pw_broadcast(ctx, fn, 2, in, &ndim, shape));
  moe_dtype dt = moe_dtype_promote(a->dtype, b->dtype);
  if (kop == MOE_PW_POW) {
    MOE_CHECK(pw_float_only(ctx, fn, "a", a->dtype));
    MOE_CHECK(pw_float_only(ctx, fn, "b", b->dtype));
  }
  moe_device d = a->storage->device;
  moe_tensor *r;
  MOE_CHECK(moe_tensor_empty(ctx, ndim, shape, dt, d, &r));
  moe_status st = MOE_OK;
  if (moe_tensor_numel(r) > 0) {
    moe_kview vo = moe_kview_of(r), va = moe_kview_broadcast(a, ndim, shape),
              vb = moe_kview_broadcast(b, ndim, shape);
    if (d.type == MOE_DEVICE_CUDA) {
      st = moe_cuda_pw_binary(ctx, d.index, kop, &vo, &va, &vb);
    } else {
      pw_job jb = pw_job_make(PW_BINARY, kop, pw_compute_of(dt), 1, 2);
      pw_cpu_run(&jb, (const moe_kview *[]){&vo, &va, &vb});
    }
  }
  if (st != MOE_OK) {
    moe_tensor_release(r);
    return st;
  }
  if (moe_dtype_is_float(dt))
    MOE_CHECK(moe_record(ctx, &(moe_record_spec){.op = op, .backward = pw_binary_backward,
                                                 .n_in = 2, .in = {a, b}, .n_save = 2,
                                                 .save = {a, b}, .iargs = {kop}},
                         1, &r));
  *out = r;
  return MOE_OK;
}

moe_status moe_pow(moe_ctx *ctx, moe_tensor *a, moe_tensor *b, moe_tensor **out) {
  return pw_binary(ctx, MOE_OP_POW, MOE_PW_POW, a, b, out);
}
moe_status moe_maximum(moe_ctx *ctx, moe_tensor *a, moe_tensor *b, moe_tensor **out) {
  return pw_binary(ctx, MOE_OP_MAXIMUM, MOE_PW_MAXIMUM, a, b, out);
}
moe_status moe_minimum(moe_ctx *ctx, moe_tensor *a, moe_tensor *b, moe_tensor **out) {
  return pw_binary(ctx, MOE_OP_MINIMUM, MOE_PW_MINIMUM, a, b, out);
}

/* --------------------------------------------------------- comparisons */

static bool pw_is_compare(moe_op op) {
  return op == MOE_OP_EQ || op == MOE_OP_NE || op == MOE_OP_LT || op == MOE_OP_LE ||
         op == MOE_OP_GT || op == MOE_OP_GE;
}

/* b NULL: compare with s. cdt: MOE_F64 for a comparison in double, MOE_I64
 * for one in int64. */
static moe_status pw_compare_run(moe_ctx *ctx, moe_op op, moe_tensor *a, moe_tensor *b, double s,
                                 moe_dtype cdt, int ndim, const int64_t *shape, moe_tensor **out) {
  moe_device d = a->storage->device;
  moe_tensor *r;
  MOE_CHECK(moe_tensor_empty(ctx, ndim, shape, MOE_BOOL, d, &r));
  moe_status st = MOE_OK;
  if (moe_tensor_numel(r) > 0) {
    moe_kview vo = moe_kview_of(r), va = moe_kview_broadcast(a, ndim, shape), vb;
    union { double d; int64_t i; } sv;
    if (b) {
      vb = moe_kview_broadcast(b, ndim, shape);
    } else { /* the scalar as a stride-0 operand of the compute type */
      memset(&vb, 0, sizeof(vb));
      vb.ndim = ndim;
      memcpy(vb.shape, shape, sizeof(int64_t) * (size_t)ndim);
      vb.data = &sv;
      if (cdt == MOE_F64) vb.dtype = MOE_F64, sv.d = s;
      else vb.dtype = MOE_I64, sv.i = (int64_t)s; /* s is integral and in range here */
    }
    if (d.type == MOE_DEVICE_CUDA) {
      st = moe_cuda_pw_compare(ctx, d.index, op, cdt, &vo, &va, b ? &vb : NULL, s);
    } else {
      pw_job jb = pw_job_make(PW_COMPARE, op, cdt == MOE_F64 ? PW_C_F64 : PW_C_I64, 1, 2);
      pw_cpu_run(&jb, (const moe_kview *[]){&vo, &va, &vb});
    }
  }
  if (st != MOE_OK) {
    moe_tensor_release(r);
    return st;
  }
  *out = r;
  return MOE_OK;
}

moe_status moe_compare(moe_ctx *ctx, moe_op op, moe_tensor *a, moe_tensor *b, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!pw_is_compare(op))
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "compare: %s (op %d) is not a comparison",
                     moe_op_name(op), (int)op);
  const char *fn = moe_op_name(op);
  moe_tensor *const in[2] = {a, b};
  MOE_CHECK(pw_args(ctx, fn, 2, in, (const char *[]){"a", "b"}, out));
  int ndim = 0;
  int64_t shape[MOE_MAX_DIMS];
  MOE_CHECK(pw_broadcast(ctx, fn, 2, in, &ndim, shape));
  moe_dtype cdt = moe_dtype_is_float(a->dtype) || moe_dtype_is_float(b->dtype) ? MOE_F64 : MOE_I64;
  return pw_compare_run(ctx, op, a, b, 0, cdt, ndim, shape, out);
}

moe_status moe_compare_scalar(moe_ctx *ctx, moe_op op, moe_tensor *a, double s,
                              moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!pw_is_compare(op))
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "compare_scalar: %s (op %d) is not a comparison",
                     moe_op_name(op), (int)op);
  const char *fn = moe_op_name(op);
  MOE_CHECK(pw_args(ctx, fn, 1, (moe_tensor *[]){a}, (const char *[]){"a"}, out));
  /* int64 only when exact: an integer tensor and an integral scalar in range */
  bool exact_int = !moe_dtype_is_float(a->dtype) && isfinite(s) && s == trunc(s) &&
                   s >= -9223372036854775808.0 && s < 9223372036854775808.0;
  return pw_compare_run(ctx, op, a, NULL, s, exact_int ? MOE_I64 : MOE_F64, a->ndim, a->shape, out);
}

/* --------------------------------------------------------------- where */

/* saved: cond. Gradients: where(cond, g, 0) to a, where(cond, 0, g) to b. */
static moe_status pw_where_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                    moe_tensor **gin) {
  /* inputs of the node: 0 = a, 1 = b (cond is not differentiable) */
  bool need[2] = {moe_node_needs_grad(n, 0), moe_node_needs_grad(n, 1)};
  if (!gout[0]) return moe_node_zero_grads(ctx, n, gin);
  moe_tensor *g = gout[0], *cond = NULL, *zero = NULL;
  moe_status st = moe_node_saved(ctx, n, 0, &cond);
  if (st == MOE_OK) st = moe_tensor_full(ctx, 0, NULL, 0.0, g->dtype, g->storage->device, &zero);
  for (int k = 0; k < 2 && st == MOE_OK; k++) {
    if (!need[k]) continue;
    moe_tensor *full = NULL;
    st = moe_where(ctx, cond, k == 0 ? g : zero, k == 0 ? zero : g, &full);
    if (st == MOE_OK) st = pw_grad_finish(ctx, n, k, full, &gin[k]);
  }
  moe_tensor_release(zero);
  moe_tensor_release(cond);
  return st;
}

moe_status moe_where(moe_ctx *ctx, moe_tensor *cond, moe_tensor *a, moe_tensor *b,
                     moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  const char *fn = "where";
  moe_tensor *const in[3] = {cond, a, b};
  MOE_CHECK(pw_args(ctx, fn, 3, in, (const char *[]){"cond", "a", "b"}, out));
  if (cond->dtype != MOE_BOOL)
    return moe_error(ctx, MOE_ERR_DTYPE, "where: cond must be a bool tensor, got %s",
                     moe_dtype_name(cond->dtype));
  int ndim = 0;
  int64_t shape[MOE_MAX_DIMS];
  MOE_CHECK(pw_broadcast(ctx, fn, 3, in, &ndim, shape));
  moe_dtype dt = moe_dtype_promote(a->dtype, b->dtype);
  moe_device d = a->storage->device;
  moe_tensor *r;
  MOE_CHECK(moe_tensor_empty(ctx, ndim, shape, dt, d, &r));
  moe_status st = MOE_OK;
  if (moe_tensor_numel(r) > 0) {
    moe_kview vo = moe_kview_of(r), vc = moe_kview_broadcast(cond, ndim, shape),
              va = moe_kview_broadcast(a, ndim, shape), vb = moe_kview_broadcast(b, ndim, shape);
    if (d.type == MOE_DEVICE_CUDA) {
      st = moe_cuda_pw_where(ctx, d.index, &vo, &vc, &va, &vb);
    } else {
      pw_job jb = pw_job_make(PW_WHERE, 0, pw_compute_of(dt), 1, 3);
      pw_cpu_run(&jb, (const moe_kview *[]){&vo, &vc, &va, &vb});
    }
  }
  if (st != MOE_OK) {
    moe_tensor_release(r);
    return st;
  }
  if (moe_dtype_is_float(dt))
    MOE_CHECK(moe_record(ctx, &(moe_record_spec){.op = MOE_OP_WHERE,
                                                 .backward = pw_where_backward, .n_in = 2,
                                                 .in = {a, b}, .n_save = 1, .save = {cond}},
                         1, &r));
  *out = r;
  return MOE_OK;
}

/* -------------------------------------------------------------- swiglu */

/* saved: gate, up. */
static moe_status pw_swiglu_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                     moe_tensor **gin) {
  bool need[2] = {moe_node_needs_grad(n, 0), moe_node_needs_grad(n, 1)};
  if (!gout[0]) return moe_node_zero_grads(ctx, n, gin);
  moe_tensor *s[2] = {NULL, NULL}, *r[2] = {NULL, NULL}, *g = gout[0];
  moe_status st = moe_node_saved(ctx, n, 0, &s[0]);
  if (st == MOE_OK) st = moe_node_saved(ctx, n, 1, &s[1]);
  moe_device d = g->storage->device;
  for (int k = 0; k < 2 && st == MOE_OK; k++)
    if (need[k]) st = moe_tensor_empty(ctx, g->ndim, g->shape, n->in_dtype[k], d, &r[k]);
  if (st == MOE_OK && moe_tensor_numel(g) > 0) {
    moe_kview vg = moe_kview_of(g), vgate = moe_kview_of(s[0]), vup = moe_kview_of(s[1]), vo[2];
    for (int k = 0; k < 2; k++)
      if (r[k]) vo[k] = moe_kview_of(r[k]);
    if (d.type == MOE_DEVICE_CUDA) {
      st = moe_cuda_pw_swiglu_grad(ctx, d.index, r[0] ? &vo[0] : NULL, r[1] ? &vo[1] : NULL, &vg,
                                   &vgate, &vup);
    } else {
      int nout = 0;
      pw_job jb = pw_job_make(PW_SWIGLU_GRAD, 0, pw_compute_of(g->dtype), 0, 3);
      const moe_kview *v[5];
      for (int k = 0; k < 2; k++)
        if (r[k]) jb.ymap[nout] = k, v[nout++] = &vo[k];
      jb.nout = nout;
      v[nout] = &vg, v[nout + 1] = &vgate, v[nout + 2] = &vup;
      pw_cpu_run(&jb, v);
    }
  }
  pw_release_all(2, s);
  for (int k = 0; k < 2; k++) {
    if (st == MOE_OK) gin[k] = r[k];
    else moe_tensor_release(r[k]);
  }
  return st;
}

moe_status moe_swiglu(moe_ctx *ctx, moe_tensor *gate, moe_tensor *up, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  moe_tensor *const in[2] = {gate, up};
  MOE_CHECK(pw_args(ctx, "swiglu", 2, in, (const char *[]){"gate", "up"}, out));
  MOE_CHECK(pw_float_only(ctx, "swiglu", "gate", gate->dtype));
  MOE_CHECK(moe_check_same_dtype(ctx, "swiglu", "gate", gate->dtype, "up", up->dtype));
  bool same = gate->ndim == up->ndim;
  for (int k = 0; same && k < gate->ndim; k++) same = gate->shape[k] == up->shape[k];
  if (!same)
    return moe_error(ctx, MOE_ERR_SHAPE, "swiglu: gate %s and up %s must have the same shape",
                     MOE_SHAPE(gate), MOE_SHAPE(up));
  moe_device d = gate->storage->device;
  moe_tensor *r;
  MOE_CHECK(moe_tensor_empty(ctx, gate->ndim, gate->shape, gate->dtype, d, &r));
  moe_status st = MOE_OK;
  if (moe_tensor_numel(r) > 0) {
    moe_kview vo = moe_kview_of(r), vg = moe_kview_of(gate), vu = moe_kview_of(up);
    if (d.type == MOE_DEVICE_CUDA) {
      st = moe_cuda_pw_swiglu(ctx, d.index, &vo, &vg, &vu);
    } else {
      pw_job jb = pw_job_make(PW_SWIGLU, 0, pw_compute_of(gate->dtype), 1, 2);
      pw_cpu_run(&jb, (const moe_kview *[]){&vo, &vg, &vu});
    }
  }
  if (st != MOE_OK) {
    moe_tensor_release(r);
    return st;
  }
  MOE_CHECK(moe_record(ctx, &(moe_record_spec){.op = MOE_OP_SWIGLU, .backward = pw_swiglu_backward,
                                               .n_in = 2, .in = {gate, up}, .n_save = 2,
                                               .save = {gate, up}},
                       1, &r));
  *out = r;
  return MOE_OK;
}

/* ------------------------------------------------------------- dropout */

/* out = keep ? x * scale : 0, out of x's shape and dtype (dense). */
static moe_status pw_dropout_run(moe_ctx *ctx, moe_tensor *x, uint64_t seed, uint64_t call,
                                 uint32_t thr, double scale, moe_tensor **out) {
  moe_device d = x->storage->device;
  moe_tensor *r;
  MOE_CHECK(moe_tensor_empty(ctx, x->ndim, x->shape, x->dtype, d, &r));
  moe_status st = MOE_OK;
  if (moe_tensor_numel(r) > 0) {
    moe_kview vo = moe_kview_of(r), vx = moe_kview_of(x);
    if (d.type == MOE_DEVICE_CUDA) {
      st = moe_cuda_pw_dropout(ctx, d.index, &vo, &vx, seed, call, thr, scale);
    } else {
      pw_job jb = pw_job_make(PW_DROPOUT, 0, pw_compute_of(x->dtype), 1, 1);
      jb.seed = seed, jb.call = call, jb.thr = thr, jb.scale = scale;
      pw_cpu_run(&jb, (const moe_kview *[]){&vo, &vx});
    }
  }
  if (st != MOE_OK) {
    moe_tensor_release(r);
    return st;
  }
  *out = r;
  return MOE_OK;
}

/* No saved tensors; iargs: seed, call, threshold; dargs: scale. The mask is
 * regenerated: the gradient is dropout of g with the forward's (seed, call). */
static moe_status pw_dropout_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                      moe_tensor **gin) {
  if (!moe_node_needs_grad(n, 0)) return MOE_OK;
  if (!gout[0]) return moe_node_zeros_input(ctx, n, 0, &gin[0]);
  return pw_dropout_run(ctx, gout[0], (uint64_t)n->iargs[0], (uint64_t)n->iargs[1],
                        (uint32_t)n->iargs[2], n->dargs[0], &gin[0]);
}

moe_status moe_dropout(moe_ctx *ctx, moe_tensor *x, double p, bool training, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(pw_args(ctx, "dropout", 1, (moe_tensor *[]){x}, (const char *[]){"x"}, out));
  MOE_CHECK(pw_float_only(ctx, "dropout", "x", x->dtype));
  if (!(p >= 0.0 && p <= 1.0))
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "dropout: p must be in [0, 1], got %g", p);
  if (!training || p == 0.0) {
    moe_tensor_retain(x);
    *out = x;
    return MOE_OK;
  }
  uint64_t seed = ctx->rng_seed, call = ctx->rng_call;
  uint32_t thr = moe_pw_dropout_threshold(p);
  double scale = p >= 1.0 ? 0.0 : 1.0 / (1.0 - p);
  moe_tensor *r;
  MOE_CHECK(pw_dropout_run(ctx, x, seed, call, thr, scale, &r));
  ctx->rng_call++;
  MOE_CHECK(moe_record(ctx, &(moe_record_spec){.op = MOE_OP_DROPOUT,
                                               .backward = pw_dropout_backward, .n_in = 1,
                                               .in = {x},
                                               .iargs = {(int64_t)seed, (int64_t)call,
                                                         (int64_t)thr},
                                               .dargs = {scale}},
                       1, &r));
  *out = r;
  return MOE_OK;
}
