--[[
moe/routers/init.lua - `local routers = require "moe.routers"`: the router
classes (each an nn.Module; see docs/MODELS.md):
  routers.TopK          top-k softmax (MegaBlocks' options)   topk.lua
  routers.Sigmoid       sigmoid scores (DeepSeek)              sigmoid.lua
  routers.BiasBalanced  aux-loss-free bias balancing (V3)      bias_balanced.lua
  routers.ExpertChoice  experts pick their tokens              expert_choice.lua
  routers.Router        the base class (gate layer, losses)    base.lua
and the helpers bincount, normalize, load_balancing_loss, z_loss.
]]
local base = require "moe.routers.base"

return {
  Router = base.Router,
  TopK = require "moe.routers.topk",
  Sigmoid = require "moe.routers.sigmoid",
  BiasBalanced = require "moe.routers.bias_balanced",
  ExpertChoice = require "moe.routers.expert_choice",
  bincount = base.bincount,
  normalize = base.normalize,
  load_balancing_loss = base.load_balancing_loss,
  z_loss = base.z_loss,
}
