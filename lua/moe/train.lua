--[[
moe/train.lua - the training loop: a (d)MoE Transformer LM trained on an
indexed dataset, with evaluation, logging (console, metrics.jsonl,
TensorBoard), atomic checkpoints and exact resumption.

  local train = require "moe.train"
  local cfg = moe.config(train.defaults())      -- key=value overrides from the command line
  local result = train.run(cfg)                 -- or train.run(cfg, parts)

cfg keys (train.defaults() holds every key with its default; an unknown key
is an error listing the valid ones):
  model.*         nn.TransformerLM options (vocab_size, d_model, n_layers, n_heads, pos,
                  norm, tie_embeddings, dropout, init_std), model.ffn = "moe" | "dense",
                  model.d_ff (dense FFN width) and model.moe.* (kind = "dmoe" | "moe",
                  num_experts, top_k, ffn_hidden_size, mlp_type, activation, mlp_impl,
                  loss_weight, zloss_weight, jitter_eps, capacity_factor, every = a MoE
                  FFN in every n-th layer, dense elsewhere)
  data            dataset prefix (prefix.bin/.idx, Megatron-LM format) or "bible"
                  (data.bible_corpus{dir = data_dir}); valid_fraction, data_seed
  seq_len, batch_size, grad_accum, steps    tokens per step = batch_size * grad_accum * seq_len
  lr, min_lr, warmup, decay ("cosine" | "linear" | "constant"), weight_decay, beta1, beta2,
  eps, clip (global grad-norm clip, 0 = off), optimizer ("adamw" | "sgd")
  eval_every, eval_iters      validation loss over the same eval_iters batches each time
  log_every, save_every (0: at the end only), keep_last, out_dir, resume ("" | "latest" | path)
  stop_at         stop after this step as if interrupted (0: run to `steps`); the schedule
                  still spans `steps`, a checkpoint is written; resume=latest continues
  deterministic   TF32 off; with the same seed a run (and a stopped-and-resumed run) gives
                  bit-identical losses on the same machine
  device ("auto" | "cpu" | "cuda"), dtype ("f32" | "bf16"), seed
  tensorboard, sample_every (0: only at the end), sample_tokens, sample_prompt,
  sample_temperature, sample_top_k, quiet

parts (optional; each replaces what run would build from cfg):
  model       a module with named_parameters, state_dict, load_state_dict, train/eval and
              loss(x, y) -> loss tensor, {lm_loss=, aux_loss=, stats=} (moe.nn's contract)
  optimizer   function(named_params, cfg) -> optimizer (step, zero_grad, lr, state_dict,
              state_scalars, load_state_dict)
  schedule    function(step) -> lr;   clip_grad_norm   function(params, max_norm) -> norm
  train_data, valid_data   objects with batch(B) -> x, y (CPU i64), state(), set_state(s)
  tokenizer   with encode(str) and decode(ids), for samples

Returns {losses = {step -> lm loss}, val_losses = {step -> loss}, step = last step,
checkpoint = last checkpoint path or nil, sample = last sample text or nil, model = model}.
Files in out_dir: metrics.jsonl, tb/events.out.tfevents.*, ckpt-<step>/ (see moe.checkpoint).
]]
local moe = require "moe"
local metrics = require "moe.metrics"
local checkpoint = require "moe.checkpoint"

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
        jitter_eps = 0.0, capacity_factor = 1.0, every = 1,
      },
    },
    data = "bible", data_dir = "data", valid_fraction = 0.05, data_seed = 1234,
    seq_len = 128, batch_size = 16, grad_accum = 1, steps = 1000,
    lr = 1e-3, min_lr = 1e-4, warmup = 50, decay = "cosine", weight_decay = 0.1,
    beta1 = 0.9, beta2 = 0.95, eps = 1e-8, clip = 1.0, optimizer = "adamw",
    eval_every = 100, eval_iters = 10, log_every = 10, save_every = 0, keep_last = 3,
    out_dir = "out", resume = "", deterministic = false, device = "auto", dtype = "f32",
    stop_at = 0, seed = 1234, tensorboard = true, sample_every = 0, sample_tokens = 200,
    sample_prompt = "", sample_temperature = 0.8, sample_top_k = 40, quiet = false,
  }
end

------------------------------------------------------------------ config

local function deep_copy(v)
  if type(v) ~= "table" then return v end
  local c = {}
  for k, x in pairs(v) do c[k] = deep_copy(x) end
  return c
end

