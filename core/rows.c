/*
 * rows.c - the shared checks and contiguous row copies of rows.h, for the
 * reductions (reduce.c), the norms (norm.c) and the losses (loss.c).
 */
#include "rows.h"

moe_status moe_rows_check_tensor(moe_ctx *ctx, const char *fn, const moe_tensor *t,
                                 const char *what) {
  if (!t) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: %s is NULL", fn, what);
  return moe_device_check(ctx, t->storage->device);
}

moe_status moe_rows_check_float(moe_ctx *ctx, const char *fn, const moe_tensor *t) {
  if (!is_float(t->dtype))
    return moe_error(ctx, MOE_ERR_DTYPE, "%s: expected a float tensor (f32, f64, bf16, f16), got %s",
                     fn, moe_dtype_name(t->dtype));
  if (t->storage->device.type == MOE_DEVICE_CUDA && t->dtype == MOE_F64)
    return moe_error(ctx, MOE_ERR_DTYPE, "%s: f64 is not supported on CUDA (use f32 or bf16)", fn);
  return MOE_OK;
}

moe_status moe_rows_check_out(moe_ctx *ctx, const char *fn, void *out) {
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: out is NULL", fn);
  return MOE_OK;
}

/* "op backward: gradient of dtype g for an output of o" (MOE_ERR_DTYPE). */
moe_status moe_rows_grad_dtype_error(moe_ctx *ctx, const moe_node *n, moe_dtype g, moe_dtype o) {
  return moe_error(ctx, MOE_ERR_DTYPE, "%s backward: gradient of dtype %s for an output of %s",
                   moe_op_name(n->op), moe_dtype_name(g), moe_dtype_name(o));
}

/* t (or t with dim `dim` swapped to the end) as a contiguous tensor, made
 * with grad mode off so the internal copy records nothing. */
moe_status moe_rows_contig(moe_ctx *ctx, moe_tensor *t, int dim, moe_tensor **out) {
  bool prev = moe_grad_set(ctx, false);
  moe_tensor *v = NULL;
  moe_status st;
  if (t->ndim > 0 && dim != t->ndim - 1) {
    st = moe_transpose(ctx, t, dim, t->ndim - 1, &v);
    if (st == MOE_OK) st = moe_contiguous(ctx, v, out);
    moe_tensor_release(v);
  } else {
    st = moe_contiguous(ctx, t, out);
  }
  moe_grad_set(ctx, prev);
  return st;
}
