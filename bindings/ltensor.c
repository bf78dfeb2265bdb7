/*
 * ltensor.c - moe.Tensor: tensors as userdata over the C core (moe.h), as
 * liolib.c makes files userdata.
 *
 *   local moe = require "moe"
 *   local x = moe.randn({2, 3}, {dtype = "f32", device = "cpu"})
 *   local y = (x * 2 + 1):transpose(0, 1)
 *   print(y, y.shape[1], y:size(-1))
 *
 * Dims and indices are 0-based (as in moe.h); a negative dim counts from the
 * end. Tables we return (t.shape, t:stride(), t:totable()) are ordinary Lua
 * sequences starting at 1: t.shape[1] is the size of dim 0.
 *
 * Owns the tensor userdata (lm_tensor), its metatable "moe.Tensor" and the
 * method table moe.Tensor (both created once per Lua state by
 * lm_push_methods; the op families add their methods to it), and the
 * functions of the class: constructors (moe.empty, zeros, ..., tensor),
 * fields, reading, views, conversions, fills, arithmetic, printing.
 *
 * Lifecycle (STYLE.md point 5). A tensor userdata owns one reference to its
 * moe_tensor and one to the lm_state holding the context (linit.c). A
 * binding pushes the owning userdata empty (lm_push_empty) before it calls
 * the core; lm_result then adopts the core's fresh tensor (lm_adopt) or
 * raises the core's error, the userdata owning nothing yet. Tensors are
 * freed by t:free(), by a to-be-closed variable (local t <close> = ...) or
 * by __gc, all through lm_release, which is idempotent; any other use of a
 * freed tensor raises "attempt to use a freed tensor". Lua's collector sees
 * a small handle, not the storage behind it (STYLE.md point 6): lm_result
 * runs a full collection every gc_step bytes of fresh CUDA storage handed to
 * Lua, and every host_gc_step bytes of fresh host storage (lm_gc_pressure),
 * and an allocation that fails for lack of memory is
 * retried once after a full collection (LM_CALL).
 */
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lmoe_internal.h"

/* ------------------------------ tensor userdata: creation, adoption, free */

lm_tensor *lm_push_empty(lua_State *L) {
  lm_tensor *u = (lm_tensor *)lua_newuserdatauv(L, sizeof *u, 0);
  u->t = NULL;
  u->S = NULL;
  luaL_setmetatable(L, LM_TENSOR);
  lm_scope_track(L); /* moe.scope: the innermost scope frees it (bindings/lscope.c) */
  return u;
}

/* Also counts t's storage when it is fresh (a view shares its base's and is
 * not counted) in the collector debt of its device (lm_gc_pressure). */
void lm_adopt(lm_tensor *u, lm_state *S, moe_tensor *t) {
  u->t = t;
  u->S = S;
  S->refs++;
  if (t && t->storage && t->storage->refcount == 1) {
    if (t->storage->device.type == MOE_DEVICE_CUDA) S->gc_debt += (int64_t)t->storage->block;
    else S->host_gc_debt += (int64_t)t->storage->block;
  }
}

/* The one free function: t:free(), __close and __gc. Idempotent. */
void lm_release(lm_tensor *u) {
  if (u->t) {
    moe_tensor_release(u->t);
    u->t = NULL;
    lm_state_unref(u->S);
    u->S = NULL;
  }
}

lm_tensor *lm_testtensor(lua_State *L, int arg) {
  return (lm_tensor *)luaL_testudata(L, arg, LM_TENSOR);
}

moe_tensor *lm_checktensor(lua_State *L, int arg, const char *fname) {
  lm_tensor *u = lm_testtensor(L, arg);
  if (u == NULL) lm_argerror(L, arg, fname, "tensor expected, got %s", lm_typename(L, arg));
  if (u->t == NULL) lm_argerror(L, arg, fname, "attempt to use a freed tensor");
  return u->t;
}

/* Runs a full collection when gc_step bytes of fresh CUDA storage, or
 * host_gc_step bytes of fresh host storage, were handed to Lua since the
 * last (lm_adopt counts them; a step <= 0 turns its device's off). Called
 * with the new result on the stack, so it survives the cycle. */
static void lm_gc_pressure(lua_State *L, lm_state *S) {
  if ((S->gc_step <= 0 || S->gc_debt < S->gc_step) && (S->host_gc_step <= 0 || S->host_gc_debt < S->host_gc_step))
    return;
  S->gc_debt = S->host_gc_debt = 0; /* a full cycle frees what is dead of both */
  S->gc_cycles++;
  lua_gc(L, LUA_GCCOLLECT);
}

/* The common tail of a binding whose result is the tensor userdata `r` at
 * the top of the stack: adopt `out`, or raise the core's error (r owns
 * nothing yet, so nothing is left to free). */
int lm_result(lua_State *L, lm_state *S, lm_tensor *r, moe_status st, moe_tensor *out,
                     const char *fname, int arg) {
  if (st != MOE_OK) return lm_corefail(L, S, fname, arg);
  lm_adopt(r, S, out);
  lm_gc_pressure(L, S);
  return 1;
}

/* ---------------------------------------------------------- constructors */

/* Sets requires_grad on the adopted result r (at the top of the stack) when
 * the options asked for it; on failure frees r and raises the core's error. */
static int lm_apply_grad_opt(lua_State *L, lm_state *S, lm_tensor *r, const lm_opts *o,
                             const char *fname) {
  if (!o->requires_grad) return 1;
  if (moe_set_requires_grad(S->ctx, r->t, true) != MOE_OK) {
    lm_release(r);
    return lm_corefail(L, S, fname, 0);
  }
  return 1;
}

/* lm_result, then the requires_grad option. */
static int lm_result_opts(lua_State *L, lm_state *S, lm_tensor *r, moe_status st,
                          moe_tensor *out, const char *fname, const lm_opts *o) {
  lm_result(L, S, r, st, out, fname, 0);
  return lm_apply_grad_opt(L, S, r, o, fname);
}

enum { LM_EMPTY, LM_ZEROS, LM_ONES, LM_RAND, LM_RANDN };

