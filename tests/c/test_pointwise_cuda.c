/*
 * test_pointwise_cuda.c - the pointwise family on CUDA against the CPU
 * reference: every op forward and backward on random inputs in f32, bf16 and
 * f16 at awkward layouts (one element, odd sizes, a large odd 1-d tensor, a
 * contiguous view whose data pointer is not 16-byte aligned, a transposed
 * view), comparisons and dropout bit for bit. Exits 77 without a GPU.
 *
 * Tolerances (|gpu - cpu| <= atol + rtol |cpu|), per compute dtype:
 *   f32  rtol 2e-5, atol 1e-6: the same formulas in float on both sides, but
 *        CUDA's expf/erff/tanhf/powf (<= 2 ulp) differ from glibc's and nvcc
 *        fuses multiply-adds where the CPU build does not (-ffp-contract=off);
 *        a formula chains up to ~10 roundings, so a few ulp of 2^-23.
 *   bf16 rtol 1e-2, atol 1e-6: float results a few ulp apart can round to
 *        neighbouring bf16 values, one bf16 ulp = 2^-8..2^-7 relative.
 *   f16  rtol 2e-3, atol 1e-5: one f16 ulp = 2^-11..2^-10 relative, plus
 *        f16 subnormals (spacing 6e-8) near 0.
 *   comparisons, where, abs, relu, clamp, maximum, minimum, dropout: exact
 *        (selections and single IEEE multiplies give identical bits).
 */
#include "harness.h"

#define SHAPE(...) (int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (int64_t[]){__VA_ARGS__}

static moe_device gpu0(void) { return (moe_device){MOE_DEVICE_CUDA, 0}; }

typedef struct tol {
  double rtol, atol;
} tol;

static tol tol_of(moe_dtype dt) {
  switch (dt) {
    case MOE_BF16: return (tol){1e-2, 1e-6};
    case MOE_F16: return (tol){2e-3, 1e-5};
    default: return (tol){2e-5, 1e-6};
  }
}

/* gpu (any device) matches cpu element by element within t. */
static bool match(moe_ctx *ctx, const moe_tensor *cpu, const moe_tensor *gpu, tol t,
                  const char *what) {
  if (!cpu || !gpu) {
    fprintf(stderr, "%s: missing tensor\n", what);
    return false;
  }
  int64_t n = moe_tensor_numel(cpu);
  if (n != moe_tensor_numel(gpu) || cpu->dtype != gpu->dtype || cpu->ndim != gpu->ndim) {
    fprintf(stderr, "%s: shape or dtype differ\n", what);
    return false;
  }
  double *a = malloc(sizeof(double) * (size_t)(n ? n : 1)), *b = malloc(sizeof(double) * (size_t)(n ? n : 1));
  bool ok = moe_tensor_to_f64(harness_ctx, cpu, a) == MOE_OK &&
            moe_tensor_to_f64(harness_ctx, gpu, b) == MOE_OK;
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; ok && i < n; i++) {
    bool same = (isnan(a[i]) && isnan(b[i])) || a[i] == b[i] ||
                fabs(a[i] - b[i]) <= t.atol + t.rtol * fabs(a[i]);
    if (!same && bad++ == 0) first = i;
  }
  if (bad) {
    fprintf(stderr, "%s: %lld of %lld differ; first at %lld: cpu %.9g gpu %.9g\n", what,
            (long long)bad, (long long)n, (long long)first, a[first], b[first]);
    ok = false;
  }
  free(a);
  free(b);
  (void)ctx;
  return ok;
}

/* ------------------------------------------------------------- layouts */

enum { L_ONE, L_ODD, L_LARGE, L_MISALIGNED, L_TRANSPOSED, L_COUNT };
static const char *const layout_names[L_COUNT] = {"one", "odd", "large", "misaligned",
                                                  "transposed"};

