--[[
moe/layers/init.lua - `local layers = require "moe.layers"`: MoE layers
(nn.Modules; forward(x (B, S, d) or (T, d)) -> the same shape).

  layers.dMoE{...}   dropless MoE (MegaBlocks' dMoE and its option names)   dmoe.lua
  layers.MoE{...}    capacity-factor MoE (token dropping)                   moe.lua
  layers.MoA{...}    Mixture of Attention heads (ScatterMoE's paper)        moa.lua

docs/LAYERS.md maps MegaBlocks' options to these and shows how to write a
new expert type.
]]
return {
  dMoE = require("moe.layers.dmoe").dMoE,
  MoE = require("moe.layers.moe").MoE,
  MoA = require("moe.layers.moa").MoA,
}
