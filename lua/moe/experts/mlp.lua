--[[
moe/experts/mlp.lua - the routed expert MLPs: experts.Experts (the shared
option handling and weight creation), experts.MLP and experts.GLU
(re-exported by moe/experts/init.lua).

Options of both (unknown names are an error listing the valid ones):
  num_experts, d_model, d_ff      E, d, f (positive integers)
  activation                      a name (gelu, gelu_tanh, silu, relu,
                                  sigmoid, tanh) or a function(t) -> t
  impl = "grouped"                "grouped" (grouped GEMM), "sparse"
                                  (block-sparse: the plan must be padded
                                  with ffn_hidden = d_ff) or "loop" (one
                                  matmul per expert: the reference)
  memory_optimized = false        backward recomputes the activation instead
                                  of keeping it (MLP: a moe.Function over the
                                  activation and the second linear; GLU: the
                                  fused glu_experts(memory_optimized = true),
                                  which always recomputes it, or the same
                                  moe.Function when composed); and on sm_90a
                                  the weight gradients of the first linear(s)
                                  read x's rows in place, not a permuted copy
  quantize = nil                  {inputs =, rematerialize =, scatter =}:
                                  moe.quantize.scope specs for the tensors
                                  saved by the first linear(s) (the expert
                                  input), by the activation (the
                                  pre-activation) and by the combine (the
                                  expert output rows); see docs/LAYERS.md.
                                  The fused GLU (impl grouped or sparse,
                                  a built-in activation) takes switches that
                                  share one built-in spec as its own option:
                                  h1 and h3 kept quantized, act(h1) * h3
                                  recomputed (moe.ops.glu_experts quantize)
  std = 0.02, out_std = std       normal init of w1 (w3) and of w2
  dtype = "f32", device = "cpu"

forward(x (T, d), plan, gates (T, k) or nil) -> (T, d).
]]
local moe = require "moe"
local nn = require "moe.nn"
local util = require "moe.experts.util"

local M = {}

local DEFAULTS = {
  num_experts = util.NONE, d_model = util.NONE, d_ff = util.NONE, activation = util.NONE,
  impl = "grouped", memory_optimized = false, quantize = util.NONE, std = 0.02,
  out_std = util.NONE, dtype = util.NONE, device = util.NONE,
}

local function check_pos_int(what, name, v)
  if math.type(v) ~= "integer" or v <= 0 then
    error(string.format("%s: %s must be a positive integer, got %s", what, name, tostring(v)), 5)
  end
end

-- normal(0, std) of shape, made in f32 on the CPU and moved (the same
-- values on every device and dtype for one seed).
local function normal(shape, std, dtype, device)
  local t = moe.randn(shape) * std
  if (dtype or "f32") ~= "f32" or (device or "cpu") ~= "cpu" then
    t = t:to({ dtype = dtype or "f32", device = device or "cpu" })
  end
  return t
end

-- The quantize table checked: {inputs =, rematerialize =, scatter =}.
local QKEYS = { inputs = true, rematerialize = true, scatter = true }
function M.check_quantize(q, what, level)
  level = level or 5
  if q == nil or q == false then return nil end
  if type(q) ~= "table" then
    error(string.format("%s: quantize must be a table {inputs =, rematerialize =, scatter =}, got %s",
      what, type(q)), level)
  end
  local any = false
  for k, v in pairs(q) do
    if not QKEYS[k] then
      error(string.format("%s: unknown quantize key '%s' (valid: inputs, rematerialize, scatter)", what,
        tostring(k)), level)
    end
    util.check_bits(v, what .. ": quantize." .. k, level + 1)
    if not (v == nil or v == false or v == 0 or v == -1) then any = true end
  end
  return any and q or nil
end

-- ------------------------------------------------------------ Experts

-- The base of routed experts: options, w1 (E, d, f) [w3 (E, d, f)] and
-- w2 (E, f, d). glu: whether w3 exists.
local Experts = nn.class("Experts", nn.Module)
M.Experts = Experts