/* The layout's view of base (shape chosen by make_base). */
static moe_tensor *layout_view(moe_ctx *ctx, moe_tensor *base, int layout) {
  moe_tensor *v = NULL;
  if (layout == L_MISALIGNED) EXPECT_OK(moe_narrow(ctx, base, 0, 1, base->shape[0] - 1, &v));
  else if (layout == L_TRANSPOSED) EXPECT_OK(moe_transpose(ctx, base, 0, 1, &v));
  else {
    moe_tensor_retain(base);
    v = base;
  }
  return v;
}

static moe_tensor *make_base(moe_ctx *ctx, int layout, double lo, double hi) {
  moe_tensor *t = NULL;
  switch (layout) {
    case L_ONE: EXPECT_OK(moe_tensor_empty(ctx, SHAPE(1), MOE_F32, MOE_CPU, &t)); break;
    case L_ODD: EXPECT_OK(moe_tensor_empty(ctx, SHAPE(3, 7), MOE_F32, MOE_CPU, &t)); break;
    case L_LARGE: EXPECT_OK(moe_tensor_empty(ctx, SHAPE(1000003), MOE_F32, MOE_CPU, &t)); break;
    case L_MISALIGNED: EXPECT_OK(moe_tensor_empty(ctx, SHAPE(4099), MOE_F32, MOE_CPU, &t)); break;
    default: EXPECT_OK(moe_tensor_empty(ctx, SHAPE(257, 129), MOE_F32, MOE_CPU, &t)); break;
  }
  EXPECT_OK(moe_uniform_(ctx, t, lo, hi));
  return t;
}

/* The same values of layout `layout` and dtype dt on CPU (*c) and GPU (*g),
 * each a leaf (no history) requiring grad when grad is set. */
static void make_pair(moe_ctx *ctx, int layout, moe_dtype dt, double lo, double hi, bool grad,
                      moe_tensor **c, moe_tensor **g) {
  moe_tensor *base = make_base(ctx, layout, lo, hi), *bc = NULL, *bg = NULL;
  EXPECT_OK(moe_to(ctx, base, dt, MOE_CPU, &bc));
  EXPECT_OK(moe_to(ctx, base, dt, gpu0(), &bg));
  *c = layout_view(ctx, bc, layout);
  *g = layout_view(ctx, bg, layout);
  if (grad && moe_dtype_is_float(dt)) {
    EXPECT_OK(moe_set_requires_grad(ctx, *c, true));
    EXPECT_OK(moe_set_requires_grad(ctx, *g, true));
  }
  moe_tensor_release(bg);
  moe_tensor_release(bc);
  moe_tensor_release(base);
}

/* A random cotangent of t's shape and dtype on CPU and GPU. */
static void make_cotangent(moe_ctx *ctx, const moe_tensor *t, moe_tensor **c, moe_tensor **g) {
  moe_tensor *r = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, t->ndim, t->shape, MOE_F32, MOE_CPU, &r));
  EXPECT_OK(moe_uniform_(ctx, r, -1, 1));
  EXPECT_OK(moe_to(ctx, r, t->dtype, MOE_CPU, c));
  EXPECT_OK(moe_to(ctx, r, t->dtype, gpu0(), g));
  moe_tensor_release(r);
}

static const moe_dtype float_dts[3] = {MOE_F32, MOE_BF16, MOE_F16};

/* --------------------------------------------------------------- unary */

typedef struct unary_case {
  const char *name;
  moe_status (*fn)(moe_ctx *, moe_tensor *, moe_tensor **);
  double lo, hi;
  bool exact; /* selections: bit-identical */
} unary_case;

