/*
 * test_experts.c - the experts family on the CPU (moe_experts.h):
 * parallel_linear (grouped and sparse) and glu_experts against a naive
 * per-expert loop written here (f64, every activation, dropless, padded and
 * capacity plans, an empty expert, every token to one expert, T not a
 * multiple of the block size, k = 1..8, E = 1..256); grouped == sparse (SDD
 * values through the dense masked matrix, DSD outputs); the GLU composed
 * from parallel_linear + silu/gelu + mul against the fused glu_experts,
 * forward and every gradient (x, w1, w3, w2, gates and a router weight
 * upstream), both impls, memory_optimized on and off; finite-difference
 * gradients (non-contiguous inputs included); the host-sync count; bf16
 * against f64; error paths.
 */
#include "gradcheck.h"
#include "harness.h"
#include "moe_routing.h"

/* -------------------------------------------------------------- helpers */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static double urand(void) { /* [-1, 1) */
  rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
  return (double)(rng_state >> 11) / 4503599627370496.0 - 1.0;
}

/* A CPU tensor of random values in [-scale, scale); host copy in *vals when
 * vals is not NULL (caller frees). */
static moe_tensor *rnd(moe_ctx *ctx, int ndim, const int64_t *shape, moe_dtype dt, double scale,
                       double **vals) {
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) n *= shape[i];
  double *v = malloc(sizeof(double) * (size_t)(n + 1));
  for (int64_t i = 0; i < n; i++) v[i] = scale * urand();
  moe_tensor *t = NULL;
  moe_tensor_from_f64(ctx, v, ndim, shape, dt, MOE_CPU, &t);
  if (dt != MOE_F64) moe_tensor_to_f64(ctx, t, v); /* the rounded values */
  if (vals) *vals = v;
  else free(v);
  return t;
}

/* ids (T, k): distinct experts per token drawn from [0, E_used). */
static void rand_ids(int64_t *ids, int64_t T, int64_t k, int64_t E_used) {
  for (int64_t t = 0; t < T; t++)
    for (int64_t j = 0; j < k; j++) {
      int64_t e;
      bool dup;
      do {
        e = (int64_t)((urand() + 1.0) * 0.5 * (double)E_used);
        if (e >= E_used) e = E_used - 1;
        dup = false;
        for (int64_t i = 0; i < j; i++) dup = dup || ids[t * k + i] == e;
      } while (dup);
      ids[t * k + j] = e;
    }
}

static moe_routing_plan *mk_plan(moe_ctx *ctx, const int64_t *ids, int64_t T, int64_t k, int64_t E,
                                 int64_t bs, int64_t ffn, double cf) {
  double *v = malloc(sizeof(double) * (size_t)(T * k + 1));
  for (int64_t i = 0; i < T * k; i++) v[i] = (double)ids[i];
  moe_tensor *tid = NULL;
  moe_tensor_from_f64(ctx, v, 2, (int64_t[]){T, k}, MOE_I64, MOE_CPU, &tid);
  free(v);
  moe_routing_opts o = moe_routing_opts_default();
  o.block_size = bs;
  o.ffn_hidden = ffn;
  o.capacity_factor = cf;
  moe_routing_plan *p = NULL;
  EXPECT_OK(moe_routing_plan_new(ctx, tid, E, &o, &p));
  moe_tensor_release(tid);
  return p;
}

static double act_f(int act, double v) {
  if (act == MOE_GLU_SILU) return v / (1.0 + exp(-v));
  if (act == MOE_GLU_GELU) return 0.5 * v * (1.0 + erf(v / sqrt(2.0)));
  return 0.5 * v * (1.0 + tanh(0.79788456080286535588 * (v + 0.044715 * v * v * v)));
}

/* Naive GLU expert MLP: out (T, d), skipping dropped assignments (dest < 0). */
static void naive_glu(const double *x, const double *w1, const double *w3, const double *w2,
                      const double *gates, const int64_t *ids, const int64_t *dest, int64_t T,
                      int64_t k, int64_t d, int64_t f, int act, double *out) {
  double *hid = malloc(sizeof(double) * (size_t)f);
  for (int64_t i = 0; i < T * d; i++) out[i] = 0;
  for (int64_t t = 0; t < T; t++)
    for (int64_t j = 0; j < k; j++) {
      int64_t a = t * k + j, e = ids[a];
      if (dest[a] < 0) continue;
      double g = gates ? gates[a] : 1.0;
      for (int64_t c = 0; c < f; c++) {
        double h1 = 0, h3 = 0;
        for (int64_t i = 0; i < d; i++) {
          h1 += x[t * d + i] * w1[(e * d + i) * f + c];
          h3 += x[t * d + i] * w3[(e * d + i) * f + c];
        }
        hid[c] = act_f(act, h1) * h3;
      }
      for (int64_t i = 0; i < d; i++) {
        double s = 0;
        for (int64_t c = 0; c < f; c++) s += hid[c] * w2[(e * f + c) * d + i];
        out[t * d + i] += g * s;
      }
    }
  free(hid);
}

static bool close_arrays(const double *a, const double *b, int64_t n, double tol, const char *what) {
  for (int64_t i = 0; i < n; i++)
    if (!(fabs(a[i] - b[i]) <= tol * (1.0 + fabs(b[i])))) {
      fprintf(stderr, "%s: element %lld is %.12g, wanted %.12g (tol %g)\n", what, (long long)i,
              a[i], b[i], tol);
      return false;
    }
  return true;
}

static double *host(moe_ctx *ctx, const moe_tensor *t) {
  int64_t n = moe_tensor_numel(t);
  double *v = malloc(sizeof(double) * (size_t)(n + 1));
  EXPECT_OK(moe_tensor_to_f64(ctx, t, v));
  return v;
}

/* ----------------------------------------------- parallel_linear values */

