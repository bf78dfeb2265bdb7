--[[
moe/layers/ep.lua - expert parallelism (EP) for layers.dMoE and layers.MoE:
the experts spread over a group of P ranks (moe.dist), MegaBlocks'
parallel_forward_once. Not a module of its own: dMoE:configure calls
ep.setup when moe_expert_model_parallelism is set, and dMoE:route_tokens
calls ep.route_tokens. docs/DISTRIBUTED.md "Expert parallelism".

Layout. Rank q of the group holds experts [q E/P, (q+1) E/P) (El = E/P of
them): its experts module keeps only those rows of w1, w2 (w3). Every rank
builds the whole layer from the same seed first and then keeps its slice, so
the random numbers drawn (and every other weight of a model) are those of
one process holding every expert. The router is replicated.

Forward on rank q (T local tokens, k choices each):
  1. plan  = routing_plan(ids, E): this rank's assignments sorted by global
     expert (dropless: R = T k rows; capacity: E C rows, C of each expert,
     padding included). Its per-expert rows ("segments") are known on the
     host: the dropless plan's counts copy, the layer's ONE device -> host
     synchronisation; a capacity plan's are C each and need none.
  2. The segments are exchanged: one all_gather of E integers over the
     group, on a CPU tensor (MPI on the host: no device synchronisation).
     From them every rank knows, for each pair of ranks, how many rows go
     from one to the other, and how many of each local expert.
  3. xs = permute(x, plan) (R, d): rows for rank p are the segments of p's
     experts, contiguous. dist.functional.all_to_all sends them: the M rows
     received arrive grouped by source rank, then by local expert.
  4. A second plan over the El local experts, on ids built on the host from
     the exchanged counts (the local expert of each received row) with
     known_counts (no synchronisation): its stable sort regroups the rows by
     local expert (source order kept within an expert), and the experts
     module runs it as any plan (impl grouped, loop or sparse), combining
     its output back into the received order (gates nil: weight 1).
  5. The reverse all_to_all returns each row to its source, in plan order;
     combine(rows, plan, gates) sums each token's k rows with its gates.
Backward runs the same path backwards: combine, the reverse all_to_all's
backward (an all_to_all), the experts, the second plan's permute/combine
backward (deterministic gathers, no atomics), the first all_to_all's
backward, permute's backward. Every rank must run backward through the
layer (each all_to_all is a collective), even one whose loss ignores it.

Gradients. The expert weight gradient on its owner is the sum over the
group's ranks of the gradients of their own losses. When each rank's loss
is a mean over its own tokens and the job's loss is the mean over ranks, the
expert gradients must be divided by P (and averaged over the ranks holding
the same experts, when there are several such groups): moe.train does it
(moe/train/parallel.lua); ep.expert_params(model) lists the tensors.
]]
local moe = require "moe"

local M = {}

local function fail(name, msg, level) error(name .. ": " .. msg, (level or 1) + 1) end

-- Whether g is a moe.dist group (also for moe/layers/wp.lua).
function M.is_group(g)
  return (type(g) == "userdata" or type(g) == "table") and pcall(function() return g:size(), g:rank() end)
end
local is_group = M.is_group

--- keep_slice(ex, dim_of, start, len): the experts' w1, w3, w2 narrowed to
--- [start, start + len) along dim_of(name), as new leaves (the old ones
--- freed); moe/layers/wp.lua keeps hidden slices the same way.
function M.keep_slice(ex, dim_of, start, len)
  moe.no_grad(function()
    for _, name in ipairs({ "w1", "w3", "w2" }) do
      local w = rawget(ex, name)
      if w ~= nil then
        local s = w:narrow(dim_of(name), start, len):contiguous():clone()
        ex:param(name, s)
        w:free()
      end
    end
  end)
end

-- The experts' weights of rank q's slice: (E, ...) -> (El, ...).
local function take_slice(ex, e0, El)
  M.keep_slice(ex, function() return 0 end, e0, El)
  ex.num_experts = El
end

--- setup(layer, o, name, level): the layer's EP state from its options
--- (moe_expert_model_parallelism set): layer.ep = {group, size, rank,
--- local_experts, expert_begin, expert_end}; the experts keep their slice.
function M.setup(layer, o, name, level)
  level = level + 1
  if not o.moe_expert_model_parallelism then
    fail(name, "expert_parallel_group is set but moe_expert_model_parallelism is false (set it to true)", level)
  end
  local group = o.expert_parallel_group
  if group == nil then
    local dist = moe.dist
    if dist == nil then fail(name, "expert parallelism needs moe.dist, which this build lacks", level) end
    group = dist.world
  end
  if not is_group(group) then
    fail(name, "expert_parallel_group must be a moe.dist group, got " .. type(group), level)
  end
  if o.experts ~= nil then
    fail(name, "expert parallelism works on the built-in experts (mlp_type \"mlp\" or \"glu\"), not on "
      .. "an experts = module", level)
  end
  local E, P = layer.num_experts, group:size()
  if E % P ~= 0 then
    fail(name, string.format("num_experts = %d is not divisible by the expert-parallel group's size %d "
      .. "(each rank holds num_experts / size experts)", E, P), level)
  end
  local q, El = group:rank(), E // P
  layer.ep = { group = group, size = P, rank = q, local_experts = El, expert_begin = q * El,
    expert_end = (q + 1) * El }
  if P > 1 then take_slice(layer.experts, q * El, El) end
