/*
 * test_blocksparse_cuda.c - the block-sparse family on CUDA against the CPU
 * reference (moe_blocksparse.h): SDD (trans_w both ways), DSD (both ways),
 * DSD^T and DDS at b = 128 with four experts, one of them empty, T not a
 * multiple of 128, K not a multiple of the 128 tile or the 32 k-chunk (K % 8
 * for bf16, odd K for f32), to_dense / from_dense, run-to-run determinism,
 * a gradient through SDD + DSD, and the CUDA-only errors (b != 128, K % 8
 * for bf16, f64). The bf16 products run with both tile widths of
 * kernels/blocksparse.cu (MOE_BSMM_TILE = 128, 256, 256k64, wg). The
 * gather variants (rows read from token order inside the wgmma kernel)
 * against permute + the product, bit for bit; dsd_sum (two DSD pairs in one
 * kernel) against the two products added; dsd_combine (top-1: rows scattered
 * in token order by the kernel) against the products and the combine, bit
 * for bit.
 * Exits 77 without a GPU.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdlib.h>

#include "harness.h"
#include "knobs.h" /* moe_knobs_reload after setenv */
#include "moe_routing.h"

static const moe_device GPU = {MOE_DEVICE_CUDA, 0};

/* T tokens, k = 2, E = 4; expert 2 gets nothing; a skewed histogram. */
static moe_tensor *mk_ids(moe_ctx *ctx, int64_t T, moe_device d) {
  double *v = (double *)malloc(sizeof(double) * (size_t)(2 * T));
  for (int64_t t = 0; t < T; t++) {
    v[2 * t] = (double)(t % 3 == 0 ? 3 : 0);
    v[2 * t + 1] = (double)(t % 5 == 0 ? 0 : 1);
    if (v[2 * t] == v[2 * t + 1]) v[2 * t + 1] = 3;
  }
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, v, 2, (int64_t[]){T, 2}, MOE_I64, d, &t));
  free(v);
  return t;
}

static moe_routing_plan *mk_plan(moe_ctx *ctx, int64_t T, int64_t b, int64_t F, moe_device d) {
  moe_tensor *ids = mk_ids(ctx, T, d);
  moe_routing_opts o = moe_routing_opts_default();
  o.block_size = b;
  o.ffn_hidden = F * b;
  moe_routing_plan *p = NULL;
  EXPECT_OK(moe_routing_plan_new(ctx, ids, 4, &o, &p));
  moe_tensor_release(ids);
  return p;
}

/* Values in [-1, 1) of dtype dt on the CPU (deterministic). */
static moe_tensor *mk_rand(moe_ctx *ctx, int ndim, const int64_t *shape, moe_dtype dt,
                           uint64_t seed) {
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) n *= shape[i];
  double *v = (double *)malloc(sizeof(double) * (size_t)(n ? n : 1));
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 7;
  for (int64_t i = 0; i < n; i++) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    v[i] = (double)(s >> 11) / 9007199254740992.0 * 2.0 - 1.0;
  }
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, v, ndim, shape, dt, MOE_CPU, &t));
  free(v);
  return t;
}

static moe_tensor *to_gpu(moe_ctx *ctx, moe_tensor *t) {
  moe_tensor *g = NULL;
  EXPECT_OK(moe_to(ctx, t, t->dtype, GPU, &g));
  return g;
}

/* max |gpu - cpu| / (1 + |cpu|) <= tol; prints the worst element. */
static bool close_rel(moe_ctx *ctx, const moe_tensor *gpu, const moe_tensor *cpu, double tol) {
  int64_t n = moe_tensor_numel(cpu);
  if (!gpu || moe_tensor_numel(gpu) != n) return false;
  double *a = (double *)malloc(sizeof(double) * (size_t)(n ? n : 1));
  double *b = (double *)malloc(sizeof(double) * (size_t)(n ? n : 1));
  EXPECT_OK(moe_tensor_to_f64(ctx, gpu, a));
  EXPECT_OK(moe_tensor_to_f64(ctx, cpu, b));
  double worst = 0;
  int64_t wi = 0;
  for (int64_t i = 0; i < n; i++) {
    double e = fabs(a[i] - b[i]) / (1 + fabs(b[i]));
    if (!(e <= worst)) worst = e, wi = i;
  }
  bool ok = worst <= tol;
  if (!ok)
    fprintf(stderr, "  worst element %lld: gpu %.8g cpu %.8g (rel %.3g > tol %g)\n", (long long)wi,
            n ? a[wi] : 0, n ? b[wi] : 0, worst, tol);
  free(a), free(b);
  return ok;
}

