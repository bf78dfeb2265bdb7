--[[
moe/cli/help.lua - `moe-lua help [command]`: the host's options and the list
of commands with a one-line summary each (also `moe-lua --help`, `-h`, and
`moe-lua` alone on a terminal); `moe-lua help <command>` is the command's own
help (`moe-lua <command> --help`).

A command is a module moe.cli.<name> returning a table with main(...) (its
exit status: an integer, or false for 1), a one-line `summary` and a `usage`
text; main takes --help and -h. Add a new command by adding its file beside
this one and its name to `commands` below (tests/lua/cli_spec.lua checks that
every file there is listed and answers --help).
]]
local M = {
  summary = "show the options and the commands; help <command> shows the command's help",
  usage = "usage: moe-lua help [command]",
}

-- In the order they are listed.
M.commands = { "help", "version", "train", "sample", "plot", "preprocess", "launch", "export" }

local function load(name)
  if type(name) ~= "string" or not name:match("^[%a][%w_%-]*$") then return nil end
  local ok, cmd = pcall(require, "moe.cli." .. name)
  if ok and type(cmd) == "table" and type(cmd.main) == "function" then return cmd end
  return nil
end

function M.main(name, ...)
  if name == "--help" or name == "-h" then
    print(M.usage)
    print("Lists the commands; with a command's name, prints that command's help.")
    return 0
  end
  if select("#", ...) > 0 then
    error(("help: takes at most one command, got '%s' too (%s)"):format(tostring((...)), M.usage), 0)
  end
  if name then
    local cmd = load(name)
    if not cmd then
      error(("help: no command '%s' (moe-lua help lists them)"):format(name), 0)
    end
    print(("moe-lua %s: %s"):format(name, cmd.summary or "(no summary)"))
    if name == "help" then return M.main("--help") end
    if type(arg) == "table" then rawset(arg, 0, name) end
    return cmd.main("--help")
  end
  local host = package.loaded["moe.host"]
  io.write(host and host.usage or "usage: moe-lua [options] [script [args]]\n")
  print("Commands:")
  for _, c in ipairs(M.commands) do
    local cmd = load(c)
    print(("  %-10s %s"):format(c, cmd and cmd.summary or "(unavailable)"))
  end
  print("moe-lua <command> --help (or moe-lua help <command>) shows a command's options.")
  print("Run a script: moe-lua experiments/demo.lua [key=value ...]   (--help lists its keys)")
  print("Documentation: README.md and docs/ (docs/OPTIONS.md, docs/API.md, docs/ENVIRONMENT.md)")
  return 0
end

return M
