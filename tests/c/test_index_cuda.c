/*
 * test_index_cuda.c - the index family on cuda:0 against the CPU reference:
 * the same calls on both devices at awkward sizes (1, odd, large,
 * non-contiguous), forward and backward, then a few timings. Needs a GPU;
 * skips (exit 77) without one.
 *
 * Tolerances, per op and dtype (written beside each check too):
 *   gather, index_select, embedding, scatter, one_hot, bincount, sort,
 *   argsort, topk, cat, stack, multinomial: exact. They move elements, compare them or
 *   draw by the same double sums (moe_index.h), so values and indices match
 *   bit for bit (stable order on ties on both devices).
 *   scatter_add, index_add and the backward of gather/index_select/embedding:
 *   f32 within 1e-6 relative, bf16 within 2^-8 relative. Both devices add in
 *   f32 in one order (scatter_add: the index tensor's; index_add and the
 *   backward of index_select/embedding: the windowed order of moe_index.h)
 *   and round once, so the results are expected bit-exact; the tolerance
 *   only absorbs a compiler's choice on the CPU side (f32 adds are not
 *   reassociated under -ffp-contract=off). The window tests of index_add
 *   (test_index_add_windows_cuda, test_index_add_bad_windows_cuda) hold
 *   that to exact: f32, bf16, f64, f16 and i32.
 *   rope: f32 within 1e-6 relative, bf16 within 2^-8: the same f32
 *   products and one rounding on both (the _rn intrinsics); exact expected.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "harness.h"
#include "index_add_keys.h"

#define GPU ((moe_device){MOE_DEVICE_CUDA, 0})
#define SH(...) ((const int64_t[]){__VA_ARGS__})

static moe_tensor *rnd(moe_ctx *ctx, moe_dtype dt, moe_device d, int ndim, const int64_t *shape) {
  moe_tensor *t = NULL, *c = NULL;
  if (moe_tensor_empty(ctx, ndim, shape, MOE_F32, MOE_CPU, &t) != MOE_OK ||
      moe_normal_(ctx, t, 0, 1) != MOE_OK || moe_to(ctx, t, dt, d, &c) != MOE_OK) {
    fprintf(stderr, "rnd: %s\n", moe_ctx_error(ctx));
    exit(1);
  }
  moe_tensor_release(t);
  return c;
}

static moe_tensor *rint_(moe_ctx *ctx, moe_dtype dt, int64_t hi, int ndim, const int64_t *shape) {
  moe_tensor *t = NULL;
  if (moe_tensor_empty(ctx, ndim, shape, dt, MOE_CPU, &t) != MOE_OK ||
      moe_randint_(ctx, t, 0, hi) != MOE_OK) {
    fprintf(stderr, "rint: %s\n", moe_ctx_error(ctx));
    exit(1);
  }
  return t;
}

static moe_tensor *gpu(moe_ctx *ctx, moe_tensor *t) {
  moe_tensor *g = NULL;
  if (moe_to(ctx, t, t->dtype, GPU, &g) != MOE_OK) {
    fprintf(stderr, "to gpu: %s\n", moe_ctx_error(ctx));
    exit(1);
  }
  return g;
}

/* a (any device) equals b (any device) within rel * max(1, |b|). */
static int same(moe_tensor *a, moe_tensor *b, double rel, const char *what, int line) {
  int64_t n = moe_tensor_numel(b);
  if (moe_tensor_numel(a) != n || a->ndim != b->ndim) {
    fprintf(stderr, "line %d %s: sizes differ\n", line, what);
    return 0;
  }
  for (int d = 0; d < a->ndim; d++)
    if (a->shape[d] != b->shape[d]) {
      fprintf(stderr, "line %d %s: shapes differ\n", line, what);
      return 0;
    }
  double *x = malloc(sizeof(double) * (size_t)(n ? n : 1)), *y = malloc(sizeof(double) * (size_t)(n ? n : 1));
  int ok = moe_tensor_to_f64(harness_ctx, a, x) == MOE_OK && moe_tensor_to_f64(harness_ctx, b, y) == MOE_OK;
  int64_t bad = 0;
  for (int64_t i = 0; ok && i < n; i++) {
    bool eq = x[i] == y[i] || (isnan(x[i]) && isnan(y[i])) || fabs(x[i] - y[i]) <= rel * fmax(1, fabs(y[i]));
    if (!eq && bad++ < 3)
      fprintf(stderr, "line %d %s: element %lld is %.9g, cpu %.9g\n", line, what, (long long)i, x[i], y[i]);
  }
  free(x);
  free(y);
  return ok && bad == 0;
}
#define SAME(a, b, rel, what) EXPECT(same((a), (b), (rel), (what), __LINE__))

static void rel3(moe_tensor *a, moe_tensor *b, moe_tensor *c) {
  moe_tensor_release(a);
  moe_tensor_release(b);
  moe_tensor_release(c);
}

/* ----------------------------------------------------- gather family */

static void test_gather_cuda(moe_ctx *ctx) {
  const moe_dtype dts[] = {MOE_F32, MOE_BF16, MOE_I64};
  for (int k = 0; k < 3; k++) {
    moe_tensor *x = rnd(ctx, dts[k], MOE_CPU, 2, SH(37, 129)), *xg = gpu(ctx, x);
    moe_tensor *i0 = rint_(ctx, MOE_I64, 37, 2, SH(50, 129)), *i0g = gpu(ctx, i0);
    moe_tensor *i1 = rint_(ctx, MOE_I32, 129, 2, SH(37, 1)), *i1g = gpu(ctx, i1);
    moe_tensor *a = NULL, *b = NULL;
    EXPECT_OK(moe_gather(ctx, xg, 0, i0g, &a));
    EXPECT_OK(moe_gather(ctx, x, 0, i0, &b));
    SAME(a, b, 0, "gather dim 0"); /* exact: element moves */
    moe_tensor_release(a);
    moe_tensor_release(b);
    EXPECT_OK(moe_gather(ctx, xg, 1, i1g, &a));
    EXPECT_OK(moe_gather(ctx, x, 1, i1, &b));
    SAME(a, b, 0, "gather dim 1 i32");
    moe_tensor_release(a);
    moe_tensor_release(b);
    /* non-contiguous x: its transpose (129, 37) */
    moe_tensor *xt = NULL, *xtg = NULL, *it = rint_(ctx, MOE_I64, 129, 2, SH(3, 37)), *itg = gpu(ctx, it);
    EXPECT_OK(moe_transpose(ctx, x, 0, 1, &xt));
    EXPECT_OK(moe_transpose(ctx, xg, 0, 1, &xtg));
    EXPECT_OK(moe_gather(ctx, xtg, 0, itg, &a));
    EXPECT_OK(moe_gather(ctx, xt, 0, it, &b));
    SAME(a, b, 0, "gather transposed");
    moe_tensor_release(a);
    moe_tensor_release(b);
    /* index_select along both dims */
    moe_tensor *s = rint_(ctx, MOE_I64, 129, 1, SH(1001)), *sg = gpu(ctx, s);
    EXPECT_OK(moe_index_select(ctx, xg, 1, sg, &a));
    EXPECT_OK(moe_index_select(ctx, x, 1, s, &b));
    SAME(a, b, 0, "index_select");
    moe_tensor_release(a);
    moe_tensor_release(b);
    moe_tensor *ts[] = {x, xg, i0, i0g, i1, i1g, xt, xtg, it, itg, s, sg};
    for (size_t j = 0; j < sizeof ts / sizeof ts[0]; j++) moe_tensor_release(ts[j]);
  }
  /* embedding, large: 4096 ids of a (5000, 256) table; size 1 */
  moe_tensor *w = rnd(ctx, MOE_BF16, MOE_CPU, 2, SH(5000, 256)), *wg = gpu(ctx, w);
  moe_tensor *ids = rint_(ctx, MOE_I64, 5000, 2, SH(4, 1024)), *idsg = gpu(ctx, ids);
  moe_tensor *a = NULL, *b = NULL;
  EXPECT_OK(moe_embedding(ctx, wg, idsg, &a));
  EXPECT_OK(moe_embedding(ctx, w, ids, &b));
  SAME(a, b, 0, "embedding");
  moe_tensor_release(a);
  moe_tensor_release(b);
  moe_tensor *w1 = rnd(ctx, MOE_F32, MOE_CPU, 2, SH(1, 1)), *w1g = gpu(ctx, w1);
  moe_tensor *id1 = rint_(ctx, MOE_I32, 1, 1, SH(1)), *id1g = gpu(ctx, id1);
  EXPECT_OK(moe_embedding(ctx, w1g, id1g, &a));
  EXPECT_OK(moe_embedding(ctx, w1, id1, &b));
  SAME(a, b, 0, "embedding 1x1");
  moe_tensor_release(a);
  moe_tensor_release(b);
  /* a CPU index with a CUDA tensor */
  EXPECT_ERR_MSG(moe_embedding(ctx, wg, ids, &a), MOE_ERR_DEVICE, "ids is on cpu");
  /* one_hot */
  moe_tensor *oh = rint_(ctx, MOE_I64, 7, 2, SH(33, 3)), *ohg = gpu(ctx, oh);
  EXPECT_OK(moe_one_hot(ctx, ohg, 7, &a));
  EXPECT_OK(moe_one_hot(ctx, oh, 7, &b));
  SAME(a, b, 0, "one_hot");
  moe_tensor_release(a);
  moe_tensor_release(b);
  EXPECT_OK(moe_one_hot(ctx, ohg, -1, &a)); /* infers 7 (max 6 is drawn w.h.p. among 99) */
  EXPECT_OK(moe_one_hot(ctx, oh, -1, &b));
  SAME(a, b, 0, "one_hot inferred");
  moe_tensor_release(a);
  moe_tensor_release(b);
  moe_tensor *ts[] = {w, wg, ids, idsg, w1, w1g, id1, id1g, oh, ohg};
  for (size_t j = 0; j < sizeof ts / sizeof ts[0]; j++) moe_tensor_release(ts[j]);
}

/* ----------------------------------------------------- scatter family */

