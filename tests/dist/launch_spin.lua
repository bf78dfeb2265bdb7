-- tests/dist/launch_spin.lua (launch_spec): every rank says it is ready (and
-- its pid) on stderr and spins (at most 60 s), trapping nothing: a SIGTERM
-- that reaches it stops it at the next safe point (status 143).
local pid = assert(io.open("/proc/self/stat")):read("l"):match("^(%d+)")
io.stderr:write(("ready %s pid=%s\n"):format(os.getenv("RANK"), pid))
io.stderr:flush()
local deadline = os.time() + 60
while os.time() < deadline do end
os.exit(3)
