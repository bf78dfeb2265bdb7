/*
 * copy.c - writing into tensors: copy_ (broadcast, dtype conversion, across
 * devices), to, clone, fill_, arange and linspace. Each validates, then runs
 * the CPU loop here or the CUDA entry point of internal.h
 * (kernels/copy.cu). A destination whose elements overlap (a stride-0 dim of
 * size > 1, as after expand) is refused by every writer: the checks that
 * every writer runs (also random.c's fills) are declared in copy_check.h.
 *
 * Autograd: to and clone (so contiguous and reshape's copy) record a COPY
 * node whose backward converts the gradient back to the input's dtype and
 * device; the in-place writers refuse, while grad mode is on, a tensor that
 * requires grad.
 */
#include <math.h>
#include <string.h>

#include "copy_check.h"
#include "cpu_loop.h"
#include "internal.h"

static moe_status check_tensor(moe_ctx *ctx, const char *fn, const moe_tensor *t,
                               const char *what) {
  if (t) return MOE_OK;
  return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: %s is NULL", fn, what);
}

moe_status moe_check_writable(moe_ctx *ctx, const char *fn, const moe_tensor *t) {
  for (int d = 0; d < t->ndim; d++)
    if (t->stride[d] == 0 && t->shape[d] > 1)
      return moe_error(ctx, MOE_ERR_INVALID_ARG,
                       "%s: cannot write into a tensor whose elements overlap (dim %d has size "
                       "%lld and stride 0, as after expand); clone it first",
                       fn, d, (long long)t->shape[d]);
  return MOE_OK;
}

moe_status moe_check_inplace(moe_ctx *ctx, const char *fn, const moe_tensor *t) {
  if (!moe_grad_enabled(ctx) || !moe_requires_grad(t)) return MOE_OK;
  if (moe_tensor_is_leaf(t))
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "%s: a leaf tensor that requires grad is being used in an in-place operation "
                     "(update it under no_grad, or write into a detached tensor)",
                     fn);
  return moe_error(ctx, MOE_ERR_INVALID_ARG,
                   "%s: in-place write into a tensor recorded in an autograd graph (output of %s) "
                   "is not supported; write into a clone, or under no_grad",
                   fn, moe_node_name(moe_tensor_grad_fn(t)));
}

/* Backward of to/clone/contiguous: the gradient goes back to the input's
 * dtype and device. */
static moe_status copy_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                moe_tensor **gin) {
  if (!moe_node_needs_grad(n, 0) || !gout[0]) return MOE_OK;
  return moe_to(ctx, gout[0], n->in_dtype[0], n->in_device[0], &gin[0]);
}

static bool same_shape(const moe_tensor *a, const moe_tensor *b) {
  if (a->ndim != b->ndim) return false;
  for (int d = 0; d < a->ndim; d++)
    if (a->shape[d] != b->shape[d]) return false;
  return true;
}

/* Whether the memory spans of a and b intersect (strides are >= 0). */
static bool tensors_overlap(const moe_tensor *a, const moe_tensor *b) {
  if (a->storage != b->storage || moe_tensor_numel(a) == 0 || moe_tensor_numel(b) == 0)
    return false;
  int64_t alo = a->offset, ahi = a->offset, blo = b->offset, bhi = b->offset;
  for (int d = 0; d < a->ndim; d++) ahi += (a->shape[d] - 1) * a->stride[d];
  for (int d = 0; d < b->ndim; d++) bhi += (b->shape[d] - 1) * b->stride[d];
  int64_t ea = (int64_t)moe_dtype_size(a->dtype), eb = (int64_t)moe_dtype_size(b->dtype);
  return alo * ea < (bhi + 1) * eb && blo * eb < (ahi + 1) * ea;
}

/* ------------------------------------------------------------ CPU loops */