static void test_scatter_cuda(moe_ctx *ctx) {
  const moe_dtype dts[] = {MOE_F32, MOE_BF16};
  const double tol[] = {1e-6, 1.0 / 256}; /* f32 / bf16: see the header; exact expected */
  for (int k = 0; k < 2; k++) {
    moe_tensor *x = rnd(ctx, dts[k], MOE_CPU, 2, SH(31, 65)), *xg = gpu(ctx, x);
    moe_tensor *src = rnd(ctx, dts[k], MOE_CPU, 2, SH(300, 65)), *srcg = gpu(ctx, src);
    moe_tensor *idx = rint_(ctx, MOE_I64, 31, 2, SH(257, 65)), *idxg = gpu(ctx, idx); /* many repeats */
    moe_tensor *a = NULL, *b = NULL;
    EXPECT_OK(moe_scatter_add(ctx, xg, 0, idxg, srcg, &a));
    EXPECT_OK(moe_scatter_add(ctx, x, 0, idx, src, &b));
    SAME(a, b, tol[k], "scatter_add");
    moe_tensor_release(a);
    moe_tensor_release(b);
    EXPECT_OK(moe_scatter(ctx, xg, 0, idxg, srcg, &a));
    EXPECT_OK(moe_scatter(ctx, x, 0, idx, src, &b));
    SAME(a, b, 0, "scatter (last write wins on both)"); /* exact */
    moe_tensor_release(a);
    moe_tensor_release(b);
    /* index_add along dim 1 with a non-contiguous src */
    moe_tensor *ia = rint_(ctx, MOE_I32, 65, 1, SH(1000)), *iag = gpu(ctx, ia);
    moe_tensor *sb = rnd(ctx, dts[k], MOE_CPU, 2, SH(1000, 31)), *sbg = gpu(ctx, sb);
    moe_tensor *st = NULL, *stg = NULL;
    EXPECT_OK(moe_transpose(ctx, sb, 0, 1, &st));
    EXPECT_OK(moe_transpose(ctx, sbg, 0, 1, &stg));
    EXPECT_OK(moe_index_add(ctx, xg, 1, iag, stg, &a));
    EXPECT_OK(moe_index_add(ctx, x, 1, ia, st, &b));
    SAME(a, b, tol[k], "index_add");
    moe_tensor_release(a);
    moe_tensor_release(b);
    moe_tensor *ts[] = {x, xg, src, srcg, idx, idxg, ia, iag, sb, sbg, st, stg};
    for (size_t j = 0; j < sizeof ts / sizeof ts[0]; j++) moe_tensor_release(ts[j]);
  }
  /* integer histogram, large: 1M ids into 256 bins */
  moe_tensor *cnt = NULL, *cntg = NULL, *ones = NULL, *onesg = NULL;
  EXPECT_OK(moe_tensor_full(ctx, 1, SH(256), 0, MOE_I64, MOE_CPU, &cnt));
  EXPECT_OK(moe_tensor_full(ctx, 1, SH(1 << 20), 1, MOE_I64, MOE_CPU, &ones));
  cntg = gpu(ctx, cnt);
  onesg = gpu(ctx, ones);
  moe_tensor *ids = rint_(ctx, MOE_I64, 256, 1, SH(1 << 20)), *idsg = gpu(ctx, ids), *a = NULL, *b = NULL;
  EXPECT_OK(moe_scatter_add(ctx, cntg, 0, idsg, onesg, &a));
  EXPECT_OK(moe_scatter_add(ctx, cnt, 0, ids, ones, &b));
  SAME(a, b, 0, "histogram"); /* exact: integers */
  rel3(a, b, NULL);
  moe_tensor *ts[] = {cnt, cntg, ones, onesg, ids, idsg};
  for (size_t j = 0; j < sizeof ts / sizeof ts[0]; j++) moe_tensor_release(ts[j]);
}

/* ------------------------------------------------------- sort, topk */

static void sort_pair(moe_ctx *ctx, moe_tensor *x, int64_t dim, bool desc, int64_t k,
                      const char *what) {
  moe_tensor *xg = gpu(ctx, x), *va = NULL, *ia = NULL, *vb = NULL, *ib = NULL;
  if (k < 0) {
    EXPECT_OK(moe_sort(ctx, xg, dim, desc, &va, &ia));
    EXPECT_OK(moe_sort(ctx, x, dim, desc, &vb, &ib));
  } else {
    EXPECT_OK(moe_topk(ctx, xg, k, dim, desc, &va, &ia));
    EXPECT_OK(moe_topk(ctx, x, k, dim, desc, &vb, &ib));
  }
  SAME(va, vb, 0, what); /* exact: comparisons only */
  SAME(ia, ib, 0, what); /* exact: stable ties on both */
  rel3(xg, va, ia);
  rel3(vb, ib, NULL);
}

static void test_sort_cuda(moe_ctx *ctx) {
  moe_tensor *x = rnd(ctx, MOE_F32, MOE_CPU, 2, SH(3, 1000));
  sort_pair(ctx, x, 1, false, -1, "sort rows");
  sort_pair(ctx, x, 0, true, -1, "sort dim 0 desc");
  moe_tensor_release(x);
  x = rnd(ctx, MOE_F32, MOE_CPU, 1, SH(100003)); /* one long row */
  sort_pair(ctx, x, 0, true, -1, "sort one row");
  moe_tensor_release(x);
  x = rnd(ctx, MOE_BF16, MOE_CPU, 2, SH(257, 33)); /* bf16: many ties */
  sort_pair(ctx, x, -1, false, -1, "sort bf16");
  sort_pair(ctx, x, -1, true, 5, "topk bf16");
  moe_tensor_release(x);
  x = rint_(ctx, MOE_I64, 10, 2, SH(5, 999)); /* integers, ties everywhere */
  sort_pair(ctx, x, 1, false, -1, "sort i64 ties");
  sort_pair(ctx, x, 1, true, -1, "sort i64 ties desc");
  sort_pair(ctx, x, 1, true, 8, "topk i64 ties");
  moe_tensor_release(x);
  /* topk: the router shape, k = 1, the sort fallback (k > 32, C > 4096) */
  x = rnd(ctx, MOE_F32, MOE_CPU, 2, SH(4099, 256));
  sort_pair(ctx, x, -1, true, 8, "topk router");
  sort_pair(ctx, x, -1, false, 2, "topk smallest");
  sort_pair(ctx, x, -1, true, 40, "topk k = 40");
  sort_pair(ctx, x, 0, true, 3, "topk dim 0");
  moe_tensor_release(x);
  x = rnd(ctx, MOE_F32, MOE_CPU, 2, SH(33, 1));
  sort_pair(ctx, x, 1, true, 1, "topk C = 1");
  moe_tensor_release(x);
  x = rnd(ctx, MOE_F32, MOE_CPU, 2, SH(5, 4097));
  sort_pair(ctx, x, 1, true, 3, "topk C = 4097");
  moe_tensor_release(x);
  x = rnd(ctx, MOE_F32, MOE_CPU, 3, SH(2, 7, 64));
  moe_tensor *xt = NULL;
  EXPECT_OK(moe_transpose(ctx, x, 0, 2, &xt)); /* (64, 7, 2), non-contiguous */
  sort_pair(ctx, xt, 0, true, 4, "topk non-contiguous");
  sort_pair(ctx, xt, 1, false, -1, "sort non-contiguous");
  moe_tensor_release(xt);
  moe_tensor_release(x);
}

/* ------------------------------------------------------------ joins */

static void test_join_cuda(moe_ctx *ctx) {
  moe_tensor *a = rnd(ctx, MOE_BF16, MOE_CPU, 2, SH(3, 5)), *b = rnd(ctx, MOE_BF16, MOE_CPU, 2, SH(3, 1));
  moe_tensor *ag = gpu(ctx, a), *bg = gpu(ctx, b), *o1 = NULL, *o2 = NULL;
  EXPECT_OK(moe_cat(ctx, 3, (moe_tensor *[]){ag, bg, ag}, 1, &o1));
  EXPECT_OK(moe_cat(ctx, 3, (moe_tensor *[]){a, b, a}, 1, &o2));
  SAME(o1, o2, 0, "cat"); /* exact */
  rel3(o1, o2, NULL);
  EXPECT_OK(moe_stack(ctx, 2, (moe_tensor *[]){ag, ag}, 2, &o1));
  EXPECT_OK(moe_stack(ctx, 2, (moe_tensor *[]){a, a}, 2, &o2));
  SAME(o1, o2, 0, "stack");
  rel3(o1, o2, NULL);
  EXPECT_ERR(moe_cat(ctx, 2, (moe_tensor *[]){ag, b}, 1, &o1), MOE_ERR_DEVICE);
  moe_tensor *ts[] = {a, b, ag, bg};
  for (size_t j = 0; j < sizeof ts / sizeof ts[0]; j++) moe_tensor_release(ts[j]);
}

/* ------------------------------------------------------------- rope */

static void test_rope_cuda(moe_ctx *ctx) {
  const moe_dtype dts[] = {MOE_F32, MOE_BF16};
  const double tol[] = {1e-6, 1.0 / 256}; /* see the header; exact expected */
  for (int k = 0; k < 2; k++) {
    moe_tensor *c = NULL, *s = NULL, *cg = NULL, *sg = NULL, *a = NULL, *b = NULL;
    EXPECT_OK(moe_rope_cache(ctx, 33, 64, 10000, dts[k], MOE_CPU, &c, &s));
    EXPECT_OK(moe_rope_cache(ctx, 33, 64, 10000, dts[k], GPU, &cg, &sg));
    SAME(cg, c, 0, "rope_cache"); /* built on the host either way */
    moe_tensor *x = rnd(ctx, dts[k], MOE_CPU, 4, SH(2, 33, 3, 64)), *xg = gpu(ctx, x);
    EXPECT_OK(moe_rope(ctx, xg, cg, sg, MOE_ROPE_BTHD, &a));
    EXPECT_OK(moe_rope(ctx, x, c, s, MOE_ROPE_BTHD, &b));
    SAME(a, b, tol[k], "rope bthd");
    rel3(a, b, NULL);
    /* BHTD through a transposed (non-contiguous) view */
    moe_tensor *xt = NULL, *xtg = NULL;
    EXPECT_OK(moe_transpose(ctx, x, 1, 2, &xt));
    EXPECT_OK(moe_transpose(ctx, xg, 1, 2, &xtg));
    EXPECT_OK(moe_rope(ctx, xtg, cg, sg, MOE_ROPE_BHTD, &a));
    EXPECT_OK(moe_rope(ctx, xt, c, s, MOE_ROPE_BHTD, &b));
    SAME(a, b, tol[k], "rope bhtd");
    rel3(a, b, NULL);
    /* backward: x requires grad, a random cotangent */
    moe_tensor *xl = NULL, *xlg = NULL, *g = rnd(ctx, dts[k], MOE_CPU, 4, SH(2, 33, 3, 64)), *gg = gpu(ctx, g);
    EXPECT_OK(moe_clone(ctx, x, &xl));
    EXPECT_OK(moe_clone(ctx, xg, &xlg));
    EXPECT_OK(moe_set_requires_grad(ctx, xl, true));
    EXPECT_OK(moe_set_requires_grad(ctx, xlg, true));
    EXPECT_OK(moe_rope(ctx, xlg, cg, sg, MOE_ROPE_BTHD, &a));
    EXPECT_OK(moe_rope(ctx, xl, c, s, MOE_ROPE_BTHD, &b));
    EXPECT_OK(moe_backward(ctx, a, gg, false));
    EXPECT_OK(moe_backward(ctx, b, g, false));
    EXPECT(moe_tensor_grad(xlg) && moe_tensor_grad(xl));
    if (moe_tensor_grad(xlg) && moe_tensor_grad(xl))
      SAME(moe_tensor_grad(xlg), moe_tensor_grad(xl), tol[k], "rope backward");
    rel3(a, b, NULL);
    moe_tensor *ts[] = {c, s, cg, sg, x, xg, xt, xtg, xl, xlg, g, gg};
    for (size_t j = 0; j < sizeof ts / sizeof ts[0]; j++) moe_tensor_release(ts[j]);
  }
}

