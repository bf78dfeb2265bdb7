/*
 * reduce.c - reductions: sum (moe.h), mean, max, min, argmax, argmin,
 * norm, logsumexp, var, softmax, log_softmax, cumsum (moe_reduce.h). Each
 * op validates, allocates its outputs (contiguous) on the input's device,
 * runs the CPU reference here or the CUDA launcher of reduce_cuda.h, and
 * records its autograd node with a backward function written here. The
 * norms live in norm.c, the losses in loss.c; the row machinery all three
 * share in rows.h / rows.c.
 *
 * The CPU reference computes in double for every float dtype (at least as
 * precise as the f32 accumulation of the GPU) and in int64 for integers.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "rows.h"

/* ------------------------------------------------------------ helpers */

static moe_status norm_dim(moe_ctx *ctx, const char *fn, int64_t dim, int ndim, int *out) {
  int64_t n = ndim;
  if (n == 0)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: dim %lld given for a tensor with no dims", fn,
                     (long long)dim);
  if (dim < -n || dim >= n)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "%s: dim %lld is out of range for a tensor of %d dim%s (expected %lld to %lld)",
                     fn, (long long)dim, ndim, ndim == 1 ? "" : "s", (long long)-n,
                     (long long)(n - 1));
  *out = (int)(dim < 0 ? dim + n : dim);
  return MOE_OK;
}

/* The reduced dims as a bit mask (ndims == 0: all dims). */
static moe_status dims_mask(moe_ctx *ctx, const char *fn, const moe_tensor *t, int ndims,
                            const int64_t *dims, unsigned *mask) {
  if (ndims < 0 || ndims > MOE_MAX_DIMS)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: %d dims given (at most %d)", fn, ndims,
                     MOE_MAX_DIMS);
  if (ndims > 0 && !dims)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: dims is NULL", fn);
  if (ndims == 0) {
    *mask = (1u << t->ndim) - 1u;
    return MOE_OK;
  }
  unsigned m = 0;
  for (int i = 0; i < ndims; i++) {
    int d = 0;
    MOE_CHECK(norm_dim(ctx, fn, dims[i], t->ndim, &d));
    if (m & (1u << d))
      return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: dim %d appears twice in the dims", fn, d);
    m |= 1u << d;
  }
  *mask = m;
  return MOE_OK;
}

/* Shape of a reduction's output. */
static void out_shape(const moe_tensor *t, unsigned mask, bool keepdim, int *ndim,
                      int64_t *shape) {
  int k = 0;
  for (int d = 0; d < t->ndim; d++) {
    if (mask & (1u << d)) {
      if (keepdim) shape[k++] = 1;
    } else {
      shape[k++] = t->shape[d];
    }
  }
  *ndim = k;
}

/* ------------------------------------------------- CPU reduction states */

typedef struct red_state {
  double a, b;  /* SUM..: sum; MAX/MIN: value; LSE: max, sum exp; VAR: mean, M2 */
  int64_t n;    /* elements seen */
  int64_t i;    /* MAX/MIN: index */
  int64_t ia;   /* integer sum / max / min */
} red_state;

static void red_push(moe_red_kind k, red_state *s, double x, int64_t j, double p) {
  switch (k) {
    case MOE_RED_SUM:
    case MOE_RED_MEAN: s->a += x; break;
    case MOE_RED_NORM1: s->a += fabs(x); break;
    case MOE_RED_NORM2: s->a += x * x; break;
    case MOE_RED_NORMP: s->a += pow(fabs(x), p); break;
    case MOE_RED_NORMINF: {
      double ax = fabs(x);
      if (!isnan(s->a) && (isnan(ax) || ax > s->a)) s->a = ax;
      break;
    }
    case MOE_RED_MAX:
      if (s->n == 0 || (!isnan(s->a) && (isnan(x) || x > s->a))) s->a = x, s->i = j;
      break;
    case MOE_RED_MIN:
      if (s->n == 0 || (!isnan(s->a) && (isnan(x) || x < s->a))) s->a = x, s->i = j;
      break;
    case MOE_RED_LSE:
      if (x > s->a) {
        s->b = s->b * exp(s->a - x) + 1.0;
        s->a = x;
      } else if (x == s->a) {
        s->b += 1.0;
      } else {
        s->b += exp(x - s->a);
      }
      break;
    case MOE_RED_VAR: {
      double d = x - s->a;
      s->a += d / (double)(s->n + 1);
      s->b += d * (x - s->a);
      break;
    }
    default: break;
  }
  s->n++;
}

static double red_final(moe_red_kind k, const red_state *s, int64_t inner, double arg) {
  switch (k) {
    case MOE_RED_MEAN: return s->a / (double)inner;
    case MOE_RED_NORM2: return sqrt(s->a);
    case MOE_RED_NORMP: return pow(s->a, 1.0 / arg);
    case MOE_RED_LSE: return s->a + log(s->b);
    case MOE_RED_VAR: {
      double den = (double)s->n - arg;
      return s->b / (den > 0 ? den : 0.0);
    }
    default: return s->a;
  }
}

