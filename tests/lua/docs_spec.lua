--[[
tests/lua/docs_spec.lua - the reference docs stay complete:
  - docs/API.md mentions every name the `moe` module exports: its functions,
    the functions of its tables (moe.ops, moe.cuda, moe.dist, ...; names
    starting with "_" are private) and the tensor methods, enumerated from
    the loaded module;
  - docs/ENVIRONMENT.md lists every MOE_* environment variable the source
    tree reads (getenv / os.getenv, the kernel knob table, $MOE_* in the CI
    scripts);
  - the user docs (README.md, docs/*.md) carry no internal issue numbers.
Run from the repository root (ctest does).
]]
local moe = require "moe"

local root = (debug.getinfo(1, "S").source:match("^@(.*)/tests/lua/[^/]*$")) or "."

local function read(path)
  local f = assert(io.open(path, "rb"), "cannot open " .. path)
  local s = f:read("a")
  f:close()
  return s
end

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
