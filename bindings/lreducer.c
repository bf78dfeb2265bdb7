/*
 * lreducer.c - moe.dist.reducer: the gradient reducer of data parallelism
 * (moe_dist.h "gradient bucketing", core/dist_reducer.c) as a Lua object.
 *
 *   local r = moe.dist.reducer(params, {bucket_mb = 25, group = moe.dist.world})
 *   r:arm()            -- the next backward all-reduces (avg) bucket by bucket
 *   loss:backward()
 *   r:finish()         -- the rest launched, all waited for: .grad is the average
 *   r:buckets()        -- how many buckets
 *   r:free()           -- also by <close> and __gc
 *
 * Sharded (ZeRO-2; moe_dist.h, MOE_REDUCER_REDUCE_SCATTER):
 *
 *   local r = moe.dist.reducer(params, {mode = "reduce_scatter", group = shard_group,
 *                                       replicate_group = nil})
 *   r:arm(); loss:backward(); r:finish()   -- .grad released; the shards hold the average
 *   r:mode()           -- "all_reduce" or "reduce_scatter"
 *   r:layout()         -- {rank =, size =, buckets = {{dtype =, device =, numel =, padded =,
 *                      --   shard_numel =, shard_offset =, segments = {{param =, param_offset =,
 *                      --   shard_offset =, numel =}, ...}}, ...},
 *                      --   params = {{bucket =, offset =}, ...}}  (param, bucket: 1-based;
 *                      --   offsets: 0-based elements)
 *   r:shard(k)         -- bucket k's (1-based) averaged gradient shard of this round, or nil
 *   r:had_grad(i)      -- parameter i (1-based) had a gradient on some rank last round
 *   r:clear()          -- drops the shards (zero_grad)
 *
 * Explicit buckets (parameter sharding): groups = {g1, ..., gn} puts
 * parameter i in bucket group gi (integers >= 1; one dtype and device per
 * group) instead of bucket_mb; units = {u1, ...} (moe.dist.fsdp_unit, one
 * per group number) releases unit g's gathered parameters as soon as its
 * bucket's collective is launched in backward.
 *
 * Parameter sharding units (moe_dist.h "parameter sharding"):
 *
 *   local u = moe.dist.fsdp_unit(flat, shard, {group = shard_group})
 *   u:gather()  u:gather{async = true}  u:wait()  u:release()
 *   u:set_prefetch(u2 or nil)   u:ready()   u:gathers()   u:free()
 *
 * params is a list of tensors (leaves that require grad) or of {name, tensor}
 * pairs (model:named_parameters()). bucket_mb may be fractional; 0 puts each
 * parameter in a bucket of its own. The reducer holds one reference to the
 * state, like a tensor, and its parameters through the core; r:free(),
 * __close and __gc share one idempotent function (which also disarms it and
 * waits for what is in flight), and a freed reducer raises "attempt to use a
 * freed reducer". The reducer keeps its group's handle alive (a group freed
 * explicitly with g:free() while a reducer uses it is the caller's error), and
 * its replicate group's.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lmoe_internal.h"

#define LM_REDUCER "moe.Reducer"

typedef struct lm_reducer {
  moe_reducer *r; /* NULL before creation and after free */
  lm_state *S;    /* one reference while r is not NULL */
  moe_fsdp_unit **bucket_unit; /* (nb) the unit released after bucket k's launch, or NULL */
  int nb;
} lm_reducer;

#define LM_FSDP_UNIT "moe.FSDPUnit"

typedef struct lm_fsdp_unit {
  moe_fsdp_unit *u; /* NULL after free */
  lm_state *S;
} lm_fsdp_unit;

static lm_fsdp_unit *lm_checkunit(lua_State *L, int arg, const char *fname) {
  lm_fsdp_unit *u = (lm_fsdp_unit *)luaL_testudata(L, arg, LM_FSDP_UNIT);
  if (u == NULL) lm_argerror(L, arg, fname, "fsdp unit expected, got %s", lm_typename(L, arg));
  if (u->u == NULL) lm_argerror(L, arg, fname, "attempt to use a freed fsdp unit");
  return u;
}

