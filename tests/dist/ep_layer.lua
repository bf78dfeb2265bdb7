--[[
tests/dist/ep_layer.lua - expert parallelism of layers.dMoE and layers.MoE
(moe/layers/ep.lua) against one process holding every expert:

  moe-lua launch -n 2 tests/dist/ep_layer.lua      (and -n 4)

Every rank builds the layer twice from the same seed: the reference (all E
experts) and the EP layer (its E / P experts). Rank r's tokens are x_r (T_r
tokens, T_r different on every rank), its loss L_r = sum(y_r * c_r) / numel
+ aux_r. The reference runs every rank's tokens through its layer (one
call per rank, as that rank would) and backward of L = mean_r L_r: what one
process on the global batch computes. The EP rank runs only x_r and
backward of L_r; then
  forward   y_r                          equals the reference's y_r
  input     dL_r/dx_r / P                equals the reference's dL/dx_r
  router    the mean over the group      equals the reference's router gradient
  experts   this rank's grads / P        equal the reference's rows of them
            (the scaling rule of docs/DISTRIBUTED.md "Expert parallelism")
in f64 within 1e-12 (relative to max(1, |reference|)): the sums over tokens
run in another order (an expert's rows from every rank in one grouped GEMM
against one GEMM per rank summed), so not bit for bit, but only rounding
apart. Routing is made uneven by a router that bans some experts per rank
(some experts get no token from some ranks; in one case a rank's experts get
no token at all). Also: one host synchronisation per dropless EP layer,
none for the capacity layer, and the error for num_experts not divisible.
]]
local moe = require "moe"
local layers = require "moe.layers"
local T = dofile(arg[0]:match("^(.*/)") .. "common.lua")
local dist = T.dist
dist.init { timeout = 120 }
assert(T.size >= 2, "run with moe-lua launch -n 2 (or 4)")

local E, K, D, F = 8, 2, 8, 8
local TOL = 1e-12

local MK = dofile(arg[0]:match("^(.*/)") .. "moekit.lua")(T, E, TOL)
local Ban, ban_bias, loss_of, close, uneven = MK.Ban, MK.ban_bias, MK.loss_of, MK.close, MK.uneven

local function build(c, ep_group)
  moe.manual_seed(7)
  local router = Ban { d_model = D, num_experts = E, top_k = K, loss_weight = 0.01, std = 0.5, dtype = "f64" }
  local o = { hidden_size = D, ffn_hidden_size = F, num_experts = E, top_k = K, dtype = "f64",
    mlp_type = c.mlp_type, mlp_impl = c.impl, block_size = 4, router = router, init_std = 0.3 }
  if c.capacity then o.capacity_factor = c.capacity end
  if ep_group then
    o.moe_expert_model_parallelism = true
    o.expert_parallel_group = ep_group
  end
  return c.capacity and layers.MoE(o) or layers.dMoE(o)
end

-- rank w's tokens (T_w of them) and the loss weights
local function data(w)
  moe.manual_seed(100 + w)
  local n = 5 + 2 * w
  local x = moe.randn({ n, D }):to("cpu", "f64")
  local c = moe.randn({ n, D }):to("cpu", "f64")
  return x:requires_grad_(true), c
end

