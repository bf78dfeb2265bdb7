--[[
tests/dist/ckpt_ep.lua - checkpoints of expert-parallel training resumed on
other layouts, on the CPU. Three launches share a folder:

  moe-lua launch -n 2 tests/dist/ckpt_ep.lua phase=save dir=D
  moe-lua launch -n 4 tests/dist/ckpt_ep.lua phase=four dir=D
  moe-lua tests/dist/ckpt_ep.lua phase=one dir=D

save (2 ranks, ep = 2): an uninterrupted run (its losses go to D/ref.txt), a
  run stopped at step K (ckpt-K: each rank's experts as rows of the global
  expert stacks), resumed with ep = 2: bit for bit; and each rank alone
  (ep = 1, grad_accum = 2: the same global batch of 8 sequences) resumes
  ckpt-K: close. The same with etp = 2 (each rank's hidden units of every
  expert, N-d boxes of the stacks): bit for bit with etp = 2, close alone; and
  ep = 2 x dp_shard = 2 resumed on the same layout: bit for bit.
four (4 ranks, ep = 2 x dp = 2, micro-batch 2: the same global batch): resumes
  the 2-rank checkpoint: close; then trains from scratch to step K and saves
  (D/ep4/ckpt-K: each expert shard held by two ranks, written once).
one (one process, ep = 1, grad_accum = 2): consolidates the 4-rank checkpoint
  (moe-lua export's path) and checks it against what a resume loads; resumes
  it: close.
Close: relative 1e-4 on the losses (measured and printed; the global batch's
mean is taken over other splits of the rows, and an expert's gradient is one
GEMM over other rows). The load-balancing loss is off (loss_weight = 0): its
value depends on how the batch is split over ranks, so the curves would
differ by more than rounding.
]]
local moe = require "moe"
local train = require "moe.train"

local opts = moe.config { steps = 8, verbose = false, loss_weight = 0, device = "cpu", phase = "", dir = "" }
assert(opts.dir ~= "", "give dir=FOLDER (shared by the three phases)")
local dist = moe.dist
local world = moe.dist and dist.world_size() or 1
local rank = world > 1 and dist.rank() or 0
local function say(...) if rank == 0 then print(string.format(...)) end end

local K = dofile(arg[0]:match("^(.*/)") .. "trainkit.lua")
local root, prefix = K.corpus(rank)
local D = opts.dir
local N, STOP = opts.steps, opts.steps // 2

local function cfg(name, over, dir)
  local c = K.base_cfg(opts, root, prefix, name, "moe", over)
  c.out_dir = (dir or D) .. "/" .. name
  c.model.tie_embeddings = false
  c.model.moe.num_experts = 8
  return c
end

local with = K.with

local function compare(what, ref, got, tol) return K.compare(what, ref, got, tol, STOP + 1, N, rank) end

local function read_ref()
  local ref = {}
  for line in io.lines(D .. "/ref.txt") do
    local s, v = line:match("^(%d+) (%S+)$")
    ref[math.tointeger(tonumber(s))] = tonumber(v)
  end
  return ref
end

if opts.phase == "save" then
  assert(world == 2, "phase=save runs on 2 ranks")
  if rank == 0 then os.execute("rm -rf '" .. D .. "'; mkdir -p '" .. D .. "'") end
  dist.barrier()
  local ep = { parallel = { ep = 2 } }
  local ref = train.run(cfg("ref", ep))
  if rank == 0 then
    local f = assert(io.open(D .. "/ref.txt", "w"))
    for s = 1, N do f:write(("%d %.17g\n"):format(s, ref.losses[s])) end
    f:close()
  end
  train.run(cfg("ep", with(ep, { stop_at = STOP, save_every = STOP, keep_last = 2 })))
  local idx = require("moe.train.dcp").read_index(D .. "/ep/ckpt-" .. STOP)
  local w1 = idx.tensors["model.blocks.0.ffn.experts.w1"]
  assert(w1 and w1.shape[1] == 8 and #w1.shards == 2 and w1.shards[1].rows and w1.shards[2].rows,
    "the expert stack is not saved as two row ranges")
  local res = train.run(cfg("ep", with(ep, { resume = "latest", keep_last = 2 })))
  compare("ep=2 -> ep=2", ref.losses, res.losses, 0)
  say("ok   ckpt_ep: ep=2 on 2 ranks saved at %d (experts as 2 row ranges), resumed with ep=2: losses bit for bit", STOP)
  local one = train.run(cfg("alone", { grad_accum = 2, parallel = { dp = 1 }, resume = D .. "/ep/ckpt-" .. STOP },
    root))
  local worst = compare("ep=2 -> one rank", ref.losses, one.losses, 1e-4)
  say("ok   ckpt_ep: the ep=2 checkpoint resumed on one rank (ep=1, grad_accum=2): losses within %.2e", worst)
  -- expert-tensor sharding: each rank's hidden units of every expert, an N-d box of the stack
  local etp = { parallel = { etp = 2 } }
  local eref = train.run(cfg("etp-ref", etp))
  train.run(cfg("etp", with(etp, { stop_at = STOP, save_every = STOP, keep_last = 2 })))
  idx = require("moe.train.dcp").read_index(D .. "/etp/ckpt-" .. STOP)
  local b1 = idx.tensors["model.blocks.0.ffn.experts.w1"]
  local b2 = idx.tensors["model.blocks.0.ffn.experts.w2"]
  assert(b1 and #b1.shards == 2 and b1.shards[1].offsets and b1.shards[2].offsets[3] > 0,
    "w1's hidden slices are not saved as two boxes along dim 3")
  assert(b2 and #b2.shards == 2 and b2.shards[2].offsets[2] > 0, "w2's hidden slices are not boxes along dim 2")
  res = train.run(cfg("etp", with(etp, { resume = "latest", keep_last = 2 })))
  compare("etp=2 -> etp=2", eref.losses, res.losses, 0)
  one = train.run(cfg("etp-alone", { grad_accum = 2, parallel = { dp = 1 }, resume = D .. "/etp/ckpt-" .. STOP },
    root))
  worst = compare("etp=2 -> one rank", eref.losses, one.losses, 1e-4)
  say("ok   ckpt_ep: etp=2 saved at %d (hidden slices as boxes), resumed with etp=2 bit for bit, on one rank " ..
    "within %.2e", STOP, worst)
  -- expert shards with the other parameters' optimizer state sharded (ZeRO-2)
  local ez = { parallel = { ep = 2, dp_shard = 2 } }
  local zref = train.run(cfg("epz-ref", ez))
  train.run(cfg("epz", with(ez, { stop_at = STOP, save_every = STOP, keep_last = 2 })))
  res = train.run(cfg("epz", with(ez, { resume = "latest", keep_last = 2 })))
  compare("ep=2 x dp_shard=2 -> the same", zref.losses, res.losses, 0)
  say("ok   ckpt_ep: ep=2 x dp_shard=2 saved at %d, resumed on the same layout bit for bit", STOP)
elseif opts.phase == "four" then
  assert(world == 4, "phase=four runs on 4 ranks")
  local ref = read_ref()
  local over = { batch_size = K.B // 2, parallel = { ep = 2 } }
  local res = train.run(cfg("four", with(over, { resume = D .. "/ep/ckpt-" .. STOP }), root))
  local worst = compare("ep=2 on 2 ranks -> ep=2 x dp=2", ref, res.losses, 1e-4)
  say("ok   ckpt_ep: the 2-rank ep=2 checkpoint resumed with ep=2 x dp=2 on 4 ranks: losses within %.2e", worst)
  train.run(cfg("ep4", with(over, { stop_at = STOP, save_every = STOP, keep_last = 1 })))
  local idx = require("moe.train.dcp").read_index(D .. "/ep4/ckpt-" .. STOP)
  local w1 = idx.tensors["model.blocks.0.ffn.experts.w1"]
  assert(#w1.shards == 2, ("the expert stack held by 4 ranks is saved in %d shards, not 2"):format(#w1.shards))
  say("ok   ckpt_ep: ep=2 x dp=2 saved at %d: each expert shard written once", STOP)
elseif opts.phase == "one" then
  assert(world == 1, "phase=one runs alone")
  local ref = read_ref()
  -- the consolidated model (export's path) is what a resume loads
  local ck = D .. "/ep4/ckpt-" .. STOP
  local full = require("moe.train.dcp").consolidate(ck)
  local loaded = train.run(cfg("load", { resume = ck, stop_at = STOP }, root)).model
  local n = 0
  for name, t in pairs(loaded:state_dict()) do
    assert(full[name], "consolidate lacks " .. name)
    assert((full[name] - t):abs():max():item() == 0, "consolidated " .. name .. " differs from the loaded one")
    n = n + 1
  end
  say("ok   ckpt_ep: the 4-rank checkpoint consolidated (%d tensors) equals what a resume loads", n)
  local res = train.run(cfg("back", { grad_accum = 2, resume = D .. "/ep4/ckpt-" .. STOP }, root))
  local worst = compare("ep=2 x dp=2 -> one process", ref, res.losses, 1e-4)
  say("ok   ckpt_ep: the 4-rank ep=2 x dp=2 checkpoint resumed by one process: losses within %.2e", worst)
  os.execute("rm -rf '" .. D .. "'")
else
  error("phase=save|four|one")
end
if world > 1 then dist.barrier() end
os.execute("rm -rf '" .. root .. "'")