static void test_parallel_linear_naive(moe_ctx *ctx) {
  /* T, k, E, K, N, E_used (E_used < E: empty experts) */
  const int64_t cfgs[][6] = {{5, 1, 3, 3, 4, 3}, {7, 2, 4, 5, 3, 3}, {9, 4, 6, 2, 6, 5}};
  for (size_t c = 0; c < sizeof cfgs / sizeof cfgs[0]; c++) {
    int64_t T = cfgs[c][0], k = cfgs[c][1], E = cfgs[c][2], K = cfgs[c][3], N = cfgs[c][4];
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)(T * k));
    rand_ids(ids, T, k, cfgs[c][5]);
    for (int trans = 0; trans < 2; trans++) {
      moe_routing_plan *p = mk_plan(ctx, ids, T, k, E, 0, 0, 0);
      double *xv, *wv, *gv;
      moe_tensor *x = rnd(ctx, 2, (int64_t[]){T, K}, MOE_F64, 1.0, &xv);
      moe_tensor *w = rnd(ctx, 3, (int64_t[]){E, K, N}, MOE_F64, 1.0, &wv);
      moe_tensor *g = rnd(ctx, 2, (int64_t[]){T, k}, MOE_F64, 1.0, &gv);
      moe_tensor *wt = NULL, *wuse = w;
      if (trans) { /* (E, N, K) view of the same matrices: exercises the copy */
        moe_tensor *wtc = NULL;
        EXPECT_OK(moe_transpose(ctx, w, 1, 2, &wtc));
        EXPECT_OK(moe_contiguous(ctx, wtc, &wt));
        moe_tensor_release(wtc);
        wuse = wt;
      }
      moe_parallel_linear_opts o = moe_parallel_linear_opts_default();
      o.trans_w = trans;
      o.gather = true;
      moe_tensor *y = NULL, *out = NULL;
      EXPECT_OK(moe_parallel_linear(ctx, x, wuse, p, &o, &y));
      o.scatter = true;
      o.gates = g;
      EXPECT_OK(moe_parallel_linear(ctx, x, wuse, p, &o, &out));
      int64_t R = p->rows;
      double *want = calloc((size_t)(R * N + 1), sizeof(double));
      double *want_out = calloc((size_t)(T * N + 1), sizeof(double));
      int64_t *src = malloc(sizeof(int64_t) * (size_t)(R + 1));
      EXPECT_OK(moe_tensor_to_i64(ctx, p->src, src));
      for (int64_t r = 0; r < R; r++) {
        if (src[r] < 0) continue;
        int64_t a = src[r], t = a / k, e = ids[a];
        for (int64_t n = 0; n < N; n++) {
          double s = 0;
          for (int64_t i = 0; i < K; i++) s += xv[t * K + i] * wv[(e * K + i) * N + n];
          want[r * N + n] = s;
          want_out[t * N + n] += gv[a] * s;
        }
      }
      double *got = host(ctx, y), *got_out = host(ctx, out);
      EXPECT(y->shape[0] == R && y->shape[1] == N);
      EXPECT(close_arrays(got, want, R * N, 1e-12, "parallel_linear gather (f64)"));
      EXPECT(close_arrays(got_out, want_out, T * N, 1e-12, "parallel_linear scatter (f64)"));
      free(got), free(got_out), free(want), free(want_out), free(src);
      free(xv), free(wv), free(gv);
      moe_tensor_release(x), moe_tensor_release(w), moe_tensor_release(wt);
      moe_tensor_release(g), moe_tensor_release(y), moe_tensor_release(out);
      moe_routing_plan_release(p);
    }
    free(ids);
  }
}

/* grouped == sparse: SDD values through the dense masked matrix, DSD outputs. */
static void test_grouped_eq_sparse(moe_ctx *ctx) {
  /* T, k, E, d, bs, F, E_used */
  const int64_t cfgs[][7] = {{7, 2, 4, 3, 4, 2, 3}, {10, 3, 5, 5, 3, 1, 5}, {6, 1, 2, 4, 8, 1, 2}};
  for (size_t c = 0; c < sizeof cfgs / sizeof cfgs[0]; c++) {
    int64_t T = cfgs[c][0], k = cfgs[c][1], E = cfgs[c][2], d = cfgs[c][3], bs = cfgs[c][4];
    int64_t f = cfgs[c][5] * bs;
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)(T * k));
    rand_ids(ids, T, k, cfgs[c][6]);
    moe_routing_plan *p = mk_plan(ctx, ids, T, k, E, bs, f, 0);
    moe_tensor *x = rnd(ctx, 2, (int64_t[]){T, d}, MOE_F64, 1.0, NULL);
    moe_tensor *w1 = rnd(ctx, 3, (int64_t[]){E, d, f}, MOE_F64, 1.0, NULL);
    moe_tensor *w2 = rnd(ctx, 3, (int64_t[]){E, f, d}, MOE_F64, 1.0, NULL);
    moe_tensor *g = rnd(ctx, 2, (int64_t[]){T, k}, MOE_F64, 1.0, NULL);
    moe_parallel_linear_opts og = moe_parallel_linear_opts_default(), os = og;
    os.impl = MOE_EXPERTS_SPARSE;
    og.gather = os.gather = true;
    moe_tensor *hg = NULL, *hs = NULL, *dense = NULL, *outg = NULL, *outs = NULL;
    EXPECT_OK(moe_parallel_linear(ctx, x, w1, p, &og, &hg));
    EXPECT_OK(moe_parallel_linear(ctx, x, w1, p, &os, &hs));
    EXPECT(hs && hs->ndim == 3 && hs->shape[0] == p->nnz);
    EXPECT_OK(moe_bsmm_to_dense(ctx, hs, p, &dense));
    int64_t R = p->rows;
    double *vg = host(ctx, hg), *vd = host(ctx, dense);
    int64_t *ro = malloc(sizeof(int64_t) * (size_t)(E + 1));
    EXPECT_OK(moe_tensor_to_i64(ctx, p->row_offsets, ro));
    double *want = calloc((size_t)(R * E * f + 1), sizeof(double));
    for (int64_t e = 0; e < E; e++)
      for (int64_t r = ro[e]; r < ro[e + 1]; r++)
        for (int64_t j = 0; j < f; j++) want[r * E * f + e * f + j] = vg[r * f + j];
    EXPECT(close_arrays(vd, want, R * E * f, 1e-12, "sparse SDD == grouped (masked dense)"));
    og.gather = os.gather = false;
    og.scatter = os.scatter = true;
    og.gates = os.gates = g;
    EXPECT_OK(moe_parallel_linear(ctx, hg, w2, p, &og, &outg));
    EXPECT_OK(moe_parallel_linear(ctx, hs, w2, p, &os, &outs));
    double *a = host(ctx, outg), *b = host(ctx, outs);
    EXPECT(close_arrays(b, a, T * d, 1e-12, "sparse DSD == grouped"));
    free(vg), free(vd), free(ro), free(want), free(a), free(b), free(ids);
    moe_tensor_release(x), moe_tensor_release(w1), moe_tensor_release(w2), moe_tensor_release(g);
    moe_tensor_release(hg), moe_tensor_release(hs), moe_tensor_release(dense);
    moe_tensor_release(outg), moe_tensor_release(outs);
    moe_routing_plan_release(p);
  }
}

/* -------------------------------------------------- glu_experts values */

