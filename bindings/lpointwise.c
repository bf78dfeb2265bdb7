/*
 * lpointwise.c - Lua bindings of pointwise math, comparisons, activations, dropout.
 * Registered by luaopen_moe through lm_open_pointwise (see lmoe_internal.h).
 *
 *   moe.exp(t) log sqrt rsqrt abs relu gelu gelu_tanh silu sigmoid tanh
 *                            and the methods t:exp() ...
 *   moe.pow(a, b)            a, b tensors or numbers (one a tensor); t:pow(x); t ^ x, x ^ t
 *   moe.clamp(t, min, max)   either bound may be nil; t:clamp(min, max)
 *   moe.maximum(a, b), moe.minimum(a, b)   b may be a number; t:maximum(x)
 *   moe.where(cond, a, b)    a or b may be a number; t:where(cond, other) = where(cond, t, other)
 *   moe.eq(a, b) ne lt le gt ge   tensor/tensor or tensor/number (either side);
 *                            t:lt(x) ... (no __lt/__le: Lua wants booleans from them)
 *   moe.swiglu(gate, up)     t:swiglu(up) = swiglu(t, up)
 *   moe.dropout(x[, p = 0.5[, training = true]])   t:dropout(p, training)
 *
 * A number operand of maximum, minimum and where becomes a 0-dim tensor on
 * the tensor's device: of the tensor's dtype, or f32 when the tensor holds
 * integers and the number does not.
 */
#include <math.h>

#include "lmoe_internal.h"

typedef moe_status (*lm_unary_fn)(moe_ctx *, moe_tensor *, moe_tensor **);

static int lm_unary(lua_State *L, lm_unary_fn fn, const char *fname) {
  lm_state *S = lm_S(L);
  moe_tensor *x = lm_checktensor(L, 1, fname);
  lm_checkend(L, 1, fname);
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, fn(S->ctx, x, &out));
  return lm_result(L, S, r, st, out, fname, 0);
}

static int lm_exp(lua_State *L) { return lm_unary(L, moe_exp, "exp"); }
static int lm_log(lua_State *L) { return lm_unary(L, moe_log, "log"); }
static int lm_sqrt(lua_State *L) { return lm_unary(L, moe_sqrt, "sqrt"); }
static int lm_rsqrt(lua_State *L) { return lm_unary(L, moe_rsqrt, "rsqrt"); }
static int lm_abs(lua_State *L) { return lm_unary(L, moe_abs, "abs"); }
static int lm_relu(lua_State *L) { return lm_unary(L, moe_relu, "relu"); }
static int lm_gelu(lua_State *L) { return lm_unary(L, moe_gelu, "gelu"); }
static int lm_gelu_tanh(lua_State *L) { return lm_unary(L, moe_gelu_tanh, "gelu_tanh"); }
static int lm_silu(lua_State *L) { return lm_unary(L, moe_silu, "silu"); }
static int lm_sigmoid(lua_State *L) { return lm_unary(L, moe_sigmoid, "sigmoid"); }
static int lm_tanh(lua_State *L) { return lm_unary(L, moe_tanh, "tanh"); }

/* A tensor (returned, borrowed) or a number (in *s, returning NULL) at
 * arg; number_ok says whether a number is acceptable there. */
static moe_tensor *lm_tensor_or_number(lua_State *L, int arg, const char *fname, bool number_ok,
                                       double *s) {
  if (lm_testtensor(L, arg)) return lm_checktensor(L, arg, fname);
  if (number_ok && lua_type(L, arg) == LUA_TNUMBER) {
    *s = (double)lua_tonumber(L, arg);
    return NULL;
  }
  lm_argerror(L, arg, fname, "%s expected, got %s", number_ok ? "tensor or number" : "tensor",
              lm_typename(L, arg));
  return NULL;
}

/* pow(a, b), also __pow (Lua passes both operands, either a tensor). */
static int lm_pow(lua_State *L) {
  lm_state *S = lm_S(L);
  double sa = 0, sb = 0;
  moe_tensor *a = lm_tensor_or_number(L, 1, "pow", true, &sa);
  moe_tensor *b = lm_tensor_or_number(L, 2, "pow", a != NULL, &sb);
  lm_checkend(L, 2, "pow");
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  if (a && b) LM_CALL(L, st, moe_pow(S->ctx, a, b, &out));
  else if (a) LM_CALL(L, st, moe_pow_scalar(S->ctx, a, sb, &out));
  else LM_CALL(L, st, moe_rpow_scalar(S->ctx, sa, b, &out));
  return lm_result(L, S, r, st, out, "pow", 0);
}

