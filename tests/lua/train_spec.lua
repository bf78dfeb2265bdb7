--[[
tests/lua/train_spec.lua - the training loop (moe.train), checkpoints
(moe.checkpoint), metrics (moe.metrics) and sampling (moe.sample).

The loop is driven with a tiny model built here from tensor ops (embedding,
a router whose argmax gives per-"expert" counts, dropout so that the RNG
state matters, a linear head), momentum SGD and an in-memory dataset with a
seeded position, all following the contracts of moe.nn / moe.optim /
moe.data, so these tests run in seconds and do not depend on those modules.
When moe.nn, moe.layers and moe.optim are present, a last test trains a real
tiny dMoE TransformerLM through train.run's own builders.

Covered: a stopped-and-resumed run gives bit-identical losses to an
uninterrupted one (deterministic mode); checkpoint folders are complete and
their files valid safetensors; a failed write leaves the previous checkpoint
intact and no partial folder; keep_last pruning; metrics.jsonl and the
TensorBoard file hold what was logged; JSON round trips; config errors.
]]
local moe = require "moe"
local train = require "moe.train"
local checkpoint = require "moe.checkpoint"
local metrics = require "moe.metrics"
local tensorboard = require "moe.tensorboard"
local sample = require "moe.sample"

local function sh_quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

local root = os.tmpname()
os.remove(root)
assert(os.execute("mkdir -p " .. sh_quote(root)))
local dir_counter = 0
local function fresh_dir()
  dir_counter = dir_counter + 1
  return ("%s/run%d"):format(root, dir_counter)
end

