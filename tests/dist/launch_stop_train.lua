-- tests/dist/launch_stop_train.lua (train_guard_spec): data-parallel training
-- (moe.train, parallel.dp = 2) that `moe-lua launch` is asked to stop with
-- SIGTERM. Each rank prints "ready <rank>" to stderr once it has made 5 steps
-- and "stop seen by <rank> at step <n>" when the flag agreed over the ranks
-- reaches it; the loop then saves ckpt-<n> (rank 0) and raises "stopped by
-- SIGTERM at step <n>; ..." on every rank. Arguments: the corpus prefix and
-- the out_dir (shared by the ranks: rank 0 writes it), and the device (cpu, the
-- default, or cuda: each rank on cuda:<local rank>; bench/ckpt_round.sh signals).
-- Alone (no launcher) it is one process of the same training.
local moe = require "moe"
local train = require "moe.train"
local corpus, out_dir, device = ...
local rank = os.getenv("RANK")
local cfg = train.config {
  model = { vocab_size = 257, d_model = 16, n_layers = 1, n_heads = 2, d_ff = 16,
    moe = { num_experts = 4, top_k = 1, ffn_hidden_size = 16 } },
  data = corpus, seq_len = 8, batch_size = 2, steps = 100000, warmup = 0, eval_every = 0, eval_iters = 0,
  log_every = 1000, save_every = 0, keep_last = 2, tensorboard = false, sample_tokens = 0, device = device or "cpu",
  out_dir = out_dir, quiet = true,
}
local seen = false
train.run(cfg, { hooks = { after_step = function(state)
  if state.step == 5 then io.stderr:write(("ready %s pid=%d\n"):format(rank, moe.proc.getpid())) end
  if state.stop_signal and not seen then
    seen = true
    io.stderr:write(("stop seen by %s at step %d\n"):format(rank, state.step))
  end
end } })
print("rank " .. rank .. " was not stopped")
os.exit(3)
