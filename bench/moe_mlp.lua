--[[
bench/moe_mlp.lua - issue 4's benchmark, moe-lua side: the MoE expert MLP
with SwiGLU (GLU) experts, forward + backward, bf16, one GPU, T = 16384
tokens, top-k routing from random logits (top-k of softmax), for the configs
mixtral (d 4096, f 14336, E 8, k 2), olmoe (2048, 1024, 64, 8) and qwen3
(2048, 768, 128, 8). One step = routing plan from the ids (its one host
sync) + permute + 3 expert GEMMs + combine, forward and backward with every
weight gradient and the gradients of x and the gates. Implementations:
  grouped      moe.ops.glu_experts, impl "grouped" (grouped GEMM)
  sparse       moe.ops.glu_experts, impl "sparse" (block-sparse, b = 128)
  lua_grouped  the GLU composed in Lua: parallel_linear x2, silu * mul,
               parallel_linear with scatter (grouped)
plus the dense bf16 GEMM rate (moe.matmul 8192^3) in the same run.
bench/moe_mlp_torch.py times PyTorch on the same configs and
bench/moe_mlp_report.py joins both.

  moe-lua bench/moe_mlp.lua [--json FILE] [--repeats N] [--budget SECONDS]
                            [--configs mixtral,olmoe,qwen3] [--impls grouped,sparse,lua_grouped]
                            [--smoke 1]

--smoke 1 runs the same code on tiny shapes (T = 128, d / f / E scaled
down), on the CPU when there is no GPU: a check of the script, not a result.

Timing: 2 warm-up steps, then `repeats` steps each between two CUDA events
(moe.Event), the median. A step that takes more than a second cuts the
repeats to 3; once `budget` seconds have passed the remaining cases are
skipped (written with "skipped": true). TFLOP/s count 18 T k d f model
FLOPs (3 GEMMs forward, 6 backward, 2 T k d f each). Peak extra memory: the
allocator's peak during one step minus what was allocated before it
(weights, x, gates, dy; no gradients held).
]]
local moe = require "moe"

local args = { json = nil, repeats = 10, budget = 80, smoke = "0",
               configs = "mixtral,olmoe,qwen3", impls = "grouped,sparse,lua_grouped" }
do
  local i = 1
  while i <= #arg do
    local a = arg[i]
    local key = a:match("^%-%-(%w+)$")
    if key and args[key] ~= nil or key == "json" then
      args[key] = arg[i + 1]
      i = i + 2
    else
      error("unknown argument " .. a)
    end
  end
  args.repeats = tonumber(args.repeats)
  args.budget = tonumber(args.budget)
end

local smoke = args.smoke ~= "0"
local dev = moe.cuda.is_available() and "cuda" or "cpu"
assert(dev == "cuda" or smoke, "bench/moe_mlp.lua needs a CUDA GPU (or --smoke 1)")

local T = smoke and 128 or 16384
local CONFIGS = {
  { name = "mixtral", d = 4096, f = 14336, E = 8, k = 2 },
  { name = "olmoe", d = 2048, f = 1024, E = 64, k = 8 },
  { name = "qwen3", d = 2048, f = 768, E = 128, k = 8 },
}
if smoke then
  for _, c in ipairs(CONFIGS) do
    c.d, c.f, c.E = c.d // 64, 128, math.max(c.k, c.E // 8)
  end
end

-- CUDA events around fn on the GPU, the host clock on the CPU (smoke runs)
local function sync() if dev == "cuda" then moe.cuda.synchronize() end end
local function timed(fn)
  if dev ~= "cuda" then
    local t0 = moe.clock()
    fn()
    return (moe.clock() - t0) * 1e3
  end
  local e0, e1 = moe.Event("cuda"), moe.Event("cuda")
  e0:record()
  fn()
  e1:record(); e1:synchronize()
  local ms = e0:elapsed(e1)
  e0:free(); e1:free()
  return ms
end

local function split(s)
  local t = {}
  for w in s:gmatch("[^,]+") do t[w] = true end
  return t
end
local want_cfg, want_impl = split(args.configs), split(args.impls)

