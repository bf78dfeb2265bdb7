/*
 * test_experts_quant.c - glu_experts with its own quantization of the saved
 * pre-activations (moe_glu_experts_opts.quant_*) on the CPU:
 *   - the same bits as the general route (moe_quantize_hooks around the
 *     memory-optimized op, keeping x, gates and the weights): output and
 *     every gradient, 8 and 4 bits, a row and groups, stochastic rounding,
 *     grouped and sparse, f32 and bf16;
 *   - the forward output is not quantized (equal to quantization off);
 *   - gradient error bounds against quantization off;
 *   - the bytes kept for backward (codes and scales of h1 and h3 only);
 *   - hooks pushed by the caller do not touch the op's tensors;
 *   - no quantization without grad or below min_numel;
 *   - bad options give clear errors.
 */
#include "harness.h"
#include "moe_routing.h"

static uint64_t rng_state = 0x243f6a8885a308d3ull;
static double urand(void) { /* [-1, 1) */
  rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
  return (double)(rng_state >> 11) / 4503599627370496.0 - 1.0;
}

typedef struct qcase {
  int64_t T, k, E, d, f, bs; /* bs 0: dense plan (grouped only) */
} qcase;

typedef struct qinputs {
  double *v[6]; /* x (T, d), w1, w3 (E, d, f), w2 (E, f, d), gates (T, k), dout (T, d) */
  int64_t *ids;
} qinputs;

static void qin_make(const qcase *c, qinputs *in) {
  int64_t n[6] = {c->T * c->d, c->E * c->d * c->f, c->E * c->d * c->f, c->E * c->f * c->d,
                  c->T * c->k, c->T * c->d};
  double sc[6] = {1.0, 1.0 / sqrt((double)c->d), 1.0 / sqrt((double)c->d),
                  1.0 / sqrt((double)c->f), 1.0, 1.0};
  for (int i = 0; i < 6; i++) {
    in->v[i] = malloc(sizeof(double) * (size_t)n[i]);
    for (int64_t j = 0; j < n[i]; j++) in->v[i][j] = sc[i] * urand();
  }
  in->ids = malloc(sizeof(int64_t) * (size_t)(c->T * c->k));
  for (int64_t t = 0; t < c->T; t++)
    for (int64_t j = 0; j < c->k; j++) {
      int64_t e;
      bool dup;
      do {
        e = (int64_t)((urand() + 1.0) * 0.5 * (double)c->E) % c->E;
        dup = false;
        for (int64_t i = 0; i < j; i++) dup = dup || in->ids[t * c->k + i] == e;
      } while (dup);
      in->ids[t * c->k + j] = e;
    }
}

static void qin_free(qinputs *in) {
  for (int i = 0; i < 6; i++) free(in->v[i]);
  free(in->ids);
}

/* How a run saves: the op's own quantization, the general hooks around the
 * memory-optimized op, or nothing. */
typedef enum { Q_OWN = 0, Q_HOOKS = 1, Q_OFF = 2 } qmode;

typedef struct qrun {
  qmode mode;
  moe_glu_experts_opts o;         /* impl, act, quant_* (Q_OWN), read by Q_HOOKS */
  const moe_quant_hooks_opts *outer; /* hooks pushed around the call, or NULL */
  bool grad;                      /* inputs require grad */
  int64_t saved_bytes;            /* out: allocated after forward - before - output */
} qrun;

/* Runs glu_experts on the CPU in dtype dt; res[0] = out, res[1..5] = grads of
 * x, w1, w3, w2, gates (f64 copies; only res[0] without grad). */
