/*
 * test_grouped_cuda.c - the grouped GEMM family on CUDA against the CPU, for
 * every backend (moe_grouped_set_backend: loop, cublas_grouped, streams,
 * auto):
 * forward (both transposes), weight gradient (both layouts) and the
 * autograd backward at awkward sizes (odd K and N, empty groups, every row
 * in one group, rows outside the groups, G = 1 and 256, a strided x), in
 * f32 and bf16, with the tolerance of each dtype beside the check; the
 * sm_90a kernel's rows gathered by index against a permuted copy, and its
 * fused GLU epilogues against the separate passes. Exits 77 without a GPU.
 */
#include "blocksparse_cuda.h" /* the sm_90a kernel's gathering and GLU launchers */
#include "experts_cuda.h"     /* the separate GLU passes */
#include "harness.h"
#include "knobs.h"
#include "moe_grouped.h"

static const moe_device GPU = {MOE_DEVICE_CUDA, 0};

static const char *const BACKENDS[] = {"loop", "cublas_grouped", "streams", "auto"};

/* Tolerances: |cuda - cpu| <= atol + rtol * |cpu|.
 * f32: both sides accumulate in f32 in different orders (cuBLAS tiles and
 *   split-K versus OpenBLAS): sums of K <= 300 products of [-1, 1) values,
 *   |y| <= ~10: 1e-4 absolute + 1e-5 relative.
 * bf16: both sides accumulate in f32 and round the output to bf16 (8 bits):
 *   the two f32 sums may round to neighbouring bf16 values, one ulp = 2^-7
 *   relative: rtol 1/64 (two ulps) + 1e-2 absolute for results near 0. */
typedef struct tol {
  double atol, rtol;
} tol;
static const tol TOL_F32 = {1e-4, 1e-5};
static const tol TOL_BF16 = {1e-2, 1.0 / 64};

static bool same_values(moe_ctx *ctx, moe_tensor *gpu, moe_tensor *cpu, tol t, const char *what) {
  int64_t n = moe_tensor_numel(cpu);
  if (moe_tensor_numel(gpu) != n) {
    fprintf(stderr, "%s: %lld vs %lld elements\n", what, (long long)moe_tensor_numel(gpu),
            (long long)n);
    return false;
  }
  double *a = malloc(sizeof(double) * (size_t)(n + 1)), *b = malloc(sizeof(double) * (size_t)(n + 1));
  bool ok = moe_tensor_to_f64(ctx, gpu, a) == MOE_OK && moe_tensor_to_f64(ctx, cpu, b) == MOE_OK;
  for (int64_t i = 0; ok && i < n; i++)
    if (!(fabs(a[i] - b[i]) <= t.atol + t.rtol * fabs(b[i]))) {
      fprintf(stderr, "%s: element %lld cuda %.9g cpu %.9g\n", what, (long long)i, a[i], b[i]);
      ok = false;
    }
  free(a), free(b);
  return ok;
}

static moe_tensor *rand_cpu(moe_ctx *ctx, int ndim, const int64_t *shape, moe_dtype dt) {
  moe_tensor *t = NULL, *f = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, ndim, shape, MOE_F32, MOE_CPU, &f));
  if (f) EXPECT_OK(moe_uniform_(ctx, f, -1, 1));
  if (f) EXPECT_OK(moe_to(ctx, f, dt, MOE_CPU, &t));
  moe_tensor_release(f);
  return t;
}

static moe_tensor *on_gpu(moe_ctx *ctx, moe_tensor *t) {
  moe_tensor *g = NULL;
  EXPECT_OK(moe_to(ctx, t, t->dtype, GPU, &g));
  return g;
}

static void random_offs(int64_t *offs, int64_t G, int64_t lo, int64_t hi, uint64_t seed) {
  uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
  offs[0] = lo;
  offs[G] = hi;
  for (int64_t g = 1; g < G; g++) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    offs[g] = lo + (int64_t)((s >> 33) % (uint64_t)(hi - lo + 1));
  }
  for (int64_t i = 1; i < G; i++)
    for (int64_t j = i; j > 1 && offs[j] < offs[j - 1]; j--) {
      int64_t t = offs[j];
      offs[j] = offs[j - 1], offs[j - 1] = t;
    }
}

/* forward, wgrad and autograd backward of one configuration: CUDA (current
 * backend) against the CPU on the same inputs. strided: x is a column
 * slice of a wider matrix. */
/* The GPU side's products: host offsets, or (doffs set) the device-offset
 * functions with doffs. */
static moe_status g_mm(moe_ctx *ctx, moe_tensor *doffs, moe_tensor *x, moe_tensor *w,
                       const int64_t *offs, int64_t G, bool tw, moe_tensor **out) {
  return doffs ? moe_grouped_mm_dev(ctx, x, w, doffs, tw, out) : moe_grouped_mm(ctx, x, w, offs, G, tw, out);
}
static moe_status g_wgrad(moe_ctx *ctx, moe_tensor *doffs, moe_tensor *a, moe_tensor *b,
                          const int64_t *offs, int64_t G, bool tw, moe_tensor **out) {
  return doffs ? moe_grouped_mm_wgrad_dev(ctx, a, b, doffs, tw, out)
               : moe_grouped_mm_wgrad(ctx, a, b, offs, G, tw, out);
}

