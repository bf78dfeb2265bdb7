/*
 * lindex.c - Lua bindings of indexing, bincount, sorting, topk, joining, rotary embedding,
 * multinomial.
 * Registered by luaopen_moe through lm_open_index (see lmoe_internal.h).
 *
 * Each function serves as moe.<op>(x, ...) and as the method x:<op>(...)
 * (the tensor comes first either way). Dims are 0-based, negative from the
 * end. Ops returning values and indices return two tensors; split and chunk
 * return a Lua list of views.
 */
#include <stdlib.h>
#include <string.h>

#include "lmoe_internal.h"

/* ------------------------------------------------------------ helpers */

static bool lm_optbool(lua_State *L, int arg, const char *fname, const char *what, bool def) {
  if (lua_isnoneornil(L, arg)) return def;
  if (lua_type(L, arg) != LUA_TBOOLEAN)
    lm_argerror(L, arg, fname, "%s must be a boolean, got %s", what, lm_typename(L, arg));
  return lua_toboolean(L, arg);
}

/* Two results: values and indices. */
static int lm_result2(lua_State *L, lm_state *S, lm_tensor *r1, lm_tensor *r2, moe_status st,
                      moe_tensor *o1, moe_tensor *o2, const char *fname) {
  if (st != MOE_OK) return lm_corefail(L, S, fname, 0);
  lm_adopt(r1, S, o1);
  lm_adopt(r2, S, o2);
  return 2;
}

/* A list of tensors at arg (a table), into a scratch array; *n its length. */
static moe_tensor **lm_checklist(lua_State *L, int arg, const char *fname, int *n) {
  if (lua_type(L, arg) != LUA_TTABLE)
    lm_argerror(L, arg, fname, "a list of tensors expected, got %s", lm_typename(L, arg));
  lua_Unsigned len = lua_rawlen(L, arg);
  if (len == 0) lm_argerror(L, arg, fname, "the list of tensors is empty");
  if (len > 1000000) lm_argerror(L, arg, fname, "the list holds too many tensors");
  void **box = lm_push_scratch(L); /* freed by the collector, even after an error */
  moe_tensor **xs = (moe_tensor **)malloc(sizeof(moe_tensor *) * (size_t)len);
  if (!xs) luaL_error(L, "%s: not enough memory", fname);
  *box = xs;
  for (lua_Unsigned i = 0; i < len; i++) {
    lua_rawgeti(L, arg, (lua_Integer)i + 1);
    lm_tensor *u = lm_testtensor(L, -1);
    if (!u) lm_argerror(L, arg, fname, "element %d must be a tensor, got %s", (int)i + 1, lm_typename(L, -1));
    if (!u->t) lm_argerror(L, arg, fname, "element %d is a freed tensor", (int)i + 1);
    xs[i] = u->t;
    lua_pop(L, 1);
  }
  *n = (int)len;
  return xs;
}

/* Pushes a Lua list adopting outs[0..n). */
static int lm_push_list(lua_State *L, lm_state *S, int n, moe_tensor **outs) {
  lua_createtable(L, n, 0);
  for (int i = 0; i < n; i++) {
    lm_tensor *r = lm_push_empty(L);
    lm_adopt(r, S, outs[i]);
    outs[i] = NULL;
    lua_rawseti(L, -2, i + 1);
  }
  return 1;
}

/* ------------------------------------------------- gather / scatter */

static int lm_gather(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *x = lm_checktensor(L, 1, "gather");
  int d = lm_checkdim(L, S, 2, "gather", x->ndim, false);
  moe_tensor *idx = lm_checktensor(L, 3, "gather");
  lm_checkend(L, 3, "gather");
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_gather(S->ctx, x, d, idx, &out));
  return lm_result(L, S, r, st, out, "gather", 0);
}

