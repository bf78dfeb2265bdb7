--[[
bench/grouped.lua - times moe.ops.grouped_mm / grouped_mm_wgrad on CUDA at
the GEMM shapes of the GLU expert MLP of issue 4's three configs (T = 16384
tokens, random top-k routing, bf16), for each grouped backend ("loop",
"cublas_grouped", "streams", "auto") and for the same GEMMs done densely (one group
holding every row: the dense bf16 GEMM rate of this run). The same shapes
and group sizes run with torch._grouped_mm in bench/grouped_torch.py, which
reads this script's JSON and writes bench/results/grouped.{json,md}.

  moe-lua bench/grouped.lua [--json FILE] [--repeats N] [--configs a,b]
      [--backends a,b] [--tag TEXT] [--no-dense]

(--backends times only those backends, --tag appends TEXT to their labels,
e.g. for a run with MOE_GROUPED_STREAMS=8; --no-dense skips the dense row.)

The six GEMMs of the expert MLP (R = T k rows in expert order, w13 the
fused (E, d, 2f) gate and up projections, w2 (E, f, d)):
  fwd_13:   h13 (R, 2f) = x @ w13[e]          grouped_mm(x, w13)
  fwd_2:    y (R, d)    = h @ w2[e]           grouped_mm(h, w2)
  dgrad_2:  dh (R, f)   = dy @ w2[e]^T        grouped_mm(dy, w2, {trans_w})
  wgrad_2:  dw2 (E,f,d) = h_e^T dy_e          grouped_mm_wgrad(h, dy)
  dgrad_13: dx (R, d)   = dh13 @ w13[e]^T     grouped_mm(dh13, w13, {trans_w})
  wgrad_13: dw13        = x_e^T dh13_e        grouped_mm_wgrad(x, dh13)
Their FLOPs add up to 18 T k d f, the issue's count. "chain" runs all six
per call. Routing: each token picks k distinct experts uniformly (Lua's
math.random seeded with 1234), the counts give the offsets.

Checks before timing: on a small problem with each config's E every
backend's six results against the CPU (same bf16 values, f32 math); at full
size fwd_13 and wgrad_13 of every backend against "loop".
Timing: CUDA events around `iters` calls after a warm-up; the median of
`repeats` samples per call.
]]
local moe = require "moe"

local args = { json = nil, repeats = 7, configs = nil, backends = nil, tag = "", dense = true }
do
  local i = 1
  while i <= #arg do
    local a = arg[i]
    if a == "--json" then args.json = arg[i + 1]; i = i + 2
    elseif a == "--repeats" then args.repeats = tonumber(arg[i + 1]); i = i + 2
    elseif a == "--configs" then args.configs = arg[i + 1]; i = i + 2
    elseif a == "--backends" then args.backends = arg[i + 1]; i = i + 2
    elseif a == "--tag" then args.tag = " " .. arg[i + 1]; i = i + 2
    elseif a == "--no-dense" then args.dense = false; i = i + 1
    else error("unknown argument " .. a) end
  end
end

assert(moe.cuda.is_available(), "bench/grouped.lua needs a CUDA GPU")

