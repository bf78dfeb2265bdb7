--[[
moe/train/build.lua - what moe.train builds from its config when the caller
does not hand it over: the model (moe.nn, moe.layers), the data (moe.data)
and the optimizer (moe.optim); and a model rebuilt from a checkpoint.
]]
local checkpoint = require "moe.checkpoint"
local tconfig = require "moe.train.config"

local M = {}

--- model(cfg, device [, ep_group [, etp_group]]) -> an nn.TransformerLM from
--- cfg.model (moe.nn, moe.layers); with ep_group (a moe.dist group) the MoE
--- layers spread their experts over it (expert parallelism), with etp_group
--- they split every expert's hidden units over it (weight parallelism).
function M.model(cfg, device, ep_group, etp_group)
  local nn = require "moe.nn"
  local mc = cfg.model
  local mo = mc.moe
  local ffn
  if mc.ffn == "moe" then
    local layers = require "moe.layers"
    ffn = function(i)
      if mo.every > 1 and i % mo.every ~= mo.every - 1 then
        return nn.MLP { d_model = mc.d_model, d_ff = mc.d_ff, activation = mo.activation }
      end
      local opts = {
        hidden_size = mc.d_model, ffn_hidden_size = mo.ffn_hidden_size, num_experts = mo.num_experts,
        top_k = mo.top_k, mlp_type = mo.mlp_type, activation_fn = mo.activation,
        mlp_impl = mo.mlp_impl, moe_loss_weight = mo.loss_weight, moe_zloss_weight = mo.zloss_weight,
        moe_jitter_eps = mo.jitter_eps,
        moe_normalize_expert_weights = mo.normalize_expert_weights > 0 and mo.normalize_expert_weights or nil,
        uniform_expert_assignment = mo.uniform_expert_assignment,
      }
      if ep_group then
        opts.moe_expert_model_parallelism, opts.expert_parallel_group = true, ep_group
        opts.ep_overlap_chunks = cfg.parallel and cfg.parallel.ep_chunks or nil
      end
      if etp_group then
        opts.moe_weight_parallelism, opts.weight_parallel_group = true, etp_group
      end
      if mo.kind == "moe" then
        opts.capacity_factor = mo.capacity_factor
        return layers.MoE(opts)
      end
      return layers.dMoE(opts)
    end
  else
    ffn = function() return nn.MLP { d_model = mc.d_model, d_ff = mc.d_ff, activation = mo.activation } end
  end
  local lm = nn.TransformerLM {
    vocab_size = mc.vocab_size, d_model = mc.d_model, n_layers = mc.n_layers, n_heads = mc.n_heads,
    seq_len = cfg.seq_len, pos = mc.pos, tie_embeddings = mc.tie_embeddings, dropout = mc.dropout,
    norm = mc.norm, init_std = mc.init_std, ffn = ffn,
  }
  if device ~= "cpu" or cfg.dtype ~= "f32" then lm:to(device, cfg.dtype) end
  return lm
end

--- load_model(ckpt_path, device) -> model (eval mode), cfg, state: the model of a checkpoint,
--- rebuilt from the config in its state.json and loaded with its weights; state is
--- the state.json table (state.tokenizer: the tokenizer's record, moe/data/tokenizer.lua).
function M.load_model(path, device)
  local dcp = require "moe.train.dcp"
  local c = dcp.is_sharded(path) and { model = dcp.consolidate(path), state = dcp.read_state(path, 0, 1) }
    or checkpoint.load(path, { device = device })
  local cfg = tconfig.config(c.state.config or {})
  local model = M.model(cfg, device)
  model:load_state_dict(c.model)
  model:eval()
  return model, cfg, c.state
end

local function file_exists(path)
  local f = io.open(path, "rb")
  if f then f:close() return true end
  return false
end

--- data(cfg) -> train_data, valid_data, tokenizer (moe.data).
function M.data(cfg)
  local prefix = cfg.data
  if prefix == "bible" then prefix = require("moe.data").bible_corpus { dir = cfg.data_dir } end
  if prefix == "" or not (file_exists(prefix .. ".bin") and file_exists(prefix .. ".idx")) then
    error(("train: data='%s': no dataset %s.bin / %s.idx (preprocess text with `moe-lua preprocess " ..
      "input=... output=PREFIX`, or use data=bible)"):format(cfg.data, prefix, prefix), 0)
  end
  local data = require "moe.data"
  local ds = data.IndexedDataset(prefix)
  -- the tokenizer preprocess recorded beside the data (prefix.meta.json); none: byte data
  local tok = data.dataset_tokenizer(prefix)
  if tok and cfg.model.vocab_size < tok.vocab_size then
    error(("train: model.vocab_size=%d is smaller than the vocabulary of data='%s' (%d tokens, %s " ..
      "tokenizer recorded in %s.meta.json): pass model.vocab_size=%d"):format(cfg.model.vocab_size, cfg.data,
      tok.vocab_size, tok.name, prefix, tok.vocab_size), 0)
  end
  local vok, verr = pcall(data.check_vocab, ds, cfg.model.vocab_size) -- ids the embedding cannot take
  if not vok then
    error(("train: data='%s': %s"):format(cfg.data, (tostring(verr):gsub("^data%.check_vocab: ", ""))), 0)
  end
  local function split(name)
    return data.GPTDataset(ds, { seq_len = cfg.seq_len, seed = cfg.data_seed, split = name,
      valid_fraction = cfg.valid_fraction })
  end
  return split("train"), split("valid"), tok or data.ByteTokenizer()
end

--- optimizer(named_params, cfg) -> AdamW or SGD (moe.optim) from cfg.
function M.optimizer(named, cfg)
  local optim = require "moe.optim"
  if cfg.optimizer == "sgd" then
    return optim.SGD(named, { lr = cfg.lr, momentum = 0.9, weight_decay = cfg.weight_decay })
  end
  return optim.AdamW(named, { lr = cfg.lr, betas = { cfg.beta1, cfg.beta2 }, eps = cfg.eps,
    weight_decay = cfg.weight_decay })
end

return M