static void run(moe_ctx *ctx, const qcase *c, const qinputs *in, moe_dtype dt, qrun *r,
                moe_tensor **res) {
  int64_t shapes[6][3] = {{c->T, c->d}, {c->E, c->d, c->f}, {c->E, c->d, c->f},
                          {c->E, c->f, c->d}, {c->T, c->k}, {c->T, c->d}};
  int nd[6] = {2, 3, 3, 3, 2, 2};
  moe_tensor *t[6] = {0};
  for (int i = 0; i < 6; i++) {
    EXPECT_OK(moe_tensor_from_f64(ctx, in->v[i], nd[i], shapes[i], dt, MOE_CPU, &t[i]));
    if (i < 5 && r->grad) EXPECT_OK(moe_set_requires_grad(ctx, t[i], true));
  }
  double *idv = malloc(sizeof(double) * (size_t)(c->T * c->k));
  for (int64_t i = 0; i < c->T * c->k; i++) idv[i] = (double)in->ids[i];
  moe_tensor *tid = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, idv, 2, (int64_t[]){c->T, c->k}, MOE_I64, MOE_CPU, &tid));
  free(idv);
  moe_routing_opts ro = moe_routing_opts_default();
  ro.block_size = c->bs;
  ro.ffn_hidden = c->bs ? c->f : 0;
  moe_routing_plan *p = NULL;
  EXPECT_OK(moe_routing_plan_new(ctx, tid, c->E, &ro, &p));
  moe_glu_experts_opts o = r->o;
  moe_quant_hooks_opts ho = moe_quant_hooks_opts_default(o.quant_bits ? o.quant_bits : 8);
  moe_tensor *const keep[5] = {t[0], t[1], t[2], t[3], t[4]};
  if (r->mode == Q_HOOKS) {
    ho.quant.group_size = o.quant_group_size;
    ho.quant.stochastic = o.quant_stochastic;
    ho.min_numel = o.quant_min_numel;
    ho.n_keep = 5;
    ho.keep = keep;
    o.quant_bits = 0;
    o.memory_optimized = true;
  } else if (r->mode == Q_OFF) {
    o.quant_bits = 0;
  }
  moe_rng_seed(ctx, 4242); /* stochastic rounding draws the same numbers */
  if (r->outer) EXPECT_OK(moe_quantize_hooks_push(ctx, r->outer));
  if (r->mode == Q_HOOKS) EXPECT_OK(moe_quantize_hooks_push(ctx, &ho));
  moe_memory_stats m0, m1;
  EXPECT_OK(moe_memory_stats_get(ctx, MOE_CPU, &m0));
  moe_tensor *out = NULL;
  if (p) EXPECT_OK(moe_glu_experts_ex(ctx, t[0], t[1], t[2], t[3], p, t[4], &o, &out));
  EXPECT_OK(moe_memory_stats_get(ctx, MOE_CPU, &m1));
  if (r->mode == Q_HOOKS) EXPECT_OK(moe_saved_hooks_pop(ctx));
  if (r->outer) EXPECT_OK(moe_saved_hooks_pop(ctx));
  if (out) {
    r->saved_bytes = m1.allocated - m0.allocated - (int64_t)moe_tensor_numel(out) *
                     (int64_t)moe_dtype_size(dt);
    EXPECT_OK(moe_to(ctx, out, MOE_F64, MOE_CPU, &res[0]));
    if (r->grad) {
      EXPECT_OK(moe_backward(ctx, out, t[5], false));
      for (int i = 0; i < 5; i++) {
        moe_tensor *g = moe_tensor_grad(t[i]);
        EXPECT(g != NULL);
        if (g) EXPECT_OK(moe_to(ctx, g, MOE_F64, MOE_CPU, &res[i + 1]));
      }
    }
  }
  moe_tensor_release(out);
  moe_tensor_release(tid);
  moe_routing_plan_release(p);
  for (int i = 0; i < 6; i++) moe_tensor_release(t[i]);
}

/* max |a - b| / max |b| */
static double rel_max(moe_ctx *ctx, moe_tensor *a, moe_tensor *b) {
  if (!a || !b || moe_tensor_numel(a) != moe_tensor_numel(b)) return INFINITY;
  int64_t n = moe_tensor_numel(a);
  double *va = malloc(sizeof(double) * (size_t)(n + 1)), *vb = malloc(sizeof(double) * (size_t)(n + 1));
  moe_tensor_to_f64(ctx, a, va);
  moe_tensor_to_f64(ctx, b, vb);
  double e = 0, s = 0;
  for (int64_t i = 0; i < n; i++) {
    e = fmax(e, fabs(va[i] - vb[i]));
    s = fmax(s, fabs(vb[i]));
  }
  free(va), free(vb);
  return s > 0 ? e / s : e;
}

static void release6(moe_tensor **t) {
  for (int i = 0; i < 6; i++) moe_tensor_release(t[i]), t[i] = NULL;
}

static const qcase CASES[] = {
    {40, 2, 4, 16, 64, 16},  /* sparse-capable: blocks of 16, f = 4 blocks */
    {33, 1, 3, 12, 40, 0},   /* dense only, T odd */
    {25, 3, 5, 8, 30, 0},    /* f = 30: 4-bit groups of 16 leave a ragged group */
};

/* The op's own quantization gives the bits of the hooks route, and its
 * forward output is the unquantized one. */
