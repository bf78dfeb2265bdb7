/*
 * dist_nccl.c - the NCCL engine behind moe_dist.h: the collectives of GPU
 * tensors (built with CUDA only; core/nocuda.c stubs the moe_nccl_* entry
 * points otherwise). core/dist.c checks the arguments and calls in here.
 *
 * Owns, per communicator (moe_comm.nccl, made by the first GPU collective
 * or by moe_nccl_comm_split): the NCCL communicator of one device, a
 * communication stream (non-blocking, highest priority), the event that
 * orders it after the context's compute stream, a pool of "done" events,
 * and a mutex held around every use of the NCCL communicator. For the
 * process: the watchdog thread and the list of collectives in flight.
 *
 * Streams. A collective records `ready` on the compute stream
 * (moe_cuda_stream), makes the communication stream wait for it (no host
 * wait), enqueues the NCCL call(s) there and records a done event after
 * them. A synchronous call then makes the compute stream wait for done; an
 * asynchronous one hands done to the moe_work (w->done) and
 * moe_nccl_work_wait makes the compute stream wait for it later.
 *
 * Memory. The caching allocator (core/cuda_runtime.c) hands a released
 * block out again at once, which is safe only for work ordered on the
 * compute stream. A tensor a collective reads or writes is held by its
 * moe_work (w->hold, dist.c) until moe_work_wait or moe_work_free, and both
 * make the compute stream wait for done before the hold is dropped (free
 * waits an unwaited work first). So a block a collective touches returns
 * to the allocator only after the compute stream is ordered behind the
 * collective, and every later user of the block (a kernel on the compute
 * stream, or a later collective, whose stream waits for `ready` recorded on
 * the compute stream) runs after it. The other direction is covered by
 * `ready`: a block freed by compute work and handed to a collective's
 * output is written only after the compute work queued before the call.
 * A synchronous call waits before it returns, so its tensors need no hold.
 * moe_nccl_work_wait orders the compute stream even when the communicator
 * has failed (then returns the error): an aborted collective's kernel exits
 * and its done event completes, so the stream never runs ahead of it.
 *
 * Failure. Every collective in flight is tracked (its done event, its
 * deadline, a description, its communicator). The watchdog thread, started
 * by the first GPU collective, polls them every 100 ms (cudaEventQuery, and
 * ncclCommGetAsyncError of each communicator with work in flight). On a
 * missed deadline, an asynchronous NCCL error or a CUDA error it marks the
 * moe_comm failed with a message naming the collective, the group, the
 * rank, the device and the sizes, prints it to stderr ("moe-lua: [rank r]
 * ...": the main thread may be blocked in a CUDA synchronisation and cannot
 * say it), and aborts the NCCL communicator (ncclCommAbort): the NCCL
 * kernels exit, blocked host syncs return, and the next call on the
 * communicator fails with the message. An error returned by an NCCL call
 * itself aborts the communicator on the main thread and fails the same way.
 *
 * Threads. The watchdog never touches a moe_ctx. The list of tracked
 * collectives, the list of states, the event pools and the failure marks
 * are guarded by g_wd.mu; each state's NCCL communicator by its mu (lock
 * order: g_wd.mu, then a state's mu; the watchdog only try-locks a state's
 * mu, so an NCCL call that blocks on the host delays an abort to a later
 * poll but never deadlocks). moe_comm.failed and .failure are written by
 * the watchdog (the text first, then the flag with release ordering).
 *
 * Lifetimes. A track has two owners: the watchdog (while `pending`) and the
 * moe_work (while `held`, from the collective to moe_nccl_work_release); it
 * is freed, and its event goes back to the pool, when both let go, so a
 * work released before its collective completes stays watched. Freeing a
 * communicator first waits for its collectives (each bounded by its
 * deadline: the same poll runs on the calling thread), then detaches the
 * tracks that works still hold (their events are destroyed at release).
 *
 * Timing (moe_comm_timing_set, dist.c). A collective that dist.c marks timed
 * (w->timed >= 0) records a pair of timing events on the communication
 * stream: `start` after the stream's wait for `ready`, `stop` after the NCCL
 * calls. The pair joins g_tm.pending; nothing waits for it then. When 256
 * pairs are pending, those complete (cudaEventQuery, oldest first) are
 * folded into g_tm.ms and their events kept in g_tm.pool for reuse;
 * moe_nccl_timing_collect synchronises on the rest. moe_nccl_timing_clear
 * destroys every event, pending ones included (CUDA releases an event
 * still queued once it completes).
 *
 * Limits. The deadline covers the GPU side of each collective and the
 * bootstrap of a new NCCL communicator (MPI_Ibcast + MPI_Ibarrier polled
 * against the communicator's timeout); a rank that stops inside a blocking
 * NCCL host call (ncclCommInitRank after the bootstrap, ncclCommSplit, the
 * first connection between two peers) is not interrupted.
 */
#include <pthread.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "cuda_check.h"
#include "dist_internal.h"

#define MOE_NCCL_POLL_NS 100000000L /* the watchdog's period: 100 ms */
#define MOE_NCCL_WHAT 256

typedef struct moe_nccl_state moe_nccl_state;

/* One collective as the watchdog sees it. */
typedef struct moe_nccl_track {
  struct moe_nccl_track *next;
  cudaEvent_t done;          /* recorded on the communication stream after the collective */
  int device;
  double deadline;           /* moe_nccl_now() seconds */
  double timeout;            /* seconds, for the message */
  char what[MOE_NCCL_WHAT];  /* "all_reduce(sum) of 16 bf16 on group 'dp' (rank 1 of 2, cuda:1)" */
  moe_comm *comm;            /* NULL once the communicator is freed */
  moe_nccl_state *nc;        /* likewise */
  bool pending;              /* watched: not known complete, communicator not aborted */
  bool held;                 /* a moe_work's w->done is this event */
} moe_nccl_track;

struct moe_nccl_state {
  moe_nccl_state *next;      /* in g_wd.states */
  moe_comm *owner;
  int device;
  ncclComm_t comm;           /* NULL after an abort (guarded by mu) */
  bool aborted;              /* written under mu (atomic: polls read it without) */
  pthread_mutex_t mu;        /* held around every use of comm */
  cudaStream_t stream;       /* the communication stream */
  cudaEvent_t ready;         /* recorded on the compute stream before each collective */
  cudaEvent_t *pool;         /* (npool of cap) free done events, guarded by g_wd.mu */
  int npool, cap;
  bool reported;             /* the failure was printed (g_wd.mu) */
  bool busy;                 /* a poll's scratch: has pending tracks */
};

static struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;         /* CLOCK_MONOTONIC; wakes the watchdog to stop */
  pthread_t thread;
  bool cv_ready, started, stop;
  moe_nccl_track *tracks;
  moe_nccl_state *states;
} g_wd = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* A timed collective's events and its op (moe_comm_op). */
typedef struct moe_nccl_tpair {
  cudaEvent_t start, stop;
  int device;
  int op;
} moe_nccl_tpair;

#define MOE_NCCL_FOLD_AT 256 /* pending pairs that make an append fold the completed ones */

static struct {
  pthread_mutex_t mu;
  moe_nccl_tpair *pending; /* (npending) recorded, in order, not yet added up */
  int npending, cap_pending;
  moe_nccl_tpair *pool;    /* (npool) made and free */
  int npool, cap_pool;
  double ms[MOE_COMM_OP_COUNT]; /* spans folded in, not yet collected */
} g_tm = {.mu = PTHREAD_MUTEX_INITIALIZER};

static double moe_nccl_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void moe_nccl_sleep_ns(long ns) {
  struct timespec ts = {ns / 1000000000L, ns % 1000000000L};
  nanosleep(&ts, NULL);
}

static bool moe_nccl_comm_failed(const moe_comm *c) {
  return __atomic_load_n(&c->failed, __ATOMIC_ACQUIRE);
}

static bool moe_nccl_aborted(moe_nccl_state *nc) {
  return __atomic_load_n(&nc->aborted, __ATOMIC_ACQUIRE);
}

static int moe_nccl_world_rank(const moe_comm *c) {
  return c->world_ranks ? c->world_ranks[c->rank] : c->rank;
}

/* ------------------------------------------------------------- names */

static bool moe_nccl_dtype(moe_dtype dt, ncclDataType_t *out) {
  switch (dt) {
  case MOE_F32: *out = ncclFloat32; return true;
  case MOE_F64: *out = ncclFloat64; return true;
  case MOE_BF16: *out = ncclBfloat16; return true;
  case MOE_F16: *out = ncclFloat16; return true;
  case MOE_I8: *out = ncclInt8; return true;
  case MOE_U8: *out = ncclUint8; return true;
  case MOE_I32: *out = ncclInt32; return true;
  case MOE_I64: *out = ncclInt64; return true;
  default: return false;
  }
}

static moe_status moe_nccl_types(moe_ctx *ctx, const char *fn, moe_dtype dt, int op,
                                 ncclDataType_t *ndt, ncclRedOp_t *nop) {
  if (!moe_nccl_dtype(dt, ndt))
    return moe_error(ctx, MOE_ERR_DTYPE, "%s: NCCL does not take %s tensors", fn,
                     moe_dtype_name(dt));
  if (op < 0) return MOE_OK; /* not a reduction */
  switch ((moe_reduce_op)op) {
  case MOE_REDUCE_SUM: *nop = ncclSum; return MOE_OK;
  case MOE_REDUCE_MAX: *nop = ncclMax; return MOE_OK;
  case MOE_REDUCE_MIN: *nop = ncclMin; return MOE_OK;
  case MOE_REDUCE_AVG:
    if (!moe_dtype_is_float(dt))
      return moe_error(ctx, MOE_ERR_DTYPE, "%s: avg takes float tensors, got %s", fn,
                       moe_dtype_name(dt));
    *nop = ncclAvg;
    return MOE_OK;
  default:
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: unknown reduce op %d", fn, op);
  }
}

/* "group 'dp' (rank 1 of 2, cuda:1)" */
static void moe_nccl_where(const moe_comm *c, int device, char *buf, size_t n) {
  snprintf(buf, n, "group '%s' (rank %d of %d, cuda:%d)", c->name, c->rank, c->size, device);
}

/* ------------------------------------------------------ the tracked list */

/* A track is done with: its event back to its state's pool (or destroyed
 * when the state is gone), the record freed. g_wd.mu held. */
static void moe_nccl_track_free_locked(moe_nccl_track *t) {
  moe_nccl_state *nc = t->nc;
  if (nc && nc->npool == nc->cap) {
    int cap = nc->cap ? 2 * nc->cap : 16;
    cudaEvent_t *p = (cudaEvent_t *)realloc(nc->pool, (size_t)cap * sizeof(*p));
    if (p) {
      nc->pool = p;
      nc->cap = cap;
    }
  }
  if (nc && nc->npool < nc->cap)
    nc->pool[nc->npool++] = t->done;
  else if (cudaEventDestroy(t->done) != cudaSuccess)
    (void)cudaGetLastError();
  free(t);
}

/* Marks t's communicator failed (first message kept), prints the message
 * once, and aborts the NCCL communicator if its mutex is free (otherwise a
 * later poll retries: t stays pending). g_wd.mu held. */
static void moe_nccl_fail_locked(moe_nccl_track *t, const char *reason) {
  moe_nccl_state *nc = t->nc;
  moe_comm *c = t->comm;
  if (!nc->reported) {
    nc->reported = true;
    char msg[sizeof c->failure];
    snprintf(msg, sizeof msg, "%s %s", t->what, reason);
    if (!moe_nccl_comm_failed(c)) {
      snprintf(c->failure, sizeof c->failure, "%s", msg);
      __atomic_store_n(&c->failed, true, __ATOMIC_RELEASE);
    }
    fprintf(stderr, "moe-lua: [rank %d] %s\n", moe_nccl_world_rank(c), msg);
    fflush(stderr);
  }
  if (pthread_mutex_trylock(&nc->mu) != 0) return;
  if (nc->comm) {
    (void)ncclCommAbort(nc->comm); /* the kernels see the abort flag and exit */
    nc->comm = NULL;
  }
  __atomic_store_n(&nc->aborted, true, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&nc->mu);
  for (moe_nccl_track *u = g_wd.tracks; u; u = u->next)
    if (u->nc == nc) u->pending = false;
}

/* One look at every collective in flight (the watchdog's period; also run
 * by moe_nccl_comm_free while it waits). g_wd.mu held. Restores the calling
 * thread's current device. */
