/*
 * loptim.c - Lua bindings of the optimiser family (core/moe_optim.h), under
 * the `moe.ops` sub-table:
 *
 *   moe.ops.adamw_step(param, grad, exp_avg, exp_avg_sq, master_or_nil,
 *       {lr =, beta1 =, beta2 =, eps =, weight_decay =, step =})
 *   moe.ops.sgd_step(param, grad, momentum_buf_or_nil, master_or_nil,
 *       {lr =, momentum =, weight_decay =})
 *
 * Both update their tensors in place and return nothing. The optimiser
 * objects of lua/moe/optim/ own the state tensors and call these once per
 * parameter. Registered by luaopen_moe through lm_open_optim.
 */
#include <string.h>

#include "lmoe_internal.h"
#include "moe_optim.h"

static double lm_optim_num(lua_State *L, int arg, const char *fname, const char *key, double def) {
  double v = def;
  if (lua_getfield(L, arg, key) != LUA_TNIL) {
    if (lua_type(L, -1) != LUA_TNUMBER)
      lm_argerror(L, arg, fname, "option %s must be a number, got %s", key, lm_describe(L, -1));
    v = (double)lua_tonumber(L, -1);
  }
  lua_pop(L, 1);
  return v;
}

static moe_tensor *lm_optim_opt_tensor(lua_State *L, int arg, const char *fname) {
  return lua_isnil(L, arg) ? NULL : lm_checktensor(L, arg, fname);
}

static void lm_optim_table(lua_State *L, int arg, const char *fname) {
  if (lua_type(L, arg) != LUA_TTABLE)
    lm_argerror(L, arg, fname, "options table expected, got %s", lm_typename(L, arg));
}

/* moe.ops.adamw_step(param, grad, exp_avg, exp_avg_sq, master, opts) */
static int lm_adamw_step(lua_State *L) {
  const char *fname = "adamw_step";
  lm_state *S = lm_S(L);
  moe_tensor *param = lm_checktensor(L, 1, fname);
  moe_tensor *grad = lm_checktensor(L, 2, fname);
  moe_tensor *m = lm_checktensor(L, 3, fname);
  moe_tensor *v = lm_checktensor(L, 4, fname);
  moe_tensor *master = lm_optim_opt_tensor(L, 5, fname);
  lm_optim_table(L, 6, fname);
  static const char *const known[] = {"lr", "beta1", "beta2", "eps", "weight_decay", "step", NULL};
  lm_checkkeys(L, 6, fname, known);
  moe_adamw_opts o = moe_adamw_opts_default();
  o.lr = lm_optim_num(L, 6, fname, "lr", o.lr);
  o.beta1 = lm_optim_num(L, 6, fname, "beta1", o.beta1);
  o.beta2 = lm_optim_num(L, 6, fname, "beta2", o.beta2);
  o.eps = lm_optim_num(L, 6, fname, "eps", o.eps);
  o.weight_decay = lm_optim_num(L, 6, fname, "weight_decay", o.weight_decay);
  if (lua_getfield(L, 6, "step") != LUA_TNIL) {
    if (!lua_isinteger(L, -1))
      lm_argerror(L, 6, fname, "option step must be an integer, got %s", lm_describe(L, -1));
    o.step = (int64_t)lua_tointeger(L, -1);
  }
  lua_pop(L, 1);
  lm_checkend(L, 6, fname);
  if (moe_adamw_step(S->ctx, param, grad, m, v, master, &o) != MOE_OK)
    return lm_corefail(L, S, fname, 0);
  return 0;
}

/* moe.ops.sgd_step(param, grad, momentum_buf, master, opts) */
static int lm_sgd_step(lua_State *L) {
  const char *fname = "sgd_step";
  lm_state *S = lm_S(L);
  moe_tensor *param = lm_checktensor(L, 1, fname);
  moe_tensor *grad = lm_checktensor(L, 2, fname);
  moe_tensor *buf = lm_optim_opt_tensor(L, 3, fname);
  moe_tensor *master = lm_optim_opt_tensor(L, 4, fname);
  lm_optim_table(L, 5, fname);
  static const char *const known[] = {"lr", "momentum", "weight_decay", NULL};
  lm_checkkeys(L, 5, fname, known);
  moe_sgd_opts o;
  o.lr = lm_optim_num(L, 5, fname, "lr", 1e-3);
  o.momentum = lm_optim_num(L, 5, fname, "momentum", 0);
  o.weight_decay = lm_optim_num(L, 5, fname, "weight_decay", 0);
  lm_checkend(L, 5, fname);
  if (moe_sgd_step(S->ctx, param, grad, buf, master, &o) != MOE_OK)
    return lm_corefail(L, S, fname, 0);
  return 0;
}

static const luaL_Reg lm_optim_functions[] = {
    {"adamw_step", lm_adamw_step}, {"sgd_step", lm_sgd_step}, {NULL, NULL}};

void lm_open_optim(lua_State *L, int ops, int methods, int sentinel) {
  lm_register(L, ops, methods, sentinel, lm_optim_functions, NULL);
}
