/*
 * tensor.c - storages and tensors: allocation (host storages here, device
 * storages through the CUDA allocator), refcounts, host statistics, tensors
 * from and to host doubles, and every view op (view, reshape, transpose,
 * permute, narrow, slice, select, expand, squeeze, unsqueeze, contiguous).
 * Views share their base's storage and never copy, except reshape's and
 * contiguous's fallback to a copy.
 */
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

#include "cpu_loop.h"
#include "internal.h"

#define MOE_HOST_ALIGN 64

/*
 * Host storages of at least MOE_HOST_MAP_MIN bytes are mapped from the
 * system (mmap) and given back when released (munmap), the smaller ones come
 * from malloc. glibc's malloc maps large blocks too, but after the first
 * such block is freed it raises its threshold to that block's size and serves
 * later ones from its heap, which it can rarely trim once a step's tensors of
 * many sizes interleave there: freeing a forward pass's intermediates as soon
 * as each module returns (moe.scope) then tripled the resident memory of a
 * CPU training run. Mapping our own large blocks keeps the resident memory
 * at what is allocated.
 */
#define MOE_HOST_MAP_MIN ((size_t)128 << 10)

static void *host_block_alloc(size_t block) {
  if (block < MOE_HOST_MAP_MIN) return aligned_alloc(MOE_HOST_ALIGN, block);
  void *p = mmap(NULL, block, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? NULL : p;
}

static void host_block_free(void *p, size_t block) {
  if (block < MOE_HOST_MAP_MIN)
    free(p);
  else
    munmap(p, block);
}

/* ----------------------------------------------------------------- storage */

/* s->data: a fresh block of s->nbytes on s's device (none for 0 bytes); on
 * the host counted in the context's statistics. fn names the caller. */
static moe_status data_alloc(moe_ctx *ctx, const char *fn, moe_storage *s) {
  size_t nbytes = s->nbytes;
  if (s->device.type == MOE_DEVICE_CUDA)
    return nbytes > 0 ? moe_cuda_alloc(ctx, s->device.index, nbytes, &s->data, &s->block) : MOE_OK;
  moe_memory_stats *m = &ctx->cpu_stats;
  if (nbytes > 0) {
    if (nbytes > (size_t)INT64_MAX - MOE_HOST_ALIGN)
      return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY,
                       "%s: %zu bytes is more than a host allocation can hold", fn, nbytes);
    size_t block = (nbytes + MOE_HOST_ALIGN - 1) / MOE_HOST_ALIGN * MOE_HOST_ALIGN;
    void *d = host_block_alloc(block);
    if (!d)
      return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: out of host memory allocating %zu bytes", fn,
                       nbytes);
    s->data = d;
    s->block = block;
    m->system_allocs++;
  }
  m->allocated += (int64_t)nbytes;
  m->reserved = m->allocated;
  if (m->allocated > m->peak_allocated) m->peak_allocated = m->allocated;
  if (m->reserved > m->peak_reserved) m->peak_reserved = m->reserved;
  m->alloc_count++;
  return MOE_OK;
}

moe_status moe_storage_new(moe_ctx *ctx, moe_device d, size_t nbytes, moe_storage **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "storage_new: out is NULL");
  MOE_CHECK(moe_device_check(ctx, d));
  moe_storage *s = calloc(1, sizeof(*s));
  if (!s) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "storage_new: out of host memory");
  s->refcount = 1;
  s->device = d;
  s->nbytes = nbytes;
  s->ctx = ctx;
  moe_status st = data_alloc(ctx, "storage_new", s);
  if (st != MOE_OK) {
    free(s);
    return st;
  }
  if (d.type != MOE_DEVICE_CUDA) ctx->cpu_stats.live_storages++;
  *out = s;
  return MOE_OK;
}

void moe_storage_retain(moe_storage *s) {
  if (s) s->refcount++;
}

void moe_storage_release(moe_storage *s) {
  if (!s) return;
  MOE_ASSERT(s->refcount > 0);
  if (--s->refcount > 0) return;
  if (s->device.type == MOE_DEVICE_CUDA) {
    if (s->data) moe_cuda_release(s->ctx, s->device.index, s->data, s->block);
  } else {
    moe_memory_stats *m = &s->ctx->cpu_stats;
    if (s->data) {
      host_block_free(s->data, s->block);
      m->system_frees++;
    }
    if (!s->data_freed) m->allocated -= (int64_t)s->nbytes;
    m->reserved = m->allocated;
    m->free_count++;
    m->live_storages--;
  }
  free(s);
}

