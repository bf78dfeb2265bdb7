--[[
moe/checkpoint.lua - training checkpoints: a folder per step, written
atomically, the last N kept.

  out_dir/ckpt-<step>/model.safetensors   the model's state dict (moe.save)
  out_dir/ckpt-<step>/optim.safetensors   the optimizer's tensors
  out_dir/ckpt-<step>/state.json          step, RNG state, data state, config,
                                          optimizer scalars, ... (any JSON table)
  out_dir/ckpt-<step>/digests.txt         XXH64 and size of each file above

  local ckpt = require "moe.checkpoint"
  local path = ckpt.save(out_dir, step, {model = sd, optim = osd, state = tbl}, {keep_last = 3})
  local c = ckpt.load(ckpt.latest(out_dir), {device = "cuda"})   -- c.model, c.optim, c.state
  ckpt.list(out_dir) -> sorted steps;  ckpt.resolve(out_dir, "latest" | path) -> path or nil
  ckpt.folders(out_dir), ckpt.remove_unfinished(out_dir), ckpt.remove_run(out_dir)

Atomicity: everything is written into out_dir/.tmp-ckpt-<step>-<n> first;
only when all four files are complete is that folder renamed to ckpt-<step>
(rename(2) is atomic within a filesystem). A failure on the way removes the
temporary folder and raises, leaving earlier checkpoints as they were. An
existing ckpt-<step> is replaced the same way (moved aside, then removed).
Folders are made and removed with mkdir -p / rm -rf (POSIX shells).

Durability: every file is fsynced before the folder is, the folder before
its rename, and out_dir after it (moe.fsync), so after a power loss the
newest ckpt-<step> is complete or absent, never a folder with an empty
state.json.

Integrity: digests.txt holds one line "<xxh64:hex> <bytes> <file>" per file
and a last line "<xxh64:hex> <bytes> digests.txt" over the lines before it.
load (and verify) re-hashes every file: a flipped bit, a truncated file or a
changed header is an error naming the file. A checkpoint without
digests.txt (written before version 2) loads with one warning.
resolve(out_dir, "latest") takes the newest checkpoint that verifies,
warning about each newer damaged one; an explicit path must verify. In a
job of several ranks each rank hashes its share of the files and the ranks
agree (train passes latest_good a collective), so no rank reads the whole
checkpoint twice.
]]
local moe = require "moe"
local metrics = require "moe.metrics"

local M = {}

M.FORMAT = "moe-lua-checkpoint"
M.VERSION = 2 -- 2: digests.txt
M.DIGESTS = "digests.txt"
local DIGESTS_HEAD = "# moe-lua checkpoint digests 1: <digest> <bytes> <file>\n"

local function sh_quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

local function sh(cmd, what)
  if not os.execute(cmd) then error(("checkpoint: %s failed (%s)"):format(what, cmd), 0) end
end

function M.mkdir_p(dir) sh("mkdir -p " .. sh_quote(dir), "mkdir") end
function M.rm_rf(dir) sh("rm -rf " .. sh_quote(dir), "rm") end

-- stat, not open: a named pipe must not block
local function exists(path) return moe.file_kind(path) ~= nil end

-- The text of a regular file, or nil and why (a named pipe is never opened).
local function read_regular(path)
  local kind = moe.file_kind(path)
  if kind == nil then return nil, ("'%s' is missing"):format(path) end
  if kind ~= "file" then return nil, ("'%s' is a %s, not a regular file"):format(path, kind) end
  local f, err = io.open(path, "rb")
  if not f then return nil, ("cannot open '%s': %s"):format(path, tostring(err)) end
  local s = f:read("a")
  f:close()
  if not s then return nil, ("cannot read '%s'"):format(path) end
  return s
end

local function write_file(path, text)
  local f, err = io.open(path, "wb")
  if not f then error(("checkpoint: cannot open '%s': %s"):format(path, err), 0) end
  local ok, werr = f:write(text)
  local cok, cerr = f:close()
  if not ok or not cok then error(("checkpoint: cannot write '%s': %s"):format(path, werr or cerr), 0) end
end

--- dir_name(out_dir, step) -> out_dir/ckpt-<step>
function M.dir_name(out_dir, step) return ("%s/ckpt-%d"):format(out_dir, step) end