/* a (any device) and b (any device) hold the same bits: same dtype and
 * shape, contiguous copies on the host compared with memcmp. */
static int bits_same(moe_ctx *ctx, moe_tensor *a, moe_tensor *b, const char *what, int line) {
  if (!a || !b || a->dtype != b->dtype || a->ndim != b->ndim) {
    fprintf(stderr, "line %d %s: missing result or dtype/rank differ\n", line, what);
    return 0;
  }
  for (int d = 0; d < a->ndim; d++)
    if (a->shape[d] != b->shape[d]) {
      fprintf(stderr, "line %d %s: shapes differ\n", line, what);
      return 0;
    }
  moe_tensor *ah = NULL, *bh = NULL, *ac = NULL, *bc = NULL;
  int ok = moe_to(ctx, a, a->dtype, MOE_CPU, &ah) == MOE_OK &&
           moe_to(ctx, b, b->dtype, MOE_CPU, &bh) == MOE_OK &&
           moe_contiguous(ctx, ah, &ac) == MOE_OK && moe_contiguous(ctx, bh, &bc) == MOE_OK;
  if (!ok) fprintf(stderr, "line %d %s: reading back failed: %s\n", line, what, moe_ctx_error(ctx));
  size_t es = moe_dtype_size(a->dtype);
  int64_t n = moe_tensor_numel(a);
  if (ok && n > 0 && memcmp(moe_tensor_data(ac), moe_tensor_data(bc), (size_t)n * es) != 0) {
    const unsigned char *x = moe_tensor_data(ac), *y = moe_tensor_data(bc);
    int64_t i = 0;
    while (memcmp(x + i * es, y + i * es, es) == 0) i++;
    uint64_t u = 0, v = 0;
    memcpy(&u, x + i * es, es);
    memcpy(&v, y + i * es, es);
    fprintf(stderr, "line %d %s (%s): element %lld has bits %llx, the other %llx\n", line, what,
            moe_dtype_name(a->dtype), (long long)i, (unsigned long long)u, (unsigned long long)v);
    ok = 0;
  }
  rel3(ah, bh, NULL);
  rel3(ac, bc, NULL);
  return ok;
}
#define BITS_SAME(a, b, what) EXPECT(bits_same(ctx, (a), (b), (what), __LINE__))

/* A view of a base tensor: 's' select(dim a, index b), 'n' narrow(dim a,
 * start b, length c), 't' transpose(a, b). */
typedef struct vop {
  char op;
  int64_t a, b, c;
} vop;

static moe_tensor *apply_views(moe_ctx *ctx, moe_tensor *t, int n, const vop *ops) {
  moe_tensor *cur = t, *next = NULL;
  moe_tensor_retain(cur);
  for (int k = 0; k < n; k++) {
    moe_status st = ops[k].op == 's'   ? moe_select(ctx, cur, ops[k].a, ops[k].b, &next)
                    : ops[k].op == 'n' ? moe_narrow(ctx, cur, ops[k].a, ops[k].b, ops[k].c, &next)
                                       : moe_transpose(ctx, cur, ops[k].a, ops[k].b, &next);
    if (st != MOE_OK) {
      fprintf(stderr, "apply_views: %s\n", moe_ctx_error(ctx));
      exit(1);
    }
    moe_tensor_release(cur);
    cur = next;
  }
  return cur;
}

/*
 * Rope of views on both devices, forward and backward (the inverse
 * rotation), bit for bit: x is a view (xo) of a random base; cos and sin
 * come from rope_cache (cshape[0] == 0) or are random views (co) of
 * cshape-shaped bases (a (T, D) width is the `full` layout). The cases reach
 * every vector width of the kernel (16-, 8-, 4-, 2-byte and scalar accesses:
 * packed q/k/v slots, D of 64, 12 and 6, offsets of 1, 2 and 4 elements)
 * and its strided fallbacks (last dim of x strided, cos rows of odd stride,
 * cos transposed).
 */
typedef struct rope_case {
  const char *what;
  int ndim;
  int64_t shape[5];
  int nx;
  vop xo[3];
  int64_t cshape[2];
  int nc;
  vop co[2];
  moe_rope_layout lay;
} rope_case;

#define SEL(d, i) {'s', d, i, 0}
#define NAR(d, start, len) {'n', d, start, len}
#define TRN(d0, d1) {'t', d0, d1, 0}
#define NOV {0, 0, 0, 0}
static const rope_case rope_cases[] = {
    {"q of packed qkv", 5, {2, 33, 3, 4, 64}, 1, {SEL(2, 0)}, {0}, 0, {NOV}, MOE_ROPE_BTHD},
    {"k of packed qkv", 5, {2, 33, 3, 4, 64}, 1, {SEL(2, 1)}, {0}, 0, {NOV}, MOE_ROPE_BTHD},
    {"v slot, full cos", 5, {2, 33, 3, 4, 64}, 1, {SEL(2, 2)}, {33, 64}, 0, {NOV}, MOE_ROPE_BTHD},
    {"k of packed qkv, D 12", 5, {2, 33, 3, 4, 12}, 1, {SEL(2, 1)}, {0}, 0, {NOV}, MOE_ROPE_BTHD},
    {"q, D 12, full cos", 5, {2, 33, 3, 4, 12}, 1, {SEL(2, 0)}, {33, 12}, 0, {NOV}, MOE_ROPE_BTHD},
    {"v slot, D 6", 5, {2, 33, 3, 4, 6}, 1, {SEL(2, 2)}, {0}, 0, {NOV}, MOE_ROPE_BTHD},
    {"offset 1", 4, {2, 33, 4, 65}, 1, {NAR(3, 1, 64)}, {0}, 0, {NOV}, MOE_ROPE_BTHD},
    {"offset 2", 4, {2, 33, 4, 66}, 1, {NAR(3, 2, 64)}, {0}, 0, {NOV}, MOE_ROPE_BTHD},
    {"offset 4", 4, {2, 33, 4, 68}, 1, {NAR(3, 4, 64)}, {0}, 0, {NOV}, MOE_ROPE_BTHD},
    {"strided last dim", 4, {2, 33, 64, 4}, 1, {TRN(2, 3)}, {0}, 0, {NOV}, MOE_ROPE_BTHD},
    {"cos rows of odd stride", 4, {2, 33, 4, 64}, 0, {NOV}, {33, 33}, 1, {NAR(1, 0, 32)},
     MOE_ROPE_BTHD},
    {"cos transposed", 4, {2, 33, 4, 64}, 0, {NOV}, {32, 33}, 1, {TRN(0, 1)}, MOE_ROPE_BTHD},
    {"bhtd", 4, {2, 4, 33, 64}, 0, {NOV}, {0}, 0, {NOV}, MOE_ROPE_BHTD},
    {"bhtd view of packed qkv", 5, {2, 33, 3, 4, 64}, 2, {SEL(2, 1), TRN(1, 2)}, {0}, 0,
     {NOV}, MOE_ROPE_BHTD},
    {"one row", 4, {1, 1, 1, 64}, 0, {NOV}, {0}, 0, {NOV}, MOE_ROPE_BTHD},
    {"odd sizes", 4, {3, 5, 7, 16}, 0, {NOV}, {0}, 0, {NOV}, MOE_ROPE_BTHD},
};
#undef SEL
#undef NAR
#undef TRN
#undef NOV

static void test_rope_views_cuda(moe_ctx *ctx) {
  const moe_dtype dts[] = {MOE_F32, MOE_BF16, MOE_F16, MOE_F64};
  for (size_t k = 0; k < sizeof dts / sizeof dts[0]; k++) {
    for (size_t c = 0; c < sizeof rope_cases / sizeof rope_cases[0]; c++) {
      const rope_case *rc = &rope_cases[c];
      char what[96];
      snprintf(what, sizeof what, "rope %s", rc->what);
      moe_tensor *base = rnd(ctx, dts[k], MOE_CPU, rc->ndim, rc->shape), *baseg = gpu(ctx, base);
      EXPECT_OK(moe_set_requires_grad(ctx, base, true));
      EXPECT_OK(moe_set_requires_grad(ctx, baseg, true));
      moe_tensor *x = apply_views(ctx, base, rc->nx, rc->xo),
                 *xg = apply_views(ctx, baseg, rc->nx, rc->xo);
      int64_t T = x->shape[rc->lay == MOE_ROPE_BTHD ? 1 : 2], D = x->shape[3];
      moe_tensor *cb = NULL, *sb = NULL, *cbg = NULL, *sbg = NULL;
      if (rc->cshape[0] == 0) {
        EXPECT_OK(moe_rope_cache(ctx, T, D, 10000, dts[k], MOE_CPU, &cb, &sb));
        EXPECT_OK(moe_rope_cache(ctx, T, D, 10000, dts[k], GPU, &cbg, &sbg));
      } else {
        cb = rnd(ctx, dts[k], MOE_CPU, 2, rc->cshape);
        sb = rnd(ctx, dts[k], MOE_CPU, 2, rc->cshape);
        cbg = gpu(ctx, cb);
        sbg = gpu(ctx, sb);
      }
      moe_tensor *cs = apply_views(ctx, cb, rc->nc, rc->co), *sn = apply_views(ctx, sb, rc->nc, rc->co),
                 *csg = apply_views(ctx, cbg, rc->nc, rc->co), *sng = apply_views(ctx, sbg, rc->nc, rc->co);
      moe_tensor *a = NULL, *b = NULL;
      EXPECT_OK(moe_rope(ctx, xg, csg, sng, rc->lay, &a));
      EXPECT_OK(moe_rope(ctx, x, cs, sn, rc->lay, &b));
      BITS_SAME(a, b, what); /* the same f32 (f64) operations, each rounded once */
      if (a && b) {
        moe_tensor *g = rnd(ctx, dts[k], MOE_CPU, 4, b->shape), *gg = gpu(ctx, g);
        EXPECT_OK(moe_backward(ctx, a, gg, false));
        EXPECT_OK(moe_backward(ctx, b, g, false));
        snprintf(what, sizeof what, "rope %s backward", rc->what);
        EXPECT(moe_tensor_grad(baseg) && moe_tensor_grad(base));
        if (moe_tensor_grad(baseg) && moe_tensor_grad(base))
          BITS_SAME(moe_tensor_grad(baseg), moe_tensor_grad(base), what);
        rel3(g, gg, NULL);
      }
      moe_tensor *ts[] = {a, b, x, xg, cs, sn, csg, sng, cb, sb, cbg, sbg, base, baseg};
      for (size_t j = 0; j < sizeof ts / sizeof ts[0]; j++) moe_tensor_release(ts[j]);
    }
  }
}

