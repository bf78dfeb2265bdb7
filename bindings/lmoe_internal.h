/*
 * lmoe_internal.h - what the files of the `moe` module share (bindings/ only;
 * lmoe.h is the public face). The files, as Lua's own are split:
 *
 *   lauxmoe.c  argument readers and errors (lauxlib.c's part): lm_check*,
 *              lm_argerror, lm_corefail, the scratch box
 *   ltensor.c  moe.Tensor (liolib.c's part for files): the userdata, its
 *              metatable and methods, free/__close/__gc, adoption of results
 *              (lm_push_empty, lm_result, lm_adopt), constructors
 *   ldevice.c  moe.cuda.*, memory statistics, the random generator's seed
 *              and state, build and version facts, moe.clock
 *   linit.c    luaopen_moe (linit.c's part): the state and its sentinel, the
 *              module table and moe.ops, made once each, and the lists of
 *              family openers
 *   l<family>.c one family of ops each (lautograd.c, lpointwise.c, ...),
 *              exposing lm_open_<family>; luaopen_moe calls it with the table
 *              its functions go into (the module, or moe.ops), the tensor
 *              method table and the sentinel (upvalue 1 of every function,
 *              so lm_S works).
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
   * 0 turns it off; moe.cuda.set_gc_step and MOE_GC_STEP_MB set it.
   * Host memory the same way: every host_gc_step bytes of new CPU storage
   * (host_gc_debt) run a full cycle; MOE_HOST_GC_STEP_MB sets it (256 MiB
   * by default, 0 off). gc_cycles counts the cycles of both. */
  int64_t gc_step, gc_debt, gc_cycles;
  int64_t host_gc_step, host_gc_debt;
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

/* ------------------------------------------- linit.c: state and opening */

/* The state of the running function's module (its upvalue 1, the
 * sentinel); raises "moe: the module's context is closed" after lua_close
 * has finalized the sentinel. */
lm_state *lm_S(lua_State *L);
/* Drops one reference to the state (tensor, event, plan, ... userdata hold
 * one); the context is freed with the last. */
void lm_state_unref(lm_state *S);
/* Registers a family's functions into the table at index lib (the module or
 * moe.ops) and its tensor methods into the method table (at index methods),
 * each with the sentinel (at index sentinel) as upvalue 1. Either list may
 * be NULL. */
void lm_register(lua_State *L, int lib, int methods, int sentinel, const luaL_Reg *functions,
                 const luaL_Reg *tensor_methods);

/* ---------------------------------- lauxmoe.c: arguments, errors, scratch */

/* A box (userdata, at the top of the stack) for one malloc'd block, freed by
 * its __gc, also when an error unwinds past it; set *box = NULL after
 * freeing it yourself. lm_scratch_init makes its metatable (once per state). */
void **lm_push_scratch(lua_State *L);
void lm_scratch_init(lua_State *L);
/* "bad argument #arg to 'fname' (fmt...)"; never returns. */
int lm_argerror(lua_State *L, int arg, const char *fname, const char *fmt, ...);
/* Raises the core's message (moe_ctx_error) as fname's error, attributed to
 * argument arg when arg > 0. Call it with nothing left to free; never
 * returns. */
int lm_corefail(lua_State *L, lm_state *S, const char *fname, int arg);
/* What the value at idx is, for messages: "tensor", "freed tensor", a
 * number's value or the type name (lm_describe); "tensor" or the type name
 * (lm_typename). */
const char *lm_describe(lua_State *L, int idx);
const char *lm_typename(lua_State *L, int idx);
/* Numbers at arg: an integer (a float with an integer value passes, a string
 * does not), any number; `what` names it in the message; lm_opt* return def
 * for nil or none. */
int64_t lm_checkint(lua_State *L, int arg, const char *fname, const char *what);
int64_t lm_optint(lua_State *L, int arg, const char *fname, const char *what, int64_t def);
double lm_checknum(lua_State *L, int arg, const char *fname, const char *what);
double lm_optnum(lua_State *L, int arg, const char *fname, const char *what, double def);
/* A fill value: a number, or a boolean (1 or 0). */
double lm_checkvalue(lua_State *L, int arg, const char *fname);
/* Raises "unexpected extra argument" for a non-nil argument past last. */
void lm_checkend(lua_State *L, int last, const char *fname);
/* A dim of a tensor of ndim dims (ndim + 1 positions when insert), negative
 * counting from the end, normalised to 0..ndim-1. */
int lm_checkdim(lua_State *L, lm_state *S, int arg, const char *fname, int ndim, bool insert);
/* A shape as one table ({2, 3}) or as numbers from arg on (2, 3), -1 allowed
 * where infer; a list of dims the same way (lm_checkdims). Both return the
 * index of the first argument after what they read. */
int lm_checkshape(lua_State *L, int arg, const char *fname, bool infer, int *ndim, int64_t *shape);
int lm_checkdims(lua_State *L, lm_state *S, int arg, const char *fname, int tndim, int *n, int64_t *dims);
/* A dtype or a device name at stack index idx, reported as argument arg. */
moe_dtype lm_checkdtype_at(lua_State *L, int idx, int arg, const char *fname);
moe_device lm_checkdevice_at(lua_State *L, lm_state *S, int idx, int arg, const char *fname);
/* "f32, f64, ...": every dtype name, for messages; returns buf. */
const char *lm_dtype_list(char *buf, size_t len);
/* The options table of constructors and t:to(): the keys in allowed
 * (LM_OPT_*), anything else raises. */
