/*
 * attention.c - scaled-dot-product attention (moe_attention.h): argument
 * checks, the CPU reference (forward and backward, in double), dispatch to
 * the fused CUDA kernels (kernels/attention.cu) and the autograd node.
 *
 * CPU reference, per row i of one (b, h):
 *   s_j = scale * q_i . k_j (j <= i when causal), lse_i = logsumexp_j s_j,
 *   p_j = exp(s_j - lse_i), o_i = sum_j p_j v_j.
 * Backward (FlashAttention's formulation, with delta_i = dout_i . o_i):
 *   dv_j += p_ij dout_i, ds_ij = p_ij (dout_i . v_j - delta_i),
 *   dq_i += scale ds_ij k_j, dk_j += scale ds_ij q_i.
 * Inputs are read in logical order into double buffers (so any strides and
 * dtypes work), computed in double and rounded to the dtype once.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention_cuda.h"
#include "internal.h"

/* --------------------------------------------------------------- checks */

static moe_status attn_check_one(moe_ctx *ctx, const char *fn, const char *name,
                                 const moe_tensor *t, const moe_tensor *q) {
  if (!t) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: %s is NULL", fn, name);
  if (t->ndim != q->ndim || memcmp(t->shape, q->shape, sizeof(int64_t) * (size_t)q->ndim) != 0)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: %s has shape %s, wanted q's shape %s", fn, name,
                     MOE_SHAPE(t), MOE_SHAPE(q));
  MOE_CHECK(moe_check_same_dtype(ctx, fn, name, t->dtype, "q", q->dtype));
  return moe_check_same_device(ctx, fn, name, t->storage->device, "q", q->storage->device);
}

/* Checks q, k, v and resolves the scale. */
static moe_status attn_check(moe_ctx *ctx, const char *fn, const moe_tensor *q,
                             const moe_tensor *k, const moe_tensor *v, double scale,
                             double *scale_out) {
  if (!q) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: q is NULL", fn);
  if (q->ndim != 4)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: q must be 4-D (B, H, T, D), got shape %s", fn,
                     MOE_SHAPE(q));
  MOE_CHECK(attn_check_one(ctx, fn, "k", k, q));
  MOE_CHECK(attn_check_one(ctx, fn, "v", v, q));
  if (q->shape[3] < 1)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: head dim (dim 3) must be at least 1, shape %s", fn,
                     MOE_SHAPE(q));
  moe_device d = q->storage->device;
  MOE_CHECK(moe_device_check(ctx, d));
  if (d.type == MOE_DEVICE_CPU) {
    if (q->dtype != MOE_F32 && q->dtype != MOE_F64 && q->dtype != MOE_BF16)
      return moe_error(ctx, MOE_ERR_DTYPE, "%s: dtype %s is not supported on the CPU (f32, f64, bf16)",
                       fn, moe_dtype_name(q->dtype));
  } else {
    if (!moe_dtype_is_float(q->dtype) || q->dtype == MOE_F64)
      return moe_error(ctx, MOE_ERR_DTYPE, "%s: dtype %s is not supported on CUDA (bf16)", fn,
                       moe_dtype_name(q->dtype));
    if (q->dtype != MOE_BF16 || (q->shape[3] != 64 && q->shape[3] != 128))
      return moe_error(ctx, MOE_ERR_NOT_SUPPORTED,
                       "%s: the CUDA kernels take bf16 with head dim 64 or 128, got %s with head "
                       "dim %lld (cast to bf16, or run on the CPU)",
                       fn, moe_dtype_name(q->dtype), (long long)q->shape[3]);
  }
  if (isinf(scale))
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: scale must be finite, got %g", fn, scale);
  *scale_out = (scale == 0 || isnan(scale)) ? 1.0 / sqrt((double)q->shape[3]) : scale;
  return MOE_OK;
}

/* ------------------------------------------------------- CPU reference */

static double *attn_read(moe_ctx *ctx, const moe_tensor *t, moe_status *st) {
  int64_t n = moe_tensor_numel(t);
  double *p = (double *)malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
  if (!p) {
    *st = moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "attention: out of host memory (%lld values)",
                    (long long)n);
    return NULL;
  }
  *st = moe_tensor_values_f64(ctx, t, p);
  if (*st != MOE_OK) {
    free(p);
    return NULL;
  }
  return p;
}

