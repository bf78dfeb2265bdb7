--[[
tests/dist/ep_overlap.lua - the chunked, pipelined expert-parallel exchange
(moe/layers/ep.lua route_tokens_chunked, dist.functional.chunked_all_to_all):

  moe-lua launch -n 2 tests/dist/ep_overlap.lua      (and -n 4)

1. The pipeline alone against dist.functional.all_to_all: every chunk's rows,
   the gathered replies and the input's gradient (a loss on both the chunks
   and the replies), exactly; replies given out of order; chunks with no
   rows; the errors of a pipeline used wrongly.
2. The dMoE / MoE layer with ep_overlap_chunks = 2, 3, 4 (and more chunks
   than local experts: clamped) against the same layer with 1 (one exchange
   each way): the output, the input's, the router's and every expert weight's
   gradient BIT FOR BIT (compared with ==), the aux loss, the stats' expert
   counts, and still one host synchronisation per dropless layer. Bit for bit
   because chunks cut the local experts, never an expert's rows: each expert
   gets the same rows in the same order and runs the same GEMMs; a token's k
   rows are summed in the order of its choices whatever the row order (the
   combine and permute's backward); the expert weight gradients of the
   chunks are concatenated, not summed. Routing is made uneven by a router
   that bans experts per rank: some chunks receive no row on some ranks,
   one case bans a whole chunk on every rank, one starves a rank.
3. The schedule of the pipeline (the order of its starts and waits), a
   forward without a graph, and train with parallel.ep_chunks: 4 steps with
   the same losses and parameters bit for bit as without chunks (2 ranks).
]]
local moe = require "moe"
local layers = require "moe.layers"
local T = dofile(arg[0]:match("^(.*/)") .. "common.lua")
local dist = T.dist
dist.init { timeout = 120 }
assert(T.size >= 2, "run with moe-lua launch -n 2 (or 4)")
local F = dist.functional
local P, me = T.size, T.rank

-- ------------------------------------------------ 1. the pipeline alone

-- chunk c of rank r sends n(r, j, c) rows to rank j (0 for some)
local function rows(r, j, c) return (r + 2 * j + c) % 3 end
local C = 3
local chunks = {}
local total = 0
for c = 1, C do
  local send, recv = {}, {}
  for j = 0, P - 1 do
    send[j + 1] = rows(me, j, c)
    recv[j + 1] = rows(j, me, c)
    total = total + send[j + 1]
  end
  chunks[c] = { send = send, recv = recv }
end
local W = 3
local function input(extra)
  return T.make({ total + extra, W }, "f64", function(i) return me * 1000 + i end):requires_grad_(true)
end
-- the reference: one all_to_all per chunk with plain functional calls
local function reference(x)
  local outs, backs, off = {}, {}, 0
  for c = 1, C do
    local n = 0
    for _, v in ipairs(chunks[c].send) do n = n + v end
    local piece = x:narrow(0, off, n)
    off = off + n
    outs[c] = F.all_to_all(piece, chunks[c].send, chunks[c].recv)
    backs[c] = F.all_to_all(outs[c] * (c + 1), chunks[c].recv, chunks[c].send)
  end
  return outs, moe.cat(backs, 0)
end
local function loss(outs, y)
  local l = (y * y):sum()
  for c, o in ipairs(outs) do l = l + (o * (0.5 * c)):sum() end
  return l
end
moe.scope(function()
  local xa, xb = input(2), input(2)
  local ra, ya = reference(xa)
  loss(ra, ya):backward()
  local p = F.chunked_all_to_all(chunks)
  p:scatter(xb)
  local rb = {}
  for c = 1, C do rb[c] = p:received(c) end
  -- replies out of order: held until the earlier ones are given
  for _, c in ipairs({ 2, 3, 1 }) do p:reply(c, rb[c] * (c + 1)) end
  local yb = p:gathered()
  T.check(yb.shape[1] == total, "gathered has %d rows, wanted %d", yb.shape[1], total)
  loss(rb, yb):backward()
  for c = 1, C do T.same(rb[c], T.flat(ra[c]), 0, "received chunk " .. c) end
  T.same(yb, T.flat(ya), 0, "gathered")
  T.same(xb.grad, T.flat(xa.grad), 0, "the input's gradient (rows past the sends: zero)")
  local tail = T.flat(xb.grad:narrow(0, total, 2))
  for i = 1, #tail do T.check(tail[i] == 0, "gradient of a row past the sends: %g", tail[i]) end
end)
T.ok("chunked_all_to_all: chunks, replies out of order and gradients equal plain all_to_alls")

