/*
 * lrouting.c - Lua bindings of the routing family (core/moe_routing.h),
 * under the `moe.ops` sub-table:
 *
 *   local plan = moe.ops.routing_plan(ids, E, {block_size =, ffn_hidden =,
 *       capacity_factor =, drop_policy = "position" | "score", scores =,
 *       experts = {e0, e1}, counts_to_host =, known_counts =})
 *   local xs = moe.ops.permute(x, plan)          -- (R, d), also plan:permute(x)
 *   local out = moe.ops.combine(y, plan, gates)  -- (T, d), also plan:combine(y, gates)
 *
 * The plan is a userdata (moe.RoutingPlan) owning one reference to the C
 * plan, which autograd nodes of permute and combine also hold: a table of
 * tensors could not be handed back to C without rebuilding the plan, and
 * the userdata keeps the host-sync counter and the host counts in one place.
 * Its fields read as Lua values: plan.counts, plan.offsets, plan.dest, ...
 * are tensors sharing the plan's storage (read them, do not write them);
 * plan.rows, plan.T, plan.k, plan.E, plan.capacity, plan.block_size,
 * plan.nnz, plan.host_syncs are integers. plan:counts_to_host() returns the
 * per-expert counts as a Lua list (the one host synchronisation, counted),
 * plan:rank_counts(n) the per-rank counts tensor. known_counts (a list of
 * E integers) are counts the caller already holds on the host: the plan
 * takes them instead of copying (core/moe_routing.h "Known counts"). plan:free(), __close and
 * __gc share one idempotent release. Registered by luaopen_moe through
 * lm_open_routing (see lmoe_internal.h).
 *
 * `permute` and `combine` are not tensor methods: t:permute is the
 * dimension permutation of the view family.
 */
#include <stdlib.h>
#include <string.h>

#include "lmoe_internal.h"
#include "moe_routing.h"

#define LM_PLAN "moe.RoutingPlan"

typedef struct lm_plan {
  moe_routing_plan *p; /* one reference; NULL before creation and after free */
  lm_state *S;         /* one reference while p is not NULL */
} lm_plan;

static lm_plan *lm_checkplan(lua_State *L, int arg, const char *fname) {
  lm_plan *u = (lm_plan *)luaL_testudata(L, arg, LM_PLAN);
  if (u == NULL) lm_argerror(L, arg, fname, "routing plan expected, got %s", lm_typename(L, arg));
  if (u->p == NULL) lm_argerror(L, arg, fname, "attempt to use a freed routing plan");
  return u;
}

moe_routing_plan *lm_toplan(lua_State *L, int arg, const char *fname) {
  lm_plan *u = (lm_plan *)luaL_testudata(L, arg, LM_PLAN);
  if (u == NULL) return NULL;
  if (u->p == NULL) lm_argerror(L, arg, fname, "attempt to use a freed routing plan");
  return u->p;
}

moe_routing_plan *lm_plan_arg(lua_State *L, int arg, const char *fname) {
  return lm_checkplan(L, arg, fname)->p;
}

static int lm_plan_release(lua_State *L) {
  lm_plan *u = (lm_plan *)luaL_checkudata(L, 1, LM_PLAN);
  if (u->p) {
    moe_routing_plan_release(u->p);
    u->p = NULL;
    lm_state_unref(u->S);
    u->S = NULL;
  }
  return 0;
}

/* ------------------------------------------------------------ options */

static int64_t lm_optfield_int(lua_State *L, int opts, const char *key, const char *fname,
                               int64_t def) {
  int64_t v = def;
  if (lua_getfield(L, opts, key) != LUA_TNIL) {
    if (!lua_isinteger(L, -1))
      lm_argerror(L, 3, fname, "option %s must be an integer, got %s", key, lm_describe(L, -1));
    v = (int64_t)lua_tointeger(L, -1);
  }
  lua_pop(L, 1);
  return v;
}

