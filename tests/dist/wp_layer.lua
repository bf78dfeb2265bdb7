--[[
tests/dist/wp_layer.lua - weight parallelism (expert-tensor sharding) of
layers.dMoE (moe/layers/wp.lua), alone and with expert parallelism, against
one process holding every expert whole:

  moe-lua launch -n 2 tests/dist/wp_layer.lua      (and -n 4)

Every rank builds the layer twice from the same seed: the reference (every
expert whole) and the sharded layer (its hidden slice of every expert, or of
its experts with expert parallelism). Rank r's tokens are x_r (T tokens, the
same T on every rank), its loss L_r = sum(y_r * c_r) / numel + aux_r. The
reference runs every rank's tokens through its layer and backward of
L = mean_r L_r; the sharded rank runs only x_r and backward of L_r; then,
with P the number of ranks whose tokens meet (the world here):
  forward   y_r                         equals the reference's y_r
  input     dL_r/dx_r / P               equals the reference's dL/dx_r
  router    the mean over the ranks     equals the reference's router gradient
  experts   this rank's slice grads / P equal the reference's slice of them
in f64 within 1e-12 (relative to max(1, |reference|)): the sums over hidden
units run in another order (per slice, then summed over ranks). Also: the
errors for ffn_hidden_size not divisible, unequal token counts, the capacity
layer, and the same group for both kinds of parallelism.
]]
local moe = require "moe"
local layers = require "moe.layers"
local T = dofile(arg[0]:match("^(.*/)") .. "common.lua")
local dist = T.dist
dist.init { timeout = 120 }
assert(T.size >= 2, "run with moe-lua launch -n 2 (or 4)")

local E, K, D, F, N = 8, 2, 8, 8, 6
local TOL = 1e-12

local MK = dofile(arg[0]:match("^(.*/)") .. "moekit.lua")(T, E, TOL)
local Ban, ban_bias, loss_of, close, uneven = MK.Ban, MK.ban_bias, MK.loss_of, MK.close, MK.uneven

local function build(c, wp_group, ep_group)
  moe.manual_seed(7)
  local router = Ban { d_model = D, num_experts = E, top_k = K, loss_weight = 0.01, std = 0.5, dtype = "f64" }
  local o = { hidden_size = D, ffn_hidden_size = F, num_experts = E, top_k = K, dtype = "f64",
    mlp_type = c.mlp_type, mlp_impl = c.impl, block_size = 2, router = router, init_std = 0.3,
    shared_expert = c.shared }
  if wp_group then
    o.moe_weight_parallelism = true
    o.weight_parallel_group = wp_group
  end
  if ep_group then
    o.moe_expert_model_parallelism = true
    o.expert_parallel_group = ep_group
  end
  return layers.dMoE(o)
end

-- rank w's tokens and the loss weights
local function data(w, n)
  moe.manual_seed(100 + w)
  local x = moe.randn({ n or N, D }):to("cpu", "f64")
  local c = moe.randn({ n or N, D }):to("cpu", "f64")
  return x:requires_grad_(true), c
end