static moe_status lm_reducer_launched(moe_ctx *ctx, int k, void *ud) {
  lm_reducer *u = (lm_reducer *)ud;
  if (k < 0 || k >= u->nb || !u->bucket_unit[k]) return MOE_OK;
  return moe_fsdp_unit_release(ctx, u->bucket_unit[k]);
}

static lm_reducer *lm_checkreducer(lua_State *L, int arg, const char *fname) {
  lm_reducer *u = (lm_reducer *)luaL_testudata(L, arg, LM_REDUCER);
  if (u == NULL) lm_argerror(L, arg, fname, "reducer expected, got %s", lm_typename(L, arg));
  if (u->r == NULL) lm_argerror(L, arg, fname, "attempt to use a freed reducer");
  return u;
}

static int lm_reducer_release(lua_State *L) {
  lm_reducer *u = (lm_reducer *)luaL_checkudata(L, 1, LM_REDUCER);
  if (u->r) {
    moe_reducer_free(u->S->ctx, u->r);
    u->r = NULL;
    lm_state_unref(u->S);
    u->S = NULL;
  }
  free(u->bucket_unit);
  u->bucket_unit = NULL;
  u->nb = 0;
  return 0;
}

/* The communicator of the group option at table index opts (the group value
 * is left on the stack), or the world (nil left). */
static moe_comm *lm_reducer_group(lua_State *L, lm_state *S, int opts) {
  moe_comm *c = NULL;
  if (opts > 0 && lua_getfield(L, opts, "group") != LUA_TNIL)
    return lm_checkgroup_at(L, lua_gettop(L), opts, "reducer");
  if (opts == 0) lua_pushnil(L);
  if (moe_dist_init(S->ctx, &c) != MOE_OK) lm_corefail(L, S, "reducer", 0);
  return c;
}

static const char *const lm_reducer_modes[] = {"all_reduce", "reduce_scatter", NULL};

/* moe.dist.reducer(params [, {bucket_mb = 25, group = world, mode = "all_reduce",
 * replicate_group = nil}]) -> reducer */