static void moe_nccl_poll_locked(void) {
  int prev = -1;
  if (cudaGetDevice(&prev) != cudaSuccess) prev = -1;
  double now = moe_nccl_now();
  for (moe_nccl_state *nc = g_wd.states; nc; nc = nc->next) nc->busy = false;
  for (moe_nccl_track *t = g_wd.tracks; t; t = t->next) {
    if (!t->pending) continue;
    if (!t->nc || moe_nccl_aborted(t->nc)) {
      t->pending = false;
      continue;
    }
    cudaError_t q = cudaSetDevice(t->device);
    if (q == cudaSuccess) q = cudaEventQuery(t->done);
    if (q == cudaSuccess) {
      t->pending = false;
    } else if (q != cudaErrorNotReady) {
      (void)cudaGetLastError();
      char why[200];
      snprintf(why, sizeof why, "failed on the GPU: %s (%s)", cudaGetErrorString(q),
               cudaGetErrorName(q));
      moe_nccl_fail_locked(t, why);
    } else if (now > t->deadline) {
      char why[200];
      snprintf(why, sizeof why,
               "did not complete within %g s: another rank did not join it (is a rank "
               "stuck, dead, or calling a different collective?)", t->timeout);
      moe_nccl_fail_locked(t, why);
    } else {
      t->nc->busy = true;
    }
  }
  for (moe_nccl_state *nc = g_wd.states; nc; nc = nc->next) {
    if (!nc->busy || moe_nccl_aborted(nc) || pthread_mutex_trylock(&nc->mu) != 0) continue;
    ncclResult_t a = ncclSuccess;
    if (nc->comm && ncclCommGetAsyncError(nc->comm, &a) != ncclSuccess) a = ncclSuccess;
    pthread_mutex_unlock(&nc->mu);
    if (a == ncclSuccess || a == ncclInProgress) continue;
    moe_nccl_track *t = g_wd.tracks;
    while (t && !(t->pending && t->nc == nc)) t = t->next;
    if (t) {
      char why[200];
      snprintf(why, sizeof why, "failed: NCCL reported %s", ncclGetErrorString(a));
      moe_nccl_fail_locked(t, why);
    }
  }
  moe_nccl_track **p = &g_wd.tracks;
  while (*p) {
    moe_nccl_track *t = *p;
    if (!t->pending && !t->held) {
      *p = t->next;
      moe_nccl_track_free_locked(t);
    } else {
      p = &t->next;
    }
  }
  if (prev >= 0) (void)cudaSetDevice(prev);
  (void)cudaGetLastError();
}

static void *moe_nccl_watchdog(void *arg) {
  (void)arg;
  pthread_mutex_lock(&g_wd.mu);
  while (!g_wd.stop) {
    moe_nccl_poll_locked();
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_nsec += MOE_NCCL_POLL_NS;
    if (ts.tv_nsec >= 1000000000L) {
      ts.tv_sec += 1;
      ts.tv_nsec -= 1000000000L;
    }
    if (!g_wd.stop) (void)pthread_cond_timedwait(&g_wd.cv, &g_wd.mu, &ts);
  }
  pthread_mutex_unlock(&g_wd.mu);
  return NULL;
}

/* Stops the watchdog and waits for it (moe_nccl_finalize; also at exit,
 * before the CUDA runtime's own teardown, for a process that ends without
 * finalize). */
static void moe_nccl_watchdog_stop(void) {
  pthread_mutex_lock(&g_wd.mu);
  bool started = g_wd.started;
  g_wd.stop = true;
  if (g_wd.cv_ready) pthread_cond_broadcast(&g_wd.cv);
  pthread_mutex_unlock(&g_wd.mu);
  if (started) pthread_join(g_wd.thread, NULL);
  pthread_mutex_lock(&g_wd.mu);
  g_wd.started = false;
  pthread_mutex_unlock(&g_wd.mu);
}

/* Starts the watchdog once (g_wd.mu held). */
static moe_status moe_nccl_watchdog_start_locked(moe_ctx *ctx) {
  if (g_wd.started) return MOE_OK;
  if (!g_wd.cv_ready) {
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    int e = pthread_cond_init(&g_wd.cv, &a);
    pthread_condattr_destroy(&a);
    if (e != 0)
      return moe_error(ctx, MOE_ERR_INTERNAL, "cannot make the NCCL watchdog's condition: %s",
                       strerror(e));
    g_wd.cv_ready = true;
  }
  g_wd.stop = false;
  int e = pthread_create(&g_wd.thread, NULL, moe_nccl_watchdog, NULL);
  if (e != 0)
    return moe_error(ctx, MOE_ERR_INTERNAL, "cannot start the NCCL watchdog thread: %s",
                     strerror(e));
  g_wd.started = true;
  static bool at_exit = false;
  if (!at_exit) at_exit = atexit(moe_nccl_watchdog_stop) == 0;
  return MOE_OK;
}

/* ------------------------------------------------------------ the states */

/* The failure of c (or of its NCCL communicator) as this call's error. */
static moe_status moe_nccl_failed_error(moe_ctx *ctx, moe_comm *c) {
  if (moe_nccl_comm_failed(c)) return moe_error(ctx, MOE_ERR_COMM, "%s", c->failure);
  return moe_error(ctx, MOE_ERR_COMM, "the NCCL communicator of group '%s' was aborted",
                   c->name);
}

/* A state around an initialised NCCL communicator: stream, event, mutex,
 * and its place in g_wd.states. On failure comm is destroyed. */
static moe_status moe_nccl_state_new(moe_ctx *ctx, moe_comm *c, int device, ncclComm_t comm,
                                     moe_nccl_state **out) {
  moe_status st = MOE_OK;
  moe_nccl_state *nc = (moe_nccl_state *)calloc(1, sizeof(*nc));
  if (!nc) {
    st = moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "out of host memory for an NCCL state");
    goto fail;
  }
  nc->owner = c;
  nc->device = device;
  nc->comm = comm;
  int lo = 0, hi = 0;
  cudaError_t e = cudaDeviceGetStreamPriorityRange(&lo, &hi);
  if (e == cudaSuccess)
    e = cudaStreamCreateWithPriority(&nc->stream, cudaStreamNonBlocking, hi);
  if (e == cudaSuccess) {
    e = cudaEventCreateWithFlags(&nc->ready, cudaEventDisableTiming);
    if (e != cudaSuccess) (void)cudaStreamDestroy(nc->stream);
  }
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    st = moe_error(ctx, MOE_ERR_CUDA, "making the communication stream of group '%s' on cuda:%d "
                   "failed at %s:%d: %s (%s)", c->name, device, moe_check_file(__FILE__),
                   __LINE__, cudaGetErrorString(e), cudaGetErrorName(e));
    goto fail;
  }
  pthread_mutex_init(&nc->mu, NULL);
  pthread_mutex_lock(&g_wd.mu);
  nc->next = g_wd.states;
  g_wd.states = nc;
  pthread_mutex_unlock(&g_wd.mu);
  c->nccl = nc;
  *out = nc;
  return MOE_OK;
fail:
  free(nc);
  (void)ncclCommDestroy(comm);
  return st;
}

/* What rank 0 sends the others to make an NCCL communicator, and the
 * requests that carry it. */
typedef struct moe_nccl_boot {
  ncclUniqueId id;
  int ok;                /* rank 0 made the id */
  int code;              /* its ncclResult_t otherwise */
  MPI_Request reqs[2];   /* the broadcast, the barrier (not sent) */
} moe_nccl_boot;

