--[[
experiments/demo.lua - a short tour of moe-lua's tensors: constructors,
arithmetic with broadcasting, views that share storage, and the GPU when
there is one. The default experiment until the training quickstart lands.

  moe-lua experiments/demo.lua                  # device=auto: cuda if visible
  moe-lua experiments/demo.lua device=cpu n=6 seed=1
  moe-lua experiments/demo.lua --help           # the keys and their defaults
]]
local moe = require "moe"

local cfg = moe.config { device = "auto", n = 4, seed = 0 }
local device = cfg.device
if device == "auto" then device = moe.cuda.is_available() and "cuda" or "cpu" end
moe.manual_seed(cfg.seed)

local function section(title) print(("\n== %s"):format(title)) end

print(moe.version_report())
print(("device = %s, n = %d, seed = %d"):format(device, cfg.n, cfg.seed))

section("constructors")
local x = moe.randn({ cfg.n, 3 }, { device = device })
print(x)
print(moe.arange(cfg.n, { device = device }))
print(moe.tensor({ { 1, 2, 3 }, { 4, 5, 6 } }, { dtype = "bf16", device = device }))

section("arithmetic with broadcasting")
local bias = moe.tensor({ 10, 20, 30 }, { device = device })       -- (3)
local scale = moe.arange(1, cfg.n + 1, { device = device }):view(cfg.n, 1) -- (n, 1)
print((x + bias) * scale)                                           -- (n, 3)
print(1 - x / 2)

section("views share storage")
local m = moe.zeros({ 3, 4 }, { device = device })
m:select(0, 1):fill_(1)         -- row 1
m:narrow(1, 2, 2):fill_(2)      -- columns 2 and 3
print(m)
print(m:transpose(0, 1), "contiguous: " .. tostring(m:transpose(0, 1):is_contiguous()))
print(m:view(-1):slice(0, 0, 12, 5))

section("back on the host")
local row = x:select(0, 0):cpu():totable()
for i, v in ipairs(row) do row[i] = ("%.3f"):format(v) end
print(("x:select(0, 0):totable() = {%s}, a Lua table"):format(table.concat(row, ", ")))

local stats = moe.memory_stats(device)
print(("\n%s: %d live storages, %d bytes allocated, peak %d"):format(
  stats.device, stats.live_storages, stats.allocated, stats.peak_allocated))
