/*
 * loptim.c - Lua bindings of the optimiser family (core/moe_optim.h), under
 * the `moe.ops` sub-table:
 *
 *   moe.ops.adamw_step(param, grad, exp_avg, exp_avg_sq, master_or_nil,
 *       {lr =, beta1 =, beta2 =, eps =, weight_decay =, step =})
 *   moe.ops.sgd_step(param, grad, momentum_buf_or_nil, master_or_nil,
 *       {lr =, momentum =, weight_decay =})
 *
 * Both update their tensors in place and return nothing. Multi-tensor forms
 * (one call for a list of tensors on one device, a few CUDA launches):
 *
 *   moe.ops.adamw_step_multi(params, grads, exp_avgs, exp_avg_sqs, masters,
 *       weight_decays, {lr =, beta1 =, beta2 =, eps =, step =,
 *                       grad_scale = tensor_or_nil, skip = tensor_or_nil})
 *     lists of equal length n; masters[i] nil or false for "no master";
 *     weight_decays a number for all or a list of n numbers. Bit-identical
 *     to adamw_step per entry when grad_scale is nil.
 *   moe.ops.grad_norm_multi(grads, max_norm_or_nil[, device])
 *     -> norm, coef, found_inf (new f32 0-d tensors on the gradients'
 *     device, or device for an empty list; no host read)
 *   moe.ops.scale_multi(tensors, scale)   t = t * scale in place
 *
 * Errors about entry k of the lists name it 1-based, as Lua counts. The
 * optimiser objects of lua/moe/optim/ own the state tensors and call these.
 * Registered by luaopen_moe through lm_open_optim.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
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

/* ------------------------------------------------------------ multi-tensor */

/* The length of the list at arg (a table, else an argument error). */
static int64_t lm_optim_list(lua_State *L, int arg, const char *fname, const char *what) {
  if (lua_type(L, arg) != LUA_TTABLE)
    lm_argerror(L, arg, fname, "%s: list of tensors expected, got %s", what, lm_typename(L, arg));
  return (int64_t)lua_rawlen(L, arg);
}

/* Element i (1-based) of the list at arg: a live tensor, or NULL for nil or
 * false when optional. */
static moe_tensor *lm_optim_elem(lua_State *L, int arg, int64_t i, const char *fname,
                                 const char *what, bool optional) {
  lua_rawgeti(L, arg, (lua_Integer)i);
  if (optional && !lua_toboolean(L, -1)) {
    lua_pop(L, 1);
    return NULL;
  }
  lm_tensor *u = lm_testtensor(L, -1);
  if (u == NULL)
    lm_argerror(L, arg, fname, "%s[%I]: tensor expected, got %s", what, (LUAI_UACINT)i,
                lm_typename(L, -1));
  if (u->t == NULL)
    lm_argerror(L, arg, fname, "%s[%I]: attempt to use a freed tensor", what, (LUAI_UACINT)i);
  lua_pop(L, 1);
  return u->t;
}

/* An optional tensor option (nil: NULL). */
static moe_tensor *lm_optim_opt_field(lua_State *L, int arg, const char *fname, const char *key) {
  moe_tensor *t = NULL;
  if (lua_getfield(L, arg, key) != LUA_TNIL) {
    lm_tensor *u = lm_testtensor(L, -1);
    if (u == NULL || u->t == NULL)
      lm_argerror(L, arg, fname, "option %s must be a tensor, got %s", key, lm_describe(L, -1));
    t = u->t;
  }
  lua_pop(L, 1);
  return t;
}

/* Raises the core's error; "<fname>: <what> K: msg" (K 0-based) becomes
 * "<fname>: <what> K+1: msg" so that it names Lua's index. */
static int lm_optim_fail(lua_State *L, lm_state *S, const char *fname, const char *what) {
  const char *msg = moe_ctx_error(S->ctx);
  char prefix[64];
  long long k = 0;
  int used = 0;
  snprintf(prefix, sizeof prefix, "%s: %s %%lld: %%n", fname, what);
  if (msg && sscanf(msg, prefix, &k, &used) == 1 && used > 0)
    return luaL_error(L, "%s: %s %I: %s", fname, what, (LUAI_UACINT)(k + 1), msg + used);
  return lm_corefail(L, S, fname, 0);
}