/* Waits for reqs, polling, until c's timeout from now. */
static moe_status moe_nccl_mpi_wait(moe_ctx *ctx, moe_comm *c, int device, int n,
                                    MPI_Request *reqs) {
  double deadline = moe_nccl_now() + c->timeout;
  char where[160];
  moe_nccl_where(c, device, where, sizeof where);
  for (;;) {
    int flag = 0;
    int rc = MPI_Testall(n, reqs, &flag, MPI_STATUSES_IGNORE);
    if (rc != MPI_SUCCESS)
      return moe_comm_fail(ctx, c, "NCCL setup of %s: MPI failed (error %d) while the ranks "
                           "exchanged the NCCL id", where, rc);
    if (flag) return MOE_OK;
    if (moe_nccl_now() > deadline)
      return moe_comm_fail(ctx, c, "NCCL setup of %s did not complete within %g s: not every "
                           "member made its first GPU collective on the group", where,
                           c->timeout);
    moe_nccl_sleep_ns(100000L);
  }
}

/* c's state for `device`, made on first use: rank 0's NCCL id broadcast
 * over c->mpi (with a barrier, both polled against the timeout, so that a
 * member that never comes fails the others instead of hanging them in
 * ncclCommInitRank), then ncclCommInitRankConfig. The device is current
 * on return. */
static moe_status moe_nccl_state_get(moe_ctx *ctx, moe_comm *c, int device,
                                     moe_nccl_state **out) {
  if (moe_nccl_comm_failed(c)) return moe_nccl_failed_error(ctx, c);
  void *compute;
  MOE_CHECK(moe_cuda_stream(ctx, device, &compute)); /* validates, makes device current */
  moe_nccl_state *nc = (moe_nccl_state *)c->nccl;
  if (nc) {
    if (nc->device != device)
      return moe_error(ctx, MOE_ERR_DEVICE, "group '%s' runs NCCL on cuda:%d but this tensor "
                       "is on cuda:%d (one GPU per rank and group)", c->name, nc->device,
                       device);
    if (moe_nccl_aborted(nc)) return moe_nccl_failed_error(ctx, c);
    *out = nc;
    return MOE_OK;
  }
  char where[160];
  moe_nccl_where(c, device, where, sizeof where);
  /* On the heap: MPI may still write into it after a timeout, when it is
   * left to the end of the process. */
  moe_nccl_boot *boot = (moe_nccl_boot *)calloc(1, sizeof(*boot));
  if (!boot) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "out of host memory for NCCL setup");
  if (c->rank == 0) {
    ncclResult_t r = ncclGetUniqueId(&boot->id);
    boot->ok = r == ncclSuccess;
    boot->code = (int)r;
  }
  if (c->size > 1 && c->mpi != MPI_COMM_NULL) {
    int rc = MPI_Ibcast(boot, (int)offsetof(moe_nccl_boot, reqs), MPI_BYTE, 0, c->mpi,
                        &boot->reqs[0]);
    if (rc == MPI_SUCCESS) rc = MPI_Ibarrier(c->mpi, &boot->reqs[1]);
    if (rc != MPI_SUCCESS)
      return moe_comm_fail(ctx, c, "NCCL setup of %s: MPI failed (error %d) to send the NCCL "
                           "id", where, rc); /* boot may be in use: left */
    MOE_CHECK(moe_nccl_mpi_wait(ctx, c, device, 2, boot->reqs)); /* likewise */
  }
  ncclUniqueId id = boot->id;
  int ok = boot->ok, code = boot->code;
  free(boot);
  if (!ok)
    return moe_comm_fail(ctx, c, "NCCL setup of %s: rank 0 could not make the NCCL id: %s",
                         where, ncclGetErrorString((ncclResult_t)code));
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 1;
  cfg.commName = c->name;
  ncclComm_t comm = NULL;
  ncclResult_t r = ncclCommInitRankConfig(&comm, c->size, id, c->rank, &cfg);
  if (r != ncclSuccess)
    return moe_comm_fail(ctx, c, "NCCL setup of %s: ncclCommInitRankConfig failed: %s (%s)",
                         where, ncclGetErrorString(r), ncclGetLastError(NULL));
  return moe_nccl_state_new(ctx, c, device, comm, out);
}

/* --------------------------------------------------- one collective call */

typedef struct moe_nccl_call {
  moe_nccl_state *nc;
  cudaStream_t compute;
  cudaEvent_t done;
  moe_nccl_track *track;
  int device;
  bool timed;          /* tp's start is recorded */
  moe_nccl_tpair tp;
  char what[MOE_NCCL_WHAT];
} moe_nccl_call;

/* ------------------------------------------------------------- timing */

/* Back to the pool (destroyed when the pool cannot grow). g_tm.mu held. */
static void moe_nccl_tpair_put_locked(moe_nccl_tpair p) {
  if (g_tm.npool == g_tm.cap_pool) {
    int cap = g_tm.cap_pool ? 2 * g_tm.cap_pool : 16;
    moe_nccl_tpair *q = (moe_nccl_tpair *)realloc(g_tm.pool, (size_t)cap * sizeof(*q));
    if (q) {
      g_tm.pool = q;
      g_tm.cap_pool = cap;
    }
  }
  if (g_tm.npool < g_tm.cap_pool) {
    g_tm.pool[g_tm.npool++] = p;
    return;
  }
  (void)cudaEventDestroy(p.start);
  (void)cudaEventDestroy(p.stop);
  (void)cudaGetLastError();
}

/* The span of a completed pair into g_tm.ms. g_tm.mu held. */
static void moe_nccl_tpair_add_locked(const moe_nccl_tpair *p) {
  float ms = 0;
  if (cudaEventElapsedTime(&ms, p->start, p->stop) == cudaSuccess && ms > 0)
    g_tm.ms[p->op] += (double)ms;
  (void)cudaGetLastError();
}

/* Folds the completed pairs at the head of the pending list, without
 * waiting (wait false), or all of them, waiting for each (wait true: an
 * error of the wait is returned after the rest are folded). g_tm.mu held;
 * restores the current device. */