static bool bit_equal(moe_ctx *ctx, const moe_tensor *x, const moe_tensor *y) {
  int64_t n = moe_tensor_numel(x);
  double *a = (double *)malloc(sizeof(double) * (size_t)(n ? n : 1));
  double *b = (double *)malloc(sizeof(double) * (size_t)(n ? n : 1));
  EXPECT_OK(moe_tensor_to_f64(ctx, x, a));
  EXPECT_OK(moe_tensor_to_f64(ctx, y, b));
  bool ok = memcmp(a, b, sizeof(double) * (size_t)n) == 0;
  free(a), free(b);
  return ok;
}

/* All four products for one dtype and K; tol written by the caller. */
static void check_products(moe_ctx *ctx, moe_dtype dt, int64_t T, int64_t F, int64_t K,
                           double tol) {
  moe_routing_plan *pc = mk_plan(ctx, T, 128, F, MOE_CPU), *pg = mk_plan(ctx, T, 128, F, GPU);
  if (!pc || !pg) {
    moe_routing_plan_release(pc), moe_routing_plan_release(pg);
    return;
  }
  EXPECT(pc->rows == pg->rows && pc->nnz == pg->nnz);
  int64_t R = pc->rows, N = F * 128, nnz = pc->nnz;
  for (int tw = 0; tw < 2; tw++) {
    bool trans_w = tw == 1;
    moe_tensor *x = mk_rand(ctx, 2, (int64_t[]){R, K}, dt, 1);
    moe_tensor *w = mk_rand(ctx, 3, trans_w ? (int64_t[]){4, N, K} : (int64_t[]){4, K, N}, dt, 2);
    moe_tensor *s = mk_rand(ctx, 3, (int64_t[]){nnz, 128, 128}, dt, 3);
    moe_tensor *w2 = mk_rand(ctx, 3, trans_w ? (int64_t[]){4, K, N} : (int64_t[]){4, N, K}, dt, 4);
    moe_tensor *gx = to_gpu(ctx, x), *gw = to_gpu(ctx, w), *gs = to_gpu(ctx, s),
               *gw2 = to_gpu(ctx, w2);
    moe_tensor *c = NULL, *g = NULL, *g2 = NULL;
    EXPECT_OK(moe_bsmm_sdd(ctx, x, w, pc, trans_w, &c));
    EXPECT_OK(moe_bsmm_sdd(ctx, gx, gw, pg, trans_w, &g));
    EXPECT(g && g->dtype == dt && close_rel(ctx, g, c, tol));
    if (!(g && close_rel(ctx, g, c, tol)))
      fprintf(stderr, "  sdd %s trans_w=%d K=%lld\n", moe_dtype_name(dt), tw, (long long)K);
    moe_tensor_release(c), moe_tensor_release(g), c = g = NULL;

    EXPECT_OK(moe_bsmm_dsd(ctx, s, w2, pc, trans_w, &c));
    EXPECT_OK(moe_bsmm_dsd(ctx, gs, gw2, pg, trans_w, &g));
    EXPECT(g && close_rel(ctx, g, c, tol));
    if (!(g && close_rel(ctx, g, c, tol)))
      fprintf(stderr, "  dsd %s trans_w=%d K=%lld\n", moe_dtype_name(dt), tw, (long long)K);
    /* determinism: a second run gives the same bits */
    EXPECT_OK(moe_bsmm_dsd(ctx, gs, gw2, pg, trans_w, &g2));
    EXPECT(g && g2 && bit_equal(ctx, g, g2));
    moe_tensor_release(c), moe_tensor_release(g), moe_tensor_release(g2), c = g = g2 = NULL;

    if (!trans_w) {
      EXPECT_OK(moe_bsmm_dsd_t(ctx, s, x, pc, &c));
      EXPECT_OK(moe_bsmm_dsd_t(ctx, gs, gx, pg, &g));
      EXPECT(g && close_rel(ctx, g, c, tol)); /* expert 2's rows: zeros on both */
      if (!(g && close_rel(ctx, g, c, tol))) fprintf(stderr, "  dsd_t %s K=%lld\n", moe_dtype_name(dt), (long long)K);
      moe_tensor_release(c), moe_tensor_release(g), c = g = NULL;
      EXPECT_OK(moe_bsmm_dds(ctx, x, s, pc, &c));
      EXPECT_OK(moe_bsmm_dds(ctx, gx, gs, pg, &g));
      EXPECT(g && close_rel(ctx, g, c, tol));
      if (!(g && close_rel(ctx, g, c, tol))) fprintf(stderr, "  dds %s K=%lld\n", moe_dtype_name(dt), (long long)K);
      moe_tensor_release(c), moe_tensor_release(g), c = g = NULL;
      /* dense conversions: exact copies */
      EXPECT_OK(moe_bsmm_to_dense(ctx, s, pc, &c));
      EXPECT_OK(moe_bsmm_to_dense(ctx, gs, pg, &g));
      EXPECT(g && c && bit_equal(ctx, g, c));
      moe_tensor *back = NULL;
      if (g) EXPECT_OK(moe_bsmm_from_dense(ctx, g, pg, &back));
      EXPECT(back && bit_equal(ctx, back, s));
      moe_tensor_release(back), moe_tensor_release(c), moe_tensor_release(g), c = g = NULL;
    }
    moe_tensor *ts[] = {x, w, s, w2, gx, gw, gs, gw2};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) moe_tensor_release(ts[i]);
  }
  moe_routing_plan_release(pc), moe_routing_plan_release(pg);
}

