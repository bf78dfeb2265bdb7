/*
 * ldist.c - moe.dist, the Lua face of moe_dist.h: the world, groups,
 * collectives and their work handles. lua/moe/dist.lua adds dist.world,
 * dist.device, the mesh and the differentiable forms (dist.functional).
 *
 *   dist.init{timeout = 600, debug = false} -> the world group
 *   dist.rank(), dist.world_size(), dist.local_rank(), dist.local_world_size()
 *   dist.launcher(), dist.initialized(), dist.barrier([group])
 *   dist.all_reduce(t, op, {group =, async =}) and the other collectives:
 *     nothing, or a work handle with async = true
 *   dist.finalize(), dist.abort([code])
 *   g:rank(), g:size(), g:name(), g:world_rank(r), g:ranks(),
 *   g:split(color [, key [, name]]), g:set_timeout(s), g:timeout(),
 *   g:set_debug(on), g:free()
 *   w:wait(), w:done(), w:free()
 *   dist.comm_timing([on]) -> whether it was on; dist.comm_times([op]),
 *   dist.comm_times_reset(): opt-in per-collective timing (moe_dist.h)
 *
 * The world starts on first use (dist.init is only needed for its options).
 *
 * Userdata
 *   moe.Group  a communicator: owned when made by split (freed by g:free(),
 *              __close or __gc, one idempotent function), borrowed for the
 *              world (which moe_dist_finalize frees). A freed group raises
 *              "attempt to use a freed group".
 *   moe.Work   a moe_work and one reference to the state (its free needs
 *              the context). Pushed empty before the core is called, so the
 *              collector owns the work as soon as it exists; __gc frees it
 *              (moe_work_free waits for an unwaited one first).
 * Both are listed in weak tables of the registry, so dist.finalize() can
 * free every work and disown every group before the communicators go.
 *
 * Every binding checks all of its Lua arguments before the core runs a
 * collective; after that the only Lua error is the core's, raised last.
 */
#include <stdint.h>
#include <string.h>

#include "lmoe_internal.h"

#define LM_GROUP "moe.Group"
#define LM_WORK "moe.Work"
#define LM_GROUPS_KEY "moe.dist.groups" /* weak table of group userdata */
#define LM_WORKS_KEY "moe.dist.works"   /* weak table of work userdata */
#define LM_WORLD_KEY "moe.dist.world"   /* the world's group userdata */

typedef struct lm_group {
  moe_comm *c; /* NULL after free */
  bool owned;  /* made by split: freed with the handle */
} lm_group;

typedef struct lm_work {
  moe_work *w; /* NULL before the core made it and after free */
  lm_state *S; /* one reference while w is not NULL */
} lm_work;

/* --------------------------------------------------------------- helpers */

/* Adds the userdata at the top of the stack to the weak table at key. */
static void lm_track(lua_State *L, const char *key) {
  if (lua_getfield(L, LUA_REGISTRYINDEX, key) != LUA_TTABLE) {
    lua_pop(L, 1);
    lua_newtable(L);
    lua_newtable(L);
    lua_pushliteral(L, "k");
    lua_setfield(L, -2, "__mode");
    lua_setmetatable(L, -2);
    lua_pushvalue(L, -1);
    lua_setfield(L, LUA_REGISTRYINDEX, key);
  }
  lua_pushvalue(L, -2);
  lua_pushboolean(L, 1);
  lua_rawset(L, -3);
  lua_pop(L, 1);
}

/* The world, started on first use. */
static moe_comm *lm_world(lua_State *L, lm_state *S, const char *fname) {
  moe_comm *w = NULL;
  if (moe_dist_init(S->ctx, &w) != MOE_OK) lm_corefail(L, S, fname, 0);
  return w;
}

static lm_group *lm_push_group(lua_State *L, moe_comm *c, bool owned) {
  lm_group *g = (lm_group *)lua_newuserdatauv(L, sizeof *g, 0);
  g->c = c;
  g->owned = owned;
  luaL_setmetatable(L, LM_GROUP);
  lm_track(L, LM_GROUPS_KEY);
  return g;
}