static void test_glu_naive(moe_ctx *ctx) {
  /* T, k, E, d, f, bs, E_used, capacity_factor * 100 */
  const int64_t cfgs[][8] = {{5, 1, 3, 3, 4, 0, 3, 0},  {7, 2, 4, 3, 4, 4, 3, 0},
                             {9, 3, 5, 4, 6, 3, 5, 0},  {6, 4, 6, 2, 2, 2, 6, 0},
                             {8, 2, 4, 3, 4, 0, 2, 60}, {11, 2, 3, 2, 8, 4, 3, 0},
                             {9, 1, 1, 3, 4, 4, 1, 0},  /* E = 1 */
                             {10, 1, 4, 3, 4, 2, 1, 0}, /* every token to expert 0 */
                             {40, 8, 256, 2, 2, 2, 256, 0}}; /* k = 8, E = 256 */
  for (size_t c = 0; c < sizeof cfgs / sizeof cfgs[0]; c++) {
    int64_t T = cfgs[c][0], k = cfgs[c][1], E = cfgs[c][2], d = cfgs[c][3], f = cfgs[c][4];
    int64_t bs = cfgs[c][5];
    double cf = (double)cfgs[c][7] / 100.0;
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)(T * k));
    rand_ids(ids, T, k, cfgs[c][6]);
    moe_routing_plan *p = mk_plan(ctx, ids, T, k, E, bs, bs ? f : 0, cf);
    int64_t *dest = malloc(sizeof(int64_t) * (size_t)(T * k));
    EXPECT_OK(moe_tensor_to_i64(ctx, p->dest, dest));
    double *xv, *w1v, *w3v, *w2v, *gv;
    moe_tensor *x = rnd(ctx, 2, (int64_t[]){T, d}, MOE_F64, 1.0, &xv);
    moe_tensor *w1 = rnd(ctx, 3, (int64_t[]){E, d, f}, MOE_F64, 1.0, &w1v);
    moe_tensor *w3 = rnd(ctx, 3, (int64_t[]){E, d, f}, MOE_F64, 1.0, &w3v);
    moe_tensor *w2 = rnd(ctx, 3, (int64_t[]){E, f, d}, MOE_F64, 1.0, &w2v);
    moe_tensor *g = rnd(ctx, 2, (int64_t[]){T, k}, MOE_F64, 1.0, &gv);
    double *want = malloc(sizeof(double) * (size_t)(T * d));
    for (int act = 0; act < 3; act++)
      for (int impl = 0; impl < (bs ? 2 : 1); impl++)
        for (int with_g = 0; with_g < 2; with_g++) {
          naive_glu(xv, w1v, w3v, w2v, with_g ? gv : NULL, ids, dest, T, k, d, f, act, want);
          moe_tensor *out = NULL;
          EXPECT_OK(moe_glu_experts(ctx, x, w1, w3, w2, p, with_g ? g : NULL,
                                    (moe_experts_impl)impl, (moe_glu_activation)act, false, &out));
          if (!out) continue;
          double *got = host(ctx, out);
          char what[96];
          snprintf(what, sizeof what, "glu_experts cfg %d act %d impl %d gates %d (f64)", (int)c,
                   act, impl, with_g);
          EXPECT(close_arrays(got, want, T * d, 1e-12, what));
          free(got);
          moe_tensor_release(out);
        }
    free(ids), free(dest), free(xv), free(w1v), free(w3v), free(w2v), free(gv), free(want);
    moe_tensor_release(x), moe_tensor_release(w1), moe_tensor_release(w3);
    moe_tensor_release(w2), moe_tensor_release(g);
    moe_routing_plan_release(p);
  }
}

/* bf16 against f64 on the same (bf16-rounded) values: relative 2e-2 (bf16
 * storage of h1, h3, a and y, 8 mantissa bits each; f32 accumulation). */
static void test_glu_bf16(moe_ctx *ctx) {
  int64_t T = 13, k = 2, E = 4, d = 8, f = 16;
  int64_t ids[26];
  rand_ids(ids, T, k, E);
  moe_routing_plan *p = mk_plan(ctx, ids, T, k, E, 4, f, 0);
  int64_t *dest = malloc(sizeof(int64_t) * (size_t)(T * k));
  EXPECT_OK(moe_tensor_to_i64(ctx, p->dest, dest));
  double *xv, *w1v, *w3v, *w2v, *gv;
  moe_tensor *x = rnd(ctx, 2, (int64_t[]){T, d}, MOE_BF16, 1.0, &xv);
  moe_tensor *w1 = rnd(ctx, 3, (int64_t[]){E, d, f}, MOE_BF16, 0.5, &w1v);
  moe_tensor *w3 = rnd(ctx, 3, (int64_t[]){E, d, f}, MOE_BF16, 0.5, &w3v);
  moe_tensor *w2 = rnd(ctx, 3, (int64_t[]){E, f, d}, MOE_BF16, 0.5, &w2v);
  moe_tensor *g = rnd(ctx, 2, (int64_t[]){T, k}, MOE_BF16, 1.0, &gv);
  double *want = malloc(sizeof(double) * (size_t)(T * d));
  naive_glu(xv, w1v, w3v, w2v, gv, ids, dest, T, k, d, f, MOE_GLU_SILU, want);
  double scale = 0;
  for (int64_t i = 0; i < T * d; i++) scale = fmax(scale, fabs(want[i]));
  for (int impl = 0; impl < 2; impl++) {
    moe_tensor *out = NULL;
    EXPECT_OK(moe_glu_experts(ctx, x, w1, w3, w2, p, g, (moe_experts_impl)impl, MOE_GLU_SILU,
                              false, &out));
    if (!out) continue;
    EXPECT(out->dtype == MOE_BF16);
    double *got = host(ctx, out), err = 0;
    for (int64_t i = 0; i < T * d; i++) err = fmax(err, fabs(got[i] - want[i]));
    EXPECT(err <= 2e-2 * scale);
    free(got);
    moe_tensor_release(out);
  }
  free(dest), free(xv), free(w1v), free(w3v), free(w2v), free(gv), free(want);
  moe_tensor_release(x), moe_tensor_release(w1), moe_tensor_release(w3);
  moe_tensor_release(w2), moe_tensor_release(g);
  moe_routing_plan_release(p);
}

/* memory_optimized changes no bit: a = act(h1) * h3 is recomputed in the
 * backward, rounded as the forward stored it, in either mode (f32 and
 * bf16, grouped and sparse, each activation). */
