-- Mark jobs running on this worker, without resurrecting expired ones.
--
-- KEYS     the job state hashes (keys.job(id)), one per job
-- ARGV[1]  this worker's name
-- ARGV[2]  now, unix seconds (started_at)
--
-- Reply: how many hashes were marked. A missing hash (expired, never submitted) is
-- left missing: HSET would create it without a TTL. A finished job stays finished.
local marked = 0
for i = 1, #KEYS do
  local status = redis.call('HGET', KEYS[i], 'status')
  if status and status ~= 'finished' then
    redis.call('HSET', KEYS[i], 'status', 'running', 'worker', ARGV[1], 'started_at', ARGV[2])
    marked = marked + 1
  end
end
return marked
