/*
 * safetensors.c - saving and loading safetensors files (moe_io.h says what
 * the format is and what is checked). Owns the moe_safetensors object: the
 * names, metadata strings (malloc'd) and one reference per loaded tensor.
 *
 * Save: validate the arguments, lay the tensors out, build the header,
 * write "<path>.tmp.<pid>", fsync, rename. Load: read and check the 8-byte
 * length, parse the header with core/json.c, check every entry and the
 * coverage of the buffer, then allocate and read one tensor at a time.
 * POSIX file calls (open, pread, write, fsync, rename) are used directly:
 * they give errno for the messages and fsync for the atomic write.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "host_pin.h"
#include "internal.h"
#include "json.h"
#include "moe_io.h"

#define ST_MAX_HEADER 100000000ull   /* the reference's limit on N */
#define ST_CHUNK ((size_t)8 << 20)     /* host buffer for strided / device tensors */
#define ST_MAX_IO ((size_t)1 << 30)    /* bytes per read/write call */
/* The longest list a header may hold: shapes have at most MOE_MAX_DIMS
 * sizes (longer ones are reported as such up to this length) and
 * data_offsets two. Bounds the parser's memory to a few times the header. */
#define ST_MAX_LIST 64

/* The safetensors name of each moe dtype. */
static const char *const st_dtype_names[MOE_DTYPE_COUNT] = {
    [MOE_F32] = "F32", [MOE_F64] = "F64", [MOE_BF16] = "BF16", [MOE_F16] = "F16",
    [MOE_I8] = "I8",   [MOE_U8] = "U8",   [MOE_I32] = "I32",   [MOE_I64] = "I64",
    [MOE_BOOL] = "BOOL"};
_Static_assert(MOE_DTYPE_COUNT == 9, "give the new dtype its safetensors name in st_dtype_names");

/* Dtypes the format knows and moe-lua has no dtype for. */
static const char *const st_foreign_dtypes[] = {"F4",      "F6_E2M3", "F6_E3M2", "F8_E5M2",
                                                "F8_E4M3", "F8_E8M0", "I16",     "U16",
                                                "U32",     "U64",     "C64",     NULL};

static const char st_supported[] = "F32, F64, BF16, F16, I8, U8, I32, I64, BOOL";

static bool host_is_little_endian(void) {
  const uint16_t one = 1;
  unsigned char b;
  memcpy(&b, &one, 1);
  return b == 1;
}

/* ------------------------------------------------------------ text buffer */

typedef struct sbuf {
  char *p;
  size_t n, cap;
  bool oom;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n) {
  if (b->oom) return;
  if (b->n + n + 1 > b->cap) {
    size_t nc = b->cap ? b->cap : 256;
    while (nc < b->n + n + 1) nc *= 2;
    char *np = realloc(b->p, nc);
    if (!np) {
      b->oom = true;
      return;
    }
    b->p = np;
    b->cap = nc;
  }
  memcpy(b->p + b->n, s, n);
  b->n += n;
  b->p[b->n] = '\0';
}

static void sb_puts(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

static void sb_u64(sbuf *b, uint64_t v) {
  char tmp[32];
  int k = snprintf(tmp, sizeof tmp, "%llu", (unsigned long long)v);
  sb_put(b, tmp, (size_t)k);
}

/* A JSON string, escaped as serde_json (the reference's writer) does. */
static void sb_json_string(sbuf *b, const char *s) {
  sb_put(b, "\"", 1);
  for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
    char esc[8];
    switch (*c) {
      case '"': sb_put(b, "\\\"", 2); break;
      case '\\': sb_put(b, "\\\\", 2); break;
      case '\b': sb_put(b, "\\b", 2); break;
      case '\f': sb_put(b, "\\f", 2); break;
      case '\n': sb_put(b, "\\n", 2); break;
      case '\r': sb_put(b, "\\r", 2); break;
      case '\t': sb_put(b, "\\t", 2); break;
      default:
        if (*c < 0x20) {
          snprintf(esc, sizeof esc, "\\u%04x", *c);
          sb_put(b, esc, 6);
        } else {
          sb_put(b, (const char *)c, 1);
        }
    }
  }
  sb_put(b, "\"", 1);
}

/* ------------------------------------------------------------------ save */

typedef struct st_entry {
  const char *name;
  moe_tensor *t;   /* borrowed from the caller */
  size_t esize;
  uint64_t begin, end; /* offsets in the data buffer */
} st_entry;

