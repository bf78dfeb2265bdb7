/*
 * test_knobs.c - the kernel tuning knobs (core/knobs.h): the table's
 * defaults are what the launchers used before the table existed, every
 * variable is parsed into its field, malformed and out-of-range values fall
 * back as the launchers always did, a context reads the environment when it
 * is created and again on moe_knobs_reload, and the grouped GEMM backend is
 * a knob of the context. Runs on the CPU (no kernel is launched).
 */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "internal.h"
#include "knobs.h"
#include "moe_grouped.h"

/* Clears every knob's variable, so the tests start from the defaults. */
static void unset_all(void) {
  for (int i = 0; i < moe_knob_count; i++)
    if (moe_knob_table[i].env) unsetenv(moe_knob_table[i].env);
}

static int knob(const moe_knobs *k, const char *name) {
  const moe_knob_def *d = moe_knob_find(name);
  EXPECT(d != NULL);
  return d ? moe_knob_get(k, d) : -12345;
}

/* The defaults, written out: what the kernels did with the variables unset. */
static void test_defaults(moe_ctx *ctx) {
  (void)ctx;
  moe_knobs k;
  moe_knobs_defaults(&k);
  EXPECT(k.attn_wg == true);
  EXPECT(k.attn_deterministic == false);
  EXPECT(k.attn_pingpong == true);
  EXPECT(k.attn_persistent == -1);
  EXPECT(k.attn_order == MOE_KNOB_ATTN_ORDER_HEAD);
  EXPECT(k.bsmm_tile == MOE_KNOB_BSMM_TILE_WG);
  EXPECT(k.bsmm_epi == MOE_KNOB_BSMM_EPI_AUTO);
  EXPECT(k.bsmm_glu == 0);
  EXPECT(k.bsmm_wg_mnswap == false);
  EXPECT(k.bsmm_gather == MOE_KNOB_BSMM_GATHER_OFF);
  EXPECT(k.bsmm_scatter == true);
  EXPECT(k.bsmm_persist == 1);
  EXPECT(k.bsmm_group == 0);
  EXPECT(k.grouped_streams == 4);
  EXPECT(k.grouped_backend == 0);
  EXPECT(k.gemm_tune == MOE_KNOB_GEMM_TUNE_BIAS);
  EXPECT(k.glu_qfused == true);
  /* the environment empty: loading gives the defaults */
  unset_all();
  moe_knobs l;
  moe_knobs_load(&l);
  for (int i = 0; i < moe_knob_count; i++)
    EXPECT(moe_knob_get(&l, &moe_knob_table[i]) == moe_knob_get(&k, &moe_knob_table[i]));
}

/* Every row names a field once and a variable at most once, has a doc, a
 * default it accepts (ints: in range or the documented "unset" value), and
 * the grouped backend's names are moe_grouped_backends(). */
static void test_table(moe_ctx *ctx) {
  (void)ctx;
  EXPECT(moe_knob_count == 17);
  for (int i = 0; i < moe_knob_count; i++) {
    const moe_knob_def *d = &moe_knob_table[i];
    EXPECT(d->name && d->doc && d->doc[0]);
    EXPECT(moe_knob_find(d->name) == d);
    if (d->env) {
      EXPECT(strncmp(d->env, "MOE_", 4) == 0);
      EXPECT(moe_knob_find(d->env) == d);
    }
    for (int j = 0; j < i; j++) {
      EXPECT(strcmp(moe_knob_table[j].name, d->name) != 0);
      EXPECT(moe_knob_table[j].offset != d->offset);
      if (d->env && moe_knob_table[j].env) EXPECT(strcmp(moe_knob_table[j].env, d->env) != 0);
    }
    if (d->type == MOE_KNOB_CHOICE) EXPECT(d->choices && d->def >= 0);
  }
  EXPECT(moe_knob_find("MOE_NO_SUCH_KNOB") == NULL);
  const moe_knob_def *gb = moe_knob_find("grouped_backend");
  EXPECT(gb && gb->env == NULL);
  if (gb) EXPECT_STR(gb->choices, moe_grouped_backends());
}

