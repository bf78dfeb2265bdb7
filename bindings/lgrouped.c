/*
 * lgrouped.c - Lua bindings of the grouped GEMM family (core/moe_grouped.h)
 * under the `moe.ops` sub-table:
 *
 *   local y  = moe.ops.grouped_mm(x, w, offsets, {trans_w = false})
 *   local dw = moe.ops.grouped_mm_wgrad(a, b, offsets, {trans_out = false})
 *   moe.ops.grouped_backend([name]) -> the current CUDA backend (sets it first
 *                                      when name is given)
 *   moe.ops.grouped_backends()      -> {"auto", "loop", "cublas_grouped", "streams", "wgmma"}
 *   moe.ops.grouped_on_device(device, dtype, groups, K, N)
 *                                   -> whether those products run on moe-lua's own
 *                                      kernel with the offsets on the device
 *
 * offsets is one of: a routing plan (its row offsets of the local experts,
 * G = expert_end - expert_begin), a Lua sequence of G + 1 integers, or an
 * i64 tensor of G + 1 values. A CUDA tensor, or a CUDA plan whose products
 * moe_grouped_offsets_on_device runs, goes to the device-offset functions
 * (moe_grouped_mm_dev: no host copy); otherwise the offsets come to the host
 * (the plan's one counts copy is made here when it has not happened yet)
 * into a scratch box on the Lua stack (freed by the collector even when an
 * error unwinds).
 * Registered by luaopen_moe through lm_open_grouped.
 */
#include <stdlib.h>
#include <string.h>

#include "lmoe_internal.h"
#include "moe_grouped.h"
#include "moe_routing.h"

/* Reads the offsets argument at `arg`; sets *offs (valid while the pushed
 * scratch box or the plan lives) and *groups. Pushes one value (the box, or
 * nil for a plan). Raises on a bad argument. */
static void lm_gg_offsets(lua_State *L, lm_state *S, int arg, const char *fname,
                          const int64_t **offs, int64_t *groups) {
  moe_routing_plan *p = lm_toplan(L, arg, fname);
  if (p) {
    if (!p->row_offsets_host && moe_routing_plan_counts_to_host(S->ctx, p) != MOE_OK)
      lm_corefail(L, S, fname, arg);
    *offs = p->row_offsets_host + p->e0;
    *groups = p->e1 - p->e0;
    lua_pushnil(L);
    return;
  }
  void **box = NULL;
  int64_t n = 0;
  lm_tensor *t = lm_testtensor(L, arg);
  if (t) {
    if (!t->t) lm_argerror(L, arg, fname, "attempt to use a freed tensor");
    moe_tensor *o = t->t;
    if (o->dtype != MOE_I64 || o->ndim != 1 || moe_tensor_device(o).type != MOE_DEVICE_CPU) {
      lm_argerror(L, arg, fname, "offsets tensor must be a 1-D i64 CPU tensor (G + 1), got %s %s",
                  moe_dtype_name(o->dtype), MOE_SHAPE(o));
    }
    n = o->shape[0];
    if (n < 2) lm_argerror(L, arg, fname, "offsets must hold G + 1 >= 2 values, got %d", (int)n);
    box = lm_push_scratch(L);
    *box = malloc(sizeof(int64_t) * (size_t)n);
    if (!*box) luaL_error(L, "%s: out of memory", fname);
    if (moe_tensor_to_i64(S->ctx, o, (int64_t *)*box) != MOE_OK) lm_corefail(L, S, fname, arg);
  } else if (lua_type(L, arg) == LUA_TTABLE) {
    n = (int64_t)lua_rawlen(L, arg);
    if (n < 2) lm_argerror(L, arg, fname, "offsets must hold G + 1 >= 2 values, got %d", (int)n);
    box = lm_push_scratch(L);
    *box = malloc(sizeof(int64_t) * (size_t)n);
    if (!*box) luaL_error(L, "%s: out of memory", fname);
    for (int64_t i = 0; i < n; i++) {
      lua_rawgeti(L, arg, (lua_Integer)(i + 1));
      if (!lua_isinteger(L, -1))
        lm_argerror(L, arg, fname, "offsets[%d] must be an integer, got %s", (int)(i + 1),
                    lm_describe(L, -1));
      ((int64_t *)*box)[i] = (int64_t)lua_tointeger(L, -1);
      lua_pop(L, 1);
    }
  } else {
    lm_argerror(L, arg, fname,
                "offsets expected (a routing plan, a list of G + 1 integers or an i64 tensor), got %s",
                lm_typename(L, arg));
  }
  *offs = (const int64_t *)*box;
  *groups = n - 1;
}

