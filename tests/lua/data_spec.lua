--[[
tests/lua/data_spec.lua - moe.data: the indexed dataset builder and reader
(values, 0-based get with offset and length, multi-sequence documents written
by numpy), corrupt and truncated files, the byte tokenizer, preprocess with
each document split, GPTDataset (windows and their shift, the train/valid
split boundary, seeded shuffling, epochs, exact resume), unigram_entropy,
the Bible corpus when `bible` is installed, and bad arguments.

The numpy client (tests/python/check_indexed.py) reads a file written here
and writes one in Megatron's layout that is read back here. Without a Python
that has numpy the client test is pending ("SKIPPED ..."); with CI set it
fails instead. Python: $MOE_PYTHON, else ~/.cache/moe-lua/pyvenv, else python3.

Run: moe-lua tests/lua/busted.lua tests/lua/data_spec.lua (ctest does).
]]
local moe = require "moe"
local data = require "moe.data"

local function sh_quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

local dir = os.tmpname()
os.remove(dir)
assert(os.execute("mkdir -p " .. sh_quote(dir)))
local function P(name) return dir .. "/" .. name end
lazy_teardown(function() os.execute("rm -rf " .. sh_quote(dir)) end)

local spec_dir = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests/lua"
local checker = spec_dir .. "/../python/check_indexed.py"

