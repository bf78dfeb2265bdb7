/*
 * index.c - the index family (moe_index.h): gather, scatter, scatter_add,
 * index_select, index_add, embedding, one_hot, sort, argsort, topk, cat,
 * stack, split, chunk, rope, rope_cache, multinomial. Each op validates,
 * runs the CPU reference here or the CUDA entry point of index_cuda.h, and
 * records its autograd node (moe_autograd.h).
 *
 * Two engines carry most ops: gather (out[p] = x[p with dim replaced by
 * index[p]]) and scatter (target of p gets or adds src[p]). index_select is
 * gather with the 1-D index expanded to the output's shape, index_add on the
 * CPU is scatter_add with the index expanded likewise, embedding is
 * index_select on dim 0; backward passes are the opposite engine.
 *
 * Internal helper calls (views, copies) run with grad mode off; each op
 * records exactly one node of its own (split and chunk are narrow views and
 * use narrow's node).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "index_cuda.h"
#include "internal.h"
#include "philox.h"

#define IX_SHAPE 160

/* ------------------------------------------------------------ helpers */

static bool ix_cuda(const moe_tensor *t) { return t->storage->device.type == MOE_DEVICE_CUDA; }

static moe_status ix_null(moe_ctx *ctx, const char *fn, const char *what, const void *p) {
  if (!p) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: %s is NULL", fn, what);
  return MOE_OK;
}

static moe_status ix_same_device(moe_ctx *ctx, const char *fn, const moe_tensor *a, const char *an,
                                 const moe_tensor *b, const char *bn) {
  if (moe_device_equal(a->storage->device, b->storage->device)) return MOE_OK;
  char da[32], db[32];
  return moe_error(ctx, MOE_ERR_DEVICE, "%s: %s is on %s but %s is on %s", fn, an,
                   moe_device_str(a->storage->device, da, sizeof da), bn,
                   moe_device_str(b->storage->device, db, sizeof db));
}

static moe_status ix_index_dtype(moe_ctx *ctx, const char *fn, const char *what,
                                 const moe_tensor *idx) {
  if (idx->dtype == MOE_I64 || idx->dtype == MOE_I32) return MOE_OK;
  return moe_error(ctx, MOE_ERR_DTYPE, "%s: %s must be i64 or i32, got %s", fn, what,
                   moe_dtype_name(idx->dtype));
}

#ifndef MOE_WITH_CUDA
static moe_status ix_not_built(moe_ctx *ctx, const char *fn) {
  return moe_error(ctx, MOE_ERR_NOT_SUPPORTED, "%s: CUDA tensor but moe-lua was built without CUDA",
                   fn);
}
#endif

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

/* Every element of a CPU index tensor lies in [0, limit). */
static moe_status ix_check_range(moe_ctx *ctx, const char *fn, const char *what,
                                 const moe_tensor *idx, int64_t limit) {
  if (ix_cuda(idx)) return MOE_OK; /* not checked on CUDA: see moe_index.h */
  int64_t n = moe_tensor_numel(idx), coord[MOE_MAX_DIMS] = {0};
  const char *p = (const char *)moe_tensor_data(idx);
  size_t es = moe_dtype_size(idx->dtype);
  for (int64_t i = 0; i < n; i++) {
    int64_t v = moe_load_i64(p + ix_offset(idx->ndim, coord, idx->stride) * (int64_t)es, idx->dtype);
    if (v < 0 || v >= limit)
      return moe_error(ctx, MOE_ERR_INVALID_ARG,
                       "%s: %s holds %lld at position %lld, outside [0, %lld)", fn, what,
                       (long long)v, (long long)i, (long long)limit);
    ix_next(idx->ndim, idx->shape, coord);
  }
  return MOE_OK;
}

static moe_status ix_zeros(moe_ctx *ctx, int ndim, const int64_t *shape, moe_dtype dt,
                           moe_device d, moe_tensor **out) {
  return moe_tensor_full(ctx, ndim, shape, 0.0, dt, d, out);
}

/* A new contiguous tensor holding a copy of x. */
static moe_status ix_copy_new(moe_ctx *ctx, const moe_tensor *x, moe_tensor **out) {
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

/* Records one node for out: inputs, saved tensors and integer arguments. On
 * failure out is released. */
static moe_status ix_record(moe_ctx *ctx, moe_op op, moe_backward_fn bw, int n_in,
                            moe_tensor *const *in, int n_save, moe_tensor *const *save,
                            int n_iargs, const int64_t *iargs, moe_tensor *out) {
  moe_node *n = NULL;
  moe_status st = moe_node_new(ctx, op, bw, n_in, in, &n);
  for (int i = 0; st == MOE_OK && i < n_save; i++) st = moe_node_save(ctx, n, save[i]);
  if (st == MOE_OK) {
    for (int i = 0; i < n_iargs; i++) n->iargs[i] = iargs[i];
    st = moe_node_set_output(ctx, n, 0, out);
  }
  if (n) moe_node_release(n);
  if (st != MOE_OK) moe_tensor_release(out);
  return st;
}

/* ---------------------------------------------------- gather engine */

/* out (new, contiguous, index's shape) = x gathered along dim. The caller
 * validated shapes and (on the CPU) the index range. */
static moe_status ix_gather_run(moe_ctx *ctx, const char *fn, const moe_tensor *x, int dim,
                                const moe_tensor *index, moe_tensor **out) {
  moe_tensor *r;
  MOE_CHECK(moe_tensor_empty(ctx, index->ndim, index->shape, x->dtype, x->storage->device, &r));
  int64_t n = moe_tensor_numel(r);
  moe_status st = MOE_OK;
  if (n > 0 && ix_cuda(x)) {
#ifdef MOE_WITH_CUDA
    moe_kview vo = moe_kview_of(r), vx = moe_kview_of(x), vi = moe_kview_of(index);
    st = moe_cuda_gather(ctx, x->storage->device.index, fn, &vo, &vx, dim, &vi);
#else
    st = ix_not_built(ctx, fn);
#endif
  } else if (n > 0) {
    size_t es = moe_dtype_size(x->dtype), is = moe_dtype_size(index->dtype);
    char *po = (char *)moe_tensor_data(r);
    const char *px = (const char *)moe_tensor_data(x), *pi = (const char *)moe_tensor_data(index);
    int64_t coord[MOE_MAX_DIMS] = {0};
    for (int64_t p = 0; p < n; p++) {
      int64_t io = 0, xo = 0;
      for (int d = 0; d < index->ndim; d++) {
        io += coord[d] * index->stride[d];
        if (d != dim) xo += coord[d] * x->stride[d];
      }
      xo += moe_load_i64(pi + io * (int64_t)is, index->dtype) * x->stride[dim];
      memcpy(po + p * (int64_t)es, px + xo * (int64_t)es, es);
      ix_next(index->ndim, index->shape, coord);
    }
  }
  if (st != MOE_OK) {
    moe_tensor_release(r);
    return st;
  }
  *out = r;
  return MOE_OK;
}

/* --------------------------------------------------- scatter engine */

/* out: contiguous, holding the base values. For each element p of index,
 * the target (p with dim replaced by index[p]) gets src[p] or adds it;
 * src is read at index's coordinates. */
static moe_status ix_scatter_into(moe_ctx *ctx, const char *fn, moe_scatter_mode mode,
                                  moe_tensor *out, int dim, const moe_tensor *index,
                                  const moe_tensor *src) {
  int64_t n = moe_tensor_numel(index);
  if (n == 0) return MOE_OK;
  if (ix_cuda(out)) {
#ifdef MOE_WITH_CUDA
    moe_kview vo = moe_kview_of(out), vi = moe_kview_of(index), vs = moe_kview_of(src);
    memcpy(vs.shape, index->shape, sizeof vs.shape); /* the region index covers */
    return moe_cuda_scatter(ctx, out->storage->device.index, fn, mode, &vo, dim, &vi, &vs);
#else
    return ix_not_built(ctx, fn);
#endif
  }
  moe_dtype dt = out->dtype;
  size_t es = moe_dtype_size(dt), is = moe_dtype_size(index->dtype);
  char *po = (char *)moe_tensor_data(out);
  const char *ps = (const char *)moe_tensor_data(src), *pi = (const char *)moe_tensor_data(index);
  /* 16-bit floats add in an f32 scratch copy and round once at the end, as
   * CUDA does */
  float *acc = NULL;
  int64_t on = moe_tensor_numel(out);
  if (mode == MOE_SCATTER_ADD && (dt == MOE_BF16 || dt == MOE_F16)) {
    acc = (float *)malloc((size_t)on * sizeof(float));
    if (!acc) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: no memory for %lld floats", fn, (long long)on);
    for (int64_t i = 0; i < on; i++) acc[i] = (float)moe_load_f64(po + i * (int64_t)es, dt);
  }
  int64_t coord[MOE_MAX_DIMS] = {0};
  for (int64_t p = 0; p < n; p++) {
    int64_t io = 0, so = 0, to = 0;
    for (int d = 0; d < index->ndim; d++) {
      io += coord[d] * index->stride[d];
      so += coord[d] * src->stride[d];
      if (d != dim) to += coord[d] * out->stride[d];
    }
    to += moe_load_i64(pi + io * (int64_t)is, index->dtype) * out->stride[dim];
    const char *s = ps + so * (int64_t)es;
    char *o = po + to * (int64_t)es;
    if (mode == MOE_SCATTER_REPLACE) {
      memcpy(o, s, es);
    } else if (acc) {
      acc[to] += (float)moe_load_f64(s, dt);
    } else if (dt == MOE_F32) {
      *(float *)o += *(const float *)s;
    } else if (dt == MOE_F64) {
      *(double *)o += *(const double *)s;
    } else {
      uint64_t v = (uint64_t)moe_load_i64(o, dt) + (uint64_t)moe_load_i64(s, dt);
      moe_store_i64(o, dt, (int64_t)v);
    }
    ix_next(index->ndim, index->shape, coord);
  }
  if (acc) {
    for (int64_t i = 0; i < on; i++) moe_store_f64(po + i * (int64_t)es, dt, acc[i]);
    free(acc);
  }
  return MOE_OK;
}

/* Shape rules of gather/scatter: one ndim; index.shape[d] <= x.shape[d] for
 * d != dim; <= src.shape[d] for every d (when src). */
static moe_status ix_gs_check(moe_ctx *ctx, const char *fn, const moe_tensor *x, int64_t dim,
                              const moe_tensor *index, const moe_tensor *src, int *d_out) {
  char sx[IX_SHAPE], si[IX_SHAPE], ss[IX_SHAPE];
  MOE_CHECK(ix_index_dtype(ctx, fn, "index", index));
  MOE_CHECK(ix_same_device(ctx, fn, x, "x", index, "index"));
  if (src) MOE_CHECK(ix_same_device(ctx, fn, x, "x", src, "src"));
  if (x->ndim == 0)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: x must have at least one dim, got a scalar", fn);
  MOE_CHECK(moe_dim_normalize_fn(ctx, fn, dim, x->ndim, false, d_out));
  if (index->ndim != x->ndim || (src && src->ndim != x->ndim))
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: x %s, index %s%s%s must have the same number of dims",
                     fn, moe_shape_str(x->ndim, x->shape, sx, sizeof sx),
                     moe_shape_str(index->ndim, index->shape, si, sizeof si), src ? " and src " : "",
                     src ? moe_shape_str(src->ndim, src->shape, ss, sizeof ss) : "");
  for (int d = 0; d < x->ndim; d++) {
    if ((d != *d_out && index->shape[d] > x->shape[d]) || (src && index->shape[d] > src->shape[d]))
      return moe_error(ctx, MOE_ERR_SHAPE,
                       "%s: index %s is larger than x %s%s%s in dim %d (dim = %d)", fn,
                       moe_shape_str(index->ndim, index->shape, si, sizeof si),
                       moe_shape_str(x->ndim, x->shape, sx, sizeof sx), src ? " or src " : "",
                       src ? moe_shape_str(src->ndim, src->shape, ss, sizeof ss) : "", d, *d_out);
  }
  if (src && src->dtype != x->dtype)
    return moe_error(ctx, MOE_ERR_DTYPE, "%s: src is %s but x is %s (they must match)", fn,
                     moe_dtype_name(src->dtype), moe_dtype_name(x->dtype));
  return MOE_OK;
}

