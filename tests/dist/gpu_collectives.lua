--[[
tests/dist/gpu_collectives.lua - moe.dist on GPU tensors (NCCL, core/dist_nccl.c)
against CPU references, on 2 ranks with one GPU each:

  mpirun -n 2 --bind-to none build/moe-lua tests/dist/gpu_collectives.lua [part=all]

part=collectives: every collective (all_reduce with each op, reduce_scatter,
all_gather, broadcast from each root, all_to_all with uneven splits that
include zeros, send/recv) in every dtype NCCL takes, on values every dtype
holds exactly (multiples of 1/4 below 12, integers for the integer dtypes),
so sums, averages, maxima and minima are compared exactly; a large random
all_reduce in f32 and bf16 with per-dtype tolerances (see `tol`);
asynchronous works and their ordering with compute on both sides (the
collective reads what a kernel queued before it wrote, a kernel queued after
the wait reads the result, an input whose handle is freed before the wait
is not reused under the collective); split groups made before the world has
an NCCL communicator (made lazily from their own NCCL id) and after
(ncclCommSplit), in reversed rank order, of one rank, and two groups in
flight at once.

part=timeout: on a split group with a 3 s timeout rank 1 skips one
all_reduce; rank 0's host sync returns once the watchdog has aborted the
collective (about 3 s), and the wait and the next call on the group fail
with the message naming the collective, the group and the rank. The world
(120 s) stays usable.

part=all (the default) runs both, the timeout last.

Without 2 GPUs, a CUDA build and 2 ranks it prints SKIPPED and exits 77
(before touching MPI) for ctest to count it as skipped. Prints "PASS <name>"
per check on rank 0 and "rank r: OK" at the end; a failure prints the error
with its traceback and ends the job (dist.abort) so that the other rank does
not wait for it.
]]
local moe = require "moe"

local part = "all"
for _, a in ipairs(arg or {}) do
  local v = tostring(a):match("^part=(.*)$")
  if v then part = v end
end
if part ~= "all" and part ~= "collectives" and part ~= "timeout" then
  error("gpu_collectives: part must be all, collectives or timeout, got '" .. part .. "'", 0)
end

local function skip(why)
  print("SKIPPED: tests/dist/gpu_collectives.lua (" .. part .. "): " .. why)
  os.exit(77)
end

local env_size = tonumber(os.getenv("OMPI_COMM_WORLD_SIZE") or os.getenv("SLURM_NTASKS")
  or os.getenv("WORLD_SIZE") or "1")
if not moe.build_info().cuda then skip("this moe-lua was built without CUDA") end
if moe.cuda.device_count() < 2 then
  skip(("needs 2 GPUs, %d visible"):format(moe.cuda.device_count()))
end
if env_size ~= 2 then skip(("needs 2 ranks (mpirun -n 2), got %d"):format(env_size)) end

local dist = moe.dist
dist.init { timeout = 120 }
local rank, size = dist.rank(), dist.world_size()
assert(size == 2, "world size 2 expected")
local dev = dist.device()
assert(dev == "cuda:" .. dist.local_rank(), "dist.device() is " .. tostring(dev))

local function pass(name)
  if rank == 0 then print("PASS " .. name) end
end

-- ------------------------------------------------------------ helpers

local FLOATS = { f32 = true, f64 = true, bf16 = true, f16 = true }
local DTYPES = { "f32", "f64", "bf16", "f16", "i8", "u8", "i32", "i64" }

-- Element i (0-based) of rank r's tensor number `salt`: exact in every dtype.
local function value(dt, r, i, salt)
  local k = (i * 7 + r * 13 + salt * 5) % 23
  if dt == "u8" then return k end
  if FLOATS[dt] then return (k - 11) * 0.25 end
  return k - 11
end

local function values(dt, r, n, salt, first)
  local v = {}
  for i = 1, n do v[i] = value(dt, r, (first or 0) + i - 1, salt) end
  return v
end

-- A tensor of the given shape (a table) from a flat list of values.
local function make(vals, shape, dt)
  local t = moe.tensor(vals, { dtype = dt, device = dev })
  return t:reshape(table.unpack(shape))
