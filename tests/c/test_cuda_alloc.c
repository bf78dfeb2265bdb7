/*
 * test_cuda_alloc.c - the CUDA caching allocator (core/cuda_runtime.c) seen
 * through tensors and moe_memory_stats: rounding, statistics returning to
 * their start, reuse without cudaMalloc, best fit with split and merge, no
 * two live blocks overlapping, peaks and their reset, empty_cache, and
 * out-of-memory errors (too large for the device, and a cudaMalloc failure
 * that flushes the cache and retries). Needs a GPU; skips (exit 77) without.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

#define GPU ((moe_device){MOE_DEVICE_CUDA, 0})
#define MIB ((int64_t)1 << 20)

static moe_memory_stats stats(moe_ctx *ctx) {
  moe_memory_stats s;
  memset(&s, 0, sizeof(s));
  if (moe_memory_stats_get(ctx, GPU, &s) != MOE_OK)
    fprintf(stderr, "memory_stats failed: %s\n", moe_ctx_error(ctx));
  return s;
}

/* A GPU tensor of nbytes bytes (u8), or NULL after a failed check. */
static moe_tensor *bytes(moe_ctx *ctx, int64_t nbytes) {
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, 1, &nbytes, MOE_U8, GPU, &t));
  return t;
}

static void test_rounding(moe_ctx *ctx) {
  static const int64_t req[][2] = {
      {1, 512},           {512, 512},         {513, 1024},       {1000, 1024},
      {MIB, MIB},         {MIB + 1, 2 * MIB}, {5 * MIB, 6 * MIB}, {64 * MIB + 3, 66 * MIB}};
  for (size_t k = 0; k < sizeof(req) / sizeof(req[0]); k++) {
    moe_memory_stats a = stats(ctx);
    moe_tensor *t = bytes(ctx, req[k][0]);
    if (!t) continue;
    moe_memory_stats b = stats(ctx);
    EXPECT((int64_t)t->storage->block == req[k][1]);
    EXPECT(b.allocated - a.allocated == req[k][1]);
    EXPECT(b.alloc_count - a.alloc_count == 1 && b.live_storages - a.live_storages == 1);
    moe_tensor_release(t);
    moe_memory_stats c = stats(ctx);
    EXPECT(c.allocated == a.allocated && c.live_storages == a.live_storages);
    EXPECT(c.free_count - a.free_count == 1);
  }
}

static void test_stats_return_to_start(moe_ctx *ctx) {
  static const int64_t sizes[] = {4, 700, 4096, 100000, MIB, 3 * MIB, 40 * MIB, 513};
  enum { N = sizeof(sizes) / sizeof(sizes[0]) };
  moe_tensor *t[N];
  moe_memory_stats a = stats(ctx);
  int64_t sum = 0;
  for (int k = 0; k < N; k++) {
    t[k] = bytes(ctx, sizes[k]);
    if (t[k]) sum += (int64_t)t[k]->storage->block;
  }
  moe_memory_stats b = stats(ctx);
  EXPECT(b.allocated - a.allocated == sum);
  EXPECT(b.alloc_count - a.alloc_count == N && b.live_storages - a.live_storages == N);
  EXPECT(b.reserved >= b.allocated && b.peak_allocated >= b.allocated);
  EXPECT(b.peak_reserved >= b.reserved);
  for (int k = 0; k < N; k++) moe_tensor_release(t[k]);
  moe_memory_stats c = stats(ctx);
  EXPECT(c.allocated == a.allocated && c.live_storages == a.live_storages);
  EXPECT(c.free_count - a.free_count == N);
  EXPECT(c.reserved == b.reserved); /* released blocks stay cached */
}

static void test_reuse_without_cudamalloc(moe_ctx *ctx) {
  static const int64_t sizes[] = {1000, 100000, 3 * MIB, 17 * MIB, 512, 700 * 1024};
  enum { N = sizeof(sizes) / sizeof(sizes[0]) };
  moe_tensor *t[N];
  for (int k = 0; k < N; k++) t[k] = bytes(ctx, sizes[k]); /* warm the cache */
  for (int k = 0; k < N; k++) moe_tensor_release(t[k]);
  moe_memory_stats a = stats(ctx);
  for (int cycle = 0; cycle < 1000; cycle++) {
    for (int k = 0; k < N; k++) t[k] = bytes(ctx, sizes[k]);
    for (int k = 0; k < N; k++) moe_tensor_release(t[(k + cycle) % N]); /* varied order */
  }
  moe_memory_stats b = stats(ctx);
  EXPECT(b.system_allocs == a.system_allocs);
  EXPECT(b.system_frees == a.system_frees);
  EXPECT(b.reserved == a.reserved);
  EXPECT(b.allocated == a.allocated);
  EXPECT(b.alloc_count - a.alloc_count == 1000 * N);
}

