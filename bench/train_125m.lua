--[[
bench/train_125m.lua - the moe-lua side of the 125M training benchmark: the
MegaBlocks 125M dMoE (12 layers, hidden 768, 12 heads, seq_len 1024, 64
experts top-1, ffn 3072; byte vocabulary 257) trained by moe.train on the
King James Bible in bf16. Before training it exports what the PyTorch
reference (bench/train_torch.py) needs to check agreement: the initial
weights (export/model.safetensors, the state dict as moe-lua names it) and
the first batch with its loss and logits at those weights
(export/first_step.safetensors: x, y (B, S) i64, logits (B, S, V) f32,
metadata loss). It then trains `steps` steps through train.run and writes
json= (tokens/s and MFU over the steps after the first log interval, peak
device memory, the loss curve) for bench/train_report.py.

  moe-lua bench/train_125m.lua data=PREFIX steps=200 batch_size=8 experts=64 \
      export=DIR out_dir=DIR json=FILE
  kind=dense trains the dense GPT of the same active size (ffn 3072) instead.
Under `moe-lua launch -n N` it trains with data parallelism (parallel.dp = N,
batch_size per rank, each rank on cuda:<local rank>); tokens/s is then per
GPU, and rank 0 alone reports (its metrics are the job's); bucket_mb= sets the
gradient buckets (parallel.bucket_mb), ep= expert parallelism (parallel.ep), etp=
expert-tensor sharding (parallel.etp), dp_shard= sharded data parallelism
(parallel.dp_shard; with shard_params=true the parameters too, ZeRO-3, gathered
prefetch= blocks ahead: parallel.prefetch, 0 its default) and
dp_replicate= its replicas (HSDP). json= also gets state_allocated_bytes: the
device memory allocated at the end of the third step, before the gradients
are zeroed (parameters, gradients, master weights and optimizer state: the
model state; the step's activations are freed by then).

profile=true adds a per-phase profile of the steps after the first log
interval (profile_steps= of them, default 20; the run needs that many steps
past log_every) to json= as `profile`, through train.run's parts.profile
marks (moe/train/loop.lua PHASES: data, forward, backward, stats, clip,
read, optimizer, log). In a measured step every phase boundary records a
CUDA event and the host clock: gpu_ms is the span of the phase on the
GPU's queue, host_ms the host's time in it (including its waits). Every
other profiled step is saturated (saturate=true): before each phase the
host queues a GEMM blocker longer than the phase's host time in the step
before, and the phase's events bracket only its own work, so kernel_ms is
the phase's GPU time without launch gaps (an upper bound: a host read inside
the phase drains the queue, and what follows runs at the host's pace).
gpu_idle_ms = wall_ms - the sum of kernel_ms: the GPU waiting for the host.
Per step also: host_reads (moe.host_reads(), when this build counts them),
gc_cycles (the bindings' backstop collections, moe.cuda.set_gc_step) and
Lua heap growth. On the CPU both clocks are the host's, with no blocker.
A profiled run's tokens/s includes the saturated steps: time throughput in
a run without profile=true.

comm_profile=true times the collectives of the timed steps (those after
the first log interval, the ones tokens/s covers) with moe.dist's opt-in
timing (dist.comm_timing, docs/DISTRIBUTED.md "Timing the collectives"):
json= gets `comm`, per kind of collective (all_to_all, all_gather,
reduce_scatter, all_reduce, ...) the calls, bytes and milliseconds per
step and the share of the step's wall time (ms_per_step), rank 0's and the
largest over the ranks. On a GPU a collective's time is its span on its
communication stream (CUDA events; waiting for the other rank included):
where the layout overlaps it with compute (the prefetched gathers of
ZeRO-3, the reduce_scatter of a bucket while backward goes on) it is
partly hidden, so the share is an upper bound on the step time lost to
it. Timing costs two event records per collective and one wait at the
end of the run. With ep > 1 it also counts the rows each rank's experts
took (comm.ep_balance: per rank, and per layer the busiest rank over the
mean), from the exchange's counts on the host.

uniform=true routes tokens round-robin (model.moe.uniform_expert_assignment:
every expert, and so every expert-parallel rank, takes the same rows; the
router still runs): what a layout costs without the router's imbalance.
]]
local moe = require "moe"
local train = require "moe.train"
local metrics = require "moe.metrics"
local bench = dofile((arg[0]:match("^(.*)/") or ".") .. "/lib.lua")

local o = moe.config {
  kind = "dmoe", experts = 64, top_k = 1, d_model = 768, n_layers = 12, n_heads = 12, ffn = 3072,
  seq_len = 1024, batch_size = 8, steps = 200, log_every = 10, lr = 6e-4, min_lr = 6e-5, warmup = 20,
  loss_weight = 0.1, activation = "gelu", mlp_impl = "auto", dtype = "bf16", device = "cuda",
  data = "data/bible_kjv", export = "", out_dir = "out/train_125m", json = "", seed = 1234,
  bucket_mb = 25, ep = 1, etp = 1, dp_shard = 0, dp_replicate = 0, shard_params = false, prefetch = 0,
  profile = false, profile_steps = 20, saturate = true, comm_profile = false, uniform = false,
}

-- ---------------------------------------------------------------- the profile

local PHASES = require("moe.train.loop").PHASES

-- The counters of one point in time: host reads (when the build counts them), the
-- bindings' backstop collections, the Lua heap (KiB).
local function counters()
  local ok, reads = pcall(function() return moe.host_reads() end)
  local _, cycles = moe.cuda.set_gc_step()
  -- moe.host_reads() -> {copies =, syncs =}: a read is one copy of device values to the host
  return { reads = ok and type(reads) == "table" and reads.copies or nil, gc = cycles, heap = collectgarbage("count") }
end

-- A GEMM blocker on the GPU: blocker(ms) queues about ms milliseconds of GEMMs
-- (calibrated once), so that the host can queue a whole phase behind them.
local function make_blocker(device)
  local n = 8192
  local a = moe.randn({ n, n }, { dtype = "bf16", device = device })
  local b = moe.randn({ n, n }, { dtype = "bf16", device = device })
  local function one() moe.scope(function() moe.matmul(a, b) end) end
  for _ = 1, 3 do one() end
  local e0, e1 = moe.Event(device), moe.Event(device)
  e0:record()
  for _ = 1, 10 do one() end
  e1:record()
  e1:synchronize()
  local ms_one = e0:elapsed(e1) / 10
  e0:free(); e1:free()
  return function(ms)
    for _ = 1, math.max(1, math.ceil(ms / ms_one)) do one() end
  end, function() a:free(); b:free() end, ms_one
end

-- new_profiler(device, first, last, saturate) -> profiler: profiler.mark is
-- parts.profile; profiler:summary() (after the run) -> the profile table.
local function new_profiler(device, first, last, saturate)
  local on_gpu = device:match("^cuda") ~= nil
  local P = { marks = {}, first = first, last = last, at = {}, last_host = {} }
  local blocker, free_blocker, ms_one
  if on_gpu and saturate then blocker, free_blocker, ms_one = make_blocker(device) end
  P.blocker_ms = ms_one
  local function saturated(step) return blocker ~= nil and (step - first) % 2 == 1 end
  function P.mark(phase, step)
    if step < first or step > last + 1 then return end
    local prev = P.marks[#P.marks]
    local m = { phase = phase, step = step, t = moe.clock() }
    if on_gpu then m.e_end = moe.Event(device):record() end
    if prev and not saturated(prev.step) then -- a measured step's host times, for the blocker
      local key = prev.phase
      P.last_host[key] = math.max(P.last_host[key] or 0, 1e3 * (m.t - prev.t))
    end
    if step <= last and saturated(step) and phase ~= "end" then
      blocker(1.5 * (P.last_host[phase] or 5) + 0.5)
      m.e_start = moe.Event(device):record()
    else
      m.e_start = m.e_end
    end
    if prev == nil or prev.step ~= step then P.at[step] = counters() end
    P.marks[#P.marks + 1] = m
  end
  function P.summary()
    if on_gpu then moe.cuda.synchronize(device) end
    local per = {} -- step -> {phase -> {gpu, host}}
    local ms = on_gpu and function(a, b) return a:elapsed(b) end or function(a, b) return 1e3 * (b - a) end
    for i = 1, #P.marks - 1 do
      local m, n = P.marks[i], P.marks[i + 1]
      if m.step >= first and m.step <= last and m.phase ~= "end" then
        per[m.step] = per[m.step] or {}
        local ph = per[m.step][m.phase] or { gpu = 0, host = 0 }
        ph.gpu = ph.gpu + (on_gpu and ms(m.e_start, n.e_end) or ms(m.t, n.t))
        ph.host = ph.host + 1e3 * (n.t - m.t)
        per[m.step][m.phase] = ph
      end
    end
    local out = { method = on_gpu and "CUDA events" or "host clock", steps_measured = 0, steps_saturated = 0,
      phases = {}, wall_ms = 0, blocker_gemm_ms = P.blocker_ms }
    local sums = {}
    for _, name in ipairs(PHASES) do sums[name] = { gpu = 0, host = 0, kernel = 0 } end
    local reads, gc, heap, counted = 0, 0, 0, 0
    for s = first, last do
      if per[s] then
        local sat = saturated(s)
        if sat then out.steps_saturated = out.steps_saturated + 1 else out.steps_measured = out.steps_measured + 1 end
        for name, ph in pairs(per[s]) do
          local acc = sums[name]
          if sat then acc.kernel = acc.kernel + ph.gpu
          else acc.gpu, acc.host = acc.gpu + ph.gpu, acc.host + ph.host end
        end
        if not sat and P.at[s] and P.at[s + 1] then
          counted = counted + 1
          local a, b = P.at[s], P.at[s + 1]
          if a.reads and b.reads then reads = reads + (b.reads - a.reads) else reads = nil end
          gc, heap = gc + (b.gc - a.gc), heap + (b.heap - a.heap)
        end
      end
    end
    -- wall: host clock from a measured step's first mark to the next step's first mark
    local first_t = {}
    for _, m in ipairs(P.marks) do if first_t[m.step] == nil then first_t[m.step] = m.t end end
    local walls = 0
    for s = first, last do
      if per[s] and not saturated(s) and first_t[s + 1] then
        out.wall_ms, walls = out.wall_ms + 1e3 * (first_t[s + 1] - first_t[s]), walls + 1
      end
    end
    out.wall_ms = walls > 0 and out.wall_ms / walls or nil
    local nm, ns = math.max(out.steps_measured, 1), out.steps_saturated
    local kernel_sum = 0
    for _, name in ipairs(PHASES) do
      local acc = sums[name]
      local row = { phase = name, gpu_ms = acc.gpu / nm, host_ms = acc.host / nm,
        kernel_ms = ns > 0 and acc.kernel / ns or nil }
      kernel_sum = kernel_sum + (row.kernel_ms or row.gpu_ms)
      out.phases[#out.phases + 1] = row
    end
    out.kernel_ms = kernel_sum
    out.gpu_idle_ms = out.wall_ms and (out.wall_ms - kernel_sum) or nil
    out.host_reads_per_step = counted > 0 and reads and reads / counted or nil
    out.gc_cycles_per_step = counted > 0 and gc / counted or nil
    out.lua_heap_kib_per_step = counted > 0 and heap / counted or nil
    for _, m in ipairs(P.marks) do
      if m.e_start ~= m.e_end then m.e_start:free() end
      if m.e_end then m.e_end:free() end
    end
    if free_blocker then free_blocker() end
    out.phases = bench.list(out.phases)
    return out
  end
  return P
end

local cfg = train.config {
  model = {
    vocab_size = 257, d_model = o.d_model, n_layers = o.n_layers, n_heads = o.n_heads, pos = "rope",
    norm = "layernorm", tie_embeddings = true, dropout = 0.0, init_std = 0.02,
    ffn = o.kind == "dense" and "dense" or "moe", d_ff = o.ffn,
    moe = { kind = o.kind == "moe" and "moe" or "dmoe", num_experts = o.experts, top_k = o.top_k,
      ffn_hidden_size = o.ffn, mlp_type = "mlp", activation = o.activation, mlp_impl = o.mlp_impl,
      loss_weight = o.loss_weight, zloss_weight = 0.0, jitter_eps = 0.0, capacity_factor = 1.0, every = 1,
      uniform_expert_assignment = o.uniform },
  },
  data = o.data, seq_len = o.seq_len, batch_size = o.batch_size, grad_accum = 1, steps = o.steps,
  lr = o.lr, min_lr = o.min_lr, warmup = math.min(o.warmup, o.steps), decay = "cosine", weight_decay = 0.1,
  clip = 1.0, eval_every = 0, eval_iters = 0, log_every = o.log_every, save_every = 0, keep_last = 0,
  out_dir = o.out_dir, device = o.device, dtype = o.dtype, seed = o.seed, tensorboard = true,
  sample_tokens = 0, parallel = { bucket_mb = o.bucket_mb, ep = o.ep, etp = o.etp,
    dp_shard = o.dp_shard, dp_replicate = o.dp_replicate, shard_params = o.shard_params, prefetch = o.prefetch },
}

local dist = moe.dist
local dp = dist.world_size() -- 1 when started alone (no MPI)
local device = train.resolve_device(cfg.device)
if dp > 1 then device = dist.device() end -- train.run's data parallelism picks the same GPU
moe.manual_seed(cfg.seed)
local t0 = moe.clock()
-- with expert parallelism train.run builds the model (its MoE layers take the EP group),
-- and the first-batch export below (one process's whole model) is skipped
local whole = o.ep == 1 and o.etp == 1 and o.dp_shard <= 1
local model = whole and train.build_model(cfg, device) or nil
local train_data, _, tokenizer = train.build_data(cfg)
local n_params, n_active
if model then
  n_params, n_active = model:num_parameters(), model:num_active_parameters()
  print(("train_125m: %s, %d parameters (%d active), built in %.1f s"):format(o.kind, n_params, n_active,
    moe.clock() - t0))
end

-- the first batch, its loss and logits at the initial weights (eval mode: no jitter, no aux loss)
local first = {}
if model then
  local s0 = train_data:state()
  local x, y = train_data:batch(cfg.batch_size)
  train_data:set_state(s0)
  moe.no_grad(function()
    model:eval()
    local xd, yd = x:to(device), y:to(device)
    local logits = model:forward(xd)
    local _, info = model:loss(xd, yd)
    first.loss = info.lm_loss
    first.logits = logits:float():cpu()
    model:train()
  end)
  first.x, first.y = x, y
  print(("train_125m: first-batch loss at the initial weights %.6f"):format(first.loss))
  if o.export ~= "" then
    local t1 = moe.clock()
    os.execute("mkdir -p '" .. o.export .. "'")
    moe.save(o.export .. "/model.safetensors", model:state_dict(), { format = "pt" })
    moe.save(o.export .. "/first_step.safetensors", { x = first.x, y = first.y, logits = first.logits },
      { loss = ("%.9g"):format(first.loss) })
    print(("train_125m: exported weights and first batch to %s in %.1f s"):format(o.export, moe.clock() - t1))
  end
  first.logits = nil
end

local on_gpu = device:match("^cuda") ~= nil
if on_gpu then
  moe.cuda.synchronize(device)
  moe.reset_peak_memory_stats(device)
end
local state_bytes
-- comm_profile with expert parallelism: the rows each MoE layer's experts on this rank took
-- in the timed steps (the exchange's counts, on the host: no synchronisation), per layer
local ep_layers, ep_rows
local ep_step = { ratio = 0, n = 0 } -- per (step, layer) sums
local function after_step(st)
  if on_gpu and st.step == 3 then state_bytes = moe.memory_stats(device).allocated end
  if o.comm_profile and o.ep > 1 and st.step > o.log_every then
    if not ep_layers then
      ep_layers, ep_rows = {}, {}
      for _, m in ipairs((model or st.model):modules()) do
        if rawget(m, "ep_last") then ep_layers[#ep_layers + 1] = m; ep_rows[#ep_layers] = 0 end
      end
    end
    for i, m in ipairs(ep_layers) do
      for _, n in ipairs(m.ep_last.recv) do ep_rows[i] = ep_rows[i] + n end
      -- this step's rows per rank from every rank's segments (the same on every rank):
      -- what the exchange waits for is this step's busiest rank, not the run's
      local g, P, El = m.ep_last.segments, m.ep.size, m.ep.local_experts
      local E = P * El
      local mx, sum = 0, 0
      for p = 0, P - 1 do
        local n = 0
        for s = 0, P - 1 do
          for e = 1, El do n = n + g[s * E + p * El + e] end
        end
        mx, sum = math.max(mx, n), sum + n
      end
      ep_step.ratio, ep_step.n = ep_step.ratio + (sum > 0 and mx * P / sum or 1), ep_step.n + 1
    end
  end
end
-- comm_profile: the collectives of the timed steps (after the first log interval)
local COMM_KINDS = { "all_to_all", "all_gather", "reduce_scatter", "all_reduce", "broadcast", "send", "recv" }
local comm_raw -- {steps =, kinds = {name -> {ms, calls, bytes}}}
local function on_log(st)
  if not o.comm_profile then return end
  if st.step == o.log_every then
    dist.comm_timing(true)
  elseif st.step == cfg.steps and dist.comm_timing() then
    comm_raw = { steps = st.step - o.log_every, kinds = dist.comm_times() }
    dist.comm_timing(false)
  end
end
if o.comm_profile and cfg.steps < 2 * o.log_every then
  error(("train_125m: comm_profile=true needs steps >= 2 * log_every (got steps=%d, log_every=%d)"):format(
    cfg.steps, o.log_every), 0)
end
local profiler
if o.profile then
  local p0 = o.log_every + 1
  local p1 = math.min(cfg.steps - 1, p0 + o.profile_steps - 1)
  if p1 < p0 then
    error(("train_125m: profile=true needs steps > log_every + 1 (got steps=%d, log_every=%d)"):format(
      cfg.steps, o.log_every), 0)
  end
  profiler = new_profiler(device, p0, p1, o.saturate)
end
local result = train.run(cfg, { model = model, train_data = train_data, tokenizer = tokenizer,
  hooks = { after_step = after_step, on_log = on_log }, profile = profiler and profiler.mark })
-- every rank: the largest time per kind over the ranks (a CPU tensor: MPI)
local comm_max
if comm_raw and dp > 1 then
  local v = {}
  for i, k in ipairs(COMM_KINDS) do v[i] = comm_raw.kinds[k].ms end
  local t = moe.tensor(v, { dtype = "f64" })
  dist.all_reduce(t, "max")
  comm_max = t:totable()
end
-- every rank's rows per layer (MPI on the host): how unevenly the router loaded the ranks
local ep_balance
if ep_rows and #ep_rows > 0 then
  local W = dist.world_size()
  local all = moe.empty({ W * #ep_rows }, { dtype = "f64" })
  dist.all_gather(all, moe.tensor(ep_rows, { dtype = "f64" }))
  local v, L = all:totable(), #ep_rows
  local ratio, per_rank = 0, {}
  for r = 1, W do
    per_rank[r] = 0
    for l = 1, L do per_rank[r] = per_rank[r] + v[(r - 1) * L + l] end
  end
  for l = 1, L do
    local mx, sum = 0, 0
    for r = 1, W do
      local x = v[(r - 1) * L + l]
      mx, sum = math.max(mx, x), sum + x
    end
    ratio = ratio + (sum > 0 and mx / (sum / W) or 1)
  end
  ep_balance = { rows_per_rank = per_rank, busiest_over_mean = ratio / L, layers = L,
    step_busiest_over_mean = ep_step.n > 0 and ep_step.ratio / ep_step.n or 1,
    what = "the rows each rank's experts took over the timed steps (summed over the MoE layers), and per " ..
      "layer the busiest rank's rows over the mean, averaged over the layers (1: even; the exchange " ..
      "makes every rank wait for the busiest); step_busiest_over_mean: the same per step and layer, " ..
      "from every rank's counts of that step, averaged (what the exchange waits for)" }
end
local profile = profiler and profiler.summary()
model = model or result.model
n_params = n_params or model:num_parameters() -- this rank's (its expert shards)
n_active = n_active or model:num_active_parameters()
local mem = on_gpu and moe.memory_stats(device) or {}
if dist.rank() ~= 0 then return end -- rank 0 reports the job

-- throughput over the log intervals after the first (which holds the warm-up steps)
local recs = {}
for _, r in ipairs(metrics.read_jsonl(cfg.out_dir .. "/metrics.jsonl")) do
  if r.tokens_per_s then recs[#recs + 1] = r end
end
local steps_timed, secs, mfu_sum = 0, 0, 0
for i = 2, #recs do
  local r, prev = recs[i], recs[i - 1]
  local n = r.step - prev.step
  steps_timed, secs = steps_timed + n, secs + n * r.ms_per_iter / 1000
  mfu_sum = mfu_sum + (r.mfu or 0) * n
end
-- metrics' tokens/s is the job's; per GPU it is one rank's share
local tokens_per_step = cfg.batch_size * cfg.seq_len
-- the expert implementation the dMoE layers ran ("auto" resolves per device)
local mlp_impl = "none"
for _, m in ipairs(model:modules()) do
  if m.resolve_impl then mlp_impl = m.mlp_impl break end
end
local out = {
  impl = "moe-lua", kind = o.kind, dp = dp, device = on_gpu and moe.cuda.get_device_name(device) or "cpu",
  version = moe.version_report and moe.version_report() or nil, date = os.date("!%Y-%m-%dT%H:%M:%SZ"),
  config = o, params = n_params, active_params = n_active, flops_per_token = model:flops_per_token(),
  tokens_per_step = tokens_per_step, steps = result.step, steps_timed = steps_timed, mlp_impl = mlp_impl,
  tokens_per_s = secs > 0 and steps_timed * tokens_per_step / secs or nil,
  ms_per_step = steps_timed > 0 and 1000 * secs / steps_timed or nil,
  mfu = steps_timed > 0 and mfu_sum / steps_timed or nil,
  peak_allocated_bytes = mem.peak_allocated, peak_reserved_bytes = mem.peak_reserved,
  state_allocated_bytes = state_bytes,
  first_loss = first.loss, first_train_loss = result.losses[1], last_loss = result.losses[result.step],
  losses = {}, seconds = result.seconds,
}
for _, r in ipairs(recs) do out.losses[#out.losses + 1] = { r.step, r.loss } end
out.profile = profile
if comm_raw then
  local n, wall = comm_raw.steps, out.ms_per_step
  local c = { method = on_gpu and "CUDA events on the communication stream (time of the collective on its " ..
    "stream: an upper bound on the exposed time where it overlaps compute)" or "host clock from the call to " ..
    "the end of its wait", steps = n, wall_ms_per_step = wall, kinds = {} }
  local parts = {}
  for i, k in ipairs(COMM_KINDS) do
    local r = comm_raw.kinds[k]
    if r.calls > 0 then
      local row = { kind = k, calls_per_step = r.calls / n, bytes_per_step = r.bytes / n, ms_per_step = r.ms / n,
        max_ms_per_step = comm_max and comm_max[i] / n or r.ms / n }
      row.share = wall and wall > 0 and row.ms_per_step / wall or nil
      row.max_share = wall and wall > 0 and row.max_ms_per_step / wall or nil
      c.kinds[#c.kinds + 1] = row
      parts[#parts + 1] = ("%s %.2f ms (%.1f%%, %.0f calls, %.1f MiB)"):format(k, row.ms_per_step,
        100 * (row.share or 0), row.calls_per_step, row.bytes_per_step / 2 ^ 20)
    end
  end
  c.kinds = bench.list(c.kinds)
  c.ep_balance = ep_balance
  out.comm = c
  print(("train_125m: collectives per step over %d steps (rank 0; %.1f ms/step): %s"):format(n, wall or 0,
    #parts > 0 and table.concat(parts, ", ") or "none"))
  if ep_balance then
    local rr = {}
    for r, x in ipairs(ep_balance.rows_per_rank) do rr[r] = ("%.0f"):format(x / n) end
    print(("train_125m: expert rows per step by rank %s; per layer the busiest rank over the mean %.3f " ..
      "over the run, %.3f per step and layer"):format(
      table.concat(rr, " / "), ep_balance.busiest_over_mean, ep_balance.step_busiest_over_mean))
  end
end
if profile then
  print(("train_125m: profile (%s) of %d measured + %d saturated steps: wall %.2f ms/step, kernels %.2f ms, " ..
    "GPU idle %.2f ms, host reads %s, gc cycles %.2f per step"):format(profile.method, profile.steps_measured,
    profile.steps_saturated, profile.wall_ms or 0, profile.kernel_ms, profile.gpu_idle_ms or 0,
    profile.host_reads_per_step and ("%.1f"):format(profile.host_reads_per_step) or "not counted",
    profile.gc_cycles_per_step or 0))
  print("  phase       gpu ms   host ms  kernel ms")
  for _, r in ipairs(profile.phases) do
    print(("  %-10s %8.3f %9.3f %10s"):format(r.phase, r.gpu_ms, r.host_ms,
      r.kernel_ms and ("%.3f"):format(r.kernel_ms) or "-"))
  end
end
print(("train_125m: %d steps, %.0f tokens/s, %.1f ms/step, MFU %.1f%%, peak allocated %.2f GiB, "
  .. "model state %.2f GiB, loss %.4f -> %.4f"):format(out.steps, out.tokens_per_s or 0, out.ms_per_step or 0,
  100 * (out.mfu or 0), (out.peak_allocated_bytes or 0) / 2 ^ 30, (state_bytes or 0) / 2 ^ 30, out.first_train_loss or 0, out.last_loss or 0))
out.losses = bench.list(out.losses)
out.title = "Training the 125M " .. o.kind .. " (moe-lua)"
out.reference = "bench/train_torch.py (PyTorch on the exported weights and batch; bench/train_report.py joins both)"
out.rows = { out }
out.columns = { { "steps", "steps" }, { "tokens/s", "tokens_per_s", "%.0f" }, { "ms/step", "ms_per_step", "%.1f" },
                { "MFU", function(r) return r.mfu and ("%.1f%%"):format(100 * r.mfu) end },
                { "peak GiB", function(r) return r.peak_allocated_bytes and r.peak_allocated_bytes / 2 ^ 30 end,
                  "%.2f" },
                { "loss", function(r) return ("%.4f -> %.4f"):format(r.first_train_loss or 0, r.last_loss or 0) end } }
-- o has no repeats: the figures are train.run's own (tokens/s over the logged intervals)
bench.write({ json = o.json, md = "" }, out)
