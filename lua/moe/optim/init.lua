--[[
moe/optim/init.lua - optimisers, learning-rate schedules and gradient clipping
(`local optim = require "moe.optim"`).

  optim.AdamW(named_params, {lr=1e-3, betas={0.9, 0.95}, eps=1e-8, weight_decay=0.1,
      no_decay=function(name, t) return t:dim() < 2 end, master_weights=nil})
  optim.SGD(named_params, {lr=, momentum=0, weight_decay=0, master_weights=nil})
  opt:step(), opt:zero_grad(), opt.lr (settable), opt.step_count
  opt:state_dict() -> {["<param>.exp_avg"]=, ...}, opt:state_scalars() -> {step=, lr=, ...}
  opt:load_state_dict(tensors, scalars)
  optim.schedule{lr=, min_lr=0, warmup=0, total=, decay="cosine"|"linear"|"constant"}
      -> function(step (0-based)) -> lr
  optim.clip_grad_norm(params, max_norm) -> total norm (one host read)
  optim.ShardedAdamW(named_params, {..., group =, replicate_group =, bucket_mb =})
      -> AdamW with state for this rank's shard only (moe/optim/zero.lua)

named_params is model:named_parameters() (an array of {name, tensor}); a plain
array of tensors is accepted too (names "0", "1", ...). The update itself is
one fused C call per parameter (moe.ops.adamw_step / sgd_step: CPU loop or one
CUDA kernel). master_weights = nil means "when the parameter is bf16 or f16":
such a parameter gets an fp32 master copy and fp32 state, and is rewritten
from the master by the same call. State tensors have the parameter's shape and
are saved under PyTorch-like names so they go into a safetensors file as they
are: "<param>.exp_avg", "<param>.exp_avg_sq", "<param>.master",
"<param>.momentum_buffer".
]]
local moe = require "moe"
local schedule = require "moe.optim.schedule"

local M = {}

local function fail(fn, msg, ...)
  error(("%s: " .. msg):format(fn, ...), 3)
end

