--[[
bench/attention_check.lua - one causal attention problem (bf16) forward and
backward, written for bench/attention_torch.py --dump DIR to check against
PyTorch's SDPA and a float64 reference: q, k, v, dout and moe's out, lse,
dq, dk, dv as raw little-endian f32 files (values exact: bf16 widened) and
DIR/shape.txt.

  moe-lua bench/attention_check.lua dir=DIR [device=cuda]
  python3 bench/attention_torch.py --dump DIR ...
]]
local moe = require "moe"

local cfg = moe.config { dir = "", device = "cuda", B = 2, H = 4, T = 1000, D = 128 }
assert(cfg.dir ~= "", "bench/attention_check.lua: dir=DIR is required")
assert(cfg.device == "cpu" or moe.cuda.is_available(), "bench/attention_check.lua needs a CUDA GPU")
local opts = { causal = true }
local B, H, T, D = cfg.B, cfg.H, cfg.T, cfg.D
local shape = { B, H, T, D }
local function randn() return moe.randn(shape, { dtype = "bf16", device = cfg.device }) end
local q, k, v, dout = randn(), randn(), randn(), randn()
local o, lse = moe.attention_forward(q, k, v, opts)
local dq, dk, dv = moe.attention_backward(q, k, v, o, lse, dout, opts)
local function write(name, t)
  local vals = t:float():cpu():reshape({ -1 }):totable()
  local f = assert(io.open(cfg.dir .. "/" .. name .. ".f32", "wb"))
  local chunk = 4096
  for i = 1, #vals, chunk do
    local j = math.min(i + chunk - 1, #vals)
    f:write(string.pack("<" .. string.rep("f", j - i + 1), table.unpack(vals, i, j)))
  end
  f:close()
end
for name, t in pairs({ q = q, k = k, v = v, dout = dout, out = o, lse = lse, dq = dq, dk = dk, dv = dv }) do
  write(name, t)
end
local f = assert(io.open(cfg.dir .. "/shape.txt", "w"))
f:write(string.format("%d %d %d %d\n", B, H, T, D))
f:close()
print("dumped " .. cfg.dir)
