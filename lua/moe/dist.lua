--[[
moe/dist.lua - the parts of moe.dist written in Lua (docs/DISTRIBUTED.md):
dist.world, dist.device, the device mesh and the differentiable collectives
(dist.functional). The world, groups and collectives are C
(bindings/ldist.c); this file adds to the same table.

  dist.world                          the group of every rank (starts the world)
  dist.device()                       "cuda:<local rank % visible GPUs>" or "cpu"
  dist.mesh{dp = 2, ep = 2}           named dims, product = world size
  dist.mesh{{"dp", 4}, {"ep", 2}}     the same with an explicit order
  mesh:size(dims), mesh:rank(dims), mesh:group(dims)   dims: a name or a list
  mesh.names, mesh.shape
  dist.functional.all_to_all / all_gather / reduce_scatter / all_reduce

Every rank must make the same collective calls in the same order: so must
mesh:group (it splits the world the first time a combination is asked for)
and the backward of a dist.functional op (each rank's backward runs the
transposed collective; a rank whose loss does not depend on the output
still has to reach it).
]]
local moe = require "moe"

local dist = moe.dist

-- dist.world: the world's group, starting the world on first use.
setmetatable(dist, {
  __index = function(_, k)
    if k == "world" then return dist._world() end
    return nil
  end,
})

-- "cuda:<local rank % visible count>" when this build has CUDA and a GPU is
-- visible, else "cpu".
function dist.device()
  local n = moe.cuda and moe.cuda.is_available() and moe.cuda.device_count() or 0
  if n > 0 then return "cuda:" .. (dist.local_rank() % n) end
  return "cpu"
end

-- ------------------------------------------------------------------ mesh

-- The order of a mesh given as a map, outermost first: ep and tp vary
-- fastest, so their groups are ranks on one node.
dist.MESH_DIMS = { "pp", "dp_replicate", "dp_shard", "dp", "cp", "ep", "etp", "tp" }
local CANONICAL = {}
for i, n in ipairs(dist.MESH_DIMS) do CANONICAL[n] = i end

local Mesh = {}
Mesh.__index = Mesh
Mesh.__name = "moe.DeviceMesh"

local function positive(name, v)
  if math.type(v) ~= "integer" or v < 1 then
    error(string.format("dist.mesh: the size of '%s' must be a positive integer, got %s",
      tostring(name), tostring(v)), 3)
  end
  return v
end

