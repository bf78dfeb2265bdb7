/*
 * event.c - events: timing points on a device's work queue (moe.h "events").
 *
 * Owns struct moe_event. Each event is on the context's list (ctx->events)
 * from moe_event_new to moe_event_free, so moe_ctx_free can destroy the ones
 * a caller left. CUDA events go through the entry points of internal.h
 * (core/cuda_runtime.c); CPU events read CLOCK_MONOTONIC.
 */
#include <stdlib.h>
#include <time.h>

#include "internal.h"

struct moe_event {
  moe_device device;
  void *cuda;       /* cudaEvent_t on a CUDA device, else NULL */
  double host_ms;   /* CPU: the clock when recorded */
  bool recorded;
  struct moe_event *prev, *next; /* the context's list */
};

static double moe_host_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

moe_status moe_event_new(moe_ctx *ctx, moe_device d, moe_event **out) {
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "Event: out is NULL");
  MOE_CHECK(moe_device_check(ctx, d));
  moe_event *e = (moe_event *)calloc(1, sizeof *e);
  if (!e) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "Event: out of host memory");
  e->device = d;
  if (d.type == MOE_DEVICE_CUDA) {
    moe_status st = moe_cuda_event_create(ctx, d.index, &e->cuda);
    if (st != MOE_OK) {
      free(e);
      return st;
    }
  }
  e->next = ctx->events;
  if (ctx->events) ctx->events->prev = e;
  ctx->events = e;
  *out = e;
  return MOE_OK;
}

moe_status moe_event_record(moe_ctx *ctx, moe_event *e) {
  if (!e) return moe_error(ctx, MOE_ERR_INVALID_ARG, "record: event is NULL");
  if (e->device.type == MOE_DEVICE_CUDA) MOE_CHECK(moe_cuda_event_record(ctx, e->device.index, e->cuda));
  else e->host_ms = moe_host_ms();
  e->recorded = true;
  return MOE_OK;
}

moe_status moe_event_synchronize(moe_ctx *ctx, moe_event *e) {
  if (!e) return moe_error(ctx, MOE_ERR_INVALID_ARG, "synchronize: event is NULL");
  if (!e->recorded) return moe_error(ctx, MOE_ERR_INVALID_ARG, "synchronize: the event was never recorded");
  if (e->device.type == MOE_DEVICE_CUDA) MOE_CHECK(moe_cuda_event_synchronize(ctx, e->cuda));
  return MOE_OK;
}

moe_status moe_event_elapsed(moe_ctx *ctx, moe_event *start, moe_event *end, double *ms) {
  if (!start || !end || !ms) return moe_error(ctx, MOE_ERR_INVALID_ARG, "elapsed: NULL argument");
  if (!start->recorded || !end->recorded)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "elapsed: both events must be recorded first (%s was not)",
                     start->recorded ? "the end event" : "the start event");
  MOE_CHECK(moe_check_same_device(ctx, "elapsed", "the start event", start->device,
                                  "the end event", end->device));
  if (start->device.type == MOE_DEVICE_CUDA) {
    float f = 0;
    MOE_CHECK(moe_cuda_event_elapsed(ctx, start->cuda, end->cuda, &f));
    *ms = f;
  } else {
    *ms = end->host_ms - start->host_ms;
  }
  return MOE_OK;
}

void moe_event_free(moe_ctx *ctx, moe_event *e) {
  if (!e) return;
  if (e->prev) e->prev->next = e->next;
  else if (ctx && ctx->events == e) ctx->events = e->next;
  if (e->next) e->next->prev = e->prev;
  moe_cuda_event_destroy(e->cuda);
  free(e);
}
