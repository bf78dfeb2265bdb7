/*
 * test_experts_cuda.c - the experts family on CUDA against the f64 CPU op
 * (moe_experts.h): glu_experts forward and every gradient (x, w1, w3, w2,
 * gates) in f32 and bf16, grouped and sparse, at awkward sizes (T not a
 * multiple of 128, an empty expert, k = 1, 2, 8, d not a multiple of 64, f
 * not a multiple of 8: the kernels' scalar path);
 * parallel_linear's node in every form of x and output, gradients
 * included; bit-identical repeats (no atomics); the
 * bf16 paths' rows gathered inside the kernel (MOE_BSMM_GATHER=1: sparse
 * and grouped; =wgrad or memory_optimized, of glu_experts and of
 * parallel_linear: the weight gradients' products, and the backward's peak
 * without the permuted tokens) against a permuted copy, and top-1 rows scattered in token
 * order by the kernel against a combine pass, bit for bit; the GLU's
 * activation passes in the products' epilogues (MOE_BSMM_GLU=1) against the
 * separate passes; one host sync per plan. Exits 77 without a GPU.
 */
#include "half.h"
#include "harness.h"
#include "knobs.h" /* moe_knobs_reload after setenv */
#include "moe_routing.h"

static uint64_t rng_state = 0x2545f4914f6cdd1dull;
static double urand(void) { /* [-1, 1) */
  rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
  return (double)(rng_state >> 11) / 4503599627370496.0 - 1.0;
}

static double *rvals(int64_t n, double scale) {
  double *v = malloc(sizeof(double) * (size_t)(n + 1));
  for (int64_t i = 0; i < n; i++) v[i] = scale * urand();
  return v;
}

typedef struct ex_case {
  int64_t T, k, E, E_used, d, f, bs; /* bs 0: an unpadded plan (grouped only) */
} ex_case;

/* Max |a - b| over the max |b|: the error relative to the tensor's scale. */
static double rel_err(moe_ctx *ctx, moe_tensor *got, moe_tensor *want) {
  int64_t n = moe_tensor_numel(want);
  double *a = malloc(sizeof(double) * (size_t)(n + 1)), *b = malloc(sizeof(double) * (size_t)(n + 1));
  double err = 0, scale = 0;
  if (moe_tensor_to_f64(ctx, got, a) != MOE_OK || moe_tensor_to_f64(ctx, want, b) != MOE_OK ||
      moe_tensor_numel(got) != n)
    err = INFINITY;
  else
    for (int64_t i = 0; i < n; i++) {
      err = fmax(err, fabs(a[i] - b[i]));
      scale = fmax(scale, fabs(b[i]));
    }
  free(a), free(b);
  return scale > 0 ? err / scale : err;
}

/* The allocator's peak during run_opts's last backward, above what was
 * allocated when it began (bytes). */
static int64_t last_bwd_peak = -1;

/* Runs glu_experts on device dev in dtype dt from the f64 host values;
 * res[0] = out, res[1..5] = grads of x, w1, w3, w2, gates (f64 CPU copies).
 * Returns the plan's host_syncs. */
static int64_t run_opts(moe_ctx *ctx, const ex_case *c, const int64_t *ids, double *const *vals,
                        moe_device dev, moe_dtype dt, moe_experts_impl impl,
                        const moe_glu_experts_opts *qo, moe_tensor **res) {
  int64_t shapes[6][3] = {{c->T, c->d}, {c->E, c->d, c->f}, {c->E, c->d, c->f},
                          {c->E, c->f, c->d}, {c->T, c->k}, {c->T, c->d}};
  int nd[6] = {2, 3, 3, 3, 2, 2};
  moe_tensor *t[6] = {0};
  for (int i = 0; i < 6; i++) {
    EXPECT_OK(moe_tensor_from_f64(ctx, vals[i], nd[i], shapes[i], dt, dev, &t[i]));
    if (i < 5) EXPECT_OK(moe_set_requires_grad(ctx, t[i], true));
  }
  double *idv = malloc(sizeof(double) * (size_t)(c->T * c->k));
  for (int64_t i = 0; i < c->T * c->k; i++) idv[i] = (double)ids[i];
  moe_tensor *tid = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, idv, 2, (int64_t[]){c->T, c->k}, MOE_I64, dev, &tid));
  free(idv);
  moe_routing_opts o = moe_routing_opts_default();
  o.block_size = c->bs;
  o.ffn_hidden = c->bs ? c->f : 0;
  moe_routing_plan *p = NULL;
  EXPECT_OK(moe_routing_plan_new(ctx, tid, c->E, &o, &p));
  moe_tensor *out = NULL;
  int64_t syncs = -1;
  moe_glu_experts_opts go = qo ? *qo : moe_glu_experts_opts_default();
  go.impl = impl;
  moe_rng_seed(ctx, 77); /* stochastic rounding: the same draws on every run */
  if (p) EXPECT_OK(moe_glu_experts_ex(ctx, t[0], t[1], t[2], t[3], p, t[4], &go, &out));
  if (out) {
    moe_memory_stats m0, m1;
    EXPECT_OK(moe_memory_stats_get(ctx, dev, &m0));
    EXPECT_OK(moe_memory_reset_peak(ctx, dev));
    EXPECT_OK(moe_backward(ctx, out, t[5], false));
    EXPECT_OK(moe_memory_stats_get(ctx, dev, &m1));
    last_bwd_peak = m1.peak_allocated - m0.allocated;
    EXPECT_OK(moe_to(ctx, out, MOE_F64, MOE_CPU, &res[0]));
    for (int i = 0; i < 5; i++) {
      moe_tensor *g = moe_tensor_grad(t[i]);
      EXPECT(g != NULL);
      if (g) EXPECT_OK(moe_to(ctx, g, MOE_F64, MOE_CPU, &res[i + 1]));
    }
    syncs = p->host_syncs;
  }
  moe_tensor_release(out);
  moe_tensor_release(tid);
  moe_routing_plan_release(p);
  for (int i = 0; i < 6; i++) moe_tensor_release(t[i]);
  return syncs;
}

