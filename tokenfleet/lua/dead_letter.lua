-- Move one jobs-stream entry to the dead-letter stream, only if this worker owns it,
-- and, when the job id is known, give the job its terminal event (rejected / error).
-- Run with owned_entry.lua prepended (it documents KEYS[1] and ARGV[1..4]).
--
-- KEYS[1]  jobs stream
-- KEYS[2]  dead-letter stream (keys.dead_letters())
-- KEYS[3..7]  optional: result string, job state hash, replay stream, the tenant's queued
--             and running sets (only with ARGV[12..20])
-- ARGV[1]  group  ARGV[2]  this worker  ARGV[3]  entry id  ARGV[4]  now (unix s)
-- ARGV[5]  job id, or ''          ARGV[6]  reason (stable string)   ARGV[7]  message
-- ARGV[8]  delivery count         ARGV[9]  original payload, or ''
-- ARGV[10] DEAD_LETTERS_MAXLEN    ARGV[11] '1' when the entry's data was deleted while
--          pending and a claim already took it off the pending list (Delivery.lost);
--          it is then accepted when pending to nobody and absent from the stream
-- ARGV[12..20]  optional terminal block, see terminal() in owned_entry.lua
--
-- The job id comes from the entry or its payload, which anyone who can XADD wrote: the
-- terminal block is skipped unless the job's state hash records this very entry (a job
-- submitted as another entry, or never submitted, must not be ended or given state).
--
-- Replies:
--   1  dead letter written (+ terminal writes), entry acked and deleted
--   0  the entry is not this worker's: nothing written
local mine = owner()
if mine ~= ARGV[2] then
  local gone = ARGV[11] == '1' and not mine and #redis.call('XRANGE', KEYS[1], ARGV[3], ARGV[3]) == 0
  if not gone then
    return 0
  end
end
-- Approximate trimming (~) is fine for this log: the oldest records go first, a few late.
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[10], '*',
           'job_id', ARGV[5], 'entry', ARGV[3], 'stream', KEYS[1], 'reason', ARGV[6],
           'message', ARGV[7], 'worker', ARGV[2], 'deliveries', ARGV[8], 'at', ARGV[4],
           'payload', ARGV[9])
if #KEYS == 7 then
  local entry = redis.call('HGET', KEYS[4], 'entry')
  if entry == ARGV[3] then
    terminal(3, 12)
  end
end
ack_delete()
return 1