static void test_memopt_bits(moe_ctx *ctx) {
  int64_t T = 13, k = 2, E = 4, d = 8, f = 16;
  int64_t ids[26];
  rand_ids(ids, T, k, E);
  const moe_glu_activation acts[] = {MOE_GLU_SILU, MOE_GLU_GELU, MOE_GLU_GELU_TANH};
  for (int dtc = 0; dtc < 2; dtc++)
    for (int impl = 0; impl < 2; impl++)
      for (int ai = 0; ai < 3; ai++) {
        moe_dtype dt = dtc ? MOE_BF16 : MOE_F32;
        moe_routing_plan *p = mk_plan(ctx, ids, T, k, E, impl ? 4 : 0, impl ? f : 0, 0);
        moe_tensor *in[5] = {rnd(ctx, 2, (int64_t[]){T, d}, dt, 1.0, NULL),
                             rnd(ctx, 3, (int64_t[]){E, d, f}, dt, 0.5, NULL),
                             rnd(ctx, 3, (int64_t[]){E, d, f}, dt, 0.5, NULL),
                             rnd(ctx, 3, (int64_t[]){E, f, d}, dt, 0.5, NULL),
                             rnd(ctx, 2, (int64_t[]){T, k}, dt, 1.0, NULL)};
        moe_tensor *dy = rnd(ctx, 2, (int64_t[]){T, d}, dt, 1.0, NULL);
        for (int i = 0; i < 5; i++) moe_set_requires_grad(ctx, in[i], true);
        double *res[2][5] = {{0}};
        for (int memopt = 0; memopt < 2; memopt++) {
          moe_tensor *out = NULL;
          EXPECT_OK(moe_glu_experts(ctx, in[0], in[1], in[2], in[3], p, in[4],
                                    (moe_experts_impl)impl, acts[ai], memopt, &out));
          if (out) EXPECT_OK(moe_backward(ctx, out, dy, false));
          for (int i = 0; i < 5; i++) {
            moe_tensor *g = moe_tensor_grad(in[i]);
            EXPECT(g != NULL);
            if (g) res[memopt][i] = host(ctx, g);
            moe_tensor_set_grad(ctx, in[i], NULL);
          }
          moe_tensor_release(out);
        }
        for (int i = 0; i < 5; i++) {
          char what[80];
          snprintf(what, sizeof what, "memopt bits: %s impl %d act %d grad %d", moe_dtype_name(dt),
                   impl, ai, i);
          if (res[0][i] && res[1][i])
            EXPECT(close_arrays(res[1][i], res[0][i], moe_tensor_numel(in[i]), 0, what));
          free(res[0][i]), free(res[1][i]);
          moe_tensor_release(in[i]);
        }
        moe_tensor_release(dy);
        moe_routing_plan_release(p);
      }
}

/* ----------------------------- composed GLU == fused GLU (with a router) */

typedef struct glu_case {
  int64_t T, k, E, d, f, bs;
  int impl, act;
  bool memopt;
} glu_case;

/* Router: gates, ids = topk(softmax(xr @ wr), k); then a plan. */
static moe_status route(moe_ctx *ctx, moe_tensor *xr, moe_tensor *wr, const glu_case *gc,
                        moe_tensor **gates, moe_routing_plan **plan) {
  moe_tensor *logits = NULL, *probs = NULL, *idx = NULL;
  moe_status st = moe_matmul(ctx, xr, wr, &logits);
  if (st == MOE_OK) st = moe_softmax(ctx, logits, -1, &probs);
  if (st == MOE_OK) st = moe_topk(ctx, probs, gc->k, -1, true, gates, &idx);
  if (st == MOE_OK) {
    moe_routing_opts o = moe_routing_opts_default();
    o.block_size = gc->bs;
    o.ffn_hidden = gc->bs ? gc->f : 0;
    st = moe_routing_plan_new(ctx, idx, gc->E, &o, plan);
  }
  moe_tensor_release(logits), moe_tensor_release(probs), moe_tensor_release(idx);
  return st;
}

static moe_status glu_composed(moe_ctx *ctx, moe_tensor *x, moe_tensor *w1, moe_tensor *w3,
                               moe_tensor *w2, moe_routing_plan *p, moe_tensor *gates,
                               const glu_case *gc, moe_tensor **out) {
  moe_parallel_linear_opts o = moe_parallel_linear_opts_default();
  o.impl = (moe_experts_impl)gc->impl;
  o.gather = true;
  moe_tensor *h1 = NULL, *h3 = NULL, *ah = NULL, *a = NULL;
  moe_status st = moe_parallel_linear(ctx, x, w1, p, &o, &h1);
  if (st == MOE_OK) st = moe_parallel_linear(ctx, x, w3, p, &o, &h3);
  if (st == MOE_OK) {
    if (gc->act == MOE_GLU_SILU) st = moe_silu(ctx, h1, &ah);
    else if (gc->act == MOE_GLU_GELU) st = moe_gelu(ctx, h1, &ah);
    else st = moe_gelu_tanh(ctx, h1, &ah);
  }
  if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_MUL, ah, h3, &a);
  if (st == MOE_OK) {
    o.gather = false;
    o.scatter = true;
    o.gates = gates;
    st = moe_parallel_linear(ctx, a, w2, p, &o, out);
  }
  moe_tensor_release(h1), moe_tensor_release(h3), moe_tensor_release(ah), moe_tensor_release(a);
  return st;
}

static moe_tensor *leaf(moe_ctx *ctx, int ndim, const int64_t *shape, double scale) {
  moe_tensor *t = rnd(ctx, ndim, shape, MOE_F64, scale, NULL);
  moe_set_requires_grad(ctx, t, true);
  return t;
}