static int lm_clamp(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *x = lm_checktensor(L, 1, "clamp");
  double lo = lua_isnoneornil(L, 2) ? NAN : lm_checknum(L, 2, "clamp", "min");
  double hi = lua_isnoneornil(L, 3) ? NAN : lm_checknum(L, 3, "clamp", "max");
  if (isnan(lo) && !lua_isnoneornil(L, 2)) lm_argerror(L, 2, "clamp", "min is NaN");
  if (isnan(hi) && !lua_isnoneornil(L, 3)) lm_argerror(L, 3, "clamp", "max is NaN");
  if (isnan(lo) && isnan(hi)) lm_argerror(L, 2, "clamp", "min or max must be given (both are nil)");
  lm_checkend(L, 3, "clamp");
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_clamp(S->ctx, x, lo, hi, &out));
  return lm_result(L, S, r, st, out, "clamp", 0);
}

/* A 0-dim tensor holding s, to stand beside `like` (see the header). */
static moe_status lm_scalar_tensor(moe_ctx *ctx, const moe_tensor *like, double s,
                                   moe_tensor **out) {
  moe_dtype dt = like->dtype;
  if (!moe_dtype_is_float(dt) && !(isfinite(s) && s == trunc(s))) dt = MOE_F32;
  return moe_tensor_full(ctx, 0, NULL, s, dt, moe_tensor_device(like), out);
}

typedef moe_status (*lm_binary_fn)(moe_ctx *, moe_tensor *, moe_tensor *, moe_tensor **);

/* maximum / minimum: a tensor, b a tensor or a number. */
static int lm_select2(lua_State *L, lm_binary_fn fn, const char *fname) {
  lm_state *S = lm_S(L);
  double s = 0;
  moe_tensor *a = lm_checktensor(L, 1, fname);
  moe_tensor *b = lm_tensor_or_number(L, 2, fname, true, &s);
  lm_checkend(L, 2, fname);
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL, *tmp = NULL;
  moe_status st = MOE_OK;
  if (!b) {
    st = lm_scalar_tensor(S->ctx, a, s, &tmp);
    b = tmp;
  }
  if (st == MOE_OK) LM_CALL(L, st, fn(S->ctx, a, b, &out));
  moe_tensor_release(tmp);
  return lm_result(L, S, r, st, out, fname, 0);
}

static int lm_maximum(lua_State *L) { return lm_select2(L, moe_maximum, "maximum"); }
static int lm_minimum(lua_State *L) { return lm_select2(L, moe_minimum, "minimum"); }

/* where(cond, a, b) with a, b tensors or numbers (not both numbers). */
static int lm_where_at(lua_State *L, int ic, int ia, int ib) {
  lm_state *S = lm_S(L);
  double sa = 0, sb = 0;
  moe_tensor *cond = lm_checktensor(L, ic, "where");
  if (cond->dtype != MOE_BOOL)
    lm_argerror(L, ic, "where", "cond must be a bool tensor, got %s", moe_dtype_name(cond->dtype));
  moe_tensor *a = lm_tensor_or_number(L, ia, "where", true, &sa);
  moe_tensor *b = lm_tensor_or_number(L, ib, "where", a != NULL, &sb);
  lm_checkend(L, 3, "where");
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL, *ta = NULL, *tb = NULL;
  moe_status st = MOE_OK;
  if (!a) {
    st = lm_scalar_tensor(S->ctx, b, sa, &ta);
    a = ta;
  }
  if (!b && st == MOE_OK) {
    st = lm_scalar_tensor(S->ctx, a, sb, &tb);
    b = tb;
  }
  if (st == MOE_OK) LM_CALL(L, st, moe_where(S->ctx, cond, a, b, &out));
  moe_tensor_release(ta);
  moe_tensor_release(tb);
  return lm_result(L, S, r, st, out, "where", 0);
}

static int lm_where(lua_State *L) {
  if (!lm_testtensor(L, 1))
    lm_argerror(L, 1, "where", "cond must be a bool tensor, got %s", lm_typename(L, 1));
  return lm_where_at(L, 1, 2, 3);
}

/* t:where(cond, other) = where(cond, t, other). */
static int lm_t_where(lua_State *L) {
  lm_checktensor(L, 1, "where");
  if (!lm_testtensor(L, 2))
    lm_argerror(L, 2, "where", "cond must be a bool tensor, got %s", lm_typename(L, 2));
  return lm_where_at(L, 2, 1, 3);
}