/* Well-formed values of every type land in their field. */
static void test_parse(moe_ctx *ctx) {
  (void)ctx;
  moe_knobs k;
  moe_knobs_defaults(&k);
  const struct {
    const char *env, *value;
    int want;
  } ok[] = {
      {"MOE_ATTN_WG", "0", 0},          {"MOE_ATTN_WG", "1", 1},
      {"MOE_ATTN_DETERMINISTIC", "1", 1}, {"MOE_ATTN_PINGPONG", "0", 0},
      {"MOE_ATTN_PERSISTENT", "0", 0},  {"MOE_ATTN_PERSISTENT", "3", 3},
      {"MOE_ATTN_ORDER", "block", MOE_KNOB_ATTN_ORDER_BLOCK},
      {"MOE_ATTN_ORDER", "head", MOE_KNOB_ATTN_ORDER_HEAD},
      {"MOE_BSMM_TILE", "128", MOE_KNOB_BSMM_TILE_128},
      {"MOE_BSMM_TILE", "256", MOE_KNOB_BSMM_TILE_256},
      {"MOE_BSMM_TILE", "256k64", MOE_KNOB_BSMM_TILE_256K64},
      {"MOE_BSMM_TILE", "wg", MOE_KNOB_BSMM_TILE_WG},
      {"MOE_BSMM_EPI", "direct", MOE_KNOB_BSMM_EPI_DIRECT},
      {"MOE_BSMM_EPI", "smem", MOE_KNOB_BSMM_EPI_SMEM},
      {"MOE_BSMM_EPI", "tma", MOE_KNOB_BSMM_EPI_TMA},
      {"MOE_BSMM_WG_MNSWAP", "1", 1},   {"MOE_BSMM_PERSIST", "1", 1},
      {"MOE_BSMM_PERSIST", "96", 96},   {"MOE_BSMM_GROUP", "1", 1},
      {"MOE_BSMM_GROUP", "64", 64},     {"MOE_GROUPED_STREAMS", "8", 8},
      {"MOE_GROUPED_STREAMS", "1", 1},  {"MOE_GEMM_TUNE", "0", MOE_KNOB_GEMM_TUNE_NONE},
      {"MOE_GEMM_TUNE", "all", MOE_KNOB_GEMM_TUNE_ALL}, {"MOE_GLU_QFUSED", "0", 0},
      {"MOE_BSMM_GATHER", "1", MOE_KNOB_BSMM_GATHER_ALL},
      {"MOE_BSMM_GATHER", "wgrad", MOE_KNOB_BSMM_GATHER_WGRAD}, {"MOE_BSMM_GLU", "1", 1},
      {"MOE_BSMM_SCATTER", "0", 0},
  };
  for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
    const moe_knob_def *d = moe_knob_find(ok[i].env);
    EXPECT(d != NULL);
    if (!d) continue;
    EXPECT(moe_knob_parse(&k, d, ok[i].value));
    if (moe_knob_get(&k, d) != ok[i].want)
      fprintf(stderr, "  %s=%s gave %d, wanted %d\n", ok[i].env, ok[i].value, moe_knob_get(&k, d),
              ok[i].want);
    EXPECT(moe_knob_get(&k, d) == ok[i].want);
    /* unset again: the default */
    EXPECT(moe_knob_parse(&k, d, NULL));
    EXPECT(moe_knob_get(&k, d) == d->def);
  }
}

/* Malformed and out-of-range values are reported (false) and keep what the
 * launchers made of them: the default, or the leading number of an int. */