static int lm_construct(lua_State *L, int kind, const char *fname) {
  lm_state *S = lm_S(L);
  int ndim = 0;
  int64_t shape[MOE_MAX_DIMS];
  lm_opts o;
  if (lua_isnone(L, 1))
    lm_argerror(L, 1, fname, "shape expected (a table of sizes, or sizes as numbers), got no value");
  int optarg = lm_checkshape(L, 1, fname, false, &ndim, shape);
  lm_checkopts(L, S, optarg, fname, LM_OPT_DTYPE | LM_OPT_DEVICE | LM_OPT_GRAD, &o);
  lm_checkend(L, optarg, fname);

  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  if (kind == LM_ZEROS || kind == LM_ONES)
    LM_CALL(L, st, moe_tensor_full(S->ctx, ndim, shape, kind == LM_ONES ? 1.0 : 0.0, o.dtype, o.device, &out));
  else
    LM_CALL(L, st, moe_tensor_empty(S->ctx, ndim, shape, o.dtype, o.device, &out));
  if (st != MOE_OK) return lm_corefail(L, S, fname, 0);
  lm_adopt(r, S, out);
  lm_gc_pressure(L, S);
  if (kind == LM_RAND) st = moe_uniform_(S->ctx, out, 0.0, 1.0);
  if (kind == LM_RANDN) st = moe_normal_(S->ctx, out, 0.0, 1.0);
  if (st != MOE_OK) {
    lm_release(r);
    return lm_corefail(L, S, fname, 0);
  }
  return lm_apply_grad_opt(L, S, r, &o, fname);
}

static int lm_empty(lua_State *L) { return lm_construct(L, LM_EMPTY, "empty"); }
static int lm_zeros(lua_State *L) { return lm_construct(L, LM_ZEROS, "zeros"); }
static int lm_ones(lua_State *L) { return lm_construct(L, LM_ONES, "ones"); }
static int lm_rand(lua_State *L) { return lm_construct(L, LM_RAND, "rand"); }
static int lm_randn(lua_State *L) { return lm_construct(L, LM_RANDN, "randn"); }

/* moe.full(shape, value [, opts]): dtype from the value unless given
 * (boolean -> bool, integer -> i64, float -> f32). */
static int lm_full(lua_State *L) {
  lm_state *S = lm_S(L);
  int ndim = 0;
  int64_t shape[MOE_MAX_DIMS];
  lm_opts o;
  if (lua_type(L, 1) != LUA_TTABLE)
    lm_argerror(L, 1, "full", "shape table expected, got %s", lm_typename(L, 1));
  lm_checkshape(L, 1, "full", false, &ndim, shape);
  double v = lm_checkvalue(L, 2, "full");
  lm_checkopts(L, S, 3, "full", LM_OPT_DTYPE | LM_OPT_DEVICE | LM_OPT_GRAD, &o);
  lm_checkend(L, 3, "full");
  if (!o.has_dtype)
    o.dtype = lua_type(L, 2) == LUA_TBOOLEAN ? MOE_BOOL : lua_isinteger(L, 2) ? MOE_I64 : MOE_F32;

  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_tensor_full(S->ctx, ndim, shape, v, o.dtype, o.device, &out));
  return lm_result_opts(L, S, r, st, out, "full", &o);
}

/* moe.randint(low, high, shape [, opts]) or moe.randint(high, shape [, opts]):
 * integers in [low, high), i64 unless dtype says otherwise. */
static int lm_randint(lua_State *L) {
  lm_state *S = lm_S(L);
  int ndim = 0;
  int64_t shape[MOE_MAX_DIMS];
  lm_opts o;
  int64_t low = 0, high;
  int sarg;
  if (lua_type(L, 2) == LUA_TTABLE) { /* randint(high, shape) */
    high = lm_checkint(L, 1, "randint", "high");
    sarg = 2;
  } else {
    low = lm_checkint(L, 1, "randint", "low");
    high = lm_checkint(L, 2, "randint", "high");
    sarg = 3;
  }
  if (lua_type(L, sarg) != LUA_TTABLE)
    lm_argerror(L, sarg, "randint", "shape table expected, got %s", lm_typename(L, sarg));
  lm_checkshape(L, sarg, "randint", false, &ndim, shape);
  lm_checkopts(L, S, sarg + 1, "randint", LM_OPT_DTYPE | LM_OPT_DEVICE | LM_OPT_GRAD, &o);
  lm_checkend(L, sarg + 1, "randint");
  if (!o.has_dtype) o.dtype = MOE_I64;
  if (high <= low)
    lm_argerror(L, sarg - 1, "randint", "empty range: high (%I) must be greater than low (%I)",
                (LUAI_UACINT)high, (LUAI_UACINT)low);

  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_tensor_empty(S->ctx, ndim, shape, o.dtype, o.device, &out));
  if (st != MOE_OK) return lm_corefail(L, S, "randint", 0);
  lm_adopt(r, S, out);
  if (moe_randint_(S->ctx, out, low, high) != MOE_OK) {
    lm_release(r);
    return lm_corefail(L, S, "randint", 0);
  }
  return lm_apply_grad_opt(L, S, r, &o, "randint");
}

/* moe.arange(end), arange(start, end [, step]) [, opts]: i64 when every
 * bound is an integer, f32 otherwise (unless dtype is given). */
static int lm_arange(lua_State *L) {
  lm_state *S = lm_S(L);
  lm_opts o;
  int nnum = 0;
  bool all_int = true;
  while (nnum < 3 && lua_type(L, nnum + 1) == LUA_TNUMBER) {
    all_int = all_int && lua_isinteger(L, nnum + 1);
    nnum++;
  }
  if (nnum == 0) lm_argerror(L, 1, "arange", "end must be a number, got %s", lm_typename(L, 1));
  double a = lua_tonumber(L, 1), b = 0, step = 1;
  if (nnum == 1) {
    b = a;
    a = 0;
  } else {
    b = lua_tonumber(L, 2);
    if (nnum == 3) step = lua_tonumber(L, 3);
  }
  if (!lua_isnoneornil(L, nnum + 1) && lua_type(L, nnum + 1) != LUA_TTABLE)
    lm_argerror(L, nnum + 1, "arange", "%s expected, got %s",
                nnum == 3 ? "options table" : "number or options table", lm_typename(L, nnum + 1));
  lm_checkopts(L, S, nnum + 1, "arange", LM_OPT_DTYPE | LM_OPT_DEVICE | LM_OPT_GRAD, &o);
  lm_checkend(L, nnum + 1, "arange");
  if (!o.has_dtype) o.dtype = all_int ? MOE_I64 : MOE_F32;
  if (!isfinite(a) || !isfinite(b) || !isfinite(step))
    lm_argerror(L, 1, "arange", "start, end and step must be finite, got %f, %f, %f", (LUAI_UACNUMBER)a,
                (LUAI_UACNUMBER)b, (LUAI_UACNUMBER)step);
  if (step == 0) lm_argerror(L, 3, "arange", "step must not be zero");

  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_arange(S->ctx, a, b, step, o.dtype, o.device, &out));
  return lm_result_opts(L, S, r, st, out, "arange", &o);
}

