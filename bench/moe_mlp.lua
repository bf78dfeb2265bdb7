--[[
bench/moe_mlp.lua - the MoE MLP benchmark, moe-lua side: the MoE expert MLP
with SwiGLU (GLU) experts, forward + backward, bf16, one GPU, T = 16384
tokens, top-k routing from random logits (top-k of softmax), for the configs
mixtral (d 4096, f 14336, E 8, k 2), olmoe (2048, 1024, 64, 8) and qwen3
(2048, 768, 128, 8). One step = routing plan from the ids (its one host
sync, or none) + permute + 3 expert GEMMs + combine, forward and backward with every
weight gradient and the gradients of x and the gates. Implementations:
  grouped      moe.ops.glu_experts, impl "grouped" (grouped GEMM: on an sm_90a GPU our
               own kernel, offsets read on the device)
  grouped_cublas  the same on cuBLAS (grouped backend loop or streams, as auto's
               rule picks for host offsets), offsets copied to the host
  sparse       moe.ops.glu_experts, impl "sparse" (block-sparse, b = 128)
  lua_grouped  the GLU composed in Lua: parallel_linear x2, silu * mul,
               parallel_linear with scatter (grouped)
  lua_ops      the same GLU from the ops parallel_linear fuses, each its own
               autograd node: permute, grouped_mm x3, combine (on request)
  auto         what a dMoE layer's mlp_impl = "auto" runs: the autotuner
               (moe/experts/autotune.lua) measures grouped and sparse on its
               synthetic even routing, then the pick is timed here (the row
               names it: "auto:sparse"; "pick_ms" holds the tuner's figures)
plus the dense bf16 GEMM rate (moe.matmul 8192^3) in the same run.
bench/moe_mlp_torch.py times PyTorch on the same configs and
bench/moe_mlp_report.py joins both.

  moe-lua bench/moe_mlp.lua [json=FILE] [repeats=10] [budget=SECONDS]
                            [configs=mixtral,olmoe,qwen3]
                            [impls=grouped,grouped_cublas,sparse,lua_grouped,auto,lua_ops]
                            (configs also: qwen3_t4k, qwen3_t64k: qwen3 at T = 4096 and
                            65536; deepseek: d 7168, f 2048, E 256, k 8, T = 8192;
                            llama4: d 5120, f 8192, E 16, k 1)
                            [smoke=true] [memory_optimized=true]

memory_optimized=true passes the option to glu_experts (the grouped, sparse and
auto rows): the backward's weight gradients read x's rows in place where the
kernels gather.

smoke=true runs the same code on tiny shapes (T = 128, d / f / E scaled
down), on the CPU when there is no GPU: a check of the script, not a result.

Timing (bench/lib.lua): 2 warm-up steps, then `repeats` steps each between
two CUDA events (the host clock on the CPU), the median. A step that takes more than a second cuts the
repeats to 3; once `budget` seconds have passed the remaining cases are
skipped (written with "skipped": true). TFLOP/s count 18 T k d f model
FLOPs (3 GEMMs forward, 6 backward, 2 T k d f each). Peak extra memory: the
allocator's peak during one step minus what was allocated before it
(weights, x, gates, dy; no gradients held).
]]
local moe = require "moe"

local bench = dofile((arg[0]:match("^(.*)/") or ".") .. "/lib.lua")

local args = bench.config { repeats = 10, warmup = 2, budget = 80.0, smoke = false, memory_optimized = false,
  configs = { "mixtral", "olmoe", "qwen3" },
  impls = { "grouped", "grouped_cublas", "sparse", "lua_grouped", "auto" } }

local smoke = args.smoke
local dev = moe.cuda.is_available() and "cuda" or "cpu"
assert(dev == "cuda" or smoke, "bench/moe_mlp.lua needs a CUDA GPU (or smoke=true)")

local T = smoke and 128 or 16384
local CONFIGS = {
  { name = "mixtral", d = 4096, f = 14336, E = 8, k = 2 },
  { name = "olmoe", d = 2048, f = 1024, E = 64, k = 8 },
  { name = "qwen3", d = 2048, f = 768, E = 128, k = 8 },
  -- on request (configs=): how qwen3 scales with tokens, and a DeepSeek-V3-like layer
  { name = "qwen3_t4k", d = 2048, f = 768, E = 128, k = 8, T = 4096 },
  { name = "qwen3_t64k", d = 2048, f = 768, E = 128, k = 8, T = 65536 },
  { name = "deepseek", d = 7168, f = 2048, E = 256, k = 8, T = 8192 },
  -- top-1 routing (Llama-4-Scout-like experts): the output rows are written where they go
  { name = "llama4", d = 5120, f = 8192, E = 16, k = 1 },
}
if smoke then
  for _, c in ipairs(CONFIGS) do
    c.d, c.f, c.E, c.T = c.d // 64, 128, math.max(c.k, c.E // 8), nil
  end
end

-- milliseconds of one call of fn: CUDA events on the GPU, the host clock on the CPU (smoke runs)
local function sync() bench.sync(dev) end
local function timed(fn) return bench.elapsed(fn, dev) * 1e3 end

local function set(list)
  local t = {}
  for _, w in ipairs(list) do t[w] = true end
  return t
end
local want_cfg, want_impl = set(args.configs), set(args.impls)
local median = bench.median

local clock0 = moe.clock()
local function elapsed() return moe.clock() - clock0 end

-- ------------------------------------------------------------ dense rate

local dense = {}
do
  local n = smoke and 256 or 8192
  local a = moe.randn({ n, n }, { dtype = "bf16", device = dev })
  local b = moe.randn({ n, n }, { dtype = "bf16", device = dev })
  local sec = bench.time(function() moe.matmul(a, b):free() end,
    { device = dev, iters = 5, repeats = 10, warmup = 3, cooldown = args.cooldown })
  a:free(); b:free()
  dense.n = n
  dense.ms = sec * 1e3
  dense.tflops = 2 * n ^ 3 / (dense.ms / 1e3) / 1e12
  print(string.format("dense bf16 GEMM %d^3: %.3f ms, %.1f TFLOP/s", n, dense.ms, dense.tflops))
end

-- ------------------------------------------------------------ the step

local function glu_lua(x, w1, w3, w2, plan, gates)
  local h1 = moe.ops.parallel_linear(x, w1, plan, { gather = true })
  local h3 = moe.ops.parallel_linear(x, w3, plan, { gather = true })
  local a = moe.silu(h1) * h3
  h1:free(); h3:free()
  local out = moe.ops.parallel_linear(a, w2, plan, { scatter = true, gates = gates })
  a:free()
  return out
end

-- the same from the ops parallel_linear fuses: the permuted tokens and the
-- product's rows are saved by their nodes
local function glu_ops(x, w1, w3, w2, plan, gates)
  local xs = moe.ops.permute(x, plan)
  local h1 = moe.ops.grouped_mm(xs, w1, plan)
  local h3 = moe.ops.grouped_mm(xs, w3, plan)
  xs:free()
  local a = moe.silu(h1) * h3
  h1:free(); h3:free()
  local rows = moe.ops.grouped_mm(a, w2, plan)
  a:free()
  local out = moe.ops.combine(rows, plan, gates)
  rows:free()
  return out
end

-- grouped_cublas: the grouped path on cuBLAS with the offsets copied to the host, the
-- backend auto's rule picks for host offsets (loop: few or large groups; else streams)
local function cublas_backend(c, tokens)
  return (c.E <= 16 or tokens * c.k / c.E >= 2048) and "loop" or "streams"
end

local function make_step(c, impl, t, tokens)
  local popts = impl == "sparse" and { block_size = 128, ffn_hidden = c.f } or nil
  local backend = impl == "grouped_cublas" and cublas_backend(c, tokens) or "auto"
  return function()
    local plan = moe.ops.routing_plan(t.ids, c.E, popts)
    local out
    moe.ops.grouped_backend(backend)
    if impl == "lua_grouped" then
      out = glu_lua(t.x, t.w1, t.w3, t.w2, plan, t.gates)
    elseif impl == "lua_ops" then
      out = glu_ops(t.x, t.w1, t.w3, t.w2, plan, t.gates)
    else
      out = moe.ops.glu_experts(t.x, t.w1, t.w3, t.w2, plan, t.gates,
        { impl = impl == "grouped_cublas" and "grouped" or impl, memory_optimized = args.memory_optimized })
    end
    out:backward(t.dy)
    out:free()
    plan:free()
    moe.ops.grouped_backend("auto")
    for _, p in ipairs({ t.x, t.w1, t.w3, t.w2, t.gates }) do p.grad = nil end
  end
end

-- The GLU experts as the autotuner sees a layer's experts.GLU, over the benchmark's
-- weights (the tuner swaps in detached handles while it measures).
local GLU_VIEW = { __call = function(self, x, plan, gates)
  return moe.ops.glu_experts(x, rawget(self, "w1"), rawget(self, "w3"), rawget(self, "w2"), plan, gates,
    { impl = self.impl, memory_optimized = self.memory_optimized })
end }
local function glu_view(c, t)
  return setmetatable({ __name = "GLUExperts", act_name = "silu", num_experts = c.E, d_model = c.d, d_ff = c.f,
    memory_optimized = args.memory_optimized, impl = "grouped", w1 = t.w1, w3 = t.w3, w2 = t.w2,
    named_parameters = function(self)
      return { { "w1", rawget(self, "w1") }, { "w3", rawget(self, "w3") }, { "w2", rawget(self, "w2") } }
    end }, GLU_VIEW)
end
local autotune = require "moe.experts.autotune"
autotune.mode = "measure" -- the auto row measures on the CPU too (smoke runs)

local results = {}
local impl_order = { "grouped", "grouped_cublas", "sparse", "lua_grouped", "auto", "lua_ops" }
for _, c in ipairs(CONFIGS) do
  if want_cfg[c.name] then
    local T = c.T or T -- luacheck: ignore 421 (this config's tokens)
    moe.manual_seed(1234)
    local o = { dtype = "bf16", device = dev }
    local t = {}
    t.x = moe.randn({ T, c.d }, o):requires_grad_(true)
    -- weights ~ N(0, 0.02) as an initialised model; dy ~ N(0, 1)
    t.w1 = (moe.randn({ c.E, c.d, c.f }, o) * 0.02):detach():requires_grad_(true)
    t.w3 = (moe.randn({ c.E, c.d, c.f }, o) * 0.02):detach():requires_grad_(true)
    t.w2 = (moe.randn({ c.E, c.f, c.d }, o) * 0.02):detach():requires_grad_(true)
    local logits = moe.randn({ T, c.E }, { dtype = "f32", device = dev })
    local g, ids = moe.topk(moe.softmax(logits, -1), c.k, -1)
    t.gates = g:to(dev, "bf16"):detach():requires_grad_(true)
    t.ids = ids
    t.dy = moe.randn({ T, c.d }, o)
    g:free(); logits:free()
    local flops = 18 * T * c.k * c.d * c.f
    for _, impl in ipairs(impl_order) do
      if want_impl[impl] then
        local r = { config = c.name, impl = impl, d = c.d, f = c.f, E = c.E, k = c.k, T = T,
                    flops = flops }
        if elapsed() > args.budget then
          r.skipped = true
          r.error = "time budget exhausted"
        else
          local ok, err = pcall(function()
            local run = impl
            if impl == "auto" then
              local pick, m = autotune.pick(glu_view(c, t), { T = T, k = c.k, block_size = 128,
                rule = autotune.rule(dev == "cuda", c.E, c.f, 128, autotune.own(dev, "bf16", c.E, c.d, c.f)) })
              run, r.impl, r.pick_ms, r.pick_T = pick, "auto:" .. pick, m and m.ms, m and m.T
            end
            local step = make_step(c, run, t, T)
            collectgarbage()
            bench.cooldown(args.cooldown, dev) -- idle first when cooldown= is set
            step() -- warm-up (cuBLAS heuristics, allocator growth)
            local first = timed(step)
            if first > 3000 then error(string.format("too slow to time: a warm step took %.0f ms", first)) end
            local reps = first > 1000 and 3 or args.repeats
            -- peak extra memory of one step
            sync()
            collectgarbage()
            local base = moe.memory_stats(dev).allocated
            moe.reset_peak_memory_stats(dev)
            step()
            sync()
            r.peak_extra_bytes = moe.memory_stats(dev).peak_allocated - base
            local s = {}
            for i = 1, reps do s[i] = timed(step) end
            r.ms = median(s)
            r.repeats = reps
            r.tflops = flops / (r.ms / 1e3) / 1e12
            r.pct_dense = 100 * r.tflops / dense.tflops
          end)
          if not ok then
            r.error = tostring(err)
            r.skipped = true
          end
        end
        results[#results + 1] = r
        if r.ms then
          print(string.format("%-8s %-12s %9.3f ms %7.1f TFLOP/s %5.1f%% of dense  peak extra %.2f GiB",
            c.name, impl, r.ms, r.tflops, r.pct_dense, r.peak_extra_bytes / 2 ^ 30))
        else
          print(string.format("%-8s %-12s skipped: %s", c.name, impl, r.error))
        end
      end
    end
    for _, v in pairs(t) do v:free() end
    collectgarbage()
    moe.empty_cache(dev)
  end
end

-- ------------------------------------------------------------ results

bench.write(args, {
  title = "MoE expert MLP (SwiGLU), forward + backward, bf16",
  device = dev,
  reference = "bench/moe_mlp_torch.py (PyTorch on the same configs; bench/moe_mlp_report.py joins both) "
    .. "and the dense bf16 GEMM rate of this run",
  dtype = "bf16", T = T, smoke = smoke,
  grouped_backend = moe.ops.grouped_backend and moe.ops.grouped_backend() or "?",
  -- MOE_BSMM_GATHER 1: the grouped and sparse paths gather token rows in the kernel instead of a
  -- permuted copy; wgrad: only the weight gradients' products do
  bsmm_gather = os.getenv("MOE_BSMM_GATHER") or "0",
  memory_optimized = args.memory_optimized, -- the glu_experts option of the grouped, sparse and auto rows
  dense = { name = ("moe.matmul bf16 %d^3"):format(dense.n), ms = dense.ms, tflops = dense.tflops },
  results = results,
  columns = { { "config", "config" }, { "impl", "impl" }, { "ms", "ms", "%.3f" }, { "TFLOP/s", "tflops", "%.1f" },
              { "% of dense", "pct_dense", "%.1f" },
              { "peak extra GiB", function(r) return r.peak_extra_bytes and r.peak_extra_bytes / 2 ^ 30 end, "%.2f" },
              { "note", "error" } },
})