static moe_status clamp_both(moe_ctx *ctx, moe_tensor *x, moe_tensor **out) {
  return moe_clamp(ctx, x, -0.5, 0.7, out);
}
static moe_status clamp_max(moe_ctx *ctx, moe_tensor *x, moe_tensor **out) {
  return moe_clamp(ctx, x, NAN, 0.2, out);
}
static moe_status pow_25(moe_ctx *ctx, moe_tensor *x, moe_tensor **out) {
  return moe_pow_scalar(ctx, x, 2.5, out);
}
static moe_status rpow_17(moe_ctx *ctx, moe_tensor *x, moe_tensor **out) {
  return moe_rpow_scalar(ctx, 1.7, x, out);
}
static moe_status dropout_03(moe_ctx *ctx, moe_tensor *x, moe_tensor **out) {
  return moe_dropout(ctx, x, 0.3, true, out);
}

static const unary_case unary_cases[] = {
    {"exp", moe_exp, -3, 3, false},         {"log", moe_log, 0.1, 4, false},
    {"sqrt", moe_sqrt, 0.1, 4, false},      {"rsqrt", moe_rsqrt, 0.1, 4, false},
    {"abs", moe_abs, -2, 2, true},          {"relu", moe_relu, -2, 2, true},
    {"gelu", moe_gelu, -4, 4, false},       {"gelu_tanh", moe_gelu_tanh, -4, 4, false},
    {"silu", moe_silu, -6, 6, false},       {"sigmoid", moe_sigmoid, -6, 6, false},
    {"tanh", moe_tanh, -3, 3, false},       {"clamp", clamp_both, -2, 2, true},
    {"clamp_max", clamp_max, -2, 2, true},  {"pow", pow_25, 0.2, 2, false},
    {"rpow", rpow_17, -2, 2, false},        {"dropout", dropout_03, -2, 2, true},
};
#define N_UNARY (int)(sizeof(unary_cases) / sizeof(unary_cases[0]))

static void test_unary_vs_cpu(moe_ctx *ctx) {
  for (int c = 0; c < N_UNARY; c++) {
    const unary_case *uc = &unary_cases[c];
    for (int k = 0; k < 3; k++) {
      tol t = uc->exact ? (tol){0, 0} : tol_of(float_dts[k]);
      for (int l = 0; l < L_COUNT; l++) {
        char what[96];
        snprintf(what, sizeof(what), "%s %s %s", uc->name, moe_dtype_name(float_dts[k]), layout_names[l]);
        moe_tensor *xc = NULL, *xg = NULL, *yc = NULL, *yg = NULL, *gc = NULL, *gg = NULL;
        make_pair(ctx, l, float_dts[k], uc->lo, uc->hi, true, &xc, &xg);
        uint64_t seed, call;
        moe_rng_get_state(ctx, &seed, &call); /* dropout: the same mask on both */
        EXPECT_OK(uc->fn(ctx, xc, &yc));
        moe_rng_set_state(ctx, seed, call);
        EXPECT_OK(uc->fn(ctx, xg, &yg));
        if (!match(ctx, yc, yg, t, what)) harness_failures++;
        harness_checks++;
        make_cotangent(ctx, yc, &gc, &gg);
        EXPECT_OK(moe_backward(ctx, yc, gc, false));
        EXPECT_OK(moe_backward(ctx, yg, gg, false));
        strncat(what, " grad", sizeof(what) - strlen(what) - 1);
        /* the gradients of selections multiply g by 0, 1 or a constant:
         * exact; smooth ops: the dtype's tolerance */
        if (!match(ctx, moe_tensor_grad(xc), moe_tensor_grad(xg), t, what)) harness_failures++;
        harness_checks++;
        moe_tensor_release(gg);
        moe_tensor_release(gc);
        moe_tensor_release(yg);
        moe_tensor_release(yc);
        moe_tensor_release(xg);
        moe_tensor_release(xc);
      }
    }
  }
}

/* -------------------------------------------------------------- binary */

typedef struct binary_case {
  const char *name;
  moe_status (*fn)(moe_ctx *, moe_tensor *, moe_tensor *, moe_tensor **);
  double lo, hi;
  bool exact;
} binary_case;