/* Pushes the world's group userdata (one per Lua state). */
static void lm_push_world(lua_State *L, lm_state *S, const char *fname) {
  moe_comm *w = lm_world(L, S, fname);
  if (lua_getfield(L, LUA_REGISTRYINDEX, LM_WORLD_KEY) == LUA_TUSERDATA) {
    lm_group *g = (lm_group *)lua_touserdata(L, -1);
    if (g->c == w) return;
    g->c = NULL; /* a world of an earlier init */
  }
  lua_pop(L, 1);
  lm_push_group(L, w, false);
  lua_pushvalue(L, -1);
  lua_setfield(L, LUA_REGISTRYINDEX, LM_WORLD_KEY);
}

moe_comm *lm_checkgroup_at(lua_State *L, int idx, int arg, const char *fname) {
  lm_group *g = (lm_group *)luaL_testudata(L, idx, LM_GROUP);
  if (g == NULL) lm_argerror(L, arg, fname, "group expected, got %s", lm_typename(L, idx));
  if (g->c == NULL) lm_argerror(L, arg, fname, "attempt to use a freed group");
  return g->c;
}

/* A group at arg, or the world when it is nil or absent. */
static moe_comm *lm_optgroup(lua_State *L, lm_state *S, int arg, const char *fname) {
  if (lua_isnoneornil(L, arg)) return lm_world(L, S, fname);
  return lm_checkgroup_at(L, arg, arg, fname);
}

/* The options {group =, async =} at arg (nil: the world, synchronous). */
static moe_comm *lm_collopts(lua_State *L, lm_state *S, int arg, const char *fname, bool *async) {
  static const char *const known[] = {"group", "async", NULL};
  *async = false;
  if (lua_isnoneornil(L, arg)) return lm_world(L, S, fname);
  if (lua_type(L, arg) != LUA_TTABLE)
    lm_argerror(L, arg, fname, "options table expected ({group =, async =}), got %s",
                lm_typename(L, arg));
  lm_checkkeys(L, arg, fname, known);
  *async = lm_field_bool(L, arg, fname, "async", false);
  moe_comm *c;
  if (lua_getfield(L, arg, "group") == LUA_TNIL) c = lm_world(L, S, fname);
  else c = lm_checkgroup_at(L, lua_gettop(L), arg, fname);
  lua_pop(L, 1);
  return c;
}

static moe_reduce_op lm_checkreduce(lua_State *L, int arg, const char *fname) {
  moe_reduce_op op = MOE_REDUCE_SUM;
  if (lua_isnoneornil(L, arg)) return op;
  if (lua_type(L, arg) != LUA_TSTRING || !moe_reduce_op_parse(lua_tostring(L, arg), &op))
    lm_argerror(L, arg, fname, "op must be \"sum\", \"avg\", \"max\" or \"min\", got %s",
                lm_describe(L, arg));
  return op;
}

/* Splits: a table of n integers or an i64 CPU tensor of n elements, into
 * a block that lives on the stack (collected with it). */
static int64_t *lm_checksplits(lua_State *L, lm_state *S, int arg, const char *fname,
                               const char *what, int n) {
  int64_t *v = (int64_t *)lua_newuserdatauv(L, (size_t)(n > 0 ? n : 1) * sizeof *v, 0);
  if (lua_type(L, arg) == LUA_TTABLE) {
    lua_Unsigned len = lua_rawlen(L, arg);
    if (len != (lua_Unsigned)n)
      lm_argerror(L, arg, fname, "%s splits must have one entry per rank of the group (%d), got %d",
                  what, n, (int)(len > 1000000 ? 1000000 : len));
    for (int i = 0; i < n; i++) {
      lua_rawgeti(L, arg, i + 1);
      int isint = 0;
      lua_Integer x = lua_type(L, -1) == LUA_TNUMBER ? lua_tointegerx(L, -1, &isint) : 0;
      if (!isint)
        lm_argerror(L, arg, fname, "%s splits[%d] must be an integer, got %s", what, i + 1,
                    lm_describe(L, -1));
      v[i] = (int64_t)x;
      lua_pop(L, 1);
    }
    return v;
  }
  lm_tensor *u = lm_testtensor(L, arg);
  if (u == NULL)
    lm_argerror(L, arg, fname, "%s splits must be a table of integers or an i64 CPU tensor, got %s",
                what, lm_typename(L, arg));
  moe_tensor *t = lm_checktensor(L, arg, fname);
  if (t->dtype != MOE_I64 || moe_tensor_device(t).type != MOE_DEVICE_CPU || t->ndim != 1 ||
      t->shape[0] != n)
    lm_argerror(L, arg, fname, "%s splits must be an i64 CPU tensor of %d elements, got %s %s on %s",
                what, n, moe_dtype_name(t->dtype), MOE_SHAPE(t), MOE_DEVICE(moe_tensor_device(t)));
  if (moe_tensor_to_i64(S->ctx, t, v) != MOE_OK) lm_corefail(L, S, fname, arg);
  return v;
}

