/*
 * experts.c - expert computation over a routing plan (core/moe_experts.h):
 * moe_parallel_linear and the fused GLU expert MLP moe_glu_experts, CPU
 * reference loops here, CUDA kernels in kernels/experts.cu
 * (core/experts_cuda.h). The matrix products come from the grouped GEMM
 * (moe_grouped.h) or the block-sparse products (moe_blocksparse.h); the
 * gather and the weighted scatter from moe_routing_permute / _combine.
 *
 * parallel_linear records ONE node (MOE_OP_PARALLEL_LINEAR, pl_backward):
 * it saves x, w and gates, never the permuted tokens (gather) or the
 * product's rows (scatter): the backward permutes again and forms the gate
 * gradient from dX0 = dout_rows W^T, which it needs anyway (the GLU's
 * scheme below). Its products are the GLU experts': with scatter and no
 * gather the forward's product and combine are one kernel where it scatters
 * (top-1), and with MOE_BSMM_GATHER=1 the kernels read token rows in place.
 *
 * glu_experts records ONE node (MOE_OP_GLU_EXPERTS) with its own backward:
 * it saves x, the weights and gates (the caller holds those anyway), the
 * pre-activations h1 = xs W1 and h3 = xs W3; a = act(h1) * h3 is recomputed
 * in the backward's fused pass (rounded as the forward stored it: the same
 * bits as saving it, for one hidden-sized tensor less). With
 * memory_optimized the backward's weight gradients dW1, dW3 read x's rows
 * in place where the kernels gather (MOE_BSMM_GATHER=wgrad's choice). The
 * permuted tokens xs = permute(x) (k times x) are not saved but gathered
 * again; with MOE_BSMM_GATHER=1 on sm_90a in bf16 neither path makes them
 * at all: the wgmma kernels read the rows of x and dout in token order
 * (moe_bsmm_*_gather, ex_gg_gather; same bits, slower today, so off by
 * default), and with MOE_BSMM_GATHER=wgrad only the weight gradients'
 * products do, so the backward's peak holds no permuted copy. With
 * MOE_BSMM_GLU=1 on that kernel (bf16, sm_90a) the sparse forward makes
 * h1, h3 and a in one launch (moe_bsmm_sdd_glu: the epilogue computes a
 * from the rounded h1 and h3), and the grouped one likewise
 * (moe_cuda_wg_grouped_glu), its backward doing the fused pass in the
 * epilogue of dA0's product (moe_cuda_wg_grouped_glu_bwd); same bits but for
 * the grouped gates' gradient, slower today, so off by default.
 * y = a W2 is never kept: the gate gradient is
 * dot(dout_t, y_r) = dot(dout_t W2^T, a_r), formed from the ungated
 * dA0 = dout_rows W2^T the backward needs anyway. Backward:
 *   dout_rows = permute(dout)              (R, d)
 *   dA0 = dout_rows W2^T                   (R, f) or sparse (nnz, b, b)
 *   fused pass: dgate_r = <dA0_r, a_r>, da = g_r dA0, dh1 = da h3 act'(h1),
 *               dh3 = da act(h1), ga = g_r a
 *   dW2 = ga^T dout_rows, dxs = dh1 W1^T + dh3 W3^T (sparse: one kernel,
 *   moe_bsmm_dsd_sum), dx = combine(dxs) (grouped: combine(dh1 W1^T) +
 *   combine(dh3 W3^T)),
 *   dW1 = xs^T dh1, dW3 = xs^T dh3, dgates[a] = dgate_rows[dest[a]].
 * In a backward that frees the graph (no retain_graph) the fused pass writes
 * dh3 over h3 and ga over h1, and xs is made
 * only after dxs was combined (grouped: each product combined on its own):
 * the peak holds one (R, d) buffer, not two or three.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "blocksparse_cuda.h"
#include "experts_cuda.h"
#include "internal.h"
#include "moe_quantize.h"
#include "moe_routing.h"
#include "quantize_cuda.h"

/* ------------------------------------------------------------- helpers */

static bool ex_cuda(const moe_tensor *t) { return t->storage->device.type == MOE_DEVICE_CUDA; }

static moe_status ex_check_float(moe_ctx *ctx, const char *fn, const char *what,
                                 const moe_tensor *t) {
  if (t->dtype != MOE_F32 && t->dtype != MOE_F64 && t->dtype != MOE_BF16)
    return moe_error(ctx, MOE_ERR_DTYPE, "%s: %s must be f32, f64 or bf16, got %s", fn, what,
                     moe_dtype_name(t->dtype));
  if (t->dtype == MOE_F64 && ex_cuda(t))
    return moe_error(ctx, MOE_ERR_DTYPE, "%s: %s is f64 on CUDA: f64 is CPU-only (use f32 or bf16)",
                     fn, what);
  return MOE_OK;
}

static moe_status ex_check_device(moe_ctx *ctx, const char *fn, const char *what,
                                  const moe_tensor *t, moe_device d) {
  return moe_check_same_device(ctx, fn, what, t->storage->device, "the plan", d);
}

/* t (a weight) has x's dtype. */
static moe_status ex_check_same_dtype(moe_ctx *ctx, const char *fn, const char *what,
                                      const moe_tensor *t, const moe_tensor *x) {
  return moe_check_same_dtype(ctx, fn, what, t->dtype, "x", x->dtype);
}

/* The plan's host row offsets of its local experts (the one host sync). */
static moe_status ex_offsets(moe_ctx *ctx, moe_routing_plan *p, const int64_t **offs,
                             int64_t *groups) {
  MOE_CHECK(moe_routing_plan_counts_to_host(ctx, p));
  *offs = p->row_offsets_host + p->e0;
  *groups = p->e1 - p->e0;
  return MOE_OK;
}

/* The plan's offsets of the local experts as a tensor on its device, when
 * the grouped products of G = e1 - e0 groups, depth K and N columns read
 * them there (moe_grouped_offsets_on_device: the sm_90a kernel, no host
 * copy); else false and the caller takes ex_offsets. */
static bool ex_dev_offsets(moe_ctx *ctx, moe_routing_plan *p, moe_dtype dt, int64_t K, int64_t N,
                           moe_tensor **offs) {
  int64_t G = p->e1 - p->e0;
  if (!p->row_offsets || !moe_grouped_offsets_on_device(ctx, p->device, dt, G, K, N)) return false;
  return moe_narrow(ctx, p->row_offsets, 0, p->e0, G + 1, offs) == MOE_OK;
}

/* Whether the grouped GLU experts' products do the activation passes in
 * their epilogues (moe_cuda_wg_grouped_glu / _glu_bwd, MOE_BSMM_GLU=1): the
 * sm_90a grouped GEMM with the offsets on the device for the experts'
 * sizes (d, f) both ways; *offs then holds them. */
static bool ex_gg_glu_fuses(moe_ctx *ctx, moe_routing_plan *p, moe_dtype dt, int64_t d, int64_t f,
                            moe_tensor **offs) {
  int64_t G = p->e1 - p->e0;
  if (!ctx->knobs.bsmm_glu || !moe_grouped_offsets_on_device(ctx, p->device, dt, G, f, d)) return false;
  return ex_dev_offsets(ctx, p, dt, d, f, offs);
}

/* Whether the data of n tensors (NULL entries skipped) are 16-byte aligned,
 * as the fused kernels need. */
static bool ex_aligned16(moe_tensor *const *t, int n) {
  uintptr_t bits = 0;
  for (int i = 0; i < n; i++)
    if (t[i]) bits |= (uintptr_t)moe_tensor_data(t[i]);
  return !(bits & 15);
}

/* The grouped products over the plan's groups, the offsets read where they
 * are when possible: out = grouped_mm(a, b) (trans_w as given), or with
 * wgrad out (G, K, N) = a^T b per group (grouped_mm_wgrad). */
static moe_status ex_grouped(moe_ctx *ctx, moe_tensor *a, moe_tensor *b, moe_routing_plan *p,
                             bool wgrad, bool trans_w, moe_tensor **out) {
  int64_t N = wgrad ? b->shape[1] : trans_w ? b->shape[1] : b->shape[2];
  moe_tensor *offs = NULL;
  if (ex_dev_offsets(ctx, p, a->dtype, a->shape[1], N, &offs)) {
    moe_status st = wgrad ? moe_grouped_mm_wgrad_dev(ctx, a, b, offs, false, out)
                          : moe_grouped_mm_dev(ctx, a, b, offs, trans_w, out);
    moe_tensor_release(offs);
    return st;
  }
  const int64_t *ho;
  int64_t G;
  MOE_CHECK(ex_offsets(ctx, p, &ho, &G));
  return wgrad ? moe_grouped_mm_wgrad(ctx, a, b, ho, G, false, out)
               : moe_grouped_mm(ctx, a, b, ho, G, trans_w, out);
}

/* h1 = xs W1, h3 = xs W3 and a = act(h1) * h3 from one kernel
 * (moe_cuda_wg_grouped_glu; ex_gg_glu_fuses held and gave offs). With an
 * unaligned operand: the two products, and *a stays NULL for the pass. */
static moe_status ex_gg_glu(moe_ctx *ctx, moe_tensor *xs, moe_tensor *w1, moe_tensor *w3,
                            moe_tensor *offs, moe_routing_plan *p, int act, moe_tensor **h1,
                            moe_tensor **h3, moe_tensor **a) {
  moe_tensor *in[3] = {xs, w1, w3}, *o[3] = {0};
  if (!ex_aligned16(in, 3) || !moe_tensor_is_contiguous(xs)) {
    MOE_CHECK(ex_grouped(ctx, xs, w1, p, false, false, h1));
    return ex_grouped(ctx, xs, w3, p, false, false, h3);
  }
  moe_status st = MOE_OK;
  int64_t R = p->rows, d = w1->shape[1], f = w1->shape[2];
  for (int i = 0; i < 3; i++)
    MOE_CHECK_GOTO(moe_tensor_empty(ctx, 2, (int64_t[]){R, f}, xs->dtype, p->device, &o[i]), st, done);
  MOE_CHECK_GOTO(moe_cuda_wg_grouped_glu(ctx, p->device.index, moe_tensor_data(xs), moe_tensor_data(w1),
                                         moe_tensor_data(w3), (const int64_t *)moe_tensor_data(offs),
                                         p->e1 - p->e0, R, d, f, act, moe_tensor_data(o[0]),
                                         moe_tensor_data(o[1]), moe_tensor_data(o[2])),
                 st, done);
  *h1 = o[0], *h3 = o[1], *a = o[2];
  o[0] = o[1] = o[2] = NULL;
done:
  for (int i = 0; i < 3; i++) moe_tensor_release(o[i]);
  return st;
}

