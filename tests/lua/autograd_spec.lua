--[[
tests/lua/autograd_spec.lua - autograd through the `moe` Lua API: the
requires_grad option and the fields requires_grad, grad, is_leaf, grad_fn;
t:backward with accumulation and retain_graph; grad mode (no_grad,
enable_grad, set_grad_enabled) restored on errors; detach and zero_grad;
gradients through views and broadcasting checked by moe.gradcheck;
differentiable functions written in Lua (moe.Function, one and two outputs);
saved-tensor hooks (counting pack/unpack, a bf16 cast, a bad unpack); and
the errors of every entry point.

Run: moe-lua tests/lua/busted.lua tests/lua/autograd_spec.lua (ctest does).
]]
local moe = require "moe"

local function near(a, b, tol)
  tol = tol or 1e-9
  if type(a) == "table" then
    if type(b) ~= "table" or #a ~= #b then return false end
    for i = 1, #a do
      if not near(a[i], b[i], tol) then return false end
    end
    return true
  end
  return math.abs(a - b) <= tol * math.max(1, math.abs(b))
end

local function leaf(values, dtype)
  return moe.tensor(values, { dtype = dtype or "f64", requires_grad = true })
end

local function ones_like(t) return moe.ones(t.shape, { dtype = t.dtype, device = t.device }) end

describe("autograd fields", function()
  it("requires_grad as a constructor option and a field", function()
    local x = moe.zeros({ 2, 3 }, { requires_grad = true })
    assert.is_true(x.requires_grad)
    assert.is_true(x.is_leaf)
    assert.is_nil(x.grad_fn)
    assert.is_nil(x.grad)
    for _, make in ipairs({
      function() return moe.ones(2, { requires_grad = true }) end,
      function() return moe.rand(2, { requires_grad = true }) end,
      function() return moe.randn(2, { requires_grad = true }) end,
      function() return moe.full({ 2 }, 1.5, { requires_grad = true }) end,
      function() return moe.arange(0, 1, 0.5, { requires_grad = true }) end,
      function() return moe.linspace(0, 1, 3, { requires_grad = true }) end,
      function() return moe.tensor({ 1.5 }, { requires_grad = true }) end,
    }) do
      assert.is_true(make().requires_grad)
    end
    local y = moe.ones(2)
    assert.is_false(y.requires_grad)
    y.requires_grad = true
    assert.is_true(y.requires_grad)
    y.requires_grad = false
    assert.is_false(y.requires_grad)
    assert.are.equal(y, y:requires_grad_())
    assert.is_true(y.requires_grad)
    y:requires_grad_(false)
    assert.is_false(y.requires_grad)
  end)

  it("results are not leaves and name their grad_fn", function()
    local x = leaf({ 1, 2 })
    local y = x * 2
    assert.is_false(y.is_leaf)
    assert.is_true(y.requires_grad)
    assert.are.equal("mul", y.grad_fn)
    assert.are.equal("add", (x + x).grad_fn)
    assert.are.equal("sub", (1 - x).grad_fn)
    assert.are.equal("div", (x / 3).grad_fn)
    assert.are.equal("neg", (-x).grad_fn)
    assert.are.equal("transpose", x:view(1, 2):transpose(0, 1).grad_fn)
    assert.are.equal("view", x:view(2, 1).grad_fn)
    assert.are.equal("copy", x:to("f32").grad_fn)
    assert.are.equal("copy", x:clone().grad_fn)
    assert.are.equal("expand", x:expand(3, 2).grad_fn)
  end)

  it("grad can be set and cleared", function()
    local x = leaf({ 1, 2 })
    x.grad = moe.tensor({ 5, 6 }, { dtype = "f64" })
    assert.are.same({ 5, 6 }, x.grad:totable())
    x.grad = nil
    assert.is_nil(x.grad)
  end)
end)

