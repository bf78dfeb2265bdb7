--[[
tests/dist/zero_equivalence.lua - sharded data parallelism (train's parallel.dp_shard,
dp_replicate: ZeRO-2 and HSDP) against data parallelism (DDP, parallel.dp), on the CPU:

  moe-lua launch -n 2 tests/dist/zero_equivalence.lua [steps=20] [verbose=true]
  moe-lua launch -n 4 tests/dist/zero_equivalence.lua

The same small dMoE and dense GPT train 20 steps both ways inside one job
(every rank runs both), and the lm losses and the trained parameters are
compared. 2 ranks: dp_shard = 2 against dp = 2. 4 ranks: dp_replicate = 2 x
dp_shard = 2 (HSDP) and dp_shard = 4 against dp = 4.

Why they agree. Per element, the reduce_scatter (avg) of 2 ranks is the same
sum and the same halving as the all_reduce (avg) of 2 ranks, and the sharded
AdamW runs the fused adamw_step on exactly the elements optim.AdamW steps,
with the same inputs: without clipping, bit for bit (asserted). Clipping uses
the global norm computed in another order (per bucket shard, then summed over
ranks in f64, against per parameter, then stacked): the norm, and so the
clipping coefficient, can differ in the last bits, which Adam carries on;
measured and printed, bounded by 1e-4 relative on the losses. With 4 ranks,
HSDP averages ((a + b) / 2 + (c + d) / 2) / 2 where DDP's all_reduce adds
the four in MPI's order: bitwise when MPI adds (a + b) + (c + d), otherwise
rounding; measured and printed, bounded like clipping.

Memory: the bytes of every master-weight and moment tensor of the sharded
AdamW on each rank against optim.AdamW's (its state_dict): at most 1/P of it
plus each bucket's padding (fewer than P elements per state tensor).
]]
local moe = require "moe"
local train = require "moe.train"

local opts = moe.config { steps = 20, verbose = false, loss_weight = 0.01, tie_embeddings = true,
  device = "cpu" }
local dist = moe.dist
dist.init()
local rank, world = dist.rank(), dist.world_size()
assert(world == 2 or world == 4, ("run under moe-lua launch -n 2 or -n 4 (world size %d)"):format(world))

local function say(...) if rank == 0 then print(string.format(...)) end end

-- ------------------------------------------------------------ the data
-- each rank its own copy (same bytes): no rank reads a file another writes
local K = dofile(arg[0]:match("^(.*/)") .. "trainkit.lua")
local root, prefix = K.corpus(rank)

local function base_cfg(name, ffn, over) return K.base_cfg(opts, root, prefix, name, ffn, over) end


-- max over steps of |a - b| / |b|
local max_rel = K.max_rel

-- parameters of a and b: how many bit-identical, the largest |difference|
local function compare_params(ma, mb)
  local pa, pb, same, maxd = ma:named_parameters(), mb:named_parameters(), 0, 0
  for i = 1, #pa do
    local a, b = pa[i][2]:double():reshape({ -1 }):totable(), pb[i][2]:double():reshape({ -1 }):totable()
    local eq = true
    for j = 1, #a do
      if a[j] ~= b[j] then
        eq = false
        maxd = math.max(maxd, math.abs(a[j] - b[j]))
      end
    end
    if eq then same = same + 1 end
  end
  return same, #pa, maxd
end

local failures = {}
local function expect(ok, msg)
  if not ok then failures[#failures + 1] = msg; io.stderr:write(("[rank %d] FAILED: %s\n"):format(rank, msg)) end
end

-- the optimizer of a run, caught by a hook
local function run_with_opt(cfg)
  local opt
  local res = train.run(cfg, { hooks = { after_step = function(state) opt = state.optimizer end } })
  return res, opt
end

local function state_bytes(opt)
  if opt.state_bytes then return opt:state_bytes() end
  local n = 0
  for _, t in pairs(opt:state_dict()) do n = n + t:numel() * 4 end
  return n
end

local layouts = world == 2 and { { shard = 2, rep = 1 } } or { { shard = 2, rep = 2 }, { shard = 4, rep = 1 } }
for ci, ffn in ipairs({ "moe", "dense" }) do
  local label = ffn == "moe" and "dMoE" or "dense GPT"
  for _, clip in ipairs({ 0, 1.0 }) do
    local function cfg_of(name, over)
      over = over or {}
      over.model = { tie_embeddings = opts.tie_embeddings }
      over.clip = clip
      -- small buckets: several per model, most padded
      over.parallel = over.parallel or {}
      over.parallel.bucket_mb = 0.02
      return base_cfg(("%s-%d-%g"):format(name, ci, clip), ffn, over)
    end
    local ddp, ddp_opt = run_with_opt(cfg_of("ddp"))
    for _, lay in ipairs(layouts) do
      local what = ("%s clip=%g dp_replicate=%d x dp_shard=%d vs dp=%d"):format(label, clip, lay.rep, lay.shard, world)
      local z, zopt = run_with_opt(cfg_of(("zero%dx%d"):format(lay.rep, lay.shard),
        { parallel = { dp_shard = lay.shard, dp_replicate = lay.rep } }))
      local rl = max_rel(z.losses, ddp.losses, opts.steps)
      local same, np, maxd = compare_params(z.model, ddp.model)
      local zb, db = state_bytes(zopt), state_bytes(ddp_opt)
      local agg = moe.tensor({ rl, np - same, maxd, zb }, { dtype = "f64" })
      dist.all_reduce(agg, "max")
      local g = agg:totable()
      say("%s: max rel diff of the lm loss over %d steps %.3e; %d of %d parameters bit-identical " ..
        "(max |diff| %.3e); optimizer state %d bytes per rank (max) vs %d (ratio %.3f, 1/P = %.3f)",
        what, opts.steps, g[1], np - g[2], np, g[3], math.tointeger(g[4]), db, g[4] / db, 1 / lay.shard)
      if opts.verbose then
        for s = 1, opts.steps do say("  step %2d  zero %.9f  ddp %.9f", s, z.losses[s], ddp.losses[s]) end
      end
      -- memory: 1/P of the DDP state, plus padding (< P elements per state tensor and bucket)
      local nb = #zopt.buckets
      expect(zb <= db / lay.shard + 3 * 4 * lay.shard * nb,
        ("%s: optimizer state %d bytes, DDP %d / %d = %g"):format(what, zb, db, lay.shard, db / lay.shard))
      if clip == 0 and world == 2 then
        expect(rl == 0 and same == np, ("%s: not bit-identical (loss %.3e, %d parameters differ)"):format(what, rl, np - same))
      else
        expect(rl <= 1e-4, ("%s: losses differ by %.3e > 1e-4"):format(what, rl))
      end
    end
    dist.barrier()
  end
end

-- errors: a product that is not the world size; SGD
do
  local ok, err = pcall(train.run, base_cfg("bad", "dense", { parallel = { dp_shard = world + 1 } }))
  expect(not ok and tostring(err):find("must be the world size"), "dp_shard = world + 1: " .. tostring(err))
  ok, err = pcall(train.run, base_cfg("sgd", "dense", { parallel = { dp_shard = world }, optimizer = "sgd" }))
  expect(not ok and tostring(err):find("optimizer=adamw"), "sgd: " .. tostring(err))
end

os.execute("rm -rf '" .. root .. "'")
local bad = moe.tensor({ #failures }, { dtype = "f64" })
dist.all_reduce(bad, "max")
if bad:item() > 0 then error(("zero_equivalence: %d check(s) failed"):format(math.tointeger(bad:item())), 0) end
say("zero_equivalence: ok")
