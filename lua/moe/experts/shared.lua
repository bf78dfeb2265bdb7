--[[
moe/experts/shared.lua - experts.Shared: a dense MLP or GLU that every token
goes through, added to the routed experts' output by the MoE layers
(MegaBlocks' shared_expert; DeepSeek's shared experts).

  experts.Shared{d_model=, d_ff=, mlp_type="mlp"|"glu", activation=
                 ("gelu" for mlp, "silu" for glu), bias=false, std=0.02,
                 out_std=std, dtype=, device=}
  forward(x (..., d)) -> (..., d)

Its child is an nn.MLP (fc1, fc2) or nn.GLU (w1, w3, w2), so
nn.TransformerLM's scaling of output projections applies to it.
]]
local nn = require "moe.nn"
local util = require "moe.experts.util"

local M = {}

local DEFAULTS = {
  d_model = util.NONE, d_ff = util.NONE, mlp_type = "mlp", activation = util.NONE, bias = false,
  std = 0.02, out_std = util.NONE, dtype = util.NONE, device = util.NONE,
}

local Shared = nn.class("SharedExpert", nn.Module)
M.Shared = Shared

function Shared:init(o)
  o = util.options("experts.Shared", o, DEFAULTS, 4)
  if o.mlp_type ~= "mlp" and o.mlp_type ~= "glu" then
    error("experts.Shared: mlp_type must be \"mlp\" or \"glu\", got " .. tostring(o.mlp_type), 3)
  end
  self.mlp_type = o.mlp_type
  local cls = o.mlp_type == "glu" and nn.GLU or nn.MLP
  self:child("mlp", cls {
    d_model = o.d_model, d_ff = o.d_ff, activation = o.activation, bias = o.bias, std = o.std,
    out_std = o.out_std, dtype = o.dtype, device = o.device,
  })
end

function Shared:forward(x) return self.mlp(x) end

function Shared:extra_repr() return "mlp_type=" .. self.mlp_type end

return M