static int lm_scatter_common(lua_State *L, bool add, const char *fname) {
  lm_state *S = lm_S(L);
  moe_tensor *x = lm_checktensor(L, 1, fname);
  int d = lm_checkdim(L, S, 2, fname, x->ndim, false);
  moe_tensor *idx = lm_checktensor(L, 3, fname);
  moe_tensor *src = lm_checktensor(L, 4, fname);
  lm_checkend(L, 4, fname);
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  if (add) LM_CALL(L, st, moe_scatter_add(S->ctx, x, d, idx, src, &out));
  else LM_CALL(L, st, moe_scatter(S->ctx, x, d, idx, src, &out));
  return lm_result(L, S, r, st, out, fname, 0);
}

static int lm_scatter(lua_State *L) { return lm_scatter_common(L, false, "scatter"); }
static int lm_scatter_add(lua_State *L) { return lm_scatter_common(L, true, "scatter_add"); }

static int lm_index_select(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *x = lm_checktensor(L, 1, "index_select");
  int d = lm_checkdim(L, S, 2, "index_select", x->ndim, false);
  moe_tensor *idx = lm_checktensor(L, 3, "index_select");
  lm_checkend(L, 3, "index_select");
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_index_select(S->ctx, x, d, idx, &out));
  return lm_result(L, S, r, st, out, "index_select", 0);
}

static int lm_index_add(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *x = lm_checktensor(L, 1, "index_add");
  int d = lm_checkdim(L, S, 2, "index_add", x->ndim, false);
  moe_tensor *idx = lm_checktensor(L, 3, "index_add");
  moe_tensor *src = lm_checktensor(L, 4, "index_add");
  lm_checkend(L, 4, "index_add");
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_index_add(S->ctx, x, d, idx, src, &out));
  return lm_result(L, S, r, st, out, "index_add", 0);
}

/* moe.embedding(weight, ids) */
static int lm_embedding(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *w = lm_checktensor(L, 1, "embedding");
  moe_tensor *ids = lm_checktensor(L, 2, "embedding");
  lm_checkend(L, 2, "embedding");
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_embedding(S->ctx, w, ids, &out));
  return lm_result(L, S, r, st, out, "embedding", 0);
}

/* moe.one_hot(ids [, num_classes = -1]) */
static int lm_one_hot(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *ids = lm_checktensor(L, 1, "one_hot");
  int64_t n = lm_optint(L, 2, "one_hot", "num_classes", -1);
  lm_checkend(L, 2, "one_hot");
  if (n < -1) lm_argerror(L, 2, "one_hot", "num_classes must be >= 0 (or -1 to infer), got %I", (LUAI_UACINT)n);
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_one_hot(S->ctx, ids, n, &out));
  return lm_result(L, S, r, st, out, "one_hot", 0);
}

/* moe.bincount(ids, E): (E) i64 counts of the ids */
static int lm_bincount(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *ids = lm_checktensor(L, 1, "bincount");
  int64_t E = lm_checkint(L, 2, "bincount", "number of bins");
  lm_checkend(L, 2, "bincount");
  if (E < 0) lm_argerror(L, 2, "bincount", "the number of bins must be >= 0, got %I", (LUAI_UACINT)E);
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_bincount(S->ctx, ids, E, &out));
  return lm_result(L, S, r, st, out, "bincount", 0);
}

/* ------------------------------------------------------ sort, topk */

/* moe.sort(x [, dim = -1 [, descending = false]]) -> values, indices */
static int lm_sort(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *x = lm_checktensor(L, 1, "sort");
  if (x->ndim == 0) lm_argerror(L, 1, "sort", "a tensor with at least one dim expected, got a scalar");
  int d = lua_isnoneornil(L, 2) ? x->ndim - 1 : lm_checkdim(L, S, 2, "sort", x->ndim, false);
  bool desc = lm_optbool(L, 3, "sort", "descending", false);
  lm_checkend(L, 3, "sort");
  lm_tensor *rv = lm_push_empty(L), *ri = lm_push_empty(L);
  moe_tensor *v = NULL, *i = NULL;
  moe_status st;
  LM_CALL(L, st, moe_sort(S->ctx, x, d, desc, &v, &i));
  return lm_result2(L, S, rv, ri, st, v, i, "sort");
}