/* ------------------------------------------------------- backward */

/* grad of a leaf x (cpu and gpu copies) through f, with cotangent g. */
typedef moe_status (*unary_fn)(moe_ctx *ctx, moe_tensor *x, void *ud, moe_tensor **out);

static void grad_pair(moe_ctx *ctx, moe_tensor *x, unary_fn f, void *ud, double tol, const char *what) {
  moe_tensor *xc = NULL, *xg = NULL, *oc = NULL, *og = NULL, *g = NULL, *gg = NULL;
  EXPECT_OK(moe_clone(ctx, x, &xc));
  EXPECT_OK(moe_to(ctx, x, x->dtype, GPU, &xg));
  EXPECT_OK(moe_set_requires_grad(ctx, xc, true));
  EXPECT_OK(moe_set_requires_grad(ctx, xg, true));
  EXPECT_OK(f(ctx, xc, ud, &oc));
  EXPECT_OK(f(ctx, xg, ud, &og));
  if (oc && og) {
    g = rnd(ctx, x->dtype, MOE_CPU, oc->ndim, oc->shape);
    gg = gpu(ctx, g);
    EXPECT_OK(moe_backward(ctx, oc, g, false));
    EXPECT_OK(moe_backward(ctx, og, gg, false));
    EXPECT(moe_tensor_grad(xc) && moe_tensor_grad(xg));
    if (moe_tensor_grad(xc) && moe_tensor_grad(xg)) SAME(moe_tensor_grad(xg), moe_tensor_grad(xc), tol, what);
  }
  rel3(xc, xg, oc);
  rel3(og, g, gg);
}

typedef struct pair_ud {
  moe_tensor *cpu, *gpu; /* an index on each device */
  int64_t dim, k;
} pair_ud;

static moe_tensor *ud_index(pair_ud *u, moe_tensor *x) {
  return moe_tensor_device(x).type == MOE_DEVICE_CUDA ? u->gpu : u->cpu;
}

static moe_status f_gather(moe_ctx *ctx, moe_tensor *x, void *ud, moe_tensor **out) {
  return moe_gather(ctx, x, ((pair_ud *)ud)->dim, ud_index(ud, x), out);
}
static moe_status f_embedding(moe_ctx *ctx, moe_tensor *x, void *ud, moe_tensor **out) {
  return moe_embedding(ctx, x, ud_index(ud, x), out);
}
static moe_status f_topk(moe_ctx *ctx, moe_tensor *x, void *ud, moe_tensor **out) {
  moe_tensor *i = NULL;
  moe_status st = moe_topk(ctx, x, ((pair_ud *)ud)->k, ((pair_ud *)ud)->dim, true, out, &i);
  moe_tensor_release(i);
  return st;
}

static void test_backward_cuda(moe_ctx *ctx) {
  const moe_dtype dts[] = {MOE_F32, MOE_BF16};
  const double tol[] = {1e-6, 1.0 / 256}; /* sums in f32 in one order on both: see the header */
  for (int k = 0; k < 2; k++) {
    moe_tensor *x = rnd(ctx, dts[k], MOE_CPU, 2, SH(61, 33));
    moe_tensor *i = rint_(ctx, MOE_I64, 61, 2, SH(200, 33));
    pair_ud u = {i, gpu(ctx, i), 0, 0};
    grad_pair(ctx, x, f_gather, &u, tol[k], "gather backward");
    moe_tensor_release(u.gpu);
    moe_tensor_release(i);
    /* embedding backward: 3000 ids into 61 rows, many repeats */
    moe_tensor *ids = rint_(ctx, MOE_I64, 61, 2, SH(3, 1000));
    pair_ud e = {ids, gpu(ctx, ids), 0, 0};
    grad_pair(ctx, x, f_embedding, &e, tol[k], "embedding backward");
    moe_tensor_release(e.gpu);
    moe_tensor_release(ids);
    pair_ud t = {NULL, NULL, -1, 8};
    grad_pair(ctx, x, f_topk, &t, 0, "topk backward"); /* exact: a scatter of distinct targets */
    moe_tensor_release(x);
  }
}

/* Backward of the ops with several differentiable inputs (and of
 * index_select, sort, split/chunk and where): each input a leaf on both
 * devices, some of them transposed views; every input's gradient compared.
 * Tolerances: moves and selections (scatter, sort, cat, stack, split,
 * chunk, where's a) exact; sums (index_select's and scatter_add's grads)
 * as the header: f32 1e-6 relative, bf16 2^-8; where's broadcast b (a
 * reduction in another order on each device) f32 1e-6, bf16 2^-7. */
typedef moe_status (*multi_fn)(moe_ctx *ctx, moe_tensor **xs, void *ud, moe_tensor **out);

/* A leaf on device d holding base's values (base on the CPU), transposed
 * (dims 0 and 1) when tr. */
static moe_tensor *leaf_on(moe_ctx *ctx, moe_tensor *base, moe_device d, bool tr) {
  moe_tensor *c = NULL, *v = NULL, *l = NULL;
  EXPECT_OK(moe_to(ctx, base, base->dtype, d, &c));
  if (tr) {
    EXPECT_OK(moe_transpose(ctx, c, 0, 1, &v));
  } else {
    v = c;
    moe_tensor_retain(v);
  }
  EXPECT_OK(moe_detach(ctx, v, &l));
  EXPECT_OK(moe_set_requires_grad(ctx, l, true));
  moe_tensor_release(v);
  moe_tensor_release(c);
  return l;
}

static void grad_multi(moe_ctx *ctx, int n, moe_tensor **base, const bool *tr, multi_fn f, void *ud,
                       double tol, const char *what) {
  moe_tensor *xc[4] = {NULL}, *xg[4] = {NULL}, *oc = NULL, *og = NULL, *g = NULL, *gg = NULL;
  for (int i = 0; i < n; i++) {
    xc[i] = leaf_on(ctx, base[i], MOE_CPU, tr[i]);
    xg[i] = leaf_on(ctx, base[i], GPU, tr[i]);
  }
  EXPECT_OK(f(ctx, xc, ud, &oc));
  EXPECT_OK(f(ctx, xg, ud, &og));
  if (oc && og) {
    g = rnd(ctx, oc->dtype, MOE_CPU, oc->ndim, oc->shape);
    gg = gpu(ctx, g);
    EXPECT_OK(moe_backward(ctx, oc, g, false));
    EXPECT_OK(moe_backward(ctx, og, gg, false));
    for (int i = 0; i < n; i++) {
      char w[128];
      snprintf(w, sizeof w, "%s: grad of input %d", what, i);
      moe_tensor *a = moe_tensor_grad(xg[i]), *b = moe_tensor_grad(xc[i]);
      EXPECT(a && b);
      if (a && b) SAME(a, b, tol, w);
    }
  }
  for (int i = 0; i < n; i++) rel3(xc[i], xg[i], NULL);
  rel3(oc, og, NULL);
  rel3(g, gg, NULL);
}

static moe_status m_index_select(moe_ctx *ctx, moe_tensor **x, void *ud, moe_tensor **out) {
  return moe_index_select(ctx, x[0], ((pair_ud *)ud)->dim, ud_index(ud, x[0]), out);
}
static moe_status m_scatter(moe_ctx *ctx, moe_tensor **x, void *ud, moe_tensor **out) {
  return moe_scatter(ctx, x[0], ((pair_ud *)ud)->dim, ud_index(ud, x[0]), x[1], out);
}
static moe_status m_scatter_add(moe_ctx *ctx, moe_tensor **x, void *ud, moe_tensor **out) {
  return moe_scatter_add(ctx, x[0], ((pair_ud *)ud)->dim, ud_index(ud, x[0]), x[1], out);
}
static moe_status m_index_add(moe_ctx *ctx, moe_tensor **x, void *ud, moe_tensor **out) {
  return moe_index_add(ctx, x[0], ((pair_ud *)ud)->dim, ud_index(ud, x[0]), x[1], out);
}
static moe_status m_where(moe_ctx *ctx, moe_tensor **x, void *ud, moe_tensor **out) {
  return moe_where(ctx, ud_index(ud, x[0]), x[0], x[1], out); /* the "index" is the condition */
}
static moe_status m_sort(moe_ctx *ctx, moe_tensor **x, void *ud, moe_tensor **out) {
  moe_tensor *i = NULL;
  moe_status st = moe_sort(ctx, x[0], ((pair_ud *)ud)->dim, true, out, &i);
  moe_tensor_release(i);
  return st;
}
static moe_status m_cat(moe_ctx *ctx, moe_tensor **x, void *ud, moe_tensor **out) {
  return moe_cat(ctx, 3, x, ((pair_ud *)ud)->dim, out);
}
static moe_status m_stack(moe_ctx *ctx, moe_tensor **x, void *ud, moe_tensor **out) {
  return moe_stack(ctx, 2, x, ((pair_ud *)ud)->dim, out);
}
/* the second piece: split by k (k > 0) or chunk into -k (k < 0) */
static moe_status m_piece(moe_ctx *ctx, moe_tensor **x, void *ud, moe_tensor **out) {
  pair_ud *u = ud;
  moe_tensor *p[16] = {NULL};
  int n = 0;
  moe_status st = u->k > 0 ? moe_split(ctx, x[0], u->k, u->dim, 16, p, &n)
                           : moe_chunk(ctx, x[0], -u->k, u->dim, 16, p, &n);
  if (st != MOE_OK) return st;
  if (n < 2) {
    for (int i = 0; i < n; i++) moe_tensor_release(p[i]);
    return moe_error(ctx, MOE_ERR_INTERNAL, "m_piece: only %d piece(s)", n);
  }
  *out = p[1];
  for (int i = 0; i < n; i++)
    if (i != 1) moe_tensor_release(p[i]);
  return MOE_OK;
}

