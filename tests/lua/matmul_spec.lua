--[[
tests/lua/matmul_spec.lua - moe.matmul, moe.bmm, moe.linear and their
tensor methods through the Lua API: values (every 1-D case, broadcasting,
transposed views, dtypes), gradients through backward, the TF32 switch,
and bad arguments naming the argument at fault. On a CUDA GPU the same
products are also compared with the CPU.

Run: moe-lua tests/lua/busted.lua tests/lua/matmul_spec.lua (ctest does).
Dims are 0-based, as everywhere in the moe API; Lua tables are 1-based.
]]
local moe = require "moe"

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

local function f64(t) return moe.tensor(t, { dtype = "f64" }) end

local A = { { 1, 2, 3 }, { 4, 5, 6 } }
local B = { { 7, 8 }, { 9, 10 }, { 11, 12 } }

describe("matmul", function()
  it("multiplies matrices in every float dtype", function()
    for _, dt in ipairs { "f32", "f64", "bf16", "f16" } do
      local r = moe.matmul(moe.tensor(A, { dtype = dt }), moe.tensor(B, { dtype = dt }))
      assert.are.equal(dt, r.dtype)
      assert.are.same({ { 58, 64 }, { 139, 154 } }, r:totable())
    end
  end)

  it("is also a tensor method", function()
    assert.are.same({ { 58, 64 }, { 139, 154 } }, f64(A):matmul(f64(B)):totable())
  end)

  it("follows torch.matmul for 1-D operands", function()
    local v, w = f64 { 1, 2, 3 }, f64 { 4, 5, 6 }
    local dot = moe.matmul(v, w)
    assert.are.same({}, dot.shape)
    assert.are.equal(32, dot:item())
    assert.are.same({ 14, 32 }, moe.matmul(f64(A), v):totable())
    assert.are.same({ 58, 64 }, moe.matmul(v, f64(B)):totable())
  end)

  it("broadcasts batch dims", function()
    local a = moe.randn({ 2, 1, 3, 4 }, { dtype = "f64" })
    local b = moe.randn({ 5, 4, 2 }, { dtype = "f64" })
    local r = moe.matmul(a, b)
    assert.are.same({ 2, 5, 3, 2 }, r.shape)
    -- element [1][3][2][1] (0-based [1, 3, 2, 1]) by hand
    local at, bt = a:totable(), b:totable()
    local s = 0
    for k = 1, 4 do s = s + at[2][1][3][k] * bt[4][k][2] end
    assert.is_true(near(r:totable()[2][4][3][2], s, 1e-12))
  end)

  it("takes transposed views without changing the result", function()
    local a = moe.randn({ 5, 4 }, { dtype = "f64" })
    local b = moe.randn({ 3, 5 }, { dtype = "f64" })
    local r1 = moe.matmul(a:transpose(0, 1), b:transpose(0, 1))
    local r2 = moe.matmul(a:transpose(0, 1):contiguous(), b:transpose(0, 1):contiguous())
    assert.is_true(near(r1:totable(), r2:totable(), 1e-12))
  end)

  it("gives gradients for both operands", function()
    local a = moe.tensor(A, { dtype = "f64", requires_grad = true })
    local b = moe.tensor(B, { dtype = "f64", requires_grad = true })
    local r = moe.matmul(a, b)
    assert.are.equal("matmul", r.grad_fn)
    r:backward(moe.ones({ 2, 2 }, { dtype = "f64" }))
    assert.are.same({ { 15, 19, 23 }, { 15, 19, 23 } }, a.grad:totable())
    assert.are.same({ { 5, 5 }, { 7, 7 }, { 9, 9 } }, b.grad:totable())
  end)

  it("gives the gradient of a dot product", function()
    local v = moe.tensor({ 1, 2, 3 }, { dtype = "f64", requires_grad = true })
    local w = moe.tensor({ 4, 5, 6 }, { dtype = "f64", requires_grad = true })
    moe.matmul(v, w):backward()
    assert.are.same({ 4, 5, 6 }, v.grad:totable())
    assert.are.same({ 1, 2, 3 }, w.grad:totable())
  end)

  it("records nothing under no_grad", function()
    local a = moe.tensor(A, { dtype = "f64", requires_grad = true })
    local r
    moe.no_grad(function() r = moe.matmul(a, f64(B)) end)
    assert.is_nil(r.grad_fn)
    assert.is_false(r.requires_grad)
  end)

  it("rejects shapes, dtypes and values that do not fit", function()
    local ok, err = pcall(moe.matmul, moe.zeros(4, 7), moe.zeros(5, 3))
    assert.is_false(ok)
    assert.matches("bad argument #2 to 'matmul' %(shapes %[4, 7%] and %[5, 3%] cannot be multiplied %(7 != 5%)%)", err)
    ok, err = pcall(moe.matmul, moe.zeros(2, 3), moe.zeros({ 3, 2 }, { dtype = "f64" }))
    assert.is_false(ok)
    assert.matches("bad argument #2 to 'matmul' %(the first operand is f32 but the second operand is f64", err)
    ok, err = pcall(moe.matmul, moe.zeros({ 2, 3 }, { dtype = "i32" }), moe.zeros(3, 2))
    assert.is_false(ok)
    assert.matches("bad argument #1 to 'matmul' %(the first operand has dtype i32", err)
    ok, err = pcall(moe.matmul, moe.zeros(2, 3), 5)
    assert.is_false(ok)
    assert.matches("bad argument #2 to 'matmul' %(tensor expected, got number%)", err)
    ok, err = pcall(moe.matmul, moe.zeros(2, 3))
    assert.is_false(ok)
    assert.matches("bad argument #2 to 'matmul' %(tensor expected, got no value%)", err)
    ok, err = pcall(moe.matmul, moe.zeros(2, 3), moe.zeros(3, 2), moe.zeros(1))
    assert.is_false(ok)
    assert.matches("bad argument #3 to 'matmul' %(unexpected extra argument", err)
    ok, err = pcall(moe.matmul, moe.zeros({}), moe.zeros(3))
    assert.is_false(ok)
    assert.matches("at least 1 dim", err)
    local freed = moe.zeros(3, 3)
    freed:free()
    ok, err = pcall(moe.matmul, moe.zeros(3, 3), freed)
    assert.is_false(ok)
    assert.matches("bad argument #2 to 'matmul' %(attempt to use a freed tensor%)", err)
  end)
end)

