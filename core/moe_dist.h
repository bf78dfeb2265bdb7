/*
 * moe_dist.h - communicators and collectives (core/dist.c; NCCL in
 * core/dist_nccl.c when built with CUDA). Included by moe.h.
 *
 * Engines, not algorithms of our own: tensors on the CPU go through MPI
 * (Open MPI), tensors on a GPU through NCCL. MPI also starts the job and
 * bootstraps NCCL: the NCCL id of a communicator is made by its rank 0 and
 * broadcast over the communicator's MPI twin.
 *
 * The world. moe_dist_init reads the environment: under mpirun (Open MPI's
 * OMPI_COMM_WORLD_* variables), srun (SLURM_PROCID / SLURM_NTASKS) or
 * `moe-lua launch`, it initialises MPI and the world has every rank. Started
 * alone, it does not touch MPI: the world has one rank and every collective
 * is a local copy (so scripts run unchanged on one process).
 *
 * Communicators. A moe_comm is a group of ranks with an MPI communicator
 * and, once a GPU tensor goes through it, an NCCL communicator on that GPU.
 * Sub-groups come from moe_comm_split (MPI_Comm_split, and ncclCommSplit
 * when the parent has an NCCL communicator). Every member must make the same
 * calls on a communicator in the same order, as MPI and NCCL require.
 *
 * Streams. GPU collectives run on the communicator's communication stream.
 * Before one starts, that stream waits (an event, not the host) for the work
 * queued so far on the context's compute stream; a synchronous call then
 * makes the compute stream wait for the collective. An asynchronous call
 * returns a moe_work; moe_work_wait makes the compute stream wait for it
 * (the host does not block on a GPU collective). The work holds references
 * to its tensors until it is waited for or freed, so their device memory
 * cannot go back to the caching allocator while the collective uses it.
 * On the CPU the host waits: moe_work_wait returns when the data are there.
 *
 * Failure. Every wait has a deadline (moe_comm_set_timeout; default
 * 600 s; MOE_DIST_TIMEOUT, in seconds, overrides; on the CPU it counts
 * from the start of the wait, and a split inherits its parent's). A collective that misses
 * it fails with MOE_ERR_COMM and a message naming the collective, the
 * communicator, this rank and the sizes; its NCCL communicator is aborted
 * (never left to hang) and the communicator is unusable after that (every
 * later call on it fails at once with the first message). NCCL's
 * asynchronous errors are polled while waiting and end the same way. MPI
 * and NCCL failures are MOE_ERR_COMM too. A rank that dies makes mpirun end
 * the job (the launcher reports which rank went first). The tensors of a
 * CPU collective that failed stay allocated until the process ends: MPI
 * can neither cancel nor free its request and may still write them.
 *
 * Checks. Arguments are checked on each rank (shapes that fit, dtypes, one
 * device). Agreement between ranks (the same collective, dtype and sizes on
 * every member) is checked when MOE_DIST_DEBUG=1 (or moe_comm_set_debug):
 * each collective first all-gathers a small descriptor over MPI and fails
 * on every rank with a message naming what differs (ranks, collective,
 * dtype, sizes, root; all_to_all also gathers the splits and checks that
 * every rank sends what its peer expects; send and recv exchange their
 * descriptors between the two ends). The group stays usable after such a
 * failure. By default it is not
 * checked: a disagreement ends in the timeout above, or garbage for
 * all_to_all splits that disagree (each rank checks that the sum of its
 * splits fits its tensors).
 *
 * Tensors. Every float dtype (f32, f64, bf16, f16) and the integer dtypes
 * (max/min/sum only on integers; bool: max and min only). bf16 and f16
 * reduce over MPI through ops that add (or compare) in float and round
 * each partial result. Collectives take contiguous tensors; the in-place
 * ones (all_reduce, broadcast, recv) write their tensor; an output may not
 * overlap its input. Over MPI one call moves at most 2^31 - 1 elements per
 * rank (MPI's int counts): more is MOE_ERR_NOT_SUPPORTED.
 */
#ifndef MOE_DIST_H
#define MOE_DIST_H

#include "moe.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct moe_comm moe_comm;
typedef struct moe_work moe_work;

typedef enum moe_reduce_op {
  MOE_REDUCE_SUM = 0,
  MOE_REDUCE_AVG, /* sum / size: NCCL's ncclAvg; on MPI a sum then a scale */
  MOE_REDUCE_MAX,
  MOE_REDUCE_MIN,
  MOE_REDUCE_COUNT
} moe_reduce_op;

