--[[
tests/lua/cli_spec.lua - the command line as a user meets it, run as a
subprocess ($MOE_BUILD_DIR/moe-lua):
  - `moe-lua --help`, `-h`, `moe-lua help` and `moe-lua` alone on a terminal
    list every command with a one-line summary; every command file in
    lua/moe/cli/ is listed and answers --help and -h;
  - a table of user mistakes across the commands and in scripts (an unknown
    command or key, a bad value, a missing file): the message alone on
    stderr, one line "moe-lua: ...", no traceback, no lua/moe/ path, a
    non-zero status; with MOE_TRACEBACK=1 the traceback is there;
  - a bug (a runtime error in the library, an assert in a script) keeps its
    traceback.
]]
local build = os.getenv("MOE_BUILD_DIR") or "build"
local exe = build .. "/moe-lua"
local help = require "moe.cli.help"

local function q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end
local function has(s, text) return s:find(text, 1, true) ~= nil end

local root = os.tmpname()
os.remove(root)
assert(os.execute("mkdir -p " .. q(root)))

local function slurp(path)
  local f = io.open(path, "rb")
  if not f then return "" end
  local s = f:read("a")
  f:close()
  return s
end

-- moe-lua with arguments (each quoted) and an environment prefix: stdout,
-- stderr, exit status.
local function host(args, env)
  local cmd = (env or "") .. " " .. q(exe)
  for _, a in ipairs(args) do cmd = cmd .. " " .. q(a) end
  local o, e = root .. "/stdout", root .. "/stderr"
  local _, _, rc = os.execute(cmd .. " </dev/null >" .. q(o) .. " 2>" .. q(e))
  return slurp(o), slurp(e), rc
end

local function script(name, source)
  local path = root .. "/" .. name
  local f = assert(io.open(path, "w"))
  f:write(source)
  f:close()
  return path
end

