/*
 * dataset.c - Megatron-LM indexed datasets (moe_data.h): the mmap'd reader
 * of prefix.bin/.idx and the streaming writer.
 *
 * The reader maps prefix.idx only while it validates and copies the sizes
 * (as token offsets), pointers and document indices into owned arrays (the
 * .idx arrays are not 8-byte aligned in the file), then keeps prefix.bin
 * mapped read-only for the dataset's life. Every count, size, pointer and
 * document index is checked against the file lengths at open, so reads
 * later need no checks beyond the caller's indices. Little-endian hosts.
 *
 * The writer streams tokens into "prefix.bin.tmp-<pid>" and writes
 * "prefix.idx.tmp-<pid>"; finalize fsyncs both and renames them over
 * prefix.bin and prefix.idx, so a reader that has the old prefix.bin mapped
 * keeps reading the old file's contents (its inode lives on) instead of
 * dying of SIGBUS on a truncated mapping.
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"
#include "moe_data.h"

#define DS_MAGIC "MMIDIDX\0\0"
#define DS_MAGIC_LEN 9
#define DS_HEADER 34 /* magic 9 + version 8 + dtype 1 + counts 8 + 8 */
#define DS_MAX_VOCAB ((int64_t)1 << 26) /* unigram counts: token ids below this */

struct moe_indexed_dataset {
  char *bin_path;      /* prefix.bin */
  const uint8_t *bin;  /* the mapping; NULL when the file is empty */
  size_t bin_len;
  moe_index_dtype dtype;
  int64_t itemsize;
  int64_t n;           /* sequences */
  int64_t c;           /* document indices (documents + 1) */
  int64_t *cum;        /* (n + 1) token offset of each sequence in the stream */
  int64_t *ptr;        /* (n) byte offset of each sequence in prefix.bin */
  int64_t *doc;        /* (c) first sequence of each document, then n */
};

/* ------------------------------------------------------------ dtypes */

static const struct {
  const char *name;
  moe_index_dtype code;
  int64_t size;
} ds_dtypes[] = {{"u8", MOE_INDEX_U8, 1},   {"i8", MOE_INDEX_I8, 1},   {"i16", MOE_INDEX_I16, 2},
                 {"i32", MOE_INDEX_I32, 4}, {"i64", MOE_INDEX_I64, 8}, {"f64", MOE_INDEX_F64, 8},
                 {"f32", MOE_INDEX_F32, 4}, {"u16", MOE_INDEX_U16, 2}};
#define DS_NDTYPES ((int)(sizeof ds_dtypes / sizeof ds_dtypes[0]))

bool moe_index_dtype_parse(const char *name, moe_index_dtype *out) {
  for (int i = 0; name && i < DS_NDTYPES; i++)
    if (strcmp(name, ds_dtypes[i].name) == 0 && ds_dtypes[i].code != MOE_INDEX_F32 &&
        ds_dtypes[i].code != MOE_INDEX_F64) {
      *out = ds_dtypes[i].code;
      return true;
    }
  return false;
}

const char *moe_index_dtype_name(moe_index_dtype code) {
  for (int i = 0; i < DS_NDTYPES; i++)
    if (ds_dtypes[i].code == code) return ds_dtypes[i].name;
  return NULL;
}

static int64_t ds_itemsize(moe_index_dtype code) {
  for (int i = 0; i < DS_NDTYPES; i++)
    if (ds_dtypes[i].code == code) return ds_dtypes[i].size;
  return 0;
}

static int64_t ds_token(const uint8_t *p, moe_index_dtype code) {
  switch (code) {
  case MOE_INDEX_U8: return p[0];
  case MOE_INDEX_I8: return (int8_t)p[0];
  case MOE_INDEX_I16: { int16_t v; memcpy(&v, p, 2); return v; }
  case MOE_INDEX_U16: { uint16_t v; memcpy(&v, p, 2); return v; }
  case MOE_INDEX_I32: { int32_t v; memcpy(&v, p, 4); return v; }
  default: { int64_t v; memcpy(&v, p, 8); return v; }
  }
}

