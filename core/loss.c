/*
 * loss.c - cross_entropy over (N, C) logits with i64 targets, ignore_index,
 * label smoothing and a reduction (moe_reduce.h); the CPU reference (in
 * double), the dispatch to the cross-entropy launchers of reduce_cuda.h and
 * the backward. The row machinery is rows.h's.
 */
#include <math.h>
#include <string.h>

#include "rows.h"

/* ------------------------------------------------------------ cross_entropy */

bool moe_reduction_parse(const char *name, moe_reduction *out) {
  if (!name || !out) return false;
  if (strcmp(name, "mean") == 0) *out = MOE_REDUCTION_MEAN;
  else if (strcmp(name, "sum") == 0) *out = MOE_REDUCTION_SUM;
  else if (strcmp(name, "none") == 0) *out = MOE_REDUCTION_NONE;
  else return false;
  return true;
}

/* iargs[0] = ignore_index, [1] = reduction; dargs[0] = smoothing; saved
 * 0 = logits, 1 = target, 2 = lse (N), 3 = count (scalar, mean only). */
static moe_status ce_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                              moe_tensor **gin) {
  if (!moe_node_needs_grad(n, 0)) return MOE_OK;
  if (!gout[0]) return moe_node_zeros_input(ctx, n, 0, &gin[0]);
  int64_t ignore = n->iargs[0];
  moe_reduction red = (moe_reduction)n->iargs[1];
  double sm = n->dargs[0];
  moe_tensor *x = NULL, *tg = NULL, *lse = NULL, *cnt = NULL, *gx = NULL, *g = NULL;
  moe_status st;
  MOE_CHECK_GOTO(moe_node_saved(ctx, n, 0, &x), st, done);
  MOE_CHECK_GOTO(moe_node_saved(ctx, n, 1, &tg), st, done);
  MOE_CHECK_GOTO(moe_node_saved(ctx, n, 2, &lse), st, done);
  if (red == MOE_REDUCTION_MEAN) MOE_CHECK_GOTO(moe_node_saved(ctx, n, 3, &cnt), st, done);
  moe_device dev = x->storage->device;
  int64_t rows = x->shape[0], C = x->shape[1];
  MOE_CHECK_GOTO(moe_tensor_empty(ctx, 2, x->shape, x->dtype, dev, &gx), st, done);
  if (rows == 0 || C == 0) goto done;
  if (dev.type == MOE_DEVICE_CUDA) {
    moe_tensor *xc = NULL, *tc = NULL;
    st = moe_rows_contig(ctx, x, 1, &xc);
    if (st == MOE_OK) st = moe_rows_contig(ctx, tg, 0, &tc);
    if (st == MOE_OK) st = moe_rows_contig(ctx, gout[0], gout[0]->ndim ? gout[0]->ndim - 1 : 0, &g);
    if (st == MOE_OK)
      st = moe_cuda_cross_entropy_backward(ctx, dev.index, moe_tensor_data(xc),
                                           (const int64_t *)moe_tensor_data(tc),
                                           (const float *)moe_tensor_data(lse), moe_tensor_data(g),
                                           g->dtype, red == MOE_REDUCTION_NONE,
                                           cnt ? (const float *)moe_tensor_data(cnt) : NULL,
                                           moe_tensor_data(gx), x->dtype, rows, C, ignore, sm);
    moe_tensor_release(xc);
    moe_tensor_release(tc);
  } else {
    double gs = 0, count = cnt ? moe_load_f64(moe_tensor_data(cnt), cnt->dtype) : 1;
    const moe_tensor *go = gout[0];
    if (red != MOE_REDUCTION_NONE) gs = moe_load_f64(moe_tensor_data(go), go->dtype) / count;
    int64_t xs0 = x->stride[0], xs1 = x->stride[1], es = (int64_t)moe_dtype_size(x->dtype);
    const char *px = (const char *)moe_tensor_data(x);
    const double *plse = (const double *)moe_tensor_data(lse);
    char *po = (char *)moe_tensor_data(gx);
    for (int64_t r = 0; r < rows; r++) {
      int64_t t = moe_load_i64((const char *)moe_tensor_data(tg) + r * tg->stride[0] * 8, MOE_I64);
      double gr = red == MOE_REDUCTION_NONE
                      ? moe_load_f64((const char *)moe_tensor_data(go) +
                                         r * go->stride[0] * (int64_t)moe_dtype_size(go->dtype),
                                     go->dtype)
                      : gs;
      for (int64_t c = 0; c < C; c++) {
        double v = 0;
        if (t != ignore) {
          double p = exp(moe_load_f64(px + (r * xs0 + c * xs1) * es, x->dtype) - plse[r]);
          v = gr * (p - (c == t ? 1.0 - sm : 0.0) - sm / (double)C);
        }
        moe_store_f64(po + (r * C + c) * es, x->dtype, v);
      }
    }
    st = MOE_OK;
  }
done:
  moe_tensor_release(x);
  moe_tensor_release(tg);
  moe_tensor_release(lse);
  moe_tensor_release(cnt);
  moe_tensor_release(g);
  if (st != MOE_OK) {
    moe_tensor_release(gx);
    return st;
  }
  gin[0] = gx;
  return MOE_OK;
}

