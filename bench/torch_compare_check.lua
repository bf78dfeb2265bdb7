-- bench/torch_compare_check.lua - runs a list of ops forward and backward on the GPU and
-- saves inputs, outputs, the output cotangent and the input gradients to one
-- safetensors file per case; bench/torch_compare.py recomputes each case with
-- PyTorch on the same GPU and prints the comparison table.
--
--   moe-lua bench/torch_compare_check.lua dir=/tmp/cmp device=cuda
--   python3 bench/torch_compare.py /tmp/cmp
--
-- Each case names its inputs (float inputs get gradients; integer inputs are
-- indices or targets), a moe function and the same computation in PyTorch as
-- a Python expression over the inputs' names (torch, F available).
local moe = require "moe"
local cfg = moe.config{ dir = "/tmp/moe_torch_compare", device = "cuda", seed = 0 }
moe.manual_seed(cfg.seed)
os.execute("mkdir -p '" .. cfg.dir .. "'")

local function randn(shape, dtype) return moe.randn(shape, {dtype = dtype, device = cfg.device}) end
local function pos(shape, dtype) return (moe.rand(shape, {device = cfg.device}) + 0.5):to(dtype) end
local function ids(shape, n) return moe.randint(0, n, shape, {dtype = "i64", device = cfg.device}) end