static void cpu_copy(const moe_kview *dst, const moe_kview *src) {
  moe_loop l;
  moe_loop_init(&l, 2, (const moe_kview *[]){dst, src});
  int64_t ed = (int64_t)moe_dtype_size(dst->dtype), es = (int64_t)moe_dtype_size(src->dtype);
  bool same = dst->dtype == src->dtype;
  bool via_int = !moe_dtype_is_float(src->dtype); /* exact for int64 sources */
#pragma omp parallel for if (l.numel >= MOE_LOOP_PAR_MIN) schedule(static)
  for (int64_t k = 0; k < l.tasks; k++) {
    int64_t off[MOE_LOOP_MAX_OPS], first;
    int64_t n = moe_loop_task(&l, k, off, &first);
    char *d = (char *)dst->data + off[0] * ed;
    const char *s = (const char *)src->data + off[1] * es;
    int64_t sd = l.inner_stride[0] * ed, ss = l.inner_stride[1] * es;
    if (same && sd == ed && ss == es) {
      memcpy(d, s, (size_t)(n * ed));
    } else if (same) {
      for (int64_t j = 0; j < n; j++, d += sd, s += ss) memcpy(d, s, (size_t)ed);
    } else if (via_int) {
      for (int64_t j = 0; j < n; j++, d += sd, s += ss)
        moe_store_i64(d, dst->dtype, moe_load_i64(s, src->dtype));
    } else {
      for (int64_t j = 0; j < n; j++, d += sd, s += ss)
        moe_store_f64(d, dst->dtype, moe_load_f64(s, src->dtype));
    }
  }
}

static void cpu_fill(const moe_kview *dst, double value) {
  unsigned char pat[8];
  int64_t es = (int64_t)moe_dtype_size(dst->dtype);
  moe_store_f64(pat, dst->dtype, value);
  moe_loop l;
  moe_loop_init(&l, 1, (const moe_kview *[]){dst});
#pragma omp parallel for if (l.numel >= MOE_LOOP_PAR_MIN) schedule(static)
  for (int64_t k = 0; k < l.tasks; k++) {
    int64_t off = 0, first = 0;
    int64_t n = moe_loop_task(&l, k, &off, &first);
    char *d = (char *)dst->data + off * es;
    int64_t sd = l.inner_stride[0] * es;
    if (es == 4 && sd == 4) {
      uint32_t u;
      memcpy(&u, pat, 4);
      for (int64_t j = 0; j < n; j++) ((uint32_t *)d)[j] = u;
    } else {
      for (int64_t j = 0; j < n; j++, d += sd) memcpy(d, pat, (size_t)es);
    }
  }
}

/* element i = start + i * step in double */
static void cpu_arange(const moe_kview *dst, double start, double step) {
  int64_t es = (int64_t)moe_dtype_size(dst->dtype);
  moe_loop l;
  moe_loop_init(&l, 1, (const moe_kview *[]){dst});
  for (int64_t k = 0; k < l.tasks; k++) {
    int64_t off, first;
    int64_t n = moe_loop_task(&l, k, &off, &first);
    char *d = (char *)dst->data + off * es;
    for (int64_t j = 0; j < n; j++, d += l.inner_stride[0] * es)
      moe_store_f64(d, dst->dtype, start + (double)(first + j) * step);
  }
}

/* ------------------------------------------------------------------ copy_ */

/* dst = src across devices: src is made contiguous on its own device (and
 * converted there when that device is a GPU), crosses with one memcpy, then
 * lands in dst directly or through a same-device copy_. */
static moe_status copy_across(moe_ctx *ctx, moe_tensor *dst, const moe_tensor *src) {
  moe_device dd = dst->storage->device, sd = src->storage->device;
  moe_tensor *s1 = NULL, *tmp = NULL;
  moe_status st = MOE_OK;
  if (sd.type == MOE_DEVICE_CUDA && !(moe_tensor_is_contiguous(src) && src->dtype == dst->dtype)) {
    MOE_CHECK(moe_tensor_empty(ctx, src->ndim, src->shape, dst->dtype, sd, &s1));
    MOE_CHECK_GOTO(moe_copy_(ctx, s1, src), st, done);
  } else {
    MOE_CHECK(moe_contiguous(ctx, (moe_tensor *)src, &s1));
  }
  size_t nbytes = (size_t)moe_tensor_numel(s1) * moe_dtype_size(s1->dtype);
  if (s1->dtype == dst->dtype && same_shape(s1, dst) && moe_tensor_is_contiguous(dst)) {
    st = moe_cuda_memcpy(ctx, moe_tensor_data(dst), dd, moe_tensor_data(s1), sd, nbytes);
    goto done;
  }
  MOE_CHECK_GOTO(moe_tensor_empty(ctx, s1->ndim, s1->shape, s1->dtype, dd, &tmp), st, done);
  MOE_CHECK_GOTO(moe_cuda_memcpy(ctx, moe_tensor_data(tmp), dd, moe_tensor_data(s1), sd, nbytes),
                 st, done);
  st = moe_copy_(ctx, dst, tmp);
done:
  moe_tensor_release(tmp);
  moe_tensor_release(s1);
  return st;
}