local function cli_files()
  local p = assert(io.popen("ls " .. q(debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") .. "/../../lua/moe/cli")))
  local names = {}
  for line in p:lines() do
    local n = line:match("^([%w_%-]+)%.lua$")
    if n then names[#names + 1] = n end
  end
  p:close()
  table.sort(names)
  return names
end

describe("moe-lua help", function()
  it("--help, -h and help list every command with its summary", function()
    for _, args in ipairs({ { "--help" }, { "-h" }, { "help" } }) do
      local out, err, rc = host(args)
      assert.are.equal(0, rc, err)
      assert.truthy(has(out, "usage: moe-lua [options] [script [args]]"), out)
      assert.truthy(has(out, "-e stat"), out)
      assert.truthy(has(out, "Commands:\n"), out)
      for _, name in ipairs(help.commands) do
        local cmd = require("moe.cli." .. name)
        assert.is_string(cmd.summary, name)
        assert.is_nil(cmd.summary:find("\n"), name .. ": a summary is one line")
        assert.truthy(has(out, ("\n  %-10s %s\n"):format(name, cmd.summary)), name .. "\n" .. out)
      end
    end
  end)

  it("lists every command file of lua/moe/cli", function()
    local listed = {}
    for _, n in ipairs(help.commands) do listed[n] = true end
    local files = cli_files()
    assert.is_true(#files >= 7, table.concat(files, " "))
    for _, n in ipairs(files) do assert.is_true(listed[n], "moe/cli/" .. n .. ".lua is not in help.commands") end
  end)

  local has_script = os.execute("command -v script >/dev/null 2>&1")
  local tty_test = has_script and it or pending
  tty_test("moe-lua alone on a terminal lists the commands (script(1) gives it one)", function()
    local o = root .. "/tty"
    local ok = os.execute("script -qec " .. q(q(exe)) .. " /dev/null </dev/null >" .. q(o) .. " 2>&1")
    local out = slurp(o)
    assert.is_true(ok, out)
    assert.truthy(has(out, "Commands:"), out)
    assert.truthy(has(out, "train"), out)
  end)

  it("every command answers --help and -h with its usage, status 0", function()
    for _, name in ipairs(help.commands) do
      for _, flag in ipairs({ "--help", "-h" }) do
        local out, err, rc = host({ name, flag })
        local all = out .. err
        -- the command's own help, reached through the dispatcher
        assert.truthy(has(all, "usage: moe-lua " .. name), name .. " " .. flag .. ":\n" .. all)
        assert.are.equal(0, rc, name .. " " .. flag .. ":\n" .. all)
        assert.truthy(has(out, "usage: moe-lua " .. name), name .. " " .. flag .. ":\n" .. all)
        assert.falsy(has(all, "stack traceback"), all)
      end
    end
  end)

  it("help <command> prints the summary and the command's help", function()
    local out, err, rc = host({ "help", "train" })
    assert.are.equal(0, rc, err)
    assert.truthy(has(out, "moe-lua train: " .. require("moe.cli.train").summary), out)
    assert.truthy(out:find("steps%s*=") ~= nil, out)
    out, err, rc = host({ "help", "plot" })
    assert.are.equal(0, rc, err)
    assert.truthy(has(out, "out_dir="), out)
  end)
end)

describe("moe-lua user mistakes", function()
  local out_dir = root .. "/run"
  local cfg_script = script("cfg.lua", "local moe = require 'moe'\nlocal cfg = moe.config{ steps = 3 }\nprint(cfg.steps)\n")
  local ckpt_script = script("ckpt.lua", "local c = require 'moe.checkpoint'\nc.load('" .. root .. "/nockpt')\n")
  local zeros_script = script("zeros.lua", "local moe = require 'moe'\nlocal t = moe.zeros('x')\n")
  local linear_script = script("linear.lua", "local nn = require 'moe.nn'\nnn.Linear('a', 3)\n")
  local train_script = script("train.lua", "local train = require 'moe.train'\ntrain.run{ steps = 0 }\n")

  -- args, the text stderr's one line has, whether the host reported it (so
  -- that MOE_TRACEBACK=1 adds the traceback; commands that print their own
  -- message and return a status do not go through the host's handler)
  local cases = {
    { { "frob" }, "moe-lua: cannot open frob (no such file or command; try 'moe-lua help')", false },
    { { "no/such/script.lua" }, "moe-lua: cannot open no/such/script.lua", false },
    { { "help", "frob" }, "moe-lua: help: no command 'frob'", true },
    { { "version", "extra" }, "moe-lua: version: takes no arguments, got 'extra'", true },
    { { "train", "stepz=3" }, "moe-lua: moe.config: unknown key 'stepz' (did you mean 'steps'?", true },
    { { "train", "steps=abc" }, "moe-lua: moe.config: steps expects an integer, got 'abc'", true },
    { { "train", "--steps=3" }, "moe-lua: moe.config: bad argument '--steps=3'", true },
    { { "train", "device=tpu", "steps=1", "warmup=0", "out_dir=" .. out_dir },
      "moe-lua: train: device must be one of auto, cpu, cuda, got 'tpu'", true },
    { { "train", "data=nosuch", "data_dir=" .. root .. "/nodata", "steps=1", "warmup=0", "out_dir=" .. out_dir },
      "moe-lua: train: data='nosuch': no dataset", true },
    { { "train", "model.moe.top_k=99", "steps=1", "warmup=0", "out_dir=" .. out_dir, "overwrite=true" },
      "moe-lua: train: model.moe.top_k=99 is more than model.moe.num_experts=8", true },
    { { "sample", "ckpt=" .. root .. "/nockpt" },
      "moe-lua: checkpoint.load: '" .. root .. "/nockpt' has no state.json", true },
    { { "sample", "tokens=many" }, "moe-lua: moe.config: tokens expects an integer, got 'many'", true },
    { { "plot", "out_dir=" .. root .. "/nothing" },
      "moe-lua: metrics.read_jsonl: cannot open '" .. root .. "/nothing/metrics.jsonl'", true },
    { { "plot", "colour=red" }, "moe-lua: moe.config: unknown key 'colour'", true },
    { { "plot", "extra" }, "moe-lua: plot: unexpected argument 'extra'", true },
    { { "launch", "-n", "x", cfg_script }, "moe-lua launch: bad -n 'x'", false },
    { { cfg_script, "stepz=4" }, "moe-lua: moe.config: unknown key 'stepz'", true },
    { { cfg_script, "steps=" }, "moe-lua: moe.config: steps expects an integer", true },
    -- raised by the library for the script's call: the script's line, not the library's
    { { ckpt_script }, "moe-lua: " .. ckpt_script .. ":2: checkpoint.load: '" .. root .. "/nockpt' has no state.json", true },
    { { zeros_script }, "moe-lua: " .. zeros_script .. ":2: bad argument #1 to 'zeros'", true },
    { { linear_script }, "moe-lua: nn.Linear: in_features must be a positive integer, got a", true },
    { { train_script }, "moe-lua: train: ", true },
  }

  for _, case in ipairs(cases) do
    local args, want, traced = case[1], case[2], case[3]
    local label = table.concat(args, " "):gsub(root, "$TMP")
    it(label .. ": the message alone", function()
      local out, err, rc = host(args)
      assert.are_not.equal(0, rc, err)
      assert.truthy(has(err, want), "want: " .. want .. "\ngot: " .. err .. out)
      assert.falsy(has(err, "stack traceback"), err)
      assert.falsy(has(err .. out, "lua/moe/"), err .. out)
      local first = err:match("^[^\n]*")
      assert.truthy(first:find("^moe%-lua[ :]"), err)
      -- one line (launch's message may add its usage hint on the same line)
      assert.are.equal(first .. "\n", err, "one line on stderr")
      if traced then
        local _, terr, trc = host(args, "MOE_TRACEBACK=1")
        assert.are_not.equal(0, trc, terr)
        assert.truthy(has(terr, "stack traceback:"), terr)
      end
    end)
  end

  it("a runtime error inside the library is a bug: it keeps its traceback", function()
    local s = script("bug.lua", "local m = require 'moe.metrics'\nm.load_balance(5)\n")
    local _, err, rc = host({ s })
    assert.are.equal(1, rc)
    assert.truthy(err:find("lua/moe/metrics%.lua:%d+: attempt to get length of a number value"), err)
    assert.truthy(has(err, "stack traceback:"), err)
    assert.truthy(has(err, s .. ":2: in main chunk"), err)
  end)

  it("a failed assert and a script's own error() keep their traceback", function()
    local s = script("assert.lua", "local function f(x) assert(x) end\nf(false)\n")
    local _, err, rc = host({ s })
    assert.are.equal(1, rc)
    assert.truthy(has(err, "moe-lua: " .. s .. ":1: assertion failed!\nstack traceback:"), err)
    s = script("own.lua", "local function f() error('boom') end\nf()\n")
    _, err, rc = host({ s })
    assert.are.equal(1, rc)
    assert.truthy(has(err, "moe-lua: " .. s .. ":1: boom\nstack traceback:"), err)
  end)
end)

describe("cleanup", function()
  it("removes the spec's folder", function()
    assert.is_true(os.execute("rm -rf " .. q(root)))
  end)
end)
