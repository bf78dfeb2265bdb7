/*
 * lmatmul.c - Lua bindings of matmul, bmm, linear.
 * Registered by luaopen_moe through lm_open_matmul (see lmoe_internal.h).
 */
#include "lmoe_internal.h"

static const luaL_Reg lm_matmul_functions[] = {{NULL, NULL}};
static const luaL_Reg lm_matmul_methods[] = {{NULL, NULL}};

void lm_open_matmul(lua_State *L, int mod, int methods, int sentinel) {
  lm_register(L, mod, methods, sentinel, lm_matmul_functions, lm_matmul_methods);
}
