/*
 * lautograd.c - Lua bindings of autograd: t:backward, t:requires_grad_,
 * t:detach, moe.zero_grad, grad mode (moe.no_grad, moe.enable_grad,
 * moe.is_grad_enabled, moe.set_grad_enabled), differentiable functions
 * written in Lua (moe.Function) and saved-tensor hooks set from Lua
 * (moe.saved_tensor_hooks). Registered by luaopen_moe through
 * lm_open_autograd (see lmoe_internal.h).
 *
 * Lua called from the core (a Function's backward, the pack and unpack
 * hooks, and the release of packed values) runs on a helper thread anchored
 * in the registry, always under lua_pcall: a Lua error becomes a moe_status
 * with its message and never longjmps through the core. What those
 * callbacks create is freed deterministically:
 *   - the handles on saved tensors and output gradients given to a
 *     Function's backward are freed when it returns;
 *   - the tensor given to pack is freed when pack returns, unless pack
 *     returns it (alone or in a table); the tensors in a packed value
 *     (alone or one level inside a table) are freed with the graph;
 *   - the handle unpack returns is freed once its tensor is taken, unless
 *     it is part of the packed value.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lmoe_internal.h"

#define LM_AG_THREAD "moe.autograd.thread" /* registry: the helper thread */
#define LM_FNCTX "moe.FunctionCtx"         /* metatable of a Function's ctx table */
#define LM_FNBOX "moe.FunctionBox"         /* metatable of the ctx's node box */
#define LM_FN_MAX_ARGS 16                  /* arguments of a Function call */

static char lm_box_key; /* its address keys the node box in a ctx table */

/* The helper thread of this Lua state, created on first use. */
static lua_State *lm_ag_thread(lua_State *L) {
  lua_State *T;
  if (lua_getfield(L, LUA_REGISTRYINDEX, LM_AG_THREAD) == LUA_TTHREAD) {
    T = lua_tothread(L, -1);
  } else {
    lua_pop(L, 1);
    T = lua_newthread(L);
    lua_pushvalue(L, -1);
    lua_setfield(L, LUA_REGISTRYINDEX, LM_AG_THREAD);
  }
  lua_pop(L, 1);
  return T;
}

/* Runs body(arg) on T under lua_pcall; a Lua error becomes a core error
 * "<what>: <message>". T's stack is left as found. */
static moe_status lm_protected(moe_ctx *ctx, lua_State *T, lua_CFunction body, void *arg,
                               const char *what) {
  int top = lua_gettop(T);
  if (!lua_checkstack(T, 4))
    return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: Lua stack overflow", what);
  lua_pushcfunction(T, body);
  lua_pushlightuserdata(T, arg);
  moe_status st = MOE_OK;
  if (lua_pcall(T, 1, 0, 0) != LUA_OK) {
    const char *msg = lua_tostring(T, -1);
    st = moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: %s", what,
                   msg ? msg : "(an error object that is not a string)");
  }
  lua_settop(T, top);
  return st;
}

/* Pushes a new handle on t (retained); nil for NULL. */
static void lm_push_tensor(lua_State *L, lm_state *S, moe_tensor *t) {
  if (!t) {
    lua_pushnil(L);
    return;
  }
  lm_tensor *r = lm_push_empty(L);
  moe_tensor_retain(t);
  lm_adopt(r, S, t);
}

/* Frees the handle at idx if it is a tensor handle. */
static void lm_free_if_tensor(lua_State *L, int idx) {
  lm_tensor *u = lm_testtensor(L, idx);
  if (u) lm_release(u);
}

/* Whether the value at v is the value at p or one of the values of the
 * table at p (one level). */
static bool lm_part_of(lua_State *L, int v, int p) {
  v = lua_absindex(L, v);
  p = lua_absindex(L, p);
  if (lua_rawequal(L, v, p)) return true;
  if (lua_type(L, p) != LUA_TTABLE || !lua_checkstack(L, 3)) return false;
  lua_pushnil(L);
  while (lua_next(L, p)) {
    bool same = lua_rawequal(L, -1, v);
    lua_pop(L, 1);
    if (same) {
      lua_pop(L, 1);
      return true;
    }
  }
  return false;
}

/* ------------------------------------------------------------ backward */