/* out = copy of x, then the scatter. */
static moe_status ix_scatter_run(moe_ctx *ctx, const char *fn, moe_scatter_mode mode,
                                 const moe_tensor *x, int dim, const moe_tensor *index,
                                 const moe_tensor *src, moe_tensor **out) {
  moe_tensor *r;
  MOE_CHECK(ix_copy_new(ctx, x, &r));
  moe_status st = ix_scatter_into(ctx, fn, mode, r, dim, index, src);
  if (st != MOE_OK) {
    moe_tensor_release(r);
    return st;
  }
  *out = r;
  return MOE_OK;
}

/* g (shape of src) = zeros, with the index-shaped corner = gout gathered at
 * index: the gradient of src in scatter and scatter_add. */
static moe_status ix_src_grad(moe_ctx *ctx, const char *fn, moe_tensor *gout, int dim,
                              moe_tensor *index, int ndim, const int64_t *src_shape,
                              moe_tensor **out) {
  moe_tensor *g = NULL, *z = NULL, *v = NULL;
  MOE_CHECK(ix_gather_run(ctx, fn, gout, dim, index, &g));
  bool same = true;
  for (int d = 0; d < ndim; d++) same = same && src_shape[d] == index->shape[d];
  if (same) {
    *out = g;
    return MOE_OK;
  }
  moe_status st = ix_zeros(ctx, ndim, src_shape, gout->dtype, gout->storage->device, &z);
  if (st == MOE_OK) {
    moe_tensor_retain(z);
    v = z;
    for (int d = 0; d < ndim && st == MOE_OK; d++) {
      moe_tensor *w = NULL;
      st = moe_narrow(ctx, v, d, 0, index->shape[d], &w);
      moe_tensor_release(v);
      v = w;
    }
    if (st == MOE_OK && moe_tensor_numel(g) > 0) st = moe_copy_(ctx, v, g);
  }
  moe_tensor_release(v);
  moe_tensor_release(g);
  if (st != MOE_OK) {
    moe_tensor_release(z);
    return st;
  }
  *out = z;
  return MOE_OK;
}

/* -------------------------------------------------------------- gather */

/* Backward of an op that picked elements of x along dim iargs[0] at the
 * indices saved in slot 0 (gather, sort, topk's values): zeros of x's shape
 * with the output gradient added back at those indices. */
static moe_status gather_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                  moe_tensor **gin) {
  if (!moe_node_needs_grad(n, 0)) return MOE_OK;
  moe_tensor *index = NULL, *g = NULL;
  MOE_CHECK(ix_zeros(ctx, n->in_ndim[0], n->in_shape[0], n->in_dtype[0], n->in_device[0], &g));
  moe_status st = MOE_OK;
  if (gout[0]) {
    char fn[64];
    snprintf(fn, sizeof fn, "%s backward", moe_node_name(n));
    st = moe_node_saved(ctx, n, 0, &index);
    if (st == MOE_OK)
      st = ix_scatter_into(ctx, fn, MOE_SCATTER_ADD, g, (int)n->iargs[0], index, gout[0]);
  }
  moe_tensor_release(index);
  if (st != MOE_OK) {
    moe_tensor_release(g);
    return st;
  }
  gin[0] = g;
  return MOE_OK;
}

moe_status moe_gather(moe_ctx *ctx, moe_tensor *x, int64_t dim, moe_tensor *index,
                      moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  const char *fn = "gather";
  MOE_CHECK(ix_null(ctx, fn, "x", x));
  MOE_CHECK(ix_null(ctx, fn, "index", index));
  MOE_CHECK(ix_null(ctx, fn, "out", out));
  int d;
  MOE_CHECK(ix_gs_check(ctx, fn, x, dim, index, NULL, &d));
  MOE_CHECK(moe_device_check(ctx, x->storage->device));
  MOE_CHECK(ix_check_range(ctx, fn, "index", index, x->shape[d]));
  moe_tensor *r;
  MOE_CHECK(ix_gather_run(ctx, fn, x, d, index, &r));
  if (moe_grad_wanted(ctx, 1, (const moe_tensor *[]){x}))
    MOE_CHECK(ix_record(ctx, MOE_OP_GATHER, gather_backward, 1, (moe_tensor *[]){x}, 1,
                        (moe_tensor *[]){index}, 1, (int64_t[]){d}, r));
  *out = r;
  return MOE_OK;
}

/* ---------------------------------------------------- scatter, scatter_add */

/* inputs x, src; saved index; iargs dim, mode. */
static moe_status scatter_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                   moe_tensor **gin) {
  int dim = (int)n->iargs[0];
  bool add = n->iargs[1] == MOE_SCATTER_ADD;
  moe_tensor *index = NULL, *gx = NULL, *gs = NULL, *zs = NULL;
  moe_status st = MOE_OK;
  if (!gout[0]) { /* nothing flowed: zeros */
    if (moe_node_needs_grad(n, 0))
      st = ix_zeros(ctx, n->in_ndim[0], n->in_shape[0], n->in_dtype[0], n->in_device[0], &gx);
    if (st == MOE_OK && moe_node_needs_grad(n, 1))
      st = ix_zeros(ctx, n->in_ndim[1], n->in_shape[1], n->in_dtype[1], n->in_device[1], &gs);
    goto done;
  }
  MOE_CHECK_GOTO(moe_node_saved(ctx, n, 0, &index), st, done);
  if (moe_node_needs_grad(n, 0)) {
    if (add) { /* d out / d x is the identity */
      MOE_CHECK_GOTO(ix_copy_new(ctx, gout[0], &gx), st, done);
    } else { /* overwritten targets get no gradient */
      MOE_CHECK_GOTO(ix_zeros(ctx, index->ndim, index->shape, gout[0]->dtype,
                              gout[0]->storage->device, &zs), st, done);
      MOE_CHECK_GOTO(ix_scatter_run(ctx, "scatter backward", MOE_SCATTER_REPLACE, gout[0], dim,
                                    index, zs, &gx), st, done);
    }
  }
  if (moe_node_needs_grad(n, 1))
    MOE_CHECK_GOTO(ix_src_grad(ctx, "scatter backward", gout[0], dim, index, n->in_ndim[1],
                               n->in_shape[1], &gs), st, done);
done:
  moe_tensor_release(index);
  moe_tensor_release(zs);
  if (st != MOE_OK) {
    moe_tensor_release(gx);
    moe_tensor_release(gs);
    return st;
  }
  gin[0] = gx;
  gin[1] = gs;
  return MOE_OK;
}

static moe_status ix_scatter_op(moe_ctx *ctx, const char *fn, moe_scatter_mode mode, moe_tensor *x,
                                int64_t dim, moe_tensor *index, moe_tensor *src,
                                moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(ix_null(ctx, fn, "x", x));
  MOE_CHECK(ix_null(ctx, fn, "index", index));
  MOE_CHECK(ix_null(ctx, fn, "src", src));
  MOE_CHECK(ix_null(ctx, fn, "out", out));
  int d;
  MOE_CHECK(ix_gs_check(ctx, fn, x, dim, index, src, &d));
  if (mode == MOE_SCATTER_ADD && x->dtype == MOE_BOOL)
    return moe_error(ctx, MOE_ERR_DTYPE, "%s: bool tensors cannot be added (convert with to)", fn);
  MOE_CHECK(moe_device_check(ctx, x->storage->device));
  MOE_CHECK(ix_check_range(ctx, fn, "index", index, x->shape[d]));
  moe_tensor *r;
  MOE_CHECK(ix_scatter_run(ctx, fn, mode, x, d, index, src, &r));
  if (moe_grad_wanted(ctx, 2, (const moe_tensor *[]){x, src}))
    MOE_CHECK(ix_record(ctx, mode == MOE_SCATTER_ADD ? MOE_OP_SCATTER_ADD : MOE_OP_SCATTER,
                        scatter_backward, 2, (moe_tensor *[]){x, src}, 1, (moe_tensor *[]){index},
                        2, (int64_t[]){d, mode}, r));
  *out = r;
  return MOE_OK;
}

moe_status moe_scatter(moe_ctx *ctx, moe_tensor *x, int64_t dim, moe_tensor *index,
                       moe_tensor *src, moe_tensor **out) {
  return ix_scatter_op(ctx, "scatter", MOE_SCATTER_REPLACE, x, dim, index, src, out);
}

