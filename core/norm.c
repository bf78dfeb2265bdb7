/*
 * norm.c - layer_norm and rms_norm over the last dim (moe_reduce.h): the
 * checks of the weight and bias, the CPU reference (in double), the
 * dispatch to the norm launchers of reduce_cuda.h and the backward. The
 * row machinery is rows.h's.
 */
#include <math.h>
#include <stdlib.h>

#include "rows.h"

/* --------------------------------------------------- layer_norm, rms_norm */

static moe_status norm_args(moe_ctx *ctx, const char *fn, moe_tensor *x, moe_tensor *w,
                            const char *wname, double eps, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(moe_rows_check_tensor(ctx, fn, x, "input"));
  MOE_CHECK(moe_rows_check_out(ctx, fn, out));
  MOE_CHECK(moe_rows_check_float(ctx, fn, x));
  if (x->ndim == 0)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: input must have at least one dim (normalised over the last)", fn);
  if (!(eps >= 0) || isinf(eps))
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: eps must be finite and >= 0, got %g", fn, eps);
  if (!w) return MOE_OK;
  int64_t n = x->shape[x->ndim - 1];
  if (w->ndim != 1 || w->shape[0] != n)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: %s of shape %s does not match the last dim of input %s (want [%lld])",
                     fn, wname, MOE_SHAPE(w), MOE_SHAPE(x), (long long)n);
  MOE_CHECK(moe_check_same_dtype(ctx, fn, wname, w->dtype, "input", x->dtype));
  return moe_check_same_device(ctx, fn, wname, w->storage->device, "input", x->storage->device);
}

static inline double ld_vec(const moe_tensor *t, int64_t j) {
  return moe_load_f64((const char *)moe_tensor_data(t) + j * t->stride[0] * (int64_t)moe_dtype_size(t->dtype),
                      t->dtype);
}

static void cpu_norm_forward(bool rms, const moe_tensor *x, const moe_tensor *w,
                             const moe_tensor *b, moe_tensor *y, moe_tensor *mean,
                             moe_tensor *rstd, double eps) {
  int d = x->ndim - 1;
  row_geom rx, ry;
  row_geom_of(x, d, &rx);
  row_geom_of(y, d, &ry);
  int64_t n = rx.n;
  char *pm = mean ? (char *)moe_tensor_data(mean) : NULL, *pr = (char *)moe_tensor_data(rstd);
  int64_t es = (int64_t)moe_dtype_size(rstd->dtype);
#pragma omp parallel for if (rx.g.outer * n >= 65536) schedule(static)
  for (int64_t o = 0; o < rx.g.outer; o++) {
    const char *px = row_at(&rx, o);
    char *py = row_at(&ry, o);
    double m = 0, v = 0;
    if (!rms) {
      for (int64_t j = 0; j < n; j++) m += moe_load_f64(px + j * rx.s * rx.es, x->dtype);
      m /= (double)n;
    }
    for (int64_t j = 0; j < n; j++) {
      double c = moe_load_f64(px + j * rx.s * rx.es, x->dtype) - m;
      v += c * c;
    }
    double r = 1.0 / sqrt(v / (double)n + eps);
    for (int64_t j = 0; j < n; j++) {
      double h = (moe_load_f64(px + j * rx.s * rx.es, x->dtype) - m) * r;
      if (w) h *= ld_vec(w, j);
      if (b) h += ld_vec(b, j);
      moe_store_f64(py + j * ry.s * ry.es, y->dtype, h);
    }
    if (pm) moe_store_f64(pm + o * es, mean->dtype, m);
    moe_store_f64(pr + o * es, rstd->dtype, r);
  }
}

static void cpu_norm_backward(bool rms, const moe_tensor *x, const moe_tensor *w,
                              const moe_tensor *g, const moe_tensor *mean, const moe_tensor *rstd,
                              moe_tensor *gx, double *gw, double *gb) {
  int d = x->ndim - 1;
  row_geom rx, rg, ro;
  row_geom_of(x, d, &rx);
  row_geom_of(g, d, &rg);
  int64_t n = rx.n;
  const char *pm = mean ? (const char *)moe_tensor_data(mean) : NULL;
  const char *pr = (const char *)moe_tensor_data(rstd);
  int64_t es = (int64_t)moe_dtype_size(rstd->dtype);
  if (gx) {
    row_geom_of(gx, d, &ro);
#pragma omp parallel for if (rx.g.outer * n >= 65536) schedule(static)
    for (int64_t o = 0; o < rx.g.outer; o++) {
      const char *px = row_at(&rx, o), *pg = row_at(&rg, o);
      char *po = row_at(&ro, o);
      double m = pm ? moe_load_f64(pm + o * es, mean->dtype) : 0;
      double r = moe_load_f64(pr + o * es, rstd->dtype);
      double sa = 0, sb = 0;
      for (int64_t j = 0; j < n; j++) {
        double h = (moe_load_f64(px + j * rx.s * rx.es, x->dtype) - m) * r;
        double gh = moe_load_f64(pg + j * rg.s * rg.es, g->dtype) * (w ? ld_vec(w, j) : 1.0);
        sa += gh;
        sb += gh * h;
      }
      sa /= (double)n;
      sb /= (double)n;
      for (int64_t j = 0; j < n; j++) {
        double h = (moe_load_f64(px + j * rx.s * rx.es, x->dtype) - m) * r;
        double gh = moe_load_f64(pg + j * rg.s * rg.es, g->dtype) * (w ? ld_vec(w, j) : 1.0);
        moe_store_f64(po + j * ro.s * ro.es, gx->dtype, r * (gh - (rms ? 0 : sa) - h * sb));
      }
    }
  }
  if (!gw && !gb) return;
  for (int64_t o = 0; o < rx.g.outer; o++) { /* rows in order: deterministic sums */
    const char *px = row_at(&rx, o), *pg = row_at(&rg, o);
    double m = pm ? moe_load_f64(pm + o * es, mean->dtype) : 0;
    double r = moe_load_f64(pr + o * es, rstd->dtype);
    for (int64_t j = 0; j < n; j++) {
      double gv = moe_load_f64(pg + j * rg.s * rg.es, g->dtype);
      if (gw) gw[j] += gv * (moe_load_f64(px + j * rx.s * rx.es, x->dtype) - m) * r;
      if (gb) gb[j] += gv;
    }
  }
}

