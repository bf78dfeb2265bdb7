/*
 * ldevice.c - the device, random-number and memory functions of the `moe`
 * module: what concerns the machine and the context rather than one tensor.
 *
 *   moe.manual_seed(seed)          moe.get_rng_state() / set_rng_state(s)
 *   moe.memory_stats([device])     moe.reset_peak_memory_stats([device])
 *   moe.empty_cache([device])      moe.clock()
 *   moe.host_reads()
 *   moe.build_info()               moe.version_report()
 *   moe.cuda.is_available()        moe.cuda.device_count()
 *   moe.cuda.synchronize([dev])    moe.cuda.get_device_name([dev])
 *   moe.cuda.set_gc_step([MiB])
 *   moe.knobs()                    moe.knob(name)    moe.set_knob(name, value)
 *
 * Owns the moe.cuda table and the setting of the collection step (gc_step
 * of lm_state): its default from MOE_GC_STEP_MB (lm_gc_step_default, read
 * when the state is made) and moe.cuda.set_gc_step; ltensor.c's
 * lm_gc_pressure spends it. Registered by luaopen_moe through
 * lm_open_device (see lmoe_internal.h).
 */
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "knobs.h"
#include "lmoe_internal.h"

#define MOE_GC_MIB ((int64_t)1 << 20)

/* ------------------------------------------------------------------ random */

static int lm_manual_seed(lua_State *L) {
  lm_state *S = lm_S(L);
  int64_t seed = lm_checkint(L, 1, "manual_seed", "seed");
  lm_checkend(L, 1, "manual_seed");
  moe_rng_seed(S->ctx, (uint64_t)seed);
  return 0;
}

/* {seed = , call = }: the whole state of the counter-based generator. */
static int lm_get_rng_state(lua_State *L) {
  lm_state *S = lm_S(L);
  uint64_t seed = 0, call = 0;
  moe_rng_get_state(S->ctx, &seed, &call);
  lua_createtable(L, 0, 2);
  lua_pushinteger(L, (lua_Integer)seed);
  lua_setfield(L, -2, "seed");
  lua_pushinteger(L, (lua_Integer)call);
  lua_setfield(L, -2, "call");
  return 1;
}

static int lm_set_rng_state(lua_State *L) {
  lm_state *S = lm_S(L);
  if (lua_type(L, 1) != LUA_TTABLE)
    lm_argerror(L, 1, "set_rng_state", "state table ({seed=, call=}) expected, got %s", lm_typename(L, 1));
  lm_checkend(L, 1, "set_rng_state");
  lua_getfield(L, 1, "seed"); /* 2 */
  lua_getfield(L, 1, "call"); /* 3 */
  int isint1 = 0, isint2 = 0;
  lua_Integer seed = lua_type(L, 2) == LUA_TNUMBER ? lua_tointegerx(L, 2, &isint1) : 0;
  lua_Integer call = lua_type(L, 3) == LUA_TNUMBER ? lua_tointegerx(L, 3, &isint2) : 0;
  if (!isint1 || !isint2)
    lm_argerror(L, 1, "set_rng_state", "state.seed and state.call must be integers, got %s and %s",
                lm_describe(L, 2), lm_describe(L, 3));
  moe_rng_set_state(S->ctx, (uint64_t)seed, (uint64_t)call);
  return 0;
}

/* ------------------------------------------------------------------ memory */

/* An optional device argument; the default is cuda:0 when a GPU is
 * visible, the CPU otherwise. */
static moe_device lm_optdevice(lua_State *L, lm_state *S, int arg, const char *fname) {
  if (lua_isnoneornil(L, arg)) {
    moe_device d = MOE_CPU;
    if (moe_cuda_device_count(S->ctx) > 0) d.type = MOE_DEVICE_CUDA;
    return d;
  }
  return lm_checkdevice_at(L, S, arg, arg, fname);
}

static void lm_setint(lua_State *L, const char *k, int64_t v) {
  lua_pushinteger(L, (lua_Integer)v);
  lua_setfield(L, -2, k);
}

