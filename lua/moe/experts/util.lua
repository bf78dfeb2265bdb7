--[[
moe/experts/util.lua - helpers shared by the expert modules (moe/experts/*)
and the MoE layers (moe/layers/*): option tables checked against their
defaults, activations by name, the expert linear over a routing plan
(moe.ops.parallel_linear, or the per-expert loop of impl "loop"), the
quantize scopes and a recomputing moe.Function (memory-optimized
experts). Not part of the public API; names may change.
]]
local moe = require "moe"

local util = {}

-- A default of "no value": options whose default is nil are listed with it.
util.NONE = setmetatable({}, { __name = "none", __tostring = function() return "nil" end })

-- Valid option names of a defaults table, sorted.
function util.option_names(defaults)
  local names = {}
  for k in pairs(defaults) do names[#names + 1] = k end
  table.sort(names)
  return names
end

-- opts merged over defaults (util.NONE becomes nil); an unknown key is an
-- error listing the valid ones. `level` as for error() (default: the
-- caller of the function that calls this one).
function util.options(name, opts, defaults, level)
  level = level or 3
  if opts ~= nil and type(opts) ~= "table" then
    error(name .. ": options table expected, got " .. type(opts), level)
  end
  local out = {}
  for k, v in pairs(defaults) do
    if v ~= util.NONE then out[k] = v end
  end
  for k, v in pairs(opts or {}) do
    if defaults[k] == nil then
      error(string.format("%s: unknown option '%s' (valid options: %s)", name, tostring(k),
        table.concat(util.option_names(defaults), ", ")), level)
    end
    out[k] = v
  end
  return out
end

-- Activation names accepted by the experts, and their functions.
local ACTIVATIONS = {
  gelu = function(t) return moe.gelu(t) end,
  gelu_tanh = function(t) return moe.gelu_tanh(t) end,
  silu = function(t) return moe.silu(t) end,
  relu = function(t) return moe.relu(t) end,
  sigmoid = function(t) return moe.sigmoid(t) end,
  tanh = function(t) return moe.tanh(t) end,
}
util.GLU_FUSED = { silu = true, gelu = true, gelu_tanh = true } -- glu_experts' activations
util.silu = ACTIVATIONS.silu -- identifies silu (a GLU with it uses moe.swiglu)

-- The activation function for a name or a Lua function (returned as is).
function util.activation(name, what, level)
  if type(name) == "function" then return name end
  local f = name == "silu" and util.silu or ACTIVATIONS[name]
  if not f then
    local names = {}
    for k in pairs(ACTIVATIONS) do names[#names + 1] = k end
    table.sort(names)
    error(string.format("%s: activation must be a function or one of %s, got %s", what,
      table.concat(names, ", "), tostring(name)), (level or 3))
  end
  return f
end

-- ids (T, k) i64 assigning the T k slots round-robin: token t's slot j on
-- expert (t k + j) mod E, distinct for k <= E (MegaBlocks'
-- uniform_expert_assignment).
function util.round_robin_ids(T, k, E, device)
  local v = {}
  for t = 0, T - 1 do
    local row = {}
    for j = 0, k - 1 do row[j + 1] = (t * k + j) % E end
    v[t + 1] = row
  end
  return moe.tensor(v, { dtype = "i64", device = device })
end

util.IMPLS = { grouped = true, sparse = true, loop = true }

function util.check_impl(impl, what, level)
  if not util.IMPLS[impl] then
    error(string.format("%s: impl must be \"grouped\", \"sparse\" or \"loop\", got %s", what,
      tostring(impl)), (level or 3))
  end
end

-- The per-expert loop: x rows grouped by the plan (gathered first when
-- opts.gather), one matmul per expert segment (rows [row_offsets[e],
-- row_offsets[e+1])), combined back with the gates when opts.scatter. Reads
-- the row offsets on the host (one copy). The reference the fused paths
-- are tested against, and a path that needs no C expert op.
local function loop_linear(x, w, plan, o)
  local xs = o.gather and moe.ops.permute(x, plan) or x
  local ro = plan.row_offsets
  if ro.device ~= "cpu" then ro = ro:to("cpu") end
  ro = ro:totable()
  local parts = {}
  for e = 0, #ro - 2 do
    local n = ro[e + 2] - ro[e + 1]
    if n > 0 then
      local we = w:select(0, e)
      if o.trans_w then we = we:transpose(0, 1) end
      parts[#parts + 1] = moe.matmul(xs:narrow(0, ro[e + 1], n), we)
    end
  end
  local ys
  if #parts == 0 then
    local ncol = o.trans_w and w.shape[2] or w.shape[3]
    ys = moe.zeros({ xs.shape[1], ncol }, { dtype = xs.dtype, device = xs.device })
  else
    ys = #parts == 1 and parts[1] or moe.cat(parts, 0)
  end
  if o.scatter then return moe.ops.combine(ys, plan, o.gates) end
  return ys
end

-- y = x W_e over the plan: moe.ops.parallel_linear for impl grouped and
-- sparse, the per-expert loop for impl "loop".
function util.parallel_linear(x, w, plan, o)
  if o.impl == "loop" then return loop_linear(x, w, plan, o) end
  local pl = moe.ops.parallel_linear
  if not pl then
    error("experts: impl '" .. o.impl .. "' needs moe.ops.parallel_linear, which this build "
      .. "lacks (impl \"loop\" works without it)", 0)
  end
  return pl(x, w, plan, o)
end

-- fn(...) under moe.quantize.scope(spec) when spec is set (nil, false, 0,
-- -1: off, MegaBlocks' -1 included).
function util.quantized(spec, fn, ...)
  if spec == nil or spec == false or spec == 0 or spec == -1 then return fn(...) end
  local q = moe.quantize
  if q == nil then
    local ok, mod = pcall(require, "moe.quantize")
    if not ok then error("experts: quantize is set but moe.quantize is not available: " .. tostring(mod), 0) end
    q = mod
  end
  return q.scope(spec, fn, ...)
end

-- A quantize setting checked: nil/false/0/-1 (off), 4, 8, or a table (a
-- spec or a user quantizer, checked by moe.quantize.scope).
function util.check_bits(v, what, level)
  if v == nil or v == false or v == 0 or v == -1 or v == 4 or v == 8 or type(v) == "table" then
    return v
  end
  error(string.format("%s must be off (nil, false, 0, -1), 4, 8 or a quantizer table, got %s", what,
    tostring(v)), (level or 3))
end

-- f(...) through a moe.Function that saves only f's tensor arguments and
-- runs f again in backward (under grad mode) to get the gradients: what f
-- computes in between (the activation, its product with the GLU's linear
-- unit) is not kept for backward. Non-tensor arguments are passed through.
local recompute_fns = setmetatable({}, { __mode = "k" })
function util.recompute(name, f, ...)
  local F = recompute_fns[f]
  if not F then
    F = moe.Function {
      name = name,
      forward = function(ctx, ...)
        local n = select("#", ...)
        local args = { ... }
        local tensors, where = {}, {}
        for i = 1, n do
          if moe.is_tensor(args[i]) then
            tensors[#tensors + 1] = args[i]
            where[#where + 1] = i
          end
        end
        ctx.n, ctx.where, ctx.other = n, where, args
        for _, i in ipairs(where) do ctx.other[i] = false end
        ctx:save_for_backward(table.unpack(tensors, 1, #tensors))
        return f(...)
      end,
      backward = function(ctx, g)
        return moe.enable_grad(function()
          local args = {}
          for i = 1, ctx.n do args[i] = ctx.other[i] end
          local leaves = {}
          for j, i in ipairs(ctx.where) do
            local s = ctx.saved_tensors[j]
            local l = s:detach()
            if ctx.needs_input_grad[i] then l:requires_grad_(true) end
            args[i], leaves[j] = l, l
          end
          local y = f(table.unpack(args, 1, ctx.n))
          y:backward(g)
          local grads = {}
          for j, i in ipairs(ctx.where) do
            if ctx.needs_input_grad[i] then grads[i] = leaves[j].grad end
          end
          return table.unpack(grads, 1, ctx.n)
        end)
      end,
    }
    recompute_fns[f] = F
  end
  return F(...)
end

return util
