/*
 * internal.h - what core/ and kernels/ share and users of moe.h do not see:
 * the context struct, status-checking macros, the strided view handed to
 * kernels, and the CUDA entry points (implemented in core/cuda_*.c and
 * kernels/ (.cu files) when built with CUDA, by core/nocuda.c otherwise).
 */
#ifndef MOE_INTERNAL_H
#define MOE_INTERNAL_H

#include "moe.h"
#include "half.h"
#include "knobs.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MOE_MAX_CUDA_DEVICES 16

/* Per-device CUDA state, owned by core/cuda_runtime.c (opaque here). */
typedef struct moe_cuda_state moe_cuda_state;

struct moe_ctx {
  moe_status status;          /* of the last failed call, MOE_OK after clear */
  char err[1024];             /* its message */
  uint64_t rng_seed;
  uint64_t rng_call;          /* advanced by one per random fill */
  moe_memory_stats cpu_stats; /* host storages */
  moe_cuda_state *cuda;       /* NULL until CUDA is first used */
  int cuda_count;             /* visible GPUs; -1 until asked */
  struct moe_event *events;   /* live events, a list owned by the context */
  /* autograd (core/autograd.c) */
  bool grad_enabled;          /* true unless inside no_grad */
  int n_hooks;                /* saved-tensor hooks stack depth */
  struct moe_saved_hooks *hooks[16]; /* (n_hooks) each holds one reference */
  moe_grad_ready_fn grad_ready; /* leaf hook of moe_backward, or NULL */
  void *grad_ready_ud;          /* its argument */
  bool backward_frees;          /* inside moe_backward without retain_graph: each node's
                                 * saved tensors are freed once it ran (moe_node_saved_owned) */
  bool backward_owned;          /* the running node was told it owns a saved slot */
  moe_knobs knobs;            /* kernel tuning knobs, read at creation (knobs.h) */
  int64_t host_copies;        /* reads of tensor values by the host (moe_host_reads) */
  int64_t host_syncs;         /* host waits for a device (moe_host_reads) */
};

/* One read of device values by the host (moe_host_reads): a copy and the
 * wait it costs; a CPU read that a GPU tensor would make a copy counts too. */
static inline void moe_host_read_note(moe_ctx *ctx) {
  ctx->host_copies++;
  ctx->host_syncs++;
}
/* moe_tensor_to_f64 / _i64 for a CPU reference reading its own operands:
 * not counted as a host read on the CPU (a GPU tensor's copy still is). */
moe_status moe_tensor_values_f64(moe_ctx *ctx, const moe_tensor *t, double *values);
moe_status moe_tensor_values_i64(moe_ctx *ctx, const moe_tensor *t, int64_t *values);

/* Propagate a failure: the callee already wrote the message. */
#define MOE_CHECK(call)                 \
  do {                                  \
    moe_status moe_s_ = (call);         \
    if (moe_s_ != MOE_OK) return moe_s_; \
  } while (0)

/* Propagate to a cleanup label; `st` must be a moe_status variable. */
#define MOE_CHECK_GOTO(call, st, label) \
  do {                                  \
    (st) = (call);                      \
    if ((st) != MOE_OK) goto label;     \
  } while (0)

