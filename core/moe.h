/*
 * moe.h - the public C API of the moe-lua core.
 *
 * The core is a C11 tensor library: refcounted storage, strided tensor views,
 * a CPU reference of every op and dispatch to CUDA launchers in kernels/.
 * It never includes lua.h, never exits and never aborts on a caller's mistake:
 * every fallible call returns a moe_status and leaves a message in the
 * context (moe_ctx_error). Abort is kept for broken internal invariants.
 *
 * Conventions
 *   - Every call takes the context first; outputs come last, as pointers.
 *   - Dims and indices are 0-based; a negative dim counts from the end
 *     (-1 is the last dim). This is the convention of the Lua API too.
 *   - Strides and offsets are in elements, not bytes, and are int64_t.
 *   - A function returning a new tensor hands the caller one reference;
 *     release it with moe_tensor_release. Views share their base's storage.
 *   - On failure no output is written and nothing is leaked.
 */
#ifndef MOE_H
#define MOE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MOE_VERSION "0.1.0"
#define MOE_MAX_DIMS 8

/* ------------------------------------------------------------------ status */

typedef enum moe_status {
  MOE_OK = 0,
  MOE_ERR_INVALID_ARG,   /* a bad value: negative size, unknown name, ... */
  MOE_ERR_SHAPE,         /* shapes that do not fit together */
  MOE_ERR_DTYPE,         /* a dtype the op does not take */
  MOE_ERR_DEVICE,        /* no such device, devices that do not match */
  MOE_ERR_OUT_OF_MEMORY, /* host or device allocation failed */
  MOE_ERR_CUDA,          /* a CUDA / cuBLAS / NCCL call failed */
  MOE_ERR_NOT_SUPPORTED, /* valid request this build or op cannot do */
  MOE_ERR_IO,            /* file errors */
  MOE_ERR_INTERNAL,      /* a bug in moe-lua */
  MOE_ERR_COMM,          /* a collective failed or timed out (moe_dist.h) */
  MOE_STATUS_COUNT
} moe_status;

const char *moe_status_name(moe_status s);

/* ------------------------------------------------------------------ dtypes */

typedef enum moe_dtype {
  MOE_F32 = 0,
  MOE_F64,
  MOE_BF16,
  MOE_F16,
  MOE_I8,
  MOE_U8,
  MOE_I32,
  MOE_I64,
  MOE_BOOL,
  MOE_DTYPE_COUNT
} moe_dtype;

const char *moe_dtype_name(moe_dtype dt);      /* "f32", "bf16", ... */
size_t moe_dtype_size(moe_dtype dt);           /* bytes per element */
bool moe_dtype_is_float(moe_dtype dt);         /* f32 f64 bf16 f16 */
/* Parses "f32" (also "float32", "float"), "bf16" ("bfloat16"), "i64"
 * ("int64", "long"), ... Returns false for an unknown name. */
bool moe_dtype_parse(const char *name, moe_dtype *out);
/* Result dtype of a binary op between tensors (PyTorch-like promotion:
 * bool < integers < floats; within a kind the wider wins; bf16 with f16
 * gives f32, i8 with u8 gives i32). */
moe_dtype moe_dtype_promote(moe_dtype a, moe_dtype b);

/* ----------------------------------------------------------------- devices */

typedef enum moe_device_type { MOE_DEVICE_CPU = 0, MOE_DEVICE_CUDA = 1 } moe_device_type;

typedef struct moe_device {
  moe_device_type type;
  int index; /* CUDA ordinal; 0 for the CPU */
} moe_device;

#define MOE_CPU ((moe_device){MOE_DEVICE_CPU, 0})

bool moe_device_equal(moe_device a, moe_device b);
/* Writes "cpu" or "cuda:N" into buf (at least 16 bytes). */
const char *moe_device_str(moe_device d, char *buf, size_t len);

/* ----------------------------------------------------------------- context */

/* The context carries the error buffer, the random generator, the per-device
 * CUDA state (stream, cuBLAS handle, caching allocator) and memory
 * statistics. One per thread of work; it is not thread-safe. Defined in
 * core/internal.h. */
typedef struct moe_ctx moe_ctx;

moe_status moe_ctx_init(moe_ctx **out);
/* Releases all CUDA state and cached device memory. Tensors must be released
 * before; live storages are reported as leaks by the statistics. */
void moe_ctx_free(moe_ctx *ctx);

