/*
 * lio.c - moe.save and moe.load: safetensors files (core/moe_io.h) from Lua.
 *
 *   moe.save("ckpt.safetensors", {["layer.0.w"] = w, bias = b}, {step = "100"})
 *   local tensors, metadata = moe.load("ckpt.safetensors", {device = "cuda"})
 *
 * save takes a table name -> tensor (names are non-empty strings, tensors
 * are not freed or changed) and an optional table of string -> string
 * metadata; the file is written atomically. load returns a table name ->
 * new tensor and the metadata table (empty when the file has none).
 *
 *   local w = moe.save_async("shard.safetensors", host_tensors, meta [, w_prev])  -- copies, then returns
 *   w:done() -> bool; w:wait() (raises the write's error); w:free() (also __gc, <close>)
 *
 *   local r <close> = moe.open_safetensors("shard.safetensors")  -- the header only
 *   r:entries() -> {name = {dtype =, shape =, offsets = {begin, end}}}   (file bytes)
 *   r:metadata() -> {key = value}
 *   r:read(name [, {offsets =, sizes =, shape =, base =}]) -> a new CPU tensor
 *   r:bytes_read() -> bytes, reads;  r:close() (also __gc, <close>)
 *
 * open_safetensors checks the header as load does and keeps the file open;
 * read reads one box of a tensor (0-based offsets, sizes; default the whole
 * tensor), only its bytes (core/moe_io.h, moe_safetensors_read_box); with
 * shape (and base) the box is in the elements [base, base + numel(shape)) of
 * the stored tensor seen as that shape (a flat range: shape = {n}).
 *
 * save_async copies the tensors' bytes (contiguous CPU or GPU tensors) into one
 * buffer and writes it on a thread (core/moe_io.h): the tensors may change
 * once it returns.
 *
 * Scratch arrays for save live in a userdata (collected if an error unwinds
 * past it). load parks the loaded file in a "moe.SafetensorsBox" userdata
 * whose __gc frees it, so a Lua error while the result tables are built
 * (out of memory) leaks nothing; the box holds a reference to the state so
 * the context outlives the tensors it still owns.
 *
 *   moe.file_digest(path) -> "xxh64:<16 hex digits>", size in bytes
 *   moe.fsync(path)       -> fsync(2) of a file or a folder
 *   moe.digest(s)         -> "xxh64:<16 hex digits>" of the bytes of string s
 *   moe.file_kind(path)   -> "file", "folder", "named pipe", ... or nil (stat, no open)
 *   moe.wall_clock()      -> seconds since the epoch (CLOCK_REALTIME), for timestamps
 *                            other processes compare (launch timelines)
 *
 * are what checkpoints (moe/checkpoint.lua) use to record and verify their
 * files and to make a save durable (core/moe_digest.h). file_digest refuses
 * a path that is not a regular file (a named pipe, a folder, a device).
 */
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "lmoe_internal.h"
#include "moe_digest.h"
#include "moe_io.h"

#define LM_ST_BOX "moe.SafetensorsBox"

typedef struct lm_st_box {
  moe_safetensors *f; /* NULL when empty */
  lm_state *S;        /* one reference while f is not NULL */
} lm_st_box;

static int lm_st_box_gc(lua_State *L) {
  lm_st_box *b = (lm_st_box *)luaL_checkudata(L, 1, LM_ST_BOX);
  if (b->f) {
    moe_safetensors_free(b->f);
    b->f = NULL;
    lm_state_unref(b->S);
    b->S = NULL;
  }
  return 0;
}

/* Counts the entries of the table at arg, checking keys and values; names
 * and tensors are then filled by a second traversal. */
