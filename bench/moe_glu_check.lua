--[[
bench/moe_glu_check.lua - the check "the MoE GLU layer forward and all
gradients against a PyTorch reference with the same weights and routing",
moe-lua side. Builds a MoE GLU layer in bf16 on the GPU (the CPU without
one): router logits = x @ wr (f32 softmax, top-k), gates in bf16,
moe.ops.glu_experts with impl "grouped" and "sparse" (block 128), and
backpropagates a fixed random dy. Writes the inputs, the weights, the ids,
the gates, the outputs and the gradients of x, wr, w1, w3, w2 (per impl)
with moe.save to DIR/glu_check.safetensors (all floats as F32: bf16 values
are exact in f32); bench/moe_glu_check.py recomputes the layer with torch in
f32 from those bf16 values and compares.

  moe-lua bench/moe_glu_check.lua [dir=DIR] [small=true]
]]
local moe = require "moe"

local cfg = moe.config { dir = ".", small = false }
local dir, small = cfg.dir, cfg.small

local dev = moe.cuda.is_available() and "cuda" or "cpu"
-- T not a multiple of 128; E = 8 with k = 2; f a multiple of 128 for sparse
local T, d, f, E, k = 1000, 512, 1024, 8, 2
if small then T, d, f, E, k = 100, 32, 256, 4, 2 end
moe.manual_seed(42)
local o = { dtype = "bf16", device = dev }
local x = moe.randn({ T, d }, o)
local wr = (moe.randn({ d, E }, o) * (1 / math.sqrt(d))):detach()
local w1 = (moe.randn({ E, d, f }, o) * (1 / math.sqrt(d))):detach()
local w3 = (moe.randn({ E, d, f }, o) * (1 / math.sqrt(d))):detach()
local w2 = (moe.randn({ E, f, d }, o) * (1 / math.sqrt(f))):detach()
local dy = moe.randn({ T, d }, o)

local saved = {}
local function keep(name, t) saved[name] = t:float():cpu() end
for name, t in pairs({ x = x, wr = wr, w1 = w1, w3 = w3, w2 = w2, dy = dy }) do keep(name, t) end

for _, impl in ipairs({ "grouped", "sparse" }) do
  local lx = x:detach():requires_grad_(true)
  local lr = wr:detach():requires_grad_(true)
  local l1, l3, l2 = w1:detach():requires_grad_(true), w3:detach():requires_grad_(true),
    w2:detach():requires_grad_(true)
  local probs = moe.softmax(moe.matmul(lx, lr):float(), -1)
  local g32, ids = moe.topk(probs, k, -1)
  local gates = g32:bfloat16()
  local plan = moe.ops.routing_plan(ids, E, impl == "sparse" and { block_size = 128, ffn_hidden = f } or nil)
  local out = moe.ops.glu_experts(lx, l1, l3, l2, plan, gates, { impl = impl })
  out:backward(dy)
  keep("ids_" .. impl, ids)
  saved["ids_" .. impl] = ids:cpu()
  keep("gates_" .. impl, gates)
  keep("out_" .. impl, out)
  for name, t in pairs({ x = lx, wr = lr, w1 = l1, w3 = l3, w2 = l2 }) do
    keep("grad_" .. name .. "_" .. impl, t.grad)
  end
end
local path = dir .. "/glu_check.safetensors"
moe.save(path, saved, { device = dev, T = tostring(T), d = tostring(d), f = tostring(f),
                        E = tostring(E), k = tostring(k) })
print(("moe_glu_check: wrote %s (%s, T %d, d %d, f %d, E %d, k %d)"):format(path, dev, T, d, f, E, k))
