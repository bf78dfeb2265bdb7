/*
 * blocksparse.c - the block-sparse family (moe_blocksparse.h): MegaBlocks'
 * SDD, DSD, DSD^T and DDS products and the dense conversions over a padded
 * routing plan's topology (moe_routing.h), with validation, the CPU
 * reference (one cblas GEMM per block, f32/f64; bf16 computed in f32), the
 * dispatch to kernels/blocksparse.cu (blocksparse_cuda.h), and the autograd
 * nodes of SDD and DSD (MOE_OP_BSMM_SDD / MOE_OP_BSMM_DSD), which hold a
 * reference to the plan (node->user).
 *
 * Determinism: every output block is produced by one owner summing its
 * blocks in the topology's order (row-major for DSD, the transpose
 * metadata's order for DSD^T and DDS); no atomics on either device.
 */
#include <cblas.h>
#include <stdint.h>
#include <string.h>

#include "blocksparse_cuda.h"
#include "internal.h"
#include "moe_routing.h"

/* The sizes of a plan's block matrix. */
typedef struct bs_geom {
  int64_t b;   /* block size */
  int64_t F;   /* column blocks per expert */
  int64_t N;   /* F * b, columns per expert */
  int64_t EL;  /* local experts e1 - e0 */
  int64_t R;   /* rows of the permuted buffer */
  int64_t Rb;  /* R / b row blocks */
  int64_t nnz; /* Rb * F blocks */
} bs_geom;

static bool bs_cuda(const moe_routing_plan *p) { return p->device.type == MOE_DEVICE_CUDA; }

/* ---------------------------------------------------------- validation */

static moe_status bs_check_plan(moe_ctx *ctx, const char *fn, const moe_routing_plan *p,
                                bs_geom *g) {
  if (!p) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: plan is NULL", fn);
  if (p->block_size <= 0)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "%s: the plan is not padded (block_size 0); build it with block_size and "
                     "ffn_hidden",
                     fn);
  if (!p->bs_row_indices || p->ffn_blocks <= 0)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "%s: the plan has no block-sparse topology; build it with ffn_hidden (a "
                     "multiple of block_size %lld)",
                     fn, (long long)p->block_size);
  if (bs_cuda(p) && p->block_size != 128)
    return moe_error(ctx, MOE_ERR_NOT_SUPPORTED,
                     "%s: block_size %lld is not supported on CUDA (the kernels need 128)", fn,
                     (long long)p->block_size);
  g->b = p->block_size;
  g->F = p->ffn_blocks;
  g->N = g->F * g->b;
  g->EL = p->e1 - p->e0;
  g->R = p->rows;
  g->Rb = p->rows / p->block_size;
  g->nnz = p->nnz;
  return MOE_OK;
}

/* dtype and device of one operand; dt0 (when not NULL and not MOE_DTYPE_COUNT)
 * is the dtype the other operands have. */
static moe_status bs_check_operand(moe_ctx *ctx, const char *fn, const char *what,
                                   const moe_tensor *t, const moe_routing_plan *p) {
  if (!t) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: %s is NULL", fn, what);
  bool cuda = bs_cuda(p);
  bool ok = t->dtype == MOE_F32 || t->dtype == MOE_BF16 || (t->dtype == MOE_F64 && !cuda);
  if (!ok)
    return moe_error(ctx, MOE_ERR_DTYPE, "%s: %s has dtype %s; supported: %s", fn, what,
                     moe_dtype_name(t->dtype), cuda ? "f32, bf16 on CUDA" : "f32, f64, bf16");
  return moe_check_same_device(ctx, fn, what, t->storage->device, "the plan", p->device);
}

/* t must have shape want (ndim dims); want_str describes it. */
static moe_status bs_check_shape(moe_ctx *ctx, const char *fn, const char *what,
                                 const moe_tensor *t, int ndim, const int64_t *want,
                                 const char *want_str) {
  bool ok = t->ndim == ndim;
  for (int i = 0; ok && i < ndim; i++) ok = t->shape[i] == want[i];
  if (ok) return MOE_OK;
  return moe_error(ctx, MOE_ERR_SHAPE, "%s: %s has shape %s, expected %s = %s", fn, what,
                   MOE_SHAPE(t), want_str, MOE_SHAPE_OF(ndim, want));
}

/* K of an operand t (named what): >= 1, and % 8 for bf16 on CUDA. */
static moe_status bs_check_k(moe_ctx *ctx, const char *fn, const char *what, const moe_tensor *t,
                             const moe_routing_plan *p, int64_t K) {
  if (K < 1)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: %s has shape %s: K = 0 is not supported", fn, what,
                     MOE_SHAPE(t));
  if (bs_cuda(p) && t->dtype == MOE_BF16 && K % 8 != 0)
    return moe_error(ctx, MOE_ERR_NOT_SUPPORTED,
                     "%s: K = %lld is not supported for bf16 on CUDA (K must be a multiple of 8)",
                     fn, (long long)K);
  return MOE_OK;
}

/* A 2-D (rows, K) operand, rows the plan's R (name "R") or T ("T"): checks
 * rows, reads K. */
static moe_status bs_check_rows(moe_ctx *ctx, const char *fn, const char *what,
                                const moe_tensor *t, const moe_routing_plan *p, int64_t rows,
                                const char *name, int64_t *K) {
  *K = 0;
  if (t->ndim != 2 || t->shape[0] != rows)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: %s has shape %s, expected (%s, K) with the plan's %s = %lld",
                     fn, what, MOE_SHAPE(t), name, name, (long long)rows);
  *K = t->shape[1];
  return bs_check_k(ctx, fn, what, t, p, *K);
}

