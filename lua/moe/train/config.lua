--[[
moe/train/config.lua - the configuration of moe.train: every key with its
default, the merge of a caller's table over them (moe.config's table form,
so an unknown key or a value of the wrong type is an error naming it), the
checks of values, and the device.

  local tc = require "moe.train.config"
  local cfg = tc.config { steps = 10, model = { d_model = 64 } }  -- a complete copy
  tc.check(cfg)                                                   -- errors name the key
]]
local moe = require "moe"

local M = {}

-- What each key means (`moe-lua train --help` prints it beside the default and
-- the type; tests/lua/config_spec.lua checks that every key has one).
M.descriptions = {
  ["model.vocab_size"] = "number of token ids the model embeds (257: bytes and an end-of-document id)",
  ["model.d_model"] = "width of the residual stream (embedding size)",
  ["model.n_layers"] = "number of transformer blocks",
  ["model.n_heads"] = "attention heads per block; must divide model.d_model",
  ["model.pos"] = "position encoding: rope, learned or none",
  ["model.norm"] = "normalisation layer: layernorm or rmsnorm",
  ["model.tie_embeddings"] = "share the token embedding with the output projection",
  ["model.dropout"] = "dropout probability in [0, 1) on attention and residual outputs",
  ["model.init_std"] = "standard deviation of the normal initialisation of the weights (> 0)",
  ["model.ffn"] = "feed-forward layer of each block: moe (model.moe.*) or dense (an MLP of model.d_ff)",
  ["model.d_ff"] = "hidden size of the dense MLPs (model.ffn=dense, or the blocks between MoE layers)",
  ["model.moe.kind"] = "dmoe (dropless, MegaBlocks) or moe (capacity-limited, tokens past capacity dropped)",
  ["model.moe.num_experts"] = "experts per MoE layer",
  ["model.moe.top_k"] = "experts each token is routed to (1 .. num_experts)",
  ["model.moe.ffn_hidden_size"] = "hidden size of each expert's MLP",
  ["model.moe.mlp_type"] = "expert MLP: mlp (act(x W1) W2) or glu (gated, SwiGLU with silu)",
  ["model.moe.activation"] = "activation of the experts and MLPs: gelu, gelu_tanh, relu, silu, tanh or sigmoid",
  ["model.moe.normalize_expert_weights"] = "p > 0: the top-k gates divided by their p-norm (1: they sum to 1, Mixtral's)",
  ["model.moe.mlp_impl"] = "expert kernels: auto, grouped (grouped GEMM), sparse (block-sparse) or loop",
  ["model.moe.loss_weight"] = "weight of the load-balancing loss (>= 0)",
  ["model.moe.zloss_weight"] = "weight of the router z-loss (>= 0)",
  ["model.moe.jitter_eps"] = "multiplicative jitter on the router input during training, in [0, 1); 0 = off",
  ["model.moe.capacity_factor"] = "model.moe.kind=moe: expert capacity as a multiple of the even share (> 0)",
  ["model.moe.uniform_expert_assignment"] = "true: tokens go to the experts round-robin, an even load (benchmarks; " ..
    "the router still runs and trains)",
  ["model.moe.every"] = "an MoE layer every N blocks (1 = every block; the others dense MLPs)",
  data = "dataset prefix (PREFIX.bin / PREFIX.idx from `moe-lua preprocess`), or bible",
  data_dir = "where data=bible is downloaded and preprocessed",
  valid_fraction = "fraction of the documents held out for validation, in [0, 1)",
  data_seed = "seed of the data order (shuffling of the documents)",
  seq_len = "tokens per sequence (the context length)",
  batch_size = "sequences per micro-batch (per rank with data parallelism)",
  grad_accum = "micro-batches accumulated per optimizer step",
  steps = "optimizer steps of the whole run (the lr schedule's length)",
  lr = "peak learning rate (>= 0)",
  min_lr = "learning rate at the end of the decay (0 <= min_lr <= lr)",
  warmup = "steps of linear warm-up from 0 to lr",
  decay = "learning-rate decay after the warm-up: cosine, linear or constant",
  weight_decay = "decoupled weight decay (AdamW) or L2 (SGD) (>= 0)",
  beta1 = "AdamW's first-moment decay, in [0, 1)",
  beta2 = "AdamW's second-moment decay, in [0, 1)",
  eps = "AdamW's epsilon, added to the denominator (> 0)",
  clip = "clip the global gradient norm to this value (0 = no clipping)",
  optimizer = "adamw or sgd (with momentum 0.9)",
  eval_every = "evaluate on the validation split every N steps and at the end (0 = never)",
  eval_iters = "validation batches per evaluation",
  log_every = "log (console, metrics.jsonl, TensorBoard) every N steps",
  save_every = "save a checkpoint every N steps (0 = only at the end)",
  keep_last = "checkpoints kept in out_dir, the newest ones (0 = save none)",
  save_async = "write checkpoints on a background thread (the step waits for a host copy; sharded format)",
  out_dir = "folder of the run: checkpoints, metrics.jsonl, tb/, config.json",
  resume = "continue a run: latest (the newest checkpoint in out_dir), a checkpoint folder, or empty",
  overwrite = "start afresh in an out_dir that holds an earlier run, deleting its checkpoints and logs",
  deterministic = "bit-reproducible kernels (GPU: TF32 off, deterministic attention backward, no GEMM timing)",
  device = "auto (cuda when available), cpu or cuda",
  dtype = "parameter and compute dtype: f32 or bf16",
  stop_at = "stop after this step, as if the run were interrupted there (0 = run all steps)",
  seed = "seed of the initialisation and of dropout, jitter and sampling",
  tensorboard = "write TensorBoard events to out_dir/tb",
  sample_every = "print a sample of generated text every N steps (0 = only at the end)",
  sample_tokens = "tokens of the samples (0 = no sample)",
  sample_prompt = "text the samples start from",
  sample_temperature = "temperature of the samples (> 0; lower is greedier)",
  sample_top_k = "sample among the k most likely tokens (0 = all)",
  quiet = "print nothing (files are still written)",
  max_skipped_in_a_row = "stop the run after this many steps in a row with a non-finite loss or gradient norm " ..
    "(each is skipped: no update)",
  ["parallel.dp"] = "data-parallel ranks (0 = the job's world size; 1 = each rank trains alone)",
  ["parallel.ep"] = "expert-parallel group size: the experts are sharded over groups of N ranks",
  ["parallel.etp"] = "expert-tensor group size: every expert's hidden units are split over groups of N ranks",
  ["parallel.ep_chunks"] = "with ep: the experts' all_to_alls in this many chunks, pipelined with their GEMMs (1 = none)",
  ["parallel.shard_params"] = "with dp_shard: shard the parameters too (ZeRO-3), gathered per block for use",
  ["parallel.prefetch"] = "with shard_params: blocks whose parameters are gathered ahead of their forward " ..
    "(the optimizer step starts the first ones; more hides more gathers and holds more memory; 0 = 2)",
  ["parallel.bucket_mb"] = "size of the gradient all-reduce buckets in MiB (0 = one per parameter)",
  ["parallel.dp_shard"] = "ranks the optimizer state and gradients are sharded over (ZeRO-2; 0 = off)",
  ["parallel.dp_replicate"] = "replicas of the sharded group (HSDP; 0 = 1)",
}

