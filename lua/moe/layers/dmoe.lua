--[[
moe/layers/dmoe.lua - layers.dMoE: the dropless MoE layer of MegaBlocks,
router -> routing plan -> experts -> output, with MegaBlocks' option names
(megablocks.layers.arguments.Arguments) and its defaults unless noted.

  layers.dMoE{hidden_size=1024, ffn_hidden_size=4096, num_experts (moe_num_experts)=1,
    top_k (moe_top_k)=1, mlp_type="mlp"|"glu", mlp_impl="auto"|"grouped"|"sparse"|"loop",
    activation_fn="gelu_tanh", moe_loss_weight=0.1, moe_zloss_weight=0,
    moe_jitter_eps=nil, moe_normalize_expert_weights=nil, shared_expert=false,
    shared_expert_hidden_size=ffn_hidden_size, shared_expert_weighted_sum=false,
    memory_optimized_mlp=false, router=nil, experts=nil (a module with
    forward(x (T, d), plan, gates) -> (T, d): a new expert type), quantize=
    {inputs=, rematerialize=, scatter=}, block_size=128, ...}

forward(x (B, S, d) or (T, d)) -> same shape (and the bias (d) as a second
value when bias and return_bias). Sets self.aux_loss (the router's, moved
here, train mode) and self.stats = {expert_counts = (E) i64, ...}: the
plan's counts, which the router's load-balancing loss shares (one count per
layer and step, offer_counts). Host synchronisations: the routing plan's one
counts copy (moe_routing.h) when the implementation needs the group sizes
on the host; the router and the statistics read nothing back.

The routing plan: dropless (impl grouped and loop) or padded to block_size
with ffn_hidden = ffn_hidden_size, MegaBlocks' block-sparse topology (impl
sparse: ffn_hidden_size must be a multiple of block_size). A router whose
forward returns kind "expert" (routers.ExpertChoice) is also accepted: the
tokens each expert chose are gathered (index_select), run as E equal groups
and added back (index_add). See docs/LAYERS.md for every option.

Expert parallelism: moe_expert_model_parallelism = true spreads the experts
over expert_parallel_group (a moe.dist group; default moe.dist.world), each
rank holding num_experts / size of them (moe/layers/ep.lua).
]]
local moe = require "moe"
local nn = require "moe.nn"
local experts = require "moe.experts"
local xmlp = require "moe.experts.mlp"
local util = require "moe.experts.util"
local autotune = require "moe.experts.autotune"

local M = {}
local NONE = util.NONE

-- MegaBlocks' Arguments (names and defaults; the deviations are noted) and
-- moe-lua's own options.
local DEFAULTS = {
  hidden_size = 1024, ffn_hidden_size = 4096, num_layers = 1,
  bias = false,                  -- MegaBlocks: True (a (d) output bias)
  return_bias = false,           -- MegaBlocks: True (forward returns out, bias)
  activation_fn = "gelu_tanh",   -- MegaBlocks: partial(F.gelu, approximate="tanh")
  moe_num_experts = NONE, moe_top_k = NONE, moe_capacity_factor = NONE,
  moe_normalize_expert_weights = NONE, moe_loss_weight = 0.1, moe_jitter_eps = NONE,
  moe_lbl_in_fp32 = false, moe_zloss_weight = 0, moe_zloss_in_fp32 = false,
  moe_expert_model_parallelism = false, expert_parallel_group = NONE,
  ep_overlap_chunks = NONE,      -- moe-lua: chunks of the pipelined expert-parallel exchange (moe/layers/ep.lua)
  moe_weight_parallelism = false, weight_parallel_group = NONE,
  pipeline_model_parallel_size = 1, num_layers_per_virtual_pipeline_stage = NONE,
  memory_optimized_mlp = false, mlp_type = "mlp",
  mlp_impl = "auto",             -- MegaBlocks: "sparse"; auto: the faster measured on CUDA (autotune.lua), grouped on CPU
  quantize_inputs_num_bits = -1, quantize_rematerialize_num_bits = -1, quantize_scatter_num_bits = -1,
  fp16 = false,                  -- MegaBlocks: True (moe-lua: dtype f32 unless asked)
  bf16 = false, device = NONE, init_method = NONE, output_layer_init_method = NONE,
  uniform_expert_assignment = false, shared_expert = false, fc_cls = NONE, fc_kwargs = NONE,
  remat_act_fn = true, shared_expert_hidden_size = NONE, shared_expert_weighted_sum = false,
  -- moe-lua
  num_experts = NONE, top_k = NONE, capacity_factor = NONE, router = NONE, experts = NONE, quantize = NONE,
  block_size = 128, dtype = NONE, init_std = 0.02, drop_policy = "position",
}
M.DEFAULTS = DEFAULTS