static void cpu_reduce(moe_red_kind kind, const moe_red_geom *g, double arg, moe_tensor *out,
                       moe_tensor *idx) {
  const char *base = (const char *)g->data;
  int64_t es = (int64_t)moe_dtype_size(g->dtype);
  bool flt = is_float(g->dtype);
  char *po = (char *)moe_tensor_data(out);
  int64_t eo = (int64_t)moe_dtype_size(out->dtype);
  int64_t *pi = idx ? (int64_t *)moe_tensor_data(idx) : NULL;
#pragma omp parallel for if (g->outer * g->inner >= 65536) schedule(static)
  for (int64_t o = 0; o < g->outer; o++) {
    int64_t ob = geom_offset(g->ondim, g->oshape, g->ostride, o);
    red_state s = {0, 0, 0, 0, 0};
    if (kind == MOE_RED_LSE) s.a = -INFINITY;
    int64_t cnt[MOE_MAX_DIMS] = {0};
    int64_t off = ob;
    for (int64_t j = 0; j < g->inner; j++) {
      const char *p = base + off * es;
      if (flt) {
        red_push(kind, &s, moe_load_f64(p, g->dtype), j, arg);
      } else {
        int64_t v = moe_load_i64(p, g->dtype);
        if (kind == MOE_RED_SUM) s.ia = (int64_t)((uint64_t)s.ia + (uint64_t)v);
        else if (s.n == 0 || (kind == MOE_RED_MAX ? v > s.ia : v < s.ia)) s.ia = v, s.i = j;
        s.n++;
      }
      /* advance the inner counters */
      for (int d = g->indim - 1; d >= 0; d--) {
        off += g->istride[d];
        if (++cnt[d] < g->ishape[d]) break;
        off -= g->istride[d] * g->ishape[d];
        cnt[d] = 0;
      }
    }
    if (flt)
      moe_store_f64(po + o * eo, out->dtype, red_final(kind, &s, g->inner, arg));
    else
      moe_store_i64(po + o * eo, out->dtype, s.ia);
    if (pi) pi[o] = s.i;
  }
}

/* ------------------------------------------------ generic reduction run */

static moe_status reduce_run(moe_ctx *ctx, const char *fn, moe_red_kind kind, moe_tensor *t,
                             unsigned mask, bool keepdim, double arg, moe_dtype odt,
                             moe_tensor **values, moe_tensor **indices) {
  int ndim;
  int64_t shape[MOE_MAX_DIMS];
  out_shape(t, mask, keepdim, &ndim, shape);
  moe_device dev = t->storage->device;
  moe_red_geom g;
  red_geom_build(t, mask, &g);
  if (g.inner == 0 && (kind == MOE_RED_MAX || kind == MOE_RED_MIN) && g.outer > 0)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: cannot reduce over an empty dim (shape %s)", fn,
                     MOE_SHAPE(t));
  moe_tensor *v = NULL, *ix = NULL;
  moe_status st = MOE_OK;
  if (values) MOE_CHECK_GOTO(moe_tensor_empty(ctx, ndim, shape, odt, dev, &v), st, fail);
  if (indices) MOE_CHECK_GOTO(moe_tensor_empty(ctx, ndim, shape, MOE_I64, dev, &ix), st, fail);
  moe_tensor *vout = v;
  if (!vout) { /* argmax without values: a scratch for the values */
    MOE_CHECK_GOTO(moe_tensor_empty(ctx, ndim, shape, odt, dev, &vout), st, fail);
  }
  if (g.outer > 0) {
    if (g.inner == 0) {
      double fillv = kind == MOE_RED_LSE ? -INFINITY
                     : (kind == MOE_RED_MEAN || kind == MOE_RED_VAR) ? NAN : 0.0;
      st = moe_fill_(ctx, vout, fillv);
    } else if (dev.type == MOE_DEVICE_CUDA) {
      st = moe_cuda_reduce(ctx, dev.index, kind, &g, arg, moe_tensor_data(vout), odt,
                           ix ? (int64_t *)moe_tensor_data(ix) : NULL);
    } else {
      cpu_reduce(kind, &g, arg, vout, ix);
    }
  }
  if (vout != v) moe_tensor_release(vout);
  if (st != MOE_OK) goto fail;
  if (values) *values = v;
  if (indices) *indices = ix;
  return MOE_OK;
fail:
  moe_tensor_release(v);
  moe_tensor_release(ix);
  return st;
}

/* ----------------------------------------------- reduction backward */

/* g (the output gradient, of the output's shape) seen as a view of the
 * input's shape: reduced dims get stride 0. */
static moe_kview bcast_reduced(const moe_tensor *g, int ndim, const int64_t *shape, unsigned mask,
                               bool keepdim) {
  moe_kview v;
  memset(&v, 0, sizeof(v));
  v.data = moe_tensor_data(g);
  v.dtype = g->dtype;
  v.ndim = ndim;
  int k = 0;
  for (int d = 0; d < ndim; d++) {
    v.shape[d] = shape[d];
    if (mask & (1u << d)) {
      v.stride[d] = 0;
      if (keepdim) k++;
    } else {
      v.stride[d] = g->stride[k++];
    }
  }
  return v;
}

