--[[
tests/lua/metrics_spec.lua - what a run's metrics look like on disk and in
tools:
  - moe.metrics.json: null keeps its place in arrays (json.null), NaN and
    infinities survive a metrics.jsonl round trip;
  - many experts (more than metrics.EXPERT_LINES_MAX): `moe-lua plot` draws a
    heatmap per layer plus max/mean; the training log writes one TensorBoard
    histogram per layer and step plus a max/mean scalar, read back here and
    by TensorBoard's own readers (tests/python/check_tensorboard.py
    --expert-load);
  - the training log sums the expert counts on their device and reads them
    to the host once per log interval (moe.host_reads).
]]
local moe = require "moe"
local metrics = require "moe.metrics"
local tb = require "moe.tensorboard"
local json = metrics.json

local function q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end
local root = os.tmpname()
os.remove(root)
assert(os.execute("mkdir -p " .. q(root)))

local function is_nan(x) return type(x) == "number" and x ~= x end

describe("metrics.json", function()
  it("keeps null's position in arrays and writes it back", function()
    local a = json.decode("[1,null,3]")
    assert.are.equal(3, #a)
    assert.are.equal(1, a[1])
    assert.are.equal(json.null, a[2])
    assert.are.equal(3, a[3])
    assert.are.equal("[1,null,3]", json.encode(a))
    assert.are.equal("[null,null]", json.encode(json.decode("[null,null]")))
    local nested = json.decode('{"a":[null,{"b":[2,null]}]}')
    assert.are.equal(2, #nested.a)
    assert.are.equal(json.null, nested.a[1])
    assert.are.same({ 2, json.null }, { nested.a[2].b[1], nested.a[2].b[2] })
    -- in an object, null is no member (t.a == nil); at the top, nil
    assert.are.same({}, json.decode('{"a":null}'))
    assert.is_nil(json.decode("null"))
    assert.are.equal("json.null", tostring(json.null))
    assert.has_error(function() json.null.x = 1 end)
  end)

  it("gives null the value asked for, everywhere", function()
    local v = json.decode('{"a":null,"b":[1,null]}', 0 / 0)
    assert.is_true(is_nan(v.a))
    assert.are.equal(2, #v.b)
    assert.is_true(is_nan(v.b[2]))
    assert.are.equal(false, json.decode("[null]", false)[1])
  end)

  it("writes NaN as null and infinities as 1e999 (valid JSON), and reads Python's NaN", function()
    assert.are.equal('{"a":null,"b":1e999,"c":-1e999,"d":[1,null,1e999]}',
      json.encode { a = 0 / 0, b = math.huge, c = -math.huge, d = { 1, 0 / 0, math.huge } })
    local back = json.decode(json.encode { b = math.huge, c = -math.huge })
    assert.are.equal(math.huge, back.b)
    assert.are.equal(-math.huge, back.c)
    local py = json.decode("[NaN, Infinity, -Infinity, -2.5]")
    assert.is_true(is_nan(py[1]))
    assert.are.same({ math.huge, -math.huge, -2.5 }, { py[2], py[3], py[4] })
  end)

  it("NaN and infinities survive a metrics.jsonl round trip", function()
    local path = root .. "/metrics.jsonl"
    local w = metrics.jsonl(path, "w")
    w:write { step = 1, loss = 0 / 0, grad_norm = math.huge, aux_loss = -math.huge, lr = 1e-3,
      expert_counts = { ["blocks.0.ffn"] = { 3, 0 / 0, 5 } } }
    w:write { step = 2, loss = 2.5 }
    w:close()
    local recs = metrics.read_jsonl(path)
    assert.are.equal(2, #recs)
    local r = recs[1]
    assert.is_true(is_nan(r.loss))
    assert.are.equal(math.huge, r.grad_norm)
    assert.are.equal(-math.huge, r.aux_loss)
    assert.are.equal(1e-3, r.lr)
    local c = r.expert_counts["blocks.0.ffn"]
    assert.are.equal(3, #c)
    assert.are.equal(3, c[1])
    assert.is_true(is_nan(c[2]))
    assert.are.equal(5, c[3])
    assert.are.equal(2.5, recs[2].loss)
    assert.is_nil(recs[2].grad_norm)
  end)
end)

-- The recipe shared with check_tensorboard.py (expert_counts there): expert j's
-- count at step s of a layer of n experts.
local function counts_of(step, n)
  local c = {}
  for j = 0, n - 1 do c[j + 1] = (j * 7 + step * (n + 1)) % 13 end
  return c
end

describe("expert load with many experts", function()
  local plot = require "moe.cli.plot"

  it("is drawn as a heatmap per layer by moe-lua plot", function()
    if not plot.gnuplot_available() then
      pending("no gnuplot")
      return
    end
    local dir = root .. "/plot"
    assert(os.execute("mkdir -p " .. q(dir)))
    local w = metrics.jsonl(dir .. "/metrics.jsonl", "w")
    for step = 1, 5 do
      w:write { step = step, loss = 5 / step, expert_counts = { ["blocks.0.ffn"] = counts_of(step, 64),
        ["blocks.1.ffn"] = counts_of(step, 4) } }
    end
    w:close()
    local pngs = plot.render(dir .. "/metrics.jsonl", dir .. "/out")
    assert.are.same({ dir .. "/out/loss.png", dir .. "/out/expert_load.png" }, pngs)
    local f = assert(io.open(pngs[2], "rb"))
    assert.are.equal("\137PNG\r\n\26\n", f:read(8))
    f:close()
    -- the heatmap's data: layer 0, one scan of 64 experts per step (load / mean load)
    f = assert(io.open(dir .. "/out/expert_heatmap.dat"))
    local text = f:read("a")
    f:close()
    local block0 = text:match("# blocks%.0%.ffn\n(.-)\n\n\n")
    assert.is_string(block0, text:sub(1, 200))
    local rows = {}
    for line in block0:gmatch("[^\n]+") do rows[#rows + 1] = line end
    assert.are.equal(5 * 64, #rows)
    local c = counts_of(3, 64)
    local total = 0
    for _, x in ipairs(c) do total = total + x end
    assert.are.equal(("3 10 %.6g"):format(c[11] * 64 / total), rows[2 * 64 + 11])
    -- layer 1 (4 experts) stays lines; the script has one heatmap and a max/mean panel
    f = assert(io.open(dir .. "/out/plot.gp"))
    local gp = f:read("a")
    f:close()
    local _, n_heat = gp:gsub("with pm3d", "")
    assert.are.equal(1, n_heat)
    assert.truthy(gp:find("index 1 using 1:5 with lines title 'e3'", 1, true), gp)
    assert.truthy(gp:find("max/mean expert load per layer", 1, true), gp)
    f = assert(io.open(dir .. "/out/load_balance.dat"))
    assert.truthy(f:read("a"):find("# blocks.1.ffn", 1, true))
    f:close()
  end)

  -- The training log's TensorBoard output for 5 log steps; returns the log folder.
  local function log_run(name)
    local dir = root .. "/" .. name
    assert(os.execute("mkdir -p " .. q(dir)))
    local tlog = require "moe.train.log"
    local log = tlog.open({ out_dir = dir, tensorboard = true, log_every = 1, steps = 5, quiet = true },
      { device = "cpu", tokens_per_step = 1 })
    for step = 1, 5 do
      log:count_experts {
        { name = "blocks.0.ffn", stats = { expert_counts = moe.tensor(counts_of(step, 64)) } },
        { name = "blocks.1.ffn", stats = { expert_counts = moe.tensor(counts_of(step, 4)) } },
      }
      log:add_step(2.0, 0.0, 1.0)
      log:write(log:record(step, 1e-3, step))
    end
    log:close()
    return dir .. "/tb"
  end

  it("is a TensorBoard histogram per layer and step, plus max/mean", function()
    local dir = log_run("tb_lua")
    local p = assert(io.popen("ls " .. q(dir)))
    local file = dir .. "/" .. p:read("l")
    p:close()
    local hist, scalars = {}, {}
    for _, ev in ipairs(tb.read(file)) do
      for _, v in ipairs(ev.values) do
        if v.histo then hist[#hist + 1] = { ev.step, v.tag, v.histo }
        elseif v.tag:find("^expert_load/") then scalars[v.tag .. "@" .. ev.step] = v.value end
      end
    end
    assert.are.equal(5, #hist)
    for i, e in ipairs(hist) do
      local step, tag, h = e[1], e[2], e[3]
      assert.are.equal(i, step)
      assert.are.equal("expert_load/layer0", tag)
      local c = counts_of(step, 64)
      local total, lo, hi = 0, math.huge, -math.huge
      for _, x in ipairs(c) do total = total + x end
      for _, x in ipairs(c) do lo, hi = math.min(lo, x * 64 / total), math.max(hi, x * 64 / total) end
      assert.are.same({ lo, hi, 64.0 }, { h.min, h.max, h.num })
      assert.is_true(math.abs(h.sum - 64) < 1e-9) -- loads / mean sum to E
      local n = 0
      for _, b in ipairs(h.bucket) do n = n + b end
      assert.are.equal(64, n)
      assert.are.equal(#h.bucket, #h.bucket_limit)
      local b0 = metrics.load_balance(c)
      assert.are.equal((string.unpack("<f", string.pack("<f", b0))), scalars["expert_load/layer0/max_over_mean@" .. step])
      assert.is_nil(scalars["expert_load/layer0/e0@" .. step])  -- no line per expert
      assert.is_number(scalars["expert_load/layer1/e3@" .. step]) -- 4 experts: lines
      assert.is_number(scalars["expert_load/layer1/max_over_mean@" .. step])
    end
  end)

  it("histogram() buckets [limit[i-1], limit[i]), one bucket for equal values, nil for none", function()
    local h = tb.histogram({ 0, 1, 2, 3, 4 }, 4)
    assert.are.same({ 1.0, 2.0, 3.0, 1.7976931348623157e308 }, h.bucket_limit)
    assert.are.same({ 1.0, 1.0, 1.0, 2.0 }, h.bucket)
    assert.are.same({ 0.0, 4.0, 5.0, 10.0, 30.0 }, { h.min, h.max, h.num, h.sum, h.sum_squares })
    h = tb.histogram({ 2, 2, 0 / 0, math.huge })
    assert.are.same({ 2.0, 2.0, 2.0 }, { h.min, h.max, h.num })
    assert.are.same({ 2.0 }, h.bucket)
    assert.is_nil(tb.histogram({ 0 / 0 }))
    local w = tb.writer(root .. "/hargs")
    assert.has_error(function() w:add_histogram("x", 3, 1) end,
      "bad argument #2 to 'add_histogram' (list of numbers expected for 'x', got number)")
    assert.has_error(function() w:add_histogram("x", {}, 1.5) end,
      "bad argument #3 to 'add_histogram' (integer step expected, got 1.5)")
    w:close()
  end)

  local function find_python()
    local home = os.getenv("XDG_CACHE_HOME") or ((os.getenv("HOME") or "/root") .. "/.cache")
    for _, py in ipairs({ os.getenv("MOE_PYTHON") or false, home .. "/moe-lua/pyvenv/bin/python3", "python3" }) do
      if py and os.execute(q(py) .. ' -c "import tensorboard, numpy" >/dev/null 2>&1') then return py end
    end
    return nil
  end
  local python = find_python()
  local client = (python or os.getenv("CI")) and it or pending
  client("is read by TensorBoard's own readers (check_tensorboard.py --expert-load)", function()
    assert.is_not_nil(python, "no python with tensorboard")
    local dir = log_run("tb_python")
    local spec_dir = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests/lua"
    local checker = spec_dir .. "/../python/check_tensorboard.py"
    local p = io.popen(q(python) .. " " .. q(checker) .. " --expert-load " .. q(dir) .. " 2>&1; echo rc=$?")
    local out = p:read("a")
    p:close()
    io.write("\n-- " .. checker .. " --expert-load\n" .. out)
    assert.matches("expert load: 5 histograms, 6 scalar tags match", out)
    assert.matches("rc=0", out)
  end)
end)

describe("the training log's expert counts", function()
  -- Summed on their device per step (the step's counts are freed with its
  -- scope, as in the training loop), read to the host once per log interval.
  it("read nothing back per step and once per interval", function()
    local tlog = require "moe.train.log"
    local log = tlog.open({ out_dir = root, log_every = 3, steps = 6, quiet = true },
      { device = "cpu", tokens_per_step = 1, writer = false })
    local function step_counts(step)
      moe.scope(function()
        log:count_experts {
          { name = "blocks.0.ffn", stats = { expert_counts = moe.tensor({ step, 0, 2 }, { dtype = "i64" }) } },
          { name = "blocks.1.ffn", stats = { expert_counts = moe.tensor({ 1, step }, { dtype = "i32" }) } },
          { name = "blocks.2.attn", stats = {} },
        }
      end)
      log:add_step(1.0, 0.0, 1.0)
    end
    for interval = 0, 1 do
      local r0 = moe.host_reads()
      for step = 1, 3 do step_counts(step + 3 * interval) end
      local r1 = moe.host_reads()
      assert.are.same({ 0, 0 }, { r1.copies - r0.copies, r1.syncs - r0.syncs })
      local rec = log:record(3 * (interval + 1), 1e-3, 3)
      local r2 = moe.host_reads()
      assert.are.same({ 1, 1 }, { r2.copies - r1.copies, r2.syncs - r1.syncs }) -- both layers, one read
      local s = 6 + 9 * interval -- 1 + 2 + 3, then 4 + 5 + 6
      assert.are.same({ s, 0, 6 }, rec.expert_counts["blocks.0.ffn"])
      assert.are.same({ 3, s }, rec.expert_counts["blocks.1.ffn"])
      assert.is_nil(rec.expert_counts["blocks.2.attn"])
      assert.are.equal(math.max(s, 6) / ((s + 6) / 3), rec.load_balance)
      log:write(rec) -- the next interval starts from zero
    end
    log:close()
  end)
end)

describe("cleanup", function()
  it("removes the spec's folder", function()
    assert.is_true(os.execute("rm -rf " .. q(root)))
  end)
end)
