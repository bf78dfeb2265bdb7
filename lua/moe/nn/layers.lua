--[[
moe/nn/layers.lua - the basic layers of moe.nn: Linear, Embedding,
LayerNorm, RMSNorm, Dropout, ModuleList, MLP and GLU (re-exported by
lua/moe/nn/init.lua). Each is a class over nn.Module whose forward is a few
differentiable moe ops.

Options common to the layers that make tensors: dtype ("f32"), device
("cpu"), std (0.02: weights drawn from normal(0, std)). Unknown option names
are an error listing the valid ones.
]]
local moe = require "moe"
local base = require "moe.nn.module"

local class, Module = base.class, base.Module
local M = {}

-- Checks that opts only names keys of `valid` (a list); returns opts or {}.
local function check_opts(fname, opts, valid)
  if opts == nil then return {} end
  if type(opts) ~= "table" then error(fname .. ": options must be a table, got " .. type(opts), 3) end
  local set = {}
  for _, k in ipairs(valid) do set[k] = true end
  for k in pairs(opts) do
    if not set[k] then
      local names = {}
      for _, v in ipairs(valid) do names[#names + 1] = v end
      table.sort(names)
      error(string.format("%s: unknown option '%s' (valid: %s)", fname, tostring(k), table.concat(names, ", ")), 3)
    end
  end
  return opts
end
M.check_opts = check_opts

local function check_pos_int(fname, what, v)
  if math.type(v) ~= "integer" or v <= 0 then
    error(string.format("%s: %s must be a positive integer, got %s", fname, what, tostring(v)), 3)
  end
end
M.check_pos_int = check_pos_int

-- normal(0, std) tensor of shape (a fresh leaf, not yet a parameter).
local function normal(shape, std, dtype, device)
  local t = moe.randn(shape, { dtype = "f32", device = "cpu" })
  t = t * std
  if (dtype or "f32") ~= "f32" or (device or "cpu") ~= "cpu" then t = t:to({ dtype = dtype, device = device }) end
  return t
end
M.normal = normal

local function tensor_opts(o) return { dtype = o.dtype or "f32", device = o.device or "cpu" } end
M.tensor_opts = tensor_opts

-- --------------------------------------------------------------- Linear

-- nn.Linear(in, out, {bias = true, std = 0.02, dtype =, device =}):
-- weight (out, in), bias (out) zero. y = x W^T + b.
local Linear = class("Linear", Module)
M.Linear = Linear

function Linear:init(n_in, n_out, opts)
  check_pos_int("nn.Linear", "in_features", n_in)
  check_pos_int("nn.Linear", "out_features", n_out)
  opts = check_opts("nn.Linear", opts, { "bias", "std", "dtype", "device" })
  self.in_features, self.out_features = n_in, n_out
  self:param("weight", normal({ n_out, n_in }, opts.std or 0.02, opts.dtype, opts.device))
  if opts.bias ~= false then self:param("bias", moe.zeros({ n_out }, tensor_opts(opts))) end
end

function Linear:forward(x)
  return moe.linear(x, self.weight, self.bias)
end

function Linear:extra_repr()
  return string.format("%d, %d, bias=%s", self.in_features, self.out_features, tostring(self.bias ~= nil))
end

-- ------------------------------------------------------------ Embedding

-- nn.Embedding(n, d, {std = 0.02, dtype =, device =}): weight (n, d).
local Embedding = class("Embedding", Module)
M.Embedding = Embedding

function Embedding:init(n, d, opts)
  check_pos_int("nn.Embedding", "num_embeddings", n)
  check_pos_int("nn.Embedding", "embedding_dim", d)
  opts = check_opts("nn.Embedding", opts, { "std", "dtype", "device" })
  self.num_embeddings, self.embedding_dim = n, d
  self:param("weight", normal({ n, d }, opts.std or 0.02, opts.dtype, opts.device))
end

function Embedding:forward(ids) return moe.embedding(self.weight, ids) end

function Embedding:extra_repr() return string.format("%d, %d", self.num_embeddings, self.embedding_dim) end

-- ------------------------------------------------------------ norms

-- nn.LayerNorm(d, {eps = 1e-5, bias = true, dtype =, device =}): weight
-- (d) ones, bias (d) zeros.
local LayerNorm = class("LayerNorm", Module)
M.LayerNorm = LayerNorm

function LayerNorm:init(d, opts)
  check_pos_int("nn.LayerNorm", "d", d)
  opts = check_opts("nn.LayerNorm", opts, { "eps", "bias", "dtype", "device" })
  self.d, self.eps = d, opts.eps or 1e-5
  self:param("weight", moe.ones({ d }, tensor_opts(opts)))
  if opts.bias ~= false then self:param("bias", moe.zeros({ d }, tensor_opts(opts))) end
end

function LayerNorm:forward(x) return moe.layer_norm(x, self.weight, self.bias, self.eps) end

function LayerNorm:extra_repr() return string.format("%d, eps=%g", self.d, self.eps) end

-- nn.RMSNorm(d, {eps = 1e-6, dtype =, device =}): weight (d) ones.
local RMSNorm = class("RMSNorm", Module)
M.RMSNorm = RMSNorm

function RMSNorm:init(d, opts)
  check_pos_int("nn.RMSNorm", "d", d)
  opts = check_opts("nn.RMSNorm", opts, { "eps", "dtype", "device" })
  self.d, self.eps = d, opts.eps or 1e-6
  self:param("weight", moe.ones({ d }, tensor_opts(opts)))
end

function RMSNorm:forward(x) return moe.rms_norm(x, self.weight, self.eps) end

function RMSNorm:extra_repr() return string.format("%d, eps=%g", self.d, self.eps) end

-- -------------------------------------------------------------- Dropout

-- nn.Dropout(p): active in train mode only.
local Dropout = class("Dropout", Module)
M.Dropout = Dropout

function Dropout:init(p)
  p = p or 0.5
  if type(p) ~= "number" or p < 0 or p > 1 then
    error("nn.Dropout: p must be a number in [0, 1], got " .. tostring(p), 2)
  end
  self.p = p
end

function Dropout:forward(x)
  if self.p == 0 or not self.training then return x end
  return moe.dropout(x, self.p, true)
end

function Dropout:extra_repr() return string.format("p=%g", self.p) end

-- ----------------------------------------------------------- ModuleList

-- nn.ModuleList([modules]): children named "0", "1", ...; ml:at(i)
-- (0-based), #ml, ml:append(m), ml:list() (a Lua array for ipairs).
local ModuleList = class("ModuleList", Module)
M.ModuleList = ModuleList

function ModuleList:init(mods)
  self.n = 0
  for _, m in ipairs(mods or {}) do self:append(m) end
end

function ModuleList:append(m)
  self:child(tostring(self.n), m)
  self.n = self.n + 1
  return m
end

-- 0-based access.
function ModuleList:at(i) return self[tostring(i)] end

function ModuleList:__len() return self.n end

-- An array of the modules (1-based Lua array, for ipairs).
function ModuleList:list()
  local out = {}
  for i = 0, self.n - 1 do out[i + 1] = self[tostring(i)] end
  return out
end

function ModuleList.forward()
  error("nn.ModuleList: a ModuleList has no forward; iterate over :list()", 2)
end

-- ------------------------------------------------------------ MLP, GLU

local activations = {
  gelu = moe.gelu,
  gelu_tanh = moe.gelu_tanh,
  relu = moe.relu,
  silu = moe.silu,
  tanh = moe.tanh,
  sigmoid = moe.sigmoid,
}
M.activations = activations

local function activation(fname, name)
  if type(name) == "function" then return name end
  local f = activations[name]
  if not f then
    local names = {}
    for k in pairs(activations) do names[#names + 1] = k end
    table.sort(names)
    error(string.format("%s: unknown activation '%s' (valid: %s)", fname, tostring(name), table.concat(names, ", ")), 3)
  end
  return f
end
M.activation = activation

-- nn.MLP{d_model=, d_ff=, activation="gelu", bias=false, std=0.02,
-- out_std=std, dtype=, device=}: fc2(act(fc1(x))).
local MLP = class("MLP", Module)
M.MLP = MLP

function MLP:init(o)
  o = check_opts("nn.MLP", o, { "d_model", "d_ff", "activation", "bias", "std", "out_std", "dtype", "device" })
  check_pos_int("nn.MLP", "d_model", o.d_model)
  check_pos_int("nn.MLP", "d_ff", o.d_ff)
  self.act_name = type(o.activation) == "string" and o.activation or (o.activation and "custom" or "gelu")
  self.act = activation("nn.MLP", o.activation or "gelu")
  local std = o.std or 0.02
  local lo = { bias = o.bias or false, std = std, dtype = o.dtype, device = o.device }
  self:child("fc1", Linear(o.d_model, o.d_ff, lo))
  lo.std = o.out_std or std
  self:child("fc2", Linear(o.d_ff, o.d_model, lo))
end

function MLP:forward(x) return self.fc2(self.act(self.fc1(x))) end

function MLP:extra_repr() return "activation=" .. self.act_name end

-- nn.GLU{d_model=, d_ff=, activation="silu", bias=false, std=, out_std=,
-- dtype=, device=}: w2(act(w1 x) * w3 x) (SwiGLU with silu).
local GLU = class("GLU", Module)
M.GLU = GLU

function GLU:init(o)
  o = check_opts("nn.GLU", o, { "d_model", "d_ff", "activation", "bias", "std", "out_std", "dtype", "device" })
  check_pos_int("nn.GLU", "d_model", o.d_model)
  check_pos_int("nn.GLU", "d_ff", o.d_ff)
  self.act_name = type(o.activation) == "string" and o.activation or (o.activation and "custom" or "silu")
  self.act = activation("nn.GLU", o.activation or "silu")
  local std = o.std or 0.02
  local lo = { bias = o.bias or false, std = std, dtype = o.dtype, device = o.device }
  self:child("w1", Linear(o.d_model, o.d_ff, lo))
  self:child("w3", Linear(o.d_model, o.d_ff, lo))
  lo.std = o.out_std or std
  self:child("w2", Linear(o.d_ff, o.d_model, lo))
end

function GLU:forward(x)
  local h
  if self.act_name == "silu" then
    h = moe.swiglu(self.w1(x), self.w3(x))
  else
    h = self.act(self.w1(x)) * self.w3(x)
  end
  return self.w2(h)
end

function GLU:extra_repr() return "activation=" .. self.act_name end

return M