static int lm_save_collect(lua_State *L, int arg, const char **names, moe_tensor **tensors) {
  int n = 0;
  lua_pushnil(L);
  while (lua_next(L, arg)) {
    if (lua_type(L, -2) != LUA_TSTRING)
    {
      const char *tn = luaL_typename(L, -2); /* before lm_describe pushes */
      lm_argerror(L, arg, "save", "tensor names must be strings, got a %s key (%s)", tn,
                  lm_describe(L, -2));
    }
    size_t len = 0;
    const char *name = lua_tolstring(L, -2, &len);
    if (len == 0) lm_argerror(L, arg, "save", "tensor names must be non-empty strings");
    if (strlen(name) != len) lm_argerror(L, arg, "save", "tensor name '%s...' contains a NUL byte", name);
    lm_tensor *u = lm_testtensor(L, -1);
    if (u == NULL)
      lm_argerror(L, arg, "save", "tensors['%s'] must be a tensor, got %s", name, lm_typename(L, -1));
    if (u->t == NULL) lm_argerror(L, arg, "save", "tensors['%s'] is a freed tensor", name);
    if (names) {
      names[n] = name;  /* kept alive by the table, which is on the stack */
      tensors[n] = u->t;
    }
    n++;
    lua_pop(L, 1);
  }
  return n;
}

static int lm_meta_collect(lua_State *L, int arg, const char **keys, const char **values) {
  int n = 0;
  lua_pushnil(L);
  while (lua_next(L, arg)) {
    if (lua_type(L, -2) != LUA_TSTRING)
    {
      const char *tn = luaL_typename(L, -2);
      lm_argerror(L, arg, "save", "metadata keys must be strings, got a %s key (%s)", tn,
                  lm_describe(L, -2));
    }
    if (lua_type(L, -1) != LUA_TSTRING)
      lm_argerror(L, arg, "save", "metadata['%s'] must be a string, got %s", lua_tostring(L, -2),
                  lm_typename(L, -1));
    size_t kl = 0, vl = 0;
    const char *k = lua_tolstring(L, -2, &kl), *v = lua_tolstring(L, -1, &vl);
    if (strlen(k) != kl || strlen(v) != vl)
      lm_argerror(L, arg, "save", "metadata['%s'] contains a NUL byte", k);
    if (keys) {
      keys[n] = lua_tostring(L, -2);
      values[n] = lua_tostring(L, -1);
    }
    n++;
    lua_pop(L, 1);
  }
  return n;
}

/* moe.save(path, tensors [, metadata]) */
static int lm_save(lua_State *L) {
  lm_state *S = lm_S(L);
  if (lua_type(L, 1) != LUA_TSTRING)
    lm_argerror(L, 1, "save", "path must be a string, got %s", lm_typename(L, 1));
  if (lua_type(L, 2) != LUA_TTABLE)
    lm_argerror(L, 2, "save", "table of tensors expected ({name = tensor, ...}), got %s",
                lm_typename(L, 2));
  if (!lua_isnoneornil(L, 3) && lua_type(L, 3) != LUA_TTABLE)
    lm_argerror(L, 3, "save", "metadata table expected ({key = \"value\", ...}), got %s",
                lm_typename(L, 3));
  lm_checkend(L, 3, "save");
  lua_settop(L, 3);
  size_t plen = 0;
  const char *path = lua_tolstring(L, 1, &plen);
  if (strlen(path) != plen) lm_argerror(L, 1, "save", "path contains a NUL byte");
  int n = lm_save_collect(L, 2, NULL, NULL);
  int nm = lua_isnil(L, 3) ? 0 : lm_meta_collect(L, 3, NULL, NULL);
  /* scratch: n names, n tensors, nm keys, nm values */
  void **scratch = (void **)lua_newuserdatauv(L, sizeof(void *) * (size_t)(2 * n + 2 * nm + 1), 0);
  const char **names = (const char **)scratch;
  moe_tensor **tensors = (moe_tensor **)(scratch + n);
  const char **keys = (const char **)(scratch + 2 * n);
  const char **values = (const char **)(scratch + 2 * n + nm);
  lm_save_collect(L, 2, names, tensors);
  if (nm > 0) lm_meta_collect(L, 3, keys, values);
  moe_status st;
  LM_CALL(L, st, moe_safetensors_save(S->ctx, path, n, names, tensors, nm, keys, values));
  if (st != MOE_OK) return lm_corefail(L, S, "save", 0);
  return 0;
}