static moe_status ex_check_sparse_plan(moe_ctx *ctx, const char *fn, const moe_routing_plan *p) {
  if (p->block_size <= 0 || p->ffn_blocks <= 0 || !p->bs_row_indices)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "%s: impl sparse needs a plan padded with ffn_hidden (block_size and "
                     "ffn_hidden options); this plan has block_size %lld and no topology",
                     fn, (long long)p->block_size);
  return MOE_OK;
}

/* --------------------------------------------------- CPU elementwise */

static inline double ex_ld(const void *p, moe_dtype dt, int64_t i) {
  switch (dt) {
    case MOE_F64: return ((const double *)p)[i];
    case MOE_F32: return ((const float *)p)[i];
    default: return moe_bf16_to_f32(((const moe_bf16 *)p)[i]);
  }
}

static inline void ex_st(void *p, moe_dtype dt, int64_t i, double v) {
  switch (dt) {
    case MOE_F64: ((double *)p)[i] = v; break;
    case MOE_F32: ((float *)p)[i] = (float)v; break;
    default: ((moe_bf16 *)p)[i] = moe_f32_to_bf16((float)v); break;
  }
}

/* act(v) and act'(v). */
static inline void ex_act(int act, double v, double *f, double *df) {
  if (act == MOE_GLU_SILU) {
    double s = 1.0 / (1.0 + exp(-v));
    *f = v * s;
    *df = s * (1.0 + v * (1.0 - s));
  } else if (act == MOE_GLU_GELU) {
    double c = 0.5 * (1.0 + erf(v * 0.70710678118654752440));
    *f = v * c;
    *df = c + v * exp(-0.5 * v * v) * 0.39894228040143267794;
  } else {
    const double k0 = 0.79788456080286535588, k1 = 0.044715;
    double t = tanh(k0 * (v + k1 * v * v * v));
    *f = 0.5 * v * (1.0 + t);
    *df = 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * k0 * (1.0 + 3.0 * k1 * v * v);
  }
}

/* Element offset of (r, c) in a hidden of layout bs (experts_cuda.h). */
static inline int64_t ex_hidx(int64_t r, int64_t c, int64_t f, int64_t bs) {
  if (bs == 0) return r * f + c;
  int64_t F = f / bs;
  return ((r / bs) * F + c / bs) * bs * bs + (r % bs) * bs + c % bs;
}

/* a = act(h1) * h3, contiguous, h1's shape and dtype. */
static moe_status ex_glu_fwd(moe_ctx *ctx, moe_tensor *h1, moe_tensor *h3, int act,
                             moe_tensor **out) {
  moe_tensor *a;
  MOE_CHECK(moe_tensor_empty(ctx, h1->ndim, h1->shape, h1->dtype, h1->storage->device, &a));
  int64_t n = moe_tensor_numel(h1);
  moe_status st = MOE_OK;
  if (n > 0 && ex_cuda(h1)) {
    st = moe_cuda_experts_glu_fwd(ctx, h1->storage->device.index, h1->dtype, act, n,
                                  moe_tensor_data(h1), moe_tensor_data(h3), moe_tensor_data(a));
  } else {
    const void *p1 = moe_tensor_data(h1), *p3 = moe_tensor_data(h3);
    void *pa = moe_tensor_data(a);
    for (int64_t i = 0; i < n; i++) {
      double f, df;
      ex_act(act, ex_ld(p1, h1->dtype, i), &f, &df);
      ex_st(pa, a->dtype, i, f * ex_ld(p3, h3->dtype, i));
    }
  }
  if (st != MOE_OK) {
    moe_tensor_release(a);
    return st;
  }
  *out = a;
  return MOE_OK;
}

/* out (n) of out_dt = idx[i] >= 0 ? in[idx[i]] : 0; in and idx contiguous. */
static moe_status ex_take(moe_ctx *ctx, moe_tensor *in, moe_tensor *idx, moe_dtype out_dt,
                          moe_tensor **out) {
  int64_t n = moe_tensor_numel(idx);
  moe_tensor *r;
  MOE_CHECK(moe_tensor_empty(ctx, 1, &n, out_dt, idx->storage->device, &r));
  moe_status st = MOE_OK;
  if (n > 0 && ex_cuda(idx)) {
    st = moe_cuda_experts_take(ctx, idx->storage->device.index, n,
                               (const int64_t *)moe_tensor_data(idx), moe_tensor_data(in),
                               in->dtype, moe_tensor_data(r), out_dt);
  } else {
    const int64_t *ip = (const int64_t *)moe_tensor_data(idx);
    const void *src = moe_tensor_data(in);
    void *dst = moe_tensor_data(r);
    for (int64_t i = 0; i < n; i++)
      ex_st(dst, out_dt, i, ip[i] >= 0 ? ex_ld(src, in->dtype, ip[i]) : 0.0);
  }
  if (st != MOE_OK) {
    moe_tensor_release(r);
    return st;
  }
  *out = r;
  return MOE_OK;
}

/* v rounded to dt (what ex_st stores, read back). */
static inline double ex_rnd(moe_dtype dt, double v) {
  double buf;
  ex_st(&buf, dt, 0, v);
  return ex_ld(&buf, dt, 0);
}

/* The fused backward pass of experts_cuda.h on the CPU (any float dtype;
 * g_rows and dgate_rows of dtype gdt); a = act(h1) * h3 recomputed and
 * rounded as the forward stored it. */
static void ex_glu_bwd_cpu(moe_dtype dt, moe_dtype gdt, int act, int64_t R, int64_t f, int64_t bs,
                           void *dA0, const void *h1, const void *h3, const void *g_rows,
                           void *dh3, void *ga, void *dgate_rows) {
  for (int64_t r = 0; r < R; r++) {
    double g = g_rows ? ex_ld(g_rows, gdt, r) : 1.0, dot = 0.0;
    for (int64_t c = 0; c < f; c++) {
      int64_t i = ex_hidx(r, c, f, bs);
      double v1 = ex_ld(h1, dt, i), v3 = ex_ld(h3, dt, i), d0 = ex_ld(dA0, dt, i);
      double fa, dfa;
      ex_act(act, v1, &fa, &dfa);
      double av = ex_rnd(dt, fa * v3);
      dot += d0 * av;
      double da = g * d0;
      ex_st(dA0, dt, i, da * v3 * dfa);
      ex_st(dh3, dt, i, da * fa);
      if (ga) ex_st(ga, dt, i, g * av);
    }
    if (dgate_rows) ex_st(dgate_rows, gdt, r, dot);
  }
}

/* ---------------------------------------------------------- glu_experts */

/* Saved slots of the node. With quantization, slots H1 and H3 hold the codes
 * of h1 and h3 and their scales follow (EX_SAVED_S1, EX_SAVED_S3). */
enum { EX_SAVED_X = 0, EX_SAVED_W1, EX_SAVED_W3, EX_SAVED_W2, EX_SAVED_H1, EX_SAVED_H3,
       EX_SAVED_S1, EX_SAVED_S3 };
/* iargs: 0 impl, 1 activation, 2 slot of gates (-1), 3 memory_optimized
 * (1: the backward's dW1 and dW3 read x's rows in place where the kernels
 * gather, as with MOE_BSMM_GATHER=wgrad), 4 quantization bits (0: h1 and h3
 * saved as they are), 5 group size */

/* Whether the CUDA passes that quantize in the activation and read the codes
 * in backward are used (the knob glu_qfused, MOE_GLU_QFUSED=0 turns them off:
 * the forward then runs the activation and two moe_quantize calls, the
 * backward dequantizes h1 and h3 first; the same bits either way, for checks
 * and A/B timings). */
static bool ex_qfused(const moe_ctx *ctx) { return ctx->knobs.glu_qfused; }

static void ex_plan_release_void(void *p) { moe_routing_plan_release((moe_routing_plan *)p); }

/* xs (R, K) times the per-expert w with impl: grouped (dense out) or sparse
 * (SDD, out (nnz, b, b)). */
static moe_status ex_mm_sdd(moe_ctx *ctx, moe_experts_impl impl, moe_tensor *xs, moe_tensor *w,
                            moe_routing_plan *p, bool trans_w, moe_tensor **out) {
  if (impl == MOE_EXPERTS_SPARSE) return moe_bsmm_sdd(ctx, xs, w, p, trans_w, out);
  return ex_grouped(ctx, xs, w, p, false, trans_w, out);
}

/* hidden (R, f) or sparse (nnz, b, b) times w -> (R, N) dense. */
static moe_status ex_mm_dsd(moe_ctx *ctx, moe_experts_impl impl, moe_tensor *h, moe_tensor *w,
                            moe_routing_plan *p, bool trans_w, moe_tensor **out) {
  if (impl == MOE_EXPERTS_SPARSE) return moe_bsmm_dsd(ctx, h, w, p, trans_w, out);
  return ex_grouped(ctx, h, w, p, false, trans_w, out);
}

/* The weight gradient (E_loc, K, N) = xs^T h per expert, xs (R, K) dense,
 * h the hidden (dense (R, N) or sparse). */
static moe_status ex_wgrad_in(moe_ctx *ctx, moe_experts_impl impl, moe_tensor *xs, moe_tensor *h,
                              moe_routing_plan *p, moe_tensor **out) {
  if (impl == MOE_EXPERTS_SPARSE) return moe_bsmm_dds(ctx, xs, h, p, out);
  return ex_grouped(ctx, xs, h, p, true, false, out);
}

/* The weight gradient (E_loc, f, d) = h^T dy per expert, h the hidden. */
static moe_status ex_wgrad_out(moe_ctx *ctx, moe_experts_impl impl, moe_tensor *h, moe_tensor *dy,
                               moe_routing_plan *p, moe_tensor **out) {
  if (impl == MOE_EXPERTS_SPARSE) return moe_bsmm_dsd_t(ctx, h, dy, p, out);
  return ex_grouped(ctx, h, dy, p, true, false, out);
}

/* Whether the products can read the token rows in place (the sm_90a kernel
 * gathers them) instead of a permuted copy: the sparse ones where
 * moe_bsmm_gathers, the grouped ones (d, f: the experts' sizes) where both
 * directions read their offsets on the device. */
