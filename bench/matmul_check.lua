--[[
bench/matmul_check.lua - checks each layout bench/matmul.lua times against
the CPU on a small bf16 problem (NN matmul, linear with bias (x W^T), the
TN product of the weight gradient): the CPU multiplies the same bf16
values in f32. Fails (non-zero exit) when a layout is off.

  moe-lua bench/matmul_check.lua [json=FILE]

Tolerance: bf16 output rounding is 2^-9 relative; f32 accumulation order
adds far less: 2^-7 of the largest |cpu| value.
]]
local moe = require "moe"
local bench = dofile((arg[0]:match("^(.*)/") or ".") .. "/lib.lua")

local cfg = moe.config { json = "", md = "", device = "cuda" }
assert(cfg.device == "cpu" or moe.cuda.is_available(), "bench/matmul_check.lua needs a CUDA GPU")

local function randn(shape) return moe.randn(shape, { dtype = "bf16", device = cfg.device }) end

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
local failed = 0
for _, c in ipairs(checks) do
  local e = rel_err(c[2], c[3])
  validation[#validation + 1] = { name = c[1], rel_err = e, ok = e < 2 ^ -7 }
  print(string.format("validate %-24s max |gpu - cpu| / max |cpu| = %.2e  %s", c[1], e,
    e < 2 ^ -7 and "ok" or "FAILED"))
  if e >= 2 ^ -7 then failed = failed + 1 end
end
bench.write(cfg, { title = "Matrix product layouts against the CPU", device = cfg.device,
  reference = "the CPU in f32 on the same bf16 values", validation = validation,
  rows = validation, columns = { { "check", "name" }, { "rel err", "rel_err", "%.2e" }, { "ok", "ok" } } })
assert(failed == 0, "matmul_check: " .. failed .. " layout(s) failed")
