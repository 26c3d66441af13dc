-- Functions for the scripts that act on a jobs-stream entry this worker owns
-- (tick.lua, accept.lua, dead_letter.lua, redeliver.lua). Not a script by itself:
-- tokenfleet/lua/__init__.py prepends this file to each of them.
--
-- Those scripts share this calling convention:
--   KEYS[1]  jobs stream            (keys.jobs(model))
--   ARGV[1]  consumer group         (keys.GROUP)
--   ARGV[2]  this worker            (its consumer name)
--   ARGV[3]  the jobs-stream entry id (tick.lua: one per job, further on)
--   ARGV[4]  now, unix seconds

-- The consumer `entry` is pending to, or false when it is pending to nobody
-- (finished, never read, or the stream/group is gone after a Redis restart).
local function owner_of(entry)
  local pending = redis.pcall('XPENDING', KEYS[1], ARGV[1], entry, entry, 1)
  if pending.err or pending[1] == nil then
    return false
  end
  return pending[1][2]
end

local function owner()
  return owner_of(ARGV[3])
end

-- The job's terminal writes. `t` holds:
--   result   result string key (keys.result)      result_data  msgpack JobResult
--                                                 result_ttl   RESULT_TTL_S
--   hash     job state hash (keys.job)            reason       finish reason
--                                                 hash_ttl     JOB_STATE_TTL_S (refreshed)
--   events   replay stream (keys.events)          finish_data  msgpack FinishEvent
--                                                 maxlen       EVENTS_MAXLEN (approximate)
--                                                 events_ttl   EVENTS_TTL_S
--   channel  the job's live channel (keys.channel): a channel, not a key
local function terminal_writes(t)
  redis.call('SET', t.result, t.result_data, 'EX', t.result_ttl)
  redis.call('HSET', t.hash, 'status', 'finished', 'finish_reason', t.reason, 'worker', ARGV[2])
  redis.call('EXPIRE', t.hash, t.hash_ttl)
  redis.call('XADD', t.events, 'MAXLEN', '~', t.maxlen, '*', 'm', t.finish_data)
  redis.call('EXPIRE', t.events, t.events_ttl)
  redis.call('PUBLISH', t.channel, t.finish_data)
end

-- The terminal block as dead_letter.lua passes it: keys KEYS[k..k+2]
-- (result, job hash, replay stream), args ARGV[a..a+7] (result data, its TTL, finish
-- reason, job hash TTL, finish event, events maxlen, events TTL, live channel).
local function terminal(k, a)
  terminal_writes({
    result = KEYS[k], hash = KEYS[k + 1], events = KEYS[k + 2],
    result_data = ARGV[a], result_ttl = ARGV[a + 1], reason = ARGV[a + 2],
    hash_ttl = ARGV[a + 3], finish_data = ARGV[a + 4], maxlen = ARGV[a + 5],
    events_ttl = ARGV[a + 6], channel = ARGV[a + 7],
  })
end

-- Ack and delete an entry together (Redis 7.0 has no XACKDEL): XLEN stays the depth.
local function ack_delete_entry(entry)
  redis.call('XACK', KEYS[1], ARGV[1], entry)
  redis.call('XDEL', KEYS[1], entry)
end

local function ack_delete()
  ack_delete_entry(ARGV[3])
end