/* A dense (R, K) operand. */
static moe_status bs_check_dense(moe_ctx *ctx, const char *fn, const char *what,
                                 const moe_tensor *t, const moe_routing_plan *p,
                                 const bs_geom *g, int64_t *K) {
  return bs_check_rows(ctx, fn, what, t, p, g->R, "R", K);
}

/* A token-order (T, K) operand of a gather. */
static moe_status bs_check_tokens(moe_ctx *ctx, const char *fn, const char *what,
                                  const moe_tensor *t, const moe_routing_plan *p, int64_t *K) {
  return bs_check_rows(ctx, fn, what, t, p, p->T, "T", K);
}

static moe_status bs_check_sparse(moe_ctx *ctx, const char *fn, const char *what,
                                  const moe_tensor *s, const bs_geom *g) {
  return bs_check_shape(ctx, fn, what, s, 3, (int64_t[]){g->nnz, g->b, g->b}, "(nnz, b, b)");
}

/* --------------------------------------------------- operand preparation */

/* A contiguous copy (or t retained) ready for the compute: on the CPU in
 * dtype cdt; on CUDA in t's dtype and 16-byte aligned. No autograd. */
static moe_status bs_prepare(moe_ctx *ctx, moe_tensor *t, moe_dtype cdt, moe_tensor **out) {
  moe_tensor *a = NULL, *c = NULL;
  moe_status st;
  if (t->storage->device.type == MOE_DEVICE_CUDA) {
    MOE_CHECK(moe_contiguous(ctx, t, &c));
    if (((uintptr_t)moe_tensor_data(c) & 15u) != 0) {
      st = moe_clone(ctx, c, &a);
      moe_tensor_release(c);
      if (st != MOE_OK) return st;
      c = a;
    }
    *out = c;
    return MOE_OK;
  }
  MOE_CHECK(moe_to(ctx, t, cdt, t->storage->device, &a));
  st = moe_contiguous(ctx, a, &c);
  moe_tensor_release(a);
  if (st != MOE_OK) return st;
  *out = c;
  return MOE_OK;
}

/* The CPU compute dtype of an operand dtype: bf16 in f32. */
static moe_dtype bs_cdt(moe_dtype dt) { return dt == MOE_F64 ? MOE_F64 : MOE_F32; }

static const int64_t *bs_idx(const moe_tensor *t) { return (const int64_t *)moe_tensor_data(t); }

/* C (m x n, ldc) = beta C + op(A) op(B), in f32 or f64 (cdt). */
static void bs_gemm(moe_dtype cdt, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                    const void *A, int64_t lda, const void *B, int64_t ldb, double beta, void *C,
                    int64_t ldc) {
  enum CBLAS_TRANSPOSE a = ta ? CblasTrans : CblasNoTrans, b = tb ? CblasTrans : CblasNoTrans;
  if (cdt == MOE_F64)
    cblas_dgemm(CblasRowMajor, a, b, (int)m, (int)n, (int)k, 1.0, (const double *)A, (int)lda,
                (const double *)B, (int)ldb, beta, (double *)C, (int)ldc);
  else
    cblas_sgemm(CblasRowMajor, a, b, (int)m, (int)n, (int)k, 1.0f, (const float *)A, (int)lda,
                (const float *)B, (int)ldb, (float)beta, (float *)C, (int)ldc);
}

/* Element pointer arithmetic in elements of size es. */
static const char *bs_at(const moe_tensor *t, int64_t elems, size_t es) {
  return (const char *)moe_tensor_data(t) + elems * (int64_t)es;
}

static moe_bs_topo bs_topo(const moe_routing_plan *p, const bs_geom *g) {
  moe_bs_topo tp;
  tp.b = g->b, tp.F = g->F, tp.EL = g->EL, tp.Rb = g->Rb, tp.nnz = g->nnz;
  tp.row_indices = bs_idx(p->bs_row_indices);
  tp.column_indices = bs_idx(p->bs_column_indices);
  tp.offsets_t = bs_idx(p->bs_offsets_t);
  tp.column_indices_t = bs_idx(p->bs_column_indices_t);
  tp.block_offsets_t = bs_idx(p->bs_block_offsets_t);
  tp.gather_src = NULL;
  tp.scatter_dst = NULL;
  tp.scatter_scale = NULL;
  tp.gather_k = p->k;
  return tp;
}

/* The four products. Each takes prepared operands (a, c contiguous; CPU: in
 * the compute dtype), writes the result r (contiguous, same dtype as the
 * operands on CUDA, the compute dtype on the CPU). */
typedef enum bs_kind { BS_SDD, BS_DSD, BS_DSD_T, BS_DDS } bs_kind;