local function sorted_keys(t, prefix, out)
  out = out or {}
  for k, v in pairs(t) do
    if type(v) == "table" and next(v) ~= nil and #v == 0 then sorted_keys(v, prefix .. k .. ".", out)
    else out[#out + 1] = prefix .. k end
  end
  table.sort(out)
  return out
end

-- cfg over the defaults: missing keys take their default; an unknown key or a value of
-- the wrong type is an error naming it.
local function merge(defaults, cfg, prefix, root)
  for k, v in pairs(cfg) do
    local d = defaults[k]
    local key = prefix .. tostring(k)
    if d == nil then
      error(("train: unknown config key '%s' (valid keys: %s)"):format(key,
        table.concat(sorted_keys(root, ""), ", ")), 0)
    end
    if type(d) == "table" and #d == 0 and next(d) ~= nil then
      if type(v) ~= "table" then error(("train: config key '%s' is a section, got a %s"):format(key, type(v)), 0) end
      merge(d, v, key .. ".", root)
    else
      if type(v) ~= type(d) then
        error(("train: config key '%s' expects a %s, got a %s (%s)"):format(key, type(d), type(v), tostring(v)), 0)
      end
      if math.type(d) == "integer" and math.type(v) ~= "integer" then
        if math.tointeger(v) == nil then
          error(("train: config key '%s' expects an integer, got %s"):format(key, tostring(v)), 0)
        end
        v = math.tointeger(v)
      end
      defaults[k] = deep_copy(v)
    end
  end
  return defaults
end

--- config(cfg) -> a complete copy of cfg (defaults filled in, keys and types checked).
function M.config(cfg)
  local d = M.defaults()
  return merge(d, cfg or {}, "", M.defaults())
end

local function check_cfg(cfg)
  local function pos(key, v, zero_ok)
    if math.type(v) ~= "integer" or v < 0 or (v == 0 and not zero_ok) then
      error(("train: %s must be an integer %s 0, got %s"):format(key, zero_ok and ">=" or ">", tostring(v)), 0)
    end
  end
  pos("seq_len", cfg.seq_len); pos("batch_size", cfg.batch_size); pos("grad_accum", cfg.grad_accum)
  pos("steps", cfg.steps, true); pos("eval_every", cfg.eval_every, true); pos("eval_iters", cfg.eval_iters, true)
  pos("log_every", cfg.log_every); pos("save_every", cfg.save_every, true); pos("keep_last", cfg.keep_last, true)
  pos("stop_at", cfg.stop_at, true); pos("warmup", cfg.warmup, true)
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

--- resolve_device(name) -> "cpu" or "cuda" ("auto": cuda when available).
function M.resolve_device(name)
  if name == "auto" then return (moe.cuda and moe.cuda.is_available()) and "cuda" or "cpu" end
  if name == "cuda" and not (moe.cuda and moe.cuda.is_available()) then
    error("train: device=cuda but no CUDA device is available (use device=auto or device=cpu)", 0)
  end
  return name
end

------------------------------------------------------------------ builders

--- build_model(cfg, device) -> an nn.TransformerLM from cfg.model (moe.nn, moe.layers).
function M.build_model(cfg, device)
  local nn = require "moe.nn"
  local mc = cfg.model
  local mo = mc.moe
  local ffn
  if mc.ffn == "moe" then
    local layers = require "moe.layers"
    ffn = function(i)
      if mo.every > 1 and i % mo.every ~= mo.every - 1 then
        return nn.MLP { d_model = mc.d_model, d_ff = mc.d_ff, activation = mo.activation }
      end
      local opts = {
        hidden_size = mc.d_model, ffn_hidden_size = mo.ffn_hidden_size, num_experts = mo.num_experts,
        top_k = mo.top_k, mlp_type = mo.mlp_type, activation_fn = mo.activation,
        mlp_impl = mo.mlp_impl, moe_loss_weight = mo.loss_weight, moe_zloss_weight = mo.zloss_weight,
        moe_jitter_eps = mo.jitter_eps,
      }
      if mo.kind == "moe" then
        opts.capacity_factor = mo.capacity_factor
        return layers.MoE(opts)
      end
      return layers.dMoE(opts)
    end
  else
    ffn = function() return nn.MLP { d_model = mc.d_model, d_ff = mc.d_ff, activation = mo.activation } end
  end
  local lm = nn.TransformerLM {
    vocab_size = mc.vocab_size, d_model = mc.d_model, n_layers = mc.n_layers, n_heads = mc.n_heads,
    seq_len = cfg.seq_len, pos = mc.pos, tie_embeddings = mc.tie_embeddings, dropout = mc.dropout,
    norm = mc.norm, init_std = mc.init_std, ffn = ffn,
  }
  if device ~= "cpu" or cfg.dtype ~= "f32" then lm:to(device, cfg.dtype) end
  return lm
end

--- load_model(ckpt_path, device) -> model (eval mode), cfg: the model of a checkpoint,
--- rebuilt from the config in its state.json and loaded with its weights.
function M.load_model(path, device)
  local c = checkpoint.load(path, { device = device })
  local cfg = M.config(c.state.config or {})
  local model = M.build_model(cfg, device)
  model:load_state_dict(c.model)
  model:eval()
  return model, cfg
end

local function file_exists(path)
  local f = io.open(path, "rb")
  if f then f:close() return true end
  return false
end

--- build_data(cfg) -> train_data, valid_data, tokenizer (moe.data).
function M.build_data(cfg)
  local prefix = cfg.data
  if prefix == "bible" then prefix = require("moe.data").bible_corpus { dir = cfg.data_dir } end
  if prefix == "" or not (file_exists(prefix .. ".bin") and file_exists(prefix .. ".idx")) then
    error(("train: data='%s': no dataset %s.bin / %s.idx (preprocess text with `moe-lua preprocess " ..
      "input=... output=PREFIX`, or use data=bible)"):format(cfg.data, prefix, prefix), 0)
  end
  local data = require "moe.data"
  local ds = data.IndexedDataset(prefix)
  local function split(name)
    return data.GPTDataset(ds, { seq_len = cfg.seq_len, seed = cfg.data_seed, split = name,
      valid_fraction = cfg.valid_fraction })
  end
  return split("train"), split("valid"), data.ByteTokenizer()
end

local function build_optimizer(named, cfg)
  local optim = require "moe.optim"
  if cfg.optimizer == "sgd" then
    return optim.SGD(named, { lr = cfg.lr, momentum = 0.9, weight_decay = cfg.weight_decay })
  end
  return optim.AdamW(named, { lr = cfg.lr, betas = { cfg.beta1, cfg.beta2 }, eps = cfg.eps,
    weight_decay = cfg.weight_decay })
end

------------------------------------------------------------------ helpers

-- A JSON-safe deep copy (functions, userdata and tensors dropped).
local function plain(v)
  local ty = type(v)
  if ty == "table" then
    local c = {}
    for k, x in pairs(v) do
      local px = plain(x)
      if px ~= nil and (type(k) == "string" or math.type(k) == "integer") then c[k] = px end
    end
    return c
  end
  if ty == "number" or ty == "string" or ty == "boolean" then return v end
  return nil
end

local function to_list(t)
  if t == nil then return nil end
  local c = t
  if c.device ~= "cpu" then c = c:cpu() end
  return c:totable()
end

-- Sums per-layer expert counts of info.stats into acc[name] (Lua arrays).
local function accumulate_counts(acc, stats)
  for _, s in ipairs(stats or {}) do
    local counts = s.stats and to_list(s.stats.expert_counts)
    if counts then
      local a = acc[s.name]
      if not a then
        a = {}
        for j = 1, #counts do a[j] = 0 end
        acc[s.name] = a
        acc[#acc + 1] = s.name
      end
      for j = 1, #counts do a[j] = a[j] + math.tointeger(counts[j]) end
    end
  end
end

local function with_rng_kept(fn, ...)
  local rng = moe.get_rng_state()
  local res = table.pack(pcall(fn, ...))
  moe.set_rng_state(rng)
  if not res[1] then error(res[2], 0) end
  return table.unpack(res, 2, res.n)
end

local function to_device(t, device)
  if device == "cpu" then return t end
  return t:to(device)
end

--- evaluate(model, data, iters, batch_size, device) -> mean lm loss over iters batches
--- (no grad, eval mode; data is rewound to where it was so each call sees the same batches).
function M.evaluate(model, data, iters, batch_size, device)
  if iters == 0 then return nil end
  local start = data:state()
  local total = 0
  moe.no_grad(function()
    model:eval()
    for _ = 1, iters do
      local x, y = data:batch(batch_size)
      local _, info = model:loss(to_device(x, device), to_device(y, device))
      total = total + info.lm_loss
      collectgarbage() -- free the batch's activations before the next
    end
    model:train()
  end)
  data:set_state(start)
  return total / iters
end

------------------------------------------------------------------ run

--- run(cfg [, parts]) -> result (see the header).
function M.run(user_cfg, parts)
  parts = parts or {}
  local cfg = M.config(user_cfg)
  check_cfg(cfg)
  local device = M.resolve_device(cfg.device)
  local console = metrics.console()
  local function say(line) if not cfg.quiet then console.print(line) end end

  local prev_tf32 -- restored at the end of the run
  if cfg.deterministic and moe.set_matmul_tf32 then prev_tf32 = moe.set_matmul_tf32(false) end
  moe.manual_seed(cfg.seed)

  local model = parts.model or M.build_model(cfg, device)
  local train_data, valid_data, tokenizer = parts.train_data, parts.valid_data, parts.tokenizer
  if not train_data then
    local td, vd, tk = M.build_data(cfg)
    train_data, valid_data, tokenizer = td, valid_data or vd, tokenizer or tk
  end
  local named = model:named_parameters()
  local params = {}
  for i, p in ipairs(named) do params[i] = p[2] end
  local opt = (parts.optimizer or build_optimizer)(named, cfg)
  local schedule = parts.schedule or require("moe.optim").schedule {
    lr = cfg.lr, min_lr = cfg.min_lr, warmup = cfg.warmup, total = cfg.steps, decay = cfg.decay }
  local clip_grad_norm = parts.clip_grad_norm or require("moe.optim").clip_grad_norm

  checkpoint.mkdir_p(cfg.out_dir)
  local result = { losses = {}, val_losses = {}, model = model, step = 0 }
  local step, consumed = 0, 0

  -- resume
  local resume_path = checkpoint.resolve(cfg.out_dir, cfg.resume)
  if resume_path then
    local c = checkpoint.load(resume_path, { device = device })
    model:load_state_dict(c.model)
    opt:load_state_dict(c.optim, c.state.optim_scalars or {})
    moe.set_rng_state(c.state.rng)
    train_data:set_state(c.state.data)
    step, consumed = c.state.step, c.state.consumed_tokens or 0
    result.checkpoint = resume_path
    say(("resumed from %s at iteration %d"):format(resume_path, step))
  elseif cfg.resume == "latest" then
    say(("no checkpoint in %s: starting from scratch"):format(cfg.out_dir))
  end
  result.step = step

  -- a fresh run starts metrics.jsonl anew; a resumed one appends to it
  local log = metrics.jsonl(cfg.out_dir .. "/metrics.jsonl", resume_path and "a" or "w")
  local tb = cfg.tensorboard and require("moe.tensorboard").writer(cfg.out_dir .. "/tb") or nil
  local n_params = 0
  for _, p in ipairs(params) do n_params = n_params + p:numel() end
  local flops_per_token = model.flops_per_token and model:flops_per_token() or nil
  local peak
  if device == "cuda" then
    peak = metrics.peak_flops_for(moe.cuda.get_device_name(0), cfg.dtype,
      not cfg.deterministic and moe.matmul_tf32 and moe.matmul_tf32() or false)
  end
  say(("training on %s (%s): %d parameters, %d steps of %d tokens, out_dir=%s"):format(device,
    cfg.dtype, n_params, cfg.steps, cfg.batch_size * cfg.grad_accum * cfg.seq_len, cfg.out_dir))

  local function sample_text(n)
    if not tokenizer then return nil end
    local sample = require "moe.sample"
    return with_rng_kept(function()
      moe.manual_seed(cfg.seed + step)
      return sample.text(model, tokenizer, cfg.sample_prompt, {
        max_new_tokens = n, temperature = cfg.sample_temperature, top_k = cfg.sample_top_k,
        seq_len = cfg.seq_len, device = device })
    end)
  end

  local function save()
    local path = checkpoint.save(cfg.out_dir, step, {
      model = model:state_dict(), optim = opt:state_dict(),
      state = { consumed_tokens = consumed, rng = moe.get_rng_state(), data = plain(train_data:state()),
        config = plain(cfg), optim_scalars = plain(opt:state_scalars()) },
    }, { keep_last = cfg.keep_last })
    result.checkpoint = path
    say(("saved checkpoint %s"):format(path))
  end

  local tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len
  local t_run, t_log = moe.clock(), moe.clock()
  local first_step = step
  local interval = { steps = 0, loss = 0, aux = 0, gn = 0, counts = {} }
  local last_saved = resume_path and step or -1

  local last = cfg.stop_at > 0 and math.min(cfg.stop_at, cfg.steps) or cfg.steps
  while step < last do
    local lr = schedule(step)
    opt.lr = lr
    local loss_sum, aux_sum = 0, 0
    for _ = 1, cfg.grad_accum do
      local x, y = train_data:batch(cfg.batch_size)
      local loss, info = model:loss(to_device(x, device), to_device(y, device))
      if cfg.grad_accum > 1 then loss = loss * (1 / cfg.grad_accum) end
      loss:backward()
      loss_sum = loss_sum + info.lm_loss
      aux_sum = aux_sum + (info.aux_loss or 0)
      accumulate_counts(interval.counts, info.stats)
    end
    local gn = clip_grad_norm(params, cfg.clip > 0 and cfg.clip or math.huge)
    opt:step()
    opt:zero_grad()
    step = step + 1
    consumed = consumed + tokens_per_step
    local lm_loss = loss_sum / cfg.grad_accum
    result.losses[step] = lm_loss
    result.step = step
    interval.steps = interval.steps + 1
    interval.loss = interval.loss + lm_loss
    interval.aux = interval.aux + aux_sum / cfg.grad_accum
    interval.gn = interval.gn + gn
    -- the step's tensors (activations, logits, graph) are garbage now: free them before the
    -- next step rather than when Lua's collector, which sees only small handles, gets to them
    collectgarbage()

    if step % cfg.log_every == 0 or step == last then
      if device == "cuda" then moe.cuda.synchronize() end
      local now = moe.clock()
      local dt = now - t_log
      t_log = now
      local n = interval.steps
      local tps = n * tokens_per_step / math.max(dt, 1e-9)
      local rec = {
        step = step, consumed_tokens = consumed, lr = lr, loss = interval.loss / n,
        aux_loss = interval.aux / n, grad_norm = interval.gn / n, tokens_per_s = tps,
        ms_per_iter = 1000 * dt / n, time = os.time(),
      }
      if flops_per_token and peak then rec.mfu = flops_per_token * tps / peak end
      local worst
      if #interval.counts > 0 then
        rec.expert_counts = {}
        for i, name in ipairs(interval.counts) do
          local counts = interval.counts[name]
          rec.expert_counts[name] = counts
          local b = metrics.load_balance(counts)
          if b and (worst == nil or b > worst) then worst = b end
          if tb then
            local total = 0
            for _, c in ipairs(counts) do total = total + c end
            for j, c in ipairs(counts) do
              local layer = tonumber(name:match("%d+")) or (i - 1) -- the block index in "blocks.<i>.ffn"
              tb:add_scalar(("expert_load/layer%d/e%d"):format(layer, j - 1), total > 0 and c / total or 0, step)
            end
          end
        end
        rec.load_balance = worst
      end
      log:write(rec)
      if tb then
        tb:add_scalars(step, { loss = rec.loss, lr = lr, grad_norm = rec.grad_norm, tokens_per_s = tps,
          aux_loss = rec.aux_loss, mfu = rec.mfu, load_balance = worst })
        tb:flush()
      end
      say(metrics.console_line {
        iteration = step, iterations = cfg.steps, consumed_tokens = consumed, ms_per_iter = rec.ms_per_iter,
        lr = lr, loss = rec.loss, aux_loss = rec.aux_loss, grad_norm = rec.grad_norm, tokens_per_s = tps,
        mfu = rec.mfu, load_balance = worst })
      interval = { steps = 0, loss = 0, aux = 0, gn = 0, counts = {} }
    end

    local eval_now = cfg.eval_every > 0 and (step % cfg.eval_every == 0 or step == cfg.steps)
    if valid_data and cfg.eval_iters > 0 and eval_now then
      local vl = with_rng_kept(M.evaluate, model, valid_data, cfg.eval_iters, cfg.batch_size, device)
      result.val_losses[step] = vl
      log:write { step = step, val_loss = vl, val_ppl = math.exp(vl) }
      if tb then tb:add_scalar("val_loss", vl, step); tb:flush() end
      say(("-"):rep(20) .. (" validation loss at iteration %d | lm loss value: %.6E | lm loss PPL: %.6E |"):format(
        step, vl, math.exp(vl)))
    end

    if cfg.sample_every > 0 and step % cfg.sample_every == 0 and step < cfg.steps then
      local text = sample_text(cfg.sample_tokens)
      if text then say(("sample at iteration %d: %q"):format(step, text)) end
    end

    if cfg.save_every > 0 and step % cfg.save_every == 0 then
      save()
      last_saved = step
    end
    if not cfg.quiet then console.bar(step - first_step, last - first_step, moe.clock() - t_run) end
  end
  console.finish()

  if step > 0 and last_saved ~= step and cfg.keep_last > 0 then save() end
  log:close()
  if tb then tb:close() end
  if cfg.sample_tokens > 0 and tokenizer then
    result.sample = sample_text(cfg.sample_tokens)
    say(("sample: %s"):format(result.sample))
  end
  result.seconds = moe.clock() - t_run
  if prev_tf32 ~= nil then moe.set_matmul_tf32(prev_tf32) end
  return result
end

return M
