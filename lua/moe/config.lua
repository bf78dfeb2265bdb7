--[[
moe/config.lua - an experiment's configuration: defaults written in the
script, overrides given as key=value on the command line. This is the one
documented way to override a config; it is exposed as moe.config.

  -- experiments/train.lua
  local moe = require "moe"
  local cfg = moe.config{
    steps = 100,                      -- integer
    lr = 3e-4,                        -- number
    device = "auto",                  -- string
    resume = false,                   -- boolean
    model = {                         -- a section: keys are model.experts, ...
      experts = 8,
      top_k = 2,
      hidden = { 512, 1024 },         -- a list of integers
    },
  }
  print(cfg.steps, cfg.model.experts)

  $ moe-lua experiments/train.lua steps=500 lr=1e-3 model.experts=16 model.hidden=256,256
  $ moe-lua experiments/train.lua --help      # every key with its default and type

moe.config(defaults [, argv]) -> cfg, rest
moe.config(defaults, overrides [, name]) -> cfg, {}
  defaults  a table. Its leaves are numbers, strings, booleans or lists
            (sequences of those); a nested table with string keys is a
            section, and its keys are addressed with dots (model.experts).
  argv      the arguments to read; by default the script's command-line
            arguments arg[1], arg[2], ... (the global `arg` set by moe-lua).
  cfg       a deep copy of defaults with every override applied.
  rest      the arguments that are not overrides, in order (positional
            arguments and flags, left for the script).
  overrides instead of argv, a table of values keyed like defaults
            ({steps = 5, model = {experts = 4}}): merged over a copy of
            defaults with the same key checks, values taken as they are
            (type-checked against the default's type: an integer key takes
            a whole number). Errors are prefixed with name (default
            "moe.config"): "train: unknown config key 'stepz' (valid keys:
            ...)". A table with any non-integer key is overrides; a sequence
            is argv.

Rules
  - `key=value`, where key is an ASCII name or a dotted name, is an
    override. The last override of a key wins.
  - An argument that looks like a mistaken override is an error naming it
    (no traceback): a flag (--steps=3, -v), an argument with '=' whose key
    is not such a name ("ste ps=1", a non-ASCII name, "=1" left by a shell
    that split "steps =1"), or the bare name of a key ("steps" of "steps 3").
    Any other argument (a word such as "run", a path) is left alone and
    returned in rest, for the script to take or refuse.
  - The key must exist in defaults, else an error names the nearest valid
    keys (edit distance: "did you mean 'steps'?") and lists them all.
  - The value is parsed against the type of the default:
      integer  1000, 1e3, 0x10 (must be a whole number)
      number   3e-4, 0.5, 2
      boolean  true or false
      string   taken as is (key= gives the empty string)
      list     a,b,c or [a,b,c] (each element parsed against the type of the
               default's first element; [] is the empty list)
    A value that does not parse raises an error naming the key, the expected
    type and the value.
  - --help (or -h) prints every key with its default, its type and its
    description, one per line ("key = default  (type)  description"), and
    exits with status 0 (closing the Lua state, so finalizers run). The
    descriptions come from the `help` field of the defaults' metatable, a
    table of dotted key -> text:
      setmetatable(defaults, { help = { steps = "optimizer steps" } })
    (moe.train.defaults() carries one for every key; a script that adds its
    own keys may add their descriptions to getmetatable(defaults).help.)
]]

local M = {}

local malformed -- defined below

local function is_list(t)
  local n = #t
  local count = 0
  for _ in pairs(t) do count = count + 1 end
  return count == n
end

-- The kind of a default value: "integer", "number", "boolean", "string",
-- "list", "section" or another Lua type name (not settable).
local function kind_of(v)
  local ty = type(v)
  if ty == "number" then return math.type(v) == "integer" and "integer" or "number" end
  if ty == "table" then return is_list(v) and "list" or "section" end
  return ty
end

local function deep_copy(v, seen)
  if type(v) ~= "table" then return v end
  seen = seen or {}
  if seen[v] then return seen[v] end
  local c = {}
  seen[v] = c
  for k, x in pairs(v) do c[deep_copy(k, seen)] = deep_copy(x, seen) end
  return setmetatable(c, getmetatable(v))
