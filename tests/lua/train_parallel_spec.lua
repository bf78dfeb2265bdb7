--[[
tests/lua/train_parallel_spec.lua - data parallelism in one process: the
config checks of parallel.dp and parallel.bucket_mb, moe.train.parallel's
helpers in a world of one, and moe.dist.reducer where all_reduce is the
identity (gradients unchanged bit for bit, .grad views of the buckets, the
bucket count, errors). The multi-rank test is tests/dist/dp_equivalence.lua.
Also: the errors of invalid layouts a single process can raise (config and
setup checks, parallel.place's answers), and a layout trained in a world of
one (dp_shard = 1) against no layout; tests/dist/layouts.lua on 2 ranks.
]]
local moe = require "moe"
local train = require "moe.train"
local parallel = require "moe.train.parallel"

describe("parallel config", function()
  it("rejects a dp other than 1 or the world size, and bad bucket sizes", function()
    local world = tonumber(os.getenv("OMPI_COMM_WORLD_SIZE") or "1")
    local cfg = train.config { parallel = { dp = world + 1 }, steps = 1, warmup = 0 }
    assert.has_error(function() train.run(cfg) end,
      ("train: parallel.dp=%d but the job has %d rank%s: data parallelism spans every rank for now " ..
       "(launch %d ranks, or set parallel.dp=%d, or parallel.dp=1 to train each rank alone)"):format(
       world + 1, world, world == 1 and "" or "s", world + 1, world))
    local bad = train.config { parallel = { bucket_mb = -1 } }
    assert.has_error(function() require("moe.train.config").check(bad) end,
      "train: parallel.bucket_mb must be a number >= 0, got -1")
    assert.has_error(function() train.config { parallel = { dp = 1.5 } } end)
  end)

  it("rejects layouts that do not fit the job or each other, before anything starts", function()
    local function fails(over, msg)
      local ok, err = pcall(parallel.setup, train.config { parallel = over })
      assert.is_false(ok)
      assert.are.equal(msg, err)
    end
    fails({ ep = 2, dp_shard = 1 }, "train: parallel.ep=2 x parallel.etp=1 = 2 does not divide the job's 1 ranks")
    fails({ ep = 2 }, "train: parallel.ep=2 needs data parallelism over the job's ranks (launch a multiple " ..
      "of 2 ranks and leave parallel.dp=0)")
    fails({ etp = 2, dp_shard = 1 }, "train: parallel.ep=1 x parallel.etp=2 = 2 does not divide the job's 1 ranks")
    fails({ etp = 2 }, "train: parallel.etp=2 needs data parallelism over the job's ranks (launch a multiple " ..
      "of 2 ranks and leave parallel.dp=0)")
    fails({ dp_shard = 2 }, "train: parallel.dp_shard=2 x dp_replicate=1 = 2 but the job has 1 rank " ..
      "(their product must be the world size)")
  end)

  it("is one rank when started alone", function()
    local par = parallel.setup(train.config {})
    assert.are.equal(1, par.dp)
    assert.are.equal(0, par.rank)
    assert.is_true(par.writer)
    assert.are.same({ 1.5, 2 }, par:mean({ 1.5, 2 }))
    assert.is_nil(par:reducer({}))
    -- batch: the dataset's own batch
    local calls = {}
    local fake = { batch = function(_, B) calls[#calls + 1] = B; return B end }
    assert.are.equal(3, par:batch(fake, 3))
    assert.are.same({ 3 }, calls)
  end)
end)

describe("moe.dist.reducer in a world of one", function()
  local dist = moe.dist
  if not (dist and dist.reducer) then
    it("is not in this build", function() end)
    return
  end

  local function params()
    moe.manual_seed(3)
    local ps = {}
    for i, shape in ipairs({ { 4, 3 }, { 3 }, { 5, 2 }, { 7 } }) do
      ps[i] = (moe.randn(shape)):requires_grad_(true)
    end
    return ps
  end

  local function loss_of(ps)
    local a = (ps[1] * ps[2]):sum() -- (4, 3) * (3)
    local b = (ps[3] * ps[3]):sum()
    return a + b * 0.5 + (ps[1]:sum() * 2) -- ps[4] unused
  end

  it("leaves gradients unchanged, as views of its buckets", function()
    local ref = params()
    loss_of(ref):backward()
    local ps = params()
    local r = dist.reducer(ps, { bucket_mb = 0 })
    assert.are.equal(4, r:buckets())
    r:arm()
    loss_of(ps):backward()
    r:finish()
    for i = 1, 3 do assert.are.same(ref[i].grad:totable(), ps[i].grad:totable()) end
    assert.is_nil(ps[4].grad) -- no gradient on any rank: left nil
    assert.matches("moe.Reducer %(4 buckets%)", tostring(r))
    r:free()
    r:free() -- idempotent
    assert.matches("freed", tostring(r))
    assert.has_error(function() r:arm() end, "bad argument #1 to 'arm' (attempt to use a freed reducer)")
    local named = {}
    for i, p in ipairs(ps) do named[i] = { "p" .. i, p } end
    local r2 = dist.reducer(named, { bucket_mb = 1 })
    assert.are.equal(1, r2:buckets())
    r2:free()
  end)

  it("reports misuse", function()
    local ps = params()
    assert.has_error(function() dist.reducer(ps, { bucket = 1 }) end)
    assert.has_error(function() dist.reducer(ps, { bucket_mb = -1 }) end,
      "bad argument #2 to 'reducer' (bucket_mb must be a number in [0, 1e6], got -1)")
    assert.has_error(function() dist.reducer({ ps[1], 3 }) end,
      "bad argument #1 to 'reducer' (parameter 2 must be a tensor or {name, tensor}, got number)")
    assert.has_error(function() dist.reducer({ ps[1], ps[1] }) end,
      "bad argument #1 to 'reducer' (parameters 0 and 1 are the same tensor (list each once))")
    local r = dist.reducer(ps)
    assert.has_error(function() r:finish() end)
    r:arm()
    assert.has_error(function() r:arm() end)
    local other = dist.reducer({ ps[2] })
    assert.has_error(function() other:arm() end)
    r:finish()
    other:arm()
    other:finish()
    do
      local closed <close> = dist.reducer(ps)
      closed:arm() -- freed (and disarmed) when the block ends
    end
    r:arm()
    r:free()
    other:free()
  end)
end)

describe("parameter sharding in a world of one", function()
  local dist = moe.dist
  if not (dist and dist.fsdp_unit) then
    it("is not in this build", function() end)
    return
  end

  it("puts each group in one bucket, and reports misuse of groups", function()
    local ps = {}
    for i, shape in ipairs({ { 4, 3 }, { 3 }, { 5, 2 }, { 7 } }) do ps[i] = moe.randn(shape):requires_grad_(true) end
    local r = dist.reducer(ps, { mode = "reduce_scatter", groups = { 1, 2, 1, 2 } })
    assert.are.equal(2, r:buckets())
    local lay = r:layout()
    assert.are.equal(lay.params[1].bucket, lay.params[3].bucket)
    assert.are.equal(lay.params[2].bucket, lay.params[4].bucket)
    assert.are_not.equal(lay.params[1].bucket, lay.params[2].bucket)
    r:free()
    assert.has_error(function() dist.reducer(ps, { groups = { 1, 2 } }) end,
      "bad argument #2 to 'reducer' (groups must be a list of 4 group numbers (one per parameter), got table)")
    assert.has_error(function() dist.reducer(ps, { groups = { 1, 0, 1, 1 } }) end,
      "bad argument #2 to 'reducer' (groups[2] must be an integer >= 1, got 0)")
    assert.has_error(function() dist.reducer(ps, { units = {} }) end,
      "bad argument #2 to 'reducer' (units needs groups (the bucket of each parameter))")
    local mixed = { ps[1], moe.randn({ 3 }, { dtype = "f64" }):requires_grad_(true) }
    assert.has_error(function() dist.reducer(mixed, { groups = { 1, 1 } }) end)
  end)

  it("frees a unit's data between uses and gathers it again for backward", function()
    local flat = moe.keep(moe.zeros({ 6 }))
    local shard = moe.keep(moe.tensor({ 1, 2, 3, 4, 5, 6 }, { dtype = "f32" }))
    local u = dist.fsdp_unit(flat, shard)
    assert.matches("gathered", tostring(u))
    local w = flat:narrow(0, 0, 6):view({ 2, 3 }):requires_grad_(true)
    u:release()
    assert.is_false(u:ready())
    u:gather()
    assert.is_true(u:ready())
    assert.are.same({ { 1, 2, 3 }, { 4, 5, 6 } }, w:totable())
    local x = moe.tensor({ { 1, 1 } }, { dtype = "f32" })
    local y = moe.matmul(x, w) -- saves w for backward
    u:release() -- as after a block's forward
    local before = u:gathers()
    y:sum():backward() -- reads w: the unit is gathered by autograd
    assert.are.equal(before + 1, u:gathers())
    assert.are.same({ { 1, 1, 1 }, { 1, 1, 1 } }, w.grad:totable())
    assert.are.same({ { 1, 2, 3 }, { 4, 5, 6 } }, w:detach():totable())
    assert.has_error(function() dist.fsdp_unit(flat, shard) end)
    assert.has_error(function() dist.fsdp_unit(flat, moe.zeros({ 5 })) end)
    u:free()
    u:free()
    assert.has_error(function() u:gather() end, "bad argument #1 to 'gather' (attempt to use a freed fsdp unit)")
  end)

  it("trains with shard_params as without (dp_shard = 1)", function()
    local data
    local function run(par, dir)
      return train.run(train.config {
        model = { d_model = 16, n_layers = 2, n_heads = 2, ffn = "dense", d_ff = 32 },
        data = data, valid_fraction = 0.1, seq_len = 8, batch_size = 2, steps = 3, warmup = 0, eval_every = 0,
        log_every = 1, tensorboard = false, quiet = true, sample_tokens = 0, clip = 0,
        out_dir = dir, overwrite = true, parallel = par })
    end
    local tmp = os.tmpname()
    os.remove(tmp)
    assert(os.execute("mkdir -p '" .. tmp .. "-d'"))
    local prefix = tmp .. "-d/words"
    local bld = require("moe.data").IndexedDatasetBuilder(prefix, { dtype = "u16" })
    for d = 1, 20 do
      local ids = {}
      for j = 1, 40 do ids[j] = (d * 7 + j * 13) % 200 end
      ids[#ids + 1] = 256
      bld:add_document(ids)
    end
    bld:finalize()
    data = prefix
    local a = run({ dp_shard = 1 }, tmp .. "-a")
    local b = run({ dp_shard = 1, shard_params = true }, tmp .. "-b")
    assert.are.same(a.losses, b.losses)
    local sa, sb = a.model:state_dict(), b.model:state_dict()
    for k, t in pairs(sa) do assert.are.same(t:totable(), sb[k]:totable(), k) end
    os.execute("rm -rf '" .. tmp .. "-a' '" .. tmp .. "-b' '" .. tmp .. "-d'")
  end)
end)

describe("invalid layouts", function()
  it("are errors before training: dims the model or the job cannot use", function()
    local tconfig = require "moe.train.config"
    local function check_fails(over, msg)
      local ok, err = pcall(tconfig.check, train.config(over))
      assert.is_false(ok)
      assert.are.equal("train: " .. msg, err)
    end
    check_fails({ parallel = { ep = 3 } }, "parallel.ep=3 does not divide model.moe.num_experts=8")
    check_fails({ parallel = { etp = 3 } }, "parallel.etp=3 does not divide model.moe.ffn_hidden_size=256")
    check_fails({ parallel = { etp = 2 }, model = { moe = { kind = "moe" } } },
      "parallel.etp=2 needs model.moe.kind=dmoe (the capacity layer does not split its experts)")
    local function setup_fails(over, msg)
      local ok, err = pcall(parallel.setup, train.config(over))
      assert.is_false(ok)
      assert.are.equal(msg, err)
    end
    setup_fails({ parallel = { dp_replicate = 2 } }, "train: parallel.dp_replicate=2 needs parallel.dp_shard " ..
      "(the ranks each replica is sharded over)")
    setup_fails({ parallel = { dp_shard = 1, dp = 2 } }, "train: parallel.dp=2 with dp_shard=1 x dp_replicate=1: " ..
      "data parallelism spans the 1 ranks (leave dp at 0)")
    setup_fails({ parallel = { dp_shard = 1 }, optimizer = "sgd" }, "train: parallel.dp_shard needs " ..
      "optimizer=adamw (the sharded optimizer is AdamW), got sgd")
    setup_fails({ parallel = { shard_params = true } }, "train: parallel.shard_params=true needs " ..
      "parallel.dp_shard (the ranks the parameters are sharded over)")
    setup_fails({ parallel = { dp_shard = 2, dp_replicate = 2 } }, "train: parallel.dp_shard=2 x dp_replicate=2 " ..
      "= 4 but the job has 1 rank (their product must be the world size)")
  end)
end)

describe("layouts as Lua functions (parallel.place)", function()
  local build = require "moe.train.build"
  local function model_of(tie)
    moe.manual_seed(1)
    return build.model(train.config { model = { d_model = 16, n_layers = 2, n_heads = 2, tie_embeddings = tie,
      moe = { num_experts = 4, top_k = 2, ffn_hidden_size = 16 } }, device = "cpu" }, "cpu")
  end
  -- a par as expert parallelism over 2 ranks would make it: the experts' weights are expert shards
  local function par_of(model, o)
    o = o or {}
    local par = { sharded = o.sharded ~= false, shards = o.shards or 2, ep = o.shards or 2, etp = 1,
      expert_set = {} }
    if par.shards > 1 then
      for _, np in ipairs(model:named_parameters()) do
        if np[1]:match("experts%.w%d$") then par.expert_set[np[2]] = true end
      end
    end
    return par
  end
  local function place_fails(layout, msg, o, tie)
    local m = model_of(tie)
    local ok, err = pcall(parallel.place, m, layout, par_of(m, o))
    assert.is_false(ok)
    assert.are.equal("train: " .. msg, err)
  end

  it("places each module: units, replicated parameters, experts", function()
    local m = model_of(false)
    local pl = parallel.place(m, function(name, mod)
      if mod.__name == "CausalSelfAttention" then return "shard" end
      if name:match("%.experts$") then return "expert" end
    end, par_of(m))
    assert.are.same({ "blocks.0.attn", "blocks.1.attn" }, pl.unit_names)
    assert.are.equal(4, pl.experts)
    local n_rep, n_unit = 0, 0
    for _, np in ipairs(m:named_parameters()) do
      if pl.replicated[np[2]] then n_rep = n_rep + 1 end
      if pl.assign[np[2]] then
        n_unit = n_unit + 1
        assert.matches("^blocks%.%d%.attn%.", np[1])
      end
    end
    assert.are.equal(4, n_unit) -- qkv and proj weights of two blocks
    assert.are.equal(#m:named_parameters() - 4 - 4, n_rep)
    -- the experts stay expert shards under a sharded block, without an answer of their own
    local pl2 = parallel.place(m, function(name) if name:match("^blocks%.%d$") then return "shard" end end, par_of(m))
    assert.are.same({ "blocks.0", "blocks.1" }, pl2.unit_names)
    assert.are.equal(4, pl2.experts)
  end)

  it("names the module of every answer it cannot use", function()
    place_fails(42, "the layout must be a function(name, module) -> \"replicate\" | \"shard\" | \"expert\" | nil, " ..
      "got a number")
    place_fails(function(name) if name == "ln_f" then return "sharded" end end,
      "the layout placed module 'ln_f' (LayerNorm) as 'sharded': expected \"replicate\", \"shard\", \"expert\" or " ..
      "nil (its parent's placement)")
    place_fails(function(name) if name == "ln_f" then return 1 end end,
      "the layout placed module 'ln_f' (LayerNorm) as 1: expected \"replicate\", \"shard\", \"expert\" or " ..
      "nil (its parent's placement)")
    place_fails(function(name) if name == "blocks.0.attn" then return "shard" end end,
      "the layout placed module 'blocks.0.attn' (CausalSelfAttention) as \"shard\", which needs " ..
      "parallel.dp_shard (the ranks its parameters are sharded over)", { sharded = false })
    place_fails(function(name) if name:match("experts$") then return "expert" end end,
      "the layout placed module 'blocks.0.ffn.experts' (MLPExperts) as \"expert\", but parallel.ep and " ..
      "parallel.etp are 1: no expert is sharded (set parallel.ep or etp)", { shards = 1 })
    place_fails(function(name) if name == "blocks.1.ffn" then return "expert" end end,
      "the layout placed module 'blocks.1.ffn' (dMoE) as \"expert\", but its parameter 'router.layer.weight' is " ..
      "not an expert shard (\"expert\" fits a module whose every parameter is an MoE layer's expert weight)")
    place_fails(function(name) if name == "drop" then return "expert" end end,
      "the layout placed module 'drop' (Dropout) as \"expert\", but it holds no parameter")
    place_fails(function(name) if name:match("experts$") then return "shard" end end,
      "the layout placed module 'blocks.0.ffn.experts' (MLPExperts) as \"shard\", but its 'w1' is an expert " ..
      "shard, spread over parallel.ep=2 x etp=1 when the model was built: answer \"expert\" (or nil)")
    place_fails(function(name) if name == "wte" then return "shard" end end,
      "the layout places the tied embeddings 'wte.weight' in the unit of 'wte', but the model's own forward " ..
      "reads them (the output projection): place 'wte' as \"replicate\", or leave it to the model's unit " ..
      "(\"\" answered \"shard\")", nil, true)
    local m = model_of(false)
    local ok, err = pcall(parallel.place, m, function(name) if name == "blocks.1" then error("boom", 0) end end,
      par_of(m))
    assert.is_false(ok)
    assert.are.equal("train: the layout failed on module 'blocks.1' (TransformerBlock): boom", err)
  end)

  it("trains as without a layout (dp_shard = 1 in a world of one)", function()
    local tmp = os.tmpname()
    os.remove(tmp)
    assert(os.execute("mkdir -p '" .. tmp .. "-d'"))
    local prefix = tmp .. "-d/words"
    local bld = require("moe.data").IndexedDatasetBuilder(prefix, { dtype = "u16" })
    for d = 1, 20 do
      local ids = {}
      for j = 1, 40 do ids[j] = (d * 7 + j * 13) % 200 end
      ids[#ids + 1] = 256
      bld:add_document(ids)
    end
    bld:finalize()
    local function run(layout, dir, hooks)
      return train.run(train.config {
        model = { d_model = 16, n_layers = 2, n_heads = 2, d_ff = 32, tie_embeddings = false,
          moe = { num_experts = 4, top_k = 2, ffn_hidden_size = 16 } },
        data = prefix, valid_fraction = 0.1, seq_len = 8, batch_size = 2, steps = 3, warmup = 0, eval_every = 0,
        log_every = 1, tensorboard = false, quiet = true, sample_tokens = 0, clip = 0,
        out_dir = dir, overwrite = true, parallel = { dp_shard = 1 } }, { layout = layout, hooks = hooks })
    end
    local a = run(nil, tmp .. "-a")
    local names, whole
    local b = run(function(name, mod)
      if mod.__name == "CausalSelfAttention" or name == "blocks.1.ffn" then return "shard" end
    end, tmp .. "-b", { after_step = function(state)
      names, whole = state.parallel.placement.unit_names, 0
      for _, u in pairs(state.parallel.fsdp.units) do if u.unit:ready() then whole = whole + 1 end end
    end })
    assert.are.same({ "blocks.0.attn", "blocks.1.attn", "blocks.1.ffn" }, names)
    assert.are.equal(0, whole)
    assert.are.same(a.losses, b.losses)
    local sa, sb = a.model:state_dict(), b.model:state_dict()
    for k, t in pairs(sa) do assert.are.same(t:totable(), sb[k]:totable(), k) end
    os.execute("rm -rf '" .. tmp .. "-a' '" .. tmp .. "-b' '" .. tmp .. "-d'")
  end)
end)