static int lm_reducer_new(lua_State *L) {
  static const char *const known[] = {"bucket_mb", "group", "mode", "replicate_group", "groups", "units",
                                      NULL};
  const char *fn = "reducer";
  lm_state *S = lm_S(L);
  if (lua_type(L, 1) != LUA_TTABLE)
    lm_argerror(L, 1, fn, "a list of parameters expected, got %s", lm_typename(L, 1));
  int opts = 0;
  double mb = 25.0;
  moe_reducer_mode mode = MOE_REDUCER_ALL_REDUCE;
  if (!lua_isnoneornil(L, 2)) {
    if (lua_type(L, 2) != LUA_TTABLE)
      lm_argerror(L, 2, fn, "options table expected, got %s", lm_typename(L, 2));
    lm_checkkeys(L, 2, fn, known);
    opts = 2;
    if (lua_getfield(L, 2, "bucket_mb") != LUA_TNIL) {
      int isnum = 0;
      mb = (double)lua_tonumberx(L, -1, &isnum);
      if (!isnum || !(mb >= 0) || mb > 1e6)
        lm_argerror(L, 2, fn, "bucket_mb must be a number in [0, 1e6], got %s", lm_describe(L, -1));
    }
    lua_pop(L, 1);
    if (lua_getfield(L, 2, "mode") != LUA_TNIL) {
      const char *m = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
      int found = -1;
      for (int i = 0; m && lm_reducer_modes[i]; i++)
        if (strcmp(m, lm_reducer_modes[i]) == 0) found = i;
      if (found < 0)
        lm_argerror(L, 2, fn, "mode must be 'all_reduce' or 'reduce_scatter', got %s",
                    lm_describe(L, -1));
      mode = (moe_reducer_mode)found;
    }
    lua_pop(L, 1);
  }
  lm_checkend(L, 2, fn);
  lua_Unsigned len = lua_rawlen(L, 1);
  if (len > 10000000) lm_argerror(L, 1, fn, "%I parameters is too many", (LUAI_UACINT)len);
  moe_tensor **params = NULL;
  void **box = lm_push_scratch(L);
  if (len > 0) {
    params = (moe_tensor **)calloc((size_t)len, sizeof(*params));
    if (!params) return luaL_error(L, "reducer: not enough memory");
    *box = params;
  }
  for (lua_Unsigned i = 0; i < len; i++) {
    lua_rawgeti(L, 1, (lua_Integer)i + 1);
    if (lua_type(L, -1) == LUA_TTABLE) { /* {name, tensor} */
      lua_rawgeti(L, -1, 2);
      lua_remove(L, -2);
    }
    lm_tensor *t = lm_testtensor(L, -1);
    if (t == NULL || t->t == NULL)
      lm_argerror(L, 1, fn, "parameter %I must be a tensor or {name, tensor}, got %s",
                  (LUAI_UACINT)(i + 1), t ? "freed tensor" : lm_typename(L, -1));
    params[i] = t->t; /* the list keeps it alive until the core retains it */
    lua_pop(L, 1);
  }
  /* explicit buckets: groups (one integer >= 1 per parameter), units (per group) */
  int *groups = NULL;
  int ngroups = 0;
  void **gbox = lm_push_scratch(L);
  if (opts > 0) lua_getfield(L, opts, "groups");
  else lua_pushnil(L);
  if (!lua_isnil(L, -1)) {
    if (lua_type(L, -1) != LUA_TTABLE || lua_rawlen(L, -1) != len)
      lm_argerror(L, opts, fn, "groups must be a list of %I group numbers (one per parameter), got %s",
                  (LUAI_UACINT)len, lm_describe(L, -1));
    groups = (int *)calloc((size_t)(len > 0 ? len : 1), sizeof(*groups));
    if (!groups) return luaL_error(L, "reducer: not enough memory");
    *gbox = groups;
    for (lua_Unsigned i = 0; i < len; i++) {
      lua_rawgeti(L, -1, (lua_Integer)i + 1);
      int isint = 0;
      lua_Integer g = lua_tointegerx(L, -1, &isint);
      if (!isint || g < 1 || g > INT32_MAX)
        lm_argerror(L, opts, fn, "groups[%I] must be an integer >= 1, got %s", (LUAI_UACINT)(i + 1),
                    lm_describe(L, -1));
      groups[i] = (int)g - 1;
      if ((int)g > ngroups) ngroups = (int)g;
      lua_pop(L, 1);
    }
  }
  lua_pop(L, 1);
  int units = 0;
  if (opts > 0) lua_getfield(L, opts, "units");
  else lua_pushnil(L);
  if (!lua_isnil(L, -1)) {
    if (!groups) lm_argerror(L, opts, fn, "units needs groups (the bucket of each parameter)");
    if (lua_type(L, -1) != LUA_TTABLE)
      lm_argerror(L, opts, fn, "units must be a list of fsdp units (one per group), got %s",
                  lm_describe(L, -1));
    for (int g = 1; g <= ngroups; g++) {
      lua_rawgeti(L, -1, g);
      if (!lua_isnil(L, -1)) {
        lm_fsdp_unit *fu = (lm_fsdp_unit *)luaL_testudata(L, -1, LM_FSDP_UNIT);
        if (!fu || !fu->u)
          lm_argerror(L, opts, fn, "units[%d] must be an fsdp unit, got %s", g, lm_describe(L, -1));
      }
      lua_pop(L, 1);
    }
  }
  units = lua_gettop(L); /* nil or the units table */
  moe_comm *c = lm_reducer_group(L, S, opts);
  int group = lua_gettop(L);
  moe_comm *rc = NULL;
  if (opts > 0 && lua_getfield(L, opts, "replicate_group") != LUA_TNIL) {
    rc = lm_checkgroup_at(L, lua_gettop(L), opts, fn);
    if (mode != MOE_REDUCER_REDUCE_SCATTER)
      lm_argerror(L, opts, fn, "replicate_group needs mode = 'reduce_scatter'");
  }
  int rgroup = lua_gettop(L); /* nil or the replicate group */
  lm_reducer *u = (lm_reducer *)lua_newuserdatauv(L, sizeof *u, 3);
  u->r = NULL;
  u->S = NULL;
  u->bucket_unit = NULL;
  u->nb = 0;
  luaL_setmetatable(L, LM_REDUCER);
  lua_pushvalue(L, group); /* the groups' handles live as long as the reducer */
  lua_setiuservalue(L, -2, 1);
  lua_pushvalue(L, rgroup);
  lua_setiuservalue(L, -2, 2);
  lua_pushvalue(L, units); /* the units live as long as the reducer */
  lua_setiuservalue(L, -2, 3);
  moe_reducer *r = NULL;
  moe_reducer_opts ro = {.bucket_bytes = (size_t)(mb * 1024.0 * 1024.0), .mode = mode, .replicate = rc,
                         .group = groups};
  if (!lua_isnil(L, units)) {
    ro.launched = lm_reducer_launched;
    ro.launched_ud = u;
  }
  if (moe_reducer_new_opts(S->ctx, c, (int)len, params, &ro, &r) != MOE_OK)
    return lm_corefail(L, S, fn, 1); /* params, groups: freed by the boxes' __gc */
  if (!lua_isnil(L, units)) {
    int nb = moe_reducer_buckets(r);
    u->bucket_unit = (moe_fsdp_unit **)calloc((size_t)(nb > 0 ? nb : 1), sizeof(*u->bucket_unit));
    if (!u->bucket_unit) {
      moe_reducer_free(S->ctx, r);
      return luaL_error(L, "reducer: not enough memory");
    }
    u->nb = nb;
    for (lua_Unsigned i = 0; i < len; i++) {
      int b = 0;
      moe_reducer_param_offset(r, (int)i, &b, NULL);
      lua_rawgeti(L, units, groups[i] + 1);
      lm_fsdp_unit *fu = (lm_fsdp_unit *)luaL_testudata(L, -1, LM_FSDP_UNIT);
      if (fu) u->bucket_unit[b] = fu->u;
      lua_pop(L, 1);
    }
  }
  free(params);
  *box = NULL;
  free(groups);
  *gbox = NULL;
  u->r = r;
  u->S = S;
  S->refs++;
  return 1;
}