static void test_bf16(moe_ctx *ctx) {
  /* Same bf16 inputs on both devices, f32 accumulation on both, in different
   * orders; each result is rounded once to bf16 (2^-8 relative): two
   * roundings of nearby f32 sums differ by at most one bf16 ulp, i.e.
   * 2^-7 |v| <= 7.9e-3 (1 + |v|); 1e-2 leaves room for the f32 order. */
  check_products(ctx, MOE_BF16, 300, 3, 200, 1e-2);
  check_products(ctx, MOE_BF16, 130, 2, 8, 1e-2);    /* K = 8: one partial chunk */
  check_products(ctx, MOE_BF16, 257, 1, 264, 1e-2);  /* K = 2 tiles + 8 */
}

/* Every bf16 kernel variant (MOE_BSMM_TILE = 128, 256, 256k64, and wg: the
 * sm_90a TMA + wgmma kernel, which the other three check against through
 * the same CPU reference), same checks and tolerance as test_bf16. */
static void test_bf16_variants(moe_ctx *ctx) {
  const char *variants[] = {"128", "256", "256k64", "wg"};
  for (int v = 0; v < 4; v++) {
    setenv("MOE_BSMM_TILE", variants[v], 1);
    EXPECT_OK(moe_knobs_reload(ctx)); /* the context reads knobs at creation */
    int before = harness_failures;
    check_products(ctx, MOE_BF16, 300, 3, 200, 1e-2);
    check_products(ctx, MOE_BF16, 257, 1, 264, 1e-2);
    check_products(ctx, MOE_BF16, 130, 2, 8, 1e-2);
    check_products(ctx, MOE_BF16, 700, 5, 584, 1e-2); /* odd F, K = 2 * 256 + 72 */
    if (harness_failures != before) fprintf(stderr, "  variant MOE_BSMM_TILE=%s failed\n", variants[v]);
  }
  unsetenv("MOE_BSMM_TILE");
  EXPECT_OK(moe_knobs_reload(ctx));
}

/* A plan of T tokens, top-k of E experts (ids spread with gaps, expert 1
 * empty), b = 128, F column blocks. */
static moe_routing_plan *mk_plan_k(moe_ctx *ctx, int64_t T, int64_t E, int64_t k, int64_t F) {
  double *v = (double *)malloc(sizeof(double) * (size_t)(T * k));
  for (int64_t t = 0; t < T; t++)
    for (int64_t j = 0; j < k; j++) {
      int64_t e = (t * 7 + j * (E / k + 1) + (t * t) % 5) % E;
      v[t * k + j] = (double)(e == 1 ? 0 : e);
    }
  moe_tensor *ids = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, v, 2, (int64_t[]){T, k}, MOE_I64, GPU, &ids));
  free(v);
  moe_routing_opts o = moe_routing_opts_default();
  o.block_size = 128;
  o.ffn_hidden = F * 128;
  moe_routing_plan *p = NULL;
  EXPECT_OK(moe_routing_plan_new(ctx, ids, E, &o, &p));
  moe_tensor_release(ids);
  return p;
}