static const binary_case binary_cases[] = {
    {"pow", moe_pow, 0.2, 2, false},
    {"maximum", moe_maximum, -2, 2, true},
    {"minimum", moe_minimum, -2, 2, true},
    {"swiglu", moe_swiglu, -5, 5, false},
};

/* a and b of one layout (same shape), and a with a broadcast row b. */
static void test_binary_vs_cpu(moe_ctx *ctx) {
  for (int c = 0; c < 4; c++) {
    const binary_case *bc = &binary_cases[c];
    for (int k = 0; k < 3; k++) {
      /* maximum/minimum: exact forward; gradients are g, g/2 or 0: exact */
      tol t = bc->exact ? (tol){0, 0} : tol_of(float_dts[k]);
      for (int l = 0; l < L_COUNT + 1; l++) {
        bool bcast = l == L_COUNT; /* (257, 129) transposed with a broadcast (129,) row... */
        if (bcast && c == 3) continue; /* swiglu does not broadcast */
        int lay = bcast ? L_TRANSPOSED : l;
        char what[96];
        snprintf(what, sizeof(what), "%s %s %s", bc->name, moe_dtype_name(float_dts[k]),
                 bcast ? "broadcast" : layout_names[l]);
        moe_tensor *ac = NULL, *ag = NULL, *bc_ = NULL, *bg = NULL;
        make_pair(ctx, lay, float_dts[k], bc->lo, bc->hi, true, &ac, &ag);
        if (bcast) {
          moe_tensor *r = NULL, *rc = NULL, *rg = NULL;
          EXPECT_OK(moe_tensor_empty(ctx, SHAPE(257), MOE_F32, MOE_CPU, &r));
          EXPECT_OK(moe_uniform_(ctx, r, bc->lo, bc->hi));
          EXPECT_OK(moe_to(ctx, r, float_dts[k], MOE_CPU, &rc));
          EXPECT_OK(moe_to(ctx, r, float_dts[k], gpu0(), &rg));
          EXPECT_OK(moe_set_requires_grad(ctx, rc, true));
          EXPECT_OK(moe_set_requires_grad(ctx, rg, true));
          bc_ = rc, bg = rg;
          moe_tensor_release(r);
        } else {
          make_pair(ctx, lay, float_dts[k], bc->lo, bc->hi, true, &bc_, &bg);
        }
        moe_tensor *yc = NULL, *yg = NULL, *gc = NULL, *gg = NULL;
        EXPECT_OK(bc->fn(ctx, ac, bc_, &yc));
        EXPECT_OK(bc->fn(ctx, ag, bg, &yg));
        if (!match(ctx, yc, yg, t, what)) harness_failures++;
        harness_checks++;
        make_cotangent(ctx, yc, &gc, &gg);
        EXPECT_OK(moe_backward(ctx, yc, gc, false));
        EXPECT_OK(moe_backward(ctx, yg, gg, false));
        /* broadcast gradients are sums over 129 rows: the reduction's
         * summation order differs, so allow the dtype tolerance there */
        tol tg = bcast ? tol_of(float_dts[k]) : t;
        if (bcast) tg.atol = 1e-4;
        char w2[112];
        snprintf(w2, sizeof(w2), "%s grad a", what);
        if (!match(ctx, moe_tensor_grad(ac), moe_tensor_grad(ag), t, w2)) harness_failures++;
        snprintf(w2, sizeof(w2), "%s grad b", what);
        if (!match(ctx, moe_tensor_grad(bc_), moe_tensor_grad(bg), tg, w2)) harness_failures++;
        harness_checks += 2;
        moe_tensor_release(gg);
        moe_tensor_release(gc);
        moe_tensor_release(yg);
        moe_tensor_release(yc);
        moe_tensor_release(bg);
        moe_tensor_release(bc_);
        moe_tensor_release(ag);
        moe_tensor_release(ac);
      }
    }
  }
}

/* ------------------------------------------- comparisons, where, ints */

