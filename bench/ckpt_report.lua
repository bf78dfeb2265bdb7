--[[
bench/ckpt_report.lua - one report of bench/ckpt_round.sh's runs: the
checkpoint figures of bench/ckpt_stall.lua on one GPU (single-file
checkpoints) and sharded on two, and the restart timeline of
tests/dist/ckpt_restart.lua under `moe-lua launch --max-restarts 1
--timeline` (moe/cli/launch.lua), as one JSON and one markdown table, then
a short table printed last. The inputs come from separate runs (one device
call each) and are joined here, on any machine: the device, date and
versions written are the first input's (on_gpu: whether it ran on a GPU).

  moe-lua bench/ckpt_report.lua single=A.json sharded=B.json timeline=T.jsonl \
      [restart_rc=0] [restart_note=TEXT] json=bench/results/dist/ckpt_125m.json

A missing input leaves its rows out, an incomplete one (cut off) is marked
so; the notes say which.
]]
local bench = dofile((arg[0]:match("^(.*)/") or ".") .. "/lib.lua")
local json = require("moe.metrics").json
local launch = require "moe.cli.launch"
local cfg = bench.config { single = "", sharded = "", timeline = "", restart_rc = -1, restart_note = "",
  title = "", repeats = 1, warmup = 0 }

local function read_json(path)
  if path == "" then return nil end
  local f = io.open(path, "r")
  if not f then return nil end
  local ok, v = pcall(json.decode, f:read("a"))
  f:close()
  return ok and v or nil
end

