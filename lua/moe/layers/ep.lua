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

Chunks. With ep_overlap_chunks = C > 1 (layer.ep.chunks, at most El) steps
3 to 5 run in C chunks of local experts, each chunk's exchange overlapping
the other chunks' experts, forward and backward, with results bit for bit
those of one exchange: route_tokens_chunked below. layer.ep.trace = {}
makes the pipeline list its steps there (tests).

Gradients. The expert weight gradient on its owner is the sum over the
group's ranks of the gradients of their own losses. When each rank's loss
is a mean over its own tokens and the job's loss is the mean over ranks, the
expert gradients must be divided by P (and averaged over the ranks holding
the same experts, when there are several such groups): moe.train does it
(moe/train/parallel.lua); ep.expert_params(model) lists the tensors.
]]
local moe = require "moe"

local M = {}

--- The number of chunks of the pipelined exchange for layers built without
--- ep_overlap_chunks (route_tokens_chunked); 1: one exchange each way.
M.default_chunks = 1

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
  local C = o.ep_overlap_chunks
  if C == nil then C = M.default_chunks end
  if math.type(C) ~= "integer" or C < 1 then
    fail(name, "ep_overlap_chunks must be a positive integer (1: no chunks), got " .. tostring(C), level)
  end
  layer.ep = { group = group, size = P, rank = q, local_experts = El, expert_begin = q * El,
    expert_end = (q + 1) * El, chunks = math.min(C, El) }
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

-- Row r of a buffer of segments (starts: 0-based, one per segment, in
-- order; nseg of them) belongs to the last segment starting at or before r
-- (empty segments share their start with the next one, so they are never
-- the last): the count of starts <= r, minus one; its local expert is that
-- index mod per. On the device, without a loop over the rows: (n, nseg)
-- comparisons. -> (n, 1) i64.
local function segment_ids(starts, per, n, dev)
  local nseg = #starts
  if n == 0 then return moe.zeros({ 0, 1 }, { dtype = "i64", device = dev }) end
  local st = moe.tensor(starts, { dtype = "i64", device = dev }):reshape({ 1, nseg })
  local seg_el = {}
  for i = 0, nseg - 1 do seg_el[i + 1] = i % per end
  local r = moe.arange(0, n, 1, { dtype = "i64", device = dev }):reshape({ n, 1 })
  local si = moe.sum(moe.ge(r, st), 1) - 1
  return moe.index_select(moe.tensor(seg_el, { dtype = "i64", device = dev }), 0, si):reshape({ n, 1 })
end

-- Options of the plan over this rank's local experts (impl sparse: padded).
local function local_opts(layer, counts)
  local lo = {}
  if layer.mlp_impl == "sparse" then lo = { block_size = layer.block_size, ffn_hidden = layer:ffn_local() } end
  lo.known_counts = counts
  return lo
end

-- The first plan over all E experts: capacity plans keep block_size (C
-- rounded as one process rounds it), dropless plans are unpadded here (the
-- local plan pads for impl sparse). ids may be remapped (chunks). -> plan,
-- capacity (bool).
local function global_plan(layer, ids, gates, E)
  local o = layer:plan_opts(gates)
  local capacity = o.capacity_factor ~= nil
  if not capacity then o = { counts_to_host = true } end
  o.ffn_hidden = nil
  return moe.ops.routing_plan(ids, E, o), capacity
end

-- Every rank's segments (P E: rank s, expert e at s E + e + 1) from this
-- rank's seg (E): one all_gather of E integers on a CPU tensor (MPI on the
-- host: no device synchronisation).
local function gather_segments(group, seg, P, E)
  local dist = moe.dist
  local mine = moe.tensor(seg, { dtype = "i64" })
  local all = moe.empty({ P * E }, { dtype = "i64" })
  dist.all_gather(all, mine, { group = group })
  local g = all:totable()
  mine:free()
  all:free()
  return g
end