static cudaError_t moe_nccl_tpair_fold_locked(bool wait) {
  int prev = -1;
  if (cudaGetDevice(&prev) != cudaSuccess) prev = -1;
  cudaError_t first = cudaSuccess;
  int i = 0;
  for (; i < g_tm.npending; i++) {
    moe_nccl_tpair *p = &g_tm.pending[i];
    cudaError_t e = cudaSetDevice(p->device);
    if (e == cudaSuccess) e = wait ? cudaEventSynchronize(p->stop) : cudaEventQuery(p->stop);
    if (e == cudaErrorNotReady && !wait) {
      (void)cudaGetLastError();
      break;
    }
    if (e == cudaSuccess) moe_nccl_tpair_add_locked(p);
    else if (first == cudaSuccess) first = e;
    (void)cudaGetLastError();
    moe_nccl_tpair_put_locked(*p);
  }
  memmove(g_tm.pending, g_tm.pending + i, (size_t)(g_tm.npending - i) * sizeof(*g_tm.pending));
  g_tm.npending -= i;
  if (prev >= 0) (void)cudaSetDevice(prev);
  (void)cudaGetLastError();
  return first;
}

/* A pair for a timed collective on the current device: from the pool or
 * new (timing events). False when none can be made (the call goes untimed). */
static bool moe_nccl_tpair_get(int device, int op, moe_nccl_tpair *out) {
  pthread_mutex_lock(&g_tm.mu);
  bool got = false;
  for (int i = g_tm.npool - 1; i >= 0 && !got; i--) {
    if (g_tm.pool[i].device != device) continue;
    *out = g_tm.pool[i];
    g_tm.pool[i] = g_tm.pool[--g_tm.npool];
    got = true;
  }
  pthread_mutex_unlock(&g_tm.mu);
  if (!got) {
    if (cudaEventCreate(&out->start) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    if (cudaEventCreate(&out->stop) != cudaSuccess) {
      (void)cudaEventDestroy(out->start);
      (void)cudaGetLastError();
      return false;
    }
    out->device = device;
  }
  out->op = op;
  return true;
}

/* Back to the pool unused (the collective did not go ahead). */
static void moe_nccl_tpair_drop(moe_nccl_tpair p) {
  pthread_mutex_lock(&g_tm.mu);
  moe_nccl_tpair_put_locked(p);
  pthread_mutex_unlock(&g_tm.mu);
}

/* A recorded pair joins the pending list (folding the completed ones
 * first when many are pending); dropped when the list cannot grow. */
static void moe_nccl_tpair_push(moe_nccl_tpair p) {
  pthread_mutex_lock(&g_tm.mu);
  if (g_tm.npending >= MOE_NCCL_FOLD_AT) (void)moe_nccl_tpair_fold_locked(false);
  if (g_tm.npending == g_tm.cap_pending) {
    int cap = g_tm.cap_pending ? 2 * g_tm.cap_pending : 64;
    moe_nccl_tpair *q = (moe_nccl_tpair *)realloc(g_tm.pending, (size_t)cap * sizeof(*q));
    if (q) {
      g_tm.pending = q;
      g_tm.cap_pending = cap;
    }
  }
  if (g_tm.npending < g_tm.cap_pending) g_tm.pending[g_tm.npending++] = p;
  else moe_nccl_tpair_put_locked(p);
  pthread_mutex_unlock(&g_tm.mu);
}

moe_status moe_nccl_timing_collect(moe_ctx *ctx, double *ms) {
  pthread_mutex_lock(&g_tm.mu);
  cudaError_t e = moe_nccl_tpair_fold_locked(true);
  for (int i = 0; i < MOE_COMM_OP_COUNT; i++) {
    ms[i] += g_tm.ms[i];
    g_tm.ms[i] = 0;
  }
  pthread_mutex_unlock(&g_tm.mu);
  if (e != cudaSuccess)
    return moe_error(ctx, MOE_ERR_CUDA, "comm_timing_read: waiting for a collective's timing "
                     "event failed: %s (%s)", cudaGetErrorString(e), cudaGetErrorName(e));
  return MOE_OK;
}

void moe_nccl_timing_clear(void) {
  pthread_mutex_lock(&g_tm.mu);
  for (int i = 0; i < g_tm.npending; i++) {
    (void)cudaEventDestroy(g_tm.pending[i].start);
    (void)cudaEventDestroy(g_tm.pending[i].stop);
  }
  for (int i = 0; i < g_tm.npool; i++) {
    (void)cudaEventDestroy(g_tm.pool[i].start);
    (void)cudaEventDestroy(g_tm.pool[i].stop);
  }
  (void)cudaGetLastError();
  free(g_tm.pending);
  free(g_tm.pool);
  g_tm.pending = g_tm.pool = NULL;
  g_tm.npending = g_tm.cap_pending = g_tm.npool = g_tm.cap_pool = 0;
  memset(g_tm.ms, 0, sizeof g_tm.ms);
  pthread_mutex_unlock(&g_tm.mu);
}

/* Gives back what begin took when the call does not go ahead. */
static void moe_nccl_call_drop(moe_nccl_call *k) {
  if (k->timed) moe_nccl_tpair_drop(k->tp);
  k->timed = false;
  if (k->track) {
    pthread_mutex_lock(&g_wd.mu);
    k->track->nc = k->nc;
    k->track->done = k->done;
    if (k->done) moe_nccl_track_free_locked(k->track);
    else free(k->track);
    pthread_mutex_unlock(&g_wd.mu);
  }
  k->track = NULL;
  k->done = NULL;
}

/* Before the NCCL calls: the state, the compute stream, a done event and a
 * track, the watchdog running, the communication stream ordered after the
 * compute stream; returns with nc->mu held. what is a printf format naming
 * the collective and its sizes (the group, rank and device are added). */
static moe_status moe_nccl_begin(moe_ctx *ctx, moe_comm *c, int device, const moe_work *w,
                                 moe_nccl_call *k, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 6, 7)))
#endif
    ;
