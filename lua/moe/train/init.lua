--[[
moe/train/init.lua - the training loop: a (d)MoE Transformer LM trained on an
indexed dataset, with evaluation, logging (console, metrics.jsonl,
TensorBoard), atomic checkpoints, exact resumption and hooks.

  local train = require "moe.train"
  local cfg = moe.config(train.defaults())      -- key=value overrides from the command line
  local result = train.run(cfg)                 -- or train.run(cfg, parts)

The parts: moe/train/config.lua (keys, defaults, checks), build.lua (model,
data, optimizer from cfg), loop.lua (the loop), log.lua (console, jsonl,
TensorBoard), hooks.lua (the hook points), parallel.lua (data parallelism).

cfg keys (train.defaults() holds every key with its default; an unknown key
is an error listing the valid ones):
  model.*         nn.TransformerLM options (vocab_size, d_model, n_layers, n_heads, pos,
                  norm, tie_embeddings, dropout, init_std), model.ffn = "moe" | "dense",
                  model.d_ff (dense FFN width) and model.moe.* (kind = "dmoe" | "moe",
                  num_experts, top_k, ffn_hidden_size, mlp_type, activation, mlp_impl,
                  loss_weight, zloss_weight, jitter_eps, capacity_factor, every = a MoE
                  FFN in every n-th layer, dense elsewhere, uniform_expert_assignment)
  data            dataset prefix (prefix.bin/.idx, Megatron-LM format) or "bible"
                  (data.bible_corpus{dir = data_dir}); valid_fraction, data_seed
  seq_len, batch_size, grad_accum, steps    tokens per step = batch_size * grad_accum * seq_len
  lr, min_lr, warmup, decay ("cosine" | "linear" | "constant"), weight_decay, beta1, beta2,
  eps, clip (global grad-norm clip, 0 = off), optimizer ("adamw" | "sgd")
  eval_every, eval_iters      validation loss over the same eval_iters batches each time
  log_every, save_every (0: at the end only), keep_last, out_dir, resume ("" | "latest" | path)
  stop_at         stop after this step as if interrupted (0: run to `steps`); the schedule
                  still spans `steps`, a checkpoint is written; resume=latest continues
  overwrite       a fresh run into an out_dir with ckpt-* folders is an error unless true;
                  then the old checkpoints, metrics.jsonl and tb/ event files are deleted
  deterministic   TF32 off, the attention backward without f32 atomics, cuBLASLt's first
                  heuristic GEMM algorithms (no timing), mlp_impl "auto" by its rule (for the
                  run; set back after); with the same seed a run (and a stopped-and-resumed
                  run) gives bit-identical losses on the same machine
  device ("auto" | "cpu" | "cuda"), dtype ("f32" | "bf16"), seed
  tensorboard, sample_every (0: only at the end), sample_tokens, sample_prompt,
  sample_temperature, sample_top_k, quiet
  parallel.dp     data-parallel ranks (0: the job's world size; 1: no data parallelism);
                  each rank reads rows [r * batch_size, (r + 1) * batch_size) of a global
                  batch of dp * batch_size, gradients are averaged over ranks in buckets of
                  parallel.bucket_mb MiB (moe/train/parallel.lua, docs/DISTRIBUTED.md)

parts (optional; each replaces what run would build from cfg):
  model       a module with named_parameters, state_dict, load_state_dict, train/eval and
              loss(x, y) -> loss tensor, {lm_loss=, aux_loss=, stats=} (moe.nn's contract)
  optimizer   function(named_params, cfg) -> optimizer (step, zero_grad, lr, state_dict,
              state_scalars, load_state_dict)
  schedule    function(step) -> lr;   clip_grad_norm   function(params, max_norm) -> norm
  train_data, valid_data   objects with batch(B) -> x, y (CPU i64), state(), set_state(s)
  tokenizer   with encode(str) and decode(ids), for samples
  hooks       {name = function(state, ...) or a list of them}: load, after_backward,
              before_step, after_step, on_log, on_eval, save (docs/TRAINING.md)
  layout      function(name, module) -> "replicate" | "shard" | "expert" | nil: where each
              module's parameters live (moe/train/parallel.lua M.place, docs/DISTRIBUTED.md)
  profile     function(phase, step), called as each phase of a step begins (loop.PHASES)

Returns {losses = {step -> lm loss}, val_losses = {step -> loss}, step = last step,
checkpoint = last checkpoint path or nil, sample = last sample text or nil, model = model}.
Files in out_dir: metrics.jsonl, tb/events.out.tfevents.*, ckpt-<step>/ (see moe.checkpoint).
]]
local tconfig = require "moe.train.config"
local build = require "moe.train.build"
local loop = require "moe.train.loop"

return {
  defaults = tconfig.defaults,             -- () -> every cfg key with its default
  config = tconfig.config,                 -- (cfg) -> a complete, checked copy
  resolve_device = tconfig.resolve_device, -- ("auto" | "cpu" | "cuda") -> "cpu" | "cuda"
  build_model = build.model,               -- (cfg, device) -> nn.TransformerLM
  load_model = build.load_model,           -- (ckpt_path, device) -> model (eval mode), cfg
  build_data = build.data,                 -- (cfg) -> train_data, valid_data, tokenizer
  evaluate = loop.evaluate,                -- (model, data, iters, batch_size, device [, par]) -> mean loss
  run = loop.run,                          -- (cfg [, parts]) -> result
  hooks = require("moe.train.hooks").names, -- the hook names, in the order they first run
}