static bool ds_fits(int64_t v, moe_index_dtype code) {
  switch (code) {
  case MOE_INDEX_U8: return v >= 0 && v <= 255;
  case MOE_INDEX_I8: return v >= -128 && v <= 127;
  case MOE_INDEX_I16: return v >= -32768 && v <= 32767;
  case MOE_INDEX_U16: return v >= 0 && v <= 65535;
  case MOE_INDEX_I32: return v >= INT32_MIN && v <= INT32_MAX;
  default: return true;
  }
}

static void ds_put(uint8_t *p, int64_t v, moe_index_dtype code) {
  switch (code) {
  case MOE_INDEX_U8: case MOE_INDEX_I8: p[0] = (uint8_t)v; break;
  case MOE_INDEX_I16: case MOE_INDEX_U16: { uint16_t u = (uint16_t)v; memcpy(p, &u, 2); break; }
  case MOE_INDEX_I32: { int32_t u = (int32_t)v; memcpy(p, &u, 4); break; }
  default: memcpy(p, &v, 8); break;
  }
}

static char *ds_path(const char *prefix, const char *ext) {
  size_t a = strlen(prefix), b = strlen(ext);
  char *p = (char *)malloc(a + b + 1);
  if (!p) return NULL;
  memcpy(p, prefix, a);
  memcpy(p + a, ext, b + 1);
  return p;
}

/* ------------------------------------------------------------ reader */

/* Maps a whole file read-only; *len 0 gives *map NULL. */
static moe_status ds_map(moe_ctx *ctx, const char *path, const uint8_t **map, size_t *len) {
  *map = NULL;
  *len = 0;
  /* O_NONBLOCK: a named pipe with no writer must not block the open */
  int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0)
    return moe_error(ctx, MOE_ERR_IO, "indexed dataset: cannot open %s: %s", path, strerror(errno));
  struct stat sb;
  if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
    bool fifo = S_ISFIFO(sb.st_mode), dir = S_ISDIR(sb.st_mode);
    close(fd);
    return moe_error(ctx, MOE_ERR_IO, "indexed dataset: %s is not a regular file%s", path,
                     fifo ? " (a named pipe)" : dir ? " (a folder)" : "");
  }
  if (sb.st_size > 0) {
    void *m = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      int e = errno;
      close(fd);
      return moe_error(ctx, MOE_ERR_IO, "indexed dataset: cannot map %s: %s", path, strerror(e));
    }
    *map = (const uint8_t *)m;
    *len = (size_t)sb.st_size;
  }
  close(fd);
  return MOE_OK;
}

static uint64_t ds_u64(const uint8_t *p) {
  uint64_t v;
  memcpy(&v, p, 8);
  return v;
}

