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
  dist.functional.chunked_all_to_all(chunks, group)   an all_to_all in chunks,
                                      each started asynchronously, for
                                      pipelining with compute (below)

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

-- ------------------------------------------------- chunked all_to_all

--[[
A pipeline of all_to_alls in C chunks, each asynchronous, so that the
compute on one chunk overlaps the exchange of the others (expert
parallelism's dispatch and return: moe/layers/ep.lua). chunks[c] =
{send = {P rows}, recv = {P rows}} (P the group's size): chunk c sends rows
[o_c, o_c + sum(send_c)) of x, o_c the sum of the earlier chunks' sends,
send_c[j] of them to rank j, in rank order; recv_c[j] rows come from rank j.

  local p = dist.functional.chunked_all_to_all(chunks, group)
  p:scatter(x)          starts every chunk's all_to_all (in chunk order)
  p:received(c) -> rc   (sum(recv_c), ...): chunk c's rows, waiting for them only
  p:reply(c, yc)        starts sending yc (sum(recv_c) rows) back to their
                        sources (chunk c's splits swapped)
  p:gathered() -> y     (sum of the sends, ...): every reply, in x's row
                        order (rows of x past the sends are not in y), waiting
                        for them all
opts.trace (a list): each start and wait is appended to it ("scatter: start
1", "backward reply: wait 3", ...), for tests of the schedule.

Each is differentiable. In backward, gathered starts every reply's reverse
all_to_all at once (last chunk first); reply(c) waits for chunk c's;
received(c) starts chunk c's reverse all_to_all as soon as its gradient is
there; scatter waits for them all. The four pieces are tied by one-element
"token" tensors (f32) that carry no values, only the order: the received
chunks hang off scatter's token, the replies' tokens are summed into
gathered's input. So backward reaches the chunks one after the other, last
chunk first (the engine runs a node's inputs last-pushed first, and the sum
pushes the last chunk last), each chunk's own work (what the caller did
between received(c) and reply(c)) running while the other chunks' exchanges
are on the wire.

Order. Every rank must start the same collectives in the same order: the
forward starts scatter's chunks in order and the replies in chunk order (a
reply given before an earlier chunk's is held until that one is given);
backward starts the received chunks' reverse all_to_alls last chunk first
(a gradient that arrives early is held), and scatter's backward starts those
that got no gradient (with zeros). Every chunk must be received before
gathered and replied before gathered: otherwise an error.

Streams (GPU): a chunk's collective runs on the communication stream after
the work queued on the compute stream before it started (moe_dist.h); its
wait makes the compute stream wait for it, so the compute of chunk c and the
exchange of chunk c + 1 run at once. On the CPU (MPI) a collective moves when
it is waited for: the results are the same, the overlap is not there.
]]

local Pipe = {}
Pipe.__index = Pipe
Pipe.__name = "moe.dist.ChunkedAllToAll"

local function pipe_fail(msg, level) error("dist.functional.chunked_all_to_all: " .. msg, level + 1) end

local function token(device) return moe.zeros({ 1 }, { dtype = "f32", device = device }) end

-- Handles made by backward functions (run on autograd's thread, outside any
-- scope): the engine holds what it needs of them once the function has
-- returned, so the next function of the pipeline frees them.
local function linger(p, t) p.linger[#p.linger + 1] = t end

local function free_linger(p)
  for i = #p.linger, 1, -1 do
    p.linger[i]:free()
    p.linger[i] = nil
  end
end

local function a2a_async(p, out, x, send, recv)
  return dist.all_to_all(out, x, send, recv, { group = p.group, async = true })
end

local function wait_free(w)
  w:wait()
  w:free()
end

-- opts.trace: a list the pipeline appends its steps to ("scatter 1", ...).
local function note(p, what, c)
  local t = p.trace
  if t then t[#t + 1] = c and what .. " " .. c or what end
end

-- Starts the received chunks' reverse all_to_alls that can go: last chunk
-- first, each once its gradient is there (or it received no rows, or force:
-- zeros).
local function start_backward(p, force)
  while p.next_bw >= 1 do
    local c = p.next_bw
    local g = p.bw_grad[c]
    if g == nil and (force or p.nrecv[c] == 0) then
      g = moe.zeros(with_rows(p.row_shape, p.nrecv[c]), { dtype = p.dtype, device = p.device })
    end
    if g == nil then return end
    if p.gx == nil then
      local make = p.x_rows > p.total and moe.zeros or moe.empty
      p.gx = make(with_rows(p.row_shape, p.x_rows), { dtype = p.dtype, device = p.device })
    end
    local out = p.gx:narrow(0, p.offset[c], p.nsend[c])
    p.bw_work[c] = a2a_async(p, out, g, p.recv[c], p.send[c])
    note(p, "backward received: start", c)
    out:free() -- the work holds the tensors it uses
    g:free()
    p.bw_grad[c] = nil
    p.next_bw = c - 1
  end
end

-- Starts the replies that can go, in chunk order.
local function start_replies(p)
  while p.next_reply <= p.n and p.reply_rows[p.next_reply] do
    local c = p.next_reply
    local y = p.reply_rows[c]
    local out = p.out:narrow(0, p.offset[c], p.nsend[c])
    p.reply_work[c] = a2a_async(p, out, y, p.recv[c], p.send[c])
    note(p, "reply: start", c)
    out:free()
    y:free()
    p.reply_rows[c] = nil
    p.next_reply = c + 1
  end
end

local SCATTER = moe.Function {
  name = "dist.chunked_all_to_all.scatter",
  forward = function(ctx, x, p)
    ctx.p = p
    p.row_shape, p.x_rows, p.dtype, p.device = x.shape, x.shape[1], x.dtype, x.device
    local xc = x:contiguous()
    for c = 1, p.n do
      local buf = moe.empty(with_rows(x.shape, p.nrecv[c]), { dtype = x.dtype, device = x.device })
      local piece = xc:narrow(0, p.offset[c], p.nsend[c])
      p.fw_work[c] = a2a_async(p, buf, piece, p.send[c], p.recv[c])
      note(p, "scatter: start", c)
      piece:free()
      p.received_rows[c] = buf
    end
    return token(x.device)
  end,
  backward = function(ctx)
    local p = ctx.p
    free_linger(p)
    start_backward(p, true)
    for c = p.n, 1, -1 do
      wait_free(p.bw_work[c])
      p.bw_work[c] = nil
      note(p, "backward scatter: wait", c)
    end
    local gx = p.gx
    p.gx = nil
    linger(p, gx)
    return gx
  end,
}

local RECEIVED = moe.Function {
  name = "dist.chunked_all_to_all.received",
  forward = function(ctx, _, p, c)
    ctx.p, ctx.c = p, c
    wait_free(p.fw_work[c])
    p.fw_work[c] = nil
    note(p, "received: wait", c)
    local buf = p.received_rows[c]
    p.received_rows[c] = nil
    return buf
  end,
  backward = function(ctx, g)
    local p, c = ctx.p, ctx.c
    free_linger(p)
    -- a handle of our own (the one given to backward is freed when it returns)
    local d = g:detach()
    local gc = d:contiguous()
    if gc ~= d then d:free() end
    p.bw_grad[c] = gc
    start_backward(p, false)
    local t = token(p.device)
    linger(p, t)
    return t
  end,
}

local REPLY = moe.Function {
  name = "dist.chunked_all_to_all.reply",
  forward = function(ctx, y, p, c)
    ctx.p, ctx.c = p, c
    if p.out == nil then
      p.out = moe.empty(with_rows(y.shape, p.total), { dtype = y.dtype, device = y.device })
      p.out_row_shape = y.shape
    end
    local d = y:detach()
    local yc = d:contiguous()
    if yc ~= d then d:free() end
    p.reply_rows[c] = yc
    start_replies(p)
    return token(y.device)
  end,
  backward = function(ctx)
    local p, c = ctx.p, ctx.c
    free_linger(p)
    wait_free(p.grad_work[c])
    p.grad_work[c] = nil
    note(p, "backward reply: wait", c)
    local gy = p.grad_rows[c]
    p.grad_rows[c] = nil
    linger(p, gy)
    return gy
  end,
}

local GATHERED = moe.Function {
  name = "dist.chunked_all_to_all.gathered",
  forward = function(ctx, _, p)
    ctx.p = p
    for c = 1, p.n do
      wait_free(p.reply_work[c])
      p.reply_work[c] = nil
      note(p, "gathered: wait", c)
    end
    local out = p.out
    p.out = nil
    return out
  end,
  backward = function(ctx, g)
    local p = ctx.p
    free_linger(p)
    local gc = g:contiguous()
    for c = p.n, 1, -1 do
      local rows = moe.empty(with_rows(gc.shape, p.nrecv[c]), { dtype = gc.dtype, device = gc.device })
      local piece = gc:narrow(0, p.offset[c], p.nsend[c])
      p.grad_work[c] = a2a_async(p, rows, piece, p.send[c], p.recv[c])
      note(p, "backward gathered: start", c)
      piece:free()
      p.grad_rows[c] = rows
    end
    local t = token(gc.device)
    if gc ~= g then gc:free() end
    linger(p, t)
    return t
  end,
}

local function split_list(v, what, c, P)
  if moe.is_tensor(v) then v = v:totable() end
  if type(v) ~= "table" or #v ~= P then
    pipe_fail(string.format("chunks[%d].%s must be a list of %d row counts (one per rank), got %s", c, what,
      P, type(v) == "table" and #v .. " entries" or type(v)), 4)
  end
  local out, n = {}, 0
  for j = 1, P do
    local r = v[j]
    if math.type(r) ~= "integer" or r < 0 then
      pipe_fail(string.format("chunks[%d].%s[%d] must be a non-negative integer, got %s", c, what, j,
        tostring(r)), 4)
    end
    out[j] = r
    n = n + r
  end
  return out, n
end

-- dist.functional.chunked_all_to_all(chunks [, group] [, {trace = list}])
-- -> a pipeline (above); trace: a list that each step is appended to.
function F.chunked_all_to_all(chunks, group, opts)
  group = group_or_world(group)
  if opts ~= nil and type(opts) ~= "table" then pipe_fail("opts must be a table ({trace =})", 2) end
  if type(chunks) ~= "table" or #chunks == 0 then
    pipe_fail("chunks must be a non-empty list of {send =, recv =}, got " .. type(chunks), 2)
  end
  local P, n = group:size(), #chunks
  local p = setmetatable({ group = group, n = n, send = {}, recv = {}, nsend = {}, nrecv = {}, offset = {},
    total = 0, fw_work = {}, received_rows = {}, got = {}, reply_rows = {}, reply_work = {}, replied = {},
    next_reply = 1, grad_work = {}, grad_rows = {}, bw_grad = {}, bw_work = {}, next_bw = n, linger = {}, trace = opts and opts.trace }, Pipe)
  for c, ch in ipairs(chunks) do
    if type(ch) ~= "table" then pipe_fail(string.format("chunks[%d] must be {send =, recv =}, got %s", c, type(ch)), 2) end
    p.send[c], p.nsend[c] = split_list(ch.send, "send", c, P)
    p.recv[c], p.nrecv[c] = split_list(ch.recv, "recv", c, P)
    p.offset[c] = p.total
    p.total = p.total + p.nsend[c]
  end
  return p
end

function Pipe:scatter(x)
  if self.scattered then pipe_fail("scatter was already called on this pipeline", 2) end
  if not moe.is_tensor(x) or x:dim() == 0 then pipe_fail("scatter: x must be a tensor with rows", 2) end
  if x.shape[1] < self.total then
    pipe_fail(string.format("scatter: the chunks send %d rows but x has %d", self.total, x.shape[1]), 2)
  end
  self.scattered = true
  self.token_in = SCATTER(x, self)
  return self
end

local function check_chunk(p, c, fname)
  if math.type(c) ~= "integer" or c < 1 or c > p.n then
    pipe_fail(string.format("%s: chunk must be an integer in 1..%d, got %s", fname, p.n, tostring(c)), 3)
  end
end

function Pipe:received(c)
  check_chunk(self, c, "received")
  if not self.scattered then pipe_fail("received: call scatter(x) first", 2) end
  if self.got[c] then pipe_fail(string.format("received: chunk %d was already received", c), 2) end
  self.got[c] = true
  return RECEIVED(self.token_in, self, c)
end

function Pipe:reply(c, y)
  check_chunk(self, c, "reply")
  if self.replied[c] then pipe_fail(string.format("reply: chunk %d was already replied", c), 2) end
  if not moe.is_tensor(y) or y:dim() == 0 or y.shape[1] ~= self.nrecv[c] then
    pipe_fail(string.format("reply: chunk %d must reply its %d received rows, got %s", c, self.nrecv[c],
      moe.is_tensor(y) and (y:dim() == 0 and "a scalar" or y.shape[1] .. " rows") or type(y)), 2)
  end
  local rs = self.out_row_shape
  if rs then
    for i = 2, #rs do
      if y.shape[i] ~= rs[i] then pipe_fail(string.format("reply: chunk %d's rows differ in shape from an "
        .. "earlier chunk's", c), 2) end
    end
    if #rs ~= y:dim() then pipe_fail(string.format("reply: chunk %d's rows differ in shape from an earlier "
      .. "chunk's", c), 2) end
  end
  self.replied[c] = true
  local t = REPLY(y, self, c)
  self.token_out = self.token_out and self.token_out + t or t
  return self
end

function Pipe:gathered()
  for c = 1, self.n do
    if self.scattered and not self.got[c] then pipe_fail(string.format("gathered: chunk %d was never received", c), 2) end
    if not self.replied[c] then pipe_fail(string.format("gathered: chunk %d was never replied", c), 2) end
  end
  if self.gathered_once then pipe_fail("gathered was already called on this pipeline", 2) end
  self.gathered_once = true
  return GATHERED(self.token_out, self)
end

return dist