static void bs_cpu(bs_kind kind, const moe_routing_plan *p, const bs_geom *g, int64_t K,
                   bool trans_w, const moe_tensor *a, const moe_tensor *c, moe_tensor *r) {
  moe_dtype cdt = r->dtype;
  size_t es = moe_dtype_size(cdt);
  int64_t b = g->b, F = g->F, N = g->N;
  const int64_t *ri = bs_idx(p->bs_row_indices), *ci = bs_idx(p->bs_column_indices);
  const int64_t *off_t = bs_idx(p->bs_offsets_t), *ci_t = bs_idx(p->bs_column_indices_t);
  const int64_t *bo_t = bs_idx(p->bs_block_offsets_t);
  char *o = (char *)moe_tensor_data(r);
  if (kind != BS_SDD && moe_tensor_numel(r) > 0) memset(o, 0, (size_t)moe_tensor_numel(r) * es);
  switch (kind) {
  case BS_SDD: /* a = x (R, K), c = w */
    for (int64_t i = 0; i < g->nnz; i++) {
      int64_t rb = ri[i], el = ci[i] / F, cc = ci[i] % F;
      const char *A = bs_at(a, rb * b * K, es);
      if (!trans_w)
        bs_gemm(cdt, false, false, b, b, K, A, K, bs_at(c, el * K * N + cc * b, es), N, 0.0,
                o + i * b * b * (int64_t)es, b);
      else
        bs_gemm(cdt, false, true, b, b, K, A, K, bs_at(c, el * N * K + cc * b * K, es), K, 0.0,
                o + i * b * b * (int64_t)es, b);
    }
    break;
  case BS_DSD: /* a = s, c = w; row block rb's blocks in order */
    for (int64_t i = 0; i < g->nnz; i++) {
      int64_t rb = ri[i], el = ci[i] / F, cc = ci[i] % F;
      const char *A = bs_at(a, i * b * b, es);
      char *C = o + rb * b * K * (int64_t)es;
      if (!trans_w)
        bs_gemm(cdt, false, false, b, K, b, A, b, bs_at(c, el * N * K + cc * b * K, es), K, 1.0, C,
                K);
      else
        bs_gemm(cdt, false, true, b, K, b, A, b, bs_at(c, el * K * N + cc * b, es), N, 1.0, C, K);
    }
    break;
  case BS_DSD_T: /* a = s, c = y; out (EL, N, K) */
    for (int64_t col = 0; col < g->EL * F; col++) {
      int64_t el = col / F, cc = col % F;
      char *C = o + (el * N * K + cc * b * K) * (int64_t)es;
      for (int64_t it = off_t[col]; it < off_t[col + 1]; it++)
        bs_gemm(cdt, true, false, b, K, b, bs_at(a, bo_t[it] * b * b, es), b,
                bs_at(c, ci_t[it] * b * K, es), K, 1.0, C, K);
    }
    break;
  case BS_DDS: /* a = x, c = s; out (EL, K, N) */
    for (int64_t col = 0; col < g->EL * F; col++) {
      int64_t el = col / F, cc = col % F;
      char *C = o + (el * K * N + cc * b) * (int64_t)es;
      for (int64_t it = off_t[col]; it < off_t[col + 1]; it++)
        bs_gemm(cdt, true, false, K, b, b, bs_at(a, ci_t[it] * b * K, es), K,
                bs_at(c, bo_t[it] * b * b, es), b, 1.0, C, N);
    }
    break;
  }
}

/* Runs one product with grad mode off: out has shape (ndim, shape) and the
 * operands' dtype. gather (CUDA only, moe_cuda_bsmm_wgmma): the dense
 * R-row operand is (T, K) and the kernel gathers its rows by the plan's src. */
static moe_status bs_run_ex(moe_ctx *ctx, const char *fn, bs_kind kind, moe_routing_plan *p,
                            const bs_geom *g, int64_t K, bool trans_w, moe_tensor *a,
                            moe_tensor *c, int ndim, const int64_t *shape, bool gather,
                            moe_tensor **out) {
  moe_dtype dt = a->dtype;
  bool cuda = bs_cuda(p);
  moe_dtype cdt = cuda ? dt : bs_cdt(dt);
  moe_tensor *pa = NULL, *pc = NULL, *r = NULL, *rc = NULL;
  bool prev = moe_grad_set(ctx, false);
  moe_status st = MOE_OK;
  MOE_CHECK_GOTO(bs_prepare(ctx, a, cdt, &pa), st, done);
  MOE_CHECK_GOTO(bs_prepare(ctx, c, cdt, &pc), st, done);
  MOE_CHECK_GOTO(moe_tensor_empty(ctx, ndim, shape, cdt, p->device, &r), st, done);
  if (cuda && g->nnz == 0) {
    /* No block (a rank whose experts received no rows under expert
     * parallelism): the dense products are zeros, as on the CPU, and no
     * kernel runs (a TMA descriptor cannot describe an empty operand). */
    if (kind != BS_SDD && moe_tensor_numel(r) > 0) st = moe_fill_(ctx, r, 0);
    if (st != MOE_OK) goto done;
  } else if (cuda) {
    moe_bs_topo tp = bs_topo(p, g);
    if (gather) tp.gather_src = bs_idx(p->src);
    int dev = p->device.index;
    const void *da = moe_tensor_data(pa), *dc = moe_tensor_data(pc);
    void *dr = moe_tensor_data(r);
    switch (kind) {
    case BS_SDD: st = moe_cuda_bsmm_sdd(ctx, dev, dt, &tp, da, dc, K, trans_w, dr); break;
    case BS_DSD: st = moe_cuda_bsmm_dsd(ctx, dev, dt, &tp, da, dc, K, trans_w, dr); break;
    case BS_DSD_T: st = moe_cuda_bsmm_dsd_t(ctx, dev, dt, &tp, da, dc, K, dr); break;
    case BS_DDS: st = moe_cuda_bsmm_dds(ctx, dev, dt, &tp, da, dc, K, dr); break;
    }
    if (st != MOE_OK) goto done;
  } else {
    bs_cpu(kind, p, g, K, trans_w, pa, pc, r);
    if (cdt != dt) {
      MOE_CHECK_GOTO(moe_to(ctx, r, dt, p->device, &rc), st, done);
      moe_tensor_release(r);
      r = rc;
    }
  }
  *out = r;
  r = NULL;
done:
  (void)fn;
  moe_grad_set(ctx, prev);
  moe_tensor_release(pa);
  moe_tensor_release(pc);
  moe_tensor_release(r);
  return st;
}

static moe_status bs_run(moe_ctx *ctx, const char *fn, bs_kind kind, moe_routing_plan *p,
                         const bs_geom *g, int64_t K, bool trans_w, moe_tensor *a, moe_tensor *c,
                         int ndim, const int64_t *shape, moe_tensor **out) {
  return bs_run_ex(ctx, fn, kind, p, g, K, trans_w, a, c, ndim, shape, false, out);
}

/* ------------------------------------------------------- raw products */

