/*
 * dist.c - the world, communicators and the collectives of moe_dist.h:
 * argument checks for every device, the cross-rank checks of debug mode,
 * the CPU path over MPI, and the hand-over of GPU tensors to
 * core/dist_nccl.c (moe_nccl_*, dist_internal.h).
 *
 * Owns
 *   - the world (one per process, from moe_dist_init to moe_dist_finalize)
 *     and the list of live communicators, so that finalize frees what
 *     callers left;
 *   - the MPI datatype of the 2-byte floats and their reduction ops (sum,
 *     max, min accumulate in float: a datatype's op, not an algorithm);
 *   - the works and buffers of failed CPU collectives: an MPI request that
 *     never completes can be neither freed nor cancelled, and MPI may
 *     still write into its buffers, so they are kept (reachable) until the
 *     process ends.
 *
 * A world of one rank started without a launcher never touches MPI, and
 * neither does any communicator of one rank: every collective is then a
 * local copy. Otherwise each CPU collective is one non-blocking MPI call
 * (MPI_Iallreduce, MPI_Ialltoallv, ...); the host waits with MPI_Testall
 * (a few polls, then a sleep between polls that backs off from 20 us to
 * 1 ms), until the communicator's timeout counted from the start of the
 * wait. MPI progresses a non-blocking collective while it is tested, so
 * an asynchronous CPU collective moves when it is waited for (or polled
 * with moe_work_done).
 *
 * MPI counts are ints: one call moves at most 2^31 - 1 elements per rank
 * (an error says so beyond that).
 */
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "dist_internal.h"

#define DIST_SLEEP_MIN_NS 20000L   /* first sleep of a wait */
#define DIST_SLEEP_MAX_NS 1000000L /* its cap */
#define DIST_SPIN_POLLS 32         /* MPI_Testall calls before the first sleep */
#define DIST_TAG_DATA 0            /* send / recv payloads */
#define DIST_TAG_DESC 1            /* debug descriptors of send / recv */
#define DIST_DEFAULT_TIMEOUT 600.0

static struct {
  moe_comm *world;
  moe_dist_env env;
  moe_comm **comms; /* (ncomms) live communicators, the world first */
  int ncomms, cap_comms;
  bool types;             /* half and half_ops are made */
  MPI_Datatype half;      /* 2 bytes: bf16 and f16 */
  MPI_Op half_ops[2][3];  /* [bf16, f16][sum, max, min] */
  void **kept;            /* (nkept) works and buffers of failed collectives */
  int nkept, cap_kept;
} g_dist;

/* ------------------------------------------------------------ reduce ops */

static const char *const reduce_names[] = {"sum", "avg", "max", "min"};
_Static_assert(sizeof reduce_names / sizeof reduce_names[0] == MOE_REDUCE_COUNT,
               "reduce_names must name every moe_reduce_op");

const char *moe_reduce_op_name(moe_reduce_op op) {
  return (unsigned)op < MOE_REDUCE_COUNT ? reduce_names[op] : "unknown";
}

bool moe_reduce_op_parse(const char *name, moe_reduce_op *out) {
  if (!name) return false;
  for (int i = 0; i < MOE_REDUCE_COUNT; i++)
    if (strcmp(name, reduce_names[i]) == 0) {
      if (out) *out = (moe_reduce_op)i;
      return true;
    }
  return false;
}

/* -------------------------------------------------------------- helpers */

double moe_dist_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void dist_sleep(long ns) {
  struct timespec ts = {0, ns};
  nanosleep(&ts, NULL);
}

moe_status moe_comm_fail(moe_ctx *ctx, moe_comm *c, const char *fmt, ...) {
  char msg[sizeof c->failure];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (c && !c->failed) {
    c->failed = true;
    snprintf(c->failure, sizeof c->failure, "%s", msg);
  }
  return moe_error(ctx, MOE_ERR_COMM, "%s", msg);
}

/* An MPI call failed: the communicator is in an unknown state. */
static moe_status mpi_fail(moe_ctx *ctx, moe_comm *c, int rc, const char *what) {
  char err[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, err, &len) != MPI_SUCCESS) snprintf(err, sizeof err, "MPI error %d", rc);
  return moe_comm_fail(ctx, c, "%s failed in MPI: %s", what, err);
}

static moe_status comm_usable(moe_ctx *ctx, const char *fn, moe_comm *c) {
  if (!c) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: the communicator is NULL", fn);
  if (c->failed)
    return moe_error(ctx, MOE_ERR_COMM, "%s on group '%s': the group failed earlier: %s", fn,
                     c->name, c->failure);
  return MOE_OK;
}

static bool on_gpu(const moe_tensor *t) { return t->storage->device.type == MOE_DEVICE_CUDA; }

static moe_status check_tensor(moe_ctx *ctx, const char *fn, const char *name, const moe_tensor *t) {
  if (!t) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: %s is NULL", fn, name);
  if (!moe_tensor_is_contiguous(t))
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "%s: %s %s must be contiguous (call contiguous() first)", fn, name,
                     MOE_SHAPE(t));
  return MOE_OK;
}

static moe_status check_pair(moe_ctx *ctx, const char *fn, const moe_tensor *out,
                             const moe_tensor *in) {
  MOE_CHECK(check_tensor(ctx, fn, "output", out));
  MOE_CHECK(check_tensor(ctx, fn, "input", in));
  MOE_CHECK(moe_check_same_dtype(ctx, fn, "output", out->dtype, "input", in->dtype));
  MOE_CHECK(moe_check_same_device(ctx, fn, "output", moe_tensor_device(out), "input",
                                  moe_tensor_device(in)));
  /* MPI and NCCL read the input while they write the output. */
  size_t es = moe_dtype_size(in->dtype);
  const char *a = (const char *)moe_tensor_data(out), *b = (const char *)moe_tensor_data(in);
  size_t na = (size_t)moe_tensor_numel(out) * es, nb = (size_t)moe_tensor_numel(in) * es;
  if (out->storage == in->storage && na && nb && a < b + nb && b < a + na)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "%s: output %s and input %s overlap in memory (give the output its own "
                     "storage)",
                     fn, MOE_SHAPE(out), MOE_SHAPE(in));
  return MOE_OK;
}

static moe_status check_reduce(moe_ctx *ctx, const char *fn, moe_reduce_op op, moe_dtype dt) {
  if ((unsigned)op >= MOE_REDUCE_COUNT)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: unknown reduce op %d (sum, avg, max, min)",
                     fn, (int)op);
  if (op == MOE_REDUCE_AVG && !moe_dtype_is_float(dt))
    return moe_error(ctx, MOE_ERR_DTYPE,
                     "%s: avg needs a float tensor (f32, f64, bf16, f16), got %s (use sum)", fn,
                     moe_dtype_name(dt));
  if (op == MOE_REDUCE_SUM && dt == MOE_BOOL)
    return moe_error(ctx, MOE_ERR_DTYPE,
                     "%s: sum of bool tensors is not defined (max is 'any', min is 'all')", fn);
  return MOE_OK;
}

/* MPI counts are ints. */
static moe_status check_count(moe_ctx *ctx, const char *what, int64_t n) {
  if (n > INT_MAX)
    return moe_error(ctx, MOE_ERR_NOT_SUPPORTED,
                     "%s: %lld elements exceed what one MPI call moves (2^31 - 1 per rank); "
                     "split the tensor",
                     what, (long long)n);
  return MOE_OK;
}

/* Elements per row (dims 1..) of a tensor of at least one dim. */
static int64_t row_elems(const moe_tensor *t) {
  int64_t n = 1;
  for (int d = 1; d < t->ndim; d++) n *= t->shape[d];
  return n;
}

/* ----------------------------------------------------------- MPI types */