static void test_malformed(moe_ctx *ctx) {
  (void)ctx;
  moe_knobs k;
  moe_knobs_defaults(&k);
  const struct {
    const char *env, *value;
    int want;
  } bad[] = {
      {"MOE_ATTN_WG", "no", 1},           /* only "0" turned it off */
      {"MOE_ATTN_WG", "00", 1},
      {"MOE_ATTN_DETERMINISTIC", "yes", 0}, /* only "1" turned it on */
      {"MOE_ATTN_PERSISTENT", "-2", -1},  /* negative: one block per SM */
      {"MOE_ATTN_PERSISTENT", "1073741824", -1}, /* 2^30 and above: likewise */
      {"MOE_ATTN_PERSISTENT", "abc", 0},  /* strtol read 0: one block per tile */
      {"MOE_ATTN_PERSISTENT", "3x", 3},   /* strtol read 3 */
      {"MOE_ATTN_ORDER", "Block", MOE_KNOB_ATTN_ORDER_HEAD},
      {"MOE_BSMM_TILE", "64", MOE_KNOB_BSMM_TILE_WG},
      {"MOE_BSMM_EPI", "regs", MOE_KNOB_BSMM_EPI_AUTO},
      {"MOE_BSMM_PERSIST", "-4", 1},
      {"MOE_BSMM_GROUP", "65", 0},
      {"MOE_BSMM_GROUP", "0", 0},
      {"MOE_GROUPED_STREAMS", "9", 4},
      {"MOE_GROUPED_STREAMS", "abc", 4},
      {"MOE_GEMM_TUNE", "2", MOE_KNOB_GEMM_TUNE_BIAS},
      {"MOE_GLU_QFUSED", "off", 1},
  };
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    const moe_knob_def *d = moe_knob_find(bad[i].env);
    EXPECT(d != NULL);
    if (!d) continue;
    EXPECT(!moe_knob_parse(&k, d, bad[i].value));
    if (moe_knob_get(&k, d) != bad[i].want)
      fprintf(stderr, "  %s=%s gave %d, wanted %d\n", bad[i].env, bad[i].value,
              moe_knob_get(&k, d), bad[i].want);
    EXPECT(moe_knob_get(&k, d) == bad[i].want);
  }
  /* an empty variable is as unset */
  const moe_knob_def *d = moe_knob_find("MOE_GROUPED_STREAMS");
  EXPECT(d && moe_knob_parse(&k, d, "") && k.grouped_streams == 4);
}

/* A context reads the environment when created, not later; moe_knobs_reload
 * reads it again and keeps the grouped backend set through the API. */
static void test_context(moe_ctx *ctx) {
  (void)ctx;
  unset_all();
  setenv("MOE_ATTN_ORDER", "block", 1);
  setenv("MOE_GROUPED_STREAMS", "2", 1);
  setenv("MOE_GLU_QFUSED", "0", 1);
  moe_ctx *c = NULL;
  EXPECT_OK(moe_ctx_init(&c));
  if (!c) return;
  EXPECT(c->knobs.attn_order == MOE_KNOB_ATTN_ORDER_BLOCK);
  EXPECT(c->knobs.grouped_streams == 2);
  EXPECT(c->knobs.glu_qfused == false);
  EXPECT(c->knobs.attn_wg == true);
  setenv("MOE_GROUPED_STREAMS", "6", 1);
  unsetenv("MOE_GLU_QFUSED");
  EXPECT(c->knobs.grouped_streams == 2); /* read at creation only */
  EXPECT_OK(moe_grouped_set_backend(c, "streams"));
  EXPECT_OK(moe_knobs_reload(c));
  EXPECT(c->knobs.grouped_streams == 6);
  EXPECT(c->knobs.glu_qfused == true);
  EXPECT(c->knobs.attn_order == MOE_KNOB_ATTN_ORDER_BLOCK);
  EXPECT_STR(moe_grouped_backend(c), "streams");
  EXPECT(knob(&c->knobs, "grouped_backend") == 3);
  /* another context has its own backend */
  EXPECT_STR(moe_grouped_backend(ctx), "auto");
  EXPECT(moe_knobs_reload(NULL) == MOE_ERR_INVALID_ARG);
  moe_ctx_free(c);
  unset_all();
}