moe_status moe_scatter_add(moe_ctx *ctx, moe_tensor *x, int64_t dim, moe_tensor *index,
                           moe_tensor *src, moe_tensor **out) {
  return ix_scatter_op(ctx, "scatter_add", MOE_SCATTER_ADD, x, dim, index, src, out);
}

/* ------------------------------------------ index_select, index_add */

/* The 1-D index (n) as a view broadcast to shape (n at dim). */
static moe_status ix_expand_index(moe_ctx *ctx, moe_tensor *index, int ndim, const int64_t *shape,
                                  int dim, moe_tensor **out) {
  moe_tensor *v = NULL;
  int64_t vs[MOE_MAX_DIMS];
  for (int d = 0; d < ndim; d++) vs[d] = d == dim ? index->shape[0] : 1;
  MOE_CHECK(moe_view(ctx, index, ndim, vs, &v));
  moe_status st = moe_expand(ctx, v, ndim, shape, out);
  moe_tensor_release(v);
  return st;
}

/* index 1-D (n) with x: the output shape (x's, n at dim). */
static moe_status ix_select_check(moe_ctx *ctx, const char *fn, const moe_tensor *x, int64_t dim,
                                  const moe_tensor *index, int *d_out, int64_t *shape) {
  char si[IX_SHAPE];
  MOE_CHECK(ix_index_dtype(ctx, fn, "index", index));
  MOE_CHECK(ix_same_device(ctx, fn, x, "x", index, "index"));
  if (x->ndim == 0)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: x must have at least one dim, got a scalar", fn);
  MOE_CHECK(moe_dim_normalize_fn(ctx, fn, dim, x->ndim, false, d_out));
  if (index->ndim != 1)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: index must be 1-D, got %s", fn,
                     moe_shape_str(index->ndim, index->shape, si, sizeof si));
  MOE_CHECK(moe_device_check(ctx, x->storage->device));
  MOE_CHECK(ix_check_range(ctx, fn, "index", index, x->shape[*d_out]));
  memcpy(shape, x->shape, sizeof(int64_t) * (size_t)x->ndim);
  shape[*d_out] = index->shape[0];
  return MOE_OK;
}

/* out = x.index_select(dim, index), no node. */
static moe_status ix_index_select_run(moe_ctx *ctx, const char *fn, moe_tensor *x, int dim,
                                      moe_tensor *index, const int64_t *shape, moe_tensor **out) {
  moe_tensor *e = NULL;
  MOE_CHECK(ix_expand_index(ctx, index, x->ndim, shape, dim, &e));
  moe_status st = ix_gather_run(ctx, fn, x, dim, e, out);
  moe_tensor_release(e);
  return st;
}

/* out: contiguous, holding the base; out.select(dim, index[i]) += src.select(dim, i). */
static moe_status ix_index_add_into(moe_ctx *ctx, const char *fn, moe_tensor *out, int dim,
                                    moe_tensor *index, moe_tensor *src) {
  if (moe_tensor_numel(src) == 0) return MOE_OK;
  if (ix_cuda(out)) {
#ifdef MOE_WITH_CUDA
    moe_tensor *sc = NULL, *ic = NULL;
    int64_t outer = 1, inner = 1;
    for (int d = 0; d < dim; d++) outer *= out->shape[d];
    for (int d = dim + 1; d < out->ndim; d++) inner *= out->shape[d];
    moe_status st = moe_contiguous(ctx, src, &sc);
    if (st == MOE_OK) st = moe_contiguous(ctx, index, &ic);
    if (st == MOE_OK)
      st = moe_cuda_index_add(ctx, out->storage->device.index, fn, moe_tensor_data(out),
                              moe_tensor_data(sc), out->dtype, moe_tensor_data(ic), ic->dtype,
                              outer, out->shape[dim], index->shape[0], inner);
    moe_tensor_release(sc);
    moe_tensor_release(ic);
    return st;
#else
    return ix_not_built(ctx, fn);
#endif
  }
  moe_tensor *e = NULL;
  MOE_CHECK(ix_expand_index(ctx, index, src->ndim, src->shape, dim, &e));
  moe_status st = ix_scatter_into(ctx, fn, MOE_SCATTER_ADD, out, dim, e, src);
  moe_tensor_release(e);
  return st;
}

/* inputs x; saved index; iargs dim. */
static moe_status index_select_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                        moe_tensor **gin) {
  if (!moe_node_needs_grad(n, 0)) return MOE_OK;
  moe_tensor *index = NULL, *g = NULL;
  MOE_CHECK(ix_zeros(ctx, n->in_ndim[0], n->in_shape[0], n->in_dtype[0], n->in_device[0], &g));
  moe_status st = MOE_OK;
  if (gout[0]) {
    st = moe_node_saved(ctx, n, 0, &index);
    if (st == MOE_OK)
      st = ix_index_add_into(ctx, "index_select backward", g, (int)n->iargs[0], index, gout[0]);
  }
  moe_tensor_release(index);
  if (st != MOE_OK) {
    moe_tensor_release(g);
    return st;
  }
  gin[0] = g;
  return MOE_OK;
}

moe_status moe_index_select(moe_ctx *ctx, moe_tensor *x, int64_t dim, moe_tensor *index,
                            moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  const char *fn = "index_select";
  MOE_CHECK(ix_null(ctx, fn, "x", x));
  MOE_CHECK(ix_null(ctx, fn, "index", index));
  MOE_CHECK(ix_null(ctx, fn, "out", out));
  int d;
  int64_t shape[MOE_MAX_DIMS];
  MOE_CHECK(ix_select_check(ctx, fn, x, dim, index, &d, shape));
  moe_tensor *r;
  bool prev = moe_grad_set(ctx, false);
  moe_status st = ix_index_select_run(ctx, fn, x, d, index, shape, &r);
  moe_grad_set(ctx, prev);
  MOE_CHECK(st);
  if (moe_grad_wanted(ctx, 1, (const moe_tensor *[]){x}))
    MOE_CHECK(ix_record(ctx, MOE_OP_INDEX_SELECT, index_select_backward, 1, (moe_tensor *[]){x},
                        1, (moe_tensor *[]){index}, 1, (int64_t[]){d}, r));
  *out = r;
  return MOE_OK;
}

/* inputs x, src; saved index; iargs dim. */
static moe_status index_add_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                     moe_tensor **gin) {
  moe_tensor *index = NULL, *gx = NULL, *gs = NULL;
  moe_status st = MOE_OK;
  int dim = (int)n->iargs[0];
  if (moe_node_needs_grad(n, 0)) {
    if (gout[0]) st = ix_copy_new(ctx, gout[0], &gx);
    else st = ix_zeros(ctx, n->in_ndim[0], n->in_shape[0], n->in_dtype[0], n->in_device[0], &gx);
  }
  if (st == MOE_OK && moe_node_needs_grad(n, 1)) {
    if (gout[0]) {
      st = moe_node_saved(ctx, n, 0, &index);
      if (st == MOE_OK)
        st = ix_index_select_run(ctx, "index_add backward", gout[0], dim, index, n->in_shape[1],
                                 &gs);
    } else {
      st = ix_zeros(ctx, n->in_ndim[1], n->in_shape[1], n->in_dtype[1], n->in_device[1], &gs);
    }
  }
  moe_tensor_release(index);
  if (st != MOE_OK) {
    moe_tensor_release(gx);
    moe_tensor_release(gs);
    return st;
  }
  gin[0] = gx;
  gin[1] = gs;
  return MOE_OK;
}

moe_status moe_index_add(moe_ctx *ctx, moe_tensor *x, int64_t dim, moe_tensor *index,
                         moe_tensor *src, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  const char *fn = "index_add";
  MOE_CHECK(ix_null(ctx, fn, "x", x));
  MOE_CHECK(ix_null(ctx, fn, "index", index));
  MOE_CHECK(ix_null(ctx, fn, "src", src));
  MOE_CHECK(ix_null(ctx, fn, "out", out));
  MOE_CHECK(ix_same_device(ctx, fn, x, "x", src, "src"));
  int d;
  int64_t shape[MOE_MAX_DIMS];
  MOE_CHECK(ix_select_check(ctx, fn, x, dim, index, &d, shape));
  char sx[IX_SHAPE], ss[IX_SHAPE];
  bool ok = src->ndim == x->ndim;
  for (int k = 0; ok && k < x->ndim; k++) ok = src->shape[k] == shape[k];
  if (!ok)
    return moe_error(ctx, MOE_ERR_SHAPE,
                     "%s: src %s must have x's shape %s with dim %d of size %lld (index's length)",
                     fn, moe_shape_str(src->ndim, src->shape, ss, sizeof ss),
                     moe_shape_str(x->ndim, x->shape, sx, sizeof sx), d,
                     (long long)index->shape[0]);
  if (src->dtype != x->dtype)
    return moe_error(ctx, MOE_ERR_DTYPE, "%s: src is %s but x is %s (they must match)", fn,
                     moe_dtype_name(src->dtype), moe_dtype_name(x->dtype));
  if (x->dtype == MOE_BOOL)
    return moe_error(ctx, MOE_ERR_DTYPE, "%s: bool tensors cannot be added (convert with to)", fn);
  moe_tensor *r = NULL;
  bool prev = moe_grad_set(ctx, false);
  moe_status st = ix_copy_new(ctx, x, &r);
  if (st == MOE_OK) st = ix_index_add_into(ctx, fn, r, d, index, src);
  moe_grad_set(ctx, prev);
  if (st != MOE_OK) {
    moe_tensor_release(r);
    return st;
  }
  if (moe_grad_wanted(ctx, 2, (const moe_tensor *[]){x, src}))
    MOE_CHECK(ix_record(ctx, MOE_OP_INDEX_ADD, index_add_backward, 2, (moe_tensor *[]){x, src}, 1,
                        (moe_tensor *[]){index}, 1, (int64_t[]){d}, r));
  *out = r;
  return MOE_OK;
}

/* ----------------------------------------------------------- embedding */