/* Whether the offsets at arg go to the device-offset functions without a
 * host copy: a CUDA i64 tensor (always), or a CUDA plan whose products of
 * depth K and N columns run on the device. */
static bool lm_gg_on_device(lua_State *L, lm_state *S, int arg, const char *fname,
                            const moe_tensor *x, int64_t K, int64_t N) {
  moe_routing_plan *p = lm_toplan(L, arg, fname);
  if (p)
    return p->device.type == MOE_DEVICE_CUDA && p->row_offsets &&
           moe_grouped_offsets_on_device(S->ctx, p->device, x->dtype, p->e1 - p->e0, K, N);
  lm_tensor *t = lm_testtensor(L, arg);
  return t && t->t && moe_tensor_device(t->t).type != MOE_DEVICE_CPU;
}

/* Those offsets as a tensor (a new reference; the plan's local slice of its
 * row offsets), or NULL with the context's error set. */
static moe_tensor *lm_gg_dev_offsets(lua_State *L, lm_state *S, int arg, const char *fname) {
  moe_routing_plan *p = lm_toplan(L, arg, fname);
  moe_tensor *o = NULL;
  if (p) {
    if (moe_narrow(S->ctx, p->row_offsets, 0, p->e0, p->e1 - p->e0 + 1, &o) != MOE_OK) return NULL;
    return o;
  }
  o = lm_testtensor(L, arg)->t;
  moe_tensor_retain(o);
  return o;
}

/* The boolean option `key` of the options table at arg (the only one allowed). */
static bool lm_gg_flag(lua_State *L, int arg, const char *fname, const char *key) {
  if (lua_isnoneornil(L, arg)) return false;
  if (lua_type(L, arg) != LUA_TTABLE)
    lm_argerror(L, arg, fname, "options table expected, got %s", lm_typename(L, arg));
  const char *const known[] = {key, NULL};
  lm_checkkeys(L, arg, fname, known);
  return lm_field_bool(L, arg, fname, key, false);
}

/* moe.ops.grouped_mm(x, w, offsets [, {trans_w = false}]) */
static int lm_grouped_mm(lua_State *L) {
  const char *fname = "grouped_mm";
  lm_state *S = lm_S(L);
  moe_tensor *x = lm_checktensor(L, 1, fname);
  moe_tensor *w = lm_checktensor(L, 2, fname);
  bool trans_w = lm_gg_flag(L, 4, fname, "trans_w");
  lm_checkend(L, 4, fname);
  bool on_dev = x->ndim == 2 && w->ndim == 3 &&
                lm_gg_on_device(L, S, 3, fname, x, x->shape[1], trans_w ? w->shape[1] : w->shape[2]);
  const int64_t *offs = NULL;
  int64_t groups = 0;
  if (!on_dev) lm_gg_offsets(L, S, 3, fname, &offs, &groups);
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  if (on_dev) {
    moe_tensor *dev = lm_gg_dev_offsets(L, S, 3, fname);
    st = dev ? MOE_OK : MOE_ERR_INVALID_ARG;
    if (dev) LM_CALL(L, st, moe_grouped_mm_dev(S->ctx, x, w, dev, trans_w, &out));
    moe_tensor_release(dev);
  } else {
    LM_CALL(L, st, moe_grouped_mm(S->ctx, x, w, offs, groups, trans_w, &out));
  }
  return lm_result(L, S, r, st, out, fname, 0);
}

