/*
 * lproc.c - moe.proc: the few process primitives `moe-lua launch`
 * (lua/moe/cli/launch.lua) needs and Lua's os library lacks.
 *
 *   moe.proc.spawn(argv, {env =, keep =}) -> {status =, signal =, forwarded =, lines =}
 *   moe.proc.getpid()          moe.proc.geteuid()
 *   moe.proc.exe()             the absolute path of the running executable
 *   moe.proc.executable(path)  a regular file this process may execute
 *   moe.proc.free_port()       a TCP port nobody listens on now
 *   moe.proc.mkdtemp([prefix]) a new private folder under $TMPDIR or /tmp
 *   moe.proc.soft_stop(on)     -> the previous mode, and whether signals reach it
 *   moe.proc.stop_requested()  -> nil, or the signal (2, 15) and its name
 *   moe.proc.stopped([sig])    the stop asked for is done: exit as the signal says
 *
 * spawn runs argv (argv[1] looked up on PATH) and waits for it. It is not a
 * process manager: one child, started, waited for, reported.
 *   - env: {NAME = "value" | false}: the child's environment is this
 *     process's, with NAME set or (false) removed.
 *   - keep: {"text", ...}: the child's stderr goes through a pipe and is
 *     copied to this process's stderr as it comes, unchanged; the lines
 *     that contain one of the texts (plain, not patterns) come back in
 *     `lines` (at most 64, each cut at 1023 bytes). Without keep the child
 *     shares this process's stderr.
 *   - While it waits, SIGINT and SIGTERM sent to this process by another
 *     process (kill, a scheduler) are sent on to the child; a Ctrl-C typed
 *     at the terminal already reached the child, which is in the same
 *     process group, and is not sent twice. `forwarded` is the last such
 *     signal (sent on or not), nil when none came. The previous handlers
 *     come back when spawn returns.
 *   - The result: status (the exit code) or signal (the signal that killed
 *     the child). Failing to start the child (no such program) raises.
 * Everything is allocated before the child starts, so no Lua error can
 * leave a child unwaited for or the handlers changed.
 *
 * Soft stops (what moe.train's loop uses so that SIGTERM from a scheduler,
 * or Ctrl-C, ends a run with a checkpoint): in the moe-lua host, SIGINT and
 * SIGTERM raise an error at the next safe point of the interpreter
 * (bindings/host.c). soft_stop(true) arms a soft stop instead: the next
 * such signal only sets a flag that stop_requested() reads, and disarms it,
 * so a second signal raises as before (a script stuck while saving can
 * still be stopped). soft_stop(true) clears the flag; soft_stop(false)
 * disarms. The loop checks the flag at its step boundaries, saves, and
 * calls stopped() before raising its message: the host then exits with
 * status 128 + the signal after the normal teardown (finalizers, MPI's
 * finalize), instead of ending a job of several ranks at once. Outside the
 * host (stock lua5.4) nothing delivers the signals: soft_stop's second
 * result is false and stop_requested() stays nil.
 */
#define _GNU_SOURCE /* pipe2 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "lmoe_internal.h"

extern char **environ;

#define LM_KEEP_LINES 64
#define LM_KEEP_LEN 1024

/* ---------------------------------------------------- signal forwarding */

static volatile sig_atomic_t lm_fwd_sig = 0;
static volatile pid_t lm_fwd_child = 0;

/* Sent by a process (kill(2), sigqueue: si_code <= 0) -> on to the child;
 * from the terminal (SI_KERNEL) the child, in our process group, has it. */
static void lm_forward(int sig, siginfo_t *si, void *uc) {
  (void)uc;
  lm_fwd_sig = sig;
  if (lm_fwd_child > 0 && (si == NULL || si->si_code <= 0)) kill(lm_fwd_child, sig);
}

/* ------------------------------------------------------------ soft stops */