local CONFIGS = {
  { name = "mixtral", d = 4096, f = 14336, E = 8, k = 2 },
  { name = "olmoe", d = 2048, f = 1024, E = 64, k = 8 },
  { name = "qwen3", d = 2048, f = 768, E = 128, k = 8 },
}
local T = 16384
local BACKENDS = { "loop", "cublas_grouped", "streams", "auto" }
local TIMED = BACKENDS
if args.backends then
  TIMED = {}
  for b in args.backends:gmatch("[^,]+") do TIMED[#TIMED + 1] = b end
end
local OPS = { "fwd_13", "fwd_2", "dgrad_2", "wgrad_2", "dgrad_13", "wgrad_13" }

local function median(t)
  table.sort(t)
  local n = #t
  if n % 2 == 1 then return t[(n + 1) // 2] end
  return (t[n // 2] + t[n // 2 + 1]) / 2
end

local function time(f, iters, repeats)
  for _ = 1, 2 do f() end
  moe.cuda.synchronize()
  local e0, e1 = moe.Event("cuda"), moe.Event("cuda")
  local samples = {}
  for r = 1, repeats do
    e0:record()
    for _ = 1, iters do f() end
    e1:record(); e1:synchronize()
    samples[r] = e0:elapsed(e1) / 1e3 / iters
  end
  e0:free(); e1:free()
  return median(samples)
end

-- Group sizes of random top-k routing: each of T tokens picks k distinct experts.
local function route(E, k, tokens, seed)
  math.randomseed(seed)
  local counts = {}
  for e = 1, E do counts[e] = 0 end
  local pick = {}
  for _ = 1, tokens do
    for j = 1, k do
      local e
      repeat
        e = math.random(E)
        local dup = false
        for i = 1, j - 1 do dup = dup or pick[i] == e end
      until not dup
      pick[j] = e
      counts[e] = counts[e] + 1
    end
  end
  local offs = { 0 }
  for e = 1, E do offs[e + 1] = offs[e] + counts[e] end
  return offs, counts
end

-- The six GEMMs over operands o (a table of tensors) and offsets offs, as
-- functions returning their result.
local function ops(o, offs)
  return {
    fwd_13 = function() return moe.ops.grouped_mm(o.x, o.w13, offs) end,
    fwd_2 = function() return moe.ops.grouped_mm(o.h, o.w2, offs) end,
    dgrad_2 = function() return moe.ops.grouped_mm(o.dy, o.w2, offs, { trans_w = true }) end,
    wgrad_2 = function() return moe.ops.grouped_mm_wgrad(o.h, o.dy, offs) end,
    dgrad_13 = function() return moe.ops.grouped_mm(o.dh13, o.w13, offs, { trans_w = true }) end,
    wgrad_13 = function() return moe.ops.grouped_mm_wgrad(o.x, o.dh13, offs) end,
  }
end

-- bf16 operands of a config on `device` for R rows and G groups.
local function operands(R, G, d, f, device)
  local function randn(shape, scale)
    local t = moe.randn(shape, { dtype = "f32", device = device })
    local s = (t * scale):to("bf16")
    t:free()
    return s
  end
  return {
    x = randn({ R, d }, 1), h = randn({ R, f }, 1), dy = randn({ R, d }, 1),
    dh13 = randn({ R, 2 * f }, 1),
    w13 = randn({ G, d, 2 * f }, 1 / math.sqrt(d)), w2 = randn({ G, f, d }, 1 / math.sqrt(f)),
  }
end

local function free_all(o) for _, t in pairs(o) do t:free() end end

-- max |a - b| / max |b|, computed on b's device in f32
local function rel_err(a, b)
  local af, bf = a:to("f32", b.device), b:to("f32")
  local diff = (af - bf):abs():max():item()
  local big = bf:abs():max():item()
  af:free(); bf:free()
  return diff / math.max(big, 1e-30)
end

local info = moe.build_info()
local gpu = info.gpus[1] or {}
print(string.format("device %s, cuda runtime %d, cublas %d, moe-lua %s", gpu.name or "?",
  info.cuda_runtime, info.cublas, info.version))

local validation, results = {}, {}

for _, c in ipairs(CONFIGS) do
  if not args.configs or args.configs:find(c.name, 1, true) then
    -- small check against the CPU: same E, 32 tokens per expert on average, odd d and f
    do
      local offs = route(c.E, c.k, 32 * c.E // c.k, 99)
      local R, d, f = offs[#offs], 72, 40
      local g = operands(R, c.E, d, f, "cuda")
      local cpu = {}
      for n, t in pairs(g) do cpu[n] = t:to("f32", "cpu") end
      local ref = ops(cpu, offs)
      for _, b in ipairs(BACKENDS) do
        moe.ops.grouped_backend(b)
        local got = ops(g, offs)
        for _, op in ipairs(OPS) do
          local r, x = ref[op](), got[op]()
          -- bf16 output rounding (2^-8 relative) dominates; f32 sums in another order add little
          local e = rel_err(x, r)
          local ok = e < 2 ^ -6
          validation[#validation + 1] = { config = c.name, backend = b, op = op, rel_err = e, ok = ok }
          if not ok then print(string.format("validate %s %s %s: %.2e FAILED", c.name, b, op, e)) end
          assert(ok, "validation failed")
          r:free(); x:free()
        end
      end
      free_all(g); free_all(cpu)
      print(string.format("validate %-8s small problem vs CPU: ok (%d backends x 6 GEMMs)", c.name,
        #BACKENDS))
    end

    local offs, counts = route(c.E, c.k, T, 1234)
    local R = offs[#offs]
    local o = operands(R, c.E, c.d, c.f, "cuda")
    local total = 18 * T * c.k * c.d * c.f

    -- full size: every backend against loop
    do
      moe.ops.grouped_backend("loop")
      local base = ops(o, offs)
      local ref = { fwd_13 = base.fwd_13(), wgrad_13 = base.wgrad_13() }
      for _, b in ipairs({ "cublas_grouped", "streams", "auto" }) do
        moe.ops.grouped_backend(b)
        local got = ops(o, offs)
        for op, r in pairs(ref) do
          local x = got[op]()
          local e = rel_err(x, r)
          local ok = e < 2 ^ -6
          validation[#validation + 1] = { config = c.name, backend = b, op = op .. " (full size vs loop)",
                                          rel_err = e, ok = ok }
          print(string.format("validate %-8s %-15s %-9s full size vs loop: %.2e %s", c.name, b, op, e,
            ok and "ok" or "FAILED"))
          assert(ok, "validation failed")
          x:free()
        end
      end
      for _, r in pairs(ref) do r:free() end
    end

    local function run(label, operand_set, offsets)
      local fs = ops(operand_set, offsets)
      local per = {}
      for _, op in ipairs(OPS) do
        local f = fs[op]
        per[op] = time(function() f():free() end, 1, args.repeats) * 1e3
      end
      local chain = time(function()
        for _, op in ipairs(OPS) do fs[op]():free() end
      end, 1, args.repeats) * 1e3
      local r = { config = c.name, impl = label, ms = chain, tflops = total / (chain / 1e3) / 1e12,
                  ops = per }
      results[#results + 1] = r
      print(string.format("%-8s %-22s chain %9.3f ms %7.1f TFLOP/s  | %s", c.name, label, chain, r.tflops,
        table.concat((function()
          local s = {}
          for _, op in ipairs(OPS) do s[#s + 1] = string.format("%s %.3f", op, per[op]) end
          return s
        end)(), " ")))
      collectgarbage()
    end

    for _, b in ipairs(TIMED) do
      moe.ops.grouped_backend(b)
      run("moe " .. b .. args.tag, o, offs)
    end
    -- dense: the same GEMMs with one group of all R rows (dense cuBLASLt GEMMs)
    if args.dense then
      local w13, w2 = o.w13, o.w2
      o.w13, o.w2 = w13:narrow(0, 0, 1), w2:narrow(0, 0, 1)
      moe.ops.grouped_backend("loop")
      run("moe dense (1 group)", o, { 0, R })
      o.w13:free(); o.w2:free()
      o.w13, o.w2 = w13, w2
    end
    moe.ops.grouped_backend("auto")
    c.counts = counts
    c.R = R
    free_all(o)
    collectgarbage()
    moe.empty_cache()
  end
end

if args.json then
  local function list(t, fmt)
    local s = {}
    for i, v in ipairs(t) do s[i] = string.format(fmt, v) end
    return table.concat(s, ", ")
  end
  local cparts = {}
  for _, c in ipairs(CONFIGS) do
    if c.counts then
      cparts[#cparts + 1] = string.format(
        '{"name": "%s", "d": %d, "f": %d, "E": %d, "k": %d, "T": %d, "R": %d, "counts": [%s]}',
        c.name, c.d, c.f, c.E, c.k, T, c.R, list(c.counts, "%d"))
    end
  end
  local rparts = {}
  for _, r in ipairs(results) do
    local ps = {}
    for _, op in ipairs(OPS) do ps[#ps + 1] = string.format('"%s": %.5f', op, r.ops[op]) end
    rparts[#rparts + 1] = string.format('{"config": "%s", "impl": "%s", "ms": %.5f, "tflops": %.2f, "ops": {%s}}',
      r.config, r.impl, r.ms, r.tflops, table.concat(ps, ", "))
  end
  local vparts = {}
  for _, v in ipairs(validation) do
    vparts[#vparts + 1] = string.format('{"config": "%s", "backend": "%s", "op": "%s", "rel_err": %.3e, "ok": %s}',
      v.config, v.backend, v.op, v.rel_err, tostring(v.ok))
  end
  local f = assert(io.open(args.json, "w"))
  f:write(string.format(
    '{"tool": "moe-lua %s", "device": "%s", "cuda_runtime": %d, "cuda_driver": %d, "cublas": %d,\n' ..
    ' "date": "%s", "repeats": %d, "T": %d,\n "configs": [%s],\n "validation": [%s],\n "results": [%s]}\n',
    info.version, gpu.name or "?", info.cuda_runtime, info.cuda_driver, info.cublas,
    os.date("!%Y-%m-%dT%H:%M:%SZ"), args.repeats, T, table.concat(cparts, ",\n  "),
    table.concat(vparts, ",\n  "), table.concat(rparts, ",\n  ")))
  f:close()
  print("wrote " .. args.json)
end
