/*
 * quantize.c - the quantize family (core/moe_quantize.h): argument checks,
 * the CPU reference of quantize / dequantize, the dispatch to the CUDA
 * kernels (kernels/quantize.cu), and the saved-tensor hooks that keep
 * activations saved for backward quantized.
 *
 * Owns: moe_qtensor's two tensors; the hooks' state (options and the
 * retained storages of the tensors never quantized).
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "moe_quantize.h"
#include "quantize_cuda.h"

moe_quant_opts moe_quant_opts_default(int bits) {
  moe_quant_opts o = {bits, bits == 4 ? 128 : 0, false};
  return o;
}

moe_quant_hooks_opts moe_quant_hooks_opts_default(int bits) {
  moe_quant_hooks_opts o = {moe_quant_opts_default(bits), 1024, 0, NULL};
  return o;
}

void moe_qtensor_clear(moe_qtensor *q) {
  if (!q) return;
  moe_tensor_release(q->values);
  moe_tensor_release(q->scales);
  memset(q, 0, sizeof(*q));
}

int64_t moe_qtensor_nbytes(const moe_qtensor *q) {
  if (!q) return 0;
  int64_t n = 0;
  if (q->values) n += moe_tensor_numel(q->values) * (int64_t)moe_dtype_size(q->values->dtype);
  if (q->scales) n += moe_tensor_numel(q->scales) * (int64_t)moe_dtype_size(q->scales->dtype);
  return n;
}

/* --------------------------------------------------------------- checks */

static moe_status qz_check_opts(moe_ctx *ctx, const char *fn, const moe_quant_opts *o) {
  if (!o) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: options are NULL", fn);
  if (o->bits != 8 && o->bits != 4)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: bits must be 8 or 4, got %d", fn, o->bits);
  if (o->group_size < 0)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: group_size must be >= 0 (0: one scale per row), got %lld",
                     fn, (long long)o->group_size);
  if (o->bits == 4 && o->group_size % 2 != 0)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "%s: group_size must be even for 4 bits (two values a byte), got %lld", fn,
                     (long long)o->group_size);
  return MOE_OK;
}

static moe_status qz_check_dtype(moe_ctx *ctx, const char *fn, moe_dtype dt, moe_device d) {
  bool ok = dt == MOE_F32 || dt == MOE_BF16 || dt == MOE_F16 ||
            (dt == MOE_F64 && d.type == MOE_DEVICE_CPU);
  if (!ok)
    return moe_error(ctx, MOE_ERR_DTYPE, "%s: dtype %s is not supported on %s (f32, bf16, f16%s)",
                     fn, moe_dtype_name(dt), d.type == MOE_DEVICE_CPU ? "the CPU" : "CUDA",
                     d.type == MOE_DEVICE_CPU ? ", f64" : "");
  return MOE_OK;
}

/* (rows, cols, G effective, ngroups, bytes per row of values) of a shape. */
typedef struct qz_geom {
  int64_t rows, cols, G, ngroups, row_bytes;
} qz_geom;

static qz_geom qz_geom_of(int ndim, const int64_t *shape, int bits, int64_t group_size) {
  qz_geom g;
  g.cols = ndim > 0 ? shape[ndim - 1] : 1;
  g.rows = 1;
  for (int d = 0; d < ndim - 1; d++) g.rows *= shape[d];
  g.G = moe_qz_group(g.cols, bits, group_size);
  g.ngroups = g.cols > 0 ? (g.cols + g.G - 1) / g.G : 0;
  g.row_bytes = bits == 8 ? g.cols : (g.cols + 1) / 2;
  return g;
}

/* The row stride of x seen as (rows, cols) when its rows can be read in
 * place (elements of a row contiguous, rows evenly spaced: e.g. a narrow
 * view of the last dim), else 0 (x must be made contiguous first). */
static int64_t qz_row_stride(const moe_tensor *x, const qz_geom *g) {
  int nd = x->ndim;
  if (nd == 0 || g->rows <= 1) return g->cols;
  if (g->cols > 1 && x->stride[nd - 1] != 1) return 0;
  int64_t ld = 0, expect = 0; /* expect: the stride the next outer dim must have */
  for (int d = nd - 2; d >= 0; d--) {
    if (x->shape[d] == 1) continue;
    if (ld == 0) {
      ld = x->stride[d];
      if (ld < g->cols) return 0;
    } else if (x->stride[d] != expect) {
      return 0;
    }
    expect = x->stride[d] * x->shape[d];
  }
  return ld;
}

/* ---------------------------------------------------------- CPU reference */

