-- KEYS: sess, boxes, gone, up. ARGV: P, payload, box_lease_ms, own box, gone_ms, box_gone_ms
-- Ends a session everywhere: tells every other worker box that minted or adopted it (they delete
-- their host's copy), then forgets it, leaving `gone` for gone_ms: a holder that stores it
-- again meanwhile (its renewal racing this, an adoption between its lookup and its store, its
-- recovery after Redis lost the session and so the boxes to tell) is refused and ends its copy.
-- Returns how many boxes were told (a holder gone, see gone_box, is not: nobody reads its box).
local n = 0
local now = redis_ms()
for _, box in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  if box ~= ARGV[4] and not gone_box(KEYS[4], box, now, tonumber(ARGV[6])) then
    push_box(ARGV[1], box, ARGV[2], ARGV[3])
    n = n + 1
  end
end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('SET', KEYS[3], '1', 'PX', ARGV[5])
return n
