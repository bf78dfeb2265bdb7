--[[
moe/train/loop.lua - the training loop of moe.train: resume, the steps
(gradient accumulation, clipping, the optimizer), evaluation, samples and
checkpoints, with the hooks of moe/train/hooks.lua at fixed points.

Memory: each micro-batch, each optimizer step and each evaluation batch runs
as an outermost moe.scope, which frees every tensor handle it made when it
ends (what autograd saved was already released by backward), so device
memory returns to the caching allocator then, not when Lua's collector gets
to the handles, and nothing of one micro-batch is alive during the next.
after_backward runs inside the micro-batch's scope, before_step and
after_step inside the optimizer step's: a tensor a hook makes and wants to
keep past it goes through moe.keep.

Guards (docs/TRAINING.md "Stops, non-finite steps and config checks"):
  - SIGTERM and SIGINT (Ctrl-C) arm no error while the loop runs: they set a
    flag (moe.proc.soft_stop), which the loop reads once per step; it then
    saves a checkpoint of the step it finished, and raises "stopped by
    SIGTERM at step N; ..." after moe.proc.stopped, so moe-lua exits with
    128 + the signal. A second signal raises at once, as outside the loop.
  - A step whose loss or gradient norm is not finite is skipped: no optimizer
    update, the gradients zeroed, counted (state.skipped_steps, metrics'
    skipped_steps); the learning rate follows the steps that updated
    (Megatron's scheduler). max_skipped_in_a_row of them in a row stop the
    run with an error, saving nothing.
  - With several ranks, both decisions are one all_reduce (max) of two
    numbers per step, in the optimizer step: every rank skips and stops at
    the same step. With one, nothing is exchanged.

Host reads: a step reads the device once, for the non-finite check: the
micro-batches' lm and aux losses stay on the device (model:loss(x, y,
{lazy = true}); a model without that option returns numbers, used as they
are) and are copied to the host with the gradient norm, when clipping leaves
it on the device, in one copy after clipping (read_values). A hook of
after_backward or before_step sees numbers: with one, the losses are read
there instead. The bindings' backstop collection (moe.cuda.set_gc_step) is
held off while a step runs: every tensor of the step is freed by its scopes.
parts.profile (function(phase, step)) is called as each phase of a step
begins (PHASES), for bench/train_125m.lua's per-phase profile.
]]
local moe = require "moe"
local checkpoint = require "moe.checkpoint"
local metrics = require "moe.metrics"
local tconfig = require "moe.train.config"
local build = require "moe.train.build"
local thooks = require "moe.train.hooks"
local tlog = require "moe.train.log"
local parallel = require "moe.train.parallel"
local autotune = require "moe.experts.autotune"

local M = {}

local function finite(x) return x == x and x ~= math.huge and x ~= -math.huge end

