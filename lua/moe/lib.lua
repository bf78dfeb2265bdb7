--[[
moe/lib.lua - the parts of the `moe` module written in Lua.

luaopen_moe (bindings/linit.c) builds the module table from C, stores it in
package.loaded.moe and then requires this file, which adds Lua-implemented
functions to the same table. Keep this file small: each feature lives in its
own module (moe/config.lua, ...) and is attached here.
]]
local moe = require "moe"

moe.config = require "moe.config"
moe.autograd = require "moe.autograd"
moe.gradcheck = require "moe.gradcheck"
moe.quantize = require "moe.quantize"
moe.dist = require "moe.dist" -- adds the mesh and dist.functional to the C part
-- The model library loads on first use (moe.nn, moe.optim, ...), so a script
-- that only uses tensors does not pay for it.
local lazy = {
  nn = "moe.nn", routers = "moe.routers", experts = "moe.experts", layers = "moe.layers",
  optim = "moe.optim", data = "moe.data", train = "moe.train", tensorboard = "moe.tensorboard",
  sample = "moe.sample",
}
setmetatable(moe, {
  __index = function(t, k)
    local name = lazy[k]
    if name == nil then return nil end
    local m = require(name)
    rawset(t, k, m)
    return m
  end,
})

return true