/* moe.linspace(start, end, steps [, opts]) */
static int lm_linspace(lua_State *L) {
  lm_state *S = lm_S(L);
  lm_opts o;
  double a = lm_checknum(L, 1, "linspace", "start");
  double b = lm_checknum(L, 2, "linspace", "end");
  int64_t steps = lm_checkint(L, 3, "linspace", "steps");
  if (!isfinite(a) || !isfinite(b))
    lm_argerror(L, isfinite(a) ? 2 : 1, "linspace", "start and end must be finite, got %f and %f",
                (LUAI_UACNUMBER)a, (LUAI_UACNUMBER)b);
  if (steps < 0) lm_argerror(L, 3, "linspace", "steps must be non-negative, got %I", (LUAI_UACINT)steps);
  lm_checkopts(L, S, 4, "linspace", LM_OPT_DTYPE | LM_OPT_DEVICE | LM_OPT_GRAD, &o);
  lm_checkend(L, 4, "linspace");

  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_linspace(S->ctx, a, b, steps, o.dtype, o.device, &out));
  return lm_result_opts(L, S, r, st, out, "linspace", &o);
}

/* ------------------------------------------------ moe.tensor(data, opts) */

enum { LM_SEEN_INT = 1, LM_SEEN_FLOAT = 2, LM_SEEN_BOOL = 4 };

typedef struct lm_nested {
  int ndim;
  int64_t shape[MOE_MAX_DIMS];
  double *values; /* scratch userdata, numel values */
  int64_t pos;
  unsigned seen;
  char path[MOE_MAX_DIMS * 24 + 8]; /* "[2][3]": where we are, for messages */
} lm_nested;

/* Reads the table at the top of the stack, at depth `dim`, into n->values. */
static void lm_nested_fill(lua_State *L, lm_nested *n, int dim) {
  int tbl = lua_gettop(L);
  size_t plen = strlen(n->path);
  lua_Unsigned len = lua_rawlen(L, tbl);
  if ((int64_t)len != n->shape[dim])
    lm_argerror(L, 1, "tensor", "ragged nested table: data%s has %I elements, expected %I",
                n->path, (LUAI_UACINT)len, (LUAI_UACINT)n->shape[dim]);
  luaL_checkstack(L, 4, "nested table too deep");
  for (lua_Integer i = 1; i <= (lua_Integer)len; i++) {
    snprintf(n->path + plen, sizeof n->path - plen, "[%lld]", (long long)i);
    int ty = lua_rawgeti(L, tbl, i);
    if (dim + 1 < n->ndim) {
      if (ty != LUA_TTABLE)
        lm_argerror(L, 1, "tensor", "ragged nested table: data%s is a %s, expected a table of %I elements",
                    n->path, lm_typename(L, -1), (LUAI_UACINT)n->shape[dim + 1]);
      lm_nested_fill(L, n, dim + 1);
    } else {
      unsigned kind;
      double v;
      if (ty == LUA_TNUMBER) {
        kind = lua_isinteger(L, -1) ? LM_SEEN_INT : LM_SEEN_FLOAT;
        v = (double)lua_tonumber(L, -1);
      } else if (ty == LUA_TBOOLEAN) {
        kind = LM_SEEN_BOOL;
        v = lua_toboolean(L, -1) ? 1.0 : 0.0;
      } else if (ty == LUA_TTABLE) {
        lm_argerror(L, 1, "tensor", "ragged nested table: data%s is a table, expected a number", n->path);
        return;
      } else {
        lm_argerror(L, 1, "tensor", "data%s must be a number or a boolean, got %s", n->path,
                    lm_typename(L, -1));
        return;
      }
      if ((kind == LM_SEEN_BOOL && (n->seen & (LM_SEEN_INT | LM_SEEN_FLOAT))) ||
          (kind != LM_SEEN_BOOL && (n->seen & LM_SEEN_BOOL)))
        lm_argerror(L, 1, "tensor", "data%s mixes booleans and numbers", n->path);
      n->seen |= kind;
      n->values[n->pos++] = v;
    }
    lua_settop(L, tbl);
  }
  n->path[plen] = '\0';
}

static int lm_tensor_new(lua_State *L) {
  lm_state *S = lm_S(L);
  lm_nested n;
  lm_opts o;
  n.ndim = 0;
  n.pos = 0;
  n.seen = 0;
  n.path[0] = '\0';
  int ty = lua_type(L, 1);
  if (ty != LUA_TTABLE && ty != LUA_TNUMBER && ty != LUA_TBOOLEAN)
    lm_argerror(L, 1, "tensor", "data must be a number, a boolean or a nested table, got %s",
                lm_typename(L, 1));
  lm_checkopts(L, S, 2, "tensor", LM_OPT_DTYPE | LM_OPT_DEVICE | LM_OPT_GRAD, &o);
  lm_checkend(L, 2, "tensor");

  /* The shape, from the first element of each level. */
  int64_t numel = 1;
  lua_pushvalue(L, 1);
  while (lua_type(L, -1) == LUA_TTABLE) {
    if (n.ndim == MOE_MAX_DIMS)
      lm_argerror(L, 1, "tensor", "nested table deeper than %d levels", MOE_MAX_DIMS);
    int64_t len = (int64_t)lua_rawlen(L, -1);
    n.shape[n.ndim++] = len;
    if (len > 0 && numel > INT64_MAX / 16 / len) lm_argerror(L, 1, "tensor", "too many elements");
    numel *= len;
    if (len == 0) break;
    lua_rawgeti(L, -1, 1);
    lua_remove(L, -2);
  }
  lua_pop(L, 1);
  if ((uint64_t)numel > SIZE_MAX / sizeof(double)) lm_argerror(L, 1, "tensor", "too many elements");
  n.values = (double *)lua_newuserdatauv(L, (size_t)numel * sizeof(double) + 1, 0); /* scratch */
  if (ty == LUA_TTABLE) {
    lua_pushvalue(L, 1);
    lm_nested_fill(L, &n, 0);
    lua_pop(L, 1);
  } else {
    n.seen = ty == LUA_TBOOLEAN ? LM_SEEN_BOOL : lua_isinteger(L, 1) ? LM_SEEN_INT : LM_SEEN_FLOAT;
    n.values[0] = ty == LUA_TBOOLEAN ? (lua_toboolean(L, 1) ? 1.0 : 0.0) : (double)lua_tonumber(L, 1);
  }
  if (!o.has_dtype)
    o.dtype = (n.seen & LM_SEEN_FLOAT) ? MOE_F32
              : (n.seen & LM_SEEN_INT) ? MOE_I64
              : (n.seen & LM_SEEN_BOOL) ? MOE_BOOL
                                        : MOE_F32; /* no elements */

  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_tensor_from_f64(S->ctx, n.values, n.ndim, n.shape, o.dtype, o.device, &out));
  return lm_result_opts(L, S, r, st, out, "tensor", &o);
}