/* iargs[0] = rms, [1] = has weight, [2] = has bias; saved 0 = x, 1 = weight
 * (or NULL), 2 = mean (NULL for rms), 3 = rstd. */
static moe_status norm_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                moe_tensor **gin) {
  bool rms = n->iargs[0] != 0, has_w = n->iargs[1] != 0, has_b = n->iargs[2] != 0;
  int iw = has_w ? 1 : -1, ib = has_b ? (has_w ? 2 : 1) : -1;
  bool want_x = moe_node_needs_grad(n, 0), want_w = iw > 0 && moe_node_needs_grad(n, iw),
       want_b = ib > 0 && moe_node_needs_grad(n, ib);
  if (!gout[0]) return moe_node_zero_grads(ctx, n, gin);
  moe_tensor *x = NULL, *w = NULL, *mean = NULL, *rstd = NULL, *gx = NULL, *gw = NULL, *gb = NULL;
  moe_tensor *g = NULL;
  double *aw = NULL, *ab = NULL;
  moe_status st;
  MOE_CHECK_GOTO(moe_node_saved(ctx, n, 0, &x), st, done);
  if (has_w) MOE_CHECK_GOTO(moe_node_saved(ctx, n, 1, &w), st, done);
  if (!rms) MOE_CHECK_GOTO(moe_node_saved(ctx, n, 2, &mean), st, done);
  MOE_CHECK_GOTO(moe_node_saved(ctx, n, 3, &rstd), st, done);
  g = gout[0];
  if (g->dtype != x->dtype) {
    st = moe_rows_grad_dtype_error(ctx, n, g->dtype, x->dtype);
    goto done;
  }
  moe_device dev = x->storage->device;
  int64_t len = x->shape[x->ndim - 1], rows = len ? moe_tensor_numel(x) / len : 0;
  if (want_x) MOE_CHECK_GOTO(moe_tensor_empty(ctx, x->ndim, x->shape, x->dtype, dev, &gx), st, done);
  if (want_w) MOE_CHECK_GOTO(moe_tensor_empty(ctx, 1, &len, x->dtype, dev, &gw), st, done);
  if (want_b) MOE_CHECK_GOTO(moe_tensor_empty(ctx, 1, &len, x->dtype, dev, &gb), st, done);
  if (dev.type == MOE_DEVICE_CUDA) {
    moe_tensor *xc = NULL, *gc = NULL, *wc = NULL;
    st = moe_rows_contig(ctx, x, x->ndim - 1, &xc);
    if (st == MOE_OK) st = moe_rows_contig(ctx, g, g->ndim - 1, &gc);
    if (st == MOE_OK && w) st = moe_rows_contig(ctx, w, 0, &wc);
    if (st == MOE_OK && (gx || gw || gb) && len > 0)
      st = moe_cuda_norm_backward(ctx, dev.index, rms, moe_tensor_data(xc),
                                  wc ? moe_tensor_data(wc) : NULL, moe_tensor_data(gc),
                                  mean ? (const float *)moe_tensor_data(mean) : NULL,
                                  (const float *)moe_tensor_data(rstd),
                                  gx ? moe_tensor_data(gx) : NULL, gw ? moe_tensor_data(gw) : NULL,
                                  gb ? moe_tensor_data(gb) : NULL, x->dtype, rows, len);
    moe_tensor_release(xc);
    moe_tensor_release(gc);
    moe_tensor_release(wc);
  } else {
    if (gw) aw = calloc((size_t)(len ? len : 1), sizeof(double));
    if (gb) ab = calloc((size_t)(len ? len : 1), sizeof(double));
    if ((gw && !aw) || (gb && !ab)) {
      st = moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s backward: out of host memory", moe_op_name(n->op));
      goto done;
    }
    cpu_norm_backward(rms, x, w, g, mean, rstd, gx, aw, ab);
    for (int64_t j = 0; j < len; j++) {
      if (gw) moe_store_f64((char *)moe_tensor_data(gw) + j * (int64_t)moe_dtype_size(gw->dtype), gw->dtype, aw[j]);
      if (gb) moe_store_f64((char *)moe_tensor_data(gb) + j * (int64_t)moe_dtype_size(gb->dtype), gb->dtype, ab[j]);
    }
    st = MOE_OK;
  }
done:
  free(aw);
  free(ab);
  moe_tensor_release(x);
  moe_tensor_release(w);
  moe_tensor_release(mean);
  moe_tensor_release(rstd);
  if (st != MOE_OK) {
    moe_tensor_release(gx);
    moe_tensor_release(gw);
    moe_tensor_release(gb);
    return st;
  }
  if (want_x) gin[0] = gx;
  if (want_w) gin[iw] = gw;
  if (want_b) gin[ib] = gb;
  return MOE_OK;
}

