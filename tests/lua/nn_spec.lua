--[[
tests/lua/nn_spec.lua - moe.nn (lua/moe/nn/*.lua): classes and the module
base (names, counts, state dicts through moe.save/moe.load, load errors,
train/eval, to(dtype), printout, aux losses and stats), the layers against
hand-written formulas, CausalSelfAttention against a naive softmax(Q K^T)
V with a causal mask, gradients of a tiny LM by finite differences in f64,
and a tiny TransformerLM learning a batch by 20 hand-written SGD steps.

Run: moe-lua tests/lua/busted.lua tests/lua/nn_spec.lua (ctest does).
]]
local moe = require "moe"
local nn = require "moe.nn"

local gpu = moe.cuda.is_available()

local function flat(t, out)
  out = out or {}
  if type(t) ~= "table" then out[#out + 1] = t; return out end
  for i = 1, #t do flat(t[i], out) end
  return out
end

local function max_diff(a, b)
  local x, y, m = flat(a:totable()), flat(b:totable()), 0
  assert(#x == #y, "sizes differ: " .. #x .. " vs " .. #y)
  for i = 1, #x do m = math.max(m, math.abs(x[i] - y[i])) end
  return m
end

local function names(m)
  local out = {}
  for i, nt in ipairs(m:named_parameters()) do out[i] = nt[1] end
  return out
end

local function tiny_lm(o)
  local cfg = { vocab_size = 11, d_model = 8, n_layers = 2, n_heads = 2, seq_len = 6 }
  for k, v in pairs(o or {}) do cfg[k] = v end
  return nn.TransformerLM(cfg)
end

describe("nn.class and nn.Module", function()
  it("makes classes, calls init and forward, inherits methods", function()
    local Affine = nn.class("Affine", nn.Module)
    function Affine:init(d, s)
      self:param("scale", moe.full({ d }, s, { dtype = "f32" }))
      self:buffer("shift", moe.ones({ d }))
    end
    function Affine:forward(x) return x * self.scale + self.shift end
    local Twice = nn.class("Twice", Affine)
    function Twice:forward(x) return Affine.forward(self, x) * 2 end
    local m = Twice(3, 2)
    assert.are.equal("Twice", m.__name)
    assert.is_true(m.scale.requires_grad)
    assert.is_false(m.shift.requires_grad)
    assert.are.same({ 6, 6, 6 }, m(moe.ones({ 3 })):totable())
    assert.are.same({ "scale" }, names(m))
    assert.are.equal("shift", m:named_buffers()[1][1])
    assert.are.equal("scale", m:named_parameters()[1].name)
    assert.are.equal(m.scale, m:named_parameters()[1].tensor)
    assert.are.equal(3, m:num_parameters())
    assert.error_matches(function() nn.Module():forward() end, "Module: forward is not defined")
    assert.error_matches(function() m:param("a.b", moe.ones({ 1 })) end, "name must be a non%-empty string")
    assert.error_matches(function() m:param("w", 3) end, "'w' must be a tensor")
    assert.error_matches(function() m:child("c", {}) end, "'c' must be an nn.Module")
  end)

  it("names parameters depth first like PyTorch and counts them", function()
    local lm = tiny_lm()
    local n = names(lm)
    assert.are.equal("wte.weight", n[1])
    assert.are.same({ "blocks.0.ln1.weight", "blocks.0.ln1.bias", "blocks.0.attn.qkv.weight",
      "blocks.0.attn.proj.weight", "blocks.0.ln2.weight", "blocks.0.ln2.bias", "blocks.0.ffn.fc1.weight",
      "blocks.0.ffn.fc2.weight" }, { table.unpack(n, 2, 9) })
    assert.are.equal("ln_f.bias", n[#n])
    assert.are.equal(19, #n)
    -- wte 11*8; per block ln1 16 + qkv 8*24 + proj 8*8 + ln2 16 + fc1 8*32 + fc2 32*8; ln_f 16
    local block = 16 + 192 + 64 + 16 + 256 + 256
    assert.are.equal(88 + 2 * block + 16, lm:num_parameters())
    assert.are.equal(#n, #lm:parameters())
    -- untied: lm_head (V, d); learned positions: wpe (seq_len, d)
    local u = tiny_lm({ tie_embeddings = false, pos = "learned" })
    assert.are.equal(88 + 2 * block + 16 + 88 + 48, u:num_parameters())
    assert.are.equal("wpe.weight", names(u)[2])
    assert.are.equal("lm_head.weight", names(u)[#names(u)])
    -- modules: self first, then depth first
    local mods = lm:modules()
    assert.are.equal(lm, mods[1])
    assert.are.equal(lm.wte, mods[2])
    local nm = lm:named_modules()
    assert.are.equal("", nm[1][1])
    assert.are.equal("blocks.1.attn.qkv", nm[#nm - 8][1])
    assert.are.equal(lm.blocks:at(1).attn.qkv, nm[#nm - 8][2])
  end)

  it("ModuleList names its children 0, 1, ...", function()
    local ml = nn.ModuleList({ nn.Linear(2, 3), nn.Linear(3, 4, { bias = false }) })
    assert.are.equal(2, #ml)
    assert.are.same({ "0.weight", "0.bias", "1.weight" }, names(ml))
    assert.are.equal(ml["1"], ml:at(1))
    assert.are.equal(2, #ml:list())
  end)

  it("round-trips the state dict through safetensors and loads it into a fresh model", function()
    moe.manual_seed(5)
    local a = tiny_lm({ tie_embeddings = false })
    local path = os.tmpname()
    moe.save(path, a:state_dict())
    moe.manual_seed(6)
    local b = tiny_lm({ tie_embeddings = false })
    local idx = moe.randint(0, 11, { 2, 6 })
    assert.is_true(max_diff(a(idx), b(idx)) > 1e-3)
    local sd = moe.load(path)
    os.remove(path)
    assert.truthy(sd["blocks.1.attn.qkv.weight"])
    local res = b:load_state_dict(sd)
    assert.are.same({}, res.missing)
    assert.are.equal(0, max_diff(a(idx), b(idx)))
    assert.is_true(b.wte.weight.requires_grad)
  end)

  it("names missing, unexpected and mis-shaped keys when loading", function()
    local m = tiny_lm()
    local sd = {}
    for k, v in pairs(m:state_dict()) do sd[k] = v:clone() end
    sd["ln_f.bias"] = nil
    sd["extra.weight"] = moe.zeros({ 2 })
    assert.error_matches(function() m:load_state_dict(sd) end,
      "missing keys: ln_f.bias; unexpected keys: extra.weight")
    local res = m:load_state_dict(sd, { strict = false })
    assert.are.same({ "ln_f.bias" }, res.missing)
    assert.are.same({ "extra.weight" }, res.unexpected)
    sd["extra.weight"] = nil
    sd["ln_f.bias"] = moe.zeros({ 8 })
    sd["wte.weight"] = moe.zeros({ 11, 9 })
    assert.error_matches(function() m:load_state_dict(sd, { strict = false }) end,
      "mis%-shaped keys: wte.weight %(expected %(11, 8%), got %(11, 9%)%)")
    assert.is_true(max_diff(m.wte.weight, moe.zeros({ 11, 8 })) > 0) -- nothing was copied
    assert.error_matches(function() m:load_state_dict(3) end, "state dict must be a table")
  end)

  it("switches dropout with train and eval", function()
    moe.manual_seed(7)
    local d = nn.Dropout(0.5)
    local x = moe.ones({ 200 })
    local zeros = 0
    for _, v in ipairs(d(x):totable()) do
      if v == 0 then zeros = zeros + 1 else assert.are.equal(2, v) end
    end
    assert.is_true(zeros > 50 and zeros < 150)
    local lm = tiny_lm({ dropout = 0.5 })
    lm:eval()
    for _, m in ipairs(lm:modules()) do assert.is_false(m.training) end
    assert.are.same(d:eval()(x):totable(), x:totable())
    local idx = moe.randint(0, 11, { 2, 6 })
    assert.are.equal(0, max_diff(lm(idx), lm(idx)))
    lm:train()
    assert.is_true(lm.blocks:at(1).attn.drop.training)
    assert.is_true(max_diff(lm(idx), lm(idx)) > 0)
    assert.error_matches(function() nn.Dropout(2) end, "p must be a number in %[0, 1%]")
  end)

  it("casts with to(nil, dtype), keeping tied weights tied and parameters trainable", function()
    moe.manual_seed(8)
    local lm = tiny_lm()
    local idx = moe.randint(0, 11, { 2, 6 })
    local ref = lm(idx)
    lm:to(nil, "f64")
    for _, p in ipairs(lm:parameters()) do
      assert.are.equal("f64", p.dtype)
      assert.is_true(p.requires_grad and p.is_leaf)
    end
    local out = lm(idx)
    assert.are.equal("f64", out.dtype)
    assert.is_true(max_diff(out, ref) < 1e-5)
    local sd64 = {}
    for k, v in pairs(lm:state_dict()) do sd64[k] = v:clone() end
    lm:to("bf16")
    assert.are.equal("bf16", lm.wte.weight.dtype)
    lm:load_state_dict(sd64) -- values converted to the module's dtype
    assert.are.equal("bf16", lm.wte.weight.dtype)
    assert.is_true(max_diff(lm.wte.weight:double(), sd64["wte.weight"]) < 0.01)
    local loss = lm:loss(idx, idx)
    assert.are.equal("f32", loss.dtype) -- cross entropy in f32 for bf16 models
    assert.error_matches(function() lm:to(nil, "i64") end, "dtype must be a floating dtype")
    local t = tiny_lm({ dtype = "f64" })
    assert.are.equal("f64", t.blocks:at(0).attn.qkv.weight.dtype)
  end)

  it("prints the tree with shapes and parameter counts", function()
    local s = tostring(tiny_lm())
    assert.matches("^TransformerLM%(vocab_size=11, d_model=8, n_layers=2", s)
    assert.matches("# 1,704 params", s, 1, true)
    assert.matches("(wte): Embedding(11, 8)  # 88 params", s, 1, true)
    assert.matches("      (qkv): Linear(8, 24, bias=false)  # 192 params", s, 1, true)
    assert.matches("(ln_f): LayerNorm(8, eps=1e-05)  # 16 params", s, 1, true)
  end)

  it("sums and clears aux losses and collects stats", function()
    local Aux = nn.class("Aux", nn.Module)
    function Aux:forward(x)
      self.aux_loss = moe.sum(x) * 0.5
      self.stats = { expert_counts = moe.tensor({ 1, 2 }, { dtype = "i64" }) }
      return x
    end
    local root = nn.Module()
    root:child("a", Aux())
    root:child("b", nn.ModuleList({ nn.Linear(1, 1), Aux() }))
    assert.is_nil(root:pop_aux_loss())
    local x = moe.ones({ 4 })
    root.a(x)
    root.b:at(1)(x)
    local st = root:collect_stats()
    assert.are.equal(2, #st)
    assert.are.equal("a", st[1].name)
    assert.are.equal("b.1", st[2].name)
    assert.are.same({ 1, 2 }, st[2].stats.expert_counts:totable())
    assert.are.equal(4, root:pop_aux_loss():item())
    assert.is_nil(root:pop_aux_loss())
    -- a loss handed up to the parent without clearing the child counts once
    root.a(x)
    root.aux_loss = root.a.aux_loss
    assert.are.equal(2, root:pop_aux_loss():item())
    assert.is_nil(rawget(root.a, "aux_loss"))
  end)
end)

describe("nn layers", function()
  it("Linear, Embedding, LayerNorm, RMSNorm, MLP and GLU follow their formulas", function()
    moe.manual_seed(9)
    local x = moe.randn({ 2, 3, 4 }, { dtype = "f64" })
    local lin = nn.Linear(4, 5, { dtype = "f64" })
    assert.are.same({ 5, 4 }, lin.weight.shape)
    assert.are.same(moe.zeros({ 5 }):totable(), lin.bias:totable())
    lin.bias = moe.randn({ 5 }, { dtype = "f64" })
    assert.is_true(max_diff(lin(x), moe.matmul(x, lin.weight:transpose(0, 1)) + lin.bias) < 1e-12)
    local big = nn.Linear(1000, 1000, { bias = false })
    local std = math.sqrt(moe.var(big.weight):item())
    assert.is_true(math.abs(std - 0.02) < 0.001, "std " .. std)
    local emb = nn.Embedding(7, 4, { dtype = "f64" })
    local ids = moe.tensor({ { 6, 0 } }, { dtype = "i64" })
    assert.are.same({ emb.weight:totable()[7], emb.weight:totable()[1] }, emb(ids):totable()[1])
    local ln = nn.LayerNorm(4, { dtype = "f64" })
    local mu = moe.mean(x, -1, true)
    local var = moe.var(x, -1, 0, true)
    assert.is_true(max_diff(ln(x), (x - mu) / moe.sqrt(var + 1e-5)) < 1e-12)
    local rms = nn.RMSNorm(4, { dtype = "f64" })
    assert.is_true(max_diff(rms(x), x / moe.sqrt(moe.mean(x * x, -1, true) + 1e-6)) < 1e-12)
    local mlp = nn.MLP({ d_model = 4, d_ff = 6, dtype = "f64" })
    assert.is_true(max_diff(mlp(x), mlp.fc2(moe.gelu(mlp.fc1(x)))) < 1e-12)
    local glu = nn.GLU({ d_model = 4, d_ff = 6, dtype = "f64" })
    assert.is_true(max_diff(glu(x), glu.w2(moe.silu(glu.w1(x)) * glu.w3(x))) < 1e-12)
    local g2 = nn.GLU({ d_model = 4, d_ff = 6, activation = "gelu", dtype = "f64" })
    assert.is_true(max_diff(g2(x), g2.w2(moe.gelu(g2.w1(x)) * g2.w3(x))) < 1e-12)
  end)

  it("rejects bad options naming them", function()
    assert.error_matches(function() nn.Linear(0, 3) end, "nn.Linear: in_features must be a positive integer")
    assert.error_matches(function() nn.Linear(2, 3, { bais = true }) end,
      "nn.Linear: unknown option 'bais' %(valid: bias, device, dtype, std%)")
    assert.error_matches(function() nn.MLP({ d_model = 4, d_ff = 8, activation = "swish" }) end,
      "nn.MLP: unknown activation 'swish'")
    assert.error_matches(function() nn.CausalSelfAttention({ d_model = 6, n_heads = 4 }) end,
      "d_model %(6%) must be divisible by n_heads %(4%)")
    assert.error_matches(function() tiny_lm({ layers = 3 }) end, "nn.TransformerLM: unknown option 'layers'")
    assert.error_matches(function() tiny_lm({ ffn = function() return 3 end }) end,
      "ffn%(0%) must return an nn.Module")
    assert.error_matches(function() tiny_lm({ norm = "batchnorm" }) end, "norm must be 'layernorm' or 'rmsnorm'")
    local a = nn.CausalSelfAttention({ d_model = 8, n_heads = 2 })
    assert.error_matches(function() a(moe.randn({ 2, 3, 5 })) end, "x must be %(B, S, 8%), got %(2, 3, 5%)")
  end)
end)

-- naive causal attention of q, k, v (B, H, S, D) with plain tensor ops
local function naive_attention(q, k, v)
  local S, D = q:size(2), q:size(3)
  local s = moe.matmul(q, k:transpose(2, 3)) * (1 / math.sqrt(D))
  local i = moe.arange(S):reshape({ S, 1 })
  local j = moe.arange(S):reshape({ 1, S })
  s = moe.where(moe.gt(j, i), -math.huge, s)
  return moe.matmul(moe.softmax(s, -1), v)
end

describe("nn.CausalSelfAttention", function()
  for _, pos in ipairs({ "none", "rope" }) do
    it("matches a naive softmax(Q K^T / sqrt(D) + causal mask) V (pos = " .. pos .. ")", function()
      moe.manual_seed(10)
      local B, S, d, H = 2, 5, 12, 3
      local a = nn.CausalSelfAttention({ d_model = d, n_heads = H, pos = pos, bias = true, dtype = "f64" })
      a.qkv.bias = moe.randn({ 3 * d }, { dtype = "f64" })
      local x = moe.randn({ B, S, d }, { dtype = "f64" })
      local qkv = moe.matmul(x, a.qkv.weight:transpose(0, 1)) + a.qkv.bias
      local function head(i) -- (B, H, S, D)
        return qkv:narrow(2, i * d, d):reshape({ B, S, H, d // H }):permute({ 0, 2, 1, 3 })
      end
      local q, k, v = head(0), head(1), head(2)
      if pos == "rope" then
        local cos, sin = moe.rope_cache(S, d // H, 10000, { dtype = "f64" })
        q, k = moe.rope(q, cos, sin, "bhtd"), moe.rope(k, cos, sin, "bhtd")
      end
      local o = naive_attention(q, k, v):permute({ 0, 2, 1, 3 }):reshape({ B, S, d })
      local ref = moe.matmul(o, a.proj.weight:transpose(0, 1)) + a.proj.bias
      assert.is_true(max_diff(a(x), ref) < 1e-12)
      -- causal: changing the last position leaves the earlier outputs alone
      local x2 = x:clone()
      x2:narrow(1, S - 1, 1):fill_(3)
      assert.are.equal(0, max_diff(a(x):narrow(1, 0, S - 1), a(x2):narrow(1, 0, S - 1)))
    end)
  end
end)

describe("nn.TransformerLM", function()
  it("has the forward shapes, the scaled initialisation and the FLOPs", function()
    moe.manual_seed(11)
    local lm = nn.TransformerLM({ vocab_size = 50, d_model = 64, n_layers = 8, n_heads = 4, seq_len = 16,
      init_std = 0.05 })
    local logits = lm(moe.randint(0, 50, { 3, 7 }))
    assert.are.same({ 3, 7, 50 }, logits.shape)
    local function std(t) return math.sqrt(moe.var(t):item()) end
    assert.is_true(math.abs(std(lm.wte.weight) - 0.05) < 0.005)
    assert.is_true(math.abs(std(lm.blocks:at(0).attn.qkv.weight) - 0.05) < 0.005)
    local out = 0.05 / 4 -- 1 / sqrt(2 n_layers)
    assert.is_true(math.abs(std(lm.blocks:at(3).attn.proj.weight) - out) < 0.1 * out)
    assert.is_true(math.abs(std(lm.blocks:at(7).ffn.fc2.weight) - out) < 0.1 * out)
    assert.are.equal(1, moe.mean(lm.ln_f.weight):item())
    -- active = all but the embedding + the tied output projection (V d)
    assert.are.equal(lm:num_parameters(), lm:num_active_parameters())
    assert.are.equal(6 * lm:num_parameters() + 12 * 8 * 64 * 16, lm:flops_per_token())
  end)

  it("has finite-difference gradients in f64", function()
    moe.manual_seed(12)
    local lm = nn.TransformerLM({ vocab_size = 5, d_model = 4, n_layers = 1, n_heads = 2, seq_len = 3,
      init_std = 0.5, dtype = "f64", tie_embeddings = false, norm = "rmsnorm" })
    local idx = moe.randint(0, 5, { 2, 3 })
    local tgt = moe.randint(0, 5, { 2, 3 })
    local params = lm:parameters()
    local ok, msg = moe.gradcheck(function() return (lm:loss(idx, tgt)) end, params)
    assert(ok, msg)
    local l2 = nn.TransformerLM({ vocab_size = 5, d_model = 4, n_layers = 1, n_heads = 1, seq_len = 3,
      init_std = 0.5, dtype = "f64", pos = "learned" })
    ok, msg = moe.gradcheck(function() return (l2:loss(idx, tgt)) end, l2:parameters())
    assert(ok, msg)
  end)

  it("learns a tiny batch in 20 SGD steps", function()
    moe.manual_seed(13)
    local lm = nn.TransformerLM({ vocab_size = 16, d_model = 16, n_layers = 2, n_heads = 2, seq_len = 8,
      ffn = function() return nn.GLU({ d_model = 16, d_ff = 32 }) end })
    local idx = moe.randint(0, 16, { 4, 8 })
    local tgt = moe.randint(0, 16, { 4, 8 })
    local first, last
    for step = 1, 20 do
      local loss, info = lm:loss(idx, tgt)
      assert.are.equal(0, info.aux_loss)
      if step == 1 then first = info.lm_loss end
      last = info.lm_loss
      loss:backward()
      moe.no_grad(function()
        for _, p in ipairs(lm:parameters()) do p:copy_(p - p.grad * 0.5) end
      end)
      lm:zero_grad()
    end
    assert.is_nil(lm.wte.weight.grad)
    assert.is_true(math.abs(first - math.log(16)) < 0.1, "first loss " .. first)
    assert.is_true(last < first - 0.5, string.format("loss %g -> %g", first, last))
  end)

  it("decodes with a KV cache to the logits of the full forward", function()
    local layers = require "moe.layers"
    for _, o in ipairs({
      { pos = "rope" }, { pos = "learned" }, { pos = "rope", norm = "rmsnorm" },
      { pos = "rope", d_model = 16, n_heads = 2, ffn = function() -- a dropless MoE layer
        return layers.dMoE({ hidden_size = 16, ffn_hidden_size = 16, num_experts = 4, top_k = 2, init_std = 0.5 })
      end },
    }) do
      moe.manual_seed(21)
      o.init_std = 0.5 -- logits that move with every position and key
      local lm = tiny_lm(o)
      lm:eval()
      local ids = { 3, 1, 4, 1, 5, 9 }
      moe.no_grad(function()
        local full = lm:forward(moe.tensor({ ids }))
        local cache = lm:new_cache()
        -- the prompt, one token, then two at once (a chunk after the cache: masked)
        local a = lm:forward(moe.tensor({ { 3, 1, 4 } }), cache)
        local b = lm:forward(moe.tensor({ { 1 } }), cache)
        local c = lm:forward(moe.tensor({ { 5, 9 } }), cache)
        assert.are.equal(6, cache.pos)
        assert.are.equal(6, cache.layers[1].k:size(2)) -- (B, H, 6, D)
        local got = moe.cat({ a, b, c }, 1)
        local err = max_diff(got, full)
        assert.is_true(err < 1e-5, string.format("%s: cached logits differ by %g", o.pos, err))
        cache:free()
        assert.is_nil(cache.layers[1].k)
        assert.are.equal(0, cache.pos)
      end)
    end
    local lm = tiny_lm({ pos = "learned" })
    local cache = lm:new_cache()
    moe.no_grad(function()
      lm:forward(moe.tensor({ { 1, 2, 3, 4 } }), cache)
      assert.error_matches(function() lm:forward(moe.tensor({ { 1, 2, 3 } }), cache) end,
        "sequence length 7 exceeds seq_len 6")
      assert.error_matches(function() lm:forward(moe.tensor({ { 1 } }), {}) end,
        "cache must come from new_cache%(%), got table")
    end)
    cache:free()
  end)

  it("grows the KV cache's buffers past their first size and keeps gradients where autograd records", function()
    moe.manual_seed(24)
    local lm = tiny_lm({ seq_len = 8, init_std = 0.5 }) -- rope: positions past seq_len are fine
    lm:eval()
    local n, ids = 40, {}
    for i = 1, n do ids[i] = (i * 7) % 11 end
    local idx = moe.tensor({ ids }, { dtype = "i64" })
    moe.no_grad(function()
      local full = lm:forward(idx)
      local cache, outs = lm:new_cache(), {}
      for i = 0, n - 1 do outs[#outs + 1] = lm:forward(idx:narrow(1, i, 1), cache) end
      -- one position at a time: the buffers grew 16 -> 34 -> 70 positions
      assert.are.equal(70, cache.layers[1].kbuf:size(2))
      assert.are.equal(n, cache.layers[2].v:size(2))
      local err = max_diff(moe.cat(outs, 1), full)
      assert.is_true(err < 1e-5, "cached logits differ by " .. err)
      -- a cache is for one batch shape
      assert.error_matches(function() lm:forward(moe.tensor({ { 1 }, { 2 } }, { dtype = "i64" }), cache) end,
        "the KV cache holds keys of shape %(1, 2, 40, 4%), the new ones are %(2, 2, 1, 4%)")
      cache:free()
      assert.is_nil(cache.layers[1].kbuf)
    end)
    -- with gradients: the cached chunks give the full forward's gradients
    local function grads(f)
      lm:zero_grad()
      local loss = f()
      loss:backward()
      local g = lm.blocks:at(0).attn.qkv.weight.grad:clone()
      loss:free()
      return g
    end
    local short = idx:narrow(1, 0, 7)
    local g_full = grads(function() return moe.sum(lm:forward(short)) end)
    local cache = lm:new_cache()
    moe.no_grad(function() lm:forward(short:narrow(1, 0, 2), cache) end) -- buffers first
    local g_cached = grads(function()
      -- the first two positions came from the buffers without gradients; give them
      -- their own forward with gradients so that the sum covers all seven
      local c2 = lm:new_cache()
      local a = lm:forward(short:narrow(1, 0, 3), c2)
      local b = lm:forward(short:narrow(1, 3, 4), c2)
      c2:free()
      return moe.sum(a) + moe.sum(b)
    end)
    assert.is_true(max_diff(g_cached, g_full) < 1e-5, "gradients through the cache differ")
    -- the cache that began without gradients goes on with them
    local c = lm:forward(short:narrow(1, 2, 5), cache)
    assert.is_true(c.requires_grad)
    assert.is_nil(cache.layers[1].kbuf)
    assert.are.equal(7, cache.layers[1].k:size(2))
    c:free()
    cache:free()
  end)

  it("generates the same tokens with and without the KV cache", function()
    local sample = require "moe.sample"
    moe.manual_seed(22)
    local lm = tiny_lm({ d_model = 16, n_heads = 2, seq_len = 8, init_std = 0.5 }) -- no near-ties
    -- 3 + 12 tokens: past seq_len, where the cache gives way to the moving window
    local with = sample.generate(lm, { 1, 2, 3 }, { max_new_tokens = 12, temperature = 0 })
    local without = sample.generate(lm, { 1, 2, 3 }, { max_new_tokens = 12, temperature = 0, kv_cache = false })
    assert.are.equal(12, #with)
    assert.are.same(without, with)
    moe.manual_seed(5)
    local s1 = sample.generate(lm, { 4 }, { max_new_tokens = 6, top_k = 4 })
    moe.manual_seed(5)
    local s2 = sample.generate(lm, { 4 }, { max_new_tokens = 6, top_k = 4, kv_cache = false })
    assert.are.same(s2, s1)
    assert.is_true(lm.training) -- mode restored
    assert.error_matches(function() sample.generate(lm, { 1 }, { kv_cache = "yes" }) end,
      "opts.kv_cache must be a boolean, got string")
  end)
end)

if gpu then
  describe("nn on CUDA", function()
    it("moves a bf16 LM to the GPU and matches the CPU in loss and gradients", function()
      moe.manual_seed(14)
      -- head dim 64: the fused bf16 attention kernels
      local lm = nn.TransformerLM({ vocab_size = 64, d_model = 128, n_layers = 2, n_heads = 2, seq_len = 16,
        ffn = function() return nn.GLU({ d_model = 128, d_ff = 96 }) end, dtype = "bf16" })
      local idx, tgt = moe.randint(0, 64, { 3, 16 }), moe.randint(0, 64, { 3, 16 })
      local cpu_loss = lm:loss(idx, tgt)
      cpu_loss:backward()
      local g_cpu = lm.blocks:at(1).attn.qkv.weight.grad:float()
      lm:zero_grad()
      lm:to("cuda")
      for _, p in ipairs(lm:parameters()) do assert.matches("^cuda", p.device) end
      local loss, info = lm:loss(idx, tgt)
      assert.matches("^cuda", loss.device)
      -- bf16 activations on both sides, different summation orders: the
      -- losses (about log 64 = 4.16) agree to a few bf16 ulps of 4
      local close_enough = math.abs(info.lm_loss - cpu_loss:item())
      assert.is_true(close_enough < 0.03, "loss diff " .. close_enough)
      loss:backward()
      local g = lm.blocks:at(1).attn.qkv.weight.grad:float():cpu()
      -- gradients of bf16 weights: relative to their scale, a few percent
      local scale = moe.max(moe.abs(g_cpu)):item()
      assert.is_true(moe.max(moe.abs(g - g_cpu)):item() < 0.05 * scale)
    end)

    it("decodes with a KV cache on the GPU to the full forward's logits and tokens", function()
      local sample = require "moe.sample"
      for _, o in ipairs({
        -- f32: attention by matmul/softmax on both paths
        { dtype = "f32", d_model = 16, n_heads = 2, tol = 1e-4 },
        -- bf16, head dim 64: the full forward on the fused kernel, the cached one by matmul/softmax
        { dtype = "bf16", d_model = 128, n_heads = 2, tol = 0.05 },
      }) do
        moe.manual_seed(23)
        local lm = tiny_lm({ d_model = o.d_model, n_heads = o.n_heads, seq_len = 8, init_std = 0.5, dtype = o.dtype })
        lm:to("cuda")
        lm:eval()
        moe.no_grad(function()
          local ids = moe.tensor({ { 3, 1, 4, 1, 5, 9, 2 } }, { dtype = "i64" }):cuda()
          local full = lm:forward(ids):float():cpu()
          local cache = lm:new_cache()
          local a = lm:forward(ids:narrow(1, 0, 4), cache)
          local b = lm:forward(ids:narrow(1, 4, 1), cache)
          local c = lm:forward(ids:narrow(1, 5, 2), cache)
          assert.matches("^cuda", cache.layers[1].k.device)
          assert.are.equal(7, cache.pos)
          local got = moe.cat({ a, b, c }, 1):float():cpu()
          local scale = moe.max(moe.abs(full)):item()
          local err = max_diff(got, full)
          assert.is_true(err < o.tol * scale,
            string.format("%s: cached logits differ by %g (scale %g)", o.dtype, err, scale))
          cache:free()
        end)
        if o.dtype == "f32" then
          -- greedy tokens past seq_len (the cache gives way to the moving window)
          local with = sample.generate(lm, { 1, 2, 3 }, { max_new_tokens = 10, temperature = 0 })
          local without = sample.generate(lm, { 1, 2, 3 }, { max_new_tokens = 10, temperature = 0, kv_cache = false })
          assert.are.same(without, with)
        end
      end
    end)
  end)
end
