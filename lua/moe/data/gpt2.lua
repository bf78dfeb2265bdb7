--[[
moe/data/gpt2.lua - GPT-2 / Hugging Face byte-level BPE tokenizers from local
files (data.GPT2Tokenizer):

  local gpt2 = require "moe.data.gpt2"
  local tok = gpt2.from_files("dir/vocab.json", "dir/merges.txt")
  local tok = gpt2.from_tokenizer_json("dir/tokenizer.json")
  tok:encode(str) -> array of ids; tok:decode(ids) -> str; tok.vocab_size; tok.eod

Encoding is what tokenizers (the PyPI package) does for a BPE model with the
ByteLevel pre-tokenizer: added tokens (<|endoftext|>, ...) are cut out of the
text first and become their ids; the text between them is cut into pieces by
the GPT-2 regex and each piece's bytes are merged by rank (C: core/bpe.c,
core/unicode.c, through moe.ops.bpe_encoder). Token strings in the files use
GPT-2's byte-to-unicode mapping (a printable character per byte: "Ġ" is the
space); they are mapped back to bytes here, so decode gives the raw bytes.

Supported in tokenizer.json: model BPE (no dropout, no subword prefix or
suffix, no byte_fallback, no ignore_merges), normalizer null, pre_tokenizer
ByteLevel (add_prefix_space, use_regex), decoder and post_processor null or
ByteLevel, added tokens without single_word/lstrip/rstrip. Anything else is
an error naming the file and what is unsupported.

eod: the id of <|endoftext|> (else </s>, <|end_of_text|> or <eos>), nil when
the vocabulary has none. vocab_size: the largest id + 1.
]]
local moe = require "moe"

local M = {}

local EOD_NAMES = { "<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>" }

-- GPT-2's bytes_to_unicode: byte -> code point, and the inverse.
local byte_cp, cp_byte = {}, {}
do
  local n = 0
  for b = 0, 255 do
    if (b >= 33 and b <= 126) or (b >= 161 and b <= 172) or (b >= 174 and b <= 255) then
      byte_cp[b] = b
    else
      byte_cp[b] = 256 + n
      n = n + 1
    end
    cp_byte[byte_cp[b]] = b
  end
end
M.byte_to_unicode = byte_cp

local function read_file(fn, path)
  local f, err = io.open(path, "rb")
  if not f then error(("%s: cannot open %s: %s"):format(fn, path, tostring(err)), 0) end
  local s = f:read("a")
  f:close()
  if s == nil then error(("%s: cannot read %s (a directory?)"):format(fn, path), 0) end
  return s
end

