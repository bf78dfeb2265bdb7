--[[
tests/lua/config_spec.lua - moe.config: key=value overrides merged into a
script's defaults (types, dotted keys, lists, errors), and, through the built
moe-lua run as a subprocess ($MOE_BUILD_DIR/moe-lua), overrides read from the
command line and `script.lua --help`.
]]
local moe = require "moe"

local build = os.getenv("MOE_BUILD_DIR") or "build"
local exe = build .. "/moe-lua"

local function sh_quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

-- Runs a Lua script with moe-lua and the given arguments: output (stdout
-- and stderr together) and exit status.
local function run_script(source, args)
  local path = os.tmpname()
  local f = assert(io.open(path, "w"))
  f:write(source)
  f:close()
  local cmd = sh_quote(exe) .. " " .. sh_quote(path)
  for _, a in ipairs(args or {}) do cmd = cmd .. " " .. sh_quote(a) end
  local p = assert(io.popen(cmd .. " 2>&1; echo \"__rc=$?\""))
  local out = p:read("a")
  p:close()
  os.remove(path)
  local rc = tonumber(out:match("__rc=(%d+)%s*$"))
  return out:gsub("__rc=%d+%s*$", ""), rc, path
end

local defaults = {
  steps = 100,
  lr = 3e-4,
  device = "auto",
  resume = false,
  name = "run",
  model = { experts = 8, top_k = 2, hidden = { 512, 1024 }, router = { jitter = 0.0 } },
  tags = {},
  scales = { 0.5, 1.5 },
}

local function err_of(f, ...)
  local ok, err = pcall(f, ...)
  assert.is_false(ok)
  return err
end

