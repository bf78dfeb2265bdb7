--[[
tests/dist/ckpt_restart.lua (launch_spec): data-parallel training (dp = 2,
sharded checkpoints every 2 steps, asynchronous) that `moe-lua launch
--max-restarts K` restarts after rank 1 kills itself with SIGKILL at the
start of step 7 (kill_step=7: in its before_step hook, after its forward and
backward, before the gradient clipping and the optimizer step) on the first
run (MOE_LAUNCH_RESTART=0). Just before, it appends a "failure" event to the
launcher's timeline (--timeline FILE; moe/cli/launch.lua). The restarted
job resumes from the newest complete checkpoint and redoes the steps after it.

  moe-lua launch -n 2 --max-restarts 2 --timeline T tests/dist/ckpt_restart.lua dir=D kill=true
  moe-lua launch -n 2 tests/dist/ckpt_restart.lua dir=D2 kill=false     (the uninterrupted run)
  device=cuda: each rank on its GPU (NCCL)

The model is the tests' 2-layer dMoE GPT unless sizes are given (what
bench/ckpt_round.sh does for the 125M dMoE): d_model=, layers=, heads=,
experts=, top_k=, ffn= (the experts' hidden size), seq_len=, batch_size=,
dtype=, activation=, with data=PREFIX (a Megatron dataset with a byte
vocabulary; default the tests' word corpus), steps=, save_every=,
kill_step=, keep_last= (0: no save at the end of a run, none removed),
async= (false: synchronous saves), ep=, dp_shard=, timeout= (seconds a
collective may wait, default 120: a large model's save keeps the other
ranks waiting in its barrier).

At the end rank 0 writes D/losses-<run>.txt: "step loss" (%.17g) of every
step this run trained.
]]
local moe = require "moe"
local train = require "moe.train"
local opts = moe.config { dir = "", kill = false, steps = 12, resume = "", device = "cpu", save_every = 2,
  kill_step = 7, d_model = 0, layers = 2, heads = 2, experts = 4, top_k = 2, ffn = 32, seq_len = 16, batch_size = 4,
  dtype = "f32", activation = "gelu", data = "", ep = 1, dp_shard = 0, keep_last = 2, async = true,
  timeout = 120 }
assert(opts.dir ~= "", "give dir=FOLDER")
local dist = moe.dist
dist.init { timeout = opts.timeout }
local rank = dist.rank()
local attempt = tonumber(os.getenv("MOE_LAUNCH_RESTART") or "0")
local K = dofile(arg[0]:match("^(.*/)") .. "trainkit.lua")
local root, prefix = K.corpus(rank)
local over = { save_every = opts.save_every, keep_last = opts.keep_last, save_async = opts.async, resume = opts.resume,
  eval_every = 0,
  parallel = { ep = opts.ep, dp_shard = opts.dp_shard } }
if opts.d_model > 0 then -- a model of the sizes given
  over.model = { d_model = opts.d_model, n_layers = opts.layers, n_heads = opts.heads, d_ff = 4 * opts.d_model,
    pos = "rope", moe = { num_experts = opts.experts, top_k = opts.top_k, ffn_hidden_size = opts.ffn,
      activation = opts.activation, kind = "dmoe", loss_weight = 0.01 } }
  over.seq_len, over.batch_size, over.dtype, over.deterministic = opts.seq_len, opts.batch_size, opts.dtype, false
end
if opts.data ~= "" then over.data = opts.data end
local cfg = K.base_cfg({ steps = opts.steps, device = opts.device, loss_weight = 0.01 }, root, prefix, "run", "moe", over)
cfg.out_dir = opts.dir .. "/out"
local pid = moe.proc.getpid()
local res = train.run(cfg, { hooks = { before_step = function(state)
  if opts.kill and attempt == 0 and rank == 1 and state.step == opts.kill_step - 1 then
    require("moe.cli.launch").timeline_event("failure", { rank = rank, step = opts.kill_step,
      what = "SIGKILL (ckpt_restart.lua kills rank 1 in step " .. opts.kill_step .. ")" })
    os.execute("kill -9 " .. pid)
  end
end } })
if rank == 0 then
  local f = assert(io.open(("%s/losses-%d.txt"):format(opts.dir, attempt), "w"))
  for s = 1, opts.steps do
    if res.losses[s] then f:write(("%d %.17g\n"):format(s, res.losses[s])) end
  end
  f:close()
end
os.execute("rm -rf '" .. root .. "'")