function Experts:init(o, name, default_act, glu)
  -- errors name the caller of the subclass's constructor: level 5 from the
  -- checks below (check, Experts.init, <Class>.init, the class call, caller)
  o = util.options(name, o, DEFAULTS, 5)
  check_pos_int(name, "num_experts", o.num_experts)
  check_pos_int(name, "d_model", o.d_model)
  check_pos_int(name, "d_ff", o.d_ff)
  util.check_impl(o.impl, name, 5)
  local act = o.activation or default_act
  self.act = util.activation(act, name, 5)
  self.act_name = type(act) == "string" and act or "custom"
  self.num_experts, self.d_model, self.d_ff = o.num_experts, o.d_model, o.d_ff
  self.impl = o.impl
  self.memory_optimized = o.memory_optimized and true or false
  self.quantize = M.check_quantize(o.quantize, name)
  local E, d, f = o.num_experts, o.d_model, o.d_ff
  self:param("w1", normal({ E, d, f }, o.std, o.dtype, o.device)) -- (E, d, f)
  if glu then self:param("w3", normal({ E, d, f }, o.std, o.dtype, o.device)) end -- (E, d, f)
  self:param("w2", normal({ E, f, d }, o.out_std or o.std, o.dtype, o.device)) -- (E, f, d)
end

function Experts:check_input(x, plan, gates)
  if not moe.is_tensor(x) or x:dim() ~= 2 or x:size(1) ~= self.d_model then
    error(string.format("%s: x must be (T, %d), got %s", self.__name, self.d_model,
      moe.is_tensor(x) and "(" .. table.concat(x.shape, ", ") .. ")" or type(x)), 3)
  end
  if plan == nil then error(self.__name .. ": a routing plan is required (moe.ops.routing_plan)", 3) end
  if gates ~= nil and not moe.is_tensor(gates) then
    error(self.__name .. ": gates must be a (T, k) tensor or nil, got " .. type(gates), 3)
  end
end

