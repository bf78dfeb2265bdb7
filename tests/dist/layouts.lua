--[[
tests/dist/layouts.lua - layouts as Lua functions (train.run(cfg, {layout =
fn}), moe/train/parallel.lua M.place) on 2 ranks, on the CPU (in CI) or on
two GPUs:

  moe-lua launch -n 2 tests/dist/layouts.lua [steps=10] [verbose=true] [device=cpu|cuda]

device=cuda: each rank on cuda:<local rank> (the example's run and the
placement probe), collectives through NCCL; the one-process references
train on cuda:0. Every part below runs on either device (all of it is
2-rank).

1. experiments/layouts/custom_layout.lua runs as a user runs it (its
   command-line overrides: this test's corpus, a smaller model and batch,
   `steps` steps): the embeddings, norms and routers replicated (ZeRO-2 over
   dp_shard = 2), each attention block a unit sharded over dp_shard = 2, the
   experts over ep = 2. Its losses are compared with one process training
   the same config (parallel.dp = 1, ep = 1, grad_accum = 2: the same global
   batch): within 1e-5 relative at every step, and every parameter within
   1e-4 of its largest value (Adam's update is about lr per element, so a
   sign or a gradient scale gone wrong shows far above that). Not bit for bit: the
   reference adds its two micro-batch gradients one at a time, an expert's
   gradient is one GEMM over both ranks' rows, and the clipping norm is
   summed per shard; measured differences are printed. Also checked: the
   placement (2 units, both attention blocks), no unit whole between steps.
2. Layouts that cannot work fail before training starts, on every rank,
   with an error naming the module: an unknown answer, "replicate" on the
   experts while ep = 2, a module with non-expert parameters as "expert",
   the tied embeddings in a unit of their own, a layout function that
   raises. And parallel.ep on a model without MoE layers (a dim the model
   cannot use). The checks a single process can make are in
   tests/lua/train_parallel_spec.lua.
]]
local moe = require "moe"
local train = require "moe.train"

local opts = moe.config { steps = 10, verbose = false, device = "cpu" }
local dist = moe.dist
dist.init { timeout = 300 }
local rank, world = dist.rank(), dist.world_size()
assert(world == 2, ("run under moe-lua launch -n 2 (world size %d)"):format(world))
local function say(...) if rank == 0 then print(string.format(...)) end end

local here = arg[0]:match("^(.*/)")
local K = dofile(here .. "trainkit.lua")
K.check_device(opts.device, "layouts")
local root, prefix = K.corpus(rank)
local failures = 0
local function expect(ok, msg)
  if not ok then
    failures = failures + 1
    io.stderr:write(("[rank %d] FAILED: %s\n"):format(rank, msg))
  end
end

-- 1. the example, with overrides on its command line
local example = here .. "../../experiments/layouts/custom_layout.lua"
local saved_arg = arg
rawset(_G, "arg", { [0] = example, "data=" .. prefix, "seq_len=16", "batch_size=4", "model.d_model=32",
  "model.n_heads=2", "model.moe.ffn_hidden_size=32", "model.vocab_size=257", "steps=" .. opts.steps,
  "eval_every=100", "log_every=1", "quiet=" .. tostring(not opts.verbose), "deterministic=true",
  "valid_fraction=0.1", "seed=7", "out_dir=" .. root .. "/example", "keep_last=0", -- out_dir is this rank's
  "device=" .. opts.device }) -- the example reads arg