local function fail(name, msg, level) error(name .. ": " .. msg, (level or 1) + 1) end

-- The value of an option given under MegaBlocks' name or moe-lua's short one.
local function alias(name, o, long, short, default, level)
  local a, b = o[long], o[short]
  if a ~= nil and b ~= nil and a ~= b then
    fail(name, string.format("%s = %s and %s = %s disagree (give one)", long, tostring(a), short, tostring(b)),
      level + 1)
  end
  if a == nil then a = b end
  if a == nil then a = default end
  return a
end

local function quantize_of(name, o, level)
  local q = o.quantize
  local old = { inputs = o.quantize_inputs_num_bits, rematerialize = o.quantize_rematerialize_num_bits,
    scatter = o.quantize_scatter_num_bits }
  local any_old = false
  for k, v in pairs(old) do
    if v ~= -1 then
      any_old = true
      if v ~= 4 and v ~= 8 then
        fail(name, string.format("quantize_%s_num_bits must be -1, 4 or 8, got %s", k, tostring(v)), level + 1)
      end
    end
  end
  if any_old then
    if q ~= nil then fail(name, "give quantize = {...} or the quantize_*_num_bits options, not both", level + 1) end
    q = {}
    for k, v in pairs(old) do
      if v ~= -1 then q[k] = v end
    end
  end
  return q
end

local dMoE = nn.class("dMoE", nn.Module)
M.dMoE = dMoE

-- o: the options (checked); name: for messages. Subclasses (layers.MoE)
-- call it with their own name and defaults and level 5 (errors name the
-- caller of the constructor: options/configure, dMoE.init, [MoE.init,]
-- the class call, the caller).
function dMoE:init(o, name, defaults, level)
  name, level = name or "layers.dMoE", level or 4
  o = util.options(name, o, defaults or DEFAULTS, level)
  self:configure(o, name, level)
end

