--[[
moe/nn/transformer.lua - CausalSelfAttention, TransformerBlock and
TransformerLM (GPT-2 / Megatron layout, pre-norm), re-exported by
lua/moe/nn/init.lua. Option tables are documented in docs/MODELS.md.

Parameter names (PyTorch-style, as state_dict writes them):
  wte.weight (V, d), wpe.weight (seq_len, d) when pos = "learned",
  blocks.<i>.ln1.{weight,bias}, blocks.<i>.attn.qkv.{weight (3d, d),bias},
  blocks.<i>.attn.proj.{weight (d, d),bias}, blocks.<i>.ln2.*,
  blocks.<i>.ffn.* (the feed-forward module of layer i), ln_f.*,
  lm_head.weight (V, d) when tie_embeddings = false.
]]
local moe = require "moe"
local base = require "moe.nn.module"
local L = require "moe.nn.layers"

local class, Module = base.class, base.Module
local check_opts, check_pos_int = L.check_opts, L.check_pos_int

local M = {}

-- Memory: each module's forward runs inside moe.scope (nn.Module's __call),
-- which frees the intermediates when it returns; what a layer keeps for later
-- calls (rope tables, the causal mask, the KV cache) goes through moe.keep and
-- is freed here when it is replaced.
local keep = moe.keep

-- Frees a kept tensor that is being replaced (nil: nothing).
local function drop(t)
  if t ~= nil then t:free() end
end

local function make_norm(fname, kind, d, eps, bias)
  if kind == "layernorm" then return L.LayerNorm(d, { eps = eps or 1e-5, bias = bias ~= false }) end
  if kind == "rmsnorm" then return L.RMSNorm(d, { eps = eps or 1e-6 }) end
  error(string.format("%s: norm must be 'layernorm' or 'rmsnorm', got %s", fname, tostring(kind)), 3)
end

-- ---------------------------------------------------- CausalSelfAttention

-- nn.CausalSelfAttention{d_model=, n_heads=, pos="rope"|"learned"|"none",
-- rope_base=10000, dropout=0, bias=false, std=0.02, out_std=std, dtype=,
-- device=}. forward(x (B, S, d)) -> (B, S, d). "learned" positions are added
-- by the model to the token embeddings, so the layer itself applies none.
local Attention = class("CausalSelfAttention", Module)
M.CausalSelfAttention = Attention

function Attention:init(o)
  o = check_opts("nn.CausalSelfAttention", o,
    { "d_model", "n_heads", "pos", "rope_base", "dropout", "bias", "std", "out_std", "dtype", "device" })
  check_pos_int("nn.CausalSelfAttention", "d_model", o.d_model)
  check_pos_int("nn.CausalSelfAttention", "n_heads", o.n_heads)
  if o.d_model % o.n_heads ~= 0 then
    error(string.format("nn.CausalSelfAttention: d_model (%d) must be divisible by n_heads (%d)", o.d_model,
      o.n_heads), 2)
  end
  local pos = o.pos or "rope"
  if pos ~= "rope" and pos ~= "learned" and pos ~= "none" then
    error("nn.CausalSelfAttention: pos must be 'rope', 'learned' or 'none', got " .. tostring(pos), 2)
  end
  self.d_model, self.n_heads, self.head_dim = o.d_model, o.n_heads, o.d_model // o.n_heads
  if pos == "rope" and self.head_dim % 2 ~= 0 then
    error("nn.CausalSelfAttention: rope needs an even head dim, got " .. self.head_dim, 2)
  end
  self.pos, self.rope_base = pos, o.rope_base or 10000
  local std = o.std or 0.02
  local lo = { bias = o.bias or false, std = std, dtype = o.dtype, device = o.device }
  self:child("qkv", L.Linear(o.d_model, 3 * o.d_model, lo))
  lo.std = o.out_std or std
  self:child("proj", L.Linear(o.d_model, o.d_model, lo))
  self:child("drop", L.Dropout(o.dropout or 0))
  self._rope = nil -- {S, dtype, device, cos, sin}
end

-- cos, sin (S, head_dim / 2) for x's dtype and device, cached (views of the cached
-- tables when they are longer). A table
-- that must grow is built for max(S, cap) rows (decoding asks for twice its length,
-- so it is not rebuilt at every token).
function Attention:rope_tables(S, dtype, device, cap)
  local c = self._rope
  if c and c.S >= S and c.dtype == dtype and c.device == device then
    if c.S == S then return c.cos, c.sin end
    return c.cos:narrow(0, 0, S), c.sin:narrow(0, 0, S)
  end
  if c then drop(c.cos); drop(c.sin) end
  local n = math.max(S, cap or 0)
  local cos, sin = keep(moe.rope_cache(n, self.head_dim, self.rope_base, { dtype = dtype, device = device }))
  self._rope = { S = n, dtype = dtype, device = device, cos = cos, sin = sin }
  if n == S then return cos, sin end
  return cos:narrow(0, 0, S), sin:narrow(0, 0, S)
