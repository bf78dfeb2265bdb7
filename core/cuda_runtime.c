/*
 * cuda_runtime.c - the CUDA runtime glue of the core (built with CUDA only;
 * core/nocuda.c stands in otherwise): device queries, the per-context CUDA
 * state and host/device copies.
 *
 * Owns `struct moe_cuda_state` (ctx->cuda, created on first use): per device
 * one non-blocking stream (created on first use), a cuBLAS handle (created on
 * first use of moe_cuda_cublas), a caching allocator with its statistics, and
 * the word in mapped host memory where kernels report bad input (kerr.h),
 * read after every synchronisation and copy to the host.
 *
 * The caching allocator follows PyTorch's CUDACachingAllocator:
 *   - requests of at most 1 MiB are rounded up to a multiple of 512 bytes and
 *     carved from 2 MiB segments (the small pool); larger requests are rounded
 *     up to a multiple of 2 MiB and get a segment of exactly that size, or a
 *     piece of a cached large segment (the large pool);
 *   - a request takes the smallest free block of its pool that fits (best
 *     fit) and splits off the rest; a released block returns to its pool at
 *     once and merges with free neighbours of the same segment;
 *   - when cudaMalloc fails, every wholly free segment of the device is
 *     cudaFree'd and the cudaMalloc tried once more; if that fails too the
 *     call returns MOE_ERR_OUT_OF_MEMORY with the sizes in the message. A
 *     request larger than the device's memory fails at once, cache untouched.
 *   - there is one compute stream per device, so a released block may be
 *     handed out again at once: every kernel that used it was queued before
 *     any later use on the same stream. No cross-stream events are recorded.
 *     NCCL's communication streams (core/dist_nccl.c) keep this true without
 *     them: a collective starts after an event recorded on the compute
 *     stream, and the tensors it uses are held until the compute stream has
 *     been made to wait for its end, so their blocks come back here only
 *     after that wait is queued (the reasoning is in dist_nccl.c).
 * Storages are charged their block size (moe_storage.block) in `allocated`.
 *
 * Constraints: C11; includes CUDA, cuBLAS and NCCL headers but never lua.h;
 * every CUDA error becomes MOE_ERR_CUDA naming the call, file:line and
 * cudaGetErrorString (cuda_check.h). Without a driver or GPU every query answers "no device"
 * and every use fails with MOE_ERR_DEVICE. Not thread-safe (nor is the ctx).
 */
#include <stdlib.h>
#include <string.h>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "cuda_check.h"
#include "host_pin.h"
#include "internal.h"
#include "kerr.h"

/* ------------------------------------------------------------------ state */

#define MOE_KIB ((size_t)1024)
#define MOE_MIB (MOE_KIB * 1024)
#define MOE_SMALL_REQUEST MOE_MIB      /* requests up to this go to the small pool */
#define MOE_SMALL_ROUND ((size_t)512)  /* small requests round up to this */
#define MOE_SMALL_SEGMENT (2 * MOE_MIB) /* small pool's cudaMalloc size */
#define MOE_LARGE_ROUND (2 * MOE_MIB)  /* large requests round up to this */

enum { MOE_POOL_SMALL = 0, MOE_POOL_LARGE = 1, MOE_POOL_COUNT = 2 };

/* A piece of a segment (one cudaMalloc). The blocks of a segment form a list
 * in address order (prev/next); the first one (prev == NULL) holds the
 * pointer cudaMalloc returned. A block is either free, on its pool's free
 * list (fprev/fnext, sorted by size then address), or in use, in the
 * device's hash of live blocks (hnext). */
typedef struct moe_cuda_block {
  char *ptr;
  size_t size;
  int pool;
  bool in_use;
  struct moe_cuda_block *prev, *next;   /* neighbours in the segment */
  struct moe_cuda_block *fprev, *fnext; /* free list */
  struct moe_cuda_block *hnext;         /* live hash chain */
} moe_cuda_block;

