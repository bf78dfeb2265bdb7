--[[
moe/cli/launch.lua - `moe-lua launch`: runs a script (or a command) on N ranks
through Open MPI's mpirun, then says how the ranks ended.

  moe-lua launch -n 2 experiments/quickstart.lua steps=100
  moe-lua launch -n 16 --hostfile hosts --record-dir /shared/run1 train ...

It is not a process manager: mpirun starts, watches and stops the ranks; the
launcher builds mpirun's command line, runs it (moe.proc.spawn: mpirun's
stderr passes through unchanged and is also scanned for mpirun's report of a
dead rank; SIGINT and SIGTERM sent to the launcher go on to mpirun), then
reads the ranks' exit records.

mpirun gets: -n N, --bind-to none (and --mca odls_base_sigkill_timeout S with
--stop-grace S); on one node (no hostfile) --oversubscribe
and loopback only (--mca btl self,vader --mca oob_tcp_if_include lo); the
variables MOE_LAUNCH_DIR (where each rank's host writes rank-<r>.exit when it
exits; bindings/host.c), MASTER_ADDR (127.0.0.1 on one node, else the first
host of the hostfile), MASTER_PORT (a free port) and OMP_NUM_THREADS (1, as
torchrun: one CPU thread per rank for OpenMP and OpenBLAS), each unless
already set in the environment, and -x for each; OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)=1 when
run as root. The ranks run this executable with the script and its
arguments.

The report (stderr), after mpirun returns:
  - the rank that failed first: the one mpirun names (a rank killed by a
    signal, or the first non-zero exit), else the earliest failing exit
    record, else a rank that left no record (it died without a word);
  - the exit status: that rank's status (128 + the signal for one killed by
    a signal), 0 when every rank exited 0, 128 + the signal when the launcher
    itself was interrupted or terminated, mpirun's own status when no rank
    left a record. The status of the first failure, not the largest one:
    after it mpirun stops the other ranks (SIGTERM: status 143), and those
    are consequences, not causes.

Restarts (--max-restarts K): when the job fails (a rank died, exited non-zero,
or a collective timed out and the ranks failed), mpirun has already stopped
every rank; the launcher logs "restart i/K after <the first failure>" and
runs the job again with resume=latest in place of any resume= or overwrite=
argument (moe.train then continues from the newest complete checkpoint in its
out_dir), at most K times. The ranks see MOE_LAUNCH_RESTART (0 on the first
run). A launcher that is itself interrupted or terminated does not restart.

