--[[
moe/cli/plot.lua - `moe-lua plot [out_dir=DIR] [output=DIR]`: renders a
training run's metrics.jsonl (written by moe.train) to PNG with gnuplot:

  <output>/loss.png          training loss and validation loss against the step
  <output>/expert_load.png   per layer, each expert's share of the routed tokens
                             against the step (a flat line at 1/E is balanced)

The data files and the gnuplot script are written beside the images
(loss.dat, val_loss.dat, expert_load.dat, plot.gp) so a plot can be re-styled
by hand. gnuplot must be installed: without it the command fails with a
message naming the Debian package (gnuplot, or gnuplot-nox on servers).
]]
local M = {
  summary = "plot a run's loss and expert load to PNG with gnuplot (out_dir=, output=)",
  usage = "usage: moe-lua plot [out_dir=DIR] [output=DIR (default: out_dir)]",
}

local function sh_quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

local function write(path, text)
  local f, err = io.open(path, "w")
  if not f then error(("moe-lua plot: cannot write '%s': %s"):format(path, err), 0) end
  f:write(text)
  f:close()
end

--- gnuplot_available() -> true when `gnuplot` is on PATH.
function M.gnuplot_available()
  return os.execute("command -v gnuplot >/dev/null 2>&1") == true
end

--- render(metrics_path, output_dir) -> list of the PNG paths written. Errors name the problem.
function M.render(metrics_path, output)
  local metrics = require "moe.metrics"
  local recs = metrics.read_jsonl(metrics_path)
  local loss, val = {}, {}
  local layers, layer_names = {}, {}
  for _, r in ipairs(recs) do
    if r.val_loss then
      val[#val + 1] = ("%d %.9g"):format(r.step, r.val_loss)
    elseif r.loss then
      loss[#loss + 1] = ("%d %.9g"):format(r.step, r.loss)
      for name, counts in pairs(r.expert_counts or {}) do
        if not layers[name] then layers[name] = {}; layer_names[#layer_names + 1] = name end
        local total = 0
        for _, c in ipairs(counts) do total = total + c end
        local row = { tostring(r.step) }
        for j, c in ipairs(counts) do row[j + 1] = ("%.6g"):format(total > 0 and c / total or 0) end
        table.insert(layers[name], table.concat(row, " "))
      end
    end
  end
  if #loss == 0 then error(("moe-lua plot: '%s' has no training loss records"):format(metrics_path), 0) end
  if not M.gnuplot_available() then
    error("moe-lua plot: gnuplot is not installed (Debian package 'gnuplot', or 'gnuplot-nox' without X: " ..
      "apt-get install gnuplot)", 0)
  end
  os.execute("mkdir -p " .. sh_quote(output))
  table.sort(layer_names)
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
  if #layer_names > 0 then
    local blocks = {}
    for i, name in ipairs(layer_names) do
      blocks[i] = "# " .. name .. "\n" .. table.concat(layers[name], "\n")
    end
    write(output .. "/expert_load.dat", "# step share_e0 share_e1 ... (one block per layer)\n" ..
      table.concat(blocks, "\n\n\n") .. "\n")
    local first = layers[layer_names[1]][1]
    local n_experts = select(2, first:gsub("%S+", "")) - 1
    local rows = #layer_names
    gp[#gp + 1] = ("set terminal png size 1000,%d"):format(math.max(300, 260 * rows))
    gp[#gp + 1] = ("set output %q"):format(output .. "/expert_load.png")
    gp[#gp + 1] = ("set multiplot layout %d,1 title 'expert load (share of routed tokens)'"):format(rows)
    gp[#gp + 1] = "set key outside right"
    gp[#gp + 1] = "set ylabel 'share of tokens'"
    for i, name in ipairs(layer_names) do
      gp[#gp + 1] = ("set title %q"):format(name)
      local cols = {}
      for j = 1, n_experts do
        cols[j] = ("%s index %d using 1:%d with lines title 'e%d'"):format(j == 1 and ("%q"):format(
          output .. "/expert_load.dat") or "''", i - 1, j + 1, j - 1)
      end
      gp[#gp + 1] = "plot " .. table.concat(cols, ", ")
    end
    gp[#gp + 1] = "unset multiplot"
    pngs[#pngs + 1] = output .. "/expert_load.png"
  end
  write(output .. "/plot.gp", table.concat(gp, "\n") .. "\n")
  local p = io.popen("gnuplot " .. sh_quote(output .. "/plot.gp") .. " 2>&1")
  local msg = p:read("a")
  local ok = p:close()
  if not ok then error(("moe-lua plot: gnuplot failed on %s/plot.gp: %s"):format(output, msg), 0) end
  return pngs
end

function M.main(...)
  local moe = require "moe"
  local cfg, rest = moe.config({ out_dir = "out", output = "" }, { ... })
  if #rest > 0 then
    io.stderr:write(("moe-lua plot: unexpected argument '%s'\n%s\n"):format(tostring(rest[1]), M.usage))
    return 1
  end
  local output = cfg.output ~= "" and cfg.output or cfg.out_dir
  local ok, res = pcall(M.render, cfg.out_dir .. "/metrics.jsonl", output)
  if not ok then
    io.stderr:write(tostring(res), "\n")
    return 1
  end
  for _, p in ipairs(res) do print("wrote " .. p) end
  return 0
end

return M