/* moe_knob_set: strict (a malformed value is an error naming what the knob
 * takes, the knob unchanged), by variable or field name, the previous value
 * back, every previous value (the out-of-range defaults too) can be set back,
 * and moe_knob_format names choices. */
static void test_set(moe_ctx *ctx) {
  const moe_knob_def *tune = moe_knob_find("MOE_GEMM_TUNE");
  int prev = -1;
  EXPECT_OK(moe_knob_set(ctx, "MOE_GEMM_TUNE", "all", &prev));
  EXPECT(prev == MOE_KNOB_GEMM_TUNE_BIAS);
  EXPECT(ctx->knobs.gemm_tune == MOE_KNOB_GEMM_TUNE_ALL);
  EXPECT(moe_knob_current(ctx, tune) == MOE_KNOB_GEMM_TUNE_ALL);
  char buf[32];
  EXPECT_STR(moe_knob_format(tune, moe_knob_current(ctx, tune), buf, sizeof buf), "all");
  EXPECT_OK(moe_knob_set(ctx, "gemm_tune", NULL, &prev)); /* the field name; NULL: the default */
  EXPECT(prev == MOE_KNOB_GEMM_TUNE_ALL && ctx->knobs.gemm_tune == MOE_KNOB_GEMM_TUNE_BIAS);
  EXPECT_OK(moe_knob_set(ctx, "MOE_ATTN_DETERMINISTIC", "1", NULL));
  EXPECT(ctx->knobs.attn_deterministic == true);
  EXPECT_OK(moe_knob_set(ctx, "MOE_ATTN_DETERMINISTIC", "", &prev));
  EXPECT(prev == 1 && ctx->knobs.attn_deterministic == false);
  struct {
    const char *name, *value, *says;
  } bad[] = {
      {"MOE_ATTN_WG", "yes", "value must be 0 or 1, got 'yes'"},
      {"MOE_BSMM_GROUP", "65", "MOE_BSMM_GROUP: value must be an integer in [1, 64], got '65'"},
      {"MOE_BSMM_GROUP", "12abc", "got '12abc'"},
      {"MOE_BSMM_TILE", "huge", "value must be one of 128,256,256k64,wg, got 'huge'"},
      {"MOE_NO_SUCH_KNOB", "1", "no knob named 'MOE_NO_SUCH_KNOB'"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    moe_knobs before = ctx->knobs;
    prev = -7;
    EXPECT(moe_knob_set(ctx, bad[i].name, bad[i].value, &prev) == MOE_ERR_INVALID_ARG);
    EXPECT(strstr(moe_ctx_error(ctx), bad[i].says) != NULL);
    EXPECT(memcmp(&before, &ctx->knobs, sizeof before) == 0);
    EXPECT(prev == -7);
  }
  /* every knob's every previous value goes back: set another value, restore */
  for (int i = 0; i < moe_knob_count; i++) {
    const moe_knob_def *d = &moe_knob_table[i];
    int was = moe_knob_current(ctx, d);
    const char *other = d->type == MOE_KNOB_BOOL ? (was ? "0" : "1") : d->type == MOE_KNOB_INT ? "2" : NULL;
    char name[32];
    if (d->type == MOE_KNOB_CHOICE) other = moe_knob_format(d, was == 0 ? 1 : 0, name, sizeof name);
    EXPECT_OK(moe_knob_set(ctx, d->name, other, &prev));
    EXPECT(prev == was);
    EXPECT(moe_knob_current(ctx, d) != was);
    EXPECT_OK(moe_knob_set(ctx, d->name, moe_knob_format(d, was, buf, sizeof buf), NULL));
    EXPECT(moe_knob_current(ctx, d) == was);
  }
  EXPECT(moe_knob_set(NULL, "MOE_ATTN_WG", "1", NULL) == MOE_ERR_INVALID_ARG);
}

int main(void) {
  harness_start();
  RUN(test_defaults);
  RUN(test_table);
  RUN(test_parse);
  RUN(test_malformed);
  RUN(test_context);
  RUN(test_set);
  return harness_end();
}