static moe_status norm_op(moe_ctx *ctx, const char *fn, moe_op op, bool rms, moe_tensor *x,
                          moe_tensor *w, moe_tensor *b, double eps, moe_tensor **out) {
  MOE_CHECK(norm_args(ctx, fn, x, w, "weight", eps, out));
  if (b) MOE_CHECK(norm_args(ctx, fn, x, b, "bias", eps, out));
  moe_device dev = x->storage->device;
  int64_t len = x->shape[x->ndim - 1], rows = len ? moe_tensor_numel(x) / len : 0;
  int64_t sshape[MOE_MAX_DIMS];
  for (int i = 0; i < x->ndim - 1; i++) sshape[i] = x->shape[i];
  moe_dtype sdt = x->dtype == MOE_F64 ? MOE_F64 : MOE_F32;
  moe_tensor *y = NULL, *mean = NULL, *rstd = NULL, *xc = NULL, *wc = NULL, *bc = NULL;
  moe_status st;
  MOE_CHECK_GOTO(moe_tensor_empty(ctx, x->ndim, x->shape, x->dtype, dev, &y), st, fail);
  if (!rms) MOE_CHECK_GOTO(moe_tensor_empty(ctx, x->ndim - 1, sshape, sdt, dev, &mean), st, fail);
  MOE_CHECK_GOTO(moe_tensor_empty(ctx, x->ndim - 1, sshape, sdt, dev, &rstd), st, fail);
  if (dev.type == MOE_DEVICE_CUDA) {
    MOE_CHECK_GOTO(moe_rows_contig(ctx, x, x->ndim - 1, &xc), st, fail);
    if (w) MOE_CHECK_GOTO(moe_rows_contig(ctx, w, 0, &wc), st, fail);
    if (b) MOE_CHECK_GOTO(moe_rows_contig(ctx, b, 0, &bc), st, fail);
    if (rows > 0 && len > 0)
      MOE_CHECK_GOTO(moe_cuda_norm_forward(ctx, dev.index, rms, moe_tensor_data(xc),
                                           wc ? moe_tensor_data(wc) : NULL,
                                           bc ? moe_tensor_data(bc) : NULL, moe_tensor_data(y),
                                           mean ? (float *)moe_tensor_data(mean) : NULL,
                                           (float *)moe_tensor_data(rstd), x->dtype, rows, len, eps),
                     st, fail);
  } else if (rows > 0 && len > 0) {
    cpu_norm_forward(rms, x, w, b, y, mean, rstd, eps);
  }
  moe_tensor *ins[3] = {x, NULL, NULL};
  int nin = 1;
  if (w) ins[nin++] = w;
  if (b) ins[nin++] = b;
  MOE_CHECK_GOTO(moe_record(ctx, &(moe_record_spec){
      .op = op, .backward = norm_backward, .n_in = nin, .in = {ins[0], ins[1], ins[2]},
      .n_save = 4, .save = {x, w, mean, rstd},
      .iargs = {rms, w != NULL, b != NULL}, .dargs = {eps}}, 1, &y), st, fail);
  moe_tensor_release(xc);
  moe_tensor_release(wc);
  moe_tensor_release(bc);
  moe_tensor_release(mean);
  moe_tensor_release(rstd);
  *out = y;
  return MOE_OK;
fail:
  moe_tensor_release(xc);
  moe_tensor_release(wc);
  moe_tensor_release(bc);
  moe_tensor_release(mean);
  moe_tensor_release(rstd);
  moe_tensor_release(y);
  return st;
}

moe_status moe_layer_norm(moe_ctx *ctx, moe_tensor *x, moe_tensor *weight, moe_tensor *bias,
                          double eps, moe_tensor **out) {
  return norm_op(ctx, "layer_norm", MOE_OP_LAYER_NORM, false, x, weight, bias, eps, out);
}

moe_status moe_rms_norm(moe_ctx *ctx, moe_tensor *x, moe_tensor *weight, double eps,
                        moe_tensor **out) {
  return norm_op(ctx, "rms_norm", MOE_OP_RMS_NORM, true, x, weight, NULL, eps, out);
}
