--[[
tests/lua/bad_input_spec.lua - 200+ different bad calls of the moe API under
pcall, in one process: wrong types, bad shapes, dims and sizes, unknown
dtypes, devices and options, ragged tables, use after free, views that need a
copy, broadcast mismatches, item() of many elements, ...

Each case names the function it calls and a piece of the message that states
the problem; the message must contain both ('fname' or "fname:" for the
function). Afterwards, with the fixtures freed and two full collections, the
CPU memory statistics must be back where they started (live storages and
allocated bytes). This spec also runs in the ASan + UBSan build, where a
leak or an invalid access fails the process.
]]
local moe = require "moe"

local gpu = moe.cuda.is_available()

-- Shapes, dims and options that are wrong for every constructor.
local ctor_bad = {
  { function(f) return f({ 1.5 }) end, "size of dim 0 must be a non-negative integer, got 1.5" },
  { function(f) return f({ -1 }) end, "size of dim 0 must be a non-negative integer, got -1" },
  { function(f) return f({ 2, -3 }) end, "size of dim 1 must be a non-negative integer, got -3" },
  { function(f) return f({ "2" }) end, "size of dim 0 must be a non-negative integer, got string" },
  { function(f) return f({ 2, {} }) end, "size of dim 1 must be a non-negative integer, got table" },
  { function(f) return f({ math.huge }) end, "size of dim 0 must be a non-negative integer, got inf" },
  { function(f) return f({ 0 / 0 }) end, "size of dim 0 must be a non-negative integer, got " },
  { function(f) return f({ 1, 1, 1, 1, 1, 1, 1, 1, 1 }) end, "a shape has at most 8 dims, got 9" },
  { function(f) return f(1, 1, 1, 1, 1, 1, 1, 1, 1) end, "a shape has at most 8 dims" },
  { function(f) return f("2x3") end, "shape expected (a table of sizes, or sizes as numbers), got string" },
  { function(f) return f() end, "shape expected (a table of sizes, or sizes as numbers), got no value" },
  { function(f) return f(true) end, "shape expected (a table of sizes, or sizes as numbers), got boolean" },
  { function(f) return f(2, 1.5) end, "bad argument #2" },
  { function(f) return f({ 2 }, { dtype = "f33" }) end, "unknown dtype 'f33' (valid: f32, f64, bf16, f16, i8, u8, i32, i64, bool)" },
  { function(f) return f({ 2 }, { dtype = 32 }) end, "dtype must be a string, got number" },
  { function(f) return f({ 2 }, { dtyp = "f32" }) end, "unknown option 'dtyp' (valid options: dtype, device, requires_grad)" },
  { function(f) return f({ 2 }, { device = "tpu" }) end, "device 'tpu'" },
  { function(f) return f({ 2 }, { device = "cuda:99" }) end, "device 'cuda:99'" },
  { function(f) return f({ 2 }, { device = 0 }) end, "device must be a string ('cpu', 'cuda', 'cuda:N'), got number" },
  { function(f) return f({ 2 }, { dtype = "i32", requires_grad = true }) end, "i32" },
  { function(f) return f({ 2 }, { requires_grad = "yes" }) end, "requires_grad must be a boolean, got string" },
  { function(f) return f({ 2 }, { "f32" }) end, "options are given by name" },
  { function(f) return f({ 2 }, "f32") end, "options table expected" },
  { function(f) return f({ 2 }, {}, 5) end, "unexpected extra argument (5)" },
  { function(f) return f({ 2 ^ 40, 2 ^ 40 }) end, "more than 2^63 elements" },
}

