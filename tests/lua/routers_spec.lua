--[[
tests/lua/routers_spec.lua - moe.routers (lua/moe/routers/*.lua): each
router's outputs against the same computation written in plain Lua over
:totable() values (top-k of softmax / sigmoid scores, p-norm
normalisation, expert counts), the load-balancing and z-losses against
hand-computed values, jitter and fp32, gradients by finite differences,
the bias update of BiasBalanced, ExpertChoice's capacity, bad options,
and a NEW router defined in this file (a subclass of nn.Module) driving a
tiny MoE Transformer trained by hand: no recompilation needed.

Run: moe-lua tests/lua/busted.lua tests/lua/routers_spec.lua (ctest does).
]]
local moe = require "moe"
local nn = require "moe.nn"
local routers = require "moe.routers"

local function close(a, b, tol, what)
  assert(math.abs(a - b) <= tol, string.format("%s: %.17g vs %.17g", what or "value", a, b))
end

-- Plain-Lua logits of x (T, d) and W (E, d) tables.
local function lua_logits(X, W)
  local out = {}
  for t = 1, #X do
    out[t] = {}
    for e = 1, #W do
      local s = 0
      for j = 1, #X[t] do s = s + X[t][j] * W[e][j] end
      out[t][e] = s
    end
  end
  return out
end

local function lua_softmax(row)
  local m, z, out = -math.huge, 0, {}
  for _, v in ipairs(row) do m = math.max(m, v) end
  for i, v in ipairs(row) do out[i] = math.exp(v - m); z = z + out[i] end
  for i = 1, #out do out[i] = out[i] / z end
  return out, m + math.log(z)
end

-- 1-based indices of the k largest of row, largest first.
local function lua_topk(row, k)
  local idx = {}
  for i = 1, #row do idx[i] = i end
  table.sort(idx, function(a, b) return row[a] > row[b] end)
  return { table.unpack(idx, 1, k) }
end

local function setup(T, d)
  local x = moe.randn({ T, d }, { dtype = "f64" })
  return x, x:totable()
end

describe("routers.TopK", function()
  it("takes the top k of softmax(x W^T), normalises gates and counts experts", function()
    moe.manual_seed(1)
    local T, d, E, k = 7, 5, 4, 2
    local r = routers.TopK({ d_model = d, num_experts = E, top_k = k, dtype = "f64", std = 1 })
    local x, X = setup(T, d)
    local out = r(x)
    assert.are.equal("token", out.kind)
    assert.are.same({ T, k }, out.ids.shape)
    assert.are.same({ T, k }, out.gates.shape)
    assert.are.same({ T, E }, out.probs.shape)
    assert.are.equal("i64", out.ids.dtype)
    local L = lua_logits(X, r.layer.weight:totable())
    local ids, gates, probs, counts = out.ids:totable(), out.gates:totable(), out.probs:totable(), {}
    for e = 1, E do counts[e] = 0 end
    for t = 1, T do
      local p = lua_softmax(L[t])
      local top = lua_topk(p, k)
      for j = 1, k do
        assert.are.equal(top[j] - 1, ids[t][j])
        close(gates[t][j], p[top[j]], 1e-12, "gate")
        counts[top[j]] = counts[top[j]] + 1
      end
      for e = 1, E do close(probs[t][e], p[e], 1e-12, "prob") end
    end
    assert.are.same(counts, out.counts:totable())
    assert.are.same(counts, r.stats.expert_counts:totable())
    -- p-norm normalisation over the k
    for _, p in ipairs({ 1, 2 }) do
      local rp = routers.TopK({ d_model = d, num_experts = E, top_k = k, normalize_expert_weights = p,
        dtype = "f64" })
      rp.layer.weight = r.layer.weight
      local g = rp(x).gates:totable()
      for t = 1, T do
        close((math.abs(g[t][1]) ^ p + math.abs(g[t][2]) ^ p) ^ (1 / p), 1, 1e-12, "p-norm")
        close(g[t][1] / g[t][2], gates[t][1] / gates[t][2], 1e-12, "ratio")
      end
    end
  end)

  it("computes the load-balancing loss and the z-loss by hand", function()
    moe.manual_seed(2)
    local T, d, E, k = 9, 3, 5, 2
    local r = routers.TopK({ d_model = d, num_experts = E, top_k = k, loss_weight = 0.1, zloss_weight = 0.01,
      dtype = "f64", std = 1 })
    local x, X = setup(T, d)
    local out = r(x)
    local L = lua_logits(X, r.layer.weight:totable())
    local count, P, z = {}, {}, 0
    for e = 1, E do count[e], P[e] = 0, 0 end
    for t = 1, T do
      local p, lse = lua_softmax(L[t])
      for _, e in ipairs(lua_topk(p, k)) do count[e] = count[e] + 1 end
      for e = 1, E do P[e] = P[e] + p[e] / T end
      z = z + lse * lse / T
    end
    local lb = 0
    for e = 1, E do lb = lb + count[e] / (T * k) * P[e] end
    local expect = 0.1 * E * lb + 0.01 * z
    close(r.aux_loss:item(), expect, 1e-12, "aux loss")
    -- the loss reaches the gate weights
    r:pop_aux_loss():backward()
    assert.truthy(r.layer.weight.grad)
    -- eval mode: stats only, no aux loss
    r:eval()
    r(x)
    assert.is_nil(r.aux_loss)
    assert.are.same(out.counts:totable(), r.stats.expert_counts:totable())
    -- default weights: 0.01 load balancing, no z-loss
    local r2 = routers.TopK({ d_model = d, num_experts = E, top_k = k, dtype = "f64" })
    r2.layer.weight = r.layer.weight
    r2(x)
    close(r2.aux_loss:item(), 0.01 * E * lb, 1e-12, "default aux loss")
  end)

  it("jitters x in train mode only and computes in fp32 for bf16 inputs", function()
    moe.manual_seed(3)
    local r = routers.TopK({ d_model = 8, num_experts = 4, top_k = 1, jitter_eps = 0.5 })
    local x = moe.randn({ 16, 8 })
    local a, b = r(x).probs, r(x).probs
    assert.is_true(moe.max(moe.abs(a - b)):item() > 1e-4)
    r:eval()
    local c, e = r(x).probs, r(x).probs
    assert.are.equal(0, moe.max(moe.abs(c - e)):item())
    assert.are.same(moe.softmax(moe.linear(x, r.layer.weight), -1):totable(), c:totable())
    local rb = routers.TopK({ d_model = 8, num_experts = 4, top_k = 2, dtype = "bf16" })
    local out = rb(x:bfloat16())
    assert.are.equal("f32", out.probs.dtype)
    assert.are.equal("f32", out.logits.dtype)
    assert.are.equal("bf16", out.gates.dtype)
    local rn = routers.TopK({ d_model = 8, num_experts = 4, top_k = 2, dtype = "bf16", fp32 = false })
    assert.are.equal("bf16", rn(x:bfloat16()).probs.dtype)
  end)

  it("has finite-difference gradients in f64 (gates and aux loss)", function()
    moe.manual_seed(4)
    local r = routers.TopK({ d_model = 4, num_experts = 3, top_k = 2, loss_weight = 0.5, zloss_weight = 0.1,
      normalize_expert_weights = 1, dtype = "f64", std = 1 })
    local x = moe.randn({ 5, 4 }, { dtype = "f64", requires_grad = true })
    local R = moe.randn({ 5, 2 }, { dtype = "f64" })
    local ok, msg = moe.gradcheck(function(xx)
      local out = r(xx)
      return moe.sum(out.gates * R) + r:pop_aux_loss()
    end, { x, r.layer.weight })
    assert(ok, msg)
  end)

  it("rejects bad options and inputs", function()
    assert.error_matches(function() routers.TopK({ d_model = 4, num_experts = 3, top_k = 4 }) end,
      "routers.TopK: top_k must be an integer in %[1, num_experts = 3%], got 4")
    assert.error_matches(function() routers.TopK({ d_model = 4, num_experts = 3, jitter = 0.1 }) end,
      "routers.TopK: unknown option 'jitter'")
    assert.error_matches(function() routers.TopK({ d_model = 4 }) end, "num_experts must be a positive integer")
    assert.error_matches(function() routers.TopK({ d_model = 4, num_experts = 2, normalize_expert_weights = -1 }) end,
      "normalize_expert_weights must be nil or a p > 0")
    assert.error_matches(function() routers.TopK({ d_model = 4, num_experts = 2, jitter_eps = 1 }) end,
      "jitter_eps must be a number in %[0, 1%)")
    local r = routers.TopK({ d_model = 4, num_experts = 2 })
    assert.error_matches(function() r(moe.randn({ 3, 5 })) end, "x must be %(T, 4%), got %(3, 5%)")
    -- (B, S, d) is flattened to (B S, d)
    assert.are.same({ 6, 1 }, r(moe.randn({ 2, 3, 4 })).ids.shape)
  end)
end)

describe("routers.Sigmoid", function()
  it("takes the top k of sigmoid scores with gates summing to 1", function()
    moe.manual_seed(5)
    local T, d, E, k = 6, 4, 5, 3
    local r = routers.Sigmoid({ d_model = d, num_experts = E, top_k = k, dtype = "f64", std = 1,
      route_scale = 2.5 })
    local x, X = setup(T, d)
    local out = r(x)
    local L = lua_logits(X, r.layer.weight:totable())
    local ids, gates = out.ids:totable(), out.gates:totable()
    for t = 1, T do
      local s = {}
      for e = 1, E do s[e] = 1 / (1 + math.exp(-L[t][e])) end
      local top = lua_topk(s, k)
      local sum = 0
      for j = 1, k do sum = sum + s[top[j]] end
      for j = 1, k do
        assert.are.equal(top[j] - 1, ids[t][j])
        close(gates[t][j], 2.5 * s[top[j]] / sum, 1e-12, "gate")
      end
    end
    assert.is_true(r.aux_loss:item() > 0)
    assert.are.equal(T * k, moe.sum(out.counts):item())
  end)
end)

describe("routers.BiasBalanced", function()
  it("updates the bias by sign(mean count - count) * rate", function()
    local r = routers.BiasBalanced({ d_model = 4, num_experts = 4, top_k = 1, bias_update_rate = 0.25 })
    assert.are.same({ 0, 0, 0, 0 }, r.expert_bias:totable())
    r:update_bias(moe.tensor({ 5, 1, 3, 3 }, { dtype = "i64" }))
    assert.are.same({ -0.25, 0.25, 0, 0 }, r.expert_bias:totable())
    r:update_bias(moe.tensor({ 0, 0, 0, 12 }, { dtype = "i64" }))
    assert.are.same({ 0, 0.5, 0.25, -0.25 }, r.expert_bias:totable())
    assert.truthy(r:state_dict().expert_bias)
    assert.are.same({ "layer.weight" }, { r:named_parameters()[1][1] })
    assert.is_false(r.expert_bias.requires_grad)
  end)

  it("selects on scores + bias, gates from the unbiased scores, updates in train mode", function()
    moe.manual_seed(6)
    local T, d, E, k = 8, 4, 4, 2
    local r = routers.BiasBalanced({ d_model = d, num_experts = E, top_k = k, dtype = "f64", std = 1 })
    local x, X = setup(T, d)
    r.expert_bias:copy_(moe.tensor({ 0, 0, 0, 10 }))
    r:eval()
    local out = r(x)
    assert.is_nil(r.aux_loss) -- aux-loss-free
    local L = lua_logits(X, r.layer.weight:totable())
    local ids, gates = out.ids:totable(), out.gates:totable()
    for t = 1, T do
      assert.are.equal(3, ids[t][1]) -- the biased expert always wins
      local s = {}
      for e = 1, E do s[e] = 1 / (1 + math.exp(-L[t][e])) end
      local other = lua_topk({ s[1], s[2], s[3] }, 1)[1]
      assert.are.equal(other - 1, ids[t][2])
      close(gates[t][1], s[4] / (s[4] + s[other]), 1e-12, "gate")
    end
    assert.are.same({ 0, 0, 0, 10 }, r.expert_bias:totable()) -- eval: no update
    r:train()
    local c = r(x).counts:totable()
    local b = r.expert_bias:totable()
    for e = 1, E do
      local mean = T * k / E
      local sign = (mean > c[e] and 1) or (mean < c[e] and -1) or 0
      close(b[e], (e == 4 and 10 or 0) + 1e-3 * sign, 1e-6, "bias") -- f32 bias: 10 - 1e-3 rounds at ~5e-7
    end
  end)
end)

describe("routers.ExpertChoice", function()
  it("lets each expert take its top-C tokens", function()
    moe.manual_seed(7)
    local T, d, E = 10, 4, 4
    local r = routers.ExpertChoice({ d_model = d, num_experts = E, capacity_factor = 1, dtype = "f64", std = 1 })
    local x, X = setup(T, d)
    local out = r(x)
    assert.are.equal("expert", out.kind)
    assert.are.equal(3, out.capacity) -- ceil(10 * 1 / 4)
    assert.are.same({ E, 3 }, out.tokens.shape)
    assert.are.same({ E, 3 }, out.gates.shape)
    local L = lua_logits(X, r.layer.weight:totable())
    local P = {}
    for t = 1, T do P[t] = lua_softmax(L[t]) end
    local tokens, gates = out.tokens:totable(), out.gates:totable()
    local per_token = {}
    for t = 1, T do per_token[t] = 0 end
    for e = 1, E do
      local col = {}
      for t = 1, T do col[t] = P[t][e] end
      local top = lua_topk(col, 3)
      for j = 1, 3 do
        assert.are.equal(top[j] - 1, tokens[e][j])
        close(gates[e][j], col[top[j]], 1e-12, "gate")
        per_token[top[j]] = per_token[top[j]] + 1
      end
    end
    assert.are.same(per_token, r.stats.tokens_routed:totable())
    assert.are.same({ 3, 3, 3, 3 }, r.stats.expert_counts:totable())
    assert.is_nil(r.aux_loss)
    local big = routers.ExpertChoice({ d_model = d, num_experts = E, capacity_factor = 100 })
    assert.are.equal(T, big(x:float()).capacity)
    assert.error_matches(function() routers.ExpertChoice({ d_model = d, num_experts = E, capacity_factor = 0 }) end,
      "capacity_factor must be a number > 0")
    assert.error_matches(function() routers.ExpertChoice({ d_model = d, num_experts = E, top_k = 1 }) end,
      "top_k does not apply")
  end)
end)

-- ---------------------------------------------------------------------
-- A new router written here, in the experiment, not in the library: cosine
-- similarity between the token and learned expert embeddings, divided by a
-- temperature, top-k, softmax over the chosen k; an entropy bonus as its
-- aux loss. Nothing is compiled.
local CosineRouter = nn.class("CosineRouter", nn.Module)

function CosineRouter:init(o)
  self.num_experts, self.top_k, self.temperature = o.num_experts, o.top_k, o.temperature or 0.1
  self:param("experts", moe.randn({ o.num_experts, o.d_model }))
end

function CosineRouter:forward(x)
  local xn = x / moe.norm(x, 2, -1, true)
  local en = self.experts / moe.norm(self.experts, 2, -1, true)
  local logits = moe.linear(xn, en) * (1 / self.temperature)
  local top, ids = moe.topk(logits, self.top_k, -1)
  local probs = moe.softmax(logits, -1)
  local counts = routers.bincount(ids, self.num_experts)
  self.stats = { expert_counts = counts }
  if self.training then self.aux_loss = moe.mean(moe.sum(probs * moe.log(probs), -1)) * 0.01 end
  return { kind = "token", ids = ids, gates = moe.softmax(top, -1), probs = probs, counts = counts }
end

-- A small MoE feed-forward in plain tensor ops: y = sum_k gate_k *
-- expert_{id_k}(x), each expert an nn.MLP, any token-choice router.
local TinyMoE = nn.class("TinyMoE", nn.Module)

function TinyMoE:init(o)
  self:child("router", o.router)
  self:child("experts", nn.ModuleList())
  for _ = 1, o.num_experts do self.experts:append(nn.MLP({ d_model = o.d_model, d_ff = o.d_ff })) end
end

function TinyMoE:forward(x)
  local shape = x.shape
  local xt = x:reshape({ -1, shape[#shape] })
  local r = self.router(xt)
  local y
  for e = 0, #self.experts - 1 do
    local w = moe.sum(moe.where(moe.eq(r.ids, e), r.gates, 0), -1, true) -- (T, 1)
    local ye = self.experts:at(e)(xt) * w
    y = y and y + ye or ye
  end
  return y:reshape(shape)
end

describe("a router defined in the experiment", function()
  it("trains a tiny MoE Transformer without recompiling", function()
    moe.manual_seed(8)
    local d, E = 16, 4
    local lm = nn.TransformerLM({ vocab_size = 16, d_model = d, n_layers = 2, n_heads = 2, seq_len = 8,
      ffn = function()
        return TinyMoE({ d_model = d, d_ff = 16, num_experts = E,
          router = CosineRouter({ d_model = d, num_experts = E, top_k = 2 }) })
      end })
    assert.truthy(lm:state_dict()["blocks.1.ffn.router.experts"])
    assert.truthy(lm:state_dict()["blocks.0.ffn.experts.3.fc2.weight"])
    local idx = moe.randint(0, 16, { 4, 8 })
    local tgt = moe.randint(0, 16, { 4, 8 })
    local first, last
    for step = 1, 20 do
      local loss, info = lm:loss(idx, tgt)
      assert.is_true(info.aux_loss < 0) -- the entropy bonus of both layers
      assert.are.equal(2, #info.stats)
      assert.are.equal("blocks.0.ffn.router", info.stats[1].name)
      assert.are.equal(4 * 8 * 2, moe.sum(info.stats[2].stats.expert_counts):item())
      if step == 1 then first = info.lm_loss end
      last = info.lm_loss
      loss:backward()
      assert.truthy(lm.blocks:at(0).ffn.router.experts.grad)
      moe.no_grad(function()
        for _, p in ipairs(lm:parameters()) do p:copy_(p - p.grad * 0.5) end
      end)
      lm:zero_grad()
    end
    assert.is_true(last < first - 0.5, string.format("loss %g -> %g", first, last))
  end)

  it("also drives the library's own routers in the same layer", function()
    moe.manual_seed(9)
    for _, R in ipairs({ routers.TopK, routers.Sigmoid, routers.BiasBalanced }) do
      local m = TinyMoE({ d_model = 8, d_ff = 8, num_experts = 3,
        router = R({ d_model = 8, num_experts = 3, top_k = 2 }) })
      local x = moe.randn({ 2, 5, 8 })
      assert.are.same({ 2, 5, 8 }, m(x).shape)
      assert.are.equal(10 * 2, moe.sum(m:collect_stats()[1].stats.expert_counts):item())
    end
  end)
end)

if moe.cuda.is_available() then
  describe("routers on CUDA", function()
    it("route bf16 tokens on the GPU with f32 scores and balanced counts", function()
      moe.manual_seed(10)
      local T, d, E, k = 300, 64, 8, 2
      local x = moe.randn({ T, d }, { dtype = "bf16", device = "cuda" })
      for _, R in ipairs({ routers.TopK, routers.Sigmoid, routers.BiasBalanced }) do
        local r = R({ d_model = d, num_experts = E, top_k = k, normalize_expert_weights = 1, dtype = "bf16",
          device = "cuda", zloss_weight = 0.001 })
        local out = r(x)
        assert.matches("^cuda", out.ids.device)
        assert.are.equal("bf16", out.gates.dtype)
        assert.are.equal("f32", out.probs.dtype)
        assert.are.equal(T * k, moe.sum(out.counts):item())
        -- gates normalised in f32, then rounded to bf16 (8 bits): rows sum to 1 within 2^-7
        local s = moe.sum(out.gates:float(), -1):cpu():totable()
        for t = 1, T do assert.is_true(math.abs(s[t] - 1) < 2 ^ -7) end
        local aux = r.aux_loss:item()
        assert.is_true(aux == aux and aux > 0)
        -- the same router on the CPU picks the same experts for most tokens
        -- (near-ties may flip under different summation orders)
        local rc = R({ d_model = d, num_experts = E, top_k = k, normalize_expert_weights = 1, dtype = "bf16" })
        rc.layer.weight = r.layer.weight:cpu()
        if rc.expert_bias then rc.expert_bias = moe.zeros({ E }) end
        local ids_c, ids_g = rc(x:cpu()).ids:totable(), out.ids:cpu():totable()
        local same = 0
        for t = 1, T do
          if ids_c[t][1] == ids_g[t][1] then same = same + 1 end
        end
        assert.is_true(same > 0.95 * T, "same first choice for " .. same .. " of " .. T)
      end
      local ec = routers.ExpertChoice({ d_model = d, num_experts = E, capacity_factor = 2, dtype = "bf16",
        device = "cuda" })
      local o = ec(x)
      assert.are.same({ E, 75 }, o.tokens.shape)
      assert.are.equal(E * 75, moe.sum(ec.stats.tokens_routed):item())
    end)
  end)
end