/* A case's routing (k distinct experts a token among the first E_used) and
   its x, w1, w3, w2, gates and output gradient, weights ~ 1/sqrt(fan-in) so
   activations stay O(1). The caller frees ids and the six arrays. */
static void case_inputs(const ex_case *c, int64_t **ids_out, double *vals[6]) {
  int64_t *ids = malloc(sizeof(int64_t) * (size_t)(c->T * c->k));
  for (int64_t t = 0; t < c->T; t++)
    for (int64_t j = 0; j < c->k; j++) {
      int64_t e;
      bool dup;
      do {
        e = (int64_t)((urand() + 1.0) * 0.5 * (double)c->E_used) % c->E_used;
        dup = false;
        for (int64_t i = 0; i < j; i++) dup = dup || ids[t * c->k + i] == e;
      } while (dup);
      ids[t * c->k + j] = e;
    }
  vals[0] = rvals(c->T * c->d, 1.0);
  vals[1] = rvals(c->E * c->d * c->f, 1.0 / sqrt((double)c->d));
  vals[2] = rvals(c->E * c->d * c->f, 1.0 / sqrt((double)c->d));
  vals[3] = rvals(c->E * c->f * c->d, 1.0 / sqrt((double)c->f));
  vals[4] = rvals(c->T * c->k, 1.0);
  vals[5] = rvals(c->T * c->d, 1.0);
  *ids_out = ids;
}

static int64_t run(moe_ctx *ctx, const ex_case *c, const int64_t *ids, double *const *vals,
                   moe_device dev, moe_dtype dt, moe_experts_impl impl, moe_tensor **res) {
  return run_opts(ctx, c, ids, vals, dev, dt, impl, NULL, res);
}

/* Runs the case again with the knob env = value and expects the bits of
 * got (the defaults' run). */
static void same_with_knob(moe_ctx *ctx, const ex_case *c, const int64_t *ids, double *const *vals,
                           moe_device dev, moe_dtype dt, int impl, const char *env, const char *value,
                           moe_tensor *const *got, int ci) {
  moe_tensor *res[6] = {0};
  setenv(env, value, 1);
  EXPECT_OK(moe_knobs_reload(ctx));
  run(ctx, c, ids, vals, dev, dt, (moe_experts_impl)impl, res);
  unsetenv(env);
  EXPECT_OK(moe_knobs_reload(ctx));
  for (int i = 0; i < 6; i++) {
    bool same = res[i] && got[i] && rel_err(ctx, res[i], got[i]) == 0.0;
    if (!same) fprintf(stderr, "case %d impl %d tensor %d: %s=%s differs from the default\n", ci, impl, i, env, value);
    EXPECT(same);
    moe_tensor_release(res[i]);
  }
}

