--[[
moe/optim/zero.lua - sharded AdamW (ZeRO-2: the optimizer-state and gradient
half of FSDP) over moe.dist.reducer's reduce_scatter mode
(docs/DISTRIBUTED.md, "Sharded data parallelism").

  local zero = require "moe.optim.zero"    -- also optim.ShardedAdamW
  local opt = zero.AdamW(model:named_parameters(), {lr =, betas =, eps =, weight_decay =,
      no_decay =, master_weights =, group = shard_group, replicate_group = nil, bucket_mb = 25,
      reduce_group = nil})  -- the reducer's communicator: group, or a split of it holding the same
                            -- ranks (its collectives then run beside group's, on a stream of their own)
  opt.reducer:arm(); loss:backward(); opt.reducer:finish()  -- gradient shards, .grad released
  opt:clip_grad_norm(max_norm) -> the global norm (one scalar all_reduce over group)
  opt:grad_norm(max_norm) -> norm, coef, found_inf (device tensors, no host read)
  opt:step([{grad_scale = coef}]) -- AdamW on this rank's shards, then all_gather of the parameters
  opt:zero_grad(), opt.lr, opt.step_count, opt:state_bytes(), opt:free()

The optimizer makes the reducer (opt.reducer, mode "reduce_scatter") over the
parameters that require grad, so the two share one layout: the parameters in
buckets of about bucket_mb MiB, each bucket one flat buffer padded to a
multiple of the group size P, rank r owning elements [r * S, (r + 1) * S) of
it (S = padded / P). Per bucket this rank holds exp_avg and exp_avg_sq of S
elements (f32; f64 for f64 parameters) and, for bf16/f16 parameters (or
master_weights = true), an fp32 master copy of its S elements: 1/P of what
optim.AdamW holds.

A step, per bucket (buckets whose parameters had no gradient on any rank are
skipped, as optim.AdamW skips a parameter whose .grad is nil):
  1. the rank's shard of the parameters in a flat buffer of their dtype
     (copied from the parameters; a bf16 bucket's comes from its master);
  2. one moe.ops.adamw_step_multi call over the contiguous runs of that
     buffer (a run: segments with the same weight decay whose parameters
     had a gradient),
     with the gradient shard and the state shards narrowed alike: the same
     element-wise operations optim.AdamW does on the whole parameter;
  3. an asynchronous all_gather of the buffer into one flat buffer of the
     bucket (padded elements), started before the next bucket is stepped;
then every gather is waited for in order and each parameter copied from its
slice. The replicate group (HSDP) needs nothing here: replicas hold the same
shard and step it the same way.

Parameter sharding (ZeRO-3, moe/fsdp.lua): with groups = {g1, ...} (one
bucket per group) and units = {[g] = {unit =, shard =}}, the parameters
exist in full only between their unit's gather and release; the step then
starts from the unit's shard (not the parameters), writes the updated values
back into it and gathers nothing: the next forward gathers each unit. A
group with no entry in units holds its parameters whole: its bucket is
stepped and all-gathered as without units (a layout's "replicate" modules).

Checkpoints: opt:state_pieces() (moe/train/dcp.lua saves and loads them;
state_dict raises). Not done here: SGD.
]]
local moe = require "moe"

local M = {}

local function fail(fn, msg, ...)
  error(("%s: " .. msg):format(fn, ...), 3)
end

local known = { lr = true, betas = true, eps = true, weight_decay = true, no_decay = true,
  master_weights = true, group = true, replicate_group = true, bucket_mb = true, groups = true, units = true,
  reduce_group = true }

local function number_opt(fn, opts, key, default)
  local v = opts[key]
  if v == nil then return default end
  if type(v) ~= "number" then fail(fn, "option %s must be a number, got %s", key, type(v)) end
  return v
end

local function state_dtype(dt) return dt == "f64" and "f64" or "f32" end
local function low_precision(dt) return dt == "bf16" or dt == "f16" end
local dtype_bytes = { f32 = 4, f64 = 8, bf16 = 2, f16 = 2 }

local Sharded = {}
Sharded.__index = Sharded

--- AdamW(named_params, opts) -> a sharded AdamW and its reducer (opt.reducer).
function M.AdamW(named_params, opts)
  local fn = "optim.ShardedAdamW"
  opts = opts or {}
  if type(opts) ~= "table" then fail(fn, "options table expected, got %s", type(opts)) end
  for k in pairs(opts) do
    if not known[k] then fail(fn, "unknown option '%s'", tostring(k)) end
  end
  local dist = moe.dist
  if not dist then fail(fn, "needs moe.dist, which this build lacks") end
  local betas = opts.betas or { 0.9, 0.95 }
  if type(betas) ~= "table" or type(betas[1]) ~= "number" or type(betas[2]) ~= "number" then
    fail(fn, "option betas must be {beta1, beta2}")
  end
  local no_decay = opts.no_decay or function(_, t) return t:dim() < 2 end
  if type(no_decay) ~= "function" then fail(fn, "option no_decay must be a function") end
  if type(named_params) ~= "table" then fail(fn, "named parameters expected, got %s", type(named_params)) end
  local group = opts.group or dist.world
  local reduce_group = opts.reduce_group or group
  if reduce_group ~= group and (reduce_group:size() ~= group:size() or reduce_group:rank() ~= group:rank()) then
    fail(fn, "option reduce_group must hold the ranks of group in its order (a split of it), but it has %d " ..
      "ranks and this one is %d there (group: %d ranks, rank %d)", reduce_group:size(), reduce_group:rank(),
      group:size(), group:rank())
  end
  local self = setmetatable({
    kind = "ShardedAdamW", lr = number_opt(fn, opts, "lr", 1e-3), step_count = 0,
    group = group, replicate_group = opts.replicate_group,
  }, Sharded)
  self.hyper = { beta1 = betas[1], beta2 = betas[2], eps = number_opt(fn, opts, "eps", 1e-8),
    weight_decay = number_opt(fn, opts, "weight_decay", 0.1) }
  -- the parameters that require grad, in the given order (the reducer's list)
  self.params = {}
  for i, e in ipairs(named_params) do
    local name, t
    if moe.is_tensor(e) then
      name, t = tostring(i - 1), e
    elseif type(e) == "table" and type(e[1]) == "string" and moe.is_tensor(e[2]) then
      name, t = e[1], e[2]
    else
      fail(fn, "parameter %d must be a tensor or {name, tensor}", i)
    end
    if t.requires_grad then
      if not t:is_contiguous() then fail(fn, "parameter '%s' must be contiguous", name) end
      if dtype_bytes[t.dtype] == nil then
        fail(fn, "parameter '%s' has dtype %s; optimisers take f32, f64, bf16 or f16", name, t.dtype)
      end
      if low_precision(t.dtype) and opts.master_weights == false then
        fail(fn, "parameter '%s' is %s: it needs master_weights (an fp32 copy)", name, t.dtype)
      end
      self.params[#self.params + 1] = { name = name, param = t,
        weight_decay = no_decay(name, t) and 0 or self.hyper.weight_decay }
    end
  end
  local list = {}
  for i, e in ipairs(self.params) do list[i] = e.param end
  local units
  if opts.groups ~= nil or opts.units ~= nil then
    if type(opts.groups) ~= "table" or #opts.groups ~= #list or type(opts.units) ~= "table" then
      fail(fn, "options groups (one group number per parameter that requires grad: %d) and units go together",
        #list)
    end
    units = {}
    for g, e in pairs(opts.units) do units[g] = e.unit end
  end
  self.reducer = dist.reducer(list, { mode = "reduce_scatter", group = reduce_group,
    replicate_group = opts.replicate_group, bucket_mb = opts.bucket_mb, groups = opts.groups, units = units })
  local layout = self.reducer:layout()
  self.layout = layout
  -- per bucket: its state shards
  self.buckets = {}
  moe.no_grad(function()
    for k, b in ipairs(layout.buckets) do
      local sd = state_dtype(b.dtype)
      local bk = { dtype = b.dtype, device = b.device, padded = b.padded, shard_numel = b.shard_numel,
        segments = b.segments, params = {} }
      bk.exp_avg = moe.zeros({ b.shard_numel }, { dtype = sd, device = b.device })
      bk.exp_avg_sq = moe.zeros({ b.shard_numel }, { dtype = sd, device = b.device })
      if opts.units then -- this bucket's unit: its first parameter's group
        local first = b.segments[1] and b.segments[1].param
        if first == nil then
          for i, where in ipairs(layout.params) do
            if where.bucket == k then first = i break end
          end
        end
        local e = opts.units[opts.groups[first]]
        if e ~= nil and (not moe.is_tensor(e.shard) or e.shard:numel() ~= b.shard_numel) then
          fail(fn, "units[%s] must be {unit =, shard =} with a shard of %d elements", tostring(opts.groups[first]),
            b.shard_numel)
        end
        bk.unit_shard = e and e.shard -- a group without a unit: parameters held whole (ZeRO-2)
        bk.unit = e and e.unit
      end
      local want = opts.master_weights
      if want == nil then want = low_precision(b.dtype) end
      if want then
        bk.master = moe.zeros({ b.shard_numel }, { dtype = sd, device = b.device })
        if bk.unit_shard then
          bk.master:copy_(bk.unit_shard) -- the parameters are not gathered: the shard is theirs
        else
          for _, s in ipairs(b.segments) do
            local p = self.params[s.param].param
            bk.master:narrow(0, s.shard_offset, s.numel):copy_(
              p:view({ p:numel() }):narrow(0, s.param_offset, s.numel))
          end
        end
      end
      self.buckets[k] = bk
    end
    for i, where in ipairs(layout.params) do
      local bk = self.buckets[where.bucket]
      bk.params[#bk.params + 1] = { param = self.params[i].param, offset = where.offset }
    end
  end)
  return self
end

--- opt:state_bytes() -> bytes of this rank's master weights and moments.
function Sharded:state_bytes()
  local n = 0
  for _, bk in ipairs(self.buckets) do
    for _, key in ipairs({ "exp_avg", "exp_avg_sq", "master" }) do
      local t = bk[key]
      if t then n = n + t:numel() * dtype_bytes[t.dtype] end
    end
  end
  return n
end

function Sharded:zero_grad()
  for _, e in ipairs(self.params) do e.param.grad = nil end
  self.reducer:clear()
end

-- The runs of bucket k's segments to step: consecutive segments with the same
-- weight decay whose parameters had a gradient.
local function runs_of(self, bk)
  local runs, cur = {}, nil
  for _, s in ipairs(bk.segments) do
    if self.reducer:had_grad(s.param) then
      local wd = self.params[s.param].weight_decay
      if cur and cur.wd == wd and cur.offset + cur.numel == s.shard_offset then
        cur.numel = cur.numel + s.numel
      else
        cur = { offset = s.shard_offset, numel = s.numel, wd = wd }
        runs[#runs + 1] = cur
      end
    else
      cur = nil
    end
  end
  return runs
end

local function step_bucket(self, k, bk, o)
  local grad = self.reducer:shard(k)
  if grad == nil then return nil end
  local runs = runs_of(self, bk)
  if #runs == 0 then return nil end -- no parameter of the bucket had a gradient anywhere
  -- parameter sharding with master weights: the update is written into the unit's shard itself
  -- (every element of it is rewritten below: stepped runs by AdamW, the rest from the master;
  -- with a master nothing is copied in, AdamW reads the master)
  local in_place = bk.master and bk.unit_shard
  local shard = in_place and bk.unit_shard or moe.zeros({ bk.shard_numel }, { dtype = bk.dtype, device = bk.device })
  if not bk.master and bk.unit_shard then
    shard:copy_(bk.unit_shard)
  elseif not bk.master then
    -- the parameters' elements of this shard: what the update starts from
    for _, s in ipairs(bk.segments) do
      local p = self.params[s.param].param
      shard:narrow(0, s.shard_offset, s.numel):copy_(p:view({ p:numel() }):narrow(0, s.param_offset, s.numel))
    end
  end
  -- every run of the bucket in one multi-tensor call (the bits of one adamw_step per run)
  local ps, gs, ms, vs, ws, wds = {}, {}, {}, {}, {}, {}
  for i, run in ipairs(runs) do
    local a, n = run.offset, run.numel
    ps[i], gs[i] = shard:narrow(0, a, n), grad:narrow(0, a, n)
    ms[i], vs[i] = bk.exp_avg:narrow(0, a, n), bk.exp_avg_sq:narrow(0, a, n)
    ws[i], wds[i] = bk.master and bk.master:narrow(0, a, n) or false, run.wd
  end
  moe.ops.adamw_step_multi(ps, gs, ms, vs, ws, wds,
    { lr = o.lr, beta1 = o.beta1, beta2 = o.beta2, eps = o.eps, step = o.step, grad_scale = o.grad_scale })
  if bk.master then
    -- segments not stepped this round keep their values: the master's, rounded (the
    -- padding past the last segment stays as it is: zeros)
    for _, s in ipairs(bk.segments) do
      if not self.reducer:had_grad(s.param) then
        shard:narrow(0, s.shard_offset, s.numel):copy_(bk.master:narrow(0, s.shard_offset, s.numel))
      end
    end
  end
  if bk.unit_shard then -- parameter sharding: the next forward gathers the unit
    if not in_place then bk.unit_shard:copy_(shard) end
    return nil
  end
  local full = moe.empty({ bk.padded }, { dtype = bk.dtype, device = bk.device })
  local work = moe.dist.all_gather(full, shard, { group = self.group, async = true })
  return { full = full, work = work }
end

local function step(self, grad_scale)
  self.step_count = self.step_count + 1
  local h = self.hyper
  local o = { lr = self.lr, beta1 = h.beta1, beta2 = h.beta2, eps = h.eps, weight_decay = 0,
    step = self.step_count, grad_scale = grad_scale }
  -- the units the next forward needs first (opt.first_units: moe/fsdp.lua's first_units) are
  -- stepped first, and each starts gathering at once, while the other buckets are stepped
  local first, order = {}, {}
  for i, u in ipairs(self.first_units or {}) do first[u] = i end
  for k, bk in ipairs(self.buckets) do
    if bk.unit and first[bk.unit] then order[#order + 1] = k end
  end
  table.sort(order, function(a, b) return first[self.buckets[a].unit] < first[self.buckets[b].unit] end)
  local early = #order
  for k, bk in ipairs(self.buckets) do
    if not (bk.unit and first[bk.unit]) then order[#order + 1] = k end
  end
  local gathers = {}
  for i, k in ipairs(order) do
    local bk = self.buckets[k]
    gathers[k] = step_bucket(self, k, bk, o) or false
    if i <= early then bk.unit:gather { async = true } end
  end
  for k, bk in ipairs(self.buckets) do
    local g = gathers[k]
    if g then
      g.work:wait()
      g.work:free()
      for _, e in ipairs(bk.params) do
        local p = e.param
        p:view({ p:numel() }):copy_(g.full:narrow(0, e.offset, p:numel()))
      end
    end
  end
end

--- opt:step([{grad_scale = coef}]): AdamW on this rank's shards, then every parameter
--- all-gathered. grad_scale: an f32 one-element tensor on the shards' device (the coefficient of
--- opt:grad_norm), every gradient multiplied by it as the update reads it.
function Sharded:step(opts)
  local gs
  if opts ~= nil then
    if type(opts) ~= "table" then fail("ShardedAdamW:step", "options must be a table, got %s", type(opts)) end
    for k in pairs(opts) do
      if k ~= "grad_scale" then fail("ShardedAdamW:step", "unknown option '%s'", tostring(k)) end
    end
    gs = opts.grad_scale
    if gs ~= nil and not moe.is_tensor(gs) then
      fail("ShardedAdamW:step", "grad_scale must be a tensor (opt:grad_norm's coefficient), got %s", type(gs))
    end
  end
  moe.no_grad(function() moe.scope(step, self, gs) end)
end

local function clip(self, max_norm)
  local norms = {}
  for k = 1, #self.buckets do
    local g = self.reducer:shard(k)
    if g then
      local n = (g.dtype == "f64" or g.dtype == "f32") and g:norm(2) or g:float():norm(2)
      if n.dtype ~= "f32" then n = n:float() end
      if n.device ~= "cpu" then n = n:cpu() end
      norms[#norms + 1] = n
    end
  end
  local sq = 0
  if #norms > 0 then
    local l = moe.stack(norms):norm(2):item()
    sq = l * l
  end
  local t = moe.tensor({ sq }, { dtype = "f64" })
  moe.dist.all_reduce(t, "sum", { group = self.group })
  local total = math.sqrt(t:item())
  if max_norm and total > max_norm then
    local coef, list = max_norm / (total + 1e-6), {}
    for k = 1, #self.buckets do list[#list + 1] = self.reducer:shard(k) end
    require("moe.optim").scale_(list, coef)
  end
  return total
end

-- The global norm on the device: this rank's sum of squares over its shards (one
-- grad_norm_multi), summed over the shard group by an all_reduce of a device scalar (no
-- host read), then norm and coefficient as optim.grad_norm makes them.
local function device_norm(self, max_norm)
  local list = {}
  for k = 1, #self.buckets do list[#list + 1] = self.reducer:shard(k) end
  local dev = self.buckets[1] and self.buckets[1].device or "cpu"
  local n = #list > 0 and moe.ops.grad_norm_multi(list, nil)
    or moe.zeros({}, { dtype = "f32", device = dev })
  local sq = (n * n):reshape({ 1 })
  moe.dist.all_reduce(sq, "sum", { group = self.group })
  return moe.ops.grad_norm_multi({ sq:sqrt() }, max_norm)
end

local function check_max_norm(fn, max_norm)
  if max_norm ~= nil and (type(max_norm) ~= "number" or max_norm <= 0) then
    error(("ShardedAdamW:%s: max_norm must be a positive number, got %s"):format(fn, tostring(max_norm)), 3)
  end
end

--- opt:grad_norm([max_norm]) -> norm, coef, found_inf: optim.grad_norm over the sharded
--- gradient (f32 0-d tensors on the shards' device; no host read, gradients untouched): the
--- global L2 norm, min(1, max_norm / (norm + 1e-6)) and whether the norm is not finite. For
--- opt:step{grad_scale = coef}.
function Sharded:grad_norm(max_norm)
  check_max_norm("grad_norm", max_norm)
  return moe.no_grad(function() return moe.scope(device_norm, self, max_norm) end)
end

--- opt:clip_grad_norm(max_norm) -> the global L2 norm of the gradient: each
--- rank's sum of squares over its shards (padding is zeros), summed over the
--- shard group by one all_reduce of an f64 scalar on the host (replicas hold
--- equal shards, so the replicate group is not involved). Scales the shards
--- by max_norm / (norm + 1e-6) when the norm exceeds max_norm.
function Sharded:clip_grad_norm(max_norm)
  check_max_norm("clip_grad_norm", max_norm)
  return moe.no_grad(function() return moe.scope(clip, self, max_norm) end)
end

function Sharded.state_dict()
  error("ShardedAdamW:state_dict: the sharded state cannot be saved as one state dict (each rank holds " ..
    "1/P of it): moe.train.dcp saves opt:state_pieces(), this rank's flat ranges of each parameter's state", 2)
end

function Sharded.load_state_dict()
  error("ShardedAdamW:load_state_dict: each rank holds 1/P of the state; load it with moe.train.dcp " ..
    "(it fills opt:state_pieces() in place), then opt:load_scalars(scalars)", 2)
end

--- opt:state_pieces() -> this rank's part of every parameter's state, as
--- pieces of moe/train/dcp.lua: {name = "<param>.exp_avg" | ".exp_avg_sq" |
--- ".master", shape = the parameter's shape, dtype, tensor = a view of the
--- bucket's state (filled in place on load), place = {flat = {a, b}}: the
--- elements [a, b) of the flattened parameter, write = first replica}. A
--- parameter that straddles ranks has one piece per rank.
function Sharded:state_pieces()
  local out = {}
  local write = self.replicate_group == nil or self.replicate_group:rank() == 0
  for _, bk in ipairs(self.buckets) do
    for _, s in ipairs(bk.segments) do
      local e = self.params[s.param]
      for _, key in ipairs({ "exp_avg", "exp_avg_sq", "master" }) do
        local t = bk[key]
        if t and s.numel > 0 then
          out[#out + 1] = { name = e.name .. "." .. key, shape = e.param.shape, dtype = t.dtype,
            tensor = t:narrow(0, s.shard_offset, s.numel), place = { flat = { s.param_offset, s.param_offset + s.numel } },
            write = write }
        end
      end
    end
  end
  return out
end

--- opt:load_scalars(scalars): the step count and lr of a checkpoint (the
--- tensors are loaded through state_pieces).
function Sharded:load_scalars(scalars)
  if type(scalars) ~= "table" then return end
  if scalars.step ~= nil then self.step_count = math.tointeger(scalars.step) or scalars.step end
  if scalars.lr ~= nil then self.lr = scalars.lr end
end

function Sharded:state_scalars()
  local s = { step = self.step_count, lr = self.lr, kind = self.kind }
  for k, v in pairs(self.hyper) do s[k] = v end
  return s
end

function Sharded:free()
  if self.reducer then self.reducer:free() end
  self.reducer = nil
end

return M