/* The gather variants against permute + the product: the kernel reads the
 * token rows in place (zeros for padding rows), so the bits must match. */
static void check_gather(moe_ctx *ctx, moe_routing_plan *p, int64_t K) {
  int64_t T = p->T, N = p->ffn_blocks * 128, EL = p->e1 - p->e0, nnz = p->nnz;
  EXPECT(moe_bsmm_gathers(ctx, p, MOE_BF16));
  EXPECT(!moe_bsmm_gathers(ctx, p, MOE_F32));
  moe_tensor *x = mk_rand(ctx, 2, (int64_t[]){T, K}, MOE_BF16, 11);
  moe_tensor *s = mk_rand(ctx, 3, (int64_t[]){nnz, 128, 128}, MOE_BF16, 12);
  moe_tensor *gx = to_gpu(ctx, x), *gs = to_gpu(ctx, s), *xs = NULL;
  EXPECT_OK(moe_routing_permute(ctx, gx, p, &xs));
  for (int tw = 0; tw < 2; tw++) {
    moe_tensor *w = mk_rand(ctx, 3, tw ? (int64_t[]){EL, N, K} : (int64_t[]){EL, K, N}, MOE_BF16, 13);
    moe_tensor *gw = to_gpu(ctx, w), *a = NULL, *b = NULL;
    EXPECT_OK(moe_bsmm_sdd_gather(ctx, gx, gw, p, tw == 1, &a));
    EXPECT_OK(moe_bsmm_sdd(ctx, xs, gw, p, tw == 1, &b));
    bool same = a && b && bit_equal(ctx, a, b);
    if (!same) fprintf(stderr, "  sdd_gather trans_w=%d T=%lld k=%lld K=%lld\n", tw, (long long)T, (long long)p->k, (long long)K);
    EXPECT(same);
    moe_tensor_release(a), moe_tensor_release(b), moe_tensor_release(w), moe_tensor_release(gw);
  }
  moe_tensor *a = NULL, *b = NULL;
  EXPECT_OK(moe_bsmm_dds_gather(ctx, gx, gs, p, &a));
  EXPECT_OK(moe_bsmm_dds(ctx, xs, gs, p, &b));
  bool same = a && b && bit_equal(ctx, a, b);
  if (!same) fprintf(stderr, "  dds_gather T=%lld k=%lld K=%lld\n", (long long)T, (long long)p->k, (long long)K);
  EXPECT(same);
  moe_tensor_release(a), moe_tensor_release(b), a = b = NULL;
  EXPECT_OK(moe_bsmm_dsd_t_gather(ctx, gs, gx, p, &a));
  EXPECT_OK(moe_bsmm_dsd_t(ctx, gs, xs, p, &b));
  same = a && b && bit_equal(ctx, a, b);
  if (!same) fprintf(stderr, "  dsd_t_gather T=%lld k=%lld K=%lld\n", (long long)T, (long long)p->k, (long long)K);
  EXPECT(same);
  moe_tensor_release(a), moe_tensor_release(b);
  moe_tensor *ts[] = {x, s, gx, gs, xs};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) moe_tensor_release(ts[i]);
}

/* dsd_sum (one kernel over two DSD pairs, one rounding) against the two
 * products added in f32. Each product is rounded to bf16 (half an ulp:
 * 2^-9 |a|) before that add, the fused sum only once, so where a and b
 * cancel the two differ by up to 2^-8 (|a| + |b|): the tolerance is
 * 1e-2 (1 + |a| + |b|) (as test_bf16's 1e-2 (1 + |v|) per product). */