static void half_reduce(void *in, void *inout, int n, bool bf16, int kind) {
  const uint16_t *a = (const uint16_t *)in;
  uint16_t *b = (uint16_t *)inout;
  for (int i = 0; i < n; i++) {
    float x = bf16 ? moe_bf16_to_f32((moe_bf16){a[i]}) : moe_f16_to_f32((moe_f16){a[i]});
    float y = bf16 ? moe_bf16_to_f32((moe_bf16){b[i]}) : moe_f16_to_f32((moe_f16){b[i]});
    float r = kind == 0 ? x + y : kind == 1 ? (x > y ? x : y) : (x < y ? x : y);
    b[i] = bf16 ? moe_f32_to_bf16(r).bits : moe_f32_to_f16(r).bits;
  }
}
static void op_bf16_sum(void *a, void *b, int *n, MPI_Datatype *t) { half_reduce(a, b, *n, true, 0); }
static void op_bf16_max(void *a, void *b, int *n, MPI_Datatype *t) { half_reduce(a, b, *n, true, 1); }
static void op_bf16_min(void *a, void *b, int *n, MPI_Datatype *t) { half_reduce(a, b, *n, true, 2); }
static void op_f16_sum(void *a, void *b, int *n, MPI_Datatype *t) { half_reduce(a, b, *n, false, 0); }
static void op_f16_max(void *a, void *b, int *n, MPI_Datatype *t) { half_reduce(a, b, *n, false, 1); }
static void op_f16_min(void *a, void *b, int *n, MPI_Datatype *t) { half_reduce(a, b, *n, false, 2); }

static moe_status types_make(moe_ctx *ctx) {
  if (g_dist.types) return MOE_OK;
  MPI_User_function *fns[2][3] = {{op_bf16_sum, op_bf16_max, op_bf16_min},
                                  {op_f16_sum, op_f16_max, op_f16_min}};
  if (MPI_Type_contiguous(2, MPI_BYTE, &g_dist.half) != MPI_SUCCESS ||
      MPI_Type_commit(&g_dist.half) != MPI_SUCCESS)
    return moe_error(ctx, MOE_ERR_COMM, "init: cannot make the MPI datatype of bf16 and f16");
  for (int i = 0; i < 2; i++)
    for (int k = 0; k < 3; k++)
      if (MPI_Op_create(fns[i][k], 1, &g_dist.half_ops[i][k]) != MPI_SUCCESS)
        return moe_error(ctx, MOE_ERR_COMM, "init: cannot make the MPI reduce ops of bf16 and f16");
  g_dist.types = true;
  return MOE_OK;
}

static void types_free(void) {
  if (!g_dist.types) return;
  for (int i = 0; i < 2; i++)
    for (int k = 0; k < 3; k++) MPI_Op_free(&g_dist.half_ops[i][k]);
  MPI_Type_free(&g_dist.half);
  g_dist.types = false;
}

static MPI_Datatype mpi_type(moe_dtype dt) {
  switch (dt) {
    case MOE_F32: return MPI_FLOAT;
    case MOE_F64: return MPI_DOUBLE;
    case MOE_BF16:
    case MOE_F16: return g_dist.half;
    case MOE_I8: return MPI_INT8_T;
    case MOE_I32: return MPI_INT32_T;
    case MOE_I64: return MPI_INT64_T;
    default: return MPI_UINT8_T; /* u8, bool */
  }
}

/* avg is a sum, then a scale (finish_avg). */
static MPI_Op mpi_op(moe_dtype dt, moe_reduce_op op) {
  int k = op == MOE_REDUCE_MAX ? 1 : op == MOE_REDUCE_MIN ? 2 : 0;
  if (dt == MOE_BF16) return g_dist.half_ops[0][k];
  if (dt == MOE_F16) return g_dist.half_ops[1][k];
  return k == 1 ? MPI_MAX : k == 2 ? MPI_MIN : MPI_SUM;
}

/* ------------------------------------------------------- communicators */

static moe_status comm_register(moe_ctx *ctx, moe_comm *c) {
  if (g_dist.ncomms == g_dist.cap_comms) {
    int cap = g_dist.cap_comms ? 2 * g_dist.cap_comms : 8;
    moe_comm **p = (moe_comm **)realloc(g_dist.comms, (size_t)cap * sizeof *p);
    if (!p) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "split: out of host memory");
    g_dist.comms = p;
    g_dist.cap_comms = cap;
  }
  g_dist.comms[g_dist.ncomms++] = c;
  return MOE_OK;
}

static bool comm_unregister(moe_comm *c) {
  for (int i = 0; i < g_dist.ncomms; i++)
    if (g_dist.comms[i] == c) {
      memmove(g_dist.comms + i, g_dist.comms + i + 1,
              (size_t)(g_dist.ncomms - i - 1) * sizeof *g_dist.comms);
      g_dist.ncomms--;
      return true;
    }
  return false;
}

/* Frees c and its MPI communicator (not a failed one's: collectives may
 * still be pending on it). */
static void comm_destroy(moe_comm *c) {
  moe_nccl_comm_free(c);
  if (c->mpi != MPI_COMM_NULL && !c->failed) {
    int fin = 0;
    MPI_Finalized(&fin);
    if (!fin) MPI_Comm_free(&c->mpi);
  }
  free(c->world_ranks);
  free(c);
}

static moe_comm *comm_alloc(int size) {
  moe_comm *c = (moe_comm *)calloc(1, sizeof *c);
  if (!c) return NULL;
  c->world_ranks = (int *)calloc((size_t)size, sizeof(int));
  if (!c->world_ranks) {
    free(c);
    return NULL;
  }
  c->size = size;
  c->mpi = MPI_COMM_NULL;
  return c;
}

int moe_comm_rank(const moe_comm *c) { return c ? c->rank : -1; }
int moe_comm_size(const moe_comm *c) { return c ? c->size : 0; }
const char *moe_comm_name(const moe_comm *c) { return c ? c->name : "(null)"; }
int moe_comm_world_rank(const moe_comm *c, int r) {
  return (c && r >= 0 && r < c->size) ? c->world_ranks[r] : -1;
}

moe_status moe_comm_set_timeout(moe_ctx *ctx, moe_comm *c, double seconds) {
  if (!c) return moe_error(ctx, MOE_ERR_INVALID_ARG, "set_timeout: the communicator is NULL");
  if (!(seconds > 0) || !isfinite(seconds))
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "set_timeout: the timeout must be a positive number of seconds, got %g",
                     seconds);
  c->timeout = seconds;
  return MOE_OK;
}
double moe_comm_timeout(const moe_comm *c) { return c ? c->timeout : 0; }
void moe_comm_set_debug(moe_comm *c, bool on) {
  if (c) c->debug = on;
}

/* ------------------------------------------------------------ the world */

/* MOE_DIST_TIMEOUT (seconds) and MOE_DIST_DEBUG (0 or 1). */
static moe_status read_knobs(moe_ctx *ctx, double *timeout, bool *debug) {
  *timeout = DIST_DEFAULT_TIMEOUT;
  *debug = false;
  const char *v = getenv("MOE_DIST_TIMEOUT");
  if (v && *v) {
    char *end = NULL;
    double s = strtod(v, &end);
    if (*end || !(s > 0) || !isfinite(s))
      return moe_error(ctx, MOE_ERR_INVALID_ARG,
                       "init: MOE_DIST_TIMEOUT must be a positive number of seconds, got '%s'", v);
    *timeout = s;
  }
  v = getenv("MOE_DIST_DEBUG");
  if (v && *v) {
    if (strcmp(v, "1") == 0) *debug = true;
    else if (strcmp(v, "0") != 0)
      return moe_error(ctx, MOE_ERR_INVALID_ARG, "init: MOE_DIST_DEBUG must be 0 or 1, got '%s'", v);
  }
  return MOE_OK;
}

