/*
 * ldata.c - Lua bindings of the data family (core/moe_data.h): Megatron-LM
 * indexed datasets, under the `moe.ops` sub-table:
 *
 *   local ds = moe.ops.indexed_dataset(prefix)   -- opens prefix.bin/.idx
 *   #ds, ds:num_sequences(), ds:num_documents(), ds:num_tokens(), ds:dtype()
 *   ds:size(i), ds:token_offset(i), ds:document_start(d)   -- 0-based
 *   ds:get(i [, offset [, length]])      -> (length) i64 CPU tensor
 *   ds:windows(seq_begin, seq_end, starts, len) -> (#starts, len) i64 tensor
 *   ds:unigram_entropy([seq_begin, seq_end]) -> nats
 *   ds:close()  (also __close and __gc)
 *
 *   local b = moe.ops.indexed_builder(prefix, "u16")
 *   b:add(tokens)   -- a Lua array of integers or a tensor, one sequence
 *   b:end_document(); b:finalize(); b:free()
 *
 *   local e = moe.ops.bpe_encoder(byte_ids, left, right, result, "gpt2"|"none")
 *   e:encode(str) -> array of ids; e:free()  (also __close and __gc)
 *       byte-level BPE (core/moe_bpe.h): byte_ids[b + 1] is the id of byte b
 *       (-1: none), merge r joins left[r], right[r] into result[r]
 *   moe.ops.gpt2_pieces(str) -> the pieces of the GPT-2 pre-tokenizer
 *   moe.ops.unicode_class(code_point) -> "letter", "number", "space" or "other"
 *
 * lua/moe/data/ builds IndexedDataset, the builder, GPTDataset and the
 * preprocessing on these. Registered by luaopen_moe through lm_open_data.
 */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "lmoe_internal.h"
#include "moe_bpe.h"
#include "moe_data.h"

#define LM_DATASET "moe.IndexedDataset"
#define LM_BUILDER "moe.IndexedBuilder"
#define LM_BPE "moe.BPEEncoder"

typedef struct lm_dataset {
  moe_indexed_dataset *ds; /* NULL after close */
} lm_dataset;

typedef struct lm_builder {
  moe_indexed_builder *b; /* NULL after free */
} lm_builder;

static moe_indexed_dataset *lm_checkds(lua_State *L, int arg, const char *fname) {
  lm_dataset *u = (lm_dataset *)luaL_testudata(L, arg, LM_DATASET);
  if (u == NULL) lm_argerror(L, arg, fname, "indexed dataset expected, got %s", lm_typename(L, arg));
  if (u->ds == NULL) lm_argerror(L, arg, fname, "attempt to use a closed indexed dataset");
  return u->ds;
}

static moe_indexed_builder *lm_checkbuilder(lua_State *L, int arg, const char *fname) {
  lm_builder *u = (lm_builder *)luaL_testudata(L, arg, LM_BUILDER);
  if (u == NULL) lm_argerror(L, arg, fname, "indexed builder expected, got %s", lm_typename(L, arg));
  if (u->b == NULL) lm_argerror(L, arg, fname, "attempt to use a freed indexed builder");
  return u->b;
}

/* An integer argument in [lo, hi]. */
static int64_t lm_data_int(lua_State *L, int arg, const char *fname, const char *what, int64_t lo,
                           int64_t hi) {
  int64_t v = lm_checkint(L, arg, fname, what);
  if (v < lo || v > hi)
    lm_argerror(L, arg, fname, "%s %I out of range [%I, %I]", what, (LUAI_UACINT)v,
                (LUAI_UACINT)lo, (LUAI_UACINT)hi);
  return v;
}

/* ------------------------------------------------------------ dataset */

static int lm_dataset_open(lua_State *L) {
  const char *fname = "indexed_dataset";
  lm_state *S = lm_S(L);
  const char *prefix = luaL_checkstring(L, 1);
  lm_checkend(L, 1, fname);
  lm_dataset *u = (lm_dataset *)lua_newuserdatauv(L, sizeof *u, 0);
  u->ds = NULL;
  luaL_setmetatable(L, LM_DATASET);
  if (moe_indexed_dataset_open(S->ctx, prefix, &u->ds) != MOE_OK) return lm_corefail(L, S, fname, 0);
  return 1;
}

