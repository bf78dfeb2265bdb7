--[[
tests/lua/moe_mlp_report_spec.lua - bench/moe_mlp_report.py, which joins the
expert-MLP benchmark's two sides and judges the fine-grained kernels'
targets, run on made-up inputs: the percentages of the higher of the two
dense rates, each target at its threshold and just below, every moe-lua path
against the faster torch._grouped_mm, skipped rows, gathered runs named by
their MOE_BSMM_GATHER and their memory against ScatterMoE's, the dense bound and the
best path's share of the dense MLP's speed, and bad arguments (a clear
message, exit status 1); then the real Lua side: bench/moe_mlp.lua's smoke
run on the CPU ($MOE_BUILD_DIR/moe-lua), joined with a torch side made from
its rows, so that a change to either JSON the report does not follow shows
here. Needs only Python 3's standard library; without a python3 the spec is
pending ("SKIPPED ..."), with CI set it fails instead.

Run: moe-lua tests/lua/busted.lua tests/lua/moe_mlp_report_spec.lua (ctest does).
]]
local json = require("moe.metrics").json

local function sh_quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

local spec_dir = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests/lua"
local script = spec_dir .. "/../../bench/moe_mlp_report.py"
local python = os.getenv("MOE_PYTHON") or "python3"
local have_python = os.execute(sh_quote(python) .. " -c 'import json' >/dev/null 2>&1")

local dir = os.tmpname()
os.remove(dir)
assert(os.execute("mkdir -p " .. sh_quote(dir)))
local function P(name) return dir .. "/" .. name end
lazy_teardown(function() os.execute("rm -rf " .. sh_quote(dir)) end)

local function write(path, v)
  local f = assert(io.open(path, "w"))
  f:write(type(v) == "string" and v or json.encode(v))
  f:close()
end
local read = dofile(spec_dir .. "/read_file.lua")

-- The report over args; returns ok, the exit status and its stdout + stderr.
local function report(args)
  local p = assert(io.popen(sh_quote(python) .. " " .. sh_quote(script) .. " " .. args .. " 2>&1"))
  local out = p:read("a")
  local ok, _, code = p:close()
  return ok, code, out
end

local SHAPES = {
  mixtral = { d = 4096, f = 14336, E = 8, k = 2 },
  olmoe = { d = 2048, f = 1024, E = 64, k = 8 },
  qwen3 = { d = 2048, f = 768, E = 128, k = 8 },
}
-- A row of config c for impl timed at pct % of a dense rate of `rate` TFLOP/s.
local function row(c, impl, pct, rate, extra)
  local s = SHAPES[c]
  local flops = 18 * 16384 * s.k * s.d * s.f
  local tflops = rate * pct / 100
  local r = { config = c, impl = impl, T = 16384, d = s.d, f = s.f, E = s.E, k = s.k,
    tflops = tflops, ms = flops / (tflops * 1e12) * 1e3, peak_extra_bytes = 2 ^ 30 }
  for k, v in pairs(extra or {}) do r[k] = v end
  return r
end

