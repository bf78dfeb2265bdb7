/*
 * knobs.h - the tuning knobs of the kernels: choices that change which kernel
 * runs or how it is launched, never what it computes (beyond the rounding of
 * the deterministic/atomic attention backward), for measuring one variant
 * against another and for tests that walk every variant.
 *
 * Every knob is listed once, in moe_knob_table (core/knobs.c): its
 * environment variable, type, default and what it does. The context reads
 * the environment once, when it is created (moe_ctx_init), into ctx->knobs;
 * the kernels read ctx->knobs, never the environment. A program that changes
 * the environment afterwards (the CUDA tests walking the variants) calls
 * moe_knobs_reload(ctx). Knobs without a variable (grouped_backend) are set
 * through their own API (moe_grouped_set_backend) and kept by a reload.
 *
 * Values are parsed as the launchers always did: a bool takes "0" or "1",
 * anything else keeps the default; an int is read as strtoll does (leading
 * digits; none gives 0) and a value outside its range keeps the default; a
 * choice is one of its names, anything else keeps the default. An empty
 * variable is as unset. A malformed value therefore never fails: it falls back
 * (moe_knob_parse tells the two apart, for tests).
 */
#ifndef MOE_KNOBS_H
#define MOE_KNOBS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Values of the choice knobs (the index of the name in the table's list). */
enum { MOE_KNOB_ATTN_ORDER_HEAD = 0, MOE_KNOB_ATTN_ORDER_BLOCK = 1 };
enum {
  MOE_KNOB_BSMM_TILE_128 = 0,
  MOE_KNOB_BSMM_TILE_256 = 1,
  MOE_KNOB_BSMM_TILE_256K64 = 2,
  MOE_KNOB_BSMM_TILE_WG = 3
};
enum {
  MOE_KNOB_BSMM_EPI_AUTO = 0,
  MOE_KNOB_BSMM_EPI_DIRECT = 1,
  MOE_KNOB_BSMM_EPI_SMEM = 2,
  MOE_KNOB_BSMM_EPI_TMA = 3
};
enum { MOE_KNOB_BSMM_GATHER_OFF = 0, MOE_KNOB_BSMM_GATHER_ALL = 1, MOE_KNOB_BSMM_GATHER_WGRAD = 2 };
enum { MOE_KNOB_GEMM_TUNE_NONE = 0, MOE_KNOB_GEMM_TUNE_BIAS = 1, MOE_KNOB_GEMM_TUNE_ALL = 2 };

/* The knobs' values (what each does: moe_knob_table in core/knobs.c). */
typedef struct moe_knobs {
  bool attn_wg;            /* MOE_ATTN_WG */
  bool attn_deterministic; /* MOE_ATTN_DETERMINISTIC */
  bool attn_pingpong;      /* MOE_ATTN_PINGPONG */
  int attn_persistent;     /* MOE_ATTN_PERSISTENT: -1 one block per SM, 0 one per tile, n at most n */
  int attn_order;          /* MOE_ATTN_ORDER: MOE_KNOB_ATTN_ORDER_* */
  int bsmm_tile;           /* MOE_BSMM_TILE: MOE_KNOB_BSMM_TILE_* */
  int bsmm_glu;            /* MOE_BSMM_GLU: the fused GLU SDD (moe_bsmm_sdd_glu) */
  int bsmm_epi;            /* MOE_BSMM_EPI: MOE_KNOB_BSMM_EPI_* */
  bool bsmm_wg_mnswap;     /* MOE_BSMM_WG_MNSWAP */
  int bsmm_gather;         /* MOE_BSMM_GATHER: MOE_KNOB_BSMM_GATHER_* */
  bool bsmm_scatter;       /* MOE_BSMM_SCATTER */
  int bsmm_persist;        /* MOE_BSMM_PERSIST: 0 one CTA per tile, 1 (default) one per SM, n at most n */
  int bsmm_group;          /* MOE_BSMM_GROUP: 0 the kernel's own (8), else 1..64 */
  int grouped_streams;     /* MOE_GROUPED_STREAMS: 1..8 */
  int grouped_backend;     /* moe_grouped_set_backend: index in moe_grouped_backends() */
  int gemm_tune;           /* MOE_GEMM_TUNE: MOE_KNOB_GEMM_TUNE_* */
  bool glu_qfused;         /* MOE_GLU_QFUSED */
} moe_knobs;

typedef enum moe_knob_type {
  MOE_KNOB_BOOL = 0, /* "0" or "1" */
  MOE_KNOB_INT,      /* an integer in [lo, hi] */
  MOE_KNOB_CHOICE    /* one of the names in choices; the value is its index */
} moe_knob_type;

/* One row of the table. */
typedef struct moe_knob_def {
  const char *name;    /* the field of moe_knobs */
  const char *env;     /* the environment variable; NULL: set through an API only */
  moe_knob_type type;
  size_t offset;       /* of the field in moe_knobs (bool for MOE_KNOB_BOOL, else int) */
  int def;             /* the default: 0/1, the number, or the index of the name */
  int lo, hi;          /* MOE_KNOB_INT: the accepted range */
  const char *choices; /* MOE_KNOB_CHOICE: the names, comma separated */
  const char *doc;     /* what it does */
} moe_knob_def;

extern const moe_knob_def moe_knob_table[];
extern const int moe_knob_count;

/* The row of the knob named name (the field or the variable); NULL if none. */
const moe_knob_def *moe_knob_find(const char *name);
/* Every knob at its default. */
void moe_knobs_defaults(moe_knobs *k);
/* The defaults, then every knob with a variable from the environment. */
void moe_knobs_load(moe_knobs *k);
/* Sets d's knob in k from value (NULL or "": the default). Returns false
 * when the value is not exactly one the knob takes; the knob then holds what
 * the launchers always made of it: the default, or for an int with trailing
 * characters (or none at all) the number strtoll reads, if in range. */
bool moe_knob_parse(moe_knobs *k, const moe_knob_def *d, const char *value);
/* The knob's current value in k (bools as 0/1). */
int moe_knob_get(const moe_knobs *k, const moe_knob_def *d);
/* Reads the environment again into ctx->knobs (after setenv/unsetenv);
 * knobs without a variable keep their values. */
moe_status moe_knobs_reload(moe_ctx *ctx);
/* Sets the knob named name (its variable or its field) in ctx->knobs from
 * value, strictly: an unknown name or a value the knob does not take
 * exactly (NULL, "" and an int knob's default as written are the default,
 * so a previous value can always be set back) is MOE_ERR_INVALID_ARG with a message
 * naming what it takes, and the knob is left as it was. *previous (if not
 * NULL) gets the value it had (moe_knob_get). Kernels read the knobs at
 * each launch; results that are cached per shape (the GEMM algorithm chosen
 * under MOE_GEMM_TUNE) keep the setting they were made under. */
moe_status moe_knob_set(moe_ctx *ctx, const char *name, const char *value, int *previous);
/* The knob's value in ctx->knobs. */
int moe_knob_current(const moe_ctx *ctx, const moe_knob_def *d);
/* The name of value for d: a choice's name, else the number ("0"/"1" for a
 * bool) written into buf (at least 24 bytes). */
const char *moe_knob_format(const moe_knob_def *d, int value, char *buf, size_t size);

#ifdef __cplusplus
}
#endif
#endif /* MOE_KNOBS_H */
