/*
 * test_routing_cuda.c - the routing family on CUDA against the CPU
 * reference: plans bit-identical (every variant, awkward sizes, i32/i64 and
 * strided ids), permute exact, combine and the backward passes with the
 * tolerance written beside each check, the host-sync counter on the GPU,
 * unchecked out-of-range ids (dropped, then reported by the counts copy),
 * and a timing line at the qwen3-like size (not asserted). Exits 77
 * without a GPU.
 */
#include "harness.h"
#include "moe_routing.h"

static const moe_device GPU = {MOE_DEVICE_CUDA, 0};

static uint64_t lcg_state = 777;
static uint64_t lcg(void) {
  lcg_state = lcg_state * 6364136223846793005ull + 1442695040888963407ull;
  return lcg_state >> 33;
}

static moe_tensor *to_gpu(moe_ctx *ctx, moe_tensor *t) {
  moe_tensor *g = NULL;
  if (moe_to(ctx, t, t->dtype, GPU, &g) != MOE_OK) fprintf(stderr, "to gpu: %s\n", moe_ctx_error(ctx));
  return g;
}

/* Same shape and the same i64 values. */
static int same_ints(moe_ctx *ctx, const moe_tensor *a, const moe_tensor *b, const char *what) {
  if (!a && !b) return 1;
  if (!a || !b || moe_tensor_numel(a) != moe_tensor_numel(b)) {
    fprintf(stderr, "%s: sizes differ\n", what);
    return 0;
  }
  int64_t n = moe_tensor_numel(a);
  int64_t *x = malloc(8 * (size_t)(n + 1)), *y = malloc(8 * (size_t)(n + 1));
  moe_tensor_to_i64(ctx, a, x);
  moe_tensor_to_i64(ctx, b, y);
  int ok = 1;
  for (int64_t i = 0; i < n && ok; i++)
    if (x[i] != y[i]) {
      fprintf(stderr, "%s[%lld]: cpu %lld cuda %lld\n", what, (long long)i, (long long)x[i], (long long)y[i]);
      ok = 0;
    }
  free(x), free(y);
  return ok;
}

/* max |a - b| / (1 + |a|) over all elements; -1 on a size mismatch. */
static double max_rel(moe_ctx *ctx, const moe_tensor *a, const moe_tensor *b) {
  int64_t n = moe_tensor_numel(a);
  if (n != moe_tensor_numel(b)) return -1;
  double *x = malloc(8 * (size_t)(n + 1)), *y = malloc(8 * (size_t)(n + 1)), m = 0;
  moe_tensor_to_f64(ctx, a, x);
  moe_tensor_to_f64(ctx, b, y);
  for (int64_t i = 0; i < n; i++) {
    double r = fabs(x[i] - y[i]) / (1 + fabs(x[i]));
    if (!(r <= m)) m = r; /* NaN propagates */
  }
  free(x), free(y);
  return m;
}

static int same_plan(moe_ctx *ctx, const moe_routing_plan *c, const moe_routing_plan *g) {
  int ok = c->rows == g->rows && c->capacity == g->capacity && c->nnz == g->nnz;
  ok &= same_ints(ctx, c->counts, g->counts, "counts");
  ok &= same_ints(ctx, c->kept, g->kept, "kept");
  ok &= same_ints(ctx, c->offsets, g->offsets, "offsets");
  ok &= same_ints(ctx, c->row_offsets, g->row_offsets, "row_offsets");
  ok &= same_ints(ctx, c->sort_perm, g->sort_perm, "sort_perm");
  ok &= same_ints(ctx, c->sort_inv, g->sort_inv, "sort_inv");
  ok &= same_ints(ctx, c->dest, g->dest, "dest");
  ok &= same_ints(ctx, c->src, g->src, "src");
  ok &= same_ints(ctx, c->bs_row_indices, g->bs_row_indices, "bs_row_indices");
  ok &= same_ints(ctx, c->bs_column_indices, g->bs_column_indices, "bs_column_indices");
  ok &= same_ints(ctx, c->bs_offsets, g->bs_offsets, "bs_offsets");
  ok &= same_ints(ctx, c->bs_column_indices_t, g->bs_column_indices_t, "bs_column_indices_t");
  ok &= same_ints(ctx, c->bs_offsets_t, g->bs_offsets_t, "bs_offsets_t");
  ok &= same_ints(ctx, c->bs_block_offsets_t, g->bs_block_offsets_t, "bs_block_offsets_t");
  return ok;
}

