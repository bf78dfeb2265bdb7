--[[
tests/lua/step_bench_spec.lua - the training-step benchmark's parts on the
CPU: bench/step_floor.lua's parameter counts against built models and its
floor arithmetic; bench/train_125m.lua profile=true on a tiny model (the
phases tile each measured step: on the host clock their sum is the step's
wall time); bench/step_report.py on those files (where python3 exists).
]]
local moe = require "moe"
local train = require "moe.train"
local data = require "moe.data"
local json = require("moe.metrics").json

local floor = dofile("bench/step_floor.lua")
local build = os.getenv("MOE_BUILD_DIR") or "build"
local exe = build .. "/moe-lua"

local function slurp(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  return s
end

local function tiny(kind)
  return { kind = kind, n_layers = 2, d_model = 16, n_heads = 2, ffn = 24, experts = kind == "dense" and 0 or 4,
    top_k = kind == "dense" and 0 or 2, seq_len = 32, batch_size = 2, vocab = 257 }
end

describe("bench/step_floor.lua", function()
  it("counts the parameters nn.TransformerLM has, total and active", function()
    for _, kind in ipairs({ "dmoe", "dense" }) do
      local m = tiny(kind)
      local cfg = train.config { model = { vocab_size = 257, d_model = m.d_model, n_layers = m.n_layers,
        n_heads = m.n_heads, pos = "rope", norm = "layernorm", tie_embeddings = true,
        ffn = kind == "dense" and "dense" or "moe", d_ff = m.ffn,
        moe = { kind = "dmoe", num_experts = 4, top_k = 2, ffn_hidden_size = m.ffn, mlp_type = "mlp",
          activation = "gelu" } }, device = "cpu", seq_len = m.seq_len }
      local model = train.build_model(cfg, "cpu")
      local total, active = floor.params(m)
      assert.are.equal(model:num_parameters(), total)
      assert.are.equal(model:num_active_parameters(), active)
    end
  end)

  it("sums the phase floors of FLOPs and bytes at the rates given", function()
    local m = floor.PRESETS.dmoe46
    local r = floor.floor(m, 1e15, 1e12)
    local P = r.params
    assert.are.equal(36 * P, r.bytes_weights)
    assert.are.equal(30 * P, r.bytes_optimizer)
    assert.are.equal(16 * 1024, r.tokens)
    -- 6 active T + the causal attention matmuls
    assert.are.equal(6 * r.active_params * r.tokens + 6 * 6 * 512 * 1024 * r.tokens, r.flops)
    assert.is_true(math.abs(r.floor - (r.floor_fwd + r.floor_bwd + r.floor_opt)) < 1e-12)
    assert.is_true(math.abs(r.floor_opt - 30 * P / 1e12) < 1e-12)
    assert.is_true(r.floor_kernels >= r.floor)
    assert.is_true(r.overlap_floor <= r.floor)
    -- compute-bound at a slow GEMM rate: the floor is the FLOPs' time
    local slow = floor.floor(floor.PRESETS.dense125, 1e12, 1e15)
    assert.is_true(math.abs(slow.floor - slow.flops / 1e12) / slow.floor < 1e-3)
  end)

  it("refuses missing rates and unknown models with one line", function()
    local p = io.popen(exe .. " bench/step_floor.lua 2>&1; echo rc=$?")
    local out = p:read("a")
    p:close()
    assert.truthy(out:find("step_floor: gemm_tflops= and copy_tbs=", 1, true), out)
    assert.falsy(out:find("traceback", 1, true), out)
    p = io.popen(exe .. " bench/step_floor.lua gemm_tflops=1 copy_tbs=1 models=gpt9 2>&1; echo rc=$?")
    out = p:read("a")
    p:close()
    assert.truthy(out:find("step_floor: unknown model 'gpt9' (valid: dense125, dmoe125, dmoe46, custom)", 1, true), out)
  end)
end)

describe("bench/train_125m.lua profile=true", function()
  local root = moe.proc.mkdtemp("step-bench")
  local prefix = root .. "/bytes"
  local b = data.IndexedDatasetBuilder(prefix, { dtype = "u16" })
  for d = 1, 40 do
    local ids = {}
    for i = 1, 120 do ids[i] = 32 + (d * 13 + i * 7) % 90 end
    ids[#ids + 1] = 256
    b:add_document(ids)
  end
  b:finalize()

  it("profiles the phases of each measured step; they add up to its wall time", function()
    local js = root .. "/prof.json"
    local cmd = table.concat({ exe, "bench/train_125m.lua", "device=cpu", "dtype=f32", "n_layers=1", "d_model=16",
      "n_heads=2", "ffn=32", "experts=4", "seq_len=16", "batch_size=2", "steps=9", "log_every=2", "profile=true",
      "profile_steps=5", "data=" .. prefix, "out_dir=" .. root .. "/run", "json=" .. js, "2>&1" }, " ")
    local p = io.popen(cmd)
    local out = p:read("a")
    p:close()
    local r = json.decode(assert(slurp(js), out))
    local prof = r.profile
    assert.are.equal("host clock", prof.method)
    assert.are.equal(5, prof.steps_measured)
    assert.are.equal(0, prof.steps_saturated) -- no blocker on the CPU
    local names, sum = {}, 0
    for i, ph in ipairs(prof.phases) do
      names[i] = ph.phase
      assert.is_true(ph.host_ms >= 0 and ph.gpu_ms >= 0)
      sum = sum + ph.host_ms
    end
    assert.are.same(require("moe.train.loop").PHASES, names)
    assert.is_true(prof.wall_ms > 0)
    assert.is_true(math.abs(sum - prof.wall_ms) <= 1e-6 * prof.wall_ms, ("%g vs %g"):format(sum, prof.wall_ms))
    assert.truthy(out:find("train_125m: profile (host clock) of 5 measured + 0 saturated steps", 1, true), out)

    -- step_report.py joins it with a floor and a timed run
    if os.execute("python3 -c 'import json' >/dev/null 2>&1") then
      local dir = root .. "/round"
      os.execute("mkdir -p '" .. dir .. "'")
      os.execute(("cp '%s' '%s/prof_dmoe46.json'; cp '%s' '%s/moe_dmoe46.json'"):format(js, dir, js, dir))
      os.execute(exe .. " bench/step_floor.lua gemm_tflops=700 copy_tbs=3 models=dmoe46 json=" .. dir ..
        "/floor.json >/dev/null 2>&1")
      p = io.popen("python3 bench/step_report.py '" .. dir .. "' dmoe46 2>&1")
      local table_out = p:read("a")
      p:close()
      local ms = ("%.1f"):format(r.ms_per_step)
      assert.truthy(table_out:find("| dmoe46 | moe-lua | " .. ("%.0f"):format(r.tokens_per_s) .. " | " .. ms .. " | " ..
        ("%.1f"):format(1e3 * floor.floor(floor.PRESETS.dmoe46, 700e12, 3e12).floor), 1, true), table_out)
      assert.truthy(table_out:find("| dmoe46 | torch eager | not run", 1, true), table_out)
      local md = slurp(dir .. "/step_round.md")
      assert.truthy(md and md:find("### dmoe46: one step by phase (host clock, 5 measured", 1, true), md)
    end
    os.execute("rm -rf '" .. root .. "'")
  end)
end)
