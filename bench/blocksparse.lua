--[[
bench/blocksparse.lua - times the block-sparse products (moe.ops.bsmm_*,
kernels/blocksparse.cu) on CUDA at the mixtral expert-MLP shapes of issue 4
(T = 16384 tokens, top-2 of E = 8 experts, d = 4096, f = 14336, bf16,
128 x 128 blocks: R = 32768 + padding rows), against a dense bf16
moe.matmul (cuBLASLt) of the same FLOPs in the same run:

  sdd        S = x @ W1 blocks            (R, d) x (E, d, f)  -> (nnz, 128, 128)
  sdd_t      S = x @ W^T blocks           (R, d) x (E, f, d)  -> (nnz, 128, 128)
  dsd        y = S @ W2                   (nnz, 128, 128) x (E, f, d) -> (R, d)
  dsd_t      dx = S @ W1^T (trans_w)      (nnz, 128, 128) x (E, d, f) -> (R, d)
  dsd_tr     dW2 = S^T @ dy               -> (E, f, d)
  dds        dW1 = x^T @ S                -> (E, d, f)

FLOPs of each: 2 R d f (R the padded rows). The dense reference is
(R, d) @ (d, f) in bf16. Results are checked first: every product against
the CPU (which multiplies the same bf16 values in f32) on a smaller
routing, and a few blocks of the full-size SDD and DSD against moe.matmul.
Timing: warm-up, then `repeats` samples of `iters` calls between two CUDA
events; the median per call.

  moe-lua bench/blocksparse.lua [--json FILE] [--md FILE] [--repeats N]

MOE_BSMM_TILE = 128 | 256 | 256k64 | wg in the environment selects the bf16
kernel variant (kernels/blocksparse.cu; wg, the default: the sm_90a TMA +
wgmma kernel, CTA tile 128 x 256, k-chunk 64; 256k64: mma.sync, same tile);
the variant is recorded in the results.
]]
local moe = require "moe"

local args = { json = nil, md = nil, repeats = 10, iters = 5 }
do
  local i = 1
  while i <= #arg do
    local a = arg[i]
    if a == "--json" then args.json = arg[i + 1]; i = i + 2
    elseif a == "--md" then args.md = arg[i + 1]; i = i + 2
    elseif a == "--repeats" then args.repeats = tonumber(arg[i + 1]); i = i + 2
    else error("unknown argument " .. a) end
  end
end

assert(moe.cuda.is_available(), "bench/blocksparse.lua needs a CUDA GPU")