static void test_glu_cuda_vs_cpu(moe_ctx *ctx) {
  const ex_case cases[] = {
      {300, 2, 8, 8, 64, 256, 128},   /* T not a multiple of 128 */
      {1000, 8, 64, 63, 128, 128, 128}, /* k = 8, expert 63 empty */
      {77, 1, 3, 2, 40, 72, 0},       /* tiny, d and f not multiples of 64 */
      {65, 2, 5, 5, 24, 36, 0},       /* f % 8 != 0: the scalar bf16 backward pass */
      {500, 1, 16, 15, 128, 256, 128}, /* k = 1: rows scattered in token order; expert 15 empty */
  };
  moe_device gpu = {MOE_DEVICE_CUDA, 0};
  for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
    const ex_case *c = &cases[ci];
    int64_t *ids = NULL;
    double *vals[6];
    case_inputs(c, &ids, vals);
    for (int dtc = 0; dtc < 2; dtc++) {
      moe_dtype dt = dtc ? MOE_BF16 : MOE_F32;
      /* the reference sees the values rounded to dt */
      double *rv[6];
      for (int i = 0; i < 6; i++) {
        int64_t n = i == 0 || i == 5 ? c->T * c->d : i == 4 ? c->T * c->k : c->E * c->d * c->f;
        rv[i] = malloc(sizeof(double) * (size_t)n);
        for (int64_t j = 0; j < n; j++) {
          if (dt == MOE_BF16) rv[i][j] = moe_bf16_to_f32(moe_f32_to_bf16((float)vals[i][j]));
          else rv[i][j] = (float)vals[i][j];
        }
      }
      moe_tensor *ref[6] = {0};
      EXPECT(run(ctx, c, ids, rv, MOE_CPU, MOE_F64, MOE_EXPERTS_GROUPED, ref) == 1);
      for (int impl = 0; impl < (c->bs ? 2 : 1); impl++) {
        moe_tensor *got[6] = {0}, *again[6] = {0};
        /* one host synchronisation for forward and backward (the plan's
         * counts), none where the grouped products read the offsets on the
         * device (bf16 on the sm_90a kernel, d and f multiples of 8) and the
         * plan's rows do not depend on the data (a padded plan copies its
         * counts when it is made) */
        bool on_dev = impl == MOE_EXPERTS_GROUPED && c->bs == 0 &&
                      moe_grouped_offsets_on_device(ctx, gpu, dt, c->E, c->d, c->f) &&
                      moe_grouped_offsets_on_device(ctx, gpu, dt, c->E, c->f, c->d);
        int64_t syncs = run(ctx, c, ids, rv, gpu, dt, (moe_experts_impl)impl, got);
        EXPECT(syncs == (on_dev ? 0 : 1));
        if (syncs != (on_dev ? 0 : 1))
          fprintf(stderr, "case %d %s impl %d: %lld host syncs\n", (int)ci, moe_dtype_name(dt), impl,
                  (long long)syncs);
        run(ctx, c, ids, rv, gpu, dt, (moe_experts_impl)impl, again);
        if (dt == MOE_BF16) {
          /* top-1 plans: the output and input-gradient rows written in token
           * order by the kernel's epilogue (MOE_BSMM_SCATTER, the default) or
           * combined in a pass; rows gathered inside the kernel
           * (MOE_BSMM_GATHER=1, both impls; =wgrad, the weight gradients'
           * products only) or a permuted copy: the same bits */
          same_with_knob(ctx, c, ids, rv, gpu, dt, impl, "MOE_BSMM_SCATTER", "0", got, (int)ci);
          same_with_knob(ctx, c, ids, rv, gpu, dt, impl, "MOE_BSMM_GATHER", "1", got, (int)ci);
          same_with_knob(ctx, c, ids, rv, gpu, dt, impl, "MOE_BSMM_GATHER", "wgrad", got, (int)ci);
        }
        bool gg_fuses = impl == MOE_EXPERTS_GROUPED && moe_grouped_offsets_on_device(ctx, gpu, dt, c->E, c->d, c->f) &&
                        moe_grouped_offsets_on_device(ctx, gpu, dt, c->E, c->f, c->d);
        if (dt == MOE_BF16 && (impl == MOE_EXPERTS_SPARSE || gg_fuses)) {
          /* h1, h3 and a from one kernel (MOE_BSMM_GLU=1) or two products and
           * the activation pass (the default): the same bits, every
           * activation. Grouped, the backward pass is dA0's product's
           * epilogue too: the same bits but for the gates' gradient, whose
           * rows are summed over 256-column tiles first */
          for (int act = 0; act < 3; act++) {
            moe_glu_experts_opts ao = moe_glu_experts_opts_default();
            ao.act = (moe_glu_activation)act;
            moe_tensor *fused[6] = {0}, *apart[6] = {0};
            run_opts(ctx, c, ids, rv, gpu, dt, (moe_experts_impl)impl, &ao, apart);
            setenv("MOE_BSMM_GLU", "1", 1);
            EXPECT_OK(moe_knobs_reload(ctx));
            if (impl == MOE_EXPERTS_SPARSE) { /* the fused kernel does run here (bf16 on the sm_90a kernel) */
              double one = 0;
              moe_tensor *tid = NULL;
              moe_routing_plan *fp = NULL;
              moe_routing_opts ro = moe_routing_opts_default();
              ro.block_size = c->bs, ro.ffn_hidden = c->f;
              EXPECT_OK(moe_tensor_from_f64(ctx, &one, 2, (int64_t[]){1, 1}, MOE_I64, gpu, &tid));
              if (tid) EXPECT_OK(moe_routing_plan_new(ctx, tid, c->E, &ro, &fp));
              EXPECT(fp && moe_bsmm_glu_fuses(ctx, fp, dt));
              moe_routing_plan_release(fp);
              moe_tensor_release(tid);
            }
            run_opts(ctx, c, ids, rv, gpu, dt, (moe_experts_impl)impl, &ao, fused);
            unsetenv("MOE_BSMM_GLU");
            EXPECT_OK(moe_knobs_reload(ctx));
            for (int i = 0; i < 6; i++) {
              double lim = i == 5 && impl == MOE_EXPERTS_GROUPED ? 1e-5 : 0.0;
              bool same = fused[i] && apart[i] && rel_err(ctx, fused[i], apart[i]) <= lim;
              if (!same)
                fprintf(stderr, "case %d impl %d activation %d tensor %d: fused GLU and the separate passes differ\n",
                        (int)ci, impl, act, i);
              EXPECT(same);
              moe_tensor_release(fused[i]), moe_tensor_release(apart[i]);
            }
          }
        }
        { /* memory_optimized (a recomputed in the backward): the same bits */
          moe_glu_experts_opts mo = moe_glu_experts_opts_default();
          mo.memory_optimized = true;
          moe_tensor *rec[6] = {0};
          run_opts(ctx, c, ids, rv, gpu, dt, (moe_experts_impl)impl, &mo, rec);
          for (int i = 0; i < 6; i++) {
            bool same = rec[i] && got[i] && rel_err(ctx, rec[i], got[i]) == 0.0;
            if (!same) fprintf(stderr, "case %d tensor %d: memory_optimized differs\n", (int)ci, i);
            EXPECT(same);
            moe_tensor_release(rec[i]);
          }
        }
        /* f32: cuBLAS(Lt) f32 GEMMs (no TF32) of depth <= 256 and the f32
         * fused pass: 1e-4 of each tensor's largest magnitude. bf16: h1,
         * h3, a, y and every gradient stored with 8 mantissa bits
         * (relative 2^-9 per rounding, a few roundings deep): 3e-2. */
        double tol = dt == MOE_F32 ? 1e-4 : 3e-2;
        for (int i = 0; i < 6; i++) {
          if (!got[i] || !ref[i]) {
            EXPECT(false);
            continue;
          }
          double e = rel_err(ctx, got[i], ref[i]);
          if (!(e <= tol))
            fprintf(stderr, "case %d %s impl %d tensor %d: relative error %g > %g\n", (int)ci,
                    moe_dtype_name(dt), impl, i, e, tol);
          EXPECT(e <= tol);
          /* deterministic: the same bits on a repeat */
          EXPECT(again[i] && rel_err(ctx, again[i], got[i]) == 0.0);
        }
        for (int i = 0; i < 6; i++) moe_tensor_release(got[i]), moe_tensor_release(again[i]);
      }
      for (int i = 0; i < 6; i++) moe_tensor_release(ref[i]), free(rv[i]);
    }
    for (int i = 0; i < 6; i++) free(vals[i]);
    free(ids);
  }
}