static void test_backward_multi_cuda(moe_ctx *ctx) {
  const moe_dtype dts[] = {MOE_F32, MOE_BF16};
  const double tol[] = {1e-6, 1.0 / 256};
  const bool no[4] = {false, false, false, false}, tr0[4] = {true, false, false, false};
  const bool tr1[4] = {false, true, false, false};
  for (int k = 0; k < 2; k++) {
    moe_dtype dt = dts[k];
    /* index_select of a transposed (61, 33) along dim 0, 1000 ids with repeats */
    moe_tensor *b61 = rnd(ctx, dt, MOE_CPU, 2, SH(33, 61));
    moe_tensor *ids = rint_(ctx, MOE_I64, 61, 1, SH(1000));
    pair_ud u = {ids, gpu(ctx, ids), 0, 0};
    grad_multi(ctx, 1, &b61, tr0, m_index_select, &u, tol[k], "index_select backward");
    /* sort values along dim 0 and dim 1 of the transposed (61, 33) */
    pair_ud su = {NULL, NULL, 0, 0};
    grad_multi(ctx, 1, &b61, tr0, m_sort, &su, 0, "sort backward dim 0");
    su.dim = 1;
    grad_multi(ctx, 1, &b61, tr0, m_sort, &su, 0, "sort backward dim 1");
    /* split by 20 along dim 0 and chunk into 3 along dim 1: the second piece */
    pair_ud pu = {NULL, NULL, 0, 20};
    grad_multi(ctx, 1, &b61, tr0, m_piece, &pu, 0, "split backward");
    pu.dim = 1;
    pu.k = -3;
    grad_multi(ctx, 1, &b61, tr0, m_piece, &pu, 0, "chunk backward");
    rel3(u.gpu, ids, NULL);

    /* scatter along dim 0 of (31, 65) with 20 distinct rows per column (a
     * prefix of a permutation: no position written twice) */
    moe_tensor *x = rnd(ctx, dt, MOE_CPU, 2, SH(31, 65)), *key = rnd(ctx, MOE_F32, MOE_CPU, 2, SH(31, 65));
    moe_tensor *perm = NULL, *pre = NULL, *idx = NULL;
    EXPECT_OK(moe_argsort(ctx, key, 0, false, &perm));
    EXPECT_OK(moe_narrow(ctx, perm, 0, 0, 20, &pre));
    EXPECT_OK(moe_contiguous(ctx, pre, &idx));
    moe_tensor *src = rnd(ctx, dt, MOE_CPU, 2, SH(20, 65));
    pair_ud sc = {idx, gpu(ctx, idx), 0, 0};
    moe_tensor *xs[2] = {x, src};
    grad_multi(ctx, 2, xs, no, m_scatter, &sc, 0, "scatter backward");
    rel3(sc.gpu, perm, pre);
    rel3(idx, src, key);
    /* scatter_add with many repeats: 257 rows into 31 */
    moe_tensor *ra = rint_(ctx, MOE_I64, 31, 2, SH(257, 65));
    moe_tensor *srca = rnd(ctx, dt, MOE_CPU, 2, SH(257, 65));
    pair_ud sa = {ra, gpu(ctx, ra), 0, 0};
    xs[1] = srca;
    grad_multi(ctx, 2, xs, no, m_scatter_add, &sa, tol[k], "scatter_add backward");
    rel3(sa.gpu, ra, srca);
    /* index_add along dim 1 of a transposed (31, 65), src (31, 1000) transposed too */
    moe_tensor *xb = rnd(ctx, dt, MOE_CPU, 2, SH(65, 31)), *sb = rnd(ctx, dt, MOE_CPU, 2, SH(1000, 31));
    moe_tensor *ia = rint_(ctx, MOE_I32, 65, 1, SH(1000));
    pair_ud ua = {ia, gpu(ctx, ia), 1, 0};
    const bool both[4] = {true, true, false, false};
    moe_tensor *xa[2] = {xb, sb};
    grad_multi(ctx, 2, xa, both, m_index_add, &ua, tol[k], "index_add backward");
    rel3(ua.gpu, ia, xb);
    moe_tensor_release(sb);
    /* where(cond, a, b): a (37, 129) transposed, b (129) broadcast (its
     * gradient sums over the 37 rows) */
    moe_tensor *ab = rnd(ctx, dt, MOE_CPU, 2, SH(129, 37)), *bb = rnd(ctx, dt, MOE_CPU, 1, SH(129));
    moe_tensor *cr = rnd(ctx, MOE_F32, MOE_CPU, 2, SH(37, 129)), *cond = NULL;
    EXPECT_OK(moe_compare_scalar(ctx, MOE_OP_GT, cr, 0.0, &cond));
    pair_ud wu = {cond, gpu(ctx, cond), 0, 0};
    moe_tensor *wx[2] = {ab, bb};
    /* b's gradient is a sum over rows, in another order on each device: one bf16 ulp */
    grad_multi(ctx, 2, wx, tr0, m_where, &wu, k ? 1.0 / 128 : 1e-6, "where backward");
    rel3(wu.gpu, cond, cr);
    rel3(ab, bb, NULL);
    /* cat of (7, 33), a transposed (7, 33) and (1, 33) along dim 0; stack of
     * two (7, 33) along dim 1 */
    moe_tensor *c0 = rnd(ctx, dt, MOE_CPU, 2, SH(7, 33)), *c1 = rnd(ctx, dt, MOE_CPU, 2, SH(33, 7));
    moe_tensor *c2 = rnd(ctx, dt, MOE_CPU, 2, SH(1, 33));
    moe_tensor *cx[3] = {c0, c1, c2};
    pair_ud cu = {NULL, NULL, 0, 0};
    grad_multi(ctx, 3, cx, tr1, m_cat, &cu, 0, "cat backward");
    cu.dim = 1;
    grad_multi(ctx, 2, cx, tr1, m_stack, &cu, 0, "stack backward");
    rel3(c0, c1, c2);
    rel3(x, b61, NULL);
  }
}

/* Operands on two devices: an error naming the op and both devices, no output. */
static void test_device_mismatch_cuda(moe_ctx *ctx) {
  moe_tensor *x = rnd(ctx, MOE_F32, MOE_CPU, 2, SH(5, 7)), *xg = gpu(ctx, x);
  moe_tensor *i = rint_(ctx, MOE_I64, 5, 2, SH(3, 7)), *ig = gpu(ctx, i);
  moe_tensor *src = rnd(ctx, MOE_F32, MOE_CPU, 2, SH(3, 7));
  moe_tensor *v = rint_(ctx, MOE_I64, 5, 1, SH(4)), *vg = gpu(ctx, v);
  moe_tensor *src4 = rnd(ctx, MOE_F32, MOE_CPU, 2, SH(4, 7));
  moe_tensor *o = NULL;
  EXPECT_ERR_MSG(moe_gather(ctx, xg, 0, i, &o), MOE_ERR_DEVICE, "gather: x is on cuda:0 but index is on cpu");
  EXPECT_ERR_MSG(moe_scatter(ctx, xg, 0, ig, src, &o), MOE_ERR_DEVICE, "scatter: x is on cuda:0 but src is on cpu");
  EXPECT_ERR_MSG(moe_scatter_add(ctx, xg, 0, i, src, &o), MOE_ERR_DEVICE, "scatter_add: x is on cuda:0 but index is on cpu");
  EXPECT_ERR_MSG(moe_index_select(ctx, xg, 0, v, &o), MOE_ERR_DEVICE, "index_select: x is on cuda:0 but index is on cpu");
  EXPECT_ERR_MSG(moe_index_add(ctx, xg, 0, vg, src4, &o), MOE_ERR_DEVICE, "index_add: x is on cuda:0 but src is on cpu");
  EXPECT_ERR_MSG(moe_stack(ctx, 2, (moe_tensor *[]){xg, x}, 0, &o), MOE_ERR_DEVICE, "stack: tensor 1 is on cpu");
  EXPECT_ERR_MSG(moe_cat(ctx, 2, (moe_tensor *[]){xg, x}, 0, &o), MOE_ERR_DEVICE, "cat: tensor 1 is on cpu");
  moe_tensor *c = NULL, *sn = NULL, *r = rnd(ctx, MOE_F32, MOE_CPU, 4, SH(1, 3, 2, 8)), *rg = gpu(ctx, r);
  EXPECT_OK(moe_rope_cache(ctx, 3, 8, 10000, MOE_F32, MOE_CPU, &c, &sn));
  EXPECT_ERR_MSG(moe_rope(ctx, rg, c, sn, MOE_ROPE_BTHD, &o), MOE_ERR_DEVICE, "rope: x is on cuda:0 but cos is on cpu");
  EXPECT(o == NULL);
  moe_tensor *ts[] = {x, xg, i, ig, src, v, vg, src4, c, sn, r, rg};
  for (size_t j = 0; j < sizeof ts / sizeof ts[0]; j++) moe_tensor_release(ts[j]);
}

/* ------------------------------------- index_add's windowed order (CUDA) */

static moe_tensor *keys_tensor(moe_ctx *ctx, const int64_t *key, int64_t n, moe_dtype it) {
  moe_tensor *t = NULL, *c = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, 1, SH(n), MOE_I64, MOE_CPU, &t));
  if (t) memcpy(moe_tensor_data(t), key, sizeof(int64_t) * (size_t)n);
  EXPECT_OK(moe_to(ctx, t, it, MOE_CPU, &c));
  moe_tensor_release(t);
  return c;
}

/* index_add(x, 1, index, src), x (outer, X, inner), src (outer, n, inner)
 * of dtype dt, on cuda:0 and on the CPU: exact (one order on both). */
static void index_add_pair(moe_ctx *ctx, moe_dtype dt, moe_dtype it, int64_t outer, int64_t X,
                           int64_t inner, int64_t n, const int64_t *key, const char *what) {
  moe_tensor *x = rnd(ctx, dt, MOE_CPU, 3, SH(outer, X, inner)), *xg = gpu(ctx, x);
  moe_tensor *src = rnd(ctx, dt, MOE_CPU, 3, SH(outer, n, inner)), *srcg = gpu(ctx, src);
  moe_tensor *idx = keys_tensor(ctx, key, n, it), *idxg = gpu(ctx, idx), *a = NULL, *b = NULL;
  EXPECT_OK(moe_index_add(ctx, xg, 1, idxg, srcg, &a));
  EXPECT_OK(moe_index_add(ctx, x, 1, idx, src, &b));
  char w[128];
  snprintf(w, sizeof w, "index_add %s (%s, outer %lld, X %lld, inner %lld, n %lld)", what,
           moe_dtype_name(dt), (long long)outer, (long long)X, (long long)inner, (long long)n);
  if (a && b) SAME(a, b, 0, w); /* exact: the windowed order on both */
  moe_tensor *ts[] = {x, xg, src, srcg, idx, idxg, a, b};
  for (size_t j = 0; j < sizeof ts / sizeof ts[0]; j++) moe_tensor_release(ts[j]);
}