-- The phases of a step, in order, as parts.profile sees them begin: the batch
-- read and copied to the device; model:loss; backward (with the gradients'
-- reduction under data parallelism); stats (expert counts, after_backward and
-- before_step hooks, the micro-batch's end); clipping; the step's host read
-- (and the ranks' agreement); the optimizer (with after_step hooks and
-- zero_grad); log (the losses' bookkeeping, logging, evaluation, checkpoints,
-- up to the next step). "end" marks the end of the last step.
M.PHASES = { "data", "forward", "backward", "stats", "clip", "read", "optimizer", "log" }

-- model:loss's option: the losses as device scalars, read once per step.
local LOSS_OPTS = { lazy = true }
-- clip_grad_norm's third argument. A clip that returns the norm as a device
-- scalar ({lazy = true}) joins the step's one read (read_values); one that
-- returns a number (moe.optim's now, a caller's) reads it itself.
local CLIP_OPTS = nil

-- read_values(vals [, gn]) -> gn as a number. vals: the micro-batches' {lm, aux},
-- each a number or a device scalar (detached); every device scalar among them,
-- and gn when it is one, is copied to the host in one copy (a cat of the
-- scalars, then one read; none when all are numbers) and replaced by its number.
-- Values of another dtype than the first device scalar's go through f64, which
-- holds every f32 and bf16 value exactly.
local function read_values(vals, gn)
  local dev, where = {}, {}
  for i, v in ipairs(vals) do
    for j = 1, 2 do
      if moe.is_tensor(v[j]) then dev[#dev + 1], where[#dev + 1] = v[j], { i, j } end
    end
  end
  local gn_dev = moe.is_tensor(gn)
  if gn_dev then dev[#dev + 1] = gn end
  if #dev == 0 then return gn end
  local host = moe.no_grad(function()
    local parts, dtype = {}, dev[1].dtype
    local same = true
    for i, t in ipairs(dev) do
      parts[i] = t:reshape({ 1 })
      same = same and t.dtype == dtype
    end
    if not same then
      for i, t in ipairs(parts) do if t.dtype ~= "f64" then parts[i] = t:to("f64") end end
    end
    local all = #parts == 1 and parts[1] or moe.cat(parts, 0)
    local h = all:totable() -- the one host read
    for _, t in ipairs(parts) do t:free() end
    all:free()
    return h
  end)
  for k, w in ipairs(where) do
    vals[w[1]][w[2]] = host[k]
    dev[k]:free()
  end
  if gn_dev then gn = host[#dev] end
  return gn
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

-- One evaluation batch in its own scope: {lm loss}, a number or a device scalar
-- (read with the others by evaluate: one read per evaluation).
local function eval_batch(model, data, batch_size, device, par)
  local x, y
  if par then x, y = par:batch(data, batch_size) else x, y = data:batch(batch_size) end
  local _, info = model:loss(to_device(x, device), to_device(y, device), LOSS_OPTS)
  local lm = info.lm_loss
  return { moe.is_tensor(lm) and lm:detach() or lm, 0 }
end

--- evaluate(model, data, iters, batch_size, device [, par]) -> mean lm loss over iters
--- batches (no grad, eval mode; data is rewound to where it was so each call sees the
--- same batches). With par (moe/train/parallel.lua) each rank evaluates its rows of
--- global batches of dp * batch_size and the result is the mean over ranks.
function M.evaluate(model, data, iters, batch_size, device, par)
  if iters == 0 then return nil end
  local start = data:state()
  local vals = {}
  moe.no_grad(function()
    model:eval()
    for i = 1, iters do vals[i] = moe.scope(eval_batch, model, data, batch_size, device, par) end
    model:train()
  end)
  data:set_state(start)
  read_values(vals)
  local total = 0
  for _, v in ipairs(vals) do total = total + v[1] end
  if par then return par:mean({ total / iters })[1] end
  return total / iters
end

-- Sharded data parallelism (parallel.dp_shard; moe/train/parallel.lua): the
-- optimizer is optim.ShardedAdamW, whose reducer (reduce_scatter) replaces the
-- DDP one and whose clip_grad_norm takes the global norm of the shards. A
-- caller's optimizer cannot be sharded for it.
local function sharded_optimizer(par, named, cfg, parts, model)
  if parts.optimizer then
    error("train: parts.optimizer cannot be used with parallel.dp_shard (the optimizer is sharded: " ..
      "optim.ShardedAdamW, from cfg's AdamW settings)", 0)
  end
  local opt = par:sharded_optimizer(named, cfg, model)
  local clip = parts.clip_grad_norm or function(_, max_norm) return opt:clip_grad_norm(max_norm) end
  return opt, opt.reducer, clip
end

-- The number of records in a metrics.jsonl (0 when there is none).
local function jsonl_records(path)
  local f = io.open(path, "r")
  if not f then return 0 end
  local n = 0
  for line in f:lines() do if line:match("%S") then n = n + 1 end end
  f:close()
  return n
end

-- Makes out_dir safe to start in, before anything is built or written; returns the
-- lines to print once the log is open. A fresh run (resume empty) into an out_dir
-- that holds ckpt-* folders is an error, raised on every rank (each reads out_dir),
-- unless overwrite=true: then rank 0 removes what an earlier run wrote there
-- (checkpoint.remove_run). So is a run that starts from step 0 (fresh, or
-- resume=latest finding no checkpoint) into an out_dir whose metrics.jsonl holds
-- records of an earlier run that left no checkpoint: it would start that file anew.
-- (TensorBoard's event files are never overwritten: each run writes its own.)
-- Rank 0 also removes the .tmp-ckpt-* folders of saves that were killed.
local function prepare_out_dir(cfg, writer)
  local fresh = cfg.resume == "" or cfg.resume == "none"
  if cfg.overwrite and not fresh then
    error(("train: overwrite=true starts afresh but resume='%s' continues a run: pass one of them"):format(
      cfg.resume), 0)
  end
  local old = checkpoint.folders(cfg.out_dir)
  if fresh and #old > 0 and not cfg.overwrite then
    error(("train: out_dir '%s' already holds checkpoints (%s) and this run would mix with them: pass " ..
      "resume=latest to continue that run, or overwrite=true to delete its checkpoints, metrics.jsonl and " ..
      "tb/ and start afresh (or choose another out_dir)"):format(cfg.out_dir, table.concat(old, ", ")), 0)
  end
  local records = #old == 0 and not cfg.overwrite and (fresh or cfg.resume == "latest")
    and jsonl_records(cfg.out_dir .. "/metrics.jsonl") or 0
  if records > 0 then
    error(("train: out_dir '%s' holds the metrics.jsonl of an earlier run (%d record%s) but no checkpoint to " ..
      "resume from, and this run would start that file anew: pass overwrite=true%s to delete it (and tb/) and " ..
      "start afresh, or choose another out_dir"):format(cfg.out_dir, records, records == 1 and "" or "s",
      fresh and "" or " instead of resume=latest"), 0)
  end
  local notes = {}
  if not writer then return notes end
  if fresh and cfg.overwrite then
    local removed = checkpoint.remove_run(cfg.out_dir)
    if #removed > 0 then
      notes[#notes + 1] = ("overwrite=true: removed %s from %s"):format(table.concat(removed, ", "), cfg.out_dir)
    end
  end
  local unfinished = checkpoint.remove_unfinished(cfg.out_dir)
  if #unfinished > 0 then
    notes[#notes + 1] = ("removed the unfinished checkpoint%s of an interrupted save from %s: %s"):format(
      #unfinished == 1 and "" or "s", cfg.out_dir, table.concat(unfinished, ", "))
  end
  return notes
end

--- run(cfg [, parts]) -> result (see moe/train/init.lua).
function M.run(user_cfg, parts)
  parts = parts or {}
  local cfg = tconfig.config(user_cfg)
  tconfig.check(cfg)
  local hooks = thooks.check(parts.hooks)
  -- data parallelism (moe/train/parallel.lua): the ranks, and each rank's device
  local par = parallel.setup(cfg)
  local device = par.device or tconfig.resolve_device(cfg.device)
  local notes = prepare_out_dir(cfg, par.writer)

  -- deterministic: TF32 off, the attention backward without f32 atomics, cuBLASLt's first
  -- heuristic pick (no timing), and mlp_impl "auto" by its rule (timed picks could differ
  -- between runs); all set back when the run ends, by an error too
  local det <close> = setmetatable({ mode = autotune.mode, knobs = {} }, { __close = function(o)
    autotune.mode = o.mode
    for k, v in pairs(o.knobs) do moe.set_knob(k, v) end
    if o.tf32 ~= nil then moe.set_matmul_tf32(o.tf32) end
  end })
  if cfg.deterministic then
    if moe.set_matmul_tf32 then det.tf32 = moe.set_matmul_tf32(false) end
    autotune.mode = "rule"
    det.knobs.MOE_ATTN_DETERMINISTIC = moe.set_knob("MOE_ATTN_DETERMINISTIC", 1)
    det.knobs.MOE_GEMM_TUNE = moe.set_knob("MOE_GEMM_TUNE", 0)
  end
  moe.manual_seed(cfg.seed)

  local model = parts.model or build.model(cfg, device, par.ep_group, par.etp_group)
  local train_data, valid_data, tokenizer = parts.train_data, parts.valid_data, parts.tokenizer
  if not train_data then
    local td, vd, tk = build.data(cfg)
    train_data, valid_data, tokenizer = td, valid_data or vd, tokenizer or tk
  end
  local named = model:named_parameters()
  local params = {}
  for i, p in ipairs(named) do params[i] = p[2] end
  par:attach(model, parts.layout) -- which parameters are expert shards; a layout places every module
  -- the same seed made the same model on every rank; rank 0's values make sure of it
  -- (before the optimizer copies master weights from the parameters)
  par:broadcast_params(params)
  local opt, sharded_reducer, sharded_clip
  if par.sharded then
    opt, sharded_reducer, sharded_clip = sharded_optimizer(par, named, cfg, parts, model)
    if par.fsdp then -- parameter sharding made the model's parameters anew
      named = model:named_parameters()
      for i, p in ipairs(named) do params[i] = p[2] end
    end
  else
    opt = (parts.optimizer or build.optimizer)(named, cfg)
  end
  local schedule = parts.schedule or require("moe.optim").schedule {
    lr = cfg.lr, min_lr = cfg.min_lr, warmup = cfg.warmup, total = cfg.steps, decay = cfg.decay }
  local optim = require "moe.optim"
  local clip_grad_norm = sharded_clip or parts.clip_grad_norm or optim.clip_grad_norm
  -- moe.optim's AdamW with its own clipping and no expert shards: the norm and the clip
  -- coefficient stay on the device (optim.grad_norm), the norm joins the step's one read,
  -- and the step applies the coefficient as it reads each gradient (no pass of its own)
  local fused_clip = not sharded_clip and not parts.clip_grad_norm and par.shards == 1
    and getmetatable(opt) and getmetatable(opt).__index == optim.AdamWClass
  -- the sharded AdamW likewise (its norm summed over the shard group on the device), when no
  -- expert shards join the norm
  local sharded_fused = sharded_clip and not parts.clip_grad_norm and par.shards == 1
    and type(opt.grad_norm) == "function"
  -- and with expert shards (no sharded optimizer): the norm over every rank's experts, on the device
  local ep_fused = not sharded_clip and not parts.clip_grad_norm and par.shards > 1
    and getmetatable(opt) and getmetatable(opt).__index == optim.AdamWClass
  clip_grad_norm = par:ep_clip(clip_grad_norm) -- expert shards: the norm over every rank's

  -- only rank 0 writes: out_dir, logs, metrics, TensorBoard, checkpoints, samples
  if par.writer then
    checkpoint.mkdir_p(cfg.out_dir)
    -- the resolved config of this run (a resumed run writes its own)
    checkpoint.write_atomic(cfg.out_dir .. "/config.json", metrics.json.encode(tconfig.plain(cfg)) .. "\n")
  end
  local result = { losses = {}, val_losses = {}, model = model, step = 0 }
  -- what every hook sees (docs/TRAINING.md): the loop updates it in place
  local state = { cfg = cfg, device = device, model = model, optimizer = opt, params = params,
    named_params = named, train_data = train_data, valid_data = valid_data, result = result,
    step = 0, consumed_tokens = 0, parallel = par, skipped_steps = 0, skipped_in_a_row = 0 }
  -- the gradients' all_reduce (avg) over ranks, armed for the last micro-batch of a step
  local reducer = sharded_reducer or par:reducer(params, cfg.parallel.bucket_mb)

  -- resume
  -- resume=latest: the newest checkpoint that verifies (rank 0 warns about damaged ones); the
  -- ranks share the hashing: each verifies its part of the files, and they agree (MPI, host)
  local ropts = { quiet = not par.writer }
  local world = par.dist and par.dist.world_size() or 1
  if world > 1 then
    ropts.part, ropts.parts = par.dist.rank() + 1, world
    ropts.agree = function(ok)
      local t = moe.tensor({ ok and 1 or 0 }, { dtype = "f64" })
      par.dist.all_reduce(t, "min")
      local all = t:item() == 1
      t:free()
      return all
    end
  end
  local resume_path = checkpoint.resolve(cfg.out_dir, cfg.resume, ropts)
  local pending_say
  if resume_path then
    local c
    if par:uses_dcp(resume_path) then -- sharded checkpoints, onto any layout (moe/train/dcp.lua)
      c = par:load_checkpoint(resume_path, model, opt)
    else
      c = checkpoint.load(resume_path, { device = device })
    end
    local was, now = c.state.tokenizer, require("moe.data.tokenizer").record(tokenizer)
    if was and now and (was.kind ~= now.kind or was.vocab_size ~= now.vocab_size or was.eod ~= now.eod) then
      error(("train: %s was trained with a %s tokenizer (vocab_size %s), the data now has a %s tokenizer " ..
        "(vocab_size %s)"):format(resume_path, tostring(was.kind), tostring(was.vocab_size), tostring(now.kind),
        tostring(now.vocab_size)), 0)
    end
    if not par:uses_dcp(resume_path) then
      thooks.call(hooks.load, state, c)
      model:load_state_dict(c.model)
      opt:load_state_dict(c.optim, c.state.optim_scalars or {})
    end
    moe.set_rng_state(c.state.rng)
    train_data:set_state(c.state.data)
    state.step, state.consumed_tokens = c.state.step, c.state.consumed_tokens or 0
    state.skipped_steps = c.state.skipped_steps or 0
    result.checkpoint = resume_path
    pending_say = ("resumed from %s at iteration %d"):format(resume_path, state.step)
  elseif cfg.resume == "latest" then
    pending_say = ("no checkpoint in %s: starting from scratch"):format(cfg.out_dir)
  end
  result.step = state.step

  local n_params = 0
  for _, p in ipairs(params) do n_params = n_params + p:numel() end
  local peak
  if tconfig.is_cuda(device) then
    peak = par.dp * metrics.peak_flops_for(moe.cuda.get_device_name(tconfig.cuda_index(device)), cfg.dtype,
      not cfg.deterministic and moe.matmul_tf32 and moe.matmul_tf32() or false)
  end
  -- tokens of the whole job per step (every rank's)
  local tokens_per_step = par.dp * cfg.batch_size * cfg.grad_accum * cfg.seq_len
  local log = tlog.open(cfg, { device = device, resumed = resume_path ~= nil, resume_step = state.step,
    tokens_per_step = tokens_per_step,
    flops_per_token = model.flops_per_token and model:flops_per_token() or nil, peak = peak,
    writer = par.writer })
  for _, line in ipairs(notes) do log:say(line) end
  if pending_say then log:say(pending_say) end
  if log.dropped and log.dropped > 0 then
    log:say(("metrics.jsonl: dropped %d record%s past iteration %d (the steps this run redoes)"):format(
      log.dropped, log.dropped == 1 and "" or "s", state.step))
  end
  log:say(("training on %s (%s): %d parameters, %d steps of %d tokens, out_dir=%s"):format(device,
    cfg.dtype, n_params, cfg.steps, tokens_per_step, cfg.out_dir))
  if par.sharded then
    log:say(("sharded data parallel (ZeRO-2) over %d ranks: optimizer state and gradients sharded over " ..
      "%d, replicated %d times; gradients in %d bucket%s"):format(par.dp, par.dp_shard, par.dp_replicate,
      reducer:buckets(), reducer:buckets() == 1 and "" or "s"))
  elseif par.dp > 1 then
    log:say(("data parallel over %d ranks: %d sequences per rank per micro-batch, gradients in %d bucket%s"):format(
      par.dp, cfg.batch_size, reducer:buckets(), reducer:buckets() == 1 and "" or "s"))
  end
  if par.placement then log:say(par:placement_summary()) end
  if par.shards > 1 then
    log:say(("expert shards over groups of %d ranks (ep=%d x etp=%d): %d expert tensors sharded"):format(
      par.shards, par.ep, par.etp, #par.expert_params))
  end

  local function sample_text(n)
    -- an expert-parallel model runs collectives: rank 0 cannot generate alone
    if not tokenizer or not par.writer or par.shards > 1 then return nil end
    local sample = require "moe.sample"
    return with_rng_kept(function()
      moe.manual_seed(cfg.seed + state.step)
      return sample.text(model, tokenizer, cfg.sample_prompt, {
        max_new_tokens = n, temperature = cfg.sample_temperature, top_k = cfg.sample_top_k,
        seq_len = cfg.seq_len, device = device })
    end)
  end

  local function save()
    local rank_state = { rng = moe.get_rng_state(), data = tconfig.plain(train_data:state()) }
    local tok_rec, tok_files = require("moe.data.tokenizer").record(tokenizer)
    -- every rank writes its shards (moe/train/dcp.lua); one process too when its saves are
    -- asynchronous and no save hook writes them
    if par.distributed or (cfg.save_async and #hooks.save == 0) then
      local path = par:save_checkpoint(state.step, model, opt, rank_state, { consumed_tokens = state.consumed_tokens,
        skipped_steps = state.skipped_steps, tokenizer = tok_rec, files = tok_rec and tok_files or nil,
        config = tconfig.plain(cfg), optim_scalars = tconfig.plain(opt:state_scalars()) })
      if path then
        result.checkpoint, state.checkpoint = path, path
        log:say(("saved checkpoint %s"):format(path))
      end
      return
    end
    if not par.writer then return end -- rank 0 writes; the others hold the same state
    local ckpt = {
      model = model:state_dict(), optim = opt:state_dict(),
      state = { consumed_tokens = state.consumed_tokens, rng = rank_state.rng,
        skipped_steps = state.skipped_steps,
        data = rank_state.data, config = tconfig.plain(cfg),
        optim_scalars = tconfig.plain(opt:state_scalars()) },
    }
    -- the tokenizer's record in state.json and its files in the checkpoint folder
    if tok_rec then ckpt.state.tokenizer, ckpt.files = tok_rec, tok_files end
    -- a save hook may add to ckpt, or write it itself and return the path
    local path = thooks.call(hooks.save, state, ckpt)
    if path == nil then path = checkpoint.save(cfg.out_dir, state.step, ckpt, { keep_last = cfg.keep_last }) end
    result.checkpoint = path
    state.checkpoint = path
    log:say(("saved checkpoint %s"):format(path))
  end

  -- The stop flag and whether this rank's step went non-finite, agreed over the ranks
  -- (one all_reduce (max) of two numbers; nothing with one rank): the signal to stop
  -- on (0: none) and whether every rank skips the step.
  local proc = moe.proc
  local function agree(bad)
    local sig = proc.stop_requested() or 0
    if par.dp == 1 then return sig, bad end
    local t = moe.tensor({ sig, bad and 1 or 0 }, { dtype = "f64" })
    par.dist.all_reduce(t, "max")
    local v = t:totable()
    t:free()
    return math.tointeger(v[1]), v[2] > 0
  end

  -- One micro-batch: forward, backward and the after_backward hooks. It runs as
  -- an outermost moe.scope, so what the micro-batch made (the batch, activations
  -- autograd did not save, the loss, the routers' plans and statistics) is freed
  -- when it ends, before the next micro-batch or the optimizer step.
  -- With data parallelism each rank reads its rows of the global batch, and the
  -- last micro-batch's backward all-reduces the gradients (the earlier ones
  -- accumulate locally, as DDP's no_sync): finished before after_backward, so
  -- hooks and clipping see the global gradient.
  local mark = parts.profile or function() end
  local function micro_step(micro)
    mark("data", state.step + 1)
    local x, y = par:batch(train_data, cfg.batch_size)
    x, y = to_device(x, device), to_device(y, device)
    mark("forward", state.step + 1)
    local loss, info = model:loss(x, y, LOSS_OPTS)
    if cfg.grad_accum > 1 then loss = loss * (1 / cfg.grad_accum) end
    local sync = reducer and micro == cfg.grad_accum
    if sync then reducer:arm() end
    mark("backward", state.step + 1)
    loss:backward()
    if par.fsdp and not sync then par.fsdp:release_all() end -- gathered by this backward
    if sync then
      reducer:finish()
      par:finish_experts() -- expert shards: the replicas' mean, / ep
    end
    mark("stats", state.step + 1)
    log:count_experts(info.stats)
    -- {lm, aux}: numbers, or device scalars until the step's read (new handles:
    -- they outlive this scope, which frees the model's)
    local lm, aux = info.lm_loss, info.aux_loss or 0
    local v = { moe.is_tensor(lm) and lm:detach() or lm, moe.is_tensor(aux) and aux:detach() or aux }
    if #hooks.after_backward > 0 then -- hooks see numbers
      read_values({ v })
      state.micro, state.loss, state.lm_loss, state.aux_loss = micro, loss, v[1], v[2]
      thooks.call(hooks.after_backward, state)
      state.loss = nil
    end
    state.micro = micro
    return v
  end

  -- The step's means of the micro-batches' losses, summed in order (host numbers).
  local function step_means(vals)
    local loss_sum, aux_sum = 0, 0
    for _, v in ipairs(vals) do loss_sum, aux_sum = loss_sum + v[1], aux_sum + v[2] end
    state.lm_loss, state.aux_loss = loss_sum / cfg.grad_accum, aux_sum / cfg.grad_accum
  end

  -- The optimizer step with its hooks, in a moe.scope of its own (a hook's
  -- temporaries are freed when it ends). vals: the micro-batches' losses.
  -- A step whose loss or gradient norm is not finite (on any rank) is skipped:
  -- no update; the gradients are zeroed below as after every step.
  local function optimizer_step(vals)
    if #hooks.before_step > 0 then -- hooks see numbers
      read_values(vals)
      step_means(vals)
      thooks.call(hooks.before_step, state)
    end
    mark("clip", state.step + 1)
    local max_norm = cfg.clip > 0 and cfg.clip or math.huge
    local gn, coef
    if fused_clip then
      gn, coef = optim.grad_norm(params, max_norm)
    elseif sharded_fused then
      gn, coef = opt:grad_norm(max_norm)
    elseif ep_fused then
      gn, coef = par:ep_grad_norm(params, max_norm)
    else
      gn = clip_grad_norm(params, max_norm, CLIP_OPTS)
    end
    mark("read", state.step + 1)
    gn = read_values(vals, gn) -- the step's one host read
    step_means(vals)
    local sig, bad = agree(not (finite(gn) and finite(state.lm_loss) and finite(state.aux_loss)))
    mark("optimizer", state.step + 1)
    state.stop_signal = sig > 0 and sig or nil
    state.skipped = bad
    if bad then
      state.skipped_steps = state.skipped_steps + 1
      state.skipped_in_a_row = state.skipped_in_a_row + 1
    else
      state.skipped_in_a_row = 0
      if coef and cfg.clip > 0 then opt:step { grad_scale = coef } else opt:step() end
    end
    state.step = state.step + 1
    state.consumed_tokens = state.consumed_tokens + tokens_per_step
    state.grad_norm = gn
    thooks.call(hooks.after_step, state)
    opt:zero_grad()
    return gn
  end

  -- The bindings' backstop collection (every gc_step MiB of new CUDA storage) finds
  -- nothing to free in a step, whose scopes free every tensor it makes: it is held
  -- off while a step runs (set_gc_step(0) also zeroes the debt), and restored after.
  local gc_step = moe.cuda and moe.cuda.set_gc_step
  local gc_restore = { __close = function(o) gc_step(o.prev) end }
  local function train_step()
    local _ <close> = gc_step and setmetatable({ prev = gc_step(0) }, gc_restore) or nil
    local vals = {}
    for micro = 1, cfg.grad_accum do vals[micro] = moe.scope(micro_step, micro) end
    local gn = moe.scope(optimizer_step, vals)
    state.micro = nil
    mark("log", state.step)
    return gn
  end

  -- one full collection before the first step: what building the model, the optimizer
  -- and the data left behind (temporaries of initialisation); steps free their own
  collectgarbage()
  local first_step = state.step
  local last_saved = resume_path and state.step or -1
  local interval = {} -- {step, lm, aux} of the steps since the last log (data parallelism)
  local last = cfg.stop_at > 0 and math.min(cfg.stop_at, cfg.steps) or cfg.steps
  local stop_sig -- the signal the run stops on
  -- signals set a flag until the run returns or raises (then the previous mode is back)
  local _ <close> = setmetatable({ prev = proc.soft_stop(true) }, {
    __close = function(o) proc.soft_stop(o.prev) end })
  local function finish() -- what every end of the run does, on every rank
    local committed = par:finish_checkpoint() -- an asynchronous save's commit
    if committed then
      result.checkpoint, state.checkpoint = committed, committed
      log:say(("saved checkpoint %s"):format(committed))
    end
    log:close()
    if reducer then reducer:free() end
    if par.sharded then opt:free() end
    par:barrier() -- no rank returns before rank 0 has written its last checkpoint
  end
  while state.step < last do
    -- the learning rate of the updates made so far (skipped steps do not advance it)
    local lr = schedule(state.step - state.skipped_steps)
    if not finite(lr) then
      error(("train: the learning-rate schedule gave %s at step %d"):format(tostring(lr), state.step), 0)
    end
    opt.lr = lr
    state.lr = lr
    local gn = train_step()
    for _, line in ipairs(autotune.take_new()) do log:say(line) end
    local step = state.step
    if step == first_step + 1 and par.writer and os.getenv("MOE_LAUNCH_TIMELINE") then -- launch's restart timeline
      require("moe.cli.launch").timeline_event("first_step", { step = step, resumed = resume_path })
    end
    result.losses[step] = state.lm_loss
    result.step = step
    if state.skipped then
      log:skip_step()
      local what = finite(gn) and "loss" or (finite(state.lm_loss) and "gradient norm" or "loss and gradient norm")
      log:say(("iteration %d: non-finite %s (lm loss %s, grad norm %s): step skipped, no update " ..
        "(%d in a row)"):format(step, what, tostring(state.lm_loss), tostring(gn), state.skipped_in_a_row))
    else
      log:add_step(state.lm_loss, state.aux_loss, gn)
      interval[#interval + 1] = { step, state.lm_loss, state.aux_loss }
    end
    if state.skipped_in_a_row >= cfg.max_skipped_in_a_row then
      finish()
      local ckpt = result.checkpoint and (" (the last checkpoint, %s, is from before them)"):format(
        result.checkpoint) or ""
      error(("train: %d steps in a row had a non-finite loss or gradient norm (max_skipped_in_a_row=%d; " ..
        "the last at iteration %d: lm loss %s, grad norm %s): stopped without saving%s; lower lr, raise " ..
        "warmup, set clip, or check the data"):format(state.skipped_in_a_row, cfg.max_skipped_in_a_row, step,
        tostring(state.lm_loss), tostring(gn), ckpt), 0)
    end

    if log:due(step, last) then
      -- the global means of the interval's losses (one collective per log step)
      log:global(par, interval)
      for _, e in ipairs(interval) do result.losses[e[1]] = e[2] end
      interval = {}
      local rec = log:record(step, lr, state.consumed_tokens)
      thooks.call(hooks.on_log, state, rec)
      log:write(rec)
    end

    local eval_now = cfg.eval_every > 0 and (step % cfg.eval_every == 0 or step == cfg.steps)
    if valid_data and cfg.eval_iters > 0 and eval_now then
      local vl = with_rng_kept(M.evaluate, model, valid_data, cfg.eval_iters, cfg.batch_size, device,
        par.dp > 1 and par or nil)
      result.val_losses[step] = vl
      state.val_loss = vl
      thooks.call(hooks.on_eval, state, vl)
      log:eval(step, vl)
    end

    if cfg.sample_every > 0 and step % cfg.sample_every == 0 and step < cfg.steps then
      local text = sample_text(cfg.sample_tokens)
      if text then log:say(("sample at iteration %d: %q"):format(step, text)) end
    end

    if cfg.save_every > 0 and step % cfg.save_every == 0 then
      save()
      last_saved = step
    end
    log:bar(step - first_step, last - first_step)
    -- several ranks: the flag agreed in the optimizer step (a rank's own flag could
    -- be set since, on it alone); one: read it now
    if par.dp > 1 then stop_sig = state.stop_signal else stop_sig = proc.stop_requested() end
    if stop_sig then break end
  end
  mark("end", state.step)
  log:finish_bar()
  -- a signal during the last step's save or evaluation stops the run too
  if not stop_sig and par.dp == 1 then stop_sig = proc.stop_requested() end

  if state.step > 0 and last_saved ~= state.step and cfg.keep_last > 0 then save() end
  finish()
  if stop_sig then
    local name = stop_sig == 2 and "SIGINT" or stop_sig == 15 and "SIGTERM" or ("signal " .. stop_sig)
    local saved = "saved nothing (keep_last=0)"
    if cfg.keep_last > 0 then
      saved = ("saved %s (resume=latest continues)"):format(checkpoint.dir_name(cfg.out_dir, state.step):match("[^/]*$"))
    end
    proc.stopped(stop_sig)
    error(("stopped by %s at step %d; %s"):format(name, state.step, saved), 0)
  end
  if cfg.sample_tokens > 0 and tokenizer then
    result.sample = sample_text(cfg.sample_tokens)
    if result.sample then log:say(("sample: %s"):format(result.sample)) end
  end
  result.seconds = log:elapsed()
  result.skipped_steps = state.skipped_steps
  return result
end

return M