static void test_same_as_hooks(moe_ctx *ctx) {
  struct {
    int bits;
    int64_t G;
    bool stoch;
  } qs[] = {{8, 0, false}, {4, 16, false}, {8, 16, false}, {4, 0, false}, {8, 0, true}, {4, 16, true}};
  for (size_t ci = 0; ci < sizeof CASES / sizeof CASES[0]; ci++) {
    const qcase *c = &CASES[ci];
    qinputs in;
    qin_make(c, &in);
    for (int dti = 0; dti < 2; dti++) {
      moe_dtype dt = dti ? MOE_BF16 : MOE_F32;
      for (int impl = 0; impl < (c->bs ? 2 : 1); impl++) {
        for (size_t qi = 0; qi < sizeof qs / sizeof qs[0]; qi++) {
          qrun a = {.mode = Q_OWN, .grad = true}, b, off;
          a.o = moe_glu_experts_opts_default();
          a.o.impl = (moe_experts_impl)impl;
          a.o.quant_bits = qs[qi].bits;
          a.o.quant_group_size = qs[qi].G;
          a.o.quant_stochastic = qs[qi].stoch;
          a.o.quant_min_numel = 0;
          b = a, b.mode = Q_HOOKS;
          off = a, off.mode = Q_OFF;
          moe_tensor *ra[6] = {0}, *rb[6] = {0}, *ro[6] = {0};
          run(ctx, c, &in, dt, &a, ra);
          run(ctx, c, &in, dt, &b, rb);
          run(ctx, c, &in, dt, &off, ro);
          int bad = 0;
          for (int i = 0; i < 6; i++) bad += !(rel_max(ctx, ra[i], rb[i]) == 0.0);
          if (bad)
            fprintf(stderr, "case %zu %s impl %d bits %d G %lld stochastic %d: %d of 6 tensors "
                    "differ from the hooks route\n", ci, moe_dtype_name(dt), impl, qs[qi].bits,
                    (long long)qs[qi].G, (int)qs[qi].stoch, bad);
          EXPECT(bad == 0);
          EXPECT(rel_max(ctx, ra[0], ro[0]) == 0.0); /* forward not quantized */
          /* gradients: quantized, so not equal to off, but close: 8 bits
           * within 5% of each tensor's largest magnitude, 4 bits 40% */
          double bound = qs[qi].bits == 8 ? 0.05 : 0.4, worst = 0;
          for (int i = 1; i < 6; i++) worst = fmax(worst, rel_max(ctx, ra[i], ro[i]));
          EXPECT(worst > 0 && worst < bound);
          release6(ra), release6(rb), release6(ro);
        }
      }
    }
    qin_free(&in);
  }
}

/* What is kept for backward: the codes and scales of h1 and h3 and no bf16
 * copy of the hidden (off keeps h1 and h3; a is recomputed either way). */
static void test_saved_bytes(moe_ctx *ctx) {
  const qcase c = {64, 2, 4, 32, 256, 0};
  qinputs in;
  qin_make(&c, &in);
  int64_t R = c.T * c.k, hb = R * c.f * 2; /* one bf16 hidden */
  qrun off = {.mode = Q_OFF, .grad = true, .o = moe_glu_experts_opts_default()};
  moe_tensor *r[6] = {0};
  run(ctx, &c, &in, MOE_BF16, &off, r);
  release6(r);
  for (int b = 0; b < 2; b++) {
    qrun q = off;
    q.mode = Q_OWN;
    q.o.quant_bits = b ? 4 : 8;
    q.o.quant_group_size = b ? 128 : 0;
    run(ctx, &c, &in, MOE_BF16, &q, r);
    release6(r);
    /* codes: R f bytes (8 bits) or R f / 2 (4 bits), scales 4 bytes per
     * group, for each of h1 and h3 */
    int64_t codes = 2 * (b ? R * c.f / 2 + R * (c.f / 128) * 4 : R * c.f + R * 4);
    printf("  bf16 %d bits: saved %lld bytes (off %lld, hidden %lld each): quantized part %lld "
           "bytes\n", b ? 4 : 8, (long long)q.saved_bytes, (long long)off.saved_bytes,
           (long long)hb, (long long)codes);
    /* the non-hidden part (x, gates, weights are the caller's; the plan's
     * own buffers) is the same in both: off - 2 hb == q - codes */
    EXPECT(off.saved_bytes - 2 * hb == q.saved_bytes - codes);
  }
  qin_free(&in);
}

/* Hooks pushed by the caller (here 4 bits on everything) leave the op's
 * tensors alone when it quantizes itself; without grad or below min_numel
 * nothing is quantized. */