static moe_status bs_check_w(moe_ctx *ctx, const char *fn, const moe_tensor *w, const bs_geom *g,
                             int64_t K, bool kn) {
  if (kn) return bs_check_shape(ctx, fn, "w", w, 3, (int64_t[]){g->EL, K, g->N}, "(E_loc, K, N)");
  return bs_check_shape(ctx, fn, "w", w, 3, (int64_t[]){g->EL, g->N, K}, "(E_loc, N, K)");
}

static moe_status bs_sdd_raw(moe_ctx *ctx, moe_tensor *x, moe_tensor *w, moe_routing_plan *p,
                             bool trans_w, moe_tensor **out) {
  const char *fn = "bsmm_sdd";
  bs_geom g = {0};
  int64_t K = 0;
  MOE_CHECK(bs_check_plan(ctx, fn, p, &g));
  MOE_CHECK(bs_check_operand(ctx, fn, "x", x, p));
  MOE_CHECK(bs_check_operand(ctx, fn, "w", w, p));
  MOE_CHECK(moe_check_same_dtype(ctx, fn, "x", x->dtype, "w", w->dtype));
  MOE_CHECK(bs_check_dense(ctx, fn, "x", x, p, &g, &K));
  MOE_CHECK(bs_check_w(ctx, fn, w, &g, K, !trans_w));
  return bs_run(ctx, fn, BS_SDD, p, &g, K, trans_w, x, w, 3, (int64_t[]){g.nnz, g.b, g.b}, out);
}

/* The checks of a DSD pair (s, w); reads K. */
static moe_status bs_dsd_check(moe_ctx *ctx, const char *fn, const char *sn, moe_tensor *s,
                               const char *wn, moe_tensor *w, moe_routing_plan *p, bool trans_w,
                               bs_geom *g, int64_t *Kout) {
  MOE_CHECK(bs_check_plan(ctx, fn, p, g));
  MOE_CHECK(bs_check_operand(ctx, fn, sn, s, p));
  MOE_CHECK(bs_check_operand(ctx, fn, wn, w, p));
  MOE_CHECK(moe_check_same_dtype(ctx, fn, sn, s->dtype, wn, w->dtype));
  MOE_CHECK(bs_check_sparse(ctx, fn, sn, s, g));
  if (w->ndim != 3)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: %s has shape %s, expected %s", fn, wn, MOE_SHAPE(w),
                     trans_w ? "(E_loc, K, N)" : "(E_loc, N, K)");
  int64_t K = trans_w ? w->shape[1] : w->shape[2];
  MOE_CHECK(bs_check_k(ctx, fn, wn, w, p, K));
  MOE_CHECK(bs_check_w(ctx, fn, w, g, K, trans_w));
  *Kout = K;
  return MOE_OK;
}

static moe_status bs_dsd_raw(moe_ctx *ctx, moe_tensor *s, moe_tensor *w, moe_routing_plan *p,
                             bool trans_w, moe_tensor **out) {
  const char *fn = "bsmm_dsd";
  bs_geom g = {0};
  int64_t K = 0;
  MOE_CHECK(bs_dsd_check(ctx, fn, "s", s, "w", w, p, trans_w, &g, &K));
  return bs_run(ctx, fn, BS_DSD, p, &g, K, trans_w, s, w, 2, (int64_t[]){g.R, K}, out);
}

bool moe_bsmm_scatters(moe_ctx *ctx, const moe_routing_plan *p, moe_dtype dt) {
  return ctx && p && bs_cuda(p) && ctx->knobs.bsmm_scatter && p->k == 1 && p->e0 == 0 &&
         p->e1 == p->E && p->capacity == 0 && p->src && moe_tensor_is_contiguous(p->src) &&
         moe_cuda_bsmm_wgmma(ctx, p->device.index, dt);
}

/* moe_bsmm_dsd_sum (combine false) and moe_bsmm_dsd_combine (true): one
 * pair when s2 is NULL. */
