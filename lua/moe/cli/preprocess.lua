--[[
moe/cli/preprocess.lua - `moe-lua preprocess`: text files to a Megatron-LM
indexed dataset (prefix.bin/.idx) with the byte tokenizer, or the default
corpus (the King James Bible).

  moe-lua preprocess input=a.txt[,b.txt...] output=data/mytext [split=line|blank_line|file]
  moe-lua preprocess corpus=bible [dir=data]
]]
local M = {
  summary = "text files to a Megatron .bin/.idx dataset (byte tokenizer), or corpus=bible",
  usage = [[
usage: moe-lua preprocess input=FILE[,FILE...] output=PREFIX [split=line|blank_line|file]
                          [tokenizer=byte|bpe:MERGES_FILE]
       moe-lua preprocess corpus=bible [dir=data]
Each document (a line, a blank-line separated paragraph, or a file) is tokenized
and ended with EOD; writes PREFIX.bin and PREFIX.idx (Megatron-LM MMIDIDX).]],
}

local known = { input = true, output = true, split = true, tokenizer = true, corpus = true, dir = true }

function M.main(...)
  local opts = {}
  for _, a in ipairs({ ... }) do
    local k, v = a:match("^([%w_]+)=(.*)$")
    if not k or not known[k] then
      io.stderr:write(("moe-lua preprocess: bad argument '%s'\n%s\n"):format(a, M.usage))
      return 2
    end
    opts[k] = v
  end
  local data = require "moe.data"
  local ok, err = pcall(function()
    if opts.corpus then
      if opts.corpus ~= "bible" then error("unknown corpus '" .. opts.corpus .. "' (available: bible)", 0) end
      local prefix = data.bible_corpus { dir = opts.dir }
      local ds = data.IndexedDataset(prefix)
      print(("%s: %d documents, %d tokens"):format(prefix, ds:num_documents(), ds:num_tokens()))
      return
    end
    if not opts.input or not opts.output then error("input= and output= are required", 0) end
    local inputs = {}
    for f in opts.input:gmatch("[^,]+") do inputs[#inputs + 1] = f end
    local prefix, stats = data.preprocess { inputs = inputs, output_prefix = opts.output,
                                            split_documents = opts.split, tokenizer = opts.tokenizer }
    print(("%s: %d documents, %d tokens"):format(prefix, stats.documents, stats.tokens))
  end)
  if not ok then
    io.stderr:write("moe-lua preprocess: " .. tostring(err) .. "\n")
    return 1
  end
  return 0
end

return M