typedef struct moe_cuda_device {
  bool ready;                /* stream created and total_mem known */
  cudaStream_t stream;       /* non-blocking; every launch and copy goes here */
  cublasHandle_t cublas;     /* NULL until moe_cuda_cublas asks for it */
  size_t total_mem;          /* the device's memory in bytes */
  moe_cuda_block *free_list[MOE_POOL_COUNT];
  moe_cuda_block **live;     /* (live_cap) hash buckets of blocks in use */
  size_t live_cap;           /* power of two; 0 before the first allocation */
  size_t live_n;
  moe_memory_stats stats;
  moe_kerr *kerr;            /* mapped pinned host memory the kernels report bad input in */
  void *kerr_dev;            /* its device address */
} moe_cuda_device;

#define MOE_KERR_TAGS 64
struct moe_cuda_state {
  moe_cuda_device dev[MOE_MAX_CUDA_DEVICES];
  const char *kerr_names[MOE_KERR_TAGS]; /* ops that asked for the error word (static strings) */
  int kerr_n;
};

static moe_status moe_cuda_state_get(moe_ctx *ctx, moe_cuda_state **out) {
  if (!ctx->cuda) {
    ctx->cuda = (moe_cuda_state *)calloc(1, sizeof(moe_cuda_state));
    if (!ctx->cuda)
      return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "out of host memory for the CUDA state");
  }
  *out = ctx->cuda;
  return MOE_OK;
}

/* --------------------------------------------------------------- queries */

bool moe_cuda_built(void) { return true; }

int moe_cuda_device_count(moe_ctx *ctx) {
  if (ctx && ctx->cuda_count >= 0) return ctx->cuda_count;
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError(); /* no driver, no device: not an error here */
    n = 0;
  }
  if (n < 0) n = 0;
  if (n > MOE_MAX_CUDA_DEVICES) n = MOE_MAX_CUDA_DEVICES;
  if (ctx) ctx->cuda_count = n;
  return n;
}

static moe_status moe_cuda_device_valid(moe_ctx *ctx, int device) {
  int n = moe_cuda_device_count(ctx);
  if (n == 0)
    return moe_error(ctx, MOE_ERR_DEVICE,
                     "cuda:%d requested but no CUDA device is visible (no GPU or no driver)",
                     device);
  if (device < 0 || device >= n)
    return moe_error(ctx, MOE_ERR_DEVICE, "cuda:%d requested but only %d CUDA device%s visible",
                     device, n, n == 1 ? " is" : "s are");
  return MOE_OK;
}

moe_status moe_cuda_device_info(moe_ctx *ctx, int index, char *name, size_t len, int *cc,
                                size_t *mem) {
  MOE_CHECK(moe_cuda_device_valid(ctx, index));
  struct cudaDeviceProp p;
  MOE_CUDA_CHECK(ctx, cudaGetDeviceProperties(&p, index));
  if (name && len > 0) {
    strncpy(name, p.name, len - 1);
    name[len - 1] = '\0';
  }
  if (cc) *cc = 10 * p.major + p.minor;
  if (mem) *mem = p.totalGlobalMem;
  return MOE_OK;
}

void moe_cuda_versions(int *runtime, int *driver, int *cublas, int *nccl) {
  int v = 0;
  if (runtime) *runtime = cudaRuntimeGetVersion(&v) == cudaSuccess ? v : 0;
  v = 0;
  if (driver) *driver = cudaDriverGetVersion(&v) == cudaSuccess ? v : 0;
  if (cublas) {
    int maj = 0, min = 0, pat = 0;
    if (cublasGetProperty(MAJOR_VERSION, &maj) == CUBLAS_STATUS_SUCCESS &&
        cublasGetProperty(MINOR_VERSION, &min) == CUBLAS_STATUS_SUCCESS &&
        cublasGetProperty(PATCH_LEVEL, &pat) == CUBLAS_STATUS_SUCCESS)
      *cublas = maj * 10000 + min * 100 + pat;
    else
      *cublas = 0;
  }
  v = 0;
  if (nccl) *nccl = ncclGetVersion(&v) == ncclSuccess ? v : 0;
  (void)cudaGetLastError();
}