static moe_status bs_dsd_pair(moe_ctx *ctx, const char *fn, moe_tensor *s, moe_tensor *w,
                              moe_tensor *s2, moe_tensor *w2, moe_routing_plan *p, bool trans_w,
                              bool combine, moe_tensor *gates, moe_tensor **out) {
  bs_geom g = {0};
  int64_t K = 0, K2 = 0;
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: out is NULL", fn);
  if (!s2 != !w2) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: s2 and w2 go together", fn);
  MOE_CHECK(bs_dsd_check(ctx, fn, "s", s, "w", w, p, trans_w, &g, &K));
  if (s2) {
    MOE_CHECK(bs_dsd_check(ctx, fn, "s2", s2, "w2", w2, p, trans_w, &g, &K2));
    MOE_CHECK(moe_check_same_dtype(ctx, fn, "s", s->dtype, "s2", s2->dtype));
    if (K2 != K)
      return moe_error(ctx, MOE_ERR_SHAPE, "%s: w %s and w2 %s give different K (%lld, %lld)", fn,
                       MOE_SHAPE(w), MOE_SHAPE(w2), (long long)K, (long long)K2);
  }
  if (gates) {
    MOE_CHECK(bs_check_operand(ctx, fn, "gates", gates, p));
    if (gates->ndim != 2 || gates->shape[0] != p->T || gates->shape[1] != p->k)
      return moe_error(ctx, MOE_ERR_SHAPE, "%s: gates have shape %s, expected the plan's (%lld, %lld)",
                       fn, MOE_SHAPE(gates), (long long)p->T, (long long)p->k);
  }
  moe_tensor *in[5] = {s, w, s2, w2, gates};
  for (int i = 0; i < 5; i++)
    if (in[i] && moe_grad_enabled(ctx) && moe_requires_grad(in[i]))
      return moe_error(ctx, MOE_ERR_INVALID_ARG,
                       "%s: not differentiable, and %s requires grad: run it with grad mode off, "
                       "or compose moe_bsmm_dsd%s", fn, (const char *[]){"s", "w", "s2", "w2", "gates"}[i],
                       combine ? " and moe_routing_combine" : " twice");
  bool prev = moe_grad_set(ctx, false);
  moe_status st = MOE_OK;
  moe_tensor *c[4] = {0}, *r = NULL, *t1 = NULL, *t2 = NULL, *gf = NULL, *gc = NULL;
  bool one = bs_cuda(p) && g.nnz > 0 && moe_cuda_bsmm_wgmma(ctx, p->device.index, s->dtype);
  bool scat = combine && one && moe_bsmm_scatters(ctx, p, s->dtype);
  if (one && (s2 || scat)) {
    /* one kernel: both pairs into one f32 sum per element; with the
     * scatter its epilogue writes each row in token order, as the combine */
    int n = s2 ? 4 : 2;
    for (int i = 0; i < n; i++) MOE_CHECK_GOTO(bs_prepare(ctx, in[i], s->dtype, &c[i]), st, done);
    int64_t rows = scat ? p->T : g.R;
    MOE_CHECK_GOTO(moe_tensor_empty(ctx, 2, (int64_t[]){rows, K}, s->dtype, p->device, &r), st, done);
    moe_bs_topo tp = bs_topo(p, &g);
    if (scat) {
      if (gates) {
        MOE_CHECK_GOTO(moe_to(ctx, gates, MOE_F32, p->device, &gf), st, done);
        MOE_CHECK_GOTO(moe_contiguous(ctx, gf, &gc), st, done);
        tp.scatter_scale = (const float *)moe_tensor_data(gc);
      }
      tp.scatter_dst = bs_idx(p->src);
    }
    if (s2)
      st = moe_cuda_bsmm_dsd2(ctx, p->device.index, s->dtype, &tp, moe_tensor_data(c[0]),
                              moe_tensor_data(c[1]), moe_tensor_data(c[2]), moe_tensor_data(c[3]), K,
                              trans_w, moe_tensor_data(r));
    else
      st = moe_cuda_bsmm_dsd(ctx, p->device.index, s->dtype, &tp, moe_tensor_data(c[0]),
                             moe_tensor_data(c[1]), K, trans_w, moe_tensor_data(r));
    if (st != MOE_OK) goto done;
  } else {
    MOE_CHECK_GOTO(bs_run(ctx, fn, BS_DSD, p, &g, K, trans_w, s, w, 2, (int64_t[]){g.R, K}, &t1), st, done);
    if (s2) {
      MOE_CHECK_GOTO(bs_run(ctx, fn, BS_DSD, p, &g, K, trans_w, s2, w2, 2, (int64_t[]){g.R, K}, &t2), st, done);
      MOE_CHECK_GOTO(moe_binary(ctx, MOE_OP_ADD, t1, t2, &r), st, done);
    } else {
      r = t1, t1 = NULL;
    }
  }
  if (combine && !scat) {
    moe_tensor *rows = r;
    r = NULL;
    st = moe_routing_combine(ctx, rows, p, gates, &r);
    moe_tensor_release(rows);
    if (st != MOE_OK) goto done;
  }
  *out = r;
  r = NULL;
done:
  moe_grad_set(ctx, prev);
  for (int i = 0; i < 4; i++) moe_tensor_release(c[i]);
  moe_tensor_release(r), moe_tensor_release(t1), moe_tensor_release(t2);
  moe_tensor_release(gf), moe_tensor_release(gc);
  return st;
}

moe_status moe_bsmm_dsd_sum(moe_ctx *ctx, moe_tensor *s, moe_tensor *w, moe_tensor *s2,
                            moe_tensor *w2, moe_routing_plan *p, bool trans_w, moe_tensor **out) {
  if (!s2 || !w2) return moe_error(ctx, MOE_ERR_INVALID_ARG, "bsmm_dsd_sum: s2 or w2 is NULL");
  return bs_dsd_pair(ctx, "bsmm_dsd_sum", s, w, s2, w2, p, trans_w, false, NULL, out);
}

moe_status moe_bsmm_dsd_combine(moe_ctx *ctx, moe_tensor *s, moe_tensor *w, moe_tensor *s2,
                                moe_tensor *w2, moe_routing_plan *p, bool trans_w, moe_tensor *gates,
                                moe_tensor **out) {
  return bs_dsd_pair(ctx, "bsmm_dsd_combine", s, w, s2, w2, p, trans_w, true, gates, out);
}

moe_status moe_bsmm_dsd_t(moe_ctx *ctx, moe_tensor *s, moe_tensor *y, moe_routing_plan *p,
                          moe_tensor **out) {
  const char *fn = "bsmm_dsd_t";
  bs_geom g = {0};
  int64_t K = 0;
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: out is NULL", fn);
  MOE_CHECK(bs_check_plan(ctx, fn, p, &g));
  MOE_CHECK(bs_check_operand(ctx, fn, "s", s, p));
  MOE_CHECK(bs_check_operand(ctx, fn, "y", y, p));
  MOE_CHECK(moe_check_same_dtype(ctx, fn, "s", s->dtype, "y", y->dtype));
  MOE_CHECK(bs_check_sparse(ctx, fn, "s", s, &g));
  MOE_CHECK(bs_check_dense(ctx, fn, "y", y, p, &g, &K));
  return bs_run(ctx, fn, BS_DSD_T, p, &g, K, false, s, y, 3, (int64_t[]){g.EL, g.N, K}, out);
}

