--[[
bench/matmul.lua - times moe's matrix products on CUDA (cuBLASLt) at the
shapes of issue 3's target: bf16 GEMMs 4096^3 and 8192^3, a linear layer
(16384 x 4096) @ (14336 x 4096)^T with and without its bias, the two GEMMs
of that layer's backward (dX = dY @ W, dW = dY^T @ X, as moe_linear's
backward runs them), the whole layer forward and backward through autograd
(three GEMMs and the bias gradient's column sums) and one f32 GEMM
(full f32, no TF32). The first call of each large GEMM shape times
cuBLASLt's candidate algorithms (kernels/matmul.cu); the warm-up absorbs it. The same cases
run with torch in bench/matmul_torch.py; bench/matmul_report.py joins both.

  moe-lua bench/matmul.lua [--json FILE] [--repeats N] [--cooldown SECONDS]

--cooldown S idles the GPU S seconds before each case and before the
breakdown (bench/matmul_torch.py takes the same option): at ~700 W an H100's
clock depends on how long it has been busy, so without it a case's timing
depends on what ran just before it, on either side.

Before timing, each layout (NN, NT via linear, TN) is checked against the
CPU on a small bf16 problem: the CPU multiplies the same bf16 values in f32.
Timing: warm-up, then `repeats` samples of `iters` calls between two
CUDA events (moe.Event), as the torch side; the median per call. Inputs
are random normal (never zeros). FLOPs: 2 M N K per GEMM.
]]
local moe = require "moe"

local args = { json = nil, repeats = 20, cooldown = 0 }
do
  local i = 1
  while i <= #arg do
    local a = arg[i]
    if a == "--json" then args.json = arg[i + 1]; i = i + 2
    elseif a == "--repeats" then args.repeats = tonumber(arg[i + 1]); i = i + 2
    elseif a == "--cooldown" then args.cooldown = tonumber(arg[i + 1]); i = i + 2
    else error("unknown argument " .. a) end
  end
end

assert(moe.cuda.is_available(), "bench/matmul.lua needs a CUDA GPU")
assert(not moe.matmul_tf32(), "TF32 must be off by default")

local function randn(shape, dtype)
  return moe.randn(shape, { dtype = dtype or "bf16", device = "cuda" })
end

-- Idle the GPU args.cooldown seconds (nothing queued: synchronised first).
local function cooldown()
  moe.cuda.synchronize()
  if args.cooldown and args.cooldown > 0 then os.execute(("sleep %g"):format(args.cooldown)) end
end

