/*
 * host.c - the moe-lua executable: Lua 5.4's stand-alone interpreter (lua.c)
 * with the `moe` module compiled in, the repository's lua/ folder on
 * package.path, and subcommands written in Lua.
 *
 *   moe-lua [options] [script [args]]     as lua5.4: -e -l -i -v -E -W -- -
 *   moe-lua script.lua key=value ...      experiment overrides (moe.config)
 *   moe-lua <command> [args]              lua/moe/cli/<command>.lua: help, version, ...
 *
 * Behaviour kept from lua.c (STYLE.md point 14):
 *   - main only creates the state and runs pmain under lua_pcall, so that
 *     even a memory error while handling arguments is reported, not fatal;
 *     every chunk runs under a message handler that appends a traceback; an
 *     error prints "moe-lua: message" and the traceback to stderr and the
 *     exit status is 1. Changed, for a user's mistake (see msghandler):
 *     the message goes alone, one line, without a traceback and without a
 *     position inside the library (lua/moe/...); MOE_TRACEBACK=1 keeps the
 *     message as raised and adds the traceback. A user's mistake is an
 *     error raised without a "source:line:" position (error(m, 0):
 *     moe.config's bad keys and values, the commands' argument checks), one
 *     raised by error() in the library's Lua code (a missing checkpoint, a
 *     bad layer argument), or one a C function raises at the script's line
 *     (the bindings' "bad argument #2 to 'matmul' (...)"). A runtime error
 *     (attempt to index nil, ...), an "assertion failed!", or an error() in
 *     the user's own script keeps lua's message and traceback: those are
 *     bugs, the library's or the script's.
 *   - The global `arg` table: arg[0] is the script, arg[1..] its arguments,
 *     negative indices the interpreter and its options (arg[0] is the
 *     interpreter when there is no script).
 *   - Ctrl-C while Lua runs sets a hook that raises "interrupted!" at the next
 *     Lua instruction, call or return: a safe point, never inside C code (a
 *     second Ctrl-C before that kills the process, as in lua.c), positioned
 *     at the innermost line running and with a traceback. Added:
 *     SIGTERM does the same with "terminated", and when such an error ends
 *     the run the exit status is 128 + the signal (130, 143), as a shell
 *     reports a process the signal killed. SIGTERMs after the first are
 *     ignored rather than fatal: a process manager (mpirun stopping a job)
 *     may send more than one, and follows with SIGKILL anyway; so the
 *     process gets to report, finalize and write its exit record. The REPL
 *     ends on SIGTERM.
 *     A soft stop (moe.proc.soft_stop, bindings/lproc.c: what moe.train's
 *     loop arms) takes the first SIGINT or SIGTERM instead: no hook, the loop
 *     sees the flag at its next step boundary, saves and ends with its own
 *     message; the status is still 128 + the signal, and after a stop the
 *     loop declared done (moe.proc.stopped) a rank of a job finalizes as
 *     usual instead of ending the job at once. A second signal is handled
 *     as above.
 *   - lua_close before returning, which runs every finalizer: tensors free
 *     their storage before the moe context, and the context before CUDA goes.
 * Added: `moe` in package.preload, the Lua library first on package.path
 * (an installed copy's own prefix, else the source's lua/: setup_path),
 * --version/--help, subcommands (a first argument that is not a file but
 * names a module moe.cli.<name> runs its main(...), which gets every later
 * argument, --help included), and
 * package.loaded["moe.host"] = {usage = <the text below>} for `moe-lua help`.
 * --help, -h and `moe-lua` alone on a terminal run `moe-lua help` (the
 * options and the commands, one line each); `moe-lua -i` is the REPL, and
 * with stdin not a terminal `moe-lua` alone runs stdin, as lua does.
 *
 * A rank of a launched job (mpirun, srun, torchrun: moe_dist_env_read), set
 * up in main before the state exists:
 *   - RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE are set from the
 *     launcher's variables (torchrun's names, for tools that expect them);
 *     MASTER_ADDR and MASTER_PORT are left to the launcher.
 *   - Ranks other than 0 send stdout to /dev/null unless MOE_DIST_PRINT=all.
 *   - In a job of several ranks, every line of an error the host reports
 *     and of a Lua warning starts with "[rank r] ":
 *     "moe-lua: [rank 1] boom.lua:3: bad".
 *   - With MOE_LAUNCH_DIR set (by `moe-lua launch`), the process writes
 *     $MOE_LAUNCH_DIR/rank-<r>.exit when it exits, os.exit included: its
 *     status, the time and the first line of the error (see
 *     write_exit_record). A rank killed outright writes nothing. The
 *     variable is removed from the environment, so that processes this one
 *     starts do not write the rank's record.
 * A launcher variable that is not a number (or a rank not below its size)
 * stops the host at once with the message and status 1.
 */
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "lauxlib.h"
#include "lua.h"
#include "lualib.h"

#include "lmoe.h"
#include "moe.h"

#define PROGNAME "moe-lua"
#define INIT_VAR "LUA_INIT"
#define INIT_VAR_VERSION INIT_VAR LUA_VERSUFFIX

static const char *progname = PROGNAME; /* NULL in the REPL: no prefix */
static lua_State *globalL = NULL;       /* the state the signal hook goes to */
static volatile sig_atomic_t got_signal = 0; /* SIGINT or SIGTERM during the last call */

/* The job this process is a rank of (setup_job). */
static moe_dist_env job = {0, 1, 0, 1, "none"};
static char rank_prefix[32] = "";         /* "[rank r] " in a job of several ranks */
static char record_dir[PATH_MAX] = "";    /* MOE_LAUNCH_DIR; "" when unset */
static char last_error[512] = "";         /* first line of the last error reported */
static int record_status = -1;            /* the exit status for the record; -1 unknown */
static int record_signal = 0;             /* the signal that ended the run, 0 none */
static char lib_root[PATH_MAX] = "";      /* "<dir>/moe/": where moe.config is; "" unknown */
static char *repl_line = NULL;          /* getline's buffer, freed in main */
static size_t repl_cap = 0;