const char *moe_reduce_op_name(moe_reduce_op op);       /* "sum", "avg", ... */
bool moe_reduce_op_parse(const char *name, moe_reduce_op *out);

/* ------------------------------------------------------------- the world */

/* Where the process sits in the job, read from the environment without
 * initialising anything (Open MPI, Slurm, then torchrun's names; one rank
 * when none is set). */
typedef struct moe_dist_env {
  int rank, world_size;
  int local_rank, local_world_size;
  const char *launcher; /* "mpirun", "srun", "torchrun" or "none" */
} moe_dist_env;

moe_status moe_dist_env_read(moe_ctx *ctx, moe_dist_env *out);

/* Initialises the world once per process (later calls return the same
 * communicator, borrowed: the process owns it until moe_dist_finalize). */
moe_status moe_dist_init(moe_ctx *ctx, moe_comm **world);
bool moe_dist_initialized(void);
/* Frees every communicator and finalises MPI (at process exit; the host
 * calls it). Safe when never initialised, and twice. A world without MPI
 * can be initialised again afterwards; after MPI_Finalize moe_dist_init
 * fails (MPI starts once per process). */
void moe_dist_finalize(void);
/* Ends the whole job at once (MPI_Abort): for a rank that cannot go on and
 * must not leave the others waiting. Does not return under MPI; returns
 * when the world has one rank. */
void moe_dist_abort(int code);

/* --------------------------------------------------------- communicators */

int moe_comm_rank(const moe_comm *c);
int moe_comm_size(const moe_comm *c);
/* The communicator's name for messages ("world", "ep", "dp_shard", ...). */
const char *moe_comm_name(const moe_comm *c);
/* The world rank of this communicator's rank r. */
int moe_comm_world_rank(const moe_comm *c, int r);

/* Collective over parent: ranks with the same color (>= 0) form one new
 * communicator, ordered by key (then by parent rank). name (1 to
 * MOE_COMM_NAME - 1 characters) is copied. The new communicator inherits
 * parent's timeout and debug setting. The caller owns *out (moe_comm_free). */
moe_status moe_comm_split(moe_ctx *ctx, moe_comm *parent, int color, int key, const char *name,
                          moe_comm **out);
/* Frees a communicator made by split (the world is freed by finalize; a
 * communicator that finalize already freed is ignored). */
void moe_comm_free(moe_comm *c);

/* Seconds a wait may take before it fails (> 0). */
moe_status moe_comm_set_timeout(moe_ctx *ctx, moe_comm *c, double seconds);
double moe_comm_timeout(const moe_comm *c);
/* Cross-rank agreement checks before each collective (see above). */
void moe_comm_set_debug(moe_comm *c, bool on);

moe_status moe_comm_barrier(moe_ctx *ctx, moe_comm *c);

/* ----------------------------------------------------------- collectives */
/*
 * work: NULL for a synchronous call; otherwise *work receives a handle that
 * the caller waits for (moe_work_wait) and frees (moe_work_free). Outputs
 * are valid after the wait (on a GPU: for work queued on the compute stream
 * after the wait).
 */

/* t <- op over ranks of t, in place. */
moe_status moe_all_reduce(moe_ctx *ctx, moe_comm *c, moe_tensor *t, moe_reduce_op op,
                          moe_work **work);
/* out (n, ...) <- rank r's share of op over ranks of in (size * n, ...):
 * rows [r * n, (r + 1) * n) of the reduction. */
moe_status moe_reduce_scatter(moe_ctx *ctx, moe_comm *c, moe_tensor *out, moe_tensor *in,
                              moe_reduce_op op, moe_work **work);
/* out (size * n, ...) <- every rank's in (n, ...), in rank order. out may
 * be any contiguous tensor of size * numel(in) elements (one flat buffer). */
moe_status moe_all_gather(moe_ctx *ctx, moe_comm *c, moe_tensor *out, moe_tensor *in,
                          moe_work **work);
/* t <- root's t, in place. */
moe_status moe_broadcast(moe_ctx *ctx, moe_comm *c, moe_tensor *t, int root, moe_work **work);
/* All-to-all with variable splits along dim 0: rows
 * [sum(send[0..j)), + send[j]) of in go to rank j; rows from rank j land at
 * [sum(recv[0..j)), + recv[j]) of out. send and recv have size entries
 * (host arrays, rows); the sums must not exceed the tensors' dim 0. On a GPU
 * this is one NCCL group of ncclSend/ncclRecv. */
