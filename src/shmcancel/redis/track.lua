-- KEYS: ifk, c, t, all, scopes, ifs (the scope's running ids). ARGV: P, scope, rid, owner, deadline_ms, now_ms, started_at
-- Adds a running request. A cancellation row older than the request, with no other request of
-- that key running, is not this request's: it goes (contract 4.3).
local ifk = KEYS[1]
if #live(ifk, ARGV[6]) == 0 then
  local at = redis.call('ZSCORE', KEYS[3], ARGV[3])
  if at and tonumber(at) < tonumber(ARGV[7]) then remove(ARGV[1], KEYS[4], KEYS[5], ARGV[2], ARGV[3]) end
end
-- The scope's running ids lose ids whose every owner's lease ran out (a worker killed, a host
-- died: their untrack never came) a few at a time, so that set stays bounded in a scope that
-- never falls idle (each track extends its life). SRANDMEMBER with a count returns the whole set
-- when it is that small.
for _, old in ipairs(redis.call('SRANDMEMBER', KEYS[6], 3)) do
  if old ~= ARGV[3] and not running(ARGV[1], ARGV[2], old, ARGV[6]) then
    redis.call('SREM', KEYS[6], old)
  end
end
redis.call('ZADD', ifk, ARGV[5], ARGV[4])
redis.call('SADD', KEYS[6], ARGV[3])
for _, k in ipairs({ifk, KEYS[6]}) do
  if redis.call('PEXPIRETIME', k) < tonumber(ARGV[5]) then redis.call('PEXPIREAT', k, ARGV[5]) end
end
return 1
