/*
 * ctx.c - the context: error buffer and status, the random generator's
 * state, device names and checks, and memory statistics by device.
 * Owns struct moe_ctx's lifetime (moe_ctx_init / moe_ctx_free); the kernel
 * tuning knobs are read from the environment once, here (knobs.h).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define MOE_RNG_SEED_DEFAULT 0x5eedull

static const char *const moe_status_names[] = {
    "ok",     "invalid argument", "shape error", "dtype error", "device error", "out of memory",
    "CUDA error", "not supported", "I/O error", "internal error",
    "communication error",
};
_Static_assert(sizeof(moe_status_names) / sizeof(moe_status_names[0]) == MOE_STATUS_COUNT,
               "moe_status_names must name every moe_status");

const char *moe_status_name(moe_status s) {
  if ((int)s < 0 || s >= MOE_STATUS_COUNT) return "unknown status";
  return moe_status_names[s];
}

/* ----------------------------------------------------------------- context */

moe_status moe_ctx_init(moe_ctx **out) {
  if (!out) return MOE_ERR_INVALID_ARG;
  moe_ctx *ctx = calloc(1, sizeof(*ctx));
  if (!ctx) return MOE_ERR_OUT_OF_MEMORY;
  ctx->status = MOE_OK;
  ctx->rng_seed = MOE_RNG_SEED_DEFAULT;
  ctx->rng_call = 0;
  ctx->cuda = NULL;
  ctx->cuda_count = -1;
  ctx->grad_enabled = true;
  moe_knobs_load(&ctx->knobs);
  *out = ctx;
  return MOE_OK;
}

void moe_ctx_free(moe_ctx *ctx) {
  if (!ctx) return;
  while (ctx->events) moe_event_free(ctx, ctx->events);
  moe_cuda_state_free(ctx);
  free(ctx);
}

const char *moe_ctx_error(const moe_ctx *ctx) { return ctx ? ctx->err : "no context"; }
moe_status moe_ctx_status(const moe_ctx *ctx) { return ctx ? ctx->status : MOE_ERR_INVALID_ARG; }

void moe_host_reads(const moe_ctx *ctx, int64_t *copies, int64_t *syncs) {
  if (copies) *copies = ctx ? ctx->host_copies : 0;
  if (syncs) *syncs = ctx ? ctx->host_syncs : 0;
}

void moe_ctx_clear(moe_ctx *ctx) {
  if (!ctx) return;
  ctx->status = MOE_OK;
  ctx->err[0] = 0;
}

moe_status moe_error(moe_ctx *ctx, moe_status s, const char *fmt, ...) {
  if (!ctx) return s;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(ctx->err, sizeof(ctx->err), fmt, ap);
  va_end(ap);
  ctx->status = s;
  return s;
}

void moe_internal_abort(const char *file, int line, const char *what) {
  fprintf(stderr, "moe-lua: internal error at %s:%d: %s\n", file, line, what);
  fflush(stderr);
  abort();
}

/* ----------------------------------------------------------------- devices */

bool moe_device_equal(moe_device a, moe_device b) {
  return a.type == b.type && (a.type == MOE_DEVICE_CPU || a.index == b.index);
}

const char *moe_device_str(moe_device d, char *buf, size_t len) {
  if (!buf || len == 0) return "";
  if (d.type == MOE_DEVICE_CPU)
    snprintf(buf, len, "cpu");
  else if (d.type == MOE_DEVICE_CUDA)
    snprintf(buf, len, "cuda:%d", d.index);
  else
    snprintf(buf, len, "device?%d", (int)d.type);
  return buf;
}

