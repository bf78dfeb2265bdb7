--[[
tests/dist/dp_equivalence.lua - data parallelism (moe.train's parallel.dp)
against single-process training, on the CPU, under

  moe-lua launch -n 2 tests/dist/dp_equivalence.lua [steps=20] [verbose=true] [loss_weight=0.01]
      [tie_embeddings=true] [device=cpu|cuda]

(device=cuda: each rank on cuda:<local rank>, gradients through NCCL.)

For a small dMoE and a small dense GPT, 20 steps with dp = 2 and micro-batch
B are compared, step by step (the lm loss), with two single-process runs made
inside rank 0 of the same job (parallel.dp = 1: moe.dist not involved) on the
same global batch of 2B:

  accum  grad_accum = 2 micro-batches of B. Must match to a relative 1e-6.
         Without tied embeddings it matches bit for bit, parameters included
         (checked on an untied dMoE): each micro-batch's backward runs from
         loss / 2, and halving commutes with every rounding, so accumulation's
         g0/2 + g1/2 and the ranks' all_reduce(avg) (g0 + g1) / 2 are the same
         floating-point numbers; rank r's rows are the reference's micro-batch
         r + 1, computed by the same kernels. With tied embeddings the shared
         weight gets two gradients per backward (embedding and head), which
         accumulation adds into .grad one by one, ((a + b)/2 + c/2) + d/2,
         where the ranks compute ((a + b) + (c + d)) / 2: 1-ulp differences in
         that weight, visible in the losses only at about 1e-7.
  whole  one micro-batch of 2B. Sums over the batch in another order (one
         mean over 2B rows instead of the mean of two means over B), so it
         matches only to rounding, which Adam amplifies over the steps; for
         the dMoE the load-balancing loss is a product of batch means (f_e *
         P_e), not a mean over sequences, so its gradient differs in value,
         not just in rounding, between one batch of 2B and two of B. The
         measured differences are printed; the bounds are loose.

Then the capacity-limited MoE (kind = "moe") and the dMoE with quantized
saved activations (its quantize = {inputs = 8, rematerialize = 8, scatter =
8} switches) train a few steps with dp = 2:
losses finite, and after every dp run the parameters are identical on both
ranks (max and min of a per-parameter checksum over ranks agree).
]]
local moe = require "moe"
local train = require "moe.train"

local opts = moe.config { steps = 20, verbose = false, loss_weight = 0.01, tie_embeddings = true,
  device = "cpu" }
local dist = moe.dist
dist.init()
local rank, world = dist.rank(), dist.world_size()
assert(world == 2, ("run under mpirun -n 2 (world size %d)"):format(world))

local function say(...) if rank == 0 then print(string.format(...)) end end

-- ------------------------------------------------------------ the data
-- each rank its own copy (same bytes): no rank reads a file another writes
local K = dofile(arg[0]:match("^(.*/)") .. "trainkit.lua")
local root, prefix = K.corpus(rank)

local B = K.B
local function base_cfg(name, ffn, over) return K.base_cfg(opts, root, prefix, name, ffn, over) end

-- The same parameters on every rank: max and min over ranks of a checksum per
-- parameter agree.
local function check_replicas(model, what)
  local sums = {}
  for _, p in ipairs(model:named_parameters()) do
    sums[#sums + 1] = p[2]:cpu():double():sum():item()
  end
  local hi, lo = moe.tensor(sums, { dtype = "f64" }), moe.tensor(sums, { dtype = "f64" })
  dist.all_reduce(hi, "max")
  dist.all_reduce(lo, "min")
  local a, b = hi:totable(), lo:totable()
  for i = 1, #a do
    assert(a[i] == b[i], ("%s: parameter %d differs between ranks (%.17g vs %.17g)"):format(what, i, a[i], b[i]))
  end
end

local function check_finite(res, what)
  for s = 1, res.step do
    local l = res.losses[s]
    assert(l and l == l and l < math.huge, ("%s: loss at step %d is %s"):format(what, s, tostring(l)))
  end
end

-- max over steps of |a - b| / |b|
local max_rel = K.max_rel

local failures = {}
local function expect(ok, msg) if not ok then failures[#failures + 1] = msg; say("FAILED: %s", msg) end end

local cases = { { ffn = "moe", tie = opts.tie_embeddings }, { ffn = "dense", tie = opts.tie_embeddings },
  { ffn = "moe", tie = false, bitwise = true } }
for ci, case in ipairs(cases) do
  local ffn = case.ffn
  local label = (ffn == "moe" and "dMoE" or "dense GPT") .. (case.tie and "" or " untied")
  local function cfg_of(name, over)
    over = over or {}
    over.model = { tie_embeddings = case.tie }
    return base_cfg(name .. "-" .. ci, ffn, over)
  end
  local dp = train.run(cfg_of("dp"))
  check_finite(dp, label .. " dp=2")
  check_replicas(dp.model, label .. " dp=2")
  -- every rank logged the same (global) losses
  local l = {}
  for s = 1, opts.steps do l[s] = dp.losses[s] end
  local hi, lo = moe.tensor(l, { dtype = "f64" }), moe.tensor(l, { dtype = "f64" })
  dist.all_reduce(hi, "max")
  dist.all_reduce(lo, "min")
  expect(max_rel(hi:totable(), lo:totable(), opts.steps) == 0, label .. ": ranks logged different losses")
  if rank == 0 then
    local accum = train.run(cfg_of("accum", { parallel = { dp = 1 }, grad_accum = 2 }))
    local whole = train.run(cfg_of("whole", { parallel = { dp = 1 }, batch_size = 2 * B }))
    local ra = max_rel(dp.losses, accum.losses, opts.steps)
    local rw = max_rel(dp.losses, whole.losses, opts.steps)
    -- the trained parameters: the grad-accumulation reference's, bit for bit?
    local pd, pa, same = dp.model:named_parameters(), accum.model:named_parameters(), 0
    for i = 1, #pd do
      local a, b = pd[i][2]:double():reshape({ -1 }):totable(), pa[i][2]:double():reshape({ -1 }):totable()
      local eq = true
      for j = 1, #a do eq = eq and a[j] == b[j] end
      if eq then same = same + 1 end
    end
    local va = 0
    for s, v in pairs(dp.val_losses) do
      va = math.max(va, math.abs(v - whole.val_losses[s]) / math.abs(whole.val_losses[s]))
    end
    say("%-9s dp=2 x B=%d vs 1 process, grad_accum=2 x B: max rel diff of the lm loss over %d steps %.3e",
      label, B, opts.steps, ra)
    say("%-9s dp=2 x B=%d vs 1 process, grad_accum=2 x B: %d of %d parameters bit-identical after %d steps",
      label, B, same, #pd, opts.steps)
    say("%-9s dp=2 x B=%d vs 1 process, one batch of 2B:  max rel diff of the lm loss over %d steps %.3e" ..
      " (val loss %.3e)", label, B, opts.steps, rw, va)
    if opts.verbose then
      for s = 1, opts.steps do
        say("  step %2d  dp %.9f  accum %.9f  whole %.9f", s, dp.losses[s], accum.losses[s], whole.losses[s])
      end
    end
    expect(ra <= 1e-6, ("%s: dp=2 vs grad_accum=2 differ by %.3e > 1e-6"):format(label, ra))
    if case.bitwise then
      expect(same == #pd, ("%s: %d of %d parameters differ from grad_accum=2's"):format(label, #pd - same, #pd))
    end
    local bound = ffn == "dense" and 1e-4 or 1e-2
    expect(rw <= bound, ("%s: dp=2 vs one batch of 2B differ by %.3e > %g"):format(label, rw, bound))
    expect(va <= bound, ("%s: validation loss differs by %.3e > %g"):format(label, va, bound))
  end
  dist.barrier()
end

-- the MoE with capacity, and the dMoE with quantized saved activations
do
  local res = train.run(base_cfg("dp-capacity", "moe", { steps = 4, eval_every = 0,
    model = { moe = { kind = "moe", capacity_factor = 1.0 } } }))
  check_finite(res, "capacity MoE dp=2")
  check_replicas(res.model, "capacity MoE dp=2")
  say("capacity MoE dp=2: 4 steps, losses %s", table.concat(res.losses, " "))
end
do
  -- the dMoE's own switches (docs/LAYERS.md): expert inputs, pre-activations and
  -- scattered outputs saved with 8 bits
  local cfg = train.config(base_cfg("dp-quant", "moe", { steps = 4, eval_every = 0 }))
  local nn, layers = require "moe.nn", require "moe.layers"
  local mc, mo = cfg.model, cfg.model.moe
  moe.manual_seed(cfg.seed)
  local model = nn.TransformerLM { vocab_size = mc.vocab_size, d_model = mc.d_model,
    n_layers = mc.n_layers, n_heads = mc.n_heads, seq_len = cfg.seq_len,
    ffn = function()
      return layers.dMoE { hidden_size = mc.d_model, ffn_hidden_size = mo.ffn_hidden_size,
        num_experts = mo.num_experts, top_k = mo.top_k, activation_fn = mo.activation,
        moe_loss_weight = mo.loss_weight, quantize = { inputs = 8, rematerialize = 8, scatter = 8 } }
    end }
  local res = train.run(cfg, { model = model })
  check_finite(res, "quantized dMoE dp=2")
  check_replicas(res.model, "quantized dMoE dp=2")
  say("dMoE with int8 saved activations dp=2: 4 steps, losses %s", table.concat(res.losses, " "))
end

os.execute("rm -rf '" .. root .. "'")
local bad = moe.tensor({ #failures }, { dtype = "f64" })
dist.all_reduce(bad, "max")
if bad:item() > 0 then error(("dp_equivalence: %d check(s) failed"):format(#failures), 0) end
say("dp_equivalence: ok")
