/*
 * digest.c - XXH64 of buffers and files, fsync of files and folders, and
 * the non-blocking open that refuses anything but a regular file
 * (moe_digest.h). XXH64 follows the xxHash specification
 * (https://github.com/Cyan4973/xxHash/blob/dev/doc/xxhash_spec.md): four
 * 64-bit lanes over 32-byte stripes, then the tail and the avalanche.
 * Little-endian reads through memcpy (any alignment).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"
#include "moe_digest.h"

#define XXH_P1 0x9E3779B185EBCA87ull
#define XXH_P2 0xC2B2AE3D27D4EB4Full
#define XXH_P3 0x165667B19E3779F9ull
#define XXH_P4 0x85EBCA77C2B2AE63ull
#define XXH_P5 0x27D4EB2F165667C5ull
#define DG_CHUNK ((size_t)4 << 20) /* read buffer of moe_file_digest */

static inline uint64_t xxh_rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t xxh_read64(const uint8_t *p) {
  uint64_t v;
  memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  v = __builtin_bswap64(v);
#endif
  return v;
}

static inline uint32_t xxh_read32(const uint8_t *p) {
  uint32_t v;
  memcpy(&v, p, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  v = __builtin_bswap32(v);
#endif
  return v;
}

static inline uint64_t xxh_round(uint64_t acc, uint64_t in) {
  acc += in * XXH_P2;
  acc = xxh_rotl(acc, 31);
  return acc * XXH_P1;
}

static inline uint64_t xxh_merge(uint64_t acc, uint64_t v) {
  acc ^= xxh_round(0, v);
  return acc * XXH_P1 + XXH_P4;
}

void moe_xxh64_init(moe_xxh64_state *s, uint64_t seed) {
  memset(s, 0, sizeof *s);
  s->seed = seed;
  s->v[0] = seed + XXH_P1 + XXH_P2;
  s->v[1] = seed + XXH_P2;
  s->v[2] = seed;
  s->v[3] = seed - XXH_P1;
}

/* Folds whole 32-byte stripes of p into v; returns the bytes consumed. */
static size_t xxh_stripes(uint64_t v[4], const uint8_t *p, size_t n) {
  uint64_t a = v[0], b = v[1], c = v[2], d = v[3];
  size_t done = 0;
  for (; done + 32 <= n; done += 32) {
    a = xxh_round(a, xxh_read64(p + done));
    b = xxh_round(b, xxh_read64(p + done + 8));
    c = xxh_round(c, xxh_read64(p + done + 16));
    d = xxh_round(d, xxh_read64(p + done + 24));
  }
  v[0] = a, v[1] = b, v[2] = c, v[3] = d;
  return done;
}

void moe_xxh64_update(moe_xxh64_state *s, const void *data, size_t n) {
  const uint8_t *p = data;
  size_t have = (size_t)(s->total % 32);
  s->total += n;
  if (have + n < 32) {
    if (n) memcpy(s->buf + have, p, n);
    return;
  }
  if (have) {
    size_t fill = 32 - have;
    memcpy(s->buf + have, p, fill);
    xxh_stripes(s->v, s->buf, 32);
    p += fill;
    n -= fill;
  }
  size_t done = xxh_stripes(s->v, p, n);
  if (n > done) memcpy(s->buf, p + done, n - done);
}

uint64_t moe_xxh64_digest(const moe_xxh64_state *s) {
  uint64_t h;
  if (s->total >= 32) {
    h = xxh_rotl(s->v[0], 1) + xxh_rotl(s->v[1], 7) + xxh_rotl(s->v[2], 12) + xxh_rotl(s->v[3], 18);
    for (int i = 0; i < 4; i++) h = xxh_merge(h, s->v[i]);
  } else {
    h = s->seed + XXH_P5;
  }
  h += s->total;
  const uint8_t *p = s->buf;
  size_t n = (size_t)(s->total % 32);
  for (; n >= 8; p += 8, n -= 8) {
    h ^= xxh_round(0, xxh_read64(p));
    h = xxh_rotl(h, 27) * XXH_P1 + XXH_P4;
  }
  if (n >= 4) {
    h ^= (uint64_t)xxh_read32(p) * XXH_P1;
    h = xxh_rotl(h, 23) * XXH_P2 + XXH_P3;
    p += 4;
    n -= 4;
  }
  for (; n > 0; p++, n--) {
    h ^= (uint64_t)(*p) * XXH_P5;
    h = xxh_rotl(h, 11) * XXH_P1;
  }
  h ^= h >> 33;
  h *= XXH_P2;
  h ^= h >> 29;
  h *= XXH_P3;
  h ^= h >> 32;
  return h;
}

uint64_t moe_xxh64(const void *p, size_t n, uint64_t seed) {
  moe_xxh64_state s;
  moe_xxh64_init(&s, seed);
  moe_xxh64_update(&s, p, n);
  return moe_xxh64_digest(&s);
}

static const char *dg_kind(mode_t m) {
  if (S_ISDIR(m)) return "a folder";
  if (S_ISFIFO(m)) return "a named pipe";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "not a regular file";
}

const char *moe_file_kind(const char *path) {
  struct stat sb;
  if (!path || stat(path, &sb) != 0) return NULL;
  if (S_ISREG(sb.st_mode)) return "file";
  if (S_ISDIR(sb.st_mode)) return "folder";
  if (S_ISFIFO(sb.st_mode)) return "named pipe";
  if (S_ISCHR(sb.st_mode)) return "character device";
  if (S_ISBLK(sb.st_mode)) return "block device";
  if (S_ISSOCK(sb.st_mode)) return "socket";
  return "other";
}

moe_status moe_file_open_regular(moe_ctx *ctx, const char *what, const char *path, int *fd,
                                 uint64_t *size) {
  *fd = -1;
  if (!path || !path[0]) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: empty path", what);
  /* O_NONBLOCK: opening a named pipe with no writer returns at once */
  int f = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (f < 0) return moe_error(ctx, MOE_ERR_IO, "%s: cannot open '%s': %s", what, path, strerror(errno));
  struct stat sb;
  if (fstat(f, &sb) != 0) {
    int e = errno;
    close(f);
    return moe_error(ctx, MOE_ERR_IO, "%s: cannot stat '%s': %s", what, path, strerror(e));
  }
  if (!S_ISREG(sb.st_mode)) {
    close(f);
    const char *k = dg_kind(sb.st_mode);
    return moe_error(ctx, MOE_ERR_IO, "%s: '%s' is %s%s", what, path, k,
                     strcmp(k, "not a regular file") ? ", not a regular file" : "");
  }
  int flags = fcntl(f, F_GETFL);
  if (flags < 0 || fcntl(f, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    int e = errno;
    close(f);
    return moe_error(ctx, MOE_ERR_IO, "%s: '%s': %s", what, path, strerror(e));
  }
  *fd = f;
  if (size) *size = (uint64_t)sb.st_size;
  return MOE_OK;
}

moe_status moe_file_digest(moe_ctx *ctx, const char *path, uint64_t *digest, uint64_t *size) {
  int fd = -1;
  uint64_t len = 0;
  MOE_CHECK(moe_file_open_regular(ctx, "file_digest", path, &fd, &len));
  uint8_t *buf = malloc(DG_CHUNK);
  if (!buf) {
    close(fd);
    return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "file_digest: out of host memory");
  }
  moe_xxh64_state s;
  moe_xxh64_init(&s, 0);
  moe_status st = MOE_OK;
  for (;;) {
    ssize_t r = read(fd, buf, DG_CHUNK);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      st = moe_error(ctx, MOE_ERR_IO, "file_digest: reading '%s': %s", path, strerror(errno));
      break;
    }
    if (r == 0) break;
    moe_xxh64_update(&s, buf, (size_t)r);
  }
  free(buf);
  close(fd);
  if (st != MOE_OK) return st;
  *digest = moe_xxh64_digest(&s);
  if (size) *size = s.total;
  (void)len;
  return MOE_OK;
}

moe_status moe_file_sync(moe_ctx *ctx, const char *path) {
  if (!path || !path[0]) return moe_error(ctx, MOE_ERR_INVALID_ARG, "fsync: empty path");
  int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return moe_error(ctx, MOE_ERR_IO, "fsync: cannot open '%s': %s", path, strerror(errno));
  int rc;
  do rc = fsync(fd);
  while (rc != 0 && errno == EINTR);
  int e = errno;
  close(fd);
  if (rc != 0 && e != EINVAL && e != EROFS)
    return moe_error(ctx, MOE_ERR_IO, "fsync: '%s': %s", path, strerror(e));
  return MOE_OK;
}