local function median(t)
  table.sort(t)
  local n = #t
  if n % 2 == 1 then return t[(n + 1) // 2] end
  return (t[n // 2] + t[n // 2 + 1]) / 2
end

local clock0 = moe.clock()
local function elapsed() return moe.clock() - clock0 end

-- ------------------------------------------------------------ dense rate

local dense = {}
do
  local n = smoke and 256 or 8192
  local a = moe.randn({ n, n }, { dtype = "bf16", device = dev })
  local b = moe.randn({ n, n }, { dtype = "bf16", device = dev })
  for _ = 1, 3 do moe.matmul(a, b):free() end
  sync()
  local s = {}
  for r = 1, 10 do
    s[r] = timed(function() for _ = 1, 5 do moe.matmul(a, b):free() end end) / 5
  end
  a:free(); b:free()
  dense.n = n
  dense.ms = median(s)
  dense.tflops = 2 * n ^ 3 / (dense.ms / 1e3) / 1e12
  print(string.format("dense bf16 GEMM %d^3: %.3f ms, %.1f TFLOP/s", n, dense.ms, dense.tflops))
end

-- ------------------------------------------------------------ the step

local function glu_lua(x, w1, w3, w2, plan, gates)
  local h1 = moe.ops.parallel_linear(x, w1, plan, { gather = true })
  local h3 = moe.ops.parallel_linear(x, w3, plan, { gather = true })
  local a = moe.silu(h1) * h3
  h1:free(); h3:free()
  local out = moe.ops.parallel_linear(a, w2, plan, { scatter = true, gates = gates })
  a:free()
  return out
end

local function make_step(c, impl, t)
  local popts = impl == "sparse" and { block_size = 128, ffn_hidden = c.f } or nil
  return function()
    local plan = moe.ops.routing_plan(t.ids, c.E, popts)
    local out
    if impl == "lua_grouped" then
      out = glu_lua(t.x, t.w1, t.w3, t.w2, plan, t.gates)
    else
      out = moe.ops.glu_experts(t.x, t.w1, t.w3, t.w2, plan, t.gates, { impl = impl })
    end
    out:backward(t.dy)
    out:free()
    plan:free()
    for _, p in ipairs({ t.x, t.w1, t.w3, t.w2, t.gates }) do p.grad = nil end
  end
end

local results = {}
local impl_order = { "grouped", "sparse", "lua_grouped" }
for _, c in ipairs(CONFIGS) do
  if want_cfg[c.name] then
    moe.manual_seed(1234)
    local o = { dtype = "bf16", device = dev }
    local t = {}
    t.x = moe.randn({ T, c.d }, o):requires_grad_(true)
    -- weights ~ N(0, 0.02) as an initialised model; dy ~ N(0, 1)
    t.w1 = (moe.randn({ c.E, c.d, c.f }, o) * 0.02):detach():requires_grad_(true)
    t.w3 = (moe.randn({ c.E, c.d, c.f }, o) * 0.02):detach():requires_grad_(true)
    t.w2 = (moe.randn({ c.E, c.f, c.d }, o) * 0.02):detach():requires_grad_(true)
    local logits = moe.randn({ T, c.E }, { dtype = "f32", device = dev })
    local g, ids = moe.topk(moe.softmax(logits, -1), c.k, -1)
    t.gates = g:to(dev, "bf16"):detach():requires_grad_(true)
    t.ids = ids
    t.dy = moe.randn({ T, c.d }, o)
    g:free(); logits:free()
    local flops = 18 * T * c.k * c.d * c.f
    for _, impl in ipairs(impl_order) do
      if want_impl[impl] then
        local r = { config = c.name, impl = impl, d = c.d, f = c.f, E = c.E, k = c.k, T = T,
                    flops = flops }
        if elapsed() > args.budget then
          r.skipped = true
          r.error = "time budget exhausted"
        else
          local step = make_step(c, impl, t)
          local ok, err = pcall(function()
            collectgarbage()
            sync()
            step() -- warm-up (cuBLAS heuristics, allocator growth)
            local first = timed(step)
            if first > 3000 then error(string.format("too slow to time: a warm step took %.0f ms", first)) end
            local reps = first > 1000 and 3 or args.repeats
            -- peak extra memory of one step
            sync()
            collectgarbage()
            local base = moe.memory_stats(dev).allocated
            moe.reset_peak_memory_stats(dev)
            step()
            sync()
            r.peak_extra_bytes = moe.memory_stats(dev).peak_allocated - base
            local s = {}
            for i = 1, reps do s[i] = timed(step) end
            r.ms = median(s)
            r.repeats = reps
            r.tflops = flops / (r.ms / 1e3) / 1e12
            r.pct_dense = 100 * r.tflops / dense.tflops
          end)
          if not ok then
            r.error = tostring(err)
            r.skipped = true
          end
        end
        results[#results + 1] = r
        if r.ms then
          print(string.format("%-8s %-12s %9.3f ms %7.1f TFLOP/s %5.1f%% of dense  peak extra %.2f GiB",
            c.name, impl, r.ms, r.tflops, r.pct_dense, r.peak_extra_bytes / 2 ^ 30))
        else
          print(string.format("%-8s %-12s skipped: %s", c.name, impl, r.error))
        end
      end
    end
    for _, v in pairs(t) do v:free() end
    collectgarbage()
    moe.empty_cache(dev)
  end
end

-- ------------------------------------------------------------ JSON

local function jstr(s)
  return '"' .. tostring(s):gsub('[%c"\\]', function(ch)
    return string.format("\\u%04x", ch:byte())
  end) .. '"'
end

if args.json then
  local info = moe.build_info()
  local gpu = info.gpus[1] or { name = dev }
  local parts = {}
  for _, r in ipairs(results) do
    local fields = {}
    for _, key in ipairs({ "config", "impl", "T", "d", "f", "E", "k", "flops", "ms", "tflops",
                           "pct_dense", "peak_extra_bytes", "repeats", "skipped", "error" }) do
      local v = r[key]
      if v ~= nil then
        local s
        if type(v) == "string" then s = jstr(v)
        elseif type(v) == "boolean" then s = tostring(v)
        elseif math.type(v) == "integer" then s = string.format("%d", v)
        else s = string.format("%.6g", v) end
        fields[#fields + 1] = jstr(key) .. ": " .. s
      end
    end
    parts[#parts + 1] = "{" .. table.concat(fields, ", ") .. "}"
  end
  local f = assert(io.open(args.json, "w"))
  f:write(string.format(
    '{"tool": %s, "device": %s, "cuda_runtime": %d, "cuda_driver": %d, "cublas": %d,\n' ..
    ' "date": %s, "dtype": "bf16", "T": %d, "smoke": %s, "grouped_backend": %s,\n' ..
    ' "dense": {"name": "moe.matmul bf16 %d^3", "ms": %.5f, "tflops": %.2f},\n' ..
    ' "results": [\n  %s]}\n',
    jstr("moe-lua " .. info.version), jstr(gpu.name or "?"), info.cuda_runtime, info.cuda_driver,
    info.cublas, jstr(os.date("!%Y-%m-%dT%H:%M:%SZ")), T, tostring(smoke),
    jstr(moe.ops.grouped_backend and moe.ops.grouped_backend() or "?"), dense.n, dense.ms,
    dense.tflops,
    table.concat(parts, ",\n  ")))
  f:close()
end