static const char usage_text[] =
    "usage: " PROGNAME " [options] [script [args]]\n"
    "       " PROGNAME " <command> [args]       (" PROGNAME " help lists the commands)\n"
    "Available options are:\n"
    "  -e stat   execute string 'stat'\n"
    "  -i        enter interactive mode after executing 'script'\n"
    "  -l mod    require library 'mod' into global 'mod'\n"
    "  -l g=mod  require library 'mod' into global 'g'\n"
    "  -v        show version information (also --version)\n"
    "  -E        ignore environment variables\n"
    "  -W        turn warnings on\n"
    "  -h        show this help and the commands (also --help)\n"
    "  --        stop handling options\n"
    "  -         stop handling options and execute stdin\n"
    "Experiment overrides follow the script: " PROGNAME " script.lua key=value ...\n"
    "(" PROGNAME " script.lua --help lists a script's keys).\n";

/* ------------------------------------------------------------ messages */

/* Keeps the first line of msg (at most sizeof last_error - 1 bytes) for the
 * exit record. */
static void keep_error(const char *msg) {
  size_t n = strcspn(msg, "\n");
  if (n > sizeof last_error - 1) n = sizeof last_error - 1;
  memcpy(last_error, msg, n);
  last_error[n] = '\0';
}

/* "pname: msg\n" to stderr in one write; in a job of several ranks every
 * line of msg starts with the rank prefix ("[rank 1] "), so that the lines of
 * ranks writing at once can be told apart. */
static void l_message(const char *pname, const char *msg) {
  keep_error(msg);
  size_t lp = strlen(rank_prefix), lines = 1;
  if (lp == 0) {
    if (pname) fprintf(stderr, "%s: ", pname);
    fprintf(stderr, "%s\n", msg);
    fflush(stderr);
    return;
  }
  for (const char *c = msg; *c; c++) lines += *c == '\n';
  size_t cap = (pname ? strlen(pname) + 2 : 0) + lines * lp + strlen(msg) + 2;
  char *buf = (char *)malloc(cap), *w = buf;
  if (buf == NULL) { /* no memory: the same text, in several writes */
    if (pname) fprintf(stderr, "%s: ", pname);
    fprintf(stderr, "%s%s\n", rank_prefix, msg);
    fflush(stderr);
    return;
  }
  if (pname) w += sprintf(w, "%s: ", pname);
  for (const char *c = msg;;) {
    memcpy(w, rank_prefix, lp);
    w += lp;
    size_t n = strcspn(c, "\n");
    memcpy(w, c, n);
    w += n;
    *w++ = '\n';
    if (c[n] == '\0') break;
    c += n + 1;
  }
  fwrite(buf, 1, (size_t)(w - buf), stderr);
  fflush(stderr);
  free(buf);
}

/* Prints the error message at the top of the stack, if status is an error. */
static int report(lua_State *L, int status) {
  if (status != LUA_OK) {
    const char *msg = lua_tostring(L, -1);
    if (msg == NULL) msg = "(error object is not a string)";
    l_message(progname, msg);
    lua_pop(L, 1);
  }
  return status;
}

static void print_usage(const char *badoption) {
  if (badoption[1] == 'e' || badoption[1] == 'l')
    fprintf(stderr, "%s: %s'%s' needs argument\n", PROGNAME, rank_prefix, badoption);
  else
    fprintf(stderr, "%s: %sunrecognized option '%s'\n", PROGNAME, rank_prefix, badoption);
  fputs(usage_text, stderr);
  fflush(stderr);
}

/* Whether the first line of msg holds "<source>:<line>:", as the errors
 * Lua positions do (error(m) at level 1 or more, runtime errors, luaL_error). */
static int has_position(const char *msg) {
  for (const char *c = msg; *c && *c != '\n'; c++) {
    if (c[0] != ':' || c[1] < '0' || c[1] > '9') continue;
    const char *d = c + 1;
    while (*d >= '0' && *d <= '9') d++;
    if (*d == ':') return 1;
  }
  return 0;
}

/* Whether the chunk name src (a source "@path" without its '@', or the
 * short_src of a message, which may start with "..." and keep only the end
 * of a long path) names a file of the library: under lib_root. */
static int in_library(const char *src) {
  size_t nr = strlen(lib_root);
  if (nr == 0) return 0;
  if (strncmp(src, lib_root, nr) == 0) return 1;
  if (strncmp(src, "...", 3) != 0) return 0;
  src += 3; /* the end of a path: does it start with an end of lib_root? */
  for (size_t i = 0; i + 4 <= nr; i++) /* at least "moe/" */
    if (strncmp(src, lib_root + i, nr - i) == 0) return 1;
  return 0;
}

/* The length of msg's leading "source:line: " (0 when there is none); when
 * lib is not NULL, *lib tells whether source is a library file. */
static size_t position_length(const char *msg, int *lib) {
  if (lib) *lib = 0;
  for (const char *c = msg; *c && *c != '\n'; c++) {
    if (c[0] != ':' || c[1] < '0' || c[1] > '9') continue;
    const char *d = c + 1;
    while (*d >= '0' && *d <= '9') d++;
    if (*d != ':') continue;
    if (lib) {
      char src[PATH_MAX];
      size_t n = (size_t)(c - msg);
      if (n < sizeof src) {
        memcpy(src, msg, n);
        src[n] = '\0';
        *lib = in_library(src);
      }
    }
    return (size_t)(d + 1 - msg) + (d[1] == ' ');
  }
  return 0;
}

/* Lua's own runtime errors: a bug wherever they come from, even when the
 * library caught and raised them again. */