-- The dims of a mesh spec, in order: names and shape.
local function mesh_dims(spec)
  if type(spec) ~= "table" then
    error("dist.mesh: a table expected ({dp = 2, ep = 2} or {{'dp', 2}, {'ep', 2}}), got "
      .. type(spec), 3)
  end
  local names, shape = {}, {}
  if #spec > 0 then
    for k in pairs(spec) do
      if math.type(k) ~= "integer" or k < 1 or k > #spec then
        error("dist.mesh: the list form takes only {name, size} pairs, got the key "
          .. tostring(k), 3)
      end
    end
    local seen = {}
    for i, d in ipairs(spec) do
      if type(d) ~= "table" or type(d[1]) ~= "string" then
        error(string.format("dist.mesh: entry %d must be {name, size}, got %s", i,
          type(d) == "table" and "{" .. tostring(d[1]) .. ", ...}" or type(d)), 3)
      end
      if seen[d[1]] then error("dist.mesh: the dim '" .. d[1] .. "' is named twice", 3) end
      seen[d[1]] = true
      names[i], shape[i] = d[1], positive(d[1], d[2])
    end
  else
    for k, v in pairs(spec) do
      if type(k) ~= "string" or not CANONICAL[k] then
        error(string.format("dist.mesh: unknown dim '%s' in the map form (known: %s; the list "
          .. "form {{'%s', n}, ...} takes any name)", tostring(k), table.concat(dist.MESH_DIMS, ", "),
          tostring(k)), 3)
      end
      positive(k, v)
    end
    for _, n in ipairs(dist.MESH_DIMS) do
      if spec[n] then
        names[#names + 1] = n
        shape[#shape + 1] = spec[n]
      end
    end
  end
  if #names == 0 then error("dist.mesh: at least one dim expected", 3) end
  return names, shape
end

-- dist.mesh(spec) -> a mesh over the world: rank r has the coordinates of
-- r in row-major order over shape (the last dim varies fastest).
function dist.mesh(spec)
  local names, shape = mesh_dims(spec)
  local world = dist.world
  local n, parts = 1, {}
  for i, s in ipairs(shape) do
    n = n * s
    parts[i] = names[i] .. "=" .. s
  end
  if n ~= world:size() then
    error(string.format("dist.mesh: %s makes %d ranks but the world has %d", table.concat(parts, " x "),
      n, world:size()), 2)
  end
  local index, coord = {}, {}
  local r = world:rank()
  for i = #names, 1, -1 do
    index[names[i]] = i
    coord[i] = r % shape[i]
    r = r // shape[i]
  end
  return setmetatable({ names = names, shape = shape, _index = index, _coord = coord,
    _groups = {} }, Mesh)
end

-- dims (a name or a list of names) as sorted mesh positions, checked.
function Mesh:_positions(dims, fname)
  if type(dims) == "string" then dims = { dims } end
  if type(dims) ~= "table" or #dims == 0 then
    error(string.format("mesh:%s: a dim name or a list of names expected, got %s", fname,
      tostring(dims)), 3)
  end
  local pos, seen = {}, {}
  for _, d in ipairs(dims) do
    local i = self._index[d]
    if not i then
      error(string.format("mesh:%s: no dim '%s' in the mesh (dims: %s)", fname, tostring(d),
        table.concat(self.names, ", ")), 3)
    end
    if seen[i] then error(string.format("mesh:%s: the dim '%s' is named twice", fname, d), 3) end
    seen[i] = true
    pos[#pos + 1] = i
  end
  table.sort(pos)
  return pos, seen
end

-- The size of a dim, or of several flattened.
function Mesh:size(dims)
  local n = 1
  for _, i in ipairs((self:_positions(dims, "size"))) do n = n * self.shape[i] end
  return n
end

-- This rank's coordinate along a dim, or its index in the flattened dims
-- (row-major over them in mesh order).
function Mesh:rank(dims)
  local r = 0
  for _, i in ipairs((self:_positions(dims, "rank"))) do r = r * self.shape[i] + self._coord[i] end
  return r
end

-- The group of the ranks that differ from this one only along dims (one
-- name, or several flattened), ordered by the coordinates along them. Made
-- by a split of the world the first time (collective: every rank must ask
-- for the same groups in the same order), then cached.
function Mesh:group(dims)
  local pos, inside = self:_positions(dims, "group")
  local parts = {}
  for k, i in ipairs(pos) do parts[k] = self.names[i] end
  local name = table.concat(parts, "_")
  local g = self._groups[name]
  if g then return g end
  local color, key = 0, 0
  for i = 1, #self.names do
    if inside[i] then key = key * self.shape[i] + self._coord[i]
    else color = color * self.shape[i] + self._coord[i] end
  end
  g = dist.world:split(color, key, name)
  self._groups[name] = g
  return g
end

function Mesh:__tostring()
  local parts = {}
  for i, n in ipairs(self.names) do parts[i] = n .. "=" .. self.shape[i] end
  return "moe.DeviceMesh{" .. table.concat(parts, ", ") .. "}"
end

-- ------------------------------------------------------------ functional

local F = {}
dist.functional = F

local function splits_table(s, what)
  if moe.is_tensor(s) then return s:totable() end
  if type(s) ~= "table" then
    error(string.format("dist.functional.all_to_all: %s splits must be a table or an i64 tensor, "
      .. "got %s", what, type(s)), 3)
  end
  return s
end

local function sum(t)
  local n = 0
  for _, v in ipairs(t) do n = n + v end
  return n
end

local function with_rows(shape, rows)
  local s = {}
  for i, v in ipairs(shape) do s[i] = v end
  s[1] = rows
  return s
end

local function like(shape, t, zeros)
  local make = zeros and moe.zeros or moe.empty
  return make(shape, { dtype = t.dtype, device = t.device })
end

local function group_or_world(group) return group or dist.world end

local A2A = moe.Function {
  name = "dist.all_to_all",
  forward = function(ctx, x, send, recv, group)
    ctx.send, ctx.recv, ctx.group = send, recv, group
    ctx.in_shape = x.shape
    local out = like(with_rows(x.shape, sum(recv)), x, true)
    dist.all_to_all(out, x:contiguous(), send, recv, { group = group })
    ctx.out_shape, ctx.dtype, ctx.device = out.shape, out.dtype, out.device
    return out
  end,
  backward = function(ctx, g)
    g = g and g:contiguous() or moe.zeros(ctx.out_shape, { dtype = ctx.dtype, device = ctx.device })
    local gx = like(ctx.in_shape, g, true)
    dist.all_to_all(gx, g, ctx.recv, ctx.send, { group = ctx.group })
    return gx
  end,
}

-- out: the rows that the ranks send to this one (recv_splits[j] rows from
-- rank j, in rank order). backward: the reverse all_to_all (splits swapped);
-- rows of x past sum(send_splits) get zero gradient.
function F.all_to_all(x, send_splits, recv_splits, group)
  local send, recv = splits_table(send_splits, "send"), splits_table(recv_splits, "recv")
  if x:dim() == 0 then error("dist.functional.all_to_all: x must have rows (dim >= 1)", 2) end
  return A2A(x, send, recv, group_or_world(group))
end

local AG = moe.Function {
  name = "dist.all_gather",
  forward = function(ctx, x, group)
    ctx.group, ctx.in_shape = group, x.shape
    local out = like(with_rows(x.shape, x.shape[1] * group:size()), x)
    dist.all_gather(out, x:contiguous(), { group = group })
    ctx.out_shape, ctx.dtype, ctx.device = out.shape, out.dtype, out.device
    return out
  end,
  backward = function(ctx, g)
    g = g and g:contiguous() or moe.zeros(ctx.out_shape, { dtype = ctx.dtype, device = ctx.device })
    local gx = like(ctx.in_shape, g)
    dist.reduce_scatter(gx, g, "sum", { group = ctx.group })
    return gx
  end,
}

-- (n, ...) -> (size * n, ...), every rank's x in rank order. backward:
-- reduce_scatter (sum) of the gradient.
function F.all_gather(x, group)
  if x:dim() == 0 then error("dist.functional.all_gather: x must have rows (dim >= 1)", 2) end
  return AG(x, group_or_world(group))
end

local RS = moe.Function {
  name = "dist.reduce_scatter",
  forward = function(ctx, x, group)
    ctx.group, ctx.in_shape = group, x.shape
    local out = like(with_rows(x.shape, x.shape[1] // group:size()), x)
    dist.reduce_scatter(out, x:contiguous(), "sum", { group = group })
    ctx.out_shape, ctx.dtype, ctx.device = out.shape, out.dtype, out.device
    return out
  end,
  backward = function(ctx, g)
    g = g and g:contiguous() or moe.zeros(ctx.out_shape, { dtype = ctx.dtype, device = ctx.device })
    local gx = like(ctx.in_shape, g)
    dist.all_gather(gx, g, { group = ctx.group })
    return gx
  end,
}

-- (size * n, ...) -> (n, ...): this rank's rows of the sum over ranks.
-- backward: all_gather of the gradient.
function F.reduce_scatter(x, group)
  group = group_or_world(group)
  if x:dim() == 0 or x.shape[1] % group:size() ~= 0 then
    error(string.format("dist.functional.reduce_scatter: dim 0 of x (%s) must be a multiple of "
      .. "the group's size (%d)", x:dim() == 0 and "a scalar" or tostring(x.shape[1]),
      group:size()), 2)
  end
  return RS(x, group)
end

local AR = moe.Function {
  name = "dist.all_reduce",
  forward = function(_, x, group)
    local out = x:contiguous():clone()
    dist.all_reduce(out, "sum", { group = group })
    return out
  end,
  backward = function(_, g) return g end,
}

-- The sum over ranks (a new tensor). backward: identity (Megatron's
-- pattern: the gradient of a replicated output is already the same on
-- every rank).
function F.all_reduce(x, group) return AR(x, group_or_world(group)) end

return dist