moe_status moe_storage_free_data(moe_ctx *ctx, moe_storage *s) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!s) return moe_error(ctx, MOE_ERR_INVALID_ARG, "storage_free_data: storage is NULL");
  s->not_ready = true;
  if (s->data_freed) return MOE_OK;
  if (s->device.type == MOE_DEVICE_CUDA) {
    if (s->data) moe_cuda_release(s->ctx, s->device.index, s->data, s->block);
  } else {
    moe_memory_stats *m = &s->ctx->cpu_stats;
    if (s->data) {
      host_block_free(s->data, s->block);
      m->system_frees++;
    }
    m->allocated -= (int64_t)s->nbytes;
    m->reserved = m->allocated;
    m->free_count++;
  }
  s->data = NULL;
  s->block = 0;
  s->data_freed = true;
  return MOE_OK;
}

moe_status moe_storage_alloc_data(moe_ctx *ctx, moe_storage *s) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!s) return moe_error(ctx, MOE_ERR_INVALID_ARG, "storage_alloc_data: storage is NULL");
  if (!s->data_freed) return MOE_OK;
  MOE_CHECK(data_alloc(ctx, "storage_alloc_data", s));
  s->data_freed = false;
  return MOE_OK;
}

moe_status moe_storage_ready(moe_ctx *ctx, moe_storage *s, const char *fn) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!s || !s->not_ready) return MOE_OK;
  if (!s->materialize)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "%s: the tensor's data were released (a sharded parameter outside its "
                     "gather) and nothing can gather them",
                     fn ? fn : "storage_ready");
  MOE_CHECK(s->materialize(ctx, s->materialize_ud));
  if (s->not_ready)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: gathering the released tensor's data failed",
                     fn ? fn : "storage_ready");
  return MOE_OK;
}

/* ------------------------------------------------------------------ helpers */

const char *moe_shape_str(int ndim, const int64_t *shape, char *buf, size_t len) {
  if (!buf || len == 0) return "";
  size_t n = (size_t)snprintf(buf, len, "[");
  for (int d = 0; d < ndim && n < len; d++)
    n += (size_t)snprintf(buf + n, len - n, d ? ", %lld" : "%lld", (long long)shape[d]);
  if (n < len) snprintf(buf + n, len - n, "]");
  return buf;
}

moe_status moe_check_same_device(moe_ctx *ctx, const char *fn, const char *an, moe_device ad,
                                 const char *bn, moe_device bd) {
  if (moe_device_equal(ad, bd)) return MOE_OK;
  return moe_error(ctx, MOE_ERR_DEVICE, "%s: %s is on %s but %s is on %s", fn, an, MOE_DEVICE(ad),
                   bn, MOE_DEVICE(bd));
}

moe_status moe_check_same_dtype(moe_ctx *ctx, const char *fn, const char *an, moe_dtype adt,
                                const char *bn, moe_dtype bdt) {
  if (adt == bdt) return MOE_OK;
  return moe_error(ctx, MOE_ERR_DTYPE, "%s: %s is %s but %s is %s", fn, an, moe_dtype_name(adt), bn,
                   moe_dtype_name(bdt));
}

static moe_status check_arg(moe_ctx *ctx, const char *fn, const void *p, const char *what) {
  if (p) return MOE_OK;
  return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: %s is NULL", fn, what);
}

static moe_status check_ndim(moe_ctx *ctx, const char *fn, int ndim, const int64_t *shape) {
  if (ndim < 0) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: ndim %d is negative", fn, ndim);
  if (ndim > MOE_MAX_DIMS)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: ndim %d exceeds the maximum of %d", fn, ndim,
                     MOE_MAX_DIMS);
  if (ndim > 0 && !shape) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: shape is NULL", fn);
  return MOE_OK;
}

/* Normalises dim with fn's name in the message (fn NULL: no prefix). */
static moe_status dim_normalize(moe_ctx *ctx, const char *fn, int64_t dim, int ndim,
                                bool for_insert, int *out) {
  int64_t n = ndim + (for_insert ? 1 : 0);
  if (n == 0)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s%sdim %lld given for a tensor with no dims",
                     fn ? fn : "", fn ? ": " : "", (long long)dim);
  if (dim < -n || dim >= n)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "%s%sdim %lld is out of range for a tensor of %d dim%s (expected %lld to %lld)",
                     fn ? fn : "", fn ? ": " : "", (long long)dim, ndim, ndim == 1 ? "" : "s",
                     (long long)-n, (long long)(n - 1));
  *out = (int)(dim < 0 ? dim + n : dim);
  return MOE_OK;
}

moe_status moe_dim_normalize_fn(moe_ctx *ctx, const char *fn, int64_t dim, int ndim,
                                bool for_insert, int *out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(check_arg(ctx, fn, out, "out"));
  if (ndim < 0 || ndim > MOE_MAX_DIMS)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: ndim %d is not in [0, %d]", fn, ndim,
                     MOE_MAX_DIMS);
  return dim_normalize(ctx, fn, dim, ndim, for_insert, out);
}