moe_status moe_copy_(moe_ctx *ctx, moe_tensor *dst, const moe_tensor *src) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(check_tensor(ctx, "copy_", dst, "destination"));
  MOE_CHECK(check_tensor(ctx, "copy_", src, "source"));
  MOE_CHECK(moe_check_writable(ctx, "copy_", dst));
  MOE_CHECK(moe_check_inplace(ctx, "copy_", dst));
  bool fits = src->ndim <= dst->ndim;
  for (int d = 0; fits && d < src->ndim; d++) {
    int64_t have = src->shape[src->ndim - 1 - d], want = dst->shape[dst->ndim - 1 - d];
    fits = have == want || have == 1;
  }
  if (!fits) {
    return moe_error(ctx, MOE_ERR_SHAPE,
                     "copy_: source shape %s cannot be broadcast to destination shape %s",
                     MOE_SHAPE(src),
                     MOE_SHAPE(dst));
  }
  moe_device dd = dst->storage->device, sd = src->storage->device;
  MOE_CHECK(moe_device_check(ctx, dd));
  MOE_CHECK(moe_device_check(ctx, sd));
  if (moe_tensor_numel(dst) == 0) return MOE_OK;
  if (!moe_device_equal(dd, sd)) return copy_across(ctx, dst, src);
  if (tensors_overlap(dst, src)) { /* read everything before writing anything */
    moe_tensor *c;
    MOE_CHECK(moe_clone(ctx, src, &c));
    moe_status st = moe_copy_(ctx, dst, c);
    moe_tensor_release(c);
    return st;
  }
  moe_kview dv = moe_kview_of(dst), sv = moe_kview_broadcast(src, dst->ndim, dst->shape);
  if (dd.type == MOE_DEVICE_CUDA) return moe_cuda_copy(ctx, dd.index, &dv, &sv);
  cpu_copy(&dv, &sv);
  return MOE_OK;
}

/* out = a new copy of t of dtype dt on d, with its COPY node (to, clone). */
static moe_status copy_new(moe_ctx *ctx, const moe_tensor *t, moe_dtype dt, moe_device d,
                           moe_tensor **out) {
  moe_tensor *r;
  MOE_CHECK(moe_tensor_empty(ctx, t->ndim, t->shape, dt, d, &r));
  moe_status st = moe_copy_(ctx, r, t);
  if (st != MOE_OK) {
    moe_tensor_release(r);
    return st;
  }
  MOE_CHECK(moe_record(ctx, &(moe_record_spec){.op = MOE_OP_COPY, .backward = copy_backward,
                                               .n_in = 1, .in = {(moe_tensor *)t}},
                       1, &r));
  *out = r;
  return MOE_OK;
}

moe_status moe_to(moe_ctx *ctx, moe_tensor *t, moe_dtype dt, moe_device d, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(check_tensor(ctx, "to", t, "tensor"));
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "to: out is NULL");
  if ((int)dt < 0 || dt >= MOE_DTYPE_COUNT)
    return moe_error(ctx, MOE_ERR_DTYPE, "to: unknown dtype %d", (int)dt);
  MOE_CHECK(moe_device_check(ctx, d));
  if (t->dtype == dt && moe_device_equal(t->storage->device, d)) {
    moe_tensor_retain(t);
    *out = t;
    return MOE_OK;
  }
  return copy_new(ctx, t, dt, d, out);
}

moe_status moe_clone(moe_ctx *ctx, const moe_tensor *t, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(check_tensor(ctx, "clone", t, "tensor"));
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "clone: out is NULL");
  return copy_new(ctx, t, t->dtype, t->storage->device, out);
}

