--[[
tests/lua/attention_spec.lua - moe.attention (alias
moe.scaled_dot_product_attention, method q:attention) and the
attention_forward / attention_backward pair from Lua: values against a naive
softmax(Q K^T scale + mask) V computed here in plain Lua, the options and
their defaults (causal = true, scale = 1/sqrt(D)), gradients through
autograd against the explicit backward and against finite differences, and
bad arguments. On a GPU also the fused bf16 kernels against the CPU.

Run: moe-lua tests/lua/busted.lua tests/lua/attention_spec.lua (ctest does).
]]
local moe = require "moe"

local gpu = moe.cuda.is_available()

local function flat(t, out)
  out = out or {}
  if type(t) ~= "table" then out[#out + 1] = t; return out end
  for i = 1, #t do flat(t[i], out) end
  return out
end

local function max_diff(a, b)
  local x, y, m = flat(a), flat(b), 0
  assert(#x == #y, "sizes differ: " .. #x .. " vs " .. #y)
  for i = 1, #x do m = math.max(m, math.abs(x[i] - y[i])) end
  return m
end

-- naive attention of nested tables q, k, v (B, H, T, D)
local function naive(q, k, v, causal, scale)
  local out = {}
  for b = 1, #q do
    out[b] = {}
    for h = 1, #q[b] do
      local Q, K, V = q[b][h], k[b][h], v[b][h]
      local T, D = #Q, #Q[1]
      out[b][h] = {}
      for i = 1, T do
        local s, m = {}, -math.huge
        local n = causal and i or T
        for j = 1, n do
          local x = 0
          for d = 1, D do x = x + Q[i][d] * K[j][d] end
          s[j] = x * scale
          m = math.max(m, s[j])
        end
        local l = 0
        for j = 1, n do s[j] = math.exp(s[j] - m); l = l + s[j] end
        local row = {}
        for d = 1, D do
          local o = 0
          for j = 1, n do o = o + s[j] / l * V[j][d] end
          row[d] = o
        end
        out[b][h][i] = row
      end
    end
  end
  return out
end

local function randn(shape, dtype, device)
  return moe.randn(shape, { dtype = dtype or "f64", device = device or "cpu" })
end

describe("moe.attention", function()
  it("matches a naive softmax(Q K^T scale + mask) V", function()
    moe.manual_seed(1)
    local q, k, v = randn({ 2, 2, 5, 3 }), randn({ 2, 2, 5, 3 }), randn({ 2, 2, 5, 3 })
    local Q, K, V = q:totable(), k:totable(), v:totable()
    assert.is_true(max_diff(moe.attention(q, k, v):totable(), naive(Q, K, V, true, 1 / math.sqrt(3))) < 1e-12)
    assert.is_true(max_diff(moe.attention(q, k, v, { causal = false }):totable(),
      naive(Q, K, V, false, 1 / math.sqrt(3))) < 1e-12)
    assert.is_true(max_diff(moe.attention(q, k, v, { causal = true, scale = 0.25 }):totable(),
      naive(Q, K, V, true, 0.25)) < 1e-12)
  end)

  it("has an alias, a method form and causal = true by default", function()
    moe.manual_seed(2)
    local q, k, v = randn({ 1, 3, 4, 2 }), randn({ 1, 3, 4, 2 }), randn({ 1, 3, 4, 2 })
    local a = moe.attention(q, k, v)
    assert.are.equal(0, max_diff(a:totable(), moe.scaled_dot_product_attention(q, k, v, { causal = true }):totable()))
    assert.are.equal(0, max_diff(a:totable(), q:attention(k, v):totable()))
    assert.is_true(max_diff(a:totable(), moe.attention(q, k, v, { causal = false }):totable()) > 1e-6)
    assert.are.same({ 1, 3, 4, 2 }, a.shape)
    assert.are.equal("f64", a.dtype)
  end)

  it("takes transposed views", function()
    moe.manual_seed(3)
    local qb, kb, vb = randn({ 2, 6, 3, 4 }), randn({ 2, 6, 3, 4 }), randn({ 2, 6, 3, 4 })
    local q, k, v = qb:transpose(1, 2), kb:transpose(1, 2), vb:transpose(1, 2)
    assert.is_false(q:is_contiguous())
    local a = moe.attention(q, k, v)
    local b = moe.attention(q:contiguous(), k:contiguous(), v:contiguous())
    assert.are.equal(0, max_diff(a:totable(), b:totable()))
  end)

  it("attention_forward returns out and the per-row logsumexp", function()
    local q = moe.tensor({ { { { 0 }, { 1 } } } }, { dtype = "f64" })
    local k = moe.tensor({ { { { 0 }, { math.log(3) } } } }, { dtype = "f64" })
    local v = moe.tensor({ { { { 4 }, { 8 } } } }, { dtype = "f64" })
    local o, lse = moe.attention_forward(q, k, v, { scale = 1 })
    assert.is_true(max_diff(o:totable(), { { { { 4 }, { 7 } } } }) < 1e-12)
    assert.is_true(max_diff(lse:totable(), { { { 0, math.log(4) } } }) < 1e-12)
  end)
end)

describe("attention gradients", function()
  it("through autograd equal attention_backward", function()
    moe.manual_seed(4)
    local q, k, v = randn({ 1, 2, 6, 4 }), randn({ 1, 2, 6, 4 }), randn({ 1, 2, 6, 4 })
    local r = randn({ 1, 2, 6, 4 })
    local o, lse = moe.attention_forward(q, k, v)
    local dq, dk, dv = moe.attention_backward(q, k, v, o, lse, r)
    q:requires_grad_(); k:requires_grad_(); v:requires_grad_()
    local out = moe.attention(q, k, v)
    out:backward(r)
    assert.are.equal(0, max_diff(q.grad:totable(), dq:totable()))
    assert.are.equal(0, max_diff(k.grad:totable(), dk:totable()))
    assert.are.equal(0, max_diff(v.grad:totable(), dv:totable()))
  end)

  it("match finite differences (f64)", function()
    moe.manual_seed(5)
    local shape = { 1, 1, 4, 3 }
    local q, k, v, r = randn(shape), randn(shape), randn(shape), randn(shape)
    local o, lse = moe.attention_forward(q, k, v)
    local dq, dk = moe.attention_backward(q, k, v, o, lse, r)
    local R = flat(r:totable())
    local function loss(qq, kk)
      local x, s = flat(moe.attention(qq, kk, v):totable()), 0
      for i = 1, #x do s = s + x[i] * R[i] end
      return s
    end
    local eps = 1e-6
    for _, c in ipairs({ { q, dq, "q" }, { k, dk, "k" } }) do
      local x, g = c[1], flat(c[2]:totable())
      local vals = flat(x:totable())
      for i = 1, #vals do
        local function at(delta)
          local t = {}
          for j = 1, #vals do t[j] = vals[j] + (j == i and delta or 0) end
          local p = moe.tensor(t, { dtype = "f64" }):view(shape)
          if c[3] == "q" then return loss(p, k) else return loss(q, p) end
        end
        local num = (at(eps) - at(-eps)) / (2 * eps)
        assert.is_true(math.abs(num - g[i]) <= 1e-6 * (1 + math.abs(num)),
          ("d%s[%d]: analytic %g numeric %g"):format(c[3], i, g[i], num))
      end
    end
  end)
end)

describe("attention bad arguments", function()
  local q = moe.randn({ 1, 2, 3, 4 })
  local function err(f, ...)
    local ok, msg = pcall(f, ...)
    assert.is_false(ok)
    return msg
  end
  it("name the argument", function()
    assert.matches("bad argument #3 to 'attention' %(tensor expected", err(moe.attention, q, q, 3))
    assert.matches("bad argument #4 to 'attention' %(options must be a table", err(moe.attention, q, q, q, true))
    assert.matches("unknown option 'casual'", err(moe.attention, q, q, q, { casual = true }))
    assert.matches("causal must be a boolean", err(moe.attention, q, q, q, { causal = 1 }))
    assert.matches("scale must be a number", err(moe.attention, q, q, q, { scale = "x" }))
    assert.matches("scale must be finite and non%-zero", err(moe.attention, q, q, q, { scale = math.huge }))
    assert.matches("bad argument #5 to 'attention' %(unexpected extra argument",
      err(moe.attention, q, q, q, {}, 1))
    assert.matches("bad argument #6 to 'attention_backward'", err(moe.attention_backward, q, q, q, q, q, nil))
  end)
  it("report the core's shape and dtype errors", function()
    assert.matches("k has shape %[1, 2, 5, 4%], wanted q's shape %[1, 2, 3, 4%]",
      err(moe.attention, q, moe.randn({ 1, 2, 5, 4 }), q))
    assert.matches("4%-D %(B, H, T, D%)", err(moe.attention, moe.randn({ 2, 3, 4 }), q, q))
    assert.matches("v is f64 but q is f32", err(moe.attention, q, q, q:double()))
    assert.matches("lse must be f32", err(moe.attention_backward, q, q, q, q, q, q))
  end)
end)

describe("attention on cuda", function()
  local function gpu_it(name, fn)
    if gpu then it(name, fn) else pending(name .. " (no CUDA GPU)") end
  end
  gpu_it("bf16 fused kernels match the CPU reference, forward and backward", function()
    moe.manual_seed(6)
    local shape = { 2, 2, 37, 64 }
    local q, k, v, r = randn(shape, "bf16"), randn(shape, "bf16"), randn(shape, "bf16"), randn(shape, "bf16")
    local qg, kg, vg = q:cuda():requires_grad_(), k:cuda():requires_grad_(), v:cuda():requires_grad_()
    local og = moe.attention(qg, kg, vg)
    og:backward(r:cuda())
    local o, lse = moe.attention_forward(q, k, v)
    local dq, dk, dv = moe.attention_backward(q, k, v, o, lse, r)
    -- bf16 outputs (2^-9 relative) and bf16 P/dS in the tensor-core products:
    -- 3e-2 absolute for values and gradients of size <= ~4
    assert.is_true(max_diff(og:cpu():totable(), o:totable()) < 3e-2)
    assert.is_true(max_diff(qg.grad:cpu():totable(), dq:totable()) < 3e-2)
    assert.is_true(max_diff(kg.grad:cpu():totable(), dk:totable()) < 3e-2)
    assert.is_true(max_diff(vg.grad:cpu():totable(), dv:totable()) < 3e-2)
  end)
  gpu_it("refuses head dims other than 64 and 128", function()
    local x = moe.randn({ 1, 1, 4, 32 }, { dtype = "bf16", device = "cuda" })
    local ok, msg = pcall(moe.attention, x, x, x)
    assert.is_false(ok)
    assert.matches("head dim 32", msg)
  end)
end)
