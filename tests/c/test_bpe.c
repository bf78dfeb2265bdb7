/*
 * test_bpe.c - byte-level BPE encoding and the GPT-2 pre-tokenizer
 * (core/moe_bpe.h): UTF-8 decoding at its edges (overlong forms, surrogates,
 * truncation), the heap-based merge against a plain reference (scan for the
 * lowest-rank adjacent pair, leftmost first, merge it, repeat) on random
 * merge tables and texts, the piece cache across its clearing, and errors
 * (a byte without a token, bad arguments). Agreement with the tokenizers
 * package itself is in tests/lua/tokenizer_spec.lua.
 */
#include <stdint.h>

#include "harness.h"
#include "moe_bpe.h"

static void test_utf8(moe_ctx *ctx) {
  (void)ctx;
  struct {
    const char *s;
    int len;
    uint32_t cp;
  } cases[] = {
      {"A", 1, 0x41},
      {"\xc3\xa9", 2, 0xE9},
      {"\xe6\x97\xa5", 3, 0x65E5},
      {"\xf0\x9f\x98\x80", 4, 0x1F600},
      {"\xf4\x8f\xbf\xbf", 4, 0x10FFFF},
      {"\xf4\x90\x80\x80", 1, MOE_UTF8_INVALID}, /* past U+10FFFF */
      {"\xc0\x80", 1, MOE_UTF8_INVALID},         /* overlong */
      {"\xe0\x80\x80", 1, MOE_UTF8_INVALID},     /* overlong */
      {"\xed\xa0\x80", 1, MOE_UTF8_INVALID},     /* surrogate */
      {"\x80", 1, MOE_UTF8_INVALID},             /* stray continuation */
      {"\xe6\x97", 1, MOE_UTF8_INVALID},         /* truncated */
      {"\xe6(", 1, MOE_UTF8_INVALID},            /* not a continuation */
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    uint32_t cp = 0;
    int n = moe_utf8_decode((const unsigned char *)cases[i].s, strlen(cases[i].s), &cp);
    EXPECT(n == cases[i].len);
    EXPECT(cp == cases[i].cp);
  }
  EXPECT(moe_unicode_class_of(0x41) == MOE_UNICODE_LETTER);
  EXPECT(moe_unicode_class_of(0x663) == MOE_UNICODE_NUMBER);
  EXPECT(moe_unicode_class_of(0x3000) == MOE_UNICODE_SPACE);
  EXPECT(moe_unicode_class_of(MOE_UTF8_INVALID) == MOE_UNICODE_OTHER);
  EXPECT(strlen(moe_unicode_version()) > 0);
}

static uint64_t rng_state = 42;
static uint32_t rng(void) {
  rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
  return (uint32_t)(rng_state >> 33);
}

/* Whether merge k is the last one listed for its pair (a pair listed twice:
 * the later line wins, as in tokenizers). */
static int last_of_pair(int64_t k, int64_t nm, const int32_t *l, const int32_t *r) {
  for (int64_t j = k + 1; j < nm; j++)
    if (l[j] == l[k] && r[j] == r[k]) return 0;
  return 1;
}

/* The plain reference: merges ids[0..n) in place; returns the new count. */
static size_t reference_merge(int32_t *ids, size_t n, int64_t nm, const int32_t *l, const int32_t *r,
                              const int32_t *res) {
  for (;;) {
    int64_t best = -1;
    size_t at = 0;
    for (size_t i = 0; i + 1 < n; i++)
      for (int64_t k = 0; k < nm; k++)
        if (l[k] == ids[i] && r[k] == ids[i + 1] && (best < 0 || k < best) && last_of_pair(k, nm, l, r)) {
          best = k;
          at = i;
        }
    if (best < 0) return n;
    ids[at] = res[best];
    memmove(ids + at + 1, ids + at + 2, (n - at - 2) * sizeof(int32_t));
    n--;
  }
}

