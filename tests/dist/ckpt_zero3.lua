--[[
tests/dist/ckpt_zero3.lua - sharded checkpoints of parameter sharding
(parallel.shard_params, ZeRO-3; moe/fsdp.lua, moe/train/dcp.lua): every rank
writes its flat shard of each parameter ("model.<name>" as flat ranges) and
of the optimizer state; the checkpoint loads onto any layout. On the CPU,
under

  moe-lua launch -n 2 tests/dist/ckpt_zero3.lua [steps=8] [verbose=true] [dtype=f32|bf16]
  moe-lua launch -n 4 tests/dist/ckpt_zero3.lua [steps=4]

2 ranks:
  same layout     a ZeRO-3 run stopped at step K and resumed with
                  resume=latest: losses bit for bit with the uninterrupted run
  dp = 2          the same checkpoint resumed without shard_params
  one process     the same checkpoint resumed by each rank alone (dp = 1,
                  grad_accum = 2: the same global batch)
  dp = 2 -> ZeRO-3  a dp = 2 checkpoint resumed with shard_params; a ZeRO-2
                  one and a single process's (the one-file format) likewise
  ep = 2 x dp_shard = 2 with shard_params, and a layout function (attention
                  in units, the rest replicated): resumed bit for bit
4 ranks:
  dp_replicate = 2 x dp_shard = 2, shard_params (HSDP): bit for bit; dp = 4
                  resumes it
  etp = 2 x dp_shard = 4, shard_params (each expert's box of hidden units
                  sharded again over the 2 ranks holding it: saved as boxes):
                  bit for bit; one process (grad_accum = 4) resumes it
  ep = 2 x dp_shard = 4, shard_params (each expert shard's rows sharded again:
                  saved as flat ranges): bit for bit; ep = 2 x dp = 4 without
                  shard_params resumes it
Across layouts within relative 1e-5 of the uninterrupted run's losses (1e-4
where experts are involved, as tests/dist/ckpt_ep.lua: an expert's gradient
is one GEMM over other rows): another layout adds the same gradients in
another order (reduce_scatter and a shard's optimizer step against
all_reduce, micro-batches summed in one process), so the losses agree to
float rounding, not bit for bit (at these sizes they are often equal). With
dtype=bf16 (by hand) 1e-4 and 1e-3: bf16 rounds each layout's gradients and
activations on its own (dp and shard_params trained from scratch differ by
4e-5 after 4 steps); the same layout stays bit for bit.
]]
local moe = require "moe"
local train = require "moe.train"
local checkpoint = require "moe.checkpoint"
local dcp = require "moe.train.dcp"

local opts = moe.config { steps = 0, verbose = false, loss_weight = 0.01, device = "cpu", dtype = "f32" }
local dist = moe.dist
dist.init { timeout = 300 }
local rank, world = dist.rank(), dist.world_size()
assert(world == 2 or world == 4, ("run under moe-lua launch -n 2 or -n 4 (world size %d)"):format(world))
local function say(...) if rank == 0 then print(string.format(...)) end end

local K = dofile(arg[0]:match("^(.*/)") .. "trainkit.lua")
local root, prefix = K.corpus(rank)
local shared = ("/tmp/moe-ckpt-zero3-%s"):format(os.getenv("MASTER_PORT") or "x")
if rank == 0 then os.execute("rm -rf '" .. shared .. "'; mkdir -p '" .. shared .. "'") end
dist.barrier()

-- steps=0: 8 on 2 ranks, 4 on 4 (CI time)
if opts.steps == 0 then opts.steps = world == 4 and 4 or 8 end
local N, STOP = opts.steps, opts.steps // 2
-- across layouts (see the header): f32 1e-5, with experts 1e-4; bf16 rounds each layout's
-- gradient sums to 8 bits, and dp and shard_params differ by 4e-5 from the start
local TOL, ETOL = 1e-5, 1e-4
if opts.dtype == "bf16" then TOL, ETOL = 1e-4, 1e-3 end
local function cfg(name, over, dir)
  local c = K.base_cfg(opts, root, prefix, name, "moe", over)
  c.out_dir = (dir or shared) .. "/" .. name
  c.model.tie_embeddings = false
  c.dtype = opts.dtype -- bf16: the parameters' shards bf16, the masters f32 (by hand; CI runs f32)
  if c.no_lb then c.model.moe.loss_weight, c.no_lb = 0, nil end -- across ep layouts: tests/dist/ckpt_ep.lua
  return c
end

local with = K.with