static int cmp_names(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Data order, as the reference writes it: dtypes in the reverse of the
 * reference's Dtype enum order (I64, F64, F32, I32, BF16, F16, I8, U8, BOOL),
 * then names in byte order. Element sizes never grow along it, so every
 * tensor starts aligned to its element size. */
static int st_dtype_rank(moe_dtype dt) {
  switch (dt) {
    case MOE_I64: return 9;
    case MOE_F64: return 8;
    case MOE_F32: return 7;
    case MOE_I32: return 6;
    case MOE_BF16: return 5;
    case MOE_F16: return 4;
    case MOE_I8: return 3;
    case MOE_U8: return 2;
    case MOE_BOOL: return 1;
    default: return 0;
  }
}

static int cmp_layout(const void *a, const void *b) {
  const st_entry *x = a, *y = b;
  int rx = st_dtype_rank(x->t->dtype), ry = st_dtype_rank(y->t->dtype);
  if (rx != ry) return rx > ry ? -1 : 1;
  return strcmp(x->name, y->name);
}

typedef struct st_writer {
  moe_ctx *ctx;
  int fd;
  const char *tmp;
} st_writer;

static moe_status st_write_all(st_writer *w, const void *buf, size_t n) {
  const char *p = buf;
  while (n > 0) {
    ssize_t r = write(w->fd, p, n > ST_MAX_IO ? ST_MAX_IO : n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0)
      return moe_error(w->ctx, MOE_ERR_IO, "save: writing '%s': %s", w->tmp,
                       r < 0 ? strerror(errno) : "the write made no progress");
    p += r;
    n -= (size_t)r;
  }
  return MOE_OK;
}

/* Writes t (any strides, any device) row-major through scratch, a 1-D host
 * tensor of t's dtype: whole when it fits, else in runs of rows of dim 0,
 * else row by row (recursing into the row). */
static moe_status st_emit(st_writer *w, moe_tensor *t, moe_tensor *scratch) {
  moe_ctx *ctx = w->ctx;
  int64_t numel = moe_tensor_numel(t), cap = scratch->shape[0];
  moe_status st = MOE_OK;
  if (numel == 0) return MOE_OK;
  if (numel <= cap) {
    moe_tensor *flat = NULL, *dst = NULL;
    MOE_CHECK(moe_narrow(ctx, scratch, 0, 0, numel, &flat));
    MOE_CHECK_GOTO(moe_view(ctx, flat, t->ndim, t->shape, &dst), st, done);
    MOE_CHECK_GOTO(moe_copy_(ctx, dst, t), st, done);
    st = st_write_all(w, moe_tensor_data(flat), (size_t)numel * moe_dtype_size(t->dtype));
  done:
    moe_tensor_release(dst);
    moe_tensor_release(flat);
    return st;
  }
  /* numel > cap >= 1, so t has a dim 0 of size >= 1 */
  int64_t rows = t->shape[0], row = numel / rows;
  int64_t step = row <= cap ? cap / row : 1;
  for (int64_t i = 0; i < rows && st == MOE_OK; i += step) {
    moe_tensor *part = NULL;
    if (row <= cap) MOE_CHECK(moe_narrow(ctx, t, 0, i, step < rows - i ? step : rows - i, &part));
    else MOE_CHECK(moe_select(ctx, t, 0, i, &part));
    st = st_emit(w, part, scratch);
    moe_tensor_release(part);
  }
  return st;
}

static moe_status st_write_tensor(st_writer *w, const st_entry *e) {
  moe_ctx *ctx = w->ctx;
  moe_tensor *t = e->t;
  int64_t numel = moe_tensor_numel(t);
  if (numel == 0) return MOE_OK;
  if (t->storage->device.type == MOE_DEVICE_CPU && moe_tensor_is_contiguous(t))
    return st_write_all(w, moe_tensor_data(t), (size_t)(e->end - e->begin));
  int64_t cap = (int64_t)(ST_CHUNK / e->esize);
  if (cap > numel) cap = numel;
  moe_tensor *scratch = NULL;
  MOE_CHECK(moe_tensor_empty(ctx, 1, &cap, t->dtype, MOE_CPU, &scratch));
  moe_status st = st_emit(w, t, scratch);
  moe_tensor_release(scratch);
  return st;
}

static moe_status st_check_save_args(moe_ctx *ctx, const char *path, int64_t n,
                                     const char *const *names, moe_tensor *const *tensors,
                                     int64_t n_meta, const char *const *meta_keys,
                                     const char *const *meta_values) {
  if (!path || !path[0]) return moe_error(ctx, MOE_ERR_INVALID_ARG, "save: path is %s", path ? "empty" : "NULL");
  if (n < 0) return moe_error(ctx, MOE_ERR_INVALID_ARG, "save: %lld tensors (a count >= 0 expected)", (long long)n);
  if (n_meta < 0)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "save: %lld metadata entries (a count >= 0 expected)",
                     (long long)n_meta);
  if (n > 0 && (!names || !tensors))
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "save: %s is NULL with %lld tensors",
                     names ? "tensors" : "names", (long long)n);
  if (n_meta > 0 && (!meta_keys || !meta_values))
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "save: %s is NULL with %lld metadata entries",
                     meta_keys ? "meta_values" : "meta_keys", (long long)n_meta);
  if (!host_is_little_endian())
    return moe_error(ctx, MOE_ERR_NOT_SUPPORTED, "save: safetensors files are little-endian and this host is not");
  for (int64_t i = 0; i < n; i++) {
    const char *nm = names[i];
    if (!nm) return moe_error(ctx, MOE_ERR_INVALID_ARG, "save: name %lld is NULL", (long long)i);
    if (!nm[0]) return moe_error(ctx, MOE_ERR_INVALID_ARG, "save: tensor %lld has an empty name", (long long)i);
    if (!moe_utf8_valid(nm, strlen(nm)))
      return moe_error(ctx, MOE_ERR_INVALID_ARG, "save: tensor name %lld is not valid UTF-8", (long long)i);
    if (strcmp(nm, "__metadata__") == 0)
      return moe_error(ctx, MOE_ERR_INVALID_ARG,
                       "save: '__metadata__' is reserved for the metadata and cannot name a tensor");
    moe_tensor *t = tensors[i];
    if (!t || !t->storage)
      return moe_error(ctx, MOE_ERR_INVALID_ARG, "save: tensor '%s' is NULL", nm);
    MOE_CHECK(moe_device_check(ctx, t->storage->device));
  }
  for (int64_t i = 0; i < n_meta; i++) {
    const char *k = meta_keys[i], *v = meta_values[i];
    if (!k || !v)
      return moe_error(ctx, MOE_ERR_INVALID_ARG, "save: metadata %s %lld is NULL", k ? "value" : "key",
                       (long long)i);
    if (!moe_utf8_valid(k, strlen(k)))
      return moe_error(ctx, MOE_ERR_INVALID_ARG, "save: metadata key %lld is not valid UTF-8", (long long)i);
    if (!moe_utf8_valid(v, strlen(v)))
      return moe_error(ctx, MOE_ERR_INVALID_ARG, "save: the metadata value of '%s' is not valid UTF-8", k);
  }
  return MOE_OK;
}

/* A duplicate among n strings (sorted copy, neighbours), NULL if none. */
static moe_status st_find_duplicate(moe_ctx *ctx, int64_t n, const char *const *s,
                                    const char **dup) {
  *dup = NULL;
  if (n < 2) return MOE_OK;
  const char **c = malloc((size_t)n * sizeof *c);
  if (!c) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "save: out of host memory");
  memcpy(c, s, (size_t)n * sizeof *c);
  qsort(c, (size_t)n, sizeof *c, cmp_names);
  for (int64_t i = 1; i < n && !*dup; i++)
    if (strcmp(c[i - 1], c[i]) == 0) *dup = c[i];
  free(c);
  return MOE_OK;
}

/* The header: compact JSON, metadata (sorted by key) first, then the
 * entries in data order; spaces up to a multiple of 8 bytes. */
static moe_status st_build_header(moe_ctx *ctx, int64_t n, const st_entry *es, int64_t n_meta,
                                  const char *const *meta_keys, const char *const *meta_values,
                                  sbuf *h) {
  sb_puts(h, "{");
  if (n_meta > 0) {
    int64_t *ord = malloc((size_t)n_meta * sizeof *ord);
    if (!ord) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "save: out of host memory");
    for (int64_t i = 0; i < n_meta; i++) ord[i] = i;
    for (int64_t i = 1; i < n_meta; i++) { /* insertion sort by key: metadata is small */
      int64_t x = ord[i], j = i;
      while (j > 0 && strcmp(meta_keys[ord[j - 1]], meta_keys[x]) > 0) {
        ord[j] = ord[j - 1];
        j--;
      }
      ord[j] = x;
    }
    sb_puts(h, "\"__metadata__\":{");
    for (int64_t i = 0; i < n_meta; i++) {
      if (i) sb_puts(h, ",");
      sb_json_string(h, meta_keys[ord[i]]);
      sb_puts(h, ":");
      sb_json_string(h, meta_values[ord[i]]);
    }
    sb_puts(h, "}");
    free(ord);
    if (n > 0) sb_puts(h, ",");
  }
  for (int64_t i = 0; i < n; i++) {
    const moe_tensor *t = es[i].t;
    if (i) sb_puts(h, ",");
    sb_json_string(h, es[i].name);
    sb_puts(h, ":{\"dtype\":\"");
    sb_puts(h, st_dtype_names[t->dtype]);
    sb_puts(h, "\",\"shape\":[");
    for (int d = 0; d < t->ndim; d++) {
      if (d) sb_puts(h, ",");
      sb_u64(h, (uint64_t)t->shape[d]);
    }
    sb_puts(h, "],\"data_offsets\":[");
    sb_u64(h, es[i].begin);
    sb_puts(h, ",");
    sb_u64(h, es[i].end);
    sb_puts(h, "]}");
  }
  sb_puts(h, "}");
  while (!h->oom && h->n % 8 != 0) sb_puts(h, " ");
  if (h->oom) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "save: out of host memory building the header");
  return MOE_OK;
}

/* fsync of the folder holding path, so the rename is durable. Best effort:
 * some file systems refuse fsync on a folder. */
static void st_sync_folder(const char *path) {
  const char *slash = strrchr(path, '/');
  char *dir = NULL;
  if (!slash) dir = strdup(".");
  else if (slash == path) dir = strdup("/");
  else dir = strndup(path, (size_t)(slash - path));
  if (!dir) return;
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    (void)fsync(fd);
    close(fd);
  }
  free(dir);
}

