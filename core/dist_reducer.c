/*
 * dist_reducer.c - data parallelism's gradient reducer (moe_dist.h, "gradient
 * bucketing"): PyTorch DDP's Reducer over moe_all_reduce and the leaf hook of
 * moe_backward (moe_autograd_set_grad_ready).
 *
 * Buckets. The parameters are walked in reverse order (the order backward
 * tends to finish them) and put, per (dtype, device) group, into buckets of
 * at most bucket_bytes (a parameter larger than that gets a bucket of its
 * own; bucket_bytes = 0: one parameter per bucket). Buckets are numbered in
 * the order they were opened; every rank builds the same buckets from the
 * same parameter list, so bucket k is the same all_reduce everywhere.
 *
 * One round (arm, backward, finish). While armed, the hook marks a parameter
 * ready when backward is done with it; a bucket whose parameters are all
 * ready is launched as soon as every bucket before it was, so the
 * collectives start in bucket order on every rank whatever order backward
 * finished them in. Launching a bucket allocates its flat buffer (numel),
 * copies each parameter's .grad into its slice (zeros where .grad is NULL)
 * and starts an asynchronous all_reduce(avg) on it. moe_reducer_finish
 * launches the buckets left (parameters backward never reached), all-reduces
 * (max, over MPI on the host: a few bytes) which parameters had a gradient on
 * some rank, waits for the buckets in order and disarms.
 *
 * A bucket of one parameter whose .grad is a contiguous tensor nobody else
 * holds skips the buffer: the all_reduce averages the .grad itself.
 *
 * Write-back without a copy. When a parameter's slice is filled, its .grad
 * becomes a view of that slice (its old gradient tensor is released at once,
 * so a round holds about one copy of the gradients, not two); the all_reduce
 * averages the views in place. The buffer is fresh each round and the
 * reducer drops its reference after the wait: the views own it from then
 * on, so nothing of one step's gradients is aliased by the next step's
 * buffers (zero_grad, which sets .grad to nil, frees it; a later backward
 * that accumulates into a view adds out of place, as into any .grad). A
 * parameter that had no gradient on any rank keeps .grad NULL (the
 * optimisers skip it, as a single process would); one that had none here
 * but some elsewhere gets the average with this rank's zeros.
 *
 * One backward per round: a parameter reported twice while armed (a second
 * backward before finish) is an error, not a silently unreduced gradient.
 * Gradient accumulation arms the reducer for the last micro-batch only.
 *
 * Sharded mode (MOE_REDUCER_REDUCE_SCATTER, ZeRO-2). The same buckets and
 * the same launch order; a bucket's buffer has padded = P * shard_numel
 * elements (zeros past its parameters) and is reduce_scatter'ed (avg) into
 * a fresh shard of shard_numel elements. A bucket of one parameter whose
 * .grad is contiguous and needs no padding is reduce_scatter'ed from the
 * .grad itself (no copy). Either way every .grad of the bucket is released
 * at launch: the collective holds the buffer (or the old .grad) until it is
 * waited for, and nothing else does, so the full gradients of a bucket are
 * freed as soon as its reduce_scatter has read them. With a replicate
 * communicator (HSDP) each shard then gets an all_reduce (avg) over it:
 * launched in bucket order, during backward for the buckets whose
 * reduce_scatter is already done (polled, never waited for, in the leaf
 * hook) and by finish for the rest. The shards stay until the next arm or
 * moe_reducer_clear. Collectives are issued in the same order on each
 * communicator on every rank (MPI and NCCL need that): reduce_scatters in
 * bucket order on the shard communicator, then its had-gradient flags; the
 * replicate all_reduces in bucket order, then its flags (finish issues every
 * replicate all_reduce before the flags). This keeps the GPU path the CPU
 * path: moe_work_done is an event query there, moe_work_wait a stream wait.
 *
 * Failure. Any error leaves the reducer disarmed after finish; free waits
 * for (and frees) the work still in flight, clears the hook if armed, and
 * releases everything, whatever state an error left.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

typedef struct bucket {
  moe_dtype dtype;
  moe_device device;
  int first, count;  /* its parameters: order[first, first + count) */
  int64_t numel;     /* elements of its parameters */
  int64_t padded;    /* elements of the flat buffer: numel rounded up to a multiple of P */
  int64_t shard_numel; /* padded / P */
  int pending;       /* parameters not yet ready this round */
  moe_tensor *buf;   /* (padded) the launched buffer, NULL before launch (all_reduce mode) */
  moe_work *work;    /* its all_reduce / reduce_scatter, NULL when none is in flight */
  moe_tensor *shard; /* (shard_numel) reduce_scatter mode: this round's averaged shard */
  moe_work *rwork;   /* the shard's all_reduce over the replicate communicator */
} bucket;