static int lm_memory_stats(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_device d = lm_optdevice(L, S, 1, "memory_stats");
  lm_checkend(L, 1, "memory_stats");
  moe_memory_stats m;
  if (moe_memory_stats_get(S->ctx, d, &m) != MOE_OK) return lm_corefail(L, S, "memory_stats", 1);
  lua_createtable(L, 0, 10);
  lm_setint(L, "allocated", m.allocated);
  lm_setint(L, "peak_allocated", m.peak_allocated);
  lm_setint(L, "reserved", m.reserved);
  lm_setint(L, "peak_reserved", m.peak_reserved);
  lm_setint(L, "alloc_count", m.alloc_count);
  lm_setint(L, "free_count", m.free_count);
  lm_setint(L, "live_storages", m.live_storages);
  lm_setint(L, "system_allocs", m.system_allocs);
  lm_setint(L, "system_frees", m.system_frees);
  lm_push_device(L, d);
  lua_setfield(L, -2, "device");
  return 1;
}

static int lm_reset_peak_memory_stats(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_device d = lm_optdevice(L, S, 1, "reset_peak_memory_stats");
  lm_checkend(L, 1, "reset_peak_memory_stats");
  if (moe_memory_reset_peak(S->ctx, d) != MOE_OK) return lm_corefail(L, S, "reset_peak_memory_stats", 1);
  return 0;
}

static int lm_empty_cache(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_device d = lm_optdevice(L, S, 1, "empty_cache");
  lm_checkend(L, 1, "empty_cache");
  if (moe_memory_empty_cache(S->ctx, d) != MOE_OK) return lm_corefail(L, S, "empty_cache", 1);
  return 0;
}

/* moe.host_reads() -> {copies =, syncs =}: the context's reads of device
 * values by the host so far (moe.h moe_host_reads; counted on the CPU too). */
static int lm_host_reads(lua_State *L) {
  lm_state *S = lm_S(L);
  lm_checkend(L, 0, "host_reads");
  int64_t copies = 0, syncs = 0;
  moe_host_reads(S->ctx, &copies, &syncs);
  lua_createtable(L, 0, 2);
  lm_setint(L, "copies", copies);
  lm_setint(L, "syncs", syncs);
  return 1;
}

/* -------------------------------------------------------------------- CUDA */

static int lm_cuda_is_available(lua_State *L) {
  lua_pushboolean(L, moe_cuda_device_count(lm_S(L)->ctx) > 0);
  return 1;
}

static int lm_cuda_device_count(lua_State *L) {
  lua_pushinteger(L, moe_cuda_device_count(lm_S(L)->ctx));
  return 1;
}

/* A CUDA device given as an index (0) or a string ("cuda:1"); default 0. */
static moe_device lm_cuda_device_arg(lua_State *L, lm_state *S, int arg, const char *fname) {
  moe_device d = {MOE_DEVICE_CUDA, 0};
  if (lua_type(L, arg) == LUA_TSTRING) {
    d = lm_checkdevice_at(L, S, arg, arg, fname);
    if (d.type != MOE_DEVICE_CUDA) lm_argerror(L, arg, fname, "a CUDA device expected, got '%s'", lua_tostring(L, arg));
    return d;
  }
  int64_t i = lm_optint(L, arg, fname, "device index", 0);
  if (i < 0 || i > INT_MAX) lm_argerror(L, arg, fname, "device index must be non-negative, got %I", (LUAI_UACINT)i);
  d.index = (int)i;
  if (moe_device_check(S->ctx, d) != MOE_OK) lm_corefail(L, S, fname, arg);
  return d;
}

static int lm_cuda_synchronize(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_device d = lm_cuda_device_arg(L, S, 1, "synchronize");
  lm_checkend(L, 1, "synchronize");
  if (moe_cuda_synchronize(S->ctx, d) != MOE_OK) return lm_corefail(L, S, "synchronize", 0);
  return 0;
}

/* moe.cuda.set_gc_step(mb): a full Lua collection every mb MiB of new CUDA
 * storage handed to Lua (0: never); returns the previous value and the number
 * of such collections so far. */
