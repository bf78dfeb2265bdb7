/*
 * test_blocksparse.c - the block-sparse family on the CPU (moe_blocksparse.h):
 * SDD, DSD, DSD^T and DDS against a naive per-row-block loop written here
 * from the plan's row offsets (f64, f32, bf16; trans_w both ways; an empty
 * expert; a local expert range; T = 0), against dense matmul on the masked
 * dense matrix (to_dense), to_dense / from_dense, finite-difference
 * gradients in f64 of SDD and DSD (b = 2 and 4, contiguous and strided
 * inputs, trans_w both ways), and error paths.
 */
#include "gradcheck.h"
#include "harness.h"
#include "moe_routing.h"

/* ------------------------------------------------------------- helpers */

static moe_routing_plan *mk_plan(moe_ctx *ctx, const int64_t *ids, int64_t T, int64_t k,
                                 int64_t E, int64_t b, int64_t F, int64_t e0, int64_t e1) {
  double v[256];
  for (int64_t i = 0; i < T * k; i++) v[i] = (double)ids[i];
  moe_tensor *t = NULL;
  moe_routing_plan *p = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, v, 2, (int64_t[]){T, k}, MOE_I64, MOE_CPU, &t));
  moe_routing_opts o = moe_routing_opts_default();
  o.block_size = b;
  o.ffn_hidden = F * b;
  o.expert_begin = e0;
  o.expert_end = e1;
  EXPECT_OK(moe_routing_plan_new(ctx, t, E, &o, &p));
  moe_tensor_release(t);
  return p;
}

/* Deterministic pseudo-random values in [-1, 1) of dtype dt. */
static moe_tensor *mk_rand(moe_ctx *ctx, int ndim, const int64_t *shape, moe_dtype dt,
                           uint64_t seed) {
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) n *= shape[i];
  double *v = (double *)malloc(sizeof(double) * (size_t)(n ? n : 1));
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (int64_t i = 0; i < n; i++) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    v[i] = (double)(s >> 11) / 9007199254740992.0 * 2.0 - 1.0;
  }
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, v, ndim, shape, dt, MOE_CPU, &t));
  free(v);
  return t;
}

static double *vals(moe_ctx *ctx, const moe_tensor *t) {
  int64_t n = moe_tensor_numel(t);
  double *v = (double *)calloc((size_t)(n ? n : 1), sizeof(double));
  EXPECT_OK(moe_tensor_to_f64(ctx, t, v));
  return v;
}

/* |got - want| <= tol * (1 + |want|) element-wise; prints the first miss. */
static bool close_to(moe_ctx *ctx, const moe_tensor *t, const double *want, int64_t n, double tol) {
  if (moe_tensor_numel(t) != n) {
    fprintf(stderr, "  %lld elements, wanted %lld\n", (long long)moe_tensor_numel(t), (long long)n);
    return false;
  }
  double *got = vals(ctx, t);
  bool ok = true;
  for (int64_t i = 0; i < n && ok; i++)
    if (!(fabs(got[i] - want[i]) <= tol * (1 + fabs(want[i])))) {
      fprintf(stderr, "  element %lld: got %.10g wanted %.10g (tol %g)\n", (long long)i, got[i],
              want[i], tol);
      ok = false;
    }
  free(got);
  return ok;
}

static bool same_tensor(moe_ctx *ctx, const moe_tensor *a, const moe_tensor *b, double tol) {
  double *w = vals(ctx, b);
  bool ok = close_to(ctx, a, w, moe_tensor_numel(b), tol);
  free(w);
  return ok;
}

/* ----------------------------------------------------- naive reference */

typedef struct geo {
  int64_t b, F, N, EL, R, Rb, nnz, e0;
  int64_t el_of_rb[64]; /* local expert of each row block */
} geo;

static geo mk_geo(moe_ctx *ctx, const moe_routing_plan *p) {
  geo g;
  g.b = p->block_size, g.F = p->ffn_blocks, g.N = g.F * g.b, g.EL = p->e1 - p->e0;
  g.R = p->rows, g.Rb = p->rows / g.b, g.nnz = g.Rb * g.F, g.e0 = p->e0;
  int64_t ro[64];
  EXPECT(p->E < 63 && g.Rb <= 64);
  EXPECT_OK(moe_tensor_to_i64(ctx, p->row_offsets, ro));
  for (int64_t rb = 0; rb < g.Rb; rb++)
    for (int64_t el = 0; el < g.EL; el++)
      if (ro[g.e0 + el] <= rb * g.b && rb * g.b < ro[g.e0 + el + 1]) g.el_of_rb[rb] = el;
  return g;
}

/* w element of the (K x N) matrix of expert el: w (EL, K, N) or (EL, N, K) */
static double w_kn(const double *w, const geo *g, int64_t K, bool nk, int64_t el, int64_t kk,
                   int64_t n) {
  return nk ? w[(el * g->N + n) * K + kk] : w[(el * K + kk) * g->N + n];
}

static void naive_sdd(const geo *g, int64_t K, const double *x, const double *w, bool trans_w,
                      double *out) {
  int64_t b = g->b;
  for (int64_t rb = 0; rb < g->Rb; rb++)
    for (int64_t c = 0; c < g->F; c++)
      for (int64_t r = 0; r < b; r++)
        for (int64_t j = 0; j < b; j++) {
          double s = 0;
          for (int64_t kk = 0; kk < K; kk++)
            s += x[(rb * b + r) * K + kk] * w_kn(w, g, K, trans_w, g->el_of_rb[rb], kk, c * b + j);
          out[((rb * g->F + c) * b + r) * b + j] = s;
        }
}

