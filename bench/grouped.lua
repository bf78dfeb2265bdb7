--[[
bench/grouped.lua - times moe.ops.grouped_mm / grouped_mm_wgrad on CUDA at
the GEMM shapes of the GLU expert MLP of the three benchmark configs (T = 16384
tokens, random top-k routing, bf16), for each grouped backend ("loop",
"cublas_grouped", "streams", "auto") and for the same GEMMs done densely (one group
holding every row: the dense bf16 GEMM rate of this run). The same shapes
and group sizes run with torch._grouped_mm in bench/grouped_torch.py, which
reads this script's JSON and writes bench/results/grouped.{json,md}.

  moe-lua bench/grouped.lua [json=FILE] [repeats=7] [configs=mixtral,olmoe,qwen3]
      [backends=loop,cublas_grouped,streams,auto] [tag=TEXT] [dense=true]

backends= also takes "wgmma": the offsets as a CUDA tensor, which sends the
products to moe-lua's own sm_90a grouped GEMM (what the GLU experts' grouped
path runs on an H100 or H200). It is not in the default list, which predates it.

(backends= times only those backends, tag= appends TEXT to their labels,
e.g. for a run with MOE_GROUPED_STREAMS=8; dense=false skips the dense row.)

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

bench/grouped_check.lua checks every backend (against the CPU on a small
problem, against "loop" at full size). Timing (bench/lib.lua): CUDA events
around each call after a warm-up; the median of `repeats` samples.
]]
local moe = require "moe"
local bench = dofile((arg[0]:match("^(.*)/") or ".") .. "/lib.lua")

local args = bench.config { repeats = 7, warmup = 2, configs = { "mixtral", "olmoe", "qwen3" },
  backends = { "loop", "cublas_grouped", "streams", "auto" }, tag = "", dense = true }
local tag = args.tag ~= "" and (" " .. args.tag) or ""

assert(moe.cuda.is_available(), "bench/grouped.lua needs a CUDA GPU")

local P = dofile((arg[0]:match("^(.*)/") or ".") .. "/grouped_problem.lua")
local CONFIGS, T, OPS = P.CONFIGS, P.T, P.OPS
local route, ops, operands, free_all = P.route, P.ops, P.operands, P.free_all
local TIMED = args.backends
local wanted = {}
for _, name in ipairs(args.configs) do wanted[name] = true end

local function time(f)
  return (bench.time(f, { device = "cuda", repeats = args.repeats, warmup = args.warmup,
                          cooldown = args.cooldown }))
end

local results = {}

for _, c in ipairs(CONFIGS) do
  if wanted[c.name] then
    local offs, counts = route(c.E, c.k, T, 1234)
    local R = offs[#offs]
    local o = operands(R, c.E, c.d, c.f, "cuda")
    local total = 18 * T * c.k * c.d * c.f

    local function run(label, operand_set, offsets)
      local fs = ops(operand_set, offsets)
      local per = {}
      for _, op in ipairs(OPS) do
        local f = fs[op]
        per[op] = time(function() f():free() end) * 1e3
      end
      local chain = time(function()
        for _, op in ipairs(OPS) do fs[op]():free() end
      end) * 1e3
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
      if b == "wgmma" then -- the sm_90a kernel: the offsets on the device, no host sync
        local dev = moe.tensor(offs, { dtype = "i64" }):to("cuda")
        run("moe " .. b .. tag, o, dev)
        dev:free()
      else
        run("moe " .. b .. tag, o, offs)
      end
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

local configs = {}
for _, c in ipairs(CONFIGS) do
  if c.counts then
    configs[#configs + 1] = { name = c.name, d = c.d, f = c.f, E = c.E, k = c.k, T = T, R = c.R,
                              counts = c.counts }
  end
end
local rows = {}
for _, r in ipairs(results) do
  local row = { config = r.config, impl = r.impl, ms = r.ms, tflops = r.tflops }
  for _, op in ipairs(OPS) do row[op] = r.ops[op] end
  rows[#rows + 1] = row
end
local columns = { { "config", "config" }, { "impl", "impl" }, { "chain ms", "ms", "%.3f" },
                  { "TFLOP/s", "tflops", "%.1f" } }
for _, op in ipairs(OPS) do columns[#columns + 1] = { op .. " ms", op, "%.3f" } end
bench.write(args, {
  title = "Grouped GEMMs of the GLU expert MLP (bf16)",
  device = "cuda",
  reference = "bench/grouped_torch.py (torch._grouped_mm on the same GPU, same group sizes; it joins both)",
  T = T, configs = configs, results = results, rows = rows, columns = columns,
})
