--[[
moe/data/bpe.lua - a small byte-level BPE tokenizer and its trainer
(data.train_bpe, data.BPETokenizer).

  local tok = data.train_bpe(text_or_array_of_texts, {vocab_size = 512})
  tok:encode(str) -> array of ids; tok:decode(ids) -> str; tok.vocab_size; tok.eod
  tok:save(path); local tok2 = data.BPETokenizer.load(path); tok:serialize() -> the file's text

Ids 0..255 are bytes, 256 is EOD (as in ByteTokenizer, so byte-level data
stays compatible), 257.. are merges in the order they were learned. Text is
first cut into pieces (leading whitespace + a run of letters, digits or other
bytes), merges never cross pieces, and pieces concatenate back to the text:
decode(encode(s)) == s for every byte string. Training counts adjacent pairs
over the distinct pieces weighted by frequency and merges the most frequent
pair (ties: the smallest pair id), until vocab_size or no pair occurs twice.
Deterministic. File format: a line "moe-bpe 1", then one merge "a b" per line.
]]
local M = {}

local EOD = 256

-- Cuts text into pieces; calls emit(piece) for each in order.
local function pieces(text, emit)
  local pos, n = 1, #text
  while pos <= n do
    local _, e = text:find("^%s*%a+", pos)
    if not e then _, e = text:find("^%s*%d+", pos) end
    if not e then _, e = text:find("^%s*[^%s%w]+", pos) end
    if not e then _, e = text:find("^%s+", pos) end
    emit(text:sub(pos, e))
    pos = e + 1
  end
end

local Tok = {}
Tok.__index = Tok

local function build(merges)
  local self = setmetatable({ name = "bpe", eod = EOD, merges = merges, rank = {}, str = {},
                              cache = {}, cache_size = 0 }, Tok)
  for i = 0, 255 do self.str[i] = string.char(i) end
  self.str[EOD] = "\n"
  for k, m in ipairs(merges) do
    local id = EOD + k
    self.rank[m[1] * 65536 + m[2]] = k
    self.str[id] = self.str[m[1]] .. self.str[m[2]]
  end
  self.vocab_size = EOD + 1 + #merges
  return self
end

-- Replaces every (a, b) in syms, left to right, by id; returns the new array.
local function merge_pair(syms, a, b, id)
  local out, i, n = {}, 1, #syms
  while i <= n do
    if i < n and syms[i] == a and syms[i + 1] == b then
      out[#out + 1] = id
      i = i + 2
    else
      out[#out + 1] = syms[i]
      i = i + 1
    end
  end
  return out
end

function Tok:encode_piece(p)
  local hit = self.cache[p]
  if hit then return hit end
  local syms = { p:byte(1, -1) }
  while #syms > 1 do
    local best, bi = nil, nil
    for i = 1, #syms - 1 do
      local r = self.rank[syms[i] * 65536 + syms[i + 1]]
      if r and (not best or r < best) then best, bi = r, i end
    end
    if not best then break end
    syms = merge_pair(syms, syms[bi], syms[bi + 1], EOD + best)
  end
  if self.cache_size < 100000 then
    self.cache[p] = syms
    self.cache_size = self.cache_size + 1
  end
  return syms
end

function Tok:encode(s)
  if type(s) ~= "string" then error("BPETokenizer:encode: string expected, got " .. type(s), 2) end
  local out = {}
  pieces(s, function(p)
    local syms = self:encode_piece(p)
    table.move(syms, 1, #syms, #out + 1, out)
  end)
  return out
end

function Tok:decode(ids)
  local moe = require "moe"
  if moe.is_tensor(ids) then ids = ids:reshape({ -1 }):long():totable() end
  local parts = {}
  for i, v in ipairs(ids) do
    local s = self.str[v]
    if s == nil then error(("BPETokenizer:decode: id %s at %d is outside the vocabulary"):format(tostring(v), i), 2) end
    parts[i] = s
  end
  return table.concat(parts)
end

-- The file's text (what save writes).
function Tok:serialize()
  local lines = { "moe-bpe 1" }
  for i, m in ipairs(self.merges) do lines[i + 1] = m[1] .. " " .. m[2] end
  return table.concat(lines, "\n") .. "\n"
end

function Tok:save(path)
  local f, err = io.open(path, "wb")
  if not f then error("BPETokenizer:save: cannot open " .. path .. ": " .. tostring(err), 2) end
  f:write(self:serialize())
  f:close()
end

M.BPETokenizer = {}

function M.BPETokenizer.load(path)
  local f, err = io.open(path, "rb")
  if not f then error("BPETokenizer.load: cannot open " .. tostring(path) .. ": " .. tostring(err), 2) end
  local header = f:read("l")
  if header ~= "moe-bpe 1" then
    f:close()
    error("BPETokenizer.load: " .. path .. " is not a moe-bpe 1 file", 2)
  end
  local merges, line_no = {}, 1
  for line in f:lines() do
    line_no = line_no + 1
    local a, b = line:match("^(%d+) (%d+)$")
    a, b = math.tointeger(tonumber(a)), math.tointeger(tonumber(b))
    local limit = EOD + #merges
    if not a or not b or a > limit or b > limit or a == EOD or b == EOD then
      f:close()
      error(("BPETokenizer.load: %s line %d: bad merge '%s'"):format(path, line_no, line), 2)
    end
    if EOD + 1 + #merges >= 65536 then -- ids past 16 bits would collide in the pair ranks
      f:close()
      error(("BPETokenizer.load: %s line %d: more than %d merges (a vocabulary above 65536)"):format(
        path, line_no, 65535 - EOD), 2)
    end
    merges[#merges + 1] = { a, b }
  end
  f:close()
  return build(merges)
end

function M.train_bpe(texts, opts)
  if type(texts) == "string" then texts = { texts } end
  if type(texts) ~= "table" then error("data.train_bpe: text or array of texts expected", 2) end
  opts = opts or {}
  for k in pairs(opts) do
    if k ~= "vocab_size" then
      error(("data.train_bpe: unknown option '%s' (valid: vocab_size)"):format(tostring(k)), 2)
    end
  end
  local vocab = opts.vocab_size or 512
  if math.type(vocab) ~= "integer" or vocab < EOD + 1 or vocab > 65536 then
    error(("data.train_bpe: vocab_size must be an integer in [257, 65536], got %s"):format(tostring(vocab)), 2)
  end
  local freq, order = {}, {}
  for _, t in ipairs(texts) do
    pieces(t, function(p)
      if not freq[p] then order[#order + 1] = p end
      freq[p] = (freq[p] or 0) + 1
    end)
  end
  local words = {}
  for i, p in ipairs(order) do words[i] = { syms = { p:byte(1, -1) }, f = freq[p] } end
  local merges = {}
  while EOD + 1 + #merges < vocab do
    local counts, best, best_key = {}, 1, nil
    for _, w in ipairs(words) do
      local s = w.syms
      for i = 1, #s - 1 do
        local key = s[i] * 65536 + s[i + 1]
        local c = (counts[key] or 0) + w.f
        counts[key] = c
        if c > best or (c == best and best_key and key < best_key) then best, best_key = c, key end
      end
    end
    if not best_key or best < 2 then break end
    local a, b = best_key // 65536, best_key % 65536
    merges[#merges + 1] = { a, b }
    local id = EOD + #merges
    for _, w in ipairs(words) do
      local s = w.syms
      for i = 1, #s - 1 do
        if s[i] == a and s[i + 1] == b then
          w.syms = merge_pair(s, a, b, id)
          break
        end
      end
    end
  end
  return build(merges)
end

return M
