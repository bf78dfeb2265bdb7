/*
 * test_routing.c - the routing family on the CPU (moe_routing.h): plans
 * against a naive per-expert loop written here for every variant (dropless,
 * padded with topology, capacity by position and by score, local expert
 * ranges), awkward routings (empty experts, one expert taking all, T = 0 and
 * 1, T not a multiple of 128, k = 1..8, E = 1..256), permute and combine
 * values, finite-difference gradients in f64 (contiguous and strided
 * inputs, gates included, dropped assignments), the host-sync counter,
 * per-rank counts, and error paths.
 */
#include "gradcheck.h"
#include "harness.h"
#include "moe_routing.h"

/* ------------------------------------------------------ naive reference */

typedef struct naive_plan {
  int64_t T, k, E, N, e0, e1, C, bs, R;
  int64_t *counts, *kept, *offsets, *row_offsets, *perm, *inv, *dest, *src;
} naive_plan;

static void naive_free(naive_plan *p) {
  free(p->counts), free(p->kept), free(p->offsets), free(p->row_offsets);
  free(p->perm), free(p->inv), free(p->dest), free(p->src);
}

/* Per expert, in increasing e: collect its assignments in order of a (or by
 * descending score, ties by a), then lay out rows. */
static void naive_build(naive_plan *p, const int64_t *ids, const double *scores, int64_t T,
                        int64_t k, int64_t E, double cf, int64_t bs, int64_t e0, int64_t e1) {
  int64_t N = T * k;
  p->T = T, p->k = k, p->E = E, p->N = N, p->bs = bs;
  p->e0 = e1 > 0 ? e0 : 0;
  p->e1 = e1 > 0 ? e1 : E;
  p->counts = calloc((size_t)E, 8), p->kept = calloc((size_t)E, 8);
  p->offsets = calloc((size_t)E + 1, 8), p->row_offsets = calloc((size_t)E + 1, 8);
  p->perm = calloc((size_t)N + 1, 8), p->inv = calloc((size_t)N + 1, 8);
  p->dest = calloc((size_t)N + 1, 8);
  p->C = 0;
  if (cf > 0) {
    p->C = (int64_t)ceil(cf * (double)N / (double)E);
    if (bs > 0) p->C = (p->C + bs - 1) / bs * bs;
    if (p->C == 0) p->C = bs > 0 ? bs : 1;
  }
  int64_t pos = 0;
  int64_t *seg = calloc((size_t)E + 1, 8); /* global segment starts */
  for (int64_t e = 0; e < E; e++) {
    p->offsets[e] = pos;
    int64_t start = pos;
    for (int64_t a = 0; a < N; a++)
      if (ids[a] == e) p->perm[pos++] = a;
    if (scores) /* insertion sort: score descending, ties a ascending */
      for (int64_t i = start + 1; i < pos; i++)
        for (int64_t j = i; j > start; j--) {
          int64_t x = p->perm[j - 1], y = p->perm[j];
          if (scores[y] > scores[x]) p->perm[j - 1] = y, p->perm[j] = x;
          else break;
        }
    p->counts[e] = pos - start;
    int64_t segsize = p->C > 0 ? p->C : bs > 0 ? (p->counts[e] + bs - 1) / bs * bs : p->counts[e];
    seg[e + 1] = seg[e] + segsize;
  }
  p->offsets[E] = pos;
  for (int64_t i = 0; i < N; i++) p->inv[p->perm[i]] = i;
  for (int64_t e = 0; e <= E; e++) {
    int64_t v = seg[e] < seg[p->e0] ? seg[p->e0] : seg[e] > seg[p->e1] ? seg[p->e1] : seg[e];
    p->row_offsets[e] = v - seg[p->e0];
  }
  p->R = p->C > 0 ? (p->e1 - p->e0) * p->C : (bs > 0 || p->e0 > 0 || p->e1 < E) ? p->row_offsets[E] : N;
  p->src = malloc(sizeof(int64_t) * (size_t)(p->R + 1));
  for (int64_t r = 0; r < p->R; r++) p->src[r] = -1;
  for (int64_t a = 0; a < N; a++) p->dest[a] = -1;
  for (int64_t e = p->e0; e < p->e1; e++) {
    int64_t n = p->counts[e];
    if (p->C > 0 && n > p->C) n = p->C;
    p->kept[e] = n;
    for (int64_t i = 0; i < n; i++) {
      int64_t a = p->perm[p->offsets[e] + i], row = p->row_offsets[e] + i;
      p->dest[a] = row;
      p->src[row] = a;
    }
  }
  free(seg);
}

