/*
 * linit.c - luaopen_moe, the opener of the `moe` module, as linit.c opens
 * Lua's standard libraries: it makes the state, the module table and the
 * moe.ops table once, then hands them to each family's opener from two
 * lists, lm_families (functions under moe) and lm_ops_families (under
 * moe.ops). A new family is one line in one of the lists and one
 * declaration in lmoe_internal.h.
 *
 * Ownership and the lifetime of the context
 *   One moe_ctx per Lua state, created by the first luaopen_moe and kept in
 *   the registry (key "moe.state") inside a sentinel userdata, which every
 *   function of the module has as upvalue 1 (lm_S finds the state there).
 *   Each tensor userdata (and event, routing plan, ...) owns one reference
 *   to the lm_state holding the ctx; the sentinel owns one more. The ctx is
 *   freed when the last of these references goes (lm_state_unref), so the
 *   order in which lua_close runs finalizers does not matter (it is the
 *   reverse order of marking, which would already put the sentinel last,
 *   but a finalizer that creates tensors could defeat that).
 *
 * After the C families, luaopen_moe sets package.loaded.moe and requires
 * moe.lib, the part of the module written in Lua (lua/moe/lib.lua).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lauxlib.h"
#include "lua.h"
#include "lualib.h"

#include "lmoe.h"
#include "lmoe_internal.h"

/* -------------------------------------------------------------- the state */

void lm_state_unref(lm_state *S) {
  if (--S->refs == 0) {
    if (S->ctx) moe_ctx_free(S->ctx);
    free(S);
  }
}

static int lm_sentinel_gc(lua_State *L) {
  lm_sentinel *b = (lm_sentinel *)luaL_checkudata(L, 1, LM_SENTINEL);
  lm_state *S = b->S;
  b->S = NULL;
  if (S) lm_state_unref(S);
  return 0;
}

/* Every function of the module has the sentinel as upvalue 1. */
lm_state *lm_S(lua_State *L) {
  lm_sentinel *b = (lm_sentinel *)lua_touserdata(L, lua_upvalueindex(1));
  if (b == NULL || b->S == NULL) luaL_error(L, "moe: the module's context is closed");
  return b->S;
}

/* Pushes the sentinel of this Lua state, creating it (and the context) on
 * the first call. */
static void lm_push_sentinel(lua_State *L) {
  if (lua_getfield(L, LUA_REGISTRYINDEX, LM_STATE_KEY) == LUA_TUSERDATA) return;
  lua_pop(L, 1);
  lm_scratch_init(L);
  lm_sentinel *b = (lm_sentinel *)lua_newuserdatauv(L, sizeof *b, 0);
  b->S = NULL;
  if (luaL_newmetatable(L, LM_SENTINEL)) {
    lua_pushcfunction(L, lm_sentinel_gc);
    lua_setfield(L, -2, "__gc");
  }
  lua_setmetatable(L, -2);
  lm_state *S = (lm_state *)malloc(sizeof *S);
  if (S == NULL) luaL_error(L, "moe: not enough memory");
  S->ctx = NULL;
  S->refs = 1;
  S->print = moe_print_options_default();
  S->gc_step = lm_gc_step_default("MOE_GC_STEP_MB", 1024);
  S->host_gc_step = lm_gc_step_default("MOE_HOST_GC_STEP_MB", 256);
  S->gc_debt = S->host_gc_debt = 0;
  S->gc_cycles = 0;
  b->S = S;
  if (S->gc_step < 0 || S->host_gc_step < 0) { /* from here the sentinel's __gc frees S */
    const char *var = S->gc_step < 0 ? "MOE_GC_STEP_MB" : "MOE_HOST_GC_STEP_MB";
    luaL_error(L, "moe: %s must be a whole number of MiB in [0, 2^40], got '%s'", var, getenv(var));
  }
  moe_status st = moe_ctx_init(&S->ctx);
  if (st != MOE_OK) luaL_error(L, "moe: cannot create the context (%s)", moe_status_name(st));
  lua_pushvalue(L, -1);
  lua_setfield(L, LUA_REGISTRYINDEX, LM_STATE_KEY);
}

/* ---------------------------------------------------------------- opening */

#ifdef MOE_LUA_DIR
/* Appends the repository's lua/ folder to package.path, so that moe.lib,
 * moe.config, ... load from stock lua5.4 too (moe-lua puts it first). */