The restart timeline (--timeline FILE, or MOE_LAUNCH_TIMELINE=FILE in the
environment; --timeline starts FILE anew; the ranks get the variable):
JSON lines, each {"event", "time" (wall-clock seconds, moe.wall_clock),
"attempt" (0 for the first run, i for restart i), ...}:
  start       the launcher, as it starts mpirun for an attempt ("ranks")
  failure     a rank or a script that causes or sees a failure, just before
              (tests write one and then kill the rank: "rank", "what")
  first_step  moe.train on rank 0, when the host has finished the run's first
              step ("step"; "resumed": the checkpoint it resumed from)
  end         the launcher, as mpirun returns: the detection. "status",
              "failure" (the launcher's one-line reason), "failed_rank",
              "failure_time" and "failure_source": a failure event of the
              attempt ("reported"), else the earliest exit record of a rank
              that failed ("exit record": a rank that exited non-zero, or a
              collective that timed out), else none ("unknown": a rank died
              without a word; "stopped_time" is then when the first of the
              others stopped on mpirun's SIGTERM, an upper bound)
  restart     the launcher, as it decides to run the job again
At the end a launcher that restarted prints one line per restart.
M.timeline_event(event, fields) appends an event (nothing without the
variable); M.read_timeline(path) -> the events; M.restarts(events) -> one
row per restart: {attempt, failure, detected, restart, first_step
(wall-clock seconds), detect_s, restart_s, first_step_s, total_s (from the
failure, or from the detection when its time is unknown), step,
failure_source, failed_rank, why}.
]]
local M = {
  summary = "run a script on N ranks through mpirun and report which rank failed first",
  usage = [[
usage: moe-lua launch [options] [--] script.lua|command [args ...]
Runs the script (or a moe-lua command such as train) on N ranks with Open MPI's
mpirun, then says which rank failed first and why.
  -n N             number of ranks (default: one per visible GPU, else 1)
  --hostfile F     Open MPI hostfile, for several nodes (-n is then required)
  --mpirun PATH    the mpirun to run (default: $MOE_MPIRUN, else mpirun on PATH)
  -x NAME[=VALUE]  export a variable to every rank (mpirun -x; repeatable)
  --record-dir D   folder for the ranks' exit records (default: a fresh temporary
                   folder, removed afterwards; with --hostfile give a folder that
                   every node sees, or only mpirun's messages are reported)
  --stop-grace S   seconds mpirun waits before it sends SIGTERM to the ranks, and again
                   before SIGKILL, when it is stopped (SIGTERM, Ctrl-C) or a rank
                   fails (Open MPI's odls_base_sigkill_timeout, default 1): training
                   saves a checkpoint on SIGTERM and needs that time to write it
  --max-restarts K when the job fails, run it again with resume=latest, at most
                   K times (default 0), logging each restart
  --timeline F     write the restart timeline to F (JSON lines: each attempt's start,
                   the failure, its detection, the restart, the first step after it)
  --dry-run        print the mpirun command line and exit
  -h, --help       show this help
Exit status: the status of the rank that failed first (128 + the signal for a
rank killed by a signal), 0 when every rank exited 0, 130/143 when the launcher
is interrupted/terminated.]],
}

local NAME = "moe-lua launch"

local function fail(fmt, ...)
  io.stderr:write(NAME .. ": " .. fmt:format(...) .. "\n")
  return 1
end

local function say(fmt, ...) io.stderr:write(NAME .. ": " .. fmt:format(...) .. "\n") end

local function quote(s)
  if s:match("^[%w%-%+%./_=:,@]+$") then return s end
  return "'" .. s:gsub("'", "'\\''") .. "'"
end

local signames = { [1] = "SIGHUP", [2] = "SIGINT", [3] = "SIGQUIT", [6] = "SIGABRT", [9] = "SIGKILL",
  [11] = "SIGSEGV", [13] = "SIGPIPE", [15] = "SIGTERM" }
local function signame(n) return signames[n] or ("signal " .. n) end

-- ------------------------------------------------------------- arguments

-- Returns the options table, or nil and a message.
local function parse(args)
  local o = { exports = {}, rest = {} }
  local i = 1
  local function value(flag)
    i = i + 1
    if args[i] == nil then return nil, ("%s needs a value"):format(flag) end
    return args[i]
  end
  while i <= #args do
    local a = args[i]
    local err
    if a == "--" then
      i = i + 1
      break
    elseif a == "-h" or a == "--help" then
      o.help = true
    elseif a == "-n" or a == "-np" or a == "--np" then
      o.n, err = value(a)
    elseif a:match("^%-n%d") then
      o.n = a:sub(3)
    elseif a == "--hostfile" then
      o.hostfile, err = value(a)
    elseif a == "--mpirun" then
      o.mpirun, err = value(a)
    elseif a == "--record-dir" then
      o.record_dir, err = value(a)
    elseif a == "-x" then
      local x
      x, err = value(a)
      if x and not x:match("^[%a_][%w_]*=?") then err = ("-x '%s' is not NAME or NAME=VALUE"):format(x) end
      o.exports[#o.exports + 1] = x
    elseif a == "--stop-grace" then
      o.stop_grace, err = value(a)
      if o.stop_grace and not o.stop_grace:match("^%d+$") then
        err = ("--stop-grace '%s' is not a whole number of seconds"):format(o.stop_grace)
      end
    elseif a == "--max-restarts" then
      o.max_restarts, err = value(a)
    elseif a == "--timeline" then
      o.timeline, err = value(a)
    elseif a == "--dry-run" then
      o.dry_run = true
    elseif a:sub(1, 1) == "-" then
      return nil, ("unknown option '%s'"):format(a)
    else
      break
    end
    if err then return nil, err end
    i = i + 1
  end
  for j = i, #args do o.rest[#o.rest + 1] = args[j] end
  if o.n ~= nil then
    local n = tostring(o.n):match("^%d+$") and tonumber(o.n)
    if not n or n < 1 or n > 1e6 then return nil, ("bad -n '%s' (a whole number of ranks, at least 1)"):format(o.n) end
    o.n = math.tointeger(n)
  end
  if o.max_restarts ~= nil then
    local k = tostring(o.max_restarts):match("^%d+$") and tonumber(o.max_restarts)
    if not k or k > 1e6 then
      return nil, ("bad --max-restarts '%s' (a whole number of restarts, 0 or more)"):format(o.max_restarts)
    end
    o.max_restarts = math.tointeger(k)
  end
  o.max_restarts = o.max_restarts or 0
  return o
end

local function file_exists(path)
  local f = io.open(path, "r")
  if not f then return false end
  local ok = f:read(0) ~= nil or f:read("a") ~= nil -- false for a folder
  f:close()
  return ok
end

-- The mpirun to run, or nil and why not.
local function find_mpirun(proc, given)
  local function check(path, where)
    if proc.executable(path) then return path end
    return nil, ("%s '%s' is not an executable file"):format(where, path)
  end
  if given then return check(given, "--mpirun") end
  local env = os.getenv("MOE_MPIRUN")
  if env and env ~= "" then return check(env, "MOE_MPIRUN") end
  for dir in (os.getenv("PATH") or ""):gmatch("[^:]+") do
    if proc.executable(dir .. "/mpirun") then return dir .. "/mpirun" end
  end
  return nil, "mpirun not found on PATH (install Open MPI, e.g. apt-get install openmpi-bin, " ..
    "or name it with --mpirun PATH or MOE_MPIRUN)"
end

-- The first host named in an Open MPI hostfile ("node1 slots=4").
local function first_host(path)
  for line in io.lines(path) do
    local host = line:gsub("#.*", ""):match("^%s*(%S+)")
    if host then return host end
  end
end

-- ----------------------------------------------------------- the report

-- rank-<r>.exit (bindings/host.c write_exit_record) as a table, or nil.
local function read_record(dir, r)
  local f = io.open(("%s/rank-%d.exit"):format(dir, r), "r")
  if not f then return nil end
  local rec = {}
  for line in f:lines() do
    local k, v = line:match("^([%w_]+)=(.*)$")
    if k then rec[k] = v end
  end
  f:close()
  rec.status = math.tointeger(tonumber(rec.status)) or -1
  rec.signal = math.tointeger(tonumber(rec.signal)) or 0
  rec.wall = tonumber(rec.wall) or math.huge
  return rec
end

local function clock(wall)
  if wall == math.huge then return "?" end
  local s = math.floor(wall)
  return os.date("%H:%M:%S", s) .. (".%03d"):format(math.floor((wall - s) * 1000))
end

-- What mpirun said about the ranks: the rank killed by a signal it
-- noticed, or the first one to exit non-zero.
local function mpirun_said(lines)
  local said = {}
  for _, line in ipairs(lines) do
    local r, pid, node, sig, what =
      line:match("mpirun noticed that process rank (%d+) with PID (%d+) on node (%S+) exited on signal (%d+) %(([^)]*)%)")
    if r then
      said.signal_rank, said.signal, said.signal_text = tonumber(r), tonumber(sig), what
      said.node, said.pid, said.line = node, pid, line:gsub("^%s+", "")
    end
    local pr = line:match("Process name:%s*%[%[%d+,%d+%],(%d+)%]")
    if pr and not said.exit_rank then said.exit_rank = tonumber(pr) end
    local code = line:match("Exit code:%s*(%d+)")
    if code and not said.exit_code then said.exit_code = tonumber(code) end
  end
  return said
end

-- "exit 1 at 12:00:01.123" / "terminated by SIGTERM at ..." for a record.
local function how(rec)
  if rec.signal ~= 0 then
    return ("stopped by %s, status %d, at %s"):format(signame(rec.signal), rec.status, clock(rec.wall))
  elseif rec.status < 0 then
    return ("exit status unknown at %s"):format(clock(rec.wall))
  end
  return ("exit %d at %s"):format(rec.status, clock(rec.wall))
end

-- One line on the ranks other than `first` that did not exit 0.
local function say_others(n, records, complete, first)
  local others = {}
  for r = 0, n - 1 do
    if r ~= first then
      local o = records[r]
      if o and o.status ~= 0 then
        others[#others + 1] = ("rank %d %s"):format(r, o.signal ~= 0 and ("stopped by " .. signame(o.signal))
          or ("exit " .. o.status))
      elseif not o and complete then
        others[#others + 1] = ("rank %d left no record"):format(r)
      end
    end
  end
  if #others > 0 then
    local shown = table.concat(others, ", ", 1, math.min(#others, 8))
    say("%s: %s%s", first and "other ranks" or "ranks", shown,
      #others > 8 and (", and %d more"):format(#others - 8) or "")
  end
end

-- Prints the report; returns the exit status.
local function report(n, records, complete, result, lines)
  local said = mpirun_said(lines)
  if result.forwarded then
    say("%s received and sent on to mpirun", signame(result.forwarded))
    say_others(n, records, complete, nil)
    return 128 + result.forwarded, nil, true
  end
  -- the rank that failed first
  local first
  if said.signal_rank and said.signal_rank < n then
    first = said.signal_rank
  elseif said.exit_rank and said.exit_rank < n then
    first = said.exit_rank
  else
    for r = 0, n - 1 do
      local rec = records[r]
      if rec and rec.status ~= 0 and (first == nil or rec.wall < records[first].wall) then first = r end
    end
    if first == nil and complete then
      for r = 0, n - 1 do
        if not records[r] then
          first = r
          break
        end
      end
    end
  end
  local mpirun_status = result.signal and 128 + result.signal or result.status
  if first == nil then
    if mpirun_status == 0 then return 0 end
    local any = next(records) ~= nil
    if any then
      say("mpirun exited with status %d though no rank failed", mpirun_status)
    else
      say("mpirun exited with status %d and no rank left an exit record (did the ranks start? " ..
        "see mpirun's messages above)", mpirun_status)
    end
    return mpirun_status, ("mpirun exited with status %d"):format(mpirun_status)
  end
  local rec, status, why = records[first]
  if rec and rec.status ~= 0 then
    local msg = rec.error ~= "" and (": " .. rec.error) or ""
    say("rank %d failed first (%s)%s", first, how(rec), msg)
    status = rec.status > 0 and rec.status or 1
    why = rec.signal ~= 0 and ("rank %d was stopped by %s"):format(first, signame(rec.signal))
      or ("rank %d failed (exit %d)"):format(first, rec.status)
  elseif said.signal_rank == first then
    say("rank %d died without a word (mpirun: exited on signal %d (%s) on node %s)", first,
      said.signal, said.signal_text, said.node)
    status = 128 + said.signal
    why = ("rank %d died (signal %d)"):format(first, said.signal)
  elseif said.exit_rank == first and said.exit_code and said.exit_code ~= 0 then
    say("rank %d failed first (exit %d, says mpirun; it left no exit record)", first, said.exit_code)
    status = said.exit_code
    why = ("rank %d failed (exit %d)"):format(first, said.exit_code)
  else
    say("rank %d died without a word (killed by a signal? it left no exit record)", first)
    status = mpirun_status ~= 0 and mpirun_status or 1
    why = ("rank %d died"):format(first)
  end
  say_others(n, records, complete, first)
  return status, why
end

-- -------------------------------------------------------------- timeline

local function json() return require("moe.metrics").json end

local function wall()
  local moe = require "moe"
  return moe.wall_clock and moe.wall_clock() or os.time()
end

local function append_line(path, obj)
  local f = io.open(path, "a")
  if not f then return false end
  f:write(json().encode(obj) .. "\n") -- one write: lines of several processes do not mix
  f:close()
  return true
end

--- timeline_event(event, fields) -> whether it was written: one JSON line
--- {event, time, attempt, rank, fields...} appended to $MOE_LAUNCH_TIMELINE
--- (nothing when it is not set). attempt: $MOE_LAUNCH_RESTART or 0; rank: $RANK.
function M.timeline_event(event, fields)
  local path = os.getenv("MOE_LAUNCH_TIMELINE")
  if not path or path == "" then return false end
  local obj = {}
  for k, v in pairs(fields or {}) do obj[k] = v end
  obj.event, obj.time = event, obj.time or wall()
  obj.attempt = obj.attempt or math.tointeger(tonumber(os.getenv("MOE_LAUNCH_RESTART") or "0")) or 0
  if obj.rank == nil then obj.rank = math.tointeger(tonumber(os.getenv("RANK") or "")) end
  return append_line(path, obj)
end

--- read_timeline(path) -> the events, in the order written (lines that are not
--- JSON objects are skipped: a rank killed while writing).
function M.read_timeline(path)
  local events = {}
  local f = io.open(path, "r")
  if not f then return events end
  for line in f:lines() do
    local ok, e = pcall(json().decode, line)
    if ok and type(e) == "table" and type(e.event) == "string" then events[#events + 1] = e end
  end
  f:close()
  return events
end

--- restarts(events) -> one row per restart (see the header), in order.
function M.restarts(events)
  local by = {}
  for _, e in ipairs(events) do
    local a = math.tointeger(e.attempt) or 0
    local t = by[a] or {}
    by[a] = t
    if e.event == "end" then t.ending = e
    elseif e.event == "start" or e.event == "restart" or e.event == "first_step" then
      t[e.event] = t[e.event] or e
    end
  end
  local rows = {}
  local a = 1
  while by[a] do
    local t = by[a]
    local prev = by[a - 1] and by[a - 1].ending or {}
    local r = { attempt = a, failure = prev.failure_time, failure_source = prev.failure_source,
      failed_rank = prev.failed_rank, why = prev.failure, detected = prev.time,
      restart = (t.restart or t.start or {}).time, first_step = t.first_step and t.first_step.time,
      step = t.first_step and t.first_step.step }
    local function d(x, y) return x and y and y - x or nil end
    r.detect_s = d(r.failure, r.detected)
    r.restart_s = d(r.detected, r.restart)
    r.first_step_s = d(r.restart, r.first_step)
    r.total_s = d(r.failure or r.detected, r.first_step)
    rows[#rows + 1] = r
    a = a + 1
  end
  return rows
end

-- The failure of an attempt that just ended: a failure event of the attempt in
-- the timeline, else the earliest exit record of a rank that failed (not one
-- stopped by mpirun's SIGTERM, whose earliest record is the last value).
local function failure_time(path, attempt, records, n)
  local reported, rank
  for _, e in ipairs(M.read_timeline(path)) do
    if e.event == "failure" and (math.tointeger(e.attempt) or 0) == attempt and type(e.time) == "number"
        and (reported == nil or e.time < reported) then
      reported, rank = e.time, e.rank
    end
  end
  local first, first_rank, stopped
  for r = 0, n - 1 do
    local rec = records[r]
    if rec and rec.status ~= 0 and rec.wall ~= math.huge then
      if rec.signal == 15 then
        if stopped == nil or rec.wall < stopped then stopped = rec.wall end
      elseif first == nil or rec.wall < first then
        first, first_rank = rec.wall, r
      end
    end
  end
  if reported then return reported, "reported", rank, stopped end
  if first then return first, "exit record", first_rank, stopped end
  return nil, "unknown", nil, stopped
end

-- One line per restart of the timeline at path.
local function say_timeline(path)
  for _, r in ipairs(M.restarts(M.read_timeline(path))) do
    local function f(v) return v and ("%.2f s"):format(v) or "?" end
    say("restart %d timeline: failure at %s (%s), detected +%s, restarted +%s, first step (%s) +%s: %s from the %s",
      r.attempt, r.failure and clock(r.failure) or "?", r.failure_source or "?", f(r.detect_s), f(r.restart_s),
      tostring(r.step or "?"), f(r.first_step_s), f(r.total_s), r.failure and "failure" or "detection")
  end
end

-- ------------------------------------------------------------------ main

function M.main(...)
  local args = { ... }
  local moe = require "moe"
  local proc = moe.proc
  local o, err = parse(args)
  if not o then return fail("%s (%s --help lists the options)", err, NAME) end
  if o.help then
    print(M.usage)
    return 0
  end
  local script = o.rest[1]
  if not script then return fail("no script given\n%s", M.usage:match("^[^\n]*")) end
  if not file_exists(script) then
    local is_command = script:match("^[%a][%w_%-]*$") and package.searchpath("moe.cli." .. script, package.path)
    if not is_command then return fail("cannot open %s (no such file or command)", script) end
  end
  if o.hostfile and not file_exists(o.hostfile) then return fail("cannot open hostfile %s", o.hostfile) end
  if o.hostfile and not o.n then return fail("with --hostfile, give -n (the number of ranks in all)") end
  local n = o.n
  if not n then
    local gpus = moe.cuda.device_count()
    n = gpus > 0 and gpus or 1
    say("no -n given: %d rank%s (%s)", n, n == 1 and "" or "s",
      gpus > 0 and "one per visible GPU" or "no GPU visible")
  end
  local mpirun, why = find_mpirun(proc, o.mpirun)
  if not mpirun then return fail("%s", why) end

  -- what the ranks get
  local env = {}
  local master_addr = os.getenv("MASTER_ADDR")
  if not master_addr or master_addr == "" then
    master_addr = o.hostfile and first_host(o.hostfile) or "127.0.0.1"
    if not master_addr then return fail("hostfile %s names no host", o.hostfile) end
    env.MASTER_ADDR = master_addr
  end
  local master_port = os.getenv("MASTER_PORT")
  if not master_port or master_port == "" then env.MASTER_PORT = tostring(proc.free_port()) end
  -- one CPU thread per rank unless the user says otherwise, as torchrun does: the ranks
  -- share the cores, and OpenBLAS's and OpenMP's threads on top of them oversubscribe them
  -- (and make a rank's CPU GEMMs sum in an order that depends on the load)
  local omp = os.getenv("OMP_NUM_THREADS")
  if not omp or omp == "" then env.OMP_NUM_THREADS = "1" end
  if proc.geteuid() == 0 then
    env.OMPI_ALLOW_RUN_AS_ROOT = os.getenv("OMPI_ALLOW_RUN_AS_ROOT") or "1"
    env.OMPI_ALLOW_RUN_AS_ROOT_CONFIRM = os.getenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM") or "1"
  end
  local dir, made_dir = o.record_dir, false
  if o.dry_run then
    env.MOE_LAUNCH_DIR = dir or "<a fresh temporary folder>"
  else
    if not dir then
      dir, made_dir = proc.mkdtemp("moe-launch"), true
    end
    env.MOE_LAUNCH_DIR = dir
  end

  local timeline = o.timeline or os.getenv("MOE_LAUNCH_TIMELINE")
  if timeline == "" then timeline = nil end
  if timeline then
    if timeline:sub(1, 1) ~= "/" and os.getenv("PWD") then timeline = os.getenv("PWD") .. "/" .. timeline end
    env.MOE_LAUNCH_TIMELINE = timeline
    if o.timeline and not o.dry_run then
      local f = io.open(timeline, "w")
      if not f then return fail("cannot write the timeline %s", timeline) end
      f:close()
    end
  end

  local argv = { mpirun, "-n", tostring(n) }
  local function add(...) for _, a in ipairs({ ... }) do argv[#argv + 1] = a end end
  if o.hostfile then
    add("--hostfile", o.hostfile)
  else
    add("--oversubscribe", "--mca", "btl", "self,vader", "--mca", "oob_tcp_if_include", "lo")
  end
  add("--bind-to", "none")
  if o.stop_grace then add("--mca", "odls_base_sigkill_timeout", o.stop_grace) end
  add("-x", "MOE_LAUNCH_DIR", "-x", "MASTER_ADDR", "-x", "MASTER_PORT", "-x", "OMP_NUM_THREADS")
  if o.max_restarts > 0 then add("-x", "MOE_LAUNCH_RESTART") end
  if timeline then add("-x", "MOE_LAUNCH_TIMELINE") end
  for _, x in ipairs(o.exports) do add("-x", x) end
  add(proc.exe())
  local fixed = #argv
  for _, a in ipairs(o.rest) do add(a) end

  if o.dry_run then
    local words = {}
    for _, k in ipairs({ "MOE_LAUNCH_DIR", "MOE_LAUNCH_TIMELINE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
      "OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM" }) do
      if env[k] then words[#words + 1] = k .. "=" .. quote(env[k]) end
    end
    for _, a in ipairs(argv) do words[#words + 1] = quote(a) end
    print(table.concat(words, " "))
    return 0
  end

  -- on several nodes a record folder that is not shared leaves records
  -- missing: then only records that are there and mpirun's word count
  local complete = not o.hostfile or o.record_dir ~= nil
  local attempt = 0
  while true do
    -- clear records a previous run left in a folder we were given
    for r = 0, n - 1 do os.remove(("%s/rank-%d.exit"):format(dir, r)) end
    if o.max_restarts > 0 then env.MOE_LAUNCH_RESTART = tostring(attempt) end
    if timeline then append_line(timeline, { event = "start", time = wall(), attempt = attempt, ranks = n }) end
    local ok, result = pcall(proc.spawn, argv, {
      env = env,
      keep = { "mpirun noticed that process rank", "Process name:", "Exit code:" },
    })
    if not ok then
      if made_dir then os.execute("rm -rf " .. quote(dir)) end
      return fail("%s", tostring(result))
    end
    local detected = wall()
    local records = {}
    for r = 0, n - 1 do records[r] = read_record(dir, r) end
    local status, failure, interrupted = report(n, records, complete, result, result.lines)
    if timeline then
      local ft, source, frank, stopped = nil, nil, nil, nil
      if status ~= 0 then ft, source, frank, stopped = failure_time(timeline, attempt, records, n) end
      append_line(timeline, { event = "end", time = detected, attempt = attempt, status = status, failure = failure,
        failure_time = ft, failure_source = source, failed_rank = frank, stopped_time = stopped })
    end
    if status == 0 or interrupted or attempt >= o.max_restarts then
      if timeline and attempt > 0 then say_timeline(timeline) end
      if made_dir then os.execute("rm -rf " .. quote(dir)) end -- with what a killed rank left half-written
      if status ~= 0 and o.max_restarts > 0 and not interrupted then
        say("giving up after %d restart%s", attempt, attempt == 1 and "" or "s")
      end
      return status
    end
    attempt = attempt + 1
    local now = wall()
    if timeline then append_line(timeline, { event = "restart", time = now, attempt = attempt, after = failure }) end
    say("restart %d/%d after %s (at %s): running it again with resume=latest", attempt, o.max_restarts,
      failure or "a failure", clock(now))
    -- the script's arguments: resume=latest instead of any resume= or overwrite=
    for i = #argv, fixed + 2, -1 do
      if argv[i]:match("^resume=") or argv[i]:match("^overwrite=") then table.remove(argv, i) end
    end
    argv[#argv + 1] = "resume=latest"
  end
end

return M
