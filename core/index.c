/*
 * index.c - the index family (moe_index.h): gather, scatter, scatter_add,
 * index_select, index_add, embedding, one_hot, bincount, sort, argsort, topk.
 * Each op validates, runs the CPU reference here or the CUDA entry point of
 * index_cuda.h, and records its autograd node (moe_autograd.h). Joining and
 * splitting live in join.c, rotary embedding in rope.c, multinomial in
 * multinomial.c; index_util.h holds what they share.
 *
 * Two engines carry most ops: gather (out[p] = x[p with dim replaced by
 * index[p]]) and scatter (target of p gets or adds src[p]). index_select is
 * gather with the 1-D index expanded to the output's shape, embedding is
 * index_select on dim 0; backward passes are the opposite engine. index_add
 * (and so the backward of index_select and embedding) has a third: the
 * windowed order of moe_index.h, here and in kernels/index.cu alike.
 *
 * Internal helper calls (views, copies) run with grad mode off; each op
 * records exactly one node of its own.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "index_cuda.h"
#include "index_util.h"
#include "internal.h"

/* ------------------------------------------------------------ helpers */

static moe_status ix_index_dtype(moe_ctx *ctx, const char *fn, const char *what,
                                 const moe_tensor *idx) {
  if (idx->dtype == MOE_I64 || idx->dtype == MOE_I32) return MOE_OK;
  return moe_error(ctx, MOE_ERR_DTYPE, "%s: %s must be i64 or i32, got %s", fn, what,
                   moe_dtype_name(idx->dtype));
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
    moe_kview vo = moe_kview_of(r), vx = moe_kview_of(x), vi = moe_kview_of(index);
    st = moe_cuda_gather(ctx, x->storage->device.index, fn, &vo, &vx, dim, &vi);
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
    moe_kview vo = moe_kview_of(out), vi = moe_kview_of(index), vs = moe_kview_of(src);
    memcpy(vs.shape, index->shape, sizeof vs.shape); /* the region index covers */
    return moe_cuda_scatter(ctx, out->storage->device.index, fn, mode, &vo, dim, &vi, &vs);
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
  MOE_CHECK(ix_index_dtype(ctx, fn, "index", index));
  MOE_CHECK(moe_check_same_device(ctx, fn, "x", x->storage->device, "index",
                                  index->storage->device));
  if (src) MOE_CHECK(moe_check_same_device(ctx, fn, "x", x->storage->device, "src",
                                           src->storage->device));
  if (x->ndim == 0)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: x must have at least one dim, got a scalar", fn);
  MOE_CHECK(moe_dim_normalize_fn(ctx, fn, dim, x->ndim, false, d_out));
  if (index->ndim != x->ndim || (src && src->ndim != x->ndim))
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: x %s, index %s%s%s must have the same number of dims",
                     fn, MOE_SHAPE(x),
                     MOE_SHAPE(index), src ? " and src " : "",
                     src ? MOE_SHAPE(src) : "");
  for (int d = 0; d < x->ndim; d++) {
    if ((d != *d_out && index->shape[d] > x->shape[d]) || (src && index->shape[d] > src->shape[d]))
      return moe_error(ctx, MOE_ERR_SHAPE,
                       "%s: index %s is larger than x %s%s%s in dim %d (dim = %d)", fn,
                       MOE_SHAPE(index),
                       MOE_SHAPE(x), src ? " or src " : "",
                       src ? MOE_SHAPE(src) : "", d, *d_out);
  }
  if (src) MOE_CHECK(moe_check_same_dtype(ctx, fn, "src", src->dtype, "x", x->dtype));
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
  moe_status st =
      moe_tensor_full(ctx, ndim, src_shape, 0.0, gout->dtype, gout->storage->device, &z);
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
  MOE_CHECK(moe_node_zeros_input(ctx, n, 0, &g));
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
  MOE_CHECK(moe_record(ctx, &(moe_record_spec){.op = MOE_OP_GATHER, .backward = gather_backward,
                                               .n_in = 1, .in = {x}, .n_save = 1, .save = {index},
                                               .iargs = {d}},
                       1, &r));
  *out = r;
  return MOE_OK;
}