static void naive_dsd(const geo *g, int64_t K, const double *s, const double *w, bool trans_w,
                      double *out) {
  int64_t b = g->b;
  for (int64_t rb = 0; rb < g->Rb; rb++)
    for (int64_t r = 0; r < b; r++)
      for (int64_t kk = 0; kk < K; kk++) {
        double acc = 0;
        for (int64_t c = 0; c < g->F; c++)
          for (int64_t j = 0; j < b; j++)
            acc += s[((rb * g->F + c) * b + r) * b + j] *
                   w_kn(w, g, K, !trans_w, g->el_of_rb[rb], kk, c * b + j);
        out[(rb * b + r) * K + kk] = acc;
      }
}

/* dsd_t: out (EL, N, K); dds: out (EL, K, N) */
static void naive_wgrad(const geo *g, int64_t K, const double *s, const double *d, bool dds,
                        double *out) {
  int64_t b = g->b;
  memset(out, 0, sizeof(double) * (size_t)(g->EL * g->N * K));
  for (int64_t rb = 0; rb < g->Rb; rb++) {
    int64_t el = g->el_of_rb[rb];
    for (int64_t c = 0; c < g->F; c++)
      for (int64_t j = 0; j < b; j++)
        for (int64_t kk = 0; kk < K; kk++) {
          double acc = 0;
          for (int64_t r = 0; r < b; r++)
            acc += s[((rb * g->F + c) * b + r) * b + j] * d[(rb * b + r) * K + kk];
          int64_t n = c * b + j;
          out[dds ? (el * K + kk) * g->N + n : (el * g->N + n) * K + kk] += acc;
        }
  }
}

/* --------------------------------------------------------- the values */

/* T = 7, k = 2, E = 4: expert 2 receives nothing. */
static const int64_t IDS[14] = {0, 1, 1, 3, 0, 3, 3, 0, 1, 0, 3, 1, 0, 3};

static void check_all(moe_ctx *ctx, moe_dtype dt, int64_t b, int64_t F, int64_t K, int64_t e0,
                      int64_t e1, double tol) {
  moe_routing_plan *p = mk_plan(ctx, IDS, 7, 2, 4, b, F, e0, e1);
  if (!p) return;
  geo g = mk_geo(ctx, p);
  for (int tw = 0; tw < 2; tw++) {
    bool trans_w = tw == 1;
    moe_tensor *x = mk_rand(ctx, 2, (int64_t[]){g.R, K}, dt, 1);
    moe_tensor *w = mk_rand(ctx, 3, trans_w ? (int64_t[]){g.EL, g.N, K} : (int64_t[]){g.EL, K, g.N},
                            dt, 2);
    moe_tensor *s = mk_rand(ctx, 3, (int64_t[]){g.nnz, b, b}, dt, 3);
    moe_tensor *w2 = mk_rand(ctx, 3, trans_w ? (int64_t[]){g.EL, K, g.N} : (int64_t[]){g.EL, g.N, K},
                             dt, 4);
    double *vx = vals(ctx, x), *vw = vals(ctx, w), *vs = vals(ctx, s), *vw2 = vals(ctx, w2);
    int64_t nmax = g.nnz * b * b + g.R * K + g.EL * g.N * K + 1;
    double *want = (double *)malloc(sizeof(double) * (size_t)nmax);
    moe_tensor *o = NULL;

    EXPECT_OK(moe_bsmm_sdd(ctx, x, w, p, trans_w, &o));
    naive_sdd(&g, K, vx, vw, trans_w, want);
    EXPECT(o && o->dtype == dt && o->ndim == 3 && o->shape[0] == g.nnz && o->shape[1] == b);
    EXPECT(o && close_to(ctx, o, want, g.nnz * b * b, tol));
    moe_tensor_release(o), o = NULL;

    EXPECT_OK(moe_bsmm_dsd(ctx, s, w2, p, trans_w, &o));
    naive_dsd(&g, K, vs, vw2, trans_w, want);
    EXPECT(o && o->dtype == dt && o->ndim == 2 && o->shape[0] == g.R && o->shape[1] == K);
    EXPECT(o && close_to(ctx, o, want, g.R * K, tol));
    moe_tensor_release(o), o = NULL;

    EXPECT_OK(moe_bsmm_dsd_t(ctx, s, x, p, &o));
    naive_wgrad(&g, K, vs, vx, false, want);
    EXPECT(o && o->ndim == 3 && o->shape[0] == g.EL && o->shape[1] == g.N && o->shape[2] == K);
    EXPECT(o && close_to(ctx, o, want, g.EL * g.N * K, tol));
    moe_tensor_release(o), o = NULL;

    EXPECT_OK(moe_bsmm_dds(ctx, x, s, p, &o));
    naive_wgrad(&g, K, vs, vx, true, want);
    EXPECT(o && o->ndim == 3 && o->shape[0] == g.EL && o->shape[1] == K && o->shape[2] == g.N);
    EXPECT(o && close_to(ctx, o, want, g.EL * g.N * K, tol));
    moe_tensor_release(o), o = NULL;

    free(vx), free(vw), free(vs), free(vw2), free(want);
    moe_tensor_release(x), moe_tensor_release(w), moe_tensor_release(s), moe_tensor_release(w2);
  }
  moe_routing_plan_release(p);
}