/* Validates the mapped index and fills ds's arrays. */
static moe_status ds_parse_index(moe_ctx *ctx, moe_indexed_dataset *ds, const char *path,
                                 const uint8_t *m, size_t len) {
  if (len < DS_HEADER)
    return moe_error(ctx, MOE_ERR_IO,
                     "indexed dataset: %s is truncated: %zu bytes, the header needs %d", path, len,
                     DS_HEADER);
  if (memcmp(m, DS_MAGIC, DS_MAGIC_LEN) != 0)
    return moe_error(ctx, MOE_ERR_IO,
                     "indexed dataset: %s is not a Megatron MMIDIDX index (bad magic)", path);
  uint64_t version = ds_u64(m + 9);
  if (version != 1)
    return moe_error(ctx, MOE_ERR_IO, "indexed dataset: %s has version %llu, expected 1", path,
                     (unsigned long long)version);
  uint8_t code = m[17];
  ds->itemsize = ds_itemsize((moe_index_dtype)code);
  if (ds->itemsize == 0)
    return moe_error(ctx, MOE_ERR_IO, "indexed dataset: %s has unknown dtype code %u", path,
                     (unsigned)code);
  if (code == MOE_INDEX_F32 || code == MOE_INDEX_F64)
    return moe_error(ctx, MOE_ERR_IO,
                     "indexed dataset: %s holds %s values; token ids must be integers", path,
                     moe_index_dtype_name((moe_index_dtype)code));
  ds->dtype = (moe_index_dtype)code;
  uint64_t n = ds_u64(m + 18), c = ds_u64(m + 26);
  uint64_t room = (uint64_t)(len - DS_HEADER);
  if (n > room / 12 || c > (room - 12 * n) / 8)
    return moe_error(ctx, MOE_ERR_IO,
                     "indexed dataset: %s is truncated or corrupt: %llu sequences and %llu "
                     "document indices need more than its %zu bytes",
                     path, (unsigned long long)n, (unsigned long long)c, len);
  uint64_t need = DS_HEADER + 12 * n + 8 * c;
  if (len != need && len != need + n)
    return moe_error(ctx, MOE_ERR_IO,
                     "indexed dataset: %s has %zu bytes; %llu sequences and %llu document "
                     "indices need %llu (or %llu with modes)",
                     path, len, (unsigned long long)n, (unsigned long long)c,
                     (unsigned long long)need, (unsigned long long)(need + n));
  if (c < 1)
    return moe_error(ctx, MOE_ERR_IO, "indexed dataset: %s has no document index (count 0)", path);
  ds->n = (int64_t)n;
  ds->c = (int64_t)c;
  ds->cum = (int64_t *)malloc(sizeof(int64_t) * (n + 1));
  ds->ptr = (int64_t *)malloc(sizeof(int64_t) * (n > 0 ? n : 1));
  ds->doc = (int64_t *)malloc(sizeof(int64_t) * c);
  if (!ds->cum || !ds->ptr || !ds->doc)
    return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "indexed dataset: no memory for the index of %s",
                     path);
  const uint8_t *sizes = m + DS_HEADER, *ptrs = sizes + 4 * n, *docs = ptrs + 8 * n;
  ds->cum[0] = 0;
  uint64_t prev_end = 0, prev_seq = 0; /* end of the last non-empty sequence, its index */
  bool any = false;
  for (uint64_t i = 0; i < n; i++) {
    int32_t sz;
    int64_t p;
    memcpy(&sz, sizes + 4 * i, 4);
    memcpy(&p, ptrs + 8 * i, 8);
    if (sz < 0)
      return moe_error(ctx, MOE_ERR_IO, "indexed dataset: %s: sequence %llu has negative size %d",
                       path, (unsigned long long)i, (int)sz);
    if (p < 0 || (uint64_t)p > ds->bin_len || (uint64_t)sz * (uint64_t)ds->itemsize >
                                                   ds->bin_len - (uint64_t)p ||
        p % ds->itemsize != 0)
      return moe_error(ctx, MOE_ERR_IO,
                       "indexed dataset: %s: sequence %llu (%d tokens at byte %lld) lies outside %s "
                       "(%zu bytes): truncated or corrupt",
                       path, (unsigned long long)i, (int)sz, (long long)p, ds->bin_path, ds->bin_len);
    if (sz > 0) { /* non-empty sequences lie in file order without overlapping */
      if (any && (uint64_t)p < prev_end)
        return moe_error(ctx, MOE_ERR_IO,
                         "indexed dataset: %s: sequence %llu (bytes [%lld, %lld) of %s) starts "
                         "before sequence %llu ends (byte %llu): sequences overlap or are out of "
                         "order; corrupt index",
                         path, (unsigned long long)i, (long long)p,
                         (long long)(p + (int64_t)sz * ds->itemsize), ds->bin_path,
                         (unsigned long long)prev_seq, (unsigned long long)prev_end);
      prev_end = (uint64_t)p + (uint64_t)sz * (uint64_t)ds->itemsize;
      prev_seq = i;
      any = true;
    }
    ds->ptr[i] = p;
    ds->cum[i + 1] = ds->cum[i] + sz;
  }
  for (uint64_t d = 0; d < c; d++) {
    int64_t v;
    memcpy(&v, docs + 8 * d, 8);
    int64_t prev = d == 0 ? 0 : ds->doc[d - 1];
    if ((d == 0 && v != 0) || v < prev || v > (int64_t)n || (d == c - 1 && v != (int64_t)n))
      return moe_error(ctx, MOE_ERR_IO,
                       "indexed dataset: %s: document index %llu is %lld (must start at 0, not "
                       "decrease and end at %llu)",
                       path, (unsigned long long)d, (long long)v, (unsigned long long)n);
    ds->doc[d] = v;
  }
  return MOE_OK;
}

