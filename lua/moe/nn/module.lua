--[[
moe/nn/module.lua - nn.class and nn.Module, the base of every layer, router
and model of moe.nn (lua/moe/nn/init.lua re-exports both).

  local Affine = nn.class("Affine", nn.Module)
  function Affine:init(d) self:param("scale", moe.ones({ d })) end
  function Affine:forward(x) return x * self.scale end
  local m = Affine(4); local y = m(x)

A module is a table whose metatable is its class; a class's __index chains
to its parent class. Calling a class makes an instance and runs
C.init(self, ...); calling an instance runs self:forward(...).

What a module owns, in registration order (private fields, read through the
methods below): _params (names of parameters), _buffers (names of buffers),
_children (names of child modules). The values live in the module itself
(m.weight, m.blocks), so replacing m.weight by assignment is seen by every
method. Names are dotted like PyTorch ("blocks.0.attn.qkv.weight"); list
children are named "0", "1", ...

Aux losses and stats: a module's forward may set self.aux_loss (a scalar
tensor, already weighted) and self.stats (a Lua table); pop_aux_loss() sums
and clears the first over all descendants, collect_stats() lists the second.

Memory: calling a module, m(x), runs forward inside moe.scope, so every
tensor handle forward makes is freed when it returns, except its results
(tensors, and tensors in plain tables among them, handed to the caller's
scope) and self.aux_loss and the tensors of self.stats (moe.pass_up: they
live until the outermost moe.scope ends, a training micro-batch, an eval batch or
a sampled token, or on when m(x) runs outside any scope). A tensor forward stores for a
later call (a cache, a table built once) is wrapped in moe.keep. Forward is
written like the math: no frees. m:forward(x) called directly runs in the
caller's scope.
]]
local moe = require "moe"

local M = {}

-- ------------------------------------------------------------- classes

-- m(...): forward in a scope (moe.forward_scope); the aux loss and the
-- tensors of the stats are passed up to the outermost scope (moe.pass_up).
local forward_scope, pass_up, is_tensor = moe.forward_scope, moe.pass_up, moe.is_tensor
local function pass_outputs(self, ...)
  local a = rawget(self, "aux_loss")
  if a ~= nil then pass_up(a) end
  local st = rawget(self, "stats")
  if type(st) == "table" then
    for _, v in pairs(st) do
      if is_tensor(v) then pass_up(v) end
    end
  end
  return ...
end
local function forward(self, ...) return pass_outputs(self, self:forward(...)) end
local function instance_call(self, ...) return forward_scope(forward, self, ...) end
local function instance_tostring(self) return self:repr() end

-- nn.class(name [, parent]) -> a class table. Metamethods (__call,
-- __tostring) are copied into every class since Lua does not inherit them.
function M.class(name, parent)
  assert(type(name) == "string", "nn.class: name must be a string")
  local C = {}
  C.__name = name
  C.__index = C
  C.__call = instance_call
  C.__tostring = instance_tostring
  C.super = parent
  setmetatable(C, {
    __index = parent,
    __call = function(cls, ...)
      local self = setmetatable({}, cls)
      self:_setup()
      local init = cls.init
      if init then init(self, ...) end
      return self
    end,
    __tostring = function() return "class " .. name end,
  })
  return C
end

-- ------------------------------------------------------------- Module

local Module = M.class("Module")
M.Module = Module

-- Fields every module has before its init runs.
function Module:_setup()
  rawset(self, "_params", {})
  rawset(self, "_buffers", {})
  rawset(self, "_children", {})
  rawset(self, "training", true)
end

function Module.init() end

function Module:forward()
  error(self.__name .. ": forward is not defined", 2)
end