static void check_case_ex(moe_ctx *ctx, int64_t R, int64_t K, int64_t N, int64_t G,
                          const int64_t *offs, moe_dtype dt, bool strided, const char *name,
                          bool dev) {
  tol t = dt == MOE_F32 ? TOL_F32 : TOL_BF16;
  char what[160];
  moe_tensor *doffs = NULL;
  if (dev) {
    double v[300];
    for (int64_t g = 0; g <= G; g++) v[g] = (double)offs[g];
    EXPECT_OK(moe_tensor_from_f64(ctx, v, 1, (int64_t[]){G + 1}, MOE_I64, GPU, &doffs));
  }
  for (int tw = 0; tw < 2; tw++) {
    moe_tensor *xw = rand_cpu(ctx, 2, (int64_t[]){R, K + (strided ? 5 : 0)}, dt), *x = NULL;
    EXPECT_OK(moe_narrow(ctx, xw, 1, strided ? 3 : 0, K, &x));
    moe_tensor *w = rand_cpu(ctx, 3, tw ? (int64_t[]){G, N, K} : (int64_t[]){G, K, N}, dt);
    moe_tensor *dy = rand_cpu(ctx, 2, (int64_t[]){R, N}, dt);
    moe_tensor *gxw = on_gpu(ctx, xw), *gx = NULL, *gw = on_gpu(ctx, w), *gdy = on_gpu(ctx, dy);
    EXPECT_OK(moe_narrow(ctx, gxw, 1, strided ? 3 : 0, K, &gx));
    moe_tensor *y = NULL, *gy = NULL, *dw = NULL, *gdw = NULL;
    /* forward, with autograd on the GPU side */
    EXPECT_OK(moe_set_requires_grad(ctx, gw, true));
    EXPECT_OK(moe_grouped_mm(ctx, x, w, offs, G, tw, &y));
    EXPECT_OK(g_mm(ctx, doffs, gx, gw, offs, G, tw, &gy));
    snprintf(what, sizeof what, "%s %s fwd R=%lld K=%lld N=%lld G=%lld trans=%d", name,
             moe_dtype_name(dt), (long long)R, (long long)K, (long long)N, (long long)G, tw);
    if (y && gy) EXPECT(same_values(ctx, gy, y, t, what));
    /* weight gradient, direct and through backward */
    EXPECT_OK(moe_grouped_mm_wgrad(ctx, x, dy, offs, G, tw, &dw));
    EXPECT_OK(g_wgrad(ctx, doffs, gx, gdy, offs, G, tw, &gdw));
    /* wgrad sums over up to R rows: the f32 tolerance scaled by R / K */
    tol tw_tol = t;
    if (dt == MOE_F32) tw_tol.atol *= (double)(R > K ? R : K) / (double)(K > 0 ? K : 1) + 1;
    snprintf(what, sizeof what, "%s %s wgrad R=%lld K=%lld N=%lld G=%lld trans=%d", name,
             moe_dtype_name(dt), (long long)R, (long long)K, (long long)N, (long long)G, tw);
    if (dw && gdw) EXPECT(same_values(ctx, gdw, dw, tw_tol, what));
    if (gy) {
      EXPECT_OK(moe_backward(ctx, gy, gdy, false));
      moe_tensor *g = moe_tensor_grad(gw);
      EXPECT(g != NULL);
      if (g && dw) EXPECT(same_values(ctx, g, dw, tw_tol, what));
    }
    /* the input gradient is the forward with the other transpose */
    moe_tensor *dx = NULL, *gdx = NULL;
    EXPECT_OK(moe_grouped_mm(ctx, dy, w, offs, G, !tw, &dx));
    EXPECT_OK(g_mm(ctx, doffs, gdy, gw, offs, G, !tw, &gdx));
    snprintf(what, sizeof what, "%s %s dgrad R=%lld K=%lld N=%lld G=%lld trans=%d", name,
             moe_dtype_name(dt), (long long)R, (long long)K, (long long)N, (long long)G, tw);
    if (dx && gdx) EXPECT(same_values(ctx, gdx, dx, t, what));
    moe_tensor_release(xw), moe_tensor_release(x), moe_tensor_release(w), moe_tensor_release(dy);
    moe_tensor_release(gxw), moe_tensor_release(gx), moe_tensor_release(gw);
    moe_tensor_release(gdy), moe_tensor_release(y), moe_tensor_release(gy);
    moe_tensor_release(dw), moe_tensor_release(gdw), moe_tensor_release(dx);
    moe_tensor_release(gdx);
  }
  moe_tensor_release(doffs);
}

static void check_case(moe_ctx *ctx, int64_t R, int64_t K, int64_t N, int64_t G,
                       const int64_t *offs, moe_dtype dt, bool strided, const char *name) {
  check_case_ex(ctx, R, K, N, G, offs, dt, strided, name, false);
}

static void run_all(moe_ctx *ctx, const char *backend) {
  EXPECT_OK(moe_grouped_set_backend(ctx, backend));
  int64_t offs[300];
  moe_dtype dts[] = {MOE_F32, MOE_BF16};
  for (int i = 0; i < 2; i++) {
    moe_dtype dt = dts[i];
    random_offs(offs, 7, 5, 290, 11); /* rows outside at both ends, odd sizes */
    check_case(ctx, 300, 131, 67, 7, offs, dt, false, backend);
    check_case(ctx, 300, 131, 67, 7, offs, dt, true, backend);
    int64_t one[] = {0, 0, 0, 257, 257};
    check_case(ctx, 257, 96, 33, 4, one, dt, false, backend);
    int64_t g1[] = {0, 129};
    check_case(ctx, 129, 7, 9, 1, g1, dt, false, backend);
    random_offs(offs, 256, 0, 700, 12); /* G = 256, many empty groups */
    check_case(ctx, 700, 24, 40, 256, offs, dt, false, backend);
    int64_t none[] = {0, 0, 0};
    check_case(ctx, 9, 8, 8, 2, none, dt, false, backend);
    random_offs(offs, 5, 0, 1000, 13); /* larger, tile-sized dims */
    check_case(ctx, 1000, 256, 384, 5, offs, dt, false, backend);
  }
  EXPECT_OK(moe_grouped_set_backend(ctx, "auto"));
}