local function median(t)
  table.sort(t)
  local n = #t
  if n % 2 == 1 then return t[(n + 1) // 2] end
  return (t[n // 2] + t[n // 2 + 1]) / 2
end

local function time(f)
  for _ = 1, 3 do f() end
  moe.cuda.synchronize()
  local e0, e1 = moe.Event("cuda"), moe.Event("cuda")
  local samples = {}
  for r = 1, args.repeats do
    e0:record()
    for _ = 1, args.iters do f() end
    e1:record(); e1:synchronize()
    samples[r] = e0:elapsed(e1) / 1e3 / args.iters
  end
  e0:free(); e1:free()
  return median(samples)
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

-- Largest |gpu - cpu| over the largest |cpu|.
local function rel_err(gpu, cpu)
  local d = (gpu:to("cpu"):to("f32") - cpu:to("f32")):abs():max():item()
  local big = cpu:to("f32"):abs():max():item()
  return d / math.max(big, 1e-30)
end

-- ------------------------------------------------------------ validation

local validation = {}
local function check(name, err, tol)
  validation[#validation + 1] = { name = name, rel_err = err, ok = err <= tol }
  print(string.format("check %-28s rel err %.2e (tol %.0e) %s", name, err, tol,
    err <= tol and "ok" or "FAILED"))
end

do -- every product against the CPU on a small routing (bf16 in, f32 accumulate on both)
  local T, E, k, d, f = 1000, 8, 2, 264, 384
  local ids = routing(T, E, k, 7)
  local pg = moe.ops.routing_plan(ids, E, { block_size = 128, ffn_hidden = f })
  local pc = moe.ops.routing_plan(ids:to("cpu"), E, { block_size = 128, ffn_hidden = f })
  local R, nnz = pg.rows, pg.nnz
  local x, w1, w2 = randn({ R, d }, "bf16", "cpu"), randn({ E, d, f }, "bf16", "cpu"),
    randn({ E, f, d }, "bf16", "cpu")
  local s, dy = randn({ nnz, 128, 128 }, "bf16", "cpu"), randn({ R, d }, "bf16", "cpu")
  local G = function(t) return t:to("cuda") end
  -- one bf16 rounding of the result (2^-8) relative to the largest value: 1e-2
  local tol = 1e-2
  check("sdd", rel_err(moe.ops.bsmm_sdd(G(x), G(w1), pg), moe.ops.bsmm_sdd(x, w1, pc)), tol)
  check("sdd trans_w", rel_err(moe.ops.bsmm_sdd(G(x), G(w2), pg, { trans_w = true }),
    moe.ops.bsmm_sdd(x, w2, pc, { trans_w = true })), tol)
  check("dsd", rel_err(moe.ops.bsmm_dsd(G(s), G(w2), pg), moe.ops.bsmm_dsd(s, w2, pc)), tol)
  check("dsd trans_w", rel_err(moe.ops.bsmm_dsd(G(s), G(w1), pg, { trans_w = true }),
    moe.ops.bsmm_dsd(s, w1, pc, { trans_w = true })), tol)
  check("dsd_t", rel_err(moe.ops.bsmm_dsd_t(G(s), G(dy), pg), moe.ops.bsmm_dsd_t(s, dy, pc)), tol)
  check("dds", rel_err(moe.ops.bsmm_dds(G(x), G(s), pg), moe.ops.bsmm_dds(x, s, pc)), tol)
  check("f32 dsd", rel_err(moe.ops.bsmm_dsd(G(s:to("f32")), G(w2:to("f32")), pg),
    moe.ops.bsmm_dsd(s:to("f32"), w2:to("f32"), pc)), 1e-5)
end

-- ------------------------------------------------------------- mixtral

local T, E, k, d, f = 16384, 8, 2, 4096, 14336
local ids = routing(T, E, k, 1234)
local plan = moe.ops.routing_plan(ids, E, { block_size = 128, ffn_hidden = f })
local R, nnz, F = plan.rows, plan.nnz, plan.ffn_blocks
print(string.format("mixtral: T=%d k=%d E=%d d=%d f=%d: R=%d padded rows (%d tokens x k), nnz=%d blocks",
  T, k, E, d, f, R, T * k, nnz))

local x, dy = randn({ R, d }), randn({ R, d })
local w1, w2 = randn({ E, d, f }), randn({ E, f, d })
local s = moe.ops.bsmm_sdd(x, w1, plan)

do -- a few blocks of the full-size products against cuBLAS
  local ri, ci = plan.bs_row_indices:to("cpu"):totable(), plan.bs_column_indices:to("cpu"):totable()
  local worst = 0
  for _, i in ipairs({ 0, 1, nnz // 3, nnz // 2 + 5, nnz - 1 }) do
    local rb, e, c = ri[i + 1], ci[i + 1] // F, ci[i + 1] % F
    local want = moe.matmul(x:narrow(0, rb * 128, 128), w1:select(0, e):narrow(1, c * 128, 128))
    worst = math.max(worst, rel_err(s:select(0, i), want:to("cpu")))
  end
  check("mixtral sdd blocks vs matmul", worst, 1e-2)
  local y = moe.ops.bsmm_dsd(s, w2, plan)
  worst = 0
  for _, rb in ipairs({ 0, (R // 128) // 2, R // 128 - 1 }) do
    local e = ci[rb * F + 1] // F
    -- the row block's F blocks side by side: (128, f)
    local srow = s:narrow(0, rb * F, F):permute(1, 0, 2):reshape(128, f)
    local want = moe.matmul(srow, w2:select(0, e))
    worst = math.max(worst, rel_err(y:narrow(0, rb * 128, 128), want:to("cpu")))
  end
  check("mixtral dsd rows vs matmul", worst, 2e-2)
  y:free()
end

local flops = 2 * R * d * f
local results = {}
local function bench(name, shape, fn)
  local sec = time(fn)
  local r = { name = name, shape = shape, ms = sec * 1e3, tflops = flops / sec / 1e12 }
  results[#results + 1] = r
  print(string.format("%-10s %-48s %8.3f ms %7.1f TFLOP/s", name, shape, r.ms, r.tflops))
  return r
end

local a, b = randn({ R, d }), randn({ d, f })
local dense = bench("dense", string.format("(%d, %d) @ (%d, %d) bf16 moe.matmul", R, d, d, f),
  function() moe.matmul(a, b):free() end)
a:free(); b:free()
local w1t = randn({ E, f, d })
bench("sdd", "x (R, d) @ w1 (E, d, f) blocks", function() moe.ops.bsmm_sdd(x, w1, plan):free() end)
bench("sdd_t", "x (R, d) @ w (E, f, d)^T blocks", function()
  moe.ops.bsmm_sdd(x, w1t, plan, { trans_w = true }):free()
end)
w1t:free()
bench("dsd", "s @ w2 (E, f, d) -> (R, d)", function() moe.ops.bsmm_dsd(s, w2, plan):free() end)
bench("dsd_t", "s @ w1 (E, d, f)^T -> (R, d)", function()
  moe.ops.bsmm_dsd(s, w1, plan, { trans_w = true }):free()
end)
bench("dsd_tr", "s^T @ dy -> (E, f, d)", function() moe.ops.bsmm_dsd_t(s, dy, plan):free() end)
bench("dds", "x^T @ s -> (E, d, f)", function() moe.ops.bsmm_dds(x, s, plan):free() end)
for _, r in ipairs(results) do r.pct_dense = 100 * r.tflops / dense.tflops end

local variants = { ["128"] = "128x128, BK 32", ["256"] = "128x256, BK 32", ["256k64"] = "128x256, BK 64",
  wg = "128x256, BK 64, TMA + wgmma (sm_90a)" }
local tile = variants[os.getenv("MOE_BSMM_TILE") or "wg"] or variants.wg
local info = moe.build_info()
local gpu = (info.gpus or {})[1] or {}
local date = os.date("!%Y-%m-%dT%H:%M:%SZ")
if args.json then
  local parts, vparts = {}, {}
  for _, r in ipairs(results) do
    parts[#parts + 1] = string.format('{"name": "%s", "shape": "%s", "ms": %.4f, "tflops": %.2f, ' ..
      '"pct_dense": %.1f}', r.name, r.shape, r.ms, r.tflops, r.pct_dense)
  end
  for _, v in ipairs(validation) do
    vparts[#vparts + 1] = string.format('{"name": "%s", "rel_err": %.3e, "ok": %s}', v.name,
      v.rel_err, tostring(v.ok))
  end
  local fh = assert(io.open(args.json, "w"))
  fh:write(string.format('{"tool": "moe-lua %s", "device": "%s", "cuda_runtime": %s, "date": "%s",\n' ..
    ' "config": {"name": "mixtral", "T": %d, "k": %d, "E": %d, "d": %d, "f": %d, "R": %d, "nnz": %d,' ..
    ' "block": 128, "dtype": "bf16", "tile": "%s"},\n "flops_per_call": %.0f, "repeats": %d,' ..
    ' "iters": %d,\n' ..
    ' "validation": [%s],\n "results": [%s]}\n', tostring(info.version), gpu.name or "?",
    tostring(info.cuda_runtime), date, T, k, E, d, f, R, nnz, tile, flops, args.repeats, args.iters,
    table.concat(vparts, ", "), table.concat(parts, ",\n  ")))
  fh:close()
end
if args.md then
  local fh = assert(io.open(args.md, "w"))
  fh:write(string.format("# Block-sparse matmul on the mixtral shapes\n\nDevice %s, %s, moe-lua %s " ..
    "(CUDA runtime %s). T=%d, top-%d of E=%d, d=%d, f=%d, bf16, 128x128 blocks: R=%d padded rows, " ..
    "nnz=%d blocks; CTA tile %s; every product %.3g FLOPs (2 R d f). Median of %d x %d calls " ..
    "between CUDA events." ..
    "\n\n| product | operands | ms | TFLOP/s | %% of dense |\n|---|---|---|---|---|\n",
    gpu.name or "?", date, tostring(info.version), tostring(info.cuda_runtime), T, k, E, d, f, R, nnz,
    tile, flops, args.repeats, args.iters))
  for _, r in ipairs(results) do
    fh:write(string.format("| %s | %s | %.3f | %.1f | %.1f |\n", r.name, r.shape, r.ms, r.tflops,
      r.pct_dense))
  end
  fh:write("\nChecks (relative to the largest reference value):\n\n")
  for _, v in ipairs(validation) do
    fh:write(string.format("- %s: %.2e %s\n", v.name, v.rel_err, v.ok and "ok" or "FAILED"))
  end
  fh:close()
end