local function check_case(c, group)
  local P, q = group:size(), group:rank()
  local sources = group:ranks() -- world ranks of the group, in group order
  local me = T.rank
  local bans = {}
  for i in ipairs(sources) do bans[i] = ban_bias(c.bans and c.bans(i - 1, P) or nil) end
  -- the reference: every rank of the group through the full layer, L = mean of the L_r
  local ref = build(c, nil)
  local ys, xs, cs = {}, {}, {}
  for i, w in ipairs(sources) do xs[i], cs[i] = data(w) end
  local total
  moe.scope(function()
    for i in ipairs(sources) do
      local l, y = loss_of(ref, xs[i], cs[i], bans[i])
      ys[i] = moe.keep(y:detach())
      total = total and total + l or l
    end
    (total * (1 / P)):backward()
  end)
  -- the EP layer: this rank's tokens only
  local ep = build(c, group)
  T.check(ep.experts.w1:size(0) == E // P, "%s: %d local experts, wanted %d", c.name, ep.experts.w1:size(0), E // P)
  T.check(ep:num_active_parameters() == ref:num_active_parameters(), "%s: active parameters %d, wanted %d",
    c.name, ep:num_active_parameters(), ref:num_active_parameters())
  local x, cw = data(me)
  local syncs, lsyncs, M
  local worst = 0
  moe.scope(function()
    local l, y = loss_of(ep, x, cw, bans[q + 1])
    worst = math.max(worst, close(y, ys[q + 1], c.name .. ": forward"))
    l:backward()
    syncs, lsyncs = ep.ep_last.plan.host_syncs, ep.ep_last.local_plan.host_syncs
    M = ep.ep_last.local_plan.T
    if c.bans and not c.capacity then -- some expert gets no token from some rank
      local zero = false
      for _, n in ipairs(ep.ep_last.segments) do zero = zero or n == 0 end
      T.check(zero, "%s: every expert got tokens from every rank", c.name)
    end
  end)
  T.check(syncs == (c.capacity and 0 or 1), "%s: the plan made %d host syncs", c.name, syncs)
  T.check(lsyncs == 0, "%s: the local plan made %d host syncs", c.name, lsyncs)
  worst = math.max(worst, close(x.grad * (1 / P), xs[q + 1].grad, c.name .. ": input gradient"))
  -- router: the mean over the group (what the reducer does)
  local rp, rref = ep.router:named_parameters(), ref.router:named_parameters()
  for i, np in ipairs(rp) do
    local g = np[2].grad:clone()
    dist.all_reduce(g, "avg", { group = group })
    worst = math.max(worst, close(g, rref[i][2].grad, c.name .. ": router " .. np[1]))
  end
  -- experts: this rank's rows, divided by P
  local El = E // P
  for _, np in ipairs(ep.experts:named_parameters()) do
    local want = rawget(ref.experts, np[1]).grad:narrow(0, q * El, El)
    local g = np[2].grad
    if g == nil then
      g = moe.zeros(want.shape, { dtype = "f64" }) -- no row reached these experts: nil, as one process
      T.check(M == 0, "%s: %s has no gradient but %d rows arrived", c.name, np[1], M)
    end
    worst = math.max(worst, close(g * (1 / P), want, c.name .. ": experts " .. np[1]))
  end
  local w = moe.tensor({ worst }, { dtype = "f64" })
  dist.all_reduce(w, "max")
  local m = moe.tensor({ M }, { dtype = "f64" })
  local mn = m:clone()
  dist.all_reduce(mn, "min")
  if T.rank == 0 then
    print(string.format("ok   %s (EP over %d of %d ranks): largest relative difference %.2e, fewest rows "
      .. "received %d", c.name, P, T.size, w:item(), math.tointeger(mn:item())))
  end
end

-- uneven (moekit): source rank s bans experts (s + j) % E for j in {0, 1, 3}; "starved": every
-- rank bans the last rank's experts (that rank receives no row)
local function starve(_, P)
  local El, out = E // P, {}
  for e = E - El, E - 1 do out[#out + 1] = e end
  return out
end

local cases = {
  { name = "dMoE grouped", impl = "grouped" },
  { name = "dMoE grouped uneven", impl = "grouped", bans = uneven },
  { name = "dMoE loop uneven", impl = "loop", bans = uneven },
  { name = "dMoE sparse uneven", impl = "sparse", bans = uneven },
  { name = "dMoE glu grouped uneven", impl = "grouped", mlp_type = "glu", bans = uneven },
  { name = "dMoE grouped starved", impl = "grouped", bans = starve },
  { name = "MoE capacity 1 grouped", impl = "grouped", capacity = 1.0, bans = uneven },
  { name = "MoE capacity 1 sparse", impl = "sparse", capacity = 1.0 },
}
for _, c in ipairs(cases) do check_case(c, dist.world) end

-- an EP group smaller than the world: {dp, ep} mesh, EP over pairs
if T.size == 4 then
  local mesh = dist.mesh { { "dp", 2 }, { "ep", 2 } }
  check_case({ name = "dMoE grouped uneven, ep group of 2", impl = "grouped", bans = uneven }, mesh:group("ep"))
end

-- num_experts not divisible by the group's size
local ok, err = pcall(layers.dMoE, { hidden_size = D, ffn_hidden_size = F, num_experts = T.size + 1,
  top_k = 1, moe_expert_model_parallelism = true })
T.check(not ok, "num_experts = %d on %d ranks: no error", T.size + 1, T.size)
local want = string.format("num_experts = %d is not divisible by the expert-parallel group's size %d",
  T.size + 1, T.size)
T.check(tostring(err):find(want, 1, true), "the error\n  %s\ndoes not contain\n  %s", tostring(err), want)
T.ok("ep_layer: num_experts not divisible is an error")
