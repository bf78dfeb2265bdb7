--[[
tests/lua/checkpoint_integrity_spec.lua - checkpoints that cannot be silently
corrupted (moe.checkpoint): a real checkpoint of a tiny dMoE GPT trained for
a few CPU steps by train.run on a preprocessed text, then damaged as disks
and people damage files: a flipped bit at the start, middle and end of every
file, a dtype swapped for another of the same width in the safetensors
header (F32 -> I32), a truncated or extended file, a missing or empty file,
a named pipe in a file's place. Each must be a clean error naming the file.
resume=latest skips a damaged newest checkpoint with a warning naming it and
takes the newest good one; an explicit resume of a damaged one is an error;
a checkpoint written before digests (no digests.txt, version 1) still loads,
with one warning. And a training process killed with SIGKILL in the middle
of its saves (six times, at delays after a save began) leaves only complete
checkpoints: every ckpt-<step> verifies and the newest loads.
]]
local moe = require "moe"
local train = require "moe.train"
local checkpoint = require "moe.checkpoint"
local metrics = require "moe.metrics"
local data = require "moe.data"

local function sh_quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end
local function sh(cmd) assert(os.execute(cmd), cmd) end

local root = os.tmpname()
os.remove(root)
sh("mkdir -p " .. sh_quote(root))
lazy_teardown(function() os.execute("rm -rf " .. sh_quote(root)) end)
local counter = 0
local function fresh(name)
  counter = counter + 1
  return ("%s/%s%d"):format(root, name or "d", counter)
end

local spec_dir = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests/lua"
local read = dofile(spec_dir .. "/read_file.lua")