static double cpu_red_grad(moe_red_kind k, double x, double g, double y, double aux,
                           double scale, double p) {
  switch (k) {
    case MOE_RED_SUM:
    case MOE_RED_MEAN: return g * scale;
    case MOE_RED_NORM1: return x > 0 ? g : x < 0 ? -g : 0.0;
    case MOE_RED_NORM2: return y == 0 ? 0.0 : g * x / y;
    case MOE_RED_NORMP:
      if (y == 0) return 0.0;
      return g * (x > 0 ? 1.0 : x < 0 ? -1.0 : 0.0) * pow(fabs(x) / y, p - 1.0);
    case MOE_RED_NORMINF:
      return fabs(x) == y && y != 0 ? (x > 0 ? g : -g) : 0.0;
    case MOE_RED_LSE: return g * exp(x - y);
    case MOE_RED_VAR: return g * scale * (x - aux);
    default: return 0.0;
  }
}

/* gin = F(x, g, y, aux) elementwise over gin's shape (all views of it). */
static void cpu_reduce_backward(moe_red_kind kind, const moe_kview *gin, const moe_kview *x,
                                const moe_kview *g, const moe_kview *y, const moe_kview *aux,
                                double scale, double p) {
  int64_t n = 1;
  for (int d = 0; d < gin->ndim; d++) n *= gin->shape[d];
  const moe_kview *v[5] = {gin, x, g, y, aux};
  int64_t es[5];
  for (int k = 0; k < 5; k++) es[k] = v[k]->data ? (int64_t)moe_dtype_size(v[k]->dtype) : 0;
  int64_t chunk = 4096, tasks = (n + chunk - 1) / chunk;
#pragma omp parallel for if (n >= 65536) schedule(static)
  for (int64_t t = 0; t < tasks; t++) {
    int64_t i0 = t * chunk, i1 = i0 + chunk < n ? i0 + chunk : n;
    int64_t cnt[MOE_MAX_DIMS], off[5] = {0};
    int64_t r = i0;
    for (int d = gin->ndim - 1; d >= 0; d--) {
      cnt[d] = r % gin->shape[d];
      r /= gin->shape[d];
      for (int k = 0; k < 5; k++) off[k] += cnt[d] * v[k]->stride[d];
    }
    for (int64_t i = i0; i < i1; i++) {
      double xv = x->data ? moe_load_f64((const char *)x->data + off[1] * es[1], x->dtype) : 0;
      double gv = moe_load_f64((const char *)g->data + off[2] * es[2], g->dtype);
      double yv = y->data ? moe_load_f64((const char *)y->data + off[3] * es[3], y->dtype) : 0;
      double av = aux->data ? moe_load_f64((const char *)aux->data + off[4] * es[4], aux->dtype) : 0;
      moe_store_f64((char *)gin->data + off[0] * es[0], gin->dtype,
                    cpu_red_grad(kind, xv, gv, yv, av, scale, p));
      for (int d = gin->ndim - 1; d >= 0; d--) {
        for (int k = 0; k < 5; k++) off[k] += v[k]->stride[d];
        if (++cnt[d] < gin->shape[d]) break;
        for (int k = 0; k < 5; k++) off[k] -= v[k]->stride[d] * gin->shape[d];
        cnt[d] = 0;
      }
    }
  }
}

/*
 * Node layout of the dim reductions: iargs[0] = mask, iargs[1] = keepdim,
 * iargs[2] = kind, dargs[0] = arg (p, correction). Saved: 0 = x (NORM*,
 * LSE, VAR), 1 = y (NORM*, LSE), for VAR 1 = the mean (keepdim).
 */