static double attn_dot(const double *a, const double *b, int64_t n) {
  double s = 0;
  for (int64_t d = 0; d < n; d++) s += a[d] * b[d];
  return s;
}

/* q, k, v, o: (BH, T, D); lse: (BH, T). Returns false when out of memory. */
static bool attn_cpu_fwd(const double *q, const double *k, const double *v, double *o,
                         double *lse, int64_t BH, int64_t T, int64_t D, bool causal,
                         double scale) {
  bool ok = true;
#pragma omp parallel
  {
    double *s = (double *)malloc(sizeof(double) * (size_t)T);
    if (!s) {
#pragma omp atomic write
      ok = false;
    }
#pragma omp for schedule(dynamic, 16)
    for (int64_t r = 0; r < BH * T; r++) {
      if (!s) continue;
      int64_t bh = r / T, i = r % T, n = causal ? i + 1 : T;
      const double *qi = q + r * D, *kb = k + bh * T * D, *vb = v + bh * T * D;
      double m = -INFINITY, l = 0;
      for (int64_t j = 0; j < n; j++) {
        s[j] = scale * attn_dot(qi, kb + j * D, D);
        if (s[j] > m) m = s[j];
      }
      double *oi = o + r * D;
      for (int64_t d = 0; d < D; d++) oi[d] = 0;
      for (int64_t j = 0; j < n; j++) {
        double p = exp(s[j] - m);
        l += p;
        const double *vj = vb + j * D;
        for (int64_t d = 0; d < D; d++) oi[d] += p * vj[d];
      }
      for (int64_t d = 0; d < D; d++) oi[d] /= l;
      lse[r] = m + log(l);
    }
    free(s);
  }
  return ok;
}

/* Gradients dq, dk, dv (BH, T, D), zeroed here; heads run in parallel. */
static void attn_cpu_bwd(const double *q, const double *k, const double *v, const double *o,
                         const double *lse, const double *dout, double *dq, double *dk,
                         double *dv, int64_t BH, int64_t T, int64_t D, bool causal,
                         double scale) {
  memset(dq, 0, sizeof(double) * (size_t)(BH * T * D));
  memset(dk, 0, sizeof(double) * (size_t)(BH * T * D));
  memset(dv, 0, sizeof(double) * (size_t)(BH * T * D));
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t bh = 0; bh < BH; bh++) {
    int64_t base = bh * T * D;
    for (int64_t i = 0; i < T; i++) {
      const double *qi = q + base + i * D, *doi = dout + base + i * D;
      double delta = attn_dot(doi, o + base + i * D, D), li = lse[bh * T + i];
      double *dqi = dq + base + i * D;
      int64_t n = causal ? i + 1 : T;
      for (int64_t j = 0; j < n; j++) {
        const double *kj = k + base + j * D, *vj = v + base + j * D;
        double p = exp(scale * attn_dot(qi, kj, D) - li);
        double ds = p * (attn_dot(doi, vj, D) - delta);
        double *dkj = dk + base + j * D, *dvj = dv + base + j * D;
        for (int64_t d = 0; d < D; d++) {
          dvj[d] += p * doi[d];
          dqi[d] += scale * ds * kj[d];
          dkj[d] += scale * ds * qi[d];
        }
      }
    }
  }
}