static void test_random_merges(moe_ctx *ctx) {
  const char alphabet[] = "ab c";
  int32_t bytes[256];
  for (int i = 0; i < 256; i++) bytes[i] = i;
  enum { NM = 40 };
  int32_t l[NM], r[NM], res[NM];
  for (int table = 0; table < 20; table++) {
    /* merges over the bytes of the alphabet and the tokens made so far */
    for (int k = 0; k < NM; k++) {
      int32_t pool = 4 + k;
      int32_t a = (int32_t)(rng() % (uint32_t)pool), b = (int32_t)(rng() % (uint32_t)pool);
      l[k] = a < 4 ? (int32_t)(unsigned char)alphabet[a] : 256 + (a - 4);
      r[k] = b < 4 ? (int32_t)(unsigned char)alphabet[b] : 256 + (b - 4);
      res[k] = 256 + k;
    }
    for (int mode = 0; mode < 2; mode++) {
      moe_bpe *b = NULL;
      EXPECT_OK(moe_bpe_new(ctx, bytes, NM, l, r, res, mode ? MOE_BPE_SPLIT_NONE : MOE_BPE_SPLIT_GPT2, &b));
      if (!b) continue;
      for (int t = 0; t < 20; t++) {
        char text[200];
        size_t len = 1 + rng() % 199;
        for (size_t i = 0; i < len; i++) text[i] = alphabet[rng() % 4];
        int32_t want[200];
        size_t nw = 0;
        for (size_t pos = 0; pos < len;) {
          size_t end = mode ? len : moe_gpt2_piece_end((const unsigned char *)text, len, pos);
          int32_t piece[200];
          for (size_t i = pos; i < end; i++) piece[i - pos] = (unsigned char)text[i];
          size_t np = reference_merge(piece, end - pos, NM, l, r, res);
          memcpy(want + nw, piece, np * sizeof(int32_t));
          nw += np;
          pos = end;
        }
        for (int again = 0; again < 2; again++) { /* the second time from the cache */
          const int32_t *got = NULL;
          size_t ng = 0;
          EXPECT_OK(moe_bpe_encode(ctx, b, text, len, &got, &ng));
          EXPECT(ng == nw && (nw == 0 || memcmp(got, want, nw * sizeof(int32_t)) == 0));
        }
      }
      moe_bpe_free(b);
    }
  }
}

static void test_cache_clearing(moe_ctx *ctx) {
  /* more distinct pieces than the cache holds: " 0" .. " 99999", digits merged pairwise */
  int32_t bytes[256];
  for (int i = 0; i < 256; i++) bytes[i] = i;
  int32_t l[10], r[10], res[10];
  for (int k = 0; k < 10; k++) l[k] = ' ', r[k] = '0' + k, res[k] = 256 + k;
  moe_bpe *b = NULL;
  EXPECT_OK(moe_bpe_new(ctx, bytes, 10, l, r, res, MOE_BPE_SPLIT_GPT2, &b));
  if (!b) return;
  for (int round = 0; round < 2; round++) {
    int bad = 0;
    for (int i = 0; i < 100000; i++) {
      char text[16];
      int len = snprintf(text, sizeof text, " %d", i);
      const int32_t *ids = NULL;
      size_t n = 0;
      if (moe_bpe_encode(ctx, b, text, (size_t)len, &ids, &n) != MOE_OK || n != (size_t)len - 1 ||
          ids[0] != 256 + (text[1] - '0'))
        bad++;
      for (int j = 2; j < len && !bad; j++) bad += ids[j - 1] != text[j];
    }
    EXPECT(bad == 0);
  }
  moe_bpe_free(b);
}

static void test_errors(moe_ctx *ctx) {
  int32_t bytes[256];
  for (int i = 0; i < 256; i++) bytes[i] = i == 'z' ? -1 : i;
  moe_bpe *b = NULL;
  EXPECT_OK(moe_bpe_new(ctx, bytes, 0, NULL, NULL, NULL, MOE_BPE_SPLIT_GPT2, &b));
  if (b) {
    const int32_t *ids = NULL;
    size_t n = 0;
    EXPECT_ERR_MSG(moe_bpe_encode(ctx, b, "a z", 3, &ids, &n), MOE_ERR_INVALID_ARG,
                   "byte 0x7A has no token");
    EXPECT_OK(moe_bpe_encode(ctx, b, "", 0, &ids, &n));
    EXPECT(n == 0);
    moe_bpe_free(b);
  }
  int32_t l = 1, r = -2, res = 300;
  EXPECT_ERR_MSG(moe_bpe_new(ctx, bytes, 1, &l, &r, &res, MOE_BPE_SPLIT_GPT2, &b), MOE_ERR_INVALID_ARG,
                 "merge 0 has a negative id");
  EXPECT(b == NULL);
  EXPECT_ERR(moe_bpe_new(ctx, bytes, -1, NULL, NULL, NULL, MOE_BPE_SPLIT_GPT2, &b), MOE_ERR_INVALID_ARG);
  EXPECT_ERR(moe_bpe_new(ctx, bytes, 0, NULL, NULL, NULL, (moe_bpe_split)7, &b), MOE_ERR_INVALID_ARG);
  bytes[3] = -5;
  EXPECT_ERR_MSG(moe_bpe_new(ctx, bytes, 0, NULL, NULL, NULL, MOE_BPE_SPLIT_GPT2, &b), MOE_ERR_INVALID_ARG,
                 "byte 3 has id -5");
  moe_bpe_free(NULL);
}

int main(void) {
  RUN(test_utf8);
  RUN(test_random_merges);
  RUN(test_cache_clearing);
  RUN(test_errors);
  return harness_end();
}
