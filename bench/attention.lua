--[[
bench/attention.lua - times moe's fused causal attention (bf16, CUDA),
forward and forward+backward, at the target shapes (seq
1024-4096, head dim 128) and one head-dim-64 shape, and the same
forward+backward through autograd. bench/attention_check.lua dumps one
problem for bench/attention_torch.py to check against PyTorch, which also
times SDPA at these shapes and joins both.

  moe-lua bench/attention.lua [json=FILE] [repeats=15] [warmup=3] [cooldown=S]

Timing (bench/lib.lua): warm-up, then `repeats` samples of `iters` calls
(5 forward, 3 forward+backward) between two CUDA events; the median per
call. FLOPs counted as PyTorch/FlashAttention do: forward 4*B*H*T*T*D / 2
(causal half), backward 2.5x the forward.
]]
local moe = require "moe"
local bench = dofile((arg[0]:match("^(.*)/") or ".") .. "/lib.lua")

local args = bench.config { repeats = 15, warmup = 3 }

assert(moe.cuda.is_available(), "bench/attention.lua needs a CUDA GPU")
local dev = "cuda"
local opts = { causal = true }

local function randn(shape)
  return moe.randn(shape, { dtype = "bf16", device = dev })
end

-- Median seconds per call of f (which frees what it makes).
local function time(f, iters)
  return (bench.time(f, { device = dev, iters = iters, repeats = args.repeats, warmup = args.warmup,
                          cooldown = args.cooldown }))
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
  local tf = time(fwd, 5)
  local tfb = time(fwdbwd, 3)
  -- the same through autograd (what a model pays)
  local qa, ka, va = q:clone():requires_grad_(), k:clone():requires_grad_(), v:clone():requires_grad_()
  local autograd = function()
    local o = moe.attention(qa, ka, va, opts)
    o:backward(dout)
    o:free()
    qa.grad = nil; ka.grad = nil; va.grad = nil
  end
  local ok_ag, tag = pcall(time, autograd, 3)
  local flops = 4 * s.B * s.H * s.T * s.T * s.D / 2
  local r = {
    B = s.B, H = s.H, T = s.T, D = s.D, causal = true,
    fwd_ms = tf * 1e3, fwd_tflops = flops / tf / 1e12,
    fwdbwd_ms = tfb * 1e3, fwdbwd_tflops = 3.5 * flops / tfb / 1e12,
    autograd_fwdbwd_ms = ok_ag and tag * 1e3 or nil,
  }
  results[#results + 1] = r
  print(string.format("%-24s %10.3f %10.1f %10.3f %10.1f%s", string.format("%d,%d,%d,%d", s.B, s.H,
    s.T, s.D), r.fwd_ms, r.fwd_tflops, r.fwdbwd_ms, r.fwdbwd_tflops,
    ok_ag and string.format("   (autograd f+b %.3f ms)", r.autograd_fwdbwd_ms)
      or ("   (autograd: " .. tostring(tag) .. ")")))
  for _, t in ipairs({ q, k, v, dout, qa, ka, va }) do t:free() end
  collectgarbage()
end

bench.write(args, {
  title = "Fused causal attention (bf16, CUDA)",
  device = dev,
  reference = "bench/attention_torch.py (torch SDPA on the same GPU; it joins both)",
  results = results,
  columns = { { "B", "B" }, { "H", "H" }, { "T", "T" }, { "D", "D" },
              { "fwd ms", "fwd_ms", "%.3f" }, { "fwd TFLOP/s", "fwd_tflops", "%.1f" },
              { "fwd+bwd ms", "fwdbwd_ms", "%.3f" }, { "fwd+bwd TFLOP/s", "fwdbwd_tflops", "%.1f" },
              { "autograd fwd+bwd ms", "autograd_fwdbwd_ms", "%.3f" } },
})
