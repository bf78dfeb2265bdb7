/*
 * elementwise.c - the elementwise ops of moe.h: binary with broadcasting and
 * dtype promotion, binary with a scalar, unary (add, sub, mul, div, neg).
 * Each validates, allocates its output on the input's device, then calls
 * the CUDA entry point of internal.h (kernels/elementwise.cu) or the CPU
 * loop here. The op names are in op_table.c.
 *
 * Math by result dtype: f32/bf16/f16 in float, f64 in double, integers and
 * bool in int64 with wrap-around (done in uint64, so overflow is defined).
 * The CPU loop treats a scalar as a one-element operand of stride 0, stored
 * in the math type, so one loop serves all three op kinds.
 *
 * Autograd: each op records its node when an input requires grad; the
 * backward reduces broadcast gradients with moe_sum_to_shape and gives each
 * input a gradient of its own dtype.
 */
#include <math.h>
#include <string.h>

#include "cpu_loop.h"
#include "internal.h"

static bool op_is_binary(moe_op op) {
  return op == MOE_OP_ADD || op == MOE_OP_SUB || op == MOE_OP_MUL || op == MOE_OP_DIV;
}

/* ------------------------------------------------------------ CPU loops */

static float apply_f32(moe_op op, float x, float y) {
  switch (op) {
    case MOE_OP_ADD: return x + y;
    case MOE_OP_SUB: return x - y;
    case MOE_OP_MUL: return x * y;
    case MOE_OP_DIV: return x / y;
    default: return -x;
  }
}

static double apply_f64(moe_op op, double x, double y) {
  switch (op) {
    case MOE_OP_ADD: return x + y;
    case MOE_OP_SUB: return x - y;
    case MOE_OP_MUL: return x * y;
    case MOE_OP_DIV: return x / y;
    default: return -x;
  }
}

static int64_t apply_i64(moe_op op, int64_t x, int64_t y) {
  uint64_t ux = (uint64_t)x, uy = (uint64_t)y;
  switch (op) {
    case MOE_OP_ADD: return (int64_t)(ux + uy);
    case MOE_OP_SUB: return (int64_t)(ux - uy);
    case MOE_OP_MUL: return (int64_t)(ux * uy);
    case MOE_OP_DIV: /* integer DIV gives f32 and never comes here; defined anyway */
      return y == 0 ? 0 : (y == -1 ? (int64_t)(0 - ux) : x / y);
    default: return (int64_t)(0 - ux);
  }
}

/* n elements of o = a op b, all f32; strides in elements. */
static void row_f32(moe_op op, int64_t n, float *o, int64_t so, const float *a, int64_t sa,
                    const float *b, int64_t sb) {
  if (so == 1 && sa == 1 && sb == 1) { /* vectorisable */
    switch (op) {
      case MOE_OP_ADD: for (int64_t j = 0; j < n; j++) o[j] = a[j] + b[j]; return;
      case MOE_OP_SUB: for (int64_t j = 0; j < n; j++) o[j] = a[j] - b[j]; return;
      case MOE_OP_MUL: for (int64_t j = 0; j < n; j++) o[j] = a[j] * b[j]; return;
      case MOE_OP_DIV: for (int64_t j = 0; j < n; j++) o[j] = a[j] / b[j]; return;
      default: for (int64_t j = 0; j < n; j++) o[j] = -a[j]; return;
    }
  }
  for (int64_t j = 0; j < n; j++) o[j * so] = apply_f32(op, a[j * sa], b[j * sb]);
}

static void row_f64(moe_op op, int64_t n, double *o, int64_t so, const double *a, int64_t sa,
                    const double *b, int64_t sb) {
  if (so == 1 && sa == 1 && sb == 1) {
    switch (op) {
      case MOE_OP_ADD: for (int64_t j = 0; j < n; j++) o[j] = a[j] + b[j]; return;
      case MOE_OP_SUB: for (int64_t j = 0; j < n; j++) o[j] = a[j] - b[j]; return;
      case MOE_OP_MUL: for (int64_t j = 0; j < n; j++) o[j] = a[j] * b[j]; return;
      case MOE_OP_DIV: for (int64_t j = 0; j < n; j++) o[j] = a[j] / b[j]; return;
      default: for (int64_t j = 0; j < n; j++) o[j] = -a[j]; return;
    }
  }
  for (int64_t j = 0; j < n; j++) o[j * so] = apply_f64(op, a[j * sa], b[j * sb]);
}

