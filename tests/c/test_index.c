/*
 * test_index.c - the index family on the CPU (moe_index.h): values against
 * hand-computed or naive references, f64 finite-difference gradient checks
 * on contiguous and non-contiguous inputs, error paths, no leaks (RUN).
 */
#include "gradcheck.h"
#include "harness.h"
#include "index_add_keys.h"

#define SH(...) ((const int64_t[]){__VA_ARGS__})
#define VALS(...) ((const double[]){__VA_ARGS__})

static moe_tensor *mk(moe_ctx *ctx, moe_dtype dt, int ndim, const int64_t *shape, const double *v) {
  moe_tensor *t = NULL;
  if (moe_tensor_from_f64(ctx, v, ndim, shape, dt, MOE_CPU, &t) != MOE_OK) {
    fprintf(stderr, "mk failed: %s\n", moe_ctx_error(ctx));
    exit(1);
  }
  return t;
}

/* f64 values in [-1, 1) from the context's generator. */
static moe_tensor *rnd(moe_ctx *ctx, moe_dtype dt, int ndim, const int64_t *shape) {
  moe_tensor *t = NULL;
  if (moe_tensor_empty(ctx, ndim, shape, dt, MOE_CPU, &t) != MOE_OK ||
      moe_uniform_(ctx, t, -1, 1) != MOE_OK) {
    fprintf(stderr, "rnd failed: %s\n", moe_ctx_error(ctx));
    exit(1);
  }
  return t;
}

static moe_tensor *leaf(moe_ctx *ctx, moe_tensor *t) {
  if (moe_set_requires_grad(ctx, t, true) != MOE_OK) {
    fprintf(stderr, "requires_grad failed: %s\n", moe_ctx_error(ctx));
    exit(1);
  }
  return t;
}

/* A transposed (dims 0, 1) view of fresh random f64 data (base shape given),
 * as a leaf requiring grad: non-contiguous. */
static moe_tensor *tleaf(moe_ctx *ctx, int ndim, const int64_t *base_shape) {
  moe_tensor *b = rnd(ctx, MOE_F64, ndim, base_shape), *v = NULL;
  if (moe_transpose(ctx, b, 0, 1, &v) != MOE_OK) exit(1);
  moe_tensor_release(b);
  return leaf(ctx, v);
}

typedef struct args {
  moe_tensor *index;
  int64_t dim, k;
  int mode;
} args;

/* ------------------------------------------------------------ gather */

static moe_status f_gather(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  args *a = ud;
  return moe_gather(ctx, in[0], a->dim, a->index, out);
}

static void test_gather(moe_ctx *ctx) {
  moe_tensor *x = mk(ctx, MOE_F32, 2, SH(2, 3), VALS(1, 2, 3, 4, 5, 6));
  moe_tensor *i0 = mk(ctx, MOE_I64, 2, SH(2, 3), VALS(1, 0, 1, 0, 0, 1));
  moe_tensor *i1 = mk(ctx, MOE_I32, 2, SH(2, 2), VALS(2, 0, 1, 1));
  moe_tensor *o = NULL;
  EXPECT_OK(moe_gather(ctx, x, 0, i0, &o));
  EXPECT_VALUES(o, 0, 4, 2, 6, 1, 2, 6);
  moe_tensor_release(o);
  EXPECT_OK(moe_gather(ctx, x, -1, i1, &o)); /* i32 index, smaller than x */
  EXPECT_VALUES(o, 0, 3, 1, 5, 5);
  EXPECT(o->dtype == MOE_F32 && o->shape[0] == 2 && o->shape[1] == 2);
  moe_tensor_release(o);
  /* bf16 moves bits exactly */
  moe_tensor *xb = mk(ctx, MOE_BF16, 2, SH(2, 3), VALS(1.5, -2, 3, 4, 5, 6.25));
  EXPECT_OK(moe_gather(ctx, xb, 1, i1, &o));
  EXPECT_VALUES(o, 0, 3, 1.5, 5, 5);
  moe_tensor_release(o);
  /* errors */
  moe_tensor *bad = mk(ctx, MOE_I64, 2, SH(1, 1), VALS(3));
  EXPECT_ERR_MSG(moe_gather(ctx, x, 1, bad, &o), MOE_ERR_INVALID_ARG, "outside [0, 3)");
  moe_tensor *neg = mk(ctx, MOE_I64, 2, SH(1, 1), VALS(-1));
  EXPECT_ERR_MSG(moe_gather(ctx, x, 0, neg, &o), MOE_ERR_INVALID_ARG, "holds -1");
  moe_tensor *i3 = mk(ctx, MOE_I64, 1, SH(2), VALS(0, 1));
  EXPECT_ERR_MSG(moe_gather(ctx, x, 0, i3, &o), MOE_ERR_SHAPE, "same number of dims");
  moe_tensor *big = mk(ctx, MOE_I64, 2, SH(3, 3), VALS(0, 0, 0, 0, 0, 0, 0, 0, 0));
  EXPECT_ERR_MSG(moe_gather(ctx, x, 1, big, &o), MOE_ERR_SHAPE, "larger than x");
  moe_tensor *fi = mk(ctx, MOE_F32, 2, SH(1, 1), VALS(0));
  EXPECT_ERR_MSG(moe_gather(ctx, x, 0, fi, &o), MOE_ERR_DTYPE, "i64 or i32");
  EXPECT_ERR_MSG(moe_gather(ctx, x, 2, i0, &o), MOE_ERR_INVALID_ARG,
                 "gather: dim 2 is out of range for a tensor of 2 dims (expected -2 to 1)");
  EXPECT_ERR_MSG(moe_gather(ctx, NULL, 0, i0, &o), MOE_ERR_INVALID_ARG, "gather: x is NULL");
  /* gradients: repeated indices accumulate */
  moe_tensor *xg = leaf(ctx, rnd(ctx, MOE_F64, 2, SH(3, 4)));
  moe_tensor *ig = mk(ctx, MOE_I64, 2, SH(2, 4), VALS(2, 0, 0, 1, 2, 2, 1, 1));
  args a = {ig, 0, 0, 0};
  EXPECT(gradcheck(ctx, f_gather, 1, &xg, &a, 1e-6, 1e-6));
  moe_tensor *xt = tleaf(ctx, 2, SH(4, 3)); /* (3, 4), non-contiguous */
  EXPECT(gradcheck(ctx, f_gather, 1, &xt, &a, 1e-6, 1e-6));
  moe_tensor *ig1 = mk(ctx, MOE_I32, 2, SH(3, 5), VALS(3, 3, 0, 1, 2, 0, 0, 0, 3, 1, 2, 2, 1, 0, 3));
  args a1 = {ig1, 1, 0, 0};
  EXPECT(gradcheck(ctx, f_gather, 1, &xt, &a1, 1e-6, 1e-6));
  moe_tensor *ts[] = {x, i0, i1, xb, bad, neg, i3, big, fi, xg, ig, xt, ig1};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) moe_tensor_release(ts[i]);
}

/* --------------------------------------------------------- scatter */

static moe_status f_scatter(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  args *a = ud;
  return a->mode ? moe_scatter_add(ctx, in[0], a->dim, a->index, in[1], out)
                 : moe_scatter(ctx, in[0], a->dim, a->index, in[1], out);
}

