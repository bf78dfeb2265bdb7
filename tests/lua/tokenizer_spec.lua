--[[
tests/lua/tokenizer_spec.lua - GPT-2 / Hugging Face byte-level BPE tokenizers
(lua/moe/data/gpt2.lua, lua/moe/data/tokenizer.lua, core/bpe.c,
core/unicode.c) and their use end to end:

  - the GPT-2 pre-tokenizer's pieces and the Unicode classes on spot checks;
  - agreement with the `tokenizers` package, id for id, on the committed
    corpus (tests/data/tokenizer/corpus.txt: English, punctuation, digits,
    whitespace runs, contractions, accents, CJK, emoji, combining marks,
    <|endoftext|>): against the committed fixture (vocab.json, merges.txt,
    tokenizer.json and expected.json, written once by
    tests/python/check_tokenizers.py --fixture), and, where Python's tokenizers
    is installed, against a tokenizer it trains now (both file forms, and
    add_prefix_space);
  - unsupported tokenizer.json parts and broken files are errors naming the file;
  - any bytes round-trip; a megabyte of one piece does not hang;
  - preprocess records the tokenizer beside the dataset; train checks
    model.vocab_size against it, saves it in checkpoints, and `moe-lua sample`
    decodes with it; data without a record stays byte data;
  - `moe-lua preprocess` through moe.config: --help, unknown keys, bad values.

Without Python's tokenizers the live agreement test is marked pending with a
line "SKIPPED (no python tokenizers): ..."; with the environment variable CI
set (.ci/deps installs it) it fails instead. The Python used is $MOE_PYTHON,
else the venv .ci/deps makes (~/.cache/moe-lua/pyvenv), else python3.
]]
local moe = require "moe"
local data = require "moe.data"
local json = require("moe.metrics").json

local function sh_quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

local dir = os.tmpname()
os.remove(dir)
assert(os.execute("mkdir -p " .. sh_quote(dir)))
local function P(name) return dir .. "/" .. name end
lazy_teardown(function() os.execute("rm -rf " .. sh_quote(dir)) end)

local spec_dir = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests/lua"
local fixture = spec_dir .. "/../data/tokenizer"
local checker = spec_dir .. "/../python/check_tokenizers.py"
local host = arg and arg[-1] or ((os.getenv("MOE_BUILD_DIR") or "build") .. "/moe-lua")

local read_all = dofile(spec_dir .. "/read_file.lua")

