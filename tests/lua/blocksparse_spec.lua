--[[
tests/lua/blocksparse_spec.lua - the block-sparse family through moe.ops on
the CPU: bsmm_sdd / bsmm_dsd / bsmm_dsd_t / bsmm_dds against dense
moe.matmul on the masked dense matrix (bsmm_to_dense), bsmm_from_dense,
gradients of sdd and dsd with moe.gradcheck (trans_w both ways, a strided
input, an empty expert), the gather option (token rows read by the plan)
against the products on a permuted copy, and bad-argument errors.

Run: moe-lua tests/lua/busted.lua tests/lua/blocksparse_spec.lua (ctest does).
]]
local moe = require "moe"

local function i64(t) return moe.tensor(t, { dtype = "i64" }) end

-- T = 4, k = 2, E = 4: experts 0, 1, 2 get 3, 1, 4 assignments; expert 3 none
local IDS = { { 2, 0 }, { 0, 2 }, { 1, 2 }, { 2, 0 } }
local E, B, F = 4, 2, 2 -- block size 2, two column blocks per expert
local N = F * B

local function plan() return moe.ops.routing_plan(i64(IDS), E, { block_size = B, ffn_hidden = N }) end

local function maxdiff(a, b) return (a - b):abs():max():item() end

local function err(fn)
  local ok, e = pcall(fn)
  assert.is_false(ok)
  return tostring(e)
end