static int lm_cuda_set_gc_step(lua_State *L) {
  lm_state *S = lm_S(L);
  int64_t old = S->gc_step / MOE_GC_MIB;
  if (!lua_isnoneornil(L, 1)) {
    int64_t mb = lm_optint(L, 1, "set_gc_step", "MiB", 0);
    lm_checkend(L, 1, "set_gc_step");
    if (mb < 0 || mb > ((int64_t)1 << 40)) lm_argerror(L, 1, "set_gc_step", "MiB must be in [0, 2^40], got %I", (LUAI_UACINT)mb);
    S->gc_step = mb * MOE_GC_MIB;
    S->gc_debt = 0;
  }
  lua_pushinteger(L, (lua_Integer)old);
  lua_pushinteger(L, (lua_Integer)S->gc_cycles);
  return 2;
}

static int lm_cuda_get_device_name(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_device d = lm_cuda_device_arg(L, S, 1, "get_device_name");
  lm_checkend(L, 1, "get_device_name");
  char name[256];
  int cc = 0;
  size_t mem = 0;
  if (moe_cuda_device_info(S->ctx, d.index, name, sizeof name, &cc, &mem) != MOE_OK)
    return lm_corefail(L, S, "get_device_name", 1);
  lua_pushstring(L, name);
  return 1;
}

/* "13.0" from 13000; "2.28.3" from 22803; "13.1.0" from 130100. */
static const char *lm_fmt_cuda(char *buf, size_t len, int v) {
  snprintf(buf, len, "%d.%d", v / 1000, (v % 1000) / 10);
  return buf;
}

static const char *lm_fmt_mmp(char *buf, size_t len, int v, int major_div) {
  snprintf(buf, len, "%d.%d.%d", v / major_div, (v % major_div) / 100, v % 100);
  return buf;
}

/* moe.build_info(): what this build and machine have, as a table. */
static int lm_build_info(lua_State *L) {
  lm_state *S = lm_S(L);
  int rt = 0, drv = 0, cublas = 0, nccl = 0;
  moe_cuda_versions(&rt, &drv, &cublas, &nccl);
  lua_createtable(L, 0, 10);
  lua_pushliteral(L, MOE_VERSION);
  lua_setfield(L, -2, "version");
  lua_pushliteral(L, LUA_RELEASE);
  lua_setfield(L, -2, "lua");
  lua_pushboolean(L, moe_cuda_built());
  lua_setfield(L, -2, "cuda");
  lm_setint(L, "cuda_runtime", rt);
  lm_setint(L, "cuda_driver", drv);
  lm_setint(L, "cublas", cublas);
  lm_setint(L, "nccl", nccl);
  int n = moe_cuda_device_count(S->ctx);
  lua_createtable(L, n > 0 ? n : 0, 0);
  for (int i = 0; i < n; i++) {
    char name[256], cc_s[16];
    int cc = 0;
    size_t mem = 0;
    if (moe_cuda_device_info(S->ctx, i, name, sizeof name, &cc, &mem) != MOE_OK) continue;
    lua_createtable(L, 0, 4);
    lua_pushstring(L, name);
    lua_setfield(L, -2, "name");
    snprintf(cc_s, sizeof cc_s, "%d.%d", cc / 10, cc % 10);
    lua_pushstring(L, cc_s);
    lua_setfield(L, -2, "cc");
    lm_setint(L, "memory", (int64_t)mem);
    lm_setint(L, "index", i);
    lua_rawseti(L, -2, (lua_Integer)lua_rawlen(L, -2) + 1);
  }
  lua_setfield(L, -2, "gpus");
  return 1;
}

