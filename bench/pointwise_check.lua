--[[
bench/pointwise_check.lua - checks the pointwise ops bench/pointwise.lua
times (gelu, gelu_tanh, silu, swiglu in bf16) on the device against the CPU
on the same 4096 random elements. Fails (non-zero exit) on a mismatch.

  moe-lua bench/pointwise_check.lua [device=cuda] [json=FILE]

Tolerance: 1e-2 relative (one bf16 ulp is 2^-8..2^-7), at least 1e-2
absolute.
]]
local moe = require "moe"
local bench = dofile((arg[0]:match("^(.*)/") or ".") .. "/lib.lua")

local cfg = moe.config { device = "cuda", json = "", md = "", n = 4096 }
assert(cfg.device == "cpu" or moe.cuda.is_available(), "bench/pointwise_check.lua needs a CUDA GPU")
moe.manual_seed(1)
local dev = { dtype = "bf16", device = cfg.device }
local x, u = moe.randn({ cfg.n }, dev), moe.randn({ cfg.n }, dev)

local ops = {
  { "gelu bf16 fwd", function(a) return a:gelu() end, 1 },
  { "gelu_tanh bf16 fwd", function(a) return a:gelu_tanh() end, 1 },
  { "silu bf16 fwd", function(a) return a:silu() end, 1 },
  { "swiglu bf16 fwd", function(a, b) return moe.swiglu(a, b) end, 2 },
}
local validation, failed = {}, 0
for _, op in ipairs(ops) do
  local name, f, nin = op[1], op[2], op[3]
  local g = nin == 2 and f(x, u) or f(x)
  local c = nin == 2 and f(x:cpu(), u:cpu()) or f(x:cpu())
  local gt, ct = g:float():cpu():totable(), c:float():totable()
  local worst, where = 0, 0
  for i = 1, #ct do
    local err = math.abs(gt[i] - ct[i]) / math.max(1, math.abs(ct[i]))
    if err > worst then worst, where = err, i end
  end
  local ok = worst <= 1e-2
  if not ok then failed = failed + 1 end
  validation[#validation + 1] = { name = name, max_rel_err = worst, ok = ok }
  print(string.format("check %-20s max err %.2e%s %s", name, worst,
    ok and "" or string.format(" (element %d: device %g cpu %g)", where, gt[where], ct[where]),
    ok and "ok" or "FAILED"))
end
bench.write(cfg, { title = "Pointwise ops against the CPU", device = cfg.device, n = cfg.n,
  reference = "the CPU on the same bf16 values", validation = validation, rows = validation,
  columns = { { "op", "name" }, { "max err", "max_rel_err", "%.2e" }, { "ok", "ok" } } })
assert(failed == 0, "pointwise_check: " .. failed .. " op(s) failed")