/* t:backward([grad] [, {retain_graph = bool}]) */
static int lm_t_backward(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, "backward");
  moe_tensor *g = NULL;
  int optarg = 2;
  if (lm_testtensor(L, 2)) {
    g = lm_checktensor(L, 2, "backward");
    optarg = 3;
  } else if (lua_isnil(L, 2) && !lua_isnone(L, 3)) {
    optarg = 3;
  } else if (!lua_isnoneornil(L, 2) && lua_type(L, 2) != LUA_TTABLE) {
    lm_argerror(L, 2, "backward", "gradient tensor or options table expected, got %s",
                lm_typename(L, 2));
  }
  bool retain = false;
  if (!lua_isnoneornil(L, optarg)) {
    if (lua_type(L, optarg) != LUA_TTABLE)
      lm_argerror(L, optarg, "backward", "options table expected ({retain_graph}), got %s",
                  lm_typename(L, optarg));
    lua_pushnil(L);
    while (lua_next(L, optarg)) {
      const char *k = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : NULL;
      if (!k || strcmp(k, "retain_graph") != 0)
        lm_argerror(L, optarg, "backward", "unknown option '%s' (valid options: retain_graph)",
                    k ? k : luaL_typename(L, -2));
      if (lua_type(L, -1) != LUA_TBOOLEAN)
        lm_argerror(L, optarg, "backward", "retain_graph must be a boolean, got %s",
                    lm_typename(L, -1));
      retain = lua_toboolean(L, -1);
      lua_pop(L, 1);
    }
  }
  lm_checkend(L, optarg, "backward");
  /* not LM_CALL: a retry after a partial backward would accumulate twice */
  if (moe_backward(S->ctx, t, g, retain) != MOE_OK) return lm_corefail(L, S, "backward", 0);
  return 0;
}

/* t:requires_grad_([bool]) -> t */
static int lm_t_requires_grad_(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, "requires_grad_");
  bool on = true;
  if (!lua_isnoneornil(L, 2)) {
    if (lua_type(L, 2) != LUA_TBOOLEAN)
      lm_argerror(L, 2, "requires_grad_", "boolean expected, got %s", lm_typename(L, 2));
    on = lua_toboolean(L, 2);
  }
  lm_checkend(L, 2, "requires_grad_");
  if (moe_set_requires_grad(S->ctx, t, on) != MOE_OK)
    return lm_corefail(L, S, "requires_grad_", 0);
  lua_settop(L, 1);
  return 1;
}

/* t:detach(): a new tensor over the same storage with no grad history. */
static int lm_t_detach(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_tensor *t = lm_checktensor(L, 1, "detach");
  lm_checkend(L, 1, "detach");
  lm_tensor *r = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st = moe_detach(S->ctx, t, &out);
  return lm_result(L, S, r, st, out, "detach", 0);
}

/* moe.zero_grad(tensors): sets .grad of each tensor of the list to nil. */
static int lm_zero_grad(lua_State *L) {
  lm_state *S = lm_S(L);
  if (lua_type(L, 1) != LUA_TTABLE)
    lm_argerror(L, 1, "zero_grad", "list of tensors expected, got %s", lm_typename(L, 1));
  lm_checkend(L, 1, "zero_grad");
  lua_Integer n = (lua_Integer)lua_rawlen(L, 1);
  for (lua_Integer i = 1; i <= n; i++) { /* check all before changing any */
    lua_rawgeti(L, 1, i);
    lm_tensor *u = lm_testtensor(L, -1);
    if (!u || !u->t)
      lm_argerror(L, 1, "zero_grad", "entry %I is %s, not a tensor", (LUAI_UACINT)i,
                  u ? "a freed tensor" : lm_typename(L, -1));
    lua_pop(L, 1);
  }
  for (lua_Integer i = 1; i <= n; i++) {
    lua_rawgeti(L, 1, i);
    moe_tensor_set_grad(S->ctx, lm_testtensor(L, -1)->t, NULL); /* clearing cannot fail */
    lua_pop(L, 1);
  }
  return 0;
}

/* ----------------------------------------------------------- grad mode */

/* Runs fn(...) (at 1, 2...) with grad mode `mode`, restoring the previous
 * mode even when fn raises; returns fn's results. */
