/*
 * test_attention_cuda.c - the fused CUDA attention kernels against the CPU
 * reference, bf16, forward (out, lse) and backward (dq, dk, dv), at
 * T = 1, 17, 128, 1000, 2048, head dims 64 and 128, B and H > 1, causal and
 * not, default and explicit scales; strided inputs read in place (transposed (B, T, H, D) buffers) and
 * copied (a last dim that is not contiguous); autograd on the GPU; the
 * deterministic backward (MOE_ATTN_DETERMINISTIC=1) is bit-identical run to
 * run; the default kernels (TMA + wgmma on compute capability 9.x) and
 * the mma.sync ones (MOE_ATTN_WG=0) both; the errors for what the kernels do
 * not take. Exits 77 without a GPU.
 */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include "harness.h"
#include "knobs.h" /* moe_knobs_reload after setenv */

#ifdef MOE_WITH_CUDA
#include "attention_cuda.h" /* moe_cuda_attention_last */
#endif

/* The kernel family the last launch ran ("none" in a build without CUDA,
 * where every test here is skipped). */
static const char *last_family(bool backward) {
#ifdef MOE_WITH_CUDA
  return moe_cuda_attention_last(backward);
#else
  (void)backward;
  return "none";
#endif
}

/* The kernel family check_config expects the GPU to run (NULL: any). */
static const char *want_family = NULL;

static moe_device gpu(void) { return (moe_device){MOE_DEVICE_CUDA, 0}; }

/* A random bf16 CPU tensor of shape s, and its copy on the GPU (same values). */
static void pair(moe_ctx *ctx, const int64_t *s, moe_tensor **cpu, moe_tensor **dev) {
  *cpu = *dev = NULL;
  if (moe_tensor_empty(ctx, 4, s, MOE_BF16, MOE_CPU, cpu) != MOE_OK) return;
  moe_normal_(ctx, *cpu, 0.0, 1.0);
  moe_to(ctx, *cpu, MOE_BF16, gpu(), dev);
}

static double *values(moe_ctx *ctx, const moe_tensor *t) {
  int64_t n = moe_tensor_numel(t);
  double *v = (double *)malloc(sizeof(double) * (size_t)(n ? n : 1));
  if (moe_tensor_to_f64(ctx, t, v) != MOE_OK) {
    free(v);
    return NULL;
  }
  return v;
}

/* Whether |got - want| <= atol_rel * max(max|want|, 1e-3) + rtol * |want|
 * everywhere; prints the worst element. The floor of 1e-3 on the scale is
 * for gradients that are exactly 0 (T = 1: a softmax over one key has a zero
 * derivative), where fp32 rounding of dout.v - dout.o leaves ~1e-6. */
static bool close_to(moe_ctx *ctx, const char *what, const moe_tensor *got, const moe_tensor *want,
                     double atol_rel, double rtol) {
  int64_t n = moe_tensor_numel(want);
  if (!got || moe_tensor_numel(got) != n) return false;
  double *a = values(ctx, got), *b = values(ctx, want);
  if (!a || !b) {
    free(a), free(b);
    return false;
  }
  double mx = 0, worst = 0;
  int64_t wi = 0;
  for (int64_t i = 0; i < n; i++) mx = fmax(mx, fabs(b[i]));
  if (atol_rel > 0) mx = fmax(mx, 1e-3);
  bool ok = true;
  for (int64_t i = 0; i < n; i++) {
    double e = fabs(a[i] - b[i]), lim = atol_rel * mx + rtol * fabs(b[i]);
    if (!(e <= lim)) ok = false;
    if (!(e <= worst)) worst = e, wi = i;
  }
  if (!ok)
    fprintf(stderr, "  %s: worst element %lld: %.6g vs %.6g (max |ref| %.4g)\n", what,
            (long long)wi, a[wi], b[wi], mx);
  free(a), free(b);
  return ok;
}

/* One configuration: GPU forward and backward against the CPU reference on
 * the same bf16 values. Tolerances:
 *   out: the kernel rounds P to bf16 for the P V product (relative 2^-9 per
 *     term) and stores bf16 (2^-9): 1% of max|out| + 1% of |out|.
 *   lse: f32 from fp32-accumulated bf16 products of exact inputs: 1e-3
 *     absolute (|lse| < 15 here), written as 1e-4 of max + 1e-4 relative.
 *   dq, dk, dv: sums over up to T terms of products whose factors P, dS
 *     are rounded to bf16 (2^-9 each, errors add like sqrt(T)), stored bf16:
 *     2% of max|grad| + 2% of |grad|. */
