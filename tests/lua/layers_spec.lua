--[[
tests/lua/layers_spec.lua - the expert modules (moe.experts) and MoE layers
(moe.layers) on the CPU in f64: dMoE against a dense per-token reference
(MLP and GLU experts, token- and expert-choice routers, shared expert),
impl grouped == sparse == loop, finite-difference gradients through the
experts and the router weights (moe.gradcheck), memory-optimized and
quantize switches, the capacity MoE dropping what a hand-built routing
predicts, aux loss and stats, option errors, MoA (a value check against
plain attention, shapes, gradients) and a new expert type defined here and
used in a dMoE.

Run: moe-lua tests/lua/busted.lua tests/lua/layers_spec.lua (ctest does).
impl "grouped"/"sparse" cases need moe.ops.parallel_linear (the C
op); without it they are reported pending.
]]
local moe = require "moe"
local nn = require "moe.nn"
local experts = require "moe.experts"
local layers = require "moe.layers"
local routers = require "moe.routers"

-- every build has parallel_linear: a build without it must fail here, not skip tests
local HAVE_PL = assert(moe.ops.parallel_linear ~= nil, "moe.ops.parallel_linear is missing from this build")

local function max_abs_diff(a, b)
  local d = moe.no_grad(function() return moe.max(moe.abs(a:double() - b:double())) end)
  return d:item()
end

local function assert_close(a, b, tol, what)
  assert.are.same(a.shape, b.shape)
  local d = max_abs_diff(a, b)
  assert(d <= tol, string.format("%s: max |a - b| = %g > %g", what or "values", d, tol))
end

local function f64(t) return moe.tensor(t, { dtype = "f64" }) end
local function i64(t) return moe.tensor(t, { dtype = "i64" }) end

-- A router that returns a fixed routing (ids, gates tables), for layers
-- checked against hand-computed results.
local FixedRouter = nn.class("FixedRouter", nn.Module)
function FixedRouter:init(ids, gates)
  self.ids, self.gates_t = ids, gates
end
function FixedRouter:forward(_)
  return { kind = "token", ids = i64(self.ids), gates = f64(self.gates_t) }
end

-- The dense per-token reference of a routed expert MLP: y_t = sum_j
-- gates[t][j] * expert_{ids[t][j]}(x_t); keep(t, j) false drops a slot.
local function expert_mlp(ex, e, xt)
  local h = moe.matmul(xt, ex.w1:select(0, e))
  local a
  if ex.w3 then a = ex.act(h) * moe.matmul(xt, ex.w3:select(0, e)) else a = ex.act(h) end
  return moe.matmul(a, ex.w2:select(0, e))
end