/* ------------------------------------------------------ fields, reading */

/* Pushes a new handle on t (retained), or nil for NULL. */
static void lm_push_handle(lua_State *L, lm_state *S, moe_tensor *t) {
  if (!t) {
    lua_pushnil(L);
    return;
  }
  lm_tensor *r = lm_push_empty(L);
  moe_tensor_retain(t);
  lm_adopt(r, S, t);
}

/* __index: methods first, then the fields shape, dtype, device, ndim and the
 * autograd fields requires_grad, grad (a new handle on the gradient, or nil),
 * is_leaf, grad_fn (the name of the node that made the tensor, or nil). */
static int lm_index(lua_State *L) {
  lua_pushvalue(L, 2);
  if (lua_rawget(L, lua_upvalueindex(2)) != LUA_TNIL) return 1;
  const char *k = lua_type(L, 2) == LUA_TSTRING ? lua_tostring(L, 2) : NULL;
  if (k == NULL) return 1; /* nil */
  if (strcmp(k, "shape") == 0) {
    moe_tensor *t = lm_checktensor(L, 1, "shape");
    lm_push_ints(L, t->ndim, t->shape);
  } else if (strcmp(k, "dtype") == 0) {
    lua_pushstring(L, moe_dtype_name(lm_checktensor(L, 1, "dtype")->dtype));
  } else if (strcmp(k, "device") == 0) {
    lm_push_device(L, moe_tensor_device(lm_checktensor(L, 1, "device")));
  } else if (strcmp(k, "ndim") == 0) {
    lua_pushinteger(L, lm_checktensor(L, 1, "ndim")->ndim);
  } else if (strcmp(k, "requires_grad") == 0) {
    lua_pushboolean(L, moe_requires_grad(lm_checktensor(L, 1, "requires_grad")));
  } else if (strcmp(k, "grad") == 0) {
    moe_tensor *t = lm_checktensor(L, 1, "grad");
    lm_push_handle(L, lm_S(L), moe_tensor_grad(t));
  } else if (strcmp(k, "is_leaf") == 0) {
    lua_pushboolean(L, moe_tensor_is_leaf(lm_checktensor(L, 1, "is_leaf")));
  } else if (strcmp(k, "grad_fn") == 0) {
    moe_node *n = moe_tensor_grad_fn(lm_checktensor(L, 1, "grad_fn"));
    if (n)
      lua_pushstring(L, moe_node_name(n));
    else
      lua_pushnil(L);
  } else {
    lua_pushnil(L);
  }
  return 1;
}

/* __newindex: t.grad = tensor or nil, t.requires_grad = boolean. */
static int lm_newindex(lua_State *L) {
  lm_state *S = lm_S(L);
  const char *k = lua_type(L, 2) == LUA_TSTRING ? lua_tostring(L, 2) : NULL;
  if (k && strcmp(k, "grad") == 0) {
    moe_tensor *t = lm_checktensor(L, 1, "grad");
    moe_tensor *g = NULL;
    if (!lua_isnil(L, 3)) {
      if (!lm_testtensor(L, 3))
        lm_argerror(L, 3, "grad", "tensor or nil expected, got %s", lm_typename(L, 3));
      g = lm_checktensor(L, 3, "grad");
    }
    if (moe_tensor_set_grad(S->ctx, t, g) != MOE_OK) return lm_corefail(L, S, "grad", 3);
    return 0;
  }
  if (k && strcmp(k, "requires_grad") == 0) {
    moe_tensor *t = lm_checktensor(L, 1, "requires_grad");
    if (lua_type(L, 3) != LUA_TBOOLEAN)
      lm_argerror(L, 3, "requires_grad", "boolean expected, got %s", lm_typename(L, 3));
    if (moe_set_requires_grad(S->ctx, t, lua_toboolean(L, 3)) != MOE_OK)
      return lm_corefail(L, S, "requires_grad", 0);
    return 0;
  }
  return luaL_error(L, "cannot set field '%s' of a tensor (settable fields: grad, requires_grad)",
                    k ? k : lm_typename(L, 2));
}

static int lm_t_numel(lua_State *L) {
  lua_pushinteger(L, (lua_Integer)moe_tensor_numel(lm_checktensor(L, 1, "numel")));
  return 1;
}

static int lm_t_dim(lua_State *L) {
  lua_pushinteger(L, lm_checktensor(L, 1, "dim")->ndim);
  return 1;
}

/* t:size() -> shape table; t:size(dim) -> integer. Same for t:stride(). */
static int lm_size_or_stride(lua_State *L, bool stride, const char *fname) {
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, fname);
  const int64_t *v = stride ? t->stride : t->shape;
  if (lua_isnoneornil(L, 2)) {
    lm_push_ints(L, t->ndim, v);
    return 1;
  }
  int d = lm_checkdim(L, S, 2, fname, t->ndim, false);
  lm_checkend(L, 2, fname);
  lua_pushinteger(L, (lua_Integer)v[d]);
  return 1;
}

static int lm_t_size(lua_State *L) { return lm_size_or_stride(L, false, "size"); }
static int lm_t_stride(lua_State *L) { return lm_size_or_stride(L, true, "stride"); }

static int lm_t_is_contiguous(lua_State *L) {
  lua_pushboolean(L, moe_tensor_is_contiguous(lm_checktensor(L, 1, "is_contiguous")));
  return 1;
}

