--[[
moe/layers/moe.lua - layers.MoE: the capacity-factor MoE layer (MegaBlocks'
MoE; Switch, GShard): every expert takes at most C = ceil(capacity_factor *
T * top_k / num_experts) assignments (rounded up to block_size for impl
sparse) and the rest are dropped (their tokens get no contribution from that
expert; a token dropped by all of its experts gets zero, or only the shared
expert).

  layers.MoE{capacity_factor (moe_capacity_factor)=1, drop_policy="position"|"score",
    <every option of layers.dMoE>}

drop_policy "position" (MegaBlocks): earlier tokens win; "score": the
assignments with the highest router gates win. stats: expert_counts (E) i64
(routed, before dropping) and expert_kept (E) i64 (kept).
]]
local dmoe = require "moe.layers.dmoe"
local nn = require "moe.nn"

local M = {}

local MoE = nn.class("MoE", dmoe.dMoE)
M.MoE = MoE

function MoE:init(o)
  dmoe.dMoE.init(self, o, "layers.MoE", dmoe.DEFAULTS, 5)
  local cfg = self.cfg
  local a, b = cfg.moe_capacity_factor, cfg.capacity_factor
  if a ~= nil and b ~= nil and a ~= b then
    error(string.format("layers.MoE: moe_capacity_factor = %s and capacity_factor = %s disagree (give one)",
      tostring(a), tostring(b)), 3)
  end
  local cf = a or b or 1
  if type(cf) ~= "number" or cf <= 0 then
    error("layers.MoE: capacity_factor must be a number > 0, got " .. tostring(cf), 3)
  end
  if cfg.drop_policy ~= "position" and cfg.drop_policy ~= "score" then
    error("layers.MoE: drop_policy must be \"position\" or \"score\", got " .. tostring(cfg.drop_policy), 3)
  end
  if self.wp then
    error("layers.MoE: weight parallelism is for the dropless layer (layers.dMoE): a capacity over the "
      .. "group's gathered tokens would drop other tokens than each rank alone", 3)
  end
  self.capacity_factor, self.drop_policy = cf, cfg.drop_policy
end

function MoE:plan_opts(gates)
  local o = dmoe.dMoE.plan_opts(self, gates)
  o.capacity_factor = self.capacity_factor
  o.drop_policy = self.drop_policy
  if self.drop_policy == "score" then
    if gates == nil then
      error("layers.MoE: drop_policy \"score\" needs the router's gates (token-choice routing)", 4)
    end
    o.scores = gates:detach()
  end
  return o
end

function MoE:record(r, plan)
  local stats = dmoe.dMoE.record(self, r, plan)
  if r.kind == "token" then stats.expert_kept = plan.kept end
  return stats
end

function MoE:extra_repr()
  return dmoe.dMoE.extra_repr(self) .. string.format(", capacity_factor=%g, drop_policy=%s",
    self.capacity_factor, self.drop_policy)
end

return M
