--[[
moe/cli/export.lua - `moe-lua export ckpt=DIR format=hf out=DIR2`: one
consolidated model (every shard of a sharded checkpoint assembled, or a
single-process checkpoint) as Hugging Face safetensors plus config.json.

  moe-lua export ckpt=out/run format=hf out=hf/run             # out_dir: its newest checkpoint
  moe-lua export ckpt=out/run/ckpt-1000 format=hf out=hf/run layout=mixtral

Layouts (layout=auto tries them in this order):
  mixtral   MixtralForCausalLM: a (d)MoE in every layer with SwiGLU experts
            (mlp_type=glu, activation=silu), kind=dmoe (dropless), RMSNorm,
            rotary positions, gates renormalised to sum 1
            (model.moe.normalize_expert_weights=1), no biases.
              wte.weight                     -> model.embed_tokens.weight
              blocks.i.ln1 / ln2.weight      -> model.layers.i.input_layernorm / post_attention_layernorm.weight
              blocks.i.attn.qkv.weight rows [0,d) [d,2d) [2d,3d) -> self_attn.q_proj / k_proj / v_proj.weight
              blocks.i.attn.proj.weight      -> self_attn.o_proj.weight
              blocks.i.ffn.router.layer.weight -> block_sparse_moe.gate.weight
              blocks.i.ffn.experts.w1[e]^T, w3[e]^T, w2[e]^T -> block_sparse_moe.experts.e.w1 / w3 / w2.weight
              ln_f.weight -> model.norm.weight;  lm_head.weight -> lm_head.weight (untied only)
            Both rotate the halves of a head (x_j with x_{j+D/2}), so q and k
            need no permutation.
  gpt2      GPT2LMHeadModel: a dense model with LayerNorm, learned positions,
            tied embeddings and GELU (gelu -> "gelu", gelu_tanh -> "gelu_new").
            Linear weights are transposed (GPT-2's Conv1D is (in, out)); the
            biases moe-lua's linears lack are written as zeros.
  moe-lua   anything else: the state dict's own names and shapes
            (docs/MODELS.md), config.json {"model_type": "moe-lua",
            "moe_lua": the model config, "seq_len": ...} and, in
            "not_mixtral" / "not_gpt2", why the other layouts do not fit.
layout=mixtral or gpt2 given explicitly is an error listing every mismatch.
The tokenizer saved in the checkpoint (state.json's record and its files,
in single-file and sharded checkpoints alike) is read back, checked against
its record, and its files are copied into out; a checkpoint whose
tokenizer files are missing exports the model with a warning.
]]
local M = {
  summary = "write a checkpoint as one Hugging Face model (Mixtral, GPT-2 or moe-lua layout)",
  usage = [[
usage: moe-lua export ckpt=DIR format=hf out=DIR2 [layout=auto|mixtral|gpt2|moe-lua]
  ckpt    a checkpoint folder (ckpt-<step>), or an out_dir (its newest checkpoint);
          sharded (several ranks) or not
  format  hf: out/model.safetensors and out/config.json, and the tokenizer's files
          saved in the checkpoint (vocab.json + merges.txt for GPT-2's, tokenizer.bpe)
  layout  auto (default): Mixtral where the model matches it, else GPT-2 for a
          dense model that matches it, else moe-lua's own names]],
}

local NAME = "moe-lua export"

local function fail(fmt, ...)
  error(setmetatable({ msg = NAME .. ": " .. fmt:format(...) }, { __tostring = function(e) return e.msg end }), 0)
end

-- Why cfg (a train config) is not a Mixtral model; empty when it is.
local function mixtral_mismatches(cfg, sd)
  local mc, mo, why = cfg.model, cfg.model.moe, {}
  local function need(ok, text) if not ok then why[#why + 1] = text end end
  need(mc.ffn == "moe", ("model.ffn=%s (Mixtral has a MoE in every layer)"):format(tostring(mc.ffn)))
  if mc.ffn == "moe" then
    need(mo.every == 1, ("model.moe.every=%s (Mixtral has a MoE in every layer)"):format(tostring(mo.every)))
    need(mo.kind == "dmoe", ("model.moe.kind=%s (Mixtral is dropless: dmoe)"):format(tostring(mo.kind)))
    need(mo.mlp_type == "glu" and mo.activation == "silu",
      ("experts mlp_type=%s activation=%s (Mixtral's experts are SwiGLU: glu with silu; GELU experts have no " ..
      "Mixtral equivalent)"):format(tostring(mo.mlp_type), tostring(mo.activation)))
    need((mo.normalize_expert_weights or 0) == 1,
      ("model.moe.normalize_expert_weights=%s (Mixtral renormalises the top-k gates to sum 1: set it to 1)"):format(
        tostring(mo.normalize_expert_weights or 0)))
  end
  need(mc.norm == "rmsnorm", ("model.norm=%s (Mixtral uses RMSNorm)"):format(tostring(mc.norm)))
  need(mc.pos == "rope", ("model.pos=%s (Mixtral uses rotary positions)"):format(tostring(mc.pos)))
  local biases = {}
  for name in pairs(sd) do
    if name:match("%.bias$") then biases[#biases + 1] = name end
  end
  table.sort(biases)
  if #biases > 0 then
    why[#why + 1] = ("%d bias%s, %s first (Mixtral has none)"):format(#biases, #biases == 1 and "" or "es", biases[1])
  end
  return why
end

local function gpt2_mismatches(cfg)
  local mc, why = cfg.model, {}
  local function need(ok, text) if not ok then why[#why + 1] = text end end
  need(mc.ffn == "dense", ("model.ffn=%s (GPT-2 is dense)"):format(tostring(mc.ffn)))
  need(mc.norm == "layernorm", ("model.norm=%s (GPT-2 uses LayerNorm)"):format(tostring(mc.norm)))
  need(mc.pos == "learned", ("model.pos=%s (GPT-2 has learned positions)"):format(tostring(mc.pos)))
  need(mc.tie_embeddings, "model.tie_embeddings=false (GPT-2 ties lm_head to wte)")
  local act = mc.moe and mc.moe.activation
  need(act == "gelu" or act == "gelu_tanh", ("activation=%s (GPT-2 uses GELU)"):format(tostring(act)))
  return why
end

local function T(t) return t:transpose(0, 1):contiguous() end

local function get(sd, name)
  local t = sd[name]
  if t == nil then fail("the checkpoint has no tensor '%s'", name) end
  return t
end

local function mixtral(cfg, sd)
  local mc, mo = cfg.model, cfg.model.moe
  local d, out = mc.d_model, {}
  out["model.embed_tokens.weight"] = get(sd, "wte.weight")
  if not mc.tie_embeddings then out["lm_head.weight"] = get(sd, "lm_head.weight") end
  out["model.norm.weight"] = get(sd, "ln_f.weight")
  for i = 0, mc.n_layers - 1 do
    local b, h = ("blocks.%d."):format(i), ("model.layers.%d."):format(i)
    out[h .. "input_layernorm.weight"] = get(sd, b .. "ln1.weight")
    out[h .. "post_attention_layernorm.weight"] = get(sd, b .. "ln2.weight")
    local qkv = get(sd, b .. "attn.qkv.weight")
    out[h .. "self_attn.q_proj.weight"] = qkv:narrow(0, 0, d):contiguous()
    out[h .. "self_attn.k_proj.weight"] = qkv:narrow(0, d, d):contiguous()
    out[h .. "self_attn.v_proj.weight"] = qkv:narrow(0, 2 * d, d):contiguous()
    out[h .. "self_attn.o_proj.weight"] = get(sd, b .. "attn.proj.weight")
    out[h .. "block_sparse_moe.gate.weight"] = get(sd, b .. "ffn.router.layer.weight")
    local w1, w2, w3 = get(sd, b .. "ffn.experts.w1"), get(sd, b .. "ffn.experts.w2"), get(sd, b .. "ffn.experts.w3")
    for e = 0, mo.num_experts - 1 do
      local x = ("%sblock_sparse_moe.experts.%d."):format(h, e)
      out[x .. "w1.weight"] = T(w1:select(0, e))
      out[x .. "w2.weight"] = T(w2:select(0, e))
      out[x .. "w3.weight"] = T(w3:select(0, e))
    end
  end
  local config = {
    architectures = { "MixtralForCausalLM" }, model_type = "mixtral", vocab_size = mc.vocab_size,
    hidden_size = d, intermediate_size = mo.ffn_hidden_size, num_hidden_layers = mc.n_layers,
    num_attention_heads = mc.n_heads, num_key_value_heads = mc.n_heads, head_dim = d // mc.n_heads,
    hidden_act = "silu", max_position_embeddings = cfg.seq_len, rms_norm_eps = 1e-6, rope_theta = 10000.0,
    num_local_experts = mo.num_experts, num_experts_per_tok = mo.top_k, tie_word_embeddings = mc.tie_embeddings,
    router_aux_loss_coef = mo.loss_weight, output_router_logits = false, attention_dropout = 0.0,
    initializer_range = mc.init_std, torch_dtype = "float32",
  }
  return out, config
end

local function gpt2(cfg, sd)
  local moe = require "moe"
  local mc, out = cfg.model, {}
  local function bias_or_zeros(name, n)
    return sd[name] or moe.zeros({ n })
  end
  out["transformer.wte.weight"] = get(sd, "wte.weight")
  out["transformer.wpe.weight"] = get(sd, "wpe.weight")
  out["transformer.ln_f.weight"] = get(sd, "ln_f.weight")
  out["transformer.ln_f.bias"] = get(sd, "ln_f.bias")
  for i = 0, mc.n_layers - 1 do
    local b, h = ("blocks.%d."):format(i), ("transformer.h.%d."):format(i)
    for _, pair in ipairs({ { "ln1", "ln_1" }, { "ln2", "ln_2" } }) do
      out[h .. pair[2] .. ".weight"] = get(sd, b .. pair[1] .. ".weight")
      out[h .. pair[2] .. ".bias"] = get(sd, b .. pair[1] .. ".bias")
    end
    local qkv, proj = get(sd, b .. "attn.qkv.weight"), get(sd, b .. "attn.proj.weight")
    out[h .. "attn.c_attn.weight"] = T(qkv)
    out[h .. "attn.c_attn.bias"] = bias_or_zeros(b .. "attn.qkv.bias", qkv.shape[1])
    out[h .. "attn.c_proj.weight"] = T(proj)
    out[h .. "attn.c_proj.bias"] = bias_or_zeros(b .. "attn.proj.bias", proj.shape[1])
    local fc1, fc2 = get(sd, b .. "ffn.fc1.weight"), get(sd, b .. "ffn.fc2.weight")
    out[h .. "mlp.c_fc.weight"] = T(fc1)
    out[h .. "mlp.c_fc.bias"] = bias_or_zeros(b .. "ffn.fc1.bias", fc1.shape[1])
    out[h .. "mlp.c_proj.weight"] = T(fc2)
    out[h .. "mlp.c_proj.bias"] = bias_or_zeros(b .. "ffn.fc2.bias", fc2.shape[1])
  end
  local config = {
    architectures = { "GPT2LMHeadModel" }, model_type = "gpt2", vocab_size = mc.vocab_size, n_embd = mc.d_model,
    n_layer = mc.n_layers, n_head = mc.n_heads, n_positions = cfg.seq_len, n_ctx = cfg.seq_len, n_inner = mc.d_ff,
    activation_function = mc.moe.activation == "gelu_tanh" and "gelu_new" or "gelu", layer_norm_epsilon = 1e-5,
    resid_pdrop = 0.0, embd_pdrop = 0.0, attn_pdrop = 0.0, tie_word_embeddings = true,
    initializer_range = mc.init_std, torch_dtype = "float32",
  }
  return out, config
end

local function run(...)
  local moe = require "moe"
  local checkpoint = require "moe.checkpoint"
  local dcp = require "moe.train.dcp"
  local tconfig = require "moe.train.config"
  local json = require("moe.metrics").json
  local o, rest = moe.config({ ckpt = "", format = "hf", out = "", layout = "auto" }, { ... })
  if #rest > 0 then fail("unexpected argument '%s' (arguments are key=value)\n%s", tostring(rest[1]), M.usage) end
  if o.ckpt == "" or o.out == "" then fail("give ckpt=DIR and out=DIR2\n%s", M.usage) end
  if o.format ~= "hf" then fail("format=%s: the only format is hf", o.format) end
  local layouts = { auto = true, mixtral = true, gpt2 = true, ["moe-lua"] = true }
  if not layouts[o.layout] then fail("layout=%s: auto, mixtral, gpt2 or moe-lua", o.layout) end
  local path = o.ckpt
  if not io.open(path .. "/state.json", "r") then
    path = checkpoint.latest(o.ckpt)
    if not path then fail("'%s' is neither a checkpoint (no state.json) nor an out_dir holding one", o.ckpt) end
  end
  local st = dcp.read_state(path, 0, 1)
  if type(st.config) ~= "table" then fail("%s/state.json has no config: cannot tell the model's layout", path) end
  local cfg = tconfig.config(st.config)
  local sd = dcp.consolidate(path, "model.")
  local not_mixtral, not_gpt2 = mixtral_mismatches(cfg, sd), gpt2_mismatches(cfg)
  local layout = o.layout
  if layout == "auto" then
    layout = #not_mixtral == 0 and "mixtral" or (#not_gpt2 == 0 and "gpt2" or "moe-lua")
  elseif layout == "mixtral" and #not_mixtral > 0 then
    fail("the model does not match Mixtral: %s", table.concat(not_mixtral, "; "))
  elseif layout == "gpt2" and #not_gpt2 > 0 then
    fail("the model does not match GPT-2: %s", table.concat(not_gpt2, "; "))
  end
  local tensors, config
  if layout == "mixtral" then
    tensors, config = mixtral(cfg, sd)
  elseif layout == "gpt2" then
    tensors, config = gpt2(cfg, sd)
  else
    tensors = sd
    config = { architectures = { "MoeLuaTransformerLM" }, model_type = "moe-lua", moe_lua = tconfig.plain(cfg.model),
      seq_len = cfg.seq_len, torch_dtype = "float32", not_mixtral = not_mixtral, not_gpt2 = not_gpt2 }
    if #not_mixtral == 0 then config.not_mixtral = nil end
    if #not_gpt2 == 0 then config.not_gpt2 = nil end
  end
  -- the tokenizer saved in the checkpoint (single-file or sharded): read back and
  -- checked against its record, then its files copied beside the model
  local tok_files, tok_note = {}, nil
  if type(st.tokenizer) == "table" then
    local tokenizer = require "moe.data.tokenizer"
    local ok, err = pcall(tokenizer.from_record, st.tokenizer, path, "", path .. "/state.json")
    if ok then
      for _, name in ipairs(st.tokenizer.files or {}) do
        local f = assert(io.open(path .. "/" .. name, "rb"))
        tok_files[name] = f:read("a")
        f:close()
      end
    else
      tok_note = ("warning: the tokenizer is not exported: %s"):format(tostring(err))
    end
  end
  checkpoint.mkdir_p(o.out)
  moe.save(o.out .. "/model.safetensors", tensors, { format = "pt" })
  checkpoint.write_atomic(o.out .. "/config.json", json.encode(config) .. "\n")
  local names = {}
  for name, text in pairs(tok_files) do
    checkpoint.write_atomic(o.out .. "/" .. name, text)
    names[#names + 1] = name
  end
  table.sort(names)
  local n = 0
  for _ in pairs(tensors) do n = n + 1 end
  print(("%s: %s (step %s) -> %s: %d tensors in the %s layout"):format(NAME, path, tostring(st.step), o.out, n, layout))
  if type(st.tokenizer) == "table" and not tok_note then
    print(("  tokenizer: %s, vocab_size %s%s"):format(tostring(st.tokenizer.kind), tostring(st.tokenizer.vocab_size),
      #names > 0 and (", files " .. table.concat(names, ", ")) or ""))
  end
  if tok_note then io.stderr:write(NAME, ": ", tok_note, "\n") end
  if layout == "moe-lua" then
    if o.layout == "auto" then
      print(("  not Mixtral: %s"):format(table.concat(not_mixtral, "; ")))
      print(("  not GPT-2: %s"):format(table.concat(not_gpt2, "; ")))
    end
  end
  return 0
end

function M.main(...)
  local ok, res = pcall(run, ...)
  if ok then return res end
  if type(res) == "table" and res.msg then
    io.stderr:write(res.msg, "\n")
    return 1
  end
  error(res, 0)
end

return M