static bool ex_gather_able(moe_ctx *ctx, moe_experts_impl impl, moe_routing_plan *p, moe_dtype dt,
                           int64_t d, int64_t f) {
  if (impl == MOE_EXPERTS_SPARSE) return moe_bsmm_gathers(ctx, p, dt);
  int64_t G = p->e1 - p->e0;
  return p->row_offsets && p->src && moe_grouped_offsets_on_device(ctx, p->device, dt, G, d, f) &&
         moe_grouped_offsets_on_device(ctx, p->device, dt, G, f, d);
}

/* Whether they do (MOE_BSMM_GATHER): wgrad, asked for the weight
 * gradients' products, which gather with MOE_BSMM_GATHER=wgrad too (the
 * others only with 1). */
static bool ex_gather(moe_ctx *ctx, moe_experts_impl impl, moe_routing_plan *p, moe_dtype dt,
                      int64_t d, int64_t f, bool wgrad) {
  int k = ctx->knobs.bsmm_gather;
  if (k != MOE_KNOB_BSMM_GATHER_ALL && !(wgrad && k == MOE_KNOB_BSMM_GATHER_WGRAD)) return false;
  return ex_gather_able(ctx, impl, p, dt, d, f);
}

/* The grouped products with tok's rows (T, width) gathered by the plan
 * inside the sm_90a kernel (ex_gather held): EX_GG_MM out (R, N) =
 * rows @ w[e] (trans_w as given; other = w); EX_GG_WGRAD_A out (G, width,
 * N) = rows^T other per expert (other (R, N)); EX_GG_WGRAD_B out (G, K,
 * width) = other^T rows (other (R, K)). An unaligned operand takes the
 * permuted copy instead. */
enum { EX_GG_MM, EX_GG_WGRAD_A, EX_GG_WGRAD_B };
static moe_status ex_gg_gather(moe_ctx *ctx, int kind, moe_tensor *tok, moe_tensor *other,
                               moe_routing_plan *p, bool trans_w, moe_tensor **out) {
  moe_status st = MOE_OK;
  moe_tensor *tc = NULL, *oc = NULL, *offs = NULL, *r = NULL, *xs = NULL;
  int64_t G = p->e1 - p->e0, R = p->rows, W = tok->shape[1];
  int64_t shape[3] = {R, 0, 0};
  int nd = 2;
  if (kind == EX_GG_MM) shape[1] = trans_w ? other->shape[1] : other->shape[2];
  else nd = 3, shape[0] = G, shape[1] = kind == EX_GG_WGRAD_A ? W : other->shape[1],
       shape[2] = kind == EX_GG_WGRAD_A ? other->shape[1] : W;
  MOE_CHECK_GOTO(moe_contiguous(ctx, tok, &tc), st, done);
  MOE_CHECK_GOTO(moe_contiguous(ctx, other, &oc), st, done);
  MOE_CHECK_GOTO(moe_narrow(ctx, p->row_offsets, 0, p->e0, G + 1, &offs), st, done);
  MOE_CHECK_GOTO(moe_tensor_empty(ctx, nd, shape, tok->dtype, p->device, &r), st, done);
  const void *td = moe_tensor_data(tc), *od = moe_tensor_data(oc);
  if (!(((uintptr_t)td | (uintptr_t)od | (uintptr_t)moe_tensor_data(r)) & 15) &&
      moe_tensor_is_contiguous(p->src)) {
    moe_wg_gather gt = {(const int64_t *)moe_tensor_data(p->src), p->k, kind == EX_GG_WGRAD_B};
    const int64_t *o = (const int64_t *)moe_tensor_data(offs);
    int dev = p->device.index;
    if (kind == EX_GG_MM)
      st = moe_cuda_wg_grouped_mm_gather(ctx, dev, td, od, NULL, NULL, o, &gt, NULL, G, R, W, shape[1],
                                         trans_w, moe_tensor_data(r));
    else
      st = moe_cuda_wg_grouped_wgrad_gather(ctx, dev, kind == EX_GG_WGRAD_A ? td : od,
                                            kind == EX_GG_WGRAD_A ? od : td, o, &gt, G, R, shape[1],
                                            shape[2], moe_tensor_data(r));
    if (st == MOE_OK) *out = r, r = NULL;
    goto done;
  }
  /* the permuted copy */
  MOE_CHECK_GOTO(moe_routing_permute(ctx, tc, p, &xs), st, done);
  if (kind == EX_GG_MM) st = ex_grouped(ctx, xs, oc, p, false, trans_w, out);
  else if (kind == EX_GG_WGRAD_A) st = ex_grouped(ctx, xs, oc, p, true, false, out);
  else st = ex_grouped(ctx, oc, xs, p, true, false, out);
done:
  moe_tensor_release(tc), moe_tensor_release(oc), moe_tensor_release(offs);
  moe_tensor_release(r), moe_tensor_release(xs);
  return st;
}

/* The grouped products' rows combined into token order, the offsets on the
 * device (offs): out = moe_routing_combine(a @ w [+ a2 @ w2], p, gates),
 * gates (T, k) or NULL. Where moe_bsmm_scatters, the sm_90a kernel's
 * epilogue writes each row where the combine would put it, scaled by its
 * gate (moe_wg_scatter): no (R, N) product, no combine pass, the same bits. */
static moe_status ex_gg_combine(moe_ctx *ctx, moe_tensor *a, moe_tensor *w, moe_tensor *a2,
                                moe_tensor *w2, moe_tensor *offs, moe_routing_plan *p, bool trans_w,
                                moe_tensor *gates, moe_tensor **out) {
  moe_status st = MOE_OK;
  moe_tensor *c[5] = {0}, *r = NULL, *gf = NULL, *gc = NULL, *rows = NULL;
  int64_t G = p->e1 - p->e0, R = p->rows, K = a->shape[1], N = trans_w ? w->shape[1] : w->shape[2];
  if (moe_bsmm_scatters(ctx, p, a->dtype)) {
    moe_tensor *in[4] = {a, w, a2, w2};
    uintptr_t bits = 0;
    for (int i = 0; i < 4; i++)
      if (in[i]) {
        MOE_CHECK_GOTO(moe_contiguous(ctx, in[i], &c[i]), st, done);
        bits |= (uintptr_t)moe_tensor_data(c[i]);
      }
    MOE_CHECK_GOTO(moe_contiguous(ctx, offs, &c[4]), st, done);
    MOE_CHECK_GOTO(moe_tensor_empty(ctx, 2, (int64_t[]){p->T, N}, a->dtype, p->device, &r), st, done);
    if (gates) {
      MOE_CHECK_GOTO(moe_to(ctx, gates, MOE_F32, p->device, &gf), st, done);
      MOE_CHECK_GOTO(moe_contiguous(ctx, gf, &gc), st, done);
    }
    if (!((bits | (uintptr_t)moe_tensor_data(r)) & 15)) {
      moe_wg_scatter sc = {(const int64_t *)moe_tensor_data(p->src),
                           gc ? (const float *)moe_tensor_data(gc) : NULL};
      st = moe_cuda_wg_grouped_mm_gather(
          ctx, p->device.index, moe_tensor_data(c[0]), moe_tensor_data(c[1]),
          c[2] ? moe_tensor_data(c[2]) : NULL, c[3] ? moe_tensor_data(c[3]) : NULL,
          (const int64_t *)moe_tensor_data(c[4]), NULL, &sc, G, R, K, N, trans_w, moe_tensor_data(r));
      if (st == MOE_OK) *out = r, r = NULL;
      goto done;
    }
  }
  if (a2) MOE_CHECK_GOTO(moe_grouped_mm_sum_dev(ctx, a, w, a2, w2, offs, trans_w, &rows), st, done);
  else MOE_CHECK_GOTO(moe_grouped_mm_dev(ctx, a, w, offs, trans_w, &rows), st, done);
  st = moe_routing_combine(ctx, rows, p, gates, out);
done:
  for (int i = 0; i < 5; i++) moe_tensor_release(c[i]);
  moe_tensor_release(r), moe_tensor_release(gf), moe_tensor_release(gc), moe_tensor_release(rows);
  return st;
}

/* The rows a @ w (w transposed with trans_w) combined into token order with
 * gates (NULL: ones): moe_bsmm_dsd_combine (sparse, a the hidden),
 * ex_gg_combine (grouped, offsets on the device), else the grouped product
 * and moe_routing_combine. */
static moe_status ex_combine(moe_ctx *ctx, moe_experts_impl impl, moe_tensor *a, moe_tensor *w,
                             moe_routing_plan *p, bool trans_w, moe_tensor *gates, moe_tensor **out) {
  if (impl == MOE_EXPERTS_SPARSE) return moe_bsmm_dsd_combine(ctx, a, w, NULL, NULL, p, trans_w, gates, out);
  moe_tensor *offs = NULL, *y = NULL;
  moe_status st;
  if (ex_dev_offsets(ctx, p, a->dtype, a->shape[1], trans_w ? w->shape[1] : w->shape[2], &offs)) {
    st = ex_gg_combine(ctx, a, w, NULL, NULL, offs, p, trans_w, gates, out);
    moe_tensor_release(offs);
    return st;
  }
  MOE_CHECK(ex_mm_dsd(ctx, impl, a, w, p, trans_w, &y));
  st = moe_routing_combine(ctx, y, p, gates, out);
  moe_tensor_release(y);
  return st;
}

/* ex_wgrad_in with x's rows gathered (x (T, K) in token order). */
static moe_status ex_wgrad_in_gather(moe_ctx *ctx, moe_experts_impl impl, moe_tensor *x, moe_tensor *h,
                                     moe_routing_plan *p, moe_tensor **out) {
  if (impl == MOE_EXPERTS_SPARSE) return moe_bsmm_dds_gather(ctx, x, h, p, out);
  return ex_gg_gather(ctx, EX_GG_WGRAD_A, x, h, p, false, out);
}

/* ------------------------------------------------------ parallel_linear */

moe_parallel_linear_opts moe_parallel_linear_opts_default(void) {
  moe_parallel_linear_opts o;
  memset(&o, 0, sizeof o);
  o.impl = MOE_EXPERTS_GROUPED;
  return o;
}