/* Reads the options table at index 3 into o; returns nothing on error (raises). */
static void lm_plan_opts(lua_State *L, const char *fname, int64_t E, moe_routing_opts *o) {
  *o = moe_routing_opts_default();
  if (lua_isnoneornil(L, 3)) return;
  if (lua_type(L, 3) != LUA_TTABLE)
    lm_argerror(L, 3, fname, "options table expected, got %s", lm_typename(L, 3));
  static const char *const known[] = {"block_size", "padded",  "ffn_hidden",     "capacity_factor",
                                      "drop_policy", "scores", "experts", "counts_to_host",
                                      "known_counts", NULL};
  lm_checkkeys(L, 3, fname, known);
  bool padded = false;
  if (lua_getfield(L, 3, "padded") != LUA_TNIL) {
    if (!lua_isboolean(L, -1)) lm_argerror(L, 3, fname, "option padded must be a boolean");
    padded = lua_toboolean(L, -1);
  }
  lua_pop(L, 1);
  o->block_size = lm_optfield_int(L, 3, "block_size", fname, padded ? 128 : 0);
  o->ffn_hidden = lm_optfield_int(L, 3, "ffn_hidden", fname, 0);
  if (lua_getfield(L, 3, "capacity_factor") != LUA_TNIL) {
    if (lua_type(L, -1) != LUA_TNUMBER)
      lm_argerror(L, 3, fname, "option capacity_factor must be a number, got %s", lm_describe(L, -1));
    o->capacity_factor = (double)lua_tonumber(L, -1);
  }
  lua_pop(L, 1);
  if (lua_getfield(L, 3, "drop_policy") != LUA_TNIL) {
    const char *s = lua_tostring(L, -1);
    if (lua_type(L, -1) != LUA_TSTRING)
      lm_argerror(L, 3, fname, "option drop_policy must be \"position\" or \"score\", got %s",
                  lm_describe(L, -1));
    if (strcmp(s, "position") != 0 && strcmp(s, "score") != 0)
      lm_argerror(L, 3, fname, "option drop_policy must be \"position\" or \"score\", got \"%s\"", s);
    o->drop_policy = strcmp(s, "score") == 0 ? MOE_ROUTING_DROP_SCORE : MOE_ROUTING_DROP_POSITION;
  }
  lua_pop(L, 1);
  if (lua_getfield(L, 3, "scores") != LUA_TNIL) {
    lm_tensor *u = lm_testtensor(L, -1);
    if (!u || !u->t) lm_argerror(L, 3, fname, "option scores must be a tensor, got %s", lm_describe(L, -1));
    o->scores = u->t; /* stays referenced by the options table during the call */
  }
  lua_pop(L, 1);
  if (lua_getfield(L, 3, "experts") != LUA_TNIL) {
    if (lua_type(L, -1) != LUA_TTABLE || lua_rawlen(L, -1) != 2)
      lm_argerror(L, 3, fname, "option experts must be {first, last + 1} (0-based), got %s",
                  lm_describe(L, -1));
    lua_rawgeti(L, -1, 1);
    lua_rawgeti(L, -2, 2);
    if (!lua_isinteger(L, -1) || !lua_isinteger(L, -2))
      lm_argerror(L, 3, fname, "option experts must hold two integers");
    o->expert_begin = (int64_t)lua_tointeger(L, -2);
    o->expert_end = (int64_t)lua_tointeger(L, -1);
    lua_pop(L, 2);
    if (o->expert_end <= 0 || o->expert_begin >= o->expert_end || o->expert_end > E)
      lm_argerror(L, 3, fname, "option experts = {%d, %d} must be a non-empty range inside [0, %d)",
                  (int)o->expert_begin, (int)o->expert_end, (int)E);
  }
  lua_pop(L, 1);
  if (lua_getfield(L, 3, "counts_to_host") != LUA_TNIL) {
    if (!lua_isboolean(L, -1)) lm_argerror(L, 3, fname, "option counts_to_host must be a boolean");
    o->counts_to_host = lua_toboolean(L, -1);
  }
  lua_pop(L, 1);
}