static void test_values_f64(moe_ctx *ctx) {
  check_all(ctx, MOE_F64, 4, 2, 5, 0, 0, 1e-12);
  check_all(ctx, MOE_F64, 2, 3, 1, 0, 0, 1e-12);
  check_all(ctx, MOE_F64, 1, 1, 3, 0, 0, 1e-12); /* b = 1 */
}

static void test_values_f32(moe_ctx *ctx) {
  /* f32 sums of <= 16 products of values in [-1, 1]: relative error ~1e-6 */
  check_all(ctx, MOE_F32, 4, 2, 7, 0, 0, 1e-5);
}

static void test_values_bf16(moe_ctx *ctx) {
  /* the reference uses the same bf16 inputs in f64; the only error is the
   * output's rounding to bf16 (2^-8 relative) plus f32 accumulation */
  check_all(ctx, MOE_BF16, 4, 2, 6, 0, 0, 8e-3);
}

static void test_local_experts(moe_ctx *ctx) {
  /* experts [1, 3): expert 1 has 4 tokens, expert 2 none */
  check_all(ctx, MOE_F64, 2, 2, 3, 1, 3, 1e-12);
  check_all(ctx, MOE_F64, 4, 1, 4, 3, 4, 1e-12);
}

/* T = 0: no rows, no blocks; the weight gradients are zeros. */
static void test_empty(moe_ctx *ctx) {
  moe_routing_plan *p = mk_plan(ctx, IDS, 0, 2, 3, 4, 2, 0, 0);
  if (!p) return;
  EXPECT(p->rows == 0 && p->nnz == 0);
  moe_tensor *x = mk_rand(ctx, 2, (int64_t[]){0, 5}, MOE_F32, 1);
  moe_tensor *w = mk_rand(ctx, 3, (int64_t[]){3, 5, 8}, MOE_F32, 2);
  moe_tensor *o = NULL, *s = NULL;
  EXPECT_OK(moe_bsmm_sdd(ctx, x, w, p, false, &s));
  EXPECT(s && s->ndim == 3 && s->shape[0] == 0 && s->shape[1] == 4);
  EXPECT_OK(moe_bsmm_dds(ctx, x, s, p, &o));
  EXPECT(o && o->shape[0] == 3 && o->shape[1] == 5 && o->shape[2] == 8);
  double want[120] = {0};
  EXPECT(o && close_to(ctx, o, want, 120, 0));
  moe_tensor_release(o), o = NULL;
  EXPECT_OK(moe_bsmm_dsd(ctx, s, w, p, true, &o));
  EXPECT(o && o->ndim == 2 && o->shape[0] == 0 && o->shape[1] == 5);
  moe_tensor_release(o);
  moe_tensor_release(s), moe_tensor_release(x), moe_tensor_release(w);
  moe_routing_plan_release(p);
}

/* --------------------------------------------- against dense matmul */

