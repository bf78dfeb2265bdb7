--[[
tests/lua/train_parallel_spec.lua - data parallelism in one process: the
config checks of parallel.dp and parallel.bucket_mb, moe.train.parallel's
helpers in a world of one, and moe.dist.reducer where all_reduce is the
identity (gradients unchanged bit for bit, .grad views of the buckets, the
bucket count, errors). The multi-rank test is tests/dist/dp_equivalence.lua.
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
