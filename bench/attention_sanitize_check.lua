--[[
bench/attention_sanitize_check.lua - attention forward and backward on a few odd
shapes, for compute-sanitizer (a driver, not a benchmark):

  MOE_ATTN_PERSISTENT=3 compute-sanitizer --tool memcheck build-gpu/moe-lua bench/attention_sanitize_check.lua
  (bench/gpu_round.sh sanitize runs memcheck, racecheck and synccheck)
]]
local moe = require "moe"
moe.config {} -- no keys: --help says so and key=value is refused
assert(moe.cuda.is_available(), "bench/attention_sanitize_check.lua needs a CUDA GPU")
for _, s in ipairs { { 2, 3, 300, 128 }, { 3, 2, 200, 64 }, { 1, 2, 77, 128 } } do
  local function r() return moe.randn(s, { dtype = "bf16", device = "cuda" }) end
  local q, k, v, d = r(), r(), r(), r()
  local o, lse = moe.attention_forward(q, k, v, { causal = true })
  local dq, dk, dv = moe.attention_backward(q, k, v, o, lse, d, { causal = true })
  moe.cuda.synchronize()
  print(table.concat(s, "x"), "ok", dq:float():abs():sum():item())
  for _, t in ipairs { q, k, v, d, o, lse, dq, dk, dv } do t:free() end
end