static void test_loop(moe_ctx *ctx) { run_all(ctx, BACKENDS[0]); }
static void test_cublas_grouped(moe_ctx *ctx) { run_all(ctx, BACKENDS[1]); }
static void test_streams(moe_ctx *ctx) { run_all(ctx, BACKENDS[2]); }
static void test_auto(moe_ctx *ctx) { run_all(ctx, BACKENDS[3]); }

/* The device-offset functions: in bf16 with K and N multiples of 8 the
 * sm_90a kernel (asserted to run), elsewhere the host copy and the backends;
 * both against the CPU as above, forward, dgrad, wgrad (both layouts) and
 * the backward. Offsets that are wrong on the device are clamped: no fault
 * (compute-sanitizer runs this), rows within R. */
static void test_device_offsets(moe_ctx *ctx) {
  int64_t offs[300];
  moe_dtype dts[] = {MOE_F32, MOE_BF16};
  for (int i = 0; i < 2; i++) {
    moe_dtype dt = dts[i];
    bool kern = dt == MOE_BF16 && moe_grouped_offsets_on_device(ctx, GPU, dt, 7, 136, 72);
    EXPECT(kern == (dt == MOE_BF16)); /* the test GPUs are compute capability 9.x */
    random_offs(offs, 7, 5, 290, 11); /* rows outside at both ends */
    check_case_ex(ctx, 300, 136, 72, 7, offs, dt, false, "dev", true);
    check_case_ex(ctx, 300, 136, 72, 7, offs, dt, true, "dev strided", true);
    check_case_ex(ctx, 300, 131, 67, 7, offs, dt, false, "dev odd K, N (host copy)", true);
    int64_t one[] = {0, 0, 0, 257, 257};
    check_case_ex(ctx, 257, 96, 40, 4, one, dt, false, "dev one group", true);
    int64_t g1[] = {0, 129};
    check_case_ex(ctx, 129, 8, 16, 1, g1, dt, false, "dev G=1", true);
    random_offs(offs, 256, 0, 700, 12); /* G = 256, many empty groups */
    check_case_ex(ctx, 700, 24, 40, 256, offs, dt, false, "dev G=256", true);
    int64_t none[] = {0, 0, 0};
    check_case_ex(ctx, 9, 8, 8, 2, none, dt, false, "dev no rows in groups", true);
    random_offs(offs, 5, 0, 1000, 13);
    check_case_ex(ctx, 1000, 256, 384, 5, offs, dt, false, "dev tile-sized", true);
    random_offs(offs, 9, 3, 4100, 14); /* more tiles than SMs: the persistent walk */
    check_case_ex(ctx, 4100, 512, 264, 9, offs, dt, false, "dev many tiles", true);
    /* group sizes on both sides of the kernel's edges: a group's last tile
     * of 128 rows (two warpgroups of 64 each), whose rows past the group's
     * are the next group's, and the weight gradient's last chunk of 64 rows
     * (wgmma slices of 16), whose rows past the group's are zeroed */
    const int64_t sz[] = {1, 15, 16, 17, 48, 63, 64, 0, 65, 127, 128, 129, 191, 192, 193, 255};
    offs[0] = 3;
    for (int g = 0; g < 16; g++) offs[g + 1] = offs[g] + sz[g];
    check_case_ex(ctx, offs[16] + 5, 136, 72, 16, offs, dt, false, "dev group sizes at the edges", true);
  }
  { /* two products summed in one kernel against the two rounded to bf16 and added (three
     * roundings of addends up to ~15: 2^-9 * 15 each, plus the sum's own) */
    random_offs(offs, 7, 5, 290, 15);
    double v[8];
    for (int g = 0; g <= 7; g++) v[g] = (double)offs[g];
    moe_tensor *o = NULL, *y = NULL, *y1 = NULL, *y2 = NULL, *ref = NULL, *ycpu = NULL;
    EXPECT_OK(moe_tensor_from_f64(ctx, v, 1, (int64_t[]){8}, MOE_I64, GPU, &o));
    moe_tensor *c[4] = {rand_cpu(ctx, 2, (int64_t[]){300, 136}, MOE_BF16),
                        rand_cpu(ctx, 3, (int64_t[]){7, 72, 136}, MOE_BF16),
                        rand_cpu(ctx, 2, (int64_t[]){300, 136}, MOE_BF16),
                        rand_cpu(ctx, 3, (int64_t[]){7, 72, 136}, MOE_BF16)};
    moe_tensor *gp[4];
    for (int i = 0; i < 4; i++) gp[i] = on_gpu(ctx, c[i]);
    EXPECT_OK(moe_grouped_mm_sum_dev(ctx, gp[0], gp[1], gp[2], gp[3], o, true, &y));
    EXPECT_OK(moe_grouped_mm(ctx, c[0], c[1], offs, 7, true, &y1));
    EXPECT_OK(moe_grouped_mm(ctx, c[2], c[3], offs, 7, true, &y2));
    if (y1 && y2) EXPECT_OK(moe_binary(ctx, MOE_OP_ADD, y1, y2, &ref));
    if (y) EXPECT_OK(moe_to(ctx, y, MOE_F32, MOE_CPU, &ycpu));
    if (ycpu && ref) EXPECT(same_values(ctx, ycpu, ref, (tol){0.08, 1.0 / 64}, "grouped_mm_sum_dev"));
    for (int i = 0; i < 4; i++) moe_tensor_release(c[i]), moe_tensor_release(gp[i]);
    moe_tensor_release(o), moe_tensor_release(y), moe_tensor_release(y1), moe_tensor_release(y2);
    moe_tensor_release(ref), moe_tensor_release(ycpu);
  }
  { /* a group's weight gradient never reads the next group's rows: an
     * infinity there (rows 70.. of b) leaves group 0's, which ends mid-chunk,
     * finite */
    double v3[3] = {0, 70, 140};
    moe_tensor *o = NULL, *dw = NULL, *dwc = NULL;
    EXPECT_OK(moe_tensor_from_f64(ctx, v3, 1, (int64_t[]){3}, MOE_I64, GPU, &o));
    double *bv = malloc(sizeof(double) * 140 * 64);
    for (int i = 0; i < 140 * 64; i++) bv[i] = i >= 70 * 64 ? INFINITY : 0.5;
    moe_tensor *ac = rand_cpu(ctx, 2, (int64_t[]){140, 72}, MOE_BF16), *bt = NULL;
    EXPECT_OK(moe_tensor_from_f64(ctx, bv, 2, (int64_t[]){140, 64}, MOE_BF16, GPU, &bt));
    moe_tensor *ag = on_gpu(ctx, ac);
    EXPECT_OK(moe_grouped_mm_wgrad_dev(ctx, ag, bt, o, false, &dw));
    if (dw) EXPECT_OK(moe_to(ctx, dw, MOE_F64, MOE_CPU, &dwc));
    if (dwc) {
      const double *d = (const double *)moe_tensor_data(dwc);
      bool finite = true;
      for (int i = 0; i < 72 * 64; i++) finite = finite && isfinite(d[i]);
      EXPECT(finite);
    }
    free(bv);
    moe_tensor_release(o), moe_tensor_release(dw), moe_tensor_release(dwc), moe_tensor_release(ac);
    moe_tensor_release(bt), moe_tensor_release(ag);
  }
  /* forced to a cuBLAS backend: the host copy, same results */
  EXPECT_OK(moe_grouped_set_backend(ctx, "loop"));
  EXPECT(!moe_grouped_offsets_on_device(ctx, GPU, MOE_BF16, 7, 136, 72));
  random_offs(offs, 7, 5, 290, 11);
  check_case_ex(ctx, 300, 136, 72, 7, offs, MOE_BF16, false, "dev via loop", true);
  EXPECT_OK(moe_grouped_set_backend(ctx, "auto"));
  /* wrong offsets on the device: clamped, no fault */
  double bad[] = {40, 500, 100, -7, 9999};
  moe_tensor *bo = NULL, *x = NULL, *w = NULL, *y = NULL, *dw = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, bad, 1, (int64_t[]){5}, MOE_I64, GPU, &bo));
  moe_tensor *xc = rand_cpu(ctx, 2, (int64_t[]){300, 64}, MOE_BF16), *wc = rand_cpu(ctx, 3, (int64_t[]){4, 64, 32}, MOE_BF16);
  x = on_gpu(ctx, xc), w = on_gpu(ctx, wc);
  EXPECT_OK(moe_grouped_mm_dev(ctx, x, w, bo, false, &y));
  EXPECT(y && y->shape[0] == 300 && y->shape[1] == 32);
  EXPECT_OK(moe_grouped_mm_wgrad_dev(ctx, x, x, bo, false, &dw));
  EXPECT(dw && dw->shape[0] == 4 && dw->shape[1] == 64 && dw->shape[2] == 64);
  EXPECT_OK(moe_cuda_synchronize(ctx, GPU));
  moe_tensor_release(bo), moe_tensor_release(x), moe_tensor_release(w), moe_tensor_release(y);
  moe_tensor_release(dw), moe_tensor_release(xc), moe_tensor_release(wc);
}