/* Broken internal invariant: not a user's mistake. Aborts with file:line. */
#define MOE_ASSERT(cond)                                                      \
  do {                                                                        \
    if (!(cond)) moe_internal_abort(__FILE__, __LINE__, #cond);               \
  } while (0)
void moe_internal_abort(const char *file, int line, const char *what);

/*
 * A strided view as kernels see it: a typed pointer to element 0 plus shape
 * and element strides. Kernels of elementwise ops take views of identical
 * shape; broadcasting is done before (stride 0 dims).
 */
typedef struct moe_kview {
  void *data;
  moe_dtype dtype;
  int ndim;
  int64_t shape[MOE_MAX_DIMS];
  int64_t stride[MOE_MAX_DIMS];
} moe_kview;

moe_kview moe_kview_of(const moe_tensor *t);

/* Host-side element access for the CPU reference (any dtype). */
double moe_load_f64(const void *p, moe_dtype dt);
int64_t moe_load_i64(const void *p, moe_dtype dt);
void moe_store_f64(void *p, moe_dtype dt, double v);
void moe_store_i64(void *p, moe_dtype dt, int64_t v);
/* moe_dim_normalize with the op's name leading the message ("gather: dim 2
 * is out of range ..."); core/tensor.c. */
moe_status moe_dim_normalize_fn(moe_ctx *ctx, const char *fn, int64_t dim, int ndim,
                                bool for_insert, int *out);

/* ------------------------------------------------------- the op kit */
/*
 * What every op family uses to validate, name and record (with the
 * shape-string size and macros of moe.h, MOE_SHAPE_STR): one wording of the device and dtype mismatch errors, one record
 * function with one failure contract and one zero-gradient helper
 * (core/autograd.c and core/tensor.c).
 */

/* MOE_ERR_DEVICE unless ad == bd: "fn: a is on cuda:0 but b is on cpu".
 * an and bn name the operands as the user knows them ("weight", "the plan"). */
moe_status moe_check_same_device(moe_ctx *ctx, const char *fn, const char *an, moe_device ad,
                                 const char *bn, moe_device bd);
/* MOE_ERR_DTYPE unless adt == bdt: "fn: a is bf16 but b is f32". */
moe_status moe_check_same_dtype(moe_ctx *ctx, const char *fn, const char *an, moe_dtype adt,
                                const char *bn, moe_dtype bdt);

/*
 * Recording an op's node (core/autograd.c). Fill a spec with designated
 * initializers and call moe_record after computing the outputs:
 *
 *   MOE_CHECK(moe_record(ctx, &(moe_record_spec){
 *       .op = MOE_OP_MUL, .backward = mul_backward,
 *       .n_in = 2, .in = {a, b}, .n_save = 2, .save = {a, b},
 *       .iargs = {dim}, .dargs = {scale}}, 1, &out));
 *
 * When grad mode is off or no input requires grad it does nothing. Otherwise
 * it makes the node over in[0, n_in) (NULL entries: absent optional inputs),
 * saves save[0, n_save) in that order (a NULL entry saves an empty slot, read
 * back as NULL), copies iargs and dargs, hands user to the node and makes
 * outs[k] its k-th output.
 *
 * The one failure contract: on failure every outs[k] is released and set to
 * NULL, and user is freed with user_free; the status is returned. On success
 * the node owns user. Either way the caller no longer owns user: a payload
 * the caller keeps using is retained before the call.
 */
typedef struct moe_record_spec {
  moe_op op;
  moe_backward_fn backward;
  int n_in;
  moe_tensor *in[MOE_NODE_MAX_INPUTS];   /* (n_in) */
  int n_save;
  moe_tensor *save[MOE_NODE_MAX_SAVED];  /* (n_save) */
  int64_t iargs[MOE_NODE_MAX_ARGS];
  double dargs[MOE_NODE_MAX_ARGS];
  void *user;                            /* payload for backward, or NULL */
  void (*user_free)(void *user);
  const char *name;                      /* overrides moe_op_name(op) when set */
} moe_record_spec;

moe_status moe_record(moe_ctx *ctx, const moe_record_spec *spec, int n_out, moe_tensor **outs);

/* Zeros of input i's shape, dtype and device (the gradient of an input when
 * nothing flowed into the node's outputs). */
moe_status moe_node_zeros_input(moe_ctx *ctx, const moe_node *n, int i, moe_tensor **out);
/* moe_node_zeros_input for every input that needs grad; on failure the
 * entries already set are released and NULL again. */
moe_status moe_node_zero_grads(moe_ctx *ctx, const moe_node *n, moe_tensor **gin);

/* ----------------------------------------------------- CUDA runtime glue */
/* In core/cuda_runtime.c (built with CUDA) or core/nocuda.c (without). */

/* Allocates from the caching allocator of `device`; *block gets the size of
 * the block actually reserved. */
moe_status moe_cuda_alloc(moe_ctx *ctx, int device, size_t nbytes, void **ptr, size_t *block);
void moe_cuda_release(moe_ctx *ctx, int device, void *ptr, size_t block);
moe_status moe_cuda_stats(moe_ctx *ctx, int device, moe_memory_stats *out);
moe_status moe_cuda_reset_peak(moe_ctx *ctx, int device);
moe_status moe_cuda_empty_cache(moe_ctx *ctx, int device);
/* The context's stream for `device` (a cudaStream_t), created on first use;
 * also makes `device` current. */
moe_status moe_cuda_stream(moe_ctx *ctx, int device, void **stream);
/* The context's cuBLAS handle for `device` (a cublasHandle_t), created on
 * first use and bound to the context's stream. */
moe_status moe_cuda_cublas(moe_ctx *ctx, int device, void **handle);
/* Copies nbytes between host and device or device and device, ordered on
 * the context's stream; returns after the copy has finished when the
 * destination is the host. */
moe_status moe_cuda_memcpy(moe_ctx *ctx, void *dst, moe_device dd, const void *src,
                           moe_device sd, size_t nbytes);
void moe_cuda_state_free(moe_ctx *ctx);
/* The device address of `device`'s error word (a moe_kerr, kerr.h) for a
 * kernel of op `fn` (a string with static storage) to report bad input in,
 * and the tag naming fn; NULL (report nothing) where there is none. The
 * report comes back as MOE_ERR_INVALID_ARG naming fn, the value and the
 * range from the next moe_cuda_synchronize or copy to the host. */
void *moe_cuda_kerr(moe_ctx *ctx, int device, const char *fn, int *tag);
/* CUDA events (cudaEvent_t behind void *), for core/event.c. */
moe_status moe_cuda_event_create(moe_ctx *ctx, int device, void **ev);
moe_status moe_cuda_event_record(moe_ctx *ctx, int device, void *ev);
moe_status moe_cuda_event_synchronize(moe_ctx *ctx, void *ev);
moe_status moe_cuda_event_elapsed(moe_ctx *ctx, void *start, void *end, float *ms);
void moe_cuda_event_destroy(void *ev);

/* ------------------------------------------------------- CUDA kernels */
/* In kernels/ (.cu files). All views live on `device`; launches go on the context's
 * stream; errors are reported through moe_error. */

/* dst = src, converting dtype; same shape (src may have stride-0 dims). */
moe_status moe_cuda_copy(moe_ctx *ctx, int device, const moe_kview *dst, const moe_kview *src);
moe_status moe_cuda_fill(moe_ctx *ctx, int device, const moe_kview *dst, double value);
/* element i (row-major) = start + i * step, computed in double */
moe_status moe_cuda_arange(moe_ctx *ctx, int device, const moe_kview *dst, double start,
                           double step);
typedef enum moe_random_kind {
  MOE_RANDOM_UNIFORM = 0, /* a = low, b = high */
  MOE_RANDOM_NORMAL,      /* a = mean, b = std */
  MOE_RANDOM_INT          /* a = low, b = high, integers in [a, b) */
} moe_random_kind;
moe_status moe_cuda_random(moe_ctx *ctx, int device, const moe_kview *dst, moe_random_kind kind,
                           uint64_t seed, uint64_t call, double a, double b);
/* out = a op b; a, b already broadcast to out's shape. */
moe_status moe_cuda_binary(moe_ctx *ctx, int device, moe_op op, const moe_kview *out,
                           const moe_kview *a, const moe_kview *b);
moe_status moe_cuda_binary_scalar(moe_ctx *ctx, int device, moe_op op, const moe_kview *out,
                                  const moe_kview *a, double s, bool reverse);
moe_status moe_cuda_unary(moe_ctx *ctx, int device, moe_op op, const moe_kview *out,
                          const moe_kview *a);

#ifdef __cplusplus
}
#endif
#endif /* MOE_INTERNAL_H */