static void test_scatter(moe_ctx *ctx) {
  moe_tensor *x = mk(ctx, MOE_F32, 2, SH(2, 3), VALS(1, 2, 3, 4, 5, 6));
  moe_tensor *src = mk(ctx, MOE_F32, 2, SH(2, 3), VALS(10, 20, 30, 40, 50, 60));
  moe_tensor *idx = mk(ctx, MOE_I64, 2, SH(2, 2), VALS(2, 2, 0, 1)); /* row 0: two writes to col 2 */
  moe_tensor *o = NULL;
  EXPECT_OK(moe_scatter(ctx, x, 1, idx, src, &o));
  EXPECT_VALUES(o, 0, 1, 2, 20, 40, 50, 6); /* the last write (20) wins */
  moe_tensor_release(o);
  EXPECT_OK(moe_scatter_add(ctx, x, 1, idx, src, &o));
  EXPECT_VALUES(o, 0, 1, 2, 33, 44, 55, 6);
  moe_tensor_release(o);
  moe_tensor *idx0 = mk(ctx, MOE_I32, 2, SH(1, 3), VALS(1, 0, 1));
  EXPECT_OK(moe_scatter_add(ctx, x, 0, idx0, src, &o));
  EXPECT_VALUES(o, 0, 1, 22, 3, 14, 5, 36);
  moe_tensor_release(o);
  /* x is untouched (out of place) */
  EXPECT_VALUES(x, 0, 1, 2, 3, 4, 5, 6);
  /* bf16 adds in f32 and rounds once: 256 + 1 + 1 = 258 exactly in bf16 */
  moe_tensor *xb = mk(ctx, MOE_BF16, 1, SH(1), VALS(256));
  moe_tensor *sb = mk(ctx, MOE_BF16, 1, SH(2), VALS(1, 1));
  moe_tensor *ib = mk(ctx, MOE_I64, 1, SH(2), VALS(0, 0));
  EXPECT_OK(moe_scatter_add(ctx, xb, 0, ib, sb, &o));
  EXPECT_VALUES(o, 0, 258);
  moe_tensor_release(o);
  /* integers: a histogram */
  moe_tensor *cnt = mk(ctx, MOE_I64, 1, SH(4), VALS(0, 0, 0, 0));
  moe_tensor *ones = mk(ctx, MOE_I64, 1, SH(6), VALS(1, 1, 1, 1, 1, 1));
  moe_tensor *ids = mk(ctx, MOE_I64, 1, SH(6), VALS(3, 1, 3, 3, 0, 1));
  EXPECT_OK(moe_scatter_add(ctx, cnt, 0, ids, ones, &o));
  EXPECT_VALUES(o, 0, 1, 2, 0, 3);
  moe_tensor_release(o);
  /* errors */
  moe_tensor *s64 = mk(ctx, MOE_F64, 2, SH(2, 3), VALS(0, 0, 0, 0, 0, 0));
  EXPECT_ERR_MSG(moe_scatter(ctx, x, 1, idx, s64, &o), MOE_ERR_DTYPE, "src is f64");
  moe_tensor *bigi = mk(ctx, MOE_I64, 2, SH(2, 4), VALS(0, 0, 0, 0, 0, 0, 0, 0));
  EXPECT_ERR_MSG(moe_scatter(ctx, x, 0, bigi, src, &o), MOE_ERR_SHAPE, "larger");
  moe_tensor *oob = mk(ctx, MOE_I64, 2, SH(1, 1), VALS(5));
  EXPECT_ERR_MSG(moe_scatter_add(ctx, x, 1, oob, src, &o), MOE_ERR_INVALID_ARG, "outside [0, 3)");
  moe_tensor *bx = mk(ctx, MOE_BOOL, 1, SH(2), VALS(0, 1));
  EXPECT_ERR_MSG(moe_scatter_add(ctx, bx, 0, ib, bx, &o), MOE_ERR_DTYPE,
                 "scatter_add: bool tensors cannot be added");
  /* gradients; scatter with distinct targets per column, src larger than index */
  moe_tensor *xg = leaf(ctx, rnd(ctx, MOE_F64, 2, SH(4, 3)));
  moe_tensor *sg = leaf(ctx, rnd(ctx, MOE_F64, 2, SH(3, 3)));
  moe_tensor *ig = mk(ctx, MOE_I64, 2, SH(2, 3), VALS(3, 0, 1, 1, 2, 0));
  moe_tensor *in[2] = {xg, sg};
  args a = {ig, 0, 0, 0};
  EXPECT(gradcheck(ctx, f_scatter, 2, in, &a, 1e-6, 1e-6));
  a.mode = 1;
  moe_tensor *igd = mk(ctx, MOE_I64, 2, SH(2, 3), VALS(3, 0, 1, 3, 0, 1)); /* repeated targets */
  a.index = igd;
  EXPECT(gradcheck(ctx, f_scatter, 2, in, &a, 1e-6, 1e-6));
  moe_tensor *xt = tleaf(ctx, 2, SH(3, 4)), *st = tleaf(ctx, 2, SH(3, 3)); /* (4, 3), (3, 3) */
  moe_tensor *in2[2] = {xt, st};
  EXPECT(gradcheck(ctx, f_scatter, 2, in2, &a, 1e-6, 1e-6));
  a.mode = 0;
  a.index = ig;
  EXPECT(gradcheck(ctx, f_scatter, 2, in2, &a, 1e-6, 1e-6));
  moe_tensor *ts[] = {x, src, idx, idx0, xb, sb, ib, cnt, ones, ids, s64, bigi, oob, bx, xg, sg, ig, igd, xt, st};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) moe_tensor_release(ts[i]);
}

/* ----------------------------------------- index_select, index_add */

static moe_status f_index_select(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  args *a = ud;
  return moe_index_select(ctx, in[0], a->dim, a->index, out);
}

static moe_status f_index_add(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  args *a = ud;
  return moe_index_add(ctx, in[0], a->dim, a->index, in[1], out);
}

static void test_index_select_add(moe_ctx *ctx) {
  moe_tensor *x = mk(ctx, MOE_F32, 2, SH(3, 2), VALS(1, 2, 3, 4, 5, 6));
  moe_tensor *i = mk(ctx, MOE_I64, 1, SH(4), VALS(2, 0, 2, 1));
  moe_tensor *o = NULL;
  EXPECT_OK(moe_index_select(ctx, x, 0, i, &o));
  EXPECT_VALUES(o, 0, 5, 6, 1, 2, 5, 6, 3, 4);
  moe_tensor_release(o);
  moe_tensor *i2 = mk(ctx, MOE_I32, 1, SH(3), VALS(1, 1, 0));
  EXPECT_OK(moe_index_select(ctx, x, 1, i2, &o));
  EXPECT_VALUES(o, 0, 2, 2, 1, 4, 4, 3, 6, 6, 5);
  moe_tensor_release(o);
  moe_tensor *src = mk(ctx, MOE_F32, 2, SH(4, 2), VALS(10, 20, 30, 40, 50, 60, 70, 80));
  EXPECT_OK(moe_index_add(ctx, x, 0, i, src, &o));
  EXPECT_VALUES(o, 0, 31, 42, 73, 84, 65, 86);
  moe_tensor_release(o);
  /* errors */
  moe_tensor *i2d = mk(ctx, MOE_I64, 2, SH(1, 1), VALS(0));
  EXPECT_ERR_MSG(moe_index_select(ctx, x, 0, i2d, &o), MOE_ERR_SHAPE, "1-D");
  moe_tensor *oob = mk(ctx, MOE_I64, 1, SH(1), VALS(3));
  EXPECT_ERR_MSG(moe_index_select(ctx, x, 0, oob, &o), MOE_ERR_INVALID_ARG, "outside [0, 3)");
  EXPECT_ERR_MSG(moe_index_add(ctx, x, 1, i2, src, &o), MOE_ERR_SHAPE, "src [4, 2]");
  /* gradients */
  moe_tensor *xg = leaf(ctx, rnd(ctx, MOE_F64, 2, SH(3, 4)));
  args a = {i, 0, 0, 0};
  EXPECT(gradcheck(ctx, f_index_select, 1, &xg, &a, 1e-6, 1e-6));
  moe_tensor *xt = tleaf(ctx, 3, SH(2, 3, 2)); /* (3, 2, 2) */
  EXPECT(gradcheck(ctx, f_index_select, 1, &xt, &a, 1e-6, 1e-6));
  a.dim = 2;
  a.index = i2;
  EXPECT(gradcheck(ctx, f_index_select, 1, &xt, &a, 1e-6, 1e-6));
  moe_tensor *sg = leaf(ctx, rnd(ctx, MOE_F64, 3, SH(3, 2, 3)));
  moe_tensor *in[2] = {xt, sg};
  EXPECT(gradcheck(ctx, f_index_add, 2, in, &a, 1e-6, 1e-6));
  /* contiguous x with a non-contiguous src */
  moe_tensor *xc = leaf(ctx, rnd(ctx, MOE_F64, 3, SH(3, 2, 2)));
  moe_tensor *st = tleaf(ctx, 3, SH(2, 3, 3)); /* (3, 2, 3) */
  moe_tensor *in2[2] = {xc, st};
  EXPECT(gradcheck(ctx, f_index_add, 2, in2, &a, 1e-6, 1e-6));
  moe_tensor *ts[] = {x, i, i2, src, i2d, oob, xg, xt, sg, xc, st};
  for (size_t k = 0; k < sizeof ts / sizeof ts[0]; k++) moe_tensor_release(ts[k]);
}

/* ------------------------------------ index_add's windowed order (CPU) */

