-- KEYS: sess, boxes, gone, stopped. ARGV: P, payload, box_lease_ms, own box, gone_ms
-- Ends a session everywhere: tells every other worker box that minted or adopted it (they delete
-- their host's copy), then forgets it, leaving `gone` for gone_ms: a holder that stores it
-- again meanwhile (its renewal racing this, an adoption between its lookup and its store, its
-- recovery after Redis lost the session and so the boxes to tell) is refused and ends its copy.
-- Returns how many boxes were told (a stopped holder's is not: nobody reads it, see stopped_box).
mend(KEYS[2], 'set')
mend(KEYS[4], 'zset')
local n = 0
for _, box in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  if box ~= ARGV[4] and not stopped_box(KEYS[4], box) then
    push_box(ARGV[1], box, ARGV[2], ARGV[3])
    n = n + 1
  end
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[1] .. ':mending')
redis.call('SET', KEYS[3], '1', 'PX', ARGV[5])
return n
