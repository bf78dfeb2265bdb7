/*
 * test_cuda_vs_cpu.c - every CUDA kernel of the core against the CPU
 * reference: the same calls run on cpu and on cuda:0 and the results are
 * compared element by element. Needs a GPU; skips (exit 77) without one.
 *
 * Tolerances, chosen per op and dtype:
 *   copies, fills, arange, linspace, uniform, randint, +-*÷ and neg:
 *     bit-exact (NaN matches NaN of any payload: x86 and CUDA make different
 *     default NaNs). The kernels use the same conversions as core/dtype.c and
 *     __fadd_rn/__fmul_rn/__fdiv_rn (and the double ones), which round like
 *     the CPU's IEEE operations built with -ffp-contract=off.
 *   normal: |gpu - cpu| <= rel * (|cpu| + std), rel = 1e-6 for f32, 1e-12 for
 *     f64, 2^-7 for bf16/f16. Box-Muller goes through log, sin and cos, whose
 *     CUDA double versions differ from libm by an ulp or two (~1e-16
 *     relative); rounding to f32 can then flip its last bit (6e-8), to bf16
 *     its last bit (2^-8). The std term covers mean + std * n near zero.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

#define GPU ((moe_device){MOE_DEVICE_CUDA, 0})
#define NDT MOE_DTYPE_COUNT

static const moe_dtype all_dtypes[NDT] = {MOE_F32, MOE_F64, MOE_BF16, MOE_F16, MOE_I8,
                                          MOE_U8,  MOE_I32, MOE_I64,  MOE_BOOL};

/* ---------------------------------------------------------------- helpers */

static uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/* Values that probe conversions: rounding ties, saturation, inf, NaN, -0,
 * f16 subnormals, f32 overflow. */
static const double special[] = {0.0,    -0.0,   1.0,     -1.0,   0.5,      2.5,     -2.5,
                                 255.5,  256.0,  -129.5,  300.7,  -1e10,    1e20,    65504.0,
                                 65520.0, 1e-30, -3e-8,   INFINITY, -INFINITY, NAN,  3.4e38,
                                 1e300,  127.49, -128.51, 1.00390625, 3.0000001};
#define NSPECIAL ((int64_t)(sizeof(special) / sizeof(special[0])))

/* Element i of a test tensor of dtype dt (with_special: the first elements
 * of float tensors are the special values). */
static double test_value(moe_dtype dt, uint64_t seed, int64_t i, bool with_special) {
  uint64_t r = splitmix64(seed * 0x100000001B3ull + (uint64_t)i);
  switch (dt) {
    case MOE_F32: case MOE_F64: case MOE_BF16: case MOE_F16:
      if (with_special && i < NSPECIAL) return special[i];
      return ((double)(r % 200001) - 100000.0) / 64.0; /* exact in f32 */
    case MOE_I8: return (double)(int64_t)(r % 256) - 128.0;
    case MOE_U8: return (double)(r % 256);
    case MOE_I32: return (double)(int32_t)(uint32_t)r;
    case MOE_I64: return (double)((int64_t)(r >> 12) - (INT64_C(1) << 51));
    default: return (double)(r & 1);
  }
}

static moe_status make_values(moe_ctx *ctx, int ndim, const int64_t *shape, moe_dtype dt,
                              moe_device d, uint64_t seed, bool with_special, moe_tensor **out) {
  int64_t n = 1;
  for (int k = 0; k < ndim; k++) n *= shape[k];
  double *v = malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
  if (!v) return MOE_ERR_OUT_OF_MEMORY;
  for (int64_t i = 0; i < n; i++) v[i] = test_value(dt, seed, i, with_special);
  moe_status st = moe_tensor_from_f64(ctx, v, ndim, shape, dt, d, out);
  free(v);
  return st;
}

/*
 * Compares got (any device) with want (cpu): same shape and dtype, then the
 * values. rel < 0: exact (floats compared as doubles, which is exact for
 * every dtype, with the sign of zero; NaN matches NaN; integers as int64).
 * rel >= 0: |got - want| <= rel * (|want| + scale). Prints the first miss.
 */
static bool compare(moe_ctx *ctx, const moe_tensor *want, const moe_tensor *got, double rel,
                    double scale, const char *what) {
  if (!want || !got) {
    fprintf(stderr, "  %s: missing result (%s)\n", what, moe_ctx_error(ctx));
    return false;
  }
  bool ok = want->dtype == got->dtype && want->ndim == got->ndim;
  for (int d = 0; ok && d < want->ndim; d++) ok = want->shape[d] == got->shape[d];
  if (!ok) {
    fprintf(stderr, "  %s: dtype/shape differ (%s vs %s)\n", what, moe_dtype_name(got->dtype),
            moe_dtype_name(want->dtype));
    return false;
  }
  int64_t n = moe_tensor_numel(want);
  if (n == 0) return true;
  bool isf = moe_dtype_is_float(want->dtype);
  double *wf = NULL, *gf = NULL;
  int64_t *wi = NULL, *gi = NULL;
  if (isf) {
    wf = malloc((size_t)n * sizeof(double));
    gf = malloc((size_t)n * sizeof(double));
    ok = wf && gf && moe_tensor_to_f64(ctx, want, wf) == MOE_OK &&
         moe_tensor_to_f64(ctx, got, gf) == MOE_OK;
  } else {
    wi = malloc((size_t)n * sizeof(int64_t));
    gi = malloc((size_t)n * sizeof(int64_t));
    ok = wi && gi && moe_tensor_to_i64(ctx, want, wi) == MOE_OK &&
         moe_tensor_to_i64(ctx, got, gi) == MOE_OK;
  }
  if (!ok) fprintf(stderr, "  %s: reading values failed: %s\n", what, moe_ctx_error(ctx));
  for (int64_t i = 0; ok && i < n; i++) {
    if (isf) {
      double w = wf[i], g = gf[i];
      bool same;
      if (isnan(w) || isnan(g))
        same = isnan(w) && isnan(g);
      else if (rel < 0)
        same = w == g && signbit(w) == signbit(g);
      else
        same = w == g || fabs(g - w) <= rel * (fabs(w) + scale);
      if (!same) {
        fprintf(stderr, "  %s (%s): element %lld is %.17g on the GPU, %.17g on the CPU\n", what,
                moe_dtype_name(want->dtype), (long long)i, g, w);
        ok = false;
      }
    } else if (wi[i] != gi[i]) {
      fprintf(stderr, "  %s (%s): element %lld is %lld on the GPU, %lld on the CPU\n", what,
              moe_dtype_name(want->dtype), (long long)i, (long long)gi[i], (long long)wi[i]);
      ok = false;
    }
  }
  free(wf);
  free(gf);
  free(wi);
  free(gi);
  return ok;
}

