/*
 * lpointwise.c - Lua bindings of pointwise math, comparisons, activations, dropout.
 * Registered by luaopen_moe through lm_open_pointwise (see lmoe_internal.h).
 */
#include "lmoe_internal.h"

static const luaL_Reg lm_pointwise_functions[] = {{NULL, NULL}};
static const luaL_Reg lm_pointwise_methods[] = {{NULL, NULL}};

void lm_open_pointwise(lua_State *L, int mod, int methods, int sentinel) {
  lm_register(L, mod, methods, sentinel, lm_pointwise_functions, lm_pointwise_methods);
}
