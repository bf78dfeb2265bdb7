--[[
moe/train/dcp.lua - distributed checkpoints: every rank writes the shards it
owns (model and optimizer state) as safetensors, rank 0 writes one index that
maps every tensor to its global shape, dtype and shards; a checkpoint written
on one layout (DP, ZeRO-2/HSDP, ZeRO-3, EP, any number of ranks) loads onto any
other.
docs/DISTRIBUTED.md "Checkpoints".

  out_dir/ckpt-<step>/shard-<r>.safetensors   what rank r owns and is the first to hold
  out_dir/ckpt-<step>/shard-<r>.json          rank r's list of its shards and its own state
  out_dir/ckpt-<step>/index.json              every tensor: shape, dtype, shards (rank 0)
  out_dir/ckpt-<step>/state.json              step, config, optimizer scalars, per-rank
                                              RNG and data states (rank 0; checkpoint.lua's format)
  out_dir/ckpt-<step>/<name>                  extra files (the tokenizer's; state.files lists them)
  out_dir/ckpt-<step>/digests.txt             XXH64 and size of every file above

A piece is what one rank holds of one global tensor:
  {name = "model.<param>" | "optim.<param>.<state key>", shape = global shape,
   dtype =, tensor = the rank's local tensor (read to save, filled to load),
   place = {full = true} | {rows = {a, b}} | {flat = {a, b}} | {offsets = {...}, sizes = {...}},
   write = whether this rank writes it (the lowest rank holding it)}
rows: rows [a, b) of dim 0 (expert shards); flat: elements [a, b) of the
row-major flattened tensor (ZeRO-2 buckets: a parameter may straddle ranks);
offsets/sizes: an N-d box (0-based offsets). Ranges are half-open, 0-based.

  local dcp = require "moe.train.dcp"
  local pieces = dcp.pieces(par, model, opt)
  local saver = dcp.Saver{out_dir =, rank =, world =, barrier = fn, keep_last =, async =}
  saver:save(step, pieces, rank_state, state)   -- rank_state: this rank's {rng=, data=};
                                                -- state.files: {name = text}, written by rank 0
  saver:finish()                                -- waits, barrier, rank 0 commits
  saver:close()                                 -- frees the buffer kept for the next save
  dcp.load_pieces(path, pieces) -> index, stats -- fills every piece; any layout; reads
                                                -- only the bytes it needs (stats.bytes)
  dcp.read_state(path, rank, world) -> state     -- checks state/index/extra files' digests
  dcp.read_index(path) -> index (a legacy checkpoint gets a synthesized one)
  dcp.consolidate(path, prefix) -> name -> full tensor (export)

Atomicity: ranks write into out_dir/.tmp-ckpt-<step>-dcp (each file through
the safetensors writer's own temporary name, fsync and rename); at finish every
rank waits for its writes, a barrier makes sure all have, and rank 0 writes
the extra files, index.json, state.json and digests.txt (fsynced), fsyncs the folder and renames it to
ckpt-<step>. checkpoint.list counts only folders with state.json, which the
rename makes appear with everything else: a crash at any moment leaves the
previous checkpoints as they were (the .tmp folder is removed at the next start).

Asynchronous saves (async = true): moe.save_async copies the pieces into one
host buffer (a memcpy per CPU tensor; a GPU's straight from the device into the
buffer, page-locked once and reused by the next save) and writes it on a
thread; the step goes on. The commit waits until the next save or finish.
]]
local moe = require "moe"
local checkpoint = require "moe.checkpoint"
local metrics = require "moe.metrics"

local M = {}

M.FORMAT = "moe-lua-dcp"
M.VERSION = 2 -- 2: extra files (state.files), checked by read_state

local json = metrics.json

local function fail(fmt, ...) error(("dcp: " .. fmt):format(...), 0) end

local function exists(path)
  local f = io.open(path, "r")
  if f then f:close(); return true end
  return false
end

local function read_file(path)
  local f, err = io.open(path, "rb")
  if not f then fail("cannot open '%s': %s", path, err) end
  local s = f:read("a")
  f:close()
  return s
end

local function write_synced(path, text)
  local f, err = io.open(path, "wb")
  if not f then fail("cannot open '%s': %s", path, err) end
  local ok, werr = f:write(text)
  local cok, cerr = f:close()
  if not ok or not cok then fail("cannot write '%s': %s", path, werr or cerr) end
  if moe.fsync then moe.fsync(path) end
end

local function numel(shape)
  local n = 1
  for _, s in ipairs(shape) do n = n * s end
  return n
end

local function arr(t) return setmetatable(t, json.array_mt) end

-- ------------------------------------------------------------- pieces

-- The place of an expert shard: the rows [q El, (q+1) El) of an expert stack
-- (expert parallelism), and with expert-tensor sharding (etp) the box of its
-- hidden units [w f, (w+1) f): dim 2 of w1 / w3 (E, d, f), dim 1 of w2 (E, f, d).
-- name: the parameter's (or its state's) name, which says which of them it is.
local function expert_place(par, t, name)
  local El = t.shape[1]
  local q = par.ep_group and par.ep_group:rank() or 0
  local shape = {}
  for i, s in ipairs(t.shape) do shape[i] = s end
  shape[1] = El * (par.ep or 1)
  if (par.etp or 1) == 1 then return shape, { rows = { q * El, (q + 1) * El } } end
  local is_w2 = name:match("%.w2$") or name:match("%.w2%.[^.]+$")
  local hd = is_w2 and 2 or 3 -- the hidden units' dim (1-based)
  local w, fl = par.etp_group:rank(), t.shape[hd]
  shape[hd] = fl * par.etp
  local offsets, sizes = {}, {}
  for i, s in ipairs(t.shape) do offsets[i], sizes[i] = 0, s end
  offsets[1], offsets[hd] = q * El, w * fl
  return shape, { offsets = offsets, sizes = sizes }
end

-- The elements [a, b) of an expert shard t (this rank's local tensor, flattened)
-- as places of the global tensor: its shape and a list of {place =, start =, n =,
-- sizes =}: the elements [start, start + n) of the range at that place (a flat
-- range of the global tensor with ep alone, sizes nil; with etp the boxes of
-- the range, each contiguous in t, shaped sizes).
local function expert_flat_places(par, t, name, a, b)
  local shape, pl = expert_place(par, t, name)
  if pl.rows then
    local row = t.shape[1] > 0 and t:numel() // t.shape[1] or 0
    local base = pl.rows[1] * row
    return shape, { { place = { flat = { base + a, base + b } }, start = 0, n = b - a } }
  end
  local out = {}
  for _, bx in ipairs(M.flat_boxes(a, b, t.shape)) do
    local offs = {}
    for d = 1, #bx.offsets do offs[d] = bx.offsets[d] + pl.offsets[d] end
    out[#out + 1] = { place = { offsets = offs, sizes = bx.sizes }, start = bx.start, n = numel(bx.sizes),
      sizes = bx.sizes }
  end
  return shape, out
end

-- The pieces of expert shards sharded again over the data-parallel ranks
-- (parallel.shard_params with ep x etp < world; moe/train/parallel.lua's
-- expert_shards): each rank holds distinct elements of its expert shard (its
-- part of the unit's flat buffer) and writes them, the parameter's
-- ("model.<name>") and, given state keys, the AdamW state's alike.
local function expert_unit_pieces(par, out, keys)
  local ex = par.expert_fsdp
  local by_bucket = {}
  for _, e in ipairs(ex.units) do by_bucket[e.bucket] = e end
  local flat = ex.sh:param_pieces()
  for _, np in ipairs(ex.sh.named) do
    local name, t = np[1], np[2]
    for _, p in ipairs(flat[t]) do
      local a, b = p.place.flat[1], p.place.flat[2]
      local e = by_bucket[p.unit_bucket]
      for _, key in ipairs(keys or { false }) do
        local src = key and e[key] and e[key]:narrow(0, p.shard_offset, b - a) or (not key and p.tensor)
        if src then
          local full = key and (name .. "." .. key) or name
          local shape, places = expert_flat_places(par, t, full, a, b)
          for _, q in ipairs(places) do
            local v = src:narrow(0, q.start, q.n)
            if q.sizes then v = v:view(#q.sizes > 0 and q.sizes or { 1 }) end
            out[#out + 1] = { name = (key and "optim." or "model.") .. full, shape = shape, dtype = src.dtype,
              tensor = v, place = q.place, write = true }
          end
        end
      end
    end
  end
end

-- Is this rank the first of the ranks holding the same expert rows?
local function first_replica(par)
  return par.replica_group == nil or par.replica_group:rank() == 0
end

--- pieces(par, model, opt) -> the pieces this rank holds: the model's state
--- dict (with parameter sharding, par.fsdp: each sharded parameter as flat
--- ranges, moe/fsdp.lua's param_pieces) and the optimizer's state
--- (optim.AdamW / SGD: whole per parameter or its expert rows;
--- optim.ShardedAdamW: opt:state_pieces(), flat ranges).
function M.pieces(par, model, opt)
  local out = {}
  local experts = par.expert_set or {}
  local rank0 = (par.rank or 0) == 0
  local names = {}
  local sd, flat
  if par.fsdp then
    -- parameter sharding (ZeRO-3): no gather; each sharded parameter as this
    -- rank's flat ranges of it, views of its unit's shard (the replicas of
    -- HSDP hold the same: the first writes)
    sd, flat = par.fsdp:local_state_dict(), par.fsdp:param_pieces()
    if par.expert_fsdp then -- the expert shards, sharded again: below
      for _, np in ipairs(par.expert_fsdp.sh.named) do sd[np[1]] = nil end
      expert_unit_pieces(par, out)
    end
  else
    sd = model:state_dict()
  end
  for name in pairs(sd) do names[#names + 1] = name end
  table.sort(names)
  local first_shard = par.replicate_group == nil or par.replicate_group:rank() == 0
  for _, name in ipairs(names) do
    local t = sd[name]
    local e = { name = "model." .. name, dtype = t.dtype, tensor = t }
    if flat and flat[t] then
      for _, p in ipairs(flat[t]) do
        out[#out + 1] = { name = e.name, dtype = t.dtype, shape = t.shape, tensor = p.tensor, place = p.place,
          write = first_shard }
      end
      e = nil
    elseif experts[t] then
      e.shape, e.place = expert_place(par, t, name)
      e.write = first_replica(par)
    else
      e.shape, e.place, e.write = t.shape, { full = true }, rank0
    end
    if e then out[#out + 1] = e end
  end
  if opt == nil then return out end
  if opt.sharded and opt.experts then
    -- ShardedAdamW over the replicated parameters and AdamW over the expert
    -- shards (moe/train/parallel.lua, with_experts): the first's flat ranges,
    -- then the second's state per expert shard, below
    for _, p in ipairs(opt.sharded:state_pieces()) do
      p.name = "optim." .. p.name
      out[#out + 1] = p
    end
    opt = opt.experts
    if opt.sh then -- expert shards sharded again over the data-parallel ranks
      expert_unit_pieces(par, out, { "exp_avg", "exp_avg_sq", "master" })
      return out
    end
  elseif opt.state_pieces then -- sharded optimizer: its flat ranges
    for _, p in ipairs(opt:state_pieces()) do
      p.name = "optim." .. p.name
      out[#out + 1] = p
    end
    return out
  end
  local osd = opt:state_dict()
  local pnames = {}
  for name in pairs(osd) do pnames[#pnames + 1] = name end
  table.sort(pnames)
  local params = {}
  for _, np in ipairs(model:named_parameters()) do params[np[1]] = np[2] end
  for _, key in ipairs(pnames) do
    local t = osd[key]
    local pname = key:match("^(.*)%.[^.]+$")
    local p = params[pname]
    local e = { name = "optim." .. key, dtype = t.dtype, tensor = t }
    if p and experts[p] then
      e.shape, e.place = expert_place(par, t, key)
      e.write = first_replica(par)
    else
      e.shape, e.place, e.write = t.shape, { full = true }, rank0
    end
    out[#out + 1] = e
  end
  return out
end

-- The key of a piece in its rank's file: the name, and where it sits.
local function file_key(p)
  local pl = p.place
  if pl.full then return p.name end
  if pl.rows then return ("%s@rows=%d:%d"):format(p.name, pl.rows[1], pl.rows[2]) end
  if pl.flat then return ("%s@flat=%d:%d"):format(p.name, pl.flat[1], pl.flat[2]) end
  return ("%s@box=%s+%s"):format(p.name, table.concat(pl.offsets, ","), table.concat(pl.sizes, ","))
end

local function place_json(pl)
  if pl.full then return { full = true } end
  if pl.rows then return { rows = arr { pl.rows[1], pl.rows[2] } } end
  if pl.flat then return { flat = arr { pl.flat[1], pl.flat[2] } } end
  return { offsets = arr { table.unpack(pl.offsets) }, sizes = arr { table.unpack(pl.sizes) } }
end

-- ------------------------------------------------------------- saving

--- reserved(name): a file name of the checkpoint's own (not for extra files).
function M.reserved(name)
  return name == "index.json" or name == "state.json" or name == checkpoint.DIGESTS
    or name:match("^shard%-%d+%.json$") ~= nil or name:match("^shard%-%d+%.safetensors$") ~= nil
end

local Saver = {}
Saver.__index = Saver

--- Saver{out_dir =, rank =, world =, barrier = fn, keep_last =, async =} -> saver.
function M.Saver(o)
  return setmetatable({ out_dir = o.out_dir, rank = o.rank or 0, world = o.world or 1,
    barrier = o.barrier or function() end, keep_last = o.keep_last or 0,
    async = o.async and moe.save_async ~= nil, pending = nil, stall = 0, saves = 0, timings = {} }, Saver)
end

local function tmp_dir(out_dir, step) return ("%s/.tmp-ckpt-%d-dcp"):format(out_dir, step) end

--- saver:save(step, pieces, rank_state, state): finishes the previous save (its
--- commit), then writes this rank's pieces (in the background when async) and
--- its shard list. state: rank 0's JSON table for state.json (step, config,
--- optimizer scalars, ...); rank_state: this rank's own (RNG, data position).
--- Returns the seconds the caller waited (the training stall); saver.stall
--- sums them over saves, saver.wait the part spent finishing the previous save;
--- saver.timings[i] = {step =, stall =, finish =}: save i's stall, and the
--- seconds its finish took (waiting for the write, the barrier, the commit).
function Saver:save(step, pieces, rank_state, state)
  local t0 = moe.clock()
  self:finish()
  local tw = moe.clock()
  self.wait = (self.wait or 0) + (tw - t0)
  local dir = tmp_dir(self.out_dir, step)
  checkpoint.mkdir_p(dir)
  local file = ("shard-%d.safetensors"):format(self.rank)
  local tensors, shards, made = {}, {}, {}
  local copy = self.async
  for _, p in ipairs(pieces) do
    if p.write then
      local key = file_key(p)
      local t = p.tensor
      if copy and not t:is_contiguous() then
        -- moe.save_async copies contiguous tensors itself, from a GPU straight into its buffer
        t = moe.no_grad(function() return t:contiguous() end)
        made[#made + 1] = t
      end
      tensors[key] = t
      local s = place_json(p.place)
      s.file, s.key = file, key
      shards[#shards + 1] = { name = p.name, shape = arr { table.unpack(p.shape) }, dtype = p.dtype, shard = s }
    end
  end
  local meta = { format = M.FORMAT, step = tostring(step), rank = tostring(self.rank) }
  local desc = { rank = self.rank, world_size = self.world, step = step, file = file,
    shards = arr(shards), state = rank_state }
  local handle
  if self.async then
    handle = moe.save_async(dir .. "/" .. file, tensors, meta, self.spent)
    if self.spent then self.spent:free() end
    self.spent = nil
  else
    moe.save(dir .. "/" .. file, tensors, meta)
  end
  -- the shard list goes in last: written and synced before the commit's barrier
  for _, t in ipairs(made) do t:free() end -- the writer holds its own copy
  local timing = { step = step }
  self.timings[#self.timings + 1] = timing
  self.pending = { step = step, dir = dir, handle = handle, desc = desc, state = state, timing = timing }
  if not self.async then self:finish() end
  local t1 = moe.clock()
  timing.stall = t1 - t0
  self.saves = self.saves + 1
  self.stall = self.stall + (t1 - t0)
  return t1 - t0
end

--- saver:finish() -> the committed checkpoint's path (nil when nothing was
--- pending). Every rank waits for its write, writes its shard list, a barrier;
--- rank 0 then writes index.json and state.json and renames the folder.
function Saver:finish()
  local p = self.pending
  if p == nil then return nil end
  self.pending = nil
  local t0 = moe.clock()
  local ok, err = true, nil
  if p.handle then
    ok, err = pcall(p.handle.wait, p.handle)
    self.spent = p.handle -- its buffer serves the next save
  end
  if ok then
    ok, err = pcall(write_synced, ("%s/shard-%d.json"):format(p.dir, self.rank), json.encode(p.desc) .. "\n")
  end
  if not ok then
    -- every rank must reach the barrier: say so and stop everyone
    io.stderr:write(("dcp: rank %d could not write its part of checkpoint %d: %s\n"):format(self.rank,
      p.step, tostring(err)))
    if moe.dist and self.world > 1 then moe.dist.abort(1) end
    error(err, 0)
  end
  if self.fail_before_commit then -- tests: a job that dies between the writes and the commit
    self.fail_before_commit = nil
    fail("checkpoint %d: failing before its commit (fail_before_commit is set)", p.step)
  end
  self.barrier()
  local final = checkpoint.dir_name(self.out_dir, p.step)
  if self.rank == 0 then M.commit(p.dir, final, p.step, self.world, p.state) end
  self.barrier() -- no rank reads or prunes before the rename
  if self.rank == 0 and self.keep_last > 0 then checkpoint.prune(self.out_dir, self.keep_last) end
  self.last = final
  if p.timing then p.timing.finish = moe.clock() - t0 end
  return final
end

--- saver:close(): frees the host buffer kept for the next asynchronous save.
function Saver:close()
  if self.spent then self.spent:free() end
  self.spent = nil
end

--- commit(dir, final, step, world, state): rank 0's part, once every rank's
--- files are in dir: the index, state.json, fsync, rename to final.
function M.commit(dir, final, step, world, state)
  local tensors, files, ranks = {}, {}, {}
  for r = 0, world - 1 do
    local path = ("%s/shard-%d.json"):format(dir, r)
    if not exists(path) then fail("checkpoint %d: rank %d wrote no shard list (%s)", step, r, path) end
    local d = json.decode(read_file(path))
    ranks[r + 1] = d.state or {}
    if #d.shards > 0 then files[#files + 1] = d.file end
    for _, s in ipairs(d.shards) do
      local e = tensors[s.name]
      if e == nil then
        e = { shape = s.shape, dtype = s.dtype, shards = arr {} }
        tensors[s.name] = e
      end
      e.shards[#e.shards + 1] = s.shard
    end
  end
  -- the extra files (state.files: the tokenizer's), before the index and state.json
  local extra = {}
  for name in pairs(state and state.files or {}) do extra[#extra + 1] = name end
  table.sort(extra, function(a, b) return tostring(a) < tostring(b) end)
  for _, name in ipairs(extra) do
    if type(name) ~= "string" or not name:match("^[%w_][%w_.%-]*$") or M.reserved(name) then
      fail("checkpoint %d: bad extra file name '%s'", step, tostring(name))
    end
    write_synced(dir .. "/" .. name, state.files[name])
  end
  local index = { format = M.FORMAT, version = M.VERSION, step = step, world_size = world,
    files = arr(files), tensors = tensors }
  write_synced(dir .. "/index.json", json.encode(index) .. "\n")
  local st = {}
  for k, v in pairs(state or {}) do st[k] = v end
  st.format, st.version, st.step = checkpoint.FORMAT, checkpoint.VERSION, step
  st.sharded, st.world_size, st.ranks = M.FORMAT, world, arr(ranks)
  st.files = arr(extra)
  write_synced(dir .. "/state.json", json.encode(st) .. "\n")
  -- every file's digest (checkpoint.verify checks them at resume=latest and load)
  local listed = { "index.json", "state.json" }
  for r = 0, world - 1 do listed[#listed + 1] = ("shard-%d.json"):format(r) end
  for _, f in ipairs(files) do listed[#listed + 1] = f end
  for _, f in ipairs(extra) do listed[#listed + 1] = f end
  checkpoint.write_digests(dir, listed)
  if moe.fsync then moe.fsync(dir) end
  if exists(final .. "/state.json") or exists(final) then
    local old = dir .. ".old"
    checkpoint.rm_rf(old)
    assert(os.rename(final, old))
    local ok, err = os.rename(dir, final)
    if not ok then os.rename(old, final); fail("cannot rename '%s' to '%s': %s", dir, final, err) end
    checkpoint.rm_rf(old)
  else
    local ok, err = os.rename(dir, final)
    if not ok then fail("cannot rename '%s' to '%s': %s", dir, final, err) end
  end
  if moe.fsync then moe.fsync(final:match("^(.*)/[^/]+$") or ".") end
end

-- ------------------------------------------------------------- loading

--- is_sharded(path): a checkpoint written by this module (index.json).
function M.is_sharded(path) return exists(path .. "/index.json") end

--- read_index(path) -> the index; a single-file checkpoint (model.safetensors,
--- optim.safetensors) gets one synthesized from its files: every tensor whole.
function M.read_index(path)
  if M.is_sharded(path) then
    local ok, idx = pcall(json.decode, read_file(path .. "/index.json"))
    if not ok or type(idx) ~= "table" or idx.format ~= M.FORMAT then
      fail("'%s/index.json' is not a moe-lua checkpoint index (%s)", path, ok and "wrong format" or idx)
    end
    return idx
  end
  local idx = { format = M.FORMAT, version = M.VERSION, files = {}, tensors = {}, legacy = true }
  for _, part in ipairs({ "model", "optim" }) do
    local file = part .. ".safetensors"
    if exists(path .. "/" .. file) then
      idx.files[#idx.files + 1] = file
      local ok, r = pcall(moe.open_safetensors, path .. "/" .. file) -- the header only
      if not ok then fail("cannot read '%s/%s': %s", path, file, tostring(r)) end
      for k, v in pairs(r:entries()) do
        idx.tensors[part .. "." .. k] = { shape = v.shape, dtype = v.dtype,
          shards = { { file = file, key = k, full = true } } }
      end
      r:close()
    end
  end
  return idx
end

-- As a flat range of the global tensor, or nil when it is not one.
local function as_flat(pl, shape)
  local n = numel(shape)
  if pl.full then return 0, n end
  if pl.flat then return pl.flat[1], pl.flat[2] end
  local row = #shape > 0 and n // math.max(shape[1], 1) or 1
  if pl.rows then return pl.rows[1] * row, pl.rows[2] * row end
  -- a box of whole rows is a flat range
  for d = 2, #shape do
    if pl.offsets[d] ~= 0 or pl.sizes[d] ~= shape[d] then return nil end
  end
  if #shape == 0 then return 0, 1 end
  return pl.offsets[1] * row, (pl.offsets[1] + pl.sizes[1]) * row
end

-- The boxes whose union is the flat range [a, b) of a tensor of shape, each
-- contiguous in row-major order: {offsets, sizes, start} (start: its first
-- element's position in the range). A range of whole rows is one box.
local function flat_boxes(a, b, shape, out, prefix, base)
  out, prefix, base = out or {}, prefix or {}, base or a
  local nd = #prefix
  if nd == #shape then -- a single element
    if b > a then out[#out + 1] = { offsets = { table.unpack(prefix) }, sizes = {}, start = a - base } end
    return out
  end
  local row = 1
  for d = nd + 2, #shape do row = row * shape[d] end
  local function whole(r0, r1, at) -- rows [r0, r1) of this dim, whole
    if r1 <= r0 then return end
    local off, size = { table.unpack(prefix) }, {}
    for _ = 1, nd do size[#size + 1] = 1 end
    off[nd + 1], size[nd + 1] = r0, r1 - r0
    for d = nd + 2, #shape do off[d], size[d] = 0, shape[d] end
    out[#out + 1] = { offsets = off, sizes = size, start = at - base }
  end
  local function part(r, x, y) -- elements [x, y) of row r
    local p = { table.unpack(prefix) }
    p[nd + 1] = r
    local sub = {}
    local res = flat_boxes(x, y, shape, {}, p, x)
    for _, bx in ipairs(res) do bx.start = bx.start + r * row + x - base; sub[#sub + 1] = bx end
    for _, bx in ipairs(sub) do out[#out + 1] = bx end
  end
  if row == 0 or b <= a then return out end
  local r0, r1 = a // row, (b - 1) // row
  if a % row == 0 and b % row == 0 then
    whole(r0, r1 + 1, a)
  elseif r0 == r1 then
    part(r0, a - r0 * row, b - r0 * row)
  else
    local first = r0
    if a % row ~= 0 then part(r0, a - r0 * row, row); first = r0 + 1 end
    local last = b % row == 0 and r1 + 1 or r1
    whole(first, last, first * row)
    if b % row ~= 0 then part(r1, 0, b - r1 * row) end
  end
  return out
end
M.flat_boxes = flat_boxes

-- A place as boxes, each with a view of t (the tensor at that place) over it.
local function boxes_of(t, pl, shape)
  if pl.offsets then return { { offsets = pl.offsets, sizes = pl.sizes, view = t } } end
  local a, b = as_flat(pl, shape)
  local out = {}
  local flat = t:reshape({ t:numel() })
  for _, bx in ipairs(flat_boxes(a, b, shape)) do
    bx.view = flat:narrow(0, bx.start, numel(bx.sizes)):view(#bx.sizes > 0 and bx.sizes or { 1 })
    if #bx.sizes == 0 then bx.view = flat:narrow(0, bx.start, 1):view({}) end
    out[#out + 1] = bx
  end
  return out
end

-- The boxes of a shard at place sp, in the shard's stored tensor: {offsets,
-- sizes (global), shape, base}: the box is the elements [base, base +
-- numel(shape)) of the stored tensor seen as shape (moe.open_safetensors' read).
local function src_boxes(sp, shape)
  if sp.offsets then return { { offsets = sp.offsets, sizes = sp.sizes, shape = sp.sizes, base = 0 } } end
  local a, b = as_flat(sp, shape)
  local out = {}
  for _, bx in ipairs(flat_boxes(a, b, shape)) do
    out[#out + 1] = { offsets = bx.offsets, sizes = bx.sizes, shape = bx.sizes, base = bx.start }
  end
  return out
end

-- Reads the part of the shard r[key] (at place sp) that overlaps dst (at
-- place dp) from the file, only its bytes, into dst; returns the number of
-- elements copied.
local function copy_overlap(dst, dp, r, key, sp, shape)
  local da, db = as_flat(dp, shape)
  local sa, sb = as_flat(sp, shape)
  if da and sa then -- two flat ranges: one read of their overlap
    local a, b = math.max(da, sa), math.min(db, sb)
    if a >= b then return 0 end
    local s = r:read(key, { shape = { sb - sa }, offsets = { a - sa }, sizes = { b - a } })
    dst:view({ dst:numel() }):narrow(0, a - da, b - a):copy_(s)
    s:free()
    return b - a
  end
  local n = 0
  local sboxes = src_boxes(sp, shape)
  for _, dbx in ipairs(boxes_of(dst, dp, shape)) do
    for _, sbx in ipairs(sboxes) do
      local d, offs, sizes, m = dbx.view, {}, {}, 1
      for k = 1, #shape do
        local a = math.max(dbx.offsets[k], sbx.offsets[k])
        local b = math.min(dbx.offsets[k] + dbx.sizes[k], sbx.offsets[k] + sbx.sizes[k])
        if a >= b then m = 0; break end
        d = d:narrow(k - 1, a - dbx.offsets[k], b - a)
        offs[k], sizes[k] = a - sbx.offsets[k], b - a
        m = m * (b - a)
      end
      if m > 0 then
        local s = r:read(key, { shape = sbx.shape, base = sbx.base, offsets = offs, sizes = sizes })
        d:copy_(s)
        s:free()
        n = n + m
      end
    end
  end
  return n
end

local function place_of(s)
  if s.full then return { full = true } end
  if s.rows then return { rows = s.rows } end
  if s.flat then return { flat = s.flat } end
  return { offsets = s.offsets, sizes = s.sizes }
end

local function same_shape(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

--- load_pieces(path, pieces [, {missing_ok = fn(name)}]) -> index, stats: fills
--- every piece's tensor with its part of the checkpoint's global tensor,
--- reading from the shards that overlap it only the bytes of the overlap
--- (moe.open_safetensors: each file's header once, then a read per run of
--- the overlap that is contiguous in the file). stats (also M.last_load):
--- {bytes =, reads =, files =, seconds =}: what this call read.
function M.load_pieces(path, pieces, opts)
  opts = opts or {}
  local t0 = moe.clock()
  local idx = M.read_index(path)
  local readers, entries, order = {}, {}, {}
  local function reader(name)
    local r = readers[name]
    if r == nil then
      local ok, res = pcall(moe.open_safetensors, path .. "/" .. name)
      if not ok then fail("cannot read '%s/%s': %s", path, name, tostring(res)) end
      r = res
      readers[name], entries[name], order[#order + 1] = r, r:entries(), name
    end
    return r, entries[name]
  end
  local function close_all()
    local bytes, reads = 0, 0
    for _, name in ipairs(order) do
      local b, n = readers[name]:bytes_read()
      bytes, reads = bytes + b, reads + n
      readers[name]:close()
    end
    return bytes, reads
  end
  local ok, err = pcall(moe.no_grad, function()
    for _, p in ipairs(pieces) do
      local e = idx.tensors[p.name]
      if e == nil then
        if not (opts.missing_ok and opts.missing_ok(p.name)) then
          fail("%s has no tensor '%s'", path, p.name)
        end
      else
        if not same_shape(e.shape, p.shape) then
          fail("'%s' is [%s] in %s but [%s] here", p.name, table.concat(e.shape, ", "), path,
            table.concat(p.shape, ", "))
        end
        local want
        do
          local a, b = as_flat(p.place, p.shape)
          if a then want = b - a else want = numel(p.place.sizes) end
        end
        local got = 0
        for _, s in ipairs(e.shards) do
          local r, keys = reader(s.file)
          if keys[s.key] == nil then fail("'%s/%s' has no tensor '%s'", path, s.file, s.key) end
          moe.scope(function()
            got = got + copy_overlap(p.tensor, p.place, r, s.key, place_of(s), p.shape)
          end)
        end
        if got ~= want then
          fail("'%s': the shards in %s cover %d of the %d elements this rank needs", p.name, path, got, want)
        end
      end
    end
  end)
  local bytes, reads = close_all()
  if not ok then error(err, 0) end
  M.last_load = { bytes = bytes, reads = reads, files = #order, seconds = moe.clock() - t0 }
  return idx, M.last_load
end

--- read_state(path, rank, world) -> state.json's table, with rng and data of
--- this rank's own state when the checkpoint has one per rank (the same world
--- size: rank r's; another: rank 0's, the state every rank draws the same
--- global batch from).
function M.read_state(path, rank, world)
  -- state.json, index.json and the extra files (the tokenizer's) against
  -- digests.txt: small files, read whole (the shards are checked by
  -- resume=latest's checkpoint.verify; their headers when they are read)
  local digests, why = checkpoint.read_digests(path)
  if not digests then fail("%s", why) end
  local function check(name)
    if digests == "none" then return end
    local ok, err = checkpoint.check_file(path, name, digests)
    if not ok then fail("%s", err) end
  end
  check("state.json")
  if M.is_sharded(path) then check("index.json") end
  local ok, st = pcall(json.decode, read_file(path .. "/state.json"))
  if not ok or type(st) ~= "table" then fail("corrupt '%s/state.json': %s", path, tostring(st)) end
  if type(st.files) == "table" then
    for _, name in ipairs(st.files) do check(name) end
  end
  if st.ranks then
    local mine = (st.world_size == world and st.ranks[rank + 1]) or st.ranks[1] or {}
    st.rng, st.data = mine.rng, mine.data
  end
  return st
end

--- consolidate(path [, prefix="model."]) -> name -> full CPU tensor of every
--- tensor whose name starts with prefix (the prefix taken off), assembled from
--- its shards.
function M.consolidate(path, prefix)
  prefix = prefix or "model."
  local idx = M.read_index(path)
  local pieces, out = {}, {}
  local names = {}
  for name in pairs(idx.tensors) do
    if name:sub(1, #prefix) == prefix then names[#names + 1] = name end
  end
  table.sort(names)
  for _, name in ipairs(names) do
    local e = idx.tensors[name]
    local t = moe.zeros(e.shape, { dtype = e.dtype })
    pieces[#pieces + 1] = { name = name, shape = e.shape, dtype = e.dtype, tensor = t, place = { full = true } }
    out[name:sub(#prefix + 1)] = t
  end
  M.load_pieces(path, pieces)
  return out, idx
end

return M