/* --------------------------------------------------------------- streams */

moe_status moe_cuda_stream(moe_ctx *ctx, int device, void **stream) {
  MOE_CHECK(moe_cuda_device_valid(ctx, device));
  moe_cuda_state *st = NULL;
  MOE_CHECK(moe_cuda_state_get(ctx, &st));
  moe_cuda_device *dev = &st->dev[device];
  MOE_CUDA_CHECK(ctx, cudaSetDevice(device));
  if (!dev->ready) {
    size_t free_b = 0, total_b = 0;
    MOE_CUDA_CHECK(ctx, cudaMemGetInfo(&free_b, &total_b));
    MOE_CUDA_CHECK(ctx, cudaStreamCreateWithFlags(&dev->stream, cudaStreamNonBlocking));
    dev->total_mem = total_b;
    dev->ready = true;
    /* the error word: without it (no mapped memory) kernels skip the report */
    void *h = NULL, *hd = NULL;
    if (cudaHostAlloc(&h, sizeof(moe_kerr), cudaHostAllocMapped) == cudaSuccess) {
      memset(h, 0, sizeof(moe_kerr));
      if (cudaHostGetDevicePointer(&hd, h, 0) == cudaSuccess) {
        dev->kerr = (moe_kerr *)h;
        dev->kerr_dev = hd;
      } else {
        (void)cudaFreeHost(h);
      }
    }
    (void)cudaGetLastError();
  }
  *stream = (void *)dev->stream;
  return MOE_OK;
}

/* The cuBLAS handle of `device`, bound to the context's stream; created on
 * first use (declared in internal.h). */
moe_status moe_cuda_cublas(moe_ctx *ctx, int device, void **handle) {
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  moe_cuda_device *dev = &ctx->cuda->dev[device];
  if (!dev->cublas) {
    cublasHandle_t h = NULL;
    MOE_CUBLAS_CHECK(ctx, cublasCreate(&h));
    cublasStatus_t s = cublasSetStream(h, (cudaStream_t)stream);
    if (s != CUBLAS_STATUS_SUCCESS) {
      cublasDestroy(h);
      return moe_error(ctx, MOE_ERR_CUDA, "cublasSetStream failed at %s:%d: %s",
                       moe_check_file(__FILE__), __LINE__, cublasGetStatusString(s));
    }
    dev->cublas = h;
  }
  *handle = (void *)dev->cublas;
  return MOE_OK;
}

/* ------------------------------------------------- errors kernels report */

void *moe_cuda_kerr(moe_ctx *ctx, int device, const char *fn, int *tag) {
  *tag = 0;
  if (!ctx || !ctx->cuda || device < 0 || device >= MOE_MAX_CUDA_DEVICES) return NULL;
  moe_cuda_state *st = ctx->cuda;
  moe_cuda_device *dev = &st->dev[device];
  if (!dev->kerr) return NULL;
  int t = 0;
  while (t < st->kerr_n && strcmp(st->kerr_names[t], fn) != 0) t++;
  if (t == st->kerr_n) {
    if (t == MOE_KERR_TAGS) t = MOE_KERR_TAGS - 1; /* full: the last name stands for the rest */
    else st->kerr_names[st->kerr_n++] = fn;
  }
  *tag = t;
  return dev->kerr_dev;
}

/* After a synchronisation of `device`: what its kernels found, as an error
 * (and the word cleared for the next one). */
