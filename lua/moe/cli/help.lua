--[[
moe/cli/help.lua - `moe-lua help`: usage, options and the list of commands.

A command is a module moe.cli.<name> returning a table with main(...) (its
exit status: an integer, or false for 1) and a one-line `summary`. Add a new
command by adding its file here and its name to `commands` below.
]]
local M = { summary = "show this help" }

-- In the order they are listed.
local commands = { "help", "version", "train", "sample", "plot", "preprocess", "launch", "export" }

function M.main(name)
  local host = package.loaded["moe.host"]
  if name then
    local ok, cmd = pcall(require, "moe.cli." .. name)
    if not ok or type(cmd) ~= "table" then
      io.stderr:write(("moe-lua help: no command '%s'\n"):format(name))
      return 1
    end
    print(("moe-lua %s: %s"):format(name, cmd.summary or "(no summary)"))
    if cmd.usage then print(cmd.usage) end
    return 0
  end
  io.write(host and host.usage or "usage: moe-lua [options] [script [args]]\n")
  print("Commands:")
  for _, c in ipairs(commands) do
    local ok, cmd = pcall(require, "moe.cli." .. c)
    print(("  %-10s %s"):format(c, ok and type(cmd) == "table" and cmd.summary or "(unavailable)"))
  end
  print("Run a script: moe-lua experiments/demo.lua [key=value ...]")
  return 0
end

return M