describe("backward", function()
  it("computes hand-checked gradients with broadcasting", function()
    local a = leaf({ { 1, 2, 3 }, { 4, 5, 6 } })
    local b = leaf({ 0.5, -1, 2 })
    local y = a * b + a / 2 - b
    y:backward(ones_like(y))
    assert.is_true(near({ { 1, -0.5, 2.5 }, { 1, -0.5, 2.5 } }, a.grad:totable()))
    assert.is_true(near({ 1 + 4 - 2, 2 + 5 - 2, 3 + 6 - 2 }, b.grad:totable()))
  end)

  it("accumulates into .grad and frees the graph unless retain_graph", function()
    local x = leaf({ 1, 2 })
    local y = x * x
    local g = ones_like(y)
    y:backward(g, { retain_graph = true })
    assert.are.same({ 2, 4 }, x.grad:totable())
    y:backward(g)
    assert.are.same({ 4, 8 }, x.grad:totable())
    local ok, err = pcall(y.backward, y, g)
    assert.is_false(ok)
    assert.matches("retain_graph", err)
    moe.zero_grad({ x })
    assert.is_nil(x.grad)
    local s = leaf({ 3 })
    local t = s * s
    t:backward()
    assert.are.same({ 6 }, s.grad:totable())
  end)

  it("keeps each input's dtype", function()
    local x = leaf({ 1, 2 }, "bf16")
    local y = x:to("f32") * moe.tensor({ 3, 4 })
    assert.are.equal("f32", y.dtype)
    y:backward(ones_like(y))
    assert.are.equal("bf16", x.grad.dtype)
    assert.are.same({ 3, 4 }, x.grad:totable())
  end)

  it("detach cuts the history and shares the storage", function()
    local x = leaf({ 1, 2 })
    local y = x * 2
    local d = y:detach()
    assert.is_false(d.requires_grad)
    assert.is_true(d.is_leaf)
    assert.are.same({ 2, 4 }, d:totable())
    local ok, err = pcall(function() (d * d):backward(ones_like(d)) end)
    assert.is_false(ok)
    assert.matches("does not require grad and has no grad_fn", err, 1, true)
  end)
end)

describe("grad mode", function()
  it("no_grad records nothing and returns fn's results", function()
    local x = leaf({ 1, 2 })
    local a, b = moe.no_grad(function(p, q) return x * p, q end, 3, "q")
    assert.is_false(a.requires_grad)
    assert.are.equal("q", b)
    assert.is_true(moe.is_grad_enabled())
  end)

  it("restores the mode when fn raises", function()
    local ok, err = pcall(moe.no_grad, function() error("boom") end)
    assert.is_false(ok)
    assert.matches("boom", err)
    assert.is_true(moe.is_grad_enabled())
    moe.no_grad(function()
      assert.is_false(moe.is_grad_enabled())
      local ok2 = pcall(moe.enable_grad, function()
        assert.is_true(moe.is_grad_enabled())
        error("inner")
      end)
      assert.is_false(ok2)
      assert.is_false(moe.is_grad_enabled())
    end)
    assert.is_true(moe.set_grad_enabled(false))
    assert.is_false(moe.set_grad_enabled(true))
  end)

  it("in-place writes into a leaf that requires grad need no_grad", function()
    local x = leaf({ 1, 2 })
    local ok, err = pcall(x.fill_, x, 0)
    assert.is_false(ok)
    assert.matches("a leaf tensor that requires grad is being used in an in-place operation", err, 1, true)
    moe.no_grad(function() x:copy_(x * 2) end)
    assert.are.same({ 2, 4 }, x:totable())
  end)
end)