local function add_name(list, name)
  for i = 1, #list do
    if list[i] == name then return end
  end
  list[#list + 1] = name
end

local function check_name(self, what, name)
  if type(name) ~= "string" or name == "" or name:find(".", 1, true) then
    error(string.format("%s:%s: name must be a non-empty string without '.', got %s", self.__name, what,
      tostring(name)), 3)
  end
end

-- m:param(name, tensor) -> tensor: a trainable parameter (requires_grad set).
function Module:param(name, t)
  check_name(self, "param", name)
  if not moe.is_tensor(t) then
    error(string.format("%s:param: '%s' must be a tensor, got %s", self.__name, name, type(t)), 2)
  end
  if not t.requires_grad then t:requires_grad_(true) end
  self[name] = moe.keep(t) -- owned by the module, even when registered inside a scope
  add_name(self._params, name)
  return t
end

-- m:buffer(name, tensor) -> tensor: saved in the state dict, not trained.
function Module:buffer(name, t)
  check_name(self, "buffer", name)
  if not moe.is_tensor(t) then
    error(string.format("%s:buffer: '%s' must be a tensor, got %s", self.__name, name, type(t)), 2)
  end
  self[name] = moe.keep(t)
  add_name(self._buffers, name)
  return t
end

-- m:child(name, module) -> module
function Module:child(name, mod)
  check_name(self, "child", name)
  if type(mod) ~= "table" or type(mod._params) ~= "table" then
    error(string.format("%s:child: '%s' must be an nn.Module, got %s", self.__name, name, type(mod)), 2)
  end
  self[name] = mod
  add_name(self._children, name)
  mod.training = self.training
  return mod
end

-- Depth-first walk: fn(prefix, module) for self and all descendants.
local function walk(mod, prefix, fn)
  fn(prefix, mod)
  for _, cname in ipairs(mod._children) do
    local c = mod[cname]
    if c ~= nil then walk(c, prefix == "" and cname or prefix .. "." .. cname, fn) end
  end
end

local function join(prefix, name) return prefix == "" and name or prefix .. "." .. name end

-- m:named_modules() -> array of {name, module}, self first (name "").
function Module:named_modules()
  local out = {}
  walk(self, "", function(p, m) out[#out + 1] = { p, m } end)
  return out
end

-- m:modules() -> array of modules, self first.
function Module:modules()
  local out = {}
  walk(self, "", function(_, m) out[#out + 1] = m end)
  return out
end

-- Named tensors of kind ("_params" or "_buffers"): entries {name, tensor}
-- (also as fields .name, .tensor); a tensor reachable under two names (tied
-- weights) is listed once, under its first name.
local function named(self, kind)
  local out, seen = {}, {}
  walk(self, "", function(p, m)
    for _, n in ipairs(m[kind]) do
      local t = m[n]
      if t ~= nil and not seen[t] then
        seen[t] = true
        local name = join(p, n)
        out[#out + 1] = { name, t, name = name, tensor = t }
      end
    end
  end)
  return out
end

function Module:named_parameters() return named(self, "_params") end
function Module:named_buffers() return named(self, "_buffers") end

function Module:parameters()
  local out = {}
  for i, nt in ipairs(self:named_parameters()) do out[i] = nt[2] end
  return out
end

function Module:num_parameters()
  local n = 0
  for _, nt in ipairs(self:named_parameters()) do n = n + nt[2]:numel() end
  return n
end

function Module:zero_grad()
  moe.zero_grad(self:parameters())
end

-- m:state_dict() -> table name -> tensor (parameters and buffers; the
-- tensors themselves, not copies).
function Module:state_dict()
  local sd = {}
  for _, nt in ipairs(self:named_parameters()) do sd[nt[1]] = nt[2] end
  for _, nt in ipairs(self:named_buffers()) do sd[nt[1]] = nt[2] end
  return sd
end

local function shape_str(t)
  return "(" .. table.concat(t.shape, ", ") .. ")"
end

local function same_shape(a, b)
  local sa, sb = a.shape, b.shape
  if #sa ~= #sb then return false end
  for i = 1, #sa do
    if sa[i] ~= sb[i] then return false end
  end
  return true
end

-- m:load_state_dict(sd [, {strict = true}]) copies the values of sd into the
-- module's tensors (dtype and device converted). strict: any missing,
-- unexpected or mis-shaped key is an error naming all of them and nothing is
-- copied. Not strict: mis-shaped keys are still an error; missing and
-- unexpected keys are returned {missing = {...}, unexpected = {...}}.
function Module:load_state_dict(sd, opts)
  if type(sd) ~= "table" then
    error("load_state_dict: state dict must be a table name -> tensor, got " .. type(sd), 2)
  end
  opts = opts or {}
  local strict = opts.strict
  if strict == nil then strict = true end
  local own = self:state_dict()
  local missing, unexpected, misshaped = {}, {}, {}
  for name, t in pairs(own) do
    local src = sd[name]
    if src == nil then
      missing[#missing + 1] = name
    elseif not moe.is_tensor(src) then
      misshaped[#misshaped + 1] = string.format("%s (not a tensor: %s)", name, type(src))
    elseif not same_shape(src, t) then
      misshaped[#misshaped + 1] = string.format("%s (expected %s, got %s)", name, shape_str(t), shape_str(src))
    end
  end
  for name in pairs(sd) do
    if own[name] == nil then unexpected[#unexpected + 1] = tostring(name) end
  end
  table.sort(missing); table.sort(unexpected); table.sort(misshaped)
  local problems = {}
  if strict and #missing > 0 then problems[#problems + 1] = "missing keys: " .. table.concat(missing, ", ") end
  if strict and #unexpected > 0 then
    problems[#problems + 1] = "unexpected keys: " .. table.concat(unexpected, ", ")
  end
  if #misshaped > 0 then problems[#problems + 1] = "mis-shaped keys: " .. table.concat(misshaped, ", ") end
  if #problems > 0 then
    error("load_state_dict (" .. self.__name .. "): " .. table.concat(problems, "; "), 2)
  end
  moe.no_grad(function()
    for name, t in pairs(own) do
      local src = sd[name]
      if src ~= nil then t:copy_(src) end
    end
  end)
  return { missing = missing, unexpected = unexpected }
end

-- m:train([on = true]) / m:eval(): sets .training on self and descendants.
function Module:train(on)
  if on == nil then on = true end
  for _, m in ipairs(self:modules()) do m.training = on and true or false end
  return self
end

function Module:eval() return self:train(false) end

local float_dtypes = { f32 = true, f64 = true, bf16 = true, f16 = true }

-- m:to(device_or_nil, dtype_or_nil): moves every parameter and buffer to
-- the device and casts floating tensors to dtype, in place (the new tensors
-- are re-registered under the same names; tied tensors stay tied).
-- m:to("bf16") (a dtype name alone) casts only.
function Module:to(device, dtype)
  if dtype == nil and float_dtypes[device] then device, dtype = nil, device end -- m:to("bf16")
  if device ~= nil and type(device) ~= "string" then
    error("to: device must be a string or nil, got " .. type(device), 2)
  end
  if dtype ~= nil and not float_dtypes[dtype] then
    error("to: dtype must be a floating dtype (f32, f64, bf16, f16) or nil, got " .. tostring(dtype), 2)
  end
  local done = {}
  local function convert(t, trainable)
    if done[t] then return done[t] end
    local opts = {}
    if device then opts.device = device end
    if dtype and float_dtypes[t.dtype] then opts.dtype = dtype end
    local n = t
    if (opts.device and opts.device ~= t.device) or (opts.dtype and opts.dtype ~= t.dtype) then
      n = moe.no_grad(function() return t:detach():to(opts) end)
      if trainable then n:requires_grad_(true) end
      moe.keep(n) -- owned by the module, even when moved inside a scope
    end
    done[t] = n
    return n
  end
  for _, m in ipairs(self:modules()) do
    for _, n in ipairs(m._params) do
      if m[n] ~= nil then m[n] = convert(m[n], true) end
    end
    for _, n in ipairs(m._buffers) do
      if m[n] ~= nil then m[n] = convert(m[n], false) end
    end
    if m._after_to then m:_after_to(device, dtype) end
  end
  return self
end

-- ------------------------------------------------------- aux losses, stats

-- m:pop_aux_loss() -> the sum of the aux_loss fields of self and all
-- descendants (cleared), or nil when none was set.
function Module:pop_aux_loss()
  local total, seen = nil, {}
  for _, m in ipairs(self:modules()) do
    local a = rawget(m, "aux_loss")
    if a ~= nil then
      if not seen[a] then -- a loss handed up to a parent unchanged counts once
        seen[a] = true
        total = total and total + a or a
      end
      m.aux_loss = nil
    end
  end
  return total
end

-- m:collect_stats() -> array of {name = <module path>, stats = <table>}.
function Module:collect_stats()
  local out = {}
  for _, nm in ipairs(self:named_modules()) do
    local s = rawget(nm[2], "stats")
    if s ~= nil then out[#out + 1] = { name = nm[1], stats = s } end
  end
  return out
end

-- ------------------------------------------------------------- printout

-- The text inside the parentheses of a leaf module's line; classes
-- override it ("64, 128, bias=true").
function Module.extra_repr() return "" end

local function fmt_count(n)
  local s = tostring(math.floor(n))
  local out = s:reverse():gsub("(%d%d%d)", "%1,"):reverse()
  return (out:gsub("^,", ""))
end

-- PyTorch-style tree; every module line ends with its parameter count, and
-- each own parameter and buffer is listed with its shape and dtype.
function Module:repr()
  local lines = {}
  local function rec(m, name, indent)
    local head = indent .. (name and ("(" .. name .. "): ") or "") .. m.__name .. "(" .. m:extra_repr()
    local n = m:num_parameters()
    local own = {}
    for _, p in ipairs(m._params) do
      if m[p] ~= nil then own[#own + 1] = { p, m[p], "param" } end
    end
    for _, b in ipairs(m._buffers) do
      if m[b] ~= nil then own[#own + 1] = { b, m[b], "buffer" } end
    end
    if #m._children == 0 then
      lines[#lines + 1] = head .. ")  # " .. fmt_count(n) .. " params"
      return
    end
    lines[#lines + 1] = head .. "  # " .. fmt_count(n) .. " params"
    for _, o in ipairs(own) do
      lines[#lines + 1] = string.format("%s  %s: %s %s %s", indent, o[1], o[3], shape_str(o[2]), o[2].dtype)
    end
    for _, c in ipairs(m._children) do
      if m[c] ~= nil then rec(m[c], c, indent .. "  ") end
    end
    lines[#lines + 1] = indent .. ")"
  end
  rec(self, nil, "")
  return table.concat(lines, "\n")
end

M.fmt_count = fmt_count

return M