static int lm_argsort(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *x = lm_checktensor(L, 1, "argsort");
  if (x->ndim == 0) lm_argerror(L, 1, "argsort", "a tensor with at least one dim expected, got a scalar");
  int d = lua_isnoneornil(L, 2) ? x->ndim - 1 : lm_checkdim(L, S, 2, "argsort", x->ndim, false);
  bool desc = lm_optbool(L, 3, "argsort", "descending", false);
  lm_checkend(L, 3, "argsort");
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_argsort(S->ctx, x, d, desc, &out));
  return lm_result(L, S, r, st, out, "argsort", 0);
}

/* moe.topk(x, k [, dim = -1 [, largest = true]]) -> values, indices */
static int lm_topk(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *x = lm_checktensor(L, 1, "topk");
  if (x->ndim == 0) lm_argerror(L, 1, "topk", "a tensor with at least one dim expected, got a scalar");
  int64_t k = lm_checkint(L, 2, "topk", "k");
  int d = lua_isnoneornil(L, 3) ? x->ndim - 1 : lm_checkdim(L, S, 3, "topk", x->ndim, false);
  bool largest = lm_optbool(L, 4, "topk", "largest", true);
  lm_checkend(L, 4, "topk");
  if (k < 0 || k > x->shape[d])
    lm_argerror(L, 2, "topk", "k = %I is outside [0, %I] (size of dim %d)", (LUAI_UACINT)k,
                (LUAI_UACINT)x->shape[d], d);
  lm_tensor *rv = lm_push_empty(L), *ri = lm_push_empty(L);
  moe_tensor *v = NULL, *i = NULL;
  moe_status st;
  LM_CALL(L, st, moe_topk(S->ctx, x, k, d, largest, &v, &i));
  return lm_result2(L, S, rv, ri, st, v, i, "topk");
}

/* ------------------------------------------------------------ joining */

static int lm_join(lua_State *L, bool stack, const char *fname) {
  lm_state *S = lm_S(L);
  int n = 0;
  int64_t dim = lm_optint(L, 2, fname, "dim", 0);
  lm_checkend(L, 2, fname);
  moe_tensor **xs = lm_checklist(L, 1, fname, &n); /* pushes the scratch box */
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  if (stack) LM_CALL(L, st, moe_stack(S->ctx, n, xs, dim, &out));
  else LM_CALL(L, st, moe_cat(S->ctx, n, xs, dim, &out));
  return lm_result(L, S, r, st, out, fname, 0);
}

/* moe.cat({a, b, ...} [, dim = 0]), moe.stack({a, b, ...} [, dim = 0]) */
static int lm_cat(lua_State *L) { return lm_join(L, false, "cat"); }
static int lm_stack(lua_State *L) { return lm_join(L, true, "stack"); }