static float qz_load(const void *x, moe_dtype dt, int64_t i) {
  switch (dt) {
  case MOE_F32: return ((const float *)x)[i];
  case MOE_F64: return (float)((const double *)x)[i];
  case MOE_BF16: return moe_bf16_to_f32(((const moe_bf16 *)x)[i]);
  default: return moe_f16_to_f32(((const moe_f16 *)x)[i]);
  }
}

static void qz_store(void *out, moe_dtype dt, int64_t i, float v) {
  switch (dt) {
  case MOE_F32: ((float *)out)[i] = v; break;
  case MOE_F64: ((double *)out)[i] = (double)v; break;
  case MOE_BF16: ((moe_bf16 *)out)[i] = moe_f32_to_bf16(v); break;
  default: ((moe_f16 *)out)[i] = moe_f32_to_f16(v); break;
  }
}

/* x: row r at element r * ld (its elements contiguous). */
static void qz_cpu_quantize(moe_dtype dt, const void *x, int64_t ld, const qz_geom *g, int bits,
                            bool stochastic, uint64_t seed, uint64_t call, void *values,
                            float *scales) {
  int qmax = bits == 8 ? 127 : 7;
  for (int64_t r = 0; r < g->rows; r++) {
    uint8_t *row4 = (uint8_t *)values + r * g->row_bytes;
    int8_t *row8 = (int8_t *)values + r * g->row_bytes;
    if (bits == 4) memset(row4, 0, (size_t)g->row_bytes);
    for (int64_t k = 0; k < g->ngroups; k++) {
      int64_t c0 = k * g->G, c1 = c0 + g->G < g->cols ? c0 + g->G : g->cols;
      float m = 0.0f;
      for (int64_t c = c0; c < c1; c++) m = moe_qz_absmax(m, qz_load(x, dt, r * ld + c));
      float s = moe_qz_scale(m, qmax), inv = moe_qz_inv(s);
      scales[r * g->ngroups + k] = s;
      for (int64_t c = c0; c < c1; c++) {
        int64_t i = r * g->cols + c;
        float u = stochastic ? moe_qz_uniform(seed, call, (uint64_t)i) : 0.0f;
        int q = moe_qz_code(qz_load(x, dt, r * ld + c), s, inv, qmax, stochastic, u);
        if (bits == 8)
          row8[c] = (int8_t)q;
        else
          row4[c / 2] |= (uint8_t)((q + 8) << ((c & 1) * 4));
      }
    }
  }
}

static void qz_cpu_dequantize(moe_dtype dt, const void *values, const float *scales,
                              const qz_geom *g, int bits, void *out) {
  for (int64_t r = 0; r < g->rows; r++) {
    const uint8_t *row4 = (const uint8_t *)values + r * g->row_bytes;
    const int8_t *row8 = (const int8_t *)values + r * g->row_bytes;
    for (int64_t c = 0; c < g->cols; c++) {
      int q = bits == 8 ? row8[c] : (int)((row4[c / 2] >> ((c & 1) * 4)) & 15) - 8;
      qz_store(out, dt, r * g->cols + c, moe_qz_value(q, scales[r * g->ngroups + c / g->G]));
    }
  }
}

/* ------------------------------------------------------------- the ops */

moe_status moe_quantize(moe_ctx *ctx, moe_tensor *x, const moe_quant_opts *opts,
                        moe_qtensor *out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  const char *fn = "quantize";
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: out is NULL", fn);
  memset(out, 0, sizeof(*out));
  if (!x) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: x is NULL", fn);
  MOE_CHECK(qz_check_opts(ctx, fn, opts));
  moe_device d = moe_tensor_device(x);
  MOE_CHECK(qz_check_dtype(ctx, fn, x->dtype, d));
  qz_geom g = qz_geom_of(x->ndim, x->shape, opts->bits, opts->group_size);
  moe_tensor *xc = NULL, *values = NULL, *scales = NULL;
  moe_status st;
  int64_t ld = qz_row_stride(x, &g);
  if (ld > 0) { /* rows read in place */
    moe_tensor_retain(x);
    xc = x;
  } else {
    MOE_CHECK_GOTO(moe_contiguous(ctx, x, &xc), st, fail);
    ld = g.cols;
  }
  MOE_CHECK_GOTO(moe_tensor_empty(ctx, 2, (const int64_t[]){g.rows, g.row_bytes},
                                  opts->bits == 8 ? MOE_I8 : MOE_U8, d, &values),
                 st, fail);
  MOE_CHECK_GOTO(moe_tensor_empty(ctx, 2, (const int64_t[]){g.rows, g.ngroups}, MOE_F32, d,
                                  &scales),
                 st, fail);
  uint64_t seed = ctx->rng_seed, call = ctx->rng_call;
  if (opts->stochastic) ctx->rng_call++;
  if (g.rows * g.cols > 0) {
    if (d.type == MOE_DEVICE_CPU) {
      qz_cpu_quantize(x->dtype, moe_tensor_data(xc), ld, &g, opts->bits, opts->stochastic, seed, call,
                      moe_tensor_data(values), (float *)moe_tensor_data(scales));
    } else {
      MOE_CHECK_GOTO(moe_cuda_quantize(ctx, d.index, x->dtype, moe_tensor_data(xc), ld, g.rows, g.cols,
                                       opts->bits, g.G, opts->stochastic, seed, call,
                                       moe_tensor_data(values), (float *)moe_tensor_data(scales)),
                     st, fail);
    }
  }
  moe_tensor_release(xc);
  out->bits = opts->bits;
  out->group_size = opts->group_size;
  out->dtype = x->dtype;
  out->ndim = x->ndim;
  memcpy(out->shape, x->shape, sizeof(int64_t) * (size_t)x->ndim);
  out->values = values;
  out->scales = scales;
  return MOE_OK;
fail:
  moe_tensor_release(xc);
  moe_tensor_release(values);
  moe_tensor_release(scales);
  return st;
}