static int lm_reducer_arm(lua_State *L) {
  lm_reducer *u = lm_checkreducer(L, 1, "arm");
  lm_checkend(L, 1, "arm");
  if (moe_reducer_arm(u->S->ctx, u->r) != MOE_OK) return lm_corefail(L, u->S, "arm", 0);
  return 0;
}

static int lm_reducer_finish(lua_State *L) {
  lm_reducer *u = lm_checkreducer(L, 1, "finish");
  lm_checkend(L, 1, "finish");
  moe_status st;
  LM_CALL(L, st, moe_reducer_finish(u->S->ctx, u->r));
  if (st != MOE_OK) return lm_corefail(L, u->S, "finish", 0);
  return 0;
}

static int lm_reducer_buckets(lua_State *L) {
  lm_reducer *u = lm_checkreducer(L, 1, "buckets");
  lm_checkend(L, 1, "buckets");
  lua_pushinteger(L, moe_reducer_buckets(u->r));
  return 1;
}

static int lm_reducer_mode(lua_State *L) {
  lm_reducer *u = lm_checkreducer(L, 1, "mode");
  lm_checkend(L, 1, "mode");
  lua_pushstring(L, lm_reducer_modes[moe_reducer_get_mode(u->r)]);
  return 1;
}

static void lm_setint(lua_State *L, const char *key, int64_t v) {
  lua_pushinteger(L, (lua_Integer)v);
  lua_setfield(L, -2, key);
}