/* t holds the n i64 values of want. */
static int same_i64(const moe_tensor *t, const int64_t *want, int64_t n, const char *what) {
  if (!t || moe_tensor_numel(t) != n) {
    fprintf(stderr, "%s: %lld elements, wanted %lld\n", what, t ? (long long)moe_tensor_numel(t) : -1LL,
            (long long)n);
    return 0;
  }
  int64_t *got = malloc(sizeof(int64_t) * (size_t)(n + 1));
  moe_tensor_to_i64(harness_ctx, t, got);
  for (int64_t i = 0; i < n; i++)
    if (got[i] != want[i]) {
      fprintf(stderr, "%s[%lld] = %lld, wanted %lld\n", what, (long long)i, (long long)got[i],
              (long long)want[i]);
      free(got);
      return 0;
    }
  free(got);
  return 1;
}

static int plan_matches(const moe_routing_plan *p, const naive_plan *q) {
  int ok = p->rows == q->R && p->capacity == q->C;
  if (!ok) fprintf(stderr, "rows %lld (wanted %lld), capacity %lld (wanted %lld)\n", (long long)p->rows,
                   (long long)q->R, (long long)p->capacity, (long long)q->C);
  ok &= same_i64(p->counts, q->counts, q->E, "counts");
  ok &= same_i64(p->kept, q->kept, q->E, "kept");
  ok &= same_i64(p->offsets, q->offsets, q->E + 1, "offsets");
  ok &= same_i64(p->row_offsets, q->row_offsets, q->E + 1, "row_offsets");
  ok &= same_i64(p->sort_perm, q->perm, q->N, "sort_perm");
  ok &= same_i64(p->sort_inv, q->inv, q->N, "sort_inv");
  ok &= same_i64(p->dest, q->dest, q->N, "dest");
  ok &= same_i64(p->src, q->src, q->R, "src");
  return ok;
}

/* A tiny deterministic generator for ids and values. */
static uint64_t lcg_state = 12345;
static uint64_t lcg(void) {
  lcg_state = lcg_state * 6364136223846793005ull + 1442695040888963407ull;
  return lcg_state >> 33;
}

static moe_tensor *ids_tensor(moe_ctx *ctx, const int64_t *ids, int64_t T, int64_t k, moe_dtype dt) {
  double *v = malloc(sizeof(double) * (size_t)(T * k + 1));
  for (int64_t i = 0; i < T * k; i++) v[i] = (double)ids[i];
  moe_tensor *t = NULL;
  moe_tensor_from_f64(ctx, v, 2, (int64_t[]){T, k}, dt, MOE_CPU, &t);
  free(v);
  return t;
}

/* ------------------------------------------------------------ plans */

typedef struct variant {
  double cf;
  int64_t bs, e0, e1;
  bool score;
} variant;

/* One routing checked against the naive plan under several variants, and
 * permute / combine against naive loops. */
