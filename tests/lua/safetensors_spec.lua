--[[
tests/lua/safetensors_spec.lua - moe.save and moe.load (safetensors files):
round trips of every dtype, strided views, empty tensors, scalars and
metadata; argument and file errors; and, where Python's `safetensors` and
numpy are installed, the real client: tests/python/check_safetensors.py loads
what moe.save wrote (values built here and there from the same recipe),
compares a small file byte for byte with the library's own, and writes a file
that moe.load must read back.

Without Python's safetensors the client test is marked pending with a line
"SKIPPED (no python safetensors): ..."; with the environment variable CI set
(.ci/deps installs it) it fails instead. The Python used is $MOE_PYTHON, else
the venv .ci/deps makes (~/.cache/moe-lua/pyvenv), else python3.
]]
local moe = require "moe"

local function sh_quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

local dir = os.tmpname() -- a fresh name; made a folder below
os.remove(dir)
assert(os.execute("mkdir -p " .. sh_quote(dir)))
local function P(name) return dir .. "/" .. name end

local spec_dir = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests/lua"
local checker = spec_dir .. "/../python/check_safetensors.py"

-- A Python that has safetensors and numpy, or nil and why not.
local function find_python()
  local home = os.getenv("XDG_CACHE_HOME") or ((os.getenv("HOME") or "/root") .. "/.cache")
  local tried = {}
  for _, py in ipairs({ os.getenv("MOE_PYTHON") or false, home .. "/moe-lua/pyvenv/bin/python3", "python3" }) do
    if py then
      if os.execute(sh_quote(py) .. ' -c "import safetensors, numpy" >/dev/null 2>&1') then return py end
      tried[#tried + 1] = py
    end
  end
  return nil, "no 'import safetensors, numpy' in " .. table.concat(tried, ", ")
end

local python, no_python = find_python()

-- The recipe shared with check_safetensors.py (EXPECTED there).
local FLOATS = { { -1.25, -0.75, -0.25 }, { 0.25, 0.75, 1.25 } }
local INTS = { { -2, -1, 0 }, { 1, 2, 3 } }
local META = { format = "pt", source = "moe-lua", note = 'ünïcødé "quoted"\n' }

local function recipe(with_bf16)
  local t = {}
  for _, dt in ipairs({ "f32", "f64", "bf16", "f16" }) do t["t_" .. dt] = moe.tensor(FLOATS, { dtype = dt }) end
  for _, dt in ipairs({ "i8", "i32", "i64" }) do t["t_" .. dt] = moe.tensor(INTS, { dtype = dt }) end
  t.t_u8 = moe.tensor({ { 0, 50, 100 }, { 150, 200, 250 } }, { dtype = "u8" })
  t.t_bool = moe.tensor({ { false, true, false }, { true, false, true } }, { dtype = "bool" })
  t.transposed = moe.arange(12, { dtype = "f32" }):view(3, 4):transpose(0, 1)
  t.sliced = moe.arange(20, { dtype = "i32" }):slice(0, 1, 20, 3)
  t.expanded = moe.tensor({ { 7 }, { -8 } }, { dtype = "i64" }):expand(2, 5)
  t.empty = moe.zeros({ 0, 3 })
  t.scalar = moe.full({}, 3.25, { dtype = "f64" })
  if not with_bf16 then t.t_bf16 = nil end
  return t
end

local function assert_same(name, want, got)
  assert(got ~= nil, name .. " is missing")
  assert.are.equal(want.dtype, got.dtype, name)
  assert.are.same(want.shape, got.shape, name)
  assert.are.same(want:totable(), got:totable(), name)
end

local function count(t)
  local n = 0
  for _ in pairs(t) do n = n + 1 end
  return n
end

local read_all = dofile(spec_dir .. "/read_file.lua")

lazy_teardown(function() os.execute("rm -rf " .. sh_quote(dir)) end)

describe("moe.save / moe.load", function()
  it("round-trip every dtype, strided views, empty tensors, scalars and metadata", function()
    local t = recipe(true)
    assert.is_false(t.transposed:is_contiguous())
    assert.is_nil(moe.save(P("all.safetensors"), t, META))
    local got, meta = moe.load(P("all.safetensors"))
    assert.are.equal(count(t), count(got))
    for name, want in pairs(t) do
      assert_same(name, want, got[name])
      assert.is_true(got[name]:is_contiguous())
    end
    assert.are.same(META, meta)
    -- the saved tensors are untouched and the loaded ones are new
    assert.are.same({ { 0, 4, 8 }, { 1, 5, 9 }, { 2, 6, 10 }, { 3, 7, 11 } }, t.transposed:totable())
    got.t_f32:fill_(0)
    assert.are.same(FLOATS, t.t_f32:totable())
    assert.are.equal(0, got.scalar:dim())
    assert.are.equal(3.25, got.scalar:item())
    for _, x in pairs(got) do x:free() end
    for _, x in pairs(t) do x:free() end
  end)

  it("save no metadata, and load returns an empty metadata table", function()
    local x = moe.ones(3)
    moe.save(P("plain.safetensors"), { x = x })
    local got, meta = moe.load(P("plain.safetensors"), { device = "cpu" })
    assert.are.same({}, meta)
    assert.are.same({ 1, 1, 1 }, got.x:totable())
    moe.save(P("none.safetensors"), {})
    got, meta = moe.load(P("none.safetensors"))
    assert.are.same({}, got)
    assert.are.same({}, meta)
    -- the header of a known small file, byte for byte
    moe.save(P("small.safetensors"), { a = moe.tensor({ 1, 2 }, { dtype = "f32" }) })
    local s = read_all(P("small.safetensors"))
    assert.are.equal('8\0\0\0\0\0\0\0{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}  ', s:sub(1, 64))
    assert.are.equal("\0\0\128\63\0\0\0\64", s:sub(65))
  end)

  it("give clear errors for bad arguments", function()
    local x = moe.ones(2)
    assert.error_matches(function() moe.save(1, { x = x }) end,
      "bad argument #1 to 'save' %(path must be a string, got number%)")
    assert.error_matches(function() moe.save(P("e"), x) end,
      "bad argument #2 to 'save' %(table of tensors expected %({name = tensor, ...}%), got tensor%)")
    assert.error_matches(function() moe.save(P("e"), { x = 3 }) end,
      "bad argument #2 to 'save' %(tensors%['x'%] must be a tensor, got number%)")
    assert.error_matches(function() moe.save(P("e"), { x }) end,
      "bad argument #2 to 'save' %(tensor names must be strings, got a number key %(1%)%)")
    assert.error_matches(function() moe.save(P("e"), { [""] = x }) end,
      "bad argument #2 to 'save' %(tensor names must be non%-empty strings%)")
    assert.error_matches(function() moe.save(P("e"), { __metadata__ = x }) end,
      "save: '__metadata__' is reserved")
    assert.error_matches(function() moe.save(P("e"), { x = x }, { step = 100 }) end,
      "bad argument #3 to 'save' %(metadata%['step'%] must be a string, got number%)")
    assert.error_matches(function() moe.save(P("e"), { x = x }, "meta") end,
      "bad argument #3 to 'save' %(metadata table expected")
    assert.error_matches(function() moe.save(P("e"), { x = x }, nil, 4) end,
      "bad argument #4 to 'save' %(unexpected extra argument")
    assert.error_matches(function() moe.load() end, "bad argument #1 to 'load' %(path must be a string, got no value%)")
    assert.error_matches(function() moe.load(P("e"), { device = "tpu" }) end, "bad argument #2 to 'load' %(device 'tpu'")
    assert.error_matches(function() moe.load(P("e"), { dtype = "f32" }) end,
      "bad argument #2 to 'load' %(unknown option 'dtype' %(valid options: device%)%)")
    assert.error_matches(function() moe.load(P("e"), "cuda") end, "bad argument #2 to 'load' %(options table expected")
    local y = moe.ones(2)
    y:free()
    assert.error_matches(function() moe.save(P("e"), { y = y }) end, "tensors%['y'%] is a freed tensor")
    x:free()
  end)

  it("give clear errors for bad files and keep an existing file on a failed save", function()
    local missing = P("missing.safetensors")
    assert.has_error(function() moe.load(missing) end,
      "load: '" .. missing .. "': cannot open: No such file or directory")
    local f = assert(io.open(P("bad.safetensors"), "wb"))
    f:write("\15\0\0\0\0\0\0\0{\"a\":{\"dtype\"}}")
    f:close()
    assert.error_matches(function() moe.load(P("bad.safetensors")) end,
      "invalid JSON in the header at byte 13 %(file byte 21%): expected ':' after the key \"dtype\"")
    f = assert(io.open(P("short.safetensors"), "wb"))
    f:write("\1\2\3")
    f:close()
    assert.error_matches(function() moe.load(P("short.safetensors")) end, "shorter than the 8%-byte header length")

    local x = moe.arange(4, { dtype = "f32" })
    moe.save(P("keep.safetensors"), { x = x })
    local before = read_all(P("keep.safetensors"))
    assert.error_matches(function() moe.save(P("no/such/dir/keep.safetensors"), { x = x }) end,
      "save: cannot create '.*no/such/dir/keep.safetensors.tmp.%d+': No such file or directory")
    assert.error_matches(function() moe.save(P("keep.safetensors"), { x = x, ["__metadata__"] = x }) end, "reserved")
    assert.are.equal(before, read_all(P("keep.safetensors")))
    -- no temporary file left behind
    local p = io.popen("ls -a " .. sh_quote(dir))
    local listing = p:read("a")
    p:close()
    assert.is_nil(listing:find(".tmp.", 1, true))
    if not moe.cuda.is_available() then
      assert.error_matches(function() moe.load(P("keep.safetensors"), { device = "cuda" }) end, "cuda")
    end
    x:free()
  end)

  it("a crafted header cannot make the loader use memory far beyond its size", function()
    local exe = (os.getenv("MOE_BUILD_DIR") or "build") .. "/moe-lua"
    -- peak RSS (VmHWM, kB) of a child moe-lua that loads path (or nothing), and its error
    local function peak_kb(path)
      local script = (path and ("pcall(require('moe').load, %q); "):format(path) or "") ..
        "for l in io.lines('/proc/self/status') do local k = l:match('^VmHWM:%s+(%d+)') " ..
        "if k then print(k) end end"
      local out = io.popen(sh_quote(exe) .. " -e " .. sh_quote(script) .. " 2>&1"):read("a")
      return assert(math.tointeger(tonumber(out:match("(%d+)"))), out)
    end
    local function header_file(name, body)
      body = body .. (" "):rep((8 - #body % 8) % 8)
      local f = assert(io.open(P(name), "wb"))
      f:write(string.pack("<I8", #body), body)
      f:close()
      return #body
    end
    local MB = 16 * 1000 * 1000
    -- a list of 8M zeros: refused at its 65th item
    local n = header_file("list.safetensors", '{"x":{"dtype":"F32","shape":[' .. ("0,"):rep(MB // 2) .. '0]}}')
    assert.error_matches(function() moe.load(P("list.safetensors")) end, "a list of more than 64 items")
    -- an object of 1.6M members "k":0, parsed whole before its first entry is refused
    local parts = {}
    for i = 1, MB // 10 do parts[i] = ('"%x":0'):format(i) end
    local m = header_file("members.safetensors", "{" .. table.concat(parts, ",") .. "}")
    parts = nil -- luacheck: ignore 311 (let the collector have the list)
    assert.error_matches(function() moe.load(P("members.safetensors")) end, "the entry must be an object")
    -- AddressSanitizer's redzones and quarantine double the heap: no bound to check there
    local maps = io.open("/proc/self/maps")
    local asan = maps and maps:read("a"):find("libasan", 1, true)
    if maps then maps:close() end
    if asan then return end
    local base = peak_kb(nil)
    local list_kb, members_kb = peak_kb(P("list.safetensors")) - base, peak_kb(P("members.safetensors")) - base
    -- the header itself (1x) and the parsed tree: about 16 (list) and 130 (members) MB
    -- before the bound, 0 and 8x now (tree: 32 bytes a value + 8 a key + 16 for the duplicate check)
    assert.is_true(list_kb * 1000 < 3 * n, ("list: %d kB for a %d-byte header"):format(list_kb, n))
    assert.is_true(members_kb * 1000 < 11 * m, ("members: %d kB for a %d-byte header"):format(members_kb, m))
    os.remove(P("list.safetensors"))
    os.remove(P("members.safetensors"))
  end)

  it("load onto cuda when a GPU is visible", function()
    if not moe.cuda.is_available() then
      print("SKIPPED (no CUDA GPU): moe.load onto cuda")
      return
    end
    local x = moe.arange(12, { dtype = "f32", device = "cuda" }):view(3, 4):transpose(0, 1)
    local s = moe.full({}, 2.5, { dtype = "bf16", device = "cuda" })
    moe.save(P("cuda.safetensors"), { x = x, s = s })
    local got = moe.load(P("cuda.safetensors"), { device = "cuda" })
    assert.are.equal("cuda:0", got.x.device)
    assert.are.same(x:totable(), got.x:totable())
    assert.are.equal("bf16", got.s.dtype)
    assert.are.equal(2.5, got.s:item())
    local cpu = moe.load(P("cuda.safetensors"))
    assert.are.equal("cpu", cpu.x.device)
    assert.are.same(x:totable(), cpu.x:totable())
  end)
end)

local function client_test()
  local t = recipe(true)
  moe.save(P("moe_all.safetensors"), t, META)
  t.t_bf16 = nil
  moe.save(P("moe_nobf16.safetensors"), t, META)
  moe.save(P("exact.safetensors"), {
    a = moe.arange(6, { dtype = "f32" }):view(2, 3),
    b = moe.tensor({ 1, -2 }, { dtype = "i64" }),
    c = moe.tensor({ 0.5 }, { dtype = "f16" }),
    d = moe.tensor({ true, false, true }, { dtype = "bool" }),
  }, { format = "pt" })
  local p = io.popen(sh_quote(python) .. " " .. sh_quote(checker) .. " " .. sh_quote(dir) .. " 2>&1")
  local out = p:read("a")
  local ok = p:close()
  io.write("\n-- " .. checker .. " (" .. python .. ")\n" .. out)
  assert(ok and out:find("\nOK\n$"), "check_safetensors.py failed:\n" .. out)

  local got, meta = moe.load(P("py.safetensors"))
  assert.are.equal("python safetensors", meta.writer)
  local function is(name, dtype, shape, values)
    assert(got[name], name .. " is missing")
    assert.are.equal(dtype, got[name].dtype, name)
    assert.are.same(shape, got[name].shape, name)
    assert.are.same(values, got[name]:totable(), name)
  end
  is("p_f32", "f32", { 2, 3 }, { { 0, 1.5, 3 }, { 4.5, 6, 7.5 } })
  is("p_f64", "f64", { 2, 2 }, { { 0, 0.125 }, { 0.25, 0.375 } })
  is("p_f16", "f16", { 3 }, { 0.5, -2, 1024 })
  is("p_i8", "i8", { 3 }, { -128, 0, 127 })
  is("p_u8", "u8", { 2 }, { 0, 255 })
  is("p_i32", "i32", { 2 }, { -2147483648, 2147483647 })
  is("p_i64", "i64", { 2 }, { -(1 << 62), (1 << 53) + 1 })
  is("p_bool", "bool", { 2 }, { true, false })
  is("p_empty", "f32", { 3, 0 }, { {}, {}, {} })
  is("p_t", "i32", { 3, 2 }, { { 0, 3 }, { 1, 4 }, { 2, 5 } })
  assert.are.equal(0, got.p_scalar:dim())
  assert.are.equal(2.5, got.p_scalar:item())
  if meta.bf16 == "yes" then
    is("p_bf16", "bf16", { 3 }, { 1, -2, 0.5 })
    assert.are.equal(12, count(got))
  else
    print("py.safetensors has no p_bf16 (this safetensors cannot write BF16 from Python)")
    assert.are.equal(11, count(got))
  end
end

describe("the real safetensors client (Python)", function()
  local name = "reads what moe.save wrote, byte-identical headers, and writes what moe.load reads"
  if python then
    it(name, client_test)
  elseif os.getenv("CI") then
    it(name, function()
      error("python safetensors is required in CI (.ci/deps installs it): " .. no_python)
    end)
  else
    print("\nSKIPPED (no python safetensors): tests/lua/safetensors_spec.lua client test, " .. no_python)
    pending(name .. " (no python safetensors)")
  end
end)