/* The order of moe_index_add (moe_index.h), worked out apart from the
 * library's counting sort: occurrence r (0-based, in order of i) of key k
 * sits at sorted position below[k] + r, below[k] counting the indices less
 * than k, so in window (below[k] + r) / P. Per element: the head (x, then
 * the occurrences in k's first window) and each later window's partial
 * (from its first occurrence), joined in window order. f32 arithmetic
 * unless dbl (f64 and the integers, whose small values add exactly in
 * double). x (outer, X, inner), src (outer, n, inner), out like x. */
static double wadd(double a, double b, bool dbl) { return dbl ? a + b : (double)((float)a + (float)b); }

static void ref_windowed(int64_t outer, int64_t X, int64_t n, int64_t inner, const double *x,
                         const int64_t *key, const double *src, bool dbl, double *out) {
  const int64_t P = MOE_INDEX_ADD_WINDOW;
  int64_t *below = calloc((size_t)X + 1, sizeof(int64_t)), *occ = malloc(sizeof(int64_t) * (size_t)n);
  int64_t *fill = calloc((size_t)X + 1, sizeof(int64_t));
  for (int64_t i = 0; i < n; i++) below[key[i] + 1]++;
  for (int64_t k = 0; k < X; k++) below[k + 1] += below[k];
  for (int64_t i = 0; i < n; i++) occ[below[key[i]] + fill[key[i]]++] = i; /* k's i's, in order */
  for (int64_t o = 0; o < outer; o++)
    for (int64_t k = 0; k < X; k++)
      for (int64_t e = 0; e < inner; e++) {
        double acc = x[(o * X + k) * inner + e], part = 0;
        int64_t first = below[k] / P, cur = -1;
        for (int64_t r = 0; r < fill[k]; r++) {
          double s = src[(o * n + occ[below[k] + r]) * inner + e];
          int64_t w = (below[k] + r) / P;
          if (w == first) {
            acc = wadd(acc, s, dbl);
          } else if (w != cur) {
            if (cur >= 0) acc = wadd(acc, part, dbl);
            part = s;
            cur = w;
          } else {
            part = wadd(part, s, dbl);
          }
        }
        if (cur >= 0) acc = wadd(acc, part, dbl);
        out[(o * X + k) * inner + e] = acc;
      }
  free(below);
  free(occ);
  free(fill);
}

/* index_add(x, 1, index, src) with x (outer, X, inner) and src (outer, n,
 * inner) of dtype dt: bit for bit the windowed order (ref_windowed, rounded
 * once to dt), and within the rounding bound of the exact (double) serial
 * sum: |got - exact| <= (m + 1) u_c sum|terms| + u_dt |got| for a key of m
 * occurrences (u_c, u_dt: the unit roundoff of the compute type and of dt). */
static void index_add_case(moe_ctx *ctx, moe_dtype dt, moe_dtype it, int64_t outer, int64_t X,
                           int64_t inner, int64_t n, const int64_t *key, const char *what) {
  bool isint = !moe_dtype_is_float(dt), dbl = isint || dt == MOE_F64;
  moe_tensor *x = NULL, *src = NULL, *idx = NULL, *o = NULL, *want = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, 3, SH(outer, X, inner), dt, MOE_CPU, &x));
  EXPECT_OK(moe_tensor_empty(ctx, 3, SH(outer, n, inner), dt, MOE_CPU, &src));
  if (isint) {
    EXPECT_OK(moe_randint_(ctx, x, -50, 50));
    EXPECT_OK(moe_randint_(ctx, src, -50, 50));
  } else {
    EXPECT_OK(moe_uniform_(ctx, x, -1, 1));
    EXPECT_OK(moe_uniform_(ctx, src, -1, 1));
  }
  double *kd = malloc(sizeof(double) * (size_t)n);
  for (int64_t i = 0; i < n; i++) kd[i] = (double)key[i];
  EXPECT_OK(moe_tensor_from_f64(ctx, kd, 1, SH(n), it, MOE_CPU, &idx));
  EXPECT_OK(moe_index_add(ctx, x, 1, idx, src, &o));
  int64_t on = outer * X * inner, sn = outer * n * inner;
  double *xd = malloc(sizeof(double) * (size_t)on), *sd = malloc(sizeof(double) * (size_t)sn);
  double *rd = malloc(sizeof(double) * (size_t)on), *got = malloc(sizeof(double) * (size_t)on);
  EXPECT_OK(moe_tensor_to_f64(ctx, x, xd));
  EXPECT_OK(moe_tensor_to_f64(ctx, src, sd));
  ref_windowed(outer, X, n, inner, xd, key, sd, dbl, rd);
  EXPECT_OK(moe_tensor_from_f64(ctx, rd, 3, SH(outer, X, inner), dt, MOE_CPU, &want));
  EXPECT_OK(moe_tensor_to_f64(ctx, want, rd)); /* rounded once to dt, as the op stores */
  bool ok = o && harness_values(o, rd, on, 0, __FILE__, __LINE__); /* exact: one order */
  if (!ok) fprintf(stderr, "  (%s, %s: the windowed order)\n", what, moe_dtype_name(dt));
  EXPECT(ok);
  /* against the serial sum in double */
  const double uc = dt == MOE_F64 ? 0x1p-53 : 0x1p-24;
  const double udt = dt == MOE_BF16 ? 0x1p-8 : dt == MOE_F16 ? 0x1p-11 : uc;
  int64_t *cnt = calloc((size_t)X, sizeof(int64_t)), bad = 0;
  for (int64_t i = 0; i < n; i++) cnt[key[i]]++;
  if (o) EXPECT_OK(moe_tensor_to_f64(ctx, o, got));
  for (int64_t oo = 0; o && oo < outer; oo++)
    for (int64_t k = 0; k < X; k++)
      for (int64_t e = 0; e < inner; e++) {
        int64_t t = (oo * X + k) * inner + e;
        double exact = xd[t], mag = fabs(xd[t]);
        for (int64_t i = 0; i < n; i++)
          if (key[i] == k) {
            exact += sd[(oo * n + i) * inner + e];
            mag += fabs(sd[(oo * n + i) * inner + e]);
          }
        double bound = isint ? 0 : (double)(cnt[k] + 1) * uc * mag + udt * fabs(got[t]);
        if (!(fabs(got[t] - exact) <= bound) && bad++ < 3)
          fprintf(stderr, "  %s %s: [%lld, %lld, %lld] is %.17g, serial sum %.17g (bound %g)\n", what,
                  moe_dtype_name(dt), (long long)oo, (long long)k, (long long)e, got[t], exact, bound);
      }
  EXPECT(bad == 0);
  free(kd);
  free(xd);
  free(sd);
  free(rd);
  free(got);
  free(cnt);
  moe_tensor *ts[] = {x, src, idx, o, want};
  for (size_t j = 0; j < sizeof ts / sizeof ts[0]; j++) moe_tensor_release(ts[j]);
}

static void test_index_add_windows(moe_ctx *ctx) {
  const int64_t P = MOE_INDEX_ADD_WINDOW;
  /* the order by hand, f32: key 0 takes 2^24 and 31 ones in window 0 (each
   * one is lost: 2^24 + 1 rounds to 2^24) and two ones in window 1, which
   * add to 2 first: 2^24 + 2. The serial sum would stay at 2^24. Key 1
   * (at position 0, sorted last) is a head in window 1: 0 + 5. */
  double iv[35], sv[35];
  iv[0] = 1;
  sv[0] = 5;
  for (int i = 1; i < 35; i++) {
    iv[i] = 0;
    sv[i] = i == 1 ? 16777216.0 : 1.0;
  }
  moe_tensor *x = mk(ctx, MOE_F32, 1, SH(2), VALS(0, 0));
  moe_tensor *ix = mk(ctx, MOE_I64, 1, SH(35), iv), *sx = mk(ctx, MOE_F32, 1, SH(35), sv), *o = NULL;
  EXPECT(P == 32); /* the hand-worked case assumes it */
  EXPECT_OK(moe_index_add(ctx, x, 0, ix, sx, &o));
  EXPECT_VALUES(o, 0, 16777218, 5);
  moe_tensor_release(o);
  moe_tensor *ts[] = {x, ix, sx};
  for (size_t k = 0; k < sizeof ts / sizeof ts[0]; k++) moe_tensor_release(ts[k]);

  const moe_dtype dts[] = {MOE_F32, MOE_F64, MOE_BF16, MOE_F16, MOE_I32};
  int64_t *key = malloc(sizeof(int64_t) * 4096);
  char what[96];
  for (int d = 0; d < 5; d++) {
    moe_dtype it = d % 2 ? MOE_I32 : MOE_I64;
    /* one key 1, P - 1, P, P + 1, 3P + 5 times, its segment starting at 0,
     * inside a window and just before a boundary */
    const int64_t ms[] = {1, P - 1, P, P + 1, 3 * P + 5}, leads[] = {0, 5, P - 1};
    for (int a = 0; a < 5; a++)
      for (int b = 0; b < 3; b++) {
        int64_t n = window_keys(key, 0, ms[a], leads[b], 0, 4, (uint64_t)(a * 3 + b + 1));
        snprintf(what, sizeof what, "one key %lld times after %lld", (long long)ms[a], (long long)leads[b]);
        index_add_case(ctx, dts[d], it, 2, 4, 3, n, key, what);
      }
    /* many keys, duplicate-heavy, inner 1 and 513, outer 1 and 3 */
    int64_t n = window_keys(key, 1, 0, 0, 1000, 257, 7);
    index_add_case(ctx, dts[d], it, 3, 257, 1, n, key, "skewed, inner 1");
    index_add_case(ctx, dts[d], it, 1, 257, 513, n, key, "skewed, inner 513");
    n = window_keys(key, 1, 0, 0, 4096, 257, 8);
    index_add_case(ctx, dts[d], it, 1, 257, 5, n, key, "skewed, 4096");
    /* all distinct: every key alone */
    n = window_keys(key, 2, 0, 0, 300, 300, 9);
    index_add_case(ctx, dts[d], it, 3, 300, 2, n, key, "distinct");
  }
  free(key);
}