describe("bmm", function()
  it("multiplies batches of matrices", function()
    local a = f64 { { { 1, 2 } }, { { 3, 4 } } }
    local b = f64 { { { 5 }, { 6 } }, { { 7 }, { 8 } } }
    assert.are.same({ { { 17 } }, { { 53 } } }, moe.bmm(a, b):totable())
    assert.are.same({ { { 17 } }, { { 53 } } }, a:bmm(b):totable())
  end)

  it("gives gradients", function()
    local a = moe.tensor({ { { 1, 2 } }, { { 3, 4 } } }, { dtype = "f64", requires_grad = true })
    local b = moe.tensor({ { { 5 }, { 6 } }, { { 7 }, { 8 } } }, { dtype = "f64", requires_grad = true })
    local r = moe.bmm(a, b)
    assert.are.equal("bmm", r.grad_fn)
    r:backward(f64 { { { 1 } }, { { 2 } } })
    assert.are.same({ { { 5, 6 } }, { { 14, 16 } } }, a.grad:totable())
    assert.are.same({ { { 1 }, { 2 } }, { { 6 }, { 8 } } }, b.grad:totable())
  end)

  it("rejects what is not a pair of 3-D batches of one size", function()
    local ok, err = pcall(moe.bmm, moe.zeros(2, 3), moe.zeros(3, 2))
    assert.is_false(ok)
    assert.matches("bad argument #2 to 'bmm' %(both operands must be 3%-D", err)
    ok, err = pcall(moe.bmm, moe.zeros(2, 1, 3), moe.zeros(3, 3, 2))
    assert.is_false(ok)
    assert.matches("different batch sizes %(2 != 3%)", err)
  end)
end)

