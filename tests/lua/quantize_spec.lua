--[[
tests/lua/quantize_spec.lua - quantization of saved activations through Lua
(lua/moe/quantize.lua over moe.ops.quantize / dequantize / quantize_scope):
round-trip values and error bounds of int8 / int4, the packed table, a
small MLP trained under moe.quantize.scope with 8 and 4 bits against the
unquantized run (gradient error bounds), the memory kept for backward
(storage bytes on the CPU), the off specs, a user quantizer written in Lua
(bf16 cast; its packed tensors freed with the graph), a user quantizer that
returns the wrong shape / dtype / no tensor (errors naming it), and bad
settings.

Run: moe-lua tests/lua/busted.lua tests/lua/quantize_spec.lua (ctest does).
]]
local moe = require "moe"
local quantize = require "moe.quantize"

local function max_abs(t) return t:abs():max():item() end

local function rel_err(a, b)
  local d = (a:to("f64") - b:to("f64")):norm():item()
  return d / b:to("f64"):norm():item()
end

describe("int8 and int4", function()
  it("round-trips within absmax / 254 per row (8 bits)", function()
    moe.manual_seed(1)
    local x = moe.rand({ 6, 50 }) * 4 - 2
    local q = quantize.int8(x)
    assert.are.equal(8, q.bits)
    assert.are.equal("i8", q.values.dtype)
    assert.are.same({ 6, 50 }, q.values.shape)
    assert.are.same({ 6, 1 }, q.scales.shape)
    assert.are.same({ 6, 50 }, q.shape)
    assert.are.equal("f32", q.dtype)
    assert.are.equal(6 * 50 + 6 * 4, quantize.nbytes(q))
    local y = quantize.dequantize(q)
    assert.are.same(x.shape, y.shape)
    for r = 0, 5 do
      local xr, yr = x:select(0, r), y:select(0, r)
      assert.is_true(max_abs(xr - yr) <= max_abs(xr) / 254 * (1 + 1e-6))
    end
  end)

  it("packs two 4-bit codes a byte with a scale per group", function()
    local x = moe.tensor({ { 1, -1, 0.5, 7, -2.4 } })
    local q = quantize.int4(x)
    assert.are.same({ { 121, 248, 6 } }, q.values:to("i64"):totable())
    assert.are.same({ { 1 } }, q.scales:totable())
    assert.are.same({ { 1, -1, 0, 7, -2 } }, quantize.dequantize(q):totable())
    moe.manual_seed(2)
    local z = moe.randn({ 3, 300 }, { dtype = "bf16" })
    local qz = quantize.int4(z, 64)
    assert.are.same({ 3, 150 }, qz.values.shape)
    assert.are.same({ 3, 5 }, qz.scales.shape) -- ragged last group of 44
    local back = quantize.dequantize(qz)
    assert.are.equal("bf16", back.dtype)
    for g = 0, 4 do
      local len = g < 4 and 64 or 44
      local zg, bg = z:narrow(1, g * 64, len):to("f32"), back:narrow(1, g * 64, len):to("f32")
      for r = 0, 2 do
        local m = max_abs(zg:select(0, r))
        -- 4-bit bound plus bf16's rounding of the result (2^-8 relative)
        assert.is_true(max_abs(zg:select(0, r) - bg:select(0, r)) <= m / 14 * 1.0001 + m / 256)
      end
    end
  end)

  it("rounds stochastically without bias", function()
    local x = moe.tensor({ { 7, 2.3, -4.6, 0.25 } })
    moe.manual_seed(3)
    local acc = moe.zeros({ 1, 4 }, { dtype = "f64" })
    local n = 2000
    for _ = 1, n do
      acc = acc + quantize.dequantize(quantize.int4(x, nil, { stochastic = true })):to("f64")
    end
    -- a Bernoulli mean over 2000 draws: std <= 0.5 / sqrt(2000) = 0.011; 0.06 is > 5 sigma
    local mean = (acc / n):totable()[1]
    for i, v in ipairs({ 7, 2.3, -4.6, 0.25 }) do
      assert.is_true(math.abs(mean[i] - v) < 0.06)
    end
  end)
end)

-- y = gelu(x @ w1) @ w2, loss = sum(y * g); returns the gradients.
local function mlp_grads(x, w1, w2, g, spec)
  for _, t in ipairs({ x, w1, w2 }) do t.grad = nil end
  local y = quantize.scope(spec, function()
    return moe.matmul(moe.gelu(moe.matmul(x, w1)), w2)
  end)
  y:backward(g)
  return { x.grad, w1.grad, w2.grad }
end

