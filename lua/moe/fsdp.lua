--[[
moe/fsdp.lua - parameter sharding, the parameter half of FSDP (ZeRO-3,
PyTorch FSDP's FULL_SHARD): each unit's parameters live in one flat buffer
of which every rank of the shard group keeps 1/P (docs/DISTRIBUTED.md,
"Parameter sharding"). With optim.ShardedAdamW (gradients and optimizer
state sharded the same way) nothing of the model is held whole between uses.

  local fsdp = require "moe.fsdp"
  local sh = fsdp.shard(model, { group = shard_group, replicate_group = nil })
  local opt = optim.ShardedAdamW(sh.named, { ..., group = shard_group, groups = sh.groups,
                                             units = sh.units })
  -- training as with ZeRO-2: opt.reducer:arm(); loss:backward(); opt.reducer:finish() ...
  sh:release_all()      -- after a backward whose reducer was not armed (gradient accumulation)
  sh:gather_all() / sh:state_dict()   -- every parameter whole (a copy for the state dict)
  sh.stats()            -- {units =, gathers =} for tests
  sh:param_pieces()     -- this rank's flat ranges of each parameter (checkpoints)

Units. One per transformer block (model.blocks, when the model has them)
and the root: every parameter no block holds (embeddings, final norm, the
output projection). A unit's parameters are views of its flat buffer (new
leaves that replace the module's parameters), laid out as the reducer lays
out its bucket, so rank r's shard of the buffer is exactly what the sharded
optimizer updates.

Lifetime of a unit's full parameters, within a step:
  forward    a block's unit is gathered when the block's forward starts (the
             prefetch started by an earlier block's forward, on the
             communication stream, is waited for) and the gathers of the next
             `prefetch` blocks start (those not already on their way);
             released when its forward ends, except the last block's
             with grad mode on: backward needs it first, so it stays, and the
             block before it starts gathering again. The root is gathered at
             the start of the model's forward and kept for backward (its
             output projection is the first thing backward needs). The
             sharded optimizer starts gathering the root and the first
             `prefetch` blocks as soon as it has stepped them (first_units),
             so the next forward finds them on their way or ready.
  backward   a released unit is gathered by autograd itself when backward
             first reads a parameter the unit's forward saved (the flat
             buffer's storage materializes through the unit), and the unit
             that backward reaches next starts gathering; released as soon
             as its gradients' bucket is launched (all of its gradients are
             complete and read into the reduce_scatter).
  no grad    (evaluation, sampling) every unit is released after its forward.
The gathers are collectives: every rank runs the same forwards and
backwards in the same order (as with the reducer).

Prefetch depth (opts.prefetch, default 2; PyTorch FSDP gathers one module
ahead). When a block's gather takes longer than its forward, the forward
waits for every gather after the ones started early; a deeper prefetch
starts more of them during the optimizer step, which has no gather of its
own to run, at the cost of `prefetch` gathered blocks held through the
step's end and up to `prefetch` + 1 during forward. On two H100 the 125M
dMoE's step (docs/DISTRIBUTED.md) was 2 to 3 ms faster with 2 than with 1,
and 4 added little more.
]]
local moe = require "moe"

local M = {}

local function fail(msg, ...) error(("fsdp.shard: " .. msg):format(...), 3) end

-- Every (module, name) that holds tensor t as a parameter.
local function owners(model)
  local by = {}
  for _, m in ipairs(model:modules()) do
    for _, n in ipairs(m._params) do
      local t = rawget(m, n)
      if t ~= nil then
        by[t] = by[t] or {}
        table.insert(by[t], { m, n })
      end
    end
  end
  return by
end

-- The parameters a module holds (itself and its descendants), as a set.
local function param_set(mod)
  local s = {}
  for _, np in ipairs(mod:named_parameters()) do s[np[2]] = true end
  return s
end

local Sharded = {}
Sharded.__index = Sharded

