--[[
tests/lua/reduce_spec.lua - reductions and normalisation through the `moe`
module on the CPU: values against hand-computed results, keepdim and
negative dims, max/min returning values and indices, gradients through
backward against closed forms, and bad-argument errors.

Run: moe-lua tests/lua/busted.lua tests/lua/reduce_spec.lua (ctest does).
Dims are 0-based, as everywhere in the moe API.
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

local function errmsg(f)
  local ok, err = pcall(f)
  assert.is_false(ok)
  return tostring(err)
end

describe("sum and mean", function()
  local t = moe.tensor({ { 1, 2, 3 }, { 4, 5, 6 } }, { dtype = "f64" })

  it("reduce all dims, one dim or a table of dims", function()
    assert.are.equal(21, moe.sum(t):item())
    assert.are.same({}, t:sum().shape)
    assert.are.same({ 5, 7, 9 }, t:sum(0):totable())
    assert.are.same({ 6, 15 }, t:sum(-1):totable())
    assert.are.same({ { 6 }, { 15 } }, t:sum(1, true):totable())
    assert.are.same({ { 21 } }, t:sum({ 0, 1 }, true):totable())
    assert.are.same({ 2.5, 3.5, 4.5 }, t:mean(0):totable())
    assert.are.equal(3.5, t:mean():item())
  end)

  it("sums integers to i64", function()
    local i = moe.tensor({ 1, 2, 3 }, { dtype = "i32" })
    assert.are.equal("i64", i:sum().dtype)
    assert.are.equal(6, i:sum():item())
  end)

  it("gives gradients of ones and 1/n", function()
    local x = moe.tensor({ { 1, 2 }, { 3, 4 } }, { dtype = "f64", requires_grad = true })
    x:sum(1):sum():backward()
    assert.are.same({ { 1, 1 }, { 1, 1 } }, x.grad:totable())
    x.grad = nil
    x:mean():backward()
    assert.are.same({ { 0.25, 0.25 }, { 0.25, 0.25 } }, x.grad:totable())
  end)

  it("rejects bad arguments", function()
    assert.matches("bad argument #2 to 'sum'", errmsg(function() return t:sum("x") end))
    assert.matches("dim 2 is out of range", errmsg(function() return t:sum(2) end))
    assert.matches("keepdim must be a boolean", errmsg(function() return t:sum(0, 1) end))
    assert.matches("tensor expected", errmsg(function() return moe.sum(3) end))
    assert.matches("expected a float tensor",
      errmsg(function() return moe.tensor({ 1, 2 }, { dtype = "i64" }):mean() end))
  end)
end)

describe("max, min, argmax", function()
  local t = moe.tensor({ { 3, 7, 7, -1 }, { 0, -2, 5, -2 } })

  it("return values and indices over a dim, a value overall", function()
    local v, i = t:max(1)
    assert.are.same({ 7, 5 }, v:totable())
    assert.are.same({ 1, 2 }, i:totable())
    assert.are.equal("i64", i.dtype)
    v, i = t:min(-1, true)
    assert.are.same({ { -1 }, { -2 } }, v:totable())
    assert.are.same({ { 3 }, { 1 } }, i:totable())
    assert.are.equal(7, t:max():item())
    assert.are.equal(-2, moe.min(t):item())
    assert.are.equal(1, t:argmax():item())
    assert.are.same({ 1, 2 }, t:argmax(1):totable())
    assert.are.same({ 1, 1, 1, 1 }, t:argmin(0):totable())
  end)

  it("sends the gradient to the arg position", function()
    local x = moe.tensor({ { 1, 9, 2 }, { 8, 0, 3 } }, { dtype = "f64", requires_grad = true })
    local v = x:max(1)
    v:sum():backward()
    assert.are.same({ { 0, 1, 0 }, { 1, 0, 0 } }, x.grad:totable())
    x.grad = nil
    x:min():backward()
    assert.are.same({ { 0, 0, 0 }, { 0, 1, 0 } }, x.grad:totable())
  end)

  it("rejects a bad dim", function()
    assert.matches("bad argument #2 to 'max'", errmsg(function() return t:max(5) end))
    assert.matches("dim must be an integer", errmsg(function() return t:argmax(0.5) end))
  end)
end)

describe("norm, logsumexp, var", function()
  local t = moe.tensor({ { 3, -4 }, { 1, 1 } }, { dtype = "f64" })

  it("compute their values", function()
    assert.is_true(near(t:norm():item(), math.sqrt(27)))
    assert.is_true(near(t:norm(2, 1):totable(), { 5, math.sqrt(2) }))
    assert.is_true(near(t:norm(1, 1):totable(), { 7, 2 }))
    assert.is_true(near(t:norm("inf", 1):totable(), { 4, 1 }))
    assert.is_true(near(t:norm(math.huge):item(), 4))
    assert.is_true(near(t:logsumexp(1):totable(),
      { math.log(math.exp(3) + math.exp(-4)), 1 + math.log(2) }))
    assert.is_true(near(t:var(1):totable(), { 24.5, 0 }))
    assert.is_true(near(t:var(1, 0):totable(), { 12.25, 0 }))
    assert.is_true(near(t:var(1, false, true):totable(), { { 12.25 }, { 0 } }))
  end)

  it("give closed-form gradients", function()
    local x = moe.tensor({ 3, -4 }, { dtype = "f64", requires_grad = true })
    x:norm():backward()
    assert.is_true(near(x.grad:totable(), { 0.6, -0.8 }))
    x.grad = nil
    x:logsumexp(0):backward()
    local z = math.exp(3) + math.exp(-4)
    assert.is_true(near(x.grad:totable(), { math.exp(3) / z, math.exp(-4) / z }))
    x.grad = nil
    x:var():backward() -- 2 (x - mean) / (n - 1)
    assert.is_true(near(x.grad:totable(), { 7, -7 }))
  end)

  it("reject a bad p", function()
    assert.matches("p must be > 0", errmsg(function() return t:norm(-1) end))
    assert.matches("bad argument #2 to 'norm'", errmsg(function() return t:norm("nuc") end))
  end)
end)

describe("softmax, log_softmax, cumsum", function()
  it("compute rows over a dim", function()
    local t = moe.tensor({ { 1, 2, 3 }, { 0, 0, 0 } }, { dtype = "f64" })
    local z = math.exp(1) + math.exp(2) + math.exp(3)
    assert.is_true(near(t:softmax():totable(),
      { { math.exp(1) / z, math.exp(2) / z, math.exp(3) / z }, { 1 / 3, 1 / 3, 1 / 3 } }))
    assert.is_true(near(t:log_softmax(1):totable()[2], { -math.log(3), -math.log(3), -math.log(3) }))
    assert.is_true(near(moe.softmax(t, 0):totable()[2],
      { 1 / (1 + math.exp(1)), 1 / (1 + math.exp(2)), 1 / (1 + math.exp(3)) }))
    assert.are.same({ { 1, 3, 6 }, { 0, 0, 0 } }, t:cumsum(1):totable())
    assert.are.same({ { 1, 2, 3 }, { 1, 2, 3 } }, t:cumsum(0):totable())
  end)

  it("give gradients", function()
    local x = moe.tensor({ 1, 2, 3, 4 }, { dtype = "f64", requires_grad = true })
    x:cumsum(0):sum():backward()
    assert.are.same({ 4, 3, 2, 1 }, x.grad:totable())
    x.grad = nil
    x:softmax():sum():backward() -- softmax sums to 1: gradient 0
    assert.is_true(near(x.grad:totable(), { 0, 0, 0, 0 }, 1e-12))
    x.grad = nil
    local y = x:log_softmax()
    moe.sum(y:narrow(0, 0, 1)):backward() -- d/dx log p0 = onehot0 - p
    local z = math.exp(1) + math.exp(2) + math.exp(3) + math.exp(4)
    assert.is_true(near(x.grad:totable(),
      { 1 - math.exp(1) / z, -math.exp(2) / z, -math.exp(3) / z, -math.exp(4) / z }))
  end)

  it("rejects a missing cumsum dim", function()
    assert.matches("bad argument #2 to 'cumsum'", errmsg(function() return moe.ones(3):cumsum() end))
  end)
end)

describe("layer_norm and rms_norm", function()
  it("normalise the last dim with optional weight and bias", function()
    local x = moe.tensor({ { 1, 2, 3, 4 } }, { dtype = "f64" })
    local s = 1 / math.sqrt(1.25 + 1e-5)
    assert.is_true(near(moe.layer_norm(x):totable()[1], { -1.5 * s, -0.5 * s, 0.5 * s, 1.5 * s }))
    local w = moe.tensor({ 2, 2, 2, 2 }, { dtype = "f64" })
    local b = moe.tensor({ 1, 1, 1, 1 }, { dtype = "f64" })
    assert.is_true(near(moe.layer_norm(x, w, b, 0):totable()[1],
      { 1 - 3 / math.sqrt(1.25), 1 - 1 / math.sqrt(1.25), 1 + 1 / math.sqrt(1.25), 1 + 3 / math.sqrt(1.25) }))
    local q = 1 / math.sqrt(7.5)
    assert.is_true(near(moe.rms_norm(x, nil, 0):totable()[1], { q, 2 * q, 3 * q, 4 * q }))
  end)

  it("give the weight and bias gradients", function()
    local x = moe.tensor({ { 1, 2 }, { 5, 3 } }, { dtype = "f64" })
    local w = moe.tensor({ 1, 1 }, { dtype = "f64", requires_grad = true })
    local b = moe.tensor({ 0, 0 }, { dtype = "f64", requires_grad = true })
    moe.layer_norm(x, w, b, 0):sum():backward()
    assert.is_true(near(w.grad:totable(), { 0, 0 }, 1e-12)) -- xhat rows are (-1, 1) and (1, -1)
    assert.are.same({ 2, 2 }, b.grad:totable())
  end)

  it("reject bad arguments", function()
    local x = moe.ones(2, 4)
    assert.matches("weight must be a tensor or nil", errmsg(function() return moe.layer_norm(x, 3) end))
    assert.matches("does not match the last dim", errmsg(function() return moe.rms_norm(x, moe.ones(3)) end))
    assert.matches("eps must be finite", errmsg(function() return moe.rms_norm(x, nil, -1) end))
  end)
end)

describe("cross_entropy", function()
  local x = moe.tensor({ { 1, 2, 3 }, { 0, 0, 0 } }, { dtype = "f64" })
  local l0 = math.log(math.exp(1) + math.exp(2) + math.exp(3))

  it("computes mean, sum and per-row losses with ignore_index and smoothing", function()
    local t = moe.tensor({ 2, 0 }, { dtype = "i64" })
    assert.is_true(near(moe.cross_entropy(x, t):item(), (l0 - 3 + math.log(3)) / 2))
    assert.is_true(near(moe.cross_entropy(x, t, { reduction = "sum" }):item(), l0 - 3 + math.log(3)))
    local ti = moe.tensor({ 2, -100 }, { dtype = "i64" })
    assert.is_true(near(moe.cross_entropy(x, ti, { reduction = "none" }):totable(), { l0 - 3, 0 }))
    assert.is_true(near(moe.cross_entropy(x, ti):item(), l0 - 3))
    assert.is_true(near(moe.cross_entropy(x, ti, { label_smoothing = 0.5, reduction = "none" }):totable(),
      { 0.5 * (l0 - 3) + 0.5 * (l0 - 2), 0 }))
  end)

  it("gives softmax minus onehot as the gradient", function()
    local xl = moe.tensor({ { 0, 0 } }, { dtype = "f64", requires_grad = true })
    moe.cross_entropy(xl, moe.tensor({ 1 }, { dtype = "i64" })):backward()
    assert.is_true(near(xl.grad:totable(), { { 0.5, -0.5 } }))
  end)

  it("rejects bad arguments", function()
    local t = moe.tensor({ 2, 0 }, { dtype = "i64" })
    assert.matches("out of range for 3 classes",
      errmsg(function() return moe.cross_entropy(x, moe.tensor({ 3, 0 }, { dtype = "i64" })) end))
    assert.matches("target must be i64", errmsg(function() return moe.cross_entropy(x, moe.tensor({ 2, 0 }, { dtype = "f32" })) end))
    assert.matches("reduction must be", errmsg(function() return moe.cross_entropy(x, t, { reduction = "avg" }) end))
    assert.matches("unknown option 'weight'", errmsg(function() return moe.cross_entropy(x, t, { weight = 1 }) end))
    assert.matches("label_smoothing must be in", errmsg(function() return moe.cross_entropy(x, t, { label_smoothing = 2 }) end))
    assert.matches("options table expected", errmsg(function() return moe.cross_entropy(x, t, "mean") end))
  end)
end)
