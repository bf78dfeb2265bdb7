--[[
moe/train/parallel.lua - data parallelism for moe.train (cfg.parallel,
docs/DISTRIBUTED.md "Data parallelism"): the ranks, the device of each, the
shard of each global batch a rank reads, the model made identical on every
rank, the gradient reducer, and the global means of what is logged.

  local par = parallel.setup(cfg)     -- {dp =, rank =, writer =, device = or nil, ...}
  par:batch(data, B)                  -- this rank's B rows of the global batch of dp * B
  par:broadcast_params(params)        -- rank 0's values everywhere (before the optimizer)
  par:reducer(params)                 -- the bucketed all_reduce(avg) of the gradients
  par:mean(values)                    -- {v1, ...} -> their means over ranks (one collective)
  par:barrier(), par:close()

parallel.dp = 0 (the default) means the job's world size: under mpirun, srun
or `moe-lua launch` every rank holds the whole model; started alone, dp = 1.
dp = 1 in a job of several ranks turns data parallelism off: each process
trains alone (a reference run inside a job). Any other dp must equal the
world size for now (expert and sharded data parallelism come later).
]]
local moe = require "moe"

local M = {}

local Par = {}
Par.__index = Par

local function dist_module()
  local d = moe.dist
  if d == nil then
    local ok, m = pcall(require, "moe.dist")
    if ok then d = m end
  end
  if d == nil then error("train: parallel.dp > 1 needs moe.dist, which this build lacks", 0) end
  return d
end

-- The world size the launcher gave this process, read from the environment
-- (moe_dist_env_read's order: Open MPI, Slurm, torchrun's names) without
-- initialising anything.
local function launched_world_size()
  local d = moe.dist
  if d and d.env then
    local ok, env = pcall(d.env)
    if ok and type(env) == "table" and env.world_size then return env.world_size end
  end
  local function int(name) return math.tointeger(tonumber(os.getenv(name) or "")) end
  return int("OMPI_COMM_WORLD_SIZE") or (os.getenv("SLURM_PROCID") and int("SLURM_NTASKS"))
    or int("WORLD_SIZE") or 1
end

--- setup(cfg) -> par. Initialises moe.dist when dp > 1.
function M.setup(cfg)
  local pc = cfg.parallel
  local world = launched_world_size()
  local dp = pc.dp == 0 and world or pc.dp
  local par = setmetatable({ dp = dp, rank = 0, writer = true, world = world }, Par)
  if dp == 1 then return par end
  if dp ~= world then
    error(("train: parallel.dp=%d but the job has %d rank%s: data parallelism spans every rank for " ..
      "now (launch %d ranks, or set parallel.dp=%d, or parallel.dp=1 to train each rank alone)"):format(
      dp, world, world == 1 and "" or "s", dp, world), 0)
  end
  local dist = dist_module()
  dist.init()
  par.dist = dist
  par.rank = dist.rank()
  par.writer = par.rank == 0
  if dist.world_size() ~= dp then
    error(("train: parallel.dp=%d but moe.dist found %d ranks"):format(dp, dist.world_size()), 0)
  end
  -- each rank its GPU: cuda:<local rank>
  if cfg.device == "cpu" then
    par.device = "cpu"
  elseif cfg.device == "cuda" then
    if not (moe.cuda and moe.cuda.is_available()) then
      error("train: device=cuda but no CUDA device is available (use device=auto or device=cpu)", 0)
    end
    par.device = "cuda:" .. dist.local_rank()
  else
    par.device = dist.device()
  end
  return par
end

--- par:batch(data, B) -> x, y: rows [rank * B, (rank + 1) * B) of the global batch
--- of dp * B sequences, drawn as one process would draw it (every rank draws it,
--- so the data order is the same everywhere; a dataset with shard_batch reads
--- only its rows).
function Par:batch(data, B)
  if self.dp == 1 then return data:batch(B) end
  if data.shard_batch then return data:shard_batch(B, self.rank, self.dp) end
  local x, y = data:batch(B * self.dp)
  return x:narrow(0, self.rank * B, B):contiguous(), y:narrow(0, self.rank * B, B):contiguous()
end

--- par:broadcast_params(params): every parameter takes rank 0's values.
function Par:broadcast_params(params)
  if self.dp == 1 then return end
  local dist = self.dist
  moe.no_grad(function()
    for _, p in ipairs(params) do dist.broadcast(p, 0) end
  end)
end

--- par:reducer(params, bucket_mb) -> the gradient reducer over the parameters
--- that require grad, or nil when dp == 1.
function Par:reducer(params, bucket_mb)
  if self.dp == 1 then return nil end
  local list = {}
  for _, p in ipairs(params) do
    if p.requires_grad then list[#list + 1] = p end
  end
  return self.dist.reducer(list, { bucket_mb = bucket_mb })
end

--- par:sum(values) -> the sums over ranks of a list of numbers (one all_reduce of
--- a CPU f64 tensor; values returned as they are when dp == 1).
function Par:sum(values)
  if self.dp == 1 or #values == 0 then return values end
  local t = moe.tensor(values, { dtype = "f64" })
  self.dist.all_reduce(t, "sum")
  local out = t:totable()
  t:free()
  return out
end

--- par:mean(values) -> the means over ranks (the sum divided by dp, in f64: for two
--- ranks (a + b) / 2, what gradient accumulation over the same two batches gives).
function Par:mean(values)
  local s = self:sum(values)
  if self.dp == 1 then return s end
  local out = {}
  for i, v in ipairs(s) do out[i] = v / self.dp end
  return out
end

function Par:barrier()
  if self.dp > 1 then self.dist.barrier() end
end

return M
