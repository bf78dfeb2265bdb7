--[[
tests/fuzz/fuzz.lua - a deterministic mutation fuzzer over moe-lua's parsers
(the targets of tests/fuzz/targets.lua: safetensors and Megatron .idx/.bin
in C and through the bindings, JSON in C and in Lua, BPE merges, config
overrides).

  moe-lua tests/fuzz/fuzz.lua target=safetensors [n=2000] [exec=build/tests/fuzz_core]
  moe-lua tests/fuzz/fuzz.lua target=all n=100000        # or MOE_FUZZ_N=100000
  moe-lua tests/fuzz/fuzz.lua target=dataset index=1234  # input 1234 alone, again
  moe-lua tests/fuzz/fuzz.lua target=bpe input=DIR       # a saved input folder

Seeds are valid files made at start by moe-lua's own writers (moe.save,
data.preprocess and the dataset builder, data.train_bpe, the JSON encoder)
and argument lists. Input i of a target is made from a generator seeded by
(seed, target, i) alone: it picks a seed input and applies 1 to 6 mutations
(bit flips; bytes set to 0, 0xff, 0x7f, 0x80 ...; little-endian integers
set to extremes; ranges inserted, deleted, duplicated; truncation;
extension; a splice with another seed; JSON-like numbers replaced by huge,
negative, 2^63, -0, 1e999 ...; tokens repeated, e.g. 5000 '['), half of
them the target's structure-aware ones (safetensors: header length,
offsets, shapes, dtypes; .idx: counts, sizes, pointers, document indices,
dtype code). Inputs 0 .. #seeds-1 are the seeds themselves, which must
load, then the target's regressions (inputs that once failed), unmutated.
So `index=i` reproduces exactly input i, on any machine.

Outcomes: clean error, load, crash, hang (see targets.lua and
fuzz_core.c for what each means per kind of target). A crash or a hang
writes the input to <work>/failures/<target>-<i>/ with REPRO (the commands
that run it again) and, for C targets, the child's stderr; the run ends
with one line per target,
  safetensors: 2000 inputs, 1712 clean errors, 288 loads, 0 crashes, 0 hangs
and exits 1 when any target had a crash or a hang.

Options (key=value): target (a name, names separated by commas, or all), n (inputs per target; the
environment variable MOE_FUZZ_N when set), seed (1), exec (fuzz_core; by
default next to this build's moe-lua), work (scratch and failures folder,
default $TMPDIR/moe-fuzz), timeout (seconds per input, 10), index, input,
chunk (C inputs per fuzz_core call, 500), verbose (print every failure's
detail).
]]
local moe = require "moe"

local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "tests/fuzz"

local defaults = {
  target = "all", n = math.tointeger(tonumber(os.getenv("MOE_FUZZ_N") or "")) or 2000, seed = 1,
  exec = "", work = (os.getenv("TMPDIR") or "/tmp") .. "/moe-fuzz", timeout = 10, index = -1,
  input = "", chunk = 500, verbose = false,
}
local opt = moe.config(defaults)

