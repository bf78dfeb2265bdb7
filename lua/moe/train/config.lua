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

--- defaults() -> a fresh table of every cfg key with its default (a moe.config table).
function M.defaults()
  return {
    model = {
      vocab_size = 257, d_model = 128, n_layers = 4, n_heads = 4, pos = "rope",
      norm = "layernorm", tie_embeddings = true, dropout = 0.0, init_std = 0.02,
      ffn = "moe", d_ff = 512,
      moe = {
        kind = "dmoe", num_experts = 8, top_k = 2, ffn_hidden_size = 256, mlp_type = "mlp",
        activation = "gelu", mlp_impl = "auto", loss_weight = 0.01, zloss_weight = 0.0,
        jitter_eps = 0.0, capacity_factor = 1.0, every = 1, normalize_expert_weights = 0,
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
    parallel = { dp = 0, ep = 1, bucket_mb = 25.0, dp_shard = 0, dp_replicate = 0 },
  }
end

--- config(cfg) -> a complete copy of cfg (defaults filled in, keys and types checked).
function M.config(cfg)
  if cfg ~= nil and type(cfg) ~= "table" then
    error(("train: config must be a table, got a %s"):format(type(cfg)), 0)
  end
  return (moe.config(M.defaults(), cfg or {}, "train"))
end

--- check(cfg): values in range; an error names the key, the rule and the value.
function M.check(cfg)
  local function pos(key, v, zero_ok)
    if math.type(v) ~= "integer" or v < 0 or (v == 0 and not zero_ok) then
      error(("train: %s must be an integer %s 0, got %s"):format(key, zero_ok and ">=" or ">", tostring(v)), 0)
    end
  end
  pos("seq_len", cfg.seq_len); pos("batch_size", cfg.batch_size); pos("grad_accum", cfg.grad_accum)
  pos("steps", cfg.steps, true); pos("eval_every", cfg.eval_every, true); pos("eval_iters", cfg.eval_iters, true)
  pos("log_every", cfg.log_every); pos("save_every", cfg.save_every, true); pos("keep_last", cfg.keep_last, true)
  pos("stop_at", cfg.stop_at, true); pos("warmup", cfg.warmup, true)
  pos("parallel.dp", cfg.parallel.dp, true)
  pos("parallel.dp_shard", cfg.parallel.dp_shard, true)
  pos("parallel.dp_replicate", cfg.parallel.dp_replicate, true)
  pos("parallel.ep", cfg.parallel.ep)
  if cfg.parallel.bucket_mb < 0 then
    error(("train: parallel.bucket_mb must be a number >= 0, got %s"):format(tostring(cfg.parallel.bucket_mb)), 0)
  end
  local function one_of(key, v, list)
    for _, x in ipairs(list) do if v == x then return end end
    error(("train: %s must be one of %s, got '%s'"):format(key, table.concat(list, ", "), tostring(v)), 0)
  end
  one_of("device", cfg.device, { "auto", "cpu", "cuda" })
  one_of("dtype", cfg.dtype, { "f32", "bf16" })
  one_of("optimizer", cfg.optimizer, { "adamw", "sgd" })
  one_of("decay", cfg.decay, { "cosine", "linear", "constant" })
  one_of("model.ffn", cfg.model.ffn, { "moe", "dense" })
  one_of("model.moe.kind", cfg.model.moe.kind, { "dmoe", "moe" })
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
