--[[
tests/dist/ckpt_resume.lua - sharded checkpoints (moe/train/dcp.lua) in
moe.train: a run stopped at step K and resumed with resume=latest continues
the loss curve of an uninterrupted run, on the CPU, under

  moe-lua launch -n 2 tests/dist/ckpt_resume.lua [steps=8] [verbose=true]
  moe-lua launch -n 4 tests/dist/ckpt_resume.lua

2 ranks:
  dp = 2              saved and resumed with dp = 2 (synchronous saves, then
                      asynchronous ones): losses bit for bit
  dp_shard = 2        ZeRO-2: the optimizer state in flat ranges (parameters
                      straddle the ranks): bit for bit; then each rank alone
                      (dp = 1, grad_accum = 2: the same global batch) resumes
                      the same checkpoint: close (relative 1e-5; the reductions
                      add in another order)
  failed save         a save that fails after the ranks wrote their shards and
                      before the commit leaves the previous checkpoint the
                      latest; resume=latest picks it and the curve is bit for bit
  damaged newest      the ranks share resume=latest's hashing: a damaged file in
                      either rank's part makes every rank skip that checkpoint
4 ranks:
  dp_replicate = 2 x dp_shard = 2 (HSDP): bit for bit; dp = 4 resumes it: close
The checkpoint folder is shared by the ranks (a folder named after MASTER_PORT,
which moe-lua launch sets per job).
]]
local moe = require "moe"
local train = require "moe.train"
local checkpoint = require "moe.checkpoint"

local opts = moe.config { steps = 8, verbose = false, loss_weight = 0.01, device = "cpu" }
local dist = moe.dist
dist.init { timeout = 300 }
local rank, world = dist.rank(), dist.world_size()
assert(world == 2 or world == 4, ("run under moe-lua launch -n 2 or -n 4 (world size %d)"):format(world))
local function say(...) if rank == 0 then print(string.format(...)) end end

local K = dofile(arg[0]:match("^(.*/)") .. "trainkit.lua")
local root, prefix = K.corpus(rank)
local shared = ("/tmp/moe-ckpt-resume-%s"):format(os.getenv("MASTER_PORT") or "x")
if rank == 0 then os.execute("rm -rf '" .. shared .. "'; mkdir -p '" .. shared .. "'") end
dist.barrier()

local N, STOP = opts.steps, opts.steps // 2
local function cfg(name, over, dir)
  local c = K.base_cfg(opts, root, prefix, name, "moe", over)
  c.out_dir = (dir or shared) .. "/" .. name
  c.model.tie_embeddings = false
  return c
end

local with = K.with

-- ref: losses of an uninterrupted run; got: of the resumed one (steps > STOP)
local function compare(what, ref, got, tol) return K.compare(what, ref, got, tol, STOP + 1, N, rank) end

-- uninterrupted; stopped at STOP (saved); resumed; returns both curves
local function stop_and_resume(name, over)
  local ref = train.run(cfg(name .. "-ref", over))
  train.run(cfg(name, with(over, { stop_at = STOP, save_every = STOP, keep_last = 2 })))
  local latest = checkpoint.latest(shared .. "/" .. name)
  assert(latest and latest:match("ckpt%-" .. STOP .. "$"), ("[rank %d] %s: latest is %s"):format(rank, name,
    tostring(latest)))
  local res = train.run(cfg(name, with(over, { resume = "latest", keep_last = 2 })))
  assert(res.step == N)
  return ref, res
end