static void test_select_vs_cpu(moe_ctx *ctx) {
  const moe_op ops[6] = {MOE_OP_EQ, MOE_OP_NE, MOE_OP_LT, MOE_OP_LE, MOE_OP_GT, MOE_OP_GE};
  for (int l = 0; l < L_COUNT; l++) {
    moe_tensor *ac = NULL, *ag = NULL, *bc = NULL, *bg = NULL;
    /* few distinct values (integers in [-2, 2] as bf16) so that ties occur */
    moe_tensor *base = make_base(ctx, l, -2.5, 2.5), *r = NULL;
    EXPECT_OK(moe_tensor_empty(ctx, base->ndim, base->shape, MOE_I64, MOE_CPU, &r));
    EXPECT_OK(moe_copy_(ctx, r, base)); /* truncates toward zero */
    moe_tensor *rb = NULL, *rbg = NULL;
    EXPECT_OK(moe_to(ctx, r, MOE_BF16, MOE_CPU, &rb));
    EXPECT_OK(moe_to(ctx, r, MOE_BF16, gpu0(), &rbg));
    ac = layout_view(ctx, rb, l);
    ag = layout_view(ctx, rbg, l);
    make_pair(ctx, l, MOE_F32, -2, 2, false, &bc, &bg);
    for (int k = 0; k < 6; k++) {
      moe_tensor *yc = NULL, *yg = NULL;
      EXPECT_OK(moe_compare(ctx, ops[k], ac, bc, &yc));
      EXPECT_OK(moe_compare(ctx, ops[k], ag, bg, &yg));
      EXPECT(match(ctx, yc, yg, (tol){0, 0}, moe_op_name(ops[k])));
      moe_tensor_release(yg);
      moe_tensor_release(yc);
      EXPECT_OK(moe_compare_scalar(ctx, ops[k], ac, 1, &yc));
      EXPECT_OK(moe_compare_scalar(ctx, ops[k], ag, 1, &yg));
      EXPECT(match(ctx, yc, yg, (tol){0, 0}, moe_op_name(ops[k])));
      if (k == 2) { /* where(a < 1, a, b) forward and backward */
        moe_tensor *wc = NULL, *wg = NULL;
        EXPECT_OK(moe_where(ctx, yc, ac, bc, &wc));
        EXPECT_OK(moe_where(ctx, yg, ag, bg, &wg));
        EXPECT(match(ctx, wc, wg, (tol){0, 0}, "where"));
        moe_tensor_release(wg);
        moe_tensor_release(wc);
      }
      moe_tensor_release(yg);
      moe_tensor_release(yc);
    }
    /* integer tensors: abs, clamp, maximum, comparisons in int64 */
    moe_tensor *ic = layout_view(ctx, r, l), *ig = NULL, *rg = NULL, *yc = NULL, *yg = NULL;
    EXPECT_OK(moe_to(ctx, r, MOE_I64, gpu0(), &rg));
    ig = layout_view(ctx, rg, l);
    EXPECT_OK(moe_clamp(ctx, ic, -1, 1, &yc));
    EXPECT_OK(moe_clamp(ctx, ig, -1, 1, &yg));
    EXPECT(yc && yg && yg->dtype == MOE_I64 && match(ctx, yc, yg, (tol){0, 0}, "clamp i64"));
    moe_tensor_release(yg);
    moe_tensor_release(yc);
    EXPECT_OK(moe_abs(ctx, ic, &yc));
    EXPECT_OK(moe_abs(ctx, ig, &yg));
    EXPECT(match(ctx, yc, yg, (tol){0, 0}, "abs i64"));
    moe_tensor_release(yg);
    moe_tensor_release(yc);
    EXPECT_OK(moe_maximum(ctx, ic, ac, &yc)); /* i64 with bf16 gives bf16 */
    EXPECT_OK(moe_maximum(ctx, ig, ag, &yg));
    EXPECT(match(ctx, yc, yg, (tol){0, 0}, "maximum i64 bf16"));
    moe_tensor_release(yg);
    moe_tensor_release(yc);
    EXPECT_OK(moe_compare_scalar(ctx, MOE_OP_GE, ic, 0, &yc));
    EXPECT_OK(moe_compare_scalar(ctx, MOE_OP_GE, ig, 0, &yg));
    EXPECT(match(ctx, yc, yg, (tol){0, 0}, "ge i64"));
    moe_tensor_release(yg);
    moe_tensor_release(yc);
    moe_tensor_release(ig);
    moe_tensor_release(rg);
    moe_tensor_release(ic);
    moe_tensor_release(bg);
    moe_tensor_release(bc);
    moe_tensor_release(ag);
    moe_tensor_release(ac);
    moe_tensor_release(rbg);
    moe_tensor_release(rb);
    moe_tensor_release(r);
    moe_tensor_release(base);
  }
}