/* embedding's and index_select's backward are index_add: the same bits. */
static void test_index_add_users(moe_ctx *ctx) {
  int64_t key[1000];
  window_keys(key, 1, 0, 0, 1000, 257, 11);
  double kd[1000];
  for (int i = 0; i < 1000; i++) kd[i] = (double)key[i];
  moe_tensor *ids = mk(ctx, MOE_I64, 1, SH(1000), kd), *w = leaf(ctx, rnd(ctx, MOE_F32, 2, SH(257, 7)));
  moe_tensor *o = NULL, *g = rnd(ctx, MOE_F32, 2, SH(1000, 7)), *z = NULL, *r = NULL;
  EXPECT_OK(moe_embedding(ctx, w, ids, &o));
  EXPECT_OK(moe_backward(ctx, o, g, false));
  EXPECT_OK(moe_tensor_full(ctx, 2, SH(257, 7), 0, MOE_F32, MOE_CPU, &z));
  EXPECT_OK(moe_index_add(ctx, z, 0, ids, g, &r));
  double *a = malloc(sizeof(double) * 257 * 7), *b = malloc(sizeof(double) * 257 * 7);
  EXPECT(moe_tensor_grad(w) != NULL);
  if (moe_tensor_grad(w) && r) {
    EXPECT_OK(moe_tensor_to_f64(ctx, moe_tensor_grad(w), a));
    EXPECT_OK(moe_tensor_to_f64(ctx, r, b));
    EXPECT(memcmp(a, b, sizeof(double) * 257 * 7) == 0);
  }
  moe_tensor_release(o);
  moe_tensor_release(r);
  moe_tensor_release(z);
  moe_tensor_release(g);
  /* index_select along dim 1 of (5, 257): outer 5 */
  moe_tensor *x = leaf(ctx, rnd(ctx, MOE_F32, 2, SH(5, 257)));
  g = rnd(ctx, MOE_F32, 2, SH(5, 1000));
  EXPECT_OK(moe_index_select(ctx, x, 1, ids, &o));
  EXPECT_OK(moe_backward(ctx, o, g, false));
  EXPECT_OK(moe_tensor_full(ctx, 2, SH(5, 257), 0, MOE_F32, MOE_CPU, &z));
  EXPECT_OK(moe_index_add(ctx, z, 1, ids, g, &r));
  EXPECT(moe_tensor_grad(x) != NULL);
  if (moe_tensor_grad(x) && r) {
    EXPECT_OK(moe_tensor_to_f64(ctx, moe_tensor_grad(x), a));
    EXPECT_OK(moe_tensor_to_f64(ctx, r, b));
    EXPECT(memcmp(a, b, sizeof(double) * 5 * 257) == 0);
  }
  free(a);
  free(b);
  moe_tensor *ts[] = {ids, w, o, g, z, r, x};
  for (size_t k = 0; k < sizeof ts / sizeof ts[0]; k++) moe_tensor_release(ts[k]);
}

/* ------------------------------------------------ embedding, one_hot */

static moe_status f_embedding(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  args *a = ud;
  return moe_embedding(ctx, in[0], a->index, out);
}

static void test_embedding(moe_ctx *ctx) {
  moe_tensor *w = mk(ctx, MOE_F32, 2, SH(4, 2), VALS(0, 1, 10, 11, 20, 21, 30, 31));
  moe_tensor *ids = mk(ctx, MOE_I64, 2, SH(2, 3), VALS(3, 0, 3, 1, 1, 2));
  moe_tensor *o = NULL;
  EXPECT_OK(moe_embedding(ctx, w, ids, &o));
  EXPECT(o->ndim == 3 && o->shape[0] == 2 && o->shape[1] == 3 && o->shape[2] == 2);
  EXPECT_VALUES(o, 0, 30, 31, 0, 1, 30, 31, 10, 11, 10, 11, 20, 21);
  moe_tensor_release(o);
  moe_tensor *ids32 = mk(ctx, MOE_I32, 1, SH(2), VALS(2, 2));
  EXPECT_OK(moe_embedding(ctx, w, ids32, &o));
  EXPECT_VALUES(o, 0, 20, 21, 20, 21);
  moe_tensor_release(o);
  moe_tensor *bad = mk(ctx, MOE_I64, 1, SH(1), VALS(4));
  EXPECT_ERR_MSG(moe_embedding(ctx, w, bad, &o), MOE_ERR_INVALID_ARG, "outside [0, 4)");
  EXPECT_ERR_MSG(moe_embedding(ctx, ids, ids, &o), MOE_ERR_INVALID_ARG, "outside");
  moe_tensor *w1 = mk(ctx, MOE_F32, 1, SH(2), VALS(1, 2));
  EXPECT_ERR_MSG(moe_embedding(ctx, w1, ids32, &o), MOE_ERR_SHAPE, "2-D (V, D)");
  EXPECT_ERR_MSG(moe_embedding(ctx, w, w, &o), MOE_ERR_DTYPE, "ids must be i64 or i32");
  /* weight gradient: rows hit several times sum */
  moe_tensor *wg = leaf(ctx, rnd(ctx, MOE_F64, 2, SH(5, 3)));
  args a = {ids, 0, 0, 0};
  EXPECT(gradcheck(ctx, f_embedding, 1, &wg, &a, 1e-6, 1e-6));
  moe_tensor *wt = tleaf(ctx, 2, SH(3, 5)); /* (5, 3) transposed */
  EXPECT(gradcheck(ctx, f_embedding, 1, &wt, &a, 1e-6, 1e-6));
  /* backward by hand: grad of sum(out) counts each id */
  moe_tensor *wl = leaf(ctx, mk(ctx, MOE_F64, 2, SH(4, 1), VALS(0, 0, 0, 0)));
  moe_tensor *ones = mk(ctx, MOE_F64, 3, SH(2, 3, 1), VALS(1, 1, 1, 1, 1, 1));
  EXPECT_OK(moe_embedding(ctx, wl, ids, &o));
  EXPECT_OK(moe_backward(ctx, o, ones, false));
  EXPECT(moe_tensor_grad(wl) != NULL);
  if (moe_tensor_grad(wl)) EXPECT_VALUES(moe_tensor_grad(wl), 0, 1, 2, 1, 2);
  moe_tensor_release(o);
  moe_tensor *ts[] = {w, ids, ids32, bad, w1, wg, wt, wl, ones};
  for (size_t k = 0; k < sizeof ts / sizeof ts[0]; k++) moe_tensor_release(ts[k]);
}

