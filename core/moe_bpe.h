/*
 * moe_bpe.h - byte-level BPE encoding as GPT-2 and Hugging Face tokenizers
 * do it: the GPT-2 pre-tokenizer (its regex, written out by hand over Unicode
 * letter/number/space classes) cuts text into pieces, and each piece, as
 * bytes, is merged pair by pair, lowest merge rank first (leftmost among
 * equal ranks), exactly as tokenizers' BPE model does. Implemented in
 * core/unicode.c (classes, UTF-8, the pre-tokenizer; tables generated into
 * core/unicode_tables.h by tools/gen_unicode_tables.py) and core/bpe.c (the
 * merges and a bounded cache of encoded pieces). CPU only; no Lua.
 *
 * The caller (lua/moe/data/gpt2.lua) maps the GPT-2 byte-to-unicode token
 * strings of vocab.json / tokenizer.json back to bytes and hands over ids:
 * the token of each single byte and the merges as (left, right) -> result
 * id in rank order. Special tokens (<|endoftext|>) are cut out of the text
 * by the caller before encoding.
 */
#ifndef MOE_BPE_H
#define MOE_BPE_H

#include "moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The classes of the GPT-2 regex: \p{L}, \p{N}, \s (White_Space), other. */
typedef enum moe_unicode_class {
  MOE_UNICODE_OTHER = 0,
  MOE_UNICODE_LETTER = 1,
  MOE_UNICODE_NUMBER = 2,
  MOE_UNICODE_SPACE = 3
} moe_unicode_class;

moe_unicode_class moe_unicode_class_of(uint32_t cp);
/* The Unicode version the letter/number tables were generated from. */
const char *moe_unicode_version(void);

/* Decodes the UTF-8 code point at s[0..len) (len >= 1) into *cp and returns
 * its length in bytes (1..4). A byte that starts no valid sequence (stray
 * continuation, overlong form, surrogate, truncated) is one code point of its
 * own with *cp = MOE_UTF8_INVALID (class other). */
#define MOE_UTF8_INVALID 0xFFFFFFFFu
int moe_utf8_decode(const unsigned char *s, size_t len, uint32_t *cp);

/* The GPT-2 pre-tokenizer
 *   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 * returns the end (exclusive) of the piece that starts at pos < len. */
size_t moe_gpt2_piece_end(const unsigned char *s, size_t len, size_t pos);

typedef struct moe_bpe moe_bpe;

/* How text is cut into pieces before merging. */
typedef enum moe_bpe_split {
  MOE_BPE_SPLIT_GPT2 = 0, /* the GPT-2 regex (ByteLevel use_regex = true) */
  MOE_BPE_SPLIT_NONE = 1  /* the whole text is one piece */
} moe_bpe_split;

/* byte_ids[b]: the id of the token of byte b, or -1 when the vocabulary has
 * none (encoding such a byte fails). Merge r (rank r, 0-based) joins the
 * adjacent ids left[r], right[r] into result[r]. Ids are >= 0. */
moe_status moe_bpe_new(moe_ctx *ctx, const int32_t byte_ids[256], int64_t n_merges,
                       const int32_t *left, const int32_t *right, const int32_t *result,
                       moe_bpe_split split, moe_bpe **out);
void moe_bpe_free(moe_bpe *b); /* NULL: no-op */

/* Encodes len bytes of text (any bytes; special tokens already cut out).
 * *ids points into b and stays valid until the next call on b; *n ids. */
moe_status moe_bpe_encode(moe_ctx *ctx, moe_bpe *b, const char *text, size_t len,
                          const int32_t **ids, size_t *n);

#ifdef __cplusplus
}
#endif
#endif /* MOE_BPE_H */