/* Dropout on the GPU: the mask of the CPU, a fraction near 1 - p, f64 too. */
static void test_dropout_gpu(moe_ctx *ctx) {
  moe_tensor *x = NULL, *xg = NULL, *yc = NULL, *yg = NULL;
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(1 << 20), 1.0, MOE_F64, MOE_CPU, &x));
  EXPECT_OK(moe_to(ctx, x, MOE_F64, gpu0(), &xg));
  moe_rng_set_state(ctx, 99, 3);
  EXPECT_OK(moe_dropout(ctx, x, 0.25, true, &yc));
  moe_rng_set_state(ctx, 99, 3);
  EXPECT_OK(moe_dropout(ctx, xg, 0.25, true, &yg));
  EXPECT(match(ctx, yc, yg, (tol){0, 0}, "dropout f64"));
  double *v = malloc(sizeof(double) << 20);
  EXPECT_OK(moe_tensor_to_f64(ctx, yg, v));
  int64_t kept = 0;
  for (int64_t i = 0; i < (1 << 20); i++) kept += v[i] != 0;
  /* 786432 expected, sd ~443: 10 sd either side */
  EXPECT(kept > 786432 - 4430 && kept < 786432 + 4430);
  free(v);
  moe_tensor_release(yg);
  moe_tensor_release(yc);
  moe_tensor_release(xg);
  moe_tensor_release(x);
}

static void test_errors_gpu(moe_ctx *ctx) {
  moe_tensor *c = NULL, *g = NULL, *y = NULL;
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(3), 1, MOE_F32, MOE_CPU, &c));
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(3), 1, MOE_F32, gpu0(), &g));
  EXPECT_ERR_MSG(moe_pow(ctx, c, g, &y), MOE_ERR_DEVICE, "pow: a is on cpu but b is on cuda:0");
  EXPECT_ERR_MSG(moe_swiglu(ctx, g, c, &y), MOE_ERR_DEVICE, "swiglu: gate is on cuda:0");
  EXPECT_ERR_MSG(moe_compare(ctx, MOE_OP_EQ, g, c, &y), MOE_ERR_DEVICE, "eq");
  moe_tensor *cond = NULL;
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(3), 1, MOE_BOOL, gpu0(), &cond));
  EXPECT_ERR_MSG(moe_where(ctx, cond, g, c, &y), MOE_ERR_DEVICE, "where: cond is on cuda:0 but b is on cpu");
  EXPECT(y == NULL);
  moe_tensor_release(cond);
  moe_tensor_release(g);
  moe_tensor_release(c);
}

int main(void) {
  moe_ctx *ctx = harness_start();
  SKIP_IF_NO_GPU(ctx);
  moe_rng_seed(ctx, 2026);
  RUN(test_unary_vs_cpu);
  RUN(test_binary_vs_cpu);
  RUN(test_select_vs_cpu);
  RUN(test_dropout_gpu);
  RUN(test_errors_gpu);
  return harness_end();
}