moe_status moe_dist_init(moe_ctx *ctx, moe_comm **world) {
  if (g_dist.world) {
    if (world) *world = g_dist.world;
    return MOE_OK;
  }
  double timeout;
  bool debug;
  moe_dist_env env;
  MOE_CHECK(read_knobs(ctx, &timeout, &debug));
  MOE_CHECK(moe_dist_env_read(ctx, &env));
  if (env.world_size < 1 || env.rank < 0 || env.rank >= env.world_size)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "init: the environment (%s) gives rank %d of %d, which is not a rank", env.launcher,
                     env.rank, env.world_size);
  int inited = 0, fin = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&fin);
  if (fin)
    return moe_error(ctx, MOE_ERR_COMM,
                     "init: MPI was finalized in this process (dist.finalize); it cannot start again");
  bool use_mpi = inited || env.world_size > 1 || strcmp(env.launcher, "none") != 0;
  int size = 1, rank = 0;
  MPI_Comm mpi = MPI_COMM_NULL;
  if (use_mpi) {
    if (!inited) {
      int provided = 0;
      if (MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
        return moe_error(ctx, MOE_ERR_COMM, "init: MPI_Init_thread failed (launcher %s)",
                         env.launcher);
    }
    int rc = MPI_Comm_dup(MPI_COMM_WORLD, &mpi);
    if (rc != MPI_SUCCESS) return moe_error(ctx, MOE_ERR_COMM, "init: MPI_Comm_dup of the world failed");
    MPI_Comm_set_errhandler(mpi, MPI_ERRORS_RETURN);
    MPI_Comm_size(mpi, &size);
    MPI_Comm_rank(mpi, &rank);
    if (strcmp(env.launcher, "none") != 0 && (size != env.world_size || rank != env.rank)) {
      MPI_Comm_free(&mpi);
      return moe_error(ctx, MOE_ERR_COMM,
                       "init: the environment (%s) says rank %d of %d but MPI says rank %d of %d "
                       "(start the ranks with mpirun, srun or moe-lua launch)",
                       env.launcher, env.rank, env.world_size, rank, size);
    }
    moe_status st = types_make(ctx);
    if (st != MOE_OK) {
      MPI_Comm_free(&mpi);
      return st;
    }
  }
  moe_comm *c = comm_alloc(size);
  if (!c) {
    if (mpi != MPI_COMM_NULL) MPI_Comm_free(&mpi);
    return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "init: out of host memory");
  }
  snprintf(c->name, sizeof c->name, "world");
  c->rank = rank;
  c->mpi = mpi;
  c->is_world = true;
  c->timeout = timeout;
  c->debug = debug;
  for (int r = 0; r < size; r++) c->world_ranks[r] = r;
  moe_status st = comm_register(ctx, c);
  if (st != MOE_OK) {
    comm_destroy(c);
    return st;
  }
  if (!use_mpi) env = (moe_dist_env){0, 1, 0, 1, "none"};
  g_dist.env = env;
  g_dist.world = c;
  if (world) *world = c;
  return MOE_OK;
}

bool moe_dist_initialized(void) { return g_dist.world != NULL; }

void moe_dist_finalize(void) {
  /* children first, the world last */
  while (g_dist.ncomms > 0) comm_destroy(g_dist.comms[--g_dist.ncomms]);
  free(g_dist.comms);
  g_dist.comms = NULL;
  g_dist.cap_comms = 0;
  g_dist.world = NULL;
  moe_nccl_finalize();
  moe_comm_timing_set(false);
  int inited = 0, fin = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&fin);
  if (inited && !fin) {
    types_free();
    MPI_Finalize();
  }
  /* The parked works stay: their tensors' storages point at contexts that
   * may be gone by now. They are reachable until the process ends. */
}

void moe_dist_abort(int code) {
  int inited = 0, fin = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&fin);
  if (inited && !fin) MPI_Abort(MPI_COMM_WORLD, code);
}

/* ---------------------------------------------------- collective timing */

static const char *const comm_op_names[] = {"all_reduce", "reduce_scatter", "all_gather",
                                            "broadcast",  "all_to_all",     "send",
                                            "recv"};
_Static_assert(sizeof comm_op_names / sizeof comm_op_names[0] == MOE_COMM_OP_COUNT,
               "comm_op_names must name every moe_comm_op");

/* The totals of moe_comm_timing_read; gen changes each time timing starts,
 * so a CPU work of an earlier period adds nothing. */
static struct {
  bool on;
  unsigned gen;
  moe_comm_time tot[MOE_COMM_OP_COUNT];
} g_timing;

const char *moe_comm_op_name(moe_comm_op op) {
  return (unsigned)op < MOE_COMM_OP_COUNT ? comm_op_names[op] : "?";
}

bool moe_comm_op_parse(const char *name, moe_comm_op *out) {
  for (int i = 0; name && i < MOE_COMM_OP_COUNT; i++)
    if (strcmp(name, comm_op_names[i]) == 0) {
      if (out) *out = (moe_comm_op)i;
      return true;
    }
  return false;
}

void moe_comm_timing_set(bool on) {
  if (on && g_timing.on) return;
  moe_nccl_timing_clear();
  memset(g_timing.tot, 0, sizeof g_timing.tot);
  if (on) g_timing.gen++;
  g_timing.on = on;
}

bool moe_comm_timing_enabled(void) { return g_timing.on; }

moe_status moe_comm_timing_read(moe_ctx *ctx, moe_comm_time *out, bool reset) {
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "comm_timing_read: out is NULL");
  if (!g_timing.on)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "comm_timing_read: collective timing is off (turn it on first)");
  double ms[MOE_COMM_OP_COUNT] = {0};
  moe_status st = moe_nccl_timing_collect(ctx, ms);
  for (int i = 0; i < MOE_COMM_OP_COUNT; i++) g_timing.tot[i].ms += ms[i];
  MOE_CHECK(st);
  memcpy(out, g_timing.tot, sizeof g_timing.tot);
  if (reset) memset(g_timing.tot, 0, sizeof g_timing.tot);
  return MOE_OK;
}

/* Marks w as a timed collective of op moving bytes (timing on), just
 * before it is launched. */
static void timing_begin(moe_work *w, moe_comm_op op, int64_t bytes) {
  if (!g_timing.on) return;
  w->timed = (int)op;
  w->timed_bytes = bytes;
  w->timed_gen = g_timing.gen;
  w->timed_t0 = moe_dist_now();
}

/* A timed collective was launched: one call and its bytes. */
static void timing_count(const moe_work *w) {
  if (w->timed < 0 || !g_timing.on || w->timed_gen != g_timing.gen) return;
  g_timing.tot[w->timed].calls++;
  g_timing.tot[w->timed].bytes += w->timed_bytes;
}

/* A timed CPU collective's wait ended: the host time since the call. */
static void timing_cpu_done(const moe_work *w) {
  if (w->timed < 0 || !g_timing.on || w->timed_gen != g_timing.gen) return;
  g_timing.tot[w->timed].ms += 1e3 * (moe_dist_now() - w->timed_t0);
}

/* --------------------------------------------------------------- works */

static moe_status work_new(moe_ctx *ctx, moe_comm *c, moe_work_kind kind, int nreq,
                           const char *what, moe_work **out) {
  moe_work *w = (moe_work *)calloc(1, sizeof *w);
  if (!w) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: out of host memory", what);
  if (nreq > 0) {
    w->reqs = (MPI_Request *)malloc((size_t)nreq * sizeof *w->reqs);
    if (!w->reqs) {
      free(w);
      return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: out of host memory", what);
    }
    for (int i = 0; i < nreq; i++) w->reqs[i] = MPI_REQUEST_NULL;
  }
  w->comm = c;
  w->kind = kind;
  w->nreq = nreq;
  w->device = -1;
  w->timed = -1;
  w->deadline = moe_dist_now() + c->timeout;
  snprintf(w->what, sizeof w->what, "%s", what);
  *out = w;
  return MOE_OK;
}

static void work_hold(moe_work *w, moe_tensor *t) {
  MOE_ASSERT(w->nhold < MOE_WORK_HOLD);
  moe_tensor_retain(t);
  w->hold[w->nhold++] = t;
}

static void work_unhold(moe_work *w) {
  while (w->nhold > 0) {
    moe_tensor_release(w->hold[--w->nhold]);
    w->hold[w->nhold] = NULL;
  }
}

/* Frees a work whose requests are all complete (or that has none). */
static void work_destroy(moe_work *w) {
  if (w->kind == MOE_WORK_GPU) moe_nccl_work_release(w);
  work_unhold(w);
  if (w->scratch_free) w->scratch_free(w->scratch);
  free(w->reqs);
  free(w);
}

/* A work or buffer of a collective that will never complete: kept to the
 * end of the process. */
static void dist_keep(void *p) {
  if (g_dist.nkept == g_dist.cap_kept) {
    int cap = g_dist.cap_kept ? 2 * g_dist.cap_kept : 8;
    void **k = (void **)realloc(g_dist.kept, (size_t)cap * sizeof *k);
    if (!k) return; /* out of memory: leaked, never freed under MPI's feet */
    g_dist.kept = k;
    g_dist.cap_kept = cap;
  }
  g_dist.kept[g_dist.nkept++] = p;
}

/* Frees a work after a failed wait: keeps it when MPI may still touch its
 * buffers. */
static void work_discard(moe_work *w) {
  bool pending = false;
  for (int i = 0; i < w->nreq; i++) pending |= w->reqs[i] != MPI_REQUEST_NULL;
  if (w->kind == MOE_WORK_CPU && pending) dist_keep(w);
  else work_destroy(w);
}