static void test_one_hot(moe_ctx *ctx) {
  moe_tensor *ids = mk(ctx, MOE_I64, 2, SH(2, 2), VALS(0, 2, 1, 2));
  moe_tensor *o = NULL;
  EXPECT_OK(moe_one_hot(ctx, ids, 4, &o));
  EXPECT(o->dtype == MOE_I64 && o->ndim == 3 && o->shape[2] == 4);
  EXPECT_VALUES(o, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 1, 0, 0, 0, 0, 1, 0);
  moe_tensor_release(o);
  EXPECT_OK(moe_one_hot(ctx, ids, -1, &o)); /* inferred: 3 */
  EXPECT(o->shape[2] == 3);
  EXPECT_VALUES(o, 0, 1, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0, 1);
  moe_tensor_release(o);
  EXPECT_ERR_MSG(moe_one_hot(ctx, ids, 2, &o), MOE_ERR_INVALID_ARG, "outside [0, 2)");
  EXPECT_ERR_MSG(moe_one_hot(ctx, ids, -2, &o), MOE_ERR_INVALID_ARG,
                 "one_hot: num_classes must be >= 0 (or -1 to infer), got -2");
  moe_tensor *e = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, 1, SH(0), MOE_I64, MOE_CPU, &e));
  EXPECT_ERR_MSG(moe_one_hot(ctx, e, -1, &o), MOE_ERR_INVALID_ARG, "empty");
  EXPECT_OK(moe_one_hot(ctx, e, 5, &o));
  EXPECT(o->shape[0] == 0 && o->shape[1] == 5);
  moe_tensor_release(o);
  moe_tensor *f = mk(ctx, MOE_F32, 1, SH(1), VALS(0));
  EXPECT_ERR_MSG(moe_one_hot(ctx, f, 2, &o), MOE_ERR_DTYPE, "one_hot: ids must be i64 or i32, got f32");
  moe_tensor_release(ids);
  moe_tensor_release(e);
  moe_tensor_release(f);
}

/* ------------------------------------------------------------ bincount */

static void test_bincount(moe_ctx *ctx) {
  moe_tensor *ids = mk(ctx, MOE_I64, 2, SH(2, 3), VALS(3, 0, 3, 1, 3, 0)), *o = NULL;
  EXPECT_OK(moe_bincount(ctx, ids, 5, &o));
  EXPECT(o && o->dtype == MOE_I64 && o->ndim == 1 && o->shape[0] == 5);
  if (o) EXPECT_VALUES(o, 0, 2, 1, 0, 3, 0);
  moe_tensor_release(o);
  /* i32, non-contiguous (the transpose reads 3, 1, 0, 3, 3, 0) */
  moe_tensor *i32 = mk(ctx, MOE_I32, 2, SH(2, 3), VALS(3, 0, 3, 1, 3, 0)), *tr = NULL;
  EXPECT_OK(moe_transpose(ctx, i32, 0, 1, &tr));
  EXPECT_OK(moe_bincount(ctx, tr, 4, &o));
  if (o) EXPECT_VALUES(o, 0, 2, 1, 0, 3);
  moe_tensor_release(o);
  /* empty ids: zeros; zero bins with no ids: an empty result */
  moe_tensor *e = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, 2, SH(0, 2), MOE_I64, MOE_CPU, &e));
  EXPECT_OK(moe_bincount(ctx, e, 3, &o));
  if (o) EXPECT_VALUES(o, 0, 0, 0, 0);
  moe_tensor_release(o);
  EXPECT_OK(moe_bincount(ctx, e, 0, &o));
  EXPECT(o && o->shape[0] == 0);
  moe_tensor_release(o);
  /* every id in one bin (an untrained router) against a naive count */
  moe_tensor *many = NULL;
  EXPECT_OK(moe_tensor_full(ctx, 1, SH(1000), 2, MOE_I64, MOE_CPU, &many));
  EXPECT_OK(moe_bincount(ctx, many, 3, &o));
  if (o) EXPECT_VALUES(o, 0, 0, 0, 1000);
  moe_tensor_release(o);
  /* errors: out of range (value, position, range), bad dtype, negative E */
  o = NULL;
  EXPECT_ERR_MSG(moe_bincount(ctx, ids, 3, &o), MOE_ERR_INVALID_ARG,
                 "bincount: ids holds 3 at position 0, outside [0, 3)");
  EXPECT(o == NULL);
  moe_tensor *neg = mk(ctx, MOE_I64, 1, SH(3), VALS(0, 1, -1));
  EXPECT_ERR_MSG(moe_bincount(ctx, neg, 3, &o), MOE_ERR_INVALID_ARG,
                 "bincount: ids holds -1 at position 2, outside [0, 3)");
  EXPECT_ERR_MSG(moe_bincount(ctx, e, 0, NULL), MOE_ERR_INVALID_ARG, "bincount: out is NULL");
  moe_tensor *f = mk(ctx, MOE_F32, 1, SH(1), VALS(0));
  EXPECT_ERR_MSG(moe_bincount(ctx, f, 2, &o), MOE_ERR_DTYPE, "bincount: ids must be i64 or i32, got f32");
  EXPECT_ERR_MSG(moe_bincount(ctx, ids, -1, &o), MOE_ERR_INVALID_ARG,
                 "bincount: the number of bins must be >= 0, got -1");
  moe_tensor *ts[] = {ids, i32, tr, e, many, neg, f};
  for (size_t k = 0; k < sizeof ts / sizeof ts[0]; k++) moe_tensor_release(ts[k]);
}

/* moe_host_reads on the CPU: bincount (and one_hot, an op reading its ids on
 * the host) read nothing back; reading a tensor's values counts one copy and
 * one sync, as a GPU tensor's would. */
static void test_host_reads(moe_ctx *ctx) {
  int64_t c0 = -1, s0 = -1, c1 = -1, s1 = -1;
  moe_tensor *ids = mk(ctx, MOE_I64, 1, SH(4), VALS(0, 2, 2, 1)), *o = NULL, *h = NULL;
  moe_host_reads(ctx, &c0, &s0);
  EXPECT(c0 >= 0 && s0 >= c0);
  EXPECT_OK(moe_bincount(ctx, ids, 3, &o));
  EXPECT_OK(moe_one_hot(ctx, ids, 3, &h));
  moe_host_reads(ctx, &c1, &s1);
  EXPECT(c1 == c0 && s1 == s0);
  int64_t v[3] = {0};
  EXPECT_OK(moe_tensor_to_i64(ctx, o, v));
  EXPECT(v[0] == 1 && v[1] == 1 && v[2] == 2);
  moe_host_reads(ctx, &c1, NULL);
  moe_host_reads(ctx, NULL, &s1);
  EXPECT(c1 == c0 + 1 && s1 == s0 + 1);
  moe_host_reads(NULL, &c1, &s1);
  EXPECT(c1 == 0 && s1 == 0);
  moe_tensor_release(ids);
  moe_tensor_release(o);
  moe_tensor_release(h);
}

/* ------------------------------------------------------ sort, topk */

static moe_status f_sort(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  args *a = ud;
  moe_tensor *ix = NULL;
  moe_status st = a->k >= 0 ? moe_topk(ctx, in[0], a->k, a->dim, a->mode, out, &ix)
                            : moe_sort(ctx, in[0], a->dim, a->mode, out, &ix);
  moe_tensor_release(ix);
  return st;
}