/* inputs weight; saved ids flattened (N). */
static moe_status embedding_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                     moe_tensor **gin) {
  if (!moe_node_needs_grad(n, 0)) return MOE_OK;
  moe_tensor *ids = NULL, *g = NULL, *g2 = NULL;
  MOE_CHECK(ix_zeros(ctx, 2, n->in_shape[0], n->in_dtype[0], n->in_device[0], &g));
  moe_status st = MOE_OK;
  if (gout[0]) {
    st = moe_node_saved(ctx, n, 0, &ids);
    if (st == MOE_OK)
      st = moe_reshape(ctx, gout[0], 2, (int64_t[]){ids->shape[0], n->in_shape[0][1]}, &g2);
    if (st == MOE_OK) st = ix_index_add_into(ctx, "embedding backward", g, 0, ids, g2);
  }
  moe_tensor_release(ids);
  moe_tensor_release(g2);
  if (st != MOE_OK) {
    moe_tensor_release(g);
    return st;
  }
  gin[0] = g;
  return MOE_OK;
}

moe_status moe_embedding(moe_ctx *ctx, moe_tensor *weight, moe_tensor *ids, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  const char *fn = "embedding";
  char sw[IX_SHAPE], si[IX_SHAPE];
  MOE_CHECK(ix_null(ctx, fn, "weight", weight));
  MOE_CHECK(ix_null(ctx, fn, "ids", ids));
  MOE_CHECK(ix_null(ctx, fn, "out", out));
  MOE_CHECK(ix_index_dtype(ctx, fn, "ids", ids));
  MOE_CHECK(ix_same_device(ctx, fn, weight, "weight", ids, "ids"));
  if (weight->ndim != 2)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: weight must be 2-D (V, D), got %s", fn,
                     moe_shape_str(weight->ndim, weight->shape, sw, sizeof sw));
  if (ids->ndim + 1 > MOE_MAX_DIMS)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: ids %s has too many dims (at most %d)", fn,
                     moe_shape_str(ids->ndim, ids->shape, si, sizeof si), MOE_MAX_DIMS - 1);
  MOE_CHECK(moe_device_check(ctx, weight->storage->device));
  MOE_CHECK(ix_check_range(ctx, fn, "ids", ids, weight->shape[0]));
  int64_t N = moe_tensor_numel(ids), D = weight->shape[1];
  int64_t oshape[MOE_MAX_DIMS];
  memcpy(oshape, ids->shape, sizeof(int64_t) * (size_t)ids->ndim);
  oshape[ids->ndim] = D;
  moe_tensor *flat = NULL, *rows = NULL, *r = NULL;
  bool prev = moe_grad_set(ctx, false);
  moe_status st = moe_reshape(ctx, ids, 1, (int64_t[]){N}, &flat);
  if (st == MOE_OK) st = ix_index_select_run(ctx, fn, weight, 0, flat, (int64_t[]){N, D}, &rows);
  if (st == MOE_OK) st = moe_view(ctx, rows, ids->ndim + 1, oshape, &r);
  moe_grad_set(ctx, prev);
  moe_tensor_release(rows);
  if (st == MOE_OK && moe_grad_wanted(ctx, 1, (const moe_tensor *[]){weight}))
    st = ix_record(ctx, MOE_OP_EMBEDDING, embedding_backward, 1, (moe_tensor *[]){weight}, 1,
                   (moe_tensor *[]){flat}, 0, NULL, r);
  else if (st != MOE_OK)
    moe_tensor_release(r);
  moe_tensor_release(flat);
  MOE_CHECK(st);
  *out = r;
  return MOE_OK;
}

/* ------------------------------------------------------------- one_hot */

moe_status moe_one_hot(moe_ctx *ctx, moe_tensor *ids, int64_t num_classes, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  const char *fn = "one_hot";
  char si[IX_SHAPE];
  MOE_CHECK(ix_null(ctx, fn, "ids", ids));
  MOE_CHECK(ix_null(ctx, fn, "out", out));
  MOE_CHECK(ix_index_dtype(ctx, fn, "ids", ids));
  if (ids->ndim + 1 > MOE_MAX_DIMS)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: ids %s has too many dims (at most %d)", fn,
                     moe_shape_str(ids->ndim, ids->shape, si, sizeof si), MOE_MAX_DIMS - 1);
  if (num_classes < -1)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: num_classes must be >= 0 (or -1 to infer), got %lld",
                     fn, (long long)num_classes);
  MOE_CHECK(moe_device_check(ctx, ids->storage->device));
  int64_t m = moe_tensor_numel(ids);
  moe_tensor *flat = NULL, *r = NULL;
  int64_t *host = NULL;
  moe_status st = MOE_OK;
  bool need_host = !ix_cuda(ids) || num_classes == -1;
  if (need_host) {
    host = (int64_t *)malloc(sizeof(int64_t) * (size_t)(m > 0 ? m : 1));
    if (!host) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: no memory", fn);
    st = moe_tensor_to_i64(ctx, ids, host); /* CUDA: a synchronisation (num_classes -1) */
  }
  if (st == MOE_OK && num_classes == -1) {
    if (m == 0) {
      st = moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: cannot infer num_classes from empty ids", fn);
    } else {
      int64_t mx = host[0];
      for (int64_t i = 1; i < m; i++) mx = host[i] > mx ? host[i] : mx;
      num_classes = mx + 1 > 0 ? mx + 1 : 0;
    }
  }
  if (st == MOE_OK && !ix_cuda(ids)) {
    for (int64_t i = 0; i < m && st == MOE_OK; i++)
      if (host[i] < 0 || host[i] >= num_classes)
        st = moe_error(ctx, MOE_ERR_INVALID_ARG,
                       "%s: ids holds %lld at position %lld, outside [0, %lld)", fn,
                       (long long)host[i], (long long)i, (long long)num_classes);
  }
  int64_t oshape[MOE_MAX_DIMS];
  memcpy(oshape, ids->shape, sizeof(int64_t) * (size_t)ids->ndim);
  oshape[ids->ndim] = num_classes;
  if (st == MOE_OK) st = ix_zeros(ctx, ids->ndim + 1, oshape, MOE_I64, ids->storage->device, &r);
  if (st == MOE_OK && m > 0 && num_classes > 0) {
    if (ix_cuda(ids)) {
#ifdef MOE_WITH_CUDA
      st = moe_reshape(ctx, ids, 1, (int64_t[]){m}, &flat);
      if (st == MOE_OK) {
        moe_tensor *fc = NULL;
        st = moe_contiguous(ctx, flat, &fc);
        if (st == MOE_OK)
          st = moe_cuda_one_hot(ctx, ids->storage->device.index, fn, (int64_t *)moe_tensor_data(r),
                                moe_tensor_data(fc), fc->dtype, m, num_classes);
        moe_tensor_release(fc);
      }
#else
      st = ix_not_built(ctx, fn);
#endif
    } else {
      int64_t *po = (int64_t *)moe_tensor_data(r);
      for (int64_t i = 0; i < m; i++) po[i * num_classes + host[i]] = 1;
    }
  }
  free(host);
  moe_tensor_release(flat);
  if (st != MOE_OK) {
    moe_tensor_release(r);
    return st;
  }
  *out = r;
  return MOE_OK;
}

/* ------------------------------------------------------ sort and topk */

typedef struct ix_key {
  double f;  /* float dtypes */
  int64_t i; /* integer dtypes */
  int64_t pos;
} ix_key;

/* NaN above every number; ties by position. */
static int ix_cmp_f(const ix_key *a, const ix_key *b, int dir) {
  bool na = isnan(a->f), nb = isnan(b->f);
  int c = 0;
  if (na || nb) c = na && nb ? 0 : (na ? 1 : -1);
  else c = a->f < b->f ? -1 : a->f > b->f ? 1 : 0;
  c *= dir;
  return c ? c : (a->pos < b->pos ? -1 : a->pos > b->pos);
}
static int ix_cmp_i(const ix_key *a, const ix_key *b, int dir) {
  int c = (a->i < b->i ? -1 : a->i > b->i) * dir;
  return c ? c : (a->pos < b->pos ? -1 : a->pos > b->pos);
}
static int ix_cmp_f_asc(const void *a, const void *b) { return ix_cmp_f(a, b, 1); }
static int ix_cmp_f_desc(const void *a, const void *b) { return ix_cmp_f(a, b, -1); }
static int ix_cmp_i_asc(const void *a, const void *b) { return ix_cmp_i(a, b, 1); }
static int ix_cmp_i_desc(const void *a, const void *b) { return ix_cmp_i(a, b, -1); }

/* CPU: each row of x along dim sorted; the first k written to values and
 * indices (contiguous, x's shape with k at dim). */
static void ix_sort_cpu(const moe_tensor *x, int dim, bool descending, int64_t k,
                        moe_tensor *values, moe_tensor *indices, ix_key *keys) {
  int64_t C = x->shape[dim], rows = C > 0 ? moe_tensor_numel(x) / C : 0;
  bool isf = moe_dtype_is_float(x->dtype);
  int (*cmp)(const void *, const void *) =
      isf ? (descending ? ix_cmp_f_desc : ix_cmp_f_asc) : (descending ? ix_cmp_i_desc : ix_cmp_i_asc);
  size_t es = moe_dtype_size(x->dtype);
  const char *px = (const char *)moe_tensor_data(x);
  char *pv = values ? (char *)moe_tensor_data(values) : NULL;
  int64_t *pi = (int64_t *)moe_tensor_data(indices);
  int64_t coord[MOE_MAX_DIMS] = {0}, rshape[MOE_MAX_DIMS];
  memcpy(rshape, x->shape, sizeof rshape);
  rshape[dim] = 1;
  for (int64_t r = 0; r < rows; r++) {
    int64_t xo = ix_offset(x->ndim, coord, x->stride), oo = ix_offset(x->ndim, coord, indices->stride);
    for (int64_t j = 0; j < C; j++) {
      const char *p = px + (xo + j * x->stride[dim]) * (int64_t)es;
      if (isf) keys[j].f = moe_load_f64(p, x->dtype);
      else keys[j].i = moe_load_i64(p, x->dtype);
      keys[j].pos = j;
    }
    qsort(keys, (size_t)C, sizeof(ix_key), cmp);
    for (int64_t j = 0; j < k; j++) {
      int64_t o = oo + j * indices->stride[dim];
      pi[o] = keys[j].pos;
      if (pv) memcpy(pv + o * (int64_t)es, px + (xo + keys[j].pos * x->stride[dim]) * (int64_t)es, es);
    }
    ix_next(x->ndim, rshape, coord);
  }
}

