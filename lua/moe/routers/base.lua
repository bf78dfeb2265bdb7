--[[
moe/routers/base.lua - what the routers of moe.routers share: the Router
base class (a gate Linear named "layer", as MegaBlocks' router.layer), the
fp32 logits, expert counts (moe.bincount of the ids: one kernel, no host
synchronisation), the load-balancing loss and the router z-loss. Each router
file only adds how scores become ids and gates.

Counts shared with the layer: a router gets its counts through
self:count(ids, gates). A layer that builds the routing plan from the
router's own ids (layers.dMoE) may set router.counts_from = function(ids,
gates) -> counts for the length of one forward: count() then calls it once
(the layer builds its plan there and hands back plan.counts) instead of
counting again, so the load-balancing loss, the layer's plan and its stats
use one count per layer per step.

Losses (per router call, i.e. per layer; pop_aux_loss() sums the layers):
  load balancing  loss_weight * E * sum_e f_e P_e, with f_e = count_e / (T k)
                  the fraction of assignments to e and P_e the mean over
                  tokens of e's normalised score (MegaBlocks and Switch;
                  MegaBlocks also divides by num_layers: pass
                  loss_weight / n_layers to match it exactly);
  z-loss          zloss_weight * mean_t logsumexp(logits_t)^2 (ST-MoE).
Both are added to self.aux_loss only in train mode.
]]
local moe = require "moe"
local nn = require "moe.nn"

local M = {}

-- The option names every router accepts.
M.common_opts = { "d_model", "num_experts", "top_k", "jitter_eps", "normalize_expert_weights", "loss_weight",
  "zloss_weight", "fp32", "bias", "std", "dtype", "device" }

local function concat(a, b)
  local out = {}
  for _, v in ipairs(a) do out[#out + 1] = v end
  for _, v in ipairs(b or {}) do out[#out + 1] = v end
  return out
end
M.concat = concat

local Router = nn.class("Router", nn.Module)
M.Router = Router

-- self:setup(fname, o, extra_names, defaults), called by a router's init: checks the options
-- and makes the gate layer; o's values override defaults.
function Router:setup(fname, o, extra, defaults)
  o = nn.check_opts(fname, o, concat(M.common_opts, extra))
  local cfg = {}
  for k, v in pairs(defaults or {}) do cfg[k] = v end
  for k, v in pairs(o) do cfg[k] = v end
  for _, k in ipairs({ "d_model", "num_experts" }) do
    if math.type(cfg[k]) ~= "integer" or cfg[k] <= 0 then
      error(string.format("%s: %s must be a positive integer, got %s", fname, k, tostring(cfg[k])), 3)
    end
  end
  if cfg.top_k ~= nil and (math.type(cfg.top_k) ~= "integer" or cfg.top_k <= 0 or cfg.top_k > cfg.num_experts) then
    error(string.format("%s: top_k must be an integer in [1, num_experts = %d], got %s", fname, cfg.num_experts,
      tostring(cfg.top_k)), 3)
  end
  local p = cfg.normalize_expert_weights
  if p ~= nil and p ~= false and (type(p) ~= "number" or p <= 0) then
    error(fname .. ": normalize_expert_weights must be nil or a p > 0 (the p of the p-norm), got " .. tostring(p), 3)
  end
  local eps = cfg.jitter_eps or 0
  if type(eps) ~= "number" or eps < 0 or eps >= 1 then
    error(fname .. ": jitter_eps must be a number in [0, 1), got " .. tostring(eps), 3)
  end
  if cfg.fp32 == nil then cfg.fp32 = true end
  self.cfg = cfg
  self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
  self:child("layer", nn.Linear(cfg.d_model, cfg.num_experts,
    { bias = cfg.bias or false, std = cfg.std or 0.02, dtype = cfg.dtype, device = cfg.device }))
  return cfg
end

-- x (..., d) -> x2 (T, d) (jittered in train mode) and logits (T, E) in
-- f32 when cfg.fp32 (else x's dtype).
function Router:logits(x)
  local d = self.cfg.d_model
  if x:size(-1) ~= d then
    error(string.format("%s: x must be (T, %d), got (%s)", self.__name, d, table.concat(x.shape, ", ")), 3)
  end
  if x:dim() ~= 2 then x = x:reshape({ -1, d }) end
  local eps = self.cfg.jitter_eps or 0
  if self.training and eps > 0 then
    local noise = moe.empty(x.shape, { dtype = x.dtype, device = x.device }):uniform_(1 - eps, 1 + eps)
    x = x * noise
  end
  local w, b = self.layer.weight, self.layer.bias
  if self.cfg.fp32 and x.dtype ~= "f32" and x.dtype ~= "f64" then
    x, w = x:float(), w:float()
    if b then b = b:float() end
  end
  return moe.linear(x, w, b), x
end

-- (E) i64 counts of the ids (any shape, values in [0, E)).
function M.bincount(ids, E)
  return moe.bincount(ids, E)
end

-- (E) i64 counts of this router's ids (T, k) with their gates (T, k): from the
-- layer's counts_from when it offers one (used once), else a bincount.
function Router:count(ids, gates)
  local from = rawget(self, "counts_from")
  if from then
    self.counts_from = nil
    return from(ids, gates)
  end
  return M.bincount(ids, self.num_experts)
end

-- gates (T, k) / ||gates||_p over the k (p nil or false: unchanged).
function M.normalize(gates, p)
  if not p then return gates end
  return gates / moe.norm(gates, p, -1, true)
end

-- loss_weight * E * sum_e (counts_e / (T k)) * mean_t(probs[t, e]).
function M.load_balancing_loss(probs, counts, k, weight)
  local T, E = probs:size(0), probs:size(1)
  local f = counts:to(probs.dtype) * (1 / (T * k))
  local P = moe.mean(probs, 0)
  return moe.sum(f * P) * (E * weight)
end

-- weight * mean_t logsumexp(logits_t)^2
function M.z_loss(logits, weight)
  local lse = moe.logsumexp(logits, -1)
  return moe.mean(lse * lse) * weight
end

-- Sets self.aux_loss (train mode only) from probs (T, E) normalised scores,
-- counts and logits, and self.stats.expert_counts.
function Router:record(probs, counts, logits)
  self.stats = { expert_counts = counts }
  if not self.training then return end
  local cfg, aux = self.cfg, nil
  if (cfg.loss_weight or 0) > 0 then
    aux = M.load_balancing_loss(probs, counts, self.top_k, cfg.loss_weight)
  end
  if (cfg.zloss_weight or 0) > 0 then
    local z = M.z_loss(logits, cfg.zloss_weight)
    aux = aux and aux + z or z
  end
  if aux then
    local prev = rawget(self, "aux_loss")
    self.aux_loss = prev and prev + aux or aux
  end
end

function Router:extra_repr()
  local c = self.cfg
  return string.format("d_model=%d, num_experts=%d%s", c.d_model, c.num_experts,
    self.top_k and (", top_k=" .. self.top_k) or "")
end

return M