moe_status moe_all_to_all(moe_ctx *ctx, moe_comm *c, moe_tensor *out, moe_tensor *in,
                          const int64_t *send, const int64_t *recv, moe_work **work);
/* Point to point: t to rank peer of c / t <- from rank peer. */
moe_status moe_send(moe_ctx *ctx, moe_comm *c, moe_tensor *t, int peer, moe_work **work);
moe_status moe_recv(moe_ctx *ctx, moe_comm *c, moe_tensor *t, int peer, moe_work **work);

/* Waits as the header says (the compute stream on a GPU, the host on the
 * CPU), within the communicator's timeout. Waiting twice is allowed. */
moe_status moe_work_wait(moe_ctx *ctx, moe_work *w);
/* True when the collective has finished (never blocks; on the CPU it also
 * moves MPI along). A CPU avg's scale is applied by the wait. */
bool moe_work_done(moe_ctx *ctx, moe_work *w);
/* Frees the handle; an unwaited GPU work is waited for first (ordering the
 * compute stream after it), so its tensors stay safe. free(NULL) is a no-op. */
void moe_work_free(moe_ctx *ctx, moe_work *w);

/* ------------------------------------------------ collective timing */
/*
 * Opt-in, per kind of collective and for the whole process: how many calls
 * of more than one rank were issued since timing was turned on (or last
 * reset), the bytes they moved (nccl-tests' "size": all_reduce, broadcast,
 * send, recv the tensor; all_gather its output; reduce_scatter its input;
 * all_to_all the rows this rank sends, its own included) and the time they
 * took. A group of one rank (a local copy) is not counted; neither is a
 * barrier.
 *
 * The time. On a GPU each collective records a pair of CUDA events on the
 * communication stream it runs on: the first after the stream's wait for
 * the compute stream, the second after the NCCL kernels. Nothing waits for
 * them while collectives run (pairs that have completed are folded in now
 * and then without blocking); moe_comm_timing_read waits for the pairs
 * still pending and adds up their spans. So a GPU figure is the time of the
 * collective on its stream, waiting for the slowest peer included: where a
 * layout overlaps a collective with compute, that time is hidden in part,
 * and the figure is an upper bound on the time the step lost to it. On the
 * CPU (MPI) it is the host clock from the call to the end of its wait (a
 * synchronous call: the call; an asynchronous one: until moe_work_wait
 * returns, which includes what the host did in between).
 *
 * Off (the default) it costs one test of a flag per collective. Turning it
 * off drops the totals and destroys the events; turning it on starts from
 * zero. Calls from one thread, like the collectives.
 */
typedef enum moe_comm_op {
  MOE_COMM_ALL_REDUCE = 0,
  MOE_COMM_REDUCE_SCATTER,
  MOE_COMM_ALL_GATHER,
  MOE_COMM_BROADCAST,
  MOE_COMM_ALL_TO_ALL,
  MOE_COMM_SEND,
  MOE_COMM_RECV,
  MOE_COMM_OP_COUNT
} moe_comm_op;

const char *moe_comm_op_name(moe_comm_op op); /* "all_reduce", ..., "recv" */
bool moe_comm_op_parse(const char *name, moe_comm_op *out);

typedef struct moe_comm_time {
  double ms;     /* milliseconds, summed over the calls (see above) */
  int64_t calls; /* collectives issued */
  int64_t bytes; /* their sizes, summed */
} moe_comm_time;

/* Turns timing on (from zero when it was off) or off (dropping everything). */
void moe_comm_timing_set(bool on);
bool moe_comm_timing_enabled(void);
/* The totals per op (out[MOE_COMM_OP_COUNT], indexed by moe_comm_op), after
 * waiting for the GPU event pairs still pending; reset: zero them after.
 * MOE_ERR_INVALID_ARG when timing is off. */
moe_status moe_comm_timing_read(moe_ctx *ctx, moe_comm_time *out, bool reset);

