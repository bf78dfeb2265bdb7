--[[
tests/lua/dcp_spec.lua - moe/train/dcp.lua without MPI: two "ranks" are two
Savers of one process (rank 1 saves first, rank 0 commits), so the index,
the placements (whole, rows, flat ranges that straddle ranks, N-d boxes),
resharding between them, writing replicated tensors once, the atomic commit
and the errors are checked where LeakSanitizer runs. And moe.save_async,
the writer thread under asynchronous saves.
]]
local moe = require "moe"
local dcp = require "moe.train.dcp"
local checkpoint = require "moe.checkpoint"

local function q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end
local root = os.tmpname()
os.remove(root)

-- the global tensors: values i + 1 in row-major order
local A = moe.arange(0, 24, 1, { dtype = "f32" }):reshape({ 4, 6 }) + 1 -- (4, 6)
local B = moe.arange(0, 10, 1, { dtype = "f64" }) * 0.5               -- (10,)
local C = moe.arange(0, 12, 1, { dtype = "f32" }):reshape({ 2, 2, 3 })  -- (2, 2, 3)

local function box(t, off, size)
  local v = t
  for d = 1, #off do v = v:narrow(d - 1, off[d], size[d]) end
  return v:contiguous()
end
local function flat(t, a, b) return t:reshape({ -1 }):narrow(0, a, b - a):contiguous() end

-- what rank r holds on the "save" layout
local function save_pieces(r)
  local p = {}
  -- A: boxes (quadrants); rank 0 the top two, rank 1 the bottom two
  for _, c in ipairs({ { 0, 0 }, { 0, 3 } }) do
    local off = { c[1] + 2 * r, c[2] }
    p[#p + 1] = { name = "A", shape = { 4, 6 }, dtype = "f32", tensor = box(A, off, { 2, 3 }),
      place = { offsets = off, sizes = { 2, 3 } }, write = true }
  end
  -- B: flat ranges [0, 7) and [7, 10)
  local a, b = r == 0 and 0 or 7, r == 0 and 7 or 10
  p[#p + 1] = { name = "B", shape = { 10 }, dtype = "f64", tensor = flat(B, a, b), place = { flat = { a, b } },
    write = true }
  -- C: replicated (every rank holds it, the first writes it)
  p[#p + 1] = { name = "C", shape = { 2, 2, 3 }, dtype = "f32", tensor = C:clone(), place = { full = true },
    write = r == 0 }
  return p
end

local function save(dir, step, async)
  local s1 = dcp.Saver { out_dir = dir, rank = 1, world = 2, async = async }
  local s0 = dcp.Saver { out_dir = dir, rank = 0, world = 2, async = async, keep_last = 2 }
  s1:save(step, save_pieces(1), { rng = "r1" }, nil)
  s1:finish()
  s0:save(step, save_pieces(0), { rng = "r0" }, { config = { x = 1 } })
  return s0:finish() or s0.last
end

local function equal(a, b)
  return a:numel() == b:numel() and (a:double() - b:double()):abs():max():item() == 0
end