describe("moe.config", function()
  it("returns a deep copy of the defaults without overrides", function()
    local cfg, rest = moe.config(defaults, {})
    assert.are.same(defaults, cfg)
    assert.are_not.equal(defaults, cfg)
    assert.are_not.equal(defaults.model, cfg.model)
    assert.are.same({}, rest)
  end)

  it("parses values against the default's type", function()
    local cfg = moe.config(defaults, { "steps=500", "lr=1e-3", "device=cuda", "resume=true", "name=" })
    assert.are.equal(500, cfg.steps)
    assert.are.equal("integer", math.type(cfg.steps))
    assert.are.equal(1e-3, cfg.lr)
    assert.are.equal("cuda", cfg.device)
    assert.is_true(cfg.resume)
    assert.are.equal("", cfg.name)
    assert.are.equal(100, defaults.steps) -- the defaults are untouched
    cfg = moe.config(defaults, { "steps=1e3", "lr=2", "resume=false" })
    assert.are.equal(1000, cfg.steps)
    assert.are.equal("integer", math.type(cfg.steps))
    assert.are.equal("float", math.type(cfg.lr))
    assert.is_false(cfg.resume)
  end)

  it("sets nested keys with dots", function()
    local cfg = moe.config(defaults, { "model.experts=16", "model.router.jitter=0.01" })
    assert.are.equal(16, cfg.model.experts)
    assert.are.equal(2, cfg.model.top_k)
    assert.are.equal(0.01, cfg.model.router.jitter)
  end)

  it("parses lists as a,b,c or [a,b,c]", function()
    local cfg = moe.config(defaults, { "model.hidden=256,128,64", "scales=[1, 2.5]", "tags=a,b" })
    assert.are.same({ 256, 128, 64 }, cfg.model.hidden)
    assert.are.equal("integer", math.type(cfg.model.hidden[1]))
    assert.are.same({ 1.0, 2.5 }, cfg.scales)
    assert.are.equal("float", math.type(cfg.scales[1]))
    assert.are.same({ "a", "b" }, cfg.tags)
    assert.are.same({}, moe.config(defaults, { "model.hidden=[]" }).model.hidden)
    assert.are.same({ 3 }, moe.config(defaults, { "tags=3" }).tags)
  end)

  it("leaves positional arguments alone; the last override wins", function()
    local cfg, rest = moe.config(defaults, { "data.txt", "steps=1", "run", "steps=2", "-" })
    assert.are.equal(2, cfg.steps)
    assert.are.same({ "data.txt", "run", "-" }, rest)
  end)

  it("rejects mistaken overrides, naming the argument", function()
    local cases = {
      { { "--steps=3" }, "bad argument '--steps=3': overrides are key=value, one argument each, " ..
        "with no spaces around '=' (write steps=3)" },
      { { "-v" }, "bad argument '-v': flags are not taken" },
      { { "--verbose" }, "bad argument '--verbose'" },
      { { "steps", "=1" }, "bad argument 'steps': a key with no value; write steps=1" },
      { { "model.experts", "4" }, "bad argument 'model.experts': a key with no value; write model.experts=4" },
      { { "x", "=1" }, "bad arguments 'x' '=1'" },
      { { "=1" }, "bad argument '=1': no key before '='" },
      { { "st\195\169ps=1" }, "bad argument 'st\195\169ps=1': 'st\195\169ps' is not a key (keys are ASCII names" },
      { { "ste ps=1" }, "bad argument 'ste ps=1': 'ste ps' is not a key" },
      { { "steps=", "1" }, "steps expects an integer, got '' (a space after '='? write steps=<value> as one argument)" },
    }
    for _, c in ipairs(cases) do
      local err = err_of(moe.config, defaults, c[1])
      assert.truthy(err:find("moe.config: " .. c[2], 1, true), err)
    end
  end)

  it("suggests the nearest keys for an unknown one", function()
    local function hint(k) return err_of(moe.config, defaults, { k .. "=1" }):match("did you mean (.-)%?") end
    assert.are.equal("'steps'", hint("stpes"))
    assert.are.equal("'steps'", hint("step"))
    assert.are.equal("'model.experts'", hint("model.expert"))
    assert.are.equal("'model.experts'", hint("experts")) -- the last part of a dotted key
    assert.are.equal("'model.top_k'", hint("topk"))
    assert.is_nil(hint("zzzzzzzz"))
    local err = err_of(moe.config, defaults, { stepz = 1 }, "train")
    assert.truthy(err:find("train: unknown config key 'stepz' (did you mean 'steps'? valid keys: device", 1, true), err)
  end)

  it("reads the script's arguments from the global arg by default", function()
    local saved = _G.arg -- busted runs specs in their own environment
    _G.arg = { [0] = "script.lua", "steps=7", "x" }
    local ok, cfg, rest = pcall(moe.config, defaults)
    _G.arg = saved
    assert.is_true(ok)
    assert.are.equal(7, cfg.steps)
    assert.are.same({ "x" }, rest)
  end)

  it("rejects an unknown key, listing the valid keys", function()
    local err = err_of(moe.config, defaults, { "stpes=1" })
    assert.truthy(err:find("unknown key 'stpes'", 1, true))
    assert.truthy(err:find("valid keys: device, lr, model.experts, model.hidden, model.router.jitter, "
      .. "model.top_k, name, resume, scales, steps, tags", 1, true))
    assert.truthy(err_of(moe.config, defaults, { "model.expert=1" }):find("unknown key 'model.expert'", 1, true))
    assert.truthy(err_of(moe.config, defaults, { "steps.x=1" }):find("unknown key 'steps.x'", 1, true))
    local sec = err_of(moe.config, defaults, { "model=3" })
    assert.truthy(sec:find("'model' is a section", 1, true))
    assert.truthy(sec:find("model.experts", 1, true))
  end)

  it("rejects a value of the wrong type, naming key, type and value", function()
    local cases = {
      { "steps=abc", "steps expects an integer, got 'abc'" },
      { "steps=2.5", "steps expects an integer, got '2.5'" },
      { "lr=fast", "lr expects a number, got 'fast'" },
      { "resume=yes", "resume expects a boolean, got 'yes'" },
      { "model.hidden=1,x", "model.hidden expects a list of integer values" },
      { "scales=[a]", "scales expects a list of number values" },
    }
    for _, c in ipairs(cases) do
      local err = err_of(moe.config, defaults, { c[1] })
      assert.truthy(err:find(c[2], 1, true), err)
      assert.truthy(err:find("moe.config: ", 1, true))
    end
  end)

  it("merges a table of overrides with the same checks, errors under the given name", function()
    local cfg = moe.config(defaults, { steps = 5, model = { experts = 4, router = { jitter = 0.1 } } }, "train")
    assert.are.equal(5, cfg.steps)
    assert.are.equal(4, cfg.model.experts)
    assert.are.equal(2, cfg.model.top_k)
    assert.are.equal(0.1, cfg.model.router.jitter)
    assert.are.equal(100, defaults.steps) -- the defaults are not touched
    assert.are.equal(math.type(moe.config(defaults, { steps = 6.0 }).steps), "integer")
    local cases = {
      { { stepz = 1 }, "train: unknown config key 'stepz' (did you mean 'steps'? valid keys: device, lr" },
      { { model = { expert = 1 } }, "train: unknown config key 'model.expert'" },
      { { model = 3 }, "train: config key 'model' is a section, got a number" },
      { { steps = "ten" }, "train: config key 'steps' expects a number, got a string (ten)" },
      { { steps = 2.5 }, "train: config key 'steps' expects an integer, got 2.5" },
      { { resume = 1 }, "train: config key 'resume' expects a boolean, got a number (1)" },
    }
    for _, c in ipairs(cases) do
      local err = err_of(moe.config, defaults, c[1], "train")
      assert.truthy(err:find(c[2], 1, true), err)
    end
    assert.truthy(err_of(moe.config, defaults, { stepz = 1 }):find("moe.config: unknown config key 'stepz'", 1, true))
  end)

  it("checks its own arguments", function()
    assert.truthy(err_of(moe.config, nil):find("bad argument #1 to 'config'", 1, true))
    assert.truthy(err_of(moe.config, {}, "x=1"):find("bad argument #2 to 'config'", 1, true))
  end)
end)