local function median(t)
  table.sort(t)
  local n = #t
  if n % 2 == 1 then return t[(n + 1) // 2] end
  return (t[n // 2] + t[n // 2 + 1]) / 2
end

-- Median seconds per call of f (which frees what it makes): CUDA events
-- around `iters` calls, as bench/matmul_torch.py times torch, so both sides
-- use one method (until 2026-11-22 this side used moe.clock() between two
-- synchronisations, which added host time to the fused step's row).
local function time(f, iters, repeats)
  for _ = 1, 5 do f() end
  moe.cuda.synchronize()
  local e0, e1 = moe.Event("cuda"), moe.Event("cuda")
  local samples = {}
  for r = 1, repeats do
    e0:record()
    for _ = 1, iters do f() end
    e1:record(); e1:synchronize()
    samples[r] = e0:elapsed(e1) / 1e3 / iters
  end
  e0:free(); e1:free()
  return median(samples)
end

-- ------------------------------------------------------------ validation

-- Largest |gpu - cpu| over the largest |cpu|, cpu from the same bf16 values in f32.
local function rel_err(gpu, cpu)
  local g, c = gpu:float():cpu():reshape({ -1 }):totable(), cpu:float():reshape({ -1 }):totable()
  assert(#g == #c, "validation: sizes differ")
  local worst, big = 0, 0
  for i = 1, #c do
    worst = math.max(worst, math.abs(g[i] - c[i]))
    big = math.max(big, math.abs(c[i]))
  end
  return worst / big
end

local validation = {}
do
  local M, N, K = 384, 200, 320
  local a, b, w, bias = randn({ M, K }), randn({ K, N }), randn({ N, K }), randn({ N })
  local at = randn({ K, M })
  local function f32cpu(t) return t:cpu():float() end
  local checks = {
    { "NN matmul", moe.matmul(a, b), moe.matmul(f32cpu(a), f32cpu(b)) },
    { "linear + bias (x W^T)", moe.linear(a, w, bias), moe.linear(f32cpu(a), f32cpu(w), f32cpu(bias)) },
    { "TN matmul (dW layout)", moe.matmul(at:transpose(0, 1), b),
      moe.matmul(f32cpu(at):transpose(0, 1), f32cpu(b)) },
  }
  -- bf16 output rounding is 2^-9 relative; f32 accumulation order adds far less
  for _, c in ipairs(checks) do
    local e = rel_err(c[2], c[3])
    validation[#validation + 1] = { name = c[1], rel_err = e, ok = e < 2 ^ -7 }
    print(string.format("validate %-24s max |gpu - cpu| / max |cpu| = %.2e  %s", c[1], e,
      e < 2 ^ -7 and "ok" or "FAILED"))
    assert(e < 2 ^ -7, "validation failed: " .. c[1])
  end
end

-- ------------------------------------------------------------ timing

local cases = {}
-- gemms: how many M x N x K GEMMs one call does (3 for a layer's forward and backward)
local function case(name, M, N, K, dtype, setup, gemms)
  cases[#cases + 1] = { name = name, M = M, N = N, K = K, dtype = dtype, setup = setup,
                        gemms = gemms or 1 }
end

case("matmul 4096^3", 4096, 4096, 4096, "bf16", function()
  local a, b = randn({ 4096, 4096 }), randn({ 4096, 4096 })
  return function() moe.matmul(a, b):free() end, { a, b }
end)
case("matmul 8192^3", 8192, 8192, 8192, "bf16", function()
  local a, b = randn({ 8192, 8192 }), randn({ 8192, 8192 })
  return function() moe.matmul(a, b):free() end, { a, b }
end)
case("linear x W^T", 16384, 14336, 4096, "bf16", function()
  local x, w = randn({ 16384, 4096 }), randn({ 14336, 4096 })
  return function() moe.linear(x, w):free() end, { x, w }
end)
case("linear x W^T + b", 16384, 14336, 4096, "bf16", function()
  local x, w, b = randn({ 16384, 4096 }), randn({ 14336, 4096 }), randn({ 14336 })
  return function() moe.linear(x, w, b):free() end, { x, w, b }
end)
case("linear bwd dX = dY W", 16384, 4096, 14336, "bf16", function()
  local dy, w = randn({ 16384, 14336 }), randn({ 14336, 4096 })
  return function() moe.matmul(dy, w):free() end, { dy, w }
end)
case("linear bwd dW = dY^T X", 14336, 4096, 16384, "bf16", function()
  local dy, x = randn({ 16384, 14336 }), randn({ 16384, 4096 })
  local dyt = dy:transpose(0, 1)
  return function() moe.matmul(dyt, x):free() end, { dy, x }
end)
case("linear fwd+bwd (autograd)", 16384, 14336, 4096, "bf16", function()
  local x = randn({ 16384, 4096 }):requires_grad_()
  local w = randn({ 14336, 4096 }):requires_grad_()
  local b = randn({ 14336 }):requires_grad_()
  local dy = randn({ 16384, 14336 })
  return function()
    local y = moe.linear(x, w, b)
    y:backward(dy)
    y:free()
    x.grad = nil; w.grad = nil; b.grad = nil
  end, { x, w, b, dy }
end, 3)
case("matmul 4096^3 f32", 4096, 4096, 4096, "f32", function()
  local a, b = randn({ 4096, 4096 }, "f32"), randn({ 4096, 4096 }, "f32")
  return function() moe.matmul(a, b):free() end, { a, b }
end)

local info = moe.build_info()
local results = {}
print(string.format("%-26s %-6s %10s %10s", "case", "dtype", "ms", "TFLOP/s"))
for _, c in ipairs(cases) do
  local f, keep = c.setup()
  cooldown()
  local flops = 2 * c.M * c.N * c.K * c.gemms
  local iters = math.max(3, math.min(200, math.floor(2e13 / flops))) -- 10-30 ms a sample
  local t = time(f, iters, args.repeats)
  local r = { name = c.name, M = c.M, N = c.N, K = c.K, dtype = c.dtype, gemms = c.gemms,
              ms = t * 1e3, tflops = flops / t / 1e12 }
  results[#results + 1] = r
  print(string.format("%-26s %-6s %10.4f %10.1f", c.name, c.dtype, r.ms, r.tflops))
  for _, x in ipairs(keep) do x:free() end
  collectgarbage()
end

-- ------------------------------------------------------------ fused-step breakdown
-- Where the time of "linear fwd+bwd (autograd)" goes (printed and written to
-- the JSON under "breakdown"; bench/matmul_torch.py measures the same):
--   step_events_ms: the same step as the table row, 3 per sample, timed with
--     events (a second measurement of the row, to see its spread);
--   fwd_ms, bwd_ms: each phase between events, one step per sync (medians);
--   by_hand_ms: the same GPU work without autograd: linear + bias, dY W,
--     dY^T X and dY:sum(0) (reduce family's kernel, not linear's column sum);
--   allocs_per_step, system_allocs_per_step: allocator calls per step (a
--     clone of a gradient would show as one more allocation).
local breakdown = {}
do
  local x = randn({ 16384, 4096 }):requires_grad_()
  local w = randn({ 14336, 4096 }):requires_grad_()
  local b = randn({ 14336 }):requires_grad_()
  local dy = randn({ 16384, 14336 })
  local xd, wd, bd = x:detach(), w:detach(), b:detach()
  local dyt = dy:transpose(0, 1)
  local function step()
    local y = moe.linear(x, w, b)
    y:backward(dy)
    y:free()
    x.grad = nil; w.grad = nil; b.grad = nil
  end
  local function by_hand()
    moe.linear(xd, wd, bd):free()
    moe.matmul(dy, wd):free()
    moe.matmul(dyt, xd):free()
    moe.sum(dy, 0):free()
  end
  cooldown()
  for _ = 1, 3 do step() end
  moe.cuda.synchronize()
  breakdown.step_events_ms = time(step, 3, args.repeats) * 1e3 -- as the table row
  local e0, e1, e2 = moe.Event("cuda"), moe.Event("cuda"), moe.Event("cuda")
  local fwd, bwd = {}, {}
  cooldown() -- each part of the breakdown after its own idle (the torch side likewise)
  local s0 = moe.memory_stats("cuda")
  for r = 1, args.repeats do
    e0:record()
    local y = moe.linear(x, w, b)
    e1:record()
    y:backward(dy)
    e2:record(); e2:synchronize()
    fwd[r], bwd[r] = e0:elapsed(e1), e1:elapsed(e2)
    y:free()
    x.grad = nil; w.grad = nil; b.grad = nil
  end
  local s1 = moe.memory_stats("cuda")
  breakdown.fwd_ms, breakdown.bwd_ms = median(fwd), median(bwd)
  breakdown.allocs_per_step = (s1.alloc_count - s0.alloc_count) / args.repeats
  breakdown.system_allocs_per_step = (s1.system_allocs - s0.system_allocs) / args.repeats
  cooldown()
  breakdown.by_hand_ms = time(by_hand, 3, args.repeats) * 1e3
  for _, t in ipairs({ e0, e1, e2 }) do t:free() end
  for _, t in ipairs({ x, w, b, dy, xd, wd, bd, dyt }) do t:free() end
  collectgarbage()
  local clock_ms = 0
  for _, r in ipairs(results) do
    if r.name == "linear fwd+bwd (autograd)" then clock_ms = r.ms end
  end
  print(string.format("breakdown of the fused step: events %.4f ms (table row %.4f), fwd %.4f, " ..
    "bwd %.4f, by hand %.4f; allocations per step %.1f (system %.1f)", breakdown.step_events_ms,
    clock_ms, breakdown.fwd_ms, breakdown.bwd_ms, breakdown.by_hand_ms,
    breakdown.allocs_per_step, breakdown.system_allocs_per_step))
end

if args.json then
  local gpu = info.gpus[1] or {}
  local parts = {}
  for _, r in ipairs(results) do
    parts[#parts + 1] = string.format(
      '{"name": "%s", "M": %d, "N": %d, "K": %d, "gemms": %d, "dtype": "%s", "ms": %.5f, ' ..
      '"tflops": %.2f}', r.name, r.M, r.N, r.K, r.gemms, r.dtype, r.ms, r.tflops)
  end
  local vparts = {}
  for _, v in ipairs(validation) do
    vparts[#vparts + 1] = string.format('{"name": "%s", "rel_err": %.3e, "ok": %s}', v.name,
      v.rel_err, tostring(v.ok))
  end
  local f = assert(io.open(args.json, "w"))
  f:write(string.format(
    '{"tool": "moe-lua %s", "device": "%s", "cuda_runtime": %d, "cuda_driver": %d, "cublas": %d,\n' ..
    ' "date": "%s", "repeats": %d, "cooldown_s": %g, "tf32": false,\n "validation": [%s],\n "results": [%s],\n' ..
    ' "breakdown": {"step_events_ms": %.5f, "fwd_ms": %.5f, "bwd_ms": %.5f, "by_hand_ms": %.5f,' ..
    ' "allocs_per_step": %.2f, "system_allocs_per_step": %.2f}}\n',
    info.version, gpu.name or "?", info.cuda_runtime, info.cuda_driver, info.cublas,
    os.date("!%Y-%m-%dT%H:%M:%SZ"), args.repeats, args.cooldown, table.concat(vparts, ", "),
    table.concat(parts, ",\n  "), breakdown.step_events_ms, breakdown.fwd_ms, breakdown.bwd_ms,
    breakdown.by_hand_ms, breakdown.allocs_per_step, breakdown.system_allocs_per_step))
  f:close()
end
