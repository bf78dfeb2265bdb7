--[[
tests/lua/train_memory_spec.lua - memory stays flat through moe.train: a tiny
dMoE and a tiny dense nn.TransformerLM trained for 30 steps by train.run, with
Lua's collector stopped for the whole run, must end every step (read by an
on_log hook, after the step's moe.scope has ended) with the same CPU bytes
allocated, the same number of live storages and the same number of live
handles as after step 3: each step's tensors are freed by the scopes (the
step's, and each module call's), not by the collector. The first steps may
grow (rope tables, the causal mask, routing group ids are built once and
kept). The evaluation batches (every 10 steps) and their scopes run too.

The memory-flatness test of the tensor layer is tests/lua/memory_flat_spec.lua.
]]
local moe = require "moe"
local train = require "moe.train"

local spec_dir = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests/lua"
local toy = dofile(spec_dir .. "/toy_data.lua")
local V, S, data = toy.V, toy.S, toy.data

local function run(ffn)
  local out_dir = os.tmpname()
  os.remove(out_dir)
  local marks = {}
  local cfg = { model = { vocab_size = V, d_model = 16, n_layers = 2, n_heads = 2, ffn = ffn, d_ff = 32,
      moe = { num_experts = 4, top_k = 2, ffn_hidden_size = 16, mlp_impl = "grouped" } },
    seq_len = S, batch_size = 4, steps = 30, warmup = 0, lr = 1e-2, log_every = 1, eval_every = 10,
    eval_iters = 2, device = "cpu", quiet = true, tensorboard = false, sample_tokens = 0, keep_last = 0,
    out_dir = out_dir }
  collectgarbage("collect")
  collectgarbage("stop")
  local ok, err = pcall(train.run, cfg, { train_data = data(1), valid_data = data(50), hooks = {
    on_log = function(state)
      local m = moe.memory_stats("cpu")
      marks[state.step] = { allocated = m.allocated, storages = m.live_storages, handles = moe.live_handles() }
    end,
  } })
  collectgarbage("restart")
  assert(ok, err)
  return marks
end

describe("train.run memory", function()
  for _, ffn in ipairs({ "moe", "dense" }) do
    it("stays flat for a " .. ffn .. " TransformerLM with the collector stopped", function()
      local marks = run(ffn)
      local ref = marks[3]
      assert.is_true(ref.allocated > 0)
      for step = 4, 30 do
        assert.are.same(ref, marks[step], "step " .. step)
      end
    end)
  end
end)