/* ------------------------------------------------------------ fills */

moe_status moe_fill_(moe_ctx *ctx, moe_tensor *t, double value) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(check_tensor(ctx, "fill_", t, "tensor"));
  MOE_CHECK(moe_check_writable(ctx, "fill_", t));
  MOE_CHECK(moe_check_inplace(ctx, "fill_", t));
  moe_device d = t->storage->device;
  MOE_CHECK(moe_device_check(ctx, d));
  if (moe_tensor_numel(t) == 0) return MOE_OK;
  moe_kview v = moe_kview_of(t);
  if (d.type == MOE_DEVICE_CUDA) return moe_cuda_fill(ctx, d.index, &v, value);
  cpu_fill(&v, value);
  return MOE_OK;
}

/* A new 1-d tensor of n elements, element i = start + i * step. */
static moe_status range_new(moe_ctx *ctx, int64_t n, double start, double step, moe_dtype dt,
                            moe_device d, moe_tensor **out) {
  moe_tensor *t;
  MOE_CHECK(moe_tensor_empty(ctx, 1, &n, dt, d, &t));
  moe_status st = MOE_OK;
  moe_kview v = moe_kview_of(t);
  if (n > 0 && d.type == MOE_DEVICE_CUDA)
    st = moe_cuda_arange(ctx, d.index, &v, start, step);
  else if (n > 0)
    cpu_arange(&v, start, step);
  if (st != MOE_OK) {
    moe_tensor_release(t);
    return st;
  }
  *out = t;
  return MOE_OK;
}

static moe_status range_args(moe_ctx *ctx, const char *fn, moe_dtype dt, moe_device d,
                             moe_tensor **out) {
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: out is NULL", fn);
  if ((int)dt < 0 || dt >= MOE_DTYPE_COUNT)
    return moe_error(ctx, MOE_ERR_DTYPE, "%s: unknown dtype %d", fn, (int)dt);
  if (dt == MOE_BOOL)
    return moe_error(ctx, MOE_ERR_DTYPE, "%s: a range of bool makes no sense; use a number dtype",
                     fn);
  return moe_device_check(ctx, d);
}

moe_status moe_arange(moe_ctx *ctx, double start, double end, double step, moe_dtype dt,
                      moe_device d, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(range_args(ctx, "arange", dt, d, out));
  if (!isfinite(start) || !isfinite(end) || !isfinite(step))
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "arange: start %g, end %g and step %g must be finite",
                     start, end, step);
  if (step == 0) return moe_error(ctx, MOE_ERR_INVALID_ARG, "arange: step must be nonzero");
  if ((step > 0 && end < start) || (step < 0 && end > start))
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "arange: step %g goes away from end %g starting at %g", step, end, start);
  double count = ceil((end - start) / step);
  if (!(count < 9.0e15))
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "arange: [%g, %g) by %g has too many elements (%g)",
                     start, end, step, count);
  return range_new(ctx, (int64_t)count, start, step, dt, d, out);
}

moe_status moe_linspace(moe_ctx *ctx, double start, double end, int64_t steps, moe_dtype dt,
                        moe_device d, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(range_args(ctx, "linspace", dt, d, out));
  if (!isfinite(start) || !isfinite(end))
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "linspace: start %g and end %g must be finite",
                     start, end);
  if (steps < 0)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "linspace: steps %lld is negative",
                     (long long)steps);
  double step = steps > 1 ? (end - start) / (double)(steps - 1) : 0.0;
  moe_tensor *t, *last = NULL;
  MOE_CHECK(range_new(ctx, steps, start, step, dt, d, &t));
  moe_status st = MOE_OK;
  if (steps > 1) { /* start + (steps - 1) * step can miss end by an ulp: pin it */
    MOE_CHECK_GOTO(moe_narrow(ctx, t, 0, steps - 1, 1, &last), st, fail);
    MOE_CHECK_GOTO(moe_fill_(ctx, last, end), st, fail);
    moe_tensor_release(last);
  }
  *out = t;
  return MOE_OK;
fail:
  moe_tensor_release(last);
  moe_tensor_release(t);
  return st;
}
