/*
 * lauxmoe.c - the auxiliary functions of the `moe` bindings, as lauxlib.c is
 * Lua's: reading and checking Lua arguments, raising errors, and the scratch
 * box that frees a malloc'd block when an error unwinds past it. Every other
 * binding file builds on these (declared in lmoe_internal.h); nothing here
 * knows an op.
 *
 * Errors: "bad argument #N to 'f' (problem)" when one argument is at fault
 * (lm_argerror), "f: problem" otherwise (operands that do not fit together,
 * a failed CUDA call, no memory: lm_corefail with arg 0). Arguments are
 * numbered as in a plain call, with self as #1: t:view(4, 7) reports its
 * shape as argument #2.
 *
 * No Lua error is raised while C code holds malloc'd memory: scratch space
 * is a userdata (collected if an error unwinds past it), and a malloc'd
 * result of the core (the text of moe_tensor_format, ...) is parked in a
 * "moe.Scratch" box (lm_push_scratch) whose __gc frees it. Owns that
 * metatable, created once per Lua state by lm_scratch_init.
 */
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lmoe_internal.h"

/* ---------------------------------------------------------- scratch boxes */

/* A box for one malloc'd block, freed by __gc unless taken back before. */
static int lm_scratch_gc(lua_State *L) {
  void **box = (void **)luaL_checkudata(L, 1, LM_SCRATCH);
  free(*box);
  *box = NULL;
  return 0;
}

void **lm_push_scratch(lua_State *L) {
  void **box = (void **)lua_newuserdatauv(L, sizeof(void *), 0);
  *box = NULL;
  luaL_setmetatable(L, LM_SCRATCH);
  return box;
}

void lm_scratch_init(lua_State *L) {
  if (luaL_newmetatable(L, LM_SCRATCH)) {
    lua_pushcfunction(L, lm_scratch_gc);
    lua_setfield(L, -2, "__gc");
  }
  lua_pop(L, 1);
}

/* ------------------------------------------------------------ errors */

/* "bad argument #arg to 'fname' (...)"; never returns. */
int lm_argerror(lua_State *L, int arg, const char *fname, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  const char *msg = lua_pushvfstring(L, fmt, ap);
  va_end(ap);
  return luaL_error(L, "bad argument #%d to '%s' (%s)", arg, fname, msg);
}

/* The core failed: its message, attributed to argument `arg` when > 0.
 * The core names its function first ("view: ..."); when that is our name
 * too it is not repeated. Called with nothing left to free; never returns. */
int lm_corefail(lua_State *L, lm_state *S, const char *fname, int arg) {
  const char *msg = moe_ctx_error(S->ctx);
  size_t n = strlen(fname);
  if (msg == NULL || msg[0] == '\0') msg = "unknown error";
  if (strncmp(msg, fname, n) == 0 && msg[n] == ':' && msg[n + 1] == ' ') msg += n + 2;
  if (arg > 0) return luaL_error(L, "bad argument #%d to '%s' (%s)", arg, fname, msg);
  return luaL_error(L, "%s: %s", fname, msg);
}


/* What a value is, for messages: "tensor", "freed tensor", a number's
 * value, or the type name. Pushes nothing that outlives the error. */
const char *lm_describe(lua_State *L, int idx) {
  switch (lua_type(L, idx)) {
    case LUA_TNUMBER:
      if (lua_isinteger(L, idx)) return lua_pushfstring(L, "%I", (LUAI_UACINT)lua_tointeger(L, idx));
      return lua_pushfstring(L, "%f", (LUAI_UACNUMBER)lua_tonumber(L, idx));
    case LUA_TUSERDATA: {
      lm_tensor *u = (lm_tensor *)luaL_testudata(L, idx, LM_TENSOR);
      if (u) return u->t ? "tensor" : "freed tensor";
      return luaL_typename(L, idx);
    }
    case LUA_TNONE: return "no value";
    default: return luaL_typename(L, idx);
  }
}

const char *lm_typename(lua_State *L, int idx) {
  if (lua_type(L, idx) == LUA_TUSERDATA && luaL_testudata(L, idx, LM_TENSOR)) return "tensor";
  return luaL_typename(L, idx);
}

/* --------------------------------------------------- argument readers */

