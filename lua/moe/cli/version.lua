--[[
moe/cli/version.lua - `moe-lua version`: the same report as `moe-lua --version`
(moe-lua and Lua versions, whether CUDA is built in, CUDA runtime and driver,
cuBLAS and NCCL versions, and the GPUs this process sees).
]]
local M = { summary = "print versions, CUDA libraries and visible GPUs (same as --version)" }

function M.main()
  io.write(require("moe").version_report())
  return 0
end

return M
