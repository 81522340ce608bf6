-- KEYS: c, t, all, scopes, ifk
-- ARGV: P, scope, rid, reason_enc, at, quota (-1: none), cap, batch, gate ("1": only in flight),
--       now_ms, box_lease_ms
-- Returns {0} not in flight, {-1} quota refused, {1, evicted} inserted, {2, 0} overwritten.
-- When gated, the cancellation is pushed to the box of every worker running the request.
local c, t, all, scopes, ifk = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local P, scope, rid, at = ARGV[1], ARGV[2], ARGV[3], ARGV[5]
local owners = {}
if ARGV[9] == '1' then
  owners = live(ifk, ARGV[10])
  if #owners == 0 then return {0} end
end
local result
if redis.call('HEXISTS', c, rid) == 1 then
  redis.call('HSET', c, rid, ARGV[4])
  redis.call('ZADD', t, at, rid)
  redis.call('ZADD', all, at, member(scope, rid))
  result = {2, 0}
else
  local quota = tonumber(ARGV[6])
  if quota >= 0 and redis.call('HLEN', c) >= quota then return {-1} end
  local evicted = 0
  if redis.call('ZCARD', all) >= tonumber(ARGV[7]) then
    evicted = evict(P, all, scopes, tonumber(ARGV[8]))
  end
  redis.call('HSET', c, rid, ARGV[4])
  redis.call('ZADD', t, at, rid)
  redis.call('ZADD', all, at, member(scope, rid))
  redis.call('ZINCRBY', scopes, 1, scope)
  result = {1, evicted}
end
local seen = {}
for _, owner in ipairs(owners) do
  local box = string.sub(owner, 1, string.find(owner, '\n', 1, true) - 1)
  if not seen[box] then
    seen[box] = true
    redis.call('LPUSH', P .. 'box:' .. box, cmsgpack.pack({scope, rid, ARGV[4]}))
    redis.call('PEXPIRE', P .. 'box:' .. box, ARGV[11])
  end
end
return result