describe("moe.gradcheck", function()
  it("checks arithmetic with broadcasting on contiguous and non-contiguous leaves", function()
    local a = leaf({ { 1.5, -0.5, 2 }, { 0.7, 1.1, -1.3 } })
    local b = leaf({ 0.9, -1.2, 1.4 })
    local f = function(p, q) return (p * q - p / q + q) * 0.5 - (-p) + 2 / q end
    assert(moe.gradcheck(f, { a, b }))
    local at = moe.no_grad(function() return leaf({ { 1.5, -0.5 }, { 2, 0.7 }, { 1.1, -1.3 } }):transpose(0, 1):detach() end)
    at.requires_grad = true
    assert.is_false(at:is_contiguous())
    assert(moe.gradcheck(f, { at, b }))
  end)

  it("checks gradients through views", function()
    local x = leaf({ { 1, 2, 3, 4 }, { 5, 6, 7, 8 }, { 9, 10, 11, 12 } })
    local v = leaf({ { 0.5 }, { -1.5 } })
    local f = function(p, q)
      local t = p:transpose(0, 1):narrow(0, 1, 2):slice(1, 0, 3, 2) -- (2, 2)
      local e = q:expand(2, 2):unsqueeze(0):squeeze(0)
      return (t:reshape(4):view(2, 2) * e):permute({ 1, 0 }):select(0, 1):contiguous()
    end
    assert(moe.gradcheck(f, { x, v }))
  end)

  it("reports a wrong gradient with the input and element", function()
    local bad = moe.Function {
      name = "bad",
      forward = function(ctx, a) return a * a end,
      backward = function(ctx, g) return g end, -- should be 2 a g
    }
    local ok, msg = moe.gradcheck(function(a) return bad(a) end, { leaf({ 3, 4 }) })
    assert.is_false(ok)
    assert.matches("input 1 element 0", msg, 1, true)
  end)
end)

describe("moe.Function", function()
  local square = moe.Function {
    name = "mysquare",
    forward = function(ctx, a)
      ctx:save_for_backward(a)
      return a * a
    end,
    backward = function(ctx, g)
      local a = ctx.saved_tensors[1]
      return g * a * 2
    end,
  }

  it("defines a differentiable op in Lua", function()
    local x = leaf({ 1, -2, 3 })
    local y = square(x)
    assert.are.equal("mysquare", y.grad_fn)
    assert.are.same({ 1, 4, 9 }, y:totable())
    y:backward(ones_like(y))
    assert.are.same({ 2, -4, 6 }, x.grad:totable())
    x.grad = nil
    assert(moe.gradcheck(function(a) return square(a) * a end, { x }))
  end)

  it("has two outputs and non-tensor arguments", function()
    local needs
    local sumprod = moe.Function {
      name = "sumprod",
      forward = function(ctx, a, b, k)
        ctx:save_for_backward(a, b)
        ctx.k = k
        needs = ctx.needs_input_grad
        return (a + b) * k, a * b
      end,
      backward = function(ctx, gs, gp)
        local a, b = ctx.saved_tensors[1], ctx.saved_tensors[2]
        assert.are.equal(2, ctx.saved_tensors.n)
        local ga, gb = gs * ctx.k, gs * ctx.k
        if gp then ga, gb = ga + gp * b, gb + gp * a end
        return ga, gb, nil
      end,
    }
    local a, b = leaf({ 1, 2, 3 }), leaf({ -1, 0.5, 2 })
    local s, p = sumprod(a, b, 3)
    assert.are.equal("sumprod", s.grad_fn)
    assert.are.equal("sumprod", p.grad_fn)
    assert.are.same({ true, true, false }, needs)
    moe.no_grad(sumprod, a, b, 1)
    assert.are.same({ false, false, false }, needs)
    assert(moe.gradcheck(function(x, y)
      local s2, p2 = sumprod(x, y, 3)
      return s2 * 2 + p2 * s2
    end, { a, b }))
    -- only one output used: the other gradient arrives as nil
    assert(moe.gradcheck(function(x, y) return (sumprod(x, y, 2)) end, { a, b }))
  end)

  it("runs forward only, without a graph, under no_grad", function()
    local x = leaf({ 2 })
    local y = moe.no_grad(square, x)
    assert.is_false(y.requires_grad)
    assert.are.same({ 4 }, y:totable())
  end)

  it("returns a fresh tensor when forward returns an input", function()
    local ident = moe.Function {
      forward = function(ctx, a) return a end,
      backward = function(ctx, g) return g end,
    }
    local x = leaf({ 1, 2 })
    local y = ident(x)
    assert.is_true(x.is_leaf)
    assert.is_false(y.is_leaf)
    assert.are.equal("Function", y.grad_fn)
    y:backward(ones_like(y))
    assert.are.same({ 1, 1 }, x.grad:totable())
  end)

  it("turns errors of forward and backward into Lua errors", function()
    local x = leaf({ 1, 2 })
    local f1 = moe.Function { name = "f1", forward = function() error("fwd boom") end,
      backward = function() end }
    local ok, err = pcall(f1, x)
    assert.is_false(ok)
    assert.matches("fwd boom", err)
    local f2 = moe.Function { name = "f2", forward = function(ctx, a) return a * 1 end,
      backward = function() error("bwd boom") end }
    local y = f2(x)
    ok, err = pcall(y.backward, y, ones_like(y))
    assert.is_false(ok)
    assert.matches("backward of f2: .*bwd boom", err)
    local f3 = moe.Function { name = "f3", forward = function(ctx, a) return a * 1 end,
      backward = function(ctx, g) return moe.ones(5, { dtype = "f64" }) end }
    y = f3(x)
    ok, err = pcall(y.backward, y, ones_like(y))
    assert.is_false(ok)
    assert.matches("backward of f3: the gradient of input 0 has shape [5], expected [2]", err, 1, true)
    local f4 = moe.Function { name = "f4", forward = function(ctx, a) return a * 1 end,
      backward = function(ctx, g) return "nope" end }
    y = f4(x)
    ok, err = pcall(y.backward, y, ones_like(y))
    assert.is_false(ok)
    assert.matches("is string, not a tensor or nil", err, 1, true)
  end)
end)