/* r:layout() -> {rank =, size =, buckets = {...}} (see the header comment) */
static int lm_reducer_layout(lua_State *L) {
  lm_reducer *u = lm_checkreducer(L, 1, "layout");
  lm_checkend(L, 1, "layout");
  moe_reducer *r = u->r;
  int nb = moe_reducer_buckets(r);
  lua_createtable(L, 0, 3);
  lua_createtable(L, nb, 0);
  int64_t P = 1, rank = 0;
  for (int k = 0; k < nb; k++) {
    moe_reducer_bucket bi;
    if (moe_reducer_bucket_info(u->S->ctx, r, k, &bi) != MOE_OK) return lm_corefail(L, u->S, "layout", 0);
    P = bi.padded / (bi.shard_numel > 0 ? bi.shard_numel : 1);
    rank = bi.shard_numel > 0 ? bi.shard_offset / bi.shard_numel : 0;
    lua_createtable(L, 0, 8);
    lua_pushstring(L, moe_dtype_name(bi.dtype));
    lua_setfield(L, -2, "dtype");
    lm_push_device(L, bi.device);
    lua_setfield(L, -2, "device");
    lm_setint(L, "numel", bi.numel);
    lm_setint(L, "padded", bi.padded);
    lm_setint(L, "shard_numel", bi.shard_numel);
    lm_setint(L, "shard_offset", bi.shard_offset);
    int ns = moe_reducer_segments(r, k, NULL, 0);
    moe_reducer_segment *seg = (moe_reducer_segment *)lua_newuserdatauv(
        L, sizeof(*seg) * (size_t)(ns > 0 ? ns : 1), 0);
    moe_reducer_segments(r, k, seg, ns);
    lua_createtable(L, ns, 0);
    for (int j = 0; j < ns; j++) {
      lua_createtable(L, 0, 4);
      lm_setint(L, "param", seg[j].param + 1);
      lm_setint(L, "param_offset", seg[j].param_offset);
      lm_setint(L, "shard_offset", seg[j].shard_offset);
      lm_setint(L, "numel", seg[j].numel);
      lua_rawseti(L, -2, j + 1);
    }
    lua_setfield(L, -3, "segments");
    lua_pop(L, 1); /* the segments' scratch */
    lua_rawseti(L, -2, k + 1);
  }
  lua_setfield(L, -2, "buckets");
  int n = 0;
  while (moe_reducer_param_offset(r, n, NULL, NULL)) n++;
  lua_createtable(L, n, 0);
  for (int i = 0; i < n; i++) {
    int b = 0;
    int64_t off = 0;
    moe_reducer_param_offset(r, i, &b, &off);
    lua_createtable(L, 0, 2);
    lm_setint(L, "bucket", b + 1);
    lm_setint(L, "offset", off);
    lua_rawseti(L, -2, i + 1);
  }
  lua_setfield(L, -2, "params");
  if (moe_reducer_get_mode(r) == MOE_REDUCER_ALL_REDUCE) P = 1, rank = 0;
  lm_setint(L, "size", P);
  lm_setint(L, "rank", rank);
  return 1;
}

/* r:shard(k) -> bucket k's gradient shard of the last round, or nil */
static int lm_reducer_shard(lua_State *L) {
  lm_reducer *u = lm_checkreducer(L, 1, "shard");
  lua_Integer k = luaL_checkinteger(L, 2);
  lm_checkend(L, 2, "shard");
  int nb = moe_reducer_buckets(u->r);
  if (k < 1 || k > nb) lm_argerror(L, 2, "shard", "bucket %I out of range [1, %d]", (LUAI_UACINT)k, nb);
  moe_tensor *t = moe_reducer_shard(u->r, (int)k - 1);
  if (!t) {
    lua_pushnil(L);
    return 1;
  }
  lm_tensor *h = lm_push_empty(L);
  moe_tensor_retain(t);
  lm_adopt(h, u->S, t);
  return 1;
}

/* r:had_grad(i) -> boolean */
static int lm_reducer_had_grad(lua_State *L) {
  lm_reducer *u = lm_checkreducer(L, 1, "had_grad");
  lua_Integer i = luaL_checkinteger(L, 2);
  lm_checkend(L, 2, "had_grad");
  lua_pushboolean(L, i >= 1 && i <= INT32_MAX && moe_reducer_had_grad(u->r, (int)i - 1));
  return 1;
}

static int lm_reducer_clear(lua_State *L) {
  lm_reducer *u = lm_checkreducer(L, 1, "clear");
  lm_checkend(L, 1, "clear");
  moe_reducer_clear(u->r);
  return 0;
}

