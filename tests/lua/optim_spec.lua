--[[
tests/lua/optim_spec.lua - moe.optim on the CPU: AdamW against a reference
written here in plain Lua (doubles) over several steps for f32 and f64
parameters and for bf16 parameters with fp32 master weights; decoupled weight
decay and no_decay; SGD with momentum; the learning-rate schedules' values;
clip_grad_norm; the multi-tensor AdamW bit for bit against the per-tensor
path (mixed dtypes, decay groups, missing gradients, device clip coefficient
and skip flag), optim.grad_norm and lazy clipping (the GPU cases are pending
without one); the state_dict / load_state_dict round trip through a
safetensors file (continuing gives the same bits); bad arguments.

Run: moe-lua tests/lua/busted.lua tests/lua/optim_spec.lua (ctest does).
]]
local moe = require "moe"
local optim = require "moe.optim"

local function flat(t) return t:reshape({ -1 }):double():totable() end

local function max_rel(got, want)
  local worst = 0
  for i = 1, #want do
    local e = math.abs(got[i] - want[i]) / (math.abs(want[i]) + 1e-3)
    if e > worst then worst = e end
  end
  return worst
end

-- Deterministic values: parameter i, gradient of step s.
local function pvals(n) local t = {} for i = 1, n do t[i] = math.sin(0.7 * i + 0.3) * 2 end return t end
local function gvals(n, s) local t = {} for i = 1, n do t[i] = math.cos(1.3 * i + s) * (0.5 + 0.1 * s) end return t end

-- PyTorch's AdamW in doubles.
local function ref_adamw(w, m, v, g, o, step)
  local bc1, bc2 = 1 - o.beta1 ^ step, 1 - o.beta2 ^ step
  for i = 1, #w do
    w[i] = w[i] * (1 - o.lr * o.wd)
    m[i] = o.beta1 * m[i] + (1 - o.beta1) * g[i]
    v[i] = o.beta2 * v[i] + (1 - o.beta2) * g[i] * g[i]
    w[i] = w[i] - o.lr / bc1 * m[i] / (math.sqrt(v[i]) / math.sqrt(bc2) + o.eps)
  end
end

local function zeros(n) local t = {} for i = 1, n do t[i] = 0 end return t end

local function run_adamw(dtype, tol)
  local n = 12
  local p = moe.tensor(pvals(n), { dtype = dtype }):view(3, 4)
  local opt = optim.AdamW({ { "w", p } }, { lr = 1e-2, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1 })
  local w, m, v = flat(p), zeros(n), zeros(n)
  for s = 1, 5 do
    p.grad = moe.tensor(gvals(n, s), { dtype = dtype }):view(3, 4)
    opt:step()
    ref_adamw(w, m, v, gvals(n, s), { lr = 1e-2, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, wd = 0.1 }, s)
  end
  local sd = opt:state_dict()
  local main = sd["w.master"] or p
  assert.is_true(max_rel(flat(main), w) <= tol, "params: " .. max_rel(flat(main), w))
  assert.is_true(max_rel(flat(sd["w.exp_avg"]), m) <= tol)
  assert.is_true(max_rel(flat(sd["w.exp_avg_sq"]), v) <= tol)
  assert.are.equal(5, opt.step_count)
  return p, opt
end