-- name, dtypes, inputs (name -> maker(dtype)), moe fn(inputs), torch expression
local cases = {
  {"add_broadcast", {"f32", "bf16"}, {a = function(dt) return randn({64, 257}, dt) end, b = function(dt) return randn({257}, dt) end},
    function(t) return t.a + t.b end, "a + b"},
  {"mul_broadcast", {"f32", "bf16"}, {a = function(dt) return randn({8, 1, 33}, dt) end, b = function(dt) return randn({5, 33}, dt) end},
    function(t) return t.a * t.b end, "a * b"},
  {"div", {"f32", "bf16"}, {a = function(dt) return randn({1000}, dt) end, b = function(dt) return pos({1000}, dt) end},
    function(t) return t.a / t.b end, "a / b"},
  {"exp", {"f32", "bf16"}, {x = function(dt) return randn({4097}, dt) end}, function(t) return moe.exp(t.x) end, "torch.exp(x)"},
  {"log", {"f32", "bf16"}, {x = function(dt) return pos({4097}, dt) end}, function(t) return moe.log(t.x) end, "torch.log(x)"},
  {"sqrt", {"f32"}, {x = function(dt) return pos({4097}, dt) end}, function(t) return moe.sqrt(t.x) end, "torch.sqrt(x)"},
  {"rsqrt", {"f32"}, {x = function(dt) return pos({4097}, dt) end}, function(t) return moe.rsqrt(t.x) end, "torch.rsqrt(x)"},
  {"pow", {"f32"}, {x = function(dt) return pos({4097}, dt) end}, function(t) return moe.pow(t.x, 2.5) end, "torch.pow(x, 2.5)"},
  {"relu", {"f32", "bf16"}, {x = function(dt) return randn({4097}, dt) end}, function(t) return moe.relu(t.x) end, "F.relu(x)"},
  {"gelu", {"f32", "bf16"}, {x = function(dt) return randn({4097}, dt) end}, function(t) return moe.gelu(t.x) end, "F.gelu(x)"},
  {"gelu_tanh", {"f32", "bf16"}, {x = function(dt) return randn({4097}, dt) end}, function(t) return moe.gelu_tanh(t.x) end, "F.gelu(x, approximate='tanh')"},
  {"silu", {"f32", "bf16"}, {x = function(dt) return randn({4097}, dt) end}, function(t) return moe.silu(t.x) end, "F.silu(x)"},
  {"sigmoid", {"f32", "bf16"}, {x = function(dt) return randn({4097}, dt) end}, function(t) return moe.sigmoid(t.x) end, "torch.sigmoid(x)"},
  {"tanh", {"f32", "bf16"}, {x = function(dt) return randn({4097}, dt) end}, function(t) return moe.tanh(t.x) end, "torch.tanh(x)"},
  {"swiglu", {"f32", "bf16"}, {g = function(dt) return randn({64, 96}, dt) end, u = function(dt) return randn({64, 96}, dt) end},
    function(t) return moe.swiglu(t.g, t.u) end, "F.silu(g) * u"},
  {"sum_dim", {"f32", "bf16"}, {x = function(dt) return randn({33, 1025}, dt) end}, function(t) return moe.sum(t.x, -1) end, "x.sum(-1)"},
  {"mean_dims", {"f32", "bf16"}, {x = function(dt) return randn({7, 33, 65}, dt) end}, function(t) return moe.mean(t.x, {0, 2}) end, "x.mean((0, 2))"},
  {"max_dim", {"f32"}, {x = function(dt) return randn({33, 1025}, dt) end}, function(t) return (moe.max(t.x, 1)) end, "x.max(1).values"},
  {"logsumexp", {"f32", "bf16"}, {x = function(dt) return randn({33, 1025}, dt) end}, function(t) return moe.logsumexp(t.x, -1) end, "torch.logsumexp(x, -1)"},
  {"var", {"f32"}, {x = function(dt) return randn({33, 1025}, dt) end}, function(t) return moe.var(t.x, -1) end, "x.var(-1)"},
  {"norm", {"f32"}, {x = function(dt) return randn({33, 1025}, dt) end}, function(t) return moe.norm(t.x, 2, -1) end, "torch.linalg.vector_norm(x, 2, -1)"},
  {"softmax", {"f32", "bf16"}, {x = function(dt) return randn({64, 1000}, dt) end}, function(t) return moe.softmax(t.x, -1) end, "torch.softmax(x, -1)"},
  {"log_softmax", {"f32", "bf16"}, {x = function(dt) return randn({64, 1000}, dt) end}, function(t) return moe.log_softmax(t.x, -1) end, "torch.log_softmax(x, -1)"},
  {"cumsum", {"f32"}, {x = function(dt) return randn({17, 513}, dt) end}, function(t) return moe.cumsum(t.x, 1) end, "torch.cumsum(x, 1)"},
  {"layer_norm", {"f32", "bf16"}, {x = function(dt) return randn({64, 768}, dt) end, w = function(dt) return randn({768}, dt) end, b = function(dt) return randn({768}, dt) end},
    function(t) return moe.layer_norm(t.x, t.w, t.b, 1e-5) end, "F.layer_norm(x, (768,), w, b, 1e-5)"},
  {"rms_norm", {"f32", "bf16"}, {x = function(dt) return randn({64, 768}, dt) end, w = function(dt) return randn({768}, dt) end},
    function(t) return moe.rms_norm(t.x, t.w, 1e-6) end, "F.rms_norm(x, (768,), w, 1e-6)"},
  {"cross_entropy", {"f32", "bf16"}, {logits = function(dt) return randn({256, 1000}, dt) end, target = function() return ids({256}, 1000) end},
    function(t) return moe.cross_entropy(t.logits, t.target) end, "F.cross_entropy(logits, target)"},
  {"cross_entropy_smooth", {"f32"}, {logits = function(dt) return randn({256, 1000}, dt) end, target = function() return ids({256}, 1000) end},
    function(t) return moe.cross_entropy(t.logits, t.target, {label_smoothing = 0.1}) end, "F.cross_entropy(logits, target, label_smoothing=0.1)"},
  {"matmul", {"f32", "bf16"}, {a = function(dt) return randn({129, 257}, dt) end, b = function(dt) return randn({257, 65}, dt) end},
    function(t) return moe.matmul(t.a, t.b) end, "a @ b"},
  {"bmm", {"f32", "bf16"}, {a = function(dt) return randn({4, 33, 65}, dt) end, b = function(dt) return randn({4, 65, 17}, dt) end},
    function(t) return moe.bmm(t.a, t.b) end, "torch.bmm(a, b)"},
  {"linear", {"f32", "bf16"}, {x = function(dt) return randn({3, 40, 256}, dt) end, w = function(dt) return randn({96, 256}, dt) end, b = function(dt) return randn({96}, dt) end},
    function(t) return moe.linear(t.x, t.w, t.b) end, "F.linear(x, w, b)"},
  {"gather", {"f32"}, {x = function(dt) return randn({16, 50}, dt) end, idx = function() return ids({16, 8}, 50) end},
    function(t) return moe.gather(t.x, 1, t.idx) end, "torch.gather(x, 1, idx)"},
  {"index_select", {"f32"}, {x = function(dt) return randn({50, 16}, dt) end, idx = function() return ids({40}, 50) end},
    function(t) return moe.index_select(t.x, 0, t.idx) end, "torch.index_select(x, 0, idx)"},
  {"embedding", {"f32", "bf16"}, {w = function(dt) return randn({100, 64}, dt) end, idx = function() return ids({4, 33}, 100) end},
    function(t) return moe.embedding(t.w, t.idx) end, "F.embedding(idx, w)"},
  {"topk_values", {"f32"}, {x = function(dt) return randn({128, 64}, dt) end}, function(t) return (moe.topk(t.x, 8, -1)) end, "torch.topk(x, 8, -1).values"},
  {"sort_values", {"f32"}, {x = function(dt) return randn({16, 100}, dt) end}, function(t) return (moe.sort(t.x, -1)) end, "torch.sort(x, -1).values"},
  {"cat", {"f32", "bf16"}, {a = function(dt) return randn({3, 5}, dt) end, b = function(dt) return randn({3, 7}, dt) end},
    function(t) return moe.cat({t.a, t.b}, 1) end, "torch.cat([a, b], 1)"},
  {"stack", {"f32"}, {a = function(dt) return randn({3, 5}, dt) end, b = function(dt) return randn({3, 5}, dt) end},
    function(t) return moe.stack({t.a, t.b}, 0) end, "torch.stack([a, b], 0)"},
  {"attention_causal", {"bf16"}, {q = function(dt) return randn({2, 4, 256, 64}, dt) end, k = function(dt) return randn({2, 4, 256, 64}, dt) end, v = function(dt) return randn({2, 4, 256, 64}, dt) end},
    function(t) return moe.attention(t.q, t.k, t.v, {causal = true}) end, "F.scaled_dot_product_attention(q, k, v, is_causal=True)"},
  {"attention_causal_d128", {"bf16"}, {q = function(dt) return randn({1, 2, 300, 128}, dt) end, k = function(dt) return randn({1, 2, 300, 128}, dt) end, v = function(dt) return randn({1, 2, 300, 128}, dt) end},
    function(t) return moe.attention(t.q, t.k, t.v, {causal = true}) end, "F.scaled_dot_product_attention(q, k, v, is_causal=True)"},
}

local written, failed = 0, 0
for _, c in ipairs(cases) do
  local name, dtypes, makers, fn, expr = c[1], c[2], c[3], c[4], c[5]
  for _, dt in ipairs(dtypes) do
    local case = name .. "." .. dt
    local ok, err = pcall(function()
      local inputs, grads_of = {}, {}
      for k, make in pairs(makers) do
        local t = make(dt)
        if t.dtype ~= "i64" then t.requires_grad = true; grads_of[#grads_of + 1] = k end
        inputs[k] = t
      end
      table.sort(grads_of)
      local out = fn(inputs)
      local cot = moe.randn(out.shape, {dtype = out.dtype, device = cfg.device})
      out:backward(cot)
      local save = {out = out, cot = cot}
      for k, t in pairs(inputs) do save["in." .. k] = t end
      for _, k in ipairs(grads_of) do save["grad." .. k] = inputs[k].grad end
      moe.save(cfg.dir .. "/" .. case .. ".safetensors", save, {torch = expr, case = case, dtype = dt})
    end)
    if ok then written = written + 1 else failed = failed + 1; print(("moe failed %-28s %s"):format(case, err)) end
  end
end
print(("torch_compare: %d cases written to %s, %d failed in moe"):format(written, cfg.dir, failed))