static int lm_reducer_tostring(lua_State *L) {
  lm_reducer *u = (lm_reducer *)luaL_checkudata(L, 1, LM_REDUCER);
  if (u->r)
    lua_pushfstring(L, "moe.Reducer (%d buckets)", moe_reducer_buckets(u->r));
  else
    lua_pushliteral(L, "moe.Reducer (freed)");
  return 1;
}

static const luaL_Reg lm_reducer_methods[] = {{"arm", lm_reducer_arm},
                                              {"finish", lm_reducer_finish},
                                              {"buckets", lm_reducer_buckets},
                                              {"mode", lm_reducer_mode},
                                              {"layout", lm_reducer_layout},
                                              {"shard", lm_reducer_shard},
                                              {"had_grad", lm_reducer_had_grad},
                                              {"clear", lm_reducer_clear},
                                              {"free", lm_reducer_release},
                                              {NULL, NULL}};

/* ------------------------------------------------------------ fsdp units */

static int lm_unit_release_handle(lua_State *L) {
  lm_fsdp_unit *u = (lm_fsdp_unit *)luaL_checkudata(L, 1, LM_FSDP_UNIT);
  if (u->u) {
    moe_fsdp_unit_free(u->S->ctx, u->u);
    u->u = NULL;
    lm_state_unref(u->S);
    u->S = NULL;
  }
  return 0;
}

/* moe.dist.fsdp_unit(flat, shard [, {group = world}]) -> unit */
static int lm_unit_new(lua_State *L) {
  static const char *const known[] = {"group", NULL};
  const char *fn = "fsdp_unit";
  lm_state *S = lm_S(L);
  moe_tensor *flat = lm_checktensor(L, 1, fn);
  moe_tensor *shard = lm_checktensor(L, 2, fn);
  int opts = 0;
  if (!lua_isnoneornil(L, 3)) {
    if (lua_type(L, 3) != LUA_TTABLE) lm_argerror(L, 3, fn, "options table expected, got %s", lm_typename(L, 3));
    lm_checkkeys(L, 3, fn, known);
    opts = 3;
  }
  lm_checkend(L, 3, fn);
  moe_comm *c = lm_reducer_group(L, S, opts);
  int group = lua_gettop(L);
  lm_fsdp_unit *u = (lm_fsdp_unit *)lua_newuserdatauv(L, sizeof *u, 2);
  u->u = NULL;
  u->S = NULL;
  luaL_setmetatable(L, LM_FSDP_UNIT);
  lua_pushvalue(L, group);
  lua_setiuservalue(L, -2, 1);
  if (moe_fsdp_unit_new(S->ctx, c, flat, shard, &u->u) != MOE_OK) return lm_corefail(L, S, fn, 1);
  u->S = S;
  S->refs++;
  return 1;
}

/* u:gather([{async = false}]) */
static int lm_unit_gather(lua_State *L) {
  lm_fsdp_unit *u = lm_checkunit(L, 1, "gather");
  bool async = false;
  if (!lua_isnoneornil(L, 2)) {
    static const char *const known[] = {"async", NULL};
    if (lua_type(L, 2) != LUA_TTABLE) lm_argerror(L, 2, "gather", "options table expected, got %s", lm_typename(L, 2));
    lm_checkkeys(L, 2, "gather", known);
    lua_getfield(L, 2, "async");
    async = lua_toboolean(L, -1);
    lua_pop(L, 1);
  }
  lm_checkend(L, 2, "gather");
  moe_status st;
  LM_CALL(L, st, moe_fsdp_unit_gather(u->S->ctx, u->u, async));
  if (st != MOE_OK) return lm_corefail(L, u->S, "gather", 0);
  return 0;
}

static int lm_unit_wait(lua_State *L) {
  lm_fsdp_unit *u = lm_checkunit(L, 1, "wait");
  lm_checkend(L, 1, "wait");
  moe_status st;
  LM_CALL(L, st, moe_fsdp_unit_wait(u->S->ctx, u->u));
  if (st != MOE_OK) return lm_corefail(L, u->S, "wait", 0);
  return 0;
}

static int lm_unit_release(lua_State *L) {
  lm_fsdp_unit *u = lm_checkunit(L, 1, "release");
  lm_checkend(L, 1, "release");
  moe_status st;
  LM_CALL(L, st, moe_fsdp_unit_release(u->S->ctx, u->u));
  if (st != MOE_OK) return lm_corefail(L, u->S, "release", 0);
  return 0;
}