static int lm_grad_scope(lua_State *L, bool mode, const char *fname) {
  lm_state *S = lm_S(L);
  if (lua_type(L, 1) != LUA_TFUNCTION)
    lm_argerror(L, 1, fname, "function expected, got %s", lm_typename(L, 1));
  bool prev = moe_grad_set(S->ctx, mode);
  int st = lua_pcall(L, lua_gettop(L) - 1, LUA_MULTRET, 0);
  moe_grad_set(S->ctx, prev);
  if (st != LUA_OK) return lua_error(L);
  return lua_gettop(L);
}

static int lm_no_grad(lua_State *L) { return lm_grad_scope(L, false, "no_grad"); }
static int lm_enable_grad(lua_State *L) { return lm_grad_scope(L, true, "enable_grad"); }

static int lm_is_grad_enabled(lua_State *L) {
  lm_state *S = lm_S(L);
  lm_checkend(L, 0, "is_grad_enabled");
  lua_pushboolean(L, moe_grad_enabled(S->ctx));
  return 1;
}

/* moe.set_grad_enabled(bool) -> the previous mode */
static int lm_set_grad_enabled(lua_State *L) {
  lm_state *S = lm_S(L);
  if (lua_type(L, 1) != LUA_TBOOLEAN)
    lm_argerror(L, 1, "set_grad_enabled", "boolean expected, got %s", lm_typename(L, 1));
  lm_checkend(L, 1, "set_grad_enabled");
  lua_pushboolean(L, moe_grad_set(S->ctx, lua_toboolean(L, 1)));
  return 1;
}

/* ------------------------------------------------- Lua-defined functions */
/*
 * f = moe.Function{name = "mysquare", forward = function(ctx, ...) ... end,
 *                  backward = function(ctx, g1, ...) ... end}
 * y = f(x, ...)
 *
 * forward runs with grad mode off and returns tensors (and other values);
 * every floating-point tensor it returns is an output of the function's
 * node. Inside forward, ctx:save_for_backward(t1, t2, ...) saves tensors
 * (nil allowed) through the saved-tensor hooks; other values may be stored
 * as fields of ctx (store tensors only through save_for_backward: a tensor
 * in a field keeps the graph alive). ctx.needs_input_grad[i] tells whether
 * argument i needs a gradient.
 *
 * backward(ctx, g1, ..., gk) gets one gradient per output (nil where none
 * flowed) and ctx.saved_tensors (a list with n = its length); it returns one
 * value per argument of forward: the gradient of a tensor argument (or nil
 * for zero), anything for the others. Handles given to backward are freed
 * when it returns.
 */

typedef struct lm_fn {
  lua_State *T;    /* the helper thread that runs backward */
  lm_state *S;     /* for handles */
  int ref_spec;    /* registry: the spec table (forward, backward, name) */
  int ref_ctx;     /* registry: the ctx table of this call */
  int n_args;      /* arguments forward received after ctx */
  int input_of_arg[LM_FN_MAX_ARGS]; /* node input of each argument, -1: not a tensor */
  char name[64];
} lm_fn;

/* The node box: the node while forward runs (one reference), else NULL. */
typedef struct lm_fnbox {
  moe_node *node;
  bool in_forward;
} lm_fnbox;

static void lm_fn_free(void *user) {
  lm_fn *f = (lm_fn *)user;
  luaL_unref(f->T, LUA_REGISTRYINDEX, f->ref_spec);
  luaL_unref(f->T, LUA_REGISTRYINDEX, f->ref_ctx);
  free(f);
}

static int lm_fnbox_gc(lua_State *L) {
  lm_fnbox *b = (lm_fnbox *)luaL_checkudata(L, 1, LM_FNBOX);
  moe_node *n = b->node;
  b->node = NULL;
  moe_node_release(n);
  return 0;
}

static lm_fnbox *lm_fnbox_of(lua_State *L, int ctxtab) {
  lua_rawgetp(L, ctxtab, &lm_box_key);
  lm_fnbox *b = (lm_fnbox *)luaL_testudata(L, -1, LM_FNBOX);
  lua_pop(L, 1); /* the ctx table holds the box */
  return b;
}

