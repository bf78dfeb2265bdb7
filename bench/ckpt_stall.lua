--[[
bench/ckpt_stall.lua - the checkpoints of one training run, measured in one
process (one job): the step time, a synchronous save, the verification and
the load of what it wrote, an asynchronous save's training stall and the
wait for its write, and the checkpoint's size, with the model built once:

  moe-lua bench/ckpt_stall.lua layout=single [d_model=256] [layers=4] ... json=A.json
  moe-lua launch -n 2 bench/ckpt_stall.lua layout=zero_ep ... json=B.json

One train.run of warm + measure + between + during steps (log_every 1); the
checkpoint work runs in its on_log hook, where the loop itself saves:
  steps 1..warm           warm-up (the first step's time is reported alone)
  the next `measure`      the step time (median): no save
  then a synchronous save what the loop does: one process, checkpoint.save
                         (model.safetensors, optim.safetensors, state.json,
                         digests.txt); several ranks, the loop's sharded save
                         (par:save_checkpoint: every rank writes its shard,
                         fsync, barrier, rank 0's commit): its seconds, of
                         which rank 0 spent hashing the files (digests.txt)
  verify                  checkpoint.verify on every rank at once: every file
                         read and hashed (what resume=latest does on every
                         rank, and checkpoint.load in one process)
  read                    par:load_checkpoint into the same model and
                         optimizer (the sharded resume's reader: each rank
                         reads the bytes of what it holds; a single-file
                         checkpoint is read whole through the same reader,
                         without a second copy on the device), the device
                         synchronised: seconds, bytes read per rank
  the checkpoint removed; `between` steps
  async                  saves with save_async (one process: the sharded format, one shard): the stall (the step's wait:
                         the copy of the rank's shards to host memory), the
                         `during` steps while the write runs (their median),
                         then the finish (the rest of the write, fsync, shard
                         lists, barrier, rank 0's commit with its digests);
                         async_saves > 1 repeats it (the later saves reuse
                         the host buffer: the steady stall); each checkpoint
                         is removed once committed
Only one checkpoint is on disk at any time. Rank 0 rewrites json= (and the
markdown beside it) after every phase, with "complete": false until the
end, so a run cut off by a time limit still leaves what it measured.

Keys: d_model, layers, heads, experts, top_k, ffn (the experts' hidden
size; 0: 2 d_model), seq_len, batch_size (per rank), dtype, activation, data
(a byte-vocabulary dataset prefix; default the tests' word corpus), device,
layout (single: one process, single-file checkpoints; dp, zero, ep, zero_ep:
sharded over the job), warm=2, measure=3, between=1, during=3,
async_saves=1 (0: none), sync=true (false: no synchronous save, verify or
read), verify=true, init=cpu (device: the experts' weights drawn on the
model's device, below), scratch (the checkpoints' folder).
]]
local moe = require "moe"
local bench = dofile((arg[0]:match("^(.*)/") or ".") .. "/lib.lua")
local train = require "moe.train"
local build = require "moe.train.build"
local tconfig = require "moe.train.config"
local checkpoint = require "moe.checkpoint"
local dcp = require "moe.train.dcp"
local t_start = moe.clock()
local cfg = bench.config { d_model = 256, layers = 4, heads = 4, experts = 8, top_k = 2, ffn = 0, seq_len = 64,
  batch_size = 4, dtype = "f32", activation = "gelu", data = "", layout = "single", device = "cpu", scratch = "",
  warm = 2, measure = 3, between = 1, during = 3, async_saves = 1, sync = true, verify = true, init = "cpu",
  title = "", repeats = 1, warmup = 0 }
local dist = moe.dist
local rank, world = dist.rank(), dist.world_size()
local K = dofile((arg[0]:match("^(.*)/") or ".") .. "/../tests/dist/trainkit.lua")
local root, prefix = K.corpus(rank)
local shared = cfg.scratch ~= "" and cfg.scratch or ("/tmp/moe-ckpt-stall-%s"):format(os.getenv("MASTER_PORT") or "x")
local function q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end
if rank == 0 then os.execute("rm -rf " .. q(shared)) end
dist.barrier()

local layouts = { dp = {}, zero = { dp_shard = world }, ep = { ep = world }, zero_ep = { dp_shard = world, ep = world },
  single = {} }
local par_cfg = layouts[cfg.layout]
if not par_cfg then error("ckpt_stall: layout=dp|zero|ep|zero_ep|single", 0) end
if (cfg.layout == "single") ~= (world == 1) then
  error(("ckpt_stall: layout=%s %s"):format(cfg.layout, world == 1 and
    "needs a job of several ranks (moe-lua launch -n N); alone: layout=single" or
    "is one process's: run it without moe-lua launch"), 0)
end
for _, k in ipairs({ "warm", "measure", "between", "during", "async_saves" }) do
  if math.type(cfg[k]) ~= "integer" or cfg[k] < 0 then error(("ckpt_stall: %s must be an integer >= 0"):format(k), 0) end
end
if cfg.warm < 1 or cfg.measure < 1 then error("ckpt_stall: warm and measure must be >= 1", 0) end
if cfg.init ~= "cpu" and cfg.init ~= "device" then error("ckpt_stall: init must be cpu or device", 0) end
local async_saves = cfg.async_saves
local on_gpu = cfg.device:match("^cuda") ~= nil

local function du(path)
  local p = io.popen("du -sb " .. q(path) .. " 2>/dev/null")
  local n = tonumber((p:read("a") or ""):match("^(%d+)")) or 0
  p:close()
  return n
end

-- the seconds f takes, the device synchronised after it
local function timed(f, device)
  local t0 = moe.clock()
  local res = f()
  if on_gpu then moe.cuda.synchronize(device) end
  return moe.clock() - t0, res
end

-- the seconds spent in module table t's function k while f runs (summed over its calls)
local function spent_in(t, k, f)
  local orig, spent = t[k], 0
  t[k] = function(...)
    local t0 = moe.clock()
    local res = table.pack(orig(...))
    spent = spent + (moe.clock() - t0)
    return table.unpack(res, 1, res.n)
  end
  local ok, err = pcall(f)
  t[k] = orig
  if not ok then error(err, 0) end
  return spent
end

-- {sum, max} over the ranks of each value
local function over_ranks(vals)
  if world == 1 then
    local s, m = {}, {}
    for i, v in ipairs(vals) do s[i], m[i] = v, v end
    return s, m
  end
  local n = #vals
  local t = moe.tensor((function()
    local x = {}
    for i = 1, n do x[i], x[n + i] = vals[i], vals[i] end
    return x
  end)(), { dtype = "f64" })
  local s, m = t:narrow(0, 0, n), t:narrow(0, n, n)
  dist.all_reduce(s, "sum")
  dist.all_reduce(m, "max")
  local r = t:totable()
  t:free()
  local sum, max = {}, {}
  for i = 1, n do sum[i], max[i] = r[i], r[n + i] end
  return sum, max
end

local function median(v) return #v > 0 and bench.median(v) or nil end

local ffn = cfg.ffn > 0 and cfg.ffn or 2 * cfg.d_model
local row = { layout = cfg.layout, ranks = world, complete = false, phases = bench.list {} }
local function phase(name, seconds)
  row.phases[#row.phases + 1] = { phase = name, seconds = seconds, at_s = moe.clock() - t_start }
end
local title = cfg.title ~= "" and cfg.title or ("checkpoints, %d rank%s, layout %s (%s)"):format(world,
  world == 1 and "" or "s", cfg.layout, cfg.device)
local function gib(b) return b and b / 2 ^ 30 or nil end
-- the JSON and markdown of what is measured so far (printed too when final)
local function write_out(final)
  if rank ~= 0 then return end
  row.ckpt_gib, row.read_gib, row.read_gib_max = gib(row.ckpt_bytes), gib(row.read_bytes), gib(row.read_bytes_max)
  row.read_gib_sum = gib(row.read_bytes_sum)
  local obj, md = bench.report(cfg, { title = title, on_gpu = on_gpu,
    device = on_gpu and (world > 1 and dist.device() or cfg.device) or "cpu",
    reference = "the step time without a save", results = { row },
    model = { d_model = cfg.d_model, layers = cfg.layers, heads = cfg.heads, experts = cfg.experts, top_k = cfg.top_k,
      ffn = ffn, seq_len = cfg.seq_len, batch_size = cfg.batch_size, dtype = cfg.dtype },
    notes = { "phases (seconds, and when each ended after the start): " .. (function()
      local s = {}
      for _, p in ipairs(row.phases) do s[#s + 1] = ("%s %.2f s (+%.1f)"):format(p.phase, p.seconds, p.at_s) end
      return table.concat(s, ", ")
    end)() },
    columns = { { "ranks", "ranks" }, { "layout", "layout" }, { "model build s", "build_s", "%.1f" },
      { "first step s", "first_step_s", "%.1f" }, { "step ms", "step_ms", "%.1f" },
      { "sync save s", "sync_save_s", "%.2f" }, { "of which hashing s", "sync_digest_s", "%.2f" },
      { "verify s", "verify_s", "%.2f" }, { "read s", "read_s", "%.2f" }, { "read GiB (rank 0)", "read_gib", "%.2f" },
      { "async stall s", "async_stall_s", "%.3f" }, { "async finish s", "async_finish_s", "%.2f" },
      { "step ms during the write", "step_ms_during", "%.1f" }, { "checkpoint GiB", "ckpt_gib", "%.2f" },
      { "complete", function(r) return tostring(r.complete) end } } })
  if final then io.write("\n", md) end
  if cfg.json ~= "" then
    for path, text in pairs({ [cfg.json] = bench.encode(obj), [cfg.json:gsub("%.json$", "") .. ".md"] = md }) do
      local f = assert(io.open(path .. ".tmp", "w"))
      f:write(text)
      f:close()
      assert(os.rename(path .. ".tmp", path))
    end
  end
end

local n_steps = cfg.warm + cfg.measure + cfg.between + async_saves * cfg.during
local over = {
  model = { d_model = cfg.d_model, n_layers = cfg.layers, n_heads = cfg.heads, d_ff = 4 * cfg.d_model, pos = "rope",
    moe = { kind = "dmoe", num_experts = cfg.experts, top_k = cfg.top_k, loss_weight = 0.01,
      ffn_hidden_size = ffn, activation = cfg.activation } },
  seq_len = cfg.seq_len, batch_size = cfg.batch_size, dtype = cfg.dtype, eval_every = 0, log_every = 1,
  deterministic = false, parallel = par_cfg, save_every = 0, keep_last = 0, save_async = false }
if cfg.data ~= "" then over.data = cfg.data end
local c = K.base_cfg({ steps = n_steps, device = cfg.device, loss_weight = 0.01 }, root, prefix, "run", "moe", over)
c.out_dir = shared .. "/run"

local step_times, during_times = {}, {}
local s_sync = cfg.warm + cfg.measure          -- the synchronous save, verify and read after this step
local s_async = s_sync + cfg.between           -- the first asynchronous save after this step
local async_done = 0

local function remove(path)
  dist.barrier()
  if rank == 0 and path then checkpoint.rm_rf(path) end
  dist.barrier()
end

local function rank_state(state)
  return { rng = moe.get_rng_state(), data = tconfig.plain(state.train_data:state()) }
end
local function state_tbl(state)
  return { consumed_tokens = state.consumed_tokens, skipped_steps = state.skipped_steps,
    config = tconfig.plain(state.cfg), optim_scalars = tconfig.plain(state.optimizer:state_scalars()) }
end

-- the synchronous save as the loop makes it; the checkpoint's path, the seconds, rank 0's hashing
local function sync_save(state)
  local par, step = state.parallel, state.step
  local path
  local digest_s = spent_in(moe, "file_digest", function()
    if par.distributed then
      if par.saver then par.saver.async = false end
      par.ckpt_opts.async = false
      path = par:save_checkpoint(step, state.model, state.optimizer, rank_state(state), state_tbl(state))
    else
      local rs = rank_state(state)
      local st = state_tbl(state)
      st.rng, st.data = rs.rng, rs.data
      path = checkpoint.save(c.out_dir, step, { model = state.model:state_dict(), optim = state.optimizer:state_dict(),
        state = st }, { keep_last = 0 })
    end
  end)
  return path, digest_s
end

local function measure_sync(state)
  local par = state.parallel
  local t0 = moe.clock()
  local path, digest_s = sync_save(state)
  row.sync_save_s = moe.clock() - t0
  row.sync_digest_s = digest_s
  row.step = state.step
  if rank == 0 then row.ckpt_bytes = du(path) end
  phase("sync save", row.sync_save_s)
  write_out()
  if cfg.verify then
    dist.barrier()
    local v = timed(function()
      local ok, why = checkpoint.verify(path)
      if not ok then error("ckpt_stall: the checkpoint just written does not verify: " .. tostring(why), 0) end
    end)
    local _, m = over_ranks({ v })
    row.verify_s, row.verify_s_max = v, m[1]
    phase("verify", v)
    write_out()
  end
  dist.barrier()
  local device = par.device or (on_gpu and cfg.device) or nil
  local r = timed(function() par:load_checkpoint(path, state.model, state.optimizer) end, device)
  local bytes = dcp.last_load and dcp.last_load.bytes or 0
  local s, m = over_ranks({ bytes, r })
  row.read_s, row.read_s_max = r, m[2]
  row.read_pieces_s = dcp.last_load and dcp.last_load.seconds -- the reads alone (the rest: the optimizer's scalars)
  row.read_bytes, row.read_bytes_sum, row.read_bytes_max = bytes, s[1], m[1]
  row.load_s = (row.verify_s or 0) + r
  phase("read", r)
  local rm = timed(function() remove(path) end)
  phase("remove", rm)
  write_out()
end

local function measure_async(state)
  local par = state.parallel
  par.ckpt_opts.async = true
  if par.saver then par.saver.async = moe.save_async ~= nil end
  par:save_checkpoint(state.step, state.model, state.optimizer, rank_state(state), state_tbl(state))
  local tm = par.saver.timings[#par.saver.timings]
  async_done = async_done + 1
  row.async_stalls = row.async_stalls or bench.list {}
  row.async_stalls[#row.async_stalls + 1] = tm.stall
  row.async_stall_s = tm.stall
  row.async_stall_first_s = row.async_stalls[1]
  phase("async save " .. async_done .. " (stall)", tm.stall)
  write_out()
  return tm
end

local function finish_async(state, tm)
  local par = state.parallel
  local t0 = moe.clock()
  local path = par.saver:finish()
  local f = moe.clock() - t0
  row.async_finish_s = f
  row.async_finishes = row.async_finishes or bench.list {}
  row.async_finishes[#row.async_finishes + 1] = f
  phase("async finish " .. async_done, f)
  if rank == 0 and path then row.async_ckpt_bytes = du(path) end
  local rm = timed(function() remove(path) end)
  phase("remove", rm)
  row.step_ms_during = median(during_times) and median(during_times) * 1e3
  write_out()
  return tm
end

-- the model's build, timed (the rest of the set-up is in the first step's time). init=device:
-- the experts' weights (moe/experts/mlp.lua draws them with moe.randn(shape), f32 on the
-- CPU, then the model moves) are drawn on the model's device instead: the same Philox
-- stream and Box-Muller transform (core/philox.h), so the same values up to the last bit
-- of log/sin/cos in double before the rounding to f32; a GPU draws 3.65 B of them in well
-- under a second where 16 CPU cores take tens of seconds. A build that fails that way is
-- made again the usual way (init_error says why).
local build_model = build.model
build.model = function(bcfg, device, ...)
  local t0 = moe.clock()
  local m
  if cfg.init == "device" then
    local randn = moe.randn
    moe.randn = function(shape, o)
      if o == nil then return randn(shape, { device = device }) end
      return randn(shape, o)
    end
    local ok, res = pcall(build_model, bcfg, device, ...)
    moe.randn = randn
    if ok then
      m, row.init = res, "device"
    else
      row.init_error = tostring(res)
      io.stderr:write("ckpt_stall: init=device failed (" .. row.init_error .. "): building on the CPU\n")
      moe.manual_seed(bcfg.seed)
    end
  end
  if not m then m, row.init = build_model(bcfg, device, ...), "cpu" end
  if on_gpu then moe.cuda.synchronize() end
  row.build_s = moe.clock() - t0
  phase("model build (init " .. row.init .. ")", row.build_s)
  return m
end

-- the parameters of the whole model (expert shards at their global shapes)
local function count_params(state)
  local names, n = {}, 0
  for _, np in ipairs(state.model:named_parameters()) do names["model." .. np[1]] = true end
  for _, p in ipairs(dcp.pieces(state.parallel, state.model, nil)) do
    if names[p.name] then
      local k = 1
      for _, d in ipairs(p.shape) do k = k * d end
      n = n + k
    end
  end
  return n
end

local pending_tm
local step_t0 -- when the step being timed began: the end of the previous on_log
local hooks = {
  on_log = function(state)
    local s = state.step
    local now = moe.clock()
    if s == 1 then
      row.first_step_s = now - t_start - (row.build_s or 0)
      phase("first step (with the set-up after the model build: optimizer, data, ranks)", row.first_step_s)
      row.params = count_params(state)
    elseif s > cfg.warm and s <= s_sync then
      step_times[#step_times + 1] = now - step_t0
    elseif pending_tm then
      during_times[#during_times + 1] = now - step_t0
    end
    if s == s_sync then
      row.step_ms = median(step_times) * 1e3
      phase(("%d steps"):format(cfg.measure), row.step_ms * cfg.measure / 1e3)
      if cfg.sync then measure_sync(state) end
    end
    if async_saves > 0 and s >= s_async and (s - s_async) % math.max(cfg.during, 1) == 0 then
      if pending_tm then
        finish_async(state, pending_tm)
        pending_tm = nil
      end
      if async_done < async_saves then pending_tm = measure_async(state) end
      if cfg.during == 0 and pending_tm then
        finish_async(state, pending_tm)
        pending_tm = nil
      end
    end
    step_t0 = moe.clock()
  end }

local ok, res = pcall(train.run, c, { hooks = hooks })
build.model = build_model
if not ok then
  if rank == 0 then row.error = tostring(res); write_out() end
  error(res, 0)
end
if pending_tm then error("ckpt_stall: an asynchronous save was left pending", 0) end
row.run_s = moe.clock() - t_start
row.complete = true
phase("train.run (every step and the work above)", res.seconds)
if rank == 0 then
  write_out(true)
  local function f(v, fmt) return v and fmt:format(v) or "-" end
  print(("ckpt_stall: %d rank%s, %s: step %s ms; sync save %s s (hashing %s s); verify %s s; read %s s (%s GiB on " ..
    "rank 0); async stall %s s, finish %s s; checkpoint %s GiB; model build %s s (init %s), first step %s s; " ..
    "run %.1f s"):format(world, world == 1 and "" or "s", cfg.layout, f(row.step_ms, "%.1f"),
    f(row.sync_save_s, "%.2f"), f(row.sync_digest_s, "%.2f"), f(row.verify_s, "%.2f"), f(row.read_s, "%.2f"),
    f(gib(row.read_bytes), "%.2f"), f(row.async_stall_s, "%.3f"), f(row.async_finish_s, "%.2f"),
    f(gib(row.ckpt_bytes or row.async_ckpt_bytes), "%.2f"), f(row.build_s, "%.1f"), tostring(row.init),
    f(row.first_step_s, "%.1f"), row.run_s))
end
dist.barrier()
if rank == 0 then os.execute("rm -rf " .. q(shared)) end
os.execute("rm -rf " .. q(root))
