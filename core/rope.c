/*
 * rope.c - rotary position embedding (moe_index.h): rope rotates pairs of
 * x's last dim by the angles whose cosines and sines come from rope_cache;
 * layouts BTHD and BHTD. The CPU reference is here, the CUDA one behind
 * moe_cuda_rope (index_cuda.h, kernels/index.cu). The backward is the
 * inverse rotation; cos and sin are constants.
 */
#include <math.h>
#include <stdlib.h>

#include "index_cuda.h"
#include "index_util.h"
#include "internal.h"

/* -------------------------------------------------------------- rope */

/* out (new, contiguous) = rotation of x (inverse: the transposed one). */
static moe_status rope_run(moe_ctx *ctx, const char *fn, const moe_tensor *x,
                              const moe_tensor *cos, const moe_tensor *sin, int tdim,
                              bool inverse, moe_tensor **out) {
  moe_tensor *r;
  MOE_CHECK(moe_tensor_empty(ctx, x->ndim, x->shape, x->dtype, x->storage->device, &r));
  moe_status st = MOE_OK;
  if (moe_tensor_numel(r) > 0 && ix_cuda(x)) {
    moe_kview vo = moe_kview_of(r), vx = moe_kview_of(x), vc = moe_kview_of(cos),
              vs = moe_kview_of(sin);
    st = moe_cuda_rope(ctx, x->storage->device.index, &vo, &vx, &vc, &vs, tdim, inverse);
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
  if (!gout[0]) return moe_node_zeros_input(ctx, n, 0, &gin[0]);
  moe_tensor *c = NULL, *s = NULL;
  moe_status st = moe_node_saved(ctx, n, 0, &c);
  if (st == MOE_OK) st = moe_node_saved(ctx, n, 1, &s);
  if (st == MOE_OK) st = rope_run(ctx, "rope backward", gout[0], c, s, (int)n->iargs[0], true, &gin[0]);
  moe_tensor_release(c);
  moe_tensor_release(s);
  return st;
}

moe_status moe_rope(moe_ctx *ctx, moe_tensor *x, moe_tensor *cos, moe_tensor *sin,
                    moe_rope_layout layout, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  const char *fn = "rope";
  MOE_CHECK(ix_null(ctx, fn, "x", x));
  MOE_CHECK(ix_null(ctx, fn, "cos", cos));
  MOE_CHECK(ix_null(ctx, fn, "sin", sin));
  MOE_CHECK(ix_null(ctx, fn, "out", out));
  if (layout != MOE_ROPE_BTHD && layout != MOE_ROPE_BHTD)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "rope: unknown layout %d (BTHD or BHTD)", (int)layout);
  MOE_CHECK(moe_check_same_device(ctx, fn, "x", x->storage->device, "cos", cos->storage->device));
  MOE_CHECK(moe_check_same_device(ctx, fn, "x", x->storage->device, "sin", sin->storage->device));
  if (x->dtype != MOE_F32 && x->dtype != MOE_F64 && x->dtype != MOE_BF16 && x->dtype != MOE_F16)
    return moe_error(ctx, MOE_ERR_DTYPE, "rope: x must be f32, f64, bf16 or f16, got %s",
                     moe_dtype_name(x->dtype));
  MOE_CHECK(moe_check_same_dtype(ctx, fn, "cos", cos->dtype, "x", x->dtype));
  MOE_CHECK(moe_check_same_dtype(ctx, fn, "sin", sin->dtype, "x", x->dtype));
  int tdim = layout == MOE_ROPE_BTHD ? 1 : 2;
  if (x->ndim != 4 || x->shape[3] % 2 != 0)
    return moe_error(ctx, MOE_ERR_SHAPE, "rope: x must be 4-D (%s) with an even last dim, got %s",
                     layout == MOE_ROPE_BTHD ? "B, T, H, D" : "B, H, T, D",
                     MOE_SHAPE(x));
  int64_t T = x->shape[tdim], D = x->shape[3];
  bool ok = cos->ndim == 2 && sin->ndim == 2 && cos->shape[0] == T && sin->shape[0] == T &&
            cos->shape[1] == sin->shape[1] && (cos->shape[1] == D || cos->shape[1] == D / 2);
  if (!ok)
    return moe_error(ctx, MOE_ERR_SHAPE,
                     "rope: cos %s and sin %s must both be (T, D/2) or (T, D) = (%lld, %lld) or "
                     "(%lld, %lld) for x %s",
                     MOE_SHAPE(cos),
                     MOE_SHAPE(sin), (long long)T,
                     (long long)(D / 2), (long long)T, (long long)D,
                     MOE_SHAPE(x));
  if (moe_requires_grad(cos) || moe_requires_grad(sin))
    return moe_error(ctx, MOE_ERR_NOT_SUPPORTED,
                     "rope: cos and sin are constants; gradients for them are not supported "
                     "(detach them)");
  MOE_CHECK(moe_device_check(ctx, x->storage->device));
  moe_tensor *r;
  MOE_CHECK(rope_run(ctx, fn, x, cos, sin, tdim, false, &r));
  MOE_CHECK(moe_record(ctx, &(moe_record_spec){.op = MOE_OP_ROPE, .backward = rope_backward,
                                               .n_in = 1, .in = {x}, .n_save = 2,
                                               .save = {cos, sin}, .iargs = {tdim}},
                       1, &r));
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