/* ---------------------------------------------------------------- works */

static lm_work *lm_push_work(lua_State *L) {
  lm_work *u = (lm_work *)lua_newuserdatauv(L, sizeof *u, 0);
  u->w = NULL;
  u->S = NULL;
  luaL_setmetatable(L, LM_WORK);
  lm_track(L, LM_WORKS_KEY);
  return u;
}

static void lm_work_adopt(lm_work *u, lm_state *S, moe_work *w) {
  u->w = w;
  u->S = S;
  S->refs++;
}

static void lm_work_release(lm_work *u) {
  if (u->w) {
    moe_work_free(u->S->ctx, u->w); /* waits first when unwaited */
    u->w = NULL;
    lm_state_unref(u->S);
    u->S = NULL;
  }
}

static int lm_work_gc(lua_State *L) {
  lm_work_release((lm_work *)luaL_checkudata(L, 1, LM_WORK));
  return 0;
}

static lm_work *lm_checkwork(lua_State *L, int arg, const char *fname) {
  lm_work *u = (lm_work *)luaL_testudata(L, arg, LM_WORK);
  if (u == NULL) lm_argerror(L, arg, fname, "work expected, got %s", lm_typename(L, arg));
  if (u->w == NULL) lm_argerror(L, arg, fname, "attempt to use a freed work");
  return u;
}

/* w:wait(): the result is usable after it (on a GPU: by later work on the
 * compute stream). Waiting twice is allowed. */
static int lm_work_wait(lua_State *L) {
  lm_work *u = lm_checkwork(L, 1, "wait");
  lm_checkend(L, 1, "wait");
  if (moe_work_wait(u->S->ctx, u->w) != MOE_OK) return lm_corefail(L, u->S, "wait", 0);
  return 0;
}

static int lm_work_done(lua_State *L) {
  lm_work *u = lm_checkwork(L, 1, "done");
  lm_checkend(L, 1, "done");
  lua_pushboolean(L, moe_work_done(u->S->ctx, u->w));
  return 1;
}

static int lm_work_tostring(lua_State *L) {
  lm_work *u = (lm_work *)luaL_checkudata(L, 1, LM_WORK);
  lua_pushfstring(L, u->w ? "moe.Work (%p)" : "moe.Work (freed)", (void *)u);
  return 1;
}

/* The tail of a collective: raises the core's error, or returns the work
 * (at index wi) when async, nothing otherwise. */
static int lm_coll_end(lua_State *L, lm_state *S, moe_status st, bool async, int wi, moe_work *w,
                       const char *fname) {
  if (st != MOE_OK) return lm_corefail(L, S, fname, 0);
  if (!async) return 0;
  lm_work_adopt((lm_work *)lua_touserdata(L, wi), S, w);
  lua_pushvalue(L, wi);
  return 1;
}

/* --------------------------------------------------------------- groups */

static void lm_group_release(lm_group *g) {
  if (g->c && g->owned) moe_comm_free(g->c);
  g->c = NULL;
}

static int lm_group_gc(lua_State *L) {
  lm_group_release((lm_group *)luaL_checkudata(L, 1, LM_GROUP));
  return 0;
}

static int lm_group_rank(lua_State *L) {
  moe_comm *c = lm_checkgroup_at(L, 1, 1, "rank");
  lua_pushinteger(L, moe_comm_rank(c));
  return 1;
}

static int lm_group_size(lua_State *L) {
  moe_comm *c = lm_checkgroup_at(L, 1, 1, "size");
  lua_pushinteger(L, moe_comm_size(c));
  return 1;
}

static int lm_group_name(lua_State *L) {
  moe_comm *c = lm_checkgroup_at(L, 1, 1, "name");
  lua_pushstring(L, moe_comm_name(c));
  return 1;
}

