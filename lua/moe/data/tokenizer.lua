--[[
moe/data/tokenizer.lua - choosing a tokenizer and recording it
(data.load_tokenizer, data.tokenizer_record, data.dataset_tokenizer).

  data.load_tokenizer(spec) -> tokenizer, where spec is
    "byte" (or nil)              the byte tokenizer (vocab 257, EOD 256)
    "bpe:PATH" or a moe-bpe file moe-lua's own small BPE (moe/data/bpe.lua)
    a directory                  its tokenizer.json, else its vocab.json + merges.txt
    a tokenizer.json path        Hugging Face tokenizers' format (moe/data/gpt2.lua)
    a vocab.json path            with merges.txt beside it (X-vocab.json: X-merges.txt)
    a tokenizer object           returned as it is
  Every tokenizer has encode(str) -> ids, decode(ids) -> str, vocab_size, eod, name.

Recording: what a dataset or a checkpoint keeps so that the same tokenizer
comes back without the original files.
  record, files = M.record(tok)   record = {kind = "byte"|"bpe"|"gpt2", vocab_size =,
      eod =, files = {name, ...}}; files = {name -> text}: the tokenizer's own files
      (tokenizer.json, or vocab.json and merges.txt, or tokenizer.bpe), byte for byte
      as they were read. nil for a tokenizer object of another kind.
  M.from_record(record, dir, prefix) reads them back from dir .. "/" .. prefix .. name.
  A dataset PREFIX.bin/.idx written by data.preprocess has PREFIX.meta.json
  ({format = "moe-lua-dataset", version = 1, documents, tokens, tokenizer = record})
  and the files as PREFIX.<name>; M.for_dataset(prefix) -> tokenizer, meta, or nil
  when there is no meta file (data from elsewhere: byte data, as before).
]]
local M = {}

local DATASET_FORMAT, DATASET_VERSION = "moe-lua-dataset", 1