moe_status moe_indexed_dataset_open(moe_ctx *ctx, const char *prefix, moe_indexed_dataset **out) {
  *out = NULL;
  if (!prefix || !prefix[0])
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "indexed dataset: empty path prefix");
  moe_indexed_dataset *ds = (moe_indexed_dataset *)calloc(1, sizeof *ds);
  char *idx_path = ds_path(prefix, ".idx");
  if (ds) ds->bin_path = ds_path(prefix, ".bin");
  if (!ds || !idx_path || !ds->bin_path) {
    free(idx_path);
    moe_indexed_dataset_close(ds);
    return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "indexed dataset: out of memory");
  }
  const uint8_t *idx = NULL;
  size_t idx_len = 0;
  moe_status st = ds_map(ctx, ds->bin_path, &ds->bin, &ds->bin_len);
  if (st == MOE_OK) st = ds_map(ctx, idx_path, &idx, &idx_len);
  if (st == MOE_OK) st = ds_parse_index(ctx, ds, idx_path, idx, idx_len);
  if (idx) munmap((void *)idx, idx_len);
  free(idx_path);
  if (st != MOE_OK) {
    moe_indexed_dataset_close(ds);
    return st;
  }
  *out = ds;
  return MOE_OK;
}

void moe_indexed_dataset_close(moe_indexed_dataset *ds) {
  if (!ds) return;
  if (ds->bin) munmap((void *)ds->bin, ds->bin_len);
  free(ds->bin_path);
  free(ds->cum);
  free(ds->ptr);
  free(ds->doc);
  free(ds);
}

int64_t moe_indexed_dataset_num_sequences(const moe_indexed_dataset *ds) { return ds->n; }
int64_t moe_indexed_dataset_num_documents(const moe_indexed_dataset *ds) { return ds->c - 1; }
int64_t moe_indexed_dataset_num_tokens(const moe_indexed_dataset *ds) { return ds->cum[ds->n]; }
moe_index_dtype moe_indexed_dataset_dtype(const moe_indexed_dataset *ds) { return ds->dtype; }
int64_t moe_indexed_dataset_size(const moe_indexed_dataset *ds, int64_t i) {
  return ds->cum[i + 1] - ds->cum[i];
}
int64_t moe_indexed_dataset_token_offset(const moe_indexed_dataset *ds, int64_t i) {
  return ds->cum[i];
}
int64_t moe_indexed_dataset_document_start(const moe_indexed_dataset *ds, int64_t d) {
  return ds->doc[d];
}

moe_status moe_indexed_dataset_get(moe_ctx *ctx, const moe_indexed_dataset *ds, int64_t i,
                                   int64_t offset, int64_t length, moe_tensor **out) {
  *out = NULL;
  if (i < 0 || i >= ds->n)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "indexed dataset get: sequence %lld out of range [0, %lld)", (long long)i,
                     (long long)ds->n);
  int64_t size = ds->cum[i + 1] - ds->cum[i];
  if (length < 0) length = size - offset;
  if (offset < 0 || offset > size || length < 0 || length > size - offset)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "indexed dataset get: tokens [%lld, %lld) outside sequence %lld of %lld "
                     "tokens",
                     (long long)offset, (long long)(offset + length), (long long)i,
                     (long long)size);
  MOE_CHECK(moe_tensor_empty(ctx, 1, (int64_t[]){length}, MOE_I64, MOE_CPU, out));
  int64_t *dst = (int64_t *)moe_tensor_data(*out);
  const uint8_t *src = ds->bin + ds->ptr[i] + offset * ds->itemsize;
  for (int64_t k = 0; k < length; k++) dst[k] = ds_token(src + k * ds->itemsize, ds->dtype);
  return MOE_OK;
}

