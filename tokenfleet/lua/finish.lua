-- Finish one job, only if this worker still owns its entry: the job's one terminal event.
-- Run with owned_entry.lua prepended (it documents KEYS[1] and ARGV[1..4]).
--
-- KEYS[1]  jobs stream
-- KEYS[2]  result string    KEYS[3]  job state hash    KEYS[4]  replay stream
-- ARGV[1]  group  ARGV[2]  this worker  ARGV[3]  entry id  ARGV[4]  now (unix s)
-- ARGV[5..12]  the terminal block, see terminal(): result, its TTL, finish reason,
--              job hash TTL, finish event, events maxlen, events TTL, live channel
--
-- Replies:
--   1  done: result stored, job hash finished, finish event appended and published,
--      entry acked and deleted
--   0  the entry is not pending to this worker (claimed by another, or already
--      finished): nothing written
if owner() ~= ARGV[2] then
  return 0
end
terminal(2, 5)
ack_delete()
return 1