moe_status moe_dim_normalize(moe_ctx *ctx, int64_t dim, int ndim, bool for_insert, int *out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(check_arg(ctx, "dim_normalize", out, "out"));
  if (ndim < 0 || ndim > MOE_MAX_DIMS)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "dim_normalize: ndim %d is not in [0, %d]", ndim,
                     MOE_MAX_DIMS);
  return dim_normalize(ctx, NULL, dim, ndim, for_insert, out);
}

int64_t moe_tensor_numel(const moe_tensor *t) {
  if (!t) return 0;
  int64_t n = 1;
  for (int d = 0; d < t->ndim; d++) n *= t->shape[d];
  return n;
}

/* Row-major strides. A tensor with elements has a product of sizes that fits
 * (numel is checked); an empty one may have other sizes whose product does
 * not, and its strides address nothing: they saturate instead of overflowing. */
static void contiguous_strides(int ndim, const int64_t *shape, int64_t *stride) {
  int64_t s = 1;
  for (int d = ndim - 1; d >= 0; d--) {
    stride[d] = s;
    if (__builtin_mul_overflow(s, shape[d] > 1 ? shape[d] : 1, &s)) s = INT64_MAX;
  }
}

bool moe_tensor_is_contiguous(const moe_tensor *t) {
  if (!t) return false;
  int64_t expect = 1;
  for (int d = t->ndim - 1; d >= 0; d--) {
    if (t->shape[d] == 0) return true;
    if (t->shape[d] == 1) continue;
    if (t->stride[d] != expect) return false;
    expect *= t->shape[d];
  }
  return true;
}

moe_device moe_tensor_device(const moe_tensor *t) { return t ? t->storage->device : MOE_CPU; }

void *moe_tensor_data(const moe_tensor *t) {
  if (!t || !t->storage->data) return NULL;
  return (char *)t->storage->data + t->offset * (int64_t)moe_dtype_size(t->dtype);
}

moe_kview moe_kview_of(const moe_tensor *t) {
  moe_kview v;
  memset(&v, 0, sizeof(v));
  v.data = moe_tensor_data(t);
  v.dtype = t->dtype;
  v.ndim = t->ndim;
  for (int d = 0; d < t->ndim; d++) {
    v.shape[d] = t->shape[d];
    v.stride[d] = t->stride[d];
  }
  return v;
}

/* --------------------------------------------------------------- lifecycle */

void moe_tensor_retain(moe_tensor *t) {
  if (t) t->refcount++;
}

void moe_tensor_release(moe_tensor *t) {
  if (!t) return;
  MOE_ASSERT(t->refcount > 0);
  if (--t->refcount > 0) return;
  moe_autograd_meta_free(t);
  moe_storage_release(t->storage);
  free(t);
}

/* A tensor header over s (retained) with the given layout. */
static moe_status tensor_wrap(moe_ctx *ctx, const char *fn, moe_storage *s, moe_dtype dt, int ndim,
                              const int64_t *shape, const int64_t *stride, int64_t offset,
                              moe_tensor **out) {
  moe_tensor *t = calloc(1, sizeof(*t));
  if (!t) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
  t->refcount = 1;
  t->storage = s;
  moe_storage_retain(s);
  t->dtype = dt;
  t->ndim = ndim;
  for (int d = 0; d < ndim; d++) {
    t->shape[d] = shape[d];
    t->stride[d] = stride[d];
  }
  t->offset = offset;
  t->autograd = NULL;
  *out = t;
  return MOE_OK;
}

static moe_status tensor_empty(moe_ctx *ctx, const char *fn, int ndim, const int64_t *shape,
                               moe_dtype dt, moe_device d, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(check_arg(ctx, fn, out, "out"));
  MOE_CHECK(check_ndim(ctx, fn, ndim, shape));
  if ((int)dt < 0 || dt >= MOE_DTYPE_COUNT)
    return moe_error(ctx, MOE_ERR_DTYPE, "%s: unknown dtype %d", fn, (int)dt);
  int64_t numel = 1;
  for (int i = 0; i < ndim; i++)
    if (shape[i] < 0)
      return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: dim %d has negative size %lld", fn, i,
                       (long long)shape[i]);
  for (int i = 0; i < ndim; i++)
    if (__builtin_mul_overflow(numel, shape[i], &numel))
      return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: shape %s has more than 2^63 elements", fn,
                       MOE_SHAPE_OF(ndim, shape));
  int64_t nbytes;
  if (__builtin_mul_overflow(numel, (int64_t)moe_dtype_size(dt), &nbytes))
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: shape %s of %s needs more than 2^63 bytes",
                     fn, MOE_SHAPE_OF(ndim, shape), moe_dtype_name(dt));
  int64_t stride[MOE_MAX_DIMS];
  contiguous_strides(ndim, shape, stride);
  moe_storage *s;
  MOE_CHECK(moe_storage_new(ctx, d, (size_t)nbytes, &s));
  moe_status st = tensor_wrap(ctx, fn, s, dt, ndim, shape, stride, 0, out);
  moe_storage_release(s); /* the tensor holds it now, or nobody does */
  return st;
}