function dMoE:configure(o, name, level)
  local E = alias(name, o, "moe_num_experts", "num_experts", 1, level)
  local k = alias(name, o, "moe_top_k", "top_k", 1, level)
  local d, f = o.hidden_size, o.ffn_hidden_size
  for _, kv in ipairs({ { "hidden_size", d }, { "ffn_hidden_size", f }, { "num_experts", E }, { "top_k", k } }) do
    if math.type(kv[2]) ~= "integer" or kv[2] <= 0 then
      fail(name, string.format("%s must be a positive integer, got %s", kv[1], tostring(kv[2])), level)
    end
  end
  if k > E then fail(name, string.format("top_k = %d is more than num_experts = %d", k, E), level) end
  if o.mlp_type ~= "mlp" and o.mlp_type ~= "glu" then
    fail(name, "mlp_type must be \"mlp\" or \"glu\", got " .. tostring(o.mlp_type), level)
  end
  if o.mlp_impl ~= "auto" and not util.IMPLS[o.mlp_impl] then
    fail(name, "mlp_impl must be \"auto\", \"grouped\", \"sparse\" or \"loop\", got " .. tostring(o.mlp_impl), level)
  end
  if math.type(o.block_size) ~= "integer" or o.block_size <= 0 then
    fail(name, "block_size must be a positive integer, got " .. tostring(o.block_size), level)
  end
  if o.mlp_impl == "sparse" and f % o.block_size ~= 0 then
    fail(name, string.format("mlp_impl \"sparse\" needs ffn_hidden_size (%d) to be a multiple of block_size (%d)",
      f, o.block_size), level)
  end
  if o.pipeline_model_parallel_size ~= 1 or o.num_layers_per_virtual_pipeline_stage ~= nil then
    fail(name, "pipeline parallelism is not available (pipeline_model_parallel_size must be 1)", level)
  end
  if o.fc_cls ~= nil or o.fc_kwargs ~= nil then
    fail(name, "fc_cls and fc_kwargs are PyTorch classes: give shared_expert options instead", level)
  end
  if o.fp16 then fail(name, "fp16 is not supported (use bf16 = true or dtype = \"bf16\")", level) end
  if o.init_method ~= nil and type(o.init_method) ~= "function" and type(o.init_method) ~= "number" then
    fail(name, "init_method must be a function(tensor) that fills it in place, or a std, got "
      .. type(o.init_method), level)
  end
  if o.output_layer_init_method ~= nil and type(o.output_layer_init_method) ~= "function"
      and type(o.output_layer_init_method) ~= "number" then
    fail(name, "output_layer_init_method must be a function(tensor) or a std, got "
      .. type(o.output_layer_init_method), level)
  end
  local dtype = o.dtype or (o.bf16 and "bf16") or nil
  local q = quantize_of(name, o, level)
  xmlp.check_quantize(q, name, level + 1)
  util.activation(o.activation_fn, name, level + 1)

  self.cfg = o
  self.hidden_size, self.ffn_hidden_size, self.num_experts, self.top_k = d, f, E, k
  self.mlp_impl, self.block_size = o.mlp_impl == "auto" and "grouped" or o.mlp_impl, o.block_size
  self.mlp_impl_option = o.mlp_impl
  self.return_bias = o.return_bias and o.bias

  -- router
  if o.router ~= nil then
    if type(o.router) ~= "table" or type(o.router._params) ~= "table" then
      fail(name, "router must be an nn.Module (a routers.* instance), got " .. type(o.router), level)
    end
    self:child("router", o.router)
  else
    local routers = require "moe.routers"
    local ropts = {
      d_model = d, num_experts = E, top_k = k, jitter_eps = o.moe_jitter_eps,
      normalize_expert_weights = o.moe_normalize_expert_weights, loss_weight = o.moe_loss_weight,
      zloss_weight = o.moe_zloss_weight, fp32 = true, std = type(o.init_method) == "number"
          and o.init_method or o.init_std, dtype = dtype, device = o.device,
    }
    self:child("router", routers.TopK(ropts))
  end

  -- experts
  local std = type(o.init_method) == "number" and o.init_method or o.init_std
  local out_std = type(o.output_layer_init_method) == "number" and o.output_layer_init_method or std
  local eopts = {
    num_experts = E, d_model = d, d_ff = f, activation = o.activation_fn,
    impl = o.mlp_impl == "auto" and "grouped" or o.mlp_impl, -- auto: set per device in forward
    memory_optimized = o.memory_optimized_mlp, quantize = q, std = std, out_std = out_std,
    dtype = dtype, device = o.device,
  }
  local ex
  if o.experts ~= nil then
    if type(o.experts) ~= "table" or type(o.experts._params) ~= "table" then
      fail(name, "experts must be an nn.Module with forward(x (T, d), plan, gates) -> (T, d), got "
        .. type(o.experts), level)
    end
    ex = self:child("experts", o.experts)
  else
    local cls = o.mlp_type == "glu" and experts.GLU or experts.MLP
    ex = self:child("experts", cls(eopts))
  end
  if type(o.init_method) == "function" or type(o.output_layer_init_method) == "function" then
    local init = type(o.init_method) == "function" and o.init_method or nil
    local out_init = type(o.output_layer_init_method) == "function" and o.output_layer_init_method or init
    moe.no_grad(function()
      if init and ex.w1 then
        init(ex.w1)
        if ex.w3 then init(ex.w3) end
      end
      if out_init and ex.w2 then out_init(ex.w2) end
    end)
  end

  if o.shared_expert then
    self:child("shared_expert", experts.Shared {
      d_model = d, d_ff = o.shared_expert_hidden_size or f, mlp_type = o.mlp_type,
      activation = o.activation_fn, std = std, out_std = out_std, dtype = dtype, device = o.device,
    })
    self.shared_expert_weighted_sum = o.shared_expert_weighted_sum
  end
  if o.bias then
    self:param("bias", moe.zeros({ d }, { dtype = dtype or "f32", device = o.device or "cpu" })) -- (d)
  end
  self.uniform_expert_assignment = o.uniform_expert_assignment
  -- expert parallelism (moe/layers/ep.lua): this rank keeps its slice of the experts
  if o.moe_expert_model_parallelism or o.expert_parallel_group ~= nil then
    require("moe.layers.ep").setup(self, o, name, level)
  end
  -- weight parallelism (moe/layers/wp.lua): this rank keeps its slice of every expert's hidden units
  if o.moe_weight_parallelism or o.weight_parallel_group ~= nil then
    require("moe.layers.wp").setup(self, o, name, level)
  end
end

-- The experts' hidden size on this rank (ffn_hidden_size / the weight-parallel size).
function dMoE:ffn_local() return self.wp and self.wp.ffn_local or self.ffn_hidden_size end