moe_status moe_safetensors_save(moe_ctx *ctx, const char *path, int64_t n,
                                const char *const *names, moe_tensor *const *tensors,
                                int64_t n_meta, const char *const *meta_keys,
                                const char *const *meta_values) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(st_check_save_args(ctx, path, n, names, tensors, n_meta, meta_keys, meta_values));
  const char *dup = NULL;
  MOE_CHECK(st_find_duplicate(ctx, n, names, &dup));
  if (dup) return moe_error(ctx, MOE_ERR_INVALID_ARG, "save: duplicate tensor name '%s'", dup);
  MOE_CHECK(st_find_duplicate(ctx, n_meta, meta_keys, &dup));
  if (dup) return moe_error(ctx, MOE_ERR_INVALID_ARG, "save: duplicate metadata key '%s'", dup);

  moe_status st = MOE_OK;
  st_entry *es = calloc(n > 0 ? (size_t)n : 1, sizeof *es);
  sbuf h = {0};
  char *tmp = NULL;
  int fd = -1;
  bool grad_prev = moe_grad_set(ctx, false); /* the chunk views must not enter a graph */
  if (!es) {
    st = moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "save: out of host memory");
    goto fail;
  }
  for (int64_t i = 0; i < n; i++) {
    es[i].name = names[i];
    es[i].t = tensors[i];
    es[i].esize = moe_dtype_size(tensors[i]->dtype);
  }
  qsort(es, (size_t)n, sizeof *es, cmp_layout);
  uint64_t pos = 0;
  for (int64_t i = 0; i < n; i++) {
    uint64_t nb = (uint64_t)moe_tensor_numel(es[i].t) * es[i].esize;
    es[i].begin = pos;
    es[i].end = pos + nb;
    pos += nb;
  }
  MOE_CHECK_GOTO(st_build_header(ctx, n, es, n_meta, meta_keys, meta_values, &h), st, fail);

  size_t tlen = strlen(path) + 32;
  tmp = malloc(tlen);
  if (!tmp) {
    st = moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "save: out of host memory");
    goto fail;
  }
  snprintf(tmp, tlen, "%s.tmp.%ld", path, (long)getpid());
  fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (fd < 0) {
    st = moe_error(ctx, MOE_ERR_IO, "save: cannot create '%s': %s", tmp, strerror(errno));
    goto fail;
  }
  st_writer w = {ctx, fd, tmp};
  unsigned char len8[8];
  for (int i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)h.n >> (8 * i));
  MOE_CHECK_GOTO(st_write_all(&w, len8, 8), st, fail);
  MOE_CHECK_GOTO(st_write_all(&w, h.p, h.n), st, fail);
  for (int64_t i = 0; i < n; i++) MOE_CHECK_GOTO(st_write_tensor(&w, &es[i]), st, fail);
  if (fsync(fd) != 0) {
    st = moe_error(ctx, MOE_ERR_IO, "save: fsync of '%s': %s", tmp, strerror(errno));
    goto fail;
  }
  int rc = close(fd);
  fd = -1;
  if (rc != 0) {
    st = moe_error(ctx, MOE_ERR_IO, "save: closing '%s': %s", tmp, strerror(errno));
    goto fail;
  }
  if (rename(tmp, path) != 0) {
    st = moe_error(ctx, MOE_ERR_IO, "save: cannot rename '%s' to '%s': %s", tmp, path, strerror(errno));
    goto fail;
  }
  st_sync_folder(path);
  goto done;
fail:
  if (fd >= 0) close(fd);
  if (tmp && st != MOE_OK) unlink(tmp); /* errno of the failure is already in the message */
done:
  moe_grad_set(ctx, grad_prev);
  free(tmp);
  free(h.p);
  free(es);
  return st;
}

/* ------------------------------------------------------------ async save */

/* The background writer (moe_io.h, moe_safetensors_save_async): everything
 * that needs the context (checks, layout, header) is done by the caller's
 * thread; the writer thread only opens, writes, fsyncs and renames, with
 * its own message buffer, and never touches a moe_ctx or a refcount. */
struct moe_safetensors_writer {
  pthread_t thread;
  bool started, joined;
  atomic_int done;        /* set by the thread as its last act */
  moe_status status;      /* the thread's result, read after the join */
  char msg[512];
  char *path, *tmp;
  sbuf header;
  unsigned char *data;    /* the data buffer: every tensor's bytes, copied by the caller's thread */
  uint64_t nbytes, cap;   /* bytes used, bytes allocated */
  bool pinned;            /* data page-locked (moe_cuda_host_register) for copies from a GPU */
};

static moe_status stw_fail(moe_safetensors_writer *w, moe_status st, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(w->msg, sizeof w->msg, fmt, ap);
  va_end(ap);
  return st;
}

static moe_status stw_write_all(moe_safetensors_writer *w, int fd, const void *buf, size_t n) {
  const char *p = buf;
  while (n > 0) {
    ssize_t r = write(fd, p, n > ST_MAX_IO ? ST_MAX_IO : n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0)
      return stw_fail(w, MOE_ERR_IO, "save_async: writing '%s': %s", w->tmp,
                      r < 0 ? strerror(errno) : "the write made no progress");
    p += r;
    n -= (size_t)r;
  }
  return MOE_OK;
}

static moe_status stw_run(moe_safetensors_writer *w) {
  int fd = open(w->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (fd < 0) return stw_fail(w, MOE_ERR_IO, "save_async: cannot create '%s': %s", w->tmp, strerror(errno));
  unsigned char len8[8];
  for (int i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)w->header.n >> (8 * i));
  moe_status st = stw_write_all(w, fd, len8, 8);
  if (st == MOE_OK) st = stw_write_all(w, fd, w->header.p, w->header.n);
  for (uint64_t at = 0; at < w->nbytes && st == MOE_OK; at += ST_MAX_IO) {
    uint64_t len = w->nbytes - at < ST_MAX_IO ? w->nbytes - at : ST_MAX_IO;
    st = stw_write_all(w, fd, w->data + at, (size_t)len);
  }
  if (st == MOE_OK && fsync(fd) != 0)
    st = stw_fail(w, MOE_ERR_IO, "save_async: fsync of '%s': %s", w->tmp, strerror(errno));
  if (close(fd) != 0 && st == MOE_OK)
    st = stw_fail(w, MOE_ERR_IO, "save_async: closing '%s': %s", w->tmp, strerror(errno));
  if (st == MOE_OK && rename(w->tmp, w->path) != 0)
    st = stw_fail(w, MOE_ERR_IO, "save_async: cannot rename '%s' to '%s': %s", w->tmp, w->path, strerror(errno));
  if (st != MOE_OK) unlink(w->tmp);
  else st_sync_folder(w->path);
  return st;
}

static void *stw_main(void *arg) {
  moe_safetensors_writer *w = arg;
  w->status = stw_run(w);
  atomic_store(&w->done, 1);
  return NULL;
}

void moe_safetensors_writer_free(moe_safetensors_writer *w) {
  if (!w) return;
  if (w->started && !w->joined) pthread_join(w->thread, NULL);
  if (w->pinned) moe_cuda_host_unregister(w->data);
  free(w->data);
  free(w->header.p);
  free(w->path);
  free(w->tmp);
  free(w);
}

