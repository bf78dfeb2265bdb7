/*
 * json.c - the strict JSON reader of json.h: recursive descent over the
 * text, one malloc'd tree. Every parse function keeps its value freeable at
 * any point (counts cover only initialised entries), so a failure anywhere
 * is cleaned up by freeing the root. Strings are written one after the
 * other into the document's string buffer (jdoc.strings, len + 1 bytes,
 * touched only as far as it is used), so a string costs no allocation.
 */
#include "json.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct jparser {
  const unsigned char *s;
  size_t len, pos;
  int depth;
  size_t max_list;  /* 0: no limit */
  char *strings;    /* the document's string buffer */
  size_t used;      /* bytes of it taken */
  size_t err_offset;
  char *err;
  size_t errlen;
} jparser;

#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static bool jfail(jparser *p, size_t at, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(p->err, p->errlen, fmt, ap);
  va_end(ap);
  p->err_offset = at;
  return false;
}

/* "'x'" for a printable character, "byte 0xNN" otherwise. */
static const char *jchar(unsigned char c, char *buf, size_t len) {
  if (c > 0x20 && c < 0x7f) snprintf(buf, len, "'%c'", c);
  else snprintf(buf, len, "byte 0x%02x", c);
  return buf;
}

static void jskip_ws(jparser *p) {
  while (p->pos < p->len) {
    unsigned char c = p->s[p->pos];
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
    p->pos++;
  }
}

/* Length of the well-formed UTF-8 sequence at s[0, len) (1 to 4), 0 if
 * there is none (RFC 3629: no overlong forms, no surrogates, <= U+10FFFF). */
static size_t utf8_seq(const unsigned char *s, size_t len) {
  unsigned char c = s[0];
  if (c < 0x80) return 1;
  size_t n;
  unsigned char lo = 0x80, hi = 0xbf;
  if (c >= 0xc2 && c <= 0xdf) n = 2;
  else if (c >= 0xe0 && c <= 0xef) {
    n = 3;
    if (c == 0xe0) lo = 0xa0;
    if (c == 0xed) hi = 0x9f;
  } else if (c >= 0xf0 && c <= 0xf4) {
    n = 4;
    if (c == 0xf0) lo = 0x90;
    if (c == 0xf4) hi = 0x8f;
  } else {
    return 0;
  }
  if (len < n) return 0;
  if (s[1] < lo || s[1] > hi) return 0;
  for (size_t i = 2; i < n; i++)
    if (s[i] < 0x80 || s[i] > 0xbf) return 0;
  return n;
}