/* moe.load(path [, {device = "cuda"}]) -> tensors, metadata */
static int lm_load(lua_State *L) {
  lm_state *S = lm_S(L);
  moe_device d = MOE_CPU;
  if (lua_type(L, 1) != LUA_TSTRING)
    lm_argerror(L, 1, "load", "path must be a string, got %s", lm_typename(L, 1));
  if (!lua_isnoneornil(L, 2)) {
    if (lua_type(L, 2) != LUA_TTABLE)
      lm_argerror(L, 2, "load", "options table expected ({device = ...}), got %s", lm_typename(L, 2));
    lua_pushnil(L);
    while (lua_next(L, 2)) {
      if (lua_type(L, -2) != LUA_TSTRING)
        lm_argerror(L, 2, "load", "options are given by name ({device = ...}), got a %s key",
                    luaL_typename(L, -2));
      const char *k = lua_tostring(L, -2);
      if (strcmp(k, "device") != 0)
        lm_argerror(L, 2, "load", "unknown option '%s' (valid options: device)", k);
      d = lm_checkdevice_at(L, S, lua_gettop(L), 2, "load");
      lua_pop(L, 1);
    }
  }
  lm_checkend(L, 2, "load");
  size_t plen = 0;
  const char *path = lua_tolstring(L, 1, &plen);
  if (strlen(path) != plen) lm_argerror(L, 1, "load", "path contains a NUL byte");

  lm_st_box *box = (lm_st_box *)lua_newuserdatauv(L, sizeof *box, 0);
  box->f = NULL;
  box->S = NULL;
  luaL_setmetatable(L, LM_ST_BOX);
  moe_safetensors *f = NULL;
  moe_status st;
  LM_CALL(L, st, moe_safetensors_load(S->ctx, path, d, &f));
  if (st != MOE_OK) return lm_corefail(L, S, "load", 0);
  box->f = f;
  box->S = S;
  S->refs++;

  int64_t n = moe_safetensors_count(f), nm = moe_safetensors_metadata_count(f);
  lua_createtable(L, 0, n > INT32_MAX ? 0 : (int)n);
  int ti = lua_gettop(L);
  for (int64_t i = 0; i < n; i++) {
    lm_tensor *u = lm_push_empty(L);
    moe_tensor *t = moe_safetensors_tensor(f, i);
    moe_tensor_retain(t);
    lm_adopt(u, S, t);
    lua_setfield(L, ti, moe_safetensors_name(f, i));
  }
  lua_createtable(L, 0, nm > INT32_MAX ? 0 : (int)nm);
  for (int64_t i = 0; i < nm; i++) {
    lua_pushstring(L, moe_safetensors_metadata_value(f, i));
    lua_setfield(L, -2, moe_safetensors_metadata_key(f, i));
  }
  /* the tables own their tensors now: drop the file's references */
  moe_safetensors_free(box->f);
  box->f = NULL;
  lm_state_unref(box->S);
  box->S = NULL;
  return 2;
}

/* A path argument: a string without NUL bytes. */
static const char *lm_io_path(lua_State *L, int arg, const char *fname) {
  if (lua_type(L, arg) != LUA_TSTRING)
    lm_argerror(L, arg, fname, "path must be a string, got %s", lm_typename(L, arg));
  size_t plen = 0;
  const char *path = lua_tolstring(L, arg, &plen);
  if (strlen(path) != plen) lm_argerror(L, arg, fname, "path contains a NUL byte");
  return path;
}

/* moe.file_digest(path) -> "xxh64:<hex>", size */
static int lm_file_digest(lua_State *L) {
  lm_state *S = lm_S(L);
  const char *path = lm_io_path(L, 1, "file_digest");
  lm_checkend(L, 1, "file_digest");
  uint64_t d = 0, size = 0;
  if (moe_file_digest(S->ctx, path, &d, &size) != MOE_OK) return lm_corefail(L, S, "file_digest", 0);
  char hex[32];
  snprintf(hex, sizeof hex, "xxh64:%016llx", (unsigned long long)d);
  lua_pushstring(L, hex);
  lua_pushinteger(L, (lua_Integer)size);
  return 2;
}

/* moe.digest(s) -> "xxh64:<hex>" */
static int lm_digest(lua_State *L) {
  if (lua_type(L, 1) != LUA_TSTRING)
    lm_argerror(L, 1, "digest", "string expected, got %s", lm_typename(L, 1));
  lm_checkend(L, 1, "digest");
  size_t n = 0;
  const char *p = lua_tolstring(L, 1, &n);
  char hex[32];
  snprintf(hex, sizeof hex, "xxh64:%016llx", (unsigned long long)moe_xxh64(p, n, 0));
  lua_pushstring(L, hex);
  return 1;
}