/* Waits for n requests until c's timeout; statuses may be
 * MPI_STATUSES_IGNORE. On a timeout c fails with a message naming what. */
static moe_status wait_reqs(moe_ctx *ctx, moe_comm *c, int n, MPI_Request *reqs,
                            MPI_Status *statuses, const char *what, int peer) {
  if (n == 0) return MOE_OK;
  if (c->failed)
    return moe_error(ctx, MOE_ERR_COMM, "%s: the group failed earlier: %s", what, c->failure);
  double deadline = moe_dist_now() + c->timeout;
  long ns = DIST_SLEEP_MIN_NS;
  for (int polls = 0;; polls++) {
    int done = 0;
    int rc = MPI_Testall(n, reqs, &done, statuses);
    if (rc == MPI_ERR_IN_STATUS && statuses != MPI_STATUSES_IGNORE) {
      for (int i = 0; i < n; i++)
        if (statuses[i].MPI_ERROR == MPI_ERR_TRUNCATE)
          return moe_error(ctx, MOE_ERR_COMM, "%s: rank %d sent more elements than the tensor holds",
                           what, peer);
    }
    if (rc != MPI_SUCCESS) return mpi_fail(ctx, c, rc, what);
    if (done) return MOE_OK;
    if (moe_dist_now() >= deadline) {
      if (peer >= 0)
        return moe_comm_fail(ctx, c,
                             "%s did not complete within %g s: rank %d did not post the matching "
                             "call (is it stuck, dead, or calling something else?)",
                             what, c->timeout, peer);
      return moe_comm_fail(ctx, c,
                           "%s did not complete within %g s: another rank did not join it (is a "
                           "rank stuck, dead, or calling a different collective?)",
                           what, c->timeout);
    }
    if (polls < DIST_SPIN_POLLS) continue; /* a short collective ends without a sleep */
    dist_sleep(ns);
    ns = ns * 2 > DIST_SLEEP_MAX_NS ? DIST_SLEEP_MAX_NS : ns * 2;
  }
}

/* The scratch of a send or recv: the peer (for messages) and the status
 * of its request. */
typedef struct p2p_scratch {
  MPI_Status status;
  int peer;
} p2p_scratch;

static void p2p_scratch_free(void *p) { free(p); }

static p2p_scratch *p2p_of(const moe_work *w) {
  return w->scratch_free == p2p_scratch_free ? (p2p_scratch *)w->scratch : NULL;
}

static moe_status finish_recv(moe_ctx *ctx, moe_work *w) {
  p2p_scratch *s = p2p_of(w);
  moe_tensor *t = w->hold[0];
  int got = 0;
  MPI_Get_count(&s->status, mpi_type(t->dtype), &got);
  if ((int64_t)got != moe_tensor_numel(t))
    return moe_error(ctx, MOE_ERR_COMM, "%s: rank %d sent %d elements, the tensor %s has %lld",
                     w->what, s->peer, got, MOE_SHAPE(t), (long long)moe_tensor_numel(t));
  return MOE_OK;
}

/* avg: the sum in hold[0] divided by the group's size, in its dtype. */
static moe_status finish_avg(moe_ctx *ctx, moe_work *w) {
  moe_tensor *t = w->hold[0];
  int64_t n = moe_tensor_numel(t);
  void *p = moe_tensor_data(t);
  int size = w->comm->size;
  switch (t->dtype) {
    case MOE_F32: {
      float *x = (float *)p, s = (float)size;
      for (int64_t i = 0; i < n; i++) x[i] /= s;
      break;
    }
    case MOE_F64: {
      double *x = (double *)p, s = (double)size;
      for (int64_t i = 0; i < n; i++) x[i] /= s;
      break;
    }
    case MOE_BF16: {
      moe_bf16 *x = (moe_bf16 *)p;
      for (int64_t i = 0; i < n; i++) x[i] = moe_f32_to_bf16(moe_bf16_to_f32(x[i]) / (float)size);
      break;
    }
    case MOE_F16: {
      moe_f16 *x = (moe_f16 *)p;
      for (int64_t i = 0; i < n; i++) x[i] = moe_f32_to_f16(moe_f16_to_f32(x[i]) / (float)size);
      break;
    }
    default: MOE_ASSERT(0 && "avg of a non-float tensor");
  }
  return MOE_OK;
}

static moe_status cpu_wait(moe_ctx *ctx, moe_work *w) {
  p2p_scratch *s = p2p_of(w);
  MOE_CHECK(wait_reqs(ctx, w->comm, w->nreq, w->reqs, s ? &s->status : MPI_STATUSES_IGNORE, w->what,
                      s ? s->peer : -1));
  timing_cpu_done(w);
  if (w->finish) {
    moe_status st = w->finish(ctx, w);
    w->finish = NULL;
    MOE_CHECK(st);
  }
  return MOE_OK;
}

moe_status moe_work_wait(moe_ctx *ctx, moe_work *w) {
  if (!w) return moe_error(ctx, MOE_ERR_INVALID_ARG, "wait: the work is NULL");
  if (w->waited) return MOE_OK;
  if (w->kind == MOE_WORK_GPU) MOE_CHECK(moe_nccl_work_wait(ctx, w));
  else MOE_CHECK(cpu_wait(ctx, w));
  w->waited = true;
  work_unhold(w);
  return MOE_OK;
}

bool moe_work_done(moe_ctx *ctx, moe_work *w) {
  if (!w) return false;
  /* a GPU wait only orders the compute stream: the collective may still run */
  if (w->kind == MOE_WORK_GPU) return moe_nccl_work_done(w);
  if (w->waited) return true;
  if (w->nreq == 0 || w->comm->failed) return w->nreq == 0;
  p2p_scratch *s = p2p_of(w);
  int done = 0;
  if (MPI_Testall(w->nreq, w->reqs, &done, s ? &s->status : MPI_STATUSES_IGNORE) != MPI_SUCCESS)
    return false;
  return done != 0;
}

void moe_work_free(moe_ctx *ctx, moe_work *w) {
  if (!w) return;
  if (!w->waited && moe_work_wait(ctx, w) != MOE_OK) {
    work_discard(w);
    return;
  }
  work_destroy(w);
}

/* The end of every collective: hands the work out, or waits and frees it. */
static moe_status work_end(moe_ctx *ctx, moe_work *w, moe_work **work) {
  timing_count(w);
  if (work) {
    *work = w;
    return MOE_OK;
  }
  moe_status st = moe_work_wait(ctx, w);
  if (st != MOE_OK) {
    work_discard(w);
    return st;
  }
  work_destroy(w);
  return MOE_OK;
}

/* ------------------------------------------------- debug descriptors */

typedef enum dist_kind {
  DIST_BARRIER = 0,
  DIST_ALL_REDUCE,
  DIST_REDUCE_SCATTER,
  DIST_ALL_GATHER,
  DIST_BROADCAST,
  DIST_ALL_TO_ALL,
  DIST_SEND,
  DIST_RECV,
  DIST_KIND_COUNT
} dist_kind;

static const char *const kind_names[] = {"barrier",   "all_reduce", "reduce_scatter",
                                         "all_gather", "broadcast", "all_to_all",
                                         "send",       "recv"};
_Static_assert(sizeof kind_names / sizeof kind_names[0] == DIST_KIND_COUNT,
               "kind_names must name every dist_kind");

/* What a rank calls, as all-gathered in debug mode. */
typedef struct dist_desc {
  int32_t kind;   /* dist_kind */
  int32_t dtype;
  int32_t op;     /* moe_reduce_op, -1 when none */
  int32_t root;   /* broadcast's root, the peer of send / recv, else -1 */
  int32_t device; /* moe_device_type */
  int32_t pad;
  int64_t count;  /* elements (per rank; all_to_all: per row) */
  uint64_t seq;   /* collectives issued on the group before this one */
} dist_desc;

