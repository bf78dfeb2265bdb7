--[[
tests/lua/memory_flat_spec.lua - the memory-flatness test: a small
MLP trained for 200 SGD steps, with moe.memory_stats(device).allocated read
after every step and required to equal the value after step 1, without ever
calling collectgarbage. It runs on the CPU, and on cuda when a GPU is there.

What the user frees, and what the core frees:
  - The core frees, the moment backward returns, every node of the graph it
    ran and every tensor those nodes saved (unless retain_graph). A graph that
    is never run is freed with the last tensor that refers to it.
  - The user frees the tensor handles the step made (activations, the loss,
    temporaries of the update, the handle t.grad returns): with `local x
    <close> = ...` as here, or x:free(). Handles left to Lua's collector keep
    their storage until it runs (STYLE.md point 6: the collector sees a
    64-byte handle, not the memory behind it).
  - .grad of the parameters is dropped by moe.zero_grad(params) after the
    update, so each step's gradients are new tensors of the same sizes.
The model uses moe.matmul when the matmul family is built in, and
elementwise weights with broadcasting otherwise; the loss is a sum of
squares through moe.sum when present, else its gradient is passed to
backward directly.

Run: moe-lua tests/lua/busted.lua tests/lua/memory_flat_spec.lua (ctest does).
]]
local moe = require "moe"

local devices = { "cpu" }
if moe.cuda.is_available() then devices[#devices + 1] = "cuda" end

local function allocated(dev) return moe.memory_stats(dev).allocated end

-- Parameters and data of the model on dev.
local function model(dev)
  moe.manual_seed(7)
  local B, D, H = 16, 8, 32
  local o = { dtype = "f32", device = dev }
  local m = { B = B, dev = dev }
  m.x = moe.randn({ B, D }, o)
  m.y = moe.randn({ B, 1 }, o)
  if moe.matmul then
    m.w1 = moe.randn({ D, H }, o)
    m.b1 = moe.zeros({ H }, o)
    m.w2 = moe.randn({ H, 1 }, o)
    m.b2 = moe.zeros({ 1 }, o)
  else
    m.w1 = moe.randn({ 1, D }, o)
    m.b1 = moe.zeros({ D }, o)
    m.w2 = moe.randn({ 1, D }, o)
    m.b2 = moe.zeros({ 1 }, o)
  end
  m.params = { m.w1, m.b1, m.w2, m.b2 }
  for _, p in ipairs(m.params) do
    moe.no_grad(function()
      local s <close> = p * 0.3
      p:copy_(s)
    end)
    p.requires_grad = true
  end
  return m
end

-- One step; returns the loss as a number.
local function step(m, lr)
  local h <close> = moe.matmul and moe.matmul(m.x, m.w1) or m.x * m.w1
  local hb <close> = h + m.b1
  local h2 <close> = hb * hb
  local h3 <close> = h2 * 0.1
  local a <close> = h3 + hb -- a smooth activation: 0.1 z^2 + z
  local o1 <close> = moe.matmul and moe.matmul(a, m.w2) or a * m.w2
  local out <close> = o1 + m.b2
  local diff <close> = out - m.y
  local loss
  if moe.sum then
    local sq <close> = diff * diff
    local s <close> = moe.sum(sq)
    local l <close> = s / m.B
    l:backward()
    loss = l:item()
  else
    local g <close> = moe.no_grad(function() return diff * (2 / m.B) end)
    out:backward(g)
    loss = 0
    for _, row in ipairs(diff:totable()) do
      for _, v in ipairs(type(row) == "table" and row or { row }) do loss = loss + v * v / m.B end
    end
  end
  moe.no_grad(function()
    for _, p in ipairs(m.params) do
      local g <close> = p.grad
      local d <close> = g * lr
      local n <close> = p - d
      p:copy_(n)
    end
  end)
  moe.zero_grad(m.params)
  return loss
end

describe("training memory", function()
  for _, dev in ipairs(devices) do
    it("is flat over 200 steps on " .. dev, function()
      local m = model(dev)
      local first_loss = step(m, 0.01)
      local after1 = allocated(dev)
      local last_loss
      for i = 2, 200 do
        last_loss = step(m, 0.01)
        local now = allocated(dev)
        if now ~= after1 then
          error(("allocated memory after step %d is %d bytes, after step 1 it was %d"):format(i, now, after1))
        end
      end
      assert.is_true(last_loss < first_loss, ("the loss did not fall: %g -> %g"):format(first_loss, last_loss))
    end)

    it("returns the saved tensors at once when backward ends on " .. dev, function()
      local n = 1024
      local x = moe.randn({ n }, { device = dev, requires_grad = true })
      local w = moe.randn({ n }, { device = dev, requires_grad = true })
      local a = x * w -- saves x and w (no new memory)
      local b = a * a -- saves a
      a:free()        -- the user's handle goes; the graph still holds a
      local g = moe.ones({ n }, { device = dev })
      local before = allocated(dev)
      b:backward(g)
      -- a's storage (4n bytes) is gone; x.grad and w.grad (4n each) came
      assert.are.equal(before - 4 * n + 8 * n, allocated(dev))
      b:free()
      g:free()
      x.grad = nil
      w.grad = nil
      local base = allocated(dev)
      -- a graph nobody runs is freed with its last tensor
      local c = x * w
      local d = c * c
      c:free()
      d:free()
      assert.are.equal(base, allocated(dev))
      x:free()
      w:free()
    end)
  end
end)
