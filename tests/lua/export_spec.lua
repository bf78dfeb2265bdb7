--[[
tests/lua/export_spec.lua - `moe-lua export ckpt=DIR format=hf out=DIR2`
(lua/moe/cli/export.lua): three small models train 2 steps and are exported:
a Mixtral-shaped dMoE (SwiGLU experts, RMSNorm, renormalised gates), a dense
GPT-2-shaped model (learned positions, LayerNorm, GELU) and a GELU dMoE,
which has no Mixtral equivalent and gets moe-lua's own layout. Then
tests/python/check_export.py reads each with Hugging Face's `safetensors`
package and checks names, shapes and values against the model's own
tensors, and runs a numpy forward of the layout's definition against
moe-lua's logits. Without Python's safetensors (and numpy) that part is
pending ("SKIPPED (no python safetensors)"), unless CI is set.
The Python used is $MOE_PYTHON, else ~/.cache/moe-lua/pyvenv, else python3.
]]
local moe = require "moe"
local train = require "moe.train"
local build = require "moe.train.build"

local function q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end
local spec_dir = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests/lua"
local checker = spec_dir .. "/../python/check_export.py"
local exe = (os.getenv("MOE_BUILD_DIR") or "build") .. "/moe-lua"

local function find_python()
  local home = os.getenv("XDG_CACHE_HOME") or ((os.getenv("HOME") or "/root") .. "/.cache")
  for _, py in ipairs({ os.getenv("MOE_PYTHON") or false, home .. "/moe-lua/pyvenv/bin/python3", "python3" }) do
    if py and os.execute(q(py) .. ' -c "import safetensors, numpy" >/dev/null 2>&1') then return py end
  end
end
local python = find_python()

local K = dofile(spec_dir .. "/../dist/trainkit.lua")
local root, prefix = K.corpus(0)

local function sh(cmd)
  local p = io.popen("(" .. cmd .. ") 2>&1")
  local out = p:read("a")
  local ok = p:close()
  return ok, out
end

-- trains name 2 steps; returns its checkpoint folder
local function trained(name, ffn, over, moe_over)
  local c = K.base_cfg({ steps = 2, device = "cpu" }, root, prefix, name, ffn, over)
  for k, v in pairs(moe_over or {}) do c.model.moe[k] = v end
  c.keep_last = 1
  return train.run(c).checkpoint
end

-- exports ckpt, writes the reference (the model's tensors, tokens, logits), runs the checker
local function export_and_check(ckpt, name, want_layout)
  local out = root .. "/hf-" .. name
  local ok, text = sh(q(exe) .. " export ckpt=" .. q(ckpt) .. " format=hf out=" .. q(out))
  assert(ok, text)
  assert.truthy(text:find("in the " .. want_layout .. " layout", 1, true), text)
  local model = build.load_model(ckpt, "cpu")
  local ref = {}
  for k, v in pairs(model:state_dict()) do ref[k] = v end
  local tokens = moe.tensor({ { 5, 17, 99, 3, 42, 7, 250, 1 } }, { dtype = "i64" })
  ref.tokens = tokens
  ref.logits = moe.no_grad(function() return model(tokens) end)
  moe.save(root .. "/ref-" .. name .. ".safetensors", ref)
  if not python then
    if os.getenv("CI") then error("no python with safetensors and numpy (CI is set)") end
    return pending("SKIPPED (no python safetensors): " .. name)
  end
  local pok, ptext = sh(q(python) .. " " .. q(checker) .. " " .. q(out) .. " " .. q(root .. "/ref-" .. name .. ".safetensors"))
  io.write("\n-- " .. checker .. " (" .. name .. ")\n" .. ptext)
  assert(pok, ptext)
  return text
end

describe("moe-lua export format=hf", function()
  teardown(function() os.execute("rm -rf " .. q(root)) end)

  it("writes a SwiGLU dMoE with RMSNorm as Mixtral", function()
    local ckpt = trained("mx", "moe", { model = { norm = "rmsnorm", tie_embeddings = false } },
      { mlp_type = "glu", activation = "silu", normalize_expert_weights = 1 })
    export_and_check(ckpt, "mixtral", "mixtral")
  end)

  it("writes a dense model with learned positions as GPT-2", function()
    export_and_check(trained("dense", "dense", { model = { pos = "learned" } }), "gpt2", "gpt2")
  end)

  it("writes GELU experts in moe-lua's layout, saying why not Mixtral, and refuses layout=mixtral", function()
    local ckpt = trained("gelu", "moe", {})
    local text = export_and_check(ckpt, "moe-lua", "moe-lua")
    assert.truthy(text:find("GELU experts have no Mixtral equivalent", 1, true), text)
    local ok, err = sh(q(exe) .. " export ckpt=" .. q(ckpt) .. " out=" .. q(root .. "/x") .. " layout=mixtral")
    assert.falsy(ok)
    assert.truthy(err:find("moe-lua export: the model does not match Mixtral: experts mlp_type=mlp activation=gelu",
      1, true), err)
    ok, err = sh(q(exe) .. " export ckpt=" .. q(root .. "/nothing") .. " out=" .. q(root .. "/x"))
    assert.falsy(ok)
    assert.truthy(err:find("is neither a checkpoint", 1, true), err)
  end)
end)