void lm_checkopts(lua_State *L, lm_state *S, int arg, const char *fname, unsigned allowed, lm_opts *o);
/* Options tables of the op families: unknown keys raise "unknown option 'k'
 * (valid options: ...)"; lm_field_bool reads one boolean field. */
void lm_checkkeys(lua_State *L, int arg, const char *fname, const char *const *known);
bool lm_field_bool(lua_State *L, int arg, const char *fname, const char *key, bool def);
/* Pushes a device's name ("cuda:0"), a Lua sequence of n integers. */
void lm_push_device(lua_State *L, moe_device d);
void lm_push_ints(lua_State *L, int n, const int64_t *v);

/* ------------------------------------------------------ ltensor.c: tensors */

/* Pushes an empty tensor userdata (metatable attached, owning nothing). */
lm_tensor *lm_push_empty(lua_State *L);
/* Gives the userdata u the tensor t (one reference, taken over) and one
 * reference to S. */
void lm_adopt(lm_tensor *u, lm_state *S, moe_tensor *t);
/* The one free function of t:free(), __close and __gc; idempotent. */
void lm_release(lm_tensor *u);
/* The tensor userdata at arg or NULL (lm_testtensor, freed ones too); the
 * live tensor at arg, raising otherwise (lm_checktensor). */
lm_tensor *lm_testtensor(lua_State *L, int arg);
moe_tensor *lm_checktensor(lua_State *L, int arg, const char *fname);
/* The common tail of a binding whose result is the userdata r at the top of
 * the stack: on MOE_OK adopts out (counting its CUDA storage towards the
 * next collection) and returns 1; otherwise raises the core's error. */
int lm_result(lua_State *L, lm_state *S, lm_tensor *r, moe_status st, moe_tensor *out, const char *fname, int arg);
/* The tensor metatable and method table, made once per Lua state; pushes
 * the method table. */
void lm_push_methods(lua_State *L, int sentinel);

/* ----------------------------------------------------------------- ldevice.c */

/* The initial gc_step of a state (var "MOE_GC_STEP_MB", def_mb 1024), or
 * host_gc_step ("MOE_HOST_GC_STEP_MB", 256): def_mb MiB unless var says
 * otherwise; -1 when that variable is malformed. */
int64_t lm_gc_step_default(const char *var, int64_t def_mb);

/* ------------------------------------------------------------- lrouting.c */

/* Routing plans (moe.RoutingPlan userdata). lm_toplan: the C plan at arg,
 * or NULL when arg is not a plan; raises on a freed plan. lm_plan_arg: the
 * same, raising "routing plan expected" otherwise. */
struct moe_routing_plan;
struct moe_routing_plan *lm_toplan(lua_State *L, int arg, const char *fname);
struct moe_routing_plan *lm_plan_arg(lua_State *L, int arg, const char *fname);

/* ---------------------------------------------------------------- families */

/* The openers luaopen_moe calls (linit.c lists them), one per file. Each
 * registers its functions into the table it is given (mod or ops) and its
 * tensor methods into the table at index methods, with the sentinel (at
 * index sentinel) as upvalue 1, through lm_register. */
/* mod is the module: their functions are moe.<name>. */
void lm_open_tensor(lua_State *L, int mod, int methods, int sentinel);
void lm_open_device(lua_State *L, int mod, int methods, int sentinel);
void lm_open_autograd(lua_State *L, int mod, int methods, int sentinel);
void lm_open_pointwise(lua_State *L, int mod, int methods, int sentinel);
void lm_open_reduce(lua_State *L, int mod, int methods, int sentinel);
void lm_open_index(lua_State *L, int mod, int methods, int sentinel);
void lm_open_matmul(lua_State *L, int mod, int methods, int sentinel);
void lm_open_attention(lua_State *L, int mod, int methods, int sentinel);
void lm_open_event(lua_State *L, int mod, int methods, int sentinel);
void lm_open_io(lua_State *L, int mod, int methods, int sentinel);
/* moe.dist (bindings/ldist.c): a table of its own, made in the module. */
void lm_open_dist(lua_State *L, int mod, int methods, int sentinel);
/* The communicator of the moe.Group at idx; a Lua error for argument arg of
 * fname when it is not a group or was freed. */
moe_comm *lm_checkgroup_at(lua_State *L, int idx, int arg, const char *fname);
void lm_open_proc(lua_State *L, int mod, int methods, int sentinel); /* moe.proc */
/* moe.dist.reducer (bindings/lreducer.c), into moe.dist: opened after it. */
void lm_open_reducer(lua_State *L, int mod, int methods, int sentinel);
/* ops is moe.ops (made by luaopen_moe alone): their functions are
 * moe.ops.<name>. */
void lm_open_routing(lua_State *L, int ops, int methods, int sentinel);
void lm_open_quantize(lua_State *L, int ops, int methods, int sentinel);
void lm_open_grouped(lua_State *L, int ops, int methods, int sentinel);
void lm_open_experts(lua_State *L, int ops, int methods, int sentinel);
void lm_open_optim(lua_State *L, int ops, int methods, int sentinel);
void lm_open_data(lua_State *L, int ops, int methods, int sentinel);
void lm_open_blocksparse(lua_State *L, int ops, int methods, int sentinel);

/* moe.scope and moe.keep (bindings/lscope.c). lm_scope_track records the
 * handle at the top of the stack in the calling thread's innermost scope, if
 * any; lm_push_empty calls it for every new tensor handle. */
void lm_open_scope(lua_State *L, int mod, int methods, int sentinel);
void lm_scope_track(lua_State *L);

#endif /* LMOE_INTERNAL_H */