/* ctx:save_for_backward(t1, t2, ...) */
static int lm_fnctx_save(lua_State *L) {
  lm_state *S = lm_S(L);
  lm_fnbox *b = lua_type(L, 1) == LUA_TTABLE ? lm_fnbox_of(L, 1) : NULL;
  if (!b) lm_argerror(L, 1, "save_for_backward", "a Function's ctx expected (call ctx:save_for_backward)");
  if (!b->in_forward)
    return luaL_error(L, "save_for_backward: may be called only inside a Function's forward");
  int n = lua_gettop(L);
  for (int i = 2; i <= n; i++)
    if (!lua_isnil(L, i)) lm_checktensor(L, i, "save_for_backward");
  if (!b->node) return 0; /* no graph is being recorded */
  if (b->node->n_saved + n - 1 > MOE_NODE_MAX_SAVED)
    return luaL_error(L, "save_for_backward: at most %d tensors can be saved", MOE_NODE_MAX_SAVED);
  for (int i = 2; i <= n; i++) {
    moe_tensor *t = lua_isnil(L, i) ? NULL : lm_testtensor(L, i)->t;
    if (moe_node_save(S->ctx, b->node, t) != MOE_OK) return lm_corefail(L, S, "save_for_backward", i);
  }
  return 0;
}

/* What the backward trampoline hands its protected body. */
typedef struct lm_fn_call {
  moe_node *node;
  moe_tensor *const *gout;
  moe_tensor **gin;
} lm_fn_call;

static int lm_fn_backward_body(lua_State *T) {
  lm_fn_call *c = (lm_fn_call *)lua_touserdata(T, 1);
  moe_node *n = c->node;
  lm_fn *f = (lm_fn *)n->user;
  lm_state *S = f->S;
  luaL_checkstack(T, 8 + n->n_outputs + n->n_saved, "backward");
  lua_rawgeti(T, LUA_REGISTRYINDEX, f->ref_ctx);
  int ctxtab = lua_gettop(T);
  /* ctx.saved_tensors: handles, freed below */
  lua_createtable(T, n->n_saved, 1);
  int saved = lua_gettop(T);
  for (int i = 0; i < n->n_saved; i++) {
    moe_tensor *t = NULL;
    lm_tensor *r = lm_push_empty(T);
    if (moe_node_saved(S->ctx, n, i, &t) != MOE_OK)
      return luaL_error(T, "%s", moe_ctx_error(S->ctx));
    if (t) lm_adopt(r, S, t);
    lua_rawseti(T, saved, i + 1); /* an empty handle for nil: skipped */
    if (!t) {
      lua_pushnil(T);
      lua_rawseti(T, saved, i + 1);
    }
  }
  lua_pushinteger(T, n->n_saved);
  lua_setfield(T, saved, "n");
  lua_pushvalue(T, saved);
  lua_setfield(T, ctxtab, "saved_tensors");
  /* the gradient handles stay below the call, to be freed after it */
  int gfirst = lua_gettop(T) + 1;
  for (int k = 0; k < n->n_outputs; k++) lm_push_tensor(T, S, c->gout[k]);
  /* backward(ctx, g1, ..., gk) */
  lua_rawgeti(T, LUA_REGISTRYINDEX, f->ref_spec);
  lua_getfield(T, -1, "backward");
  lua_remove(T, -2);
  lua_pushvalue(T, ctxtab);
  for (int k = 0; k < n->n_outputs; k++) lua_pushvalue(T, gfirst + k);
  lua_call(T, 1 + n->n_outputs, LUA_MULTRET);
  int rfirst = gfirst + n->n_outputs, nres = lua_gettop(T) - rfirst + 1;
  if (nres > f->n_args)
    return luaL_error(T, "returned %d values for %d arguments of forward", nres, f->n_args);
  for (int a = 0; a < nres; a++) {
    int in = f->input_of_arg[a], idx = rfirst + a;
    if (in < 0 || lua_isnil(T, idx)) continue;
    lm_tensor *u = lm_testtensor(T, idx);
    if (!u || !u->t)
      return luaL_error(T, "value %d (the gradient of argument %d) is %s, not a tensor or nil", a + 1,
                        a + 1, u ? "a freed tensor" : lm_typename(T, idx));
    if (!moe_node_needs_grad(n, in) || c->gin[in]) continue;
    moe_tensor_retain(u->t);
    c->gin[in] = u->t;
  }
  /* free what was made for this call */
  for (int k = 0; k < n->n_outputs; k++) lm_free_if_tensor(T, gfirst + k);
  for (int i = 1; i <= n->n_saved; i++) {
    lua_rawgeti(T, saved, i);
    lm_free_if_tensor(T, -1);
    lua_pop(T, 1);
  }
  lua_pushnil(T);
  lua_setfield(T, ctxtab, "saved_tensors");
  return 0;
}

