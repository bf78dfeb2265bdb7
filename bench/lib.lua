--[[
bench/lib.lua - the harness every Lua benchmark in bench/ uses: arguments,
timing, and the one writer of results. A script loads it beside itself:

  local moe = require "moe"
  local bench = dofile((arg[0]:match("^(.*)/") or ".") .. "/lib.lua")
  local cfg = bench.config{ device = "cuda", repeats = 20, configs = { "mixtral", "qwen3" } }
  local s = bench.time(function() moe.matmul(a, b):free() end, { device = cfg.device, iters = 10,
                        repeats = cfg.repeats, warmup = cfg.warmup, cooldown = cfg.cooldown })
  bench.write(cfg, { title = "...", device = cfg.device, reference = "...", results = rows,
                     columns = { { "case", "name" }, { "ms", "ms", "%.4f" } } })

Arguments (bench.config): moe.config's key=value overrides over the script's
defaults plus the common keys below (a script may give its own default for
any of them); `moe-lua bench/X.lua --help` lists every key.
  json=FILE      write the results as JSON there (nothing written when empty)
  md=FILE        the markdown table there (default: FILE.json -> FILE.md)
  repeats=N      timed samples; the result is their median (10)
  warmup=N       untimed calls before the samples (3)
  cooldown=S     idle seconds before each case (0): an H100 at ~700 W clocks
                 down the longer it is busy, so without an idle a case's
                 timing depends on what ran just before it
A positional argument or a --flag is an error (unless the script allows
positional ones), so an old `--json FILE` command line fails loudly.

Timing (bench.time, bench.stopwatch, bench.elapsed): on CUDA, events
recorded on the device's stream around the calls (moe.Event), so no host
time is counted; on the CPU the host clock (moe.clock), the only clock
there (CPU ops return when done). bench.time runs `warmup` calls, then
`repeats` samples of `iters` calls each, and returns the median seconds per
call and the samples.

Results (bench.write): one JSON object and one markdown file, each carrying
the device name, the date (UTC), the moe-lua, CUDA runtime / driver and
cuBLAS versions, the command (with the MOE_* variables of the environment,
which A/B runs set), the timing method and the reference the numbers are
compared with (when the script names one).
]]
local moe = require "moe"
local json = require("moe.metrics").json

local M = {}

-- The keys every benchmark takes, with their defaults.
M.COMMON = { json = "", md = "", repeats = 10, warmup = 3, cooldown = 0.0 }

-- ------------------------------------------------------------ arguments

local function copy_args(argv)
  local out = {}
  if argv == nil then
    if type(arg) == "table" then for i = 1, #arg do out[i] = arg[i] end end
  else
    for i = 1, #argv do out[i] = argv[i] end
  end
  return out
end