static void check_routing(moe_ctx *ctx, const int64_t *ids, int64_t T, int64_t k, int64_t E) {
  int64_t N = T * k;
  double *scores = malloc(sizeof(double) * (size_t)(N + 1));
  for (int64_t a = 0; a < N; a++) scores[a] = (double)(lcg() % 7) / 8.0; /* ties on purpose */
  moe_tensor *tid = ids_tensor(ctx, ids, T, k, (T + k) % 2 ? MOE_I32 : MOE_I64), *tsc = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, scores, 2, (int64_t[]){T, k}, MOE_F32, MOE_CPU, &tsc));
  variant vs[] = {{0, 0, 0, 0, false},   {0, 4, 0, 0, false},   {1.0, 0, 0, 0, false},
                  {1.25, 0, 0, 0, true}, {0.5, 2, 0, 0, false}, {0, 0, E / 2, E, false},
                  {0, 3, 0, (E + 1) / 2, false}, {2.0, 0, E - 1, E, true}};
  int64_t d = 3;
  for (size_t vi = 0; vi < sizeof vs / sizeof vs[0]; vi++) {
    variant v = vs[vi];
    if (v.e1 > 0 && v.e0 >= v.e1) continue;
    moe_routing_opts o = moe_routing_opts_default();
    o.capacity_factor = v.cf;
    o.block_size = v.bs;
    o.expert_begin = v.e0;
    o.expert_end = v.e1;
    if (v.score) o.drop_policy = MOE_ROUTING_DROP_SCORE, o.scores = tsc;
    moe_routing_plan *p = NULL;
    EXPECT_OK(moe_routing_plan_new(ctx, tid, E, &o, &p));
    if (!p) continue;
    naive_plan q;
    naive_build(&q, ids, v.score ? scores : NULL, T, k, E, v.cf, v.bs, v.e0, v.e1);
    int ok = plan_matches(p, &q);
    if (!ok) fprintf(stderr, "  (T %lld k %lld E %lld variant %zu)\n", (long long)T, (long long)k, (long long)E, vi);
    EXPECT(ok);
    /* permute and combine against naive loops, f32 */
    double *x = malloc(sizeof(double) * (size_t)(T * d + 1));
    double *g = malloc(sizeof(double) * (size_t)(N + 1));
    double *y = malloc(sizeof(double) * (size_t)(q.R * d + 1));
    for (int64_t i = 0; i < T * d; i++) x[i] = (double)(int64_t)(lcg() % 17) - 8;
    for (int64_t i = 0; i < N; i++) g[i] = (double)(lcg() % 5) / 4.0;
    for (int64_t i = 0; i < q.R * d; i++) y[i] = (double)(int64_t)(lcg() % 13) - 6;
    moe_tensor *tx = NULL, *tg = NULL, *ty = NULL, *px = NULL, *cy = NULL;
    EXPECT_OK(moe_tensor_from_f64(ctx, x, 2, (int64_t[]){T, d}, MOE_F32, MOE_CPU, &tx));
    EXPECT_OK(moe_tensor_from_f64(ctx, g, 2, (int64_t[]){T, k}, MOE_F32, MOE_CPU, &tg));
    EXPECT_OK(moe_tensor_from_f64(ctx, y, 2, (int64_t[]){q.R, d}, MOE_F32, MOE_CPU, &ty));
    EXPECT_OK(moe_routing_permute(ctx, tx, p, &px));
    EXPECT_OK(moe_routing_combine(ctx, ty, p, tg, &cy));
    double *want = calloc((size_t)(q.R * d + T * d + 1), sizeof(double));
    for (int64_t a = 0; a < N; a++)
      if (q.dest[a] >= 0)
        for (int64_t c = 0; c < d; c++) want[q.dest[a] * d + c] = x[(a / k) * d + c];
    harness_checks++;
    if (!harness_values(px, want, q.R * d, 0, __FILE__, __LINE__)) harness_failures++;
    for (int64_t i = 0; i < T * d; i++) want[i] = 0;
    for (int64_t t = 0; t < T; t++)
      for (int64_t j = 0; j < k; j++) {
        int64_t row = q.dest[t * k + j];
        if (row >= 0)
          for (int64_t c = 0; c < d; c++) want[t * d + c] += g[t * k + j] * y[row * d + c];
      }
    /* small integers times quarters: exact in f32 */
    harness_checks++;
    if (!harness_values(cy, want, T * d, 0, __FILE__, __LINE__)) harness_failures++;
    free(want), free(x), free(g), free(y);
    moe_tensor_release(tx), moe_tensor_release(tg), moe_tensor_release(ty);
    moe_tensor_release(px), moe_tensor_release(cy);
    naive_free(&q);
    moe_routing_plan_release(p);
  }
  moe_tensor_release(tid);
  moe_tensor_release(tsc);
  free(scores);
}

static void test_plan_random(moe_ctx *ctx) {
  int64_t Ts[] = {0, 1, 5, 130, 300};
  int64_t ks[] = {1, 2, 3, 8};
  int64_t Es[] = {1, 2, 7, 64, 256};
  for (size_t a = 0; a < 5; a++)
    for (size_t b = 0; b < 4; b++)
      for (size_t c = 0; c < 5; c++) {
        int64_t T = Ts[a], k = ks[b], E = Es[c];
        int64_t *ids = malloc(sizeof(int64_t) * (size_t)(T * k + 1));
        for (int64_t i = 0; i < T * k; i++) ids[i] = (int64_t)(lcg() % (uint64_t)E);
        check_routing(ctx, ids, T, k, E);
        free(ids);
      }
}

static void test_plan_awkward(moe_ctx *ctx) {
  /* every token to one expert (the last of 8), others empty */
  int64_t T = 131, k = 2, E = 8;
  int64_t *ids = malloc(sizeof(int64_t) * (size_t)(T * k));
  for (int64_t i = 0; i < T * k; i++) ids[i] = E - 1;
  check_routing(ctx, ids, T, k, E);
  /* only even experts used, k = 8 of E = 16 distinct per token */
  T = 129, k = 8, E = 16;
  ids = realloc(ids, sizeof(int64_t) * (size_t)(T * k));
  for (int64_t t = 0; t < T; t++)
    for (int64_t j = 0; j < k; j++) ids[t * k + j] = (2 * (j + t)) % E;
  check_routing(ctx, ids, T, k, E);
  free(ids);
}

