--[[
tests/lua/knobs_spec.lua - the kernels' tuning knobs from Lua (moe.knobs,
moe.knob, moe.set_knob) and what train's deterministic = true sets with them
for the length of a run.
]]
local moe = require "moe"

describe("moe.knobs / moe.knob / moe.set_knob", function()
  it("lists every knob with its value, default and doc", function()
    local list = moe.knobs()
    assert.truthy(#list >= 10)
    local seen = {}
    for _, k in ipairs(list) do
      assert.are.equal("string", type(k.name))
      assert.are.equal("string", type(k.value))
      assert.are.equal("string", type(k.default))
      assert.truthy(#k.doc > 10, k.name)
      assert.are.equal(k.value, moe.knob(k.name))
      assert.are.equal(k.value, moe.knob(k.field))
      seen[k.name] = k
    end
    assert.are.equal("1", seen.MOE_GEMM_TUNE.default)
    assert.are.equal("head", seen.MOE_ATTN_ORDER.default)
    assert.are.equal("gemm_tune", seen.MOE_GEMM_TUNE.field)
    assert.truthy(seen.grouped_backend) -- a knob without a variable goes by its field
  end)

  it("sets from a string, an integer or a boolean and returns what was there", function()
    local was = moe.knob("MOE_GEMM_TUNE")
    assert.are.equal(was, moe.set_knob("MOE_GEMM_TUNE", "all"))
    assert.are.equal("all", moe.knob("MOE_GEMM_TUNE"))
    assert.are.equal("all", moe.set_knob("MOE_GEMM_TUNE", 0))
    assert.are.equal("0", moe.knob("gemm_tune"))
    moe.set_knob("MOE_GEMM_TUNE", was)
    assert.are.equal("0", moe.set_knob("MOE_ATTN_DETERMINISTIC", true))
    assert.are.equal("1", moe.set_knob("MOE_ATTN_DETERMINISTIC", false))
    assert.are.equal("0", moe.set_knob("MOE_ATTN_DETERMINISTIC", nil))
    -- a default outside the range (-1: one block per SM) can be set back
    assert.are.equal("-1", moe.set_knob("MOE_ATTN_PERSISTENT", 4))
    assert.are.equal("4", moe.set_knob("MOE_ATTN_PERSISTENT", "-1"))
    assert.are.equal("-1", moe.knob("MOE_ATTN_PERSISTENT"))
  end)

  it("refuses bad names and values with a message naming them, the knob unchanged", function()
    local cases = {
      { { "MOE_BSMM_TILE", "huge" }, "bad argument #2 to 'set_knob' (knob MOE_BSMM_TILE: value must be one of "
        .. "128,256,256k64,wg, got 'huge')" },
      { { "MOE_BSMM_GROUP", 65 }, "value must be an integer in [1, 64], got '65'" },
      { { "MOE_BSMM_GROUP", "12abc" }, "got '12abc'" },
      { { "MOE_ATTN_WG", "yes" }, "value must be 0 or 1, got 'yes'" },
      { { "MOE_BSMM_GROUP", 1.5 }, "value must be an integer, a string or a boolean, got 1.5" },
      { { "MOE_ATTN_WG", {} }, "value must be a string, an integer or a boolean, got table" },
      { { "MOE_NOPE", 1 }, "bad argument #1 to 'set_knob' (no knob named 'MOE_NOPE' (knobs: MOE_ATTN_WG, " },
      { { 3, 1 }, "knob name (a string) expected, got number" },
    }
    for _, c in ipairs(cases) do
      local before = moe.knob("MOE_BSMM_GROUP") .. moe.knob("MOE_BSMM_TILE") .. moe.knob("MOE_ATTN_WG")
      local ok, err = pcall(moe.set_knob, table.unpack(c[1], 1, 2))
      assert.is_false(ok)
      assert.truthy(tostring(err):find(c[2], 1, true), tostring(err))
      assert.are.equal(before, moe.knob("MOE_BSMM_GROUP") .. moe.knob("MOE_BSMM_TILE") .. moe.knob("MOE_ATTN_WG"))
    end
    assert.has_error(function() moe.knob() end, "bad argument #1 to 'knob' (knob name (a string) expected, got no value)")
    assert.has_error(function() moe.knob("MOE_ATTN_WG", 1) end)
  end)
end)

describe("train.run deterministic = true", function()
  local train = require "moe.train"
  local autotune = require "moe.experts.autotune"
  local spec_dir = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests/lua"
  local toy = dofile(spec_dir .. "/toy_data.lua")
  local root = moe.proc.mkdtemp("knobs")
  local n = 0
  local function cfg(over)
    n = n + 1
    local c = { seq_len = toy.S, batch_size = 2, steps = 2, warmup = 0, eval_every = 0, eval_iters = 0,
      sample_tokens = 0, tensorboard = false, quiet = true, device = "cpu", out_dir = root .. "/run" .. n,
      keep_last = 0, model = { vocab_size = toy.V, d_model = 16, n_layers = 1, n_heads = 2, d_ff = 16,
        moe = { num_experts = 4 } } }
    for k, v in pairs(over or {}) do c[k] = v end
    return c
  end
  local function seen_in_run(over, hooks)
    local got
    hooks = hooks or {}
    hooks.before_step = function()
      got = { attn = moe.knob("MOE_ATTN_DETERMINISTIC"), tune = moe.knob("MOE_GEMM_TUNE"), auto = autotune.mode }
    end
    train.run(cfg(over), { hooks = hooks, train_data = toy.data(1) })
    return got
  end

  it("runs with the deterministic attention backward, no GEMM timing and the rule, and sets them back", function()
    local before = { attn = moe.knob("MOE_ATTN_DETERMINISTIC"), tune = moe.knob("MOE_GEMM_TUNE"),
      auto = autotune.mode }
    assert.are.same({ attn = "1", tune = "0", auto = "rule" }, seen_in_run({ deterministic = true }))
    assert.are.same(before, { attn = moe.knob("MOE_ATTN_DETERMINISTIC"), tune = moe.knob("MOE_GEMM_TUNE"),
      auto = autotune.mode })
    -- without it the run leaves them alone
    assert.are.same(before, seen_in_run({ deterministic = false }))
  end)

  it("sets them back when the run ends by an error", function()
    local before = moe.knob("MOE_GEMM_TUNE") .. moe.knob("MOE_ATTN_DETERMINISTIC") .. autotune.mode
    local ok, err = pcall(seen_in_run, { deterministic = true }, { after_step = function() error("boom", 0) end })
    assert.is_false(ok)
    assert.are.equal("boom", err)
    assert.are.equal(before, moe.knob("MOE_GEMM_TUNE") .. moe.knob("MOE_ATTN_DETERMINISTIC") .. autotune.mode)
  end)
end)
