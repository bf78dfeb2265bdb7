--[[
tests/lua/tensor_spec.lua - the `moe` module's tensors on the CPU: every
constructor, the fields, reading values back, every view method against
expected values, conversions, fills, the operators with broadcasting and
scalars on both sides, #t, printing, the lifecycle (free, <close>, __gc,
use after free) and the memory statistics.

Run: moe-lua tests/lua/busted.lua tests/lua/tensor_spec.lua (ctest does).
Dims are 0-based, as everywhere in the moe API; Lua tables are 1-based.
]]
local moe = require "moe"

local function near(a, b, tol)
  tol = tol or 1e-6
  if type(a) == "table" then
    if type(b) ~= "table" or #a ~= #b then return false end
    for i = 1, #a do
      if not near(a[i], b[i], tol) then return false end
    end
    return true
  end
  return math.abs(a - b) <= tol * math.max(1, math.abs(b))
end

local function live()
  collectgarbage()
  collectgarbage()
  return moe.memory_stats("cpu")
end

describe("constructors", function()
  it("take a shape table, sizes as numbers, and options", function()
    assert.are.same({ 2, 3 }, moe.zeros({ 2, 3 }).shape)
    assert.are.same({ 2, 3 }, moe.zeros(2, 3).shape)
    assert.are.same({ 4 }, moe.ones(4, { dtype = "i32" }).shape)
    assert.are.equal("i32", moe.ones(4, { dtype = "i32" }).dtype)
    assert.are.same({ 2, 0, 3 }, moe.empty({ 2, 0, 3 }).shape)
    assert.are.same({}, moe.zeros({}).shape)
    assert.are.equal(1, moe.zeros({}):numel())
    assert.are.equal("f32", moe.empty(1).dtype)
    assert.are.equal("cpu", moe.empty(1, { device = "cpu" }).device)
    assert.are.same({ 1, 1, 1, 1, 1, 1, 1, 1 }, moe.zeros(1, 1, 1, 1, 1, 1, 1, 1).shape)
    assert.are.same({ 2 }, moe.zeros(2.0).shape) -- an integral float is an integer
    assert.are.equal("f32", moe.zeros({ 1 }, { requires_grad = false }).dtype)
  end)

  it("zeros, ones and full fill their values", function()
    assert.are.same({ { 0, 0 }, { 0, 0 } }, moe.zeros({ 2, 2 }, { dtype = "i64" }):totable())
    assert.are.same({ 1.0, 1.0, 1.0 }, moe.ones(3):totable())
    assert.are.same({ 7, 7 }, moe.full({ 2 }, 7):totable())
    assert.are.equal("i64", moe.full({ 2 }, 7).dtype)
    assert.are.equal("f32", moe.full({ 2 }, 7.5).dtype)
    assert.are.same({ 7.5, 7.5 }, moe.full({ 2 }, 7.5):totable())
    assert.are.same({ true, true }, moe.full({ 2 }, true):totable())
    assert.are.equal("f64", moe.full({ 1 }, 2, { dtype = "f64" }).dtype)
  end)

  it("make every dtype", function()
    for _, dt in ipairs(moe.dtypes) do
      local t = moe.ones({ 2, 2 }, { dtype = dt })
      assert.are.equal(dt, t.dtype)
      local v = t:totable()[2][2]
      if dt == "bool" then assert.is_true(v) else assert.are.equal(1, v) end
    end
    assert.are.same({ "f32", "f64", "bf16", "f16", "i8", "u8", "i32", "i64", "bool" }, moe.dtypes)
    assert.are.equal("f32", moe.zeros(1, { dtype = "float32" }).dtype)
    assert.are.equal("bf16", moe.zeros(1, { dtype = "bfloat16" }).dtype)
    assert.are.equal("i64", moe.zeros(1, { dtype = "long" }).dtype)
  end)

  it("arange and linspace", function()
    assert.are.same({ 0, 1, 2, 3, 4 }, moe.arange(5):totable())
    assert.are.equal("i64", moe.arange(5).dtype)
    assert.are.same({ 2, 4, 6, 8 }, moe.arange(2, 10, 2):totable())
    assert.are.same({ 3, 4 }, moe.arange(3, 5):totable())
    assert.are.same({ 5, 3, 1 }, moe.arange(5, 0, -2):totable())
    assert.are.equal("f32", moe.arange(0, 1, 0.25).dtype)
    assert.is_true(near({ 0, 0.25, 0.5, 0.75 }, moe.arange(0, 1, 0.25):totable()))
    assert.are.equal("f64", moe.arange(3, { dtype = "f64" }).dtype)
    assert.are.same({ 0.0, 1.0, 2.0 }, moe.arange(3, { dtype = "f64" }):totable())
    assert.are.same({ 0 }, moe.arange(0).shape)
    assert.is_true(near({ 0, 0.25, 0.5, 0.75, 1 }, moe.linspace(0, 1, 5):totable()))
    assert.are.equal("f32", moe.linspace(0, 1, 5).dtype)
    assert.are.same({ 0 }, moe.linspace(0, 1, 0).shape)
    assert.are.same({ 1.0, 2.0, 3.0 }, moe.linspace(1, 3, 3, { dtype = "f64" }):totable())
  end)

  it("rand, randn and randint draw from the seeded generator", function()
    moe.manual_seed(42)
    local a = moe.rand(1000):totable()
    moe.manual_seed(42)
    local b = moe.rand(1000):totable()
    assert.are.same(a, b)
    local lo, hi, sum = math.huge, -math.huge, 0
    for _, v in ipairs(a) do
      lo, hi, sum = math.min(lo, v), math.max(hi, v), sum + v
    end
    assert.is_true(lo >= 0 and hi < 1)
    assert.is_true(math.abs(sum / #a - 0.5) < 0.05)

    local n = moe.randn(20000):totable()
    local mean, sq = 0, 0
    for _, v in ipairs(n) do mean = mean + v end
    mean = mean / #n
    for _, v in ipairs(n) do sq = sq + (v - mean) ^ 2 end
    assert.is_true(math.abs(mean) < 0.05)
    assert.is_true(math.abs(math.sqrt(sq / #n) - 1) < 0.05)
    assert.are.equal("f64", moe.randn({ 2 }, { dtype = "f64" }).dtype)

    local r = moe.randint(3, 7, { 500 })
    assert.are.equal("i64", r.dtype)
    local seen = {}
    for _, v in ipairs(r:totable()) do
      assert.is_true(math.type(v) == "integer" and v >= 3 and v < 7)
      seen[v] = true
    end
    assert.is_true(seen[3] and seen[4] and seen[5] and seen[6])
    for _, v in ipairs(moe.randint(2, { 50 }):totable()) do assert.is_true(v == 0 or v == 1) end
    assert.are.equal("i32", moe.randint(0, 5, { 3 }, { dtype = "i32" }).dtype)
  end)

  it("keeps and restores the generator state", function()
    moe.manual_seed(7)
    local state = moe.get_rng_state()
    assert.are.equal(7, state.seed)
    assert.are.equal("integer", math.type(state.call))
    local a = moe.randn(8):totable()
    moe.set_rng_state(state)
    assert.are.same(a, moe.randn(8):totable())
    assert.are_not.same(a, moe.randn(8):totable()) -- the call counter moved on
  end)

  it("moe.tensor infers the shape and the dtype", function()
    local t = moe.tensor { { 1, 2, 3 }, { 4, 5, 6 } }
    assert.are.same({ 2, 3 }, t.shape)
    assert.are.equal("i64", t.dtype)
    assert.are.same({ { 1, 2, 3 }, { 4, 5, 6 } }, t:totable())
    assert.are.equal("f32", moe.tensor({ 1, 2.5 }).dtype)
    assert.are.equal("bool", moe.tensor({ true, false }).dtype)
    assert.are.same({ true, false }, moe.tensor({ true, false }):totable())
    assert.are.equal("f64", moe.tensor({ 1, 2 }, { dtype = "f64" }).dtype)
    assert.are.same({}, moe.tensor(3).shape)
    assert.are.equal(3, moe.tensor(3):item())
    assert.are.equal(2.5, moe.tensor(2.5):item())
    assert.is_true(moe.tensor(true):item())
    assert.are.same({ 0 }, moe.tensor({}).shape)
    assert.are.same({ 2, 0 }, moe.tensor({ {}, {} }).shape)
    assert.are.same({ 1, 1, 1, 2 }, moe.tensor({ { { { 1, 2 } } } }).shape)
  end)
end)

describe("fields and reading values", function()
  local t = moe.arange(24):view(2, 3, 4)

  it("shape, dtype, device, ndim", function()
    assert.are.same({ 2, 3, 4 }, t.shape)
    local s = t.shape
    s[1] = 99 -- a fresh table each time
    assert.are.same({ 2, 3, 4 }, t.shape)
    assert.are.equal("i64", t.dtype)
    assert.are.equal("cpu", t.device)
    assert.are.equal(3, t.ndim)
    assert.is_nil(t.no_such_field)
  end)

  it("numel, size, stride, dim, is_contiguous, storage_offset", function()
    assert.are.equal(24, t:numel())
    assert.are.equal(2, t:size(0))
    assert.are.equal(4, t:size(-1))
    assert.are.equal(3, t:size(-2))
    assert.are.same({ 2, 3, 4 }, t:size())
    assert.are.same({ 12, 4, 1 }, t:stride())
    assert.are.equal(4, t:stride(1))
    assert.are.equal(3, t:dim())
    assert.is_true(t:is_contiguous())
    assert.is_false(t:transpose(0, 2):is_contiguous())
    assert.are.equal(0, t:storage_offset())
    assert.are.equal(5, t:narrow(2, 1, 2):select(1, 1):storage_offset())
  end)

  it("totable gives nested sequences, item a number", function()
    assert.are.same({ { 0, 1 }, { 2, 3 } }, moe.arange(4):view(2, 2):totable())
    assert.are.equal("integer", math.type(moe.arange(4):totable()[1]))
    assert.are.equal("float", math.type(moe.ones(1):totable()[1]))
    assert.are.equal(5, moe.tensor({ 5 }):item())
    assert.are.equal(5, moe.tensor({ { 5 } }):item())
    assert.are.equal("float", math.type(moe.ones({ 1, 1 }):item()))
    assert.are.equal(7, moe.tensor(7):totable()) -- 0-dim: the value itself
    assert.are.equal(1.5, moe.tensor({ 1.5 }, { dtype = "bf16" }):item())
    assert.are.equal(-3, moe.tensor({ -3 }, { dtype = "i8" }):item())
    assert.are.same({}, moe.zeros(0):totable())
  end)

  it("is_tensor", function()
    assert.is_true(moe.is_tensor(t))
    assert.is_false(moe.is_tensor({}))
    assert.is_false(moe.is_tensor(1))
  end)
end)

describe("views", function()
  local base = moe.arange(24):view(2, 3, 4)

  it("view and reshape", function()
    assert.are.same({ { 0, 1, 2 }, { 3, 4, 5 } }, moe.arange(6):view(2, 3):totable())
    assert.are.same({ 6, 4 }, base:view(-1, 4).shape)
    assert.are.same({ 24 }, base:view({ 24 }).shape)
    assert.are.same({ 3, 8 }, base:reshape(3, -1).shape)
    local tr = base:transpose(1, 2) -- not viewable as one dim
    local r = tr:reshape(24)
    assert.are.same({ 0, 4, 8, 1, 5, 9 }, { table.unpack(r:totable(), 1, 6) })
    assert.are.same({}, moe.tensor({ 9 }):view({}).shape)
    assert.are.equal(9, moe.tensor({ 9 }):view({}):item())
  end)

  it("views share storage with their base", function()
    local a = moe.zeros(2, 3)
    local v = a:view(6)
    v:narrow(0, 1, 2):fill_(5)
    assert.are.same({ { 0, 5, 5 }, { 0, 0, 0 } }, a:totable())
    local row = a:select(0, 1)
    row:fill_(1)
    assert.are.same({ { 0, 5, 5 }, { 1, 1, 1 } }, a:totable())
  end)

  it("transpose and permute", function()
    local m = moe.arange(6):view(2, 3)
    assert.are.same({ { 0, 3 }, { 1, 4 }, { 2, 5 } }, m:transpose(0, 1):totable())
    assert.are.same({ { 0, 3 }, { 1, 4 }, { 2, 5 } }, m:transpose(-1, -2):totable())
    local p = base:permute(2, 0, 1)
    assert.are.same({ 4, 2, 3 }, p.shape)
    assert.are.same({ 1, 12, 4 }, p:stride())
    assert.are.equal(base:select(0, 1):select(0, 2):select(0, 3):item(), p:select(0, 3):select(0, 1):select(0, 2):item())
    assert.are.same({ 3, 4, 2 }, base:permute({ 1, 2, 0 }).shape)
    assert.are.same({ 2, 3, 4 }, base:permute(-3, -2, -1).shape)
  end)

  it("narrow, slice, select", function()
    local v = moe.arange(10)
    assert.are.same({ 3, 4, 5 }, v:narrow(0, 3, 3):totable())
    assert.are.same({ 1, 4, 7 }, v:slice(0, 1, 8, 3):totable())
    assert.are.same({ 7, 8, 9 }, v:slice(0, -3):totable())
    assert.are.same({ 0, 1 }, v:slice(0, nil, 2):totable())
    assert.are.same({ 0, 2, 4, 6, 8 }, v:slice(0, nil, nil, 2):totable())
    assert.are.same({ 8, 9 }, v:slice(0, 8, 100):totable()) -- clamped
    assert.are.same({ 4, 5, 6, 7 }, base:select(0, 0):select(0, 1):totable())
    assert.are.same({ 20, 21, 22, 23 }, base:select(0, -1):select(0, -1):totable())
    assert.are.same({ 3, 7, 11 }, base:select(0, 0):select(1, 3):totable())
    assert.are.same({ 2, 3 }, base:select(2, 0).shape)
    assert.are.same({ 2, 2, 4 }, base:narrow(1, 1, 2).shape)
    assert.are.same({ 2, 3, 2 }, base:slice(-1, 0, 4, 2).shape)
  end)

  it("expand, squeeze, unsqueeze", function()
    local c = moe.tensor({ { 1 }, { 2 } })
    assert.are.same({ { 1, 1, 1 }, { 2, 2, 2 } }, c:expand(2, 3):totable())
    assert.are.equal(0, c:expand(2, 3):stride(1))
    assert.are.same({ { 1, 1 }, { 2, 2 } }, c:expand(-1, 2):totable())
    assert.are.same({ 4, 2, 3 }, c:expand(4, 2, 3).shape)
    local s = moe.zeros(1, 3, 1, 2)
    assert.are.same({ 3, 2 }, s:squeeze().shape)
    assert.are.same({ 3, 1, 2 }, s:squeeze(0).shape)
    assert.are.same({ 1, 3, 2 }, s:squeeze(-2).shape)
    assert.are.same({ 1, 3, 1, 2 }, s:squeeze(1).shape) -- size 3: unchanged
    local u = moe.arange(3)
    assert.are.same({ 1, 3 }, u:unsqueeze(0).shape)
    assert.are.same({ 3, 1 }, u:unsqueeze(1).shape)
    assert.are.same({ 3, 1 }, u:unsqueeze(-1).shape)
    assert.are.same({ { 0 }, { 1 }, { 2 } }, u:unsqueeze(-1):totable())
  end)

  it("contiguous and clone", function()
    local t = base:transpose(0, 2)
    local c = t:contiguous()
    assert.is_true(c:is_contiguous())
    assert.are.same(t:totable(), c:totable())
    assert.are.same({ 6, 2, 1 }, c:stride())
    local cl = base:clone()
    cl:fill_(0)
    assert.are.equal(23, base:select(0, 1):select(0, 2):select(0, 3):item())
    assert.are.same({ 2, 3, 4 }, cl.shape)
  end)
end)

describe("conversions, copies and fills", function()
  it("to, float, double, long, cpu", function()
    local t = moe.tensor({ 1.7, -2.2 })
    assert.are.same({ 1, -2 }, t:to("i64"):totable())
    assert.are.equal("i64", t:long().dtype)
    assert.are.equal("f64", t:double().dtype)
    assert.are.equal("f32", moe.arange(3):float().dtype)
    assert.are.equal("i32", t:int().dtype)
    assert.are.equal("f16", t:half().dtype)
    assert.are.equal("bf16", t:bfloat16().dtype)
    assert.are.same({ true, true }, t:bool():totable())
    assert.are.equal("f64", t:to({ dtype = "f64" }).dtype)
    assert.are.equal("cpu", t:to("cpu").device)
    assert.are.equal("cpu", t:cpu().device)
    assert.are.equal("i32", t:to(moe.zeros(1, { dtype = "i32" })).dtype)
    assert.are.equal("f16", t:to("cpu", "f16").dtype)
    assert.is_true(near({ 1.7, -2.2 }, t:to("f64"):totable(), 1e-6))
  end)

  it("copy_ converts and broadcasts, fill_ and random fills work in place", function()
    local d = moe.zeros(2, 3)
    assert.are.equal(d, d:copy_(moe.tensor({ 1, 2, 3 })))
    assert.are.same({ { 1, 2, 3 }, { 1, 2, 3 } }, d:totable())
    assert.are.equal(d, d:fill_(4))
    assert.are.same({ 4, 4, 4 }, d:totable()[1])
    local b = moe.zeros(2, { dtype = "bool" }):fill_(true)
    assert.are.same({ true, true }, b:totable())
    local u = moe.empty(1000):uniform_(-2, -1)
    for _, v in ipairs(u:totable()) do assert.is_true(v >= -2 and v < -1) end
    local n = moe.empty(5000, { dtype = "f64" }):normal_(10, 0.5)
    local s = 0
    for _, v in ipairs(n:totable()) do s = s + v end
    assert.is_true(math.abs(s / 5000 - 10) < 0.05)
  end)
end)

describe("operators", function()
  local a = moe.tensor({ { 1, 2, 3 }, { 4, 5, 6 } }, { dtype = "f32" })

  it("tensor op tensor, with broadcasting", function()
    assert.are.same({ { 2, 4, 6 }, { 8, 10, 12 } }, (a + a):totable())
    assert.are.same({ { 0, 0, 0 }, { 0, 0, 0 } }, (a - a):totable())
    assert.are.same({ { 1, 4, 9 }, { 16, 25, 36 } }, (a * a):totable())
    assert.are.same({ { 1, 1, 1 }, { 1, 1, 1 } }, (a / a):totable())
    local row = moe.tensor({ 10, 20, 30 }, { dtype = "f32" })
    assert.are.same({ { 11, 22, 33 }, { 14, 25, 36 } }, (a + row):totable())
    local col = moe.tensor({ { 100 }, { 200 } }, { dtype = "f32" })
    assert.are.same({ { 101, 102, 103 }, { 204, 205, 206 } }, (a + col):totable())
    local outer = moe.tensor({ { 1 }, { 2 } }) * moe.tensor({ 1, 10, 100 })
    assert.are.same({ { 1, 10, 100 }, { 2, 20, 200 } }, outer:totable())
    assert.are.same({ 2, 3 }, (a + moe.tensor(1.0)).shape)
  end)

  it("scalars on either side", function()
    assert.are.same({ { 2, 3, 4 }, { 5, 6, 7 } }, (a + 1):totable())
    assert.are.same({ { 2, 3, 4 }, { 5, 6, 7 } }, (1 + a):totable())
    assert.are.same({ { 0, 1, 2 }, { 3, 4, 5 } }, (a - 1):totable())
    assert.are.same({ { 9, 8, 7 }, { 6, 5, 4 } }, (10 - a):totable())
    assert.are.same({ { 2, 4, 6 }, { 8, 10, 12 } }, (a * 2):totable())
    assert.are.same({ { 2, 4, 6 }, { 8, 10, 12 } }, (2 * a):totable())
    assert.are.same({ { 0.5, 1, 1.5 }, { 2, 2.5, 3 } }, (a / 2):totable())
    assert.is_true(near({ 6, 3, 2 }, (6 / a):totable()[1]))
    assert.are.same({ { -1, -2, -3 }, { -4, -5, -6 } }, (-a):totable())
    assert.are.same({ { -1, -2, -3 }, { -4, -5, -6 } }, a:neg():totable())
  end)

  it("methods add, sub, mul, div", function()
    assert.are.same((a + a):totable(), a:add(a):totable())
    assert.are.same((a - 2):totable(), a:sub(2):totable())
    assert.are.same((a * a):totable(), a:mul(a):totable())
    assert.are.same((a / 4):totable(), a:div(4):totable())
  end)

  it("promotes dtypes", function()
    local i = moe.tensor({ 1, 2, 3 })
    assert.are.equal("i64", (i + 1).dtype)
    assert.are.equal("i64", (i * i).dtype)
    assert.are.equal("f32", (i + 0.5).dtype)
    assert.are.equal("f32", (i / 2).dtype)
    assert.are.same({ 0.5, 1, 1.5 }, (i / 2):totable())
    assert.are.equal("f32", (i + moe.ones(3)).dtype)
    assert.are.equal("f64", (moe.ones(3) + moe.ones(3, { dtype = "f64" })).dtype)
    assert.are.equal("f32", (moe.ones(1, { dtype = "bf16" }) + moe.ones(1, { dtype = "f16" })).dtype)
    assert.are.equal("bf16", (moe.ones(1, { dtype = "bf16" }) * 2.5).dtype)
  end)

  it("#t is the size of dim 0", function()
    assert.are.equal(2, #a)
    assert.are.equal(0, #moe.zeros(0, 4))
    assert.has_error(function() return #moe.tensor(1) end)
  end)

  it("== is identity", function()
    local b = a
    assert.is_true(a == b)
    assert.is_false(a == a:view(2, 3))
    assert.is_false(moe.zeros(1) == moe.zeros(1))
  end)
end)

describe("printing", function()
  it("looks like PyTorch, with shape, dtype and device", function()
    local s = tostring(moe.tensor({ { 1, -2.5 } }))
    assert.are.equal("tensor([[ 1.0000, -2.5000]], shape=[1, 2], dtype=f32, device=cpu)", s)
    assert.truthy(tostring(moe.arange(3)):find("tensor([0, 1, 2]", 1, true))
    assert.truthy(tostring(moe.arange(3)):find("dtype=i64", 1, true))
    assert.truthy(tostring(moe.zeros(2, 3)):find("shape=[2, 3]", 1, true))
  end)

  it("summarises big tensors", function()
    local s = tostring(moe.arange(5000))
    assert.truthy(s:find("...", 1, true))
    assert.truthy(s:find("4999", 1, true))
    assert.is_true(#s < 400)
  end)

  it("follows the print options", function()
    local old = moe.get_printoptions()
    moe.set_printoptions({ precision = 2 })
    assert.truthy(tostring(moe.tensor({ 1.0 })):find("1.00]", 1, true))
    moe.set_printoptions(old)
    assert.are.same(old, moe.get_printoptions())
    assert.truthy(tostring(moe.tensor({ 1.0 })):find("1.0000]", 1, true))
  end)
end)

describe("lifecycle", function()
  it("free is idempotent and use after free is an error", function()
    local t = moe.zeros(3)
    t:free()
    t:free()
    assert.are.equal("tensor(freed)", tostring(t))
    local ok, err = pcall(function() return t + 1 end)
    assert.is_false(ok)
    assert.truthy(err:find("attempt to use a freed tensor", 1, true))
    local _
    _, err = pcall(function() return t.shape end)
    assert.truthy(err:find("attempt to use a freed tensor", 1, true))
    _, err = pcall(function() return t:view(3) end)
    assert.truthy(err:find("bad argument #1 to 'view' (attempt to use a freed tensor)", 1, true))
    _, err = pcall(function() return moe.ones(3) + t end)
    assert.truthy(err:find("bad argument #2 to 'add' (attempt to use a freed tensor)", 1, true))
  end)

  it("free releases the storage at once; a view keeps it alive", function()
    local before = live()
    local t = moe.zeros(1000)
    local mid = moe.memory_stats("cpu")
    assert.are.equal(before.live_storages + 1, mid.live_storages)
    assert.is_true(mid.allocated - before.allocated >= 4000)
    local v = t:view(10, 100)
    t:free()
    assert.are.equal(mid.live_storages, moe.memory_stats("cpu").live_storages)
    v:free()
    local after = moe.memory_stats("cpu")
    assert.are.equal(before.live_storages, after.live_storages)
    assert.are.equal(before.allocated, after.allocated)
  end)

  it("a <close> variable frees at the end of its scope", function()
    local before = live()
    do
      local t <close> = moe.ones(256)
      assert.are.equal(256, t:numel())
      assert.are.equal(before.live_storages + 1, moe.memory_stats("cpu").live_storages)
    end
    assert.are.equal(before.live_storages, moe.memory_stats("cpu").live_storages)
  end)

  it("the garbage collector frees unreachable tensors", function()
    local before = live()
    for _ = 1, 100 do
      local _ = moe.randn(64, 64) * 2 + 1 -- three tensors, none kept
    end
    local after = live()
    assert.are.equal(before.live_storages, after.live_storages)
    assert.are.equal(before.allocated, after.allocated)
  end)
end)

describe("memory statistics", function()
  it("has every field", function()
    local s = moe.memory_stats("cpu")
    for _, k in ipairs({ "allocated", "peak_allocated", "reserved", "peak_reserved", "alloc_count",
      "free_count", "live_storages", "system_allocs", "system_frees" }) do
      assert.are.equal("integer", math.type(s[k]), k)
    end
    assert.are.equal("cpu", s.device)
  end)

  it("tracks the peak and resets it", function()
    live()
    moe.reset_peak_memory_stats("cpu")
    local base = moe.memory_stats("cpu")
    assert.are.equal(base.allocated, base.peak_allocated)
    local big = moe.zeros(100000)
    big:free()
    local s = moe.memory_stats("cpu")
    assert.is_true(s.peak_allocated >= base.allocated + 400000)
    moe.reset_peak_memory_stats("cpu")
    assert.are.equal(moe.memory_stats("cpu").allocated, moe.memory_stats("cpu").peak_allocated)
    moe.empty_cache("cpu")
  end)

  it("defaults to the GPU when there is one", function()
    local s = moe.memory_stats()
    assert.are.equal(moe.cuda.is_available() and "cuda:0" or "cpu", s.device)
  end)
end)

describe("the module", function()
  it("reports its version and build", function()
    assert.are.equal("string", type(moe.version))
    assert.truthy(moe.version:match("^%d+%.%d+%.%d+"))
    local info = moe.build_info()
    assert.are.equal(moe.version, info.version)
    assert.truthy(info.lua:find("Lua 5.4", 1, true))
    assert.are.equal("boolean", type(info.cuda))
    assert.are.equal("table", type(info.gpus))
    assert.are.equal(moe.cuda.device_count(), #info.gpus)
    for _, g in ipairs(info.gpus) do
      assert.are.equal("string", type(g.name))
      assert.truthy(g.cc:match("^%d+%.%d$"))
      assert.is_true(g.memory > 0)
    end
    local report = moe.version_report()
    assert.truthy(report:find("moe-lua " .. moe.version, 1, true))
  end)

  it("answers CUDA questions on any machine", function()
    assert.are.equal("boolean", type(moe.cuda.is_available()))
    assert.are.equal("integer", math.type(moe.cuda.device_count()))
    assert.are.equal(moe.cuda.device_count() > 0, moe.cuda.is_available())
  end)

  it("has its Lua part and exposes the method table", function()
    assert.are.equal("function", type(moe.config))
    assert.are.equal("function", type(moe.Tensor.view))
    assert.are.equal(require("moe"), moe)
  end)
end)

describe("empty tensors with huge sizes", function()
  it("have no elements and saturated strides, never an overflow", function()
    local t = moe.empty({ 0, 2 ^ 62, 4 })
    assert.are.equal(0, t:numel())
    assert.are.same({}, t:totable())
    t:free()
  end)
end)