/* values (optional) and indices: new contiguous tensors of x's shape with k
 * at dim: the first k of each row in the order asked. topk: k <= 32 on a
 * CUDA row uses the warp kernel. */
static moe_status ix_sort_run(moe_ctx *ctx, const char *fn, moe_tensor *x, int dim,
                              bool descending, int64_t k, bool want_values, moe_tensor **values,
                              moe_tensor **indices) {
  int64_t oshape[MOE_MAX_DIMS];
  memcpy(oshape, x->shape, sizeof oshape);
  oshape[dim] = k;
  moe_tensor *v = NULL, *ix = NULL;
  moe_device dev = x->storage->device;
  moe_status st = moe_tensor_empty(ctx, x->ndim, oshape, MOE_I64, dev, &ix);
  if (st == MOE_OK && want_values) st = moe_tensor_empty(ctx, x->ndim, oshape, x->dtype, dev, &v);
  int64_t C = x->shape[dim];
  if (st == MOE_OK && moe_tensor_numel(ix) > 0) {
    if (ix_cuda(x)) {
#ifdef MOE_WITH_CUDA
      /* rows along the last dim, contiguous */
      int last = x->ndim - 1;
      moe_tensor *xt = NULL, *xc = NULL, *vr = NULL, *ir = NULL, *vt = NULL, *it = NULL;
      int64_t rows = moe_tensor_numel(x) / C, tshape[MOE_MAX_DIMS];
      bool small = k <= MOE_CUDA_TOPK_MAX_K && k < C && C <= 4096;
      int64_t kk = small ? k : C; /* the sort writes whole rows */
      st = moe_transpose(ctx, x, dim, last, &xt);
      if (st == MOE_OK) st = moe_contiguous(ctx, xt, &xc);
      if (st == MOE_OK) {
        memcpy(tshape, xt->shape, sizeof tshape);
        tshape[last] = kk;
        st = moe_tensor_empty(ctx, x->ndim, tshape, x->dtype, dev, &vr);
      }
      if (st == MOE_OK) st = moe_tensor_empty(ctx, x->ndim, tshape, MOE_I64, dev, &ir);
      if (st == MOE_OK && (int64_t)rows * C >= INT32_MAX && !small)
        st = moe_error(ctx, MOE_ERR_NOT_SUPPORTED, "%s: %lld elements: the CUDA sort takes fewer than 2^31",
                       fn, (long long)(rows * C));
      if (st == MOE_OK && small)
        st = moe_cuda_topk_rows(ctx, dev.index, moe_tensor_data(vr), (int64_t *)moe_tensor_data(ir),
                                moe_tensor_data(xc), x->dtype, rows, C, k, descending);
      else if (st == MOE_OK)
        st = moe_cuda_sort_rows(ctx, dev.index, moe_tensor_data(vr), (int64_t *)moe_tensor_data(ir),
                                moe_tensor_data(xc), x->dtype, rows, C, descending);
      /* the first k along the last dim, back to dim */
      if (st == MOE_OK) st = moe_narrow(ctx, ir, last, 0, k, &it);
      if (st == MOE_OK) {
        moe_tensor *t2 = NULL;
        st = moe_transpose(ctx, it, dim, last, &t2);
        if (st == MOE_OK) st = moe_copy_(ctx, ix, t2);
        moe_tensor_release(t2);
      }
      if (st == MOE_OK && v) st = moe_narrow(ctx, vr, last, 0, k, &vt);
      if (st == MOE_OK && v) {
        moe_tensor *t2 = NULL;
        st = moe_transpose(ctx, vt, dim, last, &t2);
        if (st == MOE_OK) st = moe_copy_(ctx, v, t2);
        moe_tensor_release(t2);
      }
      moe_tensor_release(xt);
      moe_tensor_release(xc);
      moe_tensor_release(vr);
      moe_tensor_release(ir);
      moe_tensor_release(vt);
      moe_tensor_release(it);
#else
      st = ix_not_built(ctx, fn);
#endif
    } else {
      ix_key *keys = (ix_key *)malloc(sizeof(ix_key) * (size_t)C);
      if (!keys) st = moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: no memory for a row of %lld", fn, (long long)C);
      else ix_sort_cpu(x, dim, descending, k, v, ix, keys);
      free(keys);
    }
  }
  if (st != MOE_OK) {
    moe_tensor_release(v);
    moe_tensor_release(ix);
    return st;
  }
  if (values) *values = v;
  *indices = ix;
  return MOE_OK;
}


static moe_status ix_sort_check(moe_ctx *ctx, const char *fn, const moe_tensor *x, int64_t dim,
                                int *d) {
  MOE_CHECK(ix_null(ctx, fn, "x", x));
  if (x->dtype == MOE_BOOL)
    return moe_error(ctx, MOE_ERR_DTYPE, "%s: bool tensors are not sorted (convert with to)", fn);
  if (x->ndim == 0)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: x must have at least one dim, got a scalar", fn);
  MOE_CHECK(moe_dim_normalize_fn(ctx, fn, dim, x->ndim, false, d));
  return moe_device_check(ctx, x->storage->device);
}

/* values/indices with a node on values (op SORT or TOPK). */
static moe_status ix_sort_op(moe_ctx *ctx, const char *fn, moe_op op, moe_tensor *x, int d,
                             bool descending, int64_t k, moe_tensor **values,
                             moe_tensor **indices) {
  moe_tensor *v = NULL, *ix = NULL;
  bool prev = moe_grad_set(ctx, false);
  moe_status st = ix_sort_run(ctx, fn, x, d, descending, k, true, &v, &ix);
  moe_grad_set(ctx, prev);
  MOE_CHECK(st);
  if (moe_grad_wanted(ctx, 1, (const moe_tensor *[]){x})) {
    st = ix_record(ctx, op, gather_backward, 1, (moe_tensor *[]){x}, 1, (moe_tensor *[]){ix}, 1,
                   (int64_t[]){d}, v);
    if (st != MOE_OK) {
      moe_tensor_release(ix);
      return st;
    }
  }
  *values = v;
  *indices = ix;
  return MOE_OK;
}

moe_status moe_sort(moe_ctx *ctx, moe_tensor *x, int64_t dim, bool descending,
                    moe_tensor **values, moe_tensor **indices) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  int d;
  MOE_CHECK(ix_sort_check(ctx, "sort", x, dim, &d));
  MOE_CHECK(ix_null(ctx, "sort", "values", values));
  MOE_CHECK(ix_null(ctx, "sort", "indices", indices));
  return ix_sort_op(ctx, "sort", MOE_OP_SORT, x, d, descending, x->shape[d], values, indices);
}

moe_status moe_argsort(moe_ctx *ctx, moe_tensor *x, int64_t dim, bool descending,
                       moe_tensor **indices) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  int d;
  MOE_CHECK(ix_sort_check(ctx, "argsort", x, dim, &d));
  MOE_CHECK(ix_null(ctx, "argsort", "indices", indices));
  bool prev = moe_grad_set(ctx, false);
  moe_status st = ix_sort_run(ctx, "argsort", x, d, descending, x->shape[d], false, NULL, indices);
  moe_grad_set(ctx, prev);
  return st;
}

moe_status moe_topk(moe_ctx *ctx, moe_tensor *x, int64_t k, int64_t dim, bool largest,
                    moe_tensor **values, moe_tensor **indices) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  int d;
  char sx[IX_SHAPE];
  MOE_CHECK(ix_sort_check(ctx, "topk", x, dim, &d));
  MOE_CHECK(ix_null(ctx, "topk", "values", values));
  MOE_CHECK(ix_null(ctx, "topk", "indices", indices));
  if (k < 0 || k > x->shape[d])
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "topk: k = %lld is outside [0, %lld] for x %s and dim %d",
                     (long long)k, (long long)x->shape[d],
                     moe_shape_str(x->ndim, x->shape, sx, sizeof sx), d);
  return ix_sort_op(ctx, "topk", MOE_OP_TOPK, x, d, largest, k, values, indices);
}

/* ------------------------------------------------------------- joining */

static moe_status ix_join_check(moe_ctx *ctx, const char *fn, int n, moe_tensor *const *xs) {
  char s0[IX_SHAPE], si[IX_SHAPE];
  if (n < 1) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: needs at least one tensor, got %d", fn, n);
  MOE_CHECK(ix_null(ctx, fn, "the tensor list", xs));
  for (int i = 0; i < n; i++)
    if (!xs[i]) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: tensor %d is NULL", fn, i);
  for (int i = 1; i < n; i++) {
    if (!moe_device_equal(xs[i]->storage->device, xs[0]->storage->device)) {
      char a[32], b[32];
      return moe_error(ctx, MOE_ERR_DEVICE, "%s: tensor %d is on %s but tensor 0 is on %s", fn, i,
                       moe_device_str(xs[i]->storage->device, a, sizeof a),
                       moe_device_str(xs[0]->storage->device, b, sizeof b));
    }
    if (xs[i]->dtype != xs[0]->dtype)
      return moe_error(ctx, MOE_ERR_DTYPE, "%s: tensor %d is %s but tensor 0 is %s", fn, i,
                       moe_dtype_name(xs[i]->dtype), moe_dtype_name(xs[0]->dtype));
    if (xs[i]->ndim != xs[0]->ndim)
      return moe_error(ctx, MOE_ERR_SHAPE, "%s: tensor %d %s and tensor 0 %s differ in dims", fn, i,
                       moe_shape_str(xs[i]->ndim, xs[i]->shape, si, sizeof si),
                       moe_shape_str(xs[0]->ndim, xs[0]->shape, s0, sizeof s0));
  }
  return moe_device_check(ctx, xs[0]->storage->device);
}

