--[[
tests/lua/toy_data.lua - a deterministic data source for the training-loop
specs (train_memory_spec, train_reads_spec): batches of S tokens over a
vocabulary of V, each a fixed function of the position, with state() and
set_state() as moe.train expects of train_data.

  local toy = dofile(spec_dir .. "/toy_data.lua")
  local d = toy.data(seed)     -- toy.V, toy.S: the vocabulary and sequence length
]]
local moe = require "moe"

local M = { V = 32, S = 8 }

function M.data(seed)
  local V, S = M.V, M.S
  local d = { pos = seed }
  function d:batch(B)
    local x, y = {}, {}
    for b = 1, B do
      x[b], y[b] = {}, {}
      for j = 1, S do
        local v = (self.pos * 5 + b * 3 + j * 7) % V
        x[b][j], y[b][j] = v, (v * 3 + 1) % V
      end
    end
    self.pos = self.pos + 1
    return moe.tensor(x, { dtype = "i64" }), moe.tensor(y, { dtype = "i64" })
  end
  function d:state() return { pos = self.pos } end
  function d:set_state(s) self.pos = s.pos end
  return d
end

return M