local notes, rows, model, inputs = {}, {}, nil, {}
local function config_rows(path, name)
  local r = read_json(path)
  if not r or type(r.results) ~= "table" or not r.results[1] then
    notes[#notes + 1] = ("%s: no results (%s)"):format(name, path ~= "" and path or "not run")
    return nil
  end
  inputs[#inputs + 1] = r
  model = model or r.model
  local x = r.results[1]
  local row = { config = name, layout = x.layout, ranks = x.ranks, params = x.params, complete = x.complete,
    device = r.device, date = r.date, build_s = x.build_s, first_step_s = x.first_step_s, step_ms = x.step_ms,
    sync_save_s = x.sync_save_s, sync_digest_s = x.sync_digest_s, verify_s = x.verify_s,
    verify_s_max = x.verify_s_max, read_s = x.read_s, read_s_max = x.read_s_max, load_s = x.load_s,
    async_stall_s = x.async_stall_s, async_stall_first_s = x.async_stall_first_s, async_stalls = x.async_stalls,
    async_finish_s = x.async_finish_s, step_ms_during = x.step_ms_during, phases = x.phases, error = x.error }
  local function g(b) return b and b / 2 ^ 30 or nil end
  row.read_gib, row.read_gib_sum, row.read_gib_max = g(x.read_bytes), g(x.read_bytes_sum), g(x.read_bytes_max)
  row.size_gib = g(x.ckpt_bytes or x.async_ckpt_bytes)
  if x.sync_save_s and x.ckpt_bytes then row.write_gb_s = x.ckpt_bytes / 1e9 / x.sync_save_s end
  if not x.complete then
    notes[#notes + 1] = ("%s: incomplete (%s): the figures measured before it stopped"):format(name,
      x.error or "cut off by the time limit")
  end
  rows[#rows + 1] = row
  return row
end
config_rows(cfg.single, "1 GPU, single-file checkpoint")
config_rows(cfg.sharded, "2 GPUs, sharded (dcp)")

local restarts = {}
if cfg.timeline ~= "" then
  restarts = launch.restarts(launch.read_timeline(cfg.timeline))
  if #restarts == 0 then notes[#notes + 1] = ("restart: no restart in the timeline %s"):format(cfg.timeline) end
end
if cfg.restart_note ~= "" then notes[#notes + 1] = "restart: " .. cfg.restart_note end
notes[#notes + 1] = "sync save s: the synchronous save as the training loop makes it (write, fsync, digests.txt; " ..
  "sharded: every rank's shard, the barrier, rank 0's commit), of which hashing s: rank 0 hashing the files for " ..
  "digests.txt; verify s: checkpoint.verify, every file read and hashed (what resume=latest does on every rank " ..
  "first); read s: par:load_checkpoint into the same model and optimizer (rank 0; each rank reads the bytes " ..
  "of what it holds), read GiB: rank 0's; async stall s: the step's wait for an asynchronous save (the copy " ..
  "to host memory); async finish s: the rest of its write, the barrier and the commit, when asked for; " ..
  "step ms during: the steps while it writes; the files were read back from the page cache (written just before)"
if #restarts > 0 then
  notes[#notes + 1] = "restart timeline (kill -9 of rank 1 mid-step, --max-restarts 1): failure -> detection " ..
    "(mpirun notices and stops the ranks; the launcher sees it return) -> restart (the launcher starts mpirun) -> " ..
    "first step after the restart done (start-up, checkpoint load, one step)"
end

local first = inputs[1] or {}
local obj, md = bench.report(cfg, {
  title = cfg.title ~= "" and cfg.title or "Checkpoints of the 125M dMoE: save, stall, load, size, restart",
  device = "cpu", reference = "the step time without a save (bench/ckpt_stall.lua)",
  results = rows, model = model, restarts = bench.list(restarts), restart_rc = cfg.restart_rc, notes = notes,
  columns = { { "configuration", "config" }, { "model build s", "build_s", "%.1f" }, { "step ms", "step_ms", "%.1f" },
    { "sync save s", "sync_save_s", "%.2f" }, { "of which hashing s", "sync_digest_s", "%.2f" },
    { "verify s", "verify_s", "%.2f" }, { "read s", "read_s", "%.2f" }, { "read GiB", "read_gib", "%.2f" },
    { "async stall s", "async_stall_s", "%.3f" }, { "async finish s", "async_finish_s", "%.2f" },
    { "step ms during", "step_ms_during", "%.1f" }, { "size GiB", "size_gib", "%.2f" } } })
-- the device, date and versions are the measurements', not this report's
obj.device, obj.date, obj.versions, obj.on_gpu = first.device, first.date, first.versions, first.on_gpu == true
obj.command = nil
md = md:gsub("\n%- device: [^\n]*", "\n- device: " .. tostring(first.device), 1)
md = md:gsub("\n%- date: [^\n]*", "\n- date: " .. tostring(first.date), 1)
if first.versions then
  local v = first.versions
  md = md:gsub("\n%- versions: [^\n]*", ("\n- versions: moe-lua %s, CUDA runtime %s (driver %s), cuBLAS %s"):format(
    tostring(v.moe_lua), tostring(v.cuda_runtime), tostring(v.cuda_driver), tostring(v.cublas)), 1)
end
md = md:gsub("\n%- command: [^\n]*", "\n- commands: `bash bench/ckpt_round.sh gpu1`, `gpu2`, `restart` (one device " ..
  "call each), `report`", 1)
if #restarts > 0 then
  md = md .. "\n## Restart after kill -9 (2 GPUs)\n\n" .. bench.markdown_table({
    { "restart", "attempt" }, { "failure (source)", function(r) return r.failure_source end },
    { "detection s", "detect_s", "%.2f" }, { "restart s", "restart_s", "%.2f" },
    { "first step s", "first_step_s", "%.2f" }, { "failure to first step s", "total_s", "%.2f" },
    { "first step", "step" } }, restarts)
end
io.write("\n", md)
if cfg.json ~= "" then
  local f = assert(io.open(cfg.json, "w"))
  f:write(bench.encode(obj))
  f:close()
  local mdpath = cfg.md ~= "" and cfg.md or (cfg.json:gsub("%.json$", "") .. ".md")
  f = assert(io.open(mdpath, "w"))
  f:write(md)
  f:close()
  print("wrote " .. cfg.json .. " and " .. mdpath)
end

-- the short table, last
print("\n== checkpoints (" .. tostring(obj.device) .. ") ==")
local function f(v, fmt) return v and fmt:format(v) or "-" end
print(("%-32s %9s %9s %9s %9s %8s %9s"):format("", "sync s", "verify s", "read s", "stall s", "GiB", "read GiB"))
for _, r in ipairs(rows) do
  print(("%-32s %9s %9s %9s %9s %8s %9s"):format(r.config, f(r.sync_save_s, "%.2f"), f(r.verify_s, "%.2f"),
    f(r.read_s, "%.2f"), f(r.async_stall_s, "%.3f"), f(r.size_gib, "%.2f"), f(r.read_gib, "%.2f")))
end
for _, r in ipairs(restarts) do
  print(("restart %d (launcher rc %s, failure %s): detected +%s s, restarted +%s s, first step (%s) +%s s: %s s " ..
    "from the %s"):format(r.attempt, tostring(cfg.restart_rc), tostring(r.failure_source), f(r.detect_s, "%.2f"),
    f(r.restart_s, "%.2f"), tostring(r.step or "?"), f(r.first_step_s, "%.2f"), f(r.total_s, "%.2f"),
    r.failure and "failure" or "detection"))
end