static int is_runtime_error(const char *text) {
  static const char *const starts[] = {
      "attempt to ", "bad argument #", "stack overflow", "C stack overflow", "table index is ",
      "number has no integer representation", "'for' ", "assertion failed!", "invalid key to 'next'",
  };
  for (size_t i = 0; i < sizeof starts / sizeof starts[0]; i++)
    if (strncmp(text, starts[i], strlen(starts[i])) == 0) return 1;
  return 0;
}

/* Who raised the error being handled: RAISED_LIBRARY when Lua's error()
 * (the one saved at start-up) was called from the library's Lua code,
 * RAISED_C when a C function other than error() raised it (luaL_error,
 * luaL_argerror: a bad argument to a C function), RAISED_OTHER otherwise
 * (a runtime error in Lua code, the script's own error()). */
enum { RAISED_OTHER, RAISED_LIBRARY, RAISED_C };
static int raised_by(lua_State *L) {
  lua_Debug ar;
  if (!lua_getstack(L, 1, &ar) || !lua_getinfo(L, "Sf", &ar)) return RAISED_OTHER;
  lua_getfield(L, LUA_REGISTRYINDEX, "moe.host.error");
  int is_error = lua_rawequal(L, -1, -2);
  lua_pop(L, 2);
  if (!is_error) return strcmp(ar.what, "C") == 0 ? RAISED_C : RAISED_OTHER;
  if (!lua_getstack(L, 2, &ar) || !lua_getinfo(L, "S", &ar)) return RAISED_OTHER;
  return ar.source[0] == '@' && in_library(ar.source + 1) ? RAISED_LIBRARY : RAISED_OTHER;
}

/* The message handler of every call: the message plus a traceback, except
 * for a user's mistake (the header comment), which goes alone:
 *   - a message without a position;
 *   - one raised by error() in the library, with a library position taken
 *     off ("checkpoint.load: 'x' has no state.json", not
 *     ".../lua/moe/train/build.lua:55: checkpoint.load: ..."); a library
 *     error positioned in the user's script ("run.lua:7: ...", error(m, 2))
 *     keeps the script's position;
 *   - one raised by a C function at the script's line ("run.lua:7: bad
 *     argument #1 to 'zeros' (...)").
 * Lua's runtime errors (attempt to index nil, "assertion failed!", a bad
 * argument passed by the library's own code) keep the traceback: bugs.
 * MOE_TRACEBACK=1: every message as raised, with the traceback. */
static int msghandler(lua_State *L) {
  const char *msg = lua_tostring(L, 1);
  if (msg == NULL) {
    if (luaL_callmeta(L, 1, "__tostring") && lua_type(L, -1) == LUA_TSTRING) return 1;
    msg = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
  }
  const char *always = getenv("MOE_TRACEBACK");
  if (!(always && strcmp(always, "1") == 0)) {
    if (!has_position(msg)) {
      if (!is_runtime_error(msg)) return 1;
    } else {
      int who = raised_by(L), lib;
      size_t skip = position_length(msg, &lib);
      if (who == RAISED_LIBRARY && !is_runtime_error(msg + (lib ? skip : 0))) {
        lua_pushstring(L, msg + (lib ? skip : 0));
        return 1;
      }
      /* at the script's line, not an error passed on (coroutine.wrap), not
       * the signal hook's "interrupted!" (where it stopped is the point) */
      if (who == RAISED_C && !lib && !has_position(msg + skip) && !got_signal &&
          strcmp(msg + skip, "assertion failed!") != 0)
        return 1;
    }
  }
  luaL_traceback(L, L, msg, 1);
  return 1;
}

/* ------------------------------------------------- Ctrl-C and SIGTERM */

static void set_signal(int sig, void (*handler)(int)) {
  struct sigaction sa;
  sa.sa_handler = handler;
  sa.sa_flags = 0;
  sigemptyset(&sa.sa_mask);
  sigaction(sig, &sa, NULL);
}

/* The hook: runs at the next safe point of the interpreter. The message is
 * positioned at the innermost function that has a line: the hook can fire
 * on entering a C function called from C (a tensor metamethod's own calls),
 * where luaL_error's level 1 has none, and the message handler would then
 * drop the traceback. */
static void lstop(lua_State *L, lua_Debug *ar) {
  (void)ar;
  lua_sethook(L, NULL, 0, 0);
  const char *what = got_signal == SIGTERM ? "terminated" : "interrupted!";
  lua_Debug d;
  for (int level = 0; lua_getstack(L, level, &d); level++) {
    if (lua_getinfo(L, "l", &d) && d.currentline > 0) {
      luaL_where(L, level);
      lua_pushstring(L, what);
      lua_concat(L, 2);
      lua_error(L);
    }
  }
  luaL_error(L, "%s", what);
}

/* The signal handler only notes the signal and sets the hook (lua_sethook
 * is signal-safe); for SIGINT the default action comes back, so a second
 * Ctrl-C kills a stuck process; later SIGTERMs are ignored (see the top). */
static void laction(int sig) {
  got_signal = sig;
  if (lm_proc_take_signal(sig)) return; /* a soft stop: the loop stops itself */
  set_signal(sig, sig == SIGTERM ? SIG_IGN : SIG_DFL);
  lua_sethook(globalL, lstop, LUA_MASKCALL | LUA_MASKRET | LUA_MASKLINE | LUA_MASKCOUNT, 1);
}

/* Calls the function below its narg arguments, with the traceback handler
 * and Ctrl-C (and SIGTERM) armed. */
static int docall(lua_State *L, int narg, int nres) {
  int base = lua_gettop(L) - narg;
  lua_pushcfunction(L, msghandler);
  lua_insert(L, base);
  globalL = L;
  got_signal = 0;
  set_signal(SIGINT, laction);
  set_signal(SIGTERM, laction);
  int status = lua_pcall(L, narg, nres, base);
  set_signal(SIGINT, SIG_DFL);
  if (got_signal != SIGTERM) set_signal(SIGTERM, SIG_DFL);
  lua_remove(L, base);
  return status;
}

/* ------------------------------------------------------- running chunks */