static const char *desc_str(const dist_desc *d, bool seq, char *buf, size_t len) {
  const char *dt = moe_dtype_name((moe_dtype)d->dtype);
  const char *k = (unsigned)d->kind < DIST_KIND_COUNT ? kind_names[d->kind] : "?";
  int n = 0;
  switch (d->kind) {
    case DIST_BARRIER: n = snprintf(buf, len, "barrier"); break;
    case DIST_ALL_REDUCE:
    case DIST_REDUCE_SCATTER:
      n = snprintf(buf, len, "%s(%s) of %lld %s", k, moe_reduce_op_name((moe_reduce_op)d->op),
                   (long long)d->count, dt);
      break;
    case DIST_BROADCAST:
      n = snprintf(buf, len, "broadcast of %lld %s from rank %d", (long long)d->count, dt, d->root);
      break;
    case DIST_ALL_TO_ALL:
      n = snprintf(buf, len, "all_to_all of rows of %lld %s", (long long)d->count, dt);
      break;
    case DIST_SEND:
      n = snprintf(buf, len, "send of %lld %s to rank %d", (long long)d->count, dt, d->root);
      break;
    case DIST_RECV:
      n = snprintf(buf, len, "recv of %lld %s from rank %d", (long long)d->count, dt, d->root);
      break;
    default: n = snprintf(buf, len, "%s of %lld %s", k, (long long)d->count, dt);
  }
  if (n < 0 || (size_t)n >= len) return buf;
  if (d->kind != DIST_BARRIER && d->device == MOE_DEVICE_CUDA)
    n += snprintf(buf + n, len - (size_t)n, " on a GPU");
  if (seq && (size_t)n < len)
    snprintf(buf + n, len - (size_t)n, " as collective #%llu", (unsigned long long)d->seq);
  return buf;
}

static bool desc_equal(const dist_desc *a, const dist_desc *b) {
  return a->kind == b->kind && a->dtype == b->dtype && a->op == b->op && a->root == b->root &&
         a->device == b->device && a->count == b->count && a->seq == b->seq;
}

/* One all-gather of what every rank calls; a difference fails every rank
 * with the same message. */
static moe_status debug_collective(moe_ctx *ctx, moe_comm *c, const char *fn, const dist_desc *d) {
  if (!c->debug || c->size == 1) return MOE_OK;
  dist_desc *all = (dist_desc *)calloc((size_t)c->size, sizeof *all);
  if (!all) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
  char what[160];
  snprintf(what, sizeof what, "the MOE_DIST_DEBUG check before %s on group '%s' (rank %d of %d)",
           fn, c->name, c->rank, c->size);
  MPI_Request req = MPI_REQUEST_NULL;
  int rc = MPI_Iallgather(d, (int)sizeof *d, MPI_BYTE, all, (int)sizeof *d, MPI_BYTE, c->mpi, &req);
  moe_status st = rc == MPI_SUCCESS ? wait_reqs(ctx, c, 1, &req, MPI_STATUSES_IGNORE, what, -1)
                                    : mpi_fail(ctx, c, rc, what);
  if (st != MOE_OK) {
    dist_keep(all); /* MPI may still write it */
    return st;
  }
  bool seq_differs = false, differs = false;
  for (int r = 1; r < c->size; r++) {
    differs |= !desc_equal(&all[r], &all[0]);
    seq_differs |= all[r].seq != all[0].seq;
  }
  if (!differs) {
    free(all);
    return MOE_OK;
  }
  char msg[900], one[200];
  int n = snprintf(msg, sizeof msg, "rank 0 calls %s", desc_str(&all[0], seq_differs, one, sizeof one));
  int listed = 0;
  for (int r = 1; r < c->size && n > 0 && (size_t)n < sizeof msg; r++) {
    if (desc_equal(&all[r], &all[0])) continue;
    if (listed == 6) {
      n += snprintf(msg + n, sizeof msg - (size_t)n, ", ...");
      break;
    }
    n += snprintf(msg + n, sizeof msg - (size_t)n, ", rank %d calls %s", r,
                  desc_str(&all[r], seq_differs, one, sizeof one));
    listed++;
  }
  free(all);
  return moe_error(ctx, MOE_ERR_COMM, "%s on group '%s': the ranks disagree (MOE_DIST_DEBUG): %s",
                   fn, c->name, msg);
}

/* all_to_all in debug mode: every rank sends what its peer expects. */
static moe_status debug_splits(moe_ctx *ctx, moe_comm *c, const int64_t *send, const int64_t *recv) {
  if (!c->debug || c->size == 1) return MOE_OK;
  int p = c->size;
  int64_t *mine = (int64_t *)malloc((size_t)2 * (size_t)p * sizeof *mine);
  int64_t *all = (int64_t *)malloc((size_t)2 * (size_t)p * (size_t)p * sizeof *all);
  if (!mine || !all) {
    free(mine);
    free(all);
    return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "all_to_all: out of host memory");
  }
  memcpy(mine, send, (size_t)p * sizeof *mine);
  memcpy(mine + p, recv, (size_t)p * sizeof *mine);
  char what[160];
  snprintf(what, sizeof what, "the MOE_DIST_DEBUG check of all_to_all's splits on group '%s' "
           "(rank %d of %d)", c->name, c->rank, c->size);
  MPI_Request req = MPI_REQUEST_NULL;
  int rc = MPI_Iallgather(mine, 2 * p, MPI_INT64_T, all, 2 * p, MPI_INT64_T, c->mpi, &req);
  moe_status st = rc == MPI_SUCCESS ? wait_reqs(ctx, c, 1, &req, MPI_STATUSES_IGNORE, what, -1)
                                    : mpi_fail(ctx, c, rc, what);
  if (st != MOE_OK) {
    dist_keep(mine); /* MPI may still use them */
    dist_keep(all);
    return st;
  }
  free(mine);
  for (int i = 0; i < p; i++)
    for (int j = 0; j < p; j++) {
      int64_t sent = all[(size_t)i * 2 * p + j];          /* rank i's send[j] */
      int64_t expected = all[(size_t)j * 2 * p + p + i];  /* rank j's recv[i] */
      if (sent != expected) {
        free(all);
        return moe_error(ctx, MOE_ERR_COMM,
                         "all_to_all on group '%s': the splits disagree (MOE_DIST_DEBUG): rank %d "
                         "sends %lld rows to rank %d, but rank %d expects %lld rows from rank %d",
                         c->name, i, (long long)sent, j, j, (long long)expected, i);
      }
    }
  free(all);
  return MOE_OK;
}

