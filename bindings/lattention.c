/*
 * lattention.c - Lua bindings of causal scaled-dot-product attention.
 * Registered by luaopen_moe through lm_open_attention (see lmoe_internal.h).
 */
#include "lmoe_internal.h"

static const luaL_Reg lm_attention_functions[] = {{NULL, NULL}};
static const luaL_Reg lm_attention_methods[] = {{NULL, NULL}};

void lm_open_attention(lua_State *L, int mod, int methods, int sentinel) {
  lm_register(L, mod, methods, sentinel, lm_attention_functions, lm_attention_methods);
}
