--[[
moe/train/log.lua - what a training run reports: the console (lines and the
progress bar), metrics.jsonl and TensorBoard, and the per-interval averages
(loss, aux loss, grad norm, tokens/s, MFU, expert load) of the log steps.

  local log = tlog.open(cfg, { device =, resumed =, tokens_per_step =, flops_per_token =, peak = })
  log:count_experts(info.stats)           -- inside the step, while the stats tensors live
  log:add_step(lm_loss, aux_loss, grad_norm)   -- or log:skip_step() for a skipped step
  if log:due(step, last) then local rec = log:record(step, lr, consumed); log:write(rec) end
  log:eval(step, val_loss); log:say(line); log:close()
]]
local moe = require "moe"
local metrics = require "moe.metrics"

local M = {}

local Log = {}
Log.__index = Log

local function new_interval() return { steps = 0, loss = 0, aux = 0, gn = 0, skipped = 0, counts = {} } end

--- open(cfg, o) -> a logger. o.resumed: append to metrics.jsonl instead of starting it
--- anew, once the records past step o.resume_step are dropped (self.dropped: how many);
--- o.device, o.tokens_per_step, o.flops_per_token and o.peak (FLOP/s) for
--- tokens/s and MFU (tokens_per_step of the whole job: with data parallelism every
--- rank's tokens). o.writer = false (data parallelism's ranks other than 0): no
--- console, no files; the logger still keeps the interval's numbers.
function M.open(cfg, o)
  local self = setmetatable({ cfg = cfg, device = o.device, tokens_per_step = o.tokens_per_step,
    flops_per_token = o.flops_per_token, peak = o.peak, console = metrics.console(),
    interval = new_interval(), writer = o.writer ~= false }, Log)
  if self.writer then
    -- a fresh run starts metrics.jsonl anew; a resumed one appends to it, after dropping
    -- the records past the checkpoint's step (the steps it redoes): each step once
    local path = cfg.out_dir .. "/metrics.jsonl"
    if o.resumed then self.dropped = metrics.truncate_jsonl(path, o.resume_step or 0) end
    self.jsonl = metrics.jsonl(path, o.resumed and "a" or "w")
    self.tb = cfg.tensorboard and require("moe.tensorboard").writer(cfg.out_dir .. "/tb") or nil
    -- TensorBoard files cannot be edited: a SessionLog START tells its loaders to drop
    -- the earlier files' events past the checkpoint
    if self.tb and o.resumed then self.tb:session_start((o.resume_step or 0) + 1); self.tb:flush() end
  end
  self.t_run, self.t_log = moe.clock(), moe.clock()
  return self
end

function Log:say(line)
  if self.writer and not self.cfg.quiet then self.console.print(line) end
end

