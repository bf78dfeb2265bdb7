--[==[
bench/optim.lua - the optimizer step and gradient clipping on the parameter
shapes of the MegaBlocks dMoE models of bench/train_125m.lua (46M: 6 x 512,
125M: 12 x 768; 64 experts, GELU experts 4 x d wide, byte vocabulary 257),
bf16 parameters with fp32 master weights and AdamW state, bf16 gradients:

  - AdamW per tensor (optim.AdamW{multi_tensor=false}: one adamw_step launch
    per parameter) against the multi-tensor step (one adamw_step_multi call:
    a few launches), and the multi-tensor step with the clip coefficient and
    skip flag read on the device;
  - clipping: clip_grad_norm with its host read, the lazy form (norm and
    scale on the device), and optim.grad_norm alone (norm, coefficient and
    flag: two launches), which opt:step{grad_scale=, skip=} then applies.

  moe-lua bench/optim.lua [model=46m|125m|both] [device=cuda] [json=FILE] [repeats=10] [iters=10]
      [shapes=FILE]   writes the parameter list (name, shape, weight decay) as
                      JSON for bench/optim_torch.py and exits; on the GPU machine:
  moe-lua bench/optim.lua model=both shapes=/tmp/optim_shapes.json
  python3 bench/optim_torch.py /tmp/optim_shapes.json [--json FILE]

Bytes: the minimum an AdamW step moves with fp32 master weights (read the
bf16 gradient, read and write master, exp_avg, exp_avg_sq, write the bf16
parameter: 28 bytes per element) and a norm (read the gradient, 2 bytes);
GB/s = bytes / time. PyTorch's side (torch.optim.AdamW(fused=True) on fp32
parameters, as the PyTorch training reference, and clip_grad_norm_ with
foreach kernels) is bench/optim_torch.py, on the same shapes. device=cpu
runs the same cases on the host (a smoke test of the script).
]==]
local moe = require "moe"
local optim = require "moe.optim"
local train = require "moe.train"
local bench = dofile((arg[0]:match("^(.*)/") or ".") .. "/lib.lua")

local cfg = bench.config { model = "46m", device = "cuda", repeats = 10, iters = 10, shapes = "" }
local dev = cfg.device
assert(dev == "cpu" or moe.cuda.is_available(), "bench/optim.lua needs a CUDA GPU (device=cpu: a smoke test)")

local MODELS = {
  ["46m"] = { d_model = 512, n_layers = 6, n_heads = 8 },
  ["125m"] = { d_model = 768, n_layers = 12, n_heads = 12 },
  tiny = { d_model = 64, n_layers = 2, n_heads = 2 }, -- a smoke test of the script (device=cpu)
}

