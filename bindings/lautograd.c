/*
 * lautograd.c - Lua bindings of autograd: requires_grad, backward, grad, no_grad, detach, Lua-defined functions, saved-tensor hooks.
 * Registered by luaopen_moe through lm_open_autograd (see lmoe_internal.h).
 */
#include "lmoe_internal.h"

static const luaL_Reg lm_autograd_functions[] = {{NULL, NULL}};
static const luaL_Reg lm_autograd_methods[] = {{NULL, NULL}};

void lm_open_autograd(lua_State *L, int mod, int methods, int sentinel) {
  lm_register(L, mod, methods, sentinel, lm_autograd_functions, lm_autograd_methods);
}