/* Largest j in [lo, hi) with cum[j] <= pos (cum ascending). */
static int64_t ds_find(const int64_t *cum, int64_t lo, int64_t hi, int64_t pos) {
  while (hi - lo > 1) {
    int64_t mid = lo + (hi - lo) / 2;
    if (cum[mid] <= pos) lo = mid;
    else hi = mid;
  }
  return lo;
}

static moe_status ds_check_range(moe_ctx *ctx, const char *fn, const moe_indexed_dataset *ds,
                                 int64_t seq_begin, int64_t seq_end) {
  if (seq_begin < 0 || seq_end < seq_begin || seq_end > ds->n)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "%s: sequences [%lld, %lld) outside [0, %lld)", fn, (long long)seq_begin,
                     (long long)seq_end, (long long)ds->n);
  return MOE_OK;
}

moe_status moe_indexed_dataset_windows(moe_ctx *ctx, const moe_indexed_dataset *ds,
                                       int64_t seq_begin, int64_t seq_end, const int64_t *starts,
                                       int64_t B, int64_t len, moe_tensor **out) {
  const char *fn = "indexed dataset windows";
  *out = NULL;
  MOE_CHECK(ds_check_range(ctx, fn, ds, seq_begin, seq_end));
  int64_t total = ds->cum[seq_end] - ds->cum[seq_begin];
  if (B < 0 || len < 0)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: negative batch %lld or length %lld", fn,
                     (long long)B, (long long)len);
  for (int64_t b = 0; b < B; b++)
    if (starts[b] < 0 || starts[b] > total - len)
      return moe_error(ctx, MOE_ERR_INVALID_ARG,
                       "%s: window %lld [%lld, %lld) outside the stream of %lld tokens", fn,
                       (long long)b, (long long)starts[b], (long long)(starts[b] + len),
                       (long long)total);
  MOE_CHECK(moe_tensor_empty(ctx, 2, (int64_t[]){B, len}, MOE_I64, MOE_CPU, out));
  int64_t *dst = (int64_t *)moe_tensor_data(*out);
  for (int64_t b = 0; b < B; b++) {
    int64_t pos = ds->cum[seq_begin] + starts[b];
    int64_t j = len > 0 ? ds_find(ds->cum, seq_begin, seq_end, pos) : seq_begin;
    for (int64_t k = 0; k < len; k++, pos++) {
      while (pos >= ds->cum[j + 1]) j++; /* skips empty sequences too */
      dst[b * len + k] =
          ds_token(ds->bin + ds->ptr[j] + (pos - ds->cum[j]) * ds->itemsize, ds->dtype);
    }
  }
  return MOE_OK;
}

moe_status moe_indexed_dataset_unigram_entropy(moe_ctx *ctx, const moe_indexed_dataset *ds,
                                               int64_t seq_begin, int64_t seq_end, double *out) {
  const char *fn = "unigram_entropy";
  MOE_CHECK(ds_check_range(ctx, fn, ds, seq_begin, seq_end));
  int64_t total = ds->cum[seq_end] - ds->cum[seq_begin], vmax = -1;
  if (total == 0) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: no tokens", fn);
  for (int64_t j = seq_begin; j < seq_end; j++)
    for (int64_t k = 0; k < ds->cum[j + 1] - ds->cum[j]; k++) {
      int64_t v = ds_token(ds->bin + ds->ptr[j] + k * ds->itemsize, ds->dtype);
      if (v < 0 || v >= DS_MAX_VOCAB)
        return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: token id %lld outside [0, %lld)", fn,
                         (long long)v, (long long)DS_MAX_VOCAB);
      if (v > vmax) vmax = v;
    }
  int64_t *counts = (int64_t *)calloc((size_t)vmax + 1, sizeof(int64_t));
  if (!counts) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
  for (int64_t j = seq_begin; j < seq_end; j++)
    for (int64_t k = 0; k < ds->cum[j + 1] - ds->cum[j]; k++)
      counts[ds_token(ds->bin + ds->ptr[j] + k * ds->itemsize, ds->dtype)]++;
  double h = 0;
  for (int64_t v = 0; v <= vmax; v++)
    if (counts[v] > 0) {
      double p = (double)counts[v] / (double)total;
      h -= p * log(p);
    }
  free(counts);
  *out = h;
  return MOE_OK;
}