/* ------------------------------------------------- gradient bucketing */
/*
 * Data parallelism's gradient all-reduce while backward runs (PyTorch DDP's
 * Reducer). The reducer holds the parameters (leaves that require grad) in
 * buckets of about bucket_bytes, filled in reverse order of the list (the
 * order backward tends to finish them). While armed, autograd tells it when
 * a parameter's gradient of this backward is complete (moe_autograd leaf
 * hook); when every parameter of a bucket is ready, and every earlier bucket
 * was launched, the bucket's gradients are copied into one flat buffer and
 * an asynchronous collective starts. moe_reducer_finish launches what is
 * left (a parameter that got no gradient contributes zeros, on every rank,
 * so buckets always match) and waits. The order of the sums is the
 * collective's: deterministic for a given world size.
 *
 * Two modes:
 *
 * MOE_REDUCER_ALL_REDUCE (DDP): each bucket is all_reduce'd (avg) and
 * finish leaves the averaged gradients in each parameter's .grad.
 *
 * MOE_REDUCER_REDUCE_SCATTER (ZeRO-2, the gradient half of FSDP): a bucket's
 * flat buffer is padded with zeros to padded = P * shard_numel elements (P
 * the communicator's size) and reduce_scatter'ed (avg): rank r keeps
 * elements [r * shard_numel, (r + 1) * shard_numel) of the average, its
 * shard. Each .grad is released as soon as its bucket is launched (the full
 * gradients live only until their bucket's collective has read them), so
 * after finish every parameter's .grad is NULL and the gradient is the
 * shards (moe_reducer_shard), valid until the next arm or
 * moe_reducer_clear. With a replicate communicator (HSDP: shard within a
 * group, replicate across groups), each shard is then all_reduce'd (avg)
 * over it, launched in bucket order as soon as the bucket's reduce_scatter
 * is done (polled while backward runs, waited for by finish): the shard is
 * then the average over shard x replicate ranks. moe_reducer_segments maps
 * a shard to the parameters' elements it covers, for an optimiser that
 * updates only those.
 */
typedef struct moe_reducer moe_reducer;

typedef enum moe_reducer_mode {
  MOE_REDUCER_ALL_REDUCE = 0,
  MOE_REDUCER_REDUCE_SCATTER,
  MOE_REDUCER_MODE_COUNT
} moe_reducer_mode;

typedef struct moe_reducer_opts {
  size_t bucket_bytes;     /* about this many bytes per bucket; 0: one parameter each */
  moe_reducer_mode mode;
  moe_comm *replicate;     /* REDUCE_SCATTER only: all_reduce(avg) of the shards over
                            * it (HSDP); NULL: none */
  /* Explicit buckets instead of bucket_bytes: group[i] >= 0 names parameter
   * i's group; the parameters of one group form one bucket (one dtype and
   * device), numbered by the order the reverse walk of the list meets the
   * groups, their parameters in reverse list order as usual. NULL: sizes. */
  const int *group;
  /* Called once a bucket's collective has been launched (its gradients
   * read into the collective's buffer, their .grad released): bucket k of
   * this round. Parameter sharding frees the bucket's gathered parameters
   * there. NULL: none. */
  moe_status (*launched)(moe_ctx *ctx, int k, void *ud);
  void *launched_ud;
} moe_reducer_opts;

/* The DDP reducer: mode ALL_REDUCE, no replicate communicator. */
moe_status moe_reducer_new(moe_ctx *ctx, moe_comm *c, int n, moe_tensor *const *params,
                           size_t bucket_bytes, moe_reducer **out);
moe_status moe_reducer_new_opts(moe_ctx *ctx, moe_comm *c, int n, moe_tensor *const *params,
                                const moe_reducer_opts *o, moe_reducer **out);
/* The next backward reports ready gradients to this reducer (one at a
 * time per context). Drops the previous round's shards. */
moe_status moe_reducer_arm(moe_ctx *ctx, moe_reducer *r);
/* Launches the remaining buckets, waits; ALL_REDUCE writes .grad, REDUCE_SCATTER
 * leaves the shards; disarms. */
moe_status moe_reducer_finish(moe_ctx *ctx, moe_reducer *r);
int moe_reducer_buckets(const moe_reducer *r);
moe_reducer_mode moe_reducer_get_mode(const moe_reducer *r);

/* Bucket k (0-based) as laid out at creation. For ALL_REDUCE, padded =
 * shard_numel = numel and shard_offset = 0. */
typedef struct moe_reducer_bucket {
  moe_dtype dtype;
  moe_device device;
  int nparams;          /* parameters in the bucket */
  int64_t numel;        /* elements of its parameters */
  int64_t padded;       /* numel rounded up to a multiple of the group size */
  int64_t shard_numel;  /* padded / group size */
  int64_t shard_offset; /* this rank's first element: rank * shard_numel */
} moe_reducer_bucket;

