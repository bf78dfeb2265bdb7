--[[
moe/metrics.lua - what a training run reports: a small JSON encoder/decoder,
metrics.jsonl (one object per log step), the Megatron-style console line,
MFU from a table of peak FLOP/s by device name, expert load balance, and a
progress bar with ETA when stdout is a terminal.

  local metrics = require "moe.metrics"
  local log = metrics.jsonl("out/metrics.jsonl")   -- appends
  log:write{step = 10, loss = 2.5}; log:close()
  print(metrics.console_line{iteration = 10, iterations = 100, lr = 3e-4, loss = 2.5, ...})
  metrics.json.encode(v), metrics.json.decode(s)

JSON: integers are written as integers (exact 64-bit round trip), floats with
17 significant digits (exact round trip). JSON has no NaN or infinity: NaN is
written as null, +inf and -inf as 1e999 and -1e999 (valid JSON numbers that
overflow to infinity in every reader: Lua, Python's json, JavaScript). Tables
with keys 1..n are arrays, others objects with sorted keys; json.null writes
null.
Reading, null becomes json.decode's second argument when one is given (read_jsonl
gives NaN: a metrics record holds null only where a number was NaN, since a
Lua table cannot hold nil); without one, json.null in an array, so that
[1,null,3] keeps three elements and its positions and writes back the same,
and nothing in an object ({"a":null} reads as {}: t.a == nil). The reader also
takes NaN, Infinity and -Infinity, which Python's json writes.
]]
local M = {}

------------------------------------------------------------------ JSON

local json = {}
M.json = json

local escapes = { ['"'] = '\\"', ["\\"] = "\\\\", ["\b"] = "\\b", ["\f"] = "\\f",
  ["\n"] = "\\n", ["\r"] = "\\r", ["\t"] = "\\t" }

local function encode_string(s)
  return '"' .. s:gsub('[%c"\\]', function(c)
    return escapes[c] or ("\\u%04x"):format(c:byte())
  end) .. '"'
end

local function is_array(t)
  local n = #t
  local count = 0
  for k in pairs(t) do
    if math.type(k) ~= "integer" or k < 1 or k > n then return false end
    count = count + 1
  end
  return count == n
end

--- json.null: JSON's null where Lua needs a value (an array's element): encodes as
--- null; json.decode returns it for null in arrays.
json.null = setmetatable({}, {
  __tostring = function() return "json.null" end,
  __newindex = function() error("json.null is read-only", 2) end,
  __metatable = "json.null",
})

