--[[
tests/lua/launch_spec.lua - ranks of a launched job and `moe-lua launch`.

First the host as a rank, without mpirun (the launcher's variables set by
hand): torchrun's names, stdout only on rank 0, "[rank r] " on errors and
warnings, the exit record, a broken variable. Then `moe-lua launch -n 2` of
the fixtures in tests/dist/launch_*.lua through the real mpirun (pending
when there is none): the environment of both ranks, rank 0's stdout only, a
rank's error named as the first failure, a rank killed by SIGKILL named and
the other stopped by mpirun, SIGTERM to the launcher reaching both ranks,
running as root. No moe.dist: the ranks only read their environment.
]]
local build = os.getenv("MOE_BUILD_DIR") or "build"
local exe = build .. "/moe-lua"
local dist = "tests/dist"

local function q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

-- Runs a shell command line; returns stdout, stderr and the exit status.
local tmpfiles = {}
local function tmpname()
  local p = os.tmpname()
  tmpfiles[#tmpfiles + 1] = p
  return p
end
local function slurp(path)
  local f = io.open(path, "r")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  return s
end
local function sh(cmd)
  local out, err = tmpname(), tmpname()
  local _, _, rc = os.execute("(" .. cmd .. ") >" .. out .. " 2>" .. err .. " </dev/null")
  return slurp(out), slurp(err), rc
end

local function mkdtemp() return require("moe").proc.mkdtemp("launch-spec") end
local function rmdir(dir)
  os.execute("rm -rf " .. q(dir))
end

-- Whether process pid still exists (a zombie counts as gone).
local function alive(pid)
  local stat = slurp("/proc/" .. pid .. "/stat")
  return stat ~= nil and not stat:match("^%d+ %b() Z")
end

local function has(s, text) return s ~= nil and s:find(text, 1, true) ~= nil end

local function record(dir, r)
  local text = slurp(("%s/rank-%d.exit"):format(dir, r))
  if not text then return nil end
  local rec = {}
  for k, v in text:gmatch("([%w_]+)=([^\n]*)") do rec[k] = v end
  return rec
end

-- Variables of an outer launcher must not leak into these tests.
local clean = "env -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE -u OMPI_COMM_WORLD_LOCAL_RANK " ..
  "-u OMPI_COMM_WORLD_LOCAL_SIZE -u SLURM_PROCID -u RANK -u WORLD_SIZE -u LOCAL_RANK " ..
  "-u LOCAL_WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT -u MOE_LAUNCH_DIR -u MOE_DIST_PRINT -u OMP_NUM_THREADS"

describe("the host as a rank", function()
  teardown(function()
    for _, p in ipairs(tmpfiles) do os.remove(p) end
  end)

  local function as_rank(r, n, args, extra)
    return sh(("%s OMPI_COMM_WORLD_RANK=%d OMPI_COMM_WORLD_SIZE=%d OMPI_COMM_WORLD_LOCAL_RANK=%d " ..
      "OMPI_COMM_WORLD_LOCAL_SIZE=%d %s %s %s"):format(clean, r, n, r, n, extra or "", q(exe), args))
  end

  it("sets torchrun's names and prints stdout on rank 0 only", function()
    local code = q("print(os.getenv('RANK'), os.getenv('WORLD_SIZE'), os.getenv('LOCAL_RANK'), " ..
      "os.getenv('LOCAL_WORLD_SIZE')) io.stderr:write('stderr ', os.getenv('RANK'), '\\n')")
    local out, err, rc = as_rank(0, 2, "-e " .. code)
    assert.are.equal(0, rc, err)
    assert.are.equal("0\t2\t0\t2\n", out)
    assert.are.equal("stderr 0\n", err)
    out, err, rc = as_rank(1, 2, "-e " .. code)
    assert.are.equal(0, rc, err)
    assert.are.equal("", out)
    assert.are.equal("stderr 1\n", err)
    out, err, rc = as_rank(1, 2, "-e " .. code, "MOE_DIST_PRINT=all")
    assert.are.equal(0, rc, err)
    assert.are.equal("1\t2\t1\t2\n", out)
  end)

  it("prefixes errors and warnings with the rank when there are several", function()
    local s = tmpname()
    local f = assert(io.open(s, "w"))
    f:write("warn('@on') warn('careful', ' now')\nlocal function g() error('bad') end\ng()\n")
    f:close()
    local _, err, rc = as_rank(1, 2, q(s))
    assert.are.equal(1, rc)
    assert.truthy(has(err, "[rank 1] Lua warning: careful now\n"), err)
    assert.truthy(has(err, "moe-lua: [rank 1] " .. s .. ":2: bad\n[rank 1] stack traceback:\n"), err)
    for line in err:gmatch("[^\n]+") do assert.truthy(line:find("[rank 1] ", 1, true), line) end
    _, err, rc = as_rank(0, 2, q(s))
    assert.are.equal(1, rc)
    assert.truthy(has(err, "moe-lua: [rank 0] " .. s .. ":2: bad"), err)
    -- one rank: no prefix, as a process started alone
    _, err, rc = as_rank(0, 1, q(s))
    assert.are.equal(1, rc)
    assert.truthy(has(err, "Lua warning: careful now\nmoe-lua: " .. s .. ":2: bad"), err)
  end)

  it("writes an exit record at exit, os.exit included, and hides the folder from children", function()
    local dir = mkdtemp()
    local _, err, rc = as_rank(1, 2, "-e " .. q("print(os.getenv('MOE_LAUNCH_DIR')) error('bad\\nsecond line')"),
      "MOE_LAUNCH_DIR=" .. q(dir))
    assert.are.equal(1, rc, err)
    local rec = record(dir, 1)
    assert.truthy(rec, "no record")
    assert.are.equal("1", rec.rank)
    assert.are.equal("1", rec.status)
    assert.are.equal("0", rec.signal)
    assert.are.equal("(command line):1: bad", rec.error)
    assert.truthy(rec.wall:match("^%d+%.%d%d%d%d%d%d%d%d%d$"), rec.wall)
    assert.truthy(rec.monotonic:match("^%d+%.%d%d%d%d%d%d%d%d%d$"), rec.monotonic)
    assert.truthy(math.abs(tonumber(rec.wall) - os.time()) < 60, rec.wall)
    _, err, rc = as_rank(0, 2, "-e " .. q("print(os.getenv('MOE_LAUNCH_DIR')) os.exit(7)"), "MOE_LAUNCH_DIR=" .. q(dir))
    assert.are.equal(7, rc, err)
    rec = record(dir, 0)
    assert.are.equal("7", rec.status)
    assert.are.equal("", rec.error)
    local out
    out, err, rc = as_rank(0, 2, "-e " .. q("print(os.getenv('MOE_LAUNCH_DIR'))"), "MOE_LAUNCH_DIR=" .. q(dir))
    assert.are.equal(0, rc, err)
    assert.are.equal("nil\n", out)
    assert.are.equal("0", record(dir, 0).status)
    local n = 0
    for _ in io.popen("ls -A " .. q(dir)):lines() do n = n + 1 end
    assert.are.equal(2, n) -- rank-0.exit and rank-1.exit, no temporary left
    rmdir(dir)
  end)

  it("stops at once on a broken launcher variable, naming it", function()
    local out, err, rc = sh(clean .. " OMPI_COMM_WORLD_RANK=2 OMPI_COMM_WORLD_SIZE=2 " .. q(exe) .. " -e 'print(1)'")
    assert.are.equal(1, rc)
    assert.are.equal("", out)
    assert.are.equal("moe-lua: cannot tell which rank this is: OMPI_COMM_WORLD_RANK=2 is not below " ..
      "OMPI_COMM_WORLD_SIZE=2\n", err)
  end)
end)

describe("moe-lua launch", function()
  local have_mpirun = os.execute("command -v mpirun >/dev/null 2>&1")

  local function launch(args, extra)
    return sh(("%s %s %s launch %s"):format(clean, extra or "", q(exe), args))
  end

  it("explains its options and rejects bad ones", function()
    local out, err, rc = launch("--help")
    local _
    assert.are.equal(0, rc, err)
    assert.truthy(has(out, "usage: moe-lua launch [options]"), out)
    _, err, rc = launch("")
    assert.are.equal(1, rc)
    assert.truthy(has(err, "moe-lua launch: no script given"), err)
    _, err, rc = launch("-n two x.lua")
    assert.are.equal(1, rc)
    assert.truthy(has(err, "moe-lua launch: bad -n 'two'"), err)
    _, err, rc = launch("-n 0 " .. dist .. "/launch_env.lua")
    assert.are.equal(1, rc)
    assert.truthy(has(err, "bad -n '0'"), err)
    _, err, rc = launch("-n 2 no/such/script.lua")
    assert.are.equal(1, rc)
    assert.truthy(has(err, "moe-lua launch: cannot open no/such/script.lua"), err)
    _, err, rc = launch("--bogus x.lua")
    assert.are.equal(1, rc)
    assert.truthy(has(err, "unknown option '--bogus'"), err)
    _, err, rc = launch("-n 2 --mpirun /no/mpirun " .. dist .. "/launch_env.lua")
    assert.are.equal(1, rc)
    assert.truthy(has(err, "--mpirun '/no/mpirun' is not an executable file"), err)
    _, err, rc = launch("-n 2 " .. dist .. "/launch_env.lua", "PATH=/nonexistent")
    assert.are.equal(1, rc)
    assert.truthy(has(err, "mpirun not found on PATH"), err)
    out = sh(q(exe) .. " help")
    assert.truthy(out:match("\n%s+launch%s+run a script on N ranks"), out)
  end)

  it("prints mpirun's command line on --dry-run", function()
    local out, err, rc = launch("--dry-run -n 3 --mpirun /bin/true -x FOO=1 " .. dist .. "/launch_env.lua a=1 -n 5")
    assert.are.equal(0, rc, err)
    assert.truthy(has(out, "/bin/true -n 3 --oversubscribe --mca btl self,vader --mca oob_tcp_if_include lo " ..
      "--bind-to none -x MOE_LAUNCH_DIR -x MASTER_ADDR -x MASTER_PORT -x OMP_NUM_THREADS -x FOO=1 "), out)
    assert.truthy(has(out, " " .. dist .. "/launch_env.lua a=1 -n 5\n"), out)
    assert.truthy(has(out, "MASTER_ADDR=127.0.0.1 MASTER_PORT="), out)
    -- one CPU thread per rank unless OMP_NUM_THREADS is set
    assert.truthy(has(out, " OMP_NUM_THREADS=1 "), out)
    assert.falsy(has(launch("--dry-run -n 2 --mpirun /bin/true " .. dist .. "/launch_env.lua", "OMP_NUM_THREADS=4"),
      "OMP_NUM_THREADS="), "a user's OMP_NUM_THREADS is kept")
    local root = require("moe").proc.geteuid() == 0
    assert.are.equal(root, has(out, "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"), out)
    -- with a hostfile: its first host, no loopback settings, -n required
    local hosts = tmpname()
    local f = assert(io.open(hosts, "w"))
    f:write("# nodes\n\nnode7 slots=2\nnode8 slots=2\n")
    f:close()
    out, err, rc = launch("--dry-run -n 4 --mpirun /bin/true --hostfile " .. hosts .. " " .. dist .. "/launch_env.lua")
    assert.are.equal(0, rc, err)
    assert.truthy(has(out, "MASTER_ADDR=node7 "), out)
    assert.truthy(has(out, "/bin/true -n 4 --hostfile " .. hosts .. " --bind-to none "), out)
    err, rc = select(2, launch("--dry-run --mpirun /bin/true --hostfile " .. hosts .. " " .. dist .. "/launch_env.lua"))
    assert.are.equal(1, rc)
    assert.truthy(has(err, "with --hostfile, give -n"), err)
    -- MASTER_ADDR and MASTER_PORT already set are kept
    out = launch("--dry-run -n 2 --mpirun /bin/true " .. dist .. "/launch_env.lua", "MASTER_ADDR=10.0.0.1 MASTER_PORT=1234")
    assert.falsy(has(out, "MASTER_ADDR="), out)
  end)

  it("runs both ranks with the job's environment, showing rank 0's stdout", function()
    if not have_mpirun then return pending("no mpirun on this machine") end
    local out, err, rc = launch("-n 2 " .. dist .. "/launch_env.lua a=1 b")
    assert.are.equal(0, rc, err)
    assert.are.equal("stdout from rank 0\n", out)
    local port
    for r = 0, 1 do
      local line = err:match("env (RANK=" .. r .. " [^\n]*)")
      assert.truthy(line, err)
      assert.truthy(has(line, "WORLD_SIZE=2 LOCAL_RANK=" .. r .. " LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 "), line)
      local p = line:match("MASTER_PORT=(%d+)")
      assert.truthy(p, line)
      assert.truthy(port == nil or port == p, err)
      port = p
      assert.truthy(has(line, "MOE_LAUNCH_DIR=nil args=a=1,b"), line)
      assert.truthy(has(err, "[rank " .. r .. "] Lua warning: a warning from rank " .. r), err)
    end
  end)

  it("names a rank's error as the first failure and exits with its status", function()
    if not have_mpirun then return pending("no mpirun on this machine") end
    local t0 = os.time()
    local out, err, rc = launch("-n 2 " .. dist .. "/launch_fail.lua")
    assert.truthy(os.time() - t0 < 30, "took " .. (os.time() - t0) .. " s")
    assert.are.equal(1, rc, err)
    assert.are.equal("", out)
    assert.truthy(has(err, "moe-lua: [rank 1] " .. dist .. "/launch_fail.lua:4: boom from rank 1\n"), err)
    assert.truthy(err:match("\nmoe%-lua launch: rank 1 failed first %(exit 1 at %d%d:%d%d:%d%d%.%d%d%d%): " ..
      dist:gsub("%p", "%%%0") .. "/launch_fail%.lua:4: boom from rank 1\n"), err)
    assert.falsy(has(err, "was not stopped"), err)
  end)

  it("ends the job at once when a rank fails while another waits in a collective", function()
    if not have_mpirun then return pending("no mpirun on this machine") end
    local t0 = os.time()
    local out, err, rc = launch("-n 2 " .. dist .. "/launch_fail_collective.lua")
    assert.truthy(os.time() - t0 < 30, "took " .. (os.time() - t0) .. " s (the collective's timeout is 120 s)")
    assert.are.equal(1, rc, err)
    assert.are.equal("", out)
    assert.truthy(err:match("moe%-lua launch: rank 1 failed first %(exit 1 at [%d:.]+%): [^\n]*boom in step 3 of rank 1"),
      err)
    assert.falsy(has(err, "was not stopped"), err)
  end)

  it("names a rank killed by SIGKILL; mpirun stops the other", function()
    if not have_mpirun then return pending("no mpirun on this machine") end
    local dir = mkdtemp()
    local t0 = os.time()
    local out, err, rc = launch("-n 2 --record-dir " .. q(dir) .. " " .. dist .. "/launch_kill.lua " .. q(dir))
    assert.truthy(os.time() - t0 < 60, "took " .. (os.time() - t0) .. " s")
    assert.are.equal(137, rc, err)
    assert.are.equal("", out)
    assert.truthy(has(err, "mpirun noticed that process rank 1"), err) -- passed through
    assert.truthy(has(err, "moe-lua launch: rank 1 died without a word (mpirun: exited on signal 9 (Killed)"), err)
    assert.is_nil(record(dir, 1))
    -- rank 0 was stopped (mpirun: SIGTERM, then SIGKILL within about a
    -- second): its record, when it had time to write one, says so
    local pid0 = err:match("ready 0 pid=(%d+)")
    assert.truthy(pid0, err)
    assert.falsy(alive(pid0), "rank 0 still runs")
    local rec = record(dir, 0)
    if rec then assert.are.equal("143", rec.status, err) end
    assert.falsy(has(err, "was not stopped"), err)
    rmdir(dir)
  end)

  it("ends data-parallel training when a rank is killed mid-step, naming it", function()
    if not have_mpirun then return pending("no mpirun on this machine") end
    local t0 = os.time()
    local out, err, rc = launch("-n 2 " .. dist .. "/launch_kill_train.lua")
    assert.truthy(os.time() - t0 < 60, "took " .. (os.time() - t0) .. " s")
    assert.are.equal(137, rc, err)
    assert.truthy(has(err, "ready 1 pid="), err) -- rank 1 was training
    assert.truthy(has(err, "moe-lua launch: rank 1 died without a word (mpirun: exited on signal 9 (Killed)"), err)
    assert.falsy(has(out .. err, "was not stopped"), err)
  end)

  it("restarts a job whose rank was killed mid-step, and the loss curve goes on unchanged", function()
    if not have_mpirun then return pending("no mpirun on this machine") end
    local dir = mkdtemp()
    -- training ranks run MPI, whose allocations LeakSanitizer would report (tests/CMakeLists.txt)
    local noleak = "ASAN_OPTIONS=detect_leaks=0:abort_on_error=0"
    local tl = dir .. "/timeline.jsonl"
    local _, err, rc = launch("-n 2 --max-restarts 2 --timeline " .. q(tl) .. " " .. dist .. "/ckpt_restart.lua dir=" ..
      q(dir .. "/k") .. " kill=true", noleak)
    assert.are.equal(0, rc, err)
    assert.truthy(has(err, "moe-lua launch: restart 1/2 after rank 1 died (signal 9)"), err)
    assert.falsy(has(err, "restart 2/2"), err)
    -- the timeline: the failure the rank reported, its detection, the restart, the first step after it
    local L = require "moe.cli.launch"
    local events = L.read_timeline(tl)
    local kinds = {}
    for _, e in ipairs(events) do kinds[#kinds + 1] = e.attempt .. ":" .. e.event end
    assert.are.same({ "0:start", "0:first_step", "0:failure", "0:end", "1:restart", "1:start", "1:first_step", "1:end" },
      kinds)
    assert.are.equal(137, events[4].status)
    assert.are.equal(1, events[3].rank)
    local rows = L.restarts(events)
    assert.are.equal(1, #rows)
    local r = rows[1]
    assert.are.equal("reported", r.failure_source)
    assert.are.equal(1, r.failed_rank)
    assert.truthy(r.failure <= r.detected and r.detected <= r.restart and r.restart < r.first_step, err)
    assert.truthy(r.total_s > 0 and r.total_s < 60 and math.abs(r.detect_s + r.restart_s + r.first_step_s - r.total_s) < 1e-6)
    assert.truthy(r.step >= 2 and r.step <= 7, "first step after the restart " .. tostring(r.step))
    assert.truthy(events[7].resumed:match("/ckpt%-%d+$"), events[7].resumed)
    assert.truthy(has(err, "moe-lua launch: restart 1 timeline: failure at "), err)
    _, err, rc = launch("-n 2 " .. dist .. "/ckpt_restart.lua dir=" .. q(dir .. "/ref"), noleak)
    assert.are.equal(0, rc, err)
    local function losses(path)
      local t, first = {}, nil
      for line in io.lines(path) do
        local st, v = line:match("^(%d+) (%S+)$")
        st = math.tointeger(tonumber(st))
        t[st], first = v, first or st
      end
      return t, first
    end
    assert.is_nil(io.open(dir .. "/k/losses-0.txt")) -- the first run died
    local got, first = losses(dir .. "/k/losses-1.txt")
    local want = losses(dir .. "/ref/losses-0.txt")
    -- resumed from a checkpoint before the kill (step 6 was in flight), every step after it redone
    assert.truthy(first > 1 and first <= 7, "the restarted run began at step " .. tostring(first))
    for st = first, 12 do assert.are.equal(want[st], got[st], "step " .. st) end -- the printed bits
    rmdir(dir)
  end)

  it("refuses a bad --max-restarts and stops after K restarts", function()
    local _, err, rc = launch("--max-restarts -1 x.lua")
    assert.are.equal(1, rc, err)
    assert.truthy(has(err, "bad --max-restarts '-1'"), err)
    if not have_mpirun then return pending("no mpirun on this machine") end
    local dir = mkdtemp()
    _, err, rc = launch("-n 2 --max-restarts 1 --timeline " .. q(dir .. "/t.jsonl") .. " " .. dist ..
      "/launch_fail.lua resume=x overwrite=true")
    assert.are_not.equal(0, rc, err)
    assert.truthy(has(err, "restart 1/1 after rank "), err)
    assert.truthy(has(err, "giving up after 1 restart"), err)
    -- no rank reported the failure: its time is rank 1's exit record
    local L = require "moe.cli.launch"
    local rows = L.restarts(L.read_timeline(dir .. "/t.jsonl"))
    assert.are.equal(1, #rows)
    assert.are.equal("exit record", rows[1].failure_source)
    assert.are.equal(1, rows[1].failed_rank)
    assert.truthy(rows[1].detect_s >= 0 and rows[1].detect_s < 30, rows[1].detect_s)
    assert.is_nil(rows[1].first_step) -- no training
    rmdir(dir)
  end)

  it("sends SIGTERM on to both ranks and exits 143", function()
    if not have_mpirun then return pending("no mpirun on this machine") end
    local dir = mkdtemp()
    local errf = dir .. "/stderr"
    local t0 = os.time()
    -- mpirun's SIGKILL follows its SIGTERM after odls_base_sigkill_timeout
    -- (1 s by default): on a loaded machine both ranks could be killed before
    -- either writes its record, so the test gives them 3 s
    local _, err, rc = sh(([[
      OMPI_MCA_odls_base_sigkill_timeout=3 %s %s launch -n 2 --record-dir %s %s/launch_spin.lua 2>%s & p=$!
      i=0
      until grep -q 'ready 0' %s && grep -q 'ready 1' %s; do
        i=$((i + 1)); [ $i -gt 300 ] && break; sleep 0.1
      done
      kill -TERM $p
      wait $p
    ]]):format(clean, q(exe), q(dir), dist, q(errf), q(errf), q(errf)))
    local log = slurp(errf) or ""
    assert.truthy(os.time() - t0 < 45, "took " .. (os.time() - t0) .. " s")
    assert.are.equal(143, rc, log .. err)
    assert.truthy(has(log, "moe-lua launch: SIGTERM received and sent on to mpirun"), log)
    -- both got mpirun's SIGTERM and are gone; mpirun follows with SIGKILL
    -- about a second later (odls_base_sigkill_timeout), cut short when a
    -- rank exits, so a slow rank may be killed before it writes its record
    local records = 0
    for r = 0, 1 do
      local pid = log:match("ready " .. r .. " pid=(%d+)")
      assert.truthy(pid, log)
      assert.falsy(alive(pid), "rank " .. r .. " still runs")
      local rec = record(dir, r)
      if rec then
        records = records + 1
        assert.are.equal("143", rec.status, log)
        assert.are.equal("15", rec.signal, log)
      end
    end
    assert.truthy(records > 0, log)
    -- the error names the script's line (the innermost one running)
    assert.truthy(log:find("%[rank [01]%] [^\n]*:%d+: terminated") ~= nil, log)
    rmdir(dir)
  end)

  it("runs as root, allowing Open MPI to", function()
    if not have_mpirun then return pending("no mpirun on this machine") end
    if require("moe").proc.geteuid() ~= 0 then return pending("not running as root") end
    local out, err, rc = launch("-n 2 " .. dist .. "/launch_env.lua",
      "env -u OMPI_ALLOW_RUN_AS_ROOT -u OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")
    assert.are.equal(0, rc, err)
    assert.are.equal("stdout from rank 0\n", out)
  end)
end)
