-- KEYS: all, scopes. ARGV: P, last, limit. Looks at up to `limit` members with cancelled_at <= last
-- (the greatest at with now - at > ttl, store.last_expired) and removes their rows; returns
-- {rows removed, members looked at}. The caller repeats while `limit` members were looked at. A
-- member that names no row of ours goes from the index, not counted: one not of the member form,
-- one whose scope's rows keys hold another type (another client's write: removing it would fail
-- the script, at every sweep, for every scope's rows), one whose row is not there (left, it would
-- be looked at again by every sweep, and `limit` of them would hide every row behind them).
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
  elseif remove(ARGV[1], KEYS[1], KEYS[2], scope, rid) == 1 then
    n = n + 1
  else
    redis.call('ZREM', KEYS[1], m)  -- no such row
  end
end
return {n, #rows}