moe_status moe_safetensors_save_async(moe_ctx *ctx, const char *path, int64_t n,
                                      const char *const *names, moe_tensor *const *tensors,
                                      int64_t n_meta, const char *const *meta_keys,
                                      const char *const *meta_values, moe_safetensors_writer *reuse,
                                      moe_safetensors_writer **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "save_async: out is NULL");
  *out = NULL;
  MOE_CHECK(st_check_save_args(ctx, path, n, names, tensors, n_meta, meta_keys, meta_values));
  bool on_gpu = false;
  for (int64_t i = 0; i < n; i++) {
    if (!moe_tensor_is_contiguous(tensors[i]))
      return moe_error(ctx, MOE_ERR_INVALID_ARG,
                       "save_async: tensor '%s' must be contiguous (its bytes are copied as they lie)",
                       names[i]);
    if (tensors[i]->storage->device.type != MOE_DEVICE_CPU) on_gpu = true;
  }
  const char *dup = NULL;
  MOE_CHECK(st_find_duplicate(ctx, n, names, &dup));
  if (dup) return moe_error(ctx, MOE_ERR_INVALID_ARG, "save_async: duplicate tensor name '%s'", dup);
  MOE_CHECK(st_find_duplicate(ctx, n_meta, meta_keys, &dup));
  if (dup) return moe_error(ctx, MOE_ERR_INVALID_ARG, "save_async: duplicate metadata key '%s'", dup);

  moe_status st = MOE_OK;
  st_entry *es = calloc(n > 0 ? (size_t)n : 1, sizeof *es);
  moe_safetensors_writer *w = calloc(1, sizeof *w);
  size_t tlen = strlen(path) + 48;
  if (w) {
    w->path = strdup(path);
    w->tmp = malloc(tlen);
  }
  if (!es || !w || !w->path || !w->tmp) {
    st = moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "save_async: out of host memory");
    goto fail;
  }
  atomic_init(&w->done, 0);
  for (int64_t i = 0; i < n; i++) {
    es[i].name = names[i];
    es[i].t = tensors[i];
    es[i].esize = moe_dtype_size(tensors[i]->dtype);
  }
  qsort(es, (size_t)n, sizeof *es, cmp_layout);
  uint64_t pos = 0;
  for (int64_t i = 0; i < n; i++) {
    uint64_t nb = (uint64_t)moe_tensor_numel(es[i].t) * es[i].esize;
    es[i].begin = pos;
    es[i].end = pos + nb;
    pos += nb;
  }
  MOE_CHECK_GOTO(st_build_header(ctx, n, es, n_meta, meta_keys, meta_values, &w->header), st, fail);
  /* the host copy: what the caller waits for; the tensors are free to change afterwards */
  w->nbytes = pos;
  if (reuse && reuse->data && reuse->cap >= pos) { /* the previous buffer: its pages are mapped already */
    if (reuse->started && !reuse->joined) {
      pthread_join(reuse->thread, NULL);
      reuse->joined = true;
    }
    w->data = reuse->data;
    w->cap = reuse->cap;
    w->pinned = reuse->pinned;
    reuse->data = NULL;
    reuse->cap = 0;
    reuse->pinned = false;
  } else {
    void *buf = NULL; /* page-aligned, as page-locking takes whole pages */
    w->data = posix_memalign(&buf, 4096, pos > 0 ? (size_t)pos : 1) == 0 ? buf : NULL;
    w->cap = pos;
  }
  if (!w->data) {
    st = moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "save_async: out of host memory for a %llu-byte copy",
                   (unsigned long long)pos);
    goto fail;
  }
  /* GPU tensors are copied straight into the buffer, page-locked once (kept
   * with the buffer when a later save reuses it): a pageable buffer takes the
   * driver's staged copies; where locking fails (a host limit) it stays
   * pageable */
  if (on_gpu && !w->pinned && w->cap > 0) {
    w->pinned = moe_cuda_host_register(ctx, w->data, (size_t)w->cap) == MOE_OK;
    if (!w->pinned) moe_ctx_clear(ctx);
  }
  for (int64_t i = 0; i < n; i++) {
    if (es[i].end <= es[i].begin) continue;
    moe_device d = es[i].t->storage->device;
    size_t nb = (size_t)(es[i].end - es[i].begin);
    if (d.type == MOE_DEVICE_CPU) memcpy(w->data + es[i].begin, moe_tensor_data(es[i].t), nb);
    else MOE_CHECK_GOTO(moe_cuda_memcpy(ctx, w->data + es[i].begin, MOE_CPU, moe_tensor_data(es[i].t), d, nb),
                        st, fail);
  }
  snprintf(w->tmp, tlen, "%s.tmp.%ld.async", path, (long)getpid());
  int rc = pthread_create(&w->thread, NULL, stw_main, w);
  if (rc != 0) {
    st = moe_error(ctx, MOE_ERR_IO, "save_async: cannot start the writer thread: %s", strerror(rc));
    goto fail;
  }
  w->started = true;
  free(es);
  *out = w;
  return MOE_OK;
fail:
  free(es);
  moe_safetensors_writer_free(w);
  return st;
}

bool moe_safetensors_writer_done(const moe_safetensors_writer *w) {
  return w == NULL || !w->started || atomic_load(&((moe_safetensors_writer *)w)->done) != 0;
}

moe_status moe_safetensors_writer_wait(moe_ctx *ctx, moe_safetensors_writer *w) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!w) return moe_error(ctx, MOE_ERR_INVALID_ARG, "save_async: wait on a NULL writer");
  if (w->started && !w->joined) {
    pthread_join(w->thread, NULL);
    w->joined = true;
  }
  if (w->status != MOE_OK) return moe_error(ctx, w->status, "%s", w->msg);
  return MOE_OK;
}

/* ------------------------------------------------------------------ load */

struct moe_safetensors {
  int64_t n;
  char **names;          /* (n) */
  moe_tensor **tensors;  /* (n) one reference each */
  int64_t n_meta;
  char **meta_keys;      /* (n_meta) */
  char **meta_values;    /* (n_meta) */
};

void moe_safetensors_free(moe_safetensors *f) {
  if (!f) return;
  for (int64_t i = 0; i < f->n; i++) {
    if (f->tensors) moe_tensor_release(f->tensors[i]);
    if (f->names) free(f->names[i]);
  }
  for (int64_t i = 0; i < f->n_meta; i++) {
    if (f->meta_keys) free(f->meta_keys[i]);
    if (f->meta_values) free(f->meta_values[i]);
  }
  free(f->names);
  free(f->tensors);
  free(f->meta_keys);
  free(f->meta_values);
  free(f);
}

int64_t moe_safetensors_count(const moe_safetensors *f) { return f ? f->n : 0; }

const char *moe_safetensors_name(const moe_safetensors *f, int64_t i) {
  return f && i >= 0 && i < f->n ? f->names[i] : NULL;
}

moe_tensor *moe_safetensors_tensor(const moe_safetensors *f, int64_t i) {
  return f && i >= 0 && i < f->n ? f->tensors[i] : NULL;
}

moe_tensor *moe_safetensors_get(const moe_safetensors *f, const char *name) {
  if (!f || !name) return NULL;
  for (int64_t i = 0; i < f->n; i++)
    if (strcmp(f->names[i], name) == 0) return f->tensors[i];
  return NULL;
}

int64_t moe_safetensors_metadata_count(const moe_safetensors *f) { return f ? f->n_meta : 0; }

const char *moe_safetensors_metadata_key(const moe_safetensors *f, int64_t i) {
  return f && i >= 0 && i < f->n_meta ? f->meta_keys[i] : NULL;
}

const char *moe_safetensors_metadata_value(const moe_safetensors *f, int64_t i) {
  return f && i >= 0 && i < f->n_meta ? f->meta_values[i] : NULL;
}

const char *moe_safetensors_metadata_get(const moe_safetensors *f, const char *key) {
  if (!f || !key) return NULL;
  for (int64_t i = 0; i < f->n_meta; i++)
    if (strcmp(f->meta_keys[i], key) == 0) return f->meta_values[i];
  return NULL;
}