-- mlp_impl "auto": the rule picks the block-sparse path on CUDA for more
-- than 16 experts when the grouped path would run on cuBLAS (many small
-- groups: on an H100 it was 1.5x the cuBLAS grouped path on the qwen3 shape
-- of bench/moe_mlp.lua and on the 125M dMoE with 64 experts), the grouped
-- path otherwise: on the CPU (1.3x faster there at 32 experts, d 128, f 256)
-- and where moe-lua's own grouped GEMM runs it (bf16 on an sm_90a GPU:
-- 2-5 % faster than the block-sparse path on the olmoe and qwen3 shapes,
-- H100 and H200, bench/results/auto_rule.md). On CUDA the built-in experts are then
-- timed with each path once per shape (moe/experts/autotune.lua) and the
-- measurably faster one runs. Sets the built-in experts' impl too; a user's
-- experts module decides for itself. Under expert parallelism the count is of
-- this rank's local experts. T: the tokens of this call.
function dMoE:resolve_impl(device, T)
  if self.mlp_impl_option ~= "auto" then return self.mlp_impl end
  local n_experts = self.ep and self.ep.local_experts or self.num_experts
  local ex = self.experts
  local w1 = ex and ex.w1
  local own = moe.is_tensor(w1) and autotune.own(device, w1.dtype, n_experts, self.hidden_size, self:ffn_local())
  local impl = autotune.rule(device:sub(1, 4) == "cuda", n_experts, self:ffn_local(), self.block_size, own)
  local builtin = ex and ex.impl ~= nil and util.IMPLS[ex.impl] and ex.w1 ~= nil
  if builtin and T and T > 0 then
    impl = autotune.pick(ex, { T = T, k = self.top_k, block_size = self.block_size, rule = impl })
  end
  self.mlp_impl = impl
  if builtin then ex.impl = impl end
  return impl
end

-- Options of moe.ops.routing_plan for this layer (gates: the router's (T, k)).
function dMoE:plan_opts(_)
  if self.mlp_impl == "sparse" then
    return { block_size = self.block_size, ffn_hidden = self:ffn_local() }
  end
  return {}
end

-- The router's counts and the layer's plan, one count: for the length of
-- the router's forward the router may take its counts from the plan this
-- layer will run (routers/base.lua Router:count), built there from the
-- router's ids and gates. Not with expert or weight parallelism (their plans
-- are over other ids or exchanged tokens) nor uniform_expert_assignment.
-- Returns a to-be-closed holder ({plan =, ids =, gates =} once the router
-- asked) that takes the offer back when the forward ends, even by an error.
local OFFER = { __close = function(h) rawset(h.router, "counts_from", nil) end }

function dMoE:offer_counts(router)
  if self.ep or self.wp or self.uniform_expert_assignment then return nil end
  local h = setmetatable({ router = router }, OFFER)
  rawset(router, "counts_from", function(ids, gates)
    h.plan = moe.ops.routing_plan(ids, self.num_experts, self:plan_opts(gates))
    h.ids, h.gates = ids, gates
    return h.plan.counts
  end)
  return h
end

-- Token choice: (T, d) -> (T, d), plan. held: from offer_counts (the plan
-- already built from these ids and gates, or nil).
function dMoE:route_tokens(x2, r, held)
  local ids = r.ids
  if held and held.plan and rawequal(held.ids, ids) and rawequal(held.gates, r.gates) then
    return self.experts(x2, held.plan, r.gates), held.plan
  end
  if self.uniform_expert_assignment then ids = self:round_robin_ids(x2:size(0), x2.device) end
  if self.wp then return require("moe.layers.wp").route_tokens(self, x2, ids, r.gates, M.experts_of) end
  return M.experts_of(self, x2, ids, r.gates)
end

-- The experts on tokens x2 (T, d) routed to ids (T, k) with gates (T, k):
-- y (T, d), plan (through the expert-parallel exchange with layer.ep).
function M.experts_of(layer, x2, ids, gates)
  if layer.ep then return require("moe.layers.ep").route_tokens(layer, x2, ids, gates) end
  local plan = moe.ops.routing_plan(ids, layer.num_experts, layer:plan_opts(gates))
  return layer.experts(x2, plan, gates), plan
end

-- An ids tensor the layer keeps in self[field] while key stays the same
-- (built on the host: rebuilding it every step would cost more than the
-- step); build() makes it, the one it replaces is freed.
local function cached_ids(self, field, key, build)
  local c = self[field]
  if c and c.key == key then return c.ids end
  local ids = moe.keep(build())
  if c then c.ids:free() end
  self[field] = { key = key, ids = ids }
  return ids
end

-- (T, k) round-robin ids of uniform_expert_assignment, cached per T and device.
function dMoE:round_robin_ids(T, device)
  return cached_ids(self, "_rr_ids", T .. "|" .. device, function()
    return util.round_robin_ids(T, self.top_k, self.num_experts, device)
  end)