static moe_status reduce_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                  moe_tensor **gin) {
  if (!moe_node_needs_grad(n, 0)) return MOE_OK;
  if (!gout[0]) return moe_node_zeros_input(ctx, n, 0, &gin[0]);
  unsigned mask = (unsigned)n->iargs[0];
  bool keepdim = n->iargs[1] != 0;
  moe_red_kind kind = (moe_red_kind)n->iargs[2];
  double arg = n->dargs[0];
  int ndim = n->in_ndim[0];
  const int64_t *shape = n->in_shape[0];
  int64_t count = 1;
  for (int d = 0; d < ndim; d++)
    if (mask & (1u << d)) count *= shape[d];
  moe_tensor *x = NULL, *y = NULL, *r = NULL;
  moe_status st = MOE_OK;
  bool need_x = kind != MOE_RED_SUM && kind != MOE_RED_MEAN;
  if (need_x) MOE_CHECK_GOTO(moe_node_saved(ctx, n, 0, &x), st, done);
  if (need_x) MOE_CHECK_GOTO(moe_node_saved(ctx, n, 1, &y), st, done);
  MOE_CHECK_GOTO(moe_tensor_empty(ctx, ndim, shape, n->in_dtype[0], n->in_device[0], &r), st,
                 done);
  if (moe_tensor_numel(r) > 0) {
    moe_kview vr = moe_kview_of(r), vx, vg, vy, va;
    memset(&vx, 0, sizeof(vx));
    memset(&vy, 0, sizeof(vy));
    memset(&va, 0, sizeof(va));
    vg = bcast_reduced(gout[0], ndim, shape, mask, keepdim);
    double scale = 1.0;
    if (kind == MOE_RED_MEAN) scale = 1.0 / (double)count;
    if (x) vx = moe_kview_of(x);
    if (kind == MOE_RED_VAR) {
      double den = (double)count - arg;
      scale = 2.0 / (den > 0 ? den : 0.0);
      va = bcast_reduced(y, ndim, shape, mask, true); /* the mean, kept dims */
    } else if (y) {
      vy = bcast_reduced(y, ndim, shape, mask, keepdim);
    }
    if (vg.dtype != vr.dtype) {
      st = moe_rows_grad_dtype_error(ctx, n, vg.dtype, vr.dtype);
    } else if (n->in_device[0].type == MOE_DEVICE_CUDA) {
      st = moe_cuda_reduce_backward(ctx, n->in_device[0].index, kind, &vr, &vx, &vg, &vy, &va,
                                    scale, arg);
    } else {
      cpu_reduce_backward(kind, &vr, &vx, &vg, &vy, &va, scale, arg);
    }
  }
done:
  moe_tensor_release(x);
  moe_tensor_release(y);
  if (st != MOE_OK) {
    moe_tensor_release(r);
    return st;
  }
  gin[0] = r;
  return MOE_OK;
}

/* Validation, forward and node of sum / mean / norm / logsumexp / var. */
static moe_status reduce_op(moe_ctx *ctx, const char *fn, moe_op op, moe_red_kind kind,
                            moe_tensor *t, int ndims, const int64_t *dims, bool keepdim,
                            double arg, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(moe_rows_check_tensor(ctx, fn, t, "input"));
  MOE_CHECK(moe_rows_check_out(ctx, fn, out));
  moe_dtype odt = t->dtype;
  if (kind == MOE_RED_SUM && !is_float(t->dtype)) {
    odt = MOE_I64;
  } else {
    MOE_CHECK(moe_rows_check_float(ctx, fn, t));
  }
  unsigned mask = 0;
  MOE_CHECK(dims_mask(ctx, fn, t, ndims, dims, &mask));
  moe_tensor *r = NULL, *mean = NULL;
  MOE_CHECK(reduce_run(ctx, fn, kind, t, mask, keepdim, arg, odt, &r, NULL));
  if (kind == MOE_RED_VAR && moe_grad_wanted(ctx, 1, (const moe_tensor *[]){t})) {
    moe_status st = reduce_run(ctx, fn, MOE_RED_MEAN, t, mask, true, 0, odt, &mean, NULL);
    if (st != MOE_OK) {
      moe_tensor_release(r);
      return st;
    }
  }
  bool saves = kind != MOE_RED_SUM && kind != MOE_RED_MEAN;
  moe_status st = moe_record(ctx, &(moe_record_spec){
      .op = op, .backward = reduce_backward, .n_in = 1, .in = {t},
      .n_save = saves ? 2 : 0, .save = {t, mean ? mean : r},
      .iargs = {(int64_t)mask, keepdim, kind}, .dargs = {arg}}, 1, &r);
  moe_tensor_release(mean);
  MOE_CHECK(st);
  *out = r;
  return MOE_OK;
}

moe_status moe_sum(moe_ctx *ctx, moe_tensor *t, int ndims, const int64_t *dims, bool keepdim,
                   moe_tensor **out) {
  return reduce_op(ctx, "sum", MOE_OP_SUM, MOE_RED_SUM, t, ndims, dims, keepdim, 0, out);
}

moe_status moe_mean(moe_ctx *ctx, moe_tensor *t, int ndims, const int64_t *dims, bool keepdim,
                    moe_tensor **out) {
  return reduce_op(ctx, "mean", MOE_OP_MEAN, MOE_RED_MEAN, t, ndims, dims, keepdim, 0, out);
}

moe_status moe_norm(moe_ctx *ctx, moe_tensor *t, double p, int ndims, const int64_t *dims,
                    bool keepdim, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!(p > 0))
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "norm: p must be > 0 (or inf), got %g", p);
  moe_red_kind k = isinf(p) ? MOE_RED_NORMINF : p == 1 ? MOE_RED_NORM1
                   : p == 2 ? MOE_RED_NORM2 : MOE_RED_NORMP;
  return reduce_op(ctx, "norm", MOE_OP_NORM, k, t, ndims, dims, keepdim, p, out);
}

