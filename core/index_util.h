/*
 * index_util.h - what the index family's files share (core/index.c, join.c,
 * rope.c, multinomial.c): the NULL-argument check, the device test, the
 * row-major odometer and the fresh contiguous copy. Private to core/.
 */
#ifndef MOE_INDEX_UTIL_H
#define MOE_INDEX_UTIL_H

#include "internal.h"

static inline bool ix_cuda(const moe_tensor *t) {
  return t->storage->device.type == MOE_DEVICE_CUDA;
}

static inline moe_status ix_null(moe_ctx *ctx, const char *fn, const char *what, const void *p) {
  if (!p) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: %s is NULL", fn, what);
  return MOE_OK;
}

/* Row-major odometer over shape. */
static inline void ix_next(int ndim, const int64_t *shape, int64_t *coord) {
  for (int d = ndim - 1; d >= 0; d--) {
    if (++coord[d] < shape[d]) return;
    coord[d] = 0;
  }
}

static inline int64_t ix_offset(int ndim, const int64_t *coord, const int64_t *stride) {
  int64_t off = 0;
  for (int d = 0; d < ndim; d++) off += coord[d] * stride[d];
  return off;
}

/* A new contiguous tensor holding a copy of x. */
static inline moe_status ix_copy_new(moe_ctx *ctx, const moe_tensor *x, moe_tensor **out) {
  moe_tensor *r;
  MOE_CHECK(moe_tensor_empty(ctx, x->ndim, x->shape, x->dtype, x->storage->device, &r));
  moe_status st = moe_tensor_numel(r) > 0 ? moe_copy_(ctx, r, x) : MOE_OK;
  if (st != MOE_OK) {
    moe_tensor_release(r);
    return st;
  }
  *out = r;
  return MOE_OK;
}

#endif /* MOE_INDEX_UTIL_H */
