--[[
bench/ep_overlap.lua - how much of expert parallelism's all_to_all time the
chunked, pipelined exchange (layers.dMoE ep_overlap_chunks, moe/layers/ep.lua)
hides behind the local experts' compute. One dMoE layer with its experts
spread over every rank of the job (EP = world size), forward + backward:

  moe-lua launch -n 2 bench/ep_overlap.lua [json=bench/results/dist/ep_overlap.json]
  OMP_NUM_THREADS=1 moe-lua launch -n 2 bench/ep_overlap.lua device=cpu size=small   (a smoke run on the CPU)

size=125m (default): the 125M dMoE of the MegaBlocks ladder, one layer: d 768,
ffn 3072, 64 experts top-1, 8 sequences of 1024 tokens per rank, bf16, the
experts' path mlp_impl=auto (grouped under EP on CUDA). size=small: d 64, ffn
128, 8 experts top-1, 2 x 64 tokens per rank, f32. Any of d, ffn, experts,
top_k, batch, seq, dtype, impl overrides the size's value.

What is timed (each rank times its own calls; the table shows the largest
median over the ranks, since the exchanges tie the ranks together):
  layer C      the whole layer (router, counts exchange, permute, the
               exchanges and experts, combine) forward + backward with
               ep_overlap_chunks = C, C in chunks (default 1, 2, 4)
  a2a          the all_to_alls alone: the layer's four exchanges (dispatch
               and return, forward and backward: dist.functional.all_to_all
               of the rows the routing of this batch sends), no compute
  compute      the local experts alone, forward + backward, on the rows this
               rank receives (its local plan), no exchange
  section C    the exchanges and the experts together as the layer runs them
               with C chunks (moe/layers/ep.lua exchange_chunked; C = 1: the
               synchronous all_to_all, the experts, the all_to_all back):
               t_overlapped
  a2a C        the chunked exchanges alone (each chunk's rows sent back
               unchanged): what cutting the exchange into C pieces costs
  hidden C     (t_a2a + t_compute - t_section C) / t_a2a: the share of the
               all_to_all time hidden behind the experts (0 at C = 1, where
               nothing overlaps; below 0 when chunking costs more than it hides)
On the CPU the collectives are MPI, which moves an asynchronous exchange only
while it is waited for: nothing overlaps there, the numbers only show that
the script runs. Run it there with OMP_NUM_THREADS=1: the CPU kernels'
OpenMP threads spin after each parallel loop and, with more ranks than free
cores, starve the other rank's MPI polling (the chunked section then took
100x longer on a loaded 2-core machine).
]]
local moe = require "moe"
local layers = require "moe.layers"
local ep = require "moe.layers.ep"
local bench = dofile((arg[0]:match("^(.*)/") or ".") .. "/lib.lua")

local SIZES = {
  ["125m"] = { d = 768, ffn = 3072, experts = 64, top_k = 1, batch = 8, seq = 1024, dtype = "bf16" },
  small = { d = 64, ffn = 128, experts = 8, top_k = 1, batch = 2, seq = 64, dtype = "f32" },
}

local cfg = bench.config {
  device = "cuda", size = "125m", chunks = { 1, 2, 4 }, impl = "auto", seed = 1,
  d = 0, ffn = 0, experts = 0, top_k = 0, batch = 0, seq = 0, dtype = "",
  repeats = 10, warmup = 3,
}
local base = SIZES[cfg.size]
if not base then error("ep_overlap: size must be 125m or small, got " .. tostring(cfg.size), 0) end
for k, v in pairs(base) do
  if cfg[k] == 0 or cfg[k] == "" then cfg[k] = v end
end

local dist = moe.dist
dist.init {}
local rank, P = dist.rank(), dist.world_size()
local device = cfg.device
if device == "cuda" then
  device = dist.device()
  if not device:match("^cuda") then error("ep_overlap: no GPU for rank " .. rank .. " (device=cpu runs on the CPU)", 0) end
elseif device ~= "cpu" then
  error("ep_overlap: device must be cuda or cpu, got " .. tostring(device), 0)
end
if cfg.experts % P ~= 0 then
  error(("ep_overlap: experts=%d is not divisible by the %d ranks"):format(cfg.experts, P), 0)
end
local T = cfg.batch * cfg.seq
local timing = { device = device, repeats = cfg.repeats, warmup = cfg.warmup, cooldown = cfg.cooldown }

local function build(C)
  moe.manual_seed(cfg.seed)
  return layers.dMoE { hidden_size = cfg.d, ffn_hidden_size = cfg.ffn, num_experts = cfg.experts,
    top_k = cfg.top_k, mlp_impl = cfg.impl, dtype = cfg.dtype, device = device,
    moe_expert_model_parallelism = true, ep_overlap_chunks = C }
end

local function randn(shape)
  return moe.randn(shape):to({ dtype = cfg.dtype, device = device })
end

-- the largest value over the ranks
local function max_over_ranks(v)
  local t = moe.tensor({ v }, { dtype = "f64" })
  dist.all_reduce(t, "max")
  local r = t:item()
  t:free()
  return r
end

local function time(f) return max_over_ranks((bench.time(f, timing))) end

moe.manual_seed(100 + rank) -- each rank its own tokens
local x = moe.keep(randn({ T, cfg.d }):requires_grad_(true))
local gy = moe.keep(randn({ T, cfg.d }))

-- one forward + backward of layer on x (the gradients of the last call dropped)
local function step(layer)
  return function()
    moe.scope(function()
      layer:zero_grad()
      x.grad = nil
      layer(x):backward(gy)
      layer.aux_loss = nil
    end)
  end
end

local results, notes = {}, {}
local t = {}

