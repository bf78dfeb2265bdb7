--[[
tests/lua/scope_spec.lua - moe.scope, moe.keep, moe.pass_up, moe.forward_scope
(bindings/lscope.c): which handles a scope frees, which it hands on, what
happens on an error, nesting, coroutines, and that autograd works across a
scope's end. A freed handle must raise "attempt to use a freed tensor".
]]
local moe = require "moe"

local function freed(t) return tostring(t) == "tensor(freed)" end

describe("moe.scope", function()
  it("frees the handles made inside except the results, which are handed to the caller", function()
    local inner
    local n0 = moe.live_handles()
    local y = moe.scope(function(a)
      inner = a * 2
      return inner + 1
    end, moe.ones({ 3 }))
    assert.is_true(freed(inner))
    assert.is_false(freed(y))
    assert.are.same({ 2, 2, 2 }, (y - 1):totable())
    local ok, err = pcall(function() return inner:sum() end)
    assert.is_false(ok)
    assert.matches("attempt to use a freed tensor", err)
    y:free()
    collectgarbage()
    assert.are.equal(n0, moe.live_handles())
  end)

  it("hands on tensors in a returned plain table, one level deep, and passes other values", function()
    local deep
    local t, n, s = moe.scope(function()
      deep = moe.zeros({ 1 })
      return { a = moe.ones({ 2 }), nested = { deep } }, 3, "x"
    end)
    assert.is_false(freed(t.a))
    assert.is_true(freed(deep)) -- two levels down: freed
    assert.are.equal(3, n)
    assert.are.equal("x", s)
  end)

  it("leaves alone handles made outside it and inputs returned unchanged", function()
    local x = moe.ones({ 2 })
    local r = moe.scope(function(a) return a end, x)
    assert.are.equal(x, r)
    assert.is_false(freed(x))
  end)

  it("nests: results of an inner scope belong to the outer one", function()
    local from_inner
    moe.scope(function()
      from_inner = moe.scope(function() return moe.ones({ 2 }) end)
      assert.is_false(freed(from_inner))
    end)
    assert.is_true(freed(from_inner))
  end)

  it("frees everything on an error and raises the same error", function()
    local made
    local ok, err = pcall(moe.scope, function()
      made = moe.ones({ 2 })
      error({ code = 7 })
    end)
    assert.is_false(ok)
    assert.are.equal(7, err.code)
    assert.is_true(freed(made))
    -- the scope stack is back where it was: a handle made now is not freed by a stale scope
    local after = moe.ones({ 1 })
    moe.scope(function() end)
    assert.is_false(freed(after))
  end)

  it("keeps what moe.keep takes out, from the innermost scope holding it", function()
    local k1, k2
    moe.scope(function()
      local a = moe.ones({ 2 })
      moe.scope(function()
        k1 = moe.keep(moe.zeros({ 3 }))
        moe.keep(a) -- made in the outer scope
      end)
      k2 = a
    end)
    assert.is_false(freed(k1))
    assert.is_false(freed(k2))
    assert.has_error(function() moe.keep(3) end, "bad argument #1 to 'keep' (tensor expected, got number)")
  end)

  it("lets backward run after the forward's scope ended (autograd holds its own references)", function()
    local w = moe.randn({ 3, 2 }, { requires_grad = true })
    local x = moe.randn({ 4, 3 })
    local loss = moe.scope(function()
      local h = moe.matmul(x, w)
      local a = h:relu()
      return moe.sum(a * a)
    end)
    loss:backward()
    local ref = moe.sum((moe.matmul(x, w):relu()) ^ 2)
    assert.is_true(w.grad ~= nil)
    assert.is_true(math.abs(loss:item() - ref:item()) < 1e-5)
  end)

  it("does not record handles made by another coroutine", function()
    local co_t
    moe.scope(function()
      local co = coroutine.wrap(function() co_t = moe.ones({ 2 }) end)
      co()
    end)
    assert.is_false(freed(co_t))
  end)

  it("rejects a non-callable", function()
    assert.has_error(function() moe.scope(42) end, "bad argument #1 to 'scope' (function expected, got number)")
    local callable = setmetatable({}, { __call = function(_, v) return v + 1 end })
    assert.are.equal(3, moe.scope(callable, 2))
  end)
end)

describe("moe.pass_up and moe.forward_scope", function()
  it("pass marked handles through inner scopes to the outermost moe.scope, which frees them", function()
    local stat, seen_after_inner
    moe.scope(function()
      moe.forward_scope(function()
        moe.forward_scope(function() stat = moe.pass_up(moe.ones({ 4 })) end)
        seen_after_inner = not freed(stat)
      end)
      assert.is_false(freed(stat)) -- still alive in the outermost scope
    end)
    assert.is_true(seen_after_inner)
    assert.is_true(freed(stat))
  end)

  it("leave marked handles to the caller when the forward scope is the outermost", function()
    local stat
    moe.forward_scope(function() stat = moe.pass_up(moe.ones({ 4 })) end)
    assert.is_false(freed(stat))
  end)

  it("close another closeable userdata (a routing plan) at the outermost scope", function()
    local plan, counts
    moe.scope(function()
      moe.forward_scope(function()
        plan = moe.pass_up(moe.ops.routing_plan(moe.tensor({ { 0 }, { 1 } }, { dtype = "i64" }), 2))
      end)
      counts = plan.counts:totable() -- alive until the outer scope ends
    end)
    assert.are.same({ 1, 1 }, counts)
    assert.has_error(function() return plan.counts end)
  end)

  it("leave a module's parameters and buffers alone when it is built or moved inside a scope", function()
    local nn = require "moe.nn"
    local lin = moe.scope(function()
      local l = nn.Linear(3, 2)
      l:to(nil, "f64")
      return l
    end)
    assert.are.same({ 5, 2 }, lin(moe.ones({ 5, 3 }, { dtype = "f64" })).shape)
    assert.is_false(freed(lin.weight))
  end)

  it("run an nn.Module's forward: intermediates freed, results and stats kept for the caller", function()
    local nn = require "moe.nn"
    local Probe = nn.class("Probe", nn.Module)
    local tmp
    function Probe:forward(x)
      tmp = x * 3
      self.stats = { sum = moe.sum(tmp) }
      return tmp + 1
    end
    local m = Probe()
    local y = m(moe.ones({ 2 }))
    assert.is_true(freed(tmp))
    assert.are.same({ 4, 4 }, y:totable())
    assert.are.equal(6, m.stats.sum:item()) -- outside any scope: left to the caller
    moe.scope(function() m(moe.ones({ 2 })) end)
    assert.is_true(freed(m.stats.sum)) -- inside a step: freed when it ends
  end)
end)