describe("saved_tensor_hooks", function()
  it("packs every saved tensor and unpacks it in backward", function()
    local packs, unpacks = 0, 0
    local x = leaf({ 1, 2, 3 })
    local y = moe.saved_tensor_hooks(function(t)
      packs = packs + 1
      return t
    end, function(t)
      unpacks = unpacks + 1
      return t
    end, function() return x * x + x / 2 end) -- mul saves 2, div by a scalar 0
    assert.are.equal(2, packs)
    assert.are.equal(0, unpacks)
    local z = x * x -- outside the scope: no packing
    assert.are.equal(2, packs)
    y:backward(ones_like(y))
    assert.are.equal(2, unpacks)
    assert.are.same({ 2.5, 4.5, 6.5 }, x.grad:totable())
    z:free()
  end)

  it("can keep saved tensors in bf16", function()
    local x = leaf({ 1.001, 2.5, -3.25 }, "f32")
    local w = moe.tensor({ 0.3, 0.7, 1.9 }, { requires_grad = true })
    local casts = 0
    local y = moe.saved_tensor_hooks(function(t)
      casts = casts + 1
      return { t:to("bf16"), t.dtype }
    end, function(p) return p[1]:to(p[2]) end, function() return x * w end)
    assert.are.equal(2, casts)
    y:backward(ones_like(y))
    -- dy/dx = w, dy/dw = x, as rounded to bf16 (8 bits: relative error <= 2^-8)
    assert.is_true(near({ 0.3, 0.7, 1.9 }, x.grad:totable(), 2 ^ -8))
    assert.is_true(near({ 1.001, 2.5, -3.25 }, w.grad:totable(), 2 ^ -8))
    local y2 = moe.autograd.with_saved_dtype("bf16", function() return x * w end)
    y2:backward(ones_like(y2))
    assert.is_true(near({ 0.6, 1.4, 3.8 }, x.grad:totable(), 2 ^ -8))
  end)

  it("names a bad unpack and pops the hooks on error", function()
    local x = leaf({ { 1, 2 }, { 3, 4 } })
    local y = moe.saved_tensor_hooks(function(t) return t end,
      function(t) return t:reshape(4) end, function() return x * x end)
    local ok, err = pcall(y.backward, y, ones_like(y))
    assert.is_false(ok)
    assert.matches("mul: the unpack hook gave shape [4] for saved slot 0, which had shape [2, 2]", err, 1, true)
    local calls = 0
    ok, err = pcall(moe.saved_tensor_hooks, function(t) calls = calls + 1; return t end,
      function(t) return t end, function() error("scope boom") end)
    assert.is_false(ok)
    assert.matches("scope boom", err)
    local z = x * x
    assert.are.equal(0, calls)
    ok, err = pcall(moe.saved_tensor_hooks, function(t) error("pack boom") end,
      function(t) return t end, function() return x * x end)
    assert.is_false(ok)
    assert.matches("pack boom", err)
    z:free()
  end)
end)

