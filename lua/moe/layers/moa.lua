--[[
moe/layers/moa.lua - layers.MoA: Mixture of Attention heads (Zhang et al.
2022, the MoA layer of ScatterMoE's paper, Tan et al. 2024), written only in
Lua over moe.ops.parallel_linear and moe.scaled_dot_product_attention: the
example of a new expert type.

Each token's router picks top_k of num_experts attention experts. Expert e
owns a query projection Wq_e (d, H D) and an output projection Wo_e (H D, d);
keys and values (d -> H D each) are shared by all experts. For token t and
its j-th expert e = ids[t, j]:
  q_tj = x_t Wq_e (H heads of D), o_tj = attention(q_tj, K, V) (causal),
  y_t = sum_j gates[t, j] * o_tj Wo_e.
The k choices of a token act as k H heads over the same K, V.

  layers.MoA{d_model=, n_heads=, head_dim=d_model/n_heads, num_experts=, top_k=,
    router=nil (default routers.TopK{loss_weight=, zloss_weight=}),
    loss_weight=0.01, zloss_weight=0, impl="grouped"|"loop", causal=true,
    std=0.02, out_std=std, dtype=, device=}
  forward(x (B, S, d)) -> (B, S, d); aux_loss and stats as layers.dMoE.

Parameters: router.*, kv.weight (2 H D, d) (nn.Linear), wq (E, d, H D),
wo (E, H D, d). Token-choice routers only (an expert-choice router would give
a token a varying number of heads).
]]
local moe = require "moe"
local nn = require "moe.nn"
local util = require "moe.experts.util"

local M = {}
local NONE = util.NONE

local DEFAULTS = {
  d_model = NONE, n_heads = NONE, head_dim = NONE, num_experts = NONE, top_k = 1, router = NONE,
  loss_weight = 0.01, zloss_weight = 0, impl = "grouped", causal = true, std = 0.02, out_std = NONE,
  dtype = NONE, device = NONE,
}

local MoA = nn.class("MoA", nn.Module)
M.MoA = MoA

local function normal(shape, std, dtype, device)
  local t = moe.randn(shape) * std
  if (dtype or "f32") ~= "f32" or (device or "cpu") ~= "cpu" then
    t = t:to({ dtype = dtype or "f32", device = device or "cpu" })
  end
  return t
end

function MoA:init(o)
  o = util.options("layers.MoA", o, DEFAULTS, 4)
  for _, k in ipairs({ "d_model", "n_heads", "num_experts", "top_k" }) do
    if math.type(o[k]) ~= "integer" or o[k] <= 0 then
      error(string.format("layers.MoA: %s must be a positive integer, got %s", k, tostring(o[k])), 3)
    end
  end
  local d, H, E, k = o.d_model, o.n_heads, o.num_experts, o.top_k
  local D = o.head_dim
  if D == nil then
    if d % H ~= 0 then
      error(string.format("layers.MoA: d_model (%d) is not a multiple of n_heads (%d): give head_dim", d, H), 3)
    end
    D = d // H
  elseif math.type(D) ~= "integer" or D <= 0 then
    error("layers.MoA: head_dim must be a positive integer, got " .. tostring(D), 3)
  end
  if k > E then error(string.format("layers.MoA: top_k = %d is more than num_experts = %d", k, E), 3) end
  if o.impl ~= "grouped" and o.impl ~= "loop" then
    error("layers.MoA: impl must be \"grouped\" or \"loop\", got " .. tostring(o.impl), 3)
  end
  self.d_model, self.n_heads, self.head_dim, self.num_experts, self.top_k = d, H, D, E, k
  self.impl, self.causal = o.impl, o.causal and true or false
  if o.router ~= nil then
    if type(o.router) ~= "table" or type(o.router._params) ~= "table" then
      error("layers.MoA: router must be an nn.Module (a routers.* instance), got " .. type(o.router), 3)
    end
    self:child("router", o.router)
  else
    local routers = require "moe.routers"
    self:child("router", routers.TopK {
      d_model = d, num_experts = E, top_k = k, loss_weight = o.loss_weight, zloss_weight = o.zloss_weight,
      std = o.std, dtype = o.dtype, device = o.device,
    })
  end
  self:child("kv", nn.Linear(d, 2 * H * D, { bias = false, std = o.std, dtype = o.dtype, device = o.device }))
  self:param("wq", normal({ E, d, H * D }, o.std, o.dtype, o.device))                -- (E, d, H D)
  self:param("wo", normal({ E, H * D, d }, o.out_std or o.std, o.dtype, o.device))   -- (E, H D, d)
end

function MoA:forward(x)
  local d, H, D, E = self.d_model, self.n_heads, self.head_dim, self.num_experts
  if not moe.is_tensor(x) or x:dim() ~= 3 or x:size(2) ~= d then
    error(string.format("%s: x must be (B, S, %d), got %s", self.__name, d,
      moe.is_tensor(x) and "(" .. table.concat(x.shape, ", ") .. ")" or type(x)), 2)
  end
  local B, S = x:size(0), x:size(1)
  local T = B * S
  local x2 = x:reshape({ T, d })
  local r = self.router(x2)
  if type(r) ~= "table" or r.kind ~= "token" then
    error(self.__name .. ": the router must be a token-choice router (kind \"token\")", 2)
  end
  local k = r.ids:size(1)
  local plan = moe.pass_up(moe.ops.routing_plan(r.ids, E)) -- lives until the micro-batch ends
  -- queries of every (token, choice), in the plan's order then in
  -- assignment order a = t k + j (dropless: dest is a permutation)
  local q = util.parallel_linear(x2, self.wq, plan, { impl = self.impl, gather = true }) -- (T k, H D)
  q = moe.index_select(q, 0, plan.dest)
  q = q:reshape({ B, S, k * H, D }):transpose(1, 2)                                      -- (B, k H, S, D)
  local kv = self.kv(x2):reshape({ B, S, 2, H, D })
  local function heads(i) -- (B, S, H, D) -> (B, k H, S, D), the same K or V for the k choices
    local t = kv:select(2, i):transpose(1, 2)                                             -- (B, H, S, D)
    if k == 1 then return t end
    return t:unsqueeze(1):expand(B, k, H, S, D):reshape({ B, k * H, S, D })
  end
  local o = moe.scaled_dot_product_attention(q, heads(0), heads(1), { causal = self.causal }) -- (B, k H, S, D)
  o = o:transpose(1, 2):reshape({ T * k, H * D })                                        -- assignment order
  o = moe.index_select(o, 0, plan.src)                                                   -- the plan's order
  local y = util.parallel_linear(o, self.wo, plan, { impl = self.impl, scatter = true, gates = r.gates })
  local router = self.router
  local a = rawget(router, "aux_loss")
  if a ~= nil then
    local prev = rawget(self, "aux_loss")
    self.aux_loss = prev and prev + a or a
    router.aux_loss = nil
  end
  local stats = {}
  for kk, v in pairs(rawget(router, "stats") or {}) do stats[kk] = v end
  router.stats = nil
  stats.expert_counts = plan.counts
  self.stats = stats
  return y:reshape({ B, S, d })
end

function MoA:num_active_parameters()
  local per_expert = (self.wq:numel() + self.wo:numel()) // self.num_experts
  return self.router:num_parameters() + self.kv:num_parameters() + self.top_k * per_expert
end

function MoA:extra_repr()
  return string.format("d_model=%d, n_heads=%d, head_dim=%d, num_experts=%d, top_k=%d, impl=%s",
    self.d_model, self.n_heads, self.head_dim, self.num_experts, self.top_k, self.impl)
end

return M