local function write_file(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end

local read_file = dofile(spec_dir .. "/read_file.lua")

-- documents {10, 11, 12}, {}, {13}, {14, 15, 16, 17}
local function small(prefix, dtype)
  local b = data.IndexedDatasetBuilder(P(prefix), { dtype = dtype })
  b:add_document({ 10, 11, 12 })
  b:add_document({})
  b:add_document(moe.tensor({ 13 }, { dtype = "i64" }))
  b:add_document({ 14, 15, 16, 17 })
  return b:finalize()
end

describe("IndexedDataset", function()
  it("reads back what the builder wrote", function()
    for _, dt in ipairs({ "u8", "i16", "u16", "i32", "i64" }) do
      local ds = data.IndexedDataset(small("s_" .. dt, dt))
      assert.are.equal(4, #ds)
      assert.are.equal(4, ds:num_documents())
      assert.are.equal(8, ds:num_tokens())
      assert.are.equal(dt, ds:dtype())
      assert.are.same({ 10, 11, 12 }, ds:get(0):totable())
      assert.are.same({}, ds:get(1):totable())
      assert.are.same({ 15, 16 }, ds:get(3, 1, 2):totable())
      assert.are.same({ 16, 17 }, ds:get(3, 2):totable())
      assert.are.equal("i64", ds:get(0).dtype)
      assert.are.equal("cpu", ds:get(0).device)
      assert.matches("IndexedDataset%(sequences=4, documents=4, tokens=8, dtype=" .. dt, tostring(ds))
      ds:close()
      assert.has_error(function() ds:get(0) end)
    end
  end)

  it("accepts the prefix with .bin or .idx", function()
    local prefix = small("ext", "u16")
    assert.are.equal(4, #data.IndexedDataset(prefix .. ".bin"))
    assert.are.equal(4, #data.IndexedDataset(prefix .. ".idx"))
  end)

  it("gives clear errors for bad indices", function()
    local ds = data.IndexedDataset(small("idx", "u16"))
    local ok, err = pcall(ds.get, ds, 4)
    assert.is_false(ok)
    assert.matches("bad argument #2 to 'get' %(sequence 4 out of range %[0, 3%]%)", err)
    ok, err = pcall(ds.get, ds, 0, 1, 3)
    assert.is_false(ok)
    assert.matches("length 3 out of range %[0, 2%]", err)
  end)

  it("rejects corrupt and truncated files, naming the file", function()
    local prefix = small("c", "u16")
    local idx, bin = read_file(prefix .. ".idx"), read_file(prefix .. ".bin")
    local function expect(what, new_idx, new_bin)
      write_file(P("bad.idx"), new_idx or idx)
      write_file(P("bad.bin"), new_bin or bin)
      local ok, err = pcall(data.IndexedDataset, P("bad"))
      assert.is_false(ok)
      assert.matches(what, err, 1, true)
      assert.matches(P("bad"), err, 1, true)
    end
    expect("bad magic", "XX" .. idx:sub(3))
    expect("is truncated", idx:sub(1, 20))
    expect("is truncated or corrupt", idx:sub(1, #idx - 1))
    expect("version 3", idx:sub(1, 9) .. string.pack("<I8", 3) .. idx:sub(18))
    expect("lies outside", nil, bin:sub(1, #bin - 2))
    write_file(P("bad.idx"), idx) -- control: an intact copy opens
    write_file(P("bad.bin"), bin)
    assert.are.equal(4, #data.IndexedDataset(P("bad")))
  end)

  it("reports a missing dataset", function()
    local ok, err = pcall(data.IndexedDataset, P("nothing"))
    assert.is_false(ok)
    assert.matches("cannot open " .. P("nothing") .. ".bin", err, 1, true)
  end)
end)

describe("ByteTokenizer", function()
  it("encodes bytes and decodes with EOD as a newline", function()
    local tok = data.ByteTokenizer()
    assert.are.equal(257, tok.vocab_size)
    assert.are.equal(256, tok.eod)
    assert.are.same({ 104, 105, 0, 255 }, tok:encode("hi\0\255"))
    assert.are.equal("hi\nyo", tok:decode({ 104, 105, 256, 121, 111 }))
    assert.are.equal("ab", tok:decode(moe.tensor({ { 97, 98 } }, { dtype = "i64" })))
    local long = string.rep("abc", 5000)
    assert.are.equal(long, tok:decode(tok:encode(long)))
  end)
end)

describe("BPE", function()
  local text = ("the cat sat on the mat; the hat is that flat hat.\n"):rep(20) .. "Über 42 \255\0 end\n"

  it("learns merges deterministically and round-trips any bytes", function()
    local tok = data.train_bpe(text, { vocab_size = 300 })
    assert.is_true(tok.vocab_size > 257 and tok.vocab_size <= 300)
    assert.are.equal(256, tok.eod)
    local ids = tok:encode(text)
    assert.is_true(#ids < #text / 2, ("%d ids for %d bytes"):format(#ids, #text))
    assert.are.equal(text, tok:decode(ids))
    local other = "unseen words: zebra \1\2\3 ééé\n\n  spaces  "
    assert.are.equal(other, tok:decode(tok:encode(other)))
    assert.are.same(ids, data.train_bpe(text, { vocab_size = 300 }):encode(text))
    assert.are.equal("at", tok:decode({ 257 })) -- the most frequent pair: c-at s-at m-at h-at th-at fl-at
  end)

  it("saves, loads and feeds preprocess", function()
    local tok = data.train_bpe(text, { vocab_size = 280 })
    tok:save(P("bpe.txt"))
    local tok2 = data.BPETokenizer.load(P("bpe.txt"))
    assert.are.same(tok:encode(text), tok2:encode(text))
    write_file(P("bpe_in.txt"), "the cat\nthe hat\n")
    local prefix = data.preprocess { inputs = { P("bpe_in.txt") }, output_prefix = P("bpe_ds"),
                                     tokenizer = "bpe:" .. P("bpe.txt") }
    local ds = data.IndexedDataset(prefix)
    assert.are.equal(2, #ds)
    assert.are.equal("the cat\n", tok:decode(ds:get(0))) -- EOD decodes as a newline
    write_file(P("bad_bpe.txt"), "moe-bpe 1\n1 999\n")
    assert.has_error(function() data.BPETokenizer.load(P("bad_bpe.txt")) end)
    assert.has_error(function() data.train_bpe(text, { vocab_size = 10 }) end,
      "data.train_bpe: vocab_size must be an integer in [257, 65536], got 10")
  end)
end)

describe("preprocess", function()
  local text = "first line\nsecond line\n\n  \nthird paragraph\nstill third\n"
  before_each(function() write_file(P("in.txt"), text) end)

  local function docs(prefix)
    local ds, tok, out = data.IndexedDataset(prefix), data.ByteTokenizer(), {}
    for i = 0, #ds - 1 do out[#out + 1] = tok:decode(ds:get(i)) end
    return out
  end

  it("splits documents by line, blank line or file and appends EOD", function()
    local prefix, stats = data.preprocess { inputs = { P("in.txt") }, output_prefix = P("line") }
    assert.are.same({ "first line\n", "second line\n", "third paragraph\n", "still third\n" }, docs(prefix))
    assert.are.equal(4, stats.documents)
    local ds = data.IndexedDataset(prefix)
    assert.are.equal(256, ds:get(0):totable()[11])
    data.preprocess { inputs = { P("in.txt") }, output_prefix = P("para"), split_documents = "blank_line" }
    assert.are.same({ "first line\nsecond line\n", "third paragraph\nstill third\n\n" }, docs(P("para")))
    data.preprocess { inputs = { P("in.txt"), P("in.txt") }, output_prefix = P("file"), split_documents = "file" }
    assert.are.same({ text .. "\n", text .. "\n" }, docs(P("file")))
  end)

  it("runs as the host command `moe-lua preprocess`", function()
    local exe = arg and arg[-1] or "moe-lua"
    local cmd = ("%s preprocess input=%s output=%s split=blank_line 2>&1"):format(
      sh_quote(exe), sh_quote(P("in.txt")), sh_quote(P("cli")))
    local p = io.popen(cmd)
    local out = p:read("a")
    assert.is_true(p:close(), out)
    assert.matches("2 documents", out)
    assert.are.equal(2, #data.IndexedDataset(P("cli")))
  end)

  it("rejects bad options and missing inputs", function()
    local function run(extra)
      local o = { inputs = { P("in.txt") }, output_prefix = P("x") }
      for k, v in pairs(extra) do o[k] = v end
      return function() data.preprocess(o) end
    end
    assert.has_error(run { split = "line" },
      "data.preprocess: unknown option 'split' (valid: dtype, inputs, output_prefix, split_documents, tokenizer)")
    local ok, err = pcall(data.preprocess, { inputs = { P("missing.txt") }, output_prefix = P("x") })
    assert.is_false(ok)
    assert.matches("data.preprocess: cannot open " .. P("missing.txt"), err, 1, true)
    assert.error_matches(run { tokenizer = "bpe" }, "data.load_tokenizer: unknown tokenizer 'bpe' %(byte, bpe:FILE")
  end)
end)

-- 40 documents: document d holds tokens d * 100 + j for j < 5 + d % 7.
local function numbered(prefix)
  local b = data.IndexedDatasetBuilder(P(prefix), { dtype = "i32" })
  for d = 0, 39 do
    local t = {}
    for j = 0, 4 + d % 7 do t[#t + 1] = d * 100 + j end
    b:add_document(t)
  end
  return data.IndexedDataset(b:finalize())
end

describe("GPTDataset", function()
  it("gives shifted windows of the concatenated documents", function()
    local ds = numbered("g1")
    local gd = data.GPTDataset(ds, { seq_len = 8, seed = 1, valid_fraction = 0.1 })
    local valid = data.GPTDataset(ds, { seq_len = 8, seed = 1, split = "valid", valid_fraction = 0.1 })
    assert.are.equal(ds:document_start(36), valid.seq_begin) -- 4 of 40 documents
    assert.are.equal((gd:num_tokens() - 1) // 8, gd:num_samples())
    -- the train stream, token by token
    local stream = {}
    for i = 0, 35 do
      for _, v in ipairs(ds:get(i):totable()) do stream[#stream + 1] = v end
    end
    assert.are.equal(#stream, gd:num_tokens())
    local x, y = gd:batch(3)
    assert.are.same({ 3, 8 }, x.shape)
    assert.are.equal("i64", y.dtype)
    local xt, yt = x:totable(), y:totable()
    for b = 1, 3 do
      local start
      for s = 1, #stream do
        if stream[s] == xt[b][1] then start = s end
      end
      for k = 1, 8 do
        assert.are.equal(stream[start + k - 1], xt[b][k])
        assert.are.equal(stream[start + k], yt[b][k])
      end
      assert.are.equal(0, (start - 1) % 8) -- windows start at multiples of seq_len
    end
    -- valid windows only hold valid documents' tokens
    local vx = valid:batch(valid:num_samples())
    for _, row in ipairs(vx:totable()) do
      for _, v in ipairs(row) do assert.is_true(v >= 3600) end
    end
  end)

  it("visits every sample once per epoch, seeded, and resumes exactly", function()
    local ds = numbered("g2")
    local gd = data.GPTDataset(ds, { seq_len = 4, seed = 7 })
    local n = gd:num_samples()
    local seen = {}
    local x = gd:batch(n)
    for _, row in ipairs(x:totable()) do
      local key = table.concat(row, ",")
      assert.is_nil(seen[key])
      seen[key] = true
    end
    assert.are.same({ epoch = 0, position = n }, gd:state())
    gd:batch(1)
    assert.are.same({ epoch = 1, position = 1 }, gd:state())
    -- same seed, same order; another seed, another order
    local a = data.GPTDataset(ds, { seq_len = 4, seed = 7 }):batch(6):totable()
    local b = data.GPTDataset(ds, { seq_len = 4, seed = 7 }):batch(6):totable()
    local c = data.GPTDataset(ds, { seq_len = 4, seed = 8 }):batch(6):totable()
    assert.are.same(a, b)
    assert.are_not.same(a, c)
    -- resume: a fresh dataset set to a saved state continues identically
    local g1 = data.GPTDataset(ds, { seq_len = 4, seed = 7 })
    for _ = 1, 9 do g1:batch(5) end
    local st = g1:state()
    local want = { g1:batch(5):totable(), g1:batch(5):totable() }
    local g2 = data.GPTDataset(ds, { seq_len = 4, seed = 7 })
    g2:set_state(st)
    assert.are.same(want, { g2:batch(5):totable(), g2:batch(5):totable() })
    g2:reset()
    assert.are.same(a, g2:batch(6):totable())
  end)

  it("gives each rank its rows of the global batch (shard_batch)", function()
    local ds = numbered("g4")
    local n = data.GPTDataset(ds, { seq_len = 4, seed = 7 }):num_samples()
    local B, R = 3, 4
    -- across an epoch boundary: start near the end of epoch 0
    local whole = data.GPTDataset(ds, { seq_len = 4, seed = 7 })
    whole:set_state({ epoch = 0, position = n - 5 })
    local wx, wy = whole:batch(R * B)
    wx, wy = wx:totable(), wy:totable()
    for r = 0, R - 1 do
      local gd = data.GPTDataset(ds, { seq_len = 4, seed = 7 })
      gd:set_state({ epoch = 0, position = n - 5 })
      local x, y = gd:shard_batch(B, r, R)
      assert.are.same({ B, 4 }, x.shape)
      local xt, yt = x:totable(), y:totable()
      for b = 1, B do
        assert.are.same(wx[r * B + b], xt[b])
        assert.are.same(wy[r * B + b], yt[b])
      end
      assert.are.same(whole:state(), gd:state()) -- where batch(R * B) leaves it
    end
    local gd = data.GPTDataset(ds, { seq_len = 4, seed = 7 })
    assert.has_error(function() gd:shard_batch(2, 2, 2) end,
      "GPTDataset:shard_batch: rank must be an integer in [0, ranks), got rank 2 of 2")
    assert.has_error(function() gd:shard_batch(0, 0, 2) end,
      "GPTDataset:shard_batch: batch size must be an integer >= 1, got 0")
  end)

  it("rejects bad options", function()
    local ds = numbered("g3")
    assert.has_error(function() data.GPTDataset(ds, { seq_len = 4, shuffle = true }) end,
      "data.GPTDataset: unknown option 'shuffle' (valid: seed, seq_len, split, valid_fraction)")
    assert.has_error(function() data.GPTDataset(ds, { seq_len = 0 }) end,
      "data.GPTDataset: seq_len must be an integer >= 1, got 0")
    assert.has_error(function() data.GPTDataset(ds, { seq_len = 100000 }) end)
    assert.has_error(function() data.GPTDataset(ds, { seq_len = 4, split = "test" }) end,
      "data.GPTDataset: split must be \"train\" or \"valid\", got test")
    assert.has_error(function() data.GPTDataset({}, { seq_len = 4 }) end)
    local gd = data.GPTDataset(ds, { seq_len = 4 })
    assert.has_error(function() gd:set_state({ epoch = 0 }) end)
  end)
end)

describe("unigram_entropy", function()
  it("is the entropy of the token frequencies", function()
    local b = data.IndexedDatasetBuilder(P("u"), { dtype = "u8" })
    b:add_document({ 1, 1, 2, 3 })
    b:add_document({ 1, 2 })
    local ds = data.IndexedDataset(b:finalize())
    local h = -(3 / 6 * math.log(3 / 6) + 2 / 6 * math.log(2 / 6) + 1 / 6 * math.log(1 / 6))
    assert.is_true(math.abs(data.unigram_entropy(ds) - h) < 1e-12)
    local gd = data.GPTDataset(ds, { seq_len = 2, valid_fraction = 0.5 })
    local h1 = -(2 / 4 * math.log(2 / 4) + 2 * (1 / 4 * math.log(1 / 4)))
    assert.is_true(math.abs(data.unigram_entropy(gd) - h1) < 1e-12)
  end)
end)

describe("bible_corpus", function()
  local have_bible = os.execute("command -v bible >/dev/null 2>&1")
  if have_bible then
    it("preprocesses the King James Bible once, one document per chapter", function()
      local prefix = data.bible_corpus { dir = P("bible") }
      local ds = data.IndexedDataset(prefix)
      assert.are.equal(1189, ds:num_documents())
      assert.is_true(ds:num_tokens() > 4000000)
      local tok = data.ByteTokenizer()
      assert.matches("^In the beginning God created the heaven and the earth%.\n", tok:decode(ds:get(0)))
      assert.are.equal(prefix, data.bible_corpus { dir = P("bible") }) -- reused
    end)
  else
    pending("bible_corpus (the `bible` command of Debian's bible-kjv is not installed)")
  end
  it("rejects unknown options", function()
    assert.has_error(function() data.bible_corpus { path = "x" } end,
      "data.bible_corpus: unknown option 'path' (valid: dir)")
  end)
end)

-- ------------------------------------------------------------ numpy client

local function find_python()
  local home = os.getenv("XDG_CACHE_HOME") or ((os.getenv("HOME") or "/root") .. "/.cache")
  local tried = {}
  for _, py in ipairs({ os.getenv("MOE_PYTHON") or false, home .. "/moe-lua/pyvenv/bin/python3", "python3" }) do
    if py then
      if os.execute(sh_quote(py) .. ' -c "import numpy" >/dev/null 2>&1') then return py end
      tried[#tried + 1] = py
    end
  end
  return nil, "no 'import numpy' in " .. table.concat(tried, ", ")
end

local python, no_python = find_python()

describe("numpy client (tests/python/check_indexed.py)", function()
  local name = "reads our files and writes Megatron's layout that we read"
  if not python then
    if os.getenv("CI") then
      it(name, function() error("numpy is required in CI: " .. no_python) end)
    else
      print("\nSKIPPED (no numpy): tests/lua/data_spec.lua client test, " .. no_python)
      pending(name .. " (no numpy)")
    end
    return
  end
  it(name, function()
    -- RECIPE of check_indexed.py: document i = (i * 37 + j * 11) % 60000, j < (i * 7) % 13
    local b = data.IndexedDatasetBuilder(P("moe"), { dtype = "u16" })
    for i = 0, 49 do
      local t = {}
      for j = 0, (i * 7) % 13 - 1 do t[#t + 1] = (i * 37 + j * 11) % 60000 end
      b:add_document(t)
    end
    b:finalize()
    local p = io.popen(sh_quote(python) .. " " .. sh_quote(checker) .. " " .. sh_quote(dir) .. " 2>&1")
    local out = p:read("a")
    local ok = p:close()
    io.write("\n-- " .. checker .. " (" .. python .. ")\n" .. out)
    assert(ok and out:find("\nOK\n$"), "check_indexed.py failed:\n" .. out)
    -- py.*: 20 documents of two sequences: d * 1000 + j (j < 3), d * 1000 + 100 + j (j < d % 4)
    local ds = data.IndexedDataset(P("py"))
    assert.are.equal("i32", ds:dtype())
    assert.are.equal(40, #ds)
    assert.are.equal(20, ds:num_documents())
    for d = 0, 19 do
      assert.are.equal(2 * d, ds:document_start(d))
      assert.are.same({ d * 1000, d * 1000 + 1, d * 1000 + 2 }, ds:get(2 * d):totable())
      local second = {}
      for j = 0, d % 4 - 1 do second[#second + 1] = d * 1000 + 100 + j end
      assert.are.same(second, ds:get(2 * d + 1):totable())
    end
  end)
end)