/* An integer (a float with an exact integer value is accepted, a string
 * is not). `what` names the value in the message. */
int64_t lm_checkint(lua_State *L, int arg, const char *fname, const char *what) {
  int isint = 0;
  lua_Integer v = 0;
  if (lua_type(L, arg) == LUA_TNUMBER) v = lua_tointegerx(L, arg, &isint);
  if (!isint) lm_argerror(L, arg, fname, "%s must be an integer, got %s", what, lm_describe(L, arg));
  return (int64_t)v;
}

int64_t lm_optint(lua_State *L, int arg, const char *fname, const char *what, int64_t def) {
  return lua_isnoneornil(L, arg) ? def : lm_checkint(L, arg, fname, what);
}

double lm_checknum(lua_State *L, int arg, const char *fname, const char *what) {
  if (lua_type(L, arg) != LUA_TNUMBER)
    lm_argerror(L, arg, fname, "%s must be a number, got %s", what, lm_typename(L, arg));
  return (double)lua_tonumber(L, arg);
}

double lm_optnum(lua_State *L, int arg, const char *fname, const char *what, double def) {
  return lua_isnoneornil(L, arg) ? def : lm_checknum(L, arg, fname, what);
}

/* A fill value: a number, or a boolean (1 or 0). */
double lm_checkvalue(lua_State *L, int arg, const char *fname) {
  if (lua_type(L, arg) == LUA_TBOOLEAN) return lua_toboolean(L, arg) ? 1.0 : 0.0;
  if (lua_type(L, arg) != LUA_TNUMBER)
    lm_argerror(L, arg, fname, "value must be a number or a boolean, got %s", lm_typename(L, arg));
  return (double)lua_tonumber(L, arg);
}

/* No argument past `last`. */
void lm_checkend(lua_State *L, int last, const char *fname) {
  int top = lua_gettop(L);
  while (top > last && lua_isnil(L, top)) top--;
  if (top > last)
    lm_argerror(L, last + 1, fname, "unexpected extra argument (%s)", lm_describe(L, last + 1));
}

/* A dim of a tensor of ndim dims (ndim + 1 positions when `insert`),
 * normalised to 0..ndim-1. */
int lm_checkdim(lua_State *L, lm_state *S, int arg, const char *fname, int ndim, bool insert) {
  int64_t d = lm_checkint(L, arg, fname, "dim");
  int out = 0;
  if (moe_dim_normalize(S->ctx, d, ndim, insert, &out) != MOE_OK) lm_corefail(L, S, fname, arg);
  return out;
}

/* One size of a shape at stack index idx (argument `arg` in messages). */
static int64_t lm_size_at(lua_State *L, int idx, int arg, const char *fname, int dim, bool infer) {
  int isint = 0;
  lua_Integer v = 0;
  if (lua_type(L, idx) == LUA_TNUMBER) v = lua_tointegerx(L, idx, &isint);
  if (!isint || v < -1 || (v == -1 && !infer))
    lm_argerror(L, arg, fname, "size of dim %d must be a non-negative integer%s, got %s", dim,
                infer ? " (or -1)" : "", lm_describe(L, idx));
  return (int64_t)v;
}

/* A shape given as one table ({2, 3}) at `arg`, or as numbers from `arg` on
 * (2, 3). -1 is accepted where `infer` (view/reshape infer it, expand keeps
 * the size). Returns the index of the first argument after the shape. */
int lm_checkshape(lua_State *L, int arg, const char *fname, bool infer, int *ndim,
                  int64_t *shape) {
  if (lua_type(L, arg) == LUA_TTABLE) {
    lua_Unsigned n = lua_rawlen(L, arg);
    if (n > MOE_MAX_DIMS)
      lm_argerror(L, arg, fname, "a shape has at most %d dims, got %d", MOE_MAX_DIMS, (int)(n > 999 ? 999 : n));
    for (int i = 0; i < (int)n; i++) {
      lua_rawgeti(L, arg, i + 1);
      shape[i] = lm_size_at(L, -1, arg, fname, i, infer);
      lua_pop(L, 1);
    }
    *ndim = (int)n;
    return arg + 1;
  }
  if (lua_type(L, arg) != LUA_TNUMBER)
    lm_argerror(L, arg, fname, "shape expected (a table of sizes, or sizes as numbers), got %s",
                lm_typename(L, arg));
  int n = 0;
  while (lua_type(L, arg + n) == LUA_TNUMBER) {
    if (n == MOE_MAX_DIMS) lm_argerror(L, arg + n, fname, "a shape has at most %d dims", MOE_MAX_DIMS);
    shape[n] = lm_size_at(L, arg + n, arg + n, fname, n, infer);
    n++;
  }
  *ndim = n;
  return arg + n;
}

