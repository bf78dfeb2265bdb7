--[[
tests/dist/ep_train.lua - expert parallelism and expert-tensor sharding in
moe.train (parallel.ep, parallel.etp) against single-process training, on
the CPU, under

  moe-lua launch -n 2 tests/dist/ep_train.lua [steps=15] [verbose=true] [device=cpu|cuda]
  moe-lua launch -n 4 tests/dist/ep_train.lua      (ep = 2: two replicas of each shard)

A small GPT whose feed-forward layers are dMoEs (8 experts, top 2) trains
`steps` steps with parallel = {ep = 2} on W ranks (micro-batch B each; with
W = 4 the mesh is {dp = 2, ep = 2}) and, on every rank alone (parallel.dp =
1), with grad_accum = W micro-batches of B: the same global batch, the same
loss, and the gradient rule of docs/DISTRIBUTED.md "Expert parallelism"
(non-expert gradients averaged over the world, an expert shard's gradient
averaged over its replicas and divided by ep). The same with parallel.etp = 2
(every expert's hidden units split over 2 ranks; SGD only) and, on 4 ranks,
with ep = 2 x etp = 2; and with the other parameters' optimizer state and
gradients sharded (parallel.dp_shard, AdamW): ep = 2 x dp_shard = 2 on 2
ranks, ep = 2 x etp = 2 x dp_shard = 2 x dp_replicate = 2 on 4. Then:
  losses      the job's logged loss at every step against the reference's,
              relative 1e-5
  parameters  every rank's non-expert parameters and its expert shard against
              the reference's (the rows of its experts), relative 1e-4 of the
              largest value of the tensor
Not bit for bit: an expert's gradient is one grouped GEMM over the rows of
every rank (the reference: one per micro-batch, added), and the clipping norm
sums the shards' squares in f64 (the reference: one f32 norm of the norms);
rounding differences that Adam carries on. The measured differences are
printed.
]]
local moe = require "moe"
local train = require "moe.train"

local opts = moe.config { steps = 15, verbose = false, device = "cpu" }
local dist = moe.dist
dist.init { timeout = 300 }
local rank, world = dist.rank(), dist.world_size()
assert(world == 2 or world == 4, ("run under moe-lua launch -n 2 or -n 4 (world size %d)"):format(world))

local function say(...) if rank == 0 then print(string.format(...)) end end

-- each rank its own copy of the data (same bytes)
local root, prefix = dofile(arg[0]:match("^(.*/)") .. "trainkit.lua").corpus(rank)

local B = 4
local function cfg(name, over)
  local c = {
    model = { vocab_size = 257, d_model = 32, n_layers = 2, n_heads = 2, ffn = "moe", d_ff = 64,
      tie_embeddings = false,
      moe = { num_experts = 8, top_k = 2, ffn_hidden_size = 32, loss_weight = 0.01 } },
    data = prefix, valid_fraction = 0.1, seq_len = 16, batch_size = B, grad_accum = 1,
    steps = opts.steps, lr = 3e-3, min_lr = 3e-4, warmup = 2, clip = 1.0, eval_every = 5,
    eval_iters = 2, log_every = 1, save_every = 0, keep_last = 0, tensorboard = false,
    sample_tokens = 0, quiet = not opts.verbose, deterministic = true, device = opts.device, seed = 7,
    out_dir = root .. "/" .. name,
  }
  for k, v in pairs(over) do c[k] = v end
  return c
end

-- One comparison: the reference (this rank alone, grad_accum = world) and
-- parallel.ep = 2, with the optimizer given. Validation runs through the EP
-- layers too (its batches differ from the reference's: not compared).
local refs = {} -- the reference of each optimizer, once
local function compare(optimizer, layout)
  layout = layout or { ep = 2 }
  local lname = ("ep=%d etp=%d"):format(layout.ep or 1, layout.etp or 1)
  if layout.dp_shard then lname = lname .. (" dp_shard=%d"):format(layout.dp_shard) end
  if layout.dp_replicate then lname = lname .. (" dp_replicate=%d"):format(layout.dp_replicate) end
  local over = { optimizer = optimizer, lr = optimizer == "sgd" and 0.1 or 3e-3 }
  local function with(t) for k, v in pairs(over) do t[k] = v end return t end
  refs[optimizer] = refs[optimizer] or
    train.run(cfg(optimizer .. "-ref", with { grad_accum = world, parallel = { dp = 1 } }))
  local ref = refs[optimizer]
  local ep = train.run(cfg(optimizer .. "-" .. lname:gsub("[ =]", ""), with { parallel = layout }))
  local worst = 0
  for s = 1, opts.steps do
    local a, b = ep.losses[s], ref.losses[s]
    local d = math.abs(a - b) / math.abs(b)
    if d > worst then worst = d end
    assert(d <= 1e-5, ("rank %d, %s, step %d: ep loss %.9g, reference %.9g"):format(rank, optimizer, s, a, b))
  end
  -- parameters: the non-expert ones whole, the experts' rows (hidden units) of this rank's shard
  local E, F = 8, 32
  local q, El, w, Fl = 0, E, 0, F
  for _, m in ipairs(ep.model:modules()) do
    local e, h = rawget(m, "ep"), rawget(m, "wp")
    if type(e) == "table" and e.group then q, El = e.rank, e.local_experts end
    if type(h) == "table" and h.group then w, Fl = h.rank, h.ffn_local end
  end
  assert(El == E // (layout.ep or 1) and Fl == F // (layout.etp or 1), lname .. ": the layers' shards")
  local rp = {}
  for _, np in ipairs(ref.model:named_parameters()) do rp[np[1]] = np[2] end
  local pworst, n_expert = 0, 0
  for _, np in ipairs(ep.model:named_parameters()) do
    local name, got = np[1], np[2]:cpu() -- the reference of every rank trained on cuda:0
    local want = rp[name]
    assert(want, "no reference parameter " .. name)
    want = want:cpu()
    if name:match("%.experts%.w%d$") then
      want = want:narrow(0, q * El, El):narrow(name:match("w2$") and 1 or 2, w * Fl, Fl)
      n_expert = n_expert + 1
    end
    assert(table.concat(got.shape, ",") == table.concat(want.shape, ","), name .. ": shapes differ")
    local scale = want:abs():max():item()
    local d = (got - want):abs():max():item() / math.max(scale, 1e-30)
    if d > pworst then pworst = d end
    assert(d <= 1e-4, ("rank %d: parameter %s differs by %.3g of its largest value"):format(rank, name, d))
  end
  assert(n_expert > 0, "no expert parameter found")
  say("ok   ep_train: %s, parallel %s on %d ranks == grad_accum=%d alone, %d steps: losses within %.2e "
    .. "(relative), parameters %.2e of their largest value (rank 0)", optimizer, lname, world, world,
    opts.steps, worst, pworst)
end
compare("adamw") -- Adam is nearly blind to a constant factor in a gradient: clipping sees it
compare("sgd")   -- SGD is not: a wrong expert-gradient scale shows at once
compare("sgd", { etp = 2 })
if world == 4 then compare("sgd", { ep = 2, etp = 2 }) end
-- with sharded data parallelism (ZeRO-2, HSDP) over the non-expert parameters
if world == 2 then compare("adamw", { ep = 2, dp_shard = 2 }) end
if world == 4 then compare("adamw", { ep = 2, etp = 2, dp_shard = 2, dp_replicate = 2 }) end
os.execute("rm -rf '" .. root .. "'")