static moe_status lm_fn_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                 moe_tensor **gin) {
  lm_fn *f = (lm_fn *)n->user;
  lm_fn_call c = {n, gout, gin};
  char what[96];
  snprintf(what, sizeof what, "backward of %s", f->name);
  return lm_protected(ctx, f->T, lm_fn_backward_body, &c, what);
}

/* Drops the node of a failed call and raises the error at the top. */
static int lm_fn_fail(lua_State *L, lm_fnbox *box) {
  moe_node *n = box->node;
  box->node = NULL;
  moe_node_release(n);
  return lua_error(L);
}

/* f(...): the call of a Function (upvalue 2: its spec table). */
static int lm_fn_apply(lua_State *L) {
  lm_state *S = lm_S(L);
  int nargs = lua_gettop(L);
  lua_getfield(L, lua_upvalueindex(2), "name");
  const char *name = lua_tostring(L, -1);
  char fname[64];
  snprintf(fname, sizeof fname, "%s", name ? name : "Function");
  lua_pop(L, 1);
  if (nargs > LM_FN_MAX_ARGS)
    lm_argerror(L, LM_FN_MAX_ARGS + 1, fname, "a Function takes at most %d arguments",
                LM_FN_MAX_ARGS);
  moe_tensor *inputs[LM_FN_MAX_ARGS];
  int input_of_arg[LM_FN_MAX_ARGS], ninputs = 0;
  for (int a = 1; a <= nargs; a++) {
    lm_tensor *u = lm_testtensor(L, a);
    input_of_arg[a - 1] = -1;
    if (!u) continue;
    if (!u->t) lm_argerror(L, a, fname, "attempt to use a freed tensor");
    input_of_arg[a - 1] = ninputs;
    inputs[ninputs++] = u->t;
  }
  bool record = moe_grad_wanted(S->ctx, ninputs, (const moe_tensor *const *)inputs);
  if (record && ninputs > MOE_NODE_MAX_INPUTS)
    lm_argerror(L, 1, fname, "a Function that records a graph takes at most %d tensors, got %d",
                MOE_NODE_MAX_INPUTS, ninputs);

  /* the ctx table and its node box, made before anything is owned */
  lua_createtable(L, 0, 4);
  int ctxtab = lua_gettop(L);
  luaL_setmetatable(L, LM_FNCTX);
  lm_fnbox *box = (lm_fnbox *)lua_newuserdatauv(L, sizeof *box, 0);
  box->node = NULL;
  box->in_forward = false;
  luaL_setmetatable(L, LM_FNBOX);
  lua_rawsetp(L, ctxtab, &lm_box_key);
  lua_createtable(L, nargs, 0);
  for (int a = 0; a < nargs; a++) {
    int in = input_of_arg[a];
    lua_pushboolean(L, in >= 0 && moe_requires_grad(inputs[in]) && record);
    lua_rawseti(L, -2, a + 1);
  }
  lua_setfield(L, ctxtab, "needs_input_grad");
  lm_fn *f = NULL;
  if (record) {
    /* the payload first (freed by the box until the node owns it) */
    void **scratch = lm_push_scratch(L);
    f = (lm_fn *)calloc(1, sizeof *f);
    if (!f) return luaL_error(L, "%s: out of host memory", fname);
    *scratch = f;
    f->ref_spec = f->ref_ctx = LUA_NOREF;
    moe_node *node;
    if (moe_node_new(S->ctx, MOE_OP_CUSTOM, lm_fn_backward, ninputs, inputs, &node) != MOE_OK)
      return lm_corefail(L, S, fname, 0);
    box->node = node;
    *scratch = NULL; /* the node owns f from here */
    f->T = lm_ag_thread(L);
    f->S = S;
    f->n_args = nargs;
    memcpy(f->input_of_arg, input_of_arg, sizeof input_of_arg);
    snprintf(f->name, sizeof f->name, "%s", fname);
    lua_pushvalue(L, lua_upvalueindex(2));
    f->ref_spec = luaL_ref(L, LUA_REGISTRYINDEX);
    lua_pushvalue(L, ctxtab);
    f->ref_ctx = luaL_ref(L, LUA_REGISTRYINDEX);
    node->user = f;
    node->user_free = lm_fn_free;
    node->name = f->name;
    lua_pop(L, 1); /* the scratch box */
  }

  /* forward(ctx, ...) with grad mode off */
  int base = lua_gettop(L);
  lua_getfield(L, lua_upvalueindex(2), "forward");
  lua_pushvalue(L, ctxtab);
  for (int a = 1; a <= nargs; a++) lua_pushvalue(L, a);
  box->in_forward = true;
  bool prev = moe_grad_set(S->ctx, false);
  int st = lua_pcall(L, nargs + 1, LUA_MULTRET, 0);
  moe_grad_set(S->ctx, prev);
  box->in_forward = false;
  if (st != LUA_OK) return lm_fn_fail(L, box);
  int nres = lua_gettop(L) - base;
  if (nres == 0) {
    lua_pushfstring(L, "%s: forward returned no value", fname);
    return lm_fn_fail(L, box);
  }
  if (!record) return nres;

  /* the outputs: every float tensor result, in order */
  int k = 0;
  moe_tensor *seen[MOE_NODE_MAX_OUTPUTS];
  for (int i = 1; i <= nres; i++) {
    int idx = base + i;
    lm_tensor *u = lm_testtensor(L, idx);
    if (!u || !u->t || !moe_dtype_is_float(u->t->dtype)) continue;
    if (k == MOE_NODE_MAX_OUTPUTS) {
      lua_pushfstring(L, "%s: forward returned more than %d tensors", fname, MOE_NODE_MAX_OUTPUTS);
      return lm_fn_fail(L, box);
    }
    moe_tensor *t = u->t;
    bool alias = moe_requires_grad(t);
    for (int j = 0; j < ninputs && !alias; j++) alias = inputs[j] == t;
    for (int j = 0; j < k && !alias; j++) alias = seen[j] == t;
    if (alias) { /* an input or a tensor with history: return a fresh header */
      lm_tensor *r = lm_push_empty(L);
      moe_tensor *d = NULL;
      if (moe_detach(S->ctx, t, &d) != MOE_OK) {
        lua_pushfstring(L, "%s: %s", fname, moe_ctx_error(S->ctx));
        return lm_fn_fail(L, box);
      }
      lm_adopt(r, S, d);
      lua_replace(L, idx);
      t = d;
    }
    if (moe_node_set_output(S->ctx, box->node, k, t) != MOE_OK) {
      lua_pushfstring(L, "%s: %s", fname, moe_ctx_error(S->ctx));
      return lm_fn_fail(L, box);
    }
    seen[k++] = t;
  }
  moe_node *n = box->node; /* the outputs hold it now */
  box->node = NULL;
  moe_node_release(n);
  return nres;
}