/* ---------------------------------------------------- scatter, scatter_add */

/* inputs x, src; saved index; iargs dim, mode. */
static moe_status scatter_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                   moe_tensor **gin) {
  if (!gout[0]) return moe_node_zero_grads(ctx, n, gin); /* nothing flowed */
  int dim = (int)n->iargs[0];
  bool add = n->iargs[1] == MOE_SCATTER_ADD;
  moe_tensor *index = NULL, *gx = NULL, *gs = NULL, *zs = NULL;
  moe_status st = MOE_OK;
  MOE_CHECK_GOTO(moe_node_saved(ctx, n, 0, &index), st, done);
  if (moe_node_needs_grad(n, 0)) {
    if (add) { /* d out / d x is the identity */
      MOE_CHECK_GOTO(ix_copy_new(ctx, gout[0], &gx), st, done);
    } else { /* overwritten targets get no gradient */
      MOE_CHECK_GOTO(moe_tensor_full(ctx, index->ndim, index->shape, 0.0, gout[0]->dtype,
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
  MOE_CHECK(moe_record(ctx, &(moe_record_spec){
      .op = mode == MOE_SCATTER_ADD ? MOE_OP_SCATTER_ADD : MOE_OP_SCATTER,
      .backward = scatter_backward, .n_in = 2, .in = {x, src}, .n_save = 1, .save = {index},
      .iargs = {d, mode}}, 1, &r));
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
  MOE_CHECK(ix_index_dtype(ctx, fn, "index", index));
  MOE_CHECK(moe_check_same_device(ctx, fn, "x", x->storage->device, "index",
                                  index->storage->device));
  if (x->ndim == 0)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: x must have at least one dim, got a scalar", fn);
  MOE_CHECK(moe_dim_normalize_fn(ctx, fn, dim, x->ndim, false, d_out));
  if (index->ndim != 1)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: index must be 1-D, got %s", fn,
                     MOE_SHAPE(index));
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

/* index_add's sums, CPU (the order of moe_index.h, the same as CUDA's):
 * rows are added in the compute type of the dtype (f32 for f32, bf16 and
 * f16, f64 for f64, i64 wrapping for integers) and rounded once. */
typedef enum ix_acc { IX_ACC_F32, IX_ACC_F64, IX_ACC_I64 } ix_acc;

static ix_acc ix_acc_of(moe_dtype dt) {
  if (dt == MOE_F64) return IX_ACC_F64;
  return moe_dtype_is_float(dt) ? IX_ACC_F32 : IX_ACC_I64;
}

/* acc (inner, of the compute type) = the row at p (dtype dt). */
static void ix_row_load(ix_acc a, void *acc, const char *p, moe_dtype dt, int64_t inner) {
  size_t es = moe_dtype_size(dt);
  if ((a == IX_ACC_F32 && dt == MOE_F32) || a == IX_ACC_F64) {
    memcpy(acc, p, (size_t)inner * es);
  } else if (a == IX_ACC_F32) {
    float *f = (float *)acc;
    for (int64_t i = 0; i < inner; i++) f[i] = (float)moe_load_f64(p + i * (int64_t)es, dt);
  } else {
    int64_t *v = (int64_t *)acc;
    for (int64_t i = 0; i < inner; i++) v[i] = moe_load_i64(p + i * (int64_t)es, dt);
  }
}

/* acc += the row at p. */
static void ix_row_add(ix_acc a, void *acc, const char *p, moe_dtype dt, int64_t inner) {
  size_t es = moe_dtype_size(dt);
  if (a == IX_ACC_F32 && dt == MOE_F32) {
    float *f = (float *)acc;
    const float *s = (const float *)p;
    for (int64_t i = 0; i < inner; i++) f[i] += s[i];
  } else if (a == IX_ACC_F32) {
    float *f = (float *)acc;
    for (int64_t i = 0; i < inner; i++) f[i] += (float)moe_load_f64(p + i * (int64_t)es, dt);
  } else if (a == IX_ACC_F64) {
    double *f = (double *)acc;
    const double *s = (const double *)p;
    for (int64_t i = 0; i < inner; i++) f[i] += s[i];
  } else {
    int64_t *v = (int64_t *)acc;
    for (int64_t i = 0; i < inner; i++)
      v[i] = (int64_t)((uint64_t)v[i] + (uint64_t)moe_load_i64(p + i * (int64_t)es, dt));
  }
}

/* acc += part (both of the compute type). */
static void ix_acc_add(ix_acc a, void *acc, const void *part, int64_t inner) {
  if (a == IX_ACC_F32) {
    float *f = (float *)acc;
    const float *s = (const float *)part;
    for (int64_t i = 0; i < inner; i++) f[i] += s[i];
  } else if (a == IX_ACC_F64) {
    double *f = (double *)acc;
    const double *s = (const double *)part;
    for (int64_t i = 0; i < inner; i++) f[i] += s[i];
  } else {
    int64_t *v = (int64_t *)acc;
    const int64_t *s = (const int64_t *)part;
    for (int64_t i = 0; i < inner; i++) v[i] = (int64_t)((uint64_t)v[i] + (uint64_t)s[i]);
  }
}

/* The row at p (dtype dt) = acc, rounded once. */
static void ix_row_store(ix_acc a, char *p, moe_dtype dt, const void *acc, int64_t inner) {
  size_t es = moe_dtype_size(dt);
  if ((a == IX_ACC_F32 && dt == MOE_F32) || a == IX_ACC_F64) {
    memcpy(p, acc, (size_t)inner * es);
  } else if (a == IX_ACC_F32) {
    const float *f = (const float *)acc;
    for (int64_t i = 0; i < inner; i++) moe_store_f64(p + i * (int64_t)es, dt, f[i]);
  } else {
    const int64_t *v = (const int64_t *)acc;
    for (int64_t i = 0; i < inner; i++) moe_store_i64(p + i * (int64_t)es, dt, v[i]);
  }
}

/* CPU index_add: out contiguous (outer, X, inner) holding the base, src
 * contiguous (outer, n, inner), index (n) any stride. The positions i are
 * ordered by (index[i], i) with a counting sort (what CUDA's stable radix
 * sort of the keys gives), cut into windows of MOE_INDEX_ADD_WINDOW, and
 * each key's segment summed as moe_index.h says. */
static moe_status ix_index_add_cpu(moe_ctx *ctx, const char *fn, moe_tensor *out, int dim,
                                   const moe_tensor *index, const moe_tensor *src) {
  const int64_t P = MOE_INDEX_ADD_WINDOW;
  int64_t outer = 1, inner = 1, X = out->shape[dim], n = index->shape[0];
  for (int d = 0; d < dim; d++) outer *= out->shape[d];
  for (int d = dim + 1; d < out->ndim; d++) inner *= out->shape[d];
  if (n == 0 || outer == 0 || inner == 0) return MOE_OK;
  moe_dtype dt = out->dtype;
  ix_acc a = ix_acc_of(dt);
  int64_t es = (int64_t)moe_dtype_size(dt), is = (int64_t)moe_dtype_size(index->dtype);
  int64_t *key = (int64_t *)malloc(sizeof(int64_t) * (size_t)n);
  int64_t *pos = (int64_t *)malloc(sizeof(int64_t) * (size_t)n);
  int64_t *start = (int64_t *)calloc((size_t)X + 1, sizeof(int64_t));
  void *acc = malloc(sizeof(int64_t) * (size_t)inner), *part = malloc(sizeof(int64_t) * (size_t)inner);
  moe_status st = MOE_OK;
  if (!key || !pos || !start || !acc || !part) {
    st = moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: no memory to sort %lld indices", fn, (long long)n);
    goto done;
  }
  const char *pi = (const char *)moe_tensor_data(index);
  for (int64_t i = 0; i < n; i++) {
    int64_t v = moe_load_i64(pi + i * index->stride[0] * is, index->dtype);
    if (v < 0 || v >= X) { /* the callers checked; an index changed since (a saved one) */
      st = moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: index holds %lld at position %lld, outside [0, %lld)",
                     fn, (long long)v, (long long)i, (long long)X);
      goto done;
    }
    key[i] = v;
    start[v + 1]++;
  }
  for (int64_t k = 0; k < X; k++) start[k + 1] += start[k];
  for (int64_t i = 0; i < n; i++) pos[start[key[i]]++] = i; /* stable: i ascending per key */
  char *po = (char *)moe_tensor_data(out);
  const char *ps = (const char *)moe_tensor_data(src);
  for (int64_t o = 0; o < outer; o++) {
    const char *srow = ps + o * n * inner * es;
    for (int64_t j = 0; j < n;) {
      int64_t k = key[pos[j]], end = j + 1;
      while (end < n && key[pos[end]] == k) end++;
      char *orow = po + (o * X + k) * inner * es;
      /* the head: out's row, then the segment's entries in j's window */
      int64_t h = (j / P + 1) * P < end ? (j / P + 1) * P : end;
      ix_row_load(a, acc, orow, dt, inner);
      for (int64_t q = j; q < h; q++) ix_row_add(a, acc, srow + pos[q] * inner * es, dt, inner);
      /* each later window's part, summed from its first entry, then added */
      for (int64_t w = h; w < end; w += P) {
        int64_t we = w + P < end ? w + P : end;
        ix_row_load(a, part, srow + pos[w] * inner * es, dt, inner);
        for (int64_t q = w + 1; q < we; q++) ix_row_add(a, part, srow + pos[q] * inner * es, dt, inner);
        ix_acc_add(a, acc, part, inner);
      }
      ix_row_store(a, orow, dt, acc, inner);
      j = end;
    }
  }
done:
  free(key);
  free(pos);
  free(start);
  free(acc);
  free(part);
  return st;
}

/* out: contiguous, holding the base; out.select(dim, index[i]) += src.select(dim, i). */
static moe_status ix_index_add_into(moe_ctx *ctx, const char *fn, moe_tensor *out, int dim,
                                    moe_tensor *index, moe_tensor *src) {
  if (moe_tensor_numel(src) == 0) return MOE_OK;
  moe_tensor *sc = NULL;
  MOE_CHECK(moe_contiguous(ctx, src, &sc));
  moe_status st = MOE_OK;
  if (ix_cuda(out)) {
    moe_tensor *ic = NULL;
    int64_t outer = 1, inner = 1;
    for (int d = 0; d < dim; d++) outer *= out->shape[d];
    for (int d = dim + 1; d < out->ndim; d++) inner *= out->shape[d];
    st = moe_contiguous(ctx, index, &ic);
    if (st == MOE_OK)
      st = moe_cuda_index_add(ctx, out->storage->device.index, fn, moe_tensor_data(out),
                              moe_tensor_data(sc), out->dtype, moe_tensor_data(ic), ic->dtype,
                              outer, out->shape[dim], index->shape[0], inner);
    moe_tensor_release(ic);
  } else {
    st = ix_index_add_cpu(ctx, fn, out, dim, index, sc);
  }
  moe_tensor_release(sc);
  return st;
}

/* inputs x; saved index; iargs dim. */
static moe_status index_select_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                        moe_tensor **gin) {
  if (!moe_node_needs_grad(n, 0)) return MOE_OK;
  moe_tensor *index = NULL, *g = NULL;
  MOE_CHECK(moe_node_zeros_input(ctx, n, 0, &g));
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
  MOE_CHECK(moe_record(ctx, &(moe_record_spec){.op = MOE_OP_INDEX_SELECT,
                                               .backward = index_select_backward, .n_in = 1,
                                               .in = {x}, .n_save = 1, .save = {index},
                                               .iargs = {d}},
                       1, &r));
  *out = r;
  return MOE_OK;
}

/* inputs x, src; saved index; iargs dim. */
static moe_status index_add_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                     moe_tensor **gin) {
  if (!gout[0]) return moe_node_zero_grads(ctx, n, gin);
  moe_tensor *index = NULL, *gx = NULL, *gs = NULL;
  moe_status st = MOE_OK;
  int dim = (int)n->iargs[0];
  if (moe_node_needs_grad(n, 0)) st = ix_copy_new(ctx, gout[0], &gx);
  if (st == MOE_OK && moe_node_needs_grad(n, 1)) {
    st = moe_node_saved(ctx, n, 0, &index);
    if (st == MOE_OK)
      st = ix_index_select_run(ctx, "index_add backward", gout[0], dim, index, n->in_shape[1], &gs);
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
  MOE_CHECK(moe_check_same_device(ctx, fn, "x", x->storage->device, "src", src->storage->device));
  int d;
  int64_t shape[MOE_MAX_DIMS];
  MOE_CHECK(ix_select_check(ctx, fn, x, dim, index, &d, shape));
  bool ok = src->ndim == x->ndim;
  for (int k = 0; ok && k < x->ndim; k++) ok = src->shape[k] == shape[k];
  if (!ok)
    return moe_error(ctx, MOE_ERR_SHAPE,
                     "%s: src %s must have x's shape %s with dim %d of size %lld (index's length)",
                     fn, MOE_SHAPE(src),
                     MOE_SHAPE(x), d,
                     (long long)index->shape[0]);
  MOE_CHECK(moe_check_same_dtype(ctx, fn, "src", src->dtype, "x", x->dtype));
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
  MOE_CHECK(moe_record(ctx, &(moe_record_spec){.op = MOE_OP_INDEX_ADD,
                                               .backward = index_add_backward, .n_in = 2,
                                               .in = {x, src}, .n_save = 1, .save = {index},
                                               .iargs = {d}},
                       1, &r));
  *out = r;
  return MOE_OK;
}

/* ----------------------------------------------------------- embedding */

/* inputs weight; saved ids flattened (N). */
static moe_status embedding_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                     moe_tensor **gin) {
  if (!moe_node_needs_grad(n, 0)) return MOE_OK;
  moe_tensor *ids = NULL, *g = NULL, *g2 = NULL;
  MOE_CHECK(moe_node_zeros_input(ctx, n, 0, &g));
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
  MOE_CHECK(ix_null(ctx, fn, "weight", weight));
  MOE_CHECK(ix_null(ctx, fn, "ids", ids));
  MOE_CHECK(ix_null(ctx, fn, "out", out));
  MOE_CHECK(ix_index_dtype(ctx, fn, "ids", ids));
  MOE_CHECK(moe_check_same_device(ctx, fn, "weight", weight->storage->device, "ids",
                                  ids->storage->device));
  if (weight->ndim != 2)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: weight must be 2-D (V, D), got %s", fn,
                     MOE_SHAPE(weight));
  if (ids->ndim + 1 > MOE_MAX_DIMS)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: ids %s has too many dims (at most %d)", fn,
                     MOE_SHAPE(ids), MOE_MAX_DIMS - 1);
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
  if (st == MOE_OK)
    st = moe_record(ctx, &(moe_record_spec){.op = MOE_OP_EMBEDDING, .backward = embedding_backward,
                                            .n_in = 1, .in = {weight}, .n_save = 1,
                                            .save = {flat}},
                    1, &r);
  else
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
  MOE_CHECK(ix_null(ctx, fn, "ids", ids));
  MOE_CHECK(ix_null(ctx, fn, "out", out));
  MOE_CHECK(ix_index_dtype(ctx, fn, "ids", ids));
  if (ids->ndim + 1 > MOE_MAX_DIMS)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: ids %s has too many dims (at most %d)", fn,
                     MOE_SHAPE(ids), MOE_MAX_DIMS - 1);
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
    st = moe_tensor_values_i64(ctx, ids, host); /* CUDA: a synchronisation (num_classes -1) */
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
  if (st == MOE_OK)
    st = moe_tensor_full(ctx, ids->ndim + 1, oshape, 0.0, MOE_I64, ids->storage->device, &r);
  if (st == MOE_OK && m > 0 && num_classes > 0) {
    if (ix_cuda(ids)) {
      st = moe_reshape(ctx, ids, 1, (int64_t[]){m}, &flat);
      if (st == MOE_OK) {
        moe_tensor *fc = NULL;
        st = moe_contiguous(ctx, flat, &fc);
        if (st == MOE_OK)
          st = moe_cuda_one_hot(ctx, ids->storage->device.index, fn, (int64_t *)moe_tensor_data(r),
                                moe_tensor_data(fc), fc->dtype, m, num_classes);
        moe_tensor_release(fc);
      }
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

/* ------------------------------------------------------------ bincount */

moe_status moe_bincount(moe_ctx *ctx, moe_tensor *ids, int64_t E, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  const char *fn = "bincount";
  MOE_CHECK(ix_null(ctx, fn, "ids", ids));
  MOE_CHECK(ix_null(ctx, fn, "out", out));
  MOE_CHECK(ix_index_dtype(ctx, fn, "ids", ids));
  if (E < 0)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: the number of bins must be >= 0, got %lld", fn,
                     (long long)E);
  MOE_CHECK(moe_device_check(ctx, ids->storage->device));
  int64_t n = moe_tensor_numel(ids);
  moe_tensor *r = NULL, *flat = NULL, *fc = NULL;
  moe_status st;
  if (!ix_cuda(ids)) {
    st = moe_tensor_full(ctx, 1, (int64_t[]){E}, 0.0, MOE_I64, ids->storage->device, &r);
    if (st != MOE_OK) return st;
    int64_t *po = (int64_t *)moe_tensor_data(r), coord[MOE_MAX_DIMS] = {0};
    const char *p = (const char *)moe_tensor_data(ids);
    int64_t es = (int64_t)moe_dtype_size(ids->dtype);
    for (int64_t i = 0; i < n; i++) {
      int64_t v = moe_load_i64(p + ix_offset(ids->ndim, coord, ids->stride) * es, ids->dtype);
      if (v < 0 || v >= E) {
        moe_tensor_release(r);
        return moe_error(ctx, MOE_ERR_INVALID_ARG,
                         "%s: ids holds %lld at position %lld, outside [0, %lld)", fn,
                         (long long)v, (long long)i, (long long)E);
      }
      po[v]++;
      ix_next(ids->ndim, ids->shape, coord);
    }
    *out = r;
    return MOE_OK;
  }
  bool prev = moe_grad_set(ctx, false);
  st = moe_tensor_empty(ctx, 1, (int64_t[]){E}, MOE_I64, ids->storage->device, &r);
  if (st == MOE_OK) st = moe_reshape(ctx, ids, 1, (int64_t[]){n}, &flat);
  if (st == MOE_OK) st = moe_contiguous(ctx, flat, &fc);
  if (st == MOE_OK && E > 0)
    st = moe_cuda_bincount(ctx, ids->storage->device.index, fn, (int64_t *)moe_tensor_data(r),
                           moe_tensor_data(fc), fc->dtype, n, E);
  moe_grad_set(ctx, prev);
  moe_tensor_release(flat);
  moe_tensor_release(fc);
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
  st = moe_record(ctx, &(moe_record_spec){.op = op, .backward = gather_backward, .n_in = 1,
                                          .in = {x}, .n_save = 1, .save = {ix}, .iargs = {d}},
                  1, &v);
  if (st != MOE_OK) {
    moe_tensor_release(ix);
    return st;
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
  MOE_CHECK(ix_sort_check(ctx, "topk", x, dim, &d));
  MOE_CHECK(ix_null(ctx, "topk", "values", values));
  MOE_CHECK(ix_null(ctx, "topk", "indices", indices));
  if (k < 0 || k > x->shape[d])
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "topk: k = %lld is outside [0, %lld] for x %s and dim %d",
                     (long long)k, (long long)x->shape[d],
                     MOE_SHAPE(x), d);
  return ix_sort_op(ctx, "topk", MOE_OP_TOPK, x, d, largest, k, values, indices);
}