static volatile sig_atomic_t lm_soft_armed = 0; /* soft_stop(true), no signal taken since */
static volatile sig_atomic_t lm_stop_sig = 0;   /* the signal a soft stop took; 0 none */
static int lm_stop_done = 0;                    /* the signal stopped() gave; 0 none */
static int lm_host_signals = 0;                 /* the host calls lm_proc_take_signal */

void lm_proc_host_signals(void) { lm_host_signals = 1; }

int lm_proc_take_signal(int sig) {
  if (!lm_soft_armed) return 0;
  lm_soft_armed = 0;
  lm_stop_sig = sig;
  return 1;
}

int lm_proc_stopped(void) { return lm_stop_done; }

static int lm_soft_stop(lua_State *L) {
  luaL_checktype(L, 1, LUA_TBOOLEAN);
  int was = lm_soft_armed;
  if (lua_toboolean(L, 1)) {
    lm_stop_sig = 0;
    lm_stop_done = 0;
    lm_soft_armed = 1;
  } else {
    lm_soft_armed = 0;
  }
  lua_pushboolean(L, was);
  lua_pushboolean(L, lm_host_signals);
  return 2;
}

static int lm_stop_requested(lua_State *L) {
  int sig = lm_stop_sig;
  if (sig == 0) return 0;
  lua_pushinteger(L, sig);
  lua_pushstring(L, sig == SIGTERM ? "SIGTERM" : sig == SIGINT ? "SIGINT" : "signal");
  return 2;
}

/* stopped([sig]): sig defaults to the signal this process took; a rank that
 * stops because another one was signalled gives the agreed signal. */
static int lm_stopped(lua_State *L) {
  lua_Integer sig = luaL_optinteger(L, 1, lm_stop_sig);
  if (sig != SIGINT && sig != SIGTERM) {
    if (lua_isnoneornil(L, 1)) return luaL_error(L, "stopped: no stop was requested");
    lm_argerror(L, 1, "stopped", "signal must be %d (SIGINT) or %d (SIGTERM), got %d", SIGINT, SIGTERM, (int)sig);
  }
  lm_stop_done = (int)sig;
  return 0;
}

/* ----------------------------------------------------------------- spawn */

/* What spawn allocates before the child starts, in one scratch box. */
typedef struct lm_spawn_buf {
  char **argv;                            /* (nargs + 1) into the Lua strings */
  char **envp;                            /* (nenv + 1) */
  char *envdata;                          /* "NAME=value" strings of overrides */
  const char **keep;                      /* (nkeep) into the Lua strings */
  int nkeep;
  char line[LM_KEEP_LEN];                 /* the stderr line being read */
  size_t linelen;
  char kept[LM_KEEP_LINES][LM_KEEP_LEN];  /* lines that matched */
  int nkept;
} lm_spawn_buf;

static void lm_spawn_line_end(lm_spawn_buf *b) {
  b->line[b->linelen] = '\0';
  if (b->nkept < LM_KEEP_LINES) {
    for (int k = 0; k < b->nkeep; k++) {
      if (strstr(b->line, b->keep[k])) {
        memcpy(b->kept[b->nkept++], b->line, b->linelen + 1);
        break;
      }
    }
  }
  b->linelen = 0;
}

/* Copies what the pipe holds to stderr and into the line buffer. Returns
 * 1 after copying, 0 at the end of the stream (or an error), -1 when there
 * was nothing to read (EAGAIN, EINTR). */
static int lm_spawn_pump(lm_spawn_buf *b, int fd) {
  char chunk[4096];
  ssize_t n = read(fd, chunk, sizeof chunk);
  if (n < 0) return (errno == EINTR || errno == EAGAIN) ? -1 : 0;
  if (n == 0) return 0;
  fwrite(chunk, 1, (size_t)n, stderr);
  fflush(stderr);
  for (ssize_t i = 0; i < n; i++) {
    if (chunk[i] == '\n') lm_spawn_line_end(b);
    else if (b->linelen < LM_KEEP_LEN - 1) b->line[b->linelen++] = chunk[i];
  }
  return 1;
}

