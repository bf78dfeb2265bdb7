--[[
moe/sample.lua - text generation from a language model: temperature, top-k,
multinomial sampling (moe.multinomial, the global Philox RNG: seed it with
moe.manual_seed for a reproducible sample).

  local sample = require "moe.sample"
  local ids = sample.generate(model, {72, 101}, {max_new_tokens = 50, temperature = 0.8,
                                                top_k = 40, seq_len = 128, device = "cpu"})
  local text = sample.text(model, tokenizer, "In the beginning", {max_new_tokens = 200})

model: forward(idx (1, S) i64) -> logits (1, S, V) (nn.TransformerLM). A model
with new_cache() (nn.TransformerLM) decodes incrementally: the prompt runs once,
then each new token runs alone against the cached keys and values of every
layer (opts.kv_cache = false turns that off). Once the context outgrows seq_len
it is cut to the last seq_len tokens and each new token runs the model over
that window, as without a cache (the positions move with the window).
temperature = 0 is greedy (argmax); top_k = 0 or nil keeps the whole
vocabulary. Runs under moe.no_grad in eval mode and puts the model back in the
mode it was in. Each token runs inside moe.scope: its logits and temporaries
are freed when the token is picked (the KV cache keeps its tensors).
]]
local moe = require "moe"

local M = {}

--- pick(logits (V) tensor, {temperature=1, top_k=nil}) -> a token id (0-based integer).
function M.pick(logits, opts)
  opts = opts or {}
  local temperature = opts.temperature or 1.0
  if type(temperature) ~= "number" or temperature < 0 then
    error(("sample: temperature must be a number >= 0, got %s"):format(tostring(temperature)), 2)
  end
  local v = logits:float():cpu()
  if temperature == 0 then return math.tointeger(moe.argmax(v):item()) end
  local k = opts.top_k
  if k ~= nil and (math.type(k) ~= "integer" or k < 0) then
    error(("sample: top_k must be an integer >= 0, got %s"):format(tostring(k)), 2)
  end
  local n = v:size(0)
  v = v / temperature
  if k and k > 0 and k < n then
    local vals, idx = moe.topk(v, k)
    local probs = moe.softmax(vals, 0)
    local j = moe.multinomial(probs, 1):item()
    return math.tointeger(idx:totable()[math.tointeger(j) + 1])
  end
  local probs = moe.softmax(v, 0)
  return math.tointeger(moe.multinomial(probs, 1):item())
end

--- generate(model, prompt_ids (Lua array, non-empty), opts) -> array of the new ids.
--- opts: max_new_tokens=100, temperature=1, top_k=nil, seq_len=(required unless the model
--- has seq_len or cfg.seq_len, as nn.TransformerLM), device="cpu", stop=nil (an id that ends generation, not included),
--- kv_cache=true (used when the model has new_cache()).
function M.generate(model, prompt, opts)
  opts = opts or {}
  if type(prompt) ~= "table" or #prompt == 0 then
    error("bad argument #2 to 'sample.generate' (non-empty array of token ids expected)", 2)
  end
  local seq_len = opts.seq_len or model.seq_len or (type(model.cfg) == "table" and model.cfg.seq_len or nil)
  if math.type(seq_len) ~= "integer" or seq_len <= 0 then
    error("sample.generate: opts.seq_len must be a positive integer (the model's context length)", 2)
  end
  local n = opts.max_new_tokens or 100
  local device = opts.device or "cpu"
  if opts.kv_cache ~= nil and type(opts.kv_cache) ~= "boolean" then
    error("sample.generate: opts.kv_cache must be a boolean, got " .. type(opts.kv_cache), 2)
  end
  local ctx = {}
  for i, id in ipairs(prompt) do ctx[i] = id end
  local out = {}
  local was_training = model.training
  local cache = opts.kv_cache ~= false and type(model.new_cache) == "function" and model:new_cache() or nil
  -- the next token id from the model's logits for the context
  local function next_id()
    local logits, rows
    if cache and #ctx > seq_len then cache:free(); cache = nil end -- the window moves on
    if cache then -- the tokens the cache has not seen (the prompt, then one at a time)
      local new = table.move(ctx, cache.pos + 1, #ctx, 1, {})
      logits, rows = model:forward(moe.tensor({ new }, { dtype = "i64", device = device }), cache), #new
    else
      local first = math.max(1, #ctx - seq_len + 1)
      local window = table.move(ctx, first, #ctx, 1, {})
      logits, rows = model:forward(moe.tensor({ window }, { dtype = "i64", device = device })), #window
    end
    return M.pick(logits:select(0, 0):select(0, rows - 1), opts) -- (1, S, V) -> the last row
  end
  local ok, err = pcall(moe.no_grad, function()
    if model.eval then model:eval() end
    for _ = 1, n do
      local id = moe.scope(next_id)
      if opts.stop ~= nil and id == opts.stop then break end
      ctx[#ctx + 1] = id
      out[#out + 1] = id
    end
  end)
  if cache then cache:free() end
  if was_training and model.train then model:train() end
  if not ok then error(err, 0) end
  return out
end

--- text(model, tokenizer, prompt_string, opts) -> prompt .. generated text. An empty prompt
--- starts from the tokenizer's end-of-document id (tokenizer.eod). The end-of-document id
--- and ids past the tokenizer's vocab_size (a model's vocabulary padded beyond the
--- tokenizer's) are left out of the text.
function M.text(model, tokenizer, prompt, opts)
  local ids = tokenizer:encode(prompt or "")
  if #ids == 0 then ids = { tokenizer.eod or 0 } end
  local new = M.generate(model, ids, opts)
  local keep = {}
  local limit = math.type(tokenizer.vocab_size) == "integer" and tokenizer.vocab_size or math.huge
  for _, id in ipairs(new) do
    if id ~= tokenizer.eod and id < limit then keep[#keep + 1] = id end
  end
  return (prompt or "") .. tokenizer:decode(keep)
end

return M