/* g:world_rank(r): the world rank of the group's rank r. */
static int lm_group_world_rank(lua_State *L) {
  moe_comm *c = lm_checkgroup_at(L, 1, 1, "world_rank");
  int64_t r = lm_checkint(L, 2, "world_rank", "rank");
  if (r < 0 || r >= moe_comm_size(c))
    lm_argerror(L, 2, "world_rank", "rank %d is not a rank of group '%s' (0..%d)", (int)r,
                moe_comm_name(c), moe_comm_size(c) - 1);
  lua_pushinteger(L, moe_comm_world_rank(c, (int)r));
  return 1;
}

/* g:ranks(): the world ranks of the group, in its order (0-based). */
static int lm_group_ranks(lua_State *L) {
  moe_comm *c = lm_checkgroup_at(L, 1, 1, "ranks");
  int n = moe_comm_size(c);
  lua_createtable(L, n, 0);
  for (int r = 0; r < n; r++) {
    lua_pushinteger(L, moe_comm_world_rank(c, r));
    lua_rawseti(L, -2, r + 1);
  }
  return 1;
}

/* g:split(color [, key [, name]]): collective over g; key defaults to the
 * rank in g, name to "<g's name>.<color>". */
static int lm_group_split(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_comm *c = lm_checkgroup_at(L, 1, 1, "split");
  int64_t color = lm_checkint(L, 2, "split", "color");
  if (color < 0 || color > INT32_MAX)
    lm_argerror(L, 2, "split", "color must be in [0, 2^31), got %d", (int)color);
  int64_t key = lm_optint(L, 3, "split", "key", moe_comm_rank(c));
  if (key < INT32_MIN || key > INT32_MAX) lm_argerror(L, 3, "split", "key must fit in 32 bits");
  const char *name = NULL;
  if (lua_isnoneornil(L, 4)) {
    name = lua_pushfstring(L, "%s.%d", moe_comm_name(c), (int)color);
  } else {
    if (lua_type(L, 4) != LUA_TSTRING)
      lm_argerror(L, 4, "split", "name must be a string, got %s", lm_typename(L, 4));
    name = lua_tostring(L, 4);
  }
  lm_checkend(L, 4, "split");
  lm_group *g = lm_push_group(L, NULL, true);
  moe_comm *out = NULL;
  if (moe_comm_split(S->ctx, c, (int)color, (int)key, name, &out) != MOE_OK)
    return lm_corefail(L, S, "split", 0);
  g->c = out;
  return 1;
}

static int lm_group_set_timeout(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_comm *c = lm_checkgroup_at(L, 1, 1, "set_timeout");
  double s = lm_checknum(L, 2, "set_timeout", "seconds");
  lm_checkend(L, 2, "set_timeout");
  if (moe_comm_set_timeout(S->ctx, c, s) != MOE_OK) return lm_corefail(L, S, "set_timeout", 2);
  return 0;
}

static int lm_group_timeout(lua_State *L) {
  moe_comm *c = lm_checkgroup_at(L, 1, 1, "timeout");
  lua_pushnumber(L, moe_comm_timeout(c));
  return 1;
}

static int lm_group_set_debug(lua_State *L) {
  moe_comm *c = lm_checkgroup_at(L, 1, 1, "set_debug");
  if (lua_type(L, 2) != LUA_TBOOLEAN)
    lm_argerror(L, 2, "set_debug", "boolean expected, got %s", lm_typename(L, 2));
  moe_comm_set_debug(c, lua_toboolean(L, 2));
  return 0;
}

static int lm_group_tostring(lua_State *L) {
  lm_group *g = (lm_group *)luaL_checkudata(L, 1, LM_GROUP);
  if (g->c)
    lua_pushfstring(L, "moe.Group '%s' (rank %d of %d)", moe_comm_name(g->c), moe_comm_rank(g->c),
                    moe_comm_size(g->c));
  else lua_pushliteral(L, "moe.Group (freed)");
  return 1;
}

/* ---------------------------------------------------------------- world */

/* dist.init{timeout =, debug =} -> the world group. Starts the world
 * (once); the options apply to the world group. */
