--[[
bench/matmul.lua - times moe's matrix products on CUDA (cuBLASLt) at the
target shapes: bf16 GEMMs 4096^3 and 8192^3, a linear layer
(16384 x 4096) @ (14336 x 4096)^T with and without its bias, the two GEMMs
of that layer's backward (dX = dY @ W, dW = dY^T @ X, as moe_linear's
backward runs them), the whole layer forward and backward through autograd
(three GEMMs and the bias gradient's column sums) and one f32 GEMM
(full f32, no TF32). The first call of each large GEMM shape times
cuBLASLt's candidate algorithms (kernels/matmul.cu); the warm-up absorbs it. The same cases
run with torch in bench/matmul_torch.py; bench/matmul_report.py joins both.
bench/matmul_check.lua checks each layout against the CPU first.

  moe-lua bench/matmul.lua [json=FILE] [repeats=20] [warmup=5] [cooldown=SECONDS]

cooldown=S idles the GPU S seconds before each case and before each part of
the breakdown (bench/matmul_torch.py --cooldown does the same): at ~700 W an
H100's clock depends on how long it has been busy, so without it a case's
timing depends on what ran just before it, on either side.

Timing (bench/lib.lua): warm-up, then `repeats` samples of `iters` calls
between two CUDA events, as the torch side; the median per call. Inputs
are random normal (never zeros). FLOPs: 2 M N K per GEMM.
]]
local moe = require "moe"
local bench = dofile((arg[0]:match("^(.*)/") or ".") .. "/lib.lua")

local args = bench.config { repeats = 20, warmup = 5 }

assert(moe.cuda.is_available(), "bench/matmul.lua needs a CUDA GPU")
assert(not moe.matmul_tf32(), "TF32 must be off by default")

local function randn(shape, dtype)
  return moe.randn(shape, { dtype = dtype or "bf16", device = "cuda" })
end

-- Idle the GPU args.cooldown seconds (nothing queued: synchronised first).
local function cooldown() bench.cooldown(args.cooldown, "cuda") end

-- Median seconds per call of f (which frees what it makes): CUDA events
-- around `iters` calls, as bench/matmul_torch.py times torch.
local function time(f, iters)
  return (bench.time(f, { device = "cuda", iters = iters, repeats = args.repeats, warmup = args.warmup }))
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

local results = {}
print(string.format("%-26s %-6s %10s %10s", "case", "dtype", "ms", "TFLOP/s"))
for _, c in ipairs(cases) do
  local f, keep = c.setup()
  cooldown()
  local flops = 2 * c.M * c.N * c.K * c.gemms
  local iters = math.max(3, math.min(200, math.floor(2e13 / flops))) -- 10-30 ms a sample
  local t = time(f, iters)
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
  breakdown.step_events_ms = time(step, 3) * 1e3 -- as the table row
  local sw = bench.stopwatch("cuda")
  local fwd, bwd = {}, {}
  cooldown() -- each part of the breakdown after its own idle (the torch side likewise)
  local s0 = moe.memory_stats("cuda")
  for r = 1, args.repeats do
    sw:mark()
    local y = moe.linear(x, w, b)
    sw:mark()
    y:backward(dy)
    sw:mark()
    local iv = sw:intervals()
    fwd[r], bwd[r] = iv[1] * 1e3, iv[2] * 1e3
    y:free()
    x.grad = nil; w.grad = nil; b.grad = nil
  end
  local s1 = moe.memory_stats("cuda")
  breakdown.fwd_ms, breakdown.bwd_ms = bench.median(fwd), bench.median(bwd)
  breakdown.allocs_per_step = (s1.alloc_count - s0.alloc_count) / args.repeats
  breakdown.system_allocs_per_step = (s1.system_allocs - s0.system_allocs) / args.repeats
  cooldown()
  breakdown.by_hand_ms = time(by_hand, 3) * 1e3
  sw:free()
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

bench.write(args, {
  title = "Matrix products on CUDA (cuBLASLt)",
  device = "cuda",
  reference = "bench/matmul_torch.py (torch.matmul / F.linear on the same GPU; joined by bench/matmul_report.py)",
  tf32 = false,
  results = results,
  breakdown = breakdown,
  columns = { { "case", "name" }, { "dtype", "dtype" }, { "M", "M" }, { "N", "N" }, { "K", "K" },
              { "ms", "ms", "%.4f" }, { "TFLOP/s", "tflops", "%.1f" } },
  notes = { ("fused step breakdown: fwd %.4f ms, bwd %.4f ms, by hand %.4f ms, %.1f allocations per step")
    :format(breakdown.fwd_ms, breakdown.bwd_ms, breakdown.by_hand_ms, breakdown.allocs_per_step) },
})
