--[[
bench/step_floor.lua - the floor of one training step of the benchmark models
(bench/train_125m.lua's: pre-norm GPT, LayerNorm with bias, qkv/proj without
bias, rotary positions, tied byte embeddings V = 257, dMoE experts w1 (E, d, f)
and w2 (E, f, d) with a d x E router, or a dense d -> ffn -> d MLP; bf16
parameters and gradients, fp32 master weights and AdamW moments) from its
config, a GEMM rate and a copy bandwidth measured on the GPU:

  moe-lua bench/step_floor.lua gemm_tflops=760 copy_tbs=2.97 [models=dmoe46,dmoe125,dense125] \
      [json=FILE] [md=FILE]
  models=custom takes the model from train_125m.lua's keys (kind, n_layers, d_model,
  n_heads, ffn, experts, top_k, seq_len, batch_size).

What is counted, per step of T = batch_size x seq_len tokens, P parameters:
  FLOPs      6 x active parameters x T (every GEMM, the router and the tied output
             projection included) + attention's score and value matmuls with the
             causal mask skipped: 6 n_layers d S per token (half of the 12 n_layers
             d S of the MFU convention); all at the measured GEMM rate.
  weights    forward reads the bf16 weights (2P bytes: with 64 experts and top-1
             every expert gets tokens, so every expert weight is read); backward
             reads them again (2P) and writes the bf16 gradients (2P); the global
             norm reads the gradients (2P); AdamW reads the gradient, the fp32
             master, both fp32 moments (14P) and writes master, moments and the
             bf16 parameter (14P).
  activations (floor): the residual stream only, as a fully fused layer with
             recomputation would move it: per layer, forward reads its input and
             writes its output, backward reads the saved input and the incoming
             gradient and writes the outgoing one (5 T d bf16 elements per layer),
             plus the logits (T V f32 written, read by the loss, its gradient
             written and read by the head's backward).
  activations (kernels): an estimate for an implementation with one kernel per
             GEMM, norm, attention and permutation, elementwise work fused into
             them: each GEMM reads its inputs and writes its output once in bf16
             (the GELU's input and output both stored), flash attention reads q, k,
             v and writes o, LayerNorm reads and writes T d, the dMoE permutes and
             un-permutes T k rows; backward moves twice the forward's bytes. Not
             a bound: a reference for what the step's kernels move.
The floor of a phase is max(FLOPs / GEMM rate, bytes / copy bandwidth); the step's
floor is the sum over forward, backward and optimizer (clip + AdamW), which run
one after the other. `overlap_floor` (max over the whole step of FLOPs and bytes)
is the lower figure if everything overlapped.
]]
local moe = require "moe"

local M = {}

M.PRESETS = {
  dmoe46 = { kind = "dmoe", n_layers = 6, d_model = 512, n_heads = 8, ffn = 2048, experts = 64, top_k = 1,
    seq_len = 1024, batch_size = 16, vocab = 257 },
  dmoe125 = { kind = "dmoe", n_layers = 12, d_model = 768, n_heads = 12, ffn = 3072, experts = 64, top_k = 1,
    seq_len = 1024, batch_size = 8, vocab = 257 },
  dense125 = { kind = "dense", n_layers = 12, d_model = 768, n_heads = 12, ffn = 3072, experts = 0, top_k = 0,
    seq_len = 1024, batch_size = 8, vocab = 257 },
}

--- params(m) -> total parameters, active parameters per token (as
--- nn.TransformerLM's num_parameters / num_active_parameters count them).
function M.params(m)
  local d, L, V = m.d_model, m.n_layers, m.vocab or 257
  local attn = 4 * d * d + 4 * d -- qkv, proj, two LayerNorms (weight, bias)
  local ffn_total, ffn_active
  if m.kind == "dense" then
    ffn_total = 2 * d * m.ffn
    ffn_active = ffn_total
  else
    ffn_total = m.experts * d + 2 * m.experts * d * m.ffn
    ffn_active = m.experts * d + m.top_k * 2 * d * m.ffn
  end
  local total = V * d + L * (attn + ffn_total) + 2 * d
  local active = V * d + L * (attn + ffn_active) + 2 * d
  return total, active
end

-- Forward activation traffic (elements) of one layer under the kernel-boundary model.
local function layer_fwd_elements(m, T)
  local d = m.d_model
  local e = 2 * T * d -- LN1: read x, write h
    + 4 * T * d       -- qkv GEMM: read h, write q, k, v
    + 4 * T * d       -- attention: read q, k, v, write o
    + 3 * T * d       -- proj GEMM + residual: read o and x, write x'
    + 2 * T * d       -- LN2
  if m.kind == "dense" then
    local f = m.ffn
    e = e + (T * d + 2 * T * f) -- fc1: read h2, write pre-activation and GELU
      + (T * f + 2 * T * d)     -- fc2 + residual: read act and x', write out
  else
    local k, f = m.top_k, m.ffn
    e = e + T * d + 2 * T * m.experts -- router: read h2, write logits (and read them for top-k)
      + (T * d + k * T * d)             -- permute: read h2, write T k rows
      + (k * T * d + 2 * k * T * f)     -- w1: read rows, write pre-activation and GELU
      + (k * T * f + k * T * d)         -- w2: read act, write rows
      + (k * T * d + 2 * T * d)         -- combine + residual: read rows and x', write out
  end
  return e
end

--- floor(m, gemm_flops, copy_bytes_per_s) -> a table of the step's floor (seconds,
--- bytes, FLOPs) for model m (a preset table) at those rates.
function M.floor(m, gemm, bw)
  local T = m.batch_size * m.seq_len
  local P, A = M.params(m)
  local d, L, V = m.d_model, m.n_layers, m.vocab or 257
  local attn_fwd = 2 * L * d * m.seq_len * T -- causal: half of 4 L d S per token
  local fwd_flops = 2 * A * T + attn_fwd
  local bwd_flops = 2 * fwd_flops
  local logits = 2 * 4 * T * V -- f32 logits written and read (forward), as bytes
  local resid_fwd, resid_bwd = 2 * 2 * T * d * L, 3 * 2 * T * d * L
  local w_fwd, w_bwd, w_opt = 2 * P, 4 * P, 2 * P + 28 * P
  local kern_fwd = 2 * L * layer_fwd_elements(m, T) + 2 * T * d + logits
  local r = {
    params = P, active_params = A, tokens = T,
    flops = fwd_flops + bwd_flops, flops_fwd = fwd_flops, flops_bwd = bwd_flops,
    bytes_weights = w_fwd + w_bwd + w_opt, bytes_optimizer = w_opt,
    bytes_act_min = resid_fwd + resid_bwd + 2 * logits,
    bytes_act_kernels = 3 * kern_fwd,
  }
  local function phase(flops, bytes) return math.max(flops / gemm, bytes / bw) end
  r.floor_fwd = phase(fwd_flops, w_fwd + resid_fwd + logits)
  r.floor_bwd = phase(bwd_flops, w_bwd + resid_bwd + logits)
  r.floor_opt = w_opt / bw
  r.floor = r.floor_fwd + r.floor_bwd + r.floor_opt
  r.floor_kernels = phase(fwd_flops, w_fwd + kern_fwd) + phase(bwd_flops, w_bwd + 2 * kern_fwd) + r.floor_opt
  r.overlap_floor = math.max(r.flops / gemm, (r.bytes_weights + r.bytes_act_min) / bw)
  r.compute_s = r.flops / gemm
  r.memory_s = (r.bytes_weights + r.bytes_act_min) / bw
  r.tokens_per_s_at_floor = T / r.floor
  return r
end

local function main(argv)
  local bench = dofile((arg[0]:match("^(.*)/") or ".") .. "/lib.lua")
  local o = moe.config({ gemm_tflops = 0.0, copy_tbs = 0.0, models = "dmoe46,dmoe125,dense125", json = "", md = "",
    kind = "dmoe", n_layers = 12, d_model = 768, n_heads = 12, ffn = 3072, experts = 64, top_k = 1,
    seq_len = 1024, batch_size = 8 }, argv)
  if not (o.gemm_tflops > 0 and o.copy_tbs > 0) then
    error("step_floor: gemm_tflops= and copy_tbs= (the measured GEMM rate and copy bandwidth) must be > 0", 0)
  end
  local rows = {}
  for name in o.models:gmatch("[^,%s]+") do
    local m = M.PRESETS[name]
    if name == "custom" then
      m = { kind = o.kind, n_layers = o.n_layers, d_model = o.d_model, n_heads = o.n_heads, ffn = o.ffn,
        experts = o.kind == "dense" and 0 or o.experts, top_k = o.kind == "dense" and 0 or o.top_k,
        seq_len = o.seq_len, batch_size = o.batch_size, vocab = 257 }
    end
    if not m then
      local names = {}
      for k in pairs(M.PRESETS) do names[#names + 1] = k end
      table.sort(names)
      error(("step_floor: unknown model '%s' (valid: %s, custom)"):format(name, table.concat(names, ", ")), 0)
    end
    local r = M.floor(m, o.gemm_tflops * 1e12, o.copy_tbs * 1e12)
    r.model = name
    r.config = m
    rows[#rows + 1] = r
  end
  local out = { title = "The floor of one training step", gemm_tflops = o.gemm_tflops, copy_tbs = o.copy_tbs,
    model = "per phase max(FLOPs / GEMM rate, bytes / copy bandwidth), summed over forward, backward and " ..
      "the optimizer; bench/step_floor.lua says what is counted",
    rows = rows, results = rows, reference = "bench/step_floor.lua", config = o, device = "cpu",
    notes = { ("computed (no device) at the rates given: GEMM %g TFLOP/s, copy %g TB/s"):format(o.gemm_tflops,
      o.copy_tbs) } }
  out.columns = {
    { "model", "model" }, { "params", "params" }, { "active", "active_params" }, { "tokens", "tokens" },
    { "GFLOP", function(r) return r.flops / 1e9 end, "%.0f" },
    { "weights+optim GB", function(r) return r.bytes_weights / 1e9 end, "%.2f" },
    { "act min GB", function(r) return r.bytes_act_min / 1e9 end, "%.2f" },
    { "act kernels GB", function(r) return r.bytes_act_kernels / 1e9 end, "%.2f" },
    { "compute ms", function(r) return 1e3 * r.compute_s end, "%.2f" },
    { "memory ms", function(r) return 1e3 * r.memory_s end, "%.2f" },
    { "floor ms", function(r) return 1e3 * r.floor end, "%.2f" },
    { "floor (kernels) ms", function(r) return 1e3 * r.floor_kernels end, "%.2f" },
    { "tokens/s at floor", "tokens_per_s_at_floor", "%.0f" },
  }
  bench.write({ json = o.json, md = o.md }, out)
  return out
end

if arg and arg[0] and arg[0]:match("step_floor%.lua$") then main(arg) end
return M
