--[[
tests/lua/read_file.lua - the specs' reader of a whole file: returns a
function that reads the file at path, bytes as they are, and fails the
spec naming the path when it cannot be opened.

  local read = dofile(spec_dir .. "/read_file.lua")
]]
return function(path)
  local f = assert(io.open(path, "rb"), "cannot open " .. path)
  local s = f:read("a")
  f:close()
  return s
end