moe_status moe_bsmm_dds(moe_ctx *ctx, moe_tensor *x, moe_tensor *s, moe_routing_plan *p,
                        moe_tensor **out) {
  const char *fn = "bsmm_dds";
  bs_geom g = {0};
  int64_t K = 0;
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: out is NULL", fn);
  MOE_CHECK(bs_check_plan(ctx, fn, p, &g));
  MOE_CHECK(bs_check_operand(ctx, fn, "x", x, p));
  MOE_CHECK(bs_check_operand(ctx, fn, "s", s, p));
  MOE_CHECK(moe_check_same_dtype(ctx, fn, "x", x->dtype, "s", s->dtype));
  MOE_CHECK(bs_check_dense(ctx, fn, "x", x, p, &g, &K));
  MOE_CHECK(bs_check_sparse(ctx, fn, "s", s, &g));
  return bs_run(ctx, fn, BS_DDS, p, &g, K, false, x, s, 3, (int64_t[]){g.EL, K, g.N}, out);
}

/* ------------------------------------------------------------ autograd */

/* --------------------------------------------- products with a gather */

/* Whether a gather of t's rows runs inside the kernel (else the rows are
 * permuted into a copy first): bf16 on CUDA with the wgmma kernel. */
bool moe_bsmm_gathers(moe_ctx *ctx, const moe_routing_plan *p, moe_dtype dt) {
  return ctx && p && bs_cuda(p) && p->src && p->N <= INT32_MAX &&
         dt == MOE_BF16 &&
         moe_cuda_bsmm_wgmma(ctx, p->device.index, dt);
}
static bool bs_gathers(moe_ctx *ctx, const moe_routing_plan *p, const moe_tensor *t) {
  return moe_bsmm_gathers(ctx, p, t->dtype);
}

/* permute(t) by the plan with grad mode off (the fallback of a gather). */
static moe_status bs_permuted(moe_ctx *ctx, moe_tensor *t, moe_routing_plan *p, moe_tensor **out) {
  bool prev = moe_grad_set(ctx, false);
  moe_status st = moe_routing_permute(ctx, t, p, out);
  moe_grad_set(ctx, prev);
  return st;
}

/* The common checks of a gather variant: the plan, both operands (same
 * dtype), the token operand tok (T, K). */
static moe_status bs_gather_check(moe_ctx *ctx, const char *fn, moe_routing_plan *p,
                                  const char *tok_name, moe_tensor *tok, const char *other_name,
                                  moe_tensor *other, moe_tensor **out, bs_geom *g, int64_t *K) {
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: out is NULL", fn);
  MOE_CHECK(bs_check_plan(ctx, fn, p, g));
  MOE_CHECK(bs_check_operand(ctx, fn, tok_name, tok, p));
  MOE_CHECK(bs_check_operand(ctx, fn, other_name, other, p));
  MOE_CHECK(moe_check_same_dtype(ctx, fn, tok_name, tok->dtype, other_name, other->dtype));
  if (moe_grad_enabled(ctx) && (moe_requires_grad(tok) || moe_requires_grad(other)))
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "%s: not differentiable, and %s requires grad: run it with grad mode off, or "
                     "permute the rows and use the differentiable product", fn,
                     moe_requires_grad(tok) ? tok_name : other_name);
  return bs_check_tokens(ctx, fn, tok_name, tok, p, K);
}

/* Runs a checked product whose token operand tok is a (tok_first) or c:
 * gathered inside the kernel, or permuted into a copy first. */
static moe_status bs_gather_run(moe_ctx *ctx, const char *fn, bs_kind kind, moe_routing_plan *p,
                                const bs_geom *g, int64_t K, bool trans_w, bool tok_first,
                                moe_tensor *tok, moe_tensor *other, const int64_t *shape,
                                moe_tensor **out) {
  moe_tensor *a = tok_first ? tok : other, *c = tok_first ? other : tok;
  if (bs_gathers(ctx, p, tok)) return bs_run_ex(ctx, fn, kind, p, g, K, trans_w, a, c, 3, shape, true, out);
  moe_tensor *rows = NULL;
  MOE_CHECK(bs_permuted(ctx, tok, p, &rows));
  moe_status st = bs_run(ctx, fn, kind, p, g, K, trans_w, tok_first ? rows : a, tok_first ? c : rows,
                         3, shape, out);
  moe_tensor_release(rows);
  return st;
}

moe_status moe_bsmm_sdd_gather(moe_ctx *ctx, moe_tensor *x, moe_tensor *w, moe_routing_plan *p,
                               bool trans_w, moe_tensor **out) {
  const char *fn = "bsmm_sdd_gather";
  bs_geom g = {0};
  int64_t K = 0;
  MOE_CHECK(bs_gather_check(ctx, fn, p, "x", x, "w", w, out, &g, &K));
  MOE_CHECK(bs_check_w(ctx, fn, w, &g, K, !trans_w));
  return bs_gather_run(ctx, fn, BS_SDD, p, &g, K, trans_w, true, x, w,
                       (int64_t[]){g.nnz, g.b, g.b}, out);
}

moe_status moe_bsmm_dds_gather(moe_ctx *ctx, moe_tensor *x, moe_tensor *s, moe_routing_plan *p,
                               moe_tensor **out) {
  const char *fn = "bsmm_dds_gather";
  bs_geom g = {0};
  int64_t K = 0;
  MOE_CHECK(bs_gather_check(ctx, fn, p, "x", x, "s", s, out, &g, &K));
  MOE_CHECK(bs_check_sparse(ctx, fn, "s", s, &g));
  return bs_gather_run(ctx, fn, BS_DDS, p, &g, K, false, true, x, s, (int64_t[]){g.EL, K, g.N}, out);
}

moe_status moe_bsmm_dsd_t_gather(moe_ctx *ctx, moe_tensor *s, moe_tensor *y, moe_routing_plan *p,
                                 moe_tensor **out) {
  const char *fn = "bsmm_dsd_t_gather";
  bs_geom g = {0};
  int64_t K = 0;
  MOE_CHECK(bs_gather_check(ctx, fn, p, "y", y, "s", s, out, &g, &K));
  MOE_CHECK(bs_check_sparse(ctx, fn, "s", s, &g));
  return bs_gather_run(ctx, fn, BS_DSD_T, p, &g, K, false, false, y, s, (int64_t[]){g.EL, g.N, K}, out);
}

