--[[
moe/cli/version.lua - `moe-lua version`: the same report as `moe-lua --version`
(moe-lua and Lua versions, whether CUDA is built in, CUDA runtime and driver,
cuBLAS and NCCL versions, and the GPUs this process sees).
]]
local M = {
  summary = "print versions, CUDA libraries and visible GPUs (same as --version)",
  usage = "usage: moe-lua version",
}

function M.main(a)
  if a == "--help" or a == "-h" then
    print(M.usage)
    print("Prints moe-lua's and Lua's versions, whether CUDA is built in, the CUDA runtime,")
    print("driver, cuBLAS and NCCL versions, and the GPUs this process sees.")
    return 0
  end
  if a ~= nil then
    error(("version: takes no arguments, got '%s'"):format(tostring(a)), 0)
  end
  io.write(require("moe").version_report())
  return 0
end

return M