static void lm_add_lua_dir(lua_State *L) {
  luaL_getsubtable(L, LUA_REGISTRYINDEX, LUA_LOADED_TABLE);
  if (lua_getfield(L, -1, LUA_LOADLIBNAME) == LUA_TTABLE) {
    lua_getfield(L, -1, "path");
    const char *path = lua_tostring(L, -1);
    if (path && strstr(path, MOE_LUA_DIR "/?.lua") == NULL) {
      size_t n = strlen(path);
      lua_pushfstring(L, "%s%s" MOE_LUA_DIR "/?.lua;" MOE_LUA_DIR "/?/init.lua", path,
                      (n == 0 || path[n - 1] == ';') ? "" : ";");
      lua_setfield(L, -3, "path");
    }
    lua_pop(L, 1);
  }
  lua_pop(L, 2);
}
#endif

void lm_register(lua_State *L, int lib, int methods, int sentinel, const luaL_Reg *functions,
                 const luaL_Reg *tensor_methods) {
  lib = lua_absindex(L, lib);
  methods = lua_absindex(L, methods);
  sentinel = lua_absindex(L, sentinel);
  for (const luaL_Reg *r = functions; r && r->name; r++) {
    lua_pushvalue(L, sentinel);
    lua_pushcclosure(L, r->func, 1);
    lua_setfield(L, lib, r->name);
  }
  for (const luaL_Reg *r = tensor_methods; r && r->name; r++) {
    lua_pushvalue(L, sentinel);
    lua_pushcclosure(L, r->func, 1);
    lua_setfield(L, methods, r->name);
  }
}

typedef void (*lm_opener)(lua_State *L, int lib, int methods, int sentinel);

/* The families whose functions are moe.<name>, opened in this order. */
static const lm_opener lm_families[] = {
    lm_open_tensor, lm_open_device,    lm_open_autograd, lm_open_pointwise, lm_open_reduce,
    lm_open_index,  lm_open_matmul,    lm_open_attention, lm_open_event,   lm_open_io,
    lm_open_scope,  lm_open_proc,      lm_open_dist,     lm_open_reducer,  NULL};

/* The families whose functions are moe.ops.<name>: their opener gets the
 * moe.ops table where the others get the module. */
static const lm_opener lm_ops_families[] = {
    lm_open_routing, lm_open_quantize, lm_open_grouped,     lm_open_experts,
    lm_open_optim,   lm_open_data,     lm_open_blocksparse, NULL};

LUAMOD_API int luaopen_moe(lua_State *L) {
  luaL_checkversion(L);
  lm_push_sentinel(L);
  int sentinel = lua_gettop(L);
  lm_push_methods(L, sentinel);
  int methods = lua_gettop(L);

  lua_newtable(L); /* the module */
  int mod = lua_gettop(L);
  lua_pushliteral(L, MOE_VERSION);
  lua_setfield(L, mod, "version");
  lua_createtable(L, MOE_DTYPE_COUNT, 0);
  for (int i = 0; i < MOE_DTYPE_COUNT; i++) {
    lua_pushstring(L, moe_dtype_name((moe_dtype)i));
    lua_rawseti(L, -2, i + 1);
  }
  lua_setfield(L, mod, "dtypes");
  for (int i = 0; lm_families[i]; i++) lm_families[i](L, mod, methods, sentinel);

  lua_newtable(L); /* moe.ops: made here and only here */
  lua_pushvalue(L, -1);
  lua_setfield(L, mod, "ops");
  int ops = lua_gettop(L);
  for (int i = 0; lm_ops_families[i]; i++) lm_ops_families[i](L, ops, methods, sentinel);
  lua_pop(L, 1);

#ifdef MOE_LUA_DIR
  lm_add_lua_dir(L);
#endif
  /* package.loaded.moe = the module, so that moe.lib can require it. */
  luaL_getsubtable(L, LUA_REGISTRYINDEX, LUA_LOADED_TABLE);
  lua_pushvalue(L, -2);
  lua_setfield(L, -2, "moe");
  lua_pop(L, 1);

  /* The parts written in Lua (moe.config, ...). */
  lua_getglobal(L, "require");
  lua_pushliteral(L, "moe.lib");
  if (lua_pcall(L, 1, 0, 0) != LUA_OK) {
    const char *msg = lua_tostring(L, -1);
#ifdef MOE_LUA_DIR
    return luaL_error(L, "moe: cannot load moe.lib, the Lua part of the module (expected in %s): %s",
                      MOE_LUA_DIR, msg ? msg : "(no message)");
#else
    return luaL_error(L, "moe: cannot load moe.lib, the Lua part of the module: %s", msg ? msg : "(no message)");
#endif
  }
  return 1;
}
