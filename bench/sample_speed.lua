--[[
bench/sample_speed.lua - decoding speed of sample.generate with and without
the KV cache: a randomly initialised nn.TransformerLM (weights do not change
the cost), greedy, one sequence. Prints tokens/s and writes JSON (bench/lib.lua).
Timing: one warm-up generation of 8 tokens, then one of `new` tokens
between CUDA events (the host clock on the CPU).

  moe-lua bench/sample_speed.lua [device=cuda] [dtype=bf16] [d_model=768] [n_layers=12]
                                 [n_heads=12] [seq_len=1024] [prompt=32] [new=256] [json=FILE]
                                 [repeats=1]
]]
local moe = require "moe"
local nn = require "moe.nn"
local sample = require "moe.sample"
local bench = dofile((arg[0]:match("^(.*)/") or ".") .. "/lib.lua")
local cfg = bench.config({ device = "cuda", dtype = "bf16", d_model = 768, n_layers = 12, n_heads = 12,
  seq_len = 1024, vocab_size = 257, prompt = 32, new = 256, repeats = 1, warmup = 1 })
moe.manual_seed(1)
local lm = nn.TransformerLM({ vocab_size = cfg.vocab_size, d_model = cfg.d_model, n_layers = cfg.n_layers,
  n_heads = cfg.n_heads, seq_len = cfg.seq_len, dtype = cfg.dtype, device = cfg.device })
local prompt = {}
for i = 1, cfg.prompt do prompt[i] = (i * 31) % cfg.vocab_size end
local function run(kv)
  for _ = 1, cfg.warmup do -- warm-up: a short generation
    sample.generate(lm, prompt, { max_new_tokens = 8, temperature = 0, kv_cache = kv })
  end
  local ids
  local secs = bench.time(function()
    ids = sample.generate(lm, prompt, { max_new_tokens = cfg.new, temperature = 0, kv_cache = kv })
  end, { device = cfg.device, repeats = cfg.repeats, warmup = 0, cooldown = cfg.cooldown })
  return secs, ids
end
local t_cache, a = run(true)
local t_full, b = run(false)
local same = #a == #b
for i = 1, #a do same = same and a[i] == b[i] end
print(("%s %s, %d layers x d_model %d, prompt %d, %d new tokens (greedy):"):format(bench.device_name(cfg.device),
  cfg.dtype, cfg.n_layers, cfg.d_model, cfg.prompt, cfg.new))
print(("  KV cache   %8.3f s  %8.1f tokens/s"):format(t_cache, cfg.new / t_cache))
print(("  no cache   %8.3f s  %8.1f tokens/s"):format(t_full, cfg.new / t_full))
print(("  same tokens: %s"):format(tostring(same)))
bench.write(cfg, {
  title = "Decoding speed with and without the KV cache",
  device = cfg.device, reference = "the same model decoding without the KV cache (every step over the whole prefix)",
  dtype = cfg.dtype, d_model = cfg.d_model, n_layers = cfg.n_layers, n_heads = cfg.n_heads, prompt = cfg.prompt,
  new_tokens = cfg.new, kv_cache_s = t_cache, no_cache_s = t_full, kv_cache_tokens_per_s = cfg.new / t_cache,
  no_cache_tokens_per_s = cfg.new / t_full, same_tokens = same,
  rows = { { mode = "KV cache", s = t_cache, tps = cfg.new / t_cache },
           { mode = "no cache", s = t_full, tps = cfg.new / t_full } },
  columns = { { "mode", "mode" }, { "s", "s", "%.3f" }, { "tokens/s", "tps", "%.1f" } },
})
