-- Move one jobs-stream entry to the dead-letter stream, only if this worker owns it,
-- and, when the job id is known, give the job its terminal event (rejected / error).
-- Run with owned_entry.lua prepended. KEYS and ARGV by name: tokenfleet/lua/calls.py
-- DeadLetterCall (notation: lua/layout.py); its terminal block is a Terminal: the job's
-- JobTarget, Finish and Retention, the same shape as tick.lua's terminal writes.
--
-- KEYS[1]      stream                 jobs stream
-- KEYS[2]      dead_letters           dead-letter stream (keys.dead_letters())
-- KEYS[3..7]   terminal?              optional, with ARGV[12..21]:
-- KEYS[3]      terminal?.job.result   result string
-- KEYS[4]      terminal?.job.hash     job state hash
-- KEYS[5]      terminal?.job.events   replay stream
-- KEYS[6]      terminal?.job.queued   the tenant's queued set
-- KEYS[7]      terminal?.job.running  the tenant's running set
-- ARGV[1]      group                  consumer group
-- ARGV[2]      worker                 this worker
-- ARGV[3]      entry_id               entry id
-- ARGV[4]      now                    unix seconds
-- ARGV[5]      job_id                 job id, or ''
-- ARGV[6]      reason                 reason (stable string)
-- ARGV[7]      message                message
-- ARGV[8]      deliveries             delivery count
-- ARGV[9]      payload                original payload, or ''
-- ARGV[10]     maxlen                 DEAD_LETTERS_MAXLEN
-- ARGV[11]     lost                   '1' when the entry's data was deleted while pending
--                                     and a claim already took it off the pending list
--                                     (Delivery.lost); it is then accepted when pending
--                                     to nobody and absent from the stream
-- ARGV[12..21] terminal?              optional, with KEYS[3..7]:
-- ARGV[12]     terminal?.finish.result_data     msgpack JobResult
-- ARGV[13]     terminal?.retention.result_ttl   RESULT_TTL_S
-- ARGV[14]     terminal?.finish.reason          finish reason
-- ARGV[15]     terminal?.retention.hash_ttl     JOB_STATE_TTL_S
-- ARGV[16]     terminal?.finish.finish_data     msgpack FinishEvent
-- ARGV[17]     terminal?.retention.maxlen       EVENTS_MAXLEN
-- ARGV[18]     terminal?.retention.events_ttl   EVENTS_TTL_S
-- ARGV[19]     terminal?.job.channel            live channel
-- ARGV[20]     terminal?.job.job_id             job id
-- ARGV[21]     terminal?.job.publish            'PUBLISH' or 'SPUBLISH'
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
    terminal_writes({
      result = KEYS[3], hash = KEYS[4], events = KEYS[5], queued = KEYS[6], running = KEYS[7],
      result_data = ARGV[12], result_ttl = ARGV[13], reason = ARGV[14], hash_ttl = ARGV[15],
      finish_data = ARGV[16], maxlen = ARGV[17], events_ttl = ARGV[18], channel = ARGV[19],
      job_id = ARGV[20], publish = ARGV[21],
    })
  end
end
ack_delete()
return 1