#define EXPECT_SAME(ctx, want, got, what) EXPECT(compare((ctx), (want), (got), -1.0, 0.0, (what)))

/* A scenario builds its result on device d from dtypes a and b. */
typedef moe_status (*scenario_fn)(moe_ctx *ctx, moe_device d, moe_dtype a, moe_dtype b,
                                  moe_tensor **out);

#define TRY(call)                   \
  do {                              \
    st = (call);                    \
    if (st != MOE_OK) goto done;    \
  } while (0)

/* Runs sc on the CPU and on the GPU and compares (rel as in compare). */
static bool run_both(moe_ctx *ctx, scenario_fn sc, moe_dtype a, moe_dtype b, double rel,
                     double scale, const char *name) {
  moe_tensor *want = NULL, *got = NULL;
  char what[160];
  snprintf(what, sizeof(what), "%s [%s, %s]", name, moe_dtype_name(a), moe_dtype_name(b));
  moe_status s1 = sc(ctx, MOE_CPU, a, b, &want);
  if (s1 != MOE_OK) {
    fprintf(stderr, "  %s on cpu: %s: %s\n", what, moe_status_name(s1), moe_ctx_error(ctx));
    return false;
  }
  moe_status s2 = sc(ctx, GPU, a, b, &got);
  if (s2 != MOE_OK) {
    fprintf(stderr, "  %s on cuda: %s: %s\n", what, moe_status_name(s2), moe_ctx_error(ctx));
    moe_tensor_release(want);
    return false;
  }
  bool ok = compare(ctx, want, got, rel, scale, what);
  moe_tensor_release(want);
  moe_tensor_release(got);
  return ok;
}

/* ---------------------------------------------------------------- queries */

static void test_device_facts(moe_ctx *ctx) {
  char name[256];
  int cc = 0;
  size_t mem = 0;
  EXPECT(moe_cuda_built());
  EXPECT(moe_cuda_device_count(ctx) >= 1);
  EXPECT_OK(moe_cuda_device_info(ctx, 0, name, sizeof(name), &cc, &mem));
  EXPECT(cc >= 70 && mem > 0 && name[0]);
  int rt, drv, cublas, nccl;
  moe_cuda_versions(&rt, &drv, &cublas, &nccl);
  EXPECT(rt >= 12000 && drv >= rt / 1000 * 1000 && cublas >= 120000 && nccl >= 21800);
  printf("  cuda:0 %s, cc %d, %.1f GiB; runtime %d, driver %d, cuBLAS %d, NCCL %d\n", name, cc,
         (double)mem / (1 << 30), rt, drv, cublas, nccl);
  EXPECT_OK(moe_cuda_synchronize(ctx, GPU));
  EXPECT_OK(moe_cuda_synchronize(ctx, MOE_CPU));
}

/* ------------------------------------------------------------------ copies */

/* Every dtype pair: the CPU's conversion against the GPU's, on the three
 * paths a conversion can take (on the GPU, while going up, while coming
 * down) and from a misaligned view (the non-vector kernel). */
static void check_pairs(moe_ctx *ctx, moe_tensor *x, const char *label) {
  moe_tensor *xg = NULL, *xo = NULL, *xgo = NULL;
  int64_t n = x->shape[0];
  EXPECT_OK(moe_to(ctx, x, x->dtype, GPU, &xg));
  EXPECT_OK(moe_narrow(ctx, x, 0, 1, n - 1, &xo));
  if (xg) EXPECT_OK(moe_narrow(ctx, xg, 0, 1, n - 1, &xgo));
  for (int k = 0; k < NDT && xg && xo && xgo; k++) {
    moe_dtype dst = all_dtypes[k];
    moe_tensor *want = NULL, *wanto = NULL, *g1 = NULL, *g2 = NULL, *g3 = NULL, *g4 = NULL;
    char what[96];
    EXPECT_OK(moe_to(ctx, x, dst, MOE_CPU, &want));
    EXPECT_OK(moe_to(ctx, xo, dst, MOE_CPU, &wanto));
    EXPECT_OK(moe_to(ctx, xg, dst, GPU, &g1)); /* converted on the GPU */
    EXPECT_OK(moe_to(ctx, x, dst, GPU, &g2));  /* up, then converted */
    EXPECT_OK(moe_to(ctx, xg, dst, MOE_CPU, &g3)); /* converted, then down */
    EXPECT_OK(moe_to(ctx, xgo, dst, GPU, &g4));    /* misaligned source */
    snprintf(what, sizeof(what), "%s %s->%s on gpu", label, moe_dtype_name(x->dtype),
             moe_dtype_name(dst));
    EXPECT_SAME(ctx, want, g1, what);
    snprintf(what, sizeof(what), "%s %s->%s going up", label, moe_dtype_name(x->dtype),
             moe_dtype_name(dst));
    EXPECT_SAME(ctx, want, g2, what);
    snprintf(what, sizeof(what), "%s %s->%s coming down", label, moe_dtype_name(x->dtype),
             moe_dtype_name(dst));
    EXPECT_SAME(ctx, want, g3, what);
    snprintf(what, sizeof(what), "%s %s->%s misaligned", label, moe_dtype_name(x->dtype),
             moe_dtype_name(dst));
    EXPECT_SAME(ctx, wanto, g4, what);
    moe_tensor_release(want);
    moe_tensor_release(wanto);
    moe_tensor_release(g1);
    moe_tensor_release(g2);
    moe_tensor_release(g3);
    moe_tensor_release(g4);
  }
  moe_tensor_release(xgo);
  moe_tensor_release(xo);
  moe_tensor_release(xg);
}