static int lm_dataset_close(lua_State *L) {
  lm_dataset *u = (lm_dataset *)luaL_checkudata(L, 1, LM_DATASET);
  moe_indexed_dataset_close(u->ds);
  u->ds = NULL;
  return 0;
}

static int lm_dataset_len(lua_State *L) {
  lua_pushinteger(L, (lua_Integer)moe_indexed_dataset_num_sequences(lm_checkds(L, 1, "__len")));
  return 1;
}

static int lm_dataset_num_documents(lua_State *L) {
  moe_indexed_dataset *ds = lm_checkds(L, 1, "num_documents");
  lua_pushinteger(L, (lua_Integer)moe_indexed_dataset_num_documents(ds));
  return 1;
}

static int lm_dataset_num_tokens(lua_State *L) {
  moe_indexed_dataset *ds = lm_checkds(L, 1, "num_tokens");
  lua_pushinteger(L, (lua_Integer)moe_indexed_dataset_num_tokens(ds));
  return 1;
}

static int lm_dataset_dtype(lua_State *L) {
  moe_indexed_dataset *ds = lm_checkds(L, 1, "dtype");
  lua_pushstring(L, moe_index_dtype_name(moe_indexed_dataset_dtype(ds)));
  return 1;
}

static int lm_dataset_size(lua_State *L) {
  moe_indexed_dataset *ds = lm_checkds(L, 1, "size");
  int64_t n = moe_indexed_dataset_num_sequences(ds);
  int64_t i = lm_data_int(L, 2, "size", "sequence", 0, n - 1);
  lua_pushinteger(L, (lua_Integer)moe_indexed_dataset_size(ds, i));
  return 1;
}

static int lm_dataset_token_offset(lua_State *L) {
  moe_indexed_dataset *ds = lm_checkds(L, 1, "token_offset");
  int64_t n = moe_indexed_dataset_num_sequences(ds);
  int64_t i = lm_data_int(L, 2, "token_offset", "sequence", 0, n);
  lua_pushinteger(L, (lua_Integer)moe_indexed_dataset_token_offset(ds, i));
  return 1;
}

static int lm_dataset_document_start(lua_State *L) {
  moe_indexed_dataset *ds = lm_checkds(L, 1, "document_start");
  int64_t d = lm_data_int(L, 2, "document_start", "document", 0,
                          moe_indexed_dataset_num_documents(ds));
  lua_pushinteger(L, (lua_Integer)moe_indexed_dataset_document_start(ds, d));
  return 1;
}

static int lm_dataset_get(lua_State *L) {
  const char *fname = "get";
  lm_state *S = lm_S(L);
  moe_indexed_dataset *ds = lm_checkds(L, 1, fname);
  int64_t n = moe_indexed_dataset_num_sequences(ds);
  int64_t i = lm_data_int(L, 2, fname, "sequence", 0, n - 1);
  int64_t size = moe_indexed_dataset_size(ds, i);
  int64_t off = lua_isnoneornil(L, 3) ? 0 : lm_data_int(L, 3, fname, "offset", 0, size);
  int64_t len = lua_isnoneornil(L, 4) ? size - off : lm_data_int(L, 4, fname, "length", 0, size - off);
  lm_checkend(L, 4, fname);
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_indexed_dataset_get(S->ctx, ds, i, off, len, &out));
  return lm_result(L, S, r, st, out, fname, 0);
}