/* moe.file_kind(path) -> "file" | "folder" | "named pipe" | ... | nil */
static int lm_file_kind(lua_State *L) {
  const char *path = lm_io_path(L, 1, "file_kind");
  lm_checkend(L, 1, "file_kind");
  const char *k = moe_file_kind(path);
  if (k) lua_pushstring(L, k);
  else lua_pushnil(L);
  return 1;
}

/* moe.wall_clock() -> seconds since the epoch (CLOCK_REALTIME, ns resolution):
 * timestamps that other processes compare (moe.clock is monotonic and this
 * process's own) */
static int lm_wall_clock(lua_State *L) {
  lm_checkend(L, 0, "wall_clock");
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  lua_pushnumber(L, (lua_Number)ts.tv_sec + (lua_Number)ts.tv_nsec * 1e-9);
  return 1;
}

/* moe.fsync(path) */
static int lm_fsync(lua_State *L) {
  lm_state *S = lm_S(L);
  const char *path = lm_io_path(L, 1, "fsync");
  lm_checkend(L, 1, "fsync");
  if (moe_file_sync(S->ctx, path) != MOE_OK) return lm_corefail(L, S, "fsync", 0);
  return 0;
}

/* ------------------------------------------------------- moe.save_async */

#define LM_ST_WRITER "moe.SafetensorsWriter"

typedef struct lm_st_writer {
  moe_safetensors_writer *w; /* NULL once freed */
  lm_state *S;               /* one reference while w is not NULL */
} lm_st_writer;

static lm_st_writer *lm_check_writer(lua_State *L, const char *fname) {
  lm_st_writer *u = (lm_st_writer *)luaL_testudata(L, 1, LM_ST_WRITER);
  if (u == NULL) lm_argerror(L, 1, fname, "save_async writer expected, got %s", lm_typename(L, 1));
  return u;
}

/* Joins the thread (if it runs) and releases everything; idempotent. */
static int lm_writer_free(lua_State *L) {
  lm_st_writer *u = (lm_st_writer *)luaL_checkudata(L, 1, LM_ST_WRITER);
  if (u->w) {
    moe_safetensors_writer_free(u->w);
    u->w = NULL;
    lm_state_unref(u->S);
    u->S = NULL;
  }
  return 0;
}

/* w:wait(): joins the writer; raises the write's error. Again: the same. */
static int lm_writer_wait(lua_State *L) {
  lm_st_writer *u = lm_check_writer(L, "wait");
  if (u->w == NULL) return luaL_error(L, "wait: attempt to use a freed save_async writer");
  lm_state *S = u->S;
  moe_status st = moe_safetensors_writer_wait(S->ctx, u->w);
  if (st != MOE_OK) return lm_corefail(L, S, "save_async", 0);
  return 0;
}

/* w:done() -> true once the file is written (or the write failed). */
static int lm_writer_done(lua_State *L) {
  lm_st_writer *u = lm_check_writer(L, "done");
  lua_pushboolean(L, u->w == NULL || moe_safetensors_writer_done(u->w));
  return 1;
}

/* moe.save_async(path, tensors [, metadata [, reuse]]) -> writer: moe.save
 * on a thread; tensors must be contiguous (CPU or GPU: copied into the
 * writer's buffer before the call returns); reuse: an earlier writer whose
 * buffer the copy may take. */