static moe_status moe_cuda_kerr_check(moe_ctx *ctx, int device) {
  moe_cuda_device *dev = &ctx->cuda->dev[device];
  moe_kerr *e = dev->kerr;
  if (!e || !e->set) return MOE_OK;
  moe_kerr k = *e;
  memset(e, 0, sizeof *e);
  const char *fn = k.tag >= 0 && k.tag < ctx->cuda->kerr_n ? ctx->cuda->kerr_names[k.tag] : "a kernel";
  return moe_error(ctx, MOE_ERR_INVALID_ARG,
                   "%s: index %lld is out of range [0, %lld) on cuda:%d (found by the kernel, "
                   "reported at this synchronisation: the op was queued earlier and its "
                   "result is not valid)",
                   fn, k.value, k.limit, device);
}

moe_status moe_cuda_synchronize(moe_ctx *ctx, moe_device d) {
  if (d.type != MOE_DEVICE_CUDA) return MOE_OK; /* the CPU runs synchronously */
  MOE_CHECK(moe_cuda_device_valid(ctx, d.index));
  if (!ctx->cuda || !ctx->cuda->dev[d.index].ready) return MOE_OK; /* nothing was queued */
  MOE_CUDA_CHECK(ctx, cudaSetDevice(d.index));
  MOE_CUDA_CHECK(ctx, cudaStreamSynchronize(ctx->cuda->dev[d.index].stream));
  ctx->host_syncs++;
  return moe_cuda_kerr_check(ctx, d.index);
}

/* ---------------------------------------------------------------- events */

moe_status moe_cuda_event_create(moe_ctx *ctx, int device, void **ev) {
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream)); /* validates, sets the device */
  cudaEvent_t e = NULL;
  MOE_CUDA_CHECK(ctx, cudaEventCreate(&e));
  *ev = (void *)e;
  return MOE_OK;
}

moe_status moe_cuda_event_record(moe_ctx *ctx, int device, void *ev) {
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  MOE_CUDA_CHECK(ctx, cudaEventRecord((cudaEvent_t)ev, (cudaStream_t)stream));
  return MOE_OK;
}

moe_status moe_cuda_event_synchronize(moe_ctx *ctx, void *ev) {
  MOE_CUDA_CHECK(ctx, cudaEventSynchronize((cudaEvent_t)ev));
  ctx->host_syncs++;
  return MOE_OK;
}

moe_status moe_cuda_event_elapsed(moe_ctx *ctx, void *start, void *end, float *ms) {
  MOE_CUDA_CHECK(ctx, cudaEventElapsedTime(ms, (cudaEvent_t)start, (cudaEvent_t)end));
  return MOE_OK;
}

void moe_cuda_event_destroy(void *ev) {
  if (ev && cudaEventDestroy((cudaEvent_t)ev) != cudaSuccess) (void)cudaGetLastError();
}

/* ------------------------------------------------------- allocator lists */

static void moe_free_list_insert(moe_cuda_device *dev, moe_cuda_block *b) {
  moe_cuda_block **head = &dev->free_list[b->pool];
  moe_cuda_block *prev = NULL, *cur = *head;
  while (cur && (cur->size < b->size || (cur->size == b->size && cur->ptr < b->ptr))) {
    prev = cur;
    cur = cur->fnext;
  }
  b->fprev = prev;
  b->fnext = cur;
  if (cur) cur->fprev = b;
  if (prev)
    prev->fnext = b;
  else
    *head = b;
}

static void moe_free_list_remove(moe_cuda_device *dev, moe_cuda_block *b) {
  if (b->fprev)
    b->fprev->fnext = b->fnext;
  else
    dev->free_list[b->pool] = b->fnext;
  if (b->fnext) b->fnext->fprev = b->fprev;
  b->fprev = b->fnext = NULL;
}

/* Best fit: the smallest free block of the pool holding at least size. */
static moe_cuda_block *moe_free_list_take(moe_cuda_device *dev, int pool, size_t size) {
  moe_cuda_block *b = dev->free_list[pool];
  while (b && b->size < size) b = b->fnext;
  if (b) moe_free_list_remove(dev, b);
  return b;
}

static size_t moe_live_bucket(const moe_cuda_device *dev, const void *ptr) {
  uint64_t h = (uint64_t)(uintptr_t)ptr >> 9; /* blocks are 512-byte aligned */
  h *= 0x9E3779B97F4A7C15ull;
  return (size_t)(h >> 32) & (dev->live_cap - 1);
}

