-- Read up to `count` new entries for this worker from a model's priority bands: the
-- highest band that has waiting entries first, except that a band which waited while
-- `guard` jobs were pulled from higher bands gets the next pull (the starvation guard).
-- The guard's counts live in one hash per model, so the share holds fleet-wide.
--
-- KEYS and ARGV by name: tokenfleet/lua/calls.py PullCall (notation: lua/layout.py).
-- KEYS[1..n]       bands[]         the model's n bands, highest first (keys.bands(model)):
-- KEYS[i]          bands[].stream  band i's jobs stream
-- KEYS[n+1]        pulls           the guard's counts (keys.pulls(model)): band name ->
--                                  jobs pulled from higher bands while it waited
-- ARGV[1]          group           consumer group
-- ARGV[2]          worker          this worker
-- ARGV[3]          count           how many it may take
-- ARGV[4]          guard           the starvation guard
-- ARGV[5..n+4]     bands[]         the bands' names, in KEYS order:
-- ARGV[i+4]        bands[].name    band i's name
-- ARGV[n+5]        extra           how many more it may take from the highest band alone
--                                  (a worker with no room but lower-band jobs running,
--                                  which these would preempt)
-- ARGV[n+6..2n+5]  bands[]         floor, per band:
-- ARGV[n+i+5]      bands[].floor   '1' when this worker holds no job of band i and takes
--                                  one of it if one waits, room or not (its share of the
--                                  worker's tokens needs work there: worker/bands.py);
--                                  '0' (or absent) otherwise
-- ARGV[2n+6]       ceiling         the lowest band index this call may take by rank: a
--                                  band below it waits (a higher one waits in another
--                                  partition of the queue); n: none held back. A band the
--                                  starvation guard makes due, `extra` and `floor` ignore it
--
-- Reply: {pulled, top}: pulled a list of {band index (0 = highest), entry id, fields},
-- fields a flat [f1, v1, ...] list, in the order pulled; top the highest band index with
-- entries still waiting after the pull (n: none), for the worker's next ceilings. Errors
-- with NOGROUP when a band's stream exists without the group (Redis restarted, or a new
-- band): create it and pull again.
local n = #KEYS - 1
local guard = tonumber(ARGV[4])
local ceiling = tonumber(ARGV[2 * n + 6]) or n

-- Whether stream `s` holds an entry the group has not delivered yet.
local function waiting(s)
  if redis.call('EXISTS', s) == 0 then
    return false
  end
  local last = nil
  for _, group in ipairs(redis.call('XINFO', 'GROUPS', s)) do
    local info = {}
    for f = 1, #group, 2 do
      info[group[f]] = group[f + 1]
    end
    if info['name'] == ARGV[1] then
      last = info['last-delivered-id']
    end
  end
  if not last then
    return redis.error_reply('NOGROUP no group ' .. ARGV[1] .. ' on ' .. s)
  end
  local newest = redis.call('XREVRANGE', s, '+', '-', 'COUNT', 1)[1]
  if not newest then
    return false
  end
  local nm, ns = string.match(newest[1], '(%d+)-(%d+)')
  local lm, ls = string.match(last, '(%d+)-(%d+)')
  nm, ns, lm, ls = tonumber(nm), tonumber(ns), tonumber(lm), tonumber(ls)
  return nm > lm or (nm == lm and ns > ls)
end

local extra = tonumber(ARGV[5 + n]) or 0
local floor = false
for b = 1, n do
  floor = floor or ARGV[5 + n + b] == '1'
end
if tonumber(ARGV[3]) <= 0 and not floor then
  -- Only the highest band may be read (a full worker's preempting pull, every tick):
  -- nothing waiting there is the common case, so answer it with one look and no write.
  local top = extra > 0 and waiting(KEYS[1])
  if type(top) == 'table' then
    return top
  end
  if not top then
    return {{}, n}  -- (the lower bands were not looked at: no ceiling learnt)
  end
end

local open, passed = {}, {}
local counts = redis.call('HMGET', KEYS[n + 1], unpack(ARGV, 5, 4 + n))
for b = 1, n do
  local w = waiting(KEYS[b])
  if type(w) == 'table' then
    return w
  end
  open[b] = w
  passed[b] = w and (tonumber(counts[b]) or 0) or 0
end

local out = {}
local got = {}  -- band -> entries this call pulled of it

-- Pull up to `want` entries of band `b`; returns how many came.
local function take(b, want)
  local reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', want,
                           'STREAMS', KEYS[b], '>')
  local entries = {}
  if reply then
    entries = reply[1][2]  -- {{stream, entries}}, or nil when nothing came
  end
  if #entries < want then
    open[b] = false
  else
    open[b] = waiting(KEYS[b]) == true  -- it may have just emptied
  end
  for _, e in ipairs(entries) do
    out[#out + 1] = {b - 1, e[1], e[2]}
  end
  got[b] = (got[b] or 0) + #entries
  if #entries > 0 then
    passed[b] = 0
    for below = b + 1, n do
      if open[below] then
        passed[below] = passed[below] + #entries
      end
    end
  end
  return #entries
end

local left = tonumber(ARGV[3])
while left > 0 do
  local pick, want = nil, 1
  for b = 1, n do
    if open[b] and passed[b] >= guard then
      pick = b
      break
    end
  end
  if not pick then
    for b = 1, n do
      if open[b] and b - 1 <= ceiling then
        pick = b
        break
      end
    end
    if not pick then
      break
    end
    -- As many as can be pulled from this band before a band below is due.
    want = left
    for b = pick + 1, n do
      if open[b] then
        want = math.min(want, guard - passed[b])
      end
    end
  end
  left = left - take(pick, want)
end
if extra > 0 and open[1] then
  take(1, extra)
end
for b = 1, n do
  if ARGV[5 + n + b] == '1' and open[b] and not got[b] then
    take(b, 1)
  end
end

-- The guard's counts, written only when one changed (this runs every tick).
local flat, changed = {}, false
for b = 1, n do
  local now = open[b] and passed[b] or 0  -- a band that emptied starts over
  changed = changed or now ~= (tonumber(counts[b]) or 0)
  flat[#flat + 1] = ARGV[4 + b]
  flat[#flat + 1] = now
end
if changed then
  redis.call('HSET', KEYS[n + 1], unpack(flat))
end
local top = n
for b = n, 1, -1 do
  if open[b] then
    top = b - 1
  end
end
return {out, top}
