--[[
moe/experts/autotune.lua - mlp_impl = "auto" by measurement: a dMoE layer's
built-in experts (experts.MLP, experts.GLU) timed once per shape with each
implementation that can run them, the fastest kept.

  local autotune = require "moe.experts.autotune"
  impl = autotune.pick(experts, {T =, k =, block_size =, rule =})

pick times experts(x, plan, gates) forward and backward on T synthetic tokens
(normal values) routed as an untrained router routes them: the top k of
random logits per token, so each expert's row count varies as it does in
training, and the block-sparse path pays the padding of each expert's rows to
the block that a perfectly even load (say 256 rows per expert with blocks of
128) would hide,
with "grouped" and, when d_ff is a multiple of block_size, "sparse": one
untimed call each, then `repeats` (3) timed calls, the fastest counted. The
layer's own weights are used through detached copies of their handles, so no
gradient reaches the parameters and no memory is added for weights; the
random generator's state is kept, so training draws the same numbers as
without measuring. T is rounded up to a power of two (at least 256) and the
result cached per rounded shape (device, dtype, expert class, activation, E,
d, d_ff, k, block size, memory_optimized, quantize): the layers of a model
share one measurement, and the token counts an expert-parallel rank receives,
which vary by step, fall in a few buckets.

The implementation `rule` names (the layer's fixed choice: sparse on CUDA
with more than 16 experts unless the grouped path runs moe-lua's own grouped
GEMM there, else grouped) is kept unless another is faster by
more than `margin` (5%), so timing noise between two close paths does not
flip the choice from run to run. A path whose measurement raises (out of
memory at the rounded T, say) is left out and its error kept in the result
(and in the logged line); when every path fails, pick raises the first error.

M.mode decides where pick measures: "measure" (everywhere), "rule" (never:
pick returns `rule`) or "gpu" (the default: measure on CUDA, the rule on the
CPU, where the grouped path is the faster one and where tests compare runs bit
for bit). The environment variable MOE_MLP_AUTO sets the default
(docs/ENVIRONMENT.md); moe.train sets "rule" for deterministic = true.
With several ranks each measures for itself; ranks may pick differently
(both paths compute the same function; data-parallel gradients are averaged).
Not part of the public API beyond M.mode, M.results and M.take_new.
]]
local moe = require "moe"

local M = {}

local MODES = { measure = true, rule = true, gpu = true }
local env = os.getenv("MOE_MLP_AUTO")
if env ~= nil and env ~= "" and not MODES[env] then
  error(("MOE_MLP_AUTO must be measure, rule or gpu, got '%s'"):format(env), 0)
end
M.mode = (env ~= nil and env ~= "") and env or "gpu"
M.margin = 0.05
M.repeats = 3

local cache = {}  -- key -> {impl =, ms = {impl -> ms}, T =, key =}
local fresh = {}  -- results not yet taken by take_new, in the order measured

--- rule(cuda, n_experts, d_ff, block_size, own) -> the choice without measuring:
--- the block-sparse path on CUDA for more than 16 (local) experts when d_ff is a
--- multiple of the block and the grouped path would run on cuBLAS (own false:
--- not moe.ops.grouped_on_device), the grouped path otherwise
--- (moe/layers/dmoe.lua says why).
function M.rule(cuda, n_experts, d_ff, block_size, own)
  return (cuda and not own and n_experts > 16 and d_ff % block_size == 0) and "sparse" or "grouped"
end

--- own(device, dtype, n_experts, d, d_ff) -> whether the grouped path runs
--- moe-lua's own grouped GEMM there, both ways (moe.ops.grouped_on_device;
--- false without CUDA): rule's `own`.
function M.own(device, dtype, n_experts, d, d_ff)
  if device:sub(1, 4) ~= "cuda" or not moe.cuda.is_available() then return false end
  return moe.ops.grouped_on_device(device, dtype, n_experts, d, d_ff)
    and moe.ops.grouped_on_device(device, dtype, n_experts, d_ff, d)
end

-- The rounded token count a measurement uses.
function M.bucket(T)
  local b = 256
  while b < T do b = b * 2 end
  return b
end