--- shard(model, opts) -> sh: replaces the model's parameters by views of the
--- units' flat buffers, keeps this rank's shard of each, and releases them.
--- opts: group (the shard group; default moe.dist.world); exclude (a set
--- {[tensor] = true} of parameters left out of every unit: held whole, as
--- they are, e.g. expert shards that expert parallelism places). sh.named
--- lists the sharded parameters (new tensors), sh.kept the others.
--- modules and assign (together; moe/train/parallel.lua's layouts): the unit
--- modules in the order forward runs them, and {[tensor] = index into
--- modules} for the parameters each holds (a parameter neither assigned nor
--- excluded goes to the root unit); default: the blocks, each holding the
--- parameters below it.
--- prefetch: how many blocks ahead a forward gathers (an integer >= 1,
--- default 2; the file's comment says what it trades).
--- sh.layout is the reducer's layout of the units (sh.named[i] is its
--- params[i]; sh.units[g].bucket the bucket of unit g).
local known = { group = true, exclude = true, modules = true, assign = true, prefetch = true }

function M.shard(model, opts)
  opts = opts or {}
  local dist = moe.dist
  if not dist then fail("needs moe.dist, which this build lacks") end
  for k in pairs(opts) do
    if not known[k] then fail("unknown option '%s'", tostring(k)) end
  end
  local group = opts.group or dist.world
  local prefetch = opts.prefetch or 2
  if math.type(prefetch) ~= "integer" or prefetch < 1 then
    fail("option prefetch must be an integer >= 1 (blocks gathered ahead), got %s", tostring(prefetch))
  end
  local exclude = opts.exclude or {}
  if type(exclude) ~= "table" then fail("option exclude must be a set of tensors, got %s", type(exclude)) end
  if (opts.modules == nil) ~= (opts.assign == nil) or (opts.modules and (type(opts.modules) ~= "table"
      or type(opts.assign) ~= "table")) then
    fail("options modules (a list of modules) and assign (tensor -> index) go together")
  end
  local named, kept = {}, {}
  for _, np in ipairs(model:named_parameters()) do
    if exclude[np[2]] then kept[#kept + 1] = np else named[#named + 1] = np end
  end
  for _, np in ipairs(named) do
    if not np[2].requires_grad then
      fail("parameter '%s' does not require grad: frozen parameters are not sharded", np[1])
    end
    if not np[2]:is_contiguous() then fail("parameter '%s' must be contiguous", np[1]) end
  end
  -- units: the blocks in order (or the given modules), then the root
  local unit_mods = {}
  local blocks = rawget(model, "blocks")
  if opts.modules then
    for i, m in ipairs(opts.modules) do unit_mods[i] = m end
  elseif type(blocks) == "table" and blocks.n and blocks.at then
    for i = 0, blocks.n - 1 do unit_mods[#unit_mods + 1] = blocks:at(i) end
  end
  local root = #unit_mods + 1
  local unit_of = {}
  for t, g in pairs(opts.assign or {}) do
    if math.type(g) ~= "integer" or g < 1 or g > #unit_mods then
      fail("assign: unit index %s is not one of the %d modules", tostring(g), #unit_mods)
    end
    if not exclude[t] then unit_of[t] = g end
  end
  for g, m in ipairs(opts.modules and {} or unit_mods) do
    for t in pairs(param_set(m)) do
      if not exclude[t] then
        if unit_of[t] and unit_of[t] ~= g then
          fail("a parameter is shared by blocks %d and %d (shared parameters must sit in one unit)", unit_of[t], g)
        end
        unit_of[t] = g
      end
    end
  end
  -- The root unit's parameters first: the reducer walks the parameters from the last and
  -- launches its buckets in that order, so the blocks' buckets go from the last block while
  -- backward runs, and the root's (the embedding among them: done only at the end of
  -- backward) goes last instead of holding every other reduce_scatter back.
  local ordered = {}
  for _, np in ipairs(named) do if not unit_of[np[2]] then ordered[#ordered + 1] = np end end
  for _, np in ipairs(named) do if unit_of[np[2]] then ordered[#ordered + 1] = np end end
  named = ordered
  local list, groups = {}, {}
  for i, np in ipairs(named) do
    list[i] = np[2]
    groups[i] = unit_of[np[2]] or root
  end
  -- the reducer's layout of these buckets (a reducer made only to read it)
  local probe = dist.reducer(list, { mode = "reduce_scatter", group = group, groups = groups })
  local layout = probe:layout()
  probe:free()
  local by = owners(model)
  local P, r = group:size(), group:rank()
  local self = setmetatable({ group = group, units = {}, groups = groups, named = {}, kept = kept, model = model,
    unit_mods = unit_mods, root = root, layout = layout, prefetch = prefetch }, Sharded)
  -- bucket -> group
  local group_of_bucket = {}
  for i, where in ipairs(layout.params) do group_of_bucket[where.bucket] = groups[i] end
  moe.no_grad(function()
    local flats = {}
    for k, b in ipairs(layout.buckets) do
      local flat = moe.keep(moe.zeros({ b.padded }, { dtype = b.dtype, device = b.device }))
      flats[k] = flat
    end
    for i, np in ipairs(named) do
      local where, old = layout.params[i], np[2]
      local flat = flats[where.bucket]
      local n = old:numel()
      local slot = flat:narrow(0, where.offset, n)
      slot:copy_(old:view({ n }))
      local v = slot:view(old.shape)
      v:requires_grad_(true)
      for _, o in ipairs(by[old] or {}) do o[1]:param(o[2], v) end
      self.named[i] = { np[1], v, name = np[1], tensor = v }
    end
    for k, b in ipairs(layout.buckets) do
      local S = b.shard_numel
      local shard = moe.keep(flats[k]:narrow(0, r * S, S):clone())
      local unit = dist.fsdp_unit(flats[k], shard, { group = group })
      self.units[group_of_bucket[k]] = { unit = unit, shard = shard, flat = flats[k], padded = b.padded,
        bucket = k }
    end
  end)
  assert(P == layout.size or P == 1)
  -- backward reaches the root first, then the blocks from the last
  local nb = #unit_mods
  if self.units[root] and nb > 0 then self.units[root].unit:set_prefetch(self.units[nb].unit) end
  for g = 2, nb do self.units[g].unit:set_prefetch(self.units[g - 1].unit) end
  for _, old in ipairs(list) do
    if not old.grad then old:free() end
  end
  self:release_all()
  self:wrap()
  return self
end

--- sh:first_units() -> the units the next forward gathers first, in order: the root's and
--- the first `prefetch` blocks' (the sharded optimizer starts gathering them as soon as it
--- has stepped them, while it steps the others).
function Sharded:first_units()
  local out = self:ahead(0)
  if self.units[self.root] then table.insert(out, 1, self.units[self.root].unit) end
  return out
end

-- The units of blocks g + 1 .. g + prefetch (those that have one), in order.
function Sharded:ahead(g)
  local out = {}
  for j = g + 1, math.min(g + self.prefetch, self.root - 1) do
    if self.units[j] then out[#out + 1] = self.units[j].unit end
  end
  return out
end

function Sharded:release_all()
  for _, u in pairs(self.units) do u.unit:release() end
end

function Sharded:gather_all()
  for g = 1, self.root do
    local u = self.units[g]
    if u then u.unit:gather() end
  end
end

-- The forward hooks: each block's unit around its forward, the root around
-- the model's (kept for backward when grad mode is on).
function Sharded:wrap()
  local units, root = self.units, self.root
  local nb = #self.unit_mods
  for g, m in ipairs(self.unit_mods) do
    local orig = m.forward
    local u, ahead = units[g] and units[g].unit, self:ahead(g)
    local prev = g == nb and units[g - 1] and units[g - 1].unit
    rawset(m, "forward", function(mod, ...)
      if u then u:gather() end
      for _, a in ipairs(ahead) do a:gather { async = true } end -- the next blocks', while this one computes
      local out = table.pack(orig(mod, ...))
      if u and g == nb and moe.is_grad_enabled() then
        -- backward starts with the last block: it stays gathered (no gather again), and the
        -- block before it, which backward reaches next, starts gathering now
        if prev then prev:gather { async = true } end
      elseif u then
        u:release() -- backward gathers it again when it needs it
      end
      return table.unpack(out, 1, out.n)
    end)
  end
  local model, ru = self.model, units[root] and units[root].unit
  local orig = model.forward
  local first = self:ahead(0)
  rawset(model, "forward", function(mod, ...)
    if ru then ru:gather() end
    for _, a in ipairs(first) do a:gather { async = true } end
    local out = table.pack(orig(mod, ...))
    if ru and not moe.is_grad_enabled() then ru:release() end
    return table.unpack(out, 1, out.n)
  end)
  local sd = model.state_dict
  self.raw_state_dict = function() return sd(model) end
  rawset(model, "state_dict", function(mod)
    self:gather_all()
    local out = {}
    for k, t in pairs(sd(mod)) do out[k] = moe.is_tensor(t) and moe.keep(t:clone()) or t end
    self:release_all()
    return out
  end)
end

--- sh:local_state_dict() -> name -> tensor, as the model's own state_dict
--- (no gather): the sharded parameters are their unit's views, whose values
--- are not there between uses (read them through sh:param_pieces()).
function Sharded:local_state_dict() return self.raw_state_dict() end

--- sh:param_pieces() -> {[parameter] = {{tensor =, place = {flat = {a, b}},
--- shard_offset =, unit_bucket =}, ...}}: this rank's part of each sharded
--- parameter, as flat ranges of it (the elements [a, b) of the flattened
--- parameter) with views of the unit's shard that hold them (moe/train/dcp.lua
--- saves and fills them in place): elements [shard_offset, shard_offset + b - a)
--- of the shard of the layout's bucket unit_bucket. A
--- parameter whose elements all sit on other ranks has an empty list.
function Sharded:param_pieces()
  local out, shard_of = {}, {}
  for _, u in pairs(self.units) do shard_of[u.bucket] = u.shard end
  for _, np in ipairs(self.named) do out[np[2]] = {} end
  for k, b in ipairs(self.layout.buckets) do
    for _, s in ipairs(b.segments) do
      if s.numel > 0 then
        local list = out[self.named[s.param][2]]
        list[#list + 1] = { tensor = shard_of[k]:narrow(0, s.shard_offset, s.numel),
          place = { flat = { s.param_offset, s.param_offset + s.numel } }, shard_offset = s.shard_offset,
          unit_bucket = k }
      end
    end
  end
  return out
end

function Sharded:stats()
  local n, gathers = 0, 0
  for _, u in pairs(self.units) do
    n = n + 1
    gathers = gathers + u.unit:gathers()
  end
  return { units = n, gathers = gathers }
end

--- sh:shard_bytes() -> bytes of this rank's parameter shards.
function Sharded:shard_bytes()
  local n = 0
  local size = { f32 = 4, f64 = 8, bf16 = 2, f16 = 2 }
  for _, u in pairs(self.units) do n = n + u.shard:numel() * size[u.shard.dtype] end
  return n
end

return M
