--[[
bench/quantize.lua - what quantizing saved activations (moe.quantize, issue
6) costs and saves on an MoE expert layer: forward + backward of the layer
at the mixtral and qwen3 shapes of the MoE benchmark (T = 16384 tokens,
bf16) with quantization off, 8 bits and 4 bits, reporting per mode
  saved_mb   bytes autograd keeps for backward after the forward (allocated
             after forward - before, less the output), MiB
  peak_mb    peak extra memory over the whole forward + backward, MiB
  step_ms    median forward + backward time (fwd_ms, bwd_ms: medians of
             each half, timed with a synchronize between them)
  overhead   step_ms / step_ms(off) - 1
  grad_err   ||g - g_off|| / ||g_off|| for the input and each weight

  moe-lua bench/quantize.lua [json=FILE] [configs=mixtral,qwen3]
      [device=cuda|cpu] [repeats=5] [layer=dmoe|FILE.lua] [impl=grouped]
  moe-lua bench/quantize.lua kernels=true [json=FILE] [configs=...]
      the kernels alone on the saved tensors of a config: a (T k, f) bf16
      pre-activation half read in place from (T k, 2 f) and a contiguous
      (T k, f), quantized to 8 bits (row scales) and 4 bits (groups of
      128) and dequantized, against a copy (clone) of the same tensor;
      GB/s = bytes read + written / time.

layer=dmoe: the real layer, layers.dMoE{mlp_type = "glu", activation_fn
= "silu", mlp_impl = impl= (grouped; sparse; auto)} (lua/moe/layers/
dmoe.lua), bf16, its three switches set to the same bits (quantize =
{inputs =, rematerialize =, scatter =}); with them the GLU experts run the
fused moe.ops.glu_experts with its own quantize option
(lua/moe/experts/mlp.lua): h1 and h3, two (T k, f) tensors, kept quantized
and act(h1) * h3 recomputed from them in backward (quantization off keeps
all three). MOE_GLU_QFUSED=0 in the environment selects the unfused CUDA
passes (activation + two quantize kernels; dequantize before backward) for
an A/B; the JSON records it. Timing (bench/lib.lua): `repeats` steps per
mode, the modes interleaved (off, 8, 4, off, ...), medians; each half
between CUDA events (the host clock on the CPU).

The layer comes from a factory, swappable with layer=: FILE.lua returns
function(cfg) -> layer, where cfg = {d_model, d_ff, experts, top_k, T,
device, dtype} and the layer has layer:forward(x (T, d)) -> (T, d) and
layer:parameters() -> list of tensors (the nn.Module interface; the dMoE
of lua/moe/layers fits). When the layer has set_quantize(bits) (0, 8, 4)
the bench calls it instead of wrapping forward in moe.quantize.scope (for
the dMoE's own quantize = {...} switches). The default layer is a stand-in
written here while the dMoE is being written: random top-k routing
(moe.ops.routing_plan from fixed random ids), moe.ops.permute, a per-expert
SwiGLU MLP (x_e @ w13[e] -> swiglu(gate, up) @ w2[e]) over each expert's
rows, moe.ops.combine with random gates. Parameters are kept (never
quantized: keep = layer:parameters()); the scope quantizes the permuted
input, the gate/up pre-activations and the SwiGLU output.
]]
local moe = require "moe"
local quantize = require "moe.quantize"

local bench = dofile((arg[0]:match("^(.*)/") or ".") .. "/lib.lua")

local args = bench.config { configs = { "mixtral", "qwen3" }, device = "cuda", repeats = 5, warmup = 1,
                            layer = "", kernels = false, impl = "grouped" }

local CONFIGS = {
  mixtral = { d_model = 4096, d_ff = 14336, experts = 8, top_k = 2, T = 16384 },
  qwen3 = { d_model = 2048, d_ff = 768, experts = 128, top_k = 8, T = 16384 },
  olmoe = { d_model = 2048, d_ff = 1024, experts = 64, top_k = 8, T = 16384 },
  tiny = { d_model = 64, d_ff = 96, experts = 4, top_k = 2, T = 256 }, -- CPU smoke test
}

local dev = args.device
local cuda = dev ~= "cpu"
local function sync() bench.sync(dev) end

-- ------------------------------------------------------ the stand-in layer

local function standin_layer(cfg)
  local E, d, f, k, T = cfg.experts, cfg.d_model, cfg.d_ff, cfg.top_k, cfg.T
  local o = { dtype = cfg.dtype, device = cfg.device }
  local layer = {}
  layer.w13 = (moe.randn({ E, d, 2 * f }, o) * (1 / math.sqrt(d))):requires_grad_(true)
  layer.w2 = (moe.randn({ E, f, d }, o) * (1 / math.sqrt(f))):requires_grad_(true)
  local ids = moe.randint(0, E, { T, k }, { device = cfg.device })
  layer.plan = moe.ops.routing_plan(ids, E)
  layer.gates = moe.rand({ T, k }, o)
  local counts = layer.plan:counts_to_host()
  function layer.parameters() return { layer.w13, layer.w2 } end
  function layer.forward(_, x)
    local xs = moe.ops.permute(x, layer.plan) -- (T k, d)
    local ys, row = {}, 0
    for e = 0, E - 1 do
      local n = counts[e + 1]
      if n > 0 then
        local xe = xs:narrow(0, row, n)
        local w13, w2 = layer.w13:select(0, e), layer.w2:select(0, e)
        local h = moe.matmul(xe, w13) -- (n, 2f)
        local gate, up = h:narrow(1, 0, f), h:narrow(1, f, f)
        local a = moe.swiglu(gate, up)
        ys[#ys + 1] = moe.matmul(a, w2)
        -- free every handle now: a live view would keep h's storage alive
        for _, t in ipairs({ w13, w2, h, gate, up, a, xe }) do t:free() end
      end
      row = row + n
    end
    xs:free()
    local y = moe.cat(ys, 0)
    for _, t in ipairs(ys) do t:free() end
    local out = moe.ops.combine(y, layer.plan, layer.gates)
    y:free()
    return out
  end
  return layer
end

-- The real layer: layers.dMoE with SwiGLU experts.
local function dmoe_layer(cfg)
  local layers = require "moe.layers"
  local l = layers.dMoE { hidden_size = cfg.d_model, ffn_hidden_size = cfg.d_ff,
    num_experts = cfg.experts, top_k = cfg.top_k, mlp_type = "glu", activation_fn = "silu",
    mlp_impl = args.impl, moe_loss_weight = 0.01, dtype = cfg.dtype, device = cfg.device }
  function l.set_quantize(self, bits)
    self.experts.quantize = bits ~= 0 and { inputs = bits, rematerialize = bits, scatter = bits } or nil
  end
  return l
end

local factory = standin_layer
local layer_name = "stand-in (permute, per-expert SwiGLU matmuls, combine)"
if args.layer == "dmoe" then
  factory = dmoe_layer
  layer_name = "layers.dMoE (glu, silu, " .. args.impl .. ")"
elseif args.layer ~= "" then
  factory = dofile(args.layer)
  layer_name = args.layer
end

-- ----------------------------------------------------------------- measure

local median = bench.median

local MiB = 1024 * 1024

local function spec_of(bits, layer)
  if bits == 0 then return nil end
  return { bits = bits, keep = layer:parameters() }
end

-- One forward + backward; returns the bytes kept after forward and the
-- forward and backward seconds.
local sw = bench.stopwatch(dev)
local function step(layer, x, gy, bits)
  local before = moe.memory_stats(dev).allocated
  sw:mark()
  local y
  if layer.set_quantize then
    layer:set_quantize(bits)
    y = layer:forward(x)
  else
    y = quantize.scope(spec_of(bits, layer), layer.forward, layer, x)
  end
  sw:mark()
  sync()
  local saved = moe.memory_stats(dev).allocated - before - y:numel() * 2
  y:backward(gy)
  sw:mark()
  local t = sw:intervals()
  y:free()
  return saved, t[1], t[2]
end

local function grads(layer, x)
  local g = { x.grad:clone() }
  for _, p in ipairs(layer:parameters()) do g[#g + 1] = p.grad:clone() end
  return g
end

local function zero(layer, x)
  x.grad = nil
  for _, p in ipairs(layer:parameters()) do p.grad = nil end
end

local function rel(a, b)
  local fa, fb = a:float(), b:float()
  local r = (fa - fb):norm():item() / fb:norm():item()
  fa:free(); fb:free()
  return r
end


-- ------------------------------------------------------- kernels alone

local function kernels_bench()
  local out = {}
  local function timed(fn)
    bench.cooldown(args.cooldown, dev) -- idle first when cooldown= is set
    fn() -- warm-up
    sync()
    local ts = {}
    for r = 1, math.max(args.repeats, 5) do
      sw:mark()
      local v = fn()
      sw:mark()
      ts[r] = sw:intervals()[1]
      if type(v) == "table" then v.values:free(); v.scales:free() elseif v then v:free() end
    end
    return median(ts)
  end
  for _, name in ipairs(args.configs) do
    local cfg = assert(CONFIGS[name], "unknown config " .. name)
    local n, f = cfg.T * cfg.top_k, cfg.d_ff
    local h = moe.randn({ n, 2 * f }, { dtype = "bf16", device = dev })
    local views = { { "half of (Tk, 2f), in place", h:narrow(1, f, f) },
                    { "contiguous (Tk, f)", h:narrow(1, 0, f):contiguous() } }
    local elems = n * f
    for _, v in ipairs(views) do
      local vname, t = v[1], v[2]
      local copy = timed(function() return t:clone() end)
      local row = { config = name, tensor = vname, rows = n, cols = f,
                    copy_ms = copy * 1e3, copy_gbs = 4 * elems / copy / 1e9 }
      for _, bits in ipairs({ 8, 4 }) do
        local o = { bits = bits, group_size = bits == 4 and 128 or 0 }
        local packed = bits == 8 and elems + 4 * n or elems / 2 + 4 * n * math.ceil(f / 128)
        local tq = timed(function() return moe.ops.quantize(t, o) end)
        local q = moe.ops.quantize(t, o)
        local tdq = timed(function() return moe.ops.dequantize(q) end)
        q.values:free(); q.scales:free()
        row["q" .. bits .. "_ms"] = tq * 1e3
        row["q" .. bits .. "_gbs"] = (2 * elems + packed) / tq / 1e9
        row["dq" .. bits .. "_ms"] = tdq * 1e3
        row["dq" .. bits .. "_gbs"] = (2 * elems + packed) / tdq / 1e9
      end
      out[#out + 1] = row
      print(string.format("%-8s %-28s (%d, %d) bf16: copy %.3f ms %.0f GB/s | q8 %.3f ms %.0f GB/s, "
        .. "dq8 %.3f ms %.0f GB/s | q4 %.3f ms %.0f GB/s, dq4 %.3f ms %.0f GB/s", name, vname, n, f,
        row.copy_ms, row.copy_gbs, row.q8_ms, row.q8_gbs, row.dq8_ms, row.dq8_gbs, row.q4_ms,
        row.q4_gbs, row.dq4_ms, row.dq4_gbs))
    end
    for _, v in ipairs(views) do v[2]:free() end
    h:free()
    collectgarbage()
  end
  local columns = { { "config", "config" }, { "tensor", "tensor" }, { "copy GB/s", "copy_gbs", "%.0f" } }
  for _, k in ipairs({ "q8", "dq8", "q4", "dq4" }) do
    columns[#columns + 1] = { k .. " ms", k .. "_ms", "%.3f" }
    columns[#columns + 1] = { k .. " GB/s", k .. "_gbs", "%.0f" }
  end
  bench.write(args, { title = "Quantize kernels alone", device = dev, dtype = "bf16",
    reference = "a copy (clone) of the same tensor in the same run", kernels = out, rows = out, columns = columns })
end

if args.kernels then
  kernels_bench()
  return
end

local results = {}
for _, name in ipairs(args.configs) do
  local cfg = assert(CONFIGS[name], "unknown config " .. name)
  cfg.device, cfg.dtype = dev, "bf16"
  moe.manual_seed(1234)
  local layer = factory(cfg)
  local x = moe.randn({ cfg.T, cfg.d_model }, { dtype = "bf16", device = dev }):requires_grad_(true)
  local gy = moe.randn({ cfg.T, cfg.d_model }, { dtype = "bf16", device = dev })
  local ref
  step(layer, x, gy, 0) -- warm-up: cuBLAS workspaces and the allocator's pools
  local modes, by_bits = { 0, 8, 4 }, {}
  for _, bits in ipairs(modes) do
    zero(layer, x)
    collectgarbage()
    sync()
    if cuda then moe.reset_peak_memory_stats(dev) end
    local base = moe.memory_stats(dev).allocated
    local saved = step(layer, x, gy, bits)
    sync()
    local peak = moe.memory_stats(dev).peak_allocated - base
    local g = grads(layer, x)
    local errs = {}
    if bits == 0 then ref = g else
      for i = 1, #g do errs[i] = rel(g[i], ref[i]) end
    end
    if bits ~= 0 then for _, t in ipairs(g) do t:free() end end
    step(layer, x, gy, bits) -- warm-up
    local res = { config = name, bits = bits, T = cfg.T, d_model = cfg.d_model, d_ff = cfg.d_ff,
                  experts = cfg.experts, top_k = cfg.top_k, saved_mb = saved / MiB,
                  peak_mb = peak / MiB, grad_err = errs, times = {}, fwd = {}, bwd = {} }
    by_bits[bits] = res
    results[#results + 1] = res
  end
  -- timed with the modes interleaved (off, 8, 4, off, 8, 4, ...): a drift
  -- of the GPU's clocks over the run lands on every mode alike
  bench.cooldown(args.cooldown, dev) -- idle first when cooldown= is set
  for r = 1, args.repeats do
    for _, bits in ipairs(modes) do
      local res = by_bits[bits]
      zero(layer, x)
      collectgarbage()
      sync()
      local _, tf, tb = step(layer, x, gy, bits)
      res.times[r] = tf + tb
      res.fwd[r], res.bwd[r] = tf, tb
    end
  end
  local off = by_bits[0]
  for _, bits in ipairs(modes) do
    local res = by_bits[bits]
    res.step_ms, res.fwd_ms, res.bwd_ms = median(res.times) * 1e3, median(res.fwd) * 1e3, median(res.bwd) * 1e3
    res.times, res.fwd, res.bwd = nil, nil, nil
  end
  for _, bits in ipairs(modes) do
    local res = by_bits[bits]
    res.overhead = res.step_ms / off.step_ms - 1
    res.saved_ratio = off.saved_mb / res.saved_mb
    local es = {}
    for i, e in ipairs(res.grad_err) do es[i] = string.format("%.4f", e) end
    print(string.format("%-8s bits=%d saved %9.1f MiB (%.2fx less) peak %9.1f MiB step %8.2f ms "
      .. "(%+.1f%%; fwd %.2f bwd %.2f) grad rel err [%s]", name, bits, res.saved_mb, res.saved_ratio,
      res.peak_mb, res.step_ms, 100 * res.overhead, res.fwd_ms, res.bwd_ms, table.concat(es, ", ")))
  end
  for _, t in ipairs(ref) do t:free() end
  zero(layer, x)
  x:free(); gy:free()
  for _, p in ipairs(layer:parameters()) do p:free() end
  layer = nil -- luacheck: ignore
  collectgarbage()
end

local rows = {}
for _, r in ipairs(results) do
  rows[#rows + 1] = { config = r.config, bits = r.bits, T = r.T, d_model = r.d_model, d_ff = r.d_ff,
    experts = r.experts, top_k = r.top_k, saved_mib = r.saved_mb, saved_ratio = r.saved_ratio, peak_mib = r.peak_mb,
    step_ms = r.step_ms, overhead = r.overhead, fwd_ms = r.fwd_ms, bwd_ms = r.bwd_ms,
    grad_rel_err = bench.list(r.grad_err) }
end
bench.write(args, {
  title = "Quantized saved activations: memory and time of an MoE expert layer",
  device = dev, reference = "the same layer with quantization off (bits = 0) in the same run",
  layer = layer_name, dtype = "bf16", grad_order = "x, then layer:parameters()",
  timing = bench.method(dev) .. ", modes interleaved, medians",
  MOE_GLU_QFUSED = os.getenv("MOE_GLU_QFUSED") or "",
  results = rows,
  columns = { { "config", "config" }, { "bits", "bits" }, { "saved MiB", "saved_mib", "%.1f" },
              { "x less", "saved_ratio", "%.2f" }, { "peak MiB", "peak_mib", "%.1f" },
              { "step ms", "step_ms", "%.2f" },
              { "overhead", function(r) return ("%+.1f%%"):format(100 * r.overhead) end },
              { "fwd ms", "fwd_ms", "%.2f" }, { "bwd ms", "bwd_ms", "%.2f" } },
})
