--[[
tests/lua/host_spec.lua - the moe-lua executable, run as a subprocess
($MOE_BUILD_DIR/moe-lua): options as in lua5.4 (-e, -l, -i, -v, -E, --, -),
the arg table, errors with a traceback and status 1, subcommands, stdin
scripts, finalizers at exit, and Ctrl-C or SIGTERM stopping a running script
(status 130 or 143).
]]
local moe = require "moe"

local build = os.getenv("MOE_BUILD_DIR") or "build"
local exe = build .. "/moe-lua"

local function q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

-- Runs a shell command line; returns its output (stdout and stderr
-- together) and exit status.
local function sh(cmd)
  local p = assert(io.popen(cmd .. " 2>&1; echo \"__rc=$?\""))
  local out = p:read("a")
  p:close()
  local rc = tonumber(out:match("__rc=(%d+)%s*$"))
  return (out:gsub("__rc=%d+%s*$", "")), rc
end

-- moe-lua with arguments (each quoted), optionally fed `input` on stdin.
local function host(args, input, env)
  local cmd = (env or "") .. " " .. q(exe)
  for _, a in ipairs(args) do cmd = cmd .. " " .. q(a) end
  if input then cmd = "printf '%s' " .. q(input) .. " | " .. cmd else cmd = cmd .. " </dev/null" end
  return sh(cmd)
end