/* A hand example: T = 4, k = 2, E = 3. */
static void test_plan_by_hand(moe_ctx *ctx) {
  const int64_t ids[] = {2, 0, 0, 2, 1, 2, 2, 0};
  moe_tensor *tid = ids_tensor(ctx, ids, 4, 2, MOE_I64);
  moe_routing_plan *p = NULL;
  EXPECT_OK(moe_routing_plan_new(ctx, tid, 3, NULL, &p));
  EXPECT(p && p->rows == 8 && p->host_syncs == 0);
  if (p) {
    EXPECT_VALUES(p->counts, 0, 3, 1, 4);
    EXPECT_VALUES(p->offsets, 0, 0, 3, 4, 8);
    /* expert 0: a = 1, 2, 7; expert 1: a = 4; expert 2: a = 0, 3, 5, 6 */
    EXPECT_VALUES(p->sort_perm, 0, 1, 2, 7, 4, 0, 3, 5, 6);
    EXPECT_VALUES(p->sort_inv, 0, 4, 0, 1, 5, 3, 6, 7, 2);
    EXPECT_VALUES(p->dest, 0, 4, 0, 1, 5, 3, 6, 7, 2);
  }
  moe_routing_plan_release(p);
  /* capacity 1.0: C = ceil(8 / 3) = 3, expert 2 drops its 4th (a = 6) */
  moe_routing_opts o = moe_routing_opts_default();
  o.capacity_factor = 1.0;
  p = NULL;
  EXPECT_OK(moe_routing_plan_new(ctx, tid, 3, &o, &p));
  EXPECT(p && p->capacity == 3 && p->rows == 9);
  if (p) {
    EXPECT_VALUES(p->kept, 0, 3, 1, 3);
    EXPECT_VALUES(p->dest, 0, 6, 0, 1, 7, 3, 8, -1, 2);
    EXPECT_VALUES(p->src, 0, 1, 2, 7, 4, -1, -1, 0, 3, 5);
  }
  moe_routing_plan_release(p);
  /* by score: expert 2's assignments 0, 3, 5, 6 with scores .1 .9 .5 .7 keep 3, 6, 5 */
  const double sc[] = {0.1, 0.2, 0.3, 0.9, 0.4, 0.5, 0.7, 0.8};
  moe_tensor *ts = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, sc, 2, (int64_t[]){4, 2}, MOE_F64, MOE_CPU, &ts));
  o.drop_policy = MOE_ROUTING_DROP_SCORE;
  o.scores = ts;
  p = NULL;
  EXPECT_OK(moe_routing_plan_new(ctx, tid, 3, &o, &p));
  if (p) {
    /* expert 0 (a = 1, 2, 7 with .2 .3 .8): 7, 2, 1 */
    EXPECT_VALUES(p->src, 0, 7, 2, 1, 4, -1, -1, 3, 6, 5);
    EXPECT_VALUES(p->dest, 0, -1, 2, 1, 6, 3, 8, 7, 0);
  }
  moe_routing_plan_release(p);
  moe_tensor_release(ts);
  moe_tensor_release(tid);
}

/* ----------------------------------------------------------- topology */

static void check_topology(moe_ctx *ctx, const moe_routing_plan *p) {
  int64_t bs = p->block_size, F = p->ffn_blocks, Rb = p->rows / bs, EL = p->e1 - p->e0;
  int64_t nnz = p->nnz, ncol = EL * F;
  EXPECT(nnz == Rb * F);
  int64_t *ri = malloc(8 * (size_t)(nnz + 1)), *ci = malloc(8 * (size_t)(nnz + 1));
  int64_t *off = malloc(8 * (size_t)(Rb + 1)), *cit = malloc(8 * (size_t)(nnz + 1));
  int64_t *offt = malloc(8 * (size_t)(ncol + 1)), *bot = malloc(8 * (size_t)(nnz + 1));
  int64_t *ro = malloc(8 * (size_t)(p->E + 1));
  EXPECT_OK(moe_tensor_to_i64(ctx, p->bs_row_indices, ri));
  EXPECT_OK(moe_tensor_to_i64(ctx, p->bs_column_indices, ci));
  EXPECT_OK(moe_tensor_to_i64(ctx, p->bs_offsets, off));
  EXPECT_OK(moe_tensor_to_i64(ctx, p->bs_column_indices_t, cit));
  EXPECT_OK(moe_tensor_to_i64(ctx, p->bs_offsets_t, offt));
  EXPECT_OK(moe_tensor_to_i64(ctx, p->bs_block_offsets_t, bot));
  EXPECT_OK(moe_tensor_to_i64(ctx, p->row_offsets, ro));
  /* the dense block mask, naive: row block rb is expert e's when inside its segment */
  char *mask = calloc((size_t)(Rb * ncol + 1), 1);
  for (int64_t e = p->e0; e < p->e1; e++)
    for (int64_t rb = ro[e] / bs; rb < ro[e + 1] / bs; rb++)
      for (int64_t c = 0; c < F; c++) mask[rb * ncol + (e - p->e0) * F + c] = 1;
  int ok = off[0] == 0 && off[Rb] == nnz && offt[0] == 0 && offt[ncol] == nnz;
  /* CSR: row-major listing of the mask */
  for (int64_t rb = 0, i = 0; rb < Rb && ok; rb++) {
    ok &= off[rb] == i;
    for (int64_t col = 0; col < ncol; col++)
      if (mask[rb * ncol + col]) {
        ok &= i < nnz && ri[i] == rb && ci[i] == col;
        i++;
      }
  }
  /* transpose: column-major listing, block_offsets_t pointing back */
  for (int64_t col = 0, it = 0; col < ncol && ok; col++) {
    ok &= offt[col] == it;
    for (int64_t rb = 0; rb < Rb; rb++)
      if (mask[rb * ncol + col]) {
        ok &= it < nnz && cit[it] == rb && bot[it] >= 0 && bot[it] < nnz && ri[bot[it]] == rb &&
              ci[bot[it]] == col;
        it++;
      }
  }
  if (!ok) fprintf(stderr, "topology mismatch (rows %lld bs %lld F %lld)\n", (long long)p->rows, (long long)bs, (long long)F);
  EXPECT(ok);
  free(mask), free(ri), free(ci), free(off), free(cit), free(offt), free(bot), free(ro);
}