static int lm_t_storage_offset(lua_State *L) {
  lua_pushinteger(L, (lua_Integer)lm_checktensor(L, 1, "storage_offset")->offset);
  return 1;
}

typedef enum { LM_KIND_FLOAT, LM_KIND_INT, LM_KIND_BOOL } lm_kind;

static lm_kind lm_kind_of(moe_dtype dt) {
  if (dt == MOE_BOOL) return LM_KIND_BOOL;
  return moe_dtype_is_float(dt) ? LM_KIND_FLOAT : LM_KIND_INT;
}

/* Copies every element of t to the host, in row-major order, into a
 * scratch userdata left on the stack: int64 for integer and bool dtypes,
 * double for floats. */
static void *lm_read_all(lua_State *L, lm_state *S, moe_tensor *t, const char *fname) {
  int64_t n = moe_tensor_numel(t);
  if ((uint64_t)n > SIZE_MAX / 8) luaL_error(L, "%s: tensor too large", fname);
  void *buf = lua_newuserdatauv(L, (size_t)n * 8 + 1, 0);
  moe_status st = lm_kind_of(t->dtype) == LM_KIND_FLOAT ? moe_tensor_to_f64(S->ctx, t, (double *)buf)
                                                         : moe_tensor_to_i64(S->ctx, t, (int64_t *)buf);
  if (st != MOE_OK) lm_corefail(L, S, fname, 0);
  return buf;
}

static void lm_push_elem(lua_State *L, lm_kind kind, const void *buf, int64_t i) {
  switch (kind) {
    case LM_KIND_FLOAT: lua_pushnumber(L, (lua_Number)((const double *)buf)[i]); break;
    case LM_KIND_INT: lua_pushinteger(L, (lua_Integer)((const int64_t *)buf)[i]); break;
    case LM_KIND_BOOL: lua_pushboolean(L, ((const int64_t *)buf)[i] != 0); break;
  }
}

static void lm_build_table(lua_State *L, const moe_tensor *t, int dim, lm_kind kind, const void *buf,
                           int64_t *pos) {
  if (dim == t->ndim) {
    lm_push_elem(L, kind, buf, (*pos)++);
    return;
  }
  luaL_checkstack(L, 3, "tensor too deep");
  int64_t n = t->shape[dim];
  lua_createtable(L, n > INT_MAX ? INT_MAX : (int)n, 0);
  for (int64_t i = 0; i < n; i++) {
    lm_build_table(L, t, dim + 1, kind, buf, pos);
    lua_rawseti(L, -2, (lua_Integer)(i + 1));
  }
}

/* t:totable(): nested Lua sequences (a number for a 0-dim tensor). An
 * empty tensor gives its tables down to its first size 0: {} for {0, 2^40};
 * one whose tables alone would not fit in memory ({2^40, 0}: 2^40 empty
 * tables) is an error at once, not minutes of building. */
static int lm_t_totable(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, "totable");
  lm_checkend(L, 1, "totable");
  if (moe_tensor_numel(t) == 0) {
    double tables = 1, rows = 1; /* tables above the first size 0 */
    for (int d = 0; d + 1 < t->ndim && t->shape[d] > 0; d++) tables += (rows *= (double)t->shape[d]);
    if (tables > (double)INT32_MAX)
      lm_argerror(L, 1, "totable", "the empty tensor of shape %s would take more than 2^31 "
                  "empty tables", MOE_SHAPE(t));
  }
  void *buf = lm_read_all(L, S, t, "totable");
  int64_t pos = 0;
  lm_build_table(L, t, 0, lm_kind_of(t->dtype), buf, &pos);
  return 1;
}

/* t:item(): the value of a one-element tensor (integer, float or boolean). */
static int lm_t_item(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, "item");
  lm_checkend(L, 1, "item");
  int64_t n = moe_tensor_numel(t);
  if (n != 1) {
    lm_argerror(L, 1, "item", "a tensor with %I elements (shape %s) cannot be converted to a number; "
                "item() needs exactly one", (LUAI_UACINT)n, MOE_SHAPE(t));
  }
  void *buf = lm_read_all(L, S, t, "item");
  lm_push_elem(L, lm_kind_of(t->dtype), buf, 0);
  return 1;
}

/* ------------------------------------------------------------------ views */

enum { LM_VIEW, LM_RESHAPE, LM_EXPAND };

static int lm_shape_op(lua_State *L, int which, const char *fname) {
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, fname);
  int ndim = 0;
  int64_t shape[MOE_MAX_DIMS];
  if (lua_isnone(L, 2))
    lm_argerror(L, 2, fname, "shape expected (a table of sizes, or sizes as numbers), got no value");
  int next = lm_checkshape(L, 2, fname, true, &ndim, shape);
  lm_checkend(L, next - 1, fname);

  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  if (which == LM_VIEW) st = moe_view(S->ctx, t, ndim, shape, &out);
  else if (which == LM_EXPAND) st = moe_expand(S->ctx, t, ndim, shape, &out);
  else LM_CALL(L, st, moe_reshape(S->ctx, t, ndim, shape, &out));
  return lm_result(L, S, r, st, out, fname, 2);
}

static int lm_t_view(lua_State *L) { return lm_shape_op(L, LM_VIEW, "view"); }
static int lm_t_reshape(lua_State *L) { return lm_shape_op(L, LM_RESHAPE, "reshape"); }
static int lm_t_expand(lua_State *L) { return lm_shape_op(L, LM_EXPAND, "expand"); }

static int lm_t_transpose(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, "transpose");
  int d0 = lm_checkdim(L, S, 2, "transpose", t->ndim, false);
  int d1 = lm_checkdim(L, S, 3, "transpose", t->ndim, false);
  lm_checkend(L, 3, "transpose");
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st = moe_transpose(S->ctx, t, d0, d1, &out);
  return lm_result(L, S, r, st, out, "transpose", 0);
}

static int lm_t_permute(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, "permute");
  int n = 0;
  int64_t dims[MOE_MAX_DIMS];
  if (lua_isnone(L, 2)) lm_argerror(L, 2, "permute", "dims expected, got no value");
  int next = lm_checkdims(L, S, 2, "permute", t->ndim, &n, dims);
  lm_checkend(L, next - 1, "permute");
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st = moe_permute(S->ctx, t, n, dims, &out);
  return lm_result(L, S, r, st, out, "permute", 2);
}

