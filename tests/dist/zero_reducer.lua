--[[
tests/dist/zero_reducer.lua - the reducer's reduce_scatter mode (moe.dist.reducer,
mode = "reduce_scatter"; core/dist_reducer.c) and the sharded AdamW's step against
optim.AdamW, in a world of one and of two ranks:

  moe-lua tests/dist/zero_reducer.lua
  moe-lua launch -n 2 tests/dist/zero_reducer.lua

Rank r's loss is sum_i sum(p_i * c_i,r) with known c (a rank- and element-
dependent pattern), so the gradient of p_i is c_i,r and its average over ranks
is known exactly (small integers / 4: every sum and halving is exact). Checked:
the layout (buckets padded to a multiple of the group size, segments covering
every element exactly once over the ranks), each rank's shard against the
expected average (padding zeros), .grad released after finish, had_grad for a
parameter that gets no gradient anywhere and one that gets it on rank 0 only,
the no-copy path (one parameter per bucket, no padding), HSDP in both
directions on 2 ranks (shard groups of one rank with the world as replicate
group, and the reverse), errors, and ShardedAdamW.step against optim.AdamW on
the same averaged gradient (bit for bit).
]]
local moe = require "moe"
local optim = require "moe.optim"

local dist = moe.dist
local rank, world = dist.rank(), dist.world_size()
local function say(...) if rank == 0 then print(string.format(...)) end end

-- sizes: odd, so buckets need padding; one parameter that never gets a
-- gradient (index 4) and one that gets it on rank 0 only (index 5)
local shapes = { { 3, 5 }, { 7 }, { 4, 4 }, { 2 }, { 3 }, { 6, 2 } }
local NOGRAD, RANK0 = 4, 5

local function make_params()
  local ps = {}
  for i, s in ipairs(shapes) do
    local n = 1
    for _, d in ipairs(s) do n = n * d end
    local v = {}
    for j = 1, n do v[j] = (i * 7 + j) % 11 / 8 - 0.5 end
    local t = moe.tensor(v):reshape(s)
    t.requires_grad = true
    ps[i] = t
  end
  return ps
end

-- c_i,r: the gradient rank r gives parameter i (elements (i + j + 3 r) % 5 - 2)
local function coef(i, r, n)
  local v = {}
  for j = 1, n do v[j] = (i + j + 3 * r) % 5 - 2 end
  return v
end

local function expected_avg(i, n, ranks)
  local out = {}
  for j = 1, n do
    local s, cnt = 0, 0
    for _, r in ipairs(ranks) do
      cnt = cnt + 1
      if i ~= NOGRAD and (i ~= RANK0 or r == 0) then s = s + coef(i, r, n)[j] end
    end
    out[j] = s / cnt
  end
  return out
end

local function backward(ps)
  local loss
  for i, p in ipairs(ps) do
    if i ~= NOGRAD and (i ~= RANK0 or rank == 0) then
      local c = moe.tensor(coef(i, rank, p:numel())):reshape(p.shape)
      local term = (p * c):sum()
      loss = loss and loss + term or term
    end
  end
  loss:backward()
end