static int lm_dataset_windows(lua_State *L) {
  const char *fname = "windows";
  lm_state *S = lm_S(L);
  moe_indexed_dataset *ds = lm_checkds(L, 1, fname);
  int64_t n = moe_indexed_dataset_num_sequences(ds);
  int64_t lo = lm_data_int(L, 2, fname, "seq_begin", 0, n);
  int64_t hi = lm_data_int(L, 3, fname, "seq_end", lo, n);
  luaL_checktype(L, 4, LUA_TTABLE);
  int64_t len = lm_data_int(L, 5, fname, "length", 0, INT64_MAX / 2);
  lm_checkend(L, 5, fname);
  int64_t B = (int64_t)lua_rawlen(L, 4);
  void **box = lm_push_scratch(L);
  *box = malloc(sizeof(int64_t) * (size_t)(B > 0 ? B : 1));
  if (!*box) return luaL_error(L, "%s: out of memory", fname);
  int64_t *starts = (int64_t *)*box;
  for (int64_t b = 0; b < B; b++) {
    lua_rawgeti(L, 4, (lua_Integer)(b + 1));
    if (!lua_isinteger(L, -1))
      lm_argerror(L, 4, fname, "start %I must be an integer, got %s", (LUAI_UACINT)(b + 1),
                  lm_describe(L, -1));
    starts[b] = (int64_t)lua_tointeger(L, -1);
    lua_pop(L, 1);
  }
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_indexed_dataset_windows(S->ctx, ds, lo, hi, starts, B, len, &out));
  return lm_result(L, S, r, st, out, fname, 0);
}

static int lm_dataset_unigram_entropy(lua_State *L) {
  const char *fname = "unigram_entropy";
  lm_state *S = lm_S(L);
  moe_indexed_dataset *ds = lm_checkds(L, 1, fname);
  int64_t n = moe_indexed_dataset_num_sequences(ds);
  int64_t lo = lua_isnoneornil(L, 2) ? 0 : lm_data_int(L, 2, fname, "seq_begin", 0, n);
  int64_t hi = lua_isnoneornil(L, 3) ? n : lm_data_int(L, 3, fname, "seq_end", lo, n);
  lm_checkend(L, 3, fname);
  double h = 0;
  if (moe_indexed_dataset_unigram_entropy(S->ctx, ds, lo, hi, &h) != MOE_OK)
    return lm_corefail(L, S, fname, 0);
  lua_pushnumber(L, (lua_Number)h);
  return 1;
}

/* ds:check_vocab(vocab_size) -> the largest token id (-1 without tokens);
 * an id outside [0, vocab_size) is an error naming the file, sequence, id. */
static int lm_dataset_check_vocab(lua_State *L) {
  const char *fname = "check_vocab";
  lm_state *S = lm_S(L);
  moe_indexed_dataset *ds = lm_checkds(L, 1, fname);
  int64_t vocab = lm_data_int(L, 2, fname, "vocab_size", 1, INT64_MAX);
  lm_checkend(L, 2, fname);
  int64_t top = -1;
  if (moe_indexed_dataset_check_vocab(S->ctx, ds, vocab, &top) != MOE_OK)
    return lm_corefail(L, S, fname, 0);
  lua_pushinteger(L, (lua_Integer)top);
  return 1;
}

static int lm_dataset_tostring(lua_State *L) {
  lm_dataset *u = (lm_dataset *)luaL_checkudata(L, 1, LM_DATASET);
  if (!u->ds) {
    lua_pushliteral(L, "moe.IndexedDataset(closed)");
    return 1;
  }
  lua_pushfstring(L, "moe.IndexedDataset(sequences=%I, documents=%I, tokens=%I, dtype=%s)",
                  (LUAI_UACINT)moe_indexed_dataset_num_sequences(u->ds),
                  (LUAI_UACINT)moe_indexed_dataset_num_documents(u->ds),
                  (LUAI_UACINT)moe_indexed_dataset_num_tokens(u->ds),
                  moe_index_dtype_name(moe_indexed_dataset_dtype(u->ds)));
  return 1;
}

static const luaL_Reg lm_dataset_methods[] = {{"num_sequences", lm_dataset_len},
                                              {"num_documents", lm_dataset_num_documents},
                                              {"num_tokens", lm_dataset_num_tokens},
                                              {"dtype", lm_dataset_dtype},
                                              {"size", lm_dataset_size},
                                              {"token_offset", lm_dataset_token_offset},
                                              {"document_start", lm_dataset_document_start},
                                              {"get", lm_dataset_get},
                                              {"windows", lm_dataset_windows},
                                              {"unigram_entropy", lm_dataset_unigram_entropy},
                                              {"check_vocab", lm_dataset_check_vocab},
                                              {"close", lm_dataset_close},
                                              {NULL, NULL}};

