--[[
moe/layers/wp.lua - weight parallelism (expert-tensor sharding) for
layers.dMoE and layers.MoE: every expert's hidden dimension split over a
group of W ranks (moe.dist), for experts too large for one GPU. MegaBlocks'
moe_weight_parallelism / weight_parallel_group; Megatron-Core's expert
tensor parallelism (--expert-tensor-parallel-size) with its all-gather
dispatcher. Not a module of its own: dMoE:configure calls wp.setup when
moe_weight_parallelism is set, and dMoE:route_tokens calls wp.route_tokens.
docs/DISTRIBUTED.md "Expert-tensor sharding".

Layout. Rank w of the group holds columns [w f/W, (w+1) f/W) of every
expert's w1 (E, d, f) (and w3) and the same rows of w2 (E, f, d): the
experts module keeps (E, d, f/W) and (E, f/W, d). Every rank builds the
whole layer from the same seed first and then keeps its slice, so the
weights are those of one process holding the whole experts. The router, a
shared expert and the bias are replicated.

Forward on rank w (T tokens, the same T on every rank of the group, k
choices each):
  1. the router runs on this rank's tokens (its aux loss is this rank's);
  2. all_gather of x (T, d), the gates (T, k) and the expert ids over the
     group: W T tokens in rank order, the same on every rank;
  3. the experts on them, through this rank's hidden slice: with an
     activation applied per hidden unit, act(x w1) w2 = the sum over the
     slices of act(x w1[:, s]) w2[s, :], so each rank computes a partial
     output (W T, d) (gated, combined per token as usual). With expert
     parallelism too, step 3 is the expert-parallel exchange (moe/layers/
     ep.lua) of the gathered tokens among the ranks holding the same slice;
  4. reduce_scatter (sum) over the group: rank w gets its own T rows of the
     sum of the partial outputs, the whole layer's output.
Backward runs the same path backwards (reduce_scatter's backward is an
all_gather, all_gather's a reduce_scatter), so the gradients of x and of the
gates reach their own rank summed over the slices.

Gradients. A slice's gradient on its rank is the gradient of the sum over the
group's ranks of their losses (every rank's tokens went through it). When each
rank's loss is a mean over its own tokens and the job's loss is the mean over
ranks, the slice gradients must be divided by W and averaged over the ranks
holding the same slice; moe.train does it (moe/train/parallel.lua);
wp.slice_params(model) lists the tensors. Routing statistics (stats.
expert_counts) count the group's W T tokens.
]]
local moe = require "moe"

local M = {}

local function fail(name, msg, level) error(name .. ": " .. msg, (level or 1) + 1) end

local ep = require "moe.layers.ep"
local is_group = ep.is_group

-- The experts' hidden slice [h0, h0 + fl): w1, w3 (E, d, f) -> (E, d, fl) and
-- w2 (E, f, d) -> (E, fl, d), new leaves.
local function take_slice(ex, h0, fl)
  ep.keep_slice(ex, function(name) return name == "w2" and 1 or 2 end, h0, fl)
  ex.d_ff = fl
end

--- setup(layer, o, name, level): the layer's weight-parallel state from its
--- options (moe_weight_parallelism set): layer.wp = {group, size, rank,
--- ffn_local, hidden_begin, hidden_end}; the experts keep their slice.
function M.setup(layer, o, name, level)
  level = level + 1
  if o.weight_parallel_group ~= nil and not o.moe_weight_parallelism then
    fail(name, "weight_parallel_group is set but moe_weight_parallelism is false (set it to true)", level)
  end
  local group = o.weight_parallel_group
  if group == nil then
    local dist = moe.dist
    if dist == nil then fail(name, "weight parallelism needs moe.dist, which this build lacks", level) end
    group = dist.world
  end
  if not is_group(group) then
    fail(name, "weight_parallel_group must be a moe.dist group, got " .. type(group), level)
  end
  if o.experts ~= nil then
    fail(name, "weight parallelism works on the built-in experts (mlp_type \"mlp\" or \"glu\"), not on "
      .. "an experts = module", level)
  end
  if layer.ep and layer.ep.group == group and group:size() > 1 then
    fail(name, "expert_parallel_group and weight_parallel_group must be different groups (the ranks of "
      .. "one slice exchange tokens over the first, the slices of one expert over the second)", level)
  end
  local f, W = layer.ffn_hidden_size, group:size()
  if f % W ~= 0 then
    fail(name, string.format("ffn_hidden_size = %d is not divisible by the weight-parallel group's size %d "
      .. "(each rank holds ffn_hidden_size / size of every expert's hidden units)", f, W), level)
  end
  local fl, w = f // W, group:rank()
  if layer.mlp_impl_option == "sparse" and fl % layer.block_size ~= 0 then
    fail(name, string.format("mlp_impl \"sparse\" needs each rank's ffn_hidden_size / %d = %d to be a "
      .. "multiple of block_size (%d)", W, fl, layer.block_size), level)
  end
  layer.wp = { group = group, size = W, rank = w, ffn_local = fl, hidden_begin = w * fl,
    hidden_end = (w + 1) * fl }
  if W > 1 then take_slice(layer.experts, w * fl, fl) end
end

--- slice_params(model) -> list of the weight-parallel parameters of model
--- (the experts of every layer with layer.wp), each once, in model order; and
--- the group size (nil when there are none; every such layer must use groups
--- of one size).
function M.slice_params(model)
  return ep.sharded_experts(model, "wp", "weight parallelism")
end

--- route_tokens(layer, x2 (T, d), ids (T, k), gates (T, k), inner) -> y (T, d),
--- plan (over the group's W T tokens). inner(layer, xg, idsg, gatesg) runs the
--- experts on the gathered tokens and returns their partial output and plan.
function M.route_tokens(layer, x2, ids, gates, inner)
  local wp = layer.wp
  local group, W = wp.group, wp.size
  local dist = moe.dist
  local T = x2:size(0)
  -- every rank must bring the same number of tokens (a CPU all_gather: MPI
  -- on the host, no device synchronisation)
  local mine = moe.tensor({ T }, { dtype = "i64" })
  local all = moe.empty({ W }, { dtype = "i64" })
  dist.all_gather(all, mine, { group = group })
  local ts = all:totable()
  mine:free()
  all:free()
  for r = 1, W do
    if ts[r] ~= T then
      error(string.format("%s: weight parallelism needs the same number of tokens on every rank of the "
        .. "group; rank %d has %d, rank %d has %d", layer.__name, wp.rank, T, r - 1, ts[r]), 3)
    end
  end
  local F = dist.functional
  local xg = F.all_gather(x2, group) -- (W T, d)
  local gg = F.all_gather(gates, group) -- (W T, k)
  local ig = moe.empty({ W * T, ids:size(1) }, { dtype = ids.dtype, device = ids.device })
  dist.all_gather(ig, ids:contiguous(), { group = group })
  local yp, plan = inner(layer, xg, ig, gg) -- (W T, d): this slice's share
  return F.reduce_scatter(yp, group), plan
end

return M
