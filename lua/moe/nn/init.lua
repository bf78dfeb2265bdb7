--[[
moe/nn/init.lua - `local nn = require "moe.nn"`: the module system and the
layers of the model library, re-exported from

  moe/nn/module.lua       nn.class, nn.Module (parameters, children, state
                          dicts, train/eval, to(), aux losses, printout)
  moe/nn/layers.lua       Linear, Embedding, LayerNorm, RMSNorm, Dropout,
                          ModuleList, MLP, GLU
  moe/nn/transformer.lua  CausalSelfAttention, TransformerBlock, TransformerLM

See docs/MODELS.md for how to define a model and the option tables.
]]
local module = require "moe.nn.module"
local layers = require "moe.nn.layers"
local transformer = require "moe.nn.transformer"

local nn = {
  class = module.class,
  Module = module.Module,
  check_opts = layers.check_opts,
  activations = layers.activations,
}

for _, k in ipairs({ "Linear", "Embedding", "LayerNorm", "RMSNorm", "Dropout", "ModuleList", "MLP", "GLU" }) do
  nn[k] = layers[k]
end
for _, k in ipairs({ "CausalSelfAttention", "TransformerBlock", "TransformerLM" }) do
  nn[k] = transformer[k]
end

return nn