/* moe.Function{name =, forward =, backward =} -> a callable */
static int lm_function(lua_State *L) {
  if (lua_type(L, 1) != LUA_TTABLE)
    lm_argerror(L, 1, "Function", "table expected ({name =, forward =, backward =}), got %s",
                lm_typename(L, 1));
  lm_checkend(L, 1, "Function");
  lua_getfield(L, 1, "forward");
  if (lua_type(L, -1) != LUA_TFUNCTION)
    lm_argerror(L, 1, "Function", "field 'forward' must be a function, got %s", lm_typename(L, -1));
  lua_getfield(L, 1, "backward");
  if (lua_type(L, -1) != LUA_TFUNCTION)
    lm_argerror(L, 1, "Function", "field 'backward' must be a function, got %s", lm_typename(L, -1));
  lua_getfield(L, 1, "name");
  if (!lua_isnil(L, -1) && lua_type(L, -1) != LUA_TSTRING)
    lm_argerror(L, 1, "Function", "field 'name' must be a string, got %s", lm_typename(L, -1));
  lua_settop(L, 1);
  /* a private copy, so later changes to the caller's table do not matter */
  lua_createtable(L, 0, 3);
  lua_getfield(L, 1, "forward");
  lua_setfield(L, -2, "forward");
  lua_getfield(L, 1, "backward");
  lua_setfield(L, -2, "backward");
  lua_getfield(L, 1, "name");
  lua_setfield(L, -2, "name");
  lua_pushvalue(L, lua_upvalueindex(1));
  lua_insert(L, -2);
  lua_pushcclosure(L, lm_fn_apply, 2);
  return 1;
}