/* The gathering launchers (the GLU experts' grouped path with
 * MOE_BSMM_GATHER=1): rows read by a plan-like src from a token-order
 * tensor against the same launchers over the permuted copy made here, bit
 * for bit: forward (both transposes), the weight gradient gathering a or b.
 * src has padding rows (-1: zeros), the offsets leave rows outside both
 * ends, K and N are not multiples of 64; one CTA per tile and a persistent
 * grid of 3 CTAs. */
static moe_tensor *perm_rows(moe_ctx *ctx, moe_tensor *tok, const int64_t *src, int64_t R, int64_t k) {
  int64_t T = tok->shape[0], W = tok->shape[1];
  double *v = malloc(sizeof(double) * (size_t)(T * W)), *o = calloc((size_t)(R * W + 1), sizeof(double));
  moe_tensor *r = NULL;
  EXPECT_OK(moe_tensor_to_f64(ctx, tok, v));
  for (int64_t i = 0; i < R; i++)
    if (src[i] >= 0) memcpy(o + i * W, v + (src[i] / k) * W, sizeof(double) * (size_t)W);
  EXPECT_OK(moe_tensor_from_f64(ctx, o, 2, (int64_t[]){R, W}, MOE_BF16, GPU, &r));
  free(v), free(o);
  return r;
}

static bool bits_equal(moe_ctx *ctx, moe_tensor *a, moe_tensor *b, const char *what) {
  int64_t n = moe_tensor_numel(a);
  double *x = malloc(sizeof(double) * (size_t)(n + 1)), *y = malloc(sizeof(double) * (size_t)(n + 1));
  bool ok = moe_tensor_to_f64(ctx, a, x) == MOE_OK && moe_tensor_to_f64(ctx, b, y) == MOE_OK;
  for (int64_t i = 0; ok && i < n; i++)
    if (x[i] != y[i]) {
      fprintf(stderr, "%s: element %lld gathered %.9g permuted %.9g\n", what, (long long)i, x[i], y[i]);
      ok = false;
    }
  free(x), free(y);
  return ok;
}