static void test_copy_dtype_pairs(moe_ctx *ctx) {
  const int64_t sizes[] = {1023, 65537 + 2};
  for (int s = 0; s < 2; s++) {
    for (int k = 0; k < NDT; k++) {
      moe_tensor *x = NULL;
      EXPECT_OK(make_values(ctx, 1, &sizes[s], all_dtypes[k], MOE_CPU, 11 + k, true, &x));
      if (x) check_pairs(ctx, x, s ? "65539" : "1023");
      moe_tensor_release(x);
    }
  }
  /* int64 beyond 2^53: exact between integer dtypes, rounded once to floats */
  moe_tensor *big = NULL;
  int64_t n = 1023;
  EXPECT_OK(moe_tensor_empty(ctx, 1, &n, MOE_I64, MOE_CPU, &big));
  if (big) {
    moe_rng_seed(ctx, 99);
    EXPECT_OK(moe_randint_(ctx, big, -(INT64_C(1) << 62), INT64_C(1) << 62));
    check_pairs(ctx, big, "big i64");
  }
  moe_tensor_release(big);
}

/* dst^T = src: a transposed (non-contiguous) destination. */
static moe_status sc_copy_transposed_dst(moe_ctx *ctx, moe_device d, moe_dtype dt, moe_dtype sdt,
                                         moe_tensor **out) {
  moe_tensor *dst = NULL, *dstt = NULL, *src = NULL;
  moe_status st;
  int64_t shape[2] = {5, 7}, tshape[2] = {7, 5};
  TRY(moe_tensor_full(ctx, 2, shape, 0, dt, d, &dst));
  TRY(moe_transpose(ctx, dst, 0, 1, &dstt));
  TRY(make_values(ctx, 2, tshape, sdt, d, 3, true, &src));
  TRY(moe_copy_(ctx, dstt, src));
  *out = dst;
  dst = NULL;
done:
  moe_tensor_release(dst);
  moe_tensor_release(dstt);
  moe_tensor_release(src);
  return st;
}

/* A row [7] and a column [5, 1] broadcast into [5, 7] (stride-0 sources),
 * then a 0-dim scalar broadcast into [4, 1, 6]. */
static moe_status sc_copy_broadcast(moe_ctx *ctx, moe_device d, moe_dtype dt, moe_dtype sdt,
                                    moe_tensor **out) {
  moe_tensor *dst = NULL, *row = NULL, *col = NULL, *top = NULL, *bottom = NULL, *sc = NULL,
             *cube = NULL, *cubev = NULL;
  moe_status st;
  int64_t shape[2] = {10, 7}, rshape[1] = {7}, cshape[2] = {5, 1}, kshape[3] = {4, 1, 6},
          flat[2] = {4, 6};
  TRY(moe_tensor_empty(ctx, 2, shape, dt, d, &dst));
  TRY(moe_narrow(ctx, dst, 0, 0, 5, &top));
  TRY(moe_narrow(ctx, dst, 0, 5, 5, &bottom));
  TRY(make_values(ctx, 1, rshape, sdt, d, 4, true, &row));
  TRY(make_values(ctx, 2, cshape, sdt, d, 5, true, &col));
  TRY(moe_copy_(ctx, top, row));
  TRY(moe_copy_(ctx, bottom, col));
  TRY(make_values(ctx, 0, rshape, sdt, d, 6, false, &sc)); /* 0-dim: shape unused */
  TRY(moe_tensor_empty(ctx, 3, kshape, dt, d, &cube));
  TRY(moe_copy_(ctx, cube, sc));
  /* fold the cube into the result: rows 0..3 of dst get it, cols 0..5 */
  TRY(moe_view(ctx, cube, 2, flat, &cubev));
  moe_tensor_release(top);
  top = NULL;
  TRY(moe_narrow(ctx, dst, 1, 0, 6, &top));
  moe_tensor_release(bottom);
  bottom = NULL;
  TRY(moe_narrow(ctx, top, 0, 3, 4, &bottom));
  TRY(moe_copy_(ctx, bottom, cubev));
  *out = dst;
  dst = NULL;
done:
  moe_tensor_release(dst);
  moe_tensor_release(row);
  moe_tensor_release(col);
  moe_tensor_release(top);
  moe_tensor_release(bottom);
  moe_tensor_release(sc);
  moe_tensor_release(cube);
  moe_tensor_release(cubev);
  return st;
}

/* A stepped slice of a filled tensor as destination, a transposed source;
 * then a permuted 3-d tensor made contiguous and converted. */
static moe_status sc_copy_sliced(moe_ctx *ctx, moe_device d, moe_dtype dt, moe_dtype sdt,
                                 moe_tensor **out) {
  moe_tensor *dst = NULL, *sl = NULL, *src = NULL, *srct = NULL, *cube = NULL, *perm = NULL,
             *conv = NULL, *flat = NULL, *part = NULL;
  moe_status st;
  int64_t shape[2] = {10, 8}, sshape[2] = {4, 10}, cshape[3] = {3, 4, 5}, dims[3] = {2, 0, 1};
  int64_t fshape[2] = {6, 10}, pshape[3] = {5, 3, 4};
  TRY(moe_tensor_full(ctx, 2, shape, 7, dt, d, &dst));
  TRY(moe_slice(ctx, dst, 1, 1, 8, 2, &sl)); /* [10, 4], stride 2 */
  TRY(make_values(ctx, 2, sshape, sdt, d, 7, true, &src));
  TRY(moe_transpose(ctx, src, 0, 1, &srct)); /* [10, 4] */
  TRY(moe_copy_(ctx, sl, srct));
  TRY(make_values(ctx, 3, cshape, sdt, d, 8, true, &cube));
  TRY(moe_permute(ctx, cube, 3, dims, &perm)); /* [5, 3, 4] */
  TRY(moe_tensor_empty(ctx, 3, pshape, dt, d, &conv));
  TRY(moe_copy_(ctx, conv, perm)); /* strided source, conversion when dt != sdt */
  TRY(moe_view(ctx, conv, 2, fshape, &flat));
  TRY(moe_narrow(ctx, dst, 0, 0, 6, &part));
  moe_tensor_release(sl);
  sl = NULL;
  TRY(moe_narrow(ctx, part, 1, 0, 8, &sl));
  /* write the 60 converted values over the first 6 rows, cols 0..7 take the
   * first 8 of each row of flat */
  moe_tensor_release(part);
  part = NULL;
  TRY(moe_narrow(ctx, flat, 1, 2, 8, &part));
  TRY(moe_copy_(ctx, sl, part));
  *out = dst;
  dst = NULL;
done:
  moe_tensor_release(dst);
  moe_tensor_release(sl);
  moe_tensor_release(src);
  moe_tensor_release(srct);
  moe_tensor_release(cube);
  moe_tensor_release(perm);
  moe_tensor_release(conv);
  moe_tensor_release(flat);
  moe_tensor_release(part);
  return st;
}