static int lm_dist_init(lua_State *L) {
  static const char *const known[] = {"timeout", "debug", NULL};
  lm_state *S = lm_S(L);
  double timeout = 0;
  int debug = -1;
  if (!lua_isnoneornil(L, 1)) {
    if (lua_type(L, 1) != LUA_TTABLE)
      lm_argerror(L, 1, "init", "options table expected ({timeout =, debug =}), got %s",
                  lm_typename(L, 1));
    lm_checkkeys(L, 1, "init", known);
    if (lua_getfield(L, 1, "timeout") != LUA_TNIL) {
      if (lua_type(L, -1) != LUA_TNUMBER || !(lua_tonumber(L, -1) > 0))
        lm_argerror(L, 1, "init", "timeout must be a positive number of seconds, got %s",
                    lm_describe(L, -1));
      timeout = (double)lua_tonumber(L, -1);
    }
    lua_pop(L, 1);
    if (lua_getfield(L, 1, "debug") != LUA_TNIL) debug = lm_field_bool(L, 1, "init", "debug", false);
    lua_pop(L, 1);
  }
  lm_checkend(L, 1, "init");
  moe_comm *w = lm_world(L, S, "init");
  if (timeout > 0 && moe_comm_set_timeout(S->ctx, w, timeout) != MOE_OK)
    return lm_corefail(L, S, "init", 1);
  if (debug >= 0) moe_comm_set_debug(w, debug != 0);
  lm_push_world(L, S, "init");
  return 1;
}

static int lm_dist_world(lua_State *L) {
  lm_push_world(L, lm_S(L), "world");
  return 1;
}

static int lm_dist_initialized(lua_State *L) {
  lua_pushboolean(L, moe_dist_initialized());
  return 1;
}

static int lm_dist_rank(lua_State *L) {
  lua_pushinteger(L, moe_comm_rank(lm_world(L, lm_S(L), "rank")));
  return 1;
}

static int lm_dist_world_size(lua_State *L) {
  lua_pushinteger(L, moe_comm_size(lm_world(L, lm_S(L), "world_size")));
  return 1;
}

/* The environment's view (moe_dist_env_read); needs no started world. */
static moe_dist_env lm_env(lua_State *L, lm_state *S, const char *fname) {
  moe_dist_env e;
  if (moe_dist_env_read(S->ctx, &e) != MOE_OK) lm_corefail(L, S, fname, 0);
  return e;
}

static int lm_dist_local_rank(lua_State *L) {
  lua_pushinteger(L, lm_env(L, lm_S(L), "local_rank").local_rank);
  return 1;
}

static int lm_dist_local_world_size(lua_State *L) {
  lua_pushinteger(L, lm_env(L, lm_S(L), "local_world_size").local_world_size);
  return 1;
}

static int lm_dist_launcher(lua_State *L) {
  lua_pushstring(L, lm_env(L, lm_S(L), "launcher").launcher);
  return 1;
}

static int lm_dist_barrier(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_comm *c = lm_optgroup(L, S, 1, "barrier");
  lm_checkend(L, 1, "barrier");
  if (moe_comm_barrier(S->ctx, c) != MOE_OK) return lm_corefail(L, S, "barrier", 0);
  return 0;
}

/* dist.finalize(): frees every work (waiting for it) and disowns every
 * group, then moe_dist_finalize. Later dist calls fail (MPI cannot start
 * twice in a process). */
static int lm_dist_finalize(lua_State *L) {
  lm_checkend(L, 0, "finalize");
  if (lua_getfield(L, LUA_REGISTRYINDEX, LM_WORKS_KEY) == LUA_TTABLE) {
    lua_pushnil(L);
    while (lua_next(L, -2)) {
      lm_work *u = (lm_work *)luaL_testudata(L, -2, LM_WORK);
      if (u) lm_work_release(u);
      lua_pop(L, 1);
    }
  }
  lua_pop(L, 1);
  if (lua_getfield(L, LUA_REGISTRYINDEX, LM_GROUPS_KEY) == LUA_TTABLE) {
    lua_pushnil(L);
    while (lua_next(L, -2)) {
      lm_group *g = (lm_group *)luaL_testudata(L, -2, LM_GROUP);
      if (g) lm_group_release(g);
      lua_pop(L, 1);
    }
  }
  lua_pop(L, 1);
  moe_dist_finalize();
  return 0;
}