describe("scope", function()
  moe.manual_seed(4)
  local x = moe.randn({ 64, 96 }, { requires_grad = true })
  local w1 = (moe.randn({ 96, 256 }) / math.sqrt(96)):requires_grad_(true)
  local w2 = (moe.randn({ 256, 96 }) / 16):requires_grad_(true)
  local g = moe.randn({ 64, 96 })

  it("runs fn unchanged when off", function()
    local ref = mlp_grads(x, w1, w2, g, nil)
    for _, off in ipairs({ false, 0, { bits = 0 } }) do
      local got = mlp_grads(x, w1, w2, g, off)
      for i = 1, 3 do assert.are.equal(0, rel_err(got[i], ref[i])) end
    end
    assert.are.same({ 1, 2, 3 }, { quantize.scope(nil, function(...) return ... end, 1, 2, 3) })
    assert.are.same({ "a", 5 }, { quantize.scope(8, function(a, b) return a, b end, "a", 5) })
  end)

  it("keeps gradients close to the unquantized run (8 and 4 bits)", function()
    local ref = mlp_grads(x, w1, w2, g, nil)
    -- bounds: 8 bits rounds each saved value by <= absmax / 254 (gradients
    -- within 2%); 4 bits by <= absmax / 14 (about 16% rms on gelu outputs: 25%)
    local cases = {
      { 8, 0.02 }, { { bits = 8, keep = { w1, w2 } }, 0.02 },
      { 4, 0.25 }, { { bits = 4, group_size = 32, keep = { w1, w2 } }, 0.25 },
      { { bits = 8, stochastic = true }, 0.03 },
    }
    for _, c in ipairs(cases) do
      local got = mlp_grads(x, w1, w2, g, c[1])
      for i = 1, 3 do
        local e = rel_err(got[i], ref[i])
        assert.is_true(e > 0 and e < c[2], ("spec %s grad %d: rel err %g"):format(
          type(c[1]) == "table" and c[1].bits or c[1], i, e))
      end
    end
  end)

  it("shrinks what is kept for backward", function()
    local xb, w2b = x:detach():to("bf16"), w2:detach():to("bf16")
    local w1b = w1:detach():to("bf16"):requires_grad_(true)
    local function saved_bytes(spec)
      collectgarbage()
      local before = moe.memory_stats("cpu").allocated
      local y = quantize.scope(spec, function()
        local xin = xb * 1 -- owned by the step: freed unless saved
        local h = moe.matmul(xin, w1b)
        local a = moe.gelu(h)
        local out = moe.matmul(a, w2b)
        xin:free(); h:free(); a:free()
        return out
      end)
      local bytes = moe.memory_stats("cpu").allocated - before - 64 * 96 * 2
      y:free()
      return bytes
    end
    local keep = { w1b, w2b }
    local off = saved_bytes(nil)
    local b8 = saved_bytes({ bits = 8, keep = keep })
    local b4 = saved_bytes({ bits = 4, keep = keep })
    -- 8 bits: codes + one f32 scale per row, about half of bf16
    assert.is_true(b8 * 2 <= off * 1.05 and b8 * 2 >= off * 0.95, ("off %d, 8 bits %d"):format(off, b8))
    -- 4 bits: at least 3.5x smaller
    assert.is_true(b4 * 3.5 <= off, ("off %d, 4 bits %d"):format(off, b4))
  end)

  it("accepts a quantizer written in Lua", function()
    local packs, unpacks = 0, 0
    local q = {
      name = "bf16 cast",
      min_numel = 0,
      pack = function(t)
        packs = packs + 1
        return { t:to("bf16"), t.dtype }
      end,
      unpack = function(p)
        unpacks = unpacks + 1
        return p[1]:to(p[2])
      end,
    }
    local ref = mlp_grads(x, w1, w2, g, nil)
    local got = mlp_grads(x, w1, w2, g, q)
    assert.are.equal(5, packs) -- matmul: x, w1; gelu: h; matmul: a, w2
    assert.are.equal(packs, unpacks)
    for i = 1, 3 do
      local e = rel_err(got[i], ref[i])
      assert.is_true(e > 0 and e < 2 ^ -7)
    end
    -- an 8-bit quantizer built from moe.quantize.int8 in Lua
    local got8 = mlp_grads(x, w1, w2, g, {
      pack = function(t) return quantize.int8(t) end,
      unpack = function(p) return quantize.dequantize(p) end,
    })
    for i = 1, 3 do assert.is_true(rel_err(got8[i], ref[i]) < 0.02) end
  end)

  it("names a user quantizer that returns the wrong tensor", function()
    local function run(unpack)
      local y = quantize.scope({ name = "bad q", min_numel = 0, pack = function(t) return t end,
        unpack = unpack }, function() return moe.matmul(x, w1) end)
      local ok, err = pcall(y.backward, y, moe.ones(y.shape))
      assert.is_false(ok)
      return err
    end
    assert.matches("quantizer 'bad q': unpack returned shape [6144] for a saved tensor of shape [64, 96]",
      run(function(t) return t:reshape(-1) end), 1, true)
    assert.matches("quantizer 'bad q': unpack returned dtype f64 for a saved tensor of dtype f32",
      run(function(t) return t:to("f64") end), 1, true)
    assert.matches("quantizer 'bad q': unpack returned string, not a tensor",
      run(function() return "nope" end), 1, true)
  end)
end)

