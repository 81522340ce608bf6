-- KEYS: sess, boxes. ARGV: P, payload, box_lease_ms, own box
-- Ends a session everywhere: tells every other worker box that minted or adopted it (they delete
-- their host's copy), then forgets it. Returns how many boxes were told.
local n = 0
for _, box in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  if box ~= ARGV[4] then
    redis.call('LPUSH', ARGV[1] .. 'box:' .. box, ARGV[2])
    redis.call('PEXPIRE', ARGV[1] .. 'box:' .. box, ARGV[3])
    n = n + 1
  end
end
redis.call('DEL', KEYS[1], KEYS[2])
return n
