--[[
tests/lua/train_guard_spec.lua - training that cannot silently go wrong or be
lost, through the real command line ($MOE_BUILD_DIR/moe-lua):

  - config validation: a table of bad key=value overrides, each refused by
    `moe-lua train` before anything is built, with one line naming the key, no
    traceback, a non-zero status and no out_dir; the good defaults still train;
  - SIGTERM and Ctrl-C (SIGINT) during `train`: a checkpoint of the current step,
    status 143 / 130, and resume=latest ends with the weights of an
    uninterrupted run (bit-identical on the CPU);
  - non-finite steps: skipped (no update, counted in metrics.jsonl), and the run
    stops after max_skipped_in_a_row of them in a row without saving;
  - a fresh run into an out_dir that holds an earlier run's metrics.jsonl.

MOE_GUARD_REPORT=1 prints how many of the bad overrides were refused cleanly
(how the table is run against another build: MOE_BUILD_DIR=that/build).
]]
local moe = require "moe"
local data = require "moe.data"

local build = os.getenv("MOE_BUILD_DIR") or "build"
local exe = build .. "/moe-lua"

local function q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

local root = moe.proc.mkdtemp("train-guard")
local counter = 0
local function fresh_dir()
  counter = counter + 1
  return ("%s/run%d"):format(root, counter)
end

local function exists(path)
  local f = io.open(path, "rb")
  if f then f:close() end
  return f ~= nil
end