static void test_topology(moe_ctx *ctx) {
  int64_t cases[][5] = {/* T, k, E, bs, F */ {10, 2, 4, 4, 3}, {130, 2, 8, 128, 2}, {1, 1, 3, 2, 1},
                        {0, 2, 4, 4, 2},    {40, 3, 16, 8, 4}, {300, 8, 64, 16, 1}};
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    int64_t T = cases[c][0], k = cases[c][1], E = cases[c][2], bs = cases[c][3], F = cases[c][4];
    int64_t *ids = malloc(8 * (size_t)(T * k + 1));
    for (int64_t i = 0; i < T * k; i++) ids[i] = (int64_t)(lcg() % (uint64_t)(E > 2 ? E - 1 : E)); /* last empty */
    moe_tensor *tid = ids_tensor(ctx, ids, T, k, MOE_I64);
    for (int loc = 0; loc < 3; loc++) {
      moe_routing_opts o = moe_routing_opts_default();
      o.block_size = bs;
      o.ffn_hidden = F * bs;
      if (loc == 1) o.expert_begin = 1, o.expert_end = E;
      if (loc == 2) o.capacity_factor = 1.5;
      moe_routing_plan *p = NULL;
      EXPECT_OK(moe_routing_plan_new(ctx, tid, E, &o, &p));
      if (p) {
        EXPECT(p->rows % bs == 0);
        check_topology(ctx, p);
      }
      moe_routing_plan_release(p);
    }
    moe_tensor_release(tid);
    free(ids);
  }
}

/* ------------------------------------------------------- host syncs */

static void test_host_syncs(moe_ctx *ctx) {
  const int64_t ids[] = {0, 1, 1, 1, 3, 0};
  moe_tensor *tid = ids_tensor(ctx, ids, 3, 2, MOE_I64);
  moe_routing_plan *p = NULL;
  /* dropless: no copy unless asked */
  EXPECT_OK(moe_routing_plan_new(ctx, tid, 4, NULL, &p));
  EXPECT(p && p->host_syncs == 0 && p->counts_host == NULL);
  moe_tensor *x = NULL, *px = NULL, *y = NULL;
  EXPECT_OK(moe_tensor_full(ctx, 2, (int64_t[]){3, 2}, 1.0, MOE_F32, MOE_CPU, &x));
  EXPECT_OK(moe_routing_permute(ctx, x, p, &px));
  EXPECT_OK(moe_routing_combine(ctx, px, p, NULL, &y));
  EXPECT(p->host_syncs == 0); /* permute and combine never copy */
  EXPECT_OK(moe_routing_plan_counts_to_host(ctx, p));
  EXPECT(p->host_syncs == 1 && p->counts_host && p->counts_host[1] == 3 && p->counts_host[2] == 0);
  EXPECT_OK(moe_routing_plan_counts_to_host(ctx, p)); /* reuses the copy */
  EXPECT(p->host_syncs == 1);
  moe_routing_plan_release(p);
  /* asked at build time: one */
  moe_routing_opts o = moe_routing_opts_default();
  o.counts_to_host = true;
  EXPECT_OK(moe_routing_plan_new(ctx, tid, 4, &o, &p));
  EXPECT(p && p->host_syncs == 1);
  moe_routing_plan_release(p);
  /* padded: rows depend on the data, so the plan copies once (and no more) */
  o = moe_routing_opts_default();
  o.block_size = 4;
  EXPECT_OK(moe_routing_plan_new(ctx, tid, 4, &o, &p));
  EXPECT(p && p->host_syncs == 1 && p->rows == 12);
  if (p) {
    EXPECT(p->row_offsets_host[4] == 12 && p->row_offsets_host[2] == 8 && p->row_offsets_host[3] == 8);
    EXPECT_OK(moe_routing_plan_counts_to_host(ctx, p));
    EXPECT(p->host_syncs == 1);
  }
  moe_routing_plan_release(p);
  /* capacity: static rows, no copy */
  o = moe_routing_opts_default();
  o.capacity_factor = 1.0;
  o.block_size = 2;
  EXPECT_OK(moe_routing_plan_new(ctx, tid, 4, &o, &p));
  EXPECT(p && p->host_syncs == 0 && p->capacity == 2 && p->rows == 8);
  moe_routing_plan_release(p);
  moe_tensor_release(x), moe_tensor_release(px), moe_tensor_release(y);
  moe_tensor_release(tid);
}

