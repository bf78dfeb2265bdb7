/*
 * lmoe.h - the entry point of the `moe` Lua module (bindings/linit.c).
 *
 * The module is compiled twice: into build/moe.so for stock lua5.4 (and
 * busted), and into the moe-lua host, which registers luaopen_moe in
 * package.preload. Either way `local moe = require "moe"` is how Lua code
 * gets it; one moe_ctx is created per Lua state and shared by every load.
 */
#ifndef LMOE_H
#define LMOE_H

#include "lua.h"

LUAMOD_API int luaopen_moe(lua_State *L);

/* Soft stops (moe.proc.soft_stop, bindings/lproc.c), for the moe-lua host:
 * lm_proc_host_signals() says the host delivers SIGINT/SIGTERM to
 * lm_proc_take_signal, which its signal handler calls first (async-signal
 * safe) and which returns 1 when a soft stop took the signal (the host then
 * raises nothing); lm_proc_stopped() is the signal of a stop that Lua
 * declared complete (moe.proc.stopped), 0 if none. */
void lm_proc_host_signals(void);
int lm_proc_take_signal(int sig);
int lm_proc_stopped(void);

#endif /* LMOE_H */