/* One header entry, checked. */
typedef struct st_info {
  const char *name; /* borrowed from the JSON tree */
  moe_dtype dtype;
  int ndim;
  int64_t shape[MOE_MAX_DIMS];
  uint64_t begin, end;
} st_info;

typedef struct st_loader {
  moe_ctx *ctx;
  const char *path;
  const char *op; /* "load", "open_safetensors", "read": the messages' first word */
} st_loader;

/* "<op>: '<path>': <message>" with status s. */
#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static moe_status st_lerr(const st_loader *ld, moe_status s, const char *fmt, ...) {
  char msg[768];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  return moe_error(ld->ctx, s, "%s: '%s': %s", ld->op, ld->path, msg);
}

/* What a JSON value is, for messages: "-3", "a string", ... */
static const char *st_describe(const moe_json *v, char *buf, size_t len) {
  if (v->type == MOE_JSON_INT) {
    snprintf(buf, len, "%s%llu", v->negative && v->u ? "-" : "", (unsigned long long)v->u);
    return buf;
  }
  return moe_json_type_name(v->type);
}

static moe_status st_parse_dtype(const st_loader *ld, const char *name, const moe_json *v,
                                 moe_dtype *out) {
  if (v->type != MOE_JSON_STRING)
    return st_lerr(ld, MOE_ERR_IO, "tensor '%s': dtype must be a string, got %s", name,
                   moe_json_type_name(v->type));
  for (int d = 0; d < MOE_DTYPE_COUNT; d++) {
    if (strcmp(v->str, st_dtype_names[d]) == 0) {
      *out = (moe_dtype)d;
      return MOE_OK;
    }
  }
  for (int i = 0; st_foreign_dtypes[i]; i++)
    if (strcmp(v->str, st_foreign_dtypes[i]) == 0)
      return st_lerr(ld, MOE_ERR_NOT_SUPPORTED,
                     "tensor '%s': dtype %s is not supported by moe-lua (supported: %s)", name,
                     v->str, st_supported);
  return st_lerr(ld, MOE_ERR_IO, "tensor '%s': unknown dtype \"%.64s\" (safetensors dtypes moe-lua reads: %s)",
                 name, v->str, st_supported);
}

static moe_status st_parse_entry(const st_loader *ld, const char *name, const moe_json *v,
                                 st_info *info) {
  char b1[64]; /* st_describe's */
  info->name = name;
  if (v->type != MOE_JSON_OBJECT)
    return st_lerr(ld, MOE_ERR_IO, "tensor '%s': the entry must be an object, got %s", name,
                   moe_json_type_name(v->type));
  for (size_t i = 0; i < v->n; i++) {
    const char *k = v->keys[i];
    if (strcmp(k, "dtype") && strcmp(k, "shape") && strcmp(k, "data_offsets"))
      return st_lerr(ld, MOE_ERR_IO, "tensor '%s': unknown field \"%.64s\" (expected dtype, shape, data_offsets)",
                     name, k);
  }
  const moe_json *dt = moe_json_get(v, "dtype"), *sh = moe_json_get(v, "shape"),
                 *off = moe_json_get(v, "data_offsets");
  if (!dt || !sh || !off)
    return st_lerr(ld, MOE_ERR_IO, "tensor '%s': missing field '%s'", name,
                   !dt ? "dtype" : !sh ? "shape" : "data_offsets");
  MOE_CHECK(st_parse_dtype(ld, name, dt, &info->dtype));

  if (sh->type != MOE_JSON_ARRAY)
    return st_lerr(ld, MOE_ERR_IO, "tensor '%s': shape must be a list of non-negative integers, got %s",
                   name, moe_json_type_name(sh->type));
  if (sh->n > MOE_MAX_DIMS)
    return st_lerr(ld, MOE_ERR_NOT_SUPPORTED, "tensor '%s' has %zu dims; moe-lua tensors have at most %d",
                   name, sh->n, MOE_MAX_DIMS);
  /* numel: the product of the non-zero sizes; it bounds the strides, so it
   * must fit even when a 0 makes the tensor empty ([0, 2^62, 4]) */
  uint64_t numel = 1;
  bool overflow = false, empty = false;
  for (size_t d = 0; d < sh->n; d++) {
    const moe_json *s = &sh->items[d];
    if (s->type != MOE_JSON_INT || (s->negative && s->u != 0))
      return st_lerr(ld, MOE_ERR_IO,
                     "tensor '%s': shape must be a list of non-negative integers, but size %zu is %s",
                     name, d, st_describe(s, b1, sizeof b1));
    if (s->u > (uint64_t)INT64_MAX) overflow = true;
    info->shape[d] = (int64_t)s->u;
    if (s->u == 0) empty = true;
    else if (numel > UINT64_MAX / s->u) overflow = true;
    else numel *= s->u;
  }
  info->ndim = (int)sh->n;
  size_t es = moe_dtype_size(info->dtype);
  if (overflow || numel > (uint64_t)INT64_MAX / es)
    return st_lerr(ld, MOE_ERR_IO, "tensor '%s': shape %s is too large", name,
                   MOE_SHAPE_OF(info->ndim, info->shape));
  if (empty) numel = 0;

  bool offsets_ok = off->type == MOE_JSON_ARRAY && off->n == 2;
  for (size_t i = 0; offsets_ok && i < 2; i++)
    offsets_ok = off->items[i].type == MOE_JSON_INT && !(off->items[i].negative && off->items[i].u);
  if (!offsets_ok)
    return st_lerr(ld, MOE_ERR_IO,
                   "tensor '%s': data_offsets must be a list of two non-negative integers [begin, end]",
                   name);
  info->begin = off->items[0].u;
  info->end = off->items[1].u;
  if (info->end < info->begin)
    return st_lerr(ld, MOE_ERR_IO, "tensor '%s': data_offsets [%llu, %llu] end before they begin", name,
                   (unsigned long long)info->begin, (unsigned long long)info->end);
  uint64_t want = numel * es;
  if (info->end - info->begin != want)
    return st_lerr(ld, MOE_ERR_IO,
                   "tensor '%s': data_offsets [%llu, %llu] hold %llu bytes but %s %s needs %llu",
                   name, (unsigned long long)info->begin, (unsigned long long)info->end,
                   (unsigned long long)(info->end - info->begin), st_dtype_names[info->dtype],
                   MOE_SHAPE_OF(info->ndim, info->shape), (unsigned long long)want);
  return MOE_OK;
}

static int cmp_offsets(const void *a, const void *b) {
  const st_info *x = *(const st_info *const *)a, *y = *(const st_info *const *)b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  if (x->end != y->end) return x->end < y->end ? -1 : 1;
  return 0;
}