static int dochunk(lua_State *L, int status) {
  if (status == LUA_OK) status = docall(L, 0, 0);
  return report(L, status);
}

static int dofile(lua_State *L, const char *name) {
  return dochunk(L, luaL_loadfile(L, name));
}

static int dostring(lua_State *L, const char *s, const char *name) {
  return dochunk(L, luaL_loadbuffer(L, s, strlen(s), name));
}

/* -l mod or -l g=mod: g = require(mod). */
static int dolibrary(lua_State *L, const char *spec) {
  const char *eq = strchr(spec, '=');
  const char *modname = eq ? eq + 1 : spec;
  lua_getglobal(L, "require");
  lua_pushstring(L, modname);
  int status = docall(L, 1, 1);
  if (status == LUA_OK) {
    lua_pushlstring(L, spec, eq ? (size_t)(eq - spec) : strlen(spec));
    lua_insert(L, -2);
    lua_setglobal(L, lua_tostring(L, -2));
    lua_pop(L, 1);
  }
  return report(L, status);
}

/* Pushes arg[1..#arg]; returns how many. */
static int pushargs(lua_State *L) {
  if (lua_getglobal(L, "arg") != LUA_TTABLE) luaL_error(L, "'arg' is not a table");
  int n = (int)luaL_len(L, -1);
  luaL_checkstack(L, n + 3, "too many arguments to script");
  for (int i = 1; i <= n; i++) lua_rawgeti(L, -i, i);
  lua_remove(L, -n - 1);
  return n;
}

static int handle_script(lua_State *L, char **argv) {
  const char *fname = argv[0];
  if (strcmp(fname, "-") == 0 && strcmp(argv[-1], "--") != 0) fname = NULL; /* stdin */
  int status = luaL_loadfile(L, fname);
  if (status == LUA_OK) {
    int n = pushargs(L);
    status = docall(L, n, LUA_MULTRET);
  }
  return report(L, status);
}

/* ---------------------------------------------------------- subcommands */

static int file_exists(const char *name) {
  struct stat st;
  return stat(name, &st) == 0;
}

/* Is `name` a command, a module moe.cli.<name> on package.path? */
static int is_command(lua_State *L, const char *name) {
  if (!((name[0] >= 'a' && name[0] <= 'z') || (name[0] >= 'A' && name[0] <= 'Z'))) return 0;
  for (const char *p = name; *p; p++)
    if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') || *p == '_' ||
          *p == '-'))
      return 0;
  int top = lua_gettop(L);
  int found = 0;
  if (lua_getglobal(L, "package") == LUA_TTABLE && lua_getfield(L, -1, "searchpath") == LUA_TFUNCTION) {
    lua_pushfstring(L, "moe.cli.%s", name);
    lua_getfield(L, -3, "path");
    if (lua_pcall(L, 2, 1, 0) == LUA_OK) found = lua_isstring(L, -1);
  }
  lua_settop(L, top);
  return found;
}

/* require("moe.cli.<name>").main(arg[1], ...); its result is the exit
 * status: an integer as is, false -> 1, anything else -> 0. */
static int run_command(lua_State *L, const char *name, int *exit_code) {
  lua_getglobal(L, "require");
  lua_pushfstring(L, "moe.cli.%s", name);
  int status = docall(L, 1, 1);
  if (status != LUA_OK) return report(L, status);
  if (lua_getfield(L, -1, "main") != LUA_TFUNCTION) {
    lua_pop(L, 2);
    lua_pushfstring(L, "command '%s' (module moe.cli.%s) has no function 'main'", name, name);
    return report(L, LUA_ERRRUN);
  }
  lua_remove(L, -2);
  int n = pushargs(L);
  status = docall(L, n, 1);
  if (status == LUA_OK) {
    if (lua_isinteger(L, -1)) *exit_code = (int)lua_tointeger(L, -1);
    else if (lua_isboolean(L, -1) && !lua_toboolean(L, -1)) *exit_code = EXIT_FAILURE;
    lua_pop(L, 1);
  }
  return report(L, status);
}

/* ----------------------------------------------------------- the REPL */

static const char *get_prompt(lua_State *L, int firstline) {
  if (lua_getglobal(L, firstline ? "_PROMPT" : "_PROMPT2") == LUA_TNIL) {
    lua_pop(L, 1);
    return firstline ? "> " : ">> ";
  }
  const char *p = luaL_tolstring(L, -1, NULL);
  lua_remove(L, -2);
  return p; /* kept on the stack by the caller until printed */
}

/* Reads a line and pushes it; "=expr" on a first line becomes "return expr".
 * Returns 0 at the end of input. */
static int pushline(lua_State *L, int firstline) {
  int top = lua_gettop(L);
  fputs(get_prompt(L, firstline), stdout);
  fflush(stdout);
  lua_settop(L, top);
  ssize_t len = getline(&repl_line, &repl_cap, stdin);
  if (len < 0) return 0;
  if (len > 0 && repl_line[len - 1] == '\n') repl_line[--len] = '\0';
  if (firstline && repl_line[0] == '=')
    lua_pushfstring(L, "return %s", repl_line + 1);
  else
    lua_pushlstring(L, repl_line, (size_t)len);
  return 1;
}

/* A syntax error at <eof> means the statement goes on on the next line. */
static int incomplete(lua_State *L, int status) {
  static const char mark[] = "<eof>";
  size_t lmsg;
  if (status != LUA_ERRSYNTAX) return 0;
  const char *msg = lua_tolstring(L, -1, &lmsg);
  return lmsg >= sizeof mark - 1 && strcmp(msg + lmsg - (sizeof mark - 1), mark) == 0;
}

/* With the line at the top: compiles "return <line>" if that works (so an
 * expression prints its value), else the line itself, reading continuation
 * lines while the chunk is incomplete. Leaves the chunk or an error message
 * in place of the line. */