end

-- The fused CUDA attention kernels take bf16 with head dim 64 or 128 (core/attention.c); the
-- CPU kernel takes every float dtype. Elsewhere attention_math composes the same computation.
local function fused_attention_ok(q)
  if q.device:sub(1, 3) == "cpu" then return true end
  local D = q:size(3)
  return q.dtype == "bf16" and (D == 64 or D == 128)
end

-- (S, P+S) additive causal mask for S queries at positions P .. P+S-1 (0 where query i
-- may see key j, i.e. j <= P + i; -inf after) in dtype on device, cached (P = 0: the
-- square mask of a full sequence).
function Attention:causal_mask(S, dtype, device, P)
  P = P or 0
  local c = self._mask
  if c and c.S == S and c.P == P and c.dtype == dtype and c.device == device then return c.mask end
  -- from tensor ops on the device (a Lua table of S (P+S) numbers cost ~5 ms a layer at S 300)
  local qpos = moe.arange(P, P + S, { dtype = "i64", device = device }):view({ S, 1 })
  local kpos = moe.arange(0, P + S, { dtype = "i64", device = device }):view({ 1, P + S })
  local allowed = moe.le(kpos, qpos) -- (S, P+S): key j <= position of query i
  local m = keep(moe.zeros({ S, P + S }, { dtype = dtype, device = device }):where(allowed, -math.huge))
  if c then drop(c.mask) end
  self._mask = { S = S, P = P, dtype = dtype, device = device, mask = m }
  return m
end

-- Causal attention from matmul, softmax and an additive mask: q (B, H, S, D) at
-- positions P .. P+S-1 (P = 0 unless decoding with a KV cache), k, v (B, H, P+S, D)
-- -> (B, H, S, D); query i sees keys 0 .. P+i. Used where the fused kernel does not
-- apply (CUDA with f32, a head dim other than 64 / 128, or queries after a cache).
function Attention:attention_math(q, k, v, P)
  P = P or 0
  local S, D = q:size(2), q:size(3)
  local s = moe.matmul(q, k:transpose(2, 3)) * (1 / math.sqrt(D)) -- (B, H, S, P+S)
  if S > 1 then -- one query sees every key: no mask
    s = s + self:causal_mask(S, q.dtype, q.device, P)
  end
  return moe.matmul(moe.softmax(s, -1), v)
end

-- Appends kt, vt (B, H, S, D) after the cache's P positions and returns the
-- cache's keys and values (B, H, P+S, D), also left in cache.k, cache.v.
-- Without gradients (moe.no_grad, or inputs that need none) they are views of
-- buffers that grow by doubling (cache.kbuf, cache.vbuf), so a decoding step
-- copies only its own S positions; where autograd records (keys that need
-- gradients) they are a differentiable moe.cat of the old ones and the new.
-- buf[:, :, pos .. pos + n) = src (B, H, n, D)
local function put(buf, pos, src)
  buf:narrow(2, pos, src:size(2)):copy_(src)
end

local function cache_append(cache, kt, vt, P)
  local B, H, S, D = kt:size(0), kt:size(1), kt:size(2), kt:size(3)
  if cache.k and (cache.k:size(0) ~= B or cache.k:size(1) ~= H or cache.k:size(3) ~= D) then
    error(string.format("CausalSelfAttention: the KV cache holds keys of shape (%s), " ..
      "the new ones are (%s); use one cache per batch", table.concat(cache.k.shape, ", "),
      table.concat(kt.shape, ", ")), 3)
  end
  local kc, vc
  if moe.is_grad_enabled() and (kt.requires_grad or vt.requires_grad) then
    if cache.k then
      kc, vc = moe.cat({ cache.k, kt }, 2), moe.cat({ cache.v, vt }, 2)
    else
      kc, vc = kt:contiguous(), vt:contiguous()
    end
    -- the buffers, if any, no longer back cache.k: the next step without
    -- gradients starts new ones from these
    drop(cache.kbuf); drop(cache.vbuf)
    cache.kbuf, cache.vbuf = nil, nil
  else
    local need = P + S
    if not cache.kbuf or cache.kbuf:size(2) < need then
      local cap, opts = math.max(2 * need, 16), { dtype = kt.dtype, device = kt.device }
      local kb, vb = keep(moe.empty({ B, H, cap, D }, opts), moe.empty({ B, H, cap, D }, opts))
      if P > 0 then put(kb, 0, cache.k); put(vb, 0, cache.v) end
      drop(cache.kbuf); drop(cache.vbuf)
      cache.kbuf, cache.vbuf = kb, vb
    end
    put(cache.kbuf, P, kt); put(cache.vbuf, P, vt)
    kc, vc = cache.kbuf:narrow(2, 0, need), cache.vbuf:narrow(2, 0, need)
  end
  drop(cache.k); drop(cache.v)
  cache.k, cache.v = keep(kc, vc)
  return kc, vc