static void test_index_add_windows_cuda(moe_ctx *ctx) {
  const int64_t P = MOE_INDEX_ADD_WINDOW;
  const moe_dtype dts[] = {MOE_F32, MOE_BF16, MOE_F64, MOE_F16, MOE_I32};
  int64_t *key = malloc(sizeof(int64_t) * 100003);
  for (int d = 0; d < 5; d++) {
    moe_dtype it = d % 2 ? MOE_I32 : MOE_I64;
    /* one key 1, P - 1, P, P + 1, 3P + 5 times, starting at sorted position
     * 0, inside a window and just before a boundary; inner 1 and 513 */
    const int64_t ms[] = {1, P - 1, P, P + 1, 3 * P + 5}, leads[] = {0, 5, P - 1};
    for (int a = 0; a < 5; a++)
      for (int b = 0; b < 3; b++) {
        int64_t n = window_keys(key, 0, ms[a], leads[b], 0, 4, (uint64_t)(a * 3 + b + 1));
        index_add_pair(ctx, dts[d], it, 2, 4, 3, n, key, "one key");
        index_add_pair(ctx, dts[d], it, 1, 4, 1, n, key, "one key, inner 1");
        if (b == 1) index_add_pair(ctx, dts[d], it, 1, 4, 513, n, key, "one key, inner 513");
      }
    /* many keys, duplicate-heavy */
    int64_t n = window_keys(key, 1, 0, 0, 1000, 257, 7);
    index_add_pair(ctx, dts[d], it, 3, 257, 1, n, key, "skewed");
    index_add_pair(ctx, dts[d], it, 1, 257, 513, n, key, "skewed");
    index_add_pair(ctx, dts[d], it, 3, 257, 65, n, key, "skewed");
    /* all distinct */
    n = window_keys(key, 2, 0, 0, 300, 300, 9);
    index_add_pair(ctx, dts[d], it, 3, 300, 2, n, key, "distinct");
    /* four keys (0, 1, 2, 32) over 100003 entries: segments of thousands of windows */
    n = window_keys(key, 1, 0, 0, 100003, 3, 10);
    index_add_pair(ctx, dts[d], it, 2, 33, 1, n, key, "four keys, long segments");
  }
  /* the byte-vocabulary embedding gradient: 16384 tokens into 257 rows of
   * 512, bf16 */
  int64_t n = window_keys(key, 1, 0, 0, 16384, 257, 12);
  index_add_pair(ctx, MOE_BF16, MOE_I64, 1, 257, 512, n, key, "byte vocabulary");
  moe_tensor *ids = keys_tensor(ctx, key, 16384, MOE_I64);
  moe_tensor *ids2 = NULL;
  EXPECT_OK(moe_reshape(ctx, ids, 2, SH(8, 2048), &ids2));
  moe_tensor *w = rnd(ctx, MOE_BF16, MOE_CPU, 2, SH(257, 512));
  pair_ud e = {ids2, gpu(ctx, ids2), 0, 0};
  grad_pair(ctx, w, f_embedding, &e, 0, "embedding backward, byte vocabulary"); /* exact */
  rel3(e.gpu, ids2, ids);
  moe_tensor_release(w);
  /* index_select's backward along dim 1 (outer 5), f32 */
  n = window_keys(key, 1, 0, 0, 3000, 257, 13);
  ids = keys_tensor(ctx, key, n, MOE_I32);
  moe_tensor *b = rnd(ctx, MOE_F32, MOE_CPU, 2, SH(5, 257));
  pair_ud u = {ids, gpu(ctx, ids), 1, 0};
  const bool no[4] = {false, false, false, false};
  grad_multi(ctx, 1, &b, no, m_index_select, &u, 0, "index_select backward, windows"); /* exact */
  rel3(u.gpu, ids, b);
  free(key);
}

/* Out-of-range entries sort after every valid key, so the valid ones keep
 * their windows: the result is the CPU's with those entries left out. */
static void test_index_add_bad_windows_cuda(moe_ctx *ctx) {
  int64_t key[200], kept[200];
  int64_t n = window_keys(key, 1, 0, 0, 200, 5, 14), m = 0;
  for (int64_t i = 0; i < n; i++) key[i] = key[i] == 32 ? 4 : key[i]; /* X = 5: many 4s */
  key[17] = 9;
  key[150] = 9; /* one value: which bad entry is reported first is a race */
  moe_tensor *x = rnd(ctx, MOE_F32, MOE_CPU, 2, SH(5, 33)), *xg = gpu(ctx, x);
  moe_tensor *src = rnd(ctx, MOE_F32, MOE_CPU, 2, SH(200, 33)), *srcg = gpu(ctx, src);
  moe_tensor *idxg = NULL, *a = NULL, *b = NULL, *ah = NULL;
  moe_tensor *idx = keys_tensor(ctx, key, n, MOE_I64);
  idxg = gpu(ctx, idx);
  EXPECT_OK(moe_index_add(ctx, xg, 0, idxg, srcg, &a));
  EXPECT_ERR_MSG(moe_cuda_synchronize(ctx, GPU), MOE_ERR_INVALID_ARG,
                 "index_add: index 9 is out of range [0, 5)");
  EXPECT_OK(moe_cuda_synchronize(ctx, GPU));
  /* the CPU with rows 17 and 150 left out */
  float *sv = moe_tensor_data(src);
  moe_tensor *s2 = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, 2, SH(198, 33), MOE_F32, MOE_CPU, &s2));
  for (int64_t i = 0; s2 && i < n; i++)
    if (i != 17 && i != 150) {
      memcpy((float *)moe_tensor_data(s2) + m * 33, sv + i * 33, 33 * sizeof(float));
      kept[m++] = key[i];
    }
  moe_tensor *i2 = keys_tensor(ctx, kept, m, MOE_I64);
  EXPECT_OK(moe_index_add(ctx, x, 0, i2, s2, &b));
  EXPECT_OK(moe_to(ctx, a, MOE_F32, MOE_CPU, &ah));
  if (ah && b) SAME(ah, b, 0, "index_add, out-of-range entries dropped"); /* exact */
  moe_tensor *ts[] = {x, xg, src, srcg, idx, idxg, a, b, ah, s2, i2};
  for (size_t j = 0; j < sizeof ts / sizeof ts[0]; j++) moe_tensor_release(ts[j]);
}

/* ------------------------------------------- bad indices on the device */

static moe_tensor *ids_gpu(moe_ctx *ctx, int n, const int64_t *v) {
  moe_tensor *t = NULL;
  if (moe_tensor_empty(ctx, 1, (const int64_t[]){n}, MOE_I64, MOE_CPU, &t) != MOE_OK) {
    fprintf(stderr, "ids_gpu: %s\n", moe_ctx_error(ctx));
    exit(1);
  }
  memcpy(moe_tensor_data(t), v, (size_t)n * sizeof(int64_t));
  moe_tensor *g = gpu(ctx, t);
  moe_tensor_release(t);
  return g;
}

/* An index out of range on CUDA: the launch returns (no host sync), the
 * kernel stays inside memory, and the next synchronisation or copy to the
 * host fails naming the op, the value and the range; once reported, the
 * context goes on as before. */
static void test_bad_index_reported_cuda(moe_ctx *ctx) {
  moe_tensor *x = rnd(ctx, MOE_F32, MOE_CPU, 2, SH(5, 7)), *xg = gpu(ctx, x);
  moe_tensor *bad = ids_gpu(ctx, 3, (const int64_t[]){1, 9, 2});
  moe_tensor *neg = ids_gpu(ctx, 2, (const int64_t[]){-1, 0});
  moe_tensor *good = ids_gpu(ctx, 2, (const int64_t[]){4, 0});
  moe_tensor *o = NULL, *h = NULL;
  EXPECT_OK(moe_cuda_synchronize(ctx, GPU)); /* nothing pending */

  EXPECT_OK(moe_index_select(ctx, xg, 0, bad, &o));
  EXPECT_ERR_MSG(moe_cuda_synchronize(ctx, GPU), MOE_ERR_INVALID_ARG,
                 "index_select: index 9 is out of range [0, 5) on cuda:0");
  EXPECT_OK(moe_cuda_synchronize(ctx, GPU)); /* reported once */
  /* the documented result: the bad row reads 0, the others are right */
  EXPECT_OK(moe_to(ctx, o, MOE_F32, MOE_CPU, &h));
  if (h) {
    const float *hv = moe_tensor_data(h), *xv = moe_tensor_data(x);
    int ok = 1;
    for (int j = 0; j < 7; j++) ok &= hv[j] == xv[7 + j] && hv[7 + j] == 0.f && hv[14 + j] == xv[14 + j];
    EXPECT(ok);
  }
  moe_tensor_release(h);
  moe_tensor_release(o);

  /* found by the copy to the host */
  moe_tensor *i2 = NULL;
  EXPECT_OK(moe_reshape(ctx, neg, 2, SH(2, 1), &i2));
  EXPECT_OK(moe_gather(ctx, xg, 0, i2, &o));
  h = NULL;
  EXPECT_ERR_MSG(moe_to(ctx, o, MOE_F32, MOE_CPU, &h), MOE_ERR_INVALID_ARG,
                 "gather: index -1 is out of range [0, 5)");
  moe_tensor_release(h);
  moe_tensor_release(o);
  moe_tensor_release(i2);

  /* the first bad index wins until it is reported */
  moe_tensor *src = rnd(ctx, MOE_F32, GPU, 2, SH(3, 7));
  EXPECT_OK(moe_index_add(ctx, xg, 0, bad, src, &o));
  moe_tensor *o2 = NULL;
  EXPECT_OK(moe_one_hot(ctx, good, 3, &o2));
  EXPECT_ERR_MSG(moe_cuda_synchronize(ctx, GPU), MOE_ERR_INVALID_ARG,
                 "index_add: index 9 is out of range [0, 5)");
  EXPECT_OK(moe_cuda_synchronize(ctx, GPU));
  moe_tensor_release(o);
  moe_tensor_release(o2);
  moe_tensor_release(src);

  src = rnd(ctx, MOE_F32, GPU, 2, SH(2, 7));
  EXPECT_OK(moe_reshape(ctx, good, 2, SH(2, 1), &i2));
  moe_tensor *i3 = NULL;
  EXPECT_OK(moe_expand(ctx, i2, 2, SH(2, 7), &i3));
  EXPECT_OK(moe_scatter_add(ctx, xg, 1, i3, src, &o)); /* dim 1 has 7: index 4 fits, 0 fits */
  EXPECT_OK(moe_cuda_synchronize(ctx, GPU));
  moe_tensor_release(o);
  EXPECT_OK(moe_scatter_add(ctx, src, 0, i3, src, &o)); /* dim 0 of src has 2: index 4 does not */
  EXPECT_ERR_MSG(moe_cuda_synchronize(ctx, GPU), MOE_ERR_INVALID_ARG,
                 "scatter_add: index 4 is out of range [0, 2)");
  moe_tensor_release(o);
  moe_tensor_release(i2);
  moe_tensor_release(i3);
  moe_tensor_release(src);

  EXPECT_OK(moe_one_hot(ctx, good, 3, &o));
  EXPECT_ERR_MSG(moe_cuda_synchronize(ctx, GPU), MOE_ERR_INVALID_ARG, "one_hot: index 4 is out of range [0, 3)");
  moe_tensor_release(o);

  /* cross_entropy: a target out of range (NaN row, as before, and now the
   * error); ignore_index is not one */
  moe_tensor *logits = rnd(ctx, MOE_F32, GPU, 2, SH(3, 4));
  moe_tensor *t_bad = ids_gpu(ctx, 3, (const int64_t[]){1, 7, 0});
  moe_tensor *t_ign = ids_gpu(ctx, 3, (const int64_t[]){1, -100, 3});
  EXPECT_OK(moe_cross_entropy(ctx, logits, t_ign, -100, 0.0, MOE_REDUCTION_MEAN, &o));
  h = NULL;
  EXPECT_OK(moe_to(ctx, o, MOE_F32, MOE_CPU, &h));
  EXPECT(h && isfinite(*(const float *)moe_tensor_data(h)));
  moe_tensor_release(h);
  moe_tensor_release(o);
  EXPECT_OK(moe_cross_entropy(ctx, logits, t_bad, -100, 0.0, MOE_REDUCTION_MEAN, &o));
  h = NULL;
  EXPECT_ERR_MSG(moe_to(ctx, o, MOE_F32, MOE_CPU, &h), MOE_ERR_INVALID_ARG,
                 "cross_entropy (target): index 7 is out of range [0, 4)");
  moe_tensor_release(h);
  moe_tensor_release(o);

  /* the context goes on */
  EXPECT_OK(moe_index_select(ctx, xg, 0, good, &o));
  EXPECT_OK(moe_cuda_synchronize(ctx, GPU));
  moe_tensor_release(o);
  moe_tensor *ts[] = {x, xg, bad, neg, good, logits, t_bad, t_ign};
  for (size_t j = 0; j < sizeof ts / sizeof ts[0]; j++) moe_tensor_release(ts[j]);
}

