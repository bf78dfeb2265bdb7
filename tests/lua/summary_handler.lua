--[[
tests/lua/summary_handler.lua - a busted output handler: busted's usual
terminal output (utfTerminal on a terminal, plainTerminal otherwise), then a
last line "N passed, N failed" (", N skipped" when tests are pending), where
failed counts failures and errors. Loaded by tests/lua/busted.lua through
busted's --output option.
]]
return function(options)
  local busted = require "busted"
  local inner = require("busted.outputHandlers." .. options.defaultOutput)(options)

  local subscribe = inner.subscribe
  inner.subscribe = function(handler, opts)
    subscribe(handler, opts)
    busted.subscribe({ "exit" }, function()
      local failed = inner.failuresCount + inner.errorsCount
      local line = ("%d passed, %d failed"):format(inner.successesCount, failed)
      if inner.pendingsCount > 0 then line = line .. (", %d skipped"):format(inner.pendingsCount) end
      io.write(line, "\n")
      io.flush()
      return nil, true
    end)
  end
  return inner
end
