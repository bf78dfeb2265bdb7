--[[
tests/dist/corpus.lua - the small word corpus the training tests of
tests/dist/ share: 60 documents of pseudo-random words (a fixed linear
congruential sequence, so every rank and every run writes the same bytes),
as a Megatron dataset in a fresh folder of this rank's own (no rank reads a
file another writes).

  local root, prefix = dofile(arg[0]:match("^(.*/)") .. "corpus.lua")(rank)
]]
local data = require "moe.data"

local WORDS = { "the ", "king ", "and ", "of ", "his ", "house ", "said ", "unto ", "lord ", "land ",
  "in ", "was ", "to ", "a ", "people ", "went ", "out ", "day ", ". ", "\n" }

return function(rank)
  local root = os.tmpname()
  os.remove(root)
  root = root .. "-r" .. rank
  assert(os.execute("mkdir -p '" .. root .. "'"))
  local x = 12345
  local function rnd(n) x = (x * 1103515245 + 12345) % 2147483648; return x % n end
  local prefix = root .. "/words"
  local b = data.IndexedDatasetBuilder(prefix, { dtype = "u16" })
  for _ = 1, 60 do
    local ids = {}
    for _ = 1, 20 + rnd(30) do
      for c in WORDS[rnd(#WORDS) + 1]:gmatch(".") do ids[#ids + 1] = c:byte() end
    end
    ids[#ids + 1] = 256
    b:add_document(ids)
  end
  b:finalize()
  return root, prefix
end
