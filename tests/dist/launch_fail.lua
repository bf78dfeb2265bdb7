-- tests/dist/launch_fail.lua (launch_spec): rank 1 raises an error; the
-- others wait (at most 60 s) for mpirun to stop them.
if os.getenv("RANK") == "1" then
  local function step() error("boom from rank 1") end
  step()
end
local deadline = os.time() + 60
while os.time() < deadline do end
print("rank " .. os.getenv("RANK") .. " was not stopped")
os.exit(3)
