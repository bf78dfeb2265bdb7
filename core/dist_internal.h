/*
 * dist_internal.h - what core/dist.c (MPI, the world, argument checks),
 * core/dist_nccl.c (NCCL, CUDA builds) and core/dist_reducer.c share.
 * core/nocuda.c stubs the moe_nccl_* entry points in CPU-only builds.
 */
#ifndef MOE_DIST_INTERNAL_H
#define MOE_DIST_INTERNAL_H

#include <mpi.h>

#include "internal.h"
#include "moe_dist.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MOE_COMM_NAME 64
#define MOE_WORK_HOLD 4

struct moe_comm {
  char name[MOE_COMM_NAME];
  int rank, size;
  int *world_ranks;   /* (size) world rank of each member */
  MPI_Comm mpi;       /* MPI_COMM_NULL when the world has one rank */
  bool is_world;
  double timeout;     /* seconds */
  bool debug;         /* cross-rank agreement checks */
  bool failed;        /* after a timeout or an engine error: every call fails */
  char failure[512];  /* the first failure's message */
  uint64_t seq;       /* collectives issued on this communicator (not send/recv) */
  void *nccl;         /* dist_nccl.c's state, NULL until a GPU tensor uses it */
};

typedef enum moe_work_kind { MOE_WORK_CPU = 0, MOE_WORK_GPU = 1 } moe_work_kind;

struct moe_work {
  moe_comm *comm;
  moe_work_kind kind;
  char what[256];      /* "all_reduce(sum) of 1048576 bf16 on group 'dp' (rank 1 of 2)" */
  double deadline;     /* monotonic seconds when the wait fails */
  bool waited;
  /* CPU: MPI requests, then finish() (a scale for avg, a copy back, ...) */
  MPI_Request *reqs;
  int nreq;
  moe_status (*finish)(moe_ctx *ctx, moe_work *w);
  void *scratch;       /* freed with the work (host staging, datatypes...) */
  void (*scratch_free)(void *scratch);
  /* GPU: the event recorded on the communication stream after the
   * collective, and its device */
  void *done;          /* cudaEvent_t */
  int device;
  /* tensors the collective reads or writes, held until waited for */
  moe_tensor *hold[MOE_WORK_HOLD];
  int nhold;
  /* collective timing (moe_comm_timing_set): the op when timed, else -1;
   * its bytes, the timing generation it belongs to, the host clock at the
   * call (CPU) */
  int timed;
  int64_t timed_bytes;
  unsigned timed_gen;
  double timed_t0;
};

/* Monotonic clock in seconds. */
double moe_dist_now(void);
/* Marks c failed with the message (the first one is kept) and writes it to
 * ctx; returns MOE_ERR_COMM. */
moe_status moe_comm_fail(moe_ctx *ctx, moe_comm *c, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* --------------------------------------------------------- NCCL (GPU) */
/* Each enqueues the collective on c's communication stream for the device
 * of its tensors (creating the NCCL communicator on first use: rank 0's id
 * broadcast over c->mpi), after an event wait on the compute stream, and
 * records w->done. Arguments are already checked by dist.c.
 *
 * What dist.c does around them: it calls them only for groups of more than
 * one rank (a group of one copies on the compute stream itself), after the
 * debug-mode check; it fills w->comm, kind (MOE_WORK_GPU), what, deadline
 * (now + the group's timeout), device (the tensors' CUDA ordinal) and hold
 * (the tensors, retained) before the call. After a failed call it calls
 * moe_nccl_work_release(w) (so that must accept a work whose done is still
 * NULL) and frees the work. A synchronous collective is the same call
 * followed by moe_nccl_work_wait. dist.c releases the held tensors itself,
 * after a successful moe_nccl_work_wait and after moe_nccl_work_release. */
moe_status moe_nccl_all_reduce(moe_ctx *ctx, moe_comm *c, moe_tensor *t, moe_reduce_op op,
                               moe_work *w);
moe_status moe_nccl_reduce_scatter(moe_ctx *ctx, moe_comm *c, moe_tensor *out, moe_tensor *in,
                                   moe_reduce_op op, moe_work *w);
moe_status moe_nccl_all_gather(moe_ctx *ctx, moe_comm *c, moe_tensor *out, moe_tensor *in,
                               moe_work *w);
moe_status moe_nccl_broadcast(moe_ctx *ctx, moe_comm *c, moe_tensor *t, int root, moe_work *w);
moe_status moe_nccl_all_to_all(moe_ctx *ctx, moe_comm *c, moe_tensor *out, moe_tensor *in,
                               const int64_t *send, const int64_t *recv, moe_work *w);
moe_status moe_nccl_send(moe_ctx *ctx, moe_comm *c, moe_tensor *t, int peer, moe_work *w);
moe_status moe_nccl_recv(moe_ctx *ctx, moe_comm *c, moe_tensor *t, int peer, moe_work *w);
/* Orders the compute stream after w->done (no host wait); fails if the
 * communicator failed. */
moe_status moe_nccl_work_wait(moe_ctx *ctx, moe_work *w);
bool moe_nccl_work_done(moe_work *w);
void moe_nccl_work_release(moe_work *w);
/* ncclCommSplit of parent's NCCL communicator into child's when parent has
 * one (collective over parent); a no-op otherwise. dist.c calls it on every
 * rank of parent, for every split, after child's MPI communicator, rank,
 * size and world_ranks are set; on failure child is freed (with
 * moe_nccl_comm_free). */
moe_status moe_nccl_comm_split(moe_ctx *ctx, moe_comm *parent, moe_comm *child, int color,
                               int key);
void moe_nccl_comm_free(moe_comm *c);
/* Collective timing on GPUs. A collective whose w->timed >= 0 records a
 * pair of timing events on the communication stream around its NCCL calls
 * (a pair that cannot be made leaves the call untimed). collect waits for
 * every pair pending, adds its span to ms[w->timed] (ms has
 * MOE_COMM_OP_COUNT entries) and keeps the events for reuse; clear
 * destroys every event, pending or kept (timing turned off, finalize). */
moe_status moe_nccl_timing_collect(moe_ctx *ctx, double *ms);
void moe_nccl_timing_clear(void);
/* Stops the watchdog and destroys what is left (moe_dist_finalize, after
 * moe_nccl_comm_free of every communicator and before MPI_Finalize). */
void moe_nccl_finalize(void);

#ifdef __cplusplus
}
#endif
#endif /* MOE_DIST_INTERNAL_H */