-- only some chunks get a gradient: the others go back as zeros, in order
moe.scope(function()
  local x = input(0)
  local p = F.chunked_all_to_all(chunks)
  p:scatter(x)
  local r = {}
  for c = 1, C do r[c] = p:received(c) end
  ;(r[2] * 3):sum():backward()
  local xa = input(0)
  local ra = reference(xa)
  ;(ra[2] * 3):sum():backward()
  T.same(x.grad, T.flat(xa.grad), 0, "gradient through chunk 2 only")
end)
T.ok("chunked_all_to_all: chunks without a gradient")

T.raises(function() F.chunked_all_to_all({}) end, "chunks must be a non-empty list", "no chunks")
T.raises(function() F.chunked_all_to_all({ { send = { 1 }, recv = { 1 } } }) end,
  "chunks[1].send must be a list of " .. P .. " row counts", "short splits")
T.raises(function()
  local bad = { send = {}, recv = {} }
  for j = 1, P do bad.send[j], bad.recv[j] = 0, 0 end
  bad.recv[1] = -1
  F.chunked_all_to_all({ bad })
end, "chunks[1].recv[1] must be a non-negative integer", "negative split")
moe.scope(function()
  local p = F.chunked_all_to_all(chunks)
  T.raises(function() p:received(1) end, "received: call scatter(x) first", "received before scatter")
  T.raises(function() p:scatter(input(0):narrow(0, 0, total - 1 >= 0 and math.max(total - 1, 0) or 0)) end,
    "scatter: the chunks send", "x too short")
  T.raises(function() p:reply(C + 1, input(0)) end, "reply: chunk must be an integer in 1.." .. C, "chunk out of range")
  T.raises(function() p:reply(1, moe.zeros({ 99, W }, { dtype = "f64" })) end, "reply: chunk 1 must reply its",
    "reply of the wrong size")
  T.raises(function() p:gathered() end, "gathered: chunk 1 was never replied", "gathered too early")
end)
T.ok("chunked_all_to_all: errors")

-- ----------------------------------------------- 2. the layer, chunks vs none

local E, K, D, FF = 16, 2, 8, 8
local El = E // P
local MK = dofile(arg[0]:match("^(.*/)") .. "moekit.lua")(T, E, 0)
local Ban, ban_bias, loss_of = MK.Ban, MK.ban_bias, MK.loss_of

local function build(c, nchunks)
  moe.manual_seed(7)
  local router = Ban { d_model = D, num_experts = E, top_k = K, loss_weight = 0.01, std = 0.5, dtype = c.dtype }
  local o = { hidden_size = D, ffn_hidden_size = FF, num_experts = E, top_k = K, dtype = c.dtype,
    mlp_type = c.mlp_type, mlp_impl = c.impl, block_size = 4, router = router, init_std = 0.3,
    memory_optimized_mlp = c.memopt, moe_expert_model_parallelism = true, ep_overlap_chunks = nchunks }
  if c.capacity then o.capacity_factor, o.drop_policy = c.capacity, c.drop end
  return c.capacity and layers.MoE(o) or layers.dMoE(o)
end

local function data(w, dtype)
  moe.manual_seed(100 + w)
  local n = 9 + 3 * w
  local x = moe.randn({ n, D }):to("cpu", dtype)
  local cw = moe.randn({ n, D }):to("cpu", dtype)
  return x:requires_grad_(true), cw
end

-- what a run gives: flat lists of everything compared
local function run(c, nchunks)
  local layer = build(c, nchunks)
  local x, cw = data(me, c.dtype)
  local out = {}
  moe.scope(function()
    local l, y = loss_of(layer, x, cw, ban_bias(c.bans and c.bans(me) or nil))
    out.loss = T.flat(l:reshape({ 1 }))
    out.y = T.flat(y)
    l:backward()
    out.counts = T.flat(layer.stats.expert_counts)
    out.syncs = layer.ep_last.plan.host_syncs
    if c.capacity then out.kept = T.flat(layer.stats.expert_kept) end
  end)
  out.x = T.flat(x.grad)
  for _, np in ipairs(layer.router:named_parameters()) do out["router." .. np[1]] = T.flat(np[2].grad) end
  for _, np in ipairs(layer.experts:named_parameters()) do
    out["experts." .. np[1]] = np[2].grad and T.flat(np[2].grad) or "none"
  end
  out.chunks = layer.ep.chunks
  return out
end