/* The message of the last failed call ("" after success of moe_ctx_clear). */
const char *moe_ctx_error(const moe_ctx *ctx);
moe_status moe_ctx_status(const moe_ctx *ctx);
void moe_ctx_clear(moe_ctx *ctx);
/* Records an error (printf-style message) and returns the status, so
 * that `return moe_error(ctx, MOE_ERR_SHAPE, "...", ...)` is the idiom. */
moe_status moe_error(moe_ctx *ctx, moe_status s, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* Checks that a device exists in this build and on this machine; a clear
 * error otherwise ("built without CUDA", "no CUDA device", "cuda:3 but only
 * 2 devices"). */
moe_status moe_device_check(moe_ctx *ctx, moe_device d);
/* Parses "cpu", "cuda", "cuda:N", "gpu" and checks it exists. */
moe_status moe_device_parse(moe_ctx *ctx, const char *s, moe_device *out);

/* CUDA facts. All are safe to call in a build without CUDA. */
bool moe_cuda_built(void);                   /* compiled with CUDA */
int moe_cuda_device_count(moe_ctx *ctx);     /* 0 without CUDA or GPUs */
/* name/len: the GPU's name; cc: compute capability as 10*major+minor;
 * mem: total bytes. */
moe_status moe_cuda_device_info(moe_ctx *ctx, int index, char *name, size_t len,
                                int *cc, size_t *mem);
/* Versions as integers (e.g. CUDA 13000, cuBLAS 130100, NCCL 22803);
 * 0 where unknown or not built in. */
void moe_cuda_versions(int *runtime, int *driver, int *cublas, int *nccl);
/* Waits for all work queued on the context's stream of that device. */
moe_status moe_cuda_synchronize(moe_ctx *ctx, moe_device d);

/* ------------------------------------------------------------------ events */
/*
 * A point in a device's work queue, for timing and ordering (core/event.c).
 * On CUDA it is a cudaEvent recorded on the context's stream of the device;
 * on the CPU, where ops run synchronously, the host's monotonic clock at the
 * time of recording. Events belong to the context: moe_event_free returns
 * one early; moe_ctx_free destroys those left.
 */
typedef struct moe_event moe_event;

moe_status moe_event_new(moe_ctx *ctx, moe_device d, moe_event **out);
moe_status moe_event_record(moe_ctx *ctx, moe_event *e);
/* Waits until the work queued before the record has finished. */
moe_status moe_event_synchronize(moe_ctx *ctx, moe_event *e);
/* Milliseconds from start to end; both recorded, on the same device. */
moe_status moe_event_elapsed(moe_ctx *ctx, moe_event *start, moe_event *end, double *ms);
void moe_event_free(moe_ctx *ctx, moe_event *e);

/* ------------------------------------------------------------------ memory */

typedef struct moe_memory_stats {
  int64_t allocated;      /* bytes in live tensors' storages */
  int64_t peak_allocated; /* high-water mark of allocated since reset */
  int64_t reserved;       /* bytes held from the system (CUDA: cached too) */
  int64_t peak_reserved;
  int64_t alloc_count;    /* storage allocations served */
  int64_t free_count;     /* storage releases */
  int64_t live_storages;  /* storages not yet released */
  int64_t system_allocs;  /* cudaMalloc (CUDA) or malloc (CPU) calls */
  int64_t system_frees;   /* cudaFree / free calls */
} moe_memory_stats;

moe_status moe_memory_stats_get(moe_ctx *ctx, moe_device d, moe_memory_stats *out);
moe_status moe_memory_reset_peak(moe_ctx *ctx, moe_device d);
/* Returns cached, unused device blocks to CUDA (no-op on the CPU). */
moe_status moe_memory_empty_cache(moe_ctx *ctx, moe_device d);

/* Reads of device values by the host since the context began, for tests and
 * profiles that count a step's host synchronisations:
 *   copies  copies of tensor values to the host: a GPU tensor's values
 *           read or moved to the CPU (item, totable, to("cpu")), the routing
 *           plan's counts copy (moe_routing.h);
 *   syncs   host waits for a device: each of those copies (it waits for the
 *           stream), moe_cuda_synchronize, and the synchronisation of a
 *           CUDA event.
 * Counted on every device: reading a CPU tensor's values (moe_tensor_to_f64
 * / moe_tensor_to_i64, what item and totable use) and a CPU plan's counts
 * copy count one copy and one sync each, as they would on a GPU, so a CPU
 * test sees what a GPU step would pay (in a GPU run such a read of a host
 * tensor counts too; read a GPU tensor's values directly, not through a CPU
 * copy, to count its one copy once). Not counted: copies from the host to a
 * device, between two devices, and waits inside NCCL or allocator teardown.
 * Either pointer may be NULL. */
void moe_host_reads(const moe_ctx *ctx, int64_t *copies, int64_t *syncs);

/* ----------------------------------------------------------------- storage */

typedef struct moe_storage {
  int64_t refcount;
  moe_device device;
  void *data;    /* host or device pointer; NULL when nbytes == 0 */
  size_t nbytes; /* requested size */
  size_t block;  /* size of the block behind data (allocator rounding) */
  moe_ctx *ctx;  /* the context whose allocator owns data */
  /* Sharded parameters (moe_dist.h, "parameter sharding"): a storage whose
   * data were freed (moe_storage_free_data) keeps nbytes and data = NULL
   * until moe_storage_alloc_data; not_ready marks data absent or still being
   * written by an asynchronous collective, and materialize (when set) makes
   * them ready. Backward calls it for a saved tensor whose storage is not
   * ready (moe_storage_ready), so a parameter released after its forward is
   * gathered again before its backward reads it. */
  bool data_freed;
  bool not_ready;
  moe_status (*materialize)(moe_ctx *ctx, void *ud);
  void *materialize_ud;
} moe_storage;

moe_status moe_storage_new(moe_ctx *ctx, moe_device d, size_t nbytes, moe_storage **out);
void moe_storage_retain(moe_storage *s);
void moe_storage_release(moe_storage *s);
/* Returns s's data block to the allocator (data NULL, nbytes kept, not
 * ready); a no-op when already freed. Every tensor over s then has no data
 * until moe_storage_alloc_data: reading it is the caller's error. */
moe_status moe_storage_free_data(moe_ctx *ctx, moe_storage *s);
/* A fresh block of nbytes for a storage whose data were freed (contents
 * undefined; still not ready); a no-op when it has data. */
moe_status moe_storage_alloc_data(moe_ctx *ctx, moe_storage *s);
/* Makes s ready through its materialize callback when it is not; an error
 * naming fn when it is not ready and has none. NULL s: ok. */
moe_status moe_storage_ready(moe_ctx *ctx, moe_storage *s, const char *fn);

/* ------------------------------------------------------------------ tensor */

typedef struct moe_tensor {
  int64_t refcount;
  moe_storage *storage;
  moe_dtype dtype;
  int ndim;                       /* 0 for a scalar, at most MOE_MAX_DIMS */
  int64_t shape[MOE_MAX_DIMS];    /* (ndim) */
  int64_t stride[MOE_MAX_DIMS];   /* (ndim) in elements */
  int64_t offset;                 /* first element, in elements of storage */
  void *autograd;                 /* reserved for autograd; NULL for now */
} moe_tensor;

/* Lifecycle. new/empty give one reference; release frees at zero.
 * release(NULL) is a no-op. */
void moe_tensor_retain(moe_tensor *t);
void moe_tensor_release(moe_tensor *t);

moe_status moe_tensor_empty(moe_ctx *ctx, int ndim, const int64_t *shape, moe_dtype dt,
                            moe_device d, moe_tensor **out);
moe_status moe_tensor_full(moe_ctx *ctx, int ndim, const int64_t *shape, double value,
                           moe_dtype dt, moe_device d, moe_tensor **out);
/* Builds a tensor from host values given as doubles in row-major order
 * (numel(shape) values), converted to dt and placed on d. */
moe_status moe_tensor_from_f64(moe_ctx *ctx, const double *values, int ndim,
                               const int64_t *shape, moe_dtype dt, moe_device d,
                               moe_tensor **out);
/* Reads a tensor's elements in row-major logical order into host doubles
 * (numel values). int64 values above 2^53 lose precision: use _i64. */
moe_status moe_tensor_to_f64(moe_ctx *ctx, const moe_tensor *t, double *values);
moe_status moe_tensor_to_i64(moe_ctx *ctx, const moe_tensor *t, int64_t *values);

int64_t moe_tensor_numel(const moe_tensor *t);
bool moe_tensor_is_contiguous(const moe_tensor *t);
moe_device moe_tensor_device(const moe_tensor *t);
/* Address of element 0: storage data + offset * element size. */
void *moe_tensor_data(const moe_tensor *t);
/* Normalises a possibly negative dim for a tensor of ndim dims (ndim + 1
 * with for_insert, as unsqueeze needs); an error names the range. */
moe_status moe_dim_normalize(moe_ctx *ctx, int64_t dim, int ndim, bool for_insert, int *out);
/* Writes "[2, 3]" into buf. */
const char *moe_shape_str(int ndim, const int64_t *shape, char *buf, size_t len);

/* Room for the longest shape moe_shape_str writes: MOE_MAX_DIMS sizes of up
 * to 20 characters, their separators, the brackets and the NUL. */
#define MOE_SHAPE_STR 200
#ifndef __cplusplus
_Static_assert(MOE_SHAPE_STR >= MOE_MAX_DIMS * (20 + 2) + 3, "MOE_SHAPE_STR too small");
#endif
/* Room for moe_device_str ("cuda:15"). */
#define MOE_DEVICE_STR 32

/* A shape or device as a string for an error message, in a buffer that lives
 * to the end of the enclosing block: moe_error(ctx, ..., "%s", MOE_SHAPE(t)). */
#define MOE_SHAPE(t) moe_shape_str((t)->ndim, (t)->shape, (char[MOE_SHAPE_STR]){0}, MOE_SHAPE_STR)
#define MOE_SHAPE_OF(ndim, shape) \
  moe_shape_str((ndim), (shape), (char[MOE_SHAPE_STR]){0}, MOE_SHAPE_STR)
#define MOE_DEVICE(d) moe_device_str((d), (char[MOE_DEVICE_STR]){0}, MOE_DEVICE_STR)

/* ------------------------------------------------------------------- views */
/* Views share storage; none of these copies data. */

/* shape may hold one -1, inferred. Fails when the strides cannot express it
 * without a copy (then use reshape). */
moe_status moe_view(moe_ctx *ctx, moe_tensor *t, int ndim, const int64_t *shape, moe_tensor **out);
/* view when possible, otherwise a contiguous copy. */
moe_status moe_reshape(moe_ctx *ctx, moe_tensor *t, int ndim, const int64_t *shape, moe_tensor **out);
moe_status moe_transpose(moe_ctx *ctx, moe_tensor *t, int64_t dim0, int64_t dim1, moe_tensor **out);
moe_status moe_permute(moe_ctx *ctx, moe_tensor *t, int ndim, const int64_t *dims, moe_tensor **out);
/* Elements [start, start + length) of dim. */
moe_status moe_narrow(moe_ctx *ctx, moe_tensor *t, int64_t dim, int64_t start, int64_t length,
                      moe_tensor **out);
/* Python-style slice start:stop:step of dim (negative start/stop count from
 * the end, clamped to the size; step >= 1). */
moe_status moe_slice(moe_ctx *ctx, moe_tensor *t, int64_t dim, int64_t start, int64_t stop,
                     int64_t step, moe_tensor **out);
/* Removes dim, keeping element index (negative counts from the end). */
moe_status moe_select(moe_ctx *ctx, moe_tensor *t, int64_t dim, int64_t index, moe_tensor **out);
/* Broadcasts size-1 dims (stride 0); shape may hold -1 to keep a size and may
 * add leading dims. */
moe_status moe_expand(moe_ctx *ctx, moe_tensor *t, int ndim, const int64_t *shape, moe_tensor **out);
/* Removes size-1 dim `dim`, or every size-1 dim when all is true. */
moe_status moe_squeeze(moe_ctx *ctx, moe_tensor *t, int64_t dim, bool all, moe_tensor **out);
moe_status moe_unsqueeze(moe_ctx *ctx, moe_tensor *t, int64_t dim, moe_tensor **out);
/* Returns t itself (retained) when already contiguous, else a copy. */
moe_status moe_contiguous(moe_ctx *ctx, moe_tensor *t, moe_tensor **out);

/* --------------------------------------------------- copies, fills, ranges */

/* Copies src into dst, broadcasting src to dst's shape, converting dtype and
 * crossing devices. dst may be any strided view (overlapping writes are an
 * error). */
moe_status moe_copy_(moe_ctx *ctx, moe_tensor *dst, const moe_tensor *src);
/* A new tensor with dtype dt on device d; returns t retained when both
 * already match (like PyTorch's .to). */
moe_status moe_to(moe_ctx *ctx, moe_tensor *t, moe_dtype dt, moe_device d, moe_tensor **out);
moe_status moe_clone(moe_ctx *ctx, const moe_tensor *t, moe_tensor **out);
moe_status moe_fill_(moe_ctx *ctx, moe_tensor *t, double value);
/* start, start+step, ... < end (> end for negative step). */
moe_status moe_arange(moe_ctx *ctx, double start, double end, double step, moe_dtype dt,
                      moe_device d, moe_tensor **out);
moe_status moe_linspace(moe_ctx *ctx, double start, double end, int64_t steps, moe_dtype dt,
                        moe_device d, moe_tensor **out);

/* ------------------------------------------------------------------ random */
/*
 * Counter-based generator (Philox-4x32-10, core/philox.h). The context holds
 * a seed and a call counter; each fill below uses key = seed and counter =
 * (element / 4, call), then advances call by one. Element i of a tensor is a
 * function of (seed, call, i) alone, so the same seed gives the same numbers
 * on CPU and GPU whatever the launch shape: bit-identical for uniform and
 * integers, within a few ulp for normal (libm vs CUDA's logf/sincosf).
 * Element order is the row-major logical order of the tensor.
 */
void moe_rng_seed(moe_ctx *ctx, uint64_t seed);
void moe_rng_get_state(const moe_ctx *ctx, uint64_t *seed, uint64_t *call);
void moe_rng_set_state(moe_ctx *ctx, uint64_t seed, uint64_t call);
moe_status moe_uniform_(moe_ctx *ctx, moe_tensor *t, double low, double high); /* [low, high) */
moe_status moe_normal_(moe_ctx *ctx, moe_tensor *t, double mean, double std);
/* integers in [low, high) */
moe_status moe_randint_(moe_ctx *ctx, moe_tensor *t, int64_t low, int64_t high);

/* -------------------------------------------------------------- op table */
/*
 * One enum names every op the core knows, with a name table guarded by a
 * static assert in core/op_table.c. Later issues (autograd, MoE kernels) append.
 */
typedef enum moe_op {
  /* elementwise arithmetic (core/elementwise.c) */
  MOE_OP_ADD = 0,
  MOE_OP_SUB,
  MOE_OP_MUL,
  MOE_OP_DIV,
  MOE_OP_NEG,
  /* views and copies, for autograd (core/tensor.c, core/copy.c) */
  MOE_OP_VIEW,
  MOE_OP_TRANSPOSE,
  MOE_OP_PERMUTE,
  MOE_OP_NARROW,
  MOE_OP_SLICE,
  MOE_OP_SELECT,
  MOE_OP_EXPAND,
  MOE_OP_SQUEEZE,
  MOE_OP_UNSQUEEZE,
  MOE_OP_COPY,       /* to / clone / contiguous / casts */
  MOE_OP_CUSTOM,     /* a function defined outside the core (Lua) */
  /* pointwise math and activations (moe_pointwise.h) */
  MOE_OP_POW,
  MOE_OP_EXP,
  MOE_OP_LOG,
  MOE_OP_SQRT,
  MOE_OP_RSQRT,
  MOE_OP_ABS,
  MOE_OP_CLAMP,
  MOE_OP_WHERE,
  MOE_OP_EQ,
  MOE_OP_NE,
  MOE_OP_LT,
  MOE_OP_LE,
  MOE_OP_GT,
  MOE_OP_GE,
  MOE_OP_MAXIMUM,
  MOE_OP_MINIMUM,
  MOE_OP_RELU,
  MOE_OP_GELU,
  MOE_OP_GELU_TANH,
  MOE_OP_SILU,
  MOE_OP_SIGMOID,
  MOE_OP_TANH,
  MOE_OP_SWIGLU,
  MOE_OP_DROPOUT,
  /* reductions and normalisation (moe_reduce.h) */
  MOE_OP_SUM,
  MOE_OP_MEAN,
  MOE_OP_MAX,
  MOE_OP_MIN,
  MOE_OP_ARGMAX,
  MOE_OP_ARGMIN,
  MOE_OP_NORM,
  MOE_OP_LOGSUMEXP,
  MOE_OP_VAR,
  MOE_OP_SOFTMAX,
  MOE_OP_LOG_SOFTMAX,
  MOE_OP_CUMSUM,
  MOE_OP_LAYER_NORM,
  MOE_OP_RMS_NORM,
  MOE_OP_CROSS_ENTROPY,
  /* indexing, sorting, joining (moe_index.h) */
  MOE_OP_GATHER,
  MOE_OP_SCATTER,
  MOE_OP_SCATTER_ADD,
  MOE_OP_INDEX_SELECT,
  MOE_OP_INDEX_ADD,
  MOE_OP_EMBEDDING,
  MOE_OP_ONE_HOT,
  MOE_OP_TOPK,
  MOE_OP_SORT,
  MOE_OP_CAT,
  MOE_OP_STACK,
  MOE_OP_ROPE,
  MOE_OP_MULTINOMIAL,
  /* matrix products (moe_matmul.h) */
  MOE_OP_MATMUL,
  MOE_OP_BMM,
  MOE_OP_LINEAR,
  /* attention (moe_attention.h) */
  MOE_OP_ATTENTION,
  /* MoE routing (moe_routing.h) */
  MOE_OP_ROUTING_PERMUTE,
  MOE_OP_ROUTING_COMBINE,
  /* moe_grouped.h, moe_blocksparse.h, moe_experts.h */
  MOE_OP_GROUPED_MM,
  MOE_OP_BSMM_SDD,
  MOE_OP_BSMM_DSD,
  MOE_OP_PARALLEL_LINEAR,
  MOE_OP_GLU_EXPERTS,
  MOE_OP_COUNT
} moe_op;

const char *moe_op_name(moe_op op);

/* --------------------------------------------------------- elementwise */
/*
 * Binary ops broadcast their inputs (NumPy rules) and promote dtypes
 * (moe_dtype_promote; DIV of integers gives f32). Both inputs must be on the
 * same device. Float math is done in f32 for f32/bf16/f16 and f64 for f64;
 * integer math in int64, then stored to the result dtype.
 */
moe_status moe_binary(moe_ctx *ctx, moe_op op, const moe_tensor *a, const moe_tensor *b,
                      moe_tensor **out);
/* a op s (or s op a when reverse). A scalar does not widen a float tensor;
 * an integer tensor with a non-integer scalar (or DIV) gives f32. */
moe_status moe_binary_scalar(moe_ctx *ctx, moe_op op, const moe_tensor *a, double s,
                             bool reverse, moe_tensor **out);
moe_status moe_unary(moe_ctx *ctx, moe_op op, const moe_tensor *a, moe_tensor **out);

/* ---------------------------------------------------------------- printing */

typedef struct moe_print_options {
  int precision;   /* digits after the point for floats (default 4) */
  int64_t threshold; /* summarise when numel exceeds this (default 1000) */
  int edgeitems;   /* items kept at each end of a summarised dim (default 3) */
  int linewidth;   /* wrap rows past this many characters (default 80) */
} moe_print_options;

moe_print_options moe_print_options_default(void);
/* PyTorch-like text: "tensor([[ 1.0000, -2.5000]], shape=[1, 2], dtype=f32, device=cpu)".
 * *out is malloc'd; free it with free(). */
moe_status moe_tensor_format(moe_ctx *ctx, const moe_tensor *t, const moe_print_options *opt,
                             char **out);

/* ------------------------------------------------------------ reductions */
/* Sum over dims (ndims == 0: over all dims, giving a scalar). Floats sum in
 * f32 (f64 for f64) and keep their dtype; integers and bool sum to i64.
 * Differentiable. Declared here because autograd's moe_sum_to_shape uses it;
 * the other reductions are in moe_reduce.h. */
moe_status moe_sum(moe_ctx *ctx, moe_tensor *t, int ndims, const int64_t *dims, bool keepdim,
                   moe_tensor **out);

#ifdef __cplusplus
}
#endif

/* The rest of the API, one header per family of ops. */
#include "moe_autograd.h"
#include "moe_pointwise.h"
#include "moe_reduce.h"
#include "moe_index.h"
#include "moe_matmul.h"
#include "moe_attention.h"
#include "moe_routing.h"
#include "moe_grouped.h"
#include "moe_blocksparse.h"
#include "moe_experts.h"
#include "moe_quantize.h"
#include "moe_optim.h"
#include "moe_data.h"
#include "moe_io.h"
#include "moe_dist.h"

#endif /* MOE_H */
