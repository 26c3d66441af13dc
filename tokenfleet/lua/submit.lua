-- Accept one job into its band's capped jobs stream, atomically with its tenant's limit.
--
-- KEYS and ARGV by name: tokenfleet/lua/calls.py SubmitCall (notation: lua/layout.py).
-- KEYS[1]  stream          jobs stream of the job's band     P jobs:MODEL[@BAND]
-- KEYS[2]  cap             the model's cap (absent: ARGV[3])  P jobs:MODEL:cap
--                          Each band holds up to cap jobs.
-- KEYS[3]  hash            the job's state hash              P job:ID
-- KEYS[4]  models          set of model names                P models
-- KEYS[5]  queued          the tenant's queued jobs          P tenant:TENANT:queued:MODEL
-- KEYS[6]  limits          the tenant's limits               P tenant:TENANT:limits
-- KEYS[7]  default_limits  every tenant's default limits     P tenant:*:limits
-- KEYS[8]  tenants         set of tenant names               P tenants
-- ARGV[1]  job_id          job id
-- ARGV[2]  payload         msgpack map, or JSON object text
-- ARGV[3]  default_cap     used when KEYS[2] is absent (DEFAULT_QUEUE_CAP, 1000)
-- ARGV[4]  now             unix seconds (the submit time recorded for queue-wait timings)
-- ARGV[5]  hash_ttl        TTL of the state hash, seconds (JOB_STATE_TTL_S, 604800)
-- ARGV[6]  model           MODEL (for KEYS[4])
-- ARGV[7]  tenant          TENANT
-- ARGV[8]  band            BAND (recorded in the job hash)
--
-- Replies:
--   {"dup", entry_id, status}       the id was accepted before: nothing added (idempotent)
--   {"full", depth, cap}            the band's stream holds cap jobs: nothing added
--   {"tenant_full", queued, limit}  the tenant has `limit` jobs of this model queued (its
--                                   queued_share of the cap): nothing added
--   {"ok", entry_id}                added; XLEN of KEYS[1] counts it until it finishes
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
local share = tonumber(redis.call('HGET', KEYS[6], 'queued_share') or '')
  or tonumber(redis.call('HGET', KEYS[7], 'queued_share') or '')
if share then
  -- A member whose job state could have expired is stale: it can't hold a place.
  redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', tonumber(ARGV[4]) - tonumber(ARGV[5]))
  local limit = math.max(1, math.floor(share * cap))
  local queued = redis.call('ZCARD', KEYS[5])
  if queued >= limit then
    return {'tenant_full', queued, limit}
  end
end
local entry = redis.call('XADD', KEYS[1], '*', 'job_id', ARGV[1], 'payload', ARGV[2],
                         'tenant', ARGV[7])
redis.call('HSET', KEYS[3], 'status', 'queued', 'stream', KEYS[1], 'entry', entry,
           'submitted_at', ARGV[4], 'model', ARGV[6], 'tenant', ARGV[7], 'band', ARGV[8])
redis.call('EXPIRE', KEYS[3], ARGV[5])
redis.call('ZADD', KEYS[5], ARGV[4], ARGV[1])
redis.call('SADD', KEYS[4], ARGV[6])
redis.call('SADD', KEYS[8], ARGV[7])
return {'ok', entry}
