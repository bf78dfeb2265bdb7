--[[
bench/attention_profile.lua - one causal attention forward and backward
(bf16, CUDA) at one shape, for a profiler to look at:

  ncu --kernel-name regex:attn --launch-skip 4 --launch-count 4 \
    moe-lua bench/attention_profile.lua [B H T D]

Runs the pair three times (the first two warm up) and prints the last
times, synchronised around each half.
]]
local moe = require "moe"
assert(moe.cuda.is_available(), "bench/attention_profile.lua needs a CUDA GPU")
local B, H, T, D = tonumber(arg[1] or 2), tonumber(arg[2] or 16), tonumber(arg[3] or 4096),
  tonumber(arg[4] or 128)
local function randn() return moe.randn({ B, H, T, D }, { dtype = "bf16", device = "cuda" }) end
local q, k, v, dout = randn(), randn(), randn(), randn()
for it = 1, 3 do
  moe.cuda.synchronize()
  local t0 = moe.clock()
  local o, lse = moe.attention_forward(q, k, v, { causal = true })
  moe.cuda.synchronize()
  local t1 = moe.clock()
  local dq, dk, dv = moe.attention_backward(q, k, v, o, lse, dout, { causal = true })
  moe.cuda.synchronize()
  local t2 = moe.clock()
  if it == 3 then
    print(string.format("B,H,T,D = %d,%d,%d,%d: forward %.3f ms, backward %.3f ms", B, H, T, D,
      (t1 - t0) * 1e3, (t2 - t1) * 1e3))
  end
  o:free(); lse:free(); dq:free(); dk:free(); dv:free()
end
