/*
 * lreduce.c - Lua bindings of reductions, softmax, cumsum, layer_norm,
 * rms_norm, cross_entropy. Registered by luaopen_moe through lm_open_reduce
 * (see lmoe_internal.h). Each function is also a tensor method (t:sum(...)
 * is moe.sum(t, ...)). Dims are 0-based, negative from the end.
 *
 *   moe.sum(t[, dims[, keepdim]])   dims: nil (all), a dim, or a table of dims
 *   moe.mean, moe.logsumexp         the same arguments
 *   moe.var(t[, dims[, correction[, keepdim]]])   correction: a number
 *                                   (default 1) or a boolean (unbiased)
 *   moe.norm(t[, p[, dims[, keepdim]]])   p > 0 or math.huge / "inf" (default 2)
 *   moe.max(t)                      the overall max (a 0-dim tensor)
 *   moe.max(t, dim[, keepdim])      values, indices
 *   moe.min                         the same
 *   moe.argmax(t[, dim[, keepdim]]) i64 indices (no dim: into the flattened t)
 *   moe.argmin
 *   moe.softmax(t[, dim = -1]), moe.log_softmax(t[, dim = -1])
 *   moe.cumsum(t, dim)
 *   moe.layer_norm(x[, weight[, bias[, eps = 1e-5]]])
 *   moe.rms_norm(x[, weight[, eps = 1e-6]])
 *   moe.cross_entropy(logits, target[, {ignore_index = -100,
 *                     label_smoothing = 0, reduction = "mean"|"sum"|"none"}])
 */
#include <math.h>
#include <string.h>

#include "lmoe_internal.h"

/* dims at arg: nil (all dims: *n = 0), a number, or a table of numbers. */
static void lm_red_dims(lua_State *L, lm_state *S, int arg, const char *fname, int ndim, int *n,
                        int64_t *dims) {
  int t = lua_type(L, arg);
  if (t == LUA_TNONE || t == LUA_TNIL) {
    *n = 0;
  } else if (t == LUA_TNUMBER) {
    dims[0] = lm_checkdim(L, S, arg, fname, ndim, false);
    *n = 1;
  } else if (t == LUA_TTABLE) {
    lm_checkdims(L, S, arg, fname, ndim, n, dims);
    if (*n == 0) lm_argerror(L, arg, fname, "dims must not be empty (use nil for all dims)");
  } else {
    lm_argerror(L, arg, fname, "dims expected (nil, a dim or a table of dims), got %s",
                lm_typename(L, arg));
  }
}

static bool lm_red_bool(lua_State *L, int arg, const char *fname, const char *what) {
  int t = lua_type(L, arg);
  if (t == LUA_TNONE || t == LUA_TNIL) return false;
  if (t != LUA_TBOOLEAN)
    lm_argerror(L, arg, fname, "%s must be a boolean, got %s", what, lm_typename(L, arg));
  return lua_toboolean(L, arg);
}

typedef moe_status (*lm_dims_fn)(moe_ctx *, moe_tensor *, int, const int64_t *, bool,
                                 moe_tensor **);

static int lm_red_dims_call(lua_State *L, lm_dims_fn fn, const char *fname) {
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, fname);
  int n;
  int64_t dims[MOE_MAX_DIMS];
  lm_red_dims(L, S, 2, fname, t->ndim, &n, dims);
  bool keepdim = lm_red_bool(L, 3, fname, "keepdim");
  lm_checkend(L, 3, fname);
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, fn(S->ctx, t, n, dims, keepdim, &out));
  return lm_result(L, S, r, st, out, fname, 0);
}

static int lm_sum(lua_State *L) { return lm_red_dims_call(L, moe_sum, "sum"); }
static int lm_mean(lua_State *L) { return lm_red_dims_call(L, moe_mean, "mean"); }
static int lm_logsumexp(lua_State *L) { return lm_red_dims_call(L, moe_logsumexp, "logsumexp"); }

static int lm_var(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, "var");
  int n;
  int64_t dims[MOE_MAX_DIMS];
  lm_red_dims(L, S, 2, "var", t->ndim, &n, dims);
  double corr = 1;
  if (lua_type(L, 3) == LUA_TBOOLEAN) corr = lua_toboolean(L, 3) ? 1 : 0;
  else if (!lua_isnoneornil(L, 3)) corr = lm_checknum(L, 3, "var", "correction");
  bool keepdim = lm_red_bool(L, 4, "var", "keepdim");
  lm_checkend(L, 4, "var");
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_var(S->ctx, t, n, dims, corr, keepdim, &out));
  return lm_result(L, S, r, st, out, "var", 3);
}

