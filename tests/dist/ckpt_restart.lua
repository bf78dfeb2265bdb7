--[[
tests/dist/ckpt_restart.lua (launch_spec): data-parallel training (dp = 2,
sharded checkpoints every 2 steps, asynchronous) that `moe-lua launch
--max-restarts K` restarts after rank 1 kills itself with SIGKILL in the
middle of step 7 (after its backward, before its optimizer step) on the
first run (MOE_LAUNCH_RESTART=0). The restarted job resumes from the newest
complete checkpoint and redoes the steps after it.

  moe-lua launch -n 2 --max-restarts 2 tests/dist/ckpt_restart.lua dir=D kill=true
  moe-lua launch -n 2 tests/dist/ckpt_restart.lua dir=D2 kill=false     (the uninterrupted run)
  device=cuda: each rank on its GPU (NCCL)

At the end rank 0 writes D/losses-<run>.txt: "step loss" (%.17g) of every
step this run trained.
]]
local moe = require "moe"
local train = require "moe.train"
local opts = moe.config { dir = "", kill = false, steps = 12, resume = "", device = "cpu" }
assert(opts.dir ~= "", "give dir=FOLDER")
local dist = moe.dist
dist.init { timeout = 120 }
local rank = dist.rank()
local attempt = tonumber(os.getenv("MOE_LAUNCH_RESTART") or "0")
local K = dofile(arg[0]:match("^(.*/)") .. "trainkit.lua")
local root, prefix = K.corpus(rank)
local cfg = K.base_cfg({ steps = opts.steps, device = opts.device, loss_weight = 0.01 }, root, prefix, "run", "moe",
  { save_every = 2, keep_last = 2, save_async = true, resume = opts.resume, eval_every = 0 })
cfg.out_dir = opts.dir .. "/out"
local pid = moe.proc.getpid()
local res = train.run(cfg, { hooks = { before_step = function(state)
  if opts.kill and attempt == 0 and rank == 1 and state.step == 6 then os.execute("kill -9 " .. pid) end
end } })
if rank == 0 then
  local f = assert(io.open(("%s/losses-%d.txt"):format(opts.dir, attempt), "w"))
  for s = 1, opts.steps do
    if res.losses[s] then f:write(("%d %.17g\n"):format(s, res.losses[s])) end
  end
  f:close()
end
os.execute("rm -rf '" .. root .. "'")