/* parallel_linear cases: x "tokens" (T, K) gathered, "rows" (R, K) or the
 * sparse "hidden" (nnz, b, b); the output rows, or scattered to tokens
 * with or without gates. */
typedef struct pl_case {
  int64_t T, k, E, K, N, bs; /* bs > 0: impl sparse on a plan padded to it */
  bool gather, sparse_in, scatter, gates, trans_w;
} pl_case;

/* pl_run's memory_optimized option, and its last backward's allocator peak
 * above what was allocated when the backward began (bytes). */
static bool pl_memopt = false;
static int64_t pl_last_peak = -1;

/* Runs parallel_linear forward and backward on dev in dt from the f64 values
 * (x, w, gates, dout: sized by the case; x's rows: R or T, or nnz * b);
 * res[0] = out, res[1..3] = the grads of x, w, gates (f64 CPU copies). */
static void pl_run(moe_ctx *ctx, const pl_case *c, const int64_t *ids, double *const *vals,
                   moe_device dev, moe_dtype dt, moe_tensor **res) {
  double *idv = malloc(sizeof(double) * (size_t)(c->T * c->k));
  for (int64_t i = 0; i < c->T * c->k; i++) idv[i] = (double)ids[i];
  moe_tensor *tid = NULL, *x = NULL, *w = NULL, *g = NULL, *y = NULL, *dy = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, idv, 2, (int64_t[]){c->T, c->k}, MOE_I64, dev, &tid));
  free(idv);
  moe_routing_opts o = moe_routing_opts_default();
  o.block_size = c->bs;
  o.ffn_hidden = c->bs ? (c->sparse_in ? c->K : c->N) : 0;
  moe_routing_plan *p = NULL;
  EXPECT_OK(moe_routing_plan_new(ctx, tid, c->E, &o, &p));
  if (!p) goto out;
  int64_t rows = c->gather ? c->T : p->rows;
  if (c->sparse_in)
    EXPECT_OK(moe_tensor_from_f64(ctx, vals[0], 3, (int64_t[]){p->nnz, c->bs, c->bs}, dt, dev, &x));
  else
    EXPECT_OK(moe_tensor_from_f64(ctx, vals[0], 2, (int64_t[]){rows, c->K}, dt, dev, &x));
  int64_t ws[3] = {c->E, c->trans_w ? c->N : c->K, c->trans_w ? c->K : c->N};
  EXPECT_OK(moe_tensor_from_f64(ctx, vals[1], 3, ws, dt, dev, &w));
  EXPECT_OK(moe_set_requires_grad(ctx, x, true));
  EXPECT_OK(moe_set_requires_grad(ctx, w, true));
  if (c->gates) {
    EXPECT_OK(moe_tensor_from_f64(ctx, vals[2], 2, (int64_t[]){c->T, c->k}, dt, dev, &g));
    EXPECT_OK(moe_set_requires_grad(ctx, g, true));
  }
  moe_parallel_linear_opts po = moe_parallel_linear_opts_default();
  po.impl = c->bs ? MOE_EXPERTS_SPARSE : MOE_EXPERTS_GROUPED;
  po.gather = c->gather, po.scatter = c->scatter, po.trans_w = c->trans_w, po.gates = g;
  po.memory_optimized = pl_memopt;
  EXPECT_OK(moe_parallel_linear(ctx, x, w, p, &po, &y));
  if (!y) goto out;
  EXPECT_OK(moe_tensor_from_f64(ctx, vals[3], y->ndim, y->shape, dt, dev, &dy));
  moe_memory_stats m0, m1;
  EXPECT_OK(moe_memory_stats_get(ctx, dev, &m0));
  EXPECT_OK(moe_memory_reset_peak(ctx, dev));
  EXPECT_OK(moe_backward(ctx, y, dy, false));
  EXPECT_OK(moe_memory_stats_get(ctx, dev, &m1));
  pl_last_peak = m1.peak_allocated - m0.allocated;
  EXPECT_OK(moe_to(ctx, y, MOE_F64, MOE_CPU, &res[0]));
  moe_tensor *in[3] = {x, w, g};
  for (int i = 0; i < 3; i++) {
    if (!in[i]) continue;
    moe_tensor *gr = moe_tensor_grad(in[i]);
    EXPECT(gr != NULL);
    if (gr) EXPECT_OK(moe_to(ctx, gr, MOE_F64, MOE_CPU, &res[i + 1]));
  }