static void test_copy_strided(moe_ctx *ctx) {
  static const moe_dtype pairs[][2] = {
      {MOE_F32, MOE_F32},  {MOE_F64, MOE_F64}, {MOE_BF16, MOE_BF16}, {MOE_I8, MOE_I8},
      {MOE_I64, MOE_I64},  {MOE_BOOL, MOE_BOOL}, {MOE_F32, MOE_F64}, {MOE_BF16, MOE_F32},
      {MOE_I32, MOE_F16},  {MOE_U8, MOE_I64},  {MOE_F16, MOE_BOOL}, {MOE_I64, MOE_F32},
      {MOE_F64, MOE_I32},  {MOE_BOOL, MOE_F32}, {MOE_I8, MOE_U8}};
  for (size_t k = 0; k < sizeof(pairs) / sizeof(pairs[0]); k++) {
    EXPECT(run_both(ctx, sc_copy_transposed_dst, pairs[k][0], pairs[k][1], -1, 0, "copy into transpose"));
    EXPECT(run_both(ctx, sc_copy_broadcast, pairs[k][0], pairs[k][1], -1, 0, "copy broadcast"));
    EXPECT(run_both(ctx, sc_copy_sliced, pairs[k][0], pairs[k][1], -1, 0, "copy sliced"));
  }
}

/* Row copies: same-dtype copies whose last (merged) dim is dense in both
 * views take the row kernel, in 16-, 8-, 4-, 2- or 1-byte words as the row
 * bytes, pointers and row strides allow; the rest the element kernel. The
 * scenarios below take their row length from row_len. */
static int64_t row_len = 64;

/* Attention's (B, H, S, D) -> (B, S, H, D): contiguous() of a transpose. */
static moe_status sc_rows_transpose(moe_ctx *ctx, moe_device d, moe_dtype dt, moe_dtype unused,
                                    moe_tensor **out) {
  moe_tensor *src = NULL, *srct = NULL;
  moe_status st;
  int64_t shape[4] = {2, 4, 33, row_len};
  TRY(make_values(ctx, 4, shape, dt, d, 21, true, &src));
  TRY(moe_transpose(ctx, src, 1, 2, &srct));
  TRY(moe_contiguous(ctx, srct, out));
done:
  moe_tensor_release(src);
  moe_tensor_release(srct);
  return st;
}

/* Attention's backward: (B, S, H, D) gradients into slots 0 and 2 of a
 * packed (B, S, 3, H, D) tensor; slot 1 keeps its fill. */
static moe_status sc_rows_qkv_slots(moe_ctx *ctx, moe_device d, moe_dtype dt, moe_dtype unused,
                                    moe_tensor **out) {
  moe_tensor *qkv = NULL, *slot = NULL, *g = NULL;
  moe_status st;
  int64_t pshape[5] = {2, 33, 3, 4, row_len}, gshape[4] = {2, 33, 4, row_len};
  TRY(moe_tensor_full(ctx, 5, pshape, 7, dt, d, &qkv));
  for (int i = 0; i < 3; i += 2) {
    TRY(make_values(ctx, 4, gshape, dt, d, 22 + (uint64_t)i, true, &g));
    TRY(moe_select(ctx, qkv, 2, i, &slot));
    TRY(moe_copy_(ctx, slot, g));
    moe_tensor_release(slot);
    moe_tensor_release(g);
    slot = g = NULL;
  }
  *out = qkv;
  qkv = NULL;
done:
  moe_tensor_release(qkv);
  moe_tensor_release(slot);
  moe_tensor_release(g);
  return st;
}

/* Rows of row_len elements at element offsets (dst, src) inside rows of
 * row_len + 8: with 2-byte elements and row_len 64, offsets 8, 4, 2 and 1
 * leave 16-, 8-, 4- and 2-byte words. Result k of the stack holds the copy
 * of pair k; everything around the rows keeps its fill. */
static moe_status sc_rows_offsets(moe_ctx *ctx, moe_device d, moe_dtype dt, moe_dtype unused,
                                  moe_tensor **out) {
  static const int64_t offs[][2] = {{0, 0}, {1, 3}, {2, 2}, {4, 4}, {8, 8}, {8, 1}, {0, 4}, {8, 6}};
  enum { NOFFS = sizeof(offs) / sizeof(offs[0]) };
  moe_tensor *res = NULL, *src = NULL, *plane = NULL, *dv = NULL, *sv = NULL;
  moe_status st;
  int64_t w = row_len + 8, rshape[3] = {NOFFS, 5, w}, sshape[2] = {5, w};
  TRY(moe_tensor_full(ctx, 3, rshape, 7, dt, d, &res));
  TRY(make_values(ctx, 2, sshape, dt, d, 23, true, &src));
  for (int k = 0; k < NOFFS; k++) {
    TRY(moe_select(ctx, res, 0, k, &plane));
    TRY(moe_narrow(ctx, plane, 1, offs[k][0], row_len, &dv));
    TRY(moe_narrow(ctx, src, 1, offs[k][1], row_len, &sv));
    TRY(moe_copy_(ctx, dv, sv));
    moe_tensor_release(plane);
    moe_tensor_release(dv);
    moe_tensor_release(sv);
    plane = dv = sv = NULL;
  }
  *out = res;
  res = NULL;
done:
  moe_tensor_release(res);
  moe_tensor_release(src);
  moe_tensor_release(plane);
  moe_tensor_release(dv);
  moe_tensor_release(sv);
  return st;
}

/* Broadcast sources (stride 0 in outer dims): a row [L] into [6, L]; a
 * [3, 1, L] into the transposed view of a [4, 3, L] (two outer dims, one of
 * stride 0 in the source); a [3, 1, L] source cut with size-1 dims of odd
 * strides; then a column [6, 1] into [6, L] (stride 0 innermost: the element
 * kernel). Each into its own 12 rows of one [48, L] result. */