/* inputs xs; iargs dim. gin[i] = gout narrowed to input i's extent. */
static moe_status cat_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                               moe_tensor **gin) {
  int dim = (int)n->iargs[0];
  int64_t off = 0;
  moe_status st = MOE_OK;
  for (int i = 0; i < n->n_inputs && st == MOE_OK; i++) {
    int64_t len = n->in_shape[i][dim];
    if (moe_node_needs_grad(n, i)) {
      if (!gout[0]) {
        st = ix_zeros(ctx, n->in_ndim[i], n->in_shape[i], n->in_dtype[i], n->in_device[i], &gin[i]);
      } else {
        moe_tensor *v = NULL;
        st = moe_narrow(ctx, gout[0], dim, off, len, &v);
        if (st == MOE_OK) st = ix_copy_new(ctx, v, &gin[i]);
        moe_tensor_release(v);
      }
    }
    off += len;
  }
  if (st != MOE_OK)
    for (int i = 0; i < n->n_inputs; i++) {
      moe_tensor_release(gin[i]);
      gin[i] = NULL;
    }
  return st;
}

/* inputs xs; iargs dim. gin[i] = gout.select(dim, i). */
static moe_status stack_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                 moe_tensor **gin) {
  int dim = (int)n->iargs[0];
  moe_status st = MOE_OK;
  for (int i = 0; i < n->n_inputs && st == MOE_OK; i++) {
    if (!moe_node_needs_grad(n, i)) continue;
    if (!gout[0]) {
      st = ix_zeros(ctx, n->in_ndim[i], n->in_shape[i], n->in_dtype[i], n->in_device[i], &gin[i]);
    } else {
      moe_tensor *v = NULL;
      st = moe_select(ctx, gout[0], dim, i, &v);
      if (st == MOE_OK) st = ix_copy_new(ctx, v, &gin[i]);
      moe_tensor_release(v);
    }
  }
  if (st != MOE_OK)
    for (int i = 0; i < n->n_inputs; i++) {
      moe_tensor_release(gin[i]);
      gin[i] = NULL;
    }
  return st;
}

/* Copies each input into its place of a new tensor; stack: select, cat: narrow. */
static moe_status ix_join_run(moe_ctx *ctx, int n, moe_tensor *const *xs, int dim, bool stack,
                              int ndim, const int64_t *shape, moe_tensor **out) {
  moe_tensor *r;
  MOE_CHECK(moe_tensor_empty(ctx, ndim, shape, xs[0]->dtype, xs[0]->storage->device, &r));
  moe_status st = MOE_OK;
  int64_t off = 0;
  bool prev = moe_grad_set(ctx, false);
  for (int i = 0; i < n && st == MOE_OK; i++) {
    moe_tensor *v = NULL;
    int64_t len = stack ? 1 : xs[i]->shape[dim];
    st = stack ? moe_select(ctx, r, dim, i, &v) : moe_narrow(ctx, r, dim, off, len, &v);
    if (st == MOE_OK && moe_tensor_numel(v) > 0) st = moe_copy_(ctx, v, xs[i]);
    moe_tensor_release(v);
    off += len;
  }
  moe_grad_set(ctx, prev);
  if (st != MOE_OK) {
    moe_tensor_release(r);
    return st;
  }
  *out = r;
  return MOE_OK;
}

moe_status moe_cat(moe_ctx *ctx, int n, moe_tensor *const *xs, int64_t dim, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  const char *fn = "cat";
  char s0[IX_SHAPE], si[IX_SHAPE];
  MOE_CHECK(ix_join_check(ctx, fn, n, xs));
  MOE_CHECK(ix_null(ctx, fn, "out", out));
  if (xs[0]->ndim == 0)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: scalars cannot be concatenated (use stack)", fn);
  int d;
  MOE_CHECK(moe_dim_normalize_fn(ctx, "cat", dim, xs[0]->ndim, false, &d));
  int64_t shape[MOE_MAX_DIMS];
  memcpy(shape, xs[0]->shape, sizeof shape);
  shape[d] = 0;
  for (int i = 0; i < n; i++) {
    for (int k = 0; k < xs[0]->ndim; k++)
      if (k != d && xs[i]->shape[k] != xs[0]->shape[k])
        return moe_error(ctx, MOE_ERR_SHAPE,
                         "%s: tensor %d %s does not match tensor 0 %s outside dim %d", fn, i,
                         moe_shape_str(xs[i]->ndim, xs[i]->shape, si, sizeof si),
                         moe_shape_str(xs[0]->ndim, xs[0]->shape, s0, sizeof s0), d);
    shape[d] += xs[i]->shape[d];
  }
  bool grad = moe_grad_wanted(ctx, n, (const moe_tensor *const *)xs);
  if (grad && n > MOE_NODE_MAX_INPUTS) {
    /* a node holds at most 8 inputs: cat at most 8 groups (recursively), then the groups */
    int per = (n + MOE_NODE_MAX_INPUTS - 1) / MOE_NODE_MAX_INPUTS, np = 0;
    moe_tensor *parts[MOE_NODE_MAX_INPUTS] = {0};
    moe_status st = MOE_OK;
    for (int i = 0; i < n && st == MOE_OK; i += per, np++)
      st = moe_cat(ctx, n - i < per ? n - i : per, xs + i, d, &parts[np]);
    if (st == MOE_OK) st = moe_cat(ctx, np, parts, d, out);
    for (int i = 0; i < np; i++) moe_tensor_release(parts[i]);
    return st;
  }
  moe_tensor *r;
  MOE_CHECK(ix_join_run(ctx, n, xs, d, false, xs[0]->ndim, shape, &r));
  if (grad) MOE_CHECK(ix_record(ctx, MOE_OP_CAT, cat_backward, n, xs, 0, NULL, 1, (int64_t[]){d}, r));
  *out = r;
  return MOE_OK;
}

moe_status moe_stack(moe_ctx *ctx, int n, moe_tensor *const *xs, int64_t dim, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  const char *fn = "stack";
  char s0[IX_SHAPE], si[IX_SHAPE];
  MOE_CHECK(ix_join_check(ctx, fn, n, xs));
  MOE_CHECK(ix_null(ctx, fn, "out", out));
  int nd = xs[0]->ndim;
  if (nd + 1 > MOE_MAX_DIMS)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: stacking %d-dim tensors gives more than %d dims", fn,
                     nd, MOE_MAX_DIMS);
  int d;
  MOE_CHECK(moe_dim_normalize_fn(ctx, "stack", dim, nd, true, &d));
  for (int i = 1; i < n; i++)
    for (int k = 0; k < nd; k++)
      if (xs[i]->shape[k] != xs[0]->shape[k])
        return moe_error(ctx, MOE_ERR_SHAPE, "%s: tensor %d %s and tensor 0 %s differ in shape", fn,
                         i, moe_shape_str(xs[i]->ndim, xs[i]->shape, si, sizeof si),
                         moe_shape_str(nd, xs[0]->shape, s0, sizeof s0));
  int64_t shape[MOE_MAX_DIMS];
  for (int k = 0, j = 0; k <= nd; k++) shape[k] = k == d ? n : xs[0]->shape[j++];
  bool grad = moe_grad_wanted(ctx, n, (const moe_tensor *const *)xs);
  if (grad && n > MOE_NODE_MAX_INPUTS) { /* stack groups of 8, then cat the parts along d */
    int per = MOE_NODE_MAX_INPUTS, np = (n + per - 1) / per;
    moe_tensor **parts = (moe_tensor **)calloc((size_t)np, sizeof(moe_tensor *));
    if (!parts) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: no memory", fn);
    moe_status st = MOE_OK;
    for (int p = 0; p < np && st == MOE_OK; p++) {
      int i = p * per;
      st = moe_stack(ctx, n - i < per ? n - i : per, xs + i, d, &parts[p]);
    }
    if (st == MOE_OK) st = moe_cat(ctx, np, parts, d, out);
    for (int p = 0; p < np; p++) moe_tensor_release(parts[p]);
    free(parts);
    return st;
  }
  moe_tensor *r;
  MOE_CHECK(ix_join_run(ctx, n, xs, d, true, nd + 1, shape, &r));
  if (grad)
    MOE_CHECK(ix_record(ctx, MOE_OP_STACK, stack_backward, n, xs, 0, NULL, 1, (int64_t[]){d}, r));
  *out = r;
  return MOE_OK;
}

/* ------------------------------------------------------- split, chunk */

static moe_status ix_split_check(moe_ctx *ctx, const char *fn, const moe_tensor *x, int64_t dim,
                                 int *d) {
  MOE_CHECK(ix_null(ctx, fn, "x", x));
  if (x->ndim == 0)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: x must have at least one dim, got a scalar", fn);
  return moe_dim_normalize_fn(ctx, fn, dim, x->ndim, false, d);
}

moe_status moe_split_count(moe_ctx *ctx, const moe_tensor *x, int64_t split_size, int64_t dim,
                           int *count) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  int d;
  MOE_CHECK(ix_split_check(ctx, "split", x, dim, &d));
  MOE_CHECK(ix_null(ctx, "split", "count", count));
  if (split_size < 1)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "split: split_size must be >= 1, got %lld",
                     (long long)split_size);
  int64_t S = x->shape[d], c = S == 0 ? 1 : (S + split_size - 1) / split_size;
  if (c > INT32_MAX) return moe_error(ctx, MOE_ERR_INVALID_ARG, "split: %lld pieces are too many", (long long)c);
  *count = (int)c;
  return MOE_OK;
}

moe_status moe_chunk_count(moe_ctx *ctx, const moe_tensor *x, int64_t chunks, int64_t dim,
                           int *count) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  int d;
  MOE_CHECK(ix_split_check(ctx, "chunk", x, dim, &d));
  MOE_CHECK(ix_null(ctx, "chunk", "count", count));
  if (chunks < 1)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "chunk: chunks must be >= 1, got %lld", (long long)chunks);
  int64_t S = x->shape[d], size = (S + chunks - 1) / chunks;
  return moe_split_count(ctx, x, size > 0 ? size : 1, d, count);
}

/* Narrow views of the given sizes. */
static moe_status ix_split_views(moe_ctx *ctx, moe_tensor *x, int d, int n, const int64_t *sizes,
                                 moe_tensor **outs) {
  int64_t off = 0;
  for (int i = 0; i < n; i++) {
    moe_status st = moe_narrow(ctx, x, d, off, sizes[i], &outs[i]);
    if (st != MOE_OK) {
      for (int j = 0; j < i; j++) {
        moe_tensor_release(outs[j]);
        outs[j] = NULL;
      }
      return st;
    }
    off += sizes[i];
  }
  return MOE_OK;
}

