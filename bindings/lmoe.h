/*
 * lmoe.h - the entry point of the `moe` Lua module (bindings/linit.c).
 *
 * The module is compiled twice: into build/moe.so for stock lua5.4 (and
 * busted), and into the moe-lua host, which registers luaopen_moe in
 * package.preload. Either way `local moe = require "moe"` is how Lua code
 * gets it; one moe_ctx is created per Lua state and shared by every load.
 */
#ifndef LMOE_H
#define LMOE_H

#include "lua.h"

LUAMOD_API int luaopen_moe(lua_State *L);

#endif /* LMOE_H */
