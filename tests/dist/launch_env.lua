-- tests/dist/launch_env.lua (launch_spec): each rank reports what its
-- environment says about the job, on stdout (only rank 0's is shown) and on
-- stderr (every rank's), then warns (Lua warnings carry the rank prefix).
local keys = { "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT" }
local parts = {}
for _, k in ipairs(keys) do parts[#parts + 1] = k .. "=" .. tostring(os.getenv(k)) end
parts[#parts + 1] = "MOE_LAUNCH_DIR=" .. tostring(os.getenv("MOE_LAUNCH_DIR"))
parts[#parts + 1] = "args=" .. table.concat({ ... }, ",")
io.stderr:write("env " .. table.concat(parts, " ") .. "\n")
print("stdout from rank " .. os.getenv("RANK"))
warn("@on")
warn("a warning from rank " .. os.getenv("RANK"))