moe_status moe_tensor_empty(moe_ctx *ctx, int ndim, const int64_t *shape, moe_dtype dt,
                            moe_device d, moe_tensor **out) {
  return tensor_empty(ctx, "empty", ndim, shape, dt, d, out);
}

moe_status moe_tensor_full(moe_ctx *ctx, int ndim, const int64_t *shape, double value,
                           moe_dtype dt, moe_device d, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(check_arg(ctx, "full", out, "out"));
  moe_tensor *t;
  MOE_CHECK(tensor_empty(ctx, "full", ndim, shape, dt, d, &t));
  moe_status st = moe_fill_(ctx, t, value);
  if (st != MOE_OK) {
    moe_tensor_release(t);
    return st;
  }
  *out = t;
  return MOE_OK;
}

moe_status moe_tensor_from_f64(moe_ctx *ctx, const double *values, int ndim,
                               const int64_t *shape, moe_dtype dt, moe_device d,
                               moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(check_arg(ctx, "from_f64", out, "out"));
  MOE_CHECK(moe_device_check(ctx, d));
  moe_tensor *h, *t;
  MOE_CHECK(tensor_empty(ctx, "from_f64", ndim, shape, dt, MOE_CPU, &h));
  int64_t n = moe_tensor_numel(h);
  if (n > 0 && !values) {
    moe_tensor_release(h);
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "from_f64: values is NULL");
  }
  char *p = moe_tensor_data(h);
  size_t es = moe_dtype_size(dt);
  for (int64_t i = 0; i < n; i++) moe_store_f64(p + i * (int64_t)es, dt, values[i]);
  if (d.type == MOE_DEVICE_CPU) {
    *out = h;
    return MOE_OK;
  }
  moe_status st = moe_to(ctx, h, dt, d, &t);
  moe_tensor_release(h);
  if (st == MOE_OK) *out = t;
  return st;
}

/* Reads t in row-major order into vf (as doubles) or vi (as int64s). */
static moe_status tensor_read(moe_ctx *ctx, const char *fn, const moe_tensor *t, double *vf,
                              int64_t *vi, bool count) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(check_arg(ctx, fn, t, "tensor"));
  if (moe_tensor_numel(t) == 0) return MOE_OK;
  if (!vf && !vi) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: values is NULL", fn);
  moe_tensor *h = (moe_tensor *)t; /* only retained and released */
  if (t->storage->device.type != MOE_DEVICE_CPU) {
    MOE_CHECK(moe_to(ctx, h, t->dtype, MOE_CPU, &h)); /* counted by the copy */
  } else {
    moe_tensor_retain(h);
    if (count) moe_host_read_note(ctx); /* what the copy of a GPU tensor would cost */
  }
  moe_kview v = moe_kview_of(h);
  moe_loop l;
  moe_loop_init(&l, 1, (const moe_kview *[]){&v});
  int64_t es = (int64_t)moe_dtype_size(v.dtype), step = l.inner_stride[0] * es;
  for (int64_t k = 0; k < l.tasks; k++) {
    int64_t off, first;
    int64_t m = moe_loop_task(&l, k, &off, &first);
    const char *p = (const char *)v.data + off * es;
    for (int64_t j = 0; j < m; j++, p += step) {
      if (vf)
        vf[first + j] = moe_load_f64(p, v.dtype);
      else
        vi[first + j] = moe_load_i64(p, v.dtype);
    }
  }
  moe_tensor_release(h);
  return MOE_OK;
}

moe_status moe_tensor_to_f64(moe_ctx *ctx, const moe_tensor *t, double *values) {
  return tensor_read(ctx, "to_f64", t, values, NULL, true);
}

moe_status moe_tensor_to_i64(moe_ctx *ctx, const moe_tensor *t, int64_t *values) {
  return tensor_read(ctx, "to_i64", t, NULL, values, true);
}

moe_status moe_tensor_values_f64(moe_ctx *ctx, const moe_tensor *t, double *values) {
  return tensor_read(ctx, "to_f64", t, values, NULL, false);
}

moe_status moe_tensor_values_i64(moe_ctx *ctx, const moe_tensor *t, int64_t *values) {
  return tensor_read(ctx, "to_i64", t, NULL, values, false);
}

/* ------------------------------------------------------------------- views */

