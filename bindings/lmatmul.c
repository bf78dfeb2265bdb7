/*
 * lmatmul.c - Lua bindings of matmul, bmm, linear (core/moe_matmul.h):
 *   moe.matmul(a, b)        a:matmul(b)
 *   moe.bmm(a, b)           a:bmm(b)
 *   moe.linear(x, W, bias?) x:linear(W, bias?)
 *   moe.set_matmul_tf32(on) -> previous setting; moe.matmul_tf32() -> current
 * A core error (shapes, dtypes, devices) is raised as a bad argument, the
 * one the core's message names: #1 for the first operand or the input alone,
 * #3 for the bias, #2 otherwise (the second operand, the weight, shapes that
 * do not fit together).
 * Registered by luaopen_moe through lm_open_matmul (see lmoe_internal.h).
 */
#include <string.h>

#include "lmoe_internal.h"

/* The argument a failed call's message points at (see the header). */
static int lm_mm_culprit(lm_state *S, bool linear) {
  const char *msg = moe_ctx_error(S->ctx);
  if (linear) {
    if (strstr(msg, "bias")) return 3;
    if (strstr(msg, "weight")) return 2;
    return strstr(msg, "input") ? 1 : 2;
  }
  if (strstr(msg, "second operand")) return 2;
  return strstr(msg, "first operand") ? 1 : 2;
}

/* The optional bias at arg: NULL for none or nil. */
static moe_tensor *lm_optbias(lua_State *L, int arg, const char *fname) {
  if (lua_isnoneornil(L, arg)) return NULL;
  return lm_checktensor(L, arg, fname);
}

static int lm_binary_product(lua_State *L, const char *fname,
                             moe_status (*fn)(moe_ctx *, moe_tensor *, moe_tensor *,
                                              moe_tensor **)) {
  lm_state *S = lm_S(L);
  moe_tensor *a = lm_checktensor(L, 1, fname);
  moe_tensor *b = lm_checktensor(L, 2, fname);
  lm_checkend(L, 2, fname);
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, fn(S->ctx, a, b, &out));
  return lm_result(L, S, r, st, out, fname, st == MOE_OK ? 0 : lm_mm_culprit(S, false));
}

static int lm_matmul(lua_State *L) { return lm_binary_product(L, "matmul", moe_matmul); }
static int lm_bmm(lua_State *L) { return lm_binary_product(L, "bmm", moe_bmm); }

static int lm_linear(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *x = lm_checktensor(L, 1, "linear");
  moe_tensor *w = lm_checktensor(L, 2, "linear");
  moe_tensor *bias = lm_optbias(L, 3, "linear");
  lm_checkend(L, 3, "linear");
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_linear(S->ctx, x, w, bias, &out));
  return lm_result(L, S, r, st, out, "linear", st == MOE_OK ? 0 : lm_mm_culprit(S, true));
}

static int lm_set_matmul_tf32(lua_State *L) {
  if (!lua_isboolean(L, 1))
    return lm_argerror(L, 1, "set_matmul_tf32", "boolean expected, got %s", lm_typename(L, 1));
  lm_checkend(L, 1, "set_matmul_tf32");
  lua_pushboolean(L, moe_matmul_set_tf32(lua_toboolean(L, 1)));
  return 1;
}

static int lm_matmul_tf32(lua_State *L) {
  lm_checkend(L, 0, "matmul_tf32");
  lua_pushboolean(L, moe_matmul_tf32());
  return 1;
}

static const luaL_Reg lm_matmul_functions[] = {{"matmul", lm_matmul},
                                               {"bmm", lm_bmm},
                                               {"linear", lm_linear},
                                               {"set_matmul_tf32", lm_set_matmul_tf32},
                                               {"matmul_tf32", lm_matmul_tf32},
                                               {NULL, NULL}};
static const luaL_Reg lm_matmul_methods[] = {
    {"matmul", lm_matmul}, {"bmm", lm_bmm}, {"linear", lm_linear}, {NULL, NULL}};

void lm_open_matmul(lua_State *L, int mod, int methods, int sentinel) {
  lm_register(L, mod, methods, sentinel, lm_matmul_functions, lm_matmul_methods);
}