struct moe_reducer {
  moe_comm *comm;
  moe_reducer_mode mode;
  moe_comm *replicate; /* reduce_scatter mode with more than one replica, else NULL */
  int P, rank;         /* the shard group's size and this rank (1 and 0 for all_reduce) */
  int n;
  moe_tensor **params; /* (n) retained */
  int *bucket_of;      /* (n) bucket of each parameter */
  int64_t *offset;     /* (n) first element of each parameter in its bucket */
  bool *ready;         /* (n) reported by this round's backward */
  bool *had_grad;      /* (n) .grad was set when its bucket launched */
  int *order;          /* (n) parameter indices, bucket after bucket */
  int nb;
  bucket *b;           /* (nb) */
  int next;            /* first bucket not launched this round */
  int next_rep;        /* first bucket whose replicate all_reduce has not started */
  moe_ctx *armed;      /* the context armed on, NULL when not armed */
  moe_status (*launched)(moe_ctx *ctx, int k, void *ud); /* after bucket k's launch, or NULL */
  void *launched_ud;
  /* leaf pointer -> parameter index, open addressing */
  moe_tensor **hkey;   /* (nslot) NULL when empty */
  int *hval;           /* (nslot) */
  int64_t nslot;
};

static uint64_t ptr_hash(const void *p) {
  uint64_t x = (uint64_t)(uintptr_t)p;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return x;
}

static int64_t hash_slot(const moe_reducer *r, const moe_tensor *t) {
  uint64_t mask = (uint64_t)r->nslot - 1, h = ptr_hash(t) & mask;
  while (r->hkey[h] && r->hkey[h] != t) h = (h + 1) & mask;
  return (int64_t)h;
}

/* The index of parameter t, or -1. */
static int param_index(const moe_reducer *r, const moe_tensor *t) {
  if (r->nslot == 0) return -1;
  int64_t h = hash_slot(r, t);
  return r->hkey[h] ? r->hval[h] : -1;
}

/* Waits for and frees a bucket's work and drops its buffer; returns the
 * wait's status (the first failure is what the caller reports). */
static moe_status bucket_settle(moe_ctx *ctx, bucket *bk) {
  moe_status st = MOE_OK;
  if (bk->work) {
    st = moe_work_wait(ctx, bk->work);
    moe_work_free(ctx, bk->work);
    bk->work = NULL;
  }
  moe_tensor_release(bk->buf);
  bk->buf = NULL;
  return st;
}

/* The slice of bucket buffer buf that holds parameter p, in p's shape. */
static moe_status param_view(moe_ctx *ctx, moe_tensor *buf, int64_t offset, const moe_tensor *p,
                             moe_tensor **out) {
  moe_tensor *flat = NULL;
  MOE_CHECK(moe_narrow(ctx, buf, 0, offset, moe_tensor_numel(p), &flat));
  moe_status st = moe_view(ctx, flat, p->ndim, p->shape, out);
  moe_tensor_release(flat);
  return st;
}

/* Reduce_scatter mode: bucket k's gradients (or zeros) into a padded flat
 * input, a fresh shard, the reduce_scatter (avg) started; every .grad of
 * the bucket released. */