-- layer C, and the exchange of C = 1 kept for the pieces
local layer1, ex1
local section_of = {}
for _, C in ipairs(cfg.chunks) do
  local layer = build(C)
  local f = step(layer)
  t["layer" .. C] = time(f)
  -- the routing the pieces below replay (this batch's): outside any scope, so
  -- that the plans outlive the call
  layer:zero_grad()
  x.grad = nil
  layer(x):backward(gy)
  layer.aux_loss = nil
  local last = layer.ep_last
  if C == 1 then
    layer1, ex1 = layer, last
  else
    section_of[C] = { layer = layer, ex = last.exchange }
  end
  if layer.ep.chunks ~= C then notes[#notes + 1] = ("%d chunks asked, %d run (one per local expert at most)")
    :format(C, layer.ep.chunks) end
end
if not layer1 then error("ep_overlap: chunks must include 1 (the reference)", 0) end

local F = dist.functional
local send, recv = ex1.send, ex1.recv
local R, M = 0, 0
for i = 1, P do R, M = R + send[i], M + recv[i] end
local xs = moe.keep(randn({ R, cfg.d }):requires_grad_(true))
local gs = moe.keep(randn({ R, cfg.d }))
local xr = moe.keep(randn({ M, cfg.d }):requires_grad_(true))
local gr = moe.keep(randn({ M, cfg.d }))

-- a2a: the four exchanges alone
t.a2a = time(function()
  moe.scope(function()
    xs.grad = nil
    local r = F.all_to_all(xs, send, recv)
    F.all_to_all(r, recv, send):backward(gs)
  end)
end)
-- compute: the local experts alone on the received rows
local lplan = ex1.local_plan
t.compute = time(function()
  moe.scope(function()
    layer1:zero_grad()
    xr.grad = nil
    layer1.experts(xr, lplan, nil):backward(gr)
  end)
end)
-- section 1: the synchronous exchanges and the experts, as route_tokens runs them
t.section1 = time(function()
  moe.scope(function()
    layer1:zero_grad()
    xs.grad = nil
    local r = F.all_to_all(xs, send, recv)
    local ye = layer1.experts(r, lplan, nil)
    F.all_to_all(ye, recv, send):backward(gs)
  end)
end)
t.a2a_chunked1 = t.a2a
for C, s in pairs(section_of) do
  local ex = s.ex or error(("ep_overlap: %d chunks were capped to one (%d local experts per rank): give "
    .. "more experts or fewer ranks"):format(C, cfg.experts // P), 0)
  local run = { chunks = ex.chunks, bounds = ex.bounds, local_plans = ex.local_plans }
  t["section" .. C] = time(function()
    moe.scope(function()
      s.layer:zero_grad()
      xs.grad = nil
      ep.exchange_chunked(s.layer, xs, run):backward(gs)
    end)
  end)
  t["a2a_chunked" .. C] = time(function()
    moe.scope(function()
      xs.grad = nil
      local p = F.chunked_all_to_all(ex.chunks)
      p:scatter(xs)
      for c = 1, #ex.chunks do p:reply(c, p:received(c)) end
      p:gathered():backward(gs)
    end)
  end)
end

local function ms(s) return s * 1e3 end
for _, C in ipairs(cfg.chunks) do
  local sec = t["section" .. C]
  results[#results + 1] = {
    chunks = C,
    layer_ms = ms(t["layer" .. C]),
    layer_speedup = t.layer1 / t["layer" .. C],
    section_ms = ms(sec),
    a2a_chunked_ms = ms(t["a2a_chunked" .. C]),
    a2a_ms = ms(t.a2a),
    compute_ms = ms(t.compute),
    hidden = (t.a2a + t.compute - sec) / t.a2a,
  }
end

notes[#notes + 1] = ("one dMoE layer, EP over %d ranks: d %d, ffn %d, %d experts top-%d (%d per rank), %d x %d "
  .. "tokens per rank, %s, mlp_impl %s (%s); rank 0 sends %d rows and receives %d")
  :format(P, cfg.d, cfg.ffn, cfg.experts, cfg.top_k, cfg.experts // P, cfg.batch, cfg.seq, cfg.dtype, cfg.impl,
    layer1.mlp_impl, R, M)
notes[#notes + 1] = "every time is forward + backward, the largest median over the ranks; hidden = (a2a + compute "
  .. "- section) / a2a: the share of the all_to_all time the chunks hide. Section 1 has nothing to hide: its "
  .. "hidden value (0 ideally) is the bias of the measurement (waits and host work the pieces alone do not "
  .. "have), to subtract from the others'"
if device == "cpu" then
  notes[#notes + 1] = "CPU: MPI moves an asynchronous exchange only while it is waited for, so nothing overlaps here"
end

if rank == 0 then
  bench.write(cfg, {
    title = ("Expert-parallel all_to_all hidden behind the experts (%d ranks)"):format(P),
    device = device, notes = notes, results = bench.list(results),
    shape = { d = cfg.d, ffn = cfg.ffn, experts = cfg.experts, top_k = cfg.top_k, batch = cfg.batch, seq = cfg.seq,
      dtype = cfg.dtype, impl = layer1.mlp_impl, ranks = P, rows_sent = R, rows_received = M },
    columns = {
      { "chunks", "chunks" },
      { "layer ms", "layer_ms", "%.3f" },
      { "vs 1 chunk", "layer_speedup", "%.3f" },
      { "section ms (t_overlapped)", "section_ms", "%.3f" },
      { "a2a ms (t_a2a)", "a2a_ms", "%.3f" },
      { "compute ms (t_compute)", "compute_ms", "%.3f" },
      { "a2a in chunks ms", "a2a_chunked_ms", "%.3f" },
      { "hidden", "hidden", "%.3f" },
    },
  })
end
dist.barrier()
