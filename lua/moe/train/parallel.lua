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

Checkpoints of a job of several ranks (moe/train/dcp.lua; docs/DISTRIBUTED.md
"Checkpoints"): every rank writes what it owns and is the first to hold.
  par.distributed                      true once moe.dist is in use (checkpoints are sharded)
  par:save_checkpoint(step, model, opt, data, state_tbl) -> the committed path or nil
  par:finish_checkpoint() -> the committed path or nil (an asynchronous save's commit)
  par:uses_dcp(path)                   resume through dcp (an index, or a sharded layout)
  par:load_checkpoint(path, model, opt) -> {state =, path =}: any layout's checkpoint

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
world size for now (expert parallelism divides the ranks further: below;
sharded data parallelism: parallel.dp_shard / dp_replicate).

parallel.ep = N > 1 (expert parallelism, docs/DISTRIBUTED.md "Expert
parallelism"): the MoE layers' experts are sharded over groups of N ranks
(the mesh {dp = world / N, ep = N}); data parallelism still spans the world.
The EP part is setup_ep and the Par methods below it:
  par:attach(model)            which parameters are expert shards
  par:finish_experts()         after the reducer: the expert gradients averaged
                               over the ranks holding the same experts, / N
  par:ep_clip(clip_fn)         clipping by the norm over every shard

parallel.etp = N > 1 (expert-tensor sharding, docs/DISTRIBUTED.md "Expert-
tensor sharding"): every expert's hidden units are split over groups of N
ranks (moe/layers/wp.lua), alone or with ep (the mesh {dp = world / (ep N),
ep, etp = N}); the same methods handle both kinds of expert shard (par.shards
= ep N ranks hold the pieces of one expert set; their gradients / ep N).

Parameter sharding (parallel.shard_params, ZeRO-3; moe/fsdp.lua) with
dp_shard, with dp_replicate (HSDP) and with ep / etp: the dense parameters
in units over dp_shard, the expert shards placed by ep / etp and, with
data-parallel ranks left over, sharded over those too (M.expert_shards).

Layouts as Lua functions (train.run(cfg, {layout = fn}); docs/DISTRIBUTED.md
"Layouts as Lua functions"): par:attach(model, fn) asks fn(name, module) for
every module (M.place) and checks the answers before anything trains;
par:sharded_optimizer then builds the units the layout asked for.
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

-- With parameter sharding the gradients' reduce_scatters get a communicator
-- of their own over the shard group's ranks (on a GPU its own stream too): in
-- backward they then run beside the parameter gathers of the blocks ahead
-- instead of queueing with them on the shard group's one stream. Split once
-- per shard group, the first time (a collective over it).
local reduce_groups = setmetatable({}, { __mode = "k" })

function Par:reduce_group()
  local g = self.shard_group
  reduce_groups[g] = reduce_groups[g] or g:split(0, g:rank(), g:name() .. ".reduce")
  return reduce_groups[g]
end

--- setup(cfg) -> par. Initialises moe.dist when dp > 1 or sharding is on.
function M.setup(cfg)
  local pc = cfg.parallel
  local world = launched_world_size()
  local shard, rep = sharding_of(cfg, world)
  if pc.shard_params and not shard then
    error("train: parallel.shard_params=true needs parallel.dp_shard (the ranks the parameters are sharded " ..
      "over)", 0)
  end
  if pc.prefetch ~= 0 and not pc.shard_params and not shard then
    error(("train: parallel.prefetch=%d needs parallel.shard_params=true (it is how far ahead the sharded " ..
      "parameters are gathered)"):format(pc.prefetch), 0)
  end
  local dp = (pc.dp == 0 or shard) and world or pc.dp
  local par = setmetatable({ dp = dp, ep = 1, etp = 1, shards = 1, rank = 0, writer = true, world = world }, Par)
  if dp == 1 and not shard then
    for _, k in ipairs({ "ep", "etp" }) do
      if pc[k] > 1 then
        error(("train: parallel.%s=%d needs data parallelism over the job's ranks (launch a multiple of %d " ..
          "ranks and leave parallel.dp=0)"):format(k, pc[k], pc[k]), 0)
      end
    end
    -- one process: synchronous saves are single-file checkpoints (moe/checkpoint.lua);
    -- save_async writes the sharded format with one shard (moe/train/dcp.lua)
    par.ckpt_opts = { out_dir = cfg.out_dir, keep_last = cfg.keep_last, async = cfg.save_async }
    return par
  end
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
  if pc.ep > 1 or pc.etp > 1 then M.setup_ep(par, pc.ep, pc.etp) end
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
  par.shard_params = pc.shard_params
  par.prefetch = pc.prefetch > 0 and pc.prefetch or nil -- nil: moe.fsdp's default
  par.distributed = true
  par.ckpt_opts = { out_dir = cfg.out_dir, keep_last = cfg.keep_last, async = cfg.save_async }
  return par
end

--- par:sharded_optimizer(named, cfg) -> optim.ShardedAdamW over the dp_shard group
--- (and the dp_replicate group), from cfg's AdamW settings; opt.reducer is its
--- reduce_scatter reducer.
--- With expert shards (ep, etp) those are left out of it: an optim.AdamW steps
--- them (their gradients are the experts' own: par:finish_experts), and the
--- two behave as one optimizer (Sharded.with_experts below).
--- With parallel.shard_params (ZeRO-3) the model's parameters are sharded too
--- (moe/fsdp.lua): par.fsdp, and the model's parameters are new tensors (take
--- them from the model again, or from par.fsdp.named).
function Par:sharded_optimizer(named, cfg, model)
  local optim = require "moe.optim"
  local o = { lr = cfg.lr, betas = { cfg.beta1, cfg.beta2 }, eps = cfg.eps, weight_decay = cfg.weight_decay }
  local pl = self.placement
  if pl and #pl.units > 0 then return self:placed_optimizer(model, o) end
  if cfg.parallel.shard_params and not pl then
    -- ZeRO-3: the units over the shard group (HSDP: replicas hold equal shards and
    -- all-reduce their gradient shards over the replicate group); expert shards stay
    -- out of the units, placed by ep / etp, stepped by AdamW as with ZeRO-2
    local sh = require("moe.fsdp").shard(model, { group = self.shard_group, exclude = self.expert_set,
      prefetch = self.prefetch })
    self.fsdp = sh
    o.group, o.replicate_group, o.groups, o.units = self.shard_group, self.replicate_group, sh.groups, sh.units
    o.reduce_group = self:reduce_group()
    local sharded = optim.ShardedAdamW(sh.named, o)
    sharded.first_units = sh:first_units()
    if not self.expert_set then return sharded end
    return M.with_experts(sharded, self:expert_optimizer(model, sh.kept, o), self)
  end
  if not self.expert_set then
    o.group, o.replicate_group, o.bucket_mb = self.shard_group, self.replicate_group, cfg.parallel.bucket_mb
    return optim.ShardedAdamW(named, o)
  end
  local dense, experts = {}, {}
  for _, np in ipairs(named) do
    if self.expert_set[np[2]] then experts[#experts + 1] = np else dense[#dense + 1] = np end
  end
  local eopt = optim.AdamW(experts, o)
  o.group, o.replicate_group, o.bucket_mb = self.shard_group, self.replicate_group, cfg.parallel.bucket_mb
  return M.with_experts(optim.ShardedAdamW(dense, o), eopt, self)
end

-- The optimizer of a layout with units (M.place): the units' parameters
-- sharded (moe/fsdp.lua), the replicated ones whole with their gradients and
-- state sharded (ZeRO-2), one bucket per unit and per replicating module; the
-- expert shards stepped by AdamW (as with ZeRO-2 and expert shards).
function Par:placed_optimizer(model, o)
  local optim = require "moe.optim"
  local pl = self.placement
  local sh = require("moe.fsdp").shard(model, { group = self.shard_group, modules = pl.units,
    assign = pl.assign, exclude = pl.whole, prefetch = self.prefetch })
  self.fsdp = sh
  local group_of, used = {}, {}
  for i, np in ipairs(sh.named) do
    group_of[np[2]] = sh.groups[i]
    used[sh.groups[i]] = true
  end
  local base = #pl.units + (used[#pl.units + 1] and 2 or 1) -- after the root unit, when it has parameters
  for t, k in pairs(pl.replicated) do group_of[t] = base + k - 1 end
  local list, groups, experts = {}, {}, {}
  for _, np in ipairs(model:named_parameters()) do -- model order: buckets launch as backward completes them
    local g = group_of[np[2]]
    if g then
      list[#list + 1] = np
      groups[#groups + 1] = g
    elseif self.expert_set and self.expert_set[np[2]] then
      experts[#experts + 1] = np
    end
  end
  -- the root unit's parameters first, so that its bucket launches last (moe/fsdp.lua says why)
  local root_group, rl, rg = #pl.units + 1, {}, {}
  for pass = 1, 2 do
    for i, np in ipairs(list) do
      if (groups[i] == root_group) == (pass == 1) then rl[#rl + 1], rg[#rg + 1] = np, groups[i] end
    end
  end
  list, groups = rl, rg
  o.group, o.replicate_group, o.groups, o.units = self.shard_group, self.replicate_group, groups, sh.units
  o.reduce_group = self:reduce_group()
  local sharded = optim.ShardedAdamW(list, o)
  sharded.first_units = sh:first_units()
  if #experts == 0 then return sharded end
  return M.with_experts(sharded, self:expert_optimizer(model, experts, o), self)
end

-- The optimizer of the expert shards under parameter sharding: AdamW over
-- them whole, or, with parallel.shard_params and data-parallel ranks left
-- over (world > ep x etp), M.expert_shards: sharded over those ranks too.
function Par:expert_optimizer(model, experts, o)
  local ao = { lr = o.lr, betas = o.betas, eps = o.eps, weight_decay = o.weight_decay }
  if self.shard_params and self.replica_group then return M.expert_shards(self, model, ao) end
  return require("moe.optim").AdamW(experts, ao)
end

-- ------------------------------------------- expert shards, sharded again

-- With parallel.shard_params and a replica group (the world / (ep etp) ranks
-- holding the same expert shard), each MoE layer's experts module becomes a
-- unit of its own over the replica group (moe/fsdp.lua: gathered for the
-- experts' forward and backward, released after each), and its gradient is
-- reduce-scattered (avg) over that group once backward is done, then divided
-- by ep x etp: the same gradient rule as par:finish_experts, on 1/R of the
-- elements. AdamW steps each rank's shard (its moments 1/R of the shard's);
-- the step writes into the unit's shard, the next forward gathers it.
-- Not through the reducer: a backward arms one reducer, the dense one.
local ExpertShards = {}
ExpertShards.__index = ExpertShards

function M.expert_shards(par, model, o)
  local mods, idx, assign, exclude = {}, {}, {}, {}
  for _, e in ipairs(model:named_modules()) do
    local m = e[2]
    for _, pn in ipairs(m._params) do
      local t = rawget(m, pn)
      if t ~= nil and par.expert_set[t] then
        if not idx[m] then
          mods[#mods + 1] = m
          idx[m] = #mods
        end
        assign[t] = idx[m]
      end
    end
  end
  for _, np in ipairs(model:named_parameters()) do
    if not assign[np[2]] then exclude[np[2]] = true end
  end
  local group = par.replica_group
  -- one layer's experts gathered ahead (parallel.prefetch counts blocks of the dense units)
  local sh = require("moe.fsdp").shard(model, { group = group, modules = mods, assign = assign, exclude = exclude,
    prefetch = 1 })
  local R, r = group:size(), group:rank()
  local self = setmetatable({ par = par, sh = sh, lr = o.lr, step_count = 0, group = group, units = {},
    hyper = { beta1 = o.betas[1], beta2 = o.betas[2], eps = o.eps, weight_decay = o.weight_decay } }, ExpertShards)
  -- per unit: its parameters' places in the flat buffer and this rank's part of each
  for g = 1, #mods do
    local u = sh.units[g]
    local b = sh.layout.buckets[u.bucket]
    local S = b.shard_numel
    local e = { unit = u.unit, shard = u.shard, padded = u.padded, S = S, dtype = b.dtype, device = b.device,
      params = {}, segments = {}, bucket = u.bucket }
    moe.no_grad(function()
      local sd = b.dtype == "f64" and "f64" or "f32"
      e.exp_avg = moe.keep(moe.zeros({ S }, { dtype = sd, device = b.device }))
      e.exp_avg_sq = moe.keep(moe.zeros({ S }, { dtype = sd, device = b.device }))
      if b.dtype == "bf16" or b.dtype == "f16" then
        e.master = moe.keep(moe.zeros({ S }, { dtype = "f32", device = b.device }))
        e.master:copy_(u.shard)
      end
    end)
    self.units[g] = e
  end
  par.expert_params, par.expert_set = {}, {}
  for i, np in ipairs(sh.named) do
    local where = sh.layout.params[i]
    local g = sh.groups[i]
    local e = self.units[g]
    local t, n = np[2], np[2]:numel()
    e.params[#e.params + 1] = { param = t, offset = where.offset, numel = n }
    -- this rank's elements of t: [a, b) of the flat buffer within [r S, (r + 1) S)
    local a, bnd = math.max(where.offset, r * e.S), math.min(where.offset + n, (r + 1) * e.S)
    if bnd > a then
      e.segments[#e.segments + 1] = { offset = a - r * e.S, numel = bnd - a,
        weight_decay = t:dim() < 2 and 0 or self.hyper.weight_decay }
    end
    par.expert_params[#par.expert_params + 1] = t
    par.expert_set[t] = true
  end
  assert(R == sh.layout.size or R == 1)
  par.expert_fsdp = self
  return self
end

--- finish(): after backward (the last micro-batch): every unit's gradient
--- reduce-scattered (avg) over the replica group and divided by ep x etp,
--- the full gradients dropped and the units released.
function ExpertShards:finish()
  local scale = 1 / self.par.shards
  moe.no_grad(function()
    for _, e in ipairs(self.units) do
      local flat = moe.zeros({ e.padded }, { dtype = e.dtype, device = e.device })
      for _, p in ipairs(e.params) do
        local g = p.param.grad
        if g ~= nil then flat:narrow(0, p.offset, p.numel):copy_(g:reshape({ p.numel })) end
        p.param.grad = nil -- a shard no token reached: zeros, as one process has
      end
      local gs = moe.empty({ e.S }, { dtype = e.dtype, device = e.device })
      self.par.dist.reduce_scatter(gs, flat, "avg", { group = self.group })
      flat:free()
      if e.grad then e.grad:free() end
      e.grad = moe.keep(gs * scale)
      gs:free()
      e.unit:release()
    end
  end)
end

--- sumsq() -> the sum over the world of the squares of every rank's
--- gradient shards (each rank holds distinct elements of the experts).
function ExpertShards:sumsq()
  local sq, list = 0, {}
  for _, e in ipairs(self.units) do list[#list + 1] = e.grad end
  if #list > 0 then -- one norm over every shard (f32 sums, on the CPU and on CUDA), one read
    local n = moe.no_grad(function()
      return moe.scope(function() return moe.ops.grad_norm_multi(list, nil):item() end)
    end)
    sq = n * n
  end
  local t = moe.tensor({ sq }, { dtype = "f64" })
  self.par.dist.all_reduce(t, "sum")
  local v = t:item()
  t:free()
  return v
end

function ExpertShards:scale(coef)
  local list = {}
  for _, e in ipairs(self.units) do list[#list + 1] = e.grad end
  moe.no_grad(function() require("moe.optim").scale_(list, coef) end)
end

function ExpertShards:step()
  self.step_count = self.step_count + 1
  local h = self.hyper
  local o = { lr = self.lr, beta1 = h.beta1, beta2 = h.beta2, eps = h.eps, weight_decay = 0, step = self.step_count }
  moe.no_grad(function()
    moe.scope(function()
      for _, e in ipairs(self.units) do
        if e.grad then
          for _, sg in ipairs(e.segments) do
            local a, n = sg.offset, sg.numel
            o.weight_decay = sg.weight_decay
            moe.ops.adamw_step(e.shard:narrow(0, a, n), e.grad:narrow(0, a, n), e.exp_avg:narrow(0, a, n),
              e.exp_avg_sq:narrow(0, a, n), e.master and e.master:narrow(0, a, n) or nil, o)
          end
        end
      end
    end)
  end)
end

function ExpertShards:zero_grad()
  for _, e in ipairs(self.units) do
    if e.grad then e.grad:free() end
    e.grad = nil
    for _, p in ipairs(e.params) do p.param.grad = nil end
  end
end

function ExpertShards.state_dict()
  error("train: the expert shards of parameter sharding have no state dict (each rank holds a part of " ..
    "each shard): moe/train/dcp.lua saves and loads them as pieces", 2)
end

function ExpertShards:load_scalars(scalars)
  if type(scalars) ~= "table" then return end
  if scalars.step ~= nil then self.step_count = math.tointeger(scalars.step) or scalars.step end
  if scalars.lr ~= nil then self.lr = scalars.lr end
end

-- ShardedAdamW over the replicated parameters and AdamW over the expert
-- shards, as one optimizer: lr set on both, step/zero_grad both; the gradient
-- norm is the whole model's (the dense shards' squares summed over the shard
-- group, the expert shards' over the {ep, etp} group), and both are scaled by
-- one coefficient. Checkpoints: moe/train/dcp.lua's pieces (state_dict raises).
local WithExperts = {}
WithExperts.__index = function(self, k)
  if k == "lr" then return rawget(self, "sharded").lr end
  return WithExperts[k]
end
WithExperts.__newindex = function(self, k, v)
  if k == "lr" then
    rawget(self, "sharded").lr = v
    rawget(self, "experts").lr = v
  else
    rawset(self, k, v)
  end
end

function M.with_experts(sharded, experts, par)
  return setmetatable({ kind = "ShardedAdamW", sharded = sharded, experts = experts, par = par,
    reducer = sharded.reducer, layout = sharded.layout }, WithExperts)
end

function WithExperts:step()
  self.sharded:step()
  self.experts:step()
end

function WithExperts:zero_grad()
  self.sharded:zero_grad()
  self.experts:zero_grad()
end

function WithExperts:clip_grad_norm(max_norm)
  local par = self.par
  local dense = self.sharded:clip_grad_norm(nil) -- the norm over the shard group, nothing scaled
  local list = {}
  local esq
  if self.experts.sumsq then -- sharded over the replica group as well: every rank's squares
    esq = self.experts:sumsq()
  else
    for _, p in ipairs(par.expert_params) do list[#list + 1] = p end
    local e = require("moe.optim").clip_grad_norm(list, nil)
    local t = moe.tensor({ e * e }, { dtype = "f64" })
    par.dist.all_reduce(t, "sum", { group = par.expert_group })
    esq = t:item()
    t:free()
  end
  local total = math.sqrt(dense * dense + esq)
  if max_norm and total > max_norm then
    local coef, grads = max_norm / (total + 1e-6), {}
    for k = 1, self.reducer:buckets() do grads[#grads + 1] = self.reducer:shard(k) end
    for _, p in ipairs(list) do grads[#grads + 1] = p.grad end
    moe.no_grad(function() require("moe.optim").scale_(grads, coef) end)
    if self.experts.scale then self.experts:scale(coef) end
  end
  return total
end

function WithExperts:state_scalars() return self.sharded:state_scalars() end
function WithExperts:load_scalars(scalars)
  self.sharded:load_scalars(scalars)
  if self.experts.load_scalars then
    self.experts:load_scalars(scalars)
  else
    self.experts:load_state_dict(self.experts:state_dict(), scalars)
  end
end
function WithExperts:state_bytes() return self.sharded:state_bytes() end
function WithExperts:state_dict() return self.sharded:state_dict() end
function WithExperts:load_state_dict(...) return self.sharded:load_state_dict(...) end
function WithExperts:free() self.sharded:free() end

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

--- par:broadcast_params(params): every parameter takes rank 0's values (an
--- expert shard: those of the first rank holding the same experts).
function Par:broadcast_params(params)
  if self.dp == 1 then return end
  local dist, experts = self.dist, self.expert_set or {}
  moe.no_grad(function()
    for _, p in ipairs(params) do
      if not experts[p] then
        dist.broadcast(p, 0)
      elseif self.replica_group then
        dist.broadcast(p, 0, { group = self.replica_group })
      end
    end
  end)
end

--- par:reducer(params, bucket_mb) -> the gradient reducer over the parameters
--- that require grad (expert shards excepted: par:finish_experts), or nil when
--- dp == 1.
function Par:reducer(params, bucket_mb)
  if self.dp == 1 then return nil end
  local list, experts = {}, self.expert_set or {}
  for _, p in ipairs(params) do
    if p.requires_grad and not experts[p] then list[#list + 1] = p end
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

-- ------------------------------------------------------------ checkpoints

local function dcp() return require "moe.train.dcp" end

--- par:save_checkpoint(step, model, opt, rank_state, state_tbl) -> the path of the
--- checkpoint committed by this call (this step's when saves are synchronous,
--- the previous one's when asynchronous), or nil; and the seconds the caller
--- waited. rank_state: this rank's {rng =, data =}; state_tbl: state.json's table.
function Par:save_checkpoint(step, model, opt, rank_state, state_tbl)
  if not self.saver then
    local o = self.ckpt_opts
    local d = self.dist
    self.saver = dcp().Saver { out_dir = o.out_dir, rank = self.rank, world = d and d.world_size() or 1,
      barrier = function() if d then d.barrier() end end, keep_last = o.keep_last, async = o.async }
  end
  local before = self.saver.last
  local stall = self.saver:save(step, dcp().pieces(self, model, opt), rank_state, state_tbl)
  local committed = self.saver.last ~= before and self.saver.last or nil
  return committed, stall
end

--- par:finish_checkpoint() -> the path committed now (an asynchronous save's), or nil.
function Par:finish_checkpoint()
  if not self.saver then return nil end
  local path = self.saver:finish()
  self.saver:close()
  return path
end

--- par:uses_dcp(path): path is resumed through moe/train/dcp.lua: it has an
--- index, or this layout holds parts of tensors (experts, optimizer shards).
function Par:uses_dcp(path)
  return dcp().is_sharded(path) or self.ep > 1 or self.sharded == true
end

--- par:load_checkpoint(path, model, opt) -> {state =, path =}: the model and
--- optimizer state of a checkpoint of any layout, each rank reading the
--- shards that overlap what it holds; the optimizer's scalars (step, lr)
--- set; state.rng and state.data this rank's (rank 0's when the checkpoint
--- was written by another number of ranks).
function Par:load_checkpoint(path, model, opt)
  local d = dcp()
  local world = self.dist and self.dist.world_size() or 1
  local st = d.read_state(path, self.rank, world)
  d.load_pieces(path, d.pieces(self, model, opt))
  local scalars = st.optim_scalars or {}
  if opt.load_scalars then
    opt:load_scalars(scalars)
  else
    opt:load_state_dict(opt:state_dict(), scalars) -- the scalars, and parameters from master copies
  end
  return { state = st, path = path }
end

-- ------------------------------------------------------------ layouts

local answers = { replicate = true, shard = true, expert = true }

local function describe(name, m)
  return ("module '%s' (%s)"):format(name, tostring(rawget(m, "__name") or m.__name or "module"))
end

--- place(model, layout, par) -> placement: layout(name, module) is asked for
--- every module of the model (model:named_modules() order; the model itself
--- is ""), and answers
---   "replicate"  its parameters are held whole on every rank (their
---                gradients all-reduced, or with parallel.dp_shard reduce-
---                scattered and their optimizer state sharded: ZeRO-2)
---   "shard"      a unit (ZeRO-3; needs parallel.dp_shard): its parameters
---                sharded over dp_shard, gathered for its forward and its
---                backward and released after each (the model's own unit,
---                "" answered "shard", is kept from its forward to backward)
---   "expert"     a module whose every parameter is an expert shard (an MoE
---                layer's experts): placed by parallel.ep / etp
---   nil          its parent's placement (the model's: "shard" with
---                parallel.shard_params, else "replicate")
--- A parameter takes the answer of the nearest module above it (itself
--- included) that answered, except expert shards, which are always placed
--- by ep / etp. Checked before anything is built on it, each an error naming
--- the module: an answer not in the list, "shard" without dp_shard,
--- "expert" where ep and etp are 1 or on a module with other parameters,
--- "replicate" or "shard" on a module that holds expert shards itself, a
--- tied parameter placed in two units, and the tied embeddings of a
--- TransformerLM (read by the model's own forward) in a unit other than the
--- model's.
--- placement: units (the "shard" modules that hold parameters, in module
--- order), unit_names, assign {[tensor] = unit index}, replicated {[tensor] =
--- index of its replicating module}, whole {[tensor] = true} (replicated and
--- expert shards), experts (a count).
function M.place(model, layout, par)
  if type(layout) ~= "function" then
    error(("train: the layout must be a function(name, module) -> \"replicate\" | \"shard\" | \"expert\" " ..
      "| nil, got a %s"):format(type(layout)), 0)
  end
  local expert_set = par.expert_set or {}
  local mods = model:named_modules()
  local answer = {}
  for _, e in ipairs(mods) do
    local name, m = e[1], e[2]
    local ok, a = pcall(layout, name, m)
    if not ok then error(("train: the layout failed on %s: %s"):format(describe(name, m), tostring(a)), 0) end
    if a ~= nil then
      if not answers[a] then
        error(("train: the layout placed %s as %s: expected \"replicate\", \"shard\", \"expert\" or nil " ..
          "(its parent's placement)"):format(describe(name, m), type(a) == "string" and ("'" .. a .. "'") or
          tostring(a)), 0)
      end
      local own_expert
      for _, pn in ipairs(m._params) do
        local t = rawget(m, pn)
        if t ~= nil and expert_set[t] then
          own_expert = pn
          break
        end
      end
      if a == "shard" and not par.sharded then
        error(("train: the layout placed %s as \"shard\", which needs parallel.dp_shard (the ranks its " ..
          "parameters are sharded over)"):format(describe(name, m)), 0)
      elseif a == "expert" then
        if par.shards == 1 then
          error(("train: the layout placed %s as \"expert\", but parallel.ep and parallel.etp are 1: no " ..
            "expert is sharded (set parallel.ep or etp)"):format(describe(name, m)), 0)
        end
        local params = m:named_parameters()
        if #params == 0 then
          error(("train: the layout placed %s as \"expert\", but it holds no parameter"):format(describe(name, m)), 0)
        end
        for _, np in ipairs(params) do
          if not expert_set[np[2]] then
            error(("train: the layout placed %s as \"expert\", but its parameter '%s' is not an expert shard " ..
              "(\"expert\" fits a module whose every parameter is an MoE layer's expert weight)"):format(
              describe(name, m), np[1]), 0)
          end
        end
      elseif own_expert then
        error(("train: the layout placed %s as \"%s\", but its '%s' is an expert shard, spread over " ..
          "parallel.ep=%d x etp=%d when the model was built: answer \"expert\" (or nil)"):format(
          describe(name, m), a, own_expert, par.ep, par.etp), 0)
      end
      answer[m] = a
    end
  end
  -- each parameter: the nearest answer above it
  local pl = { units = {}, unit_names = {}, assign = {}, replicated = {}, whole = {}, experts = 0 }
  local unit_index, rep_index, nrep = {}, {}, 0
  local placed = {} -- tensor -> {kind, module, name}
  local function place_param(t, pname, kind, by, byname)
    if expert_set[t] then
      if not placed[t] then pl.experts = pl.experts + 1 end
      placed[t] = { "expert" }
      pl.whole[t] = true
      return
    end
    local prev = placed[t]
    if prev and (prev[1] ~= kind or prev[2] ~= by) and (kind == "shard" or prev[1] == "shard") then
      error(("train: the layout places parameter '%s' (tied: held by '%s' and '%s') in two ways (%s by '%s', " ..
        "%s by '%s'): a tied parameter sits in one unit"):format(pname, prev[4], byname, prev[1], prev[3], kind,
        byname), 0)
    end
    if prev then return end
    placed[t] = { kind, by, byname, pname }
    if kind == "shard" then
      if not unit_index[by] then
        pl.units[#pl.units + 1] = by
        pl.unit_names[#pl.units] = byname
        unit_index[by] = #pl.units
      end
      pl.assign[t] = unit_index[by]
    else
      if not rep_index[by] then
        nrep = nrep + 1
        rep_index[by] = nrep
      end
      pl.replicated[t] = rep_index[by]
      pl.whole[t] = true
    end
  end
  local function walk(m, name, kind, by, byname)
    if answer[m] and answer[m] ~= "expert" then kind, by, byname = answer[m], m, name end
    for _, pn in ipairs(m._params) do
      local t = rawget(m, pn)
      if t ~= nil then place_param(t, name == "" and pn or name .. "." .. pn, kind, by, byname) end
    end
    for _, c in ipairs(m._children) do
      local child = rawget(m, c)
      if child ~= nil then walk(child, name == "" and c or name .. "." .. c, kind, by, byname) end
    end
  end
  walk(model, "", par.shard_params and "shard" or "replicate", model, "")
  -- a TransformerLM with tied embeddings reads wte.weight in its own forward (the output
  -- projection): a unit of wte's own would be released by then
  local wte, tied = rawget(model, "wte"), rawget(model, "lm_head") == nil
  local w = type(wte) == "table" and rawget(wte, "weight")
  if tied and w and placed[w] and placed[w][1] == "shard" and placed[w][2] ~= model then
    error(("train: the layout places the tied embeddings 'wte.weight' in the unit of '%s', but the model's " ..
      "own forward reads them (the output projection): place '%s' as \"replicate\", or leave it to the " ..
      "model's unit (\"\" answered \"shard\")"):format(placed[w][3], placed[w][3]), 0)
  end
  return pl
end

--- par:placement_summary() -> a line for the log, or nil.
function Par:placement_summary()
  local pl = self.placement
  if not pl then return nil end
  local nrep = 0
  for _ in pairs(pl.replicated) do nrep = nrep + 1 end
  local names = {}
  for i, n in ipairs(pl.unit_names) do names[i] = n == "" and "(model)" or n end
  return ("layout: %d unit%s sharded over %d rank%s (%s); %d parameters replicated; %d expert shards"):format(
    #pl.units, #pl.units == 1 and "" or "s", self.dp_shard or 1, (self.dp_shard or 1) == 1 and "" or "s",
    #names > 0 and table.concat(names, ", ") or "none", nrep, pl.experts)
end

-- ------------------------------------------------------ expert parallelism

--- setup_ep(par, ep, etp): the mesh {dp = world / (ep etp), ep, etp};
--- par.ep_group (the model's MoE layers spread their experts over it; nil when
--- ep = 1), par.etp_group (they split their experts' hidden units over it; nil
--- when etp = 1), par.expert_group (the ep etp ranks that hold one whole set of
--- experts between them) and par.replica_group (the ranks holding the same
--- shard; nil when alone).
function M.setup_ep(par, ep, etp)
  etp = etp or 1
  if par.dp % (ep * etp) ~= 0 then
    error(("train: parallel.ep=%d x parallel.etp=%d = %d does not divide the job's %d ranks"):format(
      ep, etp, ep * etp, par.dp), 0)
  end
  local dist = par.dist
  par.ep, par.etp, par.shards = ep, etp, ep * etp
  par.mesh = dist.mesh { { "dp", par.dp // (ep * etp) }, { "ep", ep }, { "etp", etp } }
  if ep > 1 then par.ep_group = par.mesh:group("ep") end
  if etp > 1 then par.etp_group = par.mesh:group("etp") end
  par.expert_group = par.mesh:group({ "ep", "etp" })
  if par.dp // (ep * etp) > 1 then par.replica_group = par.mesh:group("dp") end
end

--- par:attach(model [, layout]): finds the expert shards (moe/layers/ep.lua,
--- wp.lua); an error when parallel.ep (etp) > 1 and the model has no such
--- layer. With layout (train.run's parts.layout), places every module
--- (M.place): par.placement, or an error naming the module.
function Par:attach(model, layout)
  self:find_experts(model)
  if layout ~= nil then self.placement = M.place(model, layout, self) end
  if self.prefetch and not self.shard_params and not (self.placement and #self.placement.units > 0) then
    error(("train: parallel.prefetch=%d needs parallel.shard_params=true or a layout that shards modules (it " ..
      "is how far ahead the sharded parameters are gathered)"):format(self.prefetch), 0)
  end
end

function Par:find_experts(model)
  if self.shards == 1 then return end
  self.expert_params, self.expert_set = {}, {}
  local function add(list)
    for _, p in ipairs(list) do
      if not self.expert_set[p] then
        self.expert_set[p] = true
        self.expert_params[#self.expert_params + 1] = p
      end
    end
  end
  if self.ep > 1 then
    local list, size = require("moe.layers.ep").expert_params(model)
    if #list == 0 or size ~= self.ep then
      error(("train: parallel.ep=%d but the model has no MoE layer whose experts are spread over %d ranks " ..
        "(model.ffn=moe, or a model built with expert_parallel_group = par.ep_group)"):format(self.ep, self.ep), 0)
    end
    add(list)
  end
  if self.etp > 1 then
    local list, size = require("moe.layers.wp").slice_params(model)
    if #list == 0 or size ~= self.etp then
      error(("train: parallel.etp=%d but the model has no MoE layer whose experts' hidden units are split " ..
        "over %d ranks (model.ffn=moe with model.moe.kind=dmoe, or a model built with weight_parallel_group = " ..
        "par.etp_group)"):format(self.etp, self.etp), 0)
    end
    add(list)
  end
end

--- par:finish_experts(): after the reducer finished (the last micro-batch of a
--- step). An expert shard's gradient on its owner is the sum, over the ep etp
--- ranks whose tokens it saw, of their own losses' gradients; the job's loss is
--- the mean over the world of the ranks' losses. So: the mean over the replica
--- group (the dp ranks holding the same shard), then / (ep etp). A shard no
--- token reached gets a zero gradient (one process has one for every expert).
function Par:finish_experts()
  if self.shards == 1 then return end
  if self.expert_fsdp then return self.expert_fsdp:finish() end -- sharded over the replicas too
  local dist, list = self.dist, {}
  for _, p in ipairs(self.expert_params) do
    local g = p.grad
    if g == nil then
      p.grad = moe.zeros(p.shape, { dtype = p.dtype, device = p.device })
    else
      if self.replica_group then dist.all_reduce(g, "avg", { group = self.replica_group }) end
      list[#list + 1] = g
    end
  end
  moe.no_grad(function() require("moe.optim").scale_(list, 1 / self.shards) end)
end

--- par:ep_grad_norm(params, max_norm) -> norm, coef, found_inf: ep_clip's global norm
--- computed on the device (f32 0-d tensors, no host read; the shards' squares summed over
--- the ep etp ranks by an all_reduce of a device scalar), gradients untouched: for
--- optim.AdamW's step{grad_scale = coef}, as optim.grad_norm is in one process.
function Par:ep_grad_norm(params, max_norm)
  local optim = require "moe.optim"
  local dense, experts = {}, {}
  for _, p in ipairs(params) do
    if self.expert_set[p] then experts[#experts + 1] = p else dense[#dense + 1] = p end
  end
  local dev = params[1] and params[1].device or "cpu"
  local function sq_of(list)
    local has = false
    for _, p in ipairs(list) do has = has or p.grad ~= nil end
    if not has then return moe.zeros({ 1 }, { dtype = "f32", device = dev }) end
    local n = optim.grad_norm(list)
    return (n * n):reshape({ 1 })
  end
  return moe.no_grad(function()
    return moe.scope(function()
      local e = sq_of(experts)
      self.dist.all_reduce(e, "sum", { group = self.expert_group })
      return moe.ops.grad_norm_multi({ (sq_of(dense) + e):sqrt() }, max_norm)
    end)
  end)
end

--- par:ep_clip(clip_fn) -> clip(params, max_norm): clip_fn (optim.clip_grad_norm)
--- with the norm over the whole model: the replicated parameters' norm and the
--- shards' norms summed (in squares) over the ep etp ranks holding one set of
--- experts, so every rank scales by the same coefficient, as one process would.
function Par:ep_clip(clip_fn)
  if self.shards == 1 or self.sharded then return clip_fn end -- sharded: the optimizer's clip does it
  return function(params, max_norm)
    local dense, experts = {}, {}
    for _, p in ipairs(params) do
      if self.expert_set[p] then experts[#experts + 1] = p else dense[#dense + 1] = p end
    end
    local a, b = clip_fn(dense, nil), clip_fn(experts, nil)
    local t = moe.tensor({ b * b }, { dtype = "f64" })
    self.dist.all_reduce(t, "sum", { group = self.expert_group })
    local total = math.sqrt(a * a + t:item())
    t:free()
    if max_norm and total > max_norm then
      local grads = {}
      for _, p in ipairs(params) do grads[#grads + 1] = p.grad end
      moe.no_grad(function() require("moe.optim").scale_(grads, max_norm / (total + 1e-6)) end)
    end
    return total
  end
end

return M
