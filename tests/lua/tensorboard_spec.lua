--[[
tests/lua/tensorboard_spec.lua - moe.tensorboard: crc32c against published
check values, the TFRecord framing and Event protobuf read back by the Lua
reader in the module (tags, steps, values, both CRCs of every record),
corruption detected, argument errors; and, where Python's `tensorboard`
package is installed, TensorBoard's own readers:
tests/python/check_tensorboard.py reads the file written here (the recipe is
written in both files).

Without Python's tensorboard the client test is pending with a line
"SKIPPED (no python tensorboard): ..."; with the environment variable CI set
it fails instead. The Python used is $MOE_PYTHON, else the venv .ci/deps
makes (~/.cache/moe-lua/pyvenv), else python3.
]]
local tb = require "moe.tensorboard"

local function sh_quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

local root = os.tmpname()
os.remove(root)
assert(os.execute("mkdir -p " .. sh_quote(root)))

local spec_dir = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests/lua"
local checker = spec_dir .. "/../python/check_tensorboard.py"

local function find_python()
  local home = os.getenv("XDG_CACHE_HOME") or ((os.getenv("HOME") or "/root") .. "/.cache")
  local tried = {}
  for _, py in ipairs({ os.getenv("MOE_PYTHON") or false, home .. "/moe-lua/pyvenv/bin/python3", "python3" }) do
    if py then
      if os.execute(sh_quote(py) .. ' -c "import tensorboard, numpy" >/dev/null 2>&1') then return py end
      tried[#tried + 1] = py
    end
  end
  return nil, "no 'import tensorboard, numpy' in " .. table.concat(tried, ", ")
end

local function f32(x) return (string.unpack("<f", string.pack("<f", x))) end

-- The recipe shared with check_tensorboard.py (expected() there).
local function write_recipe(w)
  for step = 1, 20 do
    w:add_scalar("loss", 5.0 / step, step)
    w:add_scalar("lr", 1e-3 * step, step)
    if step % 5 == 0 then
      local loads = {}
      for j = 0, 3 do loads[("expert_load/layer0/e%d"):format(j)] = (j + 1) / 10.0 end
      w:add_scalars(step, { val_loss = 4.0 / step + 0.25 })
      w:add_scalars(step, loads)
    end
  end
  w:add_scalar("big_step", -1.5, (1 << 40) + 3)
end

local function single_file(dir)
  local p = io.popen("ls -1 " .. sh_quote(dir))
  local names = {}
  for n in p:lines() do names[#names + 1] = n end
  p:close()
  assert.are.equal(1, #names)
  return dir .. "/" .. names[1]
end

describe("tensorboard", function()
  it("computes crc32c (Castagnoli) check values", function()
    assert.are.equal(0xE3069283, tb.crc32c("123456789"))
    assert.are.equal(0, tb.crc32c(""))
    assert.are.equal(0x8A9136AA, tb.crc32c(string.rep("\0", 32)))
    assert.are.equal(0x62A8AB43, tb.crc32c(string.rep("\255", 32)))
  end)

  it("frames records as TFRecord: length, masked CRCs, data", function()
    local r = tb.record("abc")
    assert.are.equal(8 + 4 + 3 + 4, #r)
    assert.are.equal(3, string.unpack("<I8", r))
    assert.are.equal(tb.masked_crc32c(r:sub(1, 8)), string.unpack("<I4", r, 9))
    assert.are.equal("abc", r:sub(13, 15))
    local crc = tb.crc32c("abc")
    assert.are.equal((((crc >> 15) | (crc << 17)) + 0xa282ead8) & 0xFFFFFFFF, string.unpack("<I4", r, 16))
  end)

  it("round-trips the recipe through the Lua reader", function()
    local dir = root .. "/roundtrip"
    local w = tb.writer(dir)
    write_recipe(w)
    w:close()
    local evs = tb.read(single_file(dir))
    assert.are.equal("brain.Event:2", evs[1].file_version)
    assert.are.equal(0, #evs[1].values)
    assert.is_true(evs[1].wall_time > 1.6e9)
    local got = {}
    for i = 2, #evs do
      for _, v in ipairs(evs[i].values) do
        got[v.tag] = got[v.tag] or {}
        table.insert(got[v.tag], { evs[i].step, v.value })
      end
    end
    assert.are.equal(20, #got.loss)
    assert.are.same({ 7, f32(5.0 / 7) }, got.loss[7])
    assert.are.same({ 20, f32(0.02) }, got.lr[20])
    assert.are.same({ { 5, f32(4.0 / 5 + 0.25) }, { 10, f32(0.65) }, { 15, f32(4.0 / 15 + 0.25) },
      { 20, f32(0.45) } }, got.val_loss)
    assert.are.same({ 10, f32(0.3) }, got["expert_load/layer0/e2"][2])
    assert.are.same({ { (1 << 40) + 3, -1.5 } }, got.big_step)
    -- one event per add_scalars call, its tags sorted
    local multi = evs[#evs - 1]
    assert.are.equal(4, #multi.values)
    assert.are.equal("expert_load/layer0/e0", multi.values[1].tag)
  end)

  it("detects corrupt and truncated files", function()
    local dir = root .. "/corrupt"
    local w = tb.writer(dir)
    w:add_scalar("loss", 1.0, 1)
    w:close()
    local path = single_file(dir)
    local f = assert(io.open(path, "rb"))
    local s = f:read("a")
    f:close()
    local function write(bytes)
      local g = assert(io.open(path, "wb")); g:write(bytes); g:close()
    end
    write(s:sub(1, -2) .. string.char((s:byte(-1) + 1) % 256)) -- last data CRC byte
    assert.has_error(function() tb.read(path) end)
    local ok, err = pcall(tb.read, path)
    assert.is_false(ok)
    assert.matches("data CRC mismatch", err)
    write(s:sub(1, -3))
    ok, err = pcall(tb.read, path)
    assert.is_false(ok)
    assert.matches("truncated record", err)
    local n = #s - 30 -- flip a byte in the second record's length
    write(s:sub(1, n - 1) .. string.char(s:byte(n) ~ 1) .. s:sub(n + 1))
    ok, err = pcall(tb.read, path)
    assert.is_false(ok)
    assert.matches("CRC mismatch", err)
  end)

  it("checks its arguments", function()
    local w = tb.writer(root .. "/args")
    assert.has_error(function() w:add_scalar("", 1, 1) end,
      "bad argument #1 to 'add_scalar' (tag must be a non-empty string, got string)")
    assert.has_error(function() w:add_scalar("x", "1", 1) end,
      "bad argument #2 to 'add_scalar' (number expected for 'x', got string)")
    assert.has_error(function() w:add_scalar("x", 1, 1.5) end,
      "bad argument #3 to 'add_scalar' (integer step expected, got 1.5)")
    w:close()
    assert.has_error(function() w:add_scalar("x", 1, 1) end)
    assert.has_error(function() tb.writer("") end,
      "bad argument #1 to 'tensorboard.writer' (directory name expected, got string)")
  end)

  local python, no_python = find_python()
  local client = (python or os.getenv("CI")) and it or pending
  client(python and "is read back by TensorBoard's own readers (tests/python/check_tensorboard.py)"
    or ("SKIPPED (no python tensorboard): " .. tostring(no_python)), function()
    assert.is_not_nil(python, no_python)
    local dir = root .. "/python"
    local w = tb.writer(dir)
    write_recipe(w)
    w:close()
    local p = io.popen(sh_quote(python) .. " " .. sh_quote(checker) .. " " .. sh_quote(dir) .. " 2>&1; echo rc=$?")
    local out = p:read("a")
    p:close()
    io.write("\n-- " .. checker .. " (" .. python .. ")\n" .. out)
    assert.matches("EventAccumulator: 8 scalar tags match", out)
    assert.matches("rc=0", out)
  end)
end)

describe("cleanup", function()
  it("removes the spec's folder", function()
    assert.is_true(os.execute("rm -rf " .. sh_quote(root)))
  end)
end)