local function slurp(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  return s
end

-- Runs a shell command line; returns its output (stdout and stderr) and status.
local function sh(cmd)
  local p = assert(io.popen("(" .. cmd .. ") 2>&1 </dev/null; echo \"__rc=$?\""))
  local out = p:read("a")
  p:close()
  local rc = tonumber(out:match("__rc=(%d+)%s*$"))
  return (out:gsub("__rc=%d+%s*$", "")), rc
end

-- A small corpus of words (byte ids, end-of-document 256).
local corpus = root .. "/words"
do
  local b = data.IndexedDatasetBuilder(corpus, { dtype = "u16" })
  for d = 1, 60 do
    local ids = {}
    for i = 1, 50 do ids[i] = 97 + (d * 7 + i * 3) % 26 end
    ids[#ids + 1] = 256
    b:add_document(ids)
  end
  b:finalize()
end

-- The overrides of a tiny run of `moe-lua train` (a second, fast on 2 cores).
local function base_args(out_dir, steps)
  return table.concat({
    "data=" .. q(corpus), "seq_len=8", "batch_size=2", "steps=" .. (steps or 2), "warmup=0", "eval_every=0",
    "eval_iters=0", "sample_tokens=0", "tensorboard=false", "quiet=true", "device=cpu", "keep_last=2",
    "model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.d_ff=16", "model.moe.num_experts=4",
    "model.moe.ffn_hidden_size=16", "out_dir=" .. q(out_dir) }, " ")
end

-- Bad overrides: each must be refused with a one-line error naming `key`.
local bad = {
  -- learning rate and its schedule
  { "lr=1e999", "lr" }, { "lr=-1", "lr" }, { "lr=-1e-3", "lr" }, { "lr=abc", "lr" },
  { "min_lr=-1", "min_lr" }, { "min_lr=1", "min_lr" }, { "min_lr=1e999", "min_lr" },
  { "warmup=-1", "warmup" }, { "warmup=5", "warmup" }, { "decay=exp", "decay" }, { "decay=", "decay" },
  { "decay=Cosine", "decay" },
  -- the optimizer
  { "clip=-1", "clip" }, { "clip=1e999", "clip" }, { "beta1=2", "beta1" }, { "beta1=1", "beta1" },
  { "beta1=-0.1", "beta1" }, { "beta2=2", "beta2" }, { "beta2=1", "beta2" }, { "beta2=-1", "beta2" },
  { "eps=0", "eps" }, { "eps=-1", "eps" }, { "eps=1e999", "eps" }, { "weight_decay=-0.1", "weight_decay" },
  { "weight_decay=1e999", "weight_decay" }, { "optimizer=adam", "optimizer" }, { "optimizer=", "optimizer" },
  -- the model
  { "model.init_std=-1", "model.init_std" }, { "model.init_std=0", "model.init_std" },
  { "model.init_std=1e999", "model.init_std" }, { "model.n_heads=3", "model.n_heads" },
  { "model.n_heads=0", "model.n_heads" }, { "model.n_heads=-2", "model.n_heads" },
  { "model.d_model=18", "model.d_model" }, { "model.d_model=0", "model.d_model" },
  { "model.d_model=-16", "model.d_model" }, { "model.vocab_size=0", "model.vocab_size" },
  { "model.vocab_size=-5", "model.vocab_size" }, { "model.n_layers=0", "model.n_layers" },
  { "model.d_ff=0", "model.d_ff" }, { "model.dropout=1", "model.dropout" }, { "model.dropout=-0.1", "model.dropout" },
  { "model.dropout=1.5", "model.dropout" }, { "model.pos=alibi", "model.pos" }, { "model.pos=ROPE", "model.pos" },
  { "model.pos=", "model.pos" }, { "model.norm=batchnorm", "model.norm" }, { "model.ffn=conv", "model.ffn" },
  { "model.tie_embeddings=yes", "model.tie_embeddings" },
  -- the MoE layers
  { "model.moe.every=0", "model.moe.every" }, { "model.moe.every=-1", "model.moe.every" },
  { "model.moe.every=2", "model.moe.every" }, { "model.moe.top_k=5", "model.moe.top_k" },
  { "model.moe.top_k=0", "model.moe.top_k" }, { "model.moe.top_k=-1", "model.moe.top_k" },
  { "model.moe.num_experts=0", "model.moe.num_experts" }, { "model.moe.ffn_hidden_size=0", "model.moe.ffn_hidden_size" },
  { "model.moe.capacity_factor=0", "model.moe.capacity_factor" },
  { "model.moe.capacity_factor=-1", "model.moe.capacity_factor" },
  { "model.moe.loss_weight=-1", "model.moe.loss_weight" }, { "model.moe.zloss_weight=-0.5", "model.moe.zloss_weight" },
  { "model.moe.jitter_eps=-0.1", "model.moe.jitter_eps" }, { "model.moe.jitter_eps=1", "model.moe.jitter_eps" },
  { "model.moe.activation=swish", "model.moe.activation" }, { "model.moe.mlp_type=swiglu", "model.moe.mlp_type" },
  { "model.moe.mlp_impl=cuda", "model.moe.mlp_impl" }, { "model.moe.mlp_impl=sparse", "model.moe.mlp_impl" },
  { "model.moe.kind=switch", "model.moe.kind" },
  -- data, batches, steps
  { "valid_fraction=1", "valid_fraction" }, { "valid_fraction=-0.1", "valid_fraction" },
  { "valid_fraction=2", "valid_fraction" }, { "seq_len=0", "seq_len" }, { "batch_size=0", "batch_size" },
  { "grad_accum=0", "grad_accum" }, { "steps=-1", "steps" }, { "steps=1.5", "steps" },
  { "log_every=0", "log_every" }, { "eval_every=-1", "eval_every" }, { "eval_iters=-1", "eval_iters" },
  { "save_every=-1", "save_every" }, { "keep_last=-1", "keep_last" }, { "stop_at=-1", "stop_at" },
  { "max_skipped_in_a_row=0", "max_skipped_in_a_row" },
  -- sampling
  { "sample_temperature=0", "sample_temperature" }, { "sample_temperature=-1", "sample_temperature" },
  { "sample_top_k=-1", "sample_top_k" }, { "sample_tokens=-1", "sample_tokens" }, { "sample_every=-1", "sample_every" },
  -- device, dtype, files
  { "device=tpu", "device" }, { "dtype=f16", "dtype" }, { "overwrite=yes", "overwrite" },
  -- parallelism
  { "parallel.dp=-1", "parallel.dp" }, { "parallel.dp=2", "parallel.dp" }, { "parallel.ep=0", "parallel.ep" },
  { "parallel.ep=3", "parallel.ep" }, { "parallel.bucket_mb=-1", "parallel.bucket_mb" },
  { "parallel.bucket_mb=1e999", "parallel.bucket_mb" }, { "parallel.dp_shard=-1", "parallel.dp_shard" },
  { "parallel.dp_replicate=-1", "parallel.dp_replicate" }, { "parallel.dp_replicate=2", "parallel.dp_replicate" },
}

-- Whether one bad override is refused cleanly; returns ok and why not.
local function refused(case)
  local out_dir = fresh_dir()
  local out, rc = sh(("%s train %s %s"):format(q(exe), base_args(out_dir), case[1]))
  local lines = {}
  for l in out:gmatch("[^\n]+") do lines[#lines + 1] = l end
  if rc == 0 then return false, "accepted (status 0)" end
  if out:find("stack traceback", 1, true) then return false, "traceback: " .. (lines[1] or "") end
  if exists(out_dir) then return false, "wrote out_dir: " .. (lines[1] or "") end
  if #lines ~= 1 then return false, ("%d lines: %s"):format(#lines, out) end
  if not lines[1]:find(case[2], 1, true) then return false, "does not name " .. case[2] .. ": " .. lines[1] end
  return true, lines[1]
end

describe("moe-lua train: config validation", function()
  it("refuses every bad override in one line naming the key, before anything is written", function()
    assert.truthy(#bad >= 80, #bad)
    local failures, ok_count = {}, 0
    for _, case in ipairs(bad) do
      local ok, why = refused(case)
      if ok then ok_count = ok_count + 1 else failures[#failures + 1] = case[1] .. ": " .. why end
      if os.getenv("MOE_GUARD_REPORT") == "1" then
        io.stderr:write(("%-4s %-34s %s\n"):format(ok and "ok" or "BAD", case[1], why))
      end
    end
    if os.getenv("MOE_GUARD_REPORT") == "1" then
      io.stderr:write(("%d of %d bad overrides refused cleanly\n"):format(ok_count, #bad))
    end
    assert.are.equal(0, #failures, table.concat(failures, "\n"))
  end)

  it("NaN anywhere is refused naming the key (table form: the command line cannot spell NaN)", function()
    local train = require "moe.train"
    local nan = 0 / 0
    for _, c in ipairs({ { { lr = nan }, "lr" }, { { model = { init_std = nan } }, "model.init_std" },
      { { model = { moe = { loss_weight = nan } } }, "model.moe.loss_weight" },
      { { parallel = { bucket_mb = nan } }, "parallel.bucket_mb" }, { { beta2 = nan }, "beta2" } }) do
      local ok, err = pcall(train.run, c[1])
      assert.is_false(ok)
      assert.are.equal(("train: %s must be a finite number, got nan"):format(c[2]), err)
    end
  end)

  it("the good defaults still train", function()
    local out_dir = fresh_dir()
    local out, rc = sh(("%s train %s"):format(q(exe), base_args(out_dir)))
    assert.are.equal(0, rc, out)
    assert.truthy(exists(out_dir .. "/ckpt-2/state.json"), out)
  end)
end)