/* Makes room for one more live block; the only step of an allocation that
 * can fail on host memory, so it runs before anything is changed. */
static moe_status moe_live_reserve(moe_ctx *ctx, moe_cuda_device *dev) {
  if (dev->live_n < dev->live_cap) return MOE_OK; /* load factor at most 1 */
  size_t cap = dev->live_cap ? dev->live_cap * 2 : 256;
  moe_cuda_block **buckets = (moe_cuda_block **)calloc(cap, sizeof(*buckets));
  if (!buckets)
    return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "out of host memory for the allocator's table");
  moe_cuda_block **old = dev->live;
  size_t old_cap = dev->live_cap;
  dev->live = buckets;
  dev->live_cap = cap;
  for (size_t i = 0; i < old_cap; i++) {
    moe_cuda_block *b = old[i];
    while (b) {
      moe_cuda_block *nx = b->hnext;
      size_t k = moe_live_bucket(dev, b->ptr);
      b->hnext = dev->live[k];
      dev->live[k] = b;
      b = nx;
    }
  }
  free(old);
  return MOE_OK;
}

static void moe_live_insert(moe_cuda_device *dev, moe_cuda_block *b) {
  size_t k = moe_live_bucket(dev, b->ptr);
  b->hnext = dev->live[k];
  dev->live[k] = b;
  dev->live_n++;
}

static moe_cuda_block *moe_live_remove(moe_cuda_device *dev, const void *ptr) {
  if (!dev->live_cap) return NULL;
  moe_cuda_block **p = &dev->live[moe_live_bucket(dev, ptr)];
  while (*p && (*p)->ptr != (const char *)ptr) p = &(*p)->hnext;
  moe_cuda_block *b = *p;
  if (b) {
    *p = b->hnext;
    b->hnext = NULL;
    dev->live_n--;
  }
  return b;
}

/* ------------------------------------------------------------- allocator */

static void moe_stats_peaks(moe_memory_stats *s) {
  if (s->allocated > s->peak_allocated) s->peak_allocated = s->allocated;
  if (s->reserved > s->peak_reserved) s->peak_reserved = s->reserved;
}

/* cudaFree's every wholly free segment of the device (device current, its
 * stream idle). Returns the first CUDA error, after trying them all. */
static cudaError_t moe_cache_release(moe_cuda_device *dev) {
  cudaError_t first = cudaSuccess;
  for (int pool = 0; pool < MOE_POOL_COUNT; pool++) {
    moe_cuda_block *b = dev->free_list[pool];
    while (b) {
      moe_cuda_block *nx = b->fnext;
      if (!b->prev && !b->next) {
        moe_free_list_remove(dev, b);
        cudaError_t e = cudaFree(b->ptr);
        if (e != cudaSuccess && first == cudaSuccess) first = e;
        dev->stats.reserved -= (int64_t)b->size;
        dev->stats.system_frees++;
        free(b);
      }
      b = nx;
    }
  }
  return first;
}

static moe_status moe_cuda_oom(moe_ctx *ctx, int device, const moe_cuda_device *dev,
                               size_t nbytes) {
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
    (void)cudaGetLastError();
    total_b = dev->total_mem;
  }
  return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY,
                   "CUDA out of memory on cuda:%d: tried to allocate %zu bytes (%.2f MiB); "
                   "moe-lua has %lld bytes (%.2f MiB) allocated and %lld bytes (%.2f MiB) "
                   "reserved; the device has %zu bytes (%.2f MiB) free of %zu (%.2f MiB)",
                   device, nbytes, (double)nbytes / MOE_MIB, (long long)dev->stats.allocated,
                   (double)dev->stats.allocated / MOE_MIB, (long long)dev->stats.reserved,
                   (double)dev->stats.reserved / MOE_MIB, free_b, (double)free_b / MOE_MIB,
                   total_b, (double)total_b / MOE_MIB);
}