-- the losses after STOP against the reference's: tol 0 is bit for bit
local function compare(what, ref, got, tol) return K.compare(what, ref, got, tol, STOP + 1, N, rank) end

local function stop_and_resume(name, over, parts)
  local r = train.run(cfg(name .. "-ref", over), parts)
  train.run(cfg(name, with(over, { stop_at = STOP, save_every = STOP, keep_last = 2 })), parts)
  local got = train.run(cfg(name, with(over, { resume = "latest", keep_last = 2 })), parts)
  assert(got.step == N and got.checkpoint ~= nil)
  compare(name, r.losses, got.losses, 0)
  return r
end

if world == 4 then
  local hsdp = { parallel = { dp_replicate = 2, dp_shard = 2, shard_params = true } }
  local ref = stop_and_resume("hsdp", hsdp)
  say("ok   ckpt_zero3: dp_replicate=2 x dp_shard=2, shard_params saved at %d, resumed: losses bit for bit", STOP)
  local d = train.run(cfg("hsdp-dp", { resume = shared .. "/hsdp/ckpt-" .. STOP, parallel = { dp = 4 } }, root))
  local worst = compare("hsdp shard_params -> dp=4", ref.losses, d.losses, TOL)
  say("ok   ckpt_zero3: the HSDP shard_params checkpoint resumed with dp=4: losses within %.2e", worst)
  ref = stop_and_resume("etp-units", { parallel = { etp = 2, dp_shard = 4, shard_params = true } })
  local boxes = 0
  for _, e in pairs(dcp.read_index(shared .. "/etp-units/ckpt-" .. STOP).tensors) do
    for _, sh in ipairs(e.shards) do if sh.offsets then boxes = boxes + 1 end end
  end
  assert(boxes > 0, "the etp checkpoint has no boxes: the test does not test them")
  say("ok   ckpt_zero3: etp=2 x dp_shard=4, shard_params (expert boxes sharded again) saved at %d, resumed: " ..
    "losses bit for bit", STOP)
  d = train.run(cfg("etp-one", { grad_accum = 4, resume = shared .. "/etp-units/ckpt-" .. STOP,
    parallel = { dp = 1 } }, root))
  worst = compare("etp units -> one process", ref.losses, d.losses, ETOL)
  say("ok   ckpt_zero3: that checkpoint resumed by one process (grad_accum=4): losses within %.2e", worst)
  local eover = { no_lb = true, parallel = { ep = 2, dp_shard = 4, shard_params = true } }
  ref = stop_and_resume("ep-units", eover)
  say("ok   ckpt_zero3: ep=2 x dp_shard=4, shard_params (expert shards sharded again) saved at %d, resumed: " ..
    "losses bit for bit", STOP)
  d = train.run(cfg("ep-dp", { no_lb = true, resume = shared .. "/ep-units/ckpt-" .. STOP,
    parallel = { ep = 2 } }, root))
  worst = compare("ep units -> ep=2 x dp=4", ref.losses, d.losses, ETOL)
  say("ok   ckpt_zero3: that checkpoint resumed with ep=2 x dp=4 (no shard_params): losses within %.2e", worst)