static void test_sort(moe_ctx *ctx) {
  moe_tensor *x = mk(ctx, MOE_F32, 2, SH(2, 5), VALS(3, 1, 2, 1, NAN, 0, -1, 5, -1, 2));
  moe_tensor *v = NULL, *i = NULL;
  EXPECT_OK(moe_sort(ctx, x, 1, false, &v, &i));
  EXPECT_VALUES(v, 0, 1, 1, 2, 3, NAN, -1, -1, 0, 2, 5);
  EXPECT_VALUES(i, 0, 1, 3, 2, 0, 4, 1, 3, 0, 4, 2); /* stable: ties keep their order */
  EXPECT(i->dtype == MOE_I64);
  moe_tensor_release(v);
  moe_tensor_release(i);
  EXPECT_OK(moe_sort(ctx, x, -1, true, &v, &i));
  EXPECT_VALUES(v, 0, NAN, 3, 2, 1, 1, 5, 2, 0, -1, -1);
  EXPECT_VALUES(i, 0, 4, 0, 2, 1, 3, 2, 4, 0, 1, 3);
  moe_tensor_release(v);
  moe_tensor_release(i);
  EXPECT_OK(moe_argsort(ctx, x, 0, false, &i)); /* along dim 0 */
  EXPECT_VALUES(i, 0, 1, 1, 0, 1, 1, 0, 0, 1, 0, 0);
  moe_tensor_release(i);
  moe_tensor *xi = mk(ctx, MOE_I64, 1, SH(6), VALS(5, -3, 9000000000000000000.0, 0, -3, 7));
  EXPECT_OK(moe_sort(ctx, xi, 0, false, &v, &i));
  int64_t got[6];
  EXPECT_OK(moe_tensor_to_i64(ctx, v, got));
  EXPECT(got[0] == -3 && got[1] == -3 && got[2] == 0 && got[3] == 5 && got[4] == 7 &&
         got[5] == 9000000000000000000LL);
  EXPECT_VALUES(i, 0, 1, 4, 3, 0, 5, 2);
  moe_tensor_release(v);
  moe_tensor_release(i);
  /* topk */
  EXPECT_OK(moe_topk(ctx, x, 2, -1, true, &v, &i));
  EXPECT_VALUES(v, 0, NAN, 3, 5, 2);
  EXPECT_VALUES(i, 0, 4, 0, 2, 4);
  moe_tensor_release(v);
  moe_tensor_release(i);
  EXPECT_OK(moe_topk(ctx, x, 3, 1, false, &v, &i));
  EXPECT_VALUES(v, 0, 1, 1, 2, -1, -1, 0);
  EXPECT_VALUES(i, 0, 1, 3, 2, 1, 3, 0);
  moe_tensor_release(v);
  moe_tensor_release(i);
  EXPECT_OK(moe_topk(ctx, x, 0, 1, true, &v, &i));
  EXPECT(v->shape[1] == 0 && i->shape[1] == 0);
  moe_tensor_release(v);
  moe_tensor_release(i);
  EXPECT_ERR_MSG(moe_topk(ctx, x, 6, 1, true, &v, &i), MOE_ERR_INVALID_ARG, "outside [0, 5]");
  EXPECT_ERR_MSG(moe_topk(ctx, x, -1, 1, true, &v, &i), MOE_ERR_INVALID_ARG,
                 "topk: k = -1 is outside [0, 5] for x [2, 5] and dim 1");
  moe_tensor *b = mk(ctx, MOE_BOOL, 1, SH(2), VALS(1, 0));
  EXPECT_ERR_MSG(moe_sort(ctx, b, 0, false, &v, &i), MOE_ERR_DTYPE, "sort: bool tensors are not sorted");
  EXPECT_ERR_MSG(moe_sort(ctx, x, 3, false, &v, &i), MOE_ERR_INVALID_ARG, "sort: dim 3 is out of range");
  /* gradients through values */
  moe_tensor *xg = leaf(ctx, rnd(ctx, MOE_F64, 2, SH(3, 5)));
  args a = {NULL, 1, -1, 1};
  EXPECT(gradcheck(ctx, f_sort, 1, &xg, &a, 1e-6, 1e-6));
  a.dim = 0;
  a.mode = 0;
  EXPECT(gradcheck(ctx, f_sort, 1, &xg, &a, 1e-6, 1e-6));
  moe_tensor *xt = tleaf(ctx, 2, SH(5, 3)); /* (3, 5) */
  a.dim = -1;
  a.k = 2;
  a.mode = 1;
  EXPECT(gradcheck(ctx, f_sort, 1, &xt, &a, 1e-6, 1e-6));
  a.dim = 0;
  a.k = 1;
  a.mode = 0;
  EXPECT(gradcheck(ctx, f_sort, 1, &xt, &a, 1e-6, 1e-6));
  /* topk on the contiguous input, sort on the transposed one */
  args c = {NULL, -1, 2, 1};
  EXPECT(gradcheck(ctx, f_sort, 1, &xg, &c, 1e-6, 1e-6));
  c.dim = 1;
  c.k = -1;
  c.mode = 0;
  EXPECT(gradcheck(ctx, f_sort, 1, &xt, &c, 1e-6, 1e-6));
  moe_tensor *ts[] = {x, xi, b, xg, xt};
  for (size_t k = 0; k < sizeof ts / sizeof ts[0]; k++) moe_tensor_release(ts[k]);
}

/* --------------------------------------------- cat, stack, split */

static moe_status f_cat(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  args *a = ud;
  return a->mode ? moe_stack(ctx, (int)a->k, in, a->dim, out) : moe_cat(ctx, (int)a->k, in, a->dim, out);
}

/* the second piece of split(x, 2, dim), times 1 (a view of a view) */
static moe_status f_split(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  args *a = ud;
  moe_tensor *p[8] = {0};
  int n = 0;
  moe_status st = a->mode ? moe_chunk(ctx, in[0], a->k, a->dim, 8, p, &n)
                          : moe_split(ctx, in[0], a->k, a->dim, 8, p, &n);
  if (st != MOE_OK) return st;
  *out = p[1];
  for (int i = 0; i < n; i++)
    if (i != 1) moe_tensor_release(p[i]);
  return MOE_OK;
}