static moe_status view_args(moe_ctx *ctx, const char *fn, const moe_tensor *t, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(check_arg(ctx, fn, t, "tensor"));
  return check_arg(ctx, fn, out, "out");
}

/* ---------------------------------------------------- views' backward */
/* What a view op records for autograd: its op and the plain arguments its
 * backward needs (in node->iargs). */
typedef struct view_grad {
  moe_op op;
  int nargs;
  int64_t args[MOE_MAX_DIMS];
} view_grad;

/* A zero tensor of input 0's shape, dtype and device, with g copied into the
 * part the view selected (narrow, slice, select). */
static moe_status view_scatter_back(moe_ctx *ctx, moe_node *n, moe_tensor *g, moe_tensor **out) {
  moe_tensor *z, *v = NULL;
  MOE_CHECK(moe_tensor_full(ctx, n->in_ndim[0], n->in_shape[0], 0.0, n->in_dtype[0],
                            n->in_device[0], &z));
  const int64_t *a = n->iargs;
  moe_status st;
  if (n->op == MOE_OP_NARROW)
    st = moe_narrow(ctx, z, a[0], a[1], a[2], &v);
  else if (n->op == MOE_OP_SLICE)
    st = moe_slice(ctx, z, a[0], a[1], a[2], a[3], &v);
  else
    st = moe_select(ctx, z, a[0], a[1], &v);
  if (st == MOE_OK) st = moe_copy_(ctx, v, g);
  moe_tensor_release(v);
  if (st != MOE_OK) {
    moe_tensor_release(z);
    return st;
  }
  *out = z;
  return MOE_OK;
}

/* The gradient of a view's input from the gradient of the view. */
static moe_status view_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                moe_tensor **gin) {
  moe_tensor *g = gout[0];
  if (!moe_node_needs_grad(n, 0) || !g) return MOE_OK;
  const int64_t *a = n->iargs;
  switch (n->op) {
    case MOE_OP_VIEW:
    case MOE_OP_SQUEEZE:
    case MOE_OP_UNSQUEEZE:
      return moe_reshape(ctx, g, n->in_ndim[0], n->in_shape[0], &gin[0]);
    case MOE_OP_TRANSPOSE:
      return moe_transpose(ctx, g, a[0], a[1], &gin[0]);
    case MOE_OP_PERMUTE: /* iargs hold the inverse permutation */
      return moe_permute(ctx, g, n->in_ndim[0], a, &gin[0]);
    case MOE_OP_EXPAND:
      return moe_sum_to_shape(ctx, g, n->in_ndim[0], n->in_shape[0], &gin[0]);
    case MOE_OP_NARROW:
    case MOE_OP_SLICE:
    case MOE_OP_SELECT:
      return view_scatter_back(ctx, n, g, &gin[0]);
    default:
      return moe_error(ctx, MOE_ERR_INTERNAL, "view backward: unexpected op %s",
                       moe_op_name(n->op));
  }
}

/* A view of t; records vg's node when t needs grad (vg NULL: never). */
static moe_status view_new(moe_ctx *ctx, const char *fn, moe_tensor *t, int ndim,
                           const int64_t *shape, const int64_t *stride, int64_t offset,
                           const view_grad *vg, moe_tensor **out) {
  moe_tensor *r = NULL;
  MOE_CHECK(tensor_wrap(ctx, fn, t->storage, t->dtype, ndim, shape, stride, offset, &r));
  if (vg) {
    moe_record_spec spec = {.op = vg->op, .backward = view_backward, .n_in = 1, .in = {t}};
    for (int i = 0; i < vg->nargs; i++) spec.iargs[i] = vg->args[i];
    MOE_CHECK(moe_record(ctx, &spec, 1, &r));
  }
  *out = r;
  return MOE_OK;
}

/* Resolves one -1 in shape against numel into res. */
static moe_status infer_shape(moe_ctx *ctx, const char *fn, int64_t numel, int ndim,
                              const int64_t *shape, int64_t *res) {
  MOE_CHECK(check_ndim(ctx, fn, ndim, shape));
  int infer = -1;
  int64_t known = 1;
  for (int d = 0; d < ndim; d++) {
    res[d] = shape[d];
    if (shape[d] == -1) {
      if (infer >= 0)
        return moe_error(ctx, MOE_ERR_SHAPE, "%s: shape %s has more than one -1", fn,
                         MOE_SHAPE_OF(ndim, shape));
      infer = d;
    } else if (shape[d] < 0) {
      return moe_error(ctx, MOE_ERR_SHAPE, "%s: dim %d has negative size %lld", fn, d,
                       (long long)shape[d]);
    } else if (__builtin_mul_overflow(known, shape[d], &known)) {
      return moe_error(ctx, MOE_ERR_SHAPE, "%s: shape %s is invalid for a tensor of %lld elements",
                       fn, MOE_SHAPE_OF(ndim, shape), (long long)numel);
    }
  }
  if (infer >= 0) {
    if (known == 0)
      return moe_error(ctx, MOE_ERR_SHAPE,
                       "%s: shape %s is ambiguous: the -1 could be any size for %lld elements", fn,
                       MOE_SHAPE_OF(ndim, shape), (long long)numel);
    if (numel % known == 0) {
      res[infer] = numel / known;
      return MOE_OK;
    }
  } else if (known == numel) {
    return MOE_OK;
  }
  return moe_error(ctx, MOE_ERR_SHAPE, "%s: shape %s is invalid for a tensor of %lld elements", fn,
                   MOE_SHAPE_OF(ndim, shape), (long long)numel);
}