static void check_gather_case(moe_ctx *ctx, int64_t T, int64_t k, int64_t K, int64_t N, int64_t G,
                              uint64_t seed) {
  int64_t R = T * k + T / 7 + 3; /* every assignment once, and padding rows */
  int64_t *src = malloc(sizeof(int64_t) * (size_t)R), *offs = malloc(sizeof(int64_t) * (size_t)(G + 1));
  for (int64_t i = 0; i < R; i++) src[i] = i < T * k ? i : -1;
  uint64_t s = seed;
  for (int64_t i = R - 1; i > 0; i--) { /* shuffled */
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    int64_t j = (int64_t)((s >> 33) % (uint64_t)(i + 1)), t = src[i];
    src[i] = src[j], src[j] = t;
  }
  random_offs(offs, G, R / 50, R - R / 40, seed);
  double *sv = malloc(sizeof(double) * (size_t)R), *ov = malloc(sizeof(double) * (size_t)(G + 1));
  for (int64_t i = 0; i < R; i++) sv[i] = (double)src[i];
  for (int64_t g = 0; g <= G; g++) ov[g] = (double)offs[g];
  moe_tensor *dsrc = NULL, *doffs = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, sv, 1, (int64_t[]){R}, MOE_I64, GPU, &dsrc));
  EXPECT_OK(moe_tensor_from_f64(ctx, ov, 1, (int64_t[]){G + 1}, MOE_I64, GPU, &doffs));
  moe_tensor *c[5] = {rand_cpu(ctx, 2, (int64_t[]){T, K}, MOE_BF16), rand_cpu(ctx, 3, (int64_t[]){G, K, N}, MOE_BF16),
                      rand_cpu(ctx, 3, (int64_t[]){G, N, K}, MOE_BF16), rand_cpu(ctx, 2, (int64_t[]){T, N}, MOE_BF16),
                      rand_cpu(ctx, 2, (int64_t[]){R, K}, MOE_BF16)};
  moe_tensor *xt = on_gpu(ctx, c[0]), *w = on_gpu(ctx, c[1]), *wt = on_gpu(ctx, c[2]), *bt = on_gpu(ctx, c[3]),
             *ar = on_gpu(ctx, c[4]);
  moe_tensor *xs = perm_rows(ctx, c[0], src, R, k), *bs = perm_rows(ctx, c[3], src, R, k);
  moe_wg_gather ga = {(const int64_t *)moe_tensor_data(dsrc), k, false}, gb = ga;
  gb.b_rows = true;
  const int64_t *o = (const int64_t *)moe_tensor_data(doffs);
  char what[128];
  for (int tw = 0; tw < 2; tw++) { /* forward: (R, N) */
    moe_tensor *y1 = NULL, *y2 = NULL;
    EXPECT_OK(moe_tensor_empty(ctx, 2, (int64_t[]){R, N}, MOE_BF16, GPU, &y1));
    EXPECT_OK(moe_tensor_empty(ctx, 2, (int64_t[]){R, N}, MOE_BF16, GPU, &y2));
    const void *wd = moe_tensor_data(tw ? wt : w);
    EXPECT_OK(moe_cuda_wg_grouped_mm(ctx, 0, moe_tensor_data(xs), wd, o, G, R, K, N, tw, moe_tensor_data(y1)));
    EXPECT_OK(moe_cuda_wg_grouped_mm_gather(ctx, 0, moe_tensor_data(xt), wd, NULL, NULL, o, &ga, NULL, G, R, K, N, tw,
                                            moe_tensor_data(y2)));
    snprintf(what, sizeof what, "mm_gather T=%lld k=%lld K=%lld N=%lld G=%lld trans_w=%d", (long long)T,
             (long long)k, (long long)K, (long long)N, (long long)G, tw);
    EXPECT(bits_equal(ctx, y2, y1, what));
    moe_tensor_release(y1), moe_tensor_release(y2);
  }
  for (int which = 0; which < 2; which++) { /* wgrad: gather a ((G, K, N) = xs^T bs), or b ((G, K, N) = ar^T bs) */
    moe_tensor *d1 = NULL, *d2 = NULL;
    EXPECT_OK(moe_tensor_empty(ctx, 3, (int64_t[]){G, K, N}, MOE_BF16, GPU, &d1));
    EXPECT_OK(moe_tensor_empty(ctx, 3, (int64_t[]){G, K, N}, MOE_BF16, GPU, &d2));
    const void *a = moe_tensor_data(which ? ar : xs), *b = moe_tensor_data(bs);
    EXPECT_OK(moe_cuda_wg_grouped_wgrad(ctx, 0, a, b, o, G, R, K, N, moe_tensor_data(d1)));
    if (which)
      EXPECT_OK(moe_cuda_wg_grouped_wgrad_gather(ctx, 0, a, moe_tensor_data(bt), o, &gb, G, R, K, N,
                                                 moe_tensor_data(d2)));
    else
      EXPECT_OK(moe_cuda_wg_grouped_wgrad_gather(ctx, 0, moe_tensor_data(xt), b, o, &ga, G, R, K, N,
                                                 moe_tensor_data(d2)));
    snprintf(what, sizeof what, "wgrad_gather %s T=%lld k=%lld K=%lld N=%lld G=%lld", which ? "b" : "a",
             (long long)T, (long long)k, (long long)K, (long long)N, (long long)G);
    EXPECT(bits_equal(ctx, d2, d1, what));
    moe_tensor_release(d1), moe_tensor_release(d2);
  }
  /* a gather with a summed second pair is refused */
  EXPECT_ERR_MSG(moe_cuda_wg_grouped_mm_gather(ctx, 0, moe_tensor_data(xt), moe_tensor_data(w),
                                               moe_tensor_data(xt), moe_tensor_data(w), o, &ga, NULL, G, R, K, N,
                                               false, moe_tensor_data(ar)),
                 MOE_ERR_INVALID_ARG, "a gather with a summed second pair");
  for (int i = 0; i < 5; i++) moe_tensor_release(c[i]);
  moe_tensor *t[] = {dsrc, doffs, xt, w, wt, bt, ar, xs, bs};
  for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) moe_tensor_release(t[i]);
  free(src), free(offs), free(sv), free(ov);
}