moe_status moe_logsumexp(moe_ctx *ctx, moe_tensor *t, int ndims, const int64_t *dims,
                         bool keepdim, moe_tensor **out) {
  return reduce_op(ctx, "logsumexp", MOE_OP_LOGSUMEXP, MOE_RED_LSE, t, ndims, dims, keepdim, 0,
                   out);
}

moe_status moe_var(moe_ctx *ctx, moe_tensor *t, int ndims, const int64_t *dims,
                   double correction, bool keepdim, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!(correction >= 0) || isinf(correction))
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "var: correction must be finite and >= 0, got %g",
                     correction);
  return reduce_op(ctx, "var", MOE_OP_VAR, MOE_RED_VAR, t, ndims, dims, keepdim, correction,
                   out);
}

/* ----------------------------------------------------- max, min, argmax */

/* Backward of max / min: iargs[0] = dim (-1: all dims), iargs[1] = keepdim;
 * saved 0 = indices. */
static moe_status minmax_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                  moe_tensor **gin) {
  if (!moe_node_needs_grad(n, 0)) return MOE_OK;
  moe_tensor *r = NULL, *idx = NULL, *g = NULL;
  moe_status st;
  MOE_CHECK(moe_node_zeros_input(ctx, n, 0, &r));
  if (!gout[0] || moe_tensor_numel(r) == 0) {
    gin[0] = r;
    return MOE_OK;
  }
  MOE_CHECK_GOTO(moe_node_saved(ctx, n, 0, &idx), st, done);
  MOE_CHECK_GOTO(moe_contiguous(ctx, gout[0], &g), st, done);
  int dim = (int)n->iargs[0];
  int64_t pre = 1, nd = 1, post = 1;
  for (int d = 0; d < r->ndim; d++) {
    if (dim < 0 || d == dim) nd *= r->shape[d];
    else if (d < dim) pre *= r->shape[d];
    else post *= r->shape[d];
  }
  int64_t outer = pre * post;
  if (g->dtype != r->dtype) {
    st = moe_rows_grad_dtype_error(ctx, n, g->dtype, r->dtype);
  } else if (r->storage->device.type == MOE_DEVICE_CUDA) {
    st = moe_cuda_red_scatter(ctx, r->storage->device.index, moe_tensor_data(r), moe_tensor_data(g),
                              (const int64_t *)moe_tensor_data(idx), r->dtype, outer, nd, post);
  } else {
    const int64_t *pi = (const int64_t *)moe_tensor_data(idx);
    char *pr = (char *)moe_tensor_data(r);
    const char *pg = (const char *)moe_tensor_data(g);
    int64_t es = (int64_t)moe_dtype_size(r->dtype);
    for (int64_t o = 0; o < outer; o++) {
      int64_t at = (o / post * nd + pi[o]) * post + o % post;
      memcpy(pr + at * es, pg + o * es, (size_t)es);
    }
  }
done:
  moe_tensor_release(idx);
  moe_tensor_release(g);
  if (st != MOE_OK) {
    moe_tensor_release(r);
    return st;
  }
  gin[0] = r;
  return MOE_OK;
}

/* max / min over dim (dim < 0 after normalisation: all dims, a scalar). */
static moe_status minmax_op(moe_ctx *ctx, const char *fn, moe_op op, moe_red_kind kind,
                            moe_tensor *t, bool all, int64_t dim, bool keepdim,
                            moe_tensor **values, moe_tensor **indices) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(moe_rows_check_tensor(ctx, fn, t, "input"));
  if (!values && !indices) return moe_rows_check_out(ctx, fn, NULL);
  if (t->storage->device.type == MOE_DEVICE_CUDA && t->dtype == MOE_F64)
    MOE_CHECK(moe_rows_check_float(ctx, fn, t));
  unsigned mask;
  int d = -1;
  if (all) {
    mask = (1u << t->ndim) - 1u;
    keepdim = false;
  } else {
    MOE_CHECK(norm_dim(ctx, fn, dim, t->ndim, &d));
    mask = 1u << d;
  }
  bool want_grad = values && moe_grad_wanted(ctx, 1, (const moe_tensor *[]){t});
  moe_tensor *v = NULL, *ix = NULL;
  MOE_CHECK(reduce_run(ctx, fn, kind, t, mask, keepdim, 0, t->dtype, values ? &v : NULL,
                       (indices || want_grad) ? &ix : NULL));
  if (want_grad) {
    moe_status st = moe_record(ctx, &(moe_record_spec){
        .op = op, .backward = minmax_backward, .n_in = 1, .in = {t},
        .n_save = 1, .save = {ix}, .iargs = {d, keepdim}}, 1, &v);
    if (st != MOE_OK) {
      moe_tensor_release(ix);
      return st;
    }
  }
  if (values) *values = v;
  if (indices) *indices = ix;
  else moe_tensor_release(ix);
  return MOE_OK;
}

moe_status moe_max(moe_ctx *ctx, moe_tensor *t, int64_t dim, bool keepdim, moe_tensor **values,
                   moe_tensor **indices) {
  return minmax_op(ctx, "max", MOE_OP_MAX, MOE_RED_MAX, t, false, dim, keepdim, values, indices);
}

