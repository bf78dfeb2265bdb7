/*
 * lscope.c - moe.scope and moe.keep: deterministic freeing of the tensor
 * handles a piece of code makes (STYLE.md point 6).
 *
 *   local y = moe.scope(function(x)
 *     local h = moe.matmul(x, w)        -- freed when the scope ends
 *     self.cache = moe.keep(h:clone())  -- kept: not freed by the scope
 *     return h:relu()                   -- returned: handed to the caller
 *   end, x)
 *
 * moe.scope(fn, ...) -> fn(...)
 *   Runs fn(...) and then frees (t:free(), the one idempotent free path,
 *   lm_release) every tensor handle made during the call, except:
 *     - the handles among fn's results, and those that are values of a plain
 *       table (no metatable) among the results, one level deep: they are
 *       handed to the enclosing scope, or left to the caller (and Lua's
 *       collector) when there is none;
 *     - the handles given to moe.keep.
 *   On an error every handle made during the call is freed and the error is
 *   raised again (the same value; the traceback is that of the re-raise).
 *   fn may not yield.
 * moe.keep(t, ...) -> t, ...
 *   Takes tensor handles out of the scope that would free them (the
 *   innermost that holds them): a module's cache, buffer or table that lives
 *   on after the call. A kept handle is freed by t:free() or the collector.
 * moe.pass_up(t, ...) -> t, ...
 *   Marks handles of the current scopes as outputs of the whole call tree
 *   (a module's aux loss and stats, read by the training step): when their
 *   scope ends they go to the enclosing scope, still marked, and are freed by
 *   the outermost moe.scope. Freed handles, handles of no scope and other
 *   values are ignored, except userdata with a __close metamethod other than
 *   tensors (a routing plan, which a recomputing backward may still use):
 *   those join the innermost scope, marked, and are closed by the outermost
 *   moe.scope.
 * moe.forward_scope(fn, ...) -> fn(...)
 *   moe.scope for nn.Module's __call: the same, except that marked handles
 *   outlive it when it is the outermost scope (left to the caller, as its
 *   results are), so m(x) outside any scope leaves m.stats usable.
 * moe.live_handles() -> the number of handles that hold the module's context
 *   (tensors, events, routing plans, safetensors files), for tests.
 *
 * Freeing a handle drops only that handle's reference: a tensor saved by
 * autograd, stored as another tensor's .grad or viewed by a live handle
 * stays alive through those references, so backward works after the scope
 * of the forward has ended. A handle freed by a scope and used later raises
 * "attempt to use a freed tensor".
 *
 * How: every handle is made by lm_push_empty (bindings/ltensor.c), which calls
 * lm_scope_track. A scope is a frame: a table whose keys are the handles made
 * while it is the innermost scope of the Lua thread that opened it (weak keys,
 * so the collector still frees a handle that becomes garbage inside a long
 * scope), with a link to the enclosing frame. Only the thread that opened a
 * scope records into it: the helper thread that runs saved-tensor hooks and
 * Function backwards (bindings/lautograd.c) manages its own handles.
 * The registry holds, at the address of lm_scope_key, a table thread -> its
 * innermost frame (weak keys).
 */
#include <stdbool.h>

#include "lauxlib.h"
#include "lua.h"

#include "lmoe_internal.h"

static char lm_scope_key;  /* registry: thread -> innermost frame */
static char lm_frame_key;  /* registry: the metatable of frames ({__mode = "k"}) */
static char lm_parent_key; /* frame field: the enclosing frame */

/* The value of a handle in a frame: made there, or marked by moe.pass_up. */
enum { LM_SCOPE_MADE = 1, LM_SCOPE_PASSED = 2 };

void lm_scope_track(lua_State *L) {
  if (lua_rawgetp(L, LUA_REGISTRYINDEX, &lm_scope_key) != LUA_TTABLE) {
    lua_pop(L, 1);
    return;
  }
  luaL_checkstack(L, 4, "moe.scope");
  lua_pushthread(L);
  if (lua_rawget(L, -2) != LUA_TTABLE) {
    lua_pop(L, 2);
    return;
  }
  lua_pushvalue(L, -3); /* the handle */
  lua_pushinteger(L, LM_SCOPE_MADE);
  lua_rawset(L, -3);
  lua_pop(L, 2);
}

