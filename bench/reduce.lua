--[==[
bench/reduce.lua - bandwidth of the fused row kernels (softmax, log_softmax,
layer_norm, rms_norm, cross_entropy forward; softmax, layer_norm and
cross_entropy backward kernels through autograd) on a large bf16 input,
against a device-to-device copy of the same bytes measured in the same run.

  moe-lua bench/reduce.lua [rows [cols]]     (default 16384 4096)

Bytes counted are the minimum each kernel must move (reads + writes of the
(rows, cols) tensors; per-row statistics and weights are below 0.1% and
left out). Each timing is the median over 7 batches of 20 launches between
two synchronisations, after a warm-up; inputs are random (never zeros).
Backward figures are (forward + backward through autograd) minus the
forward, so they include the engine's work for one node.
The last lines are a table: op, time per call (us), GB/s, % of copy.
]==]
local moe = require "moe"

local rows = tonumber(arg and arg[1]) or 16384
local cols = tonumber(arg and arg[2]) or 4096
local dev = os.getenv("MOE_BENCH_DEVICE") or "cuda" -- "cpu": a smoke test of the script
assert(dev == "cpu" or moe.cuda.is_available(), "bench/reduce.lua needs a CUDA GPU")
local function sync()
  if dev ~= "cpu" then moe.cuda.synchronize() end
end
local x = moe.randn({ rows, cols }, { dtype = "bf16", device = dev })
local g = moe.randn({ rows, cols }, { dtype = "bf16", device = dev })
local w = moe.rand({ cols }, { dtype = "bf16", device = dev }) + 0.5
local b = moe.randn({ cols }, { dtype = "bf16", device = dev })
local target = moe.randint(0, cols, { rows }, { dtype = "i64", device = dev })
local dst = moe.empty({ rows, cols }, { dtype = "bf16", device = dev })
local elt = 2 -- bytes per bf16

local function time(f)
  for _ = 1, 3 do f() end
  sync()
  local ts = {}
  for k = 1, 7 do
    local t0 = moe.clock()
    for _ = 1, 20 do f() end
    sync()
    ts[k] = (moe.clock() - t0) / 20
  end
  table.sort(ts)
  return ts[4]
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
print(string.format("device: %s; shape (%d, %d) bf16", dev == "cpu" and "cpu" or moe.cuda.get_device_name(), rows, cols))
print(string.format("%-28s %10s %10s %8s", "op", "us/call", "GB/s", "% copy"))
for _, r in ipairs(results) do
  local bw = r.bytes / r.secs
  print(string.format("%-28s %10.1f %10.1f %7.1f%%", r.name, r.secs * 1e6, bw / 1e9, 100 * bw / copy_bw))
end