moe_status moe_min(moe_ctx *ctx, moe_tensor *t, int64_t dim, bool keepdim, moe_tensor **values,
                   moe_tensor **indices) {
  return minmax_op(ctx, "min", MOE_OP_MIN, MOE_RED_MIN, t, false, dim, keepdim, values, indices);
}

moe_status moe_max_all(moe_ctx *ctx, moe_tensor *t, moe_tensor **out) {
  if (ctx && !out) return moe_rows_check_out(ctx, "max", NULL);
  return minmax_op(ctx, "max", MOE_OP_MAX, MOE_RED_MAX, t, true, 0, false, out, NULL);
}

moe_status moe_min_all(moe_ctx *ctx, moe_tensor *t, moe_tensor **out) {
  if (ctx && !out) return moe_rows_check_out(ctx, "min", NULL);
  return minmax_op(ctx, "min", MOE_OP_MIN, MOE_RED_MIN, t, true, 0, false, out, NULL);
}

static moe_status arg_op(moe_ctx *ctx, const char *fn, moe_red_kind kind, moe_tensor *t,
                         int64_t dim, bool all, bool keepdim, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(moe_rows_check_tensor(ctx, fn, t, "input"));
  MOE_CHECK(moe_rows_check_out(ctx, fn, out));
  if (t->storage->device.type == MOE_DEVICE_CUDA && t->dtype == MOE_F64)
    MOE_CHECK(moe_rows_check_float(ctx, fn, t));
  unsigned mask;
  if (all) {
    mask = (1u << t->ndim) - 1u;
    keepdim = false;
  } else {
    int d = 0;
    MOE_CHECK(norm_dim(ctx, fn, dim, t->ndim, &d));
    mask = 1u << d;
  }
  return reduce_run(ctx, fn, kind, t, mask, keepdim, 0, t->dtype, NULL, out);
}

moe_status moe_argmax(moe_ctx *ctx, moe_tensor *t, int64_t dim, bool all, bool keepdim,
                      moe_tensor **out) {
  return arg_op(ctx, "argmax", MOE_RED_MAX, t, dim, all, keepdim, out);
}

moe_status moe_argmin(moe_ctx *ctx, moe_tensor *t, int64_t dim, bool all, bool keepdim,
                      moe_tensor **out) {
  return arg_op(ctx, "argmin", MOE_RED_MIN, t, dim, all, keepdim, out);
}

/* --------------------------------------------- softmax, log_softmax, cumsum */

static void cpu_softmax(bool lg, const moe_tensor *x, moe_tensor *y, int d) {
  row_geom rx, ry;
  row_geom_of(x, d, &rx);
  row_geom_of(y, d, &ry);
  moe_dtype xt = x->dtype, yt = y->dtype;
#pragma omp parallel for if (rx.g.outer * rx.n >= 65536) schedule(static)
  for (int64_t o = 0; o < rx.g.outer; o++) {
    const char *px = row_at(&rx, o);
    char *py = row_at(&ry, o);
    double m = -INFINITY, s = 0;
    for (int64_t j = 0; j < rx.n; j++) {
      double v = moe_load_f64(px + j * rx.s * rx.es, xt);
      if (v > m || isnan(v)) m = v;
    }
    for (int64_t j = 0; j < rx.n; j++) s += exp(moe_load_f64(px + j * rx.s * rx.es, xt) - m);
    double ls = log(s);
    for (int64_t j = 0; j < rx.n; j++) {
      double v = moe_load_f64(px + j * rx.s * rx.es, xt) - m;
      moe_store_f64(py + j * ry.s * ry.es, yt, lg ? v - ls : exp(v) / s);
    }
  }
}

/* gx = y * (g - sum(g y))  or  g - exp(y) * sum(g). */
static void cpu_softmax_backward(bool lg, const moe_tensor *y, const moe_tensor *g, moe_tensor *gx,
                                 int d) {
  row_geom ry, rg, rx;
  row_geom_of(y, d, &ry);
  row_geom_of(g, d, &rg);
  row_geom_of(gx, d, &rx);
  moe_dtype dt = y->dtype, gt = g->dtype;
#pragma omp parallel for if (ry.g.outer * ry.n >= 65536) schedule(static)
  for (int64_t o = 0; o < ry.g.outer; o++) {
    const char *py = row_at(&ry, o), *pg = row_at(&rg, o);
    char *px = row_at(&rx, o);
    double s = 0;
    for (int64_t j = 0; j < ry.n; j++) {
      double gv = moe_load_f64(pg + j * rg.s * rg.es, gt);
      s += lg ? gv : gv * moe_load_f64(py + j * ry.s * ry.es, dt);
    }
    for (int64_t j = 0; j < ry.n; j++) {
      double gv = moe_load_f64(pg + j * rg.s * rg.es, gt), yv = moe_load_f64(py + j * ry.s * ry.es, dt);
      moe_store_f64(px + j * rx.s * rx.es, gx->dtype, lg ? gv - exp(yv) * s : yv * (gv - s));
    }
  }
}