static void test_glu_composed(moe_ctx *ctx) {
  const glu_case cases[] = {
      {9, 2, 4, 3, 4, 0, MOE_EXPERTS_GROUPED, MOE_GLU_SILU, false},
      {9, 2, 4, 3, 4, 0, MOE_EXPERTS_GROUPED, MOE_GLU_GELU, true},
      {7, 3, 5, 4, 6, 3, MOE_EXPERTS_SPARSE, MOE_GLU_SILU, false},
      {7, 3, 5, 4, 6, 3, MOE_EXPERTS_SPARSE, MOE_GLU_GELU_TANH, true},
      {5, 1, 3, 2, 4, 4, MOE_EXPERTS_GROUPED, MOE_GLU_GELU_TANH, false},
      {6, 4, 4, 3, 2, 2, MOE_EXPERTS_SPARSE, MOE_GLU_SILU, true},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    const glu_case *gc = &cases[c];
    moe_tensor *x = leaf(ctx, 2, (int64_t[]){gc->T, gc->d}, 1.0);
    moe_tensor *wr = leaf(ctx, 2, (int64_t[]){gc->d, gc->E}, 1.0);
    moe_tensor *w1 = leaf(ctx, 3, (int64_t[]){gc->E, gc->d, gc->f}, 1.0);
    moe_tensor *w3 = leaf(ctx, 3, (int64_t[]){gc->E, gc->d, gc->f}, 1.0);
    moe_tensor *w2 = leaf(ctx, 3, (int64_t[]){gc->E, gc->f, gc->d}, 1.0);
    moe_tensor *rt = rnd(ctx, 2, (int64_t[]){gc->T, gc->d}, MOE_F64, 1.0, NULL);
    moe_tensor *params[5] = {x, wr, w1, w3, w2};
    double *res[2][6] = {{0}};
    for (int path = 0; path < 2; path++) {
      moe_tensor *gates = NULL, *out = NULL;
      moe_routing_plan *p = NULL;
      EXPECT_OK(route(ctx, x, wr, gc, &gates, &p));
      if (!p) break;
      if (path == 0) EXPECT_OK(glu_composed(ctx, x, w1, w3, w2, p, gates, gc, &out));
      else
        EXPECT_OK(moe_glu_experts(ctx, x, w1, w3, w2, p, gates, (moe_experts_impl)gc->impl,
                                  (moe_glu_activation)gc->act, gc->memopt, &out));
      if (out) {
        res[path][5] = host(ctx, out);
        EXPECT_OK(moe_backward(ctx, out, rt, false));
        for (int i = 0; i < 5; i++) {
          moe_tensor *gr = moe_tensor_grad(params[i]);
          EXPECT(gr != NULL);
          if (gr) res[path][i] = host(ctx, gr);
          moe_tensor_set_grad(ctx, params[i], NULL);
        }
        if (path == 1) EXPECT(p->host_syncs == 1); /* forward + backward: one sync */
      }
      moe_tensor_release(out), moe_tensor_release(gates);
      moe_routing_plan_release(p);
    }
    const char *names[6] = {"dx", "dwr", "dw1", "dw3", "dw2", "out"};
    for (int i = 0; i < 6; i++) {
      int64_t n = i == 5 ? gc->T * gc->d : moe_tensor_numel(params[i]);
      char what[96];
      snprintf(what, sizeof what, "composed vs fused case %d %s", (int)c, names[i]);
      if (res[0][i] && res[1][i]) EXPECT(close_arrays(res[1][i], res[0][i], n, 1e-11, what));
      else EXPECT(false);
      free(res[0][i]), free(res[1][i]);
    }
    for (int i = 0; i < 5; i++) moe_tensor_release(params[i]);
    moe_tensor_release(rt);
  }
}

/* What the node keeps: h1 and h3 in either mode (a is recomputed), never
 * the permuted tokens or y. */
static void test_saved_memory(moe_ctx *ctx) {
  int64_t T = 12, k = 2, E = 3, d = 4, f = 6;
  int64_t ids[24];
  rand_ids(ids, T, k, E);
  moe_routing_plan *p = mk_plan(ctx, ids, T, k, E, 0, 0, 0);
  moe_tensor *x = leaf(ctx, 2, (int64_t[]){T, d}, 1.0);
  moe_tensor *w1 = leaf(ctx, 3, (int64_t[]){E, d, f}, 1.0);
  moe_tensor *w3 = leaf(ctx, 3, (int64_t[]){E, d, f}, 1.0);
  moe_tensor *w2 = leaf(ctx, 3, (int64_t[]){E, f, d}, 1.0);
  moe_tensor *g = leaf(ctx, 2, (int64_t[]){T, k}, 1.0);
  int64_t held[2];
  for (int memopt = 0; memopt < 2; memopt++) {
    moe_memory_stats s0, s1;
    EXPECT_OK(moe_memory_stats_get(ctx, MOE_CPU, &s0));
    moe_tensor *out = NULL;
    EXPECT_OK(moe_glu_experts(ctx, x, w1, w3, w2, p, g, MOE_EXPERTS_GROUPED, MOE_GLU_SILU,
                              memopt, &out));
    EXPECT_OK(moe_memory_stats_get(ctx, MOE_CPU, &s1));
    held[memopt] = s1.allocated - s0.allocated;
    moe_tensor_release(out);
  }
  int64_t R = p->rows, hidden = R * f * 8, outb = T * d * 8;
  EXPECT(held[0] == outb + 2 * hidden); /* out, h1, h3 */
  EXPECT(held[1] == outb + 2 * hidden); /* out, h1, h3 */
  moe_tensor_release(x), moe_tensor_release(w1), moe_tensor_release(w3);
  moe_tensor_release(w2), moe_tensor_release(g);
  moe_routing_plan_release(p);
}

/* A backward that frees the graph writes dh3 and ga over h1, h3 or a and
 * frees the saved hidden tensors as it goes; one that retains the graph must
 * leave them intact: retain, then free, gives the same gradients bit for bit
 * (the second reads what the first left), a third backward is refused, and
 * the freeing backward's peak is lower by at least the two hidden-sized
 * buffers it did not allocate. */