/* out = a op b (b is ignored by NEG); all views have out's shape. */
static void cpu_elementwise(moe_op op, const moe_kview *out, const moe_kview *a,
                            const moe_kview *b) {
  moe_loop l;
  moe_loop_init(&l, 3, (const moe_kview *[]){out, a, b});
  moe_dtype dt = out->dtype;
  bool same = a->dtype == dt && b->dtype == dt;
  int64_t eo = (int64_t)moe_dtype_size(dt), ea = (int64_t)moe_dtype_size(a->dtype),
          eb = (int64_t)moe_dtype_size(b->dtype);
#pragma omp parallel for if (l.numel >= MOE_LOOP_PAR_MIN) schedule(static)
  for (int64_t k = 0; k < l.tasks; k++) {
    int64_t off[MOE_LOOP_MAX_OPS], first;
    int64_t n = moe_loop_task(&l, k, off, &first);
    char *po = (char *)out->data + off[0] * eo;
    const char *pa = (const char *)a->data + off[1] * ea, *pb = (const char *)b->data + off[2] * eb;
    int64_t so = l.inner_stride[0], sa = l.inner_stride[1], sb = l.inner_stride[2];
    if (same && dt == MOE_F32) {
      row_f32(op, n, (float *)po, so, (const float *)pa, sa, (const float *)pb, sb);
    } else if (same && dt == MOE_F64) {
      row_f64(op, n, (double *)po, so, (const double *)pa, sa, (const double *)pb, sb);
    } else if (dt == MOE_F64) {
      for (int64_t j = 0; j < n; j++, po += so * eo, pa += sa * ea, pb += sb * eb)
        moe_store_f64(po, dt, apply_f64(op, moe_load_f64(pa, a->dtype), moe_load_f64(pb, b->dtype)));
    } else if (moe_dtype_is_float(dt)) {
      for (int64_t j = 0; j < n; j++, po += so * eo, pa += sa * ea, pb += sb * eb) {
        float x = (float)moe_load_f64(pa, a->dtype), y = (float)moe_load_f64(pb, b->dtype);
        moe_store_f64(po, dt, apply_f32(op, x, y));
      }
    } else {
      for (int64_t j = 0; j < n; j++, po += so * eo, pa += sa * ea, pb += sb * eb)
        moe_store_i64(po, dt, apply_i64(op, moe_load_i64(pa, a->dtype), moe_load_i64(pb, b->dtype)));
    }
  }
}

/* ------------------------------------------------------------- backward */
/*
 * Saved slots: binary MUL saves (b if a needs grad, a if b needs grad); DIV
 * saves (b, a if b needs grad); scalar DIV with the scalar first saves a.
 * dargs[0] is the scalar, iargs[0] whether it came first (reverse).
 */

/* The gradient g of the output, reduced to input i's shape and converted to
 * its dtype (g consumed). */
static moe_status grad_to_input(moe_ctx *ctx, const moe_node *n, int i, moe_tensor *g,
                                moe_tensor **out) {
  moe_tensor *r;
  moe_status st = moe_sum_to_shape(ctx, g, n->in_ndim[i], n->in_shape[i], &r);
  moe_tensor_release(g);
  if (st != MOE_OK) return st;
  if (r->dtype == n->in_dtype[i]) {
    *out = r;
    return MOE_OK;
  }
  st = moe_to(ctx, r, n->in_dtype[i], n->in_device[i], out);
  moe_tensor_release(r);
  return st;
}