local function encode(v, out, seen)
  local ty = type(v)
  if ty == "nil" or v == json.null then out[#out + 1] = "null"
  elseif ty == "boolean" then out[#out + 1] = tostring(v)
  elseif ty == "number" then
    if math.type(v) == "integer" then out[#out + 1] = ("%d"):format(v)
    elseif v ~= v then out[#out + 1] = "null"
    elseif v == math.huge then out[#out + 1] = "1e999"
    elseif v == -math.huge then out[#out + 1] = "-1e999"
    else
      local s = ("%.17g"):format(v)
      if not s:find("[%.eE]") then s = s .. ".0" end -- stays a float on decode
      out[#out + 1] = s
    end
  elseif ty == "string" then out[#out + 1] = encode_string(v)
  elseif ty == "table" then
    if seen[v] then error("json.encode: a table holds itself", 0) end
    seen[v] = true
    if next(v) ~= nil and is_array(v) then
      out[#out + 1] = "["
      for i = 1, #v do
        if i > 1 then out[#out + 1] = "," end
        encode(v[i], out, seen)
      end
      out[#out + 1] = "]"
    elseif next(v) == nil and getmetatable(v) == json.array_mt then
      out[#out + 1] = "[]"
    else
      local keys = {}
      for k in pairs(v) do
        if type(k) ~= "string" then
          error(("json.encode: object keys must be strings, got a %s key"):format(type(k)), 0)
        end
        keys[#keys + 1] = k
      end
      table.sort(keys)
      out[#out + 1] = "{"
      for i, k in ipairs(keys) do
        if i > 1 then out[#out + 1] = "," end
        out[#out + 1] = encode_string(k)
        out[#out + 1] = ":"
        encode(v[k], out, seen)
      end
      out[#out + 1] = "}"
    end
    seen[v] = nil
  else
    error(("json.encode: cannot encode a %s"):format(ty), 0)
  end
end

--- json.array_mt: set it on an empty table to encode it as [] rather than {}.
json.array_mt = {}

--- json.encode(v) -> string; raises "json.encode: ..." for functions, userdata, cycles.
function json.encode(v)
  local out = {}
  encode(v, out, {})
  return table.concat(out)
end

local function decode_error(pos, what)
  error(("json.decode: %s at character %d"):format(what, pos), 0)
end

local function skip_ws(s, pos) return s:find("[^ \t\r\n]", pos) or #s + 1 end

local decode_value
local NULL_MARK = {} -- what decode_value returns for null; its container decides

local function decode_string(s, pos)
  local out = {}
  local i = pos + 1
  while true do
    local c = s:sub(i, i)
    if c == "" then decode_error(pos, "unterminated string") end
    if c == '"' then return table.concat(out), i + 1 end
    if c == "\\" then
      local e = s:sub(i + 1, i + 1)
      local map = { ['"'] = '"', ["\\"] = "\\", ["/"] = "/", b = "\b", f = "\f", n = "\n", r = "\r", t = "\t" }
      if map[e] then out[#out + 1] = map[e]; i = i + 2
      elseif e == "u" then
        local hex = s:sub(i + 2, i + 5)
        local cp = hex:match("^%x%x%x%x$") and tonumber(hex, 16)
        if not cp then decode_error(i, "bad \\u escape") end
        i = i + 6
        if cp >= 0xD800 and cp <= 0xDBFF and s:sub(i, i + 1) == "\\u" then
          local lo = tonumber(s:sub(i + 2, i + 5), 16)
          if lo and lo >= 0xDC00 and lo <= 0xDFFF then
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00)
            i = i + 6
          end
        end
        out[#out + 1] = utf8.char(cp)
      else decode_error(i, "bad escape") end
    else
      out[#out + 1] = c
      i = i + 1
    end
  end
end

-- null: the value of JSON's null in arrays (json.null by default) and in objects
-- (nil by default: no member). Lists and objects nest at most MAX_DEPTH deep (a
-- deeper text would overflow Lua's stack).
local MAX_DEPTH = 1000

function decode_value(s, pos, null_arr, null_obj, depth)
  pos = skip_ws(s, pos)
  local c = s:sub(pos, pos)
  if (c == "{" or c == "[") and depth >= MAX_DEPTH then
    decode_error(pos, ("nesting deeper than %d levels"):format(MAX_DEPTH))
  end
  if c == "{" then
    local obj = {}
    pos = skip_ws(s, pos + 1)
    if s:sub(pos, pos) == "}" then return obj, pos + 1 end
    while true do
      if s:sub(pos, pos) ~= '"' then decode_error(pos, "object key expected") end
      local k
      k, pos = decode_string(s, pos)
      pos = skip_ws(s, pos)
      if s:sub(pos, pos) ~= ":" then decode_error(pos, "':' expected") end
      local v
      v, pos = decode_value(s, pos + 1, null_arr, null_obj, depth + 1)
      if v == NULL_MARK then v = null_obj end
      obj[k] = v
      pos = skip_ws(s, pos)
      local d = s:sub(pos, pos)
      if d == "}" then return obj, pos + 1 end
      if d ~= "," then decode_error(pos, "',' or '}' expected") end
      pos = skip_ws(s, pos + 1)
    end
  elseif c == "[" then
    local arr, n = setmetatable({}, json.array_mt), 0
    pos = skip_ws(s, pos + 1)
    if s:sub(pos, pos) == "]" then return arr, pos + 1 end
    while true do
      local v
      v, pos = decode_value(s, pos, null_arr, null_obj, depth + 1)
      if v == NULL_MARK then v = null_arr end
      n = n + 1
      arr[n] = v
      pos = skip_ws(s, pos)
      local d = s:sub(pos, pos)
      if d == "]" then return arr, pos + 1 end
      if d ~= "," then decode_error(pos, "',' or ']' expected") end
      pos = pos + 1
    end
  elseif c == '"' then
    return decode_string(s, pos)
  elseif s:sub(pos, pos + 3) == "true" then return true, pos + 4
  elseif s:sub(pos, pos + 4) == "false" then return false, pos + 5
  elseif s:sub(pos, pos + 3) == "null" then return NULL_MARK, pos + 4
  elseif s:sub(pos, pos + 2) == "NaN" then return 0 / 0, pos + 3
  elseif s:sub(pos, pos + 7) == "Infinity" then return math.huge, pos + 8
  elseif s:sub(pos, pos + 8) == "-Infinity" then return -math.huge, pos + 9
  else
    local num = s:match("^-?%d+%.?%d*[eE]?[-+]?%d*", pos)
    if not num or num == "" or num == "-" then decode_error(pos, "unexpected character '" .. c .. "'") end
    local v
    if num:find("[%.eE]") then v = tonumber(num) else v = math.tointeger(tonumber(num)) or tonumber(num) end
    if v == nil then decode_error(pos, "bad number '" .. num .. "'") end
    return v, pos + #num
  end
end

--- json.decode(s [, null]) -> value; raises "json.decode: <what> at character <n>".
--- JSON null becomes null when given (not nil), everywhere; otherwise json.null in an
--- array (it keeps its length) and no member in an object. A top-level null is nil.
function json.decode(s, null)
  if type(s) ~= "string" then error("json.decode: string expected, got " .. type(s), 2) end
  local null_arr, null_obj = json.null, nil
  if null ~= nil then null_arr, null_obj = null, null end
  local v, pos = decode_value(s, 1, null_arr, null_obj, 0)
  pos = skip_ws(s, pos)
  if pos <= #s then decode_error(pos, "trailing characters") end
  if v == NULL_MARK then v = null_obj end
  return v
end

------------------------------------------------------------------ JSONL

local Jsonl = {}
Jsonl.__index = Jsonl

--- jsonl(path [, mode="a"]) -> a writer of one JSON object per line.
function M.jsonl(path, mode)
  local f, err = io.open(path, mode or "a")
  if not f then error(("metrics.jsonl: cannot open '%s': %s"):format(path, err), 2) end
  return setmetatable({ path = path, file = f }, Jsonl)
end

function Jsonl:write(obj)
  self.file:write(json.encode(obj), "\n")
  self.file:flush()
end

function Jsonl:close()
  if self.file then self.file:close(); self.file = nil end
end

--- truncate_jsonl(path, step) -> how many records it dropped: the records of a JSONL
--- file whose step is > step (what a run resumed from step redoes), and lines that do
--- not parse (the half-written last line of a killed run). The file is rewritten
--- through path.tmp and a rename; kept lines are copied byte for byte. A missing
--- file is left missing (0).
function M.truncate_jsonl(path, step)
  local f = io.open(path, "rb")
  if not f then return 0 end
  local kept, dropped = {}, 0
  for line in f:lines() do
    if line:find("%S") then
      local ok, v = pcall(json.decode, line)
      if ok and type(v) == "table" and not (math.type(v.step) and v.step > step) then
        kept[#kept + 1] = line
      else
        dropped = dropped + 1
      end
    end
  end
  f:close()
  if dropped == 0 then return 0 end
  local tmp = path .. ".tmp"
  local out, err = io.open(tmp, "wb")
  if not out then error(("metrics.truncate_jsonl: cannot open '%s': %s"):format(tmp, err), 2) end
  local ok, werr = true, nil
  if #kept > 0 then ok, werr = out:write(table.concat(kept, "\n"), "\n") end
  local cok, cerr = out:close()
  if not ok or not cok then
    os.remove(tmp)
    error(("metrics.truncate_jsonl: cannot write '%s': %s"):format(tmp, tostring(werr or cerr)), 2)
  end
  local rok, rerr = os.rename(tmp, path)
  if not rok then
    os.remove(tmp)
    error(("metrics.truncate_jsonl: cannot rename '%s' to '%s': %s"):format(tmp, path, rerr), 2)
  end
  return dropped
end

--- read_jsonl(path) -> array of the objects of a JSONL file (blank lines skipped);
--- null reads as NaN (what the writer wrote for NaN), so a NaN loss comes back NaN.
function M.read_jsonl(path)
  local f, err = io.open(path, "r")
  if not f then error(("metrics.read_jsonl: cannot open '%s': %s"):format(path, err), 2) end
  local out, n = {}, 0
  for line in f:lines() do
    n = n + 1
    if line:find("%S") then
      local ok, v = pcall(json.decode, line, 0 / 0)
      if not ok then f:close(); error(("metrics.read_jsonl: %s line %d: %s"):format(path, n, v), 2) end
      out[#out + 1] = v
    end
  end
  f:close()
  return out
end

------------------------------------------------------------------ MFU, balance

-- Peak dense FLOP/s by a pattern of the device name, per compute dtype
-- (bf16 tensor cores; f32 = TF32 tensor cores when TF32 matmuls are on, plain FP32 otherwise).
M.peak_flops = {
  { pattern = "H100", bf16 = 989e12, tf32 = 494.5e12, f32 = 67e12 },
  { pattern = "H200", bf16 = 989e12, tf32 = 494.5e12, f32 = 67e12 },
  { pattern = "A100", bf16 = 312e12, tf32 = 156e12, f32 = 19.5e12 },
}

--- peak_flops_for(device_name, dtype [, tf32]) -> FLOP/s or nil (unknown device, CPU).
function M.peak_flops_for(name, dtype, tf32)
  if type(name) ~= "string" then return nil end
  for _, e in ipairs(M.peak_flops) do
    if name:find(e.pattern, 1, true) then
      if dtype == "bf16" or dtype == "f16" then return e.bf16 end
      return tf32 and e.tf32 or e.f32
    end
  end
  return nil
end

--- EXPERT_LINES_MAX: up to this many experts a layer's load is shown one line per expert
--- (TensorBoard scalars, `moe-lua plot`); above it, as a heatmap (plot) or a histogram per
--- step (TensorBoard), with max/mean beside.
M.EXPERT_LINES_MAX = 16

--- load_balance(counts) -> max/mean of a list of per-expert counts (1 = perfectly
--- balanced), nil when empty or all zero.
function M.load_balance(counts)
  local n, sum, max = #counts, 0, 0
  for _, c in ipairs(counts) do sum = sum + c; if c > max then max = c end end
  if n == 0 or sum == 0 then return nil end
  return max / (sum / n)
end

------------------------------------------------------------------ console

local function fmt_duration(s)
  if s == nil or s ~= s or s == math.huge then return "?" end
  s = math.floor(s + 0.5)
  if s >= 3600 then return ("%dh%02dm"):format(s // 3600, (s % 3600) // 60) end
  if s >= 60 then return ("%dm%02ds"):format(s // 60, s % 60) end
  return ("%ds"):format(s)
end
M.fmt_duration = fmt_duration

--- console_line(m) -> Megatron's log line. m: iteration, iterations, consumed_tokens,
--- ms_per_iter, lr, loss, grad_norm, tokens_per_s, mfu (fraction or nil), load_balance
--- (or nil), aux_loss (or nil), extra (string or nil). Fields that are nil are left out.
function M.console_line(m)
  local w = #tostring(m.iterations or m.iteration)
  local parts = { (" iteration %" .. w .. "d/%" .. w .. "d"):format(m.iteration, m.iterations or m.iteration) }
  local function add(s) parts[#parts + 1] = s end
  if m.consumed_tokens then add(("consumed tokens: %d"):format(m.consumed_tokens)) end
  if m.ms_per_iter then add(("elapsed time per iteration (ms): %.1f"):format(m.ms_per_iter)) end
  if m.lr then add(("learning rate: %.3E"):format(m.lr)) end
  if m.loss then add(("lm loss: %.6E"):format(m.loss)) end
  if m.aux_loss and m.aux_loss ~= 0 then add(("aux loss: %.4E"):format(m.aux_loss)) end
  if m.grad_norm then add(("grad norm: %.3f"):format(m.grad_norm)) end
  if m.tokens_per_s then add(("tokens/s: %.0f"):format(m.tokens_per_s)) end
  if m.mfu then add(("MFU: %.1f%%"):format(100 * m.mfu)) end
  if m.load_balance then add(("expert load max/mean: %.3f"):format(m.load_balance)) end
  if m.extra then add(m.extra) end
  return table.concat(parts, " | ") .. " |"
end

--- is_terminal() -> true when stdout is a terminal (checked once, via `test -t 1`).
local tty
function M.is_terminal()
  if tty == nil then
    tty = os.getenv("MOE_NO_PROGRESS") == nil and os.execute("test -t 1") == true
  end
  return tty
end

--- progress(done, total, elapsed_s [, width=30]) -> "[#####.....] 50% 5/10 ETA 1m02s".
function M.progress(done, total, elapsed, width)
  width = width or 30
  local frac = total > 0 and math.min(done / total, 1) or 1
  local fill = math.floor(frac * width + 0.5)
  local eta = done > 0 and elapsed / done * (total - done) or nil
  return ("[%s%s] %3d%% %d/%d ETA %s"):format(("#"):rep(fill), ("."):rep(width - fill),
    math.floor(frac * 100), done, total, fmt_duration(eta))
end

--- A console: print(line) clears a drawn bar first; bar(done, total, elapsed) redraws it
--- (only on a terminal).
function M.console(out)
  out = out or io.stdout
  local c = { drawn = false }
  function c.print(line)
    if c.drawn then out:write("\r\27[K"); c.drawn = false end
    out:write(line, "\n")
    out:flush()
  end
  function c.bar(done, total, elapsed)
    if not M.is_terminal() then return end
    out:write("\r\27[K", M.progress(done, total, elapsed))
    out:flush()
    c.drawn = true
  end
  function c.finish()
    if c.drawn then out:write("\r\27[K"); out:flush(); c.drawn = false end
  end
  return c
end

return M