local function read_file(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  return s
end

local function is_dir(path)
  local f = io.open(path, "rb")
  if not f then return false end
  local _, _, code = f:read(1)
  f:close()
  return code == 21 -- EISDIR
end

local function exists(path)
  local f = io.open(path, "rb")
  if f then f:close() end
  return f ~= nil
end

local function gpt2() return require "moe.data.gpt2" end
local function bpe() return require "moe.data.bpe" end

--- load(spec) -> tokenizer (see the header).
function M.load(spec)
  local fn = "data.load_tokenizer"
  local data = require "moe.data"
  if spec == nil or spec == "byte" then return data.ByteTokenizer() end
  if type(spec) == "table" and type(spec.encode) == "function" then return spec end
  if type(spec) ~= "string" or spec == "" then
    error(("%s: tokenizer spec expected (byte, bpe:FILE, a directory or a file), got %s"):format(
      fn, tostring(spec)), 0)
  end
  if spec:sub(1, 4) == "bpe:" then return bpe().BPETokenizer.load(spec:sub(5)) end
  if is_dir(spec) then
    local dir = spec:gsub("/+$", "")
    if exists(dir .. "/tokenizer.json") then return gpt2().from_tokenizer_json(dir .. "/tokenizer.json") end
    if exists(dir .. "/vocab.json") and exists(dir .. "/merges.txt") then
      return gpt2().from_files(dir .. "/vocab.json", dir .. "/merges.txt")
    end
    error(("%s: %s has no tokenizer.json and no vocab.json + merges.txt"):format(fn, spec), 0)
  end
  if not exists(spec) then
    error(("%s: unknown tokenizer '%s' (byte, bpe:FILE, or the path of a directory, a tokenizer.json, " ..
      "a vocab.json or a moe-bpe file; no such file)"):format(fn, spec), 0)
  end
  local f = assert(io.open(spec, "rb"))
  local head = f:read(16) or ""
  f:close()
  if head:sub(1, 10) == "moe-bpe 1\n" then return bpe().BPETokenizer.load(spec) end
  if spec:match("vocab%.json$") then
    local merges = spec:gsub("vocab%.json$", "merges.txt")
    if not exists(merges) then
      error(("%s: %s needs its merges file %s, which does not exist"):format(fn, spec, merges), 0)
    end
    return gpt2().from_files(spec, merges)
  end
  if spec:match("%.json$") then return gpt2().from_tokenizer_json(spec) end
  error(("%s: %s is not a tokenizer file (tokenizer.json, vocab.json or a moe-bpe file)"):format(fn, spec), 0)
end

--- record(tok) -> record, files (see the header), or nil for other tokenizers.
function M.record(tok)
  if type(tok) ~= "table" then return nil end
  local json = require("moe.metrics").json
  local rec = { kind = tok.name, vocab_size = tok.vocab_size, eod = tok.eod, files = setmetatable({}, json.array_mt) }
  local files = {}
  if tok.name == "byte" then
    return rec, files
  elseif tok.name == "bpe" and tok.serialize then
    files["tokenizer.bpe"] = tok:serialize()
  elseif tok.name == "gpt2" and type(tok.files) == "table" then
    for name, text in pairs(tok.files) do files[name] = text end
  else
    return nil
  end
  for name in pairs(files) do rec.files[#rec.files + 1] = name end
  table.sort(rec.files)
  return rec, files
end

--- from_record(record, dir, prefix) -> tokenizer: the files of a record read back
--- from dir/<prefix><name>; where names the record in messages.
function M.from_record(rec, dir, prefix, where)
  local fn = "tokenizer"
  where = where or dir
  if type(rec) ~= "table" or type(rec.kind) ~= "string" then
    error(("%s: %s: the tokenizer record is missing or corrupt"):format(fn, where), 0)
  end
  local names = {}
  for _, name in ipairs(type(rec.files) == "table" and rec.files or {}) do
    if type(name) ~= "string" or name:find("/", 1, true) then
      error(("%s: %s: bad tokenizer file name %s"):format(fn, where, tostring(name)), 0)
    end
    local path = dir .. "/" .. prefix .. name
    if not exists(path) then
      error(("%s: %s records the tokenizer file %s, which is missing"):format(fn, where, path), 0)
    end
    names[name] = path
  end
  local tok
  if rec.kind == "byte" then
    tok = require("moe.data").ByteTokenizer()
  elseif rec.kind == "bpe" and names["tokenizer.bpe"] then
    tok = bpe().BPETokenizer.load(names["tokenizer.bpe"])
  elseif rec.kind == "gpt2" and names["tokenizer.json"] then
    tok = gpt2().from_tokenizer_json(names["tokenizer.json"])
  elseif rec.kind == "gpt2" and names["vocab.json"] and names["merges.txt"] then
    tok = gpt2().from_files(names["vocab.json"], names["merges.txt"])
  else
    error(("%s: %s: unknown tokenizer kind '%s' or missing files"):format(fn, where, rec.kind), 0)
  end
  if tok.vocab_size ~= rec.vocab_size or tok.eod ~= rec.eod then
    error(("%s: %s records vocab_size %s and eod %s, but its files give %s and %s"):format(fn, where,
      tostring(rec.vocab_size), tostring(rec.eod), tostring(tok.vocab_size), tostring(tok.eod)), 0)
  end
  return tok
end

local function split_path(prefix)
  local dir, base = prefix:match("^(.*)/([^/]*)$")
  if not dir then return ".", prefix end
  return dir == "" and "/" or dir, base
end

local function write_file(path, text)
  local f, err = io.open(path, "wb")
  if not f then error(("data.preprocess: cannot write %s: %s"):format(path, tostring(err)), 0) end
  local ok, werr = f:write(text)
  local cok, cerr = f:close()
  if not ok or not cok then error(("data.preprocess: cannot write %s: %s"):format(path, tostring(werr or cerr)), 0) end
end

--- write_dataset_meta(prefix, tok, stats): PREFIX.meta.json and the tokenizer's files
--- beside PREFIX.bin/.idx. Returns the meta table (nil for an unrecordable tokenizer).
function M.write_dataset_meta(prefix, tok, stats)
  local rec, files = M.record(tok)
  if not rec then return nil end
  local dir, base = split_path(prefix)
  for name, text in pairs(files) do write_file(dir .. "/" .. base .. "." .. name, text) end
  local meta = { format = DATASET_FORMAT, version = DATASET_VERSION, tokenizer = rec,
    documents = stats and stats.documents, tokens = stats and stats.tokens }
  local json = require("moe.metrics").json
  write_file(prefix .. ".meta.json.tmp", json.encode(meta) .. "\n")
  local ok, err = os.rename(prefix .. ".meta.json.tmp", prefix .. ".meta.json")
  if not ok then error(("data.preprocess: cannot write %s.meta.json: %s"):format(prefix, tostring(err)), 0) end
  return meta
end

--- for_dataset(prefix) -> tokenizer, meta: the tokenizer recorded beside a dataset,
--- or nil when PREFIX.meta.json does not exist.
function M.for_dataset(prefix)
  local path = prefix .. ".meta.json"
  local text = read_file(path)
  if text == nil then return nil end
  local json = require("moe.metrics").json
  local ok, meta = pcall(json.decode, text)
  if not ok or type(meta) ~= "table" or meta.format ~= DATASET_FORMAT then
    error(("data: %s is corrupt or not a moe-lua dataset meta file%s"):format(path,
      ok and "" or ": " .. tostring(meta)), 0)
  end
  if meta.version ~= DATASET_VERSION then
    error(("data: %s has version %s; this moe-lua reads version %d"):format(path, tostring(meta.version),
      DATASET_VERSION), 0)
  end
  local dir, base = split_path(prefix)
  return M.from_record(meta.tokenizer, dir, base .. ".", path), meta
end

return M
