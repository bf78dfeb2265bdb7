--[[
bench/quantize_curves.lua - loss curves with the saved activations of the
dMoE experts kept off / 8-bit / 4-bit: the same model, data and
seed trained once per mode through moe.train (lua/moe/train/), the
quantize switches of every dMoE layer set to the mode's bits (quantize =
{inputs =, rematerialize =, scatter =} on the experts module).

  moe-lua bench/quantize_curves.lua run preset=quickstart|dmoe46m [modes=off,8,4]
      [steps=N] [device=auto] [dtype=] [batch_size=] [out=DIR] [json=FILE]
      [mlp=mlp|glu]  glu: SwiGLU experts (the fused op quantizes its own
                    pre-activations) instead of the preset's gelu MLP; the
                    preset is then reported as NAME-glu
      [seconds=S]   per-mode wall-clock limit: a mode that hits it stops at
                    its last finished step (the schedule still spans steps),
                    and the comparison uses the steps every mode reached
      [seeds=S1,S2,...]  one run per mode and seed (the seed of the initial
                    weights and of the step RNG; the data order and split
                    stay those of data_seed): the report then gives each
                    seed's row and the mean over seeds per mode, so that the
                    quantized modes are compared with the seed-to-seed
                    spread of the unquantized run
  moe-lua bench/quantize_curves.lua report json=FILE[,FILE...] md=FILE png=FILE
      a Markdown table (final loss = mean train loss of the last 10% of the
      common steps, and the last validation loss) and a gnuplot PNG of the
      curves (smoothed over a window of 10 steps).

Presets (KJV bible corpus, byte tokens, data.bible_corpus):
  quickstart  experiments/quickstart.lua's model: 4 layers, d_model 128,
              8 experts top-2, ffn 256 (gelu MLP experts), seq 128, batch 8,
              150 steps, lr 3e-3 -> 3e-4
  dmoe46m     MegaBlocks' dmoe-46M shape: 6 layers, hidden 512, 8 heads,
              64 experts top-1, ffn_hidden_size 2048 (gelu MLP experts),
              seq 1024, batch 8, lr 1e-3 -> 1e-4, bf16 on the GPU
]]
local moe = require "moe"
local train = require "moe.train"
local bench = dofile((arg[0]:match("^(.*)/") or ".") .. "/lib.lua")