/* A new segment of `size` bytes from cudaMalloc, as one free-standing block
 * (not on a free list). On failure, empties the cache and retries once. */
static moe_status moe_segment_new(moe_ctx *ctx, int device, moe_cuda_device *dev, size_t size,
                                  int pool, size_t nbytes, moe_cuda_block **out) {
  moe_cuda_block *b = (moe_cuda_block *)calloc(1, sizeof(*b));
  if (!b) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "out of host memory for a block record");
  void *p = NULL;
  cudaError_t e = cudaMalloc(&p, size);
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    cudaError_t es = cudaStreamSynchronize(dev->stream);
    cudaError_t ef = es == cudaSuccess ? moe_cache_release(dev) : es;
    if (ef != cudaSuccess) {
      (void)cudaGetLastError();
      free(b);
      return moe_error(ctx, MOE_ERR_CUDA, "freeing cached blocks after a failed cudaMalloc "
                       "failed at %s:%d: %s", moe_check_file(__FILE__), __LINE__,
                       cudaGetErrorString(ef));
    }
    e = cudaMalloc(&p, size);
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      free(b);
      return moe_cuda_oom(ctx, device, dev, nbytes);
    }
  }
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    free(b);
    return moe_error(ctx, MOE_ERR_CUDA, "cudaMalloc(%zu) failed at %s:%d: %s (%s)", size,
                     moe_check_file(__FILE__), __LINE__, cudaGetErrorString(e),
                     cudaGetErrorName(e));
  }
  b->ptr = (char *)p;
  b->size = size;
  b->pool = pool;
  dev->stats.reserved += (int64_t)size;
  dev->stats.system_allocs++;
  moe_stats_peaks(&dev->stats);
  *out = b;
  return MOE_OK;
}

moe_status moe_cuda_alloc(moe_ctx *ctx, int device, size_t nbytes, void **ptr, size_t *block) {
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream)); /* checks device, makes it current */
  moe_cuda_device *dev = &ctx->cuda->dev[device];
  if (nbytes == 0) { /* an empty storage holds no block */
    dev->stats.alloc_count++;
    dev->stats.live_storages++;
    *ptr = NULL;
    *block = 0;
    return MOE_OK;
  }
  int pool;
  size_t size;
  if (nbytes <= MOE_SMALL_REQUEST) {
    pool = MOE_POOL_SMALL;
    size = (nbytes + MOE_SMALL_ROUND - 1) / MOE_SMALL_ROUND * MOE_SMALL_ROUND;
  } else {
    pool = MOE_POOL_LARGE;
    size = nbytes > SIZE_MAX - MOE_LARGE_ROUND
               ? SIZE_MAX
               : (nbytes + MOE_LARGE_ROUND - 1) / MOE_LARGE_ROUND * MOE_LARGE_ROUND;
  }
  if (size > dev->total_mem) return moe_cuda_oom(ctx, device, dev, nbytes); /* can never fit */
  MOE_CHECK(moe_live_reserve(ctx, dev));

  moe_cuda_block *b = moe_free_list_take(dev, pool, size);
  if (!b)
    MOE_CHECK(moe_segment_new(ctx, device, dev, pool == MOE_POOL_SMALL ? MOE_SMALL_SEGMENT : size,
                              pool, nbytes, &b));
  /* Split off the rest when another block fits in it (in the large pool every
   * size is a multiple of 2 MiB). Without host memory for the record, the
   * storage keeps the whole block: correct, only less economical. */
  size_t rest = b->size - size;
  if (rest >= (pool == MOE_POOL_SMALL ? MOE_SMALL_ROUND : MOE_LARGE_ROUND)) {
    moe_cuda_block *r = (moe_cuda_block *)calloc(1, sizeof(*r));
    if (r) {
      r->ptr = b->ptr + size;
      r->size = rest;
      r->pool = pool;
      r->prev = b;
      r->next = b->next;
      if (b->next) b->next->prev = r;
      b->next = r;
      b->size = size;
      moe_free_list_insert(dev, r);
    }
  }
  b->in_use = true;
  moe_live_insert(dev, b);
  dev->stats.allocated += (int64_t)b->size;
  dev->stats.alloc_count++;
  dev->stats.live_storages++;
  moe_stats_peaks(&dev->stats);
  *ptr = b->ptr;
  *block = b->size;
  return MOE_OK;
}