static moe_status pl_validate(moe_ctx *ctx, moe_tensor *x, moe_tensor *w, moe_routing_plan *plan,
                              moe_parallel_linear_opts o) {
  const char *fn = "parallel_linear";
  if (o.impl != MOE_EXPERTS_GROUPED && o.impl != MOE_EXPERTS_SPARSE)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: unknown impl %d", fn, (int)o.impl);
  MOE_CHECK(ex_check_float(ctx, fn, "x", x));
  MOE_CHECK(ex_check_same_dtype(ctx, fn, "w", w, x));
  MOE_CHECK(ex_check_device(ctx, fn, "x", x, plan->device));
  MOE_CHECK(ex_check_device(ctx, fn, "w", w, plan->device));
  int64_t E_loc = plan->e1 - plan->e0;
  if (w->ndim != 3 || w->shape[0] != E_loc)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: w must be (E_loc, %s) with the plan's E_loc = %lld "
                     "local experts, got %s", fn, o.trans_w ? "N, K" : "K, N", (long long)E_loc,
                     MOE_SHAPE(w));
  int64_t K = o.trans_w ? w->shape[2] : w->shape[1];
  int64_t N = o.trans_w ? w->shape[1] : w->shape[2];
  if (o.gates && !o.scatter)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: gates are given but scatter is off", fn);
  if (o.gates) {
    MOE_CHECK(ex_check_float(ctx, fn, "gates", o.gates));
    MOE_CHECK(ex_check_device(ctx, fn, "gates", o.gates, plan->device));
    if (o.gates->ndim != 2 || o.gates->shape[0] != plan->T || o.gates->shape[1] != plan->k)
      return moe_error(ctx, MOE_ERR_SHAPE, "%s: gates must be the plan's (T, k) = (%lld, %lld), got %s",
                       fn, (long long)plan->T, (long long)plan->k, MOE_SHAPE(o.gates));
  }
  bool sparse_in = o.impl == MOE_EXPERTS_SPARSE && x->ndim == 3;
  int64_t nb = plan->ffn_blocks * plan->block_size; /* the sparse width */
  if (o.impl == MOE_EXPERTS_SPARSE) {
    MOE_CHECK(ex_check_sparse_plan(ctx, fn, plan));
    if (x->ndim != 2 && x->ndim != 3)
      return moe_error(ctx, MOE_ERR_SHAPE, "%s: impl sparse takes a dense 2-D x or a sparse "
                       "(nnz, b, b) x, got %s", fn, MOE_SHAPE(x));
    if (sparse_in && o.gather)
      return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: gather needs a dense x (T, K), got the "
                       "sparse %s", fn, MOE_SHAPE(x));
    if (!sparse_in && o.scatter)
      return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: scatter of a block-sparse (SDD) output is "
                       "not defined: the dense x %s gives a sparse hidden", fn,
                       MOE_SHAPE(x));
    if (sparse_in) {
      int64_t b = plan->block_size;
      if (x->shape[0] != plan->nnz || x->shape[1] != b || x->shape[2] != b)
        return moe_error(ctx, MOE_ERR_SHAPE, "%s: sparse x must be the plan's (nnz, b, b) = "
                         "(%lld, %lld, %lld), got %s", fn, (long long)plan->nnz, (long long)b,
                         (long long)b, MOE_SHAPE(x));
      if (K != nb)
        return moe_error(ctx, MOE_ERR_SHAPE, "%s: w %s must have K = ffn_hidden = %lld for a "
                         "sparse x", fn, MOE_SHAPE(w), (long long)nb);
    } else if (N != nb) {
      return moe_error(ctx, MOE_ERR_SHAPE, "%s: w %s must have N = ffn_hidden = %lld for impl "
                       "sparse (the plan's topology)", fn, MOE_SHAPE(w),
                       (long long)nb);
    }
  } else if (x->ndim != 2) {
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: x must be 2-D (%s, K), got %s", fn,
                     o.gather ? "T" : "R", MOE_SHAPE(x));
  }
  if (!sparse_in) {
    int64_t rows = o.gather ? plan->T : plan->rows;
    if (x->shape[0] != rows || x->shape[1] != K)
      return moe_error(ctx, MOE_ERR_SHAPE, "%s: x must be (%s, K) = (%lld, %lld) for w %s%s, got %s",
                       fn, o.gather ? "T" : "R", (long long)rows, (long long)K,
                       MOE_SHAPE(w), o.trans_w ? " (trans_w)" : "",
                       MOE_SHAPE(x));
  }
  return MOE_OK;
}

/* The gate's backward pass of a linear's rows on the CPU (experts_cuda.h's
 * moe_cuda_experts_gate_rows; any float dtype, g_rows and dgate_rows of
 * dtype gdt). */
static void ex_gate_rows_cpu(moe_dtype dt, moe_dtype gdt, int64_t R, int64_t K, int64_t bs, void *dX0,
                             const void *xs, const int64_t *src, int64_t k, const void *g_rows,
                             void *gxs, void *ys, int64_t N, void *dgate_rows) {
  for (int64_t r = 0; r < R; r++) {
    double g = g_rows ? ex_ld(g_rows, gdt, r) : 1.0, dot = 0.0;
    int64_t xrow = src ? (src[r] >= 0 ? src[r] / k : -1) : 0;
    for (int64_t c = 0; c < K; c++) {
      int64_t i = ex_hidx(r, c, K, bs);
      double xv = !src ? ex_ld(xs, dt, i) : xrow >= 0 ? ex_ld(xs, dt, xrow * K + c) : 0.0;
      if (dX0) {
        double d0 = ex_ld(dX0, dt, i);
        dot += d0 * xv;
        ex_st(dX0, dt, i, g * d0);
      }
      if (gxs) ex_st(gxs, dt, i, g * xv);
    }
    for (int64_t c = 0; ys && c < N; c++) ex_st(ys, dt, r * N + c, g * ex_ld(ys, dt, r * N + c));
    if (dgate_rows) ex_st(dgate_rows, gdt, r, dot);
  }
}

/* iargs of the parallel_linear node: 0 impl, 1 trans_w, 2 gather,
 * 3 scatter, 4 slot of the gates (-1: none), 5 memory_optimized. Saved: x,
 * w (contiguous), gates. */
enum { PL_SAVED_X = 0, PL_SAVED_W, PL_SAVED_G };

/* rows = (gather ? permute(x) : x) @ w over the plan: the kernels gather x's
 * rows where ex_gather holds (N, K: w's sizes). */
static moe_status pl_rows(moe_ctx *ctx, moe_experts_impl impl, moe_tensor *x, moe_tensor *w,
                          moe_routing_plan *p, bool trans_w, bool gather, int64_t K, int64_t N,
                          moe_tensor **out) {
  bool sparse_in = impl == MOE_EXPERTS_SPARSE && x->ndim == 3;
  if (gather && ex_gather(ctx, impl, p, x->dtype, K, N, false)) {
    if (impl == MOE_EXPERTS_SPARSE) return moe_bsmm_sdd_gather(ctx, x, w, p, trans_w, out);
    return ex_gg_gather(ctx, EX_GG_MM, x, w, p, trans_w, out);
  }
  moe_tensor *xs = NULL;
  if (gather) MOE_CHECK(moe_routing_permute(ctx, x, p, &xs));
  else moe_tensor_retain(xs = x);
  moe_status st = sparse_in ? moe_bsmm_dsd(ctx, xs, w, p, trans_w, out)
                            : ex_mm_sdd(ctx, impl, xs, w, p, trans_w, out);
  moe_tensor_release(xs);
  return st;
}

/*
 * Backward of out = scatter(rows(x) W, gates), with xs the rows of x (x
 * itself, or its permuted tokens with gather), drows the rows of dout
 * (permuted with scatter) and g the rows' gates (1 without gates):
 *   dX0 = drows W^T                        (the rows of dx, ungated)
 *   with gates: dgate_r = <dX0_r, xs_r>, dX0_r *= g_r, and drows_r *= g_r
 *               in place (or gxs = g xs where the kernels read dout's rows
 *               in place): one pass, moe_cuda_experts_gate_rows
 *   dx = gather ? combine(dX0) : dX0       (without gates and with gather:
 *                                           ex_combine, fused where it scatters)
 *   dW = xs^T drows (or gxs^T drows) per expert (transposed for trans_w)
 * Where ex_gather holds, the kernels read the token rows of x and dout in
 * place (the one not read in place is made: both at once is not a product
 * the kernels have). Neither the permuted tokens nor the product's rows are
 * saved.
 */