static void test_rank_counts(moe_ctx *ctx) {
  const int64_t ids[] = {0, 1, 1, 1, 3, 0, 2, 3};
  moe_tensor *tid = ids_tensor(ctx, ids, 4, 2, MOE_I32), *rc = NULL;
  moe_routing_plan *p = NULL;
  EXPECT_OK(moe_routing_plan_new(ctx, tid, 4, NULL, &p));
  EXPECT_OK(moe_routing_rank_counts(ctx, p, 2, &rc));
  if (rc) EXPECT_VALUES(rc, 0, 5, 3);
  moe_tensor_release(rc);
  rc = NULL;
  EXPECT_OK(moe_routing_rank_counts(ctx, p, 4, &rc));
  if (rc) EXPECT_VALUES(rc, 0, 2, 3, 1, 2);
  moe_tensor_release(rc);
  EXPECT_ERR_MSG(moe_routing_rank_counts(ctx, p, 3, &rc), MOE_ERR_INVALID_ARG, "do not divide");
  moe_routing_plan_release(p);
  moe_tensor_release(tid);
}

/* ---------------------------------------------------------- gradients */

static moe_status f_permute(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  return moe_routing_permute(ctx, in[0], (moe_routing_plan *)ud, out);
}
static moe_status f_combine(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  return moe_routing_combine(ctx, in[0], (moe_routing_plan *)ud, in[1], out);
}
static moe_status f_combine_nogates(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  return moe_routing_combine(ctx, in[0], (moe_routing_plan *)ud, NULL, out);
}
/* permute then combine: the layer's data path with gates */
static moe_status f_roundtrip(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  moe_tensor *px = NULL, *sq = NULL;
  moe_status st = moe_routing_permute(ctx, in[0], (moe_routing_plan *)ud, &px);
  if (st == MOE_OK) st = moe_binary(ctx, MOE_OP_MUL, px, px, &sq);
  if (st == MOE_OK) st = moe_routing_combine(ctx, sq, (moe_routing_plan *)ud, in[1], out);
  moe_tensor_release(px);
  moe_tensor_release(sq);
  return st;
}

/* A leaf (rows, cols) f64 requiring grad; transposed: a view of a (cols, rows) leaf. */
static moe_tensor *leaf(moe_ctx *ctx, int64_t rows, int64_t cols, bool transposed, moe_tensor **base) {
  int64_t n = rows * cols;
  double *v = malloc(sizeof(double) * (size_t)(n + 1));
  for (int64_t i = 0; i < n; i++) v[i] = sin(0.37 * (double)i + 0.11) + 0.2;
  moe_tensor *b = NULL, *t = NULL;
  if (transposed) {
    moe_tensor_from_f64(ctx, v, 2, (int64_t[]){cols, rows}, MOE_F64, MOE_CPU, &b);
    moe_set_requires_grad(ctx, b, true);
    bool prev = moe_grad_set(ctx, false);
    moe_transpose(ctx, b, 0, 1, &t);
    moe_grad_set(ctx, prev);
    moe_set_requires_grad(ctx, t, true);
  } else {
    moe_tensor_from_f64(ctx, v, 2, (int64_t[]){rows, cols}, MOE_F64, MOE_CPU, &t);
    moe_set_requires_grad(ctx, t, true);
  }
  free(v);
  *base = b;
  return t;
}

