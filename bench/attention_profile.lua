--[[
bench/attention_profile.lua - one causal attention forward and backward
(bf16, CUDA) at one shape, for a profiler to look at:

  ncu --kernel-name regex:attn --launch-skip 4 --launch-count 4 \
    moe-lua bench/attention_profile.lua [B=2] [H=16] [T=4096] [D=128]

Runs the pair three times (the first two warm up) and prints the last
times, each half between CUDA events (bench/lib.lua).
]]
local moe = require "moe"
local bench = dofile((arg[0]:match("^(.*)/") or ".") .. "/lib.lua")
local cfg = moe.config { B = 2, H = 16, T = 4096, D = 128 }
assert(moe.cuda.is_available(), "bench/attention_profile.lua needs a CUDA GPU")
local B, H, T, D = cfg.B, cfg.H, cfg.T, cfg.D
local function randn() return moe.randn({ B, H, T, D }, { dtype = "bf16", device = "cuda" }) end
local q, k, v, dout = randn(), randn(), randn(), randn()
local sw = bench.stopwatch("cuda")
for it = 1, 3 do
  sw:mark()
  local o, lse = moe.attention_forward(q, k, v, { causal = true })
  sw:mark()
  local dq, dk, dv = moe.attention_backward(q, k, v, o, lse, dout, { causal = true })
  sw:mark()
  local t = sw:intervals()
  if it == 3 then
    print(string.format("B,H,T,D = %d,%d,%d,%d: forward %.3f ms, backward %.3f ms", B, H, T, D,
      t[1] * 1e3, t[2] * 1e3))
  end
  o:free(); lse:free(); dq:free(); dk:free(); dv:free()
end
sw:free()