static void test_dense_matmul(moe_ctx *ctx) {
  moe_routing_plan *p = mk_plan(ctx, IDS, 7, 2, 4, 4, 3, 0, 0);
  if (!p) return;
  geo g = mk_geo(ctx, p);
  int64_t K = 6, C = g.EL * g.N;
  moe_tensor *x = mk_rand(ctx, 2, (int64_t[]){g.R, K}, MOE_F64, 5);
  moe_tensor *w = mk_rand(ctx, 3, (int64_t[]){g.EL, K, g.N}, MOE_F64, 6);
  moe_tensor *wt = mk_rand(ctx, 3, (int64_t[]){g.EL, g.N, K}, MOE_F64, 7);
  moe_tensor *s = mk_rand(ctx, 3, (int64_t[]){g.nnz, g.b, g.b}, MOE_F64, 8);
  moe_tensor *ones = NULL, *mask = NULL, *sd = NULL, *wcat = NULL, *wp = NULL, *wstack = NULL;
  moe_tensor *full = NULL, *masked = NULL, *o = NULL, *od = NULL, *ref = NULL, *tmp = NULL,
             *sdt = NULL, *xt = NULL;
  EXPECT_OK(moe_tensor_full(ctx, 3, (int64_t[]){g.nnz, g.b, g.b}, 1.0, MOE_F64, MOE_CPU, &ones));
  EXPECT_OK(moe_bsmm_to_dense(ctx, ones, p, &mask));
  EXPECT_OK(moe_bsmm_to_dense(ctx, s, p, &sd));
  /* SDD: to_dense(x @ w blocks) == mask * (x @ Wcat), Wcat (K, EL * N) */
  EXPECT_OK(moe_permute(ctx, w, 3, (int64_t[]){1, 0, 2}, &wp));
  EXPECT_OK(moe_reshape(ctx, wp, 2, (int64_t[]){K, C}, &wcat));
  EXPECT_OK(moe_matmul(ctx, x, wcat, &full));
  EXPECT_OK(moe_binary(ctx, MOE_OP_MUL, full, mask, &masked));
  EXPECT_OK(moe_bsmm_sdd(ctx, x, w, p, false, &o));
  EXPECT_OK(moe_bsmm_to_dense(ctx, o, p, &od));
  EXPECT(od && masked && same_tensor(ctx, od, masked, 1e-12));
  moe_tensor_release(o), moe_tensor_release(od), moe_tensor_release(full), o = od = full = NULL;
  /* DSD: s_dense @ Wstack, Wstack (EL * N, K) */
  EXPECT_OK(moe_reshape(ctx, wt, 2, (int64_t[]){C, K}, &wstack));
  EXPECT_OK(moe_matmul(ctx, sd, wstack, &ref));
  EXPECT_OK(moe_bsmm_dsd(ctx, s, wt, p, false, &o));
  EXPECT(o && ref && same_tensor(ctx, o, ref, 1e-12));
  moe_tensor_release(o), moe_tensor_release(ref), o = ref = NULL;
  /* DSD_T: s_dense^T @ x == dsd_t(s, x) as (EL * N, K) */
  EXPECT_OK(moe_transpose(ctx, sd, 0, 1, &sdt));
  EXPECT_OK(moe_matmul(ctx, sdt, x, &ref));
  EXPECT_OK(moe_bsmm_dsd_t(ctx, s, x, p, &o));
  EXPECT(o && ref && same_tensor(ctx, o, ref, 1e-12));
  moe_tensor_release(o), moe_tensor_release(ref), o = ref = NULL;
  /* DDS: x^T @ s_dense == dds(x, s) permuted to (K, EL, N) */
  EXPECT_OK(moe_transpose(ctx, x, 0, 1, &xt));
  EXPECT_OK(moe_matmul(ctx, xt, sd, &ref));
  EXPECT_OK(moe_bsmm_dds(ctx, x, s, p, &o));
  if (o) EXPECT_OK(moe_permute(ctx, o, 3, (int64_t[]){1, 0, 2}, &tmp));
  EXPECT(tmp && ref && same_tensor(ctx, tmp, ref, 1e-12));
  /* from_dense(to_dense(s)) == s */
  moe_tensor *back = NULL;
  EXPECT_OK(moe_bsmm_from_dense(ctx, sd, p, &back));
  EXPECT(back && same_tensor(ctx, back, s, 0));
  /* to_dense is zero outside the blocks: sum(sd * (1 - mask)) == 0 */
  double *vm = vals(ctx, mask), *vd = vals(ctx, sd);
  double outside = 0, inside = 0;
  for (int64_t i = 0; i < g.R * C; i++) {
    outside += vm[i] == 0 ? fabs(vd[i]) : 0;
    inside += vm[i];
  }
  EXPECT(outside == 0 && inside == (double)(g.nnz * g.b * g.b));
  free(vm), free(vd);
  moe_tensor *ts[] = {x, w, wt, s, ones, mask, sd, wcat, wp, wstack, masked, o, ref, tmp, sdt, xt,
                      back};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) moe_tensor_release(ts[i]);
  moe_routing_plan_release(p);
}

/* -------------------------------------------------------- gradients */

typedef struct gc_ud {
  moe_routing_plan *p;
  bool trans_w, dsd;
} gc_ud;

static moe_status gc_fn(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  gc_ud *u = (gc_ud *)ud;
  if (u->dsd) return moe_bsmm_dsd(ctx, in[0], in[1], u->p, u->trans_w, out);
  return moe_bsmm_sdd(ctx, in[0], in[1], u->p, u->trans_w, out);
}

static void gradcheck_case(moe_ctx *ctx, int64_t b, int64_t F, int64_t K, bool strided) {
  /* T = 5, k = 2, E = 4: expert 2 empty */
  static const int64_t ids[10] = {0, 1, 1, 3, 0, 3, 3, 0, 1, 0};
  moe_routing_plan *p = mk_plan(ctx, ids, 5, 2, 4, b, F, 0, 0);
  if (!p) return;
  geo g = mk_geo(ctx, p);
  for (int dsd = 0; dsd < 2; dsd++)
    for (int tw = 0; tw < 2; tw++) {
      moe_tensor *a = NULL, *w = NULL, *base = NULL;
      if (!dsd) {
        /* x (R, K): strided = the transpose of a (K, R) tensor */
        if (strided) {
          base = mk_rand(ctx, 2, (int64_t[]){K, g.R}, MOE_F64, 11);
          EXPECT_OK(moe_transpose(ctx, base, 0, 1, &a));
        } else {
          a = mk_rand(ctx, 2, (int64_t[]){g.R, K}, MOE_F64, 11);
        }
      } else {
        if (strided) { /* s (nnz, b, b) with its last two dims swapped */
          base = mk_rand(ctx, 3, (int64_t[]){g.nnz, b, b}, MOE_F64, 12);
          EXPECT_OK(moe_transpose(ctx, base, 1, 2, &a));
        } else {
          a = mk_rand(ctx, 3, (int64_t[]){g.nnz, b, b}, MOE_F64, 12);
        }
      }
      bool kn = dsd ? tw == 1 : tw == 0; /* w (EL, K, N) */
      w = mk_rand(ctx, 3, kn ? (int64_t[]){g.EL, K, g.N} : (int64_t[]){g.EL, g.N, K}, MOE_F64, 13);
      if (strided && base) EXPECT(!moe_tensor_is_contiguous(a));
      EXPECT_OK(moe_set_requires_grad(ctx, a, true));
      EXPECT_OK(moe_set_requires_grad(ctx, w, true));
      gc_ud u = {p, tw == 1, dsd == 1};
      moe_tensor *in[2] = {a, w};
      bool ok = gradcheck(ctx, gc_fn, 2, in, &u, 1e-6, 1e-6);
      if (!ok)
        fprintf(stderr, "  gradcheck %s trans_w=%d b=%lld strided=%d\n", dsd ? "dsd" : "sdd", tw,
                (long long)b, (int)strided);
      EXPECT(ok);
      moe_tensor_release(a), moe_tensor_release(w), moe_tensor_release(base);
    }
  moe_routing_plan_release(p);
}

