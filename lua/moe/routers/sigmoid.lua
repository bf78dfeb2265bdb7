--[[
moe/routers/sigmoid.lua - routers.Sigmoid: DeepSeek-style sigmoid scores.
scores = sigmoid(x W^T) (f32 when fp32), ids = the top_k of the scores,
gates = the chosen scores divided by their p-norm (normalize_expert_weights,
default 1: they sum to 1) times route_scale. The load-balancing loss uses
the scores normalised over the experts as the probabilities P.

  routers.Sigmoid{d_model=, num_experts=, top_k=1, normalize_expert_weights=1,
    route_scale=1, loss_weight=0.01, zloss_weight=0, jitter_eps=0, fp32=true,
    bias=false, std=0.02}
  forward(x (T, d)) -> {kind="token", ids, gates, probs=(T, E) f32 (the
    normalised scores), scores=(T, E), counts=(E) i64, logits}
]]
local moe = require "moe"
local nn = require "moe.nn"
local base = require "moe.routers.base"

local Sigmoid = nn.class("SigmoidRouter", base.Router)

function Sigmoid:init(o)
  self:setup("routers.Sigmoid", o, { "route_scale" },
    { top_k = 1, loss_weight = 0.01, zloss_weight = 0, normalize_expert_weights = 1, route_scale = 1 })
end

-- scores (T, E) and the ids (T, k) chosen; subclasses change the choice.
function Sigmoid:select(scores)
  local _, ids = moe.topk(scores, self.top_k, -1)
  return ids
end

function Sigmoid:forward(x)
  local logits = self:logits(x)
  local scores = moe.sigmoid(logits)
  local ids = self:select(scores)
  local gates = base.normalize(moe.gather(scores, 1, ids), self.cfg.normalize_expert_weights)
  if self.cfg.route_scale ~= 1 then gates = gates * self.cfg.route_scale end
  if gates.dtype ~= x.dtype then gates = gates:to(x.dtype) end
  local counts = self:count(ids, gates)
  local probs = scores / moe.sum(scores, -1, true)
  self:record(probs, counts, logits)
  return { kind = "token", ids = ids, gates = gates, probs = probs, scores = scores, counts = counts,
    logits = logits }
end

return Sigmoid