end

local function flat(t)
  local c = t:cpu():double()
  return c:reshape(c:numel()):totable()
end

-- Exact comparison (values chosen so that every result is representable).
local function same(name, got, want)
  if #got ~= #want then
    error(("%s on rank %d: %d elements, %d expected"):format(name, rank, #got, #want), 2)
  end
  for i = 1, #want do
    if got[i] ~= want[i] then
      error(("%s on rank %d: element %d is %s, %s expected"):format(name, rank, i - 1,
        tostring(got[i]), tostring(want[i])), 2)
    end
  end
end

local function reduce(op, a, b)
  if op == "sum" then return a + b end
  if op == "avg" then return (a + b) / 2 end
  if op == "max" then return math.max(a, b) end
  return math.min(a, b)
end

local function sync() moe.cuda.synchronize(dev) end

-- ------------------------------------------------------------ timeout

local function timeout_test()
  local g = dist.world:split(0, rank, "t")
  g:set_timeout(3)
  local x = make(values("f32", rank, 1024, 1), { 1024 }, "f32")
  dist.all_reduce(x, "sum", { group = g }) -- every rank: g's NCCL communicator, connected
  sync()
  if rank == 1 then
    print("rank 1: skips the next all_reduce on group 't'")
  else
    local t0 = moe.clock()
    local w = dist.all_reduce(x, "sum", { group = g, async = true })
    local ok_wait, err_wait = pcall(w.wait, w) -- orders the stream; no host wait
    assert(ok_wait, "the wait before the deadline should not fail: " .. tostring(err_wait))
    assert(not w:done(), "the skipped collective cannot have completed")
    local ok_sync, err_sync = pcall(sync) -- returns once the watchdog has aborted it (~3 s)
    local waited = moe.clock() - t0
    print(("rank 0: the host sync returned after %.2f s (%s)"):format(waited,
      ok_sync and "ok" or tostring(err_sync)))
    assert(waited > 2.5 and waited < 60, ("the host sync returned after %.2f s"):format(waited))
    assert(w:done(), "the aborted collective should count as done")
    local ok2, err2 = pcall(dist.all_reduce, x, "sum", { group = g })
    assert(not ok2, "a call on the failed group should fail")
    err2 = tostring(err2)
    print("rank 0: the next all_reduce -> " .. err2)
    for _, want in ipairs { "all_reduce(sum) of 1024 f32 on group 't' (rank 0 of 2, cuda:0)",
                            "did not complete within 3 s" } do
      assert(err2:find(want, 1, true), ("the message lacks %q: %s"):format(want, err2))
    end
    local ok3 = pcall(dist.broadcast, x, 0, { group = g, async = true })
    assert(not ok3, "an async call on the failed group should fail")
    w:free()
    pass(("timeout: rank 0 got the error after %.1f s"):format(waited))
  end
  -- the world is not affected
  local y = make(values("f32", rank, 8, 2), { 8 }, "f32")
  dist.all_reduce(y, "max")
  local want = {}
  for i = 1, 8 do want[i] = math.max(value("f32", 0, i - 1, 2), value("f32", 1, i - 1, 2)) end
  same("all_reduce on the world after the timeout", flat(y), want)
  dist.barrier()
  g:free()
  pass("the world still works after a group timed out")
end

local function collectives_test()

  -- A group made before the world has an NCCL communicator: its own NCCL id.
  local rev_early = dist.world:split(0, -rank, "rev_early")
  assert(rev_early:rank() == 1 - rank and rev_early:size() == 2)

  local function check_all_reduce(dt, group, grank)
    grank = grank or rank
    local ops = FLOATS[dt] and { "sum", "avg", "max", "min" } or { "sum", "max", "min" }
    local n = 1000
    for _, op in ipairs(ops) do
      local t = make(values(dt, grank, n, 2), { 10, 100 }, dt)
      dist.all_reduce(t, op, { group = group })
      local want = {}
      for i = 1, n do
        want[i] = reduce(op, value(dt, 0, i - 1, 2), value(dt, 1, i - 1, 2))
      end
      same(("all_reduce(%s) %s"):format(op, dt), flat(t), want)
    end
  end

  local function check_dtype(dt)
    check_all_reduce(dt)

    -- reduce_scatter: in (2 * 6, 5), out (6, 5)
    local rows, cols = 6, 5
    for _, op in ipairs(FLOATS[dt] and { "sum", "avg" } or { "sum", "max" }) do
      local input = make(values(dt, rank, 2 * rows * cols, 3), { 2 * rows, cols }, dt)
      local out = moe.zeros({ rows, cols }, { dtype = dt, device = dev })
      dist.reduce_scatter(out, input, op)
      local want, first = {}, rank * rows * cols
      for i = 1, rows * cols do
        want[i] = reduce(op, value(dt, 0, first + i - 1, 3), value(dt, 1, first + i - 1, 3))
      end
      same(("reduce_scatter(%s) %s"):format(op, dt), flat(out), want)
    end

    -- all_gather: in (3, 7), out (2 * 3, 7) and a flat out of the same size
    local input = make(values(dt, rank, 21, 4), { 3, 7 }, dt)
    local want = {}
    for r = 0, 1 do
      for i = 1, 21 do want[#want + 1] = value(dt, r, i - 1, 4) end
    end
    local out = moe.zeros({ 6, 7 }, { dtype = dt, device = dev })
    dist.all_gather(out, input)
    same("all_gather " .. dt, flat(out), want)
    local out_flat = moe.zeros({ 42 }, { dtype = dt, device = dev })
    dist.all_gather(out_flat, input)
    same("all_gather (flat out) " .. dt, flat(out_flat), want)

    -- broadcast from each root
    for root = 0, 1 do
      local t = make(values(dt, rank, 33, 5 + root), { 33 }, dt)
      dist.broadcast(t, root)
      same(("broadcast from %d %s"):format(root, dt), flat(t), values(dt, root, 33, 5 + root))
    end

    -- send / recv both ways, on the same stream order on both ranks
    local mine = make(values(dt, rank, 17, 8), { 17 }, dt)
    local theirs = moe.zeros({ 17 }, { dtype = dt, device = dev })
    if rank == 0 then
      dist.send(mine, 1)
      dist.recv(theirs, 1)
    else
      dist.recv(theirs, 0)
      dist.send(mine, 0)
    end
    same("send/recv " .. dt, flat(theirs), values(dt, 1 - rank, 17, 8))
    pass("all_reduce, reduce_scatter, all_gather, broadcast, send/recv " .. dt)
  end

  -- all_to_all: S[r][j] rows go from rank r to rank j; rows of shape (3, 5).
  local function check_all_to_all(dt, S, name)
    local row = 15
    local nsend = S[rank + 1][1] + S[rank + 1][2]
    local send = { S[rank + 1][1], S[rank + 1][2] }
    local recv = { S[1][rank + 1], S[2][rank + 1] }
    local nrecv = recv[1] + recv[2]
    -- in and out one row longer than needed: the sums may be below dim 0
    local input = make(values(dt, rank, (nsend + 1) * row, 9), { nsend + 1, 3, 5 }, dt)
    local out = moe.full({ nrecv + 1, 3, 5 }, 1, { dtype = dt, device = dev })
    dist.all_to_all(out, input, send, recv)
    local want = {}
    for r = 0, 1 do
      local first = 0 -- rows of rank r's input before those for this rank
      for j = 0, rank - 1 do first = first + S[r + 1][j + 1] end
      for i = 1, S[r + 1][rank + 1] * row do want[#want + 1] = value(dt, r, first * row + i - 1, 9) end
    end
    for _ = 1, row do want[#want + 1] = 1 end -- the spare row is untouched
    same(("all_to_all %s %s"):format(name, dt), flat(out), want)
  end

  local SPLITS = {
    { { { 3, 0 }, { 5, 2 } }, "uneven with a zero" },
    { { { 0, 4 }, { 0, 0 } }, "rank 0 receives nothing, rank 1 sends nothing" },
    { { { 0, 0 }, { 0, 0 } }, "all zero" },
    { { { 64, 64 }, { 64, 64 } }, "equal" },
  }

  for _, dt in ipairs(DTYPES) do
    check_dtype(dt)
    for _, s in ipairs(SPLITS) do check_all_to_all(dt, s[1], s[2]) end
    pass("all_to_all " .. dt)
  end

  -- Large random all_reduce (several NCCL chunks): tolerances per dtype. The
  -- sum of two values is rounded once to the dtype (NCCL adds in the dtype
  -- for 2 ranks), so half an ulp of the result: 2^-24 (f32), 2^-9 (bf16),
  -- written with room.
  local tol = { f32 = 1e-6, bf16 = 8e-3 }
  for _, dt in ipairs { "f32", "bf16" } do
    local n = 3 * 1024 * 1024 + 17
    local inputs = {}
    for r = 0, 1 do
      moe.manual_seed(100 + r)
      inputs[r] = moe.randn({ n }):to(dt):double()
    end
    local want = inputs[0] + inputs[1]
    local t = inputs[rank]:to(dt):to(dev)
    dist.all_reduce(t, "sum")
    local got = t:cpu():double()
    local err = moe.max(moe.abs(got - want) / (moe.abs(want) + 1)):item()
    assert(err <= tol[dt], ("large all_reduce %s on rank %d: relative error %g > %g"):format(dt,
      rank, err, tol[dt]))
    pass(("large all_reduce %s (%d elements, max rel. error %.2g)"):format(dt, n, err))
  end

  -- ------------------------------------------------------------ async and ordering

  do
    -- The collective reads what a long kernel queued before it wrote; a kernel
    -- queued after the wait reads the reduced values.
    local m = 4096
    moe.manual_seed(7)
    local a = moe.randn({ m, m }, { device = dev })
    local b = moe.randn({ m, m }, { device = dev }) * 0
    local y = moe.matmul(a, b) + (rank + 1) -- long kernels, then y = rank + 1 everywhere
    for _ = 1, 4 do y = moe.matmul(a, b) + y end
    local w = dist.all_reduce(y, "sum", { async = true })
    w:wait()
    local z = y * 2 -- queued after the wait: (1 + 2) * 2
    local err = moe.max(moe.abs(z:cpu():double() - 6)):item()
    assert(err == 0, ("async all_reduce on rank %d: max error %g (6 expected)"):format(rank, err))
    assert(w:done())
    w:wait() -- waiting twice is allowed
    pass("async all_reduce ordered after and before compute")
  end

  do
    -- done() is false while the peer has not come; the input's handle freed
    -- before the wait: the work holds it, so the blocks allocated and written
    -- meanwhile (same size) are not the input's and the result is intact.
    local n = 4 * 1024 * 1024 -- f32 integers below 2^24: exact
    local input = moe.arange(n, { dtype = "f32", device = dev }) + rank * n
    local out = moe.zeros({ 2 * n }, { device = dev })
    sync()
    if rank == 1 then os.execute("sleep 1") end
    local w = dist.all_gather(out, input, { async = true })
    if rank == 0 then assert(not w:done(), "all_gather done before rank 1 called it") end
    input:free()
    local junk = {}
    for k = 1, 8 do junk[k] = moe.full({ n }, -1, { device = dev }) end
    w:wait()
    local err = moe.max(moe.abs(out:cpu():double() - moe.arange(2 * n):double())):item()
    assert(err == 0, ("all_gather with a freed input on rank %d: max error %g"):format(rank, err))
    for k = 1, #junk do junk[k]:free() end
    w:free()
    pass("async all_gather: done() before the peer, input freed before the wait")
  end

  do
    local e = moe.zeros({ 0 }, { device = dev })
    dist.all_reduce(e, "sum")
    local w = dist.all_reduce(e, "max", { async = true })
    w:wait()
    pass("empty all_reduce")
  end

  -- ------------------------------------------------------------ groups

  -- Made after the world has an NCCL communicator: ncclCommSplit.
  local rev_late = dist.world:split(0, -rank, "rev_late")
  local solo = dist.world:split(rank, 0, "solo")
  assert(rev_late:rank() == 1 - rank and solo:size() == 1)

  for _, g in ipairs { rev_early, rev_late } do
    local gr = g:rank()
    for _, dt in ipairs { "f32", "bf16", "i32" } do check_all_reduce(dt, g, gr) end
    -- all_gather in group rank order: group rank 0 is world rank 1
    local input = make(values("f32", gr, 12, 12), { 12 }, "f32")
    local out = moe.zeros({ 24 }, { device = dev })
    dist.all_gather(out, input, { group = g })
    local want = values("f32", 0, 12, 12)
    for _, v in ipairs(values("f32", 1, 12, 12)) do want[#want + 1] = v end
    same("all_gather on " .. g:name(), flat(out), want)
    -- broadcast from group rank 0 (world rank 1)
    local t = make(values("f32", gr, 9, 13), { 9 }, "f32")
    dist.broadcast(t, 0, { group = g })
    same("broadcast on " .. g:name(), flat(t), values("f32", 0, 9, 13))
    -- all_to_all: every rank sends 2 rows to group rank 0 and 3 to group rank 1
    local sends = { 2, 3 }
    local recv = gr == 0 and { 2, 2 } or { 3, 3 }
    local inp = make(values("f32", gr, 5 * 4, 14), { 5, 4 }, "f32")
    local o = moe.zeros({ recv[1] + recv[2], 4 }, { device = dev })
    dist.all_to_all(o, inp, sends, recv, { group = g })
    local wa, first = {}, gr == 0 and 0 or 2
    for r = 0, 1 do
      for i = 1, recv[r + 1] * 4 do wa[#wa + 1] = value("f32", r, first * 4 + i - 1, 14) end
    end
    same("all_to_all on " .. g:name(), flat(o), wa)
    pass("group " .. g:name() .. " (reversed ranks)")
  end

  do
    local t = make(values("f32", rank, 10, 15), { 10 }, "f32")
    dist.all_reduce(t, "sum", { group = solo })
    same("all_reduce on a group of one", flat(t), values("f32", rank, 10, 15))
    local out = moe.zeros({ 3, 2 }, { device = dev })
    dist.all_to_all(out, make(values("f32", rank, 6, 16), { 3, 2 }, "f32"), { 3 }, { 3 }, { group = solo })
    same("all_to_all on a group of one", flat(out), values("f32", rank, 6, 16))
    pass("group of one rank")
  end

  -- Both groups busy at once, asynchronously, then the world again.
  do
    local a = make(values("f32", rev_late:rank(), 64, 17), { 64 }, "f32")
    local b = make(values("f32", rank, 64, 18), { 64 }, "f32")
    local wa = dist.all_reduce(a, "max", { group = rev_late, async = true })
    local wb = dist.all_reduce(b, "min", { async = true })
    wb:wait()
    wa:wait()
    local want_a, want_b = {}, {}
    for i = 1, 64 do
      want_a[i] = math.max(value("f32", 0, i - 1, 17), value("f32", 1, i - 1, 17))
      want_b[i] = math.min(value("f32", 0, i - 1, 18), value("f32", 1, i - 1, 18))
    end
    same("async all_reduce on rev_late", flat(a), want_a)
    same("async all_reduce on the world", flat(b), want_b)
    wa:free()
    wb:free()
    pass("two groups in flight at once")
  end

  solo:free()
  rev_late:free()
  rev_early:free()
  dist.barrier()
end

local ok, err = xpcall(function()
  if part ~= "timeout" then collectives_test() end
  if part ~= "collectives" then timeout_test() end
end, debug.traceback)
if not ok then
  io.stderr:write(("rank %d: FAILED: %s\n"):format(rank, tostring(err)))
  io.stderr:flush()
  dist.abort(1)
  os.exit(1)
end
print(("rank %d: OK"):format(rank))
