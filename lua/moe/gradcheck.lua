--[[
moe/gradcheck.lua - moe.gradcheck(fn, inputs [, opts]): the finite-difference
gradient check of tests/c/gradcheck.h, from Lua (Torch7's nn/Jacobian.lua).

  local ok, msg = moe.gradcheck(function(a, b) return a * b + a end, { a, b })
  assert(ok, msg)

inputs: a list of f64 CPU tensors that require grad (leaves; they may be
non-contiguous: each element is perturbed in place through its strides).
fn(inputs...) returns one tensor. The check draws a fixed cotangent R of the
output's shape, computes the analytic gradients of L = sum(out * R) with one
backward, and compares each with the central difference
(L(x + eps) - L(x - eps)) / (2 eps) evaluated under moe.no_grad.
opts: eps (1e-6), atol (1e-5), rtol (1e-4): an element passes when
|analytic - numeric| <= atol + rtol * |numeric|.
Returns true, or false and a message naming the input and element. Every
tensor it makes is freed before it returns; .grad of the inputs is cleared
before and after.
]]
local moe = require "moe"

-- The row-major values of t as a flat list.
local function values(t)
  local v, out = t:totable(), {}
  local function walk(x)
    if type(x) == "table" then
      for i = 1, #x do walk(x[i]) end
    else
      out[#out + 1] = x
    end
  end
  walk(v)
  return out
end

local function is_input(t, inputs)
  for i = 1, #inputs do
    if rawequal(t, inputs[i]) then return true end
  end
  return false
end

-- fn's output, checked to be a tensor.
local function call(fn, inputs)
  local out = fn(table.unpack(inputs))
  if not moe.is_tensor(out) then
    error("gradcheck: fn must return a tensor, got " .. type(out), 3)
  end
  return out
end

-- L = sum(out * r) with grad mode off.
local function loss(fn, inputs, r)
  return moe.no_grad(function()
    local out = call(fn, inputs)
    local v, s = values(out), 0
    if #v ~= #r then error("gradcheck: the output's size changed", 0) end
    for j = 1, #v do s = s + v[j] * r[j] end
    if not is_input(out, inputs) then out:free() end
    return s
  end)
end

-- The element of t with row-major index i (0-based), as a 0-dim view.
local function element(t, i)
  local shape, idx = t.shape, {}
  for d = #shape, 1, -1 do
    idx[d] = i % shape[d]
    i = i // shape[d]
  end
  local e = t
  for d = 1, #shape do
    local nxt = e:select(0, idx[d])
    if e ~= t then e:free() end
    e = nxt
  end
  if e == t then e = t:view({}) end
  return e, idx
end

local function gradcheck(fn, inputs, opts)
  if type(fn) ~= "function" then
    error("bad argument #1 to 'gradcheck' (function expected, got " .. type(fn) .. ")", 2)
  end
  if type(inputs) ~= "table" then
    error("bad argument #2 to 'gradcheck' (list of tensors expected, got " .. type(inputs) .. ")", 2)
  end
  opts = opts or {}
  local eps, atol, rtol = opts.eps or 1e-6, opts.atol or 1e-5, opts.rtol or 1e-4
  for k, x in ipairs(inputs) do
    if not moe.is_tensor(x) or x.dtype ~= "f64" or x.device ~= "cpu" then
      return false, ("gradcheck: input %d must be an f64 CPU tensor"):format(k)
    end
    if not x.requires_grad or not x.is_leaf then
      return false, ("gradcheck: input %d must be a leaf that requires grad"):format(k)
    end
    x.grad = nil
  end
  -- analytic
  local out = call(fn, inputs)
  local n = out:numel()
  local r = {}
  for j = 1, n do r[j] = math.sin(0.7 * (j - 1) + 0.3) + 0.1 end -- fixed, non-trivial
  local rt = moe.tensor(#out.shape == 0 and r[1] or r, { dtype = out.dtype, device = out.device })
  if #out.shape > 0 then
    local v = rt:view(out.shape)
    rt:free()
    rt = v
  end
  local ok, err = pcall(out.backward, out, rt)
  rt:free()
  if not is_input(out, inputs) then out:free() end
  if not ok then return false, "gradcheck: backward failed: " .. tostring(err) end
  local analytic = {}
  for k, x in ipairs(inputs) do
    local g = x.grad
    if g then
      analytic[k] = values(g)
      g:free()
    else
      analytic[k] = {} -- no gradient reached it: zeros
    end
  end
  -- numeric
  local result, msg = true, nil
  for k, x in ipairs(inputs) do
    local m = x:numel()
    for i = 0, m - 1 do
      local e, idx = element(x, i)
      local x0 = e:item()
      moe.no_grad(function() e:fill_(x0 + eps) end)
      local okp, lp = pcall(loss, fn, inputs, r)
      moe.no_grad(function() e:fill_(x0 - eps) end)
      local okm, lm = pcall(loss, fn, inputs, r)
      moe.no_grad(function() e:fill_(x0) end)
      e:free()
      if not okp or not okm then
        result, msg = false, "gradcheck: forward failed: " .. tostring(okp and lm or lp)
        break
      end
      local num, ana = (lp - lm) / (2 * eps), analytic[k][i + 1] or 0
      -- written so that a NaN on either side fails the check
      if not (math.abs(num - ana) <= atol + rtol * math.abs(num)) then -- luacheck: ignore 581
        result = false
        msg = ("gradcheck: input %d element %d (index {%s}): analytic %.10g, numeric %.10g")
          :format(k, i, table.concat(idx, ", "), ana, num)
        break
      end
    end
    if not result then break end
  end
  for _, x in ipairs(inputs) do x.grad = nil end
  return result, msg
end

return gradcheck