else
  local z3 = { parallel = { dp_shard = 2, shard_params = true } }
  local dp2 = { parallel = { dp = 2 } }

  -- (a) ZeRO-3: uninterrupted; stopped at STOP (saved); resumed with resume=latest
  local ref = train.run(cfg("z3-ref", z3))
  train.run(cfg("z3", with(z3, { stop_at = STOP, save_every = STOP, keep_last = 2 })))
  local ck = shared .. "/z3/ckpt-" .. STOP
  assert(checkpoint.latest(shared .. "/z3") == ck, ("[rank %d] latest is %s"):format(rank,
    tostring(checkpoint.latest(shared .. "/z3"))))
  -- the parameters are in it as flat ranges, some straddling the two ranks' files
  local idx = dcp.read_index(ck)
  local flat, straddle = 0, 0
  for name, e in pairs(idx.tensors) do
    if name:match("^model%.") then
      local files, n = {}, 0
      for _, s in ipairs(e.shards) do
        if s.flat then flat = flat + 1 end
        if not files[s.file] then files[s.file], n = true, n + 1 end
      end
      if n > 1 then straddle = straddle + 1 end
    end
  end
  -- bf16: the parameters in their dtype (the bf16 shards), beside the f32 masters
  for name, e in pairs(idx.tensors) do
    local want = name:match("^model%.") and opts.dtype or "f32"
    assert(e.dtype == want, ("'%s' is %s in the checkpoint, expected %s"):format(name, e.dtype, want))
    if opts.dtype == "bf16" and name:match("^model%.") then
      assert(idx.tensors["optim." .. name:sub(7) .. ".master"], ("no master of '%s'"):format(name))
    end
  end
  assert(flat > 0 and straddle > 0, ("the ZeRO-3 checkpoint has %d flat model shards, %d straddling"):format(flat,
    straddle))
  local res = train.run(cfg("z3", with(z3, { resume = "latest", keep_last = 2 })))
  assert(res.step == N)
  compare("shard_params -> shard_params", ref.losses, res.losses, 0)
  say("ok   ckpt_zero3: shard_params saved at %d (%d flat model shards, %d parameters straddle the ranks), " ..
    "resumed: losses bit for bit", STOP, flat, straddle)

  -- (b) the ZeRO-3 checkpoint onto dp = 2 and onto one process
  local d = train.run(cfg("z3-dp", { resume = ck, parallel = { dp = 2 } }, root))
  local worst = compare("shard_params -> dp=2", ref.losses, d.losses, TOL)
  say("ok   ckpt_zero3: the shard_params checkpoint resumed with dp=2: losses within %.2e", worst)
  local one = train.run(cfg("z3-alone", { grad_accum = 2, parallel = { dp = 1 }, resume = ck }, root))
  worst = compare("shard_params -> one process", ref.losses, one.losses, TOL)
  say("ok   ckpt_zero3: the shard_params checkpoint resumed by one process (grad_accum=2): losses within %.2e",
    worst)

  -- (c) a dp = 2 checkpoint resumed with shard_params
  local dref = train.run(cfg("dp-ref", dp2))
  train.run(cfg("dp", with(dp2, { stop_at = STOP, save_every = STOP, keep_last = 2 })))
  local z = train.run(cfg("dp-z3", with(z3, { resume = shared .. "/dp/ckpt-" .. STOP }), root))
  worst = compare("dp=2 -> shard_params", dref.losses, z.losses, TOL)
  say("ok   ckpt_zero3: a dp=2 checkpoint resumed with shard_params: losses within %.2e", worst)

  -- (d) a ZeRO-2 checkpoint and a single process's (one-file format) resumed with shard_params
  local z2 = { parallel = { dp_shard = 2, bucket_mb = 0.002 } }
  train.run(cfg("z2", with(z2, { stop_at = STOP, save_every = STOP, keep_last = 2 })))
  z = train.run(cfg("z2-z3", with(z3, { resume = shared .. "/z2/ckpt-" .. STOP }), root))
  worst = compare("dp_shard=2 -> shard_params", ref.losses, z.losses, TOL)
  say("ok   ckpt_zero3: a dp_shard=2 (ZeRO-2) checkpoint resumed with shard_params: losses within %.2e", worst)
  -- each rank alone writes the same checkpoint in its own folder; each resumes from its own
  train.run(cfg("one", { grad_accum = 2, parallel = { dp = 1 }, stop_at = STOP, save_every = STOP, keep_last = 2 },
    root))
  assert(not dcp.is_sharded(root .. "/one/ckpt-" .. STOP), "one process wrote a sharded checkpoint")
  z = train.run(cfg("one-z3", with(z3, { resume = root .. "/one/ckpt-" .. STOP }), root))
  worst = compare("one process -> shard_params", ref.losses, z.losses, TOL)
  say("ok   ckpt_zero3: a single process's checkpoint (one file) resumed with shard_params: losses within %.2e",
    worst)

  -- (e) with expert parallelism (the dense parameters in units, the expert shards placed by ep) and
  -- with a layout function (attention in units, the rest replicated: ZeRO-2 buckets beside the units)
  local function layout(_, module)
    if module.__name == "CausalSelfAttention" then return "shard" end
    return nil
  end
  for _, case in ipairs({
    { "ep", { parallel = { ep = 2, dp_shard = 2, shard_params = true } }, nil, "ep=2 x dp_shard=2, shard_params" },
    { "layout", { parallel = { dp_shard = 2 } }, layout, "a layout function (attention sharded, the rest replicated)" },
  }) do
    stop_and_resume(case[1], case[2], case[3] and { layout = case[3] } or nil)
    say("ok   ckpt_zero3: %s saved at %d, resumed: losses bit for bit", case[4], STOP)
  end
end

dist.barrier()
if rank == 0 then os.execute("rm -rf '" .. shared .. "'") end
os.execute("rm -rf '" .. root .. "'")
