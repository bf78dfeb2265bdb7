--[[
moe/tensorboard.lua - TensorBoard event files written (and read back) in pure
Lua: scalars and histograms, what the training loop logs.

  local tb = require "moe.tensorboard"
  local w = tb.writer("out/tb")            -- out/tb/events.out.tfevents.<time>.<host>.<n>
  w:add_scalar("loss", 2.5, 10)           -- tag, value, step
  w:add_histogram("expert_load/layer0", {0.5, 1.5, 1.0}, 10)   -- a distribution of values
  w:flush(); w:close()
  for _, ev in ipairs(tb.read("out/tb/events.out...")) do print(ev.step, ev.values[1].tag) end

TensorBoard shows scalars in its Scalars dashboard and histograms in its
Histograms (one histogram per step, stacked) and Distributions (percentile
bands against the step) dashboards, all built in: no plugin needed. The
training loop logs the per-expert load of a layer with many experts as one
histogram per layer and step (moe/train/log.lua).

Format (what TensorBoard's event_file_loader reads):
  - TFRecord framing per record: u64 little-endian data length, u32 masked
    crc32c of those 8 bytes, the data, u32 masked crc32c of the data.
    masked(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8 (mod 2^32).
  - data = an Event protobuf: wall_time double (field 1), step int64 (field
    2), file_version string (field 3, "brain.Event:2", first event only),
    summary (field 5): Summary { repeated Value value = 1 { string tag = 1;
    float simple_value = 2, or HistogramProto histo = 5 { double min = 1,
    max = 2, num = 3, sum = 4, sum_squares = 5; repeated double
    bucket_limit = 6 [packed], bucket = 7 [packed] } } } (bucket i counts
    the values in [bucket_limit[i-1], bucket_limit[i]), the first from
    min, TensorFlow's rule); or session_log (field 6): SessionLog {
    SessionStatus status = 1 } with START = 1, which tells TensorBoard's
    loaders (purge_orphaned_data, on by default) to drop the run's events
    of this step and later read before it: what a resumed run redoes.
crc32c is the Castagnoli polynomial (reflected 0x82F63B78), table-driven.
This module owns nothing else: no dependency on the tensor library.
]]
local M = {}

------------------------------------------------------------------ crc32c

local CRC_TABLE = {}
for i = 0, 255 do
  local c = i
  for _ = 1, 8 do
    if c & 1 == 1 then c = (c >> 1) ~ 0x82F63B78 else c = c >> 1 end
  end
  CRC_TABLE[i] = c
end

--- crc32c(s) -> the CRC-32C (Castagnoli) of the string s, an integer in [0, 2^32).
function M.crc32c(s)
  local crc = 0xFFFFFFFF
  for i = 1, #s do
    crc = CRC_TABLE[(crc ~ s:byte(i)) & 0xFF] ~ (crc >> 8)
  end
  return crc ~ 0xFFFFFFFF
end

--- masked_crc32c(s) -> TFRecord's masked CRC of s.
function M.masked_crc32c(s)
  local crc = M.crc32c(s)
  return (((crc >> 15) | (crc << 17)) + 0xa282ead8) & 0xFFFFFFFF
end

------------------------------------------------------------------ protobuf

local function varint(n)
  -- n: a Lua integer; negative values are written as 10-byte two's complement (int64).
  local out = {}
  repeat
    local b = n & 0x7F
    n = n >> 7 -- logical shift: terminates for negative n too
    if n ~= 0 then b = b | 0x80 end
    out[#out + 1] = string.char(b)
  until n == 0
  return table.concat(out)
end

local function key(field, wire) return varint((field << 3) | wire) end
local function len_field(field, bytes) return key(field, 2) .. varint(#bytes) .. bytes end

local function packed_doubles(list)
  local parts = {}
  for i, x in ipairs(list) do parts[i] = string.pack("<d", x) end
  return table.concat(parts)
end

-- A HistogramProto's bytes (h from M.histogram).
local function encode_histo(h)
  return key(1, 1) .. string.pack("<d", h.min) .. key(2, 1) .. string.pack("<d", h.max) ..
    key(3, 1) .. string.pack("<d", h.num) .. key(4, 1) .. string.pack("<d", h.sum) ..
    key(5, 1) .. string.pack("<d", h.sum_squares) .. len_field(6, packed_doubles(h.bucket_limit)) ..
    len_field(7, packed_doubles(h.bucket))
end

-- A Summary.Value: a scalar (value a number) or a histogram (value a table from M.histogram).
local function encode_value(tag, value)
  if type(value) == "table" then return len_field(1, tag) .. len_field(5, encode_histo(value)) end
  return len_field(1, tag) .. key(2, 5) .. string.pack("<f", value)
end

local DBL_MAX = 1.7976931348623157e308

--- histogram(values [, bins=30]) -> {min, max, num, sum, sum_squares, bucket_limit, bucket}:
--- the HistogramProto of a list of finite numbers (NaN and infinities are left out), in
--- bins equal buckets over [min, max] (the last one's limit DBL_MAX, as TensorFlow
--- writes it); one bucket when every value is the same; nil when no value is left.
function M.histogram(values, bins)
  bins = bins or 30
  local xs = {}
  for _, v in ipairs(values) do
    if type(v) == "number" and v == v and v ~= math.huge and v ~= -math.huge then xs[#xs + 1] = v + 0.0 end
  end
  if #xs == 0 then return nil end
  local lo, hi, sum, sq = math.huge, -math.huge, 0.0, 0.0
  for _, v in ipairs(xs) do
    if v < lo then lo = v end
    if v > hi then hi = v end
    sum, sq = sum + v, sq + v * v
  end
  local h = { min = lo, max = hi, num = #xs + 0.0, sum = sum, sum_squares = sq }
  if hi == lo then
    h.bucket_limit, h.bucket = { DBL_MAX }, { #xs + 0.0 }
    return h
  end
  local width = (hi - lo) / bins
  h.bucket_limit, h.bucket = {}, {}
  for i = 1, bins do
    h.bucket_limit[i] = i < bins and lo + i * width or DBL_MAX
    h.bucket[i] = 0.0
  end
  for _, v in ipairs(xs) do
    local i = math.min(bins, math.floor((v - lo) / width) + 1)
    while i > 1 and v < h.bucket_limit[i - 1] do i = i - 1 end -- rounding at an edge
    while i < bins and v >= h.bucket_limit[i] do i = i + 1 end
    h.bucket[i] = h.bucket[i] + 1
  end
  return h
end

-- An Event's bytes. fields: wall_time (number), step (integer), file_version
-- (string or nil), scalars (array of {tag, value}) or nil.
local function encode_event(wall_time, step, file_version, scalars)
  local parts = { key(1, 1) .. string.pack("<d", wall_time) }
  if step ~= 0 then parts[#parts + 1] = key(2, 0) .. varint(step) end
  if file_version then parts[#parts + 1] = len_field(3, file_version) end
  if scalars then
    local values = {}
    for i, s in ipairs(scalars) do values[i] = len_field(1, encode_value(s[1], s[2])) end
    parts[#parts + 1] = len_field(5, table.concat(values))
  end
  return table.concat(parts)
end

-- A SessionLog START event at step.
local function encode_session_start(wall_time, step)
  return key(1, 1) .. string.pack("<d", wall_time) .. key(2, 0) .. varint(step) ..
    len_field(6, key(1, 0) .. varint(1))
end

--- record(data) -> the TFRecord framing of the string data.
function M.record(data)
  local len = string.pack("<I8", #data)
  return len .. string.pack("<I4", M.masked_crc32c(len)) .. data .. string.pack("<I4", M.masked_crc32c(data))
end

------------------------------------------------------------------ writer

local Writer = {}
Writer.__index = Writer

local function sh_quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

local function hostname()
  local f = io.open("/etc/hostname", "r")
  local h = f and f:read("l")
  if f then f:close() end
  h = h and h:gsub("[^%w%-%.]", "") or ""
  return h ~= "" and h or "localhost"
end

local function now()
  local ok, moe = pcall(require, "moe")
  -- os.time has one-second resolution; refine with the monotonic clock's fraction.
  local t = os.time()
  if ok and type(moe) == "table" and moe.clock then t = t + (moe.clock() % 1) end
  return t + 0.0
end

local file_counter = 0

--- writer(logdir [, {filename_suffix=""}]) -> a Writer; creates logdir (mkdir -p) and a
--- new event file in it, whose first event carries file_version "brain.Event:2".
function M.writer(logdir, opts)
  if type(logdir) ~= "string" or logdir == "" then
    error(("bad argument #1 to 'tensorboard.writer' (directory name expected, got %s)"):format(
      type(logdir)), 2)
  end
  opts = opts or {}
  if not os.execute("mkdir -p " .. sh_quote(logdir)) then
    error(("tensorboard.writer: cannot create the directory '%s'"):format(logdir), 2)
  end
  file_counter = file_counter + 1
  local path = ("%s/events.out.tfevents.%010d.%s.%d%s"):format(logdir, os.time(), hostname(),
    file_counter, opts.filename_suffix or "")
  local f, err = io.open(path, "wb")
  if not f then error(("tensorboard.writer: cannot open '%s': %s"):format(path, err), 2) end
  local w = setmetatable({ path = path, file = f }, Writer)
  w:_write(encode_event(now(), 0, "brain.Event:2", nil))
  w:flush()
  return w
end

function Writer:_write(data)
  if not self.file then error("tensorboard: write to a closed writer (" .. self.path .. ")", 3) end
  local ok, err = self.file:write(M.record(data))
  if not ok then error(("tensorboard: cannot write '%s': %s"):format(self.path, err), 3) end
end

--- w:add_scalar(tag, value, step [, wall_time]): one scalar event.
function Writer:add_scalar(tag, value, step, wall_time)
  if type(tag) ~= "string" or tag == "" then
    error(("bad argument #1 to 'add_scalar' (tag must be a non-empty string, got %s)"):format(
      type(tag)), 2)
  end
  if type(value) ~= "number" then
    error(("bad argument #2 to 'add_scalar' (number expected for '%s', got %s)"):format(
      tag, type(value)), 2)
  end
  if math.type(step) ~= "integer" then
    error(("bad argument #3 to 'add_scalar' (integer step expected, got %s)"):format(
      tostring(step)), 2)
  end
  self:_write(encode_event(wall_time or now(), step, nil, { { tag, value } }))
end

--- w:add_histogram(tag, values, step [, wall_time [, bins=30]]): one histogram event of a list
--- of numbers (M.histogram); nothing when no value is finite.
function Writer:add_histogram(tag, values, step, wall_time, bins)
  if type(tag) ~= "string" or tag == "" then
    error(("bad argument #1 to 'add_histogram' (tag must be a non-empty string, got %s)"):format(
      type(tag)), 2)
  end
  if type(values) ~= "table" then
    error(("bad argument #2 to 'add_histogram' (list of numbers expected for '%s', got %s)"):format(
      tag, type(values)), 2)
  end
  if math.type(step) ~= "integer" then
    error(("bad argument #3 to 'add_histogram' (integer step expected, got %s)"):format(
      tostring(step)), 2)
  end
  local h = M.histogram(values, bins)
  if h then self:_write(encode_event(wall_time or now(), step, nil, { { tag, h } })) end
end

--- w:add_scalars(step, {tag = value, ...}): one event holding several scalars (tags sorted).
function Writer:add_scalars(step, values, wall_time)
  local tags = {}
  for t in pairs(values) do tags[#tags + 1] = t end
  table.sort(tags)
  local list = {}
  for i, t in ipairs(tags) do list[i] = { t, values[t] } end
  if #list > 0 then self:_write(encode_event(wall_time or now(), step, nil, list)) end
end

--- w:session_start(step): a SessionLog START at step: TensorBoard discards the events
--- at step and after that it read before this one (a resumed run's redone steps).
function Writer:session_start(step, wall_time)
  if math.type(step) ~= "integer" then
    error(("bad argument #1 to 'session_start' (integer step expected, got %s)"):format(tostring(step)), 2)
  end
  self:_write(encode_session_start(wall_time or now(), step))
end

function Writer:flush()
  if self.file then self.file:flush() end
end

function Writer:close()
  if self.file then
    self.file:close()
    self.file = nil
  end
end

Writer.__close = Writer.close
Writer.__gc = Writer.close

------------------------------------------------------------------ reader

local decode_histo -- below

local function read_varint(s, pos)
  local n, shift = 0, 0
  while true do
    local b = s:byte(pos)
    if b == nil then error("truncated varint", 0) end
    pos = pos + 1
    n = n | ((b & 0x7F) << shift)
    if b < 0x80 then return n, pos end
    shift = shift + 7
    if shift > 63 then error("varint too long", 0) end
  end
end

-- Parses protobuf bytes into an array of {field, wire, value} (value: integer,
-- number for fixed64 (raw bytes too), string for length-delimited).
local function parse_fields(s)
  local out, pos = {}, 1
  while pos <= #s do
    local k
    k, pos = read_varint(s, pos)
    local field, wire = k >> 3, k & 7
    local v
    if wire == 0 then
      v, pos = read_varint(s, pos)
    elseif wire == 1 then
      if pos + 7 > #s then error("truncated fixed64", 0) end
      v = s:sub(pos, pos + 7); pos = pos + 8
    elseif wire == 2 then
      local n
      n, pos = read_varint(s, pos)
      if pos + n - 1 > #s then error("truncated length-delimited field", 0) end
      v = s:sub(pos, pos + n - 1); pos = pos + n
    elseif wire == 5 then
      if pos + 3 > #s then error("truncated fixed32", 0) end
      v = s:sub(pos, pos + 3); pos = pos + 4
    else
      error(("unsupported wire type %d"):format(wire), 0)
    end
    out[#out + 1] = { field, wire, v }
  end
  return out
end

local function unpack_doubles(bytes)
  local out = {}
  if #bytes % 8 ~= 0 then error("packed doubles of " .. #bytes .. " bytes", 0) end
  for i = 1, #bytes, 8 do out[#out + 1] = string.unpack("<d", bytes, i) end
  return out
end

-- A HistogramProto: {min=, max=, num=, sum=, sum_squares=, bucket_limit={...}, bucket={...}}.
decode_histo = function(data)
  local names = { "min", "max", "num", "sum", "sum_squares" }
  local h = { bucket_limit = {}, bucket = {} }
  for _, x in ipairs(parse_fields(data)) do
    if x[1] <= 5 and x[2] == 1 then h[names[x[1]]] = string.unpack("<d", x[3])
    elseif (x[1] == 6 or x[1] == 7) and x[2] == 2 then
      local list = x[1] == 6 and h.bucket_limit or h.bucket
      for _, d in ipairs(unpack_doubles(x[3])) do list[#list + 1] = d end
    elseif (x[1] == 6 or x[1] == 7) and x[2] == 1 then -- unpacked
      local list = x[1] == 6 and h.bucket_limit or h.bucket
      list[#list + 1] = string.unpack("<d", x[3])
    end
  end
  return h
end

-- Decodes one Event: {wall_time=, step=, file_version=, session_status=,
-- values={{tag=, value=} or {tag=, histo=}...}}.
local function decode_event(data)
  local ev = { step = 0, values = {} }
  for _, f in ipairs(parse_fields(data)) do
    local field, v = f[1], f[3]
    if field == 1 and f[2] == 1 then ev.wall_time = string.unpack("<d", v)
    elseif field == 2 and f[2] == 0 then ev.step = v
    elseif field == 3 and f[2] == 2 then ev.file_version = v
    elseif field == 6 and f[2] == 2 then
      for _, x in ipairs(parse_fields(v)) do
        if x[1] == 1 and x[2] == 0 then ev.session_status = x[3] end
      end
    elseif field == 5 and f[2] == 2 then
      for _, vf in ipairs(parse_fields(v)) do
        if vf[1] == 1 and vf[2] == 2 then
          local val = {}
          for _, x in ipairs(parse_fields(vf[3])) do
            if x[1] == 1 and x[2] == 2 then val.tag = x[3]
            elseif x[1] == 2 and x[2] == 5 then val.value = string.unpack("<f", x[3])
            elseif x[1] == 5 and x[2] == 2 then val.histo = decode_histo(x[3]) end
          end
          ev.values[#ev.values + 1] = val
        end
      end
    end
  end
  return ev
end

--- read(path) -> array of events {wall_time, step, file_version, values = {{tag, value} or
--- {tag, histo = {min, max, num, sum, sum_squares, bucket_limit, bucket}}...}}.
--- Checks both CRCs of every record; a bad CRC or a truncated record is an error naming
--- the file and the record's offset.
function M.read(path)
  local f, err = io.open(path, "rb")
  if not f then error(("tensorboard.read: cannot open '%s': %s"):format(path, err), 2) end
  local s = f:read("a")
  f:close()
  local events, pos = {}, 1
  while pos <= #s do
    local function bad(what) error(("tensorboard.read: %s: %s at byte %d"):format(path, what, pos - 1), 3) end
    if pos + 11 > #s then bad("truncated record header") end
    local lenbytes = s:sub(pos, pos + 7)
    local n = string.unpack("<I8", lenbytes)
    if string.unpack("<I4", s, pos + 8) ~= M.masked_crc32c(lenbytes) then bad("length CRC mismatch") end
    if pos + 12 + n + 3 > #s then bad("truncated record") end
    local data = s:sub(pos + 12, pos + 12 + n - 1)
    if string.unpack("<I4", s, pos + 12 + n) ~= M.masked_crc32c(data) then bad("data CRC mismatch") end
    local ok, ev = pcall(decode_event, data)
    if not ok then bad("bad Event protobuf (" .. tostring(ev) .. ")") end
    events[#events + 1] = ev
    pos = pos + 12 + n + 4
  end
  return events
end

return M
