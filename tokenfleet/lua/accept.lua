-- Check freshly read (or claimed) jobs-stream entries against the jobs' state, and mark
-- the genuine ones running on this worker. Only the entry the submit script recorded
-- for a job is that job: anyone who can XADD can add an entry naming any job id.
--
-- Run with owned_entry.lua prepended.
--
-- KEYS[1]         jobs stream
-- KEYS[2i], KEYS[2i+1]  job state hash and cancel flag of entry i, i = 1..n
-- ARGV[1]  consumer group   ARGV[2]  this worker   ARGV[3]  '' (the entry ids follow)
-- ARGV[4]  now, unix seconds (started_at)
-- ARGV[4+i]  entry i's id
--
-- Reply: per entry {verdict, cancelled (0/1)}:
--   'ok'           the job's state records this entry, which is pending to this worker:
--                  marked running here
--   'lost'         the entry is not pending to this worker (any more): a worker that was
--                  paused while another claimed it; nothing written
--   'unsubmitted'  no state for the job (never submitted through the submit script, or
--                  its state expired): serve nothing, never create its state
--   'duplicate'    the job's state records another entry (a spoofed or repeated XADD)
--   'finished'     the job already ended: its result stands
-- Nothing but the 'ok' entries' own hashes is written.
local reply = {}
for i = 1, #ARGV - 4 do
  local hash, cancel, entry = KEYS[2 * i], KEYS[2 * i + 1], ARGV[4 + i]
  local state = redis.call('HMGET', hash, 'status', 'entry', 'stream')
  local flag = redis.call('EXISTS', cancel)
  if owner_of(entry) ~= ARGV[2] then
    reply[i] = {'lost', flag}
  elseif not state[1] then
    reply[i] = {'unsubmitted', flag}
  elseif state[2] ~= entry or state[3] ~= KEYS[1] then
    reply[i] = {'duplicate', flag}
  elseif state[1] == 'finished' then
    reply[i] = {'finished', flag}
  else
    redis.call('HSET', hash, 'status', 'running', 'worker', ARGV[2], 'started_at', ARGV[4])
    reply[i] = {'ok', flag}
  end
end
return reply