static int lm_save_async(lua_State *L) {
  lm_state *S = lm_S(L);
  if (lua_type(L, 1) != LUA_TSTRING)
    lm_argerror(L, 1, "save_async", "path must be a string, got %s", lm_typename(L, 1));
  if (lua_type(L, 2) != LUA_TTABLE)
    lm_argerror(L, 2, "save_async", "table of tensors expected ({name = tensor, ...}), got %s",
                lm_typename(L, 2));
  if (!lua_isnoneornil(L, 3) && lua_type(L, 3) != LUA_TTABLE)
    lm_argerror(L, 3, "save_async", "metadata table expected ({key = \"value\", ...}), got %s",
                lm_typename(L, 3));
  lm_st_writer *reuse = NULL;
  if (!lua_isnoneornil(L, 4)) {
    reuse = (lm_st_writer *)luaL_testudata(L, 4, LM_ST_WRITER);
    if (reuse == NULL)
      lm_argerror(L, 4, "save_async", "an earlier save_async writer expected (reuse), got %s", lm_typename(L, 4));
  }
  lm_checkend(L, 4, "save_async");
  lua_settop(L, 4);
  size_t plen = 0;
  const char *path = lua_tolstring(L, 1, &plen);
  if (strlen(path) != plen) lm_argerror(L, 1, "save_async", "path contains a NUL byte");
  int n = lm_save_collect(L, 2, NULL, NULL);
  int nm = lua_isnil(L, 3) ? 0 : lm_meta_collect(L, 3, NULL, NULL);
  void **scratch = (void **)lua_newuserdatauv(L, sizeof(void *) * (size_t)(2 * n + 2 * nm + 1), 0);
  const char **names = (const char **)scratch;
  moe_tensor **tensors = (moe_tensor **)(scratch + n);
  const char **keys = (const char **)(scratch + 2 * n);
  const char **values = (const char **)(scratch + 2 * n + nm);
  lm_save_collect(L, 2, names, tensors);
  if (nm > 0) lm_meta_collect(L, 3, keys, values);
  if (reuse && reuse->w == NULL) lm_argerror(L, 4, "save_async", "reuse is a freed writer");
  lm_st_writer *u = (lm_st_writer *)lua_newuserdatauv(L, sizeof *u, 0);
  u->w = NULL;
  u->S = NULL;
  luaL_setmetatable(L, LM_ST_WRITER);
  moe_safetensors_writer *w = NULL;
  moe_status st;
  LM_CALL(L, st, moe_safetensors_save_async(S->ctx, path, n, names, tensors, nm, keys, values,
                                                reuse ? reuse->w : NULL, &w));
  if (st != MOE_OK) return lm_corefail(L, S, "save_async", 0);
  u->w = w;
  u->S = S;
  S->refs++;
  return 1;
}

/* ------------------------------------------------- moe.open_safetensors */

#define LM_ST_READER "moe.SafetensorsReader"

typedef struct lm_st_reader {
  moe_safetensors_reader *r; /* NULL once closed */
  lm_state *S;               /* one reference while r is not NULL */
} lm_st_reader;

/* Closes the file and frees the header; idempotent (close, __gc, __close). */
static int lm_reader_close(lua_State *L) {
  lm_st_reader *u = (lm_st_reader *)luaL_checkudata(L, 1, LM_ST_READER);
  if (u->r) {
    moe_safetensors_reader_free(u->r);
    u->r = NULL;
    lm_state_unref(u->S);
    u->S = NULL;
  }
  return 0;
}

static lm_st_reader *lm_check_reader(lua_State *L, const char *fname) {
  lm_st_reader *u = (lm_st_reader *)luaL_testudata(L, 1, LM_ST_READER);
  if (u == NULL) lm_argerror(L, 1, fname, "safetensors reader expected, got %s", lm_typename(L, 1));
  if (u->r == NULL) luaL_error(L, "%s: attempt to use a closed safetensors reader", fname);
  return u;
}

/* r:entries() -> {name = {dtype =, shape =, offsets = {begin, end} (file bytes)}} */
static int lm_reader_entries(lua_State *L) {
  lm_st_reader *u = lm_check_reader(L, "entries");
  lm_checkend(L, 1, "entries");
  int64_t n = moe_safetensors_reader_count(u->r);
  lua_createtable(L, 0, n > INT32_MAX ? 0 : (int)n);
  for (int64_t i = 0; i < n; i++) {
    moe_dtype dt;
    int ndim = 0;
    int64_t shape[MOE_MAX_DIMS];
    uint64_t b = 0, e = 0;
    moe_safetensors_reader_entry(u->r, i, &dt, &ndim, shape, &b, &e);
    lua_createtable(L, 0, 3);
    lua_pushstring(L, moe_dtype_name(dt));
    lua_setfield(L, -2, "dtype");
    lm_push_ints(L, ndim, shape);
    lua_setfield(L, -2, "shape");
    int64_t off[2] = {(int64_t)b, (int64_t)e};
    lm_push_ints(L, 2, off);
    lua_setfield(L, -2, "offsets");
    lua_setfield(L, -2, moe_safetensors_reader_name(u->r, i));
  }
  return 1;
}