/* moe.ops.adamw_step_multi(params, grads, exp_avgs, exp_avg_sqs, masters, weight_decays, opts) */
static int lm_adamw_step_multi(lua_State *L) {
  const char *fname = "adamw_step_multi";
  lm_state *S = lm_S(L);
  static const char *const lists[] = {"params", "grads", "exp_avgs", "exp_avg_sqs"};
  int64_t n = lm_optim_list(L, 1, fname, lists[0]);
  for (int a = 2; a <= 4; a++) {
    int64_t m = lm_optim_list(L, a, fname, lists[a - 1]);
    if (m != n)
      lm_argerror(L, a, fname, "%s has %I entries but params has %I", lists[a - 1],
                  (LUAI_UACINT)m, (LUAI_UACINT)n);
  }
  if (!lua_isnil(L, 5) && lua_type(L, 5) != LUA_TTABLE)
    lm_argerror(L, 5, fname, "masters: list of tensors (or false) or nil expected, got %s",
                lm_typename(L, 5));
  bool wd_list = lua_type(L, 6) == LUA_TTABLE;
  double wd_all = 0;
  if (!wd_list) wd_all = lm_checknum(L, 6, fname, "weight_decays");
  else if ((int64_t)lua_rawlen(L, 6) != n)
    lm_argerror(L, 6, fname, "weight_decays has %I entries but params has %I",
                (LUAI_UACINT)lua_rawlen(L, 6), (LUAI_UACINT)n);
  lm_optim_table(L, 7, fname);
  static const char *const known[] = {"lr", "beta1", "beta2", "eps", "step",
                                      "grad_scale", "skip", NULL};
  lm_checkkeys(L, 7, fname, known);
  moe_adamw_opts o = moe_adamw_opts_default();
  o.lr = lm_optim_num(L, 7, fname, "lr", o.lr);
  o.beta1 = lm_optim_num(L, 7, fname, "beta1", o.beta1);
  o.beta2 = lm_optim_num(L, 7, fname, "beta2", o.beta2);
  o.eps = lm_optim_num(L, 7, fname, "eps", o.eps);
  o.weight_decay = 0;
  if (lua_getfield(L, 7, "step") != LUA_TNIL) {
    if (!lua_isinteger(L, -1))
      lm_argerror(L, 7, fname, "option step must be an integer, got %s", lm_describe(L, -1));
    o.step = (int64_t)lua_tointeger(L, -1);
  }
  lua_pop(L, 1);
  moe_tensor *gscale = lm_optim_opt_field(L, 7, fname, "grad_scale");
  moe_tensor *skip = lm_optim_opt_field(L, 7, fname, "skip");
  lm_checkend(L, 7, fname);
  void **box = lm_push_scratch(L);
  moe_adamw_entry *e = n > 0 ? malloc(sizeof *e * (size_t)n) : NULL;
  if (n > 0 && e == NULL) return luaL_error(L, "%s: out of host memory for %I entries", fname, (LUAI_UACINT)n);
  *box = e;
  for (int64_t i = 0; i < n; i++) {
    e[i].param = lm_optim_elem(L, 1, i + 1, fname, "params", false);
    e[i].grad = lm_optim_elem(L, 2, i + 1, fname, "grads", false);
    e[i].exp_avg = lm_optim_elem(L, 3, i + 1, fname, "exp_avgs", false);
    e[i].exp_avg_sq = lm_optim_elem(L, 4, i + 1, fname, "exp_avg_sqs", false);
    e[i].master = lua_isnil(L, 5) ? NULL : lm_optim_elem(L, 5, i + 1, fname, "masters", true);
    e[i].weight_decay = wd_all;
    if (wd_list) {
      if (lua_rawgeti(L, 6, (lua_Integer)(i + 1)) != LUA_TNUMBER)
        lm_argerror(L, 6, fname, "weight_decays[%I]: number expected, got %s", (LUAI_UACINT)(i + 1),
                    lm_typename(L, -1));
      e[i].weight_decay = lua_tonumber(L, -1);
      lua_pop(L, 1);
    }
  }
  moe_status st = moe_adamw_step_multi(S->ctx, e, n, &o, gscale, skip);
  free(e);
  *box = NULL;
  if (st != MOE_OK) return lm_optim_fail(L, S, fname, "entry");
  return 0;
}