static moe_status bucket_launch_rs(moe_ctx *ctx, moe_reducer *r, int k) {
  bucket *bk = &r->b[k];
  MOE_ASSERT(!bk->work && !bk->shard && !bk->rwork);
  moe_tensor *in = NULL, *shard = NULL;
  moe_status st = MOE_OK;
  if (bk->count == 1 && bk->padded == bk->numel) {
    /* one parameter, no padding: its .grad is the input */
    int i = r->order[bk->first];
    moe_tensor *g = moe_tensor_grad(r->params[i]);
    if (g && moe_tensor_is_contiguous(g) && g->dtype == bk->dtype) {
      MOE_CHECK(moe_view(ctx, g, 1, &bk->padded, &in));
      r->had_grad[i] = true;
    }
  }
  if (!in) {
    MOE_CHECK(moe_tensor_empty(ctx, 1, &bk->padded, bk->dtype, bk->device, &in));
    for (int j = 0; j < bk->count && st == MOE_OK; j++) {
      int i = r->order[bk->first + j];
      moe_tensor *p = r->params[i], *g = moe_tensor_grad(p), *v = NULL;
      st = param_view(ctx, in, r->offset[i], p, &v);
      if (st != MOE_OK) break;
      r->had_grad[i] = g != NULL;
      st = g ? moe_copy_(ctx, v, g) : moe_fill_(ctx, v, 0.0);
      moe_tensor_release(v);
    }
    if (st == MOE_OK && bk->padded > bk->numel) {
      moe_tensor *pad = NULL;
      st = moe_narrow(ctx, in, 0, bk->numel, bk->padded - bk->numel, &pad);
      if (st == MOE_OK) st = moe_fill_(ctx, pad, 0.0);
      moe_tensor_release(pad);
    }
  }
  if (st == MOE_OK) st = moe_tensor_empty(ctx, 1, &bk->shard_numel, bk->dtype, bk->device, &shard);
  if (st == MOE_OK) st = moe_reduce_scatter(ctx, r->comm, shard, in, MOE_REDUCE_AVG, &bk->work);
  /* the collective holds in until it is waited for: the full gradients go
   * when it has read them */
  moe_tensor_release(in);
  if (st != MOE_OK) {
    moe_tensor_release(shard);
    bk->work = NULL;
    return st;
  }
  bk->shard = shard;
  for (int j = 0; j < bk->count && st == MOE_OK; j++)
    st = moe_tensor_set_grad(ctx, r->params[r->order[bk->first + j]], NULL);
  return st;
}

/* Reduce_scatter mode with replicas: starts, in bucket order, the replicate
 * all_reduce of each launched bucket whose reduce_scatter is done (every
 * launched one, waiting for it, when block is true). */
static moe_status advance_replicate(moe_ctx *ctx, moe_reducer *r, bool block) {
  if (!r->replicate) return MOE_OK;
  while (r->next_rep < r->next) {
    bucket *bk = &r->b[r->next_rep];
    if (bk->work) {
      if (!block && !moe_work_done(ctx, bk->work)) break;
      moe_status st = moe_work_wait(ctx, bk->work);
      moe_work_free(ctx, bk->work);
      bk->work = NULL;
      MOE_CHECK(st);
    }
    r->next_rep++;
    MOE_CHECK(moe_all_reduce(ctx, r->replicate, bk->shard, MOE_REDUCE_AVG, &bk->rwork));
  }
  return MOE_OK;
}

/* Fills bucket k's buffer from the parameters' gradients, makes each .grad
 * a view of its slice and starts the all_reduce. */
static moe_status bucket_launch_ar(moe_ctx *ctx, moe_reducer *r, int k);

static moe_status bucket_launch(moe_ctx *ctx, moe_reducer *r, int k) {
  moe_status st = r->mode == MOE_REDUCER_REDUCE_SCATTER ? bucket_launch_rs(ctx, r, k)
                                                        : bucket_launch_ar(ctx, r, k);
  if (st == MOE_OK && r->launched) st = r->launched(ctx, k, r->launched_ud);
  return st;
}

