--[[
tests/dist/comm_timing.lua - the opt-in timing of the collectives
(dist.comm_timing, dist.comm_times, dist.comm_times_reset; moe_dist.h
"collective timing") on W ranks:

  moe-lua launch -n 2 tests/dist/comm_timing.lua
  MOE_DIST_DEVICE=cuda moe-lua launch -n 2 tests/dist/comm_timing.lua   (GPU tensors, NCCL)

A known sequence of collectives (synchronous and asynchronous, every kind,
several dtypes, all_to_all with uneven splits, a ring of send / recv), and
every kind's calls and bytes checked exactly against what the sequence
issues (bytes: nccl-tests' size: all_reduce, broadcast, send and recv the
tensor, all_gather its output, reduce_scatter its input, all_to_all the
rows this rank sends); every kind that ran has a time > 0, the others 0.
Also: off by default (reading raises), the results of the collectives are
unchanged, a barrier and a group of one rank are not counted, one kind
alone, the reset, off dropping the totals, and an asynchronous collective
issued before timing restarts not counted after it.
]]
local T = dofile(arg[0]:match("^(.*/)") .. "common.lua")
local dist = T.dist
local rank, W = T.rank, T.size
T.check(W >= 2, "run under moe-lua launch -n 2 or more (world size %d)", W)

