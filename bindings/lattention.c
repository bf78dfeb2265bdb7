/*
 * lattention.c - Lua bindings of scaled-dot-product attention
 * (core/moe_attention.h). Registered by luaopen_moe through
 * lm_open_attention (see lmoe_internal.h).
 *
 *   moe.attention(q, k, v [, {causal = true, scale = nil}])   -> out
 *   moe.scaled_dot_product_attention(...)                      (alias)
 *   q:attention(k, v [, opts])                                 (method)
 *   moe.attention_forward(q, k, v [, opts])                    -> out, lse
 *   moe.attention_backward(q, k, v, out, lse, dout [, opts])   -> dq, dk, dv
 *
 * q, k, v: (B, H, T, D). causal defaults to true (this is the causal
 * attention of language models; pass causal = false for full attention).
 * scale defaults to 1/sqrt(D). attention is differentiable; the _forward /
 * _backward pair is the same computation without autograd (lse is the
 * per-row logsumexp the backward needs).
 */
#include <math.h>
#include <string.h>

#include "lmoe_internal.h"

typedef struct lm_attn_opts {
  bool causal;
  double scale; /* NaN: the default 1/sqrt(D) */
} lm_attn_opts;

/* The options table at arg (nil or absent: the defaults). */
static lm_attn_opts lm_attn_checkopts(lua_State *L, int arg, const char *fname) {
  lm_attn_opts o = {true, NAN};
  if (lua_isnoneornil(L, arg)) return o;
  if (!lua_istable(L, arg))
    lm_argerror(L, arg, fname, "options must be a table {causal = ..., scale = ...}, got %s",
                lm_typename(L, arg));
  lua_pushnil(L);
  while (lua_next(L, arg) != 0) {
    const char *key = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : NULL;
    if (!key)
      lm_argerror(L, arg, fname, "option names must be strings, got %s", lm_describe(L, -2));
    if (strcmp(key, "causal") != 0 && strcmp(key, "scale") != 0)
      lm_argerror(L, arg, fname, "unknown option '%s' (options are causal and scale)", key);
    lua_pop(L, 1);
  }
  int t = lua_getfield(L, arg, "causal");
  if (t != LUA_TNIL) {
    if (t != LUA_TBOOLEAN)
      lm_argerror(L, arg, fname, "causal must be a boolean, got %s", lm_typename(L, -1));
    o.causal = lua_toboolean(L, -1);
  }
  lua_pop(L, 1);
  t = lua_getfield(L, arg, "scale");
  if (t != LUA_TNIL) {
    if (t != LUA_TNUMBER)
      lm_argerror(L, arg, fname, "scale must be a number, got %s", lm_typename(L, -1));
    o.scale = (double)lua_tonumber(L, -1);
    if (!isfinite(o.scale) || o.scale == 0)
      lm_argerror(L, arg, fname, "scale must be finite and non-zero, got %f", (LUAI_UACNUMBER)o.scale);
  }
  lua_pop(L, 1);
  return o;
}

static int lm_attention_impl(lua_State *L, const char *fname) {
  lm_state *S = lm_S(L);
  moe_tensor *q = lm_checktensor(L, 1, fname), *k = lm_checktensor(L, 2, fname),
             *v = lm_checktensor(L, 3, fname);
  lm_attn_opts o = lm_attn_checkopts(L, 4, fname);
  lm_checkend(L, 4, fname);
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_attention(S->ctx, q, k, v, o.causal, o.scale, &out));
  return lm_result(L, S, r, st, out, fname, 0);
}

static int lm_attention(lua_State *L) { return lm_attention_impl(L, "attention"); }
static int lm_sdpa(lua_State *L) { return lm_attention_impl(L, "scaled_dot_product_attention"); }

static int lm_attention_forward(lua_State *L) {
  const char *fname = "attention_forward";
  lm_state *S = lm_S(L);
  moe_tensor *q = lm_checktensor(L, 1, fname), *k = lm_checktensor(L, 2, fname),
             *v = lm_checktensor(L, 3, fname);
  lm_attn_opts o = lm_attn_checkopts(L, 4, fname);
  lm_checkend(L, 4, fname);
  lm_tensor *ro = lm_push_empty(L), *rl = lm_push_empty(L);
  moe_tensor *out = NULL, *lse = NULL;
  moe_status st;
  LM_CALL(L, st, moe_attention_forward(S->ctx, q, k, v, o.causal, o.scale, &out, &lse));
  if (st != MOE_OK) return lm_corefail(L, S, fname, 0);
  lm_adopt(ro, S, out);
  lm_adopt(rl, S, lse);
  return 2;
}

static int lm_attention_backward(lua_State *L) {
  const char *fname = "attention_backward";
  lm_state *S = lm_S(L);
  moe_tensor *in[6];
  for (int i = 0; i < 6; i++) in[i] = lm_checktensor(L, i + 1, fname);
  lm_attn_opts o = lm_attn_checkopts(L, 7, fname);
  lm_checkend(L, 7, fname);
  lm_tensor *r[3] = {lm_push_empty(L), lm_push_empty(L), lm_push_empty(L)};
  moe_tensor *g[3] = {NULL};
  moe_status st;
  LM_CALL(L, st, moe_attention_backward(S->ctx, in[0], in[1], in[2], in[3], in[4], in[5], o.causal,
                                        o.scale, &g[0], &g[1], &g[2]));
  if (st != MOE_OK) return lm_corefail(L, S, fname, 0);
  for (int i = 0; i < 3; i++) lm_adopt(r[i], S, g[i]);
  return 3;
}

static const luaL_Reg lm_attention_functions[] = {
    {"attention", lm_attention},
    {"scaled_dot_product_attention", lm_sdpa},
    {"attention_forward", lm_attention_forward},
    {"attention_backward", lm_attention_backward},
    {NULL, NULL}};
static const luaL_Reg lm_attention_methods[] = {{"attention", lm_attention}, {NULL, NULL}};

void lm_open_attention(lua_State *L, int mod, int methods, int sentinel) {
  lm_register(L, mod, methods, sentinel, lm_attention_functions, lm_attention_methods);
}