out:
  moe_tensor_release(tid), moe_tensor_release(x), moe_tensor_release(w), moe_tensor_release(g);
  moe_tensor_release(y), moe_tensor_release(dy);
  moe_routing_plan_release(p);
}

/* pl_run with the knob env = value; expects the bits of got, except that
 * the gradient of w may differ by w_tol (relative to its scale). */
static void pl_same_with_knob(moe_ctx *ctx, const pl_case *c, const int64_t *ids, double *const *vals,
                              const char *env, const char *value, moe_tensor *const *got, int ci,
                              double w_tol) {
  moe_tensor *res[4] = {0};
  moe_device gpu = {MOE_DEVICE_CUDA, 0};
  setenv(env, value, 1);
  EXPECT_OK(moe_knobs_reload(ctx));
  pl_run(ctx, c, ids, vals, gpu, MOE_BF16, res);
  unsetenv(env);
  EXPECT_OK(moe_knobs_reload(ctx));
  for (int i = 0; i < 4; i++) {
    bool same = (!res[i] && !got[i]) || (res[i] && got[i] && rel_err(ctx, res[i], got[i]) <= (i == 2 ? w_tol : 0.0));
    if (!same) fprintf(stderr, "parallel_linear case %d tensor %d: %s=%s differs from the default\n", ci, i, env, value);
    EXPECT(same);
    moe_tensor_release(res[i]);
  }
}

/* parallel_linear (its own node) on CUDA, forward and the gradients of x,
 * w and gates, f32 and bf16, against the f64 CPU op on the same rounded
 * values, for each form of x and output, k = 1 and 2, trans_w, grouped and
 * sparse; bf16: rows gathered in the kernels (MOE_BSMM_GATHER=1) and top-1
 * rows scattered by them or combined in a pass (MOE_BSMM_SCATTER=0) give
 * the same bits (with gates and the gather, w's gradient rounds the gate's
 * product on the other operand: within bf16's rounding). */
