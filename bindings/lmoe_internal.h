/*
 * lmoe_internal.h - what the files of the `moe` module share (bindings/ only).
 *
 * bindings/lmoe.c owns the state, the tensor userdata and the argument
 * readers; each family of ops has its own binding file (lautograd.c,
 * lpointwise.c, lreduce.c, lindex.c, lmatmul.c, lattention.c) exposing
 * lm_open_<family>, which luaopen_moe calls with the module table, the tensor
 * method table and the sentinel (upvalue 1 of every function, so lm_S works).
 *
 * Every binding has one shape (STYLE.md point 3): check all Lua arguments;
 * push the owning userdata with lm_push_empty; call the core; lm_result
 * adopts the output or raises the core's error as the last statement.
 *
 *   static int lm_relu(lua_State *L) {
 *     lm_state *S = lm_S(L);
 *     moe_tensor *x = lm_checktensor(L, 1, "relu");
 *     lm_checkend(L, 1, "relu");
 *     lm_tensor *r = lm_push_empty(L);
 *     moe_tensor *out = NULL;
 *     moe_status st;
 *     LM_CALL(L, st, moe_relu(S->ctx, x, &out));
 *     return lm_result(L, S, r, st, out, "relu", 0);
 *   }
 */
#ifndef LMOE_INTERNAL_H
#define LMOE_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "lauxlib.h"
#include "lua.h"
#include "moe.h"

#define LM_TENSOR "moe.Tensor"    /* metatable of tensor userdata */
#define LM_SENTINEL "moe.State"   /* metatable of the sentinel owning the ctx */
#define LM_SCRATCH "moe.Scratch"  /* metatable of a box owning a malloc'd block */
#define LM_STATE_KEY "moe.state"  /* registry key of the sentinel */
#define LM_METHODS_KEY "moe.methods" /* registry key of the method table */

/* ------------------------------------------------------------ the state */

typedef struct lm_state {
  moe_ctx *ctx;
  int64_t refs;            /* the sentinel + one per live tensor userdata */
  moe_print_options print; /* for __tostring; moe.set_printoptions */
  /* Device memory is invisible to Lua's collector, which only sees small
   * handles: tensors that became garbage in a forward pass would keep their
   * device blocks until a cycle happens to run. Every gc_step bytes of new
   * CUDA storage handed to Lua (gc_debt counts them) run a full cycle.
   * 0 turns it off; moe.cuda.set_gc_step and MOE_GC_STEP_MB set it. */
  int64_t gc_step, gc_debt, gc_cycles;
} lm_state;

typedef struct lm_sentinel {
  lm_state *S; /* NULL once the sentinel's finalizer has run */
} lm_sentinel;

typedef struct lm_tensor {
  moe_tensor *t; /* one reference; NULL before adoption and after free */
  lm_state *S;   /* one reference while t is not NULL */
} lm_tensor;

/* A call that allocates: on MOE_ERR_OUT_OF_MEMORY, collect garbage (freeing
 * unreachable tensors) and try once more. */
#define LM_CALL(L, st, call)                    \
  do {                                          \
    (st) = (call);                              \
    if ((st) == MOE_ERR_OUT_OF_MEMORY) {        \
      lua_gc((L), LUA_GCCOLLECT);               \
      (st) = (call);                            \
    }                                           \
  } while (0)

enum { LM_OPT_DTYPE = 1, LM_OPT_DEVICE = 2, LM_OPT_GRAD = 4 };

typedef struct lm_opts {
  moe_dtype dtype;
  moe_device device;
  bool has_dtype, has_device;
  bool requires_grad; /* requires_grad = true was given */
} lm_opts;

