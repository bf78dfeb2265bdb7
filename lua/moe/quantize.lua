--[[
moe/quantize.lua - quantization of activations saved for backward,
over the saved-tensor hooks of the autograd. The quantizers themselves are C
(core/quantize.c, kernels/quantize.cu, bound as moe.ops.quantize /
dequantize / quantize_scope); docs/QUANTIZE.md describes the formats.

  moe.quantize.scope(spec, fn, ...) -> fn(...)
      Runs fn(...) with every floating-point tensor (f32, bf16, f16) that an
      op saves for backward stored quantized, and dequantized in backward.
      spec:
        nil, false or 0      off: fn runs unchanged
        8 or 4               built-in absmax quantizer (8: one scale per row
                             of the last dim; 4: groups of 128)
        {bits = 8 | 4, group_size = (0: a row; default 0 for 8, 128 for 4),
         stochastic = false, min_numel = 1024, keep = {tensors...}}
                             built-in, with options: tensors smaller than
                             min_numel, and tensors sharing storage with
                             one of keep (e.g. model:parameters()), are
                             saved unchanged
        {pack = function(t) return packed end,
         unpack = function(packed) return tensor end,
         name = "my quantizer", min_numel = 1024}
                             a quantizer written in Lua over tensor ops;
                             unpack must give back the saved tensor's shape,
                             dtype and device (a clear error naming the
                             quantizer otherwise). Tensors in the packed
                             value (it, or one level inside a table) are
                             freed with the graph.
  moe.quantize.spec(spec [, what]) -> normalized spec or nil (off); raises
      the error scope would raise (for validating configuration early).
  moe.quantize.int8(t [, {group_size =, stochastic =}]) -> q
  moe.quantize.int4(t [, group_size = 128] [, {stochastic =}]) -> q
  moe.quantize.quantize(t, spec) -> q        (spec as above, built-in only)
  moe.quantize.dequantize(q) -> tensor       (t's dtype, shape, device)
  moe.quantize.nbytes(q) -> bytes of q's values and scales
      q = {values =, scales =, bits =, group_size =, dtype =, shape =}.
]]
local moe = require "moe"

local M = {}

local FLOAT = { f32 = true, bf16 = true, f16 = true }
local BUILTIN_KEYS = { bits = true, group_size = true, stochastic = true, min_numel = true, keep = true }
local USER_KEYS = { pack = true, unpack = true, name = true, min_numel = true }

local function sorted_keys(set)
  local ks = {}
  for k in pairs(set) do ks[#ks + 1] = k end
  table.sort(ks)
  return table.concat(ks, ", ")
end

local function fail(what, msg, level)
  error(what .. ": " .. msg, level + 1)
end

local function check_bits(what, bits, level)
  if bits ~= 8 and bits ~= 4 then
    fail(what, ("bits must be 8 or 4 (or 0, nil or false for off), got %s"):format(tostring(bits)),
      level + 1)
  end
end

local function check_keys(what, t, valid, level)
  for k in pairs(t) do
    if not valid[k] then
      fail(what, ("unknown option '%s' (valid options: %s)"):format(tostring(k), sorted_keys(valid)),
        level + 1)
    end
  end
end

local function check_min_numel(what, v, level)
  if v ~= nil and (math.type(v) ~= "integer" or v < 0) then
    fail(what, "min_numel must be an integer >= 0, got " .. tostring(v), level + 1)
  end
end

-- Normalizes a spec: nil for off, {kind = "builtin", opts = {...}} or
-- {kind = "user", pack =, unpack =, name =, min_numel =}.
local function parse(spec, what, level)
  level = level + 1
  if spec == nil or spec == false or spec == 0 then return nil end
  if type(spec) == "number" then
    check_bits(what, spec, level)
    return { kind = "builtin", opts = { bits = math.tointeger(spec) } }
  end
  if type(spec) ~= "table" then
    fail(what, "spec must be nil, false, 0, 8, 4 or a table, got " .. type(spec), level)
  end
  if spec.pack ~= nil or spec.unpack ~= nil then
    check_keys(what, spec, USER_KEYS, level)
    if type(spec.pack) ~= "function" or type(spec.unpack) ~= "function" then
      fail(what, ("a user quantizer needs pack and unpack functions, got pack = %s, unpack = %s")
        :format(type(spec.pack), type(spec.unpack)), level)
    end
    if spec.name ~= nil and type(spec.name) ~= "string" then
      fail(what, "name must be a string, got " .. type(spec.name), level)
    end
    check_min_numel(what, spec.min_numel, level)
    return { kind = "user", pack = spec.pack, unpack = spec.unpack,
             name = spec.name or "user quantizer", min_numel = spec.min_numel or 1024 }
  end
  check_keys(what, spec, BUILTIN_KEYS, level)
  if spec.bits == nil or spec.bits == false or spec.bits == 0 then return nil end
  check_bits(what, spec.bits, level)
  local gs = spec.group_size
  if gs ~= nil and (math.type(gs) ~= "integer" or gs < 0) then
    fail(what, "group_size must be an integer >= 0 (0: one scale per row), got " .. tostring(gs), level)
  end
  if spec.bits == 4 and gs ~= nil and gs % 2 ~= 0 then
    fail(what, "group_size must be even for 4 bits (two values a byte), got " .. gs, level)
  end
  if spec.stochastic ~= nil and type(spec.stochastic) ~= "boolean" then
    fail(what, "stochastic must be a boolean, got " .. type(spec.stochastic), level)
  end
  check_min_numel(what, spec.min_numel, level)
  if spec.keep ~= nil then
    if type(spec.keep) ~= "table" then fail(what, "keep must be a list of tensors, got " .. type(spec.keep), level) end
    for i, t in ipairs(spec.keep) do
      if not moe.is_tensor(t) then
        fail(what, ("keep: entry %d is %s, not a tensor"):format(i, type(t)), level)
      end
    end
  end
  return { kind = "builtin", opts = { bits = math.tointeger(spec.bits), group_size = gs,
    stochastic = spec.stochastic, min_numel = spec.min_numel, keep = spec.keep } }
end

function M.spec(spec, what)
  return parse(spec, what or "moe.quantize", 1)
end

local function same_shape(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do
    if a[i] ~= b[i] then return false end
  end
  return true
end

local function shape_str(s) return "[" .. table.concat(s, ", ") .. "]" end

-- The saved-tensor hook pair of a user quantizer. The packed value is a
-- table holding the user's packed value and, one level down, its tensors
-- (so that the binding frees them with the graph and never frees a tensor
-- the user's packed value still uses).
local function user_hooks(q)
  local where = ("quantizer '%s'"):format(q.name)
  local function pack(t)
    if not FLOAT[t.dtype] or t:dim() == 0 or t:numel() < q.min_numel or t:numel() == 0 then
      return t
    end
    local p = q.pack(t)
    if p == nil then error(where .. ": pack returned nil", 0) end
    local w = { user = p, shape = t.shape, dtype = t.dtype, device = t.device }
    if moe.is_tensor(p) then
      w[1] = p
    elseif type(p) == "table" then
      for _, v in pairs(p) do
        if moe.is_tensor(v) then w[#w + 1] = v end
      end
    end
    return w
  end
  local function unpack(w)
    if moe.is_tensor(w) then return w end
    local r = q.unpack(w.user)
    if not moe.is_tensor(r) then
      error(("%s: unpack returned %s, not a tensor"):format(where, type(r)), 0)
    end
    if not same_shape(r.shape, w.shape) then
      error(("%s: unpack returned shape %s for a saved tensor of shape %s")
        :format(where, shape_str(r.shape), shape_str(w.shape)), 0)
    end
    if r.dtype ~= w.dtype then
      error(("%s: unpack returned dtype %s for a saved tensor of dtype %s")
        :format(where, r.dtype, w.dtype), 0)
    end
    if r.device ~= w.device then
      error(("%s: unpack returned a tensor on %s for a saved tensor on %s")
        :format(where, r.device, w.device), 0)
    end
    return r
  end
  return pack, unpack
end

function M.scope(spec, fn, ...)
  if type(fn) ~= "function" then
    error("bad argument #2 to 'scope' (function expected, got " .. type(fn) .. ")", 2)
  end
  local q = parse(spec, "moe.quantize.scope", 2)
  if q == nil then return fn(...) end
  if q.kind == "builtin" then return moe.ops.quantize_scope(q.opts, fn, ...) end
  local pack, unpack = user_hooks(q)
  return moe.saved_tensor_hooks(pack, unpack, fn, ...)
end

local function builtin_opts(what, spec, level)
  local q = parse(spec, what, level + 1)
  if q == nil or q.kind ~= "builtin" then
    fail(what, "a built-in spec (8, 4 or {bits = ...}) is required", level + 1)
  end
  return { bits = q.opts.bits, group_size = q.opts.group_size, stochastic = q.opts.stochastic }
end

function M.quantize(t, spec)
  if not moe.is_tensor(t) then
    error("bad argument #1 to 'quantize' (tensor expected, got " .. type(t) .. ")", 2)
  end
  return moe.ops.quantize(t, builtin_opts("moe.quantize.quantize", spec, 2))
end

function M.int8(t, opts)
  opts = opts or {}
  if not moe.is_tensor(t) then
    error("bad argument #1 to 'int8' (tensor expected, got " .. type(t) .. ")", 2)
  end
  return moe.ops.quantize(t, builtin_opts("moe.quantize.int8",
    { bits = 8, group_size = opts.group_size, stochastic = opts.stochastic }, 2))
end

function M.int4(t, group_size, opts)
  opts = opts or {}
  if not moe.is_tensor(t) then
    error("bad argument #1 to 'int4' (tensor expected, got " .. type(t) .. ")", 2)
  end
  return moe.ops.quantize(t, builtin_opts("moe.quantize.int4",
    { bits = 4, group_size = group_size or 128, stochastic = opts.stochastic }, 2))
end

function M.dequantize(q) return moe.ops.dequantize(q) end

function M.nbytes(q)
  return q.values:numel() + 4 * q.scales:numel()
end

return M
