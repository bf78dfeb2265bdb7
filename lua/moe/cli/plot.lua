--[[
moe/cli/plot.lua - `moe-lua plot [out_dir=DIR] [output=DIR]`: renders a
training run's metrics.jsonl (written by moe.train) to PNG with gnuplot:

  <output>/loss.png          training loss and validation loss against the step
  <output>/expert_load.png   per MoE layer, each expert's share of the routed
                             tokens against the step: with at most 16 experts
                             one line per expert (a flat line at 1/E is
                             balanced); with more (M.HEATMAP_ABOVE), a heatmap
                             of step x expert coloured by load / mean load (1 is
                             balanced, 0 an idle expert, E one expert taking
                             everything); then one panel of every layer's
                             max/mean load against the step.

The data files and the gnuplot script are written beside the images
(loss.dat, val_loss.dat, expert_load.dat, expert_heatmap.dat, load_balance.dat,
plot.gp) so a plot can be re-styled by hand. gnuplot must be installed:
without it the command fails with a message naming the Debian package
(gnuplot, or gnuplot-nox on servers).
]]
local M = {
  summary = "plot a run's loss and expert load to PNG with gnuplot (out_dir=, output=)",
  usage = "usage: moe-lua plot [out_dir=DIR] [output=DIR (default: out_dir)]",
  -- more experts than this: a heatmap per layer rather than one line per expert
  HEATMAP_ABOVE = require("moe.metrics").EXPERT_LINES_MAX,
}

local function sh_quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

local function write(path, text)
  local f, err = io.open(path, "w")
  if not f then error(("plot: cannot write '%s': %s"):format(path, err), 0) end
  f:write(text)
  f:close()
end

--- gnuplot_available() -> true when `gnuplot` is on PATH.
function M.gnuplot_available()
  return os.execute("command -v gnuplot >/dev/null 2>&1") == true
end