static moe_status bucket_launch_ar(moe_ctx *ctx, moe_reducer *r, int k) {
  bucket *bk = &r->b[k];
  MOE_ASSERT(!bk->buf && !bk->work);
  if (bk->count == 1) {
    /* A parameter with a bucket of its own (one larger than the bucket
     * size: an MoE layer's expert weights) whose gradient nobody else holds
     * is averaged in place: no buffer, no copy. */
    int i = r->order[bk->first];
    moe_tensor *g = moe_tensor_grad(r->params[i]);
    if (g && g->refcount == 1 && g->storage->refcount == 1 && moe_tensor_is_contiguous(g) &&
        g->dtype == bk->dtype) {
      r->had_grad[i] = true;
      moe_tensor_retain(g);
      bk->buf = g;
      moe_status st = moe_all_reduce(ctx, r->comm, g, MOE_REDUCE_AVG, &bk->work);
      if (st != MOE_OK) {
        moe_tensor_release(bk->buf);
        bk->buf = NULL;
        bk->work = NULL;
      }
      return st;
    }
  }
  MOE_CHECK(moe_tensor_empty(ctx, 1, &bk->numel, bk->dtype, bk->device, &bk->buf));
  moe_status st = MOE_OK;
  for (int j = 0; j < bk->count && st == MOE_OK; j++) {
    int i = r->order[bk->first + j];
    moe_tensor *p = r->params[i], *g = moe_tensor_grad(p), *v = NULL;
    st = param_view(ctx, bk->buf, r->offset[i], p, &v);
    if (st != MOE_OK) break;
    r->had_grad[i] = g != NULL;
    if (g) {
      st = moe_copy_(ctx, v, g);
      if (st == MOE_OK) st = moe_tensor_set_grad(ctx, p, v); /* releases the old gradient */
    } else {
      st = moe_fill_(ctx, v, 0.0);
    }
    moe_tensor_release(v);
  }
  if (st == MOE_OK) st = moe_all_reduce(ctx, r->comm, bk->buf, MOE_REDUCE_AVG, &bk->work);
  if (st != MOE_OK) {
    moe_tensor_release(bk->buf);
    bk->buf = NULL;
    bk->work = NULL;
  }
  return st;
}

/* Launches, in order, the buckets from r->next on that are complete (every
 * one left when all is true). */
static moe_status launch_ready(moe_ctx *ctx, moe_reducer *r, bool all) {
  while (r->next < r->nb && (all || r->b[r->next].pending == 0)) {
    int k = r->next++;
    MOE_CHECK(bucket_launch(ctx, r, k));
  }
  return MOE_OK;
}

/* The leaf hook while armed. */
static moe_status reducer_grad_ready(moe_ctx *ctx, moe_tensor *leaf, void *ud) {
  moe_reducer *r = (moe_reducer *)ud;
  int i = param_index(r, leaf);
  if (i < 0) return MOE_OK; /* a leaf the reducer does not hold */
  if (r->ready[i])
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "reducer: parameter %d got a gradient from a second backward while armed "
                     "(arm the reducer for one backward, then finish it)",
                     i);
  r->ready[i] = true;
  bucket *bk = &r->b[r->bucket_of[i]];
  MOE_ASSERT(bk->pending > 0);
  bk->pending--;
  MOE_CHECK(launch_ready(ctx, r, false));
  return advance_replicate(ctx, r, false);
}

/* ------------------------------------------------------------- the API */

static void reducer_destroy(moe_reducer *r) {
  if (!r) return;
  for (int i = 0; r->params && i < r->n; i++) moe_tensor_release(r->params[i]);
  free(r->params);
  free(r->bucket_of);
  free(r->offset);
  free(r->ready);
  free(r->had_grad);
  free(r->order);
  free(r->b);
  free(r->hkey);
  free(r->hval);
  free(r);
}

moe_status moe_reducer_new(moe_ctx *ctx, moe_comm *c, int n, moe_tensor *const *params,
                           size_t bucket_bytes, moe_reducer **out) {
  moe_reducer_opts o = {.bucket_bytes = bucket_bytes, .mode = MOE_REDUCER_ALL_REDUCE};
  return moe_reducer_new_opts(ctx, c, n, params, &o, out);
}