/* moe.ops.routing_plan(ids, E [, opts]) */
static int lm_routing_plan(lua_State *L) {
  const char *fname = "routing_plan";
  lm_state *S = lm_S(L);
  moe_tensor *ids = lm_checktensor(L, 1, fname);
  int64_t E = lm_checkint(L, 2, fname, "number of experts");
  if (E < 1) lm_argerror(L, 2, fname, "number of experts must be >= 1, got %d", (int)E);
  moe_routing_opts o;
  lm_plan_opts(L, fname, E, &o);
  lm_checkend(L, 3, fname);
  if (lua_istable(L, 3) && lua_getfield(L, 3, "known_counts") != LUA_TNIL) {
    if (lua_type(L, -1) != LUA_TTABLE || (int64_t)lua_rawlen(L, -1) != E)
      lm_argerror(L, 3, fname, "option known_counts must be a list of %d integers, got %s", (int)E,
                  lm_describe(L, -1));
    int kc = lua_gettop(L);
    void **box = lm_push_scratch(L); /* freed by the collector, errors included */
    *box = malloc(sizeof(int64_t) * (size_t)E);
    if (!*box) luaL_error(L, "%s: out of memory", fname);
    for (int64_t e = 0; e < E; e++) {
      lua_rawgeti(L, kc, (lua_Integer)(e + 1));
      if (!lua_isinteger(L, -1))
        lm_argerror(L, 3, fname, "known_counts[%d] must be an integer, got %s", (int)(e + 1),
                    lm_describe(L, -1));
      ((int64_t *)*box)[e] = (int64_t)lua_tointeger(L, -1);
      lua_pop(L, 1);
    }
    o.known_counts = (const int64_t *)*box;
  }
  lm_plan *u = (lm_plan *)lua_newuserdatauv(L, sizeof *u, 0);
  u->p = NULL;
  u->S = NULL;
  luaL_setmetatable(L, LM_PLAN);
  moe_routing_plan *p = NULL;
  moe_status st;
  LM_CALL(L, st, moe_routing_plan_new(S->ctx, ids, E, &o, &p));
  if (st != MOE_OK) return lm_corefail(L, S, fname, 0);
  u->p = p;
  u->S = S;
  S->refs++;
  return 1;
}

/* ------------------------------------------------------- permute / combine */

static int lm_permute_impl(lua_State *L, int xarg, int parg, const char *fname) {
  lm_state *S = lm_S(L);
  moe_tensor *x = lm_checktensor(L, xarg, fname);
  lm_plan *u = lm_checkplan(L, parg, fname);
  lm_checkend(L, 2, fname);
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_routing_permute(S->ctx, x, u->p, &out));
  return lm_result(L, S, r, st, out, "routing_permute", 0); /* the core's name */
}

static int lm_combine_impl(lua_State *L, int yarg, int parg, int garg, const char *fname) {
  lm_state *S = lm_S(L);
  moe_tensor *y = lm_checktensor(L, yarg, fname);
  lm_plan *u = lm_checkplan(L, parg, fname);
  moe_tensor *gates = lua_isnoneornil(L, garg) ? NULL : lm_checktensor(L, garg, fname);
  lm_checkend(L, 3, fname);
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_routing_combine(S->ctx, y, u->p, gates, &out));
  return lm_result(L, S, r, st, out, "routing_combine", 0); /* the core's name */
}

/* moe.ops.permute(x, plan) and plan:permute(x) */
static int lm_ops_permute(lua_State *L) { return lm_permute_impl(L, 1, 2, "permute"); }
static int lm_plan_permute(lua_State *L) { return lm_permute_impl(L, 2, 1, "permute"); }
/* moe.ops.combine(y, plan [, gates]) and plan:combine(y [, gates]) */
static int lm_ops_combine(lua_State *L) { return lm_combine_impl(L, 1, 2, 3, "combine"); }
static int lm_plan_combine(lua_State *L) { return lm_combine_impl(L, 2, 1, 3, "combine"); }

/* ------------------------------------------------------- plan methods */

static int lm_plan_counts_to_host(lua_State *L) {
  lm_plan *u = lm_checkplan(L, 1, "counts_to_host");
  lm_checkend(L, 1, "counts_to_host");
  if (moe_routing_plan_counts_to_host(u->S->ctx, u->p) != MOE_OK)
    return lm_corefail(L, u->S, "counts_to_host", 0);
  lm_push_ints(L, (int)u->p->E, u->p->counts_host);
  return 1;
}

static int lm_plan_rank_counts(lua_State *L) {
  lm_plan *u = lm_checkplan(L, 1, "rank_counts");
  int64_t n = lm_checkint(L, 2, "rank_counts", "number of ranks");
  lm_checkend(L, 2, "rank_counts");
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_routing_rank_counts(u->S->ctx, u->p, n, &out));
  if (st != MOE_OK) return lm_corefail(L, u->S, "routing_rank_counts", 0);
  return lm_result(L, u->S, r, st, out, "rank_counts", 0);
}

static const luaL_Reg lm_plan_methods[] = {{"permute", lm_plan_permute},
                                           {"combine", lm_plan_combine},
                                           {"counts_to_host", lm_plan_counts_to_host},
                                           {"rank_counts", lm_plan_rank_counts},
                                           {"free", lm_plan_release},
                                           {NULL, NULL}};

