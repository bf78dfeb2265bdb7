--[[
tests/dist/fsdp_memory.lua - the model-state memory of parameter sharding
(FSDP / ZeRO-3: moe/fsdp.lua with optim.ShardedAdamW, what train's parallel
= {dp_shard = N, shard_params = true} builds) against one process holding
everything (optim.AdamW), measured on the CPU (in CI) or on GPUs:

  moe-lua launch -n 2 tests/dist/fsdp_memory.lua [verbose=true] [device=cpu|cuda]
  moe-lua launch -n 4 tests/dist/fsdp_memory.lua

device=cuda: each rank on cuda:<local rank> (one GPU per rank), the
collectives through NCCL, and the bytes are the CUDA caching allocator's
(moe.memory_stats("cuda:<i>").allocated: the block sizes of the live
storages, requests rounded up to 512 bytes, or to 2 MiB above 1 MiB),
read after a synchronisation; before the measured runs one untimed
single-process step makes whatever the GPU path keeps from its first step
(cached buffers), so neither figure counts it. bench/dist_round.sh
layouts2 runs the 2-rank case on two GPUs; -n 4 needs four.

Measured, not computed from shapes: moe.memory_stats(device).allocated (on
the CPU the bytes of every live tensor storage of the CPU allocator) before the model is
built and after one training step (forward, backward, the reduce, the
optimizer step; the step's temporaries freed, the gradients kept as they
are before zero_grad). The difference is the parameters, the gradients and
the optimizer state (exp_avg, exp_avg_sq) a rank holds between steps, plus
the rope tables the attention caches (a few KiB in both runs). Every rank
first makes the single-process figure itself (AdamW, nothing sharded), then
the sharded one. Asserted: sharded / single <= 0.55 with 2 ranks, <= 0.30
with 4 (1/N plus the padding of each unit's flat buffer to a multiple of N
and the rope tables). Also printed: the peak over the step (from after the
optimizer is made: the gathered units, activations, the full gradients of
a bucket before its reduce_scatter), not asserted.
]]
local moe = require "moe"
local tconfig = require "moe.train.config"
local build = require "moe.train.build"
local optim = require "moe.optim"
local fsdp = require "moe.fsdp"

local opts = moe.config { verbose = false, device = "cpu" }
local dist = moe.dist
dist.init { timeout = 300 }
local rank, world = dist.rank(), dist.world_size()
assert(world == 2 or world == 4, ("run under moe-lua launch -n 2 or -n 4 (world size %d)"):format(world))
local function say(...) if rank == 0 then print(string.format(...)) end end
dofile(arg[0]:match("^(.*/)") .. "trainkit.lua").check_device(opts.device, "fsdp_memory")
local dev = opts.device == "cuda" and "cuda:" .. dist.local_rank() or "cpu"
local on_gpu = dev ~= "cpu"

local cfg = tconfig.config {
  model = { vocab_size = 257, d_model = 64, n_layers = 3, n_heads = 4, ffn = "moe", d_ff = 128,
    moe = { num_experts = 8, top_k = 2, ffn_hidden_size = 128, loss_weight = 0.01 } },
  seq_len = 16, device = opts.device, seed = 7,
}
local B, S = 4, cfg.seq_len

local function allocated()
  collectgarbage()
  collectgarbage()
  if on_gpu then moe.cuda.synchronize(dev) end
  return moe.memory_stats(dev).allocated
end

local function batch()
  moe.manual_seed(11 + rank)
  local x = moe.randint(0, cfg.model.vocab_size, { B, S }, { dtype = "i64" })
  local y = moe.randint(0, cfg.model.vocab_size, { B, S }, { dtype = "i64" })
  if on_gpu then x, y = x:to(dev), y:to(dev) end
  return x, y
end

local adam = { lr = 1e-3, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1 }

-- one process: the whole model, its gradients and AdamW's state
local function single()
  local base = allocated()
  moe.manual_seed(cfg.seed)
  local model = build.model(cfg, dev)
  local named = model:named_parameters()
  local params_bytes = allocated() - base
  local opt = optim.AdamW(named, adam)
  moe.reset_peak_memory_stats(dev)
  moe.scope(function()
    local x, y = batch()
    local loss = model:loss(x, y)
    loss:backward()
  end)
  opt:step()
  local held = allocated() - base
  local peak = moe.memory_stats(dev).peak_allocated - base
  opt:zero_grad()
  for _, np in ipairs(named) do np[2]:free() end
  return { held = held, peak = peak, params = params_bytes }
end

-- FSDP over the world: units of the blocks and the root, sharded AdamW
local function sharded()
  local base = allocated()
  moe.manual_seed(cfg.seed)
  local model = build.model(cfg, dev)
  local sh = fsdp.shard(model, { group = dist.world })
  local o = { group = dist.world, groups = sh.groups, units = sh.units }
  for k, v in pairs(adam) do o[k] = v end
  local opt = optim.ShardedAdamW(sh.named, o)
  local after_build = allocated() - base
  moe.reset_peak_memory_stats(dev)
  moe.scope(function()
    local x, y = batch()
    local loss = model:loss(x, y)
    opt.reducer:arm()
    loss:backward()
    opt.reducer:finish()
  end)
  opt:step()
  local held = allocated() - base
  local peak = moe.memory_stats(dev).peak_allocated - base
  local whole = 0
  for _, u in pairs(sh.units) do if u.unit:ready() then whole = whole + 1 end end
  local r = { held = held, peak = peak, after_build = after_build, units = sh:stats().units, whole = whole,
    shard_bytes = sh:shard_bytes(), state_bytes = opt:state_bytes() }
  opt:zero_grad()
  opt:free()
  return r
end

if on_gpu then single() end -- the first step's lasting buffers, outside both measurements
local one = single()
local sh = sharded()
local ratio = sh.held / one.held
-- every rank's figures on rank 0 (the largest ratio decides)
local t = moe.tensor({ ratio, sh.held, one.held, sh.peak, one.peak, sh.whole }, { dtype = "f64" })
local all = moe.empty({ world * 6 }, { dtype = "f64" })
dist.all_gather(all, t)
local v = all:totable()
local worst, whole = 0, 0
for r = 0, world - 1 do
  local o = r * 6
  say("rank %d: parameters + gradients + AdamW state %9d bytes against %9d in one process: %.3f " ..
    "(peak over the step %d against %d)", r, v[o + 2], v[o + 3], v[o + 1], v[o + 4], v[o + 5])
  worst = math.max(worst, v[o + 1])
  whole = whole + v[o + 6]
end
if opts.verbose then
  say("rank 0: one process: parameters %d bytes; sharded: %d units, parameter shards %d bytes, optimizer " ..
    "state %d bytes, %d bytes after building", one.params, sh.units, sh.shard_bytes, sh.state_bytes,
    sh.after_build)
end
local bound = world == 2 and 0.55 or 0.30
local ok = worst <= bound and whole == 0 and one.held >= 3 * one.params
say("fsdp_memory: %d ranks: the largest ratio %.3f (bound %.2f, ideal %.3f); units whole after the step: %d",
  world, worst, bound, 1 / world, whole)
if not ok then
  error(("fsdp_memory: %d ranks: model-state memory %.3f of one process's (bound %.2f), %d unit(s) whole, " ..
    "one process %d bytes for %d bytes of parameters"):format(world, worst, bound, whole, one.held, one.params), 0)
end
say("fsdp_memory: ok (%s)", dev == "cpu" and "cpu" or "cuda, one GPU per rank")
