--[[
bench/moe_mlp_series.lua - one expert-MLP layer's step, timed step by step:
the SwiGLU experts forward + backward of bench/moe_mlp.lua (the same data:
seed 1234, weights N(0, 0.02), top-k of softmax(random logits), dy N(0, 1)),
each implementation in turn (order=), `steps` consecutive steps each after
one untimed step, every step printed with its CUDA-event time and its host
time (the host clock around the step and a synchronise). What a median
hides: a GPU at its power cap lowers its clocks part way through a series,
so two paths timed one after the other can differ by the cap alone.

  moe-lua bench/moe_mlp_series.lua [order=grouped,sparse,grouped,sparse] [steps=12]
      [d=7168] [f=2048] [E=256] [k=8] [T=8192]   (the DeepSeek-V3-like layer by default)
      [json=FILE]
]]
local moe = require "moe"
local bench = dofile((arg[0]:match("^(.*)/") or ".") .. "/lib.lua")

local o = bench.config { order = { "grouped", "sparse", "grouped", "sparse" }, steps = 12,
  d = 7168, f = 2048, E = 256, k = 8, T = 8192, json = "" }
assert(moe.cuda and moe.cuda.is_available(), "bench/moe_mlp_series.lua needs a CUDA GPU")
moe.manual_seed(1234)
local to = { dtype = "bf16", device = "cuda" }
local t = {}
t.x = moe.randn({ o.T, o.d }, to):requires_grad_(true)
t.w1 = (moe.randn({ o.E, o.d, o.f }, to) * 0.02):detach():requires_grad_(true)
t.w3 = (moe.randn({ o.E, o.d, o.f }, to) * 0.02):detach():requires_grad_(true)
t.w2 = (moe.randn({ o.E, o.f, o.d }, to) * 0.02):detach():requires_grad_(true)
local logits = moe.randn({ o.T, o.E }, { dtype = "f32", device = "cuda" })
local g, ids = moe.topk(moe.softmax(logits, -1), o.k, -1)
t.gates = g:to("cuda", "bf16"):detach():requires_grad_(true)
t.dy = moe.randn({ o.T, o.d }, to)
g:free(); logits:free()

local function step(impl)
  local popts = impl == "sparse" and { block_size = 128, ffn_hidden = o.f } or nil
  local plan = moe.ops.routing_plan(ids, o.E, popts)
  local out = moe.ops.glu_experts(t.x, t.w1, t.w3, t.w2, plan, t.gates, { impl = impl })
  out:backward(t.dy)
  out:free(); plan:free()
  for _, p in ipairs({ t.x, t.w1, t.w3, t.w2, t.gates }) do p.grad = nil end
end

local runs = {}
for _, impl in ipairs(o.order) do
  step(impl)
  bench.sync("cuda")
  local ev, host = {}, {}
  for i = 1, o.steps do
    local t0 = moe.clock()
    ev[i] = bench.elapsed(function() step(impl) end, "cuda") * 1e3
    bench.sync("cuda")
    host[i] = (moe.clock() - t0) * 1e3
  end
  local function fmt(list)
    local s = {}
    for i, v in ipairs(list) do s[i] = ("%.1f"):format(v) end
    return table.concat(s, " ")
  end
  print(impl, "events:", fmt(ev))
  print(impl, "host:  ", fmt(host))
  runs[#runs + 1] = { impl = impl, events_ms = bench.list(ev), host_ms = bench.list(host),
    median_ms = bench.median(ev), min_ms = math.min(table.unpack(ev)), max_ms = math.max(table.unpack(ev)) }
end
bench.write({ json = o.json }, { title = "Expert-MLP steps one by one (bench/moe_mlp_series.lua)",
  shape = { d = o.d, f = o.f, E = o.E, k = o.k, T = o.T }, steps = o.steps, runs = runs, rows = runs,
  columns = { { "impl", "impl" }, { "median ms", "median_ms", "%.1f" }, { "min ms", "min_ms", "%.1f" },
    { "max ms", "max_ms", "%.1f" } } })