/* moe.version_report(): the text of `moe-lua --version`, one fact a line. */
static int lm_version_report(lua_State *L) {
  lm_state *S = lm_S(L);
  int rt = 0, drv = 0, cublas = 0, nccl = 0;
  char a[32], b[32], c[32], d[32];
  luaL_Buffer B;
  moe_cuda_versions(&rt, &drv, &cublas, &nccl);
  int n = moe_cuda_device_count(S->ctx);
  luaL_buffinit(L, &B);
  lua_pushfstring(L, "moe-lua %s\n%s\n", MOE_VERSION, LUA_COPYRIGHT);
  luaL_addvalue(&B);
  if (moe_cuda_built())
    lua_pushfstring(L, "CUDA: built in; runtime %s, driver %s, cuBLAS %s, NCCL %s\n",
                    rt ? lm_fmt_cuda(a, sizeof a, rt) : "unknown", drv ? lm_fmt_cuda(b, sizeof b, drv) : "none",
                    cublas ? lm_fmt_mmp(c, sizeof c, cublas, 10000) : "unknown",
                    nccl ? lm_fmt_mmp(d, sizeof d, nccl, 10000) : "unknown");
  else
    lua_pushliteral(L, "CUDA: not built in (CPU only)\n");
  luaL_addvalue(&B);
  if (n <= 0) luaL_addstring(&B, "no CUDA GPU visible\n");
  for (int i = 0; i < n; i++) {
    char name[256];
    int cc = 0;
    size_t mem = 0;
    if (moe_cuda_device_info(S->ctx, i, name, sizeof name, &cc, &mem) != MOE_OK)
      lua_pushfstring(L, "GPU %d: %s\n", i, moe_ctx_error(S->ctx));
    else {
      snprintf(a, sizeof a, "%.1f GiB", (double)mem / (1024.0 * 1024.0 * 1024.0));
      lua_pushfstring(L, "GPU %d: %s, compute capability %d.%d, %s\n", i, name, cc / 10, cc % 10, a);
    }
    luaL_addvalue(&B);
  }
  luaL_pushresult(&B);
  return 1;
}

/* ------------------------------------------------------------------ timing */

/* moe.clock(): seconds from a monotonic clock, for timing (with
 * moe.cuda.synchronize() around GPU work). */
static int lm_clock(lua_State *L) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  lua_pushnumber(L, (lua_Number)ts.tv_sec + (lua_Number)ts.tv_nsec * 1e-9);
  return 1;
}

/* ------------------------------------------------------------------- knobs */

/* The kernels' tuning knobs (core/knobs.c's table), by variable name (or
 * field name for the ones without a variable), their values as strings:
 * a choice's name, else the number ("0"/"1" for a bool). */

static const moe_knob_def *lm_checkknob(lua_State *L, int arg, const char *fname) {
  if (lua_type(L, arg) != LUA_TSTRING)
    lm_argerror(L, arg, fname, "knob name (a string) expected, got %s", lm_typename(L, arg));
  const char *name = lua_tostring(L, arg);
  const moe_knob_def *d = moe_knob_find(name);
  if (!d) {
    luaL_Buffer b;
    luaL_buffinit(L, &b);
    for (int i = 0; i < moe_knob_count; i++) {
      if (i) luaL_addstring(&b, ", ");
      luaL_addstring(&b, moe_knob_table[i].env ? moe_knob_table[i].env : moe_knob_table[i].name);
    }
    luaL_pushresult(&b);
    lm_argerror(L, arg, fname, "no knob named '%s' (knobs: %s)", name, lua_tostring(L, -1));
  }
  return d;
}

static void lm_pushknob(lua_State *L, const moe_knob_def *d, int value) {
  char buf[64];
  lua_pushstring(L, moe_knob_format(d, value, buf, sizeof buf));
}

/* moe.knobs() -> {{name =, field =, value =, default =, doc =}, ...} in the table's order. */
static int lm_knobs(lua_State *L) {
  lm_state *S = lm_S(L);
  lm_checkend(L, 0, "knobs");
  lua_createtable(L, moe_knob_count, 0);
  for (int i = 0; i < moe_knob_count; i++) {
    const moe_knob_def *d = &moe_knob_table[i];
    lua_createtable(L, 0, 5);
    lua_pushstring(L, d->env ? d->env : d->name);
    lua_setfield(L, -2, "name");
    lua_pushstring(L, d->name);
    lua_setfield(L, -2, "field");
    lm_pushknob(L, d, moe_knob_current(S->ctx, d));
    lua_setfield(L, -2, "value");
    lm_pushknob(L, d, d->def);
    lua_setfield(L, -2, "default");
    lua_pushstring(L, d->doc);
    lua_setfield(L, -2, "doc");
    lua_rawseti(L, -2, i + 1);
  }
  return 1;
}

