--[[
tests/lua/busted.lua - runs busted specs inside moe-lua, so that they test the
host and the `moe` module compiled into it (ASan build included):

  moe-lua tests/lua/busted.lua tests/lua/tensor_spec.lua [busted options]

This is what ctest runs for each tests/lua/*_spec.lua (tests/CMakeLists.txt),
from the repository root. Busted (Debian's lua-busted, in /usr/share/lua/5.4)
prints its usual output; summary_handler.lua then ends the run with one line

  N passed, N failed[, N skipped]

(failed counts failures and errors). The exit status is 0 when nothing failed
and 1 otherwise.
]]
local dir = (arg and arg[0] or ""):match("^(.*)/[^/]*$") or "."

-- Busted reads its options from the global `arg`: put our output handler
-- first, in front of the spec files and options given on the command line.
table.insert(arg, 1, "--output=" .. dir .. "/summary_handler.lua")

require("busted.runner")({ standalone = false })