static moe_status pl_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout, moe_tensor **gin) {
  moe_routing_plan *p = (moe_routing_plan *)n->user;
  moe_experts_impl impl = (moe_experts_impl)n->iargs[0];
  bool trans_w = n->iargs[1], gather = n->iargs[2], scatter = n->iargs[3];
  int gslot = (int)n->iargs[4];
  if (!gout[0]) return moe_node_zero_grads(ctx, n, gin);
  bool need_x = moe_node_needs_grad(n, 0), need_w = moe_node_needs_grad(n, 1),
       need_g = gslot >= 0 && moe_node_needs_grad(n, 2);
  moe_status st = MOE_OK;
  moe_tensor *x = NULL, *w = NULL, *gates = NULL, *xc = NULL, *dout = NULL, *drows = NULL,
             *dX0 = NULL, *gc = NULL, *g_rows = NULL, *gxs = NULL, *dgate_rows = NULL, *xs = NULL,
             *dw = NULL, *dwt = NULL, *dg = NULL;
  MOE_CHECK_GOTO(moe_node_saved(ctx, n, PL_SAVED_X, &x), st, done);
  MOE_CHECK_GOTO(moe_node_saved(ctx, n, PL_SAVED_W, &w), st, done);
  if (gslot >= 0) MOE_CHECK_GOTO(moe_node_saved(ctx, n, gslot, &gates), st, done);
  moe_dtype dt = n->in_dtype[0];
  moe_dtype gdt = dt == MOE_F64 ? MOE_F64 : MOE_F32;
  moe_device dev = n->in_device[0];
  bool sparse_in = impl == MOE_EXPERTS_SPARSE && x->ndim == 3;
  int64_t K = trans_w ? w->shape[2] : w->shape[1], N = trans_w ? w->shape[1] : w->shape[2];
  int64_t R = p->rows;
  bool gated = scatter && gates; /* the gate pass runs */
  bool gath = (gather || scatter) && ex_gather(ctx, impl, p, dt, K, N, false);
  bool dk = scatter && gath; /* the kernels read dout's rows in place */
  /* the weight gradient reads x's rows in place (MOE_BSMM_GATHER 1 or
   * wgrad, or memory_optimized where the kernels gather) */
  bool gath_w = gather && (ex_gather(ctx, impl, p, dt, K, N, true) ||
                           (n->iargs[5] == 1 && ex_gather_able(ctx, impl, p, dt, K, N)));
  MOE_CHECK_GOTO(moe_contiguous(ctx, x, &xc), st, done);
  MOE_CHECK_GOTO(moe_contiguous(ctx, gout[0], &dout), st, done);
  if (!scatter) moe_tensor_retain(drows = dout);
  else if (!dk) MOE_CHECK_GOTO(moe_routing_permute(ctx, dout, p, &drows), st, done);
  /* with gather and no gate pass, dx is one product combined (fused where
   * it scatters): dX0 is not made for it */
  bool fuse_dx = need_x && gather && !gated && drows;
  if ((need_x && !fuse_dx) || (gated && need_g)) {
    if (dk && sparse_in) MOE_CHECK_GOTO(moe_bsmm_sdd_gather(ctx, dout, w, p, !trans_w, &dX0), st, done);
    else if (dk) MOE_CHECK_GOTO(ex_gg_gather(ctx, EX_GG_MM, dout, w, p, !trans_w, &dX0), st, done);
    else if (sparse_in) MOE_CHECK_GOTO(moe_bsmm_sdd(ctx, drows, w, p, !trans_w, &dX0), st, done);
    else MOE_CHECK_GOTO(ex_mm_dsd(ctx, impl, drows, w, p, !trans_w, &dX0), st, done);
  }
  if (gated) {
    int64_t bs = sparse_in ? p->block_size : 0;
    MOE_CHECK_GOTO(moe_contiguous(ctx, gates, &gc), st, done);
    MOE_CHECK_GOTO(ex_take(ctx, gc, p->src, gdt, &g_rows), st, done);
    /* the weight gradient's gate goes on drows, scaled in place (the
     * permuted copy is the backward's own), or where the kernels read dout's
     * rows in place on a copy of xs */
    if (need_w && dk) {
      if (gather) MOE_CHECK_GOTO(moe_tensor_empty(ctx, 2, (int64_t[]){R, K}, dt, dev, &gxs), st, done);
      else MOE_CHECK_GOTO(moe_tensor_empty(ctx, xc->ndim, xc->shape, dt, dev, &gxs), st, done);
    }
    if (need_g) MOE_CHECK_GOTO(moe_tensor_empty(ctx, 1, &R, gdt, dev, &dgate_rows), st, done);
    const int64_t *src = gather ? (const int64_t *)moe_tensor_data(p->src) : NULL;
    void *d0 = dX0 ? moe_tensor_data(dX0) : NULL, *gx = gxs ? moe_tensor_data(gxs) : NULL;
    void *ys = need_w && !dk ? moe_tensor_data(drows) : NULL;
    if (R > 0 && dev.type == MOE_DEVICE_CUDA)
      MOE_CHECK_GOTO(moe_cuda_experts_gate_rows(
                         ctx, dev.index, dt, R, K, bs, d0, moe_tensor_data(xc), src, p->k,
                         (const float *)moe_tensor_data(g_rows), gx, ys, N,
                         dgate_rows ? (float *)moe_tensor_data(dgate_rows) : NULL),
                     st, done);
    else if (R > 0)
      ex_gate_rows_cpu(dt, gdt, R, K, bs, d0, moe_tensor_data(xc), src, p->k, moe_tensor_data(g_rows),
                       gx, ys, N, dgate_rows ? moe_tensor_data(dgate_rows) : NULL);
  }
  if (need_x && fuse_dx) {
    MOE_CHECK_GOTO(ex_combine(ctx, impl, drows, w, p, !trans_w, NULL, &gin[0]), st, done);
  } else if (need_x && gather) {
    MOE_CHECK_GOTO(moe_routing_combine(ctx, dX0, p, NULL, &gin[0]), st, done);
  } else if (need_x) {
    moe_tensor_retain(gin[0] = dX0);
  }
  moe_tensor_release(dX0), dX0 = NULL;
  if (need_w) {
    /* the x side: gxs, x, or x's rows read in place (unless dout's are) */
    moe_tensor *a = gxs ? gxs : xc;
    bool ak = !gxs && gath_w && !dk;
    if (!gxs && gather && !ak) {
      MOE_CHECK_GOTO(moe_routing_permute(ctx, xc, p, &xs), st, done);
      a = xs;
    }
    if (impl == MOE_EXPERTS_SPARSE && sparse_in)
      st = dk ? moe_bsmm_dsd_t_gather(ctx, a, dout, p, &dw) : moe_bsmm_dsd_t(ctx, a, drows, p, &dw);
    else if (impl == MOE_EXPERTS_SPARSE)
      st = ak ? moe_bsmm_dds_gather(ctx, a, drows, p, &dw) : moe_bsmm_dds(ctx, a, drows, p, &dw);
    else if (ak)
      st = ex_gg_gather(ctx, EX_GG_WGRAD_A, a, drows, p, false, &dw);
    else if (dk)
      st = ex_gg_gather(ctx, EX_GG_WGRAD_B, dout, a, p, false, &dw);
    else
      st = ex_grouped(ctx, a, drows, p, true, false, &dw);
    if (st != MOE_OK) goto done;
    if (trans_w) {
      MOE_CHECK_GOTO(moe_transpose(ctx, dw, 1, 2, &dwt), st, done);
      MOE_CHECK_GOTO(moe_contiguous(ctx, dwt, &gin[1]), st, done);
    } else {
      moe_tensor_retain(gin[1] = dw);
    }
  }
  if (need_g) {
    MOE_CHECK_GOTO(ex_take(ctx, dgate_rows, p->dest, n->in_dtype[2], &dg), st, done);
    MOE_CHECK_GOTO(moe_view(ctx, dg, 2, (int64_t[]){p->T, p->k}, &gin[2]), st, done);
  }
done:
  moe_tensor_release(x), moe_tensor_release(w), moe_tensor_release(gates), moe_tensor_release(xc);
  moe_tensor_release(dout), moe_tensor_release(drows), moe_tensor_release(dX0);
  moe_tensor_release(gc), moe_tensor_release(g_rows), moe_tensor_release(gxs);
  moe_tensor_release(dgate_rows), moe_tensor_release(xs), moe_tensor_release(dw);
  moe_tensor_release(dwt), moe_tensor_release(dg);
  return st;
}

moe_status moe_parallel_linear(moe_ctx *ctx, moe_tensor *x, moe_tensor *w,
                               struct moe_routing_plan *plan,
                               const moe_parallel_linear_opts *opts, moe_tensor **out) {
  if (!x || !w || !plan || !out)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "parallel_linear: x, w, plan or out is NULL");
  moe_parallel_linear_opts o = opts ? *opts : moe_parallel_linear_opts_default();
  MOE_CHECK(pl_validate(ctx, x, w, plan, o));
  int64_t K = o.trans_w ? w->shape[2] : w->shape[1], N = o.trans_w ? w->shape[1] : w->shape[2];
  moe_tensor *in[3] = {x, w, o.gates};
  bool want = moe_grad_wanted(ctx, o.gates ? 3 : 2, (const moe_tensor *const *)in);
  moe_status st = MOE_OK;
  moe_tensor *wc = NULL, *y = NULL, *r = NULL;
  bool prev = moe_grad_set(ctx, false);
  MOE_CHECK_GOTO(moe_contiguous(ctx, w, &wc), st, fail);
  if (o.scatter && !o.gather) {
    /* one product and the combine: fused where the kernels scatter */
    MOE_CHECK_GOTO(ex_combine(ctx, o.impl, x, wc, plan, o.trans_w, o.gates, &r), st, fail);
  } else {
    MOE_CHECK_GOTO(pl_rows(ctx, o.impl, x, wc, plan, o.trans_w, o.gather, K, N, &y), st, fail);
    if (o.scatter) MOE_CHECK_GOTO(moe_routing_combine(ctx, y, plan, o.gates, &r), st, fail);
    else r = y, y = NULL;
  }
  moe_grad_set(ctx, prev);
  if (want) {
    moe_record_spec spec = {.op = MOE_OP_PARALLEL_LINEAR, .backward = pl_backward,
                            .n_in = o.gates ? 3 : 2, .in = {x, w, o.gates}, .n_save = 2,
                            .save = {x, wc},
                            .iargs = {o.impl, o.trans_w, o.gather, o.scatter, -1, o.memory_optimized},
                            .user = plan, .user_free = ex_plan_release_void};
    if (o.gates) {
      spec.iargs[4] = spec.n_save;
      spec.save[spec.n_save++] = o.gates;
    }
    moe_routing_plan_retain(plan);
    st = moe_record(ctx, &spec, 1, &r);
    if (st != MOE_OK) goto done;
  }
  *out = r;
  r = NULL;
  goto done;
fail:
  moe_grad_set(ctx, prev);
done:
  moe_tensor_release(wc), moe_tensor_release(y), moe_tensor_release(r);
  return st;
}

/* Whether the backward of n may write into t, which it got from saved slot
 * `slot` (as saved, then through moe_contiguous or moe_dequantize): a fresh
 * copy is its own; the saved tensor itself only when the node owns it
 * (moe_node_saved_owned; the caller holds saved and t, the same tensor). */
static bool ex_owned(moe_ctx *ctx, const moe_node *n, int slot, const moe_tensor *saved,
                     const moe_tensor *t) {
  if (t != saved) return t->refcount == 1 && t->storage->refcount == 1;
  return moe_node_saved_owned(ctx, n, slot, saved, 2);
}

