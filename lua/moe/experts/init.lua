--[[
moe/experts/init.lua - `local experts = require "moe.experts"`: expert
modules over a routing plan (the E experts' weights stacked in one tensor
per linear, applied with moe.ops.parallel_linear / moe.ops.glu_experts).

  experts.MLP{num_experts=, d_model=, d_ff=, activation="gelu", impl="grouped", ...}
      w1 (E, d, f), w2 (E, f, d): y = act(x W1_e) W2_e
  experts.GLU{..., activation="silu", memory_optimized=false}
      w1, w3 (E, d, f), w2 (E, f, d): y = (act(x W1_e) * x W3_e) W2_e
  experts.Shared{d_model=, d_ff=, mlp_type="mlp"|"glu", activation=, ...}
      a dense MLP or GLU applied to every token (MegaBlocks' shared_expert)

Routed experts are called as experts(x (T, d), plan, gates (T, k) or nil)
-> (T, d): the gate-weighted sum over each token's kept assignments.
docs/LAYERS.md says how to write a new expert type.
]]
local experts = {}

local mlp = require "moe.experts.mlp"
experts.Experts = mlp.Experts
experts.MLP = mlp.MLP
experts.GLU = mlp.GLU
experts.Shared = require("moe.experts.shared").Shared
experts.util = require "moe.experts.util"

return experts