static void test_parallel_linear_cuda(moe_ctx *ctx) {
  const pl_case cases[] = {
      {300, 2, 4, 64, 72, 0, true, false, false, false, false},   /* gather */
      {300, 1, 4, 64, 72, 0, true, false, false, false, true},    /* gather, trans_w, k = 1 */
      {300, 2, 4, 64, 72, 0, false, false, true, true, false},    /* scatter with gates */
      {257, 1, 4, 64, 72, 0, false, false, true, true, true},     /* scatter, k = 1: fused */
      {257, 1, 5, 64, 72, 0, false, false, true, false, false},   /* scatter without gates */
      {300, 2, 4, 64, 72, 0, true, false, true, true, false},     /* gather and scatter */
      {129, 1, 3, 64, 72, 0, true, false, true, false, false},    /* both, no gates, k = 1 */
      {200, 2, 3, 72, 64, 0, false, false, false, false, false},  /* rows to rows */
      {300, 2, 4, 64, 256, 128, true, false, false, false, false}, /* sparse: gather (SDD) */
      {300, 1, 4, 256, 64, 128, false, true, true, true, false},  /* sparse hidden, gated, k = 1 */
      {300, 2, 4, 256, 64, 128, false, true, true, true, true},   /* sparse hidden, gated, trans_w */
      {300, 2, 4, 256, 64, 128, false, true, false, false, false}, /* sparse hidden to rows */
  };
  moe_device gpu = {MOE_DEVICE_CUDA, 0};
  for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
    const pl_case *c = &cases[ci];
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)(c->T * c->k));
    for (int64_t t = 0; t < c->T; t++)
      for (int64_t j = 0; j < c->k; j++) ids[t * c->k + j] = (t * 7 + j * 3 + (t % 5) * j) % c->E;
    for (int64_t t = 0; t < c->T && c->k == 2; t++)
      if (ids[t * 2] == ids[t * 2 + 1]) ids[t * 2 + 1] = (ids[t * 2] + 1) % c->E;
    /* generous sizes: rows of x at most T k + E bs (padding) */
    int64_t xn = (c->T * c->k + c->E * (c->bs ? c->bs : 1)) * c->K, wn = c->E * c->K * c->N;
    int64_t dn = (c->T * c->k + c->E * (c->bs ? c->bs : 1)) * c->N;
    double *vals[4] = {rvals(xn, 1.0), rvals(wn, 1.0 / sqrt((double)c->K)), rvals(c->T * c->k, 1.0),
                       rvals(dn, 1.0)};
    for (int dtc = 0; dtc < 2; dtc++) {
      moe_dtype dt = dtc ? MOE_BF16 : MOE_F32;
      double *rv[4];
      int64_t ns[4] = {xn, wn, c->T * c->k, dn};
      for (int i = 0; i < 4; i++) {
        rv[i] = malloc(sizeof(double) * (size_t)ns[i]);
        for (int64_t j = 0; j < ns[i]; j++)
          rv[i][j] = dt == MOE_BF16 ? moe_bf16_to_f32(moe_f32_to_bf16((float)vals[i][j])) : (float)vals[i][j];
      }
      moe_tensor *ref[4] = {0}, *got[4] = {0};
      pl_run(ctx, c, ids, rv, MOE_CPU, MOE_F64, ref);
      pl_run(ctx, c, ids, rv, gpu, dt, got);
      /* f32: GEMMs of depth <= 300 on O(1) values; bf16: the products' and
       * the gradients' roundings, relative to each tensor's scale */
      double tol = dt == MOE_F32 ? 1e-4 : 2e-2;
      for (int i = 0; i < 4; i++) {
        bool have = i < 3 || c->gates;
        double e = have && got[i] && ref[i] ? rel_err(ctx, got[i], ref[i]) : (have ? INFINITY : 0);
        if (!(e <= tol))
          fprintf(stderr, "parallel_linear case %d %s tensor %d: error %g\n", (int)ci, moe_dtype_name(dt), i, e);
        EXPECT(e <= tol);
      }
      if (dt == MOE_BF16) {
        /* with gates and dout's rows read in place, the weight gradient
         * applies the gate to x's rows (rounded there) instead of dout's */
        pl_same_with_knob(ctx, c, ids, rv, "MOE_BSMM_GATHER", "1", got, (int)ci, c->gates ? 1e-2 : 0.0);
        /* only the weight gradient reads x's rows in place: the same bits */
        pl_same_with_knob(ctx, c, ids, rv, "MOE_BSMM_GATHER", "wgrad", got, (int)ci, 0.0);
        pl_same_with_knob(ctx, c, ids, rv, "MOE_BSMM_SCATTER", "0", got, (int)ci, 0.0);
        /* memory_optimized: that too, asked for by the call */
        moe_tensor *mo[4] = {0};
        pl_memopt = true;
        pl_run(ctx, c, ids, rv, gpu, dt, mo);
        pl_memopt = false;
        for (int i = 0; i < 4; i++) {
          bool same = (!mo[i] && !got[i]) || (mo[i] && got[i] && rel_err(ctx, mo[i], got[i]) == 0.0);
          if (!same) fprintf(stderr, "parallel_linear case %d tensor %d: memory_optimized differs\n", (int)ci, i);
          EXPECT(same);
          moe_tensor_release(mo[i]);
        }
      }
      for (int i = 0; i < 4; i++) moe_tensor_release(ref[i]), moe_tensor_release(got[i]), free(rv[i]);
    }
    for (int i = 0; i < 4; i++) free(vals[i]);
    free(ids);
  }
}

/* glu_experts with its own quantization of h1 and h3 on CUDA:
 * the fused passes (quantize in the activation, codes read in backward)
 * give the bits of the unfused route (MOE_GLU_QFUSED=0: activation + two
 * moe_quantize calls, dequantize + the plain backward pass), which is
 * built from ops tested elsewhere; the forward output is not quantized;
 * gradients stay within the quantization's bounds of quantization off; f32
 * 8 bits against the CPU op. Cases: the vector paths (f a multiple of 8,
 * grouped and sparse), groups narrower than a row, a ragged 4-bit group,
 * and f % 8 != 0 (the fused forward does not apply; scalar backward). */
