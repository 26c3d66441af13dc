-- Accept one job into a capped jobs stream, atomically.
--
-- KEYS[1]  jobs stream            (keys.jobs(model))
-- KEYS[2]  the stream's cap       (keys.queue_cap(model)); absent = ARGV[3]
-- KEYS[3]  the job's state hash   (keys.job(job_id))
-- KEYS[4]  set of model names     (keys.models())
-- ARGV[1]  job id
-- ARGV[2]  payload (msgpack map, or JSON object text)
-- ARGV[3]  default cap, used when KEYS[2] is absent
-- ARGV[4]  now, unix seconds (the submit time recorded for queue-wait timings)
-- ARGV[5]  TTL of the state hash, seconds
-- ARGV[6]  model name (for KEYS[4])
--
-- Replies:
--   {"dup", entry_id, status}   the id was accepted before: nothing added (idempotent retry)
--   {"full", depth, cap}        the stream already holds cap jobs: nothing added (backpressure)
--   {"ok", entry_id}            added; XLEN of KEYS[1] counts it until a worker finishes it
--
-- Never XADD with MAXLEN/MINID here: trimming deletes jobs that were accepted.
local status = redis.call('HGET', KEYS[3], 'status')
if status then
  return {'dup', redis.call('HGET', KEYS[3], 'entry') or '', status}
end
local cap = tonumber(redis.call('GET', KEYS[2]) or ARGV[3]) or tonumber(ARGV[3])
local depth = redis.call('XLEN', KEYS[1])
if depth >= cap then
  return {'full', depth, cap}
end
local entry = redis.call('XADD', KEYS[1], '*', 'job_id', ARGV[1], 'payload', ARGV[2])
redis.call('HSET', KEYS[3], 'status', 'queued', 'stream', KEYS[1], 'entry', entry,
           'submitted_at', ARGV[4], 'model', ARGV[6])
redis.call('EXPIRE', KEYS[3], ARGV[5])
redis.call('SADD', KEYS[4], ARGV[6])
return {'ok', entry}
