--[[
tests/dist/nonfinite_train.lua - non-finite steps under data parallelism
(parallel.dp) and sharded data parallelism (parallel.dp_shard, ZeRO-2), on
the CPU:

  moe-lua launch -n 2 tests/dist/nonfinite_train.lua

At step 4 only rank 1 makes its gradient NaN, after the reduction (so its
gradient norm alone is NaN, and without agreement rank 0 would update and
rank 1 not). The ranks agree in the step's collective (moe/train/loop.lua):
both skip step 4, count it, and end with the same parameters. Then the same
with NaN from step 3 on and max_skipped_in_a_row = 2: every rank raises the
same error at the same step.
]]
local moe = require "moe"
local train = require "moe.train"
local K = dofile(arg[0]:match("^(.*/)") .. "trainkit.lua")

local dist = moe.dist
dist.init()
local rank = dist.rank()
assert(dist.world_size() == 2, "run under moe-lua launch -n 2")
local root, prefix = K.corpus(rank)

-- NaN in rank 1's first gradient (DDP: a parameter's .grad; ZeRO: its first
-- gradient shard, the sharded optimizer having released .grad) at steps
-- first .. last.
local function poison_from(first, last)
  return function(state)
    if rank == 1 and state.step + 1 >= first and state.step + 1 <= last then
      local g
      if state.optimizer.reducer then
        g = state.optimizer.reducer:shard(1)
      else
        for _, p in ipairs(state.params) do g = g or p.grad end
      end
      g:copy_(moe.full(g.shape, 0 / 0))
    end
  end
end

-- The largest |difference| of a parameter between the ranks (0 when equal).
local function spread(params)
  local worst = 0
  for _, p in ipairs(params) do
    local a, b = p:clone(), p:clone()
    dist.all_reduce(a, "max")
    dist.all_reduce(b, "min")
    local d = (a - b):abs():max():item()
    if d ~= d then d = math.huge end
    worst = math.max(worst, d)
  end
  return worst
end

for _, mode in ipairs({ { "dp", { parallel = { dp = 2 } } }, { "dp_shard", { parallel = { dp_shard = 2 } } } }) do
  local cfg = K.base_cfg({ steps = 8, device = "cpu" }, root, prefix, mode[1], "moe", mode[2])
  cfg.eval_every = 0
  local skipped_at = {}
  local r = train.run(cfg, { hooks = { after_backward = poison_from(4, 4),
    after_step = function(state) if state.skipped then skipped_at[#skipped_at + 1] = state.step end end } })
  assert(r.step == 8, mode[1] .. ": ran " .. r.step .. " steps")
  assert(r.skipped_steps == 1 and #skipped_at == 1 and skipped_at[1] == 4,
    ("%s: rank %d skipped %d steps (%s)"):format(mode[1], rank, r.skipped_steps, table.concat(skipped_at, ",")))
  local params = {}
  for _, p in ipairs(r.model:named_parameters()) do params[#params + 1] = p[2] end
  local s = spread(params)
  assert(s == 0, ("%s: the ranks' parameters differ by %g after a skipped step"):format(mode[1], s))
  if rank == 0 then print(("%s: step 4 skipped on both ranks, parameters equal"):format(mode[1])) end

  cfg = K.base_cfg({ steps = 8, device = "cpu" }, root, prefix, mode[1] .. "_stop", "moe", mode[2])
  cfg.eval_every, cfg.max_skipped_in_a_row = 0, 2
  local ok, err = pcall(train.run, cfg, { hooks = { after_backward = poison_from(3, 8) } })
  assert(not ok and tostring(err):find("2 steps in a row had a non%-finite loss or gradient norm %(" ..
    "max_skipped_in_a_row=2; the last at iteration 4"), tostring(err))
  if rank == 0 then print(("%s: both ranks stopped at step 4"):format(mode[1])) end
end
os.execute("rm -rf '" .. root .. "'")