static void test_glu_quant_cuda(moe_ctx *ctx) {
  const ex_case cases[] = {
      {300, 2, 8, 8, 64, 256, 128},
      {77, 1, 3, 2, 40, 72, 0},
      {65, 2, 5, 5, 24, 36, 0},
  };
  struct {
    int bits;
    int64_t G;
    bool stoch;
  } qs[] = {{8, 0, false}, {4, 128, false}, {8, 64, false}, {4, 0, false}, {8, 0, true}, {4, 128, true}};
  moe_device gpu = {MOE_DEVICE_CUDA, 0};
  for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
    const ex_case *c = &cases[ci];
    int64_t *ids = NULL;
    double *vals[6];
    case_inputs(c, &ids, vals);
    for (int dtc = 0; dtc < 2; dtc++) {
      moe_dtype dt = dtc ? MOE_BF16 : MOE_F32;
      for (int impl = 0; impl < (c->bs ? 2 : 1); impl++) {
        moe_tensor *off[6] = {0};
        run_opts(ctx, c, ids, vals, gpu, dt, (moe_experts_impl)impl, NULL, off);
        for (size_t qi = 0; qi < sizeof qs / sizeof qs[0]; qi++) {
          moe_glu_experts_opts o = moe_glu_experts_opts_default();
          o.quant_bits = qs[qi].bits;
          o.quant_group_size = qs[qi].G;
          o.quant_stochastic = qs[qi].stoch;
          o.quant_min_numel = 0;
          moe_tensor *fused[6] = {0}, *unfused[6] = {0};
          run_opts(ctx, c, ids, vals, gpu, dt, (moe_experts_impl)impl, &o, fused);
          setenv("MOE_GLU_QFUSED", "0", 1);
          EXPECT_OK(moe_knobs_reload(ctx)); /* the context reads knobs at creation */
          run_opts(ctx, c, ids, vals, gpu, dt, (moe_experts_impl)impl, &o, unfused);
          unsetenv("MOE_GLU_QFUSED");
          EXPECT_OK(moe_knobs_reload(ctx));
          double worst_fu = 0, worst_off = 0;
          for (int i = 0; i < 6; i++) {
            if (!fused[i] || !unfused[i] || !off[i]) {
              EXPECT(false);
              continue;
            }
            worst_fu = fmax(worst_fu, rel_err(ctx, fused[i], unfused[i]));
            if (i > 0) worst_off = fmax(worst_off, rel_err(ctx, fused[i], off[i]));
          }
          double fwd = fused[0] && off[0] ? rel_err(ctx, fused[0], off[0]) : INFINITY;
          /* 8 bits: each value within absmax / 254 of its group; gradients
           * within 5% of each tensor's largest magnitude. 4 bits: absmax / 14,
           * within 40%. Fused vs unfused: the same arithmetic on the same
           * codes (1e-6: summation order is identical too, so 0 is expected). */
          double bound = qs[qi].bits == 8 ? 0.05 : 0.4;
          if (!(worst_fu <= 1e-6) || !(worst_off < bound) || !(worst_off > 0) || !(fwd <= 1e-6))
            fprintf(stderr, "case %zu %s impl %d bits %d G %lld stochastic %d: fused vs unfused "
                    "%g, grads vs off %g, forward vs off %g\n", ci, moe_dtype_name(dt), impl,
                    qs[qi].bits, (long long)qs[qi].G, (int)qs[qi].stoch, worst_fu, worst_off, fwd);
          EXPECT(worst_fu <= 1e-6);
          EXPECT(worst_off < bound && worst_off > 0);
          EXPECT(fwd <= 1e-6);
          if (dt == MOE_F32 && qs[qi].bits == 8 && !qs[qi].stoch) {
            /* the CPU op in f32: the same quantizer on hiddens that differ
             * by GEMM rounding (a code may flip by one step, absmax / 127) */
            moe_tensor *cpu[6] = {0};
            run_opts(ctx, c, ids, vals, MOE_CPU, MOE_F32, (moe_experts_impl)impl, &o, cpu);
            double worst = 0;
            for (int i = 0; i < 6; i++) worst = fmax(worst, cpu[i] ? rel_err(ctx, fused[i], cpu[i]) : INFINITY);
            if (!(worst <= 2e-2)) fprintf(stderr, "case %zu impl %d: CUDA vs CPU %g\n", ci, impl, worst);
            EXPECT(worst <= 2e-2);
            for (int i = 0; i < 6; i++) moe_tensor_release(cpu[i]);
          }
          for (int i = 0; i < 6; i++) moe_tensor_release(fused[i]), moe_tensor_release(unfused[i]);
        }
        for (int i = 0; i < 6; i++) moe_tensor_release(off[i]);
      }
    }
    for (int i = 0; i < 6; i++) free(vals[i]);
    free(ids);
  }
}

/* MOE_BSMM_GATHER=wgrad, or the op's memory_optimized: the backward's weight
 * gradients dW1, dW3 read x's rows in place, so the permuted tokens (R, d)
 * never exist. On a layer whose backward peaks at those products (the
 * weight gradients large beside the rows) the peak falls by at least their
 * size; with every product gathering (1) it falls no less. Both impls; the
 * bits are the default's. */
