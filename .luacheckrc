-- luacheck over the Lua of the repository (a ctest test, lint/luacheck):
--   luacheck lua experiments bench tests
std = "lua54"
codes = true
max_line_length = false
exclude_files = { "build*/", "**/build*/" }
-- the specs run under busted; test code may keep arguments it shows for the API's sake
files["tests/"] = { std = "+busted", ignore = { "212" } }
