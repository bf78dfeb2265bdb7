-- Run by stock lua5.4 (not moe-lua): the module built as build/moe.so loads
-- into a plain interpreter, with its Lua parts (moe.config) found too.
-- Usage: lua5.4 tests/lua/stock_load.lua BUILD_DIR
local build = assert(arg[1], "usage: lua5.4 stock_load.lua BUILD_DIR")
package.cpath = build .. "/?.so;" .. package.cpath
local moe = require "moe"
local t = moe.randn{2, 3}
assert(t.shape[1] == 2 and t.shape[2] == 3)
print(t)
assert(type(moe.config) == "function", "moe.config missing")
print("config ok")