/* send / recv in debug mode: the two ends exchange their descriptors. */
static moe_status debug_p2p(moe_ctx *ctx, moe_comm *c, const char *fn, const dist_desc *d, int peer) {
  if (!c->debug) return MOE_OK;
  dist_desc *theirs = (dist_desc *)calloc(2, sizeof *theirs);
  if (!theirs) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
  theirs[1] = *d;
  char what[160];
  snprintf(what, sizeof what, "the MOE_DIST_DEBUG check before %s on group '%s' (rank %d of %d)",
           fn, c->name, c->rank, c->size);
  MPI_Request reqs[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  int rc = MPI_Irecv(&theirs[0], (int)sizeof *d, MPI_BYTE, peer, DIST_TAG_DESC, c->mpi, &reqs[0]);
  if (rc == MPI_SUCCESS)
    rc = MPI_Isend(&theirs[1], (int)sizeof *d, MPI_BYTE, peer, DIST_TAG_DESC, c->mpi, &reqs[1]);
  moe_status st = rc == MPI_SUCCESS ? wait_reqs(ctx, c, 2, reqs, MPI_STATUSES_IGNORE, what, peer)
                                    : mpi_fail(ctx, c, rc, what);
  if (st != MOE_OK) {
    dist_keep(theirs); /* MPI may still use it */
    return st;
  }
  dist_desc t = theirs[0];
  free(theirs);
  bool ok = t.kind == (d->kind == DIST_SEND ? DIST_RECV : DIST_SEND) && t.dtype == d->dtype &&
            t.count == d->count && t.device == d->device && t.root == c->rank;
  if (ok) return MOE_OK;
  char a[200], b[200];
  return moe_error(ctx, MOE_ERR_COMM,
                   "%s on group '%s': the two ends disagree (MOE_DIST_DEBUG): rank %d calls %s, "
                   "rank %d calls %s",
                   fn, c->name, c->rank, desc_str(d, false, a, sizeof a), peer,
                   desc_str(&t, false, b, sizeof b));
}

/* ------------------------------------------------------- local copies */

/* n elements from src (from element s0) to dst (from element d0), on the
 * host or a GPU (the context's stream). */
static moe_status local_copy(moe_ctx *ctx, moe_tensor *dst, int64_t d0, const moe_tensor *src,
                             int64_t s0, int64_t n) {
  size_t es = moe_dtype_size(src->dtype), bytes = (size_t)n * es;
  if (bytes == 0) return MOE_OK;
  char *d = (char *)moe_tensor_data(dst) + (size_t)d0 * es;
  const char *s = (const char *)moe_tensor_data(src) + (size_t)s0 * es;
  if (d == s) return MOE_OK;
  if (!on_gpu(dst) && !on_gpu(src)) {
    memmove(d, s, bytes);
    return MOE_OK;
  }
  return moe_cuda_memcpy(ctx, d, moe_tensor_device(dst), s, moe_tensor_device(src), bytes);
}

/* A group of one rank: the copy is done; a work that is already done. */
static moe_status local_done(moe_ctx *ctx, moe_comm *c, const char *what, moe_work **work) {
  if (!work) return MOE_OK;
  return work_new(ctx, c, MOE_WORK_CPU, 0, what, work);
}

/* --------------------------------------------------------- collectives */

static void describe(char *buf, size_t len, moe_comm *c, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;
static void describe(char *buf, size_t len, moe_comm *c, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(buf, len, fmt, ap);
  va_end(ap);
  if (n >= 0 && (size_t)n < len)
    snprintf(buf + n, len - (size_t)n, " on group '%s' (rank %d of %d)", c->name, c->rank, c->size);
}

/* A GPU collective: a work holding the tensors, filled by dist_nccl.c. */
static moe_status gpu_work(moe_ctx *ctx, moe_comm *c, const char *what, moe_tensor *a,
                           moe_tensor *b, moe_work **out) {
  MOE_CHECK(work_new(ctx, c, MOE_WORK_GPU, 0, what, out));
  (*out)->device = moe_tensor_device(a).index;
  work_hold(*out, a);
  if (b) work_hold(*out, b);
  return MOE_OK;
}

/* After moe_nccl_<collective>: on failure the work goes, else as work_end. */
static moe_status gpu_end(moe_ctx *ctx, moe_status st, moe_work *w, moe_work **work) {
  if (st != MOE_OK) {
    work_destroy(w);
    return st;
  }
  return work_end(ctx, w, work);
}

moe_status moe_comm_barrier(moe_ctx *ctx, moe_comm *c) {
  MOE_CHECK(comm_usable(ctx, "barrier", c));
  dist_desc d = {DIST_BARRIER, 0, -1, -1, 0, 0, 0, c->seq++};
  if (c->size == 1) return MOE_OK;
  MOE_CHECK(debug_collective(ctx, c, "barrier", &d));
  char what[256];
  describe(what, sizeof what, c, "barrier");
  moe_work *w = NULL;
  MOE_CHECK(work_new(ctx, c, MOE_WORK_CPU, 1, what, &w));
  int rc = MPI_Ibarrier(c->mpi, &w->reqs[0]);
  if (rc != MPI_SUCCESS) {
    work_destroy(w);
    return mpi_fail(ctx, c, rc, what);
  }
  return work_end(ctx, w, NULL);
}

moe_status moe_all_reduce(moe_ctx *ctx, moe_comm *c, moe_tensor *t, moe_reduce_op op,
                          moe_work **work) {
  const char *fn = "all_reduce";
  if (work) *work = NULL;
  MOE_CHECK(comm_usable(ctx, fn, c));
  MOE_CHECK(check_tensor(ctx, fn, "tensor", t));
  MOE_CHECK(check_reduce(ctx, fn, op, t->dtype));
  int64_t n = moe_tensor_numel(t);
  char what[256];
  describe(what, sizeof what, c, "all_reduce(%s) of %lld %s", moe_reduce_op_name(op), (long long)n,
           moe_dtype_name(t->dtype));
  dist_desc d = {DIST_ALL_REDUCE, t->dtype, op, -1, moe_tensor_device(t).type, 0, n, c->seq++};
  if (c->size == 1) return local_done(ctx, c, what, work);
  MOE_CHECK(debug_collective(ctx, c, fn, &d));
  moe_work *w = NULL;
  if (on_gpu(t)) {
    MOE_CHECK(gpu_work(ctx, c, what, t, NULL, &w));
    timing_begin(w, MOE_COMM_ALL_REDUCE, n * (int64_t)moe_dtype_size(t->dtype));
    return gpu_end(ctx, moe_nccl_all_reduce(ctx, c, t, op, w), w, work);
  }
  MOE_CHECK(check_count(ctx, what, n));
  MOE_CHECK(work_new(ctx, c, MOE_WORK_CPU, 1, what, &w));
  work_hold(w, t);
  timing_begin(w, MOE_COMM_ALL_REDUCE, n * (int64_t)moe_dtype_size(t->dtype));
  int rc = MPI_Iallreduce(MPI_IN_PLACE, moe_tensor_data(t), (int)n, mpi_type(t->dtype),
                          mpi_op(t->dtype, op), c->mpi, &w->reqs[0]);
  if (rc != MPI_SUCCESS) {
    work_destroy(w);
    return mpi_fail(ctx, c, rc, what);
  }
  if (op == MOE_REDUCE_AVG) w->finish = finish_avg;
  return work_end(ctx, w, work);
}

moe_status moe_reduce_scatter(moe_ctx *ctx, moe_comm *c, moe_tensor *out, moe_tensor *in,
                              moe_reduce_op op, moe_work **work) {
  const char *fn = "reduce_scatter";
  if (work) *work = NULL;
  MOE_CHECK(comm_usable(ctx, fn, c));
  MOE_CHECK(check_pair(ctx, fn, out, in));
  MOE_CHECK(check_reduce(ctx, fn, op, in->dtype));
  bool fits = in->ndim >= 1 && out->ndim == in->ndim && in->shape[0] == (int64_t)c->size * out->shape[0];
  for (int dd = 1; fits && dd < in->ndim; dd++) fits = in->shape[dd] == out->shape[dd];
  if (!fits)
    return moe_error(ctx, MOE_ERR_SHAPE,
                     "%s: input %s must be (size * n, ...) for output %s (n, ...): group '%s' has "
                     "%d ranks, so input dim 0 must be %d x %lld with the same sizes beyond",
                     fn, MOE_SHAPE(in), MOE_SHAPE(out), c->name, c->size, c->size,
                     out->ndim >= 1 ? (long long)out->shape[0] : 0LL);
  int64_t n = moe_tensor_numel(out);
  char what[256];
  describe(what, sizeof what, c, "reduce_scatter(%s) of %lld %s per rank", moe_reduce_op_name(op),
           (long long)n, moe_dtype_name(in->dtype));
  dist_desc d = {DIST_REDUCE_SCATTER, in->dtype, op, -1, moe_tensor_device(in).type, 0, n, c->seq++};
  if (c->size == 1) {
    MOE_CHECK(local_copy(ctx, out, 0, in, 0, n));
    return local_done(ctx, c, what, work);
  }
  MOE_CHECK(debug_collective(ctx, c, fn, &d));
  moe_work *w = NULL;
  if (on_gpu(in)) {
    MOE_CHECK(gpu_work(ctx, c, what, out, in, &w));
    timing_begin(w, MOE_COMM_REDUCE_SCATTER, moe_tensor_numel(in) * (int64_t)moe_dtype_size(in->dtype));
    return gpu_end(ctx, moe_nccl_reduce_scatter(ctx, c, out, in, op, w), w, work);
  }
  MOE_CHECK(check_count(ctx, what, n));
  MOE_CHECK(work_new(ctx, c, MOE_WORK_CPU, 1, what, &w));
  work_hold(w, out);
  work_hold(w, in);
  timing_begin(w, MOE_COMM_REDUCE_SCATTER, moe_tensor_numel(in) * (int64_t)moe_dtype_size(in->dtype));
  int rc = MPI_Ireduce_scatter_block(moe_tensor_data(in), moe_tensor_data(out), (int)n,
                                     mpi_type(in->dtype), mpi_op(in->dtype, op), c->mpi,
                                     &w->reqs[0]);
  if (rc != MPI_SUCCESS) {
    work_destroy(w);
    return mpi_fail(ctx, c, rc, what);
  }
  if (op == MOE_REDUCE_AVG) w->finish = finish_avg;
  return work_end(ctx, w, work);
}

moe_status moe_all_gather(moe_ctx *ctx, moe_comm *c, moe_tensor *out, moe_tensor *in,
                          moe_work **work) {
  const char *fn = "all_gather";
  if (work) *work = NULL;
  MOE_CHECK(comm_usable(ctx, fn, c));
  MOE_CHECK(check_pair(ctx, fn, out, in));
  int64_t n = moe_tensor_numel(in);
  if (moe_tensor_numel(out) != (int64_t)c->size * n)
    return moe_error(ctx, MOE_ERR_SHAPE,
                     "%s: output %s has %lld elements but group '%s' of %d ranks gathers %d x %lld "
                     "= %lld (input %s)",
                     fn, MOE_SHAPE(out), (long long)moe_tensor_numel(out), c->name, c->size,
                     c->size, (long long)n, (long long)(c->size * n), MOE_SHAPE(in));
  char what[256];
  describe(what, sizeof what, c, "all_gather of %lld %s per rank", (long long)n,
           moe_dtype_name(in->dtype));
  dist_desc d = {DIST_ALL_GATHER, in->dtype, -1, -1, moe_tensor_device(in).type, 0, n, c->seq++};
  if (c->size == 1) {
    MOE_CHECK(local_copy(ctx, out, 0, in, 0, n));
    return local_done(ctx, c, what, work);
  }
  MOE_CHECK(debug_collective(ctx, c, fn, &d));
  moe_work *w = NULL;
  if (on_gpu(in)) {
    MOE_CHECK(gpu_work(ctx, c, what, out, in, &w));
    timing_begin(w, MOE_COMM_ALL_GATHER, moe_tensor_numel(out) * (int64_t)moe_dtype_size(in->dtype));
    return gpu_end(ctx, moe_nccl_all_gather(ctx, c, out, in, w), w, work);
  }
  MOE_CHECK(check_count(ctx, what, n));
  MOE_CHECK(work_new(ctx, c, MOE_WORK_CPU, 1, what, &w));
  work_hold(w, out);
  work_hold(w, in);
  MPI_Datatype ty = mpi_type(in->dtype);
  timing_begin(w, MOE_COMM_ALL_GATHER, moe_tensor_numel(out) * (int64_t)moe_dtype_size(in->dtype));
  int rc = MPI_Iallgather(moe_tensor_data(in), (int)n, ty, moe_tensor_data(out), (int)n, ty, c->mpi,
                          &w->reqs[0]);
  if (rc != MPI_SUCCESS) {
    work_destroy(w);
    return mpi_fail(ctx, c, rc, what);
  }
  return work_end(ctx, w, work);
}

moe_status moe_broadcast(moe_ctx *ctx, moe_comm *c, moe_tensor *t, int root, moe_work **work) {
  const char *fn = "broadcast";
  if (work) *work = NULL;
  MOE_CHECK(comm_usable(ctx, fn, c));
  MOE_CHECK(check_tensor(ctx, fn, "tensor", t));
  if (root < 0 || root >= c->size)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: root %d is not a rank of group '%s' (0..%d)", fn,
                     root, c->name, c->size - 1);
  int64_t n = moe_tensor_numel(t);
  char what[256];
  describe(what, sizeof what, c, "broadcast of %lld %s from rank %d", (long long)n,
           moe_dtype_name(t->dtype), root);
  dist_desc d = {DIST_BROADCAST, t->dtype, -1, root, moe_tensor_device(t).type, 0, n, c->seq++};
  if (c->size == 1) return local_done(ctx, c, what, work);
  MOE_CHECK(debug_collective(ctx, c, fn, &d));
  moe_work *w = NULL;
  if (on_gpu(t)) {
    MOE_CHECK(gpu_work(ctx, c, what, t, NULL, &w));
    timing_begin(w, MOE_COMM_BROADCAST, n * (int64_t)moe_dtype_size(t->dtype));
    return gpu_end(ctx, moe_nccl_broadcast(ctx, c, t, root, w), w, work);
  }
  MOE_CHECK(check_count(ctx, what, n));
  MOE_CHECK(work_new(ctx, c, MOE_WORK_CPU, 1, what, &w));
  work_hold(w, t);
  timing_begin(w, MOE_COMM_BROADCAST, n * (int64_t)moe_dtype_size(t->dtype));
  int rc = MPI_Ibcast(moe_tensor_data(t), (int)n, mpi_type(t->dtype), root, c->mpi, &w->reqs[0]);
  if (rc != MPI_SUCCESS) {
    work_destroy(w);
    return mpi_fail(ctx, c, rc, what);
  }
  return work_end(ctx, w, work);
}

static moe_status check_splits(moe_ctx *ctx, moe_comm *c, const char *name, const int64_t *s,
                               const moe_tensor *t, const char *tname, int64_t *total) {
  if (!s) return moe_error(ctx, MOE_ERR_INVALID_ARG, "all_to_all: %s splits are NULL", name);
  int64_t sum = 0;
  for (int j = 0; j < c->size; j++) {
    if (s[j] < 0)
      return moe_error(ctx, MOE_ERR_INVALID_ARG,
                       "all_to_all: %s splits must be non-negative, got %lld rows for rank %d", name,
                       (long long)s[j], j);
    sum += s[j];
  }
  if (sum > t->shape[0])
    return moe_error(ctx, MOE_ERR_SHAPE,
                     "all_to_all: the %s splits add up to %lld rows but %s %s has %lld", name,
                     (long long)sum, tname, MOE_SHAPE(t), (long long)t->shape[0]);
  *total = sum;
  return MOE_OK;
}

moe_status moe_all_to_all(moe_ctx *ctx, moe_comm *c, moe_tensor *out, moe_tensor *in,
                          const int64_t *send, const int64_t *recv, moe_work **work) {
  const char *fn = "all_to_all";
  if (work) *work = NULL;
  MOE_CHECK(comm_usable(ctx, fn, c));
  MOE_CHECK(check_pair(ctx, fn, out, in));
  bool rows = in->ndim >= 1 && out->ndim == in->ndim;
  for (int dd = 1; rows && dd < in->ndim; dd++) rows = in->shape[dd] == out->shape[dd];
  if (!rows)
    return moe_error(ctx, MOE_ERR_SHAPE,
                     "%s: output %s and input %s must have rows of one shape (the same sizes "
                     "beyond dim 0, at least one dim)",
                     fn, MOE_SHAPE(out), MOE_SHAPE(in));
  int64_t nsend = 0, nrecv = 0, re = row_elems(in);
  MOE_CHECK(check_splits(ctx, c, "send", send, in, "input", &nsend));
  MOE_CHECK(check_splits(ctx, c, "recv", recv, out, "output", &nrecv));
  char what[256];
  describe(what, sizeof what, c, "all_to_all of %lld rows of %lld %s (receiving %lld)",
           (long long)nsend, (long long)re, moe_dtype_name(in->dtype), (long long)nrecv);
  dist_desc d = {DIST_ALL_TO_ALL, in->dtype, -1, -1, moe_tensor_device(in).type, 0, re, c->seq++};
  if (c->size == 1) {
    if (send[0] != recv[0])
      return moe_error(ctx, MOE_ERR_SHAPE,
                       "%s: group '%s' has one rank, so it receives what it sends: send[0] = %lld "
                       "but recv[0] = %lld",
                       fn, c->name, (long long)send[0], (long long)recv[0]);
    MOE_CHECK(local_copy(ctx, out, 0, in, 0, send[0] * re));
    return local_done(ctx, c, what, work);
  }
  MOE_CHECK(debug_collective(ctx, c, fn, &d));
  MOE_CHECK(debug_splits(ctx, c, send, recv));
  moe_work *w = NULL;
  if (on_gpu(in)) {
    MOE_CHECK(gpu_work(ctx, c, what, out, in, &w));
    timing_begin(w, MOE_COMM_ALL_TO_ALL, nsend * re * (int64_t)moe_dtype_size(in->dtype));
    return gpu_end(ctx, moe_nccl_all_to_all(ctx, c, out, in, send, recv, w), w, work);
  }
  MOE_CHECK(check_count(ctx, what, nsend * re));
  MOE_CHECK(check_count(ctx, what, nrecv * re));
  int p = c->size;
  int *counts = (int *)malloc((size_t)4 * (size_t)p * sizeof *counts);
  if (!counts) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
  int *sc = counts, *sd = counts + p, *rcn = counts + 2 * p, *rd = counts + 3 * p;
  int64_t so = 0, ro = 0;
  for (int j = 0; j < p; j++) {
    sc[j] = (int)(send[j] * re);
    sd[j] = (int)so;
    rcn[j] = (int)(recv[j] * re);
    rd[j] = (int)ro;
    so += send[j] * re;
    ro += recv[j] * re;
  }
  moe_status st = work_new(ctx, c, MOE_WORK_CPU, 1, what, &w);
  if (st != MOE_OK) {
    free(counts);
    return st;
  }
  w->scratch = counts; /* MPI reads the counts until the collective ends */
  w->scratch_free = free;
  work_hold(w, out);
  work_hold(w, in);
  MPI_Datatype ty = mpi_type(in->dtype);
  timing_begin(w, MOE_COMM_ALL_TO_ALL, nsend * re * (int64_t)moe_dtype_size(in->dtype));
  int rc = MPI_Ialltoallv(moe_tensor_data(in), sc, sd, ty, moe_tensor_data(out), rcn, rd, ty, c->mpi,
                          &w->reqs[0]);
  if (rc != MPI_SUCCESS) {
    work_destroy(w);
    return mpi_fail(ctx, c, rc, what);
  }
  return work_end(ctx, w, work);
}

static moe_status p2p(moe_ctx *ctx, moe_comm *c, moe_tensor *t, int peer, bool is_send,
                      moe_work **work) {
  const char *fn = is_send ? "send" : "recv";
  if (work) *work = NULL;
  MOE_CHECK(comm_usable(ctx, fn, c));
  MOE_CHECK(check_tensor(ctx, fn, "tensor", t));
  if (peer < 0 || peer >= c->size)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: peer %d is not a rank of group '%s' (0..%d)", fn,
                     peer, c->name, c->size - 1);
  if (peer == c->rank)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "%s: peer %d is this rank of group '%s': a rank cannot %s itself", fn, peer,
                     c->name, is_send ? "send to" : "receive from");
  int64_t n = moe_tensor_numel(t);
  char what[256];
  describe(what, sizeof what, c, "%s of %lld %s %s rank %d", fn, (long long)n,
           moe_dtype_name(t->dtype), is_send ? "to" : "from", peer);
  dist_desc d = {is_send ? DIST_SEND : DIST_RECV, t->dtype, -1, peer, moe_tensor_device(t).type, 0,
                 n, 0};
  MOE_CHECK(debug_p2p(ctx, c, fn, &d, peer));
  moe_work *w = NULL;
  if (on_gpu(t)) {
    MOE_CHECK(gpu_work(ctx, c, what, t, NULL, &w));
    timing_begin(w, is_send ? MOE_COMM_SEND : MOE_COMM_RECV, n * (int64_t)moe_dtype_size(t->dtype));
    moe_status st = is_send ? moe_nccl_send(ctx, c, t, peer, w) : moe_nccl_recv(ctx, c, t, peer, w);
    return gpu_end(ctx, st, w, work);
  }
  MOE_CHECK(check_count(ctx, what, n));
  MOE_CHECK(work_new(ctx, c, MOE_WORK_CPU, 1, what, &w));
  work_hold(w, t);
  p2p_scratch *s = (p2p_scratch *)calloc(1, sizeof *s);
  if (!s) {
    work_destroy(w);
    return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
  }
  s->peer = peer;
  w->scratch = s;
  w->scratch_free = p2p_scratch_free;
  int rc;
  timing_begin(w, is_send ? MOE_COMM_SEND : MOE_COMM_RECV, n * (int64_t)moe_dtype_size(t->dtype));
  if (is_send) {
    rc = MPI_Isend(moe_tensor_data(t), (int)n, mpi_type(t->dtype), peer, DIST_TAG_DATA, c->mpi,
                   &w->reqs[0]);
  } else {
    w->finish = finish_recv;
    rc = MPI_Irecv(moe_tensor_data(t), (int)n, mpi_type(t->dtype), peer, DIST_TAG_DATA, c->mpi,
                   &w->reqs[0]);
  }
  if (rc != MPI_SUCCESS) {
    work_destroy(w);
    return mpi_fail(ctx, c, rc, what);
  }
  return work_end(ctx, w, work);
}