static int compile_line(lua_State *L) {
  const char *line = lua_tostring(L, -1);
  const char *ret = lua_pushfstring(L, "return %s;", line);
  if (luaL_loadbuffer(L, ret, strlen(ret), "=stdin") == LUA_OK) {
    lua_remove(L, -2); /* "return ...;" */
    lua_remove(L, -2); /* the line */
    return LUA_OK;
  }
  lua_pop(L, 2);
  for (;;) {
    size_t len;
    const char *code = lua_tolstring(L, -1, &len);
    int status = luaL_loadbuffer(L, code, len, "=stdin"); /* code, chunk or message */
    if (incomplete(L, status) && pushline(L, 0)) {
      lua_remove(L, -2); /* the message */
      lua_pushliteral(L, "\n");
      lua_insert(L, -2);
      lua_concat(L, 3); /* code .. "\n" .. next line */
      continue;
    }
    lua_remove(L, -2); /* the code */
    return status;
  }
}

static void print_results(lua_State *L, int base) {
  int n = lua_gettop(L) - base;
  if (n <= 0) return;
  luaL_checkstack(L, LUA_MINSTACK, "too many results to print");
  lua_getglobal(L, "print");
  lua_insert(L, base + 1);
  if (lua_pcall(L, n, 0, 0) != LUA_OK)
    l_message(progname, lua_pushfstring(L, "error calling 'print' (%s)", lua_tostring(L, -1)));
}

static void doREPL(lua_State *L) {
  const char *oldprogname = progname;
  int base = lua_gettop(L);
  progname = NULL;
  while (pushline(L, 1)) {
    int status = compile_line(L);
    if (status == LUA_OK) status = docall(L, 0, LUA_MULTRET);
    if (status == LUA_OK) print_results(L, base);
    else report(L, status);
    lua_settop(L, base);
    if (got_signal == SIGTERM) break;
  }
  fputs("\n", stdout);
  fflush(stdout);
  progname = oldprogname;
}

/* --------------------------------------------------------- the options */

#define has_error 1 /* bad option */
#define has_i 2     /* -i */
#define has_v 4     /* -v, --version */
#define has_e 8     /* -e */
#define has_E 16    /* -E */
#define has_h 32    /* -h, --help */

/* Scans the options. *first gets the index of the script (0: none), or of
 * the bad option when the result is has_error. */
static int collectargs(char **argv, int *first) {
  int args = 0;
  *first = 0;
  if (argv[0] == NULL) return 0;
  for (int i = 1; argv[i] != NULL; i++) {
    *first = i;
    if (argv[i][0] != '-') return args; /* the script */
    switch (argv[i][1]) {
      case '-':
        if (argv[i][2] == '\0') { /* "--" */
          *first = argv[i + 1] ? i + 1 : 0;
          return args;
        }
        if (strcmp(argv[i], "--version") == 0) args |= has_v;
        else if (strcmp(argv[i], "--help") == 0) args |= has_h;
        else return has_error;
        break;
      case '\0': return args; /* "-": the script is stdin */
      case 'E':
        if (argv[i][2] != '\0') return has_error;
        args |= has_E;
        break;
      case 'W':
        if (argv[i][2] != '\0') return has_error;
        break;
      case 'h':
        if (argv[i][2] != '\0') return has_error;
        args |= has_h;
        break;
      case 'i':
        args |= has_i; /* -i implies -v */
        /* FALLTHROUGH */
      case 'v':
        if (argv[i][2] != '\0') return has_error;
        args |= has_v;
        break;
      case 'e':
        args |= has_e;
        /* FALLTHROUGH */
      case 'l': /* both need an argument */
        if (argv[i][2] == '\0') {
          i++;
          if (argv[i] == NULL || argv[i][0] == '-') return has_error;
        }
        break;
      default: return has_error;
    }
  }
  *first = 0;
  return args;
}

/* Runs -e, -l and -W in order; argv[1..n-1] are options. */
static int runargs(lua_State *L, char **argv, int n) {
  for (int i = 1; i < n; i++) {
    char option = argv[i][1];
    switch (option) {
      case 'e':
      case 'l': {
        const char *extra = argv[i] + 2;
        if (*extra == '\0') extra = argv[++i];
        int status = option == 'e' ? dostring(L, extra, "=(command line)") : dolibrary(L, extra);
        if (status != LUA_OK) return 0;
        break;
      }
      case 'W': lua_warning(L, "@on", 0); break;
      default: break;
    }
  }
  return 1;
}

static int handle_luainit(lua_State *L) {
  const char *name = "=" INIT_VAR_VERSION;
  const char *init = getenv(name + 1);
  if (init == NULL) {
    name = "=" INIT_VAR;
    init = getenv(name + 1);
  }
  if (init == NULL) return LUA_OK;
  if (init[0] == '@') return dofile(L, init + 1);
  return dostring(L, init, name);
}

static void createargtable(lua_State *L, char **argv, int argc, int script) {
  lua_createtable(L, argc - (script + 1) > 0 ? argc - (script + 1) : 0, script + 1);
  for (int i = 0; i < argc; i++) {
    lua_pushstring(L, argv[i]);
    lua_rawseti(L, -2, i - script);
  }
  lua_setglobal(L, "arg");
}

/* ------------------------------------------------------ moe-specific setup */

/* Lua's search paths, relative to the executable first.
 *
 * Installed (cmake --install, LuaRocks): the executable is <prefix>/bin/moe-lua
 * and <exe dir>/MOE_LUA_INSTALL_REL (../share/lua/5.4 by default) holds
 * moe/lib.lua. That folder goes first on package.path and
 * <exe dir>/MOE_LUA_CINSTALL_REL (../lib/lua/5.4) first on package.cpath;
 * no compiled-in source path is added, so an installed copy never reads the
 * source tree it was built from, and the prefix may be moved.
 * Build tree: MOE_LUA_DIR (the source's lua/), then <exe dir>/../lua when it
 * is another folder, before the rest of package.path.
 * The rest is LUA_PATH / LUA_CPATH or Lua's defaults, as in lua5.4. */
