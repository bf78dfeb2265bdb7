--[[
bench/sample_speed.lua - decoding speed of sample.generate with and without
the KV cache: a randomly initialised nn.TransformerLM (weights do not change
the cost), greedy, one sequence. Prints tokens/s and writes JSON.

  moe-lua bench/sample_speed.lua [device=cuda] [dtype=bf16] [d_model=768] [n_layers=12]
                                 [n_heads=12] [seq_len=1024] [prompt=32] [new=256] [json=FILE]
]]
local moe = require "moe"
local nn = require "moe.nn"
local sample = require "moe.sample"
local cfg = moe.config({ device = "cuda", dtype = "bf16", d_model = 768, n_layers = 12, n_heads = 12,
  seq_len = 1024, vocab_size = 257, prompt = 32, new = 256, json = "" })
moe.manual_seed(1)
local lm = nn.TransformerLM({ vocab_size = cfg.vocab_size, d_model = cfg.d_model, n_layers = cfg.n_layers,
  n_heads = cfg.n_heads, seq_len = cfg.seq_len, dtype = cfg.dtype, device = cfg.device })
local prompt = {}
for i = 1, cfg.prompt do prompt[i] = (i * 31) % cfg.vocab_size end
local function run(kv)
  sample.generate(lm, prompt, { max_new_tokens = 8, temperature = 0, kv_cache = kv }) -- warm-up
  if cfg.device ~= "cpu" then moe.cuda.synchronize() end
  local t0 = moe.clock()
  local ids = sample.generate(lm, prompt, { max_new_tokens = cfg.new, temperature = 0, kv_cache = kv })
  if cfg.device ~= "cpu" then moe.cuda.synchronize() end
  return (moe.clock() - t0), ids
end
local t_cache, a = run(true)
local t_full, b = run(false)
local same = #a == #b
for i = 1, #a do same = same and a[i] == b[i] end
local dev = cfg.device == "cpu" and "cpu" or moe.cuda.get_device_name(cfg.device)
print(("%s %s, %d layers x d_model %d, prompt %d, %d new tokens (greedy):"):format(dev, cfg.dtype,
  cfg.n_layers, cfg.d_model, cfg.prompt, cfg.new))
print(("  KV cache   %8.3f s  %8.1f tokens/s"):format(t_cache, cfg.new / t_cache))
print(("  no cache   %8.3f s  %8.1f tokens/s"):format(t_full, cfg.new / t_full))
print(("  same tokens: %s"):format(tostring(same)))
if cfg.json ~= "" then
  local f = assert(io.open(cfg.json, "w"))
  f:write(string.format('{"device": "%s", "dtype": "%s", "d_model": %d, "n_layers": %d, "n_heads": %d, ' ..
    '"prompt": %d, "new_tokens": %d, "kv_cache_s": %.4f, "no_cache_s": %.4f, "kv_cache_tokens_per_s": %.2f, ' ..
    '"no_cache_tokens_per_s": %.2f, "same_tokens": %s, "date": "%s"}\n', dev, cfg.dtype, cfg.d_model,
    cfg.n_layers, cfg.n_heads, cfg.prompt, cfg.new, t_cache, t_full, cfg.new / t_cache, cfg.new / t_full,
    tostring(same), os.date("!%Y-%m-%d %H:%M UTC")))
  f:close()
end