/* --------------------------------------------------- saved-tensor hooks */

typedef struct lm_hooks {
  lua_State *T;
  lm_state *S;
  int ref_pack, ref_unpack; /* registry: the Lua functions */
} lm_hooks;

typedef struct lm_hook_call {
  lm_hooks *h;
  moe_tensor *t;  /* pack: the tensor */
  int ref;        /* pack: out; unpack: in */
  moe_tensor **out;
} lm_hook_call;

static int lm_pack_body(lua_State *T) {
  lm_hook_call *c = (lm_hook_call *)lua_touserdata(T, 1);
  luaL_checkstack(T, 6, "pack");
  lua_rawgeti(T, LUA_REGISTRYINDEX, c->h->ref_pack);
  lm_push_tensor(T, c->h->S, c->t);
  int arg = lua_gettop(T);
  lua_pushvalue(T, -2);
  lua_pushvalue(T, arg);
  lua_call(T, 1, 1);
  if (!lm_part_of(T, arg, -1)) lm_free_if_tensor(T, arg);
  c->ref = luaL_ref(T, LUA_REGISTRYINDEX);
  return 0;
}

static moe_status lm_pack(moe_ctx *ctx, void *ud, moe_tensor *t, void **packed) {
  lm_hook_call c = {(lm_hooks *)ud, t, LUA_NOREF, NULL};
  moe_status st = lm_protected(ctx, c.h->T, lm_pack_body, &c, "saved_tensor_hooks: pack");
  if (st == MOE_OK) *packed = (void *)(intptr_t)c.ref;
  return st;
}

static int lm_unpack_body(lua_State *T) {
  lm_hook_call *c = (lm_hook_call *)lua_touserdata(T, 1);
  luaL_checkstack(T, 6, "unpack");
  lua_rawgeti(T, LUA_REGISTRYINDEX, c->ref);
  int packed = lua_gettop(T);
  lua_rawgeti(T, LUA_REGISTRYINDEX, c->h->ref_unpack);
  lua_pushvalue(T, packed);
  lua_call(T, 1, 1);
  lm_tensor *u = lm_testtensor(T, -1);
  if (!u || !u->t)
    return luaL_error(T, "unpack returned %s, not a tensor", u ? "a freed tensor" : lm_typename(T, -1));
  moe_tensor_retain(u->t);
  *c->out = u->t;
  if (!lm_part_of(T, -1, packed)) lm_release(u);
  return 0;
}

static moe_status lm_unpack(moe_ctx *ctx, void *ud, void *packed, moe_tensor **out) {
  lm_hook_call c = {(lm_hooks *)ud, NULL, (int)(intptr_t)packed, out};
  *out = NULL;
  return lm_protected(ctx, c.h->T, lm_unpack_body, &c, "saved_tensor_hooks: unpack");
}

/* Frees the tensors of a packed value and its reference. Runs outside any
 * pcall (from a release): nothing here may raise. */
static void lm_free_packed(void *ud, void *packed) {
  lm_hooks *h = (lm_hooks *)ud;
  lua_State *T = h->T;
  int ref = (int)(intptr_t)packed;
  if (lua_checkstack(T, 4)) {
    lua_rawgeti(T, LUA_REGISTRYINDEX, ref);
    if (lua_type(T, -1) == LUA_TTABLE) {
      lua_pushnil(T);
      while (lua_next(T, -2)) {
        lm_free_if_tensor(T, -1);
        lua_pop(T, 1);
      }
    } else {
      lm_free_if_tensor(T, -1);
    }
    lua_pop(T, 1);
  }
  luaL_unref(T, LUA_REGISTRYINDEX, ref);
}