local tmpfiles = {}
local function script(source)
  local path = os.tmpname()
  local f = assert(io.open(path, "w"))
  f:write(source)
  f:close()
  tmpfiles[#tmpfiles + 1] = path
  return path
end

local function has(out, text) return out:find(text, 1, true) ~= nil end

describe("moe-lua", function()
  teardown(function()
    for _, p in ipairs(tmpfiles) do os.remove(p) end
  end)

  it("exists", function()
    local f = io.open(exe, "rb")
    assert.is_truthy(f, "no " .. exe .. " (set MOE_BUILD_DIR to the build folder)")
    f:close()
  end)

  it("runs -e statements in order", function()
    local out, rc = host({ "-e", "x = 20", "-e", "print(x + 22)" })
    assert.are.equal(0, rc)
    assert.are.equal("42\n", out)
  end)

  it("has moe compiled in and lua/ first on package.path", function()
    local out, rc = host({ "-e", "package.cpath = '' local moe = require 'moe' print(moe.version, type(package.preload.moe))" })
    assert.are.equal(0, rc, out)
    assert.are.equal(moe.version .. "\tfunction\n", out)
    out = host({ "-e", "print(package.searchpath('moe.config', package.path))" })
    assert.truthy(out:match("/lua/moe/config%.lua\n$"), out)
    out = host({ "-e", "print(require('moe').randn{2, 3})" })
    assert.truthy(has(out, "shape=[2, 3], dtype=f32, device=cpu"), out)
  end)

  it("-l loads a module into a global, also as g=mod", function()
    local out, rc = host({ "-l", "moe", "-l", "cfg=moe.config", "-e", "print(type(moe.zeros), type(cfg))" })
    assert.are.equal(0, rc, out)
    assert.are.equal("function\tfunction\n", out)
  end)

  it("-v and --version print versions, CUDA and the GPUs", function()
    for _, flag in ipairs({ "-v", "--version" }) do
      local out, rc = host({ flag })
      assert.are.equal(0, rc, out)
      assert.truthy(has(out, "moe-lua " .. moe.version .. "\n"), out)
      assert.truthy(has(out, "Lua 5.4"), out)
      assert.truthy(has(out, "CUDA: "), out)
      if moe.build_info().cuda then
        assert.truthy(out:match("CUDA: built in; runtime [%d.]+, driver [%w.]+, cuBLAS [%w.]+, NCCL [%w.]+"), out)
      else
        assert.truthy(has(out, "CUDA: not built in"), out)
      end
      if moe.cuda.is_available() then
        assert.truthy(out:match("GPU 0: .+, compute capability %d+%.%d, [%d.]+ GiB"), out)
      else
        assert.truthy(has(out, "no CUDA GPU visible"), out)
      end
    end
    local v = host({ "-v" })
    assert.are.equal(v, (host({ "version" })))
  end)

  it("builds the arg table as lua does", function()
    local s = script("for i = -3, 3 do print(i, arg[i]) end print('varargs', ...)")
    local out, rc = host({ "-e", "x=1", s, "a", "b c" })
    assert.are.equal(0, rc, out)
    assert.are.equal(table.concat({
      "-3\t" .. exe, "-2\t-e", "-1\tx=1", "0\t" .. s, "1\ta", "2\tb c", "3\tnil", "varargs\ta\tb c", "" }, "\n"), out)
    out = host({ "-e", "print(arg[0], arg[1], arg[2], arg[-1])" })
    assert.are.equal(exe .. "\t-e\tprint(arg[0], arg[1], arg[2], arg[-1])\tnil\n", out)
  end)

  it("reports a script error with a traceback and status 1", function()
    local s = script("local function f() error('boom') end\nf()\n")
    local out, rc = host({ s })
    assert.are.equal(1, rc)
    assert.truthy(has(out, "moe-lua: " .. s .. ":1: boom"), out)
    assert.truthy(has(out, "stack traceback:"), out)
    assert.truthy(has(out, s .. ":2: in main chunk"), out)
    out, rc = host({ "-e", "error('in -e')" })
    assert.are.equal(1, rc)
    assert.truthy(has(out, "moe-lua: (command line):1: in -e"), out)
    out, rc = host({ script("error(setmetatable({}, {__tostring = function() return 'custom' end}))") })
    assert.are.equal(1, rc)
    assert.truthy(has(out, "moe-lua: custom"), out)
    out, rc = host({ script("local x = = 1") })
    assert.are.equal(1, rc)
    assert.truthy(has(out, "unexpected symbol"), out)
  end)

  it("reports a message without a position (error(m, 0)) alone, the traceback on request", function()
    local s = script("local function f() error('train: steps must be > 0, got 0', 0) end\nf()\n")
    local out, rc = host({ s })
    assert.are.equal(1, rc)
    assert.are.equal("moe-lua: train: steps must be > 0, got 0\n", out)
    out, rc = host({ s }, nil, "MOE_TRACEBACK=1")
    assert.are.equal(1, rc)
    assert.truthy(has(out, "moe-lua: train: steps must be > 0, got 0\nstack traceback:"), out)
    assert.truthy(has(out, s .. ":2: in main chunk"), out)
  end)

  it("reports a bad moe call with the function and the problem", function()
    local out, rc = host({ "-e", "local moe = require 'moe' moe.arange(30):view(4, 7)" })
    assert.are.equal(1, rc)
    assert.truthy(has(out, "bad argument #2 to 'view' (shape [4, 7] is invalid for a tensor of 30 elements)"), out)
  end)

  it("returns os.exit's status and runs finalizers at exit", function()
    local _, rc = host({ "-e", "os.exit(3)" })
    assert.are.equal(3, rc)
    local out
    out, rc = host({ script([[
      local moe = require 'moe'
      keep = moe.zeros(1000)
      setmetatable({}, { __gc = function() print('finalized') end })
    ]]) })
    assert.are.equal(0, rc, out)
    assert.are.equal("finalized\n", out)
  end)

  it("runs subcommands and rejects unknown names", function()
    local out, rc = host({ "help" })
    assert.are.equal(0, rc, out)
    assert.truthy(has(out, "usage: moe-lua [options] [script [args]]"), out)
    assert.truthy(has(out, "Commands:"), out)
    assert.truthy(out:match("\n%s+version%s+%S"), out)
    out, rc = host({ "help", "version" })
    assert.are.equal(0, rc, out)
    assert.truthy(has(out, "moe-lua version: "), out)
    out, rc = host({ "help", "nosuch" })
    assert.are.equal(1, rc, out)
    out, rc = host({ "nosuchcommand", "x" })
    assert.are.equal(1, rc)
    assert.are.equal("moe-lua: cannot open nosuchcommand (no such file or command; try 'moe-lua help')\n", out)
    out, rc = host({ "no/such/file.lua" })
    assert.are.equal(1, rc)
    assert.truthy(has(out, "cannot open no/such/file.lua"), out)
  end)

  it("prints the usage on a bad option, and on --help", function()
    local out, rc = host({ "-x" })
    assert.are.equal(1, rc)
    assert.truthy(has(out, "moe-lua: unrecognized option '-x'"), out)
    assert.truthy(has(out, "usage: moe-lua"), out)
    out, rc = host({ "-e" })
    assert.are.equal(1, rc)
    assert.truthy(has(out, "'-e' needs argument"), out)
    out, rc = host({ "--bogus" })
    assert.are.equal(1, rc)
    assert.truthy(has(out, "unrecognized option '--bogus'"), out)
    for _, flag in ipairs({ "-h", "--help" }) do
      out, rc = host({ flag })
      assert.are.equal(0, rc)
      assert.truthy(has(out, "usage: moe-lua"), out)
      assert.truthy(has(out, "-e stat"), out)
    end
  end)

  it("runs a script from stdin", function()
    local out, rc = host({ "-", "a", "b" }, "print(arg[0], ...)\n")
    assert.are.equal(0, rc, out)
    assert.are.equal("-\ta\tb\n", out)
    out, rc = host({}, "print('piped ' .. require('moe').version)\n")
    assert.are.equal(0, rc, out)
    assert.are.equal("piped " .. moe.version .. "\n", out)
    out, rc = host({ "--", script("print('after --', ...)"), "-x" })
    assert.are.equal(0, rc, out)
    assert.are.equal("after --\t-x\n", out)
  end)

  it("-i reads statements after the script, printing expressions", function()
    local out, rc = host({ "-i" }, "x = 6\n=x * 7\nx + 1\nfor i = 1, 2 do\nprint('loop', i)\nend\nerror('oops')\nprint('still here')\n")
    assert.are.equal(0, rc, out)
    assert.truthy(has(out, "42\n"), out)
    assert.truthy(has(out, "7\n"), out)
    assert.truthy(has(out, "loop\t1\n"), out)
    assert.truthy(has(out, "loop\t2\n"), out)
    assert.truthy(has(out, "stdin:1: oops"), out)
    assert.truthy(has(out, "still here"), out)
  end)

  it("-E ignores LUA_INIT, which otherwise runs first", function()
    local out = host({ "-e", "print('main')" }, nil, "LUA_INIT='print(\"init\")'")
    assert.are.equal("init\nmain\n", out)
    out = host({ "-E", "-e", "print('main')" }, nil, "LUA_INIT='print(\"init\")'")
    assert.are.equal("main\n", out)
  end)

  it("stops a running script at a safe point on SIGINT", function()
    local _, has_timeout = sh("command -v timeout")
    if has_timeout ~= 0 then
      pending("no timeout(1) on this machine")
      return
    end
    local s = script([[
      local moe = require 'moe'
      io.write('started\n') io.flush()
      local t = moe.zeros(16)
      while true do t = t + 1 end
    ]])
    -- --foreground: the signal goes to moe-lua once (not again to the group,
    -- which would be a second Ctrl-C and kill it, as it kills lua5.4).
    -- --preserve-status: moe-lua's status, not timeout's 124.
    local out, rc = sh("timeout --foreground --preserve-status -k 5 -s INT 2 " .. q(exe) .. " " .. q(s))
    assert.are.equal(130, rc, out)
    assert.truthy(has(out, "started"), out)
    -- positioned at the script's line wherever the hook fired (in the loop's
    -- own code or on entering the tensor's C metamethod), with a traceback
    assert.truthy(out:find("[^\n]*:4: interrupted!") ~= nil, out)
    assert.truthy(has(out, "stack traceback:"), out)
    assert.falsy(has(out, "AddressSanitizer"), out)
    assert.falsy(has(out, "LeakSanitizer"), out)
  end)

  it("stops a running script at a safe point on SIGTERM, status 143", function()
    local _, has_timeout = sh("command -v timeout")
    if has_timeout ~= 0 then
      pending("no timeout(1) on this machine")
      return
    end
    local s = script([[
      io.write('started\n') io.flush()
      local ok, err = pcall(function() while true do end end)
      print('caught', err)
      error('saved a checkpoint, stopping', 0)
    ]])
    -- a pcall may catch the error (to save a checkpoint, say); an error
    -- that then ends the run still gives 143
    local out, rc = sh("timeout --foreground --preserve-status -k 5 -s TERM 1 " .. q(exe) .. " " .. q(s))
    assert.are.equal(143, rc, out)
    assert.truthy(has(out, "started"), out)
    assert.truthy(out:find("caught\t[^\n]*:2: terminated\n") ~= nil, out)
    assert.truthy(has(out, "moe-lua: saved a checkpoint, stopping"), out)
    out, rc = sh("timeout --foreground --preserve-status -k 5 -s TERM 1 " .. q(exe) .. " -e 'while true do end'")
    assert.are.equal(143, rc, out)
    assert.truthy(has(out, "moe-lua: (command line):1: terminated\nstack traceback:\n"), out)
  end)

  it("a soft stop takes the first SIGTERM or SIGINT as a flag; a second one raises", function()
    for _, c in ipairs({ { "TERM", 15, 143, "terminated" }, { "INT", 2, 130, "interrupted!" } }) do
      local s = script(([[
        local moe = require 'moe'
        local prev, delivered = moe.proc.soft_stop(true)
        print('armed', prev, delivered)
        local pid = moe.proc.getpid()
        io.popen('kill -%s ' .. pid):close() -- not os.execute: system() ignores SIGINT
        local t = os.time() + 10
        while not moe.proc.stop_requested() and os.time() < t do end
        print('flag', moe.proc.stop_requested())
        -- disarmed by the first: the second raises at the next safe point
        local ok, err = pcall(function()
          io.popen('kill -%s ' .. pid):close()
          local t2 = os.time() + 10
          while os.time() < t2 do end
        end)
        print('second', ok, err)
        moe.proc.stopped()
        error('stopped as asked', 0)
      ]]):format(c[1], c[1]))
      local out, rc = host({ s })
      assert.are.equal(c[3], rc, out)
      assert.truthy(has(out, "armed\tfalse\ttrue\n"), out)
      assert.truthy(has(out, ("flag\t%d\tSIG%s\n"):format(c[2], c[1])), out)
      assert.truthy(out:find("second\tfalse\t[^\n]*" .. c[4]:gsub("!", "%%!")), out)
      assert.truthy(has(out, "moe-lua: stopped as asked"), out)
    end
    -- stopped() without a stop is an error; soft_stop(false) disarms
    local out, rc = host({ "-e", "local p = require('moe').proc; p.soft_stop(true); p.soft_stop(false); " ..
      "os.execute('kill -TERM ' .. p.getpid()); local t = os.time() + 10; while os.time() < t do end" })
    assert.are.equal(143, rc, out)
    assert.truthy(has(out, "terminated"), out)
    out, rc = host({ "-e", "require('moe').proc.stopped()" })
    assert.are.equal(1, rc, out)
    assert.truthy(has(out, "stopped: no stop was requested"), out)
  end)
end)

describe("host memory", function()
  -- dead 1 MiB CPU tensors: Lua's collector sees their small handles only; the
  -- host backstop (MOE_HOST_GC_STEP_MB, 256 by default) runs a full cycle every
  -- that many MiB of new host storage, so the allocator's bytes stay bounded
  local source = [[
    local moe = require 'moe'
    moe.reset_peak_memory_stats('cpu')
    local base = moe.memory_stats('cpu').allocated
    for _ = 1, 200 do
      local t = moe.zeros({ 256, 1024 }) -- 1 MiB, dead at the next iteration
      t = nil
    end
    print(('peak %d MiB'):format((moe.memory_stats('cpu').peak_allocated - base) // (1024 * 1024)))
  ]]
  it("keeps dead CPU tensors under MOE_HOST_GC_STEP_MB, as device memory under MOE_GC_STEP_MB", function()
    local s = script(source)
    local out, rc = host({ s }, nil, "MOE_HOST_GC_STEP_MB=16")
    assert.are.equal(0, rc, out)
    local peak = tonumber(out:match("peak (%d+) MiB"))
    assert.truthy(peak and peak <= 17, out)
    -- the default (256 MiB) bounds them too; without the backstop (0) they pile up
    out, rc = host({ s })
    assert.are.equal(0, rc, out)
    assert.truthy(tonumber(out:match("peak (%d+) MiB")) <= 200, out)
    -- (Lua's own collector, paced by its small handles, frees some of them anyway)
    out, rc = host({ s }, nil, "MOE_HOST_GC_STEP_MB=0")
    assert.are.equal(0, rc, out)
    assert.truthy(tonumber(out:match("peak (%d+) MiB")) >= 64, out)
    out, rc = host({ "-e", "require 'moe'" }, nil, "MOE_HOST_GC_STEP_MB=lots")
    assert.are.equal(1, rc, out)
    assert.truthy(has(out, "MOE_HOST_GC_STEP_MB must be a whole number of MiB"), out)
  end)
end)