--- route_tokens(layer, x2 (T, d), ids (T, k), gates (T, k)) -> y (T, d), plan.
function M.route_tokens(layer, x2, ids, gates)
  if layer.ep.chunks > 1 then return M.route_tokens_chunked(layer, x2, ids, gates) end
  local ep = layer.ep
  local group, P, q, El = ep.group, ep.size, ep.rank, ep.local_experts
  local E = layer.num_experts
  local dist = moe.dist
  -- 1. this rank's plan over all E experts
  local plan, capacity = global_plan(layer, ids, gates, E)
  local seg
  if capacity then
    seg = {}
    for e = 1, E do seg[e] = plan.capacity end
  else
    seg = plan:counts_to_host() -- the one host synchronisation
  end
  -- 2. the segments of every rank
  local g = gather_segments(group, seg, P, E)
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
  local lids = segment_ids(starts, El, nrecv, x2.device)
  local lplan = moe.ops.routing_plan(lids, El, local_opts(layer, lc))
  local ye = layer.experts(xr, lplan, nil) -- (nrecv, d), received order
  -- 5. back to the sources, and the gated sum of each token's rows
  local yb = dist.functional.all_to_all(ye, recv, send, group) -- (R, d)
  local y = moe.ops.combine(yb, plan, gates)
  moe.pass_up(lplan)
  -- for tests: the plans, the splits and every rank's segments (P E: rank s, expert e at s E + e + 1)
  rawset(layer, "ep_last", { plan = plan, local_plan = lplan, send = send, recv = recv, segments = g })
  return y, plan
end

-- ------------------------------------------------------------ chunks

