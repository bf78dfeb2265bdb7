/*
 * knobs.c - the table of the kernels' tuning knobs and its parser (contract
 * in knobs.h). The table is the one list of them: docs/DEVELOPING.md copies
 * its env, default and doc columns.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "knobs.h"

#define KNOB_BOOL(field, env, def, doc) \
  {#field, env, MOE_KNOB_BOOL, offsetof(moe_knobs, field), def, 0, 1, NULL, doc}
#define KNOB_INT(field, env, def, lo, hi, doc) \
  {#field, env, MOE_KNOB_INT, offsetof(moe_knobs, field), def, lo, hi, NULL, doc}
#define KNOB_CHOICE(field, env, def, choices, doc) \
  {#field, env, MOE_KNOB_CHOICE, offsetof(moe_knobs, field), def, 0, 0, choices, doc}

const moe_knob_def moe_knob_table[] = {
    KNOB_BOOL(attn_wg, "MOE_ATTN_WG", 1,
              "0: attention on the mma.sync kernels (what GPUs other than compute capability 9.x "
              "run); 1: the TMA + wgmma kernels on 9.x"),
    KNOB_BOOL(attn_deterministic, "MOE_ATTN_DETERMINISTIC", 0,
              "1: the bit-reproducible attention backward (no f32 reductions into dQ)"),
    KNOB_BOOL(attn_pingpong, "MOE_ATTN_PINGPONG", 1,
              "0: no turn-taking between the attention forward's two consumer warpgroups"),
    KNOB_INT(attn_persistent, "MOE_ATTN_PERSISTENT", -1, 0, (1 << 30) - 1,
             "0: one block per attention tile; n: at most n persistent blocks (default: one "
             "per SM)"),
    KNOB_CHOICE(attn_order, "MOE_ATTN_ORDER", MOE_KNOB_ATTN_ORDER_HEAD, "head,block",
                "block: every head's heaviest attention tile first; head (default): a head's "
                "tiles together, so the blocks running at once share its K, V, Q, dO and dQ "
                "sums in L2"),
    KNOB_CHOICE(bsmm_tile, "MOE_BSMM_TILE", MOE_KNOB_BSMM_TILE_WG, "128,256,256k64,wg",
                "the bf16 block-sparse kernel: wg (TMA + wgmma, 128 x 256, BK 64; 256k64 off "
                "9.x), or mma.sync 128 (128 x 128, BK 32), 256 (128 x 256, BK 32), 256k64 "
                "(128 x 256, BK 64)"),
    KNOB_CHOICE(bsmm_epi, "MOE_BSMM_EPI", MOE_KNOB_BSMM_EPI_AUTO, "auto,direct,smem,tma",
                "the wgmma block-sparse epilogue: staged through shared memory and stored by "
                "TMA (tma) or by the threads (smem), or stored from registers (direct); auto: "
                "tma"),
    KNOB_BOOL(bsmm_wg_mnswap, "MOE_BSMM_WG_MNSWAP", 0,
              "1: the wgmma block-sparse kernel walks its tiles with m and n swapped"),
    KNOB_CHOICE(bsmm_gather, "MOE_BSMM_GATHER", MOE_KNOB_BSMM_GATHER_OFF, "0,1,wgrad",
                "1: the GLU experts and parallel_linear (block-sparse or grouped on the sm_90a "
                "kernel) gather the token rows inside the wgmma kernel (cp.async) instead of "
                "reading a permuted copy (TMA); wgrad: only the weight gradients' products do, "
                "so the backward never makes the permuted tokens; same bits, less memory, slower"),
    KNOB_BOOL(bsmm_scatter, "MOE_BSMM_SCATTER", 1,
              "0: the top-1 GLU experts and parallel_linear's scatter write their rows in expert "
              "order and combine them in a pass of their own, instead of the sm_90a kernel's "
              "epilogue writing the rows in token order (same bits)"),
    KNOB_BOOL(bsmm_glu, "MOE_BSMM_GLU", 0,
              "1: the GLU experts' activation passes go into the wgmma products' epilogues "
              "(sm_90a, bf16): block-sparse, h1, h3 and a = act(h1) * h3 in one kernel; grouped, "
              "that and the backward pass in dA0's product; same bits (grouped: but the gates' "
              "gradient, summed in another order), slower today"),
    KNOB_INT(bsmm_persist, "MOE_BSMM_PERSIST", 1, 0, 2147483647,
             "1 (default): a persistent wgmma block-sparse grid of one CTA per SM; n >= 2: n "
             "CTAs; 0: one CTA per tile"),
    KNOB_INT(bsmm_group, "MOE_BSMM_GROUP", 0, 1, 64,
             "tile rows per rasterisation group of the block-sparse kernels (0: the built-in 8)"),
    KNOB_INT(grouped_streams, "MOE_GROUPED_STREAMS", 4, 1, 8,
             "side streams of the grouped GEMM's streams backend"),
    KNOB_CHOICE(grouped_backend, NULL, 0, "auto,loop,cublas_grouped,streams,wgmma",
                "the grouped GEMM's CUDA backend (moe_grouped_set_backend, "
                "moe.ops.grouped_backend); auto: loop or streams chosen per call, and the "
                "sm_90a kernel (wgmma) for device offsets where it runs"),
    KNOB_CHOICE(gemm_tune, "MOE_GEMM_TUNE", MOE_KNOB_GEMM_TUNE_BIAS, "0,1,all",
                "0: cuBLASLt's first heuristic choice everywhere; all: time the top candidates "
                "of every large GEMM; 1 (default): of large GEMMs with the bias epilogue"),
    KNOB_BOOL(glu_qfused, "MOE_GLU_QFUSED", 1,
              "0: the quantized GLU experts run the activation and two moe_quantize calls, and "
              "dequantize in backward, instead of the fused CUDA passes (same bits)"),
};
const int moe_knob_count = (int)(sizeof(moe_knob_table) / sizeof(moe_knob_table[0]));

const moe_knob_def *moe_knob_find(const char *name) {
  if (!name) return NULL;
  for (int i = 0; i < moe_knob_count; i++) {
    const moe_knob_def *d = &moe_knob_table[i];
    if (strcmp(d->name, name) == 0 || (d->env && strcmp(d->env, name) == 0)) return d;
  }
  return NULL;
}

static void knob_store(moe_knobs *k, const moe_knob_def *d, int v) {
  char *p = (char *)k + d->offset;
  if (d->type == MOE_KNOB_BOOL) *(bool *)p = v != 0;
  else *(int *)p = v;
}

int moe_knob_get(const moe_knobs *k, const moe_knob_def *d) {
  const char *p = (const char *)k + d->offset;
  return d->type == MOE_KNOB_BOOL ? (*(const bool *)p ? 1 : 0) : *(const int *)p;
}

/* The index of value in the comma-separated names, -1 if none. */
static int knob_choice(const char *choices, const char *value) {
  size_t n = strlen(value);
  int i = 0;
  for (const char *s = choices; *s; i++) {
    const char *e = strchr(s, ',');
    size_t len = e ? (size_t)(e - s) : strlen(s);
    if (len == n && strncmp(s, value, n) == 0) return i;
    if (!e) break;
    s = e + 1;
  }
  return -1;
}

