--[[
moe/data/gpt.lua - GPTDataset: training samples of seq_len + 1 tokens from an
indexed dataset (data.GPTDataset).

  local gd = data.GPTDataset(ds, {seq_len=, seed=1234, split="train"|"valid",
                                  valid_fraction=0.05})
  local x, y = gd:batch(B)   -- (B, seq_len) i64 CPU tensors, y = x shifted by one
  local x, y = gd:shard_batch(B, rank, ranks)  -- rows [rank*B, (rank+1)*B) of batch(ranks*B)
  gd:state() -> {epoch=, position=}; gd:set_state(s); gd:reset(); gd:num_samples()

Split: the last valid_fraction of the documents (at least one when there are
two or more) form "valid", the rest "train"; a split's token stream is its
documents concatenated as stored (preprocess ends each with EOD), so no window
crosses the split boundary. Sample k is stream tokens [k * seq_len,
k * seq_len + seq_len + 1) (consecutive samples share one token, as in
Megatron), k < num_samples = floor((tokens - 1) / seq_len).

Order: each epoch visits every sample once in a Fisher-Yates permutation
drawn from splitmix64 seeded by (seed, epoch, split), a local integer RNG
independent of math.random and of moe's generator, so (epoch, position)
resumes exactly.
]]
local M = {}

local GPT = {}
GPT.__index = GPT

local function fail(msg, ...) error(("data.GPTDataset: " .. msg):format(...), 3) end

-- splitmix64: returns a generator of 64-bit integers (wrapping arithmetic).
local function splitmix64(seed)
  local x = seed
  return function()
    x = x + 0x9E3779B97F4A7C15
    local z = x
    z = (z ~ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ~ (z >> 27)) * 0x94D049BB133111EB
    return z ~ (z >> 31)
  end
end

local function permutation(n, seed, epoch, salt)
  local nextr = splitmix64(seed * 1000003 + epoch * 7919 + salt)
  local p = {}
  for i = 1, n do p[i] = i - 1 end
  for i = n, 2, -1 do
    local j = ((nextr() >> 1) % i) + 1
    p[i], p[j] = p[j], p[i]
  end
  return p
end

local known = { seq_len = true, seed = true, split = true, valid_fraction = true }

function M.GPTDataset(ds, opts)
  if type(ds) ~= "userdata" or not pcall(function() return ds:num_documents() end) then
    fail("an indexed dataset (data.IndexedDataset) expected, got %s", type(ds))
  end
  if type(opts) ~= "table" then fail("options table expected, got %s", type(opts)) end
  for k in pairs(opts) do
    if not known[k] then fail("unknown option '%s' (valid: seed, seq_len, split, valid_fraction)", tostring(k)) end
  end
  local seq_len, seed = opts.seq_len, opts.seed or 1234
  local split, vf = opts.split or "train", opts.valid_fraction or 0.05
  if math.type(seq_len) ~= "integer" or seq_len < 1 then
    fail("seq_len must be an integer >= 1, got %s", tostring(seq_len))
  end
  if math.type(seed) ~= "integer" then fail("seed must be an integer, got %s", tostring(seed)) end
  if split ~= "train" and split ~= "valid" then
    fail("split must be \"train\" or \"valid\", got %s", tostring(split))
  end
  if type(vf) ~= "number" or vf < 0 or vf >= 1 then
    fail("valid_fraction must be in [0, 1), got %s", tostring(vf))
  end
  local ndocs = ds:num_documents()
  local nvalid = 0
  if vf > 0 and ndocs >= 2 then nvalid = math.max(1, math.floor(ndocs * vf + 0.5)) end
  if nvalid >= ndocs then nvalid = ndocs - 1 end
  if split == "valid" and nvalid == 0 then
    fail("no validation split: %d document(s), valid_fraction %s", ndocs, tostring(vf))
  end
  local d0, d1 = 0, ndocs - nvalid
  if split == "valid" then d0, d1 = ndocs - nvalid, ndocs end
  local self = setmetatable({
    ds = ds, seq_len = seq_len, seed = seed, split = split,
    seq_begin = ds:document_start(d0), seq_end = ds:document_start(d1),
    epoch = 0, position = 0,
  }, GPT)
  self.tokens = ds:token_offset(self.seq_end) - ds:token_offset(self.seq_begin)
  self.samples = (self.tokens - 1) // seq_len
  if self.samples < 1 then
    fail("the %s split has %d tokens, fewer than seq_len + 1 = %d", split, self.tokens, seq_len + 1)
  end
  self.salt = split == "train" and 1 or 2
  self.perm = permutation(self.samples, seed, 0, self.salt)
  return self
end

function GPT:num_samples() return self.samples end
function GPT:num_tokens() return self.tokens end

-- The start tokens of the next n samples (advancing epoch and position).
local function draw(self, n)
  local starts = {}
  for b = 1, n do
    if self.position >= self.samples then
      self.epoch = self.epoch + 1
      self.position = 0
      self.perm = permutation(self.samples, self.seed, self.epoch, self.salt)
    end
    starts[b] = self.perm[self.position + 1] * self.seq_len
    self.position = self.position + 1
  end
  return starts
end

local function windows(self, starts)
  local w = self.ds:windows(self.seq_begin, self.seq_end, starts, self.seq_len + 1)
  local x = w:narrow(1, 0, self.seq_len):contiguous()
  local y = w:narrow(1, 1, self.seq_len):contiguous()
  w:free()
  return x, y
end

local function check_batch(fn, B)
  if math.type(B) ~= "integer" or B < 1 then
    error(("GPTDataset:%s: batch size must be an integer >= 1, got %s"):format(fn, tostring(B)), 3)
  end
end

-- x, y: (B, seq_len) i64 CPU tensors.
function GPT:batch(B)
  check_batch("batch", B)
  return windows(self, draw(self, B))
end

-- x, y: rows [rank * B, (rank + 1) * B) of what batch(ranks * B) would return,
-- leaving the dataset where batch(ranks * B) leaves it (data parallelism: every
-- rank draws the same global batch and reads only its own rows).
function GPT:shard_batch(B, rank, ranks)
  check_batch("shard_batch", B)
  if math.type(ranks) ~= "integer" or ranks < 1 or math.type(rank) ~= "integer" or rank < 0
      or rank >= ranks then
    error(("GPTDataset:shard_batch: rank must be an integer in [0, ranks), got rank %s of %s"):format(
      tostring(rank), tostring(ranks)), 2)
  end
  local starts = draw(self, B * ranks)
  return windows(self, table.move(starts, rank * B + 1, (rank + 1) * B, 1, {}))
end

function GPT:state() return { epoch = self.epoch, position = self.position } end

function GPT:set_state(s)
  if type(s) ~= "table" or math.type(s.epoch) ~= "integer" or math.type(s.position) ~= "integer"
      or s.epoch < 0 or s.position < 0 or s.position > self.samples then
    error("GPTDataset:set_state: {epoch = integer >= 0, position = integer in [0, num_samples]} expected", 2)
  end
  if s.epoch ~= self.epoch then self.perm = permutation(self.samples, self.seed, s.epoch, self.salt) end
  self.epoch, self.position = s.epoch, s.position
end

function GPT:reset() self:set_state({ epoch = 0, position = 0 }) end

return M