static void check_config(moe_ctx *ctx, int64_t B, int64_t H, int64_t T, int64_t D, bool causal,
                         int layout, double scale) {
  int64_t s[4] = {B, H, T, D}, st[4] = {B, T, H, D}, sd[4] = {B, H, D, T};
  moe_tensor *qc, *kc, *vc, *rc, *qg, *kg, *vg, *rg;
  moe_tensor *qb = NULL, *qbg = NULL;
  if (layout == 1) { /* q read in place from a (B, T, H, D) buffer */
    pair(ctx, st, &qb, &qbg);
    moe_transpose(ctx, qb, 1, 2, &qc);
    moe_transpose(ctx, qbg, 1, 2, &qg);
  } else if (layout == 2) { /* q's last dim has stride T: copied first */
    pair(ctx, sd, &qb, &qbg);
    moe_transpose(ctx, qb, 2, 3, &qc);
    moe_transpose(ctx, qbg, 2, 3, &qg);
  } else {
    pair(ctx, s, &qc, &qg);
  }
  pair(ctx, s, &kc, &kg);
  pair(ctx, s, &vc, &vg);
  pair(ctx, s, &rc, &rg);
  moe_tensor *oc = NULL, *lc = NULL, *og = NULL, *lg = NULL, *gc[3] = {NULL}, *gg[3] = {NULL};
  EXPECT_OK(moe_attention_forward(ctx, qc, kc, vc, causal, scale, &oc, &lc));
  EXPECT_OK(moe_attention_forward(ctx, qg, kg, vg, causal, scale, &og, &lg));
  char what[120];
  snprintf(what, sizeof(what), "B=%lld H=%lld T=%lld D=%lld causal=%d layout=%d scale=%g",
           (long long)B, (long long)H, (long long)T, (long long)D, causal, layout, scale);
  bool ok = close_to(ctx, "out", og, oc, 1e-2, 1e-2);
  ok = close_to(ctx, "lse", lg, lc, 1e-4, 1e-4) && ok;
  /* backward from the GPU's own out and lse, against the CPU's from its own */
  EXPECT_OK(moe_attention_backward(ctx, qc, kc, vc, oc, lc, rc, causal, scale, &gc[0], &gc[1], &gc[2]));
  EXPECT_OK(moe_attention_backward(ctx, qg, kg, vg, og, lg, rg, causal, scale, &gg[0], &gg[1], &gg[2]));
  if (want_family) {
    const char *f = last_family(false), *b = last_family(true);
    if (strcmp(f, want_family) != 0 || strcmp(b, want_family) != 0)
      fprintf(stderr, "  kernels: forward %s, backward %s, expected %s\n", f, b, want_family);
    EXPECT(strcmp(f, want_family) == 0 && strcmp(b, want_family) == 0);
  }
  const char *names[3] = {"dq", "dk", "dv"};
  for (int i = 0; i < 3; i++) ok = close_to(ctx, names[i], gg[i], gc[i], 2e-2, 2e-2) && ok;
  if (!ok) fprintf(stderr, "  in %s\n", what);
  EXPECT(ok);
  moe_tensor *t[] = {qc, kc, vc, rc, qg, kg, vg, rg, qb, qbg, oc, lc, og, lg,
                     gc[0], gc[1], gc[2], gg[0], gg[1], gg[2]};
  for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++) moe_tensor_release(t[i]);
}

static void test_sizes(moe_ctx *ctx) {
  moe_rng_seed(ctx, 11);
  const int64_t Ts[5] = {1, 17, 128, 1000, 2048};
  for (int d = 0; d < 2; d++)
    for (int i = 0; i < 5; i++) {
      int64_t T = Ts[i], D = d ? 128 : 64;
      check_config(ctx, 2, T >= 1000 ? 2 : 3, T, D, true, 0, 0);
      if (T <= 1000) check_config(ctx, 1, 2, T, D, false, 0, 0);
    }
}