#ifndef MOE_LUA_INSTALL_REL
#define MOE_LUA_INSTALL_REL "../share/lua/5.4"
#endif
#ifndef MOE_LUA_CINSTALL_REL
#define MOE_LUA_CINSTALL_REL "../lib/lua/5.4"
#endif

/* Prepends `pattern` (a string with %s for dir, used twice) to package[field]. */
static void prepend_path(lua_State *L, const char *field, const char *pattern, const char *dir) {
  lua_getglobal(L, "package");
  lua_getfield(L, -1, field);
  lua_pushfstring(L, pattern, dir, dir);
  lua_insert(L, -2);
  lua_concat(L, 2);
  lua_setfield(L, -2, field);
  lua_pop(L, 1);
}

/* realpath of <exe_dir>/<rel> into out, or NULL when it does not exist. */
static const char *exe_relative(const char *exe_dir, const char *rel, char out[PATH_MAX]) {
  char joined[2 * PATH_MAX + 2];
  snprintf(joined, sizeof joined, "%s/%s", exe_dir, rel);
  return realpath(joined, out);
}

static void setup_path(lua_State *L) {
  char exe[PATH_MAX], real_dir[PATH_MAX], real_cdir[PATH_MAX], probe[PATH_MAX + 32];
  const char *exe_dir = NULL;
  ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n > 0) {
    exe[n] = '\0';
    char *slash = strrchr(exe, '/');
    if (slash) {
      *slash = '\0';
      exe_dir = exe;
    }
  }
  if (exe_dir && exe_relative(exe_dir, MOE_LUA_INSTALL_REL, real_dir) != NULL) {
    snprintf(probe, sizeof probe, "%s/moe/lib.lua", real_dir);
    if (access(probe, R_OK) == 0) { /* installed */
      if (exe_relative(exe_dir, MOE_LUA_CINSTALL_REL, real_cdir) != NULL)
        prepend_path(L, "cpath", "%s/?.so;", real_cdir);
      prepend_path(L, "path", "%s/?.lua;%s/?/init.lua;", real_dir);
      return;
    }
  }
  /* the build tree */
  char real_src[PATH_MAX];
  const char *exe_lua = exe_dir ? exe_relative(exe_dir, "../lua", real_dir) : NULL;
#ifdef MOE_LUA_DIR
  if (exe_lua && realpath(MOE_LUA_DIR, real_src) != NULL && strcmp(real_src, exe_lua) == 0)
    exe_lua = NULL; /* the same folder */
  const char *src_lua = MOE_LUA_DIR;
#else
  (void)real_src;
  const char *src_lua = NULL;
#endif
  if (exe_lua) prepend_path(L, "path", "%s/?.lua;%s/?/init.lua;", exe_lua);
  if (src_lua) prepend_path(L, "path", "%s/?.lua;%s/?/init.lua;", src_lua);
}

/* package.preload.moe and package.loaded["moe.host"]. */
static void setup_moe(lua_State *L) {
  luaL_getsubtable(L, LUA_REGISTRYINDEX, LUA_PRELOAD_TABLE);
  lua_pushcfunction(L, luaopen_moe);
  lua_setfield(L, -2, "moe");
  lua_pop(L, 1);
  luaL_getsubtable(L, LUA_REGISTRYINDEX, LUA_LOADED_TABLE);
  lua_createtable(L, 0, 2);
  lua_pushstring(L, usage_text);
  lua_setfield(L, -2, "usage");
  lua_pushliteral(L, PROGNAME);
  lua_setfield(L, -2, "progname");
  lua_setfield(L, -2, "moe.host");
  lua_pop(L, 1);
}

/* -v, --version: moe.version_report(). */
static int print_version(lua_State *L) {
  lua_getglobal(L, "require");
  lua_pushliteral(L, "moe");
  int status = docall(L, 1, 1);
  if (status == LUA_OK) {
    lua_getfield(L, -1, "version_report");
    lua_remove(L, -2);
    status = docall(L, 0, 1);
  }
  if (status == LUA_OK) {
    fputs(lua_tostring(L, -1), stdout);
    fflush(stdout);
    lua_pop(L, 1);
  } else {
    printf("%s (version information unavailable)\n%s\n", PROGNAME, LUA_COPYRIGHT);
    fflush(stdout);
  }
  return report(L, status);
}

/* --help, -h and moe-lua alone on a terminal: `moe-lua help` (moe.cli.help),
 * or the usage text when that command cannot run. Returns the exit status. */
static int print_help(lua_State *L) {
  int code = EXIT_SUCCESS;
  lua_getglobal(L, "arg");
  int has_arg = lua_istable(L, -1);
  lua_pop(L, 1);
  if (has_arg) { /* no arguments for help: clear arg[1..] */
    lua_newtable(L);
    lua_setglobal(L, "arg");
  }
  if (!is_command(L, "help") || run_command(L, "help", &code) != LUA_OK) {
    fputs(usage_text, stdout);
    fflush(stdout);
    code = EXIT_SUCCESS;
  }
  return code;
}

/* Keeps Lua's error function (for msghandler, which tells the library's
 * error() calls from runtime errors) and the library's folder: the one
 * holding moe/config.lua on package.path. */
static void setup_errors(lua_State *L) {
  lua_getglobal(L, "error");
  lua_setfield(L, LUA_REGISTRYINDEX, "moe.host.error");
  int top = lua_gettop(L);
  if (lua_getglobal(L, "package") == LUA_TTABLE && lua_getfield(L, -1, "searchpath") == LUA_TFUNCTION) {
    lua_pushliteral(L, "moe.config");
    lua_getfield(L, -3, "path");
    if (lua_pcall(L, 2, 1, 0) == LUA_OK && lua_type(L, -1) == LUA_TSTRING) {
      /* as found, not resolved: the chunk names of the library's modules are these paths */
      const char *path = lua_tostring(L, -1);
      const char *slash = strrchr(path, '/');
      if (slash && (size_t)(slash - path) + 2 < sizeof lib_root) {
        memcpy(lib_root, path, (size_t)(slash - path) + 1);
        lib_root[slash - path + 1] = '\0';
      }
    }
  }
  lua_settop(L, top);
}