/* Smallest and largest token of the n tokens at p: one typed loop per dtype
 * (the compiler vectorizes them). */
#define DS_MINMAX(T)                                      \
  do {                                                    \
    T lo_, hi_;                                           \
    memcpy(&lo_, p, sizeof(T));                           \
    hi_ = lo_;                                            \
    for (int64_t k = 0; k < n; k++) {                     \
      T v_;                                               \
      memcpy(&v_, p + k * (int64_t)sizeof(T), sizeof(T)); \
      lo_ = v_ < lo_ ? v_ : lo_;                          \
      hi_ = v_ > hi_ ? v_ : hi_;                          \
    }                                                     \
    *mn = (int64_t)lo_;                                   \
    *mx = (int64_t)hi_;                                   \
  } while (0)

static void ds_minmax(const uint8_t *p, int64_t n, moe_index_dtype code, int64_t *mn, int64_t *mx) {
  switch (code) {
  case MOE_INDEX_U8: DS_MINMAX(uint8_t); break;
  case MOE_INDEX_I8: DS_MINMAX(int8_t); break;
  case MOE_INDEX_I16: DS_MINMAX(int16_t); break;
  case MOE_INDEX_U16: DS_MINMAX(uint16_t); break;
  case MOE_INDEX_I32: DS_MINMAX(int32_t); break;
  default: DS_MINMAX(int64_t); break;
  }
}

moe_status moe_indexed_dataset_check_vocab(moe_ctx *ctx, const moe_indexed_dataset *ds,
                                           int64_t vocab_size, int64_t *max_id) {
  if (vocab_size < 1)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "check_vocab: vocab_size %lld (>= 1 expected)",
                     (long long)vocab_size);
  int64_t top = -1;
  for (int64_t i = 0; i < ds->n; i++) {
    int64_t n = ds->cum[i + 1] - ds->cum[i], mn = 0, mx = -1;
    if (n == 0) continue;
    const uint8_t *p = ds->bin + ds->ptr[i];
    ds_minmax(p, n, ds->dtype, &mn, &mx);
    if (mn < 0 || mx >= vocab_size) {
      for (int64_t k = 0; k < n; k++) {
        int64_t v = ds_token(p + k * ds->itemsize, ds->dtype);
        if (v < 0 || v >= vocab_size)
          return moe_error(ctx, MOE_ERR_INVALID_ARG,
                           "indexed dataset %s: sequence %lld holds token id %lld (token %lld of "
                           "it), outside the model's vocabulary [0, %lld)",
                           ds->bin_path, (long long)i, (long long)v, (long long)k,
                           (long long)vocab_size);
      }
    }
    top = mx > top ? mx : top;
  }
  if (max_id) *max_id = top;
  return MOE_OK;
}

/* ------------------------------------------------------------ writer */

struct moe_indexed_builder {
  char *bin_path, *idx_path;
  char *bin_tmp;  /* prefix.bin.tmp-<pid>: the tokens until finalize renames it */
  FILE *bin;
  moe_index_dtype dtype;
  int64_t itemsize;
  int32_t *sizes; /* (n) */
  int64_t n, cap;
  int64_t *docs;  /* (nd) starts with 0 */
  int64_t nd, dcap;
  uint8_t *buf;   /* conversion buffer */
  size_t buf_cap;
  bool finalized;
};

static bool ds_grow(void **p, int64_t *cap, int64_t need, size_t elem) {
  if (need <= *cap) return true;
  int64_t c = *cap > 0 ? *cap : 64;
  while (c < need) c *= 2;
  void *q = realloc(*p, (size_t)c * elem);
  if (!q) return false;
  *p = q;
  *cap = c;
  return true;
}

