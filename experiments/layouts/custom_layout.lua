--[[
experiments/layouts/custom_layout.lua - a layout written as a Lua function:
where each module of a dMoE language model lives when it trains on several
ranks (docs/DISTRIBUTED.md "Layouts as Lua functions").

  moe-lua launch -n 2 experiments/layouts/custom_layout.lua            # on the CPU: device=cpu
  moe-lua launch -n 2 experiments/layouts/custom_layout.lua steps=50 model.n_layers=6
  moe-lua launch -n 4 experiments/layouts/custom_layout.lua parallel.dp_replicate=2

The layout keeps the embeddings, the norms and the routers replicated
(every rank holds them whole; their gradients and AdamW state are still
sharded over parallel.dp_shard, ZeRO-2), shards each attention block
(ZeRO-3: a unit gathered for its forward and its backward, released after
each), and places the experts by expert parallelism (parallel.ep = 2: each
rank holds half of every MoE layer's experts). parallel.dp_shard defaults
to the job's world size divided by dp_replicate. `train.run(cfg, {layout =
fn})` asks fn(name, module) for every module ("" is the model itself) and
checks every answer before training: an answer it cannot use is an error
naming the module.
]]
local moe = require "moe"
local train = require "moe.train"

-- the layout: a module's name and the module itself -> where its parameters live
local function layout(name, module)
  if module.__name == "CausalSelfAttention" then return "shard" end -- blocks.N.attn
  if name:match("%.experts$") then return "expert" end              -- blocks.N.ffn.experts
  return nil -- the parent's placement; the model's own is "replicate"
end

local defaults = train.defaults()
defaults.model.d_model, defaults.model.n_layers, defaults.model.n_heads = 64, 2, 4
defaults.model.moe.num_experts, defaults.model.moe.top_k, defaults.model.moe.ffn_hidden_size = 4, 2, 128
defaults.model.tie_embeddings = false
defaults.data, defaults.seq_len, defaults.batch_size = "bible", 64, 4
defaults.steps, defaults.lr, defaults.min_lr, defaults.warmup = 20, 3e-3, 3e-4, 5
defaults.eval_every, defaults.eval_iters, defaults.log_every = 10, 2, 5
defaults.out_dir, defaults.save_every, defaults.sample_tokens = "out/custom_layout", 0, 0
defaults.tensorboard, defaults.device = false, "cpu"
defaults.parallel.ep = 2
local cfg = moe.config(defaults)
if cfg.parallel.dp_shard == 0 then
  local world = moe.dist.world_size()
  cfg.parallel.dp_shard = world // math.max(cfg.parallel.dp_replicate, 1)
end

local result = train.run(cfg, { layout = layout })
if moe.dist.rank() == 0 then
  print(("custom_layout: %d steps, last loss %.4f"):format(result.step, result.losses[result.step]))
end
return result, cfg, layout -- for tests/dist/layouts.lua
