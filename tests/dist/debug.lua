--[[
tests/dist/debug.lua - debug mode (dist.init{debug = true}, or
MOE_DIST_DEBUG=1): ranks that call different collectives, sizes, dtypes,
roots or all_to_all splits fail on every rank at once with a message that
names what differs and which ranks, instead of hanging or writing garbage;
send / recv ends that disagree fail on both ends. The group stays usable.
Run with 2 and 4 ranks.
]]
local T = dofile(arg[0]:match("^(.*/)") .. "common.lua")
local moe, dist = T.moe, T.dist
local R, P = T.rank, T.size

dist.init { debug = true, timeout = 30 }

-- sizes: rank 1 all-reduces 512 elements, the others 1024
do
  local n = R == 1 and 512 or 1024
  local t = moe.ones({ n }, { dtype = "f32", device = T.device })
  T.raises(function() dist.all_reduce(t, "sum") end, {
    "all_reduce on group 'world': the ranks disagree (MOE_DIST_DEBUG): rank 0 calls all_reduce(sum) "
      .. "of 1024 f32, rank 1 calls all_reduce(sum) of 512 f32" }, "sizes")
end
-- collectives: the last rank broadcasts while the others all-reduce
do
  local t = moe.ones({ 8 }, { dtype = "bf16", device = T.device })
  local fn = function()
    if R == P - 1 then dist.broadcast(t, 0) else dist.all_reduce(t, "max") end
  end
  T.raises(fn, { "rank 0 calls all_reduce(max) of 8 bf16, rank " .. (P - 1)
    .. " calls broadcast of 8 bf16 from rank 0" }, "collectives")
end
-- dtypes and ops
do
  local t = moe.ones({ 4 }, { dtype = R == 0 and "f32" or "f64", device = T.device })
  T.raises(function() dist.all_reduce(t, R == 0 and "sum" or "avg") end,
    { "rank 0 calls all_reduce(sum) of 4 f32, rank 1 calls all_reduce(avg) of 4 f64" }, "dtypes")
end
-- all_to_all splits: rank 0 sends one row too many to rank 1
do
  local send, recv = {}, {}
  for j = 1, P do send[j], recv[j] = 1, 1 end
  if R == 0 then send[2] = 2 end
  local input = moe.zeros({ P + 1, 2 }, { dtype = "f32", device = T.device })
  local out = moe.zeros({ P + 1, 2 }, { dtype = "f32", device = T.device })
  T.raises(function() dist.all_to_all(out, input, send, recv) end, {
    "all_to_all on group 'world': the splits disagree (MOE_DIST_DEBUG): rank 0 sends 2 rows to "
      .. "rank 1, but rank 1 expects 1 rows from rank 0" }, "splits")
end
-- send / recv: the receiver expects fewer elements
if R < 2 then
  local peer = 1 - R
  local t = moe.zeros({ R == 0 and 6 or 4 }, { dtype = "f32", device = T.device })
  local fn = function() if R == 0 then dist.send(t, peer) else dist.recv(t, peer) end end
  T.raises(fn, { "the two ends disagree (MOE_DIST_DEBUG)", "send of 6 f32 to rank 1",
    "recv of 4 f32 from rank 0" }, "send/recv")
end
-- the group is still usable
local t = T.make({ 5 }, "f32", function(i) return R + i end)
dist.all_reduce(t, "sum")
local want = {}
for i = 0, 4 do want[i + 1] = P * i + P * (P - 1) / 2 end
T.same(t, want, 0, "all_reduce after the mismatches")
-- a group made by split inherits debug mode
local g = dist.world:split(0, R, "g")
T.raises(function() dist.all_reduce(moe.ones({ R + 1 }, { device = T.device }), "sum", { group = g }) end,
  { "all_reduce on group 'g': the ranks disagree" }, "split group")
T.ok("debug")