/* The entries must tile [0, buffer_len) exactly, in some order. */
static moe_status st_check_coverage(const st_loader *ld, size_t n, st_info *infos,
                                    uint64_t buffer_len, uint64_t data_start) {
  if (n == 0) {
    if (buffer_len != 0)
      return st_lerr(ld, MOE_ERR_IO,
                     "%llu bytes of data after a header with no tensors (the data buffer must be covered exactly)",
                     (unsigned long long)buffer_len);
    return MOE_OK;
  }
  const st_info **ord = malloc(n * sizeof *ord);
  if (!ord) return st_lerr(ld, MOE_ERR_OUT_OF_MEMORY, "out of host memory");
  for (size_t i = 0; i < n; i++) ord[i] = &infos[i];
  qsort(ord, n, sizeof *ord, cmp_offsets);
  moe_status st = MOE_OK;
  uint64_t pos = 0;
  const st_info *prev = NULL;
  for (size_t i = 0; i < n && st == MOE_OK; i++) {
    const st_info *e = ord[i];
    if (e->begin < pos)
      st = st_lerr(ld, MOE_ERR_IO, "tensor '%s' (data_offsets [%llu, %llu]) overlaps tensor '%s' ([%llu, %llu])",
                   e->name, (unsigned long long)e->begin, (unsigned long long)e->end, prev->name,
                   (unsigned long long)prev->begin, (unsigned long long)prev->end);
    else if (e->begin > pos)
      st = st_lerr(ld, MOE_ERR_IO,
                   "hole in the data buffer: bytes [%llu, %llu) before tensor '%s' belong to no tensor "
                   "(the buffer must be covered exactly)",
                   (unsigned long long)pos, (unsigned long long)e->begin, e->name);
    else if (e->end > buffer_len)
      st = st_lerr(ld, MOE_ERR_IO,
                   "truncated file: tensor '%s' ends at byte %llu of the data buffer (file byte %llu) "
                   "but the file has only %llu bytes",
                   e->name, (unsigned long long)e->end, (unsigned long long)(data_start + e->end),
                   (unsigned long long)(data_start + buffer_len));
    pos = e->end > pos ? e->end : pos;
    prev = e;
  }
  if (st == MOE_OK && pos < buffer_len)
    st = st_lerr(ld, MOE_ERR_IO,
                 "%llu unused bytes after the last tensor ('%s' ends at byte %llu of the data buffer): "
                 "the buffer must be covered exactly",
                 (unsigned long long)(buffer_len - pos), prev->name, (unsigned long long)pos);
  free(ord);
  return st;
}

static moe_status st_pread_all(const st_loader *ld, int fd, void *buf, size_t n, uint64_t at,
                               const char *what) {
  char *p = buf;
  while (n > 0) {
    ssize_t r = pread(fd, p, n > ST_MAX_IO ? ST_MAX_IO : n, (off_t)at);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return st_lerr(ld, MOE_ERR_IO, "reading %s: %s", what, strerror(errno));
    if (r == 0)
      return st_lerr(ld, MOE_ERR_IO, "truncated file: it ended while reading %s (at file byte %llu)",
                     what, (unsigned long long)at);
    p += r;
    n -= (size_t)r;
    at += (uint64_t)r;
  }
  return MOE_OK;
}

/* Copies the checked header into f (names, metadata strings). */
static moe_status st_fill_names(const st_loader *ld, const moe_json *meta, size_t n,
                                const st_info *infos, moe_safetensors *f) {
  size_t nm = meta ? meta->n : 0;
  f->names = calloc(n ? n : 1, sizeof *f->names);
  f->tensors = calloc(n ? n : 1, sizeof *f->tensors);
  f->meta_keys = calloc(nm ? nm : 1, sizeof *f->meta_keys);
  f->meta_values = calloc(nm ? nm : 1, sizeof *f->meta_values);
  if (!f->names || !f->tensors || !f->meta_keys || !f->meta_values)
    return st_lerr(ld, MOE_ERR_OUT_OF_MEMORY, "out of host memory");
  f->n = (int64_t)n;
  f->n_meta = (int64_t)nm;
  for (size_t i = 0; i < n; i++)
    if (!(f->names[i] = strdup(infos[i].name))) return st_lerr(ld, MOE_ERR_OUT_OF_MEMORY, "out of host memory");
  for (size_t i = 0; i < nm; i++) {
    f->meta_keys[i] = strdup(meta->keys[i]);
    f->meta_values[i] = strdup(meta->items[i].str);
    if (!f->meta_keys[i] || !f->meta_values[i]) return st_lerr(ld, MOE_ERR_OUT_OF_MEMORY, "out of host memory");
  }
  return MOE_OK;
}

/* Reads tensor i into host storage and moves it to d. */
static moe_status st_read_tensor(const st_loader *ld, int fd, uint64_t data_start,
                                 const st_info *e, moe_device d, moe_tensor **out) {
  moe_ctx *ctx = ld->ctx;
  moe_tensor *h = NULL;
  MOE_CHECK(moe_tensor_empty(ctx, e->ndim, e->shape, e->dtype, MOE_CPU, &h));
  size_t nbytes = (size_t)(e->end - e->begin);
  char what[320];
  snprintf(what, sizeof what, "tensor '%.256s'", e->name);
  moe_status st = MOE_OK;
  if (nbytes > 0) MOE_CHECK_GOTO(st_pread_all(ld, fd, moe_tensor_data(h), nbytes, data_start + e->begin, what), st, fail);
  if (e->dtype == MOE_BOOL) {
    unsigned char *b = moe_tensor_data(h);
    for (size_t i = 0; i < nbytes; i++) b[i] = b[i] != 0;
  }
  if (d.type == MOE_DEVICE_CPU) {
    *out = h;
    return MOE_OK;
  }
  moe_tensor *dev = NULL;
  MOE_CHECK_GOTO(moe_to(ctx, h, e->dtype, d, &dev), st, fail);
  moe_tensor_release(h);
  *out = dev;
  return MOE_OK;
fail:
  moe_tensor_release(h);
  return st;
}

/* The checked header of an open file: what moe_safetensors_load and
 * moe_safetensors_open share. Owns header, root and infos (st_header_free). */
typedef struct st_header {
  char *header;
  moe_json *root;
  const moe_json *meta; /* in root, or NULL */
  st_info *infos;       /* (n) names borrowed from root */
  size_t n;
  uint64_t data_start;  /* file byte of the data buffer */
  uint64_t bytes;       /* bytes read: the length and the header */
} st_header;

static void st_header_free(st_header *h) {
  free(h->infos);
  moe_json_free(h->root);
  free(h->header);
  memset(h, 0, sizeof *h);
}

