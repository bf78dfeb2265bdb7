--[[
tests/lua/checkpoint_reader_spec.lua - reading parts of safetensors files
(moe.open_safetensors, core/moe_io.h moe_safetensors_read_box) and what
sharded checkpoints (moe/train/dcp.lua) read with it: the values of boxes,
flat ranges and views against the whole tensor; the bytes read counted
(header, then only the box's); a rank's rows of a big tensor loaded from a
checkpoint read fewer bytes than its files hold; the errors. And the extra
files (a tokenizer's) of a sharded checkpoint: written at the commit,
listed in state.json and digests.txt, checked by read_state.
]]
local moe = require "moe"
local dcp = require "moe.train.dcp"
local checkpoint = require "moe.checkpoint"

local function q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end
local root = os.tmpname()
os.remove(root)
os.execute("mkdir -p " .. q(root))

local function equal(a, b)
  if #a.shape ~= #b.shape then return false end
  for i = 1, #a.shape do if a.shape[i] ~= b.shape[i] then return false end end
  return a:numel() == 0 or (a:double() - b:double()):abs():max():item() == 0
end
local function box(t, off, size)
  local v = t
  for d = 1, #off do v = v:narrow(d - 1, off[d], size[d]) end
  return v:contiguous()
end
local function size_of(path)
  local f = assert(io.open(path, "rb"))
  local n = f:seek("end")
  f:close()
  return n
end

-- (2, 3, 4, 5): values 0 .. 119 in row-major order
local T = moe.arange(0, 120, 1, { dtype = "f32" }):reshape({ 2, 3, 4, 5 })
local I = moe.arange(0, 6, 1, { dtype = "i64" })
local file = root .. "/t.safetensors"
moe.save(file, { t = T, i = I }, { step = "3" })

describe("moe.open_safetensors", function()
  it("reads the header only, then boxes, flat ranges and views, counting the bytes", function()
    local r <close> = moe.open_safetensors(file)
    local e = r:entries()
    assert.are.same({ 2, 3, 4, 5 }, e.t.shape)
    assert.are.equal("f32", e.t.dtype)
    assert.are.equal(480, e.t.offsets[2] - e.t.offsets[1])
    assert.are.same({ step = "3" }, r:metadata())
    local header = r:bytes_read()
    assert.are.equal(e.i.offsets[1] < e.t.offsets[1] and e.i.offsets[1] or e.t.offsets[1], header)
    -- a box: 1 x 2 x 3 x 2 floats, in 6 runs of 2
    local b = r:read("t", { offsets = { 1, 1, 0, 2 }, sizes = { 1, 2, 3, 2 } })
    assert.is_true(equal(b, box(T, { 1, 1, 0, 2 }, { 1, 2, 3, 2 })))
    local bytes, reads = r:bytes_read()
    assert.are.equal(header + 48, bytes)
    assert.are.equal(2 + 6, reads)
    -- whole trailing dims: one run
    b = r:read("t", { offsets = { 1, 1, 0, 0 }, sizes = { 1, 2, 4, 5 } })
    assert.is_true(equal(b, box(T, { 1, 1, 0, 0 }, { 1, 2, 4, 5 })))
    local bytes2, reads2 = r:bytes_read()
    assert.are.same({ bytes + 160, reads + 1 }, { bytes2, reads2 })
    -- a flat range, and a box of a view of elements [60, 120) as (3, 4, 5)
    b = r:read("t", { shape = { 120 }, offsets = { 7 }, sizes = { 11 } })
    assert.is_true(equal(b, T:reshape({ 120 }):narrow(0, 7, 11)))
    b = r:read("t", { shape = { 3, 4, 5 }, base = 60, offsets = { 0, 1, 0 }, sizes = { 3, 2, 5 } })
    assert.is_true(equal(b, box(T:select(0, 1), { 0, 1, 0 }, { 3, 2, 5 })))
    -- whole tensors, an empty box (nothing read), a scalar view
    assert.is_true(equal(r:read("t"), T))
    assert.is_true(equal(r:read("i"), I))
    local before = r:bytes_read()
    assert.are.equal(0, r:read("t", { offsets = { 0, 0, 0, 0 }, sizes = { 2, 0, 4, 5 } }):numel())
    assert.are.equal(before, r:bytes_read())
    assert.are.equal(4, r:read("i", { shape = {}, base = 4 }):item())
  end)

  it("refuses boxes outside the tensor, unknown names and a closed reader, naming them", function()
    local r = moe.open_safetensors(file)
    local function err(...)
      local ok, e = pcall(r.read, r, ...)
      assert.is_false(ok)
      return tostring(e)
    end
    assert.truthy(err("t", { offsets = { 0, 0, 0, 4 }, sizes = { 1, 1, 1, 2 } }):find(
      "tensor 't': box at [0, 0, 0, 4] of sizes [1, 1, 1, 2] is outside [2, 3, 4, 5] (dim 3)", 1, true))
    assert.truthy(err("t", { shape = { 200 } }):find("has 120 elements: a view [200] at element 0 does not fit", 1, true))
    assert.truthy(err("t", { shape = { 10 }, base = 111 }):find("a view [10] at element 111 does not fit", 1, true))
    assert.truthy(err("zz"):find("the file has no tensor 'zz'", 1, true))
    assert.truthy(err("t", { offsets = { 0 } }):find("give box.offsets and box.sizes together", 1, true))
    assert.truthy(err("t", { offsets = { 0 }, sizes = { 1 } }):find("need 4 items", 1, true))
    assert.truthy(err("t", { offsets = { 0, 0, 0, "a" }, sizes = { 1, 1, 1, 1 } }):find("box.offsets[4] must be an integer",
      1, true))
    assert.truthy(err("t", { size = { 1 } }):find("unknown option 'size'", 1, true))
    r:close()
    r:close() -- again: nothing
    assert.truthy(err("t"):find("attempt to use a closed safetensors reader", 1, true))
    local ok, e = pcall(moe.open_safetensors, root .. "/none.safetensors")
    assert.is_false(ok)
    assert.truthy(tostring(e):find("open_safetensors: '" .. root .. "/none.safetensors': cannot open", 1, true), e)
    -- a truncated file: the header's check, as load's
    local g = assert(io.open(file, "rb"))
    local bytes = g:read("a")
    g:close()
    g = assert(io.open(root .. "/cut.safetensors", "wb"))
    g:write(bytes:sub(1, #bytes - 8))
    g:close()
    ok, e = pcall(moe.open_safetensors, root .. "/cut.safetensors")
    assert.is_false(ok)
    assert.truthy(tostring(e):find("truncated file", 1, true), e)
  end)
end)

describe("dcp: loading reads only what a rank needs", function()
  it("loads a rank's rows of a big tensor reading fewer bytes than the files hold", function()
    -- saved by two "ranks" (rows [0, 32) and [32, 64) of a (64, 256) tensor, and a
    -- flat-range optimizer state), loaded onto four: each reads about a quarter
    local W = moe.arange(0, 64 * 256, 1, { dtype = "f32" }):reshape({ 64, 256 })
    local S = moe.arange(0, 1000, 1, { dtype = "f32" })
    local dir = root .. "/big"
    local savers = {}
    for r = 1, 0, -1 do
      local s = dcp.Saver { out_dir = dir, rank = r, world = 2 }
      savers[r] = s
      s:save(1, {
        { name = "model.w", shape = { 64, 256 }, dtype = "f32", tensor = W:narrow(0, 32 * r, 32):contiguous(),
          place = { rows = { 32 * r, 32 * (r + 1) } }, write = true },
        { name = "optim.s", shape = { 1000 }, dtype = "f32", tensor = S:narrow(0, 600 * r, r == 0 and 600 or 400):contiguous(),
          place = { flat = { 600 * r, r == 0 and 600 or 1000 } }, write = true },
      }, {}, r == 0 and {} or nil)
    end
    local path = savers[0].last
    local total = size_of(path .. "/shard-0.safetensors") + size_of(path .. "/shard-1.safetensors")
    for q4 = 0, 3 do
      local w = moe.zeros({ 16, 256 })
      local s = moe.zeros({ 250 })
      local _, stats = dcp.load_pieces(path, {
        { name = "model.w", shape = { 64, 256 }, tensor = w, place = { rows = { 16 * q4, 16 * (q4 + 1) } } },
        { name = "optim.s", shape = { 1000 }, tensor = s, place = { flat = { 250 * q4, 250 * (q4 + 1) } } },
      })
      assert.is_true(equal(w, W:narrow(0, 16 * q4, 16)), "rows of rank " .. q4)
      assert.is_true(equal(s, S:narrow(0, 250 * q4, 250)), "flat range of rank " .. q4)
      local need = (16 * 256 + 250) * 4
      -- the bytes of its parts, plus the headers of the files it opened
      assert.truthy(stats.bytes >= need and stats.bytes < need + 2 * 1024, ("rank %d read %d bytes for %d"):format(
        q4, stats.bytes, need))
      assert.truthy(stats.bytes < total / 3, ("rank %d read %d of %d bytes"):format(q4, stats.bytes, total))
      assert.are.same(stats, dcp.last_load)
    end
    -- one rank with everything reads every byte of the data once
    local w, s = moe.zeros({ 64, 256 }), moe.zeros({ 1000 })
    local _, stats = dcp.load_pieces(path, {
      { name = "model.w", shape = { 64, 256 }, tensor = w, place = { full = true } },
      { name = "optim.s", shape = { 1000 }, tensor = s, place = { full = true } },
    })
    assert.is_true(equal(w, W) and equal(s, S))
    assert.truthy(stats.bytes <= total and stats.bytes >= (64 * 256 + 1000) * 4, stats.bytes)
    assert.are.equal(2, stats.files)
  end)
end)

describe("dcp: extra files (the tokenizer's)", function()
  it("are written at the commit, listed in state.json and digests.txt, and checked by read_state", function()
    local dir = root .. "/extra"
    local s = dcp.Saver { out_dir = dir, rank = 0, world = 1 }
    local piece = { name = "model.w", shape = { 3 }, dtype = "f32", tensor = moe.ones({ 3 }), place = { full = true },
      write = true }
    s:save(2, { piece }, {}, { tokenizer = { kind = "bpe" }, files = { ["tokenizer.bpe"] = "merges\n", ["a.txt"] = "x" } })
    local path = s.last
    local f = assert(io.open(path .. "/tokenizer.bpe", "rb"))
    assert.are.equal("merges\n", f:read("a"))
    f:close()
    local st = dcp.read_state(path, 0, 1)
    assert.are.same({ "a.txt", "tokenizer.bpe" }, st.files)
    local d = checkpoint.read_digests(path)
    assert.truthy(d["tokenizer.bpe"] and d["a.txt"])
    assert.is_true(checkpoint.verify(path))
    -- a changed file: read_state names it
    f = assert(io.open(path .. "/tokenizer.bpe", "wb"))
    f:write("merged\n")
    f:close()
    local ok, err = pcall(dcp.read_state, path, 0, 1)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("'" .. path .. "/tokenizer.bpe' is corrupt: its digest is", 1, true), err)
    os.remove(path .. "/tokenizer.bpe")
    ok, err = pcall(dcp.read_state, path, 0, 1)
    assert.is_false(ok)
    assert.truthy(tostring(err):find(path .. "/tokenizer.bpe", 1, true), err)
    -- names of the checkpoint's own files are refused
    for _, bad in ipairs({ "state.json", "shard-0.safetensors", "index.json", "../x", "digests.txt" }) do
      local s2 = dcp.Saver { out_dir = root .. "/extra2", rank = 0, world = 1 }
      ok, err = pcall(s2.save, s2, 1, { piece }, {}, { files = { [bad] = "x" } })
      assert.is_false(ok, bad)
      assert.truthy(tostring(err):find("bad extra file name '" .. bad .. "'", 1, true), err)
    end
  end)
end)

teardown(function() os.execute("rm -rf " .. q(root)) end)
