--[[
bench/grouped_problem.lua - the problem bench/grouped.lua times and
bench/grouped_check.lua checks: the configs, random top-k group sizes, the
bf16 operands of the GLU expert MLP's six GEMMs and those GEMMs as
functions. Loaded with dofile by both.
]]
local moe = require "moe"
local M = {}

M.CONFIGS = {
  { name = "mixtral", d = 4096, f = 14336, E = 8, k = 2 },
  { name = "olmoe", d = 2048, f = 1024, E = 64, k = 8 },
  { name = "qwen3", d = 2048, f = 768, E = 128, k = 8 },
}
M.T = 16384
M.OPS = { "fwd_13", "fwd_2", "dgrad_2", "wgrad_2", "dgrad_13", "wgrad_13" }

-- Group sizes of random top-k routing: each of T tokens picks k distinct experts.
function M.route(E, k, tokens, seed)
  math.randomseed(seed)
  local counts = {}
  for e = 1, E do counts[e] = 0 end
  local pick = {}
  for _ = 1, tokens do
    for j = 1, k do
      local e
      repeat
        e = math.random(E)
        local dup = false
        for i = 1, j - 1 do dup = dup or pick[i] == e end
      until not dup
      pick[j] = e
      counts[e] = counts[e] + 1
    end
  end
  local offs = { 0 }
  for e = 1, E do offs[e + 1] = offs[e] + counts[e] end
  return offs, counts
end

-- The six GEMMs over operands o (a table of tensors) and offsets offs, as
-- functions returning their result.
function M.ops(o, offs)
  return {
    fwd_13 = function() return moe.ops.grouped_mm(o.x, o.w13, offs) end,
    fwd_2 = function() return moe.ops.grouped_mm(o.h, o.w2, offs) end,
    dgrad_2 = function() return moe.ops.grouped_mm(o.dy, o.w2, offs, { trans_w = true }) end,
    wgrad_2 = function() return moe.ops.grouped_mm_wgrad(o.h, o.dy, offs) end,
    dgrad_13 = function() return moe.ops.grouped_mm(o.dh13, o.w13, offs, { trans_w = true }) end,
    wgrad_13 = function() return moe.ops.grouped_mm_wgrad(o.x, o.dh13, offs) end,
  }
end

-- bf16 operands of a config on `device` for R rows and G groups.
function M.operands(R, G, d, f, device)
  local function randn(shape, scale)
    local t = moe.randn(shape, { dtype = "f32", device = device })
    local s = (t * scale):to("bf16")
    t:free()
    return s
  end
  return {
    x = randn({ R, d }, 1), h = randn({ R, f }, 1), dy = randn({ R, d }, 1),
    dh13 = randn({ R, 2 * f }, 1),
    w13 = randn({ G, d, 2 * f }, 1 / math.sqrt(d)), w2 = randn({ G, f, d }, 1 / math.sqrt(f)),
  }
end

function M.free_all(o) for _, t in pairs(o) do t:free() end end

return M