-- wp_group (and ep_group) over the whole world: every rank's tokens meet
local function check_case(c, wp_group, ep_group)
  local P, me = T.size, T.rank
  local bans = {}
  for r = 0, P - 1 do bans[r + 1] = ban_bias(c.bans and c.bans(r) or nil) end
  local ref = build(c, nil, nil)
  local ys, xs, cs = {}, {}, {}
  for r = 0, P - 1 do xs[r + 1], cs[r + 1] = data(r) end
  local total
  moe.scope(function()
    for r = 0, P - 1 do
      local l, y = loss_of(ref, xs[r + 1], cs[r + 1], bans[r + 1])
      ys[r + 1] = moe.keep(y:detach())
      total = total and total + l or l
    end
    (total * (1 / P)):backward()
  end)
  local sh = build(c, wp_group, ep_group)
  local W, w = wp_group:size(), wp_group:rank()
  local fl = F // W
  local El, q = E, 0
  if ep_group then El, q = E // ep_group:size(), ep_group:rank() end
  T.check(sh.experts.w1:size(2) == fl and sh.experts.w2:size(1) == fl, "%s: hidden slice %d/%d, wanted %d",
    c.name, sh.experts.w1:size(2), sh.experts.w2:size(1), fl)
  T.check(sh:num_active_parameters() == ref:num_active_parameters(), "%s: active parameters %d, wanted %d",
    c.name, sh:num_active_parameters(), ref:num_active_parameters())
  local x, cw = data(me)
  local worst = 0
  moe.scope(function()
    local l, y = loss_of(sh, x, cw, bans[me + 1])
    worst = math.max(worst, close(y, ys[me + 1], c.name .. ": forward"))
    l:backward()
  end)
  worst = math.max(worst, close(x.grad * (1 / P), xs[me + 1].grad, c.name .. ": input gradient"))
  local function mean_close(mod, rmod, what)
    local rp = rmod:named_parameters()
    for i, np in ipairs(mod:named_parameters()) do
      local g = np[2].grad:clone()
      dist.all_reduce(g, "avg")
      worst = math.max(worst, close(g, rp[i][2].grad, c.name .. ": " .. what .. " " .. np[1]))
    end
  end
  mean_close(sh.router, ref.router, "router")
  if c.shared then mean_close(sh.shared_expert, ref.shared_expert, "shared expert") end
  for _, np in ipairs(sh.experts:named_parameters()) do
    local want = rawget(ref.experts, np[1]).grad:narrow(0, q * El, El)
    want = want:narrow(np[1] == "w2" and 1 or 2, w * fl, fl)
    local g = np[2].grad or moe.zeros(want.shape, { dtype = "f64" })
    worst = math.max(worst, close(g * (1 / P), want, c.name .. ": experts " .. np[1]))
  end
  local t = moe.tensor({ worst }, { dtype = "f64" })
  dist.all_reduce(t, "max")
  if T.rank == 0 then
    print(string.format("ok   %s (WP over %d%s of %d ranks): largest relative difference %.2e", c.name, W,
      ep_group and (" x EP over " .. ep_group:size()) or "", T.size, t:item()))
  end
end

local world = dist.world
local cases = {
  { name = "dMoE grouped", impl = "grouped" },
  { name = "dMoE grouped uneven", impl = "grouped", bans = uneven },
  { name = "dMoE loop uneven", impl = "loop", bans = uneven },
  { name = "dMoE sparse uneven", impl = "sparse", bans = uneven },
  { name = "dMoE glu grouped uneven, shared expert", impl = "grouped", mlp_type = "glu", bans = uneven,
    shared = true },
}
for _, c in ipairs(cases) do check_case(c, world) end

-- with expert parallelism: a {ep, wp} mesh of 2 x 2
if T.size == 4 then
  local mesh = dist.mesh { { "ep", 2 }, { "wp", 2 } }
  check_case({ name = "dMoE grouped uneven, EP x WP", impl = "grouped", bans = uneven },
    mesh:group("wp"), mesh:group("ep"))
  check_case({ name = "dMoE glu sparse, EP x WP", impl = "sparse", mlp_type = "glu" },
    mesh:group("wp"), mesh:group("ep"))
end

-- errors
T.raises(function()
  layers.dMoE { hidden_size = D, ffn_hidden_size = T.size * 2 + 1, num_experts = E, top_k = 1,
    moe_weight_parallelism = true }
end, string.format("ffn_hidden_size = %d is not divisible by the weight-parallel group's size %d",
  T.size * 2 + 1, T.size), "ffn_hidden_size not divisible")
T.raises(function()
  layers.MoE { hidden_size = D, ffn_hidden_size = F, num_experts = E, top_k = 1, moe_weight_parallelism = true }
end, "weight parallelism is for the dropless layer", "the capacity layer")
T.raises(function()
  layers.dMoE { hidden_size = D, ffn_hidden_size = F, num_experts = E, top_k = 1, moe_weight_parallelism = true,
    moe_expert_model_parallelism = true }
end, "expert_parallel_group and weight_parallel_group must be different groups", "one group for both")
T.raises(function()
  local l = build({ impl = "grouped" }, world)
  local x = data(T.rank, T.rank == 1 and N + 1 or N)
  l(x)
end, { "weight parallelism needs the same number of tokens on every rank", "rank 1 has 7" },
  "unequal token counts")
T.ok("wp_layer: the errors")