describe("dcp: sharded checkpoints", function()
  teardown(function() os.execute("rm -rf " .. q(root)) end)

  it("writes one index mapping every tensor to its shards", function()
    local path = save(root .. "/a", 3)
    assert.are.equal(root .. "/a/ckpt-3", path)
    local idx = dcp.read_index(path)
    assert.are.equal("moe-lua-dcp", idx.format)
    assert.are.equal(2, idx.world_size)
    assert.are.same({ 4, 6 }, idx.tensors.A.shape)
    assert.are.equal(4, #idx.tensors.A.shards)
    assert.are.same({ 2, 0 }, idx.tensors.A.shards[3].offsets)
    assert.are.same({ 2, 3 }, idx.tensors.A.shards[3].sizes)
    assert.are.equal("shard-1.safetensors", idx.tensors.A.shards[3].file)
    assert.are.same({ 7, 10 }, idx.tensors.B.shards[2].flat)
    assert.are.equal(1, #idx.tensors.C.shards) -- replicated: written once
    assert.is_true(idx.tensors.C.shards[1].full)
    local st = dcp.read_state(path, 1, 2)
    assert.are.equal("r1", st.rng)       -- this rank's own
    assert.are.equal("r0", dcp.read_state(path, 1, 4).rng) -- another world: rank 0's
    assert.are.equal(3, st.step)
    assert.are.same({ 3 }, checkpoint.list(root .. "/a"))
  end)

  it("loads onto other layouts: rows, flat ranges across boxes, boxes across flat ranges", function()
    local path = root .. "/a/ckpt-3"
    local layouts = {
      { name = "A", shape = { 4, 6 }, place = { full = true }, want = A },
      { name = "A", shape = { 4, 6 }, place = { rows = { 1, 3 } }, want = A:narrow(0, 1, 2) },
      { name = "A", shape = { 4, 6 }, place = { flat = { 5, 20 } }, want = flat(A, 5, 20) },
      { name = "A", shape = { 4, 6 }, place = { offsets = { 1, 2 }, sizes = { 3, 2 } }, want = box(A, { 1, 2 }, { 3, 2 }) },
      { name = "A", shape = { 4, 6 }, place = { flat = { 1, 4 } }, want = flat(A, 1, 4) },
      { name = "A", shape = { 4, 6 }, place = { flat = { 4, 23 } }, want = flat(A, 4, 23) },
      { name = "B", shape = { 10 }, place = { flat = { 3, 9 } }, want = flat(B, 3, 9) },
      { name = "B", shape = { 10 }, place = { rows = { 6, 8 } }, want = flat(B, 6, 8) },
      { name = "C", shape = { 2, 2, 3 }, place = { offsets = { 1, 0, 1 }, sizes = { 1, 2, 2 } },
        want = box(C, { 1, 0, 1 }, { 1, 2, 2 }) },
    }
    for i, l in ipairs(layouts) do
      local t = moe.zeros(l.want.shape, { dtype = l.name == "B" and "f64" or "f32" })
      dcp.load_pieces(path, { { name = l.name, shape = l.shape, tensor = t, place = l.place } })
      assert.is_true(equal(t, l.want), "layout " .. i)
    end
  end)

  it("splits a flat range into contiguous boxes", function()
    local bx = dcp.flat_boxes(4, 23, { 4, 6 })
    assert.are.same({ { offsets = { 0, 4 }, sizes = { 1, 2 }, start = 0 }, { offsets = { 1, 0 }, sizes = { 2, 6 }, start = 2 },
      { offsets = { 3, 0 }, sizes = { 1, 5 }, start = 14 } }, bx)
    local n = 0
    for _, b in ipairs(dcp.flat_boxes(3, 11, { 2, 2, 3 })) do n = n + b.sizes[1] * b.sizes[2] * b.sizes[3] end
    assert.are.equal(8, n)
  end)

  it("refuses what does not fit, naming the tensor", function()
    local path = root .. "/a/ckpt-3"
    local t = moe.zeros({ 5 })
    assert.has_error(function()
      dcp.load_pieces(path, { { name = "Z", shape = { 1 }, tensor = t, place = { full = true } } })
    end, "dcp: " .. path .. " has no tensor 'Z'")
    assert.has_error(function()
      dcp.load_pieces(path, { { name = "B", shape = { 11 }, tensor = t, place = { full = true } } })
    end, "dcp: 'B' is [10] in " .. path .. " but [11] here")
    -- a shard file gone: the index still names it
    os.execute("cp -r " .. q(path) .. " " .. q(root .. "/broken"))
    os.remove(root .. "/broken/shard-1.safetensors")
    local ok, err = pcall(dcp.load_pieces, root .. "/broken", { { name = "B", shape = { 10 }, tensor = moe.zeros({ 10 },
      { dtype = "f64" }), place = { full = true } } })
    assert.is_false(ok)
    assert.truthy(tostring(err):find("cannot read '" .. root .. "/broken/shard-1.safetensors'", 1, true), err)
  end)

  it("commits atomically: a save that fails before its commit leaves the previous one latest", function()
    local dir = root .. "/b"
    save(dir, 2)
    local s1 = dcp.Saver { out_dir = dir, rank = 1, world = 2 }
    s1:save(4, save_pieces(1), {}, nil) -- rank 1 wrote and is done
    local s0 = dcp.Saver { out_dir = dir, rank = 0, world = 2 }
    s0.fail_before_commit = true
    local ok, err = pcall(s0.save, s0, 4, save_pieces(0), {}, {})
    assert.is_false(ok)
    assert.truthy(tostring(err):find("failing before its commit", 1, true), err)
    assert.are.same({ 2 }, checkpoint.list(dir))
    assert.are.equal(dir .. "/ckpt-2", checkpoint.resolve(dir, "latest"))
    assert.are.same({ ".tmp-ckpt-4-dcp" }, checkpoint.remove_unfinished(dir))
    -- a rank that wrote no shard list: the commit refuses
    local s = dcp.Saver { out_dir = dir, rank = 0, world = 2 }
    ok, err = pcall(s.save, s, 6, save_pieces(0), {}, {})
    assert.is_false(ok)
    assert.truthy(tostring(err):find("checkpoint 6: rank 1 wrote no shard list", 1, true), err)
    assert.are.same({ 2 }, checkpoint.list(dir))
  end)

  it("saves asynchronously through moe.save_async, keeping the last keep_last", function()
    local dir = root .. "/c"
    for step = 1, 3 do save(dir, step, true) end
    assert.are.same({ 2, 3 }, checkpoint.list(dir))
    local t = moe.zeros({ 4, 6 })
    dcp.load_pieces(dir .. "/ckpt-3", { { name = "A", shape = { 4, 6 }, tensor = t, place = { full = true } } })
    assert.is_true(equal(t, A))
  end)

  it("reads a single-process checkpoint through a synthesized index", function()
    local path = checkpoint.save(root .. "/legacy", 5, { model = { w = A }, optim = { ["w.exp_avg"] = B },
      state = {} })
    local idx = dcp.read_index(path)
    assert.is_true(idx.legacy)
    local full = dcp.consolidate(path)
    assert.is_true(equal(full.w, A))
    local t = moe.zeros({ 2, 6 })
    dcp.load_pieces(path, { { name = "model.w", shape = { 4, 6 }, tensor = t, place = { rows = { 2, 4 } } } })
    assert.is_true(equal(t, A:narrow(0, 2, 2)))
  end)
end)

describe("moe.save_async", function()
  it("writes what moe.save writes, on a thread, and reports through wait", function()
    os.execute("mkdir -p " .. q(root))
    local big = moe.randn({ 512, 1024 })
    local w = moe.save_async(root .. "/async.safetensors", { big = big, a = A }, { k = "v" })
    local done = w:done()
    assert.is_boolean(done)
    w:wait()
    w:wait() -- again: the same answer
    assert.is_true(w:done())
    w:free()
    w:free()
    moe.save(root .. "/sync.safetensors", { big = big, a = A }, { k = "v" })
    local f1, f2 = io.open(root .. "/async.safetensors", "rb"), io.open(root .. "/sync.safetensors", "rb")
    assert.are.equal(f2:read("a"), f1:read("a")) -- byte for byte
    f1:close(); f2:close()
    assert.has_error(function() w:wait() end, "wait: attempt to use a freed save_async writer")
    -- the bytes were copied before save_async returned: changing the tensor at once changes nothing
    local c = A:clone()
    w = moe.save_async(root .. "/copied.safetensors", { c = c })
    c:fill_(-1)
    w:wait()
    w:free()
    assert.is_true(equal(moe.load(root .. "/copied.safetensors").c, A))
    -- a later save takes an earlier writer's buffer
    local w1 = moe.save_async(root .. "/r1.safetensors", { a = A })
    w1:wait()
    local w2 = moe.save_async(root .. "/r2.safetensors", { b = B }, nil, w1)
    w1:free()
    w2:wait()
    w2:free()
    assert.is_true(equal(moe.load(root .. "/r2.safetensors").b, B))
    assert.is_true(equal(moe.load(root .. "/r1.safetensors").a, A))
    assert.has_error(function() moe.save_async(root .. "/r3.safetensors", { b = B }, nil, w1) end,
      "bad argument #4 to 'save_async' (reuse is a freed writer)")
  end)

  it("refuses strided tensors at once, and reports a failed write at wait", function()
    local ok, err = pcall(moe.save_async, root .. "/x.safetensors", { t = A:transpose(0, 1) })
    assert.is_false(ok)
    assert.truthy(tostring(err):find("save_async: tensor 't' must be contiguous", 1, true), err)
    local w = moe.save_async(root .. "/no/such/folder/x.safetensors", { t = A })
    ok, err = pcall(w.wait, w)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("save_async: cannot create '" .. root .. "/no/such/folder/x.safetensors", 1, true), err)
    assert.has_error(function() moe.save_async(1, {}) end)
    -- a writer dropped without wait is joined by the collector
    moe.save_async(root .. "/gc.safetensors", { t = A })
    collectgarbage()
    collectgarbage()
    assert.is_not_nil(io.open(root .. "/gc.safetensors", "rb"))
    moe.fsync(root)
    moe.fsync(root .. "/gc.safetensors")
    assert.has_error(function() moe.fsync(root .. "/none") end)
  end)

  it("copies GPU tensors into its buffer (page-locked) and reuses it", function()
    if not (moe.cuda and moe.cuda.is_available()) then pending("no GPU") return end
    os.execute("mkdir -p " .. q(root))
    local big = moe.randn({ 512, 1024 })
    local g, gb = A:to("cuda"), big:to({ device = "cuda", dtype = "bf16" })
    local w1 = moe.save_async(root .. "/g1.safetensors", { a = g, big = gb, c = C })
    g:fill_(-1) -- copied before the call returned
    w1:wait()
    local got = moe.load(root .. "/g1.safetensors")
    assert.is_true(equal(got.a, A))
    assert.is_true(equal(got.big, big:to("bf16")))
    assert.is_true(equal(got.c, C))
    local w2 = moe.save_async(root .. "/g2.safetensors", { a = g }, nil, w1)
    w1:free()
    w2:wait()
    w2:free()
    assert.is_true(equal(moe.load(root .. "/g2.safetensors").a, g:cpu()))
  end)
end)
