--[[
bench/attention.lua - times moe's fused causal attention (bf16, CUDA),
forward and forward+backward, at the shapes of issue 3's target (seq
1024-4096, head dim 128) and one head-dim-64 shape; optionally dumps one
problem (inputs, outputs, gradients) for bench/attention_torch.py to check
against PyTorch.

  moe-lua bench/attention.lua [--json FILE] [--dump DIR] [--repeats N]

Timing: moe.cuda.synchronize() around each repeat of `iters` calls, timed
with moe.clock(); warm-up first; the median over repeats, per call.
FLOPs counted as PyTorch/FlashAttention do: forward 4*B*H*T*T*D / 2 (causal
half), backward 2.5x the forward.
]]
local moe = require "moe"

local args = { json = nil, dump = nil, repeats = 15 }
do
  local i = 1
  while i <= #arg do
    local a = arg[i]
    if a == "--json" then args.json = arg[i + 1]; i = i + 2
    elseif a == "--dump" then args.dump = arg[i + 1]; i = i + 2
    elseif a == "--repeats" then args.repeats = tonumber(arg[i + 1]); i = i + 2
    else error("unknown argument " .. a) end
  end
end

assert(moe.cuda.is_available(), "bench/attention.lua needs a CUDA GPU")
local dev = "cuda"
local opts = { causal = true }

local function randn(shape)
  return moe.randn(shape, { dtype = "bf16", device = dev })
end

local function median(t)
  table.sort(t)
  local n = #t
  if n % 2 == 1 then return t[(n + 1) // 2] end
  return (t[n // 2] + t[n // 2 + 1]) / 2
end

-- Median seconds per call of f (which frees what it makes).
local function time(f, iters, repeats)
  for _ = 1, 3 do f() end
  moe.cuda.synchronize()
  local samples = {}
  for r = 1, repeats do
    moe.cuda.synchronize()
    local t0 = moe.clock()
    for _ = 1, iters do f() end
    moe.cuda.synchronize()
    samples[r] = (moe.clock() - t0) / iters
  end
  return median(samples)
end

local shapes = {
  { B = 8, H = 16, T = 1024, D = 128 },
  { B = 4, H = 16, T = 2048, D = 128 },
  { B = 2, H = 16, T = 4096, D = 128 },
  { B = 4, H = 16, T = 2048, D = 64 },
}

local results = {}
print(string.format("%-24s %10s %10s %10s %10s", "shape (B,H,T,D)", "fwd ms", "fwd TF/s",
  "f+b ms", "f+b TF/s"))
for _, s in ipairs(shapes) do
  local shape = { s.B, s.H, s.T, s.D }
  local q, k, v, dout = randn(shape), randn(shape), randn(shape), randn(shape)
  local fwd = function()
    local o, lse = moe.attention_forward(q, k, v, opts)
    o:free(); lse:free()
  end
  local fwdbwd = function()
    local o, lse = moe.attention_forward(q, k, v, opts)
    local dq, dk, dv = moe.attention_backward(q, k, v, o, lse, dout, opts)
    o:free(); lse:free(); dq:free(); dk:free(); dv:free()
  end
  local tf = time(fwd, 5, args.repeats)
  local tfb = time(fwdbwd, 3, args.repeats)
  -- the same through autograd (what a model pays)
  local qa, ka, va = q:clone():requires_grad_(), k:clone():requires_grad_(), v:clone():requires_grad_()
  local autograd = function()
    local o = moe.attention(qa, ka, va, opts)
    o:backward(dout)
    o:free()
    qa.grad = nil; ka.grad = nil; va.grad = nil
  end
  local ok_ag, tag = pcall(time, autograd, 3, args.repeats)
  local flops = 4 * s.B * s.H * s.T * s.T * s.D / 2
  local r = {
    B = s.B, H = s.H, T = s.T, D = s.D, causal = true,
    fwd_ms = tf * 1e3, fwd_tflops = flops / tf / 1e12,
    fwdbwd_ms = tfb * 1e3, fwdbwd_tflops = 3.5 * flops / tfb / 1e12,
    autograd_ms = ok_ag and tag * 1e3 or nil,
  }
  results[#results + 1] = r
  print(string.format("%-24s %10.3f %10.1f %10.3f %10.1f%s", string.format("%d,%d,%d,%d", s.B, s.H,
    s.T, s.D), r.fwd_ms, r.fwd_tflops, r.fwdbwd_ms, r.fwdbwd_tflops,
    ok_ag and string.format("   (autograd f+b %.3f ms)", r.autograd_ms) or ("   (autograd: " .. tostring(tag) .. ")")))
  for _, t in ipairs({ q, k, v, dout, qa, ka, va }) do t:free() end
  collectgarbage()
end

if args.json then
  local f = assert(io.open(args.json, "w"))
  local parts = {}
  for _, r in ipairs(results) do
    parts[#parts + 1] = string.format(
      '{"B": %d, "H": %d, "T": %d, "D": %d, "causal": true, "fwd_ms": %.5f, "fwd_tflops": %.2f, ' ..
      '"fwdbwd_ms": %.5f, "fwdbwd_tflops": %.2f, "autograd_fwdbwd_ms": %s}',
      r.B, r.H, r.T, r.D, r.fwd_ms, r.fwd_tflops, r.fwdbwd_ms, r.fwdbwd_tflops,
      r.autograd_ms and string.format("%.5f", r.autograd_ms) or "null")
  end
  f:write("[" .. table.concat(parts, ",\n ") .. "]\n")
  f:close()
end

-- One problem written as raw little-endian f32 files (values exact: bf16
-- widened) for attention_torch.py --dump.
if args.dump then
  local B, H, T, D = 2, 4, 1000, 128
  local shape = { B, H, T, D }
  local q, k, v, dout = randn(shape), randn(shape), randn(shape), randn(shape)
  local o, lse = moe.attention_forward(q, k, v, opts)
  local dq, dk, dv = moe.attention_backward(q, k, v, o, lse, dout, opts)
  local function write(name, t)
    local vals = t:float():cpu():reshape({ -1 }):totable()
    local f = assert(io.open(args.dump .. "/" .. name .. ".f32", "wb"))
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
  local f = assert(io.open(args.dump .. "/shape.txt", "w"))
  f:write(string.format("%d %d %d %d\n", B, H, T, D))
  f:close()
  print("dumped " .. args.dump)
end