static void test_gradcheck(moe_ctx *ctx) {
  gradcheck_case(ctx, 2, 2, 3, false);
  gradcheck_case(ctx, 2, 2, 3, true);
  gradcheck_case(ctx, 4, 1, 2, true);
}

/* The backward retains the plan: the graph outlives the caller's reference. */
static void test_plan_retained(moe_ctx *ctx) {
  moe_routing_plan *p = mk_plan(ctx, IDS, 7, 2, 4, 2, 2, 0, 0);
  if (!p) return;
  geo g = mk_geo(ctx, p);
  moe_tensor *x = mk_rand(ctx, 2, (int64_t[]){g.R, 3}, MOE_F64, 21);
  moe_tensor *w = mk_rand(ctx, 3, (int64_t[]){g.EL, 3, g.N}, MOE_F64, 22);
  moe_tensor *s = NULL, *y = NULL, *loss = NULL;
  EXPECT_OK(moe_set_requires_grad(ctx, x, true));
  EXPECT_OK(moe_bsmm_sdd(ctx, x, w, p, false, &s));
  EXPECT_OK(moe_bsmm_dsd(ctx, s, w, p, true, &y)); /* y (R, 3): x W W^T on the blocks */
  moe_routing_plan_release(p);                     /* the nodes keep it alive */
  EXPECT_OK(moe_sum(ctx, y, 0, NULL, false, &loss));
  EXPECT_OK(moe_backward(ctx, loss, NULL, false));
  EXPECT(moe_tensor_grad(x) != NULL);
  EXPECT(moe_tensor_grad(w) == NULL); /* w does not require grad */
  moe_tensor_release(loss), moe_tensor_release(y), moe_tensor_release(s);
  moe_tensor_release(x), moe_tensor_release(w);
}

/* ----------------------------------------------------------- errors */