-- The model's named parameters (built on dev, then freed: only the shapes
-- and names matter), with train's no_decay rule (1-D parameters). The
-- expert weights dominate: 64 x 2 x d x 4d per layer (about 0.8G elements
-- for 46m, 3.6G for 125m: the names count active parameters).
local function model_params(name)
  local m = MODELS[name] or error("bench/optim.lua: model must be 46m, 125m or both, got " .. name)
  local tcfg = train.config {
    model = { vocab_size = 257, d_model = m.d_model, n_layers = m.n_layers, n_heads = m.n_heads,
      pos = "rope", norm = "layernorm", tie_embeddings = true, dropout = 0.0, init_std = 0.02,
      ffn = "moe", d_ff = 4 * m.d_model,
      moe = { kind = "dmoe", num_experts = 64, top_k = 1, ffn_hidden_size = 4 * m.d_model,
        mlp_type = "mlp", activation = "gelu", loss_weight = 0.1, every = 1 } },
    seq_len = 1024, batch_size = 1, steps = 1, device = dev, dtype = "bf16", data = "",
  }
  local model = train.build_model(tcfg, dev)
  local out = {}
  for _, e in ipairs(model:named_parameters()) do
    out[#out + 1] = { name = e[1], shape = e[2].shape, decay = e[2]:dim() >= 2 }
    e[2]:free()
  end
  return out
end

local names = cfg.model == "both" and { "46m", "125m" } or { cfg.model }

if cfg.shapes ~= "" then
  local obj = {}
  for _, name in ipairs(names) do
    local list = bench.list {}
    for _, p in ipairs(model_params(name)) do
      list[#list + 1] = { name = p.name, shape = bench.list(p.shape), decay = p.decay }
    end
    obj[name] = list
  end
  local f = assert(io.open(cfg.shapes, "w"))
  f:write(bench.encode(obj), "\n")
  f:close()
  print("wrote " .. cfg.shapes)
  return
end

local function time(f)
  return (bench.time(f, { device = dev, iters = cfg.iters, repeats = cfg.repeats, warmup = cfg.warmup,
                          cooldown = cfg.cooldown }))
end

local results = {}
for _, name in ipairs(names) do
  local shapes = model_params(name)
  collectgarbage()
  -- one set of parameters (the 125m expert stacks take ~58 GB with one
  -- optimizer's state); each optimizer is made, timed and freed in turn
  local ps, named, numel = {}, {}, 0
  for i, s in ipairs(shapes) do
    local t = (moe.randn(s.shape, { device = dev }) * 0.02):to("bf16")
    t.grad = (moe.randn(s.shape, { device = dev }) * 0.01):to("bf16")
    ps[i], named[i] = t, { s.name, t }
    numel = numel + t:numel()
  end
  local function add(case, secs, bytes)
    results[#results + 1] = { model = name, tensors = #shapes, params = numel, case = case,
                              ms = secs * 1e3, gbs = bytes / secs / 1e9 }
  end
  local function free_state(opt)
    for _, t in pairs(opt:state_dict()) do t:free() end
    collectgarbage()
  end
  local adam_bytes, norm_bytes = 28 * numel, 2 * numel
  local ref = optim.AdamW(named, { lr = 1e-4, weight_decay = 0.1, multi_tensor = false })
  add("AdamW per tensor", time(function() ref:step() end), adam_bytes)
  free_state(ref)
  local multi = optim.AdamW(named, { lr = 1e-4, weight_decay = 0.1 })
  add("AdamW multi-tensor", time(function() multi:step() end), adam_bytes)
  local n, c, f = optim.grad_norm(ps, 1.0)
  add("AdamW multi-tensor, grad_scale + skip", time(function() multi:step { grad_scale = c, skip = f } end),
      adam_bytes)
  n:free(); c:free(); f:free()
  add("grad_norm (norm, coef, flag)", time(function()
    local a, b, d = optim.grad_norm(ps, 1.0)
    a:free(); b:free(); d:free()
  end), norm_bytes)
  -- max_norm above the norm: the gradients stay as they are between samples
  add("clip_grad_norm (host read)", time(function() optim.clip_grad_norm(ps, 1e9) end), norm_bytes)
  add("clip_grad_norm lazy (scales)", time(function() optim.clip_grad_norm(ps, 1e9, { lazy = true }):free() end),
      3 * norm_bytes)
  add("grad_norm + multi-tensor step (a clipped step)", time(function()
    local a, b, d = optim.grad_norm(ps, 1.0)
    multi:step { grad_scale = b, skip = d }
    a:free(); b:free(); d:free()
  end), adam_bytes + norm_bytes)
  free_state(multi)
  for _, t in ipairs(ps) do t.grad = nil; t:free() end
  collectgarbage()
end

bench.write(cfg, {
  title = "Optimizer step and gradient clipping (bf16 params, fp32 master and state)",
  device = dev,
  reference = "bench/optim_torch.py: torch.optim.AdamW(fused=True), clip_grad_norm_(foreach=True)",
  results = results,
  columns = { { "model", "model" }, { "tensors", "tensors" }, { "params", "params" }, { "case", "case" },
              { "ms", "ms", "%.3f" }, { "GB/s", "gbs", "%.0f" } },
})