moe_status moe_indexed_builder_open(moe_ctx *ctx, const char *prefix, moe_index_dtype dtype,
                                    moe_indexed_builder **out) {
  *out = NULL;
  if (!prefix || !prefix[0])
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "indexed builder: empty path prefix");
  if (ds_itemsize(dtype) == 0 || dtype == MOE_INDEX_F32 || dtype == MOE_INDEX_F64)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "indexed builder: dtype code %d is not one of u8 i8 i16 i32 i64 u16",
                     (int)dtype);
  moe_indexed_builder *b = (moe_indexed_builder *)calloc(1, sizeof *b);
  if (!b) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "indexed builder: out of memory");
  b->dtype = dtype;
  b->itemsize = ds_itemsize(dtype);
  b->bin_path = ds_path(prefix, ".bin");
  b->idx_path = ds_path(prefix, ".idx");
  char suffix[40];
  snprintf(suffix, sizeof suffix, ".tmp-%ld", (long)getpid());
  b->bin_tmp = b->bin_path ? ds_path(b->bin_path, suffix) : NULL;
  if (!b->bin_path || !b->idx_path || !b->bin_tmp ||
      !ds_grow((void **)&b->docs, &b->dcap, 1, sizeof(int64_t))) {
    b->finalized = true; /* nothing to remove */
    moe_indexed_builder_free(b);
    return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "indexed builder: out of memory");
  }
  b->docs[0] = 0;
  b->nd = 1;
  b->bin = fopen(b->bin_tmp, "wb");
  if (!b->bin) {
    moe_status st = moe_error(ctx, MOE_ERR_IO, "indexed builder: cannot create %s: %s",
                              b->bin_tmp, strerror(errno));
    b->finalized = true;
    moe_indexed_builder_free(b);
    return st;
  }
  *out = b;
  return MOE_OK;
}

moe_status moe_indexed_builder_add(moe_ctx *ctx, moe_indexed_builder *b, const int64_t *tokens,
                                   int64_t n) {
  if (b->finalized)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "indexed builder: %s is already finalized",
                     b->idx_path);
  if (n < 0 || n > INT32_MAX)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "indexed builder: a sequence of %lld tokens (at most 2^31 - 1)", (long long)n);
  for (int64_t i = 0; i < n; i++)
    if (!ds_fits(tokens[i], b->dtype))
      return moe_error(ctx, MOE_ERR_INVALID_ARG,
                       "indexed builder: token %lld (at %lld) does not fit dtype %s",
                       (long long)tokens[i], (long long)i, moe_index_dtype_name(b->dtype));
  size_t bytes = (size_t)n * (size_t)b->itemsize;
  if (bytes > b->buf_cap) {
    uint8_t *q = (uint8_t *)realloc(b->buf, bytes);
    if (!q) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "indexed builder: out of memory");
    b->buf = q;
    b->buf_cap = bytes;
  }
  if (!ds_grow((void **)&b->sizes, &b->cap, b->n + 1, sizeof(int32_t)))
    return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "indexed builder: out of memory");
  for (int64_t i = 0; i < n; i++) ds_put(b->buf + i * b->itemsize, tokens[i], b->dtype);
  if (bytes > 0 && fwrite(b->buf, 1, bytes, b->bin) != bytes)
    return moe_error(ctx, MOE_ERR_IO, "indexed builder: writing %s failed: %s", b->bin_path,
                     strerror(errno));
  b->sizes[b->n++] = (int32_t)n;
  return MOE_OK;
}

moe_status moe_indexed_builder_end_document(moe_ctx *ctx, moe_indexed_builder *b) {
  if (b->finalized)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "indexed builder: %s is already finalized",
                     b->idx_path);
  if (!ds_grow((void **)&b->docs, &b->dcap, b->nd + 1, sizeof(int64_t)))
    return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "indexed builder: out of memory");
  b->docs[b->nd++] = b->n;
  return MOE_OK;
}