static void test_hooks_and_off(moe_ctx *ctx) {
  const qcase c = CASES[0];
  qinputs in;
  qin_make(&c, &in);
  moe_quant_hooks_opts outer = moe_quant_hooks_opts_default(4);
  outer.min_numel = 0;
  qrun a = {.mode = Q_OWN, .grad = true, .o = moe_glu_experts_opts_default()};
  a.o.quant_bits = 8;
  qrun b = a;
  b.outer = &outer;
  moe_tensor *ra[6] = {0}, *rb[6] = {0}, *ro[6] = {0};
  run(ctx, &c, &in, MOE_F32, &a, ra);
  run(ctx, &c, &in, MOE_F32, &b, rb);
  for (int i = 0; i < 6; i++) EXPECT(rel_max(ctx, rb[i], ra[i]) == 0.0);
  release6(ra), release6(rb);
  /* min_numel above the hidden's size: equal to off */
  qrun big = a, off = a;
  big.o.quant_min_numel = (int64_t)1 << 40; /* above any hidden (rows are padded) */
  off.mode = Q_OFF;
  run(ctx, &c, &in, MOE_F32, &big, ra);
  run(ctx, &c, &in, MOE_F32, &off, ro);
  for (int i = 0; i < 6; i++) {
    double e = rel_max(ctx, ra[i], ro[i]);
    if (e != 0.0) fprintf(stderr, "min_numel: tensor %d differs from off by %g\n", i, e);
    EXPECT(e == 0.0);
  }
  release6(ra);
  /* no grad: the forward runs, equal to off */
  qrun ng = a;
  ng.grad = false;
  run(ctx, &c, &in, MOE_F32, &ng, ra);
  EXPECT(rel_max(ctx, ra[0], ro[0]) == 0.0);
  release6(ra), release6(ro);
  qin_free(&in);
}

static void test_errors(moe_ctx *ctx) {
  const qcase c = CASES[1];
  qinputs in;
  qin_make(&c, &in);
  moe_tensor *x = NULL, *w1 = NULL, *w2 = NULL, *tid = NULL, *out = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, in.v[0], 2, (int64_t[]){c.T, c.d}, MOE_F32, MOE_CPU, &x));
  EXPECT_OK(moe_tensor_from_f64(ctx, in.v[1], 3, (int64_t[]){c.E, c.d, c.f}, MOE_F32, MOE_CPU, &w1));
  EXPECT_OK(moe_tensor_from_f64(ctx, in.v[3], 3, (int64_t[]){c.E, c.f, c.d}, MOE_F32, MOE_CPU, &w2));
  double *idv = malloc(sizeof(double) * (size_t)(c.T * c.k));
  for (int64_t i = 0; i < c.T * c.k; i++) idv[i] = (double)in.ids[i];
  EXPECT_OK(moe_tensor_from_f64(ctx, idv, 2, (int64_t[]){c.T, c.k}, MOE_I64, MOE_CPU, &tid));
  free(idv);
  moe_routing_opts ro = moe_routing_opts_default();
  moe_routing_plan *p = NULL;
  EXPECT_OK(moe_routing_plan_new(ctx, tid, c.E, &ro, &p));
  moe_glu_experts_opts o = moe_glu_experts_opts_default();
  o.quant_bits = 5;
  EXPECT_ERR_MSG(moe_glu_experts_ex(ctx, x, w1, w1, w2, p, NULL, &o, &out), MOE_ERR_INVALID_ARG,
                 "glu_experts: quantize bits must be 8 or 4 (0: off), got 5");
  o.quant_bits = 4;
  o.quant_group_size = 7;
  EXPECT_ERR_MSG(moe_glu_experts_ex(ctx, x, w1, w1, w2, p, NULL, &o, &out), MOE_ERR_INVALID_ARG,
                 "even for 4 bits, got 7");
  o.quant_group_size = -2;
  EXPECT_ERR_MSG(moe_glu_experts_ex(ctx, x, w1, w1, w2, p, NULL, &o, &out), MOE_ERR_INVALID_ARG,
                 "group_size must be >= 0");
  o.quant_group_size = 0;
  o.quant_min_numel = -1;
  EXPECT_ERR_MSG(moe_glu_experts_ex(ctx, x, w1, w1, w2, p, NULL, &o, &out), MOE_ERR_INVALID_ARG,
                 "min_numel must be >= 0");
  EXPECT(out == NULL);
  moe_tensor_release(x), moe_tensor_release(w1), moe_tensor_release(w2), moe_tensor_release(tid);
  moe_routing_plan_release(p);
  qin_free(&in);
}

int main(void) {
  RUN(test_same_as_hooks);
  RUN(test_saved_bytes);
  RUN(test_hooks_and_off);
  RUN(test_errors);
  return harness_end();
}