local function quantize_key(q)
  if q == nil then return "-" end
  local parts = {}
  for _, k in ipairs({ "inputs", "rematerialize", "scatter" }) do
    local v = q[k]
    if type(v) == "table" then
      local kv = {}
      for kk, vv in pairs(v) do
        if kk ~= "keep" then kv[#kv + 1] = tostring(kk) .. "=" .. tostring(vv) end
      end
      table.sort(kv)
      v = "{" .. table.concat(kv, ",") .. "}"
    end
    parts[#parts + 1] = k .. "=" .. tostring(v)
  end
  return table.concat(parts, ";")
end

local function device_kind(t) return t.device:sub(1, 4) == "cuda" and "cuda" or "cpu" end

-- The cache key of experts ex at T tokens (rounded), k slots, block size bs.
function M.key(ex, T, k, bs)
  local w = ex.w1
  return table.concat({ device_kind(w), w.dtype, ex.__name, ex.act_name, ex.num_experts, ex.d_model, ex.d_ff,
    k, M.bucket(T), bs, tostring(ex.memory_optimized), quantize_key(ex.quantize) }, "|")
end

-- The implementations that can run ex at block size bs.
function M.candidates(ex, bs)
  local c = { "grouped" }
  if ex.d_ff % bs == 0 then c[#c + 1] = "sparse" end
  return c
end

local function wait(device)
  if device ~= "cpu" and moe.cuda then moe.cuda.synchronize() end
end

-- Milliseconds of the fastest of `repeats` forward + backward calls of ex
-- with impl, after one untimed call. Everything made is freed.
local function measure(ex, impl, T, k, bs)
  local w = ex.w1
  local device, dtype, E = w.device, w.dtype, ex.num_experts
  local names = {}
  for _, nt in ipairs(ex:named_parameters()) do names[#names + 1] = nt[1] end
  return moe.scope(function()
    local x = moe.randn({ T, ex.d_model }, { dtype = dtype, device = device }):requires_grad_(true)
    local dy = moe.randn({ T, ex.d_model }, { dtype = dtype, device = device })
    local _, ids = moe.topk(moe.randn({ T, E }, { device = device }), k, -1)
    local gates = moe.full({ T, k }, 1 / k, { dtype = dtype, device = device }):requires_grad_(true)
    local popts = impl == "sparse" and { block_size = bs, ffn_hidden = ex.d_ff } or nil
    local function once()
      moe.scope(function()
        local plan = moe.ops.routing_plan(ids, E, popts)
        local y = ex(x, plan, gates)
        y:backward(dy)
      end)
      x.grad, gates.grad = nil, nil
      for _, n in ipairs(names) do ex[n].grad = nil end
      wait(device)
    end
    once()
    local best = math.huge
    for _ = 1, M.repeats do
      local t0 = moe.clock()
      once()
      best = math.min(best, moe.clock() - t0)
    end
    return best * 1e3
  end)
end

-- Runs fn with ex's parameters replaced by detached handles of the same
-- storage (requiring grad: the backward runs in full, into their own .grad)
-- and ex.impl left as it was; grad mode on; the generator's state kept.
local function isolated(ex, fn)
  local saved, impl = {}, ex.impl
  for _, nt in ipairs(ex:named_parameters()) do
    local name, p = nt[1], nt[2]
    if name:find(".", 1, true) then error("autotune: experts with submodules are not measured", 0) end
    saved[name] = p
    rawset(ex, name, moe.keep(p:detach():requires_grad_(true)))
  end
  local rng = moe.get_rng_state()
  local prev = moe.set_grad_enabled(true)
  local res = table.pack(pcall(fn))
  moe.set_grad_enabled(prev)
  moe.set_rng_state(rng)
  for name, p in pairs(saved) do
    local a = rawget(ex, name)
    rawset(ex, name, p)
    a.grad = nil
    a:free()
  end
  ex.impl = impl
  if not res[1] then error(res[2], 0) end
  return table.unpack(res, 2, res.n)
end

-- Whether pick measures on the device of experts ex.
local function measures(ex)
  if M.mode == "rule" then return false end
  if M.mode == "measure" then return true end
  return device_kind(ex.w1) == "cuda"
end

--- pick(ex, o) -> impl, the result table or nil. o: T (tokens), k (slots per
--- token), block_size, rule (the choice without measuring), time (optional
--- function(impl) -> ms, for tests: replaces the timing).
function M.pick(ex, o)
  if not measures(ex) then return o.rule, nil end
  local key = M.key(ex, o.T, o.k, o.block_size)
  local r = cache[key]
  if r then return r.impl, r end
  local T = M.bucket(o.T)
  local ms, errors, first_err, best = {}, {}, nil, nil
  isolated(ex, function()
    for _, impl in ipairs(M.candidates(ex, o.block_size)) do
      ex.impl = impl
      local ok, v = pcall(function() return o.time and o.time(impl) or measure(ex, impl, T, o.k, o.block_size) end)
      if ok then
        ms[impl] = v
        if best == nil or v < ms[best] then best = impl end
      else
        errors[impl] = tostring(v)
        first_err = first_err or v
      end
    end
  end)
  if best == nil then error(first_err, 0) end
  -- the rule's choice stays unless another is clearly faster
  if ms[o.rule] and ms[best] >= ms[o.rule] * (1 - M.margin) then best = o.rule end
  r = { impl = best, ms = ms, errors = next(errors) and errors or nil, T = T, key = key, rule = o.rule }
  cache[key] = r
  fresh[#fresh + 1] = r
  return best, r
end

--- results() -> a list of every measurement so far ({impl =, ms =, errors =, T =, key =, rule =}).
function M.results()
  local out = {}
  for _, r in pairs(cache) do out[#out + 1] = r end
  table.sort(out, function(a, b) return a.key < b.key end)
  return out
end

--- take_new() -> one line per measurement made since the last call.
function M.take_new()
  local lines = {}
  for _, r in ipairs(fresh) do
    local parts = {}
    for impl, ms in pairs(r.ms) do parts[#parts + 1] = ("%s %.3f ms"):format(impl, ms) end
    for impl, err in pairs(r.errors or {}) do parts[#parts + 1] = ("%s failed: %s"):format(impl, err) end
    table.sort(parts)
    local E, d, f, k = r.key:match("^[^|]*|[^|]*|[^|]*|[^|]*|(%d+)|(%d+)|(%d+)|(%d+)|")
    lines[#lines + 1] = ("mlp_impl auto: %s (%s; E=%s d=%s d_ff=%s k=%s T=%d)"):format(r.impl,
      table.concat(parts, ", "), E, d, f, k, r.T)
  end
  fresh = {}
  return lines
end

--- clear() forgets every measurement (tests).
function M.clear()
  cache, fresh = {}, {}
end

return M