-- The bytes of a token string in GPT-2's mapping, or nil when a character is
-- outside it (then the token is not byte-level).
local function token_bytes(s)
  if not utf8.len(s) then return nil end
  local out = {}
  for _, cp in utf8.codes(s) do
    local b = cp_byte[cp]
    if b == nil then return nil end
    out[#out + 1] = b
  end
  local parts = {}
  for i = 1, #out, 4096 do parts[#parts + 1] = string.char(table.unpack(out, i, math.min(i + 4095, #out))) end
  return table.concat(parts)
end
M.token_bytes = token_bytes

local Tok = {}
Tok.__index = Tok

--[[ build{vocab = {token string -> id}, merges = {{a, b}, ...} (token strings),
added = {{id=, content=, special=}, ...}, split = "gpt2"|"none", add_prefix_space,
files = {name -> text}, where = file name for messages} -> tokenizer ]]
local function build(o)
  local where = o.where
  local function bad(msg, ...) error(("%s: " .. msg):format(where, ...), 0) end
  local id_bytes, vocab_size = {}, 0
  for s, id in pairs(o.vocab) do
    if math.type(id) ~= "integer" or id < 0 or id >= 0x7fffffff then
      bad("token %q has id %s (ids are integers >= 0)", s, tostring(id))
    end
    if id_bytes[id] ~= nil then bad("id %d is given to two tokens", id) end
    -- a token outside the byte mapping (an added token written into the vocab) decodes as itself
    id_bytes[id] = token_bytes(s) or s
    if id + 1 > vocab_size then vocab_size = id + 1 end
  end
  local byte_ids = {}
  for b = 0, 255 do byte_ids[b + 1] = o.vocab[utf8.char(byte_cp[b])] or -1 end
  local left, right, result = {}, {}, {}
  for r, m in ipairs(o.merges) do
    local a, b = o.vocab[m[1]], o.vocab[m[2]]
    local ab = o.vocab[m[1] .. m[2]]
    if not a or not b then
      bad("merge %d '%s %s' uses a token that is not in the vocabulary", r, m[1], m[2])
    end
    if not ab then bad("merge %d '%s %s' makes '%s', which is not in the vocabulary", r, m[1], m[2], m[1] .. m[2]) end
    left[r], right[r], result[r] = a, b, ab
  end
  local added, special = {}, {}
  for _, t in ipairs(o.added or {}) do
    if math.type(t.id) ~= "integer" or t.id < 0 then
      bad("added token %q has id %s", tostring(t.content), tostring(t.id))
    end
    if type(t.content) ~= "string" or t.content == "" then bad("added token %d has no content", t.id) end
    if o.vocab[t.content] ~= nil and o.vocab[t.content] ~= t.id then
      bad("added token %q has id %d but the vocabulary gives it %d", t.content, t.id, o.vocab[t.content])
    end
    if id_bytes[t.id] ~= nil and o.vocab[t.content] == nil then
      bad("added token %q has id %d, which the vocabulary gives to another token", t.content, t.id)
    end
    id_bytes[t.id] = t.content
    if t.id + 1 > vocab_size then vocab_size = t.id + 1 end
    added[#added + 1] = { content = t.content, id = t.id }
    special[t.content] = t.id
  end
  local eod
  for _, name in ipairs(EOD_NAMES) do
    eod = special[name] or o.vocab[name]
    if eod then break end
  end
  local self = setmetatable({ name = "gpt2", vocab_size = vocab_size, eod = eod, id_bytes = id_bytes,
    added = added, add_prefix_space = o.add_prefix_space or false, files = o.files, where = where },
    Tok)
  local ok, enc = pcall(moe.ops.bpe_encoder, byte_ids, left, right, result, o.split or "gpt2")
  if not ok then bad("%s", tostring(enc)) end
  self.encoder = enc
  return self
end

-- Encodes text with no added tokens in it.
function Tok:encode_plain(s, out)
  if s == "" then return end
  if self.add_prefix_space and s:byte(1) ~= 32 then s = " " .. s end
  local ids = self.encoder:encode(s)
  table.move(ids, 1, #ids, #out + 1, out)
end

function Tok:encode(s)
  if type(s) ~= "string" then error("GPT2Tokenizer:encode: string expected, got " .. type(s), 2) end
  local out = {}
  if #self.added == 0 then
    self:encode_plain(s, out)
    return out
  end
  -- added tokens: leftmost match first, the longest among those starting there
  local next_at = {} -- added token index -> its next occurrence at or after pos (false: none)
  local pos = 1
  while pos <= #s do
    local best, best_i
    for i, t in ipairs(self.added) do
      local at = next_at[i]
      if at ~= false and (at == nil or at < pos) then
        at = s:find(t.content, pos, true) or false
        next_at[i] = at
      end
      if at and (not best or at < best or (at == best and #t.content > #self.added[best_i].content)) then
        best, best_i = at, i
      end
    end
    if not best then
      self:encode_plain(s:sub(pos), out)
      break
    end
    self:encode_plain(s:sub(pos, best - 1), out)
    local t = self.added[best_i]
    out[#out + 1] = t.id
    pos = best + #t.content
  end
  return out
end

function Tok:decode(ids)
  if moe.is_tensor(ids) then ids = ids:reshape({ -1 }):long():totable() end
  if type(ids) ~= "table" then error("GPT2Tokenizer:decode: array of ids expected", 2) end
  local parts = {}
  for i, v in ipairs(ids) do
    local s = self.id_bytes[v]
    if s == nil then
      error(("GPT2Tokenizer:decode: id %s at %d is outside the vocabulary"):format(tostring(v), i), 2)
    end
    parts[i] = s
  end
  return table.concat(parts)
end

function Tok:free()
  if self.encoder then self.encoder:free() end
end

-- ------------------------------------------------------------------ files

local function parse_merges(fn, path, text)
  local merges, line_no = {}, 0
  for line in (text .. "\n"):gmatch("([^\n]*)\n") do
    line_no = line_no + 1
    line = line:gsub("\r$", "")
    if line ~= "" and not (line_no == 1 and line:match("^#version")) then
      local a, b = line:match("^([^ ]+) ([^ ]+)$")
      if not a then error(("%s: %s line %d: expected two tokens separated by one space, got %q"):format(
        fn, path, line_no, line), 0) end
      merges[#merges + 1] = { a, b }
    end
  end
  return merges
end

local function decode_json(fn, path, text)
  local json = require("moe.metrics").json
  local ok, v = pcall(json.decode, text)
  if not ok then error(("%s: %s is not valid JSON: %s"):format(fn, path, tostring(v)), 0) end
  return v
end

--- from_files(vocab_path, merges_path) -> tokenizer. <|endoftext|>, when in
--- the vocabulary, is a special token (as GPT-2 has it).
function M.from_files(vocab_path, merges_path)
  local fn = "GPT2Tokenizer"
  local vtext, mtext = read_file(fn, vocab_path), read_file(fn, merges_path)
  local vocab = decode_json(fn, vocab_path, vtext)
  if type(vocab) ~= "table" or next(vocab) == nil or getmetatable(vocab) ~= nil then
    error(("%s: %s is not a vocabulary (a JSON object of token -> id)"):format(fn, vocab_path), 0)
  end
  local added = {}
  for _, name in ipairs(EOD_NAMES) do
    if math.type(vocab[name]) == "integer" then added[#added + 1] = { content = name, id = vocab[name] } end
  end
  return build { vocab = vocab, merges = parse_merges(fn, merges_path, mtext), added = added,
    files = { ["vocab.json"] = vtext, ["merges.txt"] = mtext }, where = vocab_path .. " + " .. merges_path }
end

-- "type X" of a tokenizer.json component, for messages.
local function kind(v) return type(v) == "table" and tostring(v.type) or tostring(v) end

--- from_tokenizer_json(path) -> tokenizer (the Hugging Face tokenizers format).
function M.from_tokenizer_json(path)
  local fn = "GPT2Tokenizer"
  local text = read_file(fn, path)
  local t = decode_json(fn, path, text)
  local function unsupported(what, ...)
    error(("%s: %s: unsupported %s (moe-lua reads byte-level BPE tokenizers: model BPE, pre_tokenizer " ..
      "ByteLevel)"):format(fn, path, what:format(...)), 0)
  end
  if type(t) ~= "table" or type(t.model) ~= "table" then
    error(("%s: %s is not a tokenizers file (no \"model\")"):format(fn, path), 0)
  end
  local m = t.model
  if (m.type or "BPE") ~= "BPE" then unsupported("model type %s", kind(m)) end
  if m.dropout ~= nil and m.dropout ~= 0 then unsupported("BPE dropout %s", tostring(m.dropout)) end
  if (m.continuing_subword_prefix or "") ~= "" then
    unsupported("continuing_subword_prefix %q", m.continuing_subword_prefix)
  end
  if (m.end_of_word_suffix or "") ~= "" then unsupported("end_of_word_suffix %q", m.end_of_word_suffix) end
  if m.byte_fallback then unsupported("byte_fallback") end
  if m.ignore_merges then unsupported("ignore_merges") end
  if t.normalizer ~= nil then unsupported("normalizer type %s", kind(t.normalizer)) end
  local pre = t.pre_tokenizer
  if type(pre) ~= "table" or pre.type ~= "ByteLevel" then
    unsupported("pre_tokenizer type %s", pre == nil and "null" or kind(pre))
  end
  if t.decoder ~= nil and kind(t.decoder) ~= "ByteLevel" then unsupported("decoder type %s", kind(t.decoder)) end
  if t.post_processor ~= nil and kind(t.post_processor) ~= "ByteLevel" then
    unsupported("post_processor type %s", kind(t.post_processor))
  end
  if type(m.vocab) ~= "table" then error(("%s: %s: model.vocab is missing"):format(fn, path), 0) end
  local merges = {}
  for i, x in ipairs(m.merges or {}) do
    if type(x) == "string" then
      local a, b = x:match("^([^ ]+) ([^ ]+)$")
      if not a then error(("%s: %s: model.merges[%d] %q is not two tokens"):format(fn, path, i, x), 0) end
      merges[i] = { a, b }
    elseif type(x) == "table" and type(x[1]) == "string" and type(x[2]) == "string" and #x == 2 then
      merges[i] = { x[1], x[2] }
    else
      error(("%s: %s: model.merges[%d] is not a merge"):format(fn, path, i), 0)
    end
  end
  local added = {}
  for i, a in ipairs(t.added_tokens or {}) do
    if type(a) ~= "table" then error(("%s: %s: added_tokens[%d] is not an object"):format(fn, path, i), 0) end
    for _, opt in ipairs({ "single_word", "lstrip", "rstrip" }) do
      if a[opt] then unsupported("%s on the added token %q", opt, tostring(a.content)) end
    end
    added[#added + 1] = { id = a.id, content = a.content, special = a.special }
  end
  return build { vocab = m.vocab, merges = merges, added = added,
    split = pre.use_regex == false and "none" or "gpt2", add_prefix_space = pre.add_prefix_space == true,
    files = { ["tokenizer.json"] = text }, where = path }
end

return M