static moe_status sc_rows_broadcast(moe_ctx *ctx, moe_device d, moe_dtype dt, moe_dtype unused,
                                    moe_tensor **out) {
  moe_tensor *res = NULL, *plane = NULL, *v = NULL, *src = NULL, *big = NULL, *cut = NULL,
             *cut2 = NULL;
  moe_status st;
  int64_t L = row_len, rshape[2] = {4 * 12, L}, r1[1] = {L}, p2[3] = {4, 3, L},
          s2[3] = {3, 1, L}, b3[3] = {3, 5, L + 2}, c4[2] = {6, 1};
  TRY(moe_tensor_full(ctx, 2, rshape, 7, dt, d, &res));
  /* plane 0: rows 0..5 = a broadcast row */
  TRY(moe_narrow(ctx, res, 0, 0, 6, &plane));
  TRY(make_values(ctx, 1, r1, dt, d, 24, true, &src));
  TRY(moe_copy_(ctx, plane, src));
  moe_tensor_release(plane);
  moe_tensor_release(src);
  plane = src = NULL;
  /* plane 1: rows 12..23 as [4, 3, L], written through its [3, 4, L] transpose */
  TRY(moe_narrow(ctx, res, 0, 12, 12, &plane));
  TRY(moe_view(ctx, plane, 3, p2, &v));
  moe_tensor_release(plane);
  plane = NULL;
  TRY(moe_transpose(ctx, v, 0, 1, &plane));
  TRY(make_values(ctx, 3, s2, dt, d, 25, true, &src));
  TRY(moe_copy_(ctx, plane, src));
  moe_tensor_release(plane);
  moe_tensor_release(v);
  moe_tensor_release(src);
  plane = v = src = NULL;
  /* plane 2: rows 24..26 = big[:, 2:3, 1:1+L] (size-1 middle dim) */
  TRY(moe_narrow(ctx, res, 0, 24, 3, &plane));
  TRY(moe_view(ctx, plane, 3, s2, &v));
  TRY(make_values(ctx, 3, b3, dt, d, 26, true, &big));
  TRY(moe_narrow(ctx, big, 1, 2, 1, &cut));
  TRY(moe_narrow(ctx, cut, 2, 1, L, &cut2));
  TRY(moe_copy_(ctx, v, cut2));
  moe_tensor_release(plane);
  moe_tensor_release(v);
  plane = v = NULL;
  /* plane 3: rows 36..41 = a broadcast column */
  TRY(moe_narrow(ctx, res, 0, 36, 6, &plane));
  TRY(make_values(ctx, 2, c4, dt, d, 27, true, &src));
  TRY(moe_copy_(ctx, plane, src));
  *out = res;
  res = NULL;
done:
  moe_tensor_release(res);
  moe_tensor_release(plane);
  moe_tensor_release(v);
  moe_tensor_release(src);
  moe_tensor_release(big);
  moe_tensor_release(cut);
  moe_tensor_release(cut2);
  return st;
}

static void test_copy_rows(moe_ctx *ctx) {
  static const int64_t lens[] = {64, 7, 33, 2, 1, 130};
  for (size_t l = 0; l < sizeof(lens) / sizeof(lens[0]); l++) {
    row_len = lens[l];
    for (int k = 0; k < NDT; k++) {
      moe_dtype dt = all_dtypes[k];
      char what[64];
      snprintf(what, sizeof(what), "rows %lld transpose", (long long)row_len);
      EXPECT(run_both(ctx, sc_rows_transpose, dt, dt, -1, 0, what));
      snprintf(what, sizeof(what), "rows %lld qkv slots", (long long)row_len);
      EXPECT(run_both(ctx, sc_rows_qkv_slots, dt, dt, -1, 0, what));
      snprintf(what, sizeof(what), "rows %lld offsets", (long long)row_len);
      EXPECT(run_both(ctx, sc_rows_offsets, dt, dt, -1, 0, what));
      snprintf(what, sizeof(what), "rows %lld broadcast", (long long)row_len);
      EXPECT(run_both(ctx, sc_rows_broadcast, dt, dt, -1, 0, what));
    }
  }
  row_len = 64;
}

/* Row copies at sizes where the grid caps (65535 blocks in y, 65535 in x)
 * leave the kernel's grid-stride loops more than one turn: 70000 rows of
 * 257 bytes, then 2 rows of 2^24 + 999 bytes (1-byte words: the rows start
 * at odd offsets). Compared byte for byte, the whole destination. */
static void test_copy_rows_large(moe_ctx *ctx) {
  static const int64_t sizes[][2] = {{70000, 257}, {2, (INT64_C(1) << 24) + 999}};
  for (int k = 0; k < 2; k++) {
    int64_t R = sizes[k][0], L = sizes[k][1];
    int64_t bshape[2] = {R, L + 2}, dshape[2] = {R, L + 3};
    moe_tensor *base = NULL, *baseg = NULL, *dst = NULL, *dstg = NULL, *sv = NULL, *svg = NULL,
               *dv = NULL, *dvg = NULL, *back = NULL;
    moe_rng_seed(ctx, 5 + (uint64_t)k);
    EXPECT_OK(moe_tensor_empty(ctx, 2, bshape, MOE_U8, MOE_CPU, &base));
    if (base) EXPECT_OK(moe_randint_(ctx, base, 0, 256));
    EXPECT_OK(moe_to(ctx, base, MOE_U8, GPU, &baseg));
    EXPECT_OK(moe_tensor_full(ctx, 2, dshape, 9, MOE_U8, MOE_CPU, &dst));
    EXPECT_OK(moe_tensor_full(ctx, 2, dshape, 9, MOE_U8, GPU, &dstg));
    if (base && baseg && dst && dstg) {
      EXPECT_OK(moe_narrow(ctx, base, 1, 1, L, &sv));
      EXPECT_OK(moe_narrow(ctx, baseg, 1, 1, L, &svg));
      EXPECT_OK(moe_narrow(ctx, dst, 1, 2, L, &dv));
      EXPECT_OK(moe_narrow(ctx, dstg, 1, 2, L, &dvg));
    }
    if (sv && svg && dv && dvg) {
      EXPECT_OK(moe_copy_(ctx, dv, sv));
      EXPECT_OK(moe_copy_(ctx, dvg, svg));
      EXPECT_OK(moe_to(ctx, dstg, MOE_U8, MOE_CPU, &back));
    }
    if (back) {
      const unsigned char *a = moe_tensor_data(back), *b = moe_tensor_data(dst);
      int64_t n = R * (L + 3), bad = -1;
      if (memcmp(a, b, (size_t)n) != 0)
        for (int64_t i = 0; i < n && bad < 0; i++)
          if (a[i] != b[i]) bad = i;
      if (bad >= 0)
        fprintf(stderr, "  rows %lld x %lld: byte %lld is %d on the GPU, %d on the CPU\n",
                (long long)R, (long long)L, (long long)bad, a[bad], b[bad]);
      EXPECT(bad < 0);
    }
    moe_tensor *ts[] = {base, baseg, dst, dstg, sv, svg, dv, dvg, back};
    for (size_t j = 0; j < sizeof ts / sizeof ts[0]; j++) moe_tensor_release(ts[j]);
  }
}

