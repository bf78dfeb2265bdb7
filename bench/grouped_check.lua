--[[
bench/grouped_check.lua - checks every grouped-GEMM backend ("loop",
"cublas_grouped", "streams", "auto") on the six GEMMs of the GLU expert MLP
that bench/grouped.lua times (see there), for the three MoE configs:
  - on a small problem with each config's E (32 tokens per expert on
    average, odd d = 72 and f = 40) against the CPU (the same bf16 values,
    f32 math);
  - at full size (T = 16384, random top-k routing as bench/grouped.lua),
    fwd_13 and wgrad_13 of every backend against "loop".
Fails (non-zero exit) when one is off.

  moe-lua bench/grouped_check.lua [json=FILE] [configs=mixtral,olmoe,qwen3] [full=true]

Tolerance 2^-6 of the largest reference value: bf16 output rounding (2^-8
relative) dominates; f32 sums in another order add little.
]]
local moe = require "moe"
local bench = dofile((arg[0]:match("^(.*)/") or ".") .. "/lib.lua")

local args = moe.config { json = "", md = "", configs = { "mixtral", "olmoe", "qwen3" }, full = true }
assert(moe.cuda.is_available(), "bench/grouped_check.lua needs a CUDA GPU")

local P = dofile((arg[0]:match("^(.*)/") or ".") .. "/grouped_problem.lua")
local CONFIGS, T, OPS = P.CONFIGS, P.T, P.OPS
local route, ops, operands, free_all = P.route, P.ops, P.operands, P.free_all
local BACKENDS = { "loop", "cublas_grouped", "streams", "auto" }

-- max |a - b| / max |b|, computed on b's device in f32
local function rel_err(a, b)
  local af, bf = a:to("f32", b.device), b:to("f32")
  local diff = (af - bf):abs():max():item()
  local big = bf:abs():max():item()
  af:free(); bf:free()
  return diff / math.max(big, 1e-30)
end

local validation = {}
local failed = 0
local function record(v)
  validation[#validation + 1] = v
  if not v.ok then failed = failed + 1 end
end
local wanted = {}
for _, name in ipairs(args.configs) do wanted[name] = true end

for _, c in ipairs(CONFIGS) do
  if wanted[c.name] then
    -- small check against the CPU: same E, 32 tokens per expert on average, odd d and f
    do
      local offs = route(c.E, c.k, 32 * c.E // c.k, 99)
      local R, d, f = offs[#offs], 72, 40
      local g = operands(R, c.E, d, f, "cuda")
      local cpu = {}
      for n, t in pairs(g) do cpu[n] = t:to("f32", "cpu") end
      local ref = ops(cpu, offs)
      for _, b in ipairs(BACKENDS) do
        moe.ops.grouped_backend(b)
        local got = ops(g, offs)
        for _, op in ipairs(OPS) do
          local r, x = ref[op](), got[op]()
          -- bf16 output rounding (2^-8 relative) dominates; f32 sums in another order add little
          local e = rel_err(x, r)
          local ok = e < 2 ^ -6
          record({ config = c.name, backend = b, op = op, rel_err = e, ok = ok })
          if not ok then print(string.format("validate %s %s %s: %.2e FAILED", c.name, b, op, e)) end
          r:free(); x:free()
        end
      end
      free_all(g); free_all(cpu)
      print(string.format("validate %-8s small problem vs CPU: done (%d backends x 6 GEMMs)", c.name,
        #BACKENDS))
    end

    if args.full then
      local offs = route(c.E, c.k, T, 1234)
      local R = offs[#offs]
      local o = operands(R, c.E, c.d, c.f, "cuda")
      -- full size: every backend against loop
      do
        moe.ops.grouped_backend("loop")
        local base = ops(o, offs)
        local ref = { fwd_13 = base.fwd_13(), wgrad_13 = base.wgrad_13() }
        for _, b in ipairs({ "cublas_grouped", "streams", "auto" }) do
          moe.ops.grouped_backend(b)
          local got = ops(o, offs)
          for op, r in pairs(ref) do
            local x = got[op]()
            local e = rel_err(x, r)
            local ok = e < 2 ^ -6
            record({ config = c.name, backend = b, op = op .. " (full size vs loop)", rel_err = e, ok = ok })
            print(string.format("validate %-8s %-15s %-9s full size vs loop: %.2e %s", c.name, b, op, e,
              ok and "ok" or "FAILED"))
            x:free()
          end
        end
        for _, r in pairs(ref) do r:free() end
      end
      free_all(o)
      collectgarbage()
      moe.empty_cache()
    end
    moe.ops.grouped_backend("auto")
  end
end

bench.write(args, { title = "Grouped GEMM backends checked", device = "cuda",
  reference = "the CPU in f32 on the same bf16 values (small problem); the loop backend (full size)",
  T = T, validation = validation, rows = validation,
  columns = { { "config", "config" }, { "backend", "backend" }, { "op", "op" }, { "rel err", "rel_err", "%.2e" },
              { "ok", "ok" } } })
assert(failed == 0, "grouped_check: " .. failed .. " check(s) failed")
