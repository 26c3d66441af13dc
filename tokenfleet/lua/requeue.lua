-- Put a job this worker holds but has not been able to start back at the tail of its
-- band's stream, for any worker (bands.py: a job waiting on a worker past `hold_s`).
-- The same move as accept.lua's max_running deferral: a new entry with the old one's
-- fields, recorded in the job's state, the old one acked and deleted, all in one script,
-- so the job is the new entry's from here on; this worker's later writes for the old
-- entry are refused (the fence). The job counts as queued again for its tenant. Tokens
-- it already emitted stay in its replay stream; whoever starts it resumes after them
-- (accept.lua hands back `emitted`).
-- Run with owned_entry.lua prepended. KEYS and ARGV by name: tokenfleet/lua/calls.py
-- RequeueCall (notation: lua/layout.py).
--
-- KEYS[1]  stream    jobs stream
-- KEYS[2]  hash      job state hash
-- KEYS[3]  queued    the tenant's queued set
-- KEYS[4]  running   the tenant's running set
-- ARGV[1]  group     consumer group
-- ARGV[2]  worker    this worker
-- ARGV[3]  entry_id  entry id
-- ARGV[4]  now       unix seconds (the queued score when the job's submit time is unknown)
-- ARGV[5]  job_id    job id
--
-- Reply: the new entry's id, or false with nothing written when the entry is not this
-- worker's (any more), is not the job's recorded one, the job has finished, or the
-- entry's data is gone (nothing to copy: the worker keeps it and serves it).
local state = redis.call('HMGET', KEYS[2], 'status', 'entry', 'stream', 'submitted_at')
if owner() ~= ARGV[2] or state[1] == 'finished' or state[2] ~= ARGV[3]
    or state[3] ~= KEYS[1] then
  return false
end
local copy = redis.call('XRANGE', KEYS[1], ARGV[3], ARGV[3])[1]
if not copy then
  return false
end
ack_delete()
local again = redis.call('XADD', KEYS[1], '*', unpack(copy[2]))
redis.call('HSET', KEYS[2], 'entry', again, 'status', 'queued')
redis.call('ZREM', KEYS[4], ARGV[5])
redis.call('ZADD', KEYS[3], state[4] or ARGV[4], ARGV[5])
return again