static void bs_plan_release_void(void *p) { moe_routing_plan_release((moe_routing_plan *)p); }

/* Shared by SDD and DSD: inputs (a, w) saved in slots 0, 1; iargs[0] =
 * trans_w; iargs[1] = 0 for SDD, 1 for DSD. */
static moe_status bs_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                              moe_tensor **gin) {
  moe_routing_plan *p = (moe_routing_plan *)n->user;
  bool trans_w = n->iargs[0] != 0, dsd = n->iargs[1] != 0;
  if (!gout[0]) return moe_node_zero_grads(ctx, n, gin);
  moe_tensor *a = NULL, *w = NULL;
  moe_status st = MOE_OK;
  moe_tensor *g = gout[0];
  if (moe_node_needs_grad(n, 0)) {
    MOE_CHECK_GOTO(moe_node_saved(ctx, n, 1, &w), st, done);
    /* SDD: dx = DSD(dS, w, !trans_w); DSD: ds = SDD(dout, w, !trans_w) */
    if (dsd) MOE_CHECK_GOTO(bs_sdd_raw(ctx, g, w, p, !trans_w, &gin[0]), st, done);
    else MOE_CHECK_GOTO(bs_dsd_raw(ctx, g, w, p, !trans_w, &gin[0]), st, done);
  }
  if (moe_node_needs_grad(n, 1)) {
    MOE_CHECK_GOTO(moe_node_saved(ctx, n, 0, &a), st, done);
    if (!dsd) { /* a = x, g = dS */
      if (!trans_w) MOE_CHECK_GOTO(moe_bsmm_dds(ctx, a, g, p, &gin[1]), st, done);
      else MOE_CHECK_GOTO(moe_bsmm_dsd_t(ctx, g, a, p, &gin[1]), st, done);
    } else { /* a = s, g = dout */
      if (!trans_w) MOE_CHECK_GOTO(moe_bsmm_dsd_t(ctx, a, g, p, &gin[1]), st, done);
      else MOE_CHECK_GOTO(moe_bsmm_dds(ctx, g, a, p, &gin[1]), st, done);
    }
  }
done:
  moe_tensor_release(a);
  moe_tensor_release(w);
  return st;
}

/* Records the node of SDD (dsd false) or DSD over inputs (a, w) on *out;
 * moe_record's failure contract. */
static moe_status bs_node(moe_ctx *ctx, bool dsd, moe_tensor *a, moe_tensor *w,
                          moe_routing_plan *p, bool trans_w, moe_tensor **out) {
  moe_routing_plan_retain(p); /* the node's; released by bs_plan_release_void */
  /* the gradient of a needs w and that of w needs a */
  return moe_record(ctx, &(moe_record_spec){
      .op = dsd ? MOE_OP_BSMM_DSD : MOE_OP_BSMM_SDD, .backward = bs_backward,
      .n_in = 2, .in = {a, w}, .n_save = 2, .save = {a, w},
      .iargs = {trans_w ? 1 : 0, dsd ? 1 : 0},
      .user = p, .user_free = bs_plan_release_void}, 1, out);
}

bool moe_bsmm_glu_fuses(moe_ctx *ctx, const moe_routing_plan *p, moe_dtype dt) {
  return ctx && p && bs_cuda(p) && dt == MOE_BF16 && moe_cuda_bsmm_wgmma(ctx, p->device.index, dt) &&
         ctx->knobs.bsmm_glu;
}

moe_status moe_bsmm_sdd_glu(moe_ctx *ctx, moe_tensor *x, moe_tensor *w1, moe_tensor *w3,
                            moe_routing_plan *p, int act, moe_tensor **h1, moe_tensor **h3,
                            moe_tensor **a) {
  const char *fn = "bsmm_sdd_glu";
  bs_geom g = {0};
  int64_t K = 0;
  if (!h1 || !h3 || !a) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: h1, h3 or a is NULL", fn);
  MOE_CHECK(bs_check_plan(ctx, fn, p, &g));
  moe_tensor *in[3] = {x, w1, w3};
  const char *names[3] = {"x", "w1", "w3"};
  for (int i = 0; i < 3; i++) {
    MOE_CHECK(bs_check_operand(ctx, fn, names[i], in[i], p));
    MOE_CHECK(moe_check_same_dtype(ctx, fn, "x", x->dtype, names[i], in[i]->dtype));
    if (moe_grad_enabled(ctx) && moe_requires_grad(in[i]))
      return moe_error(ctx, MOE_ERR_INVALID_ARG,
                       "%s: not differentiable, and %s requires grad: run it with grad mode off, or "
                       "use two moe_bsmm_sdd and the activation", fn, names[i]);
  }
  if (act < 0 || act > 2)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: activation must be 0 (silu), 1 (gelu) or 2 (gelu_tanh), got %d",
                     fn, act);
  if (!moe_bsmm_glu_fuses(ctx, p, x->dtype))
    return moe_error(ctx, MOE_ERR_NOT_SUPPORTED,
                     "%s: runs on the sm_90a wgmma kernel only (bf16 on compute capability 9.x, "
                     "MOE_BSMM_GLU=1); got %s on %s", fn, moe_dtype_name(x->dtype),
                     bs_cuda(p) ? "this CUDA device" : "the CPU");
  MOE_CHECK(bs_check_dense(ctx, fn, "x", x, p, &g, &K));
  MOE_CHECK(bs_check_w(ctx, fn, w1, &g, K, true));
  MOE_CHECK(bs_check_w(ctx, fn, w3, &g, K, true));
  moe_status st = MOE_OK;
  moe_tensor *c[3] = {0}, *r[3] = {0};
  const int64_t shape[3] = {g.nnz, g.b, g.b};
  for (int i = 0; i < 3; i++) {
    MOE_CHECK_GOTO(bs_prepare(ctx, in[i], x->dtype, &c[i]), st, done);
    MOE_CHECK_GOTO(moe_tensor_empty(ctx, 3, shape, x->dtype, p->device, &r[i]), st, done);
  }
  if (g.nnz > 0) {
    moe_bs_topo tp = bs_topo(p, &g);
    MOE_CHECK_GOTO(moe_cuda_bsmm_sdd_glu(ctx, p->device.index, x->dtype, &tp, moe_tensor_data(c[0]),
                                         moe_tensor_data(c[1]), moe_tensor_data(c[2]), K, act,
                                         moe_tensor_data(r[0]), moe_tensor_data(r[1]),
                                         moe_tensor_data(r[2])),
                   st, done);
  }
  *h1 = r[0], *h3 = r[1], *a = r[2];
  r[0] = r[1] = r[2] = NULL;