/* Pushes the thread -> frame table, creating it (and the frame metatable). */
static void lm_push_scopes(lua_State *L) {
  if (lua_rawgetp(L, LUA_REGISTRYINDEX, &lm_scope_key) == LUA_TTABLE) return;
  lua_pop(L, 1);
  lua_createtable(L, 0, 1);
  lua_createtable(L, 0, 1);
  lua_pushliteral(L, "k");
  lua_setfield(L, -2, "__mode");
  lua_pushvalue(L, -1);
  lua_rawsetp(L, LUA_REGISTRYINDEX, &lm_frame_key);
  lua_setmetatable(L, -2); /* the thread table is weak-keyed too */
  lua_pushvalue(L, -1);
  lua_rawsetp(L, LUA_REGISTRYINDEX, &lm_scope_key);
}

/* Frees every tensor handle that is a key of the frame at idx. When pass is
 * set, the handles marked by moe.pass_up go to the frame at parent instead
 * (parent 0: they are left alone). */
static void lm_frame_release(lua_State *L, int frame, bool pass, int parent) {
  lua_pushnil(L); /* becomes a table of the other userdata to close, when there are some */
  int closing = lua_gettop(L);
  lua_pushnil(L);
  while (lua_next(L, frame)) {
    bool passed = lua_tointeger(L, -1) == LM_SCOPE_PASSED;
    lua_pop(L, 1);
    lm_tensor *u = lm_testtensor(L, -1);
    if (u == NULL && lua_type(L, -1) != LUA_TUSERDATA) continue;
    if (pass && passed) {
      if (parent) {
        lua_pushvalue(L, -1);
        lua_pushinteger(L, LM_SCOPE_PASSED);
        lua_rawset(L, parent);
      }
      continue;
    }
    if (u) {
      lm_release(u);
      continue;
    }
    if (lua_isnil(L, closing)) {
      lua_createtable(L, 4, 0);
      lua_replace(L, closing);
    }
    lua_pushvalue(L, -1);
    lua_rawseti(L, closing, (lua_Integer)lua_rawlen(L, closing) + 1);
  }
  if (!lua_isnil(L, closing)) { /* closed after the traversal */
    for (lua_Integer i = 1, n = (lua_Integer)lua_rawlen(L, closing); i <= n; i++) {
      lua_rawgeti(L, closing, i);
      if (luaL_callmeta(L, -1, "__close")) lua_pop(L, 1);
      lua_pop(L, 1);
    }
  }
  lua_pop(L, 1);
}

/* If the value at v is a handle of the frame, moves it to parent (an index,
 * 0 when there is no enclosing frame). */
static void lm_hand_one(lua_State *L, int v, int frame, int parent) {
  if (lua_type(L, v) != LUA_TUSERDATA) return;
  lua_pushvalue(L, v);
  if (lua_rawget(L, frame) == LUA_TNIL) {
    lua_pop(L, 1);
    return;
  }
  lua_Integer how = lua_tointeger(L, -1);
  lua_pop(L, 1);
  lua_pushvalue(L, v);
  lua_pushnil(L);
  lua_rawset(L, frame);
  if (parent) {
    lua_pushvalue(L, v);
    lua_pushinteger(L, how);
    lua_rawset(L, parent);
  }
}

/* A result: a handle, or a plain table whose values are handed over. */
static void lm_hand_over(lua_State *L, int v, int frame, int parent) {
  if (lua_type(L, v) == LUA_TTABLE) {
    if (lua_getmetatable(L, v)) {
      lua_pop(L, 1);
      return;
    }
    lua_pushnil(L);
    while (lua_next(L, v)) {
      lm_hand_one(L, lua_gettop(L), frame, parent);
      lua_pop(L, 1);
    }
    return;
  }
  lm_hand_one(L, v, frame, parent);
}

/* moe.scope (forward false) and moe.forward_scope (forward true). */
static int lm_scope_run(lua_State *L, bool forward) {
  const char *fname = forward ? "forward_scope" : "scope";
  if (lua_type(L, 1) != LUA_TFUNCTION) {
    if (luaL_getmetafield(L, 1, "__call") == LUA_TNIL)
      return lm_argerror(L, 1, fname, "function expected, got %s", lm_typename(L, 1));
    lua_pop(L, 1);
  }
  int nargs = lua_gettop(L) - 1;
  luaL_checkstack(L, nargs + 8, "moe.scope");
  lm_push_scopes(L);
  int scopes = lua_gettop(L);
  lua_pushthread(L);
  lua_rawget(L, scopes);
  int parent = lua_gettop(L); /* a frame or nil */
  lua_createtable(L, 0, 8);
  int frame = lua_gettop(L);
  lua_rawgetp(L, LUA_REGISTRYINDEX, &lm_frame_key);
  lua_setmetatable(L, frame);
  if (!lua_isnil(L, parent)) {
    lua_pushvalue(L, parent);
    lua_rawsetp(L, frame, &lm_parent_key);
  }
  lua_pushthread(L);
  lua_pushvalue(L, frame);
  lua_rawset(L, scopes);

  int base = lua_gettop(L);
  for (int i = 1; i <= nargs + 1; i++) lua_pushvalue(L, i);
  int st = lua_pcall(L, nargs, LUA_MULTRET, 0);
  /* the enclosing frame is innermost again */
  lua_pushthread(L);
  lua_pushvalue(L, parent);
  lua_rawset(L, scopes);
  if (st != LUA_OK) {
    lm_frame_release(L, frame, false, 0);
    return lua_error(L); /* the error value is at the top */
  }
  int top = lua_gettop(L);
  int p = lua_isnil(L, parent) ? 0 : parent;
  for (int i = base + 1; i <= top; i++) lm_hand_over(L, i, frame, p);
  luaL_checkstack(L, 4, "moe.scope");
  lm_frame_release(L, frame, p != 0 || forward, p);
  return top - base;
}