describe("block-sparse products", function()
  local p = plan()
  local R, K = p.rows, 3
  local nnz = p.nnz

  it("has the plan's shapes", function()
    assert.are.equal(10, R) -- segments of 4, 2, 4 rows, expert 3 empty
    assert.are.equal(10, nnz) -- 5 row blocks x 2 column blocks
    local s = moe.ops.bsmm_sdd(moe.randn({ R, K }), moe.randn({ E, K, N }), p)
    assert.are.same({ nnz, B, B }, s:size())
    assert.are.same({ R, K }, moe.ops.bsmm_dsd(s, moe.randn({ E, N, K }), p):size())
    assert.are.same({ E, N, K }, moe.ops.bsmm_dsd_t(s, moe.randn({ R, K }), p):size())
    assert.are.same({ E, K, N }, moe.ops.bsmm_dds(moe.randn({ R, K }), s, p):size())
    assert.are.same({ R, E * N }, moe.ops.bsmm_to_dense(s, p):size())
  end)

  it("equal dense matmul on the masked dense matrix", function()
    local x = moe.randn({ R, K }, { dtype = "f64" })
    local w = moe.randn({ E, K, N }, { dtype = "f64" })
    local wt = moe.randn({ E, N, K }, { dtype = "f64" })
    local s = moe.randn({ nnz, B, B }, { dtype = "f64" })
    local mask = moe.ops.bsmm_to_dense(moe.ones({ nnz, B, B }, { dtype = "f64" }), p)
    local sd = moe.ops.bsmm_to_dense(s, p)
    local wcat = w:permute(1, 0, 2):reshape(K, E * N) -- (K, E * N)
    local wstack = wt:reshape(E * N, K)               -- (E * N, K)
    -- sdd
    local got = moe.ops.bsmm_to_dense(moe.ops.bsmm_sdd(x, w, p), p)
    assert.is_true(maxdiff(got, moe.matmul(x, wcat) * mask) < 1e-12)
    local got_t = moe.ops.bsmm_to_dense(moe.ops.bsmm_sdd(x, wt, p, { trans_w = true }), p)
    assert.is_true(maxdiff(got_t, moe.matmul(x, wstack:transpose(0, 1)) * mask) < 1e-12)
    -- dsd
    assert.is_true(maxdiff(moe.ops.bsmm_dsd(s, wt, p), moe.matmul(sd, wstack)) < 1e-12)
    assert.is_true(maxdiff(moe.ops.bsmm_dsd(s, w, p, { trans_w = true }),
      moe.matmul(sd, wcat:transpose(0, 1))) < 1e-12)
    -- dsd_t and dds (weight gradients)
    local dt = moe.ops.bsmm_dsd_t(s, x, p):reshape(E * N, K)
    assert.is_true(maxdiff(dt, moe.matmul(sd:transpose(0, 1), x)) < 1e-12)
    local dd = moe.ops.bsmm_dds(x, s, p):permute(1, 0, 2):reshape(K, E * N)
    assert.is_true(maxdiff(dd, moe.matmul(x:transpose(0, 1), sd)) < 1e-12)
    -- the empty expert's weight gradient is zero
    assert.are.equal(0, moe.ops.bsmm_dds(x, s, p):narrow(0, 3, 1):abs():max():item())
    -- from_dense inverts to_dense; to_dense is zero outside the blocks
    assert.are.equal(0, maxdiff(moe.ops.bsmm_from_dense(sd, p), s))
    assert.are.equal(0, (sd * (1 - mask)):abs():max():item())
    assert.are.equal(nnz * B * B, mask:sum():item())
  end)

  it("keep the dtype (f32, bf16)", function()
    for _, dt in ipairs({ "f32", "bf16" }) do
      local x = moe.randn({ R, K }, { dtype = dt })
      local w = moe.randn({ E, K, N }, { dtype = dt })
      local s = moe.ops.bsmm_sdd(x, w, p)
      assert.are.equal(dt, s.dtype)
      local ref = moe.ops.bsmm_sdd(x:to("f64"), w:to("f64"), p)
      -- bf16 output: one rounding (2^-8 relative) of values of size ~3
      assert.is_true(maxdiff(s:to("f64"), ref) < (dt == "bf16" and 5e-2 or 1e-5))
    end
  end)

  it("have gradients (gradcheck in f64)", function()
    local xs = moe.randn({ K, R }, { dtype = "f64" }):transpose(0, 1):requires_grad_(true)
    local w = moe.randn({ E, K, N }, { dtype = "f64" }):requires_grad_(true)
    local wt = moe.randn({ E, N, K }, { dtype = "f64" }):requires_grad_(true)
    local s = moe.randn({ nnz, B, B }, { dtype = "f64" }):requires_grad_(true)
    assert.is_true(moe.gradcheck(function(a, b) return moe.ops.bsmm_sdd(a, b, p) end, { xs, w }))
    assert.is_true(moe.gradcheck(function(a, b)
      return moe.ops.bsmm_sdd(a, b, p, { trans_w = true })
    end, { xs, wt }))
    assert.is_true(moe.gradcheck(function(a, b) return moe.ops.bsmm_dsd(a, b, p) end, { s, wt }))
    assert.is_true(moe.gradcheck(function(a, b)
      return moe.ops.bsmm_dsd(a, b, p, { trans_w = true })
    end, { s, w }))
  end)

  it("compose into an expert MLP that matches a per-expert loop", function()
    -- y = relu(x W1_e) W2_e per row of expert e, via sdd -> relu -> dsd
    local x = moe.randn({ R, K }, { dtype = "f64" })
    local w1 = moe.randn({ E, K, N }, { dtype = "f64" })
    local w2 = moe.randn({ E, N, K }, { dtype = "f64" })
    local y = moe.ops.bsmm_dsd(moe.ops.bsmm_sdd(x, w1, p):relu(), w2, p)
    local ro = p.row_offsets:totable()
    for e = 0, E - 1 do
      local n = ro[e + 2] - ro[e + 1]
      if n > 0 then
        local xe = x:narrow(0, ro[e + 1], n)
        local want = moe.matmul(moe.matmul(xe, w1:select(0, e)):relu(), w2:select(0, e))
        assert.is_true(maxdiff(y:narrow(0, ro[e + 1], n), want) < 1e-12)
      end
    end
  end)

  it("over a plan with no rows give empty and zero results (CPU, and CUDA in bf16 when there)", function()
    -- a rank whose local experts receive no rows under expert parallelism
    local devs = { { "cpu", "f64" } }
    if moe.cuda.is_available() then devs[2] = { "cuda", "bf16" } end
    for _, d in ipairs(devs) do
      local dev, dt = d[1], d[2]
      local Bz, Kz, Fz = dev == "cuda" and 128 or 2, 128, 2
      local Nz = Fz * Bz
      local ids = moe.zeros({ 0, 1 }, { dtype = "i64", device = dev })
      local pz = moe.ops.routing_plan(ids, 2, { block_size = Bz, ffn_hidden = Nz })
      assert.are.equal(0, pz.rows)
      assert.are.equal(0, pz.nnz)
      local o = { dtype = dt, device = dev }
      local x, w, wt = moe.randn({ 0, Kz }, o), moe.randn({ 2, Kz, Nz }, o), moe.randn({ 2, Nz, Kz }, o)
      local s = moe.ops.bsmm_sdd(x, w, pz)
      assert.are.same({ 0, Bz, Bz }, s:size())
      assert.are.same({ 0, Kz }, moe.ops.bsmm_dsd(s, wt, pz):size())
      local dt_ = moe.ops.bsmm_dsd_t(s, x, pz)
      local dd = moe.ops.bsmm_dds(x, s, pz)
      assert.are.same({ 2, Nz, Kz }, dt_:size())
      assert.are.same({ 2, Kz, Nz }, dd:size())
      assert.are.equal(0, dt_:float():abs():max():item())
      assert.are.equal(0, dd:float():abs():max():item())
    end
  end)

  it("gather token rows by the plan (gather = true), as on a permuted copy", function()
    local T = #IDS
    local x, w, s = moe.randn({ T, K }), moe.randn({ E, K, N }), moe.randn({ nnz, B, B })
    local xs = moe.ops.permute(x, p) -- (R, K), zeros in the padding rows
    assert.are.equal(0, maxdiff(moe.ops.bsmm_sdd(x, w, p, { gather = true }), moe.ops.bsmm_sdd(xs, w, p)))
    local wt = moe.randn({ E, N, K })
    assert.are.equal(0, maxdiff(moe.ops.bsmm_sdd(x, wt, p, { gather = true, trans_w = true }),
      moe.ops.bsmm_sdd(xs, wt, p, { trans_w = true })))
    assert.are.equal(0, maxdiff(moe.ops.bsmm_dds(x, s, p, { gather = true }), moe.ops.bsmm_dds(xs, s, p)))
    assert.are.equal(0, maxdiff(moe.ops.bsmm_dsd_t(s, x, p, { gather = true }), moe.ops.bsmm_dsd_t(s, xs, p)))
    -- not differentiable: an input that requires grad is refused while grad mode is on
    local xg = moe.randn({ T, K }):requires_grad_(true)
    assert.truthy(err(function() moe.ops.bsmm_sdd(xg, w, p, { gather = true }) end):find(
      "bsmm_sdd_gather: not differentiable, and x requires grad", 1, true))
    moe.no_grad(function() moe.ops.bsmm_sdd(xg, w, p, { gather = true }):free() end)
    assert.truthy(err(function() moe.ops.bsmm_dsd(s, moe.randn({ E, N, K }), p, { gather = true }) end):find(
      "unknown option 'gather' (valid options: trans_w)", 1, true))
    assert.truthy(err(function() moe.ops.bsmm_dds(xs, s, p, { gather = true }) end):find(
      "bsmm_dds_gather: x has shape [10, 3], expected (T, K) with the plan's T = 4", 1, true))
    assert.truthy(err(function() moe.ops.bsmm_dsd_t(s, x, p, { trans_w = true }) end):find(
      "unknown option 'trans_w' (valid options: gather)", 1, true))
  end)

  it("reject bad arguments", function()
    local x, w = moe.randn({ R, K }), moe.randn({ E, K, N })
    assert.truthy(err(function() moe.ops.bsmm_sdd(x, w, "plan") end):find(
      "bad argument #3 to 'bsmm_sdd' (routing plan expected, got string)", 1, true))
    assert.truthy(err(function() moe.ops.bsmm_sdd(x, w, p, { trans = true }) end):find(
      "bad argument #4 to 'bsmm_sdd' (unknown option 'trans' (valid options: trans_w, gather))", 1, true))
    assert.truthy(err(function() moe.ops.bsmm_dsd(x, w, p, { trans_w = 1 }) end):find(
      "option trans_w must be a boolean", 1, true))
    assert.truthy(err(function() moe.ops.bsmm_dds(1, x, p) end):find(
      "bad argument #1 to 'bsmm_dds'", 1, true))
    assert.truthy(err(function() moe.ops.bsmm_sdd(moe.randn({ R + 2, K }), w, p) end):find(
      "bsmm_sdd: x has shape [12, 3], expected (R, K) with the plan's R = 10", 1, true))
    assert.truthy(err(function() moe.ops.bsmm_sdd(x, w, p, { trans_w = true }) end):find(
      "expected (E_loc, N, K)", 1, true))
    assert.truthy(err(function() moe.ops.bsmm_sdd(x, w:to("f64"), p) end):find(
      "bsmm_sdd: x is f32 but w is f64", 1, true))
    local unpadded = moe.ops.routing_plan(i64(IDS), E)
    assert.truthy(err(function() moe.ops.bsmm_sdd(x, w, unpadded) end):find("not padded", 1, true))
    local nohidden = moe.ops.routing_plan(i64(IDS), E, { block_size = B })
    assert.truthy(err(function() moe.ops.bsmm_to_dense(moe.randn({ nnz, B, B }), nohidden) end):find(
      "no block-sparse topology", 1, true))
    local q = plan()
    q:free()
    assert.truthy(err(function() moe.ops.bsmm_dds(x, moe.randn({ nnz, B, B }), q) end):find(
      "attempt to use a freed routing plan", 1, true))
  end)
end)
