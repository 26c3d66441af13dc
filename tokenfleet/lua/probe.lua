-- Run once by a worker at start: try every command the worker sends (its scripts run
-- with its own ACL rights) on throwaway keys under the fleet's prefix, and report the
-- ones its Redis user may not run, so a missing permission stops the worker at once
-- with the command named instead of failing mid-job.
--
-- KEYS and ARGV by name: tokenfleet/lua/calls.py ProbeCall (notation: lua/layout.py).
-- KEYS[1]  stream   probe stream
-- KEYS[2]  hash     probe hash
-- KEYS[3]  string   probe string
-- KEYS[4]  zset     probe sorted set
-- ARGV[1]  group    consumer group
-- ARGV[2]  worker   consumer
-- ARGV[3]  channel  a channel under the prefix
--
-- Reply: the names of the refused commands (empty when all may run). Errors other
-- than a refused permission (an out-of-memory Redis refusing XADD) are not reported.
local denied = {}
local function try(name, ...)
  local reply = redis.pcall(...)
  if type(reply) == 'table' and reply.err then
    local err = reply.err
    if string.find(err, "can't run this command", 1, true) or string.find(err, 'NOPERM', 1, true) then
      denied[#denied + 1] = name
    end
  end
  return reply
end
local id = try('xadd', 'XADD', KEYS[1], '*', 'probe', '1')
try('xgroup|create', 'XGROUP', 'CREATE', KEYS[1], ARGV[1], '0', 'MKSTREAM')
try('xreadgroup', 'XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', '1', 'STREAMS', KEYS[1], '>')
try('xpending', 'XPENDING', KEYS[1], ARGV[1], '-', '+', '1')
try('xinfo|consumers', 'XINFO', 'CONSUMERS', KEYS[1], ARGV[1])
try('xinfo|groups', 'XINFO', 'GROUPS', KEYS[1])
try('xrevrange', 'XREVRANGE', KEYS[1], '+', '-', 'COUNT', '1')
if type(id) ~= 'table' then
  try('xclaim', 'XCLAIM', KEYS[1], ARGV[1], ARGV[2], '0', id)
  try('xrange', 'XRANGE', KEYS[1], id, id)
  try('xack', 'XACK', KEYS[1], ARGV[1], id)
  try('xdel', 'XDEL', KEYS[1], id)
else
  try('xclaim', 'XCLAIM', KEYS[1], ARGV[1], ARGV[2], '0', '0-1')
  try('xrange', 'XRANGE', KEYS[1], '-', '+')
  try('xack', 'XACK', KEYS[1], ARGV[1], '0-1')
  try('xdel', 'XDEL', KEYS[1], '0-1')
end
try('xlen', 'XLEN', KEYS[1])
try('xgroup|delconsumer', 'XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
try('hset', 'HSET', KEYS[2], 'probe', '1')
try('hget', 'HGET', KEYS[2], 'probe')
try('hmget', 'HMGET', KEYS[2], 'probe')
try('expire', 'EXPIRE', KEYS[2], '10')
try('set', 'SET', KEYS[3], '1', 'EX', '10')
try('exists', 'EXISTS', KEYS[3])
try('zadd', 'ZADD', KEYS[4], '1', 'probe')
try('zscore', 'ZSCORE', KEYS[4], 'probe')
try('zcard', 'ZCARD', KEYS[4])
try('zrem', 'ZREM', KEYS[4], 'probe')
try('publish', 'PUBLISH', ARGV[3], 'probe')
try('del', 'DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4])
return denied