--[[
Chunked, pipelined exchange (layer.ep.chunks = C > 1; the layer option
ep_overlap_chunks). The El local experts are cut into C runs of consecutive
experts, chunk c holding local experts [b_c, b_{c+1}) (b_c = (c - 1) El // C)
of every rank. The rows of chunk c are everything routed to those experts
of any rank, so an expert's rows are all in one chunk, in the order C = 1
gives them: every expert sees the same rows in the same order, and each
chunk's experts run as a grouped GEMM of their own.

  1. The ids are renumbered (one index_select of a table of E entries) so
     that the first plan sorts its rows by chunk, then destination rank, then
     local expert: expert p El + el, el in chunk c, becomes
     P b_c + p (b_{c+1} - b_c) + (el - b_c). Chunk c's rows for every rank
     are then one run of the permuted buffer, ready for an all_to_all.
     Counts, the one host synchronisation and the all_gather of the
     segments are as for C = 1 (in the experts' own numbering).
  2. dist.functional.chunked_all_to_all starts every chunk's exchange at
     once; for c = 1..C: wait for chunk c, run its experts (w1, w3, w2 cut to
     the chunk's experts by one moe.Function whose backward concatenates
     the chunks' gradients, so no chunk writes zeros for the others'), start
     chunk c's return. While chunk c's experts run, chunk c + 1 .. C are on
     the wire (GPU: the communication stream), and chunk c - 1's return.
  3. Backward: the returns' reverse exchanges all start at once (last chunk
     first), then chunk C's experts' backward runs as soon as its gradient
     is back, then its reverse dispatch starts while chunk C - 1's experts'
     backward runs, and so on.
The plan handed to the caller is a table whose counts (and kept, for a
capacity plan) are in the experts' own order (stats.expert_counts).
]]

-- Chunk bounds, the renumbering (0-based new id of each expert, a host list
-- and a device tensor) for (P, El, C) on dev, cached in the layer's ep.
local function chunk_layout(ep, dev)
  local P, El, C = ep.size, ep.local_experts, ep.chunks
  local lay = ep.layout
  if lay and lay.device == dev then return lay end
  local b = {}
  for c = 1, C + 1 do b[c] = (c - 1) * El // C end
  local new = {}
  for p = 0, P - 1 do
    for c = 1, C do
      local n = b[c + 1] - b[c]
      for el = b[c], b[c + 1] - 1 do new[p * El + el + 1] = P * b[c] + p * n + (el - b[c]) end
    end
  end
  lay = { device = dev, bounds = b, new = new,
    remap = moe.keep(moe.tensor(new, { dtype = "i64", device = dev })) }
  ep.layout = lay
  return lay
end

-- The experts' weights cut along dim 0 into parts (lists {start, length});
-- backward concatenates the parts' gradients (zeros for a part that got
-- none). At most 4 parts per node (moe.Function's outputs).
local SLICES = moe.Function {
  name = "ep.expert_slices",
  forward = function(ctx, w, parts)
    ctx.parts, ctx.shape, ctx.dtype, ctx.device = parts, w.shape, w.dtype, w.device
    local out = {}
    for i, pt in ipairs(parts) do out[i] = w:narrow(0, pt[1], pt[2]) end
    return table.unpack(out)
  end,
  backward = function(ctx, ...)
    local gs, pieces, made = { ... }, {}, {}
    for i, pt in ipairs(ctx.parts) do
      local g = gs[i]
      if g == nil then
        local shape = { pt[2] }
        for j = 2, #ctx.shape do shape[j] = ctx.shape[j] end
        g = moe.zeros(shape, { dtype = ctx.dtype, device = ctx.device })
        made[#made + 1] = g
      end
      pieces[i] = g
    end
    local out = #pieces == 1 and (#made == 0 and pieces[1] or pieces[1]:clone()) or moe.cat(pieces, 0)
    for _, t in ipairs(made) do t:free() end
    return out
  end,
}

-- w cut into the parts (a list of {start, length}, in order, covering w's
-- rows): a list of views, through SLICES nodes (a tree when more than 4).
local function slices(w, parts)
  if #parts <= 4 then return { SLICES(w, parts) } end
  local groups, per = {}, (#parts + 3) // 4
  for i = 1, #parts, per do
    local g = {}
    for j = i, math.min(i + per - 1, #parts) do g[#g + 1] = parts[j] end
    groups[#groups + 1] = g
  end
  local spans = {}
  for i, g in ipairs(groups) do
    local last = g[#g]
    spans[i] = { g[1][1], last[1] + last[2] - g[1][1] }
  end
  local outer, out = { SLICES(w, spans) }, {}
  for i, g in ipairs(groups) do
    local rebased = {}
    for j, pt in ipairs(g) do rebased[j] = { pt[1] - spans[i][1], pt[2] } end
    for _, v in ipairs(slices(outer[i], rebased)) do out[#out + 1] = v end
  end
  return out
end

-- The experts module seen through chunk c's weights: calling it runs the
-- module's forward (in its scope, as m(x) does) on those.
local function chunk_experts(ex, cut, c, n)
  local view = { num_experts = n }
  for name, parts in pairs(cut) do view[name] = parts[c] end
  return setmetatable(view, { __index = ex, __call = getmetatable(ex).__call })
end

--- exchange_chunked(layer, xs (R, d), ex) -> yb (R, d): the pipelined part
--- of route_tokens_chunked (bench/ep_overlap.lua times it alone). xs: the
--- permuted rows, by chunk, destination rank, local expert; ex.chunks[c] =
--- {send =, recv =, rows =}, ex.bounds (C + 1 local expert bounds), and
--- either ex.local_plans (one per chunk) or ex.local_counts and ex.starts
--- (the plans are then built after the exchanges have started, and stored
--- in ex.local_plans). yb: each row's expert output, back in xs's order.
function M.exchange_chunked(layer, xs, ex)
  local ep = layer.ep
  local b, chunks, C = ex.bounds, ex.chunks, #ex.chunks
  -- every chunk's rows on their way, then the local plans (no synchronisation)
  local pipe = moe.dist.functional.chunked_all_to_all(chunks, ep.group, { trace = ep.trace })
  pipe:scatter(xs)
  if ex.local_plans == nil then
    local lplans = {}
    for c = 1, C do
      local n = b[c + 1] - b[c]
      lplans[c] = moe.ops.routing_plan(segment_ids(ex.starts[c], n, chunks[c].rows, xs.device), n,
        local_opts(layer, ex.local_counts[c]))
    end
    ex.local_plans = lplans
  end
  local experts, cut, parts = layer.experts, {}, {}
  for c = 1, C do parts[c] = { b[c], b[c + 1] - b[c] } end
  for _, name in ipairs({ "w1", "w3", "w2" }) do
    local w = rawget(experts, name)
    if w ~= nil then cut[name] = slices(w, parts) end
  end
  -- chunk by chunk: its experts while the others travel
  for c = 1, C do
    local xr = pipe:received(c) -- (rows_c, d)
    local view = chunk_experts(experts, cut, c, parts[c][2])
    local ye = view(xr, ex.local_plans[c], nil)
    if rawget(view, "path") ~= nil then experts.path = rawget(view, "path") end
    pipe:reply(c, ye)
  end
  return pipe:gathered()
end

--- route_tokens_chunked(layer, x2, ids, gates) -> y (T, d), plan: route_tokens
--- with layer.ep.chunks > 1 (above).
function M.route_tokens_chunked(layer, x2, ids, gates)
  local ep = layer.ep
  local group, P, q, El, C = ep.group, ep.size, ep.rank, ep.local_experts, ep.chunks
  local E = layer.num_experts
  local dev = x2.device
  local lay = chunk_layout(ep, dev)
  local b, new = lay.bounds, lay.new
  -- 1. the plan over the renumbered experts; the counts in the experts' own order
  local flat = ids:reshape({ -1 })
  if flat.dtype ~= "i64" then flat = flat:to({ dtype = "i64" }) end
  local rids = moe.index_select(lay.remap, 0, flat):reshape(ids.shape)
  local plan, capacity = global_plan(layer, rids, gates, E)
  local seg = {}
  if capacity then
    for e = 1, E do seg[e] = plan.capacity end
  else
    local sn = plan:counts_to_host() -- the one host synchronisation
    for e = 1, E do seg[e] = sn[new[e] + 1] end
  end
  local g = gather_segments(group, seg, P, E)
  -- per chunk: the splits, the local counts and the segment starts of the received rows
  local chunks, lcs, starts = {}, {}, {}
  for c = 1, C do
    local b0, b1 = b[c], b[c + 1]
    local send, recv, lc, st, nrecv = {}, {}, {}, {}, 0
    for p = 0, P - 1 do send[p + 1] = sum(seg, p * El + b0 + 1, p * El + b1) end
    for j = 1, b1 - b0 do lc[j] = 0 end
    for s = 0, P - 1 do
      local base = s * E + q * El
      recv[s + 1] = sum(g, base + b0 + 1, base + b1)
      for j = 1, b1 - b0 do
        local n = g[base + b0 + j]
        lc[j] = lc[j] + n
        st[#st + 1] = nrecv
        nrecv = nrecv + n
      end
    end
    chunks[c], lcs[c], starts[c] = { send = send, recv = recv, rows = nrecv }, lc, st
  end
  -- 2. and 3.: the pipelined exchange and experts
  local xs = moe.ops.permute(x2, plan) -- (R, d): chunk, destination rank, local expert
  local ex = { chunks = chunks, bounds = b, local_counts = lcs, starts = starts }
  local yb = M.exchange_chunked(layer, xs, ex) -- (R, d)
  local lplans = ex.local_plans
  local y = moe.ops.combine(yb, plan, gates)
  moe.pass_up(plan)
  for c = 1, C do moe.pass_up(lplans[c]) end
  -- the caller's view of the plan: counts (and kept) per expert in the experts' own order
  local view = { host_syncs = plan.host_syncs, T = plan.T, k = plan.k, E = plan.E, capacity = plan.capacity,
    rows = plan.rows, plan = plan }
  view.counts = moe.index_select(plan.counts, 0, lay.remap)
  if capacity then view.kept = moe.index_select(plan.kept, 0, lay.remap) end
  rawset(layer, "ep_last", { plan = plan, local_plans = lplans, chunks = chunks, segments = g,
    bounds = b, exchange = ex })
  return y, view
end

return M