moe_status moe_reducer_new_opts(moe_ctx *ctx, moe_comm *c, int n, moe_tensor *const *params,
                                const moe_reducer_opts *o, moe_reducer **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "reducer: out is NULL");
  *out = NULL;
  if (!c) return moe_error(ctx, MOE_ERR_INVALID_ARG, "reducer: the communicator is NULL");
  if (!o) return moe_error(ctx, MOE_ERR_INVALID_ARG, "reducer: the options are NULL");
  if ((int)o->mode < 0 || o->mode >= MOE_REDUCER_MODE_COUNT)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "reducer: unknown mode %d", (int)o->mode);
  if (o->replicate && o->mode != MOE_REDUCER_REDUCE_SCATTER)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "reducer: a replicate group needs mode reduce_scatter (all_reduce mode "
                     "averages over its one group)");
  size_t bucket_bytes = o->bucket_bytes;
  if (n < 0 || (n > 0 && !params))
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "reducer: %d parameters%s", n,
                     n > 0 ? " but the list is NULL" : "");
  for (int i = 0; i < n; i++) {
    const moe_tensor *p = params[i];
    if (!p) return moe_error(ctx, MOE_ERR_INVALID_ARG, "reducer: parameter %d is NULL", i);
    if (!moe_tensor_is_leaf(p) || !moe_requires_grad(p))
      return moe_error(ctx, MOE_ERR_INVALID_ARG,
                       "reducer: parameter %d (shape %s) is not a leaf that requires grad", i,
                       MOE_SHAPE(p));
  }
  moe_reducer *r = calloc(1, sizeof(*r));
  if (!r) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "reducer: out of host memory");
  size_t un = (size_t)(n > 0 ? n : 1);
  r->comm = c;
  r->mode = o->mode;
  r->launched = o->launched;
  r->launched_ud = o->launched_ud;
  r->replicate = o->replicate && moe_comm_size(o->replicate) > 1 ? o->replicate : NULL;
  r->P = o->mode == MOE_REDUCER_REDUCE_SCATTER ? moe_comm_size(c) : 1;
  r->rank = o->mode == MOE_REDUCER_REDUCE_SCATTER ? moe_comm_rank(c) : 0;
  r->n = n;
  r->params = calloc(un, sizeof(*r->params));
  r->bucket_of = calloc(un, sizeof(*r->bucket_of));
  r->offset = calloc(un, sizeof(*r->offset));
  r->ready = calloc(un, sizeof(*r->ready));
  r->had_grad = calloc(un, sizeof(*r->had_grad));
  r->order = calloc(un, sizeof(*r->order));
  r->b = calloc(un, sizeof(*r->b));
  r->nslot = 16;
  while (r->nslot < 2 * (int64_t)n) r->nslot *= 2;
  r->hkey = calloc((size_t)r->nslot, sizeof(*r->hkey));
  r->hval = calloc((size_t)r->nslot, sizeof(*r->hval));
  int *open = calloc(un, sizeof(*open)); /* the open bucket of each group so far */
  int *gbucket = NULL; /* explicit groups: the bucket of each group id, -1 before */
  int ngroups = 0;
  if (o->group) {
    for (int i = 0; i < n; i++) {
      if (o->group[i] < 0) {
        reducer_destroy(r);
        free(open);
        return moe_error(ctx, MOE_ERR_INVALID_ARG, "reducer: parameter %d has group %d (>= 0 expected)",
                         i, o->group[i]);
      }
      if (o->group[i] >= ngroups) ngroups = o->group[i] + 1;
    }
    gbucket = malloc((size_t)(ngroups > 0 ? ngroups : 1) * sizeof(*gbucket));
    if (gbucket)
      for (int g = 0; g < ngroups; g++) gbucket[g] = -1;
  }
  size_t *bytes = calloc(un, sizeof(*bytes)); /* bytes of each bucket */
  moe_status st = MOE_OK;
  if (!r->params || !r->bucket_of || !r->offset || !r->ready || !r->had_grad || !r->order ||
      !r->b || !r->hkey || !r->hval || !open || !bytes || (o->group && !gbucket)) {
    st = moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "reducer: out of host memory");
    goto done;
  }
  for (int i = 0; i < n; i++) {
    int64_t h = hash_slot(r, params[i]);
    if (r->hkey[h]) {
      st = moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "reducer: parameters %d and %d are the same tensor (list each once)",
                     r->hval[h], i);
      goto done;
    }
    r->hkey[h] = params[i];
    r->hval[h] = i;
  }
  /* buckets: reverse parameter order, per (dtype, device) group */
  int nopen = 0;
  for (int i = n - 1; i >= 0; i--) {
    const moe_tensor *p = params[i];
    moe_device d = moe_tensor_device(p);
    size_t pb = (size_t)moe_tensor_numel(p) * moe_dtype_size(p->dtype);
    int k = -1, slot = -1;
    if (gbucket) {
      int g = o->group[i];
      k = gbucket[g];
      if (k < 0) {
        k = gbucket[g] = r->nb++;
        r->b[k].dtype = p->dtype;
        r->b[k].device = d;
      } else if (r->b[k].dtype != p->dtype || !moe_device_equal(r->b[k].device, d)) {
        st = moe_error(ctx, MOE_ERR_INVALID_ARG,
                       "reducer: group %d mixes %s on %s (parameter %d) with %s on %s: a bucket "
                       "holds one dtype on one device",
                       g, moe_dtype_name(p->dtype), MOE_DEVICE(d), i, moe_dtype_name(r->b[k].dtype),
                       MOE_DEVICE(r->b[k].device));
        goto done;
      }
      goto place;
    }
    for (int q = 0; q < nopen; q++) {
      bucket *ob = &r->b[open[q]];
      if (ob->dtype == p->dtype && moe_device_equal(ob->device, d)) {
        slot = q;
        k = open[q];
        break;
      }
    }
    if (k >= 0 && bytes[k] + pb > bucket_bytes && r->b[k].count > 0) k = -1; /* full */
    if (k < 0) {
      k = r->nb++;
      r->b[k].dtype = p->dtype;
      r->b[k].device = d;
      if (slot >= 0) open[slot] = k;
      else open[nopen++] = k;
    }
  place:
    r->bucket_of[i] = k;
    r->offset[i] = r->b[k].numel;
    r->b[k].numel += moe_tensor_numel(p);
    r->b[k].count++;
    bytes[k] += pb;
  }
  /* order: the parameters of bucket 0, then of bucket 1, ... each in the
   * order they were added (reverse parameter order) */
  for (int k = 1; k < r->nb; k++) r->b[k].first = r->b[k - 1].first + r->b[k - 1].count;
  for (int k = 0; k < r->nb; k++) {
    bucket *bk = &r->b[k];
    bk->shard_numel = (bk->numel + r->P - 1) / r->P;
    bk->padded = bk->shard_numel * r->P;
  }
  for (int k = 0; k < r->nb; k++) r->b[k].pending = 0; /* used as a fill count here */
  for (int i = n - 1; i >= 0; i--) {
    bucket *bk = &r->b[r->bucket_of[i]];
    r->order[bk->first + bk->pending++] = i;
  }
  for (int i = 0; i < n; i++) {
    moe_tensor_retain(params[i]);
    r->params[i] = params[i];
  }
