/*
 * lquantize.c - Lua bindings of the quantize family (core/moe_quantize.h),
 * under the `moe.ops` sub-table:
 *
 *   local q = moe.ops.quantize(x, {bits = 8 | 4, group_size =, stochastic =})
 *       -- a plain table {values =, scales =, bits =, group_size =,
 *       --                dtype =, shape = {...}} (tensors owned by the table)
 *   local y = moe.ops.dequantize(q)   -- x's dtype, shape and device
 *   moe.ops.quantize_scope({bits =, group_size =, stochastic =,
 *       min_numel = 1024, keep = {tensors...}}, fn, ...) -> fn(...)
 *
 * quantize_scope pushes the C saved-tensor hooks of moe_quantize_hooks_push
 * around fn (no Lua runs in backward: packing and unpacking are C); tensors
 * in keep (e.g. parameters) and any tensor sharing their storage are saved
 * unchanged. The user-facing API is lua/moe/quantize.lua (moe.quantize).
 * Registered by luaopen_moe through lm_open_quantize (lmoe_internal.h).
 */
#include <stdlib.h>
#include <string.h>

#include "lmoe_internal.h"
#include "moe_quantize.h"

/* Reads {bits, group_size, stochastic} (and, when hooks, min_numel and
 * keep, whose tensors are stored in a scratch array left on the stack) from
 * the table at arg. */
static void lm_qz_opts(lua_State *L, int arg, const char *fname, bool hooks,
                       moe_quant_hooks_opts *o) {
  if (lua_type(L, arg) != LUA_TTABLE)
    lm_argerror(L, arg, fname, "options table expected ({bits = 8 | 4, ...}), got %s",
                lm_typename(L, arg));
  static const char *const known_hooks[] = {"bits", "group_size", "stochastic", "min_numel", "keep", NULL};
  static const char *const known[] = {"bits", "group_size", "stochastic", NULL};
  lm_checkkeys(L, arg, fname, hooks ? known_hooks : known);
  lua_getfield(L, arg, "bits");
  if (!lua_isinteger(L, -1))
    lm_argerror(L, arg, fname, "option bits must be 8 or 4, got %s", lm_describe(L, -1));
  lua_Integer bits = lua_tointeger(L, -1);
  if (bits != 8 && bits != 4)
    lm_argerror(L, arg, fname, "option bits must be 8 or 4, got %d", (int)bits);
  lua_pop(L, 1);
  *o = moe_quant_hooks_opts_default((int)bits);
  if (lua_getfield(L, arg, "group_size") != LUA_TNIL) {
    if (!lua_isinteger(L, -1) || lua_tointeger(L, -1) < 0)
      lm_argerror(L, arg, fname, "option group_size must be an integer >= 0 (0: one scale per row), got %s",
                  lm_describe(L, -1));
    o->quant.group_size = (int64_t)lua_tointeger(L, -1);
  }
  lua_pop(L, 1);
  if (lua_getfield(L, arg, "stochastic") != LUA_TNIL) {
    if (!lua_isboolean(L, -1))
      lm_argerror(L, arg, fname, "option stochastic must be a boolean, got %s", lm_describe(L, -1));
    o->quant.stochastic = lua_toboolean(L, -1);
  }
  lua_pop(L, 1);
  if (!hooks) return;
  if (lua_getfield(L, arg, "min_numel") != LUA_TNIL) {
    if (!lua_isinteger(L, -1) || lua_tointeger(L, -1) < 0)
      lm_argerror(L, arg, fname, "option min_numel must be an integer >= 0, got %s",
                  lm_describe(L, -1));
    o->min_numel = (int64_t)lua_tointeger(L, -1);
  }
  lua_pop(L, 1);
  void **scratch = lm_push_scratch(L); /* stays on the stack */
  if (lua_getfield(L, arg, "keep") != LUA_TNIL) {
    if (lua_type(L, -1) != LUA_TTABLE)
      lm_argerror(L, arg, fname, "option keep must be a list of tensors, got %s", lm_describe(L, -1));
    int n = (int)lua_rawlen(L, -1);
    if (n > 0) {
      moe_tensor **keep = (moe_tensor **)calloc((size_t)n, sizeof(*keep));
      if (!keep) luaL_error(L, "%s: out of host memory", fname);
      *scratch = keep;
      for (int i = 0; i < n; i++) {
        lua_rawgeti(L, -1, i + 1);
        lm_tensor *u = lm_testtensor(L, -1);
        if (!u || !u->t)
          lm_argerror(L, arg, fname, "option keep: entry %d is %s, not a tensor", i + 1,
                      lm_describe(L, -1));
        keep[i] = u->t; /* referenced by the options table during the call */
        lua_pop(L, 1);
      }
      o->n_keep = n;
      o->keep = keep;
    }
  }
  lua_pop(L, 1);
}