/* A random float tensor (rows, cols) on the CPU, optionally as a transposed view. */
static moe_tensor *rand_cpu(moe_ctx *ctx, int64_t rows, int64_t cols, moe_dtype dt, bool transposed) {
  moe_tensor *t = NULL, *v = NULL;
  int64_t sh[2] = {transposed ? cols : rows, transposed ? rows : cols};
  moe_tensor_empty(ctx, 2, sh, dt, MOE_CPU, &t);
  moe_uniform_(ctx, t, -1, 1);
  if (!transposed) return t;
  moe_transpose(ctx, t, 0, 1, &v);
  moe_tensor_release(t);
  return v;
}

/* The same strided layout on the GPU: copy the base then take the same view. */
static moe_tensor *gpu_like(moe_ctx *ctx, moe_tensor *c) {
  if (moe_tensor_is_contiguous(c)) return to_gpu(ctx, c);
  moe_tensor *ct = NULL, *base = NULL, *v = NULL;
  moe_transpose(ctx, c, 0, 1, &ct); /* contiguous again */
  base = to_gpu(ctx, ct);
  moe_transpose(ctx, base, 0, 1, &v);
  moe_tensor_release(ct), moe_tensor_release(base);
  return v;
}

typedef struct variant {
  double cf;
  int64_t bs, ffn, e0, e1;
  bool score;
} variant;