static moe_status ex_glu_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                  moe_tensor **gin) {
  moe_routing_plan *p = (moe_routing_plan *)n->user;
  moe_experts_impl impl = (moe_experts_impl)n->iargs[0];
  int act = (int)n->iargs[1];
  int gslot = (int)n->iargs[2];
  int64_t qbits = n->iargs[4];
  bool has_gates = gslot >= 0;
  if (!gout[0]) return moe_node_zero_grads(ctx, n, gin);
  bool need_x = moe_node_needs_grad(n, 0), need_w1 = moe_node_needs_grad(n, 1),
       need_w3 = moe_node_needs_grad(n, 2), need_w2 = moe_node_needs_grad(n, 3),
       need_g = has_gates && moe_node_needs_grad(n, 4);
  moe_status st = MOE_OK;
  moe_tensor *x = NULL, *w1 = NULL, *w3 = NULL, *w2 = NULL, *h1s = NULL, *h3s = NULL, *h1 = NULL,
             *h3 = NULL, *gates = NULL, *gc = NULL,
             *g_rows = NULL, *dout_rows = NULL, *dA0 = NULL, *dh3 = NULL, *ga = NULL,
             *dgate_rows = NULL, *xs = NULL, *t1 = NULL, *t2 = NULL, *dxs = NULL, *dg = NULL,
             *s1 = NULL, *s3 = NULL, *goffs = NULL;
  MOE_CHECK_GOTO(moe_node_saved(ctx, n, EX_SAVED_W1, &w1), st, done);
  MOE_CHECK_GOTO(moe_node_saved(ctx, n, EX_SAVED_W3, &w3), st, done);
  MOE_CHECK_GOTO(moe_node_saved(ctx, n, EX_SAVED_W2, &w2), st, done);
  MOE_CHECK_GOTO(moe_node_saved(ctx, n, EX_SAVED_H1, &h1s), st, done);
  MOE_CHECK_GOTO(moe_node_saved(ctx, n, EX_SAVED_H3, &h3s), st, done);
  moe_dtype dt = n->in_dtype[0];
  moe_device dev = n->in_device[0];
  moe_dtype gdt = dt == MOE_F64 ? MOE_F64 : MOE_F32;
  /* the hidden's shape: dense (R, f), sparse (nnz, b, b) */
  int hnd;
  int64_t hshape[3];
  bool qdirect = false; /* CUDA reads the codes h1s, h3s with scales s1, s3 */
  if (qbits) {
    int64_t rows = h1s->shape[0], bs = p->block_size;
    if (impl == MOE_EXPERTS_SPARSE) {
      hnd = 3;
      hshape[0] = bs > 0 ? rows / bs : 0, hshape[1] = bs, hshape[2] = bs;
    } else {
      hnd = 2;
      hshape[0] = rows, hshape[1] = w1->shape[2];
    }
    MOE_CHECK_GOTO(moe_node_saved(ctx, n, EX_SAVED_S1, &s1), st, done);
    MOE_CHECK_GOTO(moe_node_saved(ctx, n, EX_SAVED_S3, &s3), st, done);
    qdirect = ex_cuda(h1s) && ex_qfused(ctx);
    if (!qdirect) {
      moe_qtensor q = {.bits = (int)qbits, .group_size = n->iargs[5], .dtype = dt, .ndim = hnd};
      memcpy(q.shape, hshape, sizeof(int64_t) * (size_t)hnd);
      q.values = h1s, q.scales = s1;
      MOE_CHECK_GOTO(moe_dequantize(ctx, &q, &h1), st, done);
      q.values = h3s, q.scales = s3;
      MOE_CHECK_GOTO(moe_dequantize(ctx, &q, &h3), st, done);
    }
  } else {
    MOE_CHECK_GOTO(moe_contiguous(ctx, h1s, &h1), st, done);
    MOE_CHECK_GOTO(moe_contiguous(ctx, h3s, &h3), st, done);
    hnd = h1->ndim;
    memcpy(hshape, h1->shape, sizeof(int64_t) * (size_t)hnd);
  }
  /* per-row gates g_rows[r] = gates[src[r]] (0 for padding) */
  if (has_gates) {
    MOE_CHECK_GOTO(moe_node_saved(ctx, n, gslot, &gates), st, done);
    MOE_CHECK_GOTO(moe_contiguous(ctx, gates, &gc), st, done);
    MOE_CHECK_GOTO(ex_take(ctx, gc, p->src, gdt, &g_rows), st, done);
  }
  /* gath: dout_rows is gout[0] itself (T, d), the kernels gather its rows;
   * gath_w: the weight gradients dW1, dW3 read x's rows in place (the knob,
   * or memory_optimized where the kernels gather) */
  bool gath = ex_gather(ctx, impl, p, dt, w1->shape[1], w1->shape[2], false);
  bool gath_w = ex_gather(ctx, impl, p, dt, w1->shape[1], w1->shape[2], true) ||
                (n->iargs[3] == 1 && ex_gather_able(ctx, impl, p, dt, w1->shape[1], w1->shape[2]));
  /* gfuse: dA0's product does the pass below in its epilogue
   * (moe_cuda_wg_grouped_glu_bwd); dA0 is then only dh1's buffer */
  bool gfuse = !gath && !qbits && impl == MOE_EXPERTS_GROUPED &&
               ex_gg_glu_fuses(ctx, p, dt, w1->shape[1], w1->shape[2], &goffs);
  if (gath) {
    MOE_CHECK_GOTO(moe_contiguous(ctx, gout[0], &dout_rows), st, done);
    if (impl == MOE_EXPERTS_SPARSE)
      MOE_CHECK_GOTO(moe_bsmm_sdd_gather(ctx, dout_rows, w2, p, true, &dA0), st, done);
    else
      MOE_CHECK_GOTO(ex_gg_gather(ctx, EX_GG_MM, dout_rows, w2, p, true, &dA0), st, done);
  } else {
    MOE_CHECK_GOTO(moe_routing_permute(ctx, gout[0], p, &dout_rows), st, done);
    moe_tensor *in[4] = {dout_rows, w2, h1, h3};
    gfuse = gfuse && ex_aligned16(in, 4) && moe_tensor_is_contiguous(w2);
    if (gfuse) MOE_CHECK_GOTO(moe_tensor_empty(ctx, hnd, hshape, dt, dev, &dA0), st, done);
    else MOE_CHECK_GOTO(ex_mm_sdd(ctx, impl, dout_rows, w2, p, true, &dA0), st, done);
  }
  /* dh3 and ga take the places of h3 and h1 where the node owns them:
   * the fused pass reads each element before it writes it, so the backward's
   * peak holds two hidden-sized buffers fewer */
  if (h3 && ex_owned(ctx, n, EX_SAVED_H3, h3s, h3)) moe_tensor_retain(dh3 = h3);
  else MOE_CHECK_GOTO(moe_tensor_empty(ctx, hnd, hshape, dt, dev, &dh3), st, done);
  if (need_w2 && h1 && ex_owned(ctx, n, EX_SAVED_H1, h1s, h1)) moe_tensor_retain(ga = h1);
  else if (need_w2) MOE_CHECK_GOTO(moe_tensor_empty(ctx, hnd, hshape, dt, dev, &ga), st, done);
  if (need_g) {
    int64_t R = p->rows;
    MOE_CHECK_GOTO(moe_tensor_empty(ctx, 1, &R, gdt, dev, &dgate_rows), st, done);
  }
  {
    int64_t R = p->rows, bs = impl == MOE_EXPERTS_SPARSE ? p->block_size : 0;
    int64_t f = impl == MOE_EXPERTS_SPARSE ? p->ffn_blocks * p->block_size : hshape[1];
    if (qdirect) {
      int64_t cols = hshape[hnd - 1];
      moe_ex_qhidden qh = {(int)qbits, cols, moe_qz_group(cols, (int)qbits, n->iargs[5]),
                           moe_tensor_data(h1s), moe_tensor_data(h3s),
                           (const float *)moe_tensor_data(s1), (const float *)moe_tensor_data(s3)};
      if (R > 0 && f > 0)
        MOE_CHECK_GOTO(moe_cuda_experts_glu_bwd_quant(
                           ctx, dev.index, dt, act, R, f, bs, moe_tensor_data(dA0), &qh,
                           g_rows ? (const float *)moe_tensor_data(g_rows) : NULL,
                           moe_tensor_data(dh3), ga ? moe_tensor_data(ga) : NULL,
                           dgate_rows ? (float *)moe_tensor_data(dgate_rows) : NULL),
                       st, done);
    } else if (gfuse) {
      MOE_CHECK_GOTO(moe_cuda_wg_grouped_glu_bwd(
                         ctx, dev.index, moe_tensor_data(dout_rows), moe_tensor_data(w2),
                         (const int64_t *)moe_tensor_data(goffs), p->e1 - p->e0, R, w1->shape[1], f,
                         act, moe_tensor_data(h1), moe_tensor_data(h3),
                         g_rows ? (const float *)moe_tensor_data(g_rows) : NULL,
                         moe_tensor_data(dA0), moe_tensor_data(dh3), ga ? moe_tensor_data(ga) : NULL,
                         dgate_rows ? (float *)moe_tensor_data(dgate_rows) : NULL),
                     st, done);
    } else if (dev.type == MOE_DEVICE_CUDA) {
      if (R > 0 && f > 0)
        MOE_CHECK_GOTO(moe_cuda_experts_glu_bwd(
                           ctx, h1->storage->device.index, dt, act, R, f, bs, moe_tensor_data(dA0),
                           moe_tensor_data(h1), moe_tensor_data(h3),
                           g_rows ? (const float *)moe_tensor_data(g_rows) : NULL,
                           moe_tensor_data(dh3), ga ? moe_tensor_data(ga) : NULL,
                           dgate_rows ? (float *)moe_tensor_data(dgate_rows) : NULL),
                       st, done);
    } else {
      ex_glu_bwd_cpu(dt, gdt, act, R, f, bs, moe_tensor_data(dA0), moe_tensor_data(h1),
                     moe_tensor_data(h3), g_rows ? moe_tensor_data(g_rows) : NULL,
                     moe_tensor_data(dh3), ga ? moe_tensor_data(ga) : NULL,
                     dgate_rows ? moe_tensor_data(dgate_rows) : NULL);
    }
  }
  /* dA0 now holds dh1. Buffers go back as soon as their last use is queued
   * (a lower peak: the hidden-sized ones are R x f each, the row-sized ones
   * R x d). */
#define EX_DROP(t) (moe_tensor_release(t), (t) = NULL)
  EX_DROP(h1);
  EX_DROP(h1s);
  EX_DROP(h3);
  EX_DROP(h3s);
  EX_DROP(s1);
  EX_DROP(s3);
  /* the node's own references too (when the graph is freed after this
   * backward): what dh3 and ga do not reuse goes back now */
  moe_node_saved_free(ctx, n, EX_SAVED_H1);
  moe_node_saved_free(ctx, n, EX_SAVED_H3);
  if (qbits) moe_node_saved_free(ctx, n, EX_SAVED_S1), moe_node_saved_free(ctx, n, EX_SAVED_S3);
  if (need_w2 && gath && impl == MOE_EXPERTS_SPARSE)
    MOE_CHECK_GOTO(moe_bsmm_dsd_t_gather(ctx, ga, dout_rows, p, &gin[3]), st, done);
  else if (need_w2 && gath)
    MOE_CHECK_GOTO(ex_gg_gather(ctx, EX_GG_WGRAD_B, dout_rows, ga, p, false, &gin[3]), st, done);
  else if (need_w2) MOE_CHECK_GOTO(ex_wgrad_out(ctx, impl, ga, dout_rows, p, &gin[3]), st, done);
  EX_DROP(ga);
  EX_DROP(dout_rows);
  if (need_g) {
    MOE_CHECK_GOTO(ex_take(ctx, dgate_rows, p->dest, n->in_dtype[4], &dg), st, done);
    MOE_CHECK_GOTO(moe_view(ctx, dg, 2, (int64_t[]){p->T, p->k}, &gin[4]), st, done);
  }
  /* the input gradient first, so that its rows (R, d) are combined into
   * (T, d) before the permuted tokens xs (R, d) exist, one (R, d) buffer at
   * a time. Sparse: dxs = dh1 W1^T + dh3 W3^T in one kernel
   * (moe_bsmm_dsd_sum), and likewise grouped with the offsets on the device
   * (moe_grouped_mm_sum_dev); else dx = combine(dh1 W1^T) + combine(dh3 W3^T) */
  moe_tensor *doffs = NULL;
  if (need_x && impl == MOE_EXPERTS_SPARSE) {
    MOE_CHECK_GOTO(moe_bsmm_dsd_combine(ctx, dA0, w1, dh3, w3, p, true, NULL, &gin[0]), st, done);
  } else if (need_x && ex_dev_offsets(ctx, p, dA0->dtype, dA0->shape[1], w1->shape[1], &doffs)) {
    /* the grouped GEMM on the device: both products in one kernel too */
    st = ex_gg_combine(ctx, dA0, w1, dh3, w3, doffs, p, true, NULL, &gin[0]);
    moe_tensor_release(doffs);
    if (st != MOE_OK) goto done;
  } else if (need_x) {
    MOE_CHECK_GOTO(ex_mm_dsd(ctx, impl, dA0, w1, p, true, &dxs), st, done);
    MOE_CHECK_GOTO(moe_routing_combine(ctx, dxs, p, NULL, &t1), st, done);
    EX_DROP(dxs);
    MOE_CHECK_GOTO(ex_mm_dsd(ctx, impl, dh3, w3, p, true, &dxs), st, done);
    MOE_CHECK_GOTO(moe_routing_combine(ctx, dxs, p, NULL, &t2), st, done);
    EX_DROP(dxs);
    MOE_CHECK_GOTO(moe_binary(ctx, MOE_OP_ADD, t1, t2, &gin[0]), st, done);
    EX_DROP(t1);
    EX_DROP(t2);
  }
  if (need_w1 || need_w3) {
    MOE_CHECK_GOTO(moe_node_saved(ctx, n, EX_SAVED_X, &x), st, done);
    /* gath_w: xs is x itself, the kernels gather its rows */
    if (gath_w) MOE_CHECK_GOTO(moe_contiguous(ctx, x, &xs), st, done);
    else MOE_CHECK_GOTO(moe_routing_permute(ctx, x, p, &xs), st, done);
  }
  if (need_w1 && gath_w) MOE_CHECK_GOTO(ex_wgrad_in_gather(ctx, impl, xs, dA0, p, &gin[1]), st, done);
  else if (need_w1) MOE_CHECK_GOTO(ex_wgrad_in(ctx, impl, xs, dA0, p, &gin[1]), st, done);
  EX_DROP(dA0);
  if (need_w3 && gath_w) MOE_CHECK_GOTO(ex_wgrad_in_gather(ctx, impl, xs, dh3, p, &gin[2]), st, done);
  else if (need_w3) MOE_CHECK_GOTO(ex_wgrad_in(ctx, impl, xs, dh3, p, &gin[2]), st, done);
#undef EX_DROP
done:
  moe_tensor_release(x);
  moe_tensor_release(w1);
  moe_tensor_release(w3);
  moe_tensor_release(w2);
  moe_tensor_release(h1s);
  moe_tensor_release(h3s);
  moe_tensor_release(h1);
  moe_tensor_release(h3);
  moe_tensor_release(gates);
  moe_tensor_release(gc);
  moe_tensor_release(g_rows);
  moe_tensor_release(dout_rows);
  moe_tensor_release(dA0);
  moe_tensor_release(dh3);
  moe_tensor_release(ga);
  moe_tensor_release(dgate_rows);
  moe_tensor_release(xs);
  moe_tensor_release(t1);
  moe_tensor_release(t2);
  moe_tensor_release(dxs);
  moe_tensor_release(dg);
  moe_tensor_release(s1);
  moe_tensor_release(s3);
  moe_tensor_release(goffs);
  return st;
}

