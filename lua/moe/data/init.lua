--[[
moe/data/init.lua - datasets (`local data = require "moe.data"`).

  data.IndexedDataset(prefix)            Megatron-LM MMIDIDX prefix.bin/.idx, memory mapped
      #ds (sequences; one per document for files written here and by Megatron's
      preprocess_data.py without sentence splitting), ds:num_documents(),
      ds:num_tokens(), ds:get(i [, offset, length]) -> i64 CPU tensor (0-based i),
      ds:size(i), ds:document_start(d), ds:close(). A corrupt or truncated file
      fails at open with an error naming the file and the problem.
  data.check_vocab(ds, vocab_size)       every token id in [0, vocab_size), or an error
      naming prefix.bin, the sequence and the id (one C pass, about 1 GB/s);
      returns the largest id
  data.IndexedDatasetBuilder(prefix, {dtype="u16"}) :add_document(ids), :finalize()
  data.ByteTokenizer()                   bytes 0..255 and EOD 256 (vocab_size 257)
  data.train_bpe(text, {vocab_size=512}) a small byte-level BPE (moe/data/bpe.lua);
      data.BPETokenizer.load(path), tok:save(path)
  data.load_tokenizer(spec)              "byte", "bpe:FILE", or a GPT-2 / Hugging Face
      byte-level BPE: a directory, tokenizer.json, or vocab.json (+ merges.txt beside it)
      (moe/data/tokenizer.lua, moe/data/gpt2.lua); data.GPT2Tokenizer.from_files(vocab,
      merges), data.GPT2Tokenizer.from_tokenizer_json(path)
  data.dataset_tokenizer(prefix)         the tokenizer preprocess recorded beside a
      dataset (prefix.meta.json) and the meta table, or nil
  data.preprocess{inputs=, output_prefix=, tokenizer="byte", split_documents="line"}
  data.bible_corpus{dir="data"}          the King James Bible, preprocessed once
  data.GPTDataset(ds, {seq_len=, seed=1234, split="train", valid_fraction=0.05})
  data.unigram_entropy(ds_or_gd)         unigram baseline loss in nats

The reader and writer are C (core/dataset.c, bindings/ldata.c: moe.ops.
indexed_dataset / indexed_builder); the rest is Lua here and in
moe/data/gpt.lua and moe/data/preprocess.lua. See docs/DATA.md.
]]
local moe = require "moe"

local M = {}

local function fail(fn, msg, ...) error(("%s: " .. msg):format(fn, ...), 3) end

-- "x.bin" / "x.idx" / "x" -> "x"
local function strip(prefix) return (prefix:gsub("%.bin$", ""):gsub("%.idx$", "")) end

function M.IndexedDataset(prefix)
  if type(prefix) ~= "string" or prefix == "" then
    fail("data.IndexedDataset", "path prefix expected (prefix.bin/.idx), got %s", tostring(prefix))
  end
  local ok, ds = pcall(moe.ops.indexed_dataset, strip(prefix))
  if not ok then error("data.IndexedDataset: " .. tostring(ds):gsub("^indexed_dataset: ", ""), 2) end
  return ds
end

function M.check_vocab(ds, vocab_size)
  local ok, top = pcall(ds.check_vocab, ds, vocab_size)
  if not ok then error("data.check_vocab: " .. tostring(top):gsub("^check_vocab: ", ""), 2) end
  return top
end

-- ------------------------------------------------------------------ builder

local Builder = {}
Builder.__index = Builder

function M.IndexedDatasetBuilder(prefix, opts)
  local fn = "data.IndexedDatasetBuilder"
  if type(prefix) ~= "string" or prefix == "" then
    fail(fn, "path prefix expected, got %s", tostring(prefix))
  end
  opts = opts or {}
  for k in pairs(opts) do
    if k ~= "dtype" then fail(fn, "unknown option '%s' (valid: dtype)", tostring(k)) end
  end
  local ok, b = pcall(moe.ops.indexed_builder, strip(prefix), opts.dtype or "u16")
  if not ok then error(fn .. ": " .. tostring(b):gsub("^indexed_builder: ", ""), 2) end
  return setmetatable({ b = b, prefix = strip(prefix), documents = 0, tokens = 0 }, Builder)