/* ----------------------------------------------------- fill, arange, linspace */

static const double fill_values[] = {1.5, 0.0, -3.0, 300.0, 1e10, -0.0, NAN, 65519.0, -1.0};
#define NFILL ((int)(sizeof(fill_values) / sizeof(fill_values[0])))

/* Contiguous fills of every fill value, then a strided fill over them. */
static moe_status sc_fill(moe_ctx *ctx, moe_device d, moe_dtype dt, moe_dtype unused,
                          moe_tensor **out) {
  moe_tensor *t = NULL, *row = NULL, *sl = NULL;
  moe_status st;
  int64_t shape[2] = {NFILL, 1029};
  TRY(moe_tensor_empty(ctx, 2, shape, dt, d, &t));
  for (int k = 0; k < NFILL; k++) {
    TRY(moe_select(ctx, t, 0, k, &row));
    TRY(moe_fill_(ctx, row, fill_values[k]));
    moe_tensor_release(row);
    row = NULL;
  }
  TRY(moe_slice(ctx, t, 1, 3, 1029, 7, &sl)); /* every 7th column from 3 */
  TRY(moe_fill_(ctx, sl, 2.25));
  *out = t;
  t = NULL;
done:
  moe_tensor_release(t);
  moe_tensor_release(row);
  moe_tensor_release(sl);
  return st;
}

static moe_status sc_arange(moe_ctx *ctx, moe_device d, moe_dtype dt, moe_dtype variant,
                            moe_tensor **out) {
  switch ((int)variant) {
    case 0: return moe_arange(ctx, 0, 1023, 1, dt, d, out);
    case 1: return moe_arange(ctx, -3.5, 7.25, 0.37, dt, d, out);
    case 2: return moe_arange(ctx, 100, -65537, -3, dt, d, out);
    case 3: return moe_arange(ctx, 0.1, 0.1, 1, dt, d, out); /* empty */
    default: return moe_arange(ctx, 1e6, 1e6 + 70001 * 0.3, 0.3, dt, d, out);
  }
}

static moe_status sc_linspace(moe_ctx *ctx, moe_device d, moe_dtype dt, moe_dtype variant,
                              moe_tensor **out) {
  switch ((int)variant) {
    case 0: return moe_linspace(ctx, 0, 1, 1023, dt, d, out);
    case 1: return moe_linspace(ctx, -5, 5, 1, dt, d, out);
    case 2: return moe_linspace(ctx, 3, -2.5, 7, dt, d, out);
    case 3: return moe_linspace(ctx, 0, 1, 0, dt, d, out);
    default: return moe_linspace(ctx, -1e4, 3e4, 65537, dt, d, out);
  }
}

static void test_fill_arange_linspace(moe_ctx *ctx) {
  for (int k = 0; k < NDT; k++) {
    moe_dtype dt = all_dtypes[k];
    EXPECT(run_both(ctx, sc_fill, dt, dt, -1, 0, "fill"));
    if (dt == MOE_BOOL) continue; /* no ranges of bool */
    for (int v = 0; v < 5; v++) {
      EXPECT(run_both(ctx, sc_arange, dt, (moe_dtype)v, -1, 0, "arange variant"));
      EXPECT(run_both(ctx, sc_linspace, dt, (moe_dtype)v, -1, 0, "linspace variant"));
    }
  }
}

/* ------------------------------------------------------------------ random */

enum { R_UNIFORM, R_NORMAL, R_INT };

/* Seeds, then two fills of a fresh [1023] tensor (the second shows that the
 * call counter moves alike) into a [2, 1023] result, then one fill of a
 * transposed, stepped view of a [6, 9] tensor holding a sentinel. */
static moe_status sc_random(moe_ctx *ctx, moe_device d, moe_dtype dt, moe_dtype kind,
                            moe_tensor **out) {
  moe_tensor *t = NULL, *row = NULL, *base = NULL, *sl = NULL, *view = NULL, *flat = NULL,
             *res = NULL, *part = NULL;
  moe_status st;
  int64_t shape[2] = {2, 1023}, bshape[2] = {6, 9}, rshape[1] = {2 * 1023 + 54},
          n2 = 2 * 1023, n3 = 54;
  moe_rng_seed(ctx, 0xC0FFEE);
  TRY(moe_tensor_empty(ctx, 2, shape, dt, d, &t));
  TRY(moe_tensor_full(ctx, 2, bshape, 99, dt, d, &base));
  TRY(moe_slice(ctx, base, 1, 1, 9, 2, &sl));  /* [6, 4] */
  TRY(moe_transpose(ctx, sl, 0, 1, &view));    /* [4, 6], strides (2, 9) */
  for (int r = 0; r < 3; r++) {
    moe_tensor *target = view;
    if (r < 2) {
      TRY(moe_select(ctx, t, 0, r, &row));
      target = row;
    }
    if ((int)kind == R_UNIFORM) TRY(moe_uniform_(ctx, target, -2.0, 3.0));
    else if ((int)kind == R_NORMAL) TRY(moe_normal_(ctx, target, 0.5, 2.0));
    else if (dt == MOE_BOOL) TRY(moe_randint_(ctx, target, 0, 2));
    else if (dt == MOE_U8) TRY(moe_randint_(ctx, target, 3, 250));
    else if (dt == MOE_I64) TRY(moe_randint_(ctx, target, -(INT64_C(1) << 40), INT64_C(1) << 52));
    else if (dt == MOE_BF16) TRY(moe_randint_(ctx, target, -256, 257));
    else TRY(moe_randint_(ctx, target, -100, 101));
    moe_tensor_release(row);
    row = NULL;
  }
  /* result: t's 2046 values then base's 54 */
  TRY(moe_tensor_empty(ctx, 1, rshape, dt, d, &res));
  TRY(moe_narrow(ctx, res, 0, 0, n2, &part));
  TRY(moe_view(ctx, t, 1, &n2, &flat));
  TRY(moe_copy_(ctx, part, flat));
  moe_tensor_release(part);
  moe_tensor_release(flat);
  part = flat = NULL;
  TRY(moe_narrow(ctx, res, 0, n2, n3, &part));
  TRY(moe_view(ctx, base, 1, &n3, &flat));
  TRY(moe_copy_(ctx, part, flat));
  *out = res;
  res = NULL;
done:
  moe_tensor_release(t);
  moe_tensor_release(row);
  moe_tensor_release(base);
  moe_tensor_release(sl);
  moe_tensor_release(view);
  moe_tensor_release(flat);
  moe_tensor_release(res);
  moe_tensor_release(part);
  return st;
}

