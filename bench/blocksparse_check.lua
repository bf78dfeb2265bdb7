--[[
bench/blocksparse_check.lua - checks the block-sparse products that
bench/blocksparse.lua times (moe.ops.bsmm_*, kernels/blocksparse.cu):
every product against the CPU (which multiplies the same bf16 values in
f32) on a smaller routing (T 1000, E 8, k 2, d 264, f 384, and one f32
DSD), and a few blocks of the full-size mixtral SDD and DSD against
moe.matmul. Fails (non-zero exit) when one is off.

  moe-lua bench/blocksparse_check.lua [json=FILE] [full=true]

MOE_BSMM_TILE = 128 | 256 | 256k64 | wg in the environment selects the
kernel variant checked, as for the benchmark.
]]
local moe = require "moe"
local bench = dofile((arg[0]:match("^(.*)/") or ".") .. "/lib.lua")

local args = moe.config { json = "", md = "", full = true }
assert(moe.cuda.is_available(), "bench/blocksparse_check.lua needs a CUDA GPU")

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

if args.full then
  local T, E, k, d, f = 16384, 8, 2, 4096, 14336
  local ids = routing(T, E, k, 1234)
  local plan = moe.ops.routing_plan(ids, E, { block_size = 128, ffn_hidden = f })
  local R, nnz, F = plan.rows, plan.nnz, plan.ffn_blocks
  local x = randn({ R, d })
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
  for _, t in ipairs({ x, w1, w2, s }) do t:free() end
end

local failed = 0
for _, v in ipairs(validation) do if not v.ok then failed = failed + 1 end end
bench.write(args, { title = "Block-sparse products checked", device = "cuda",
  reference = "the CPU in f32 on the same bf16 values; moe.matmul (cuBLASLt) for the full-size blocks",
  validation = validation, rows = validation,
  columns = { { "check", "name" }, { "rel err", "rel_err", "%.2e" }, { "ok", "ok" } } })
assert(failed == 0, "blocksparse_check: " .. failed .. " check(s) failed")
