/*
 * lexperts.c - Lua bindings of the experts family (core/moe_experts.h),
 * under `moe.ops`:
 *
 *   moe.ops.parallel_linear(x, w, plan, {impl = "grouped" | "sparse",
 *       trans_w = false, gather = false, scatter = false, gates = nil,
 *       memory_optimized = false})
 *   moe.ops.glu_experts(x, w1, w3, w2, plan, gates, {impl = "grouped",
 *       activation = "silu" | "gelu" | "gelu_tanh", memory_optimized = false,
 *       quantize = {bits = 8 | 4, group_size = 0 (8) / 128 (4),
 *                   stochastic = false, min_numel = 1024}})
 *     quantize: h1 and h3 are kept for backward quantized (and act(h1) * h3
 *     recomputed from them): moe_glu_experts_opts's quant_* fields.
 *
 * gates of glu_experts may be nil (all ones). The plan is the userdata of
 * lrouting.c ("moe.RoutingPlan"), whose first field is the C plan pointer
 * (NULL once freed). Registered by luaopen_moe through lm_open_experts.
 */
#include <string.h>

#include "lmoe_internal.h"
#include "moe_routing.h"

static moe_experts_impl lm_ex_impl(lua_State *L, int arg, const char *fname) {
  moe_experts_impl impl = MOE_EXPERTS_GROUPED;
  if (lua_getfield(L, arg, "impl") != LUA_TNIL) {
    const char *s = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
    if (s && strcmp(s, "grouped") == 0) impl = MOE_EXPERTS_GROUPED;
    else if (s && strcmp(s, "sparse") == 0) impl = MOE_EXPERTS_SPARSE;
    else if (s)
      lm_argerror(L, arg, fname, "option impl must be \"grouped\" or \"sparse\", got \"%s\"", s);
    else
      lm_argerror(L, arg, fname, "option impl must be \"grouped\" or \"sparse\", got %s",
                  lm_describe(L, -1));
  }
  lua_pop(L, 1);
  return impl;
}

/* moe.ops.parallel_linear(x, w, plan [, opts]) */
static int lm_parallel_linear(lua_State *L) {
  const char *fname = "parallel_linear";
  lm_state *S = lm_S(L);
  moe_tensor *x = lm_checktensor(L, 1, fname);
  moe_tensor *w = lm_checktensor(L, 2, fname);
  moe_routing_plan *p = lm_plan_arg(L, 3, fname);
  moe_parallel_linear_opts o = moe_parallel_linear_opts_default();
  if (!lua_isnoneornil(L, 4)) {
    if (lua_type(L, 4) != LUA_TTABLE)
      lm_argerror(L, 4, fname, "options table expected, got %s", lm_typename(L, 4));
    static const char *const known[] = {"impl", "trans_w", "gather", "scatter", "gates", "memory_optimized",
                                        NULL};
    lm_checkkeys(L, 4, fname, known);
    o.impl = lm_ex_impl(L, 4, fname);
    o.trans_w = lm_field_bool(L, 4, fname, "trans_w", false);
    o.gather = lm_field_bool(L, 4, fname, "gather", false);
    o.scatter = lm_field_bool(L, 4, fname, "scatter", false);
    o.memory_optimized = lm_field_bool(L, 4, fname, "memory_optimized", false);
    if (lua_getfield(L, 4, "gates") != LUA_TNIL) {
      lm_tensor *u = lm_testtensor(L, -1);
      if (!u || !u->t)
        lm_argerror(L, 4, fname, "option gates must be a tensor, got %s", lm_describe(L, -1));
      o.gates = u->t; /* referenced by the options table during the call */
    }
    lua_pop(L, 1);
  }
  lm_checkend(L, 4, fname);
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_parallel_linear(S->ctx, x, w, p, &o, &out));
  return lm_result(L, S, r, st, out, fname, 0);
}

/* An integer field of the quantize table at idx (option arg of fname). */
static int64_t lm_ex_qint(lua_State *L, int idx, int arg, const char *fname, const char *key,
                          int64_t def, int64_t min) {
  int64_t v = def;
  if (lua_getfield(L, idx, key) != LUA_TNIL) {
    if (!lua_isinteger(L, -1) || lua_tointeger(L, -1) < min)
      lm_argerror(L, arg, fname, "option quantize.%s must be an integer >= %d, got %s", key,
                  (int)min, lm_describe(L, -1));
    v = (int64_t)lua_tointeger(L, -1);
  }
  lua_pop(L, 1);
  return v;
}