/* ------------------------------------------------------------- bincount */

/* ids (n) in [0, E) with about `skew` of them in bin 0 (an untrained
 * router), of dtype dt, on the CPU. */
static moe_tensor *skewed_ids(moe_ctx *ctx, moe_dtype dt, int64_t n, int64_t E, double skew) {
  moe_tensor *t = rint_(ctx, MOE_I64, E, 1, SH(n)), *u = NULL, *c = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, 1, SH(n), MOE_F64, MOE_CPU, &u));
  EXPECT_OK(moe_uniform_(ctx, u, 0, 1));
  int64_t *pt = moe_tensor_data(t);
  const double *pu = moe_tensor_data(u);
  for (int64_t i = 0; i < n; i++)
    if (pu[i] < skew) pt[i] = 0;
  EXPECT_OK(moe_to(ctx, t, dt, MOE_CPU, &c));
  moe_tensor_release(t);
  moe_tensor_release(u);
  return c;
}

/* Exact against the CPU: sizes 1, odd, a warp and a block boundary, the
 * MoE router's 16384 ids, one bin taking nearly all; E from 1 to past the
 * shared-memory histogram (MOE_BINCOUNT_SMEM_MAX: the global path); i32 and
 * i64; a non-contiguous view; empty ids. */
static void test_bincount_cuda(moe_ctx *ctx) {
  const int64_t ns[] = {1, 31, 257, 16384, 100003};
  const int64_t Es[] = {1, 64, 1000, MOE_BINCOUNT_SMEM_MAX, MOE_BINCOUNT_SMEM_MAX + 1};
  const double skews[] = {0, 0.97};
  for (int a = 0; a < 5; a++)
    for (int b = 0; b < 5; b++)
      for (int c = 0; c < 2; c++) {
        moe_dtype dt = (a + b + c) % 2 ? MOE_I32 : MOE_I64;
        moe_tensor *ids = skewed_ids(ctx, dt, ns[a], Es[b], skews[c]), *idsg = gpu(ctx, ids);
        moe_tensor *x = NULL, *y = NULL;
        EXPECT_OK(moe_bincount(ctx, idsg, Es[b], &x));
        EXPECT_OK(moe_bincount(ctx, ids, Es[b], &y));
        EXPECT(x && x->storage->device.type == MOE_DEVICE_CUDA && x->dtype == MOE_I64);
        if (x && y) SAME(x, y, 0, "bincount");
        rel3(ids, idsg, x);
        moe_tensor_release(y);
      }
  /* a (3, 5) transposed view; 2-D ids */
  moe_tensor *ids = skewed_ids(ctx, MOE_I64, 15, 4, 0.5), *ids2 = NULL, *tr = NULL, *idsg = NULL;
  EXPECT_OK(moe_reshape(ctx, ids, 2, SH(3, 5), &ids2));
  idsg = gpu(ctx, ids2);
  EXPECT_OK(moe_transpose(ctx, idsg, 0, 1, &tr));
  moe_tensor *x = NULL, *y = NULL;
  EXPECT_OK(moe_bincount(ctx, tr, 4, &x));
  EXPECT_OK(moe_bincount(ctx, ids, 4, &y));
  if (x && y) SAME(x, y, 0, "bincount non-contiguous");
  moe_tensor_release(x);
  moe_tensor_release(y);
  moe_tensor *e = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, 1, SH(0), MOE_I64, GPU, &e));
  EXPECT_OK(moe_bincount(ctx, e, 3, &x));
  EXPECT_OK(moe_tensor_full(ctx, 1, SH(3), 0, MOE_I64, MOE_CPU, &y));
  if (x && y) SAME(x, y, 0, "bincount of no ids");
  moe_tensor_release(x);
  moe_tensor_release(y);
  moe_tensor *ts[] = {ids, ids2, tr, idsg, e};
  for (size_t j = 0; j < sizeof ts / sizeof ts[0]; j++) moe_tensor_release(ts[j]);
}

/* Out of range on CUDA: no error at the call (no host sync); the bad ids
 * are counted nowhere and the next synchronisation names them. */
static void test_bincount_bad_cuda(moe_ctx *ctx) {
  moe_tensor *bad = ids_gpu(ctx, 4, (const int64_t[]){1, 7, 1, 0}), *o = NULL, *h = NULL;
  EXPECT_OK(moe_cuda_synchronize(ctx, GPU));
  EXPECT_OK(moe_bincount(ctx, bad, 3, &o));
  EXPECT_ERR_MSG(moe_cuda_synchronize(ctx, GPU), MOE_ERR_INVALID_ARG,
                 "bincount: index 7 is out of range [0, 3) on cuda:0");
  EXPECT_OK(moe_to(ctx, o, MOE_I64, MOE_CPU, &h)); /* reported once; the rest counted */
  if (h) EXPECT_VALUES(h, 0, 1, 2, 0);
  moe_tensor_release(h);
  moe_tensor_release(o);
  moe_tensor *neg = ids_gpu(ctx, 2, (const int64_t[]){-3, 0});
  EXPECT_OK(moe_bincount(ctx, neg, MOE_BINCOUNT_SMEM_MAX + 5, &o)); /* the global path */
  h = NULL;
  EXPECT_ERR_MSG(moe_to(ctx, o, MOE_I64, MOE_CPU, &h), MOE_ERR_INVALID_ARG,
                 "bincount: index -3 is out of range");
  moe_tensor_release(h);
  moe_tensor_release(o);
  moe_tensor_release(neg);
  moe_tensor_release(bad);
}

/* moe_host_reads on a GPU: bincount queues work and reads nothing back; a
 * copy to the host is one copy and one sync; a synchronisation one sync. */
static void test_host_reads_cuda(moe_ctx *ctx) {
  moe_tensor *ids = ids_gpu(ctx, 4, (const int64_t[]){0, 2, 2, 1}), *o = NULL, *h = NULL;
  EXPECT_OK(moe_cuda_synchronize(ctx, GPU));
  int64_t c0, s0, c1, s1;
  moe_host_reads(ctx, &c0, &s0);
  EXPECT_OK(moe_bincount(ctx, ids, 3, &o));
  moe_host_reads(ctx, &c1, &s1);
  EXPECT(c1 == c0 && s1 == s0);
  EXPECT_OK(moe_to(ctx, o, MOE_I64, MOE_CPU, &h));
  moe_host_reads(ctx, &c1, &s1);
  EXPECT(c1 == c0 + 1 && s1 == s0 + 1);
  EXPECT_OK(moe_cuda_synchronize(ctx, GPU));
  moe_host_reads(ctx, &c1, &s1);
  EXPECT(c1 == c0 + 1 && s1 == s0 + 2);
  /* reading the host copy's values counts too (moe.h: what a GPU tensor's read would cost) */
  if (h) EXPECT_VALUES(h, 0, 1, 1, 2);
  moe_host_reads(ctx, &c1, &s1);
  EXPECT(c1 == c0 + 2 && s1 == s0 + 3);
  moe_tensor_release(h);
  moe_tensor_release(o);
  moe_tensor_release(ids);
}

/* ------------------------------------------------------- multinomial */