moe_status moe_send(moe_ctx *ctx, moe_comm *c, moe_tensor *t, int peer, moe_work **work) {
  return p2p(ctx, c, t, peer, true, work);
}

moe_status moe_recv(moe_ctx *ctx, moe_comm *c, moe_tensor *t, int peer, moe_work **work) {
  return p2p(ctx, c, t, peer, false, work);
}

/* ---------------------------------------------------------------- split */

moe_status moe_comm_split(moe_ctx *ctx, moe_comm *parent, int color, int key, const char *name,
                          moe_comm **out) {
  const char *fn = "split";
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: out is NULL", fn);
  *out = NULL;
  MOE_CHECK(comm_usable(ctx, fn, parent));
  if (!name || !*name || strlen(name) >= MOE_COMM_NAME)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: the name must have 1 to %d characters", fn,
                     MOE_COMM_NAME - 1);
  if (color < 0)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: color must be >= 0, got %d", fn, color);
  int p = parent->size;
  int size = 1, rank = 0;
  int *members = NULL; /* parent ranks of the new group, in its order */
  int *ck = NULL;
  if (p > 1) {
    /* Every rank's (color, key), gathered under the timeout, gives the
     * groups; MPI_Comm_split then only confirms them. */
    ck = (int *)malloc((size_t)2 * (size_t)p * sizeof *ck);
    members = (int *)malloc((size_t)p * sizeof *members);
    if (!ck || !members) {
      free(ck);
      free(members);
      return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
    }
    int mine[2] = {color, key};
    char what[256];
    describe(what, sizeof what, parent, "split into '%s'", name);
    MPI_Request req = MPI_REQUEST_NULL;
    int rc = MPI_Iallgather(mine, 2, MPI_INT, ck, 2, MPI_INT, parent->mpi, &req);
    moe_status st = rc == MPI_SUCCESS ? wait_reqs(ctx, parent, 1, &req, MPI_STATUSES_IGNORE, what, -1)
                                      : mpi_fail(ctx, parent, rc, what);
    if (st != MOE_OK) {
      free(members);
      dist_keep(ck); /* MPI may still write it */
      return st;
    }
    size = 0;
    for (int r = 0; r < p; r++)
      if (ck[2 * r] == color) {
        /* insertion by (key, parent rank) */
        int i = size++;
        while (i > 0 && ck[2 * members[i - 1] + 1] > ck[2 * r + 1]) {
          members[i] = members[i - 1];
          i--;
        }
        members[i] = r;
      }
    for (int i = 0; i < size; i++)
      if (members[i] == parent->rank) rank = i;
  }
  moe_comm *c = comm_alloc(size);
  if (!c) {
    free(ck);
    free(members);
    return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
  }
  snprintf(c->name, sizeof c->name, "%s", name);
  c->rank = rank;
  c->timeout = parent->timeout;
  c->debug = parent->debug;
  if (p > 1) {
    for (int i = 0; i < size; i++) c->world_ranks[i] = parent->world_ranks[members[i]];
  } else {
    c->world_ranks[0] = parent->world_ranks[0];
  }
  free(ck);
  free(members);
  moe_status st = MOE_OK;
  if (parent->mpi != MPI_COMM_NULL) {
    int rc = MPI_Comm_split(parent->mpi, color, key, &c->mpi);
    if (rc != MPI_SUCCESS) {
      c->mpi = MPI_COMM_NULL;
      comm_destroy(c);
      return mpi_fail(ctx, parent, rc, "split");
    }
    MPI_Comm_set_errhandler(c->mpi, MPI_ERRORS_RETURN);
    int mr = -1, ms = -1;
    MPI_Comm_rank(c->mpi, &mr);
    MPI_Comm_size(c->mpi, &ms);
    MOE_ASSERT(mr == c->rank && ms == c->size);
  }
  MOE_CHECK_GOTO(moe_nccl_comm_split(ctx, parent, c, color, key), st, fail);
  MOE_CHECK_GOTO(comm_register(ctx, c), st, fail);
  *out = c;
  return MOE_OK;
fail:
  comm_destroy(c);
  return st;
}

void moe_comm_free(moe_comm *c) {
  if (!c || c->is_world) return;
  /* after moe_dist_finalize the communicator is already gone */
  if (comm_unregister(c)) comm_destroy(c);
}
