--[[
moe/cli/preprocess.lua - `moe-lua preprocess key=value ...`: text files to a
Megatron-LM indexed dataset (PREFIX.bin/.idx) with any tokenizer of
data.load_tokenizer, recorded beside it (PREFIX.meta.json and a copy of the
tokenizer's files); or the default corpus (the King James Bible). The
arguments go through moe.config: unknown keys suggest near ones, values are
type-checked, and --help lists every key with its meaning.

  moe-lua preprocess input=a.txt,b.txt output=data/mytext split=blank_line tokenizer=gpt2/
  moe-lua preprocess corpus=bible dir=data
]]
local M = {
  summary = "text files to a Megatron .bin/.idx dataset (byte, moe-bpe or GPT-2/HF BPE), or corpus=bible",
  usage = [[
usage: moe-lua preprocess input=FILE[,FILE...] output=PREFIX [split=line|blank_line|file]
                          [tokenizer=byte|bpe:FILE|DIR|tokenizer.json|vocab.json] [dtype=auto|u16|i32]
       moe-lua preprocess corpus=bible [dir=data]
Each document (a line, a blank-line separated paragraph, or a file) is tokenized
and ended with the tokenizer's EOD; writes PREFIX.bin and PREFIX.idx (Megatron-LM
MMIDIDX), PREFIX.meta.json and a copy of the tokenizer's files.]],
}

-- Every key: its default and its meaning (for --help).
local keys = {
  { "input", "", "text files to read, comma-separated" },
  { "output", "", "the dataset's path prefix: writes PREFIX.bin, PREFIX.idx, PREFIX.meta.json" },
  { "split", "line", "what a document is: line (each non-empty line), blank_line (paragraphs) or file" },
  { "tokenizer", "byte", "byte, bpe:FILE (moe-bpe), or a GPT-2 / Hugging Face byte-level BPE: a directory " ..
    "with tokenizer.json or vocab.json + merges.txt, a tokenizer.json, or a vocab.json" },
  { "dtype", "auto", "token dtype of PREFIX.bin: auto (u16 when the vocabulary fits, else i32), u8, u16, i32, i64" },
  { "corpus", "", "bible: preprocess the King James Bible (Debian bible-kjv) instead of input=" },
  { "dir", "data", "with corpus=bible: the folder of bible_kjv.bin/.idx" },
}

local function defaults()
  local d = {}
  for _, k in ipairs(keys) do d[k[1]] = k[2] end
  return d
end

local function help()
  io.write(M.usage, "\n\nkeys (key=default  meaning):\n")
  local width = 0
  for _, k in ipairs(keys) do width = math.max(width, #k[1] + #k[2] + 1) end
  for _, k in ipairs(keys) do
    io.write(("  %-" .. width .. "s  %s\n"):format(k[1] .. "=" .. k[2], k[3]))
  end
end

-- The message of an error, without the "file.lua:12: " a Lua error may carry.
local function message(err) return (tostring(err):gsub("^[^\n:]*%.lua:%d+: ", "")) end

function M.main(...)
  local argv = { ... }
  for _, a in ipairs(argv) do
    if a == "--help" or a == "-h" then
      help()
      return 0
    end
  end
  local moe = require "moe"
  local ok, cfg, rest = pcall(moe.config, defaults(), argv)
  if not ok then
    io.stderr:write(("moe-lua preprocess: %s\n"):format(message(cfg):gsub("^moe%.config: ", "")))
    return 2
  end
  if #rest > 0 then
    io.stderr:write(("moe-lua preprocess: unexpected argument '%s' (arguments are key=value; --help lists " ..
      "the keys)\n"):format(rest[1]))
    return 2
  end
  local data = require "moe.data"
  local run_ok, err = pcall(function()
    if cfg.corpus ~= "" then
      if cfg.corpus ~= "bible" then error("unknown corpus '" .. cfg.corpus .. "' (available: bible)", 0) end
      local prefix = data.bible_corpus { dir = cfg.dir }
      local ds = data.IndexedDataset(prefix)
      print(("%s: %d documents, %d tokens"):format(prefix, ds:num_documents(), ds:num_tokens()))
      return
    end
    if cfg.input == "" or cfg.output == "" then
      error("input= and output= are required (or corpus=bible); --help lists the keys", 0)
    end
    local splits = { line = true, blank_line = true, file = true }
    if not splits[cfg.split] then
      error(("split must be line, blank_line or file, got '%s'"):format(cfg.split), 0)
    end
    local inputs = {}
    for f in cfg.input:gmatch("[^,]+") do inputs[#inputs + 1] = f end
    local prefix, stats = data.preprocess { inputs = inputs, output_prefix = cfg.output,
      split_documents = cfg.split, tokenizer = cfg.tokenizer, dtype = cfg.dtype ~= "auto" and cfg.dtype or nil }
    print(("%s: %d documents, %d tokens, %s tokenizer (vocab_size %d), %.1f MB in %.2f s (%.1f MB/s)"):format(
      prefix, stats.documents, stats.tokens, tostring(stats.tokenizer), stats.vocab_size,
      stats.bytes / 1e6, stats.seconds, stats.bytes / 1e6 / math.max(stats.seconds, 1e-9)))
  end)
  if not run_ok then
    io.stderr:write("moe-lua preprocess: " .. message(err) .. "\n")
    return 1
  end
  return 0
end

return M
