-- tests/dist/launch_kill_train.lua (launch_spec): data-parallel training
-- (moe.train, parallel.dp = 2) where rank 1 kills itself with SIGKILL in
-- the middle of step 3, between its backward and its optimizer step (the
-- before_step hook). Rank 0 goes on into the step's collectives and waits
-- for a rank that is gone; mpirun sees rank 1 die and stops rank 0. The
-- data is a small corpus written by each rank for itself. MOE_DIST_DEVICE=cuda
-- trains on the ranks' GPUs (NCCL).
local moe = require "moe"
local train = require "moe.train"
local data = require "moe.data"
local rank = tonumber(os.getenv("RANK"))
local dir = os.tmpname()
os.remove(dir)
dir = dir .. "-r" .. rank
assert(os.execute("mkdir -p '" .. dir .. "'"))
local b = data.IndexedDatasetBuilder(dir .. "/words", { dtype = "u16" })
for d = 1, 40 do
  local ids = {}
  for i = 1, 60 do ids[i] = 97 + (d * 7 + i * 3) % 26 end
  ids[#ids + 1] = 256
  b:add_document(ids)
end
b:finalize()
local cfg = train.config {
  model = { vocab_size = 257, d_model = 32, n_layers = 1, n_heads = 2, ffn = "moe", d_ff = 64,
    moe = { num_experts = 4, top_k = 1, ffn_hidden_size = 32 } },
  data = dir .. "/words", seq_len = 16, batch_size = 2, steps = 1000, warmup = 1, eval_every = 0,
  eval_iters = 0, log_every = 1, save_every = 0, keep_last = 0, tensorboard = false, sample_tokens = 0,
  device = os.getenv("MOE_DIST_DEVICE") == "cuda" and "cuda" or "cpu", out_dir = dir .. "/out", quiet = true,
}
local pid = moe.proc.getpid()
io.stderr:write(("ready %d pid=%d\n"):format(rank, pid))
train.run(cfg, { hooks = { before_step = function(state)
  if rank == 1 and state.step == 3 then os.execute("kill -9 " .. pid) end
end } })
print("rank " .. rank .. " was not stopped")
os.exit(3)
