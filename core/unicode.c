/*
 * unicode.c - what the GPT-2 pre-tokenizer needs of Unicode (moe_bpe.h):
 * UTF-8 decoding, the letter / number / whitespace class of a code point
 * (letters and numbers from the generated ranges of unicode_tables.h, found
 * by binary search after a 256-entry table for Latin-1; whitespace is the
 * White_Space property, what \s matches in Oniguruma, which tokenizers
 * uses), and the regex itself as a hand-written matcher.
 */
#include <stdint.h>
#include <string.h>

#include "moe_bpe.h"
#include "unicode_tables.h"

const char *moe_unicode_version(void) { return MOE_UNICODE_VERSION; }

static int moe_unicode_is_space(uint32_t cp) {
  if (cp < 0x80) return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20;
  switch (cp) {
  case 0x85: case 0xA0: case 0x1680: case 0x2028: case 0x2029: case 0x202F: case 0x205F:
  case 0x3000:
    return 1;
  default:
    return cp >= 0x2000 && cp <= 0x200A;
  }
}

static moe_unicode_class moe_unicode_lookup(uint32_t cp) {
  size_t lo = 0, hi = MOE_UNICODE_NRANGES;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (cp < moe_unicode_ranges[mid][0]) hi = mid;
    else if (cp > moe_unicode_ranges[mid][1]) lo = mid + 1;
    else return (moe_unicode_class)moe_unicode_classes[mid];
  }
  return MOE_UNICODE_OTHER;
}

/* Latin-1 classes, filled on first use (idempotent: a race writes the same values). */
static uint8_t moe_unicode_latin1[256];
static volatile int moe_unicode_latin1_ready;

moe_unicode_class moe_unicode_class_of(uint32_t cp) {
  if (cp < 256) {
    if (!moe_unicode_latin1_ready) {
      for (uint32_t c = 0; c < 256; c++)
        moe_unicode_latin1[c] = (uint8_t)(moe_unicode_is_space(c) ? MOE_UNICODE_SPACE
                                                                   : moe_unicode_lookup(c));
      moe_unicode_latin1_ready = 1;
    }
    return (moe_unicode_class)moe_unicode_latin1[cp];
  }
  if (cp == MOE_UTF8_INVALID) return MOE_UNICODE_OTHER;
  if (moe_unicode_is_space(cp)) return MOE_UNICODE_SPACE;
  return moe_unicode_lookup(cp);
}

int moe_utf8_decode(const unsigned char *s, size_t len, uint32_t *cp) {
  unsigned c = s[0];
  if (c < 0x80) {
    *cp = c;
    return 1;
  }
  int n;
  uint32_t v, min;
  if (c >= 0xC2 && c <= 0xDF) n = 2, v = c & 0x1F, min = 0x80;
  else if (c >= 0xE0 && c <= 0xEF) n = 3, v = c & 0x0F, min = 0x800;
  else if (c >= 0xF0 && c <= 0xF4) n = 4, v = c & 0x07, min = 0x10000;
  else {
    *cp = MOE_UTF8_INVALID;
    return 1;
  }
  if ((size_t)n > len) {
    *cp = MOE_UTF8_INVALID;
    return 1;
  }
  for (int i = 1; i < n; i++) {
    if ((s[i] & 0xC0) != 0x80) {
      *cp = MOE_UTF8_INVALID;
      return 1;
    }
    v = (v << 6) | (s[i] & 0x3F);
  }
  if (v < min || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) {
    *cp = MOE_UTF8_INVALID;
    return 1;
  }
  *cp = v;
  return n;
}

/* The class of the code point at pos (and its length in *n). */
static moe_unicode_class moe_class_at(const unsigned char *s, size_t len, size_t pos, int *n) {
  uint32_t cp;
  if (s[pos] < 0x80) {
    *n = 1;
    return moe_unicode_class_of(s[pos]);
  }
  *n = moe_utf8_decode(s + pos, len - pos, &cp);
  return moe_unicode_class_of(cp);
}

/* The end of the run of code points of class cls starting at pos. */
static size_t moe_run_end(const unsigned char *s, size_t len, size_t pos, moe_unicode_class cls) {
  int n;
  while (pos < len && moe_class_at(s, len, pos, &n) == cls) pos += (size_t)n;
  return pos;
}

size_t moe_gpt2_piece_end(const unsigned char *s, size_t len, size_t pos) {
  int n;
  /* 's|'t|'re|'ve|'m|'ll|'d */
  if (s[pos] == '\'' && pos + 1 < len) {
    unsigned char a = s[pos + 1], b = pos + 2 < len ? s[pos + 2] : 0;
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return pos + 2;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return pos + 3;
  }
  /* ' ?' followed by a letter, a number or an other: one of the next three */
  size_t start = pos;
  if (s[pos] == ' ' && pos + 1 < len) {
    moe_unicode_class next = moe_class_at(s, len, pos + 1, &n);
    if (next != MOE_UNICODE_SPACE) start = pos + 1;
  }
  moe_unicode_class cls = moe_class_at(s, len, start, &n);
  if (cls != MOE_UNICODE_SPACE) return moe_run_end(s, len, start + (size_t)n, cls);
  /* \s+(?!\S) | \s+ : the whitespace run, less its last code point when
   * something other than whitespace follows and the run has two or more */
  size_t end = pos, last = pos;
  while (end < len && moe_class_at(s, len, end, &n) == MOE_UNICODE_SPACE) {
    last = end;
    end += (size_t)n;
  }
  if (end < len && last > pos) return last;
  return end;
}