local function write(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end

local function size(path) return #read(path) end

-- flips bit `bit` of byte `at` (0-based) of path in place
local function flip(path, at, bit)
  local f = assert(io.open(path, "r+b"))
  f:seek("set", at)
  local b = f:read(1):byte()
  f:seek("set", at)
  f:write(string.char(b ~ (1 << bit)))
  f:close()
end

local prefix
local function run(over)
  local c = { lr = 1e-2, warmup = 0, min_lr = 1e-3, seq_len = 8, batch_size = 2, steps = 4, log_every = 2,
    eval_every = 0, quiet = true, deterministic = true, device = "cpu", seed = 3, sample_tokens = 0,
    keep_last = 0, save_every = 2, tensorboard = false, data = prefix, valid_fraction = 0.1,
    model = { d_model = 16, n_layers = 1, n_heads = 2,
      moe = { num_experts = 4, top_k = 1, ffn_hidden_size = 16, mlp_impl = "grouped" } } }
  for k, v in pairs(over or {}) do c[k] = v end
  return train.run(c)
end

-- a trained run with ckpt-2 and ckpt-4, made once
local run_dir
local function trained()
  if run_dir then return run_dir end
  local txt = root .. "/corpus.txt"
  local f = assert(io.open(txt, "w"))
  for i = 1, 40 do f:write(("line %d: in the beginning was the word, %d.\n"):format(i, i * 7)) end
  f:close()
  prefix = data.preprocess { inputs = { txt }, output_prefix = root .. "/corpus", tokenizer = "byte" }
  run_dir = root .. "/run"
  run { out_dir = run_dir }
  return run_dir
end

-- a copy of checkpoint ckpt-<step> of the trained run, to damage
local function copy(step, dst)
  dst = dst or fresh("c")
  sh(("mkdir -p %s && cp -r %s %s"):format(sh_quote(dst), sh_quote(trained() .. "/ckpt-" .. step),
    sh_quote(dst .. "/ckpt-" .. step)))
  return dst .. "/ckpt-" .. step
end

local FILES = { "model.safetensors", "optim.safetensors", "state.json", "digests.txt" }

local function load_fails(path, file, what)
  local ok, err = pcall(checkpoint.load, path)
  assert.is_false(ok, what .. " loaded")
  err = tostring(err)
  assert.truthy(err:find(path .. "/" .. file, 1, true), what .. ": error does not name the file: " .. err)
  assert.falsy(err:find("traceback", 1, true), err)
  assert.falsy(err:find("\n", 1, true), what .. ": not one line: " .. err)
  return err
end

describe("checkpoint digests", function()
  it("a fresh checkpoint records every file and loads", function()
    local p = trained() .. "/ckpt-4"
    local text = read(p .. "/digests.txt")
    for _, name in ipairs(FILES) do
      local d, n = text:match("(xxh64:%x+) (%d+) " .. name:gsub("%.", "%%.") .. "\n")
      assert.truthy(d, name)
      if name ~= "digests.txt" then
        local got, bytes = moe.file_digest(p .. "/" .. name)
        assert.are.equal(d, got)
        assert.are.equal(math.tointeger(n), bytes)
      end
    end
    local c = checkpoint.load(p)
    assert.are.equal(4, c.state.step)
    assert.are.equal(2, c.state.version)
    assert.truthy(checkpoint.verify(p))
  end)

  it("a flipped bit anywhere in any file is an error naming the file", function()
    local n = 0
    for _, name in ipairs(FILES) do
      local len = size(trained() .. "/ckpt-4/" .. name)
      for _, at in ipairs({ 0, 5, len // 2, len - 2, len - 1 }) do
        for _, bit in ipairs({ 0, 7 }) do
          local p = copy(4)
          flip(p .. "/" .. name, at, bit)
          load_fails(p, name, ("bit %d of byte %d of %s"):format(bit, at, name))
          n = n + 1
        end
      end
    end
    assert.are.equal(#FILES * 10, n)
  end)

  it("a dtype swapped for another of the same width in a header is an error naming the file", function()
    for _, name in ipairs({ "model.safetensors", "optim.safetensors" }) do
      local p = copy(4)
      local s = read(p .. "/" .. name)
      local swapped, k = s:gsub('"dtype":"F32"', '"dtype":"I32"', 1)
      assert.are.equal(1, k)
      write(p .. "/" .. name, swapped)
      -- the file alone is still a valid safetensors file: only the digest can tell
      assert.is_table(moe.load(p .. "/" .. name))
      local err = load_fails(p, name, "F32 -> I32 in " .. name)
      assert.matches("is corrupt: its digest is", err)
    end
  end)

  it("truncated, extended, empty, missing and non-regular files are errors naming the file", function()
    for _, name in ipairs(FILES) do
      local p = copy(4)
      local s = read(p .. "/" .. name)
      write(p .. "/" .. name, s:sub(1, #s - 1))
      load_fails(p, name, "truncated " .. name)
      p = copy(4)
      write(p .. "/" .. name, s .. "\0")
      load_fails(p, name, "extended " .. name)
      p = copy(4)
      write(p .. "/" .. name, "")
      load_fails(p, name, "empty " .. name)
    end
    for _, name in ipairs({ "model.safetensors", "optim.safetensors", "state.json" }) do
      local p = copy(4)
      os.remove(p .. "/" .. name)
      load_fails(p, name, "missing " .. name)
      p = copy(4)
      os.remove(p .. "/" .. name)
      sh("mkfifo " .. sh_quote(p .. "/" .. name))
      local err = load_fails(p, name, "named pipe " .. name)
      if name ~= "state.json" then assert.matches("named pipe", err) end
    end
    -- a version-2 checkpoint without its digests.txt
    local p = copy(4)
    os.remove(p .. "/digests.txt")
    load_fails(p, "digests.txt", "missing digests.txt")
  end)

  it("a checkpoint without digests (version 1) loads with one warning", function()
    local p = copy(2)
    os.remove(p .. "/digests.txt")
    local state = metrics.json.decode(read(p .. "/state.json"))
    state.version = 1
    write(p .. "/state.json", metrics.json.encode(state) .. "\n")
    local c = checkpoint.load(p)
    assert.are.equal(2, c.state.step)
    -- the warning, once per checkpoint per process: counted in a child moe-lua
    local exe = (os.getenv("MOE_BUILD_DIR") or "build") .. "/moe-lua"
    local script = ("local c = require 'moe.checkpoint'; c.load(%q); c.load(%q); print('loaded')"):format(p, p)
    local out = assert(io.popen(sh_quote(exe) .. " -e " .. sh_quote(script) .. " 2>&1")):read("a")
    local _, warnings = out:gsub("has no digests%.txt", "")
    assert.are.equal(1, warnings, out)
    assert.matches("loaded", out)
  end)
end)

describe("resume=latest", function()
  local function damaged_run(how)
    local d = fresh("r")
    copy(2, d)
    local p = copy(4, d)
    how(p)
    return d, p
  end

  local damages = {
    ["state.json missing"] = function(p) os.remove(p .. "/state.json") end,
    ["state.json empty"] = function(p) write(p .. "/state.json", "") end,
    ["state.json not JSON"] = function(p)
      write(p .. "/state.json", "{\"step\": 4,")
      os.remove(p .. "/digests.txt") -- no digest to catch it first
    end,
    ["a digest mismatch"] = function(p) flip(p .. "/model.safetensors", size(p .. "/model.safetensors") - 3, 2) end,
  }

  it("skips a damaged newest checkpoint with a warning naming it and why", function()
    for what, how in pairs(damages) do
      local d, bad = damaged_run(how)
      local warnings = {}
      local got = checkpoint.latest_good(d, function(m) warnings[#warnings + 1] = m end)
      assert.are.equal(d .. "/ckpt-2", got, what)
      assert.are.equal(1, #warnings, what)
      assert.truthy(warnings[1]:find("skipping damaged " .. bad, 1, true), warnings[1])
    end
  end)

  it("train.run resumes from the newest good checkpoint; an explicit damaged one is an error", function()
    local d, bad = damaged_run(damages["a digest mismatch"])
    local r = run { out_dir = d, steps = 6, resume = "latest" }
    assert.is_nil(r.losses[2]) -- resumed after step 2, not 4
    assert.is_number(r.losses[3])
    assert.are.equal(6, r.step)
    -- the damaged ckpt-4 was replaced by the resumed run's own
    assert.truthy(checkpoint.verify(d .. "/ckpt-4"))
    local d2, bad2 = damaged_run(damages["a digest mismatch"])
    local ok, err = pcall(run, { out_dir = d2, steps = 6, resume = bad2 })
    assert.is_false(ok)
    assert.truthy(tostring(err):find(bad2 .. "/model.safetensors", 1, true), err)
    assert.is_nil(checkpoint.latest_good(fresh("empty")))
    assert.truthy(bad)
  end)

  it("verify hashes only its part of the files when the ranks share the work", function()
    local d, bad = damaged_run(damages["a digest mismatch"])
    local order = checkpoint.read_digests(bad).order
    local at -- model.safetensors' position in digests.txt
    for i, name in ipairs(order) do if name == "model.safetensors" then at = i end end
    local n = #order
    local mine = (at - 1) % n + 1
    local other = mine % n + 1
    assert.is_nil(checkpoint.verify(bad, { part = mine, parts = n }))
    assert.is_true(checkpoint.verify(bad, { part = other, parts = n })) -- not its file to hash
    -- latest_good with an agree that sees only this part: the damage is in another rank's part
    local said = {}
    local got = checkpoint.latest_good(d, function(m) said[#said + 1] = m end,
      { part = other, parts = n, agree = function(ok) return ok and false end })
    assert.is_nil(got)
    assert.truthy(said[1]:find("another rank found a damaged file", 1, true), said[1])
    for _, o in ipairs({ { part = 0, parts = 2 }, { part = 3, parts = 2 }, { part = 1, parts = 1.5 } }) do
      local ok, err = pcall(checkpoint.verify, bad, o)
      assert.is_false(ok)
      assert.truthy(tostring(err):find("part and parts must be integers with 1 <= part <= parts", 1, true), err)
    end
  end)
end)

describe("a process killed while it saves", function()
  -- moe-lua trains in a child that saves every step and writes "saving <step>"
  -- to a file when each save starts; the test kills it with SIGKILL at several
  -- delays after a save began (mid-write for most). Every time, the newest
  -- checkpoint that resume=latest picks verifies and loads, and a resumed run
  -- finishes.
  local exe = (os.getenv("MOE_BUILD_DIR") or "build") .. "/moe-lua"
  it("leaves the previous checkpoint loadable, every time", function()
    trained() -- the corpus
    local dir = fresh("killed")
    local marks = root .. "/marks"
    local script = root .. "/kill_train.lua"
    write(script, ([[
      local train = require "moe.train"
      local marks = %q
      train.run({ lr = 1e-3, warmup = 0, min_lr = 1e-4, seq_len = 16, batch_size = 2, steps = tonumber(arg[2]),
        log_every = 100, eval_every = 0, quiet = true, device = "cpu", seed = 3, sample_tokens = 0,
        keep_last = 2, save_every = 1, tensorboard = false, data = %q, valid_fraction = 0.1,
        out_dir = %q, resume = arg[1], decay = "constant",
        model = { d_model = 256, n_layers = 6, n_heads = 2, ffn = "dense", d_ff = 1024 } },
        { hooks = { save = function(state)
          local f = io.open(marks, "a"); f:write("saving ", state.step, "\n"); f:close()
        end } })
    ]]):format(marks, prefix, dir))
    -- two checkpoints first, then runs that resume and are killed in their first save
    assert.is_true(os.execute(("%s %s none 2 >/dev/null"):format(sh_quote(exe), sh_quote(script))))
    local kills, mid = 0, 0 -- runs killed; of them, killed in the middle of a save
    for _, delay_ms in ipairs({ 0, 2, 5, 10, 20, 40 }) do
      os.remove(marks)
      local cmd = ("%s %s latest 400 & p=$!; i=0; until [ -s %s ] || [ $i -gt 600 ]; do i=$((i + 1)); " ..
        "sleep 0.02; done; sleep %.3f; kill -9 $p; wait $p 2>/dev/null"):format(sh_quote(exe), sh_quote(script),
        sh_quote(marks), delay_ms / 1000)
      local _, _, rc = os.execute(cmd)
      if rc == 9 or rc == 137 then kills = kills + 1 end
      mid = mid + #checkpoint.remove_unfinished(dir) -- a save the kill cut short
      -- atomic saves: every ckpt-<step> there is complete (none half written)
      for _, step in ipairs(checkpoint.list(dir)) do
        local path = checkpoint.dir_name(dir, step)
        local ok, why = checkpoint.verify(path)
        assert.is_true(ok, tostring(why))
      end
      local latest = checkpoint.resolve(dir, "latest", { quiet = true })
      if latest then
        assert.is_true(checkpoint.verify(latest), latest)
        local c = checkpoint.load(latest)
        assert.truthy(next(c.model) ~= nil, latest)
      end
    end
    assert.is_true(kills >= 4, ("only %d of 6 runs were killed"):format(kills))
    -- (the saves of this 4.8M-parameter model take tens of ms: most kills land in one)
    assert.is_true(mid >= 1, ("none of the %d kills landed in a save"):format(kills))
    assert.truthy(checkpoint.resolve(dir, "latest", { quiet = true }), "no checkpoint survived")
  end)
end)