/* dist.abort([code]): ends every rank of the job at once (MPI_Abort);
 * returns only in a world of one rank without MPI. */
static int lm_dist_abort(lua_State *L) {
  int64_t code = lm_optint(L, 1, "abort", "code", 1);
  lm_checkend(L, 1, "abort");
  moe_dist_abort((int)code);
  return 0;
}

/* ----------------------------------------------------------- collectives */

/* After the arguments are checked: the work userdata an async call hands
 * back, made before the core is called (so its __gc owns the work even if
 * a later step raises); its stack index, or 0 for a synchronous call. */
static int lm_coll_begin(lua_State *L, bool async) {
  if (!async) return 0;
  lm_push_work(L);
  return lua_gettop(L);
}

/* dist.all_reduce(t, op, opts) */
static int lm_all_reduce(lua_State *L) {
  const char *fn = "all_reduce";
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, fn);
  moe_reduce_op op = lm_checkreduce(L, 2, fn);
  bool async;
  moe_comm *c = lm_collopts(L, S, 3, fn, &async);
  lm_checkend(L, 3, fn);
  int wi = lm_coll_begin(L, async);
  moe_work *w = NULL;
  moe_status st = moe_all_reduce(S->ctx, c, t, op, async ? &w : NULL);
  return lm_coll_end(L, S, st, async, wi, w, fn);
}

/* dist.reduce_scatter(out, input, op, opts) */
static int lm_reduce_scatter(lua_State *L) {
  const char *fn = "reduce_scatter";
  lm_state *S = lm_S(L);
  moe_tensor *out = lm_checktensor(L, 1, fn);
  moe_tensor *in = lm_checktensor(L, 2, fn);
  moe_reduce_op op = lm_checkreduce(L, 3, fn);
  bool async;
  moe_comm *c = lm_collopts(L, S, 4, fn, &async);
  lm_checkend(L, 4, fn);
  int wi = lm_coll_begin(L, async);
  moe_work *w = NULL;
  moe_status st = moe_reduce_scatter(S->ctx, c, out, in, op, async ? &w : NULL);
  return lm_coll_end(L, S, st, async, wi, w, fn);
}

/* dist.all_gather(out, input, opts) */
static int lm_all_gather(lua_State *L) {
  const char *fn = "all_gather";
  lm_state *S = lm_S(L);
  moe_tensor *out = lm_checktensor(L, 1, fn);
  moe_tensor *in = lm_checktensor(L, 2, fn);
  bool async;
  moe_comm *c = lm_collopts(L, S, 3, fn, &async);
  lm_checkend(L, 3, fn);
  int wi = lm_coll_begin(L, async);
  moe_work *w = NULL;
  moe_status st = moe_all_gather(S->ctx, c, out, in, async ? &w : NULL);
  return lm_coll_end(L, S, st, async, wi, w, fn);
}

/* dist.broadcast(t, root, opts) */
static int lm_broadcast(lua_State *L) {
  const char *fn = "broadcast";
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, fn);
  int64_t root = lm_checkint(L, 2, fn, "root");
  bool async;
  moe_comm *c = lm_collopts(L, S, 3, fn, &async);
  lm_checkend(L, 3, fn);
  if (root < 0 || root >= moe_comm_size(c))
    lm_argerror(L, 2, fn, "root %d is not a rank of group '%s' (0..%d)", (int)root,
                moe_comm_name(c), moe_comm_size(c) - 1);
  int wi = lm_coll_begin(L, async);
  moe_work *w = NULL;
  moe_status st = moe_broadcast(S->ctx, c, t, (int)root, async ? &w : NULL);
  return lm_coll_end(L, S, st, async, wi, w, fn);
}

/* dist.all_to_all(out, input, send_splits, recv_splits, opts) */
static int lm_all_to_all(lua_State *L) {
  const char *fn = "all_to_all";
  lm_state *S = lm_S(L);
  moe_tensor *out = lm_checktensor(L, 1, fn);
  moe_tensor *in = lm_checktensor(L, 2, fn);
  bool async;
  moe_comm *c = lm_collopts(L, S, 5, fn, &async);
  lm_checkend(L, 5, fn);
  int n = moe_comm_size(c);
  int64_t *send = lm_checksplits(L, S, 3, fn, "send", n);
  int64_t *recv = lm_checksplits(L, S, 4, fn, "recv", n);
  int wi = lm_coll_begin(L, async);
  moe_work *w = NULL;
  moe_status st = moe_all_to_all(S->ctx, c, out, in, send, recv, async ? &w : NULL);
  return lm_coll_end(L, S, st, async, wi, w, fn);
}

