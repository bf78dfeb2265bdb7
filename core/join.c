/*
 * join.c - joining and splitting along a dim (moe_index.h): cat, stack,
 * split (by size or by sizes), chunk, and the piece counts of split and
 * chunk. cat and stack copy each input into its place of a new tensor
 * (device-independent: narrow/select views and moe_copy_) and record one node
 * whose backward hands each input its slice of the output gradient; a node
 * holds at most MOE_NODE_MAX_INPUTS inputs, so longer lists are joined in
 * groups first. split and chunk return narrow views (narrow's node).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "index_util.h"
#include "internal.h"

/* ------------------------------------------------------------- joining */

static moe_status join_check(moe_ctx *ctx, const char *fn, int n, moe_tensor *const *xs) {
  if (n < 1) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: needs at least one tensor, got %d", fn, n);
  MOE_CHECK(ix_null(ctx, fn, "the tensor list", xs));
  for (int i = 0; i < n; i++)
    if (!xs[i]) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: tensor %d is NULL", fn, i);
  for (int i = 1; i < n; i++) {
    char name[32];
    snprintf(name, sizeof name, "tensor %d", i);
    MOE_CHECK(moe_check_same_device(ctx, fn, name, xs[i]->storage->device, "tensor 0",
                                    xs[0]->storage->device));
    MOE_CHECK(moe_check_same_dtype(ctx, fn, name, xs[i]->dtype, "tensor 0", xs[0]->dtype));
    if (xs[i]->ndim != xs[0]->ndim)
      return moe_error(ctx, MOE_ERR_SHAPE, "%s: tensor %d %s and tensor 0 %s differ in dims", fn, i,
                       MOE_SHAPE(xs[i]),
                       MOE_SHAPE(xs[0]));
  }
  return moe_device_check(ctx, xs[0]->storage->device);
}

/* inputs xs; iargs dim. gin[i] = gout narrowed to input i's extent. */
static moe_status cat_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                               moe_tensor **gin) {
  if (!gout[0]) return moe_node_zero_grads(ctx, n, gin);
  int dim = (int)n->iargs[0];
  int64_t off = 0;
  moe_status st = MOE_OK;
  for (int i = 0; i < n->n_inputs && st == MOE_OK; i++) {
    int64_t len = n->in_shape[i][dim];
    if (moe_node_needs_grad(n, i)) {
      moe_tensor *v = NULL;
      st = moe_narrow(ctx, gout[0], dim, off, len, &v);
      if (st == MOE_OK) st = ix_copy_new(ctx, v, &gin[i]);
      moe_tensor_release(v);
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
  if (!gout[0]) return moe_node_zero_grads(ctx, n, gin);
  int dim = (int)n->iargs[0];
  moe_status st = MOE_OK;
  for (int i = 0; i < n->n_inputs && st == MOE_OK; i++) {
    if (!moe_node_needs_grad(n, i)) continue;
    moe_tensor *v = NULL;
    st = moe_select(ctx, gout[0], dim, i, &v);
    if (st == MOE_OK) st = ix_copy_new(ctx, v, &gin[i]);
    moe_tensor_release(v);
  }
  if (st != MOE_OK)
    for (int i = 0; i < n->n_inputs; i++) {
      moe_tensor_release(gin[i]);
      gin[i] = NULL;
    }
  return st;
}

/* Copies each input into its place of a new tensor; stack: select, cat: narrow. */
static moe_status join_run(moe_ctx *ctx, int n, moe_tensor *const *xs, int dim, bool stack,
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
  MOE_CHECK(join_check(ctx, fn, n, xs));
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
                         MOE_SHAPE(xs[i]),
                         MOE_SHAPE(xs[0]), d);
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
  MOE_CHECK(join_run(ctx, n, xs, d, false, xs[0]->ndim, shape, &r));
  if (grad) { /* n <= MOE_NODE_MAX_INPUTS here */
    moe_record_spec spec = {.op = MOE_OP_CAT, .backward = cat_backward, .n_in = n, .iargs = {d}};
    memcpy(spec.in, xs, sizeof(moe_tensor *) * (size_t)n);
    MOE_CHECK(moe_record(ctx, &spec, 1, &r));
  }
  *out = r;
  return MOE_OK;
}

moe_status moe_stack(moe_ctx *ctx, int n, moe_tensor *const *xs, int64_t dim, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  const char *fn = "stack";
  MOE_CHECK(join_check(ctx, fn, n, xs));
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
                         i, MOE_SHAPE(xs[i]),
                         MOE_SHAPE_OF(nd, xs[0]->shape));
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
  MOE_CHECK(join_run(ctx, n, xs, d, true, nd + 1, shape, &r));
  if (grad) { /* n <= MOE_NODE_MAX_INPUTS here */
    moe_record_spec spec = {.op = MOE_OP_STACK, .backward = stack_backward, .n_in = n, .iargs = {d}};
    memcpy(spec.in, xs, sizeof(moe_tensor *) * (size_t)n);
    MOE_CHECK(moe_record(ctx, &spec, 1, &r));
  }
  *out = r;
  return MOE_OK;
}

/* ------------------------------------------------------- split, chunk */

static moe_status split_check(moe_ctx *ctx, const char *fn, const moe_tensor *x, int64_t dim,
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
  MOE_CHECK(split_check(ctx, "split", x, dim, &d));
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
  MOE_CHECK(split_check(ctx, "chunk", x, dim, &d));
  MOE_CHECK(ix_null(ctx, "chunk", "count", count));
  if (chunks < 1)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "chunk: chunks must be >= 1, got %lld", (long long)chunks);
  int64_t S = x->shape[d], size = (S + chunks - 1) / chunks;
  return moe_split_count(ctx, x, size > 0 ? size : 1, d, count);
}

/* Narrow views of the given sizes. */
static moe_status split_views(moe_ctx *ctx, moe_tensor *x, int d, int n, const int64_t *sizes,
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
  MOE_CHECK(split_check(ctx, "split", x, dim, &d));
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
                     (long long)sum, MOE_SHAPE(x),
                     (long long)x->shape[d], d);
  return split_views(ctx, x, d, n, sizes, outs);
}

static moe_status split_even(moe_ctx *ctx, const char *fn, moe_tensor *x, int d, int64_t size,
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
  moe_status st = split_views(ctx, x, d, c, sizes, outs);
  free(sizes);
  if (st == MOE_OK) *n_out = c;
  return st;
}

moe_status moe_split(moe_ctx *ctx, moe_tensor *x, int64_t split_size, int64_t dim, int max_out,
                     moe_tensor **outs, int *n_out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  int d;
  MOE_CHECK(split_check(ctx, "split", x, dim, &d));
  return split_even(ctx, "split", x, d, split_size, max_out, outs, n_out);
}

moe_status moe_chunk(moe_ctx *ctx, moe_tensor *x, int64_t chunks, int64_t dim, int max_out,
                     moe_tensor **outs, int *n_out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  int d;
  MOE_CHECK(split_check(ctx, "chunk", x, dim, &d));
  if (chunks < 1)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "chunk: chunks must be >= 1, got %lld", (long long)chunks);
  int64_t S = x->shape[d], size = (S + chunks - 1) / chunks;
  return split_even(ctx, "chunk", x, d, size > 0 ? size : 1, max_out, outs, n_out);
}