--- list(out_dir) -> ascending array of the steps of complete checkpoints in out_dir.
function M.list(out_dir)
  local steps = {}
  local p = io.popen("ls -1 " .. sh_quote(out_dir) .. " 2>/dev/null")
  if p then
    for name in p:lines() do
      local s = name:match("^ckpt%-(%d+)$")
      if s and exists(("%s/%s/state.json"):format(out_dir, name)) then steps[#steps + 1] = math.tointeger(s) end
    end
    p:close()
  end
  table.sort(steps)
  return steps
end

-- The names in dir (hidden ones too), sorted; none when dir does not exist.
local function entries(dir)
  local names = {}
  local p = io.popen("ls -1A " .. sh_quote(dir) .. " 2>/dev/null")
  if p then
    for name in p:lines() do names[#names + 1] = name end
    p:close()
  end
  table.sort(names)
  return names
end

--- folders(out_dir) -> sorted names of every ckpt-<step> folder in out_dir,
--- complete or not (what a fresh run would mix with its own).
function M.folders(out_dir)
  local names = {}
  for _, name in ipairs(entries(out_dir)) do
    if name:match("^ckpt%-%d+$") then names[#names + 1] = name end
  end
  return names
end

--- remove_unfinished(out_dir) -> the names of the .tmp-ckpt-* folders (saves that
--- were killed before their rename) it removed from out_dir.
function M.remove_unfinished(out_dir)
  local removed = {}
  for _, name in ipairs(entries(out_dir)) do
    if name:match("^%.tmp%-ckpt%-") then
      M.rm_rf(out_dir .. "/" .. name)
      removed[#removed + 1] = name
    end
  end
  return removed
end

--- remove_run(out_dir) -> the names it removed: what moe.train writes into out_dir
--- (ckpt-<step> and .tmp-ckpt-* folders, metrics.jsonl, config.json, the event files
--- of tb/ and tb/ itself once empty); nothing else in out_dir is touched.
function M.remove_run(out_dir)
  local removed = {}
  for _, name in ipairs(entries(out_dir)) do
    if name:match("^ckpt%-%d+$") or name:match("^%.tmp%-ckpt%-") or name == "metrics.jsonl"
        or name == "config.json" then
      M.rm_rf(out_dir .. "/" .. name)
      removed[#removed + 1] = name
    end
  end
  local tb = out_dir .. "/tb"
  local events = 0
  for _, name in ipairs(entries(tb)) do
    if name:match("^events%.out%.tfevents%.") then
      assert(os.remove(tb .. "/" .. name))
      events = events + 1
    end
  end
  if events > 0 then removed[#removed + 1] = ("tb/ (%d event file%s)"):format(events, events == 1 and "" or "s") end
  if #entries(tb) == 0 then os.remove(tb) end -- rmdir: only when empty
  return removed
end

-- The folder that holds path ("." for a bare name).
local function parent(path)
  local d = path:match("^(.*)/[^/]*$")
  if d == nil then return "." end
  return d == "" and "/" or d
end

local function fsync(path)
  local ok, err = pcall(moe.fsync, path)
  if not ok then error("checkpoint: " .. tostring(err), 0) end
end

--- write_atomic(path, text): text into path through path.tmp, an fsync and a
--- rename (then an fsync of the folder), so a reader never sees half a file
--- and a power loss leaves the old file or the new one.
function M.write_atomic(path, text)
  local tmp = path .. ".tmp"
  write_file(tmp, text)
  local sok, serr = pcall(fsync, tmp)
  local ok, err = sok, serr
  if sok then ok, err = os.rename(tmp, path) end
  if not ok then
    os.remove(tmp)
    error(("checkpoint: cannot rename '%s' to '%s': %s"):format(tmp, path, err), 0)
  end
  fsync(parent(path))
end

--- latest(out_dir) -> path of the newest checkpoint, or nil when there is none.
function M.latest(out_dir)
  local steps = M.list(out_dir)
  if #steps == 0 then return nil end
  return M.dir_name(out_dir, steps[#steps])
end

-- The text of digests.txt for the files of folder dir.
local function digests_text(dir, files)
  local lines = { DIGESTS_HEAD }
  for _, name in ipairs(files) do
    local ok, d, size = pcall(moe.file_digest, dir .. "/" .. name)
    if not ok then error("checkpoint: " .. tostring(d), 0) end
    lines[#lines + 1] = ("%s %d %s\n"):format(d, size, name)
  end
  local body = table.concat(lines)
  return body .. ("%s %d %s\n"):format(moe.digest(body), #body, M.DIGESTS)
end

--- write_digests(dir, files): dir/digests.txt for the files (names in dir),
--- fsynced: what save does, for checkpoints written another way (moe/train/dcp.lua).
function M.write_digests(dir, files)
  write_file(dir .. "/" .. M.DIGESTS, digests_text(dir, files))
  fsync(dir .. "/" .. M.DIGESTS)
end

--- read_digests(dir) -> {name -> {digest =, bytes =}, order = {name, ...}}, or nil and
--- why (naming the file); "none" when dir has no digests.txt. The list itself is
--- checked (its own digest); the files are not read.
function M.read_digests(dir)
  local dpath = dir .. "/" .. M.DIGESTS
  if not exists(dpath) then return "none" end
  local text, rerr = read_regular(dpath)
  if not text then return nil, rerr end
  local body, d, size = text:match("^(.*\n)(xxh64:%x+) (%d+) digests%.txt\n$")
  if not body or body:sub(1, #DIGESTS_HEAD) ~= DIGESTS_HEAD then
    return nil, ("'%s' is corrupt (not a digest list)"):format(dpath)
  end
  if moe.digest(body) ~= d or #body ~= math.tointeger(size) then
    return nil, ("'%s' is corrupt (its own digest does not match)"):format(dpath)
  end
  local out = { order = {} }
  for line in body:sub(#DIGESTS_HEAD + 1):gmatch("([^\n]*)\n") do
    local want, bytes, name = line:match("^(xxh64:%x+) (%d+) ([^/]+)$")
    if not want then return nil, ("'%s' is corrupt (bad line '%s')"):format(dpath, line) end
    out[name] = { digest = want, bytes = math.tointeger(bytes) }
    out.order[#out.order + 1] = name
  end
  if #out.order == 0 then return nil, ("'%s' lists no files"):format(dpath) end
  return out
end

--- check_file(dir, name, digests) -> true, or nil and why: dir/name against its
--- line in digests (read_digests); a file digests.txt does not list is an error.
function M.check_file(dir, name, digests)
  local want = digests[name]
  local file = dir .. "/" .. name
  if not want then return nil, ("'%s/%s' does not list '%s'"):format(dir, M.DIGESTS, name) end
  local ok, got, got_size = pcall(moe.file_digest, file)
  if not ok then return nil, (tostring(got):gsub("^file_digest: ", "")) end
  if got_size ~= want.bytes then
    return nil, ("'%s' is corrupt: %d bytes, %d bytes were written"):format(file, got_size, want.bytes)
  end
  if got ~= want.digest then
    return nil, ("'%s' is corrupt: its digest is %s, %s was written"):format(file, got, want.digest)
  end
  return true
end

-- Checks the files of checkpoint dir against its digests.txt: true, or
-- nil and why (naming the file); "none" when there is no digests.txt. With
-- part and parts, only the files at positions part, part + parts, ... of
-- digests.txt (1-based) are read and hashed.
local function check_digests(dir, part, parts)
  local digests, why = M.read_digests(dir)
  if digests == "none" or not digests then return digests, why end
  for i, name in ipairs(digests.order) do
    if not parts or (i - 1) % parts == part - 1 then
      local ok, err = M.check_file(dir, name, digests)
      if not ok then return nil, err end
    end
  end
  return true
end

local warned_undigested = {}

--- verify(path [, {part =, parts =}]) -> true, or nil and a one-line reason naming the damaged
--- file: state.json missing, empty or not a checkpoint state, digests.txt
--- corrupt or missing (version >= 2), a file missing or not matching its digest.
--- part/parts (1 <= part <= parts): hash only every parts-th file of digests.txt from the
--- part-th (the ranks of a job share the work: latest_good's agree); state.json and
--- digests.txt are checked whole either way.
function M.verify(path, opts)
  local part, parts = opts and opts.part, opts and opts.parts
  if parts ~= nil and (math.type(parts) ~= "integer" or parts < 1 or math.type(part) ~= "integer"
      or part < 1 or part > parts) then
    error(("checkpoint.verify: part and parts must be integers with 1 <= part <= parts, got %s and %s"):format(
      tostring(part), tostring(parts)), 2)
  end
  local state_path = path .. "/state.json"
  local text, rerr = read_regular(state_path)
  if not text then return nil, rerr end
  if text == "" then return nil, ("'%s' is empty"):format(state_path) end
  local dok, why = check_digests(path, part, parts)
  if not dok then return nil, why end
  local ok, state = pcall(metrics.json.decode, text)
  if not ok then return nil, ("'%s' is corrupt: %s"):format(state_path, tostring(state)) end
  if type(state) ~= "table" or state.format ~= M.FORMAT then
    return nil, ("'%s' is not a moe-lua checkpoint state (format '%s')"):format(
      state_path, type(state) == "table" and tostring(state.format) or type(state))
  end
  if dok == "none" then
    if (math.tointeger(state.version) or 1) >= 2 then
      return nil, ("'%s/%s' is missing (written by version %s, which records digests)"):format(
        path, M.DIGESTS, tostring(state.version))
    end
    if not warned_undigested[path] then
      warned_undigested[path] = true
      io.stderr:write(("checkpoint: warning: '%s' has no %s (an older checkpoint): its files are " ..
        "not verified\n"):format(path, M.DIGESTS))
    end
  end
  return true, nil, state
end

--- latest_good(out_dir [, warn [, {part =, parts =, agree =}]]) -> path of the newest
--- checkpoint that verifies, or nil. Each newer ckpt-<step> folder that does not is skipped
--- with warn("checkpoint: skipping damaged <path>: <why>") (default: a line on stderr).
--- The ranks of a job share the hashing: each verifies its part of the files (verify's
--- part/parts) and agree(ok) -> whether every rank's part verified (a collective: every rank
--- calls it for the same folders in the same order). A rank that finds a damaged file says
--- why on stderr, whatever warn is; the others warn that another rank found it.
function M.latest_good(out_dir, warn, opts)
  warn = warn or function(msg) io.stderr:write(msg, "\n") end
  local agree = opts and opts.agree
  local vopts = agree and { part = opts.part, parts = opts.parts } or nil
  local folders = M.folders(out_dir)
  table.sort(folders, function(a, b) return tonumber(a:match("%d+$")) > tonumber(b:match("%d+$")) end)
  for _, name in ipairs(folders) do
    local path = out_dir .. "/" .. name
    local ok, why = M.verify(path, vopts)
    if agree then
      local all = agree(ok == true)
      if all then return path end
      if ok then
        warn(("checkpoint: skipping damaged %s: another rank found a damaged file"):format(path))
      else
        io.stderr:write(("checkpoint: skipping damaged %s: %s\n"):format(path, why))
      end
    else
      if ok then return path end
      warn(("checkpoint: skipping damaged %s: %s"):format(path, why))
    end
  end
  return nil
end

--- resolve(out_dir, resume [, {quiet=false, part=, parts=, agree=}]) -> a checkpoint path or
--- nil. resume: nil/false/"" (nil), "latest" (the newest good one in out_dir, skipping
--- damaged ones with a warning unless quiet; nil if none; part, parts and agree: the
--- ranks share the hashing, latest_good), or a checkpoint folder (must exist; load
--- verifies it).
function M.resolve(out_dir, resume, opts)
  if resume == nil or resume == false or resume == "" or resume == "none" then return nil end
  if resume == "latest" then
    return M.latest_good(out_dir, opts and opts.quiet and function() end or nil, opts)
  end
  if not exists(resume .. "/state.json") then
    error(("checkpoint: resume='%s' is not a checkpoint folder (no state.json in it)"):format(resume), 0)
  end
  return resume
end

local tmp_counter = 0

M.reserved = { ["model.safetensors"] = true, ["optim.safetensors"] = true, ["state.json"] = true,
  [M.DIGESTS] = true }

--- save(out_dir, step, {model=, optim=, state=, files=}, {keep_last=nil}) -> the checkpoint's path.
--- model and optim: tables name -> tensor (optim may be empty or nil); state: a JSON table;
--- files: optional {file name = text} written into the folder too (the tokenizer's files).
function M.save(out_dir, step, parts, opts)
  if math.type(step) ~= "integer" or step < 0 then
    error(("bad argument #2 to 'checkpoint.save' (step must be an integer >= 0, got %s)"):format(
      tostring(step)), 2)
  end
  if type(parts) ~= "table" or type(parts.model) ~= "table" then
    error("bad argument #3 to 'checkpoint.save' ({model = state dict, optim =, state =} expected)", 2)
  end
  opts = opts or {}
  M.mkdir_p(out_dir)
  tmp_counter = tmp_counter + 1
  local tmp = ("%s/.tmp-ckpt-%d-%d-%d"):format(out_dir, step, os.time(), tmp_counter)
  local final = M.dir_name(out_dir, step)
  local ok, err = pcall(function()
    M.mkdir_p(tmp)
    local meta = { format = M.FORMAT, step = tostring(step) }
    moe.save(tmp .. "/model.safetensors", parts.model, meta)
    moe.save(tmp .. "/optim.safetensors", parts.optim or {}, meta)
    local state = {}
    for k, v in pairs(parts.state or {}) do state[k] = v end
    state.format, state.version, state.step = M.FORMAT, M.VERSION, step
    write_file(tmp .. "/state.json", metrics.json.encode(state) .. "\n")
    local listed = { "model.safetensors", "optim.safetensors", "state.json" }
    local extra = {}
    for name in pairs(parts.files or {}) do extra[#extra + 1] = name end
    table.sort(extra, function(a, b) return tostring(a) < tostring(b) end)
    for _, name in ipairs(extra) do -- extra files: {name = text}, e.g. the tokenizer's
      if type(name) ~= "string" or not name:match("^[%w_][%w_.%-]*$") or M.reserved[name] then
        error(("bad extra file name '%s'"):format(tostring(name)), 0)
      end
      write_file(tmp .. "/" .. name, parts.files[name])
      fsync(tmp .. "/" .. name)
      listed[#listed + 1] = name
    end
    fsync(tmp .. "/state.json") -- moe.save fsyncs the .safetensors files itself
    write_file(tmp .. "/" .. M.DIGESTS, digests_text(tmp, listed))
    fsync(tmp .. "/" .. M.DIGESTS)
    fsync(tmp)
    if exists(final) then
      local old = tmp .. ".old"
      assert(os.rename(final, old))
      local rok, rerr = os.rename(tmp, final)
      if not rok then os.rename(old, final); error(rerr, 0) end
      M.rm_rf(old)
    else
      local rok, rerr = os.rename(tmp, final)
      if not rok then error(("cannot rename '%s' to '%s': %s"):format(tmp, final, rerr), 0) end
    end
    fsync(out_dir)
  end)
  if not ok then
    pcall(M.rm_rf, tmp)
    error(("checkpoint.save: cannot write the checkpoint of step %d in '%s': %s"):format(
      step, out_dir, tostring(err)), 2)
  end
  if opts.keep_last and opts.keep_last > 0 then M.prune(out_dir, opts.keep_last) end
  return final
end

--- prune(out_dir, keep_last): removes all but the newest keep_last checkpoints.
function M.prune(out_dir, keep_last)
  local steps = M.list(out_dir)
  for i = 1, #steps - keep_last do M.rm_rf(M.dir_name(out_dir, steps[i])) end
end

--- load(path [, {device=}]) -> {model = name -> tensor, optim = name -> tensor, state = table,
--- path = path}. A missing or corrupt file (digests.txt says which) is an error naming it.
function M.load(path, opts)
  if type(path) ~= "string" then
    error(("bad argument #1 to 'checkpoint.load' (checkpoint folder expected, got %s)"):format(type(path)), 2)
  end
  local lopts = opts and opts.device and { device = opts.device } or nil
  local state_path = path .. "/state.json"
  if not exists(state_path) then
    error(("checkpoint.load: '%s' has no state.json ('%s/state.json' is missing)"):format(path, path), 2)
  end
  local ok, why, state = M.verify(path)
  if not ok then error("checkpoint.load: " .. why, 2) end
  local out = { state = state, path = path }
  for _, name in ipairs({ "model", "optim" }) do
    local file = ("%s/%s.safetensors"):format(path, name)
    local lok, t = pcall(moe.load, file, lopts)
    if not lok then error(("checkpoint.load: cannot read '%s': %s"):format(file, tostring(t)), 2) end
    out[name] = t
  end
  return out
end

return M
