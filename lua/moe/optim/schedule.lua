--[[
moe/optim/schedule.lua - learning-rate schedules (optim.schedule).

  local sched = optim.schedule{lr=3e-4, min_lr=3e-5, warmup=100, total=2000, decay="cosine"}
  opt.lr = sched(step)   -- step is 0-based

Warmup: lr * (step + 1) / warmup for step < warmup (linear, never 0 at the
first step). Then over steps warmup .. total, progress p = (step - warmup) /
(total - warmup) clamped to [0, 1]:
  cosine:   min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2
  linear:   lr - (lr - min_lr) * p
  constant: lr
After total, cosine and linear stay at min_lr.
]]
local function fail(msg, ...) error(("optim.schedule: " .. msg):format(...), 3) end

local known = { lr = true, min_lr = true, warmup = true, total = true, decay = true }

return function(opts)
  if type(opts) ~= "table" then fail("options table expected, got %s", type(opts)) end
  for k in pairs(opts) do
    if not known[k] then fail("unknown option '%s' (valid: decay, lr, min_lr, total, warmup)", tostring(k)) end
  end
  local lr, min_lr = opts.lr, opts.min_lr or 0
  local warmup, total, decay = opts.warmup or 0, opts.total, opts.decay or "cosine"
  if type(lr) ~= "number" or lr < 0 then fail("lr must be a number >= 0, got %s", tostring(lr)) end
  if type(min_lr) ~= "number" or min_lr < 0 or min_lr > lr then
    fail("min_lr must be a number in [0, lr], got %s", tostring(min_lr))
  end
  if math.type(warmup) ~= "integer" or warmup < 0 then
    fail("warmup must be an integer >= 0, got %s", tostring(warmup))
  end
  if decay ~= "cosine" and decay ~= "linear" and decay ~= "constant" then
    fail("decay must be \"cosine\", \"linear\" or \"constant\", got %s", tostring(decay))
  end
  if decay ~= "constant" and (math.type(total) ~= "integer" or total < warmup) then
    fail("total must be an integer >= warmup (%d) for %s decay, got %s", warmup, decay, tostring(total))
  end
  return function(step)
    if math.type(step) ~= "integer" or step < 0 then
      error(("schedule: step must be an integer >= 0, got %s"):format(tostring(step)), 2)
    end
    if step < warmup then return lr * (step + 1) / warmup end
    if decay == "constant" then return lr end
    local span = total - warmup
    local p = span > 0 and (step - warmup) / span or 1
    if p > 1 then p = 1 end
    if decay == "cosine" then return min_lr + (lr - min_lr) * (1 + math.cos(math.pi * p)) / 2 end
    return lr - (lr - min_lr) * p
  end
end
