/*
 * test_digest.c - core/moe_digest.h: XXH64 against the reference's test
 * vectors (one shot and streamed in every split), the digest of a file
 * equal to the digest of its bytes, a flipped bit changing it, files that
 * are not regular (named pipe, folder, /dev/zero) refused at once, fsync of
 * a file and a folder, and the hashing speed (printed, not asserted).
 */
#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "moe_digest.h"

static char dir[64];

static const char *path(const char *name) {
  static char buf[256];
  snprintf(buf, sizeof buf, "%s/%s", dir, name);
  return buf;
}

static void test_vectors(moe_ctx *ctx) {
  (void)ctx;
  /* the xxhash reference (xxhsum -H1, python-xxhash) */
  EXPECT(moe_xxh64("", 0, 0) == 0xef46db3751d8e999ull);
  EXPECT(moe_xxh64("a", 1, 0) == 0xd24ec4f1a98c6e5bull);
  EXPECT(moe_xxh64("abc", 3, 0) == 0x44bc2cf5ad770999ull);
  const char *s = "Nobody inspects the spammish repetition";
  EXPECT(moe_xxh64(s, strlen(s), 0) == 0xfbcea83c8a378bf1ull);
  /* streamed in two pieces at every split point, and byte by byte: the same */
  char big[200];
  for (int i = 0; i < 200; i++) big[i] = (char)(i * 7 + 3);
  uint64_t want = moe_xxh64(big, sizeof big, 0);
  int bad = 0;
  for (size_t cut = 0; cut <= sizeof big; cut++) {
    moe_xxh64_state st;
    moe_xxh64_init(&st, 0);
    moe_xxh64_update(&st, big, cut);
    moe_xxh64_update(&st, big + cut, sizeof big - cut);
    bad += moe_xxh64_digest(&st) != want;
  }
  moe_xxh64_state st;
  moe_xxh64_init(&st, 0);
  for (size_t i = 0; i < sizeof big; i++) moe_xxh64_update(&st, big + i, 1);
  bad += moe_xxh64_digest(&st) != want;
  EXPECT(bad == 0);
  /* every single-bit flip changes the digest */
  int same = 0;
  for (size_t bit = 0; bit < 8 * sizeof big; bit++) {
    big[bit / 8] ^= (char)(1 << (bit % 8));
    same += moe_xxh64(big, sizeof big, 0) == want;
    big[bit / 8] ^= (char)(1 << (bit % 8));
  }
  EXPECT(same == 0);
}

static void test_file(moe_ctx *ctx) {
  const size_t n = 5000000 + 13; /* more than one read chunk, not a multiple of 32 */
  unsigned char *buf = malloc(n);
  if (!buf) return;
  for (size_t i = 0; i < n; i++) buf[i] = (unsigned char)(i * 2654435761u >> 13);
  FILE *f = fopen(path("f.bin"), "wb");
  EXPECT(f && fwrite(buf, 1, n, f) == n);
  if (f) fclose(f);
  uint64_t d = 0, size = 0;
  EXPECT_OK(moe_file_digest(ctx, path("f.bin"), &d, &size));
  EXPECT(size == n);
  EXPECT(d == moe_xxh64(buf, n, 0));
  /* one flipped bit in the middle of the file */
  int fd = open(path("f.bin"), O_WRONLY);
  unsigned char c = buf[n / 2] ^ 0x10;
  EXPECT(fd >= 0 && pwrite(fd, &c, 1, (off_t)(n / 2)) == 1);
  if (fd >= 0) close(fd);
  uint64_t d2 = 0;
  EXPECT_OK(moe_file_digest(ctx, path("f.bin"), &d2, NULL));
  EXPECT(d2 != d);
  EXPECT_OK(moe_file_sync(ctx, path("f.bin")));
  EXPECT_OK(moe_file_sync(ctx, dir));
  EXPECT_ERR_MSG(moe_file_sync(ctx, path("missing")), MOE_ERR_IO, "missing");
  EXPECT_ERR_MSG(moe_file_digest(ctx, path("missing"), &d, NULL), MOE_ERR_IO, "cannot open");

  /* speed: 64 MiB from memory */
  size_t m = (size_t)64 << 20;
  unsigned char *big = malloc(m);
  if (big) {
    memset(big, 0x5a, m); /* touch the pages before the clock starts */
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    volatile uint64_t h = moe_xxh64(big, m, 0);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    (void)h;
    double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    printf("xxh64: %.0f MB/s (64 MiB in memory)\n", (double)m / 1e6 / (s > 0 ? s : 1e-9));
    free(big);
  }
  free(buf);
}

static void test_not_regular(moe_ctx *ctx) {
  uint64_t d = 0;
  int fd = -1;
  EXPECT(mkfifo(path("fifo"), 0600) == 0);
  /* a pipe with no writer: a blocking open would wait forever */
  EXPECT_ERR_MSG(moe_file_digest(ctx, path("fifo"), &d, NULL), MOE_ERR_IO, "is a named pipe");
  EXPECT_ERR_MSG(moe_file_open_regular(ctx, "load", path("fifo"), &fd, NULL), MOE_ERR_IO,
                 "load: '");
  EXPECT(fd == -1);
  EXPECT_ERR_MSG(moe_file_digest(ctx, dir, &d, NULL), MOE_ERR_IO, "is a folder");
  EXPECT_ERR_MSG(moe_file_digest(ctx, "/dev/zero", &d, NULL), MOE_ERR_IO,
                 "'/dev/zero' is a character device, not a regular file");
  EXPECT_OK(moe_file_open_regular(ctx, "x", path("f.bin"), &fd, NULL));
  EXPECT(fd >= 0 && !(fcntl(fd, F_GETFL) & O_NONBLOCK));
  if (fd >= 0) close(fd);
}

int main(void) {
  snprintf(dir, sizeof dir, "/tmp/moe-digest-XXXXXX");
  if (!mkdtemp(dir)) return 1;
  RUN(test_vectors);
  RUN(test_file);
  RUN(test_not_regular);
  remove(path("f.bin"));
  remove(path("fifo"));
  rmdir(dir);
  return harness_end();
}
