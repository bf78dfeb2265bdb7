/*
 * bpe.c - byte-level BPE encoding (moe_bpe.h): pieces from the GPT-2
 * pre-tokenizer (core/unicode.c), each merged as tokenizers' BPE model does
 * (Word::merge_all): a min-heap of adjacent pairs ordered by (merge rank,
 * position), popped one at a time, stale entries skipped; O(n log n) in the
 * piece's length, so a megabyte of spaces is no hang.
 *
 * Owns: the merge table (open addressing, key = left << 32 | right), a cache
 * of encoded pieces up to MOE_BPE_CACHE_KEY bytes (cleared whole when it
 * holds MOE_BPE_CACHE_ENTRIES), the work arrays of one piece and the output
 * ids. Not thread-safe: one encoder per thread.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "moe_bpe.h"

#define MOE_BPE_CACHE_KEY 64        /* longest piece cached, bytes */
#define MOE_BPE_CACHE_ENTRIES 65536 /* entries before the cache is cleared */
#define MOE_BPE_CACHE_SLOTS (2 * MOE_BPE_CACHE_ENTRIES)

typedef struct moe_bpe_merge {
  uint64_t key; /* left << 32 | right; UINT64_MAX: empty slot */
  int32_t rank, result;
} moe_bpe_merge;

typedef struct moe_bpe_slot {
  uint64_t hash;    /* 0: empty */
  uint32_t key_off; /* into keys */
  uint32_t key_len;
  uint32_t ids_off; /* into cache_ids */
  uint32_t n_ids;
} moe_bpe_slot;

typedef struct moe_bpe_heap_entry {
  int32_t rank, pos, right;
} moe_bpe_heap_entry;

struct moe_bpe {
  int32_t byte_ids[256];
  moe_bpe_split split;
  moe_bpe_merge *merges; /* (merge_cap) */
  size_t merge_cap;      /* power of two */
  /* cache */
  moe_bpe_slot *slots; /* (MOE_BPE_CACHE_SLOTS) */
  size_t n_cached;
  char *keys;
  size_t keys_len, keys_cap;
  int32_t *cache_ids;
  size_t cache_ids_len, cache_ids_cap;
  /* one piece's work arrays (work_cap) */
  int32_t *sym, *next, *prev;
  moe_bpe_heap_entry *heap;
  size_t work_cap, heap_cap;
  /* output */
  int32_t *out;
  size_t out_len, out_cap;
};

static uint64_t moe_bpe_mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

static uint64_t moe_bpe_hash_bytes(const unsigned char *s, size_t n) {
  uint64_t h = 1469598103934665603ULL; /* FNV-1a, then mixed */
  for (size_t i = 0; i < n; i++) h = (h ^ s[i]) * 1099511628211ULL;
  h = moe_bpe_mix(h ^ n);
  return h ? h : 1;
}

/* Grows *p (elements of size sz) to hold at least need; false when out of memory. */
static bool moe_bpe_grow(void **p, size_t *cap, size_t need, size_t sz) {
  if (need <= *cap) return true;
  size_t c = *cap ? *cap : 64;
  while (c < need) c *= 2;
  void *q = realloc(*p, c * sz);
  if (q == NULL) return false;
  *p = q;
  *cap = c;
  return true;
}

static const moe_bpe_merge *moe_bpe_find(const moe_bpe *b, int32_t left, int32_t right) {
  uint64_t key = ((uint64_t)(uint32_t)left << 32) | (uint32_t)right;
  size_t mask = b->merge_cap - 1;
  for (size_t i = moe_bpe_mix(key) & mask;; i = (i + 1) & mask) {
    const moe_bpe_merge *m = &b->merges[i];
    if (m->key == key) return m;
    if (m->key == UINT64_MAX) return NULL;
  }
}

