--[[
moe/cli/train.lua - `moe-lua train [key=value ...]`: trains a (d)MoE language
model with moe.train; every key of moe.train's config can be overridden
(`moe-lua train --help` lists them with their defaults).

  moe-lua train data=bible steps=500 model.moe.num_experts=16 out_dir=out/e16
  moe-lua train out_dir=out/e16 steps=1000 resume=latest     # continue a run
]]
local M = {
  summary = "train a (d)MoE language model (key=value overrides; --help lists the keys)",
  usage = "usage: moe-lua train [key=value ...]   (moe-lua train --help for every key)",
}

function M.main(...)
  local moe = require "moe"
  local train = require "moe.train"
  local cfg, rest = moe.config(train.defaults(), { ... })
  if #rest > 0 then
    io.stderr:write(("moe-lua train: unexpected argument '%s' (arguments are key=value)\n%s\n"):format(
      tostring(rest[1]), M.usage))
    return 1
  end
  train.run(cfg)
  return 0
end

return M
