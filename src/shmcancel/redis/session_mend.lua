-- KEYS: sess, boxes, stopped, live, mending. ARGV: P, payload, box_lease_ms, seen ("" : a key
-- of another type, else "=" .. the value read), now_ms
-- A session's copy no host can adopt (another client wrote over it) that a lookup met: deleted,
-- unless it changed since it was read (a holder stored it again meanwhile: returns -1), and
-- every holder's box is told to store the session again (the holder that minted or adopted it
-- holds its version and client). When no listed holder is left to tell (they exited, or the
-- holders' set was written over too), every live box (up to LIVE_TOLD of them, newest first)
-- is told: a worker holding the session stores it, the others skip the item. `mending` is set
-- for a box lease meanwhile: a lookup finding no copy answers "retry later", not "no such
-- session". Returns how many boxes were told.
local LIVE_TOLD = 256
local kind = redis.call('TYPE', KEYS[1]).ok
if ARGV[4] == '' then
  if kind == 'string' or kind == 'none' then return -1 end
elseif kind ~= 'string' or '=' .. redis.call('GET', KEYS[1]) ~= ARGV[4] then
  return -1
end
redis.call('DEL', KEYS[1])
mend(KEYS[2], 'set')
mend(KEYS[3], 'zset')
mend(KEYS[4], 'zset')
mend(KEYS[5], 'string')
redis.call('SET', KEYS[5], '1', 'PX', ARGV[3])
local n = 0
for _, box in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  if not stopped_box(KEYS[3], box) then
    push_box(ARGV[1], box, ARGV[2], ARGV[3])
    n = n + 1
  end
end
if n > 0 then return n end
-- the live index keeps boxes whose alive key went (their worker exited) until they age out
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', '(' .. (tonumber(ARGV[5]) - LIVE_KEPT_MS))
for _, box in ipairs(redis.call('ZREVRANGE', KEYS[4], 0, LIVE_TOLD - 1)) do
  if redis.call('EXISTS', ARGV[1] .. 'alive:' .. box) == 1 and not stopped_box(KEYS[3], box) then
    push_box(ARGV[1], box, ARGV[2], ARGV[3])
    n = n + 1
  end
end
return n