/* Checks that q's tensors have the shapes, dtypes and device its fields imply. */
static moe_status qz_check_qtensor(moe_ctx *ctx, const char *fn, const moe_qtensor *q,
                                   qz_geom *g) {
  if (!q) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: q is NULL", fn);
  if (!q->values || !q->scales)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: q has no values or scales", fn);
  moe_quant_opts o = {q->bits, q->group_size, false};
  MOE_CHECK(qz_check_opts(ctx, fn, &o));
  if (q->ndim < 0 || q->ndim > MOE_MAX_DIMS)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: q has %d dims", fn, q->ndim);
  for (int i = 0; i < q->ndim; i++)
    if (q->shape[i] < 0) return moe_error(ctx, MOE_ERR_SHAPE, "%s: negative size in q's shape", fn);
  moe_device d = moe_tensor_device(q->values);
  MOE_CHECK(qz_check_dtype(ctx, fn, q->dtype, d));
  MOE_CHECK(moe_check_same_device(ctx, fn, "values", d, "scales", moe_tensor_device(q->scales)));
  *g = qz_geom_of(q->ndim, q->shape, q->bits, q->group_size);
  moe_dtype vdt = q->bits == 8 ? MOE_I8 : MOE_U8;
  const int64_t vs[2] = {g->rows, g->row_bytes}, ss[2] = {g->rows, g->ngroups};
  const moe_tensor *v = q->values, *s = q->scales;
  if (v->dtype != vdt || v->ndim != 2 || v->shape[0] != vs[0] || v->shape[1] != vs[1] ||
      !moe_tensor_is_contiguous(v))
    return moe_error(ctx, MOE_ERR_SHAPE,
                     "%s: values must be a contiguous %s tensor of shape %s for %d bits and shape "
                     "%s, got %s %s",
                     fn, moe_dtype_name(vdt), MOE_SHAPE_OF(2, vs), q->bits,
                     MOE_SHAPE(q), moe_dtype_name(v->dtype),
                     MOE_SHAPE(v));
  if (s->dtype != MOE_F32 || s->ndim != 2 || s->shape[0] != ss[0] || s->shape[1] != ss[1] ||
      !moe_tensor_is_contiguous(s))
    return moe_error(ctx, MOE_ERR_SHAPE,
                     "%s: scales must be a contiguous f32 tensor of shape %s for group_size %lld "
                     "and shape %s, got %s %s",
                     fn, MOE_SHAPE_OF(2, ss), (long long)q->group_size,
                     MOE_SHAPE(q), moe_dtype_name(s->dtype),
                     MOE_SHAPE(s));
  return MOE_OK;
}

moe_status moe_dequantize(moe_ctx *ctx, const moe_qtensor *q, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  const char *fn = "dequantize";
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: out is NULL", fn);
  *out = NULL;
  qz_geom g;
  MOE_CHECK(qz_check_qtensor(ctx, fn, q, &g));
  moe_device d = moe_tensor_device(q->values);
  moe_tensor *r = NULL;
  MOE_CHECK(moe_tensor_empty(ctx, q->ndim, q->shape, q->dtype, d, &r));
  if (g.rows * g.cols > 0) {
    if (d.type == MOE_DEVICE_CPU) {
      qz_cpu_dequantize(q->dtype, moe_tensor_data(q->values),
                        (const float *)moe_tensor_data(q->scales), &g, q->bits,
                        moe_tensor_data(r));
    } else {
      moe_status st = moe_cuda_dequantize(ctx, d.index, q->dtype, moe_tensor_data(q->values),
                               (const float *)moe_tensor_data(q->scales), g.rows, g.cols, q->bits,
                               g.G, moe_tensor_data(r));
      if (st != MOE_OK) {
        moe_tensor_release(r);
        return st;
      }
    }
  }
  *out = r;
  return MOE_OK;
}