-- The training records' expert counts by layer: layers[name] = { {step, counts}, ... },
-- names sorted; the number of experts of each layer.
local function expert_series(recs)
  local layers, names, n_experts = {}, {}, {}
  for _, r in ipairs(recs) do
    if r.loss and not r.val_loss and type(r.expert_counts) == "table" then
      for name, counts in pairs(r.expert_counts) do
        if type(counts) == "table" and #counts > 0 then
          if not layers[name] then layers[name] = {}; names[#names + 1] = name end
          table.insert(layers[name], { r.step, counts })
          n_experts[name] = math.max(n_experts[name] or 0, #counts)
        end
      end
    end
  end
  table.sort(names)
  return layers, names, n_experts
end

-- Shares of the routed tokens (sum 1); all 0 when nothing was routed.
local function shares(counts, E)
  local total = 0
  for j = 1, E do
    local c = tonumber(counts[j]) or 0
    if c == c then total = total + c end
  end
  local out = {}
  for j = 1, E do
    local c = tonumber(counts[j]) or 0
    out[j] = (total > 0 and c == c) and c / total or 0
  end
  return out
end

--- render(metrics_path, output_dir) -> list of the PNG paths written. Errors name the problem.
function M.render(metrics_path, output)
  local metrics = require "moe.metrics"
  local recs = metrics.read_jsonl(metrics_path)
  local loss, val = {}, {}
  for _, r in ipairs(recs) do
    if r.val_loss then
      val[#val + 1] = ("%d %.9g"):format(r.step, r.val_loss)
    elseif r.loss then
      loss[#loss + 1] = ("%d %.9g"):format(r.step, r.loss)
    end
  end
  if #loss == 0 then error(("plot: '%s' has no training loss records"):format(metrics_path), 0) end
  if not M.gnuplot_available() then
    error("plot: gnuplot is not installed (Debian package 'gnuplot', or 'gnuplot-nox' without X: " ..
      "apt-get install gnuplot)", 0)
  end
  os.execute("mkdir -p " .. sh_quote(output))
  write(output .. "/loss.dat", "# step loss\n" .. table.concat(loss, "\n") .. "\n")
  write(output .. "/val_loss.dat", "# step val_loss\n" .. table.concat(val, "\n") .. "\n")
  local gp = {
    "set terminal png size 1000,600",
    ("set output %q"):format(output .. "/loss.png"),
    "set title 'loss'", "set xlabel 'step'", "set ylabel 'cross entropy (nats)'", "set grid",
    ("plot %q using 1:2 with lines title 'train'%s"):format(output .. "/loss.dat",
      #val > 0 and (", %q using 1:2 with linespoints title 'valid'"):format(output .. "/val_loss.dat") or ""),
  }
  local pngs = { output .. "/loss.png" }
  local layers, names, n_experts = expert_series(recs)
  if #names > 0 then
    -- per layer: lines (few experts) or heatmap rows (many), and max/mean for the last panel
    local lines, heat, balance = {}, {}, {}
    for i, name in ipairs(names) do
      local E = n_experts[name]
      local lrows, hrows, brows = {}, {}, {}
      for _, e in ipairs(layers[name]) do
        local step, sh = e[1], shares(e[2], E)
        local row, max = { tostring(step) }, 0
        for j = 1, E do
          row[j + 1] = ("%.6g"):format(sh[j])
          if sh[j] > max then max = sh[j] end
          if E > M.HEATMAP_ABOVE then hrows[#hrows + 1] = ("%d %d %.6g"):format(step, j - 1, sh[j] * E) end
        end
        if E > M.HEATMAP_ABOVE then hrows[#hrows + 1] = "" end -- one scan per step
        lrows[#lrows + 1] = table.concat(row, " ")
        brows[#brows + 1] = ("%d %.6g"):format(step, max * E)
      end
      lines[i] = "# " .. name .. "\n" .. table.concat(lrows, "\n")
      heat[i] = "# " .. name .. (E > M.HEATMAP_ABOVE and "\n" .. table.concat(hrows, "\n") or "\n# (lines)\n0 0 0\n")
      balance[i] = "# " .. name .. "\n" .. table.concat(brows, "\n")
    end
    write(output .. "/expert_load.dat", "# step share_e0 share_e1 ... (one block per layer)\n" ..
      table.concat(lines, "\n\n\n") .. "\n")
    write(output .. "/expert_heatmap.dat", "# step expert load/mean (one block per layer, one scan per step)\n" ..
      table.concat(heat, "\n\n") .. "\n")
    write(output .. "/load_balance.dat", "# step max/mean load (one block per layer)\n" ..
      table.concat(balance, "\n\n\n") .. "\n")
    local rows = #names + 1
    gp[#gp + 1] = ("set terminal png size 1000,%d"):format(math.max(520, 260 * rows))
    gp[#gp + 1] = ("set output %q"):format(output .. "/expert_load.png")
    gp[#gp + 1] = ("set multiplot layout %d,1 title 'expert load'"):format(rows)
    gp[#gp + 1] = "set key outside right"
    for i, name in ipairs(names) do
      local E = n_experts[name]
      if E > M.HEATMAP_ABOVE then
        gp[#gp + 1] = ("set title %q"):format(name .. (": load / mean load (%d experts; 1 is balanced)"):format(E))
        gp[#gp + 1] = "set ylabel 'expert'"
        gp[#gp + 1] = ("set yrange [-0.5:%g]"):format(E - 0.5)
        gp[#gp + 1] = "unset grid"
        gp[#gp + 1] = "set view map"
        gp[#gp + 1] = "set pm3d map corners2color c1"
        gp[#gp + 1] = "set palette defined (0 'white', 1 '#4575b4', 2 '#fee090', 4 '#d73027')"
        gp[#gp + 1] = ("set cbrange [0:%g]"):format(math.min(E, 4))
        gp[#gp + 1] = ("splot %q index %d using 1:2:3 with pm3d notitle"):format(output .. "/expert_heatmap.dat", i - 1)
        gp[#gp + 1] = "unset pm3d"
        gp[#gp + 1] = "set autoscale y"
        gp[#gp + 1] = "set autoscale cb"
        gp[#gp + 1] = "set grid"
      else
        gp[#gp + 1] = ("set title %q"):format(name .. " (share of routed tokens)")
        gp[#gp + 1] = "set ylabel 'share of tokens'"
        local cols = {}
        for j = 1, E do
          cols[j] = ("%s index %d using 1:%d with lines title 'e%d'"):format(j == 1 and ("%q"):format(
            output .. "/expert_load.dat") or "''", i - 1, j + 1, j - 1)
        end
        gp[#gp + 1] = "plot " .. table.concat(cols, ", ")
      end
    end
    gp[#gp + 1] = "set title 'max/mean expert load per layer (1 is balanced)'"
    gp[#gp + 1] = "set ylabel 'max / mean'"
    gp[#gp + 1] = "set xlabel 'step'"
    local cols = {}
    for i, name in ipairs(names) do
      cols[i] = ("%s index %d using 1:2 with lines title %q"):format(i == 1 and ("%q"):format(
        output .. "/load_balance.dat") or "''", i - 1, name)
    end
    gp[#gp + 1] = "plot " .. table.concat(cols, ", ")
    gp[#gp + 1] = "unset multiplot"
    pngs[#pngs + 1] = output .. "/expert_load.png"
  end
  write(output .. "/plot.gp", table.concat(gp, "\n") .. "\n")
  local p = io.popen("gnuplot " .. sh_quote(output .. "/plot.gp") .. " 2>&1")
  local msg = p:read("a")
  local ok = p:close()
  if not ok then error(("plot: gnuplot failed on %s/plot.gp: %s"):format(output, msg), 0) end
  return pngs
end

function M.main(...)
  local moe = require "moe"
  local cfg, rest = moe.config({ out_dir = "out", output = "" }, { ... })
  if #rest > 0 then
    error(("plot: unexpected argument '%s' (%s)"):format(tostring(rest[1]), M.usage), 0)
  end
  local output = cfg.output ~= "" and cfg.output or cfg.out_dir
  for _, p in ipairs(M.render(cfg.out_dir .. "/metrics.jsonl", output)) do print("wrote " .. p) end
  return 0
end

return M