-- The interval's expert counts stay on their device until read: count_experts
-- adds each layer's counts to a sum there (one add per layer and step, no host
-- read), and the first lookup of iv.counts[name] (record, global, write: once per
-- log interval) reads every layer's sum to the host in one copy per device,
-- puts the Lua lists in place and frees the sums. iv.counts keeps its names in
-- order in its array part, as before.
local function read_sums(counts, sums)
  local by_dev, order = {}, {}
  for _, name in ipairs(counts) do
    local t = sums[name]
    if t then
      local d = by_dev[t.device]
      if not d then d = {}; by_dev[t.device] = d; order[#order + 1] = t.device end
      d[#d + 1] = name
    end
  end
  for _, dev in ipairs(order) do
    local names, parts = by_dev[dev], {}
    for i, name in ipairs(names) do parts[i] = sums[name] end
    local made = #parts > 1
    local flat = made and moe.cat(parts, 0) or parts[1]
    local v = flat:totable() -- the interval's one read of this device
    if made then flat:free() end
    local k = 0
    for _, name in ipairs(names) do
      local t, list = sums[name], {}
      for j = 1, t:size(0) do list[j] = math.tointeger(v[k + j]) end
      k = k + t:size(0)
      rawset(counts, name, list)
      sums[name] = nil
      t:free()
    end
  end
end

--- count_experts(stats): adds the per-layer expert counts of a model's collect_stats()
--- ({name =, stats = {expert_counts = (E) tensor}}) to the interval, on their device:
--- nothing is read to the host here (the sums are, once, when the interval is reported).
function Log:count_experts(stats)
  local acc = self.interval.counts
  local mt = getmetatable(acc)
  if not mt then
    local sums = {}
    mt = { sums = sums, __index = function(t, k)
      if type(k) == "string" and next(sums) then read_sums(t, sums); return rawget(t, k) end
    end }
    setmetatable(acc, mt)
  end
  local sums = mt.sums
  for _, s in ipairs(stats or {}) do
    local c = s.stats and s.stats.expert_counts
    if c then
      if c.dtype ~= "i64" then c = c:to("i64") end
      local a = sums[s.name]
      if a then
        sums[s.name] = moe.keep(a + c) -- outlives the micro-batch's scope
        a:free()
      elseif rawget(acc, s.name) == nil then
        sums[s.name] = moe.keep(c:clone())
        acc[#acc + 1] = s.name
      else -- already read this interval (an early lookup): add on the host
        local a2, v = rawget(acc, s.name), c:totable()
        for j = 1, #v do a2[j] = a2[j] + math.tointeger(v[j]) end
      end
    end
  end
end

--- add_step(lm_loss, aux_loss, grad_norm): one optimizer step into the interval.
function Log:add_step(lm_loss, aux_loss, grad_norm)
  local iv = self.interval
  iv.steps = iv.steps + 1
  iv.loss = iv.loss + lm_loss
  iv.aux = iv.aux + aux_loss
  iv.gn = iv.gn + grad_norm
end

--- skip_step(): a skipped optimizer step (non-finite loss or gradient norm) into the
--- interval: counted, kept out of its means.
function Log:skip_step()
  self.interval.skipped = self.interval.skipped + 1
end

--- due(step, last) -> whether step is a log step.
function Log:due(step, last)
  return step % self.cfg.log_every == 0 or step == last
end

--- record(step, lr, consumed) -> the metrics.jsonl record of the interval ending at step.
function Log:record(step, lr, consumed)
  if self.device:sub(1, 4) == "cuda" then moe.cuda.synchronize(self.device) end
  local now = moe.clock()
  local dt = now - self.t_log
  self.t_log = now
  local iv = self.interval
  local n = iv.steps + iv.skipped -- iterations, for the time; n - skipped updates, for the means
  local u = iv.steps > 0 and iv.steps or 0 / 0
  local tps = n * self.tokens_per_step / math.max(dt, 1e-9)
  local rec = {
    step = step, consumed_tokens = consumed, lr = lr, loss = iv.loss / u,
    aux_loss = iv.aux / u, grad_norm = iv.gn / u, tokens_per_s = tps,
    ms_per_iter = 1000 * dt / n, time = os.time(), skipped_steps = iv.skipped,
  }
  if iv.steps == 0 then rec.loss, rec.aux_loss, rec.grad_norm = nil, nil, nil end -- every step skipped
  if self.flops_per_token and self.peak then rec.mfu = self.flops_per_token * tps / self.peak end
  if #iv.counts > 0 then
    rec.expert_counts = {}
    local worst
    for _, name in ipairs(iv.counts) do
      rec.expert_counts[name] = iv.counts[name]
      local b = metrics.load_balance(iv.counts[name])
      if b and (worst == nil or b > worst) then worst = b end
    end
    rec.load_balance = worst
  end
  return rec
end

--- write(rec): rec (from record, perhaps extended by on_log hooks) to metrics.jsonl,
--- TensorBoard and the console; starts the next interval.
function Log:write(rec)
  local step, tb = rec.step, self.tb
  if tb and rec.expert_counts then
    -- per layer: each expert's share as a scalar (up to metrics.EXPERT_LINES_MAX experts), or
    -- (more) one histogram of the experts' load / mean load; and max/mean load as a scalar
    for i, name in ipairs(self.interval.counts) do
      local counts = rec.expert_counts[name]
      local total = 0
      for _, c in ipairs(counts) do total = total + c end
      local layer = tonumber(name:match("%d+")) or (i - 1) -- the block index in "blocks.<i>.ffn"
      local tag = ("expert_load/layer%d"):format(layer)
      if #counts > metrics.EXPERT_LINES_MAX then
        local loads = {}
        for j, c in ipairs(counts) do loads[j] = total > 0 and c * #counts / total or 0 end
        tb:add_histogram(tag, loads, step)
      else
        for j, c in ipairs(counts) do
          tb:add_scalar(("%s/e%d"):format(tag, j - 1), total > 0 and c / total or 0, step)
        end
      end
      local b = metrics.load_balance(counts)
      if b then tb:add_scalar(tag .. "/max_over_mean", b, step) end
    end
  end
  if self.jsonl then self.jsonl:write(rec) end
  if tb then
    tb:add_scalars(step, { loss = rec.loss, lr = rec.lr, grad_norm = rec.grad_norm, tokens_per_s = rec.tokens_per_s,
      aux_loss = rec.aux_loss, mfu = rec.mfu, load_balance = rec.load_balance, skipped_steps = rec.skipped_steps })
    tb:flush()
  end
  self:say(metrics.console_line {
    iteration = step, iterations = self.cfg.steps, consumed_tokens = rec.consumed_tokens,
    ms_per_iter = rec.ms_per_iter, lr = rec.lr, loss = rec.loss, aux_loss = rec.aux_loss,
    grad_norm = rec.grad_norm, tokens_per_s = rec.tokens_per_s, mfu = rec.mfu, load_balance = rec.load_balance,
    extra = (rec.skipped_steps or 0) > 0 and ("number of skipped iterations: %d"):format(rec.skipped_steps) or nil })
  self.interval = new_interval()
end

--- eval(step, val_loss): the validation loss to metrics.jsonl, TensorBoard and the console.
function Log:eval(step, vl)
  if self.jsonl then self.jsonl:write { step = step, val_loss = vl, val_ppl = math.exp(vl) } end
  if self.tb then self.tb:add_scalar("val_loss", vl, step); self.tb:flush() end
  self:say(("-"):rep(20) .. (" validation loss at iteration %d | lm loss value: %.6E | lm loss PPL: %.6E |"):format(
    step, vl, math.exp(vl)))
end

--- bar(done, total): the progress bar (not when quiet).
function Log:bar(done, total)
  if self.writer and not self.cfg.quiet then self.console.bar(done, total, moe.clock() - self.t_run) end
end

--- elapsed() -> seconds since open.
function Log:elapsed() return moe.clock() - self.t_run end

function Log:finish_bar()
  if self.writer then self.console.finish() end
end

--- global(par, losses): data parallelism at a log step: the interval's lm and aux
--- losses become the means over ranks and its expert counts the sums, in one
--- collective (par:sum); losses = {{step, lm, aux}, ...} of the interval's steps
--- (each lm replaced by its global mean). Nothing to do when dp == 1.
function Log:global(par, losses)
  if par.dp == 1 then return end
  local iv, v = self.interval, {}
  for _, e in ipairs(losses) do v[#v + 1] = e[2]; v[#v + 1] = e[3] end
  for _, name in ipairs(iv.counts) do
    for _, c in ipairs(iv.counts[name]) do v[#v + 1] = c end
  end
  local s = par:sum(v)
  iv.loss, iv.aux = 0, 0
  for i, e in ipairs(losses) do
    e[2], e[3] = s[2 * i - 1] / par.dp, s[2 * i] / par.dp
    iv.loss = iv.loss + e[2] -- in step order, as add_step summed them
    iv.aux = iv.aux + e[3]
  end
  local k = 2 * #losses
  for _, name in ipairs(iv.counts) do
    local a = iv.counts[name]
    for j = 1, #a do k = k + 1; a[j] = math.tointeger(s[k]) or s[k] end
  end
end

function Log:close()
  if not self.writer then return end
  self.jsonl:close()
  if self.tb then self.tb:close() end
end

return M
