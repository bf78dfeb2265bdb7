/*
 * json.h - a small strict JSON reader for file headers (safetensors.c), not
 * part of the public API.
 *
 * It reads RFC 8259 JSON into a tree, with two restrictions that fit headers
 * and keep the reader small: numbers must be integers (a fraction or an
 * exponent is an error: headers hold sizes and offsets), and strings may not
 * contain U+0000 (they become C strings). Everything else is checked: UTF-8
 * (overlong forms, surrogates and bytes past U+10FFFF rejected), escapes
 * (\uXXXX with surrogate pairs), control characters in strings, duplicate
 * keys in one object, nesting deeper than MOE_JSON_MAX_DEPTH, and anything
 * but whitespace after the value. An error gives the byte offset where the
 * text stopped making sense and a short message.
 *
 * The tree is owned by its root: moe_json_free(root) frees everything.
 * Memory: the strings (keys too) live in one buffer of len + 1 bytes (a
 * decoded string and its terminator never outgrow its quoted text), the
 * values in one array per list or object, 32 bytes each. Texts are at
 * most 4 GiB - 1 bytes (offsets are 32-bit).
 */
#ifndef MOE_JSON_H
#define MOE_JSON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define MOE_JSON_MAX_DEPTH 64

typedef enum moe_json_type {
  MOE_JSON_NULL = 0,
  MOE_JSON_BOOL,
  MOE_JSON_INT,
  MOE_JSON_STRING,
  MOE_JSON_ARRAY,
  MOE_JSON_OBJECT
} moe_json_type;

typedef struct moe_json moe_json;
/* 32 bytes a value (64-bit hosts): a header of many small values costs
 * about 16 times its text at most (a list of "0,"), and a caller can bound
 * lists with moe_json_parse_limited. */
struct moe_json {
  moe_json_type type;
  uint32_t offset;   /* byte offset of the value's first character */
  size_t n;          /* ARRAY, OBJECT: number of items / members */
  union {
    struct {
      uint64_t u;    /* INT: absolute value (at most 2^64 - 1) */
      bool negative; /* INT: the sign */
    };
    bool boolean;    /* BOOL */
    struct {
      char *str;     /* STRING: NUL-terminated UTF-8 (no NUL inside) */
      size_t len;    /* STRING: bytes, without the terminator */
    };
    struct {
      moe_json *items; /* ARRAY: (n) values; OBJECT: (n) member values */
      char **keys;     /* OBJECT: (n) member names, in text order */
    };
  };
};

/* Parses text[0, len). On success *out is the root (free with
 * moe_json_free). On failure returns false, writes the byte offset of the
 * problem to *err_offset and a message (no trailing period) to err, and
 * allocates nothing. */
bool moe_json_parse(const char *text, size_t len, moe_json **out, size_t *err_offset, char *err,
                    size_t errlen);
void moe_json_free(moe_json *root);
/* moe_json_parse, where a list of more than max_list items (0: no limit)
 * is an error at its first extra item: a reader that knows its lists are
 * short (a safetensors shape) then never builds a long one. */
bool moe_json_parse_limited(const char *text, size_t len, size_t max_list, moe_json **out,
                            size_t *err_offset, char *err, size_t errlen);

/* The member named key of an object (NULL when absent or not an object). */
const moe_json *moe_json_get(const moe_json *obj, const char *key);
/* "null", "a boolean", "an integer", "a string", "a list", "an object". */
const char *moe_json_type_name(moe_json_type t);
/* Whether s[0, len) is well-formed UTF-8 (the same rules the reader uses). */
bool moe_utf8_valid(const char *s, size_t len);

#endif /* MOE_JSON_H */