static void check_dsd_sum(moe_ctx *ctx, moe_routing_plan *p, int64_t K) {
  int64_t N = p->ffn_blocks * 128, EL = p->e1 - p->e0, nnz = p->nnz;
  for (int tw = 0; tw < 2; tw++) {
    const int64_t *ws = tw ? (int64_t[]){EL, K, N} : (int64_t[]){EL, N, K};
    moe_tensor *s1 = mk_rand(ctx, 3, (int64_t[]){nnz, 128, 128}, MOE_BF16, 31);
    moe_tensor *s2 = mk_rand(ctx, 3, (int64_t[]){nnz, 128, 128}, MOE_BF16, 32);
    moe_tensor *w1 = mk_rand(ctx, 3, ws, MOE_BF16, 33), *w2 = mk_rand(ctx, 3, ws, MOE_BF16, 34);
    moe_tensor *g1 = to_gpu(ctx, s1), *g2 = to_gpu(ctx, s2), *h1 = to_gpu(ctx, w1), *h2 = to_gpu(ctx, w2);
    moe_tensor *got = NULL, *a = NULL, *b = NULL;
    EXPECT_OK(moe_bsmm_dsd_sum(ctx, g1, h1, g2, h2, p, tw == 1, &got));
    EXPECT_OK(moe_bsmm_dsd(ctx, g1, h1, p, tw == 1, &a));
    EXPECT_OK(moe_bsmm_dsd(ctx, g2, h2, p, tw == 1, &b));
    int64_t n = a ? moe_tensor_numel(a) : 0, bad = 0;
    double *x = malloc(sizeof(double) * (size_t)(n + 1)), *y = malloc(sizeof(double) * (size_t)(n + 1)),
           *z = malloc(sizeof(double) * (size_t)(n + 1));
    EXPECT(got && got->dtype == MOE_BF16 && b && moe_tensor_numel(got) == n && moe_tensor_numel(b) == n);
    if (got && b && moe_tensor_numel(got) == n && moe_tensor_numel(b) == n) {
      EXPECT_OK(moe_tensor_to_f64(ctx, got, x));
      EXPECT_OK(moe_tensor_to_f64(ctx, a, y));
      EXPECT_OK(moe_tensor_to_f64(ctx, b, z));
      for (int64_t e = 0; e < n; e++)
        if (!(fabs(x[e] - (y[e] + z[e])) <= 1e-2 * (1 + fabs(y[e]) + fabs(z[e])))) {
          if (bad++ == 0)
            fprintf(stderr, "  dsd_sum trans_w=%d T=%lld K=%lld: row %lld col %lld got %g, a %g + b %g\n", tw,
                    (long long)p->T, (long long)K, (long long)(e / K), (long long)(e % K), x[e], y[e], z[e]);
        }
    }
    EXPECT(bad == 0);
    free(x), free(y), free(z);
    moe_tensor *ts[] = {s1, s2, w1, w2, g1, g2, h1, h2, got, a, b};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) moe_tensor_release(ts[i]);
  }
}

/* dsd_combine: the scatter inside the kernel (k = 1) or the products and a
 * combine pass (k > 1), against dsd (+ dsd) and moe_routing_combine, bit for
 * bit; with gates and without, one pair and two. */
static void check_dsd_combine(moe_ctx *ctx, moe_routing_plan *p, int64_t K) {
  int64_t N = p->ffn_blocks * 128, EL = p->e1 - p->e0, nnz = p->nnz;
  EXPECT(moe_bsmm_scatters(ctx, p, MOE_BF16) == (p->k == 1));
  moe_tensor *c[5] = {mk_rand(ctx, 3, (int64_t[]){nnz, 128, 128}, MOE_BF16, 61),
                      mk_rand(ctx, 3, (int64_t[]){nnz, 128, 128}, MOE_BF16, 62),
                      mk_rand(ctx, 3, (int64_t[]){EL, N, K}, MOE_BF16, 63),
                      mk_rand(ctx, 3, (int64_t[]){EL, N, K}, MOE_BF16, 64),
                      mk_rand(ctx, 2, (int64_t[]){p->T, p->k}, MOE_BF16, 65)};
  moe_tensor *gp[5];
  for (int i = 0; i < 5; i++) gp[i] = to_gpu(ctx, c[i]);
  for (int pair = 0; pair < 2; pair++) {
    moe_tensor *got = NULL, *rows = NULL, *b = NULL, *want = NULL, *sum = NULL;
    EXPECT_OK(moe_bsmm_dsd_combine(ctx, gp[0], gp[2], pair ? gp[1] : NULL, pair ? gp[3] : NULL, p, false,
                                   pair ? NULL : gp[4], &got));
    if (pair) {
      EXPECT_OK(moe_bsmm_dsd_sum(ctx, gp[0], gp[2], gp[1], gp[3], p, false, &sum));
    } else {
      EXPECT_OK(moe_bsmm_dsd(ctx, gp[0], gp[2], p, false, &rows));
    }
    EXPECT_OK(moe_routing_combine(ctx, pair ? sum : rows, p, pair ? NULL : gp[4], &want));
    int64_t n = want ? moe_tensor_numel(want) : 0, bad = 0;
    EXPECT(got && want && moe_tensor_numel(got) == n);
    if (got && want && moe_tensor_numel(got) == n) {
      double *x = malloc(sizeof(double) * (size_t)(n + 1)), *y = malloc(sizeof(double) * (size_t)(n + 1));
      EXPECT_OK(moe_tensor_to_f64(ctx, got, x));
      EXPECT_OK(moe_tensor_to_f64(ctx, want, y));
      for (int64_t e = 0; e < n; e++)
        if (x[e] != y[e] || signbit(x[e]) != signbit(y[e])) {
          if (bad++ == 0)
            fprintf(stderr, "  dsd_combine pair=%d T=%lld k=%lld K=%lld: token %lld col %lld got %g, want %g\n",
                    pair, (long long)p->T, (long long)p->k, (long long)K, (long long)(e / K),
                    (long long)(e % K), x[e], y[e]);
        }
      free(x), free(y);
    }
    EXPECT(bad == 0);
    moe_tensor *ts[] = {got, rows, b, want, sum};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) moe_tensor_release(ts[i]);
  }
  for (int i = 0; i < 5; i++) moe_tensor_release(c[i]), moe_tensor_release(gp[i]);
}