end

-- One document made of one sequence: a Lua array of ids or a 1-D integer tensor.
function Builder:add_document(ids)
  self.b:add(ids)
  self.b:end_document()
  self.documents = self.documents + 1
  self.tokens = self.tokens + (moe.is_tensor(ids) and ids:numel() or #ids)
end

-- Sequences of one document added one by one, closed by end_document().
function Builder:add_sequence(ids) self.b:add(ids) end
function Builder:end_document()
  self.b:end_document()
  self.documents = self.documents + 1
end

function Builder:finalize()
  self.b:finalize()
  self.b:free()
  return self.prefix
end

-- Abandons the files (removes prefix.bin when not finalized).
function Builder:free() self.b:free() end

-- ------------------------------------------------------------------ tokenizer

local ByteTokenizer = {}
ByteTokenizer.__index = ByteTokenizer

function M.ByteTokenizer()
  return setmetatable({ name = "byte", vocab_size = 257, eod = 256 }, ByteTokenizer)
end

-- string -> array of byte values (0..255)
function ByteTokenizer.encode(_, s)
  if type(s) ~= "string" then error("ByteTokenizer:encode: string expected, got " .. type(s), 2) end
  local out, n = {}, #s
  for i = 1, n, 4096 do
    local chunk = { s:byte(i, math.min(i + 4095, n)) }
    table.move(chunk, 1, #chunk, #out + 1, out)
  end
  return out
end

-- array or tensor of ids -> string; EOD becomes "\n", ids above 256 are skipped
function ByteTokenizer:decode(ids)
  if moe.is_tensor(ids) then ids = ids:reshape({ -1 }):long():totable() end
  if type(ids) ~= "table" then error("ByteTokenizer:decode: array of ids expected", 2) end
  local parts = {}
  for i = 1, #ids, 4096 do
    local chunk = {}
    for j = i, math.min(i + 4095, #ids) do
      local v = math.tointeger(ids[j])
      if v == nil then error(("ByteTokenizer:decode: id %d is not an integer"):format(j), 2) end
      if v == self.eod then chunk[#chunk + 1] = 10
      elseif v >= 0 and v < 256 then chunk[#chunk + 1] = v end
    end
    parts[#parts + 1] = string.char(table.unpack(chunk))
  end
  return table.concat(parts)
end

local bpe = require "moe.data.bpe"
M.train_bpe = bpe.train_bpe
M.BPETokenizer = bpe.BPETokenizer

local tokenizer = require "moe.data.tokenizer"
local gpt2 = require "moe.data.gpt2"
M.GPT2Tokenizer = { from_files = gpt2.from_files, from_tokenizer_json = gpt2.from_tokenizer_json }

-- "byte", "bpe:<file>", a directory or file of a GPT-2 / Hugging Face byte-level BPE
-- (tokenizer.json, vocab.json + merges.txt) or a tokenizer object (moe/data/tokenizer.lua).
M.load_tokenizer = tokenizer.load
M.tokenizer = tokenizer.load
-- The tokenizer recorded beside a dataset (prefix.meta.json), or nil.
M.dataset_tokenizer = tokenizer.for_dataset

-- ------------------------------------------------------------------ the rest

local pre = require "moe.data.preprocess"
M.preprocess = function(opts) return pre.preprocess(M, opts) end
M.bible_corpus = function(opts) return pre.bible_corpus(M, opts) end

local gpt = require "moe.data.gpt"
M.GPTDataset = gpt.GPTDataset

function M.unigram_entropy(x)
  if type(x) == "table" and x.ds and x.seq_begin then
    return x.ds:unigram_entropy(x.seq_begin, x.seq_end)
  end
  local ok, h = pcall(function() return x:unigram_entropy() end)
  if not ok then error("data.unigram_entropy: " .. tostring(h), 2) end
  return h
end

return M