--- defaults() -> a fresh table of every cfg key with its default (a moe.config table;
--- its metatable's `help` holds M.descriptions for --help).
function M.defaults()
  return setmetatable({
    model = {
      vocab_size = 257, d_model = 128, n_layers = 4, n_heads = 4, pos = "rope",
      norm = "layernorm", tie_embeddings = true, dropout = 0.0, init_std = 0.02,
      ffn = "moe", d_ff = 512,
      moe = {
        kind = "dmoe", num_experts = 8, top_k = 2, ffn_hidden_size = 256, mlp_type = "mlp",
        activation = "gelu", mlp_impl = "auto", loss_weight = 0.01, zloss_weight = 0.0,
        jitter_eps = 0.0, capacity_factor = 1.0, every = 1, normalize_expert_weights = 0,
        uniform_expert_assignment = false,
      },
    },
    data = "bible", data_dir = "data", valid_fraction = 0.05, data_seed = 1234,
    seq_len = 128, batch_size = 16, grad_accum = 1, steps = 1000,
    lr = 1e-3, min_lr = 1e-4, warmup = 50, decay = "cosine", weight_decay = 0.1,
    beta1 = 0.9, beta2 = 0.95, eps = 1e-8, clip = 1.0, optimizer = "adamw",
    eval_every = 100, eval_iters = 10, log_every = 10, save_every = 0, keep_last = 3, save_async = false,
    out_dir = "out", resume = "", overwrite = false, deterministic = false, device = "auto", dtype = "f32",
    stop_at = 0, seed = 1234, tensorboard = true, sample_every = 0, sample_tokens = 200,
    sample_prompt = "", sample_temperature = 0.8, sample_top_k = 40, quiet = false,
    max_skipped_in_a_row = 10,
    parallel = { dp = 0, ep = 1, etp = 1, bucket_mb = 25.0, dp_shard = 0, dp_replicate = 0,
      shard_params = false, prefetch = 0, ep_chunks = 1 },
  }, { help = M.descriptions })
end

--- config(cfg) -> a complete copy of cfg (defaults filled in, keys and types checked).
function M.config(cfg)
  if cfg ~= nil and type(cfg) ~= "table" then
    error(("train: config must be a table, got a %s"):format(type(cfg)), 0)
  end
  return (moe.config(M.defaults(), cfg or {}, "train"))
end

local function fail(fmt, ...) error("train: " .. fmt:format(...), 0) end

local function show(v)
  if v ~= v then return "nan" end
  if v == math.huge then return "inf" elseif v == -math.huge then return "-inf" end
  if type(v) == "string" then return "'" .. v .. "'" end
  return tostring(v)
end

-- Every number of cfg is finite (NaN and infinities name their key).
local function check_finite(t, prefix)
  local keys = {}
  for k in pairs(t) do if type(k) == "string" then keys[#keys + 1] = k end end
  table.sort(keys)
  for _, k in ipairs(keys) do
    local v = t[k]
    if type(v) == "table" then
      check_finite(v, prefix .. k .. ".")
    elseif type(v) == "number" and (v ~= v or v == math.huge or v == -math.huge) then
      fail("%s%s must be a finite number, got %s", prefix, k, show(v))
    end
  end
end

-- The valid values of the string keys with a fixed set (model.moe.activation:
-- the names nn.MLP knows).
local function enums()
  local acts = {}
  for name in pairs(require("moe.nn.layers").activations) do acts[#acts + 1] = name end
  table.sort(acts)
  return {
    { "device", { "auto", "cpu", "cuda" } }, { "dtype", { "f32", "bf16" } },
    { "optimizer", { "adamw", "sgd" } }, { "decay", { "cosine", "linear", "constant" } },
    { "model.pos", { "rope", "learned", "none" } }, { "model.norm", { "layernorm", "rmsnorm" } },
    { "model.ffn", { "moe", "dense" } }, { "model.moe.kind", { "dmoe", "moe" } },
    { "model.moe.mlp_type", { "mlp", "glu" } }, { "model.moe.activation", acts },
    { "model.moe.mlp_impl", { "auto", "grouped", "sparse", "loop" } },
  }
end

local function get(cfg, key)
  local v = cfg
  for part in key:gmatch("[^.]+") do v = v[part] end
  return v
end

--- check(cfg): values in range, before anything is built; an error names the key, the
--- rule and the value, in one line.
function M.check(cfg)
  check_finite(cfg, "")
  local function int(key, lo)
    local v = get(cfg, key)
    if math.type(v) ~= "integer" or v < lo then
      fail("%s must be an integer >= %d, got %s", key, lo, show(v))
    end
  end
  local function num(key, lo, lo_open, hi, hi_open)
    local v = get(cfg, key)
    local bad = type(v) ~= "number" or v < lo or (lo_open and v == lo)
      or (hi and (v > hi or (hi_open and v == hi)))
    if bad then
      local rule = ("%s %s"):format(lo_open and ">" or ">=", show(lo))
      if hi then
        rule = ("in %s%s, %s%s"):format(lo_open and "(" or "[", show(lo), show(hi), hi_open and ")" or "]")
      end
      fail("%s must be a number %s, got %s", key, rule, show(v))
    end
  end
  for _, k in ipairs({ "seq_len", "batch_size", "grad_accum", "log_every", "max_skipped_in_a_row",
    "model.vocab_size", "model.d_model", "model.n_layers", "model.n_heads", "model.d_ff",
    "model.moe.num_experts", "model.moe.top_k", "model.moe.ffn_hidden_size", "model.moe.every", "parallel.ep",
    "parallel.etp", "parallel.ep_chunks" }) do
    int(k, 1)
  end
  for _, k in ipairs({ "steps", "eval_every", "eval_iters", "save_every", "keep_last", "stop_at", "warmup",
    "sample_every", "sample_tokens", "sample_top_k", "parallel.dp", "parallel.dp_shard", "parallel.dp_replicate",
    "parallel.prefetch" }) do
    int(k, 0)
  end
  num("lr", 0); num("min_lr", 0); num("weight_decay", 0); num("clip", 0)
  num("beta1", 0, false, 1, true); num("beta2", 0, false, 1, true); num("eps", 0, true)
  num("valid_fraction", 0, false, 1, true); num("sample_temperature", 0, true)
  num("model.dropout", 0, false, 1, true); num("model.init_std", 0, true)
  num("model.moe.loss_weight", 0); num("model.moe.zloss_weight", 0); num("model.moe.jitter_eps", 0, false, 1, true)
  num("model.moe.capacity_factor", 0, true); num("parallel.bucket_mb", 0)
  for _, e in ipairs(enums()) do
    local v, list = get(cfg, e[1]), e[2]
    local found = false
    for _, x in ipairs(list) do found = found or v == x end
    if not found then fail("%s must be one of %s, got %s", e[1], table.concat(list, ", "), show(v)) end
  end
  local mc, mo = cfg.model, cfg.model.moe
  if cfg.min_lr > cfg.lr then
    fail("min_lr=%s is above lr=%s (the decay ends at min_lr): pass min_lr <= lr", show(cfg.min_lr), show(cfg.lr))
  end
  if mc.d_model % mc.n_heads ~= 0 then
    fail("model.n_heads=%d does not divide model.d_model=%d", mc.n_heads, mc.d_model)
  end
  if mc.pos == "rope" and (mc.d_model // mc.n_heads) % 2 ~= 0 then
    fail("model.pos=rope needs an even head dim, but model.d_model / model.n_heads = %d", mc.d_model // mc.n_heads)
  end
  if mc.ffn == "moe" then
    if mo.top_k > mo.num_experts then
      fail("model.moe.top_k=%d is more than model.moe.num_experts=%d", mo.top_k, mo.num_experts)
    end
    if mo.mlp_impl == "sparse" and mo.ffn_hidden_size % 128 ~= 0 then
      fail("model.moe.mlp_impl=sparse needs model.moe.ffn_hidden_size a multiple of 128 (the block size), got %d",
        mo.ffn_hidden_size)
    end
    if mo.every > mc.n_layers then
      fail("model.moe.every=%d is more than model.n_layers=%d: the model would have no MoE layer", mo.every,
        mc.n_layers)
    end
    if cfg.parallel.ep > 1 and mo.num_experts % cfg.parallel.ep ~= 0 then
      fail("parallel.ep=%d does not divide model.moe.num_experts=%d", cfg.parallel.ep, mo.num_experts)
    end
    if cfg.parallel.etp > 1 and mo.ffn_hidden_size % cfg.parallel.etp ~= 0 then
      fail("parallel.etp=%d does not divide model.moe.ffn_hidden_size=%d", cfg.parallel.etp, mo.ffn_hidden_size)
    end
    if cfg.parallel.etp > 1 and mo.kind ~= "dmoe" then
      fail("parallel.etp=%d needs model.moe.kind=dmoe (the capacity layer does not split its experts)",
        cfg.parallel.etp)
    end
  end
  if cfg.out_dir == "" then fail("out_dir must not be empty") end
  if cfg.decay ~= "constant" and cfg.steps < cfg.warmup then
    error(("train: warmup=%d is longer than steps=%d, so the %s decay would never start: " ..
      "pass warmup=<n> with n <= %d, or decay=constant"):format(cfg.warmup, cfg.steps,
      tostring(cfg.decay), cfg.steps), 0)
  end
end

--- is_cuda(device) -> whether a resolved device ("cpu", "cuda", "cuda:1") is a GPU.
function M.is_cuda(device) return device:sub(1, 4) == "cuda" end

--- cuda_index(device) -> the ordinal of "cuda" (0) or "cuda:<i>".
function M.cuda_index(device) return math.tointeger(device:match("^cuda:(%d+)$")) or 0 end

--- resolve_device(name) -> "cpu" or "cuda" ("auto": cuda when available).
function M.resolve_device(name)
  if name == "auto" then return (moe.cuda and moe.cuda.is_available()) and "cuda" or "cpu" end
  if name == "cuda" and not (moe.cuda and moe.cuda.is_available()) then
    error("train: device=cuda but no CUDA device is available (use device=auto or device=cpu)", 0)
  end
  return name
end

-- A JSON-safe deep copy (functions, userdata and tensors dropped): what a
-- checkpoint's state.json stores of the config and the data state.
function M.plain(v)
  local ty = type(v)
  if ty == "table" then
    local c = {}
    for k, x in pairs(v) do
      local px = M.plain(x)
      if px ~= nil and (type(k) == "string" or math.type(k) == "integer") then c[k] = px end
    end
    return c
  end
  if ty == "number" or ty == "string" or ty == "boolean" then return v end
  return nil
end

return M