/* ------------------------------------------------------------ builder */

static int lm_builder_open(lua_State *L) {
  const char *fname = "indexed_builder";
  lm_state *S = lm_S(L);
  const char *prefix = luaL_checkstring(L, 1);
  const char *dname = luaL_optstring(L, 2, "u16");
  moe_index_dtype dt;
  if (!moe_index_dtype_parse(dname, &dt))
    lm_argerror(L, 2, fname, "unknown token dtype '%s' (u8, i8, i16, u16, i32, i64)", dname);
  lm_checkend(L, 2, fname);
  lm_builder *u = (lm_builder *)lua_newuserdatauv(L, sizeof *u, 0);
  u->b = NULL;
  luaL_setmetatable(L, LM_BUILDER);
  if (moe_indexed_builder_open(S->ctx, prefix, dt, &u->b) != MOE_OK)
    return lm_corefail(L, S, fname, 0);
  return 1;
}

static int lm_builder_free(lua_State *L) {
  lm_builder *u = (lm_builder *)luaL_checkudata(L, 1, LM_BUILDER);
  moe_indexed_builder_free(u->b);
  u->b = NULL;
  return 0;
}

static int lm_builder_add(lua_State *L) {
  const char *fname = "add";
  lm_state *S = lm_S(L);
  moe_indexed_builder *b = lm_checkbuilder(L, 1, fname);
  lm_checkend(L, 2, fname);
  void **box = lm_push_scratch(L);
  int64_t n;
  if (lua_type(L, 2) == LUA_TTABLE) {
    n = (int64_t)lua_rawlen(L, 2);
    *box = malloc(sizeof(int64_t) * (size_t)(n > 0 ? n : 1));
    if (!*box) return luaL_error(L, "%s: out of memory", fname);
    int64_t *v = (int64_t *)*box;
    for (int64_t i = 0; i < n; i++) {
      lua_rawgeti(L, 2, (lua_Integer)(i + 1));
      if (!lua_isinteger(L, -1))
        lm_argerror(L, 2, fname, "token %I must be an integer, got %s", (LUAI_UACINT)(i + 1),
                    lm_describe(L, -1));
      v[i] = (int64_t)lua_tointeger(L, -1);
      lua_pop(L, 1);
    }
  } else {
    lm_tensor *t = lm_testtensor(L, 2);
    if (!t || !t->t)
      lm_argerror(L, 2, fname, "array of token ids or tensor expected, got %s", lm_describe(L, 2));
    if (t->t->ndim != 1 || moe_dtype_is_float(t->t->dtype))
      lm_argerror(L, 2, fname, "token tensor must be 1-D of an integer dtype, got %dD %s",
                  t->t->ndim, moe_dtype_name(t->t->dtype));
    n = moe_tensor_numel(t->t);
    *box = malloc(sizeof(int64_t) * (size_t)(n > 0 ? n : 1));
    if (!*box) return luaL_error(L, "%s: out of memory", fname);
    if (moe_tensor_to_i64(S->ctx, t->t, (int64_t *)*box) != MOE_OK)
      return lm_corefail(L, S, fname, 2);
  }
  if (moe_indexed_builder_add(S->ctx, b, (const int64_t *)*box, n) != MOE_OK)
    return lm_corefail(L, S, fname, 2);
  return 0;
}

static int lm_builder_end_document(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_indexed_builder *b = lm_checkbuilder(L, 1, "end_document");
  lm_checkend(L, 1, "end_document");
  if (moe_indexed_builder_end_document(S->ctx, b) != MOE_OK)
    return lm_corefail(L, S, "end_document", 0);
  return 0;
}

static int lm_builder_finalize(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_indexed_builder *b = lm_checkbuilder(L, 1, "finalize");
  lm_checkend(L, 1, "finalize");
  if (moe_indexed_builder_finalize(S->ctx, b) != MOE_OK) return lm_corefail(L, S, "finalize", 0);
  return 0;
}