static moe_status attn_cpu_forward(moe_ctx *ctx, moe_tensor *q, moe_tensor *k, moe_tensor *v,
                                   bool causal, double scale, moe_tensor **out,
                                   moe_tensor **lse) {
  int64_t BH = q->shape[0] * q->shape[1], T = q->shape[2], D = q->shape[3];
  moe_status st = MOE_OK;
  double *dq = NULL, *dk = NULL, *dvv = NULL, *o = NULL, *l = NULL;
  moe_tensor *ot = NULL, *lt = NULL;
  dq = attn_read(ctx, q, &st);
  if (st == MOE_OK) dk = attn_read(ctx, k, &st);
  if (st == MOE_OK) dvv = attn_read(ctx, v, &st);
  if (st == MOE_OK) {
    o = (double *)malloc(sizeof(double) * (size_t)(BH * T * D > 0 ? BH * T * D : 1));
    l = (double *)malloc(sizeof(double) * (size_t)(BH * T > 0 ? BH * T : 1));
    if (!o || !l || !attn_cpu_fwd(dq, dk, dvv, o, l, BH, T, D, causal, scale))
      st = moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "attention: out of host memory");
  }
  if (st == MOE_OK) st = moe_tensor_from_f64(ctx, o, 4, q->shape, q->dtype, MOE_CPU, &ot);
  if (st == MOE_OK)
    st = moe_tensor_from_f64(ctx, l, 3, q->shape, q->dtype == MOE_F64 ? MOE_F64 : MOE_F32,
                             MOE_CPU, &lt);
  free(dq), free(dk), free(dvv), free(o), free(l);
  if (st != MOE_OK) {
    moe_tensor_release(ot);
    return st;
  }
  *out = ot;
  *lse = lt;
  return MOE_OK;
}

static moe_status attn_cpu_backward(moe_ctx *ctx, moe_tensor *q, moe_tensor *k, moe_tensor *v,
                                    moe_tensor *out, moe_tensor *lse, moe_tensor *dout,
                                    bool causal, double scale, moe_tensor **dq, moe_tensor **dk,
                                    moe_tensor **dv) {
  int64_t BH = q->shape[0] * q->shape[1], T = q->shape[2], D = q->shape[3];
  moe_status st = MOE_OK;
  double *in[6] = {NULL}, *g[3] = {NULL};
  const moe_tensor *src[6] = {q, k, v, out, lse, dout};
  moe_tensor *r[3] = {NULL};
  for (int i = 0; i < 6 && st == MOE_OK; i++) in[i] = attn_read(ctx, src[i], &st);
  for (int i = 0; i < 3 && st == MOE_OK; i++) {
    g[i] = (double *)malloc(sizeof(double) * (size_t)(BH * T * D > 0 ? BH * T * D : 1));
    if (!g[i]) st = moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "attention backward: out of host memory");
  }
  if (st == MOE_OK)
    attn_cpu_bwd(in[0], in[1], in[2], in[3], in[4], in[5], g[0], g[1], g[2], BH, T, D, causal,
                 scale);
  for (int i = 0; i < 3 && st == MOE_OK; i++)
    st = moe_tensor_from_f64(ctx, g[i], 4, q->shape, q->dtype, MOE_CPU, &r[i]);
  for (int i = 0; i < 6; i++) free(in[i]);
  for (int i = 0; i < 3; i++) free(g[i]);
  if (st != MOE_OK) {
    for (int i = 0; i < 3; i++) moe_tensor_release(r[i]);
    return st;
  }
  *dq = r[0], *dk = r[1], *dv = r[2];
  return MOE_OK;
}

/* ------------------------------------------------------------ CUDA path */

/* t itself (retained) when the kernels can read its rows, else a contiguous
 * copy (made with grad mode off: it is internal to the op). */
static moe_status attn_rows(moe_ctx *ctx, moe_tensor *t, moe_tensor **out) {
  moe_kview kv = moe_kview_of(t);
  if (moe_cuda_attention_rows_ok(&kv)) {
    moe_tensor_retain(t);
    *out = t;
    return MOE_OK;
  }
  bool prev = moe_grad_set(ctx, false);
  moe_status st = moe_clone(ctx, t, out);
  moe_grad_set(ctx, prev);
  return st;
}