static moe_status moe_nccl_begin(moe_ctx *ctx, moe_comm *c, int device, const moe_work *w,
                                 moe_nccl_call *k, const char *fmt, ...) {
  memset(k, 0, sizeof *k);
  k->device = device;
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(k->what, sizeof k->what, fmt, ap);
  va_end(ap);
  if (n >= 0 && (size_t)n + 4 < sizeof k->what) {
    memcpy(k->what + n, " on ", 5);
    moe_nccl_where(c, device, k->what + n + 4, sizeof k->what - (size_t)n - 4);
  }

  MOE_CHECK(moe_nccl_state_get(ctx, c, device, &k->nc));
  void *s;
  MOE_CHECK(moe_cuda_stream(ctx, device, &s));
  k->compute = (cudaStream_t)s;
  moe_nccl_state *nc = k->nc;
  k->track = (moe_nccl_track *)calloc(1, sizeof(*k->track));
  if (!k->track) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "out of host memory for a work");

  pthread_mutex_lock(&g_wd.mu);
  moe_status st = moe_nccl_watchdog_start_locked(ctx);
  if (st == MOE_OK && nc->npool > 0) k->done = nc->pool[--nc->npool];
  pthread_mutex_unlock(&g_wd.mu);
  if (st != MOE_OK) {
    moe_nccl_call_drop(k);
    return st;
  }
  cudaError_t e = cudaSuccess;
  if (!k->done) e = cudaEventCreateWithFlags(&k->done, cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaEventRecord(nc->ready, k->compute);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(nc->stream, nc->ready, 0);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    moe_nccl_call_drop(k);
    return moe_error(ctx, MOE_ERR_CUDA, "%s: ordering the communication stream failed at "
                     "%s:%d: %s (%s)", k->what, moe_check_file(__FILE__), __LINE__,
                     cudaGetErrorString(e), cudaGetErrorName(e));
  }
  /* timed: the span starts once the stream may run the collective */
  if (w && w->timed >= 0 && moe_nccl_tpair_get(device, w->timed, &k->tp)) {
    k->timed = true;
    if (cudaEventRecord(k->tp.start, nc->stream) != cudaSuccess) {
      (void)cudaGetLastError();
      moe_nccl_tpair_drop(k->tp);
      k->timed = false;
    }
  }
  pthread_mutex_lock(&nc->mu);
  if (moe_nccl_aborted(nc)) {
    pthread_mutex_unlock(&nc->mu);
    moe_nccl_call_drop(k);
    return moe_nccl_failed_error(ctx, c);
  }
  return MOE_OK;
}

/* After the NCCL calls (r: the first failure, call: its name): releases
 * nc->mu; on failure aborts the NCCL communicator and fails c; otherwise
 * records done, tracks it, and either hands it to w or (w NULL: a
 * synchronous call) makes the compute stream wait for it. */
static moe_status moe_nccl_end(moe_ctx *ctx, moe_comm *c, moe_nccl_call *k, ncclResult_t r,
                               const char *call, moe_work *w) {
  moe_nccl_state *nc = k->nc;
  if (r != ncclSuccess) {
    char last[256];
    snprintf(last, sizeof last, "%s", ncclGetLastError(nc->comm));
    (void)ncclCommAbort(nc->comm); /* its peers may be waiting in this collective */
    nc->comm = NULL;
    __atomic_store_n(&nc->aborted, true, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&nc->mu);
    pthread_mutex_lock(&g_wd.mu);
    for (moe_nccl_track *u = g_wd.tracks; u; u = u->next)
      if (u->nc == nc) u->pending = false;
    pthread_mutex_unlock(&g_wd.mu);
    moe_nccl_call_drop(k);
    return moe_comm_fail(ctx, c, "%s: %s failed: %s (%s); the NCCL communicator was aborted",
                         k->what, call, ncclGetErrorString(r), last);
  }
  pthread_mutex_unlock(&nc->mu);
  cudaError_t e = cudaEventRecord(k->done, nc->stream);
  if (e != cudaSuccess) {
    /* The collective is queued but cannot be waited for: wait here. */
    (void)cudaGetLastError();
    (void)cudaStreamSynchronize(nc->stream);
    (void)cudaGetLastError();
    moe_nccl_call_drop(k);
    return moe_error(ctx, MOE_ERR_CUDA, "%s: cudaEventRecord failed at %s:%d: %s (%s)",
                     k->what, moe_check_file(__FILE__), __LINE__, cudaGetErrorString(e),
                     cudaGetErrorName(e));
  }
  if (k->timed) {
    if (cudaEventRecord(k->tp.stop, nc->stream) == cudaSuccess) {
      moe_nccl_tpair_push(k->tp);
    } else {
      (void)cudaGetLastError();
      moe_nccl_tpair_drop(k->tp);
    }
    k->timed = false;
  }
  moe_nccl_track *t = k->track;
  t->done = k->done;
  t->device = k->device;
  t->timeout = c->timeout;
  t->deadline = moe_nccl_now() + c->timeout;
  memcpy(t->what, k->what, sizeof t->what);
  t->comm = c;
  t->nc = nc;
  t->pending = true;
  t->held = w != NULL;
  if (w) {
    w->kind = MOE_WORK_GPU;
    w->device = k->device;
    w->done = (void *)k->done;
    w->deadline = moe_dist_now() + c->timeout;
    if (!w->what[0]) snprintf(w->what, sizeof w->what, "%s", k->what);
  }
  pthread_mutex_lock(&g_wd.mu);
  t->next = g_wd.tracks;
  g_wd.tracks = t;
  pthread_mutex_unlock(&g_wd.mu);
  if (!w) MOE_CUDA_CHECK(ctx, cudaStreamWaitEvent(k->compute, k->done, 0));
  return MOE_OK;
}

static int moe_nccl_device(const moe_tensor *t) { return moe_tensor_device(t).index; }

/* ---------------------------------------------------------- collectives */

moe_status moe_nccl_all_reduce(moe_ctx *ctx, moe_comm *c, moe_tensor *t, moe_reduce_op op,
                               moe_work *w) {
  ncclDataType_t dt = ncclFloat32;
  ncclRedOp_t nop = ncclSum;
  MOE_CHECK(moe_nccl_types(ctx, "all_reduce", t->dtype, (int)op, &dt, &nop));
  size_t n = (size_t)moe_tensor_numel(t);
  moe_nccl_call k;
  MOE_CHECK(moe_nccl_begin(ctx, c, moe_nccl_device(t), w, &k, "all_reduce(%s) of %zu %s",
                           moe_reduce_op_name(op), n, moe_dtype_name(t->dtype)));
  void *p = moe_tensor_data(t);
  ncclResult_t r = n ? ncclAllReduce(p, p, n, dt, nop, k.nc->comm, k.nc->stream) : ncclSuccess;
  return moe_nccl_end(ctx, c, &k, r, "ncclAllReduce", w);
}

moe_status moe_nccl_reduce_scatter(moe_ctx *ctx, moe_comm *c, moe_tensor *out, moe_tensor *in,
                                   moe_reduce_op op, moe_work *w) {
  ncclDataType_t dt = ncclFloat32;
  ncclRedOp_t nop = ncclSum;
  MOE_CHECK(moe_nccl_types(ctx, "reduce_scatter", in->dtype, (int)op, &dt, &nop));
  size_t n = (size_t)moe_tensor_numel(out); /* per rank */
  moe_nccl_call k;
  MOE_CHECK(moe_nccl_begin(ctx, c, moe_nccl_device(in), w, &k,
                           "reduce_scatter(%s) of %zu %s into %zu", moe_reduce_op_name(op),
                           (size_t)moe_tensor_numel(in), moe_dtype_name(in->dtype), n));
  ncclResult_t r = n ? ncclReduceScatter(moe_tensor_data(in), moe_tensor_data(out), n, dt, nop,
                                         k.nc->comm, k.nc->stream)
                     : ncclSuccess;
  return moe_nccl_end(ctx, c, &k, r, "ncclReduceScatter", w);
}