/* A list of dims (permute), as one table or as numbers from `arg` on. */
int lm_checkdims(lua_State *L, lm_state *S, int arg, const char *fname, int tndim, int *n,
                 int64_t *dims) {
  if (lua_type(L, arg) == LUA_TTABLE) {
    lua_Unsigned len = lua_rawlen(L, arg);
    if (len > MOE_MAX_DIMS)
      lm_argerror(L, arg, fname, "at most %d dims expected, got %d", MOE_MAX_DIMS, (int)(len > 999 ? 999 : len));
    for (int i = 0; i < (int)len; i++) {
      lua_rawgeti(L, arg, i + 1);
      int isint = 0;
      lua_Integer v = lua_type(L, -1) == LUA_TNUMBER ? lua_tointegerx(L, -1, &isint) : 0;
      if (!isint) lm_argerror(L, arg, fname, "dims[%d] must be an integer, got %s", i + 1, lm_describe(L, -1));
      int d = 0;
      if (moe_dim_normalize(S->ctx, v, tndim, false, &d) != MOE_OK) lm_corefail(L, S, fname, arg);
      dims[i] = d;
      lua_pop(L, 1);
    }
    *n = (int)len;
    return arg + 1;
  }
  if (lua_type(L, arg) != LUA_TNUMBER)
    lm_argerror(L, arg, fname, "dims expected (a table, or dims as numbers), got %s", lm_typename(L, arg));
  int k = 0;
  while (lua_type(L, arg + k) == LUA_TNUMBER) {
    if (k == MOE_MAX_DIMS) lm_argerror(L, arg + k, fname, "at most %d dims expected", MOE_MAX_DIMS);
    dims[k] = lm_checkdim(L, S, arg + k, fname, tndim, false);
    k++;
  }
  *n = k;
  return arg + k;
}

/* "f32, f64, ..." for messages. */
const char *lm_dtype_list(char *buf, size_t len) {
  size_t used = 0;
  buf[0] = '\0';
  for (int i = 0; i < MOE_DTYPE_COUNT && used < len; i++)
    used += (size_t)snprintf(buf + used, len - used, "%s%s", i ? ", " : "", moe_dtype_name((moe_dtype)i));
  return buf;
}

moe_dtype lm_checkdtype_at(lua_State *L, int idx, int arg, const char *fname) {
  moe_dtype dt = MOE_F32;
  char list[128];
  if (lua_type(L, idx) != LUA_TSTRING)
    lm_argerror(L, arg, fname, "dtype must be a string, got %s", lm_typename(L, idx));
  if (!moe_dtype_parse(lua_tostring(L, idx), &dt))
    lm_argerror(L, arg, fname, "unknown dtype '%s' (valid: %s)", lua_tostring(L, idx),
                lm_dtype_list(list, sizeof list));
  return dt;
}

moe_device lm_checkdevice_at(lua_State *L, lm_state *S, int idx, int arg, const char *fname) {
  moe_device d = MOE_CPU;
  if (lua_type(L, idx) != LUA_TSTRING)
    lm_argerror(L, arg, fname, "device must be a string ('cpu', 'cuda', 'cuda:N'), got %s",
                lm_typename(L, idx));
  if (moe_device_parse(S->ctx, lua_tostring(L, idx), &d) != MOE_OK)
    lm_argerror(L, arg, fname, "device '%s': %s", lua_tostring(L, idx), moe_ctx_error(S->ctx));
  return d;
}

/* The options table of constructors and of t:to(). */

static const char *lm_opt_names(unsigned allowed) {
  switch (allowed) {
    case LM_OPT_DTYPE | LM_OPT_DEVICE: return "dtype, device";
    case LM_OPT_DEVICE | LM_OPT_GRAD: return "device, requires_grad";
    default: return "dtype, device, requires_grad";
  }
}