static void test_best_fit_split_merge(moe_ctx *ctx) {
  EXPECT_OK(moe_memory_empty_cache(ctx, GPU));
  moe_memory_stats a = stats(ctx);
  const int64_t sz = 300 * 1024; /* small pool: three fit in one 2 MiB segment */
  moe_tensor *x = bytes(ctx, sz), *y = bytes(ctx, sz), *z = bytes(ctx, sz);
  moe_memory_stats b = stats(ctx);
  EXPECT(b.system_allocs - a.system_allocs == 1);
  EXPECT(b.reserved - a.reserved == 2 * MIB);
  if (x && y && z) {
    char *px = x->storage->data, *py = y->storage->data, *pz = z->storage->data;
    EXPECT(py == px + sz && pz == py + sz); /* carved in order from one segment */
    moe_tensor_release(y);
    moe_tensor_release(x); /* merges with y's block */
    moe_tensor *w = bytes(ctx, 2 * sz);
    if (w) EXPECT((char *)w->storage->data == px);
    moe_memory_stats c = stats(ctx);
    EXPECT(c.system_allocs == b.system_allocs);
    moe_tensor_release(w);
    moe_tensor_release(z);
  }
  moe_memory_stats d = stats(ctx);
  EXPECT(d.allocated == a.allocated);
  EXPECT_OK(moe_memory_empty_cache(ctx, GPU)); /* the segment is whole again */
  moe_memory_stats e = stats(ctx);
  EXPECT(e.reserved == a.reserved && e.system_frees - a.system_frees == 1);
}

static uint64_t mix(uint64_t x) {
  x = (x ^ (x >> 33)) * 0xFF51AFD7ED558CCDull;
  x = (x ^ (x >> 33)) * 0xC4CEB9FE1A85EC53ull;
  return x ^ (x >> 33);
}

/* Tensors of random sizes filled with their id, churned; each must still
 * hold its id at the end (no two live blocks overlap). */
static void test_no_overlap(moe_ctx *ctx) {
  enum { N = 240 };
  moe_tensor *t[N] = {0};
  int id[N] = {0};
  int next_id = 1;
  for (int round = 0; round < 4; round++) {
    for (int k = 0; k < N; k++) {
      if (t[k] && (mix((uint64_t)(k * 7 + round)) & 1)) {
        moe_tensor_release(t[k]);
        t[k] = NULL;
      }
      if (!t[k]) {
        uint64_t r = mix((uint64_t)(k + 1000 * round));
        int64_t n = (r & 7) == 0 ? (int64_t)(r >> 8) % (5 * MIB) + 1 : (int64_t)(r >> 8) % 70000 + 1;
        t[k] = bytes(ctx, n);
        id[k] = next_id++ % 250 + 1;
        if (t[k]) EXPECT_OK(moe_fill_(ctx, t[k], id[k]));
      }
    }
  }
  int bad = 0;
  for (int k = 0; k < N; k++) {
    if (!t[k]) continue;
    int64_t n = moe_tensor_numel(t[k]);
    int64_t *v = malloc((size_t)n * sizeof(int64_t));
    if (v && moe_tensor_to_i64(ctx, t[k], v) == MOE_OK) {
      for (int64_t i = 0; i < n; i++)
        if (v[i] != id[k]) {
          bad++;
          break;
        }
    } else {
      bad++;
    }
    free(v);
    moe_tensor_release(t[k]);
  }
  EXPECT(bad == 0);
}

static void test_peak_and_reset(moe_ctx *ctx) {
  EXPECT_OK(moe_memory_reset_peak(ctx, GPU));
  moe_memory_stats a = stats(ctx);
  EXPECT(a.peak_allocated == a.allocated && a.peak_reserved == a.reserved);
  moe_tensor *t = bytes(ctx, 8 * MIB);
  moe_memory_stats b = stats(ctx);
  EXPECT(b.peak_allocated == a.allocated + 8 * MIB);
  moe_tensor_release(t);
  moe_memory_stats c = stats(ctx);
  EXPECT(c.peak_allocated == b.peak_allocated && c.allocated == a.allocated);
  EXPECT(c.peak_reserved >= c.reserved);
  EXPECT_OK(moe_memory_reset_peak(ctx, GPU));
  moe_memory_stats d = stats(ctx);
  EXPECT(d.peak_allocated == d.allocated && d.peak_reserved == d.reserved);
}