/* g op x with x saved in slot k. */
static moe_status grad_with_saved(moe_ctx *ctx, moe_node *n, moe_op op, moe_tensor *g, int k,
                                  moe_tensor **out) {
  moe_tensor *x;
  MOE_CHECK(moe_node_saved(ctx, n, k, &x));
  moe_status st = moe_binary(ctx, op, g, x, out);
  moe_tensor_release(x);
  return st;
}

static moe_status binary_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                  moe_tensor **gin) {
  moe_tensor *g = gout[0], *t = NULL, *u = NULL;
  moe_status st = MOE_OK;
  for (int i = 0; i < 2 && st == MOE_OK; i++) {
    if (!moe_node_needs_grad(n, i)) continue;
    t = NULL;
    switch (n->op) {
      case MOE_OP_ADD:
        moe_tensor_retain(g);
        t = g;
        break;
      case MOE_OP_SUB:
        if (i == 0) {
          moe_tensor_retain(g);
          t = g;
        } else {
          st = moe_unary(ctx, MOE_OP_NEG, g, &t);
        }
        break;
      case MOE_OP_MUL: /* d(a*b)/da = b (slot 0), d/db = a (slot 1) */
        st = grad_with_saved(ctx, n, MOE_OP_MUL, g, i, &t);
        break;
      default: /* DIV: d/da = 1/b, d/db = -a/b^2 */
        if (i == 0) {
          st = grad_with_saved(ctx, n, MOE_OP_DIV, g, 0, &t);
        } else {
          st = grad_with_saved(ctx, n, MOE_OP_MUL, g, 1, &u);   /* g*a */
          if (st == MOE_OK) st = grad_with_saved(ctx, n, MOE_OP_DIV, u, 0, &t); /* g*a/b */
          moe_tensor_release(u);
          u = t;
          t = NULL;
          if (st == MOE_OK) st = grad_with_saved(ctx, n, MOE_OP_DIV, u, 0, &t); /* g*a/b^2 */
          moe_tensor_release(u);
          u = t;
          t = NULL;
          if (st == MOE_OK) st = moe_unary(ctx, MOE_OP_NEG, u, &t);
          moe_tensor_release(u);
          u = NULL;
        }
        break;
    }
    if (st == MOE_OK) st = grad_to_input(ctx, n, i, t, &gin[i]);
    else moe_tensor_release(t);
  }
  return st;
}

static moe_status scalar_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                  moe_tensor **gin) {
  if (!moe_node_needs_grad(n, 0)) return MOE_OK;
  moe_tensor *g = gout[0], *t = NULL, *u = NULL;
  double s = n->dargs[0];
  bool reverse = n->iargs[0] != 0;
  moe_status st = MOE_OK;
  switch (n->op) {
    case MOE_OP_ADD:
      moe_tensor_retain(g);
      t = g;
      break;
    case MOE_OP_SUB: /* a - s, or s - a */
      if (reverse) {
        st = moe_unary(ctx, MOE_OP_NEG, g, &t);
      } else {
        moe_tensor_retain(g);
        t = g;
      }
      break;
    case MOE_OP_MUL:
      st = moe_binary_scalar(ctx, MOE_OP_MUL, g, s, false, &t);
      break;
    case MOE_OP_NEG:
      st = moe_unary(ctx, MOE_OP_NEG, g, &t);
      break;
    default: /* DIV: a / s, or s / a whose gradient is -s g / a^2 */
      if (!reverse) {
        st = moe_binary_scalar(ctx, MOE_OP_DIV, g, s, false, &t);
        break;
      }
      st = moe_binary_scalar(ctx, MOE_OP_MUL, g, -s, false, &u);
      if (st == MOE_OK) st = grad_with_saved(ctx, n, MOE_OP_DIV, u, 0, &t);
      moe_tensor_release(u);
      u = t;
      t = NULL;
      if (st == MOE_OK) st = grad_with_saved(ctx, n, MOE_OP_DIV, u, 0, &t);
      moe_tensor_release(u);
      break;
  }
  if (st != MOE_OK) {
    moe_tensor_release(t);
    return st;
  }
  return grad_to_input(ctx, n, 0, t, &gin[0]);
}

