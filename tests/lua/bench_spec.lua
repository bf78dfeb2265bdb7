--[[
tests/lua/bench_spec.lua - bench/lib.lua, the harness of the Lua benchmarks,
on the CPU: arguments through moe.config, the median, the host-clock timing
path (with moe.clock replaced by a scripted clock), and the fields of the
JSON and markdown the writer produces.
]]
local moe = require "moe"
local json = require("moe.metrics").json
local bench = dofile("bench/lib.lua")

local spec_dir = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests/lua"
local read = dofile(spec_dir .. "/read_file.lua")

describe("bench.config", function()
  it("adds the common keys to the script's defaults and parses key=value", function()
    local cfg = bench.config({ configs = { "mixtral", "qwen3" }, repeats = 20, device = "cuda" },
      { "json=/tmp/x.json", "cooldown=2", "configs=olmoe", "warmup=1" })
    assert.are.equal("/tmp/x.json", cfg.json)
    assert.are.equal(2, cfg.cooldown)
    assert.are.same({ "olmoe" }, cfg.configs)
    assert.are.equal(20, cfg.repeats) -- the script's default wins over the common one
    assert.are.equal(1, cfg.warmup)
    assert.are.equal("", cfg.md)
    assert.are.equal("cuda", cfg.device)
  end)

  it("keeps the defaults without arguments", function()
    local cfg = bench.config({ n = 7 }, {})
    assert.are.equal(7, cfg.n)
    assert.are.equal(bench.COMMON.repeats, cfg.repeats)
    assert.are.equal(bench.COMMON.warmup, cfg.warmup)
    assert.are.equal(0, cfg.cooldown)
    assert.are.equal("", cfg.json)
  end)

  it("rejects the old --flags, unknown keys and bad values", function()
    assert.error_matches(function() bench.config({}, { "--json", "out.json" }) end,
      "bad argument '%-%-json': flags are not taken")
    assert.error_matches(function() bench.config({}, { "jsn=out.json" }) end, "unknown key 'jsn'")
    assert.error_matches(function() bench.config({}, { "repeats=many" }) end, "repeats expects an integer")
    assert.error_matches(function() bench.config({}, { "run" }) end, "unexpected argument 'run'")
  end)

  it("returns positional arguments where the script takes them", function()
    local cfg, rest = bench.config({ preset = "quickstart" }, { "run", "preset=dmoe46m" }, { positional = 1 })
    assert.are.same({ "run" }, rest)
    assert.are.equal("dmoe46m", cfg.preset)
    assert.error_matches(function() bench.config({}, { "run", "again" }, { positional = 1 }) end,
      "unexpected argument 'again'")
  end)
end)

describe("bench.median", function()
  it("takes the middle of an odd count and the mean of the middle two of an even one", function()
    assert.are.equal(3, bench.median({ 5, 1, 3 }))
    assert.are.equal(2.5, bench.median({ 4, 1, 3, 2 }))
    assert.are.equal(7, bench.median({ 7 }))
    assert.are.equal(2, bench.median({ 100, 2, 1, 2, -50 }))
  end)

  it("leaves its argument alone and refuses an empty list", function()
    local t = { 3, 1, 2 }
    bench.median(t)
    assert.are.same({ 3, 1, 2 }, t)
    assert.error_matches(function() bench.median({}) end, "no samples")
  end)
end)