/* a op b; a number on the left swaps the operands and mirrors the op. */
static int lm_compare(lua_State *L, moe_op op, const char *fname) {
  lm_state *S = lm_S(L);
  double sa = 0, sb = 0;
  moe_tensor *a = lm_tensor_or_number(L, 1, fname, true, &sa);
  moe_tensor *b = lm_tensor_or_number(L, 2, fname, a != NULL, &sb);
  lm_checkend(L, 2, fname);
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  if (a && b) {
    LM_CALL(L, st, moe_compare(S->ctx, op, a, b, &out));
  } else if (a) {
    LM_CALL(L, st, moe_compare_scalar(S->ctx, op, a, sb, &out));
  } else {
    moe_op m = op == MOE_OP_LT ? MOE_OP_GT : op == MOE_OP_GT ? MOE_OP_LT
             : op == MOE_OP_LE ? MOE_OP_GE : op == MOE_OP_GE ? MOE_OP_LE : op;
    LM_CALL(L, st, moe_compare_scalar(S->ctx, m, b, sa, &out));
  }
  return lm_result(L, S, r, st, out, fname, 0);
}

static int lm_eq(lua_State *L) { return lm_compare(L, MOE_OP_EQ, "eq"); }
static int lm_ne(lua_State *L) { return lm_compare(L, MOE_OP_NE, "ne"); }
static int lm_lt(lua_State *L) { return lm_compare(L, MOE_OP_LT, "lt"); }
static int lm_le(lua_State *L) { return lm_compare(L, MOE_OP_LE, "le"); }
static int lm_gt(lua_State *L) { return lm_compare(L, MOE_OP_GT, "gt"); }
static int lm_ge(lua_State *L) { return lm_compare(L, MOE_OP_GE, "ge"); }

static int lm_swiglu(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *gate = lm_checktensor(L, 1, "swiglu");
  moe_tensor *up = lm_checktensor(L, 2, "swiglu");
  lm_checkend(L, 2, "swiglu");
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_swiglu(S->ctx, gate, up, &out));
  return lm_result(L, S, r, st, out, "swiglu", 0);
}

static int lm_dropout(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *x = lm_checktensor(L, 1, "dropout");
  double p = lm_optnum(L, 2, "dropout", "p", 0.5);
  if (!(p >= 0.0 && p <= 1.0)) lm_argerror(L, 2, "dropout", "p must be in [0, 1], got %f", p);
  bool training = true;
  if (!lua_isnoneornil(L, 3)) {
    if (lua_type(L, 3) != LUA_TBOOLEAN)
      lm_argerror(L, 3, "dropout", "training must be a boolean, got %s", lm_typename(L, 3));
    training = lua_toboolean(L, 3);
  }
  lm_checkend(L, 3, "dropout");
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_dropout(S->ctx, x, p, training, &out));
  return lm_result(L, S, r, st, out, "dropout", 0);
}

static const luaL_Reg lm_pointwise_functions[] = {
    {"exp", lm_exp},         {"log", lm_log},           {"sqrt", lm_sqrt},
    {"rsqrt", lm_rsqrt},     {"abs", lm_abs},           {"relu", lm_relu},
    {"gelu", lm_gelu},       {"gelu_tanh", lm_gelu_tanh}, {"silu", lm_silu},
    {"sigmoid", lm_sigmoid}, {"tanh", lm_tanh},         {"pow", lm_pow},
    {"clamp", lm_clamp},     {"maximum", lm_maximum},   {"minimum", lm_minimum},
    {"where", lm_where},     {"eq", lm_eq},             {"ne", lm_ne},
    {"lt", lm_lt},           {"le", lm_le},             {"gt", lm_gt},
    {"ge", lm_ge},           {"swiglu", lm_swiglu},     {"dropout", lm_dropout},
    {NULL, NULL}};

static const luaL_Reg lm_pointwise_methods[] = {
    {"exp", lm_exp},         {"log", lm_log},           {"sqrt", lm_sqrt},
    {"rsqrt", lm_rsqrt},     {"abs", lm_abs},           {"relu", lm_relu},
    {"gelu", lm_gelu},       {"gelu_tanh", lm_gelu_tanh}, {"silu", lm_silu},
    {"sigmoid", lm_sigmoid}, {"tanh", lm_tanh},         {"pow", lm_pow},
    {"clamp", lm_clamp},     {"maximum", lm_maximum},   {"minimum", lm_minimum},
    {"where", lm_t_where},   {"eq", lm_eq},             {"ne", lm_ne},
    {"lt", lm_lt},           {"le", lm_le},             {"gt", lm_gt},
    {"ge", lm_ge},           {"swiglu", lm_swiglu},     {"dropout", lm_dropout},
    {NULL, NULL}};

void lm_open_pointwise(lua_State *L, int mod, int methods, int sentinel) {
  lm_register(L, mod, methods, sentinel, lm_pointwise_functions, lm_pointwise_methods);
  /* t ^ x and x ^ t: the metamethod lives in the tensor metatable */
  sentinel = lua_absindex(L, sentinel);
  luaL_getmetatable(L, LM_TENSOR);
  lua_pushvalue(L, sentinel);
  lua_pushcclosure(L, lm_pow, 1);
  lua_setfield(L, -2, "__pow");
  lua_pop(L, 1);
}