/* plan.<field>: a method, an integer, or a tensor sharing the plan's storage. */
static int lm_plan_index(lua_State *L) {
  lm_plan *u = (lm_plan *)luaL_checkudata(L, 1, LM_PLAN);
  const char *key = luaL_checkstring(L, 2);
  lua_pushvalue(L, lua_upvalueindex(2)); /* the methods table */
  if (lua_getfield(L, -1, key) != LUA_TNIL) return 1;
  lua_pop(L, 2);
  if (!u->p) return luaL_error(L, "attempt to use a freed routing plan");
  moe_routing_plan *p = u->p;
  struct { const char *name; int64_t v; } ints[] = {
      {"T", p->T}, {"k", p->k}, {"E", p->E}, {"rows", p->rows}, {"capacity", p->capacity},
      {"block_size", p->block_size}, {"nnz", p->nnz}, {"ffn_blocks", p->ffn_blocks},
      {"expert_begin", p->e0}, {"expert_end", p->e1}, {"host_syncs", p->host_syncs}};
  for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++)
    if (strcmp(key, ints[i].name) == 0) {
      lua_pushinteger(L, (lua_Integer)ints[i].v);
      return 1;
    }
  if (strcmp(key, "device") == 0) {
    lm_push_device(L, p->device);
    return 1;
  }
  struct { const char *name; moe_tensor *t; } ts[] = {
      {"counts", p->counts}, {"kept", p->kept}, {"offsets", p->offsets},
      {"row_offsets", p->row_offsets}, {"sort_perm", p->sort_perm}, {"sort_inv", p->sort_inv},
      {"dest", p->dest}, {"src", p->src}, {"bs_row_indices", p->bs_row_indices},
      {"bs_column_indices", p->bs_column_indices}, {"bs_offsets", p->bs_offsets},
      {"bs_column_indices_t", p->bs_column_indices_t}, {"bs_offsets_t", p->bs_offsets_t},
      {"bs_block_offsets_t", p->bs_block_offsets_t}};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++)
    if (strcmp(key, ts[i].name) == 0) {
      if (!ts[i].t) {
        lua_pushnil(L);
        return 1;
      }
      lm_tensor *r = lm_push_empty(L);
      moe_tensor_retain(ts[i].t);
      lm_adopt(r, u->S, ts[i].t);
      return 1;
    }
  lua_pushnil(L);
  return 1;
}

static int lm_plan_tostring(lua_State *L) {
  lm_plan *u = (lm_plan *)luaL_checkudata(L, 1, LM_PLAN);
  if (!u->p) {
    lua_pushliteral(L, "moe.RoutingPlan (freed)");
    return 1;
  }
  moe_routing_plan *p = u->p;
  lua_pushfstring(L, "moe.RoutingPlan(T=%I, k=%I, E=%I, rows=%I, block_size=%I, capacity=%I, device=%s)",
                  (LUAI_UACINT)p->T, (LUAI_UACINT)p->k, (LUAI_UACINT)p->E, (LUAI_UACINT)p->rows,
                  (LUAI_UACINT)p->block_size, (LUAI_UACINT)p->capacity,
                  MOE_DEVICE(p->device));
  return 1;
}

static const luaL_Reg lm_routing_functions[] = {{"routing_plan", lm_routing_plan},
                                                {"permute", lm_ops_permute},
                                                {"combine", lm_ops_combine},
                                                {NULL, NULL}};

void lm_open_routing(lua_State *L, int ops, int methods, int sentinel) {
  sentinel = lua_absindex(L, sentinel);
  if (luaL_newmetatable(L, LM_PLAN)) {
    lua_pushcfunction(L, lm_plan_release);
    lua_setfield(L, -2, "__gc");
    lua_pushcfunction(L, lm_plan_release);
    lua_setfield(L, -2, "__close");
    lua_pushcfunction(L, lm_plan_tostring);
    lua_setfield(L, -2, "__tostring");
    /* __index: a closure over (sentinel, methods table) */
    lua_pushvalue(L, sentinel);
    luaL_newlibtable(L, lm_plan_methods);
    lua_pushvalue(L, sentinel);
    luaL_setfuncs(L, lm_plan_methods, 1);
    lua_pushcclosure(L, lm_plan_index, 2);
    lua_setfield(L, -2, "__index");
  }
  lua_pop(L, 1);
  lm_register(L, ops, methods, sentinel, lm_routing_functions, NULL);
}