static void check_case(moe_ctx *ctx, int64_t T, int64_t k, int64_t E, int64_t d, moe_dtype dt,
                       bool strided) {
  int64_t N = T * k;
  double *iv = malloc(8 * (size_t)(N + 1));
  for (int64_t i = 0; i < N; i++) iv[i] = (double)(lcg() % (uint64_t)E);
  if (E > 3) /* an empty expert */
    for (int64_t i = 0; i < N; i++)
      if (iv[i] == 1) iv[i] = 2;
  moe_tensor *ids = NULL, *idsT = NULL, *gids = NULL;
  if (strided) { /* ids as a transposed view of (k, T) */
    double *tv = malloc(8 * (size_t)(N + 1));
    for (int64_t t = 0; t < T; t++)
      for (int64_t j = 0; j < k; j++) tv[j * T + t] = iv[t * k + j];
    moe_tensor_from_f64(ctx, tv, 2, (int64_t[]){k, T}, MOE_I32, MOE_CPU, &idsT);
    moe_transpose(ctx, idsT, 0, 1, &ids);
    free(tv);
  } else {
    moe_tensor_from_f64(ctx, iv, 2, (int64_t[]){T, k}, MOE_I64, MOE_CPU, &ids);
  }
  gids = gpu_like(ctx, ids);
  moe_tensor *sc = rand_cpu(ctx, T, k, MOE_F32, false), *gsc = to_gpu(ctx, sc);
  variant vs[] = {{0, 0, 0, 0, 0, false},       {0, 128, 256, 0, 0, false},
                  {1.0, 0, 0, 0, 0, false},     {1.0, 0, 0, 0, 0, true},
                  {0.75, 64, 128, 0, 0, true},  {0, 0, 0, E / 2, E, false},
                  {0, 16, 32, 0, (E + 1) / 2, false}};
  for (size_t vi = 0; vi < sizeof vs / sizeof vs[0]; vi++) {
    variant v = vs[vi];
    if (v.e1 > 0 && v.e0 >= v.e1) continue;
    moe_routing_opts o = moe_routing_opts_default();
    o.capacity_factor = v.cf, o.block_size = v.bs, o.ffn_hidden = v.ffn;
    o.expert_begin = v.e0, o.expert_end = v.e1;
    if (v.score) o.drop_policy = MOE_ROUTING_DROP_SCORE, o.scores = sc;
    moe_routing_plan *pc = NULL, *pg = NULL;
    EXPECT_OK(moe_routing_plan_new(ctx, ids, E, &o, &pc));
    o.scores = gsc;
    EXPECT_OK(moe_routing_plan_new(ctx, gids, E, &o, &pg));
    if (!pc || !pg) {
      moe_routing_plan_release(pc), moe_routing_plan_release(pg);
      continue;
    }
    int ok = same_plan(ctx, pc, pg);
    if (!ok) fprintf(stderr, "  plan differs: T %lld k %lld E %lld variant %zu\n", (long long)T, (long long)k, (long long)E, vi);
    EXPECT(ok);
    EXPECT(pc->host_syncs == pg->host_syncs);
    /* permute: a copy, exact (tolerance 0) */
    moe_tensor *x = rand_cpu(ctx, T, d, dt, strided), *gx = gpu_like(ctx, x);
    moe_tensor *y = rand_cpu(ctx, pc->rows, d, dt, strided), *gy = gpu_like(ctx, y);
    moe_tensor *g = rand_cpu(ctx, T, k, dt, false), *gg = to_gpu(ctx, g);
    moe_tensor *px = NULL, *gpx = NULL, *cy = NULL, *gcy = NULL;
    EXPECT_OK(moe_routing_permute(ctx, x, pc, &px));
    EXPECT_OK(moe_routing_permute(ctx, gx, pg, &gpx));
    EXPECT(px && gpx && max_rel(ctx, px, gpx) == 0);
    /* combine: f32 (f64) products and sums in slot order with _rn intrinsics on
     * both sides, one rounding at the store: the same bits (tolerance 0) */
    EXPECT_OK(moe_routing_combine(ctx, y, pc, g, &cy));
    EXPECT_OK(moe_routing_combine(ctx, gy, pg, gg, &gcy));
    EXPECT(cy && gcy && max_rel(ctx, cy, gcy) == 0);
    /* backward through autograd on both devices */
    moe_set_requires_grad(ctx, x, true), moe_set_requires_grad(ctx, gx, true);
    moe_set_requires_grad(ctx, y, true), moe_set_requires_grad(ctx, gy, true);
    moe_set_requires_grad(ctx, g, true), moe_set_requires_grad(ctx, gg, true);
    moe_tensor *o1 = NULL, *o2 = NULL, *go1 = NULL, *go2 = NULL;
    moe_tensor *dp = rand_cpu(ctx, pc->rows, d, dt, false), *gdp = to_gpu(ctx, dp);
    moe_tensor *dc = rand_cpu(ctx, T, d, dt, false), *gdc = to_gpu(ctx, dc);
    EXPECT_OK(moe_routing_permute(ctx, x, pc, &o1));
    EXPECT_OK(moe_routing_permute(ctx, gx, pg, &go1));
    EXPECT_OK(moe_backward(ctx, o1, dp, false));
    EXPECT_OK(moe_backward(ctx, go1, gdp, false));
    /* permute's backward is an ungated combine: exact as above */
    EXPECT(max_rel(ctx, moe_tensor_grad(x), moe_tensor_grad(gx)) == 0);
    EXPECT_OK(moe_routing_combine(ctx, y, pc, g, &o2));
    EXPECT_OK(moe_routing_combine(ctx, gy, pg, gg, &go2));
    EXPECT_OK(moe_backward(ctx, o2, dc, false));
    EXPECT_OK(moe_backward(ctx, go2, gdc, false));
    /* dy = gate * dout: one product, rounded once: exact */
    EXPECT(max_rel(ctx, moe_tensor_grad(y), moe_tensor_grad(gy)) == 0);
    /* dgates: a dot product over d; the CPU sums in f64 in order, CUDA in f32
     * (f64 for f64) by one warp: d / 32 terms per lane, then 5 tree levels.
     * f32: the error bound is (d / 32 + 6) * 2^-24 * sum |terms|, with
     * sum |terms| <= d for values in [-1, 1]; f64: the same with 2^-53, so
     * 1e-12 covers d <= 200; bf16 / f16 gradients are rounded once to 8 / 11
     * bits from different f32 / f64 sums: at most one ulp apart (2^-7 / 2^-10
     * relative), tolerance two ulps. */
    double tol = dt == MOE_F64 ? 1e-12
               : dt == MOE_F32 ? ((double)d / 32 + 6) * ldexp(1.0, -24) * (double)d
               : dt == MOE_BF16 ? 2.0 / 128 : 2.0 / 1024;
    double r = max_rel(ctx, moe_tensor_grad(g), moe_tensor_grad(gg));
    if (!(r <= tol)) fprintf(stderr, "  dgates rel %g > tol %g (dt %s d %lld)\n", r, tol, moe_dtype_name(dt), (long long)d);
    EXPECT(r <= tol);
    moe_tensor *all[] = {x, gx, y, gy, g, gg, px, gpx, cy, gcy, o1, o2, go1, go2, dp, gdp, dc, gdc};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) moe_tensor_release(all[i]);
    moe_routing_plan_release(pc), moe_routing_plan_release(pg);
  }
  moe_tensor_release(ids), moe_tensor_release(idsT), moe_tensor_release(gids);
  moe_tensor_release(sc), moe_tensor_release(gsc);
  free(iv);
}

/* The last two cases take the scatter form of the ungated permute (k > 1,
 * contiguous rows of 16-byte units: f32 and bf16) with padding, capacity
 * drops and expert ranges. */