describe("optim.AdamW", function()
  it("matches the reference for f32 parameters (f32 state: 1e-5 relative)", function()
    local _, opt = run_adamw("f32", 1e-5)
    assert.is_nil(opt:state_dict()["w.master"])
  end)

  it("matches the reference for f64 parameters (1e-12)", function()
    run_adamw("f64", 1e-12)
  end)

  it("keeps fp32 master weights for bf16 parameters", function()
    -- the reference starts from the bf16-rounded values, as the master does
    local n = 12
    local p = moe.tensor(pvals(n), { dtype = "bf16" }):view(3, 4)
    local opt = optim.AdamW({ { "w", p } }, { lr = 1e-2, weight_decay = 0.1 })
    local sd = opt:state_dict()
    assert.are.equal("f32", sd["w.master"].dtype)
    assert.are.equal("f32", sd["w.exp_avg"].dtype)
    assert.are.same({ 3, 4 }, sd["w.exp_avg"].shape)
    local w, m, v = flat(p), zeros(n), zeros(n)
    for s = 1, 5 do
      p.grad = moe.tensor(gvals(n, s), { dtype = "bf16" }):view(3, 4)
      opt:step()
      local g = flat(p.grad)
      ref_adamw(w, m, v, g, { lr = 1e-2, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, wd = 0.1 }, s)
    end
    assert.is_true(max_rel(flat(sd["w.master"]), w) <= 1e-5)
    -- the bf16 parameter is the master rounded to nearest even
    assert.are.same(flat(sd["w.master"]:bfloat16()), flat(p))
    assert.are.equal("bf16", p.dtype)
  end)

  it("decays only parameters no_decay rejects, and skips parameters without grad", function()
    local w = moe.ones({ 2, 2 }, { dtype = "f64" })
    local b = moe.ones({ 2 }, { dtype = "f64" })
    local c = moe.ones({ 2 }, { dtype = "f64" })
    local opt = optim.AdamW({ { "w", w }, { "b", b }, { "c", c } }, { lr = 0.5, weight_decay = 0.1 })
    w.grad = moe.zeros({ 2, 2 }, { dtype = "f64" })
    b.grad = moe.zeros({ 2 }, { dtype = "f64" })
    opt:step()
    local d = 1 - 0.5 * 0.1 -- decoupled decay; a zero gradient moves nothing
    assert.are.same({ d, d, d, d }, flat(w))
    assert.are.same({ 1, 1 }, flat(b))
    assert.are.same({ 1, 1 }, flat(c))
    local opt2 = optim.AdamW({ { "b", b } }, { lr = 0.5, weight_decay = 0.1, no_decay = function() return false end })
    opt2:step()
    assert.are.same({ d, d }, flat(b))
    opt2:zero_grad()
    assert.is_nil(b.grad)
  end)

  it("follows a settable lr", function()
    local w = moe.ones({ 2, 2 }, { dtype = "f32" })
    local opt = optim.AdamW({ { "w", w } }, { lr = 0.1 })
    opt.lr = 0
    w.grad = moe.ones({ 2, 2 })
    opt:step()
    assert.are.same({ 1, 1, 1, 1 }, flat(w))
  end)

  it("loads its state into bf16 parameters that require grad (a model's, at resume)", function()
    local a = moe.tensor(pvals(6), { dtype = "bf16", requires_grad = true })
    local o = optim.AdamW({ { "a", a } }, { lr = 3e-3 })
    local sd = {}
    for k, t in pairs(o:state_dict()) do sd[k] = t:clone() end
    sd["a.master"]:fill_(0.5)
    o:load_state_dict(sd, { step = 2 })
    assert.are.same({ 0.5, 0.5, 0.5, 0.5, 0.5, 0.5 }, flat(a)) -- the parameter follows the loaded master
    assert.is_true(a.requires_grad)
  end)

  it("round-trips its state through safetensors and continues bit for bit", function()
    local function make()
      local a = moe.tensor(pvals(6), { dtype = "bf16" }):view(2, 3)
      local b = moe.tensor(pvals(3), { dtype = "f32" })
      return a, b, optim.AdamW({ { "layer.a", a }, { "layer.b", b } }, { lr = 3e-3 })
    end
    local a1, b1, o1 = make()
    for s = 1, 3 do
      a1.grad = moe.tensor(gvals(6, s), { dtype = "bf16" }):view(2, 3)
      b1.grad = moe.tensor(gvals(3, s), { dtype = "f32" })
      o1:step()
    end
    local keys = {}
    for k in pairs(o1:state_dict()) do keys[#keys + 1] = k end
    table.sort(keys)
    assert.are.same({ "layer.a.exp_avg", "layer.a.exp_avg_sq", "layer.a.master", "layer.b.exp_avg",
                      "layer.b.exp_avg_sq" }, keys)
    local path = os.tmpname()
    moe.save(path, o1:state_dict())
    local scalars = o1:state_scalars()
    assert.are.equal(3, scalars.step)
    local a2, b2, o2 = make()
    o2:load_state_dict(moe.load(path), scalars)
    os.remove(path)
    assert.are.same(flat(a1), flat(a2)) -- the bf16 param follows the loaded master
    b2:copy_(b1)
    for s = 4, 5 do
      for _, pair in ipairs({ { a1, b1 }, { a2, b2 } }) do
        pair[1].grad = moe.tensor(gvals(6, s), { dtype = "bf16" }):view(2, 3)
        pair[2].grad = moe.tensor(gvals(3, s), { dtype = "f32" })
      end
      o1:step()
      o2:step()
    end
    assert.are.same(flat(a1), flat(a2))
    assert.are.same(flat(b1), flat(b2))
    assert.are.equal(5, o2.step_count)
  end)

  it("rejects bad arguments and state", function()
    local w = moe.ones({ 2, 2 }, { dtype = "f32" })
    assert.has_error(function() optim.AdamW({ { "w", w } }, { lr = 1, bogus = 2 }) end,
      "optim.AdamW: unknown option 'bogus' (valid: betas, eps, lr, master_weights, multi_tensor, no_decay, weight_decay)")
    local half = moe.ones({ 2 }, { dtype = "bf16" })
    assert.has_error(function() optim.AdamW({ { "w", half } }, { master_weights = false }) end,
      "optim.AdamW: parameter 'w' is bf16: it needs master_weights (an fp32 copy)")
    assert.has_error(function() optim.AdamW({ { "w", moe.ones({ 2 }, { dtype = "i64" }) } }) end,
      "optim.AdamW: parameter 'w' has dtype i64; optimisers take f32, f64, bf16 or f16")
    local opt = optim.AdamW({ { "w", w } })
    assert.has_error(function() opt:load_state_dict({}) end, "AdamW:load_state_dict: missing state tensor 'w.exp_avg'")
    local bad = opt:state_dict()
    bad["w.exp_avg"] = moe.zeros({ 4 })
    assert.has_error(function() opt:load_state_dict(bad) end,
      "AdamW:load_state_dict: state 'w.exp_avg' has shape [4], expected [2, 2]")
    local ok, err = pcall(moe.ops.adamw_step, w, moe.zeros({ 3 }), moe.zeros({ 2, 2 }), moe.zeros({ 2, 2 }), nil,
                          { lr = 1 })
    assert.is_false(ok)
    assert.matches("grad has shape %[3%] but param has shape %[2, 2%]", err)
    ok, err = pcall(moe.ops.adamw_step, w, w, w, w, nil, { lr = 1, beta = 0.9 })
    assert.is_false(ok)
    assert.matches("bad argument #6 to 'adamw_step' %(unknown option 'beta' %(valid options: ", err)
  end)
end)

describe("optim.SGD", function()
  it("matches the momentum reference", function()
    local n = 8
    local p = moe.tensor(pvals(n), { dtype = "f64" })
    local opt = optim.SGD({ p }, { lr = 0.1, momentum = 0.9, weight_decay = 0.01 })
    local w, buf = flat(p), zeros(n)
    for s = 1, 4 do
      local g = gvals(n, s)
      p.grad = moe.tensor(g, { dtype = "f64" })
      opt:step()
      for i = 1, n do
        buf[i] = 0.9 * buf[i] + g[i] + 0.01 * w[i]
        w[i] = w[i] - 0.1 * buf[i]
      end
    end
    assert.is_true(max_rel(flat(p), w) <= 1e-12)
    assert.is_true(max_rel(flat(opt:state_dict()["0.momentum_buffer"]), buf) <= 1e-12)
  end)

  it("needs lr", function()
    assert.has_error(function() optim.SGD({}, {}) end, "optim.SGD: option lr is required")
  end)
end)

describe("optim.schedule", function()
  it("warms up linearly then decays by cosine to min_lr", function()
    local s = optim.schedule { lr = 1, min_lr = 0.1, warmup = 4, total = 14, decay = "cosine" }
    assert.are.equal(0.25, s(0))
    assert.are.equal(1, s(3))
    assert.are.equal(1, s(4))
    assert.is_true(math.abs(s(9) - 0.55) < 1e-12) -- halfway: (lr + min_lr) / 2
    assert.are.equal(0.1, s(14))
    assert.are.equal(0.1, s(100))
  end)

  it("decays linearly or stays constant", function()
    local l = optim.schedule { lr = 2, min_lr = 0, warmup = 0, total = 10, decay = "linear" }
    assert.are.equal(2, l(0))
    assert.are.equal(1, l(5))
    assert.are.equal(0, l(10))
    local c = optim.schedule { lr = 3e-4, warmup = 2, decay = "constant" }
    assert.are.equal(1.5e-4, c(0))
    assert.are.equal(3e-4, c(1000))
  end)

  it("rejects bad options", function()
    assert.has_error(function() optim.schedule { lr = 1, total = 10, decay = "step" } end,
      "optim.schedule: decay must be \"cosine\", \"linear\" or \"constant\", got step")
    assert.has_error(function() optim.schedule { lr = 1, warmup = 5, total = 3 } end,
      "optim.schedule: total must be an integer >= warmup (5) for cosine decay, got 3")
    assert.has_error(function() optim.schedule { lr = 1, total = 3, warm = 1 } end)
  end)
end)

describe("optim.clip_grad_norm", function()
  it("returns the global norm and scales the gradients down to max_norm", function()
    local a = moe.zeros({ 2, 2 }, { dtype = "f32" })
    local b = moe.zeros({ 3 }, { dtype = "bf16" })
    local c = moe.zeros({ 1 }, { dtype = "f32" }) -- no grad: ignored
    a.grad = moe.tensor({ { 3, 0 }, { 0, 0 } }, { dtype = "f32" })
    b.grad = moe.tensor({ 0, 4, 0 }, { dtype = "bf16" })
    assert.are.equal(5, optim.clip_grad_norm({ a, b, c }, 10)) -- below: untouched
    assert.are.same({ 3, 0, 0, 0 }, flat(a.grad))
    local total = optim.clip_grad_norm({ { "a", a }, { "b", b } }, 1)
    assert.are.equal(5, total)
    local ga, gb = flat(a.grad), flat(b.grad)
    assert.is_true(math.abs(ga[1] - 0.6) < 1e-6)
    assert.is_true(math.abs(gb[2] - 0.8) < 4e-3) -- bf16 gradient: 8 bits of mantissa
    assert.are.equal(0, optim.clip_grad_norm({ c }, 1))
    assert.has_error(function() optim.clip_grad_norm({ a }, -1) end,
      "optim.clip_grad_norm: max_norm must be a positive number, got -1")
  end)
end)

-- ------------------------------------------------------------------ multi-tensor

-- Mixed parameters: f32 and f64 without master, bf16 and f32 with master,
-- two weight-decay groups (no_decay: 1-D), a parameter left without a
-- gradient on some steps; one copy per optimizer.
local function mixed_params(device)
  local specs = {
    { "w1", { 4, 5 }, "f32" }, { "b1", { 5 }, "f32" }, { "w2", { 3, 7 }, "bf16" },
    { "n2", { 7 }, "bf16" }, { "w3", { 2, 3 }, "f64" }, { "w4", { 70 }, "f32" },
    { "w5", { 6, 2 }, "f16" },
  }
  local out = {}
  for k, s in ipairs(specs) do
    local n = 1
    for _, d in ipairs(s[2]) do n = n * d end
    local v = {}
    for i = 1, n do v[i] = math.sin(0.37 * i + k) end
    local t = moe.tensor(v, { dtype = s[3] }):reshape(s[2])
    if device then t = t:to(device) end
    out[k] = { s[1], t }
  end
  return out
end

local function set_grads(params, step)
  for k, e in ipairs(params) do
    local t = e[2]
    if not (k == 2 and step % 3 == 0) then -- b1 has no gradient every third step
      local n = t:numel()
      local v = {}
      for i = 1, n do v[i] = math.cos(1.1 * i + step + k) * (0.2 + 0.1 * step) end
      t.grad = moe.tensor(v, { dtype = t.dtype, device = t.device }):reshape(t.shape)
    else
      t.grad = nil
    end
  end
end

local function same_bits(a, b)
  local x, y = flat(a), flat(b)
  if #x ~= #y then return false end
  for i = 1, #x do if x[i] ~= y[i] then return false end end
  return true
end

local function assert_same_state(o1, o2)
  local s1, s2 = o1:state_dict(), o2:state_dict()
  local n = 0
  for key, t in pairs(s1) do
    assert(same_bits(t, s2[key]), "state " .. key .. " differs")
    n = n + 1
  end
  assert.is_true(n > 0)
  for i, e in ipairs(o1.params) do assert(same_bits(e.param, o2.params[i].param), e.name) end
end

local function run_pair(device, steps, with_clip)
  local pa, pb = mixed_params(device), mixed_params(device)
  local function names(ps)
    local out = {}
    for _, e in ipairs(ps) do out[#out + 1] = { e[1], e[2] } end
    return out
  end
  local opts = { lr = 0.01, betas = { 0.9, 0.95 }, weight_decay = 0.1 }
  local ref = optim.AdamW(names(pa), { lr = opts.lr, betas = opts.betas, weight_decay = 0.1,
                                       multi_tensor = false })
  local multi = optim.AdamW(names(pb), opts)
  assert.is_true(multi.multi_tensor)
  assert.is_false(ref.multi_tensor)
  for step = 1, steps do
    set_grads(pa, step)
    set_grads(pb, step)
    if with_clip then
      local la, lb = {}, {}
      for i = 1, #pa do la[i], lb[i] = pa[i][2], pb[i][2] end
      local n1, c1, f1 = optim.grad_norm(la, 0.5)
      local n2, c2, f2 = optim.grad_norm(lb, 0.5)
      assert.are.equal(n1:item(), n2:item())
      ref:step({ grad_scale = c1, skip = f1 })
      multi:step({ grad_scale = c2, skip = f2 })
    else
      ref:step()
      multi:step()
    end
    ref:zero_grad()
    multi:zero_grad()
  end
  assert_same_state(ref, multi)
  return ref, multi
end

describe("optim.AdamW multi-tensor", function()
  it("gives the bits of the per-tensor path over 10 steps of mixed parameters", function()
    local _, multi = run_pair(nil, 10, false)
    assert.are.equal(10, multi.step_count)
  end)

  it("applies the clip coefficient and the skip flag on the device like the reference", function()
    run_pair(nil, 6, true)
  end)

  it("skips the update when skip is not 0 (NaN too) and scales with grad_scale", function()
    local p = moe.tensor({ 1, 2, 3 }, { dtype = "f32" })
    local q = moe.tensor({ 1, 2, 3 }, { dtype = "f32" })
    local opt = optim.AdamW({ { "p", p } }, { lr = 0.1 })
    for _, flag in ipairs({ 1, 0 / 0, -2 }) do
      p.grad = moe.tensor({ 1, 1, 1 }, { dtype = "f32" })
      opt:step({ skip = moe.full({}, flag, { dtype = "f32" }) })
      assert.is_true(same_bits(p, q))
      assert.are.same({ 0, 0, 0 }, flat(opt.params[1].exp_avg))
    end
    p.grad = moe.tensor({ 1, 1, 1 }, { dtype = "f32" })
    opt:step({ skip = moe.zeros({}, { dtype = "f32" }), grad_scale = moe.full({}, 0.5, { dtype = "f32" }) })
    assert.is_true(math.abs(flat(opt.params[1].exp_avg)[1] - 0.05) < 1e-7) -- (1 - 0.9) * 0.5
    assert.has_error(function() opt:step({ grad_scale = 2 }) end,
      "AdamW:step: option grad_scale must be a tensor, got number")
    assert.has_error(function() opt:step({ scale = 2 }) end)
  end)

  it("reports bad lists naming the argument and the entry", function()
    local p, g = moe.zeros({ 3 }), moe.zeros({ 3 })
    local m, v = moe.zeros({ 3 }), moe.zeros({ 3 })
    local ok, err = pcall(moe.ops.adamw_step_multi, { p }, { moe.zeros({ 4 }) }, { m }, { v }, nil, 0, { step = 1 })
    assert.is_false(ok)
    local _
    assert.matches("adamw_step_multi: entry 1: grad has shape %[4%] but param has shape %[3%]", err)
    _, err = pcall(moe.ops.adamw_step_multi, { p }, { g }, { m }, {}, nil, 0, { step = 1 })
    assert.matches("bad argument #4 to 'adamw_step_multi' %(exp_avg_sqs has 0 entries but params has 1%)", err)
    _, err = pcall(moe.ops.adamw_step_multi, { p }, { g }, { m:double() }, { v }, nil, 0, { step = 1 })
    assert.matches("entry 1: exp_avg must be f32 for a f32 param, got f64", err)
    _, err = pcall(moe.ops.adamw_step_multi, { p }, { g }, { m }, { v }, { 1 }, 0, { step = 1 })
    assert.matches("bad argument #5 to 'adamw_step_multi' %(masters%[1%]: tensor expected, got number%)", err)
    _, err = pcall(moe.ops.adamw_step_multi, { p }, { g }, { m }, { v }, nil, { "x" }, { step = 1 })
    assert.matches("weight_decays%[1%]: number expected, got string", err)
    _, err = pcall(moe.ops.adamw_step_multi, { p }, { g }, { m }, { v }, nil, 0, { step = 1, skip = 1 })
    assert.matches("option skip must be a tensor", err)
    _, err = pcall(moe.ops.adamw_step_multi, { p }, { g }, { m }, { v }, nil, 0,
      { step = 1, grad_scale = moe.zeros({ 2 }) })
    assert.matches("grad_scale must have one element, got shape %[2%]", err)
    _, err = pcall(moe.ops.grad_norm_multi, { g, moe.zeros({ 2 }, { dtype = "i32" }) }, 1)
    assert.matches("grad_norm_multi: grad 2: must be f32, f64, bf16 or f16, got i32", err)
    assert.are.same({ 0, 0, 0 }, flat(p))
  end)
end)

describe("optim.grad_norm and lazy clipping", function()
  local function grads()
    local a = moe.zeros({ 2, 2 }, { dtype = "f32" })
    local b = moe.zeros({ 3 }, { dtype = "bf16" })
    a.grad = moe.tensor({ { 3, 0 }, { 0, 0 } }, { dtype = "f32" })
    b.grad = moe.tensor({ 0, 4, 0 }, { dtype = "bf16" })
    return a, b
  end

  it("returns norm, coefficient and non-finite flag as device tensors", function()
    local a, b = grads()
    local n, c, f = optim.grad_norm({ a, b }, 1)
    assert.is_true(moe.is_tensor(n) and moe.is_tensor(c) and moe.is_tensor(f))
    assert.are.equal("f32", n.dtype)
    assert.are.equal(5, n:item())
    assert.is_true(math.abs(c:item() - 1 / (5 + 1e-6)) < 1e-7)
    assert.are.equal(0, f:item())
    assert.are.same({ 3, 0, 0, 0 }, flat(a.grad)) -- untouched
    local _, c1 = optim.grad_norm({ a, b })
    assert.are.equal(1, c1:item())
    b.grad = moe.tensor({ 0, 1 / 0, 0 }, { dtype = "bf16" })
    n, _, f = optim.grad_norm({ a, b }, 1)
    assert.are.equal(1, f:item())
    assert.are.equal(math.huge, n:item())
  end)

  it("clips lazily: the norm as a tensor, the gradients scaled on the device", function()
    local a, b = grads()
    local n = optim.clip_grad_norm({ a, b }, 1, { lazy = true })
    assert.is_true(moe.is_tensor(n))
    assert.are.equal(5, n:item())
    assert.is_true(math.abs(flat(a.grad)[1] - 0.6) < 1e-6)
    assert.is_true(math.abs(flat(b.grad)[2] - 0.8) < 4e-3)
    local a2, b2 = grads()
    assert.are.equal(5, optim.clip_grad_norm({ a2, b2 }, 10, { lazy = true }):item()) -- below max_norm: the same bits
    assert.are.same({ 3, 0, 0, 0 }, flat(a2.grad))
    assert.are.same({ 0, 4, 0 }, flat(b2.grad))
    assert.are.equal(5, optim.clip_grad_norm({ a2, b2 }, math.huge))
    assert.has_error(function() optim.clip_grad_norm({ a }, 1, { lazy = 1 }) end,
      "optim.clip_grad_norm: option lazy must be a boolean, got number")
    assert.has_error(function() optim.grad_norm({ a }, 0) end,
      "optim.grad_norm: max_norm must be a positive number, got 0")
  end)

  it("is deterministic: the same bits from the same gradients", function()
    local ts = {}
    for k = 1, 5 do
      local t = moe.zeros({ 1000 * k + 3 })
      t.grad = moe.randn({ 1000 * k + 3 })
      ts[k] = t
    end
    local n1 = optim.grad_norm(ts):item()
    local n2 = optim.grad_norm(ts):item()
    assert.are.equal(n1, n2)
    local ref = 0
    for _, t in ipairs(ts) do ref = ref + t.grad:double():pow(2):sum():item() end
    assert.is_true(math.abs(n1 - math.sqrt(ref)) < 1e-5 * math.sqrt(ref))
  end)
end)

describe("optim multi-tensor on cuda", function()
  local gpu = moe.cuda.is_available()
  local function gpu_it(name, fn)
    if gpu then it(name, fn) else pending(name .. " (no CUDA GPU)") end
  end

  gpu_it("gives the bits of the per-tensor path on the GPU, with clipping", function()
    run_pair("cuda:0", 10, false)
    run_pair("cuda:0", 6, true)
  end)

  gpu_it("computes the norm with the CPU's bits and clips lazily", function()
    local ts, tc = {}, {}
    for k = 1, 60 do
      local g = moe.randn({ 997 * k + 1 }):to(k % 2 == 0 and "bf16" or "f32")
      tc[k] = moe.zeros({ 997 * k + 1 }):to(g.dtype)
      tc[k].grad = g
      ts[k] = tc[k]:to("cuda:0")
      ts[k].grad = g:to("cuda:0")
    end
    local nc = optim.grad_norm(tc, 1)
    local ng, cg = optim.grad_norm(ts, 1)
    assert.are.equal("cuda:0", ng.device)
    assert.are.equal(nc:item(), ng:item())
    local n = optim.clip_grad_norm(ts, 1, { lazy = true })
    assert.are.equal("cuda:0", n.device)
    assert.is_true(math.abs(optim.grad_norm(ts):item() - 1) < 1e-2)
    assert.is_true(cg:item() < 1)
  end)
end)

describe("optim.scale_", function()
  it("scales every tensor of a list in place, as t * coef in f32, and refuses bad arguments", function()
    local a = moe.randn({ 5, 3 })
    local b = moe.randn({ 7 }, { dtype = "bf16" })
    local wa, wb = (a * 0.25):totable(), (b:float() * 0.25):to("bf16"):float():totable()
    optim.scale_({ a, b }, 0.25)
    assert.are.same(wa, a:totable())
    assert.are.same(wb, b:float():totable())
    optim.scale_({}, 2) -- nothing to scale
    assert.has_error(function() optim.scale_({ a }, "2") end, "optim.scale_: coef must be a number, got string")
    assert.has_error(function() optim.scale_({ a, 3 }, 2) end, "optim.scale_: item 2 is not a tensor")
  end)
end)