/* ------------------------------------------------------------- the job */

/* Writes $MOE_LAUNCH_DIR/rank-<r>.exit (atexit, so os.exit and the return
 * from main both write it), as key=value lines:
 *   rank=1
 *   status=1            exit status; 130/143 after SIGINT/SIGTERM; -1 unknown
 *   signal=0            the signal that stopped the run (2, 15), 0 none
 *   wall=1717171717.123456789       CLOCK_REALTIME, seconds
 *   monotonic=12345.678901234       CLOCK_MONOTONIC, seconds (this host's)
 *   pid=4242
 *   error=boom.lua:3: bad           the first line of the last error, or ""
 * through a temporary name and rename, so a reader never sees half a
 * record. Errors writing it are ignored (the launcher then reports a rank
 * without a record). */
static void write_exit_record(void) {
  if (record_dir[0] == '\0') return;
  char path[PATH_MAX + 64], tmp[PATH_MAX + 96];
  snprintf(path, sizeof path, "%s/rank-%d.exit", record_dir, job.rank);
  snprintf(tmp, sizeof tmp, "%s/.rank-%d.exit.%ld", record_dir, job.rank, (long)getpid());
  struct timespec wall, mono;
  clock_gettime(CLOCK_REALTIME, &wall);
  clock_gettime(CLOCK_MONOTONIC, &mono);
  FILE *f = fopen(tmp, "w");
  if (f == NULL) return;
  fprintf(f, "rank=%d\nstatus=%d\nsignal=%d\nwall=%lld.%09ld\nmonotonic=%lld.%09ld\npid=%ld\n",
          job.rank, record_status, record_signal, (long long)wall.tv_sec, wall.tv_nsec,
          (long long)mono.tv_sec, mono.tv_nsec, (long)getpid());
  fprintf(f, "error=%s\n", record_status == 0 ? "" : last_error);
  if (fclose(f) == 0) rename(tmp, path);
  else unlink(tmp);
}

static void set_int_env(const char *name, int v) {
  char buf[16];
  snprintf(buf, sizeof buf, "%d", v);
  setenv(name, buf, 1);
}

/* Reads the job from the environment (moe_dist_env_read) and applies the
 * policy of the header comment. Returns 0 when the environment is broken
 * (the message printed). */
static int setup_job(void) {
  moe_ctx *ctx = NULL;
  if (moe_ctx_init(&ctx) != MOE_OK) {
    l_message(PROGNAME, "cannot create a context: not enough memory");
    return 0;
  }
  moe_status st = moe_dist_env_read(ctx, &job);
  if (st != MOE_OK) {
    char msg[600];
    snprintf(msg, sizeof msg, "cannot tell which rank this is: %s", moe_ctx_error(ctx));
    moe_ctx_free(ctx);
    l_message(PROGNAME, msg);
    return 0;
  }
  moe_ctx_free(ctx);
  const char *dir = getenv("MOE_LAUNCH_DIR");
  if (dir && *dir && strlen(dir) < sizeof record_dir) {
    strcpy(record_dir, dir);
    atexit(write_exit_record);
  }
  unsetenv("MOE_LAUNCH_DIR");
  if (strcmp(job.launcher, "none") == 0) return 1;
  set_int_env("RANK", job.rank);
  set_int_env("WORLD_SIZE", job.world_size);
  set_int_env("LOCAL_RANK", job.local_rank);
  set_int_env("LOCAL_WORLD_SIZE", job.local_world_size);
  if (job.world_size > 1) snprintf(rank_prefix, sizeof rank_prefix, "[rank %d] ", job.rank);
  const char *print = getenv("MOE_DIST_PRINT");
  if (job.rank != 0 && !(print && strcmp(print, "all") == 0)) {
    fflush(stdout);
    int fd = open("/dev/null", O_WRONLY);
    if (fd >= 0) {
      dup2(fd, STDOUT_FILENO);
      if (fd != STDOUT_FILENO) close(fd);
    }
  }
  return 1;
}

/* Lua's warnings (lauxlib's warnf, "@on"/"@off" and messages in pieces)
 * with the rank prefix; installed only in a job of several ranks. A message's
 * pieces are gathered and the line written in one write (stderr is
 * unbuffered), so the ranks' lines do not interleave within a line. */
static int warn_state = 0; /* 0 off, 1 on, 2 in the middle of a message */
static char warn_buf[2048];
static size_t warn_len = 0;

static void warn_put(const char *s) {
  size_t n = strlen(s), room = sizeof warn_buf - 1 - warn_len; /* one byte kept for the newline */
  if (n > room) { /* a long message: what is gathered so far goes out first */
    fwrite(warn_buf, 1, warn_len, stderr);
    warn_len = 0;
    if (n > sizeof warn_buf - 1) {
      fputs(s, stderr);
      return;
    }
  }
  memcpy(warn_buf + warn_len, s, n);
  warn_len += n;
}

static void host_warnf(void *ud, const char *msg, int tocont) {
  (void)ud;
  if (warn_state != 2 && !tocont && msg[0] == '@') { /* a control message */
    if (strcmp(msg, "@off") == 0) warn_state = 0;
    else if (strcmp(msg, "@on") == 0) warn_state = 1;
    return;
  }
  if (warn_state == 0) return;
  if (warn_state == 1) {
    warn_len = 0;
    warn_put(rank_prefix);
    warn_put("Lua warning: ");
  }
  warn_put(msg);
  if (tocont) {
    warn_state = 2;
  } else {
    warn_buf[warn_len++] = '\n';
    fwrite(warn_buf, 1, warn_len, stderr);
    fflush(stderr);
    warn_len = 0;
    warn_state = 1;
  }
}