static void test_gather(moe_ctx *ctx) {
  const char *persist[] = {"0", "3"};
  for (int v = 0; v < 2; v++) {
    setenv("MOE_BSMM_PERSIST", persist[v], 1);
    EXPECT_OK(moe_knobs_reload(ctx));
    check_gather_case(ctx, 300, 2, 136, 72, 7, 21);  /* partial chunks and tiles */
    check_gather_case(ctx, 130, 8, 64, 264, 16, 22); /* k = 8 */
    check_gather_case(ctx, 257, 1, 512, 256, 3, 23); /* k = 1, more tiles than CTAs */
    check_gather_case(ctx, 100, 4, 8, 8, 64, 24);    /* tiny K, N; many empty groups */
  }
  unsetenv("MOE_BSMM_PERSIST");
  EXPECT_OK(moe_knobs_reload(ctx));
}

/* The sm_90a kernel's epilogues on GG: whole tiles stored by TMA and the
 * tiles that end inside the output (a group's last rows) by the threads
 * (the default), against every tile staged and stored by the threads
 * (MOE_BSMM_EPI=smem) and stored from registers (direct): the same bits,
 * forward and transposed, alone and with a summed second pair, one CTA a
 * tile and a persistent grid of 3. */
static void test_epilogues(moe_ctx *ctx) {
  int64_t offs[16];
  const int64_t R = 1000, K = 136, N = 328, G = 9;
  random_offs(offs, G, 3, 990, 31); /* partial tiles, rows outside both ends */
  double v[16];
  for (int64_t g = 0; g <= G; g++) v[g] = (double)offs[g];
  moe_tensor *o = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, v, 1, (int64_t[]){G + 1}, MOE_I64, GPU, &o));
  const char *epis[] = {"smem", "direct"}, *persist[] = {"0", "3"};
  for (int trans = 0; trans < 2; trans++) {
    int64_t ws[3] = {G, trans ? N : K, trans ? K : N};
    moe_tensor *c[4] = {rand_cpu(ctx, 2, (int64_t[]){R, K}, MOE_BF16), rand_cpu(ctx, 3, ws, MOE_BF16),
                        rand_cpu(ctx, 2, (int64_t[]){R, K}, MOE_BF16), rand_cpu(ctx, 3, ws, MOE_BF16)};
    moe_tensor *gp[4];
    for (int i = 0; i < 4; i++) gp[i] = on_gpu(ctx, c[i]);
    for (int sum = 0; sum < 2; sum++)
      for (int pi = 0; pi < 2; pi++) {
        setenv("MOE_BSMM_PERSIST", persist[pi], 1);
        EXPECT_OK(moe_knobs_reload(ctx));
        moe_tensor *ref = NULL;
        if (sum) EXPECT_OK(moe_grouped_mm_sum_dev(ctx, gp[0], gp[1], gp[2], gp[3], o, trans, &ref));
        else EXPECT_OK(moe_grouped_mm_dev(ctx, gp[0], gp[1], o, trans, &ref));
        for (int ei = 0; ei < 2; ei++) {
          setenv("MOE_BSMM_EPI", epis[ei], 1);
          EXPECT_OK(moe_knobs_reload(ctx));
          moe_tensor *y = NULL;
          if (sum) EXPECT_OK(moe_grouped_mm_sum_dev(ctx, gp[0], gp[1], gp[2], gp[3], o, trans, &y));
          else EXPECT_OK(moe_grouped_mm_dev(ctx, gp[0], gp[1], o, trans, &y));
          char what[96];
          snprintf(what, sizeof what, "epilogue %s trans %d sum %d persist %s", epis[ei], trans, sum, persist[pi]);
          EXPECT(y && ref && bits_equal(ctx, y, ref, what));
          moe_tensor_release(y);
          unsetenv("MOE_BSMM_EPI");
        }
        moe_tensor_release(ref);
      }
    unsetenv("MOE_BSMM_PERSIST");
    EXPECT_OK(moe_knobs_reload(ctx));
    for (int i = 0; i < 4; i++) moe_tensor_release(c[i]), moe_tensor_release(gp[i]);
  }
  moe_tensor_release(o);
}

/* The GLU experts' fused epilogues (moe_cuda_wg_grouped_glu, _glu_bwd)
 * against the products and the separate passes (moe_cuda_experts_glu_fwd,
 * _glu_bwd): h1, h3, a, dh1, dh3 and ga bit for bit, the gate gradient
 * (summed in another order) within 1e-5 of its largest magnitude; every
 * activation; gates or none, ga and the gate gradient or neither, h3 and h1
 * as dh3's and ga's buffers; partial tiles, rows outside both ends, N not a
 * multiple of the tiles' 128 or 256 columns; one CTA a tile and a
 * persistent grid of 3. */
static double max_abs_diff(moe_ctx *ctx, moe_tensor *a, moe_tensor *b, double *scale) {
  int64_t n = moe_tensor_numel(a);
  double *x = malloc(sizeof(double) * (size_t)(n + 1)), *y = malloc(sizeof(double) * (size_t)(n + 1)), d = 0;
  *scale = 0;
  if (moe_tensor_to_f64(ctx, a, x) != MOE_OK || moe_tensor_to_f64(ctx, b, y) != MOE_OK) d = INFINITY;
  for (int64_t i = 0; d != INFINITY && i < n; i++) {
    d = fmax(d, fabs(x[i] - y[i]));
    *scale = fmax(*scale, fabs(y[i]));
  }
  free(x), free(y);
  return d;
}

static void *dp(moe_tensor *t) { return t ? moe_tensor_data(t) : NULL; }