/* ------------------------------------------------------- saved-tensor hooks */

typedef struct qz_hooks {
  moe_quant_hooks_opts o;  /* o.keep points at keep below */
  moe_storage **keep;      /* (o.n_keep) retained */
} qz_hooks;

/* A packed saved tensor: quantized, or kept as it was. */
typedef struct qz_packed {
  moe_qtensor q;     /* when plain is NULL */
  moe_tensor *plain; /* a tensor saved unchanged (retained) */
} qz_packed;

static bool qz_hooks_quantizes(const qz_hooks *h, const moe_tensor *t) {
  if (t->dtype != MOE_F32 && t->dtype != MOE_BF16 && t->dtype != MOE_F16) return false;
  if (t->ndim == 0 || moe_tensor_numel(t) < h->o.min_numel || moe_tensor_numel(t) == 0)
    return false;
  for (int i = 0; i < h->o.n_keep; i++)
    if (h->keep[i] == t->storage) return false;
  return true;
}

static moe_status qz_hooks_pack(moe_ctx *ctx, void *ud, moe_tensor *t, void **packed) {
  qz_hooks *h = (qz_hooks *)ud;
  qz_packed *p = calloc(1, sizeof(*p));
  if (!p) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "quantize hooks: out of host memory");
  if (!qz_hooks_quantizes(h, t)) {
    moe_tensor_retain(t);
    p->plain = t;
  } else {
    moe_status st = moe_quantize(ctx, t, &h->o.quant, &p->q);
    if (st != MOE_OK) {
      free(p);
      return st;
    }
  }
  *packed = p;
  return MOE_OK;
}

static moe_status qz_hooks_unpack(moe_ctx *ctx, void *ud, void *packed, moe_tensor **out) {
  (void)ud;
  qz_packed *p = (qz_packed *)packed;
  if (p->plain) {
    moe_tensor_retain(p->plain);
    *out = p->plain;
    return MOE_OK;
  }
  return moe_dequantize(ctx, &p->q, out);
}

static void qz_hooks_free_packed(void *ud, void *packed) {
  (void)ud;
  qz_packed *p = (qz_packed *)packed;
  if (!p) return;
  moe_tensor_release(p->plain);
  moe_qtensor_clear(&p->q);
  free(p);
}

static void qz_hooks_free(void *ud) {
  qz_hooks *h = (qz_hooks *)ud;
  if (!h) return;
  for (int i = 0; i < h->o.n_keep; i++) moe_storage_release(h->keep[i]);
  free(h->keep);
  free(h);
}

moe_status moe_quantize_hooks_push(moe_ctx *ctx, const moe_quant_hooks_opts *opts) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  const char *fn = "quantize_hooks_push";
  if (!opts) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: options are NULL", fn);
  MOE_CHECK(qz_check_opts(ctx, fn, &opts->quant));
  if (opts->min_numel < 0)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: min_numel must be >= 0, got %lld", fn,
                     (long long)opts->min_numel);
  if (opts->n_keep < 0 || (opts->n_keep > 0 && !opts->keep))
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: keep has %d tensors but is NULL", fn,
                     opts->n_keep);
  for (int i = 0; i < opts->n_keep; i++)
    if (!opts->keep[i])
      return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: keep tensor %d is NULL", fn, i);
  qz_hooks *h = calloc(1, sizeof(*h));
  if (!h) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
  h->o = *opts;
  h->o.keep = NULL;
  if (opts->n_keep > 0) {
    h->keep = calloc((size_t)opts->n_keep, sizeof(*h->keep));
    if (!h->keep) {
      free(h);
      return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
    }
    for (int i = 0; i < opts->n_keep; i++) {
      h->keep[i] = opts->keep[i]->storage;
      moe_storage_retain(h->keep[i]);
    }
  }
  moe_saved_hooks hooks = {0, qz_hooks_pack, qz_hooks_unpack, qz_hooks_free_packed,
                           qz_hooks_free, h};
  moe_status st = moe_saved_hooks_push(ctx, &hooks);
  if (st != MOE_OK) qz_hooks_free(h);
  return st;
}