static int lm_p2p(lua_State *L, bool is_send) {
  const char *fn = is_send ? "send" : "recv";
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, fn);
  int64_t peer = lm_checkint(L, 2, fn, "peer");
  bool async;
  moe_comm *c = lm_collopts(L, S, 3, fn, &async);
  lm_checkend(L, 3, fn);
  if (peer < 0 || peer >= moe_comm_size(c) || peer == moe_comm_rank(c))
    lm_argerror(L, 2, fn, "peer %d is not another rank of group '%s' (0..%d, this rank is %d)",
                (int)peer, moe_comm_name(c), moe_comm_size(c) - 1, moe_comm_rank(c));
  int wi = lm_coll_begin(L, async);
  moe_work *w = NULL;
  moe_status st = is_send ? moe_send(S->ctx, c, t, (int)peer, async ? &w : NULL)
                          : moe_recv(S->ctx, c, t, (int)peer, async ? &w : NULL);
  return lm_coll_end(L, S, st, async, wi, w, fn);
}

static int lm_send(lua_State *L) { return lm_p2p(L, true); }
static int lm_recv(lua_State *L) { return lm_p2p(L, false); }

/* ---------------------------------------------------------------- timing */

/* dist.comm_timing([on]) -> whether timing was on. on true starts it from
 * zero (when it was off), false stops it and drops the totals. */
static int lm_comm_timing(lua_State *L) {
  bool was = moe_comm_timing_enabled();
  if (!lua_isnoneornil(L, 1)) {
    if (lua_type(L, 1) != LUA_TBOOLEAN)
      lm_argerror(L, 1, "comm_timing", "boolean expected (true: on, false: off), got %s",
                  lm_typename(L, 1));
    lm_checkend(L, 1, "comm_timing");
    moe_comm_timing_set(lua_toboolean(L, 1) != 0);
  }
  lua_pushboolean(L, was);
  return 1;
}

static void lm_push_comm_time(lua_State *L, const moe_comm_time *t) {
  lua_createtable(L, 0, 3);
  lua_pushnumber(L, (lua_Number)t->ms);
  lua_setfield(L, -2, "ms");
  lua_pushinteger(L, (lua_Integer)t->calls);
  lua_setfield(L, -2, "calls");
  lua_pushinteger(L, (lua_Integer)t->bytes);
  lua_setfield(L, -2, "bytes");
}

/* Raises unless timing is on (fname: the Lua name). */
static void lm_timing_on(lua_State *L, const char *fname) {
  if (!moe_comm_timing_enabled())
    luaL_error(L, "%s: collective timing is off (turn it on with dist.comm_timing(true))", fname);
}

/* dist.comm_times([op]) -> {all_reduce = {ms =, calls =, bytes =}, ...},
 * or op's record alone. Waits for the GPU timing events still pending. */
static int lm_comm_times(lua_State *L) {
  const char *fn = "comm_times";
  lm_state *S = lm_S(L);
  int one = -1;
  if (!lua_isnoneornil(L, 1)) {
    if (lua_type(L, 1) != LUA_TSTRING)
      lm_argerror(L, 1, fn, "collective name expected, got %s", lm_typename(L, 1));
    moe_comm_op op;
    if (!moe_comm_op_parse(lua_tostring(L, 1), &op)) {
      char known[160] = "";
      for (int i = 0; i < MOE_COMM_OP_COUNT; i++) {
        strncat(known, i ? ", " : "", sizeof known - strlen(known) - 1);
        strncat(known, moe_comm_op_name((moe_comm_op)i), sizeof known - strlen(known) - 1);
      }
      lm_argerror(L, 1, fn, "unknown collective '%s' (known: %s)", lua_tostring(L, 1), known);
    }
    one = (int)op;
  }
  lm_checkend(L, 1, fn);
  lm_timing_on(L, "dist.comm_times");
  moe_comm_time t[MOE_COMM_OP_COUNT];
  if (moe_comm_timing_read(S->ctx, t, false) != MOE_OK) return lm_corefail(L, S, fn, 0);
  if (one >= 0) {
    lm_push_comm_time(L, &t[one]);
    return 1;
  }
  lua_createtable(L, 0, MOE_COMM_OP_COUNT);
  for (int i = 0; i < MOE_COMM_OP_COUNT; i++) {
    lm_push_comm_time(L, &t[i]);
    lua_setfield(L, -2, moe_comm_op_name((moe_comm_op)i));
  }
  return 1;
}