if world == 2 then
  -- (a) dp = 2, synchronous and asynchronous saves
  for _, async in ipairs({ false, true }) do
    local name = async and "dp-async" or "dp"
    local ref, res = stop_and_resume(name, { save_async = async })
    compare(name, ref.losses, res.losses, 0)
    say("ok   ckpt_resume: dp=2%s saved at %d, resumed: losses to step %d bit for bit", async and " (async)" or "",
      STOP, N)
  end

  -- (b) ZeRO-2: bitwise on the same layout, close on one rank
  local zover = { parallel = { dp_shard = 2, bucket_mb = 0.002 } } -- small buckets: parameters straddle ranks
  local ref, res = stop_and_resume("zero", zover)
  compare("dp_shard=2", ref.losses, res.losses, 0)
  say("ok   ckpt_resume: dp_shard=2 saved at %d, resumed with dp_shard=2: losses bit for bit", STOP)
  local idx = require("moe.train.dcp").read_index(shared .. "/zero/ckpt-" .. STOP)
  local straddle = 0
  for _, e in pairs(idx.tensors) do
    local ranks = {}
    for _, s in ipairs(e.shards) do if s.flat then ranks[s.file] = true end end
    local n = 0
    for _ in pairs(ranks) do n = n + 1 end
    if n > 1 then straddle = straddle + 1 end
  end
  assert(straddle > 0, "no optimizer tensor straddles the ranks: the test does not test flat ranges")
  local mine = root .. "/alone"
  local one = train.run(cfg("zero-alone", { grad_accum = 2, parallel = { dp = 1 },
    resume = shared .. "/zero/ckpt-" .. STOP }, mine))
  local worst = compare("dp_shard=2 -> one rank", ref.losses, one.losses, 1e-5)
  say("ok   ckpt_resume: dp_shard=2 checkpoint resumed on one rank (grad_accum=2): losses within %.2e " ..
    "(%d tensors straddle the ranks)", worst, straddle)

  -- (d) a save that fails before its commit leaves the previous checkpoint
  local name = "failed"
  local over = { save_every = 2, keep_last = 3 }
  local fref = train.run(cfg(name .. "-ref", {}))
  local hooks = { after_step = function(state)
    if state.step == STOP + 3 and state.parallel.saver then state.parallel.saver.fail_before_commit = true end
  end }
  local ok, err = pcall(train.run, cfg(name, with(over, { save_async = true })), { hooks = hooks })
  assert(not ok and tostring(err):find("before its commit", 1, true), ("[rank %d] the save did not fail: %s"):format(
    rank, tostring(err)))
  dist.barrier()
  local latest = checkpoint.latest(shared .. "/" .. name)
  -- asynchronous: the save of step STOP was committed when that of STOP + 2 began; the
  -- save of STOP + 2 failed at its commit, when that of STOP + 4 began
  assert(latest and latest:match("ckpt%-" .. STOP .. "$"), ("[rank %d] latest is %s"):format(rank, tostring(latest)))
  local tmp = io.popen("ls -1A '" .. shared .. "/" .. name .. "'"):read("a")
  assert(tmp:find(".tmp-ckpt-" .. (STOP + 2) .. "-dcp", 1, true), "the failed save left no temporary folder: " .. tmp)
  dist.barrier() -- every rank has looked before the resumed run's rank 0 removes the unfinished save
  res = train.run(cfg(name, with(over, { resume = "latest" })))
  compare("after a failed save", fref.losses, res.losses, 0)
  tmp = io.popen("ls -1A '" .. shared .. "/" .. name .. "'"):read("a")
  assert(not tmp:find(".tmp-ckpt-", 1, true), "the unfinished save was not removed: " .. tmp)
  say("ok   ckpt_resume: a save that failed before its commit: resume=latest took ckpt-%d, losses bit for bit", STOP)

  -- (e) the ranks share resume=latest's hashing (each its part of digests.txt's files):
  -- a damaged file of the newest checkpoint, in either rank's part, makes every rank
  -- skip it and take the one before
  local digests
  for part = 1, 2 do
    name = "damaged-" .. part
    train.run(cfg(name, { stop_at = STOP + 2, save_every = 2, keep_last = 3 }))
    local newest = shared .. "/" .. name .. "/ckpt-" .. (STOP + 2)
    digests = checkpoint.read_digests(newest)
    dist.barrier()
    if rank == 0 then
      local file = newest .. "/" .. digests.order[part]
      local f = assert(io.open(file, "r+b"))
      local size = f:seek("end")
      f:seek("set", size // 2)
      local b = f:read(1)
      f:seek("set", size // 2)
      f:write(string.char(255 - b:byte()))
      f:close()
    end
    dist.barrier()
    res = train.run(cfg(name, { resume = "latest" }))
    assert(res.checkpoint == shared .. "/" .. name .. "/ckpt-" .. STOP,
      ("[rank %d] a damaged file in rank %d's part: resumed from %s, ckpt-%d expected"):format(rank, part - 1,
        tostring(res.checkpoint), STOP))
    assert(res.step == N)
    say("ok   ckpt_resume: '%s' damaged in ckpt-%d (rank %d's part of the hashing): every rank resumed from ckpt-%d",
      digests.order[part], STOP + 2, part - 1, STOP)
  end
else
  local over = { parallel = { dp_shard = 2, dp_replicate = 2, bucket_mb = 0.002 } }
  local ref, res = stop_and_resume("hsdp", over)
  compare("hsdp", ref.losses, res.losses, 0)
  say("ok   ckpt_resume: dp_replicate=2 x dp_shard=2 saved at %d, resumed: losses bit for bit", STOP)
  local dp = train.run(cfg("hsdp", { resume = shared .. "/hsdp/ckpt-" .. STOP, parallel = { dp = 4 } }, root))
  local worst = compare("hsdp -> dp=4", ref.losses, dp.losses, 1e-5)
  say("ok   ckpt_resume: the HSDP checkpoint resumed with dp=4: losses within %.2e", worst)
end
dist.barrier()
if rank == 0 then os.execute("rm -rf '" .. shared .. "'") end
os.execute("rm -rf '" .. root .. "'")