static void test_glu_epilogue(moe_ctx *ctx) {
  int64_t offs[16];
  const int64_t R = 1000, K = 136, N = 328, G = 9;
  random_offs(offs, G, 3, 990, 47);
  double v[16];
  for (int64_t g = 0; g <= G; g++) v[g] = (double)offs[g];
  moe_tensor *o = NULL, *gr = NULL, *gcpu = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, v, 1, (int64_t[]){G + 1}, MOE_I64, GPU, &o));
  EXPECT_OK(moe_tensor_empty(ctx, 1, (int64_t[]){R}, MOE_F32, MOE_CPU, &gcpu));
  if (gcpu) EXPECT_OK(moe_uniform_(ctx, gcpu, 0, 1));
  gr = on_gpu(ctx, gcpu);
  moe_tensor *c[5] = {rand_cpu(ctx, 2, (int64_t[]){R, K}, MOE_BF16), rand_cpu(ctx, 3, (int64_t[]){G, K, N}, MOE_BF16),
                      rand_cpu(ctx, 3, (int64_t[]){G, K, N}, MOE_BF16), rand_cpu(ctx, 2, (int64_t[]){R, K}, MOE_BF16),
                      rand_cpu(ctx, 3, (int64_t[]){G, N, K}, MOE_BF16)}; /* x, w1, w3, dy, w2 */
  moe_tensor *gp[5];
  for (int i = 0; i < 5; i++) gp[i] = on_gpu(ctx, c[i]);
  const int64_t *od = (const int64_t *)dp(o);
  const char *persist[] = {"0", "3"};
  for (int pi = 0; pi < 2; pi++) {
    setenv("MOE_BSMM_PERSIST", persist[pi], 1);
    EXPECT_OK(moe_knobs_reload(ctx));
    for (int act = 0; act < 3; act++) {
      char what[96];
      moe_tensor *h1 = NULL, *h3 = NULL, *a = NULL, *f[3] = {0};
      EXPECT_OK(moe_grouped_mm_dev(ctx, gp[0], gp[1], o, false, &h1));
      EXPECT_OK(moe_grouped_mm_dev(ctx, gp[0], gp[2], o, false, &h3));
      EXPECT_OK(moe_tensor_empty(ctx, 2, (int64_t[]){R, N}, MOE_BF16, GPU, &a));
      if (h1 && h3 && a) EXPECT_OK(moe_cuda_experts_glu_fwd(ctx, 0, MOE_BF16, act, R * N, dp(h1), dp(h3), dp(a)));
      for (int i = 0; i < 3; i++) EXPECT_OK(moe_tensor_empty(ctx, 2, (int64_t[]){R, N}, MOE_BF16, GPU, &f[i]));
      EXPECT_OK(moe_cuda_wg_grouped_glu(ctx, 0, dp(gp[0]), dp(gp[1]), dp(gp[2]), od, G, R, K, N, act, dp(f[0]),
                                        dp(f[1]), dp(f[2])));
      moe_tensor *fr[3] = {h1, h3, a};
      for (int i = 0; i < 3; i++) {
        snprintf(what, sizeof what, "glu forward tensor %d activation %d persist %s", i, act, persist[pi]);
        EXPECT(f[i] && fr[i] && bits_equal(ctx, f[i], fr[i], what));
      }
      /* backward: gates and both extras (0), neither (1), in place (2) */
      for (int form = 0; form < 3; form++) {
        bool gates = form != 1, extras = form != 1, inplace = form == 2;
        moe_tensor *r[4] = {0}, *b[4] = {0}, *h1c = NULL, *h3c = NULL; /* dh1, dh3, ga, dgate */
        EXPECT_OK(moe_grouped_mm_dev(ctx, gp[3], gp[4], o, true, &r[0]));
        EXPECT_OK(moe_tensor_empty(ctx, 2, (int64_t[]){R, N}, MOE_BF16, GPU, &r[1]));
        if (extras) EXPECT_OK(moe_tensor_empty(ctx, 2, (int64_t[]){R, N}, MOE_BF16, GPU, &r[2]));
        if (extras) EXPECT_OK(moe_tensor_empty(ctx, 1, (int64_t[]){R}, MOE_F32, GPU, &r[3]));
        if (r[0] && r[1])
          EXPECT_OK(moe_cuda_experts_glu_bwd(ctx, 0, MOE_BF16, act, R, N, 0, dp(r[0]), dp(h1), dp(h3),
                                             gates ? (const float *)dp(gr) : NULL, dp(r[1]), dp(r[2]),
                                             (float *)dp(r[3])));
        EXPECT_OK(moe_clone(ctx, h1, &h1c));
        EXPECT_OK(moe_clone(ctx, h3, &h3c));
        EXPECT_OK(moe_tensor_empty(ctx, 2, (int64_t[]){R, N}, MOE_BF16, GPU, &b[0]));
        if (inplace) moe_tensor_retain(b[1] = h3c), moe_tensor_retain(b[2] = h1c);
        else EXPECT_OK(moe_tensor_empty(ctx, 2, (int64_t[]){R, N}, MOE_BF16, GPU, &b[1]));
        if (extras && !inplace) EXPECT_OK(moe_tensor_empty(ctx, 2, (int64_t[]){R, N}, MOE_BF16, GPU, &b[2]));
        if (extras) EXPECT_OK(moe_tensor_empty(ctx, 1, (int64_t[]){R}, MOE_F32, GPU, &b[3]));
        EXPECT_OK(moe_cuda_wg_grouped_glu_bwd(ctx, 0, dp(gp[3]), dp(gp[4]), od, G, R, K, N, act, dp(h1c),
                                              dp(h3c), gates ? (const float *)dp(gr) : NULL, dp(b[0]),
                                              dp(b[1]), dp(b[2]), (float *)dp(b[3])));
        for (int i = 0; i < 3; i++) {
          if (!r[i] && !b[i]) continue;
          snprintf(what, sizeof what, "glu backward tensor %d activation %d form %d persist %s", i, act, form,
                   persist[pi]);
          EXPECT(r[i] && b[i] && bits_equal(ctx, b[i], r[i], what));
        }
        if (r[3] && b[3]) {
          double scale, d = max_abs_diff(ctx, b[3], r[3], &scale);
          if (!(d <= 1e-5 * scale && scale > 0))
            fprintf(stderr, "glu backward gate gradient activation %d: %g off (largest %g)\n", act, d, scale);
          EXPECT(d <= 1e-5 * scale && scale > 0);
        }
        for (int i = 0; i < 4; i++) moe_tensor_release(r[i]), moe_tensor_release(b[i]);
        moe_tensor_release(h1c), moe_tensor_release(h3c);
      }
      moe_tensor_release(h1), moe_tensor_release(h3), moe_tensor_release(a);
      for (int i = 0; i < 3; i++) moe_tensor_release(f[i]);
    }
  }
  unsetenv("MOE_BSMM_PERSIST");
  EXPECT_OK(moe_knobs_reload(ctx));
  for (int i = 0; i < 5; i++) moe_tensor_release(c[i]), moe_tensor_release(gp[i]);
  moe_tensor_release(o), moe_tensor_release(gr), moe_tensor_release(gcpu);
}

