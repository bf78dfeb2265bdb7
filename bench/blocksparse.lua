--[[
bench/blocksparse.lua - times the block-sparse products (moe.ops.bsmm_*,
kernels/blocksparse.cu) on CUDA at the mixtral expert-MLP shapes
(T = 16384 tokens, top-2 of E = 8 experts, d = 4096, f = 14336, bf16,
128 x 128 blocks: R = 32768 + padding rows), against a dense bf16
moe.matmul (cuBLASLt) of the same FLOPs in the same run:

  sdd        S = x @ W1 blocks            (R, d) x (E, d, f)  -> (nnz, 128, 128)
  sdd_t      S = x @ W^T blocks           (R, d) x (E, f, d)  -> (nnz, 128, 128)
  dsd        y = S @ W2                   (nnz, 128, 128) x (E, f, d) -> (R, d)
  dsd_t      dx = S @ W1^T (trans_w)      (nnz, 128, 128) x (E, d, f) -> (R, d)
  dsd_tr     dW2 = S^T @ dy               -> (E, f, d)
  dds        dW1 = x^T @ S                -> (E, d, f)
  sdd_gather, dsd_tr_gather, dds_gather: sdd, dsd_tr and dds reading the
             token rows (T, d) by the plan inside the kernel (gather = true)

FLOPs of each: 2 R d f (R the padded rows). The dense reference is
(R, d) @ (d, f) in bf16. bench/blocksparse_check.lua checks every product
(against the CPU on a smaller routing, and a few blocks of the full-size
SDD and DSD against moe.matmul). Timing (bench/lib.lua): warm-up, then
`repeats` samples of `iters` calls between two CUDA events; the median per
call.

  moe-lua bench/blocksparse.lua [json=FILE] [md=FILE] [repeats=10] [iters=5]

MOE_BSMM_TILE = 128 | 256 | 256k64 | wg in the environment selects the bf16
kernel variant (kernels/blocksparse.cu; wg, the default: the sm_90a TMA +
wgmma kernel, CTA tile 128 x 256, k-chunk 64; 256k64: mma.sync, same tile);
the variant is recorded in the results.
]]
local moe = require "moe"

local bench = dofile((arg[0]:match("^(.*)/") or ".") .. "/lib.lua")

local args = bench.config { repeats = 10, iters = 5, warmup = 3 }

assert(moe.cuda.is_available(), "bench/blocksparse.lua needs a CUDA GPU")

local function time(f)
  return (bench.time(f, { device = "cuda", iters = args.iters, repeats = args.repeats, warmup = args.warmup,
                          cooldown = args.cooldown }))
end

-- Top-k ids (T, k) of random logits, on the GPU.
local function routing(T, E, k, seed)
  moe.manual_seed(seed)
  local logits = moe.randn({ T, E }, { device = "cuda" })
  local _, ids = moe.topk(logits, k, 1)
  return ids
end

local function randn(shape, dtype, device)
  return moe.randn(shape, { dtype = dtype or "bf16", device = device or "cuda" })
end

-- ------------------------------------------------------------- mixtral

local T, E, k, d, f = 16384, 8, 2, 4096, 14336
local ids = routing(T, E, k, 1234)
local plan = moe.ops.routing_plan(ids, E, { block_size = 128, ffn_hidden = f })
local R, nnz = plan.rows, plan.nnz
print(string.format("mixtral: T=%d k=%d E=%d d=%d f=%d: R=%d padded rows (%d tokens x k), nnz=%d blocks",
  T, k, E, d, f, R, T * k, nnz))

local x, dy = randn({ R, d }), randn({ R, d })
local w1, w2 = randn({ E, d, f }), randn({ E, f, d })
local s = moe.ops.bsmm_sdd(x, w1, plan)

local flops = 2 * R * d * f
local results = {}
local function bench_product(name, shape, fn)
  local sec = time(fn)
  local r = { name = name, shape = shape, ms = sec * 1e3, tflops = flops / sec / 1e12 }
  results[#results + 1] = r
  print(string.format("%-10s %-48s %8.3f ms %7.1f TFLOP/s", name, shape, r.ms, r.tflops))
  return r
end

local a, b = randn({ R, d }), randn({ d, f })
local dense = bench_product("dense", string.format("(%d, %d) @ (%d, %d) bf16 moe.matmul", R, d, d, f),
  function() moe.matmul(a, b):free() end)
a:free(); b:free()
local w1t = randn({ E, f, d })
bench_product("sdd", "x (R, d) @ w1 (E, d, f) blocks", function() moe.ops.bsmm_sdd(x, w1, plan):free() end)
bench_product("sdd_t", "x (R, d) @ w (E, f, d)^T blocks", function()
  moe.ops.bsmm_sdd(x, w1t, plan, { trans_w = true }):free()
end)
w1t:free()
bench_product("dsd", "s @ w2 (E, f, d) -> (R, d)", function() moe.ops.bsmm_dsd(s, w2, plan):free() end)
bench_product("dsd_t", "s @ w1 (E, d, f)^T -> (R, d)", function()
  moe.ops.bsmm_dsd(s, w1, plan, { trans_w = true }):free()
end)
bench_product("dsd_tr", "s^T @ dy -> (E, f, d)", function() moe.ops.bsmm_dsd_t(s, dy, plan):free() end)
bench_product("dds", "x^T @ s -> (E, d, f)", function() moe.ops.bsmm_dds(x, s, plan):free() end)
-- the same products reading token rows (T, d) by the plan inside the kernel (gather = true)
local xt, dyt = randn({ T, d }), randn({ T, d })
bench_product("sdd_gather", "x (T, d) gathered @ w1 (E, d, f) blocks", function()
  moe.ops.bsmm_sdd(xt, w1, plan, { gather = true }):free()
end)
bench_product("dsd_tr_gather", "s^T @ dy (T, d) gathered -> (E, f, d)", function()
  moe.ops.bsmm_dsd_t(s, dyt, plan, { gather = true }):free()
end)
bench_product("dds_gather", "x (T, d) gathered ^T @ s -> (E, d, f)", function()
  moe.ops.bsmm_dds(xt, s, plan, { gather = true }):free()
end)
xt:free(); dyt:free()
for _, r in ipairs(results) do r.pct_dense = 100 * r.tflops / dense.tflops end

local variants = { ["128"] = "128x128, BK 32", ["256"] = "128x256, BK 32", ["256k64"] = "128x256, BK 64",
  wg = "128x256, BK 64, TMA + wgmma (sm_90a)" }
local tile = variants[os.getenv("MOE_BSMM_TILE") or "wg"] or variants.wg
bench.write(args, {
  title = "Block-sparse matmul on the mixtral shapes",
  device = "cuda",
  reference = "a dense bf16 moe.matmul (cuBLASLt) of the same FLOPs in the same run",
  config = { name = "mixtral", T = T, k = k, E = E, d = d, f = f, R = R, nnz = nnz, block = 128, dtype = "bf16",
             tile = tile },
  flops_per_call = flops, iters = args.iters, results = results,
  columns = { { "product", "name" }, { "operands", "shape" }, { "ms", "ms", "%.3f" }, { "TFLOP/s", "tflops", "%.1f" },
              { "% of dense", "pct_dense", "%.1f" } },
  notes = { ("T=%d, top-%d of E=%d, d=%d, f=%d, bf16, 128x128 blocks: R=%d padded rows, nnz=%d blocks; CTA tile %s; "
    .. "every product %.3g FLOPs (2 R d f)"):format(T, k, E, d, f, R, nnz, tile, flops) },
})
