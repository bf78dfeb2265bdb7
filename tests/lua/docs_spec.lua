--[[
tests/lua/docs_spec.lua - the reference docs stay complete:
  - docs/API.md mentions every name the `moe` module exports: its functions,
    the functions of its tables (moe.ops, moe.cuda, moe.dist, ...; names
    starting with "_" are private) and the tensor methods, enumerated from
    the loaded module;
  - docs/ENVIRONMENT.md lists every MOE_* environment variable the source
    tree reads (getenv / os.getenv, the kernel knob table, $MOE_* in the CI
    scripts);
  - the user docs (README.md, docs/*.md) carry no internal issue numbers;
  - docs/OPTIONS.md's moe-lua command for MegaBlocks' 125M dMoE script uses
    only keys `moe-lua train` has, with values of their types, and runs one
    step on the CPU with its sizes cut down.
Run from the repository root (ctest does).
]]
local moe = require "moe"

local root = (debug.getinfo(1, "S").source:match("^@(.*)/tests/lua/[^/]*$")) or "."

local spec_dir = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests/lua"
local read = dofile(spec_dir .. "/read_file.lua")

local function q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

local function lines_of(cmd)
  local p = assert(io.popen(cmd))
  local out = {}
  for l in p:lines() do out[#out + 1] = l end
  p:close()
  return out
end

local function sorted_keys(t)
  local out = {}
  for k in pairs(t) do if type(k) == "string" then out[#out + 1] = k end end
  table.sort(out)
  return out
end

-- Whether text has `prefix..name` followed by something that ends a Lua name.
local function mentions(text, prefix, name)
  local pat = (prefix .. name):gsub("[%p]", "%%%0") .. "[^%w_]"
  return text:find(pat) ~= nil
end

describe("docs/API.md", function()
  local api = read(root .. "/docs/API.md")

  it("mentions every name of require 'moe' as `moe.<name>`", function()
    local missing = {}
    for _, name in ipairs(sorted_keys(moe)) do
      if not mentions(api, "`moe.", name) then missing[#missing + 1] = "moe." .. name end
    end
    assert.are.same({}, missing)
  end)

  it("mentions every name of the module's tables (moe.ops, moe.cuda, ...)", function()
    local missing, n = {}, 0
    for _, t in ipairs(sorted_keys(moe)) do
      if type(moe[t]) == "table" and t ~= "Tensor" then
        for _, name in ipairs(sorted_keys(moe[t])) do
          n = n + 1
          if name:match("^_") then goto private end
          if not mentions(api, "moe." .. t .. ".", name) then missing[#missing + 1] = "moe." .. t .. "." .. name end
          ::private::
        end
      end
    end
    assert.is_true(n > 50, "only " .. n .. " names found in the module's tables")
    assert.are.same({}, missing)
  end)

  it("mentions every tensor method as `t:<name>` (or a field as `t.<name>`)", function()
    local missing = {}
    local methods = sorted_keys(moe.Tensor)
    assert.is_true(#methods > 50, "only " .. #methods .. " tensor methods")
    for _, name in ipairs(methods) do
      if not name:match("^__") and not (mentions(api, "`t:", name) or mentions(api, "`t.", name)) then
        missing[#missing + 1] = "t:" .. name
      end
    end
    assert.are.same({}, missing)
  end)

  it("can fail: a name the module does not have is not taken as mentioned", function()
    assert.is_false(mentions(api, "`moe.", "no_such_function_xyz"))
    assert.is_true(mentions(api, "`moe.", "zeros"))
  end)
end)

describe("docs/ENVIRONMENT.md", function()
  local env_doc = read(root .. "/docs/ENVIRONMENT.md")

  -- Every MOE_* variable read somewhere in the tree: name -> first file:line.
  local function variables_read()
    local found = {}
    local function note(name, where) found[name] = found[name] or where end
    local files = lines_of("cd " .. q(root) .. " && find core bindings lua kernels .ci tests experiments bench tools " ..
      "-type f 2>/dev/null | sed 's|^\\./||' | sort")
    assert.is_true(#files > 100, "find found " .. #files .. " files")
    for _, f in ipairs(files) do
      local fh = io.open(root .. "/" .. f, "rb")
      if fh then
        local n = 0
        local shell = f:match("^%.ci/") or f:match("%.sh$")
        for line in fh:lines() do
          n = n + 1
          for name in line:gmatch("getenv%(%s*\"(MOE_[%w_]+)\"") do note(name, f .. ":" .. n) end
          for name in line:gmatch("KNOB_%u+%(%s*[%w_]+%s*,%s*\"(MOE_[%w_]+)\"") do note(name, f .. ":" .. n) end
          if shell then
            for name in line:gmatch("%${?(MOE_[%w_]+)") do note(name, f .. ":" .. n) end
          end
        end
        fh:close()
      end
    end
    return found
  end

  it("lists every MOE_* variable the source reads", function()
    local found = variables_read()
    -- the scan itself works: variables read in C, in Lua, in the knob table, in a CI script
    for _, known in ipairs({ "MOE_TRACEBACK", "MOE_NO_PROGRESS", "MOE_ATTN_WG", "MOE_GPU_BUILD" }) do
      assert.is_string(found[known], known .. " not found by the scan")
    end
    local missing = {}
    for _, name in ipairs(sorted_keys(found)) do
      if not env_doc:find("`" .. name .. "`", 1, true) then missing[#missing + 1] = name .. " (" .. found[name] .. ")" end
    end
    assert.are.same({}, missing)
  end)
end)

describe("docs/OPTIONS.md", function()
  local text = read(root .. "/docs/OPTIONS.md")
  -- The arguments after `moe-lua launch -n 8 train` in the fenced sh block.
  local block = text:match("```sh\n(moe%-lua launch %-n 8 train.-)\n```")
  local args = {}
  if block then
    for word in block:gsub("\\\n", " "):gmatch("%S+") do args[#args + 1] = word end
    for _ = 1, 5 do table.remove(args, 1) end -- moe-lua launch -n 8 train
  end

  it("has the 125M dMoE command, every argument a train key of the right type", function()
    assert.is_string(block, "no ```sh block starting 'moe-lua launch -n 8 train'")
    assert.is_true(#args > 30, #args .. " arguments")
    local train = require "moe.train"
    local tconfig = require "moe.train.config"
    local ok, cfg, rest = pcall(moe.config, train.defaults(), args)
    assert.is_true(ok, tostring(cfg))
    assert.are.same({}, rest)
    tconfig.check(cfg)
    assert.are.same({ 12, 768, 64, 1, 8, 20000 }, { cfg.model.n_layers, cfg.model.d_model, cfg.model.moe.num_experts,
      cfg.model.moe.top_k, cfg.parallel.ep, cfg.steps })
  end)

  it("runs one step of that command on the CPU, sizes cut down", function()
    local dir = os.tmpname()
    os.remove(dir)
    assert(os.execute("mkdir -p " .. q(dir)))
    local txt = dir .. "/corpus.txt"
    local f = assert(io.open(txt, "w"))
    for i = 1, 200 do f:write(("line %d of a small corpus for a smoke test\n"):format(i)) end
    f:close()
    local data = require "moe.data"
    local prefix = data.preprocess { inputs = { txt }, output_prefix = dir .. "/corpus" }
    local exe = (os.getenv("MOE_BUILD_DIR") or "build") .. "/moe-lua"
    local cmd = q(exe) .. " train"
    for _, a in ipairs(args) do cmd = cmd .. " " .. q(a) end
    for _, a in ipairs({ "data=" .. prefix, "model.vocab_size=257", "out_dir=" .. dir .. "/out", "steps=1",
      "warmup=0", "seq_len=32", "batch_size=2", "grad_accum=1", "model.n_layers=2", "model.d_model=64",
      "model.n_heads=2", "model.moe.ffn_hidden_size=128", "model.moe.num_experts=8", "parallel.ep=1",
      "eval_every=0", "save_every=0", "log_every=1", "eval_iters=1", "sample_tokens=0", "valid_fraction=0.1",
      "device=cpu" }) do
      cmd = cmd .. " " .. q(a)
    end
    local p = assert(io.popen(cmd .. " 2>&1; echo rc=$?"))
    local out = p:read("a")
    p:close()
    assert.truthy(out:find("rc=0\n$"), out)
    assert.truthy(out:find("iteration 1/1", 1, true), out)
    local recs = require("moe.metrics").read_jsonl(dir .. "/out/metrics.jsonl")
    assert.is_true(#recs >= 1)
    assert.is_true(recs[1].loss == recs[1].loss and recs[1].loss > 0, tostring(recs[1].loss))
    os.execute("rm -rf " .. q(dir))
  end)
end)

describe("user docs", function()
  it("carry no internal issue numbers", function()
    local files = lines_of("cd " .. q(root) .. " && ls README.md docs/*.md")
    assert.is_true(#files > 5)
    local bad = {}
    for _, f in ipairs(files) do
      local n = 0
      for line in io.lines(root .. "/" .. f) do
        n = n + 1
        if line:lower():find("issue[s']*%s*#?%d") or line:lower():find("the issue's") then
          bad[#bad + 1] = f .. ":" .. n .. ": " .. line
        end
      end
    end
    assert.are.same({}, bad)
  end)
end)