static void test_cuda_vs_cpu(moe_ctx *ctx) {
  int64_t cases[][4] = {/* T, k, E, d */ {1, 1, 1, 1},     {0, 2, 4, 3},      {7, 2, 8, 33},
                        {129, 8, 256, 5}, {1000, 2, 8, 200}, {4099, 8, 64, 17}, {3000, 1, 3, 64},
                        {513, 4, 16, 129}, {2051, 8, 64, 40}, {700, 4, 16, 64}};
  moe_dtype dts[] = {MOE_F32, MOE_BF16, MOE_F64, MOE_F16};
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
    for (int s = 0; s < 2; s++)
      check_case(ctx, cases[c][0], cases[c][1], cases[c][2], cases[c][3], dts[(c + (size_t)s) % 4], s);
}

static void test_cuda_one_expert(moe_ctx *ctx) {
  /* every token to expert 5 of 8 (the others empty), T not a multiple of 128 */
  int64_t T = 300, k = 2, N = T * k;
  moe_tensor *ids = NULL, *gids = NULL;
  moe_tensor_full(ctx, 2, (int64_t[]){T, k}, 5, MOE_I64, MOE_CPU, &ids);
  gids = to_gpu(ctx, ids);
  moe_routing_opts o = moe_routing_opts_default();
  o.block_size = 128;
  o.ffn_hidden = 256;
  moe_routing_plan *pc = NULL, *pg = NULL;
  EXPECT_OK(moe_routing_plan_new(ctx, ids, 8, &o, &pc));
  EXPECT_OK(moe_routing_plan_new(ctx, gids, 8, &o, &pg));
  EXPECT(pc && pg && same_plan(ctx, pc, pg) && pg->rows == 640 && pg->nnz == 10);
  EXPECT(pg && pg->host_syncs == 1 && pg->counts_host[5] == N);
  moe_routing_plan_release(pc), moe_routing_plan_release(pg);
  moe_tensor_release(ids), moe_tensor_release(gids);
}

static void test_cuda_host_syncs(moe_ctx *ctx) {
  moe_tensor *ids = NULL, *gids = NULL, *x = NULL, *px = NULL, *y = NULL;
  moe_tensor_empty(ctx, 2, (int64_t[]){1000, 2}, MOE_I64, MOE_CPU, &ids);
  moe_randint_(ctx, ids, 0, 8);
  gids = to_gpu(ctx, ids);
  moe_routing_plan *p = NULL;
  EXPECT_OK(moe_routing_plan_new(ctx, gids, 8, NULL, &p));
  EXPECT(p && p->host_syncs == 0);
  moe_tensor_empty(ctx, 2, (int64_t[]){1000, 16}, MOE_F32, GPU, &x);
  moe_uniform_(ctx, x, -1, 1);
  EXPECT_OK(moe_routing_permute(ctx, x, p, &px));
  EXPECT_OK(moe_routing_combine(ctx, px, p, NULL, &y));
  EXPECT(p->host_syncs == 0);
  EXPECT_OK(moe_routing_plan_counts_to_host(ctx, p));
  EXPECT_OK(moe_routing_plan_counts_to_host(ctx, p));
  EXPECT(p->host_syncs == 1);
  int64_t sum = 0;
  for (int e = 0; e < 8; e++) sum += p->counts_host[e];
  EXPECT(sum == 2000);
  moe_routing_plan_release(p);
  moe_routing_opts o = moe_routing_opts_default();
  o.block_size = 128;
  p = NULL;
  EXPECT_OK(moe_routing_plan_new(ctx, gids, 8, &o, &p));
  EXPECT(p && p->host_syncs == 1);
  moe_routing_plan_release(p);
  moe_tensor_release(ids), moe_tensor_release(gids), moe_tensor_release(x);
  moe_tensor_release(px), moe_tensor_release(y);
}

/* Out-of-range ids on CUDA: not checked at build; dropped; the counts copy reports them. */
static void test_cuda_bad_ids(moe_ctx *ctx) {
  const double iv[] = {0, 1, 9, 2, -1, 3};
  moe_tensor *ids = NULL, *gids = NULL;
  moe_tensor_from_f64(ctx, iv, 2, (int64_t[]){3, 2}, MOE_I64, MOE_CPU, &ids);
  gids = to_gpu(ctx, ids);
  moe_routing_plan *p = NULL;
  EXPECT_OK(moe_routing_plan_new(ctx, gids, 4, NULL, &p));
  if (p) {
    EXPECT_VALUES(p->dest, 0, 0, 1, -1, 2, -1, 3);
    EXPECT_VALUES(p->src, 0, 0, 1, 3, 5, -1, -1);
    EXPECT_ERR_MSG(moe_routing_plan_counts_to_host(ctx, p), MOE_ERR_INVALID_ARG, "2 of the 6 ids");
  }
  moe_routing_plan_release(p);
  moe_routing_opts o = moe_routing_opts_default();
  o.counts_to_host = true;
  p = NULL;
  EXPECT_ERR_MSG(moe_routing_plan_new(ctx, gids, 4, &o, &p), MOE_ERR_INVALID_ARG, "not experts");
  EXPECT(p == NULL);
  moe_tensor_release(ids), moe_tensor_release(gids);
}