moe_status moe_reducer_bucket_info(moe_ctx *ctx, const moe_reducer *r, int k,
                                   moe_reducer_bucket *out);

/* Elements [param_offset, + numel) of parameter param (its index in the
 * list given to new, flattened row-major) are elements [shard_offset,
 * + numel) of this rank's shard of the bucket. */
typedef struct moe_reducer_segment {
  int param;
  int64_t param_offset, shard_offset, numel;
} moe_reducer_segment;

/* The segments of this rank's shard of bucket k, in shard order (the
 * padding at the end of the last rank's shard belongs to none). Writes up to
 * cap of them into out (out may be NULL when cap is 0) and returns how many
 * there are; -1 when k is out of range. */
int moe_reducer_segments(const moe_reducer *r, int k, moe_reducer_segment *out, int cap);
/* Where parameter i sits: its bucket and its first element in the bucket's
 * flat (padded) buffer; false when i is out of range. */
bool moe_reducer_param_offset(const moe_reducer *r, int i, int *bucket, int64_t *offset);
/* REDUCE_SCATTER: this round's averaged gradient shard of bucket k,
 * (shard_numel) of the bucket's dtype, borrowed; NULL before finish, after
 * clear, in ALL_REDUCE mode, or when k is out of range. */
moe_tensor *moe_reducer_shard(const moe_reducer *r, int k);
/* Whether parameter i had a gradient on some rank in the last finished round
 * (of the shard and the replicate communicators). */
bool moe_reducer_had_grad(const moe_reducer *r, int i);
/* Drops the shards (the optimiser's zero_grad). */
void moe_reducer_clear(moe_reducer *r);
void moe_reducer_free(moe_ctx *ctx, moe_reducer *r);

/* ------------------------------------------------ parameter sharding */
/*
 * The parameter half of FSDP (ZeRO-3): a unit's parameters live in one flat
 * buffer (flat: contiguous, 1-D, padded to a multiple of the group size P,
 * the whole of its storage) of which each rank keeps only its shard (shard:
 * elements [r S, (r + 1) S), S = padded / P, a tensor of its own). Between
 * uses flat's data are freed (moe_storage_free_data): every parameter view
 * of it has no data. gather allocates them again and all-gathers the
 * shards into them (asynchronously: a prefetch; wait, or the next gather,
 * completes it); release frees them. The unit is flat's storage's
 * materialize callback, so backward gathers a released unit by itself when
 * it first reads a parameter saved by the unit's forward; it then starts
 * the gather of the unit set by set_prefetch (the one backward reaches
 * next) asynchronously. The units' order of gathers must be the same on
 * every rank (each is a collective of the group).
 */
typedef struct moe_fsdp_unit moe_fsdp_unit;

moe_status moe_fsdp_unit_new(moe_ctx *ctx, moe_comm *c, moe_tensor *flat, moe_tensor *shard,
                             moe_fsdp_unit **out);
/* Starts the all_gather of the shards into flat (allocating its data when
 * freed); async false: waits too. A no-op when the data are ready or a
 * gather is in flight (then async false waits for it). */
moe_status moe_fsdp_unit_gather(moe_ctx *ctx, moe_fsdp_unit *u, bool async);
/* Waits for a gather in flight (none: a no-op). */
moe_status moe_fsdp_unit_wait(moe_ctx *ctx, moe_fsdp_unit *u);
/* Frees flat's data (waiting for a gather in flight first). */
moe_status moe_fsdp_unit_release(moe_ctx *ctx, moe_fsdp_unit *u);
/* The unit whose gather starts when backward gathers u (NULL: none). */
void moe_fsdp_unit_set_prefetch(moe_fsdp_unit *u, moe_fsdp_unit *next);
/* Whether flat's data are there and complete; gathers started so far. */
bool moe_fsdp_unit_ready(const moe_fsdp_unit *u);
int64_t moe_fsdp_unit_gathers(const moe_fsdp_unit *u);
/* Frees the unit (waiting for a gather in flight; flat's storage forgets
 * it and keeps whatever data it has). free(NULL) is a no-op. */
void moe_fsdp_unit_free(moe_ctx *ctx, moe_fsdp_unit *u);

#ifdef __cplusplus
}
#endif
#endif /* MOE_DIST_H */