/* opts.quantize of glu_experts (a table or nil/false) into o. */
static void lm_ex_quantize(lua_State *L, int arg, const char *fname, moe_glu_experts_opts *o) {
  int t = lua_getfield(L, arg, "quantize");
  if (t == LUA_TNIL || (t == LUA_TBOOLEAN && !lua_toboolean(L, -1))) {
    lua_pop(L, 1);
    return;
  }
  if (t != LUA_TTABLE)
    lm_argerror(L, arg, fname, "option quantize must be a table {bits = 8 | 4, ...}, got %s",
                lm_describe(L, -1));
  int idx = lua_gettop(L);
  static const char *const known[] = {"bits", "group_size", "stochastic", "min_numel", NULL};
  lua_pushnil(L);
  while (lua_next(L, idx)) {
    bool ok = false;
    if (lua_type(L, -2) == LUA_TSTRING)
      for (int i = 0; known[i] && !ok; i++) ok = strcmp(lua_tostring(L, -2), known[i]) == 0;
    if (!ok)
      lm_argerror(L, arg, fname,
                  "unknown option quantize.%s (valid options: bits, group_size, min_numel, "
                  "stochastic)",
                  lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : lm_describe(L, -2));
    lua_pop(L, 1);
  }
  lua_getfield(L, idx, "bits");
  if (!lua_isinteger(L, -1) || (lua_tointeger(L, -1) != 8 && lua_tointeger(L, -1) != 4))
    lm_argerror(L, arg, fname, "option quantize.bits must be 8 or 4, got %s", lm_describe(L, -1));
  o->quant_bits = (int)lua_tointeger(L, -1);
  lua_pop(L, 1);
  o->quant_group_size = lm_ex_qint(L, idx, arg, fname, "group_size", o->quant_bits == 4 ? 128 : 0, 0);
  if (o->quant_bits == 4 && o->quant_group_size % 2)
    lm_argerror(L, arg, fname, "option quantize.group_size must be even for 4 bits, got %d",
                (int)o->quant_group_size);
  o->quant_min_numel = lm_ex_qint(L, idx, arg, fname, "min_numel", 1024, 0);
  if (lua_getfield(L, idx, "stochastic") != LUA_TNIL) {
    if (!lua_isboolean(L, -1))
      lm_argerror(L, arg, fname, "option quantize.stochastic must be a boolean, got %s",
                  lm_describe(L, -1));
    o->quant_stochastic = lua_toboolean(L, -1);
  }
  lua_pop(L, 2);
}

/* moe.ops.glu_experts(x, w1, w3, w2, plan, gates [, opts]) */
static int lm_glu_experts(lua_State *L) {
  const char *fname = "glu_experts";
  lm_state *S = lm_S(L);
  moe_tensor *x = lm_checktensor(L, 1, fname);
  moe_tensor *w1 = lm_checktensor(L, 2, fname);
  moe_tensor *w3 = lm_checktensor(L, 3, fname);
  moe_tensor *w2 = lm_checktensor(L, 4, fname);
  moe_routing_plan *p = lm_plan_arg(L, 5, fname);
  moe_tensor *gates = lua_isnoneornil(L, 6) ? NULL : lm_checktensor(L, 6, fname);
  moe_glu_experts_opts o = moe_glu_experts_opts_default();
  moe_glu_activation act = MOE_GLU_SILU;
  if (!lua_isnoneornil(L, 7)) {
    if (lua_type(L, 7) != LUA_TTABLE)
      lm_argerror(L, 7, fname, "options table expected, got %s", lm_typename(L, 7));
    static const char *const known[] = {"impl", "activation", "memory_optimized", "quantize", NULL};
    lm_checkkeys(L, 7, fname, known);
    o.impl = lm_ex_impl(L, 7, fname);
    o.memory_optimized = lm_field_bool(L, 7, fname, "memory_optimized", false);
    lm_ex_quantize(L, 7, fname, &o);
    if (lua_getfield(L, 7, "activation") != LUA_TNIL) {
      const char *s = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
      if (s && strcmp(s, "silu") == 0) act = MOE_GLU_SILU;
      else if (s && strcmp(s, "gelu") == 0) act = MOE_GLU_GELU;
      else if (s && strcmp(s, "gelu_tanh") == 0) act = MOE_GLU_GELU_TANH;
      else if (s)
        lm_argerror(L, 7, fname,
                    "option activation must be \"silu\", \"gelu\" or \"gelu_tanh\", got \"%s\"",
                    s);
      else
        lm_argerror(L, 7, fname,
                    "option activation must be \"silu\", \"gelu\" or \"gelu_tanh\", got %s",
                    lm_describe(L, -1));
    }
    lua_pop(L, 1);
  }
  lm_checkend(L, 7, fname);
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  o.act = act;
  LM_CALL(L, st, moe_glu_experts_ex(S->ctx, x, w1, w3, w2, p, gates, &o, &out));
  return lm_result(L, S, r, st, out, fname, 0);
}

static const luaL_Reg lm_experts_functions[] = {{"parallel_linear", lm_parallel_linear},
                                                {"glu_experts", lm_glu_experts},
                                                {NULL, NULL}};

void lm_open_experts(lua_State *L, int ops, int methods, int sentinel) {
  lm_register(L, ops, methods, sentinel, lm_experts_functions, NULL);
}
