--[[
tests/dist/ckpt_tokenizer.lua - the tokenizer in sharded checkpoints: dp = 2
training on a corpus tokenized with a small BPE (data.train_bpe) saves
checkpoints (moe/train/dcp.lua) that carry the tokenizer's file beside the
shards, listed in state.json's "files" and in digests.txt;

  moe-lua launch -n 2 tests/dist/ckpt_tokenizer.lua

then (rank 0) `moe-lua sample` generates from the sharded checkpoint with
it, `moe-lua export` copies it beside the model, and (every rank) resuming a
copy of the checkpoint whose tokenizer file was changed fails, naming the file.
]]
local moe = require "moe"
local train = require "moe.train"
local data = require "moe.data"
local checkpoint = require "moe.checkpoint"
local dcp = require "moe.train.dcp"

local dist = moe.dist
dist.init { timeout = 120 }
local rank, world = dist.rank(), dist.world_size()
assert(world == 2, "run under moe-lua launch -n 2")

local function q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end
local function slurp(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  return s
end

-- each rank its own corpus folder (the same bytes); the run's out_dir is shared
local root = os.tmpname()
os.remove(root)
root = root .. "-tok-r" .. rank
assert(os.execute("mkdir -p " .. q(root)))
local words = { "the ", "king ", "and ", "of ", "his ", "house ", "said ", "unto ", "lord ", "land " }
local x, lines = 7, {}
for _ = 1, 60 do
  local l = {}
  for _ = 1, 12 do
    x = (x * 1103515245 + 12345) % 2147483648
    l[#l + 1] = words[x % #words + 1]
  end
  lines[#lines + 1] = table.concat(l)
end
local text = table.concat(lines, "\n") .. "\n"
local f = assert(io.open(root .. "/corpus.txt", "w"))
f:write(text)
f:close()
local tok = data.train_bpe(text, { vocab_size = 300 })
tok:save(root .. "/tok.bpe")
local prefix = data.preprocess { inputs = { root .. "/corpus.txt" }, output_prefix = root .. "/bpe",
  tokenizer = "bpe:" .. root .. "/tok.bpe" }

local shared = ("/tmp/moe-ckpt-tok-%s"):format(os.getenv("MASTER_PORT") or "x")
if rank == 0 then os.execute("rm -rf " .. q(shared) .. "; mkdir -p " .. q(shared)) end
dist.barrier()

local function cfg(over)
  local c = {
    model = { vocab_size = tok.vocab_size, d_model = 32, n_layers = 1, n_heads = 2, ffn = "moe", d_ff = 64,
      moe = { num_experts = 4, top_k = 2, ffn_hidden_size = 32, loss_weight = 0.01 } },
    data = prefix, valid_fraction = 0.1, seq_len = 16, batch_size = 2, steps = 4, lr = 3e-3, warmup = 1,
    eval_every = 0, log_every = 1, save_every = 2, keep_last = 2, tensorboard = false, sample_tokens = 0,
    quiet = true, deterministic = true, device = "cpu", seed = 3, out_dir = shared .. "/run",
  }
  for k, v in pairs(over or {}) do c[k] = v end
  return c
end
train.run(cfg())
local path = shared .. "/run/ckpt-4"
local ok_all = true
local function check(cond, what)
  if not cond then
    ok_all = false
    io.stderr:write(("rank %d: FAILED: %s\n"):format(rank, what))
  end
end

if rank == 0 then
  -- the file, its digest line, state.json's list
  check(dcp.is_sharded(path), "the checkpoint is sharded")
  check(slurp(path .. "/tokenizer.bpe") == tok:serialize(), "tokenizer.bpe is the tokenizer's own file")
  local st = dcp.read_state(path, 0, 2)
  check(st.files and st.files[1] == "tokenizer.bpe" and #st.files == 1, "state.json lists tokenizer.bpe")
  check(st.tokenizer and st.tokenizer.kind == "bpe" and st.tokenizer.vocab_size == tok.vocab_size,
    "state.json records the tokenizer")
  local digests = checkpoint.read_digests(path)
  check(type(digests) == "table" and digests["tokenizer.bpe"] ~= nil, "digests.txt lists tokenizer.bpe")
  check(checkpoint.verify(path), "the checkpoint verifies")
  -- sample and export read it
  local exe = moe.proc.exe()
  local p = io.popen(("%s sample ckpt=%s prompt=%s tokens=8 device=cpu 2>&1; echo rc=$?"):format(q(exe), q(path),
    q("the king")))
  local out = p:read("a")
  p:close()
  check(out:match("rc=0\n$") and out:find("the king", 1, true), "moe-lua sample from the sharded checkpoint: " .. out)
  p = io.popen(("%s export ckpt=%s format=hf out=%s 2>&1; echo rc=$?"):format(q(exe), q(path), q(shared .. "/hf")))
  out = p:read("a")
  p:close()
  check(out:match("rc=0\n$") and out:find("tokenizer: bpe, vocab_size " .. tok.vocab_size .. ", files tokenizer.bpe",
    1, true), "moe-lua export names the tokenizer: " .. out)
  check(slurp(shared .. "/hf/tokenizer.bpe") == tok:serialize(), "export copies tokenizer.bpe")
  -- a copy whose tokenizer file changed
  os.execute(("cp -r %s %s"):format(q(path), q(shared .. "/bad")))
  local g = assert(io.open(shared .. "/bad/tokenizer.bpe", "ab"))
  g:write("x")
  g:close()
  local ok, err = pcall(dcp.read_state, shared .. "/bad", 0, 2)
  check(not ok and tostring(err):find("'" .. shared .. "/bad/tokenizer.bpe' is corrupt", 1, true),
    "read_state names the changed file: " .. tostring(err))
end
dist.barrier()
-- resuming the damaged copy: every rank refuses it, naming the file
local ok, err = pcall(train.run, cfg({ steps = 6, resume = shared .. "/bad", out_dir = shared .. "/run2" }))
check(not ok and tostring(err):find("tokenizer.bpe' is corrupt", 1, true),
  "resuming a checkpoint with a changed tokenizer file fails: " .. tostring(err))
-- the good one resumes
local res = train.run(cfg({ steps = 6, resume = path, out_dir = shared .. "/run3" }))
check(res.step == 6 and res.losses[5] ~= nil and res.losses[4] == nil, "resuming the checkpoint trains steps 5-6")

dist.barrier()
if rank == 0 then os.execute("rm -rf " .. q(shared)) end
os.execute("rm -rf " .. q(root))
local all = moe.tensor({ ok_all and 1 or 0 }, { dtype = "f64" })
dist.all_reduce(all, "min")
local good = all:totable()[1] == 1
if rank == 0 then print(good and "ckpt_tokenizer: ok" or "ckpt_tokenizer: FAILED") end
if not good then os.exit(1) end
