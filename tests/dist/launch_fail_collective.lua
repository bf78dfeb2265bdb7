-- tests/dist/launch_fail_collective.lua (launch_spec): both ranks run
-- all_reduces; rank 1 raises an error after a few while rank 0 goes on
-- into the next collective, which would wait its whole timeout (120 s).
-- The failed rank ends the job at once (MPI_Abort), so the launcher
-- returns in seconds and names rank 1.
local moe = require "moe"
local dist = moe.dist
dist.init { timeout = 120 }
local t = moe.ones({ 1024 })
for step = 1, 1000 do
  if dist.rank() == 1 and step == 3 then error("boom in step 3 of rank 1") end
  dist.all_reduce(t, "avg")
end
print("rank " .. dist.rank() .. " was not stopped")
os.exit(3)
