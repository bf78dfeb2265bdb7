--[[
moe/routers/bias_balanced.lua - routers.BiasBalanced: DeepSeek-V3's
auxiliary-loss-free balancing. Sigmoid scores; the experts are chosen by
the top_k of scores + expert_bias (a (E) f32 buffer, not trained, saved in
the state dict), the gates come from the unbiased scores. After each step
the bias moves toward balance: bias_e += rate * sign(mean_count - count_e)
(router:update_bias(counts)), done by forward itself in train mode unless
auto_update = false. loss_weight defaults to 0 (no aux loss).

  routers.BiasBalanced{d_model=, num_experts=, top_k=1,
    bias_update_rate=1e-3, auto_update=true, normalize_expert_weights=1,
    route_scale=1, loss_weight=0, zloss_weight=0, fp32=true, ...}
]]
local moe = require "moe"
local nn = require "moe.nn"
local Sigmoid = require "moe.routers.sigmoid"

local BiasBalanced = nn.class("BiasBalancedRouter", Sigmoid)

function BiasBalanced:init(o)
  self:setup("routers.BiasBalanced", o, { "route_scale", "bias_update_rate", "auto_update" },
    { top_k = 1, loss_weight = 0, zloss_weight = 0, normalize_expert_weights = 1, route_scale = 1,
      bias_update_rate = 1e-3, auto_update = true })
  local dev = self.cfg.device or "cpu"
  self:buffer("expert_bias", moe.zeros({ self.num_experts }, { dtype = "f32", device = dev }))
end

function BiasBalanced:select(scores)
  local b = self.expert_bias
  if b.dtype ~= scores.dtype then b = b:to(scores.dtype) end
  local _, ids = moe.topk(scores:detach() + b, self.top_k, -1)
  return ids
end

-- bias += rate * sign(mean(counts) - counts); counts (E) of any dtype.
function BiasBalanced:update_bias(counts)
  local E = self.num_experts
  local c = counts:to({ dtype = "f32", device = self.expert_bias.device })
  moe.no_grad(function()
    local d = moe.sum(c) * (1 / E) - c -- mean - count
    local sign = moe.gt(d, 0):float() - moe.lt(d, 0):float()
    self.expert_bias:copy_(self.expert_bias + sign * self.cfg.bias_update_rate)
  end)
end

function BiasBalanced:forward(x)
  local out = Sigmoid.forward(self, x)
  if self.training and self.cfg.auto_update then self:update_bias(out.counts) end
  return out
end

return BiasBalanced