/* Rows gathered inside the wgmma kernel (bf16): k = 1, 2, 8, up to 256
 * experts with empty ones, T not a multiple of 128, K with a partial 64-wide
 * chunk and a partial 256-wide tile; one CTA per tile and a persistent grid
 * of 3 CTAs (many tiles and stage phases per CTA). */
static void test_gather(moe_ctx *ctx) {
  const int64_t cfg[][5] = {/* T, E, k, F, K */
                            {300, 4, 2, 3, 200},  {130, 8, 1, 2, 8},   {257, 16, 8, 1, 264},
                            {700, 64, 8, 5, 584}, {1000, 256, 8, 2, 136}, {1000, 16, 1, 3, 264}};
  const char *persist[] = {"0", "3"};
  for (int v = 0; v < 2; v++) {
    setenv("MOE_BSMM_PERSIST", persist[v], 1);
    EXPECT_OK(moe_knobs_reload(ctx));
    for (size_t i = 0; i < sizeof cfg / sizeof cfg[0]; i++) {
      moe_routing_plan *p = mk_plan_k(ctx, cfg[i][0], cfg[i][1], cfg[i][2], cfg[i][3]);
      if (p) check_gather(ctx, p, cfg[i][4]);
      if (p) check_dsd_sum(ctx, p, cfg[i][4]);
      if (p) check_dsd_combine(ctx, p, cfg[i][4]);
      moe_routing_plan_release(p);
    }
  }
  unsetenv("MOE_BSMM_PERSIST");
  /* the scatter takes the staged epilogue whatever MOE_BSMM_EPI says */
  setenv("MOE_BSMM_EPI", "direct", 1);
  EXPECT_OK(moe_knobs_reload(ctx));
  moe_routing_plan *p1 = mk_plan_k(ctx, 1000, 16, 1, 3);
  if (p1) check_dsd_combine(ctx, p1, 264);
  moe_routing_plan_release(p1);
  unsetenv("MOE_BSMM_EPI");
  EXPECT_OK(moe_knobs_reload(ctx));
}

static void test_f32(moe_ctx *ctx) {
  /* f32 FMAs vs the CPU's cblas: sums of <= 384 products of values in
   * [-1, 1] agree to ~1e-6 relative; 1e-4 is generous yet catches any
   * wrong block or missing term (errors of O(1)). */
  check_products(ctx, MOE_F32, 300, 3, 77, 1e-4);  /* odd K */
  check_products(ctx, MOE_F32, 200, 2, 129, 1e-4);
}