void moe_cuda_release(moe_ctx *ctx, int device, void *ptr, size_t block) {
  MOE_ASSERT(ctx && ctx->cuda && device >= 0 && device < MOE_MAX_CUDA_DEVICES);
  moe_cuda_device *dev = &ctx->cuda->dev[device];
  dev->stats.free_count++;
  dev->stats.live_storages--;
  if (!ptr) return; /* an empty storage */
  moe_cuda_block *b = moe_live_remove(dev, ptr);
  MOE_ASSERT(b && b->in_use && b->size == block); /* a pointer this allocator handed out */
  b->in_use = false;
  dev->stats.allocated -= (int64_t)b->size;
  /* Merge with free neighbours of the same segment. */
  moe_cuda_block *p = b->prev;
  if (p && !p->in_use) {
    moe_free_list_remove(dev, p);
    p->size += b->size;
    p->next = b->next;
    if (b->next) b->next->prev = p;
    free(b);
    b = p;
  }
  moe_cuda_block *n = b->next;
  if (n && !n->in_use) {
    moe_free_list_remove(dev, n);
    b->size += n->size;
    b->next = n->next;
    if (n->next) n->next->prev = b;
    free(n);
  }
  moe_free_list_insert(dev, b);
}

moe_status moe_cuda_stats(moe_ctx *ctx, int device, moe_memory_stats *out) {
  MOE_CHECK(moe_cuda_device_valid(ctx, device));
  if (ctx->cuda)
    *out = ctx->cuda->dev[device].stats;
  else
    memset(out, 0, sizeof(*out));
  return MOE_OK;
}

moe_status moe_cuda_reset_peak(moe_ctx *ctx, int device) {
  MOE_CHECK(moe_cuda_device_valid(ctx, device));
  if (ctx->cuda) {
    moe_memory_stats *s = &ctx->cuda->dev[device].stats;
    s->peak_allocated = s->allocated;
    s->peak_reserved = s->reserved;
  }
  return MOE_OK;
}

moe_status moe_cuda_empty_cache(moe_ctx *ctx, int device) {
  MOE_CHECK(moe_cuda_device_valid(ctx, device));
  if (!ctx->cuda || !ctx->cuda->dev[device].ready) return MOE_OK; /* nothing cached */
  moe_cuda_device *dev = &ctx->cuda->dev[device];
  MOE_CUDA_CHECK(ctx, cudaSetDevice(device));
  MOE_CUDA_CHECK(ctx, cudaStreamSynchronize(dev->stream)); /* free blocks may still be in use */
  MOE_CUDA_CHECK(ctx, moe_cache_release(dev));
  return MOE_OK;
}

/* ----------------------------------------------------------------- copies */

moe_status moe_cuda_host_register(moe_ctx *ctx, void *p, size_t nbytes) {
  if (nbytes == 0) return MOE_OK;
  MOE_CUDA_CHECK(ctx, cudaHostRegister(p, nbytes, cudaHostRegisterDefault));
  return MOE_OK;
}

void moe_cuda_host_unregister(void *p) {
  if (p) (void)cudaHostUnregister(p);
}