/* Does the child's environment override NAME=... (the entry e)? */
static int lm_env_overridden(lua_State *L, int env, const char *e) {
  const char *eq = strchr(e, '=');
  if (env == 0 || eq == NULL) return 0;
  lua_pushlstring(L, e, (size_t)(eq - e));
  int t = lua_rawget(L, env);
  lua_pop(L, 1);
  return t != LUA_TNIL;
}

static int lm_spawn(lua_State *L) {
  /* the arguments */
  luaL_checktype(L, 1, LUA_TTABLE);
  int nargs = (int)luaL_len(L, 1);
  if (nargs < 1) lm_argerror(L, 1, "spawn", "argv is empty");
  for (int i = 1; i <= nargs; i++) {
    if (lua_rawgeti(L, 1, i) != LUA_TSTRING)
      lm_argerror(L, 1, "spawn", "argv[%d] is a %s, a string expected", i, luaL_typename(L, -1));
    lua_pop(L, 1);
  }
  int env = 0, keep = 0;
  if (!lua_isnoneornil(L, 2)) {
    static const char *const known[] = {"env", "keep", NULL};
    luaL_checktype(L, 2, LUA_TTABLE);
    lm_checkkeys(L, 2, "spawn", known);
    if (lua_getfield(L, 2, "env") != LUA_TNIL) {
      if (!lua_istable(L, -1)) lm_argerror(L, 2, "spawn", "env must be a table");
      env = lua_gettop(L);
      lua_pushnil(L);
      while (lua_next(L, env)) {
        if (lua_type(L, -2) != LUA_TSTRING || strchr(lua_tostring(L, -2), '=') ||
            !(lua_type(L, -1) == LUA_TSTRING ||
              (lua_isboolean(L, -1) && !lua_toboolean(L, -1))))
          lm_argerror(L, 2, "spawn", "env: names (without '=') to strings or false expected");
        lua_pop(L, 1);
      }
    } else {
      lua_pop(L, 1);
    }
    if (lua_getfield(L, 2, "keep") != LUA_TNIL) {
      if (!lua_istable(L, -1)) lm_argerror(L, 2, "spawn", "keep must be a list of strings");
      keep = lua_gettop(L);
      for (int i = 1; i <= (int)luaL_len(L, keep); i++) {
        if (lua_rawgeti(L, keep, i) != LUA_TSTRING)
          lm_argerror(L, 2, "spawn", "keep[%d] is a %s, a string expected", i,
                      luaL_typename(L, -1));
        lua_pop(L, 1);
      }
    } else {
      lua_pop(L, 1);
    }
  }

  /* everything the child needs, and the reading buffers, before it starts */
  int nenv = 0, nover = 0;
  size_t overbytes = 0;
  for (char **e = environ; *e; e++) nenv++;
  if (env) {
    lua_pushnil(L);
    while (lua_next(L, env)) {
      if (lua_isstring(L, -1)) {
        nover++;
        overbytes += lua_rawlen(L, -2) + lua_rawlen(L, -1) + 2;
      }
      lua_pop(L, 1);
    }
  }
  int nkeep = keep ? (int)luaL_len(L, keep) : 0;
  void **box = lm_push_scratch(L);
  size_t bytes = sizeof(lm_spawn_buf) + (size_t)(nargs + 1) * sizeof(char *) +
                 (size_t)(nenv + nover + 1) * sizeof(char *) + (size_t)nkeep * sizeof(char *) +
                 overbytes + 1;
  *box = calloc(1, bytes);
  if (*box == NULL) return luaL_error(L, "spawn: not enough memory");
  lm_spawn_buf *b = (lm_spawn_buf *)*box;
  b->argv = (char **)(b + 1);
  b->envp = b->argv + nargs + 1;
  b->keep = (const char **)(b->envp + nenv + nover + 1);
  b->envdata = (char *)(b->keep + nkeep);
  for (int i = 1; i <= nargs; i++) {
    lua_rawgeti(L, 1, i);
    b->argv[i - 1] = (char *)lua_tostring(L, -1); /* the table keeps it alive */
    lua_pop(L, 1);
  }
  int ne = 0;
  for (char **e = environ; *e; e++)
    if (!lm_env_overridden(L, env, *e)) b->envp[ne++] = *e;
  if (env) {
    char *w = b->envdata;
    lua_pushnil(L);
    while (lua_next(L, env)) {
      if (lua_isstring(L, -1)) {
        b->envp[ne++] = w;
        w += sprintf(w, "%s=%s", lua_tostring(L, -2), lua_tostring(L, -1)) + 1;
      }
      lua_pop(L, 1);
    }
  }
  b->envp[ne] = NULL;
  for (int i = 1; i <= nkeep; i++) {
    lua_rawgeti(L, keep, i);
    b->keep[i - 1] = lua_tostring(L, -1); /* the table keeps it alive */
    lua_pop(L, 1);
  }
  b->nkeep = nkeep;

  /* the child */
  int fds[2] = {-1, -1};
  if (keep && pipe2(fds, O_CLOEXEC) != 0)
    return luaL_error(L, "spawn: cannot make a pipe: %s", strerror(errno));
  posix_spawn_file_actions_t fa;
  posix_spawnattr_t attr;
  posix_spawn_file_actions_init(&fa);
  posix_spawnattr_init(&attr);
  if (keep) posix_spawn_file_actions_adddup2(&fa, fds[1], STDERR_FILENO);
  sigset_t none, deflt, block, oldmask;
  sigemptyset(&none);
  sigemptyset(&deflt);
  sigaddset(&deflt, SIGINT);
  sigaddset(&deflt, SIGTERM);
  sigaddset(&deflt, SIGPIPE);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &deflt);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  sigemptyset(&block);
  sigaddset(&block, SIGINT);
  sigaddset(&block, SIGTERM);
  sigprocmask(SIG_BLOCK, &block, &oldmask); /* no signal between spawn and the handlers */
  fflush(stdout);
  fflush(stderr);
  pid_t pid;
  int err = posix_spawnp(&pid, b->argv[0], &fa, &attr, b->argv, b->envp);
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
  if (keep) close(fds[1]);
  if (err != 0) {
    sigprocmask(SIG_SETMASK, &oldmask, NULL);
    if (keep) close(fds[0]);
    return luaL_error(L, "spawn: cannot run '%s': %s", b->argv[0], strerror(err));
  }
  struct sigaction fwd, old_int, old_term;
  memset(&fwd, 0, sizeof fwd);
  fwd.sa_sigaction = lm_forward;
  fwd.sa_flags = SA_SIGINFO;
  sigemptyset(&fwd.sa_mask);
  lm_fwd_sig = 0;
  lm_fwd_child = pid;
  sigaction(SIGINT, &fwd, &old_int);
  sigaction(SIGTERM, &fwd, &old_term);
  sigprocmask(SIG_SETMASK, &oldmask, NULL);

  /* wait, copying stderr */
  int wstatus = 0;
  if (keep) {
    int open_fd = 1, done = 0;
    while (!done) {
      if (open_fd) {
        struct pollfd p = {.fd = fds[0], .events = POLLIN};
        if (poll(&p, 1, 200) > 0) open_fd = lm_spawn_pump(b, fds[0]) != 0;
      }
      pid_t w = waitpid(pid, &wstatus, open_fd ? WNOHANG : 0);
      if (w == pid) done = 1;
      else if (w < 0 && errno != EINTR) done = 1, wstatus = 0;
    }
    /* what the child wrote last; a grandchild holding the pipe is not waited for */
    fcntl(fds[0], F_SETFL, O_NONBLOCK);
    while (open_fd && lm_spawn_pump(b, fds[0]) == 1) {
    }
    if (b->linelen > 0) lm_spawn_line_end(b);
    close(fds[0]);
  } else {
    while (waitpid(pid, &wstatus, 0) < 0 && errno == EINTR) {
    }
  }
  sigaction(SIGINT, &old_int, NULL);
  sigaction(SIGTERM, &old_term, NULL);
  lm_fwd_child = 0;

  /* the result */
  lua_createtable(L, 0, 4);
  if (WIFSIGNALED(wstatus)) {
    lua_pushinteger(L, WTERMSIG(wstatus));
    lua_setfield(L, -2, "signal");
  } else {
    lua_pushinteger(L, WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : 1);
    lua_setfield(L, -2, "status");
  }
  if (lm_fwd_sig) {
    lua_pushinteger(L, lm_fwd_sig);
    lua_setfield(L, -2, "forwarded");
  }
  lua_createtable(L, b->nkept, 0);
  for (int i = 0; i < b->nkept; i++) {
    lua_pushstring(L, b->kept[i]);
    lua_rawseti(L, -2, i + 1);
  }
  lua_setfield(L, -2, "lines");
  return 1;
}