static int lm_t_narrow(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, "narrow");
  int d = lm_checkdim(L, S, 2, "narrow", t->ndim, false);
  int64_t start = lm_checkint(L, 3, "narrow", "start");
  int64_t len = lm_checkint(L, 4, "narrow", "length");
  lm_checkend(L, 4, "narrow");
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st = moe_narrow(S->ctx, t, d, start, len, &out);
  return lm_result(L, S, r, st, out, "narrow", 0);
}

/* t:slice(dim [, start [, stop [, step]]]): Python's start:stop:step; nil
 * start/stop mean the ends. */
static int lm_t_slice(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, "slice");
  int d = lm_checkdim(L, S, 2, "slice", t->ndim, false);
  int64_t start = lm_optint(L, 3, "slice", "start", 0);
  int64_t stop = lm_optint(L, 4, "slice", "stop", INT64_MAX);
  int64_t step = lm_optint(L, 5, "slice", "step", 1);
  lm_checkend(L, 5, "slice");
  if (step < 1) lm_argerror(L, 5, "slice", "step must be positive, got %I", (LUAI_UACINT)step);
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st = moe_slice(S->ctx, t, d, start, stop, step, &out);
  return lm_result(L, S, r, st, out, "slice", 0);
}

static int lm_t_select(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, "select");
  int d = lm_checkdim(L, S, 2, "select", t->ndim, false);
  int64_t i = lm_checkint(L, 3, "select", "index");
  lm_checkend(L, 3, "select");
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st = moe_select(S->ctx, t, d, i, &out);
  return lm_result(L, S, r, st, out, "select", 3);
}

/* t:squeeze() removes every size-1 dim; t:squeeze(dim) that one. */
static int lm_t_squeeze(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, "squeeze");
  bool all = lua_isnoneornil(L, 2);
  int d = all ? 0 : lm_checkdim(L, S, 2, "squeeze", t->ndim, false);
  lm_checkend(L, 2, "squeeze");
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st = moe_squeeze(S->ctx, t, d, all, &out);
  return lm_result(L, S, r, st, out, "squeeze", all ? 0 : 2);
}

static int lm_t_unsqueeze(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, "unsqueeze");
  int d = lm_checkdim(L, S, 2, "unsqueeze", t->ndim, true);
  lm_checkend(L, 2, "unsqueeze");
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st = moe_unsqueeze(S->ctx, t, d, &out);
  return lm_result(L, S, r, st, out, "unsqueeze", 2);
}

static int lm_t_contiguous(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, "contiguous");
  lm_checkend(L, 1, "contiguous");
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_contiguous(S->ctx, t, &out));
  return lm_result(L, S, r, st, out, "contiguous", 0);
}

static int lm_t_clone(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, "clone");
  lm_checkend(L, 1, "clone");
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_clone(S->ctx, t, &out));
  return lm_result(L, S, r, st, out, "clone", 0);
}

/* ------------------------------------------------- conversions and fills */

static int lm_to_common(lua_State *L, lm_state *S, moe_tensor *t, moe_dtype dt, moe_device d,
                        const char *fname) {
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_to(S->ctx, t, dt, d, &out));
  return lm_result(L, S, r, st, out, fname, 0);
}

/* One string argument of t:to(): a dtype name or a device. */
static void lm_to_string(lua_State *L, lm_state *S, int arg, moe_dtype *dt, moe_device *d) {
  const char *s = lua_tostring(L, arg);
  if (moe_dtype_parse(s, dt)) return;
  if (strncmp(s, "cpu", 3) == 0 || strncmp(s, "cuda", 4) == 0 || strncmp(s, "gpu", 3) == 0) {
    *d = lm_checkdevice_at(L, S, arg, arg, "to");
    return;
  }
  char list[128];
  lm_argerror(L, arg, "to", "unknown dtype or device '%s' (dtypes: %s; devices: cpu, cuda, cuda:N)", s,
              lm_dtype_list(list, sizeof list));
}

/* t:to(dtype | device | {dtype=, device=} | other_tensor), or
 * t:to(device, dtype) with two strings. Returns t's storage (a new handle)
 * when nothing changes. */
static int lm_t_to(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, "to");
  moe_dtype dt = t->dtype;
  moe_device d = moe_tensor_device(t);
  int last = 2;
  switch (lua_type(L, 2)) {
    case LUA_TSTRING:
      lm_to_string(L, S, 2, &dt, &d);
      if (lua_type(L, 3) == LUA_TSTRING) {
        lm_to_string(L, S, 3, &dt, &d);
        last = 3;
      }
      break;
    case LUA_TTABLE: {
      lm_opts o;
      lm_checkopts(L, S, 2, "to", LM_OPT_DTYPE | LM_OPT_DEVICE, &o);
      if (o.has_dtype) dt = o.dtype;
      if (o.has_device) d = o.device;
      break;
    }
    default: {
      lm_tensor *other = lm_testtensor(L, 2);
      if (other == NULL)
        lm_argerror(L, 2, "to", "dtype, device, options table or tensor expected, got %s",
                    lm_typename(L, 2));
      moe_tensor *o = lm_checktensor(L, 2, "to");
      dt = o->dtype;
      d = moe_tensor_device(o);
    }
  }
  lm_checkend(L, last, "to");
  return lm_to_common(L, S, t, dt, d, "to");
}

static int lm_t_cpu(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, "cpu");
  lm_checkend(L, 1, "cpu");
  return lm_to_common(L, S, t, t->dtype, MOE_CPU, "cpu");
}

/* t:cuda([index]) */
static int lm_t_cuda(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, "cuda");
  int64_t i = lm_optint(L, 2, "cuda", "device index", 0);
  lm_checkend(L, 2, "cuda");
  if (i < 0 || i > INT_MAX) lm_argerror(L, 2, "cuda", "device index must be non-negative, got %I", (LUAI_UACINT)i);
  moe_device d = {MOE_DEVICE_CUDA, (int)i};
  if (moe_device_check(S->ctx, d) != MOE_OK) lm_corefail(L, S, "cuda", 0);
  return lm_to_common(L, S, t, t->dtype, d, "cuda");
}

static int lm_to_dtype(lua_State *L, moe_dtype dt, const char *fname) {
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, fname);
  lm_checkend(L, 1, fname);
  return lm_to_common(L, S, t, dt, moe_tensor_device(t), fname);
}