static moe_status attn_cuda_forward(moe_ctx *ctx, moe_tensor *q, moe_tensor *k, moe_tensor *v,
                                    bool causal, double scale, moe_tensor **out,
                                    moe_tensor **lse) {
  moe_device d = q->storage->device;
  moe_tensor *in[3] = {NULL}, *src[3] = {q, k, v}, *ot = NULL, *lt = NULL;
  moe_status st = MOE_OK;
  for (int i = 0; i < 3 && st == MOE_OK; i++) st = attn_rows(ctx, src[i], &in[i]);
  if (st == MOE_OK) st = moe_tensor_empty(ctx, 4, q->shape, q->dtype, d, &ot);
  if (st == MOE_OK) st = moe_tensor_empty(ctx, 3, q->shape, MOE_F32, d, &lt);
  if (st == MOE_OK && moe_tensor_numel(ot) > 0) {
    moe_kview vq = moe_kview_of(in[0]), vk = moe_kview_of(in[1]), vv = moe_kview_of(in[2]),
              vo = moe_kview_of(ot), vl = moe_kview_of(lt);
    st = moe_cuda_attention_fwd(ctx, d.index, &vq, &vk, &vv, &vo, &vl, causal, scale);
  }
  for (int i = 0; i < 3; i++) moe_tensor_release(in[i]);
  if (st != MOE_OK) {
    moe_tensor_release(ot);
    moe_tensor_release(lt);
    return st;
  }
  *out = ot;
  *lse = lt;
  return MOE_OK;
}

static moe_status attn_cuda_backward(moe_ctx *ctx, moe_tensor *q, moe_tensor *k, moe_tensor *v,
                                     moe_tensor *out, moe_tensor *lse, moe_tensor *dout,
                                     bool causal, double scale, moe_tensor **dq,
                                     moe_tensor **dk, moe_tensor **dv) {
  moe_device d = q->storage->device;
  moe_tensor *in[5] = {NULL}, *src[5] = {q, k, v, out, dout}, *g[3] = {NULL}, *delta = NULL,
             *lc = NULL, *acc = NULL;
  moe_status st = MOE_OK;
  for (int i = 0; i < 5 && st == MOE_OK; i++) st = attn_rows(ctx, src[i], &in[i]);
  if (st == MOE_OK) {
    bool prev = moe_grad_set(ctx, false);
    st = moe_contiguous(ctx, lse, &lc);
    moe_grad_set(ctx, prev);
  }
  for (int i = 0; i < 3 && st == MOE_OK; i++)
    st = moe_tensor_empty(ctx, 4, q->shape, q->dtype, d, &g[i]);
  if (st == MOE_OK) st = moe_tensor_empty(ctx, 3, q->shape, MOE_F32, d, &delta);
  if (st == MOE_OK && moe_cuda_attention_bwd_atomic(ctx, d.index))
    st = moe_tensor_empty(ctx, 4, q->shape, MOE_F32, d, &acc);
  if (st == MOE_OK && moe_tensor_numel(g[0]) > 0) {
    moe_kview vq = moe_kview_of(in[0]), vk = moe_kview_of(in[1]), vv = moe_kview_of(in[2]),
              vo = moe_kview_of(in[3]), vdo = moe_kview_of(in[4]), vl = moe_kview_of(lc),
              vd = moe_kview_of(delta), gq = moe_kview_of(g[0]), gk = moe_kview_of(g[1]),
              gv = moe_kview_of(g[2]), va = acc ? moe_kview_of(acc) : (moe_kview){0};
    st = moe_cuda_attention_bwd(ctx, d.index, &vq, &vk, &vv, &vo, &vl, &vdo, &vd, &gq, &gk, &gv,
                                acc ? &va : NULL, causal, scale);
  }
  for (int i = 0; i < 5; i++) moe_tensor_release(in[i]);
  moe_tensor_release(lc);
  moe_tensor_release(delta);
  moe_tensor_release(acc);
  if (st != MOE_OK) {
    for (int i = 0; i < 3; i++) moe_tensor_release(g[i]);
    return st;
  }
  *dq = g[0], *dk = g[1], *dv = g[2];
  return MOE_OK;
}

/* ---------------------------------------------------------------- API */

moe_status moe_attention_forward(moe_ctx *ctx, moe_tensor *q, moe_tensor *k, moe_tensor *v,
                                 bool causal, double scale, moe_tensor **out, moe_tensor **lse) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!out || !lse) return moe_error(ctx, MOE_ERR_INVALID_ARG, "attention: out or lse is NULL");
  double s = 0;
  MOE_CHECK(attn_check(ctx, "attention", q, k, v, scale, &s));
  if (q->storage->device.type == MOE_DEVICE_CUDA)
    return attn_cuda_forward(ctx, q, k, v, causal, s, out, lse);
  return attn_cpu_forward(ctx, q, k, v, causal, s, out, lse);
}

