-- Count one more delivery of an entry this worker keeps, for an in-process retry.
-- Run with owned_entry.lua prepended (it documents KEYS[1] and ARGV[1..4]).
--
-- KEYS[1]  jobs stream
-- ARGV[1]  group  ARGV[2]  this worker  ARGV[3]  entry id  ARGV[4]  now (unused)
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