local function ls(dir)
  local names = {}
  local p = io.popen("ls -1a " .. sh_quote(dir) .. " 2>/dev/null")
  for n in p:lines() do if n ~= "." and n ~= ".." then names[#names + 1] = n end end
  p:close()
  table.sort(names)
  return names
end

---------------------------------------------------------------- tiny parts

local V, D, E = 32, 16, 4

-- A model with moe.nn's interface: named_parameters, state_dict, load_state_dict,
-- train/eval, forward(idx) -> logits (B, S, V), loss(x, y) -> loss, info.
local function tiny_model()
  local m = { training = true, seq_len = 8 }
  local emb = moe.randn({ V, D }) * 0.5
  local router = moe.randn({ E, D }) * 0.5
  local head = moe.randn({ V, D }) * 0.2
  m.params = { { "emb.weight", emb:requires_grad_(true) }, { "router.weight", router:requires_grad_(true) },
    { "head.weight", head:requires_grad_(true) } }
  function m:named_parameters() return self.params end
  function m:state_dict()
    local sd = {}
    for _, p in ipairs(self.params) do sd[p[1]] = p[2] end
    return sd
  end
  function m:load_state_dict(sd)
    for _, p in ipairs(self.params) do
      assert(sd[p[1]], "missing " .. p[1])
      moe.no_grad(function() p[2]:copy_(sd[p[1]]) end)
    end
  end
  function m:train() self.training = true end
  function m:eval() self.training = false end
  function m:forward(idx)
    local h = moe.embedding(self.params[1][2], idx)                  -- (B, S, D)
    h = moe.dropout(h, 0.1, self.training)
    local r = moe.linear(h, self.params[2][2])                        -- (B, S, E)
    local ids = moe.argmax(r, -1):reshape(-1)
    self.stats = { expert_counts = moe.one_hot(ids, E):sum(0) }
    local top = moe.max(r, -1) -- values (B, S)
    h = h * moe.sigmoid(top):unsqueeze(-1)
    return moe.linear(h, self.params[3][2])                           -- (B, S, V)
  end
  function m:loss(x, y)
    local logits = self:forward(x)
    local loss = moe.cross_entropy(logits:reshape(-1, V), y:reshape(-1))
    return loss, { lm_loss = loss:item(), aux_loss = 0, stats = { { name = "layer", stats = self.stats } } }
  end
  return m
end

-- Momentum SGD with moe.optim's interface.
local function tiny_sgd(named, cfg)
  local opt = { lr = cfg.lr, bufs = {}, steps = 0 }
  for _, p in ipairs(named) do opt.bufs[p[1]] = moe.zeros(p[2].shape) end
  function opt:step()
    moe.no_grad(function()
      for _, p in ipairs(named) do
        local g = p[2].grad
        if g then
          local b = self.bufs[p[1]]
          b:copy_(b * 0.9 + g)
          p[2]:copy_(p[2] - b * self.lr)
        end
      end
    end)
    self.steps = self.steps + 1
  end
  function opt.zero_grad()
    local ps = {}
    for i, p in ipairs(named) do ps[i] = p[2] end
    moe.zero_grad(ps)
  end
  function opt.state_dict(self)
    local sd = {}
    for k, b in pairs(self.bufs) do sd[k .. ".momentum"] = b end
    return sd
  end
  function opt:state_scalars() return { steps = self.steps, lr = self.lr } end
  function opt:load_state_dict(t, s)
    for k, b in pairs(self.bufs) do b:copy_(t[k .. ".momentum"]) end
    self.steps = s.steps
  end
  return opt
end

local function tiny_clip(params, max_norm)
  local total = 0
  for _, p in ipairs(params) do
    if p.grad then total = total + moe.sum(p.grad * p.grad):item() end
  end
  total = math.sqrt(total)
  if total > max_norm then
    moe.no_grad(function()
      for _, p in ipairs(params) do if p.grad then p.grad:copy_(p.grad * (max_norm / (total + 1e-6))) end end
    end)
  end
  return total
end

-- An in-memory dataset: windows of seq_len + 1 tokens at positions drawn from an LCG.
local function tiny_data(seed, S)
  local text = ("the quick brown fox jumps over the lazy dog and the cat sat on the mat "):rep(8)
  local toks = {}
  for i = 1, #text do toks[i] = text:byte(i) % V end
  local d = { pos = seed }
  function d:batch(B)
    local xs, ys = {}, {}
    for b = 1, B do
      self.pos = (self.pos * 1103515245 + 12345) % 2147483648
      local start = self.pos % (#toks - S - 1)
      xs[b], ys[b] = {}, {}
      for j = 1, S do xs[b][j] = toks[start + j]; ys[b][j] = toks[start + j + 1] end
    end
    return moe.tensor(xs, { dtype = "i64" }), moe.tensor(ys, { dtype = "i64" })
  end
  function d:state() return { pos = self.pos } end
  function d:set_state(s) self.pos = s.pos end
  return d
end

local tiny_tokenizer = {

  encode = function(_, s)
    local t = {}
    for i = 1, #s do t[i] = s:byte(i) % V end
    return t
  end,
  decode = function(_, ids)
    local t = {}
    for i, id in ipairs(ids) do t[i] = string.char(65 + id % 26) end
    return table.concat(t)
  end,
}

local function parts(seed)
  moe.manual_seed(seed or 7)
  return {
    model = tiny_model(), optimizer = tiny_sgd, clip_grad_norm = tiny_clip,
    train_data = tiny_data(11, 8), valid_data = tiny_data(99, 8), tokenizer = tiny_tokenizer,
  }
end

local function cfg(over)
  local c = { lr = 0.05, warmup = 2, min_lr = 0.001, seq_len = 8, batch_size = 4, steps = 10, log_every = 2,
    eval_every = 5, eval_iters = 2, quiet = true, deterministic = true, device = "cpu", seed = 3,
    sample_tokens = 0, keep_last = 3 }
  for k, v in pairs(over or {}) do c[k] = v end
  return c
end

---------------------------------------------------------------- tests

describe("train.run", function()
  it("resumes exactly: N steps == N/2, stop, resume N/2 (bit-identical losses)", function()
    local full_dir, split_dir = fresh_dir(), fresh_dir()
    local full = train.run(cfg { out_dir = full_dir, steps = 10 }, parts())
    local first = train.run(cfg { out_dir = split_dir, steps = 10, stop_at = 5 }, parts())
    assert.are.equal(5, first.step)
    assert.are.equal(split_dir .. "/ckpt-5", first.checkpoint)
    -- a fresh process-like start: different model init, different RNG, fresh data objects
    moe.manual_seed(12345)
    local p2 = parts(999)
    local second = train.run(cfg { out_dir = split_dir, steps = 10, resume = "latest" }, p2)
    assert.are.equal(10, full.step)
    assert.are.equal(10, second.step)
    for s = 1, 5 do assert.are.equal(full.losses[s], first.losses[s]) end
    for s = 6, 10 do
      assert.is_number(second.losses[s])
      assert.are.equal(full.losses[s], second.losses[s], "loss at step " .. s) -- exact equality
    end
    assert.is_nil(second.losses[5]) -- the resumed run did not redo step 5
    -- metrics.jsonl: the stopped run logged 2, 4 and its last step 5; the resumed run appended
    local logged = {}
    for _, rec in ipairs(metrics.read_jsonl(split_dir .. "/metrics.jsonl")) do
      if rec.loss then logged[#logged + 1] = rec.step end
    end
    assert.are.same({ 2, 4, 5, 6, 8, 10 }, logged)
    assert.are.equal(full.val_losses[10], second.val_losses[10])
    -- losses fall on this easy task
    assert.is_true(full.losses[10] < full.losses[1])
  end)

  it("depends on the seed (dropout draws from the RNG), so the resume test can fail", function()
    local d = fresh_dir()
    local a = train.run(cfg { out_dir = d, steps = 4 }, parts())
    local b = train.run(cfg { out_dir = fresh_dir(), steps = 4, seed = 4 }, parts())
    assert.are_not.equal(a.losses[2], b.losses[2]) -- dropout masks depend on the seed
  end)

  it("writes metrics.jsonl, TensorBoard scalars and checkpoints", function()
    local d = fresh_dir()
    local r = train.run(cfg { out_dir = d, steps = 6, save_every = 2, keep_last = 2 }, parts())
    assert.are.same({ "ckpt-4", "ckpt-6", "config.json", "metrics.jsonl", "tb" }, ls(d))
    assert.are.same({ "digests.txt", "model.safetensors", "optim.safetensors", "state.json" }, ls(d .. "/ckpt-6"))
    assert.are.equal(d .. "/ckpt-6", r.checkpoint)
    -- valid safetensors with the model's tensors
    local sd = moe.load(d .. "/ckpt-6/model.safetensors")
    assert.are.same({ 32, 16 }, sd["emb.weight"].shape)
    local osd = moe.load(d .. "/ckpt-6/optim.safetensors")
    assert.is_not_nil(osd["head.weight.momentum"])
    local c = checkpoint.load(d .. "/ckpt-6")
    assert.are.equal(6, c.state.step)
    assert.are.equal(6 * 4 * 8, c.state.consumed_tokens)
    assert.are.equal(6, c.state.optim_scalars.steps)
    assert.are.equal(8, c.state.config.seq_len)
    assert.is_number(c.state.rng.seed)
    -- metrics: log steps 2, 4, 6 and validation at 5 and 6
    local recs = metrics.read_jsonl(d .. "/metrics.jsonl")
    local steps, vals = {}, {}
    for _, rec in ipairs(recs) do
      if rec.val_loss then vals[#vals + 1] = rec.step else steps[#steps + 1] = rec.step end
    end
    assert.are.same({ 2, 4, 6 }, steps)
    assert.are.same({ 5, 6 }, vals)
    local last = recs[#recs - 1]
    assert.are.equal(6, last.step)
    assert.are.equal((r.losses[5] + r.losses[6]) / 2, last.loss)
    local counts = last.expert_counts.layer
    local total = 0
    for _, n in ipairs(counts) do total = total + n end
    assert.are.equal(2 * 4 * 8, total) -- two steps of B*S tokens
    assert.are.equal(#counts, E)
    -- TensorBoard
    local files = ls(d .. "/tb")
    assert.are.equal(1, #files)
    local evs = tensorboard.read(d .. "/tb/" .. files[1])
    assert.are.equal("brain.Event:2", evs[1].file_version)
    local seen = {}
    for _, ev in ipairs(evs) do
      for _, v in ipairs(ev.values) do seen[v.tag .. "@" .. ev.step] = v.value end
    end
    assert.are.equal(string.unpack("<f", string.pack("<f", last.loss)), seen["loss@6"])
    assert.is_number(seen["val_loss@5"])
    assert.is_number(seen["lr@2"])
    assert.is_number(seen["grad_norm@4"])
    assert.is_number(seen["tokens_per_s@6"])
    assert.is_number(seen["expert_load/layer0/e0@6"])
  end)

  it("refuses a fresh run into an out_dir with checkpoints; overwrite=true starts afresh", function()
    local d = fresh_dir()
    train.run(cfg { out_dir = d, steps = 4, save_every = 2 }, parts())
    assert.is_true(os.execute("mkdir -p " .. sh_quote(d .. "/tb/keep") .. " && echo mine > " .. sh_quote(d .. "/notes.txt")))
    local before = ls(d)
    local f = io.open(d .. "/metrics.jsonl"); local metrics_before = f:read("a"); f:close()
    local ok, err = pcall(train.run, cfg { out_dir = d, steps = 2 }, parts())
    assert.is_false(ok)
    assert.truthy(err:find("train: out_dir '" .. d .. "' already holds checkpoints (ckpt-2, ckpt-4)", 1, true), err)
    assert.truthy(err:find("resume=latest", 1, true), err)
    assert.truthy(err:find("overwrite=true", 1, true), err)
    assert.are.same(before, ls(d)) -- nothing written, nothing pruned
    f = io.open(d .. "/metrics.jsonl"); assert.are.equal(metrics_before, f:read("a")); f:close()
    ok, err = pcall(train.run, cfg { out_dir = d, steps = 2, resume = "latest", overwrite = true }, parts())
    assert.is_false(ok)
    assert.truthy(err:find("overwrite=true starts afresh but resume='latest' continues a run", 1, true), err)
    -- overwrite=true: moe-lua's own files go, the folder's other content stays
    local old_tb = ls(d .. "/tb")
    local r = train.run(cfg { out_dir = d, steps = 3, overwrite = true }, parts())
    assert.are.equal(3, r.step)
    assert.are.same({ "ckpt-3", "config.json", "metrics.jsonl", "notes.txt", "tb" }, ls(d))
    local tb_now = ls(d .. "/tb")
    assert.are.equal(2, #tb_now) -- keep/ and the new run's event file
    for _, name in ipairs(tb_now) do
      for _, o in ipairs(old_tb) do if o ~= "keep" then assert.are_not.equal(o, name) end end
    end
    local logged = {}
    for _, rec in ipairs(metrics.read_jsonl(d .. "/metrics.jsonl")) do
      if rec.loss then logged[#logged + 1] = rec.step end
    end
    assert.are.same({ 2, 3 }, logged)
  end)

  it("writes the resolved config to out_dir/config.json", function()
    local d = fresh_dir()
    train.run(cfg { out_dir = d, steps = 2, model = { d_model = 16 } }, parts())
    local f = io.open(d .. "/config.json")
    local c = metrics.json.decode(f:read("a"))
    f:close()
    assert.are.equal(2, c.steps)
    assert.are.equal(d, c.out_dir)
    assert.are.equal(16, c.model.d_model)
    assert.are.equal(8, c.model.moe.num_experts) -- defaults filled in
    assert.is_false(c.overwrite)
  end)

  it("after a resume metrics.jsonl holds each step once; TensorBoard is told to purge", function()
    local d = fresh_dir()
    train.run(cfg { out_dir = d, steps = 8, save_every = 5 }, parts())
    checkpoint.rm_rf(d .. "/ckpt-8") -- killed after logging step 8, before its checkpoint
    -- and a save killed half way
    assert.is_true(os.execute("mkdir -p " .. sh_quote(d .. "/.tmp-ckpt-8-1-1") .. " && echo x > " ..
      sh_quote(d .. "/.tmp-ckpt-8-1-1/model.safetensors")))
    local f = io.open(d .. "/metrics.jsonl", "a"); f:write('{"step": 9, "lo'); f:close() -- a half line
    local r = train.run(cfg { out_dir = d, steps = 8, resume = "latest" }, parts())
    assert.are.equal(d .. "/ckpt-8", r.checkpoint)
    assert.are.same({ "ckpt-5", "ckpt-8", "config.json", "metrics.jsonl", "tb" }, ls(d)) -- no .tmp-ckpt-*
    local logged, evals = {}, {}
    for _, rec in ipairs(metrics.read_jsonl(d .. "/metrics.jsonl")) do
      if rec.loss then logged[#logged + 1] = rec.step else evals[#evals + 1] = rec.step end
    end
    assert.are.same({ 2, 4, 6, 8 }, logged)
    assert.are.same({ 5, 8 }, evals)
    -- the resumed run's event file starts with a SessionLog START at the first redone step
    local files = ls(d .. "/tb")
    assert.are.equal(2, #files)
    local starts = {}
    for _, name in ipairs(files) do
      for _, ev in ipairs(tensorboard.read(d .. "/tb/" .. name)) do
        if ev.session_status then starts[#starts + 1] = { ev.session_status, ev.step } end
      end
    end
    assert.are.same({ { 1, 6 } }, starts)
  end)

  it("resume='latest' with no checkpoint starts from scratch; a bad resume path is an error", function()
    local d = fresh_dir()
    local r = train.run(cfg { out_dir = d, steps = 2, resume = "latest" }, parts())
    assert.are.equal(2, r.step)
    assert.has_error(function() train.run(cfg { out_dir = d, resume = d .. "/nope" }, parts()) end,
      "checkpoint: resume='" .. d .. "/nope' is not a checkpoint folder (no state.json in it)")
  end)

  it("rejects bad config keys and values with a clear message", function()
    local ok, err = pcall(train.run, cfg { stepz = 3 }, parts())
    assert.is_false(ok)
    assert.matches("unknown config key 'stepz' %(did you mean 'steps'%? valid keys: .*steps", err)
    ok, err = pcall(train.run, cfg { model = { d_modl = 3 } }, parts())
    assert.is_false(ok)
    assert.matches("unknown config key 'model.d_modl'", err)
    ok, err = pcall(train.run, cfg { steps = "ten" }, parts())
    assert.is_false(ok)
    assert.matches("config key 'steps' expects a number, got a string", err)
    ok, err = pcall(train.run, cfg { batch_size = 0 }, parts())
    assert.is_false(ok)
    assert.matches("batch_size must be an integer >= 1, got 0", err)
    ok, err = pcall(train.run, cfg { device = "tpu" }, parts())
    assert.is_false(ok)
    assert.matches("device must be one of auto, cpu, cuda, got 'tpu'", err)
    ok, err = pcall(train.run, cfg { steps = 5, warmup = 20 }, parts())
    assert.is_false(ok)
    assert.matches("warmup=20 is longer than steps=5", err, 1, true)
    ok, err = pcall(train.run, cfg { warmup = -1 }, parts())
    assert.is_false(ok)
    assert.matches("warmup must be an integer >= 0, got -1", err, 1, true)
  end)

  it("reports a missing dataset clearly", function()
    local ok, err = pcall(train.run, cfg { data = root .. "/missing", out_dir = fresh_dir() },
      { model = parts().model, optimizer = tiny_sgd, schedule = function() return 0.1 end, clip_grad_norm = tiny_clip })
    assert.is_false(ok)
    assert.matches("no dataset .*missing%.bin", err)
  end)

  it("accumulates gradients over micro-batches", function()
    local r = train.run(cfg { out_dir = fresh_dir(), steps = 3, grad_accum = 2 }, parts())
    assert.are.equal(3, r.step)
    local c = checkpoint.load(r.checkpoint)
    assert.are.equal(3 * 2 * 4 * 8, c.state.consumed_tokens)
  end)

  it("model.moe.uniform_expert_assignment: every expert gets the same rows, the router gets gradients", function()
    local dir = fresh_dir()
    local p = parts()
    p.model, p.optimizer, p.clip_grad_norm = nil, nil, nil
    local c = cfg { out_dir = dir, steps = 2, log_every = 1, eval_every = 0, deterministic = false,
      model = { vocab_size = V, d_model = 16, n_layers = 2, n_heads = 2, d_ff = 16,
        moe = { num_experts = 8, top_k = 2, ffn_hidden_size = 16, uniform_expert_assignment = true } } }
    local router_grads = {}
    p.hooks = { after_backward = function(state)
      for _, nt in ipairs(state.named_params) do
        if nt[1]:find("router", 1, true) and nt[2].grad then
          router_grads[#router_grads + 1] = moe.no_grad(function() return moe.abs(nt[2].grad):sum():item() end)
        end
      end
    end }
    train.run(c, p)
    -- the router still gets gradients (its load-balancing loss), so it trains as without the option
    assert.are.equal(4, #router_grads) -- 2 layers x 2 steps
    for _, g in ipairs(router_grads) do assert.truthy(g > 0) end
    local f = assert(io.open(dir .. "/metrics.jsonl"))
    local n = 0
    for line in f:lines() do
      local rec = metrics.json.decode(line)
      for layer, counts in pairs(rec.expert_counts) do
        n = n + 1
        assert.are.same({ 8, 8, 8, 8, 8, 8, 8, 8 }, counts, layer) -- 4 x 8 tokens x 2 slots over 8 experts
      end
    end
    f:close()
    assert.are.equal(4, n)
  end)

  it("samples text at the end without changing the training RNG stream", function()
    local a = train.run(cfg { out_dir = fresh_dir(), steps = 4, sample_tokens = 5, sample_every = 2 }, parts())
    local b = train.run(cfg { out_dir = fresh_dir(), steps = 4 }, parts())
    assert.are.equal(5, #a.sample)
    for s = 1, 4 do assert.are.equal(b.losses[s], a.losses[s]) end
  end)
end)

describe("moe-lua plot", function()
  local plot = require "moe.cli.plot"
  local d = fresh_dir()
  train.run(cfg { out_dir = d, steps = 6 }, parts())

  local function is_png(path)
    local f = io.open(path, "rb")
    if not f then return false end
    local head = f:read(8)
    f:close()
    return head == "\137PNG\r\n\26\n"
  end

  local test = plot.gnuplot_available() and it or pending
  test("renders loss.png and expert_load.png with gnuplot", function()
    local pngs = plot.render(d .. "/metrics.jsonl", d .. "/plots")
    assert.are.same({ d .. "/plots/loss.png", d .. "/plots/expert_load.png" }, pngs)
    assert.is_true(is_png(pngs[1]))
    assert.is_true(is_png(pngs[2]))
    assert.are.equal(0, plot.main("out_dir=" .. d, "output=" .. d .. "/plots2"))
    assert.is_true(is_png(d .. "/plots2/loss.png"))
  end)

  it("names the Debian package when gnuplot is missing, and a missing file", function()
    local saved = plot.gnuplot_available
    plot.gnuplot_available = function() return false end
    local ok, err = pcall(plot.render, d .. "/metrics.jsonl", d .. "/plots3")
    plot.gnuplot_available = saved
    assert.is_false(ok)
    assert.matches("gnuplot is not installed %(Debian package 'gnuplot'", err)
    ok, err = pcall(plot.render, d .. "/nothing.jsonl", d .. "/plots3")
    assert.is_false(ok)
    assert.matches("cannot open '.*nothing%.jsonl'", err)
  end)
end)

describe("moe-lua train / sample commands", function()
  it("reject bad arguments clearly", function()
    local cli_train = require "moe.cli.train"
    local cli_sample = require "moe.cli.sample"
    assert.is_string(cli_train.summary)
    assert.are.equal(1, cli_train.main("positional"))
    assert.has_error(function() cli_train.main("stepz=3") end)
    local ok, err = pcall(cli_train.main, "stepz=3")
    assert.is_false(ok)
    assert.matches("unknown key 'stepz'", err)
    assert.are.equal(1, cli_sample.main("out_dir=" .. root .. "/no_such_run"))
    ok, err = pcall(cli_sample.main, "kv_cache=maybe")
    assert.is_false(ok)
    assert.matches("kv_cache expects a boolean, got 'maybe'", err)
  end)
end)

describe("checkpoint", function()
  local function sd(v) return { w = moe.full({ 2, 3 }, v), b = moe.full({ 3 }, -v) } end

  it("keeps the last N and lists complete checkpoints only", function()
    local d = fresh_dir()
    for s = 1, 5 do checkpoint.save(d, s * 10, { model = sd(s), state = {} }, { keep_last = 2 }) end
    assert.are.same({ 40, 50 }, checkpoint.list(d))
    assert.are.equal(d .. "/ckpt-50", checkpoint.latest(d))
    assert.is_true(os.execute("mkdir -p " .. sh_quote(d .. "/ckpt-60"))) -- no state.json: incomplete
    assert.are.same({ 40, 50 }, checkpoint.list(d))
    local c = checkpoint.load(d .. "/ckpt-50")
    assert.are.same({ { 5, 5, 5 }, { 5, 5, 5 } }, c.model.w:totable())
  end)

  it("a failed write leaves the previous checkpoint intact and no partial folder", function()
    local d = fresh_dir()
    checkpoint.save(d, 1, { model = sd(1), state = { note = "first" } })
    -- fails in moe.save (a non-tensor value), before any rename
    local ok, err = pcall(checkpoint.save, d, 2, { model = { w = moe.ones({ 2 }), bad = 5 } })
    assert.is_false(ok)
    assert.matches("cannot write the checkpoint of step 2", err)
    -- fails after both safetensors files were written (state not JSON-encodable)
    ok, err = pcall(checkpoint.save, d, 2, { model = sd(2), state = { f = print } })
    assert.is_false(ok)
    assert.matches("json.encode: cannot encode a function", err)
    -- overwriting step 1 fails: the old ckpt-1 is still the complete original
    ok = pcall(checkpoint.save, d, 1, { model = sd(9), state = { f = print } })
    assert.is_false(ok)
    assert.are.same({ "ckpt-1" }, ls(d))
    local c = checkpoint.load(d .. "/ckpt-1")
    assert.are.equal("first", c.state.note)
    assert.are.same({ -1, -1, -1 }, c.model.b:totable())
    -- a successful overwrite replaces it
    checkpoint.save(d, 1, { model = sd(3), state = { note = "second" } })
    assert.are.same({ "ckpt-1" }, ls(d))
    assert.are.equal("second", checkpoint.load(d .. "/ckpt-1").state.note)
  end)

  -- The real client, where Python's safetensors is installed (as in safetensors_spec.lua).
  local function find_python()
    local home = os.getenv("XDG_CACHE_HOME") or ((os.getenv("HOME") or "/root") .. "/.cache")
    for _, py in ipairs({ os.getenv("MOE_PYTHON") or false, home .. "/moe-lua/pyvenv/bin/python3", "python3" }) do
      if py and os.execute(sh_quote(py) .. ' -c "import safetensors, numpy" >/dev/null 2>&1') then return py end
    end
  end
  local python = find_python()
  local client = python and it or pending
  client("model and optimizer files load with Python's safetensors", function()
    local d = fresh_dir()
    local r = train.run(cfg { out_dir = d, steps = 2 }, parts())
    local script = "import sys; from safetensors.numpy import load_file\n" ..
      "for f in sys.argv[1:]:\n" ..
      "    d = load_file(f)\n" ..
      "    print(' '.join('%s:%s:%s' % (k, 'x'.join(map(str, v.shape)), v.dtype) for k, v in sorted(d.items())))\n"
    local p = io.popen(sh_quote(python) .. " -c " .. sh_quote(script) .. " " .. sh_quote(r.checkpoint ..
      "/model.safetensors") .. " " .. sh_quote(r.checkpoint .. "/optim.safetensors") .. " 2>&1")
    local out = p:read("a")
    p:close()
    assert.are.equal("emb.weight:32x16:float32 head.weight:32x16:float32 router.weight:4x16:float32\n" ..
      "emb.weight.momentum:32x16:float32 head.weight.momentum:32x16:float32 router.weight.momentum:4x16:float32\n",
      out)
  end)

  it("reports corrupt and missing checkpoints clearly", function()
    local d = fresh_dir()
    local p = checkpoint.save(d, 1, { model = sd(1), state = {} })
    local f = assert(io.open(p .. "/state.json", "w")); f:write("{\"step\": 1,"); f:close()
    local ok, err = pcall(checkpoint.load, p)
    assert.is_false(ok)
    assert.matches("'.*state%.json' is corrupt", err) -- its digest, recorded in digests.txt
    p = checkpoint.save(d, 2, { model = sd(1), state = {} })
    f = assert(io.open(p .. "/model.safetensors", "w")); f:write("garbage"); f:close()
    ok, err = pcall(checkpoint.load, p)
    assert.is_false(ok)
    assert.matches("'.*ckpt%-2/model%.safetensors' is corrupt", err)
    ok, err = pcall(checkpoint.load, d .. "/none")
    assert.is_false(ok)
    assert.matches("has no state.json", err)
  end)
end)

describe("metrics", function()
  it("JSON round-trips integers, floats, strings, nesting", function()
    local v = { a = 1, b = -0.1, c = "x\"y\n\1é", d = { 1, 2, { 3 } }, e = true, big = math.maxinteger,
      neg = math.mininteger, f = 1e300, g = 3.0, h = {} }
    local back = metrics.json.decode(metrics.json.encode(v))
    assert.are.same(v, back)
    assert.are.equal("float", math.type(back.g))
    assert.are.equal("integer", math.type(back.big))
    assert.are.equal('{"a":[1,2.5,null],"b":"\\u0001"}', metrics.json.encode { a = { 1, 2.5, 0 / 0 }, b = "\1" })
    assert.has_error(function() metrics.json.decode("{\"a\":1,}") end,
      "json.decode: object key expected at character 8")
  end)

  it("formats the console line, balance, MFU peak table and progress bar", function()
    local line = metrics.console_line { iteration = 20, iterations = 100, consumed_tokens = 2560,
      ms_per_iter = 12.5, lr = 3e-4, loss = 2.5, grad_norm = 0.75, tokens_per_s = 10240, mfu = 0.4,
      load_balance = 1.25 }
    assert.are.equal(" iteration  20/100 | consumed tokens: 2560 | elapsed time per iteration (ms): 12.5 | " ..
      "learning rate: 3.000E-04 | lm loss: 2.500000E+00 | grad norm: 0.750 | tokens/s: 10240 | MFU: 40.0% | " ..
      "expert load max/mean: 1.250 |", line)
    assert.are.equal(2.0, metrics.load_balance { 0, 4, 2, 2 })
    assert.are.equal(1.0, metrics.load_balance { 3, 3 })
    assert.is_nil(metrics.load_balance { 0, 0 })
    assert.are.equal(989e12, metrics.peak_flops_for("NVIDIA H100 80GB HBM3", "bf16"))
    assert.are.equal(989e12, metrics.peak_flops_for("NVIDIA H200", "bf16"))
    assert.is_nil(metrics.peak_flops_for("cpu", "f32"))
    assert.are.equal("[###.......]  30% 3/10 ETA 1m10s", metrics.progress(3, 10, 30, 10))
  end)
end)

describe("sample", function()
  it("greedy picks the argmax; top_k=1 is greedy; temperature and top_k are checked", function()
    local logits = moe.tensor({ 0.1, 3.0, -1.0, 2.9 })
    assert.are.equal(1, sample.pick(logits, { temperature = 0 }))
    for _ = 1, 5 do assert.are.equal(1, sample.pick(logits, { top_k = 1 })) end
    -- top_k = 2 only ever gives ids 1 or 3
    for _ = 1, 20 do
      local id = sample.pick(logits, { top_k = 2, temperature = 1.0 })
      assert.is_true(id == 1 or id == 3)
    end
    assert.has_error(function() sample.pick(logits, { temperature = -1 }) end,
      "sample: temperature must be a number >= 0, got -1")
    assert.has_error(function() sample.pick(logits, { top_k = 1.5 }) end,
      "sample: top_k must be an integer >= 0, got 1.5")
  end)

  it("generates max_new_tokens ids reproducibly under a seed, cutting the context", function()
    local m = tiny_model()
    moe.manual_seed(5)
    local a = sample.generate(m, { 1, 2, 3 }, { max_new_tokens = 12, seq_len = 4, top_k = 5 })
    moe.manual_seed(5)
    local b = sample.generate(m, { 1, 2, 3 }, { max_new_tokens = 12, seq_len = 4, top_k = 5 })
    assert.are.equal(12, #a)
    assert.are.same(a, b)
    assert.is_true(m.training) -- mode restored
    assert.has_error(function() sample.generate(m, {}, {}) end,
      "bad argument #2 to 'sample.generate' (non-empty array of token ids expected)")
  end)
end)

-- A real tiny dMoE TransformerLM through train.run's builder and moe.optim's AdamW.
describe("train.run with moe.nn and moe.layers", function()
  it("trains a tiny dMoE LM and resumes it exactly", function()
    local model_cfg = { vocab_size = V, d_model = 16, n_layers = 2, n_heads = 2,
      moe = { num_experts = 4, top_k = 2, ffn_hidden_size = 16,
        mlp_impl = "grouped" } }
    local function run(over)
      local c = cfg(over)
      c.model = model_cfg
      c.lr, c.warmup, c.min_lr = 1e-2, 0, 1e-3
      local p = parts()
      p.model = nil
      p.optimizer, p.clip_grad_norm = nil, nil
      return train.run(c, p)
    end
    local d1, d2 = fresh_dir(), fresh_dir()
    local full = run { out_dir = d1, steps = 6 }
    run { out_dir = d2, steps = 6, stop_at = 3 }
    local second = run { out_dir = d2, steps = 6, resume = "latest" }
    for s = 4, 6 do assert.are.equal(full.losses[s], second.losses[s], "step " .. s) end
    assert.is_true(full.losses[6] < full.losses[1])
    local recs = metrics.read_jsonl(d1 .. "/metrics.jsonl")
    local counts = recs[1].expert_counts["blocks.0.ffn"]
    assert.are.equal(4, #counts)
    local total = 0
    for _, n in ipairs(counts) do total = total + n end
    assert.are.equal(2 * 4 * 8 * 2, total) -- 2 steps of B*S tokens, top-2
    -- the checkpoint rebuilds the model for sampling
    local m, mcfg = train.load_model(d1 .. "/ckpt-6", "cpu")
    assert.are.equal(16, mcfg.model.d_model)
    assert.is_false(m.training)
    assert.are.equal(7, #sample.generate(m, { 1, 2 }, { max_new_tokens = 7, seq_len = 8 }))
  end)
end)

-- The same through train.run's data builder (IndexedDataset + GPTDataset, whose state()
-- goes into the checkpoint) on a small preprocessed text.
describe("train.run with moe.data", function()
  it("trains on a preprocessed text and resumes exactly, then samples from the checkpoint", function()
    local data = require "moe.data"
    local txt = root .. "/corpus.txt"
    local f = assert(io.open(txt, "w"))
    for i = 1, 60 do f:write(("line %d: in the beginning was the word, and the word was %d.\n"):format(i, i * 7)) end
    f:close()
    local prefix = data.preprocess { inputs = { txt }, output_prefix = root .. "/corpus", tokenizer = "byte" }
    local function run(over)
      local c = cfg(over)
      c.data = prefix
      c.valid_fraction = 0.1
      c.model = { d_model = 16, n_layers = 1, n_heads = 2,
        moe = { num_experts = 4, top_k = 1, ffn_hidden_size = 16, mlp_impl = "grouped" } }
      c.warmup = 0
      return train.run(c)
    end
    local d1, d2 = fresh_dir(), fresh_dir()
    local full = run { out_dir = d1, steps = 6, sample_tokens = 10, sample_prompt = "line" }
    run { out_dir = d2, steps = 6, stop_at = 3 }
    local second = run { out_dir = d2, steps = 6, resume = "latest" }
    for s = 4, 6 do assert.are.equal(full.losses[s], second.losses[s], "step " .. s) end
    assert.is_number(full.val_losses[6])
    assert.are.equal(full.val_losses[6], second.val_losses[6])
    assert.are.equal("line", full.sample:sub(1, 4)) -- the prompt, then up to 10 bytes (EOD left out)
    assert.is_true(#full.sample > 4 and #full.sample <= 14)
    local c = checkpoint.load(d2 .. "/ckpt-6")
    assert.is_table(c.state.data)
  end)
  it("a missing dataset prefix is a clear error", function()
    local ok, err = pcall(train.run, cfg { data = root .. "/nothing", out_dir = fresh_dir(),
      model = { d_model = 16, n_layers = 1, n_heads = 2 } })
    assert.is_false(ok)
    assert.matches("train: data='.*nothing': no dataset .*nothing%.bin / .*nothing%.idx", err)
  end)
end)

describe("experiments/ladder.lua", function()
  local ladder = dofile("experiments/ladder.lua")
  it("has MegaBlocks' nine rows", function()
    local want = { ["46m"] = { 6, 512, 6e-4 }, ["125m"] = { 12, 768, 6e-4 }, ["356m"] = { 24, 1024, 3e-4 } }
    for size, w in pairs(want) do
      for _, kind in ipairs({ "dense", "dmoe", "moe" }) do
        local c = ladder.config(size, kind)
        assert.are.same({ w[1], w[2], 1024, w[3] }, { c.model.n_layers, c.model.d_model, c.seq_len, c.lr })
        assert.are.equal(kind == "dense" and "dense" or "moe", c.model.ffn)
        assert.are.equal(4 * w[2], c.model.d_ff)
        if kind ~= "dense" then
          assert.are.same({ 64, 1, 4 * w[2] }, { c.model.moe.num_experts, c.model.moe.top_k, c.model.moe.ffn_hidden_size })
          assert.are.equal(kind == "moe" and "moe" or "dmoe", c.model.moe.kind)
        end
      end
    end
    assert.has_error(function() ladder.config("1b", "dmoe") end, "ladder: size must be 46m, 125m or 356m, got '1b'")
    assert.has_error(function() ladder.config("46m", "mlp") end, "ladder: kind must be dense, dmoe or moe, got 'mlp'")
  end)

  it("trains each kind end to end, shrunk to a few steps on the CPU", function()
    local host = (os.getenv("MOE_BUILD_DIR") or "build") .. "/moe-lua"
    local data = require "moe.data"
    local txt = root .. "/ladder.txt"
    local f = assert(io.open(txt, "w"))
    for i = 1, 80 do f:write(("verse %d: and the evening and the morning were the day %d.\n"):format(i, i)) end
    f:close()
    local prefix = data.preprocess { inputs = { txt }, output_prefix = root .. "/ladder", tokenizer = "byte" }
    for _, kind in ipairs({ "dense", "dmoe", "moe" }) do
      local out = fresh_dir()
      local cmd = table.concat({ sh_quote(host), "experiments/ladder.lua", "size=46m", "kind=" .. kind,
        "data=" .. sh_quote(prefix), "device=cpu", "dtype=f32", "steps=2", "seq_len=16", "batch_size=2",
        "model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.moe.num_experts=4",
        "model.moe.ffn_hidden_size=64", "eval_every=0", "save_every=0", "log_every=1", "warmup=1",
        "sample_tokens=0", "out_dir=" .. sh_quote(out), "2>&1" }, " ")
      local p = io.popen(cmd)
      local text = p:read("a")
      local ok = p:close()
      assert.is_true(ok, text)
      assert.matches("iteration +2/2", text)
      local lines = 0
      for _ in io.lines(out .. "/metrics.jsonl") do lines = lines + 1 end
      assert.is_true(lines >= 2)
    end
  end)
end)

describe("cleanup", function()
  it("removes the spec's folder", function()
    assert.is_true(os.execute("rm -rf " .. sh_quote(root)))
  end)
end)
