--[[
tests/lua/gpu_spec.lua - tensors on "cuda": the same values as on the CPU
(constructors, the seeded generator, views, operators, conversions), printing,
and the CUDA memory statistics rising and coming back after free.

Without a CUDA GPU every test is marked pending and a line
"SKIPPED (no CUDA GPU): ..." says so; busted's summary then counts them as
skipped.
]]
local moe = require "moe"

local gpu = moe.cuda.is_available()

local function near(a, b, tol)
  if type(a) == "table" then
    if type(b) ~= "table" or #a ~= #b then return false end
    for i = 1, #a do
      if not near(a[i], b[i], tol) then return false end
    end
    return true
  end
  return math.abs(a - b) <= tol * math.max(1, math.abs(b))
end

if not gpu then
  local why = moe.build_info().cuda and "no GPU visible to this process" or "this moe-lua was built without CUDA"
  print(("\nSKIPPED (no CUDA GPU): tests/lua/gpu_spec.lua, %s"):format(why))
end

-- it() on a GPU, pending() without one.
local function gpu_it(name, fn)
  if gpu then it(name, fn) else pending(name .. " (no CUDA GPU)") end
end

describe("tensors on cuda", function()
  gpu_it("are made on cuda:0 with the same values as on the CPU", function()
    local z = moe.zeros({ 2, 3 }, { device = "cuda" })
    assert.are.equal("cuda:0", z.device)
    assert.are.same({ { 0, 0, 0 }, { 0, 0, 0 } }, z:totable())
    assert.are.same({ 1, 1 }, moe.ones(2, { device = "cuda", dtype = "i32" }):totable())
    assert.are.same(moe.arange(10):totable(), moe.arange(10, { device = "cuda" }):totable())
    assert.is_true(near(moe.linspace(-1, 1, 7):totable(), moe.linspace(-1, 1, 7, { device = "cuda" }):totable(), 1e-6))
    assert.are.same({ { 1, 2 }, { 3, 4 } }, moe.tensor({ { 1, 2 }, { 3, 4 } }, { device = "cuda" }):totable())
    assert.are.equal(7.5, moe.full({ 1 }, 7.5, { device = "cuda" }):item())
    for _, dt in ipairs(moe.dtypes) do
      local t = moe.ones({ 3 }, { dtype = dt, device = "cuda" })
      assert.are.equal(dt, t.dtype)
      assert.are.same(moe.ones({ 3 }, { dtype = dt }):totable(), t:totable())
    end
  end)

  gpu_it("draw the same random numbers as the CPU for the same seed", function()
    moe.manual_seed(1234)
    local cu = moe.rand(4099, { device = "cuda" }):totable()
    moe.manual_seed(1234)
    local cpu = moe.rand(4099):totable()
    assert.are.same(cpu, cu) -- bit-identical
    moe.manual_seed(99)
    local ncu = moe.randn(1000, { device = "cuda" }):totable()
    moe.manual_seed(99)
    assert.is_true(near(moe.randn(1000):totable(), ncu, 1e-5))
    moe.manual_seed(5)
    local icu = moe.randint(0, 100, { 777 }, { device = "cuda" }):totable()
    moe.manual_seed(5)
    assert.are.same(moe.randint(0, 100, { 777 }):totable(), icu)
  end)

  gpu_it("views, contiguous and copies match the CPU", function()
    local c = moe.arange(24):view(2, 3, 4)
    local g = c:cuda()
    assert.are.equal("cuda:0", g.device)
    assert.are.same(c:transpose(0, 2):contiguous():totable(), g:transpose(0, 2):contiguous():totable())
    assert.are.same(c:permute(1, 2, 0):totable(), g:permute(1, 2, 0):totable())
    assert.are.same(c:narrow(2, 1, 2):totable(), g:narrow(2, 1, 2):totable())
    assert.are.same(c:slice(2, 0, 4, 3):totable(), g:slice(2, 0, 4, 3):totable())
    assert.are.same(c:select(1, -1):totable(), g:select(1, -1):totable())
    assert.are.same(c:select(0, 1):unsqueeze(0):expand(3, 3, 4):totable(),
      g:select(0, 1):unsqueeze(0):expand(3, 3, 4):totable())
    assert.are.same(c:view(6, 4):totable(), g:view(6, 4):totable())
    assert.are.same(c:transpose(0, 1):reshape(24):totable(), g:transpose(0, 1):reshape(24):totable())
    local back = g:float():cpu()
    assert.are.equal("cpu", back.device)
    assert.are.equal("f32", back.dtype)
    assert.are.same(c:float():totable(), back:totable())
    local d = moe.zeros({ 2, 4 }, { device = "cuda" })
    d:copy_(moe.tensor({ 1, 2, 3, 4 })) -- from the CPU, broadcast
    assert.are.same({ { 1, 2, 3, 4 }, { 1, 2, 3, 4 } }, d:totable())
    d:select(0, 0):fill_(9)
    assert.are.same({ { 9, 9, 9, 9 }, { 1, 2, 3, 4 } }, d:totable())
    assert.are.equal("cuda:0", c:to("cuda:0").device)
    assert.are.equal("bf16", c:to({ device = "cuda", dtype = "bf16" }).dtype)
  end)

  gpu_it("operators match the CPU, with broadcasting and scalars", function()
    moe.manual_seed(3)
    local a, b = moe.randn(4, 5), moe.randn(5)
    local ga, gb = a:cuda(), b:cuda()
    assert.is_true(near((a + b):totable()[3], (ga + gb):totable()[3], 1e-6))
    assert.is_true(near((a * b - 2):totable()[2], (ga * gb - 2):totable()[2], 1e-6))
    assert.is_true(near((1 / (a * a + 1)):totable()[4], (1 / (ga * ga + 1)):totable()[4], 1e-6))
    assert.is_true(near((-a):totable()[1], (-ga):totable()[1], 0))
    local i = moe.arange(6):view(2, 3)
    assert.are.same((i * 3 + 1):totable(), (i:cuda() * 3 + 1):totable())
    assert.are.same((i / 2):totable(), (i:cuda() / 2):totable())
    local ok, err = pcall(function() return ga + b end)
    assert.is_false(ok)
    assert.truthy(err:find("add:", 1, true), err)
    moe.cuda.synchronize()
  end)

  gpu_it("print with their device", function()
    local s = tostring(moe.tensor({ { 1, -2.5 } }, { device = "cuda" }))
    assert.are.equal("tensor([[ 1.0000, -2.5000]], shape=[1, 2], dtype=f32, device=cuda:0)", s)
    assert.truthy(tostring(moe.arange(5000, { device = "cuda" })):find("...", 1, true))
  end)

  gpu_it("count their memory, which comes back after free", function()
    collectgarbage()
    collectgarbage()
    moe.cuda.synchronize()
    local before = moe.memory_stats("cuda:0")
    assert.are.equal("cuda:0", before.device)
    local t = moe.zeros({ 1024, 1024 }, { device = "cuda" }) -- 4 MiB
    local during = moe.memory_stats("cuda:0")
    assert.is_true(during.allocated >= before.allocated + 4 * 1024 * 1024)
    assert.are.equal(before.live_storages + 1, during.live_storages)
    assert.is_true(during.peak_allocated >= during.allocated)
    assert.is_true(during.reserved >= during.allocated)
    t:free()
    local after = moe.memory_stats("cuda:0")
    assert.are.equal(before.allocated, after.allocated)
    assert.are.equal(before.live_storages, after.live_storages)
    -- A second allocation of the same size is served from the cache.
    local again = moe.zeros({ 1024, 1024 }, { device = "cuda" })
    assert.are.equal(after.system_allocs, moe.memory_stats("cuda:0").system_allocs)
    again:free()
    moe.empty_cache("cuda:0")
    assert.is_true(moe.memory_stats("cuda:0").reserved <= after.reserved)
    moe.reset_peak_memory_stats("cuda:0")
    local s = moe.memory_stats("cuda:0")
    assert.are.equal(s.allocated, s.peak_allocated)
  end)

  gpu_it("name the devices", function()
    assert.is_true(moe.cuda.device_count() >= 1)
    assert.are.equal("string", type(moe.cuda.get_device_name(0)))
    assert.truthy(#moe.cuda.get_device_name() > 0)
    assert.are.equal(moe.cuda.get_device_name(0), moe.build_info().gpus[1].name)
  end)

  gpu_it("collect garbage tensors when enough device memory has passed to Lua", function()
    collectgarbage()
    local old_step = moe.cuda.set_gc_step(64) -- a full cycle every 64 MiB
    local _, cycles0 = moe.cuda.set_gc_step()
    local base = moe.memory_stats("cuda:0").allocated
    local x = moe.ones({ 1024, 1024 }, { device = "cuda" }) -- 4 MiB
    local peak = 0
    collectgarbage("stop") -- only the device-memory rule may collect
    for _ = 1, 200 do -- 800 MiB of results dropped on the floor
      local _ = x * 2 -- dropped at once
      peak = math.max(peak, moe.memory_stats("cuda:0").allocated - base)
    end
    collectgarbage("restart")
    local _, cycles1 = moe.cuda.set_gc_step(old_step)
    assert.is_true(cycles1 - cycles0 >= 10, ("only %d collections"):format(cycles1 - cycles0))
    assert.is_true(peak <= 80 * 1024 * 1024, ("peak %.1f MiB over the base"):format(peak / 2 ^ 20))
    -- Views are not counted: they make no new storage.
    local _, c2 = moe.cuda.set_gc_step(1)
    collectgarbage("stop")
    for _ = 1, 10 do local _ = x:view({ 1024 * 1024 }) end
    collectgarbage("restart")
    local _, c3 = moe.cuda.set_gc_step(old_step)
    assert.are.equal(c2, c3)
    x:free()
  end)

  gpu_it("report an index out of range at the next synchronisation, then go on", function()
    local w = moe.randn({ 10, 4 }, { device = "cuda" })
    local ids = moe.tensor({ 1, 12, 3 }, { dtype = "i64" }):cuda()
    local e = moe.embedding(w, ids) -- queued: the launch cannot know
    local ok, msg = pcall(moe.cuda.synchronize)
    assert.is_false(ok)
    assert.matches("embedding: index 12 is out of range %[0, 10%) on cuda:0", msg)
    assert.is_true(pcall(moe.cuda.synchronize)) -- reported once
    e:free()
    local logits = moe.randn({ 2, 5 }, { device = "cuda" })
    local loss = moe.cross_entropy(logits, moe.tensor({ 2, 5 }, { dtype = "i64" }):cuda())
    ok, msg = pcall(loss.item, loss)
    assert.is_false(ok)
    assert.matches("cross_entropy %(target%): index 5 is out of range %[0, 5%)", msg)
    local fine = moe.cross_entropy(logits, moe.tensor({ 2, 4 }, { dtype = "i64" }):cuda())
    assert.is_true(fine:item() == fine:item()) -- a number, not NaN
  end)

  it("reject a negative gc step", function()
    assert.has_error(function() moe.cuda.set_gc_step(-1) end,
      "bad argument #1 to 'set_gc_step' (MiB must be in [0, 2^40], got -1)")
  end)
end)
