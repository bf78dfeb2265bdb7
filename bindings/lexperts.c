/*
 * lexperts.c - Lua bindings of the experts family (core/moe_experts.h),
 * under `moe.ops`:
 *
 *   moe.ops.parallel_linear(x, w, plan, {impl = "grouped" | "sparse",
 *       trans_w = false, gather = false, scatter = false, gates = nil})
 *   moe.ops.glu_experts(x, w1, w3, w2, plan, gates, {impl = "grouped",
 *       activation = "silu" | "gelu" | "gelu_tanh", memory_optimized = false})
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
    static const char *const known[] = {"impl", "trans_w", "gather", "scatter", "gates", NULL};
    lm_checkkeys(L, 4, fname, known);
    o.impl = lm_ex_impl(L, 4, fname);
    o.trans_w = lm_field_bool(L, 4, fname, "trans_w", false);
    o.gather = lm_field_bool(L, 4, fname, "gather", false);
    o.scatter = lm_field_bool(L, 4, fname, "scatter", false);
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
  moe_experts_impl impl = MOE_EXPERTS_GROUPED;
  moe_glu_activation act = MOE_GLU_SILU;
  bool memopt = false;
  if (!lua_isnoneornil(L, 7)) {
    if (lua_type(L, 7) != LUA_TTABLE)
      lm_argerror(L, 7, fname, "options table expected, got %s", lm_typename(L, 7));
    static const char *const known[] = {"impl", "activation", "memory_optimized", NULL};
    lm_checkkeys(L, 7, fname, known);
    impl = lm_ex_impl(L, 7, fname);
    memopt = lm_field_bool(L, 7, fname, "memory_optimized", false);
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
  LM_CALL(L, st, moe_glu_experts(S->ctx, x, w1, w3, w2, p, gates, impl, act, memopt, &out));
  return lm_result(L, S, r, st, out, fname, 0);
}

static const luaL_Reg lm_experts_functions[] = {{"parallel_linear", lm_parallel_linear},
                                                {"glu_experts", lm_glu_experts},
                                                {NULL, NULL}};

void lm_open_experts(lua_State *L, int mod, int methods, int sentinel) {
  mod = lua_absindex(L, mod);
  methods = lua_absindex(L, methods);
  sentinel = lua_absindex(L, sentinel);
  if (lua_getfield(L, mod, "ops") != LUA_TTABLE) { /* moe.ops, created when absent */
    lua_pop(L, 1);
    lua_newtable(L);
    lua_pushvalue(L, -1);
    lua_setfield(L, mod, "ops");
  }
  lm_register(L, lua_gettop(L), methods, sentinel, lm_experts_functions, NULL);
  lua_pop(L, 1);
}
