--[[
bench/pointwise.lua - bandwidth of the pointwise CUDA kernels against a
device-to-device copy measured in the same run.

  moe-lua bench/pointwise.lua [N] [out.json] [device]

N elements (default 64M) of random bf16 data on cuda:0 (device "cpu" runs
the same script on the CPU, for checking the script itself). Each op is checked
against the CPU on a slice first, then timed: per repeat, K launches between
two synchronisations (moe.clock), the median over repeats. Bandwidth counts
the minimum bytes (every input read once, the output written once); the copy
(dst:copy_(src)) counts read + write, like GPU.md's ceiling. The last lines
are a table; with out.json the figures are written there as JSON too.
]]
local moe = require "moe"

local N = tonumber(arg and arg[1]) or 64 * 1024 * 1024
local out_json = arg and arg[2] ~= "" and arg[2] or nil
local device = arg and arg[3] or "cuda"
assert(device == "cpu" or moe.cuda.is_available(), "bench/pointwise.lua needs a CUDA GPU")
local function sync()
  if device ~= "cpu" then moe.cuda.synchronize() end
end
local REPEATS, K = 15, 10

moe.manual_seed(1)
local dev = { dtype = "bf16", device = device }
local x = moe.randn({ N }, dev)
local u = moe.randn({ N }, dev)
local dst = moe.empty({ N }, dev)

-- check before timing: GPU against CPU on the first 4096 elements
local function check(name, f, nin)
  local xs = x:narrow(0, 0, 4096)
  local us = u:narrow(0, 0, 4096)
  local g = nin == 2 and f(xs, us) or f(xs)
  local c = nin == 2 and f(xs:cpu(), us:cpu()) or f(xs:cpu())
  local gt, ct = g:cpu():totable(), c:totable()
  for i = 1, #ct do
    local tol = 1e-2 * math.max(1, math.abs(ct[i])) -- one bf16 ulp is 2^-8..2^-7
    assert(math.abs(gt[i] - ct[i]) <= tol, string.format("%s: element %d gpu %g cpu %g", name, i, gt[i], ct[i]))
  end
end

local function median(t)
  table.sort(t)
  return t[(#t + 1) // 2]
end

-- seconds per call of f (which returns a tensor to free, or nil)
local function time(f)
  for _ = 1, 3 do
    local r = f()
    if r then r:free() end
  end
  sync()
  local times = {}
  for rep = 1, REPEATS do
    local t0 = moe.clock()
    for _ = 1, K do
      local r = f()
      if r then r:free() end
    end
    sync()
    times[rep] = (moe.clock() - t0) / K
  end
  return median(times)
end

local rows = {}
local function bench(name, bytes_per_elem, f)
  local s = time(f)
  local gbs = bytes_per_elem * N / s / 1e9
  rows[#rows + 1] = { name = name, us = s * 1e6, gbs = gbs }
  return gbs
end

local copy_gbs = bench("copy bf16 (read+write)", 4, function() dst:copy_(x) end)

local ops = {
  { "gelu bf16 fwd", 4, function() return x:gelu() end, function(a) return a:gelu() end, 1 },
  { "gelu_tanh bf16 fwd", 4, function() return x:gelu_tanh() end, function(a) return a:gelu_tanh() end, 1 },
  { "silu bf16 fwd", 4, function() return x:silu() end, function(a) return a:silu() end, 1 },
  { "swiglu bf16 fwd", 6, function() return moe.swiglu(x, u) end, function(a, b) return moe.swiglu(a, b) end, 2 },
  { "dropout(0.1) bf16 fwd", 4, function() return x:dropout(0.1) end, nil, 1 },
}
for _, op in ipairs(ops) do
  if op[4] then check(op[1], op[4], op[5]) end
  bench(op[1], op[2], op[3])
end

local name = device == "cpu" and "cpu" or moe.cuda.get_device_name(0)
print(string.format("device: %s, N = %d elements, median of %d x %d launches", name, N, REPEATS, K))
print(string.format("%-24s %10s %10s %8s", "op", "time us", "GB/s", "of copy"))
for _, r in ipairs(rows) do
  print(string.format("%-24s %10.1f %10.1f %7.1f%%", r.name, r.us, r.gbs, 100 * r.gbs / copy_gbs))
end

if out_json then
  local f = assert(io.open(out_json, "w"))
  f:write(string.format('{"device": "%s", "n": %d, "copy_gbs": %.1f, "ops": [', name, N, copy_gbs))
  for i, r in ipairs(rows) do
    f:write(string.format('%s{"op": "%s", "us": %.2f, "gbs": %.1f, "of_copy": %.3f}', i > 1 and ", " or "",
      r.name, r.us, r.gbs, r.gbs / copy_gbs))
  end
  f:write("]}\n")
  f:close()
end