moe_status moe_attention_backward(moe_ctx *ctx, moe_tensor *q, moe_tensor *k, moe_tensor *v,
                                  moe_tensor *out, moe_tensor *lse, moe_tensor *dout, bool causal,
                                  double scale, moe_tensor **dq, moe_tensor **dk,
                                  moe_tensor **dv) {
  const char *fn = "attention backward";
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!dq || !dk || !dv) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: dq, dk or dv is NULL", fn);
  double s = 0;
  MOE_CHECK(attn_check(ctx, fn, q, k, v, scale, &s));
  MOE_CHECK(attn_check_one(ctx, fn, "out", out, q));
  MOE_CHECK(attn_check_one(ctx, fn, "dout", dout, q));
  if (!lse) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: lse is NULL", fn);
  moe_dtype lse_dt = q->dtype == MOE_F64 && q->storage->device.type == MOE_DEVICE_CPU ? MOE_F64 : MOE_F32;
  if (lse->ndim != 3 || memcmp(lse->shape, q->shape, 3 * sizeof(int64_t)) != 0 ||
      lse->dtype != lse_dt || !moe_device_equal(lse->storage->device, q->storage->device))
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: lse must be %s %s on q's device, got %s %s", fn,
                     moe_dtype_name(lse_dt), MOE_SHAPE_OF(3, q->shape), moe_dtype_name(lse->dtype),
                     MOE_SHAPE(lse));
  if (q->storage->device.type == MOE_DEVICE_CUDA)
    return attn_cuda_backward(ctx, q, k, v, out, lse, dout, causal, s, dq, dk, dv);
  return attn_cpu_backward(ctx, q, k, v, out, lse, dout, causal, s, dq, dk, dv);
}

/* Saved: 0 q, 1 k, 2 v, 3 out (detached), 4 lse; iargs[0] causal;
 * dargs[0] the resolved scale. */
static moe_status attention_backward_fn(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                        moe_tensor **gin) {
  moe_tensor *sv[5] = {NULL}, *g[3] = {NULL};
  moe_status st = MOE_OK;
  /* nothing flowed into the output: zero gradients */
  if (!gout[0]) return moe_node_zero_grads(ctx, n, gin);
  for (int i = 0; i < 5 && st == MOE_OK; i++) st = moe_node_saved(ctx, n, i, &sv[i]);
  if (st == MOE_OK)
    st = moe_attention_backward(ctx, sv[0], sv[1], sv[2], sv[3], sv[4], gout[0],
                                n->iargs[0] != 0, n->dargs[0], &g[0], &g[1], &g[2]);
  for (int i = 0; i < 5; i++) moe_tensor_release(sv[i]);
  if (st != MOE_OK) return st;
  for (int i = 0; i < 3; i++) {
    if (moe_node_needs_grad(n, i))
      gin[i] = g[i];
    else
      moe_tensor_release(g[i]);
  }
  return MOE_OK;
}

moe_status moe_attention(moe_ctx *ctx, moe_tensor *q, moe_tensor *k, moe_tensor *v, bool causal,
                         double scale, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "attention: out is NULL");
  double s = 0;
  MOE_CHECK(attn_check(ctx, "attention", q, k, v, scale, &s));
  moe_tensor *o = NULL, *lse = NULL, *od = NULL;
  MOE_CHECK(moe_attention_forward(ctx, q, k, v, causal, s, &o, &lse));
  moe_status st = MOE_OK;
  /* the output is saved detached: a saved tensor holding its own node
   * would make a cycle that outlives an unused graph */
  if (moe_grad_wanted(ctx, 3, (const moe_tensor *[]){q, k, v})) st = moe_detach(ctx, o, &od);
  if (st == MOE_OK)
    st = moe_record(ctx, &(moe_record_spec){
        .op = MOE_OP_ATTENTION, .backward = attention_backward_fn, .n_in = 3, .in = {q, k, v},
        .n_save = 5, .save = {q, k, v, od, lse}, .iargs = {causal}, .dargs = {s}}, 1, &o);
  else
    moe_tensor_release(o);
  moe_tensor_release(od);
  moe_tensor_release(lse);
  MOE_CHECK(st);
  *out = o;
  return MOE_OK;
}