static const luaL_Reg lm_builder_methods[] = {{"add", lm_builder_add},
                                              {"end_document", lm_builder_end_document},
                                              {"finalize", lm_builder_finalize},
                                              {"free", lm_builder_free},
                                              {NULL, NULL}};

/* ------------------------------------------------------------ BPE */

typedef struct lm_bpe {
  moe_bpe *b; /* NULL after free */
} lm_bpe;

/* The integers of the array at arg into a new int32 array in a scratch box
 * (pushed); *n gets the length. Each must be in [lo, INT32_MAX]. */
static int32_t *lm_bpe_ints(lua_State *L, int arg, const char *fname, const char *what, int32_t lo,
                            int64_t *n) {
  if (lua_type(L, arg) != LUA_TTABLE) lm_argerror(L, arg, fname, "array of %s expected, got %s",
                                                   what, lm_typename(L, arg));
  *n = (int64_t)lua_rawlen(L, arg);
  void **box = lm_push_scratch(L);
  *box = malloc(sizeof(int32_t) * (size_t)(*n > 0 ? *n : 1));
  if (!*box) luaL_error(L, "%s: out of memory", fname);
  int32_t *v = (int32_t *)*box;
  for (int64_t i = 0; i < *n; i++) {
    lua_rawgeti(L, arg, (lua_Integer)(i + 1));
    int ok = 0;
    lua_Integer x = lua_tointegerx(L, -1, &ok);
    if (!ok || x < lo || x > INT32_MAX)
      lm_argerror(L, arg, fname, "%s[%I] must be an integer in [%d, %d], got %s", what,
                  (LUAI_UACINT)(i + 1), (int)lo, (int)INT32_MAX, lm_describe(L, -1));
    v[i] = (int32_t)x;
    lua_pop(L, 1);
  }
  return v;
}

static int lm_bpe_new(lua_State *L) {
  const char *fname = "bpe_encoder";
  lm_state *S = lm_S(L);
  static const char *const splits[] = {"gpt2", "none", NULL};
  lm_checkend(L, 5, fname);
  int64_t nb, nl, nr, nres;
  int32_t *bytes = lm_bpe_ints(L, 1, fname, "byte ids", -1, &nb);
  if (nb != 256) lm_argerror(L, 1, fname, "256 byte ids expected, got %I", (LUAI_UACINT)nb);
  int32_t *left = lm_bpe_ints(L, 2, fname, "left ids", 0, &nl);
  int32_t *right = lm_bpe_ints(L, 3, fname, "right ids", 0, &nr);
  int32_t *result = lm_bpe_ints(L, 4, fname, "result ids", 0, &nres);
  if (nr != nl || nres != nl)
    lm_argerror(L, 3, fname, "left, right and result must have one length, got %I, %I and %I",
                (LUAI_UACINT)nl, (LUAI_UACINT)nr, (LUAI_UACINT)nres);
  int split = luaL_checkoption(L, 5, "gpt2", splits);
  lm_bpe *u = (lm_bpe *)lua_newuserdatauv(L, sizeof *u, 0);
  u->b = NULL;
  luaL_setmetatable(L, LM_BPE);
  if (moe_bpe_new(S->ctx, bytes, nl, left, right, result, (moe_bpe_split)split, &u->b) != MOE_OK)
    return lm_corefail(L, S, fname, 0);
  return 1;
}

static int lm_bpe_free(lua_State *L) {
  lm_bpe *u = (lm_bpe *)luaL_checkudata(L, 1, LM_BPE);
  moe_bpe_free(u->b);
  u->b = NULL;
  return 0;
}