static int lm_norm(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, "norm");
  double p = 2;
  if (lua_type(L, 2) == LUA_TSTRING) {
    const char *s = lua_tostring(L, 2);
    if (strcmp(s, "inf") != 0 && strcmp(s, "fro") != 0)
      lm_argerror(L, 2, "norm", "p must be a number, \"inf\" or \"fro\", got \"%s\"", s);
    p = strcmp(s, "inf") == 0 ? HUGE_VAL : 2;
  } else if (!lua_isnoneornil(L, 2)) {
    p = lm_checknum(L, 2, "norm", "p");
    if (!(p > 0)) lm_argerror(L, 2, "norm", "p must be > 0 (or math.huge), got %f", p);
  }
  int n;
  int64_t dims[MOE_MAX_DIMS];
  lm_red_dims(L, S, 3, "norm", t->ndim, &n, dims);
  bool keepdim = lm_red_bool(L, 4, "norm", "keepdim");
  lm_checkend(L, 4, "norm");
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_norm(S->ctx, t, p, n, dims, keepdim, &out));
  return lm_result(L, S, r, st, out, "norm", 0);
}

typedef moe_status (*lm_minmax_fn)(moe_ctx *, moe_tensor *, int64_t, bool, moe_tensor **,
                                   moe_tensor **);
typedef moe_status (*lm_all_fn)(moe_ctx *, moe_tensor *, moe_tensor **);

/* max(t) -> value; max(t, dim[, keepdim]) -> values, indices */
static int lm_minmax(lua_State *L, lm_minmax_fn fn, lm_all_fn all, const char *fname) {
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, fname);
  if (lua_isnoneornil(L, 2)) {
    lm_checkend(L, 1, fname);
    lm_tensor *r = lm_push_empty(L);
    moe_tensor *out = NULL;
    moe_status st;
    LM_CALL(L, st, all(S->ctx, t, &out));
    return lm_result(L, S, r, st, out, fname, 0);
  }
  int d = lm_checkdim(L, S, 2, fname, t->ndim, false);
  bool keepdim = lm_red_bool(L, 3, fname, "keepdim");
  lm_checkend(L, 3, fname);
  lm_tensor *rv = lm_push_empty(L);
  lm_tensor *ri = lm_push_empty(L);
  moe_tensor *v = NULL, *ix = NULL;
  moe_status st;
  LM_CALL(L, st, fn(S->ctx, t, d, keepdim, &v, &ix));
  if (st != MOE_OK) return lm_corefail(L, S, fname, 0);
  lm_adopt(rv, S, v);
  lm_adopt(ri, S, ix);
  return 2;
}

static int lm_max(lua_State *L) { return lm_minmax(L, moe_max, moe_max_all, "max"); }
static int lm_min(lua_State *L) { return lm_minmax(L, moe_min, moe_min_all, "min"); }

typedef moe_status (*lm_arg_fn)(moe_ctx *, moe_tensor *, int64_t, bool, bool, moe_tensor **);

static int lm_argfn(lua_State *L, lm_arg_fn fn, const char *fname) {
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, fname);
  bool all = lua_isnoneornil(L, 2);
  int d = all ? 0 : lm_checkdim(L, S, 2, fname, t->ndim, false);
  bool keepdim = lm_red_bool(L, 3, fname, "keepdim");
  lm_checkend(L, 3, fname);
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, fn(S->ctx, t, d, all, keepdim, &out));
  return lm_result(L, S, r, st, out, fname, 0);
}

static int lm_argmax(lua_State *L) { return lm_argfn(L, moe_argmax, "argmax"); }
static int lm_argmin(lua_State *L) { return lm_argfn(L, moe_argmin, "argmin"); }

typedef moe_status (*lm_dim_fn)(moe_ctx *, moe_tensor *, int64_t, moe_tensor **);

static int lm_dim_call(lua_State *L, lm_dim_fn fn, const char *fname, bool dim_required) {
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, fname);
  int d;
  if (!dim_required && lua_isnoneornil(L, 2)) {
    if (t->ndim == 0) lm_argerror(L, 1, fname, "a tensor with at least one dim expected");
    d = t->ndim - 1;
  } else {
    d = lm_checkdim(L, S, 2, fname, t->ndim, false);
  }
  lm_checkend(L, 2, fname);
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, fn(S->ctx, t, d, &out));
  return lm_result(L, S, r, st, out, fname, 0);
}

static int lm_softmax(lua_State *L) { return lm_dim_call(L, moe_softmax, "softmax", false); }
static int lm_log_softmax(lua_State *L) {
  return lm_dim_call(L, moe_log_softmax, "log_softmax", false);
}
static int lm_cumsum(lua_State *L) { return lm_dim_call(L, moe_cumsum, "cumsum", true); }

/* An optional tensor at arg (nil: NULL). */
static moe_tensor *lm_opttensor(lua_State *L, int arg, const char *fname, const char *what) {
  if (lua_isnoneornil(L, arg)) return NULL;
  if (!lm_testtensor(L, arg))
    lm_argerror(L, arg, fname, "%s must be a tensor or nil, got %s", what, lm_typename(L, arg));
  return lm_checktensor(L, arg, fname);
}

