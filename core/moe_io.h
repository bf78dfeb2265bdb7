/*
 * moe_io.h - reading and writing tensors in files: safetensors
 * (https://github.com/huggingface/safetensors), the checkpoint and exchange
 * format that PyTorch, NumPy, JAX and the `safetensors` library open.
 * Implemented in core/safetensors.c (with the JSON reader core/json.c).
 * Include it beside moe.h.
 *
 * The format: an 8-byte little-endian u64 N, an N-byte UTF-8 JSON header
 *   {"__metadata__": {"key": "value", ...},
 *    "<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...}
 * padded with spaces to a multiple of 8 bytes, then the data buffer: each
 * tensor row-major, contiguous, little-endian, at [begin, end) of the
 * buffer. Dtypes: f32 F32, f64 F64, bf16 BF16, f16 F16, i8 I8, u8 U8,
 * i32 I32, i64 I64, bool BOOL (one byte, 0 or 1).
 *
 * Saving
 *   Tensors may live on any device and have any strides: each is written
 *   contiguous. A CPU tensor that is already contiguous is written straight
 *   from its storage; any other (a strided view, a CUDA tensor) goes through
 *   one host buffer of at most 8 MiB per tensor, a chunk at a time, so a
 *   large GPU tensor is never copied to the host whole. Tensors are laid out
 *   as the reference library lays them out: by dtype (I64, F64, F32, I32,
 *   BF16, F16, I8, U8, BOOL: element sizes never grow, so every tensor is
 *   aligned to its element size), then by name (byte order). The header is
 *   compact JSON: "__metadata__" first (keys sorted), then the tensors in
 *   data order. So the bytes of a file are a function of its contents alone,
 *   and equal to the reference's own for the same tensors and at most one
 *   metadata key (the reference's order of several keys is not fixed).
 *   The write is atomic: the file is written to "<path>.tmp.<pid>" in the
 *   same folder, flushed with fsync, then renamed over path (and the folder
 *   synced). On any failure the temporary file is removed and a file already
 *   at path is left untouched.
 *   Names must be non-empty, unique, valid UTF-8 and not "__metadata__";
 *   metadata keys unique, keys and values valid UTF-8.
 *
 * Loading
 *   Everything is validated before any tensor is allocated, as the reference
 *   does: the header length (at most 100 MB and inside the file), the JSON
 *   (an error gives the byte offset; lists of more than 64 items are
 *   refused while parsing, so the parsed header takes at most about eight
 *   times its size in memory), every entry's dtype, shape and
 *   data_offsets (inside the buffer, end - begin = numel * element size), and
 *   the buffer must be covered exactly: overlaps, holes between tensors and
 *   bytes after the last one are errors, as is a truncated file. Unknown
 *   fields in an entry are errors. Known safetensors dtypes that moe-lua has
 *   no dtype for (U16, F8_E4M3, ...) fail with MOE_ERR_NOT_SUPPORTED; other
 *   problems with the file's content or the file system give MOE_ERR_IO.
 *   Messages start with "load: '<path>': ". A path that is not a regular
 *   file (a named pipe, a folder, a device) is refused before any read, and
 *   a named pipe does not block the open.
 *   The data is read with one read (pread, repeated only on a partial read)
 *   per tensor straight into its host storage: no mmap, since tensors own
 *   refcounted storages that outlive the file. With a CUDA target each
 *   tensor is copied to the device after its read and the host copy freed
 *   at once, so the host holds one tensor at a time. BOOL bytes other than 0
 *   and 1 are read as true.
 */
#ifndef MOE_IO_H
#define MOE_IO_H

#include "moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Writes n tensors (names[i] -> tensors[i]) and n_meta metadata strings
 * (meta_keys[i] -> meta_values[i]; both NULL when n_meta is 0) to path.
 * The tensors are not modified or released. */
moe_status moe_safetensors_save(moe_ctx *ctx, const char *path, int64_t n,
                                const char *const *names, moe_tensor *const *tensors,
                                int64_t n_meta, const char *const *meta_keys,
                                const char *const *meta_values);

/* Writes the same file as moe_safetensors_save on a thread of its own and
 * returns once the data is copied: the arguments are checked, the layout and
 * header made, and every tensor's bytes copied into one host buffer here (the
 * caller may change or free the tensors afterwards); the thread opens
 * "<path>.tmp.<pid>.async", writes, fsyncs, renames and syncs the folder,
 * touching no moe_ctx. The tensors must be contiguous, on the CPU or a GPU
 * (copied from the device straight into the buffer, which is then
 * page-locked, and stays so when reused; pageable where locking fails).
 * reuse (NULL or an earlier writer):
 * its buffer is taken when large enough (joined first if need be), so
 * repeated saves copy into memory that is already mapped. moe_safetensors_writer_wait joins the
 * thread and returns the write's status (its message in ctx); it may be
 * called again. done polls. moe_safetensors_writer_free joins if needed and
 * frees the buffer. */
