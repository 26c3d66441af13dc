-- Functions for the scripts that act on a jobs-stream entry this worker owns
-- (tick.lua, accept.lua, dead_letter.lua, redeliver.lua, requeue.lua). Not a script by itself:
-- tokenfleet/lua/__init__.py prepends this file to each of them.
--
-- Those scripts share this calling convention (tokenfleet/lua/calls.py; tick.lua and
-- accept.lua take their streams and entry ids per job, further on, and ARGV[3] no_entry):
-- KEYS[1]  stream    jobs stream (keys.jobs(model, band))
-- ARGV[1]  group     consumer group (keys.GROUP)
-- ARGV[2]  worker    this worker (its consumer name)
-- ARGV[3]  entry_id  the jobs-stream entry id
-- ARGV[4]  now       unix seconds

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

-- The job's terminal writes. `t` holds the fields of calls.py's JobTarget, Finish and
-- Retention, by the same names (tick.lua and dead_letter.lua fill it from their slots):
--   JobTarget  result   result string key (keys.result)
--              hash     job state hash (keys.job)
--              events   replay stream (keys.events)
--              queued, running   the tenant's sets of queued and running jobs
--                       (keys.tenant_queued, keys.tenant_running): the job leaves both
--              channel  the job's live channel (keys.channel): a channel, not a key
--              publish  'PUBLISH', or 'SPUBLISH' for a shard channel (keys.publish)
--              job_id   the job id (the member of those sets)
--   Finish     reason   finish reason
--              result_data  msgpack JobResult
--              finish_data  msgpack FinishEvent
--   Retention  result_ttl   RESULT_TTL_S
--              hash_ttl     JOB_STATE_TTL_S (refreshed)
--              maxlen       EVENTS_MAXLEN (approximate)
--              events_ttl   EVENTS_TTL_S
--   announced  true when the caller appended and published the finish event itself
--              (tick.lua: with the job's last tokens, in one entry)
local function terminal_writes(t)
  redis.call('SET', t.result, t.result_data, 'EX', t.result_ttl)
  redis.call('ZREM', t.queued, t.job_id)
  redis.call('ZREM', t.running, t.job_id)
  redis.call('HSET', t.hash, 'status', 'finished', 'finish_reason', t.reason, 'worker', ARGV[2])
  redis.call('EXPIRE', t.hash, t.hash_ttl)
  if not t.announced then
    redis.call('XADD', t.events, 'MAXLEN', '~', t.maxlen, '*', 'm', t.finish_data)
  end
  redis.call('EXPIRE', t.events, t.events_ttl)
  if not t.announced then
    redis.call(t.publish, t.channel, t.finish_data)
  end
end

-- Ack and delete an entry together (Redis 7.0 has no XACKDEL): XLEN stays the depth.
local function ack_delete_entry(stream, entry)
  redis.call('XACK', stream, ARGV[1], entry)
  redis.call('XDEL', stream, entry)
end

local function ack_delete()
  ack_delete_entry(KEYS[1], ARGV[3])
end