moe_status moe_nccl_all_gather(moe_ctx *ctx, moe_comm *c, moe_tensor *out, moe_tensor *in,
                               moe_work *w) {
  ncclDataType_t dt = ncclFloat32;
  MOE_CHECK(moe_nccl_types(ctx, "all_gather", in->dtype, -1, &dt, NULL));
  size_t n = (size_t)moe_tensor_numel(in); /* per rank */
  moe_nccl_call k;
  MOE_CHECK(moe_nccl_begin(ctx, c, moe_nccl_device(in), w, &k, "all_gather of %zu %s into %zu", n,
                           moe_dtype_name(in->dtype), (size_t)moe_tensor_numel(out)));
  ncclResult_t r = n ? ncclAllGather(moe_tensor_data(in), moe_tensor_data(out), n, dt,
                                     k.nc->comm, k.nc->stream)
                     : ncclSuccess;
  return moe_nccl_end(ctx, c, &k, r, "ncclAllGather", w);
}

moe_status moe_nccl_broadcast(moe_ctx *ctx, moe_comm *c, moe_tensor *t, int root, moe_work *w) {
  ncclDataType_t dt = ncclFloat32;
  MOE_CHECK(moe_nccl_types(ctx, "broadcast", t->dtype, -1, &dt, NULL));
  size_t n = (size_t)moe_tensor_numel(t);
  moe_nccl_call k;
  MOE_CHECK(moe_nccl_begin(ctx, c, moe_nccl_device(t), w, &k, "broadcast from rank %d of %zu %s",
                           root, n, moe_dtype_name(t->dtype)));
  void *p = moe_tensor_data(t);
  ncclResult_t r =
      n ? ncclBroadcast(p, p, n, dt, root, k.nc->comm, k.nc->stream) : ncclSuccess;
  return moe_nccl_end(ctx, c, &k, r, "ncclBroadcast", w);
}

/* Elements per row along dim 0 (1 for a 1-d tensor). */
static size_t moe_nccl_row_elems(const moe_tensor *t) {
  size_t n = 1;
  for (int d = 1; d < t->ndim; d++) n *= (size_t)t->shape[d];
  return n;
}

moe_status moe_nccl_all_to_all(moe_ctx *ctx, moe_comm *c, moe_tensor *out, moe_tensor *in,
                               const int64_t *send, const int64_t *recv, moe_work *w) {
  ncclDataType_t dt = ncclFloat32;
  MOE_CHECK(moe_nccl_types(ctx, "all_to_all", in->dtype, -1, &dt, NULL));
  size_t es = moe_dtype_size(in->dtype);
  size_t rin = moe_nccl_row_elems(in), rout = moe_nccl_row_elems(out);
  int64_t ns = 0, nr = 0;
  for (int j = 0; j < c->size; j++) {
    ns += send[j];
    nr += recv[j];
  }
  moe_nccl_call k;
  MOE_CHECK(moe_nccl_begin(ctx, c, moe_nccl_device(in), w, &k,
                           "all_to_all of %s %s (sending %lld rows, receiving %lld rows of %zu)",
                           MOE_SHAPE(in), moe_dtype_name(in->dtype), (long long)ns,
                           (long long)nr, rin));
  const char *src = (const char *)moe_tensor_data(in);
  char *dst = (char *)moe_tensor_data(out);
  /* One group; an error inside it still ends the group before returning. */
  const char *call = "ncclGroupStart";
  ncclResult_t r = ncclGroupStart();
  if (r == ncclSuccess) {
    size_t soff = 0, roff = 0; /* elements */
    for (int j = 0; j < c->size && r == ncclSuccess; j++) {
      size_t sn = (size_t)send[j] * rin, rn = (size_t)recv[j] * rout;
      if (sn) {
        r = ncclSend(src + soff * es, sn, dt, j, k.nc->comm, k.nc->stream);
        call = "ncclSend";
      }
      if (r == ncclSuccess && rn) {
        r = ncclRecv(dst + roff * es, rn, dt, j, k.nc->comm, k.nc->stream);
        call = "ncclRecv";
      }
      soff += sn;
      roff += rn;
    }
    ncclResult_t e = ncclGroupEnd();
    if (r == ncclSuccess) {
      r = e;
      call = "ncclGroupEnd";
    }
  }
  return moe_nccl_end(ctx, c, &k, r, call, w);
}

moe_status moe_nccl_send(moe_ctx *ctx, moe_comm *c, moe_tensor *t, int peer, moe_work *w) {
  ncclDataType_t dt = ncclFloat32;
  MOE_CHECK(moe_nccl_types(ctx, "send", t->dtype, -1, &dt, NULL));
  size_t n = (size_t)moe_tensor_numel(t);
  moe_nccl_call k;
  MOE_CHECK(moe_nccl_begin(ctx, c, moe_nccl_device(t), w, &k, "send of %zu %s to rank %d", n,
                           moe_dtype_name(t->dtype), peer));
  ncclResult_t r =
      n ? ncclSend(moe_tensor_data(t), n, dt, peer, k.nc->comm, k.nc->stream) : ncclSuccess;
  return moe_nccl_end(ctx, c, &k, r, "ncclSend", w);
}

moe_status moe_nccl_recv(moe_ctx *ctx, moe_comm *c, moe_tensor *t, int peer, moe_work *w) {
  ncclDataType_t dt = ncclFloat32;
  MOE_CHECK(moe_nccl_types(ctx, "recv", t->dtype, -1, &dt, NULL));
  size_t n = (size_t)moe_tensor_numel(t);
  moe_nccl_call k;
  MOE_CHECK(moe_nccl_begin(ctx, c, moe_nccl_device(t), w, &k, "recv of %zu %s from rank %d", n,
                           moe_dtype_name(t->dtype), peer));
  ncclResult_t r =
      n ? ncclRecv(moe_tensor_data(t), n, dt, peer, k.nc->comm, k.nc->stream) : ncclSuccess;
  return moe_nccl_end(ctx, c, &k, r, "ncclRecv", w);
}

/* ----------------------------------------------------------------- works */

moe_status moe_nccl_work_wait(moe_ctx *ctx, moe_work *w) {
  if (w->done) {
    /* Ordered even when the communicator failed: see Memory above. */
    void *s;
    MOE_CHECK(moe_cuda_stream(ctx, w->device, &s));
    MOE_CUDA_CHECK(ctx, cudaStreamWaitEvent((cudaStream_t)s, (cudaEvent_t)w->done, 0));
  }
  if (w->comm && moe_nccl_comm_failed(w->comm)) return moe_nccl_failed_error(ctx, w->comm);
  return MOE_OK;
}