/* ------------------------------------------------------------- dispatch */

static moe_status op_args(moe_ctx *ctx, const char *fn, const moe_tensor *a, const moe_tensor *b,
                          bool has_b, moe_tensor **out) {
  if (!a) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: first operand is NULL", fn);
  if (has_b && !b) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: second operand is NULL", fn);
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: out is NULL", fn);
  if (has_b)
    MOE_CHECK(moe_check_same_device(ctx, fn, "a", a->storage->device, "b", b->storage->device));
  return moe_device_check(ctx, a->storage->device);
}

/* Allocates out (shape, dt, a's device) and runs out = a op b, where a and b
 * broadcast to shape. Without b: the scalar s, which `scalar` describes for
 * the CPU loop; without either: the unary op on a. */
static moe_status elementwise_run(moe_ctx *ctx, moe_op op, int ndim, const int64_t *shape,
                                  moe_dtype dt, const moe_tensor *a, const moe_tensor *b,
                                  const moe_kview *scalar, double s, bool reverse,
                                  moe_tensor **out) {
  moe_device d = a->storage->device;
  moe_tensor *r;
  MOE_CHECK(moe_tensor_empty(ctx, ndim, shape, dt, d, &r));
  moe_status st = MOE_OK;
  if (moe_tensor_numel(r) > 0) {
    moe_kview vo = moe_kview_of(r), va = moe_kview_broadcast(a, ndim, shape);
    moe_kview vb = b ? moe_kview_broadcast(b, ndim, shape) : scalar ? *scalar : va;
    if (d.type == MOE_DEVICE_CUDA) {
      if (!op_is_binary(op))
        st = moe_cuda_unary(ctx, d.index, op, &vo, &va);
      else if (b)
        st = moe_cuda_binary(ctx, d.index, op, &vo, &va, &vb);
      else
        st = moe_cuda_binary_scalar(ctx, d.index, op, &vo, &va, s, reverse);
    } else if (reverse) {
      cpu_elementwise(op, &vo, &vb, &va);
    } else {
      cpu_elementwise(op, &vo, &va, &vb);
    }
  }
  if (st != MOE_OK) {
    moe_tensor_release(r);
    return st;
  }
  *out = r;
  return MOE_OK;
}

moe_status moe_binary(moe_ctx *ctx, moe_op op, const moe_tensor *a, const moe_tensor *b,
                      moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!op_is_binary(op))
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "binary: %s (op %d) is not a binary op",
                     moe_op_name(op), (int)op);
  const char *fn = moe_op_name(op);
  MOE_CHECK(op_args(ctx, fn, a, b, true, out));
  int ndim = a->ndim > b->ndim ? a->ndim : b->ndim;
  int64_t shape[MOE_MAX_DIMS];
  for (int i = 0; i < ndim; i++) {
    int da = i - (ndim - a->ndim), db = i - (ndim - b->ndim);
    int64_t x = da >= 0 ? a->shape[da] : 1, y = db >= 0 ? b->shape[db] : 1;
    if (x != y && x != 1 && y != 1)
      return moe_error(ctx, MOE_ERR_SHAPE, "%s: shapes %s and %s cannot be broadcast", fn,
                       MOE_SHAPE(a),
                       MOE_SHAPE(b));
    shape[i] = x == 1 ? y : x;
  }
  if (op == MOE_OP_SUB && a->dtype == MOE_BOOL && b->dtype == MOE_BOOL)
    return moe_error(ctx, MOE_ERR_DTYPE,
                     "sub: subtracting two bool tensors is not supported (convert one with to)");
  moe_dtype dt = moe_dtype_promote(a->dtype, b->dtype);
  if (op == MOE_OP_DIV && !moe_dtype_is_float(dt)) dt = MOE_F32;
  moe_tensor *r;
  MOE_CHECK(elementwise_run(ctx, op, ndim, shape, dt, a, b, NULL, 0, false, &r));
  if (moe_dtype_is_float(dt)) { /* saved slots: see the backward section */
    moe_tensor *ta = (moe_tensor *)a, *tb = (moe_tensor *)b;
    moe_record_spec spec = {.op = op, .backward = binary_backward, .n_in = 2, .in = {ta, tb}};
    if (op == MOE_OP_MUL || op == MOE_OP_DIV) {
      spec.n_save = 2;
      spec.save[0] = op == MOE_OP_DIV || moe_requires_grad(a) ? tb : NULL;
      spec.save[1] = moe_requires_grad(b) ? ta : NULL;
    }
    MOE_CHECK(moe_record(ctx, &spec, 1, &r));
  }
  *out = r;
  return MOE_OK;
}

