/*
 * lblocksparse.c - Lua bindings of the block-sparse family
 * (core/moe_blocksparse.h), under the `moe.ops` sub-table:
 *
 *   moe.ops.bsmm_sdd(x, w, plan [, {trans_w = false, gather = false}])  -- (nnz, b, b)
 *   moe.ops.bsmm_dsd(s, w, plan [, {trans_w = false}])  -- (R, K)
 *   moe.ops.bsmm_dsd_t(s, y, plan [, {gather = false}])  -- (E_loc, N, K)
 *   moe.ops.bsmm_dds(x, s, plan [, {gather = false}])    -- (E_loc, K, N)
 *   moe.ops.bsmm_to_dense(s, plan)                      -- (R, E_loc * N)
 *   moe.ops.bsmm_from_dense(d, plan)                    -- (nnz, b, b)
 *
 * plan is a moe.RoutingPlan userdata (bindings/lrouting.c) built with
 * block_size and ffn_hidden. sdd and dsd are differentiable (the nodes hold
 * the C plan). gather = true: x (or y) is (T, K) in token order and the
 * product reads its rows by the plan (moe_bsmm_*_gather; not differentiable). Registered by luaopen_moe through lm_open_blocksparse.
 */
#include <string.h>

#include "lmoe_internal.h"
#include "moe_routing.h"

/* Options table at arg: trans_w (sdd, dsd) and gather (sdd, dsd_t, dds). */
static void lm_bs_opts(lua_State *L, int arg, const char *fname, bool has_trans, bool has_gather,
                       bool *trans_w, bool *gather) {
  *trans_w = *gather = false;
  if (lua_isnoneornil(L, arg)) return;
  if (lua_type(L, arg) != LUA_TTABLE)
    lm_argerror(L, arg, fname, "options table expected, got %s", lm_typename(L, arg));
  static const char *const k_tw[] = {"trans_w", NULL}, *const k_g[] = {"gather", NULL},
                           *const k_both[] = {"trans_w", "gather", NULL};
  lm_checkkeys(L, arg, fname, has_trans && has_gather ? k_both : has_trans ? k_tw : k_g);
  if (has_trans) *trans_w = lm_field_bool(L, arg, fname, "trans_w", false);
  if (has_gather) *gather = lm_field_bool(L, arg, fname, "gather", false);
}

typedef enum lm_bs_kind { LM_SDD, LM_DSD, LM_DSD_T, LM_DDS } lm_bs_kind;

static int lm_bs_product(lua_State *L, lm_bs_kind kind, const char *fname) {
  lm_state *S = lm_S(L);
  moe_tensor *a = lm_checktensor(L, 1, fname);
  moe_tensor *b = lm_checktensor(L, 2, fname);
  moe_routing_plan *p = lm_plan_arg(L, 3, fname);
  bool trans_w = false, gather = false;
  lm_bs_opts(L, 4, fname, kind == LM_SDD || kind == LM_DSD, kind != LM_DSD, &trans_w, &gather);
  lm_checkend(L, 4, fname);
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st = MOE_OK;
  switch (kind) {
  case LM_SDD:
    if (gather) LM_CALL(L, st, moe_bsmm_sdd_gather(S->ctx, a, b, p, trans_w, &out));
    else LM_CALL(L, st, moe_bsmm_sdd(S->ctx, a, b, p, trans_w, &out));
    break;
  case LM_DSD: LM_CALL(L, st, moe_bsmm_dsd(S->ctx, a, b, p, trans_w, &out)); break;
  case LM_DSD_T:
    if (gather) LM_CALL(L, st, moe_bsmm_dsd_t_gather(S->ctx, a, b, p, &out));
    else LM_CALL(L, st, moe_bsmm_dsd_t(S->ctx, a, b, p, &out));
    break;
  case LM_DDS:
    if (gather) LM_CALL(L, st, moe_bsmm_dds_gather(S->ctx, a, b, p, &out));
    else LM_CALL(L, st, moe_bsmm_dds(S->ctx, a, b, p, &out));
    break;
  }
  return lm_result(L, S, r, st, out, fname, 0);
}

static int lm_bsmm_sdd(lua_State *L) { return lm_bs_product(L, LM_SDD, "bsmm_sdd"); }
static int lm_bsmm_dsd(lua_State *L) { return lm_bs_product(L, LM_DSD, "bsmm_dsd"); }
static int lm_bsmm_dsd_t(lua_State *L) { return lm_bs_product(L, LM_DSD_T, "bsmm_dsd_t"); }
static int lm_bsmm_dds(lua_State *L) { return lm_bs_product(L, LM_DDS, "bsmm_dds"); }

static int lm_bs_convert(lua_State *L, bool to_dense, const char *fname) {
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, fname);
  moe_routing_plan *p = lm_plan_arg(L, 2, fname);
  lm_checkend(L, 2, fname);
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  if (to_dense) LM_CALL(L, st, moe_bsmm_to_dense(S->ctx, t, p, &out));
  else LM_CALL(L, st, moe_bsmm_from_dense(S->ctx, t, p, &out));
  return lm_result(L, S, r, st, out, fname, 0);
}

static int lm_bsmm_to_dense(lua_State *L) { return lm_bs_convert(L, true, "bsmm_to_dense"); }
static int lm_bsmm_from_dense(lua_State *L) { return lm_bs_convert(L, false, "bsmm_from_dense"); }

static const luaL_Reg lm_blocksparse_functions[] = {{"bsmm_sdd", lm_bsmm_sdd},
                                                    {"bsmm_dsd", lm_bsmm_dsd},
                                                    {"bsmm_dsd_t", lm_bsmm_dsd_t},
                                                    {"bsmm_dds", lm_bsmm_dds},
                                                    {"bsmm_to_dense", lm_bsmm_to_dense},
                                                    {"bsmm_from_dense", lm_bsmm_from_dense},
                                                    {NULL, NULL}};

void lm_open_blocksparse(lua_State *L, int ops, int methods, int sentinel) {
  lm_register(L, ops, methods, sentinel, lm_blocksparse_functions, NULL);
}
