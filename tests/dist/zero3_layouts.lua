--[[
tests/dist/zero3_layouts.lua - parameter sharding (parallel.shard_params,
ZeRO-3) combined with the other dims, against single-process training, on
the CPU (in CI) or on GPUs:

  moe-lua launch -n 2 tests/dist/zero3_layouts.lua [steps=10] [verbose=true] [device=cpu|cuda]
  moe-lua launch -n 4 tests/dist/zero3_layouts.lua

device=cuda: each rank on cuda:<local rank>, collectives through NCCL (one
GPU per rank; bench/dist_round.sh layouts2 runs it on two GPUs, so the
2-rank cases; the 4-rank ones, HSDP 2 x 2 among them, run on the CPU, or
on GPUs with -n 4 on a machine of four). The references train on cuda:0.
The cases that ran are printed.

Layouts (W ranks; the reference is every rank alone, parallel.dp = 1, with
grad_accum = W micro-batches of the same size: the same global batch):
  2 ranks  ep = 2 x dp_shard = 2, shard_params (the dense parameters in
           units sharded over dp_shard, the experts sharded by ep);
           etp = 2 x dp_shard = 2, shard_params (every expert's hidden
           units split over 2 ranks)
  4 ranks  dp_replicate = 2 x dp_shard = 2, shard_params (HSDP with
           parameter sharding);
           ep = 2 x dp_shard = 2 x dp_replicate = 2, shard_params (experts
           sharded by ep and, each MoE layer's experts a unit, by the 2
           data-parallel ranks left)
Checked: the job's logged loss at every step within 1e-5 relative of the
reference's, and every parameter (gathered through the model's state dict;
an expert stack: this rank's experts and hidden units) within 1e-4 of its largest value after
`steps` AdamW steps with clipping at 1.0. Not bit for bit: the reference
adds W micro-batch gradients one at a time, the job reduces them in MPI's
order, an expert's gradient is one GEMM over every rank's rows, and the
clipping norm is summed per shard in f64; Adam carries those roundings on
(about 1e-7 relative per step at these sizes). The measured differences are
printed.
]]
local moe = require "moe"
local train = require "moe.train"

local opts = moe.config { steps = 10, verbose = false, device = "cpu" }
local dist = moe.dist
dist.init { timeout = 300 }
local rank, world = dist.rank(), dist.world_size()
assert(world == 2 or world == 4, ("run under moe-lua launch -n 2 or -n 4 (world size %d)"):format(world))
local function say(...) if rank == 0 then print(string.format(...)) end end

local K = dofile(arg[0]:match("^(.*/)") .. "trainkit.lua")
K.check_device(opts.device, "zero3_layouts")
local root, prefix = K.corpus(rank)
local E, F = 4, 32 -- trainkit's dMoE: 4 experts of 32 hidden units

local failures = 0
local function expect(ok, msg)
  if not ok then
    failures = failures + 1
    io.stderr:write(("[rank %d] FAILED: %s\n"):format(rank, msg))
  end
end