static void test_errors(moe_ctx *ctx) {
  moe_routing_plan *p = mk_plan(ctx, IDS, 7, 2, 4, 4, 2, 0, 0);
  if (!p) return;
  geo g = mk_geo(ctx, p);
  moe_tensor *x = mk_rand(ctx, 2, (int64_t[]){g.R, 5}, MOE_F32, 1);
  moe_tensor *xbad = mk_rand(ctx, 2, (int64_t[]){g.R + 4, 5}, MOE_F32, 1);
  moe_tensor *x0 = mk_rand(ctx, 2, (int64_t[]){g.R, 0}, MOE_F32, 1);
  moe_tensor *x64 = mk_rand(ctx, 2, (int64_t[]){g.R, 5}, MOE_F64, 1);
  moe_tensor *xi = mk_rand(ctx, 2, (int64_t[]){g.R, 5}, MOE_I64, 1);
  moe_tensor *xh = mk_rand(ctx, 2, (int64_t[]){g.R, 5}, MOE_F16, 1);
  moe_tensor *w = mk_rand(ctx, 3, (int64_t[]){g.EL, 5, g.N}, MOE_F32, 2);
  moe_tensor *wbad = mk_rand(ctx, 3, (int64_t[]){g.EL, 5, g.N + 1}, MOE_F32, 2);
  moe_tensor *s = mk_rand(ctx, 3, (int64_t[]){g.nnz, 4, 4}, MOE_F32, 3);
  moe_tensor *sbad = mk_rand(ctx, 3, (int64_t[]){g.nnz, 4, 2}, MOE_F32, 3);
  moe_tensor *o = NULL;
  EXPECT_ERR_MSG(moe_bsmm_sdd(ctx, xbad, w, p, false, &o), MOE_ERR_SHAPE, "bsmm_sdd: x has shape");
  EXPECT_ERR_MSG(moe_bsmm_sdd(ctx, x0, w, p, false, &o), MOE_ERR_SHAPE, "K = 0");
  EXPECT_ERR_MSG(moe_bsmm_sdd(ctx, x, wbad, p, false, &o), MOE_ERR_SHAPE, "(E_loc, K, N)");
  EXPECT_ERR_MSG(moe_bsmm_sdd(ctx, x, w, p, true, &o), MOE_ERR_SHAPE, "(E_loc, N, K)");
  EXPECT_ERR_MSG(moe_bsmm_sdd(ctx, x64, w, p, false, &o), MOE_ERR_DTYPE, "bsmm_sdd: x is f64 but w is f32");
  EXPECT_ERR_MSG(moe_bsmm_sdd(ctx, xi, w, p, false, &o), MOE_ERR_DTYPE, "x has dtype i64");
  EXPECT_ERR_MSG(moe_bsmm_sdd(ctx, xh, w, p, false, &o), MOE_ERR_DTYPE, "x has dtype f16");
  EXPECT_ERR_MSG(moe_bsmm_sdd(ctx, NULL, w, p, false, &o), MOE_ERR_INVALID_ARG, "x is NULL");
  EXPECT_ERR_MSG(moe_bsmm_sdd(ctx, x, w, NULL, false, &o), MOE_ERR_INVALID_ARG, "plan is NULL");
  EXPECT_ERR_MSG(moe_bsmm_dsd(ctx, sbad, w, p, true, &o), MOE_ERR_SHAPE, "(nnz, b, b)");
  EXPECT_ERR_MSG(moe_bsmm_dsd(ctx, s, x, p, true, &o), MOE_ERR_SHAPE, "bsmm_dsd: w has shape");
  EXPECT_ERR_MSG(moe_bsmm_dsd_t(ctx, s, xbad, p, &o), MOE_ERR_SHAPE, "bsmm_dsd_t: y has shape");
  EXPECT_ERR_MSG(moe_bsmm_dds(ctx, x, sbad, p, &o), MOE_ERR_SHAPE, "bsmm_dds: s has shape");
  EXPECT_ERR_MSG(moe_bsmm_to_dense(ctx, x, p, &o), MOE_ERR_SHAPE, "bsmm_to_dense: s has shape");
  EXPECT_ERR_MSG(moe_bsmm_from_dense(ctx, x, p, &o), MOE_ERR_SHAPE, "(R, E_loc * N)");
  EXPECT(o == NULL);
  /* the fused GLU SDD: the sm_90a kernel only, so the CPU names what it needs */
  moe_tensor *h1 = NULL, *h3 = NULL, *a = NULL;
  EXPECT(!moe_bsmm_glu_fuses(ctx, p, MOE_F32));
  EXPECT_ERR_MSG(moe_bsmm_sdd_glu(ctx, x, w, w, p, 0, &h1, &h3, &a), MOE_ERR_NOT_SUPPORTED,
                 "bsmm_sdd_glu: runs on the sm_90a wgmma kernel only (bf16 on compute capability 9.x");
  EXPECT_ERR_MSG(moe_bsmm_sdd_glu(ctx, x, w, w, p, 3, &h1, &h3, &a), MOE_ERR_INVALID_ARG,
                 "activation must be 0 (silu), 1 (gelu) or 2 (gelu_tanh), got 3");
  EXPECT_ERR_MSG(moe_bsmm_sdd_glu(ctx, x, w, x64, p, 0, &h1, &h3, &a), MOE_ERR_DTYPE,
                 "bsmm_sdd_glu: x is f32 but w3 is f64");
  EXPECT_ERR_MSG(moe_bsmm_sdd_glu(ctx, x, w, w, p, 0, &h1, NULL, &a), MOE_ERR_INVALID_ARG, "h1, h3 or a is NULL");
  EXPECT(h1 == NULL && h3 == NULL && a == NULL);
  /* plans without a topology */
  moe_tensor *ids = NULL;
  double v[14];
  for (int i = 0; i < 14; i++) v[i] = (double)IDS[i];
  EXPECT_OK(moe_tensor_from_f64(ctx, v, 2, (int64_t[]){7, 2}, MOE_I64, MOE_CPU, &ids));
  moe_routing_opts op = moe_routing_opts_default();
  moe_routing_plan *unpadded = NULL, *nohidden = NULL;
  EXPECT_OK(moe_routing_plan_new(ctx, ids, 4, &op, &unpadded));
  op.block_size = 4;
  EXPECT_OK(moe_routing_plan_new(ctx, ids, 4, &op, &nohidden));
  EXPECT_ERR_MSG(moe_bsmm_sdd(ctx, x, w, unpadded, false, &o), MOE_ERR_INVALID_ARG, "not padded");
  EXPECT_ERR_MSG(moe_bsmm_dds(ctx, x, s, nohidden, &o), MOE_ERR_INVALID_ARG, "ffn_hidden");
  moe_routing_plan_release(unpadded), moe_routing_plan_release(nohidden);
  moe_tensor *ts[] = {x, xbad, x0, x64, xi, xh, w, wbad, s, sbad, ids};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) moe_tensor_release(ts[i]);
  moe_routing_plan_release(p);
}

/* The gather variants take x (T, K) in token order: row r of the product
 * reads token src[r] / k (zeros for padding and other ranks' rows). Against
 * the products on a permuted copy built here from the plan's src. */