/* x:split(size [, dim = 0]) or x:split({s1, s2, ...} [, dim = 0]) -> list of views */
static int lm_split(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *x = lm_checktensor(L, 1, "split");
  if (x->ndim == 0) lm_argerror(L, 1, "split", "a tensor with at least one dim expected, got a scalar");
  int d = lua_isnoneornil(L, 3) ? 0 : lm_checkdim(L, S, 3, "split", x->ndim, false);
  lm_checkend(L, 3, "split");
  int n = 0;
  int64_t *sizes = NULL;
  void **box = lm_push_scratch(L);
  if (lua_type(L, 2) == LUA_TTABLE) {
    lua_Unsigned len = lua_rawlen(L, 2);
    if (len == 0 || len > 1000000) lm_argerror(L, 2, "split", "sizes must be a non-empty list of sizes");
    sizes = (int64_t *)malloc(sizeof(int64_t) * (size_t)len);
    if (!sizes) luaL_error(L, "split: not enough memory");
    *box = sizes;
    int64_t sum = 0;
    for (lua_Unsigned i = 0; i < len; i++) {
      lua_rawgeti(L, 2, (lua_Integer)i + 1);
      int isint = 0;
      lua_Integer v = lua_type(L, -1) == LUA_TNUMBER ? lua_tointegerx(L, -1, &isint) : 0;
      if (!isint || v < 0)
        lm_argerror(L, 2, "split", "sizes[%d] must be a non-negative integer, got %s", (int)i + 1, lm_describe(L, -1));
      sizes[i] = v;
      sum += v;
      lua_pop(L, 1);
    }
    if (sum != x->shape[d])
      lm_argerror(L, 2, "split", "sizes sum to %I but dim %d has size %I", (LUAI_UACINT)sum, d,
                  (LUAI_UACINT)x->shape[d]);
    n = (int)len;
  } else {
    int64_t size = lm_checkint(L, 2, "split", "split_size");
    if (size < 1) lm_argerror(L, 2, "split", "split_size must be >= 1, got %I", (LUAI_UACINT)size);
    if (moe_split_count(S->ctx, x, size, d, &n) != MOE_OK) lm_corefail(L, S, "split", 2);
  }
  moe_tensor **outs = (moe_tensor **)calloc((size_t)n, sizeof(moe_tensor *));
  if (!outs) luaL_error(L, "split: not enough memory");
  void **obox = lm_push_scratch(L);
  *obox = outs;
  moe_status st;
  int got = n;
  if (sizes) st = moe_split_sizes(S->ctx, x, n, sizes, d, outs);
  else st = moe_split(S->ctx, x, lua_tointeger(L, 2), d, n, outs, &got);
  if (st != MOE_OK) return lm_corefail(L, S, "split", 0);
  return lm_push_list(L, S, got, outs);
}

/* x:chunk(n [, dim = 0]) -> list of views */
static int lm_chunk(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *x = lm_checktensor(L, 1, "chunk");
  if (x->ndim == 0) lm_argerror(L, 1, "chunk", "a tensor with at least one dim expected, got a scalar");
  int64_t chunks = lm_checkint(L, 2, "chunk", "chunks");
  int d = lua_isnoneornil(L, 3) ? 0 : lm_checkdim(L, S, 3, "chunk", x->ndim, false);
  lm_checkend(L, 3, "chunk");
  if (chunks < 1) lm_argerror(L, 2, "chunk", "chunks must be >= 1, got %I", (LUAI_UACINT)chunks);
  int n = 0;
  if (moe_chunk_count(S->ctx, x, chunks, d, &n) != MOE_OK) lm_corefail(L, S, "chunk", 2);
  moe_tensor **outs = (moe_tensor **)calloc((size_t)n, sizeof(moe_tensor *));
  if (!outs) luaL_error(L, "chunk: not enough memory");
  void **box = lm_push_scratch(L);
  *box = outs;
  int got = 0;
  if (moe_chunk(S->ctx, x, chunks, d, n, outs, &got) != MOE_OK) return lm_corefail(L, S, "chunk", 0);
  return lm_push_list(L, S, got, outs);
}

/* ------------------------------------------------------------- rope */

/* moe.rope(x, cos, sin [, layout = "bthd" | "bhtd"]) */
static int lm_rope(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *x = lm_checktensor(L, 1, "rope");
  moe_tensor *c = lm_checktensor(L, 2, "rope");
  moe_tensor *s = lm_checktensor(L, 3, "rope");
  moe_rope_layout layout = MOE_ROPE_BTHD;
  if (!lua_isnoneornil(L, 4)) {
    const char *name = lua_type(L, 4) == LUA_TSTRING ? lua_tostring(L, 4) : NULL;
    if (name && strcmp(name, "bthd") == 0) layout = MOE_ROPE_BTHD;
    else if (name && strcmp(name, "bhtd") == 0) layout = MOE_ROPE_BHTD;
    else lm_argerror(L, 4, "rope", "layout must be 'bthd' or 'bhtd', got %s", lm_describe(L, 4));
  }
  lm_checkend(L, 4, "rope");
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_rope(S->ctx, x, c, s, layout, &out));
  return lm_result(L, S, r, st, out, "rope", 0);
}