end

--- sharded_experts(model, field, what) -> list of the experts' parameters of
--- every layer of model with layer[field] (a parallel state: ep, wp), each
--- once, in model order; and the group size (nil when there are none; every
--- such layer must use groups of one size; what names the kind in the error).
function M.sharded_experts(model, field, what)
  local out, seen, size = {}, {}, nil
  for _, m in ipairs(model:modules()) do
    local st = rawget(m, field)
    if type(st) == "table" and st.group then
      if size and size ~= st.size then
        error(("%s: layers with groups of sizes %d and %d"):format(what, size, st.size), 3)
      end
      size = st.size
      for _, p in ipairs(m.experts:parameters()) do
        if not seen[p] then
          seen[p] = true
          out[#out + 1] = p
        end
      end
    end
  end
  return out, size
end

--- expert_params(model) -> the expert-parallel parameters of model (the experts
--- of every layer with layer.ep) and the EP group size (sharded_experts).
function M.expert_params(model) return M.sharded_experts(model, "ep", "expert parallelism") end

local function sum(t, a, b)
  local n = 0
  for i = a, b do n = n + t[i] end
  return n
end

--- route_tokens(layer, x2 (T, d), ids (T, k), gates (T, k)) -> y (T, d), plan.
function M.route_tokens(layer, x2, ids, gates)
  local ep = layer.ep
  local group, P, q, El = ep.group, ep.size, ep.rank, ep.local_experts
  local E = layer.num_experts
  local dist = moe.dist
  -- 1. this rank's plan over all E experts; capacity plans keep block_size (C
  -- rounded as one process rounds it), dropless plans are unpadded here (the
  -- local plan pads for impl sparse)
  local o = layer:plan_opts(gates)
  local capacity = o.capacity_factor ~= nil
  if not capacity then o = { counts_to_host = true } end
  o.ffn_hidden = nil
  local plan = moe.ops.routing_plan(ids, E, o)
  local seg
  if capacity then
    seg = {}
    for e = 1, E do seg[e] = plan.capacity end
  else
    seg = plan:counts_to_host() -- the one host synchronisation
  end
  -- 2. the segments of every rank (CPU: MPI, no device synchronisation)
  local mine = moe.tensor(seg, { dtype = "i64" })
  local all = moe.empty({ P * E }, { dtype = "i64" })
  dist.all_gather(all, mine, { group = group })
  local g = all:totable()
  mine:free()
  all:free()
  local send, recv, lc = {}, {}, {}
  for p = 0, P - 1 do send[p + 1] = sum(seg, p * El + 1, (p + 1) * El) end
  for el = 1, El do lc[el] = 0 end
  -- the received rows come in P El segments (source s, then local expert el):
  -- their starts, for the local expert of each row below
  local starts, nrecv = {}, 0
  for s = 0, P - 1 do
    local base = s * E + q * El
    recv[s + 1] = sum(g, base + 1, base + El)
    for el = 1, El do
      local n = g[base + el]
      lc[el] = lc[el] + n
      starts[#starts + 1] = nrecv
      nrecv = nrecv + n
    end
  end
  -- 3. the rows to their experts' ranks
  local xs = moe.ops.permute(x2, plan) -- (R, d)
  local xr = dist.functional.all_to_all(xs, send, recv, group) -- (nrecv, d)
  -- 4. the local experts over the received rows
  local lo = {}
  if layer.mlp_impl == "sparse" then lo = { block_size = layer.block_size, ffn_hidden = layer:ffn_local() } end
  lo.known_counts = lc
  -- row r's segment is the last one starting at or before r (empty segments
  -- share their start with the next one, so they are never the last): the
  -- count of starts <= r, minus one; its local expert is that index mod El.
  -- On the device, without a loop over the rows: (nrecv, P El) comparisons.
  local dev = x2.device
  local st = moe.tensor(starts, { dtype = "i64", device = dev }):reshape({ 1, P * El })
  local seg_el = {}
  for i = 0, P * El - 1 do seg_el[i + 1] = i % El end
  local lids
  if nrecv > 0 then
    local r = moe.arange(0, nrecv, 1, { dtype = "i64", device = dev }):reshape({ nrecv, 1 })
    local si = moe.sum(moe.ge(r, st), 1) - 1
    lids = moe.index_select(moe.tensor(seg_el, { dtype = "i64", device = dev }), 0, si):reshape({ nrecv, 1 })
  else
    lids = moe.zeros({ 0, 1 }, { dtype = "i64", device = dev })
  end
  local lplan = moe.ops.routing_plan(lids, El, lo)
  local ye = layer.experts(xr, lplan, nil) -- (nrecv, d), received order
  -- 5. back to the sources, and the gated sum of each token's rows
  local yb = dist.functional.all_to_all(ye, recv, send, group) -- (R, d)
  local y = moe.ops.combine(yb, plan, gates)
  moe.pass_up(lplan)
  -- for tests: the plans, the splits and every rank's segments (P E: rank s, expert e at s E + e + 1)
  rawset(layer, "ep_last", { plan = plan, local_plan = lplan, send = send, recv = recv, segments = g })
  return y, plan
end

return M
