/*
 * lindex.c - Lua bindings of indexing, sorting, topk, joining, rotary embedding, multinomial.
 * Registered by luaopen_moe through lm_open_index (see lmoe_internal.h).
 */
#include "lmoe_internal.h"

static const luaL_Reg lm_index_functions[] = {{NULL, NULL}};
static const luaL_Reg lm_index_methods[] = {{NULL, NULL}};

void lm_open_index(lua_State *L, int mod, int methods, int sentinel) {
  lm_register(L, mod, methods, sentinel, lm_index_functions, lm_index_methods);
}
