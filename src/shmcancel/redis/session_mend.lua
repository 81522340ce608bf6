-- KEYS: sess, boxes, stopped. ARGV: P, payload, box_lease_ms, seen ("" : a key of another type,
-- else "=" .. the value read)
-- A session's copy no host can adopt (another client wrote over it) that a lookup met: deleted,
-- unless it changed since it was read (a holder stored it again meanwhile: returns -1), and
-- every holder's box is told to store the session again (the holder that minted or adopted it
-- holds its version and client). Returns how many boxes were told.
local kind = redis.call('TYPE', KEYS[1]).ok
if ARGV[4] == '' then
  if kind == 'string' or kind == 'none' then return -1 end
elseif kind ~= 'string' or '=' .. redis.call('GET', KEYS[1]) ~= ARGV[4] then
  return -1
end
redis.call('DEL', KEYS[1])
mend(KEYS[2], 'set')
mend(KEYS[3], 'zset')
local n = 0
for _, box in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  if not stopped_box(KEYS[3], box) then
    push_box(ARGV[1], box, ARGV[2], ARGV[3])
    n = n + 1
  end
end
return n
