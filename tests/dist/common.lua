--[[
tests/dist/common.lua - what the multi-rank scripts of tests/dist/ share:
deterministic per-rank data, so that every rank can compute what each
collective must give (a single-process reference), and assertions that
name the rank. A failed assertion raises: moe-lua exits 1 and mpirun fails
the test.

  local T = dofile(arg[0]:match("^(.*/)") .. "common.lua")

MOE_DIST_DEVICE=cuda makes T.make's tensors GPU tensors (functional.lua
runs that way on the 2-GPU machine: bench/dist_round.sh tests).
]]
local moe = require "moe"

local T = { moe = moe, dist = moe.dist }
T.rank, T.size = T.dist.rank(), T.dist.world_size()
-- MOE_DIST_DEVICE=cuda: T.make puts tensors on this rank's GPU (collectives through NCCL)
T.device = os.getenv("MOE_DIST_DEVICE") == "cuda" and T.dist.device() or "cpu"

function T.fail(fmt, ...)
  error(string.format("[rank %d] " .. fmt, T.rank, ...), 2)
end

function T.check(cond, fmt, ...)
  if not cond then error(string.format("[rank %d] " .. fmt, T.rank, ...), 2) end
end

-- Small integers, exact in every float dtype and in sums of 4 of them.
function T.val(r, i) return ((r * 7 + i * 3) % 11) - 5 end

-- The row-major values of a tensor as one flat list.
function T.flat(t)
  local out = {}
  local function walk(v)
    if type(v) == "table" then for _, x in ipairs(v) do walk(x) end
    else out[#out + 1] = (v == true and 1) or (v == false and 0) or v end
  end
  walk(t:totable())
  return out
end

-- t holds want (a flat list) within tol.
function T.same(t, want, tol, what)
  local got = T.flat(t)
  if #got ~= #want then
    error(string.format("[rank %d] %s: %d values, wanted %d", T.rank, what, #got, #want), 2)
  end
  for i = 1, #want do
    if math.abs(got[i] - want[i]) > (tol or 0) then
      error(string.format("[rank %d] %s: value %d is %s, wanted %s", T.rank, what, i,
        tostring(got[i]), tostring(want[i])), 2)
    end
  end
end

-- fn() must raise an error whose message contains every plain string of parts.
-- With GPU tensors the debug checks add " on a GPU" after each call they
-- describe: those words are taken out before matching.
function T.raises(fn, parts, what)
  local ok, err = pcall(fn)
  if ok then error(string.format("[rank %d] %s: no error", T.rank, what), 2) end
  err = tostring(err)
  if T.device ~= "cpu" and err:find("(MOE_DIST_DEBUG)", 1, true) then
    err = err:gsub(" on a GPU", "")
  end
  for _, p in ipairs(type(parts) == "table" and parts or { parts }) do
    if not err:find(p, 1, true) then
      error(string.format("[rank %d] %s: the error\n  %s\ndoes not contain\n  %s", T.rank, what,
        err, p), 2)
    end
  end
  return err
end

-- A tensor of dtype with values f(i) for i = 0..n-1, shaped as shape.
function T.make(shape, dtype, f)
  local n = 1
  for _, s in ipairs(shape) do n = n * s end
  local v = {}
  for i = 0, n - 1 do v[i + 1] = f(i) end
  local t = moe.tensor(v, { dtype = dtype }):reshape(shape)
  if T.device ~= "cpu" then t = t:to(T.device) end
  return t
end

function T.ok(name)
  T.dist.barrier()
  if T.rank == 0 then print(string.format("ok   %s (%d ranks)", name, T.size)) end
end

return T
