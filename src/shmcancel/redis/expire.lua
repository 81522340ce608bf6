-- KEYS: all, scopes. ARGV: P, last, limit. Removes up to `limit` rows with cancelled_at <= last
-- (the greatest at with now - at > ttl, store.last_expired); returns how many went. The caller
-- repeats while the limit was reached. A member whose scope's rows keys hold another type (another
-- client's write: removing its row would fail the script, at every sweep, for every scope's rows)
-- names no row of ours: dropped, not counted, as one not of the member form.
local function ours(P, scope)
  local c, t = redis.call('TYPE', skey(P, scope, 'c')).ok, redis.call('TYPE', skey(P, scope, 't')).ok
  return (c == 'hash' or c == 'none') and (t == 'zset' or t == 'none')
end
local rows = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[2], 'LIMIT', 0, tonumber(ARGV[3]))
local n = 0
for _, m in ipairs(rows) do
  local scope, rid = unmember(m)
  if scope == nil or not ours(ARGV[1], scope) then
    redis.call('ZREM', KEYS[1], m)  -- not a row's member: dropped, not counted
  else
    n = n + remove(ARGV[1], KEYS[1], KEYS[2], scope, rid)
  end
end
return n
