--[[
tests/lua/grouped_spec.lua - the grouped GEMM family through moe.ops on the
CPU: moe.ops.grouped_mm and moe.ops.grouped_mm_wgrad against a per-group
loop of narrow() + matmul written here (both transposes, empty groups, rows
outside the groups), the three forms of the offsets (a Lua list, an i64
tensor, a routing plan), gradients with moe.gradcheck and against the
documented backward rule, the backend setting, and bad-argument errors.

Run: moe-lua tests/lua/busted.lua tests/lua/grouped_spec.lua (ctest does).
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

-- out (R, N): per group g, rows [offs[g], offs[g+1]) = x[rows] @ w[g] (or w[g]^T)
local function loop_mm(x, w, offs, trans_w)
  local R = x:size(0)
  local N = trans_w and w:size(1) or w:size(2)
  local out = moe.zeros({ R, N }, { dtype = x.dtype })
  for g = 0, #offs - 2 do
    local a, b = offs[g + 1], offs[g + 2]
    if b > a then
      local wg = w:select(0, g)
      if trans_w then wg = wg:transpose(0, 1) end
      out:narrow(0, a, b - a):copy_(moe.matmul(x:narrow(0, a, b - a), wg))
    end
  end
  return out
end

-- (G, K, N) = a_g^T b_g or (G, N, K) = b_g^T a_g
local function loop_wgrad(a, b, offs, trans_out)
  local G, K, N = #offs - 1, a:size(1), b:size(1)
  local out = moe.zeros(trans_out and { G, N, K } or { G, K, N }, { dtype = a.dtype })
  for g = 0, G - 1 do
    local s, e = offs[g + 1], offs[g + 2]
    if e > s then
      local ag, bg = a:narrow(0, s, e - s), b:narrow(0, s, e - s)
      local r = trans_out and moe.matmul(bg:transpose(0, 1), ag) or moe.matmul(ag:transpose(0, 1), bg)
      out:select(0, g):copy_(r)
    end
  end
  return out
end

local function flat(t) return t:contiguous():view({ -1 }):totable() end

-- row 0 and rows 9, 10 outside; group 1 empty
local OFFS = { 1, 4, 4, 9 }

describe("grouped_mm", function()
  it("multiplies each group's rows by its weight", function()
    for _, tw in ipairs({ false, true }) do
      local x = moe.randn({ 11, 5 }, { dtype = "f64" })
      local w = moe.randn(tw and { 3, 4, 5 } or { 3, 5, 4 }, { dtype = "f64" })
      local y = moe.ops.grouped_mm(x, w, OFFS, { trans_w = tw })
      assert.are.same({ 11, 4 }, y.shape)
      assert.is_true(near(flat(y), flat(loop_mm(x, w, OFFS, tw)), 1e-12))
      -- rows outside the groups are zero
      assert.are.same({ 0, 0, 0, 0 }, y:select(0, 0):totable())
      assert.are.same({ 0, 0, 0, 0 }, y:select(0, 10):totable())
    end
  end)

  it("takes the offsets as a list, an i64 tensor or a routing plan", function()
    local x = moe.randn({ 11, 3 }, { dtype = "f64" })
    local w = moe.randn({ 3, 3, 2 }, { dtype = "f64" })
    local a = moe.ops.grouped_mm(x, w, OFFS)
    local b = moe.ops.grouped_mm(x, w, moe.tensor(OFFS, { dtype = "i64" }))
    assert.are.same(flat(a), flat(b))
    -- a plan over 4 experts with local experts 1..3: G = 3
    local ids = moe.tensor({ { 0, 1 }, { 2, 3 }, { 1, 3 }, { 3, 2 }, { 1, 0 } }, { dtype = "i64" })
    local plan = moe.ops.routing_plan(ids, 4, { experts = { 1, 4 } })
    local xs = moe.ops.permute(moe.randn({ 5, 3 }, { dtype = "f64" }), plan)
    local y = moe.ops.grouped_mm(xs, w, plan)
    assert.are.equal(1, plan.host_syncs)
    local offs = plan.row_offsets:totable()
    local local_offs = { offs[2], offs[3], offs[4], offs[5] }
    assert.are.same({ 0, 3, 5, 8 }, local_offs) -- experts 1, 2, 3 get 3, 2, 3 rows
    assert.is_true(near(flat(y), flat(loop_mm(xs, w, local_offs, false)), 1e-12))
  end)

  it("computes in f32 and bf16", function()
    local x = moe.randn({ 11, 6 })
    local w = moe.randn({ 3, 6, 5 })
    local ref = flat(loop_mm(x:to("f64"), w:to("f64"), OFFS, false))
    assert.is_true(near(flat(moe.ops.grouped_mm(x, w, OFFS)), ref, 1e-5))
    -- bf16: inputs rounded to 8 bits of mantissa, output rounded again: 2^-7 relative of
    -- sums of 6 products of N(0, 1) values (|y| below ~10): 0.1 absolute
    local xb, wb = x:to("bf16"), w:to("bf16")
    local yb = moe.ops.grouped_mm(xb, wb, OFFS)
    assert.are.equal("bf16", yb.dtype)
    local refb = flat(loop_mm(xb:to("f64"), wb:to("f64"), OFFS, false))
    local got = flat(yb:to("f64"))
    for i = 1, #got do assert.is_true(math.abs(got[i] - refb[i]) <= 0.1) end
  end)

  it("has gradients (gradcheck, contiguous and strided)", function()
    for _, tw in ipairs({ false, true }) do
      local w = moe.randn(tw and { 3, 2, 4 } or { 3, 4, 2 }, { dtype = "f64" }):requires_grad_(true)
      local x = moe.randn({ 11, 4 }, { dtype = "f64" }):requires_grad_(true)
      local f = function(a, b) return moe.ops.grouped_mm(a, b, OFFS, { trans_w = tw }) end
      assert(moe.gradcheck(f, { x, w }))
      local xt = moe.randn({ 4, 11 }, { dtype = "f64" }):transpose(0, 1):requires_grad_(true)
      assert(moe.gradcheck(f, { xt, w }))
    end
  end)

  it("follows the documented backward rule", function()
    local x = moe.randn({ 11, 4 }):requires_grad_(true)
    local w = moe.randn({ 3, 4, 5 }):requires_grad_(true)
    local dy = moe.randn({ 11, 5 })
    moe.ops.grouped_mm(x, w, OFFS):backward(dy)
    local dx = moe.ops.grouped_mm(dy, w:detach(), OFFS, { trans_w = true })
    local dw = moe.ops.grouped_mm_wgrad(x:detach(), dy, OFFS)
    assert.are.same(flat(dx), flat(x.grad))
    assert.are.same(flat(dw), flat(w.grad))
    -- and the rows outside the groups get zero gradient
    assert.are.same({ 0, 0, 0, 0 }, x.grad:select(0, 0):totable())
  end)
end)

describe("grouped_mm_wgrad", function()
  it("sums a_g^T b_g per group, zero for empty groups", function()
    for _, to in ipairs({ false, true }) do
      local a = moe.randn({ 11, 3 }, { dtype = "f64" })
      local b = moe.randn({ 11, 4 }, { dtype = "f64" })
      local dw = moe.ops.grouped_mm_wgrad(a, b, OFFS, { trans_out = to })
      assert.are.same(to and { 3, 4, 3 } or { 3, 3, 4 }, dw.shape)
      assert.is_true(near(flat(dw), flat(loop_wgrad(a, b, OFFS, to)), 1e-12))
      for _, v in ipairs(flat(dw:select(0, 1))) do assert.are.equal(0, v) end
    end
  end)

  it("zeroes runs of empty groups (first, middle and last) and nothing else", function()
    local offs = { 0, 0, 0, 4, 4, 4, 9, 9, 9 } -- groups 1, 2, 4, 5, 7, 8 empty
    local a = moe.randn({ 9, 3 }, { dtype = "f64" })
    local b = moe.randn({ 9, 2 }, { dtype = "f64" })
    local dw = moe.ops.grouped_mm_wgrad(a, b, offs)
    assert.are.same({ 8, 3, 2 }, dw.shape)
    assert.is_true(near(flat(dw), flat(loop_wgrad(a, b, offs, false)), 1e-12))
    for _, g in ipairs({ 0, 1, 3, 4, 6, 7 }) do
      for _, v in ipairs(flat(dw:select(0, g))) do assert.are.equal(0, v) end
    end
    for _, g in ipairs({ 2, 5 }) do assert.is_true(flat(dw:select(0, g))[1] ~= 0) end
  end)
end)

describe("grouped backends", function()
  it("lists, reads and sets the backend", function()
    assert.are.same({ "auto", "loop", "cublas_grouped", "streams", "wgmma" }, moe.ops.grouped_backends())
    assert.are.equal("auto", moe.ops.grouped_backend())
    assert.are.equal("loop", moe.ops.grouped_backend("loop"))
    assert.are.equal("loop", moe.ops.grouped_backend())
    assert.has_error(function() moe.ops.grouped_backend("fastest") end,
      "bad argument #1 to 'grouped_backend' (unknown backend \"fastest\" (valid: auto,loop,cublas_grouped,streams,wgmma))")
    assert.are.equal("auto", moe.ops.grouped_backend("auto"))
  end)

  it("says where the grouped GEMM reads its offsets on the device", function()
    -- never on the CPU; on CUDA only bf16 with K and N multiples of 8 (and a Hopper GPU)
    assert.is_false(moe.ops.grouped_on_device("cpu", "bf16", 8, 4096, 14336))
    if moe.cuda.is_available() then
      assert.is_false(moe.ops.grouped_on_device("cuda:0", "f32", 8, 4096, 14336))
      assert.is_false(moe.ops.grouped_on_device("cuda:0", "bf16", 8, 4096, 14335))
      if moe.cuda.get_device_name(0):match("H[12]00") then -- Hopper: compute capability 9.0
        assert.is_true(moe.ops.grouped_on_device("cuda:0", "bf16", 8, 4096, 14336))
        moe.ops.grouped_backend("loop") -- cuBLAS, offsets on the host
        assert.is_false(moe.ops.grouped_on_device("cuda:0", "bf16", 8, 4096, 14336))
        moe.ops.grouped_backend("auto")
      end
    end
    assert.has_error(function() moe.ops.grouped_on_device("cpu", "bf16", 8, 4096) end,
      "bad argument #5 to 'grouped_on_device' (N must be an integer, got no value)")
    assert.has_error(function() moe.ops.grouped_on_device("cpu", "f99", 8, 16, 16) end)
  end)
end)

describe("grouped errors", function()
  local x = moe.randn({ 6, 4 })
  local w = moe.randn({ 2, 4, 3 })
  it("names the argument or the shapes", function()
    assert.has_error(function() moe.ops.grouped_mm(x, w, { 0, 3, 6, 6 }) end,
      "grouped_mm: w of shape [2, 4, 3] has 2 groups, wanted 3 (x [6, 4])")
    assert.has_error(function() moe.ops.grouped_mm(x, w, { 0, 3, 6 }, { trans_w = true }) end,
      "grouped_mm: x [6, 4] and w [2, 4, 3] cannot be multiplied (K 4 != 3, trans_w true)")
    assert.has_error(function() moe.ops.grouped_mm(x, w, { 0, 4, 3 }) end,
      "grouped_mm: offsets out of order: offsets[2] = 3 < offsets[1] = 4")
    assert.has_error(function() moe.ops.grouped_mm(x, w, { 0, 3, 7 }) end,
      "grouped_mm: offsets[2] = 7 is past the 6 rows of the input")
    assert.has_error(function() moe.ops.grouped_mm(x, w, { 0 }) end,
      "bad argument #3 to 'grouped_mm' (offsets must hold G + 1 >= 2 values, got 1)")
    assert.has_error(function() moe.ops.grouped_mm(x, w, { 0, 1.5, 6 }) end,
      "bad argument #3 to 'grouped_mm' (offsets[2] must be an integer, got 1.5)")
    assert.has_error(function() moe.ops.grouped_mm(x, w, "offs") end,
      "bad argument #3 to 'grouped_mm' (offsets expected (a routing plan, a list of G + 1 integers or an "
        .. "i64 tensor), got string)")
    assert.has_error(function() moe.ops.grouped_mm(x, w, moe.tensor({ 0, 3, 6 }, { dtype = "f32" })) end,
      "bad argument #3 to 'grouped_mm' (offsets tensor must be a 1-D i64 CPU tensor (G + 1), got f32 [3])")
    assert.has_error(function() moe.ops.grouped_mm(x, w, { 0, 3, 6 }, { transpose = true }) end,
      "bad argument #4 to 'grouped_mm' (unknown option 'transpose' (valid options: trans_w))")
    assert.has_error(function() moe.ops.grouped_mm(x, w, { 0, 3, 6 }, { trans_w = 1 }) end,
      "bad argument #4 to 'grouped_mm' (option trans_w must be a boolean, got 1)")
    assert.has_error(function() moe.ops.grouped_mm(x, w:to("f64"), { 0, 3, 6 }) end,
      "grouped_mm: x is f32 but w is f64")
    assert.has_error(function() moe.ops.grouped_mm(x:to("i64"), w, { 0, 3, 6 }) end,
      "grouped_mm: x has dtype i64; grouped_mm takes f32, f64 or bf16")
    assert.has_error(function() moe.ops.grouped_mm(x, "w", { 0, 3, 6 }) end)
    assert.has_error(function() moe.ops.grouped_mm_wgrad(x, moe.randn({ 5, 3 }), { 0, 3, 6 }) end,
      "grouped_mm_wgrad: a [6, 4] and b [5, 3] have different rows (6 != 5)")
    assert.has_error(function() moe.ops.grouped_mm_wgrad(x, x, { 0, 3, 6 }, { trans_w = true }) end,
      "bad argument #4 to 'grouped_mm_wgrad' (unknown option 'trans_w' (valid options: trans_out))")
  end)
end)

-- On a GPU: offsets on the device (a CUDA i64 tensor, or a CUDA plan) reach the
-- device-offset functions; the same values as the host offsets. Pending without one.
local gpu = moe.cuda.is_available()
local function gpu_it(name, fn)
  if gpu then it(name, fn) else pending(name .. " (no CUDA GPU)") end
end
describe("grouped offsets on the device", function()
  gpu_it("a CUDA offsets tensor or plan gives the host offsets' results", function()
    moe.manual_seed(5)
    local o = { dtype = "bf16", device = "cuda" }
    local x, w, dy = moe.randn({ 300, 64 }, o), moe.randn({ 4, 64, 40 }, o), moe.randn({ 300, 40 }, o)
    local host = { 3, 90, 90, 200, 280 }
    local dev = moe.tensor(host, { dtype = "i64" }):cuda()
    -- cuBLAS and the sm_90a kernel sum in different orders: bf16 roundings apart
    local y_host, y_dev = moe.ops.grouped_mm(x, w, host), moe.ops.grouped_mm(x, w, dev)
    assert.is_true(near(flat(y_dev:to("cpu", "f64")), flat(y_host:to("cpu", "f64")), 0.25))
    local g_host, g_dev = moe.ops.grouped_mm_wgrad(x, dy, host), moe.ops.grouped_mm_wgrad(x, dy, dev)
    assert.is_true(near(flat(g_dev:to("cpu", "f64")), flat(g_host:to("cpu", "f64")), 1.0))
    -- a plan on the GPU: its row offsets, read where they are
    local ids = moe.tensor({ { 0, 1 }, { 2, 3 }, { 1, 2 } }, { dtype = "i64" }):cuda()
    local plan = moe.ops.routing_plan(ids, 4)
    local xs = moe.randn({ 6, 64 }, o)
    local yp = moe.ops.grouped_mm(xs, w, plan)
    assert.are.same({ 6, 40 }, yp.shape)
    assert.are.equal(0, plan.host_syncs)
  end)
  gpu_it("names what is wrong with offsets on the device", function()
    local o = { dtype = "bf16", device = "cuda" }
    local x, w = moe.randn({ 300, 64 }, o), moe.randn({ 4, 64, 40 }, o)
    local f32 = moe.tensor({ 0, 10, 20, 30, 40 }, { dtype = "f32" }):cuda()
    assert.error_matches(function() moe.ops.grouped_mm(x, w, f32) end,
      "offsets must be a 1%-D i64 tensor of G %+ 1 >= 2 entries, got f32")
    local two = moe.tensor({ { 0, 10 }, { 20, 30 } }, { dtype = "i64" }):cuda()
    assert.error_matches(function() moe.ops.grouped_mm_wgrad(x, x, two) end,
      "offsets must be a 1%-D i64 tensor")
    local xc, wc = moe.randn({ 300, 64 }), moe.randn({ 4, 64, 40 })
    local dev = moe.tensor({ 0, 10, 20, 30, 40 }, { dtype = "i64" }):cuda()
    assert.error_matches(function() moe.ops.grouped_mm(xc, wc, dev) end,
      "offsets are on another device than the operands")
    local three = moe.tensor({ 0, 10, 20 }, { dtype = "i64" }):cuda()
    assert.error_matches(function() moe.ops.grouped_mm(x, w, three) end,
      "w of shape %[4, 64, 40%] has 4 groups, the offsets 2")
  end)
end)