static void lm_free_hooks(void *ud) {
  lm_hooks *h = (lm_hooks *)ud;
  luaL_unref(h->T, LUA_REGISTRYINDEX, h->ref_pack);
  luaL_unref(h->T, LUA_REGISTRYINDEX, h->ref_unpack);
  free(h);
}

/* moe.saved_tensor_hooks(pack, unpack, fn, ...): runs fn(...) with the hooks
 * applied to every tensor an op saves for backward; returns fn's results. */
static int lm_saved_tensor_hooks(lua_State *L) {
  lm_state *S = lm_S(L);
  if (lua_type(L, 1) != LUA_TFUNCTION)
    lm_argerror(L, 1, "saved_tensor_hooks", "pack function expected, got %s", lm_typename(L, 1));
  if (lua_type(L, 2) != LUA_TFUNCTION)
    lm_argerror(L, 2, "saved_tensor_hooks", "unpack function expected, got %s", lm_typename(L, 2));
  if (lua_type(L, 3) != LUA_TFUNCTION)
    lm_argerror(L, 3, "saved_tensor_hooks", "function expected, got %s", lm_typename(L, 3));
  lua_State *T = lm_ag_thread(L);
  void **scratch = lm_push_scratch(L);
  lm_hooks *h = (lm_hooks *)calloc(1, sizeof *h);
  if (!h) return luaL_error(L, "saved_tensor_hooks: out of host memory");
  *scratch = h;
  h->T = T;
  h->S = S;
  h->ref_pack = h->ref_unpack = LUA_NOREF;
  lua_pushvalue(L, 1);
  h->ref_pack = luaL_ref(L, LUA_REGISTRYINDEX);
  lua_pushvalue(L, 2);
  h->ref_unpack = luaL_ref(L, LUA_REGISTRYINDEX);
  moe_saved_hooks hooks = {0, lm_pack, lm_unpack, lm_free_packed, lm_free_hooks, h};
  if (moe_saved_hooks_push(S->ctx, &hooks) != MOE_OK) {
    luaL_unref(L, LUA_REGISTRYINDEX, h->ref_pack);
    luaL_unref(L, LUA_REGISTRYINDEX, h->ref_unpack);
    return lm_corefail(L, S, "saved_tensor_hooks", 0);
  }
  *scratch = NULL; /* the hooks own h now */
  lua_pop(L, 1);
  lua_remove(L, 1);
  lua_remove(L, 1); /* fn, ... */
  int st = lua_pcall(L, lua_gettop(L) - 1, LUA_MULTRET, 0);
  moe_saved_hooks_pop(S->ctx);
  if (st != LUA_OK) return lua_error(L);
  return lua_gettop(L);
}

/* -------------------------------------------------------- registration */

static const luaL_Reg lm_autograd_functions[] = {
    {"zero_grad", lm_zero_grad},
    {"no_grad", lm_no_grad},
    {"enable_grad", lm_enable_grad},
    {"is_grad_enabled", lm_is_grad_enabled},
    {"set_grad_enabled", lm_set_grad_enabled},
    {"Function", lm_function},
    {"saved_tensor_hooks", lm_saved_tensor_hooks},
    {NULL, NULL}};

static const luaL_Reg lm_autograd_methods[] = {
    {"backward", lm_t_backward},
    {"requires_grad_", lm_t_requires_grad_},
    {"detach", lm_t_detach},
    {NULL, NULL}};

void lm_open_autograd(lua_State *L, int mod, int methods, int sentinel) {
  lm_register(L, mod, methods, sentinel, lm_autograd_functions, lm_autograd_methods);
  sentinel = lua_absindex(L, sentinel);
  if (luaL_newmetatable(L, LM_FNBOX)) {
    lua_pushcfunction(L, lm_fnbox_gc);
    lua_setfield(L, -2, "__gc");
  }
  lua_pop(L, 1);
  if (luaL_newmetatable(L, LM_FNCTX)) {
    lua_createtable(L, 0, 1);
    lua_pushvalue(L, sentinel);
    lua_pushcclosure(L, lm_fnctx_save, 1);
    lua_setfield(L, -2, "save_for_backward");
    lua_setfield(L, -2, "__index");
  }
  lua_pop(L, 1);
  lm_ag_thread(L);
}