static void check_gather(moe_ctx *ctx, int64_t e0, int64_t e1) {
  moe_routing_plan *p = mk_plan(ctx, IDS, 7, 2, 4, 4, 2, e0, e1);
  if (!p) return;
  geo g = mk_geo(ctx, p);
  const int64_t K = 5, T = 7;
  moe_tensor *x = mk_rand(ctx, 2, (int64_t[]){T, K}, MOE_F64, 21);
  double *xv = vals(ctx, x), *src = vals(ctx, p->src);
  double *pv = (double *)calloc((size_t)(g.R * K), sizeof(double));
  for (int64_t r = 0; r < g.R; r++)
    if (src[r] >= 0)
      for (int64_t c = 0; c < K; c++) pv[r * K + c] = xv[(int64_t)src[r] / 2 * K + c];
  moe_tensor *xs = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, pv, 2, (int64_t[]){g.R, K}, MOE_F64, MOE_CPU, &xs));
  moe_tensor *s = mk_rand(ctx, 3, (int64_t[]){g.nnz, 4, 4}, MOE_F64, 22);
  EXPECT(!moe_bsmm_gathers(ctx, p, MOE_BF16)); /* the CPU permutes */
  for (int tw = 0; tw < 2; tw++) {
    moe_tensor *w = mk_rand(ctx, 3, tw ? (int64_t[]){g.EL, g.N, K} : (int64_t[]){g.EL, K, g.N},
                            MOE_F64, 23);
    moe_tensor *a = NULL, *b = NULL;
    EXPECT_OK(moe_bsmm_sdd_gather(ctx, x, w, p, tw == 1, &a));
    EXPECT_OK(moe_bsmm_sdd(ctx, xs, w, p, tw == 1, &b));
    EXPECT(a && b && same_tensor(ctx, a, b, 0));
    moe_tensor_release(a), moe_tensor_release(b), moe_tensor_release(w);
  }
  moe_tensor *a = NULL, *b = NULL;
  EXPECT_OK(moe_bsmm_dds_gather(ctx, x, s, p, &a));
  EXPECT_OK(moe_bsmm_dds(ctx, xs, s, p, &b));
  EXPECT(a && b && same_tensor(ctx, a, b, 0));
  moe_tensor_release(a), moe_tensor_release(b), a = b = NULL;
  EXPECT_OK(moe_bsmm_dsd_t_gather(ctx, s, x, p, &a));
  EXPECT_OK(moe_bsmm_dsd_t(ctx, s, xs, p, &b));
  EXPECT(a && b && same_tensor(ctx, a, b, 0));
  moe_tensor_release(a), moe_tensor_release(b), a = NULL;
  /* bad input: the permuted (R, K) shape, dtypes, NULLs */
  moe_tensor *w = mk_rand(ctx, 3, (int64_t[]){g.EL, K, g.N}, MOE_F64, 23);
  moe_tensor *x32 = mk_rand(ctx, 2, (int64_t[]){T, K}, MOE_F32, 21);
  EXPECT_ERR_MSG(moe_bsmm_sdd_gather(ctx, xs, w, p, false, &a), MOE_ERR_SHAPE,
                 "bsmm_sdd_gather: x has shape");
  EXPECT_ERR_MSG(moe_bsmm_sdd_gather(ctx, x, w, p, true, &a), MOE_ERR_SHAPE, "(E_loc, N, K)");
  EXPECT_ERR_MSG(moe_bsmm_dds_gather(ctx, x32, s, p, &a), MOE_ERR_DTYPE, "x is f32 but s is f64");
  EXPECT_ERR_MSG(moe_bsmm_dsd_t_gather(ctx, s, xs, p, &a), MOE_ERR_SHAPE, "expected (T, K)");
  EXPECT_ERR_MSG(moe_bsmm_dsd_t_gather(ctx, s, x, NULL, &a), MOE_ERR_INVALID_ARG, "plan is NULL");
  EXPECT_ERR_MSG(moe_bsmm_dds_gather(ctx, x, s, p, NULL), MOE_ERR_INVALID_ARG, "out is NULL");
  EXPECT(a == NULL);
  moe_tensor *ts[] = {x, xs, s, w, x32};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) moe_tensor_release(ts[i]);
  free(xv), free(src), free(pv);
  moe_routing_plan_release(p);
}

/* dsd_sum on the CPU: the two products added (f64: exact), and its errors. */
static void test_dsd_sum(moe_ctx *ctx) {
  moe_routing_plan *p = mk_plan(ctx, IDS, 7, 2, 4, 4, 2, 0, 0);
  if (!p) return;
  geo g = mk_geo(ctx, p);
  const int64_t K = 5;
  moe_tensor *s1 = mk_rand(ctx, 3, (int64_t[]){g.nnz, 4, 4}, MOE_F64, 41);
  moe_tensor *s2 = mk_rand(ctx, 3, (int64_t[]){g.nnz, 4, 4}, MOE_F64, 42);
  for (int tw = 0; tw < 2; tw++) {
    const int64_t *ws = tw ? (int64_t[]){g.EL, K, g.N} : (int64_t[]){g.EL, g.N, K};
    moe_tensor *w1 = mk_rand(ctx, 3, ws, MOE_F64, 43), *w2 = mk_rand(ctx, 3, ws, MOE_F64, 44);
    moe_tensor *got = NULL, *a = NULL, *b = NULL, *want = NULL;
    EXPECT_OK(moe_bsmm_dsd_sum(ctx, s1, w1, s2, w2, p, tw == 1, &got));
    EXPECT_OK(moe_bsmm_dsd(ctx, s1, w1, p, tw == 1, &a));
    EXPECT_OK(moe_bsmm_dsd(ctx, s2, w2, p, tw == 1, &b));
    EXPECT_OK(moe_binary(ctx, MOE_OP_ADD, a, b, &want));
    EXPECT(got && same_tensor(ctx, got, want, 0));
    moe_tensor *ts[] = {w1, w2, got, a, b, want};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) moe_tensor_release(ts[i]);
  }
  moe_tensor *w = mk_rand(ctx, 3, (int64_t[]){g.EL, g.N, K}, MOE_F64, 43);
  moe_tensor *w6 = mk_rand(ctx, 3, (int64_t[]){g.EL, g.N, K + 1}, MOE_F64, 43);
  moe_tensor *w32 = mk_rand(ctx, 3, (int64_t[]){g.EL, g.N, K}, MOE_F32, 43);
  moe_tensor *wg = mk_rand(ctx, 3, (int64_t[]){g.EL, g.N, K}, MOE_F64, 43), *o = NULL;
  EXPECT_OK(moe_set_requires_grad(ctx, wg, true));
  EXPECT_ERR_MSG(moe_bsmm_dsd_sum(ctx, s1, w, s2, w6, p, false, &o), MOE_ERR_SHAPE,
                 "give different K (5, 6)");
  EXPECT_ERR_MSG(moe_bsmm_dsd_sum(ctx, s1, w, s2, w32, p, false, &o), MOE_ERR_DTYPE,
                 "bsmm_dsd_sum: s2 is f64 but w2 is f32");
  EXPECT_ERR_MSG(moe_bsmm_dsd_sum(ctx, s1, w, s2, wg, p, false, &o), MOE_ERR_INVALID_ARG,
                 "not differentiable, and w2 requires grad");
  EXPECT_ERR_MSG(moe_bsmm_dsd_sum(ctx, s1, w, s2, w, p, false, NULL), MOE_ERR_INVALID_ARG,
                 "out is NULL");
  EXPECT(o == NULL);
  moe_tensor *ts[] = {s1, s2, w, w6, w32, wg};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) moe_tensor_release(ts[i]);
  moe_routing_plan_release(p);
}