moe_status moe_split_sizes(moe_ctx *ctx, moe_tensor *x, int n, const int64_t *sizes,
                           int64_t dim, moe_tensor **outs) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  int d;
  char sx[IX_SHAPE];
  MOE_CHECK(ix_split_check(ctx, "split", x, dim, &d));
  MOE_CHECK(ix_null(ctx, "split", "outs", outs));
  if (n < 1) return moe_error(ctx, MOE_ERR_INVALID_ARG, "split: needs at least one size, got %d", n);
  MOE_CHECK(ix_null(ctx, "split", "sizes", sizes));
  int64_t sum = 0;
  for (int i = 0; i < n; i++) {
    if (sizes[i] < 0)
      return moe_error(ctx, MOE_ERR_INVALID_ARG, "split: sizes[%d] = %lld is negative", i,
                       (long long)sizes[i]);
    sum += sizes[i];
  }
  if (sum != x->shape[d])
    return moe_error(ctx, MOE_ERR_SHAPE, "split: sizes sum to %lld but x %s has %lld in dim %d",
                     (long long)sum, moe_shape_str(x->ndim, x->shape, sx, sizeof sx),
                     (long long)x->shape[d], d);
  return ix_split_views(ctx, x, d, n, sizes, outs);
}

static moe_status ix_split_even(moe_ctx *ctx, const char *fn, moe_tensor *x, int d, int64_t size,
                                int max_out, moe_tensor **outs, int *n_out) {
  int c;
  MOE_CHECK(moe_split_count(ctx, x, size, d, &c));
  MOE_CHECK(ix_null(ctx, fn, "outs", outs));
  MOE_CHECK(ix_null(ctx, fn, "n_out", n_out));
  if (c > max_out)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: gives %d pieces but outs has room for %d", fn,
                     c, max_out);
  int64_t *sizes = (int64_t *)malloc(sizeof(int64_t) * (size_t)c);
  if (!sizes) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: no memory", fn);
  int64_t S = x->shape[d];
  for (int i = 0; i < c; i++) sizes[i] = S - i * size < size ? S - i * size : size;
  moe_status st = ix_split_views(ctx, x, d, c, sizes, outs);
  free(sizes);
  if (st == MOE_OK) *n_out = c;
  return st;
}

moe_status moe_split(moe_ctx *ctx, moe_tensor *x, int64_t split_size, int64_t dim, int max_out,
                     moe_tensor **outs, int *n_out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  int d;
  MOE_CHECK(ix_split_check(ctx, "split", x, dim, &d));
  return ix_split_even(ctx, "split", x, d, split_size, max_out, outs, n_out);
}

moe_status moe_chunk(moe_ctx *ctx, moe_tensor *x, int64_t chunks, int64_t dim, int max_out,
                     moe_tensor **outs, int *n_out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  int d;
  MOE_CHECK(ix_split_check(ctx, "chunk", x, dim, &d));
  if (chunks < 1)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "chunk: chunks must be >= 1, got %lld", (long long)chunks);
  int64_t S = x->shape[d], size = (S + chunks - 1) / chunks;
  return ix_split_even(ctx, "chunk", x, d, size > 0 ? size : 1, max_out, outs, n_out);
}

/* -------------------------------------------------------------- rope */

/* out (new, contiguous) = rotation of x (inverse: the transposed one). */
static moe_status ix_rope_run(moe_ctx *ctx, const char *fn, const moe_tensor *x,
                              const moe_tensor *cos, const moe_tensor *sin, int tdim,
                              bool inverse, moe_tensor **out) {
  moe_tensor *r;
  MOE_CHECK(moe_tensor_empty(ctx, x->ndim, x->shape, x->dtype, x->storage->device, &r));
  moe_status st = MOE_OK;
  if (moe_tensor_numel(r) > 0 && ix_cuda(x)) {
#ifdef MOE_WITH_CUDA
    moe_kview vo = moe_kview_of(r), vx = moe_kview_of(x), vc = moe_kview_of(cos),
              vs = moe_kview_of(sin);
    st = moe_cuda_rope(ctx, x->storage->device.index, &vo, &vx, &vc, &vs, tdim, inverse);
#else
    st = ix_not_built(ctx, fn);
#endif
  } else if (moe_tensor_numel(r) > 0) {
    moe_dtype dt = x->dtype;
    size_t es = moe_dtype_size(dt);
    int64_t D = x->shape[3], h = D / 2, full = cos->shape[1] == D;
    const char *px = (const char *)moe_tensor_data(x), *pc = (const char *)moe_tensor_data(cos),
               *ps = (const char *)moe_tensor_data(sin);
    char *po = (char *)moe_tensor_data(r);
    int64_t coord[4] = {0}, pshape[4] = {x->shape[0], x->shape[1], x->shape[2], h};
    int64_t pairs = x->shape[0] * x->shape[1] * x->shape[2] * h;
    for (int64_t p = 0; p < pairs; p++) {
      int64_t t = coord[tdim], j = coord[3];
      int64_t xo = coord[0] * x->stride[0] + coord[1] * x->stride[1] + coord[2] * x->stride[2];
      int64_t oo = coord[0] * r->stride[0] + coord[1] * r->stride[1] + coord[2] * r->stride[2];
      int64_t ja = j, jb = full ? j + h : j;
      const char *x1 = px + (xo + j * x->stride[3]) * (int64_t)es;
      const char *x2 = px + (xo + (j + h) * x->stride[3]) * (int64_t)es;
      int64_t ca = (t * cos->stride[0] + ja * cos->stride[1]) * (int64_t)es;
      int64_t cb = (t * cos->stride[0] + jb * cos->stride[1]) * (int64_t)es;
      int64_t sa = (t * sin->stride[0] + ja * sin->stride[1]) * (int64_t)es;
      int64_t sb = (t * sin->stride[0] + jb * sin->stride[1]) * (int64_t)es;
      /* forward: o1 = x1 c_a - x2 s_a, o2 = x2 c_b + x1 s_b;
       * inverse: o1 = x1 c_a + x2 s_b, o2 = x2 c_b - x1 s_a */
      if (dt == MOE_F64) {
        double a = *(const double *)x1, b = *(const double *)x2;
        double c1 = moe_load_f64(pc + ca, dt), c2 = moe_load_f64(pc + cb, dt);
        double s1 = moe_load_f64(ps + sa, dt), s2 = moe_load_f64(ps + sb, dt);
        double o1 = inverse ? a * c1 + b * s2 : a * c1 - b * s1;
        double o2 = inverse ? b * c2 - a * s1 : b * c2 + a * s2;
        moe_store_f64(po + (oo + j) * (int64_t)es, dt, o1);
        moe_store_f64(po + (oo + j + h) * (int64_t)es, dt, o2);
      } else {
        float a = (float)moe_load_f64(x1, dt), b = (float)moe_load_f64(x2, dt);
        float c1 = (float)moe_load_f64(pc + ca, dt), c2 = (float)moe_load_f64(pc + cb, dt);
        float s1 = (float)moe_load_f64(ps + sa, dt), s2 = (float)moe_load_f64(ps + sb, dt);
        float o1 = inverse ? a * c1 + b * s2 : a * c1 - b * s1;
        float o2 = inverse ? b * c2 - a * s1 : b * c2 + a * s2;
        moe_store_f64(po + (oo + j) * (int64_t)es, dt, o1);
        moe_store_f64(po + (oo + j + h) * (int64_t)es, dt, o2);
      }
      ix_next(4, pshape, coord);
    }
  }
  if (st != MOE_OK) {
    moe_tensor_release(r);
    return st;
  }
  *out = r;
  return MOE_OK;
}

/* inputs x; saved cos, sin; iargs tdim. */
static moe_status rope_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                moe_tensor **gin) {
  if (!moe_node_needs_grad(n, 0)) return MOE_OK;
  if (!gout[0])
    return ix_zeros(ctx, n->in_ndim[0], n->in_shape[0], n->in_dtype[0], n->in_device[0], &gin[0]);
  moe_tensor *c = NULL, *s = NULL;
  moe_status st = moe_node_saved(ctx, n, 0, &c);
  if (st == MOE_OK) st = moe_node_saved(ctx, n, 1, &s);
  if (st == MOE_OK) st = ix_rope_run(ctx, "rope backward", gout[0], c, s, (int)n->iargs[0], true, &gin[0]);
  moe_tensor_release(c);
  moe_tensor_release(s);
  return st;
}

moe_status moe_rope(moe_ctx *ctx, moe_tensor *x, moe_tensor *cos, moe_tensor *sin,
                    moe_rope_layout layout, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  const char *fn = "rope";
  char sx[IX_SHAPE], sc[IX_SHAPE], ss[IX_SHAPE];
  MOE_CHECK(ix_null(ctx, fn, "x", x));
  MOE_CHECK(ix_null(ctx, fn, "cos", cos));
  MOE_CHECK(ix_null(ctx, fn, "sin", sin));
  MOE_CHECK(ix_null(ctx, fn, "out", out));
  if (layout != MOE_ROPE_BTHD && layout != MOE_ROPE_BHTD)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "rope: unknown layout %d (BTHD or BHTD)", (int)layout);
  MOE_CHECK(ix_same_device(ctx, fn, x, "x", cos, "cos"));
  MOE_CHECK(ix_same_device(ctx, fn, x, "x", sin, "sin"));
  if (x->dtype != MOE_F32 && x->dtype != MOE_F64 && x->dtype != MOE_BF16 && x->dtype != MOE_F16)
    return moe_error(ctx, MOE_ERR_DTYPE, "rope: x must be f32, f64, bf16 or f16, got %s",
                     moe_dtype_name(x->dtype));
  if (cos->dtype != x->dtype || sin->dtype != x->dtype)
    return moe_error(ctx, MOE_ERR_DTYPE, "rope: cos (%s) and sin (%s) must have x's dtype %s",
                     moe_dtype_name(cos->dtype), moe_dtype_name(sin->dtype), moe_dtype_name(x->dtype));
  int tdim = layout == MOE_ROPE_BTHD ? 1 : 2;
  if (x->ndim != 4 || x->shape[3] % 2 != 0)
    return moe_error(ctx, MOE_ERR_SHAPE, "rope: x must be 4-D (%s) with an even last dim, got %s",
                     layout == MOE_ROPE_BTHD ? "B, T, H, D" : "B, H, T, D",
                     moe_shape_str(x->ndim, x->shape, sx, sizeof sx));
  int64_t T = x->shape[tdim], D = x->shape[3];
  bool ok = cos->ndim == 2 && sin->ndim == 2 && cos->shape[0] == T && sin->shape[0] == T &&
            cos->shape[1] == sin->shape[1] && (cos->shape[1] == D || cos->shape[1] == D / 2);
  if (!ok)
    return moe_error(ctx, MOE_ERR_SHAPE,
                     "rope: cos %s and sin %s must both be (T, D/2) or (T, D) = (%lld, %lld) or "
                     "(%lld, %lld) for x %s",
                     moe_shape_str(cos->ndim, cos->shape, sc, sizeof sc),
                     moe_shape_str(sin->ndim, sin->shape, ss, sizeof ss), (long long)T,
                     (long long)(D / 2), (long long)T, (long long)D,
                     moe_shape_str(x->ndim, x->shape, sx, sizeof sx));
  if (moe_requires_grad(cos) || moe_requires_grad(sin))
    return moe_error(ctx, MOE_ERR_NOT_SUPPORTED,
                     "rope: cos and sin are constants; gradients for them are not supported "
                     "(detach them)");
  MOE_CHECK(moe_device_check(ctx, x->storage->device));
  moe_tensor *r;
  MOE_CHECK(ix_rope_run(ctx, fn, x, cos, sin, tdim, false, &r));
  if (moe_grad_wanted(ctx, 1, (const moe_tensor *[]){x}))
    MOE_CHECK(ix_record(ctx, MOE_OP_ROPE, rope_backward, 1, (moe_tensor *[]){x}, 2,
                        (moe_tensor *[]){cos, sin}, 1, (int64_t[]){tdim}, r));
  *out = r;
  return MOE_OK;
}