/* moe.ops.grad_norm_multi(grads, max_norm_or_nil[, device]) -> norm, coef, found_inf */
static int lm_grad_norm_multi(lua_State *L) {
  const char *fname = "grad_norm_multi";
  lm_state *S = lm_S(L);
  int64_t n = lm_optim_list(L, 1, fname, "grads");
  double max_norm = lua_isnil(L, 2) ? HUGE_VAL : lm_checknum(L, 2, fname, "max_norm");
  if (!(max_norm > 0))
    lm_argerror(L, 2, fname, "max_norm must be > 0 (nil: no clipping), got %s", lm_describe(L, 2));
  moe_device dev = lua_isnoneornil(L, 3) ? MOE_CPU : lm_checkdevice_at(L, S, 3, 3, fname);
  lm_checkend(L, 3, fname);
  void **box = lm_push_scratch(L);
  const moe_tensor **g = n > 0 ? malloc(sizeof *g * (size_t)n) : NULL;
  if (n > 0 && g == NULL) return luaL_error(L, "%s: out of host memory for %I gradients", fname, (LUAI_UACINT)n);
  *box = (void *)g;
  for (int64_t i = 0; i < n; i++) g[i] = lm_optim_elem(L, 1, i + 1, fname, "grads", false);
  if (n > 0) dev = moe_tensor_device(g[0]);
  lm_tensor *r[3];
  moe_tensor *out[3] = {NULL, NULL, NULL};
  for (int k = 0; k < 3; k++) r[k] = lm_push_empty(L);
  moe_status st = MOE_OK;
  for (int k = 0; k < 3 && st == MOE_OK; k++)
    st = moe_tensor_empty(S->ctx, 0, NULL, MOE_F32, dev, &out[k]);
  if (st == MOE_OK) st = moe_grad_norm_multi(S->ctx, g, n, max_norm, out[0], out[1], out[2]);
  free((void *)g);
  *box = NULL;
  if (st != MOE_OK) {
    for (int k = 0; k < 3; k++) moe_tensor_release(out[k]);
    return lm_optim_fail(L, S, fname, "grad");
  }
  for (int k = 0; k < 3; k++) lm_adopt(r[k], S, out[k]);
  return 3;
}

/* moe.ops.scale_multi(tensors, scale) */
static int lm_scale_multi(lua_State *L) {
  const char *fname = "scale_multi";
  lm_state *S = lm_S(L);
  int64_t n = lm_optim_list(L, 1, fname, "tensors");
  moe_tensor *scale = lm_checktensor(L, 2, fname);
  lm_checkend(L, 2, fname);
  void **box = lm_push_scratch(L);
  moe_tensor **t = n > 0 ? malloc(sizeof *t * (size_t)n) : NULL;
  if (n > 0 && t == NULL) return luaL_error(L, "%s: out of host memory for %I tensors", fname, (LUAI_UACINT)n);
  *box = t;
  for (int64_t i = 0; i < n; i++) t[i] = lm_optim_elem(L, 1, i + 1, fname, "tensors", false);
  moe_status st = moe_scale_multi(S->ctx, t, n, scale);
  free(t);
  *box = NULL;
  if (st != MOE_OK) return lm_optim_fail(L, S, fname, "tensor");
  return 0;
}

static const luaL_Reg lm_optim_functions[] = {
    {"adamw_step", lm_adamw_step},
    {"sgd_step", lm_sgd_step},
    {"adamw_step_multi", lm_adamw_step_multi},
    {"grad_norm_multi", lm_grad_norm_multi},
    {"scale_multi", lm_scale_multi},
    {NULL, NULL}};

void lm_open_optim(lua_State *L, int ops, int methods, int sentinel) {
  lm_register(L, ops, methods, sentinel, lm_optim_functions, NULL);
}