describe("moe.config in a script run by moe-lua", function()
  local script = [[
local moe = require "moe"
local cfg, rest = moe.config{ steps = 100, lr = 0.001, model = { experts = 8, hidden = {4, 8} }, tag = "x" }
print("steps", cfg.steps, "lr", cfg.lr, "experts", cfg.model.experts, "hidden", table.concat(cfg.model.hidden, ","))
print("rest", table.concat(rest, " "))
]]

  it("takes overrides from the command line", function()
    local out, rc = run_script(script, { "steps=5", "model.experts=16", "pos", "model.hidden=[1,2,3]" })
    assert.are.equal(0, rc, out)
    assert.truthy(out:find("steps\t5\tlr\t0.001\texperts\t16\thidden\t1,2,3", 1, true), out)
    assert.truthy(out:find("rest\tpos", 1, true), out)
  end)

  it("--help lists every key with its default and type, and exits 0", function()
    for _, flag in ipairs({ "--help", "-h" }) do
      local out, rc = run_script(script, { flag })
      assert.are.equal(0, rc, out)
      assert.truthy(out:find("usage: moe-lua ", 1, true), out)
      assert.truthy(out:match("\n%s+lr = 0%.001%s+%(number%)\n"), out)
      assert.truthy(out:match("\n%s+model%.experts = 8%s+%(integer%)\n"), out)
      assert.truthy(out:match("\n%s+model%.hidden = 4,8%s+%(list of integer%)\n"), out)
      assert.truthy(out:match("\n%s+steps = 100%s+%(integer%)\n"), out)
      assert.truthy(out:match("\n%s+tag = x%s+%(string%)\n"), out)
      assert.falsy(out:find("steps\t", 1, true)) -- the script stopped
    end
  end)

  it("--help prints the description of a key beside its default and type", function()
    local described = [[
local moe = require "moe"
moe.config(setmetatable({ steps = 100, model = { experts = 8 } },
  { help = { steps = "optimizer steps of the run", ["model.experts"] = "experts per layer" } }))
]]
    local out, rc = run_script(described, { "--help" })
    assert.are.equal(0, rc, out)
    assert.truthy(out:match("\n  steps = 100%s+%(integer%)  optimizer steps of the run\n"), out)
    assert.truthy(out:match("\n  model%.experts = 8%s+%(integer%)  experts per layer\n"), out)
  end)

  it("moe-lua train --help describes every key of moe.train's config", function()
    local train = require "moe.train.config"
    local p = assert(io.popen(sh_quote(exe) .. " train --help 2>&1"))
    local out = p:read("a")
    p:close()
    local keys, missing = 0, {}
    local function walk(t, prefix)
      for k, v in pairs(t) do
        local key = prefix .. k
        if type(v) == "table" and #v == 0 and next(v) ~= nil then
          walk(v, key .. ".")
        else
          keys = keys + 1
          local d = train.descriptions[key]
          if type(d) ~= "string" or #d < 10 then missing[#missing + 1] = key end
          -- the line: key = default  (type)  description
          local line = out:match("\n  " .. key:gsub("[%.%-]", "%%%0") .. " = [^\n]*")
          if not (line and d and line:find("  " .. d, 1, true)) then missing[#missing + 1] = key .. " (help line)" end
        end
      end
    end
    walk(train.defaults(), "")
    assert.truthy(keys > 60, keys)
    assert.are.same({}, missing)
    -- no description of a key that does not exist
    for key in pairs(train.descriptions) do
      local t = train.defaults()
      for part in key:gmatch("[^.]+") do t = t and t[part] end
      assert.truthy(t ~= nil, "a description of no key: " .. key)
    end
  end)

  it("an unknown key stops the script with the list of keys and status 1", function()
    local out, rc = run_script(script, { "stpes=5" })
    assert.are.equal(1, rc)
    assert.truthy(out:find("moe.config: unknown key 'stpes' (did you mean 'steps'? valid keys: lr, model.experts, " ..
      "model.hidden, steps, tag)", 1, true), out)
    -- a message for the user: no position, no traceback (MOE_TRACEBACK=1 adds it)
    assert.truthy(out:find("moe-lua: moe.config: unknown key", 1, true), out)
    assert.falsy(out:find("stack traceback", 1, true), out)
  end)

  it("a flag or a split override stops the script naming the argument, without a traceback", function()
    for _, c in ipairs({ { { "--steps=3" }, "bad argument '--steps=3'" }, { { "steps", "=1" }, "bad argument 'steps'" },
      { { "st\195\169ps=1" }, "bad argument 'st\195\169ps=1'" } }) do
      local out, rc = run_script(script, c[1])
      assert.are.equal(1, rc, out)
      assert.truthy(out:find("moe-lua: moe.config: " .. c[2], 1, true), out)
      assert.falsy(out:find("stack traceback", 1, true), out)
      assert.falsy(out:find("steps\t", 1, true), out) -- the script stopped
    end
  end)
end)