local function check_options(fn, opts, known)
  if opts == nil then return {} end
  if type(opts) ~= "table" then fail(fn, "options table expected, got %s", type(opts)) end
  for k in pairs(opts) do
    if not known[k] then
      local names = {}
      for n in pairs(known) do names[#names + 1] = n end
      table.sort(names)
      fail(fn, "unknown option '%s' (valid: %s)", tostring(k), table.concat(names, ", "))
    end
  end
  return opts
end

local function number_opt(fn, opts, key, default)
  local v = opts[key]
  if v == nil then return default end
  if type(v) ~= "number" then fail(fn, "option %s must be a number, got %s", key, type(v)) end
  return v
end

-- {{name, tensor}, ...} from named parameters or a plain array of tensors.
local function normalize_params(fn, params)
  if type(params) ~= "table" then
    fail(fn, "named parameters expected (model:named_parameters()), got %s", type(params))
  end
  local out, seen = {}, {}
  for i, e in ipairs(params) do
    local name, t
    if moe.is_tensor(e) then
      name, t = tostring(i - 1), e
    elseif type(e) == "table" and type(e[1]) == "string" and moe.is_tensor(e[2]) then
      name, t = e[1], e[2]
    else
      fail(fn, "parameter %d must be a tensor or {name, tensor}", i)
    end
    if seen[name] then fail(fn, "parameter name '%s' appears twice", name) end
    seen[name] = true
    if not t:is_contiguous() then fail(fn, "parameter '%s' must be contiguous", name) end
    local dt = t.dtype
    if dt ~= "f32" and dt ~= "f64" and dt ~= "bf16" and dt ~= "f16" then
      fail(fn, "parameter '%s' has dtype %s; optimisers take f32, f64, bf16 or f16", name, dt)
    end
    out[#out + 1] = { name = name, param = t }
  end
  return out
end

local function state_dtype(t) return t.dtype == "f64" and "f64" or "f32" end
local function low_precision(t) return t.dtype == "bf16" or t.dtype == "f16" end

local function zeros_like_state(t)
  return moe.zeros(t.shape, { dtype = state_dtype(t), device = t.device })
end

-- The fp32 master copy of a parameter (a fresh contiguous tensor).
local function make_master(fn, e, master_weights)
  local t = e.param
  local want = master_weights
  if want == nil then want = low_precision(t) end
  if not want and low_precision(t) then
    fail(fn, "parameter '%s' is %s: it needs master_weights (an fp32 copy)", e.name, t.dtype)
  end
  if not want then return nil end
  local m = moe.zeros(t.shape, { dtype = state_dtype(t), device = t.device })
  m:copy_(t)
  return m
end

-- The shared part of both optimisers.
local Optimizer = {}
Optimizer.__index = Optimizer

function Optimizer:zero_grad()
  for _, e in ipairs(self.params) do e.param.grad = nil end
end

-- name -> tensor of every state tensor (shared, not copies).
function Optimizer:state_dict()
  local sd = {}
  for _, e in ipairs(self.params) do
    for _, key in ipairs(self.state_keys) do
      if e[key] then sd[e.name .. "." .. key] = e[key] end
    end
  end
  return sd
end

function Optimizer:state_scalars()
  local s = { step = self.step_count, lr = self.lr, kind = self.kind }
  for k, v in pairs(self.hyper) do s[k] = v end
  return s
end

function Optimizer:load_state_dict(tensors, scalars)
  local fn = self.kind .. ":load_state_dict"
  if type(tensors) ~= "table" then fail(fn, "table of tensors expected, got %s", type(tensors)) end
  local expected = self:state_dict()
  local keys = {}
  for key in pairs(expected) do keys[#keys + 1] = key end
  table.sort(keys) -- errors name the first key in order
  for _, key in ipairs(keys) do
    local t, src = expected[key], tensors[key]
    if src == nil then fail(fn, "missing state tensor '%s'", key) end
    if not moe.is_tensor(src) then fail(fn, "state '%s' is not a tensor", key) end
    local a, b = t.shape, src.shape
    local same = #a == #b
    for i = 1, #a do same = same and a[i] == b[i] end
    if not same then
      fail(fn, "state '%s' has shape [%s], expected [%s]", key, table.concat(b, ", "),
           table.concat(a, ", "))
    end
  end
  for key in pairs(tensors) do
    if expected[key] == nil then fail(fn, "unexpected state tensor '%s'", key) end
  end
  for key, t in pairs(expected) do t:copy_(tensors[key]) end
  for _, e in ipairs(self.params) do
    -- the parameter follows its master copy, as after a step
    if e.master then e.param:copy_(e.master) end
  end
  if scalars ~= nil then
    if type(scalars) ~= "table" then fail(fn, "scalars table expected, got %s", type(scalars)) end
    if scalars.step ~= nil then self.step_count = math.tointeger(scalars.step) or scalars.step end
    if scalars.lr ~= nil then self.lr = scalars.lr end
  end
end

-- ------------------------------------------------------------------ AdamW

local adamw_known = { lr = true, betas = true, eps = true, weight_decay = true, no_decay = true,
                      master_weights = true }

local function default_no_decay(_, t) return t:dim() < 2 end

function M.AdamW(named_params, opts)
  local fn = "optim.AdamW"
  opts = check_options(fn, opts, adamw_known)
  local betas = opts.betas or { 0.9, 0.95 }
  if type(betas) ~= "table" or type(betas[1]) ~= "number" or type(betas[2]) ~= "number" then
    fail(fn, "option betas must be {beta1, beta2}")
  end
  local self = setmetatable({
    kind = "AdamW",
    lr = number_opt(fn, opts, "lr", 1e-3),
    step_count = 0,
    state_keys = { "exp_avg", "exp_avg_sq", "master" },
  }, { __index = M.AdamWClass })
  self.hyper = { beta1 = betas[1], beta2 = betas[2], eps = number_opt(fn, opts, "eps", 1e-8),
                 weight_decay = number_opt(fn, opts, "weight_decay", 0.1) }
  local no_decay = opts.no_decay or default_no_decay
  if type(no_decay) ~= "function" then fail(fn, "option no_decay must be a function") end
  self.params = normalize_params(fn, named_params)
  for _, e in ipairs(self.params) do
    e.exp_avg = zeros_like_state(e.param)
    e.exp_avg_sq = zeros_like_state(e.param)
    e.master = make_master(fn, e, opts.master_weights)
    e.weight_decay = no_decay(e.name, e.param) and 0 or self.hyper.weight_decay
  end
  return self
end

M.AdamWClass = setmetatable({}, { __index = Optimizer })

function M.AdamWClass:step()
  self.step_count = self.step_count + 1
  local h = self.hyper
  local o = { lr = self.lr, beta1 = h.beta1, beta2 = h.beta2, eps = h.eps, weight_decay = 0,
              step = self.step_count }
  for _, e in ipairs(self.params) do
    local g = e.param.grad
    if g then
      o.weight_decay = e.weight_decay
      moe.ops.adamw_step(e.param, g, e.exp_avg, e.exp_avg_sq, e.master, o)
    end
  end
end

-- ------------------------------------------------------------------ SGD

local sgd_known = { lr = true, momentum = true, weight_decay = true, master_weights = true }

function M.SGD(named_params, opts)
  local fn = "optim.SGD"
  opts = check_options(fn, opts, sgd_known)
  if opts.lr == nil then fail(fn, "option lr is required") end
  local self = setmetatable({
    kind = "SGD",
    lr = number_opt(fn, opts, "lr", nil),
    step_count = 0,
    state_keys = { "momentum_buffer", "master" },
  }, { __index = M.SGDClass })
  self.hyper = { momentum = number_opt(fn, opts, "momentum", 0),
                 weight_decay = number_opt(fn, opts, "weight_decay", 0) }
  self.params = normalize_params(fn, named_params)
  for _, e in ipairs(self.params) do
    if self.hyper.momentum > 0 then e.momentum_buffer = zeros_like_state(e.param) end
    e.master = make_master(fn, e, opts.master_weights)
  end
  return self
end

M.SGDClass = setmetatable({}, { __index = Optimizer })

function M.SGDClass:step()
  self.step_count = self.step_count + 1
  local o = { lr = self.lr, momentum = self.hyper.momentum, weight_decay = self.hyper.weight_decay }
  for _, e in ipairs(self.params) do
    local g = e.param.grad
    if g then moe.ops.sgd_step(e.param, g, e.momentum_buffer, e.master, o) end
  end
end

-- ------------------------------------------------------------------ clipping

-- Global L2 norm of the gradients of params (tensors or {name, tensor});
-- scales them by max_norm / (norm + 1e-6) when the norm exceeds max_norm.
-- One reduction per gradient on its device, one host read of the total.
-- The norm of one gradient as an f32 scalar on device, in a moe.scope of its
-- own (clip_grad_norm): an fp32 copy of a bf16 gradient is freed before the
-- next gradient's is made, not left to the collector, which does not see
-- device memory.
local function grad_norm(g, device)
  local n = (g.dtype == "f64" or g.dtype == "f32") and g:norm(2) or g:float():norm(2)
  if n.device ~= device then n = n:to(device) end
  if n.dtype ~= "f32" then n = n:float() end
  return n
end

local function scale_(g, coef) g:copy_(g * coef) end

local function clip(fn, params, max_norm)
  local grads, norms, device = {}, {}, nil
  for i, p in ipairs(params) do
    local t = p
    if type(p) == "table" and not moe.is_tensor(p) then t = p[2] end
    if not moe.is_tensor(t) then fail(fn, "parameter %d is not a tensor", i) end
    local g = t.grad
    if g then
      device = device or g.device
      grads[#grads + 1] = g
      norms[#norms + 1] = moe.scope(grad_norm, g, device)
    end
  end
  if #grads == 0 then return 0 end
  local total = moe.stack(norms):norm(2):item()
  if max_norm and total > max_norm then
    local coef = max_norm / (total + 1e-6)
    for _, g in ipairs(grads) do moe.scope(scale_, g, coef) end
  end
  return total
end

function M.clip_grad_norm(params, max_norm)
  local fn = "optim.clip_grad_norm"
  if type(params) ~= "table" then fail(fn, "array of parameters expected, got %s", type(params)) end
  if max_norm ~= nil and (type(max_norm) ~= "number" or max_norm <= 0) then
    fail(fn, "max_norm must be a positive number, got %s", tostring(max_norm))
  end
  return moe.scope(clip, fn, params, max_norm)
end

M.schedule = schedule

--- ShardedAdamW(named_params, opts): ZeRO-2 AdamW (moe/optim/zero.lua).
function M.ShardedAdamW(named_params, opts)
  return require("moe.optim.zero").AdamW(named_params, opts)
end

return M