/* Strides for viewing t as shape without a copy (PyTorch's computeStride):
 * each run of dims of t that is contiguous in memory may be split or merged
 * freely; false when the new dims straddle two runs. */
static bool view_strides(const moe_tensor *t, int ndim, const int64_t *shape, int64_t *stride) {
  if (moe_tensor_numel(t) == 0 || t->ndim == 0) {
    contiguous_strides(ndim, shape, stride);
    return true;
  }
  int vd = ndim - 1;
  int64_t base = t->stride[t->ndim - 1], tnumel = 1, vnumel = 1;
  for (int td = t->ndim - 1; td >= 0; td--) {
    tnumel *= t->shape[td];
    if (td == 0 || (t->shape[td - 1] != 1 && t->stride[td - 1] != tnumel * base)) {
      while (vd >= 0 && (vnumel < tnumel || shape[vd] == 1)) {
        stride[vd] = vnumel * base;
        vnumel *= shape[vd];
        vd--;
      }
      if (vnumel != tnumel) return false;
      if (td > 0) {
        base = t->stride[td - 1];
        tnumel = vnumel = 1;
      }
    }
  }
  return vd == -1;
}

moe_status moe_view(moe_ctx *ctx, moe_tensor *t, int ndim, const int64_t *shape, moe_tensor **out) {
  MOE_CHECK(view_args(ctx, "view", t, out));
  int64_t res[MOE_MAX_DIMS], stride[MOE_MAX_DIMS];
  MOE_CHECK(infer_shape(ctx, "view", moe_tensor_numel(t), ndim, shape, res));
  if (!view_strides(t, ndim, res, stride)) {
    return moe_error(ctx, MOE_ERR_SHAPE,
                     "view: shape %s cannot view a tensor of shape %s and strides %s without a "
                     "copy (use reshape, or contiguous first)",
                     MOE_SHAPE_OF(ndim, res),
                     MOE_SHAPE(t),
                     MOE_SHAPE_OF(t->ndim, t->stride));
  }
  return view_new(ctx, "view", t, ndim, res, stride, t->offset, &(view_grad){MOE_OP_VIEW, 0, {0}},
                  out);
}

moe_status moe_reshape(moe_ctx *ctx, moe_tensor *t, int ndim, const int64_t *shape,
                       moe_tensor **out) {
  MOE_CHECK(view_args(ctx, "reshape", t, out));
  int64_t res[MOE_MAX_DIMS], stride[MOE_MAX_DIMS];
  MOE_CHECK(infer_shape(ctx, "reshape", moe_tensor_numel(t), ndim, shape, res));
  if (view_strides(t, ndim, res, stride))
    return view_new(ctx, "reshape", t, ndim, res, stride, t->offset,
                    &(view_grad){MOE_OP_VIEW, 0, {0}}, out);
  moe_tensor *c;
  MOE_CHECK(moe_clone(ctx, t, &c));
  contiguous_strides(ndim, res, stride);
  moe_status st = view_new(ctx, "reshape", c, ndim, res, stride, c->offset,
                           &(view_grad){MOE_OP_VIEW, 0, {0}}, out);
  moe_tensor_release(c);
  return st;
}

moe_status moe_transpose(moe_ctx *ctx, moe_tensor *t, int64_t dim0, int64_t dim1,
                         moe_tensor **out) {
  MOE_CHECK(view_args(ctx, "transpose", t, out));
  int d0 = 0, d1 = 0;
  MOE_CHECK(dim_normalize(ctx, "transpose", dim0, t->ndim, false, &d0));
  MOE_CHECK(dim_normalize(ctx, "transpose", dim1, t->ndim, false, &d1));
  int64_t shape[MOE_MAX_DIMS], stride[MOE_MAX_DIMS];
  memcpy(shape, t->shape, sizeof(shape));
  memcpy(stride, t->stride, sizeof(stride));
  shape[d0] = t->shape[d1], stride[d0] = t->stride[d1];
  shape[d1] = t->shape[d0], stride[d1] = t->stride[d0];
  return view_new(ctx, "transpose", t, t->ndim, shape, stride, t->offset,
                  &(view_grad){MOE_OP_TRANSPOSE, 2, {d0, d1}}, out);
}

