--[[
moe/data/preprocess.lua - text files to Megatron .bin/.idx (data.preprocess)
and the default corpus (data.bible_corpus). Used through moe.data.

Documents: split_documents = "line" (every non-empty line), "blank_line"
(paragraphs separated by blank lines) or "file" (a whole file). Every
document is tokenized and followed by the tokenizer's EOD (Megatron's
--append-eod), so GPTDataset can concatenate documents as stored.

tokenizer: any spec of data.load_tokenizer (moe/data/tokenizer.lua). The
tokenizer is recorded beside the dataset: PREFIX.meta.json (kind,
vocab_size, eod, counts) and a copy of its files (PREFIX.tokenizer.json, ...),
which moe.train reads when the data opens.
]]
local tokenizers = require "moe.data.tokenizer"

local M = {}

local function fail(fn, msg, ...) error(("%s: " .. msg):format(fn, ...), 4) end

local function read_file(fn, path)
  local f, err = io.open(path, "rb")
  if not f then fail(fn, "cannot open %s: %s", path, tostring(err)) end
  local s = f:read("a")
  f:close()
  return s
end

-- Calls emit(text) for every document of s.
local function split(s, how, emit)
  if how == "file" then
    if s:find("%S") then emit(s) end
  elseif how == "line" then
    for line in s:gmatch("[^\n]+") do
      if line:find("%S") then emit(line) end
    end
  else -- blank_line
    s = s:gsub("\r\n", "\n")
    local start = 1
    while start <= #s do
      local a, b = s:find("\n[ \t]*\n%s*", start)
      local doc = s:sub(start, (a or #s + 1) - 1)
      if doc:find("%S") then emit(doc) end
      if not a then break end
      start = b + 1
    end
  end
end

local function add_text(builder, tok, text)
  local ids = tok:encode(text)
  ids[#ids + 1] = tok.eod
  builder:add_document(ids)
end

local known = { inputs = true, output_prefix = true, tokenizer = true, split_documents = true,
                dtype = true }

function M.preprocess(data, opts)
  local fn = "data.preprocess"
  if type(opts) ~= "table" then fail(fn, "options table expected, got %s", type(opts)) end
  for k in pairs(opts) do
    if not known[k] then
      fail(fn, "unknown option '%s' (valid: dtype, inputs, output_prefix, split_documents, tokenizer)",
           tostring(k))
    end
  end
  local inputs = opts.inputs
  if type(inputs) == "string" then inputs = { inputs } end
  if type(inputs) ~= "table" or #inputs == 0 then fail(fn, "inputs must list text files") end
  if type(opts.output_prefix) ~= "string" or opts.output_prefix == "" then
    fail(fn, "output_prefix is required")
  end
  local how = opts.split_documents or "line"
  if how ~= "line" and how ~= "file" and how ~= "blank_line" then
    fail(fn, "split_documents must be \"line\", \"file\" or \"blank_line\", got %s", tostring(how))
  end
  local ok_tok, tok = pcall(data.load_tokenizer, opts.tokenizer)
  if not ok_tok then error(tostring(tok), 0) end
  if math.type(tok.eod) ~= "integer" then
    fail(fn, "tokenizer %s has no end-of-document token (<|endoftext|>, </s>, <|end_of_text|> or <eos>)",
         tostring(opts.tokenizer))
  end
  local max_id = { u8 = 255, i8 = 127, i16 = 32767, u16 = 65535, i32 = 2147483647 }
  if opts.dtype and max_id[opts.dtype] and tok.vocab_size - 1 > max_id[opts.dtype] then
    fail(fn, "dtype %s cannot hold the ids of a vocabulary of %d (largest %d)", opts.dtype, tok.vocab_size,
         max_id[opts.dtype])
  end
  local texts, bytes = {}, 0
  for i, path in ipairs(inputs) do -- all readable first
    texts[i] = read_file(fn, path)
    bytes = bytes + #texts[i]
  end
  local t0 = os.clock()
  local b = data.IndexedDatasetBuilder(opts.output_prefix,
                                       { dtype = opts.dtype or (tok.vocab_size <= 65536 and "u16" or "i32") })
  local ok, err = pcall(function()
    for _, s in ipairs(texts) do split(s, how, function(doc) add_text(b, tok, doc) end) end
  end)
  if not ok then
    b:free()
    error(err, 0)
  end
  local stats = { documents = b.documents, tokens = b.tokens, bytes = bytes, seconds = os.clock() - t0,
                  tokenizer = tok.name, vocab_size = tok.vocab_size }
  b:finalize()
  if not tokenizers.write_dataset_meta(b.prefix, tok, stats) then
    os.remove(b.prefix .. ".meta.json") -- a tokenizer object of its own: nothing recorded
  end
  return opts.output_prefix, stats
end

local function exists(path)
  local f = io.open(path, "rb")
  if f then f:close() end
  return f ~= nil
end

local function shell_quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

-- The King James Bible from `bible -f gen1:1-rev22:21` (Debian bible-kjv):
-- one document per chapter, verses without their references, one per line.
function M.bible_corpus(data, opts)
  local fn = "data.bible_corpus"
  opts = opts or {}
  for k in pairs(opts) do
    if k ~= "dir" then fail(fn, "unknown option '%s' (valid: dir)", tostring(k)) end
  end
  local dir = opts.dir or "data"
  local prefix = dir .. "/bible_kjv"
  if exists(prefix .. ".bin") and exists(prefix .. ".idx") then
    local ok = pcall(data.IndexedDataset, prefix)
    if ok then return prefix end
  end
  local ok_cmd = os.execute("command -v bible >/dev/null 2>&1")
  if not ok_cmd then
    fail(fn, "the `bible` command is not installed: install the Debian package bible-kjv " ..
         "(sudo apt-get install bible-kjv)")
  end
  local p = io.popen("bible -f gen1:1-rev22:21 2>/dev/null", "r")
  local text = p and p:read("a") or ""
  if p then p:close() end
  if #text < 1000000 then
    fail(fn, "`bible -f gen1:1-rev22:21` printed %d bytes; is bible-kjv installed completely?", #text)
  end
  os.execute("mkdir -p " .. shell_quote(dir))
  local tok = data.ByteTokenizer()
  local b = data.IndexedDatasetBuilder(prefix .. ".tmp", { dtype = "u16" })
  local chapter, verses = nil, {}
  local function flush()
    if #verses > 0 then add_text(b, tok, table.concat(verses, "\n")) end
    verses = {}
  end
  for line in text:gmatch("[^\n]+") do
    local ref, verse = line:match("^(%d?%a+%d+):%d+%s+(.*)$")
    if ref then
      if ref ~= chapter then
        flush()
        chapter = ref
      end
      verses[#verses + 1] = verse
    end
  end
  flush()
  b:finalize()
  for _, ext in ipairs({ ".bin", ".idx" }) do
    local ok, err = os.rename(prefix .. ".tmp" .. ext, prefix .. ext)
    if not ok then fail(fn, "cannot write %s: %s", prefix .. ext, tostring(err)) end
  end
  tokenizers.write_dataset_meta(prefix, tok, { documents = b.documents, tokens = b.tokens })
  return prefix
end

return M