static int lm_scope(lua_State *L) { return lm_scope_run(L, false); }
static int lm_forward_scope(lua_State *L) { return lm_scope_run(L, true); }

/* Finds the frame of the thread's scopes that holds the handle at arg;
 * leaves it on the stack (or nil) and returns whether found. Expects the
 * innermost frame (or nil) at the top. */
static bool lm_find_frame(lua_State *L, int arg) {
  lua_pushvalue(L, -1);
  while (lua_type(L, -1) == LUA_TTABLE) {
    lua_pushvalue(L, arg);
    if (lua_rawget(L, -2) != LUA_TNIL) {
      lua_pop(L, 1);
      return true;
    }
    lua_pop(L, 1);
    lua_rawgetp(L, -1, &lm_parent_key);
    lua_remove(L, -2);
  }
  return false;
}

static int lm_pass_up(lua_State *L) {
  int n = lua_gettop(L);
  if (lua_rawgetp(L, LUA_REGISTRYINDEX, &lm_scope_key) != LUA_TTABLE) {
    lua_pop(L, 1);
    return n;
  }
  luaL_checkstack(L, 6, "moe.pass_up");
  lua_pushthread(L);
  lua_rawget(L, -2);
  for (int i = 1; i <= n; i++) {
    lm_tensor *u = lm_testtensor(L, i);
    if (u == NULL) {
      /* another closeable userdata: into the innermost frame, marked */
      if (lua_type(L, i) == LUA_TUSERDATA && lua_istable(L, -1) &&
          luaL_getmetafield(L, i, "__close") != LUA_TNIL) {
        lua_pop(L, 1);
        lua_pushvalue(L, i);
        lua_pushinteger(L, LM_SCOPE_PASSED);
        lua_rawset(L, -3);
      }
      continue;
    }
    if (u->t == NULL) continue;
    if (lm_find_frame(L, i)) {
      lua_pushvalue(L, i);
      lua_pushinteger(L, LM_SCOPE_PASSED);
      lua_rawset(L, -3);
    }
    lua_pop(L, 1);
  }
  lua_pop(L, 2);
  return n;
}

static int lm_keep(lua_State *L) {
  int n = lua_gettop(L);
  for (int i = 1; i <= n; i++) {
    lm_tensor *u = lm_testtensor(L, i);
    if (u == NULL) lm_argerror(L, i, "keep", "tensor expected, got %s", lm_typename(L, i));
    if (u->t == NULL) lm_argerror(L, i, "keep", "attempt to use a freed tensor");
  }
  if (lua_rawgetp(L, LUA_REGISTRYINDEX, &lm_scope_key) != LUA_TTABLE) {
    lua_pop(L, 1);
    return n;
  }
  luaL_checkstack(L, 6, "moe.keep");
  lua_pushthread(L);
  lua_rawget(L, -2); /* the innermost frame or nil */
  for (int i = 1; i <= n; i++) {
    if (lm_find_frame(L, i)) {
      lua_pushvalue(L, i);
      lua_pushnil(L);
      lua_rawset(L, -3);
    }
    lua_pop(L, 1);
  }
  lua_pop(L, 2);
  return n;
}

static int lm_live_handles(lua_State *L) {
  lm_state *S = lm_S(L);
  lm_checkend(L, 0, "live_handles");
  lua_pushinteger(L, (lua_Integer)(S->refs - 1));
  return 1;
}

static const luaL_Reg lm_scope_functions[] = {
    {"scope", lm_scope},       {"forward_scope", lm_forward_scope}, {"keep", lm_keep},
    {"pass_up", lm_pass_up},   {"live_handles", lm_live_handles},   {NULL, NULL}};

void lm_open_scope(lua_State *L, int mod, int methods, int sentinel) {
  lm_register(L, mod, methods, sentinel, lm_scope_functions, NULL);
}
