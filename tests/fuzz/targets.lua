--[[
tests/fuzz/targets.lua - the parsers tests/fuzz/fuzz.lua fuzzes: one entry
each, in the table this file returns (a function of the fuzzer's kit).

An entry:
  name      the target's name (target=NAME on the command line, fuzz/NAME in ctest)
  files     the file names of one input, e.g. {"data.idx", "data.bin"}; an
            input is a table file name -> bytes
  weights   optional: how often each file is the one mutated ({["data.idx"] = 3})
  max_size  optional: bytes per file after mutation (default kit.MAX_SIZE)
  seeds     function(dir) -> array of valid inputs, made by moe-lua's own
            writers in the scratch folder dir (the same bytes on every run)
  exec      for a C parser: its name in tests/fuzz/fuzz_core.c, which runs it
            in a forked child (crashes and sanitizer reports cost one input)
  load      for a Lua parser, instead of exec: function(input, dir) called in
            this process under pcall, a time limit and a memory limit; dir
            holds the input's files when the entry sets write_files = true.
            Returning is a load, raising an error a clean error when the
            message matches one of `clean`, a crash otherwise (a Lua error
            of the interpreter such as "attempt to index a nil value", a
            stack overflow, a message without the parser's prefix). A load
            function may also check the result and raise kit.bug(msg) (a
            crash) when it is wrong.
  clean     Lua patterns of the parser's own error messages
  seeds_may_fail  optional: a seed may be a clean error (by default every
            seed must load)
  regressions  optional: inputs that once crashed or hung, run unmutated
            after the seeds
  mutators  optional: structure-aware mutations, functions(r, input) that
            change input in place (r is the input's generator: r:below(n),
            r:pick(list), r:chance(k))

Adding a parser: write its seeds with the writer that makes such files (or
literal samples), its load function, and its clean patterns, e.g.

  { name = "gpt2_bpe", files = { "vocab.json", "merges.txt" },
    seeds = function(dir) ... return { { ["vocab.json"] = v, ["merges.txt"] = m } } end,
    write_files = true,
    load = function(_, dir) return data.GPT2Tokenizer.load(dir .. "/vocab.json", dir .. "/merges.txt") end,
    clean = { "^GPT2Tokenizer%.load: " } },

then add its name to the foreach of tests/CMakeLists.txt (fuzz/<name>).
]]
return function(kit)
  local moe = require "moe"
  local data = require "moe.data"
  local metrics = require "moe.metrics"
  local tconfig = require "moe.train.config"
  local read, write, u64, i32, i64 = kit.read, kit.write, kit.u64, kit.i32, kit.i64

  ------------------------------------------------------------ safetensors

  local function st_seeds(dir)
    local files = {
      { w = moe.tensor({ { -1.25, 0.5, 2 }, { 3, 4, 5 } }, { dtype = "f32" }),
        b = moe.tensor({ 1, 2, 3, 4 }, { dtype = "bf16" }),
        ids = moe.tensor({ 7, -8, 9 }, { dtype = "i64" }),
        mask = moe.tensor({ true, false }, { dtype = "bool" }),
        empty = moe.zeros({ 0, 4 }),
        scalar = moe.full({}, 3.25, { dtype = "f64" }) },
      { ["layer.0.w"] = moe.arange(8, { dtype = "f32" }):view(2, 4) },
      {},
      { h = moe.tensor({ 1, 2 }, { dtype = "f16" }), c = moe.tensor({ -1, 1 }, { dtype = "i8" }),
        u = moe.tensor({ 0, 255 }, { dtype = "u8" }), n = moe.tensor({ { 1 }, { 2 } }, { dtype = "i32" }) },
    }
    local metas = { { step = "3", format = "pt" }, nil, { note = 'ünï "q"\n' }, { a = "" } }
    local out = {}
    for i, t in ipairs(files) do
      local p = ("%s/st%d.safetensors"):format(dir, i)
      moe.save(p, t, metas[i])
      out[i] = { ["model.safetensors"] = read(p) }
    end
    return out
  end

  local ST_DTYPES = { "F32", "F64", "BF16", "F16", "I8", "U8", "I32", "I64", "BOOL", "U16", "F8_E4M3",
                      "I16", "C64", "f32", "", "F32 " }

  -- The header text and data of a safetensors file, and the file back.
  local function st_split(s)
    if #s < 8 then return nil end
    local n = string.unpack("<I8", s)
    if n < 0 or n > #s - 8 then return nil end
    return s:sub(9, 8 + n), s:sub(9 + n)
  end
  local function st_join(h, d) return string.pack("<I8", #h) .. h .. d end

  local st_mutators = {
    -- the header length field: off by a little, the file size, huge
    function(r, input)
      local s = input["model.safetensors"]
      if #s < 8 then return end
      local n = string.unpack("<I8", s)
      local v = r:pick({ 0, 1, 2, n - 1, n + 1, n + 8, n - 8, #s - 8, #s - 7, #s, 100000000, 100000001,
                         1 << 32, math.maxinteger, math.mininteger, -1 })
      input["model.safetensors"] = string.pack("<i8", v) .. s:sub(9)
    end,
    -- a text mutation of the header with the length field kept right, so
    -- the JSON and the entry checks are reached
    function(r, input)
      local h, d = st_split(input["model.safetensors"])
      if not h then return end
      h = kit.mutate_text(r, h)
      input["model.safetensors"] = st_join(h, d)
    end,
    -- data_offsets and shapes: numbers replaced by neighbours and extremes
    function(r, input)
      local h, d = st_split(input["model.safetensors"])
      if not h then return end
      local nums = {}
      for a, b in h:gmatch("()%-?%d+()") do nums[#nums + 1] = { a, b } end
      if #nums == 0 then return end
      local at = r:pick(nums)
      local old = math.tointeger(tonumber(h:sub(at[1], at[2] - 1))) or 0
      local new = r:pick({ old + 1, old - 1, old * 2, 0, #d, #d + 1, #d - 1, old + 8, old - 8, 1 << 31,
                           1 << 32, 1 << 62, math.maxinteger, "9223372036854775808", "18446744073709551615" })
      h = h:sub(1, at[1] - 1) .. tostring(new) .. h:sub(at[2])
      input["model.safetensors"] = st_join(h, d)
    end,
    -- a dtype swapped for another (same width or not, foreign, unknown)
    function(r, input)
      local h, d = st_split(input["model.safetensors"])
      if not h then return end
      local spots = {}
      for a, b in h:gmatch('"dtype":"()[^"]*()"') do spots[#spots + 1] = { a, b } end
      if #spots == 0 then return end
      local at = r:pick(spots)
      h = h:sub(1, at[1] - 1) .. r:pick(ST_DTYPES) .. h:sub(at[2])
      input["model.safetensors"] = st_join(h, d)
    end,
    -- the data buffer cut or grown
    function(r, input)
      local h, d = st_split(input["model.safetensors"])
      if not h then return end
      if r:chance(2) then d = d:sub(1, r:below(#d + 1)) else d = d .. string.rep("\0", 1 + r:below(16)) end
      input["model.safetensors"] = st_join(h, d)
    end,
  }

  -- Empty tensors whose other sizes multiply past 2^63 (their strides
  -- overflowed in moe_tensor_empty: a UBSan report).
  local st_regressions = {}
  for _, shape in ipairs({ "[0,9223372036854775808]", "[0,4611686018427387904,4]",
                           "[3,0,9223372036854775807,9223372036854775807]" }) do
    local h = ('{"t":{"dtype":"F32","shape":%s,"data_offsets":[0,0]}}'):format(shape)
    st_regressions[#st_regressions + 1] = { ["model.safetensors"] = st_join(h, "") }
  end

  ------------------------------------------------------------ Megatron .idx/.bin

  local TEXT = "In the beginning was the word.\nAnd the word was with moe.\n\nA second paragraph, " ..
               "with digits 12345 and punctuation!?\nünïcødé bytes \0\1\2 too\n"

  local function ds_seeds(dir)
    local out = {}
    local function take(prefix)
      out[#out + 1] = { ["data.idx"] = read(prefix .. ".idx"), ["data.bin"] = read(prefix .. ".bin") }
    end
    write(dir .. "/text.txt", TEXT)
    -- the preprocess writer, as `moe-lua preprocess` runs it
    for i, o in ipairs({ { split_documents = "line", dtype = "u16" }, { split_documents = "blank_line", dtype = "i32" },
                         { split_documents = "file", dtype = "i64" } }) do
      local prefix = ("%s/pre%d"):format(dir, i)
      data.preprocess { inputs = { dir .. "/text.txt" }, output_prefix = prefix,
                        split_documents = o.split_documents, dtype = o.dtype }
      take(prefix)
    end
    -- documents of several sequences, empty sequences, small dtypes
    for i, dt in ipairs({ "u8", "i16", "i8" }) do
      local prefix = ("%s/seq%d"):format(dir, i)
      local b = data.IndexedDatasetBuilder(prefix, { dtype = dt })
      b:add_sequence({ 1, 2, 3 }); b:add_sequence({}); b:add_sequence({ 4, 5 }); b:end_document()
      b:add_document({ 6 })
      b:add_sequence({ 7, 8, 9, 10 }); b:end_document()
      b:finalize()
      take(prefix)
    end
    -- a .bin of exactly one page: a read past its end faults
    local padded = out[1]
    padded = { ["data.idx"] = padded["data.idx"], ["data.bin"] = padded["data.bin"] ..
               string.rep("\0", 4096 - #padded["data.bin"]) }
    out[#out + 1] = padded
    -- no sequences at all
    local b = data.IndexedDatasetBuilder(dir .. "/none", { dtype = "u16" })
    b:finalize()
    take(dir .. "/none")
    return out
  end

  -- Offsets of the .idx fields: version 9, dtype 17, n 18, c 26, then
  -- sizes i32[n], pointers i64[n], document indices i64[c].
  local function idx_fields(s)
    if #s < 34 then return nil end
    local n, c = string.unpack("<i8", s, 19), string.unpack("<i8", s, 27)
    if n < 0 or c < 0 or n > #s or c > #s or 34 + 12 * n + 8 * c > #s then return nil end
    return n, c
  end

  local ds_mutators = {
    -- a header field: version, dtype code, sequence or document count
    function(r, input)
      local s = input["data.idx"]
      if #s < 34 then return end
      local which = r:below(4)
      if which == 1 then
        input["data.idx"] = kit.put(s, 18, string.char(r:pick({ 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 255 })))
      else
        local at = ({ 10, nil, 19, 27 })[which + 1]
        local old = string.unpack("<i8", s, at)
        input["data.idx"] = kit.put(s, at, u64(r:pick({ 0, 1, 2, old - 1, old + 1, old * 2, -1, math.maxinteger,
                                                        math.mininteger, 1 << 32, (1 << 62) // 3, #s, #s // 12 })))
      end
    end,
    -- one size, pointer or document index
    function(r, input)
      local s = input["data.idx"]
      local n, c = idx_fields(s)
      if not n or n + c == 0 then return end
      local bin = #input["data.bin"]
      local k = r:below(3)
      if k == 0 and n > 0 then
        local at = 35 + 4 * r:below(n)
        local old = string.unpack("<i4", s, at)
        input["data.idx"] = kit.put(s, at, i32(r:pick({ 0, 1, -1, old + 1, old - 1, old * 2, bin, bin + 1,
                                                        bin // 2, 0x7fffffff, -0x80000000 })))
      elseif k == 1 and n > 0 then
        local at = 35 + 4 * n + 8 * r:below(n)
        local old = string.unpack("<i8", s, at)
        input["data.idx"] = kit.put(s, at, i64(r:pick({ 0, 1, -1, -2, old + 1, old - 1, old + 2, bin, bin - 1,
                                                        bin + 1, math.maxinteger, math.mininteger, 1 << 32 })))
      elseif c > 0 then
        local at = 35 + 12 * n + 8 * r:below(c)
        local old = string.unpack("<i8", s, at)
        input["data.idx"] = kit.put(s, at, i64(r:pick({ 0, 1, -1, old + 1, old - 1, n, n + 1, math.maxinteger,
                                                        math.mininteger })))
      end
    end,
    -- the optional modes array, or a count changed with the arrays to match
    function(r, input)
      local s = input["data.idx"]
      local n, c = idx_fields(s)
      if not n then return end
      if r:chance(2) then
        input["data.idx"] = s .. string.rep("\1", n)
      else -- one sequence more: size, pointer and the last document index moved
        local sizes, ptrs, docs = s:sub(35, 34 + 4 * n), s:sub(35 + 4 * n, 34 + 12 * n), s:sub(35 + 12 * n, 34 + 12 * n + 8 * c)
        sizes = sizes .. i32(r:pick({ 0, 1, 3, 1000 }))
        ptrs = ptrs .. i64(r:pick({ 0, #input["data.bin"], #input["data.bin"] - 2 }))
        if c > 0 then docs = docs:sub(1, -9) .. i64(n + 1) end
        input["data.idx"] = s:sub(1, 18) .. u64(n + 1) .. u64(c) .. sizes .. ptrs .. docs
      end
    end,
    -- the .bin cut, emptied or grown
    function(r, input)
      local b = input["data.bin"]
      local k = r:below(3)
      if k == 0 then b = b:sub(1, r:below(#b + 1)) elseif k == 1 then b = "" else b = b .. string.rep("\255", 1 + r:below(9)) end
      input["data.bin"] = b
    end,
  }

  ------------------------------------------------------------ JSON

  local function json_seeds(dir)
    local out = {}
    local function add(s) out[#out + 1] = { ["input.json"] = s } end
    for _, st in ipairs(st_seeds(dir)) do -- the headers moe.save writes
      local h = st_split(st["model.safetensors"])
      add(h)
    end
    -- state.json and config.json as training writes them
    local cfg = tconfig.config {}
    add(metrics.json.encode { step = 10, config = cfg, rng = { 1, 2, 3 }, loss = 2.5, lr = 3e-4,
                              tokens = 81920, note = "ünï\n\"q\"", skipped = setmetatable({}, metrics.json.array_mt) })
    add(metrics.json.encode(cfg))
    add(metrics.json.encode { step = 3, loss = 1.25, ["time/step_ms"] = 12.5, mfu = 0 })
    -- literal samples: escapes, surrogate pairs, nesting, scalars
    add('{"a":[1,-2,0,{"b":null,"c":true,"d":false}],"e":"\\u00e9\\ud83d\\ude00\\n\\t\\"x\\\\\\/"}')
    add(' [ [ [ [ 18446744073709551615, -9223372036854775808 ] ] ] ] ')
    add('"\\u0041\\u00ff\\u0100 é 😀"')
    add("[]"); add("{}"); add("0"); add("-1"); add("null"); add("true")
    add('{"x":1.5e3,"y":-0.25,"z":[1e-7,2E+2]}')
    return out
  end

  ------------------------------------------------------------ BPE

  local SAMPLE = TEXT .. "the the the word word words moe moe-lua 2026 !!! \t\r\n"
  local ALL_BYTES = {}
  for i = 0, 255 do ALL_BYTES[#ALL_BYTES + 1] = string.char(i) end
  ALL_BYTES = table.concat(ALL_BYTES)

  local function bpe_seeds(dir)
    local out = {}
    for i, v in ipairs({ 257, 270, 300, 400 }) do
      local tok = data.train_bpe({ SAMPLE, SAMPLE:upper(), "aaaa bbbb aaaa bbbb abab" }, { vocab_size = v })
      local p = ("%s/bpe%d.txt"):format(dir, i)
      tok:save(p)
      out[i] = { ["merges.txt"] = read(p) }
    end
    return out
  end

  local function bpe_load(_, dir)
    local tok = data.BPETokenizer.load(dir .. "/merges.txt")
    for _, s in ipairs({ SAMPLE, ALL_BYTES, "" }) do
      local ids = tok:encode(s)
      for _, id in ipairs(ids) do
        if math.type(id) ~= "integer" or id < 0 or id >= tok.vocab_size then
          kit.bug(("encode gave id %s outside the vocabulary of %d"):format(tostring(id), tok.vocab_size))
        end
      end
      if tok:decode(ids) ~= s then kit.bug("decode(encode(s)) differs from s") end
    end
    return tok
  end

  ------------------------------------------------------------ GPT-2 / Hugging Face BPE

  -- seeds: the committed fixture (a 320-token byte-level BPE made by the
  -- tokenizers package) as vocab.json + merges.txt and as tokenizer.json
  local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
  local fixture = here .. "../data/tokenizer/"
  local gpt2 = require "moe.data.gpt2"
  local GPT2_CLEAN = { "^GPT2Tokenizer", "^[^:]*/vocab%.json %+ [^:]*/merges%.txt: ", "^[^:]*/tokenizer%.json: " }

  -- every id of an encoding is in the vocabulary and decodes back to the text
  local function gpt2_check(tok)
    for _, s in ipairs({ SAMPLE, "", "  spaces  and\ttabs\n", "caf\u{e9} \u{4e2d}\u{6587} 123" }) do
      local ok, ids = pcall(tok.encode, tok, s)
      if ok then
        for _, id in ipairs(ids) do
          if math.type(id) ~= "integer" or id < 0 or id >= tok.vocab_size then
            kit.bug(("encode gave id %s outside the vocabulary of %d"):format(tostring(id), tok.vocab_size))
          end
        end
        local dok, back = pcall(tok.decode, tok, ids)
        if dok and back ~= s then kit.bug("decode(encode(s)) differs from s") end
      end
    end
    return tok
  end

  local function gpt2_files_seeds()
    return { { ["vocab.json"] = read(fixture .. "vocab.json"), ["merges.txt"] = read(fixture .. "merges.txt") } }
  end
  local function tokjson_seeds() return { { ["tokenizer.json"] = read(fixture .. "tokenizer.json") } } end

  ------------------------------------------------------------ config

  -- moe.train's keys, plus list keys (moe.config's list parsing)
  local function config_defaults()
    local d = tconfig.defaults()
    d.hidden = { 512, 1024 }
    d.tags = {}
    d.names = { "a", "b" }
    d.flags = { true, false }
    d.ratios = { 0.5 }
    return d
  end

  local function config_seeds()
    local out = {}
    local function add(t) out[#out + 1] = { argv = table.concat(t, "\n") } end
    add { "steps=5", "warmup=0", "lr=1e-3", "model.d_model=64", "model.moe.num_experts=4", "parallel.bucket_mb=2.5" }
    add { "device=cpu", "resume=latest", "overwrite=true", "out_dir=/tmp/x", "data=bible" }
    add { "hidden=256,256", "tags=[a,b]", "names=", "flags=[true,false]", "ratios=0.25,1e-2" }
    add { "model.moe.kind=moe", "model.moe.top_k=1", "decay=constant", "warmup=0", "steps=0x10" }
    add { "run", "steps=1e3", "eval_every=0", "model.norm=rmsnorm", "sample_prompt=a=b" }
    add {}
    return out
  end

  local function config_load(input)
    local argv = {}
    for a in (input.argv .. "\n"):gmatch("([^\n]*)\n") do argv[#argv + 1] = a end
    -- --help prints the keys and exits: not a parse, kept out of the run
    local exit, wr = os.exit, io.write
    os.exit = function() error(kit.HELP_EXIT, 0) end -- luacheck: ignore 122
    io.write = function() end -- luacheck: ignore 122
    local ok, cfg = pcall(moe.config, config_defaults(), argv)
    os.exit, io.write = exit, wr -- luacheck: ignore 122
    if not ok then
      if cfg == kit.HELP_EXIT then return "help" end
      error(cfg, 0)
    end
    tconfig.check(cfg)
    return cfg
  end

  ------------------------------------------------------------ the same files through the bindings

  -- moe.load (bindings/lio.c) and data.IndexedDataset (bindings/ldata.c) in
  -- this process: their conversions and error paths (a leak shows at exit
  -- under LeakSanitizer, a crash ends the run).
  local function st_lua_load(_, dir)
    local t, meta = moe.load(dir .. "/model.safetensors")
    local n = 0
    for name, x in pairs(t) do
      if type(name) ~= "string" or not moe.is_tensor(x) then kit.bug("moe.load gave a bad entry") end
      x:totable()
      n = n + 1
    end
    for k, v in pairs(meta) do
      if type(k) ~= "string" or type(v) ~= "string" then kit.bug("moe.load gave bad metadata") end
    end
    return n
  end

  local function ds_lua_load(_, dir)
    local ds = data.IndexedDataset(dir .. "/data")
    local tokens = 0
    for i = 0, #ds - 1 do
      if tokens > 65536 then break end
      local x = ds:get(i)
      tokens = tokens + x:numel()
      x:totable()
    end
    for d = 0, ds:num_documents() do ds:document_start(d) end
    ds:close()
    return tokens
  end

  ------------------------------------------------------------ the table

  return {
    { name = "safetensors", files = { "model.safetensors" }, seeds = st_seeds, exec = "safetensors",
      mutators = st_mutators, regressions = st_regressions },
    { name = "safetensors_lua", files = { "model.safetensors" }, seeds = st_seeds, mutators = st_mutators,
      write_files = true, load = st_lua_load, clean = { "^load: '" }, regressions = st_regressions },
    { name = "dataset_lua", files = { "data.idx", "data.bin" }, weights = { ["data.idx"] = 3, ["data.bin"] = 1 },
      seeds = ds_seeds, mutators = ds_mutators, write_files = true, load = ds_lua_load,
      clean = { "^data%.IndexedDataset: indexed dataset: " } },
    -- the C reader takes integers only: the seeds with fractions are clean errors
    { name = "json", files = { "input.json" }, seeds = json_seeds, exec = "json", seeds_may_fail = true },
    { name = "dataset", files = { "data.idx", "data.bin" }, weights = { ["data.idx"] = 3, ["data.bin"] = 1 },
      seeds = ds_seeds, exec = "dataset", mutators = ds_mutators },
    { name = "lua_json", files = { "input.json" }, seeds = json_seeds, max_size = 300000,
      load = function(input) return metrics.json.encode(metrics.json.decode(input["input.json"])) end,
      clean = { "^json%.decode: " },
      regressions = { { ["input.json"] = '"\\u0041\\u-0ff"' }, { ["input.json"] = ("["):rep(250000) } } },
    { name = "bpe", files = { "merges.txt" }, seeds = bpe_seeds, write_files = true, load = bpe_load,
      clean = { "^BPETokenizer%.load: " },
      regressions = { { ["merges.txt"] = "moe-bpe 1\n32 99999999999999999999\n" },
                      -- ids past 65535 collided in the pair ranks: encode("bc") decoded as "axy"
                      { ["merges.txt"] = "moe-bpe 1\n" .. ("32 32\n"):rep(65378) .. "120 121\n97 65635\n" } } },
    { name = "gpt2_bpe", files = { "vocab.json", "merges.txt" }, seeds = gpt2_files_seeds, write_files = true,
      load = function(_, dir)
        return gpt2_check(gpt2.from_files(dir .. "/vocab.json", dir .. "/merges.txt"))
      end,
      clean = GPT2_CLEAN },
    { name = "tokenizer_json", files = { "tokenizer.json" }, seeds = tokjson_seeds, write_files = true,
      load = function(_, dir) return gpt2_check(gpt2.from_tokenizer_json(dir .. "/tokenizer.json")) end,
      clean = GPT2_CLEAN },
    { name = "config", files = { "argv" }, seeds = config_seeds, load = config_load, max_size = 4096,
      clean = { "^moe%.config: ", "^train: " },
      -- a long unknown key took minutes (edit distance to every key)
      regressions = { { argv = ("x"):rep(130000) .. "=1" } } },
  }
end