bool moe_nccl_work_done(moe_work *w) {
  if (!w->done) return true;
  cudaError_t q = cudaEventQuery((cudaEvent_t)w->done);
  if (q == cudaErrorNotReady) return false;
  if (q != cudaSuccess) (void)cudaGetLastError(); /* finished, badly: the wait says how */
  return true;
}

void moe_nccl_work_release(moe_work *w) {
  if (!w->done) return;
  pthread_mutex_lock(&g_wd.mu);
  moe_nccl_track **p = &g_wd.tracks;
  while (*p && !((*p)->held && (*p)->done == (cudaEvent_t)w->done)) p = &(*p)->next;
  if (*p) {
    moe_nccl_track *t = *p;
    t->held = false;
    if (!t->pending) {
      *p = t->next;
      moe_nccl_track_free_locked(t);
    }
  }
  pthread_mutex_unlock(&g_wd.mu);
  w->done = NULL;
}

/* --------------------------------------------------------- communicators */

moe_status moe_nccl_comm_split(moe_ctx *ctx, moe_comm *parent, moe_comm *child, int color,
                               int key) {
  moe_nccl_state *p = (moe_nccl_state *)parent->nccl;
  if (!p) return MOE_OK; /* the child makes its own on first use */
  if (moe_nccl_comm_failed(parent) || moe_nccl_aborted(p))
    return moe_nccl_failed_error(ctx, parent);
  void *s;
  MOE_CHECK(moe_cuda_stream(ctx, p->device, &s)); /* makes the parent's device current */
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 1;
  cfg.commName = child->name;
  ncclComm_t comm = NULL;
  /* Every rank of parent takes part; a group of one never uses NCCL (dist.c
   * copies), so its rank asks for no communicator. */
  int ncolor = child->size == 1 ? NCCL_SPLIT_NOCOLOR : color;
  pthread_mutex_lock(&p->mu);
  ncclResult_t r = p->comm ? ncclCommSplit(p->comm, ncolor, key, &comm, &cfg) : ncclInvalidUsage;
  const char *last = p->comm ? ncclGetLastError(p->comm) : "aborted";
  pthread_mutex_unlock(&p->mu);
  char where[160];
  moe_nccl_where(parent, p->device, where, sizeof where);
  if (r != ncclSuccess)
    return moe_error(ctx, MOE_ERR_COMM, "splitting '%s' from %s: ncclCommSplit failed: %s (%s)",
                     child->name, where, ncclGetErrorString(r), last);
  if (ncolor == NCCL_SPLIT_NOCOLOR) return MOE_OK;
  int nr = -1, rk = -1;
  if (!comm || ncclCommCount(comm, &nr) != ncclSuccess ||
      ncclCommUserRank(comm, &rk) != ncclSuccess || nr != child->size || rk != child->rank) {
    if (comm) (void)ncclCommDestroy(comm);
    return moe_error(ctx, MOE_ERR_INTERNAL, "splitting '%s' from %s: NCCL made rank %d of %d, "
                     "MPI rank %d of %d", child->name, where, rk, nr, child->rank, child->size);
  }
  moe_nccl_state *nc;
  return moe_nccl_state_new(ctx, child, p->device, comm, &nc);
}

void moe_nccl_comm_free(moe_comm *c) {
  moe_nccl_state *nc = (moe_nccl_state *)c->nccl;
  if (!nc) return;
  /* Its collectives first: each completes or is aborted at its deadline. */
  for (;;) {
    pthread_mutex_lock(&g_wd.mu);
    moe_nccl_poll_locked();
    bool busy = false;
    for (moe_nccl_track *t = g_wd.tracks; t && !busy; t = t->next)
      busy = t->nc == nc && t->pending;
    pthread_mutex_unlock(&g_wd.mu);
    if (!busy) break;
    moe_nccl_sleep_ns(1000000L);
  }
  pthread_mutex_lock(&g_wd.mu);
  moe_nccl_state **sp = &g_wd.states;
  while (*sp && *sp != nc) sp = &(*sp)->next;
  if (*sp) *sp = nc->next;
  moe_nccl_track **p = &g_wd.tracks;
  while (*p) {
    moe_nccl_track *t = *p;
    if (t->nc != nc) {
      p = &t->next;
      continue;
    }
    t->nc = NULL; /* a held one's event is destroyed at release */
    t->comm = NULL;
    if (t->held) {
      p = &t->next;
    } else {
      *p = t->next;
      moe_nccl_track_free_locked(t);
    }
  }
  for (int i = 0; i < nc->npool; i++) (void)cudaEventDestroy(nc->pool[i]);
  free(nc->pool);
  pthread_mutex_unlock(&g_wd.mu);

  int prev = -1;
  if (cudaGetDevice(&prev) != cudaSuccess) prev = -1;
  (void)cudaSetDevice(nc->device);
  pthread_mutex_lock(&nc->mu);
  if (nc->comm) {
    (void)cudaStreamSynchronize(nc->stream);
    if (moe_nccl_comm_failed(c))
      (void)ncclCommAbort(nc->comm);
    else if (ncclCommDestroy(nc->comm) != ncclSuccess)
      (void)ncclCommAbort(nc->comm);
    nc->comm = NULL;
  }
  pthread_mutex_unlock(&nc->mu);
  (void)cudaEventDestroy(nc->ready);
  (void)cudaStreamDestroy(nc->stream);
  pthread_mutex_destroy(&nc->mu);
  free(nc);
  c->nccl = NULL;
  if (prev >= 0) (void)cudaSetDevice(prev);
  (void)cudaGetLastError();
}

void moe_nccl_finalize(void) {
  moe_nccl_watchdog_stop();
  pthread_mutex_lock(&g_wd.mu);
  moe_nccl_state *left = g_wd.states;
  pthread_mutex_unlock(&g_wd.mu);
  /* Communicators dist.c did not free (it frees them before this). */
  while (left) {
    moe_comm *c = left->owner;
    moe_nccl_comm_free(c); /* unlinks the state */
    pthread_mutex_lock(&g_wd.mu);
    left = g_wd.states;
    pthread_mutex_unlock(&g_wd.mu);
  }
  /* Tracks no work holds any more (held ones go at release). */
  pthread_mutex_lock(&g_wd.mu);
  moe_nccl_track **p = &g_wd.tracks;
  while (*p) {
    moe_nccl_track *t = *p;
    if (t->held) {
      p = &t->next;
    } else {
      *p = t->next;
      moe_nccl_track_free_locked(t);
    }
  }
  pthread_mutex_unlock(&g_wd.mu);
}