static void test_random(moe_ctx *ctx) {
  for (int k = 0; k < NDT; k++) {
    moe_dtype dt = all_dtypes[k];
    EXPECT(run_both(ctx, sc_random, dt, (moe_dtype)R_INT, -1, 0, "randint")); /* bit-exact */
    if (!moe_dtype_is_float(dt)) continue;
    EXPECT(run_both(ctx, sc_random, dt, (moe_dtype)R_UNIFORM, -1, 0, "uniform")); /* bit-exact */
    /* normal: see the header for the tolerances; scale = std = 2 */
    double rel = dt == MOE_F64 ? 1e-12 : dt == MOE_F32 ? 1e-6 : 1.0 / 128;
    EXPECT(run_both(ctx, sc_random, dt, (moe_dtype)R_NORMAL, rel, 2.0, "normal"));
  }
  /* a large normal fill in f32 and f64 (many blocks, every lane) */
  const moe_dtype fl[2] = {MOE_F32, MOE_F64};
  for (int k = 0; k < 2; k++) {
    moe_tensor *a = NULL, *b = NULL;
    int64_t n = 65537 * 3;
    EXPECT_OK(moe_tensor_empty(ctx, 1, &n, fl[k], MOE_CPU, &a));
    EXPECT_OK(moe_tensor_empty(ctx, 1, &n, fl[k], GPU, &b));
    if (a && b) {
      moe_rng_seed(ctx, 7);
      EXPECT_OK(moe_normal_(ctx, a, 0.0, 1.0));
      moe_rng_seed(ctx, 7);
      EXPECT_OK(moe_normal_(ctx, b, 0.0, 1.0));
      EXPECT(compare(ctx, a, b, fl[k] == MOE_F32 ? 1e-6 : 1e-12, 1.0, "normal 196611"));
    }
    moe_tensor_release(a);
    moe_tensor_release(b);
  }
}

/* ------------------------------------------------------------ elementwise */

typedef struct bin_shape {
  int na, nb;
  int64_t a[3], b[3];
} bin_shape;

static const bin_shape bin_shapes[] = {
    {1, 1, {1}, {1}},         {1, 1, {7}, {7}},           {1, 1, {1023}, {1023}},
    {1, 1, {65537}, {65537}}, {3, 2, {3, 1, 5}, {4, 1}},  {1, 1, {0}, {0}},
    {0, 1, {0}, {7}},         {1, 1, {65537}, {1}},       {2, 3, {4, 5}, {3, 4, 5}},
};
#define NSHAPES ((int)(sizeof(bin_shapes) / sizeof(bin_shapes[0])))

static int g_op, g_shape; /* scenario parameters beyond the two dtypes */

static moe_status sc_binary(moe_ctx *ctx, moe_device d, moe_dtype adt, moe_dtype bdt,
                            moe_tensor **out) {
  moe_tensor *a = NULL, *b = NULL;
  moe_status st;
  const bin_shape *s = &bin_shapes[g_shape];
  TRY(make_values(ctx, s->na, s->a, adt, d, 21, true, &a));
  TRY(make_values(ctx, s->nb, s->b, bdt, d, 22, false, &b));
  TRY(moe_binary(ctx, (moe_op)g_op, a, b, out));
done:
  moe_tensor_release(a);
  moe_tensor_release(b);
  return st;
}

/* b op a on a transposed a and a sliced b: strided typed and dynamic paths */
static moe_status sc_binary_strided(moe_ctx *ctx, moe_device d, moe_dtype adt, moe_dtype bdt,
                                    moe_tensor **out) {
  moe_tensor *a = NULL, *b = NULL, *at = NULL, *bs = NULL;
  moe_status st;
  int64_t ashape[2] = {33, 17}, bshape[2] = {17, 70};
  TRY(make_values(ctx, 2, ashape, adt, d, 23, true, &a));
  TRY(make_values(ctx, 2, bshape, bdt, d, 24, false, &b));
  TRY(moe_transpose(ctx, a, 0, 1, &at));       /* [17, 33] */
  TRY(moe_slice(ctx, b, 1, 2, 68, 2, &bs));    /* [17, 33] */
  TRY(moe_binary(ctx, (moe_op)g_op, bs, at, out));
done:
  moe_tensor_release(a);
  moe_tensor_release(b);
  moe_tensor_release(at);
  moe_tensor_release(bs);
  return st;
}

static void test_binary(moe_ctx *ctx) {
  static const moe_dtype combos[][2] = {
      {MOE_F32, MOE_F32}, {MOE_F64, MOE_F64}, {MOE_BF16, MOE_BF16}, {MOE_F16, MOE_F16},
      {MOE_I32, MOE_I32}, {MOE_I64, MOE_I64}, {MOE_U8, MOE_U8},     {MOE_I8, MOE_U8},
      {MOE_BOOL, MOE_BOOL}, {MOE_F32, MOE_BF16}, {MOE_F16, MOE_BF16}, {MOE_I32, MOE_F32},
      {MOE_I64, MOE_F64}, {MOE_BOOL, MOE_F16}, {MOE_U8, MOE_I64},   {MOE_I8, MOE_I8}};
  const moe_op ops[4] = {MOE_OP_ADD, MOE_OP_SUB, MOE_OP_MUL, MOE_OP_DIV};
  for (size_t c = 0; c < sizeof(combos) / sizeof(combos[0]); c++) {
    for (int o = 0; o < 4; o++) {
      if (ops[o] == MOE_OP_SUB && combos[c][0] == MOE_BOOL && combos[c][1] == MOE_BOOL) continue;
      g_op = ops[o];
      for (g_shape = 0; g_shape < NSHAPES; g_shape++) {
        char what[64];
        snprintf(what, sizeof(what), "%s, shapes #%d", moe_op_name(ops[o]), g_shape);
        EXPECT(run_both(ctx, sc_binary, combos[c][0], combos[c][1], -1, 0, what)); /* bit-exact */
      }
      EXPECT(run_both(ctx, sc_binary_strided, combos[c][0], combos[c][1], -1, 0,
                      moe_op_name(ops[o])));
    }
  }
}

