--[[
tests/lua/train_reads_spec.lua - the host reads of moe.train's step
(moe/train/loop.lua): a tiny dMoE nn.TransformerLM trained by train.run on
the CPU, with moe.Tensor.item and totable wrapped to count the reads made
from the loop's own files:

  - without hooks that need numbers inside the step, the loop reads the device
    once per step (the lm and aux losses of every micro-batch and a device
    gradient norm, in one copy) and once per evaluation (its batches' losses),
    and the model's loss reads nothing;
  - the losses, grad norms and metrics.jsonl are the same numbers as with a
    model whose loss returns numbers (the read-per-micro-batch path);
  - a step whose loss is NaN on the device is still skipped and counted;
  - parts.profile sees the phases of each step in order;
  - the bindings' backstop collection is held off during a step and restored.
]]
local moe = require "moe"
local train = require "moe.train"
local metrics = require "moe.metrics"

local spec_dir = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests/lua"
local toy = dofile(spec_dir .. "/toy_data.lua")
local V, S, data = toy.V, toy.S, toy.data

local function cfg(over)
  local out_dir = os.tmpname()
  os.remove(out_dir)
  local c = { model = { vocab_size = V, d_model = 16, n_layers = 2, n_heads = 2, ffn = "moe", d_ff = 32,
      moe = { num_experts = 4, top_k = 2, ffn_hidden_size = 16, mlp_impl = "grouped" } },
    seq_len = S, batch_size = 4, steps = 6, warmup = 0, lr = 1e-2, log_every = 2, eval_every = 0,
    eval_iters = 0, device = "cpu", quiet = true, tensorboard = false, sample_tokens = 0, keep_last = 0,
    grad_accum = 2, clip = 1.0, seed = 7, out_dir = out_dir }
  for k, v in pairs(over or {}) do c[k] = v end
  return c
end

-- Runs fn with moe.Tensor.item/totable counting the calls made from the given
-- source files (matched against the caller's chunk name); returns fn's results
-- and the counts.
local function counting_reads(files, fn)
  local T = moe.Tensor
  local item, totable = T.item, T.totable
  local n = {}
  local function count()
    local src = debug.getinfo(3, "S").source
    for _, f in ipairs(files) do
      if src:find(f, 1, true) then n[f] = (n[f] or 0) + 1 end
    end
  end
  T.item = function(...) count() return item(...) end
  T.totable = function(...) count() return totable(...) end
  local ok, res = pcall(fn)
  T.item, T.totable = item, totable
  assert(ok, res)
  return res, n
end

-- The lazy clip a device-side clip_grad_norm gives: the norm as a device scalar.
local function device_clip(params, max_norm)
  local norm = require("moe.optim").clip_grad_norm(params, max_norm)
  return moe.tensor(norm, { dtype = "f32" })
end

local function records(dir)
  local out = {}
  for _, r in ipairs(metrics.read_jsonl(dir .. "/metrics.jsonl")) do
    out[#out + 1] = { r.step, r.loss, r.aux_loss, r.grad_norm, r.skipped_steps, r.val_loss }
  end
  return out
end

describe("train.run host reads", function()
  it("reads the device once per step and once per evaluation, in the loop, never in model:loss", function()
    local c = cfg({ eval_every = 3, eval_iters = 2 })
    local r, n = counting_reads({ "train/loop.lua", "nn/transformer.lua" }, function()
      return train.run(c, { train_data = data(1), valid_data = data(50), clip_grad_norm = device_clip })
    end)
    assert.are.equal(6, r.step)
    assert.is_number(r.val_losses[3])
    assert.is_number(r.val_losses[6])
    assert.are.equal(6 + 2, n["train/loop.lua"])
    assert.is_nil(n["nn/transformer.lua"])
  end)

  it("gives the same losses and metrics as a model whose loss returns numbers", function()
    local c1, c2 = cfg({ eval_every = 3, eval_iters = 2 }), cfg({ eval_every = 3, eval_iters = 2 })
    local r1 = train.run(c1, { train_data = data(1), valid_data = data(50) })
    moe.manual_seed(c2.seed) -- as train.run seeds before it builds the model
    local model = train.build_model(train.config(c2), "cpu")
    local loss = model.loss
    model.loss = function(self, x, y) return loss(self, x, y) end -- no lazy option: numbers
    local r2 = train.run(c2, { model = model, train_data = data(1), valid_data = data(50) })
    for s = 1, 6 do assert.are.equal(r2.losses[s], r1.losses[s]) end
    assert.is_number(r1.val_losses[3])
    assert.are.same(r2.val_losses, r1.val_losses)
    assert.are.same(records(c2.out_dir), records(c1.out_dir))
    assert.are.equal(3 + 2, #records(c1.out_dir)) -- log steps 2, 4, 6 and evaluations at 3, 6
    -- and with a device gradient norm
    local c3 = cfg({ eval_every = 3, eval_iters = 2 })
    train.run(c3, { train_data = data(1), valid_data = data(50), clip_grad_norm = device_clip })
    assert.are.same(records(c1.out_dir), records(c3.out_dir))
    -- of another dtype than the losses' (read through f64)
    local c4 = cfg({ eval_every = 3, eval_iters = 2 })
    train.run(c4, { train_data = data(1), valid_data = data(50), clip_grad_norm = function(params, max_norm)
      local n = require("moe.optim").clip_grad_norm(params, max_norm)
      return moe.tensor(n, { dtype = "f64" })
    end })
    assert.are.same(records(c1.out_dir), records(c4.out_dir))
  end)

  it("skips a step whose loss is NaN on the device", function()
    local c = cfg({ grad_accum = 1 })
    local model = train.build_model(train.config(c), "cpu")
    local loss, calls = model.loss, 0
    model.loss = function(self, x, y, o)
      calls = calls + 1
      local total, info = loss(self, x, y, o)
      assert.is_true(moe.is_tensor(info.lm_loss))
      if calls == 3 then total, info.lm_loss = total * (0 / 0), info.lm_loss * (0 / 0) end
      return total, info
    end
    local skipped = {}
    local r = train.run(c, { model = model, train_data = data(1), hooks = {
      after_step = function(st) if st.skipped then skipped[#skipped + 1] = st.step end end } })
    assert.are.same({ 3 }, skipped)
    assert.are.equal(1, r.skipped_steps)
    assert.is_true(r.losses[3] ~= r.losses[3])
    assert.is_true(r.losses[4] == r.losses[4])
  end)

  it("shows parts.profile the phases of each step in order", function()
    local c = cfg({ steps = 2 })
    local seen = {}
    train.run(c, { train_data = data(1), profile = function(phase, step)
      seen[#seen + 1] = step .. ":" .. phase
    end })
    local micro = { "data", "forward", "backward", "stats" }
    local want = {}
    for s = 1, 2 do
      for _ = 1, 2 do for _, p in ipairs(micro) do want[#want + 1] = s .. ":" .. p end end
      for _, p in ipairs({ "clip", "read", "optimizer", "log" }) do want[#want + 1] = s .. ":" .. p end
    end
    want[#want + 1] = "2:end"
    assert.are.same(want, seen)
  end)

  it("holds the backstop collection off during a step and restores it", function()
    local before = moe.cuda.set_gc_step()
    local during
    train.run(cfg({ steps = 1 }), { train_data = data(1), hooks = {
      before_step = function() during = moe.cuda.set_gc_step() end } })
    assert.are.equal(0, during)
    assert.are.equal(before, moe.cuda.set_gc_step())
    -- and after an error inside a step
    local ok = pcall(train.run, cfg({ steps = 1 }), { train_data = data(1), hooks = {
      before_step = function() error("boom") end } })
    assert.is_false(ok)
    assert.are.equal(before, moe.cuda.set_gc_step())
  end)
end)