moe_status moe_bpe_new(moe_ctx *ctx, const int32_t byte_ids[256], int64_t n_merges,
                       const int32_t *left, const int32_t *right, const int32_t *result,
                       moe_bpe_split split, moe_bpe **out) {
  *out = NULL;
  if (n_merges < 0 || n_merges > INT32_MAX / 4 || (n_merges > 0 && (!left || !right || !result)))
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "bpe: bad merge count %lld", (long long)n_merges);
  if (split != MOE_BPE_SPLIT_GPT2 && split != MOE_BPE_SPLIT_NONE)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "bpe: unknown split mode %d", (int)split);
  for (int i = 0; i < 256; i++)
    if (byte_ids[i] < -1)
      return moe_error(ctx, MOE_ERR_INVALID_ARG, "bpe: byte %d has id %d", i, (int)byte_ids[i]);
  for (int64_t r = 0; r < n_merges; r++)
    if (left[r] < 0 || right[r] < 0 || result[r] < 0)
      return moe_error(ctx, MOE_ERR_INVALID_ARG, "bpe: merge %lld has a negative id", (long long)r);
  moe_bpe *b = (moe_bpe *)calloc(1, sizeof *b);
  if (b == NULL) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "bpe: out of memory");
  memcpy(b->byte_ids, byte_ids, sizeof b->byte_ids);
  b->split = split;
  b->merge_cap = 16;
  while (b->merge_cap < 2 * (size_t)n_merges + 2) b->merge_cap *= 2;
  b->merges = (moe_bpe_merge *)malloc(b->merge_cap * sizeof *b->merges);
  b->slots = (moe_bpe_slot *)calloc(MOE_BPE_CACHE_SLOTS, sizeof *b->slots);
  if (b->merges == NULL || b->slots == NULL) {
    moe_bpe_free(b);
    return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "bpe: out of memory for %lld merges",
                     (long long)n_merges);
  }
  for (size_t i = 0; i < b->merge_cap; i++) b->merges[i].key = UINT64_MAX;
  size_t mask = b->merge_cap - 1;
  for (int64_t r = 0; r < n_merges; r++) {
    uint64_t key = ((uint64_t)(uint32_t)left[r] << 32) | (uint32_t)right[r];
    size_t i = moe_bpe_mix(key) & mask;
    while (b->merges[i].key != UINT64_MAX && b->merges[i].key != key) i = (i + 1) & mask;
    /* a pair listed twice: the later line wins, as in tokenizers */
    b->merges[i].key = key;
    b->merges[i].rank = (int32_t)r;
    b->merges[i].result = result[r];
  }
  *out = b;
  return MOE_OK;
}

void moe_bpe_free(moe_bpe *b) {
  if (b == NULL) return;
  free(b->merges);
  free(b->slots);
  free(b->keys);
  free(b->cache_ids);
  free(b->sym);
  free(b->next);
  free(b->prev);
  free(b->heap);
  free(b->out);
  free(b);
}

/* ------------------------------------------------------------ one piece */

static bool moe_bpe_less(const moe_bpe_heap_entry *a, const moe_bpe_heap_entry *b) {
  return a->rank < b->rank || (a->rank == b->rank && a->pos < b->pos);
}

static void moe_bpe_push(moe_bpe *b, size_t *n, moe_bpe_heap_entry e) {
  size_t i = (*n)++;
  while (i > 0) {
    size_t p = (i - 1) / 2;
    if (!moe_bpe_less(&e, &b->heap[p])) break;
    b->heap[i] = b->heap[p];
    i = p;
  }
  b->heap[i] = e;
}

static moe_bpe_heap_entry moe_bpe_pop(moe_bpe *b, size_t *n) {
  moe_bpe_heap_entry top = b->heap[0], e = b->heap[--(*n)];
  size_t i = 0;
  for (;;) {
    size_t c = 2 * i + 1;
    if (c >= *n) break;
    if (c + 1 < *n && moe_bpe_less(&b->heap[c + 1], &b->heap[c])) c++;
    if (!moe_bpe_less(&b->heap[c], &e)) break;
    b->heap[i] = b->heap[c];
    i = c;
  }
  b->heap[i] = e;
  return top;
}

/* Pushes the pair (pos, right) when it is a merge. */
static void moe_bpe_offer(moe_bpe *b, size_t *hn, int32_t pos, int32_t right) {
  const moe_bpe_merge *m = moe_bpe_find(b, b->sym[pos], b->sym[right]);
  if (m) moe_bpe_push(b, hn, (moe_bpe_heap_entry){m->rank, pos, right});
}

