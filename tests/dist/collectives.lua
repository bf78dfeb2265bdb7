--[[
tests/dist/collectives.lua - every collective of moe.dist over MPI, run
with 2 and 4 ranks (tests/CMakeLists.txt): all_reduce (sum, avg, max, min),
reduce_scatter, all_gather, broadcast, all_to_all with uneven and empty
splits, send / recv, barrier; every float dtype and the integers where the
op allows them; synchronous and async; split groups and a mesh; the Lua
argument errors. Every rank computes the expected result from the data
every rank made (T.val), a single-process reference.
]]
local T = dofile(arg[0]:match("^(.*/)") .. "common.lua")
local moe, dist = T.moe, T.dist
local R, P = T.rank, T.size

dist.init { timeout = 60 }
T.check(dist.world:size() == P and dist.world:rank() == R, "world group")
T.check(dist.world:name() == "world", "world name")
T.check(dist.local_world_size() == P and dist.local_rank() == R, "local rank (one node)")
local gpus = moe.cuda and moe.cuda.is_available() and moe.cuda.device_count() or 0
T.check(dist.device() == (gpus > 0 and "cuda:" .. (R % gpus) or "cpu"), "device")
T.check(dist.launcher() == "mpirun", "launcher")

local FLOATS = { "f32", "f64", "bf16", "f16" }
local ALL = { "f32", "f64", "bf16", "f16", "i8", "i32", "i64" }
local is_float = { f32 = true, f64 = true, bf16 = true, f16 = true }

local function reduce(op, f)
  local acc = f(0)
  for r = 1, P - 1 do
    local v = f(r)
    if op == "sum" or op == "avg" then acc = acc + v
    elseif op == "max" then acc = math.max(acc, v)
    else acc = math.min(acc, v) end
  end
  if op == "avg" then acc = acc / P end
  return acc
end

local function run(w, async)
  if async then
    T.check(w ~= nil, "async gives a work")
    w:wait()
    T.check(w:done(), "done after wait")
    w:wait() -- twice is allowed
  else
    T.check(w == nil, "sync gives nothing")
  end
end

-- all_reduce ----------------------------------------------------------
for _, dt in ipairs(ALL) do
  for _, op in ipairs { "sum", "avg", "max", "min" } do
    if op ~= "avg" or is_float[dt] then
      for _, async in ipairs { false, true } do
        local n = 37
        local t = T.make({ n }, dt, function(i) return T.val(R, i) end)
        run(dist.all_reduce(t, op, { async = async }), async)
        local want = {}
        for i = 0, n - 1 do want[i + 1] = reduce(op, function(r) return T.val(r, i) end) end
        T.same(t, want, 0, string.format("all_reduce(%s) %s async=%s", op, dt, tostring(async)))
      end
    end
  end
end
-- bool: max is any, min is all
do
  local t = T.make({ 4 }, "bool", function(i) return (i + R) % 3 == 0 end)
  dist.all_reduce(t, "max")
  local want = {}
  for i = 0, 3 do want[i + 1] = reduce("max", function(r) return (i + r) % 3 == 0 and 1 or 0 end) end
  T.same(t, want, 0, "all_reduce(max) bool")
end
-- empty and 2-D
do
  local e = moe.zeros({ 0 }, { dtype = "f32" })
  dist.all_reduce(e, "sum")
  local m = T.make({ 3, 4 }, "f32", function(i) return T.val(R, i) end)
  dist.all_reduce(m, "sum")
  local want = {}
  for i = 0, 11 do want[i + 1] = reduce("sum", function(r) return T.val(r, i) end) end
  T.same(m, want, 0, "all_reduce 2-D")
end

-- reduce_scatter ------------------------------------------------------
for _, dt in ipairs(ALL) do
  for _, op in ipairs { "sum", "avg", "max", "min" } do
    if op ~= "avg" or is_float[dt] then
      local n, C = 3, 2
      local input = T.make({ P * n, C }, dt, function(i) return T.val(R, i) end)
      local out = moe.zeros({ n, C }, { dtype = dt })
      local async = op == "max"
      run(dist.reduce_scatter(out, input, op, { async = async }), async)
      local want = {}
      for k = 0, n * C - 1 do
        want[k + 1] = reduce(op, function(r) return T.val(r, R * n * C + k) end)
      end
      T.same(out, want, 0, string.format("reduce_scatter(%s) %s", op, dt))
    end
  end
end