/* ------------------------------------------------------------- the rest */

static int lm_getpid(lua_State *L) {
  lua_pushinteger(L, (lua_Integer)getpid());
  return 1;
}

static int lm_geteuid(lua_State *L) {
  lua_pushinteger(L, (lua_Integer)geteuid());
  return 1;
}

static int lm_exe(lua_State *L) {
  char path[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", path, sizeof path - 1);
  if (n <= 0) return luaL_error(L, "exe: cannot read /proc/self/exe: %s", strerror(errno));
  path[n] = '\0';
  lua_pushstring(L, path);
  return 1;
}

static int lm_executable(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  struct stat st;
  lua_pushboolean(L, stat(path, &st) == 0 && S_ISREG(st.st_mode) && access(path, X_OK) == 0);
  return 1;
}

/* Binds port 0 on every interface and reads the port the kernel chose. */
static int lm_free_port(lua_State *L) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return luaL_error(L, "free_port: socket: %s", strerror(errno));
  struct sockaddr_in a;
  memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 ||
      getsockname(fd, (struct sockaddr *)&a, &len) != 0) {
    int e = errno;
    close(fd);
    return luaL_error(L, "free_port: %s", strerror(e));
  }
  close(fd);
  lua_pushinteger(L, ntohs(a.sin_port));
  return 1;
}

