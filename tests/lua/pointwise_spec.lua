--[[
tests/lua/pointwise_spec.lua - the pointwise family through the `moe` module:
values of the math functions and activations (functions and methods), pow
with its three forms and the ^ operator, clamp with absent bounds,
comparisons (both operand orders), where, maximum/minimum, swiglu, dropout
(reproducible from the generator state, eval mode), gradients through
t:backward, and bad-argument errors.

Run: moe-lua tests/lua/busted.lua tests/lua/pointwise_spec.lua (ctest does).
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
  if a ~= a and b ~= b then return true end -- NaN
  return math.abs(a - b) <= tol * math.max(1, math.abs(b))
end

local function map(t, f)
  local r = {}
  for i, v in ipairs(t) do r[i] = f(v) end
  return r
end

local function erf(x) -- Abramowitz-Stegun 7.1.26 is too coarse; use a series
  local s, term, n = x, x, 0
  repeat
    n = n + 1
    term = -term * x * x / n
    s = s + term / (2 * n + 1)
  until math.abs(term) < 1e-17
  return 2 / math.sqrt(math.pi) * s
end

local xs = { -2.5, -1, -0.25, 0.5, 1.5, 3 }

describe("unary math and activations", function()
  local refs = {
    exp = math.exp,
    log = function(v) return math.log(math.abs(v)) end,
    sqrt = function(v) return math.sqrt(math.abs(v)) end,
    rsqrt = function(v) return 1 / math.sqrt(math.abs(v)) end,
    abs = math.abs,
    relu = function(v) return v > 0 and v or 0 end,
    gelu = function(v) return 0.5 * v * (1 + erf(v / math.sqrt(2))) end,
    gelu_tanh = function(v)
      local u = math.sqrt(2 / math.pi) * (v + 0.044715 * v ^ 3)
      local t = (math.exp(2 * u) - 1) / (math.exp(2 * u) + 1)
      return 0.5 * v * (1 + t)
    end,
    silu = function(v) return v / (1 + math.exp(-v)) end,
    sigmoid = function(v) return 1 / (1 + math.exp(-v)) end,
    tanh = function(v) return (math.exp(2 * v) - 1) / (math.exp(2 * v) + 1) end,
  }
  local positive = { log = true, sqrt = true, rsqrt = true }
  for name, ref in pairs(refs) do
    it(name .. " matches a reference as function and method (f64)", function()
      local input = positive[name] and map(xs, math.abs) or xs
      local x = moe.tensor(input, { dtype = "f64" })
      local want = map(input, ref)
      assert.is_true(near(moe[name](x):totable(), want, 1e-12))
      assert.is_true(near(x[name](x):totable(), want, 1e-12))
      assert.are.equal("f64", moe[name](x).dtype)
    end)
  end

  it("keep f32 and bf16 dtypes", function()
    local x = moe.tensor(xs)
    assert.are.equal("f32", x:gelu().dtype)
    local b = x:bfloat16():silu()
    assert.are.equal("bf16", b.dtype)
    assert.is_true(near(b:totable(), map(xs, refs.silu), 1e-2))
  end)

  it("reject integer tensors naming the op and dtype", function()
    local i = moe.tensor({ 1, 2 }, { dtype = "i64" })
    assert.has_error(function() i:exp() end, "exp: x has dtype i64; exp takes float tensors (f32, f64, bf16, f16)")
    assert.are.same({ 1, 2 }, moe.abs(moe.tensor({ -1, 2 }, { dtype = "i64" })):totable())
  end)
end)

describe("pow", function()
  it("has tensor^number, number^tensor and tensor^tensor forms", function()
    local a = moe.tensor({ 1, 2, 3 }, { dtype = "f64" })
    assert.is_true(near((a ^ 2):totable(), { 1, 4, 9 }))
    assert.is_true(near((2 ^ a):totable(), { 2, 4, 8 }))
    assert.is_true(near(a:pow(0.5):totable(), { 1, math.sqrt(2), math.sqrt(3) }))
    assert.is_true(near(moe.pow(a, a):totable(), { 1, 4, 27 }))
    assert.is_true(near(moe.pow(3, a):totable(), { 3, 9, 27 }))
  end)

  it("broadcasts", function()
    local a = moe.tensor({ { 1, 2 }, { 3, 4 } }, { dtype = "f32" })
    local b = moe.tensor({ 2, 1 }, { dtype = "f32" })
    assert.is_true(near((a ^ b):totable(), { { 1, 2 }, { 9, 4 } }))
  end)
end)

describe("clamp", function()
  local x = moe.tensor({ -2, -0.5, 0.5, 2 })
  it("takes min and max, either nil", function()
    assert.are.same({ -1, -0.5, 0.5, 1 }, x:clamp(-1, 1):totable())
    assert.are.same({ 0, 0, 0.5, 2 }, x:clamp(0):totable())
    assert.are.same({ -2, -0.5, 0, 0 }, moe.clamp(x, nil, 0):totable())
  end)
  it("rejects no bounds and bad bounds", function()
    assert.has_error(function() x:clamp() end, "bad argument #2 to 'clamp' (min or max must be given (both are nil))")
    assert.has_error(function() x:clamp("a") end, "bad argument #2 to 'clamp' (min must be a number, got string)")
    assert.has_error(function() x:clamp(0, 1, 2) end)
  end)
end)

describe("comparisons", function()
  local a = moe.tensor({ { 1, 2, 3 }, { 4, 5, 6 } })
  local b = moe.tensor({ 2, 2, 2 })
  it("compare tensors with broadcasting and give bool", function()
    assert.are.equal("bool", a:lt(b).dtype)
    assert.are.same({ { true, false, false }, { false, false, false } }, a:lt(b):totable())
    assert.are.same({ { false, true, false }, { false, false, false } }, a:eq(b):totable())
    assert.are.same({ { true, false, true }, { true, true, true } }, moe.ne(a, b):totable())
  end)
  it("compare with numbers on either side", function()
    assert.are.same({ { false, false, true }, { true, true, true } }, a:gt(2):totable())
    assert.are.same({ { false, false, true }, { true, true, true } }, moe.lt(2, a):totable())
    assert.are.same({ { true, true, false }, { false, false, false } }, moe.ge(2, a):totable())
    assert.are.same({ { false, true, true }, { true, true, true } }, a:ge(2):totable())
    assert.are.same({ { true, true, false }, { false, false, false } }, a:le(2):totable())
  end)
  it("reject a bad operand", function()
    assert.has_error(function() a:lt("x") end, "bad argument #2 to 'lt' (tensor or number expected, got string)")
    assert.has_error(function() moe.eq(1, 2) end, "bad argument #2 to 'eq' (tensor expected, got number)")
    assert.has_error(function() a:lt(moe.zeros(4)) end)
  end)
end)

describe("where, maximum, minimum", function()
  it("select with broadcasting and numbers", function()
    local x = moe.tensor({ -1, 2, -3 })
    assert.are.same({ 0, 2, 0 }, moe.where(x:gt(0), x, 0):totable())
    assert.are.same({ -1, 9, -3 }, x:where(x:lt(0), 9):totable())
    assert.are.same({ 0, 2, 0 }, x:maximum(0):totable())
    assert.are.same({ -1, 0, -3 }, moe.minimum(x, moe.zeros(1)):totable())
  end)
  it("check cond", function()
    local x = moe.tensor({ 1.5 })
    assert.has_error(function() moe.where(x, x, x) end,
      "bad argument #1 to 'where' (cond must be a bool tensor, got f32)")
    assert.has_error(function() x:where(x:gt(0)) end,
      "bad argument #3 to 'where' (tensor or number expected, got no value)")
  end)
end)

describe("swiglu and dropout", function()
  it("swiglu is silu(gate) * up", function()
    local g = moe.tensor({ -1, 0.5, 2 }, { dtype = "f64" })
    local u = moe.tensor({ 3, -2, 0.5 }, { dtype = "f64" })
    assert.is_true(near(moe.swiglu(g, u):totable(), (g:silu() * u):totable(), 1e-12))
    assert.is_true(near(g:swiglu(u):totable(), (g:silu() * u):totable(), 1e-12))
    assert.has_error(function() moe.swiglu(g, moe.zeros(2, { dtype = "f64" })) end,
      "swiglu: gate [3] and up [2] must have the same shape")
  end)

  it("dropout is reproducible, scales by 1/(1-p), and is the identity in eval", function()
    local x = moe.ones(1000)
    moe.manual_seed(7)
    local a = x:dropout(0.25)
    moe.manual_seed(7)
    local b = moe.dropout(x, 0.25, true)
    assert.are.same(a:totable(), b:totable())
    local kept = 0
    for _, v in ipairs(a:totable()) do
      assert.is_true(v == 0 or near(v, 1 / 0.75))
      if v ~= 0 then kept = kept + 1 end
    end
    assert.is_true(kept > 700 and kept < 800)
    assert.are.same(x:totable(), x:dropout(0.5, false):totable())
    assert.has_error(function() x:dropout(1.5) end, "bad argument #2 to 'dropout' (p must be in [0, 1], got 1.5)")
    assert.has_error(function() x:dropout(0.5, 1) end,
      "bad argument #3 to 'dropout' (training must be a boolean, got number)")
  end)
end)

describe("gradients", function()
  it("flow through the activations", function()
    local x = moe.tensor({ -1, 0.5, 2 }, { dtype = "f64", requires_grad = true })
    local y = x:sigmoid()
    y:backward(moe.ones(3, { dtype = "f64" }))
    local want = map({ -1, 0.5, 2 }, function(v)
      local s = 1 / (1 + math.exp(-v))
      return s * (1 - s)
    end)
    assert.is_true(near(x.grad:totable(), want, 1e-12))
  end)

  it("of pow go to base and exponent", function()
    local a = moe.tensor({ 2, 3 }, { dtype = "f64", requires_grad = true })
    local b = moe.tensor({ 3, 2 }, { dtype = "f64", requires_grad = true })
    moe.pow(a, b):backward(moe.ones(2, { dtype = "f64" }))
    assert.is_true(near(a.grad:totable(), { 3 * 4, 2 * 3 }, 1e-12))
    assert.is_true(near(b.grad:totable(), { 8 * math.log(2), 9 * math.log(3) }, 1e-12))
  end)

  it("of maximum split ties, of where follow cond, of swiglu reach both", function()
    local a = moe.tensor({ 1, 2, 3 }, { dtype = "f64", requires_grad = true })
    local b = moe.tensor({ 1, 5, 0 }, { dtype = "f64", requires_grad = true })
    moe.maximum(a, b):backward(moe.ones(3, { dtype = "f64" }))
    assert.are.same({ 0.5, 0, 1 }, a.grad:totable())
    assert.are.same({ 0.5, 1, 0 }, b.grad:totable())
    a.grad = nil
    b.grad = nil
    moe.where(a:gt(1.5), a, b):backward(moe.ones(3, { dtype = "f64" }))
    assert.are.same({ 0, 1, 1 }, a.grad:totable())
    assert.are.same({ 1, 0, 0 }, b.grad:totable())
    a.grad = nil
    b.grad = nil
    moe.swiglu(a, b):backward(moe.ones(3, { dtype = "f64" }))
    local s = 1 / (1 + math.exp(-2))
    assert.is_true(near(a.grad:select(0, 1):item(), 5 * s * (1 + 2 * (1 - s)), 1e-12))
    assert.is_true(near(b.grad:select(0, 1):item(), 2 * s, 1e-12))
  end)

  it("of dropout use the forward's mask", function()
    local x = moe.ones(64, { dtype = "f64", requires_grad = true })
    local y = x:dropout(0.5)
    y:backward(moe.ones(64, { dtype = "f64" }))
    assert.are.same(y:totable(), x.grad:totable())
  end)

  it("do not flow from comparisons", function()
    local x = moe.tensor({ 1, 2 }, { dtype = "f32", requires_grad = true })
    assert.is_false(x:gt(1).requires_grad)
    assert.is_true(x:exp().requires_grad)
  end)
end)
