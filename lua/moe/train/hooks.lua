--[[
moe/train/hooks.lua - the hooks of the training loop (docs/TRAINING.md):
functions the caller hands to train.run(cfg, {hooks = {...}}), through which
data parallelism, sharding and checkpointing enter without editing the loop.

  hooks = {
    after_backward = function(state) ... end,        -- or a list of functions
    before_step = { reduce_grads, check_finite },
  }

Each key names a point of the loop; each value is a function or a list of
functions, called in order with the loop's state table (and, for some, one
more argument). after_step also runs after a step the loop skipped for a
non-finite loss or gradient norm (state.skipped is true: no update was made). An unknown key or a value that is not a function is an error
naming the key.
]]
local M = {}

-- The points of the loop, in the order they first run.
M.names = { "load", "after_backward", "before_step", "after_step", "on_log", "on_eval", "save" }

local known = {}
for _, n in ipairs(M.names) do known[n] = true end

--- check(hooks) -> name -> array of functions (every name present; empty when not given).
function M.check(hooks)
  local out = {}
  for _, n in ipairs(M.names) do out[n] = {} end
  if hooks == nil then return out end
  if type(hooks) ~= "table" then
    error(("train: hooks must be a table of name = function, got a %s"):format(type(hooks)), 0)
  end
  local names = {}
  for k in pairs(hooks) do names[#names + 1] = k end
  table.sort(names, function(a, b) return tostring(a) < tostring(b) end)
  for _, k in ipairs(names) do
    if not known[k] then
      error(("train: unknown hook '%s' (valid hooks: %s)"):format(tostring(k), table.concat(M.names, ", ")), 0)
    end
    local v = hooks[k]
    if type(v) == "function" then
      out[k] = { v }
    elseif type(v) == "table" and getmetatable(v) == nil then
      for i = 1, #v do
        if type(v[i]) ~= "function" then
          error(("train: hook '%s'[%d] must be a function, got a %s"):format(k, i, type(v[i])), 0)
        end
        out[k][i] = v[i]
      end
    else
      error(("train: hook '%s' must be a function or a list of functions, got a %s"):format(k, type(v)), 0)
    end
  end
  return out
end

--- call(list, state, ...) -> the first non-nil value a function of list returned (all run).
function M.call(list, state, ...)
  local first
  for i = 1, #list do
    local r = list[i](state, ...)
    if first == nil then first = r end
  end
  return first
end

return M