end

-- forward(x (B, S, d) [, cache]) -> (B, S, d). With a cache (a table, from
-- TransformerLM:new_cache: cache.pos tokens already seen), x holds the next S
-- tokens: their keys and values are appended to cache.k, cache.v (B, H, pos+S, D)
-- and their queries attend to every cached key before them.
function Attention:forward(x, cache)
  if x:dim() ~= 3 or x:size(2) ~= self.d_model then
    error(string.format("CausalSelfAttention: x must be (B, S, %d), got (%s)", self.d_model,
      table.concat(x.shape, ", ")), 2)
  end
  local B, S = x:size(0), x:size(1)
  local H, D = self.n_heads, self.head_dim
  local P = cache and cache.pos or 0
  local qkv = self.qkv(x):view({ B, S, 3, H, D }) -- (B, S, 3 d)
  local q, k, v = qkv:select(2, 0), qkv:select(2, 1), qkv:select(2, 2) -- (B, S, H, D)
  if self.pos == "rope" then
    local cos, sin = self:rope_tables(P + S, x.dtype, x.device, cache and 2 * (P + S) or nil)
    if P > 0 then cos, sin = cos:narrow(0, P, S), sin:narrow(0, P, S) end -- rows P .. P+S-1
    q, k = moe.rope(q, cos, sin, "bthd"), moe.rope(k, cos, sin, "bthd")
  end
  local qt, kt, vt = q:transpose(1, 2), k:transpose(1, 2), v:transpose(1, 2) -- (B, H, S, D)
  if cache then kt, vt = cache_append(cache, kt, vt, P) end
  local o -- (B, H, S, D)
  if P > 0 or self.math_attention or not fused_attention_ok(qt) then
    o = self:attention_math(qt, kt, vt, P)
  else
    o = moe.scaled_dot_product_attention(qt, kt, vt, { causal = true })
  end
  return self.drop(self.proj(o:transpose(1, 2):reshape({ B, S, self.d_model })))
end

function Attention:extra_repr()
  return string.format("d_model=%d, n_heads=%d, pos=%s", self.d_model, self.n_heads, self.pos)
end

-- ----------------------------------------------------- TransformerBlock

-- nn.TransformerBlock{d_model=, n_heads=, norm="layernorm"|"rmsnorm",
-- norm_eps=, ffn=<module> (default nn.MLP{d_model, 4 d_model}), d_ff=,
-- activation=, pos=, rope_base=, dropout=0, bias=false, std=, out_std=}.
-- Pre-norm: x + drop(attn(ln1(x))), then x + drop(ffn(ln2(x))).
local Block = class("TransformerBlock", Module)
M.TransformerBlock = Block

function Block:init(o)
  o = check_opts("nn.TransformerBlock", o, { "d_model", "n_heads", "norm", "norm_eps", "ffn", "d_ff",
    "activation", "pos", "rope_base", "dropout", "bias", "std", "out_std", "dtype", "device" })
  check_pos_int("nn.TransformerBlock", "d_model", o.d_model)
  local norm = o.norm or "layernorm"
  self:child("ln1", make_norm("nn.TransformerBlock", norm, o.d_model, o.norm_eps, o.bias))
  self:child("attn", Attention({ d_model = o.d_model, n_heads = o.n_heads, pos = o.pos, rope_base = o.rope_base,
    dropout = o.dropout, bias = o.bias, std = o.std, out_std = o.out_std }))
  self:child("ln2", make_norm("nn.TransformerBlock", norm, o.d_model, o.norm_eps, o.bias))
  local ffn = o.ffn
  if ffn == nil then
    ffn = L.MLP({ d_model = o.d_model, d_ff = o.d_ff or 4 * o.d_model, activation = o.activation or "gelu",
      bias = o.bias, std = o.std, out_std = o.out_std })
  end
  self:child("ffn", ffn)
  self:child("drop", L.Dropout(o.dropout or 0))
  if o.dtype or o.device then self:to(o.device, o.dtype) end