local cases = {}
local function case(fname, problem, fn) cases[#cases + 1] = { fname = fname, problem = problem, fn = fn } end

for _, name in ipairs({ "empty", "zeros", "ones", "rand", "randn" }) do
  for _, c in ipairs(ctor_bad) do
    case(name, c[2], function() return c[1](moe[name]) end)
  end
end

-- Fixtures, made before the memory snapshot and freed before the check.
local fx = {}
local function fixtures()
  fx.t = moe.arange(30):view(5, 6)       -- (5, 6) i64
  fx.f = moe.randn(2, 3)                  -- (2, 3) f32
  fx.tr = fx.f:transpose(0, 1)            -- (3, 2), not contiguous
  fx.ex = moe.ones(1, 3):expand(4, 3)     -- overlapping elements
  fx.s = moe.tensor(5)                    -- 0-dim
  fx.b = moe.tensor({ true, false })
  fx.freed = moe.zeros(3)
  fx.freed:free()
end

local cuda_missing = "device 'cuda'"

-- full, randint, arange, linspace
case("full", "shape table expected, got number", function() return moe.full(2, 1) end)
case("full", "value must be a number or a boolean, got string", function() return moe.full({ 2 }, "x") end)
case("full", "value must be a number or a boolean, got no value", function() return moe.full({ 2 }) end)
case("full", "value must be a number or a boolean, got table", function() return moe.full({ 2 }, {}) end)
case("full", "unknown option 'size'", function() return moe.full({ 2 }, 1, { size = 3 }) end)
case("full", "size of dim 0 must be a non-negative integer, got 0.5", function() return moe.full({ 0.5 }, 1) end)
case("randint", "low must be an integer, got 0.5", function() return moe.randint(0.5, 3, { 2 }) end)
case("randint", "high must be an integer, got string", function() return moe.randint(0, "3", { 2 }) end)
case("randint", "empty range: high (3) must be greater than low (3)", function() return moe.randint(3, 3, { 2 }) end)
case("randint", "empty range: high (0) must be greater than low (0)", function() return moe.randint(0, { 2 }) end)
case("randint", "shape table expected, got number", function() return moe.randint(0, 3, 2) end)
case("randint", "shape table expected, got no value", function() return moe.randint(0, 3) end)
case("randint", "unknown option 'dtpye'", function() return moe.randint(0, 3, { 2 }, { dtpye = "i32" }) end)
case("randint", "size of dim 0 must be a non-negative integer, got -2", function() return moe.randint(0, 3, { -2 }) end)
case("arange", "end must be a number, got no value", function() return moe.arange() end)
case("arange", "end must be a number, got string", function() return moe.arange("10") end)
case("arange", "step must not be zero", function() return moe.arange(0, 10, 0) end)
case("arange", "must be finite", function() return moe.arange(math.huge) end)
case("arange", "must be finite", function() return moe.arange(0, 1, 0 / 0) end)
case("arange", "step -1", function() return moe.arange(0, 10, -1) end)
case("arange", "number or options table expected, got string", function() return moe.arange(1, "x") end)
case("arange", "options table expected, got number", function() return moe.arange(1, 2, 3, 4) end)
case("arange", "unknown dtype 'int128'", function() return moe.arange(3, { dtype = "int128" }) end)
case("arange", "unexpected extra argument", function() return moe.arange(3, {}, 1) end)
case("linspace", "start must be a number, got no value", function() return moe.linspace() end)
case("linspace", "end must be a number, got string", function() return moe.linspace(0, "1", 5) end)
case("linspace", "steps must be an integer, got 2.5", function() return moe.linspace(0, 1, 2.5) end)
case("linspace", "steps must be non-negative, got -1", function() return moe.linspace(0, 1, -1) end)
case("linspace", "must be finite", function() return moe.linspace(0, 0 / 0, 3) end)
case("linspace", "bool", function() return moe.linspace(0, 1, 3, { dtype = "bool" }) end)

-- moe.tensor
case("tensor", "ragged nested table: data[2] has 1 elements, expected 2", function() return moe.tensor({ { 1, 2 }, { 3 } }) end)
case("tensor", "ragged nested table: data[2] is a number, expected a table of 2 elements", function() return moe.tensor({ { 1, 2 }, 3 }) end)
case("tensor", "ragged nested table: data[2] is a table, expected a number", function() return moe.tensor({ 1, { 2 } }) end)
case("tensor", "ragged nested table: data[1][2] has 0 elements, expected 1", function() return moe.tensor({ { { 1 }, {} } }) end)
case("tensor", "data[2][2] mixes booleans and numbers", function() return moe.tensor({ { 1, 2 }, { 3, true } }) end)
case("tensor", "data[3] mixes booleans and numbers", function() return moe.tensor({ true, false, 1 }) end)
case("tensor", "data[2] must be a number or a boolean, got string", function() return moe.tensor({ 1, "2" }) end)
case("tensor", "data[1] must be a number or a boolean, got tensor", function() return moe.tensor({ fx.f }) end)
case("tensor", "data[1][1] must be a number or a boolean, got function", function() return moe.tensor({ { print } }) end)
case("tensor", "nested table deeper than 8 levels", function() return moe.tensor({ { { { { { { { { 1 } } } } } } } } }) end)
case("tensor", "data must be a number, a boolean or a nested table, got string", function() return moe.tensor("1") end)
case("tensor", "data must be a number, a boolean or a nested table, got no value", function() return moe.tensor() end)
case("tensor", "unknown option 'shape'", function() return moe.tensor({ 1 }, { shape = { 1 } }) end)
case("tensor", "unknown dtype 'float128'", function() return moe.tensor({ 1 }, { dtype = "float128" }) end)
case("tensor", "unexpected extra argument", function() return moe.tensor({ 1 }, nil, "x") end)

-- Every method, on something that is not a tensor and on a freed tensor.
local method_args = {
  numel = {}, size = {}, stride = {}, dim = {}, is_contiguous = {}, storage_offset = {}, totable = {},
  item = {}, view = { 3 }, reshape = { 3 }, transpose = { 0, 0 }, permute = { 0 }, narrow = { 0, 0, 1 },
  slice = { 0, 0, 1 }, select = { 0, 0 }, expand = { 3 }, squeeze = {}, unsqueeze = { 0 }, contiguous = {},
  clone = {}, to = { "f32" }, cpu = {}, cuda = {}, float = {}, double = {}, half = {}, bfloat16 = {},
  long = {}, int = {}, bool = {}, fill_ = { 1 }, uniform_ = {}, normal_ = {}, add = { 1 }, sub = { 1 },
  mul = { 1 }, div = { 1 }, neg = {},
}
local method_names = {}
for name in pairs(method_args) do method_names[#method_names + 1] = name end
table.sort(method_names)
for _, name in ipairs(method_names) do
  local args = method_args[name]
  case(name, "bad argument #1 to '" .. name .. "' (tensor", function()
    return moe.Tensor[name]({}, table.unpack(args))
  end)
  case(name, "bad argument #1 to '" .. name .. "' (attempt to use a freed tensor)", function()
    return moe.Tensor[name](fx.freed, table.unpack(args))
  end)
end
case("copy_", "bad argument #2 to 'copy_' (attempt to use a freed tensor)", function() return fx.f:copy_(fx.freed) end)
case("free", "bad argument #1 to 'free' (tensor expected, got number)", function() return moe.Tensor.free(3) end)
case("shape", "attempt to use a freed tensor", function() return fx.freed.shape end)
case("dtype", "attempt to use a freed tensor", function() return fx.freed.dtype end)
case("device", "attempt to use a freed tensor", function() return fx.freed.device end)
case("ndim", "attempt to use a freed tensor", function() return fx.freed.ndim end)
case("__len", "attempt to use a freed tensor", function() return #fx.freed end)
case("add", "bad argument #2 to 'add' (attempt to use a freed tensor)", function() return fx.f + fx.freed end)

-- Views: shapes, dims and indices that do not fit.
case("view", "shape [4, 7] is invalid for a tensor of 30 elements", function() return fx.t:view(4, 7) end)
case("view", "bad argument #2 to 'view'", function() return fx.t:view(7, -1) end)
case("view", "without a copy", function() return fx.tr:view(6) end)
case("view", "more than one -1", function() return fx.t:view(-1, -1) end)
case("view", "size of dim 0 must be a non-negative integer (or -1), got -2", function() return fx.t:view(-2, 15) end)
case("view", "size of dim 1 must be a non-negative integer (or -1), got 2.5", function() return fx.t:view(12, 2.5) end)
case("view", "shape expected (a table of sizes, or sizes as numbers), got no value", function() return fx.t:view() end)
case("view", "shape expected (a table of sizes, or sizes as numbers), got string", function() return fx.t:view("30") end)
case("view", "unexpected extra argument", function() return fx.t:view(30, "x") end)
case("reshape", "shape [7, -1] is invalid for a tensor of 30 elements", function() return fx.t:reshape(7, -1) end)
case("reshape", "a shape has at most 8 dims, got 9", function() return fx.t:reshape({ 1, 1, 1, 1, 1, 1, 1, 1, 30 }) end)
case("expand", "cannot be expanded", function() return fx.t:expand(3, 5, 7) end)
case("expand", "bad argument #2 to 'expand'", function() return fx.t:expand(6) end)
case("expand", "size of dim 0 must be a non-negative integer (or -1), got -5", function() return fx.t:expand(-5, 6) end)
case("transpose", "dim 5 is out of range for a tensor of 2 dims", function() return fx.t:transpose(0, 5) end)
case("transpose", "dim -3 is out of range for a tensor of 2 dims", function() return fx.t:transpose(-3, 0) end)
case("transpose", "dim must be an integer, got 0.5", function() return fx.t:transpose(0.5, 1) end)
case("transpose", "dim must be an integer, got no value", function() return fx.t:transpose(0) end)
case("transpose", "dim must be an integer, got string", function() return fx.t:transpose("0", 1) end)
case("transpose", "dim 0 given for a tensor with no dims", function() return fx.s:transpose(0, 0) end)
case("permute", "appears twice", function() return fx.t:permute(0, 0) end)
case("permute", "1 dims given for a tensor of 2 dims", function() return fx.t:permute(0) end)
case("permute", "dim 2 is out of range for a tensor of 2 dims", function() return fx.t:permute(0, 2) end)
case("permute", "dims[2] must be an integer, got string", function() return fx.t:permute({ 0, "x" }) end)
case("permute", "dims expected, got no value", function() return fx.t:permute() end)
case("narrow", "exceeds size 5 of dim 0", function() return fx.t:narrow(0, 4, 3) end)
case("narrow", "narrow:", function() return fx.t:narrow(0, 0, -1) end)
case("narrow", "narrow:", function() return fx.t:narrow(0, -9, 1) end)
case("narrow", "dim 2 is out of range", function() return fx.t:narrow(2, 0, 1) end)
case("narrow", "start must be an integer, got 1.5", function() return fx.t:narrow(0, 1.5, 1) end)
case("narrow", "length must be an integer, got no value", function() return fx.t:narrow(0, 1) end)
case("slice", "step must be positive, got 0", function() return fx.t:slice(0, 0, 5, 0) end)
case("slice", "step must be positive, got -1", function() return fx.t:slice(0, 0, 5, -1) end)
case("slice", "dim must be an integer, got string", function() return fx.t:slice("0") end)
case("slice", "stop must be an integer, got 2.5", function() return fx.t:slice(0, 0, 2.5) end)
case("slice", "dim 3 is out of range", function() return fx.t:slice(3, 0, 1) end)
case("select", "index 6 is out of range for size 6 of dim 1", function() return fx.t:select(1, 6) end)
case("select", "out of range", function() return fx.t:select(0, -6) end)
case("select", "dim 2 is out of range", function() return fx.t:select(2, 0) end)
case("select", "index must be an integer, got 0.5", function() return fx.t:select(0, 0.5) end)
case("squeeze", "dim 2 is out of range", function() return fx.t:squeeze(2) end)
case("squeeze", "dim must be an integer, got string", function() return fx.t:squeeze("all") end)
case("unsqueeze", "dim 3 is out of range for a tensor of 2 dims", function() return fx.t:unsqueeze(3) end)
case("unsqueeze", "dim -4 is out of range", function() return fx.t:unsqueeze(-4) end)
case("unsqueeze", "dim must be an integer, got no value", function() return fx.t:unsqueeze() end)
case("unsqueeze", "ndim 9 exceeds the maximum of 8", function()
  return moe.zeros(1, 1, 1, 1, 1, 1, 1, 1):unsqueeze(0)
end)
case("size", "dim 2 is out of range", function() return fx.t:size(2) end)
case("size", "dim must be an integer, got string", function() return fx.t:size("0") end)
case("stride", "dim -3 is out of range", function() return fx.t:stride(-3) end)
case("item", "a tensor with 30 elements (shape [5, 6]) cannot be converted to a number", function() return fx.t:item() end)
case("item", "a tensor with 0 elements", function() return moe.zeros(0):item() end)
case("item", "unexpected extra argument", function() return fx.s:item(1) end)
case("totable", "unexpected extra argument", function() return fx.t:totable(1) end)
case("__len", "a 0-dim tensor has no length", function() return #fx.s end)

-- Arithmetic.
case("add", "shapes [5, 6] and [4] cannot be broadcast", function() return fx.t + moe.ones(4) end)
case("sub", "shapes [2, 3] and [3, 2] cannot be broadcast", function() return fx.f - fx.tr end)
case("mul", "cannot be broadcast", function() return fx.f * moe.ones(2) end)
case("div", "cannot be broadcast", function() return moe.ones(4, 3) / moe.ones(2, 1, 4) end)
case("add", "bad argument #2 to 'add' (tensor or number expected, got string)", function() return fx.f + "x" end)
case("add", "bad argument #1 to 'add' (tensor or number expected, got string)", function() return "x" + fx.f end)
case("add", "bad argument #2 to 'add' (tensor or number expected, got table)", function() return fx.f + {} end)
case("sub", "bad argument #2 to 'sub' (tensor or number expected, got boolean)", function() return fx.f - true end)
case("mul", "bad argument #1 to 'mul' (tensor or number expected, got table)", function() return {} * fx.f end)
case("div", "bad argument #2 to 'div' (tensor or number expected, got nil)", function() return fx.f / nil end)
case("add", "bad argument #2 to 'add' (tensor or number expected, got no value)", function() return fx.f:add() end)
case("mul", "unexpected extra argument", function() return fx.f:mul(2, 3) end)
case("sub", "bad argument #2 to 'sub' (tensor expected, got number)", function() return moe.Tensor.sub(1, 2) end)
case("neg", "unexpected extra argument", function() return fx.f:neg(1) end)
case("add", "cannot be broadcast", function() return fx.b + moe.ones(3) end)

-- Conversions, copies, fills.
case("to", "unknown dtype or device 'f33'", function() return fx.f:to("f33") end)
case("to", "unknown dtype or device 'tpu'", function() return fx.f:to("tpu") end)
case("to", "device 'cuda:77'", function() return fx.f:to("cuda:77") end)
case("to", "dtype, device, options table or tensor expected, got number", function() return fx.f:to(5) end)
case("to", "dtype, device, options table or tensor expected, got no value", function() return fx.f:to() end)
case("to", "unknown option 'requires_grad' (valid options: dtype, device)", function() return fx.f:to({ requires_grad = false }) end)
case("to", "unknown dtype 'x'", function() return fx.f:to({ dtype = "x" }) end)
case("to", "bad argument #2 to 'to' (attempt to use a freed tensor)", function() return fx.f:to(fx.freed) end)
case("to", "unexpected extra argument", function() return fx.f:to("f32", 1) end)
case("cuda", "device index must be non-negative, got -1", function() return fx.f:cuda(-1) end)
case("cuda", "device index must be an integer, got string", function() return fx.f:cuda("0") end)
case("cuda", "cuda:", function() return fx.f:cuda(77) end)
case("float", "unexpected extra argument", function() return fx.f:float("f64") end)
case("copy_", "source shape [3] cannot be broadcast to destination shape [5, 6]", function() return fx.t:copy_(moe.ones(3)) end)
case("copy_", "bad argument #2 to 'copy_' (tensor expected, got number)", function() return fx.t:copy_(1) end)
case("copy_", "overlap", function() return fx.ex:copy_(moe.zeros(4, 3)) end)
case("fill_", "value must be a number or a boolean, got string", function() return fx.f:fill_("1") end)
case("fill_", "value must be a number or a boolean, got no value", function() return fx.f:fill_() end)
case("fill_", "overlap", function() return fx.ex:fill_(1) end)
case("uniform_", "low must be a number, got string", function() return fx.f:uniform_("0", 1) end)
case("uniform_", "float", function() return fx.t:uniform_() end)
case("normal_", "std must be non-negative, got -1", function() return fx.f:normal_(0, -1) end)
case("normal_", "needs a float tensor, got i64", function() return fx.t:normal_() end)
case("normal_", "mean must be a number, got table", function() return fx.f:normal_({}) end)

-- Module functions.
case("manual_seed", "seed must be an integer, got 1.5", function() return moe.manual_seed(1.5) end)
case("manual_seed", "seed must be an integer, got string", function() return moe.manual_seed("1") end)
case("manual_seed", "seed must be an integer, got no value", function() return moe.manual_seed() end)
case("set_rng_state", "state table ({seed=, call=}) expected, got number", function() return moe.set_rng_state(1) end)
case("set_rng_state", "state.seed and state.call must be integers, got string and nil", function() return moe.set_rng_state({ seed = "x" }) end)
case("memory_stats", "device must be a string ('cpu', 'cuda', 'cuda:N'), got number", function() return moe.memory_stats(0) end)
case("memory_stats", "device 'tpu'", function() return moe.memory_stats("tpu") end)
case("memory_stats", "device 'cuda:42'", function() return moe.memory_stats("cuda:42") end)
case("reset_peak_memory_stats", "device 'npu'", function() return moe.reset_peak_memory_stats("npu") end)
case("empty_cache", "device must be a string", function() return moe.empty_cache({}) end)
case("set_printoptions", "options table expected, got number", function() return moe.set_printoptions(3) end)
case("set_printoptions", "unknown option 'digits'", function() return moe.set_printoptions({ digits = 3 }) end)
case("set_printoptions", "precision must be a non-negative integer, got -1", function() return moe.set_printoptions({ precision = -1 }) end)
case("set_printoptions", "linewidth must be a non-negative integer, got string", function() return moe.set_printoptions({ linewidth = "wide" }) end)
case("get_device_name", "device index must be non-negative, got -1", function() return moe.cuda.get_device_name(-1) end)
case("get_device_name", "cuda:", function() return moe.cuda.get_device_name(64) end)
case("synchronize", "a CUDA device expected, got 'cpu'", function() return moe.cuda.synchronize("cpu") end)
case("synchronize", "device index must be an integer, got table", function() return moe.cuda.synchronize({}) end)
case("config", "table of defaults expected, got nil", function() return moe.config() end)
case("config", "unknown key 'x'", function() return moe.config({ y = 1 }, { "x=1" }) end)
case("config", "y expects an integer, got 'one'", function() return moe.config({ y = 1 }, { "y=one" }) end)

-- The core operator set: index, sort, reductions, norms, losses, joins, attention.
case("gather", "dim 5 is out of range for a tensor of 2 dims (expected -2 to 1)", function() return moe.gather(fx.f, 5, moe.tensor({ { 0, 1, 2 } })) end)
case("gather", "index must be i64 or i32, got f32", function() return moe.gather(fx.f, 1, fx.f) end)
case("gather", "index holds 7 at position 1, outside [0, 3)", function() return moe.gather(fx.f, 1, moe.tensor({ { 0, 7, 1 } })) end)
case("gather", "dim must be an integer, got string", function() return moe.gather(fx.f, "1", moe.tensor({ { 0 } })) end)
case("scatter", "bad argument #4 to 'scatter' (tensor expected, got string)", function() return moe.scatter(fx.f, 1, moe.tensor({ { 0 } }), "x") end)
case("index_select", "index holds 5 at position 0, outside [0, 2)", function() return moe.index_select(fx.f, 0, moe.tensor({ 5 })) end)
case("index_select", "index must be 1-D, got [1, 1]", function() return moe.index_select(fx.f, 0, moe.tensor({ { 0 } })) end)
case("index_add", "src [1, 4] must have x's shape [2, 3] with dim 0 of size 1", function() return moe.index_add(fx.f, 0, moe.tensor({ 0 }), moe.randn(1, 4)) end)
case("embedding", "ids holds 2 at position 0, outside [0, 2)", function() return moe.embedding(fx.f, moe.tensor({ 2 })) end)
case("embedding", "ids must be i64 or i32, got f32", function() return moe.embedding(fx.f, fx.f) end)
case("one_hot", "ids holds 5 at position 1, outside [0, 3)", function() return moe.one_hot(moe.tensor({ 1, 5 }), 3) end)
case("topk", "k = 4 is outside [0, 3] (size of dim 1)", function() return moe.topk(fx.f, 4) end)
case("topk", "dim 5 is out of range", function() return fx.f:topk(2, 5) end)
case("sort", "dim 2 is out of range", function() return moe.sort(fx.f, 2) end)
case("argsort", "bool tensors are not sorted", function() return moe.argsort(fx.b, 0) end)
case("cumsum", "dim 2 is out of range", function() return moe.cumsum(fx.f, 2) end)
case("softmax", "expected a float tensor (f32, f64, bf16, f16), got i64", function() return moe.softmax(fx.t, 1) end)
case("log_softmax", "dim 3 is out of range", function() return moe.log_softmax(fx.f, 3) end)
case("argmax", "dim 3 is out of range", function() return moe.argmax(fx.f, 3) end)
case("logsumexp", "dim 4 is out of range", function() return moe.logsumexp(fx.f, 4) end)
case("var", "expected a float tensor", function() return moe.var(fx.t, 0) end)
case("norm", "p must be > 0", function() return moe.norm(fx.f, -1) end)
case("cross_entropy", "target 3 at row 1 is out of range for 3 classes", function() return moe.cross_entropy(fx.f, moe.tensor({ 0, 3 })) end)
case("cross_entropy", "target must be i64 class indices, got f32", function() return moe.cross_entropy(fx.f, moe.tensor({ 0.5, 1 })) end)
case("cross_entropy", "target of shape [1] does not match logits [2, 3] (want [2])", function() return moe.cross_entropy(fx.f, moe.tensor({ 0 })) end)
case("cross_entropy", "label_smoothing must be in [0, 1], got 2.0", function() return moe.cross_entropy(fx.f, moe.tensor({ 0, 1 }), { label_smoothing = 2 }) end)
case("layer_norm", "weight of shape [4] does not match the last dim of input [2, 3] (want [3])", function() return moe.layer_norm(fx.f, moe.ones(4)) end)
case("rms_norm", "eps must be finite and >= 0, got -1.0", function() return moe.rms_norm(fx.f, moe.ones(3), -1) end)
case("swiglu", "gate [2, 3] and up [3] must have the same shape", function() return moe.swiglu(fx.f, moe.randn(3)) end)
case("where", "cond must be a bool tensor, got f32", function() return moe.where(fx.f, fx.f, fx.f) end)
case("clamp", "min or max must be given (both are nil)", function() return moe.clamp(fx.f) end)
case("dropout", "p must be in [0, 1], got 1.5", function() return moe.dropout(fx.f, 1.5) end)
case("multinomial", "weights must be finite and >= 0", function() return moe.multinomial(moe.full({ 2, 3 }, -0.5), 2) end)
case("multinomial", "num_samples = 4 must be in [0, 3] without replacement", function() return moe.multinomial(moe.ones(2, 3), 4, false) end)
case("cat", "tensor 1 [2, 4] does not match tensor 0 [2, 3] outside dim 0", function() return moe.cat({ fx.f, moe.randn(2, 4) }, 0) end)
case("cat", "the list of tensors is empty", function() return moe.cat({}, 0) end)
case("cat", "element 2 must be a tensor, got number", function() return moe.cat({ fx.f, 3 }, 0) end)
case("stack", "tensor 1 [3, 2] and tensor 0 [2, 3] differ in shape", function() return moe.stack({ fx.f, fx.tr }, 0) end)
case("split", "split_size must be >= 1, got 0", function() return moe.split(fx.f, 0, 1) end)
case("chunk", "chunks must be >= 1, got 0", function() return moe.chunk(fx.f, 0, 1) end)
case("attention", "q must be 4-D (B, H, T, D), got shape [2, 3]", function() return moe.attention(fx.f, fx.f, fx.f) end)
case("attention", "v has shape [1, 2, 5, 8], wanted q's shape [1, 2, 4, 8]", function() return moe.attention(moe.randn(1, 2, 4, 8), moe.randn(1, 2, 4, 8), moe.randn(1, 2, 5, 8)) end)
case("rope", "must both be (T, D/2) or (T, D)", function() return moe.rope(moe.randn(1, 4, 2, 8), moe.ones(4, 3), moe.ones(4, 3)) end)
case("bmm", "different batch sizes (2 != 3)", function() return moe.bmm(moe.randn(2, 3, 4), moe.randn(3, 4, 5)) end)
case("linear", "cannot be multiplied (in features 3 != 4)", function() return moe.linear(fx.f, moe.randn(4, 4)) end)
case("matmul", "cannot be multiplied (3 != 2)", function() return moe.matmul(fx.f, moe.randn(2, 3)) end)

-- Without a GPU, asking for one is a clear error.
if not gpu then
  case("zeros", cuda_missing, function() return moe.zeros({ 2 }, { device = "cuda" }) end)
  case("randn", cuda_missing, function() return moe.randn({ 2 }, { device = "cuda" }) end)
  case("tensor", cuda_missing, function() return moe.tensor({ 1 }, { device = "cuda" }) end)
  case("arange", "device 'gpu'", function() return moe.arange(3, { device = "gpu" }) end)
  case("to", cuda_missing, function() return fx.f:to("cuda") end)
  case("cuda", "cuda:0", function() return fx.f:cuda() end)
  case("memory_stats", cuda_missing, function() return moe.memory_stats("cuda") end)
  case("synchronize", "cuda:0", function() return moe.cuda.synchronize() end)
  case("get_device_name", "cuda:0", function() return moe.cuda.get_device_name() end)
else
  case("add", "a is on cpu but b is on cuda:0", function() return fx.f + moe.ones(3, { device = "cuda" }) end)
  case("copy_", "cannot be broadcast", function() return moe.zeros(2, { device = "cuda" }):copy_(moe.ones(3)) end)
  case("view", "is invalid for a tensor of", function() return moe.zeros(6, { device = "cuda" }):view(4, 2) end)
  case("normal_", "needs a float tensor", function() return moe.zeros(2, { device = "cuda", dtype = "i32" }):normal_() end)
  case("to", "device 'cuda:64'", function() return fx.f:to("cuda:64") end)
end

-- Files that are not regular files: a clean error at once, never a hang on a named pipe.
local odd_dir = os.tmpname()
os.remove(odd_dir)
assert(os.execute("mkdir -p '" .. odd_dir .. "' && mkfifo '" .. odd_dir .. "/pipe.safetensors' '" ..
  odd_dir .. "/pipe.bin' && : > '" .. odd_dir .. "/pipe.idx'"))
case("load", "not a regular file (a named pipe)", function() return moe.load(odd_dir .. "/pipe.safetensors") end)
case("load", "not a regular file (a folder)", function() return moe.load(odd_dir) end)
case("load", "not a regular file (a device or socket)", function() return moe.load("/dev/zero") end)
case("file_digest", "is a named pipe, not a regular file", function() return moe.file_digest(odd_dir .. "/pipe.safetensors") end)
case("file_digest", "'/dev/zero' is a character device", function() return moe.file_digest("/dev/zero") end)
case("indexed_dataset", "pipe.bin is not a regular file (a named pipe)", function() return moe.ops.indexed_dataset(odd_dir .. "/pipe") end)
case("totable", "would take more than 2^31 empty tables", function() return moe.zeros({ 2^40, 0 }):totable() end)
case("totable", "[1048576, 1048576, 0]", function() return moe.zeros({ 2^20, 2^20, 0 }):totable() end)

describe("bad input", function()
  it("has more than 200 different cases", function()
    assert.is_true(#cases >= 200, "only " .. #cases .. " cases")
  end)

  it("every bad call raises an error naming the function and the problem; nothing leaks", function()
    collectgarbage()
    collectgarbage()
    local before = moe.memory_stats("cpu")
    local before_gpu = gpu and moe.memory_stats("cuda:0")
    fixtures()

    local failures = {}
    for i, c in ipairs(cases) do
      local ok, err = pcall(c.fn)
      err = tostring(err)
      local names = err:find("'" .. c.fname .. "'", 1, true) or err:find(c.fname .. ":", 1, true)
      if ok then
        failures[#failures + 1] = ("case %d (%s, %q): no error"):format(i, c.fname, c.problem)
      elseif not names or not err:find(c.problem, 1, true) then
        failures[#failures + 1] = ("case %d (%s, %q): got %q"):format(i, c.fname, c.problem, err)
      end
    end

    for _, v in pairs(fx) do v:free() end
    collectgarbage()
    collectgarbage()
    local after = moe.memory_stats("cpu")
    assert.are.same({}, failures)
    print(("\n%d bad calls checked"):format(#cases))
    assert.are.equal(before.live_storages, after.live_storages)
    assert.are.equal(before.allocated, after.allocated)
    if gpu then
      local after_gpu = moe.memory_stats("cuda:0")
      assert.are.equal(before_gpu.live_storages, after_gpu.live_storages)
      assert.are.equal(before_gpu.allocated, after_gpu.allocated)
    end
  end)
end)

describe("bad files and data", function()
  it("totable of an empty tensor with huge sizes returns at once", function()
    local t0 = os.clock()
    assert.are.same({}, moe.zeros({ 0, 2^40 }):totable())
    assert.are.same({ {}, {}, {} }, moe.zeros({ 3, 0, 2^40 }):totable())
    assert.is_true(os.clock() - t0 < 1)
  end)

  it("preprocess into the prefix a reader has open: the reader keeps the old tokens (no SIGBUS)", function()
    local data = require "moe.data"
    local txt = odd_dir .. "/a.txt"
    local f = assert(io.open(txt, "w"))
    for i = 1, 400 do f:write(("line %d of the first text, long enough to span some pages\n"):format(i)) end
    f:close()
    local prefix = data.preprocess { inputs = { txt }, output_prefix = odd_dir .. "/corpus" }
    local ds = data.IndexedDataset(prefix)
    local old = {}
    for i = 0, #ds - 1 do old[i] = ds:get(i):totable() end
    f = assert(io.open(txt, "w"))
    f:write("short\n") -- the new .bin is a few bytes: a truncated mapping would raise SIGBUS
    f:close()
    data.preprocess { inputs = { txt }, output_prefix = prefix }
    for i = 0, #ds - 1 do assert.are.same(old[i], ds:get(i):totable(), "sequence " .. i) end
    assert.are.equal(400, #ds)
    ds:close()
    local now = data.IndexedDataset(prefix)
    assert.are.equal(1, #now)
    now:close()
    -- no temporary files left
    local p = io.popen("ls -a '" .. odd_dir .. "'")
    local listing = p:read("a")
    p:close()
    assert.is_nil(listing:find("tmp", 1, true), listing)
  end)

  it("token ids outside the model's vocabulary are found when the data opens", function()
    local data = require "moe.data"
    local b = data.IndexedDatasetBuilder(odd_dir .. "/ids", { dtype = "u16" })
    b:add_document({ 1, 2, 3 })
    b:add_document({ 4, 256, 5 })
    b:add_document({ 6, 300, 7 })
    b:finalize()
    local ds = data.IndexedDataset(odd_dir .. "/ids")
    assert.are.equal(300, data.check_vocab(ds, 301))
    assert.error_matches(function() data.check_vocab(ds, 257) end,
      "data%.check_vocab: indexed dataset .*/ids%.bin: sequence 2 holds token id 300 %(token 1 of it%), " ..
      "outside the model's vocabulary %[0, 257%)")
    ds:close()
    local ok, err = pcall(require("moe.train").run, { data = odd_dir .. "/ids", steps = 1, warmup = 0,
      out_dir = odd_dir .. "/run", quiet = true, seq_len = 2, batch_size = 1,
      model = { d_model = 16, n_layers = 1, n_heads = 2 } })
    assert.is_false(ok)
    assert.matches("^train: data='.*/ids': indexed dataset .*/ids%.bin: sequence 2 holds token id 300", err)
  end)

  it("an .idx whose sequences overlap is rejected at open, naming the file and the sequence", function()
    local data = require "moe.data"
    local b = data.IndexedDatasetBuilder(odd_dir .. "/ov", { dtype = "u16" })
    for i = 1, 3 do b:add_document({ i, i, i, i }) end
    b:finalize()
    -- the pointer of sequence 2 (bytes 34 + 12 + 16 ..) moved back into sequence 1
    local f = assert(io.open(odd_dir .. "/ov.idx", "r+b"))
    f:seek("set", 34 + 4 * 3 + 8 * 2)
    f:write(string.pack("<i8", 10))
    f:close()
    assert.error_matches(function() data.IndexedDataset(odd_dir .. "/ov") end,
      "ov%.idx: sequence 2 %(bytes %[10, 18%) of .*ov%.bin%) starts before sequence 1 ends %(byte 16%)")
    os.execute("rm -rf '" .. odd_dir .. "'") -- the last user of odd_dir
  end)
end)
