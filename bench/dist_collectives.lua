--[[
bench/dist_collectives.lua - moe.dist's GPU collectives (NCCL through
core/dist_nccl.c): all_reduce (sum) and all_to_all (equal splits) of 8, 64,
256 and 1024 MiB per rank, one process per GPU, beside
bench/dist_collectives_torch.py (torch.distributed, the same sizes, dtype and
timing) as the reference. bench/dist_round.sh runs both.

  mpirun -n 2 --bind-to none moe-lua bench/dist_collectives.lua [json=FILE] [dtype=bf16]
         [sizes=8,64,256,1024] [ops=all_reduce,all_to_all] [iters=0] [repeats=10] [warmup=3]

Each size is checked first (all_reduce of rank + 1 everywhere; all_to_all
of blocks filled with their source and destination), then timed on random
data (randn): CUDA events on the compute stream around `iters` synchronous
calls (each call's collective waits for the compute stream and the compute
stream for it, as a training step sees it), the median of `repeats` such
samples after `warmup` calls, on rank 0. iters=0 picks 20 calls per sample
up to 64 MiB, 10 up to 256 MiB, 5 above. The all_reduce sums run on the
same tensor every call (values grow; NCCL's speed does not depend on them).

Bandwidths as nccl-tests defines them, in GB/s (1e9 bytes): algbw = bytes
per rank / time; busbw = algbw * 2 (n - 1) / n for all_reduce, algbw *
(n - 1) / n for all_to_all. Only rank 0 writes the JSON and markdown.
]]
local moe = require "moe"
local bench = dofile((arg[0]:match("^(.*)/") or ".") .. "/lib.lua")

local cfg = bench.config {
  dtype = "bf16",
  sizes = { 8, 64, 256, 1024 }, -- MiB per rank
  ops = { "all_reduce", "all_to_all" },
  iters = 0,
  repeats = 10,
  warmup = 3,
}

local dist = moe.dist
dist.init {}
local rank, n = dist.rank(), dist.world_size()
local dev = dist.device()
if not tostring(dev):match("^cuda") then error("dist_collectives: no GPU for this rank", 0) end
local esize = ({ f32 = 4, bf16 = 2, f16 = 2, f64 = 8 })[cfg.dtype]
if not esize then error("dist_collectives: dtype must be f32, bf16, f16 or f64", 0) end

local COLS = 1024 -- elements per row of the all_to_all tensors

local function iters_for(mib)
  if cfg.iters > 0 then return cfg.iters end
  if mib <= 64 then return 20 elseif mib <= 256 then return 10 end
  return 5
end

local function check(cond, what)
  if not cond then error(("dist_collectives: check failed on rank %d: %s"):format(rank, what), 0) end
end

local function minmax(t) return moe.min(t):item(), moe.max(t):item() end

local function validate(op, mib)
  local elems = mib * 1024 * 1024 // esize
  if op == "all_reduce" then
    local t = moe.full({ elems }, rank + 1, { dtype = cfg.dtype, device = dev })
    dist.all_reduce(t, "sum")
    local lo, hi = minmax(t)
    local want = n * (n + 1) / 2
    check(lo == want and hi == want, ("all_reduce of %d MiB: [%g, %g], %g expected"):format(mib, lo, hi, want))
    t:free()
  else
    local rows = elems // COLS
    local chunk = rows // n
    local input = moe.empty({ rows, COLS }, { dtype = cfg.dtype, device = dev })
    for j = 0, n - 1 do input:narrow(0, j * chunk, chunk):fill_(rank * n + j) end
    local out = moe.zeros({ rows, COLS }, { dtype = cfg.dtype, device = dev })
    local splits = {}
    for j = 1, n do splits[j] = chunk end
    dist.all_to_all(out, input, splits, splits)
    for r = 0, n - 1 do
      local lo, hi = minmax(out:narrow(0, r * chunk, chunk))
      local want = r * n + rank
      check(lo == want and hi == want, ("all_to_all of %d MiB: rows from rank %d are [%g, %g], %g expected")
        :format(mib, r, lo, hi, want))
    end
    input:free()
    out:free()
  end
end

local results = {}
for _, op in ipairs(cfg.ops) do
  if op ~= "all_reduce" and op ~= "all_to_all" then
    error("dist_collectives: ops are all_reduce and all_to_all, got " .. tostring(op), 0)
  end
  for _, mib in ipairs(cfg.sizes) do
    validate(op, mib)
    local bytes = mib * 1024 * 1024
    local elems = bytes // esize
    local f, tensors
    if op == "all_reduce" then
      local t = moe.randn({ elems }, { dtype = cfg.dtype, device = dev })
      tensors = { t }
      f = function() dist.all_reduce(t, "sum") end
    else
      local rows = elems // COLS
      local input = moe.randn({ rows, COLS }, { dtype = cfg.dtype, device = dev })
      local out = moe.empty({ rows, COLS }, { dtype = cfg.dtype, device = dev })
      local splits = {}
      for j = 1, n do splits[j] = rows // n end
      tensors = { input, out }
      f = function() dist.all_to_all(out, input, splits, splits) end
    end
    local iters = iters_for(mib)
    local s = bench.time(f, { device = dev, iters = iters, repeats = cfg.repeats, warmup = cfg.warmup })
    for _, t in ipairs(tensors) do t:free() end
    local algbw = bytes / s / 1e9
    local factor = op == "all_reduce" and 2 * (n - 1) / n or (n - 1) / n
    results[#results + 1] = {
      op = op, mib = mib, bytes = bytes, dtype = cfg.dtype, ranks = n, iters = iters,
      ms = s * 1e3, algbw_gbps = algbw, busbw_gbps = algbw * factor,
    }
    if rank == 0 then
      io.write(("%-10s %5d MiB  %9.3f ms  algbw %7.1f GB/s  busbw %7.1f GB/s\n"):format(op, mib,
        s * 1e3, algbw, algbw * factor))
      io.flush()
    end
  end
end

dist.barrier()
if rank == 0 then
  local info = moe.build_info()
  local nccl = info.nccl or 0
  bench.write(cfg, {
    title = ("moe.dist collectives on %d GPUs (%s)"):format(n, cfg.dtype),
    device = dev,
    impl = "moe-lua",
    ranks = n,
    nccl = nccl,
    nccl_version = ("%d.%d.%d"):format(nccl // 10000, (nccl % 10000) // 100, nccl % 100),
    reference = "bench/dist_collectives_torch.py (torch.distributed, NCCL backend)",
    results = bench.list(results),
    notes = {
      "bytes: per rank; algbw = bytes / time; busbw (nccl-tests): all_reduce algbw * 2(n-1)/n, " ..
        "all_to_all algbw * (n-1)/n; GB/s = 1e9 bytes/s",
      "each sample: iters synchronous calls between CUDA events on the compute stream (rank 0)",
    },
    columns = {
      { "op", "op" }, { "MiB", "mib" }, { "iters", "iters" }, { "ms", "ms", "%.3f" },
      { "algbw GB/s", "algbw_gbps", "%.1f" }, { "busbw GB/s", "busbw_gbps", "%.1f" },
    },
  })
end