static int lm_t_float(lua_State *L) { return lm_to_dtype(L, MOE_F32, "float"); }
static int lm_t_double(lua_State *L) { return lm_to_dtype(L, MOE_F64, "double"); }
static int lm_t_half(lua_State *L) { return lm_to_dtype(L, MOE_F16, "half"); }
static int lm_t_bfloat16(lua_State *L) { return lm_to_dtype(L, MOE_BF16, "bfloat16"); }
static int lm_t_long(lua_State *L) { return lm_to_dtype(L, MOE_I64, "long"); }
static int lm_t_int(lua_State *L) { return lm_to_dtype(L, MOE_I32, "int"); }
static int lm_t_bool(lua_State *L) { return lm_to_dtype(L, MOE_BOOL, "bool"); }

/* In-place ops return self. */
static int lm_inplace_done(lua_State *L, lm_state *S, moe_status st, const char *fname, int arg) {
  if (st != MOE_OK) return lm_corefail(L, S, fname, arg);
  lua_settop(L, 1);
  return 1;
}

static int lm_t_copy_(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *dst = lm_checktensor(L, 1, "copy_");
  moe_tensor *src = lm_checktensor(L, 2, "copy_");
  lm_checkend(L, 2, "copy_");
  return lm_inplace_done(L, S, moe_copy_(S->ctx, dst, src), "copy_", 0);
}

static int lm_t_fill_(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, "fill_");
  double v = lm_checkvalue(L, 2, "fill_");
  lm_checkend(L, 2, "fill_");
  return lm_inplace_done(L, S, moe_fill_(S->ctx, t, v), "fill_", 0);
}

static int lm_t_uniform_(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, "uniform_");
  double a = lm_optnum(L, 2, "uniform_", "low", 0.0);
  double b = lm_optnum(L, 3, "uniform_", "high", 1.0);
  lm_checkend(L, 3, "uniform_");
  return lm_inplace_done(L, S, moe_uniform_(S->ctx, t, a, b), "uniform_", 0);
}

static int lm_t_normal_(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, "normal_");
  double m = lm_optnum(L, 2, "normal_", "mean", 0.0);
  double s = lm_optnum(L, 3, "normal_", "std", 1.0);
  lm_checkend(L, 3, "normal_");
  if (s < 0) lm_argerror(L, 3, "normal_", "std must be non-negative, got %f", (LUAI_UACNUMBER)s);
  return lm_inplace_done(L, S, moe_normal_(S->ctx, t, m, s), "normal_", 0);
}

/* ------------------------------------------------------------ arithmetic */

/* a op b for tensor/tensor, tensor/number and number/tensor: the methods
 * t:add(x) ... and the metamethods __add ... share this. */
static int lm_arith(lua_State *L, moe_op op, const char *fname) {
  lm_state *S = lm_S(L);
  lm_tensor *ua = lm_testtensor(L, 1), *ub = lm_testtensor(L, 2);
  moe_tensor *a = NULL, *b = NULL;
  double s = 0;
  if (ua) a = lm_checktensor(L, 1, fname);
  else if (lua_type(L, 1) == LUA_TNUMBER) s = (double)lua_tonumber(L, 1);
  else lm_argerror(L, 1, fname, "tensor or number expected, got %s", lm_typename(L, 1));
  if (ub) b = lm_checktensor(L, 2, fname);
  else if (lua_type(L, 2) == LUA_TNUMBER && a) s = (double)lua_tonumber(L, 2);
  else lm_argerror(L, 2, fname, "%s expected, got %s", a ? "tensor or number" : "tensor", lm_typename(L, 2));
  lm_checkend(L, 2, fname);

  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  if (a && b) LM_CALL(L, st, moe_binary(S->ctx, op, a, b, &out));
  else if (a) LM_CALL(L, st, moe_binary_scalar(S->ctx, op, a, s, false, &out));
  else LM_CALL(L, st, moe_binary_scalar(S->ctx, op, b, s, true, &out));
  return lm_result(L, S, r, st, out, fname, 0);
}

static int lm_add(lua_State *L) { return lm_arith(L, MOE_OP_ADD, "add"); }
static int lm_sub(lua_State *L) { return lm_arith(L, MOE_OP_SUB, "sub"); }
static int lm_mul(lua_State *L) { return lm_arith(L, MOE_OP_MUL, "mul"); }
static int lm_div(lua_State *L) { return lm_arith(L, MOE_OP_DIV, "div"); }

static int lm_neg(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *a = lm_checktensor(L, 1, "neg");
  lm_checkend(L, 1, "neg");
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_unary(S->ctx, MOE_OP_NEG, a, &out));
  return lm_result(L, S, r, st, out, "neg", 0);
}

/* __unm receives the operand twice; t:neg() once. */
static int lm_unm(lua_State *L) {
  lua_settop(L, 1);
  return lm_neg(L);
}

/* #t: the size of dim 0. */
static int lm_len(lua_State *L) {
  moe_tensor *t = lm_checktensor(L, 1, "__len");
  if (t->ndim == 0)
    lm_argerror(L, 1, "__len", "a 0-dim tensor has no length (use t:item() or t:numel())");
  lua_pushinteger(L, (lua_Integer)t->shape[0]);
  return 1;
}

/* --------------------------------------------------------------- lifecycle */

static int lm_t_free(lua_State *L) {
  lm_tensor *u = lm_testtensor(L, 1);
  if (u == NULL) lm_argerror(L, 1, "free", "tensor expected, got %s", lm_typename(L, 1));
  lm_release(u);
  return 0;
}

static int lm_gc(lua_State *L) {
  lm_tensor *u = lm_testtensor(L, 1);
  if (u) lm_release(u);
  return 0;
}

/* __tostring; a freed tensor prints as "tensor(freed)" (as io prints a
 * closed file) rather than raising, so that printing never fails. */
static int lm_tostring(lua_State *L) {
  lm_tensor *u = lm_testtensor(L, 1);
  if (u == NULL) lm_argerror(L, 1, "tostring", "tensor expected, got %s", lm_typename(L, 1));
  if (u->t == NULL) {
    lua_pushliteral(L, "tensor(freed)");
    return 1;
  }
  lm_state *S = u->S; /* the tensor's own reference: valid even while lua_close runs */
  void **box = lm_push_scratch(L);
  if (moe_tensor_format(S->ctx, u->t, &S->print, (char **)box) != MOE_OK)
    return lm_corefail(L, S, "tostring", 0);
  lua_pushstring(L, (const char *)*box);
  free(*box);
  *box = NULL;
  return 1;
}