--- bench.config(defaults [, argv [, opts]]) -> cfg, positional
-- defaults: the script's keys (moe.config rules); the COMMON keys are added
-- where the script does not set them. argv: the arguments (default: the
-- script's). opts.positional: how many positional arguments the script
-- takes (default 0; any other non-override argument is an error).
function M.config(defaults, argv, opts)
  if type(defaults) ~= "table" then
    error(("bench.config: table of defaults expected, got %s"):format(type(defaults)), 2)
  end
  local d = {}
  for k, v in pairs(M.COMMON) do d[k] = v end
  for k, v in pairs(defaults) do d[k] = v end
  local args = copy_args(argv)
  local cfg, rest = moe.config(d, args)
  local allowed = (opts and opts.positional) or 0
  for i, a in ipairs(rest) do
    if i > allowed or tostring(a):match("^%-") then
      error(("bench: unexpected argument '%s' (arguments are key=value, e.g. json=out.json; " ..
        "--help lists the keys)"):format(tostring(a)), 0)
    end
  end
  M.argv = args
  return cfg, rest
end

-- ------------------------------------------------------------ statistics

--- bench.median(samples) -> the median (the mean of the middle two for an
-- even count); the list is not modified.
function M.median(samples)
  local n = #samples
  if n == 0 then error("bench.median: no samples", 2) end
  local s = {}
  for i = 1, n do s[i] = samples[i] end
  table.sort(s)
  if n % 2 == 1 then return s[(n + 1) // 2] end
  return (s[n // 2] + s[n // 2 + 1]) / 2
end

-- ------------------------------------------------------------ timing

local function is_cpu(device) return device == nil and false or tostring(device):match("^cpu") ~= nil end

--- bench.sync(device): waits for the device's queued work (nothing on the CPU).
function M.sync(device)
  if not is_cpu(device) then moe.cuda.synchronize() end
end

--- bench.cooldown(seconds, device): synchronises, then idles `seconds`.
function M.cooldown(seconds, device)
  M.sync(device)
  if seconds and seconds > 0 then os.execute(("sleep %g"):format(seconds)) end
end

--- bench.method(device) -> "CUDA events" or "host clock".
function M.method(device) return is_cpu(device) and "host clock" or "CUDA events" end

local Stopwatch = {}
Stopwatch.__index = Stopwatch

--- bench.stopwatch(device) -> sw: sw:mark() records a point (a CUDA event
-- on the device's stream; the host clock on the CPU); sw:intervals() waits
-- for the last point and returns the seconds between consecutive points,
-- then starts over (the events are reused); sw:free() frees the events.
function M.stopwatch(device)
  return setmetatable({ device = device or "cuda", cpu = is_cpu(device), events = {}, times = {}, n = 0 },
    Stopwatch)
end

function Stopwatch:mark()
  self.n = self.n + 1
  if self.cpu then
    self.times[self.n] = moe.clock()
  else
    local e = self.events[self.n]
    if e == nil then
      e = moe.Event(self.device)
      self.events[self.n] = e
    end
    e:record()
  end
end

function Stopwatch:intervals()
  local out = {}
  if self.cpu then
    for i = 2, self.n do out[i - 1] = self.times[i] - self.times[i - 1] end
  elseif self.n > 0 then
    self.events[self.n]:synchronize()
    for i = 2, self.n do out[i - 1] = self.events[i - 1]:elapsed(self.events[i]) / 1e3 end
  end
  self.n = 0
  return out
end

function Stopwatch:free()
  for _, e in ipairs(self.events) do e:free() end
  self.events, self.n = {}, 0
end

--- bench.elapsed(f, device) -> seconds one call of f takes (events on CUDA).
function M.elapsed(f, device)
  local sw = M.stopwatch(device)
  sw:mark()
  f()
  sw:mark()
  local s = sw:intervals()[1]
  sw:free()
  return s
end

--- bench.time(f, opts) -> median seconds per call, samples (seconds per call)
-- opts: device ("cuda"), iters (calls per sample, 1), repeats (10), warmup
-- (untimed calls first, 3), cooldown (idle seconds before the warm-up, 0).
-- f must free what it makes.
function M.time(f, opts)
  opts = opts or {}
  local device = opts.device or "cuda"
  local iters, repeats, warmup = opts.iters or 1, opts.repeats or 10, opts.warmup or 3
  if repeats < 1 or iters < 1 then
    error(("bench.time: repeats and iters must be at least 1 (got %s, %s)"):format(repeats, iters), 2)
  end
  if opts.cooldown and opts.cooldown > 0 then M.cooldown(opts.cooldown, device) end
  for _ = 1, warmup do f() end
  M.sync(device)
  local sw = M.stopwatch(device)
  local samples = {}
  for r = 1, repeats do
    sw:mark()
    for _ = 1, iters do f() end
    sw:mark()
    samples[r] = sw:intervals()[1] / iters
  end
  sw:free()
  return M.median(samples), samples
end

-- ------------------------------------------------------------ environment

-- "13.0" from 13000 (CUDA); "13.1.0" from 130100 (cuBLAS), as moe-lua --version.
local function fmt_cuda(v) return v and v > 0 and ("%d.%d"):format(v // 1000, (v % 1000) // 10) or "none" end
local function fmt_mmp(v)
  return v and v > 0 and ("%d.%d.%d"):format(v // 10000, (v % 10000) // 100, v % 100) or "none"
end

local function sh_quote(s)
  s = tostring(s)
  if s:match("^[%w%._/=,:+%-]+$") then return s end
  return "'" .. s:gsub("'", "'\\''") .. "'"
end

-- MOE_* variables of this process's environment, sorted (Linux; none elsewhere).
local function moe_environment()
  local f = io.open("/proc/self/environ", "rb")
  if not f then return {} end
  local text = f:read("a") or ""
  f:close()
  local out = {}
  for entry in text:gmatch("[^%z]+") do
    if entry:match("^MOE_[%w_]*=") and not entry:match("^MOE_BUILD_DIR=") and
       not entry:match("^MOE_LAUNCH_DIR=") then
      out[#out + 1] = entry
    end
  end
  table.sort(out)
  return out
end

--- bench.command([argv]) -> the command line that ran this script, with the
-- MOE_* environment variables in front (`moe-lua launch -n N` for a rank of
-- a job of N ranks).
function M.command(argv)
  local parts = {}
  for _, e in ipairs(moe_environment()) do
    local k, v = e:match("^([^=]*)=(.*)$")
    parts[#parts + 1] = k .. "=" .. sh_quote(v)
  end
  parts[#parts + 1] = "moe-lua"
  local n = tonumber(os.getenv("WORLD_SIZE") or "")
  if n and n > 1 then parts[#parts + 1] = "launch -n " .. math.tointeger(n) end
  parts[#parts + 1] = sh_quote((type(arg) == "table" and arg[0]) or "?")
  for _, a in ipairs(argv or M.argv or copy_args(nil)) do parts[#parts + 1] = sh_quote(a) end
  return table.concat(parts, " ")
end

--- bench.device_name(device) -> "cpu" or the GPU's name ("NVIDIA H100 80GB HBM3").
function M.device_name(device)
  if is_cpu(device) then return "cpu" end
  local idx = tonumber(tostring(device or ""):match(":(%d+)$")) or 0
  local ok, name = pcall(moe.cuda.get_device_name, idx)
  return ok and name or "?"
end

--- bench.knobs() -> {variable = value} of the kernel knobs not at their
-- default (moe.knobs(): set by MOE_* variables or moe.set_knob), {} if none.
function M.knobs()
  local out = {}
  for _, k in ipairs(moe.knobs()) do
    if k.value ~= k.default then out[k.name] = k.value end
  end
  return out
end

--- bench.environment(device [, argv]) -> the facts every result carries:
-- tool, device, date (UTC), moe_lua, cuda_runtime / cuda_driver / cublas
-- (integers as the runtime gives them), versions (strings as moe-lua
-- --version prints them), command, knobs (those not at their default).
function M.environment(device, argv)
  local info = moe.build_info()
  return {
    knobs = M.knobs(),
    tool = "moe-lua " .. info.version,
    moe_lua = info.version,
    device = M.device_name(device),
    date = os.date("!%Y-%m-%dT%H:%M:%SZ"),
    cuda_runtime = info.cuda_runtime, cuda_driver = info.cuda_driver, cublas = info.cublas,
    versions = { moe_lua = info.version, lua = info.lua, cuda_runtime = fmt_cuda(info.cuda_runtime),
                 cuda_driver = fmt_cuda(info.cuda_driver), cublas = fmt_mmp(info.cublas) },
    command = M.command(argv),
  }
end

-- ------------------------------------------------------------ the writer

--- bench.list(t) -> t, encoded as a JSON array even when empty.
function M.list(t) return setmetatable(t or {}, json.array_mt) end

-- JSON with one top-level key a line and one element a line in lists of
-- objects (diffs of results stay readable); keys sorted.
function M.encode(obj)
  local keys = {}
  for k in pairs(obj) do keys[#keys + 1] = k end
  table.sort(keys)
  local lines = {}
  for _, k in ipairs(keys) do
    local v = obj[k]
    local s
    if type(v) == "table" and #v > 0 and type(v[1]) == "table" then
      local items = {}
      for i, x in ipairs(v) do items[i] = json.encode(x) end
      s = "[\n  " .. table.concat(items, ",\n  ") .. "]"
    else
      s = json.encode(v)
    end
    lines[#lines + 1] = " " .. json.encode(k) .. ": " .. s
  end
  return "{\n" .. table.concat(lines, ",\n") .. "\n}\n"
end

-- A cell: column = { header, key or function(row), format }.
local function cell(row, col)
  local get, fmt = col[2], col[3]
  local v
  if type(get) == "function" then v = get(row) else v = row[get] end
  if v == nil then return "" end
  if fmt and type(v) == "number" then return fmt:format(v) end
  return tostring(v)
end

--- bench.markdown_table(columns, rows) -> the table's text.
function M.markdown_table(columns, rows)
  local head, rule = {}, {}
  for i, c in ipairs(columns) do head[i], rule[i] = c[1], "---" end
  local lines = { "| " .. table.concat(head, " | ") .. " |", "|" .. table.concat(rule, "|") .. "|" }
  for _, r in ipairs(rows) do
    local cells = {}
    for i, c in ipairs(columns) do cells[i] = cell(r, c) end
    lines[#lines + 1] = "| " .. table.concat(cells, " | ") .. " |"
  end
  return table.concat(lines, "\n") .. "\n"
end

-- Keys of a report that go to the markdown only.
local MD_ONLY = { title = true, columns = true, notes = true, rows = true }

--- bench.report(cfg, r) -> the JSON object, the markdown text.
-- r: the script's fields (results, validation, ...: written as they are)
-- plus title (markdown heading), device (the device the numbers come
-- from, "cuda" or "cpu"; written as its name), reference (what the numbers are compared with), columns (the
-- markdown table's columns, { header, key or function(row), format }),
-- rows (the table's rows; default r.results), notes (lines under the
-- facts). The environment's fields, and, when cfg has repeats (a
-- benchmark's cfg from bench.config; a check reads its own with
-- moe.config), the timing method and cfg's repeats, warmup and cooldown
-- are added where r does not set them.
function M.report(cfg, r)
  cfg = cfg or {}
  local obj = {}
  for k, v in pairs(r) do if not MD_ONLY[k] then obj[k] = v end end
  local env = M.environment(r.device or cfg.device, M.argv)
  for k, v in pairs(env) do if obj[k] == nil then obj[k] = v end end
  obj.device = env.device -- the device's name, not the "cuda" the script ran on
  if cfg.repeats ~= nil then -- a benchmark (a check's cfg has no repeats)
    if obj.timing == nil then obj.timing = M.method(r.device or cfg.device) end
    if obj.repeats == nil then obj.repeats = cfg.repeats end
    if obj.warmup == nil then obj.warmup = cfg.warmup end
    if obj.cooldown_s == nil then obj.cooldown_s = cfg.cooldown end
  end

  local v = obj.versions or env.versions
  local md = { "# " .. (r.title or "Benchmark"), "",
    "- device: " .. tostring(obj.device),
    "- date: " .. tostring(obj.date),
    ("- versions: moe-lua %s, CUDA runtime %s (driver %s), cuBLAS %s"):format(
      tostring(v.moe_lua), tostring(v.cuda_runtime), tostring(v.cuda_driver), tostring(v.cublas)),
    "- command: `" .. tostring(obj.command) .. "`",
  }
  if obj.reference then md[#md + 1] = "- reference: " .. tostring(obj.reference) end
  if obj.repeats then
    md[#md + 1] = ("- timing: %s, median of %s repeats after %s warm-up calls%s"):format(obj.timing,
      tostring(obj.repeats), tostring(obj.warmup or 0),
      (obj.cooldown_s or 0) > 0 and (", %g s idle before each case"):format(obj.cooldown_s) or "")
  end
  for _, line in ipairs(r.notes or {}) do md[#md + 1] = "- " .. line end
  md[#md + 1] = ""
  if r.columns then md[#md + 1] = M.markdown_table(r.columns, r.rows or r.results or {}) end
  return obj, table.concat(md, "\n") .. (r.columns and "" or "\n")
end

local function write_file(path, text)
  local f, err = io.open(path, "w")
  if not f then error("bench.write: cannot open " .. tostring(err), 0) end
  f:write(text)
  f:close()
end

--- bench.write(cfg, r) -> obj, md: builds the report (bench.report), prints
-- the markdown, writes the JSON to cfg.json and the markdown to cfg.md
-- (default: cfg.json with .json replaced by .md) when cfg.json is set.
function M.write(cfg, r)
  local obj, md = M.report(cfg, r)
  io.write("\n", md)
  if cfg.json and cfg.json ~= "" then
    write_file(cfg.json, M.encode(obj))
    local mdpath = (cfg.md and cfg.md ~= "") and cfg.md or (cfg.json:gsub("%.json$", "") .. ".md")
    write_file(mdpath, md)
    print("wrote " .. cfg.json .. " and " .. mdpath)
  elseif cfg.md and cfg.md ~= "" then
    write_file(cfg.md, md)
    print("wrote " .. cfg.md)
  end
  return obj, md
end

return M