static int lm_bpe_encode(lua_State *L) {
  const char *fname = "encode";
  lm_state *S = lm_S(L);
  lm_bpe *u = (lm_bpe *)luaL_testudata(L, 1, LM_BPE);
  if (u == NULL) lm_argerror(L, 1, fname, "BPE encoder expected, got %s", lm_typename(L, 1));
  if (u->b == NULL) lm_argerror(L, 1, fname, "attempt to use a freed BPE encoder");
  if (lua_type(L, 2) != LUA_TSTRING)
    lm_argerror(L, 2, fname, "string expected, got %s", lm_typename(L, 2));
  lm_checkend(L, 2, fname);
  size_t len;
  const char *s = lua_tolstring(L, 2, &len);
  const int32_t *ids;
  size_t n;
  if (moe_bpe_encode(S->ctx, u->b, s, len, &ids, &n) != MOE_OK) return lm_corefail(L, S, fname, 2);
  if (n > (size_t)INT_MAX) return luaL_error(L, "%s: %zu ids do not fit a Lua array", fname, n);
  lua_createtable(L, (int)n, 0);
  for (size_t i = 0; i < n; i++) {
    lua_pushinteger(L, (lua_Integer)ids[i]);
    lua_rawseti(L, -2, (lua_Integer)(i + 1));
  }
  return 1;
}

static const luaL_Reg lm_bpe_methods[] = {{"encode", lm_bpe_encode}, {"free", lm_bpe_free},
                                          {NULL, NULL}};

static int lm_gpt2_pieces(lua_State *L) {
  const char *fname = "gpt2_pieces";
  if (lua_type(L, 1) != LUA_TSTRING)
    lm_argerror(L, 1, fname, "string expected, got %s", lm_typename(L, 1));
  lm_checkend(L, 1, fname);
  size_t len;
  const unsigned char *s = (const unsigned char *)lua_tolstring(L, 1, &len);
  lua_newtable(L);
  lua_Integer k = 0;
  for (size_t pos = 0; pos < len;) {
    size_t end = moe_gpt2_piece_end(s, len, pos);
    lua_pushlstring(L, (const char *)s + pos, end - pos);
    lua_rawseti(L, -2, ++k);
    pos = end;
  }
  return 1;
}

static int lm_unicode_class(lua_State *L) {
  const char *fname = "unicode_class";
  static const char *const names[] = {"other", "letter", "number", "space"};
  int64_t cp = lm_checkint(L, 1, fname, "code point");
  if (cp < 0 || cp > 0x10FFFF)
    lm_argerror(L, 1, fname, "code point %I out of range [0, 0x10FFFF]", (LUAI_UACINT)cp);
  lm_checkend(L, 1, fname);
  lua_pushstring(L, names[moe_unicode_class_of((uint32_t)cp)]);
  return 1;
}

/* ------------------------------------------------------------ open */

static void lm_data_metatable(lua_State *L, const char *name, lua_CFunction release,
                              const luaL_Reg *methods, int sentinel) {
  if (luaL_newmetatable(L, name)) {
    lua_pushcfunction(L, release);
    lua_setfield(L, -2, "__gc");
    lua_pushcfunction(L, release);
    lua_setfield(L, -2, "__close");
    lua_newtable(L);
    lua_pushvalue(L, sentinel);
    luaL_setfuncs(L, methods, 1);
    lua_setfield(L, -2, "__index");
  }
}

static const luaL_Reg lm_data_functions[] = {{"indexed_dataset", lm_dataset_open},
                                             {"indexed_builder", lm_builder_open},
                                             {"bpe_encoder", lm_bpe_new},
                                             {"gpt2_pieces", lm_gpt2_pieces},
                                             {"unicode_class", lm_unicode_class},
                                             {NULL, NULL}};

void lm_open_data(lua_State *L, int ops, int methods, int sentinel) {
  sentinel = lua_absindex(L, sentinel);
  lm_data_metatable(L, LM_DATASET, lm_dataset_close, lm_dataset_methods, sentinel);
  lua_pushcfunction(L, lm_dataset_len);
  lua_setfield(L, -2, "__len");
  lua_pushcfunction(L, lm_dataset_tostring);
  lua_setfield(L, -2, "__tostring");
  lua_pop(L, 1);
  lm_data_metatable(L, LM_BUILDER, lm_builder_free, lm_builder_methods, sentinel);
  lua_pop(L, 1);
  lm_data_metatable(L, LM_BPE, lm_bpe_free, lm_bpe_methods, sentinel);
  lua_pop(L, 1);
  lm_register(L, ops, methods, sentinel, lm_data_functions, NULL);
}