/* A gradient through SDD then DSD on the GPU matches the CPU's. */
static void test_grad(moe_ctx *ctx) {
  moe_routing_plan *pc = mk_plan(ctx, 260, 128, 2, MOE_CPU), *pg = mk_plan(ctx, 260, 128, 2, GPU);
  if (!pc || !pg) {
    moe_routing_plan_release(pc), moe_routing_plan_release(pg);
    return;
  }
  int64_t R = pc->rows, N = 256, K = 64;
  moe_tensor *x = mk_rand(ctx, 2, (int64_t[]){R, K}, MOE_F32, 5);
  moe_tensor *w1 = mk_rand(ctx, 3, (int64_t[]){4, K, N}, MOE_F32, 6);
  moe_tensor *w2 = mk_rand(ctx, 3, (int64_t[]){4, N, K}, MOE_F32, 7);
  moe_tensor *gx = to_gpu(ctx, x), *gw1 = to_gpu(ctx, w1), *gw2 = to_gpu(ctx, w2);
  moe_tensor *leaves[2][3] = {{x, w1, w2}, {gx, gw1, gw2}};
  moe_routing_plan *plans[2] = {pc, pg};
  for (int d = 0; d < 2; d++) {
    for (int i = 0; i < 3; i++) EXPECT_OK(moe_set_requires_grad(ctx, leaves[d][i], true));
    moe_tensor *s = NULL, *y = NULL, *loss = NULL;
    EXPECT_OK(moe_bsmm_sdd(ctx, leaves[d][0], leaves[d][1], plans[d], false, &s));
    EXPECT_OK(moe_bsmm_dsd(ctx, s, leaves[d][2], plans[d], false, &y));
    EXPECT_OK(moe_sum(ctx, y, 0, NULL, false, &loss));
    EXPECT_OK(moe_backward(ctx, loss, NULL, false));
    moe_tensor_release(s), moe_tensor_release(y), moe_tensor_release(loss);
  }
  /* gradients sum <= 256 * 64 terms of O(1) values in f32: 1e-4 relative */
  for (int i = 0; i < 3; i++)
    EXPECT(close_rel(ctx, moe_tensor_grad(leaves[1][i]),
                     moe_tensor_grad(leaves[0][i]), 1e-4));
  moe_tensor *ts[] = {x, w1, w2, gx, gw1, gw2};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) moe_tensor_release(ts[i]);
  moe_routing_plan_release(pc), moe_routing_plan_release(pg);
}

static void test_errors(moe_ctx *ctx) {
  moe_routing_plan *p64 = mk_plan(ctx, 100, 64, 2, GPU), *pg = mk_plan(ctx, 100, 128, 1, GPU);
  if (!p64 || !pg) {
    moe_routing_plan_release(p64), moe_routing_plan_release(pg);
    return;
  }
  moe_tensor *x = NULL, *w = NULL, *xo = NULL, *wo = NULL, *xd = NULL, *wd = NULL, *o = NULL;
  EXPECT_OK(moe_tensor_full(ctx, 2, (int64_t[]){p64->rows, 16}, 1.0, MOE_BF16, GPU, &x));
  EXPECT_OK(moe_tensor_full(ctx, 3, (int64_t[]){4, 16, 128}, 1.0, MOE_BF16, GPU, &w));
  EXPECT_ERR_MSG(moe_bsmm_sdd(ctx, x, w, p64, false, &o), MOE_ERR_NOT_SUPPORTED, "block_size 64");
  EXPECT_OK(moe_tensor_full(ctx, 2, (int64_t[]){pg->rows, 12}, 1.0, MOE_BF16, GPU, &xo));
  EXPECT_OK(moe_tensor_full(ctx, 3, (int64_t[]){4, 12, 128}, 1.0, MOE_BF16, GPU, &wo));
  EXPECT_ERR_MSG(moe_bsmm_sdd(ctx, xo, wo, pg, false, &o), MOE_ERR_NOT_SUPPORTED, "K = 12");
  EXPECT_OK(moe_tensor_full(ctx, 2, (int64_t[]){pg->rows, 16}, 1.0, MOE_F64, GPU, &xd));
  EXPECT_OK(moe_tensor_full(ctx, 3, (int64_t[]){4, 16, 128}, 1.0, MOE_F64, GPU, &wd));
  EXPECT_ERR_MSG(moe_bsmm_sdd(ctx, xd, wd, pg, false, &o), MOE_ERR_DTYPE, "f64");
  moe_tensor *xc = NULL;
  EXPECT_OK(moe_tensor_full(ctx, 2, (int64_t[]){pg->rows, 16}, 1.0, MOE_BF16, MOE_CPU, &xc));
  EXPECT_ERR_MSG(moe_bsmm_sdd(ctx, xc, w, pg, false, &o), MOE_ERR_DEVICE, "x is on cpu");
  EXPECT(o == NULL);
  moe_tensor *ts[] = {x, w, xo, wo, xd, wd, xc};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) moe_tensor_release(ts[i]);
  moe_routing_plan_release(p64), moe_routing_plan_release(pg);
}