function Experts:extra_repr()
  local q = ""
  if self.quantize then
    local parts = {}
    for _, k in ipairs({ "inputs", "rematerialize", "scatter" }) do
      local v = self.quantize[k]
      if v ~= nil then parts[#parts + 1] = k .. "=" .. (type(v) == "table" and "table" or tostring(v)) end
    end
    q = ", quantize={" .. table.concat(parts, ", ") .. "}"
  end
  return string.format("num_experts=%d, d_model=%d, d_ff=%d, activation=%s, impl=%s%s%s",
    self.num_experts, self.d_model, self.d_ff, self.act_name, self.impl,
    self.memory_optimized and ", memory_optimized=true" or "", q)
end

-- The second half of an expert MLP: (rows of) h -> combined (T, d).
-- scatter_q: the quantize spec of the combine (nil: fused in the linear).
local function tail(a, w2, plan, gates, impl, scatter_q)
  if scatter_q == nil then
    return util.parallel_linear(a, w2, plan, { impl = impl, scatter = true, gates = gates })
  end
  local rows = util.parallel_linear(a, w2, plan, { impl = impl })
  return util.quantized(scatter_q, moe.ops.combine, rows, plan, gates)
end

-- The scope spec of switch k, nil when off. A built-in spec (8, 4 or a
-- {bits =} table without keep) gets keep = the expert weights, so that only
-- activations are quantized (MegaBlocks' switches name activations).
local function quant(q, k, self)
  local v = q and q[k]
  if v == nil or v == false or v == 0 or v == -1 then return nil end
  if type(v) == "number" then v = { bits = v } end
  if v.bits ~= nil and v.keep == nil then
    local c = { keep = { self.w1, self.w2, self.w3 } }
    for kk, vv in pairs(v) do c[kk] = vv end
    v = c
  end
  return v
end

-- ---------------------------------------------------------------- MLP

local MLP = nn.class("MLPExperts", Experts)
M.MLP = MLP

function MLP:init(o) Experts.init(self, o, "experts.MLP", "gelu", false) end

-- memory-optimized tail: act(h) and the second linear, recomputed in
-- backward (only h, w2 and gates are saved).
local function mlp_tail(h, w2, gates, plan, impl, act)
  return tail(act(h), w2, plan, gates, impl, nil)
end

function MLP:forward(x, plan, gates)
  self:check_input(x, plan, gates)
  local q, impl = self.quantize, self.impl
  local h = util.quantized(quant(q, "inputs", self), util.parallel_linear, x, self.w1, plan,
    { impl = impl, gather = true, memory_optimized = self.memory_optimized })
  if self.memory_optimized then
    return util.quantized(quant(q, "rematerialize", self), util.recompute, "mlp_experts_recompute", mlp_tail,
      h, self.w2, gates, plan, impl, self.act)
  end
  local a = util.quantized(quant(q, "rematerialize", self), self.act, h)
  return tail(a, self.w2, plan, gates, impl, quant(q, "scatter", self))
end

-- ---------------------------------------------------------------- GLU

local GLU = nn.class("GLUExperts", Experts)
M.GLU = GLU

function GLU:init(o) Experts.init(self, o, "experts.GLU", "silu", true) end

local function glu_act(act, h1, h3)
  if act == util.silu then return moe.swiglu(h1, h3) end
  return act(h1) * h3
end

local function glu_tail(h1, h3, w2, gates, plan, impl, act)
  return tail(glu_act(act, h1, h3), w2, plan, gates, impl, nil)
end

-- The quantize option of the fused op, or nil when the set switches cannot
-- share one: every set switch a built-in spec (8, 4 or {bits =}) with the
-- same bits, group_size, stochastic and min_numel. The fused op keeps the
-- pre-activations h1 and h3 quantized (MegaBlocks' rematerialize switch) and
-- recomputes act(h1) * h3 from them in backward, quantizing in the
-- activation's own pass on CUDA; it never saves a permuted copy of x (it
-- gathers again in backward) nor the rows it combines (the gate gradient
-- comes from the hidden), so "inputs" and "scatter" have nothing more to
-- quantize there and any of the three switches turns this on.
local function fused_spec(q, self)
  if q == nil then return nil end
  local one
  for _, k in ipairs({ "inputs", "rematerialize", "scatter" }) do
    local v = quant(q, k, self)
    if v ~= nil then
      if type(v) ~= "table" or v.bits == nil then return nil end
      if one == nil then
        one = v
      elseif one.bits ~= v.bits or one.group_size ~= v.group_size or one.stochastic ~= v.stochastic
          or one.min_numel ~= v.min_numel then
        return nil
      end
    end
  end
  if one == nil then return nil end
  -- validated as moe.quantize.scope would (a clear error for bad bits)
  require("moe.quantize").spec({ bits = one.bits, group_size = one.group_size, stochastic = one.stochastic,
    min_numel = one.min_numel }, self.__name .. ": quantize")
  return { bits = math.tointeger(one.bits), group_size = one.group_size, stochastic = one.stochastic,
    min_numel = one.min_numel }
end

-- Whether forward uses the fused C op (moe.ops.glu_experts): impl grouped or
-- sparse, an activation it has, and no quantize switch set or switches that
-- share one built-in spec (fused_spec; other settings name tensors that
-- only the composed path saves).
function GLU:fused()
  if not (self.impl ~= "loop" and util.GLU_FUSED[self.act_name] == true and moe.ops.glu_experts ~= nil) then
    return false
  end
  if self.quantize == nil then return true end
  return fused_spec(self.quantize, self) ~= nil
end

function GLU:forward(x, plan, gates)
  self:check_input(x, plan, gates)
  local q, impl = self.quantize, self.impl
  if self:fused() then
    self.path = "fused"
    return moe.ops.glu_experts(x, self.w1, self.w3, self.w2, plan, gates, { impl = impl,
      activation = self.act_name, memory_optimized = self.memory_optimized, quantize = fused_spec(q, self) })
  end
  self.path = "composed"
  local act = self.act
  local h1, h3 = util.quantized(quant(q, "inputs", self), function()
    local o = { impl = impl, gather = true, memory_optimized = self.memory_optimized }
    return util.parallel_linear(x, self.w1, plan, o), util.parallel_linear(x, self.w3, plan, o)
  end)
  if self.memory_optimized then
    return util.quantized(quant(q, "rematerialize", self), util.recompute, "glu_experts_recompute", glu_tail,
      h1, h3, self.w2, gates, plan, impl, act)
  end
  local a = util.quantized(quant(q, "rematerialize", self), glu_act, act, h1, h3)
  return tail(a, self.w2, plan, gates, impl, quant(q, "scatter", self))
end

return M