static void test_backward_frees(moe_ctx *ctx) {
  int64_t T = 16, k = 2, E = 2, d = 2, f = 64, bs = 16;
  int64_t ids[32];
  rand_ids(ids, T, k, E);
  for (int sparse = 0; sparse < 2; sparse++)
    for (int memopt = 0; memopt < 2; memopt++) {
      moe_experts_impl impl = sparse ? MOE_EXPERTS_SPARSE : MOE_EXPERTS_GROUPED;
      moe_routing_plan *p = mk_plan(ctx, ids, T, k, E, sparse ? bs : 0, sparse ? f : 0, 0);
      moe_tensor *x = leaf(ctx, 2, (int64_t[]){T, d}, 1.0);
      moe_tensor *w1 = leaf(ctx, 3, (int64_t[]){E, d, f}, 1.0);
      moe_tensor *w3 = leaf(ctx, 3, (int64_t[]){E, d, f}, 1.0);
      moe_tensor *w2 = leaf(ctx, 3, (int64_t[]){E, f, d}, 1.0);
      moe_tensor *g = leaf(ctx, 2, (int64_t[]){T, k}, 1.0);
      moe_tensor *dy = rnd(ctx, 2, (int64_t[]){T, d}, MOE_F64, 1.0, NULL);
      moe_tensor *params[5] = {x, w1, w3, w2, g};
      int64_t peak[2] = {0, 0}, hidden = 0;
      char what[96];
      for (int retain = 1; retain >= 0; retain--) {
        /* a fresh graph per mode, its peak measured from before its backward */
        moe_memory_stats s0, s1;
        EXPECT_OK(moe_memory_stats_get(ctx, MOE_CPU, &s0));
        moe_tensor *out = NULL;
        EXPECT_OK(moe_glu_experts(ctx, x, w1, w3, w2, p, g, impl, MOE_GLU_SILU, memopt, &out));
        EXPECT_OK(moe_memory_stats_get(ctx, MOE_CPU, &s1));
        hidden = (s1.allocated - s0.allocated - T * d * 8) / 2; /* h1, h3 */
        EXPECT_OK(moe_memory_reset_peak(ctx, MOE_CPU));
        EXPECT_OK(moe_backward(ctx, out, dy, retain));
        EXPECT_OK(moe_memory_stats_get(ctx, MOE_CPU, &s0));
        peak[retain] = s0.peak_allocated - s1.allocated;
        if (retain) { /* the same graph again, freeing it: the same gradients */
          double *res[5];
          for (int i = 0; i < 5; i++) {
            res[i] = host(ctx, moe_tensor_grad(params[i]));
            moe_tensor_set_grad(ctx, params[i], NULL);
          }
          EXPECT_OK(moe_backward(ctx, out, dy, false));
          for (int i = 0; i < 5; i++) {
            double *again = host(ctx, moe_tensor_grad(params[i]));
            snprintf(what, sizeof what, "retained then freed: sparse %d memopt %d grad %d", sparse,
                     memopt, i);
            EXPECT(close_arrays(again, res[i], moe_tensor_numel(params[i]), 0, what));
            free(again), free(res[i]);
          }
          EXPECT(moe_backward(ctx, out, dy, false) == MOE_ERR_INVALID_ARG);
          EXPECT(strstr(moe_ctx_error(ctx), "already freed") != NULL);
          moe_ctx_clear(ctx);
        }
        for (int i = 0; i < 5; i++) moe_tensor_set_grad(ctx, params[i], NULL);
        moe_tensor_release(out);
      }
      snprintf(what, sizeof what, "sparse %d memopt %d", sparse, memopt);
      if (!(peak[0] <= peak[1] - 2 * hidden))
        fprintf(stderr, "%s: backward peak %lld freeing, %lld retaining, hidden %lld\n", what,
                (long long)peak[0], (long long)peak[1], (long long)hidden);
      EXPECT(hidden > 0 && peak[0] <= peak[1] - 2 * hidden);
      for (int i = 0; i < 5; i++) moe_tensor_release(params[i]);
      moe_tensor_release(dy);
      moe_routing_plan_release(p);
    }
}

/* ------------------------------------------------------ gradient checks */

typedef struct gc_ud {
  moe_routing_plan *p;
  const glu_case *gc;
} gc_ud;

static moe_status f_glu(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  gc_ud *u = (gc_ud *)ud;
  return moe_glu_experts(ctx, in[0], in[1], in[2], in[3], u->p, in[4],
                         (moe_experts_impl)u->gc->impl, (moe_glu_activation)u->gc->act,
                         u->gc->memopt, out);
}

static moe_status f_glu_router(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  gc_ud *u = (gc_ud *)ud;
  moe_tensor *gates = NULL;
  moe_routing_plan *p = NULL;
  moe_status st = route(ctx, in[0], in[1], u->gc, &gates, &p);
  if (st == MOE_OK)
    st = moe_glu_experts(ctx, in[0], in[2], in[3], in[4], p, gates, (moe_experts_impl)u->gc->impl,
                         (moe_glu_activation)u->gc->act, u->gc->memopt, out);
  moe_tensor_release(gates);
  moe_routing_plan_release(p);
  return st;
}

/* x @ w1 (gather) -> h; h @ w2 (scatter with gates): the parallel_linear chain. */
static moe_status f_pl(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  gc_ud *u = (gc_ud *)ud;
  moe_parallel_linear_opts o = moe_parallel_linear_opts_default();
  o.impl = (moe_experts_impl)u->gc->impl;
  o.gather = true;
  moe_tensor *h = NULL;
  moe_status st = moe_parallel_linear(ctx, in[0], in[1], u->p, &o, &h);
  if (st == MOE_OK) {
    o.gather = false;
    o.scatter = true;
    o.gates = in[3];
    o.trans_w = u->gc->memopt; /* reused as "w2 given transposed (E, d, f)" */
    st = moe_parallel_linear(ctx, h, in[2], u->p, &o, out);
  }
  moe_tensor_release(h);
  return st;
}

/* A (rows, cols) leaf that is a transposed view of a (cols, rows) tensor. */
static moe_tensor *leaf_t(moe_ctx *ctx, int64_t rows, int64_t cols, moe_tensor **base) {
  *base = rnd(ctx, 2, (int64_t[]){cols, rows}, MOE_F64, 1.0, NULL);
  moe_tensor *t = NULL;
  EXPECT_OK(moe_transpose(ctx, *base, 0, 1, &t));
  moe_set_requires_grad(ctx, t, true);
  return t;
}

/* (E, a, b) leaf as a transposed view of an (E, b, a) tensor. */
static moe_tensor *leaf3_t(moe_ctx *ctx, int64_t E, int64_t a, int64_t b, moe_tensor **base) {
  *base = rnd(ctx, 3, (int64_t[]){E, b, a}, MOE_F64, 1.0, NULL);
  moe_tensor *t = NULL;
  EXPECT_OK(moe_transpose(ctx, *base, 1, 2, &t));
  moe_set_requires_grad(ctx, t, true);
  return t;
}

