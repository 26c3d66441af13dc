-- Take, renew or release a lease (the batch driver's), atomically.
--
-- KEYS and ARGV by name: tokenfleet/lua/calls.py LeaseCall (notation: lua/layout.py).
-- KEYS[1]  lease   the lease key (P batch:ID:lease)
-- ARGV[1]  owner   the driver's id
-- ARGV[2]  ms      lease, milliseconds
-- ARGV[3]  action  'take' (take or renew) or 'release'
--
-- Replies: 1 while ARGV[1] holds the lease (take) or it was released (release);
--          0 when someone else holds it.
local held = redis.call('GET', KEYS[1])
if ARGV[3] == 'release' then
  if held == ARGV[1] then
    redis.call('DEL', KEYS[1])
    return 1
  end
  return 0
end
if not held then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if held == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