moe_status moe_permute(moe_ctx *ctx, moe_tensor *t, int ndim, const int64_t *dims,
                       moe_tensor **out) {
  MOE_CHECK(view_args(ctx, "permute", t, out));
  if (ndim != t->ndim)
    return moe_error(ctx, MOE_ERR_SHAPE, "permute: %d dims given for a tensor of %d dims", ndim,
                     t->ndim);
  if (ndim > 0 && !dims) return moe_error(ctx, MOE_ERR_INVALID_ARG, "permute: dims is NULL");
  int64_t shape[MOE_MAX_DIMS], stride[MOE_MAX_DIMS];
  bool seen[MOE_MAX_DIMS] = {false};
  view_grad inv = {MOE_OP_PERMUTE, ndim, {0}}; /* args: the inverse permutation */
  for (int i = 0; i < ndim; i++) {
    int d = 0;
    MOE_CHECK(dim_normalize(ctx, "permute", dims[i], ndim, false, &d));
    if (seen[d])
      return moe_error(ctx, MOE_ERR_INVALID_ARG, "permute: dim %d appears twice in the permutation",
                       d);
    seen[d] = true;
    inv.args[d] = i;
    shape[i] = t->shape[d];
    stride[i] = t->stride[d];
  }
  return view_new(ctx, "permute", t, ndim, shape, stride, t->offset, &inv, out);
}

moe_status moe_narrow(moe_ctx *ctx, moe_tensor *t, int64_t dim, int64_t start, int64_t length,
                      moe_tensor **out) {
  MOE_CHECK(view_args(ctx, "narrow", t, out));
  int d = 0;
  MOE_CHECK(dim_normalize(ctx, "narrow", dim, t->ndim, false, &d));
  int64_t size = t->shape[d];
  if (start < -size || start > size)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "narrow: start %lld is out of range for size %lld of dim %d",
                     (long long)start, (long long)size, d);
  if (start < 0) start += size;
  if (length < 0)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "narrow: length %lld is negative",
                     (long long)length);
  if (length > size - start)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "narrow: start %lld + length %lld exceeds size %lld of dim %d",
                     (long long)start, (long long)length, (long long)size, d);
  int64_t shape[MOE_MAX_DIMS];
  memcpy(shape, t->shape, sizeof(shape));
  shape[d] = length;
  return view_new(ctx, "narrow", t, t->ndim, shape, t->stride, t->offset + start * t->stride[d],
                  &(view_grad){MOE_OP_NARROW, 3, {d, start, length}}, out);
}

moe_status moe_slice(moe_ctx *ctx, moe_tensor *t, int64_t dim, int64_t start, int64_t stop,
                     int64_t step, moe_tensor **out) {
  MOE_CHECK(view_args(ctx, "slice", t, out));
  int d = 0;
  MOE_CHECK(dim_normalize(ctx, "slice", dim, t->ndim, false, &d));
  if (step < 1)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "slice: step %lld must be >= 1", (long long)step);
  int64_t size = t->shape[d];
  if (start < 0) start = start < -size ? 0 : start + size;
  if (stop < 0) stop = stop < -size ? 0 : stop + size;
  if (start > size) start = size;
  if (stop > size) stop = size;
  int64_t len = stop > start ? (stop - start - 1) / step + 1 : 0;
  int64_t shape[MOE_MAX_DIMS], stride[MOE_MAX_DIMS];
  memcpy(shape, t->shape, sizeof(shape));
  memcpy(stride, t->stride, sizeof(stride));
  shape[d] = len;
  stride[d] = t->stride[d] * step;
  return view_new(ctx, "slice", t, t->ndim, shape, stride, t->offset + start * t->stride[d],
                  &(view_grad){MOE_OP_SLICE, 4, {d, start, start + len * step, step}}, out);
}

moe_status moe_select(moe_ctx *ctx, moe_tensor *t, int64_t dim, int64_t index, moe_tensor **out) {
  MOE_CHECK(view_args(ctx, "select", t, out));
  int d = 0;
  MOE_CHECK(dim_normalize(ctx, "select", dim, t->ndim, false, &d));
  int64_t size = t->shape[d];
  if (index < -size || index >= size)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "select: index %lld is out of range for size %lld of dim %d",
                     (long long)index, (long long)size, d);
  if (index < 0) index += size;
  int64_t shape[MOE_MAX_DIMS], stride[MOE_MAX_DIMS];
  for (int i = 0, j = 0; i < t->ndim; i++) {
    if (i == d) continue;
    shape[j] = t->shape[i];
    stride[j++] = t->stride[i];
  }
  return view_new(ctx, "select", t, t->ndim - 1, shape, stride, t->offset + index * t->stride[d],
                  &(view_grad){MOE_OP_SELECT, 2, {d, index}}, out);
}