/* r:metadata() -> {key = value} */
static int lm_reader_metadata(lua_State *L) {
  lm_st_reader *u = lm_check_reader(L, "metadata");
  lm_checkend(L, 1, "metadata");
  int64_t n = moe_safetensors_reader_metadata_count(u->r);
  lua_createtable(L, 0, n > INT32_MAX ? 0 : (int)n);
  for (int64_t i = 0; i < n; i++) {
    lua_pushstring(L, moe_safetensors_reader_metadata_value(u->r, i));
    lua_setfield(L, -2, moe_safetensors_reader_metadata_key(u->r, i));
  }
  return 1;
}

/* r:bytes_read() -> bytes, reads */
static int lm_reader_bytes(lua_State *L) {
  lm_st_reader *u = lm_check_reader(L, "bytes_read");
  lm_checkend(L, 1, "bytes_read");
  uint64_t reads = 0, bytes = moe_safetensors_reader_bytes(u->r, &reads);
  lua_pushinteger(L, (lua_Integer)bytes);
  lua_pushinteger(L, (lua_Integer)reads);
  return 2;
}

/* Reads a list of integers (at most MOE_MAX_DIMS) at field key of the
 * table at arg; returns its length, -1 when the field is nil. */
static int lm_box_field(lua_State *L, int arg, const char *key, int64_t *v) {
  int n = -1;
  if (lua_getfield(L, arg, key) != LUA_TNIL) {
    if (!lua_istable(L, -1))
      lm_argerror(L, arg, "read", "box.%s must be a list of integers, got %s", key, lm_typename(L, -1));
    lua_Integer len = luaL_len(L, -1);
    if (len > MOE_MAX_DIMS)
      lm_argerror(L, arg, "read", "box.%s has %lld items (at most %d dims)", key, (long long)len, MOE_MAX_DIMS);
    n = (int)len;
    for (int i = 0; i < n; i++) {
      lua_rawgeti(L, -1, i + 1);
      int ok = 0;
      lua_Integer x = lua_tointegerx(L, -1, &ok);
      if (!ok) lm_argerror(L, arg, "read", "box.%s[%d] must be an integer, got %s", key, i + 1, lm_describe(L, -1));
      v[i] = (int64_t)x;
      lua_pop(L, 1);
    }
  }
  lua_pop(L, 1);
  return n;
}

/* r:read(name [, {offsets =, sizes =, shape =, base =}]) -> a new CPU tensor */
static int lm_reader_read(lua_State *L) {
  lm_st_reader *u = lm_check_reader(L, "read");
  lm_state *S = u->S;
  if (lua_type(L, 2) != LUA_TSTRING) lm_argerror(L, 2, "read", "tensor name expected, got %s", lm_typename(L, 2));
  const char *name = lua_tostring(L, 2);
  int64_t i = moe_safetensors_reader_find(u->r, name);
  if (i < 0) lm_argerror(L, 2, "read", "the file has no tensor '%s'", name);
  int64_t offsets[MOE_MAX_DIMS], sizes[MOE_MAX_DIMS], shape[MOE_MAX_DIMS], base = 0;
  int no = -1, ns = -1, nsh = -1;
  if (!lua_isnoneornil(L, 3)) {
    if (!lua_istable(L, 3))
      lm_argerror(L, 3, "read", "box table expected ({offsets =, sizes =, shape =, base =}), got %s",
                  lm_typename(L, 3));
    static const char *const known[] = {"offsets", "sizes", "shape", "base", NULL};
    lm_checkkeys(L, 3, "read", known);
    no = lm_box_field(L, 3, "offsets", offsets);
    ns = lm_box_field(L, 3, "sizes", sizes);
    nsh = lm_box_field(L, 3, "shape", shape);
    if (lua_getfield(L, 3, "base") != LUA_TNIL) {
      int ok = 0;
      base = (int64_t)lua_tointegerx(L, -1, &ok);
      if (!ok) lm_argerror(L, 3, "read", "box.base must be an integer, got %s", lm_describe(L, -1));
    }
    lua_pop(L, 1);
  }
  lm_checkend(L, 3, "read");
  int ndim = 0;
  moe_safetensors_reader_entry(u->r, i, NULL, &ndim, NULL, NULL, NULL);
  if (nsh >= 0) ndim = nsh;
  if ((no >= 0) != (ns >= 0)) lm_argerror(L, 3, "read", "give box.offsets and box.sizes together");
  if (no >= 0 && (no != ndim || ns != ndim))
    lm_argerror(L, 3, "read", "box.offsets and box.sizes need %d items (the %s's dims), got %d and %d", ndim,
                nsh >= 0 ? "view" : "tensor", no, ns);
  lm_tensor *res = lm_push_empty(L);
  moe_tensor *out = NULL;
  moe_status st;
  LM_CALL(L, st, moe_safetensors_read_box(S->ctx, u->r, i, base, ndim, nsh >= 0 ? shape : NULL,
                                          no >= 0 ? offsets : NULL, ns >= 0 ? sizes : NULL, &out));
  return lm_result(L, S, res, st, out, "read", 0);
}