static void test_gradients(moe_ctx *ctx) {
  const int64_t ids[] = {2, 0, 0, 2, 1, 2, 2, 0, 3, 2};
  moe_tensor *tid = ids_tensor(ctx, ids, 5, 2, MOE_I64);
  moe_routing_opts opts[4];
  for (int i = 0; i < 4; i++) opts[i] = moe_routing_opts_default();
  opts[1].block_size = 2;                              /* padded */
  opts[2].capacity_factor = 1.0;                       /* drops one of expert 2's */
  opts[3].expert_begin = 1, opts[3].expert_end = 3;    /* local experts 1, 2 */
  for (int v = 0; v < 4; v++) {
    moe_routing_plan *p = NULL;
    EXPECT_OK(moe_routing_plan_new(ctx, tid, 4, &opts[v], &p));
    if (!p) continue;
    for (int tr = 0; tr < 2; tr++) {
      moe_tensor *bx, *by, *bg;
      moe_tensor *x = leaf(ctx, 5, 3, tr, &bx), *y = leaf(ctx, p->rows, 3, tr, &by);
      moe_tensor *g = leaf(ctx, 5, 2, tr, &bg);
      EXPECT(gradcheck(ctx, f_permute, 1, &x, p, 1e-6, 1e-6));
      EXPECT(gradcheck(ctx, f_combine, 2, (moe_tensor *[]){y, g}, p, 1e-6, 1e-6));
      EXPECT(gradcheck(ctx, f_combine_nogates, 1, &y, p, 1e-6, 1e-6));
      EXPECT(gradcheck(ctx, f_roundtrip, 2, (moe_tensor *[]){x, g}, p, 1e-6, 1e-6));
      moe_tensor_release(x), moe_tensor_release(y), moe_tensor_release(g);
      moe_tensor_release(bx), moe_tensor_release(by), moe_tensor_release(bg);
    }
    if (v == 2) { /* dropped assignments (expert 2: a = 6, 9) get zero gate gradient */
      moe_tensor *bx, *by, *bg, *out = NULL;
      moe_tensor *y = leaf(ctx, p->rows, 3, false, &by), *g = leaf(ctx, 5, 2, false, &bg);
      moe_tensor *x = leaf(ctx, 5, 3, false, &bx);
      moe_tensor *ones = NULL;
      EXPECT_OK(moe_routing_combine(ctx, y, p, g, &out));
      EXPECT_OK(moe_tensor_full(ctx, 2, (int64_t[]){5, 3}, 1.0, MOE_F64, MOE_CPU, &ones));
      EXPECT_OK(moe_backward(ctx, out, ones, false));
      int64_t dest[10];
      moe_tensor_to_i64(ctx, p->dest, dest);
      double gg[10] = {0};
      EXPECT(moe_tensor_grad(g) != NULL);
      if (moe_tensor_grad(g)) moe_tensor_to_f64(ctx, moe_tensor_grad(g), gg);
      int dropped = 0;
      for (int a = 0; a < 10; a++)
        if (dest[a] < 0) {
          dropped++;
          EXPECT(gg[a] == 0.0);
        }
      EXPECT(dropped == 2); /* expert 2 has 5 of capacity ceil(10 / 4) = 3 */
      moe_tensor_release(ones), moe_tensor_release(out);
      moe_tensor_release(x), moe_tensor_release(y), moe_tensor_release(g);
      moe_tensor_release(bx), moe_tensor_release(by), moe_tensor_release(bg);
    }
    moe_routing_plan_release(p);
  }
  moe_tensor_release(tid);
}

/* bf16 combine: products and sums in f32, rounded once: the f32 result rounded */
static void test_bf16(moe_ctx *ctx) {
  const int64_t ids[] = {1, 0, 0, 1, 1, 0};
  moe_tensor *tid = ids_tensor(ctx, ids, 3, 2, MOE_I64);
  moe_routing_plan *p = NULL;
  EXPECT_OK(moe_routing_plan_new(ctx, tid, 2, NULL, &p));
  const double yv[] = {1.5, -2.25, 3.0, 0.5, -1.0, 2.0, 0.75, 4.0, -0.5, 1.25, 2.5, -3.5};
  const double gv[] = {0.5, 0.25, 0.75, 0.125, 1.0, 0.5};
  moe_tensor *y = NULL, *g = NULL, *y32 = NULL, *g32 = NULL, *o = NULL, *o32 = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, yv, 2, (int64_t[]){6, 2}, MOE_BF16, MOE_CPU, &y));
  EXPECT_OK(moe_tensor_from_f64(ctx, gv, 2, (int64_t[]){3, 2}, MOE_BF16, MOE_CPU, &g));
  EXPECT_OK(moe_tensor_from_f64(ctx, yv, 2, (int64_t[]){6, 2}, MOE_F32, MOE_CPU, &y32));
  EXPECT_OK(moe_tensor_from_f64(ctx, gv, 2, (int64_t[]){3, 2}, MOE_F32, MOE_CPU, &g32));
  EXPECT_OK(moe_routing_combine(ctx, y, p, g, &o));
  EXPECT_OK(moe_routing_combine(ctx, y32, p, g32, &o32));
  double a[6], b[6];
  if (o && o32) {
    moe_tensor_to_f64(ctx, o, a);
    moe_tensor_to_f64(ctx, o32, b);
    /* values exact in bf16 (few mantissa bits): equal after rounding */
    for (int i = 0; i < 6; i++) EXPECT(a[i] == b[i]);
    EXPECT(o->dtype == MOE_BF16);
  }
  moe_tensor_release(y), moe_tensor_release(g), moe_tensor_release(y32), moe_tensor_release(g32);
  moe_tensor_release(o), moe_tensor_release(o32);
  moe_routing_plan_release(p);
  moe_tensor_release(tid);
}

/* -------------------------------------------------------------- errors */

