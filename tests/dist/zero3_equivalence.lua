--[[
tests/dist/zero3_equivalence.lua - parameter sharding (train's
parallel.shard_params with dp_shard: ZeRO-3, moe/fsdp.lua) against data
parallelism (DDP, parallel.dp), on the CPU:

  moe-lua launch -n 2 tests/dist/zero3_equivalence.lua [steps=8] [verbose=true]
  moe-lua launch -n 4 tests/dist/zero3_equivalence.lua

A small dMoE and a dense GPT (tied embeddings) train both ways inside one job.
Without clipping on 2 ranks the two are bit for bit the same (asserted): the
gathered parameters are the values DDP holds, the reduce_scatter (avg) of 2
ranks is DDP's all_reduce (avg) per element, and the sharded AdamW steps the
same elements with the same inputs. With clipping (the norm summed per unit
shard) and on 4 ranks (MPI's order of a 4-rank sum), within 1e-4 relative on
the losses. Also, at every step's end: no unit holds its gathered parameters
(each was released after its forward or its gradients' reduce_scatter) but
the root and the first parallel.prefetch blocks, which the optimizer started
gathering (prefetch 1, the default 2, and 3 on a model of 4 blocks), the
gathers per step are at least one per unit in forward and one per block in
backward, and this rank's parameter shards are 1/P of the parameters (plus
padding); the model's state dict (gathered) equals DDP's model.
]]
local moe = require "moe"
local train = require "moe.train"

local opts = moe.config { steps = 8, verbose = false, loss_weight = 0.01, tie_embeddings = true,
  device = "cpu" }
local dist = moe.dist
dist.init()
local rank, world = dist.rank(), dist.world_size()
assert(world == 2 or world == 4, ("run under moe-lua launch -n 2 or -n 4 (world size %d)"):format(world))

local function say(...) if rank == 0 then print(string.format(...)) end end

local K = dofile(arg[0]:match("^(.*/)") .. "trainkit.lua")
local root, prefix = K.corpus(rank)

local failures = {}
local function expect(ok, msg)
  if not ok then failures[#failures + 1] = msg; io.stderr:write(("[rank %d] FAILED: %s\n"):format(rank, msg)) end
end

-- the state dicts of two models: how many tensors bit-identical, the largest |difference|
local function compare_sd(a, b)
  local same, n, maxd = 0, 0, 0
  for k, ta in pairs(a) do
    local tb = b[k]
    n = n + 1
    if tb == nil then
      maxd = math.huge
    else
      local x, y = ta:double():reshape({ -1 }):totable(), tb:double():reshape({ -1 }):totable()
      local eq = #x == #y
      for j = 1, math.min(#x, #y) do
        if x[j] ~= y[j] then
          eq = false
          maxd = math.max(maxd, math.abs(x[j] - y[j]))
        end
      end
      if eq then same = same + 1 end
    end
  end
  return same, n, maxd
end

-- ffn, clip, parallel.prefetch (nil: the default, 2) and the blocks (nil: 2)
local cases = { { "moe", 0, prefetch = 1 }, { "moe", 1.0 }, { "dense", 0 }, { "dense", 1.0, prefetch = 1 },
  { "moe", 0, layers = 4, prefetch = 3 } }
for ci, case in ipairs(cases) do
  local ffn, clip, prefetch = case[1], case[2], case.prefetch or 2
  local first_blocks = math.min(prefetch, case.layers or 2)
  local label = (ffn == "moe" and "dMoE" or "dense GPT") .. (case.layers and (" of %d blocks"):format(case.layers) or "")
  local function cfg_of(name, over)
    over = over or {}
    over.model = { tie_embeddings = opts.tie_embeddings, n_layers = case.layers }
    over.clip = clip
    return K.base_cfg(opts, root, prefix, ("%s-%d-%g"):format(name, ci, clip), ffn, over)
  end
  local ddp = train.run(cfg_of("ddp"))
  local what = ("%s clip=%g shard_params (prefetch %d) over %d ranks vs dp=%d"):format(label, clip, prefetch,
    world, world)
  local checked, last_gathers, per_step = 0, nil, math.huge
  local sh
  local z = train.run(cfg_of("zero3", { parallel = { dp_shard = world, shard_params = true,
    prefetch = case.prefetch } }), {
    hooks = { after_step = function(state)
      sh = state.parallel.fsdp
      -- after the step every unit is released, but those the next forward needs first (the
      -- root's and the first `prefetch` blocks'), which the optimizer started gathering
      local first = {}
      local fu = sh:first_units()
      expect(#fu == 1 + first_blocks and fu[1] == sh.units[sh.root].unit,
        ("%s: step %d: %d first units, the root's and %d blocks' expected"):format(what, state.step, #fu,
          first_blocks))
      for _, u in ipairs(fu) do first[u] = true end
      for g, u in pairs(sh.units) do
        expect(first[u.unit] or not u.unit:ready(), ("%s: step %d: unit %d still gathered after the step"):format(
          what, state.step, g))
      end
      local g = sh:stats().gathers
      if last_gathers then per_step = math.min(per_step, g - last_gathers) end
      last_gathers = g
      checked = checked + 1
    end },
  })
  expect(checked == opts.steps, ("%s: the hook ran %d times"):format(what, checked))
  local units = sh:stats().units
  local blocks = units - 1
  -- the reduce_scatters go in bucket order: the last block's first, the root's (the embedding's
  -- gradient is done only at the end of backward) last, so none waits for it
  expect(sh.units[sh.root].bucket == #sh.layout.buckets and sh.units[blocks].bucket == 1,
    ("%s: the root unit's bucket is %d and the last block's %d of %d (the root's last, the last " ..
      "block's first expected)"):format(what, sh.units[sh.root].bucket, sh.units[blocks].bucket,
      #sh.layout.buckets))
  -- forward: every unit once; backward: every block again but the last (the root and the last
  -- block stay gathered from forward to backward)
  expect(per_step >= units + blocks - 1, ("%s: %d gathers in a step, at least %d expected"):format(what,
    per_step, units + blocks - 1))
  local n_bytes = 0
  for _, np in ipairs(z.model:named_parameters()) do n_bytes = n_bytes + np[2]:numel() * 4 end
  local sb = sh:shard_bytes()
  expect(sb <= n_bytes / world + 4 * world * units,
    ("%s: parameter shards %d bytes, parameters %d / %d"):format(what, sb, n_bytes, world))
  local rl = K.max_rel(z.losses, ddp.losses, opts.steps)
  local same, n, maxd = compare_sd(z.model:state_dict(), ddp.model:state_dict())
  local agg = moe.tensor({ rl, n - same, maxd }, { dtype = "f64" })
  dist.all_reduce(agg, "max")
  local a = agg:totable()
  say("%s: max rel diff of the lm loss over %d steps %.3e; %d of %d tensors bit-identical (max |diff| " ..
    "%.3e); %d units, at least %d gathers per step; parameter shards %d of %d bytes", what, opts.steps,
    a[1], n - a[2], n, a[3], units, per_step, sb, n_bytes)
  if opts.verbose then
    for s = 1, opts.steps do say("  step %2d  zero3 %.9f  ddp %.9f", s, z.losses[s], ddp.losses[s]) end
  end
  if clip == 0 and world == 2 then
    expect(rl == 0 and same == n, ("%s: not bit-identical (loss %.3e, %d tensors differ)"):format(what, rl,
      n - same))
  else
    expect(rl <= 1e-4, ("%s: losses differ by %.3e > 1e-4"):format(what, rl))
  end
  dist.barrier()
end

-- errors: shard_params without dp_shard
do
  local ok, err = pcall(train.run, K.base_cfg(opts, root, prefix, "bad1", "dense",
    { parallel = { shard_params = true } }))
  expect(not ok and tostring(err):find("needs parallel.dp_shard", 1, true), "no dp_shard: " .. tostring(err))
  ok, err = pcall(train.run, K.base_cfg(opts, root, prefix, "bad2", "dense",
    { parallel = { dp_shard = world, prefetch = 2 } }))
  expect(not ok and tostring(err):find("parallel.prefetch=2 needs parallel.shard_params=true or a layout", 1, true),
    "prefetch without shard_params: " .. tostring(err))
  ok, err = pcall(train.run, K.base_cfg(opts, root, prefix, "bad3", "dense",
    { parallel = { dp_shard = world, shard_params = true, prefetch = -1 } }))
  expect(not ok and tostring(err):find("parallel.prefetch must be an integer >= 0, got -1", 1, true),
    "prefetch=-1: " .. tostring(err))
end

os.execute("rm -rf '" .. root .. "'")
local bad = moe.tensor({ #failures }, { dtype = "f64" })
dist.all_reduce(bad, "max")
if bad:item() > 0 then error(("zero3_equivalence: %d check(s) failed"):format(math.tointeger(bad:item())), 0) end
say("zero3_equivalence: ok")
