-- tests/dist/launch_kill.lua (launch_spec): rank 1 kills itself with
-- SIGKILL (no exit record, no message); the others spin (at most 60 s)
-- until mpirun stops them. With a folder as argument, rank 0 marks it
-- (ready-0) once it runs, and rank 1 waits for that before it dies, so that
-- rank 0 is stopped while its script runs.
local sync = ...
local rank = os.getenv("RANK")
local function exists(path)
  local f = io.open(path, "r")
  if f then f:close() end
  return f ~= nil
end
local pid = assert(io.open("/proc/self/stat")):read("l"):match("^(%d+)")
io.stderr:write(("ready %s pid=%s\n"):format(rank, pid))
if sync and rank == "0" then assert(io.open(sync .. "/ready-0", "w")):close() end
if rank == "1" then
  local deadline = os.time() + 30
  while sync and not exists(sync .. "/ready-0") and os.time() < deadline do end
  os.execute("kill -9 " .. pid)
end
local deadline = os.time() + 60
while os.time() < deadline do end
print("rank " .. rank .. " was not stopped")
os.exit(3)
