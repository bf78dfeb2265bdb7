--[[
moe/routers/expert_choice.lua - routers.ExpertChoice (Zhou et al. 2022):
each expert takes its top-C tokens by score, C = ceil(T * capacity_factor /
E) (at most T). probs = softmax over the experts of x W^T (f32 when fp32);
gates are the chosen probs. Balanced by construction: no load-balancing
loss (zloss_weight still applies). A token may be taken by several experts
or by none.

  routers.ExpertChoice{d_model=, num_experts=, capacity_factor=1,
    zloss_weight=0, fp32=true, bias=false, std=0.02}
  forward(x (T, d)) -> {kind="expert", tokens=(E, C) i64, gates=(E, C) x's
    dtype, probs=(T, E) f32, capacity=C}; stats = {expert_counts=(E) i64
    (C each), tokens_routed=(T) i64 (experts per token)}
]]
local moe = require "moe"
local nn = require "moe.nn"
local base = require "moe.routers.base"

local ExpertChoice = nn.class("ExpertChoiceRouter", base.Router)

function ExpertChoice:init(o)
  self:setup("routers.ExpertChoice", o, { "capacity_factor" },
    { capacity_factor = 1, loss_weight = 0, zloss_weight = 0 })
  local cf = self.cfg.capacity_factor
  if type(cf) ~= "number" or cf <= 0 then
    error("routers.ExpertChoice: capacity_factor must be a number > 0, got " .. tostring(cf), 2)
  end
  if self.cfg.top_k ~= nil then error("routers.ExpertChoice: top_k does not apply (use capacity_factor)", 2) end
end

function ExpertChoice:capacity(T)
  return math.max(1, math.min(T, math.ceil(T * self.cfg.capacity_factor / self.num_experts)))
end

function ExpertChoice:forward(x)
  local logits = self:logits(x)
  local T, E = logits:size(0), self.num_experts
  local probs = moe.softmax(logits, -1)
  local C = self:capacity(T)
  local gates, tokens = moe.topk(probs:transpose(0, 1), C, -1) -- (E, C)
  if gates.dtype ~= x.dtype then gates = gates:to(x.dtype) end
  local counts = moe.full({ E }, C, { dtype = "i64", device = logits.device })
  self.stats = { expert_counts = counts, tokens_routed = base.bincount(tokens, T) }
  if self.training and (self.cfg.zloss_weight or 0) > 0 then
    local z = base.z_loss(logits, self.cfg.zloss_weight)
    local prev = rawget(self, "aux_loss")
    self.aux_loss = prev and prev + z or z
  end
  return { kind = "expert", tokens = tokens, gates = gates, probs = probs, capacity = C }
end

function ExpertChoice:extra_repr()
  return string.format("d_model=%d, num_experts=%d, capacity_factor=%g", self.cfg.d_model, self.num_experts,
    self.cfg.capacity_factor)
end

return ExpertChoice
