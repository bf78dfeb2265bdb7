--[[
tests/dist/dp_layers.lua - the gradient reducer (moe.dist.reducer) on the MoE
layers trained outside moe.train: the Mixture of Attention heads (layers.MoA),
the capacity-factor MoE (layers.MoE) and the dMoE, under

  moe-lua launch -n 2 tests/dist/dp_layers.lua [device=cpu|cuda]

Each rank runs its own batch through the same layer (same seed), then:
  reference  backward unarmed, then every .grad all_reduce'd (avg) one by one
  reducer    the same backward with the reducer armed (buckets of 1 KB, so
             several buckets, lone parameters averaged in place), finished
The two must give the same gradients bit for bit (the same sums of the same
two numbers), and the same on every rank.
]]
local moe = require "moe"
local layers = require "moe.layers"
local dist = moe.dist
local o = moe.config { device = "cpu" }
dist.init { timeout = 120 }
local rank, world = dist.rank(), dist.world_size()
assert(world >= 2, "run with moe-lua launch -n 2")
local device = o.device == "cpu" and "cpu" or dist.device()

local function make(name)
  moe.manual_seed(11) -- the same weights on every rank
  local d = 32
  if name == "MoA" then -- CUDA attention takes bf16 with head dim 64 or 128
    local gpu = device ~= "cpu"
    return layers.MoA { d_model = gpu and 128 or d, n_heads = 2, num_experts = 4, top_k = 2, device = device,
      dtype = gpu and "bf16" or nil }
  elseif name == "MoE" then
    return layers.MoE { hidden_size = d, ffn_hidden_size = 48, num_experts = 4, top_k = 2,
      capacity_factor = 1.0, device = device }
  end
  return layers.dMoE { hidden_size = d, ffn_hidden_size = 48, num_experts = 4, top_k = 2, device = device }
end

local function loss_of(layer, name)
  moe.manual_seed(100 + rank) -- each rank its own batch
  local gpu_moa = name == "MoA" and device ~= "cpu"
  local x = moe.randn({ 2, 8, gpu_moa and 128 or 32 }):to(device, gpu_moa and "bf16" or "f32")
  local y = layer:forward(x)
  local l = (y * y):float():mean()
  local aux = rawget(layer, "aux_loss")
  if aux then l = l + aux end
  return l
end

local function grads(layer)
  local out = {}
  for _, np in ipairs(layer:named_parameters()) do
    local g = np[2].grad
    out[#out + 1] = { np[1], g and g:cpu():double():totable() or false }
  end
  return out
end

local function flat(t, acc)
  acc = acc or {}
  if type(t) ~= "table" then acc[#acc + 1] = t return acc end
  for _, v in ipairs(t) do flat(v, acc) end
  return acc
end

for _, name in ipairs { "MoA", "MoE", "dMoE" } do
  -- reference: plain backward, then one all_reduce(avg) per gradient
  local layer = make(name)
  moe.scope(function() loss_of(layer, name):backward() end)
  for _, p in ipairs(layer:parameters()) do
    if p.grad then dist.all_reduce(p.grad, "avg") end
  end
  local want = grads(layer)
  -- the reducer
  layer = make(name)
  local r = dist.reducer(layer:parameters(), { bucket_mb = 0.001 })
  r:arm()
  moe.scope(function() loss_of(layer, name):backward() end)
  r:finish()
  local got = grads(layer)
  assert(r:buckets() > 1, name .. ": expected several buckets, got " .. r:buckets())
  r:free()
  for i, w in ipairs(want) do
    local g = got[i]
    assert(g[1] == w[1], name .. ": parameter order")
    assert((g[2] == false) == (w[2] == false), ("%s: %s has a gradient on one side only"):format(name, w[1]))
    if w[2] then
      local a, b = flat(w[2]), flat(g[2])
      for j = 1, #a do
        if a[j] ~= b[j] then
          error(("%s: %s element %d: reducer %.17g, reference %.17g (rank %d)"):format(name, w[1], j - 1,
            b[j], a[j], rank), 0)
        end
      end
    end
  end
  -- the same on every rank
  local s = 0
  for _, g in ipairs(got) do if g[2] then for _, v in ipairs(flat(g[2])) do s = s + v end end end
  local hi, lo = moe.tensor({ s }, { dtype = "f64" }), moe.tensor({ s }, { dtype = "f64" })
  dist.all_reduce(hi, "max")
  dist.all_reduce(lo, "min")
  assert(hi:item() == lo:item(), name .. ": the averaged gradients differ between ranks")
  if rank == 0 then print(("ok   %s: reducer == per-gradient all_reduce, %d parameters (%s)"):format(
    name, #got, device)) end
end
