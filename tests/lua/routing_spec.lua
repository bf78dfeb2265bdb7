--[[
tests/lua/routing_spec.lua - the routing family through moe.ops on the CPU:
moe.ops.routing_plan (fields, variants, the host-sync counter, per-rank
counts), moe.ops.permute and moe.ops.combine (values, gradients with
moe.gradcheck including the gates), a tiny MoE layer composed in Lua
(router matmul, softmax, topk, permute, a per-expert loop over narrow()ed
rows, combine) checked against a dense per-token reference in values and
in gradients, and bad-argument errors.

Run: moe-lua tests/lua/busted.lua tests/lua/routing_spec.lua (ctest does).
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

local function i64(t) return moe.tensor(t, { dtype = "i64" }) end
local function f64(t) return moe.tensor(t, { dtype = "f64" }) end

-- T = 4, k = 2, E = 3: expert 0 gets a = 1, 2, 7; expert 1 a = 4; expert 2 a = 0, 3, 5, 6
local IDS = { { 2, 0 }, { 0, 2 }, { 1, 2 }, { 2, 0 } }

describe("routing_plan", function()
  it("sorts the assignments stably by expert", function()
    local p = moe.ops.routing_plan(i64(IDS), 3)
    assert.are.equal(8, p.rows)
    assert.are.equal(4, p.T)
    assert.are.equal(2, p.k)
    assert.are.same({ 3, 1, 4 }, p.counts:totable())
    assert.are.same({ 0, 3, 4, 8 }, p.offsets:totable())
    assert.are.same({ 1, 2, 7, 4, 0, 3, 5, 6 }, p.sort_perm:totable())
    assert.are.same({ 4, 0, 1, 5, 3, 6, 7, 2 }, p.sort_inv:totable())
    assert.are.same(p.sort_inv:totable(), p.dest:totable())
    assert.is_nil(p.bs_offsets)
    assert.matches("RoutingPlan", tostring(p))
  end)

  it("takes i32 ids", function()
    local p = moe.ops.routing_plan(moe.tensor(IDS, { dtype = "i32" }), 3)
    assert.are.same({ 1, 2, 7, 4, 0, 3, 5, 6 }, p.sort_perm:totable())
  end)

  it("pads segments and builds the block-sparse topology", function()
    local p = moe.ops.routing_plan(i64(IDS), 3, { block_size = 2, ffn_hidden = 4 })
    -- segments 4, 2, 4 rows
    assert.are.same({ 0, 4, 6, 10 }, p.row_offsets:totable())
    assert.are.equal(10, p.rows)
    assert.are.equal(1, p.host_syncs) -- rows depend on the counts: the one copy
    assert.are.equal(10, p.nnz)       -- 5 row blocks x 2 column blocks
    assert.are.same({ 0, 1, 0, 1, 2, 3, 4, 5, 4, 5 }, p.bs_column_indices:totable())
    assert.are.same({ 0, 2, 4, 6, 8, 10 }, p.bs_offsets:totable())
    assert.are.same({ 0, 2, 4, 5, 6, 8, 10 }, p.bs_offsets_t:totable())
    assert.are.same({ 0, 1, 0, 1, 2, 2, 3, 4, 3, 4 }, p.bs_column_indices_t:totable())
    assert.are.same({ 0, 2, 1, 3, 4, 5, 6, 8, 7, 9 }, p.bs_block_offsets_t:totable())
    local q = moe.ops.routing_plan(i64(IDS), 3, { padded = true })
    assert.are.equal(128, q.block_size)
    assert.are.equal(3 * 128, q.rows)
  end)

  it("drops over capacity by position or by score", function()
    local p = moe.ops.routing_plan(i64(IDS), 3, { capacity_factor = 1.0 })
    assert.are.equal(3, p.capacity)
    assert.are.same({ 3, 1, 3 }, p.kept:totable())
    assert.are.same({ 6, 0, 1, 7, 3, 8, -1, 2 }, p.dest:totable())
    local s = f64({ { 0.1, 0.2 }, { 0.3, 0.9 }, { 0.4, 0.5 }, { 0.7, 0.8 } })
    local q = moe.ops.routing_plan(i64(IDS), 3, { capacity_factor = 1.0, drop_policy = "score", scores = s })
    assert.are.same({ 7, 2, 1, 4, -1, -1, 3, 6, 5 }, q.src:totable())
  end)

  it("restricts to local experts and gives per-rank counts", function()
    local p = moe.ops.routing_plan(i64(IDS), 3, { experts = { 1, 3 } })
    assert.are.equal(5, p.rows)
    assert.are.same({ 1, -1, -1, 2, 0, 3, 4, -1 }, p.dest:totable())
    assert.are.same({ 0, 0, 1, 5 }, p.row_offsets:totable())
    local q = moe.ops.routing_plan(i64({ { 0, 1 }, { 1, 1 }, { 3, 0 }, { 2, 3 } }), 4)
    assert.are.same({ 5, 3 }, q:rank_counts(2):totable())
  end)

  it("counts host synchronisations: one copy of the counts at most", function()
    local p = moe.ops.routing_plan(i64(IDS), 3)
    assert.are.equal(0, p.host_syncs)
    local x = moe.randn({ 4, 5 })
    local y = moe.ops.combine(moe.ops.permute(x, p), p)
    assert.are.equal(0, p.host_syncs)
    assert.are.same({ 3, 1, 4 }, p:counts_to_host())
    assert.are.same({ 3, 1, 4 }, p:counts_to_host())
    assert.are.equal(1, p.host_syncs)
    assert.are.same({ 4, 5 }, y.shape)
    assert.are.equal(1, moe.ops.routing_plan(i64(IDS), 3, { counts_to_host = true }).host_syncs)
  end)

  it("takes known counts without a host synchronisation, checked on the CPU", function()
    local p = moe.ops.routing_plan(i64(IDS), 3, { known_counts = { 3, 1, 4 } })
    assert.are.same({ 3, 1, 4 }, p:counts_to_host())
    assert.are.equal(0, p.host_syncs)
    -- padded: the rows follow from the known counts (no copy either)
    local q = moe.ops.routing_plan(i64(IDS), 3, { known_counts = { 3, 1, 4 }, block_size = 2 })
    assert.are.equal(10, q.rows)
    assert.are.equal(0, q.host_syncs)
    local function err(kc)
      local ok, e = pcall(moe.ops.routing_plan, i64(IDS), 3, { known_counts = kc })
      assert.is_false(ok)
      return e
    end
    assert.matches("known_counts%[1%] = 2 but the ids give 1", err({ 3, 2, 3 }))
    assert.matches("known_counts sum to 9 but there are 8 assignments", err({ 3, 2, 4 }))
    assert.matches("known_counts must be a list of 3 integers", err({ 3, 5 }))
    assert.matches("known_counts%[0%] = %-1 is negative", err({ -1, 5, 4 }))
  end)

  it("frees once, by free, <close> or the collector", function()
    local p = moe.ops.routing_plan(i64(IDS), 3)
    p:free()
    p:free()
    assert.has_error(function() moe.ops.permute(moe.randn({ 4, 2 }), p) end,
      "bad argument #2 to 'permute' (attempt to use a freed routing plan)")
    do
      local q <close> = moe.ops.routing_plan(i64(IDS), 3)
      assert.are.equal(8, q.rows)
    end
  end)
end)

describe("permute and combine", function()
  it("gather rows into expert order and sum them back with gates", function()
    local p = moe.ops.routing_plan(i64(IDS), 3)
    local x = f64({ { 1, 2 }, { 3, 4 }, { 5, 6 }, { 7, 8 } })
    local xs = moe.ops.permute(x, p)
    -- sorted assignments 1, 2, 7, 4, 0, 3, 5, 6 are tokens 0, 1, 3, 2, 0, 1, 2, 3
    assert.are.same({ { 1, 2 }, { 3, 4 }, { 7, 8 }, { 5, 6 }, { 1, 2 }, { 3, 4 }, { 5, 6 }, { 7, 8 } },
      xs:totable())
    assert.are.same(xs:totable(), p:permute(x):totable())
    local g = f64({ { 0.5, 0.25 }, { 1, 2 }, { 0, 1 }, { 3, 1 } })
    -- each token gets sum_j g[t][j] * x[t]
    assert.are.same({ { 0.75, 1.5 }, { 9, 12 }, { 5, 6 }, { 28, 32 } }, moe.ops.combine(xs, p, g):totable())
    assert.are.same({ { 2, 4 }, { 6, 8 }, { 10, 12 }, { 14, 16 } }, p:combine(xs):totable())
  end)

  it("give dropped assignments zero", function()
    local p = moe.ops.routing_plan(i64(IDS), 3, { capacity_factor = 1.0 })
    local x = f64({ { 1 }, { 2 }, { 3 }, { 4 } })
    -- a = 6 (token 3, slot 0) is dropped: token 3 keeps only slot 1
    assert.are.same({ { 2 }, { 4 }, { 6 }, { 4 } }, moe.ops.combine(moe.ops.permute(x, p), p):totable())
  end)

  it("have finite-difference gradients, gates included", function()
    for _, opts in ipairs({ {}, { block_size = 2 }, { capacity_factor = 1.0 }, { experts = { 0, 2 } } }) do
      local p = moe.ops.routing_plan(i64(IDS), 3, opts)
      local x = moe.randn({ 3, 4 }, { dtype = "f64" }):transpose(0, 1):requires_grad_(true)
      local g = moe.rand({ 4, 2 }, { dtype = "f64" }):requires_grad_(true)
      local y = moe.randn({ p.rows, 3 }, { dtype = "f64" }):requires_grad_(true)
      assert(moe.gradcheck(function(a) return moe.ops.permute(a, p) end, { x }))
      assert(moe.gradcheck(function(a, b) return moe.ops.combine(a, p, b) end, { y, g }))
      assert(moe.gradcheck(function(a, b)
        local xs = moe.ops.permute(a, p)
        return moe.ops.combine(xs * xs, p, b)
      end, { x, g }))
    end
  end)

  it("reject bad arguments", function()
    local p = moe.ops.routing_plan(i64(IDS), 3)
    assert.has_error(function() moe.ops.routing_plan(i64({ { 0, 3 } }), 3) end,
      "routing_plan: ids[0][1] = 3 is not an expert in [0, 3)")
    assert.has_error(function() moe.ops.routing_plan("ids", 3) end,
      "bad argument #1 to 'routing_plan' (tensor expected, got string)")
    assert.has_error(function() moe.ops.routing_plan(i64(IDS), 0) end,
      "bad argument #2 to 'routing_plan' (number of experts must be >= 1, got 0)")
    assert.has_error(function() moe.ops.routing_plan(i64(IDS), 3, { capacity = 2 }) end,
      "bad argument #3 to 'routing_plan' (unknown option 'capacity' (valid options: block_size, padded, ffn_hidden, capacity_factor, drop_policy, scores, experts, counts_to_host, known_counts))")
    assert.has_error(function() moe.ops.routing_plan(i64(IDS), 3, { drop_policy = "random" }) end,
      "bad argument #3 to 'routing_plan' (option drop_policy must be \"position\" or \"score\", got \"random\")")
    assert.has_error(function() moe.ops.routing_plan(i64(IDS), 3, { experts = { 2, 5 } }) end,
      "bad argument #3 to 'routing_plan' (option experts = {2, 5} must be a non-empty range inside [0, 3))")
    assert.has_error(function() moe.ops.routing_plan(i64(IDS), 3, { capacity_factor = 1, drop_policy = "score" }) end,
      "routing_plan: drop_policy 'score' needs scores (T, k)")
    assert.has_error(function() moe.ops.permute(moe.randn({ 5, 2 }), p) end,
      "routing_permute: x has shape [5, 2], expected (T, d) with the plan's T")
    assert.has_error(function() moe.ops.permute(moe.randn({ 4, 2 }), "plan") end,
      "bad argument #2 to 'permute' (routing plan expected, got string)")
    assert.has_error(function() moe.ops.combine(moe.randn({ 8, 2 }), p, moe.randn({ 4, 3 })) end,
      "routing_combine: gates has shape [4, 3], expected the plan's (T, k)")
    assert.has_error(function() moe.ops.combine(moe.randn({ 8, 2 }), p, 1) end,
      "bad argument #3 to 'combine' (tensor expected, got number)")
    assert.has_error(function() p:rank_counts(2) end,
      "routing_rank_counts: 2 ranks do not divide E = 3 experts")
  end)
end)

describe("a tiny MoE layer composed in Lua", function()
  -- router logits = x @ Wr, softmax, top-k; experts y_e = x_e @ W_e on the
  -- narrow()ed rows of the permuted tokens; combine with the top-k gates.
  local T, d, f, E, k = 9, 4, 3, 5, 2

  local function moe_layer(x, Wr, W, opts)
    local probs = moe.softmax(moe.matmul(x, Wr), -1)
    local gates, ids = moe.topk(probs, k, -1)
    local plan = moe.ops.routing_plan(ids, E, opts)
    local xs = moe.ops.permute(x, plan)
    local ro = plan.row_offsets:totable()
    local parts = {}
    for e = 0, E - 1 do
      local n = ro[e + 2] - ro[e + 1]
      if n > 0 then parts[#parts + 1] = moe.matmul(xs:narrow(0, ro[e + 1], n), W[e + 1]) end
    end
    local ys = moe.cat(parts, 0)
    return moe.ops.combine(ys, plan, gates), gates, ids
  end

  -- dense reference: every token through every expert, weighted by the
  -- gates scattered into a (T, E) matrix of zeros
  local function dense_layer(x, Wr, W)
    local probs = moe.softmax(moe.matmul(x, Wr), -1)
    local gates, ids = moe.topk(probs, k, -1)
    local full = moe.scatter(moe.zeros({ T, E }, { dtype = "f64" }), 1, ids, gates)
    local out
    for e = 0, E - 1 do
      local term = moe.matmul(x, W[e + 1]) * full:narrow(1, e, 1)
      out = out and out + term or term
    end
    return out
  end

  local function params()
    moe.manual_seed(7)
    local x = moe.randn({ T, d }, { dtype = "f64" }):requires_grad_(true)
    local Wr = moe.randn({ d, E }, { dtype = "f64" }):requires_grad_(true)
    local W = {}
    for e = 1, E do W[e] = moe.randn({ d, f }, { dtype = "f64" }):requires_grad_(true) end
    return x, Wr, W
  end

  it("matches the dense per-token reference in values", function()
    local x, Wr, W = params()
    local out, gates, ids = moe_layer(x, Wr, W)
    local ref = dense_layer(x, Wr, W)
    assert.is_true(near(out:totable()[1], ref:totable()[1], 1e-12))
    for t = 1, T do assert.is_true(near(out:totable()[t], ref:totable()[t], 1e-12)) end
    -- and per token by hand, from the routing itself
    local xt, it, gt = x:totable(), ids:totable(), gates:totable()
    local Wt = {}
    for e = 1, E do Wt[e] = W[e]:totable() end
    local o = out:totable()
    for t = 1, T do
      for c = 1, f do
        local s = 0
        for j = 1, k do
          local e = it[t][j] + 1
          local h = 0
          for i = 1, d do h = h + xt[t][i] * Wt[e][i][c] end
          s = s + gt[t][j] * h
        end
        assert.is_true(near(o[t][c], s, 1e-12))
      end
    end
  end)

  it("matches the dense reference in every gradient (x, router, experts)", function()
    for _, opts in ipairs({ {}, { block_size = 4 } }) do
      local x, Wr, W = params()
      local R = moe.randn({ T, f }, { dtype = "f64" })
      local out = moe_layer(x, Wr, W, opts)
      out:backward(R)
      local gx, gr, gw = x.grad:totable(), Wr.grad:totable(), {}
      for e = 1, E do gw[e] = W[e].grad:totable() end
      moe.zero_grad({ x, Wr, table.unpack(W) })
      dense_layer(x, Wr, W):backward(R)
      assert.is_true(near(gx, x.grad:totable(), 1e-10))
      assert.is_true(near(gr, Wr.grad:totable(), 1e-10))
      for e = 1, E do assert.is_true(near(gw[e], W[e].grad:totable(), 1e-10)) end
    end
  end)

  it("passes a finite-difference check through router and experts", function()
    local x, Wr, W = params()
    assert(moe.gradcheck(function(a, r, w1, w2, w3, w4, w5)
      return (moe_layer(a, r, { w1, w2, w3, w4, w5 }))
    end, { x, Wr, W[1], W[2], W[3], W[4], W[5] }))
  end)
end)

-- On a GPU: the plan bit-identical to the CPU's, and the tiny layer in f32
-- on cuda against the f64 CPU layer. Pending without a CUDA GPU.
local gpu = moe.cuda.is_available()
local function gpu_it(name, fn)
  if gpu then it(name, fn) else pending(name .. " (no CUDA GPU)") end
end

describe("routing on cuda", function()
  gpu_it("builds the CPU's plan and the same permute / combine values", function()
    moe.manual_seed(3)
    local ids = moe.randint(0, 16, { 300, 4 }, { dtype = "i64" })
    local gids = ids:cuda()
    for _, opts in ipairs({ {}, { block_size = 128, ffn_hidden = 256 }, { capacity_factor = 1.0 },
                            { experts = { 4, 12 } } }) do
      local p, q = moe.ops.routing_plan(ids, 16, opts), moe.ops.routing_plan(gids, 16, opts)
      assert.are.equal("cuda:0", q.device)
      for _, f in ipairs({ "counts", "offsets", "row_offsets", "sort_perm", "dest", "src" }) do
        assert.are.same(p[f]:totable(), q[f]:totable())
      end
      assert.are.equal(p.host_syncs, q.host_syncs)
      local x = moe.randn({ 300, 24 })
      local g = moe.rand({ 300, 4 })
      -- permute is a copy and combine sums in slot order in f32 on both: exact
      local xs, gxs = moe.ops.permute(x, p), moe.ops.permute(x:cuda(), q)
      assert.are.same(xs:totable(), gxs:totable())
      assert.are.same(moe.ops.combine(xs, p, g):totable(), moe.ops.combine(gxs, q, g:cuda()):totable())
    end
  end)

  gpu_it("runs the tiny MoE layer in f32 like the f64 CPU layer, gradients included", function()
    local T, d, f, E, k = 33, 16, 8, 6, 2
    moe.manual_seed(11)
    local cx, cr = moe.randn({ T, d }, { dtype = "f64" }), moe.randn({ d, E }, { dtype = "f64" })
    local cW = {}
    for e = 1, E do cW[e] = moe.randn({ d, f }, { dtype = "f64" }) end
    local R = moe.randn({ T, f }, { dtype = "f64" })
    local function layer(x, Wr, W)
      local gates, ids = moe.topk(moe.softmax(moe.matmul(x, Wr), -1), k, -1)
      local plan = moe.ops.routing_plan(ids, E, { block_size = 8 })
      local xs = moe.ops.permute(x, plan)
      local ro, parts = plan.row_offsets:totable(), {}
      for e = 0, E - 1 do
        local n = ro[e + 2] - ro[e + 1]
        if n > 0 then parts[#parts + 1] = moe.matmul(xs:narrow(0, ro[e + 1], n), W[e + 1]) end
      end
      return moe.ops.combine(moe.cat(parts, 0), plan, gates)
    end
    local function run(dev, dtype)
      local x = cx:to(dev, dtype):detach():requires_grad_(true)
      local Wr = cr:to(dev, dtype):detach():requires_grad_(true)
      local W = {}
      for e = 1, E do W[e] = cW[e]:to(dev, dtype):detach():requires_grad_(true) end
      local out = layer(x, Wr, W)
      out:backward(R:to(dev, dtype))
      local gw = {}
      for e = 1, E do gw[e] = W[e].grad:double():cpu():totable() end
      return out:double():cpu():totable(), x.grad:double():cpu():totable(),
        Wr.grad:double():cpu():totable(), gw
    end
    local o1, gx1, gr1, gw1 = run("cpu", "f64")
    local o2, gx2, gr2, gw2 = run("cuda", "f32")
    -- f32 against f64 through matmuls of depth 16 (cuBLAS may use TF32-free
    -- f32 or split sums): relative 1e-3 leaves room for f32 rounding of O(10)
    -- values; the routing (topk of well-separated random logits) is the same
    assert.is_true(near(o1, o2, 1e-3))
    assert.is_true(near(gx1, gx2, 1e-3))
    assert.is_true(near(gr1, gr2, 1e-3))
    for e = 1, E do assert.is_true(near(gw1[e], gw2[e], 1e-3)) end
  end)
end)
