--[[
tests/lua/index_spec.lua - the index family through the `moe` module on the
CPU: gather, scatter, scatter_add, index_select, index_add (and its
windowed summation order; on cuda too, pending without a GPU), embedding,
one_hot, bincount, sort, argsort, topk, cat, stack, split, chunk, rope,
rope_cache, multinomial; values, gradients (when the autograd bindings are
present) and bad-argument errors; bincount on cuda too (pending without a
GPU).

Run: moe-lua tests/lua/busted.lua tests/lua/index_spec.lua (ctest does).
Dims and indices are 0-based, as everywhere in the moe API.
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

local function i64(t) return moe.tensor(t, { dtype = "i64" }) end

describe("gather and scatter", function()
  local x = moe.tensor({ { 1, 2, 3 }, { 4, 5, 6 } })

  it("gather picks along a dim", function()
    assert.are.same({ { 4, 2, 6 }, { 1, 2, 6 } }, moe.gather(x, 0, i64({ { 1, 0, 1 }, { 0, 0, 1 } })):totable())
    assert.are.same({ { 3, 1 }, { 5, 5 } }, x:gather(-1, i64({ { 2, 0 }, { 1, 1 } })):totable())
    local i32 = moe.tensor({ { 2, 0 }, { 1, 1 } }, { dtype = "i32" })
    assert.are.same({ { 3, 1 }, { 5, 5 } }, x:gather(1, i32):totable())
  end)

  it("scatter writes out of place; the last repeated write wins", function()
    local src = moe.tensor({ { 10, 20, 30 }, { 40, 50, 60 } })
    local idx = i64({ { 2, 2 }, { 0, 1 } })
    assert.are.same({ { 1, 2, 20 }, { 40, 50, 6 } }, x:scatter(1, idx, src):totable())
    assert.are.same({ { 1, 2, 33 }, { 44, 55, 6 } }, moe.scatter_add(x, 1, idx, src):totable())
    assert.are.same({ { 1, 2, 3 }, { 4, 5, 6 } }, x:totable())
  end)

  it("index_select and index_add", function()
    local y = moe.tensor({ { 1, 2 }, { 3, 4 }, { 5, 6 } })
    local idx = i64({ 2, 0, 2 })
    assert.are.same({ { 5, 6 }, { 1, 2 }, { 5, 6 } }, y:index_select(0, idx):totable())
    assert.are.same({ { 2, 1 }, { 4, 3 }, { 6, 5 } }, moe.index_select(y, 1, i64({ 1, 0 })):totable())
    local src = moe.tensor({ { 10, 20 }, { 30, 40 }, { 50, 60 } })
    assert.are.same({ { 31, 42 }, { 3, 4 }, { 65, 86 } }, y:index_add(0, idx, src):totable())
  end)

  it("rejects bad arguments", function()
    assert.has_error(function() x:gather(0, moe.tensor({ { 0.5 } })) end,
      "gather: index must be i64 or i32, got f32")
    assert.has_error(function() x:gather(5, i64({ { 0 } })) end)
    assert.has_error(function() x:gather(0, "no") end,
      "bad argument #3 to 'gather' (tensor expected, got string)")
    assert.has_error(function() x:gather(1, i64({ { 3 } })) end,
      "gather: index holds 3 at position 0, outside [0, 3)")
    assert.has_error(function() x:scatter(0, i64({ { 0 } })) end,
      "bad argument #4 to 'scatter' (tensor expected, got no value)")
    assert.has_error(function() x:index_select(0, i64({ { 0 } })) end,
      "index_select: index must be 1-D, got [1, 1]")
  end)
end)

describe("index_add's summation order", function()
  -- moe_index.h: sort the positions by (index, position), cut the sorted
  -- entries into windows of P = 32; per key, x plus its entries in its first
  -- window, then each later window's partial (from its first entry), added
  -- in window order. Lua adds doubles as an f64 tensor does.
  local P = 32
  local function windowed(x, idx, src)
    local n, X, inner = #idx, #x, #x[1]
    local below = {}
    for k = 0, X do below[k] = 0 end
    for _, k in ipairs(idx) do below[k + 1] = below[k + 1] + 1 end
    for k = 1, X do below[k] = below[k] + below[k - 1] end
    local out = {}
    for k = 0, X - 1 do
      local row = {}
      for e = 1, inner do
        local acc, part, cur, r = x[k + 1][e], 0, nil, 0
        local first = below[k] // P
        for i = 1, n do
          if idx[i] == k then
            local w = (below[k] + r) // P
            r = r + 1
            local s = src[i][e]
            if w == first then acc = acc + s
            elseif w ~= cur then
              if cur then acc = acc + part end
              part, cur = s, w
            else part = part + s end
          end
        end
        if cur then acc = acc + part end
        row[e] = acc
      end
      out[k + 1] = row
    end
    return out
  end

  it("adds each key in windows of 32 sorted entries (f64, exact)", function()
    moe.manual_seed(11)
    local keys = moe.randint(0, 5, { 170 }, { dtype = "i64" })
    keys:narrow(0, 20, 110):fill_(3) -- key 3 spans four windows
    local x = moe.randn({ 5, 3 }, { dtype = "f64" }) * 1e3
    local src = moe.randn({ 170, 3 }, { dtype = "f64" })
    local want = windowed(x:totable(), keys:totable(), src:totable())
    assert.are.same(want, x:index_add(0, keys, src):totable())
    -- the serial sum in another order: equal within rounding
    local serial = x:totable()
    for i, k in ipairs(keys:totable()) do
      for e = 1, 3 do serial[k + 1][e] = serial[k + 1][e] + src:totable()[i][e] end
    end
    local got = x:index_add(0, keys, src):totable()
    for k = 1, 5 do
      for e = 1, 3 do assert.is_true(math.abs(got[k][e] - serial[k][e]) <= 1e-9 * 1e3) end
    end
  end)

  local gpu = moe.cuda.is_available()
  local function gpu_it(name, fn)
    if gpu then it(name, fn) else pending(name .. " (no CUDA GPU)") end
  end

  gpu_it("on cuda: the CPU's bits (bf16, f32, f64)", function()
    moe.manual_seed(12)
    local keys = moe.randint(0, 257, { 5000 }, { dtype = "i64" })
    keys:narrow(0, 100, 2500):fill_(32) -- a frequent byte
    for _, dt in ipairs({ "bf16", "f32", "f64" }) do
      local x = moe.randn({ 257, 65 }, { dtype = dt })
      local src = moe.randn({ 5000, 65 }, { dtype = dt })
      local want = x:index_add(0, keys, src):totable()
      assert.are.same(want, x:cuda():index_add(0, keys:cuda(), src:cuda()):totable())
    end
  end)
end)

describe("embedding and one_hot", function()
  it("embedding looks rows up for ids of any shape", function()
    local w = moe.tensor({ { 0, 1 }, { 10, 11 }, { 20, 21 } })
    local out = moe.embedding(w, i64({ { 2, 0 }, { 1, 2 } }))
    assert.are.same({ 2, 2, 2 }, out.shape)
    assert.are.same({ { { 20, 21 }, { 0, 1 } }, { { 10, 11 }, { 20, 21 } } }, out:totable())
    assert.has_error(function() moe.embedding(w, i64({ 3 })) end,
      "embedding: ids holds 3 at position 0, outside [0, 3)")
    assert.has_error(function() moe.embedding(w) end,
      "bad argument #2 to 'embedding' (tensor expected, got no value)")
  end)

  it("one_hot gives i64 rows, inferring the class count", function()
    local ids = i64({ 0, 2, 1 })
    local o = moe.one_hot(ids, 4)
    assert.are.equal("i64", o.dtype)
    assert.are.same({ { 1, 0, 0, 0 }, { 0, 0, 1, 0 }, { 0, 1, 0, 0 } }, o:totable())
    assert.are.same({ 3, 3 }, ids:one_hot().shape)
    assert.has_error(function() moe.one_hot(ids, 2) end, "one_hot: ids holds 2 at position 1, outside [0, 2)")
    assert.has_error(function() moe.one_hot(ids, -3) end)
  end)
end)

describe("bincount", function()
  it("counts ids of any shape and integer dtype into E bins", function()
    local ids = i64({ { 3, 0, 3 }, { 1, 3, 0 } })
    local c = moe.bincount(ids, 5)
    assert.are.equal("i64", c.dtype)
    assert.are.same({ 2, 1, 0, 3, 0 }, c:totable())
    assert.are.same({ 2, 1, 0, 3 }, ids:transpose(0, 1):bincount(4):totable())
    assert.are.same({ 0, 0, 2 }, moe.tensor({ 2, 2 }, { dtype = "i32" }):bincount(3):totable())
    assert.are.same({ 0, 0 }, moe.zeros({ 0 }, { dtype = "i64" }):bincount(2):totable())
    -- against a count in Lua over random ids
    local r = moe.randint(0, 7, { 500 }, { dtype = "i64" })
    local want = { 0, 0, 0, 0, 0, 0, 0 }
    for _, v in ipairs(r:totable()) do want[v + 1] = want[v + 1] + 1 end
    assert.are.same(want, moe.bincount(r, 7):totable())
  end)

  it("rejects ids outside [0, E), float ids and a negative E", function()
    local ids = i64({ 0, 4, 1 })
    assert.has_error(function() moe.bincount(ids, 4) end, "bincount: ids holds 4 at position 1, outside [0, 4)")
    assert.has_error(function() moe.bincount(i64({ -2 }), 4) end,
      "bincount: ids holds -2 at position 0, outside [0, 4)")
    assert.has_error(function() moe.bincount(moe.zeros({ 2 }), 4) end, "bincount: ids must be i64 or i32, got f32")
    assert.has_error(function() moe.bincount(ids, -1) end,
      "bad argument #2 to 'bincount' (the number of bins must be >= 0, got -1)")
    assert.has_error(function() moe.bincount(ids) end)
  end)

  local gpu = moe.cuda.is_available()
  local function gpu_it(name, fn)
    if gpu then it(name, fn) else pending(name .. " (no CUDA GPU)") end
  end

  gpu_it("on cuda: the CPU's counts; a bad id is reported at the next synchronisation", function()
    moe.manual_seed(5)
    for _, E in ipairs({ 1, 64, 8192, 8193 }) do
      local ids = moe.randint(0, E, { 16384 }, { dtype = "i64" })
      ids:narrow(0, 0, 15000):fill_(0) -- nearly all in one bin
      assert.are.same(moe.bincount(ids, E):totable(), moe.bincount(ids:cuda(), E):totable())
      local i32 = ids:to("i32")
      assert.are.same(moe.bincount(i32, E):totable(), moe.bincount(i32:cuda(), E):totable())
    end
    local c = moe.bincount(i64({ 1, 9, 0 }):cuda(), 3) -- no error yet: no host sync
    assert.has_error(function() moe.cuda.synchronize() end, "synchronize: bincount: index 9 is out of range [0, 3) on cuda:0 "
      .. "(found by the kernel, reported at this synchronisation: the op was queued earlier and its result is "
      .. "not valid)")
    assert.are.same({ 1, 1, 0 }, c:totable())
  end)
end)

describe("sort and topk", function()
  local x = moe.tensor({ { 3, 1, 2, 1 }, { 0, -1, 5, -1 } })

  it("sort is stable, ascending or descending", function()
    local v, i = x:sort()
    assert.are.same({ { 1, 1, 2, 3 }, { -1, -1, 0, 5 } }, v:totable())
    assert.are.same({ { 1, 3, 2, 0 }, { 1, 3, 0, 2 } }, i:totable())
    v, i = moe.sort(x, 1, true)
    assert.are.same({ { 3, 2, 1, 1 }, { 5, 0, -1, -1 } }, v:totable())
    assert.are.same({ { 0, 2, 1, 3 }, { 2, 0, 1, 3 } }, i:totable())
    assert.are.same({ { 1, 1, 0, 1 }, { 0, 0, 1, 0 } }, x:argsort(0):totable())
  end)

  it("topk returns values and indices, largest or smallest", function()
    local v, i = x:topk(2)
    assert.are.same({ { 3, 2 }, { 5, 0 } }, v:totable())
    assert.are.same({ { 0, 2 }, { 2, 0 } }, i:totable())
    assert.are.equal("i64", i.dtype)
    v, i = moe.topk(x, 1, 0, false)
    assert.are.same({ { 0, -1, 2, -1 } }, v:totable())
    assert.are.same({ { 1, 1, 0, 1 } }, i:totable())
  end)

  it("rejects bad arguments", function()
    assert.has_error(function() x:topk(5) end, "bad argument #2 to 'topk' (k = 5 is outside [0, 4] (size of dim 1))")
    assert.has_error(function() x:topk("2") end, "bad argument #2 to 'topk' (k must be an integer, got string)")
    assert.has_error(function() x:sort(0, 1) end, "bad argument #3 to 'sort' (descending must be a boolean, got number)")
    assert.has_error(function() moe.tensor({ true }):sort() end, "sort: bool tensors are not sorted (convert with to)")
  end)
end)

describe("cat, stack, split, chunk", function()
  local a = moe.tensor({ { 1, 2 }, { 3, 4 } })
  local b = moe.tensor({ { 5 }, { 6 } })

  it("cat and stack", function()
    assert.are.same({ { 1, 2, 5 }, { 3, 4, 6 } }, moe.cat({ a, b }, 1):totable())
    assert.are.same({ { 1, 2 }, { 3, 4 }, { 1, 2 }, { 3, 4 } }, moe.cat({ a, a }):totable())
    assert.are.same({ 2, 2, 2 }, moe.stack({ a, a }).shape)
    assert.are.same({ { { 1, 1 }, { 2, 2 } }, { { 3, 3 }, { 4, 4 } } }, moe.stack({ a, a }, -1):totable())
  end)

  it("split and chunk return lists of views", function()
    local x = moe.arange(10):view(5, 2)
    local p = x:split(2)
    assert.are.equal(3, #p)
    assert.are.same({ { 4, 5 }, { 6, 7 } }, p[2]:totable())
    assert.are.same({ { 8, 9 } }, p[3]:totable())
    p = x:split({ 1, 4 })
    assert.are.same({ 1, 2 }, p[1].shape)
    assert.are.same({ 4, 2 }, p[2].shape)
    p = moe.chunk(x, 2, 1)
    assert.are.equal(2, #p)
    assert.are.same({ { 0 }, { 2 }, { 4 }, { 6 }, { 8 } }, p[1]:totable())
    assert.are.equal(3, #x:chunk(3))
  end)

  it("rejects bad arguments", function()
    assert.has_error(function() moe.cat(a) end, "bad argument #1 to 'cat' (a list of tensors expected, got tensor)")
    assert.has_error(function() moe.cat({}) end, "bad argument #1 to 'cat' (the list of tensors is empty)")
    assert.has_error(function() moe.cat({ a, 3 }) end, "bad argument #1 to 'cat' (element 2 must be a tensor, got number)")
    assert.has_error(function() moe.cat({ a, b }, 0) end)
    assert.has_error(function() moe.stack({ a, b }) end)
    assert.has_error(function() a:split(0) end, "bad argument #2 to 'split' (split_size must be >= 1, got 0)")
    assert.has_error(function() a:split({ 1, 2 }) end, "bad argument #2 to 'split' (sizes sum to 3 but dim 0 has size 2)")
    assert.has_error(function() a:chunk(0) end, "bad argument #2 to 'chunk' (chunks must be >= 1, got 0)")
  end)
end)

describe("rope", function()
  it("rope_cache holds cos and sin of t * base^(-2j/D)", function()
    local c, s = moe.rope_cache(3, 4, 100, { dtype = "f64" })
    assert.are.same({ 3, 2 }, c.shape)
    assert.are.equal("f64", c.dtype)
    assert.is_true(near(math.cos(2 * 100 ^ -0.5), c:totable()[3][2], 1e-12))
    assert.is_true(near(math.sin(1), s:totable()[2][1], 1e-12))
    assert.are.equal("f32", moe.rope_cache(2, 2).dtype)
  end)

  it("rotates half of each head", function()
    local x = moe.randn({ 1, 2, 1, 4 }, { dtype = "f64" })
    local c, s = moe.rope_cache(2, 4, 10000, { dtype = "f64" })
    local out = moe.rope(x, c, s):totable()
    local xv, cv, sv = x:totable(), c:totable(), s:totable()
    for t = 1, 2 do
      for j = 1, 2 do
        local a, b = xv[1][t][1][j], xv[1][t][1][j + 2]
        assert.is_true(near(a * cv[t][j] - b * sv[t][j], out[1][t][1][j], 1e-12))
        assert.is_true(near(b * cv[t][j] + a * sv[t][j], out[1][t][1][j + 2], 1e-12))
      end
    end
    local alt = x:transpose(1, 2):rope(c, s, "bhtd"):transpose(1, 2):totable()
    assert.is_true(near(out[1][2][1], alt[1][2][1], 1e-12))
  end)

  it("rejects bad arguments", function()
    local c, s = moe.rope_cache(2, 4)
    assert.has_error(function() moe.rope(moe.zeros(1, 2, 1, 4), c, s, "thd") end,
      "bad argument #4 to 'rope' (layout must be 'bthd' or 'bhtd', got string)")
    assert.has_error(function() moe.rope(moe.zeros(2, 4), c, s) end)
    assert.has_error(function() moe.rope_cache(2, 3) end, "bad argument #2 to 'rope_cache' (D must be even and > 0, got 3)")
    assert.has_error(function() moe.rope_cache(2, 4, 100, { dtype = "nope" }) end)
  end)
end)

describe("multinomial", function()
  it("draws where the weight is, reproducibly for a seed", function()
    local p = moe.tensor({ { 0, 1, 0, 3 }, { 2, 0, 0, 0 } }, { dtype = "f32" })
    moe.manual_seed(3)
    local a = moe.multinomial(p, 50, true)
    moe.manual_seed(3)
    local b = p:multinomial(50, true)
    assert.are.same(a:totable(), b:totable())
    assert.are.same({ 2, 50 }, a.shape)
    for _, v in ipairs(a:totable()[1]) do assert.is_true(v == 1 or v == 3) end
    for _, v in ipairs(a:totable()[2]) do assert.are.equal(0, v) end
    local w = moe.multinomial(moe.tensor({ 1, 1, 0, 1 }, { dtype = "f32" }), 3):totable()
    table.sort(w)
    assert.are.same({ 0, 1, 3 }, w)
  end)

  it("rejects bad arguments", function()
    assert.has_error(function() moe.multinomial(moe.tensor({ 1, 1 }, { dtype = "f32" }), 3) end,
      "multinomial: num_samples = 3 must be in [0, 2] without replacement (C categories)")
    assert.has_error(function() moe.multinomial(moe.tensor({ 1, -1 }, { dtype = "f32" }), 1, true) end,
      "multinomial: probs[0, 1] = -1: weights must be finite and >= 0")
    assert.has_error(function() moe.multinomial(moe.tensor({ 1, 1 }), 1) end,
      "multinomial: probs must be f32, f64, bf16 or f16, got i64")
    assert.has_error(function() moe.multinomial(moe.tensor({ 1, 1 }), -1) end,
      "bad argument #2 to 'multinomial' (num_samples must be >= 0, got -1)")
    assert.has_error(function() moe.multinomial(moe.tensor({ 1, 1 }), 1, "yes") end,
      "bad argument #3 to 'multinomial' (replacement must be a boolean, got string)")
  end)
end)

-- Gradients through moe's Lua API (requires_grad_, backward, .grad).
describe("gradients", function()
  local function f64(t) return moe.tensor(t, { dtype = "f64" }) end

  it("gather and embedding send gradients back to the rows used", function()
    local w = moe.zeros({ 3, 2 }, { dtype = "f64" }):requires_grad_(true)
    local out = moe.embedding(w, i64({ 2, 0, 2 }))
    out:backward(moe.ones({ 3, 2 }, { dtype = "f64" }))
    assert.are.same({ { 1, 1 }, { 0, 0 }, { 2, 2 } }, w.grad:totable())
    local x = f64({ 1, 2, 3 }):requires_grad_(true)
    x:gather(0, i64({ 2, 2, 0 })):backward(f64({ 1, 10, 100 }))
    assert.are.same({ 100, 0, 11 }, x.grad:totable())
  end)

  it("topk and sort pass gradients to the chosen elements", function()
    local x = f64({ 1, 5, 3 }):requires_grad_(true)
    local v = x:topk(2)
    v:backward(f64({ 10, 20 }))
    assert.are.same({ 0, 10, 20 }, x.grad:totable())
    local y = f64({ 3, 1, 2 }):requires_grad_(true)
    local sv = y:sort()
    sv:backward(f64({ 1, 2, 3 }))
    assert.are.same({ 3, 1, 2 }, y.grad:totable())
  end)

  it("scatter_add, index_select and index_add", function()
    local x = f64({ 0, 0 }):requires_grad_(true)
    local src = f64({ 1, 2, 3 }):requires_grad_(true)
    x:scatter_add(0, i64({ 1, 0, 1 }), src):backward(f64({ 10, 20 }))
    assert.are.same({ 10, 20 }, x.grad:totable())
    assert.are.same({ 20, 10, 20 }, src.grad:totable())
    local y = f64({ { 1, 2 }, { 3, 4 } }):requires_grad_(true)
    y:index_select(0, i64({ 1, 1, 0 })):backward(f64({ { 1, 1 }, { 2, 2 }, { 5, 5 } }))
    assert.are.same({ { 5, 5 }, { 3, 3 } }, y.grad:totable())
  end)

  it("cat, stack, split and chunk send each part its gradient", function()
    local a = moe.zeros({ 2 }, { dtype = "f64" }):requires_grad_(true)
    local b = moe.zeros({ 1 }, { dtype = "f64" }):requires_grad_(true)
    moe.cat({ a, b }):backward(f64({ 1, 2, 3 }))
    assert.are.same({ 1, 2 }, a.grad:totable())
    assert.are.same({ 3 }, b.grad:totable())
    local c = moe.zeros({ 2 }, { dtype = "f64" }):requires_grad_(true)
    moe.stack({ c, c }, 1):backward(f64({ { 1, 2 }, { 3, 4 } }))
    assert.are.same({ 3, 7 }, c.grad:totable())
    local x = moe.zeros({ 5 }, { dtype = "f64" }):requires_grad_(true)
    x:split(2)[2]:backward(f64({ 7, 8 }))
    assert.are.same({ 0, 0, 7, 8, 0 }, x.grad:totable())
    local y = moe.zeros({ 4 }, { dtype = "f64" }):requires_grad_(true)
    y:chunk(2)[1]:backward(f64({ 1, 2 }))
    assert.are.same({ 1, 2, 0, 0 }, y.grad:totable())
  end)

  it("rope's gradient is the inverse rotation", function()
    local c, s = moe.rope_cache(3, 4, 10000, { dtype = "f64" })
    local x = moe.randn({ 2, 3, 1, 4 }, { dtype = "f64" }):requires_grad_(true)
    local g = moe.randn({ 2, 3, 1, 4 }, { dtype = "f64" })
    moe.rope(x, c, s):backward(g)
    -- rotating the gradient forward gives back the cotangent
    local back = moe.rope(x.grad, c, s):totable()
    local want = g:totable()
    for b = 1, 2 do
      for t = 1, 3 do
        assert.is_true(near(want[b][t][1], back[b][t][1], 1e-12))
      end
    end
  end)
end)