/* Opens ld->path read-only: a regular file; a named pipe does not block the open. */
static moe_status st_open_regular(const st_loader *ld, int *out_fd, uint64_t *out_size) {
  int fd = open(ld->path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return st_lerr(ld, MOE_ERR_IO, "cannot open: %s", strerror(errno));
  moe_status st = MOE_OK;
  struct stat sb;
  int fl;
  if (fstat(fd, &sb) != 0) {
    st = st_lerr(ld, MOE_ERR_IO, "cannot stat: %s", strerror(errno));
  } else if (!S_ISREG(sb.st_mode)) {
    st = st_lerr(ld, MOE_ERR_IO, "not a regular file (%s)",
                 S_ISFIFO(sb.st_mode) ? "a named pipe" : S_ISDIR(sb.st_mode) ? "a folder" : "a device or socket");
  } else if ((fl = fcntl(fd, F_GETFL)) < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
    st = st_lerr(ld, MOE_ERR_IO, "fcntl: %s", strerror(errno));
  }
  if (st != MOE_OK) {
    close(fd);
    return st;
  }
  *out_fd = fd;
  *out_size = (uint64_t)sb.st_size;
  return MOE_OK;
}

/* Reads and checks the length, the header and every entry of the file open
 * at fd (size bytes), and the coverage of its data buffer. */
static moe_status st_read_header(const st_loader *ld, int fd, uint64_t size, st_header *h) {
  memset(h, 0, sizeof *h);
  moe_status st = MOE_OK;
  if (size < 8)
    return st_lerr(ld, MOE_ERR_IO,
                   "the file is %llu bytes, shorter than the 8-byte header length: not a safetensors file",
                   (unsigned long long)size);
  unsigned char len8[8];
  MOE_CHECK(st_pread_all(ld, fd, len8, 8, 0, "the header length"));
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | len8[i];
  if (hlen > ST_MAX_HEADER)
    return st_lerr(ld, MOE_ERR_IO,
                   "header length %llu is absurd (more than %llu bytes): not a safetensors file, or a corrupted one",
                   (unsigned long long)hlen, ST_MAX_HEADER);
  if (8 + hlen > size)
    return st_lerr(ld, MOE_ERR_IO,
                   "header length %llu runs past the end of the file (%llu bytes): a truncated file or not a safetensors file",
                   (unsigned long long)hlen, (unsigned long long)size);
  h->header = malloc(hlen ? hlen : 1);
  if (!h->header)
    return st_lerr(ld, MOE_ERR_OUT_OF_MEMORY, "out of host memory for a %llu-byte header", (unsigned long long)hlen);
  MOE_CHECK_GOTO(st_pread_all(ld, fd, h->header, hlen, 8, "the header"), st, fail);
  h->bytes = 8 + hlen;
  char jerr[256];
  size_t jat = 0;
  if (!moe_json_parse_limited(h->header, hlen, ST_MAX_LIST, &h->root, &jat, jerr, sizeof jerr)) {
    st = st_lerr(ld, MOE_ERR_IO, "invalid JSON in the header at byte %zu (file byte %llu): %s", jat,
                 (unsigned long long)(8 + jat), jerr);
    goto fail;
  }
  const moe_json *root = h->root;
  if (root->type != MOE_JSON_OBJECT) {
    st = st_lerr(ld, MOE_ERR_IO, "the header must be a JSON object, got %s", moe_json_type_name(root->type));
    goto fail;
  }
  const moe_json *meta = moe_json_get(root, "__metadata__");
  if (meta) {
    if (meta->type != MOE_JSON_OBJECT) {
      st = st_lerr(ld, MOE_ERR_IO, "__metadata__ must be an object of strings, got %s",
                   moe_json_type_name(meta->type));
      goto fail;
    }
    for (size_t i = 0; i < meta->n; i++) {
      if (meta->items[i].type != MOE_JSON_STRING) {
        st = st_lerr(ld, MOE_ERR_IO, "__metadata__ values must be strings, but \"%.64s\" is %s", meta->keys[i],
                     moe_json_type_name(meta->items[i].type));
        goto fail;
      }
    }
  }
  h->meta = meta;
  h->n = root->n - (meta ? 1 : 0);
  h->infos = calloc(h->n ? h->n : 1, sizeof *h->infos);
  if (!h->infos) {
    st = st_lerr(ld, MOE_ERR_OUT_OF_MEMORY, "out of host memory");
    goto fail;
  }
  for (size_t i = 0, k = 0; i < root->n; i++) {
    if (&root->items[i] == meta) continue;
    MOE_CHECK_GOTO(st_parse_entry(ld, root->keys[i], &root->items[i], &h->infos[k]), st, fail);
    k++;
  }
  h->data_start = 8 + hlen;
  MOE_CHECK_GOTO(st_check_coverage(ld, h->n, h->infos, size - h->data_start, h->data_start), st, fail);
  return MOE_OK;
fail:
  st_header_free(h);
  return st;
}

/* What load and open begin with: the path and out checked, the file opened (a
 * regular file) and its header read and checked. On an error nothing is left
 * open or allocated. */
static moe_status st_begin(st_loader *ld, const void *out, int *fd, st_header *h) {
  const char *path = ld->path;
  if (!path || !path[0])
    return moe_error(ld->ctx, MOE_ERR_INVALID_ARG, "%s: path is %s", ld->op, path ? "empty" : "NULL");
  if (!out) return moe_error(ld->ctx, MOE_ERR_INVALID_ARG, "%s: out is NULL", ld->op);
  if (!host_is_little_endian())
    return st_lerr(ld, MOE_ERR_NOT_SUPPORTED, "safetensors files are little-endian and this host is not");
  uint64_t size = 0;
  MOE_CHECK(st_open_regular(ld, fd, &size));
  moe_status st = st_read_header(ld, *fd, size, h);
  if (st != MOE_OK) {
    close(*fd);
    *fd = -1;
  }
  return st;
}

moe_status moe_safetensors_load(moe_ctx *ctx, const char *path, moe_device d,
                                moe_safetensors **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  MOE_CHECK(moe_device_check(ctx, d));
  st_loader ld = {ctx, path, "load"};
  int fd = -1;
  st_header h;
  moe_status st = st_begin(&ld, out, &fd, &h);
  if (st != MOE_OK) return st;
  moe_safetensors *f = calloc(1, sizeof *f);
  if (!f) {
    st = st_lerr(&ld, MOE_ERR_OUT_OF_MEMORY, "out of host memory");
    goto done;
  }
  MOE_CHECK_GOTO(st_fill_names(&ld, h.meta, h.n, h.infos, f), st, done);
  for (size_t i = 0; i < h.n; i++)
    MOE_CHECK_GOTO(st_read_tensor(&ld, fd, h.data_start, &h.infos[i], d, &f->tensors[i]), st, done);

done:
  if (st == MOE_OK) *out = f;
  else moe_safetensors_free(f);
  st_header_free(&h);
  close(fd);
  return st;
}

/* ---------------------------------------------------------------- reader */

struct moe_safetensors_reader {
  int fd;             /* open while the reader lives */
  char *path;
  int64_t n;
  st_info *infos;     /* (n) checked entries; names point into names */
  char **names;       /* (n) */
  int64_t n_meta;
  char **meta_keys;   /* (n_meta) */
  char **meta_values; /* (n_meta) */
  uint64_t data_start;
  uint64_t bytes, reads; /* read so far: bytes, pread calls */
};

void moe_safetensors_reader_free(moe_safetensors_reader *r) {
  if (!r) return;
  if (r->fd >= 0) close(r->fd);
  for (int64_t i = 0; i < r->n; i++)
    if (r->names) free(r->names[i]);
  for (int64_t i = 0; i < r->n_meta; i++) {
    if (r->meta_keys) free(r->meta_keys[i]);
    if (r->meta_values) free(r->meta_values[i]);
  }
  free(r->names);
  free(r->infos);
  free(r->meta_keys);
  free(r->meta_values);
  free(r->path);
  free(r);
}

moe_status moe_safetensors_open(moe_ctx *ctx, const char *path, moe_safetensors_reader **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  st_loader ld = {ctx, path, "open_safetensors"};
  int fd = -1;
  st_header h;
  moe_status st = st_begin(&ld, out, &fd, &h);
  if (st != MOE_OK) return st;
  moe_safetensors_reader *r = calloc(1, sizeof *r);
  if (!r) {
    close(fd);
    st_header_free(&h);
    return st_lerr(&ld, MOE_ERR_OUT_OF_MEMORY, "out of host memory");
  }
  r->fd = fd;
  size_t nm = h.meta ? h.meta->n : 0;
  r->path = strdup(path);
  r->infos = calloc(h.n ? h.n : 1, sizeof *r->infos);
  r->names = calloc(h.n ? h.n : 1, sizeof *r->names);
  r->meta_keys = calloc(nm ? nm : 1, sizeof *r->meta_keys);
  r->meta_values = calloc(nm ? nm : 1, sizeof *r->meta_values);
  if (!r->path || !r->infos || !r->names || !r->meta_keys || !r->meta_values) goto oom;
  r->n = (int64_t)h.n;
  r->n_meta = (int64_t)nm;
  for (size_t i = 0; i < h.n; i++) {
    r->infos[i] = h.infos[i];
    if (!(r->names[i] = strdup(h.infos[i].name))) goto oom;
    r->infos[i].name = r->names[i];
  }
  for (size_t i = 0; i < nm; i++) {
    r->meta_keys[i] = strdup(h.meta->keys[i]);
    r->meta_values[i] = strdup(h.meta->items[i].str);
    if (!r->meta_keys[i] || !r->meta_values[i]) goto oom;
  }
  r->data_start = h.data_start;
  r->bytes = h.bytes;
  r->reads = 2;
  st_header_free(&h);
  *out = r;
  return MOE_OK;
oom:
  st_header_free(&h);
  moe_safetensors_reader_free(r);
  return st_lerr(&ld, MOE_ERR_OUT_OF_MEMORY, "out of host memory");
}

int64_t moe_safetensors_reader_count(const moe_safetensors_reader *r) { return r ? r->n : 0; }

const char *moe_safetensors_reader_name(const moe_safetensors_reader *r, int64_t i) {
  return r && i >= 0 && i < r->n ? r->names[i] : NULL;
}

int64_t moe_safetensors_reader_find(const moe_safetensors_reader *r, const char *name) {
  if (!r || !name) return -1;
  for (int64_t i = 0; i < r->n; i++)
    if (strcmp(r->names[i], name) == 0) return i;
  return -1;
}

bool moe_safetensors_reader_entry(const moe_safetensors_reader *r, int64_t i, moe_dtype *dtype, int *ndim,
                                  int64_t *shape, uint64_t *file_begin, uint64_t *file_end) {
  if (!r || i < 0 || i >= r->n) return false;
  const st_info *e = &r->infos[i];
  if (dtype) *dtype = e->dtype;
  if (ndim) *ndim = e->ndim;
  if (shape)
    for (int d = 0; d < e->ndim; d++) shape[d] = e->shape[d];
  if (file_begin) *file_begin = r->data_start + e->begin;
  if (file_end) *file_end = r->data_start + e->end;
  return true;
}

int64_t moe_safetensors_reader_metadata_count(const moe_safetensors_reader *r) { return r ? r->n_meta : 0; }

const char *moe_safetensors_reader_metadata_key(const moe_safetensors_reader *r, int64_t i) {
  return r && i >= 0 && i < r->n_meta ? r->meta_keys[i] : NULL;
}

const char *moe_safetensors_reader_metadata_value(const moe_safetensors_reader *r, int64_t i) {
  return r && i >= 0 && i < r->n_meta ? r->meta_values[i] : NULL;
}

uint64_t moe_safetensors_reader_bytes(const moe_safetensors_reader *r, uint64_t *reads) {
  if (reads) *reads = r ? r->reads : 0;
  return r ? r->bytes : 0;
}

moe_status moe_safetensors_read_box(moe_ctx *ctx, moe_safetensors_reader *r, int64_t i, int64_t base, int ndim,
                                    const int64_t *shape, const int64_t *offsets, const int64_t *sizes,
                                    moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!r) return moe_error(ctx, MOE_ERR_INVALID_ARG, "read: reader is NULL");
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "read: out is NULL");
  if (i < 0 || i >= r->n)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "read: '%s': entry %lld out of range [0, %lld)", r->path,
                     (long long)i, (long long)r->n);
  st_loader ld = {ctx, r->path, "read"};
  const st_info *e = &r->infos[i];
  int64_t vshape[MOE_MAX_DIMS] = {0}, off[MOE_MAX_DIMS] = {0}, sz[MOE_MAX_DIMS] = {0};
  if (shape == NULL) {
    if (base != 0)
      return st_lerr(&ld, MOE_ERR_INVALID_ARG, "tensor '%s': base %lld without a view shape (base needs one)",
                     e->name, (long long)base);
    ndim = e->ndim;
    for (int d = 0; d < ndim; d++) vshape[d] = e->shape[d];
  } else {
    if (ndim < 0 || ndim > MOE_MAX_DIMS)
      return st_lerr(&ld, MOE_ERR_INVALID_ARG, "tensor '%s': a view of %d dims (0 to %d)", e->name, ndim,
                     MOE_MAX_DIMS);
    for (int d = 0; d < ndim; d++) vshape[d] = shape[d];
  }
  /* the view must lie inside the stored elements */
  uint64_t stored = 1, view = 1;
  for (int d = 0; d < e->ndim; d++) stored *= (uint64_t)e->shape[d];
  for (int d = 0; d < ndim; d++) {
    if (vshape[d] < 0 || (vshape[d] > 0 && view > (uint64_t)INT64_MAX / (uint64_t)vshape[d]))
      return st_lerr(&ld, MOE_ERR_INVALID_ARG, "tensor '%s': bad view shape %s", e->name,
                     MOE_SHAPE_OF(ndim, vshape));
    view *= (uint64_t)vshape[d];
  }
  if (base < 0 || (uint64_t)base > stored || view > stored - (uint64_t)base)
    return st_lerr(&ld, MOE_ERR_INVALID_ARG,
                   "tensor '%s' %s has %llu elements: a view %s at element %lld does not fit", e->name,
                   MOE_SHAPE_OF(e->ndim, e->shape), (unsigned long long)stored, MOE_SHAPE_OF(ndim, vshape),
                   (long long)base);
  for (int d = 0; d < ndim; d++) {
    off[d] = offsets ? offsets[d] : 0;
    sz[d] = sizes ? sizes[d] : vshape[d];
    if (off[d] < 0 || sz[d] < 0 || off[d] > vshape[d] || sz[d] > vshape[d] - off[d])
      return st_lerr(&ld, MOE_ERR_INVALID_ARG,
                     "tensor '%s': box at %s of sizes %s is outside %s (dim %d)", e->name,
                     MOE_SHAPE_OF(ndim, off), MOE_SHAPE_OF(ndim, sz), MOE_SHAPE_OF(ndim, vshape), d);
  }
  moe_tensor *t = NULL;
  MOE_CHECK(moe_tensor_empty(ctx, ndim, sz, e->dtype, MOE_CPU, &t));
  int64_t numel = 1;
  for (int d = 0; d < ndim; d++) numel *= sz[d];
  if (numel == 0) {
    *out = t;
    return MOE_OK;
  }
  /* the box in runs contiguous in the file: dims j.. (dim j in part, the
   * ones after it whole); one pread per run, over the indices of dims < j */
  size_t es = moe_dtype_size(e->dtype);
  int64_t stride[MOE_MAX_DIMS], idx[MOE_MAX_DIMS] = {0};
  int64_t s = 1;
  for (int d = ndim - 1; d >= 0; d--) {
    stride[d] = s;
    s *= vshape[d];
  }
  int j = ndim > 0 ? ndim - 1 : 0;
  int64_t run = ndim > 0 ? sz[j] : 1;
  while (j > 0 && sz[j] == vshape[j]) {
    j--;
    run *= sz[j];
  }
  char what[320];
  snprintf(what, sizeof what, "tensor '%.256s'", e->name);
  char *dst = moe_tensor_data(t);
  size_t run_bytes = (size_t)run * es;
  moe_status st = MOE_OK;
  for (;;) {
    int64_t el = base;
    for (int d = 0; d < ndim; d++) el += (off[d] + (d < j ? idx[d] : 0)) * stride[d];
    MOE_CHECK_GOTO(st_pread_all(&ld, r->fd, dst, run_bytes, r->data_start + e->begin + (uint64_t)el * es, what), st,
                   fail);
    r->bytes += run_bytes;
    r->reads++;
    dst += run_bytes;
    int d = j - 1;
    while (d >= 0 && ++idx[d] == sz[d]) idx[d--] = 0;
    if (d < 0) break;
  }
  if (e->dtype == MOE_BOOL) {
    unsigned char *b = moe_tensor_data(t);
    for (int64_t k = 0; k < numel; k++) b[k] = b[k] != 0;
  }
  *out = t;
  return MOE_OK;
fail:
  moe_tensor_release(t);
  return st;
}