lm_state *lm_S(lua_State *L);
void **lm_push_scratch(lua_State *L);
int lm_argerror(lua_State *L, int arg, const char *fname, const char *fmt, ...);
int lm_corefail(lua_State *L, lm_state *S, const char *fname, int arg);
const char *lm_describe(lua_State *L, int idx);
const char *lm_typename(lua_State *L, int idx);
int64_t lm_checkint(lua_State *L, int arg, const char *fname, const char *what);
int64_t lm_optint(lua_State *L, int arg, const char *fname, const char *what, int64_t def);
double lm_checknum(lua_State *L, int arg, const char *fname, const char *what);
double lm_optnum(lua_State *L, int arg, const char *fname, const char *what, double def);
double lm_checkvalue(lua_State *L, int arg, const char *fname);
void lm_checkend(lua_State *L, int last, const char *fname);
int lm_checkdim(lua_State *L, lm_state *S, int arg, const char *fname, int ndim, bool insert);
int lm_checkshape(lua_State *L, int arg, const char *fname, bool infer, int *ndim, int64_t *shape);
int lm_checkdims(lua_State *L, lm_state *S, int arg, const char *fname, int tndim, int *n, int64_t *dims);
moe_dtype lm_checkdtype_at(lua_State *L, int idx, int arg, const char *fname);
moe_device lm_checkdevice_at(lua_State *L, lm_state *S, int idx, int arg, const char *fname);
void lm_checkopts(lua_State *L, lm_state *S, int arg, const char *fname, unsigned allowed, lm_opts *o);
/* Options tables of the op families: unknown keys raise "unknown option 'k'
 * (valid options: ...)"; lm_field_bool reads one boolean field. */
void lm_checkkeys(lua_State *L, int arg, const char *fname, const char *const *known);
bool lm_field_bool(lua_State *L, int arg, const char *fname, const char *key, bool def);
lm_tensor *lm_push_empty(lua_State *L);
void lm_adopt(lm_tensor *u, lm_state *S, moe_tensor *t);
void lm_release(lm_tensor *u);
lm_tensor *lm_testtensor(lua_State *L, int arg);
/* Routing plans (lrouting.c's moe.RoutingPlan userdata). lm_toplan: the C
 * plan at arg, or NULL when arg is not a plan; raises on a freed plan.
 * lm_plan_arg: the same, raising "routing plan expected" otherwise. */
struct moe_routing_plan;
struct moe_routing_plan *lm_toplan(lua_State *L, int arg, const char *fname);
struct moe_routing_plan *lm_plan_arg(lua_State *L, int arg, const char *fname);
moe_tensor *lm_checktensor(lua_State *L, int arg, const char *fname);
int lm_result(lua_State *L, lm_state *S, lm_tensor *r, moe_status st, moe_tensor *out, const char *fname, int arg);
void lm_push_device(lua_State *L, moe_device d);
void lm_push_ints(lua_State *L, int n, const int64_t *v);

/* Registers a family's functions into the module table (at index mod) and
 * its tensor methods into the method table (at index methods), each with the
 * sentinel (at index sentinel) as upvalue 1. Either list may be NULL. */
void lm_register(lua_State *L, int mod, int methods, int sentinel, const luaL_Reg *functions,
                 const luaL_Reg *tensor_methods);

/* The families of ops, one binding file each. */
void lm_open_autograd(lua_State *L, int mod, int methods, int sentinel);
void lm_open_pointwise(lua_State *L, int mod, int methods, int sentinel);
void lm_open_reduce(lua_State *L, int mod, int methods, int sentinel);
void lm_open_index(lua_State *L, int mod, int methods, int sentinel);
void lm_open_matmul(lua_State *L, int mod, int methods, int sentinel);
void lm_open_attention(lua_State *L, int mod, int methods, int sentinel);
void lm_open_event(lua_State *L, int mod, int methods, int sentinel);
void lm_open_io(lua_State *L, int mod, int methods, int sentinel);
void lm_open_routing(lua_State *L, int mod, int methods, int sentinel);
void lm_open_optim(lua_State *L, int mod, int methods, int sentinel);
void lm_open_data(lua_State *L, int mod, int methods, int sentinel);
void lm_open_quantize(lua_State *L, int mod, int methods, int sentinel);
void lm_open_grouped(lua_State *L, int mod, int methods, int sentinel);
void lm_open_experts(lua_State *L, int mod, int methods, int sentinel);
void lm_open_blocksparse(lua_State *L, int mod, int methods, int sentinel);

/* moe.scope and moe.keep (bindings/lscope.c). lm_scope_track records the
 * handle at the top of the stack in the calling thread's innermost scope, if
 * any; lm_push_empty calls it for every new tensor handle. */
void lm_open_scope(lua_State *L, int mod, int methods, int sentinel);
void lm_scope_track(lua_State *L);

/* Drops one reference to the state (tensor and event userdata hold one);
 * the context is freed with the last. */
void lm_state_unref(lm_state *S);

#endif /* LMOE_INTERNAL_H */