/* moe.set_printoptions{precision=, threshold=, edgeitems=, linewidth=} */
static int lm_set_printoptions(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_print_options p = S->print;
  if (lua_type(L, 1) != LUA_TTABLE)
    lm_argerror(L, 1, "set_printoptions", "options table expected, got %s", lm_typename(L, 1));
  lm_checkend(L, 1, "set_printoptions");
  lua_pushnil(L);
  while (lua_next(L, 1)) {
    int isint = 0;
    const char *k = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : "?";
    lua_Integer v = lua_type(L, -1) == LUA_TNUMBER ? lua_tointegerx(L, -1, &isint) : 0;
    if (strcmp(k, "precision") != 0 && strcmp(k, "threshold") != 0 && strcmp(k, "edgeitems") != 0 &&
        strcmp(k, "linewidth") != 0)
      lm_argerror(L, 1, "set_printoptions",
                  "unknown option '%s' (valid options: precision, threshold, edgeitems, linewidth)", k);
    if (!isint || v < 0 || v > INT_MAX)
      lm_argerror(L, 1, "set_printoptions", "%s must be a non-negative integer, got %s", k,
                  lm_describe(L, lua_gettop(L)));
    if (strcmp(k, "precision") == 0) p.precision = (int)v;
    else if (strcmp(k, "threshold") == 0) p.threshold = v;
    else if (strcmp(k, "edgeitems") == 0) p.edgeitems = (int)v;
    else p.linewidth = (int)v;
    lua_pop(L, 1);
  }
  S->print = p;
  return 0;
}

static int lm_get_printoptions(lua_State *L) {
  lm_state *S = lm_S(L);
  lua_createtable(L, 0, 4);
  lua_pushinteger(L, S->print.precision);
  lua_setfield(L, -2, "precision");
  lua_pushinteger(L, (lua_Integer)S->print.threshold);
  lua_setfield(L, -2, "threshold");
  lua_pushinteger(L, S->print.edgeitems);
  lua_setfield(L, -2, "edgeitems");
  lua_pushinteger(L, S->print.linewidth);
  lua_setfield(L, -2, "linewidth");
  return 1;
}

static int lm_is_tensor(lua_State *L) {
  lua_pushboolean(L, lm_testtensor(L, 1) != NULL);
  return 1;
}

/* ---------------------------------------------------------------- opening */

static const luaL_Reg lm_tensor_methods[] = {
    {"numel", lm_t_numel},         {"size", lm_t_size},
    {"stride", lm_t_stride},       {"dim", lm_t_dim},
    {"is_contiguous", lm_t_is_contiguous}, {"storage_offset", lm_t_storage_offset},
    {"totable", lm_t_totable},     {"item", lm_t_item},
    {"view", lm_t_view},           {"reshape", lm_t_reshape},
    {"transpose", lm_t_transpose}, {"permute", lm_t_permute},
    {"narrow", lm_t_narrow},       {"slice", lm_t_slice},
    {"select", lm_t_select},       {"expand", lm_t_expand},
    {"squeeze", lm_t_squeeze},     {"unsqueeze", lm_t_unsqueeze},
    {"contiguous", lm_t_contiguous}, {"clone", lm_t_clone},
    {"to", lm_t_to},               {"cpu", lm_t_cpu},
    {"cuda", lm_t_cuda},           {"float", lm_t_float},
    {"double", lm_t_double},       {"half", lm_t_half},
    {"bfloat16", lm_t_bfloat16},   {"long", lm_t_long},
    {"int", lm_t_int},             {"bool", lm_t_bool},
    {"copy_", lm_t_copy_},         {"fill_", lm_t_fill_},
    {"uniform_", lm_t_uniform_},   {"normal_", lm_t_normal_},
    {"add", lm_add},               {"sub", lm_sub},
    {"mul", lm_mul},               {"div", lm_div},
    {"neg", lm_neg},               {"free", lm_t_free},
    {NULL, NULL}};

static const luaL_Reg lm_tensor_meta[] = {
    {"__gc", lm_gc},   {"__close", lm_gc}, {"__tostring", lm_tostring}, {"__len", lm_len},
    {"__add", lm_add}, {"__sub", lm_sub},  {"__mul", lm_mul},           {"__div", lm_div},
    {"__unm", lm_unm}, {"__newindex", lm_newindex}, {NULL, NULL}};

static const luaL_Reg lm_tensor_functions[] = {
    {"empty", lm_empty},
    {"zeros", lm_zeros},
    {"ones", lm_ones},
    {"full", lm_full},
    {"rand", lm_rand},
    {"randn", lm_randn},
    {"randint", lm_randint},
    {"arange", lm_arange},
    {"linspace", lm_linspace},
    {"tensor", lm_tensor_new},
    {"is_tensor", lm_is_tensor},
    {"set_printoptions", lm_set_printoptions},
    {"get_printoptions", lm_get_printoptions},
    {NULL, NULL}};

/* The tensor metatable, created once per Lua state; pushes the method table. */
void lm_push_methods(lua_State *L, int sentinel) {
  if (lua_getfield(L, LUA_REGISTRYINDEX, LM_METHODS_KEY) == LUA_TTABLE) return;
  lua_pop(L, 1);
  luaL_newmetatable(L, LM_TENSOR);
  lua_pushvalue(L, sentinel);
  luaL_setfuncs(L, lm_tensor_meta, 1);
  luaL_newlibtable(L, lm_tensor_methods);
  lua_pushvalue(L, sentinel);
  luaL_setfuncs(L, lm_tensor_methods, 1);
  lua_pushvalue(L, sentinel);
  lua_pushvalue(L, -2);
  lua_pushcclosure(L, lm_index, 2);
  lua_setfield(L, -3, "__index");
  lua_remove(L, -2); /* the metatable */
  lua_pushvalue(L, -1);
  lua_setfield(L, LUA_REGISTRYINDEX, LM_METHODS_KEY);
}

/* The constructors and printing functions into the module, and the method
 * table as moe.Tensor. */
void lm_open_tensor(lua_State *L, int mod, int methods, int sentinel) {
  mod = lua_absindex(L, mod);
  methods = lua_absindex(L, methods);
  lm_register(L, mod, methods, sentinel, lm_tensor_functions, NULL);
  lua_pushvalue(L, methods);
  lua_setfield(L, mod, "Tensor");
}