/* Timing at the qwen3-like size (not asserted): plan, permute, combine, bf16. */
static void test_cuda_timing(moe_ctx *ctx) {
  int64_t T = 16384, k = 8, E = 128, d = 2048;
  moe_tensor *ids = NULL, *x = NULL, *g = NULL, *px = NULL, *y = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, 2, (int64_t[]){T, k}, MOE_I64, GPU, &ids));
  EXPECT_OK(moe_randint_(ctx, ids, 0, E));
  EXPECT_OK(moe_tensor_empty(ctx, 2, (int64_t[]){T, d}, MOE_BF16, GPU, &x));
  EXPECT_OK(moe_uniform_(ctx, x, -1, 1));
  EXPECT_OK(moe_tensor_empty(ctx, 2, (int64_t[]){T, k}, MOE_BF16, GPU, &g));
  EXPECT_OK(moe_uniform_(ctx, g, 0, 1));
  moe_event *e0 = NULL, *e1 = NULL, *e2 = NULL, *e3 = NULL;
  moe_event_new(ctx, GPU, &e0), moe_event_new(ctx, GPU, &e1);
  moe_event_new(ctx, GPU, &e2), moe_event_new(ctx, GPU, &e3);
  double best[3] = {1e30, 1e30, 1e30};
  bool prev = moe_grad_set(ctx, false);
  for (int it = 0; it < 12; it++) {
    moe_routing_plan *p = NULL;
    moe_event_record(ctx, e0);
    EXPECT_OK(moe_routing_plan_new(ctx, ids, E, NULL, &p));
    moe_event_record(ctx, e1);
    if (p) EXPECT_OK(moe_routing_permute(ctx, x, p, &px));
    moe_event_record(ctx, e2);
    if (px) EXPECT_OK(moe_routing_combine(ctx, px, p, g, &y));
    moe_event_record(ctx, e3);
    moe_event_synchronize(ctx, e3);
    double ms[3];
    moe_event_elapsed(ctx, e0, e1, &ms[0]);
    moe_event_elapsed(ctx, e1, e2, &ms[1]);
    moe_event_elapsed(ctx, e2, e3, &ms[2]);
    if (it >= 2)
      for (int i = 0; i < 3; i++) best[i] = ms[i] < best[i] ? ms[i] : best[i];
    EXPECT(p && p->host_syncs == 0);
    moe_tensor_release(px), moe_tensor_release(y);
    px = y = NULL;
    moe_routing_plan_release(p);
  }
  moe_grad_set(ctx, prev);
  /* bytes: permute reads T*d and writes T*k*d bf16; combine reads T*k*d, writes T*d */
  double gb_perm = (double)(T * d + T * k * d) * 2 / 1e9, gb_comb = (double)(T * k * d + T * d) * 2 / 1e9;
  printf("TIMING T=%lld k=%lld E=%lld d=%lld bf16 (best of 10): plan %.3f ms | permute %.3f ms "
         "(%.0f GB/s) | combine %.3f ms (%.0f GB/s)\n",
         (long long)T, (long long)k, (long long)E, (long long)d, best[0], best[1],
         gb_perm / (best[1] / 1e3), best[2], gb_comb / (best[2] / 1e3));
  moe_event_free(ctx, e0), moe_event_free(ctx, e1), moe_event_free(ctx, e2), moe_event_free(ctx, e3);
  moe_tensor_release(ids), moe_tensor_release(x), moe_tensor_release(g);
}

int main(void) {
  moe_ctx *ctx = harness_start();
  SKIP_IF_NO_GPU(ctx);
  moe_rng_seed(ctx, 4242);
  RUN(test_cuda_vs_cpu);
  RUN(test_cuda_one_expert);
  RUN(test_cuda_host_syncs);
  RUN(test_cuda_bad_ids);
  RUN(test_cuda_timing);
  return harness_end();
}
