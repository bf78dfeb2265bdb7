--[[
experiments/quickstart.lua - the first thing to run: a tiny dMoE language
model (4 layers, d_model 128, 8 experts top-2, byte tokens, seq_len 128)
trained on the King James Bible (Debian's bible-kjv, preprocessed once into
data/) for about two minutes on 2 CPU cores, or on the GPU when there is one.
It prints the unigram baseline of the corpus (the loss of a model that
ignores context), Megatron-style log lines, the validation loss, and a
sample of generated text; everything lands in out/quickstart (metrics.jsonl,
TensorBoard events in tb/, checkpoints).

  moe-lua experiments/quickstart.lua                      # device=auto
  moe-lua experiments/quickstart.lua steps=600 model.moe.num_experts=16
  moe-lua experiments/quickstart.lua resume=latest steps=600   # continue
  moe-lua experiments/quickstart.lua --help               # every key and its default
  moe-lua plot out_dir=out/quickstart                     # loss.png, expert_load.png
  moe-lua sample out_dir=out/quickstart prompt="And God said"
]]
local moe = require "moe"
local train = require "moe.train"
local data = require "moe.data"

local defaults = train.defaults()
defaults.model.d_model, defaults.model.n_layers, defaults.model.n_heads = 128, 4, 4
defaults.model.moe.num_experts, defaults.model.moe.top_k = 8, 2
defaults.model.moe.ffn_hidden_size = 256
defaults.data, defaults.seq_len, defaults.batch_size = "bible", 128, 8
defaults.steps, defaults.lr, defaults.min_lr, defaults.warmup = 150, 3e-3, 3e-4, 20
defaults.weight_decay = 0.0
defaults.eval_every, defaults.eval_iters, defaults.log_every = 50, 4, 10
defaults.out_dir, defaults.keep_last, defaults.save_every = "out/quickstart", 2, 50
defaults.sample_tokens, defaults.sample_prompt = 300, "And God said"
local cfg = moe.config(defaults)

-- The baseline to beat: the unigram entropy of the corpus (nats per byte).
local prefix = data.bible_corpus { dir = cfg.data_dir }
cfg.data = prefix
local baseline = data.unigram_entropy(data.IndexedDataset(prefix))
print(("quickstart: King James Bible at %s; unigram baseline %.4f nats/byte"):format(prefix, baseline))

local result = train.run(cfg)

local last_step, last_val = -1, nil
for step, v in pairs(result.val_losses) do
  if step > last_step then last_step, last_val = step, v end
end
print(("quickstart: %d steps in %.0f s"):format(result.step, result.seconds))
if last_val then
  local gap = baseline - last_val
  print(("quickstart: validation loss %.4f at step %d vs unigram baseline %.4f (%.2f nats %s)"):format(
    last_val, last_step, baseline, math.abs(gap), gap >= 0 and "below" or "above"))
end