local function identical(got, want, what)
  if type(want) ~= "table" then
    T.check(got == want, "%s: %s, wanted %s", what, tostring(got), tostring(want))
    return
  end
  T.check(type(got) == "table" and #got == #want, "%s: %s values, wanted %d", what,
    type(got) == "table" and #got or tostring(got), #want)
  for i = 1, #want do
    if got[i] ~= want[i] then T.fail("%s: value %d is %.17g, wanted %.17g (bit for bit)", what, i, got[i], want[i]) end
  end
end

-- source rank s bans the experts of chunk (s % 2) of rank (s + 1) % P, and expert s
local function uneven(s)
  local out, q = { s % E }, (s + 1) % P
  local half = El // 2
  for j = 0, half - 1 do out[#out + 1] = q * El + (s % 2) * half + j end
  return out
end
-- every rank bans the first two local experts of every rank (chunk 1 of 2, 4 is empty everywhere)
local function empty_chunk()
  local out = {}
  for q = 0, P - 1 do out[#out + 1] = q * El; out[#out + 1] = q * El + 1 end
  return out
end
-- every rank bans the last rank's experts (it receives no row)
local function starve()
  local out = {}
  for e = E - El, E - 1 do out[#out + 1] = e end
  return out
end

local cases = {
  { name = "dMoE grouped f32", impl = "grouped", dtype = "f32" },
  { name = "dMoE grouped f32 uneven", impl = "grouped", dtype = "f32", bans = uneven },
  { name = "dMoE grouped f64 empty chunk", impl = "grouped", dtype = "f64", bans = empty_chunk },
  { name = "dMoE grouped f32 starved", impl = "grouped", dtype = "f32", bans = starve },
  { name = "dMoE loop f32 uneven", impl = "loop", dtype = "f32", bans = uneven },
  { name = "dMoE sparse f32 uneven", impl = "sparse", dtype = "f32", bans = uneven },
  { name = "dMoE glu grouped f32 uneven", impl = "grouped", dtype = "f32", mlp_type = "glu", bans = uneven },
  { name = "dMoE glu grouped memory_optimized f32", impl = "grouped", dtype = "f32", mlp_type = "glu", memopt = true },
  { name = "dMoE grouped memory_optimized f32", impl = "grouped", dtype = "f32", memopt = true, bans = uneven },
  { name = "MoE capacity 1 grouped f32 uneven", impl = "grouped", dtype = "f32", capacity = 1.0, bans = uneven },
  { name = "MoE capacity 1 sparse f32", impl = "sparse", dtype = "f32", capacity = 1.0 },
  { name = "MoE capacity 0.75 score grouped f32 uneven", impl = "grouped", dtype = "f32", capacity = 0.75,
    drop = "score", bans = uneven },
}
local tried = { 2, 3, 4, El + 3 } -- El + 3: clamped to El (one expert per chunk)
for _, c in ipairs(cases) do
  local want = run(c, 1)
  T.check(want.chunks == 1, "%s: %d chunks with ep_overlap_chunks = 1", c.name, want.chunks)
  T.check(want.syncs == (c.capacity and 0 or 1), "%s: %d host syncs", c.name, want.syncs)
  for _, n in ipairs(tried) do
    local got = run(c, n)
    local what = string.format("%s, %d chunks", c.name, n)
    T.check(got.chunks == math.min(n, El), "%s: %d chunks, wanted %d", what, got.chunks, math.min(n, El))
    for k, v in pairs(want) do
      if k ~= "chunks" then identical(got[k], v, what .. ": " .. k) end
    end
  end
  T.ok("ep_overlap: " .. c.name .. ": chunks 2, 3, 4 and " .. (El + 3) .. " (clamped) bit for bit as 1")
end

-- an EP group smaller than the world: {dp, ep} mesh, EP over pairs
if T.size == 4 then
  local mesh = dist.mesh { { "dp", 2 }, { "ep", 2 } }
  local g = mesh:group("ep")
  local function run_g(n)
    moe.manual_seed(7)
    local router = Ban { d_model = D, num_experts = E, top_k = K, loss_weight = 0.01, std = 0.5, dtype = "f32" }
    local layer = layers.dMoE { hidden_size = D, ffn_hidden_size = FF, num_experts = E, top_k = K, dtype = "f32",
      router = router, init_std = 0.3, moe_expert_model_parallelism = true, expert_parallel_group = g,
      ep_overlap_chunks = n }
    local x, cw = data(me, "f32")
    local out = {}
    moe.scope(function()
      local l, y = loss_of(layer, x, cw, ban_bias(uneven(me)))
      out.y = T.flat(y)
      l:backward()
    end)
    out.x = T.flat(x.grad)
    out.w1 = T.flat(layer.experts.w1.grad)
    out.w2 = T.flat(layer.experts.w2.grad)
    return out
  end
  local want = run_g(1)
  for _, n in ipairs({ 2, 4 }) do
    local got = run_g(n)
    for k, v in pairs(want) do identical(got[k], v, "ep group of 2, " .. n .. " chunks: " .. k) end
  end
  T.ok("ep_overlap: an ep group of 2 in a {dp 2, ep 2} mesh, chunks 2 and 4 bit for bit as 1")
end

-- the schedule: every exchange started early, each chunk waited for just before its use (forward),
-- backward chunk by chunk from the last, each chunk's reverse dispatch started before the next
-- chunk's gradient is waited for (the experts' backward of chunk c runs between its two steps)
do
  local layer = build({ impl = "grouped", dtype = "f32" }, 3)
  local trace = {}
  layer.ep.trace = trace
  local x, cw = data(me, "f32")
  moe.scope(function()
    local l = loss_of(layer, x, cw, nil)
    l:backward()
  end)
  local want = { "scatter: start 1", "scatter: start 2", "scatter: start 3",
    "received: wait 1", "reply: start 1", "received: wait 2", "reply: start 2", "received: wait 3", "reply: start 3",
    "gathered: wait 1", "gathered: wait 2", "gathered: wait 3",
    "backward gathered: start 3", "backward gathered: start 2", "backward gathered: start 1",
    "backward reply: wait 3", "backward received: start 3", "backward reply: wait 2", "backward received: start 2",
    "backward reply: wait 1", "backward received: start 1",
    "backward scatter: wait 3", "backward scatter: wait 2", "backward scatter: wait 1" }
  T.check(table.concat(trace, ", ") == table.concat(want, ", "), "the schedule\n  %s\nwanted\n  %s",
    table.concat(trace, ", "), table.concat(want, ", "))
  T.ok("ep_overlap: the schedule of 3 chunks, forward and backward")
end

-- without a graph (evaluation): the same output
do
  local ys = {}
  for i, n in ipairs({ 1, 3 }) do
    local layer = build({ impl = "grouped", dtype = "f32" }, n)
    layer:eval()
    local x = data(me, "f32")
    moe.no_grad(function() moe.scope(function() ys[i] = T.flat(layer(x:detach())) end) end)
  end
  identical(ys[2], ys[1], "no_grad forward, 3 chunks")
  T.ok("ep_overlap: a forward without a graph, 3 chunks as 1")
end

-- train: parallel.ep_chunks reaches the layers, and 4 steps of training give the same losses
-- and parameters bit for bit as without chunks (2 ranks; ep = 2, 8 experts: 4 per rank)
if T.size == 2 then
  local train = require "moe.train"
  local root, prefix = dofile(arg[0]:match("^(.*/)") .. "trainkit.lua").corpus(me)
  local function tcfg(name, nchunks)
    return { model = { vocab_size = 257, d_model = 32, n_layers = 2, n_heads = 2, ffn = "moe", d_ff = 64,
        moe = { num_experts = 8, top_k = 2, ffn_hidden_size = 32, loss_weight = 0.01 } },
      data = prefix, valid_fraction = 0.1, seq_len = 16, batch_size = 4, grad_accum = 1, steps = 4, lr = 3e-3,
      min_lr = 3e-4, warmup = 2, clip = 1.0, eval_every = 0, log_every = 1, save_every = 0, keep_last = 0,
      tensorboard = false, sample_tokens = 0, quiet = true, deterministic = true, device = "cpu", seed = 7,
      out_dir = root .. "/" .. name, parallel = { ep = 2, ep_chunks = nchunks } }
  end
  local a, b = train.run(tcfg("one", 1)), train.run(tcfg("chunks", 4))
  local nrun = 0
  for _, m in ipairs(b.model:modules()) do
    local e = rawget(m, "ep")
    if type(e) == "table" and e.group then nrun = e.chunks end
  end
  T.check(nrun == 4, "parallel.ep_chunks = 4: the layers run %d chunks", nrun)
  identical(b.losses, a.losses, "train, 4 chunks: losses")
  local pa = {}
  for _, np in ipairs(a.model:named_parameters()) do pa[np[1]] = T.flat(np[2]) end
  for _, np in ipairs(b.model:named_parameters()) do identical(T.flat(np[2]), pa[np[1]], "train: " .. np[1]) end
  os.execute("rm -rf '" .. root .. "'")
  T.ok("ep_overlap: train with parallel.ep_chunks = 4, 4 steps bit for bit as 1")
end

-- a bad option
local ok, err = pcall(layers.dMoE, { hidden_size = D, ffn_hidden_size = FF, num_experts = E, top_k = 1,
  moe_expert_model_parallelism = true, ep_overlap_chunks = 0 })
T.check(not ok and tostring(err):find("ep_overlap_chunks must be a positive integer", 1, true),
  "ep_overlap_chunks = 0: %s", tostring(err))
T.ok("ep_overlap: ep_overlap_chunks = 0 is an error")