/* moe.ops.grouped_mm_wgrad(a, b, offsets [, {trans_out = false}]) */
static int lm_grouped_mm_wgrad(lua_State *L) {
  const char *fname = "grouped_mm_wgrad";
  lm_state *S = lm_S(L);
  moe_tensor *a = lm_checktensor(L, 1, fname);
  moe_tensor *b = lm_checktensor(L, 2, fname);
  bool trans_out = lm_gg_flag(L, 4, fname, "trans_out");
  lm_checkend(L, 4, fname);
  bool on_dev = a->ndim == 2 && b->ndim == 2 &&
                lm_gg_on_device(L, S, 3, fname, a, a->shape[1], b->shape[1]);
  const int64_t *offs = NULL;
  int64_t groups = 0;
  if (!on_dev) lm_gg_offsets(L, S, 3, fname, &offs, &groups);
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  if (on_dev) {
    moe_tensor *dev = lm_gg_dev_offsets(L, S, 3, fname);
    st = dev ? MOE_OK : MOE_ERR_INVALID_ARG;
    if (dev) LM_CALL(L, st, moe_grouped_mm_wgrad_dev(S->ctx, a, b, dev, trans_out, &out));
    moe_tensor_release(dev);
  } else {
    LM_CALL(L, st, moe_grouped_mm_wgrad(S->ctx, a, b, offs, groups, trans_out, &out));
  }
  return lm_result(L, S, r, st, out, fname, 0);
}

/* moe.ops.grouped_backend([name]) -> the current backend's name */
static int lm_grouped_backend(lua_State *L) {
  const char *fname = "grouped_backend";
  lm_state *S = lm_S(L);
  if (!lua_isnoneornil(L, 1)) {
    if (lua_type(L, 1) != LUA_TSTRING)
      lm_argerror(L, 1, fname, "backend name expected (one of %s), got %s",
                  moe_grouped_backends(), lm_typename(L, 1));
    lm_checkend(L, 1, fname);
    if (moe_grouped_set_backend(S->ctx, lua_tostring(L, 1)) != MOE_OK)
      lm_argerror(L, 1, fname, "unknown backend \"%s\" (valid: %s)", lua_tostring(L, 1),
                  moe_grouped_backends());
  }
  lua_pushstring(L, moe_grouped_backend(S->ctx));
  return 1;
}

/* moe.ops.grouped_backends() -> list of names, "auto" first */
static int lm_grouped_backends(lua_State *L) {
  lm_checkend(L, 0, "grouped_backends");
  const char *s = moe_grouped_backends();
  lua_newtable(L);
  int i = 0;
  while (*s) {
    const char *e = strchr(s, ',');
    size_t len = e ? (size_t)(e - s) : strlen(s);
    lua_pushlstring(L, s, len);
    lua_rawseti(L, -2, ++i);
    s += len + (e ? 1 : 0);
  }
  return 1;
}

/* moe.ops.grouped_on_device(device, dtype, groups, K, N) -> boolean:
 * moe_grouped_offsets_on_device (bf16 on compute capability 9.x with the
 * grouped backend auto or wgmma, K and N multiples of 8). */
static int lm_grouped_on_device(lua_State *L) {
  const char *fname = "grouped_on_device";
  lm_state *S = lm_S(L);
  moe_device d = lm_checkdevice_at(L, S, 1, 1, fname);
  moe_dtype dt = lm_checkdtype_at(L, 2, 2, fname);
  int64_t G = lm_checkint(L, 3, fname, "groups"), K = lm_checkint(L, 4, fname, "K"),
          N = lm_checkint(L, 5, fname, "N");
  lm_checkend(L, 5, fname);
  lua_pushboolean(L, moe_grouped_offsets_on_device(S->ctx, d, dt, G, K, N));
  return 1;
}

static const luaL_Reg lm_grouped_functions[] = {{"grouped_mm", lm_grouped_mm},
                                                {"grouped_mm_wgrad", lm_grouped_mm_wgrad},
                                                {"grouped_backend", lm_grouped_backend},
                                                {"grouped_backends", lm_grouped_backends},
                                                {"grouped_on_device", lm_grouped_on_device},
                                                {NULL, NULL}};

void lm_open_grouped(lua_State *L, int ops, int methods, int sentinel) {
  lm_register(L, ops, methods, sentinel, lm_grouped_functions, NULL);
}