/* dist.comm_times_reset(): the totals back to zero (timing stays on). */
static int lm_comm_times_reset(lua_State *L) {
  lm_state *S = lm_S(L);
  lm_checkend(L, 0, "comm_times_reset");
  lm_timing_on(L, "dist.comm_times_reset");
  moe_comm_time t[MOE_COMM_OP_COUNT];
  if (moe_comm_timing_read(S->ctx, t, true) != MOE_OK) return lm_corefail(L, S, "comm_times_reset", 0);
  return 0;
}

/* ----------------------------------------------------------------- open */

static const luaL_Reg lm_group_methods[] = {
    {"rank", lm_group_rank},
    {"size", lm_group_size},
    {"name", lm_group_name},
    {"world_rank", lm_group_world_rank},
    {"ranks", lm_group_ranks},
    {"split", lm_group_split},
    {"set_timeout", lm_group_set_timeout},
    {"timeout", lm_group_timeout},
    {"set_debug", lm_group_set_debug},
    {"free", lm_group_gc},
    {NULL, NULL}};

static const luaL_Reg lm_work_methods[] = {
    {"wait", lm_work_wait}, {"done", lm_work_done}, {"free", lm_work_gc}, {NULL, NULL}};

static const luaL_Reg lm_dist_functions[] = {
    {"init", lm_dist_init},
    {"initialized", lm_dist_initialized},
    {"_world", lm_dist_world},
    {"rank", lm_dist_rank},
    {"world_size", lm_dist_world_size},
    {"local_rank", lm_dist_local_rank},
    {"local_world_size", lm_dist_local_world_size},
    {"launcher", lm_dist_launcher},
    {"barrier", lm_dist_barrier},
    {"finalize", lm_dist_finalize},
    {"abort", lm_dist_abort},
    {"all_reduce", lm_all_reduce},
    {"reduce_scatter", lm_reduce_scatter},
    {"all_gather", lm_all_gather},
    {"broadcast", lm_broadcast},
    {"all_to_all", lm_all_to_all},
    {"send", lm_send},
    {"recv", lm_recv},
    {"comm_timing", lm_comm_timing},
    {"comm_times", lm_comm_times},
    {"comm_times_reset", lm_comm_times_reset},
    {NULL, NULL}};

/* A metatable with __gc, __close, __tostring and an __index of methods,
 * each with the sentinel as upvalue 1. */
static void lm_dist_metatable(lua_State *L, const char *name, lua_CFunction gc,
                              lua_CFunction tostring, const luaL_Reg *methods, int sentinel) {
  if (luaL_newmetatable(L, name)) {
    lua_pushcfunction(L, gc);
    lua_setfield(L, -2, "__gc");
    lua_pushcfunction(L, gc);
    lua_setfield(L, -2, "__close");
    lua_pushcfunction(L, tostring);
    lua_setfield(L, -2, "__tostring");
    luaL_newlibtable(L, lm_group_methods);
    lua_pushvalue(L, sentinel);
    luaL_setfuncs(L, methods, 1);
    lua_setfield(L, -2, "__index");
  }
  lua_pop(L, 1);
}

void lm_open_dist(lua_State *L, int mod, int methods, int sentinel) {
  mod = lua_absindex(L, mod);
  sentinel = lua_absindex(L, sentinel);
  lm_dist_metatable(L, LM_GROUP, lm_group_gc, lm_group_tostring, lm_group_methods, sentinel);
  lm_dist_metatable(L, LM_WORK, lm_work_gc, lm_work_tostring, lm_work_methods, sentinel);
  lua_newtable(L);
  lm_register(L, -1, methods, sentinel, lm_dist_functions, NULL);
  lua_setfield(L, mod, "dist");
}