/* The wgmma kernel's epilogues (MOE_BSMM_EPI = tma, the default; smem;
 * direct), with one CTA per tile and with 3 CTAs walking many tiles: each
 * matches the CPU as in test_bf16 and all give the same bits (the same
 * accumulators rounded once). Odd F leaves SDD's last tile one block wide;
 * K = 200 and 584 clip the dense outputs' last columns (DSD, DSD^T) and
 * DDS's last rows. */
static moe_tensor *rand_gpu(moe_ctx *ctx, int ndim, const int64_t *shape, uint64_t seed) {
  moe_tensor *c = mk_rand(ctx, ndim, shape, MOE_BF16, seed), *g = c ? to_gpu(ctx, c) : NULL;
  moe_tensor_release(c);
  return g;
}

static void test_epilogues(moe_ctx *ctx) {
  const char *epis[] = {"tma", "smem", "direct"}, *persist[] = {"0", "3"};
  const int64_t shapes[2][3] = {{300, 3, 200}, {700, 5, 584}};
  for (int sh = 0; sh < 2; sh++) {
    int64_t T = shapes[sh][0], F = shapes[sh][1], K = shapes[sh][2];
    moe_routing_plan *pg = mk_plan(ctx, T, 128, F, GPU);
    if (!pg) continue;
    int64_t R = pg->rows, N = F * 128, nnz = pg->nnz;
    moe_tensor *x = rand_gpu(ctx, 2, (int64_t[]){R, K}, 11);
    moe_tensor *w = rand_gpu(ctx, 3, (int64_t[]){4, K, N}, 12);
    moe_tensor *s = rand_gpu(ctx, 3, (int64_t[]){nnz, 128, 128}, 13);
    moe_tensor *w2 = rand_gpu(ctx, 3, (int64_t[]){4, N, K}, 14);
    moe_tensor *ref[4] = {NULL, NULL, NULL, NULL};
    for (int p = 0; p < 2; p++) {
      for (int e = 0; e < 3; e++) {
        setenv("MOE_BSMM_EPI", epis[e], 1);
        setenv("MOE_BSMM_PERSIST", persist[p], 1);
        EXPECT_OK(moe_knobs_reload(ctx));
        moe_tensor *o[4] = {NULL, NULL, NULL, NULL};
        EXPECT_OK(moe_bsmm_sdd(ctx, x, w, pg, false, &o[0]));
        EXPECT_OK(moe_bsmm_dsd(ctx, s, w2, pg, false, &o[1]));
        EXPECT_OK(moe_bsmm_dsd_t(ctx, s, x, pg, &o[2]));
        EXPECT_OK(moe_bsmm_dds(ctx, x, s, pg, &o[3]));
        for (int i = 0; i < 4; i++) {
          if (!ref[i]) {
            ref[i] = o[i];
            continue;
          }
          bool same = o[i] && bit_equal(ctx, o[i], ref[i]);
          EXPECT(same);
          if (!same)
            fprintf(stderr, "  product %d: MOE_BSMM_EPI=%s MOE_BSMM_PERSIST=%s differs from tma, persist 0 "
                    "(T %lld F %lld K %lld)\n", i, epis[e], persist[p], (long long)T, (long long)F,
                    (long long)K);
          moe_tensor_release(o[i]);
        }
      }
    }
    /* and the default against the CPU */
    unsetenv("MOE_BSMM_EPI");
    unsetenv("MOE_BSMM_PERSIST");
    EXPECT_OK(moe_knobs_reload(ctx));
    check_products(ctx, MOE_BF16, T, F, K, 1e-2);
    moe_tensor *ts[] = {x, w, s, w2, ref[0], ref[1], ref[2], ref[3]};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) moe_tensor_release(ts[i]);
    moe_routing_plan_release(pg);
  }
}

int main(void) {
  moe_ctx *ctx = harness_start();
  SKIP_IF_NO_GPU(ctx);
  RUN(test_bf16);
  RUN(test_bf16_variants);
  RUN(test_epilogues);
  RUN(test_gather);
  RUN(test_f32);
  RUN(test_grad);
  RUN(test_errors);
  return harness_end();
}
