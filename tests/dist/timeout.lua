--[[
tests/dist/timeout.lua - a collective that a rank skips fails on the
others after the group's timeout, with a message naming the collective, the
group, the rank and the sizes; the group is unusable afterwards (every call
fails at once with the first message), while another group still works.
Run with 2 ranks: rank 1 skips one all_reduce of the world.
]]
local T = dofile(arg[0]:match("^(.*/)") .. "common.lua")
local moe, dist = T.moe, T.dist
local R = T.rank

dist.init { timeout = 2 }
local other = dist.world:split(0, R, "other") -- every rank, made before the failure
other:set_timeout(60)
local t = moe.ones({ 1024 }, { dtype = "f32" })
dist.all_reduce(t, "sum") -- every rank
T.check(t:totable()[1] == T.size, "a first all_reduce works")

if R == 0 then
  local t0 = moe.clock and moe.clock() or os.time()
  local err = T.raises(function() dist.all_reduce(t, "sum") end, {
    "all_reduce(sum) of 1024 f32 on group 'world' (rank 0 of " .. T.size .. ") did not complete "
      .. "within 2 s: another rank did not join it (is a rank stuck, dead, or calling a different "
      .. "collective?)" }, "timeout")
  local t1 = moe.clock and moe.clock() or os.time()
  T.check(t1 - t0 >= 1.5, "the wait lasted the timeout (%s s)", tostring(t1 - t0))
  -- the world is failed: later calls fail at once with the first message
  T.raises(function() dist.barrier() end,
    { "barrier on group 'world': the group failed earlier: all_reduce(sum) of 1024 f32" },
    "failed group")
  T.raises(function() dist.broadcast(t, 0, { async = true }) end, { "the group failed earlier" },
    "failed group, async")
  print("rank 0 got: " .. err)
end

-- another group is not affected
local x = T.make({ 3 }, "f64", function(i) return R + i end)
dist.all_reduce(x, "max", { group = other })
T.same(x, { T.size - 1, T.size, T.size + 1 }, 0, "the other group still works")
dist.barrier(other)
if R == 0 then print("ok   timeout") end