moe_status moe_device_check(moe_ctx *ctx, moe_device d) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (d.type == MOE_DEVICE_CPU) return MOE_OK;
  if (d.type != MOE_DEVICE_CUDA)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "unknown device type %d (expected cpu or cuda)",
                     (int)d.type);
  if (d.index < 0)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "cuda:%d is not a device: the index must be >= 0",
                     d.index);
  if (!moe_cuda_built())
    return moe_error(ctx, MOE_ERR_NOT_SUPPORTED,
                     "cuda:%d requested but this moe-lua was built without CUDA (configure with "
                     "-DMOE_CUDA=ON on a machine with the CUDA toolkit)",
                     d.index);
  int count = moe_cuda_device_count(ctx);
  if (count <= 0)
    return moe_error(ctx, MOE_ERR_DEVICE, "cuda:%d requested but no CUDA GPU is visible",
                     d.index);
  if (d.index >= count)
    return moe_error(ctx, MOE_ERR_DEVICE,
                     "cuda:%d requested but only %d CUDA device%s visible", d.index, count,
                     count == 1 ? " is" : "s are");
  return MOE_OK;
}

moe_status moe_device_parse(moe_ctx *ctx, const char *s, moe_device *out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!s) return moe_error(ctx, MOE_ERR_INVALID_ARG, "device: the name is NULL");
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "device: out is NULL");
  moe_device d;
  if (strcmp(s, "cpu") == 0) {
    d = MOE_CPU;
  } else if (strcmp(s, "cuda") == 0 || strcmp(s, "gpu") == 0) {
    d = (moe_device){MOE_DEVICE_CUDA, 0};
  } else if (strncmp(s, "cuda:", 5) == 0 && s[5] >= '0' && s[5] <= '9' && strlen(s) <= 9) {
    int index = 0;
    const char *p = s + 5;
    for (; *p >= '0' && *p <= '9'; p++) index = index * 10 + (*p - '0');
    if (*p) goto unknown;
    d = (moe_device){MOE_DEVICE_CUDA, index};
  } else {
    goto unknown;
  }
  MOE_CHECK(moe_device_check(ctx, d));
  *out = d;
  return MOE_OK;
unknown:
  return moe_error(ctx, MOE_ERR_INVALID_ARG,
                   "device: unknown device \"%.64s\" (expected \"cpu\", \"cuda\", \"cuda:N\" or "
                   "\"gpu\")",
                   s);
}

/* ------------------------------------------------------------------ random */

void moe_rng_seed(moe_ctx *ctx, uint64_t seed) {
  if (!ctx) return;
  ctx->rng_seed = seed;
  ctx->rng_call = 0;
}

void moe_rng_get_state(const moe_ctx *ctx, uint64_t *seed, uint64_t *call) {
  if (!ctx) return;
  if (seed) *seed = ctx->rng_seed;
  if (call) *call = ctx->rng_call;
}

void moe_rng_set_state(moe_ctx *ctx, uint64_t seed, uint64_t call) {
  if (!ctx) return;
  ctx->rng_seed = seed;
  ctx->rng_call = call;
}

/* ------------------------------------------------------------------ memory */

moe_status moe_memory_stats_get(moe_ctx *ctx, moe_device d, moe_memory_stats *out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "memory_stats: out is NULL");
  MOE_CHECK(moe_device_check(ctx, d));
  if (d.type == MOE_DEVICE_CUDA) return moe_cuda_stats(ctx, d.index, out);
  *out = ctx->cpu_stats;
  return MOE_OK;
}

moe_status moe_memory_reset_peak(moe_ctx *ctx, moe_device d) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(moe_device_check(ctx, d));
  if (d.type == MOE_DEVICE_CUDA) return moe_cuda_reset_peak(ctx, d.index);
  ctx->cpu_stats.peak_allocated = ctx->cpu_stats.allocated;
  ctx->cpu_stats.peak_reserved = ctx->cpu_stats.reserved;
  return MOE_OK;
}

moe_status moe_memory_empty_cache(moe_ctx *ctx, moe_device d) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(moe_device_check(ctx, d));
  if (d.type == MOE_DEVICE_CUDA) return moe_cuda_empty_cache(ctx, d.index);
  return MOE_OK; /* host storages are returned to the system as they die */
}
