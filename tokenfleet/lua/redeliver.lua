-- Count one more delivery of an entry this worker keeps, for an in-process retry.
-- Run with owned_entry.lua prepended. KEYS and ARGV by name: tokenfleet/lua/calls.py
-- RedeliverCall (notation: lua/layout.py).
--
-- KEYS[1]  stream    jobs stream
-- ARGV[1]  group     consumer group
-- ARGV[2]  worker    this worker
-- ARGV[3]  entry_id  entry id
-- ARGV[4]  now       unix seconds (unused)
--
-- Reply: the entry's new delivery count (XCLAIM to itself: count + 1, idle reset), or
-- nil when it is not pending to this worker (claimed by another, finished), or when its
-- data was deleted (7.0's XCLAIM then drops it from the pending list: nothing to retry).
if owner() ~= ARGV[2] then
  return false
end
local got = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3])
if got[1] == nil then
  return false
end
return redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)[1][4]