local result, cfg, layout = dofile(example)
rawset(_G, "arg", saved_arg)
local ref_cfg = train.config(cfg)
ref_cfg.parallel = { dp = 1 }
ref_cfg.grad_accum, ref_cfg.out_dir = 2, root .. "/ref"
local ref = train.run(ref_cfg)
local rl = K.max_rel(result.losses, ref.losses, opts.steps)
expect(rl <= 1e-5, ("custom_layout: losses differ from one process's by %.3g (relative)"):format(rl))
-- every parameter (gathered by the state dict; the experts: this rank's half)
local sd, pworst = result.model:state_dict(), 0
for _, np in ipairs(ref.model:named_parameters()) do
  local name, want = np[1], np[2]
  want = want:cpu() -- on GPUs: the reference on cuda:0, this rank's on its own
  if name:match("%.experts%.w%d$") then want = want:narrow(0, rank * 2, 2) end
  local got = sd[name] and sd[name]:cpu()
  local d = got and (got - want):abs():max():item() / math.max(want:abs():max():item(), 1e-30) or math.huge
  pworst = math.max(pworst, d)
  expect(d <= 1e-4, ("custom_layout: parameter %s differs by %.3g of its largest value"):format(name, d))
end
if opts.verbose then
  for s = 1, opts.steps do say("  step %2d  layout %.9f  one process %.9f", s, result.losses[s], ref.losses[s]) end
end

-- the placement, through the hooks of one more run
local seen
local probe = train.config(cfg)
probe.steps, probe.warmup, probe.out_dir, probe.keep_last = 2, 1, root .. "/probe", 0
train.run(probe, { layout = layout, hooks = { after_step = function(state)
  local par = state.parallel
  local whole = 0
  for _, u in pairs(par.fsdp.units) do if u.unit:ready() then whole = whole + 1 end end
  seen = { names = table.concat(par.placement.unit_names, ","), whole = whole, experts = par.placement.experts }
end } })
expect(seen and seen.names == "blocks.0.attn,blocks.1.attn" and seen.whole == 0 and seen.experts == 4,
  ("custom_layout: placement %s"):format(seen and ("units %s, %d whole, %d expert shards"):format(seen.names,
  seen.whole, seen.experts) or "never seen"))
say("custom_layout (ep=2 x dp_shard=2, attention sharded) on 2 ranks == grad_accum=2 alone, %d steps: losses " ..
  "within %.2e (relative), parameters within %.2e of their largest value (rank 0); units %s", opts.steps, rl,
  pworst, seen and seen.names or "?")

-- 2. errors before training
local function fails(name, over, lay, want)
  local c = train.config(cfg)
  c.out_dir = root .. "/bad-" .. name
  for k, v in pairs(over) do
    if type(v) == "table" then for k2, v2 in pairs(v) do c[k][k2] = v2 end else c[k] = v end
  end
  local stepped = false
  local ok, err = pcall(train.run, c, { layout = lay, hooks = { before_step = function() stepped = true end } })
  err = tostring(err)
  local good = not ok and not stepped and err:find(want, 1, true) ~= nil
  expect(good, ("%s: expected an error with '%s' before training, got %s"):format(name, want, ok and "none" or err))
  if good then say("ok   %s: %s", name, err) end
  dist.barrier()
end
fails("answer", {}, function(name) if name == "blocks.1.ln1" then return "sharded" end end,
  "the layout placed module 'blocks.1.ln1' (LayerNorm) as 'sharded': expected")
fails("replicate experts", {}, function(name) if name:match("experts$") then return "replicate" end end,
  "module 'blocks.0.ffn.experts' (MLPExperts) as \"replicate\", but its 'w1' is an expert shard")
fails("expert with a router", {}, function(name) if name == "blocks.0.ffn" then return "expert" end end,
  "module 'blocks.0.ffn' (dMoE) as \"expert\", but its parameter 'router.layer.weight' is not an expert shard")
fails("tied embeddings", { model = { tie_embeddings = true } },
  function(name) if name == "wte" then return "shard" end end,
  "places the tied embeddings 'wte.weight' in the unit of 'wte'")
fails("raising", {}, function(name) if name == "blocks.0.attn.qkv" then error("no idea") end end,
  "the layout failed on module 'blocks.0.attn.qkv' (Linear): ")
fails("dense model with ep", { model = { ffn = "dense" }, parallel = { dp_shard = 0 } }, nil,
  "train: parallel.ep=2 but the model has no MoE layer whose experts are spread over 2 ranks")

os.execute("rm -rf '" .. root .. "'")
local bad = moe.tensor({ failures }, { dtype = "f64" })
dist.all_reduce(bad, "max")
if bad:item() > 0 then error(("layouts: %d check(s) failed"):format(math.tointeger(bad:item())), 0) end
say("layouts: ok (%s, 2 ranks: custom_layout against one process, its placement, 6 layouts that fail)",
  opts.device)