/* os.exit that notes its status for the exit record, then calls Lua's
 * (upvalue 1) with the same arguments. */
static int host_os_exit(lua_State *L) {
  if (lua_isboolean(L, 1)) record_status = lua_toboolean(L, 1) ? EXIT_SUCCESS : EXIT_FAILURE;
  else record_status = (int)(luaL_optinteger(L, 1, EXIT_SUCCESS) & 0xff);
  record_signal = 0;
  lua_pushvalue(L, lua_upvalueindex(1));
  lua_insert(L, 1);
  lua_call(L, lua_gettop(L) - 1, 0);
  return 0;
}

static void wrap_os_exit(lua_State *L) {
  if (record_dir[0] == '\0') return;
  if (lua_getglobal(L, "os") == LUA_TTABLE && lua_getfield(L, -1, "exit") == LUA_TFUNCTION) {
    lua_pushcclosure(L, host_os_exit, 1);
    lua_setfield(L, -2, "exit");
  } else {
    lua_pop(L, 1);
  }
  lua_pop(L, 1);
}

/* ------------------------------------------------------------- pmain */

/* Everything but the creation of the state, under lua_pcall. Returns the
 * exit status as an integer. */
static int pmain(lua_State *L) {
  int argc = (int)lua_tointeger(L, 1);
  char **argv = (char **)lua_touserdata(L, 2);
  int script;
  int exit_code = EXIT_SUCCESS;
  int args = collectargs(argv, &script);
  int optlim = (script > 0) ? script : argc;
  lua_settop(L, 0);
  luaL_checkversion(L);
  if (args == has_error) {
    print_usage(argv[script]);
    lua_pushinteger(L, EXIT_FAILURE);
    return 1;
  }
  if (args & has_E) {
    lua_pushboolean(L, 1);
    lua_setfield(L, LUA_REGISTRYINDEX, "LUA_NOENV");
  }
  luaL_openlibs(L);
  wrap_os_exit(L);
  setup_moe(L);
  setup_path(L);
  setup_errors(L);
  createargtable(L, argv, argc, script);
  lua_gc(L, LUA_GCRESTART);
  lua_gc(L, LUA_GCGEN, 0, 0);
  if (args & has_h) { /* the options and the commands */
    lua_pushinteger(L, print_help(L));
    return 1;
  }
  if ((args & has_v) && print_version(L) != LUA_OK) goto fail;
  if (!(args & has_E) && handle_luainit(L) != LUA_OK) goto fail;
  if (!runargs(L, argv, optlim)) goto fail;
  if (script > 0) {
    const char *name = argv[script];
    int is_stdin = strcmp(name, "-") == 0 && strcmp(argv[script - 1], "--") != 0;
    if (is_stdin || file_exists(name)) {
      if (handle_script(L, argv + script) != LUA_OK) goto fail;
    } else if (is_command(L, name)) {
      if (run_command(L, name, &exit_code) != LUA_OK) goto fail;
    } else {
      lua_pushfstring(L, "cannot open %s (no such file or command; try '%s help')", name, PROGNAME);
      report(L, LUA_ERRFILE);
      goto fail;
    }
  }
  if (args & has_i) {
    doREPL(L);
    if (got_signal == SIGTERM) goto fail;
  } else if (script < 1 && !(args & (has_e | has_v))) {
    if (isatty(0)) {
      exit_code = print_help(L); /* the REPL is -i */
    } else if (dofile(L, NULL) != LUA_OK) {
      goto fail;
    }
  }
  lua_pushinteger(L, exit_code);
  return 1;
fail:
  lua_pushinteger(L, EXIT_FAILURE);
  return 1;
}

int main(int argc, char **argv) {
  if (!setup_job()) return EXIT_FAILURE;
  lm_proc_host_signals(); /* laction hands SIGINT/SIGTERM to soft stops */
  lua_State *L = luaL_newstate();
  if (L == NULL) {
    l_message(PROGNAME, "cannot create state: not enough memory");
    record_status = EXIT_FAILURE;
    return EXIT_FAILURE;
  }
  if (rank_prefix[0]) lua_setwarnf(L, host_warnf, NULL);
  lua_gc(L, LUA_GCSTOP); /* no collections while handling the arguments */
  lua_pushcfunction(L, pmain);
  lua_pushinteger(L, argc);
  lua_pushlightuserdata(L, argv);
  int status = lua_pcall(L, 2, 1, 0);
  int result = status == LUA_OK ? (int)lua_tointeger(L, -1) : EXIT_FAILURE;
  report(L, status);
  if (result != EXIT_SUCCESS && (got_signal || lm_proc_stopped())) { /* the signal's error ended the run */
    record_signal = lm_proc_stopped() ? lm_proc_stopped() : got_signal;
    result = 128 + record_signal;
  }
  if (lm_proc_stopped() && job.world_size > 1) {
    /* A rank that stopped as asked, in a job that mpirun is stopping: its
     * kill sequence may end this process during the teardown below (MPI's
     * finalize waits for mpirun), so the record goes first. */
    record_status = result;
    write_exit_record();
    record_dir[0] = '\0'; /* written once */
  }
  if (result != EXIT_SUCCESS && moe_dist_initialized() && job.world_size > 1 && !lm_proc_stopped()) {
    /* A failed rank of a job: MPI_Finalize would wait for the other ranks,
     * which may wait in a collective for this one until their timeout, and
     * finalizers may wait for collectives too. End the whole job now: the
     * exit record says why, mpirun stops the others. */
    record_status = result;
    write_exit_record();
    record_dir[0] = '\0'; /* written once */
    moe_dist_abort(result);
  }
  lua_close(L); /* runs every finalizer: tensors, then the moe context */
  moe_dist_finalize(); /* communicators, NCCL and MPI (moe_dist.h), after every finalizer */
  free(repl_line);
  record_status = result;
  return result;
}