static moe_status ex_glu_validate(moe_ctx *ctx, moe_tensor *x, moe_tensor *w1, moe_tensor *w3,
                                  moe_tensor *w2, moe_routing_plan *p, moe_tensor *gates,
                                  moe_experts_impl impl, moe_glu_activation act) {
  const char *fn = "glu_experts";
  if (impl != MOE_EXPERTS_GROUPED && impl != MOE_EXPERTS_SPARSE)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: unknown impl %d", fn, (int)impl);
  if (act != MOE_GLU_SILU && act != MOE_GLU_GELU && act != MOE_GLU_GELU_TANH)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: unknown activation %d", fn, (int)act);
  MOE_CHECK(ex_check_float(ctx, fn, "x", x));
  MOE_CHECK(ex_check_same_dtype(ctx, fn, "w1", w1, x));
  MOE_CHECK(ex_check_same_dtype(ctx, fn, "w3", w3, x));
  MOE_CHECK(ex_check_same_dtype(ctx, fn, "w2", w2, x));
  MOE_CHECK(ex_check_device(ctx, fn, "x", x, p->device));
  MOE_CHECK(ex_check_device(ctx, fn, "w1", w1, p->device));
  MOE_CHECK(ex_check_device(ctx, fn, "w3", w3, p->device));
  MOE_CHECK(ex_check_device(ctx, fn, "w2", w2, p->device));
  int64_t E_loc = p->e1 - p->e0;
  if (x->ndim != 2 || x->shape[0] != p->T)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: x must be (T, d) with the plan's T = %lld, got %s",
                     fn, (long long)p->T, MOE_SHAPE(x));
  int64_t d = x->shape[1];
  if (w1->ndim != 3 || w1->shape[0] != E_loc || w1->shape[1] != d)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: w1 must be (E_loc, d, f) = (%lld, %lld, f) for x %s, "
                     "got %s", fn, (long long)E_loc, (long long)d, MOE_SHAPE(x),
                     MOE_SHAPE(w1));
  int64_t f = w1->shape[2];
  if (w3->ndim != 3 || w3->shape[0] != E_loc || w3->shape[1] != d || w3->shape[2] != f ||
      w2->ndim != 3 || w2->shape[0] != E_loc || w2->shape[1] != f || w2->shape[2] != d)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: w1 %s, w3 %s and w2 %s must be (E_loc, d, f), "
                     "(E_loc, d, f) and (E_loc, f, d) with E_loc = %lld, d = %lld", fn,
                     MOE_SHAPE(w1), MOE_SHAPE(w3),
                     MOE_SHAPE(w2), (long long)E_loc, (long long)d);
  if (gates) {
    MOE_CHECK(ex_check_float(ctx, fn, "gates", gates));
    MOE_CHECK(ex_check_device(ctx, fn, "gates", gates, p->device));
    if (gates->ndim != 2 || gates->shape[0] != p->T || gates->shape[1] != p->k)
      return moe_error(ctx, MOE_ERR_SHAPE, "%s: gates must be the plan's (T, k) = (%lld, %lld), got %s",
                       fn, (long long)p->T, (long long)p->k, MOE_SHAPE(gates));
  }
  if (impl == MOE_EXPERTS_SPARSE) {
    MOE_CHECK(ex_check_sparse_plan(ctx, fn, p));
    if (p->ffn_blocks * p->block_size != f)
      return moe_error(ctx, MOE_ERR_SHAPE, "%s: impl sparse needs the plan's ffn_hidden (%lld) to "
                       "equal f = %lld of w1 %s", fn, (long long)(p->ffn_blocks * p->block_size),
                       (long long)f, MOE_SHAPE(w1));
  }
  return MOE_OK;
}

moe_glu_experts_opts moe_glu_experts_opts_default(void) {
  moe_glu_experts_opts o = {MOE_EXPERTS_GROUPED, MOE_GLU_SILU, false, 0, 0, false, 1024};
  return o;
}

moe_status moe_glu_experts(moe_ctx *ctx, moe_tensor *x, moe_tensor *w1, moe_tensor *w3,
                           moe_tensor *w2, struct moe_routing_plan *plan, moe_tensor *gates,
                           moe_experts_impl impl, moe_glu_activation act,
                           bool memory_optimized, moe_tensor **out) {
  moe_glu_experts_opts o = moe_glu_experts_opts_default();
  o.impl = impl;
  o.act = act;
  o.memory_optimized = memory_optimized;
  return moe_glu_experts_ex(ctx, x, w1, w3, w2, plan, gates, &o, out);
}

/* a = act(h1) * h3 and h1, h3 quantized as opts say (codes v1, v3 and
 * scales s1, s3, as moe_quantize gives them): one fused pass on CUDA when it
 * applies, else the activation and two moe_quantize calls. */
