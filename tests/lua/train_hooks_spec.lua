--[[
tests/lua/train_hooks_spec.lua - the hooks of moe.train (lua/moe/train/hooks.lua,
docs/TRAINING.md): the order in which the loop calls them, that a before_step
hook that scales the gradients is seen by clipping and the optimizer, that the
save hook runs at every checkpoint and can add to it or write it itself, that
load runs on resume, that tensors a hook sees are step intermediates (freed
with the step's scope), and that a bad hook name or value is a clear error.

A tiny bigram model (embedding then a linear head) and an in-memory dataset
keep each run under a second.
]]
local moe = require "moe"
local train = require "moe.train"
local checkpoint = require "moe.checkpoint"

local root = os.tmpname()
os.remove(root)
assert(os.execute("mkdir -p '" .. root .. "'"))
local n_dirs = 0
local function fresh_dir()
  n_dirs = n_dirs + 1
  return ("%s/run%d"):format(root, n_dirs)
end

local V, D, S = 16, 8, 6

local function bigram()
  local m = { training = true }
  m.emb = moe.randn({ V, D }):requires_grad_(true)
  m.head = moe.randn({ V, D }):requires_grad_(true)
  m.named = { { "emb", m.emb }, { "head", m.head } }
  function m:named_parameters() return self.named end
  function m:state_dict() return { emb = self.emb, head = self.head } end
  function m:load_state_dict(sd)
    moe.no_grad(function() self.emb:copy_(sd.emb); self.head:copy_(sd.head) end)
  end
  function m:train() self.training = true end
  function m:eval() self.training = false end
  function m:loss(x, y)
    local logits = moe.linear(moe.embedding(self.emb, x), self.head)
    local loss = moe.cross_entropy(logits:reshape(-1, V), y:reshape(-1))
    return loss, { lm_loss = loss:item(), aux_loss = 0, stats = {} }
  end
  return m
end

local function data(seed)
  local d = { pos = seed }
  function d:batch(B)
    local x, y = {}, {}
    for b = 1, B do
      x[b], y[b] = {}, {}
      for j = 1, S do
        local v = (self.pos * 7 + b * 3 + j) % V
        x[b][j], y[b][j] = v, (v + 1) % V
      end
    end
    self.pos = self.pos + 1
    return moe.tensor(x, { dtype = "i64" }), moe.tensor(y, { dtype = "i64" })
  end
  function d:state() return { pos = self.pos } end
  function d:set_state(s) self.pos = s.pos end
  return d
end

-- Plain SGD that records the sum of the gradients it is given at each step.
local function recording_sgd(named, cfg)
  local opt = { lr = cfg.lr, seen = {} }
  function opt:step()
    local total = 0
    moe.no_grad(function()
      for _, p in ipairs(named) do
        local g = p[2].grad
        if g then
          total = total + moe.sum(g * g):item()
          p[2]:copy_(p[2] - g * self.lr)
        end
      end
    end)
    self.seen[#self.seen + 1] = total
  end
  function opt.zero_grad()
    for _, p in ipairs(named) do p[2].grad = nil end
  end
  function opt.state_dict() return {} end
  function opt.state_scalars() return {} end
  function opt.load_state_dict() end
  return opt
end

local function cfg(over)
  local c = { lr = 0.1, warmup = 0, decay = "constant", seq_len = S, batch_size = 2, steps = 2,
    log_every = 1, eval_every = 2, eval_iters = 1, quiet = true, device = "cpu", seed = 5,
    sample_tokens = 0, keep_last = 2, tensorboard = false, clip = 0 }
  for k, v in pairs(over or {}) do c[k] = v end
  return c
end

local function parts(hooks, model)
  moe.manual_seed(3)
  return { model = model or bigram(), optimizer = recording_sgd, train_data = data(1),
    valid_data = data(100), hooks = hooks }
end

describe("train.run hooks", function()
  it("are called in order around backward, the optimizer step, logging, eval and saving", function()
    local calls = {}
    local function rec(name)
      return function(state)
        calls[#calls + 1] = ("%s@%d%s"):format(name, state.step, state.micro and ("." .. state.micro) or "")
      end
    end
    local hooks = {}
    for _, n in ipairs(train.hooks) do hooks[n] = rec(n) end
    train.run(cfg { out_dir = fresh_dir(), grad_accum = 2 }, parts(hooks))
    assert.are.same({
      "after_backward@0.1", "after_backward@0.2", "before_step@0.2", "after_step@1.2", "on_log@1",
      "after_backward@1.1", "after_backward@1.2", "before_step@1.2", "after_step@2.2", "on_log@2",
      "on_eval@2", "save@2",
    }, calls)
  end)

  it("run in list order when a key holds a list, and see the state of the loop", function()
    local order, seen = {}, {}
    local hooks = {
      after_step = {
        function() order[#order + 1] = "a" end,
        function(state)
          order[#order + 1] = "b"
          seen.lr, seen.gn, seen.loss = state.lr, state.grad_norm, state.lm_loss
          seen.model, seen.opt, seen.cfg = state.model, state.optimizer, state.cfg
        end,
      },
      on_log = function(_, rec) rec.extra_metric = 42 end,
    }
    local p = parts(hooks)
    local d = fresh_dir()
    local r = train.run(cfg { out_dir = d, steps = 1 }, p)
    assert.are.same({ "a", "b" }, order)
    assert.are.equal(0.1, seen.lr)
    assert.is_true(seen.gn > 0)
    assert.are.equal(r.losses[1], seen.loss)
    assert.are.equal(p.model, seen.model)
    assert.are.equal(1, #seen.opt.seen)
    assert.are.equal(1, seen.cfg.steps)
    -- what on_log added is written to metrics.jsonl
    local recs = require("moe.metrics").read_jsonl(d .. "/metrics.jsonl")
    assert.are.equal(42, recs[1].extra_metric)
  end)

  it("before_step can scale the gradients, and clipping and the optimizer see it", function()
    local function run(scale)
      local norms, opt
      local hooks = {
        before_step = function(state)
          if scale == 1 then return end
          moe.no_grad(function()
            for _, p in ipairs(state.params) do p.grad:copy_(p.grad * scale) end
          end)
        end,
        after_step = function(state)
          norms = norms or {}
          norms[#norms + 1] = state.grad_norm
          opt = state.optimizer
        end,
      }
      local p = parts(hooks)
      local w0 = p.model.emb:clone()
      train.run(cfg { out_dir = fresh_dir(), steps = 1 }, p)
      return norms[1], opt.seen[1], moe.sum((p.model.emb - w0):abs()):item()
    end
    local n1, g1, moved1 = run(1)
    local n2, g2, moved2 = run(2)
    local n0, g0, moved0 = run(0)
    assert.is_true(math.abs(n2 / n1 - 2) < 1e-5, ("grad norm %g vs %g"):format(n2, n1))
    assert.is_true(math.abs(g2 / g1 - 4) < 1e-4, ("sum of squares %g vs %g"):format(g2, g1))
    assert.is_true(moved1 > 0)
    assert.is_true(math.abs(moved2 / moved1 - 2) < 1e-4)
    assert.are.equal(0, n0)
    assert.are.equal(0, g0)
    assert.are.equal(0, moved0) -- zeroed gradients: the step changed nothing
  end)

  it("save is called at every checkpoint; it may add to it or write it itself", function()
    local saved = {}
    local d = fresh_dir()
    train.run(cfg { out_dir = d, steps = 4, save_every = 2, eval_every = 0 }, parts {
      save = function(state, ckpt)
        saved[#saved + 1] = state.step
        assert.is_table(ckpt.model)
        assert.is_table(ckpt.optim)
        ckpt.state.note = "hello " .. state.step
      end,
    })
    assert.are.same({ 2, 4 }, saved)
    local c = checkpoint.load(d .. "/ckpt-4")
    assert.are.equal("hello 4", c.state.note)
    assert.are.equal(4, c.state.step)

    -- a hook that writes the checkpoint itself returns its path; the loop writes nothing
    local d2 = fresh_dir()
    local r = train.run(cfg { out_dir = d2, steps = 2, eval_every = 0 }, parts {
      save = function(state) return d2 .. "/mine-" .. state.step end,
    })
    assert.are.equal(d2 .. "/mine-2", r.checkpoint)
    assert.is_nil(checkpoint.resolve(d2, "latest"))
  end)

  it("load is called with the checkpoint on resume, before it is applied", function()
    local d = fresh_dir()
    train.run(cfg { out_dir = d, steps = 2 }, parts())
    local got
    local r = train.run(cfg { out_dir = d, steps = 3, resume = "latest" }, parts {
      load = function(state, ckpt)
        got = { step = state.step, ckpt_step = ckpt.state.step, has_model = ckpt.model.emb ~= nil }
      end,
    })
    assert.are.same({ step = 0, ckpt_step = 2, has_model = true }, got)
    assert.are.equal(3, r.step)
  end)

  it("see step tensors that the step's scope frees afterwards", function()
    local loss
    local ok, err
    train.run(cfg { out_dir = fresh_dir(), steps = 1 }, parts {
      after_backward = function(state)
        assert.is_true(moe.is_tensor(state.loss))
        assert.are.equal(state.lm_loss, state.loss:item()) -- alive inside the step
        loss = state.loss
      end,
      on_log = function()
        ok, err = pcall(function() return loss:item() end)
      end,
    })
    assert.is_false(ok)
    assert.matches("attempt to use a freed tensor", err)
  end)

  it("reject an unknown name or a value that is not a function, naming the key", function()
    local ok, err = pcall(train.run, cfg { out_dir = fresh_dir() }, parts { after_backwards = function() end })
    assert.is_false(ok)
    assert.are.equal("train: unknown hook 'after_backwards' (valid hooks: load, after_backward, before_step, " ..
      "after_step, on_log, on_eval, save)", err)
    ok, err = pcall(train.run, cfg { out_dir = fresh_dir() }, parts { save = 3 })
    assert.is_false(ok)
    assert.are.equal("train: hook 'save' must be a function or a list of functions, got a number", err)
    ok, err = pcall(train.run, cfg { out_dir = fresh_dir() }, parts { before_step = { function() end, "x" } })
    assert.is_false(ok)
    assert.are.equal("train: hook 'before_step'[2] must be a function, got a string", err)
    ok, err = pcall(train.run, cfg { out_dir = fresh_dir() }, parts(42))
    assert.is_false(ok)
    assert.are.equal("train: hooks must be a table of name = function, got a number", err)
  end)
end)