-- The command (run or report) and its keys through moe.config; a key left
-- at its empty default ("" or 0) is nil in the returned table.
local function parse_args()
  local cfg, rest = moe.config {
    preset = "quickstart", modes = "off,8,4", steps = 0, batch_size = 0, device = "", dtype = "",
    out = "", json = "", mlp = "", seconds = 0.0, seeds = "", md = "", png = "",
  }
  if #rest > 1 or (rest[1] and tostring(rest[1]):match("^%-")) then
    error("bad argument '" .. tostring(rest[#rest]) .. "' (run|report, then key=value)", 0)
  end
  local a = { cmd = rest[1] }
  for k, v in pairs(cfg) do
    if v ~= "" and v ~= 0 then a[k] = v end
  end
  return a
end

local function preset_cfg(name)
  local c = train.defaults()
  c.data, c.tensorboard, c.sample_every, c.sample_tokens = "bible", false, 0, 0
  c.save_every, c.keep_last, c.weight_decay = 0, 0, 0.0 -- keep_last 0: no checkpoint
  if name == "quickstart" then
    c.model.d_model, c.model.n_layers, c.model.n_heads = 128, 4, 4
    c.model.moe.num_experts, c.model.moe.top_k, c.model.moe.ffn_hidden_size = 8, 2, 256
    c.seq_len, c.batch_size, c.steps = 128, 8, 150
    c.lr, c.min_lr, c.warmup = 3e-3, 3e-4, 20
    c.eval_every, c.eval_iters, c.log_every = 50, 4, 10
  elseif name == "dmoe46m" then
    c.model.d_model, c.model.n_layers, c.model.n_heads = 512, 6, 8
    c.model.moe.num_experts, c.model.moe.top_k, c.model.moe.ffn_hidden_size = 64, 1, 2048
    c.seq_len, c.batch_size, c.steps = 1024, 8, 300
    c.lr, c.min_lr, c.warmup = 1e-3, 1e-4, 30
    c.eval_every, c.eval_iters, c.log_every = 100, 4, 25
    c.dtype = "bf16"
  else
    error("unknown preset '" .. tostring(name) .. "' (quickstart, dmoe46m)", 0)
  end
  return c
end

-- Sets the quantize switches of every expert module of model (the modules
-- with w1 and w2 that a dMoE holds as .experts).
local function set_quantize(model, bits)
  local n = 0
  for _, m in ipairs(model:modules()) do
    if m.experts ~= nil and m.experts.w1 ~= nil then
      m.experts.quantize = bits ~= 0 and { inputs = bits, rematerialize = bits, scatter = bits } or nil
      n = n + 1
    end
  end
  if n == 0 then error("quantize_curves: the model has no dMoE experts", 0) end
  return n
end

local function run(a)
  local preset = a.preset or "quickstart"
  local base = preset_cfg(preset)
  if a.steps then
    base.steps = a.steps
    base.warmup = math.min(base.warmup, base.steps // 5)
    base.eval_every = math.min(base.eval_every, base.steps)
  end
  if a.batch_size then base.batch_size = a.batch_size end
  if a.mlp == "glu" then -- SwiGLU experts: the fused op with its own quantize option
    base.model.moe.mlp_type, base.model.moe.activation = "glu", "silu"
    preset = preset .. "-glu"
  elseif a.mlp ~= nil and a.mlp ~= "mlp" then
    error("bad argument mlp=" .. a.mlp .. " (mlp or glu)", 0)
  end
  if a.device then base.device = a.device end
  if a.dtype then base.dtype = a.dtype end
  local device = train.resolve_device(base.device)
  if device == "cpu" and base.dtype == "bf16" and not a.dtype then base.dtype = "f32" end
  local out = a.out or ("out/quantize_curves/" .. preset)
  local seconds = a.seconds or 0
  local json = a.json or (out .. "/curves.json")
  -- written after every mode, so that a run cut short keeps what finished
  local function write_json(records)
    local runs = {}
    for i, r in ipairs(records) do
      runs[i] = { mode = r.mode, bits = r.bits, seed = r.seed, steps = r.steps, seconds = r.seconds,
                  losses = bench.list(r.losses), val = bench.list(r.vals) }
    end
    local obj = bench.environment(device)
    obj.preset, obj.dtype, obj.steps, obj.batch_size, obj.seq_len = preset, base.dtype, base.steps,
      base.batch_size, base.seq_len
    obj.runs = runs
    local f = assert(io.open(json, "w"))
    f:write(bench.encode(obj))
    f:close()
    print("quantize_curves: wrote " .. json)
  end
  local records = {}
  local seeds = {}
  for sd in (a.seeds or tostring(base.seed)):gmatch("[^,]+") do
    seeds[#seeds + 1] = assert(math.tointeger(tonumber(sd)), "seeds: integers expected, got " .. sd)
  end
  for _, seed in ipairs(seeds) do
  for mode in (a.modes or "off,8,4"):gmatch("[^,]+") do
    local bits = mode == "off" and 0 or math.tointeger(tonumber(mode))
    base.seed = seed
    local cfg = train.config(base)
    cfg.out_dir = out .. "/" .. mode
    cfg.quiet = true
    os.execute("rm -rf '" .. cfg.out_dir .. "'")
    moe.manual_seed(cfg.seed) -- the same initial weights in every mode
    local model = train.build_model(cfg, device)
    local nq = set_quantize(model, bits)
    -- a wall-clock limit: stop_at is fixed before the run, so time a few
    -- steps first when a limit is given
    if seconds > 0 then
      local probe = train.config(cfg)
      probe.stop_at, probe.out_dir, probe.eval_every = 6, cfg.out_dir .. "-probe", cfg.steps
      local pr = train.run(probe, { model = model })
      local per = pr.seconds / 6 -- the first steps are slower: a safe estimate
      os.execute("rm -rf '" .. probe.out_dir .. "'")
      moe.manual_seed(cfg.seed)
      model = train.build_model(cfg, device)
      set_quantize(model, bits)
      local fit = math.floor(seconds / per)
      if fit < cfg.steps then cfg.stop_at = math.max(fit, 10) end
    end
    local t0 = moe.clock()
    local res = train.run(cfg, { model = model })
    local secs = moe.clock() - t0
    local losses, vals = {}, {}
    for s = 1, res.step do losses[#losses + 1] = res.losses[s] or res.losses[s - 1] or 0 end
    local vsteps = {}
    for s in pairs(res.val_losses) do vsteps[#vsteps + 1] = s end
    table.sort(vsteps)
    for _, s in ipairs(vsteps) do vals[#vals + 1] = { s, res.val_losses[s] } end
    local r = { mode = mode, bits = bits, seed = seed, steps = res.step, seconds = secs, losses = losses,
                vals = vals, layers = nq }
    records[#records + 1] = r
    print(string.format("quantize_curves %s mode=%s seed=%d (%d dMoE layers): %d steps in %.1f s, last loss %.4f%s",
      preset, mode, seed, nq, res.step, secs, losses[#losses] or 0 / 0,
      #vals > 0 and string.format(", val %.4f at step %d", vals[#vals][2], vals[#vals][1]) or ""))
    model = nil -- luacheck: ignore
    res = nil -- luacheck: ignore
    collectgarbage()
    write_json(records)
  end
  end
end

-- ------------------------------------------------------------------ report

local function read_json(path)
  local f = assert(io.open(path))
  local s = f:read("a")
  f:close()
  return require("moe.metrics").json.decode(s)
end

local function report(a)
  assert(a.json, "report: json=FILE[,FILE...] is required")
  local md, png = a.md, a.png
  local lines = { "| preset | mode | seed | steps | final train loss (mean of last 10%) | vs off | last val loss "
                  .. "| vs off | time s |",
                  "|---|---|---|---|---|---|---|---|---|" }
  local plots = {}
  local function pct(v, ref) return string.format("%+.2f%%", 100 * (v / ref - 1)) end
  for path in a.json:gmatch("[^,]+") do
    local d = read_json(path)
    local common = math.huge
    for _, r in ipairs(d.runs) do common = math.min(common, #r.losses) end
    local w = math.max(1, common // 10)
    -- runs by mode (in order) and, within a mode, by seed
    local modes, by_mode = {}, {}
    for _, r in ipairs(d.runs) do
      local s = 0
      for i = common - w + 1, common do s = s + r.losses[i] end
      r.final = s / w
      r.last_val = #r.val > 0 and r.val[#r.val][2] or nil
      r.seed = r.seed or 0
      if not by_mode[r.mode] then by_mode[r.mode] = {}; modes[#modes + 1] = r.mode end
      table.insert(by_mode[r.mode], r)
    end
    local off_of = {} -- seed -> the off run
    for _, r in ipairs(by_mode.off or {}) do off_of[r.seed] = r end
    local nseeds = #(by_mode[modes[1]])
    for _, mode in ipairs(modes) do
      for _, r in ipairs(by_mode[mode]) do
        local o = off_of[r.seed]
        lines[#lines + 1] = string.format("| %s | %s | %d | %d | %.4f | %s | %s | %s | %.0f |", d.preset, mode,
          r.seed, common, r.final, (o and mode ~= "off") and pct(r.final, o.final) or "",
          r.last_val and string.format("%.4f", r.last_val) or "-",
          (o and mode ~= "off" and r.last_val and o.last_val) and pct(r.last_val, o.last_val) or "", r.seconds)
      end
    end
    -- the mean over seeds per mode, and the spread of each mode's runs
    if nseeds > 1 then
      local mean = {}
      for _, mode in ipairs(modes) do
        local sf, sv, lo, hi, n, nv = 0, 0, math.huge, -math.huge, 0, 0
        for _, r in ipairs(by_mode[mode]) do
          sf, n = sf + r.final, n + 1
          lo, hi = math.min(lo, r.final), math.max(hi, r.final)
          if r.last_val then sv, nv = sv + r.last_val, nv + 1 end
        end
        mean[mode] = { final = sf / n, val = nv > 0 and sv / nv or nil, lo = lo, hi = hi, n = n }
      end
      local mo = mean.off
      for _, mode in ipairs(modes) do
        local m = mean[mode]
        lines[#lines + 1] = string.format("| %s | %s | mean of %d (train %.4f..%.4f) | %d | %.4f | %s | %s | %s | |",
          d.preset, mode, m.n, m.lo, m.hi, common, m.final, (mo and mode ~= "off") and pct(m.final, mo.final) or "",
          m.val and string.format("%.4f", m.val) or "-",
          (mo and mode ~= "off" and m.val and mo.val) and pct(m.val, mo.val) or "")
      end
    end
    -- smoothed curves for gnuplot: the mean over seeds of each mode
    for _, mode in ipairs(modes) do
      local dat = os.tmpname()
      local fh = assert(io.open(dat, "w"))
      local rs = by_mode[mode]
      for i = 1, common do
        local lo, acc = math.max(1, i - 9), 0
        for _, r in ipairs(rs) do
          for j = lo, i do acc = acc + r.losses[j] end
        end
        fh:write(string.format("%d %.5f\n", i, acc / ((i - lo + 1) * #rs)))
      end
      fh:close()
      local label = ("%s, %d steps"):format(mode, d.steps)
      if #rs > 1 then label = label .. (" (mean of %d seeds)"):format(#rs) end
      plots[#plots + 1] = { preset = d.preset, mode = label, file = dat }
    end
  end
  local text = table.concat(lines, "\n") .. "\n"
  io.write(text)
  if md then
    local f = assert(io.open(md, "w"))
    f:write(text)
    f:close()
  end
  if png then
    local presets, order = {}, {}
    for _, p in ipairs(plots) do
      if not presets[p.preset] then presets[p.preset] = {}; order[#order + 1] = p.preset end
      table.insert(presets[p.preset], p)
    end
    local gp = { string.format("set terminal pngcairo size %d,420 font ',10'", 560 * #order),
                 "set output '" .. png .. "'", string.format("set multiplot layout 1,%d", #order),
                 "set xlabel 'step'", "set ylabel 'train loss (nats/byte, 10-step mean)'", "set grid" }
    for _, name in ipairs(order) do
      gp[#gp + 1] = "set title '" .. name .. ": saved activations off / 8-bit / 4-bit'"
      local ps = {}
      for _, p in ipairs(presets[name]) do
        ps[#ps + 1] = string.format("'%s' using 1:2 with lines lw 2 title '%s'", p.file, p.mode)
      end
      gp[#gp + 1] = "plot " .. table.concat(ps, ", ")
    end
    gp[#gp + 1] = "unset multiplot"
    local script = os.tmpname()
    local f = assert(io.open(script, "w"))
    f:write(table.concat(gp, "\n") .. "\n")
    f:close()
    local ok = os.execute("gnuplot '" .. script .. "'")
    os.remove(script)
    if not ok then error("report: gnuplot failed", 0) end
    print("quantize_curves: wrote " .. png)
  end
  for _, p in ipairs(plots) do os.remove(p.file) end
end

local a = parse_args()
if a.cmd == "run" then
  run(a)
elseif a.cmd == "report" then
  report(a)
else
  error("usage: moe-lua bench/quantize_curves.lua run|report key=value ...", 0)
end
