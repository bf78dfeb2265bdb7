--[[
tests/lua/experts_spec.lua - the experts family through moe.ops:
moe.ops.parallel_linear (values against a per-expert loop in Lua, grouped ==
sparse) and moe.ops.glu_experts (values; the GLU composed in Lua from
parallel_linear + silu + mul matching the fused op in the output and in
every gradient, router included; finite differences; memory_optimized;
bad-argument errors). CPU in f64; a CUDA section (pending without a GPU)
compares bf16/f32 on the GPU with the f64 CPU result.

Run: moe-lua tests/lua/busted.lua tests/lua/experts_spec.lua (ctest does).
Indices are 0-based, as everywhere in the moe API.
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

local T, d, f, E, k = 9, 4, 6, 5, 2

local function params(seed, dtype)
  moe.manual_seed(seed or 5)
  local o = { dtype = dtype or "f64" }
  return {
    x = moe.randn({ T, d }, o):requires_grad_(true),
    wr = moe.randn({ d, E }, o):requires_grad_(true),
    w1 = moe.randn({ E, d, f }, o):requires_grad_(true),
    w3 = moe.randn({ E, d, f }, o):requires_grad_(true),
    w2 = moe.randn({ E, f, d }, o):requires_grad_(true),
  }
end

local function route(p, opts)
  local gates, ids = moe.topk(moe.softmax(moe.matmul(p.x, p.wr), -1), k, -1)
  return gates, ids, moe.ops.routing_plan(ids, E, opts)
end

local ACTS = { silu = moe.silu, gelu = moe.gelu, gelu_tanh = moe.gelu_tanh }

-- the GLU expert MLP composed from parallel_linear
local function glu_lua(p, plan, gates, impl, act)
  local h1 = moe.ops.parallel_linear(p.x, p.w1, plan, { impl = impl, gather = true })
  local h3 = moe.ops.parallel_linear(p.x, p.w3, plan, { impl = impl, gather = true })
  local a = ACTS[act or "silu"](h1) * h3
  return moe.ops.parallel_linear(a, p.w2, plan, { impl = impl, scatter = true, gates = gates })
end

describe("parallel_linear", function()
  it("matches a per-expert loop over the plan's rows", function()
    local p = params(1)
    local _, ids, plan = route(p)
    local y = moe.ops.parallel_linear(p.x, p.w1, plan, { gather = true })
    assert.are.same({ plan.rows, f }, y:size())
    local src, yt, xt, wt, it = plan.src:totable(), y:totable(), p.x:totable(), p.w1:totable(), ids:totable()
    for r = 1, plan.rows do
      local a = src[r]
      local t, j = a // k, a % k
      local e = it[t + 1][j + 1]
      for c = 1, f do
        local s = 0
        for i = 1, d do s = s + xt[t + 1][i] * wt[e + 1][i][c] end
        assert.is_true(near(yt[r][c], s, 1e-12))
      end
    end
    -- trans_w: the same weights stored (E, N, K)
    local yt2 = moe.ops.parallel_linear(p.x, p.w1:transpose(1, 2):contiguous(), plan,
      { gather = true, trans_w = true })
    assert.is_true(near(yt2:totable(), yt, 1e-12))
  end)

  -- the op against the differentiable ops it fuses (permute, the grouped or
  -- block-sparse product, combine), values and the gradients of x, w and
  -- gates, for every option it takes
  local function composed(x, w, plan, o)
    local xs = o.gather and moe.ops.permute(x, plan) or x
    local y
    if o.impl == "sparse" then
      y = (xs:dim() == 3 and moe.ops.bsmm_dsd or moe.ops.bsmm_sdd)(xs, w, plan, { trans_w = o.trans_w })
    else
      y = moe.ops.grouped_mm(xs, w, plan, { trans_w = o.trans_w })
    end
    if o.scatter then return moe.ops.combine(y, plan, o.gates) end
    return y
  end
  -- x's form: "tokens" (T, K) gathered, "rows" (R, K), "hidden" the sparse
  -- (nnz, b, b); out: "rows", or "tokens" (scattered, with or without gates)
  local CASES = {
    { "grouped", "tokens", "rows" }, { "grouped", "rows", "rows" }, { "grouped", "rows", "tokens" },
    { "grouped", "rows", "gated" }, { "grouped", "tokens", "gated" }, { "grouped", "tokens", "tokens" },
    { "sparse", "tokens", "rows" }, { "sparse", "rows", "rows" }, { "sparse", "hidden", "rows" },
    { "sparse", "hidden", "tokens" }, { "sparse", "hidden", "gated" },
  }
  for _, kk in ipairs({ 1, 2 }) do
    for _, c in ipairs(CASES) do
      for _, trans in ipairs({ false, true }) do
        local impl, xin, out = c[1], c[2], c[3]
        it(("matches the composed ops in values and gradients (k %d, %s, x %s, out %s%s)"):format(
          kk, impl, xin, out, trans and ", trans_w" or ""), function()
          local o64 = { dtype = "f64" }
          moe.manual_seed(40 + kk)
          local _, ids = moe.topk(moe.rand({ T, E }, o64), kk, -1)
          local plan = moe.ops.routing_plan(ids, E, impl == "sparse" and { block_size = 2, ffn_hidden = f } or nil)
          local Kin = xin == "hidden" and f or d
          local Nout = impl == "sparse" and xin ~= "hidden" and f or d + 1
          local results = {}
          for path = 1, 2 do
            moe.manual_seed(50)
            local xshape = xin == "hidden" and { plan.nnz, 2, 2 } or { xin == "tokens" and T or plan.rows, Kin }
            local x = moe.randn(xshape, o64):requires_grad_(true)
            local w = moe.randn(trans and { E, Nout, Kin } or { E, Kin, Nout }, o64):requires_grad_(true)
            local g = out == "gated" and moe.rand({ T, kk }, o64):requires_grad_(true) or nil
            -- memory_optimized (k 2): the same values (it changes only what the backward keeps)
            local o = { impl = impl, gather = xin == "tokens", scatter = out ~= "rows", gates = g, trans_w = trans,
              memory_optimized = kk == 2 }
            local y = path == 1 and composed(x, w, plan, o) or moe.ops.parallel_linear(x, w, plan, o)
            y:backward(moe.randn(y:size(), o64))
            results[path] = { y:totable(), x.grad:totable(), w.grad:totable(), g and g.grad:totable() or {} }
          end
          for i = 1, 4 do assert.is_true(near(results[2][i], results[1][i], 1e-10)) end
        end)
      end
    end
  end

  it("passes a finite-difference check with gates and trans_w", function()
    moe.manual_seed(60)
    local o64 = { dtype = "f64" }
    local _, ids = moe.topk(moe.rand({ T, E }, o64), k, -1)
    local plan = moe.ops.routing_plan(ids, E, { block_size = 2, ffn_hidden = f })
    local x = moe.randn({ T, d }, o64):requires_grad_(true)
    local w = moe.randn({ E, d + 1, d }, o64):requires_grad_(true)
    local g = moe.rand({ T, k }, o64):requires_grad_(true)
    assert(moe.gradcheck(function(a, b, c)
      return moe.ops.parallel_linear(a, b, plan, { gather = true, scatter = true, gates = c, trans_w = true })
    end, { x, w, g }))
    local hs = moe.randn({ plan.nnz, 2, 2 }, o64):requires_grad_(true)
    local w2 = moe.randn({ E, f, d }, o64):requires_grad_(true)
    assert(moe.gradcheck(function(a, b, c)
      return moe.ops.parallel_linear(a, b, plan, { impl = "sparse", scatter = true, gates = c })
    end, { hs, w2, g }))
  end)

  it("gives the same result grouped and block-sparse", function()
    local p = params(2)
    local gates, _, plan = route(p, { block_size = 2, ffn_hidden = f })
    local hg = moe.ops.parallel_linear(p.x, p.w1, plan, { gather = true })
    local hs = moe.ops.parallel_linear(p.x, p.w1, plan, { gather = true, impl = "sparse" })
    assert.are.same({ plan.nnz, 2, 2 }, hs:size())
    local og = moe.ops.parallel_linear(hg, p.w2, plan, { scatter = true, gates = gates })
    local os = moe.ops.parallel_linear(hs, p.w2, plan, { scatter = true, gates = gates, impl = "sparse" })
    assert.is_true(near(og:totable(), os:totable(), 1e-12))
  end)
end)

describe("glu_experts", function()
  for _, impl in ipairs({ "grouped", "sparse" }) do
    for _, act in ipairs({ "silu", "gelu", "gelu_tanh" }) do
      it(("matches the Lua-composed GLU in values and all gradients (%s, %s)"):format(impl, act), function()
        local opts = impl == "sparse" and { block_size = 3, ffn_hidden = f } or nil
        local R = moe.randn({ T, d }, { dtype = "f64" })
        local results = {}
        for path = 1, 3 do
          local p = params(3)
          local gates, _, plan = route(p, opts)
          local out
          if path == 1 then
            out = glu_lua(p, plan, gates, impl, act)
          else
            out = moe.ops.glu_experts(p.x, p.w1, p.w3, p.w2, plan, gates,
              { impl = impl, activation = act, memory_optimized = path == 3 })
          end
          out:backward(R)
          results[path] = { out:totable(), p.x.grad:totable(), p.wr.grad:totable(),
            p.w1.grad:totable(), p.w3.grad:totable(), p.w2.grad:totable() }
        end
        for path = 2, 3 do
          for i = 1, 6 do assert.is_true(near(results[path][i], results[1][i], 1e-10)) end
        end
      end)
    end
  end

  it("takes nil gates (all ones) and passes a finite-difference check", function()
    local p = params(4)
    local _, ids = moe.topk(moe.softmax(moe.matmul(p.x, p.wr), -1), k, -1)
    local plan = moe.ops.routing_plan(ids, E, { block_size = 3, ffn_hidden = f })
    local g = moe.rand({ T, k }, { dtype = "f64" }):requires_grad_(true)
    local x = moe.randn({ d, T }, { dtype = "f64" }):transpose(0, 1):requires_grad_(true)
    for _, impl in ipairs({ "grouped", "sparse" }) do
      assert(moe.gradcheck(function(a, w1, w3, w2, gg)
        return moe.ops.glu_experts(a, w1, w3, w2, plan, gg, { impl = impl })
      end, { x, p.w1, p.w3, p.w2, g }))
      assert(moe.gradcheck(function(a, w1, w3, w2)
        return moe.ops.glu_experts(a, w1, w3, w2, plan, nil, { impl = impl, memory_optimized = true })
      end, { x, p.w1, p.w3, p.w2 }))
    end
  end)

  it("counts one host synchronisation per plan for forward and backward", function()
    local p = params(6)
    local gates, _, plan = route(p)
    assert.are.equal(0, plan.host_syncs)
    moe.ops.glu_experts(p.x, p.w1, p.w3, p.w2, plan, gates):sum():backward()
    assert.are.equal(1, plan.host_syncs)
  end)
end)

describe("glu_experts quantize", function()
  -- the op's own quantization of h1 and h3 gives the bits of the
  -- general saved-tensor route: quantize_scope around the memory-optimized
  -- op, keeping x, the gates and the weights
  local function grads(p, run)
    for _, t in ipairs({ p.x, p.wr, p.w1, p.w3, p.w2 }) do t.grad = nil end
    local gates, _, plan = route(p, { block_size = 3, ffn_hidden = f })
    local y = run(gates, plan)
    moe.sum(y * y):backward()
    return y, { p.x.grad, p.wr.grad, p.w1.grad, p.w3.grad, p.w2.grad }
  end
  it("matches quantize_scope around the memory-optimized op, bit for bit", function()
    local p = params(9, "f32")
    for _, impl in ipairs({ "grouped", "sparse" }) do
      for _, q in ipairs({ { bits = 8 }, { bits = 4, group_size = 2 }, { bits = 8, stochastic = true } }) do
        local qo = { bits = q.bits, group_size = q.group_size, stochastic = q.stochastic, min_numel = 0 }
        moe.manual_seed(1)
        local y1, g1 = grads(p, function(gates, plan)
          return moe.ops.glu_experts(p.x, p.w1, p.w3, p.w2, plan, gates, { impl = impl, quantize = qo })
        end)
        moe.manual_seed(1)
        local y2, g2 = grads(p, function(gates, plan)
          local so = { keep = { p.x, p.w1, p.w3, p.w2, gates } }
          for kk, v in pairs(qo) do so[kk] = v end
          return moe.ops.quantize_scope(so, moe.ops.glu_experts, p.x, p.w1, p.w3, p.w2, plan, gates,
            { impl = impl, memory_optimized = true })
        end)
        local y0, g0 = grads(p, function(gates, plan)
          return moe.ops.glu_experts(p.x, p.w1, p.w3, p.w2, plan, gates, { impl = impl })
        end)
        assert.are.same(y0:totable(), y1:totable()) -- the forward is not quantized
        assert.are.same(y1:totable(), y2:totable())
        local differs = false
        for i = 1, #g1 do
          assert.are.same(g2[i]:totable(), g1[i]:totable())
          differs = differs or moe.max(moe.abs(g1[i] - g0[i])):item() > 0
        end
        assert.is_true(differs) -- and backward saw quantized values
      end
    end
  end)
  it("rejects bad settings with the option's name", function()
    local p = params(10, "f32")
    local gates, _, plan = route(p)
    local function call(q)
      return moe.ops.glu_experts(p.x, p.w1, p.w3, p.w2, plan, gates, { quantize = q })
    end
    assert.has_error(function() call({ bits = 5 }) end,
      "bad argument #7 to 'glu_experts' (option quantize.bits must be 8 or 4, got 5)")
    assert.has_error(function() call({ bits = 8, gruop_size = 4 }) end,
      "bad argument #7 to 'glu_experts' (unknown option quantize.gruop_size"
        .. " (valid options: bits, group_size, min_numel, stochastic))")
    assert.has_error(function() call({ bits = 4, group_size = 3 }) end,
      "bad argument #7 to 'glu_experts' (option quantize.group_size must be even for 4 bits, got 3)")
    assert.has_error(function() call({ bits = 8, stochastic = "yes" }) end,
      "bad argument #7 to 'glu_experts' (option quantize.stochastic must be a boolean, got string)")
    assert.has_error(function() call(8) end,
      "bad argument #7 to 'glu_experts' (option quantize must be a table {bits = 8 | 4, ...}, got 8)")
    assert.is_true(moe.is_tensor(call(false)))
  end)
end)

describe("parallel_linear's node", function()
  it("accumulates with retain_graph and says so when its saved tensors are gone", function()
    local p = params(8)
    local gates, _, plan = route(p)
    local g = gates:detach():requires_grad_(true)
    local y = moe.ops.parallel_linear(p.x, p.w1:transpose(1, 2):contiguous(), plan,
      { gather = true, scatter = true, gates = g, trans_w = true })
    local R = moe.randn(y:size(), { dtype = "f64" })
    y:backward(R, { retain_graph = true })
    local gx, gg = p.x.grad:totable(), g.grad:totable()
    y:backward(R)
    for t = 1, T do
      for j = 1, k do assert.is_true(near(g.grad:totable()[t][j], 2 * gg[t][j], 1e-12)) end
      for c = 1, d do assert.is_true(near(p.x.grad:totable()[t][c], 2 * gx[t][c], 1e-12)) end
    end
    local ok, err = pcall(y.backward, y, R)
    assert.is_false(ok)
    assert.matches("retain_graph", err)
  end)
end)

describe("experts bad arguments", function()
  local p = params(7)
  local gates, _, plan = route(p)
  it("names the argument and the problem", function()
    assert.has_error(function() moe.ops.parallel_linear(p.x, p.w1, "plan") end,
      "bad argument #3 to 'parallel_linear' (routing plan expected, got string)")
    assert.has_error(function() moe.ops.parallel_linear(p.x, p.w1, plan, { impl = "dense" }) end,
      "bad argument #4 to 'parallel_linear' (option impl must be \"grouped\" or \"sparse\", got \"dense\")")
    assert.has_error(function() moe.ops.parallel_linear(p.x, p.w1, plan, { gahter = true }) end,
      "bad argument #4 to 'parallel_linear' (unknown option 'gahter' (valid options: impl, trans_w, gather, scatter, "
      .. "gates, memory_optimized))")
    assert.has_error(function() moe.ops.parallel_linear(p.x, p.w1, plan, { memory_optimized = "yes" }) end,
      "bad argument #4 to 'parallel_linear' (option memory_optimized must be a boolean, got string)")
    assert.has_error(function() moe.ops.parallel_linear(p.x, p.w1, plan, { gather = 1 }) end,
      "bad argument #4 to 'parallel_linear' (option gather must be a boolean, got 1)")
    assert.has_error(function() moe.ops.parallel_linear(p.x, p.w1, plan, { impl = "sparse", gather = true }) end)
    local ok, err = pcall(moe.ops.parallel_linear, p.x, p.w1, plan, { impl = "sparse", gather = true })
    assert.is_false(ok)
    assert.matches("padded with ffn_hidden", err)
    ok, err = pcall(moe.ops.parallel_linear, p.x, p.w1, plan)
    assert.is_false(ok)
    assert.matches("parallel_linear: x must be %(R, K%)", err)
    assert.has_error(function() moe.ops.glu_experts(p.x, p.w1, p.w3, p.w2, plan, gates, { activation = "relu" }) end,
      "bad argument #7 to 'glu_experts' (option activation must be \"silu\", \"gelu\" or \"gelu_tanh\", got \"relu\")")
    assert.has_error(function() moe.ops.glu_experts(p.x, p.w1, p.w3, p.w2, plan, 3) end)
    ok, err = pcall(moe.ops.glu_experts, p.x, p.w1, p.w2, p.w2, plan, gates)
    assert.is_false(ok)
    assert.matches("glu_experts: w1", err)
    plan:free()
    assert.has_error(function() moe.ops.glu_experts(p.x, p.w1, p.w3, p.w2, plan, gates) end,
      "bad argument #5 to 'glu_experts' (attempt to use a freed routing plan)")
  end)
end)

-- On a GPU: glu_experts in bf16 / f32 against the f64 CPU result (values and
-- gradients), both impls. Pending without a CUDA GPU.
local gpu = moe.cuda.is_available()
local function gpu_it(name, fn)
  if gpu then it(name, fn) else pending(name .. " (no CUDA GPU)") end
end

describe("glu_experts on cuda", function()
  gpu_it("matches the f64 CPU op (f32 and bf16, grouped and sparse)", function()
    local Tg, dg, fg, Eg, kg = 300, 64, 256, 8, 2
    moe.manual_seed(9)
    local cx = moe.randn({ Tg, dg }, { dtype = "f64" })
    local c1 = moe.randn({ Eg, dg, fg }, { dtype = "f64" }) * 0.1
    local c3 = moe.randn({ Eg, dg, fg }, { dtype = "f64" }) * 0.1
    local c2 = moe.randn({ Eg, fg, dg }, { dtype = "f64" }) * 0.1
    local cg = moe.rand({ Tg, kg }, { dtype = "f64" })
    local ids = moe.randint(0, Eg, { Tg, kg }, { dtype = "i64" })
    local R = moe.randn({ Tg, dg }, { dtype = "f64" })
    local function run(dev, dtype, impl)
      local plan = moe.ops.routing_plan(dev == "cpu" and ids or ids:cuda(), Eg,
        { block_size = 128, ffn_hidden = fg })
      local t = {}
      for name, v in pairs({ x = cx, w1 = c1, w3 = c3, w2 = c2, g = cg }) do
        t[name] = v:to(dev, dtype):detach():requires_grad_(true)
      end
      local out = moe.ops.glu_experts(t.x, t.w1, t.w3, t.w2, plan, t.g, { impl = impl })
      out:backward(R:to(dev, dtype))
      local res = { out:double():cpu():totable() }
      for _, name in ipairs({ "x", "w1", "w3", "w2", "g" }) do
        res[#res + 1] = t[name].grad:double():cpu():totable()
      end
      return res
    end
    local function maxrel(a, b, acc)
      if type(a) == "table" then
        for i = 1, #a do acc = maxrel(a[i], b[i], acc) end
        return acc
      end
      acc.err = math.max(acc.err, math.abs(a - b))
      acc.scale = math.max(acc.scale, math.abs(b))
      return acc
    end
    local ref = run("cpu", "f64", "grouped")
    -- f32: cuBLAS f32 GEMMs of depth <= 300 on O(1) values: 1e-4 of the
    -- largest magnitude; bf16: 8-bit mantissas on h1, h3, a, y and the
    -- gradients: 3e-2 of the largest magnitude
    for _, cfg in ipairs({ { "f32", 1e-4 }, { "bf16", 3e-2 } }) do
      for _, impl in ipairs({ "grouped", "sparse" }) do
        local got = run("cuda", cfg[1], impl)
        for i = 1, #ref do
          local acc = maxrel(got[i], ref[i], { err = 0, scale = 0 })
          assert.is_true(acc.err <= cfg[2] * acc.scale,
            ("%s %s tensor %d: err %g scale %g"):format(cfg[1], impl, i, acc.err, acc.scale))
        end
      end
    end
  end)
end)