static void test_cuda_errors(moe_ctx *ctx) {
  moe_tensor *x = NULL, *w = NULL, *wc = NULL, *out = NULL;
  int64_t offs[] = {0, 2, 4};
  EXPECT_OK(moe_tensor_full(ctx, 2, (int64_t[]){4, 3}, 1, MOE_F64, GPU, &x));
  EXPECT_OK(moe_tensor_full(ctx, 3, (int64_t[]){2, 3, 2}, 1, MOE_F64, GPU, &w));
  EXPECT_OK(moe_tensor_full(ctx, 3, (int64_t[]){2, 3, 2}, 1, MOE_F32, MOE_CPU, &wc));
  EXPECT_ERR_MSG(moe_grouped_mm(ctx, x, w, offs, 2, false, &out), MOE_ERR_DTYPE,
                 "f64 is CPU only");
  moe_tensor *x32 = NULL;
  EXPECT_OK(moe_tensor_full(ctx, 2, (int64_t[]){4, 3}, 1, MOE_F32, GPU, &x32));
  EXPECT_ERR_MSG(moe_grouped_mm(ctx, x32, wc, offs, 2, false, &out), MOE_ERR_DEVICE,
                 "x is on cuda:0 but w is on cpu");
  EXPECT(out == NULL);
  moe_tensor_release(x), moe_tensor_release(w), moe_tensor_release(wc), moe_tensor_release(x32);
  /* the gathering launcher refuses what its kernel does not have: a gather
   * with a scatter in one product, a gather with a summed second pair */
  moe_tensor *t[6] = {0};
  double ov[3] = {0, 64, 128}, sv[128];
  for (int i = 0; i < 128; i++) sv[i] = i;
  EXPECT_OK(moe_tensor_full(ctx, 2, (int64_t[]){64, 64}, 1, MOE_BF16, GPU, &t[0]));     /* tokens */
  EXPECT_OK(moe_tensor_full(ctx, 3, (int64_t[]){2, 64, 64}, 1, MOE_BF16, GPU, &t[1]));  /* w */
  EXPECT_OK(moe_tensor_from_f64(ctx, ov, 1, (int64_t[]){3}, MOE_I64, GPU, &t[2]));      /* offsets */
  EXPECT_OK(moe_tensor_from_f64(ctx, sv, 1, (int64_t[]){128}, MOE_I64, GPU, &t[3]));    /* src, dst */
  EXPECT_OK(moe_tensor_full(ctx, 2, (int64_t[]){128, 64}, 0, MOE_BF16, GPU, &t[4]));    /* out */
  EXPECT_OK(moe_tensor_full(ctx, 2, (int64_t[]){128, 64}, 1, MOE_BF16, GPU, &t[5]));    /* x2 */
  if (t[0] && t[1] && t[2] && t[3] && t[4] && t[5]) {
    const int64_t *src = (const int64_t *)moe_tensor_data(t[3]), *o = (const int64_t *)moe_tensor_data(t[2]);
    moe_wg_gather gt = {src, 2, false};
    moe_wg_scatter sc = {src, NULL};
    EXPECT_ERR_MSG(moe_cuda_wg_grouped_mm_gather(ctx, 0, moe_tensor_data(t[0]), moe_tensor_data(t[1]), NULL,
                                                 NULL, o, &gt, &sc, 2, 128, 64, 64, false, moe_tensor_data(t[4])),
                   MOE_ERR_INVALID_ARG, "a gather and a scatter in one product");
    EXPECT_ERR_MSG(moe_cuda_wg_grouped_mm_gather(ctx, 0, moe_tensor_data(t[0]), moe_tensor_data(t[1]),
                                                 moe_tensor_data(t[5]), moe_tensor_data(t[1]), o, &gt, NULL, 2,
                                                 128, 64, 64, false, moe_tensor_data(t[4])),
                   MOE_ERR_INVALID_ARG, "a gather with a summed second pair");
  }
  /* the GLU launchers name a bad activation */
  if (t[0] && t[1] && t[2] && t[4])
    EXPECT_ERR_MSG(moe_cuda_wg_grouped_glu(ctx, 0, moe_tensor_data(t[0]), moe_tensor_data(t[1]),
                                           moe_tensor_data(t[1]), (const int64_t *)moe_tensor_data(t[2]), 2, 64,
                                           64, 64, 5, moe_tensor_data(t[4]), moe_tensor_data(t[4]),
                                           moe_tensor_data(t[4])),
                   MOE_ERR_INVALID_ARG, "grouped gemm glu: activation 5");
  for (int i = 0; i < 6; i++) moe_tensor_release(t[i]);
}

int main(void) {
  moe_ctx *ctx = harness_start();
  SKIP_IF_NO_GPU(ctx);
  RUN(test_loop);
  RUN(test_cublas_grouped);
  RUN(test_streams);
  RUN(test_auto);
  RUN(test_device_offsets);
  RUN(test_gather);
  RUN(test_epilogues);
  RUN(test_glu_epilogue);
  RUN(test_cuda_errors);
  return harness_end();
}
