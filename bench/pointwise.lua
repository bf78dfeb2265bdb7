--[[
bench/pointwise.lua - bandwidth of the pointwise CUDA kernels against a
device-to-device copy measured in the same run.

  moe-lua bench/pointwise.lua [n=67108864] [device=cuda] [json=FILE] [repeats=15] [iters=10]

n elements (default 64M) of random bf16 data on cuda:0 (device=cpu runs the
same script on the CPU, for checking the script itself);
bench/pointwise_check.lua checks each op against the CPU. Timing
(bench/lib.lua): per sample `iters` launches between two CUDA events (the
host clock on the CPU), the median over `repeats` samples after a warm-up.
Bandwidth counts the minimum bytes (every input read once, the output
written once); the copy (dst:copy_(src)) counts read + write, like
GPU.md's ceiling. Two strided cases of attention's shapes (S 1024, H 8,
D 64, bf16, B from n) follow when n holds at least one batch: the
(B, H, S, D) -> (B, S, H, D) copy and rope of q as a view of a packed qkv.
]]
local moe = require "moe"
local bench = dofile((arg[0]:match("^(.*)/") or ".") .. "/lib.lua")

local cfg = bench.config { n = 64 * 1024 * 1024, device = "cuda", repeats = 15, iters = 10 }
local N, device = cfg.n, cfg.device
assert(device == "cpu" or moe.cuda.is_available(), "bench/pointwise.lua needs a CUDA GPU")

moe.manual_seed(1)
local dev = { dtype = "bf16", device = device }
local x = moe.randn({ N }, dev)
local u = moe.randn({ N }, dev)
local dst = moe.empty({ N }, dev)

-- seconds per call of f (which returns a tensor to free, or nil)
local function time(f)
  return (bench.time(function()
    local r = f()
    if r then r:free() end
  end, { device = device, iters = cfg.iters, repeats = cfg.repeats, warmup = cfg.warmup, cooldown = cfg.cooldown }))
end

local rows = {}
local function bench_op(name, bytes_per_elem, f, elems)
  local s = time(f)
  local gbs = bytes_per_elem * (elems or N) / s / 1e9
  rows[#rows + 1] = { op = name, us = s * 1e6, gbs = gbs }
  return gbs
end

local copy_gbs = bench_op("copy bf16 (read+write)", 4, function() dst:copy_(x) end)
bench_op("gelu bf16 fwd", 4, function() return x:gelu() end)
bench_op("gelu_tanh bf16 fwd", 4, function() return x:gelu_tanh() end)
bench_op("silu bf16 fwd", 4, function() return x:silu() end)
bench_op("swiglu bf16 fwd", 6, function() return moe.swiglu(x, u) end)
bench_op("dropout(0.1) bf16 fwd", 4, function() return x:dropout(0.1) end)
-- attention's layouts (S 1024, H 8, D 64; B from n): its (B, H, S, D)
-- output into (B, S, H, D) order (the strided copy of
-- o:transpose(1, 2):reshape), and rope of q, a strided (B, S, H, D) view of
-- the packed (B, S, 3, H, D) qkv
local S, H, D = 1024, 8, 64
local B = N // (S * H * D)
if B >= 1 then
  local o4 = moe.randn({ B, H, S, D }, dev)
  bench_op("transpose (B,H,S,D)->(B,S,H,D) bf16", 4, function() return o4:transpose(1, 2):contiguous() end,
           B * S * H * D)
  o4:free()
  local Bq = math.max(1, N // (3 * S * H * D))
  local qkv = moe.randn({ Bq, S, 3, H, D }, dev)
  local q = qkv:select(2, 0)
  local cos, sin = moe.rope_cache(S, D, 10000, dev)
  bench_op("rope of q in a packed qkv bf16", 4, function() return moe.rope(q, cos, sin, "bthd") end,
           Bq * S * H * D)
  qkv:free()
end
for _, r in ipairs(rows) do r.of_copy = r.gbs / copy_gbs end

bench.write(cfg, {
  title = "Pointwise kernels: bandwidth against a copy",
  device = device, reference = "a device-to-device copy of the same bytes in the same run",
  n = N, copy_gbs = copy_gbs, iters = cfg.iters, ops = rows,
  rows = rows,
  columns = { { "op", "op" }, { "time us", "us", "%.1f" }, { "GB/s", "gbs", "%.1f" },
              { "of copy", function(r) return ("%.1f%%"):format(100 * r.of_copy) end } },
})