moe_status moe_cuda_memcpy(moe_ctx *ctx, void *dst, moe_device dd, const void *src,
                           moe_device sd, size_t nbytes) {
  if (nbytes == 0) return MOE_OK;
  bool dcuda = dd.type == MOE_DEVICE_CUDA, scuda = sd.type == MOE_DEVICE_CUDA;
  if (!dcuda && !scuda) {
    memcpy(dst, src, nbytes);
    return MOE_OK;
  }
  void *stream;
  if (dcuda && !scuda) { /* pageable host source: consumed before the call returns */
    MOE_CHECK(moe_cuda_stream(ctx, dd.index, &stream));
    MOE_CUDA_CHECK(ctx, cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyHostToDevice,
                                        (cudaStream_t)stream));
    return MOE_OK;
  }
  if (!dcuda) {
    MOE_CHECK(moe_cuda_stream(ctx, sd.index, &stream));
    MOE_CUDA_CHECK(ctx, cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToHost,
                                        (cudaStream_t)stream));
    MOE_CUDA_CHECK(ctx, cudaStreamSynchronize((cudaStream_t)stream));
    moe_host_read_note(ctx);
    return moe_cuda_kerr_check(ctx, sd.index);
  }
  if (dd.index == sd.index) {
    MOE_CHECK(moe_cuda_stream(ctx, dd.index, &stream));
    MOE_CUDA_CHECK(ctx, cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToDevice,
                                        (cudaStream_t)stream));
    return MOE_OK;
  }
  /* Between two GPUs: each side's queued work first, then the copy on the
   * destination's stream, waited for so that neither stream can touch the
   * buffers while it runs. Rare (experts move with NCCL), so simple. */
  void *sstream;
  MOE_CHECK(moe_cuda_stream(ctx, sd.index, &sstream));
  MOE_CUDA_CHECK(ctx, cudaStreamSynchronize((cudaStream_t)sstream));
  MOE_CHECK(moe_cuda_stream(ctx, dd.index, &stream));
  MOE_CUDA_CHECK(ctx, cudaStreamSynchronize((cudaStream_t)stream));
  MOE_CUDA_CHECK(ctx, cudaMemcpyPeerAsync(dst, dd.index, src, sd.index, nbytes,
                                          (cudaStream_t)stream));
  MOE_CUDA_CHECK(ctx, cudaStreamSynchronize((cudaStream_t)stream));
  return MOE_OK;
}

/* --------------------------------------------------------------- teardown */

static void moe_block_destroy(moe_cuda_block *b) {
  if (!b->prev) { /* the segment's first block holds the cudaMalloc pointer */
    if (cudaFree(b->ptr) != cudaSuccess) (void)cudaGetLastError();
  }
  free(b);
}

void moe_cuda_state_free(moe_ctx *ctx) {
  if (!ctx || !ctx->cuda) return;
  moe_cuda_state *st = ctx->cuda;
  for (int d = 0; d < MOE_MAX_CUDA_DEVICES; d++) {
    moe_cuda_device *dev = &st->dev[d];
    if (dev->ready) {
      if (cudaSetDevice(d) == cudaSuccess) (void)cudaStreamSynchronize(dev->stream);
      (void)cudaGetLastError();
    }
    /* Every block is either on a free list or in the live table (storages
     * the user leaked): free the records, cudaFree each segment once. */
    for (int pool = 0; pool < MOE_POOL_COUNT; pool++) {
      moe_cuda_block *b = dev->free_list[pool];
      while (b) {
        moe_cuda_block *nx = b->fnext;
        moe_block_destroy(b);
        b = nx;
      }
    }
    for (size_t i = 0; i < dev->live_cap; i++) {
      moe_cuda_block *b = dev->live[i];
      while (b) {
        moe_cuda_block *nx = b->hnext;
        moe_block_destroy(b);
        b = nx;
      }
    }
    free(dev->live);
    if (dev->kerr && cudaFreeHost(dev->kerr) != cudaSuccess) (void)cudaGetLastError();
    if (dev->cublas) cublasDestroy(dev->cublas);
    if (dev->ready && cudaStreamDestroy(dev->stream) != cudaSuccess) (void)cudaGetLastError();
  }
  free(st);
  ctx->cuda = NULL;
  (void)cudaGetLastError();
}
