/*
 * moe_digest.h - file integrity helpers for checkpoints and datasets:
 * XXH64 digests (the 64-bit xxHash of Yann Collet, seed 0, bit-identical to
 * `xxhsum -H1` and the xxhash library's XXH64) of buffers and whole files,
 * fsync of a file or a folder, and the check that a path is a regular file
 * before anything reads it. Implemented in core/digest.c.
 *
 * XXH64 is not a cryptographic hash: it detects corruption (flipped bits,
 * truncation, swapped bytes) with a 2^-64 chance of a miss, at memory speed;
 * it does not defend against someone who crafts a file on purpose.
 *
 * Opening: every function that opens a path opens it with O_NONBLOCK and
 * checks fstat before reading, so a named pipe, a folder or a device
 * (/dev/zero) is a clean MOE_ERR_IO naming the path ("is a named pipe, not a
 * regular file"), never a hang or an endless read.
 */
#ifndef MOE_DIGEST_H
#define MOE_DIGEST_H

#include "moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Streaming XXH64: init, update any number of times, digest (the state is
 * not changed by digest, so it may be called again after more updates). */
typedef struct moe_xxh64_state {
  uint64_t total;  /* bytes seen */
  uint64_t v[4];   /* accumulators */
  uint8_t buf[32]; /* (total % 32) bytes not yet folded into v */
  uint64_t seed;
} moe_xxh64_state;

void moe_xxh64_init(moe_xxh64_state *s, uint64_t seed);
void moe_xxh64_update(moe_xxh64_state *s, const void *p, size_t n);
uint64_t moe_xxh64_digest(const moe_xxh64_state *s);
/* One shot: moe_xxh64(p, n, 0) of "" is 0xef46db3751d8e999. */
uint64_t moe_xxh64(const void *p, size_t n, uint64_t seed);

/* Opens path read-only for a reader that must not hang: O_NONBLOCK, then
 * fstat; anything but a regular file is closed again and is an error
 * naming it ("<what>: '<path>' is a named pipe, not a regular file"). On
 * success *fd is a blocking descriptor (O_NONBLOCK cleared) and *size the
 * file's length. what prefixes the messages ("load", "indexed dataset"). */
moe_status moe_file_open_regular(moe_ctx *ctx, const char *what, const char *path, int *fd,
                                 uint64_t *size);

/* What is at path, without opening it (stat(2), links followed): "file",
 * "folder", "named pipe", "character device", "block device", "socket",
 * "other", or NULL when nothing is (or it cannot be stat'ed). */
const char *moe_file_kind(const char *path);

/* XXH64 (seed 0) and length of the whole file at path (a regular file). */
moe_status moe_file_digest(moe_ctx *ctx, const char *path, uint64_t *digest, uint64_t *size);

/* fsync(2) of path: a file (its data and size reach the disk) or a folder
 * (the names created, renamed or removed in it do). A file system that
 * refuses fsync of a folder (EINVAL) is not an error. */
moe_status moe_file_sync(moe_ctx *ctx, const char *path);

#ifdef __cplusplus
}
#endif
#endif /* MOE_DIGEST_H */