bool moe_utf8_valid(const char *s, size_t len) {
  const unsigned char *u = (const unsigned char *)s;
  size_t i = 0;
  while (i < len) {
    size_t n = utf8_seq(u + i, len - i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

/* The root value and the buffer every string of the tree points into. */
typedef struct jdoc {
  moe_json root; /* first: a moe_json * of the root is a jdoc * */
  char *strings;
} jdoc;

static void jfree_contents(moe_json *v) {
  if (v->type != MOE_JSON_ARRAY && v->type != MOE_JSON_OBJECT) return;
  for (size_t i = 0; i < v->n; i++)
    if (v->items) jfree_contents(&v->items[i]);
  free(v->items);
  free(v->keys);
}

void moe_json_free(moe_json *root) {
  if (!root) return;
  jfree_contents(root);
  free(((jdoc *)root)->strings);
  free(root);
}

static int hexval(unsigned char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

/* Four hex digits at s[at]; -1 if they are not. */
static long jhex4(jparser *p, size_t at) {
  if (at + 4 > p->len) return -1;
  long v = 0;
  for (size_t i = 0; i < 4; i++) {
    int h = hexval(p->s[at + i]);
    if (h < 0) return -1;
    v = v * 16 + h;
  }
  return v;
}

static size_t put_utf8(char *o, unsigned long cp) {
  if (cp < 0x80) {
    o[0] = (char)cp;
    return 1;
  }
  if (cp < 0x800) {
    o[0] = (char)(0xc0 | (cp >> 6));
    o[1] = (char)(0x80 | (cp & 0x3f));
    return 2;
  }
  if (cp < 0x10000) {
    o[0] = (char)(0xe0 | (cp >> 12));
    o[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
    o[2] = (char)(0x80 | (cp & 0x3f));
    return 3;
  }
  o[0] = (char)(0xf0 | (cp >> 18));
  o[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
  o[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
  o[3] = (char)(0x80 | (cp & 0x3f));
  return 4;
}

/* A string at p->pos (which is at the opening quote) into *out / *outlen. */
static bool jstring(jparser *p, char **out, size_t *outlen) {
  size_t start = p->pos;
  size_t i = start + 1;
  /* Find the closing quote first: the decoded text is never longer. */
  while (i < p->len && p->s[i] != '"') i += p->s[i] == '\\' ? 2 : 1;
  if (i >= p->len) return jfail(p, start, "unterminated string");
  size_t end = i;
  char *buf = p->strings + p->used; /* room: the decoded text + 1 < end + 1 - start */
  size_t o = 0;
  char cb[16];
  i = start + 1;
  while (i < end) {
    unsigned char c = p->s[i];
    if (c == '\\') {
      unsigned char e = p->s[i + 1];
      const char *simple = strchr("\"\\/bfnrt", e);
      if (e != 0 && simple) {
        static const char map[] = "\"\\/\b\f\n\r\t";
        buf[o++] = map[simple - "\"\\/bfnrt"];
        i += 2;
        continue;
      }
      if (e != 'u') {
        return jfail(p, i, "invalid escape '\\%c' in a string", e > 0x20 && e < 0x7f ? e : '?');
      }
      long cp = jhex4(p, i + 2);
      if (cp < 0 || i + 6 > end) {
        return jfail(p, i, "invalid \\u escape (four hex digits expected)");
      }
      size_t esc_at = i;
      i += 6;
      if (cp >= 0xdc00 && cp <= 0xdfff) {
        return jfail(p, esc_at, "unpaired low surrogate \\u%04lx in a string", cp);
      }
      if (cp >= 0xd800 && cp <= 0xdbff) {
        long lo = (i + 6 <= end && p->s[i] == '\\' && p->s[i + 1] == 'u') ? jhex4(p, i + 2) : -1;
        if (lo < 0xdc00 || lo > 0xdfff) {
            return jfail(p, esc_at, "unpaired high surrogate \\u%04lx in a string", cp);
        }
        cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
        i += 6;
      }
      if (cp == 0) {
        return jfail(p, esc_at, "\\u0000 in a string is not supported");
      }
      o += put_utf8(buf + o, (unsigned long)cp);
      continue;
    }
    if (c < 0x20) {
      return jfail(p, i, "control character %s in a string (it must be escaped)",
                   jchar(c, cb, sizeof cb));
    }
    size_t n = utf8_seq(p->s + i, end - i);
    if (n == 0) {
      return jfail(p, i, "invalid UTF-8 in a string (%s)", jchar(c, cb, sizeof cb));
    }
    memcpy(buf + o, p->s + i, n);
    o += n;
    i += n;
  }
  buf[o] = '\0';
  p->used += o + 1;
  p->pos = end + 1;
  *out = buf;
  *outlen = o;
  return true;
}

static bool jnumber(jparser *p, moe_json *v) {
  size_t start = p->pos;
  v->type = MOE_JSON_INT;
  if (p->s[p->pos] == '-') {
    v->negative = true;
    p->pos++;
  }
  if (p->pos >= p->len || p->s[p->pos] < '0' || p->s[p->pos] > '9')
    return jfail(p, p->pos, "a digit expected after '-'");
  if (p->s[p->pos] == '0' && p->pos + 1 < p->len && p->s[p->pos + 1] >= '0' &&
      p->s[p->pos + 1] <= '9')
    return jfail(p, start, "leading zeros are not allowed in a number");
  uint64_t u = 0;
  while (p->pos < p->len && p->s[p->pos] >= '0' && p->s[p->pos] <= '9') {
    unsigned d = (unsigned)(p->s[p->pos] - '0');
    if (u > (UINT64_MAX - d) / 10) return jfail(p, start, "integer too large (more than 2^64 - 1)");
    u = u * 10 + d;
    p->pos++;
  }
  if (p->pos < p->len && (p->s[p->pos] == '.' || p->s[p->pos] == 'e' || p->s[p->pos] == 'E'))
    return jfail(p, start, "only integers are supported here (a fraction or an exponent found)");
  v->u = u;
  return true;
}

typedef struct jkey {
  const char *k;
  size_t off;
} jkey;

static int jkey_cmp(const void *a, const void *b) {
  const jkey *x = a, *y = b;
  int c = strcmp(x->k, y->k);
  if (c) return c;
  return x->off < y->off ? -1 : x->off > y->off;
}

static bool jvalue(jparser *p, moe_json *v);

static bool jarray(jparser *p, moe_json *v) {
  size_t cap = 0;
  v->type = MOE_JSON_ARRAY;
  p->pos++; /* '[' */
  jskip_ws(p);
  if (p->pos < p->len && p->s[p->pos] == ']') {
    p->pos++;
    return true;
  }
  for (;;) {
    if (p->max_list && v->n == p->max_list)
      return jfail(p, p->pos, "a list of more than %zu items", p->max_list);
    if (v->n == cap) {
      size_t nc = cap ? cap * 2 : 2;
      moe_json *ni = realloc(v->items, nc * sizeof *ni);
      if (!ni) return jfail(p, p->pos, "out of memory reading a list");
      v->items = ni;
      cap = nc;
    }
    memset(&v->items[v->n], 0, sizeof v->items[0]);
    v->n++;
    if (!jvalue(p, &v->items[v->n - 1])) return false;
    jskip_ws(p);
    if (p->pos >= p->len) return jfail(p, p->pos, "unexpected end of the text in a list");
    unsigned char c = p->s[p->pos++];
    if (c == ']') return true;
    if (c != ',') {
      char cb[16];
      return jfail(p, p->pos - 1, "expected ',' or ']' in a list, got %s", jchar(c, cb, sizeof cb));
    }
    jskip_ws(p);
  }
}

/* Checks the keys of an object for a duplicate: ks holds (name, offset) of
 * each member and is sorted here. */
static bool jcheck_keys(jparser *p, jkey *ks, size_t n) {
  if (n < 2) return true;
  qsort(ks, n, sizeof *ks, jkey_cmp);
  for (size_t i = 1; i < n; i++)
    if (strcmp(ks[i - 1].k, ks[i].k) == 0) /* the message may quote a long key */
      return jfail(p, ks[i].off, "duplicate key \"%.200s\" in an object", ks[i].k);
  return true;
}

static bool jobject_members(jparser *p, moe_json *v, jkey **ks);

static bool jobject(jparser *p, moe_json *v) {
  jkey *ks = NULL; /* (v->n) names and offsets, for the duplicate check */
  bool ok = jobject_members(p, v, &ks) && jcheck_keys(p, ks, v->n);
  free(ks);
  return ok;
}

static bool jobject_members(jparser *p, moe_json *v, jkey **ks) {
  size_t cap = 0;
  char cb[16];
  v->type = MOE_JSON_OBJECT;
  p->pos++; /* '{' */
  jskip_ws(p);
  if (p->pos < p->len && p->s[p->pos] == '}') {
    p->pos++;
    return true;
  }
  for (;;) {
    if (p->pos >= p->len) return jfail(p, p->pos, "unexpected end of the text in an object");
    if (p->s[p->pos] != '"')
      return jfail(p, p->pos, "expected a string key in an object, got %s",
                   jchar(p->s[p->pos], cb, sizeof cb));
    if (v->n == cap) {
      size_t nc = cap ? cap * 2 : 2;
      moe_json *ni = realloc(v->items, nc * sizeof *ni);
      if (ni) v->items = ni;
      char **nk = ni ? realloc(v->keys, nc * sizeof *nk) : NULL;
      if (nk) v->keys = nk;
      jkey *no = nk ? realloc(*ks, nc * sizeof *no) : NULL;
      if (!no) return jfail(p, p->pos, "out of memory reading an object");
      *ks = no;
      cap = nc;
    }
    size_t key_at = p->pos, klen = 0;
    char *key = NULL;
    if (!jstring(p, &key, &klen)) return false;
    memset(&v->items[v->n], 0, sizeof v->items[0]);
    v->keys[v->n] = key;
    (*ks)[v->n] = (jkey){key, key_at};
    v->n++;
    jskip_ws(p);
    if (p->pos >= p->len || p->s[p->pos] != ':')
      return jfail(p, p->pos, "expected ':' after the key \"%s\"", key);
    p->pos++;
    jskip_ws(p);
    if (!jvalue(p, &v->items[v->n - 1])) return false;
    jskip_ws(p);
    if (p->pos >= p->len) return jfail(p, p->pos, "unexpected end of the text in an object");
    unsigned char c = p->s[p->pos++];
    if (c == '}') return true;
    if (c != ',')
      return jfail(p, p->pos - 1, "expected ',' or '}' in an object, got %s", jchar(c, cb, sizeof cb));
    jskip_ws(p);
  }
}

static bool jliteral(jparser *p, const char *word) {
  size_t n = strlen(word);
  if (p->len - p->pos < n || memcmp(p->s + p->pos, word, n) != 0) {
    char cb[16];
    return jfail(p, p->pos, "expected a value, got %s", jchar(p->s[p->pos], cb, sizeof cb));
  }
  p->pos += n;
  return true;
}

static bool jvalue(jparser *p, moe_json *v) {
  jskip_ws(p);
  v->offset = (uint32_t)p->pos;
  if (p->pos >= p->len) return jfail(p, p->pos, "unexpected end of the text (a value expected)");
  unsigned char c = p->s[p->pos];
  switch (c) {
    case '{':
    case '[': {
      if (p->depth >= MOE_JSON_MAX_DEPTH)
        return jfail(p, p->pos, "nesting deeper than %d levels", MOE_JSON_MAX_DEPTH);
      p->depth++;
      bool ok = c == '{' ? jobject(p, v) : jarray(p, v);
      p->depth--;
      return ok;
    }
    case '"':
      v->type = MOE_JSON_STRING;
      return jstring(p, &v->str, &v->len);
    case 't':
      v->type = MOE_JSON_BOOL;
      v->boolean = true;
      return jliteral(p, "true");
    case 'f':
      v->type = MOE_JSON_BOOL;
      return jliteral(p, "false");
    case 'n':
      v->type = MOE_JSON_NULL;
      return jliteral(p, "null");
    default:
      if (c == '-' || (c >= '0' && c <= '9')) return jnumber(p, v);
      {
        char cb[16];
        return jfail(p, p->pos, "expected a value, got %s", jchar(c, cb, sizeof cb));
      }
  }
}

bool moe_json_parse_limited(const char *text, size_t len, size_t max_list, moe_json **out,
                            size_t *err_offset, char *err, size_t errlen) {
  char dummy[8];
  jparser p = {(const unsigned char *)text, len, 0, 0, max_list, NULL, 0, 0, err ? err : dummy,
               err ? errlen : sizeof dummy};
  p.err[0] = '\0';
  jdoc *doc = NULL;
  bool ok = true;
  if (len > UINT32_MAX) ok = jfail(&p, 0, "a text of %zu bytes (at most 4 GiB - 1)", len);
  if (ok) doc = calloc(1, sizeof *doc);
  if (doc) doc->strings = p.strings = malloc(len + 1);
  if (ok && (!doc || !doc->strings)) ok = jfail(&p, 0, "out of memory");
  if (ok) ok = jvalue(&p, &doc->root);
  if (ok) {
    jskip_ws(&p);
    if (p.pos < p.len) {
      char cb[16];
      ok = jfail(&p, p.pos, "unexpected %s after the end of the JSON value",
                 jchar(p.s[p.pos], cb, sizeof cb));
    }
  }
  if (!ok) {
    moe_json_free(doc ? &doc->root : NULL);
    if (err_offset) *err_offset = p.err_offset;
    return false;
  }
  *out = &doc->root;
  return true;
}

bool moe_json_parse(const char *text, size_t len, moe_json **out, size_t *err_offset, char *err,
                    size_t errlen) {
  return moe_json_parse_limited(text, len, 0, out, err_offset, err, errlen);
}

const moe_json *moe_json_get(const moe_json *obj, const char *key) {
  if (!obj || obj->type != MOE_JSON_OBJECT) return NULL;
  for (size_t i = 0; i < obj->n; i++)
    if (strcmp(obj->keys[i], key) == 0) return &obj->items[i];
  return NULL;
}

const char *moe_json_type_name(moe_json_type t) {
  switch (t) {
    case MOE_JSON_NULL: return "null";
    case MOE_JSON_BOOL: return "a boolean";
    case MOE_JSON_INT: return "an integer";
    case MOE_JSON_STRING: return "a string";
    case MOE_JSON_ARRAY: return "a list";
    case MOE_JSON_OBJECT: return "an object";
  }
  return "?";
}
