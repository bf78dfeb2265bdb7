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

Sharded data parallelism (ZeRO-2, HSDP; docs/DISTRIBUTED.md "Sharded data
parallelism"): parallel.dp_shard = N (and dp_replicate = M, default 1) with
N * M = the world size. The data are still split over all N * M ranks (par.dp
is the world size); the gradients are reduce_scatter'ed over the dp_shard
group and the optimizer state is sharded over it (par:sharded_optimizer).

  par.sharded, par.dp_shard, par.dp_replicate, par.shard_group, par.replicate_group
  par:sharded_optimizer(named, cfg)   -- optim.ShardedAdamW; its reducer is opt.reducer

parallel.dp = 0 (the default) means the job's world size: under mpirun, srun
or `moe-lua launch` every rank holds the whole model; started alone, dp = 1.
dp = 1 in a job of several ranks turns data parallelism off: each process
trains alone (a reference run inside a job). Any other dp must equal the
world size for now (expert parallelism comes later).
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

-- dp_shard, dp_replicate of cfg.parallel, checked against the world size; nil
-- when sharding is off.
local function sharding_of(cfg, world)
  local pc = cfg.parallel
  if pc.dp_shard == 0 and pc.dp_replicate == 0 then return nil end
  if pc.dp_shard == 0 then
    error(("train: parallel.dp_replicate=%d needs parallel.dp_shard (the ranks each replica is " ..
      "sharded over)"):format(pc.dp_replicate), 0)
  end
  local shard, rep = pc.dp_shard, pc.dp_replicate == 0 and 1 or pc.dp_replicate
  if shard * rep ~= world then
    error(("train: parallel.dp_shard=%d x dp_replicate=%d = %d but the job has %d rank%s (their " ..
      "product must be the world size)"):format(shard, rep, shard * rep, world, world == 1 and "" or "s"), 0)
  end
  if pc.dp ~= 0 and pc.dp ~= world then
    error(("train: parallel.dp=%d with dp_shard=%d x dp_replicate=%d: data parallelism spans the %d ranks " ..
      "(leave dp at 0)"):format(pc.dp, shard, rep, world), 0)
  end
  if cfg.optimizer ~= "adamw" then
    error(("train: parallel.dp_shard needs optimizer=adamw (the sharded optimizer is AdamW), got %s"):format(
      tostring(cfg.optimizer)), 0)
  end
  return shard, rep
end

-- The shard and replicate groups of a dp_replicate x dp_shard mesh (dp_shard
-- varies fastest: a shard group is consecutive ranks).
local function setup_sharding(par, shard, rep)
  local mesh = par.dist.mesh { dp_replicate = rep, dp_shard = shard }
  par.sharded, par.dp_shard, par.dp_replicate = true, shard, rep
  par.mesh = mesh
  par.shard_group = mesh:group("dp_shard")
  if rep > 1 then par.replicate_group = mesh:group("dp_replicate") end
end

--- setup(cfg) -> par. Initialises moe.dist when dp > 1 or sharding is on.
function M.setup(cfg)
  local pc = cfg.parallel
  local world = launched_world_size()
  local shard, rep = sharding_of(cfg, world)
  local dp = (pc.dp == 0 or shard) and world or pc.dp
  local par = setmetatable({ dp = dp, rank = 0, writer = true, world = world }, Par)
  if dp == 1 and not shard then return par end
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
  if shard then setup_sharding(par, shard, rep) end
  return par
end

--- par:sharded_optimizer(named, cfg) -> optim.ShardedAdamW over the dp_shard group
--- (and the dp_replicate group), from cfg's AdamW settings; opt.reducer is its
--- reduce_scatter reducer.
function Par:sharded_optimizer(named, cfg)
  return require("moe.optim").ShardedAdamW(named, { lr = cfg.lr, betas = { cfg.beta1, cfg.beta2 },
    eps = cfg.eps, weight_decay = cfg.weight_decay, group = self.shard_group,
    replicate_group = self.replicate_group, bucket_mb = cfg.parallel.bucket_mb })
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