static void test_join(moe_ctx *ctx) {
  moe_tensor *a = mk(ctx, MOE_F32, 2, SH(2, 2), VALS(1, 2, 3, 4));
  moe_tensor *b = mk(ctx, MOE_F32, 2, SH(2, 1), VALS(5, 6));
  moe_tensor *o = NULL;
  EXPECT_OK(moe_cat(ctx, 2, (moe_tensor *[]){a, b}, 1, &o));
  EXPECT(o->shape[0] == 2 && o->shape[1] == 3);
  EXPECT_VALUES(o, 0, 1, 2, 5, 3, 4, 6);
  moe_tensor_release(o);
  EXPECT_ERR_MSG(moe_cat(ctx, 2, (moe_tensor *[]){a, b}, 0, &o), MOE_ERR_SHAPE, "outside dim 0");
  EXPECT_OK(moe_stack(ctx, 2, (moe_tensor *[]){a, a}, 1, &o));
  EXPECT(o->ndim == 3 && o->shape[1] == 2);
  EXPECT_VALUES(o, 0, 1, 2, 1, 2, 3, 4, 3, 4);
  moe_tensor_release(o);
  EXPECT_OK(moe_stack(ctx, 2, (moe_tensor *[]){a, a}, -1, &o));
  EXPECT(o->ndim == 3 && o->shape[2] == 2);
  EXPECT_VALUES(o, 0, 1, 1, 2, 2, 3, 3, 4, 4);
  moe_tensor_release(o);
  EXPECT_ERR_MSG(moe_stack(ctx, 2, (moe_tensor *[]){a, b}, 0, &o), MOE_ERR_SHAPE, "differ in shape");
  moe_tensor *c = mk(ctx, MOE_F64, 2, SH(2, 1), VALS(5, 6));
  EXPECT_ERR_MSG(moe_cat(ctx, 2, (moe_tensor *[]){a, c}, 1, &o), MOE_ERR_DTYPE, "tensor 1 is f64");
  EXPECT_ERR_MSG(moe_cat(ctx, 0, (moe_tensor *[]){a}, 0, &o), MOE_ERR_INVALID_ARG,
                 "cat: needs at least one tensor, got 0");
  EXPECT_ERR_MSG(moe_cat(ctx, 2, (moe_tensor *[]){a, a}, 2, &o), MOE_ERR_INVALID_ARG, "cat: dim 2 is out of range");
  EXPECT_ERR_MSG(moe_stack(ctx, 2, (moe_tensor *[]){a, a}, 3, &o), MOE_ERR_INVALID_ARG,
                 "stack: dim 3 is out of range for a tensor of 2 dims (expected -3 to 2)");
  /* split and chunk */
  moe_tensor *x = mk(ctx, MOE_F32, 2, SH(5, 2), VALS(0, 1, 2, 3, 4, 5, 6, 7, 8, 9));
  moe_tensor *p[8] = {0};
  int n = 0;
  EXPECT_OK(moe_split(ctx, x, 2, 0, 8, p, &n));
  EXPECT(n == 3 && p[2]->shape[0] == 1);
  EXPECT_VALUES(p[1], 0, 4, 5, 6, 7);
  EXPECT_VALUES(p[2], 0, 8, 9);
  for (int i = 0; i < n; i++) moe_tensor_release(p[i]);
  EXPECT_OK(moe_chunk(ctx, x, 3, 0, 8, p, &n)); /* ceil(5/3) = 2: sizes 2, 2, 1 */
  EXPECT(n == 3 && p[0]->shape[0] == 2 && p[2]->shape[0] == 1);
  for (int i = 0; i < n; i++) moe_tensor_release(p[i]);
  EXPECT_OK(moe_chunk(ctx, x, 4, 0, 8, p, &n)); /* size 2: only 3 pieces, as PyTorch */
  EXPECT(n == 3);
  for (int i = 0; i < n; i++) moe_tensor_release(p[i]);
  EXPECT_OK(moe_split_sizes(ctx, x, 2, SH(1, 4), 0, p));
  EXPECT_VALUES(p[0], 0, 0, 1);
  EXPECT(p[1]->shape[0] == 4);
  moe_tensor_release(p[0]);
  moe_tensor_release(p[1]);
  int cnt = 0;
  EXPECT_OK(moe_split_count(ctx, x, 1, 0, &cnt));
  EXPECT(cnt == 5);
  EXPECT_OK(moe_chunk_count(ctx, x, 2, 1, &cnt));
  EXPECT(cnt == 2);
  EXPECT_ERR_MSG(moe_split(ctx, x, 1, 0, 4, p, &n), MOE_ERR_INVALID_ARG, "room for 4");
  EXPECT_ERR_MSG(moe_split_sizes(ctx, x, 2, SH(1, 3), 0, p), MOE_ERR_SHAPE, "sum to 4");
  EXPECT_ERR_MSG(moe_split(ctx, x, 0, 0, 8, p, &n), MOE_ERR_INVALID_ARG, "split: split_size must be >= 1, got 0");
  EXPECT_ERR_MSG(moe_split(ctx, x, 1, 2, 8, p, &n), MOE_ERR_INVALID_ARG, "split: dim 2 is out of range");
  EXPECT_ERR_MSG(moe_chunk(ctx, x, 0, 0, 8, p, &n), MOE_ERR_INVALID_ARG, "chunk: chunks must be >= 1, got 0");
  /* gradients: cat of 3 (one non-contiguous), stack, 10 inputs (grouped nodes) */
  moe_tensor *g1 = leaf(ctx, rnd(ctx, MOE_F64, 2, SH(2, 3)));
  moe_tensor *g2 = tleaf(ctx, 2, SH(3, 2)); /* (2, 3) */
  moe_tensor *g3 = leaf(ctx, rnd(ctx, MOE_F64, 2, SH(2, 3)));
  moe_tensor *in3[3] = {g1, g2, g3};
  args ac = {NULL, 0, 3, 0};
  EXPECT(gradcheck(ctx, f_cat, 3, in3, &ac, 1e-6, 1e-6));
  ac.dim = 1;
  EXPECT(gradcheck(ctx, f_cat, 3, in3, &ac, 1e-6, 1e-6));
  ac.mode = 1;
  EXPECT(gradcheck(ctx, f_cat, 3, in3, &ac, 1e-6, 1e-6));
  ac.dim = 2;
  EXPECT(gradcheck(ctx, f_cat, 3, in3, &ac, 1e-6, 1e-6));
  moe_tensor *many[10];
  for (int i = 0; i < 10; i++) many[i] = leaf(ctx, rnd(ctx, MOE_F64, 1, SH(2)));
  args am = {NULL, 0, 10, 0};
  EXPECT(gradcheck(ctx, f_cat, 10, many, &am, 1e-6, 1e-6));
  am.mode = 1;
  am.dim = 1;
  EXPECT(gradcheck(ctx, f_cat, 10, many, &am, 1e-6, 1e-6));
  moe_tensor *xs = tleaf(ctx, 2, SH(3, 5)); /* (5, 3) */
  args as = {NULL, 0, 2, 0};
  EXPECT(gradcheck(ctx, f_split, 1, &xs, &as, 1e-6, 1e-6));
  as.mode = 1;
  as.dim = 1;
  EXPECT(gradcheck(ctx, f_split, 1, &xs, &as, 1e-6, 1e-6));
  moe_tensor *xsc = leaf(ctx, rnd(ctx, MOE_F64, 2, SH(5, 3))); /* contiguous */
  EXPECT(gradcheck(ctx, f_split, 1, &xsc, &as, 1e-6, 1e-6));
  as.mode = 0;
  as.dim = 0;
  EXPECT(gradcheck(ctx, f_split, 1, &xsc, &as, 1e-6, 1e-6));
  moe_tensor *ts[] = {a, b, c, x, g1, g2, g3, xs, xsc};
  for (size_t k = 0; k < sizeof ts / sizeof ts[0]; k++) moe_tensor_release(ts[k]);
  for (int i = 0; i < 10; i++) moe_tensor_release(many[i]);
}

/* ------------------------------------------------------------- rope */

static moe_status f_rope(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
  args *a = ud;
  moe_tensor **cs = (moe_tensor **)a->index;
  return moe_rope(ctx, in[0], cs[0], cs[1], (moe_rope_layout)a->mode, out);
}

static void test_rope(moe_ctx *ctx) {
  /* (B, T, H, D) = (1, 3, 2, 4): naive reference in double */
  int64_t B = 1, T = 3, H = 2, D = 4, h = 2;
  moe_tensor *x = rnd(ctx, MOE_F64, 4, SH(B, T, H, D));
  moe_tensor *c = NULL, *s = NULL, *o = NULL;
  EXPECT_OK(moe_rope_cache(ctx, T, D, 10000, MOE_F64, MOE_CPU, &c, &s));
  EXPECT(c->shape[0] == T && c->shape[1] == h);
  double cv[6], sv[6], xv[24], want[24];
  EXPECT_OK(moe_tensor_to_f64(ctx, c, cv));
  EXPECT_OK(moe_tensor_to_f64(ctx, s, sv));
  EXPECT_NEAR(cv[1 * h + 1], cos(1.0 * pow(10000, -0.5)), 1e-15); /* t = 1, j = 1 */
  EXPECT_NEAR(sv[2 * h + 0], sin(2.0), 1e-15);
  EXPECT_OK(moe_tensor_to_f64(ctx, x, xv));
  for (int64_t t = 0; t < T; t++)
    for (int64_t hh = 0; hh < H; hh++)
      for (int64_t j = 0; j < h; j++) {
        int64_t base = (t * H + hh) * D;
        double a = xv[base + j], b = xv[base + j + h], cc = cv[t * h + j], ss = sv[t * h + j];
        want[base + j] = a * cc - b * ss;
        want[base + j + h] = b * cc + a * ss;
      }
  EXPECT_OK(moe_rope(ctx, x, c, s, MOE_ROPE_BTHD, &o));
  double got[24];
  EXPECT_OK(moe_tensor_to_f64(ctx, o, got));
  double err = 0;
  for (int i = 0; i < 24; i++) err = fmax(err, fabs(got[i] - want[i]));
  EXPECT(err < 1e-15);
  moe_tensor_release(o);
  /* BHTD on the permuted input gives the permuted output */
  moe_tensor *xp = NULL, *op = NULL, *opp = NULL;
  EXPECT_OK(moe_permute(ctx, x, 4, SH(0, 2, 1, 3), &xp));
  EXPECT_OK(moe_rope(ctx, xp, c, s, MOE_ROPE_BHTD, &op));
  EXPECT_OK(moe_permute(ctx, op, 4, SH(0, 2, 1, 3), &opp));
  EXPECT(harness_values(opp, want, 24, 1e-15, __FILE__, __LINE__));
  moe_tensor_release(op);
  moe_tensor_release(opp);
  /* (T, D) tables with duplicated halves give the same */
  moe_tensor *cf = NULL, *sf = NULL;
  EXPECT_OK(moe_cat(ctx, 2, (moe_tensor *[]){c, c}, 1, &cf));
  EXPECT_OK(moe_cat(ctx, 2, (moe_tensor *[]){s, s}, 1, &sf));
  EXPECT_OK(moe_rope(ctx, x, cf, sf, MOE_ROPE_BTHD, &o));
  EXPECT(harness_values(o, want, 24, 1e-15, __FILE__, __LINE__));
  moe_tensor_release(o);
  /* f32 agrees within f32 rounding */
  moe_tensor *x32 = NULL, *c32 = NULL, *s32 = NULL;
  EXPECT_OK(moe_to(ctx, x, MOE_F32, MOE_CPU, &x32));
  EXPECT_OK(moe_rope_cache(ctx, T, D, 10000, MOE_F32, MOE_CPU, &c32, &s32));
  EXPECT_OK(moe_rope(ctx, x32, c32, s32, MOE_ROPE_BTHD, &o));
  EXPECT(harness_values(o, want, 24, 1e-6, __FILE__, __LINE__)); /* |x| < 1: a few f32 ulps */
  moe_tensor_release(o);
  /* errors */
  moe_tensor *x3 = rnd(ctx, MOE_F64, 3, SH(3, 2, 4));
  EXPECT_ERR_MSG(moe_rope(ctx, x3, c, s, MOE_ROPE_BTHD, &o), MOE_ERR_SHAPE, "4-D");
  EXPECT_ERR_MSG(moe_rope(ctx, x, c, s, MOE_ROPE_BHTD, &o), MOE_ERR_SHAPE, "(T, D/2)");
  EXPECT_ERR_MSG(moe_rope(ctx, x32, c, s, MOE_ROPE_BTHD, &o), MOE_ERR_DTYPE, "rope: cos is f64 but x is f32");
  EXPECT_ERR_MSG(moe_rope(ctx, x, c, s, (moe_rope_layout)7, &o), MOE_ERR_INVALID_ARG,
                 "rope: unknown layout 7 (BTHD or BHTD)");
  EXPECT_ERR_MSG(moe_rope_cache(ctx, 3, 5, 10000, MOE_F32, MOE_CPU, &c32, &s32), MOE_ERR_INVALID_ARG,
                 "rope_cache: T must be >= 0 and D even and > 0, got T = 3, D = 5");
  EXPECT_ERR_MSG(moe_rope_cache(ctx, 3, 4, 10000, MOE_I64, MOE_CPU, &c32, &s32), MOE_ERR_DTYPE,
                 "rope_cache: dtype must be a float dtype, got i64");
  moe_tensor *cg = leaf(ctx, rnd(ctx, MOE_F64, 2, SH(T, h)));
  EXPECT_ERR_MSG(moe_rope(ctx, x, cg, s, MOE_ROPE_BTHD, &o), MOE_ERR_NOT_SUPPORTED, "constants");
  /* gradients: contiguous and a non-contiguous (B, H, T, D) view */
  moe_tensor *cs[2] = {c, s};
  args a = {(moe_tensor *)cs, 0, 0, MOE_ROPE_BTHD};
  moe_tensor *xg = leaf(ctx, rnd(ctx, MOE_F64, 4, SH(2, 3, 2, 4)));
  EXPECT(gradcheck(ctx, f_rope, 1, &xg, &a, 1e-6, 1e-6));
  moe_tensor *base = rnd(ctx, MOE_F64, 4, SH(2, 3, 2, 4)), *xv2 = NULL;
  EXPECT_OK(moe_transpose(ctx, base, 1, 2, &xv2)); /* (2, 2, 3, 4) BHTD, non-contiguous */
  leaf(ctx, xv2);
  a.mode = MOE_ROPE_BHTD;
  EXPECT(gradcheck(ctx, f_rope, 1, &xv2, &a, 1e-6, 1e-6));
  moe_tensor *cfs[2] = {cf, sf};
  a.index = (moe_tensor *)cfs;
  EXPECT(gradcheck(ctx, f_rope, 1, &xv2, &a, 1e-6, 1e-6));
  moe_tensor *ts[] = {x, c, s, xp, cf, sf, x32, c32, s32, x3, cg, xg, base, xv2};
  for (size_t k = 0; k < sizeof ts / sizeof ts[0]; k++) moe_tensor_release(ts[k]);
}