static int lm_mkdtemp(lua_State *L) {
  const char *prefix = luaL_optstring(L, 1, "moe");
  if (strchr(prefix, '/')) lm_argerror(L, 1, "mkdtemp", "prefix '%s' has a '/'", prefix);
  const char *tmp = getenv("TMPDIR");
  if (tmp == NULL || *tmp == '\0') tmp = "/tmp";
  char path[PATH_MAX];
  if (snprintf(path, sizeof path, "%s/%s-XXXXXX", tmp, prefix) >= (int)sizeof path)
    return luaL_error(L, "mkdtemp: the path is too long");
  if (mkdtemp(path) == NULL)
    return luaL_error(L, "mkdtemp: cannot make %s: %s", path, strerror(errno));
  lua_pushstring(L, path);
  return 1;
}

static const luaL_Reg lm_proc_functions[] = {
    {"spawn", lm_spawn},     {"getpid", lm_getpid},         {"geteuid", lm_geteuid},
    {"exe", lm_exe},         {"executable", lm_executable}, {"free_port", lm_free_port},
    {"mkdtemp", lm_mkdtemp}, {"soft_stop", lm_soft_stop},   {"stop_requested", lm_stop_requested},
    {"stopped", lm_stopped}, {NULL, NULL}};

/* moe.proc. */
void lm_open_proc(lua_State *L, int mod, int methods, int sentinel) {
  mod = lua_absindex(L, mod);
  luaL_newlibtable(L, lm_proc_functions);
  lm_register(L, -1, methods, sentinel, lm_proc_functions, NULL);
  lua_setfield(L, mod, "proc");
}