static double g_scalar;
static bool g_reverse;

static moe_status sc_scalar(moe_ctx *ctx, moe_device d, moe_dtype adt, moe_dtype layout,
                            moe_tensor **out) {
  moe_tensor *a = NULL, *at = NULL;
  moe_status st;
  int64_t shape[2] = {31, 65};
  TRY(make_values(ctx, 2, shape, adt, d, 25, true, &a));
  if ((int)layout == 1) TRY(moe_transpose(ctx, a, 0, 1, &at));
  TRY(moe_binary_scalar(ctx, (moe_op)g_op, at ? at : a, g_scalar, g_reverse, out));
done:
  moe_tensor_release(a);
  moe_tensor_release(at);
  return st;
}

static moe_status sc_neg(moe_ctx *ctx, moe_device d, moe_dtype adt, moe_dtype layout,
                         moe_tensor **out) {
  moe_tensor *a = NULL, *at = NULL;
  moe_status st;
  int64_t shape[2] = {31, 65};
  TRY(make_values(ctx, 2, shape, adt, d, 26, true, &a));
  if ((int)layout == 1) TRY(moe_transpose(ctx, a, 0, 1, &at));
  TRY(moe_unary(ctx, MOE_OP_NEG, at ? at : a, out));
done:
  moe_tensor_release(a);
  moe_tensor_release(at);
  return st;
}

static void test_scalar_and_unary(moe_ctx *ctx) {
  const double scalars[] = {2.5, -3.0, 0.1, 0.0, 1e30};
  const moe_op ops[4] = {MOE_OP_ADD, MOE_OP_SUB, MOE_OP_MUL, MOE_OP_DIV};
  for (int k = 0; k < NDT; k++) {
    moe_dtype dt = all_dtypes[k];
    for (int o = 0; o < 4; o++) {
      g_op = ops[o];
      for (int s = 0; s < 5; s++) {
        g_scalar = scalars[s];
        for (int r = 0; r < 2; r++) {
          g_reverse = r;
          char what[64];
          snprintf(what, sizeof(what), "%s%s scalar %g", moe_op_name(ops[o]), r ? " reversed" : "",
                   scalars[s]);
          EXPECT(run_both(ctx, sc_scalar, dt, (moe_dtype)(s & 1), -1, 0, what)); /* bit-exact */
        }
      }
    }
    if (dt == MOE_BOOL) continue; /* neg of bool is refused */
    EXPECT(run_both(ctx, sc_neg, dt, (moe_dtype)0, -1, 0, "neg"));
    EXPECT(run_both(ctx, sc_neg, dt, (moe_dtype)1, -1, 0, "neg transposed"));
  }
}

/* ------------------------------------------------------------------ errors */

static void test_errors(moe_ctx *ctx) {
  moe_tensor *a = NULL, *b = NULL, *r = NULL;
  int64_t n = 4;
  moe_device bad = {MOE_DEVICE_CUDA, 99};
  moe_device parsed;
  moe_memory_stats ms;
  EXPECT_OK(moe_tensor_full(ctx, 1, &n, 1, MOE_F32, MOE_CPU, &a));
  EXPECT_OK(moe_tensor_full(ctx, 1, &n, 2, MOE_F32, GPU, &b));
  if (a && b) {
    EXPECT_ERR(moe_binary(ctx, MOE_OP_ADD, a, b, &r), MOE_ERR_DEVICE);
    EXPECT_ERR(moe_binary(ctx, MOE_OP_MUL, b, a, &r), MOE_ERR_DEVICE);
    EXPECT(r == NULL);
  }
  EXPECT_ERR(moe_tensor_empty(ctx, 1, &n, MOE_F32, bad, &r), MOE_ERR_DEVICE);
  EXPECT(strstr(moe_ctx_error(ctx), "cuda:99") != NULL);
  EXPECT_ERR(moe_device_parse(ctx, "cuda:99", &parsed), MOE_ERR_DEVICE);
  EXPECT_ERR(moe_memory_stats_get(ctx, bad, &ms), MOE_ERR_DEVICE);
  EXPECT_ERR(moe_cuda_device_info(ctx, 99, NULL, 0, NULL, NULL), MOE_ERR_DEVICE);
  EXPECT_ERR(moe_cuda_synchronize(ctx, bad), MOE_ERR_DEVICE);
  EXPECT(r == NULL);
  moe_tensor_release(a);
  moe_tensor_release(b);
}

/* Last: every GPU tensor of the tests above was released. */
static void test_no_gpu_leaks(moe_ctx *ctx) {
  moe_memory_stats ms;
  EXPECT_OK(moe_memory_stats_get(ctx, GPU, &ms));
  EXPECT(ms.live_storages == 0 && ms.allocated == 0);
  EXPECT(ms.alloc_count == ms.free_count);
  printf("  cuda:0: %lld allocations, %lld cudaMalloc, peak %.1f MiB, reserved %.1f MiB\n",
         (long long)ms.alloc_count, (long long)ms.system_allocs,
         (double)ms.peak_allocated / (1 << 20), (double)ms.reserved / (1 << 20));
}

int main(void) {
  SKIP_IF_NO_GPU(harness_start());
  RUN(test_device_facts);
  RUN(test_copy_dtype_pairs);
  RUN(test_copy_strided);
  RUN(test_copy_rows);
  RUN(test_copy_rows_large);
  RUN(test_fill_arange_linspace);
  RUN(test_random);
  RUN(test_binary);
  RUN(test_scalar_and_unary);
  RUN(test_errors);
  RUN(test_no_gpu_leaks);
  return harness_end();
}