/* moe.open_safetensors(path) -> reader */
static int lm_open_safetensors(lua_State *L) {
  lm_state *S = lm_S(L);
  const char *path = lm_io_path(L, 1, "open_safetensors");
  lm_checkend(L, 1, "open_safetensors");
  lm_st_reader *u = (lm_st_reader *)lua_newuserdatauv(L, sizeof *u, 0);
  u->r = NULL;
  u->S = NULL;
  luaL_setmetatable(L, LM_ST_READER);
  moe_safetensors_reader *r = NULL;
  moe_status st;
  LM_CALL(L, st, moe_safetensors_open(S->ctx, path, &r));
  if (st != MOE_OK) return lm_corefail(L, S, "open_safetensors", 0);
  u->r = r;
  u->S = S;
  S->refs++;
  return 1;
}

static const luaL_Reg lm_reader_methods[] = {{"entries", lm_reader_entries}, {"metadata", lm_reader_metadata},
                                             {"read", lm_reader_read},       {"bytes_read", lm_reader_bytes},
                                             {"close", lm_reader_close},     {NULL, NULL}};

static const luaL_Reg lm_writer_methods[] = {{"wait", lm_writer_wait}, {"done", lm_writer_done},
                                             {"free", lm_writer_free}, {NULL, NULL}};

static const luaL_Reg lm_io_functions[] = {{"save", lm_save},
                                           {"load", lm_load},
                                           {"save_async", lm_save_async},
                                           {"file_digest", lm_file_digest},
                                           {"fsync", lm_fsync},
                                           {"digest", lm_digest},
                                           {"file_kind", lm_file_kind},
                                           {"open_safetensors", lm_open_safetensors},
                                           {"wall_clock", lm_wall_clock},
                                           {NULL, NULL}};

void lm_open_io(lua_State *L, int mod, int methods, int sentinel) {
  if (luaL_newmetatable(L, LM_ST_BOX)) {
    lua_pushcfunction(L, lm_st_box_gc);
    lua_setfield(L, -2, "__gc");
  }
  lua_pop(L, 1);
  if (luaL_newmetatable(L, LM_ST_WRITER)) {
    lua_pushcfunction(L, lm_writer_free);
    lua_setfield(L, -2, "__gc");
    lua_pushcfunction(L, lm_writer_free);
    lua_setfield(L, -2, "__close");
    luaL_newlib(L, lm_writer_methods);
    lua_setfield(L, -2, "__index");
  }
  lua_pop(L, 1);
  if (luaL_newmetatable(L, LM_ST_READER)) {
    lua_pushcfunction(L, lm_reader_close);
    lua_setfield(L, -2, "__gc");
    lua_pushcfunction(L, lm_reader_close);
    lua_setfield(L, -2, "__close");
    luaL_newlib(L, lm_reader_methods);
    lua_setfield(L, -2, "__index");
  }
  lua_pop(L, 1);
  lm_register(L, mod, methods, sentinel, lm_io_functions, NULL);
}
