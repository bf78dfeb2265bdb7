--[==[
bench/reduce.lua - bandwidth of the fused row kernels (softmax, log_softmax,
layer_norm, rms_norm, cross_entropy forward; softmax, layer_norm and
cross_entropy backward kernels through autograd) on a large bf16 input,
against a device-to-device copy of the same bytes measured in the same run.

  moe-lua bench/reduce.lua [rows=16384] [cols=4096] [device=cuda] [json=FILE] [repeats=7] [iters=20]

Bytes counted are the minimum each kernel must move (reads + writes of the
(rows, cols) tensors; per-row statistics and weights are below 0.1% and
left out). Timing (bench/lib.lua): the median over `repeats` samples of
`iters` launches between two CUDA events (the host clock with device=cpu,
a smoke test of the script), after a warm-up; inputs are random (never
zeros). Backward figures are (forward + backward through autograd) minus
the forward, so they include the engine's work for one node.
]==]
local moe = require "moe"
local bench = dofile((arg[0]:match("^(.*)/") or ".") .. "/lib.lua")

local cfg = bench.config { rows = 16384, cols = 4096, device = "cuda", repeats = 7, iters = 20 }
local rows, cols, dev = cfg.rows, cfg.cols, cfg.device
assert(dev == "cpu" or moe.cuda.is_available(), "bench/reduce.lua needs a CUDA GPU")
local x = moe.randn({ rows, cols }, { dtype = "bf16", device = dev })
local g = moe.randn({ rows, cols }, { dtype = "bf16", device = dev })
local w = moe.rand({ cols }, { dtype = "bf16", device = dev }) + 0.5
local b = moe.randn({ cols }, { dtype = "bf16", device = dev })
local target = moe.randint(0, cols, { rows }, { dtype = "i64", device = dev })
local dst = moe.empty({ rows, cols }, { dtype = "bf16", device = dev })
local elt = 2 -- bytes per bf16

local function time(f)
  return (bench.time(f, { device = dev, iters = cfg.iters, repeats = cfg.repeats, warmup = cfg.warmup,
                          cooldown = cfg.cooldown }))
end

local function run(f) -- f returns tensors to free at once (no waiting for the GC)
  return function()
    local a, c = f()
    if a then a:free() end
    if c then c:free() end
  end
end

local results = {}
local function add(name, secs, bytes)
  results[#results + 1] = { name = name, secs = secs, bytes = bytes }
end

local n = rows * cols
add("copy (bf16)", time(function() dst:copy_(x) end), 2 * n * elt)
add("softmax fwd", time(run(function() return x:softmax(-1) end)), 2 * n * elt)
add("log_softmax fwd", time(run(function() return x:log_softmax(-1) end)), 2 * n * elt)
add("layer_norm fwd (w, b)", time(run(function() return moe.layer_norm(x, w, b) end)), 2 * n * elt)
add("rms_norm fwd (w)", time(run(function() return moe.rms_norm(x, w) end)), 2 * n * elt)
add("cross_entropy fwd (mean)", time(run(function() return moe.cross_entropy(x, target) end)), n * elt)

-- backward kernels: forward + backward through autograd, minus the forward
-- (so the figure includes the engine's own work for one op)
local xr = x:detach():requires_grad_(true)
local wr = w:detach():requires_grad_(true)
local br = b:detach():requires_grad_(true)
local function fb(fwd)
  return run(function()
    local y = fwd(xr)
    if y:numel() == 1 then y:backward() else y:backward(g) end
    local gx = xr.grad
    xr.grad, wr.grad, br.grad = nil, nil, nil
    y:free()
    return gx
  end)
end
add("softmax bwd", time(fb(function(v) return v:softmax(-1) end)) - results[2].secs, 3 * n * elt)
add("layer_norm bwd (dx, dw, db)",
  time(fb(function(v) return moe.layer_norm(v, wr, br) end)) - results[4].secs, 3 * n * elt)
add("rms_norm bwd (dx, dw)",
  time(fb(function(v) return moe.rms_norm(v, wr) end)) - results[5].secs, 3 * n * elt)
add("cross_entropy bwd", time(fb(function(v) return moe.cross_entropy(v, target) end)) - results[6].secs,
  2 * n * elt)

local copy_bw = results[1].bytes / results[1].secs
for _, r in ipairs(results) do
  r.us = r.secs * 1e6
  r.gbs = r.bytes / r.secs / 1e9
  r.of_copy = r.bytes / r.secs / copy_bw
  r.secs = nil
end
bench.write(cfg, {
  title = "Row kernels: bandwidth against a copy",
  device = dev, reference = "a device-to-device copy of the same bytes in the same run",
  shape = { rows, cols }, dtype = "bf16", iters = cfg.iters, results = results,
  columns = { { "op", "name" }, { "us/call", "us", "%.1f" }, { "GB/s", "gbs", "%.1f" },
              { "% copy", function(r) return ("%.1f%%"):format(100 * r.of_copy) end } },
})
