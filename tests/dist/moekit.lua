--[[
tests/dist/moekit.lua - what the MoE layer tests of several ranks share
(ep_layer.lua, wp_layer.lua): a router that bans experts per source rank,
the loss each rank takes, and the comparison against a single process.

  local M = dofile(arg[0]:match("^(.*/)") .. "moekit.lua")(T, E, TOL)
  M.Ban{...}            routers.TopK with a per-rank bias (router.ban_bias)
  M.ban_bias(banned)    -30 on the logits of the experts in banned (0-based)
  M.uneven(s)           source rank s bans experts (s + j) % E for j in {0, 1, 3}
  M.loss_of(layer, x, c, bans) -> sum(y * c) / numel + the layer's aux loss, y
  M.close(got, want, what) -> the largest relative difference (fails past TOL)
]]
local moe = require "moe"
local nn = require "moe.nn"
local routers = require "moe.routers"

return function(T, E, TOL)
  local M = {}

  -- The top-k router with a per-source-rank bias: -30 on the logits of the
  -- experts that rank's tokens may not pick (softmax weight ~1e-13).
  M.Ban = nn.class("BanRouter", routers.TopK)
  function M.Ban:logits(x)
    local l = routers.TopK.logits(self, x)
    local b = rawget(self, "ban_bias")
    if b then l = l + b:to(l.dtype) end
    return l
  end

  function M.ban_bias(banned)
    local v = {}
    for e = 1, E do v[e] = 0 end
    for _, e in ipairs(banned or {}) do v[e + 1] = -30 end
    return moe.keep(moe.tensor(v, { dtype = "f64" }))
  end

  function M.uneven(s) return { s % E, (s + 1) % E, (s + 3) % E } end

  function M.loss_of(layer, x, c, bans)
    layer.router.ban_bias = bans
    local y = layer(x)
    local l = (y * c):sum() * (1 / y:numel())
    local aux = rawget(layer, "aux_loss")
    layer.aux_loss = nil
    if aux then l = l + aux end
    return l, y
  end

  -- relative to max(1, |want|), element by element
  function M.close(got, want, what)
    local a, b = T.flat(got), T.flat(want)
    T.check(#a == #b, "%s: %d values, wanted %d", what, #a, #b)
    local worst = 0
    for i = 1, #a do
      local err = math.abs(a[i] - b[i]) / math.max(1, math.abs(b[i]))
      if err > worst then worst = err end
      if err > TOL then T.fail("%s: value %d is %.17g, wanted %.17g", what, i, a[i], b[i]) end
    end
    return worst
  end

  return M
end
