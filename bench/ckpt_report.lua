--[[
bench/ckpt_report.lua - one report of bench/ckpt_round.sh's runs: the
checkpoint figures of bench/ckpt_stall.lua on one GPU (single-file
checkpoints) and sharded on two, and the restart timeline of
tests/dist/ckpt_restart.lua under `moe-lua launch --max-restarts 1
--timeline` (moe/cli/launch.lua), as one JSON and one markdown table
(device, date, versions), then a short table printed last.

  moe-lua bench/ckpt_report.lua single=A.json sharded=B.json timeline=T.jsonl \
      [restart_rc=0] [restart_note=TEXT] [device=cuda] json=bench/results/dist/ckpt_125m.json

A missing input leaves its rows out (and says so in the notes).
]]
local bench = dofile((arg[0]:match("^(.*)/") or ".") .. "/lib.lua")
local json = require("moe.metrics").json
local launch = require "moe.cli.launch"
local cfg = bench.config { single = "", sharded = "", timeline = "", restart_rc = -1, restart_note = "",
  device = "cuda", title = "", repeats = 1, warmup = 0 }

local function read_json(path)
  if path == "" then return nil end
  local f = io.open(path, "r")
  if not f then return nil end
  local ok, v = pcall(json.decode, f:read("a"))
  f:close()
  return ok and v or nil
end

local notes, rows, model = {}, {}, nil
local function config_rows(path, name)
  local r = read_json(path)
  if not r then
    notes[#notes + 1] = ("%s: no results (%s)"):format(name, path ~= "" and path or "not run")
    return nil
  end
  model = model or r.model
  local by = {}
  for _, x in ipairs(r.results or {}) do by[x.mode] = x end
  local row = { config = name, layout = r.results[1] and r.results[1].layout, ranks = r.results[1] and r.results[1].ranks,
    params = r.results[1] and r.results[1].params }
  row.step_ms = by.none and by.none.step_ms
  row.sync_save_s = by.sync and by.sync.stall_ms / 1e3
  row.async_stall_s = by.async and by.async.stall_ms / 1e3
  row.async_finish_s = by.async and by.async.finish_ms and by.async.finish_ms / 1e3
  row.load_s = by.load and by.load.load_s
  row.load_s_max = by.load and by.load.load_s_max
  row.read_gib = by.load and by.load.read_bytes_sum and by.load.read_bytes_sum / 2 ^ 30
  row.read_gib_max = by.load and by.load.read_bytes_max and by.load.read_bytes_max / 2 ^ 30
  local bytes = (by.sync and by.sync.ckpt_bytes) or (by.load and by.load.ckpt_bytes)
  row.size_gib = bytes and bytes / 2 ^ 30
  row.saves = by.sync and by.sync.saves
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
notes[#notes + 1] = "sync save s: the step's stall for a synchronous save (write, fsync, barrier, commit); " ..
  "async stall s: the stall of an asynchronous save (the copy to host memory); async finish s: its write's " ..
  "remaining wait, barrier and commit when asked for; load s: reading the checkpoint at resume onto the " ..
  "rank's tensors (rank 0's; slowest rank in the JSON); read GiB: what all ranks read to load it"
if #restarts > 0 then
  notes[#notes + 1] = "restart timeline (kill -9 of rank 1 mid-step, --max-restarts 1): failure -> detection " ..
    "(mpirun notices and stops the ranks; the launcher sees it return) -> restart (the launcher starts mpirun) -> " ..
    "first step after the restart done (start-up, checkpoint load, one step)"
end

local obj, md = bench.report(cfg, {
  title = cfg.title ~= "" and cfg.title or "Checkpoints of the 125M dMoE: save, stall, load, size, restart",
  device = cfg.device, reference = "the step time without saves (bench/ckpt_stall.lua mode none)",
  results = rows, model = model, restarts = bench.list(restarts), restart_rc = cfg.restart_rc, notes = notes,
  columns = { { "configuration", "config" }, { "step ms", "step_ms", "%.1f" }, { "sync save s", "sync_save_s", "%.2f" },
    { "async stall s", "async_stall_s", "%.2f" }, { "async finish s", "async_finish_s", "%.2f" },
    { "load s", "load_s", "%.2f" }, { "read GiB", "read_gib", "%.2f" }, { "size GiB", "size_gib", "%.2f" } } })
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
print(("%-32s %9s %9s %9s %8s %9s"):format("", "sync s", "stall s", "load s", "GiB", "read GiB"))
for _, r in ipairs(rows) do
  print(("%-32s %9s %9s %9s %8s %9s"):format(r.config, f(r.sync_save_s, "%.2f"), f(r.async_stall_s, "%.2f"),
    f(r.load_s, "%.2f"), f(r.size_gib, "%.2f"), f(r.read_gib, "%.2f")))
end
for _, r in ipairs(restarts) do
  print(("restart %d (launcher rc %s, failure %s): detected +%s s, restarted +%s s, first step (%s) +%s s: %s s " ..
    "from the %s"):format(r.attempt, tostring(cfg.restart_rc), tostring(r.failure_source), f(r.detect_s, "%.2f"),
    f(r.restart_s, "%.2f"), tostring(r.step or "?"), f(r.first_step_s, "%.2f"), f(r.total_s, "%.2f"),
    r.failure and "failure" or "detection"))
end