static void test_gradcheck(moe_ctx *ctx) {
  /* T not a multiple of bs; k = 1..4; E_used < E: an empty expert */
  const glu_case cases[] = {
      {5, 1, 3, 3, 4, 0, MOE_EXPERTS_GROUPED, MOE_GLU_SILU, false},
      {7, 2, 4, 3, 4, 4, MOE_EXPERTS_GROUPED, MOE_GLU_GELU, true},
      {6, 3, 4, 2, 4, 4, MOE_EXPERTS_SPARSE, MOE_GLU_SILU, false},
      {5, 4, 5, 3, 4, 2, MOE_EXPERTS_SPARSE, MOE_GLU_GELU_TANH, true},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    const glu_case *gc = &cases[c];
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)(gc->T * gc->k));
    rand_ids(ids, gc->T, gc->k, gc->E - 1 >= gc->k ? gc->E - 1 : gc->E); /* last expert empty */
    moe_routing_plan *p = mk_plan(ctx, ids, gc->T, gc->k, gc->E, gc->bs, gc->bs ? gc->f : 0, 0);
    gc_ud u = {p, gc};
    bool strided = c % 2 == 1;
    moe_tensor *xb = NULL, *w1b = NULL, *x, *w1;
    if (strided) {
      x = leaf_t(ctx, gc->T, gc->d, &xb);
      w1 = leaf3_t(ctx, gc->E, gc->d, gc->f, &w1b);
    } else {
      x = leaf(ctx, 2, (int64_t[]){gc->T, gc->d}, 1.0);
      w1 = leaf(ctx, 3, (int64_t[]){gc->E, gc->d, gc->f}, 1.0);
    }
    moe_tensor *w3 = leaf(ctx, 3, (int64_t[]){gc->E, gc->d, gc->f}, 1.0);
    moe_tensor *w2 = leaf(ctx, 3, (int64_t[]){gc->E, gc->f, gc->d}, 1.0);
    moe_tensor *g = leaf(ctx, 2, (int64_t[]){gc->T, gc->k}, 1.0);
    moe_tensor *in[5] = {x, w1, w3, w2, g};
    if (!gradcheck(ctx, f_glu, 5, in, &u, 1e-6, 1e-6)) {
      fprintf(stderr, "glu_experts gradcheck failed: case %d\n", (int)c);
      EXPECT(false);
    } else {
      EXPECT(true);
    }
    /* the parallel_linear chain (w2 transposed in the odd cases) */
    moe_tensor *w2t = NULL, *w2tb = NULL;
    if (gc->memopt) w2t = leaf3_t(ctx, gc->E, gc->d, gc->f, &w2tb);
    moe_tensor *inp[4] = {x, w1, gc->memopt ? w2t : w2, g};
    EXPECT(gradcheck(ctx, f_pl, 4, inp, &u, 1e-6, 1e-6));
    /* the router upstream: x feeds the router and the experts */
    moe_tensor *wr = leaf(ctx, 2, (int64_t[]){gc->d, gc->E}, 1.0);
    moe_tensor *inr[5] = {x, wr, w1, w3, w2};
    EXPECT(gradcheck(ctx, f_glu_router, 5, inr, &u, 1e-6, 1e-6));
    moe_tensor_release(x), moe_tensor_release(xb), moe_tensor_release(w1);
    moe_tensor_release(w1b), moe_tensor_release(w3), moe_tensor_release(w2);
    moe_tensor_release(g), moe_tensor_release(w2t), moe_tensor_release(w2tb);
    moe_tensor_release(wr);
    moe_routing_plan_release(p);
    free(ids);
  }
}

/* Without gates and with gates that do not require grad; a capacity plan
 * with dropped assignments (their gate gradients are zero). */
static void test_gradcheck_variants(moe_ctx *ctx) {
  const glu_case gcs = {8, 2, 3, 2, 3, 0, MOE_EXPERTS_GROUPED, MOE_GLU_SILU, false};
  int64_t ids[16];
  rand_ids(ids, 8, 2, 2); /* experts 0 and 1 only, capacity 0.6 drops some */
  moe_routing_plan *p = mk_plan(ctx, ids, 8, 2, 3, 0, 0, 0.6);
  gc_ud u = {p, &gcs};
  moe_tensor *x = leaf(ctx, 2, (int64_t[]){8, 2}, 1.0);
  moe_tensor *w1 = leaf(ctx, 3, (int64_t[]){3, 2, 3}, 1.0);
  moe_tensor *w3 = leaf(ctx, 3, (int64_t[]){3, 2, 3}, 1.0);
  moe_tensor *w2 = leaf(ctx, 3, (int64_t[]){3, 3, 2}, 1.0);
  moe_tensor *g = leaf(ctx, 2, (int64_t[]){8, 2}, 1.0);
  moe_tensor *in[5] = {x, w1, w3, w2, g};
  EXPECT(gradcheck(ctx, f_glu, 5, in, &u, 1e-6, 1e-6));
  in[4] = NULL;
  EXPECT(gradcheck(ctx, f_glu, 4, in, &u, 1e-6, 1e-6));
  /* dropped assignments: zero gate gradient */
  moe_tensor *out = NULL;
  EXPECT_OK(moe_glu_experts(ctx, x, w1, w3, w2, p, g, MOE_EXPERTS_GROUPED, MOE_GLU_SILU, false,
                            &out));
  if (out) {
    moe_tensor *ones = NULL;
    EXPECT_OK(moe_tensor_full(ctx, 2, out->shape, 1.0, MOE_F64, MOE_CPU, &ones));
    EXPECT_OK(moe_backward(ctx, out, ones, false));
    moe_tensor_release(ones);
    int64_t dest[16];
    EXPECT_OK(moe_tensor_to_i64(ctx, p->dest, dest));
    moe_tensor *gg = moe_tensor_grad(g);
    EXPECT(gg != NULL);
    int dropped = 0;
    if (gg) {
      double *v = host(ctx, gg);
      for (int i = 0; i < 16; i++)
        if (dest[i] < 0) {
          dropped++;
          EXPECT(v[i] == 0.0);
        }
      free(v);
    }
    EXPECT(dropped > 0);
  }
  moe_tensor_release(out);
  moe_tensor_release(x), moe_tensor_release(w1), moe_tensor_release(w3);
  moe_tensor_release(w2), moe_tensor_release(g);
  moe_routing_plan_release(p);
}

/* ----------------------------------------------------------------- errors */

