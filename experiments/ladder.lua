--[[
experiments/ladder.lua - MegaBlocks' model ladder as moe.train configs: the
dense GPT, the dropless MoE (dMoE: 64 experts, top-1, expert width = the
dense FFN width) and the capacity-factor MoE (the same experts, capacity
factor 1, tokens over capacity dropped) at the 46M (6 layers, hidden 512),
125M (12, 768) and 356M (24, 1024) sizes, sequence length 1024, byte
vocabulary on the King James Bible unless data= says otherwise.

  moe-lua experiments/ladder.lua size=125m kind=dmoe                # train (device=auto, bf16)
  moe-lua experiments/ladder.lua size=46m kind=dense steps=2000 batch_size=16
  moe-lua experiments/ladder.lua size=356m kind=moe show=true       # print the config, no training
  moe-lua experiments/ladder.lua size=125m kind=dmoe --help         # every train key and its default

size= and kind= pick the row; every other key=value overrides a moe.train key
(lua/moe/train/config.lua). The sizes are the "model" part of MegaBlocks'
exp/gpt2/gpt2_{46m,125m,356m}_*.sh and exp/dmoe/dmoe_{46m,125m,356m}_*.sh
(layers, hidden, heads, ffn = 4 hidden, 64 experts top-1, moe loss weight
0.1, lr 6e-4 / 6e-4 / 3e-4 with cosine decay to a tenth, clip 1.0, weight
decay 0.1); MegaBlocks trains with a global batch of 512 x 1024 tokens on 8
GPUs, here batch_size x grad_accum x seq_len is the user's choice (default 8
x 1 x 1024, what one H100 holds for the 125M dMoE: 3.65 B parameters with
their AdamW state, docs/RESULTS.md).
]]
local moe = require "moe"
local train = require "moe.train"

local M = {}

M.sizes = {
  ["46m"] = { n_layers = 6, d_model = 512, n_heads = 8, lr = 6e-4 },
  ["125m"] = { n_layers = 12, d_model = 768, n_heads = 12, lr = 6e-4 },
  ["356m"] = { n_layers = 24, d_model = 1024, n_heads = 16, lr = 3e-4 },
}
M.kinds = { dense = true, dmoe = true, moe = true }

--- M.config(size, kind) -> a moe.train config table (train.defaults() with the row applied).
function M.config(size, kind)
  local s = M.sizes[size]
  if not s then error(("ladder: size must be 46m, 125m or 356m, got '%s'"):format(tostring(size)), 2) end
  if not M.kinds[kind] then error(("ladder: kind must be dense, dmoe or moe, got '%s'"):format(tostring(kind)), 2) end
  local c = train.defaults()
  local m = c.model
  m.vocab_size, m.d_model, m.n_layers, m.n_heads = 257, s.d_model, s.n_layers, s.n_heads
  m.pos, m.norm, m.tie_embeddings, m.init_std = "rope", "layernorm", true, 0.02
  m.ffn, m.d_ff = kind == "dense" and "dense" or "moe", 4 * s.d_model
  m.moe.kind = kind == "moe" and "moe" or "dmoe"
  m.moe.num_experts, m.moe.top_k, m.moe.ffn_hidden_size = 64, 1, 4 * s.d_model
  m.moe.mlp_type, m.moe.activation, m.moe.mlp_impl = "mlp", "gelu", "auto"
  m.moe.loss_weight, m.moe.zloss_weight, m.moe.capacity_factor = 0.1, 0.0, 1.0
  c.data, c.seq_len, c.batch_size, c.grad_accum = "bible", 1024, 8, 1
  c.steps, c.lr, c.min_lr, c.warmup, c.decay = 2000, s.lr, s.lr / 10, 100, "cosine"
  c.weight_decay, c.clip, c.beta1, c.beta2 = 0.1, 1.0, 0.9, 0.95
  c.eval_every, c.eval_iters, c.log_every, c.save_every = 200, 10, 10, 500
  c.dtype, c.device = "bf16", "auto"
  c.out_dir = ("out/ladder-%s-%s"):format(size, kind)
  return c
end

-- Run as a script: size= kind= show= taken out of the arguments, the rest are train overrides.
if arg and arg[0] and arg[0]:match("ladder%.lua$") then
  local size, kind, show, rest = "125m", "dmoe", false, {}
  for _, a in ipairs(arg) do
    local k, v = a:match("^([%w_]+)=(.*)$")
    if k == "size" then size = v:lower()
    elseif k == "kind" then kind = v:lower()
    elseif k == "show" then show = (v == "true" or v == "1")
    else rest[#rest + 1] = a end
  end
  local cfg = moe.config(M.config(size, kind), rest)
  if show then
    local m = cfg.model
    print(("ladder %s %s: %d layers, d_model %d, %d heads, seq_len %d, ffn %s (%s), lr %g, batch %d x %d"):format(
      size, kind, m.n_layers, m.d_model, m.n_heads, cfg.seq_len, m.ffn,
      m.ffn == "dense" and ("d_ff " .. m.d_ff) or ("%s, %d experts top-%d, ffn %d"):format(m.moe.kind,
        m.moe.num_experts, m.moe.top_k, m.moe.ffn_hidden_size), cfg.lr, cfg.batch_size, cfg.grad_accum))
  else
    train.run(cfg)
  end
end

return M