static void test_empty_cache(moe_ctx *ctx) {
  moe_tensor *keep = bytes(ctx, 1000); /* one live block keeps its segment */
  moe_tensor *t1 = bytes(ctx, 10 * MIB), *t2 = bytes(ctx, 4000);
  moe_tensor_release(t1);
  moe_tensor_release(t2);
  moe_memory_stats a = stats(ctx);
  EXPECT(a.reserved > a.allocated);
  EXPECT_OK(moe_memory_empty_cache(ctx, GPU));
  moe_memory_stats b = stats(ctx);
  EXPECT(b.reserved < a.reserved);
  EXPECT(b.system_frees > a.system_frees);
  EXPECT(b.allocated == a.allocated && b.reserved == 2 * MIB); /* keep's small segment */
  EXPECT(b.system_allocs - b.system_frees == 1);
  moe_tensor_release(keep);
  EXPECT_OK(moe_memory_empty_cache(ctx, GPU));
  moe_memory_stats c = stats(ctx);
  EXPECT(c.reserved == 0 && c.allocated == 0 && c.system_allocs == c.system_frees);
  moe_tensor *again = bytes(ctx, 10 * MIB); /* the cache is gone: cudaMalloc again */
  moe_memory_stats d = stats(ctx);
  EXPECT(d.system_allocs == c.system_allocs + 1);
  moe_tensor_release(again);
}

static void test_out_of_memory(moe_ctx *ctx) {
  moe_tensor *t = NULL;
  /* more than the device has: fails at once, the cache and stats untouched */
  moe_tensor *cached = bytes(ctx, 64 * MIB);
  moe_tensor_release(cached);
  moe_memory_stats a = stats(ctx);
  int64_t pib = (int64_t)1 << 50;
  EXPECT_ERR(moe_tensor_empty(ctx, 1, &pib, MOE_U8, GPU, &t), MOE_ERR_OUT_OF_MEMORY);
  EXPECT(strstr(moe_ctx_error(ctx), "out of memory") != NULL);
  EXPECT(strstr(moe_ctx_error(ctx), "1125899906842624 bytes") != NULL);
  printf("  message: %s\n", moe_ctx_error(ctx));
  moe_memory_stats b = stats(ctx);
  EXPECT(memcmp(&a, &b, sizeof(a)) == 0);
  EXPECT(t == NULL);

  /* the whole device: cudaMalloc fails (the CUDA context holds some), the
   * cache is flushed, the retry fails too */
  size_t mem = 0;
  EXPECT_OK(moe_cuda_device_info(ctx, 0, NULL, 0, NULL, &mem));
  int64_t all = (int64_t)(mem / (2 * (size_t)MIB) * (2 * (size_t)MIB));
  EXPECT(a.reserved >= 64 * MIB);
  EXPECT_ERR(moe_tensor_empty(ctx, 1, &all, MOE_U8, GPU, &t), MOE_ERR_OUT_OF_MEMORY);
  printf("  message: %s\n", moe_ctx_error(ctx));
  moe_memory_stats c = stats(ctx);
  EXPECT(c.allocated == a.allocated && c.reserved == 0); /* nothing live: all flushed */
  EXPECT(c.system_frees > a.system_frees && c.system_allocs == a.system_allocs);
  EXPECT(c.alloc_count == a.alloc_count && c.live_storages == a.live_storages);
  /* and the device works afterwards */
  t = bytes(ctx, 3 * MIB);
  if (t) {
    EXPECT_OK(moe_fill_(ctx, t, 5));
    EXPECT_OK(moe_cuda_synchronize(ctx, GPU));
  }
  moe_tensor_release(t);
}

/* A context freed with a GPU tensor still alive frees the block too (the
 * tensor's host header is leaked on purpose: its context is gone). */
static void test_teardown_with_live_tensor(moe_ctx *unused) {
  moe_ctx *c2 = NULL;
  moe_tensor *t = NULL;
  int64_t n = 5 * MIB;
  EXPECT(moe_ctx_init(&c2) == MOE_OK);
  if (!c2) return;
  EXPECT(moe_tensor_empty(c2, 1, &n, MOE_F32, GPU, &t) == MOE_OK);
  EXPECT(moe_fill_(c2, t, 1.0) == MOE_OK);
  moe_ctx_free(c2);
}

int main(void) {
  SKIP_IF_NO_GPU(harness_start());
  RUN(test_rounding);
  RUN(test_stats_return_to_start);
  RUN(test_reuse_without_cudamalloc);
  RUN(test_best_fit_split_merge);
  RUN(test_no_overlap);
  RUN(test_peak_and_reset);
  RUN(test_empty_cache);
  RUN(test_out_of_memory);
  RUN(test_teardown_with_live_tensor);
  return harness_end();
}