static void test_errors(moe_ctx *ctx) {
  int64_t ids[12];
  rand_ids(ids, 6, 2, 3);
  moe_routing_plan *p = mk_plan(ctx, ids, 6, 2, 3, 0, 0, 0);
  moe_routing_plan *pp = mk_plan(ctx, ids, 6, 2, 3, 4, 8, 0);
  moe_tensor *x = rnd(ctx, 2, (int64_t[]){6, 5}, MOE_F64, 1.0, NULL);
  moe_tensor *xf = rnd(ctx, 2, (int64_t[]){6, 5}, MOE_F32, 1.0, NULL);
  moe_tensor *xi = NULL;
  EXPECT_OK(moe_tensor_full(ctx, 2, (int64_t[]){6, 5}, 1, MOE_I64, MOE_CPU, &xi));
  moe_tensor *w = rnd(ctx, 3, (int64_t[]){3, 5, 8}, MOE_F64, 1.0, NULL);
  moe_tensor *w2 = rnd(ctx, 3, (int64_t[]){3, 8, 5}, MOE_F64, 1.0, NULL);
  moe_tensor *wbad = rnd(ctx, 3, (int64_t[]){2, 5, 8}, MOE_F64, 1.0, NULL);
  moe_tensor *g = rnd(ctx, 2, (int64_t[]){6, 2}, MOE_F64, 1.0, NULL);
  moe_tensor *gbad = rnd(ctx, 2, (int64_t[]){6, 3}, MOE_F64, 1.0, NULL);
  moe_tensor *out = NULL, *hs = NULL;
  moe_parallel_linear_opts o = moe_parallel_linear_opts_default();
  o.gather = true;
  o.impl = MOE_EXPERTS_SPARSE;
  EXPECT_ERR_MSG(moe_parallel_linear(ctx, x, w, p, &o, &out), MOE_ERR_INVALID_ARG,
                 "padded with ffn_hidden");
  EXPECT_OK(moe_parallel_linear(ctx, x, w, pp, &o, &hs));
  EXPECT_ERR_MSG(moe_parallel_linear(ctx, hs, w2, pp, &o, &out), MOE_ERR_INVALID_ARG,
                 "gather needs a dense x");
  o.gather = false;
  o.scatter = true;
  moe_tensor *xr = NULL;
  EXPECT_OK(moe_parallel_linear(ctx, hs, w2, pp, &o, &xr)); /* DSD + scatter: fine */
  EXPECT(xr && xr->shape[0] == 6 && xr->shape[1] == 5);
  moe_tensor_release(xr);
  moe_tensor *xs = NULL;
  EXPECT_OK(moe_routing_permute(ctx, x, pp, &xs));
  EXPECT_ERR_MSG(moe_parallel_linear(ctx, xs, w, pp, &o, &out), MOE_ERR_INVALID_ARG,
                 "scatter of a block-sparse");
  o.scatter = false;
  EXPECT_ERR_MSG(moe_parallel_linear(ctx, xs, w2, pp, &o, &out), MOE_ERR_SHAPE, "ffn_hidden = 8");
  moe_tensor_release(xs);
  o = moe_parallel_linear_opts_default();
  EXPECT_ERR_MSG(moe_parallel_linear(ctx, x, w, p, &o, &out), MOE_ERR_SHAPE, "(R, K) = (12, 5)");
  o.gather = true;
  EXPECT_ERR_MSG(moe_parallel_linear(ctx, x, wbad, p, &o, &out), MOE_ERR_SHAPE, "E_loc = 3");
  EXPECT_ERR_MSG(moe_parallel_linear(ctx, x, w2, p, &o, &out), MOE_ERR_SHAPE, "[3, 8, 5]");
  EXPECT_ERR_MSG(moe_parallel_linear(ctx, xf, w, p, &o, &out), MOE_ERR_DTYPE, "w is f64 but x is f32");
  EXPECT_ERR_MSG(moe_parallel_linear(ctx, xi, w, p, &o, &out), MOE_ERR_DTYPE, "parallel_linear: x");
  o.gates = g;
  EXPECT_ERR_MSG(moe_parallel_linear(ctx, x, w, p, &o, &out), MOE_ERR_INVALID_ARG,
                 "scatter is off");
  o.scatter = true;
  o.gates = gbad;
  EXPECT_ERR_MSG(moe_parallel_linear(ctx, x, w, p, &o, &out), MOE_ERR_SHAPE, "(T, k) = (6, 2)");
  o.impl = (moe_experts_impl)7;
  EXPECT_ERR_MSG(moe_parallel_linear(ctx, x, w, p, &o, &out), MOE_ERR_INVALID_ARG, "unknown impl");
  EXPECT_ERR(moe_parallel_linear(ctx, NULL, w, p, NULL, &out), MOE_ERR_INVALID_ARG);

  /* glu_experts */
  EXPECT_ERR_MSG(moe_glu_experts(ctx, x, w, w, w2, p, g, MOE_EXPERTS_SPARSE, MOE_GLU_SILU, false,
                                 &out), MOE_ERR_INVALID_ARG, "padded with ffn_hidden");
  moe_routing_plan *pp4 = mk_plan(ctx, ids, 6, 2, 3, 4, 4, 0);
  EXPECT_ERR_MSG(moe_glu_experts(ctx, x, w, w, w2, pp4, g, MOE_EXPERTS_SPARSE, MOE_GLU_SILU, false,
                                 &out), MOE_ERR_SHAPE, "ffn_hidden (4)");
  EXPECT_ERR_MSG(moe_glu_experts(ctx, x, w, w, w, p, g, MOE_EXPERTS_GROUPED, MOE_GLU_SILU, false,
                                 &out), MOE_ERR_SHAPE, "(E_loc, f, d)");
  EXPECT_ERR_MSG(moe_glu_experts(ctx, x, wbad, w, w2, p, g, MOE_EXPERTS_GROUPED, MOE_GLU_SILU,
                                 false, &out), MOE_ERR_SHAPE, "w1 must be");
  EXPECT_ERR_MSG(moe_glu_experts(ctx, x, w, w, w2, p, gbad, MOE_EXPERTS_GROUPED, MOE_GLU_SILU,
                                 false, &out), MOE_ERR_SHAPE, "gates must be");
  EXPECT_ERR_MSG(moe_glu_experts(ctx, xf, w, w, w2, p, g, MOE_EXPERTS_GROUPED, MOE_GLU_SILU, false,
                                 &out), MOE_ERR_DTYPE, "glu_experts: w1 is f64 but x is f32");
  EXPECT_ERR_MSG(moe_glu_experts(ctx, x, w, w, w2, p, g, MOE_EXPERTS_GROUPED,
                                 (moe_glu_activation)9, false, &out), MOE_ERR_INVALID_ARG,
                 "unknown activation");
  moe_tensor *x7 = rnd(ctx, 2, (int64_t[]){7, 5}, MOE_F64, 1.0, NULL);
  EXPECT_ERR_MSG(moe_glu_experts(ctx, x7, w, w, w2, p, g, MOE_EXPERTS_GROUPED, MOE_GLU_SILU,
                                 false, &out), MOE_ERR_SHAPE, "x must be (T, d) with the plan's T = 6");
  moe_tensor_release(x7);
  EXPECT_ERR(moe_glu_experts(ctx, x, NULL, w, w2, p, g, MOE_EXPERTS_GROUPED, MOE_GLU_SILU, false,
                             &out), MOE_ERR_INVALID_ARG);
  EXPECT(out == NULL);
  moe_tensor_release(x), moe_tensor_release(xf), moe_tensor_release(xi), moe_tensor_release(w);
  moe_tensor_release(w2), moe_tensor_release(wbad), moe_tensor_release(g);
  moe_tensor_release(gbad), moe_tensor_release(hs);
  moe_routing_plan_release(p), moe_routing_plan_release(pp), moe_routing_plan_release(pp4);
}

int main(void) {
  RUN(test_parallel_linear_naive);
  RUN(test_grouped_eq_sparse);
  RUN(test_glu_naive);
  RUN(test_glu_bf16);
  RUN(test_memopt_bits);
  RUN(test_glu_composed);
  RUN(test_saved_memory);
  RUN(test_backward_frees);
  RUN(test_gradcheck);
  RUN(test_gradcheck_variants);
  RUN(test_errors);
  return harness_end();
}