moe_status moe_cross_entropy(moe_ctx *ctx, moe_tensor *logits, moe_tensor *target,
                             int64_t ignore_index, double label_smoothing,
                             moe_reduction reduction, moe_tensor **out) {
  const char *fn = "cross_entropy";
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(moe_rows_check_tensor(ctx, fn, logits, "logits"));
  MOE_CHECK(moe_rows_check_tensor(ctx, fn, target, "target"));
  MOE_CHECK(moe_rows_check_out(ctx, fn, out));
  MOE_CHECK(moe_rows_check_float(ctx, fn, logits));
  if (logits->ndim != 2)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: logits must be (N, C), got shape %s", fn,
                     MOE_SHAPE(logits));
  if (target->ndim != 1 || target->shape[0] != logits->shape[0])
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: target of shape %s does not match logits %s (want [%lld])",
                     fn, MOE_SHAPE(target), MOE_SHAPE(logits), (long long)logits->shape[0]);
  if (target->dtype != MOE_I64)
    return moe_error(ctx, MOE_ERR_DTYPE, "%s: target must be i64 class indices, got %s", fn,
                     moe_dtype_name(target->dtype));
  MOE_CHECK(moe_check_same_device(ctx, fn, "logits", logits->storage->device, "target",
                                  target->storage->device));
  if (!(label_smoothing >= 0 && label_smoothing <= 1))
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: label_smoothing must be in [0, 1], got %g", fn,
                     label_smoothing);
  if ((int)reduction < 0 || reduction > MOE_REDUCTION_NONE)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: unknown reduction %d", fn, (int)reduction);
  moe_device dev = logits->storage->device;
  int64_t rows = logits->shape[0], C = logits->shape[1];
  if (C == 0 && rows > 0)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: logits %s have no classes", fn, MOE_SHAPE(logits));
  moe_tensor *y = NULL, *lse = NULL, *cnt = NULL, *loss = NULL;
  moe_status st = MOE_OK;
  moe_dtype sdt = dev.type == MOE_DEVICE_CUDA ? MOE_F32 : MOE_F64;
  MOE_CHECK_GOTO(moe_tensor_empty(ctx, 1, &rows, sdt, dev, &lse), st, fail);
  MOE_CHECK_GOTO(moe_tensor_empty(ctx, 0, NULL, sdt, dev, &cnt), st, fail);
  if (reduction == MOE_REDUCTION_NONE)
    MOE_CHECK_GOTO(moe_tensor_empty(ctx, 1, &rows, logits->dtype, dev, &y), st, fail);
  else
    MOE_CHECK_GOTO(moe_tensor_empty(ctx, 0, NULL, logits->dtype, dev, &y), st, fail);
  if (dev.type == MOE_DEVICE_CUDA) {
    moe_tensor *xc = NULL, *tc = NULL;
    MOE_CHECK_GOTO(moe_tensor_empty(ctx, 1, &rows, MOE_F32, dev, &loss), st, fail);
    st = moe_rows_contig(ctx, logits, 1, &xc);
    if (st == MOE_OK) st = moe_rows_contig(ctx, target, 0, &tc);
    if (st == MOE_OK && rows > 0)
      st = moe_cuda_cross_entropy(ctx, dev.index, moe_tensor_data(xc),
                                  (const int64_t *)moe_tensor_data(tc), (float *)moe_tensor_data(loss),
                                  (float *)moe_tensor_data(lse), logits->dtype, rows, C,
                                  ignore_index, label_smoothing);
    if (st == MOE_OK && reduction != MOE_REDUCTION_NONE)
      st = moe_cuda_cross_entropy_reduce(ctx, dev.index, (const float *)moe_tensor_data(loss),
                                         (const int64_t *)moe_tensor_data(tc), rows, ignore_index,
                                         reduction == MOE_REDUCTION_MEAN, moe_tensor_data(y),
                                         logits->dtype, (float *)moe_tensor_data(cnt));
    if (st == MOE_OK && reduction == MOE_REDUCTION_NONE && rows > 0) {
      moe_kview vy = moe_kview_of(y), vl = moe_kview_of(loss);
      st = moe_cuda_copy(ctx, dev.index, &vy, &vl);
    }
    moe_tensor_release(xc);
    moe_tensor_release(tc);
    if (st != MOE_OK) goto fail;
  } else {
    const char *px = (const char *)moe_tensor_data(logits);
    int64_t xs0 = logits->stride[0], xs1 = logits->stride[1];
    int64_t es = (int64_t)moe_dtype_size(logits->dtype);
    const int64_t *pt = (const int64_t *)moe_tensor_data(target);
    double *plse = (double *)moe_tensor_data(lse);
    double total = 0, count = 0;
    for (int64_t r = 0; r < rows; r++) {
      int64_t t = pt[r * target->stride[0]];
      if (t != ignore_index && (t < 0 || t >= C)) {
        st = moe_error(ctx, MOE_ERR_INVALID_ARG,
                       "%s: target %lld at row %lld is out of range for %lld classes (and is not ignore_index %lld)",
                       fn, (long long)t, (long long)r, (long long)C, (long long)ignore_index);
        goto fail;
      }
    }
    for (int64_t r = 0; r < rows; r++) {
      int64_t t = pt[r * target->stride[0]];
      double m = -INFINITY, s = 0, sx = 0;
      for (int64_t c = 0; c < C; c++) {
        double v = moe_load_f64(px + (r * xs0 + c * xs1) * es, logits->dtype);
        if (v > m || isnan(v)) m = v;
        sx += v;
      }
      for (int64_t c = 0; c < C; c++)
        s += exp(moe_load_f64(px + (r * xs0 + c * xs1) * es, logits->dtype) - m);
      double l = m + log(s), lr = 0;
      plse[r] = l;
      if (t != ignore_index) {
        double xt = moe_load_f64(px + (r * xs0 + t * xs1) * es, logits->dtype);
        lr = l - (1 - label_smoothing) * xt - label_smoothing * sx / (double)C;
        count += 1;
        total += lr;
      }
      if (reduction == MOE_REDUCTION_NONE)
        moe_store_f64((char *)moe_tensor_data(y) + r * es, y->dtype, lr);
    }
    *(double *)moe_tensor_data(cnt) = count;
    if (reduction != MOE_REDUCTION_NONE)
      moe_store_f64(moe_tensor_data(y), y->dtype,
                    reduction == MOE_REDUCTION_MEAN ? total / count : total);
  }
  MOE_CHECK_GOTO(moe_record(ctx, &(moe_record_spec){
      .op = MOE_OP_CROSS_ENTROPY, .backward = ce_backward, .n_in = 1, .in = {logits},
      .n_save = 4, .save = {logits, target, lse, cnt},
      .iargs = {ignore_index, reduction}, .dargs = {label_smoothing}}, 1, &y), st, fail);
  moe_tensor_release(lse);
  moe_tensor_release(cnt);
  moe_tensor_release(loss);
  *out = y;
  return MOE_OK;
fail:
  moe_tensor_release(lse);
  moe_tensor_release(cnt);
  moe_tensor_release(loss);
  moe_tensor_release(y);
  return st;
}
