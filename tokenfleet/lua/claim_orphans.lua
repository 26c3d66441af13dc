-- Claim pending entries of consumers whose worker is presumed dead (heartbeat hash gone).
-- The heartbeat check and the claim are one atomic step, so a live worker's entries are
-- never taken, however long they have been idle.
--
-- KEYS and ARGV by name: tokenfleet/lua/calls.py ClaimOrphansCall (notation: lua/layout.py).
-- KEYS[1]       stream             jobs stream
-- KEYS[2..n+1]  candidates[]       one key per candidate consumer i = 1..n:
-- KEYS[i+1]     candidates[].hash  its worker hash (keys.worker(name))
-- ARGV[1]       group              consumer group
-- ARGV[2]       worker             this worker (the new owner)
-- ARGV[3]       min_idle_ms        min idle, ms
-- ARGV[4]       most               most entries to claim in all
-- ARGV[5..n+4]  candidates[]       one arg per candidate consumer i:
-- ARGV[i+4]     candidates[].name  its consumer name
--
-- Reply: a list of {entry_id, delivery_count, fields}, fields a flat [f1, v1, ...] list.
--   Claimed entries are now pending to ARGV[2] (XCLAIM: delivery count + 1).
--   An entry whose data was deleted while pending cannot be claimed (7.0 XCLAIM drops
--   it): it is taken off the pending list and returned with no fields; the claimer
--   answers for it (dead_letter.lua's ARGV[11]).
-- A dead consumer left with no pending entries is deleted from the group.
local claimed = {}
local left = tonumber(ARGV[4])
for i = 2, #KEYS do
  if left <= 0 then
    break
  end
  local name = ARGV[3 + i]
  if name ~= ARGV[2] and redis.call('EXISTS', KEYS[i]) == 0 then
    local pending = redis.call('XPENDING', KEYS[1], ARGV[1], 'IDLE', ARGV[3], '-', '+', left, name)
    for _, p in ipairs(pending) do
      local id = p[1]
      if #redis.call('XRANGE', KEYS[1], id, id) == 0 then
        redis.call('XACK', KEYS[1], ARGV[1], id)
        claimed[#claimed + 1] = {id, p[4] + 1, {}}
      else
        -- Always claimed: the script is atomic and XPENDING IDLE already checked idle time.
        local got = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], id)
        local now = redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1)
        claimed[#claimed + 1] = {id, now[1][4], got[1][2]}
      end
      left = left - 1
    end
    if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, name) == 0 then
      redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], name)
    end
  end
end
return claimed
