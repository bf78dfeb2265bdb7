--[[
moe/routers/topk.lua - routers.TopK: the top-k softmax router of MegaBlocks
and Switch. probs = softmax(x W^T) (f32 when fp32), ids and gates = the
top_k of probs, gates optionally divided by their p-norm over the k
(normalize_expert_weights = p), jitter (train mode: x * uniform(1 - eps,
1 + eps)), load-balancing and z-loss as in moe/routers/base.lua.

  routers.TopK{d_model=, num_experts=, top_k=1, jitter_eps=0,
    normalize_expert_weights=nil, loss_weight=0.01, zloss_weight=0,
    fp32=true, bias=false, std=0.02}
  forward(x (T, d)) -> {kind="token", ids=(T, k) i64, gates=(T, k) x's dtype,
    probs=(T, E) f32, counts=(E) i64, logits=(T, E)}
]]
local moe = require "moe"
local nn = require "moe.nn"
local base = require "moe.routers.base"

local TopK = nn.class("TopKRouter", base.Router)

function TopK:init(o)
  self:setup("routers.TopK", o, nil, { top_k = 1, loss_weight = 0.01, zloss_weight = 0 })
end

function TopK:forward(x)
  local logits = self:logits(x)
  local probs = moe.softmax(logits, -1)
  local gates, ids = moe.topk(probs, self.top_k, -1)
  gates = base.normalize(gates, self.cfg.normalize_expert_weights)
  if gates.dtype ~= x.dtype then gates = gates:to(x.dtype) end
  local counts = self:count(ids, gates)
  self:record(probs, counts, logits)
  return { kind = "token", ids = ids, gates = gates, probs = probs, counts = counts, logits = logits }
end

return TopK