done:
  free(open);
  free(bytes);
  free(gbucket);
  if (st != MOE_OK) {
    reducer_destroy(r);
    return st;
  }
  *out = r;
  return MOE_OK;
}

moe_status moe_reducer_arm(moe_ctx *ctx, moe_reducer *r) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!r) return moe_error(ctx, MOE_ERR_INVALID_ARG, "reducer_arm: reducer is NULL");
  if (r->armed)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "reducer_arm: this reducer is already armed (finish it first)");
  if (ctx->grad_ready)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "reducer_arm: another reducer (or leaf hook) is armed on this context; "
                     "finish it first");
  moe_reducer_clear(r);
  for (int i = 0; i < r->n; i++) r->ready[i] = r->had_grad[i] = false;
  for (int k = 0; k < r->nb; k++) {
    MOE_ASSERT(!r->b[k].buf && !r->b[k].work && !r->b[k].rwork);
    r->b[k].pending = r->b[k].count;
  }
  r->next = 0;
  r->next_rep = 0;
  r->armed = ctx;
  moe_autograd_set_grad_ready(ctx, reducer_grad_ready, r);
  return MOE_OK;
}

/* Disarms: clears the hook if it is still this reducer's. */
static void reducer_disarm(moe_reducer *r) {
  moe_ctx *ctx = r->armed;
  if (!ctx) return;
  if (ctx->grad_ready == reducer_grad_ready && ctx->grad_ready_ud == r)
    moe_autograd_set_grad_ready(ctx, NULL, NULL);
  r->armed = NULL;
}