static void test_errors(moe_ctx *ctx) {
  const int64_t ids[] = {0, 1, 1, 5};
  moe_tensor *bad = ids_tensor(ctx, ids, 2, 2, MOE_I64), *good = NULL, *fl = NULL, *one = NULL;
  moe_routing_plan *p = NULL;
  EXPECT_ERR_MSG(moe_routing_plan_new(ctx, bad, 4, NULL, &p), MOE_ERR_INVALID_ARG,
                 "ids[1][1] = 5 is not an expert in [0, 4)");
  EXPECT(p == NULL);
  EXPECT_ERR_MSG(moe_routing_plan_new(ctx, bad, 0, NULL, &p), MOE_ERR_INVALID_ARG, "E = 0");
  EXPECT_OK(moe_tensor_full(ctx, 2, (int64_t[]){2, 2}, 1.0, MOE_F32, MOE_CPU, &fl));
  EXPECT_ERR_MSG(moe_routing_plan_new(ctx, fl, 4, NULL, &p), MOE_ERR_DTYPE, "ids must be i64 or i32, got f32");
  EXPECT_OK(moe_tensor_full(ctx, 1, (int64_t[]){4}, 1.0, MOE_I64, MOE_CPU, &one));
  EXPECT_ERR_MSG(moe_routing_plan_new(ctx, one, 4, NULL, &p), MOE_ERR_SHAPE, "ids must be (T, k), got shape [4]");
  EXPECT_OK(moe_tensor_full(ctx, 2, (int64_t[]){2, 2}, 1.0, MOE_I64, MOE_CPU, &good));
  moe_routing_opts o = moe_routing_opts_default();
  o.block_size = 4;
  o.ffn_hidden = 6;
  EXPECT_ERR_MSG(moe_routing_plan_new(ctx, good, 4, &o, &p), MOE_ERR_INVALID_ARG, "ffn_hidden = 6");
  o = moe_routing_opts_default();
  o.capacity_factor = 1.0;
  o.drop_policy = MOE_ROUTING_DROP_SCORE;
  EXPECT_ERR_MSG(moe_routing_plan_new(ctx, good, 4, &o, &p), MOE_ERR_INVALID_ARG, "needs scores");
  o.scores = one;
  EXPECT_ERR_MSG(moe_routing_plan_new(ctx, good, 4, &o, &p), MOE_ERR_DTYPE, "scores must be");
  o.scores = fl;
  o.capacity_factor = 0;
  EXPECT_ERR_MSG(moe_routing_plan_new(ctx, good, 4, &o, &p), MOE_ERR_INVALID_ARG, "capacity_factor > 0");
  o = moe_routing_opts_default();
  o.capacity_factor = -1;
  EXPECT_ERR(moe_routing_plan_new(ctx, good, 4, &o, &p), MOE_ERR_INVALID_ARG);
  o = moe_routing_opts_default();
  o.expert_begin = 3, o.expert_end = 2;
  EXPECT_ERR_MSG(moe_routing_plan_new(ctx, good, 4, &o, &p), MOE_ERR_INVALID_ARG, "local experts [3, 2)");
  EXPECT_OK(moe_routing_plan_new(ctx, good, 4, NULL, &p));
  moe_tensor *x3 = NULL, *out = NULL, *g3 = NULL;
  EXPECT_OK(moe_tensor_full(ctx, 2, (int64_t[]){3, 5}, 1.0, MOE_F32, MOE_CPU, &x3));
  EXPECT_ERR_MSG(moe_routing_permute(ctx, x3, p, &out), MOE_ERR_SHAPE, "x has shape [3, 5]");
  EXPECT_ERR_MSG(moe_routing_permute(ctx, good, p, &out), MOE_ERR_DTYPE, "x must be f32");
  EXPECT_ERR_MSG(moe_routing_combine(ctx, x3, p, NULL, &out), MOE_ERR_SHAPE, "y has shape [3, 5]");
  moe_tensor *y4 = NULL;
  EXPECT_OK(moe_tensor_full(ctx, 2, (int64_t[]){4, 5}, 1.0, MOE_F32, MOE_CPU, &y4));
  EXPECT_OK(moe_tensor_full(ctx, 2, (int64_t[]){2, 3}, 1.0, MOE_F32, MOE_CPU, &g3));
  EXPECT_ERR_MSG(moe_routing_combine(ctx, y4, p, g3, &out), MOE_ERR_SHAPE, "gates has shape [2, 3]");
  EXPECT(out == NULL);
  moe_routing_plan_release(p);
  moe_tensor_release(bad), moe_tensor_release(good), moe_tensor_release(fl), moe_tensor_release(one);
  moe_tensor_release(x3), moe_tensor_release(g3), moe_tensor_release(y4);
}

int main(void) {
  RUN(test_plan_by_hand);
  RUN(test_plan_random);
  RUN(test_plan_awkward);
  RUN(test_topology);
  RUN(test_host_syncs);
  RUN(test_rank_counts);
  RUN(test_gradients);
  RUN(test_bf16);
  RUN(test_errors);
  return harness_end();
}
