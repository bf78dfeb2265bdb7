--[[
moe/cli/sample.lua - `moe-lua sample [key=value ...]`: generates text from a
checkpoint written by moe.train (the model is rebuilt from the config stored
in its state.json; the tokenizer saved in the checkpoint encodes the prompt
and decodes the text, the byte tokenizer for checkpoints that saved none).

  moe-lua sample out_dir=out                       # the latest checkpoint in out/
  moe-lua sample ckpt=out/ckpt-1000 prompt="And God said" tokens=300 temperature=0.7 top_k=20
]]
local M = {
  summary = "generate text from a training checkpoint (ckpt= or out_dir=, prompt=, tokens=, ...)",
  usage = "usage: moe-lua sample [ckpt=DIR | out_dir=DIR] [prompt=TEXT] [tokens=N] [temperature=T] " ..
    "[top_k=K] [seed=S] [device=auto|cpu|cuda] [kv_cache=true|false]",
}

local defaults = { ckpt = "", out_dir = "out", prompt = "", tokens = 200, temperature = 0.8, top_k = 40,
  seed = 0, device = "auto", kv_cache = true }

function M.main(...)
  local moe = require "moe"
  local train = require "moe.train"
  local checkpoint = require "moe.checkpoint"
  local sample = require "moe.sample"
  local cfg, rest = moe.config(defaults, { ... })
  if #rest > 0 then
    io.stderr:write(("moe-lua sample: unexpected argument '%s'\n%s\n"):format(tostring(rest[1]), M.usage))
    return 1
  end
  local path = cfg.ckpt ~= "" and cfg.ckpt or checkpoint.latest(cfg.out_dir)
  if not path then
    io.stderr:write(("moe-lua sample: no checkpoint in '%s' (give ckpt=DIR or out_dir=DIR)\n"):format(cfg.out_dir))
    return 1
  end
  local device = train.resolve_device(cfg.device)
  local model, tcfg, state = train.load_model(path, device)
  -- the tokenizer saved in the checkpoint (state.json's record and its files); older
  -- checkpoints have none: their data was byte data
  local tokenizer
  if state.tokenizer then
    local ok, tok = pcall(require("moe.data.tokenizer").from_record, state.tokenizer, path, "",
      path .. "/state.json")
    if not ok then
      io.stderr:write(("moe-lua sample: %s\n"):format(tostring(tok)))
      return 1
    end
    tokenizer = tok
  else
    tokenizer = require("moe.data").ByteTokenizer()
  end
  moe.manual_seed(cfg.seed)
  io.write(sample.text(model, tokenizer, cfg.prompt, { max_new_tokens = cfg.tokens,
    temperature = cfg.temperature, top_k = cfg.top_k, seq_len = tcfg.seq_len, device = device,
    kv_cache = cfg.kv_cache }), "\n")
  return 0
end

return M