/* u:set_prefetch(u2 or nil): u2 is gathered (async) when backward gathers u */
static int lm_unit_set_prefetch(lua_State *L) {
  lm_fsdp_unit *u = lm_checkunit(L, 1, "set_prefetch");
  moe_fsdp_unit *next = NULL;
  if (!lua_isnoneornil(L, 2)) next = lm_checkunit(L, 2, "set_prefetch")->u;
  lm_checkend(L, 2, "set_prefetch");
  lua_settop(L, 2);
  lua_setiuservalue(L, 1, 2); /* keeps the next unit alive */
  moe_fsdp_unit_set_prefetch(u->u, next);
  return 0;
}

static int lm_unit_ready(lua_State *L) {
  lm_fsdp_unit *u = lm_checkunit(L, 1, "ready");
  lm_checkend(L, 1, "ready");
  lua_pushboolean(L, moe_fsdp_unit_ready(u->u));
  return 1;
}

static int lm_unit_gathers(lua_State *L) {
  lm_fsdp_unit *u = lm_checkunit(L, 1, "gathers");
  lm_checkend(L, 1, "gathers");
  lua_pushinteger(L, (lua_Integer)moe_fsdp_unit_gathers(u->u));
  return 1;
}

static int lm_unit_tostring(lua_State *L) {
  lm_fsdp_unit *u = (lm_fsdp_unit *)luaL_checkudata(L, 1, LM_FSDP_UNIT);
  if (u->u)
    lua_pushfstring(L, "moe.FSDPUnit (%s)", moe_fsdp_unit_ready(u->u) ? "gathered" : "released");
  else
    lua_pushliteral(L, "moe.FSDPUnit (freed)");
  return 1;
}

static const luaL_Reg lm_unit_methods[] = {{"gather", lm_unit_gather},
                                           {"wait", lm_unit_wait},
                                           {"release", lm_unit_release},
                                           {"set_prefetch", lm_unit_set_prefetch},
                                           {"ready", lm_unit_ready},
                                           {"gathers", lm_unit_gathers},
                                           {"free", lm_unit_release_handle},
                                           {NULL, NULL}};

static const luaL_Reg lm_reducer_functions[] = {{"reducer", lm_reducer_new}, {"fsdp_unit", lm_unit_new},
                                                {NULL, NULL}};

/* Registers moe.dist.reducer into the module's moe.dist table (made by
 * lm_open_dist, which linit.c opens first). */
void lm_open_reducer(lua_State *L, int mod, int methods, int sentinel) {
  if (luaL_newmetatable(L, LM_REDUCER)) {
    lua_pushcfunction(L, lm_reducer_release);
    lua_setfield(L, -2, "__gc");
    lua_pushcfunction(L, lm_reducer_release);
    lua_setfield(L, -2, "__close");
    lua_pushcfunction(L, lm_reducer_tostring);
    lua_setfield(L, -2, "__tostring");
    luaL_newlibtable(L, lm_reducer_methods);
    luaL_setfuncs(L, lm_reducer_methods, 0);
    lua_setfield(L, -2, "__index");
  }
  lua_pop(L, 1);
  if (luaL_newmetatable(L, LM_FSDP_UNIT)) {
    lua_pushcfunction(L, lm_unit_release_handle);
    lua_setfield(L, -2, "__gc");
    lua_pushcfunction(L, lm_unit_release_handle);
    lua_setfield(L, -2, "__close");
    lua_pushcfunction(L, lm_unit_tostring);
    lua_setfield(L, -2, "__tostring");
    luaL_newlibtable(L, lm_unit_methods);
    luaL_setfuncs(L, lm_unit_methods, 0);
    lua_setfield(L, -2, "__index");
  }
  lua_pop(L, 1);
  if (lua_getfield(L, mod, "dist") != LUA_TTABLE)
    luaL_error(L, "moe: moe.dist must be opened before its reducer");
  lm_register(L, -1, methods, sentinel, lm_reducer_functions, NULL);
  lua_pop(L, 1);
}