/* The global "had a gradient" of every parameter: max over ranks (of the
 * replicate communicator too). */
static moe_status global_had_grad(moe_ctx *ctx, moe_reducer *r) {
  if (r->n == 0) return MOE_OK;
  moe_tensor *flags = NULL;
  int64_t n = r->n;
  MOE_CHECK(moe_tensor_empty(ctx, 1, &n, MOE_I32, MOE_CPU, &flags));
  int32_t *f = (int32_t *)moe_tensor_data(flags);
  for (int i = 0; i < r->n; i++) f[i] = r->had_grad[i] ? 1 : 0;
  moe_status st = moe_all_reduce(ctx, r->comm, flags, MOE_REDUCE_MAX, NULL);
  if (st == MOE_OK && r->replicate)
    st = moe_all_reduce(ctx, r->replicate, flags, MOE_REDUCE_MAX, NULL);
  if (st == MOE_OK)
    for (int i = 0; i < r->n; i++) r->had_grad[i] = f[i] != 0;
  moe_tensor_release(flags);
  return st;
}

moe_status moe_reducer_finish(moe_ctx *ctx, moe_reducer *r) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!r) return moe_error(ctx, MOE_ERR_INVALID_ARG, "reducer_finish: reducer is NULL");
  if (!r->armed)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "reducer_finish: the reducer is not armed (arm it before the backward)");
  if (r->armed != ctx)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "reducer_finish: the reducer was armed on another context");
  reducer_disarm(r);
  bool prev = moe_grad_set(ctx, false);
  moe_status st = launch_ready(ctx, r, true);
  if (r->mode == MOE_REDUCER_REDUCE_SCATTER) {
    if (st == MOE_OK) st = advance_replicate(ctx, r, true);
    if (st == MOE_OK) st = global_had_grad(ctx, r);
    for (int k = 0; k < r->nb; k++) {
      bucket *bk = &r->b[k];
      moe_status ws = bucket_settle(ctx, bk);
      if (st == MOE_OK) st = ws;
      if (bk->rwork) {
        ws = moe_work_wait(ctx, bk->rwork);
        moe_work_free(ctx, bk->rwork);
        bk->rwork = NULL;
        if (st == MOE_OK) st = ws;
      }
    }
    moe_grad_set(ctx, prev);
    return st;
  }
  if (st == MOE_OK) st = global_had_grad(ctx, r);
  for (int k = 0; k < r->nb; k++) {
    bucket *bk = &r->b[k];
    if (!bk->buf) continue; /* not launched (an error stopped the launches) */
    moe_tensor *buf = bk->buf;
    moe_tensor_retain(buf);
    moe_status ws = bucket_settle(ctx, bk);
    if (st == MOE_OK) st = ws;
    /* a parameter with no gradient here but one elsewhere: the average */
    for (int j = 0; st == MOE_OK && j < bk->count; j++) {
      int i = r->order[bk->first + j];
      moe_tensor *p = r->params[i], *v = NULL;
      if (!r->had_grad[i] || moe_tensor_grad(p)) continue;
      st = param_view(ctx, buf, r->offset[i], p, &v);
      if (st == MOE_OK) st = moe_tensor_set_grad(ctx, p, v);
      moe_tensor_release(v);
    }
    moe_tensor_release(buf);
  }
  moe_grad_set(ctx, prev);
  return st;
}