typedef struct moe_safetensors_writer moe_safetensors_writer;
moe_status moe_safetensors_save_async(moe_ctx *ctx, const char *path, int64_t n,
                                      const char *const *names, moe_tensor *const *tensors,
                                      int64_t n_meta, const char *const *meta_keys,
                                      const char *const *meta_values, moe_safetensors_writer *reuse,
                                      moe_safetensors_writer **out);
bool moe_safetensors_writer_done(const moe_safetensors_writer *w);
moe_status moe_safetensors_writer_wait(moe_ctx *ctx, moe_safetensors_writer *w);
void moe_safetensors_writer_free(moe_safetensors_writer *w); /* NULL is a no-op */

/* A loaded file: names, tensors and metadata, in the header's order. It
 * holds one reference to each tensor; moe_safetensors_free drops them, so
 * retain a tensor to keep it past the free. */
typedef struct moe_safetensors moe_safetensors;

/* Reads the file at path, placing every tensor on device d. */
moe_status moe_safetensors_load(moe_ctx *ctx, const char *path, moe_device d,
                                moe_safetensors **out);
void moe_safetensors_free(moe_safetensors *f); /* NULL is a no-op */

int64_t moe_safetensors_count(const moe_safetensors *f);
/* Entry i (0 <= i < count), borrowed; NULL out of range. */
const char *moe_safetensors_name(const moe_safetensors *f, int64_t i);
moe_tensor *moe_safetensors_tensor(const moe_safetensors *f, int64_t i);
/* The tensor called name, borrowed; NULL when there is none. */
moe_tensor *moe_safetensors_get(const moe_safetensors *f, const char *name);

int64_t moe_safetensors_metadata_count(const moe_safetensors *f);
const char *moe_safetensors_metadata_key(const moe_safetensors *f, int64_t i);
const char *moe_safetensors_metadata_value(const moe_safetensors *f, int64_t i);
/* The value of metadata key, borrowed; NULL when absent. */
const char *moe_safetensors_metadata_get(const moe_safetensors *f, const char *key);

/* Reading parts of a file. moe_safetensors_open reads the 8-byte length and
 * the header only, and checks them exactly as moe_safetensors_load does
 * (messages start with "open_safetensors: '<path>': ", and read_box's with "read: "); the file stays open until
 * moe_safetensors_reader_free. moe_safetensors_read_box then reads one box
 * of one tensor into a new contiguous CPU tensor of shape sizes: only the
 * box's bytes, one pread per run of it that is contiguous in the file (the
 * last dims the box covers whole, and its range in the dim before them).
 *   shape NULL: the box is in the stored tensor (ndim its ndim, base 0);
 *   otherwise the elements [base, base + numel(shape)) of the stored tensor
 *   (row-major) are seen as a tensor of ndim dims `shape` (a flat range:
 *   ndim 1, shape {count}), and the box is in that view.
 *   offsets / sizes: 0-based start and size per dim; NULL: the whole view.
 * An empty box reads nothing. The reader counts what it read (header
 * included): moe_safetensors_reader_bytes returns the bytes, *reads (when
 * not NULL) the pread calls. Entries are in the header's order; a reader is
 * not safe to share between threads. */
typedef struct moe_safetensors_reader moe_safetensors_reader;
moe_status moe_safetensors_open(moe_ctx *ctx, const char *path, moe_safetensors_reader **out);
void moe_safetensors_reader_free(moe_safetensors_reader *r); /* NULL is a no-op; closes the file */
int64_t moe_safetensors_reader_count(const moe_safetensors_reader *r);
/* Entry i's name (borrowed) and index of name (-1 when absent). */
const char *moe_safetensors_reader_name(const moe_safetensors_reader *r, int64_t i);
int64_t moe_safetensors_reader_find(const moe_safetensors_reader *r, const char *name);
/* Entry i: dtype, ndim, shape (room for MOE_MAX_DIMS) and its bytes
 * [file_begin, file_end) in the file; any out pointer may be NULL. False
 * when i is out of range. */
bool moe_safetensors_reader_entry(const moe_safetensors_reader *r, int64_t i, moe_dtype *dtype, int *ndim,
                                  int64_t *shape, uint64_t *file_begin, uint64_t *file_end);
int64_t moe_safetensors_reader_metadata_count(const moe_safetensors_reader *r);
const char *moe_safetensors_reader_metadata_key(const moe_safetensors_reader *r, int64_t i);
const char *moe_safetensors_reader_metadata_value(const moe_safetensors_reader *r, int64_t i);
uint64_t moe_safetensors_reader_bytes(const moe_safetensors_reader *r, uint64_t *reads);
moe_status moe_safetensors_read_box(moe_ctx *ctx, moe_safetensors_reader *r, int64_t i, int64_t base, int ndim,
                                    const int64_t *shape, const int64_t *offsets, const int64_t *sizes,
                                    moe_tensor **out);

#ifdef __cplusplus
}
#endif
#endif /* MOE_IO_H */
