/*
 * fsdp.c - parameter sharding, the parameter half of FSDP (ZeRO-3): a unit
 * of parameters in one flat buffer whose data exist only between a gather
 * and a release (moe_dist.h, "parameter sharding").
 *
 * The unit is the materialize callback of its flat buffer's storage:
 * backward calls it (moe_storage_ready) when a tensor a node saved, a view
 * of the buffer, has no data or an unfinished gather. It then waits for the
 * gather in flight or gathers synchronously, and starts the prefetch unit's
 * gather asynchronously, so the next unit backward reaches is on its way
 * while this one computes. On a GPU a gather runs on the group's
 * communication stream and the wait orders the compute stream after it
 * (moe_work_wait); the host never blocks.
 */
#include <stdlib.h>

#include "internal.h"
#include "moe_dist.h"

struct moe_fsdp_unit {
  moe_comm *comm;
  moe_tensor *flat;   /* (padded) retained; its storage's materialize is this unit */
  moe_tensor *shard;  /* (padded / P) retained */
  moe_work *pending;  /* a gather in flight, or NULL */
  moe_fsdp_unit *prefetch;
  int64_t gathers;
};

static moe_status unit_materialize(moe_ctx *ctx, void *ud);

moe_status moe_fsdp_unit_new(moe_ctx *ctx, moe_comm *c, moe_tensor *flat, moe_tensor *shard,
                             moe_fsdp_unit **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!c || !flat || !shard || !out)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "fsdp_unit_new: %s is NULL",
                     !c ? "the group" : !flat ? "flat" : !shard ? "shard" : "out");
  int P = moe_comm_size(c);
  int64_t n = moe_tensor_numel(flat), ns = moe_tensor_numel(shard);
  if (flat->ndim != 1 || !moe_tensor_is_contiguous(flat) || flat->offset != 0 ||
      (size_t)n * moe_dtype_size(flat->dtype) != flat->storage->nbytes)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "fsdp_unit_new: flat must be a 1-D contiguous tensor that is all of its storage");
  if (shard->dtype != flat->dtype || !moe_device_equal(moe_tensor_device(shard), moe_tensor_device(flat)))
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "fsdp_unit_new: shard is %s on %s but flat is %s on %s",
                     moe_dtype_name(shard->dtype), MOE_DEVICE(moe_tensor_device(shard)),
                     moe_dtype_name(flat->dtype), MOE_DEVICE(moe_tensor_device(flat)));
  if (ns * P != n || !moe_tensor_is_contiguous(shard))
    return moe_error(ctx, MOE_ERR_SHAPE,
                     "fsdp_unit_new: shard has %lld elements, flat %lld: flat must be %d (the group's "
                     "size) times the shard, both contiguous",
                     (long long)ns, (long long)n, P);
  if (flat->storage->materialize)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "fsdp_unit_new: flat belongs to another unit already");
  moe_fsdp_unit *u = calloc(1, sizeof(*u));
  if (!u) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "fsdp_unit_new: out of host memory");
  u->comm = c;
  moe_tensor_retain(flat);
  moe_tensor_retain(shard);
  u->flat = flat;
  u->shard = shard;
  flat->storage->materialize = unit_materialize;
  flat->storage->materialize_ud = u;
  *out = u;
  return MOE_OK;
}

moe_status moe_fsdp_unit_wait(moe_ctx *ctx, moe_fsdp_unit *u) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!u) return moe_error(ctx, MOE_ERR_INVALID_ARG, "fsdp_unit_wait: unit is NULL");
  if (!u->pending) return MOE_OK;
  moe_work *w = u->pending;
  u->pending = NULL;
  moe_status st = moe_work_wait(ctx, w);
  moe_work_free(ctx, w);
  MOE_CHECK(st);
  u->flat->storage->not_ready = false;
  return MOE_OK;
}

moe_status moe_fsdp_unit_gather(moe_ctx *ctx, moe_fsdp_unit *u, bool async) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!u) return moe_error(ctx, MOE_ERR_INVALID_ARG, "fsdp_unit_gather: unit is NULL");
  moe_storage *s = u->flat->storage;
  if (!u->pending && s->not_ready) {
    MOE_CHECK(moe_storage_alloc_data(ctx, s));
    MOE_CHECK(moe_all_gather(ctx, u->comm, u->flat, u->shard, &u->pending));
    u->gathers++;
  }
  return async ? MOE_OK : moe_fsdp_unit_wait(ctx, u);
}

moe_status moe_fsdp_unit_release(moe_ctx *ctx, moe_fsdp_unit *u) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!u) return moe_error(ctx, MOE_ERR_INVALID_ARG, "fsdp_unit_release: unit is NULL");
  MOE_CHECK(moe_fsdp_unit_wait(ctx, u)); /* the collective writes into the block */
  return moe_storage_free_data(ctx, u->flat->storage);
}

static moe_status unit_materialize(moe_ctx *ctx, void *ud) {
  moe_fsdp_unit *u = (moe_fsdp_unit *)ud;
  MOE_CHECK(moe_fsdp_unit_gather(ctx, u, false));
  if (u->prefetch && u->prefetch->flat->storage->not_ready)
    MOE_CHECK(moe_fsdp_unit_gather(ctx, u->prefetch, true));
  return MOE_OK;
}

void moe_fsdp_unit_set_prefetch(moe_fsdp_unit *u, moe_fsdp_unit *next) {
  if (u) u->prefetch = next;
}

bool moe_fsdp_unit_ready(const moe_fsdp_unit *u) {
  return u && !u->pending && !u->flat->storage->not_ready;
}

int64_t moe_fsdp_unit_gathers(const moe_fsdp_unit *u) { return u ? u->gathers : 0; }

void moe_fsdp_unit_free(moe_ctx *ctx, moe_fsdp_unit *u) {
  if (!u) return;
  if (u->pending) {
    moe_status st = moe_work_wait(ctx, u->pending);
    (void)st; /* freeing: the wait's error has nowhere to go but the context's message */
    moe_work_free(ctx, u->pending);
    u->pending = NULL;
  }
  moe_storage *s = u->flat->storage;
  if (s->materialize_ud == u) {
    s->materialize = NULL;
    s->materialize_ud = NULL;
  }
  moe_tensor_release(u->flat);
  moe_tensor_release(u->shard);
  free(u);
}