end

function Block:forward(x, cache)
  x = x + self.attn(self.ln1(x), cache)
  return x + self.drop(self.ffn(self.ln2(x)))
end

-- ------------------------------------------------------ TransformerLM

local lm_keys = { "vocab_size", "d_model", "n_layers", "n_heads", "seq_len", "pos", "rope_base",
  "tie_embeddings", "dropout", "norm", "norm_eps", "init_std", "ffn", "d_ff", "activation", "bias", "dtype",
  "device" }

-- Names (relative to a block) of output projections, scaled by
-- 1 / sqrt(2 n_layers) at initialisation.
local function is_output_projection(name)
  return name == "attn.proj.weight" or name:match("^ffn%..*fc2%.weight$") ~= nil
      or name:match("^ffn%..*w2%.weight$") ~= nil or name:match("^ffn%..*%.w2$") ~= nil
      or name == "ffn.w2"
end
M.is_output_projection = is_output_projection

-- nn.TransformerLM{vocab_size=, d_model=, n_layers=, n_heads=, seq_len=,
-- pos="rope", rope_base=10000, tie_embeddings=true, dropout=0,
-- norm="layernorm", norm_eps=, init_std=0.02, ffn=function(i) -> module,
-- d_ff=4 d_model, activation="gelu", bias=false, dtype="f32", device="cpu"}
local LM = class("TransformerLM", Module)
M.TransformerLM = LM

function LM:init(o)
  o = check_opts("nn.TransformerLM", o, lm_keys)
  for _, k in ipairs({ "vocab_size", "d_model", "n_layers", "n_heads", "seq_len" }) do
    check_pos_int("nn.TransformerLM", k, o[k])
  end
  if o.ffn ~= nil and type(o.ffn) ~= "function" then
    error("nn.TransformerLM: ffn must be a function(i) returning a module, got " .. type(o.ffn), 2)
  end
  local pos = o.pos or "rope"
  local std = o.init_std or 0.02
  local out_scale = 1 / math.sqrt(2 * o.n_layers)
  self.cfg = {
    vocab_size = o.vocab_size, d_model = o.d_model, n_layers = o.n_layers, n_heads = o.n_heads,
    seq_len = o.seq_len, pos = pos, tie_embeddings = o.tie_embeddings ~= false, init_std = std,
    norm = o.norm or "layernorm",
  }
  self:child("wte", L.Embedding(o.vocab_size, o.d_model, { std = std }))
  if pos == "learned" then self:child("wpe", L.Embedding(o.seq_len, o.d_model, { std = std })) end
  self:child("drop", L.Dropout(o.dropout or 0))
  local blocks = self:child("blocks", L.ModuleList())
  for i = 0, o.n_layers - 1 do
    local ffn
    if o.ffn then
      ffn = o.ffn(i)
      if type(ffn) ~= "table" or type(ffn._params) ~= "table" then
        error(string.format("nn.TransformerLM: ffn(%d) must return an nn.Module, got %s", i, type(ffn)), 2)
      end
    end
    local blk = Block({ d_model = o.d_model, n_heads = o.n_heads, norm = o.norm, norm_eps = o.norm_eps, ffn = ffn,
      d_ff = o.d_ff, activation = o.activation, pos = pos == "learned" and "none" or pos, rope_base = o.rope_base,
      dropout = o.dropout, bias = o.bias, std = std })
    -- output projections: std / sqrt(2 n_layers)
    moe.no_grad(function()
      for _, nt in ipairs(blk:named_parameters()) do
        if is_output_projection(nt[1]) then nt[2]:copy_(nt[2] * out_scale) end
      end
    end)
    blocks:append(blk)
  end
  self:child("ln_f", make_norm("nn.TransformerLM", self.cfg.norm, o.d_model, o.norm_eps, o.bias))
  if not self.cfg.tie_embeddings then
    self:child("lm_head", L.Linear(o.d_model, o.vocab_size, { bias = false, std = std }))
  end
  if o.dtype or o.device then self:to(o.device, o.dtype) end
end

-- A key/value cache for incremental decoding (forward(idx, cache)): the keys
-- and values of every layer for the cache.pos tokens seen so far. cache:free()
-- releases them at once (device memory does not wait for the collector).
local Cache = {}
Cache.__index = Cache
function Cache:free()
  for _, c in pairs(self.layers) do
    for _, name in ipairs({ "k", "v", "kbuf", "vbuf" }) do
      if c[name] then c[name]:free() end
      c[name] = nil
    end
  end
  self.pos = 0
end