local function all_ranks()
  local r = {}
  for i = 0, world - 1 do r[#r + 1] = i end
  return r
end

-- One round of a reducer in reduce_scatter mode over group (size P, this rank
-- at index), averaged over ranks: checks shards, layout, grads.
local function check_round(label, opts, avg_ranks)
  local ps = make_params()
  local r = dist.reducer(ps, opts)
  assert(r:mode() == "reduce_scatter")
  local lay = r:layout()
  local P = lay.size
  local covered = {}
  for k, b in ipairs(lay.buckets) do
    assert(b.padded % P == 0 and b.padded >= b.numel and b.padded - b.numel < P,
      ("%s: bucket %d: padded %d for %d elements over %d ranks"):format(label, k, b.padded, b.numel, P))
    assert(b.shard_numel * P == b.padded and b.shard_offset == lay.rank * b.shard_numel)
    for _, s in ipairs(b.segments) do
      assert(lay.params[s.param].bucket == k)
      covered[s.param] = (covered[s.param] or 0) + s.numel
    end
  end
  -- over the group, every element is covered once
  local cov = {}
  for i = 1, #ps do cov[i] = covered[i] or 0 end
  local t = moe.tensor(cov, { dtype = "f64" })
  dist.all_reduce(t, "sum", { group = opts.group })
  for i, v in ipairs(t:totable()) do
    assert(v == ps[i]:numel(), ("%s: parameter %d covered %d times of %d elements"):format(label, i, v, ps[i]:numel()))
  end
  for round = 1, 2 do
    r:arm()
    backward(ps)
    r:finish()
    for i, p in ipairs(ps) do
      assert(p.grad == nil, ("%s: parameter %d still has a .grad after finish"):format(label, i))
    end
    assert(r:had_grad(NOGRAD) == false, label .. ": a parameter with no gradient anywhere had_grad")
    assert(r:had_grad(RANK0) == true, label .. ": a parameter with a gradient on rank 0 only")
    assert(r:had_grad(1) == true)
    for k, b in ipairs(lay.buckets) do
      local sh = r:shard(k)
      assert(sh and sh:numel() == b.shard_numel, ("%s: bucket %d shard"):format(label, k))
      local v = sh:totable()
      local seen = {}
      for _, s in ipairs(b.segments) do
        local want = expected_avg(s.param, ps[s.param]:numel(), avg_ranks)
        for j = 0, s.numel - 1 do
          local got, exp = v[s.shard_offset + j + 1], want[s.param_offset + j + 1]
          assert(got == exp, ("%s round %d: bucket %d parameter %d element %d: %s, expected %s"):format(
            label, round, k, s.param, s.param_offset + j, tostring(got), tostring(exp)))
          seen[s.shard_offset + j + 1] = true
        end
      end
      for j = 1, b.shard_numel do
        if not seen[j] then assert(v[j] == 0, ("%s: padding element %d is %s"):format(label, j, v[j])) end
      end
    end
  end
  r:clear()
  assert(r:shard(1) == nil, label .. ": shard after clear")
  r:free()
  return lay
end

local W = all_ranks()
-- several buckets (a few hundred bytes each), padded
local lay = check_round("rs world", { mode = "reduce_scatter", bucket_mb = 200 / 2 ^ 20 }, W)
say("reduce_scatter over %d rank(s): %d buckets, ok", world, #lay.buckets)
-- one parameter per bucket: the no-copy path where numel % P == 0
check_round("rs one per bucket", { mode = "reduce_scatter", bucket_mb = 0 }, W)
-- one bucket
check_round("rs one bucket", { mode = "reduce_scatter", bucket_mb = 1 }, W)
if world == 2 then
  -- HSDP, shard groups of one (each rank alone) and the world as replicate group
  local alone = dist.world:split(rank, 0, "alone")
  check_round("hsdp 1x2", { mode = "reduce_scatter", group = alone, replicate_group = dist.world,
    bucket_mb = 200 / 2 ^ 20 }, W)
  -- and the reverse: shards over the world, replicas alone
  check_round("hsdp 2x1", { mode = "reduce_scatter", group = dist.world, replicate_group = alone,
    bucket_mb = 200 / 2 ^ 20 }, W)
  -- a reduce_group that is not the group's ranks is refused before anything is built
  local ok, err = pcall(optim.ShardedAdamW, { { "p", make_params()[1] } }, { group = dist.world,
    reduce_group = alone })
  assert(not ok and err:find("option reduce_group must hold the ranks of group in its order", 1, true), err)
  alone:free()
  say("HSDP (1 x 2 and 2 x 1): ok")
end

-- errors
do
  local ps = make_params()
  local ok, err = pcall(dist.reducer, ps, { mode = "scatter" })
  assert(not ok and err:find("mode must be"), err)
  ok, err = pcall(dist.reducer, ps, { replicate_group = dist.world })
  assert(not ok and err:find("replicate_group needs mode"), err)
  local r = dist.reducer(ps)
  assert(r:mode() == "all_reduce" and r:shard(1) == nil)
  local l = r:layout()
  assert(l.size == 1 and l.rank == 0 and l.buckets[1].padded == l.buckets[1].numel)
  r:free()
end

-- Two copies of the parameters: one under ShardedAdamW, one under optim.AdamW (the
-- reference), with the same hyperparameters.
local function two_optimizers()
  local ps, ref = make_params(), make_params()
  local named, rnamed = {}, {}
  for i = 1, #ps do
    named[i] = { "p" .. i, ps[i] }
    rnamed[i] = { "p" .. i, ref[i] }
  end
  local hp = { lr = 1e-2, weight_decay = 0.1, betas = { 0.9, 0.95 } }
  local zopt = optim.ShardedAdamW(named, { lr = hp.lr, weight_decay = hp.weight_decay, betas = hp.betas,
    bucket_mb = 200 / 2 ^ 20 })
  return ps, ref, zopt, optim.AdamW(rnamed, hp)
end

-- ShardedAdamW against optim.AdamW on the same averaged gradient, 3 steps:
-- the same element-wise update, so the same bits
do
  local ps, ref, zopt, aopt = two_optimizers()
  for _ = 1, 3 do
    zopt.reducer:arm()
    backward(ps)
    zopt.reducer:finish()
    zopt:step()
    zopt:zero_grad()
    -- the reference: the average gradient set by hand (nil where none anywhere)
    for i, p in ipairs(ref) do
      if i ~= NOGRAD then p.grad = moe.tensor(expected_avg(i, p:numel(), W)):reshape(p.shape) end
    end
    aopt:step()
    aopt:zero_grad()
  end
  for i = 1, #ps do
    local a, b = ps[i]:reshape({ -1 }):totable(), ref[i]:reshape({ -1 }):totable()
    for j = 1, #a do
      assert(a[j] == b[j], ("ShardedAdamW: parameter %d element %d: %.9g vs AdamW's %.9g"):format(i, j, a[j], b[j]))
    end
  end
  -- state: 1/P of AdamW's (plus padding)
  local full = 0
  for _, t in pairs(aopt:state_dict()) do full = full + t:numel() * 4 end
  local mine = zopt:state_bytes()
  local per = moe.tensor({ mine }, { dtype = "f64" })
  dist.all_reduce(per, "max")
  say("ShardedAdamW == AdamW over 3 steps; state %d bytes per rank (max), AdamW %d", math.tointeger(per:item()), full)
  assert(per:item() <= full / world + 2 * 4 * #zopt.buckets * world)
  local ok, err = pcall(zopt.state_dict, zopt)
  assert(not ok and err:find("cannot be saved"), err)
  zopt:free()
end

-- ShardedAdamW:grad_norm and step{grad_scale} against optim.grad_norm and AdamW's
-- step{grad_scale} on the same averaged gradient (clipped: max_norm below the norm). The norm
-- adds the same squares in another order (per rank, then over ranks): close, not bit for bit;
-- with the reference's coefficient the step is the same element-wise update, bit for bit.
do
  local ps, ref, zopt, aopt = two_optimizers()
  zopt.reducer:arm()
  backward(ps)
  zopt.reducer:finish()
  for i, p in ipairs(ref) do
    if i ~= NOGRAD then p.grad = moe.tensor(expected_avg(i, p:numel(), W)):reshape(p.shape) end
  end
  local rn, rcoef = optim.grad_norm(ref, 0.5)
  local zn, zcoef, zinf = zopt:grad_norm(0.5)
  assert(zn.device == "cpu" and zn:numel() == 1 and zinf:item() == 0)
  local a, b = zn:item(), rn:item()
  assert(math.abs(a - b) <= 1e-6 * b, ("ShardedAdamW:grad_norm %.9g vs optim.grad_norm %.9g"):format(a, b))
  assert(zcoef:item() < 1 and math.abs(zcoef:item() - rcoef:item()) <= 1e-6)
  local ok, err = pcall(zopt.grad_norm, zopt, -1)
  assert(not ok and err:find("ShardedAdamW:grad_norm: max_norm must be a positive number, got %-1"), err)
  ok, err = pcall(zopt.step, zopt, { grad_scale = 0.5 })
  assert(not ok and err:find("grad_scale must be a tensor"), err)
  ok, err = pcall(zopt.step, zopt, { scale = rcoef })
  assert(not ok and err:find("unknown option 'scale'"), err)
  zopt:step { grad_scale = rcoef }
  aopt:step { grad_scale = rcoef }
  for i = 1, #ps do
    local x, y = ps[i]:reshape({ -1 }):totable(), ref[i]:reshape({ -1 }):totable()
    for j = 1, #x do
      assert(x[j] == y[j], ("ShardedAdamW step{grad_scale}: parameter %d element %d: %.9g vs %.9g"):format(
        i, j, x[j], y[j]))
    end
  end
  say("ShardedAdamW:grad_norm %.7g (optim.grad_norm %.7g); step{grad_scale} == AdamW's", a, b)
  zopt:free()
end

dist.barrier()
say("zero_reducer: ok")