void lm_checkopts(lua_State *L, lm_state *S, int arg, const char *fname, unsigned allowed,
                  lm_opts *o) {
  o->dtype = MOE_F32;
  o->device = MOE_CPU;
  o->has_dtype = o->has_device = false;
  o->requires_grad = false;
  if (lua_isnoneornil(L, arg)) return;
  if (lua_type(L, arg) != LUA_TTABLE)
    lm_argerror(L, arg, fname, "options table expected ({%s}), got %s", lm_opt_names(allowed),
                lm_typename(L, arg));
  arg = lua_absindex(L, arg);
  lua_pushnil(L);
  while (lua_next(L, arg)) {
    const char *k = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : NULL;
    int top = lua_gettop(L);
    if (k == NULL)
      lm_argerror(L, arg, fname, "options are given by name ({%s}), got a %s key",
                  lm_opt_names(allowed), luaL_typename(L, -2));
    if ((allowed & LM_OPT_DTYPE) && strcmp(k, "dtype") == 0) {
      o->dtype = lm_checkdtype_at(L, top, arg, fname);
      o->has_dtype = true;
    } else if ((allowed & LM_OPT_DEVICE) && strcmp(k, "device") == 0) {
      o->device = lm_checkdevice_at(L, S, top, arg, fname);
      o->has_device = true;
    } else if ((allowed & LM_OPT_GRAD) && strcmp(k, "requires_grad") == 0) {
      if (lua_type(L, top) != LUA_TBOOLEAN)
        lm_argerror(L, arg, fname, "requires_grad must be a boolean, got %s", lm_typename(L, top));
      o->requires_grad = lua_toboolean(L, top);
    } else {
      lm_argerror(L, arg, fname, "unknown option '%s' (valid options: %s)", k, lm_opt_names(allowed));
    }
    lua_settop(L, top - 1);
  }
}

/* ------------------------------------------- options of the op families */

/* Raises "unknown option 'k' (valid options: a, b, ...)" for the first key
 * of the table at arg that is not one of known (NULL-terminated). */
void lm_checkkeys(lua_State *L, int arg, const char *fname, const char *const *known) {
  arg = lua_absindex(L, arg);
  lua_pushnil(L);
  while (lua_next(L, arg)) {
    bool ok = false;
    if (lua_type(L, -2) == LUA_TSTRING)
      for (int i = 0; known[i] && !ok; i++) ok = strcmp(lua_tostring(L, -2), known[i]) == 0;
    if (!ok) {
      luaL_Buffer b;
      luaL_buffinit(L, &b);
      for (int i = 0; known[i]; i++) {
        if (i) luaL_addstring(&b, ", ");
        luaL_addstring(&b, known[i]);
      }
      luaL_pushresult(&b);
      const char *list = lua_tostring(L, -1); /* stays on the stack */
      if (lua_type(L, -3) == LUA_TSTRING)
        lm_argerror(L, arg, fname, "unknown option '%s' (valid options: %s)", lua_tostring(L, -3), list);
      lm_argerror(L, arg, fname, "unknown option %s (valid options: %s)", lm_describe(L, -3), list);
    }
    lua_pop(L, 1);
  }
}

/* The boolean field key of the options table at arg; def when absent. */
bool lm_field_bool(lua_State *L, int arg, const char *fname, const char *key, bool def) {
  bool v = def;
  if (lua_getfield(L, arg, key) != LUA_TNIL) {
    if (!lua_isboolean(L, -1))
      lm_argerror(L, arg, fname, "option %s must be a boolean, got %s", key, lm_describe(L, -1));
    v = lua_toboolean(L, -1);
  }
  lua_pop(L, 1);
  return v;
}


/* ---------------------------------------------------------------- pushers */

void lm_push_device(lua_State *L, moe_device d) {
  char buf[MOE_DEVICE_STR];
  lua_pushstring(L, moe_device_str(d, buf, sizeof buf));
}

void lm_push_ints(lua_State *L, int n, const int64_t *v) {
  lua_createtable(L, n, 0);
  for (int i = 0; i < n; i++) {
    lua_pushinteger(L, (lua_Integer)v[i]);
    lua_rawseti(L, -2, i + 1);
  }
}