/* ------------------------------------------------------- multinomial */

static void test_multinomial(moe_ctx *ctx) {
  moe_tensor *p = mk(ctx, MOE_F32, 2, SH(2, 4), VALS(0, 1, 0, 3, 5, 0, 0, 0));
  moe_tensor *o = NULL, *o2 = NULL;
  moe_rng_seed(ctx, 7);
  EXPECT_OK(moe_multinomial(ctx, p, 4000, true, &o));
  EXPECT(o->dtype == MOE_I64 && o->shape[0] == 2 && o->shape[1] == 4000);
  int64_t *v = malloc(sizeof(int64_t) * 8000);
  EXPECT_OK(moe_tensor_to_i64(ctx, o, v));
  int64_t c1 = 0, c3 = 0, bad = 0;
  for (int i = 0; i < 4000; i++) {
    c1 += v[i] == 1;
    c3 += v[i] == 3;
    bad += v[i] == 0 || v[i] == 2 || v[4000 + i] != 0;
  }
  EXPECT(bad == 0);
  EXPECT(c1 + c3 == 4000);
  /* P(1) = 1/4: mean 1000, sd 27; 6 sd bounds */
  EXPECT(c1 > 1000 - 165 && c1 < 1000 + 165);
  /* the same seed gives the same samples; the call counter moves on */
  moe_rng_seed(ctx, 7);
  EXPECT_OK(moe_multinomial(ctx, p, 4000, true, &o2));
  int64_t *w = malloc(sizeof(int64_t) * 8000);
  EXPECT_OK(moe_tensor_to_i64(ctx, o2, w));
  EXPECT(memcmp(v, w, sizeof(int64_t) * 8000) == 0);
  moe_tensor_release(o2);
  EXPECT_OK(moe_multinomial(ctx, p, 4000, true, &o2));
  EXPECT_OK(moe_tensor_to_i64(ctx, o2, w));
  EXPECT(memcmp(v, w, sizeof(int64_t) * 8000) != 0);
  moe_tensor_release(o2);
  moe_tensor_release(o);
  free(v);
  free(w);
  /* without replacement: a permutation of the non-zero categories */
  moe_tensor *q = mk(ctx, MOE_F64, 1, SH(6), VALS(1, 2, 0, 3, 4, 5));
  EXPECT_OK(moe_multinomial(ctx, q, 5, false, &o));
  int64_t s[5], seen[6] = {0};
  EXPECT_OK(moe_tensor_to_i64(ctx, o, s));
  for (int i = 0; i < 5; i++) seen[s[i] >= 0 && s[i] < 6 ? s[i] : 2]++;
  EXPECT(seen[0] == 1 && seen[1] == 1 && seen[2] == 0 && seen[3] == 1 && seen[4] == 1 && seen[5] == 1);
  moe_tensor_release(o);
  /* a large row (many chunks) still draws only where the weight is */
  double big[1000];
  for (int i = 0; i < 1000; i++) big[i] = i % 97 == 5 ? 1.0 : 0.0;
  moe_tensor *pb = mk(ctx, MOE_BF16, 1, SH(1000), big);
  EXPECT_OK(moe_multinomial(ctx, pb, 64, true, &o));
  int64_t sb[64];
  EXPECT_OK(moe_tensor_to_i64(ctx, o, sb));
  int okb = 1;
  for (int i = 0; i < 64; i++) okb = okb && sb[i] % 97 == 5;
  EXPECT(okb);
  moe_tensor_release(o);
  /* errors */
  EXPECT_ERR_MSG(moe_multinomial(ctx, q, 6, false, &o), MOE_ERR_INVALID_ARG, "fewer than num_samples");
  EXPECT_ERR_MSG(moe_multinomial(ctx, q, 7, false, &o), MOE_ERR_INVALID_ARG, "num_samples = 7");
  moe_tensor *neg = mk(ctx, MOE_F32, 1, SH(2), VALS(1, -1));
  EXPECT_ERR_MSG(moe_multinomial(ctx, neg, 1, true, &o), MOE_ERR_INVALID_ARG, ">= 0");
  moe_tensor *z = mk(ctx, MOE_F32, 1, SH(2), VALS(0, 0));
  EXPECT_ERR_MSG(moe_multinomial(ctx, z, 1, true, &o), MOE_ERR_INVALID_ARG, "fewer than one");
  moe_tensor *ip = mk(ctx, MOE_I64, 1, SH(2), VALS(1, 1));
  EXPECT_ERR_MSG(moe_multinomial(ctx, ip, 1, true, &o), MOE_ERR_DTYPE,
                 "multinomial: probs must be f32, f64, bf16 or f16, got i64");
  moe_tensor *p3 = rnd(ctx, MOE_F32, 3, SH(1, 1, 2));
  EXPECT_ERR_MSG(moe_multinomial(ctx, p3, 1, true, &o), MOE_ERR_SHAPE,
                 "multinomial: probs must be (N, C) or (C) with C >= 1, got [1, 1, 2]");
  moe_tensor *ts[] = {p, q, pb, neg, z, ip, p3};
  for (size_t k = 0; k < sizeof ts / sizeof ts[0]; k++) moe_tensor_release(ts[k]);
}

int main(void) {
  RUN(test_gather);
  RUN(test_scatter);
  RUN(test_index_select_add);
  RUN(test_index_add_windows);
  RUN(test_index_add_users);
  RUN(test_embedding);
  RUN(test_one_hot);
  RUN(test_bincount);
  RUN(test_host_reads);
  RUN(test_sort);
  RUN(test_join);
  RUN(test_rope);
  RUN(test_multinomial);
  return harness_end();
}
