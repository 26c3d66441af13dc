-- Functions for the scripts that act on a jobs-stream entry this worker owns
-- (finish.lua, dead_letter.lua, redeliver.lua). Not a script by itself:
-- tokenfleet.worker.queue prepends this file to each of them before registering it.
--
-- Those scripts share this calling convention:
--   KEYS[1]  jobs stream            (keys.jobs(model))
--   ARGV[1]  consumer group         (keys.GROUP)
--   ARGV[2]  this worker            (its consumer name)
--   ARGV[3]  the jobs-stream entry id
--   ARGV[4]  now, unix seconds

-- The consumer the entry is pending to, or false when it is pending to nobody
-- (finished, never read, or the stream/group is gone after a Redis restart).
local function owner()
  local pending = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
  if pending.err or pending[1] == nil then
    return false
  end
  return pending[1][2]
end

-- The job's terminal writes: keys KEYS[k], KEYS[k+1], KEYS[k+2], args ARGV[a] .. ARGV[a+7]:
--   KEYS[k]    result string (keys.result)     ARGV[a]    msgpack JobResult
--                                              ARGV[a+1]  RESULT_TTL_S
--   KEYS[k+1]  job state hash (keys.job)       ARGV[a+2]  finish reason
--                                              ARGV[a+3]  JOB_STATE_TTL_S (refreshed)
--   KEYS[k+2]  replay stream (keys.events)     ARGV[a+4]  msgpack FinishEvent
--                                              ARGV[a+5]  EVENTS_MAXLEN (approximate)
--                                              ARGV[a+6]  EVENTS_TTL_S
--   ARGV[a+7]  the job's live channel (keys.channel): a channel, not a key, so it is an ARGV
local function terminal(k, a)
  redis.call('SET', KEYS[k], ARGV[a], 'EX', ARGV[a + 1])
  redis.call('HSET', KEYS[k + 1], 'status', 'finished', 'finish_reason', ARGV[a + 2],
             'worker', ARGV[2])
  redis.call('EXPIRE', KEYS[k + 1], ARGV[a + 3])
  redis.call('XADD', KEYS[k + 2], 'MAXLEN', '~', ARGV[a + 5], '*', 'm', ARGV[a + 4])
  redis.call('EXPIRE', KEYS[k + 2], ARGV[a + 6])
  redis.call('PUBLISH', ARGV[a + 7], ARGV[a + 4])
end

-- Ack and delete the entry together (Redis 7.0 has no XACKDEL): XLEN stays the depth.
local function ack_delete()
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
  redis.call('XDEL', KEYS[1], ARGV[3])
end