static void cpu_cumsum(bool reverse, const moe_tensor *x, moe_tensor *y, int d) {
  row_geom rx, ry;
  row_geom_of(x, d, &rx);
  row_geom_of(y, d, &ry);
  bool flt = is_float(y->dtype);
#pragma omp parallel for if (rx.g.outer * rx.n >= 65536) schedule(static)
  for (int64_t o = 0; o < rx.g.outer; o++) {
    const char *px = row_at(&rx, o);
    char *py = row_at(&ry, o);
    double s = 0;
    int64_t si = 0;
    for (int64_t k = 0; k < rx.n; k++) {
      int64_t j = reverse ? rx.n - 1 - k : k;
      const char *p = px + j * rx.s * rx.es;
      if (flt) {
        s += moe_load_f64(p, x->dtype);
        moe_store_f64(py + j * ry.s * ry.es, y->dtype, s);
      } else {
        si = (int64_t)((uint64_t)si + (uint64_t)moe_load_i64(p, x->dtype));
        moe_store_i64(py + j * ry.s * ry.es, y->dtype, si);
      }
    }
  }
}

/* Swaps dim d of a contiguous row-layout result back (transpose d <-> last)
 * into a contiguous tensor; takes ownership of r. */
static moe_status rows_back(moe_ctx *ctx, moe_tensor *r, int d, moe_tensor **out) {
  if (r->ndim == 0 || d == r->ndim - 1) {
    *out = r;
    return MOE_OK;
  }
  bool prev = moe_grad_set(ctx, false);
  moe_tensor *v = NULL;
  moe_status st = moe_transpose(ctx, r, d, r->ndim - 1, &v);
  if (st == MOE_OK) st = moe_contiguous(ctx, v, out);
  moe_grad_set(ctx, prev);
  moe_tensor_release(v);
  moe_tensor_release(r);
  return st;
}

/* The rows kind of the GPU: SOFTMAX, LOG_SOFTMAX, CUMSUM (rev: reversed). */
typedef enum row_kind { ROW_SOFTMAX, ROW_LOG_SOFTMAX, ROW_CUMSUM, ROW_CUMSUM_REV } row_kind;

/* y = kind(x) along dim d, on the GPU through contiguous rows. */
static moe_status cuda_rows(moe_ctx *ctx, row_kind kind, moe_tensor *x, int d, moe_dtype ydt,
                            moe_tensor **out) {
  moe_tensor *xc = NULL, *yc = NULL;
  moe_status st;
  MOE_CHECK(moe_rows_contig(ctx, x, d, &xc));
  st = moe_tensor_empty(ctx, xc->ndim, xc->shape, ydt, xc->storage->device, &yc);
  int64_t n = x->ndim ? x->shape[d] : 1, numel = moe_tensor_numel(xc);
  int64_t rows = n ? numel / n : 0;
  int dev = xc->storage->device.index;
  if (st == MOE_OK && numel > 0) {
    if (kind == ROW_CUMSUM || kind == ROW_CUMSUM_REV)
      st = moe_cuda_cumsum(ctx, dev, kind == ROW_CUMSUM_REV, moe_tensor_data(xc),
                           moe_tensor_data(yc), ydt, rows, n);
    else
      st = moe_cuda_softmax(ctx, dev, kind == ROW_LOG_SOFTMAX, moe_tensor_data(xc),
                            moe_tensor_data(yc), ydt, rows, n);
  }
  moe_tensor_release(xc);
  if (st != MOE_OK) {
    moe_tensor_release(yc);
    return st;
  }
  return rows_back(ctx, yc, d, out);
}

/* iargs[0] = dim, iargs[1] = log; saved 0 = y. */
static moe_status softmax_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                   moe_tensor **gin) {
  if (!moe_node_needs_grad(n, 0)) return MOE_OK;
  if (!gout[0]) return moe_node_zeros_input(ctx, n, 0, &gin[0]);
  int d = (int)n->iargs[0];
  bool lg = n->iargs[1] != 0;
  moe_tensor *y = NULL, *r = NULL;
  moe_status st;
  MOE_CHECK(moe_node_saved(ctx, n, 0, &y));
  if (gout[0]->dtype != y->dtype) {
    st = moe_rows_grad_dtype_error(ctx, n, gout[0]->dtype, y->dtype);
  } else if (y->storage->device.type == MOE_DEVICE_CUDA) {
    moe_tensor *yc = NULL, *gc = NULL, *rc = NULL;
    st = moe_rows_contig(ctx, y, d, &yc);
    if (st == MOE_OK) st = moe_rows_contig(ctx, gout[0], d, &gc);
    if (st == MOE_OK) st = moe_tensor_empty(ctx, yc->ndim, yc->shape, yc->dtype, yc->storage->device, &rc);
    int64_t len = y->shape[d], numel = moe_tensor_numel(y);
    if (st == MOE_OK && numel > 0)
      st = moe_cuda_softmax_backward(ctx, y->storage->device.index, lg, moe_tensor_data(yc),
                                     moe_tensor_data(gc), moe_tensor_data(rc), y->dtype,
                                     numel / len, len);
    moe_tensor_release(yc);
    moe_tensor_release(gc);
    if (st == MOE_OK) st = rows_back(ctx, rc, d, &r);
    else moe_tensor_release(rc);
  } else {
    st = moe_tensor_empty(ctx, y->ndim, y->shape, y->dtype, MOE_CPU, &r);
    if (st == MOE_OK) cpu_softmax_backward(lg, y, gout[0], r, d);
  }
  moe_tensor_release(y);
  if (st != MOE_OK) {
    moe_tensor_release(r);
    return st;
  }
  gin[0] = r;
  return MOE_OK;
}