-- all_gather ----------------------------------------------------------
for _, dt in ipairs(ALL) do
  for _, async in ipairs { false, true } do
    local n = 5
    local input = T.make({ n }, dt, function(i) return T.val(R, i) end)
    local out = async and moe.zeros({ P, n }, { dtype = dt }) or moe.zeros({ P * n }, { dtype = dt })
    run(dist.all_gather(out, input, { async = async }), async)
    local want = {}
    for r = 0, P - 1 do for i = 0, n - 1 do want[#want + 1] = T.val(r, i) end end
    T.same(out, want, 0, "all_gather " .. dt)
  end
end

-- broadcast -----------------------------------------------------------
for _, dt in ipairs(ALL) do
  for root = 0, P - 1 do
    local t = T.make({ 2, 3 }, dt, function(i) return T.val(R, i) end)
    local async = root % 2 == 1
    run(dist.broadcast(t, root, { async = async }), async)
    local want = {}
    for i = 0, 5 do want[i + 1] = T.val(root, i) end
    T.same(t, want, 0, string.format("broadcast %s from %d", dt, root))
  end
end

-- all_to_all ----------------------------------------------------------
-- rank r sends (2r + j) % 3 rows to rank j: uneven, some empty.
local function sends(r)
  local s = {}
  for j = 0, P - 1 do s[j + 1] = (2 * r + j) % 3 end
  return s
end
local function sum(t, upto)
  local n = 0
  for i = 1, upto or #t do n = n + t[i] end
  return n
end
for _, dt in ipairs(ALL) do
  for variant = 1, 3 do
    local C = 3
    local send = sends(R)
    local recv = {}
    for j = 0, P - 1 do recv[j + 1] = sends(j)[R + 1] end
    local nin, nout = sum(send) + 1, sum(recv) + 2 -- rows past the splits are left alone
    local input = T.make({ nin, C }, dt, function(i) return T.val(R, i) end)
    local out = moe.full({ nout, C }, 99, { dtype = dt })
    local s, rv = send, recv
    if variant == 2 then -- splits as i64 tensors
      s, rv = moe.tensor(send, { dtype = "i64" }), moe.tensor(recv, { dtype = "i64" })
    end
    local async = variant == 3
    run(dist.all_to_all(out, input, s, rv, { async = async }), async)
    local want = {}
    for j = 0, P - 1 do
      local sj = sends(j)
      local first = sum(sj, R) -- rank j's rows for this rank start after those for ranks < R
      for row = first, first + sj[R + 1] - 1 do
        for c = 0, C - 1 do want[#want + 1] = T.val(j, row * C + c) end
      end
    end
    for _ = 1, 2 * C do want[#want + 1] = 99 end
    T.same(out, want, 0, string.format("all_to_all %s variant %d", dt, variant))
  end
end

-- send / recv ---------------------------------------------------------
for _, dt in ipairs(FLOATS) do
  local to, from = (R + 1) % P, (R - 1 + P) % P
  local t = T.make({ 6 }, dt, function(i) return T.val(R, i) end)
  local got = moe.zeros({ 6 }, { dtype = dt })
  local w = dist.send(t, to, { async = true })
  dist.recv(got, from)
  w:wait()
  local want = {}
  for i = 0, 5 do want[i + 1] = T.val(from, i) end
  T.same(got, want, 0, "ring send/recv " .. dt)
end
do -- synchronous pairs: even ranks send first
  local peer = R % 2 == 0 and R + 1 or R - 1
  local t = T.make({ 4 }, "i64", function(i) return R * 10 + i end)
  local got = moe.zeros({ 4 }, { dtype = "i64" })
  if R % 2 == 0 then dist.send(t, peer); dist.recv(got, peer)
  else dist.recv(got, peer); dist.send(t, peer) end
  T.same(got, { peer * 10, peer * 10 + 1, peer * 10 + 2, peer * 10 + 3 }, 0, "send/recv pairs")
  -- a recv whose tensor is larger than what comes is an error naming the sizes
  local big = moe.zeros({ 8 }, { dtype = "i64" })
  if R % 2 == 0 then
    dist.send(t, peer)
  else
    T.raises(function() dist.recv(big, peer) end, { "sent 4 elements, the tensor [8] has 8" },
      "short recv")
  end
end
dist.barrier()

-- groups --------------------------------------------------------------
do
  local g = dist.world:split(R % 2, R, "parity")
  T.check(g:name() == "parity", "group name")
  T.check(g:size() == P // 2 and g:rank() == R // 2, "parity group rank %d size %d", g:rank(), g:size())
  local ranks = g:ranks()
  for k = 1, #ranks do T.check(ranks[k] == R % 2 + 2 * (k - 1), "parity ranks") end
  T.check(g:world_rank(0) == R % 2, "world_rank")
  for _, dt in ipairs { "f32", "bf16", "i64" } do
    local t = T.make({ 5 }, dt, function(i) return T.val(R, i) end)
    local w = dist.all_reduce(t, "sum", { group = g, async = true })
    w:wait()
    local want = {}
    for i = 0, 4 do
      local acc = 0
      for r = R % 2, P - 1, 2 do acc = acc + T.val(r, i) end
      want[i + 1] = acc
    end
    T.same(t, want, 0, "all_reduce on the parity group " .. dt)
  end
  -- a split of a split; key reverses the order
  local h = g:split(0, -R, "reversed")
  T.check(h:rank() == g:size() - 1 - g:rank(), "key orders the ranks")
  dist.barrier(h)
  h:free()
  h:free() -- idempotent
  T.raises(function() dist.barrier(h) end, "attempt to use a freed group", "freed group")
  T.check(tostring(h) == "moe.Group (freed)", "freed tostring")
  g:set_timeout(30)
  T.check(g:timeout() == 30, "timeout")
  g:free()
end

-- mesh ----------------------------------------------------------------
do
  local mesh = P == 4 and dist.mesh { ep = 2, dp = 2 } or dist.mesh { ep = P, dp = 1 }
  T.check(mesh.names[1] == "dp" and mesh.names[2] == "ep", "map form orders dp before ep")
  local ep, dpn = mesh:size("ep"), mesh:size("dp")
  T.check(ep * dpn == P and mesh.shape[1] == dpn and mesh.shape[2] == ep, "shape")
  T.check(mesh:rank("ep") == R % ep and mesh:rank("dp") == R // ep, "coordinates")
  T.check(mesh:rank { "dp", "ep" } == R and mesh:size { "ep", "dp" } == P, "flattened")
  local gep, gdp = mesh:group("ep"), mesh:group("dp")
  T.check(mesh:group("ep") == gep, "groups are cached")
  T.check(gep:size() == ep and gep:rank() == R % ep and gep:name() == "ep", "ep group")
  T.check(gdp:size() == dpn and gdp:rank() == R // ep, "dp group")
  local both = mesh:group { "ep", "dp" }
  T.check(both:name() == "dp_ep" and both:size() == P and both:rank() == R, "flattened group")
  local t = T.make({ 3 }, "f32", function(i) return T.val(R, i) end)
  dist.all_reduce(t, "sum", { group = gep })
  local want = {}
  for i = 0, 2 do
    local acc = 0
    for e = 0, ep - 1 do acc = acc + T.val((R // ep) * ep + e, i) end
    want[i + 1] = acc
  end
  T.same(t, want, 0, "all_reduce over the ep group")
  local l = dist.mesh { { "pipe", 1 }, { "x", P } }
  T.check(l.names[1] == "pipe" and l:size("x") == P and l:rank("x") == R, "list form")
  T.raises(function() dist.mesh { dp = P, ep = 2 } end,
    { "dist.mesh: dp=" .. P .. " x ep=2 makes " .. 2 * P .. " ranks but the world has " .. P },
    "mesh product")
  T.raises(function() dist.mesh { dp = P, foo = 1 } end, { "unknown dim 'foo' in the map form" },
    "mesh unknown dim")
  T.raises(function() dist.mesh { dp = 0 } end, { "the size of 'dp' must be a positive integer, got 0" },
    "mesh size")
  T.raises(function() mesh:group("tp") end, { "no dim 'tp' in the mesh" }, "mesh group unknown")
end

-- argument errors -----------------------------------------------------
do
  local t = moe.zeros({ 4 })
  T.raises(function() dist.all_reduce(t, "mean") end,
    { "bad argument #2 to 'all_reduce'", "op must be \"sum\", \"avg\", \"max\" or \"min\"" }, "op name")
  T.raises(function() dist.all_reduce(t, "sum", { asink = true }) end, { "unknown option 'asink'" },
    "option name")
  T.raises(function() dist.all_reduce(t, "sum", { async = 1 }) end, { "option async must be a boolean" },
    "async type")
  T.raises(function() dist.all_reduce(t, "sum", { group = 3 }) end, { "group expected" }, "group type")
  T.raises(function() dist.all_reduce(moe.zeros({ 2 }, { dtype = "i64" }), "avg") end,
    { "avg needs a float tensor", "got i64" }, "avg of integers")
  T.raises(function() dist.all_to_all(t, t, { 1 }, { 1 }) end,
    { "send splits must have one entry per rank of the group (" .. P .. "), got 1" }, "splits length")
  T.raises(function() dist.all_to_all(t, t, moe.zeros({ P }), moe.zeros({ P })) end,
    { "must be an i64 CPU tensor" }, "splits dtype")
  T.raises(function() dist.send(t, R) end, { "is not another rank" }, "send to self")
  T.raises(function() dist.broadcast(t, P) end, { "root " .. P .. " is not a rank of group 'world'" },
    "root")
  T.raises(function() dist.all_gather(moe.zeros({ 3 }), t) end,
    { "all_gather: output [3] has 3 elements but group 'world' of " .. P .. " ranks gathers" },
    "all_gather shapes")
  T.raises(function() dist.reduce_scatter(moe.zeros({ 3 }), moe.zeros({ 3 * P + 1 })) end,
    { "reduce_scatter: input [" .. (3 * P + 1) .. "] must be (size * n, ...) for output [3]" },
    "reduce_scatter shapes")
  T.raises(function() dist.all_reduce(moe.zeros({ 2, 3 }):transpose(0, 1), "sum") end,
    { "must be contiguous" }, "contiguous")
end

T.ok("collectives")
