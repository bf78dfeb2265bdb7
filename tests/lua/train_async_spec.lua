--[[
tests/lua/train_async_spec.lua - asynchronous checkpoints of one process:
train.run with save_async = true writes the sharded format (one shard,
moe/train/dcp.lua) from a background thread, and a run stopped and resumed
from it continues the loss curve of an uninterrupted run bit for bit. A save
hook keeps the synchronous single-file checkpoint (the hook may write it).
]]
local moe = require "moe"
local train = require "moe.train"
local checkpoint = require "moe.checkpoint"

local spec_dir = debug.getinfo(1, "S").source:match("^@(.*)/") or "."
local K = dofile(spec_dir .. "/../dist/trainkit.lua")
local root, prefix = K.corpus(0)

local function cfg(name, over)
  local c = K.base_cfg({ steps = 8, device = "cpu", loss_weight = 0.01 }, root, prefix, name, "moe", over)
  return c
end

local function ls(dir)
  local p = io.popen("ls -1 '" .. dir .. "'")
  local out = {}
  for l in p:lines() do out[#out + 1] = l end
  p:close()
  return out
end

describe("train.run with save_async in one process", function()
  it("writes sharded checkpoints in the background and resumes bit for bit", function()
    local full = train.run(cfg("full"))
    local first = train.run(cfg("split", { save_every = 2, keep_last = 2, save_async = true, stop_at = 5 }))
    assert.are.equal(5, first.step)
    local dir = root .. "/split"
    -- saves at 2 and 4, the stop's at 5; keep_last 2
    assert.are.same({ 4, 5 }, checkpoint.list(dir))
    assert.are.equal(dir .. "/ckpt-5", first.checkpoint)
    assert.are.same({ "digests.txt", "index.json", "shard-0.json", "shard-0.safetensors", "state.json" },
      ls(dir .. "/ckpt-5"))
    moe.manual_seed(999)
    local second = train.run(cfg("split", { save_every = 2, keep_last = 2, save_async = true, resume = "latest" }))
    assert.are.equal(8, second.step)
    for s = 6, 8 do
      assert.is_number(second.losses[s])
      assert.are.equal(full.losses[s], second.losses[s], "loss at step " .. s)
    end
    assert.is_nil(second.losses[5])
    assert.are.same({ 6, 8 }, checkpoint.list(dir))
  end)

  it("keeps the synchronous single-file checkpoint when a save hook is given", function()
    local seen = 0
    local r = train.run(cfg("hooked", { save_every = 2, save_async = true, steps = 4 }),
      { hooks = { save = function(_, ckpt) seen = seen + 1; assert.is_table(ckpt.model) end } })
    assert.are.equal(2, seen)
    assert.are.same({ "digests.txt", "model.safetensors", "optim.safetensors", "state.json" },
      ls(r.checkpoint))
  end)
end)
