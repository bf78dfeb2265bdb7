--[[
bench/ckpt_stall.lua - checkpoints of a training run: the training stall of a
save (the seconds the step waits), synchronous against asynchronous
(save_async = true), the time to load one at resume, the bytes the ranks
read to load it, and its size on disk:

  moe-lua launch -n 2 bench/ckpt_stall.lua [d_model=256] [layers=4] [experts=8] [steps=12]
      [save_every=2] [layout=dp|zero|ep|zero_ep] json=bench/results/dist/ckpt_stall.json
  moe-lua bench/ckpt_stall.lua layout=single ...        (one process: single-file checkpoints)

A dMoE GPT (d_model, layers, heads, experts, top_k, ffn: the experts' hidden
size, default 2 d_model; seq_len, batch_size per rank, dtype, activation)
trains `steps` steps on the tests' word corpus (or data=PREFIX, a byte
vocabulary dataset) in each mode of modes= (default none,sync,load,async):
  none   no saves: the step time
  sync   a save every save_every steps, written before the step goes on
  load   a run that resumes the sync run's last checkpoint and trains one step:
         the load's time (dcp.load_pieces, or checkpoint.load for single-file
         checkpoints; the device synchronised after it) and the bytes read
  async  saves on a background thread (jobs of several ranks; not for layout=single)
Reported per mode: the median step time of the steps without a save, the
mean stall per save (sync: the write, fsync, barrier and commit; async: the
copy of the shards to host memory, plus the wait for the previous write and
its commit, shown on its own), the mean time of a save's finish (async: the
wait for its write, the barrier and the commit, when the next save or the
end of the run asks for it), the checkpoint's size (every rank's files), and
for load the seconds and bytes read (rank 0's, the sum and the largest over
the ranks). Each mode's checkpoints are removed once measured (keep_last=0
by default: no save at the end of a run, so a run of steps < 2 save_every
writes one checkpoint: what disk space allows for a large model).
layout: dp (every rank whole: rank 0 writes everything), zero (dp_shard =
world), ep (ep = world), zero_ep (dp_shard = world and ep = world), single.
Rank 0 reports; every rank's stall is its own (they are alike: the barrier).
]]
local moe = require "moe"
local bench = dofile((arg[0]:match("^(.*)/") or ".") .. "/lib.lua")
local train = require "moe.train"
local dcp = require "moe.train.dcp"
local checkpoint = require "moe.checkpoint"
local cfg = bench.config { d_model = 256, layers = 4, heads = 4, experts = 8, top_k = 2, ffn = 0, seq_len = 64,
  batch_size = 4, dtype = "f32", activation = "gelu", data = "", steps = 12, save_every = 2, keep_last = 0,
  layout = "dp", modes = "none,sync,load,async", device = "cpu", scratch = "", title = "", repeats = 1, warmup = 0 }
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
local par = layouts[cfg.layout]
assert(par, "layout=dp|zero|ep|zero_ep|single")
if (cfg.layout == "single") ~= (world == 1) then
  error(("ckpt_stall: layout=%s %s"):format(cfg.layout, world == 1 and
    "needs a job of several ranks (moe-lua launch -n N); alone: layout=single" or
    "is one process's: run it without moe-lua launch"), 0)