describe("bad arguments", function()
  local x = leaf({ 1, 2 })
  local cases = {
    { function() return x:backward("g") end, "bad argument #2 to 'backward' (gradient tensor or options table expected, got string)" },
    { function() return x:backward(nil, { retain = true }) end, "unknown option 'retain' (valid options: retain_graph)" },
    { function() return x:backward(nil, { retain_graph = 1 }) end, "retain_graph must be a boolean" },
    { function() return (x * 2):backward() end, "implied only for a tensor of one element" },
    { function() return (x * 2):backward(moe.ones(3, { dtype = "f64" })) end, "gradient of shape [3] for a tensor of shape [2]" },
    { function() return x:requires_grad_("yes") end, "bad argument #2 to 'requires_grad_' (boolean expected, got string)" },
    { function() return (x * 2):requires_grad_(false) end, "only leaf tensors can change requires_grad" },
    { function() return moe.ones(2, { dtype = "i64", requires_grad = true }) end, "only floating-point tensors can require grad, not i64" },
    { function() x.foo = 1 end, "cannot set field 'foo' of a tensor (settable fields: grad, requires_grad)" },
    { function() x.grad = 5 end, "bad argument #3 to 'grad' (tensor or nil expected, got number)" },
    { function() x.grad = moe.ones(3, { dtype = "f64" }) end, "gradient of shape [3] for a tensor of shape [2]" },
    { function() x.requires_grad = 1 end, "bad argument #3 to 'requires_grad' (boolean expected, got number)" },
    { function() return moe.no_grad(5) end, "bad argument #1 to 'no_grad' (function expected, got number)" },
    { function() return moe.enable_grad() end, "bad argument #1 to 'enable_grad' (function expected, got no value)" },
    { function() return moe.set_grad_enabled("on") end, "bad argument #1 to 'set_grad_enabled' (boolean expected, got string)" },
    { function() return moe.zero_grad(x) end, "bad argument #1 to 'zero_grad' (list of tensors expected, got tensor)" },
    { function() return moe.zero_grad({ x, 3 }) end, "entry 2 is number, not a tensor" },
    { function() return moe.Function(5) end, "bad argument #1 to 'Function' (table expected" },
    { function() return moe.Function { backward = print } end, "field 'forward' must be a function, got nil" },
    { function() return moe.Function { forward = print } end, "field 'backward' must be a function, got nil" },
    { function() return moe.Function { forward = print, backward = print, name = 3 } end, "field 'name' must be a string, got number" },
    { function() return moe.Function { forward = function() end, backward = print }(x) end, "forward returned no value" },
    { function() return moe.saved_tensor_hooks(1, print, print) end, "bad argument #1 to 'saved_tensor_hooks' (pack function expected, got number)" },
    { function() return moe.saved_tensor_hooks(print, nil, print) end, "bad argument #2 to 'saved_tensor_hooks' (unpack function expected, got nil)" },
    { function() return moe.saved_tensor_hooks(print, print) end, "bad argument #3 to 'saved_tensor_hooks' (function expected, got no value)" },
    { function() return moe.gradcheck(5, {}) end, "bad argument #1 to 'gradcheck' (function expected, got number)" },
  }
  for i, c in ipairs(cases) do
    it(("case %d: %s"):format(i, c[2]), function()
      local ok, err = pcall(c[1])
      assert.is_false(ok)
      assert.matches(c[2], err, 1, true)
    end)
  end

  it("gradcheck refuses inputs it cannot perturb", function()
    local ok, msg = moe.gradcheck(function(a) return a * 2 end, { moe.ones(2, { requires_grad = true }) })
    assert.is_false(ok)
    assert.matches("input 1 must be an f64 CPU tensor", msg, 1, true)
    ok, msg = moe.gradcheck(function(a) return a * 2 end, { moe.ones(2, { dtype = "f64" }) })
    assert.is_false(ok)
    assert.matches("must be a leaf that requires grad", msg, 1, true)
  end)
end)