describe("bad settings", function()
  local x = moe.ones({ 2, 4 })
  local f = function() return 1 end
  local cases = {
    { function() return quantize.scope(3, f) end,
      "moe.quantize.scope: bits must be 8 or 4 (or 0, nil or false for off), got 3" },
    { function() return quantize.scope({ bits = 16 }, f) end,
      "bits must be 8 or 4 (or 0, nil or false for off), got 16" },
    { function() return quantize.scope({ bits = 8, groupsize = 2 }, f) end,
      "unknown option 'groupsize' (valid options: bits, group_size, keep, min_numel, stochastic)" },
    { function() return quantize.scope({ bits = 4, group_size = 3 }, f) end, "group_size must be even for 4 bits" },
    { function() return quantize.scope({ bits = 8, group_size = -1 }, f) end, "group_size must be an integer >= 0" },
    { function() return quantize.scope({ bits = 8, stochastic = 1 }, f) end,
      "stochastic must be a boolean, got number" },
    { function() return quantize.scope({ bits = 8, keep = { 1 } }, f) end, "keep: entry 1 is number, not a tensor" },
    { function() return quantize.scope({ pack = f }, f) end,
      "a user quantizer needs pack and unpack functions, got pack = function, unpack = nil" },
    { function() return quantize.scope({ pack = f, unpack = f, bits = 8 }, f) end,
      "unknown option 'bits' (valid options: min_numel, name, pack, unpack)" },
    { function() return quantize.scope("8", f) end, "spec must be nil, false, 0, 8, 4 or a table, got string" },
    { function() return quantize.scope(8, 5) end, "bad argument #2 to 'scope' (function expected, got number)" },
    { function() return quantize.int4(x, 5) end, "moe.quantize.int4: group_size must be even for 4 bits" },
    { function() return quantize.int8("x") end, "bad argument #1 to 'int8' (tensor expected, got string)" },
    { function() return quantize.quantize(x, { pack = f, unpack = f }) end,
      "a built-in spec (8, 4 or {bits = ...}) is required" },
    { function() return moe.ops.quantize(moe.ones({ 2 }, { dtype = "i64" }), { bits = 8 }) end,
      "quantize: dtype i64 is not supported" },
    { function() return moe.ops.quantize(x, { bits = 2 }) end,
      "bad argument #2 to 'quantize' (option bits must be 8 or 4, got 2)" },
    { function() return moe.ops.quantize(x, { bits = 8, mode = 1 }) end,
      "unknown option 'mode' (valid options: bits, group_size, stochastic)" },
    { function() return moe.ops.dequantize(5) end,
      "bad argument #1 to 'dequantize' (quantized table expected (from quantize), got number)" },
    { function()
        local q = quantize.int8(x)
        q.shape = { 2, 5 }
        return moe.ops.dequantize(q)
      end, "bad argument #1 to 'dequantize' (values must be a contiguous i8 tensor of shape [2, 5]" },
    { function() return moe.ops.quantize_scope({ bits = 8 }, 5) end,
      "bad argument #2 to 'quantize_scope' (function expected, got number)" },
    { function() return moe.ops.quantize_scope({ bits = 8, keep = 3 }, f) end,
      "option keep must be a list of tensors, got 3" },
  }
  for i, c in ipairs(cases) do
    it(("case %d: %s"):format(i, c[2]), function()
      local ok, err = pcall(c[1])
      assert.is_false(ok)
      assert.matches(c[2], err, 1, true)
    end)
  end

  it("pops the hooks when fn fails", function()
    local ok, err = pcall(quantize.scope, 8, function() error("scope boom") end)
    assert.is_false(ok)
    assert.matches("scope boom", err)
    -- no hooks left: a product saved now is kept exactly
    local a = moe.randn({ 40, 40 }, { requires_grad = true })
    local y = a * a
    y:backward(moe.ones({ 40, 40 }))
    assert.are.equal(0, rel_err(a.grad, a * 2))
  end)
end)