/* moe.knob(name) -> the knob's value now. */
static int lm_knob(lua_State *L) {
  lm_state *S = lm_S(L);
  const moe_knob_def *d = lm_checkknob(L, 1, "knob");
  lm_checkend(L, 1, "knob");
  lm_pushknob(L, d, moe_knob_current(S->ctx, d));
  return 1;
}

/* moe.set_knob(name, value) -> the previous value. value: a string, an
 * integer or a boolean (1 / 0); nil sets the default. */
static int lm_set_knob(lua_State *L) {
  lm_state *S = lm_S(L);
  const moe_knob_def *d = lm_checkknob(L, 1, "set_knob");
  char buf[64];
  const char *value = NULL;
  switch (lua_type(L, 2)) {
    case LUA_TNIL:
    case LUA_TNONE:
      break;
    case LUA_TBOOLEAN:
      value = lua_toboolean(L, 2) ? "1" : "0";
      break;
    case LUA_TSTRING:
      value = lua_tostring(L, 2);
      break;
    case LUA_TNUMBER:
      if (!lua_isinteger(L, 2))
        return lm_argerror(L, 2, "set_knob", "value must be an integer, a string or a boolean, got %s",
                           lm_describe(L, 2));
      snprintf(buf, sizeof buf, "%lld", (long long)lua_tointeger(L, 2));
      value = buf;
      break;
    default:
      return lm_argerror(L, 2, "set_knob", "value must be a string, an integer or a boolean, got %s",
                         lm_typename(L, 2));
  }
  lm_checkend(L, 2, "set_knob");
  int prev = 0;
  if (moe_knob_set(S->ctx, lua_tostring(L, 1), value, &prev) != MOE_OK)
    return lm_corefail(L, S, "set_knob", 2);
  lm_pushknob(L, d, prev);
  return 1;
}

/* ----------------------------------------------------------------- opening */

/* def_mb MiB unless the variable var says otherwise (0 turns it off; -1 for
 * a malformed value). A full cycle over the Lua heap of a training script
 * took 0.1 ms on a 2-core CPU (docs/ARCHITECTURE.md). */
int64_t lm_gc_step_default(const char *var, int64_t def_mb) {
  const char *e = getenv(var);
  if (e && *e) {
    char *end = NULL;
    long long v = strtoll(e, &end, 10);
    if (end && *end == '\0' && v >= 0 && v <= ((long long)1 << 40)) return (int64_t)v * MOE_GC_MIB;
    return -1;
  }
  return def_mb * MOE_GC_MIB;
}


static const luaL_Reg lm_device_functions[] = {
    {"manual_seed", lm_manual_seed},
    {"get_rng_state", lm_get_rng_state},
    {"set_rng_state", lm_set_rng_state},
    {"memory_stats", lm_memory_stats},
    {"reset_peak_memory_stats", lm_reset_peak_memory_stats},
    {"empty_cache", lm_empty_cache},
    {"host_reads", lm_host_reads},
    {"build_info", lm_build_info},
    {"version_report", lm_version_report},
    {"clock", lm_clock},
    {"knobs", lm_knobs},
    {"knob", lm_knob},
    {"set_knob", lm_set_knob},
    {NULL, NULL}};

static const luaL_Reg lm_cuda_functions[] = {
    {"is_available", lm_cuda_is_available},
    {"device_count", lm_cuda_device_count},
    {"synchronize", lm_cuda_synchronize},
    {"get_device_name", lm_cuda_get_device_name},
    {"set_gc_step", lm_cuda_set_gc_step},
    {NULL, NULL}};

/* The functions above into the module, and moe.cuda. */
void lm_open_device(lua_State *L, int mod, int methods, int sentinel) {
  mod = lua_absindex(L, mod);
  methods = lua_absindex(L, methods);
  sentinel = lua_absindex(L, sentinel);
  lm_register(L, mod, methods, sentinel, lm_device_functions, NULL);
  luaL_newlibtable(L, lm_cuda_functions);
  lm_register(L, -1, methods, sentinel, lm_cuda_functions, NULL);
  lua_setfield(L, mod, "cuda");
}