local function write_file(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end

local corpus = read_all(fixture .. "/corpus.txt")

-- The first index where two id arrays differ, or nil.
local function first_difference(a, b)
  for i = 1, math.max(#a, #b) do
    if a[i] ~= b[i] then return i end
  end
  return nil
end

local function assert_ids(want, got, what)
  local i = first_difference(want, got)
  if i then
    error(("%s: ids differ at %d of %d/%d: want %s, got %s"):format(what, i, #want, #got,
      tostring(want[i]), tostring(got[i])), 2)
  end
end

-- Runs a shell command; returns its output and whether it exited 0.
local function run(cmd)
  local p = io.popen(cmd .. " 2>&1")
  local out = p:read("a")
  local ok = p:close()
  return out, ok == true
end

describe("the GPT-2 pre-tokenizer", function()
  it("cuts text as the GPT-2 regex does", function()
    local text = "Hello, world! I'm   here...  it's 2024\t\n\n naïve café 日本語 😀👍 e\xcc\x81 'S ' s\xc2\xa0x  \n"
    -- what tokenizers' ByteLevel pre-tokenizer gives for this text
    assert.are.same({ "Hello", ",", " world", "!", " I", "'m", "  ", " here", "...", " ", " it", "'s",
      " 2024", "\t\n\n", " naïve", " café", " 日本語", " 😀👍", " e", "\xcc\x81", " '", "S", " '", " s",
      "\xc2\xa0", "x", "  \n" }, moe.ops.gpt2_pieces(text))
    assert.are.same({ "'re", "'ve", "'ll", "'d", "'t", "'", "x" }, moe.ops.gpt2_pieces("'re've'll'd't'x"))
    assert.are.same({ "a", "   ", " b", "  " }, moe.ops.gpt2_pieces("a    b  "))
    assert.are.same({}, moe.ops.gpt2_pieces(""))
    -- invalid UTF-8: each bad byte is a code point of the "other" class
    assert.are.same({ "a", "\xff\xfe", " \x80!", "b" }, moe.ops.gpt2_pieces("a\xff\xfe \x80!b"))
    assert.are.same({ "x", " \xe6\x97" }, moe.ops.gpt2_pieces("x \xe6\x97")) -- truncated at the end
  end)

  it("classifies code points", function()
    local cls = moe.ops.unicode_class
    assert.are.same({ "letter", "letter", "letter", "letter", "letter" },
      { cls(0x41), cls(0xE9), cls(0x65E5), cls(0x3B1), cls(0x1D400) })
    assert.are.same({ "number", "number", "number", "number" }, { cls(0x37), cls(0xB2), cls(0x2167), cls(0x661) })
    assert.are.same({ "space", "space", "space", "space", "space" },
      { cls(0x20), cls(0x0A), cls(0xA0), cls(0x3000), cls(0x2028) })
    assert.are.same({ "other", "other", "other", "other" }, { cls(0x21), cls(0x301), cls(0x1F600), cls(0x10FFFF) })
    assert.error_matches(function() cls(0x110000) end, "code point 1114112 out of range")
  end)
end)

describe("GPT-2 / Hugging Face BPE files", function()
  local expected = json.decode(read_all(fixture .. "/expected.json"))

  it("encode the corpus as tokenizers does (the committed fixture, three ways to load it)", function()
    for _, spec in ipairs({ fixture, fixture .. "/tokenizer.json", fixture .. "/vocab.json" }) do
      local tok = data.load_tokenizer(spec)
      assert.are.equal("gpt2", tok.name)
      assert.are.equal(expected.vocab_size, tok.vocab_size)
      assert.are.equal(expected.eod, tok.eod)
      assert_ids(expected.ids, tok:encode(corpus), spec)
      assert.are.equal(corpus, tok:decode(tok:encode(corpus)))
      tok:free()
    end
    local tok = data.GPT2Tokenizer.from_files(fixture .. "/vocab.json", fixture .. "/merges.txt")
    assert_ids(expected.ids, tok:encode(corpus), "from_files")
    assert.are.same({ 0 }, tok:encode("<|endoftext|>"))
    assert.are.same({}, tok:encode(""))
    assert.are.equal("<|endoftext|>ab", tok:decode(moe.tensor({ 0, tok:encode("a")[1], tok:encode("b")[1] },
      { dtype = "i64" })))
    assert.error_matches(function() tok:decode({ 99999 }) end, "id 99999 at 1 is outside the vocabulary")
    assert.error_matches(function() tok:encode(5) end, "string expected, got number")
  end)

  it("round-trip any bytes and do not hang on a megabyte of one piece", function()
    local tok = data.load_tokenizer(fixture)
    local rng = 12345
    local function byte()
      rng = (rng * 1103515245 + 12345) % 2147483648
      return rng % 256
    end
    for _ = 1, 20 do
      local t = {}
      for i = 1, 300 do t[i] = string.char(byte()) end
      local s = table.concat(t)
      assert.are.equal(s, tok:decode(tok:encode(s)))
    end
    for _, s in ipairs({ (" "):rep(1 << 20), ("!"):rep(1 << 20), ("ab"):rep(1 << 19) }) do
      local t0 = os.clock()
      local ids = tok:encode(s)
      assert.are.equal(s, tok:decode(ids))
      assert.is_true(os.clock() - t0 < 10, "encoding 1 MB of one piece took too long")
    end
  end)

  it("read both merge forms, reject unsupported parts and broken files naming the file", function()
    local base = json.decode(read_all(fixture .. "/tokenizer.json"))
    local function variant(name, edit)
      local t = json.decode(read_all(fixture .. "/tokenizer.json"))
      edit(t)
      write_file(P(name), json.encode(t))
      return function() data.load_tokenizer(P(name)) end
    end
    assert.is_table(base.model)
    -- merges written as "a b" strings (tokenizers before 0.20) read the same
    variant("strings.json", function(t)
      for i, m in ipairs(t.model.merges) do t.model.merges[i] = m[1] .. " " .. m[2] end
    end)
    assert_ids(expected.ids, data.load_tokenizer(P("strings.json")):encode(corpus), "string merges")
    assert.error_matches(variant("wp.json", function(t) t.model.type = "WordPiece" end),
      "GPT2Tokenizer: .*wp%.json: unsupported model type WordPiece")
    assert.error_matches(variant("seq.json", function(t) t.pre_tokenizer = { type = "Sequence" } end),
      "seq%.json: unsupported pre_tokenizer type Sequence")
    assert.error_matches(variant("nfc.json", function(t) t.normalizer = { type = "NFC" } end),
      "nfc%.json: unsupported normalizer type NFC")
    assert.error_matches(variant("dec.json", function(t) t.decoder = { type = "Metaspace" } end),
      "dec%.json: unsupported decoder type Metaspace")
    assert.error_matches(variant("tpl.json", function(t) t.post_processor = { type = "TemplateProcessing" } end),
      "tpl%.json: unsupported post_processor type TemplateProcessing")
    assert.error_matches(variant("drop.json", function(t) t.model.dropout = 0.1 end),
      "drop%.json: unsupported BPE dropout 0.1")
    assert.error_matches(variant("lstrip.json", function(t) t.added_tokens[1].lstrip = true end),
      "lstrip%.json: unsupported lstrip on the added token \"<|endoftext|>\"")
    assert.error_matches(variant("badmerge.json", function(t) t.model.merges[1] = { "zz", "q" } end),
      "badmerge%.json: merge 1 'zz q' uses a token that is not in the vocabulary")
    write_file(P("notjson.json"), "{\"model\": ")
    assert.error_matches(function() data.load_tokenizer(P("notjson.json")) end, "notjson%.json is not valid JSON")
    write_file(P("x-vocab.json"), read_all(fixture .. "/vocab.json"))
    assert.error_matches(function() data.load_tokenizer(P("x-vocab.json")) end,
      "x%-vocab%.json needs its merges file .*x%-merges%.txt, which does not exist")
    write_file(P("x-merges.txt"), "#version: 0.2\nĠ t h\n")
    assert.error_matches(function() data.load_tokenizer(P("x-vocab.json")) end,
      "x%-merges%.txt line 2: expected two tokens separated by one space")
    assert.error_matches(function() data.load_tokenizer(P("nothing-here")) end,
      "data.load_tokenizer: unknown tokenizer '.*nothing%-here' %(byte, bpe:FILE")
    assert.error_matches(function() data.load_tokenizer(dir) end,
      "has no tokenizer.json and no vocab.json %+ merges.txt")
    write_file(P("plain.txt"), "hello")
    assert.error_matches(function() data.load_tokenizer(P("plain.txt")) end, "is not a tokenizer file")
  end)

  it("load byte and moe-bpe tokenizers through the same entry", function()
    assert.are.equal("byte", data.load_tokenizer("byte").name)
    assert.are.equal("byte", data.load_tokenizer().name)
    local bpe = data.train_bpe("the cat sat on the mat, the cat sat", { vocab_size = 270 })
    bpe:save(P("small.bpe"))
    for _, spec in ipairs({ P("small.bpe"), "bpe:" .. P("small.bpe") }) do
      local tok = data.load_tokenizer(spec)
      assert.are.equal("bpe", tok.name)
      assert.are.same(bpe:encode("the mat"), tok:encode("the mat"))
    end
  end)
end)

-- Python's tokenizers, or nil and why not.
local function find_python()
  local home = os.getenv("XDG_CACHE_HOME") or ((os.getenv("HOME") or "/root") .. "/.cache")
  local tried = {}
  for _, py in ipairs({ os.getenv("MOE_PYTHON") or false, home .. "/moe-lua/pyvenv/bin/python3", "python3" }) do
    if py then
      if os.execute(sh_quote(py) .. ' -c "import tokenizers" >/dev/null 2>&1') then return py end
      tried[#tried + 1] = py
    end
  end
  return nil, "no 'import tokenizers' in " .. table.concat(tried, ", ")
end

local python, no_python = find_python()

describe("the real tokenizers (Python)", function()
  local name = "trains a byte-level BPE whose ids moe-lua matches, from tokenizer.json and vocab.json + merges.txt"
  if python then
    it(name, function()
      local out, ok = run(("%s %s %s %s"):format(sh_quote(python), sh_quote(checker), sh_quote(P("py")),
        sh_quote(fixture .. "/corpus.txt")))
      io.write("\n-- " .. checker .. " (" .. python .. ")\n" .. out)
      assert(ok and out:find("\nOK\n$"), "check_tokenizers.py failed:\n" .. out)
      local want = json.decode(read_all(P("py/expected.json")))
      for _, spec in ipairs({ P("py"), P("py/vocab.json"), P("py/tokenizer.json") }) do
        local tok = data.load_tokenizer(spec)
        assert.are.equal(want.vocab_size, tok.vocab_size)
        assert_ids(want.ids, tok:encode(corpus), spec)
      end
      -- add_prefix_space lives in tokenizer.json only
      local pwant = json.decode(read_all(P("py/prefix/expected.json")))
      assert_ids(pwant.ids, data.load_tokenizer(P("py/prefix/tokenizer.json")):encode(corpus), "add_prefix_space")
    end)
  elseif os.getenv("CI") then
    it(name, function() error("python tokenizers is required in CI (.ci/deps installs it): " .. no_python) end)
  else
    print("\nSKIPPED (no python tokenizers): tests/lua/tokenizer_spec.lua agreement test, " .. no_python)
    pending(name .. " (no python tokenizers)")
  end
end)

describe("a tokenizer end to end", function()
  local train = require "moe.train"
  local checkpoint = require "moe.checkpoint"
  local sample = require "moe.sample"

  it("preprocess records it, train checks and saves it, sample decodes with it", function()
    write_file(P("doc.txt"), corpus)
    local prefix, stats = data.preprocess { inputs = { P("doc.txt") }, output_prefix = P("ds"),
      tokenizer = fixture }
    assert.are.equal("gpt2", stats.tokenizer)
    local tok, meta = data.dataset_tokenizer(prefix)
    assert.are.equal(320, tok.vocab_size)
    assert.are.same({ "tokenizer.json" }, meta.tokenizer.files)
    assert.are.equal(read_all(fixture .. "/tokenizer.json"), read_all(P("ds.tokenizer.json")))
    -- the dataset holds the ids of each line and EOD
    local ds = data.IndexedDataset(prefix)
    local first = corpus:match("^[^\n]+")
    local want = tok:encode(first)
    want[#want + 1] = 0
    assert.are.same(want, ds:get(0):totable())
    assert.are.equal(stats.documents, #ds)

    local function cfg(over)
      local c = { data = prefix, seq_len = 8, batch_size = 2, steps = 2, warmup = 0, log_every = 1,
        eval_every = 0, quiet = true, device = "cpu", deterministic = true, sample_tokens = 6,
        sample_prompt = "In the", out_dir = P("run"), overwrite = true,
        model = { vocab_size = 320, d_model = 16, n_layers = 1, n_heads = 2,
          moe = { num_experts = 2, top_k = 1, ffn_hidden_size = 16, mlp_impl = "grouped" } } }
      for k, v in pairs(over or {}) do c[k] = v end
      return c
    end
    local ok, err = pcall(train.run, cfg { model = { vocab_size = 257 } })
    assert.is_false(ok)
    assert.matches("train: model.vocab_size=257 is smaller than the vocabulary of data='" .. prefix ..
      "' (320 tokens, gpt2 tokenizer recorded in " .. prefix .. ".meta.json): pass model.vocab_size=320", err, 1, true)

    local result = train.run(cfg())
    assert.are.equal("In the", result.sample:sub(1, 6))
    local ckpt = result.checkpoint
    local c = checkpoint.load(ckpt)
    assert.are.equal("gpt2", c.state.tokenizer.kind)
    assert.are.equal(read_all(fixture .. "/tokenizer.json"), read_all(ckpt .. "/tokenizer.json"))
    -- moe-lua sample decodes with the checkpoint's tokenizer: the same text as in-process
    local model, tcfg, state = train.load_model(ckpt, "cpu")
    local ctok = require("moe.data.tokenizer").from_record(state.tokenizer, ckpt, "")
    moe.manual_seed(5)
    local want_text = sample.text(model, ctok, "In the", { max_new_tokens = 12, temperature = 0, top_k = 0,
      seq_len = tcfg.seq_len, device = "cpu" })
    local out, cli_ok = run(("%s sample ckpt=%s prompt='In the' tokens=12 temperature=0 top_k=0 seed=5 " ..
      "device=cpu"):format(sh_quote(host), sh_quote(ckpt)))
    assert.is_true(cli_ok, out)
    assert.are.equal(want_text .. "\n", out)
    -- resuming on data with another tokenizer is refused
    local bprefix = data.preprocess { inputs = { P("doc.txt") }, output_prefix = P("bds") }
    ok, err = pcall(train.run, cfg { data = bprefix, resume = ckpt, steps = 3, out_dir = P("run2"), overwrite = false })
    assert.is_false(ok)
    assert.matches("was trained with a gpt2 tokenizer (vocab_size 320), the data now has a byte tokenizer " ..
      "(vocab_size 257)", err, 1, true)
    -- a record whose files are gone is a clear error (the checkpoint's digests list them)
    os.remove(ckpt .. "/tokenizer.json")
    out, cli_ok = run(("%s sample ckpt=%s tokens=2 device=cpu"):format(sh_quote(host), sh_quote(ckpt)))
    assert.is_false(cli_ok)
    assert.matches("cannot open '.*/tokenizer%.json': No such file", out)
  end)

  it("data without a record stays byte data; moe-bpe data is recorded too", function()
    write_file(P("bytes.txt"), "one line\nanother line\n")
    local prefix = data.preprocess { inputs = { P("bytes.txt") }, output_prefix = P("bytes") }
    assert.are.equal("byte", data.dataset_tokenizer(prefix).name)
    os.remove(prefix .. ".meta.json")
    assert.is_nil(data.dataset_tokenizer(prefix))
    local _, _, tok = train.build_data { data = prefix, seq_len = 4, data_seed = 1, valid_fraction = 0.5,
      model = { vocab_size = 257 } }
    assert.are.equal("byte", tok.name)
    local bpe = data.train_bpe("one line another line", { vocab_size = 260 })
    bpe:save(P("t.bpe"))
    local bprefix = data.preprocess { inputs = { P("bytes.txt") }, output_prefix = P("bpeds"),
      tokenizer = "bpe:" .. P("t.bpe") }
    local btok, meta = data.dataset_tokenizer(bprefix)
    assert.are.equal("bpe", btok.name)
    assert.are.same({ "tokenizer.bpe" }, meta.tokenizer.files)
    assert.are.same(bpe:encode("one line"), btok:encode("one line"))
    write_file(bprefix .. ".meta.json", "{\"format\": \"other\"}")
    assert.error_matches(function() data.dataset_tokenizer(bprefix) end,
      "bpeds%.meta%.json is corrupt or not a moe%-lua dataset meta file")
  end)

  it("checkpoint extra files must have plain names", function()
    assert.error_matches(function()
      checkpoint.save(P("ck"), 1, { model = {}, files = { ["../x"] = "y" } })
    end, "bad extra file name '%.%./x'")
    assert.error_matches(function()
      checkpoint.save(P("ck"), 1, { model = {}, files = { ["state.json"] = "y" } })
    end, "bad extra file name 'state.json'")
    local path = checkpoint.save(P("ck"), 2, { model = {}, files = { ["extra.txt"] = "hi" } })
    assert.are.equal("hi", read_all(path .. "/extra.txt"))
  end)
end)

describe("moe-lua preprocess", function()
  it("lists every key with its meaning on --help", function()
    local out, ok = run(sh_quote(host) .. " preprocess --help")
    assert.is_true(ok, out)
    for _, key in ipairs({ "input", "output", "split", "tokenizer", "dtype", "corpus", "dir" }) do
      assert.matches("\n  " .. key .. "=[^\n]*  %a", out)
    end
  end)

  it("validates keys and values through moe.config", function()
    local out, ok = run(sh_quote(host) .. " preprocess outptu=x input=y")
    assert.is_false(ok)
    assert.matches("moe%-lua preprocess: unknown key 'outptu' %(did you mean 'output'%?", out)
    out, ok = run(sh_quote(host) .. " preprocess input=y output=z split=lines")
    assert.is_false(ok)
    assert.matches("split must be line, blank_line or file, got 'lines'", out)
    out, ok = run(sh_quote(host) .. " preprocess output=z")
    assert.is_false(ok)
    assert.matches("input= and output= are required", out)
    out, ok = run(sh_quote(host) .. " preprocess --output=z")
    assert.is_false(ok)
    assert.matches("write output=z", out)
    out, ok = run(("%s preprocess input=%s output=%s tokenizer=%s"):format(sh_quote(host),
      sh_quote(fixture .. "/corpus.txt"), sh_quote(P("cli")), sh_quote(P("nope"))))
    assert.is_false(ok)
    assert.matches("moe%-lua preprocess: data.load_tokenizer: unknown tokenizer", out)
    assert.is_nil(out:find("traceback", 1, true))
    out, ok = run(("%s preprocess input=%s output=%s tokenizer=%s"):format(sh_quote(host),
      sh_quote(fixture .. "/corpus.txt"), sh_quote(P("cli")), sh_quote(fixture)))
    assert.is_true(ok, out)
    assert.matches("documents, %d+ tokens, gpt2 tokenizer %(vocab_size 320%)", out)
  end)
end)