static moe_status softmax_op(moe_ctx *ctx, const char *fn, moe_op op, bool lg, moe_tensor *t,
                             int64_t dim, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(moe_rows_check_tensor(ctx, fn, t, "input"));
  MOE_CHECK(moe_rows_check_out(ctx, fn, out));
  MOE_CHECK(moe_rows_check_float(ctx, fn, t));
  int d = 0;
  MOE_CHECK(norm_dim(ctx, fn, dim, t->ndim, &d));
  moe_tensor *y = NULL;
  if (t->storage->device.type == MOE_DEVICE_CUDA) {
    MOE_CHECK(cuda_rows(ctx, lg ? ROW_LOG_SOFTMAX : ROW_SOFTMAX, t, d, t->dtype, &y));
  } else {
    MOE_CHECK(moe_tensor_empty(ctx, t->ndim, t->shape, t->dtype, MOE_CPU, &y));
    if (moe_tensor_numel(y) > 0) cpu_softmax(lg, t, y, d);
  }
  MOE_CHECK(moe_record(ctx, &(moe_record_spec){
      .op = op, .backward = softmax_backward, .n_in = 1, .in = {t},
      .n_save = 1, .save = {y}, .iargs = {d, lg}}, 1, &y));
  *out = y;
  return MOE_OK;
}

moe_status moe_softmax(moe_ctx *ctx, moe_tensor *t, int64_t dim, moe_tensor **out) {
  return softmax_op(ctx, "softmax", MOE_OP_SOFTMAX, false, t, dim, out);
}

moe_status moe_log_softmax(moe_ctx *ctx, moe_tensor *t, int64_t dim, moe_tensor **out) {
  return softmax_op(ctx, "log_softmax", MOE_OP_LOG_SOFTMAX, true, t, dim, out);
}

/* cumsum along d, forward or reversed (the backward), on t's device. */
static moe_status cumsum_run(moe_ctx *ctx, moe_tensor *t, int d, bool reverse, moe_tensor **out) {
  moe_dtype ydt = is_float(t->dtype) ? t->dtype : MOE_I64;
  if (t->storage->device.type == MOE_DEVICE_CUDA) {
    if (ydt == MOE_I64 && t->dtype != MOE_I64) {
      moe_tensor *c = NULL;
      MOE_CHECK(moe_to(ctx, t, MOE_I64, t->storage->device, &c));
      moe_status st = cuda_rows(ctx, reverse ? ROW_CUMSUM_REV : ROW_CUMSUM, c, d, ydt, out);
      moe_tensor_release(c);
      return st;
    }
    return cuda_rows(ctx, reverse ? ROW_CUMSUM_REV : ROW_CUMSUM, t, d, ydt, out);
  }
  moe_tensor *y = NULL;
  MOE_CHECK(moe_tensor_empty(ctx, t->ndim, t->shape, ydt, MOE_CPU, &y));
  if (moe_tensor_numel(y) > 0) cpu_cumsum(reverse, t, y, d);
  *out = y;
  return MOE_OK;
}

static moe_status cumsum_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                  moe_tensor **gin) {
  if (!moe_node_needs_grad(n, 0)) return MOE_OK;
  if (!gout[0]) return moe_node_zeros_input(ctx, n, 0, &gin[0]);
  return cumsum_run(ctx, gout[0], (int)n->iargs[0], true, &gin[0]);
}

moe_status moe_cumsum(moe_ctx *ctx, moe_tensor *t, int64_t dim, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(moe_rows_check_tensor(ctx, "cumsum", t, "input"));
  MOE_CHECK(moe_rows_check_out(ctx, "cumsum", out));
  if (is_float(t->dtype)) MOE_CHECK(moe_rows_check_float(ctx, "cumsum", t));
  int d = 0;
  MOE_CHECK(norm_dim(ctx, "cumsum", dim, t->ndim, &d));
  moe_tensor *y = NULL;
  MOE_CHECK(cumsum_run(ctx, t, d, false, &y));
  MOE_CHECK(moe_record(ctx, &(moe_record_spec){
      .op = MOE_OP_CUMSUM, .backward = cumsum_backward, .n_in = 1, .in = {t}, .iargs = {d}},
      1, &y));
  *out = y;
  return MOE_OK;
}