static void test_glu_gather_wgrad_peak(moe_ctx *ctx) {
  const ex_case c = {256, 2, 4, 4, 512, 512, 128}; /* 3 x 2 MB of weight gradients */
  moe_device gpu = {MOE_DEVICE_CUDA, 0};
  int64_t *ids = NULL;
  double *vals[6];
  case_inputs(&c, &ids, vals);
  for (int i = 0; i < 6; i++) { /* bf16 values, as the kernels see them */
    int64_t n = i == 0 || i == 5 ? c.T * c.d : i == 4 ? c.T * c.k : c.E * c.d * c.f;
    for (int64_t j = 0; j < n; j++) vals[i][j] = moe_bf16_to_f32(moe_f32_to_bf16((float)vals[i][j]));
  }
  /* the knob's three values, then memory_optimized with the knob at 0 */
  const char *modes[4] = {"0", "wgrad", "1", "0"};
  for (int impl = 0; impl < 2; impl++) {
    if (!moe_grouped_offsets_on_device(ctx, gpu, MOE_BF16, c.E, c.d, c.f))
      continue; /* both impls gather on the sm_90a kernel only */
    int64_t peak[4];
    moe_tensor *got[4][6] = {{0}};
    for (int m = 0; m < 4; m++) {
      setenv("MOE_BSMM_GATHER", modes[m], 1);
      EXPECT_OK(moe_knobs_reload(ctx));
      moe_glu_experts_opts o = moe_glu_experts_opts_default();
      o.memory_optimized = m == 3;
      last_bwd_peak = -1;
      run_opts(ctx, &c, ids, vals, gpu, MOE_BF16, (moe_experts_impl)impl, &o, got[m]);
      peak[m] = last_bwd_peak;
    }
    unsetenv("MOE_BSMM_GATHER");
    EXPECT_OK(moe_knobs_reload(ctx));
    int64_t rows_bytes = c.T * c.k * c.d * 2; /* xs: (R, d) bf16 */
    if (!(peak[0] - peak[1] >= rows_bytes && peak[2] <= peak[1] && peak[3] == peak[1]))
      fprintf(stderr, "impl %d: backward peaks %lld (0), %lld (wgrad), %lld (1), %lld (memory_optimized); xs is %lld bytes\n",
              impl, (long long)peak[0], (long long)peak[1], (long long)peak[2], (long long)peak[3],
              (long long)rows_bytes);
    EXPECT(peak[0] > 0 && peak[0] - peak[1] >= rows_bytes);
    EXPECT(peak[2] <= peak[1]);
    EXPECT(peak[3] == peak[1]);
    for (int m = 1; m < 4; m++)
      for (int i = 0; i < 6; i++) EXPECT(got[m][i] && got[0][i] && rel_err(ctx, got[m][i], got[0][i]) == 0.0);
    for (int m = 0; m < 4; m++)
      for (int i = 0; i < 6; i++) moe_tensor_release(got[m][i]);
  }
  for (int i = 0; i < 6; i++) free(vals[i]);
  free(ids);
}

/* parallel_linear with gather and memory_optimized: its backward's weight
 * gradient reads x's rows in place, so on a product whose backward peaks
 * there (a weight gradient large beside the rows) the peak falls by the
 * permuted tokens' size; grouped and sparse. */
static void test_pl_memopt_peak(moe_ctx *ctx) {
  moe_device gpu = {MOE_DEVICE_CUDA, 0};
  const pl_case cases[] = {{256, 2, 4, 512, 512, 0, true, false, false, false, false},
                           {256, 2, 4, 512, 512, 128, true, false, false, false, false}};
  for (size_t ci = 0; ci < 2; ci++) {
    const pl_case *c = &cases[ci];
    if (!moe_grouped_offsets_on_device(ctx, gpu, MOE_BF16, c->E, c->K, c->N)) continue; /* sm_90a only */
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)(c->T * c->k));
    for (int64_t t = 0; t < c->T; t++)
      for (int64_t j = 0; j < c->k; j++) ids[t * c->k + j] = (t + j) % c->E;
    int64_t xn = (c->T * c->k + c->E * (c->bs ? c->bs : 1)) * c->K, wn = c->E * c->K * c->N;
    int64_t dn = (c->T * c->k + c->E * (c->bs ? c->bs : 1)) * c->N;
    double *vals[4] = {rvals(xn, 1.0), rvals(wn, 1.0 / sqrt((double)c->K)), rvals(c->T * c->k, 1.0), rvals(dn, 1.0)};
    int64_t peak[2];
    moe_tensor *res[2][4] = {{0}};
    for (int m = 0; m < 2; m++) {
      pl_memopt = m == 1;
      pl_last_peak = -1;
      pl_run(ctx, c, ids, vals, gpu, MOE_BF16, res[m]);
      peak[m] = pl_last_peak;
    }
    pl_memopt = false;
    int64_t rows_bytes = c->T * c->k * c->K * 2; /* the permuted tokens (at least T k rows), bf16 */
    if (!(peak[0] - peak[1] >= rows_bytes))
      fprintf(stderr, "parallel_linear peak case %d: %lld without, %lld with memory_optimized; xs >= %lld\n",
              (int)ci, (long long)peak[0], (long long)peak[1], (long long)rows_bytes);
    EXPECT(peak[1] > 0 && peak[0] - peak[1] >= rows_bytes);
    for (int i = 0; i < 3; i++) {
      EXPECT(res[0][i] && res[1][i] && rel_err(ctx, res[1][i], res[0][i]) == 0.0);
      moe_tensor_release(res[0][i]), moe_tensor_release(res[1][i]);
    }
    for (int i = 0; i < 4; i++) free(vals[i]);
    free(ids);
  }
}

int main(void) {
  moe_ctx *ctx = harness_start();
  SKIP_IF_NO_GPU(ctx);
  RUN(test_glu_cuda_vs_cpu);
  RUN(test_parallel_linear_cuda);
  RUN(test_glu_quant_cuda);
  RUN(test_glu_gather_wgrad_peak);
  RUN(test_pl_memopt_peak);
  return harness_end();
}
