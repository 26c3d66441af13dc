-- One tick of one worker, in one call: for every job it holds, check that it still owns
-- the job's current delivery, then append the tick's token events (each index once),
-- announce them live, and end the job when it finished. A worker that lost a job (its
-- entry was claimed by another worker or finished, or the job's state records another
-- entry) writes nothing for it: the fence is in the same script as the writes.
-- Run with owned_entry.lua prepended. KEYS and ARGV by name: tokenfleet/lua/calls.py
-- TickCall (notation: lua/layout.py); the terminal writes take a job's JobTarget, Finish
-- and the tick's Retention, the same shape as dead_letter.lua's terminal block.
--
-- KEYS[1..7n]  held[]                  seven keys per held job i = 1..n:
-- KEYS[7i-6]   held[].stream           its jobs stream (the band it was read from)
-- KEYS[7i-5]   held[].job.hash         job state hash
-- KEYS[7i-4]   held[].job.events       replay stream
-- KEYS[7i-3]   held[].job.result       result string
-- KEYS[7i-2]   held[].cancel           cancel flag
-- KEYS[7i-1]   held[].job.queued       the tenant's queued set
-- KEYS[7i]     held[].job.running      the tenant's running set
-- ARGV[1]      group                   consumer group
-- ARGV[2]      worker                  this worker
-- ARGV[3]      no_entry                '' (the entry ids are per job)
-- ARGV[4]      now                     unix seconds
-- ARGV[5]      retention.maxlen        EVENTS_MAXLEN
-- ARGV[6]      retention.events_ttl    EVENTS_TTL_S
-- ARGV[7]      retention.result_ttl    RESULT_TTL_S
-- ARGV[8]      retention.hash_ttl      JOB_STATE_TTL_S
-- ARGV[9]      n                       jobs
-- ARGV[10..]   held[]                  per job, in order, from its first arg a (10 for
--                                      the first job; the next job's follows its last):
-- ARGV[a]      held[].entry_id         entry id
-- ARGV[a+1]    held[].job.job_id       job id
-- ARGV[a+2]    held[].job.channel      live channel
-- ARGV[a+3]    held[].job.publish      'PUBLISH', or 'SPUBLISH' (a shard channel: a cluster)
-- ARGV[a+4]    held[].durable          -1, or (durable mode) the indices a replica holds
-- ARGV[a+5]    held[].announce         durable mode: the events to announce now, or ''
-- ARGV[a+6]    held[].count            k, its token events
-- ARGV[a+7]    held[].ends             '1' when the job ends this tick, else '0'
-- ARGV[a+8..a+2k+7]  held[].tokens[]   token event e = 1..k:
-- ARGV[a+2e+6] held[].tokens[].index   its index
-- ARGV[a+2e+7] held[].tokens[].data    msgpack TokenEvent
-- ARGV[a+2k+8..a+2k+10]  held[].end?   only when it ends:
-- ARGV[a+2k+8] held[].end?.reason      finish reason
-- ARGV[a+2k+9] held[].end?.result_data msgpack JobResult
-- ARGV[a+2k+10] held[].end?.finish_data msgpack FinishEvent
--
-- A job's new events (and its finish event, when it ends) go into ONE replay entry and
-- ONE message: their msgpack encodings back to back (docs/protocol.md), so a worker that
-- coalesces several ticks' tokens of a job (--stream-interval) costs one write of each.
--
-- Durable mode (a fleet with replicas, docs/design.md "Failover"): a job's `durable` is
-- the number of its token indices a replica acknowledged (WAIT after the tick that wrote
-- them), and nothing past it may reach a client: the fresh events are appended but not
-- published, `announce` (the worker's copy of the events that became durable) is
-- published instead, and the hash's `durable` field bounds what replay readers deliver.
-- The field is set with the job's first events, so no reader sees an event without it.
-- A plain tick (durable -1) keeps a `durable` field it finds equal to `emitted`.
--
-- Reply: per job {verdict, next}, next = indices now in its replay stream (the job
-- hash's `emitted` field):
--   'ok'     owned, events appended
--   'cancel' owned, events appended, and its client asked to cancel
--   'done'   owned and ended: result stored, finish event sent, entry acked + deleted
--   'lost'   not this worker's (any more): nothing written; drop the job
--   'gap'    owned, but an event skipped an index the stream lacks: appended up to the
--            hole, not ended; resend from `next`
-- An event whose index the stream already holds is skipped, so resending all of a
-- job's events after a reconnect appends only what the stream lacks.
local n = tonumber(ARGV[9])
local a = 10
local reply = {}
for j = 1, n do
  local k0 = 1 + 7 * (j - 1)
  local stream, hash, events, result = KEYS[k0], KEYS[k0 + 1], KEYS[k0 + 2], KEYS[k0 + 3]
  local cancel, queued, running = KEYS[k0 + 4], KEYS[k0 + 5], KEYS[k0 + 6]
  local entry, job, channel, publish = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  local durable, announce = tonumber(ARGV[a + 4]), ARGV[a + 5]
  local count, ends = tonumber(ARGV[a + 6]), ARGV[a + 7] == '1'
  local first = a + 8
  a = first + 2 * count + (ends and 3 or 0)

  local state = redis.call('HMGET', hash, 'entry', 'emitted', 'status', 'durable')
  if owner_of(stream, entry) ~= ARGV[2] or state[1] ~= entry or state[3] == 'finished' then
    reply[j] = {'lost', 0}
  else
    local next = tonumber(state[2]) or 0
    local start = next
    local gap = false
    local fresh = {}  -- the events the replay stream lacks, in index order
    for e = 0, count - 1 do
      local index = tonumber(ARGV[first + 2 * e])
      if index == next then
        fresh[#fresh + 1] = ARGV[first + 2 * e + 1]
        next = next + 1
      elseif index > next then
        gap = true
        break
      end
    end
    local finishing = ends and not gap
    if finishing then
      fresh[#fresh + 1] = ARGV[first + 2 * count + 2]  -- the finish event, in the same entry
    end
    local raise = nil  -- the hash's new `durable`, written with `emitted` in one HSET
    if durable >= 0 then
      if announce ~= '' then
        redis.call(publish, channel, announce)
      end
      local known = tonumber(state[4])
      if known == nil or durable > known then
        raise = math.min(durable, next)
      end
    end
    if #fresh > 0 then
      -- One replay entry and one message for all of them: their encodings back to back
      -- (docs/protocol.md), however many ticks the worker coalesced.
      local data = table.concat(fresh)
      redis.call('XADD', events, 'MAXLEN', '~', ARGV[5], '*', 'm', data)
      if durable < 0 or finishing then
        redis.call(publish, channel, data)
      end
    end
    if durable < 0 and state[4] and next ~= start then
      raise = next  -- a durable fleet's job, here plainly: what it publishes is its bound
    end
    if next ~= start and raise ~= nil then
      redis.call('HSET', hash, 'emitted', next, 'durable', raise)
    elseif next ~= start then
      redis.call('HSET', hash, 'emitted', next)
    elseif raise ~= nil then
      redis.call('HSET', hash, 'durable', raise)
    end
    if next ~= start then
      if start == 0 and not finishing then
        -- Set by the first event and again by the finish: refreshing it on every
        -- token would cost a command per event.
        redis.call('EXPIRE', events, ARGV[6])
      end
    end
    if gap then
      reply[j] = {'gap', next}
    elseif ends then
      local t = first + 2 * count
      terminal_writes({
        result = result, hash = hash, events = events, channel = channel, publish = publish,
        queued = queued, running = running, job_id = job,
        reason = ARGV[t], result_data = ARGV[t + 1], finish_data = ARGV[t + 2],
        result_ttl = ARGV[7], hash_ttl = ARGV[8], maxlen = ARGV[5], events_ttl = ARGV[6],
        announced = true,
      })
      ack_delete_entry(stream, entry)
      reply[j] = {'done', next}
    elseif redis.call('EXISTS', cancel) == 1 then
      reply[j] = {'cancel', next}
    else
      reply[j] = {'ok', next}
    end
  end
end
return reply
