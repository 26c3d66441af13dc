-- Check freshly read (or claimed) jobs-stream entries against the jobs' state, and mark
-- the genuine ones running on this worker. Only the entry the submit script recorded
-- for a job is that job: anyone who can XADD can add an entry naming any job id.
-- A job whose tenant already runs its `max_running` jobs of the model is put back at
-- the tail of its band instead (a new entry, recorded in its state): it waits without
-- holding this worker's slot, and the jobs behind it are served meanwhile.
--
-- Run with owned_entry.lua prepended. KEYS and ARGV by name: tokenfleet/lua/calls.py
-- AcceptCall (notation: lua/layout.py).
--
-- KEYS[1..7n]  entries[]                 seven keys per entry i = 1..n:
-- KEYS[7i-6]   entries[].stream          the jobs stream the entry was read from
-- KEYS[7i-5]   entries[].hash            job state hash
-- KEYS[7i-4]   entries[].cancel          cancel flag
-- KEYS[7i-3]   entries[].queued          the tenant's queued set
-- KEYS[7i-2]   entries[].running         the tenant's running set
-- KEYS[7i-1]   entries[].limits          the tenant's limits
-- KEYS[7i]     entries[].default_limits  the default limits
-- ARGV[1]      group                     consumer group
-- ARGV[2]      worker                    this worker
-- ARGV[3]      no_entry                  '' (the entry ids follow)
-- ARGV[4]      now                       unix seconds (started_at)
-- ARGV[5..2n+4]  entries[]               two args per entry i:
-- ARGV[2i+3]   entries[].entry_id        its entry id
-- ARGV[2i+4]   entries[].job_id          its job id
--
-- Reply: per entry {verdict, cancelled (0/1), submitted_at, emitted, cache group}, the
-- last three '' unless ok: emitted = token indices the job's replay stream holds (the
-- hash's `emitted`: a job put back by a worker, or claimed, resumes after them), cache
-- group = the tenant's `cache_group`, else the default limits' ('' for none):
--   'ok'           the job's state records this entry, which is pending to this worker:
--                  marked running here, counted in its tenant's running set
--   'deferred'     as 'ok', but its tenant is at max_running: re-queued at the tail
--                  of its band, acked and deleted here; not this worker's
--   'lost'         the entry is not pending to this worker (any more): a worker that was
--                  paused while another claimed it; nothing written
--   'unsubmitted'  no state for the job (never submitted through the submit script, or
--                  its state expired): serve nothing, never create its state
--   'duplicate'    the job's state records another entry (a spoofed or repeated XADD)
--   'finished'     the job already ended: its result stands
-- Nothing but the 'ok' and 'deferred' entries' own state is written.
local reply = {}
local n = (#ARGV - 4) / 2
for i = 1, n do
  local k = 1 + 7 * (i - 1)
  local stream, hash, cancel = KEYS[k], KEYS[k + 1], KEYS[k + 2]
  local queued, running, limits, defaults = KEYS[k + 3], KEYS[k + 4], KEYS[k + 5], KEYS[k + 6]
  local entry, job = ARGV[3 + 2 * i], ARGV[4 + 2 * i]
  local state = redis.call('HMGET', hash, 'status', 'entry', 'stream', 'submitted_at')
  local flag = redis.call('EXISTS', cancel)
  if owner_of(stream, entry) ~= ARGV[2] then
    reply[i] = {'lost', flag, '', '', ''}
  elseif not state[1] then
    reply[i] = {'unsubmitted', flag, '', '', ''}
  elseif state[2] ~= entry or state[3] ~= stream then
    reply[i] = {'duplicate', flag, '', '', ''}
  elseif state[1] == 'finished' then
    reply[i] = {'finished', flag, '', '', ''}
  else
    local most = tonumber(redis.call('HGET', limits, 'max_running') or '')
      or tonumber(redis.call('HGET', defaults, 'max_running') or '')
    local at_limit = most and flag == 0 and state[1] == 'queued'
      and not redis.call('ZSCORE', running, job)
      and redis.call('ZCARD', running) >= most
    local copy = at_limit and redis.call('XRANGE', stream, entry, entry)[1]
    if copy then  -- (an entry whose data was deleted while pending just starts)
      local fields = copy[2]
      ack_delete_entry(stream, entry)
      local again = redis.call('XADD', stream, '*', unpack(fields))
      redis.call('HSET', hash, 'entry', again)
      reply[i] = {'deferred', flag, '', '', ''}
    else
      redis.call('HSET', hash, 'status', 'running', 'worker', ARGV[2], 'started_at', ARGV[4])
      redis.call('ZREM', queued, job)
      redis.call('ZADD', running, ARGV[4], job)
      local group = redis.call('HGET', limits, 'cache_group')
        or redis.call('HGET', defaults, 'cache_group') or ''
      local emitted = redis.call('HGET', hash, 'emitted') or '0'
      reply[i] = {'ok', flag, state[4] or '', emitted, group}
    end
  end
end
return reply