moe_status moe_rope_cache(moe_ctx *ctx, int64_t T, int64_t D, double base, moe_dtype dt,
                          moe_device d, moe_tensor **cos_out, moe_tensor **sin_out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  const char *fn = "rope_cache";
  MOE_CHECK(ix_null(ctx, fn, "cos", cos_out));
  MOE_CHECK(ix_null(ctx, fn, "sin", sin_out));
  if (T < 0 || D <= 0 || D % 2 != 0)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: T must be >= 0 and D even and > 0, got T = %lld, D = %lld",
                     fn, (long long)T, (long long)D);
  if (!(base > 0) || !isfinite(base))
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: base must be positive and finite, got %g", fn, base);
  if (!moe_dtype_is_float(dt))
    return moe_error(ctx, MOE_ERR_DTYPE, "%s: dtype must be a float dtype, got %s", fn, moe_dtype_name(dt));
  MOE_CHECK(moe_device_check(ctx, d));
  int64_t h = D / 2, n = T * h;
  double *c = (double *)malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
  double *s = (double *)malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
  if (!c || !s) {
    free(c);
    free(s);
    return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: no memory for %lld values", fn, (long long)n);
  }
  for (int64_t j = 0; j < h; j++) {
    double inv = pow(base, -2.0 * (double)j / (double)D);
    for (int64_t t = 0; t < T; t++) {
      c[t * h + j] = cos((double)t * inv);
      s[t * h + j] = sin((double)t * inv);
    }
  }
  moe_tensor *tc = NULL, *ts = NULL;
  int64_t shape[2] = {T, h};
  moe_status st = moe_tensor_from_f64(ctx, c, 2, shape, dt, d, &tc);
  if (st == MOE_OK) st = moe_tensor_from_f64(ctx, s, 2, shape, dt, d, &ts);
  free(c);
  free(s);
  if (st != MOE_OK) {
    moe_tensor_release(tc);
    return st;
  }
  *cos_out = tc;
  *sin_out = ts;
  return MOE_OK;
}

/* -------------------------------------------------------- multinomial */

#define IX_MN_CHUNKS 256

/* prefix[0..256] of the chunk sums of w (C weights, zeroed where taken). */
static void ix_mn_prefix(const double *part, double *prefix) {
  prefix[0] = 0;
  for (int t = 0; t < IX_MN_CHUNKS; t++) prefix[t + 1] = prefix[t] + part[t];
}

/* The draw for target: the first category whose running sum exceeds it;
 * when rounding leaves none, the last category of positive weight. */
static int64_t ix_mn_pick(const double *w, int64_t C, int64_t cs, const double *prefix,
                          double target) {
  for (int t = 0; t < IX_MN_CHUNKS; t++) {
    if (!(prefix[t + 1] > target)) continue;
    double acc = prefix[t];
    int64_t lo = (int64_t)t * cs, hi = lo + cs < C ? lo + cs : C;
    for (int64_t j = lo; j < hi; j++) {
      acc += w[j];
      if (acc > target) return j;
    }
    break;
  }
  for (int64_t j = C - 1; j >= 0; j--)
    if (w[j] > 0) return j;
  return 0;
}

static double ix_mn_chunk_sum(const double *w, int64_t C, int64_t cs, int t) {
  double acc = 0;
  int64_t lo = (int64_t)t * cs, hi = lo + cs < C ? lo + cs : C;
  for (int64_t j = lo; j < hi; j++) acc += w[j];
  return acc;
}

moe_status moe_multinomial(moe_ctx *ctx, moe_tensor *probs, int64_t num_samples,
                           bool replacement, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  const char *fn = "multinomial";
  char sp[IX_SHAPE];
  MOE_CHECK(ix_null(ctx, fn, "probs", probs));
  MOE_CHECK(ix_null(ctx, fn, "out", out));
  if (probs->dtype != MOE_F32 && probs->dtype != MOE_F64 && probs->dtype != MOE_BF16 &&
      probs->dtype != MOE_F16)
    return moe_error(ctx, MOE_ERR_DTYPE, "%s: probs must be f32, f64, bf16 or f16, got %s", fn,
                     moe_dtype_name(probs->dtype));
  if ((probs->ndim != 1 && probs->ndim != 2) || probs->shape[probs->ndim - 1] == 0)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: probs must be (N, C) or (C) with C >= 1, got %s", fn,
                     moe_shape_str(probs->ndim, probs->shape, sp, sizeof sp));
  int64_t C = probs->shape[probs->ndim - 1], N = probs->ndim == 2 ? probs->shape[0] : 1;
  if (num_samples < 0 || (!replacement && num_samples > C))
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "%s: num_samples = %lld must be in [0, %lld]%s", fn, (long long)num_samples,
                     (long long)(replacement ? INT64_MAX : C),
                     replacement ? "" : " without replacement (C categories)");
  MOE_CHECK(moe_device_check(ctx, probs->storage->device));
  int64_t oshape[2] = {N, num_samples};
  moe_tensor *r;
  MOE_CHECK(moe_tensor_empty(ctx, probs->ndim, probs->ndim == 2 ? oshape : oshape + 1, MOE_I64,
                             probs->storage->device, &r));
  uint64_t seed = ctx->rng_seed, call = ctx->rng_call;
  moe_status st = MOE_OK;
  if (N * num_samples > 0 && ix_cuda(probs)) {
#ifdef MOE_WITH_CUDA
    moe_kview vp = moe_kview_of(probs);
    if (vp.ndim == 1) { /* as (1, C) */
      vp.ndim = 2;
      vp.shape[1] = vp.shape[0], vp.stride[1] = vp.stride[0];
      vp.shape[0] = 1, vp.stride[0] = 0;
    }
    st = moe_cuda_multinomial(ctx, probs->storage->device.index, (int64_t *)moe_tensor_data(r), &vp,
                              num_samples, replacement, seed, call);
#else
    st = ix_not_built(ctx, fn);
#endif
  } else if (N * num_samples > 0) {
    double *w = (double *)malloc(sizeof(double) * (size_t)C);
    if (!w) st = moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: no memory for a row of %lld", fn, (long long)C);
    int64_t cs = (C + IX_MN_CHUNKS - 1) / IX_MN_CHUNKS;
    int64_t *po = (int64_t *)moe_tensor_data(r);
    const char *pp = (const char *)moe_tensor_data(probs);
    size_t es = moe_dtype_size(probs->dtype);
    int64_t rs = probs->ndim == 2 ? probs->stride[0] : 0, cst = probs->stride[probs->ndim - 1];
    double part[IX_MN_CHUNKS], prefix[IX_MN_CHUNKS + 1];
    for (int64_t row = 0; row < N && st == MOE_OK; row++) {
      int64_t nonzero = 0;
      for (int64_t j = 0; j < C; j++) {
        w[j] = moe_load_f64(pp + (row * rs + j * cst) * (int64_t)es, probs->dtype);
        if (!(w[j] >= 0) || isinf(w[j])) {
          st = moe_error(ctx, MOE_ERR_INVALID_ARG,
                         "%s: probs[%lld, %lld] = %g: weights must be finite and >= 0", fn,
                         (long long)row, (long long)j, w[j]);
          break;
        }
        nonzero += w[j] > 0;
      }
      if (st != MOE_OK) break;
      if (nonzero == 0 || (!replacement && nonzero < num_samples)) {
        st = moe_error(ctx, MOE_ERR_INVALID_ARG,
                       "%s: row %lld has %lld non-zero weights, fewer than %s", fn, (long long)row,
                       (long long)nonzero, nonzero == 0 ? "one" : "num_samples without replacement");
        break;
      }
      for (int t = 0; t < IX_MN_CHUNKS; t++) part[t] = ix_mn_chunk_sum(w, C, cs, t);
      ix_mn_prefix(part, prefix);
      for (int64_t s = 0; s < num_samples; s++) {
        double u = moe_philox_uniform53(seed, call, (uint64_t)(row * num_samples + s));
        int64_t j = ix_mn_pick(w, C, cs, prefix, u * prefix[IX_MN_CHUNKS]);
        po[row * num_samples + s] = j;
        if (!replacement) { /* j leaves the urn: its chunk is summed again */
          w[j] = 0;
          int t = (int)(j / cs);
          part[t] = ix_mn_chunk_sum(w, C, cs, t);
          ix_mn_prefix(part, prefix);
        }
      }
    }
    free(w);
  }
  if (st != MOE_OK) {
    moe_tensor_release(r);
    return st;
  }
  ctx->rng_call++;
  *out = r;
  return MOE_OK;
}