/* moe.rope_cache(T, D [, base = 10000] [, {dtype = "f32", device = "cpu"}]) -> cos, sin */
static int lm_rope_cache(lua_State *L) {
  lm_state *S = lm_S(L);
  int64_t T = lm_checkint(L, 1, "rope_cache", "T");
  int64_t D = lm_checkint(L, 2, "rope_cache", "D");
  int oarg = 3;
  double base = 10000.0;
  if (lua_type(L, 3) == LUA_TNUMBER || lua_isnil(L, 3)) {
    base = lm_optnum(L, 3, "rope_cache", "base", 10000.0);
    oarg = 4;
  }
  lm_opts o;
  lm_checkopts(L, S, oarg, "rope_cache", LM_OPT_DTYPE | LM_OPT_DEVICE, &o);
  lm_checkend(L, oarg, "rope_cache");
  if (T < 0) lm_argerror(L, 1, "rope_cache", "T must be >= 0, got %I", (LUAI_UACINT)T);
  if (D <= 0 || D % 2 != 0) lm_argerror(L, 2, "rope_cache", "D must be even and > 0, got %I", (LUAI_UACINT)D);
  if (!(base > 0)) lm_argerror(L, 3, "rope_cache", "base must be > 0, got %f", (LUAI_UACNUMBER)base);
  lm_tensor *rc = lm_push_empty(L), *rs = lm_push_empty(L);
  moe_tensor *c = NULL, *s = NULL;
  moe_status st;
  LM_CALL(L, st, moe_rope_cache(S->ctx, T, D, base, o.has_dtype ? o.dtype : MOE_F32, o.device, &c, &s));
  return lm_result2(L, S, rc, rs, st, c, s, "rope_cache");
}

/* moe.multinomial(probs, num_samples [, replacement = false]) */
static int lm_multinomial(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *p = lm_checktensor(L, 1, "multinomial");
  int64_t n = lm_checkint(L, 2, "multinomial", "num_samples");
  bool repl = lm_optbool(L, 3, "multinomial", "replacement", false);
  lm_checkend(L, 3, "multinomial");
  if (n < 0) lm_argerror(L, 2, "multinomial", "num_samples must be >= 0, got %I", (LUAI_UACINT)n);
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_multinomial(S->ctx, p, n, repl, &out));
  return lm_result(L, S, r, st, out, "multinomial", 0);
}

/* ------------------------------------------------------ registration */

static const luaL_Reg lm_index_functions[] = {
    {"gather", lm_gather},           {"scatter", lm_scatter},
    {"scatter_add", lm_scatter_add}, {"index_select", lm_index_select},
    {"index_add", lm_index_add},     {"embedding", lm_embedding},
    {"one_hot", lm_one_hot},         {"sort", lm_sort},
    {"argsort", lm_argsort},         {"topk", lm_topk},
    {"cat", lm_cat},                 {"stack", lm_stack},
    {"split", lm_split},             {"chunk", lm_chunk},
    {"rope", lm_rope},               {"rope_cache", lm_rope_cache},
    {"multinomial", lm_multinomial}, {"bincount", lm_bincount},
    {NULL, NULL}};

static const luaL_Reg lm_index_methods[] = {
    {"gather", lm_gather},           {"scatter", lm_scatter},
    {"scatter_add", lm_scatter_add}, {"index_select", lm_index_select},
    {"index_add", lm_index_add},     {"one_hot", lm_one_hot},
    {"sort", lm_sort},               {"argsort", lm_argsort},
    {"topk", lm_topk},               {"split", lm_split},
    {"chunk", lm_chunk},             {"rope", lm_rope},
    {"multinomial", lm_multinomial}, {"bincount", lm_bincount},
    {NULL, NULL}};

void lm_open_index(lua_State *L, int mod, int methods, int sentinel) {
  lm_register(L, mod, methods, sentinel, lm_index_functions, lm_index_methods);
}
