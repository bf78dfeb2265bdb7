--[[
moe/checkpoint.lua - training checkpoints: a folder per step, written
atomically, the last N kept.

  out_dir/ckpt-<step>/model.safetensors   the model's state dict (moe.save)
  out_dir/ckpt-<step>/optim.safetensors   the optimizer's tensors
  out_dir/ckpt-<step>/state.json          step, RNG state, data state, config,
                                          optimizer scalars, ... (any JSON table)

  local ckpt = require "moe.checkpoint"
  local path = ckpt.save(out_dir, step, {model = sd, optim = osd, state = tbl}, {keep_last = 3})
  local c = ckpt.load(ckpt.latest(out_dir), {device = "cuda"})   -- c.model, c.optim, c.state
  ckpt.list(out_dir) -> sorted steps;  ckpt.resolve(out_dir, "latest" | path) -> path or nil
  ckpt.folders(out_dir), ckpt.remove_unfinished(out_dir), ckpt.remove_run(out_dir)

Atomicity: everything is written into out_dir/.tmp-ckpt-<step>-<n> first;
only when all three files are complete is that folder renamed to ckpt-<step>
(rename(2) is atomic within a filesystem). A failure on the way removes the
temporary folder and raises, leaving earlier checkpoints as they were. An
existing ckpt-<step> is replaced the same way (moved aside, then removed).
Folders are made and removed with mkdir -p / rm -rf (POSIX shells).
]]
local moe = require "moe"
local metrics = require "moe.metrics"

local M = {}

M.FORMAT = "moe-lua-checkpoint"
M.VERSION = 1

local function sh_quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

local function sh(cmd, what)
  if not os.execute(cmd) then error(("checkpoint: %s failed (%s)"):format(what, cmd), 0) end
end

function M.mkdir_p(dir) sh("mkdir -p " .. sh_quote(dir), "mkdir") end
function M.rm_rf(dir) sh("rm -rf " .. sh_quote(dir), "rm") end

local function exists(path)
  local f = io.open(path, "r")
  if f then f:close(); return true end
  return false
end

local function write_file(path, text)
  local f, err = io.open(path, "wb")
  if not f then error(("checkpoint: cannot open '%s': %s"):format(path, err), 0) end
  local ok, werr = f:write(text)
  local cok, cerr = f:close()
  if not ok or not cok then error(("checkpoint: cannot write '%s': %s"):format(path, werr or cerr), 0) end
end

local function read_file(path)
  local f, err = io.open(path, "rb")
  if not f then error(("checkpoint: cannot open '%s': %s"):format(path, err), 0) end
  local s = f:read("a")
  f:close()
  return s
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

--- write_atomic(path, text): text into path through path.tmp and a rename, so a
--- reader never sees half a file.
function M.write_atomic(path, text)
  local tmp = path .. ".tmp"
  write_file(tmp, text)
  local ok, err = os.rename(tmp, path)
  if not ok then
    os.remove(tmp)
    error(("checkpoint: cannot rename '%s' to '%s': %s"):format(tmp, path, err), 0)
  end
end

--- latest(out_dir) -> path of the newest checkpoint, or nil when there is none.
function M.latest(out_dir)
  local steps = M.list(out_dir)
  if #steps == 0 then return nil end
  return M.dir_name(out_dir, steps[#steps])
end

--- resolve(out_dir, resume) -> a checkpoint path or nil. resume: nil/false/"" (nil),
--- "latest" (the newest in out_dir, nil if none), or a checkpoint folder (must exist).
function M.resolve(out_dir, resume)
  if resume == nil or resume == false or resume == "" or resume == "none" then return nil end
  if resume == "latest" then return M.latest(out_dir) end
  if not exists(resume .. "/state.json") then
    error(("checkpoint: resume='%s' is not a checkpoint folder (no state.json in it)"):format(resume), 0)
  end
  return resume
end

local tmp_counter = 0

M.reserved = { ["model.safetensors"] = true, ["optim.safetensors"] = true, ["state.json"] = true }

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
    for name, text in pairs(parts.files or {}) do -- extra files: {name = text}, e.g. the tokenizer's
      if type(name) ~= "string" or not name:match("^[%w_][%w_.%-]*$") or M.reserved[name] then
        error(("bad extra file name '%s'"):format(tostring(name)), 0)
      end
      write_file(tmp .. "/" .. name, text)
    end
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
--- path = path}. A missing or corrupt file is an error naming it.
function M.load(path, opts)
  if type(path) ~= "string" then
    error(("bad argument #1 to 'checkpoint.load' (checkpoint folder expected, got %s)"):format(type(path)), 2)
  end
  local lopts = opts and opts.device and { device = opts.device } or nil
  local state_path = path .. "/state.json"
  if not exists(state_path) then
    error(("checkpoint.load: '%s' has no state.json (not a checkpoint)"):format(path), 2)
  end
  local ok, state = pcall(metrics.json.decode, read_file(state_path))
  if not ok then error(("checkpoint.load: corrupt '%s': %s"):format(state_path, state), 2) end
  if type(state) ~= "table" or state.format ~= M.FORMAT then
    error(("checkpoint.load: '%s' is not a moe-lua checkpoint state (format '%s')"):format(
      state_path, type(state) == "table" and tostring(state.format) or type(state)), 2)
  end
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