end

-- (E C, 1) ids: row i belongs to expert i // C (cached per E, C, device).
function dMoE:group_ids(E, C, device)
  return cached_ids(self, "_group_ids", E .. "|" .. C .. "|" .. device, function()
    local v = {}
    for e = 0, E - 1 do
      for _ = 1, C do v[#v + 1] = { e } end
    end
    return moe.tensor(v, { dtype = "i64", device = device })
  end)
end

-- Expert choice: tokens (E, C) gathered per expert, E equal groups through
-- the experts (gated), added back to their tokens.
function dMoE:route_experts(x2, r)
  if self.ep or self.wp then
    error(self.__name .. ": expert and weight parallelism take token-choice routers only (not expert choice)", 3)
  end
  local E, C = r.tokens:size(0), r.tokens:size(1)
  if E ~= self.num_experts then
    error(string.format("%s: the router chose tokens for %d experts, the layer has %d", self.__name, E,
      self.num_experts), 3)
  end
  local flat = r.tokens:reshape({ E * C })
  local xs = moe.index_select(x2, 0, flat) -- (E C, d)
  local plan = moe.ops.routing_plan(self:group_ids(E, C, x2.device), E, self:plan_opts(nil))
  local ys = self.experts(xs, plan, r.gates:reshape({ E * C, 1 })) -- (E C, d)
  local zeros = moe.zeros(x2.shape, { dtype = ys.dtype, device = ys.device })
  return moe.index_add(zeros, 0, flat, ys), plan
end

local function shape_str(t) return "(" .. table.concat(t.shape, ", ") .. ")" end

function dMoE:forward(x)
  local d = self.hidden_size
  if not moe.is_tensor(x) or (x:dim() ~= 2 and x:dim() ~= 3) or x:size(-1) ~= d then
    error(string.format("%s: x must be (B, S, %d) or (T, %d), got %s", self.__name, d, d,
      moe.is_tensor(x) and shape_str(x) or type(x)), 2)
  end
  local x2 = x:dim() == 2 and x or x:reshape({ -1, d })
  self:resolve_impl(x2.device, x2:size(0))
  local held <close> = self:offer_counts(self.router)
  local r = self.router(x2)
  if held then rawset(self.router, "counts_from", nil) end
  if type(r) ~= "table" or (r.kind ~= "token" and r.kind ~= "expert") then
    error(self.__name .. ": the router must return {kind = \"token\", ids =, gates =} or {kind = \"expert\", "
      .. "tokens =, gates =}", 2)
  end
  local y, plan
  if r.kind == "token" then y, plan = self:route_tokens(x2, r, held) else y, plan = self:route_experts(x2, r) end
  if self.shared_expert then
    local s = self.shared_expert(x2)
    if self.shared_expert_weighted_sum then
      -- MegaBlocks: shared and routed outputs weighted 1 : top_k, summing to one
      local k = self.top_k
      y = s * (1 / (k + 1)) + y * (k / (k + 1))
    else
      y = y + s
    end
  end
  self:record(r, plan)
  if x:dim() == 3 then y = y:reshape(x.shape) end
  if self.bias then
    if self.return_bias then return y, self.bias end
    y = y + self.bias
  end
  return y
end

-- Moves the router's aux loss here (added to what this layer holds) and
-- sets self.stats = the router's stats with expert_counts from the plan.
function dMoE:record(r, plan)
  -- the plan's device tensors live until the micro-batch ends (a recomputing backward uses it)
  moe.pass_up(plan)
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
  if r.kind == "token" then stats.expert_counts = plan.counts end
  self.stats = stats
  return stats
end

-- Parameters a token uses: the router, top_k experts' share, the shared
-- expert and the bias (for nn.TransformerLM:flops_per_token()).
function dMoE:num_active_parameters()
  local ex = self.experts
  -- expert (weight) parallelism: this rank holds 1 / size of the experts (of their hidden units)
  local shards = (self.ep and self.ep.size or 1) * (self.wp and self.wp.size or 1)
  local n = self.router:num_parameters() + ex:num_parameters() * shards * self.top_k // self.num_experts
  if self.shared_expert then n = n + self.shared_expert:num_parameters() end
  if self.bias then n = n + self.bias:numel() end
  return n
end

function dMoE:extra_repr()
  return string.format("hidden_size=%d, ffn_hidden_size=%d, num_experts=%d, top_k=%d, mlp_impl=%s",
    self.hidden_size, self.ffn_hidden_size, self.num_experts, self.top_k, self.mlp_impl)
end

return M