local refs, ran = {}, {}
local function compare(ffn, layout)
  local parts = {}
  for _, k in ipairs({ "dp_replicate", "dp_shard", "ep", "etp" }) do
    if layout[k] then parts[#parts + 1] = ("%s=%d"):format(k, layout[k]) end
  end
  local lname = table.concat(parts, " x ")
  local o = { steps = opts.steps, loss_weight = 0.01, device = opts.device, verbose = opts.verbose }
  local model = { tie_embeddings = false }
  local key = ffn
  refs[key] = refs[key] or train.run(K.base_cfg(o, root, prefix, "ref-" .. key, ffn,
    { grad_accum = world, parallel = { dp = 1 }, model = model }))
  local ref = refs[key]
  layout.shard_params = true
  local whole, units, eunits = 0, 0, 0
  local z = train.run(K.base_cfg(o, root, prefix, "z3-" .. key .. lname:gsub("[ =x]", ""), ffn,
    { parallel = layout, model = model }), { hooks = { after_step = function(state)
      local sh = state.parallel.fsdp
      units = sh and sh:stats().units or 0
      for _, u in pairs(sh and sh.units or {}) do if u.unit:ready() then whole = whole + 1 end end
      local ex = state.parallel.expert_fsdp
      eunits = ex and #ex.units or 0
      for _, u in ipairs(ex and ex.units or {}) do if u.unit:ready() then whole = whole + 1 end end
    end } })
  -- the units: the 2 blocks and the root, none whole between steps; with data-parallel ranks
  -- left over by ep x etp, each MoE layer's experts too
  local left = world // ((layout.ep or 1) * (layout.etp or 1))
  local want_e = (layout.ep or layout.etp) and left > 1 and 2 or 0
  expect(units == 3 and eunits == want_e and whole == 0, ("%s: %d units, %d expert units (%d expected), %d " ..
    "whole after a step"):format(lname, units, eunits, want_e, whole))
  local lworst = K.max_rel(z.losses, ref.losses, opts.steps)
  -- parameters: the state dict gathers every unit; an expert stack holds this rank's rows
  local q, El, w, Fl = 0, E, 0, F
  for _, m in ipairs(z.model:modules()) do
    local e, h = rawget(m, "ep"), rawget(m, "wp")
    if type(e) == "table" and e.group then q, El = e.rank, e.local_experts end
    if type(h) == "table" and h.group then w, Fl = h.rank, h.ffn_local end
  end
  local sd, pworst, n = z.model:state_dict(), 0, 0
  for _, np in ipairs(ref.model:named_parameters()) do
    local name, want = np[1], np[2]
    local got = sd[name]
    want = want:cpu() -- on a GPU: the reference on cuda:0, this rank's on its own
    if got == nil then
      expect(false, ("%s: no parameter %s"):format(lname, name))
    else
      if name:match("%.experts%.w%d$") then
        want = want:narrow(0, q * El, El):narrow(name:match("w2$") and 1 or 2, w * Fl, Fl)
      end
      got = got:cpu()
      local d = (got - want):abs():max():item() / math.max(want:abs():max():item(), 1e-30)
      pworst = math.max(pworst, d)
      n = n + 1
      expect(d <= 1e-4, ("%s %s: parameter %s differs by %.3g of its largest value"):format(ffn, lname, name, d))
    end
  end
  expect(lworst <= 1e-5, ("%s %s: losses differ by %.3g (relative)"):format(ffn, lname, lworst))
  local agg = moe.tensor({ lworst, pworst }, { dtype = "f64" })
  dist.all_reduce(agg, "max")
  local a = agg:totable()
  say("%s %s, shard_params on %d ranks == grad_accum=%d alone, %d steps: losses within %.2e (relative), " ..
    "%d parameters within %.2e of their largest value (every rank)", ffn == "moe" and "dMoE" or "dense GPT",
    lname, world, world, opts.steps, a[1], n, a[2])
  if opts.verbose then
    for s = 1, opts.steps do say("  step %2d  zero3 %.9f  ref %.9f", s, z.losses[s], ref.losses[s]) end
  end
  dist.barrier()
  ran[#ran + 1] = lname
end

if world == 2 then
  compare("moe", { ep = 2, dp_shard = 2 })
  compare("moe", { etp = 2, dp_shard = 2 })
else
  compare("moe", { dp_replicate = 2, dp_shard = 2 })
  compare("moe", { ep = 2, dp_shard = 2, dp_replicate = 2 })
end

os.execute("rm -rf '" .. root .. "'")
local bad = moe.tensor({ failures }, { dtype = "f64" })
dist.all_reduce(bad, "max")
if bad:item() > 0 then error(("zero3_layouts: %d check(s) failed"):format(math.tointeger(bad:item())), 0) end
say("zero3_layouts: ok (%s, %d ranks: %s)", opts.device, world, table.concat(ran, "; "))
