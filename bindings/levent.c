/*
 * levent.c - moe.Event: timing points on a device's work queue (moe.h
 * "events"), the Lua face of moe_event.
 *
 *   local e0, e1 = moe.Event("cuda"), moe.Event("cuda")
 *   e0:record(); work(); e1:record(); e1:synchronize()
 *   print(e0:elapsed(e1), "ms")
 *
 * An event userdata holds one reference to the state (like a tensor), so the
 * context outlives it; e:free(), __close and __gc share one idempotent
 * function, and a freed event raises "attempt to use a freed event".
 */
#include "lmoe_internal.h"

#define LM_EVENT "moe.Event"

typedef struct lm_event {
  moe_event *e; /* NULL before creation and after free */
  lm_state *S;  /* one reference while e is not NULL */
} lm_event;

static lm_event *lm_checkevent(lua_State *L, int arg, const char *fname) {
  lm_event *u = (lm_event *)luaL_testudata(L, arg, LM_EVENT);
  if (u == NULL) lm_argerror(L, arg, fname, "event expected, got %s", lm_typename(L, arg));
  if (u->e == NULL) lm_argerror(L, arg, fname, "attempt to use a freed event");
  return u;
}

static int lm_event_release(lua_State *L) {
  lm_event *u = (lm_event *)luaL_checkudata(L, 1, LM_EVENT);
  if (u->e) {
    moe_event_free(u->S->ctx, u->e);
    u->e = NULL;
    lm_state_unref(u->S);
    u->S = NULL;
  }
  return 0;
}

/* moe.Event([device]): a new event on device (default "cpu"). */
static int lm_event_new(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_device d = MOE_CPU;
  if (!lua_isnoneornil(L, 1)) d = lm_checkdevice_at(L, S, 1, 1, "Event");
  lm_checkend(L, 1, "Event");
  lm_event *u = (lm_event *)lua_newuserdatauv(L, sizeof *u, 0);
  u->e = NULL;
  u->S = NULL;
  luaL_setmetatable(L, LM_EVENT);
  moe_event *e = NULL;
  if (moe_event_new(S->ctx, d, &e) != MOE_OK) return lm_corefail(L, S, "Event", 1);
  u->e = e;
  u->S = S;
  S->refs++;
  return 1;
}

static int lm_event_record(lua_State *L) {
  lm_event *u = lm_checkevent(L, 1, "record");
  lm_checkend(L, 1, "record");
  if (moe_event_record(u->S->ctx, u->e) != MOE_OK) return lm_corefail(L, u->S, "record", 0);
  lua_settop(L, 1);
  return 1; /* e:record() returns e, so `local t0 = moe.Event("cuda"):record()` */
}

static int lm_event_synchronize(lua_State *L) {
  lm_event *u = lm_checkevent(L, 1, "synchronize");
  lm_checkend(L, 1, "synchronize");
  if (moe_event_synchronize(u->S->ctx, u->e) != MOE_OK) return lm_corefail(L, u->S, "synchronize", 0);
  return 0;
}

/* start:elapsed(end): milliseconds from start to end. */
static int lm_event_elapsed(lua_State *L) {
  lm_event *a = lm_checkevent(L, 1, "elapsed");
  lm_event *b = lm_checkevent(L, 2, "elapsed");
  lm_checkend(L, 2, "elapsed");
  double ms = 0;
  if (moe_event_elapsed(a->S->ctx, a->e, b->e, &ms) != MOE_OK) return lm_corefail(L, a->S, "elapsed", 0);
  lua_pushnumber(L, (lua_Number)ms);
  return 1;
}

static int lm_event_tostring(lua_State *L) {
  lm_event *u = (lm_event *)luaL_checkudata(L, 1, LM_EVENT);
  lua_pushfstring(L, u->e ? "moe.Event (%p)" : "moe.Event (freed)", (void *)u);
  return 1;
}

static const luaL_Reg lm_event_methods[] = {{"record", lm_event_record},
                                            {"synchronize", lm_event_synchronize},
                                            {"elapsed", lm_event_elapsed},
                                            {"free", lm_event_release},
                                            {NULL, NULL}};

static const luaL_Reg lm_event_functions[] = {{"Event", lm_event_new}, {NULL, NULL}};

void lm_open_event(lua_State *L, int mod, int methods, int sentinel) {
  if (luaL_newmetatable(L, LM_EVENT)) {
    lua_pushcfunction(L, lm_event_release);
    lua_setfield(L, -2, "__gc");
    lua_pushcfunction(L, lm_event_release);
    lua_setfield(L, -2, "__close");
    lua_pushcfunction(L, lm_event_tostring);
    lua_setfield(L, -2, "__tostring");
    luaL_newlibtable(L, lm_event_methods);
    luaL_setfuncs(L, lm_event_methods, 0);
    lua_setfield(L, -2, "__index");
  }
  lua_pop(L, 1);
  lm_register(L, mod, methods, sentinel, lm_event_functions, NULL);
}