static int lm_layer_norm(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *x = lm_checktensor(L, 1, "layer_norm");
  moe_tensor *w = lm_opttensor(L, 2, "layer_norm", "weight");
  moe_tensor *b = lm_opttensor(L, 3, "layer_norm", "bias");
  double eps = lm_optnum(L, 4, "layer_norm", "eps", 1e-5);
  if (!(eps >= 0) || isinf(eps)) lm_argerror(L, 4, "layer_norm", "eps must be finite and >= 0, got %f", eps);
  lm_checkend(L, 4, "layer_norm");
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_layer_norm(S->ctx, x, w, b, eps, &out));
  return lm_result(L, S, r, st, out, "layer_norm", 0);
}

static int lm_rms_norm(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *x = lm_checktensor(L, 1, "rms_norm");
  moe_tensor *w = lm_opttensor(L, 2, "rms_norm", "weight");
  double eps = lm_optnum(L, 3, "rms_norm", "eps", 1e-6);
  if (!(eps >= 0) || isinf(eps)) lm_argerror(L, 3, "rms_norm", "eps must be finite and >= 0, got %f", eps);
  lm_checkend(L, 3, "rms_norm");
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_rms_norm(S->ctx, x, w, eps, &out));
  return lm_result(L, S, r, st, out, "rms_norm", 0);
}

static int lm_cross_entropy(lua_State *L) {
  lm_state *S = lm_S(L);
  const char *fname = "cross_entropy";
  moe_tensor *x = lm_checktensor(L, 1, fname);
  moe_tensor *t = lm_checktensor(L, 2, fname);
  int64_t ignore = -100;
  double smooth = 0;
  moe_reduction red = MOE_REDUCTION_MEAN;
  if (!lua_isnoneornil(L, 3)) {
    if (lua_type(L, 3) != LUA_TTABLE)
      lm_argerror(L, 3, fname, "options table expected, got %s", lm_typename(L, 3));
    lua_pushnil(L);
    while (lua_next(L, 3)) {
      const char *k = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : NULL;
      int isint = 0;
      if (k && strcmp(k, "ignore_index") == 0) {
        ignore = lua_type(L, -1) == LUA_TNUMBER ? (int64_t)lua_tointegerx(L, -1, &isint) : 0;
        if (!isint) lm_argerror(L, 3, fname, "ignore_index must be an integer, got %s", lm_describe(L, -1));
      } else if (k && strcmp(k, "label_smoothing") == 0) {
        if (lua_type(L, -1) != LUA_TNUMBER)
          lm_argerror(L, 3, fname, "label_smoothing must be a number, got %s", lm_typename(L, -1));
        smooth = lua_tonumber(L, -1);
        if (!(smooth >= 0 && smooth <= 1))
          lm_argerror(L, 3, fname, "label_smoothing must be in [0, 1], got %f", smooth);
      } else if (k && strcmp(k, "reduction") == 0) {
        const char *v = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
        if (!v || !moe_reduction_parse(v, &red))
          lm_argerror(L, 3, fname, "reduction must be \"mean\", \"sum\" or \"none\", got %s",
                      v ? v : lm_typename(L, -1));
      } else {
        lm_argerror(L, 3, fname, "unknown option '%s' (ignore_index, label_smoothing, reduction)",
                    k ? k : lm_typename(L, -2));
      }
      lua_pop(L, 1);
    }
  }
  lm_checkend(L, 3, fname);
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_cross_entropy(S->ctx, x, t, ignore, smooth, red, &out));
  return lm_result(L, S, r, st, out, fname, 0);
}

static const luaL_Reg lm_reduce_functions[] = {
    {"sum", lm_sum},           {"mean", lm_mean},
    {"logsumexp", lm_logsumexp}, {"var", lm_var},
    {"norm", lm_norm},         {"max", lm_max},
    {"min", lm_min},           {"argmax", lm_argmax},
    {"argmin", lm_argmin},     {"softmax", lm_softmax},
    {"log_softmax", lm_log_softmax}, {"cumsum", lm_cumsum},
    {"layer_norm", lm_layer_norm}, {"rms_norm", lm_rms_norm},
    {"cross_entropy", lm_cross_entropy}, {NULL, NULL}};

static const luaL_Reg lm_reduce_methods[] = {
    {"sum", lm_sum},           {"mean", lm_mean},
    {"logsumexp", lm_logsumexp}, {"var", lm_var},
    {"norm", lm_norm},         {"max", lm_max},
    {"min", lm_min},           {"argmax", lm_argmax},
    {"argmin", lm_argmin},     {"softmax", lm_softmax},
    {"log_softmax", lm_log_softmax}, {"cumsum", lm_cumsum},
    {NULL, NULL}};

void lm_open_reduce(lua_State *L, int mod, int methods, int sentinel) {
  lm_register(L, mod, methods, sentinel, lm_reduce_functions, lm_reduce_methods);
}