local KINDS = { "all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "send", "recv" }

-- off by default; reading or resetting while off raises
T.check(dist.comm_timing() == false, "timing is on by default")
T.raises(dist.comm_times, "collective timing is off", "comm_times while off")
T.raises(dist.comm_times_reset, "collective timing is off", "comm_times_reset while off")
T.raises(function() dist.comm_timing("yes") end, "boolean expected", "comm_timing('yes')")

-- one-rank groups (a local copy each), made before timing starts
local solo = dist.world:split(rank, 0, "solo")

T.check(dist.comm_timing(true) == false, "comm_timing(true) returns the previous setting")
T.check(dist.comm_timing() == true, "timing is not on")
T.raises(function() dist.comm_times("barrier") end, { "unknown collective 'barrier'", "all_to_all" },
  "comm_times('barrier')")
T.raises(function() dist.comm_times(3) end, "collective name expected", "comm_times(3)")

local want = {}
for _, k in ipairs(KINDS) do want[k] = { calls = 0, bytes = 0 } end
local function expect(kind, bytes) want[kind].calls, want[kind].bytes = want[kind].calls + 1, want[kind].bytes + bytes end

-- all_reduce: twice synchronous (f32, 10), once asynchronous (f64, 5)
local a = T.make({ 10 }, "f32", function(i) return T.val(rank, i) end)
dist.all_reduce(a, "sum")
dist.all_reduce(a, "max")
expect("all_reduce", 40); expect("all_reduce", 40)
local sums = {} -- the sum over ranks; then the max of W equal sums
for i = 0, 9 do
  sums[i + 1] = 0
  for r = 0, W - 1 do sums[i + 1] = sums[i + 1] + T.val(r, i) end
end
T.same(a, sums, 0, "all_reduce under timing")
local b = T.make({ 5 }, "f64", function(i) return i end)
local wk = dist.all_reduce(b, "sum", { async = true })
expect("all_reduce", 40)
wk:wait()
T.same(b, { 0, W, 2 * W, 3 * W, 4 * W }, 0, "async all_reduce under timing")

-- reduce_scatter: (W * 3) f32 into 3
local rin = T.make({ W * 3 }, "f32", function(i) return i end)
local rout = T.make({ 3 }, "f32", function() return 0 end)
dist.reduce_scatter(rout, rin, "sum")
expect("reduce_scatter", W * 3 * 4)
T.same(rout, { W * (3 * rank), W * (3 * rank + 1), W * (3 * rank + 2) }, 0, "reduce_scatter under timing")

-- all_gather: 2 bf16 per rank, asynchronous
local gin = T.make({ 2 }, "bf16", function(i) return rank * 2 + i end)
local gout = T.make({ W * 2 }, "bf16", function() return 0 end)
dist.all_gather(gout, gin, { async = true }):wait()
expect("all_gather", W * 2 * 2)
local g = {}
for i = 0, 2 * W - 1 do g[i + 1] = i end
T.same(gout, g, 0, "all_gather under timing")

-- broadcast: 6 i64 from the last rank
local bc = T.make({ 6 }, "i64", function(i) return rank * 10 + i end)
dist.broadcast(bc, W - 1)
expect("broadcast", 48)
T.same(bc, { (W - 1) * 10, (W - 1) * 10 + 1, (W - 1) * 10 + 2, (W - 1) * 10 + 3, (W - 1) * 10 + 4,
  (W - 1) * 10 + 5 }, 0, "broadcast under timing")

-- all_to_all: rows of 4 f32, (rank + j) % 3 + 1 rows to rank j (so as many from j)
local send, recv, ns, nr = {}, {}, 0, 0
for j = 0, W - 1 do
  send[j + 1] = (rank + j) % 3 + 1
  recv[j + 1] = (j + rank) % 3 + 1
  ns, nr = ns + send[j + 1], nr + recv[j + 1]
end
local xin = T.make({ ns, 4 }, "f32", function(i) return rank * 1000 + i end)
local xout = T.make({ nr, 4 }, "f32", function() return -1 end)
dist.all_to_all(xout, xin, send, recv)
expect("all_to_all", ns * 16)
local xw = {}
for j = 0, W - 1 do
  -- rank j's rows for this rank start after the rows it sends to ranks before this one
  local start = 0
  for q = 0, rank - 1 do start = start + (j + q) % 3 + 1 end
  for r = 0, recv[j + 1] - 1 do
    for c = 0, 3 do xw[#xw + 1] = j * 1000 + (start + r) * 4 + c end
  end
end
T.same(xout, xw, 0, "all_to_all under timing")
-- and once more, asynchronously, in a dtype of 2 bytes
local yin = T.make({ ns, 4 }, "bf16", function(i) return i % 7 end)
local yout = T.make({ nr, 4 }, "bf16", function() return 0 end)
dist.all_to_all(yout, yin, send, recv, { async = true }):wait()
expect("all_to_all", ns * 8)

-- a ring of send / recv: 7 f32 to the next rank, from the previous one
local nxt, prv = (rank + 1) % W, (rank - 1) % W
local s = T.make({ 7 }, "f32", function(i) return rank + i end)
local r = T.make({ 7 }, "f32", function() return 0 end)
local sw = dist.send(s, nxt, { async = true })
dist.recv(r, prv)
sw:wait()
expect("send", 28); expect("recv", 28)
T.same(r, { prv, prv + 1, prv + 2, prv + 3, prv + 4, prv + 5, prv + 6 }, 0, "recv under timing")

-- not counted: a barrier, the collectives of a group of one
dist.barrier()
dist.all_reduce(a, "sum", { group = solo })
dist.all_gather(T.make({ 2 }, "f32", function() return 0 end), T.make({ 2 }, "f32", function() return 1 end),
  { group = solo })

local got = dist.comm_times()
for _, k in ipairs(KINDS) do
  local g1, w1 = got[k], want[k]
  T.check(type(g1) == "table", "comm_times has no %s", k)
  T.check(g1.calls == w1.calls and g1.bytes == w1.bytes, "%s: %d calls, %d bytes; %d calls, %d bytes issued", k,
    g1.calls, g1.bytes, w1.calls, w1.bytes)
  T.check(w1.calls > 0 and g1.ms > 0 or w1.calls == 0 and g1.ms == 0, "%s: %g ms for %d calls", k, g1.ms, g1.calls)
  local one = dist.comm_times(k)
  T.check(one.calls == g1.calls and one.bytes == g1.bytes and one.ms >= g1.ms,
    "comm_times('%s') differs from comm_times().%s", k, k)
end
local n = 0
for _ in pairs(got) do n = n + 1 end
T.check(n == #KINDS, "comm_times has %d kinds, %d expected", n, #KINDS)
if rank == 0 then
  for _, k in ipairs(KINDS) do
    print(("  %-15s %3d calls %6d bytes %8.3f ms"):format(k, got[k].calls, got[k].bytes, got[k].ms))
  end
end

-- the reset: zeros, then counting goes on
dist.comm_times_reset()
for _, k in ipairs(KINDS) do
  local z = dist.comm_times(k)
  T.check(z.calls == 0 and z.bytes == 0 and z.ms == 0, "%s after the reset: %d calls", k, z.calls)
end
dist.all_reduce(a, "sum")
local one = dist.comm_times("all_reduce")
T.check(one.calls == 1 and one.bytes == 40 and one.ms > 0, "after the reset: %d calls, %d bytes", one.calls, one.bytes)

-- off drops everything; an asynchronous collective issued before the restart is not counted after it
local late = dist.all_reduce(b, "sum", { async = true })
T.check(dist.comm_timing(false) == true, "comm_timing(false) returns the previous setting")
T.raises(dist.comm_times, "collective timing is off", "comm_times after off")
dist.comm_timing(true)
late:wait()
for _, k in ipairs(KINDS) do
  local z = dist.comm_times(k)
  T.check(z.calls == 0 and z.bytes == 0 and z.ms == 0, "%s after a restart: %d calls, %g ms", k, z.calls, z.ms)
end
dist.comm_timing(false)
solo:free()
T.ok("comm_timing (" .. T.device .. ")")