end

-- Every settable key, dotted, sorted; with its default.
local function collect_keys(t, prefix, out)
  for k, v in pairs(t) do
    if type(k) == "string" then
      local key = prefix .. k
      if kind_of(v) == "section" then
        collect_keys(v, key .. ".", out)
      else
        out[#out + 1] = { key = key, value = v }
      end
    end
  end
  return out
end

local function sorted_keys(defaults)
  local keys = collect_keys(defaults, "", {})
  table.sort(keys, function(a, b) return a.key < b.key end)
  return keys
end

local function key_list(defaults, prefix)
  local names = {}
  for _, e in ipairs(sorted_keys(defaults)) do names[#names + 1] = (prefix or "") .. e.key end
  return table.concat(names, ", ")
end

-- Levenshtein distance between two strings (bytes).
local function distance(a, b)
  local prev = {}
  for j = 0, #b do prev[j] = j end
  for i = 1, #a do
    local cur = { [0] = i }
    for j = 1, #b do
      local cost = a:byte(i) == b:byte(j) and 0 or 1
      cur[j] = math.min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
    end
    prev = cur
  end
  return prev[#b]
end

-- The valid keys nearest to an unknown one (at most 3): by edit distance to
-- the whole dotted key or to its last part (model.d_modl -> model.d_model,
-- experts -> model.experts), within a third of the key's length (at least 2).
-- A distance is at least the difference of the lengths: one beyond the limit
-- is not computed (a 100 kB argument would take minutes).
local function nearest(defaults, key)
  local last = key:match("([^.]*)$")
  local limit = math.max(2, #key // 3)
  local function near(a, b) return math.abs(#a - #b) <= limit and distance(a, b) or math.huge end
  local best, found = math.huge, {}
  for _, e in ipairs(sorted_keys(defaults)) do
    local d = math.min(near(key, e.key), near(last, e.key:match("([^.]*)$")) + 0.5)
    if d < best then best, found = d, { e.key }
    elseif d == best and #found < 3 then found[#found + 1] = e.key end
  end
  if best > limit then return {} end
  return found
end

-- "unknown key 'stepz' (did you mean 'steps'? valid keys: ...)"
local function unknown_key(defaults, key, what)
  local near = nearest(defaults, key)
  local hint = ""
  if #near > 0 then hint = ("did you mean '%s'? "):format(table.concat(near, "' or '")) end
  return ("unknown %s '%s' (%svalid keys: %s)"):format(what or "key", key, hint, key_list(defaults))
end

local article = { integer = "an integer", number = "a number", boolean = "a boolean", string = "a string" }

-- Parses one scalar against a kind; returns the value or nil.
local function parse_scalar(kind, s)
  if kind == "string" then return s end
  if kind == "boolean" then
    if s == "true" then return true elseif s == "false" then return false end
    return nil
  end
  local n = tonumber(s)
  if n == nil then return nil end
  if kind == "integer" then return math.tointeger(n) end
  if kind == "number" then return n + 0.0 end
  return nil
end

-- The kind of a list's elements: from its first element, or guessed from
-- the text when the default list is empty.
local function element_kind(default, text)
  if #default > 0 then return kind_of(default[1]) end
  if math.tointeger(tonumber(text)) then return "integer" end
  if tonumber(text) then return "number" end
  if text == "true" or text == "false" then return "boolean" end
  return "string"
end

local function trim(s) return (s:gsub("^%s+", ""):gsub("%s+$", "")) end

-- Parses `text` for the key whose default is `default`; returns the value,
-- or nil and an error message.
local function parse_value(key, default, text)
  local kind = kind_of(default)
  if kind == "list" then
    local body = trim(text)
    body = body:match("^%[(.*)%]$") or body
    local list = {}
    if trim(body) == "" then return list end
    local ekind
    for item in (body .. ","):gmatch("([^,]*),") do
      item = trim(item)
      ekind = ekind or element_kind(default, item)
      local v = parse_scalar(ekind, item)
      if v == nil then
        return nil, ("%s expects a list of %s values (a,b,c or [a,b,c]), got '%s' (bad element '%s')"):format(
          key, ekind, text, item)
      end
      list[#list + 1] = v
    end
    return list
  end
  if article[kind] == nil then
    return nil, ("%s has a default of type %s, which cannot be set from the command line"):format(key, kind)
  end
  local v = parse_scalar(kind, text)
  if v == nil then
    return nil, ("%s expects %s, got '%s'"):format(key, article[kind], text)
  end
  return v
end

-- Finds the table holding `key` (dotted) in cfg; returns it and the last
-- name, or nil and an error message.
local function locate(cfg, defaults, key)
  local t, d = cfg, defaults
  local parts = {}
  for part in key:gmatch("[^.]+") do parts[#parts + 1] = part end
  for i = 1, #parts - 1 do
    local p = parts[i]
    if type(d[p]) ~= "table" or kind_of(d[p]) ~= "section" then
      return nil, unknown_key(defaults, key)
    end
    t, d = t[p], d[p]
  end
  local last = parts[#parts]
  if d[last] == nil then
    return nil, unknown_key(defaults, key)
  end
  if kind_of(d[last]) == "section" then
    return nil, ("'%s' is a section, not a value; set one of its keys: %s"):format(
      key, key_list(d[last], key .. "."))
  end
  return t, last, d[last]
end

local function show(v)
  if type(v) == "table" then
    local items = {}
    for i, x in ipairs(v) do items[i] = tostring(x) end
    return #items == 0 and "[]" or table.concat(items, ",")
  end
  return tostring(v)
end

local function type_label(v)
  local kind = kind_of(v)
  if kind == "list" then return #v > 0 and ("list of " .. kind_of(v[1])) or "list" end
  return kind
end

-- The descriptions of the keys: the `help` table of defaults' metatable,
-- dotted key -> text (moe.train's defaults carry one); {} when none.
local function descriptions(defaults)
  local mt = getmetatable(defaults)
  local help = type(mt) == "table" and rawget(mt, "help")
  return type(help) == "table" and help or {}
end

local function print_help(defaults)
  local script = (type(arg) == "table" and arg[0]) or "script.lua"
  local help = descriptions(defaults)
  local lines, width, twidth = {}, 0, 0
  for _, e in ipairs(sorted_keys(defaults)) do
    local left, ty = e.key .. " = " .. show(e.value), "(" .. type_label(e.value) .. ")"
    width, twidth = math.max(width, #left), math.max(twidth, #ty)
    lines[#lines + 1] = { left, ty, help[e.key] }
  end
  io.write(("usage: moe-lua %s [key=value ...]\n"):format(script))
  io.write("keys (key = default  (type)  description):\n")
  for _, l in ipairs(lines) do
    local text = ("  %-" .. width .. "s  %-" .. twidth .. "s  %s"):format(l[1], l[2], l[3] or "")
    io.write((text:gsub("%s+$", "")), "\n")
  end
  io.flush()
end

-- Merges the table `over` into cfg (a copy of defaults) at one level of
-- sections; root is the whole defaults table, for the list of valid keys.
local function merge(cfg, defaults, over, prefix, root, name)
  for k, v in pairs(over) do
    local key = prefix .. tostring(k)
    local d = nil
    if type(k) == "string" then d = defaults[k] end
    if d == nil then
      error(("%s: %s"):format(name, unknown_key(root, key, "config key")), 0)
    end
    local kind = kind_of(d)
    if kind == "section" then
      if type(v) ~= "table" then
        error(("%s: config key '%s' is a section, got a %s"):format(name, key, type(v)), 0)
      end
      merge(cfg[k], d, v, key .. ".", root, name)
    else
      if type(v) ~= type(d) then
        error(("%s: config key '%s' expects a %s, got a %s (%s)"):format(name, key, type(d), type(v),
          tostring(v)), 0)
      end
      if kind == "integer" and math.type(v) ~= "integer" then
        local i = math.tointeger(v)
        if i == nil then
          error(("%s: config key '%s' expects an integer, got %s"):format(name, key, tostring(v)), 0)
        end
        v = i
      end
      cfg[k] = deep_copy(v)
    end
  end
end

-- Whether argv[i], which is not key=value, is a mistaken override rather than
-- a positional argument for the script: a flag (--steps=3, -n), an '=' with
-- no key or a key that is not a plain ASCII name ("steps =1" split by the
-- shell, "ste ps=1", a non-ASCII name), or a bare name of a key ("steps" of
-- "steps 3"). Returns the message, or nil.
malformed = function(defaults, argv, i)
  local a = tostring(argv[i])
  local hint = "overrides are key=value, one argument each, with no spaces around '='"
  local flag = a:match("^%-%-?([%a_][%w_%-%.]*=.*)$")
  if flag then
    return ("bad argument '%s': %s (write %s)"):format(a, hint, flag)
  end
  if a:match("^%-.") then -- "-" alone (stdin, by convention) is a positional argument
    return ("bad argument '%s': flags are not taken; %s (--help lists the keys)"):format(a, hint)
  end
  if a:match("^=") then
    local prev = argv[i - 1] and tostring(argv[i - 1])
    if prev and prev:match("^[%a_][%w_%-%.]*$") then
      return ("bad arguments '%s' '%s': %s (write %s%s)"):format(prev, a, hint, prev, a)
    end
    return ("bad argument '%s': no key before '='; %s"):format(a, hint)
  end
  local k = a:match("^([^=]*)=")
  if k then
    return ("bad argument '%s': '%s' is not a key (keys are ASCII names and dotted names such as " ..
      "model.experts); %s"):format(a, k, hint)
  end
  local t, _, default = locate(deep_copy(defaults), defaults, a)
  if a:match("^[%a_][%w_%-%.]*$") and t ~= nil then
    return ("bad argument '%s': a key with no value; write %s=%s"):format(a, a,
      argv[i + 1] and tostring(argv[i + 1]):gsub("^=", "") or show(default))
  end
  return nil
end

local function is_overrides(t)
  for k in pairs(t) do
    if math.type(k) ~= "integer" then return true end
  end
  return false
end

--- moe.config(defaults [, argv]) -> cfg, rest (see the header of this file).
function M.config(defaults, argv, name)
  if type(defaults) ~= "table" then
    error(("bad argument #1 to 'config' (table of defaults expected, got %s)"):format(type(defaults)), 2)
  end
  if type(argv) == "table" and is_overrides(argv) then
    if name ~= nil and type(name) ~= "string" then
      error(("bad argument #3 to 'config' (string expected, got %s)"):format(type(name)), 2)
    end
    local cfg = deep_copy(defaults)
    merge(cfg, defaults, argv, "", defaults, name or "moe.config")
    return cfg, {}
  end
  if argv == nil then
    argv = {}
    if type(arg) == "table" then
      for i = 1, #arg do argv[i] = arg[i] end
    end
  elseif type(argv) ~= "table" then
    error(("bad argument #2 to 'config' (table of arguments expected, got %s)"):format(type(argv)), 2)
  end

  for _, a in ipairs(argv) do
    if a == "--help" or a == "-h" then
      print_help(defaults)
      os.exit(0, true)
    end
  end

  local cfg = deep_copy(defaults)
  local rest = {}
  for i, a in ipairs(argv) do
    a = tostring(a)
    local key, text = a:match("^([%a_][%w_%-%.]*)=(.*)$")
    if key == nil then
      -- level 0: a message for the user, printed by moe-lua without a traceback
      local bad = malformed(defaults, argv, i)
      if bad then error("moe.config: " .. bad, 0) end
      rest[#rest + 1] = a
    else
      local t, field, default = locate(cfg, defaults, key)
      if t == nil then error("moe.config: " .. field, 0) end
      local v, err = parse_value(key, default, text)
      if v == nil then
        if text == "" and argv[i + 1] ~= nil then
          err = err .. (" (a space after '='? write %s=<value> as one argument)"):format(key)
        end
        error("moe.config: " .. err, 0)
      end
      t[field] = v
    end
  end
  return cfg, rest
end

return M.config
