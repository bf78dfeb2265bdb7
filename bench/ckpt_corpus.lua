--[[
bench/ckpt_corpus.lua - a word corpus large enough for long sequences, for
bench/ckpt_round.sh when no dataset is given: `docs` documents of
pseudo-random words (the generator of tests/dist/trainkit.lua: the same bytes
on every run), a Megatron dataset with the byte vocabulary (257 ids).

  moe-lua bench/ckpt_corpus.lua prefix=/tmp/moe-ckpt-corpus/words [docs=4000]
]]
local moe = require "moe"
local data = require "moe.data"
local o = moe.config { prefix = "", docs = 4000 }
assert(o.prefix ~= "", "give prefix=PATH")
local dir = o.prefix:match("^(.*)/[^/]*$")
if dir then assert(os.execute("mkdir -p '" .. dir:gsub("'", "'\\''") .. "'")) end
local WORDS = { "the ", "king ", "and ", "of ", "his ", "house ", "said ", "unto ", "lord ", "land ",
  "in ", "was ", "to ", "a ", "people ", "went ", "out ", "day ", ". ", "\n" }
local x = 12345
local function rnd(n) x = (x * 1103515245 + 12345) % 2147483648; return x % n end
local b = data.IndexedDatasetBuilder(o.prefix, { dtype = "u16" })
local tokens = 0
for _ = 1, o.docs do
  local ids = {}
  for _ = 1, 20 + rnd(30) do
    for c in WORDS[rnd(#WORDS) + 1]:gmatch(".") do ids[#ids + 1] = c:byte() end
  end
  ids[#ids + 1] = 256
  b:add_document(ids)
  tokens = tokens + #ids
end
b:finalize()
print(("ckpt_corpus: %s: %d documents, %d tokens"):format(o.prefix, o.docs, tokens))