describe("bench.time on the CPU", function()
  local real_clock
  before_each(function() real_clock = moe.clock end)
  after_each(function() moe.clock = real_clock end)

  it("runs the warm-up, then repeats x iters calls, timed by the host clock", function()
    -- a scripted clock: each call of f takes its scripted duration
    local now, calls = 0, 0
    local durations = { 5, 1, 3, 2, 4 } -- per sample (iters = 2 calls each)
    moe.clock = function() return now end
    local f = function()
      calls = calls + 1
      if calls > 3 then
        local sample = (calls - 4) // 2 + 1
        now = now + durations[sample] / 2
      end
    end
    local med, samples = bench.time(f, { device = "cpu", iters = 2, repeats = 5, warmup = 3 })
    assert.are.equal(3 + 5 * 2, calls)
    assert.are.equal(5, #samples)
    for i, d in ipairs(durations) do assert.are.equal(d / 2, samples[i]) end
    assert.are.equal(1.5, med) -- per call: the median sample (3) over 2 calls
  end)

  it("measures real CPU work with the host clock", function()
    local x = moe.randn({ 128, 128 })
    local med, samples = bench.time(function() moe.matmul(x, x):free() end,
      { device = "cpu", repeats = 3, warmup = 1 })
    assert.are.equal(3, #samples)
    assert.is_true(med > 0 and med < 10)
    x:free()
    assert.are.equal("host clock", bench.method("cpu"))
    assert.are.equal("CUDA events", bench.method("cuda"))
  end)

  it("gives the intervals between stopwatch marks and times one call", function()
    local now = 10
    moe.clock = function() return now end
    local sw = bench.stopwatch("cpu")
    sw:mark(); now = now + 0.5; sw:mark(); now = now + 2; sw:mark()
    assert.are.same({ 0.5, 2 }, sw:intervals())
    sw:free()
    assert.are.equal(0.25, bench.elapsed(function() now = now + 0.25 end, "cpu"))
  end)

  it("rejects zero repeats", function()
    assert.error_matches(function() bench.time(function() end, { device = "cpu", repeats = 0 }) end,
      "repeats and iters must be at least 1")
  end)
end)

describe("bench.write", function()
  it("writes JSON and markdown carrying the device, date, versions, command and reference", function()
    local path = os.tmpname()
    os.remove(path)
    path = path .. ".json"
    local cfg = bench.config({ device = "cpu" }, { "json=" .. path, "repeats=4" })
    local rows = { { name = "a", ms = 1.25 }, { name = "b", ms = 2.5 } }
    local obj = bench.write(cfg, { title = "Test bench", device = cfg.device, reference = "torch on the same GPU",
      results = rows, validation = bench.list({}), columns = { { "case", "name" }, { "ms", "ms", "%.3f" } } })
    assert.are.equal("cpu", obj.device)

    local j = json.decode(read(path))
    assert.are.equal("cpu", j.device)
    assert.matches("^%d%d%d%d%-%d%d%-%d%dT%d%d:%d%d:%d%dZ$", j.date)
    assert.are.equal("moe-lua " .. moe.version, j.tool)
    assert.are.equal(moe.version, j.versions.moe_lua)
    assert.is_string(j.versions.cuda_runtime)
    assert.is_string(j.versions.cublas)
    assert.is_number(j.cuda_runtime)
    assert.is_number(j.cublas)
    assert.matches("moe%-lua .*json=.*repeats=4", j.command)
    assert.are.equal("torch on the same GPU", j.reference)
    assert.are.equal("host clock", j.timing)
    assert.are.equal(4, j.repeats)
    assert.are.equal(0, j.cooldown_s)
    assert.are.same(rows, j.results)
    assert.are.same({}, j.validation)
    assert.is_nil(j.columns)
    assert.is_nil(j.title)

    local md = read(path:gsub("%.json$", ".md"))
    assert.matches("^# Test bench\n", md)
    assert.matches("%- device: cpu\n", md)
    assert.is_truthy(md:find("- date: " .. j.date .. "\n", 1, true))
    assert.matches("%- versions: moe%-lua " .. moe.version:gsub("%.", "%%.") .. ", CUDA runtime ", md)
    assert.matches("cuBLAS ", md)
    assert.matches("%- command: `moe%-lua ", md)
    assert.matches("%- reference: torch on the same GPU\n", md)
    assert.matches("%- timing: host clock, median of 4 repeats", md)
    assert.matches("| case | ms |\n|%-%-%-|%-%-%-|\n| a | 1%.250 |\n| b | 2%.500 |\n", md)
    os.remove(path)
    os.remove((path:gsub("%.json$", ".md")))
  end)

  it("writes the GPU's name, not the device kind", function()
    local real = moe.cuda.get_device_name
    moe.cuda.get_device_name = function(i) return "Fake GPU " .. i end
    local ok, obj, md = pcall(bench.report, { repeats = 3, warmup = 1, cooldown = 0.0 },
      { title = "T", device = "cuda", results = {} })
    moe.cuda.get_device_name = real
    assert.is_true(ok, obj)
    assert.are.equal("Fake GPU 0", obj.device)
    assert.are.equal("CUDA events", obj.timing)
    assert.matches("%- device: Fake GPU 0\n", md)
    assert.matches("%- timing: CUDA events, median of 3 repeats after 1 warm%-up calls\n", md)
  end)

  it("puts MOE_* variables of the environment in front of the command", function()
    local f = io.open("/proc/self/environ")
    if not f then return end -- not Linux
    f:close()
    -- the test process's own environment: ctest sets MOE_BUILD_DIR, which is left out
    local cmd = bench.command({ "a=1", "b=two words" })
    assert.matches("moe%-lua [^ ]+ a=1 'b=two words'$", cmd)
    assert.is_nil(cmd:match("MOE_BUILD_DIR"))
  end)

  it("writes nothing without json= or md=", function()
    local cfg = bench.config({ device = "cpu" }, {})
    local _, md = bench.write(cfg, { title = "T", device = "cpu", results = {} })
    assert.matches("^# T\n", md)
  end)
end)
