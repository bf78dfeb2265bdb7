--[[
bench/ckpt_stall.lua - the training stall of a checkpoint save (the seconds
the step waits), synchronous against asynchronous (save_async = true), on
ranks of one job:

  moe-lua launch -n 2 bench/ckpt_stall.lua [d_model=256] [layers=4] [experts=8] [steps=12]
      [save_every=2] [layout=dp|zero|ep] json=bench/results/dist/ckpt_stall.json

A dMoE GPT trains `steps` steps three ways: without saves (the step time),
saving every save_every steps synchronously, and asynchronously. Reported per
mode: the median step time of steps without a save, the mean stall per save
(what saver:save took: a synchronous save's write, fsync, barrier and
commit; an asynchronous one's copy of the shards to host memory, plus the
wait for the previous write and its commit, shown on its own), and the
checkpoint's size.
Rank 0 reports; every rank's stall is its own (they are alike: the barrier).
]]
local moe = require "moe"
local bench = dofile((arg[0]:match("^(.*)/") or ".") .. "/lib.lua")
local train = require "moe.train"
local cfg = bench.config { d_model = 256, layers = 4, experts = 8, steps = 12, save_every = 2, layout = "dp",
  device = "cpu", repeats = 1, warmup = 0 }
local dist = moe.dist
local rank, world = dist.rank(), dist.world_size()
local K = dofile((arg[0]:match("^(.*)/") or ".") .. "/../tests/dist/trainkit.lua")
local root, prefix = K.corpus(rank)
local shared = ("/tmp/moe-ckpt-stall-%s"):format(os.getenv("MASTER_PORT") or "x")
if rank == 0 then os.execute("rm -rf '" .. shared .. "'") end
dist.barrier()

local par = ({ dp = {}, zero = { dp_shard = world }, ep = { ep = world } })[cfg.layout]
assert(par, "layout=dp|zero|ep")

local function run(mode)
  local c = K.base_cfg({ steps = cfg.steps, device = cfg.device, loss_weight = 0.01 }, root, prefix, mode, "moe", {
    model = { d_model = cfg.d_model, n_layers = cfg.layers, n_heads = 4, d_ff = 4 * cfg.d_model,
      moe = { num_experts = cfg.experts, top_k = 2, ffn_hidden_size = 2 * cfg.d_model } },
    seq_len = 64, batch_size = 4, eval_every = 0, parallel = par,
    save_every = mode == "none" and 0 or cfg.save_every, keep_last = mode == "none" and 0 or 2,
    save_async = mode == "async" })
  c.out_dir = shared .. "/" .. mode
  local times, t0, saver, n_params = {}, nil, nil, 0
  local res = train.run(c, { hooks = {
    before_step = function()
      if not t0 then t0 = moe.clock() end
    end,
    after_step = function(state)
      saver = state.parallel.saver
      if n_params == 0 then for _, p in ipairs(state.params) do n_params = n_params + p:numel() end end
    end,
    on_log = function(state)
      local now = moe.clock()
      -- steps with a save end after the log; the time of a step is from one log to the next
      if state.step % cfg.save_every ~= 1 and state.step > 1 then times[#times + 1] = now - t0 end
      t0 = now
    end } })
  table.sort(times)
  local bytes = 0
  if mode ~= "none" then
    local p = io.popen("du -sb '" .. shared .. "/" .. mode .. "/ckpt-" .. cfg.steps .. "' 2>/dev/null")
    bytes = tonumber((p:read("a") or ""):match("^(%d+)")) or 0
    p:close()
  end
  return { mode = mode, step_ms = (times[(#times + 1) // 2] or 0) * 1e3,
    stall_ms = saver and saver.saves > 0 and saver.stall / saver.saves * 1e3 or 0, saves = saver and saver.saves or 0,
    wait_ms = saver and saver.saves > 0 and (saver.wait or 0) / saver.saves * 1e3 or 0,
    ckpt_mb = bytes / 2 ^ 20, params = n_params, seconds = res.seconds }
end

local rows = {}
for _, mode in ipairs({ "none", "sync", "async" }) do rows[#rows + 1] = run(mode) end
if rank == 0 then
  for _, r in ipairs(rows) do
    print(("%-6s step %.1f ms, stall per save %.1f ms (previous save %.1f) over %d saves, checkpoint %.1f MiB, %d parameters, run %.2f s")
      :format(r.mode, r.step_ms, r.stall_ms, r.wait_ms, r.saves, r.ckpt_mb, r.params, r.seconds))
  end
  bench.write(cfg, { title = ("checkpoint stall, %d ranks, layout %s (CPU)"):format(world, cfg.layout),
    device = "cpu", reference = "mode none: the same training without saves", results = rows,
    columns = { { "mode", "mode" }, { "step ms", "step_ms", "%.1f" }, { "stall per save ms", "stall_ms", "%.1f" },
      { "of which finishing the previous ms", "wait_ms", "%.1f" }, { "saves", "saves", "%d" }, { "checkpoint MiB", "ckpt_mb", "%.1f" }, { "run s", "seconds", "%.2f" } } })
end
dist.barrier()
if rank == 0 then os.execute("rm -rf '" .. shared .. "'") end
os.execute("rm -rf '" .. root .. "'")