bool moe_knob_parse(moe_knobs *k, const moe_knob_def *d, const char *value) {
  knob_store(k, d, d->def);
  if (!value || !*value) return true;
  switch (d->type) {
    case MOE_KNOB_BOOL:
      if (strcmp(value, "0") == 0 || strcmp(value, "1") == 0) {
        knob_store(k, d, value[0] == '1');
        return true;
      }
      return false;
    case MOE_KNOB_INT: {
      /* as atoi/strtol: the leading digits, 0 without any */
      char *end = NULL;
      long long v = strtoll(value, &end, 10);
      if (v < d->lo || v > d->hi) return false;
      knob_store(k, d, (int)v);
      return end != value && *end == 0;
    }
    case MOE_KNOB_CHOICE: {
      int i = knob_choice(d->choices, value);
      if (i < 0) return false;
      knob_store(k, d, i);
      return true;
    }
  }
  return false;
}

void moe_knobs_defaults(moe_knobs *k) {
  memset(k, 0, sizeof(*k));
  for (int i = 0; i < moe_knob_count; i++) knob_store(k, &moe_knob_table[i], moe_knob_table[i].def);
}

/* Every knob with a variable from the environment; the others untouched. */
static void knobs_read_env(moe_knobs *k) {
  for (int i = 0; i < moe_knob_count; i++) {
    const moe_knob_def *d = &moe_knob_table[i];
    if (d->env) (void)moe_knob_parse(k, d, getenv(d->env));
  }
}

void moe_knobs_load(moe_knobs *k) {
  moe_knobs_defaults(k);
  knobs_read_env(k);
}

moe_status moe_knobs_reload(moe_ctx *ctx) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  knobs_read_env(&ctx->knobs);
  return MOE_OK;
}

const char *moe_knob_format(const moe_knob_def *d, int value, char *buf, size_t size) {
  if (d->type == MOE_KNOB_CHOICE) {
    int i = 0;
    for (const char *c = d->choices; *c; i++) {
      const char *e = strchr(c, ',');
      size_t len = e ? (size_t)(e - c) : strlen(c);
      if (i == value) {
        snprintf(buf, size, "%.*s", (int)len, c);
        return buf;
      }
      if (!e) break;
      c = e + 1;
    }
  }
  snprintf(buf, size, "%d", value);
  return buf;
}

moe_status moe_knob_set(moe_ctx *ctx, const char *name, const char *value, int *previous) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  const moe_knob_def *d = moe_knob_find(name);
  if (!d) return moe_error(ctx, MOE_ERR_INVALID_ARG, "knob: no knob named '%s'", name ? name : "(null)");
  const char *label = d->env ? d->env : d->name;
  moe_knobs k = ctx->knobs;
  /* an int knob's default may lie outside its range (-1, 0: "the built-in"):
   * it is taken back as written, so a previous value can always be restored */
  bool is_default = false;
  if (d->type == MOE_KNOB_INT && value && *value) {
    char *end = NULL;
    long long v = strtoll(value, &end, 10);
    is_default = end != value && *end == 0 && v == d->def;
  }
  if (is_default) {
    moe_knob_parse(&k, d, NULL);
  } else if (!moe_knob_parse(&k, d, value)) {
    switch (d->type) {
      case MOE_KNOB_BOOL:
        return moe_error(ctx, MOE_ERR_INVALID_ARG, "knob %s: value must be 0 or 1, got '%s'", label, value);
      case MOE_KNOB_INT:
        return moe_error(ctx, MOE_ERR_INVALID_ARG, "knob %s: value must be an integer in [%d, %d], got '%s'",
                         label, d->lo, d->hi, value);
      case MOE_KNOB_CHOICE:
        return moe_error(ctx, MOE_ERR_INVALID_ARG, "knob %s: value must be one of %s, got '%s'", label,
                         d->choices, value);
    }
  }
  if (previous) *previous = moe_knob_get(&ctx->knobs, d);
  ctx->knobs = k;
  return MOE_OK;
}

int moe_knob_current(const moe_ctx *ctx, const moe_knob_def *d) { return moe_knob_get(&ctx->knobs, d); }