/* moe.ops.quantize(x, opts) -> {values, scales, bits, group_size, dtype, shape} */
static int lm_quantize(lua_State *L) {
  const char *fname = "quantize";
  lm_state *S = lm_S(L);
  moe_tensor *x = lm_checktensor(L, 1, fname);
  moe_quant_hooks_opts o;
  lm_qz_opts(L, 2, fname, false, &o);
  lm_checkend(L, 2, fname);
  /* the result table and two empty handles first, so nothing leaks on error */
  lua_createtable(L, 0, 6);
  int res = lua_gettop(L);
  lm_tensor *rv = lm_push_empty(L);
  lua_setfield(L, res, "values");
  lm_tensor *rs = lm_push_empty(L);
  lua_setfield(L, res, "scales");
  moe_qtensor q;
  moe_status st;
  LM_CALL(L, st, moe_quantize(S->ctx, x, &o.quant, &q));
  if (st != MOE_OK) return lm_corefail(L, S, fname, 0);
  lm_adopt(rv, S, q.values);
  lm_adopt(rs, S, q.scales);
  lua_pushinteger(L, q.bits);
  lua_setfield(L, res, "bits");
  lua_pushinteger(L, (lua_Integer)q.group_size);
  lua_setfield(L, res, "group_size");
  lua_pushstring(L, moe_dtype_name(q.dtype));
  lua_setfield(L, res, "dtype");
  lm_push_ints(L, q.ndim, q.shape);
  lua_setfield(L, res, "shape");
  lua_pushvalue(L, res);
  return 1;
}

/* moe.ops.dequantize(q) -> tensor */
static int lm_dequantize(lua_State *L) {
  const char *fname = "dequantize";
  lm_state *S = lm_S(L);
  if (lua_type(L, 1) != LUA_TTABLE)
    lm_argerror(L, 1, fname, "quantized table expected (from quantize), got %s", lm_typename(L, 1));
  lm_checkend(L, 1, fname);
  moe_qtensor q;
  memset(&q, 0, sizeof q);
  lua_getfield(L, 1, "values");
  lm_tensor *u = lm_testtensor(L, -1);
  if (!u || !u->t) lm_argerror(L, 1, fname, "field values must be a tensor, got %s", lm_describe(L, -1));
  q.values = u->t;
  lua_getfield(L, 1, "scales");
  u = lm_testtensor(L, -1);
  if (!u || !u->t) lm_argerror(L, 1, fname, "field scales must be a tensor, got %s", lm_describe(L, -1));
  q.scales = u->t;
  lua_getfield(L, 1, "bits");
  if (!lua_isinteger(L, -1)) lm_argerror(L, 1, fname, "field bits must be 8 or 4, got %s", lm_describe(L, -1));
  q.bits = (int)lua_tointeger(L, -1);
  lua_getfield(L, 1, "group_size");
  if (!lua_isinteger(L, -1))
    lm_argerror(L, 1, fname, "field group_size must be an integer, got %s", lm_describe(L, -1));
  q.group_size = (int64_t)lua_tointeger(L, -1);
  lua_getfield(L, 1, "dtype");
  const char *dts = lua_tostring(L, -1);
  if (lua_type(L, -1) != LUA_TSTRING || !moe_dtype_parse(dts, &q.dtype))
    lm_argerror(L, 1, fname, "field dtype must be a dtype name, got %s", lm_describe(L, -1));
  lua_getfield(L, 1, "shape");
  if (lua_type(L, -1) != LUA_TTABLE)
    lm_argerror(L, 1, fname, "field shape must be a list of sizes, got %s", lm_describe(L, -1));
  int n = (int)lua_rawlen(L, -1);
  if (n > MOE_MAX_DIMS) lm_argerror(L, 1, fname, "field shape has %d dims (at most %d)", n, MOE_MAX_DIMS);
  q.ndim = n;
  for (int i = 0; i < n; i++) {
    lua_rawgeti(L, -1, i + 1);
    if (!lua_isinteger(L, -1))
      lm_argerror(L, 1, fname, "field shape: entry %d is %s, not an integer", i + 1, lm_describe(L, -1));
    q.shape[i] = (int64_t)lua_tointeger(L, -1);
    lua_pop(L, 1);
  }
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_dequantize(S->ctx, &q, &out));
  return lm_result(L, S, r, st, out, fname, 1);
}

/* moe.ops.quantize_scope(opts, fn, ...) -> fn(...) */
static int lm_quantize_scope(lua_State *L) {
  const char *fname = "quantize_scope";
  lm_state *S = lm_S(L);
  if (lua_type(L, 2) != LUA_TFUNCTION)
    lm_argerror(L, 2, fname, "function expected, got %s", lm_typename(L, 2));
  int top = lua_gettop(L);
  moe_quant_hooks_opts o;
  lm_qz_opts(L, 1, fname, true, &o); /* leaves the keep scratch on the stack */
  if (moe_quantize_hooks_push(S->ctx, &o) != MOE_OK) return lm_corefail(L, S, fname, 1);
  lua_settop(L, top); /* frees the scratch at the next collection; hooks retained storages */
  lua_remove(L, 1);   /* fn, ... */
  int st = lua_pcall(L, lua_gettop(L) - 1, LUA_MULTRET, 0);
  moe_saved_hooks_pop(S->ctx);
  if (st != LUA_OK) return lua_error(L);
  return lua_gettop(L);
}

static const luaL_Reg lm_quantize_functions[] = {{"quantize", lm_quantize},
                                                 {"dequantize", lm_dequantize},
                                                 {"quantize_scope", lm_quantize_scope},
                                                 {NULL, NULL}};

void lm_open_quantize(lua_State *L, int ops, int methods, int sentinel) {
  lm_register(L, ops, methods, sentinel, lm_quantize_functions, NULL);
}