static void test_multinomial_cuda(moe_ctx *ctx) {
  moe_tensor *p = NULL, *pc = NULL, *a = NULL, *b = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, 2, SH(7, 1000), MOE_F32, MOE_CPU, &p));
  EXPECT_OK(moe_uniform_(ctx, p, 0, 1));
  moe_tensor *pg = gpu(ctx, p);
  moe_rng_seed(ctx, 11);
  EXPECT_OK(moe_multinomial(ctx, pg, 300, true, &a));
  moe_rng_seed(ctx, 11);
  EXPECT_OK(moe_multinomial(ctx, p, 300, true, &b));
  SAME(a, b, 0, "multinomial with replacement"); /* exact: same draws, same double sums */
  rel3(a, b, NULL);
  EXPECT_OK(moe_multinomial(ctx, pg, 20, false, &a));
  moe_rng_seed(ctx, 11);
  moe_rng_set_state(ctx, 11, 1); /* the second call of seed 11 */
  EXPECT_OK(moe_multinomial(ctx, p, 20, false, &b));
  SAME(a, b, 0, "multinomial without replacement");
  rel3(a, b, NULL);
  /* one large bf16 row (vocabulary-sized), 1 sample */
  moe_tensor *v = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, 1, SH(50257), MOE_F32, MOE_CPU, &v));
  EXPECT_OK(moe_uniform_(ctx, v, 0, 1));
  EXPECT_OK(moe_to(ctx, v, MOE_BF16, MOE_CPU, &pc));
  moe_tensor *vg = gpu(ctx, pc);
  moe_rng_set_state(ctx, 5, 9);
  EXPECT_OK(moe_multinomial(ctx, vg, 16, true, &a));
  moe_rng_set_state(ctx, 5, 9);
  EXPECT_OK(moe_multinomial(ctx, pc, 16, true, &b));
  SAME(a, b, 0, "multinomial vocabulary row");
  rel3(a, b, NULL);
  moe_tensor *ts[] = {p, pg, v, pc, vg};
  for (size_t j = 0; j < sizeof ts / sizeof ts[0]; j++) moe_tensor_release(ts[j]);
}

/* ------------------------------------------------------------ timings */

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* Median of 9 runs of 10 calls, ms per call (host clock around a sync). */
#define BENCH(name, bytes, body)                                                          \
  do {                                                                                    \
    double t_[9];                                                                         \
    for (int w_ = 0; w_ < 3; w_++) { body; }                                              \
    moe_cuda_synchronize(ctx, GPU);                                                       \
    for (int r_ = 0; r_ < 9; r_++) {                                                      \
      double t0_ = now_ms();                                                              \
      for (int i_ = 0; i_ < 10; i_++) { body; }                                           \
      moe_cuda_synchronize(ctx, GPU);                                                     \
      t_[r_] = (now_ms() - t0_) / 10;                                                     \
    }                                                                                     \
    for (int a_ = 0; a_ < 9; a_++)                                                        \
      for (int b_ = a_ + 1; b_ < 9; b_++)                                                 \
        if (t_[b_] < t_[a_]) { double s_ = t_[a_]; t_[a_] = t_[b_]; t_[b_] = s_; }        \
    printf("bench %-44s %9.4f ms  %8.1f GB/s\n", name, t_[4], (bytes) / (t_[4] * 1e6));  \
  } while (0)

static void test_timings(moe_ctx *ctx) {
  /* router topk: 65536 tokens x 256 experts f32, k = 8 */
  moe_tensor *x = NULL, *v = NULL, *i = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, 2, SH(65536, 256), MOE_F32, GPU, &x));
  EXPECT_OK(moe_normal_(ctx, x, 0, 1));
  BENCH("topk k=8 of (65536, 256) f32", 65536.0 * 256 * 4 + 65536.0 * 8 * 12,
        { moe_topk(ctx, x, 8, -1, true, &v, &i); moe_tensor_release(v); moe_tensor_release(i); });
  moe_tensor *x2 = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, 2, SH(65536, 64), MOE_BF16, GPU, &x2));
  EXPECT_OK(moe_normal_(ctx, x2, 0, 1));
  BENCH("topk k=2 of (65536, 64) bf16", 65536.0 * 64 * 2 + 65536.0 * 2 * 10,
        { moe_topk(ctx, x2, 2, -1, true, &v, &i); moe_tensor_release(v); moe_tensor_release(i); });
  /* argsort of 131072 expert ids (the MoE dispatch permutation) */
  moe_tensor *ids = NULL, *idsg = NULL;
  ids = rint_(ctx, MOE_I64, 64, 1, SH(131072));
  idsg = gpu(ctx, ids);
  BENCH("argsort 131072 i64 ids", 131072.0 * 8 * 4, { moe_argsort(ctx, idsg, 0, false, &i); moe_tensor_release(i); });
  /* embedding (50257, 1024) bf16, 8192 tokens: forward and weight gradient */
  moe_tensor *w = NULL, *tok = NULL, *tokg = NULL, *o = NULL, *g = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, 2, SH(50257, 1024), MOE_BF16, GPU, &w));
  EXPECT_OK(moe_normal_(ctx, w, 0, 1));
  tok = rint_(ctx, MOE_I64, 50257, 1, SH(8192));
  tokg = gpu(ctx, tok);
  BENCH("embedding fwd 8192 x 1024 bf16", 8192.0 * 1024 * 2 * 2,
        { moe_embedding(ctx, w, tokg, &o); moe_tensor_release(o); });
  EXPECT_OK(moe_tensor_empty(ctx, 2, SH(8192, 1024), MOE_BF16, GPU, &g));
  EXPECT_OK(moe_normal_(ctx, g, 0, 1));
  moe_tensor *z = NULL;
  EXPECT_OK(moe_tensor_full(ctx, 2, SH(50257, 1024), 0, MOE_BF16, GPU, &z));
  BENCH("index_add (embedding bwd core) 8192 x 1024", 8192.0 * 1024 * 2 * 3 + 50257.0 * 1024 * 4,
        { moe_index_add(ctx, z, 0, tokg, g, &o); moe_tensor_release(o); });
  /* the byte-vocabulary embedding gradient: 16384 tokens (half of them one
   * byte) into 257 rows of 512, bf16 (one thread per distinct row and
   * element walked each row's tokens before the windowed order) */
  int64_t *bk = malloc(sizeof(int64_t) * 16384);
  window_keys(bk, 1, 0, 0, 16384, 257, 12);
  moe_tensor *btok = keys_tensor(ctx, bk, 16384, MOE_I64), *btokg = gpu(ctx, btok), *bg = NULL, *bz = NULL;
  free(bk);
  EXPECT_OK(moe_tensor_empty(ctx, 2, SH(16384, 512), MOE_BF16, GPU, &bg));
  EXPECT_OK(moe_normal_(ctx, bg, 0, 1));
  EXPECT_OK(moe_tensor_full(ctx, 2, SH(257, 512), 0, MOE_BF16, GPU, &bz));
  BENCH("index_add byte vocab 16384 x 512 bf16 (257)", 16384.0 * 512 * 2 + 257.0 * 512 * 4,
        { moe_index_add(ctx, bz, 0, btokg, bg, &o); moe_tensor_release(o); });
  rel3(btok, btokg, bg);
  moe_tensor_release(bz);
  /* rope (8, 2048, 16, 128) bf16 */
  moe_tensor *q = NULL, *c = NULL, *s = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, 4, SH(8, 2048, 16, 128), MOE_BF16, GPU, &q));
  EXPECT_OK(moe_normal_(ctx, q, 0, 1));
  EXPECT_OK(moe_rope_cache(ctx, 2048, 128, 10000, MOE_BF16, GPU, &c, &s));
  BENCH("rope (8, 2048, 16, 128) bf16", 8.0 * 2048 * 16 * 128 * 2 * 2,
        { moe_rope(ctx, q, c, s, MOE_ROPE_BTHD, &o); moe_tensor_release(o); });
  /* rope of q, a strided view of the packed qkv of a small model's
   * attention (B 16, T 1024, H 8, D 64), bf16 */
  moe_tensor *qkv = NULL, *qv = NULL, *c2 = NULL, *s2 = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, 5, SH(16, 1024, 3, 8, 64), MOE_BF16, GPU, &qkv));
  EXPECT_OK(moe_normal_(ctx, qkv, 0, 1));
  EXPECT_OK(moe_select(ctx, qkv, 2, 0, &qv));
  EXPECT_OK(moe_rope_cache(ctx, 1024, 64, 10000, MOE_BF16, GPU, &c2, &s2));
  BENCH("rope q of packed qkv (16, 1024, 8, 64) bf16", 16.0 * 1024 * 8 * 64 * 2 * 2,
        { moe_rope(ctx, qv, c2, s2, MOE_ROPE_BTHD, &o); moe_tensor_release(o); });
  /* multinomial: 64 rows of a 50257 vocabulary, one sample each */
  moe_tensor *pr = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, 2, SH(64, 50257), MOE_F32, GPU, &pr));
  EXPECT_OK(moe_uniform_(ctx, pr, 0, 1));
  BENCH("multinomial (64, 50257) f32, 1 sample", 64.0 * 50257 * 4,
        { moe_multinomial(ctx, pr, 1, true, &o); moe_tensor_release(o); });
  /* the router's expert counts: 16384 ids into 64 bins, nearly all in one
   * (an untrained router), by bincount and by the scatter_add of ones */
  moe_tensor *rid = skewed_ids(ctx, MOE_I64, 16384, 64, 0.97), *ridg = gpu(ctx, rid);
  moe_tensor *one = NULL, *zb = NULL;
  EXPECT_OK(moe_tensor_full(ctx, 1, SH(16384), 1, MOE_I64, GPU, &one));
  EXPECT_OK(moe_tensor_full(ctx, 1, SH(64), 0, MOE_I64, GPU, &zb));
  BENCH("bincount 16384 ids into 64 bins (97% in one)", 16384.0 * 8,
        { moe_bincount(ctx, ridg, 64, &o); moe_tensor_release(o); });
  BENCH("scatter_add of ones, the same counts", 16384.0 * 16,
        { moe_scatter_add(ctx, zb, 0, ridg, one, &o); moe_tensor_release(o); });
  moe_tensor *ts[] = {x, x2, ids, idsg, w, tok, tokg, g, z, q, c, s, qkv, qv, c2, s2, pr, rid, ridg, one, zb};
  for (size_t j = 0; j < sizeof ts / sizeof ts[0]; j++) moe_tensor_release(ts[j]);
}

int main(void) {
  moe_ctx *ctx = harness_start();
  SKIP_IF_NO_GPU(ctx);
  RUN(test_gather_cuda);
  RUN(test_scatter_cuda);
  RUN(test_sort_cuda);
  RUN(test_join_cuda);
  RUN(test_rope_cuda);
  RUN(test_rope_views_cuda);
  RUN(test_backward_cuda);
  RUN(test_backward_multi_cuda);
  RUN(test_index_add_windows_cuda);
  RUN(test_index_add_bad_windows_cuda);
  RUN(test_device_mismatch_cuda);
  RUN(test_bad_index_reported_cuda);
  RUN(test_multinomial_cuda);
  RUN(test_bincount_cuda);
  RUN(test_bincount_bad_cuda);
  RUN(test_host_reads_cuda);
  if (!getenv("MOE_SKIP_BENCH")) RUN(test_timings); /* compute-sanitizer runs skip it */
  return harness_end();
}