end
local modes = {}
for m in cfg.modes:gmatch("[^,]+") do
  assert(({ none = true, sync = true, load = true, async = true })[m], "modes: none, sync, load, async")
  if not (m == "async" and cfg.layout == "single") then modes[#modes + 1] = m end
end
local on_gpu = cfg.device:match("^cuda") ~= nil
local function sync_device()
  if on_gpu then moe.cuda.synchronize(world > 1 and dist.device() or cfg.device) end
end

-- the time of each call of module table t's function k while f runs
local function timed(t, k, f)
  local orig, spent = t[k], {}
  t[k] = function(...)
    local t0 = moe.clock()
    local res = table.pack(orig(...))
    sync_device()
    spent[#spent + 1] = moe.clock() - t0
    return table.unpack(res, 1, res.n)
  end
  local ok, err = pcall(f)
  t[k] = orig
  if not ok then error(err, 0) end
  return spent
end

local function du(path)
  local p = io.popen("du -sb " .. q(path) .. " 2>/dev/null")
  local n = tonumber((p:read("a") or ""):match("^(%d+)")) or 0
  p:close()
  return n
end

-- sum and max over the ranks of v
local function over_ranks(v)
  if world == 1 then return v, v end
  local t = moe.tensor({ v, v }, { dtype = "f64" })
  local s, m = t:narrow(0, 0, 1), t:narrow(0, 1, 1)
  dist.all_reduce(s, "sum")
  dist.all_reduce(m, "max")
  local r = t:totable()
  t:free()
  return r[1], r[2]
end

local last_sync -- the sync run's last checkpoint (what load resumes)
local function run(mode)
  local steps = mode == "load" and 0 or cfg.steps
  local over = {
    model = { d_model = cfg.d_model, n_layers = cfg.layers, n_heads = cfg.heads, d_ff = 4 * cfg.d_model, pos = "rope",
      moe = { kind = "dmoe", num_experts = cfg.experts, top_k = cfg.top_k, loss_weight = 0.01,
        ffn_hidden_size = cfg.ffn > 0 and cfg.ffn or 2 * cfg.d_model, activation = cfg.activation } },
    seq_len = cfg.seq_len, batch_size = cfg.batch_size, dtype = cfg.dtype, eval_every = 0,
    deterministic = false, parallel = par,
    save_every = (mode == "sync" or mode == "async") and cfg.save_every or 0,
    keep_last = (mode == "sync" or mode == "async") and cfg.keep_last or 0,
    save_async = mode == "async" }
  if cfg.data ~= "" then over.data = cfg.data end
  local c = K.base_cfg({ steps = steps, device = cfg.device, loss_weight = 0.01 }, root, prefix, mode, "moe", over)
  c.out_dir = shared .. "/" .. mode
  if mode == "load" then
    assert(last_sync, "modes: load needs sync before it")
    c.resume = last_sync
    c.steps = math.tointeger(last_sync:match("(%d+)$")) + 1
  end
  local times, t0, saver, n_params = {}, nil, nil, 0
  local res
  local hooks = {
    before_step = function()
      if not t0 then t0 = moe.clock() end
    end,
    after_step = function(state)
      saver = state.parallel.saver
      if n_params == 0 then for _, p in ipairs(state.params) do n_params = n_params + p:numel() end end
    end,
    on_log = function(state)
      local now = moe.clock()
      -- a save ends after its step's log: the interval to the next log holds it
      local had_save = c.save_every > 0 and state.step % c.save_every == 1 % c.save_every
      if state.step > 1 and not (had_save and state.step > 1) then times[#times + 1] = now - t0 end
      t0 = now
    end }
  local single_saves, loads = {}, {}
  local function go() res = train.run(c, { hooks = hooks }) end
  if cfg.layout == "single" then
    local function with_save() single_saves = timed(checkpoint, "save", go) end
    if mode == "load" then loads = timed(checkpoint, "load", with_save) else with_save() end
  elseif mode == "load" then
    loads = timed(dcp, "load_pieces", go)
  else
    go()
  end
  table.sort(times)
  local row = { mode = mode, layout = cfg.layout, ranks = world, params = n_params, seconds = res.seconds,
    step_ms = (times[(#times + 1) // 2] or 0) * 1e3 }
  if mode == "sync" or mode == "async" then
    local stalls, finishes = {}, {}
    if saver then
      for _, t in ipairs(saver.timings) do
        stalls[#stalls + 1] = t.stall
        if t.finish then finishes[#finishes + 1] = t.finish end
      end
      row.wait_ms = saver.saves > 0 and (saver.wait or 0) / saver.saves * 1e3 or 0
    else
      stalls = single_saves
    end
    local function mean(v)
      local s = 0
      for _, x in ipairs(v) do s = s + x end
      return #v > 0 and s / #v or nil
    end
    row.saves = #stalls
    row.stall_ms = (mean(stalls) or 0) * 1e3
    row.finish_ms = mean(finishes) and mean(finishes) * 1e3 or nil
    local path = res.checkpoint
    if rank == 0 and path then row.ckpt_bytes = du(path) end
    if mode == "sync" then last_sync = path end
  elseif mode == "load" then
    row.step_ms = nil -- one step after the load
    row.load_s = loads[1] or 0
    local bytes = cfg.layout == "single" and du(last_sync .. "/model.safetensors") + du(last_sync .. "/optim.safetensors")
      or dcp.last_load and dcp.last_load.bytes or 0
    row.read_bytes = bytes
    row.read_bytes_sum, row.read_bytes_max = over_ranks(bytes)
    local _, slowest = over_ranks(row.load_s)
    row.load_s_max = slowest
    if rank == 0 then row.ckpt_bytes = du(last_sync) end
  end
  dist.barrier()
  if rank == 0 and mode ~= "sync" then os.execute("rm -rf " .. q(c.out_dir)) end
  if rank == 0 and mode == "load" then os.execute("rm -rf " .. q(shared .. "/sync")) end
  dist.barrier()
  return row
end

local rows = {}
local order = { none = 1, sync = 2, load = 3, async = 4 }
table.sort(modes, function(a, b) return order[a] < order[b] end)
for _, mode in ipairs(modes) do rows[#rows + 1] = run(mode) end
if rank == 0 then os.execute("rm -rf " .. q(shared)) end
if rank == 0 then
  for _, r in ipairs(rows) do
    if r.ckpt_bytes then r.ckpt_mb = r.ckpt_bytes / 2 ^ 20 end
    if r.read_bytes_sum then r.read_mb_sum, r.read_mb_max = r.read_bytes_sum / 2 ^ 20, r.read_bytes_max / 2 ^ 20 end
    print(("%-6s step %s ms, stall per save %s ms (previous %s, finish %s) over %s saves, load %s s (slowest rank " ..
      "%s s) reading %s MiB (largest rank %s), checkpoint %s MiB, %d parameters, run %.2f s"):format(r.mode,
      r.step_ms and ("%.1f"):format(r.step_ms) or "-",
      r.stall_ms and ("%.1f"):format(r.stall_ms) or "-", r.wait_ms and ("%.1f"):format(r.wait_ms) or "-",
      r.finish_ms and ("%.1f"):format(r.finish_ms) or "-", tostring(r.saves or "-"),
      r.load_s and ("%.3f"):format(r.load_s) or "-", r.load_s_max and ("%.3f"):format(r.load_s_max) or "-",
      r.read_mb_sum and ("%.1f"):format(r.read_mb_sum) or "-", r.read_mb_max and ("%.1f"):format(r.read_mb_max) or "-",
      r.ckpt_mb and ("%.1f"):format(r.ckpt_mb) or "-", r.params, r.seconds))
  end
  bench.write(cfg, { title = cfg.title ~= "" and cfg.title or ("checkpoints, %d rank%s, layout %s (%s)"):format(world,
      world == 1 and "" or "s", cfg.layout, cfg.device),
    device = world > 1 and on_gpu and dist.device() or cfg.device,
    reference = "mode none: the same training without saves", results = rows,
    model = { d_model = cfg.d_model, layers = cfg.layers, heads = cfg.heads, experts = cfg.experts, top_k = cfg.top_k,
      ffn = cfg.ffn > 0 and cfg.ffn or 2 * cfg.d_model, seq_len = cfg.seq_len, batch_size = cfg.batch_size,
      dtype = cfg.dtype },
    columns = { { "mode", "mode" }, { "step ms", "step_ms", "%.1f" }, { "stall per save ms", "stall_ms", "%.1f" },
      { "of which finishing the previous ms", "wait_ms", "%.1f" }, { "finish ms", "finish_ms", "%.1f" },
      { "saves", "saves", "%d" }, { "load s", "load_s", "%.3f" }, { "read MiB (all ranks)", "read_mb_sum", "%.1f" },
      { "checkpoint MiB", "ckpt_mb", "%.1f" }, { "run s", "seconds", "%.2f" } } })
end
dist.barrier()
os.execute("rm -rf " .. q(root))