done:
  for (int i = 0; i < 3; i++) moe_tensor_release(c[i]), moe_tensor_release(r[i]);
  return st;
}

moe_status moe_bsmm_sdd(moe_ctx *ctx, moe_tensor *x, moe_tensor *w, moe_routing_plan *p,
                        bool trans_w, moe_tensor **out) {
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "bsmm_sdd: out is NULL");
  moe_tensor *r;
  MOE_CHECK(bs_sdd_raw(ctx, x, w, p, trans_w, &r));
  MOE_CHECK(bs_node(ctx, false, x, w, p, trans_w, &r));
  *out = r;
  return MOE_OK;
}

moe_status moe_bsmm_dsd(moe_ctx *ctx, moe_tensor *s, moe_tensor *w, moe_routing_plan *p,
                        bool trans_w, moe_tensor **out) {
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "bsmm_dsd: out is NULL");
  moe_tensor *r;
  MOE_CHECK(bs_dsd_raw(ctx, s, w, p, trans_w, &r));
  MOE_CHECK(bs_node(ctx, true, s, w, p, trans_w, &r));
  *out = r;
  return MOE_OK;
}

/* ---------------------------------------------------- dense conversions */

static moe_status bs_convert(moe_ctx *ctx, const char *fn, bool to_dense, moe_tensor *in,
                             moe_routing_plan *p, moe_tensor **out) {
  bs_geom g = {0};
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: out is NULL", fn);
  MOE_CHECK(bs_check_plan(ctx, fn, p, &g));
  MOE_CHECK(bs_check_operand(ctx, fn, to_dense ? "s" : "dense", in, p));
  if (to_dense) MOE_CHECK(bs_check_sparse(ctx, fn, "s", in, &g));
  else
    MOE_CHECK(bs_check_shape(ctx, fn, "dense", in, 2, (int64_t[]){g.R, g.EL * g.N},
                             "(R, E_loc * N)"));
  moe_tensor *c = NULL, *r = NULL;
  bool prev = moe_grad_set(ctx, false);
  moe_status st = moe_contiguous(ctx, in, &c);
  if (st == MOE_OK && bs_cuda(p) && ((uintptr_t)moe_tensor_data(c) & 15u) != 0) {
    moe_tensor *a = NULL;
    st = moe_clone(ctx, c, &a);
    moe_tensor_release(c);
    c = a;
  }
  moe_grad_set(ctx, prev);
  if (st != MOE_OK) return st;
  if (to_dense) st = moe_tensor_full(ctx, 2, (int64_t[]){g.R, g.EL * g.N}, 0.0, in->dtype, p->device, &r);
  else st = moe_tensor_empty(ctx, 3, (int64_t[]){g.nnz, g.b, g.b}, in->dtype, p->device, &r);
  if (st != MOE_OK) goto done;
  if (bs_cuda(p)) {
    moe_bs_topo tp = bs_topo(p, &g);
    if (to_dense)
      st = moe_cuda_bsmm_to_dense(ctx, p->device.index, in->dtype, &tp, moe_tensor_data(c),
                                  moe_tensor_data(r));
    else
      st = moe_cuda_bsmm_from_dense(ctx, p->device.index, in->dtype, &tp, moe_tensor_data(c),
                                    moe_tensor_data(r));
  } else {
    size_t es = moe_dtype_size(in->dtype);
    const int64_t *ri = bs_idx(p->bs_row_indices), *ci = bs_idx(p->bs_column_indices);
    int64_t ld = g.EL * g.N, b = g.b;
    char *s = (char *)moe_tensor_data(to_dense ? c : r), *d = (char *)moe_tensor_data(to_dense ? r : c);
    for (int64_t i = 0; i < g.nnz; i++)
      for (int64_t row = 0; row < b; row++) {
        char *sp = s + (i * b * b + row * b) * (int64_t)es;
        char *dp = d + ((ri[i] * b + row) * ld + ci[i] * b) * (int64_t)es;
        if (to_dense) memcpy(dp, sp, (size_t)b * es);
        else memcpy(sp, dp, (size_t)b * es);
      }
  }
  if (st == MOE_OK) {
    *out = r;
    r = NULL;
  }
done:
  moe_tensor_release(c);
  moe_tensor_release(r);
  return st;
}

moe_status moe_bsmm_to_dense(moe_ctx *ctx, moe_tensor *s, moe_routing_plan *p, moe_tensor **out) {
  return bs_convert(ctx, "bsmm_to_dense", true, s, p, out);
}

moe_status moe_bsmm_from_dense(moe_ctx *ctx, moe_tensor *dense, moe_routing_plan *p,
                               moe_tensor **out) {
  return bs_convert(ctx, "bsmm_from_dense", false, dense, p, out);
}