int moe_reducer_buckets(const moe_reducer *r) { return r ? r->nb : 0; }

moe_reducer_mode moe_reducer_get_mode(const moe_reducer *r) {
  return r ? r->mode : MOE_REDUCER_ALL_REDUCE;
}

moe_status moe_reducer_bucket_info(moe_ctx *ctx, const moe_reducer *r, int k,
                                   moe_reducer_bucket *out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!r || !out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "reducer_bucket_info: NULL argument");
  if (k < 0 || k >= r->nb)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "reducer_bucket_info: bucket %d of %d", k, r->nb);
  const bucket *bk = &r->b[k];
  out->dtype = bk->dtype;
  out->device = bk->device;
  out->nparams = bk->count;
  out->numel = bk->numel;
  out->padded = bk->padded;
  out->shard_numel = bk->shard_numel;
  out->shard_offset = (int64_t)r->rank * bk->shard_numel;
  return MOE_OK;
}

int moe_reducer_segments(const moe_reducer *r, int k, moe_reducer_segment *out, int cap) {
  if (!r || k < 0 || k >= r->nb) return -1;
  const bucket *bk = &r->b[k];
  int64_t lo = (int64_t)r->rank * bk->shard_numel, hi = lo + bk->shard_numel;
  int m = 0;
  for (int j = 0; j < bk->count; j++) {
    int i = r->order[bk->first + j];
    int64_t off = r->offset[i], end = off + moe_tensor_numel(r->params[i]);
    int64_t a = off > lo ? off : lo, b = end < hi ? end : hi;
    if (a >= b) continue;
    if (out && m < cap) {
      out[m].param = i;
      out[m].param_offset = a - off;
      out[m].shard_offset = a - lo;
      out[m].numel = b - a;
    }
    m++;
  }
  return m;
}

bool moe_reducer_param_offset(const moe_reducer *r, int i, int *bucket_out, int64_t *offset) {
  if (!r || i < 0 || i >= r->n) return false;
  if (bucket_out) *bucket_out = r->bucket_of[i];
  if (offset) *offset = r->offset[i];
  return true;
}

moe_tensor *moe_reducer_shard(const moe_reducer *r, int k) {
  if (!r || k < 0 || k >= r->nb || r->armed) return NULL;
  return r->b[k].shard;
}

bool moe_reducer_had_grad(const moe_reducer *r, int i) {
  return r && i >= 0 && i < r->n && r->had_grad[i];
}

void moe_reducer_clear(moe_reducer *r) {
  if (!r) return;
  for (int k = 0; k < r->nb; k++) {
    if (r->b[k].work || r->b[k].rwork) continue; /* in flight: finish or free settles it */
    moe_tensor_release(r->b[k].shard);
    r->b[k].shard = NULL;
  }
}

void moe_reducer_free(moe_ctx *ctx, moe_reducer *r) {
  if (!r) return;
  reducer_disarm(r);
  for (int k = 0; k < r->nb; k++) {
    bucket *bk = &r->b[k];
    if (bk->work && ctx) { /* without a context the handle cannot be waited for: left */
      (void)moe_work_wait(ctx, bk->work);
      moe_work_free(ctx, bk->work);
    }
    if (bk->rwork && ctx) {
      (void)moe_work_wait(ctx, bk->rwork);
      moe_work_free(ctx, bk->rwork);
    }
    bk->work = NULL;
    bk->rwork = NULL;
    moe_tensor_release(bk->buf);
    bk->buf = NULL;
    moe_tensor_release(bk->shard);
    bk->shard = NULL;
  }
  reducer_destroy(r);
}