/* dsd_combine on the CPU (the reference of the kernel's scatter): the
 * products combined by the plan with the gates (f64: exact), k = 1 and 2, one
 * pair and two; and its errors. */
static void test_dsd_combine(moe_ctx *ctx) {
  for (int k = 1; k <= 2; k++) {
    moe_routing_plan *p = mk_plan(ctx, IDS, 7, k, 4, 4, 2, 0, 0);
    if (!p) return;
    EXPECT(!moe_bsmm_scatters(ctx, p, MOE_F64)); /* the CPU combines in a pass */
    geo g = mk_geo(ctx, p);
    const int64_t K = 5;
    moe_tensor *s1 = mk_rand(ctx, 3, (int64_t[]){g.nnz, 4, 4}, MOE_F64, 51);
    moe_tensor *s2 = mk_rand(ctx, 3, (int64_t[]){g.nnz, 4, 4}, MOE_F64, 52);
    moe_tensor *w1 = mk_rand(ctx, 3, (int64_t[]){g.EL, g.N, K}, MOE_F64, 53);
    moe_tensor *w2 = mk_rand(ctx, 3, (int64_t[]){g.EL, g.N, K}, MOE_F64, 54);
    moe_tensor *gates = mk_rand(ctx, 2, (int64_t[]){7, k}, MOE_F64, 55);
    for (int pair = 0; pair < 2; pair++) {
      moe_tensor *got = NULL, *rows = NULL, *b = NULL, *sum = NULL, *want = NULL;
      EXPECT_OK(moe_bsmm_dsd_combine(ctx, s1, w1, pair ? s2 : NULL, pair ? w2 : NULL, p, false,
                                     pair ? NULL : gates, &got));
      EXPECT_OK(moe_bsmm_dsd(ctx, s1, w1, p, false, &rows));
      if (pair) EXPECT_OK(moe_bsmm_dsd(ctx, s2, w2, p, false, &b));
      if (pair && rows && b) EXPECT_OK(moe_binary(ctx, MOE_OP_ADD, rows, b, &sum));
      EXPECT_OK(moe_routing_combine(ctx, pair ? sum : rows, p, pair ? NULL : gates, &want));
      EXPECT(got && want && got->shape[0] == 7 && got->shape[1] == K && same_tensor(ctx, got, want, 0));
      moe_tensor *ts[] = {got, rows, b, sum, want};
      for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) moe_tensor_release(ts[i]);
    }
    moe_tensor *o = NULL, *bad = mk_rand(ctx, 2, (int64_t[]){7, k + 1}, MOE_F64, 56);
    EXPECT_ERR_MSG(moe_bsmm_dsd_combine(ctx, s1, w1, NULL, NULL, p, false, bad, &o), MOE_ERR_SHAPE,
                   "bsmm_dsd_combine: gates have shape");
    EXPECT_ERR_MSG(moe_bsmm_dsd_combine(ctx, s1, w1, s2, NULL, p, false, NULL, &o), MOE_ERR_INVALID_ARG,
                   "s2 and w2 go together");
    EXPECT_OK(moe_set_requires_grad(ctx, gates, true));
    EXPECT_ERR_MSG(moe_bsmm_dsd_combine(ctx, s1, w1, NULL, NULL, p, false, gates, &o), MOE_ERR_INVALID_ARG,
                   "not differentiable, and gates requires grad");
    EXPECT(o == NULL);
    moe_tensor *ts[] = {s1, s2, w1, w2, gates, bad};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) moe_tensor_release(ts[i]);
    moe_routing_plan_release(p);
  }
}

static void test_gather(moe_ctx *ctx) {
  check_gather(ctx, 0, 0); /* all experts */
  check_gather(ctx, 1, 3); /* local experts: other ranks' rows are not in the buffer */
}

int main(void) {
  RUN(test_values_f64);
  RUN(test_values_f32);
  RUN(test_values_bf16);
  RUN(test_local_experts);
  RUN(test_empty);
  RUN(test_dense_matmul);
  RUN(test_gradcheck);
  RUN(test_plan_retained);
  RUN(test_errors);
  RUN(test_gather);
  RUN(test_dsd_sum);
  RUN(test_dsd_combine);
  return harness_end();
}
