--[[
moe/optim/init.lua - optimisers, learning-rate schedules and gradient clipping
(`local optim = require "moe.optim"`).

  optim.AdamW(named_params, {lr=1e-3, betas={0.9, 0.95}, eps=1e-8, weight_decay=0.1,
      no_decay=function(name, t) return t:dim() < 2 end, master_weights=nil,
      multi_tensor=true})
  optim.SGD(named_params, {lr=, momentum=0, weight_decay=0, master_weights=nil})
  opt:step([{grad_scale=, skip=}]), opt:zero_grad(), opt.lr (settable), opt.step_count
  opt:state_dict() -> {["<param>.exp_avg"]=, ...}, opt:state_scalars() -> {step=, lr=, ...}
  opt:load_state_dict(tensors, scalars)
  optim.schedule{lr=, min_lr=0, warmup=0, total=, decay="cosine"|"linear"|"constant"}
      -> function(step (0-based)) -> lr
  optim.clip_grad_norm(params, max_norm[, {lazy=true}]) -> total norm (a number:
      one host read; lazy: an f32 device tensor, no host read)
  optim.grad_norm(params[, max_norm]) -> norm, coef, found_inf (f32 device
      tensors, gradients untouched; for opt:step{grad_scale=coef, skip=found_inf})
  optim.scale_(tensors, coef) -> every tensor times the number coef, in place
  optim.ShardedAdamW(named_params, {..., group =, replicate_group =, bucket_mb =})
      -> AdamW with state for this rank's shard only (moe/optim/zero.lua)

named_params is model:named_parameters() (an array of {name, tensor}); a plain
array of tensors is accepted too (names "0", "1", ...). AdamW's update is one
multi-tensor C call per device (moe.ops.adamw_step_multi: a few CUDA launches
for every parameter), bit-identical to one moe.ops.adamw_step per parameter,
which multi_tensor=false selects (the reference path); SGD calls sgd_step per
parameter. opt:step{grad_scale=, skip=} takes f32 one-element device tensors:
every gradient is multiplied by grad_scale as the update reads it (the clip
coefficient of optim.grad_norm), and no parameter or state changes when skip
is not 0 (found_inf); both are read on the device, so a clipped step needs no
host read. step_count advances on a skipped step too (the host does not know);
a loop that reads found_inf later may take it back (opt.step_count is
settable). master_weights = nil means "when the parameter is bf16 or f16":
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
  moe.no_grad(function() -- parameters are leaves that require grad: written as a step writes them
    -- (its own state_dict given back: the tensors are already in place)
    for key, t in pairs(expected) do
      if not rawequal(t, tensors[key]) then t:copy_(tensors[key]) end
    end
    for _, e in ipairs(self.params) do
      -- the parameter follows its master copy, as after a step
      if e.master then e.param:copy_(e.master) end
    end
  end)
  if scalars ~= nil then
    if type(scalars) ~= "table" then fail(fn, "scalars table expected, got %s", type(scalars)) end
    if scalars.step ~= nil then self.step_count = math.tointeger(scalars.step) or scalars.step end
    if scalars.lr ~= nil then self.lr = scalars.lr end
  end
end

-- ------------------------------------------------------------------ AdamW

local adamw_known = { lr = true, betas = true, eps = true, weight_decay = true, no_decay = true,
                      master_weights = true, multi_tensor = true }

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
  if opts.multi_tensor ~= nil and type(opts.multi_tensor) ~= "boolean" then
    fail(fn, "option multi_tensor must be a boolean, got %s", type(opts.multi_tensor))
  end
  self.multi_tensor = opts.multi_tensor ~= false
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

local step_known = { grad_scale = true, skip = true }

-- The device scalar option key of opt:step, checked; moved to device when
-- the parameters of a group live elsewhere (a copy on the stream, no host read).
local function step_scalar(fn, t, key)
  if t == nil then return nil end
  if not moe.is_tensor(t) then fail(fn, "option %s must be a tensor, got %s", key, type(t)) end
  return t
end

local function on_device(t, device)
  if t == nil or t.device == device then return t end
  return t:to(device)
end

-- The per-tensor reference: one adamw_step per parameter; grad_scale and
-- skip by tensor ops and one host read of skip.
local function step_per_tensor(self, o, grad_scale, skip)
  if skip and skip:item() ~= 0 then return end
  for _, e in ipairs(self.params) do
    local g = e.param.grad
    if g then
      if grad_scale then -- the product in the state's precision, as the multi-tensor kernel
        g = moe.scope(function()
          local gs = on_device(grad_scale, g.device)
          if g.dtype == "f64" then return g * gs:to("f64") end
          return g:float() * gs
        end)
      end
      o.weight_decay = e.weight_decay
      moe.ops.adamw_step(e.param, g, e.exp_avg, e.exp_avg_sq, e.master, o)
      if grad_scale then g:free() end
    end
  end
end

-- One adamw_step_multi per device over the parameters that have a gradient.
local function step_multi(self, o, grad_scale, skip)
  local groups, order = {}, {}
  for _, e in ipairs(self.params) do
    local g = e.param.grad
    if g then
      local dev = e.param.device
      local G = groups[dev]
      if not G then
        G = { p = {}, g = {}, m = {}, v = {}, w = {}, wd = {}, n = 0 }
        groups[dev] = G
        order[#order + 1] = dev
      end
      local n = G.n + 1
      G.n = n
      G.p[n], G.g[n], G.m[n], G.v[n] = e.param, g, e.exp_avg, e.exp_avg_sq
      G.w[n], G.wd[n] = e.master or false, e.weight_decay
    end
  end
  o.weight_decay = nil
  for _, dev in ipairs(order) do
    local G = groups[dev]
    o.grad_scale, o.skip = on_device(grad_scale, dev), on_device(skip, dev)
    moe.ops.adamw_step_multi(G.p, G.g, G.m, G.v, G.w, G.wd, o)
  end
end

--- opt:step([{grad_scale =, skip =}]): one AdamW step over every parameter
--- with a gradient (see the header for the options).
function M.AdamWClass:step(opts)
  local fn = "AdamW:step"
  opts = check_options(fn, opts, step_known)
  local grad_scale = step_scalar(fn, opts.grad_scale, "grad_scale")
  local skip = step_scalar(fn, opts.skip, "skip")
  self.step_count = self.step_count + 1
  local h = self.hyper
  local o = { lr = self.lr, beta1 = h.beta1, beta2 = h.beta2, eps = h.eps, weight_decay = 0,
              step = self.step_count }
  if self.multi_tensor then
    moe.scope(step_multi, self, o, grad_scale, skip)
  else
    moe.scope(step_per_tensor, self, o, grad_scale, skip)
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

-- The gradients of params (tensors or {name, tensor}) grouped per device, in
-- order: {devices = {dev, ...}, [dev] = {g, ...}, all = {g, ...}}.
local function collect_grads(fn, params)
  if type(params) ~= "table" then fail(fn, "array of parameters expected, got %s", type(params)) end
  local out = { devices = {}, all = {} }
  for i, p in ipairs(params) do
    local t = p
    if type(p) == "table" and not moe.is_tensor(p) then t = p[2] end
    if not moe.is_tensor(t) then fail(fn, "parameter %d is not a tensor", i) end
    local g = t.grad
    if g then
      local dev = g.device
      if not out[dev] then
        out[dev] = {}
        out.devices[#out.devices + 1] = dev
      end
      out[dev][#out[dev] + 1] = g
      out.all[#out.all + 1] = g
    end
  end
  return out
end

local function check_max_norm(fn, max_norm)
  if max_norm ~= nil and (type(max_norm) ~= "number" or max_norm <= 0 or max_norm ~= max_norm) then
    fail(fn, "max_norm must be a positive number, got %s", tostring(max_norm))
  end
end

-- norm, coef, found_inf of the collected gradients, on the first device: one
-- moe.ops.grad_norm_multi per device (two launches on CUDA, no host read);
-- with several devices, the norm of the per-device norms.
local function device_norm(grads, max_norm)
  local devs = grads.devices
  if #devs <= 1 then return moe.ops.grad_norm_multi(grads.all, max_norm) end
  local norms = {}
  for i, dev in ipairs(devs) do
    local n = moe.ops.grad_norm_multi(grads[dev], nil)
    norms[i] = on_device(n, devs[1])
  end
  return moe.ops.grad_norm_multi(norms, max_norm)
end

--- optim.grad_norm(params[, max_norm]) -> norm, coef, found_inf: the global L2
--- norm of the gradients, min(1, max_norm / (norm + 1e-6)) (1 without
--- max_norm) and 1 when the norm is not finite (else 0), as f32 0-d tensors on
--- the gradients' device, computed there (f32 sums in a fixed order: the same
--- bits every run). Gradients are untouched: hand coef and found_inf to
--- opt:step{grad_scale = coef, skip = found_inf}.
function M.grad_norm(params, max_norm)
  local fn = "optim.grad_norm"
  check_max_norm(fn, max_norm)
  return moe.scope(device_norm, collect_grads(fn, params), max_norm)
end

local function scale_grads(grads, coef)
  for _, dev in ipairs(grads.devices) do moe.ops.scale_multi(grads[dev], on_device(coef, dev)) end
end

--- optim.scale_(tensors, coef): every tensor of the list (contiguous, floating) times the
--- number coef in place: one moe.ops.scale_multi per device (f32 arithmetic, as the
--- clip's own scaling), where t:copy_(t * coef) makes a temporary and a copy per tensor.
function M.scale_(tensors, coef)
  if type(coef) ~= "number" then fail("optim.scale_", "coef must be a number, got %s", type(coef)) end
  local by, devs = {}, {}
  for i, t in ipairs(tensors) do
    if not moe.is_tensor(t) then fail("optim.scale_", "item %d is not a tensor", i) end
    local dev = t.device
    if not by[dev] then
      by[dev] = {}
      devs[#devs + 1] = dev
    end
    by[dev][#by[dev] + 1] = t
  end
  for _, dev in ipairs(devs) do
    local c = moe.tensor({ coef }, { dtype = "f32", device = dev })
    moe.ops.scale_multi(by[dev], c)
    c:free()
  end
end

local function clip(fn, params, max_norm, lazy)
  local grads = collect_grads(fn, params)
  if #grads.all == 0 and not lazy then return 0 end
  local norm, coef = device_norm(grads, max_norm)
  if lazy then
    if max_norm then scale_grads(grads, coef) end
    return norm
  end
  local total = norm:item()
  if max_norm and total > max_norm then scale_grads(grads, coef) end
  return total
end

--- optim.clip_grad_norm(params, max_norm[, {lazy = true}]) -> the global L2
--- norm of the gradients of params (tensors or {name, tensor}), which are
--- scaled in place by min(1, max_norm / (norm + 1e-6)); max_norm nil: the norm
--- only. Without lazy: a number (one host read), gradients scaled only when
--- the norm exceeds max_norm. lazy: the norm as an f32 0-d tensor on the
--- gradients' device and the scaling by one multi-tensor kernel reading the
--- coefficient there (no host read; a non-finite norm leaves the gradients
--- scaled by 0 or untouched, the caller checks the norm).
local clip_known = { lazy = true }

function M.clip_grad_norm(params, max_norm, opts)
  local fn = "optim.clip_grad_norm"
  if type(params) ~= "table" then fail(fn, "array of parameters expected, got %s", type(params)) end
  check_max_norm(fn, max_norm)
  opts = check_options(fn, opts, clip_known)
  if opts.lazy ~= nil and type(opts.lazy) ~= "boolean" then
    fail(fn, "option lazy must be a boolean, got %s", type(opts.lazy))
  end
  if max_norm == math.huge then max_norm = nil end
  return moe.scope(clip, fn, params, max_norm, opts.lazy == true)
end

M.schedule = schedule

--- ShardedAdamW(named_params, opts): ZeRO-2 AdamW (moe/optim/zero.lua).
function M.ShardedAdamW(named_params, opts)
  return require("moe.optim.zero").AdamW(named_params, opts)
end

return M