-- Both sides' JSON: rows as {config, impl, pct} (percentages of the faster dense rate,
-- torch's 800 TFLOP/s against moe-lua's 700) or, on the moe-lua side, a row as written.
local function inputs(name, moe_rows, torch_rows)
  local m, t = {}, {}
  for _, r in ipairs(moe_rows) do m[#m + 1] = r.config and r or row(r[1], r[2], r[3], 800) end
  for _, r in ipairs(torch_rows) do t[#t + 1] = row(r[1], r[2], r[3], 800) end
  write(P(name .. "_moe.json"), { device = "GPU", date = "2026-01-01T00:00:00Z", tool = "moe-lua",
    T = 16384, dense = { tflops = 700 }, results = m })
  write(P(name .. "_torch.json"), { device = "GPU", tool = "torch", cuda = "13.0",
    dense = { tflops = 800 }, results = t })
  return P(name .. "_moe.json") .. " " .. P(name .. "_torch.json") .. " " .. P(name)
end

local function run(name, moe_rows, torch_rows)
  local ok, code, out = report(inputs(name, moe_rows, torch_rows) .. " --command 'bench test'")
  assert(ok, ("report failed (%s): %s"):format(tostring(code), out))
  return json.decode(read(P(name .. "/moe_mlp.json"))), read(P(name .. "/moe_mlp.md"))
end

-- Every target met: mixtral at exactly 88 % (the threshold counts), the fine-grained at 60 %,
-- both paths faster than torch's faster _grouped_mm.
local MET = {
  moe = { { "mixtral", "grouped", 88 }, { "mixtral", "sparse", 86 }, { "olmoe", "grouped", 60 },
    { "olmoe", "sparse", 61 }, { "qwen3", "grouped", 59 }, { "qwen3", "sparse", 60 } },
  torch = { { "mixtral", "torch_grouped_mm", 70 }, { "mixtral", "torch_grouped_mm_compiled", 80 },
    { "olmoe", "torch_grouped_mm", 30 }, { "olmoe", "torch_grouped_mm_compiled", 35 },
    { "qwen3", "torch_grouped_mm", 25 }, { "qwen3", "torch_grouped_mm_compiled", 28 } },
}
local function copy(rows)
  local t = {}
  for i, r in ipairs(rows) do t[i] = { r[1], r[2], r[3] } end
  return t
end

describe("bench/moe_mlp_report.py", function()
  if not have_python then
    if os.getenv("CI") then
      it("runs", function() error("python3 is required in CI (" .. python .. ")") end)
    else
      print("\nSKIPPED (no " .. python .. "): tests/lua/moe_mlp_report_spec.lua")
      pending("no " .. python)
    end
    return
  end

  it("takes percentages of the higher dense rate and meets every target at its threshold", function()
    local out, md = run("met", MET.moe, MET.torch)
    assert.are.equal(800, out.dense.reference_tflops)
    local t = out.targets
    assert.is_true(math.abs(t.best_pct_dense.mixtral.pct_dense - 88) < 1e-9)
    assert.are.equal("grouped", t.best_pct_dense.mixtral.impl)
    assert.is_true(t.best_pct_dense.mixtral.met)
    assert.is_false(t.best_pct_dense.mixtral.goal_met) -- 90
    assert.are.equal("sparse", t.best_pct_dense.qwen3.impl)
    assert.is_true(t.best_pct_dense.olmoe.met and t.best_pct_dense.qwen3.met)
    assert.are.equal("torch_grouped_mm_compiled", t.faster_than_best_torch_grouped_mm.mixtral.torch_best)
    assert.is_true(t.resolve_time_met)
    assert.truthy(md:find("| mixtral | 16384 | 4096 | 14336 | 8 | 2 | grouped |", 1, true))
    assert.truthy(md:find("- time targets: met", 1, true))
    assert.truthy(md:find("- command: `bench test`", 1, true))
    assert.are.equal("ScatterMoE did not run: its peak extra memory is not compared in this run", t.memory)
  end)

  it("fails a config just below its percentage, and a path slower than torch", function()
    local m = copy(MET.moe)
    m[1][3] = 87.9 -- mixtral grouped, and sparse stays at 86
    local out, md = run("below", m, MET.torch)
    assert.is_false(out.targets.best_pct_dense.mixtral.met)
    assert.is_false(out.targets.resolve_time_met)
    assert.truthy(md:find(">= 88% of dense on mixtral: 87.9%: NOT met", 1, true))

    m = copy(MET.moe)
    m[4][3] = 34.9 -- olmoe sparse, below compiled torch's 35
    out, md = run("slower", m, MET.torch)
    assert.is_true(out.targets.best_pct_dense.olmoe.met) -- grouped still at 60
    assert.is_false(out.targets.faster_than_best_torch_grouped_mm.olmoe.sparse)
    assert.is_true(out.targets.faster_than_best_torch_grouped_mm.olmoe.grouped)
    assert.is_false(out.targets.resolve_time_met)
    assert.truthy(md:find("- sparse faster than torch_grouped_mm_compiled on olmoe: ", 1, true))
    assert.truthy(md:find("NOT met\n", 1, true))
  end)

  it("lists a skipped row without timing it, and a missing torch side is not met", function()
    local m = copy(MET.moe)
    local skipped = { config = "qwen3", impl = "grouped_cublas", T = 16384, d = 2048, f = 768, E = 128, k = 8,
      error = "too slow to time" }
    m[#m + 1] = skipped
    local torch = {}
    for _, r in ipairs(MET.torch) do if r[1] ~= "qwen3" then torch[#torch + 1] = r end end
    local out, md = run("skipped", m, torch)
    assert.truthy(md:find("| qwen3 | 16384 | 2048 | 768 | 128 | 8 | grouped_cublas | skipped: too slow to time |", 1, true))
    assert.is_false(out.targets.faster_than_best_torch_grouped_mm.qwen3.grouped)
    assert.is_false(out.targets.resolve_time_met)
    assert.truthy(md:find("- grouped faster than torch._grouped_mm on qwen3: ", 1, true))
  end)

  it("reports the dense bound and the best path's share of the dense MLP's speed", function()
    local torch = copy(MET.torch)
    torch[#torch + 1] = { "mixtral", "torch_dense_mlp", 85 }
    torch[#torch + 1] = { "mixtral", "torch_dense_mlp_compiled", 90 }
    torch[#torch + 1] = { "mixtral", "torch_dense_gemms", 95 }
    local out, md = run("bound", MET.moe, torch)
    local b = out.targets.dense_bound.mixtral
    assert.are.equal("torch_dense_mlp_compiled", b.dense_mlp.impl)
    assert.is_true(math.abs(b.best_pct_of_dense_mlp_speed - 100 * 88 / 90) < 1e-9)
    assert.is_true(math.abs(b.dense_gemms.pct_dense - 95) < 1e-9)
    assert.is_nil(out.targets.dense_bound.olmoe)
    assert.truthy(md:find("best moe%-lua path [%d.]+ ms, 88%.0%%, at 97%.8%% of the dense MLP's speed"))
  end)

  it("adds gathered runs by their MOE_BSMM_GATHER and weighs their memory against ScatterMoE's", function()
    local base = inputs("gath", MET.moe, MET.torch)
    -- ScatterMoE on qwen3 at 2 GiB; the default paths at 1 GiB (row()), the gathered ones below
    local t = json.decode(read(P("gath_torch.json")))
    t.results[#t.results + 1] = row("qwen3", "scattermoe", 20, 800, { peak_extra_bytes = 2 * 2 ^ 30 })
    write(P("gath_torch.json"), t)
    local function gathered(name, mode, gib)
      local rs = { row("qwen3", "grouped", 55, 800, { peak_extra_bytes = gib * 2 ^ 30 }),
        row("qwen3", "sparse", 54, 800, { peak_extra_bytes = gib * 2 ^ 30 }),
        row("qwen3", "auto:grouped", 55, 800) }
      write(P(name), { device = "GPU", date = "2026-01-01T00:00:00Z", dense = { tflops = 700 },
        bsmm_gather = mode, results = rs })
      return P(name)
    end
    local g1, gw = gathered("g1.json", "1", 1.5), gathered("gw.json", "wgrad", 1.7)
    local old = gathered("gold.json", true, 1.5) -- the JSON before the knob took wgrad
    local ok, code, out = report(base .. " --gathered " .. g1 .. " --gathered " .. gw)
    assert(ok, ("report failed (%s): %s"):format(tostring(code), out))
    local j, md = json.decode(read(P("gath/moe_mlp.json"))), read(P("gath/moe_mlp.md"))
    local impls = {}
    for _, r in ipairs(j.rows) do if r.config == "qwen3" then impls[r.impl] = r end end
    for _, i in ipairs({ "grouped_gather", "sparse_gather", "grouped_gather_wgrad", "sparse_gather_wgrad" }) do
      assert.is_table(impls[i], i)
      assert.are.equal("moe-lua", impls[i].side)
    end
    assert.is_true(math.abs(impls.grouped_gather_wgrad.pct_dense - 55) < 1e-9)
    assert.is_nil(impls["auto:grouped_gather"]) -- only the grouped and sparse rows join
    local m = j.targets.memory.qwen3
    assert.is_true(m.grouped.met and m.grouped.goal_met) -- 1 GiB against 2: 0.8x needs <= 1.6
    assert.is_true(m.grouped_gather.goal_met)
    assert.is_true(m.sparse_gather_wgrad.met)
    assert.is_false(m.sparse_gather_wgrad.goal_met) -- 1.7 > 1.6
    assert.is_nil(j.targets.memory.mixtral) -- ScatterMoE did not run there
    assert.truthy(md:find("- grouped_gather_wgrad peak extra memory <= ScatterMoE's on qwen3: 1.70 vs 2.00 GiB: met", 1,
      true), md)
    -- the best path and the torch comparison stay the default paths'
    assert.are.equal("sparse", j.targets.best_pct_dense.qwen3.impl)
    assert.is_nil(j.targets.faster_than_best_torch_grouped_mm.qwen3.grouped_gather)
    -- an older JSON's bsmm_gather = true is MOE_BSMM_GATHER=1
    ok, code, out = report(base .. " --gathered " .. old)
    assert(ok, ("report failed (%s): %s"):format(tostring(code), out))
    assert.truthy(read(P("gath/moe_mlp.md")):find("| qwen3 | 16384 | 2048 | 768 | 128 | 8 | grouped_gather |", 1, true))
  end)

  it("stops with a message naming a missing file, a wrong file, a bad option or argument count", function()
    local good = inputs("args", MET.moe, MET.torch)
    local moe_json, torch_json = good:match("^(%S+) (%S+)")
    local cases = {
      { P("nope.json") .. " " .. torch_json, "cannot read MOE_JSON %(bench/moe_mlp.lua%) '[^']*nope.json'" },
      { moe_json .. " " .. P("nope.json"), "cannot read TORCH_JSON" },
      { moe_json, "expected MOE_JSON TORCH_JSON %[OUTDIR%], got 1 arguments" },
      { good .. " --bogus", "unknown option %-%-bogus" },
      { good .. " --command", "%-%-command needs a value" },
      { good .. " --gathered", "%-%-gathered needs a value" },
      { good .. " --gathered " .. P("nope.json"), "cannot read %-%-gathered JSON" },
      { torch_json .. " " .. torch_json, "MOE_JSON %(bench/moe_mlp.lua%) '[^']*' has no 'date'" },
    }
    write(P("notjson.json"), "{ not json")
    cases[#cases + 1] = { P("notjson.json") .. " " .. torch_json, "cannot read MOE_JSON .*notjson.json" }
    for _, c in ipairs(cases) do
      local ok, code, out = report(c[1])
      assert.is_falsy(ok, c[1])
      assert.are.equal(1, code, c[1])
      assert.truthy(out:find("moe_mlp_report: " .. c[2]), out)
      assert.truthy(out:find("usage: python3 bench/moe_mlp_report.py", 1, true), out)
      assert.is_nil(out:find("Traceback", 1, true), out)
    end
  end)

  it("joins bench/moe_mlp.lua's own JSON (its smoke run on the CPU)", function()
    local exe = (os.getenv("MOE_BUILD_DIR") or "build") .. "/moe-lua"
    local bench = spec_dir .. "/../../bench/moe_mlp.lua"
    local cmd = ("%s %s smoke=true repeats=1 warmup=1 json=%s > %s 2>&1"):format(sh_quote(exe), sh_quote(bench),
      sh_quote(P("smoke_moe.json")), sh_quote(P("smoke.log")))
    assert(os.execute(cmd), read(P("smoke.log")))
    local moe = json.decode(read(P("smoke_moe.json")))
    -- the torch side: compiled _grouped_mm at half the speed of each config's grouped row
    local rows = {}
    for _, r in ipairs(moe.results) do
      if r.impl == "grouped" then
        rows[#rows + 1] = { config = r.config, impl = "torch_grouped_mm_compiled", T = r.T, d = r.d, f = r.f,
          E = r.E, k = r.k, ms = 2 * r.ms, tflops = r.tflops / 2, peak_extra_bytes = r.peak_extra_bytes }
      end
    end
    assert.are.equal(3, #rows)
    write(P("smoke_torch.json"), { device = moe.device, tool = "torch", cuda = "13.0",
      dense = { tflops = moe.dense.tflops / 2 }, results = rows })
    local ok, code, out = report(P("smoke_moe.json") .. " " .. P("smoke_torch.json") .. " " .. P("smoke"))
    assert(ok, ("report failed (%s): %s"):format(tostring(code), out))
    local joined = json.decode(read(P("smoke/moe_mlp.json")))
    assert.are.equal(moe.dense.tflops, joined.dense.reference_tflops)
    local t = joined.targets
    for _, c in ipairs({ "mixtral", "olmoe", "qwen3" }) do
      assert.is_number(t.best_pct_dense[c].pct_dense, c)
      assert.is_true(t.faster_than_best_torch_grouped_mm[c].grouped, c)
      assert.is_string(t.auto[c].pick, c) -- the auto row's pick, read from "auto:<impl>"
      assert.is_table(t.auto[c].tuner_ms, c)
    end
    local md = read(P("smoke/moe_mlp.md"))
    assert.truthy(md:find("| mixtral | 128 | 64 | 128 | 2 | 2 | grouped |", 1, true), md)
    assert.truthy(md:find("- mlp_impl auto on qwen3: picks ", 1, true), md)
  end)
end)
