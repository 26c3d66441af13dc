-- Functions for the scripts that act on a jobs-stream entry this worker owns
-- (tick.lua, accept.lua, dead_letter.lua, redeliver.lua, requeue.lua). Not a script by itself:
-- tokenfleet/lua/__init__.py prepends this file to each of them.
--
-- Those scripts share this calling convention:
--   KEYS[1]  jobs stream            (keys.jobs(model, band); tick.lua, accept.lua: one
--                                    per job, further on)
--   ARGV[1]  consumer group         (keys.GROUP)
--   ARGV[2]  this worker            (its consumer name)
--   ARGV[3]  the jobs-stream entry id (tick.lua, accept.lua: one per job, further on)
--   ARGV[4]  now, unix seconds

-- The consumer `entry` of `stream` is pending to, or false when it is pending to nobody
-- (finished, never read, or the stream/group is gone after a Redis restart).
local function owner_of(stream, entry)
  local pending = redis.pcall('XPENDING', stream, ARGV[1], entry, entry, 1)
  if pending.err or pending[1] == nil then
    return false
  end
  return pending[1][2]
end

local function owner()
  return owner_of(KEYS[1], ARGV[3])
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
--   queued, running   the tenant's sets of queued and running jobs (keys.tenant_queued,
--            keys.tenant_running): the job leaves both
--   job      the job id (the member of those sets)
local function terminal_writes(t)
  redis.call('SET', t.result, t.result_data, 'EX', t.result_ttl)
  redis.call('ZREM', t.queued, t.job)
  redis.call('ZREM', t.running, t.job)
  redis.call('HSET', t.hash, 'status', 'finished', 'finish_reason', t.reason, 'worker', ARGV[2])
  redis.call('EXPIRE', t.hash, t.hash_ttl)
  redis.call('XADD', t.events, 'MAXLEN', '~', t.maxlen, '*', 'm', t.finish_data)
  redis.call('EXPIRE', t.events, t.events_ttl)
  redis.call('PUBLISH', t.channel, t.finish_data)
end

-- The terminal block as dead_letter.lua passes it: keys KEYS[k..k+4]
-- (result, job hash, replay stream, tenant's queued set, tenant's running set), args
-- ARGV[a..a+8] (result data, its TTL, finish reason, job hash TTL, finish event, events
-- maxlen, events TTL, live channel, job id).
local function terminal(k, a)
  terminal_writes({
    result = KEYS[k], hash = KEYS[k + 1], events = KEYS[k + 2],
    queued = KEYS[k + 3], running = KEYS[k + 4],
    result_data = ARGV[a], result_ttl = ARGV[a + 1], reason = ARGV[a + 2],
    hash_ttl = ARGV[a + 3], finish_data = ARGV[a + 4], maxlen = ARGV[a + 5],
    events_ttl = ARGV[a + 6], channel = ARGV[a + 7], job = ARGV[a + 8],
  })
end

-- Ack and delete an entry together (Redis 7.0 has no XACKDEL): XLEN stays the depth.
local function ack_delete_entry(stream, entry)
  redis.call('XACK', stream, ARGV[1], entry)
  redis.call('XDEL', stream, entry)
end

local function ack_delete()
  ack_delete_entry(KEYS[1], ARGV[3])
end