/* Merges the bytes p[0..n) and appends the ids to b->out. */
static moe_status moe_bpe_piece(moe_ctx *ctx, moe_bpe *b, const unsigned char *p, size_t n) {
  if (n > (size_t)INT32_MAX - 1)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "bpe: a piece of %zu bytes is too long", n);
  if (!moe_bpe_grow((void **)&b->sym, &b->work_cap, n, sizeof(int32_t))) goto oom;
  size_t cap = b->work_cap;
  void *q = realloc(b->next, cap * sizeof(int32_t));
  if (q == NULL) goto oom;
  b->next = (int32_t *)q;
  q = realloc(b->prev, cap * sizeof(int32_t));
  if (q == NULL) goto oom;
  b->prev = (int32_t *)q;
  if (!moe_bpe_grow((void **)&b->heap, &b->heap_cap, 2 * n + 1, sizeof(moe_bpe_heap_entry)))
    goto oom;
  int32_t len = (int32_t)n;
  for (int32_t i = 0; i < len; i++) {
    int32_t id = b->byte_ids[p[i]];
    if (id < 0)
      return moe_error(ctx, MOE_ERR_INVALID_ARG, "bpe: byte 0x%02X has no token in the vocabulary",
                       p[i]);
    b->sym[i] = id;
    b->next[i] = i + 1;
    b->prev[i] = i - 1;
  }
  size_t hn = 0;
  for (int32_t i = 0; i + 1 < len; i++) moe_bpe_offer(b, &hn, i, i + 1);
  while (hn > 0) {
    moe_bpe_heap_entry e = moe_bpe_pop(b, &hn);
    /* stale: a side was merged away or changed since the entry was pushed */
    if (b->sym[e.pos] < 0 || b->next[e.pos] != e.right || b->sym[e.right] < 0) continue;
    const moe_bpe_merge *m = moe_bpe_find(b, b->sym[e.pos], b->sym[e.right]);
    if (m == NULL || m->rank != e.rank) continue;
    b->sym[e.pos] = m->result;
    b->sym[e.right] = -1;
    int32_t after = b->next[e.right];
    b->next[e.pos] = after;
    if (after < len) b->prev[after] = e.pos;
    if (hn + 2 > b->heap_cap) goto oom; /* cannot happen: at most n - 1 pairs live + 2 per merge */
    if (b->prev[e.pos] >= 0) moe_bpe_offer(b, &hn, b->prev[e.pos], e.pos);
    if (after < len) moe_bpe_offer(b, &hn, e.pos, after);
  }
  size_t count = 0;
  for (int32_t i = 0; i < len; i = b->next[i]) count++;
  if (!moe_bpe_grow((void **)&b->out, &b->out_cap, b->out_len + count, sizeof(int32_t))) goto oom;
  for (int32_t i = 0; i < len; i = b->next[i]) b->out[b->out_len++] = b->sym[i];
  return MOE_OK;
oom:
  return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "bpe: out of memory for a piece of %zu bytes", n);
}

/* ------------------------------------------------------------ cache */

static void moe_bpe_cache_clear(moe_bpe *b) {
  memset(b->slots, 0, MOE_BPE_CACHE_SLOTS * sizeof *b->slots);
  b->n_cached = 0;
  b->keys_len = 0;
  b->cache_ids_len = 0;
}

/* A piece through the cache: appends its ids to b->out. */
static moe_status moe_bpe_cached(moe_ctx *ctx, moe_bpe *b, const unsigned char *p, size_t n) {
  uint64_t h = moe_bpe_hash_bytes(p, n);
  size_t mask = MOE_BPE_CACHE_SLOTS - 1, i = h & mask;
  for (; b->slots[i].hash != 0; i = (i + 1) & mask) {
    const moe_bpe_slot *s = &b->slots[i];
    if (s->hash == h && s->key_len == n && memcmp(b->keys + s->key_off, p, n) == 0) {
      if (!moe_bpe_grow((void **)&b->out, &b->out_cap, b->out_len + s->n_ids, sizeof(int32_t)))
        return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "bpe: out of memory");
      memcpy(b->out + b->out_len, b->cache_ids + s->ids_off, s->n_ids * sizeof(int32_t));
      b->out_len += s->n_ids;
      return MOE_OK;
    }
  }
  size_t first = b->out_len;
  moe_status st = moe_bpe_piece(ctx, b, p, n);
  if (st != MOE_OK) return st;
  size_t k = b->out_len - first;
  if (b->n_cached >= MOE_BPE_CACHE_ENTRIES) {
    moe_bpe_cache_clear(b);
    i = h & mask;
  }
  if (!moe_bpe_grow((void **)&b->keys, &b->keys_cap, b->keys_len + n, 1) ||
      !moe_bpe_grow((void **)&b->cache_ids, &b->cache_ids_cap, b->cache_ids_len + k,
                    sizeof(int32_t)))
    return MOE_OK; /* not cached; the ids are out already */
  memcpy(b->keys + b->keys_len, p, n);
  memcpy(b->cache_ids + b->cache_ids_len, b->out + first, k * sizeof(int32_t));
  b->slots[i] = (moe_bpe_slot){h, (uint32_t)b->keys_len, (uint32_t)n, (uint32_t)b->cache_ids_len,
                               (uint32_t)k};
  b->keys_len += n;
  b->cache_ids_len += k;
  b->n_cached++;
  return MOE_OK;
}

/* ------------------------------------------------------------ text */

moe_status moe_bpe_encode(moe_ctx *ctx, moe_bpe *b, const char *text, size_t len,
                          const int32_t **ids, size_t *n) {
  const unsigned char *s = (const unsigned char *)text;
  b->out_len = 0;
  *ids = NULL;
  *n = 0;
  size_t pos = 0;
  while (pos < len) {
    size_t end = b->split == MOE_BPE_SPLIT_GPT2 ? moe_gpt2_piece_end(s, len, pos) : len;
    moe_status st = end - pos <= MOE_BPE_CACHE_KEY ? moe_bpe_cached(ctx, b, s + pos, end - pos)
                                                   : moe_bpe_piece(ctx, b, s + pos, end - pos);
    if (st != MOE_OK) return st;
    pos = end;
  }
  *ids = b->out;
  *n = b->out_len;
  return MOE_OK;
}