static void test_layouts(moe_ctx *ctx) {
  moe_rng_seed(ctx, 12);
  check_config(ctx, 2, 3, 77, 64, true, 1, 0);
  check_config(ctx, 2, 2, 130, 128, true, 1, 0);
  check_config(ctx, 1, 3, 33, 128, false, 2, 0);
  check_config(ctx, 3, 1, 65, 64, true, 2, 0);
  /* an explicit scale, negative too */
  check_config(ctx, 1, 2, 200, 128, true, 0, 0.3);
  check_config(ctx, 2, 1, 99, 64, false, 0, -0.2);
}

/* Autograd on the GPU equals the direct backward; with
 * MOE_ATTN_DETERMINISTIC=1 (dQ has its own pass: no atomics) a second
 * backward is bit-identical; by default (the wgmma kernels on an H100/H200
 * sum dQ with f32 atomics) dK and dV still are, dQ within bf16 rounding. */
static void check_autograd(moe_ctx *ctx, bool deterministic) {
  moe_rng_seed(ctx, 13);
  int64_t s[4] = {2, 4, 300, 128};
  moe_tensor *c[4], *g[4];
  for (int i = 0; i < 4; i++) pair(ctx, s, &c[i], &g[i]);
  for (int i = 0; i < 3; i++) EXPECT_OK(moe_set_requires_grad(ctx, g[i], true));
  moe_tensor *o = NULL, *o2 = NULL, *lse = NULL, *d1[3] = {NULL}, *d2[3] = {NULL};
  EXPECT_OK(moe_attention(ctx, g[0], g[1], g[2], true, 0, &o));
  EXPECT(o && moe_tensor_grad_fn(o) != NULL);
  EXPECT_OK(moe_backward(ctx, o, g[3], false));
  bool prev = moe_grad_set(ctx, false);
  EXPECT_OK(moe_attention_forward(ctx, g[0], g[1], g[2], true, 0, &o2, &lse));
  EXPECT_OK(moe_attention_backward(ctx, g[0], g[1], g[2], o2, lse, g[3], true, 0, &d1[0], &d1[1], &d1[2]));
  EXPECT_OK(moe_attention_backward(ctx, g[0], g[1], g[2], o2, lse, g[3], true, 0, &d2[0], &d2[1], &d2[2]));
  moe_grad_set(ctx, prev);
  for (int i = 0; i < 3; i++) {
    moe_tensor *ag = moe_tensor_grad(g[i]);
    /* dQ's atomic sums round to bf16 within one ulp (2^-8 relative) */
    double tol = deterministic || i > 0 ? 0 : 1.0 / 128;
    EXPECT(ag && close_to(ctx, "autograd", ag, d1[i], tol, tol));
    EXPECT(close_to(ctx, "repeat", d2[i], d1[i], tol, tol));
  }
  moe_tensor *t[] = {o, o2, lse, d1[0], d1[1], d1[2], d2[0], d2[1], d2[2]};
  for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++) moe_tensor_release(t[i]);
  for (int i = 0; i < 4; i++) moe_tensor_release(c[i]), moe_tensor_release(g[i]);
}

static void test_autograd_determinism(moe_ctx *ctx) {
  check_autograd(ctx, false);
  setenv("MOE_ATTN_DETERMINISTIC", "1", 1);
  EXPECT_OK(moe_knobs_reload(ctx)); /* the context reads knobs at creation */
  check_autograd(ctx, true);
  unsetenv("MOE_ATTN_DETERMINISTIC");
  EXPECT_OK(moe_knobs_reload(ctx));
}

/* The family the default runs here: "tma" on compute capability 9.x. */
static const char *default_family(moe_ctx *ctx) {
  int64_t s[4] = {1, 1, 64, 64};
  moe_tensor *c, *g, *o = NULL, *l = NULL;
  pair(ctx, s, &c, &g);
  EXPECT_OK(moe_attention_forward(ctx, g, g, g, true, 0, &o, &l));
  moe_tensor_release(o), moe_tensor_release(l), moe_tensor_release(c), moe_tensor_release(g);
  return last_family(false);
}

/* Every size and layout with the default kernels (the TMA ones on an
 * H100/H200: strided operands, transposed (B, T, H, D) buffers included,
 * go through tensor maps too). */