moe_status moe_expand(moe_ctx *ctx, moe_tensor *t, int ndim, const int64_t *shape,
                      moe_tensor **out) {
  MOE_CHECK(view_args(ctx, "expand", t, out));
  MOE_CHECK(check_ndim(ctx, "expand", ndim, shape));
  if (ndim < t->ndim)
    return moe_error(ctx, MOE_ERR_SHAPE,
                     "expand: target shape %s has fewer dims than the tensor's shape %s",
                     MOE_SHAPE_OF(ndim, shape),
                     MOE_SHAPE(t));
  int64_t res[MOE_MAX_DIMS], stride[MOE_MAX_DIMS];
  int lead = ndim - t->ndim;
  for (int i = 0; i < ndim; i++) {
    int64_t want = shape[i];
    if (i < lead) {
      if (want < 0)
        return moe_error(ctx, MOE_ERR_SHAPE,
                         "expand: size %lld is not allowed for the new leading dim %d of %s", (long long)want,
                         i, MOE_SHAPE_OF(ndim, shape));
      res[i] = want;
      stride[i] = 0;
      continue;
    }
    int64_t have = t->shape[i - lead];
    if (want == -1) want = have;
    if (want < 0)
      return moe_error(ctx, MOE_ERR_SHAPE, "expand: dim %d has negative size %lld", i,
                       (long long)want);
    if (want == have) {
      res[i] = have;
      stride[i] = t->stride[i - lead];
    } else if (have == 1) {
      res[i] = want;
      stride[i] = 0;
    } else {
      return moe_error(ctx, MOE_ERR_SHAPE,
                       "expand: shape %s cannot be expanded to %s (dim %d has size %lld, only "
                       "size-1 dims expand)",
                       MOE_SHAPE(t),
                       MOE_SHAPE_OF(ndim, shape), i - lead, (long long)have);
    }
  }
  return view_new(ctx, "expand", t, ndim, res, stride, t->offset,
                  &(view_grad){MOE_OP_EXPAND, 0, {0}}, out);
}

moe_status moe_squeeze(moe_ctx *ctx, moe_tensor *t, int64_t dim, bool all, moe_tensor **out) {
  MOE_CHECK(view_args(ctx, "squeeze", t, out));
  int d = -1;
  if (!all) MOE_CHECK(dim_normalize(ctx, "squeeze", dim, t->ndim, false, &d));
  int64_t shape[MOE_MAX_DIMS], stride[MOE_MAX_DIMS];
  int n = 0;
  for (int i = 0; i < t->ndim; i++) {
    /* like PyTorch, squeezing a dim whose size is not 1 leaves it */
    if (t->shape[i] == 1 && (all || i == d)) continue;
    shape[n] = t->shape[i];
    stride[n++] = t->stride[i];
  }
  return view_new(ctx, "squeeze", t, n, shape, stride, t->offset,
                  &(view_grad){MOE_OP_SQUEEZE, 0, {0}}, out);
}

moe_status moe_unsqueeze(moe_ctx *ctx, moe_tensor *t, int64_t dim, moe_tensor **out) {
  MOE_CHECK(view_args(ctx, "unsqueeze", t, out));
  if (t->ndim >= MOE_MAX_DIMS)
    return moe_error(ctx, MOE_ERR_SHAPE, "unsqueeze: ndim %d exceeds the maximum of %d",
                     t->ndim + 1, MOE_MAX_DIMS);
  int d = 0;
  MOE_CHECK(dim_normalize(ctx, "unsqueeze", dim, t->ndim, true, &d));
  int64_t shape[MOE_MAX_DIMS], stride[MOE_MAX_DIMS];
  for (int i = 0, j = 0; i <= t->ndim; i++) {
    if (i == d) {
      shape[i] = 1;
      stride[i] = d < t->ndim ? t->shape[d] * t->stride[d] : 1;
    } else {
      shape[i] = t->shape[j];
      stride[i] = t->stride[j++];
    }
  }
  return view_new(ctx, "unsqueeze", t, t->ndim + 1, shape, stride, t->offset,
                  &(view_grad){MOE_OP_UNSQUEEZE, 0, {0}}, out);
}

moe_status moe_contiguous(moe_ctx *ctx, moe_tensor *t, moe_tensor **out) {
  MOE_CHECK(view_args(ctx, "contiguous", t, out));
  if (moe_tensor_is_contiguous(t)) {
    moe_tensor_retain(t);
    *out = t;
    return MOE_OK;
  }
  return moe_clone(ctx, t, out);
}