static bool ds_write(FILE *f, const void *p, size_t n) { return n == 0 || fwrite(p, 1, n, f) == n; }

/* Flushes f to the disk and closes it; false (errno set) on failure. */
static bool ds_close_synced(FILE *f) {
  bool ok = fflush(f) == 0 && fsync(fileno(f)) == 0;
  int e = errno;
  ok = (fclose(f) == 0) && ok;
  if (!ok && e) errno = e;
  return ok;
}

/* fsync of the folder holding path (best effort: the renames' durability). */
static void ds_sync_folder(const char *path) {
  const char *slash = strrchr(path, '/');
  char *dir = slash ? (slash == path ? strdup("/") : strndup(path, (size_t)(slash - path))) : strdup(".");
  if (!dir) return;
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    (void)fsync(fd);
    close(fd);
  }
  free(dir);
}

moe_status moe_indexed_builder_finalize(moe_ctx *ctx, moe_indexed_builder *b) {
  if (b->finalized)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "indexed builder: %s is already finalized",
                     b->idx_path);
  /* sequences added after the last end_document form a last document */
  if (b->docs[b->nd - 1] != b->n) MOE_CHECK(moe_indexed_builder_end_document(ctx, b));
  bool closed = ds_close_synced(b->bin);
  b->bin = NULL;
  if (!closed)
    return moe_error(ctx, MOE_ERR_IO, "indexed builder: closing %s failed: %s", b->bin_tmp,
                     strerror(errno));
  char suffix[40];
  snprintf(suffix, sizeof suffix, ".tmp-%ld", (long)getpid());
  char *tmp = ds_path(b->idx_path, suffix);
  if (!tmp) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "indexed builder: out of memory");
  FILE *f = fopen(tmp, "wb");
  if (!f) {
    moe_status st = moe_error(ctx, MOE_ERR_IO, "indexed builder: cannot create %s: %s", tmp,
                              strerror(errno));
    free(tmp);
    return st;
  }
  uint64_t version = 1, n = (uint64_t)b->n, c = (uint64_t)b->nd;
  uint8_t code = (uint8_t)b->dtype;
  bool ok = ds_write(f, DS_MAGIC, DS_MAGIC_LEN) && ds_write(f, &version, 8) &&
            ds_write(f, &code, 1) && ds_write(f, &n, 8) && ds_write(f, &c, 8) &&
            ds_write(f, b->sizes, sizeof(int32_t) * (size_t)b->n);
  int64_t ptr = 0;
  for (int64_t i = 0; ok && i < b->n; i++) {
    ok = ds_write(f, &ptr, 8);
    ptr += (int64_t)b->sizes[i] * b->itemsize;
  }
  ok = ok && ds_write(f, b->docs, sizeof(int64_t) * (size_t)b->nd);
  ok = ds_close_synced(f) && ok;
  /* .bin first, then .idx: an index is never newer than its tokens */
  if (ok && rename(b->bin_tmp, b->bin_path) != 0) {
    moe_status st = moe_error(ctx, MOE_ERR_IO, "indexed builder: renaming %s to %s failed: %s",
                              b->bin_tmp, b->bin_path, strerror(errno));
    remove(tmp);
    free(tmp);
    return st;
  }
  if (!ok || rename(tmp, b->idx_path) != 0) {
    moe_status st = moe_error(ctx, MOE_ERR_IO, "indexed builder: writing %s failed: %s",
                              b->idx_path, strerror(errno));
    remove(tmp);
    free(tmp);
    return st;
  }
  free(tmp);
  ds_sync_folder(b->idx_path);
  b->finalized = true;
  return MOE_OK;
}

void moe_indexed_builder_free(moe_indexed_builder *b) {
  if (!b) return;
  if (b->bin) fclose(b->bin);
  if (!b->finalized && b->bin_tmp) remove(b->bin_tmp);
  free(b->bin_tmp);
  free(b->bin_path);
  free(b->idx_path);
  free(b->sizes);
  free(b->docs);
  free(b->buf);
  free(b);
}