local function reference(ex, x, ids, gates, keep)
  local rows = {}
  for t = 0, x:size(0) - 1 do
    local xt = x:narrow(0, t, 1)
    local acc = moe.zeros({ 1, x:size(1) }, { dtype = x.dtype })
    for j = 0, #ids[t + 1] - 1 do
      if not keep or keep(t, j) then
        acc = acc + expert_mlp(ex, ids[t + 1][j + 1], xt) * gates[t + 1][j + 1]
      end
    end
    rows[#rows + 1] = acc
  end
  return moe.cat(rows, 0)
end

-- The router's routing of x as Lua tables (eval mode: no jitter).
local function routing_of(router, x)
  local r = router(x)
  return r.ids:totable(), r.gates:totable()
end

local T, D, F, E, K = 7, 6, 8, 4, 2

local function dmoe(opts)
  local o = { hidden_size = D, ffn_hidden_size = F, num_experts = E, top_k = K, dtype = "f64", init_std = 0.5,
    mlp_impl = "loop", activation_fn = "gelu" }
  for k, v in pairs(opts or {}) do o[k] = v end
  return layers.dMoE(o)
end

describe("layers.dMoE", function()
  it("mlp_impl auto: sparse on CUDA with more than 16 experts, grouped otherwise", function()
    local function make(n, impl)
      return layers.dMoE { hidden_size = 8, ffn_hidden_size = 128, num_experts = n, top_k = 1, mlp_impl = impl }
    end
    local big = make(32, nil)
    assert.are.equal("auto", big.mlp_impl_option)
    assert.are.equal("grouped", big:resolve_impl("cpu"))
    assert.are.equal("grouped", big.experts.impl)
    assert.are.equal("sparse", big:resolve_impl("cuda:0"))
    assert.are.equal("sparse", big.experts.impl)
    assert.are.same(128, big:plan_opts(nil).block_size)
    assert.are.equal("grouped", big:resolve_impl("cpu"))
    assert.is_nil(big:plan_opts(nil).block_size)
    assert.are.equal("grouped", make(16, "auto"):resolve_impl("cuda:0"))
    assert.are.equal("grouped", make(32, "grouped"):resolve_impl("cuda:0"))
    assert.are.equal("loop", make(32, "loop"):resolve_impl("cuda:0"))
    -- ffn_hidden_size not a multiple of the block: grouped even on CUDA
    local odd = layers.dMoE { hidden_size = 8, ffn_hidden_size = 100, num_experts = 32, top_k = 1 }
    assert.are.equal("grouped", odd:resolve_impl("cuda:0"))
    assert.has_error(function() make(4, "fast") end)
  end)

  it("mlp_impl auto's rule keeps the grouped path where our own grouped GEMM runs it", function()
    local autotune = require "moe.experts.autotune"
    assert.are.equal("sparse", autotune.rule(true, 32, 128, 128, false))
    assert.are.equal("sparse", autotune.rule(true, 32, 128, 128))
    assert.are.equal("grouped", autotune.rule(true, 32, 128, 128, true))
    assert.are.equal("grouped", autotune.rule(false, 32, 128, 128, false))
    assert.are.equal("grouped", autotune.rule(true, 16, 128, 128, false))
    assert.are.equal("grouped", autotune.rule(true, 32, 100, 128, false))
  end)

  it("matches a dense per-token reference (MLP and GLU experts)", function()
    moe.manual_seed(1)
    for _, mlp_type in ipairs({ "mlp", "glu" }) do
      local m = dmoe({ mlp_type = mlp_type })
      m:eval()
      local x = moe.randn({ T, D }, { dtype = "f64" })
      local ids, gates = routing_of(m.router, x)
      local y = m(x)
      assert_close(y, reference(m.experts, x, ids, gates), 1e-12, mlp_type)
      -- (B, S, d) input: the same numbers
      local y3 = m(x:reshape({ 1, T, D }))
      assert.are.same({ 1, T, D }, y3.shape)
      assert_close(y3:reshape({ T, D }), y, 0, mlp_type .. " 3-D")
    end
  end)

  it("gives the same result with impl grouped, sparse and loop", function()
    moe.manual_seed(2)
    for _, mlp_type in ipairs({ "mlp", "glu" }) do
      local ref = dmoe({ mlp_type = mlp_type, block_size = 4 })
      ref:eval()
      local x = moe.randn({ T, D }, { dtype = "f64" })
      local y = ref(x)
      for _, impl in ipairs({ "grouped", "sparse" }) do
        local m = dmoe({ mlp_type = mlp_type, mlp_impl = impl, block_size = 4 })
        m:load_state_dict(ref:state_dict())
        m:eval()
        -- f64 throughout: only the order of the sums differs
        assert_close(m(x), y, 1e-12, mlp_type .. " " .. impl)
        if mlp_type == "glu" and moe.ops.glu_experts then assert.are.equal("fused", m.experts.path) end
      end
    end
  end)

  it("has finite-difference gradients through the experts and the router", function()
    moe.manual_seed(3)
    local impls = { "loop" }
    if HAVE_PL then impls = { "loop", "grouped", "sparse" } end
    for _, impl in ipairs(impls) do
      for _, mlp_type in ipairs({ "mlp", "glu" }) do
        local m = dmoe({ mlp_type = mlp_type, mlp_impl = impl, block_size = 4, top_k = 2 })
        m:eval()
        -- a non-contiguous input
        local x = moe.randn({ D, 5 }, { dtype = "f64" }):transpose(0, 1):requires_grad_(true)
        local ins = { x, m.experts.w1, m.experts.w2, m.router.layer.weight }
        if m.experts.w3 then ins[#ins + 1] = m.experts.w3 end
        local ok, msg = moe.gradcheck(function(a) return m(a) end, ins)
        assert(ok, impl .. " " .. mlp_type .. ": " .. tostring(msg))
      end
    end
  end)

  it("memory_optimized_mlp gives the same values and gradients", function()
    moe.manual_seed(4)
    local cases = { { "mlp", "loop" }, { "glu", "loop" } }
    if HAVE_PL then -- the GLU's fused glu_experts(memory_optimized = true)
      cases[#cases + 1] = { "mlp", "grouped" }
      cases[#cases + 1] = { "glu", "grouped" }
    end
    for _, case in ipairs(cases) do
      local mlp_type, impl = case[1], case[2]
      local a = dmoe({ mlp_type = mlp_type, mlp_impl = impl })
      local b = dmoe({ mlp_type = mlp_type, memory_optimized_mlp = true, mlp_impl = impl })
      b:load_state_dict(a:state_dict())
      a:eval(); b:eval()
      local x = moe.randn({ T, D }, { dtype = "f64" })
      local ya, yb = a(x), b(x)
      assert_close(yb, ya, 1e-12, mlp_type .. " " .. impl .. " values")
      moe.sum(ya * ya):backward()
      moe.sum(yb * yb):backward()
      assert_close(b.experts.w1.grad, a.experts.w1.grad, 1e-12, mlp_type .. " dw1")
      assert_close(b.experts.w2.grad, a.experts.w2.grad, 1e-12, mlp_type .. " dw2")
      assert_close(b.router.layer.weight.grad, a.router.layer.weight.grad, 1e-12, mlp_type .. " drouter")
      local xg = x:clone():requires_grad_(true)
      assert(moe.gradcheck(function(t) return b(t) end, { xg, b.experts.w1, b.experts.w2 }))
    end
  end)

  it("sets the aux loss and stats: expert counts summing to T k", function()
    moe.manual_seed(5)
    local m = dmoe({ moe_loss_weight = 0.1, moe_zloss_weight = 0.01 })
    m:train()
    local x = moe.randn({ 3, 5, D }, { dtype = "f64" })
    local y = m(x)
    assert.are.same({ 3, 5, D }, y.shape)
    assert.is_true(moe.is_tensor(m.aux_loss))
    assert.are.equal(0, m.aux_loss:dim())
    assert.is_true(m.aux_loss:item() > 0)
    assert.is_nil(rawget(m.router, "aux_loss")) -- moved to the layer: counted once
    local counts = m.stats.expert_counts:totable()
    local sum = 0
    for _, c in ipairs(counts) do sum = sum + c end
    assert.are.equal(E, #counts)
    assert.are.equal(15 * K, sum)
    local stats = m:collect_stats()
    assert.are.equal(1, #stats)
    local aux = m:pop_aux_loss()
    assert.is_true(aux:item() > 0)
    assert.is_nil(m:pop_aux_loss())
    -- the aux loss has gradients into the router
    m(x)
    m:pop_aux_loss():backward()
    assert.is_true(moe.is_tensor(m.router.layer.weight.grad))
    -- eval: no aux loss
    m:eval()
    m(x)
    assert.is_nil(m:pop_aux_loss())
  end)

  -- The router's load-balancing loss takes its counts from the layer's plan
  -- (no second count), and a forward + backward reads nothing back to the
  -- host but the plan's one counts copy (moe.host_reads counts on the CPU as
  -- on a GPU); the capacity layer's padded plan needs none.
  it("shares one expert count with the router; host reads: the plan's copy only", function()
    local orig = moe.bincount
    local calls = 0
    moe.bincount = function(...) calls = calls + 1; return orig(...) end
    local ok, err = pcall(function()
      for _, case in ipairs({ { "dMoE", "grouped", 1 }, { "dMoE", "sparse", 1 }, { "MoE", "grouped", 1 },
                              { "MoE", "sparse", 0 } }) do
        local cls, impl, want = case[1], case[2], case[3]
        moe.manual_seed(21)
        local m = layers[cls] { hidden_size = D, ffn_hidden_size = 8, num_experts = E, top_k = K, dtype = "f64",
          mlp_impl = impl, block_size = 4, moe_loss_weight = 0.1, moe_zloss_weight = 0.01 }
        m:train()
        local x = moe.randn({ 3, 5, D }, { dtype = "f64" }):requires_grad_(true)
        calls = 0
        local r0 = moe.host_reads()
        local y = m(x)
        local loss = moe.sum(y * y) + m:pop_aux_loss()
        loss:backward()
        local r1 = moe.host_reads()
        local what = cls .. " " .. impl
        assert.are.equal(0, calls, what .. ": the router counted again")
        assert.are.equal(want, r1.copies - r0.copies, what .. ": copies to the host")
        assert.are.equal(want, r1.syncs - r0.syncs, what .. ": host synchronisations")
        assert.is_nil(rawget(m.router, "counts_from"))
        -- the same aux loss as the router alone (which counts by itself)
        local layer_aux = (m(x) and m:pop_aux_loss()):item()
        local alone = m.router(x:reshape({ -1, D }))
        assert.are.equal(1, calls)
        assert.are.same(alone.counts:totable(), m.stats.expert_counts:totable())
        local router_aux = m.router.aux_loss:item()
        m.router.aux_loss = nil
        assert.is_true(math.abs(layer_aux - router_aux) <= 1e-12 * math.abs(router_aux), what)
      end
      -- uniform_expert_assignment routes other ids than the router's: two counts
      local m = dmoe({ mlp_impl = "grouped", uniform_expert_assignment = true })
      calls = 0
      m(moe.randn({ T, D }, { dtype = "f64" }))
      assert.are.equal(1, calls)
      assert.are.same({ 4, 4, 3, 3 }, m.stats.expert_counts:totable()) -- T k = 14 round-robin
      -- the ids are made once per token count, not every step
      local first = m._rr_ids.ids
      m(moe.randn({ T, D }, { dtype = "f64" }))
      assert.are.equal(first, m._rr_ids.ids)
      m(moe.randn({ T + 1, D }, { dtype = "f64" }))
      assert.are.equal(T + 1, m._rr_ids.ids:size(0))
    end)
    moe.bincount = orig
    assert(ok, err)
  end)

  it("takes the count offer back when the router fails", function()
    local Bad = nn.class("FailingRouter", nn.Module)
    function Bad.forward() error("router failed", 0) end
    local m = dmoe({ router = Bad() })
    local ok, err = pcall(m, moe.randn({ T, D }, { dtype = "f64" }))
    assert.is_false(ok)
    assert.are.equal("router failed", err)
    assert.is_nil(rawget(m.router, "counts_from"))
  end)

  it("adds the shared expert (plain or weighted sum)", function()
    moe.manual_seed(6)
    for _, weighted in ipairs({ false, true }) do
      local m = dmoe({ shared_expert = true, shared_expert_hidden_size = 5, shared_expert_weighted_sum = weighted })
      m:eval()
      local x = moe.randn({ T, D }, { dtype = "f64" })
      local ids, gates = routing_of(m.router, x)
      local routed, shared = reference(m.experts, x, ids, gates), m.shared_expert(x)
      local want = weighted and (shared * (1 / (K + 1)) + routed * (K / (K + 1))) or routed + shared
      assert_close(m(x), want, 1e-12, "shared, weighted=" .. tostring(weighted))
      assert.are.same({ 5, D }, m.shared_expert.mlp.fc1.weight.shape)
    end
  end)

  it("routes with an expert-choice router (gather per expert, equal groups, index_add)", function()
    moe.manual_seed(7)
    local router = routers.ExpertChoice { d_model = D, num_experts = E, capacity_factor = 1.5, dtype = "f64" }
    local m = dmoe({ router = router })
    m:eval()
    local x = moe.randn({ T, D }, { dtype = "f64" })
    local r = router(x)
    local tokens, gates = r.tokens:totable(), r.gates:totable()
    local rows = {}
    for t = 0, T - 1 do rows[t + 1] = moe.zeros({ 1, D }, { dtype = "f64" }) end
    for e = 0, E - 1 do
      for c = 1, #tokens[e + 1] do
        local t = tokens[e + 1][c]
        rows[t + 1] = rows[t + 1] + expert_mlp(m.experts, e, x:narrow(0, t, 1)) * gates[e + 1][c]
      end
    end
    assert_close(m(x), moe.cat(rows, 0), 1e-12, "expert choice")
    local C = r.capacity
    assert.are.same({ C, C, C, C }, m.stats.expert_counts:totable())
    local xg = x:clone():requires_grad_(true)
    assert(moe.gradcheck(function(a) return m(a) end, { xg, m.experts.w1, m.experts.w2 }))
  end)

  it("runs the quantize switches through moe.quantize.scope", function()
    moe.manual_seed(8)
    require "moe.quantize"
    -- f32 (the scope quantizes f32, bf16, f16); min_numel = 1: these tiny
    -- tensors are quantized too. An identity quantizer written in Lua gives
    -- exactly the unquantized result; int8 gradients are close but differ.
    local ident = { pack = function(t) return t:clone() end, unpack = function(p) return p end, min_numel = 1 }
    local q8 = { bits = 8, min_numel = 1 }
    local cases = { { "mlp", "loop" }, { "glu", "loop" } }
    if HAVE_PL then -- grouped GLU: the fused C node (a) against the composed path (b, c)
      cases[#cases + 1] = { "mlp", "grouped" }
      cases[#cases + 1] = { "glu", "grouped" }
    end
    for _, case in ipairs(cases) do
      local mlp_type, impl = case[1], case[2]
      local function make(q)
        return dmoe({ mlp_type = mlp_type, dtype = "f32", quantize = q, mlp_impl = impl })
      end
      local a = make(nil)
      local b = make({ inputs = ident, rematerialize = ident, scatter = ident })
      local c = make({ inputs = q8, rematerialize = q8, scatter = q8 })
      b:load_state_dict(a:state_dict())
      c:load_state_dict(a:state_dict())
      for _, m in ipairs({ a, b, c }) do m:eval() end
      local x = moe.randn({ T, D })
      local ya, yb, yc = a(x), b(x), c(x)
      -- fused and composed f32 paths may round differently: 1e-6 relative
      local tol = impl == "loop" and 0 or 1e-6 * moe.max(moe.abs(ya)):item()
      assert_close(yb, ya, tol, mlp_type .. " " .. impl .. " identity quantizer")
      assert_close(yc, c.experts.path == "fused" and ya or yb, 0,
        mlp_type .. " " .. impl .. " forward is not quantized")
      moe.sum(ya * ya):backward()
      moe.sum(yb * yb):backward()
      moe.sum(yc * yc):backward()
      local gtol = impl == "loop" and 0 or 1e-6 * moe.max(moe.abs(a.experts.w1.grad)):item()
      assert_close(b.experts.w1.grad, a.experts.w1.grad, gtol, mlp_type .. " " .. impl .. " dw1 identity")
      -- int8 saved activations: gradients within 5% of the largest, not equal
      local g, gq = a.experts.w1.grad, c.experts.w1.grad
      local rel = max_abs_diff(gq, g) / moe.max(moe.abs(g)):item()
      assert(rel < 0.05 and rel > 0, mlp_type .. " int8 dw1 relative error " .. rel)
      if mlp_type == "glu" then assert.are.equal("composed", b.experts.path) end
    end
  end)

  it("wraps the expert input, the activation and the combine in their quantize scopes", function()
    -- a stand-in moe.quantize.scope that records, per switch, the shapes of
    -- the tensors saved for backward inside it (and saves them unchanged)
    moe.manual_seed(16)
    local saved = {}
    local fake = { scope = function(spec, fn, ...)
      local function pack(t)
        local l = saved[spec.label] or {}
        saved[spec.label] = l
        l[#l + 1] = table.concat(t.shape, "x")
        return t
      end
      return moe.saved_tensor_hooks(pack, function(t) return t end, fn, ...)
    end }
    local old = moe.quantize
    moe.quantize = fake
    local ok, err = pcall(function()
      for _, mo in ipairs({ false, true }) do
        saved = {}
        local m = dmoe({ mlp_type = "glu", memory_optimized_mlp = mo, top_k = 1, quantize = {
          inputs = { label = "inputs" }, rematerialize = { label = "rematerialize" },
          scatter = { label = "scatter" } } })
        local x = moe.randn({ T, D }, { dtype = "f64" })
        moe.sum(m(x)):backward()
        local function has(label, shape)
          for _, sh in ipairs(saved[label] or {}) do
            if sh == shape then return true end
          end
          return false
        end
        -- top_k 1, impl loop: expert rows are (n_e, .) pieces; the full
        -- (T, .) tensors are the permuted input, the pre-activations, the
        -- expert output rows
        assert(has("inputs", T .. "x" .. D) or #saved.inputs > 0, "inputs scope saved nothing")
        assert(has("rematerialize", T .. "x" .. F), "rematerialize: the (T, f) pre-activation, mo=" .. tostring(mo))
        if mo then
          assert.is_nil(saved.scatter) -- recomputed: the combine saves nothing
        else
          assert(has("scatter", T .. "x" .. D), "scatter: the (T, d) expert output rows")
        end
        assert.are.equal("composed", m.experts.path)
      end
    end)
    moe.quantize = old
    assert(ok, err)
  end)

  it("runs in bf16 on the CPU (forward and backward)", function()
    moe.manual_seed(17)
    for _, mlp_type in ipairs({ "mlp", "glu" }) do
      local m = layers.dMoE { hidden_size = 8, ffn_hidden_size = 16, num_experts = 4, top_k = 2, bf16 = true,
        mlp_type = mlp_type, mlp_impl = HAVE_PL and "grouped" or "loop" }
      local ref = layers.dMoE { hidden_size = 8, ffn_hidden_size = 16, num_experts = 4, top_k = 2, dtype = "f32",
        mlp_type = mlp_type, mlp_impl = "loop" }
      ref:load_state_dict(m:state_dict())
      m:eval(); ref:eval()
      local x = moe.randn({ 2, 6, 8 })
      local y = m(x:bfloat16())
      assert.are.equal("bf16", y.dtype)
      assert.are.equal("bf16", m.experts.w1.dtype)
      -- bf16 storage (8 bits of mantissa) of inputs, weights and results:
      -- a few percent of the largest value
      local yr = ref(x)
      local tol = 0.05 * moe.max(moe.abs(yr)):item()
      assert_close(y, yr, tol, mlp_type .. " bf16")
      moe.sum(y:float()):backward()
      assert.are.equal("bf16", m.experts.w2.grad.dtype)
    end
  end)

  it("rejects bad options with clear messages", function()
    local ok, err = pcall(layers.dMoE, { hidden_size = 4, ffn_size = 8 })
    assert.is_false(ok)
    assert.matches("layers.dMoE: unknown option 'ffn_size' %(valid options: activation_fn, bf16, bias", err)
    assert.matches("moe_capacity_factor, moe_expert_model_parallelism", err)
    local cases = {
      { { mlp_type = "swiglu" }, "mlp_type must be \"mlp\" or \"glu\", got swiglu" },
      { { mlp_impl = "dense" }, "mlp_impl must be \"auto\", \"grouped\", \"sparse\" or \"loop\", got dense" },
      { { mlp_impl = "sparse", ffn_hidden_size = 100 },
        "mlp_impl \"sparse\" needs ffn_hidden_size (100) to be a multiple of block_size (128)" },
      { { top_k = 5 }, "top_k = 5 is more than num_experts = 4" },
      { { hidden_size = 0 }, "hidden_size must be a positive integer, got 0" },
      { { num_experts = 4, moe_num_experts = 8 }, "moe_num_experts = 8 and num_experts = 4 disagree" },
      { { weight_parallel_group = 3 }, "weight_parallel_group is set but moe_weight_parallelism is false" },
      { { moe_weight_parallelism = true, weight_parallel_group = 3 },
        "weight_parallel_group must be a moe.dist group, got number" },
      { { expert_parallel_group = 3 }, "expert_parallel_group is set but moe_expert_model_parallelism is false" },
      { { moe_expert_model_parallelism = true, expert_parallel_group = 3 },
        "expert_parallel_group must be a moe.dist group, got number" },
      { { quantize = { inputs = 3 } },
        "quantize.inputs must be off (nil, false, 0, -1), 4, 8 or a quantizer table, got 3" },
      { { quantize = { weights = 8 } }, "unknown quantize key 'weights'" },
      { { quantize_inputs_num_bits = 5 }, "quantize_inputs_num_bits must be -1, 4 or 8, got 5" },
      { { activation_fn = "swish" }, "activation must be a function or one of" },
      { { fp16 = true }, "fp16 is not supported" },
      { { router = 3 }, "router must be an nn.Module" },
    }
    for _, c in ipairs(cases) do
      local o = { hidden_size = 4, ffn_hidden_size = 8, num_experts = 4, top_k = 1 }
      for k, v in pairs(c[1]) do o[k] = v end
      local ok2, err2 = pcall(layers.dMoE, o)
      assert.is_false(ok2)
      assert(err2:find("layers.dMoE: " .. c[2], 1, true) or err2:find(c[2], 1, true),
        "expected '" .. c[2] .. "', got '" .. tostring(err2) .. "'")
    end
    local m = layers.dMoE { hidden_size = 4, ffn_hidden_size = 8, num_experts = 4, mlp_impl = "loop" }
    assert.has_error(function() m(moe.randn({ 3, 5 })) end, "dMoE: x must be (B, S, 4) or (T, 4), got (3, 5)")
    assert.has_error(function() experts.MLP { num_experts = 2, d_model = 4 } end,
      "experts.MLP: d_ff must be a positive integer, got nil")
    assert.has_error(function() experts.GLU { num_experts = 2, d_model = 4, d_ff = 4, impl = "fast" } end,
      "experts.GLU: impl must be \"grouped\", \"sparse\" or \"loop\", got fast")
    assert.has_error(function() m.experts(moe.randn({ 3, 4 })) end,
      "MLPExperts: a routing plan is required (moe.ops.routing_plan)")
  end)

  it("accepts MegaBlocks' option names and returns the bias when asked", function()
    moe.manual_seed(9)
    local m = layers.dMoE {
      hidden_size = D, ffn_hidden_size = F, moe_num_experts = E, moe_top_k = 1, moe_loss_weight = 0.05,
      moe_jitter_eps = 0.01, moe_normalize_expert_weights = 1, moe_lbl_in_fp32 = true, mlp_type = "glu",
      mlp_impl = "loop", bias = true, return_bias = true, num_layers = 2, uniform_expert_assignment = true,
      init_method = function(t) t:fill_(0.5) end, output_layer_init_method = 0.1, remat_act_fn = true,
    }
    assert.are.equal(E, m.num_experts)
    assert.are.equal(1, m.top_k)
    assert.are.same({ 0.5, 0.5 }, { m.experts.w1:select(0, 0):select(0, 0):totable()[1],
      m.experts.w3:select(0, 3):select(0, 5):totable()[3] })
    local y, b = m(moe.randn({ 8, D }))
    assert.are.same({ 8, D }, y.shape)
    assert.are.same({ D }, b.shape)
    -- uniform assignment: 8 tokens round-robin over 4 experts
    assert.are.same({ 2, 2, 2, 2 }, m.stats.expert_counts:totable())
    assert.are.equal(m.router:num_parameters() + m.experts:num_parameters() // E + D, m:num_active_parameters())
  end)
end)

describe("layers.MoE (capacity factor)", function()
  -- T = 4, k = 2, E = 3 (the routing of routing_spec.lua): expert 0 gets
  -- a = 1, 2, 7; expert 1 a = 4; expert 2 a = 0, 3, 5, 6. Capacity 1.0:
  -- C = ceil(8 / 3) = 3, so by position a = 6 (token 3, slot 0) is dropped.
  local IDS = { { 2, 0 }, { 0, 2 }, { 1, 2 }, { 2, 0 } }
  local GATES = { { 0.1, 0.2 }, { 0.3, 0.9 }, { 0.4, 0.5 }, { 0.7, 0.8 } }

  local function capacity_moe(policy, impl)
    return layers.MoE {
      hidden_size = 3, ffn_hidden_size = 4, num_experts = 3, top_k = 2, capacity_factor = 1.0, dtype = "f64",
      mlp_impl = impl or "loop", router = FixedRouter(IDS, GATES), drop_policy = policy, init_std = 0.5,
      activation_fn = "relu", block_size = 2,
    }
  end

  it("drops by position as the plan predicts", function()
    moe.manual_seed(10)
    local m = capacity_moe("position")
    local x = moe.randn({ 4, 3 }, { dtype = "f64" })
    local want = reference(m.experts, x, IDS, GATES, function(t, j) return not (t == 3 and j == 0) end)
    assert_close(m(x), want, 1e-12, "position")
    assert.are.same({ 3, 1, 4 }, m.stats.expert_counts:totable())
    assert.are.same({ 3, 1, 3 }, m.stats.expert_kept:totable())
    -- a capacity factor large enough keeps everything: the dropless result
    local all = layers.MoE {
      hidden_size = 3, ffn_hidden_size = 4, num_experts = 3, top_k = 2, moe_capacity_factor = 2, dtype = "f64",
      mlp_impl = "loop", router = FixedRouter(IDS, GATES), activation_fn = "relu",
    }
    all:load_state_dict(m:state_dict())
    assert_close(all(x), reference(m.experts, x, IDS, GATES), 1e-12, "no drop")
  end)

  it("drops by score: the lowest gate of the full expert", function()
    moe.manual_seed(11)
    local m = capacity_moe("score")
    local x = moe.randn({ 4, 3 }, { dtype = "f64" })
    -- expert 2 holds a = 0 (0.1), 3 (0.9), 5 (0.5), 6 (0.7): a = 0 (token 0, slot 0) loses
    local want = reference(m.experts, x, IDS, GATES, function(t, j) return not (t == 0 and j == 0) end)
    assert_close(m(x), want, 1e-12, "score")
  end)

  it("matches across impls and has gradients", function()
    moe.manual_seed(12)
    local m = capacity_moe("position")
    local x = moe.randn({ 4, 3 }, { dtype = "f64" }):requires_grad_(true)
    assert(moe.gradcheck(function(a) return m(a) end, { x, m.experts.w1, m.experts.w2 }))
    if HAVE_PL then
      for _, impl in ipairs({ "grouped", "sparse" }) do
        local o = capacity_moe("position", impl)
        -- sparse rounds the capacity up to block_size: 1 keeps C = 3
        if impl == "sparse" then o.block_size = 1 end
        o:load_state_dict(m:state_dict())
        assert_close(o(x), m(x), 1e-12, impl)
        assert.are.same({ 3, 1, 3 }, o.stats.expert_kept:totable())
      end
    end
  end)

  it("rejects a bad capacity factor or drop policy", function()
    local base = { hidden_size = 3, ffn_hidden_size = 4, num_experts = 3 }
    local function with(k, v)
      local o = {}
      for a, b in pairs(base) do o[a] = b end
      o[k] = v
      return o
    end
    assert.has_error(function() layers.MoE(with("capacity_factor", 0)) end,
      "layers.MoE: capacity_factor must be a number > 0, got 0")
    assert.has_error(function() layers.MoE(with("drop_policy", "random")) end,
      "layers.MoE: drop_policy must be \"position\" or \"score\", got random")
    local ok, err = pcall(layers.MoE, with("capacity", 2))
    assert.is_false(ok)
    assert.matches("layers.MoE: unknown option 'capacity'", err)
  end)
end)

describe("layers.MoA (attention heads as experts)", function()
  it("with one expert is plain attention with shared keys and values", function()
    moe.manual_seed(13)
    local B, S, d, H = 2, 5, 6, 2
    local m = layers.MoA { d_model = d, n_heads = H, num_experts = 1, top_k = 1, dtype = "f64", impl = "loop",
      std = 0.5 }
    m:eval()
    local x = moe.randn({ B, S, d }, { dtype = "f64" })
    local y = m(x)
    assert.are.same({ B, S, d }, y.shape)
    local Dh = d // H
    local q = moe.matmul(x, m.wq:select(0, 0)):reshape({ B, S, H, Dh }):transpose(1, 2)
    local kv = moe.matmul(x, m.kv.weight:transpose(0, 1)):reshape({ B, S, 2, H, Dh })
    local k, v = kv:select(2, 0):transpose(1, 2), kv:select(2, 1):transpose(1, 2)
    local o = moe.scaled_dot_product_attention(q, k, v, { causal = true }):transpose(1, 2):reshape({ B, S, d })
    assert_close(y, moe.matmul(o, m.wo:select(0, 0)), 1e-12, "MoA E=1")
  end)

  it("has the right shapes, stats and finite-difference gradients", function()
    moe.manual_seed(14)
    local impls = { "loop" }
    if HAVE_PL then impls = { "loop", "grouped" } end
    for _, impl in ipairs(impls) do
      local m = layers.MoA { d_model = 4, n_heads = 2, head_dim = 1, num_experts = 3, top_k = 2, dtype = "f64",
        impl = impl, std = 0.5 }
      local x = moe.randn({ 2, 3, 4 }, { dtype = "f64" }):requires_grad_(true)
      local y = m(x)
      assert.are.same({ 2, 3, 4 }, y.shape)
      assert.is_true(m:pop_aux_loss():item() > 0)
      local sum = 0
      for _, c in ipairs(m.stats.expert_counts:totable()) do sum = sum + c end
      assert.are.equal(2 * 3 * 2, sum)
      assert.are.same({ 3, 4, 2 }, m.wq.shape)
      assert.are.same({ 3, 2, 4 }, m.wo.shape)
      m:eval()
      local ok, msg = moe.gradcheck(function(a) return m(a) end,
        { x, m.wq, m.wo, m.kv.weight, m.router.layer.weight })
      assert(ok, impl .. ": " .. tostring(msg))
    end
  end)

  it("rejects bad options", function()
    assert.has_error(function() layers.MoA { d_model = 5, n_heads = 2, num_experts = 2 } end,
      "layers.MoA: d_model (5) is not a multiple of n_heads (2): give head_dim")
    assert.has_error(function() layers.MoA { d_model = 4, n_heads = 2, num_experts = 2, impl = "sparse" } end,
      "layers.MoA: impl must be \"grouped\" or \"loop\", got sparse")
    local m = layers.MoA { d_model = 4, n_heads = 2, num_experts = 2 }
    assert.has_error(function() m(moe.randn({ 3, 4 })) end, "MoA: x must be (B, S, 4), got (3, 4)")
  end)
end)

describe("a new expert type defined in a script", function()
  -- Bilinear experts: y = (x A_e) * (x B_e), no activation, one matmul pair
  -- per expert over the routed rows (the per-expert loop over narrow()ed
  -- rows of the permuted tokens), combined with the gates.
  local Bilinear = nn.class("BilinearExperts", nn.Module)
  function Bilinear:init(E_, d)
    self.num_experts = E_
    self:param("a", moe.randn({ E_, d, d }, { dtype = "f64" }) * 0.5)
    self:param("b", moe.randn({ E_, d, d }, { dtype = "f64" }) * 0.5)
  end
  function Bilinear:forward(x, plan, gates)
    local xs = moe.ops.permute(x, plan)
    local ro = plan.row_offsets:totable()
    local parts = {}
    for e = 0, self.num_experts - 1 do
      local n = ro[e + 2] - ro[e + 1]
      if n > 0 then
        local xe = xs:narrow(0, ro[e + 1], n)
        parts[#parts + 1] = moe.matmul(xe, self.a:select(0, e)) * moe.matmul(xe, self.b:select(0, e))
      end
    end
    return moe.ops.combine(moe.cat(parts, 0), plan, gates)
  end

  it("plugs into a dMoE and trains its weights", function()
    moe.manual_seed(15)
    local ex = Bilinear(3, 4)
    local m = layers.dMoE { hidden_size = 4, ffn_hidden_size = 4, num_experts = 3, top_k = 2, experts = ex,
      dtype = "f64" }
    m:eval()
    local x = moe.randn({ 5, 4 }, { dtype = "f64" })
    local ids, gates = routing_of(m.router, x)
    local rows = {}
    for t = 0, 4 do
      local xt = x:narrow(0, t, 1)
      local acc = moe.zeros({ 1, 4 }, { dtype = "f64" })
      for j = 1, 2 do
        local e = ids[t + 1][j]
        acc = acc + moe.matmul(xt, ex.a:select(0, e)) * moe.matmul(xt, ex.b:select(0, e)) * gates[t + 1][j]
      end
      rows[#rows + 1] = acc
    end
    assert_close(m(x), moe.cat(rows, 0), 1e-12, "bilinear experts")
    local names = {}
    for _, nt in ipairs(m:named_parameters()) do names[#names + 1] = nt[1] end
    assert.are.same({ "router.layer.weight", "experts.a", "experts.b" }, names)
    local xg = x:clone():requires_grad_(true)
    assert(moe.gradcheck(function(t) return m(t) end, { xg, ex.a, ex.b, m.router.layer.weight }))
  end)
end)

describe("on the GPU (same weights and routing as on the CPU)", function()
  local gpu = moe.cuda.is_available()
  it("dMoE, MoE and MoA forward and gradients match the CPU", function()
    if not gpu then
      pending("no CUDA GPU")
      return
    end
    moe.manual_seed(18)
    local cases = {
      { layers.dMoE, { mlp_type = "glu", mlp_impl = "grouped" } },
      { layers.dMoE, { mlp_type = "mlp", mlp_impl = "sparse", block_size = 128, ffn_hidden_size = 256 } },
      { layers.dMoE, { mlp_type = "glu", mlp_impl = "grouped", memory_optimized_mlp = true, shared_expert = true } },
      { layers.MoE, { mlp_type = "mlp", mlp_impl = "grouped", capacity_factor = 1.0 } },
    }
    for i, c in ipairs(cases) do
      local o = { hidden_size = 64, ffn_hidden_size = 96, num_experts = 8, top_k = 2, init_std = 0.1 }
      for k, v in pairs(c[2]) do o[k] = v end
      local cpu = c[1](o)
      local dev = c[1](o)
      dev:load_state_dict(cpu:state_dict())
      dev:to("cuda")
      cpu:eval(); dev:eval()
      local x = moe.randn({ 3, 67, 64 }) -- T = 201: not a multiple of any tile
      local yc, yd = cpu(x), dev(x:to("cuda"))
      -- f32 with fp32 accumulation, other summation orders: 1e-4 of the scale
      local scale = moe.max(moe.abs(yc)):item()
      assert_close(yd:to("cpu"), yc, 1e-4 * scale, "case " .. i .. " forward")
      moe.sum(yc * yc):backward()
      moe.sum(yd * yd):backward()
      for _, nt in ipairs(cpu:named_parameters()) do
        local gd = dev:state_dict()[nt[1]].grad
        local g = nt[2].grad
        if g then
          local gs = math.max(moe.max(moe.abs(g)):item(), 1e-30)
          assert_close(gd:to("cpu"), g, 1e-3 * gs, "case " .. i .. " grad " .. nt[1])
        end
      end
    end
    -- CUDA attention is bf16 with head dim 64 or 128: MoA in bf16 on the
    -- GPU against f32 on the CPU, within bf16's rounding (8-bit mantissa
    -- on inputs, weights, q, k, v and outputs): 3% of the scale
    local mo = { d_model = 128, n_heads = 2, num_experts = 4, top_k = 2, std = 0.1 }
    -- both sides start from the same bf16 values of x and the weights, so
    -- that the f32 router picks the same experts
    local moa, moa_d = layers.MoA(mo), layers.MoA(mo)
    moa_d:to("cuda", "bf16")
    moa:load_state_dict(moa_d:state_dict())
    moa:eval(); moa_d:eval()
    local xb = moe.randn({ 2, 37, 128 }):bfloat16()
    local yc = moa(xb:float())
    local yd = moa_d(xb:to("cuda"))
    assert_close(yd:to({ device = "cpu", dtype = "f32" }), yc, 0.03 * moe.max(moe.abs(yc)):item(), "MoA bf16")
  end)
end)
