--[[
tests/dist/trainkit.lua - what the training tests of tests/dist/ share:

  local K = dofile(arg[0]:match("^(.*/)") .. "trainkit.lua")
  local root, prefix = K.corpus(rank)
      a small word corpus: 60 documents of pseudo-random words (a fixed
      linear congruential sequence, so every rank and every run writes the
      same bytes), as a Megatron dataset in a fresh folder of this rank's
      own (no rank reads a file another writes)
  K.base_cfg(opts, root, prefix, name, ffn, over)
      the train config of a 2-layer GPT (ffn "moe": dMoEs of 4 experts,
      top 2) on that corpus, micro-batch 4, opts.steps steps on opts.device;
      `over` merged in (one level deep)
  K.max_rel(a, b, steps)  max over steps of |a - b| / |b|
  K.with(t, extra)        a copy of t with extra's keys set
  K.compare(what, ref, got, tol, from, to, rank)
      the losses got[from..to] against ref's: tol 0 bit for bit, else
      relative |got - ref| / |ref| <= tol (an error naming the step);
      returns the largest relative difference
  K.check_device(device, name)
      device=cuda (each rank on cuda:<local rank>, collectives through
      NCCL) needs a GPU per rank of this node: a clear error otherwise
]]
local moe = require "moe"
local data = require "moe.data"

local WORDS = { "the ", "king ", "and ", "of ", "his ", "house ", "said ", "unto ", "lord ", "land ",
  "in ", "was ", "to ", "a ", "people ", "went ", "out ", "day ", ". ", "\n" }

local K = {}
K.B = 4

function K.corpus(rank)
  local root = os.tmpname()
  os.remove(root)
  root = root .. "-r" .. rank
  assert(os.execute("mkdir -p '" .. root .. "'"))
  local x = 12345
  local function rnd(n) x = (x * 1103515245 + 12345) % 2147483648; return x % n end
  local prefix = root .. "/words"
  local b = data.IndexedDatasetBuilder(prefix, { dtype = "u16" })
  for _ = 1, 60 do
    local ids = {}
    for _ = 1, 20 + rnd(30) do
      for c in WORDS[rnd(#WORDS) + 1]:gmatch(".") do ids[#ids + 1] = c:byte() end
    end
    ids[#ids + 1] = 256
    b:add_document(ids)
  end
  b:finalize()
  return root, prefix
end

function K.base_cfg(opts, root, prefix, name, ffn, over)
  local c = {
    model = { vocab_size = 257, d_model = 32, n_layers = 2, n_heads = 2, ffn = ffn, d_ff = 64,
      moe = { num_experts = 4, top_k = 2, ffn_hidden_size = 32, loss_weight = opts.loss_weight } },
    data = prefix, valid_fraction = 0.1, seq_len = 16, batch_size = K.B, grad_accum = 1,
    steps = opts.steps, lr = 3e-3, min_lr = 3e-4, warmup = 2, clip = 1.0, eval_every = 10,
    eval_iters = 2, log_every = 1, save_every = 0, keep_last = 0, tensorboard = false,
    sample_tokens = 0, quiet = not opts.verbose, deterministic = true, device = opts.device, seed = 7,
    out_dir = root .. "/" .. name,
  }
  for k, v in pairs(over or {}) do
    if type(v) == "table" and type(c[k]) == "table" then
      for k2, v2 in pairs(v) do c[k][k2] = v2 end
    else
      c[k] = v
    end
  end
  return c
end

function K.check_device(device, name)
  if device == "cpu" then return end
  if device ~= "cuda" then error(("%s: device must be cpu or cuda, got %s"):format(name, tostring(device)), 0) end
  local n = moe.cuda and moe.cuda.is_available() and moe.cuda.device_count() or 0
  local need = moe.dist.local_world_size()
  if n < need then
    error(("%s: device=cuda puts each rank on its own GPU: %d ranks on this node, %d GPU(s) visible"):format(
      name, need, n), 0)
  end
end

function K.max_rel(a, b, steps)
  local m = 0
  for s = 1, steps do
    local d = math.abs(a[s] - b[s]) / math.abs(b[s])
    if d > m then m = d end
  end
  return m
end

function K.with(t, extra)
  local o = {}
  for k, v in pairs(t) do o[k] = v end
  for k, v in pairs(extra or {}) do o[k] = v end
  return o
end

function K.compare(what, ref, got, tol, from, to, rank)
  local worst = 0
  for s = from, to do
    assert(got[s] ~= nil, ("[rank %d] %s: no loss at step %d"):format(rank, what, s))
    local d = math.abs(got[s] - ref[s]) / math.abs(ref[s])
    if d > worst then worst = d end
    if tol == 0 then
      assert(got[s] == ref[s], ("[rank %d] %s: step %d loss %.17g, uninterrupted %.17g"):format(rank, what, s,
        got[s], ref[s]))
    else
      assert(d <= tol, ("[rank %d] %s: step %d loss %.9g, uninterrupted %.9g"):format(rank, what, s, got[s], ref[s]))
    end
  end
  return worst
end

return K
