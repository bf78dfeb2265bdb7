--[[
tests/dist/functional.lua - dist.functional: the differentiable
collectives, forward and backward against references computed from every
rank's data. Each loss is sum(out * W_r) with a per-rank weight W_r, so the
gradient of x on rank r is the transposed collective of the W's:
  all_to_all      the reverse all_to_all (swapped splits)
  all_gather      reduce_scatter (sum)
  reduce_scatter  all_gather
  all_reduce      identity
Then dist.finalize() ends the runtime and later calls fail. Run with 2 and
4 ranks.
]]
local T = dofile(arg[0]:match("^(.*/)") .. "common.lua")
local moe, dist = T.moe, T.dist
local F = dist.functional
local R, P = T.rank, T.size

local C = 3
local function w(r, i) return ((r * 5 + i) % 7) - 3 end -- the loss weights of rank r

local function leaf(shape, dt, f)
  local x = T.make(shape, dt, f)
  x.requires_grad = true
  return x
end

local function loss(out, r)
  local W = T.make(out.shape, out.dtype, function(i) return w(r, i) end)
  return (out * W):sum()
end

-- (no f64 reductions on CUDA: f32 and bf16 there)
for _, dt in ipairs(T.device == "cpu" and { "f32", "f64" } or { "f32", "bf16" }) do
  -- all_to_all ------------------------------------------------------
  local function sends(r)
    local s = {}
    for j = 0, P - 1 do s[j + 1] = (r + 2 * j) % 3 end
    return s
  end
  local function first(s, upto)
    local n = 0
    for k = 1, upto do n = n + s[k] end
    return n
  end
  local send, recv = sends(R), {}
  for j = 0, P - 1 do recv[j + 1] = sends(j)[R + 1] end
  local nin = first(send, P) + 1 -- one row that goes nowhere
  local x = leaf({ nin, C }, dt, function(i) return T.val(R, i) end)
  local out = F.all_to_all(x, send, moe.tensor(recv, { dtype = "i64" }))
  T.check(out.shape[1] == first(recv, P) and out.shape[2] == C, "all_to_all shape")
  local want = {}
  for j = 0, P - 1 do
    local sj = sends(j)
    for row = first(sj, R), first(sj, R) + sj[R + 1] - 1 do
      for c = 0, C - 1 do want[#want + 1] = T.val(j, row * C + c) end
    end
  end
  T.same(out, want, 0, "functional.all_to_all forward " .. dt)
  loss(out, R):backward()
  -- row `row` of x goes to rank j, landing at row first(recv_j, R) + k of its output
  local gwant = {}
  for j = 0, P - 1 do
    local recv_j = {}
    for k = 0, P - 1 do recv_j[k + 1] = sends(k)[j + 1] end
    local at = first(recv_j, R)
    for k = 0, send[j + 1] - 1 do
      for c = 0, C - 1 do gwant[#gwant + 1] = w(j, (at + k) * C + c) end
    end
  end
  for _ = 1, C do gwant[#gwant + 1] = 0 end
  T.same(x.grad, gwant, 0, "functional.all_to_all backward " .. dt)

  -- all_gather ------------------------------------------------------
  local n = 2
  local xg = leaf({ n, C }, dt, function(i) return T.val(R, i) end)
  local og = F.all_gather(xg)
  want = {}
  for r = 0, P - 1 do for i = 0, n * C - 1 do want[#want + 1] = T.val(r, i) end end
  T.same(og, want, 0, "functional.all_gather forward " .. dt)
  loss(og, R):backward()
  gwant = {}
  for i = 0, n * C - 1 do
    local acc = 0
    for r = 0, P - 1 do acc = acc + w(r, R * n * C + i) end
    gwant[i + 1] = acc
  end
  T.same(xg.grad, gwant, 0, "functional.all_gather backward " .. dt)

  -- reduce_scatter --------------------------------------------------
  local xr = leaf({ P * n, C }, dt, function(i) return T.val(R, i) end)
  local orr = F.reduce_scatter(xr, dist.world)
  want = {}
  for i = 0, n * C - 1 do
    local acc = 0
    for r = 0, P - 1 do acc = acc + T.val(r, R * n * C + i) end
    want[i + 1] = acc
  end
  T.same(orr, want, 0, "functional.reduce_scatter forward " .. dt)
  loss(orr, R):backward()
  gwant = {}
  for r = 0, P - 1 do for i = 0, n * C - 1 do gwant[#gwant + 1] = w(r, i) end end
  T.same(xr.grad, gwant, 0, "functional.reduce_scatter backward " .. dt)

  -- all_reduce ------------------------------------------------------
  local xa = leaf({ 4 }, dt, function(i) return T.val(R, i) end)
  local oa = F.all_reduce(xa)
  want = {}
  for i = 0, 3 do
    local acc = 0
    for r = 0, P - 1 do acc = acc + T.val(r, i) end
    want[i + 1] = acc
  end
  T.same(oa, want, 0, "functional.all_reduce forward " .. dt)
  T.same(xa, (function() local v = {} for i = 0, 3 do v[i + 1] = T.val(R, i) end return v end)(),
    0, "functional.all_reduce leaves its input")
  loss(oa, R):backward()
  gwant = {}
  for i = 0, 3 do gwant[i + 1] = w(R, i) end
  T.same(xa.grad, gwant, 0, "functional.all_reduce backward (identity) " .. dt)
end

-- on a sub-group: all_gather over the parity group
do
  local g = dist.world:split(R % 2, R, "parity")
  local x = leaf({ 1, C }, "f32", function(i) return R * 10 + i end)
  local out = F.all_gather(x, g)
  local want = {}
  for r = R % 2, P - 1, 2 do for c = 0, C - 1 do want[#want + 1] = r * 10 + c end end
  T.same(out, want, 0, "functional.all_gather on a group")
  out:sum():backward()
  T.same(x.grad, { g:size(), g:size(), g:size() }, 0, "its backward")
end

T.raises(function() F.reduce_scatter(moe.zeros({ P + 1 })) end, { "must be a multiple of" },
  "reduce_scatter rows")

-- finalize: works are waited for and freed, groups disowned
local t = moe.ones({ 3 })
local wk = dist.all_reduce(t, "sum", { async = true })
local g2 = dist.world:split(0, R, "late")
dist.barrier()
if R == 0 then print(string.format("ok   functional (%d ranks)", P)) end
dist.finalize()
T.check(not dist.initialized(), "finalized")
T.same(t, { P, P, P }, 0, "the async all_reduce was waited for by finalize")
T.raises(function() wk:wait() end, "attempt to use a freed work", "work after finalize")
T.raises(function() g2:rank() end, "attempt to use a freed group", "group after finalize")
T.raises(function() dist.rank() end, "cannot start again", "init after finalize")