function LM.new_cache()
  return setmetatable({ pos = 0, layers = {} }, Cache)
end

-- forward(idx (B, S) i64 [, cache]) -> logits (B, S, V). With a cache
-- (new_cache()), idx holds the next S tokens after the cache.pos already seen
-- (positions cache.pos .. cache.pos+S-1); their keys and values join the cache.
function LM:forward(idx, cache)
  if not moe.is_tensor(idx) or idx:dim() ~= 2 then
    error("TransformerLM:forward: idx must be a (B, S) integer tensor", 2)
  end
  if cache ~= nil and getmetatable(cache) ~= Cache then
    error("TransformerLM:forward: cache must come from new_cache(), got " .. type(cache), 2)
  end
  local S = idx:size(1)
  local P = cache and cache.pos or 0
  if P + S > self.cfg.seq_len and self.cfg.pos == "learned" then
    error(string.format("TransformerLM:forward: sequence length %d exceeds seq_len %d", P + S,
      self.cfg.seq_len), 2)
  end
  local dev = self.wte.weight.device
  local x = self.wte(idx.device ~= dev and idx:to(dev) or idx)
  if self.wpe then x = x + self.wpe(moe.arange(P, P + S, { dtype = "i64", device = dev })) end
  x = self.drop(x)
  for i = 0, self.blocks.n - 1 do
    local lc
    if cache then
      lc = cache.layers[i + 1] or {}
      cache.layers[i + 1], lc.pos = lc, P
    end
    x = self.blocks:at(i)(x, lc)
  end
  if cache then cache.pos = P + S end
  x = self.ln_f(x)
  if self.lm_head then return self.lm_head(x) end
  return moe.linear(x, self.wte.weight)
end

-- lm:loss(idx (B, S), targets (B, S) [, {lazy = true}]) -> loss (scalar tensor:
-- mean cross entropy + the aux losses of the layers), {lm_loss=, aux_loss=, stats=}.
-- The cross entropy is computed in f32 whatever the model's dtype. lazy: lm_loss
-- and aux_loss are the scalar tensors (aux_loss nil without aux losses), not
-- numbers read from the device (moe.train reads them once per step).
function LM:loss(idx, targets, opts)
  local logits = self:forward(idx)
  if logits.dtype ~= "f32" and logits.dtype ~= "f64" then logits = logits:float() end
  local tg = targets.device ~= logits.device and targets:to(logits.device) or targets
  local lm = moe.cross_entropy(logits:reshape({ -1, self.cfg.vocab_size }), tg:reshape({ -1 }))
  local aux = self:pop_aux_loss()
  local total = lm
  if aux ~= nil then
    if aux.dtype ~= lm.dtype then aux = aux:to(lm.dtype) end
    total = lm + aux
  end
  if opts and opts.lazy then return total, { lm_loss = lm, aux_loss = aux, stats = self:collect_stats() } end
  return total, { lm_loss = lm:item(), aux_loss = aux and aux:item() or 0, stats = self:collect_stats() }
end

-- Parameters used per token: every parameter except the embedding tables,
-- plus the output projection (V d, tied or not); a feed-forward module that
-- defines num_active_parameters() (a MoE layer: the router and top_k of
-- num_experts experts) counts that instead of all its parameters.
function LM:num_active_parameters()
  local c = self.cfg
  local n = c.vocab_size * c.d_model -- output projection
  if self.lm_head then n = 0 end
  for _, m in ipairs({ self.ln_f, self.lm_head }) do n = n + m:num_parameters() end
  for i = 0, self.blocks.n - 1 do
    local blk = self.blocks:at(i)
    for _, cname in ipairs(blk._children) do
      local ch = blk[cname]
      if cname == "ffn" and ch.num_active_parameters then
        n = n + ch:num_active_parameters()
      else
        n = n + ch:num_parameters()
      end
    end
  end
  return n
end

-- Model FLOPs per token, forward + backward: 6 N_active + 12 n_layers d S
-- (PaLM appendix B: the attention score and value matmuls, not halved for
-- the causal mask), the convention of Megatron's and nanoGPT's MFU.
function LM:flops_per_token()
  local c = self.cfg
  return 6 * self:num_active_parameters() + 12 * c.n_layers * c.d_model * c.seq_len
end

function LM:extra_repr()
  local c = self.cfg
  return string.format("vocab_size=%d, d_model=%d, n_layers=%d, n_heads=%d, seq_len=%d, pos=%s, tied=%s",
    c.vocab_size, c.d_model, c.n_layers, c.n_heads, c.seq_len, c.pos, tostring(c.tie_embeddings))
end

return M