static void test_default_kernels(moe_ctx *ctx) {
  want_family = default_family(ctx);
  fprintf(stderr, "  default kernels: %s\n", want_family);
  test_sizes(ctx);
  test_layouts(ctx);
  want_family = NULL;
}

/* The mma.sync kernels (what GPUs other than 9.x run) at every size too. */
static void test_mma_sync_kernels(moe_ctx *ctx) {
  setenv("MOE_ATTN_WG", "0", 1);
  EXPECT_OK(moe_knobs_reload(ctx));
  want_family = "mma";
  test_sizes(ctx);
  test_layouts(ctx);
  want_family = NULL;
  unsetenv("MOE_ATTN_WG");
  EXPECT_OK(moe_knobs_reload(ctx));
}

/* The persistent TMA kernels with a grid of 3 blocks (MOE_ATTN_PERSISTENT=3):
 * every block runs many tiles, so the stage rings wrap across tiles. */
static void test_persistent_small_grid(moe_ctx *ctx) {
  want_family = default_family(ctx);
  setenv("MOE_ATTN_PERSISTENT", "3", 1);
  EXPECT_OK(moe_knobs_reload(ctx));
  moe_rng_seed(ctx, 14);
  check_config(ctx, 2, 3, 77, 64, true, 1, 0);
  check_config(ctx, 2, 3, 1000, 128, true, 0, 0);
  check_config(ctx, 3, 2, 520, 64, true, 2, 0);
  check_config(ctx, 2, 2, 300, 128, false, 0, 0);
  /* the block-major tile order (MOE_ATTN_ORDER=block; head-major is the
   * default), on 3 blocks and on the full grid */
  setenv("MOE_ATTN_ORDER", "block", 1);
  EXPECT_OK(moe_knobs_reload(ctx));
  check_config(ctx, 2, 3, 1000, 128, true, 0, 0);
  check_config(ctx, 3, 2, 520, 64, true, 2, 0);
  unsetenv("MOE_ATTN_PERSISTENT");
  EXPECT_OK(moe_knobs_reload(ctx));
  check_config(ctx, 2, 3, 77, 64, true, 1, 0);
  check_config(ctx, 2, 2, 1000, 128, true, 0, 0);
  unsetenv("MOE_ATTN_ORDER");
  EXPECT_OK(moe_knobs_reload(ctx));
  want_family = NULL;
}

static void test_errors(moe_ctx *ctx) {
  int64_t s[4] = {1, 2, 8, 32}, s64[4] = {1, 2, 8, 64};
  moe_tensor *a = NULL, *f = NULL, *o = NULL, *c = NULL;
  EXPECT_OK(moe_tensor_full(ctx, 4, s, 1, MOE_BF16, gpu(), &a));
  EXPECT_OK(moe_tensor_full(ctx, 4, s64, 1, MOE_F32, gpu(), &f));
  EXPECT_OK(moe_tensor_full(ctx, 4, s64, 1, MOE_BF16, MOE_CPU, &c));
  EXPECT_ERR_MSG(moe_attention(ctx, a, a, a, true, 0, &o), MOE_ERR_NOT_SUPPORTED, "head dim 32");
  EXPECT_ERR_MSG(moe_attention(ctx, f, f, f, true, 0, &o), MOE_ERR_NOT_SUPPORTED, "got f32");
  EXPECT_ERR_MSG(moe_attention(ctx, c, c, f, true, 0, &o), MOE_ERR_DTYPE, "v is f32");
  moe_tensor *cb = NULL;
  EXPECT_OK(moe_to(ctx, f, MOE_BF16, gpu(), &cb));
  EXPECT_ERR_MSG(moe_attention(ctx, c, c, cb, true, 0, &o), MOE_ERR_DEVICE, "v is on cuda:0");
  EXPECT(o == NULL);
  moe_tensor_release(a), moe_tensor_release(f), moe_tensor_release(c), moe_tensor_release(cb);
}

int main(void) {
  moe_ctx *ctx = harness_start();
  SKIP_IF_NO_GPU(ctx);
  RUN(test_default_kernels);
  RUN(test_persistent_small_grid);
  RUN(test_autograd_determinism);
  RUN(test_mma_sync_kernels);
  RUN(test_errors);
  return harness_end();
}
