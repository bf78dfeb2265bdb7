--[[
moe/autograd.lua - Lua helpers over the core's autograd (the engine itself is
core/autograd.c, bound in bindings/lautograd.c).

  moe.autograd.cast_hooks(dtype) -> pack, unpack
      A saved-tensor hook pair that keeps floating-point tensors saved for
      backward in `dtype` (e.g. "bf16") and gives them back in their own
      dtype: half the memory of f32 activations, at bf16's precision.
      Integer tensors (indices) are kept as they are.
  moe.autograd.with_saved_dtype(dtype, fn, ...) -> fn(...)
      Runs fn with cast_hooks(dtype) pushed.
  moe.autograd.backward(tensors [, grads] [, opts])
      Backward from several roots in turn (grads[i] for tensors[i]; nil
      for one-element roots); opts as for t:backward.
]]
local moe = require "moe"

local autograd = {}

local float = { f32 = true, f64 = true, bf16 = true, f16 = true }

function autograd.cast_hooks(dtype)
  if type(dtype) ~= "string" then
    error("bad argument #1 to 'cast_hooks' (dtype string expected, got " .. type(dtype) .. ")", 2)
  end
  local function pack(t)
    if not float[t.dtype] or t.dtype == dtype then return t end
    return { t:to(dtype), t.dtype }
  end
  local function unpack(p)
    if moe.is_tensor(p) then return p end
    return p[1]:to(p[2])
  end
  return pack, unpack
end

function autograd.with_saved_dtype(dtype, fn, ...)
  local pack, unpack = autograd.cast_hooks(dtype)
  return moe.saved_tensor_hooks(pack, unpack, fn, ...)
end

function autograd.backward(tensors, grads, opts)
  if type(tensors) ~= "table" then
    error("bad argument #1 to 'backward' (list of tensors expected, got " .. type(tensors) .. ")", 2)
  end
  grads = grads or {}
  for i, t in ipairs(tensors) do
    local last = i == #tensors
    local o = opts or {}
    if not last then o = { retain_graph = true } end
    if grads[i] then t:backward(grads[i], o) else t:backward(nil, o) end
  end
end

return autograd