moe_status moe_binary_scalar(moe_ctx *ctx, moe_op op, const moe_tensor *a, double s,
                             bool reverse, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!op_is_binary(op))
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "binary_scalar: %s (op %d) is not a binary op",
                     moe_op_name(op), (int)op);
  MOE_CHECK(op_args(ctx, moe_op_name(op), a, NULL, false, out));
  /* a scalar never widens a float tensor; an integer one goes to f32 for a
   * non-integer scalar or DIV; bool with an integer scalar goes to i64 */
  moe_dtype dt = a->dtype;
  bool integral = isfinite(s) && s == trunc(s);
  if (!moe_dtype_is_float(dt) && (op == MOE_OP_DIV || !integral))
    dt = MOE_F32;
  else if (dt == MOE_BOOL)
    dt = MOE_I64;
  /* the scalar as a stride-0 operand in the math type of dt */
  union { float f; double d; int64_t i; } sv;
  moe_kview vs;
  memset(&vs, 0, sizeof(vs));
  vs.data = &sv;
  vs.ndim = a->ndim;
  memcpy(vs.shape, a->shape, sizeof(vs.shape));
  if (dt == MOE_F64) {
    vs.dtype = MOE_F64, sv.d = s;
  } else if (moe_dtype_is_float(dt)) {
    vs.dtype = MOE_F32, sv.f = (float)s;
  } else {
    vs.dtype = MOE_I64;
    sv.i = s >= 9223372036854775807.0 ? INT64_MAX : s <= -9223372036854775808.0 ? INT64_MIN : (int64_t)s;
  }
  moe_tensor *r;
  MOE_CHECK(elementwise_run(ctx, op, a->ndim, a->shape, dt, a, NULL, &vs, s, reverse, &r));
  if (moe_dtype_is_float(dt)) {
    bool save_a = op == MOE_OP_DIV && reverse; /* s / a */
    MOE_CHECK(moe_record(ctx, &(moe_record_spec){.op = op, .backward = scalar_backward, .n_in = 1,
                                                 .in = {(moe_tensor *)a}, .n_save = save_a,
                                                 .save = {(moe_tensor *)a}, .iargs = {reverse},
                                                 .dargs = {s}},
                         1, &r));
  }
  *out = r;
  return MOE_OK;
}

moe_status moe_unary(moe_ctx *ctx, moe_op op, const moe_tensor *a, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (op != MOE_OP_NEG)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "unary: %s (op %d) is not a unary op",
                     moe_op_name(op), (int)op);
  MOE_CHECK(op_args(ctx, "neg", a, NULL, false, out));
  if (a->dtype == MOE_BOOL)
    return moe_error(ctx, MOE_ERR_DTYPE,
                     "neg: negating a bool tensor is not supported (convert it with to first)");
  moe_tensor *r;
  MOE_CHECK(elementwise_run(ctx, op, a->ndim, a->shape, a->dtype, a, NULL, NULL, 0, false, &r));
  if (moe_dtype_is_float(a->dtype))
    MOE_CHECK(moe_record(ctx, &(moe_record_spec){.op = op, .backward = scalar_backward, .n_in = 1,
                                                 .in = {(moe_tensor *)a}},
                         1, &r));
  *out = r;
  return MOE_OK;
}