local function sh(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

------------------------------------------------------------------ kit

local kit = { MAX_SIZE = 65536, MEMORY_MB = 512 }
kit.HANG = setmetatable({}, { __tostring = function() return "time limit" end })
kit.MEMORY = setmetatable({}, { __tostring = function() return "memory limit" end })
kit.HELP_EXIT = setmetatable({}, { __tostring = function() return "--help exit" end })
local BUG = {}

--- kit.bug(msg): a Lua target's result is wrong: a crash, with msg.
function kit.bug(msg) error(setmetatable({ msg = msg }, BUG), 0) end

function kit.read(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("a")
  f:close()
  return s
end

function kit.write(path, s)
  local f = assert(io.open(path, "wb"))
  assert(f:write(s))
  assert(f:close())
end

function kit.u64(v) return string.pack("<i8", v) end
function kit.i64(v) return string.pack("<i8", v) end
function kit.i32(v) return string.pack("<i4", ((v + 0x80000000) & 0xffffffff) - 0x80000000) end
--- kit.put(s, pos, bytes): s with bytes written at pos (1-based), s grown if needed.
function kit.put(s, pos, b)
  if pos > #s + 1 then s = s .. string.rep("\0", pos - #s - 1) end
  return s:sub(1, pos - 1) .. b .. s:sub(pos + #b)
end

-- splitmix64: one generator per input, from (seed, target, index)
local Rng = {}
Rng.__index = Rng
local function rng(x) return setmetatable({ s = x }, Rng) end
function Rng:next()
  self.s = self.s + 0x9E3779B97F4A7C15
  local z = self.s
  z = (z ~ (z >> 30)) * 0xBF58476D1CE4E5B9
  z = (z ~ (z >> 27)) * 0x94D049BB133111EB
  return z ~ (z >> 31)
end
--- r:below(n): an integer in [0, n) (0 when n <= 0).
function Rng:below(n)
  if n <= 0 then return 0 end
  return (self:next() >> 1) % n
end
function Rng:pick(list) return list[1 + self:below(#list)] end
--- r:chance(k): true one time in k.
function Rng:chance(k) return self:below(k) == 0 end

local function fnv(s)
  local h = -3750763034362895579 -- 0xcbf29ce484222325
  for i = 1, #s do h = (h ~ s:byte(i)) * 0x100000001b3 end
  return h
end

local function input_rng(target, i) return rng(fnv(("%d/%s/%d"):format(opt.seed, target.name, i))) end

------------------------------------------------------------------ mutations

local INTERESTING_BYTES = { 0, 0xff, 0x7f, 0x80, 1, 0x20, 0x22, 0x5c, 0x0a, 0xc0, 0xed, 0xf4, 0xfe }
local INTERESTING_INTS = { 0, -1, 1, 0x7f, 0x80, 0xff, 0x7fff, 0x8000, 0xffff, 0x7fffffff, -0x80000000,
                           0xffffffff, 1 << 32, math.maxinteger, math.mininteger, 100000000 }
local NUMBERS = { "18446744073709551616", "18446744073709551615", "-1", "9223372036854775808",
                  "9223372036854775807", "-9223372036854775809", "-0", "1e999", "-1e999", "0.5", "1e-999",
                  "99999999999999999999999999999", "0x10", "1e3", "NaN", "inf", "00", "-", "", "4294967296",
                  "2147483648", "65536", "1.0", "1E+2", "0e0" }
local TOKENS = { '"', "\\", "\\u", "\\ud800", "\\udc00", "\\u0000", "{", "}", "[", "]", ",", ":", "null", "true",
                 "\n", "=", ".", " ", "é", "\xff", "\xc0\x80", "\xed\xa0\x80", "\0", "--", "-", "[]", "{}",
                 '"a":', "\r\n", "\t", "model.", "steps", "=1", ",,", "%" }

-- Generic mutations of one string (r: the input's generator, other: a
-- string of another seed for a splice).
local generic = {
  function(r, s) -- bit flip
    if #s == 0 then return s end
    local p = 1 + r:below(#s)
    return kit.put(s, p, string.char(s:byte(p) ~ (1 << r:below(8))))
  end,
  function(r, s) -- an interesting byte
    if #s == 0 then return s end
    return kit.put(s, 1 + r:below(#s), string.char(r:pick(INTERESTING_BYTES)))
  end,
  function(r, s) -- an interesting little-endian integer of 1, 2, 4 or 8 bytes
    local w = r:pick({ 1, 2, 4, 8 })
    local v = r:pick(INTERESTING_INTS)
    local b = string.pack("<i8", v):sub(1, w)
    return kit.put(s, 1 + r:below(#s + 1), b)
  end,
  function(r, s) -- random bytes inserted
    local n, b = 1 + r:below(16), {}
    for k = 1, n do b[k] = string.char(r:below(256)) end
    local p = 1 + r:below(#s + 1)
    return s:sub(1, p - 1) .. table.concat(b) .. s:sub(p)
  end,
  function(r, s) -- a range deleted
    if #s == 0 then return s end
    local p = 1 + r:below(#s)
    local n = 1 + r:below(r:chance(4) and #s or 16)
    return s:sub(1, p - 1) .. s:sub(p + n)
  end,
  function(r, s) -- a range duplicated somewhere
    if #s == 0 then return s end
    local p = 1 + r:below(#s)
    local piece = s:sub(p, p + r:below(64))
    local q = 1 + r:below(#s + 1)
    return s:sub(1, q - 1) .. piece .. s:sub(q)
  end,
  function(r, s) -- truncated
    return s:sub(1, r:below(#s + 1))
  end,
  function(r, s) -- extended
    local fill = r:chance(2) and "\0" or string.char(r:below(256))
    return s .. string.rep(fill, 1 + r:below(r:chance(8) and 4096 or 16))
  end,
  function(r, s, other) -- a splice: our head, another seed's tail
    if not other then return s end
    return s:sub(1, r:below(#s + 1)) .. other:sub(1 + r:below(#other + 1))
  end,
  function(r, s) -- a number of the text replaced
    local nums = {}
    for a, b in s:gmatch("()%-?%d+%.?%d*()") do nums[#nums + 1] = { a, b } end
    if #nums == 0 then return s end
    local at = r:pick(nums)
    return s:sub(1, at[1] - 1) .. r:pick(NUMBERS) .. s:sub(at[2])
  end,
  function(r, s) -- a token inserted, or repeated (deep nesting, long runs)
    local tok = r:pick(TOKENS)
    if r:chance(8) then tok = tok:rep(r:pick({ 64, 65, 200, 1000, 1001, 5000, 250000 })) end
    local p = 1 + r:below(#s + 1)
    if r:chance(2) then return s:sub(1, p - 1) .. tok .. s:sub(p) end
    return s:sub(1, p - 1) .. tok .. s:sub(p + #tok)
  end,
}

--- kit.mutate_text(r, s): one generic mutation of s.
function kit.mutate_text(r, s) return r:pick(generic)(r, s, nil) end

local function copy(t)
  local c = {}
  for k, v in pairs(t) do c[k] = v end
  return c
end

-- Input i of target: seeds[i + 1] itself for i < #seeds (the valid seeds,
-- then the regressions), else 1 to 6 mutations of one of the first n_valid.
local function make_input(target, seeds, n_valid, i)
  if i < #seeds then return copy(seeds[i + 1]) end
  local r = input_rng(target, i)
  local valid = table.move(seeds, 1, n_valid, 1, {})
  local input = copy(r:pick(valid))
  local files, weighted = target.files, {}
  for _, f in ipairs(files) do
    for _ = 1, (target.weights and target.weights[f] or 1) do weighted[#weighted + 1] = f end
  end
  local count = 1 + r:below(r:chance(4) and 6 or 2)
  for _ = 1, count do
    if target.mutators and r:chance(2) then
      r:pick(target.mutators)(r, input)
    else
      local f = r:pick(weighted)
      local other = r:pick(valid)[f]
      input[f] = r:pick(generic)(r, input[f] or "", other)
    end
  end
  local cap = target.max_size or kit.MAX_SIZE
  for _, f in ipairs(files) do
    if #input[f] > cap then input[f] = input[f]:sub(1, cap) end
  end
  return input
end

------------------------------------------------------------------ running

local function mkdir(d) assert(os.execute("mkdir -p " .. sh(d)), "cannot create " .. d) end

local function write_input(target, input, prefix)
  for _, f in ipairs(target.files) do kit.write(prefix .. f, input[f]) end
end

-- A Lua target's input under pcall, a time limit and a memory limit.
local function run_lua(target, input, dir)
  if target.write_files then write_input(target, input, dir .. "/") end
  local deadline = os.clock() + opt.timeout
  local mem_limit = collectgarbage("count") + kit.MEMORY_MB * 1024
  debug.sethook(function()
    if os.clock() > deadline then error(kit.HANG, 0) end
    if collectgarbage("count") > mem_limit then
      collectgarbage()
      if collectgarbage("count") > mem_limit then error(kit.MEMORY, 0) end
    end
  end, "", 1000)
  local ok, e = pcall(target.load, input, dir)
  debug.sethook()
  if ok then return "load", "" end
  if e == kit.HANG then return "hang", "ran past the time limit" end
  if e == kit.MEMORY then return "crash", ("used more than %d MiB of Lua memory"):format(kit.MEMORY_MB) end
  if getmetatable(e) == BUG then return "crash", "wrong result: " .. e.msg end
  if type(e) ~= "string" then return "crash", "error value of type " .. type(e) .. ": " .. tostring(e) end
  -- error(msg, 2) in a loader blames its caller, the load function here
  local msg = e:gsub("^[^\n]-tests/fuzz/[%w_]+%.lua:%d+: ", "")
  if msg:find("attempt to ") or msg:find("stack overflow") or msg:find("traceback") or
      msg:find("bad argument #") then
    return "crash", "Lua error of the interpreter: " .. e
  end
  for _, p in ipairs(target.clean) do
    if msg:find(p) then return "clean", msg end
  end
  return "crash", "error without the parser's message: " .. e
end

local function exec_path()
  if opt.exec ~= "" then return opt.exec end
  local build = os.getenv("MOE_BUILD_DIR") or ((arg[-1] or ""):match("^(.*)/[^/]*$") or ".")
  return build .. "/tests/fuzz_core"
end

-- C targets: inputs [first, last] written to dir, run by fuzz_core; calls
-- report(i, outcome, detail, log) for each.
local function run_exec(target, make, first, last, dir, report)
  os.execute("rm -rf " .. sh(dir))
  mkdir(dir)
  for i = first, last do write_input(target, make(i), ("%s/%d."):format(dir, i)) end
  local cmd = ("%s %s %s %d %d %d"):format(sh(exec_path()), target.exec, sh(dir), first, last, opt.timeout)
  local p = assert(io.popen(cmd, "r"))
  local seen = {} -- i -> {outcome, detail}; a later crash line (at exit) wins
  for line in p:lines() do
    local i, outcome, detail = line:match("^(%d+) (%a+) ?(.*)$")
    i = math.tointeger(tonumber(i))
    if i and (not seen[i] or outcome == "crash") then seen[i] = { outcome, detail } end
  end
  local ok, how, code = p:close()
  if not ok then error(("fuzz: %s failed (%s %s)"):format(cmd, tostring(how), tostring(code)), 0) end
  for i = first, last do
    if not seen[i] then error(("fuzz: %s gave no outcome for input %d"):format(cmd, i), 0) end
    report(i, seen[i][1], seen[i][2], seen[i][2]:match("stderr in (%S+)"))
  end
end

local function save_failure(target, i, input, outcome, detail, log)
  local d = ("%s/failures/%s-%d"):format(opt.work, target.name, i)
  os.execute("rm -rf " .. sh(d))
  mkdir(d)
  write_input(target, input, d .. "/")
  local script = here .. "/fuzz.lua"
  local lines = {
    ("%s %s: input %d: %s"):format(target.name, outcome, i, detail),
    "# the same input made again from its index (seed " .. opt.seed .. "):",
    ("%s %s target=%s index=%d seed=%d%s"):format(arg[-1] or "moe-lua", script, target.name, i, opt.seed,
      target.exec and (" exec=" .. exec_path()) or ""),
    "# the files of this folder:",
  }
  if target.exec then
    lines[#lines + 1] = ("%s %s --one %s/"):format(exec_path(), target.exec, d)
  else
    lines[#lines + 1] = ("%s %s target=%s input=%s"):format(arg[-1] or "moe-lua", script, target.name, d)
  end
  if log then
    local f = io.open(log, "rb")
    if f then
      kit.write(d .. "/stderr.txt", f:read("a"))
      f:close()
    end
  end
  kit.write(d .. "/REPRO", table.concat(lines, "\n") .. "\n")
  return d
end

local function fuzz_target(target)
  local seed_dir = ("%s/seeds/%s"):format(opt.work, target.name)
  os.execute("rm -rf " .. sh(seed_dir))
  mkdir(seed_dir)
  local seeds = target.seeds(seed_dir)
  assert(#seeds > 0, target.name .. ": no seeds")
  local n_valid = #seeds
  for _, x in ipairs(target.regressions or {}) do seeds[#seeds + 1] = x end
  local scratch = ("%s/run/%s"):format(opt.work, target.name)
  os.execute("rm -rf " .. sh(scratch))
  mkdir(scratch)

  local counts = { clean = 0, load = 0, crash = 0, hang = 0 }
  local failures = {}
  local function make(i) return make_input(target, seeds, n_valid, i) end
  local function report(i, outcome, detail, log)
    if counts[outcome] == nil then outcome, detail = "crash", "unknown outcome " .. outcome .. ": " .. detail end
    if i < n_valid and outcome ~= "load" and not (target.seeds_may_fail and outcome == "clean") then
      outcome, detail = "crash", "a seed (valid input made by moe-lua's writer) did not load: " .. detail
    end
    counts[outcome] = counts[outcome] + 1
    if opt.index >= 0 then print(("%s %d: %s %s"):format(target.name, i, outcome, detail)) end
    if outcome == "crash" or outcome == "hang" then
      local d = save_failure(target, i, make(i), outcome, detail, log)
      failures[#failures + 1] = ("  %s %d: %s\n    saved in %s (see REPRO)"):format(outcome, i, detail, d)
    end
  end

  local first, last = 0, opt.n - 1
  if opt.index >= 0 then first, last = opt.index, opt.index end
  local t0 = os.time()
  if opt.input ~= "" then -- a saved folder
    local input = {}
    for _, f in ipairs(target.files) do input[f] = kit.read(opt.input .. "/" .. f) end
    if target.exec then
      local p = assert(io.popen(("%s %s --one %s/"):format(sh(exec_path()), target.exec, sh(opt.input))))
      local line = p:read("a")
      p:close()
      io.write(line)
      local outcome = line:match("^%d+ (%a+)")
      counts[outcome or "crash"] = counts[outcome or "crash"] + 1
    else
      local outcome, detail = run_lua(target, input, opt.input)
      print(outcome .. " " .. detail)
      counts[outcome] = counts[outcome] + 1
    end
    first, last = 0, 0
  elseif target.exec then
    for a = first, last, opt.chunk do
      run_exec(target, make, a, math.min(a + opt.chunk - 1, last), scratch .. "/chunk", report)
    end
  else
    for i = first, last do
      -- a crash that ends this process (a C call of a binding) leaves the
      -- input's files and its index in the scratch folder
      if target.write_files then kit.write(scratch .. "/INDEX", tostring(i)) end
      local outcome, detail = run_lua(target, make(i), scratch)
      report(i, outcome, detail)
    end
  end
  os.execute("rm -rf " .. sh(scratch))
  local n = last - first + 1
  print(("%s: %d inputs, %d clean errors, %d loads, %d crashes, %d hangs (%d s)"):format(target.name, n,
    counts.clean, counts.load, counts.crash, counts.hang, os.time() - t0))
  for k, f in ipairs(failures) do
    if k <= 20 or opt.verbose then print(f) end
  end
  if #failures > 20 and not opt.verbose then print(("  ... and %d more"):format(#failures - 20)) end
  io.stdout:flush()
  return counts.crash + counts.hang
end

-- target=selftest: every kind of failure must be seen as what it is, by
-- fuzz_core (its selftest target) and by the Lua runner.
local function selftest()
  local sanitized = io.popen(sh(exec_path()) .. " --sanitized"):read("l") == "1"
  local cases = { clean = "clean", load = "load", segv = "crash", abort = "crash", oom = "crash",
                  badmsg = "crash", rss = "crash" } -- and hang, alone below
  if sanitized then cases.oob, cases.ubsan, cases.leak = "crash", "crash", "crash" end
  local words = {}
  for w in pairs(cases) do words[#words + 1] = w end
  table.sort(words)
  words[#words + 1] = "load" -- after the leak: its batch is run again input by input
  local fails = 0
  local function expect(what, want, got, detail)
    local ok = want == got
    if not ok then fails = fails + 1 end
    print(("%-4s %-28s expected %-5s got %-5s %s"):format(ok and "ok" or "FAIL", what, want, got, detail or ""))
  end
  local t = { name = "selftest", exec = "selftest", files = { "input.json" } }
  local dir = opt.work .. "/run/selftest"
  local timeout = opt.timeout
  run_exec(t, function(i) return { ["input.json"] = words[i + 1] } end, 0, #words - 1, dir, function(i, outcome, detail)
    expect("fuzz_core " .. words[i + 1], cases[words[i + 1]], outcome, detail)
  end)
  opt.timeout = 1 -- the hang alone, with a short limit
  run_exec(t, function() return { ["input.json"] = "hang" } end, 0, 0, dir, function(_, outcome, detail)
    expect("fuzz_core hang", "hang", outcome, detail)
  end)
  local lua_cases = {
    { "returns", "load", function() return 1 end },
    { "its own message", "clean", function() error("sel: bad input", 0) end },
    { "its message, level 2", "clean", function() (function() error("sel: bad input", 2) end)() end },
    { "another message", "crash", function() error("bad input", 0) end },
    { "attempt to index nil", "crash", function() local x; return x.y end }, -- luacheck: ignore 221
    { "bad argument", "crash", function() return string.char(-1) end },
    { "stack overflow", "crash", function() local function f() return 1 + f() end return f() end },
    { "kit.bug", "crash", function() kit.bug("wrong") end },
    { "an error table", "crash", function() error({}) end },
    { "an endless loop", "hang", function() while true do end end },
    -- luacheck: ignore 241 431
    { "memory", "crash", function() local t = {} for k = 1, math.huge do t[k] = ("x"):rep(1 << 20) .. k end end, 60 },
  }
  for _, c in ipairs(lua_cases) do
    opt.timeout = c[4] or 1
    kit.MEMORY_MB = c[4] and 64 or 512 -- the memory case: a low limit, reached quickly
    local c0 = os.clock()
    local outcome, detail = run_lua({ load = c[3], clean = { "^sel: " } }, {}, dir)
    expect("lua " .. c[1], c[2], outcome, ("%.2f s %s"):format(os.clock() - c0, detail:sub(1, 60)))
  end
  opt.timeout = timeout
  os.execute("rm -rf " .. sh(dir))
  print(("selftest: %d checks failed%s"):format(fails, sanitized and "" or " (oob, ubsan, leak: sanitizer build only)"))
  os.exit(fails == 0 and 0 or 1, true)
end

if opt.target == "selftest" then
  mkdir(opt.work)
  selftest()
end

local targets = dofile(here .. "/targets.lua")(kit)
local chosen = {}
for _, t in ipairs(targets) do
  if opt.target == "all" or ("," .. opt.target .. ","):find("," .. t.name .. ",", 1, true) then
    chosen[#chosen + 1] = t
  end
end
if #chosen == 0 then
  local names = {}
  for _, t in ipairs(targets) do names[#names + 1] = t.name end
  error(("fuzz: unknown target '%s' (all, %s)"):format(opt.target, table.concat(names, ", ")), 0)
end
if opt.n < 1 then error("fuzz: n must be >= 1", 0) end
mkdir(opt.work)
local bad = 0
for _, t in ipairs(chosen) do bad = bad + fuzz_target(t) end
os.exit(bad == 0 and 0 or 1, true)