static moe_status ex_glu_fwd_quant(moe_ctx *ctx, moe_tensor *h1, moe_tensor *h3, int act,
                                   const moe_glu_experts_opts *o, moe_tensor **a,
                                   moe_tensor **v1, moe_tensor **s1, moe_tensor **v3,
                                   moe_tensor **s3) {
  moe_quant_opts qo = {o->quant_bits, o->quant_group_size, o->quant_stochastic};
  moe_status st = MOE_OK;
  if (ex_cuda(h1) && ex_qfused(ctx)) {
    int64_t cols = h1->shape[h1->ndim - 1], n = moe_tensor_numel(h1);
    int64_t rows = cols > 0 ? n / cols : 0, G = moe_qz_group(cols, qo.bits, qo.group_size);
    int64_t vshape[2] = {rows, qo.bits == 8 ? cols : (cols + 1) / 2};
    int64_t sshape[2] = {rows, cols > 0 ? (cols + G - 1) / G : 0};
    moe_device d = h1->storage->device;
    moe_dtype vdt = qo.bits == 8 ? MOE_I8 : MOE_U8;
    moe_tensor *t[5] = {0};
    MOE_CHECK_GOTO(moe_tensor_empty(ctx, h1->ndim, h1->shape, h1->dtype, d, &t[0]), st, qfail);
    MOE_CHECK_GOTO(moe_tensor_empty(ctx, 2, vshape, vdt, d, &t[1]), st, qfail);
    MOE_CHECK_GOTO(moe_tensor_empty(ctx, 2, sshape, MOE_F32, d, &t[2]), st, qfail);
    MOE_CHECK_GOTO(moe_tensor_empty(ctx, 2, vshape, vdt, d, &t[3]), st, qfail);
    MOE_CHECK_GOTO(moe_tensor_empty(ctx, 2, sshape, MOE_F32, d, &t[4]), st, qfail);
    moe_ex_qhidden qh = {qo.bits, cols, G, moe_tensor_data(t[1]), moe_tensor_data(t[3]),
                         (const float *)moe_tensor_data(t[2]), (const float *)moe_tensor_data(t[4])};
    uint64_t seed = ctx->rng_seed, call = ctx->rng_call;
    bool done = false;
    MOE_CHECK_GOTO(moe_cuda_experts_glu_fwd_quant(ctx, d.index, h1->dtype, act, rows, &qh,
                                                  qo.stochastic, seed, call, call + 1,
                                                  moe_tensor_data(h1), moe_tensor_data(h3),
                                                  moe_tensor_data(t[0]), &done),
                   st, qfail);
    if (done) {
      if (qo.stochastic) ctx->rng_call += 2; /* as two moe_quantize calls */
      *a = t[0], *v1 = t[1], *s1 = t[2], *v3 = t[3], *s3 = t[4];
      return MOE_OK;
    }
  qfail:
    for (int i = 0; i < 5; i++) moe_tensor_release(t[i]);
    if (st != MOE_OK) return st;
  }
  moe_qtensor q1 = {0}, q3 = {0};
  moe_tensor *ta = NULL;
  MOE_CHECK(ex_glu_fwd(ctx, h1, h3, act, &ta));
  MOE_CHECK_GOTO(moe_quantize(ctx, h1, &qo, &q1), st, fail);
  MOE_CHECK_GOTO(moe_quantize(ctx, h3, &qo, &q3), st, fail);
  *a = ta, *v1 = q1.values, *s1 = q1.scales, *v3 = q3.values, *s3 = q3.scales;
  return MOE_OK;
fail:
  moe_tensor_release(ta);
  moe_qtensor_clear(&q1);
  moe_qtensor_clear(&q3);
  return st;
}

moe_status moe_glu_experts_ex(moe_ctx *ctx, moe_tensor *x, moe_tensor *w1, moe_tensor *w3,
                              moe_tensor *w2, struct moe_routing_plan *plan, moe_tensor *gates,
                              const moe_glu_experts_opts *opts, moe_tensor **out) {
  if (!x || !w1 || !w3 || !w2 || !plan || !out)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "glu_experts: x, w1, w3, w2, plan or out is NULL");
  moe_glu_experts_opts o = opts ? *opts : moe_glu_experts_opts_default();
  moe_experts_impl impl = o.impl;
  moe_glu_activation act = o.act;
  MOE_CHECK(ex_glu_validate(ctx, x, w1, w3, w2, plan, gates, impl, act));
  if (o.quant_bits != 0) {
    if (o.quant_bits != 8 && o.quant_bits != 4)
      return moe_error(ctx, MOE_ERR_INVALID_ARG,
                       "glu_experts: quantize bits must be 8 or 4 (0: off), got %d", o.quant_bits);
    if (o.quant_group_size < 0 || (o.quant_bits == 4 && o.quant_group_size % 2))
      return moe_error(ctx, MOE_ERR_INVALID_ARG,
                       "glu_experts: quantize group_size must be >= 0 (0: a row) and even for "
                       "4 bits, got %lld", (long long)o.quant_group_size);
    if (o.quant_min_numel < 0)
      return moe_error(ctx, MOE_ERR_INVALID_ARG, "glu_experts: quantize min_numel must be >= 0, got %lld",
                       (long long)o.quant_min_numel);
    if (x->dtype == MOE_F64 && moe_tensor_device(x).type == MOE_DEVICE_CUDA)
      return moe_error(ctx, MOE_ERR_DTYPE, "glu_experts: quantize takes f32 or bf16 on CUDA");
  }
  moe_tensor *in[5] = {x, w1, w3, w2, gates};
  int n_in = gates ? 5 : 4;
  bool want = moe_grad_wanted(ctx, n_in, (const moe_tensor *const *)in);
  moe_status st = MOE_OK;
  moe_tensor *w1c = NULL, *w3c = NULL, *w2c = NULL, *xs = NULL, *h1 = NULL, *h3 = NULL, *a = NULL,
             *r = NULL, *v1 = NULL, *s1 = NULL, *v3 = NULL, *s3 = NULL, *goffs = NULL;
  bool prev = moe_grad_set(ctx, false);
  MOE_CHECK_GOTO(moe_contiguous(ctx, w1, &w1c), st, fail);
  MOE_CHECK_GOTO(moe_contiguous(ctx, w3, &w3c), st, fail);
  MOE_CHECK_GOTO(moe_contiguous(ctx, w2, &w2c), st, fail);
  if (ex_gather(ctx, impl, plan, x->dtype, w1->shape[1], w1->shape[2], false)) {
    /* the kernel reads x's rows: no permuted copy */
    if (impl == MOE_EXPERTS_SPARSE) {
      MOE_CHECK_GOTO(moe_bsmm_sdd_gather(ctx, x, w1c, plan, false, &h1), st, fail);
      MOE_CHECK_GOTO(moe_bsmm_sdd_gather(ctx, x, w3c, plan, false, &h3), st, fail);
    } else {
      MOE_CHECK_GOTO(ex_gg_gather(ctx, EX_GG_MM, x, w1c, plan, false, &h1), st, fail);
      MOE_CHECK_GOTO(ex_gg_gather(ctx, EX_GG_MM, x, w3c, plan, false, &h3), st, fail);
    }
  } else {
    MOE_CHECK_GOTO(moe_routing_permute(ctx, x, plan, &xs), st, fail);
    if (impl == MOE_EXPERTS_SPARSE && o.quant_bits == 0 && moe_bsmm_glu_fuses(ctx, plan, x->dtype)) {
      /* one kernel: h1, h3 and a (the same bits as the passes below) */
      MOE_CHECK_GOTO(moe_bsmm_sdd_glu(ctx, xs, w1c, w3c, plan, (int)act, &h1, &h3, &a), st, fail);
    } else if (impl == MOE_EXPERTS_GROUPED && o.quant_bits == 0 &&
               ex_gg_glu_fuses(ctx, plan, x->dtype, w1->shape[1], w1->shape[2], &goffs)) {
      /* likewise for the grouped GEMM */
      MOE_CHECK_GOTO(ex_gg_glu(ctx, xs, w1c, w3c, goffs, plan, (int)act, &h1, &h3, &a), st, fail);
    } else {
      MOE_CHECK_GOTO(ex_mm_sdd(ctx, impl, xs, w1c, plan, false, &h1), st, fail);
      MOE_CHECK_GOTO(ex_mm_sdd(ctx, impl, xs, w3c, plan, false, &h3), st, fail);
    }
    moe_tensor_release(xs);
    xs = NULL;
  }
  /* quantized only when backward will need them, and when large enough */
  bool quant = o.quant_bits != 0 && want && moe_tensor_numel(h1) >= o.quant_min_numel;
  if (quant) {
    MOE_CHECK_GOTO(ex_glu_fwd_quant(ctx, h1, h3, (int)act, &o, &a, &v1, &s1, &v3, &s3), st, fail);
    /* the bf16 pre-activations go now: only their codes are kept */
    moe_tensor_release(h1);
    moe_tensor_release(h3);
    h1 = h3 = NULL;
  } else if (!a) {
    MOE_CHECK_GOTO(ex_glu_fwd(ctx, h1, h3, (int)act, &a), st, fail);
  }
  MOE_CHECK_GOTO(ex_combine(ctx, impl, a, w2c, plan, false, gates, &r), st, fail);
  moe_grad_set(ctx, prev);
  if (want) {
    /* saved: the contiguous weights (w itself when already contiguous), the
     * hidden (or its codes and scales), then gates and a when present */
    moe_record_spec spec = {
        .op = MOE_OP_GLU_EXPERTS, .backward = ex_glu_backward, .n_in = n_in,
        .in = {x, w1, w3, w2, gates},
        .save = {x, w1c, w3c, w2c, quant ? v1 : h1, quant ? v3 : h3, s1, s3},
        .iargs = {impl, act, -1, o.memory_optimized ? 1 : 0, quant ? o.quant_bits : 0, o.quant_group_size},
        .user = plan, .user_free = ex_plan_release_void};
    spec.n_save = quant ? 8 : 6;
    if (gates) {
      spec.iargs[2] = spec.n_save;
      spec.save[spec.n_save++] = gates;
    }
    /* a is not saved: the backward's fused pass reads h1 and h3 anyway and
     * recomputes it with the forward's rounding (the same bits), so keeping
     * it would cost a hidden-sized tensor per layer and its read */
    /* the op's own quantization applies to its saved tensors: the caller's
     * hooks are set aside while they are saved */
    int n_hooks = ctx->n_hooks;
    if (quant) ctx->n_hooks = 0;
    moe_routing_plan_retain(plan);
    st = moe_record(ctx, &spec, 1, &r);
    ctx->n_hooks = n_hooks;
    if (st != MOE_OK) goto done;
  }
  *out = r;
  r = NULL;
  goto done;
fail:
  moe_grad_set(ctx, prev);
done:
  moe_tensor_release(w1c);
  moe_tensor_release(w3c);
  moe_tensor_release(w2c);
  moe_tensor_release(xs);
  moe_tensor_release(h1);
  moe_tensor_release(h3);
  moe_tensor_release(a);
  moe_tensor_release(r);
  moe_tensor_release(v1);
  moe_tensor_release(s1);
  moe_tensor_release(v3);
  moe_tensor_release(s3);
  moe_tensor_release(goffs);
  return st;
}
