--[[
moe/lib.lua - the parts of the `moe` module written in Lua.

luaopen_moe (bindings/lmoe.c) builds the module table from C, stores it in
package.loaded.moe and then requires this file, which adds Lua-implemented
functions to the same table. Keep this file small: each feature lives in its
own module (moe/config.lua, ...) and is attached here.
]]
local moe = require "moe"

moe.config = require "moe.config"
moe.autograd = require "moe.autograd"
moe.gradcheck = require "moe.gradcheck"

return true
