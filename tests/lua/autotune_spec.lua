--[[
tests/lua/autotune_spec.lua - mlp_impl = "auto" by measurement
(moe/experts/autotune.lua): what is measured, what is cached, that the
measurement leaves the layer's parameters, their gradients and the random
generator as they were, the rule's margin, the modes, and the layer and the
training loop using it. Timings are replaced by given figures where the
choice is checked; one test measures for real on the CPU.
]]
local moe = require "moe"
local experts = require "moe.experts"
local layers = require "moe.layers"
local autotune = require "moe.experts.autotune"

local function glu(o)
  local c = { num_experts = 4, d_model = 16, d_ff = 32, activation = "silu" }
  for k, v in pairs(o or {}) do c[k] = v end
  return experts.GLU(c)
end

local function with_mode(mode, fn)
  local prev = autotune.mode
  autotune.mode = mode
  autotune.clear()
  local ok, err = pcall(fn)
  autotune.mode = prev
  autotune.clear()
  if not ok then error(err, 0) end
end


describe("autotune.pick", function()
  it("times each path that can run the experts and keeps the fastest, once per rounded shape", function()
    with_mode("measure", function()
      local ex = glu()
      local calls = {}
      local function time(impl)
        calls[#calls + 1] = impl
        return impl == "sparse" and 1.0 or 2.0
      end
      local impl, r = autotune.pick(ex, { T = 300, k = 2, block_size = 16, rule = "grouped", time = time })
      assert.are.equal("sparse", impl)
      assert.are.same({ "grouped", "sparse" }, calls)
      assert.are.equal(512, r.T)
      assert.are.same({ grouped = 2.0, sparse = 1.0 }, r.ms)
      -- 400 tokens round to the same 512: the cached pick, nothing timed
      assert.are.equal("sparse", (autotune.pick(ex, { T = 400, k = 2, block_size = 16, rule = "grouped",
        time = function() error("timed again") end })))
      -- 600 tokens are another shape
      autotune.pick(ex, { T = 600, k = 2, block_size = 16, rule = "grouped", time = time })
      assert.are.equal(4, #calls)
      assert.are.equal(2, #autotune.results())
      local lines = autotune.take_new()
      assert.are.equal(2, #lines)
      assert.truthy(lines[1]:find("mlp_impl auto: sparse (grouped 2.000 ms, sparse 1.000 ms; E=4 d=16 d_ff=32 k=2 T=512)",
        1, true), lines[1])
      assert.are.same({}, autotune.take_new())
      assert.are.equal("grouped", ex.impl) -- the experts' own impl is the layer's to set
    end)
  end)

  it("keeps the rule's path unless another is faster by more than the margin", function()
    with_mode("measure", function()
      local ex = glu()
      local function times(g, s) return function(impl) return impl == "grouped" and g or s end end
      assert.are.equal("grouped", (autotune.pick(ex, { T = 256, k = 1, block_size = 16, rule = "grouped",
        time = times(1.0, 0.96) })))
      assert.are.equal("sparse", (autotune.pick(ex, { T = 1024, k = 1, block_size = 16, rule = "grouped",
        time = times(1.0, 0.94) })))
      assert.are.equal("sparse", (autotune.pick(ex, { T = 4096, k = 1, block_size = 16, rule = "sparse",
        time = times(0.97, 1.0) })))
    end)
  end)

  it("offers sparse only when d_ff is a multiple of the block size", function()
    with_mode("measure", function()
      local ex = glu({ d_ff = 24 })
      assert.are.same({ "grouped" }, autotune.candidates(ex, 16))
      assert.are.same({ "grouped", "sparse" }, autotune.candidates(ex, 8))
      local seen = {}
      local impl = autotune.pick(ex, { T = 64, k = 1, block_size = 16, rule = "grouped",
        time = function(i) seen[#seen + 1] = i; return 1 end })
      assert.are.equal("grouped", impl)
      assert.are.same({ "grouped" }, seen)
    end)
  end)

  it("measures for real on the CPU without touching the parameters, their gradients or the generator", function()
    with_mode("measure", function()
      moe.manual_seed(7)
      local ex = glu()
      local before = {}
      for _, nt in ipairs(ex:named_parameters()) do
        before[nt[1]] = { p = nt[2], v = nt[2]:totable() }
        assert.is_nil(nt[2].grad)
      end
      local rng = moe.get_rng_state()
      local impl, r = autotune.pick(ex, { T = 40, k = 2, block_size = 8, rule = "grouped" })
      assert.truthy(impl == "grouped" or impl == "sparse")
      for _, i in ipairs({ "grouped", "sparse" }) do
        assert.truthy(r.ms[i] > 0 and r.ms[i] < 10000, tostring(r.ms[i]))
      end
      assert.are.same(rng, moe.get_rng_state())
      for _, nt in ipairs(ex:named_parameters()) do
        local b = before[nt[1]]
        assert.is_true(rawequal(b.p, nt[2]), nt[1]) -- the same handle is back
        assert.is_nil(nt[2].grad, nt[1])
        assert.are.same(b.v, nt[2]:totable())
        assert.is_true(nt[2].requires_grad)
      end
      assert.are.equal("grouped", ex.impl)
    end)
  end)

  it("does not measure in mode rule, nor on the CPU in mode gpu (the default)", function()
    for _, mode in ipairs({ "rule", "gpu" }) do
      with_mode(mode, function()
        local impl, r = autotune.pick(glu(), { T = 64, k = 1, block_size = 16, rule = "grouped",
          time = function() error("measured in mode " .. mode) end })
        assert.are.equal("grouped", impl)
        assert.is_nil(r)
        assert.are.same({}, autotune.results())
      end)
    end
  end)

  it("a path whose measurement fails is left out; when every one fails, the error is raised", function()
    with_mode("measure", function()
      local ex = glu()
      local w1 = ex.w1
      local impl, r = autotune.pick(ex, { T = 64, k = 1, block_size = 16, rule = "sparse",
        time = function(i) if i == "sparse" then error("out of memory", 0) end return 1 end })
      assert.are.equal("grouped", impl)
      assert.truthy(r.errors.sparse:find("out of memory", 1, true))
      assert.truthy(autotune.take_new()[1]:find("sparse failed: out of memory", 1, true))
      local ok, err = pcall(autotune.pick, ex, { T = 4096, k = 1, block_size = 16, rule = "grouped",
        time = function(i) error(i .. ": out of memory", 0) end })
      assert.is_false(ok)
      assert.are.equal("grouped: out of memory", err)
      assert.is_true(rawequal(w1, ex.w1))
      assert.are.equal("grouped", ex.impl)
      assert.are.equal(1, #autotune.results())
    end)
  end)
end)

describe("dMoE mlp_impl = auto", function()
  it("runs the measured path and gives the fixed path's output", function()
    with_mode("measure", function()
      moe.manual_seed(3)
      local o = { hidden_size = 16, ffn_hidden_size = 32, moe_num_experts = 4, moe_top_k = 2, mlp_type = "glu",
        activation_fn = "silu", block_size = 8 }
      local auto = layers.dMoE(o)
      local fixed = {}
      for _, impl in ipairs({ "grouped", "sparse" }) do
        local c = {}
        for k, v in pairs(o) do c[k] = v end
        c.mlp_impl = impl
        fixed[impl] = layers.dMoE(c)
        fixed[impl]:load_state_dict(auto:state_dict())
      end
      local x = moe.randn({ 2, 20, 16 })
      local y = auto(x)
      assert.truthy(auto.mlp_impl == "grouped" or auto.mlp_impl == "sparse")
      assert.are.equal(auto.mlp_impl, auto.experts.impl)
      assert.are.equal(1, #autotune.results())
      local want = fixed[auto.mlp_impl](x)
      local diff = moe.no_grad(function() return moe.max(moe.abs(y:double() - want:double())):item() end)
      assert.truthy(diff < 1e-5, tostring(diff))
      auto(x) -- the same shape: no second measurement
      assert.are.equal(1, #autotune.results())
    end)
  end)
end)

describe("train.run with mlp_impl = auto", function()
  local train = require "moe.train"
  local spec_dir = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests/lua"
  local toy = dofile(spec_dir .. "/toy_data.lua")
  local root = moe.proc.mkdtemp("autotune")
  local function run(out_dir, over)
    local c = { seq_len = toy.S, batch_size = 2, steps = 2, warmup = 0, eval_every = 0, eval_iters = 0,
      sample_tokens = 0, tensorboard = false, quiet = true, device = "cpu", out_dir = out_dir, keep_last = 0,
      model = { vocab_size = toy.V, d_model = 16, n_layers = 2, n_heads = 2, d_ff = 16,
        moe = { num_experts = 4, ffn_hidden_size = 16 } } }
    for k, v in pairs(over or {}) do c[k] = v end
    return train.run(c, { train_data = toy.data(1) })
  end

  it("measures once for layers of one shape, and not at all with deterministic = true", function()
    with_mode("measure", function()
      run(root .. "/a")
      assert.are.equal(1, #autotune.results())
      assert.are.equal("measure", autotune.mode)
      autotune.clear()
      run(root .. "/b", { deterministic = true })
      assert.are.equal(0, #autotune.results())
      assert.are.equal("measure", autotune.mode) -- the run's setting ends with it
    end)
  end)
end)

describe("MOE_MLP_AUTO", function()
  it("a value other than measure, rule or gpu is an error naming it", function()
    local exe = (os.getenv("MOE_BUILD_DIR") or "build") .. "/moe-lua"
    local p = assert(io.popen(("MOE_MLP_AUTO=fast %s -e 'require \"moe.experts.autotune\"' 2>&1; echo rc=$?"):format(exe)))
    local out = p:read("a")
    p:close()
    assert.truthy(out:find("MOE_MLP_AUTO must be measure, rule or gpu, got 'fast'", 1, true), out)
    assert.falsy(out:find("rc=0", 1, true), out)
    p = assert(io.popen(("MOE_MLP_AUTO=rule %s -e 'print(require(\"moe.experts.autotune\").mode)' 2>&1"):format(exe)))
    out = p:read("a")
    p:close()
    assert.are.equal("rule\n", out)
  end)
end)