describe("linear", function()
  local X = { { 1, 2, 3 }, { 4, 5, 6 } }
  local W = { { 1, 0, -1 }, { 2, 1, 0 } }

  it("computes x W^T + b, with and without a bias", function()
    local x, w, b = f64(X), f64(W), f64 { 10, 20 }
    assert.are.same({ { 8, 24 }, { 8, 33 } }, moe.linear(x, w, b):totable())
    assert.are.same({ { -2, 4 }, { -2, 13 } }, moe.linear(x, w):totable())
    assert.are.same({ { -2, 4 }, { -2, 13 } }, x:linear(w, nil):totable())
    assert.are.same({ 8, 33 }, moe.linear(f64 { 4, 5, 6 }, w, b):totable())
    assert.are.same({ 2, 5, 2 }, moe.linear(moe.zeros({ 2, 5, 3 }, { dtype = "f64" }), w, b).shape)
  end)

  it("gives gradients for input, weight and bias", function()
    local x = moe.tensor(X, { dtype = "f64", requires_grad = true })
    local w = moe.tensor({ { 7, 9, 11 }, { 8, 10, 12 } }, { dtype = "f64", requires_grad = true })
    local b = moe.tensor({ 0.5, -0.5 }, { dtype = "f64", requires_grad = true })
    local r = moe.linear(x, w, b)
    assert.are.equal("linear", r.grad_fn)
    r:backward(f64 { { 1, 2 }, { 3, 4 } })
    assert.are.same({ { 23, 29, 35 }, { 53, 67, 81 } }, x.grad:totable())
    assert.are.same({ { 13, 17, 21 }, { 18, 24, 30 } }, w.grad:totable())
    assert.are.same({ 4, 6 }, b.grad:totable())
  end)

  it("names the argument at fault", function()
    local ok, err = pcall(moe.linear, moe.zeros(4, 7), moe.zeros(5, 3))
    assert.is_false(ok)
    assert.matches("bad argument #2 to 'linear' %(input %[4, 7%] and weight %[5, 3%] cannot be multiplied %(in features 7 != 3%)%)", err)
    ok, err = pcall(moe.linear, moe.zeros(2, 3), moe.zeros(5, 3), moe.zeros(4))
    assert.is_false(ok)
    assert.matches("bad argument #3 to 'linear' %(bias of shape %[4%] does not fit weight %[5, 3%]", err)
    ok, err = pcall(moe.linear, moe.zeros(2, 3), moe.zeros(5, 3), "bias")
    assert.is_false(ok)
    assert.matches("bad argument #3 to 'linear' %(tensor expected, got string%)", err)
    ok, err = pcall(moe.linear, moe.zeros({ 2, 3 }, { dtype = "i64" }), moe.zeros(5, 3))
    assert.is_false(ok)
    assert.matches("bad argument #1 to 'linear' %(the input has dtype i64", err)
  end)
end)

describe("the TF32 switch", function()
  it("is off by default and returns the previous setting", function()
    assert.is_false(moe.matmul_tf32())
    assert.is_false(moe.set_matmul_tf32(true))
    assert.is_true(moe.matmul_tf32())
    assert.is_true(moe.set_matmul_tf32(false))
    assert.is_false(moe.matmul_tf32())
    local ok, err = pcall(moe.set_matmul_tf32, 1)
    assert.is_false(ok)
    assert.matches("bad argument #1 to 'set_matmul_tf32' %(boolean expected, got number%)", err)
  end)
end)

local gpu = moe.cuda.is_available()
local function gpu_it(name, fn)
  if gpu then it(name, fn) else pending(name .. " (no CUDA GPU)") end
end

describe("matmul on cuda", function()
  -- f32 on CUDA runs in full f32 (no TF32): sums of 33 products of values
  -- in N(0, 1) agree with the CPU to about 1e-5 relative.
  gpu_it("agrees with the CPU in f32, with gradients", function()
    local a = moe.randn({ 3, 17, 33 }, { dtype = "f32" })
    local w = moe.randn({ 9, 33 }, { dtype = "f32" })
    local b = moe.randn({ 9 }, { dtype = "f32" })
    local cpu = moe.linear(a, w, b)
    local dev = moe.linear(a:cuda(), w:cuda(), b:cuda())
    assert.are.equal("cuda:0", dev.device)
    assert.is_true(near(dev:cpu():totable(), cpu:totable(), 1e-4))
    local wc = w:cuda():detach():requires_grad_()
    local r = moe.matmul(a:cuda(), wc:transpose(0, 1))
    r:backward(moe.ones({ 3, 17, 9 }, { device = "cuda" }))
    assert.are.same({ 9, 33 }, wc.grad.shape)
    assert.are.equal("cuda:0", wc.grad.device)
  end)

  gpu_it("rejects operands on different devices", function()
    local ok, err = pcall(moe.matmul, moe.zeros(2, 3), moe.zeros({ 3, 2 }, { device = "cuda" }))
    assert.is_false(ok)
    assert.matches("bad argument #2 to 'matmul' %(the first operand is on cpu but the second operand is on cuda:0%)", err)
  end)
end)
